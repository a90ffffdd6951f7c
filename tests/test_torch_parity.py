"""tide_torch vs stock FSDP2 on a tiny Llama, world 4 (2 nodes x 2 and 4 nodes x 1), 5 AdamW
steps with MixedPrecisionPolicy(bf16, fp32):

(a) identical data on every rank, so every gradient sum is exact in any order: final parameters
    and losses bitwise equal to stock FSDP2, for both modes;
(b) ordinary per-rank random data: within fp32 tolerance of stock;
(d) every unsharded parameter's data_ptr is its planned landing address;
(e) In-Place issues backward all-gathers ahead of the reduce-scatters, Slot-Reuse does not.

This file runs the default transport on 2 x 2 and on 1 x 4 (with a cast the all-gathers pull into
each rank's own landing on both, comm.py); test_torch_lane.py runs 4 x 1 (the L_sub = 1
lane) and test_torch_programs.py runs TIDE's own AG/RS programs.
"""
from __future__ import annotations

import torch

import tide
from _torch_dist import batches, build, local_shards, mesh_1d, spawn, train

STEPS = 5
BOTH_MODES = ((True, "in_place"), (True, "slot_reuse"), (False, "in_place"),
              (False, "slot_reuse"))


def parity(rank, world, nodes, gpn, transport="auto", cases=BOTH_MODES):
    import tide_torch
    topo = tide.Topology(nodes=nodes, gpus_per_node=gpn)
    mesh = mesh_1d()
    for exact in sorted({e for e, _ in cases}, reverse=True):
        data = batches(STEPS, same_on_all_ranks=exact)
        stock = build(mesh=mesh)
        stock_losses = train(stock, data)
        ref = local_shards(stock)
        for mode in [m for e, m in cases if e == exact]:
            model = build(mesh=mesh)
            handle = tide_torch.enable(model, mode=mode, topology=topo, transport=transport)
            losses = train(model, data)
            assert not handle.fallbacks, handle.fallbacks
            if transport == "auto":  # on CPU the default is TIDE's own process-mode executor
                assert handle.transport == "tide-executor", handle.transport
            assert handle.stats["ag_tide"] > 0 and handle.stats["rs_tide"] > 0, handle.stats
            assert handle.stats["rs_stock"] == 0 and handle.stats["ag_stock"] == 0, handle.stats
            # With a cast every TIDE-AG pulls into the rank's own landing, on one node and across
            # nodes (comm.py, [Note: pull landing]) ...
            pulls = handle.stats["ag_pull_chunks"]
            assert pulls >= handle.stats["ag_tide"], (nodes, handle.stats)
            # ... so no call waits for the peers' arrival (L = 1 too: no pushes at all): one
            # handshake per call.
            assert handle.stats["arrival_fences"] == 0, handle.stats
            sessions = handle._rt.transport._sessions  # the programs that ran: pulls, no pushes
            ops = [op for (_, which), sess in sessions.items() if which == "ag" or which.startswith("ag:")
                   for op in sess.programs("all_gather", 1, 1.0, False).describe(rank)]
            assert ops and any("tag=Pull" in o for o in ops), ops
            assert not any("Push" in o for o in ops), ops
            if nodes > 1:  # the rounds between nodes are the push program's
                assert any("tag=RoundTail" in o for o in ops), ops
            # In-Place issues the next backward all-gather ahead of the reduce-scatter
            # (runtime.py [Note: early backward all-gather]); Slot-Reuse cannot.
            early = handle.stats["ag_early"]
            assert (early > 0) if mode == "in_place" else (early == 0), (mode, handle.stats)
            got = local_shards(model)
            for name, t in ref.items():
                if exact:
                    assert torch.equal(got[name], t), (mode, name, (got[name] - t).abs().max())
                else:
                    torch.testing.assert_close(got[name], t, rtol=1e-4, atol=1e-5,
                                               msg=lambda m: f"{mode} {name}: {m}")
            if exact:
                assert losses == stock_losses, (mode, losses, stock_losses)
            # (d) zero-copy: unsharded parameters live at their planned landing addresses.
            landings = handle.landings()
            assert len(landings) == sum(1 for _ in model.parameters())
            for name, (planned, got_ptr) in landings.items():
                assert got_ptr == planned, (mode, name, planned, got_ptr)
            handle.disable()


def test_parity_2x2():
    spawn(parity, 2, 2)


def test_parity_one_node_pulls():
    """1 x 4: the all-gathers pull (one node, bf16 params from fp32 shards), bitwise = stock."""
    spawn(parity, 1, 4)

