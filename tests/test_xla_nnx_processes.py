"""Acceptance of tide_xla across processes with a model no other test holds: a Flax NNX conv stem
and MLP-mixer blocks (tests/_xla_nnx_worker.py: lists, dicts, a bias-free Linear, a (1,)-row
parameter, leaves with fewer rows than ranks) trains 3 AdamW steps on XLA:CPU as 2 processes x 4
devices (one node of 8 ranks) and as 4 processes x 2 devices on 2 nodes x 4; every process's
per-device losses and final fp32 shards are bitwise those of one process holding all 8 devices
on the same topology."""
import os

import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("optax")

from xla_mp_helpers import REPO, assert_same_shards, launch  # noqa: E402

WORKER = os.path.join(REPO, "tests", "_xla_nnx_worker.py")


def _launch(out_dir, processes: int, case: str, topology: str | None = None):
    env = dict(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // processes}")
    return launch(out_dir, processes, case, topology, env, worker=WORKER, wait_s=90.0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process of 8 devices, trained on each topology below (one run of the worker)."""
    rc, data, err = _launch(tmp_path_factory.mktemp("ref"), 1, "reference")[0]
    assert rc == 0 and data is not None, err
    return data


@pytest.mark.parametrize("processes,topology", [(2, "1x8"), (4, "2x4")])
def test_an_nnx_model_trains_bitwise_equal_to_one_process(tmp_path, reference, processes, topology):
    ref = {k: v for k, v in reference.items() if k.startswith(f"{topology}/")}
    assert any("/loss2/" in k for k in ref) and any("stem" in k for k in ref), sorted(ref)[:8]
    assert_same_shards(_launch(tmp_path, processes, "train", topology), ref)
