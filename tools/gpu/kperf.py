"""Kernel attributes, registers and spills (tools/gpu/run.py's `kperf` stage).

    python3 tools/gpu/kperf.py [BUILD_LOG ...]     # the first that exists; default build/build.log

Two sources: ptxas -v in the build log (every kernel nvcc compiled: registers, spill stores and
loads, stack frame; CMakeLists.txt passes -Xptxas=-v) and, on a CUDA build with a GPU, the loaded
module (tide._core.cuda.kernel_attrs(): registers and local memory of the SUM/REDUCE kernels
as the driver reports them). Prints a table; the last line is "N kernels, M spills (ptxas); ...".
Exit 1 when a kernel spills or neither source has anything.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

ENTRY = re.compile(r"Compiling entry function '([^']+)'")
PROPS = re.compile(r"Function properties for (\S+)")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
REGS = re.compile(r"Used (\d+) registers")


def ptxas(text: str) -> list[dict]:
    """One dict per compiled entry function: name, regs, stack, spill_stores, spill_loads."""
    kernels: dict[str, dict] = {}
    props: dict[str, tuple[int, int, int]] = {}
    cur = last = None
    for line in text.splitlines():
        if m := ENTRY.search(line):
            cur = m.group(1)
            kernels.setdefault(cur, dict(name=cur, regs=0, stack=0, spill_stores=0, spill_loads=0))
        elif m := PROPS.search(line):
            last = m.group(1)
        elif m := FRAME.search(line):
            if last:
                props[last] = tuple(int(x) for x in m.groups())
        elif (m := REGS.search(line)) and cur:
            kernels[cur]["regs"] = int(m.group(1))
    for k in kernels.values():
        k["stack"], k["spill_stores"], k["spill_loads"] = props.get(k["name"], (0, 0, 0))
    return list(kernels.values())


def demangle(names: list[str]) -> list[str]:
    if not names or not shutil.which("c++filt"):
        return names
    r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    out = r.stdout.splitlines()
    return out if len(out) == len(names) else names


def main(argv=None) -> int:
    logs = (argv if argv is not None else sys.argv[1:]) or ["build/build.log"]
    log = next((p for p in logs if os.path.exists(p)), None)
    ks = []
    if log:
        with open(log, errors="replace") as f:
            ks = ptxas(f.read())
    print(f"# ptxas: {len(ks)} kernels in {log or 'no build log (' + ', '.join(logs) + ')'}")
    for k, name in sorted(zip(ks, demangle([k["name"] for k in ks])), key=lambda x: -x[0]["regs"])[:15]:
        print(f"  {k['regs']:4d} regs {k['stack']:5d} B stack {k['spill_stores']:4d}/{k['spill_loads']:<4d} B spill"
              f"  {name[:90]}")
    spilled = [k for k in ks if k["spill_stores"] or k["spill_loads"]]
    for k, name in zip(spilled, demangle([k["name"] for k in spilled])):
        print(f"SPILL {k['spill_stores']} B stores / {k['spill_loads']} B loads: {name[:110]}")
    loaded = ""
    try:
        from tide import _core
        if _core.cuda.available():
            attrs = _core.cuda.kernel_attrs()
            local = [a["name"] for a in attrs if a["local_bytes"]]
            for a in attrs:
                print(f"# loaded {a['name']:28} {a['regs']:4d} regs {a['local_bytes']:5d} B local "
                      f"{a['static_smem']:6d} B static smem")
            loaded = f"; {len(attrs)} loaded SUM/REDUCE kernels, {len(local)} with local memory"
            spilled += local
        else:
            loaded = "; loaded kernels: no CUDA device or no CUDA build"
    except Exception as e:  # noqa: BLE001 - an unbuilt core is reported, not raised
        loaded = f"; loaded kernels: {type(e).__name__}: {e}"
    print(f"{len(ks)} kernels, {sum(1 for k in ks if k['spill_stores'] or k['spill_loads'])} spills (ptxas){loaded}")
    return 1 if spilled or not (ks or "loaded SUM" in loaded) else 0


if __name__ == "__main__":
    sys.exit(main())
