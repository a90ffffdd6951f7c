"""`tide plan` / `tide demo` and the built-in model groups."""
import json
import re
from math import prod

import pytest

import tide
from tide import _core, cli, models


def _run(capsys, *argv):
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _numel(group):
    return sum(prod(s) for _, s in group)


def test_model_groups_match_their_configs():
    llama = models.groups("llama3.1-70b")
    # 2*8192^2 (q, o) + 2*1024*8192 (k, v) + 3*28672*8192 (MLP) + 2*8192 (RMSNorm)
    assert _numel(llama["block"]) == 2 * 8192**2 + 2 * 1024 * 8192 + 3 * 28672 * 8192 + 2 * 8192
    assert ("embed_tokens.weight", (128256, 8192)) in llama["embedding"]
    assert llama["largest"] == llama["head"]  # lm_head + final norm: 8192 more than the embedding
    assert all(len(s) == 1 for n, s in llama["block"] if "norm" in n)
    qwen = models.groups("qwen3-30b-a3b")
    assert _numel(qwen["block"]) == (2048 * 4096 * 2 + 2048 * 512 * 2 + 128 * 2
                                     + 128 * 2048 + 3 * 128 * 768 * 2048 + 2 * 2048)
    assert qwen["largest"] == qwen["block"] and len(qwen["block_per_expert"]) == 393
    wan = models.groups("wan2.2-14b")
    # 8 biased 5120x5120 projections, 4 qk norms, norm3 w+b, FFN w+b both ways, modulation 6x5120
    assert _numel(wan["block"]) == (8 * (5120 * 5120 + 5120) + 4 * 5120 + 2 * 5120
                                    + 2 * 13824 * 5120 + 13824 + 5120 + 6 * 5120)
    assert len(wan["block"]) == 27 and wan["largest"] == wan["block"]
    with pytest.raises(ValueError, match="model: unknown model"):
        models.groups("gpt2")
    with pytest.raises(ValueError, match="group: model 'wan2.2-14b' has no group 'head'"):
        models.signature("wan2.2-14b", "head")


def test_per_expert_qwen_block_falls_back():
    with pytest.raises(tide.PlanError, match="393 parameters .* stock"):
        tide.plan(models.signature("qwen3-30b-a3b", "block_per_expert"), tide.Topology(8, 8))


@pytest.mark.parametrize("mode,staging,total", [("in_place", 0.594, 3.72),
                                                ("slot_reuse", 0.164, 2.29)])
def test_acceptance_llama_largest_64x8(capsys, mode, staging, total):
    rc, out, _ = _run(capsys, "plan", "--model", "llama3.1-70b", "--group", "largest",
                      "--nodes", "64", "--gpus-per-node", "8", "--mode", mode)
    assert rc == 0
    eq = "Eq. 11" if mode == "in_place" else "Eq. 12"
    shown = float(re.search(rf"staging \({eq}[^)]*\) ([0-9.]+) NS", out).group(1))
    assert shown == staging
    laid_out = float(re.search(r"RS staging Area_RS.*?([0-9.]+)\n", out).group(1))
    assert abs(laid_out - staging) < 0.005
    tide_total = float(re.search(rf"TIDE total \({mode}\)\s+\d+\s+[0-9.]+\s+([0-9.]+)", out).group(1))
    bound = float(re.search(r"TIDE total bound \(\w+\) = .* = ([0-9.]+) NS", out).group(1))
    assert tide_total <= total and bound <= total
    assert re.search(r"FSDP2 total\s+\d+\s+[0-9.]+\s+4\.000", out)
    for name in ("ring0", "ring1", "stage", "staging", "outbox", "inbox", "spare", "counters"):
        assert re.search(rf"^  {name}\s+\d+\s+\d+$", out, re.M)
    assert "M=64 nodes x L=8 GPUs (N=512)" in out and "k = 4 (solver)" in out


def test_json_and_shapes_file(capsys, tmp_path):
    f = tmp_path / "g.json"
    f.write_text(json.dumps({"w": [1000, 64], "b": [1000]}))
    rc, out, _ = _run(capsys, "plan", "--shapes", str(f), "--nodes", "4", "--json",
                      "--mode", "slot_reuse", "--k", "2", "--w-wave", "4", "--grad-dtype", "float32")
    assert rc == 0
    d = json.loads(out)
    assert [q["name"] for q in d["layout"]["params"]] == ["w", "b"]
    assert d["layout"]["params"][0]["R"] == 32 and d["layout"]["N"] == 32  # ceil(1000/32)
    assert d["options"]["k"] == 2 and d["solver"]["k_given"] and d["rs"]["w_wave"] == 4
    assert d["dtypes"]["grad"] == "float32" and d["options"]["mode"] == "slot_reuse"
    assert d["memory"]["area_rs_ns"] > 0 and d["memory"]["arena"][0]["name"] == "ring0"
    f.write_text(json.dumps([[1000, 64], [1000]]))
    rc, out2, _ = _run(capsys, "plan", "--shapes", str(f), "--nodes", "4", "--json",
                       "--mode", "slot_reuse", "--k", "2", "--w-wave", "4",
                       "--grad-dtype", "float32")
    assert rc == 0 and json.loads(out2)["hash"] == d["hash"]


@pytest.mark.parametrize("argv,match", [
    (["--model", "nope"], "unknown model"),
    (["--model", "wan2.2-14b", "--gpus-per-node", "16"], "gpus_per_node"),
    (["--model", "wan2.2-14b", "--w-wave", "9"], "w_wave"),
    (["--model", "wan2.2-14b", "--dtype", "int4"], "ag_dtype"),
    (["--model", "wan2.2-14b", "--mode", "x"], "mode"),
    ([], "exactly one of --model or --shapes"),
    (["--shapes", "/nonexistent.json"], "nonexistent"),
])
def test_cli_errors(capsys, argv, match):
    rc, _, err = _run(capsys, "plan", *argv)
    assert rc == 2 and match in err


def test_validate_all_dispatch(capsys, monkeypatch):
    monkeypatch.delattr(_core, "validate_all", raising=False)
    rc, _, err = _run(capsys, "plan", "--validate-all", "--gpus-per-node", "8", "--max-nodes", "4")
    assert rc == 2 and "validate_all" in err
    calls = []
    monkeypatch.setattr(_core, "validate_all",
                        lambda L, M: calls.append((L, M)) or {"accepted": 1, "rejected": 2},
                        raising=False)
    rc, out, _ = _run(capsys, "plan", "--validate-all", "--gpus-per-node", "4", "--max-nodes", "16")
    assert rc == 0 and calls == [(4, 16)] and "accepted: 1" in out and "rejected: 2" in out


def test_demo(capsys):
    rc, out, _ = _run(capsys, "demo")
    assert rc == 0 and "llama3.1-70b / block" in out and "llama3.1-70b / largest" in out
    assert "M=8 nodes x L=8 GPUs (N=64)" in out
