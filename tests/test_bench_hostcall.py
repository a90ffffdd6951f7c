"""`tide bench hostcall` on CPU (gloo, the CPU executor, a scaled-down group): both columns,
TIDE's transport calls and stock FSDP2's own collective functions, come out of one run."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from tide_apps import cli  # noqa: E402
from tide_apps.bench import hostcall_stock  # noqa: E402


def test_hostcall_cpu_prints_stock_beside_tide(capsys, tmp_path):
    path = tmp_path / "hostcall.json"
    rc = cli.main(["bench", "hostcall", "--device", "cpu", "--ranks", "2", "--scale", "128",
                   "--iters", "2", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0
    res = json.loads(path.read_text())
    assert res["ranks"] == 2 and res["transport"] == "tide-executor" and res["scale"] == 128
    assert res["stock_grad_dtype"] in ("bfloat16", "float32")
    for what in ("ag", "rs"):
        tide_, stock = res[what], res["stock_" + what]
        assert 0 < tide_["median_us"] <= tide_["p90_us"]
        assert 0 < stock["median_us"] <= stock["p90_us"]
        assert tide_["ratio_to_stock"] == pytest.approx(tide_["median_us"] / stock["median_us"])
        row = next(line.split() for line in out.splitlines() if line.startswith(what + " "))
        assert float(row[3]) == pytest.approx(stock["median_us"], abs=0.05)
        assert row[5] == f"{tide_['ratio_to_stock']:.2f}x"


def test_hostcall_graphs_column_beside_eager_and_stock(capsys, tmp_path):
    """--graphs: TIDE's replayed column (ExecutorOptions(graphs=True)) beside the eager one and
    stock's, ratios against stock. On CPU the executor has no graphs: the column runs eager and
    the table says so (on CUDA it reports how many calls were launched as graphs)."""
    path = tmp_path / "hostcall.json"
    rc = cli.main(["bench", "hostcall", "--device", "cpu", "--ranks", "2", "--scale", "128",
                   "--iters", "3", "--graphs", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0
    res = json.loads(path.read_text())
    assert res["graphs"] and res["graph_calls_per_rank"] == 8
    assert res["graph_launches"] == [None, None] and res["graph_captures"] == [None, None]
    for what in ("ag", "rs"):
        eager, graph, stock = res[what], res["graphs_" + what], res["stock_" + what]
        assert 0 < graph["median_us"] <= graph["p90_us"]
        assert graph["ratio_to_stock"] == pytest.approx(graph["median_us"] / stock["median_us"])
        assert graph["ratio_to_eager"] == pytest.approx(graph["median_us"] / eager["median_us"])
        row = next(line.split() for line in out.splitlines() if line.startswith(what + " "))
        assert float(row[1]) == pytest.approx(eager["median_us"], abs=0.05)
        assert float(row[3]) == pytest.approx(graph["median_us"], abs=0.05)
        assert float(row[5]) == pytest.approx(stock["median_us"], abs=0.05)
        assert row[7] == f"{eager['ratio_to_stock']:.2f}x" and row[8] == f"{graph['ratio_to_stock']:.2f}x"
    assert "no CUDA graphs" in out


def test_hostcall_stock_times_fsdp2s_own_functions():
    """The patched names are the ones FSDP2's param group calls (it imports them by name): a
    rename in torch would leave the stock column timing nothing, which measure() refuses."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fpg
    for name in hostcall_stock._TIMED:
        assert getattr(fpg, name) is getattr(coll, name)


def test_hostcall_rejects_one_rank(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "hostcall", "--device", "cpu", "--ranks", "1"])
