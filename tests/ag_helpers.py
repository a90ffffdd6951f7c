"""Shared helpers for the TIDE-AG tests: reference shards and the numpy all-gather."""
import ml_dtypes
import numpy as np

import tide
from tide import _core

BF16 = np.dtype(ml_dtypes.bfloat16)
SHAPES = [(7, 3), (5,), (20, 2)]


def make_plan(M, L, shapes=SHAPES, shard_dtype=None, **kw):
    topo = tide.Topology(nodes=M, gpus_per_node=L)
    return topo, tide.plan(tide.GroupSignature(shapes=shapes, shard_dtype=shard_dtype), topo, **kw)


def make_fulls(shapes, kind, seed, dtype=BF16):
    rng = np.random.default_rng(seed)
    out = []
    for s in shapes:
        if kind == "int":
            x = rng.integers(-128, 128, size=s).astype(np.float32)
        else:
            x = rng.standard_normal(size=s).astype(np.float32) * 3
        out.append(x.astype(dtype))
    return out


def shard(fulls, plan, N, padded=True):
    """shards[r][p]: rows [r*R_p, (r+1)*R_p) of each full parameter (zero padded)."""
    lay = plan.layout
    shards = []
    for r in range(N):
        row = []
        for p, f in enumerate(fulls):
            R = lay.params[p].R
            part = f[r * R:(r + 1) * R]
            if padded:
                x = np.zeros((R,) + f.shape[1:], dtype=f.dtype)
                x[: len(part)] = part
                part = x
            row.append(part)
        shards.append(row)
    return shards


def reference(fulls, ag_dtype=BF16):
    """What every rank must hold: the full parameters in the AG dtype."""
    return [np.asarray(f).astype(ag_dtype) for f in fulls]


def same_bits(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))
