"""tools/gpu/run.py (the GPU machine's runner), checked on the CPU: every stage's command refers to
files, tests, markers and bench names that exist; the multicast safety variables are set in one
place and forced for every child; the runner kills a stage at its limit, goes on, and prints the
summary last."""
import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_PY = ROOT / "tools" / "gpu" / "run.py"


def _load():
    spec = importlib.util.spec_from_file_location("tide_gpu_run", RUN_PY)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(mod)
    return mod


run = _load()
CONTEXTS = [(n, m) for n in (0, 1, 2, 8) for m in (False, True)]


def _tables(tmp_path):
    for ngpu, multi in CONTEXTS:
        ctx = run.Ctx(out=tmp_path / "out", tmp=tmp_path / "tmp", py="python3", ngpu=ngpu, multi=multi)
        yield (ngpu, multi), run.stage_table(ctx)


def _steps(table):
    for stage in table.values():
        for st in stage.steps:
            yield stage, st
            if st.on_fail:
                yield stage, st.on_fail


def _declared_markers():
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"markers\s*=\s*\[(.*?)\]", text, re.S).group(1)
    return set(re.findall(r'"(\w+):', block))


def _check_pytest_args(args, where):
    """Paths / node ids exist, -m expressions use declared markers; returns the paths."""
    markers, paths, i = _declared_markers(), [], 0
    while i < len(args):
        a = args[i]
        if a == "-m":
            names = set(re.findall(r"\w+", args[i + 1])) - {"and", "or", "not"}
            assert names and names <= markers, f"{where}: -m {args[i + 1]!r}: undeclared marker(s) {names - markers}"
            i += 2
            continue
        if a in ("-k", "-p"):
            assert i + 1 < len(args), where
            i += 2
            continue
        if not a.startswith("-"):
            path, _, node = a.partition("::")
            assert (ROOT / path).exists(), f"{where}: {path} does not exist"
            if node:
                func = node.split("[")[0]
                assert re.search(rf"^def {func}\(", (ROOT / path).read_text(), re.M), f"{where}: no {a}"
            paths.append(path)
        i += 1
    return paths


def test_every_stage_command_refers_to_things_that_exist(tmp_path):
    from tide_apps.cli import BENCHES
    bench_choices = set(BENCHES)
    assert {"ag", "rs", "train", "layout"} <= bench_choices
    seen_pytest = 0
    for (ngpu, multi), table in _tables(tmp_path):
        assert set(table) >= {"build", "smoke", "suite", "kernels", "executor", "cudaipc",
                              "torchgpu", "xlacuda", "nccl", "hang", "sanitize", "kperf", "bench:layout"}
        for stage, st in _steps(table):
            where = f"{stage.name}/{st.name} (gpus {ngpu}, multi {multi})"
            assert st.limit > 0 and stage.limit > 0, where
            if st.skip:
                continue
            cmd = [str(x) for x in st.cmd]
            assert cmd, where
            if st.kind == "pytest":
                assert cmd[:3] == ["python3", "-m", "pytest"], where
                assert _check_pytest_args(cmd[3:], where), f"{where}: selects no path"
                seen_pytest += 1
                continue
            assert cmd[:3] != ["python3", "-m", "tide"] or cmd[3] == "plan", where  # demo, bench: tide_apps
            if cmd[:3] == ["python3", "-m", "tide_apps"]:
                assert cmd[3] in ("bench", "demo"), where
                if cmd[3] == "bench":
                    assert cmd[4] in bench_choices, f"{where}: tide bench {cmd[4]} is not a bench"
            for a in cmd:
                if re.fullmatch(r"(tools|examples|tests)/[\w/.-]+", a):
                    assert (ROOT / a).exists(), f"{where}: {a} does not exist"
    assert seen_pytest > 10
    hang_py = (ROOT / "tools" / "gpu" / "hang.py").read_text()
    default = re.search(r'DEFAULT_TEST = "([^"]+)"', hang_py).group(1)
    _check_pytest_args([default], "hang.py DEFAULT_TEST")


def test_groups_expand_to_known_stages(tmp_path):
    table = run.stage_table(run.Ctx(out=tmp_path, tmp=tmp_path, py="python3", ngpu=1))
    for g in run.GROUPS:
        assert run.expand([g], table)
    check = [n for n, _ in run.expand(["check"], table)]
    assert check == ["build", "smoke", "kernels", "bench:layout", "executor", "demo", "sanitize"]
    assert run.expand(["base", "suite:400", "smoke:7"], table) == [("build", None), ("smoke", 7), ("suite", 400)]
    assert ("xlacuda", 70) in run.expand(["multi"], table)
    with pytest.raises(SystemExit):
        run.expand(["no_such_stage"], table)


def test_safety_variables_are_set_in_exactly_one_place(tmp_path):
    consts = [n.value for n in ast.walk(ast.parse(RUN_PY.read_text())) if isinstance(n, ast.Constant)]
    names = list(run.SAFETY) + [run.MULTICAST_GATE]
    assert set(names) >= {"NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "TIDE_ENABLE_MULTICAST"}
    for k in names:
        assert consts.count(k) == 1, f"{k} appears {consts.count(k)} times as a literal in run.py"
    assert run.SAFETY["NCCL_NVLS_ENABLE"] == "0" and run.SAFETY["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    for _ctx, table in _tables(tmp_path):
        for stage, st in _steps(table):
            assert not set(st.env) & set(names), f"{stage.name}/{st.name} sets a safety variable"
    # nothing else under tools/ sets them
    for p in (ROOT / "tools").rglob("*"):
        if p.is_file() and p != RUN_PY and p.suffix in (".sh", ".py"):
            assert "NCCL_NVLS_ENABLE" not in p.read_text(), p
    env = run.child_env({"NCCL_NVLS_ENABLE": "1", "TIDE_ENABLE_MULTICAST": "1", "PATH": "/bin",
                         "CUDA_DEVICE_MAX_CONNECTIONS": "8"})
    assert "TIDE_ENABLE_MULTICAST" not in env
    assert {k: env[k] for k in run.SAFETY} == run.SAFETY
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "8" and env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert run.child_env({})["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"
    # ...except the layout bench, which runs at the driver's default (what a training process gets)
    for _ctx, table in _tables(tmp_path):
        layout = [st for stage, st in _steps(table) if stage.name == "bench:layout"]
        assert layout and all("CUDA_DEVICE_MAX_CONNECTIONS" in st.unset for st in layout)
    assert run.refused({"NCCL_NVLS_ENABLE": "1"}) and run.refused({"TIDE_ENABLE_MULTICAST": ""})
    assert not run.refused({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}) and not run.refused({})


def test_cli_refuses_multicast_and_lists_and_dry_runs():
    env = {k: v for k, v in os.environ.items() if k not in (*run.SAFETY, run.MULTICAST_GATE)}
    r = subprocess.run([sys.executable, str(RUN_PY), "--dry-run"], env=dict(env, NCCL_NVLS_ENABLE="1"),
                       capture_output=True, text=True)
    assert r.returncode == 2 and "refusing" in r.stderr
    r = subprocess.run([sys.executable, str(RUN_PY), "--list"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "bench:layout" in r.stdout and "check" in r.stdout
    r = subprocess.run([sys.executable, str(RUN_PY), "--dry-run", "--multi", "--gpus", "8", "--args", "suite=-k x",
                        "suite", "bench:ag"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "--topologies 1x8,2x4,4x2,8x1" in r.stdout and "tests/ -k x" in r.stdout


def test_judge_pytest_outcomes():
    s = run.Step("t", ["x"], 10, kind="pytest")
    assert run.judge(s, 0, "..\n3 passed, 1 skipped in 1.0s", False, None, 10)[0] == "PASS"
    assert run.judge(s, 0, "2 skipped in 0.1s", False, None, 10)[0] == "FAIL"
    assert run.judge(run.Step("t", ["x"], 10, kind="pytest", may_skip=True), 0, "2 skipped", False, None, 10)[0] == "SKIP"
    assert run.judge(s, 1, "1 failed, 2 passed", False, None, 10)[0] == "FAIL"
    assert run.judge(s, -15, "", True, None, 10)[0] == "TIMEOUT"
    js = run.Step("b", ["x"], 10, json="/nonexistent.json", detail=run.d_train)
    assert run.judge(js, 0, "done", False, None, 10)[0] == "FAIL"  # no JSON written
    assert run.judge(js, 0, "", False, {"rows": [{"note": "torch failed"}]}, 10) == ("FAIL", "torch failed")


def test_runner_kills_at_the_limit_goes_on_and_prints_the_summary_last(tmp_path, capsys):
    py = sys.executable
    sleeper = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
               "print('started', flush=True); time.sleep(60)")
    table = {
        "build": run.Stage("build", 30, [run.Step("b", [py, "-c", "print('built')"], 30)], "fake build"),
        "slow": run.Stage("slow", 2, [run.Step("sleep", [py, "-c", sleeper], 30),
                                      run.Step("after", [py, "-c", "print(1)"], 30)], "killed at 2 s"),
        "bad": run.Stage("bad", 30, [run.Step("rc3", [py, "-c", "import sys; print('oops'); sys.exit(3)"], 30)], "fails"),
        "json": run.Stage("json", 30, [run.Step("j", [py, "-c", f"import json; json.dump({{'rows': [1, 2]}}, "
                                                            f"open({str(tmp_path / 'j.json')!r}, 'w'))"], 30,
                                                json=str(tmp_path / "j.json"),
                                                detail=lambda t, d: f"{len(d['rows'])} rows")], "writes JSON"),
        "env": run.Stage("env", 30, [run.Step("e", [py, "-c", "import os; assert os.environ['NCCL_NVLS_ENABLE'] == '0';"
                                                        "assert 'TIDE_ENABLE_MULTICAST' not in os.environ"], 30)],
                         "sees the safety env"),
        "later": run.Stage("later", 30, [run.Step("l", [py, "-c", "print('ok')"], 30)], "needs bad", needs=("bad",)),
    }
    ctx = run.Ctx(out=tmp_path, tmp=tmp_path, py=py, ngpu=0)
    r = run.Runner(ctx, table, run.child_env(dict(os.environ, TIDE_ENABLE_MULTICAST="1")), budget=0)
    t0 = time.monotonic()
    for name in table:
        r.stage(table[name], table[name].limit)
    r.summary()
    assert time.monotonic() - t0 < 25  # the sleeper's group died at 2 s (+ grace), not at 60 s
    status = {row[0]: row[1] for row in r.rows}
    assert status == {"build": "PASS", "slow": "FAIL", "bad": "FAIL", "json": "PASS", "env": "PASS", "later": "SKIP"}
    slow = next(row for row in r.rows if row[0] == "slow")
    assert {s[0]: s[1] for s in slow[4]} == {"sleep": "TIMEOUT"}
    out = capsys.readouterr().out.rstrip().splitlines()
    head = max(i for i, ln in enumerate(out) if "run.py summary" in ln)
    assert [ln.split()[0] for ln in out[head + 1:-1] if not ln.startswith(" ")] == list(table)
    assert out[-1].startswith("logs in") and "run.log" in out[-1] and "results.json" in out[-1]
    log = (tmp_path / "run.log").read_text()
    assert "started" in log and "oops" in log and log.rstrip().splitlines()[-1].startswith("logs in")
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["results"]["json"]["j"] == {"rows": [1, 2]}
    assert [s["detail"] for s in res["stages"] if s["name"] == "json"] == ["2 rows"]


def test_the_step_ratio_check_fails_above_its_goal():
    run = _load()
    row = lambda name, ms: {"framework": "torch", "run": name, "step_ms": ms}  # noqa: E731
    check = run.d_ratio(1.0)
    assert check("", {"rows": [row("stock", 40.0), row("tide_in_place", 38.0)]})[0] == "PASS"
    verdict, detail = check("", {"rows": [row("stock", 40.0), row("tide_in_place", 80.0)]})
    assert verdict == "FAIL" and "2.00x" in detail, detail
    assert check("", {"rows": [row("stock", 40.0)]})[0] == "FAIL"  # TIDE's run missing
    assert check("", {"rows": [{"framework": "torch", "note": "timed out"}]}) == ("FAIL", "timed out")
    assert run.d_ratio(0.9)("", {"rows": [row("stock", 100.0), row("tide_in_place", 95.0)]})[0] == "FAIL"


def test_graphdiag_verdict_names_the_variants_that_differ():
    """The graphdiag stage's verdict reads graphdiag.py's lines (its stats lines are not verdicts)."""
    text = ("graphdiag graphs_sync  bitwise equal to stock after each of 6 steps\n"
            "graphdiag graphs_sync  stats {'graph_launches': 54}\n"
            "graphdiag graphs       first differs after step 0: 18 params (...), max |d| 2.7e-04\n"
            "graphdiag graphs       stats {'graph_launches': 51}\n")
    assert run.d_graphdiag(text) == ("FAIL", "2 variants, differ: graphs")
    ok = "\n".join(ln for ln in text.splitlines() if "graphs " not in ln)
    assert run.d_graphdiag(ok) == ("PASS", "1 variants, all bitwise vs stock")
    assert run.d_graphdiag("Traceback (most recent call last):\n")[0] == "FAIL"
