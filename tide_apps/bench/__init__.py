"""Benchmarks (`tide bench ...`). Each module has a `main(argv)` entry point."""
