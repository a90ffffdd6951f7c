"""Bounded options: every planner option and ExecutorOptions field has a range checked when the
plan or executor is made, and the error names the field, its range and the value got; an arena
larger than the memory it can get is refused naming its largest region, before anything runs."""
import json
import re
import time

import pytest

import tide

pytestmark = pytest.mark.usefixtures("no_leaks")  # conftest.py: no segment, no child left

G, T = tide.GroupSignature, tide.Topology
SMALL = G(shapes=[(64, 32), (17,)])


def _refused(sig, topo, match, **kw):
    t0 = time.monotonic()
    with pytest.raises(tide.PlanError, match=match):
        tide.plan(sig, topo, **kw)
    return time.monotonic() - t0


# ---- planner options: field, range and value in the message --------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("kw,match", [
    ({"n_part": 10**9}, r"Options\.n_part: must be in \[0, 16\] .*got 1000000000"),
    ({"n_part": 17}, r"Options\.n_part: must be in \[0, 16\] .*got 17"),
    ({"n_part": -1}, r"Options\.n_part: must be in \[0, 16\] .*got -1"),
    ({"n_stg": 10**9}, r"Options\.n_stg: must be in \[1, 16\], got 1000000000"),
    ({"n_stg": 0}, r"Options\.n_stg: must be in \[1, 16\], got 0"),
    ({"k": 10**9}, r"Options\.k: must be in \[0, 32\] .*got 1000000000"),
    ({"k": 33}, r"Options\.k: must be in \[0, 32\] .*got 33"),
    ({"sum_ctas": 10**9}, r"Options\.sum_ctas: must be in \[0, 4096\] .*got 1000000000"),
    ({"land_ctas": 4097}, r"Options\.land_ctas: must be in \[0, 4096\] .*got 4097"),
    ({"land_ctas": -1}, r"Options\.land_ctas: must be in \[0, 4096\] .*got -1"),
    ({"w_wave": -1}, r"Options\.w_wave: must be in \[0, L=4\] .*got -1"),
    ({"chunk_bytes": 1}, r"Options\.chunk_bytes: must be 0 \(planner\) or >= 2 \(one bfloat16 gradient element\), got 1"),
    ({"chunk_bytes": -5}, r"Options\.chunk_bytes: must be 0 \(planner\) or >= 2 .*got -5"),
    ({"ag_head_bytes": -1}, r"Options\.ag_head_bytes: must be >= 0 .*got -1"),
    ({"n_part": 2**31}, r"Options\.n_part: 2147483648 does not fit in 32 bits"),
])
def test_option_out_of_range_names_field_range_and_value(kw, match):
    # Refused before any sizing work: n_part=10**9 used to allocate 12 GB before std::bad_alloc.
    assert _refused(SMALL, T(2, 4), match, **kw) < 0.5


@pytest.mark.parametrize("kw,match", [
    ({"k": "3"}, r"Options\.k: '3' is not an integer"),
    ({"n_stg": 2.0}, r"Options\.n_stg: 2\.0 is not an integer"),
    ({"w_wave": False}, r"Options\.w_wave: False is a bool"),
    ({"land_ctas": [1]}, r"Options\.land_ctas: \[1\] is not an integer"),
    ({"w_wave": 5}, r"Options\.w_wave: W_wave = 5 exceeds L = 4"),
    ({"sum_ctas": 4097}, r"Options\.sum_ctas: must be in \[0, 4096\]"),
    ({"ag_head_bytes": -1}, r"Options\.ag_head_bytes: must be >= 0"),
    ({"chunk_bytes": 1}, r"Options\.chunk_bytes: must be 0 \(planner\) or >= 2"),
    ({"n_sgt": 2}, r"options: unknown option\(s\) n_sgt"),
])
def test_check_options_refuses_any_bad_option_without_a_group(kw, match):
    """tide.plan.check_options: what a face's enable()/init() calls at creation (issue 45)."""
    from tide.plan import check_options
    with pytest.raises(tide.PlanError, match=match):
        check_options(T(2, 4), **kw)


def test_check_options_takes_every_good_value():
    from tide.plan import check_options
    good = {"n_part": 16, "n_stg": 16, "k": 32, "sum_ctas": 4096, "land_ctas": 4096,
            "chunk_bytes": 2, "ag_head_bytes": 0, "w_wave": 4}
    for topo in (T(1, 1), T(1, 4), T(2, 4), T(64, 8)):
        for k, v in good.items():
            if k != "w_wave" or v <= topo.gpus_per_node:
                assert check_options(topo, **{k: v}) == {k: v}
    import numpy as np
    assert check_options(T(2, 4), k=np.int32(3)) == {"k": 3}


def test_chunk_bytes_minimum_follows_the_gradient_dtype():
    _refused(G(shapes=[(64, 32)], grad_dtype="float32"), T(2, 4), r"or >= 4 \(one float32 gradient element\), got 3",
             chunk_bytes=3)
    tide.plan(G(shapes=[(64, 32)], grad_dtype="float32"), T(2, 4), chunk_bytes=4)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("topo,where,need", [(T(2, 2), "sub-slice pass of 524288 elements", 1024),
                                             (T(1, 2), "output of 33554432 elements", 65536)])
def test_chunk_bytes_with_too_many_chunks_is_refused_naming_the_minimum(topo, where, need):
    """A chunk of a few bytes on a large group used to plan, then exhaust memory building one op
    per chunk at the first reduce-scatter; now the plan names the smallest chunk_bytes it takes."""
    sig = G(shapes=[(4096, 1024)] if topo.nodes == 2 else [(8192, 8192)])
    assert _refused(sig, topo, rf"Options\.chunk_bytes: 2 B splits each {where} .* above the limit of 1024; "
                    rf"for this group chunk_bytes must be 0 \(planner\) or >= {need}$", chunk_bytes=2) < 0.5
    p = tide.plan(sig, topo, chunk_bytes=need)  # the minimum it names is accepted
    assert p.rs_schedule.n_chunks <= 1024


def test_every_bound_is_inclusive():
    for kw in ({"n_part": 16}, {"n_stg": 16}, {"k": 32}, {"sum_ctas": 4096}, {"land_ctas": 4096},
               {"chunk_bytes": 2}, {"ag_head_bytes": 0}, {"w_wave": 4}):
        tide.plan(SMALL, T(2, 4), **kw)


def test_arena_beyond_the_plan_limit_names_the_largest_region():
    # NS = 2**39 bytes: two ring slots alone are 1 TiB per rank.
    _refused(G(shapes=[(1 << 30, 1 << 8)]), T(2, 8),
             r"plan: the arena needs \d+ bytes per rank, above TIDE's limit of 1099511627776 \(1 TiB\); "
             r"its largest region is 'ring0' \(549755813888 bytes\)$")
    # Sixteen whole-output staging slots of fp32 gradients at one node: staging dominates.
    _refused(G(shapes=[(1 << 23, 1 << 12)], grad_dtype="float32"), T(1, 8),
             r"its largest region is 'staging' \(\d+ bytes\) \(Options\.n_stg slots", n_stg=16, chunk_bytes=1 << 40)


# ---- the executor's arena against the memory it can get -------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("ranks_as", ["threads", "processes"])
def test_cpu_arena_larger_than_memory_is_refused_before_mapping(ranks_as):
    """A plan within the 1 TiB limit whose 16 arenas exceed this machine: the virtual cluster
    refuses before mapping (processes mode once mapped 6.6 TB of /dev/shm without complaint; its
    arena is now an anonymous shared mapping, bounded by physical memory like the threads')."""
    topo = T(2, 8)
    plan = tide.plan(G(shapes=[(1 << 26, 1 << 11)]), topo)
    vc = tide.VirtualCluster(topo, ranks_as=ranks_as)
    t0 = time.monotonic()
    with pytest.raises(tide.PlanError, match=rf"CpuArena: 16 rank\(s\) x \d+ arena bytes \(\d+ bytes mapped\) exceed "
                                             rf"the \d+ bytes of physical memory; the largest region is 'ring0' \(\d+ bytes per rank\)"):
        vc.session(plan, "all_gather")
    assert time.monotonic() - t0 < 5


# ---- ExecutorOptions: ranges, and no silent narrowing ---------------------------------------------

@pytest.mark.parametrize("field,value,match", [
    ("cast_ctas", 2**32 + 1, r"ExecutorOptions: cast_ctas: expected 1\.\.4096, got 4294967297"),
    ("zero_ctas", 2**32 + 8, r"zero_ctas: expected 1\.\.4096, got 4294967304"),
    ("workers", 2**31, r"workers: expected 0\.\.1024, got 2147483648"),
    ("copy_lanes", -2**40, r"copy_lanes: expected 1\.\.8, got -1099511627776"),
    ("rail_ctas", 65, r"ExecutorOptions\.rail_ctas: expected 1\.\.64, got 65"),
    ("rail_channels_per_peer", 0, r"ExecutorOptions\.rail_channels_per_peer: expected 1\.\.32, got 0"),
    ("copy_spread_bytes", 2**70, r"copy_spread_bytes: 1180591620717411303424 does not fit in 64 bits"),
    ("timeout_s", float("inf"), r"ExecutorOptions\.timeout_s: expected a finite number of seconds in \(0, 1e6\]"),
])
def test_executor_option_out_of_range_names_field_and_range(field, value, match):
    # A value past int used to wrap: cast_ctas=2**32+1 was accepted as 1.
    with pytest.raises(tide.PlanError, match=match):
        tide.ExecutorOptions(**{field: value})


def test_debug_env_override_is_range_checked_too(monkeypatch):
    monkeypatch.setenv("TIDE_EXEC_OPTIONS", "zero_ctas=4294967304")
    with pytest.raises(tide.PlanError, match=r"TIDE_EXEC_OPTIONS: zero_ctas: expected 1\.\.4096, got 4294967304"):
        tide.ExecutorOptions().effective()


# ---- the CLI: one-line errors with rc 2, Ctrl-C and progress for long work -------------------------

def _cli(capsys, *argv):
    from tide import cli
    rc = cli.main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _one_line_error(rc, err, *fragments):
    assert rc == 2, err
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("tide plan: error: "), err
    for f in fragments:
        assert f in err, (f, err)


@pytest.mark.timeout(30)
def test_cli_deeply_nested_shapes_is_one_line(capsys, tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)  # a RecursionError traceback before
    rc, _, err = _cli(capsys, "--shapes", str(deep))
    _one_line_error(rc, err, f"--shapes {deep}: nested too deeply")


@pytest.mark.parametrize("text,fragment", [
    ("[[4, 8], [1", "not valid JSON (Expecting ',' delimiter at line 1 column 12; truncated?)"),
    ("", "not valid JSON (Expecting value at line 1 column 1"),
    (b"\xff\xfe[1]", "not UTF-8 text"),
])
def test_cli_bad_shapes_file_names_the_file_and_the_flag(capsys, tmp_path, text, fragment):
    f = tmp_path / "shapes.json"
    (f.write_bytes if isinstance(text, bytes) else f.write_text)(text)
    rc, _, err = _cli(capsys, "--shapes", str(f))
    _one_line_error(rc, err, f"--shapes {f}: ", fragment)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("source", ["/dev/zero", "/dev/urandom", "sparse", "long-json"])
def test_cli_shapes_input_is_bounded(capsys, tmp_path, source):
    """Issue 45: `--shapes /dev/zero` read without bound (24 GB, killed); any input past
    SHAPES_MAX_BYTES is refused after reading that much, naming the file and the bound."""
    from tide import cli
    path = source
    if source == "sparse":  # 64 GiB of holes: reading it all would take minutes
        path = tmp_path / "big.json"
        with open(path, "wb") as f:
            f.truncate(64 << 30)
    elif source == "long-json":  # valid JSON, just too long
        path = tmp_path / "long.json"
        path.write_text("[" + ",".join(["[4, 8]"] * (cli.SHAPES_MAX_BYTES // 7 + 10)) + "]")
    t0 = time.monotonic()
    rc, _, err = _cli(capsys, "--shapes", str(path))
    assert time.monotonic() - t0 < 10
    _one_line_error(rc, err, f"--shapes {path}: more than 4 MiB", "not a shapes file?")
    ok = tmp_path / "ok.json"  # the largest group (256 parameters) is far below the bound
    ok.write_text(json.dumps({f"layers.{i}.weight": [8192, 28672] for i in range(256)}))
    assert _cli(capsys, "--shapes", str(ok), "--nodes", "2")[0] == 0


@pytest.mark.timeout(30)
def test_cli_shapes_fifo_without_a_writer_does_not_hang(capsys, tmp_path):
    import os
    fifo = tmp_path / "shapes.fifo"
    os.mkfifo(fifo)
    rc, _, err = _cli(capsys, "--shapes", str(fifo))  # open() used to wait for a writer
    _one_line_error(rc, err, f"--shapes {fifo}: not valid JSON (Expecting value")


def _dtype_help_names():
    """The dtype names `tide plan --help` lists for --dtype."""
    import argparse

    from tide import cli
    ap = argparse.ArgumentParser()
    cli._add_plan_args(ap)
    (act,) = [a for a in ap._actions if "--dtype" in a.option_strings]
    return re.findall(r"\b(?:bfloat16|u?int\d+|float\d+\w*)\b", act.help)


def test_cli_dtype_error_lists_every_dtype_its_help_lists(capsys):
    """Issue 45: float8 was accepted (and in the help) but the error did not name it."""
    names = _dtype_help_names()
    assert {"bfloat16", "float16", "float32", "uint8", "float8_e4m3fn", "float8_e5m2"} <= set(names)
    for flag in ("--dtype", "--grad-dtype", "--shard-dtype"):
        rc, _, err = _cli(capsys, "--model", "wan2.2-14b", flag, "int4")
        _one_line_error(rc, err, "unknown dtype 'int4'")
        listed = err.split("(expected", 1)[1]
        for n in names:
            assert re.search(rf"\b{n}\b", listed), (n, err)
    for n in names:  # and every name listed is one the planner takes
        assert _cli(capsys, "--model", "wan2.2-14b", "--nodes", "1", "--dtype", n)[0] == 0, n


@pytest.mark.parametrize("argv,fragment", [
    (["--gpus-per-node", "0"], "--gpus-per-node: must be in [1, 8], got 0"),
    (["--gpus-per-node", "9"], "--gpus-per-node: must be in [1, 8], got 9"),
    (["--max-nodes", "1"], "--max-nodes: must be in [2, 65536], got 1"),
    (["--max-nodes", "70000"], "--max-nodes: must be in [2, 65536], got 70000"),
])
def test_cli_validate_all_bad_range_is_one_line(capsys, argv, fragment):
    rc, _, err = _cli(capsys, "--validate-all", *argv)  # a traceback with rc 1 before
    _one_line_error(rc, err, fragment)


def test_cli_validate_all_in_parts_equals_one_call():
    import io

    from tide import _core, cli
    progress = io.StringIO()
    parts = cli._validate_all(4, 120, progress=progress, every_s=0.0)
    whole = _core.validate_all(4, 120)
    for key in ("accepted", "rejected", "accepted_pairs", "rejected_pairs", "n_part_ok", "n_part_checked"):
        assert parts[key] == whole[key], key
    lines = progress.getvalue().splitlines()
    assert lines and all(ln.startswith("tide plan: --validate-all: M up to ") and "of 120 done" in ln
                         for ln in lines)


@pytest.mark.timeout(60)
def test_cli_validate_all_obeys_ctrl_c():
    import os
    import signal
    import subprocess
    import sys
    # The child restores Python's SIGINT handler: a runner started in the background may
    # hand it SIGINT ignored.
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from tide.cli import main; sys.exit(main(sys.argv[1:]))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-c", code, "plan", "--validate-all", "--max-nodes", "65536"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        time.sleep(2.0)  # inside the work (the whole range takes hours)
        assert p.poll() is None
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=10)
        assert time.monotonic() - t0 < 2.0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130 and "tide plan: --validate-all interrupted" in err and "Traceback" not in err


# ---- faces: a wrong argument is named, not an AttributeError from inside -------------------------

@pytest.mark.parametrize("topo,match", [
    (None, r"VirtualCluster\.topo: expected a tide\.Topology, got None"),
    ((1, 2), r"VirtualCluster\.topo: expected a tide\.Topology, got \(1, 2\)"),
    (T("a", 2), r"VirtualCluster\.topo\.nodes: expected an int >= 1, got 'a'"),
    (T(2, 0), r"VirtualCluster\.topo\.gpus_per_node: expected an int >= 1, got 0"),
    (T(True, 2), r"VirtualCluster\.topo\.nodes: expected an int >= 1, got True"),
])
def test_virtual_cluster_names_a_bad_topology(topo, match):
    with pytest.raises(tide.PlanError, match=match):
        tide.VirtualCluster(topo)


def _torch_topology_errors(rank, world):
    import os

    import tide_torch
    from _torch_dist import build, mesh_1d
    model = build(mesh=mesh_1d())
    for bad, fragment in (((1, 2), "tide_torch.enable(topology=...): expected a tide.Topology(nodes, "
                                   "gpus_per_node), got tuple (1, 2)"),
                          (tide.Topology("1", 2), "tide_torch.enable(topology=...): nodes must be an int >= 1, got '1'")):
        with pytest.raises(tide_torch.TideEnableError) as e:
            tide_torch.enable(model, topology=bad)
        assert fragment in str(e.value), str(e.value)
    os.environ["LOCAL_WORLD_SIZE"] = "abc"
    with pytest.raises(tide_torch.TideEnableError) as e:
        tide_torch.enable(model)
    assert "LOCAL_WORLD_SIZE='abc' is not an integer" in str(e.value), str(e.value)


@pytest.mark.timeout(120)
def test_tide_torch_enable_names_a_bad_topology_on_every_rank():
    pytest.importorskip("torch")
    from _torch_dist import spawn
    spawn(_torch_topology_errors, world=2)


def test_tide_torch_arena_larger_than_dev_shm_is_refused_before_mapping():
    import os
    torch = pytest.importorskip("torch")
    from tide_torch.arena import Arena
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    st = os.statvfs("/dev/shm")
    too_big = st.f_bavail * st.f_frsize + (1 << 30)
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(tide.PlanError, match=r"Arena: \d+ bytes of shared memory exceed the \d+ bytes free in "
                                             r"/dev/shm; the largest region is 'staging' \(\d+ bytes\)"):
        Arena({"ring0": 4096, "staging": too_big}, torch.device("cpu"))
    assert set(os.listdir("/dev/shm")) <= before  # nothing created


@pytest.mark.parametrize("name", ["sum_ctas", "land_ctas"])
def test_session_cta_override_shares_the_planner_range(name):
    plan = tide.plan(SMALL, T(1, 2))
    with pytest.raises(tide.PlanError, match=rf"VirtualCluster\.{name}: expected None \(the plan's solver\) or 1\.\.4096, got 4097"):
        tide.VirtualCluster(T(1, 2), **{name: 4097})
    ex = tide._core.CpuClusterExecutor(2, plan, ["all_gather"], processes=False, options={})
    with pytest.raises(tide.PlanError, match=rf"SessionOptions\.{name}: expected 0 \(the .*solver\) or 1\.\.4096, got 4097"):
        tide._core.GroupSession(plan, ex, ["all_gather"], **{name: 4097})


@pytest.mark.parametrize("field,value,rng", [
    ("bw_nic", 0.0, r"\[1e\+06, 1e\+15\]"), ("bw_sum", float("nan"), r"\[1e\+06, 1e\+15\]"),
    ("bw_hbm", 1e30, r"\[1e\+06, 1e\+15\]"), ("bw_push", -1.0, r"\[1e\+06, 1e\+15\]"),
    ("t_rnd", float("inf"), r"\[0, 10\]"), ("gamma_skew", 0.5, r"\[1, 16\]"),
    ("eta_tail", 0.0, r"\(0, 1\]"), ("k_max", 10**6, r"1\.\.32"),
])
def test_calibration_fields_have_ranges(field, value, rng):
    """A calibration override outside its range is refused naming the field (the solver's
    formulas have no meaning there)."""
    _refused(SMALL, T(2, 8), rf"Calibration\.{field}: expected .*{rng}, got", calibration={field: value})


def test_solver_cta_choices_saturate_at_the_executor_ceiling():
    """Extreme but valid calibrations cannot make the solver choose more CTAs than the executors
    take (kMaxCtas = 4096, the range of Options.sum_ctas / land_ctas)."""
    s = tide.plan(SMALL, T(2, 8), calibration={"bw_nic": 1e15, "bw_sum": 1e6}).solver
    assert s["sum_ctas"] == 4096
    s = tide.plan(SMALL, T(1, 8), calibration={"bw_cap": 1e15, "bw_land": 1e6}).solver
    assert s["land_ctas"] == 4096
