"""Planner face: Topology, GroupSignature and plan() over tide._core.

`plan()` returns a `tide._core.Plan`: `plan.layout` (R_p, s_p, o_p, S, landing(p, r), rows(p, r),
valid_rows(p, r), S_fp32, B_pack, NS), `plan.ag` / `plan.rs` / `plan.solver` / `plan.options`
(dicts), `plan.memory()` (memory-model terms in bytes and NS units plus the arena table, and
`pull_arena` / `pull_arena_bytes`: the arena of a TIDE-AG that pulls, stage and one-sided counters
only, [Note: pulled arena] in csrc/include/tide/plan.h), `plan.region(name)` and `plan.hash`.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from tide import _core

PlanError = _core.PlanError

# Options accepted by plan(); 0 means "let the solver choose" where the solver owns the value.
# Ranges (checked by the core, "Option ranges" in csrc/include/tide/plan.h) after each default.
_INT_OPTIONS = {
    "w_wave": 0,        # W_wave, contributors per wave (0 -> L); 0..L
    "k": 0,             # max concurrent rail transfers per round (0 -> solver); 0..32
    "n_part": 0,        # sub-slice passes per reduce-scatter (0 -> planner); 0..16
    "n_stg": 2,         # local bf16 staging slots; 1..16
    "chunk_bytes": 0,   # RS staging chunk (0 -> planner: n_stg slots within one output block);
                        # else >= one gradient element and <= 1024 chunks per sub-slice pass
    "sum_ctas": 0,      # C_sum (0 -> solver, Eq. 13); 0..4096
    "land_ctas": 0,     # C_mc (0 -> solver, Eq. 14); 0..4096
    "ag_head_bytes": 8 << 20,  # >= 0 (0: no head/tail split)
}


# The outbox/spare bank of TIDE-RS call `seq` (1, 2, ...): b = (seq - 1) mod 2, as Algorithm 1
# numbers calls. The core's rule (tide/session.h), the one every session applies.
rs_bank = _core.rs_bank


def _as_int(value: Any, where: str, bits: int = 64) -> int:
    if isinstance(value, bool):
        raise PlanError(f"{where}: {value!r} is a bool, not an integer")
    try:
        v = operator.index(value)
    except TypeError:
        raise PlanError(f"{where}: {value!r} is not an integer") from None
    if not -(1 << (bits - 1)) <= v < (1 << (bits - 1)):
        raise PlanError(f"{where}: {v} does not fit in {bits} bits")
    return v


@dataclass(frozen=True)
class Topology:
    """M nodes x L GPUs per NVSwitch domain; node-major rank r = n*L + l."""

    nodes: int = 1
    gpus_per_node: int = 1

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class GroupSignature:
    """One FSDP2 parameter group: unsharded shapes (dim-0 sharded) and dtypes."""

    shapes: Sequence[Sequence[int]]
    ag_dtype: str = "bfloat16"
    grad_dtype: str = "bfloat16"
    shard_dtype: str | None = None  # None: same as ag_dtype (no cast)
    names: Sequence[str] = field(default_factory=tuple)

    @classmethod
    def from_json(cls, obj: Any, **dtypes) -> "GroupSignature":
        """A list of shapes, or a {name: shape} mapping (the `tide plan --shapes` file format)."""
        if isinstance(obj, Mapping):
            return cls(shapes=tuple(obj.values()), names=tuple(str(k) for k in obj), **dtypes)
        if isinstance(obj, (list, tuple)):
            return cls(shapes=tuple(obj), **dtypes)
        raise PlanError(f"GroupSignature.shapes: expected a list of shapes or a {{name: shape}} "
                        f"mapping, got {type(obj).__name__}")


def _check_shapes(sig: GroupSignature) -> list[list[int]]:
    if isinstance(sig.shapes, (str, bytes)) or not isinstance(sig.shapes, Sequence):
        raise PlanError(f"GroupSignature.shapes: expected a sequence of shapes, got {sig.shapes!r}")
    names = list(sig.names)
    shapes = []
    for i, s in enumerate(sig.shapes):
        who = f"GroupSignature.shapes[{i}]" + (f" ('{names[i]}')" if i < len(names) else "")
        if isinstance(s, (int, str, bytes)) or not isinstance(s, Sequence):
            raise PlanError(f"{who}: {s!r} is not a sequence of ints")
        shapes.append([_as_int(d, f"{who}[{j}]") for j, d in enumerate(s)])
    return shapes


def plan(sig: GroupSignature, topo: Topology, mode: str = "in_place",
         calibration: Mapping[str, float] | None = None, **options: int):
    """Plan one group on one topology; raises tide.PlanError naming the field at fault.

    options: w_wave, k, n_part, n_stg, chunk_bytes, sum_ctas, land_ctas, ag_head_bytes
    (see tide/plan.py); calibration overrides the solver's Calibration fields (bw_nic, ...).
    """
    unknown = sorted(set(options) - set(_INT_OPTIONS))
    if unknown:
        raise PlanError(f"options: unknown option(s) {', '.join(unknown)} "
                        f"(expected some of {', '.join(_INT_OPTIONS)})")
    opts = {k: _as_int(options.get(k, v), f"Options.{k}",
                    64 if k.endswith("bytes") else 32) for k, v in _INT_OPTIONS.items()}
    if not isinstance(mode, str):
        raise PlanError(f"mode: expected 'in_place' or 'slot_reuse', got {mode!r}")
    for f in ("ag_dtype", "grad_dtype", "shard_dtype"):
        v = getattr(sig, f)
        if v is not None and not isinstance(v, str):
            raise PlanError(f"GroupSignature.{f}: expected a dtype name, got {v!r}")
    shapes = _check_shapes(sig)
    nodes = _as_int(topo.nodes, "Topology.nodes", 32)
    gpus = _as_int(topo.gpus_per_node, "Topology.gpus_per_node", 32)
    return _core.make_plan(
        shapes, [str(n) for n in sig.names], sig.ag_dtype, sig.grad_dtype,
        sig.shard_dtype or sig.ag_dtype, nodes, gpus, mode, calibration=dict(calibration or {}),
        **opts)


def check_options(topo: Topology, mode: str = "in_place", **options: Any) -> dict[str, int]:
    """Planner options checked on their own, before any group is planned (a face's ``enable()``
    / ``init()`` calls it at creation): every name known, every value an int (not a bool, a
    float or a string), every range the core's (``validate_inputs``, "Option ranges" in
    tide/plan.h) for ``topo`` (``w_wave`` <= L, the wave widths App. D refuses). The ranges are
    applied by planning a one-row-per-rank bf16 probe group with the options, so the message is
    the core's: ``PlanError: Options.k: must be in [0, 32] ..., got -1``. What depends on a
    group (``chunk_bytes`` against its gradient dtype and its chunk count) is checked when that
    group is planned. Returns the options as ints. A topology the planner refuses is left to
    the caller's own check (the probe plans with the default options first)."""
    unknown = sorted(set(options) - set(_INT_OPTIONS))
    if unknown:
        raise PlanError(f"options: unknown option(s) {', '.join(unknown)} "
                        f"(expected some of {', '.join(_INT_OPTIONS)})")
    opts = {k: _as_int(v, f"Options.{k}", 64 if k.endswith("bytes") else 32)
            for k, v in options.items()}
    probe = GroupSignature(shapes=[(max(1, topo.world),)], names=("options-probe",))
    try:
        plan(probe, topo, mode=mode)
    except PlanError:
        return opts
    plan(probe, topo, mode=mode, **opts)
    return opts


def layout(shapes: Sequence[Sequence[int]], world: int, ag_dtype: str = "bfloat16",
           grad_dtype: str = "bfloat16"):
    """The planner's layout of a group sharded over `world` ranks (paper Section 2.1, Eqs. 2-3):
    per parameter D, K, R = ceil(D / N), e = R K, the packed byte offset o and the fp32 element
    offset o32; E, S, S_fp32 for the group. Faces ask this instead of re-deriving it."""
    sig = GroupSignature(shapes=shapes)
    return _core.make_layout(_check_shapes(sig), _as_int(world, "world", 32), ag_dtype, grad_dtype)


MAX_PARAMS = 256  # tide::kMaxParams: the parameters one plan holds


# [Note: Shard(k) as rows]
# A parameter sharded on dim k > 0 over N ranks (FSDP2's Shard(k): MoE expert weights on dim 1)
# has shape (A_0.., D_k, B..), each rank's shard being columns [r D_k/N, (r+1) D_k/N) of every
# one of its A = prod(A_0..) rows, contiguous as (A, D_k/N, B..). Planned as A consecutive
# dim-0 items of shape (N, c), c = (D_k/N) prod(B..) (R = 1, s = c b), item a's landing is
#     landing(a, r) = (o_0 + a s) N + r s = o_0 N + a (N s) + r s,
# which is exactly byte (a, r-th column block) of the row-major unsharded tensor at o_0 N: the
# strided landing of rank r's columns, with no change to Eq. 2 and no copy. The A items' packed
# shards (o_a = o_0 + a s) are the rank's contiguous (A, D_k/N, B..) shard, and item a's gradient
# is row a of the unsharded gradient (N c contiguous elements), whose rank-r block is the
# rank's reduced shard row: TIDE-RS reads the gradient in place and writes the Shard(k) shard.
# The items must be consecutive in one plan (a face checks where it chunks).
def shard_rows(shape: Sequence[int], dim: int, world: int) -> tuple[int, tuple[int, int]]:
    """(A, item shape (N, c)) of a parameter of ``shape`` sharded on ``dim`` over ``world`` ranks
    ([Note: Shard(k) as rows]); raises PlanError unless ``shape[dim]`` divides by ``world``."""
    shape = [_as_int(d, f"shape[{i}]") for i, d in enumerate(shape)]
    if not 0 < dim < len(shape):
        raise PlanError(f"shard dim {dim}: expected 1..{len(shape) - 1} for shape {tuple(shape)}")
    if shape[dim] % world:
        raise PlanError(f"shard dim {dim}: {shape[dim]} does not divide by {world} ranks")
    rows = 1
    for d in shape[:dim]:
        rows *= d
    cols = shape[dim] // world
    for d in shape[dim + 1:]:
        cols *= d
    return rows, (world, cols)
RS_SCRATCH = ("staging", "outbox", "inbox", "spare")  # TIDE-RS regions groups of one arena share


def region_bytes(plan: Any, name: str) -> int:
    """Bytes of arena region `name` in `plan` (0 where the plan lays it out empty)."""
    try:
        return int(plan.region(name)[1])
    except (AttributeError, KeyError, ValueError, TypeError):
        return 0


def plan_fitting(sig: GroupSignature, topo: Topology, mode: str, options: Mapping[str, int], *,
                 counters: int, regions: Mapping[str, int], rails: str = "one_sided") -> Any:
    """plan() for a reduce-scatter that must run in an arena already laid out (a sub-plan of a
    group's parameters): a PlanError names the resource when it needs more than `counters`
    counters (one reserved range) or more of a TIDE-RS scratch region than `regions` holds."""
    p = plan(sig, topo, mode=mode, **options)
    space = _core.CounterSpace()
    space.reserve(p, "reduce_scatter", rails=rails)
    if space.used > counters:
        raise PlanError(f"needs {space.used} counters, a reserved range holds {counters}")
    for name in RS_SCRATCH:
        if region_bytes(p, name) > regions.get(name, 0):
            raise PlanError(f"its {name} needs {region_bytes(p, name)} B, the arena holds "
                            f"{regions.get(name, 0)} B")
    return p


def plan_chunks(sig: GroupSignature, topo: Topology, mode: str = "in_place",
                **options: int) -> list[tuple[int, Any]]:
    """A group of any number of parameters as plans of at most MAX_PARAMS consecutive ones:
    [(first parameter, plan)], in order (one entry for a group of at most MAX_PARAMS)."""
    out = []
    for first in range(0, len(sig.shapes), MAX_PARAMS):
        end = first + MAX_PARAMS
        part = GroupSignature(shapes=list(sig.shapes[first:end]), ag_dtype=sig.ag_dtype,
                              grad_dtype=sig.grad_dtype, shard_dtype=sig.shard_dtype,
                              names=tuple(sig.names[first:end]))
        out.append((first, plan(part, topo, mode=mode, **options)))
    return out


def _cut(members: list[int], bundles: Sequence[int] | None) -> list[list[int]]:
    """``members`` in runs of at most MAX_PARAMS, never splitting consecutive members of one
    bundle (a bundle longer than MAX_PARAMS is cut where it must)."""
    if bundles is None:
        return [members[i:i + MAX_PARAMS] for i in range(0, len(members), MAX_PARAMS)]
    runs: list[list[int]] = []
    for m in members:
        if runs and bundles[m] == bundles[runs[-1][-1]] and len(runs[-1]) < MAX_PARAMS:
            runs[-1].append(m)  # the bundle continues
        else:
            runs.append([m])
    pieces: list[list[int]] = []
    for run in runs:
        if pieces and len(pieces[-1]) + len(run) <= MAX_PARAMS:
            pieces[-1] += run
        else:
            pieces.append(run)
    return pieces


def plan_classes(shapes: Sequence[Sequence[int]], dtypes: Sequence[tuple[str, str, str]],
                 topo: Topology, mode: str = "in_place", names: Sequence[str] = (),
                 bundles: Sequence[int] | None = None,
                 **options: int) -> list[tuple[tuple[int, ...], Any]]:
    """A group whose parameters may differ in dtype as plans of one dtype class each:
    ``dtypes[p]`` = (ag, grad, shard) dtype names of parameter p. Each class's parameters, in
    group order, MAX_PARAMS at a time, are one plan: [(their group indices, plan)], ordered by
    first parameter. A group of one class is plan_chunks' consecutive chunks. ``bundles[p]``:
    consecutive parameters with the same bundle stay in one plan where they fit (the rows of a
    Shard(k) parameter: [Note: Shard(k) as rows])."""
    if len(dtypes) != len(shapes):
        raise PlanError(f"dtypes: {len(dtypes)} entries for {len(shapes)} parameters")
    names = list(names) or [""] * len(shapes)
    classes: dict[tuple[str, str, str], list[int]] = {}
    for p, d in enumerate(dtypes):
        classes.setdefault(tuple(d), []).append(p)
    pieces = sorted((piece, cls) for cls, members in classes.items()
                    for piece in _cut(members, bundles))
    out = []
    for members, (ag, grad, shard) in pieces:
        sig = GroupSignature(shapes=[shapes[p] for p in members], ag_dtype=ag, grad_dtype=grad,
                             shard_dtype=shard, names=tuple(names[p] for p in members))
        out.append((tuple(members), plan(sig, topo, mode=mode, **options)))
    return out


def regather_plan(base: Any, sub: Topology, mode: str = "in_place", **options: int) -> Any:
    """The all-gather plan over a sub-group of ``sub.world`` ranks (dividing ``base``'s N) that
    lands where ``base`` lands: ``base``'s shapes padded to N R_p rows, each rank's rows its own in
    the sub-group (an FSDP2 post-forward re-gather), shards in the all-gather dtype. None where
    the two layouts would differ."""
    N = base.layout.N
    if sub.world < 1 or N % sub.world:
        return None
    params = base.layout.params
    padded = [(pl.R * N, *shape[1:]) for pl, shape in zip(params, base.shapes)]
    ag = base.ag_dtype
    # 1-byte AG items (uint8) are never gradients: the re-gather plan's (unused) grad dtype is bf16.
    sig = GroupSignature(shapes=padded, ag_dtype=ag, grad_dtype="bfloat16" if ag == "uint8" else ag, shard_dtype=ag,
                         names=tuple(base.names))
    try:
        p = plan(sig, sub, mode=mode, **options)
    except PlanError:
        return None
    grow = N // sub.world
    same = all(q.R == pl.R * grow and p.layout.landing(i, 0) == base.layout.landing(i, 0)
               for i, (q, pl) in enumerate(zip(p.layout.params, params)))
    return p if same else None
