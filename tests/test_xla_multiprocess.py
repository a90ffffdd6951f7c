"""tide_xla across processes on XLA:CPU: jax.distributed on localhost, each process with its host
devices, the same programs through one CPU rank executor per device over shared memory.

Each test launches its processes itself (tests/_xla_mp_worker.py, a free port, short timeouts)
and compares their addressable shards bitwise with one process holding all 8 devices.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("jax")

from xla_mp_helpers import REPO, assert_same_shards, launch


def _launch(out_dir, processes: int, devices: int, case: str, topology: str | None = None):
    """The worker as `processes` processes of `devices` host devices each (XLA:CPU)."""
    env = dict(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return launch(out_dir, processes, case, topology, env)


_REFERENCE = {}


def _reference(tmp_path_factory, topology):
    """One process holding all 8 devices: every rank's shards."""
    if topology not in _REFERENCE:
        res = _launch(tmp_path_factory.mktemp("ref"), 1, 8, "run", topology)
        rc, data, err = res[0]
        assert rc == 0 and data is not None, err
        _REFERENCE[topology] = data
    return _REFERENCE[topology]


@pytest.mark.parametrize("processes,devices,topology", [
    (2, 4, None),      # 2 processes x 4 devices, one node of 8 ranks
    (4, 2, "2x4"),     # 4 processes x 2 devices, 2 nodes x 4
    (4, 2, "4x2"),     # 4 processes x 2 devices, 4 nodes x 2
])
def test_processes_equal_one_process_bitwise(tmp_path, tmp_path_factory, processes, devices,
                                             topology):
    """TIDE-AG forward, the AG+RS gradient and RS with scale and an accumulator: every
    process's shards are bitwise the one-process run's."""
    ref = _reference(tmp_path_factory, topology)
    assert_same_shards(_launch(tmp_path, processes, devices, "run", topology), ref)


def test_release_frees_every_process_states_and_refuses_later_calls(tmp_path, tmp_path_factory):
    """2 processes x 4 devices: the run's shards, then tide_xla.release on every process leaves no
    state, the compiled gather is refused naming tide_xla.release, and after init again a fresh
    trace gathers the same bits (tests/_xla_mp_worker.py, case "release"); no process reports
    nanobind leaks at exit."""
    ref = _reference(tmp_path_factory, None)
    res = _launch(tmp_path, 2, 4, "release")
    assert_same_shards(res, ref)
    for i, (_, _, log) in res.items():
        assert "leaked" not in log, f"process {i}: {log}"


def test_a_process_with_another_model_fails_on_every_process_naming_it(tmp_path):
    """Process 1 groups the same parameters into one TIDE call: every process raises at trace
    time, naming which processes have which call, before anything runs (no hang)."""
    res = _launch(tmp_path, 2, 4, "other_model")
    for i, (rc, _, err) in res.items():
        assert rc != 0, f"process {i} succeeded"
        assert "ValueError: tide_xla: cross-process call #0: the processes of the mesh disagree" in err, err
        assert "process 0: tide_all_gather of 1 parameter(s) [(37, 8)] float32 -> bfloat16" in err, err
        assert "process 1: tide_all_gather of 3 parameter(s) [(37, 8), (16,), (5, 3)]" in err, err


@pytest.mark.parametrize("devices,topology", [((2, 3), None), ((1, 1, 2), None), ((3, 1), "1x4")])
def test_uneven_processes_are_named_on_every_process(tmp_path, devices, topology):
    """Issue 45: 2 + 3 devices gave JAX's "cannot reshape array of size 5 into shape (2,2)";
    tide_xla.init names each process's device count, on every process (any topology)."""
    env = dict(JAX_PLATFORMS="cpu")
    res = launch(tmp_path, len(devices), "run", topology, env, per_process=lambda i: {
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices[i]}"})
    each = ", ".join(f"process {p}: {c} device{'s' if c != 1 else ''}" for p, c in enumerate(devices))
    for i, (rc, _, err) in res.items():
        assert rc != 0, f"process {i} succeeded"
        assert (f"ValueError: tide_xla.init: the job's {sum(devices)} devices are split unevenly "
                f"over its {len(devices)} processes ({each})") in err, err
        assert "cannot reshape" not in err, err


def test_no_room_in_dev_shm_on_one_process_fails_every_process_naming_it(tmp_path):
    """Process 1's /dev/shm cannot hold its segments: the shortfall rides in the call's agreement,
    so every process raises before any segment exists, naming process 1 (no hang, no SIGBUS)."""
    res = _launch(tmp_path, 2, 4, "no_shm")
    for i, (rc, _, err) in res.items():
        assert rc != 0, f"process {i} succeeded"
        assert "PlanError: tide_xla: cross-process call #0" in err and "not enough shared memory" in err, err
        assert "process 1: its 4 segment(s) need" in err and "bytes of /dev/shm, 4096 free" in err, err
        assert "process 0:" not in err.split("not enough shared memory")[1], err


def test_a_process_that_never_calls_times_out_naming_it(tmp_path):
    """The last process never calls: the others fail after the context's timeout (3 s), naming
    it, instead of waiting forever."""
    res = _launch(tmp_path, 2, 4, "skip")
    rc, _, err = res[0]
    assert rc != 0
    assert "TimeoutError" in err and "waited 3 s for processes [1]" in err, err
    assert res[1][0] == 0, res[1][2]


def test_a_process_that_traces_but_never_runs_times_out_naming_its_ranks(tmp_path):
    """The last process compiles the gather but never runs it: the other's ranks time out in the
    rank executor after 3 s (DEADLINE_EXCEEDED), naming the rank waited for and which process
    holds which ranks."""
    res = _launch(tmp_path, 2, 4, "no_run")
    rc, _, err = res[0]
    assert rc != 0
    assert "DEADLINE_EXCEEDED: tide_all_gather: TIDE timeout after 3 s" in err, err
    assert "ranks 0-3 on process 0, ranks 4-7 on process 1" in err, err
    assert res[1][0] == 0, res[1][2]


EXAMPLE = os.path.join(REPO, "examples", "flax_fsdp.py")


def _example(tmp_path, processes: int, check: bool = False) -> tuple[dict, str]:
    """The example's --json and its stdout; `check`: with its own one-process check."""
    out = tmp_path / f"flax_{processes}.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, EXAMPLE, "--steps", "3", "--runs", "tide_xla", "--processes",
                        str(processes), "--json", str(out), *([] if check else ["--no-check"])],
                       env=env, capture_output=True, text=True, timeout=360 if check else 240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(out.read_text()), r.stdout


@pytest.fixture(scope="module")
def flax_one_process(tmp_path_factory):
    return _example(tmp_path_factory.mktemp("flax"), 1)[0]


@pytest.mark.parametrize("processes", [2, 4])
def test_flax_example_across_processes_ends_bitwise_equal(tmp_path, flax_one_process, processes):
    """examples/flax_fsdp.py --processes N: the tiny Llama's 3 AdamW steps through
    tide_xla end with the same parameter bytes as one process holding the 8 devices."""
    one = flax_one_process
    many, stdout = _example(tmp_path, processes, check=processes == 2)
    if processes == 2:  # the example's own check, printed (and gloo's connection lines dropped)
        assert ("parameter bytes after 3 steps, tide_xla: 2 processes vs 1 process: bitwise "
                "equal") in stdout, stdout[-2000:]
        assert "[Gloo]" not in stdout
    assert one["world"] == many["world"] == 8
    a, b = one["runs"][0], many["runs"][0]
    assert a["name"] == b["name"] == "tide_xla" and len(b["losses"]) == 3
    assert a["params_sha256"] == b["params_sha256"]
    # The printed loss is XLA's pmean across processes (another summation order): close, not
    # necessarily bitwise; the parameters above are TIDE's.
    assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) < 1e-5


def test_cuda_takes_several_ranks_of_one_node_per_process_and_refuses_two_nodes():
    """On CUDA a process may hold several ranks of its node (one process per host: their arenas by
    pointer) or one rank of each; ranks of two nodes of one group in one process are refused at
    trace time naming them (a node is a host; their rail would have both ends in the process)."""
    from types import SimpleNamespace

    from tide_xla import processes
    # (process, device id, local device, group, rank) rows of a 2 x 2 topology over 2 processes
    rows = lambda owners, group=lambda r: 0: tuple(v for r, p in enumerate(owners)  # noqa: E731
                                                   for v in (p, r, 0, group(r), r % 4))
    for owners in ([0, 0, 1, 1], [0, 1, 2, 3], [0, 0, 1, 2], [0, 1, 2, 2]):
        processes._check_cuda_slots(SimpleNamespace(device_table=rows(owners), gpus_per_node=2, nodes=2), "ag")
    # fsdp x data: process 0 holds node 0 of group 0 and node 0 of group 1
    processes._check_cuda_slots(SimpleNamespace(device_table=rows([0, 0, 1, 1, 0, 0, 1, 1], lambda r: r // 4),
                                                gpus_per_node=2, nodes=2), "ag")
    for owners, match in (([0, 1, 1, 0], "process 0 holds rank 0 of node 0 and rank 3 of node 1"),
                          ([0, 1, 0, 1], "process 0 holds rank 0 of node 0 and rank 2 of node 1")):
        ctx = SimpleNamespace(device_table=rows(owners), gpus_per_node=2, nodes=2)
        with pytest.raises(NotImplementedError, match=match + r" \(group 0, topology 2x2\)"):
            processes._check_cuda_slots(ctx, "tide_all_gather")
