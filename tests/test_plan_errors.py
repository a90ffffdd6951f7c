"""Every bad input raises tide.PlanError naming the field or parameter at fault; plan hash."""
import subprocess
import sys

import pytest

import tide

G, T = tide.GroupSignature, tide.Topology
OK = [(64, 8)]


@pytest.mark.parametrize("sig,topo,kw,match", [
    (G(shapes=[]), T(2, 8), {}, r"GroupSignature\.shapes: the group is empty"),
    (G(shapes=[(4, 0)], names=["w"]), T(2, 8), {}, r"parameter 0 \('w'\): shape\[1\] = 0"),
    (G(shapes=[(8,), (-3, 2)]), T(2, 8), {}, r"parameter 1: shape\[0\] = -3"),
    (G(shapes=[()]), T(2, 8), {}, r"parameter 0: shape is empty"),
    (G(shapes=[(8, 2.5)]), T(2, 8), {}, r"GroupSignature\.shapes\[0\]\[1\]: 2\.5 is not an integer"),
    (G(shapes=[(8, "4")]), T(2, 8), {}, r"shapes\[0\]\[1\]: '4' is not an integer"),
    (G(shapes=[(True, 4)]), T(2, 8), {}, r"shapes\[0\]\[0\]: True is a bool"),
    (G(shapes=[8]), T(2, 8), {}, r"GroupSignature\.shapes\[0\]: 8 is not a sequence"),
    (G(shapes=[(1 << 70,)]), T(2, 8), {}, r"shapes\[0\]\[0\]: .* does not fit in 64 bits"),
    (G(shapes=[(1 << 40, 1 << 30)]), T(2, 8), {}, r"GroupSignature\.shapes: the group is too large"),
    (G(shapes=[(8,)] * 257), T(2, 8), {}, r"257 parameters .* falls back to stock"),
    (G(shapes=OK), T(2, 9), {}, r"Topology\.gpus_per_node: L = 9 .* falls back to stock"),
    (G(shapes=OK), T(2, 0), {}, r"Topology\.gpus_per_node: must be >= 1"),
    (G(shapes=OK), T(0, 8), {}, r"Topology\.nodes"),
    (G(shapes=OK), T(2.0, 8), {}, r"Topology\.nodes: 2\.0 is not an integer"),
    (G(shapes=OK), T(2, 4), {"w_wave": 5}, r"Options\.w_wave: W_wave = 5 exceeds L = 4"),
    (G(shapes=OK), T(2, 4), {"w_wave": -1}, r"Options\.w_wave"),
    (G(shapes=OK), T(2, 4), {"k": -1}, r"Options\.k"),
    (G(shapes=OK), T(2, 4), {"n_part": -1}, r"Options\.n_part"),
    (G(shapes=OK), T(2, 4), {"n_stg": 0}, r"Options\.n_stg"),
    (G(shapes=OK), T(2, 4), {"k": 1.5}, r"Options\.k: 1\.5 is not an integer"),
    (G(shapes=OK), T(2, 4), {"nonsense": 1}, r"options: unknown option\(s\) nonsense"),
    (G(shapes=OK, ag_dtype="int8"), T(2, 8), {}, r"GroupSignature\.ag_dtype: unknown dtype 'int8'"),
    (G(shapes=OK, grad_dtype="fp8"), T(2, 8), {}, r"GroupSignature\.grad_dtype: unknown dtype"),
    (G(shapes=OK, shard_dtype="f64"), T(2, 8), {}, r"GroupSignature\.shard_dtype: unknown dtype"),
    (G(shapes=OK), T(2, 8), {"mode": "both"}, r"mode: unknown mode 'both'"),
    (G(shapes=OK), T(2, 8), {"mode": 1}, r"mode: expected"),
])
def test_plan_error_names_the_field(sig, topo, kw, match):
    with pytest.raises(tide.PlanError, match=match):
        tide.plan(sig, topo, **kw)


def test_plan_error_is_a_value_error_and_not_generic():
    assert issubclass(tide.PlanError, ValueError)
    with pytest.raises(tide.PlanError) as e:
        tide.plan(G(shapes=[]), T(1, 1))
    assert type(e.value) is tide.PlanError


def _hash(shapes=OK, M=4, L=8, **kw):
    dt = {k: kw.pop(k) for k in ("ag_dtype", "grad_dtype", "shard_dtype", "names") if k in kw}
    return tide.plan(G(shapes=shapes, **dt), T(M, L), **kw).hash


def test_hash_equal_for_equal_inputs_and_different_otherwise():
    h = _hash()
    assert h == _hash(shapes=[[64, 8]]) == _hash(names=["anything"])  # names do not change a plan
    others = [_hash(shapes=[(64, 9)]), _hash(shapes=[(8, 64)]), _hash(shapes=OK * 2),
              _hash(M=2), _hash(L=4), _hash(mode="slot_reuse"), _hash(grad_dtype="float32"),
              _hash(ag_dtype="float32"), _hash(shard_dtype="float32"), _hash(k=2),
              _hash(n_part=2), _hash(w_wave=4), _hash(sum_ctas=16), _hash(chunk_bytes=4096)]
    assert h not in others
    assert len(set(others)) == len(others)
    # The solver's choice equals the explicit value, so the resolved plans and hashes agree.
    assert _hash(k=tide.plan(G(shapes=OK), T(4, 8)).solver["k"]) == h


def test_hash_identical_in_another_process():
    code = ("import tide; print(tide.plan(tide.GroupSignature(shapes=[(64, 8)]), "
            "tide.Topology(4, 8)).hash)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) == _hash()
