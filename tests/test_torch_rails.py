"""tide_torch across nodes over two-sided rails (4 gloo processes as 2 nodes x 2 and 4 x 1): each
rank maps only its own node's arena segments, every byte to another node travels over the gloo
rail, and training is bitwise equal to stock FSDP2 on exact-sum data (both modes, and HSDP with
shard groups that span the nodes); one-sided rails stay available on one host."""
from __future__ import annotations

import re

import torch

import tide
from _torch_dist import assert_same, batches, build, local_shards, mesh_1d, spawn, train

STEPS = 4


def _isolated(handle, rank, topo):
    """Rank `rank` maps exactly its own node's segments; its sessions run two-sided programs."""
    ex = handle._rt.transport.rank_executor
    L = topo.gpus_per_node
    for r in range(topo.world):
        mapped = ex.segment_address(r) != 0
        assert mapped == (r // L == rank // L), (rank, r, mapped)
    sessions = handle._rt.transport._sessions
    assert sessions
    for (_, which), s in sessions.items():
        kind = "all_gather" if which == "ag" else "reduce_scatter"
        assert s.programs(kind, 1).rails == "two_sided"


def _rails(rank, world, nodes, gpn):
    import tide_torch
    topo = tide.Topology(nodes=nodes, gpus_per_node=gpn)
    mesh = mesh_1d()
    data = batches(STEPS, same_on_all_ranks=True)
    stock = build(mesh=mesh)
    stock_losses = train(stock, data)
    ref = local_shards(stock)
    for mode in ("in_place", "slot_reuse"):
        model = build(mesh=mesh)
        handle = tide_torch.enable(model, mode=mode, topology=topo)
        assert handle.rails == "two_sided" and not handle.fallbacks, (handle.rails, handle.fallbacks)
        losses = train(model, data)
        _isolated(handle, rank, topo)
        assert handle.stats["ag_tide"] > 0 and handle.stats["rs_tide"] > 0, handle.stats
        got = local_shards(model)
        for name, t in ref.items():
            assert torch.equal(got[name], t), (mode, name, (got[name] - t).abs().max())
        assert losses == stock_losses
        handle.disable()
    # One-sided rails on one host: every rank maps every segment, same bits.
    model = build(mesh=mesh)
    handle = tide_torch.enable(model, topology=topo, rails="one_sided")
    assert handle.rails == "one_sided" and not handle.fallbacks
    train(model, data)
    ex = handle._rt.transport.rank_executor
    assert all(ex.segment_address(r) != 0 for r in range(topo.world))
    assert_same(model, stock, "one_sided")
    handle.disable()


def _hsdp_across_nodes(rank, world):
    import tide_torch
    from torch.distributed.device_mesh import DeviceMesh
    topo = tide.Topology(nodes=2, gpus_per_node=2)
    # Shard groups {0, 2} and {1, 3}: each spans both nodes (2 x 1 plans over the rail);
    # the replica groups {0, 1} and {2, 3} stay inside a node (stock all-reduce).
    mesh = DeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]), mesh_dim_names=("replicate", "shard"))
    data = batches(STEPS, same_on_all_ranks=True)
    stock = build(mesh=mesh)
    train(stock, data)
    model = build(mesh=mesh)
    handle = tide_torch.enable(model, topology=topo)
    assert not handle.fallbacks, handle.fallbacks
    assert all(p.nodes == 2 and p.gpus_per_node == 1 for p in handle.plans.values())
    train(model, data)
    _isolated(handle, rank, topo)
    assert_same(model, stock, "hsdp across nodes")
    handle.disable()


def test_rails_2x2():
    spawn(_rails, 2, 2)


def test_rails_4x1():
    spawn(_rails, 4, 1)


def test_hsdp_shard_groups_across_nodes():
    spawn(_hsdp_across_nodes)


def _hosts_that_cannot_be_served(rank, world):
    import sys

    import tide_torch
    enable_mod = sys.modules["tide_torch.enable"]  # the module (tide_torch.enable is the function)
    mesh = mesh_1d()
    data = batches(2, same_on_all_ranks=True)
    stock = build(mesh=mesh)
    train(stock, data)
    enable_mod.host_identity = lambda: f"host-{rank // 2}"  # two hosts of two ranks each
    try:
        # One topology node over both hosts: its ranks cannot map each other's arenas.
        model = build(mesh=mesh)
        handle = tide_torch.enable(model, topology=tide.Topology(1, 4))
        assert handle.fallbacks and not handle.plans, handle.fallbacks
        assert all("topology node 0" in why and "host" in why for why in handle.fallbacks.values())
        train(model, data)  # stock collectives: the same bits
        assert_same(model, stock, "fallback on a node split over hosts")
        handle.disable()
        # One-sided rails across hosts: refused the same way; two-sided serves it.
        model = build(mesh=mesh)
        handle = tide_torch.enable(model, topology=tide.Topology(2, 2), rails="one_sided")
        assert handle.fallbacks and all("one-sided rails" in w for w in handle.fallbacks.values())
        handle.disable()
        model = build(mesh=mesh)
        handle = tide_torch.enable(model, topology=tide.Topology(2, 2))
        assert not handle.fallbacks and handle.rails == "two_sided"
        train(model, data)
        assert_same(model, stock, "two hosts, two-sided")
        handle.disable()
    finally:
        enable_mod.host_identity = sys.modules["tide.ranks"].host_identity


def test_hosts_recorded_at_enable_decide_what_is_served():
    spawn(_hosts_that_cannot_be_served)


def _a_peer_that_stops(rank, world):
    import os
    import time

    import tide_torch
    mesh = mesh_1d()
    data = batches(1, same_on_all_ranks=True)
    model = build(mesh=mesh)
    handle = tide_torch.enable(model, topology=tide.Topology(2, 2),
                               executor_options=tide.ExecutorOptions(timeout_s=2.0))
    assert handle.rails == "two_sided"
    if rank == 3:  # stops before its first collective (dead as far as its peers can tell)
        time.sleep(8)
        os._exit(0)
    t0 = time.monotonic()
    try:
        train(model, data)
    except tide.TimeoutError as e:
        waited = time.monotonic() - t0
        msg = str(e)
        assert waited < 2.0 + 4, waited
        assert re.search(r"rank \d .*call seq 1", msg), msg
        assert "rail group" in msg or "waits for counter" in msg or "entry fence" in msg, msg
        # Each survivor names a peer as the root, never itself. The AG pulls (a cast, [Note: pull
        # landing]): the dead rank's rail peer (rank 1) and its node peer (rank 2) name rank 3;
        # rank 0 waits for the round area rank 1 pulls it from, and rank 1 has started the call
        # (its fence says so), so the survivors' diagnosis (posted roots) takes it on to rank 3.
        assert not re.search(rf"root: rank {rank}\b", msg) and "runs in its own process" not in msg, msg
        if rank == 0:
            assert "rank 1 has started run #1" in msg, msg
        else:
            assert re.search(r"rank 3 (never posted|is behind)", msg), msg
        diagnosis = msg.split("survivors' diagnosis: ", 1)[-1]
        assert "survivors' diagnosis: " in msg and diagnosis.endswith(
            "rank 3 stopped (it posted no timeout diagnosis: dead, hung outside TIDE, or it never made this call)"), msg
        if rank == 0:
            assert diagnosis.startswith("rank 1 (timed out, waits for rank 3) -> rank 3 stopped"), msg
        os._exit(0)  # fail-stop: the process ends (gloo transfers to the dead peer stay posted)
    raise AssertionError(f"rank {rank}: training went on without rank 3")


def test_a_peer_that_stops_fails_every_survivor_within_the_timeout():
    spawn(_a_peer_that_stops)


def _ctrl_c_while_a_peer_is_gone(rank, world):
    import os
    import signal
    import threading
    import time

    import tide_torch
    model = build(mesh=mesh_1d())
    data = batches(1, same_on_all_ranks=True)
    tide_torch.enable(model, topology=tide.Topology(1, 2), executor_options=tide.ExecutorOptions(timeout_s=30.0))
    if rank == 1:  # never reaches its first collective while rank 0 waits
        time.sleep(6)
        os._exit(0)
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        train(model, data)
    except KeyboardInterrupt:
        waited = time.monotonic() - t0
        assert waited < 4.0, waited  # the deadline was 30 s
        os._exit(0)  # the process group is broken (rank 1 is gone): leave at once
    raise AssertionError("rank 0: training went on without rank 1")


def test_ctrl_c_stops_a_rank_blocked_on_a_gone_peer():
    """The CPU rank executor (tide_torch's transport) polls Python's signals while a call waits:
    Ctrl-C ends a call blocked on a peer within about a second, not at its 30 s deadline."""
    spawn(_ctrl_c_while_a_peer_is_gone, world=2)
