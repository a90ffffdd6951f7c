"""Launching tests/_xla_mp_worker.py as jax.distributed processes (tests/test_xla_multiprocess.py
on XLA:CPU, tests/test_xla_gpu_processes.py on one GPU shared by the processes)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "_xla_mp_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(out_dir, processes: int, case: str, topology: str | None, env: dict,
           per_process=None, wait_s: float = 50.0, worker: str = WORKER):
    """Runs `worker` (the same command line as tests/_xla_mp_worker.py's) as `processes` processes
    with `env` on top of ours (`per_process(i)`: more variables for process i); returns
    {process: (returncode, results npz or None, error text)}.
    A launch that takes longer than `wait_s` (a healthy one takes seconds) fails the test."""
    os.makedirs(out_dir, exist_ok=True)
    base = dict(os.environ, **env, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    port = str(free_port())
    args = [case] + ([topology] if topology else [])
    procs = [subprocess.Popen([sys.executable, worker, str(out_dir), str(i), str(processes), port, *args],
                              env=dict(base, **(per_process(i) if per_process else {})),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for i in range(processes)]
    deadline = time.monotonic() + wait_s
    logs = {}
    try:
        for i, p in enumerate(procs):
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            logs[i] = out.decode(errors="replace")
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{processes} processes ({case}, {env}) did not finish in {wait_s:g} s")
    res = {}
    for i, p in enumerate(procs):
        npz = os.path.join(out_dir, f"p{i}.npz")
        err = os.path.join(out_dir, f"p{i}.err")
        text = open(err).read() if os.path.exists(err) else ""
        res[i] = (p.returncode, dict(np.load(npz)) if os.path.exists(npz) else None, text or logs[i][-3000:])
    return res


def assert_same_shards(res: dict, ref: dict) -> None:
    """Every process succeeded, each shard it holds is bitwise the reference's, and together they
    hold every shard of the reference."""
    seen = set()
    for i, (rc, data, err) in res.items():
        assert rc == 0 and data is not None, f"process {i}: {err}"
        for key, value in data.items():
            assert key in ref, key
            assert np.array_equal(value, ref[key]), f"process {i}: {key} differs"
            seen.add(key)
    assert seen == set(ref), sorted(set(ref) - seen)
