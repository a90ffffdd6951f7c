"""`tide` command line: `tide plan`, `tide demo` (later issues add `tide bench`)."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tide", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("plan", help="plan a parameter group and print the memory model")
    sub.add_parser("demo", help="the main job")
    args, rest = ap.parse_known_args(argv)
    from tide import plan as _plan, Topology, GroupSignature
    p = _plan(GroupSignature(shapes=[(8192, 8192)]), Topology(8, 8))
    print(f"plan hash {p.hash:#x} S={p.layout.S}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
