"""Repeats one flaky GPU test to catch a rare hang (tools/gpu/run.py's `hang` stage).

    python3 tools/gpu/hang.py [--reps 6] [--dump-after 20] [--timeout 240] [--test NODEID]

The test's own hang deadline is TIDE_TEST_HANG_S (the runner sets 30 s unless the caller set it):
past it the test sends SIGUSR1 to the stuck rank processes (Python stacks on stderr; pytest -s
keeps them in the log). Before it (--dump-after seconds into a run; a passing run takes ~10 s)
this records each rank process's thread states, syscalls and, where gdb or eu-stack exists,
native stacks, then sends each SIGUSR2 (tide._core's native stack dump, stackdump.cc). A failed
run's whole log is printed, with tide._core's frames resolved by addr2line. Summary last; exit 1
when any run failed. Rank processes are this script's own descendants (multiprocessing.spawn).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

DEFAULT_TEST = "tests/test_cuda_ipc.py::test_peer_that_never_runs_is_a_timeout_naming_rank_op_seq[True]"


def descendants(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(d) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            kids.setdefault(int(fields[1]), []).append(int(d.split("/")[2]))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def read(path: str, limit: int = 4096) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace")
    except OSError:
        return ""


def rank_processes(root: int) -> list[int]:
    return [p for p in descendants(root) if "multiprocessing.spawn" in read(f"/proc/{p}/cmdline").replace("\0", " ")]


def native(pids: list[int]) -> str:
    """Thread states and stacks of the rank processes."""
    lines = []
    for p in pids:
        lines.append(f"---- pid {p}: {read(f'/proc/{p}/cmdline').replace(chr(0), ' ')[:120]}")
        for t in sorted(glob.glob(f"/proc/{p}/task/*"), key=lambda s: int(s.rsplit("/", 1)[1])):
            tid = t.rsplit("/", 1)[1]
            wchan = read(f"{t}/wchan")
            if "futex_do_wait" in wchan and tid != str(p):
                continue  # idle pool threads
            stat = read(f"{t}/stat").split()
            sysc = " ".join(read(f"{t}/syscall").split()[:3])
            lines.append(f"  tid {tid} {' '.join(stat[1:3])} wchan {wchan} syscall {sysc}")
        lines += read(f"/proc/{p}/task/{p}/stack").splitlines()[:12]
        if shutil.which("gdb"):
            cmd = ["gdb", "-p", str(p), "-batch", "-ex", "thread apply all bt 25"]
            keep = re.compile(r"^#|^Thread")
        elif shutil.which("eu-stack"):
            cmd, keep = ["eu-stack", "-p", str(p)], re.compile("")
        else:
            lines.append("  (no gdb or eu-stack on this machine)")
            continue
        try:
            got = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
        except subprocess.TimeoutExpired:
            got = "  (stack tool timed out)"
        lines += [ln for ln in got.splitlines() if keep.search(ln)][:120]
    return "\n".join(lines) + "\n"


def core_frames(text: str) -> str:
    """tide._core frames of the SIGUSR2 dumps -> function names (addr2line)."""
    so = sorted(glob.glob("tide/_core*.so"))
    if not so or not shutil.which("addr2line"):
        return ""
    addrs = sorted(set(re.findall(r"_core[^ ]*\.so\(\+(0x[0-9a-f]+)\)", text)))
    out = ["==== tide._core frames"]
    for a in addrs:
        r = subprocess.run(["addr2line", "-Cfpe", so[0], a], capture_output=True, text=True)
        out.append(f"{a} {(r.stdout.splitlines() or [''])[0][:160]}")
    return "\n".join(out) + "\n"


def one_run(test: str, dump_after: float, timeout: float, log_path: str) -> tuple[int, float]:
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", test],
                             stdout=log, stderr=subprocess.STDOUT)
        dumped = False
        while p.poll() is None:
            time.sleep(1)
            el = time.monotonic() - t0
            if el > timeout:
                for k in descendants(p.pid):
                    os.kill(k, signal.SIGKILL)
                p.kill()
                log.write(f"\n==== hang.py: run killed at its {timeout:.0f} s limit\n")
                break
            if not dumped and el > dump_after:
                dumped = True
                kids = rank_processes(p.pid)
                log.write(f"==== {time.strftime('%H:%M:%S', time.gmtime())} still running after {el:.0f} s; "
                          f"rank processes: {' '.join(map(str, kids))}\n")
                log.write(native(kids))
                log.flush()
                for k in kids:  # native stacks (tide._core's SIGUSR2 handler)
                    try:
                        os.kill(k, signal.SIGUSR2)
                    except ProcessLookupError:
                        pass
                    time.sleep(0.3)
        rc = p.wait()
    return rc, time.monotonic() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--test", default=DEFAULT_TEST, help="pytest node id")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--dump-after", type=float, default=20.0, help="seconds into a run before the stack dumps")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per run")
    a = ap.parse_args(argv)
    hang_s = os.environ.get("TIDE_TEST_HANG_S", "120 (the test's default)")
    fails, times = 0, []
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "hang_run.log")
        for i in range(1, a.reps + 1):
            rc, secs = one_run(a.test, a.dump_after, a.timeout, log_path)
            times.append(f"{secs:.0f}")
            print(f"run {i}: rc {rc}, {secs:.0f} s", flush=True)
            if rc != 0:
                fails += 1
                text = read(log_path, 1 << 24)
                print(f"==== failed run {i}: its whole log\n{text}{core_frames(text)}==== end of run {i}", flush=True)
    print(f"\n== hang: {a.test} x {a.reps} (hang report after {hang_s} s)")
    print(f"passed {a.reps - fails}, failed {fails}; seconds per run: {' '.join(times)}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
