"""A small SUM/LAND/CAST/ZERO/COPY case for compute-sanitizer (no framework loaded).

Run: compute-sanitizer --tool memcheck python3 tools/gpu_sanitize_case.py
Exits non-zero if a result is wrong; the sanitizer reports bad accesses itself.
"""
import struct
import sys

from tide import _core as c


def f32(xs):
    return struct.pack(f"{len(xs)}f", *xs)


def bf16(xs):
    return b"".join(struct.pack("<f", x)[2:] for x in xs)  # exact for these small integers


def main():
    n = 1003  # ragged: vector body + scalar tail
    staged_vals = [[float((i * (j + 3)) % 7 - 3) for i in range(n)] for j in range(3)]
    own_vals = [float(i % 5) for i in range(n)]
    staged = []
    for v in staged_vals:
        p = c.cuda_malloc(2 * n)
        c.cuda_h2d(p, bf16(v))
        staged.append(p)
    own = c.cuda_malloc(2 * n)
    c.cuda_h2d(own, bf16(own_vals))
    seg = c.cuda_malloc(32 * 2)
    rows = [(0, 800, 0, 0), (800, n - 800, 0, 0xFFFFFFFF)]
    c.cuda_h2d(seg, b"".join(struct.pack("<qqqq", *r) for r in rows))
    dst = c.cuda_malloc(4 * n)
    c.cuda_sum(dst, n, staged, seg, 2, [own], 3, 0)
    c.cuda_synchronize()
    got = struct.unpack(f"{n}f", c.cuda_d2h(dst, 4 * n))
    for i in range(n):
        want = sum(v[i] for v in staged_vals) + (own_vals[i] if i < 800 else 0.0)
        if got[i] != want:
            print("SUM mismatch at", i, got[i], want)
            return 1
    out = c.cuda_malloc(4 * n)
    c.cuda_land([(out, [dst, dst], n)], 0.5, False, 2, 0)
    c.cuda_synchronize()
    land = struct.unpack(f"{n}f", c.cuda_d2h(out, 4 * n))
    if any(land[i] != got[i] for i in range(n)):
        print("LAND mismatch")
        return 1
    half = c.cuda_malloc(2 * n)
    c.cuda_cast(half, out, n, 2, 0)
    c.cuda_zero([(out + 4, 4 * n - 8)], 2, 0)
    c.cuda_copies([(staged[0], staged[1], 2 * n, 1, 0, 0), (staged[2] + 2, own, 64, 4, 128, 100)], 0)
    c.cuda_synchronize()
    for p in staged + [own, seg, dst, out, half]:
        c.cuda_free(p)
    if full_grid() != 0:
        return 1
    print("sanitize case ok")
    return 0


def full_grid():
    """SUM and LAND on a budget above one resident wave: one short-lived CTA per tile
    (kernels.h [Note: full grid]), ragged tail included."""
    n = (1 << 20) + 5
    vals = [float(i % 9 - 4) for i in range(n)]
    src = c.cuda_malloc(2 * n)
    c.cuda_h2d(src, bf16(vals))
    seg = c.cuda_malloc(32)
    c.cuda_h2d(seg, struct.pack("<qqqq", 0, n, 0, 0xFFFFFFFF))
    dst, out = c.cuda_malloc(4 * n), c.cuda_malloc(4 * n)
    c.cuda_sum(dst, n, [src, src], seg, 1, [], 100_000, 0)
    c.cuda_land([(out, [dst], n)], 0.5, False, 100_000, 0)
    c.cuda_synchronize()
    land = struct.unpack(f"{n}f", c.cuda_d2h(out, 4 * n))
    bad = [i for i in range(n) if land[i] != vals[i]]
    for p in (src, seg, dst, out):
        c.cuda_free(p)
    if bad:
        print("full-grid SUM/LAND mismatch at", bad[0], land[bad[0]], vals[bad[0]])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
