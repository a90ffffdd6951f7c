"""The groups of `tide bench layout` and FSDP2's stock layout path for each (tide_apps/bench/layout.py).

A group is a list of parameters (name, unsharded shape, FSDP2 shard dim) in one item size:

  llama70b, qwen3, wan22  the paper's three models' blocks (tide/models.py), bf16, Shard(0)
  llama70b_fp8            the Llama-3.1-70B block's seven nn.Linear weights as torchao's Float8
                          training gathers them with ``enable_fsdp_float8_all_gather``: each
                          weight's ``fsdp_pre_all_gather`` returns its float8_e4m3fn data as the one
                          all-gather input and its fp32 scale as metadata (torchao/float8/
                          fsdp_utils.py), so the wire carries 1-byte items (planned "uint8",
                          tide_torch/extensions.py [Note: all-gather extensions]), half the bf16
                          bytes. The block's two RMSNorm weights are no Float8Linear: under
                          tide_torch they are a bf16 chunk of their own (a dtype class), left out.
                          The reduce-scatter is the bf16 gradients' (llama70b's rows): AG only.
  moe_shard1              64 experts of Qwen3-30B-A3B's grouped expert weights (w1, w2, w3; the
                          128 experts over an expert-parallel degree of 2), sharded on dim 1 as
                          torchtitan places experts when EP x FSDP exceeds the expert count
                          (``shard_placement_fn`` -> Shard(1)); planned as rows (tide/plan.py
                          [Note: Shard(k) as rows]).

Stock (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), every rank's work at once:
  AG  all_gather_copy_in (``_foreach_copy_`` of the shards into the flat input), the collective
      (the rank-major output: one copy of the N packed inputs), ``split_with_sizes_copy`` into
      the per-parameter all-gather outputs; a Shard(k > 0) parameter is split into a temporary
      and ``torch.cat``-ed on dim k into its output (foreach_all_gather_copy_out).
  RS  (foreach_reduce) a Shard(k > 0) gradient is reordered first, ``torch.cat(torch.chunk(g, N,
      dim=k), dim=0)``; then ``_chunk_cat`` into the fp32 reduce-scatter input.
The builders here take torch and a device, so the CPU tests run the stock path and the TIDE CPU
cluster on small groups of the same kinds (tests/test_bench_layout_rows.py).
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from math import prod

# The plain groups: bench name -> built-in model (tide/models.py holds the shapes and their configs).
GROUPS = {"llama70b": "llama3.1-70b", "qwen3": "qwen3-30b-a3b", "wan22": "wan2.2-14b"}


@dataclass(frozen=True)
class Group:
    name: str
    params: tuple[tuple[str, tuple[int, ...], int], ...]  # (name, unsharded shape, shard dim)
    item: str = "bfloat16"   # the AG item dtype: "bfloat16" or "uint8" (float8 data as bytes)
    rs: bool = True          # False: the group's RS is another group's (the fp8 weights' bf16 RS)
    note: str = ""

    @property
    def item_size(self) -> int:
        return 1 if self.item == "uint8" else 2

    @property
    def shard_dims(self) -> bool:
        return any(d for _, _, d in self.params)


def _plain(name: str) -> Group:
    from tide import models
    return Group(name, tuple((n, tuple(s), 0) for n, s in models.groups(GROUPS[name])["block"]))


def llama70b_fp8() -> Group:
    from tide import models
    lin = [(n, tuple(s), 0) for n, s in models.groups("llama3.1-70b")["block"] if len(s) == 2]
    return Group("llama70b_fp8", tuple(lin), item="uint8", rs=False,
                 note="torchao Float8 all-gather: float8_e4m3fn weights as 1-byte items, scales as metadata")


def moe_shard1(experts: int = 64, dim: int = 2048, moe: int = 768) -> Group:
    """Grouped experts (torchtitan's GroupedExperts: w1/w3 (E, moe, dim), w2 (E, dim, moe));
    sizes from Qwen3-30B-A3B's config (tide/models.py), `experts` of its 128."""
    return Group("moe_shard1", (("experts.w1", (experts, moe, dim), 1), ("experts.w2", (experts, dim, moe), 1),
                                ("experts.w3", (experts, moe, dim), 1)),
                 note=f"{experts} grouped experts, Shard(1)")


def group(name: str) -> Group:
    if name in GROUPS:
        return _plain(name)
    if name in EXTRA:
        return EXTRA[name]()
    raise KeyError(name)


EXTRA = {"llama70b_fp8": llama70b_fp8, "moe_shard1": moe_shard1}
NAMES = tuple(GROUPS) + tuple(EXTRA)


def items(g: Group, world: int) -> list[tuple[int, int | None, tuple[int, ...]]]:
    """The plan's items in order: (parameter, row a or None for a dim-0 parameter, item shape)."""
    from tide.plan import shard_rows
    out = []
    for p, (_, shape, dim) in enumerate(g.params):
        if dim == 0:
            out.append((p, None, shape))
            continue
        rows, item = shard_rows(shape, dim, world)
        out += [(p, a, item) for a in range(rows)]
    return out


def signature(g: Group, world: int):
    """The GroupSignature TIDE plans for `g` over `world` ranks (Shard(k) parameters as rows)."""
    from tide.plan import GroupSignature
    its = items(g, world)
    names = tuple(g.params[p][0] + ("" if a is None else f"[{a}]") for p, a, _ in its)
    grad = "bfloat16"  # 1-byte items are never gradients (the RS is over the bf16 parameters)
    return GroupSignature(shapes=[s for _, _, s in its], ag_dtype=g.item, grad_dtype=grad, shard_dtype=g.item,
                          names=names)


def shard_shape(shape: tuple[int, ...], dim: int, world: int) -> tuple[int, ...]:
    """A rank's (padded) FSDP2 shard: ceil(D_0/N) rows on dim 0, or D_k/N on dim k."""
    s = list(shape)
    s[dim] = -(-s[dim] // world)
    return tuple(s)


def torch_dtype(torch, g: Group):
    return torch.uint8 if g.item == "uint8" else torch.bfloat16


def make_shards(torch, g: Group, world: int, device, seed: int = 1):
    """shards[r][p]: rank r's contiguous local shard of parameter p (bf16 normals, or float8_e4m3fn
    values of normals as bytes for a 1-byte group)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(world):
        row = []
        for _, shape, dim in g.params:
            x = torch.randn(shard_shape(shape, dim, world), device=device, generator=gen)
            row.append(x.to(torch.float8_e4m3fn).view(torch.uint8) if g.item == "uint8" else x.to(torch.bfloat16))
        out.append(row)
    return out


def item_shards(g: Group, world: int, shards_r):
    """One rank's AG inputs per plan item: a dim-0 parameter's shard, or row a of a Shard(k)
    parameter's shard (its (1, c) view: [Note: Shard(k) as rows])."""
    out = []
    for p, a, shape in items(g, world):
        s, dim = shards_r[p], g.params[p][2]
        out.append(s if a is None else s.reshape(prod(s.shape[:dim]), -1)[a].view(1, -1))
    return out


def unsharded_from_items(torch, g: Group, world: int, full_r):
    """Rank r's unsharded parameters as flat byte tensors, from its per-item AG outputs (the
    landing; a Shard(k) parameter's rows back to back are its row-major tensor)."""
    by_param: list[list] = [[] for _ in g.params]
    for (p, _, _), t in zip(items(g, world), full_r):
        by_param[p].append(t.contiguous().reshape(-1).view(torch.uint8))
    out = []
    for p, (_, shape, _) in enumerate(g.params):
        flat = by_param[p][0] if len(by_param[p]) == 1 else torch.cat(by_param[p])
        out.append(flat[:prod(shape) * g.item_size])
    return out


class StockAllGather:
    """FSDP2's all-gather layout path for every rank of one node at once (module docstring):
    copy_in(), collective(), copy_out(); bytes are HBM bytes read + written of each step."""

    def __init__(self, torch, g: Group, shards, world: int):
        self.torch, self.g, self.L = torch, g, world
        L, dev = world, shards[0][0].device
        dt = torch_dtype(torch, g)
        self.inputs = [[s.reshape(-1) for s in row] for row in shards]
        self.sizes = [s.numel() for s in self.inputs[0]]
        Es = sum(self.sizes)
        self.packed = torch.empty(L, Es, dtype=dt, device=dev)       # each rank's all-gather input
        self.ag_out = torch.empty(L, L * Es, dtype=dt, device=dev)   # each rank's rank-major output
        # Each rank's all-gather outputs (dim 0: the unsharded parameter; dim k: a temporary).
        self.temps = [torch.empty(L, L * e, dtype=dt, device=dev) for e in self.sizes]
        self.params = [torch.empty(L, *shape, dtype=dt, device=dev) if dim else None
                       for _, shape, dim in g.params]
        self.outs = [t.view(L * L, e) for t, e in zip(self.temps, self.sizes)]
        b = g.item_size
        self.bytes = dict(copy_in=2 * b * L * Es, collective=2 * b * L * L * Es, copy_out=2 * b * L * L * Es
                          + sum(2 * b * L * prod(shape) for _, shape, dim in g.params if dim))

    def copy_in(self):
        for u in range(self.L):
            self.torch._foreach_copy_(list(self.torch.split(self.packed[u], self.sizes)), self.inputs[u])

    def collective(self):
        self.ag_out.copy_(self.packed.view(1, -1).expand(self.L, -1))

    def copy_out(self):
        torch, L = self.torch, self.L
        torch.split_with_sizes_copy(self.ag_out.view(L * L, -1), self.sizes, dim=1, out=self.outs)
        for p, (_, shape, dim) in enumerate(self.g.params):
            if dim:  # every rank's (N s_0, ..) temporary, chunked on dim 0 and cat on dim k
                pre = list(shard_shape(shape, dim, L))
                pre[0] *= L
                chunks = torch.chunk(self.temps[p].view(L, *pre), L, dim=1)
                torch.cat(chunks, dim=dim + 1, out=self.params[p])

    def __call__(self):
        self.copy_in()
        self.collective()
        self.copy_out()

    def unsharded(self, r: int):
        """Rank r's unsharded parameters as flat byte tensors (compare with unsharded_from_items)."""
        out = []
        for p, (_, shape, dim) in enumerate(self.g.params):
            t = self.params[p][r] if dim else self.temps[p][r]
            out.append(t.reshape(-1)[:prod(shape)].contiguous().view(self.torch.uint8))
        return out


def make_grads(torch, g: Group, world: int, device, seed: int = 2):
    """grads[r][p]: rank r's unsharded bf16 gradient of parameter p, small integers (every fp32
    sum of L of them, times 1/L with L a power of two, is exact in any order)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [[torch.randint(-4, 5, shape, device=device, generator=gen).to(torch.bfloat16)
             for _, shape, _ in g.params] for _ in range(world)]


def item_grads(g: Group, world: int, grads_r):
    """One rank's RS inputs per plan item, read in place: a dim-0 gradient, or row a of a Shard(k)
    gradient as (N, c) (its rank-j block is rank j's shard row: [Note: Shard(k) as rows])."""
    out = []
    for p, a, shape in items(g, world):
        gr = grads_r[p]
        out.append(gr if a is None else gr.reshape(-1, prod(shape))[a].view(shape))
    return out


def reordered_shape(shape, dim: int, world: int) -> tuple[int, ...]:
    """A Shard(k) gradient after FSDP2's reorder: its N dim-k chunks stacked on dim 0."""
    s = list(shape)
    s[0] *= world
    s[dim] //= world
    return tuple(s)


def stock_rs_inputs(torch, g: Group, world: int, grads_r):
    """FSDP2's foreach_reduce before the copy-in: a Shard(k > 0) gradient reordered to dim 0."""
    return [torch.cat(torch.chunk(gr, world, dim=dim), dim=0) if dim else gr
            for gr, (_, _, dim) in zip(grads_r, g.params)]


def stock_rs_reorder_bytes(g: Group, world: int) -> int:
    """HBM bytes of every rank's Shard(k) reorder (bf16 read + written)."""
    return sum(4 * world * prod(shape) for _, shape, dim in g.params if dim)


# ---- the RS references (the bench's checks) ---------------------------------------------------
def bit_diff(torch, want, got, row):
    """(equal bitwise, None or dict(count, first element, its block row, want, got))."""
    ne = want.view(torch.int32) != got.view(torch.int32)
    count = int(ne.sum())
    if count == 0:
        return True, None
    i = int(ne.nonzero()[0, 0])
    return False, dict(count=count, first=i, block_row=i // row, want=float(want[i]), got=float(got[i]))


def _np_grads(torch, grads):
    """Torch gradients as the CPU cluster's numpy arrays (bf16 via ml_dtypes)."""
    from tide_apps.bench.collectives import _np_bf16
    return [[_np_bf16(x.cpu()) for x in row] for row in grads]


def cpu_reference(torch, tide, plan, L, grads, alpha, mode):
    """The CPU VirtualCluster's outputs (torch CUDA fp32 per rank) and a note, or (None, why not)."""
    mem = plan.memory()
    need = L * (mem["arena_bytes"] + 2 * mem["NS_bytes"] + 4 * plan.layout.E)
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if mode == "off":
        return None, "off (--cpu-check off)"
    if mode == "auto" and need > free // 2:
        return None, f"skipped: needs ~{need / 1e9:.0f} GB host memory, {free / 1e9:.0f} GB free (--cpu-check on)"
    vc = tide.VirtualCluster(tide.Topology(1, L), check=False, workers=min(L, os.cpu_count() or 1))
    outs = vc.reduce_scatter(plan, _np_grads(torch, grads), scale=alpha)
    del vc
    gc.collect()
    return [torch.from_numpy(o).cuda() for o in outs], "CPU VirtualCluster"


def _plan_layout(torch, lay, packed):
    """A stock output shard (parameters back to back) in the plan's fp32 shard layout (o32_p)."""
    out = torch.zeros(lay.E, dtype=torch.float32, device=packed.device)
    at = 0
    for o, e in zip(lay.o, lay.e):
        out[o:o + e] = packed[at:at + e]
        at += e
    return out


def rs_diff(torch, lay, ref, outs):
    """None when every rank's output equals the reference on every parameter's elements (o32_p,
    e_p), else dict(rank, count, first element of that rank's parameter elements, want, got)."""
    for r, (w, g) in enumerate(zip(ref, outs)):
        ws = torch.cat([w[o:o + e] for o, e in zip(lay.o, lay.e)])
        gs = torch.cat([g[o:o + e] for o, e in zip(lay.o, lay.e)])
        ok, d = bit_diff(torch, ws, gs, max(1, ws.numel()))
        if not ok:
            d.pop("block_row")
            return dict(rank=r, **d)
    return None
