"""tests/test_cuda_host_processes.py's shapes in variants, one short table: which fix matters.

    python3 tools/gpu/host_processes_diag.py [--timeout 5] [--budget 90] [--only NAME ...]

after a CUDA build in place (exit 2 without a GPU or without NCCL headers). 2 spawned processes
hold 2 ranks of GPU 0 each (run_shape() of the test): 2 x 2 (each process an emulated host, NCCL
rails between them) and 1 x 4 (one node across both processes), each with the same-process issue
gate on and off (ExecutorOptions.issue_gate; fabric/fabric.h [Note: same-process issue gate]),
and the 2 x 2 shape also with every stream of a process in one hardware queue
(CUDA_DEVICE_MAX_CONNECTIONS=1). Each variant is bounded: the executors' deadline (--timeout, a
stuck wait is a TimeoutError), the driver's (--budget, then the processes are killed). Per
variant: the verdict (ok: bitwise the CPU virtual cluster; wrong; timeout: a rank's TimeoutError;
error; no answer: a process said nothing within the budget), seconds, the processes' exit codes
(0; -6: abort, e.g. std::terminate in teardown; -9: killed after the budget or a hung teardown)
and the first problem. Exit 1 when a gate-on variant is not ok. A healthy variant takes ~20 s, a
stuck one up to the budget plus 30 s (then its processes are killed): --only runs a subset.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = [  # name, (M, L), executor options, environment of the rank processes
    ("2x2 gate on", (2, 2), None, None),
    ("2x2 gate off", (2, 2), {"issue_gate": False}, None),
    ("2x2 gate on, 1 queue", (2, 2), None, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    ("2x2 gate off, 1 queue", (2, 2), {"issue_gate": False}, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    ("1x4 gate on (one node)", (1, 4), None, None),
    ("1x4 gate off (one node)", (1, 4), {"issue_gate": False}, None),
]


def _verdict(hp, shape, seed, calls, error):
    if error is not None:  # the exception's line when a process sent its traceback
        lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
        return "no answer", next((ln for ln in reversed(lines) if "Error" in ln), lines[0] if lines else "")
    bad = hp.problems(*shape, seed, calls)
    if not bad:
        return "ok", ""
    text = "\n".join(bad)
    kind = "timeout" if "TimeoutError" in text else "wrong" if "differs" in text else "error"
    first = next((ln.strip() for ln in text.splitlines() if "Error" in ln), bad[0].splitlines()[0])
    return kind, first


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=5.0, help="the executors' deadline, s (default 5)")
    ap.add_argument("--budget", type=float, default=90.0, help="each variant's driver deadline, s (default 90)")
    ap.add_argument("--only", nargs="*", default=None, help="variant names (substrings) to run")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    from tide import _core
    if not getattr(_core, "built_with_cuda", False) or _core.cuda.device_count() < 1:
        print("host_processes_diag: no CUDA build or no GPU", file=sys.stderr)
        return 2
    if not _core.cuda.nccl_header_version():
        print("host_processes_diag: tide._core was built without NCCL headers (no rails)", file=sys.stderr)
        return 2
    import test_cuda_host_processes as hp

    chosen = [v for v in VARIANTS if not args.only or any(o in v[0] for o in args.only)]
    print(f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset (driver default)')} "
          f"unless the variant sets it; executor timeout {args.timeout} s, budget {args.budget} s per variant",
          flush=True)
    rows, failed = [], False
    for name, shape, options, env in chosen:
        t0 = time.monotonic()
        seed, calls, codes, error = hp.run_shape(*shape, options=options, timeout_s=args.timeout, env=env,
                                                 budget_s=args.budget)
        verdict, first = _verdict(hp, shape, seed, calls, error)
        secs = time.monotonic() - t0
        rows.append((name, verdict, f"{secs:.1f}", ",".join(str(c) for c in codes), first[:150]))
        print(f"  {name}: {verdict} ({secs:.1f} s, exit codes {codes})", flush=True)
        if "gate on" in name and (verdict != "ok" or any(codes)):
            failed = True
    widths = [max(len(r[i]) for r in rows + [("variant", "verdict", "s", "exit", "first problem")]) for i in range(5)]
    print()
    for r in [("variant", "verdict", "s", "exit", "first problem")] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print("\nReading: gate on ok and gate off timeout -> the same-process issue gate is what matters; a timeout "
          "variant whose exit codes are 0 -> teardown after a timeout is clean (the late-work join); -6 there: "
          "it still aborts.")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
