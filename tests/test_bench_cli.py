"""`tide bench ag|rs|interference|train` on the CPU emulation (tiny sizes), their checks and
tables; the CUDA runners and multi-device cluster on a GPU (marked gpu)."""
from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from tide_apps import cli  # noqa: E402
from tide_apps.bench import collectives as coll  # noqa: E402
from tide_apps.bench import common  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
TINY = ["--context", "cpu", "--reps", "2", "--warmup", "1"]


def _run(capsys, args):
    rc = cli.main(["bench"] + args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _png_ok(path):
    with open(path, "rb") as f:
        head = f.read(8)
    return head == PNG and os.path.getsize(path) > 1000


# ---- helpers the tables rest on ------------------------------------------------------------
def test_group_shapes_total_and_rows():
    for shard, P, N in ((32 << 20, 30, 8), (1 << 16, 16, 4), (1 << 20, 7, 3)):
        shapes = common.group_shapes(shard, P, N, 2)
        assert len(shapes) == P
        assert all(D % N == 0 for D, _ in shapes)  # no parameter padded
        total = sum(D * K for D, K in shapes) * 2
        assert abs(total - N * shard) / (N * shard) < 0.15, (shard, P, N, total)
    with pytest.raises(ValueError, match="P >= 1"):
        common.group_shapes(1 << 20, 0, 8, 2)


def test_bw_columns_match_nccl_tests():
    c = common.bw_columns(8 << 30, 10.0, 8)  # 8 GiB in 10 ms over 8 ranks
    assert c["algbw"] == pytest.approx((8 << 30) / 1e-2 / 1e9)
    assert c["busbw"] == pytest.approx(c["algbw"] * 7 / 8)


def test_ag_check_catches_a_corrupted_landing():
    shapes = [(8, 4), (4, 6)]
    N = 4
    shards = coll._make_shards(torch, shapes, N, "cpu")
    full = [[torch.cat([shards[u][p] for u in range(N)])[:D].clone() for p, (D, _) in enumerate(shapes)]
            for _ in range(N)]
    assert coll._check_ag(torch, shapes, shards, full, [0, N - 1]) == "bitwise"
    full[N - 1][1][3, 2] = float("nan")
    assert "rank 3 param 1" in coll._check_ag(torch, shapes, shards, full, [0, N - 1])


@pytest.mark.slow  # two spawned ranks import torch: ~35 s per op on a small CPU machine
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_stock_process_group_orchestration_on_gloo(op):
    """The >= 2 GPU stock rows' machinery (spawned ranks, per-rep max over ranks, SymmMem
    fallback agreed by every rank) on gloo CPU processes."""
    shapes = [(8, 16), (4, 8)]
    times, notes, E = coll._stock_nccl(op, shapes, 2, 3, 1, backend="gloo")
    assert E == 4 * 16 + 2 * 8
    bare = "bare NCCL AG (pre-packed)" if op == "ag" else "bare NCCL RS fp32 (pre-packed)"
    assert set(times) == {coll.STOCK, bare}
    assert all(len(ts) == 3 and min(ts) > 0 for ts in times.values())
    (name, note), = notes.items()
    assert name.startswith(coll.SYMM) and note.startswith("not available")


def test_collect_reports_a_dead_worker():
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=os._exit, args=(3,))
    p.start()
    with pytest.raises(RuntimeError, match="worker 0 exited with 3 before reporting"):
        common.collect([p], q, 1, 30)


# ---- the benches on the CPU emulation -------------------------------------------------------
def test_bench_ag_cpu(capsys, tmp_path):
    j, png = tmp_path / "ag.json", tmp_path / "ag.png"
    rc, out, err = _run(capsys, ["ag", "--sizes", "0.03125", "--params", "6", "--json", str(j), "--plot", str(png)]
                        + TINY)
    assert rc == 0, err
    assert "EMULATION (CPU)" in out
    for head in ("min ms", "med ms", "buffer/GPU", "algbw", "busbw", "vs stock"):
        assert head in out
    assert "ag 0.03125 MiB" in err  # progress lines go to stderr
    res = json.loads(j.read_text())
    assert res["context"] == "cpu" and res["P"] == 6 and res["world"] == 4
    rows = {r["path"]: r for r in res["rows"]}
    tide_row = rows["TIDE-AG (1 node x 4)"]
    assert tide_row["check"] == "bitwise"  # TIDE's landing equals FSDP2's copy-out bit for bit
    stock = rows["FSDP2 stock"]
    for r in (tide_row, stock):
        assert 0 < r["min_ms"] <= r["med_ms"]
        assert r["busbw"] == pytest.approx(r["algbw"] * 3 / 4)
    assert stock["vs_stock"] == pytest.approx(1.0)
    assert tide_row["vs_stock"] == pytest.approx(stock["med_ms"] / tide_row["med_ms"])
    assert rows["FSDP2+SymmMem"]["note"].startswith("not available")
    assert stock["extra_bytes"] == 4 * tide_row["E"] * 2  # the rank-major AG output, bf16
    assert any(t["target"].startswith("AG >= 1.2x") for t in res["targets"])
    assert _png_ok(png)


def test_bench_rs_cpu(capsys, tmp_path):
    j, png = tmp_path / "rs.json", tmp_path / "rs.png"
    rc, out, err = _run(capsys, ["rs", "--sizes", "0.03125", "--params", "5", "--json", str(j), "--plot", str(png)]
                        + TINY)
    assert rc == 0, err
    assert "EMULATION (CPU)" in out and "TIDE-RS (1 node x 4)" in out
    res = json.loads(j.read_text())
    rows = {r["path"]: r for r in res["rows"]}
    t = rows["TIDE-RS (1 node x 4)"]
    assert t["rel_err"] < 1e-5  # against an fp32 reference of the averaged gradients
    assert t["extra_bytes"] > 0 and rows["FSDP2 stock"]["extra_bytes"] > 0
    assert {x["target"] for x in res["targets"]} >= {"RS >= 1.4x FSDP2 stock",
                                                    "RS >= 1.0x bare RS fp32 (pre-packed)"}
    assert _png_ok(png)


def test_bench_rs_on_node_splits(capsys, tmp_path):
    """--topologies: one TIDE row per node split of the N ranks (rails, waves on the emulation)."""
    j = tmp_path / "rs.json"
    rc, out, err = _run(capsys, ["rs", "--sizes", "0.03125", "--params", "3", "--topologies", "1x4,2x2,4x1",
                                 "--json", str(j)] + TINY)
    assert rc == 0, err
    rows = {r["path"]: r for r in json.loads(j.read_text())["rows"]}
    for name in ("TIDE-RS (1 node x 4)", "TIDE-RS (2 nodes x 2)", "TIDE-RS (4 nodes x 1)"):
        assert rows[name]["rel_err"] < 1e-5, (name, rows[name])
    with pytest.raises(SystemExit, match="3x2 has 6 ranks, this run has N = 4"):
        _run(capsys, ["rs", "--sizes", "0.03125", "--topologies", "1x4,3x2"] + TINY)


def test_bench_interference_nccl_cta_limits_are_parsed():
    """--nccl-ctas (Table 4's NCCL <= 8 / <= 4 CTA rows): parsed, a bad value is refused early."""
    from tide_apps.bench.interference import _nccl_ctas
    assert _nccl_ctas("default,8,4") == [None, 8, 4]
    assert _nccl_ctas(None) == [None]
    with pytest.raises(SystemExit, match="'0' is neither"):
        _nccl_ctas("default,0")


def test_bench_interference_cpu(capsys, tmp_path):
    j, png = tmp_path / "i.json", tmp_path / "i.png"
    rc, out, err = _run(capsys, ["interference", "--shard", "0.03125", "--json", str(j), "--plot", str(png)]
                        + TINY)
    assert rc == 0, err
    assert "EMULATION (CPU)" in out and "slow one-wave" in out
    res = json.loads(j.read_text())
    names = [r["config"] for r in res["rows"]]
    assert names[:3] == ["TIDE-RS, training (16+4)", "TIDE-RS, 4+4", "TIDE-AG"]
    assert any(n.startswith("RS FSDP2 stock") for n in names) and any(n.startswith("AG FSDP2 stock") for n in names)
    for r in res["rows"]:
        assert r["alone_ms"] > 0
        for v in ("one-wave GEMM", "28-wave GEMM", "elementwise 256 MiB"):
            assert isinstance(r[f"slow:{v}"], float)
    assert res["target"]["emulation"] is True
    assert _png_ok(png)


def test_bench_rejects_a_gpu_context_without_a_gpu(capsys):
    from tide import _core
    if _core.cuda.available():
        pytest.skip("this machine has a GPU")
    rc, _, err = _run(capsys, ["ag", "--context", "gpu1"])
    assert rc == 2 and "--context gpu1: no usable CUDA GPU" in err


def test_ce_proof_needs_a_gpu(capsys):
    from tide import _core
    if _core.cuda.available():
        pytest.skip("this machine has a GPU")
    rc, _, err = _run(capsys, ["ag", "--ce-proof"])
    assert rc == 2 and "needs a CUDA GPU" in err


# ---- train ---------------------------------------------------------------------------------
FAKE = """
import argparse, json
ap = argparse.ArgumentParser()
ap.add_argument("--json")
ap.add_argument("--device", default="cpu")
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--size", default="tiny")
ap.add_argument("--seed", type=int, default=0)
a, _ = ap.parse_known_args()
runs = [dict(name=n, step_ms=ms, peak_bytes=pk, final_loss=fl, losses=[5.0] * (a.steps - 1) + [fl],
             layout_copies=cp) for n, ms, pk, fl, cp in RUNS]
print("training", a.steps, "steps")
model = dict(size=a.size, seed=a.seed, global_batch=16, seq=32, parameters=PARAMS)
json.dump(dict(framework=FW, device=a.device, world=4, model=model, runs=runs), open(a.json, "w"))
"""


def _fake(tmp_path, name, fw, runs, params=1000):
    p = tmp_path / name
    p.write_text(f"FW = {fw!r}\nRUNS = {runs!r}\nPARAMS = {params!r}\n" + textwrap.dedent(FAKE))
    return str(p)


def _copies(**ops):
    return {op: dict(calls=1 if b else 0, bytes=b) for op, b in ops.items()}


def test_bench_train_tabulates_examples(capsys, tmp_path):
    stock = _copies(ag_in=100, ag_out=800, rs_pack=1600)
    t = _fake(tmp_path, "t.py", "torch", [("stock", 20.0, 1000, 2.5, stock),
                                          ("tide_in_place", 16.0, 800, 2.5, _copies(ag_in=0, ag_out=0, rs_pack=0)),
                                          ("tide_slot_reuse", 18.0, 700, 2.4, _copies(ag_in=0, ag_out=0, rs_pack=600))])
    x = _fake(tmp_path, "x.py", "jax", [("gspmd", 30.0, None, 3.0, None),
                                        ("tide_xla", 15.0, None, 3.0, {"landing": dict(calls=2, bytes=64)})])
    j, png = tmp_path / "t.json", tmp_path / "t.png"
    rc, out, err = _run(capsys, ["train", "--context", "cpu", "--torch-example", t, "--jax-example", x,
                                 "--steps", "2", "--warmup", "1", "--json", str(j), "--plot", str(png)])
    assert rc == 0, err
    assert "[torch] training 2 steps" in err  # the example's output streams as progress
    assert "--size tiny --steps 2 --warmup 1 --seed 0" in err  # the same arguments to both examples
    res = json.loads(j.read_text())
    assert res["same_model"] is True and "same model, weights and tokens in every framework: yes" in out
    rows = {(r["framework"], r["run"]): r for r in res["rows"]}
    assert rows[("torch", "tide_in_place")]["speedup"] == pytest.approx(20.0 / 16.0)
    assert rows[("torch", "tide_slot_reuse")]["mem_ratio"] == pytest.approx(1000 / 700)
    assert rows[("torch", "tide_slot_reuse")]["loss_diff"] == pytest.approx(-0.1)
    assert rows[("torch", "tide_slot_reuse")]["max_dloss"] == pytest.approx(0.1)
    assert rows[("torch", "stock")]["steps"] == 2
    assert rows[("torch", "tide_in_place")]["copies_removed"] == 2500
    assert rows[("torch", "tide_slot_reuse")]["copies_removed"] == 1900
    assert rows[("jax", "tide_xla")]["speedup"] == pytest.approx(2.0)
    assert rows[("jax", "tide_xla")]["mem_ratio"] is None  # no peak memory reported
    assert rows[("jax", "tide_xla")]["copies"] == "n/a; own 64 B"  # gspmd's are not counted
    assert rows[("jax", "gspmd")]["copies"] == "baseline"
    # step 1 against torch's stock run: both 5.0 here
    assert rows[("jax", "gspmd")]["x_rel1"] == 0.0
    assert "tide_slot_reuse" in out and "vs base" in out and "copies removed" in out
    assert "loss per step" in out and "jax/tide_xla" in out
    assert _png_ok(png)


def test_bench_train_flags_different_models(capsys, tmp_path):
    t = _fake(tmp_path, "t.py", "torch", [("stock", 20.0, 1000, 2.5, None)], params=1000)
    x = _fake(tmp_path, "x.py", "jax", [("gspmd", 30.0, None, 3.0, None)], params=999)
    rc, out, _ = _run(capsys, ["train", "--context", "cpu", "--torch-example", t, "--jax-example", x,
                               "--steps", "2"])
    assert rc == 1
    assert "same model, weights and tokens in every framework: NO" in out and "parameters (1000 vs 999)" in out


@pytest.mark.parametrize("args, msg", [(["--steps", "0"], "--steps must be >= 1"),
                                       (["--steps", "3", "--warmup", "3"], "--warmup 3 leaves no timed step"),
                                       (["--frameworks", "torch,mxnet"], "--frameworks: unknown"),
                                       (["--size", "70b"], "--size: invalid choice"),
                                       (["--world", "0"], "--world must be >= 1")])
def test_bench_train_rejects_bad_arguments(capsys, args, msg):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "train", "--context", "cpu"] + args)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_bench_train_reports_missing_json_and_bad_output(capsys, tmp_path):
    old = tmp_path / "old.py"
    old.write_text("import argparse\nargparse.ArgumentParser().parse_args()\n")
    bad = _fake(tmp_path, "bad.py", "jax", [("gspmd", 30.0, None, 3.0, None)])
    text = open(bad).read().replace("losses=[5.0] * (a.steps - 1) + [fl]", "losses=None")
    open(bad, "w").write(text)
    j = tmp_path / "t.json"
    rc, out, _ = _run(capsys, ["train", "--context", "cpu", "--torch-example", str(old), "--jax-example", bad,
                               "--json", str(j)])
    assert rc == 1
    notes = {r["framework"]: r["note"] for r in json.loads(j.read_text())["rows"]}
    assert "has no --json option (older checkout)" in notes["torch"]
    assert "runs[0].losses" in notes["jax"]


def test_bench_train_real_examples_tiny(capsys, tmp_path):
    """Both real examples on the tiny Llama (one block), 2 gloo ranks and 2 XLA:CPU devices, from
    the same weights and tokens: step-1 losses agree across frameworks (measured within 3e-5
    relative; bf16 kernels differ), TIDE's torch runs equal stock bit for bit and remove every
    FSDP2 layout copy, tide_xla's losses stay within 5e-4 of GSPMD's (measured 1e-4), and
    tide_xla adds no landing copy (one node, fp32 shards: TIDE-AG pulls into XLA's results)."""
    j, png = tmp_path / "t.json", tmp_path / "t.png"
    one_block = "--layers 1"
    rc, out, err = _run(capsys, ["train", "--context", "cpu", "--timeout", "240", "--world", "2", "--steps", "3",
                                 "--warmup", "1", "--batch", "2", "--seq", "16", "--torch-args", one_block,
                                 "--jax-args", one_block, "--json", str(j), "--plot", str(png)])
    res = json.loads(j.read_text())
    assert rc == 0, err
    assert res["same_model"] is True
    rows = {(r["framework"], r["run"]): r for r in res["rows"]}
    assert set(rows) == {("torch", "stock"), ("torch", "tide_in_place"), ("torch", "tide_slot_reuse"),
                         ("jax", "gspmd"), ("jax", "tide_xla")}
    assert all(r["step_ms"] > 0 and r["steps"] == 3 for r in rows.values())
    assert all(abs(r["x_rel1"]) < 3e-4 for r in rows.values()), {k: r["x_rel1"] for k, r in rows.items()}
    stock = next(r for x in res["results"] if x["framework"] == "torch" for r in x["runs"] if r["name"] == "stock")
    assert sum(c["bytes"] for c in stock["layout_copies"].values()) > 0
    for mode in ("tide_in_place", "tide_slot_reuse"):
        assert rows[("torch", mode)]["max_dloss"] == 0.0
        assert rows[("torch", mode)]["copy_bytes"] == 0
        assert rows[("torch", mode)]["copies_removed"] == sum(c["bytes"] for c in stock["layout_copies"].values())
    assert rows[("jax", "tide_xla")]["max_dloss"] < 5e-4
    assert rows[("jax", "tide_xla")]["copy_bytes"] == 0
    assert _png_ok(png)


# ---- GPU: runners and the multi-device cluster ---------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("devices", [[0], [0, 1]])
def test_cuda_runners_repeat_the_collectives(devices):
    import tide
    from tide import _core
    if len(devices) > _core.cuda.device_count():
        pytest.skip(f"needs {len(devices)} GPUs")
    N = 4
    shapes = [(24, 40), (8, 16), (12, 8)]
    topo = tide.Topology(1, N)
    plan = tide.plan(tide.GroupSignature(shapes=shapes), topo)
    vc = tide.VirtualCluster(topo, backend="cuda", devices=devices)
    shards = [[s.to(f"cuda:{vc.device_of(r)}") for s in row]
              for r, row in enumerate(coll._make_shards(torch, shapes, N, "cpu"))]
    full, go, landing = vc.all_gather_runner(plan, shards)
    assert coll._check_ag(torch, shapes, [[s.cpu() for s in row] for row in shards], full, range(N)) == "bitwise"
    before = []
    for r in range(N):
        ptr, nbytes = landing(r)
        assert nbytes >= plan.layout.S * N
        with torch.cuda.device(vc.device_of(r)):
            before.append(_core.cuda.d2h(ptr, plan.layout.S * N))
            _core.cuda.memset(ptr, 0xFF, nbytes, torch.cuda.current_stream().cuda_stream)
            torch.cuda.synchronize()
            assert _core.cuda.d2h(ptr, plan.layout.S * N) != before[r]
    go()
    go()  # two more calls over the resident shards land the same bytes again
    for r in range(N):
        ptr, _ = landing(r)
        with torch.cuda.device(vc.device_of(r)):
            assert _core.cuda.d2h(ptr, plan.layout.S * N) == before[r], f"rank {r}"
    grads = [[x.to(f"cuda:{vc.device_of(r)}") for x in row]
             for r, row in enumerate(coll._make_grads(torch, shapes, N, "cpu"))]
    outs, go_rs = vc.reduce_scatter_runner(plan, grads, scale=1.0 / N)
    for o in outs:
        o.fill_(float("nan"))
    go_rs()
    go_rs()  # both banks
    assert [o.device.index for o in outs] == [vc.device_of(r) for r in range(N)]
    assert coll._check_rs(torch, shapes, [[x.cpu() for x in row] for row in grads], outs, plan, range(N)) < 1e-5


@pytest.mark.gpu
def test_cuda_cluster_rejects_a_missing_device():
    import tide
    from tide import _core
    n = _core.cuda.device_count()
    with pytest.raises(tide.PlanError, match=f"device {n} does not exist"):
        tide.VirtualCluster(tide.Topology(1, 2), backend="cuda", devices=[0, n])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_bench_collectives_on_one_gpu_small(capsys, tmp_path, op):
    j = tmp_path / f"{op}.json"
    rc, out, err = _run(capsys, [op, "--context", "gpu1", "--sizes", "1", "--ranks", "4", "--reps", "3",
                                 "--json", str(j)])
    assert rc == 0, err
    assert "1 GPU, 4 virtual ranks" in out
    rows = {r["path"]: r for r in json.loads(j.read_text())["rows"]}
    t = rows[f"TIDE-{op.upper()} (1 node x 4)"]
    assert t["med_ms"] > 0 and rows[coll.STOCK]["med_ms"] > 0
    assert t["check"] == "bitwise" if op == "ag" else t["rel_err"] < 1e-5


@pytest.mark.gpu
def test_bench_interference_on_one_gpu_small(capsys, tmp_path):
    j = tmp_path / "i.json"
    rc, out, err = _run(capsys, ["interference", "--context", "gpu1", "--shard", "1", "--ranks", "4",
                                 "--reps", "4", "--json", str(j)])
    assert rc == 0, err
    rows = json.loads(j.read_text())["rows"]
    tide_rs = rows[0]
    assert tide_rs["config"] == "TIDE-RS, training (16+4)" and tide_rs["sm_ms"] >= 0
    assert all(isinstance(r["slow:one-wave GEMM"], float) for r in rows)


@pytest.mark.gpu
def test_ce_proof_runs_bounded(capsys, tmp_path):
    pytest.importorskip("cupy")
    j = tmp_path / "ce.json"
    rc, out, err = _run(capsys, ["ag", "--ce-proof", "--spin-s", "0.5", "--sizes", "1", "--json", str(j)])
    res = json.loads(j.read_text())
    t = res["rows"][0]
    assert t["resident_blocks"] == t["spinner_blocks"]  # the spinner held every SM
    assert t["spinner_end_s"] is not None and t["call_done_s"] is not None
    assert rc == (1 if res["verdict"] == "FAIL" else 0)


def test_layout_plot_from_a_result(tmp_path):
    """`tide bench layout --plot`: the figure is drawn from the measured rows (no GPU needed)."""
    from tide_apps.bench.layout import plot_layout
    steps = {"AG stock: rank-major + split_with_sizes_copy": 1.7,
             "AG TIDE: direct landing, P strided copies, 4 lane(s)": 1.1,
             "AG TIDE: direct landing, N*P batched copies, 4 lane(s)": 1.0,
             "AG TIDE: direct landing, N*P batched copies, 1 lane(s)": 0.5,  # not the executors' count: ignored
             "RS stock: _chunk_cat fp32 pack + packed reduce": 6.3, "RS TIDE: staging + SUM + LAND": 8.8,
             "RS TIDE: staging + SUM + LAND, full grid": 1.9}
    result = dict(device="test GPU", ranks=8, groups=[{"group": "g", "exec_lanes": 4}],
                  rows=[dict(group="g", step=k, ms=v) for k, v in steps.items()])
    png = tmp_path / "layout.png"
    plot_layout(str(png), result)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plot_layout(None, result)  # no path: nothing drawn, no error
    result["rows"] = [r for r in result["rows"] if not r["step"].startswith("RS stock")]
    with pytest.raises(KeyError):  # a missing stock row is an error, not a silently empty bar
        plot_layout(str(tmp_path / "x.png"), result)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_bench_help_lists_every_bench(capsys, flag):
    """Issue 45: `tide bench --help` lists the benches (it was "arguments are required: which")."""
    rc, out, err = _run(capsys, [flag])
    assert rc == 0, err
    assert "usage: tide bench BENCH" in out
    for name in cli.BENCHES:
        assert f"\n  {name} " in out, name
    with pytest.raises(SystemExit) as e:  # a named bench's own help (its argparse exits)
        _run(capsys, ["ag", flag])
    assert e.value.code == 0 and "usage: tide bench ag" in capsys.readouterr().out


def test_bench_without_a_bench_names_them(capsys):
    with pytest.raises(SystemExit) as e:
        _run(capsys, [])
    assert e.value.code == 2
    assert "name a bench: one of ag, rs, interference, train, layout, hostcall" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _run(capsys, ["--json"])
    assert "(got '--json')" in capsys.readouterr().err
