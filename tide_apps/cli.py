"""The `tide` command: `tide plan` (tide.cli's, reused), `tide demo` and
`tide bench ag|rs|interference|train|layout|hostcall`.

The console script `tide` (pyproject.toml [project.scripts]; `make` writes .venv/bin/tide) and
`python -m tide_apps` run main(). The demo and the benches are imported only when their command
runs, so `tide plan` loads no framework.
"""
from __future__ import annotations

import argparse
import sys

from tide import cli as plan_cli


def _cmd_demo(args: argparse.Namespace) -> int:
    from tide_apps import demo
    if args.steps < 2:
        print("tide demo: error: --steps must be >= 2 (step 1 is the profiled one)",
              file=sys.stderr)
        return 2
    return demo.main(device=args.device, train_steps=None if args.no_train else args.steps)


def _cmd_bench(which: str, rest: list[str]) -> int:
    if which in ("ag", "rs"):
        from tide_apps.bench import collectives
        return collectives.main(rest, op=which) or 0
    if which == "interference":
        from tide_apps.bench import interference
        return interference.main(rest) or 0
    if which == "train":
        from tide_apps.bench import train
        return train.main(rest) or 0
    if which == "hostcall":
        from tide_apps.bench import hostcall
        return hostcall.main(rest) or 0
    from tide_apps.bench import layout
    return layout.main(rest) or 0


BENCHES = {
    "ag": "TIDE-AG vs the stock all-gather: latency table (paper Table 7)",
    "rs": "TIDE-RS vs the stock reduce-scatter: latency table (paper Table 8)",
    "interference": "a victim kernel's slowdown next to each collective (Tables 4, 6)",
    "train": "examples/ trained side by side: step time, memory, loss",
    "layout": "one GPU, N virtual ranks: where TIDE-AG lands each shard",
    "hostcall": "host time per call of tide_torch's CUDA path",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tide", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    plan_cli.add_plan_command(sub)
    dp = sub.add_parser("demo", help="the main job: TIDE-AG/RS on a virtual cluster, checked; "
                        "FSDP2 training with and without TIDE, checked bit for bit; the "
                        "planner's view of Llama-3.1-70B on 8x8 GPUs")
    dp.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="where the training section runs (auto: the GPUs when the GPU path "
                         "can run, else 2 nodes x 2 gloo processes on the CPU)")
    dp.add_argument("--steps", type=int, default=4, help="AdamW steps per training run")
    dp.add_argument("--no-train", action="store_true", help="skip the training section")
    # add_help=False: `tide bench ag --help` is the bench's own help; `tide bench --help` (no
    # bench named) prints this parser's, the list of benches.
    bp = sub.add_parser("bench", help="benchmarks: TIDE and the stock path side by side",
                        add_help=False, usage="tide bench BENCH [its flags]",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        description="benches (`tide bench BENCH --help`: its flags):\n"
                        + "\n".join(f"  {name:<13} {what}" for name, what in BENCHES.items()))
    bp.add_argument("which", nargs="?", choices=list(BENCHES), metavar="BENCH",
                    help="one of " + ", ".join(BENCHES))
    args, rest = ap.parse_known_args(argv)
    if args.cmd == "bench":
        if args.which is None:
            if rest and rest[0] in ("-h", "--help"):
                bp.print_help()
                return 0
            bp.error("name a bench: one of " + ", ".join(BENCHES)
                     + (f" (got {rest[0]!r})" if rest else "")
                     + "; `tide bench BENCH --help` for its flags")
        return _cmd_bench(args.which, rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "plan":
        return args.run(args)
    return _cmd_demo(args)


if __name__ == "__main__":
    sys.exit(main())
