"""The main job's checks (tide demo): they must really compare, and really pass."""
import numpy as np

import tide
from tide import demo


def test_demo_checks_pass_on_the_cpu_cluster():
    res = demo.run(tide.Topology(2, 2), seed=3)
    for mode in ("in_place", "slot_reuse"):
        assert res[mode]["ag_bitexact"] and res[mode]["rs_int_bitexact"]
        assert 0 <= res[mode]["rs_rel_err"] <= 1e-5


def test_demo_reference_detects_a_wrong_result():
    """The fp64 reference the demo compares with is not vacuous: a perturbed output fails."""
    sig = demo.small_llama_block()
    topo = tide.Topology(1, 2)
    plan = tide.plan(sig, topo)
    rng = np.random.default_rng(0)
    grads = [[rng.standard_normal(s).astype(demo.BF16) for s in sig.shapes] for _ in range(2)]
    outs = tide.VirtualCluster(topo).reduce_scatter(plan, grads, scale=0.5)
    ref = demo._rs_reference(plan, grads, 0.5)
    assert np.allclose(outs[1], ref[1], rtol=0, atol=1e-5)
    bad = np.array(outs[1], copy=True)
    bad[7] += 1e-2
    assert not np.allclose(bad, ref[1], rtol=0, atol=1e-5)
