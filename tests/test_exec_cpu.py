"""CPU executor: arena accounting, canaries, timeouts, tracing, shared-memory hygiene."""
import os
import subprocess
import sys

import numpy as np
import pytest

import tide
from tide import _core
from ag_helpers import SHAPES, make_fulls, make_plan, reference, same_bits, shard


def test_arena_bytes_per_rank_match_the_layout():
    topo, plan = make_plan(5, 2)
    vc = tide.VirtualCluster(topo)
    vc.all_gather(plan, shard(make_fulls(SHAPES, "int", 0), plan, 10))
    arena = vc.arena(plan)
    progs = _core.build_ag_programs(plan)
    assert arena.bytes_per_rank == progs.arena_bytes()
    K = _core.buf_kinds
    NS = plan.layout.S * 10
    assert arena.region_bytes(K["ring0"]) == NS and arena.region_bytes(K["ring1"]) == NS
    assert arena.region_bytes(K["stage"]) == _core.plan_ag(plan).stage_bytes == 4 * plan.layout.S
    assert arena.region_bytes(K["resident"]) == plan.layout.S


@pytest.mark.parametrize("ranks_as", ["threads", "processes"])
def test_canary_damage_is_reported(ranks_as):
    topo, plan = make_plan(2, 2)
    vc = tide.VirtualCluster(topo, ranks_as=ranks_as)
    shards = shard(make_fulls(SHAPES, "int", 1), plan, 4)
    vc.all_gather(plan, shards)
    vc.arena(plan).poke_guard(3)
    with pytest.raises(_core.Error, match="corruption: rank 3"):
        vc.all_gather(plan, shards)


def test_timeout_names_rank_op_seq_and_counter():
    topo, plan = make_plan(2, 1)
    vc = tide.VirtualCluster(topo, timeout_s=0.2)
    vc.faults = dict(dead_rank=1, dead_op=0)
    with pytest.raises(tide.TimeoutError, match=r"rank 0 .*call seq 1.*op \d+ WAIT .*(HEAD|TAIL)\[0\].*producer: rank 1"):
        vc.all_gather(plan, shard(make_fulls(SHAPES, "int", 2), plan, 2))


def test_trace_behind_tide_debug():
    code = ("import sys; sys.path.insert(0, 'tests'); import tide; from ag_helpers import *\n"
            "topo, plan = make_plan(2, 1)\n"
            "tide.VirtualCluster(topo).all_gather(plan, shard(make_fulls(SHAPES, 'int', 0), plan, 2))\n")
    env = dict(os.environ, TIDE_DEBUG="1", PYTHONPATH=".")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "[tide] rank 1 (node 1, local 0) call seq 1 group 0: op" in out.stderr
    assert " PUT [stream caller]" in out.stderr
    env["TIDE_DEBUG"] = "0"
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert "[tide]" not in quiet.stderr


def test_processes_leave_no_shared_memory_segment():
    before = set(os.listdir("/dev/shm"))
    topo, plan = make_plan(3, 2)
    vc = tide.VirtualCluster(topo, ranks_as="processes")
    fulls = make_fulls(SHAPES, "normal", 3)
    out = vc.all_gather(plan, shard(fulls, plan, 6))
    assert all(same_bits(out[r][p], reference(fulls)[p]) for r in range(6) for p in range(3))
    leaked = [n for n in set(os.listdir("/dev/shm")) - before if n.startswith("tide-vc")]
    assert not leaked


def test_user_buffers_of_other_ranks_are_refused():
    # The executor enforces the push rule independently of the checker.
    topo, plan = make_plan(2, 1)
    vc = tide.VirtualCluster(topo, check=False)
    fulls = make_fulls(SHAPES, "int", 4)
    vc.all_gather(plan, shard(fulls, plan, 2), resident=False)
    progs = _core.build_ag_programs(plan, resident=False)
    with pytest.raises(_core.Error, match="is not bound"):
        vc.run(plan, [[(progs, 2)], [(progs, 2)]], [[], []])


def test_workers_do_not_change_bytes():
    topo, plan = make_plan(4, 4)
    fulls = make_fulls(SHAPES, "normal", 5)
    outs = [tide.VirtualCluster(topo, workers=w).all_gather(plan, shard(fulls, plan, 16)) for w in (1, 3)]
    assert all(same_bits(outs[0][r][p], outs[1][r][p]) for r in range(16) for p in range(3))


def test_arena_matches_the_planners_memory_model_when_present():
    topo, plan = make_plan(3, 2, shard_dtype=None)
    if not hasattr(plan, "memory"):
        pytest.skip("this planner build has no memory model yet")
    mem = plan.memory()
    vc = tide.VirtualCluster(topo)
    vc.all_gather(plan, shard(make_fulls(SHAPES, "int", 6), plan, 6))
    arena = vc.arena(plan)
    assert arena.bytes_per_rank == mem["arena_bytes"]
    for reg in mem["arena"]:
        if reg["name"] in _core.buf_kinds:
            assert arena.region_bytes(_core.buf_kinds[reg["name"]]) == reg["bytes"], reg


def test_put_checksum_reports_bytes_changed_before_consumption():
    plan = make_plan(1, 2, shapes=[(8, 4)])[1]
    W = 16
    ring = lambda r, off: ("ring0", r, -1, off, W)  # noqa: E731
    spec = [
        dict(streams=["caller"], num_counters=2, ops=[
            dict(kind="PUT", stream=0, copies=[(("resident", 0, -1, 0, W), ring(1, 0))], counter=(1, 0), value=1),
            dict(kind="COPY", stream=0, copies=[(("resident", 0, -1, W, W), ring(1, 0))]),  # rogue overwrite
        ]),
        dict(streams=["caller"], num_counters=2, ops=[
            dict(kind="WAIT", stream=0, counter=(1, 0), value=0, per_call=1, tag=_core.op_tags["ArrivalWait"]),
        ]),
    ]
    progs = _core.program_set_from_spec(plan, spec)
    arena = _core.CpuArena(2, progs)
    arena.write(0, _core.buf_kinds["resident"], 0, np.arange(2 * W, dtype=np.uint8))
    with pytest.raises(_core.Error, match=r"corruption: rank 1 .* op 0 WAIT .*rank 0 op 0 PUT"):
        arena.run([[(progs, 1)], [(progs, 1)]], [[], []], timeout_s=5, workers=1)  # rank 0 steps first
    spec[0]["ops"].pop()  # without the rogue write the same run is clean
    clean = _core.program_set_from_spec(plan, spec)
    arena2 = _core.CpuArena(2, clean)
    arena2.run([[(clean, 1)], [(clean, 1)]], [[], []], timeout_s=5, workers=1)
