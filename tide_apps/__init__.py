"""TIDE's applications: what uses the planner and a face (tide_torch, tide_xla) together.

The layers, arrows pointing down only: tide_apps -> tide_torch / tide_xla -> tide (the core).
`tide` imports no face and nothing from here; each face imports `tide` only.

  cli.py        the `tide` command: `tide plan` (tide.cli's), `tide demo`, `tide bench ...`
  demo.py       `tide demo`: the main job (virtual-cluster checks, FSDP2 training, the planner)
  demo_train.py the demo's training section: stock FSDP2 against tide_torch, bit for bit
  llama.py      the Llama-style model in torch and its FSDP2 training loop, written once: the
                demo, examples/fsdp2_llama.py (so `tide bench train`) and tests/_torch_dist.py
  llama_spec.py the model's sizes, weights, tokens and AdamW settings (numpy only), shared by
                examples/fsdp2_llama.py and its JAX twin examples/flax_fsdp.py
  bench/        `tide bench ag|rs|interference|train|layout|hostcall`

Importing tide_apps, its CLI, demo or benches loads no framework: torch and jax are imported
inside the functions that need them (llama.py and demo_train.py import torch at the top, and are
imported only when training runs).
"""
