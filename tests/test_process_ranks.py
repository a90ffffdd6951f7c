"""A VirtualCluster's blocked call stops on Ctrl-C or a killed rank process, and its rank processes
die with their parent.

A parent killed with SIGKILL while its ranks wait inside a call (a stalled peer, a long deadline)
must not leave them spinning on the shared arena: every rank process is gone at once (the test
allows 5 s). The test fails without the parent-death signal (checked). Ctrl-C during a call blocked on a dead
peer (deadline 60 s) raises KeyboardInterrupt at once in both rank modes, and the next call on that
cluster is refused at once, naming the earlier failure.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("no_leaks")  # conftest.py: no segment, no child left

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import sys, numpy as np, tide
    topo = tide.Topology(1, 4)
    plan = tide.plan(tide.GroupSignature(shapes=[[64, 8]], names=["w"]), topo)
    vc = tide.VirtualCluster(topo, ranks_as="processes", timeout_s=60.0)
    vc.faults = dict(stall_rank=2, stall_op=1, stall_s=60.0)  # the call blocks for a minute
    shards = [[np.zeros((16, 8), np.float32)] for _ in range(4)]
    print("calling", flush=True)
    vc.all_gather(plan, shards)
""")


HELPERS_SRC = '''
def _children(pid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d))
    return out


def _alive(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has exited (its reaper may be slow)
'''


DRIVER = textwrap.dedent("""
    # The driver is a child subreaper (prctl PR_SET_CHILD_SUBREAPER): the ranks of the CHILD it
    # kills are reparented to it, not to an init that may reap or kill orphans on its own.
    import ctypes, os, signal, subprocess, sys, time
    from pathlib import Path
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    HELPERS
    p = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "calling"
    deadline, kids = time.time() + 20, []
    while time.time() < deadline and len(kids) < 4:
        time.sleep(0.2)
        kids = [k for k in _children(p.pid) if _alive(k)]
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    deadline = time.time() + 5
    while time.time() < deadline and any(_alive(k) for k in kids):
        time.sleep(0.1)
    left = [k for k in kids if _alive(k)]
    for k in left:
        os.kill(k, signal.SIGKILL)
    for k in kids:
        try:
            os.waitpid(k, 0)
        except ChildProcessError:
            pass
    print("ranks", len(kids), "left", left, flush=True)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_rank_processes_die_with_their_parent():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    driver = DRIVER.replace("HELPERS", HELPERS_SRC)
    out = subprocess.run([sys.executable, "-c", driver, CHILD], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "ranks 4 left []", out.stdout + out.stderr[-2000:]


INTERRUPTED = textwrap.dedent("""
    import sys, time, numpy as np, tide
    topo = tide.Topology(1, 4)
    plan = tide.plan(tide.GroupSignature(shapes=[[64, 8]], names=["w"]), topo)
    vc = tide.VirtualCluster(topo, ranks_as=sys.argv[1], timeout_s=60.0)
    shards = [[(np.arange(128, dtype=np.float32).reshape(16, 8) % 17) + r] for r in range(4)]
    vc.faults = dict(dead_rank=2, dead_op=1)  # its peers wait for it until the deadline
    print("calling", flush=True)
    t = time.time()
    try:
        vc.all_gather(plan, shards)
    except KeyboardInterrupt:
        print(f"KeyboardInterrupt after {time.time() - t:.2f} s", flush=True)
    vc.faults = {}
    try:  # the next call on the same cluster
        out = vc.all_gather(plan, shards)
        ok = all(np.array_equal(out[r][0].astype(np.float32), np.concatenate([s[0] for s in shards]))
                 for r in range(4))
        print("next call:", "exact" if ok else "WRONG", flush=True)
    except Exception as e:  # noqa: BLE001 - reported to the test
        print("next call:", type(e).__name__, str(e)[:300], flush=True)
""")


@pytest.mark.parametrize("ranks_as", ["threads", "processes"])
def test_ctrl_c_stops_a_blocked_call_at_once(ranks_as):
    import signal
    import time
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-c", INTERRUPTED, ranks_as], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "calling"
        time.sleep(1.0)
        os.kill(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=15)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    lines = out.strip().splitlines()  # after "calling"
    assert len(lines) == 2 and lines[0].startswith("KeyboardInterrupt after"), out + err[-2000:]
    assert float(lines[0].split()[2]) < 3.0, lines[0]  # the deadline was 60 s
    # The interrupted call left the arena mid-call: the next one is refused at once, saying why.
    assert lines[1].startswith("next call: Error") and "an earlier call failed" in lines[1], lines[1]
    assert "interrupted" in lines[1] and "seq 2" in lines[1], lines[1]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank processes in /proc")
def test_a_killed_rank_process_fails_the_call_at_once():
    """kill -9 of one rank process mid-call (its peers blocked behind a rank stalled for a minute,
    deadline 60 s): the parent fails the call at once, naming the process, its rank and the
    signal, every other rank stops, and no process or shared-memory segment is left (no_leaks)."""
    import signal
    import threading
    import time

    import numpy as np

    import tide
    ns: dict = {}
    exec(HELPERS_SRC, {"os": os, "Path": Path}, ns)
    me, before = os.getpid(), set(ns["_children"](os.getpid()))
    topo = tide.Topology(1, 4)
    plan = tide.plan(tide.GroupSignature(shapes=[[64, 8]], names=["w"]), topo)
    vc = tide.VirtualCluster(topo, ranks_as="processes", timeout_s=60.0)
    vc.faults = dict(stall_rank=2, stall_op=1, stall_s=60.0)
    killed: list = []

    def kill_one():
        deadline = time.time() + 20
        while time.time() < deadline:
            kids = sorted(k for k in ns["_children"](me) if k not in before and ns["_alive"](k))
            if len(kids) == 4:
                time.sleep(0.3)  # every rank inside the call
                os.kill(kids[0], signal.SIGKILL)
                killed.append(kids[0])
                return
            time.sleep(0.05)

    t = threading.Thread(target=kill_one)
    t.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(tide._core.Error) as ei:
            vc.all_gather(plan, [[np.zeros((16, 8), np.float32)] for _ in range(4)])
    finally:
        t.join()
    took = time.monotonic() - t0
    assert killed, "the rank processes never appeared"
    msg = str(ei.value)
    assert f"(pid {killed[0]}, rank " in msg and "killed by signal 9" in msg and "call seq 1" in msg, msg
    assert "every rank stopped" in msg and not isinstance(ei.value, tide.TimeoutError), msg
    assert took < 10, f"the call took {took:.1f} s (the peers waited for their deadline)"
