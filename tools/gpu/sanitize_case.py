"""A small SUM/LAND/CAST/ZERO/COPY case for compute-sanitizer (no framework loaded).

Run: compute-sanitizer --tool memcheck python3 tools/gpu/sanitize_case.py (tools/gpu/run.py sanitize)
LAND runs as the executors run it: REDUCE over a run table (land=True). The tables come from the
core (cuda.sum_segments, cuda.reduce_runs). Exits non-zero if a result is wrong; the sanitizer
reports bad accesses itself.
"""
import struct
import sys

from tide import _core

cu = _core.cuda


def f32(xs):
    return struct.pack(f"{len(xs)}f", *xs)


def bf16(xs):
    return b"".join(struct.pack("<f", x)[2:] for x in xs)  # exact for these small integers


def land(out, src, n, alpha, ctas):
    """out = alpha * src (fp32), one REDUCE run over one fp32 term."""
    table = cu.reduce_runs([(0, n, [(0, 0)])])
    cu.reduce(out, n, table.ptr, table.count, 1, 1, True, False, alpha, [src], ctas)
    return table  # alive until the caller synchronises


def main():
    n = 1003  # ragged: vector body + scalar tail
    staged_vals = [[float((i * (j + 3)) % 7 - 3) for i in range(n)] for j in range(3)]
    own_vals = [float(i % 5) for i in range(n)]
    staged = []
    for v in staged_vals:
        p = cu.malloc(2 * n)
        cu.h2d(p, bf16(v))
        staged.append(p)
    own = cu.malloc(2 * n)
    cu.h2d(own, bf16(own_vals))
    segs = cu.sum_segments([(0, 800, 0, 0), (800, n - 800, 0, -1)])
    dst = cu.malloc(4 * n)
    cu.sum(dst, n, staged, segs.ptr, segs.count, [own], 3)
    cu.synchronize()
    got = struct.unpack(f"{n}f", cu.d2h(dst, 4 * n))
    for i in range(n):
        want = sum(v[i] for v in staged_vals) + (own_vals[i] if i < 800 else 0.0)
        if got[i] != want:
            print("SUM mismatch at", i, got[i], want)
            return 1
    out = cu.malloc(4 * n)
    keep = land(out, dst, n, 0.5, 2)
    cu.synchronize()
    landed = struct.unpack(f"{n}f", cu.d2h(out, 4 * n))
    if any(landed[i] != 0.5 * got[i] for i in range(n)):
        print("LAND mismatch")
        return 1
    half = cu.malloc(2 * n)
    cu.cast(half, out, n, 2)
    cu.zero([(out + 4, 4 * n - 8)], 2)
    cu.copies([(staged[0], staged[1], 2 * n, 1, 0, 0), (staged[2] + 2, own, 64, 4, 128, 100)])
    cu.synchronize()
    del keep, segs
    for p in staged + [own, dst, out, half]:
        cu.free(p)
    if full_grid() != 0:
        return 1
    print("sanitize case ok")
    return 0


def full_grid():
    """SUM and LAND on a budget above one resident wave: one short-lived CTA per tile
    (kernels.h [Note: full grid]), ragged tail included."""
    n = (1 << 20) + 5
    vals = [float(i % 9 - 4) for i in range(n)]
    src = cu.malloc(2 * n)
    cu.h2d(src, bf16(vals))
    segs = cu.sum_segments([(0, n, 0, -1)])
    dst, out = cu.malloc(4 * n), cu.malloc(4 * n)
    cu.sum(dst, n, [src, src], segs.ptr, segs.count, [], 100_000)
    keep = land(out, dst, n, 0.5, 100_000)
    cu.synchronize()
    landed = struct.unpack(f"{n}f", cu.d2h(out, 4 * n))
    bad = [i for i in range(n) if landed[i] != vals[i]]
    del keep, segs
    for p in (src, dst, out):
        cu.free(p)
    if bad:
        print("full-grid SUM/LAND mismatch at", bad[0], landed[bad[0]], vals[bad[0]])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
