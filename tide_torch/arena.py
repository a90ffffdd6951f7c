"""One rank's TIDE arena: named regions, and zero-offset tensor views rooted inside it.

Regions (App. F; sizes come from the groups' plans, see ``placement.py``):

- ``ring0`` / ``ring1``: the two position-aware all-gather ring slots. Ring group g (execution
  order) lands in slot g mod 2; each slot is sized for the groups assigned to it.
- ``fixed``: unsharded storage for groups outside the ring (the root group, and groups that do not
  reshard after forward except the folded ring tail).
- ``resident``: adopted sharded parameters of groups whose sharded dtype is the all-gather dtype
  (§3.1 in-place shard adoption: later all-gathers read them without copy-in).
- ``stage``: two receive-stage slots; mixed-precision groups cast their fp32 shards into one.

On CPU the arena is a POSIX shared-memory segment (mode 0600) so that TIDE's CPU executor,
running ranks as processes, can push into peers' arenas. ``enable()`` unlinks its name as soon as
every peer has mapped it (the mapping lives on), so nothing outlives the processes; ``close()``
also runs at exit and from multiprocessing's exit hooks (forked ranks skip atexit).

On CUDA, when this build of tide._core has the CUDA-IPC fabric, the arena is the fabric's
zeroed ``cudaMalloc`` (``tide._core.cuda.IpcFabric``): ``enable()`` exchanges every rank's IPC
handle and opens the peers' arenas, so TIDE's CUDA executor pushes into them (peers on other
GPUs of the node, or other processes on the same GPU). With ``enable(fabric="nccl")`` it is the
``tide._core.cuda.NcclFabric``'s arena instead (``ncclMemAlloc`` in an NCCL symmetric window, peers
mapped by the fabric itself: no handle exchange). Without a fabric it is a plain device
allocation (tests). See [Note: fabric lifetime].

[Note: zero-offset views]
FSDP2 builds unsharded parameters with ``torch.as_strided(..., storage_offset=0)``, and
``copy.deepcopy(get_model_state_dict(model))`` breaks on DTensor local tensors with a non-zero
storage offset. Every view handed to FSDP2 is therefore rooted in a storage of its own that
starts at the view's address (``storage_offset() == 0``) and has its own version counter.
Such storages are not resizable: the FSDPParams whose unsharded data lives here get a per-instance
``free_unsharded_param`` that releases the slot logically instead of resizing storage.

[Note: fabric lifetime]
The fabric owns the device memory (and the peers' IPC mappings); freeing it under a live view
would leave FSDP2 parameters pointing at freed memory. Every CUDA view is therefore made through
``__cuda_array_interface__`` from an object that references the fabric: torch's storage keeps
that object, hence the fabric, alive until the last view (and every alias FSDP2 or autograd made
of it) is gone. The arena holds the fabric too, so peers' mappings stay open while it exists.
Views use the fabric's ``arena_ptr``: the address the executor resolves as this rank's arena
(``fabric->arena(rank)``). On the NCCL fabric that is the own rank's LSA pointer, which aliases
``local_arena_ptr`` (the ``ncclMemAlloc`` pointer); views and executor use the same one.
The NCCL fabric is the exception to "freed with the last view": its teardown (window
deregistration) is collective, so it is not left to each rank's garbage collector.
``close_fabric()`` frees it on every rank together (``TideHandle.disable()``, after the barrier
that follows the ranks' last TIDE work); views made before are dangling afterwards (disable() has
moved every parameter back to private storage by then).
``release()`` (runtime.py [Note: runtime lifetime]) drops the arena's reference to its fabric, so
the CUDA-IPC fabric is freed with its last view. At interpreter exit, ``detach_views()`` (run by
runtime.py's exit hook after its synchronize) sets ``_FabricBytes.fabric = None`` on every view
(views dangle: the process is ending), so the fabrics are freed then, in order, rather than left
to interpreter shutdown. Views of an NCCL fabric still open keep it (its teardown is collective).
"""
from __future__ import annotations

import atexit
import weakref
from typing import Any

import torch

import tide
from tide import shm
from tide.regions import Region, arena_nbytes, layout

class Arena:
    """A contiguous per-rank buffer carved into named regions."""

    def __init__(self, sizes: dict[str, int], device: torch.device, *, rank: int = 0,
                 world: int = 1, fabric: bool = False, nccl: Any = None,
                 nbytes: int | None = None) -> None:
        """``rank``/``world``: this rank in the default process group (the CUDA-IPC fabric's
        world). ``fabric``: on CUDA, allocate through ``tide._core.cuda.IpcFabric`` (else a
        plain device allocation). ``nccl``: instead, a ``tide._core.cuda.NcclFabric`` the caller has
        built (collectively: ``make_nccl_fabric``) whose arena this one is. ``nbytes``: total
        size, at least the regions' (``arena_nbytes(sizes)``; the NCCL fabric's size)."""
        self.device = device
        self.regions = layout(sizes)
        need = arena_nbytes(sizes)
        if nbytes is not None and nbytes < need:
            raise ValueError(f"Arena: nbytes {nbytes} is below the regions' {need} bytes")
        self.nbytes = need if nbytes is None else int(nbytes)
        self.shm_name: str | None = None
        self.closed = False
        self._shm = None
        self.fabric = None
        self.fabric_kind: str | None = None
        if nccl is not None:
            if device.type != "cuda":
                raise ValueError(
                    f"Arena: the NCCL fabric needs CUDA, the arena's device is {device}")
            if nccl.arena_bytes < self.nbytes:
                raise ValueError(f"Arena: the NCCL fabric has {nccl.arena_bytes} bytes, the arena "
                                 f"needs {self.nbytes}")
            self.fabric, self.fabric_kind = nccl, "nccl"
            self._base = _device_view(nccl, int(nccl.arena_ptr), self.nbytes, device)
        elif device.type == "cpu":
            _check_shm_room(self.regions, self.nbytes)
            self.shm_name, self._shm = shm.create("tide", self.nbytes, map_it=True)
            _LIVE.add(self)
            self._base = torch.frombuffer(self._shm, dtype=torch.uint8, count=self.nbytes)
        elif fabric and fabric_api() is not None:
            index = device.index if device.index is not None else torch.cuda.current_device()
            if self.regions:  # more than the device has free: refused naming the largest region
                big = max(self.regions.values(), key=lambda r: r.nbytes)
                tide._core.cuda.check_device_room(index, 1, self.nbytes, "Arena",
                                                  f"the largest region is '{big.name}' ({big.nbytes} bytes)")
            self.fabric, self.fabric_kind = fabric_api()(rank, world, index, self.nbytes), "ipc"
            self._base = _device_view(self.fabric, int(self.fabric.arena_ptr), self.nbytes, device)
        else:
            self._base = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.base_ptr = self._base.data_ptr()
        if self.fabric is not None:
            _FABRIC_ARENAS.add(self)

    def region(self, name: str) -> Region:
        return self.regions[name]

    def view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """1-D tensor of ``numel`` ``dtype`` items at arena byte ``offset``, with its own storage
        (``storage_offset() == 0``, own version counter). See [Note: zero-offset views]."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self.closed:
            raise RuntimeError("arena is closed")
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"arena view [{offset}, {offset + nbytes}) outside {self.nbytes} bytes")
        if self._shm is not None:
            raw = torch.frombuffer(self._shm, dtype=torch.uint8, count=nbytes, offset=offset)
            return raw.view(dtype)
        if self.fabric is not None:  # See [Note: fabric lifetime]
            raw = _device_view(self.fabric, self.base_ptr + offset, nbytes, self.device)
            return raw.view(dtype)
        storage = torch._C._construct_storage_from_data_pointer(
            self.base_ptr + offset, self.device, nbytes)
        out = torch.empty(0, dtype=dtype, device=self.device)
        out.set_(storage, 0, (numel,), (1,))
        return out

    def ipc_handle(self) -> bytes | None:
        """This rank's CUDA IPC handle (None off the CUDA-IPC fabric)."""
        return bytes(self.fabric.handle()) if self.fabric_kind == "ipc" else None

    def open_peers(self, handles: list[bytes | None]) -> None:
        """Maps every peer's arena (``handles[r]`` from rank r; this rank's entry is ignored).
        Only the CUDA-IPC fabric needs it (the NCCL fabric maps its LSA peers itself)."""
        if self.fabric_kind != "ipc":
            return
        missing = [r for r, h in enumerate(handles) if h is None]  # b"": another node's, not mapped
        if missing:
            raise RuntimeError(f"tide_torch: ranks {missing} have no CUDA-IPC arena handle")
        self.fabric.open_peers(list(handles))

    def flat(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A plain (shared-storage) view, for buffers FSDP2 never sees."""
        item = torch.empty((), dtype=dtype).element_size()
        return self._base.narrow(0, offset, numel * item).view(dtype)

    def close(self) -> None:
        """Unlinks the shared-memory name; the mapping lives on while views reference it."""
        if self.closed:
            return
        self.closed = True
        if self._shm is not None:
            shm.unlink(self.shm_name)
            _LIVE.discard(self)
            # The mapping itself stays: views handed out keep the mmap alive and may outlive us.

    def close_fabric(self) -> None:
        """Frees the NCCL fabric (synchronise, deregister the window, free, destroy the
        communicators). Collective: every rank calls it, after every peer's last push into this
        arena (``TideHandle.disable()``: after its barrier). Views are dangling afterwards.
        No-op for the other arenas (the CUDA-IPC fabric is freed with its last view)."""
        self.close()
        if self.fabric_kind == "nccl" and not self.fabric.closed:
            self.fabric.close()

    def release(self) -> None:
        """Drops the arena's reference to its fabric (after this rank's last TIDE work; see
        [Note: fabric lifetime]). An NCCL fabric still open is kept (its teardown is collective:
        close_fabric())."""
        self.close()
        if self.fabric is not None and (self.fabric_kind != "nccl" or self.fabric.closed):
            self.fabric = None

    def describe(self) -> dict[str, int]:
        return {name: r.nbytes for name, r in self.regions.items()}


def make_nccl_fabric(rank: int, world: int, device: torch.device, nbytes: int,
                     unique_id: bytes, gpus_per_node: int) -> Any:
    """``tide._core.cuda.NcclFabric`` of ``nbytes`` on ``device``. Collective over the ``world``
    ranks of ``unique_id``: every rank calls it with the same ``nbytes`` and ``gpus_per_node``
    (the fabric's probe makes every rank raise otherwise)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return tide._core.cuda.NcclFabric(rank, world, index, int(nbytes), unique_id,
                                      gpus_per_node=gpus_per_node)


def nccl_fabric_api_error() -> str | None:
    """Why this build cannot give tide_torch the NCCL fabric (None: it can)."""
    core = tide._core
    if not core.cuda.built:
        return "tide._core was built without CUDA (no tide._core.cuda.RankExecutor)"
    if not core.cuda.nccl_header_version():
        return "tide._core was built without NCCL headers (no NcclFabric)"
    if not core.cuda.available():
        return "no usable CUDA device"
    return None


def fabric_api():
    """tide._core.cuda.IpcFabric when this build has the CUDA-IPC fabric, else None."""
    return tide._core.cuda.IpcFabric if tide._core.cuda.built else None


class _FabricBytes:
    """``nbytes`` of fabric memory at ``ptr``, as a CUDA array; references the fabric."""

    def __init__(self, fabric, ptr: int, nbytes: int) -> None:
        self.fabric = fabric
        _VIEWS.add(self)
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


def _device_view(fabric, ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over fabric memory whose storage keeps the fabric alive (zero offset)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    t = torch.as_tensor(_FabricBytes(fabric, ptr, nbytes), device=device)
    if t.data_ptr() != ptr or t.storage_offset() != 0 or t.untyped_storage().nbytes() != nbytes:
        raise RuntimeError(f"tide_torch: fabric view at {ptr:#x} ({nbytes} bytes) came back as "
                           f"{t.data_ptr():#x} (+{t.storage_offset()}, "
                           f"{t.untyped_storage().nbytes()} bytes)")
    return t


def detach_views() -> None:
    """Interpreter exit only: every arena and view lets go of its fabric (See
    [Note: fabric lifetime]); the fabrics nothing else holds are freed now. An NCCL fabric still
    open is kept."""
    for arena in list(_FABRIC_ARENAS):  # e.g. one an enable() that failed left in a traceback
        arena.release()
    for view in list(_VIEWS):
        fabric = view.fabric
        if fabric is not None and getattr(fabric, "closed", True):  # IpcFabric has no "closed"
            view.fabric = None


def _check_shm_room(regions: dict[str, Region], nbytes: int) -> None:
    """Refuses a segment larger than /dev/shm's free space (tide/shm.py), naming the largest
    region (each rank checks its own segment)."""
    free = shm.free_bytes()
    if free is not None and nbytes > free and regions:
        big = max(regions.values(), key=lambda r: r.nbytes)
        raise tide.PlanError(f"Arena: {nbytes} bytes of shared memory exceed the {free} bytes free in "
                             f"/dev/shm; the largest region is '{big.name}' ({big.nbytes} bytes)")


_LIVE: "weakref.WeakSet[Arena]" = weakref.WeakSet()
_VIEWS: "weakref.WeakSet[_FabricBytes]" = weakref.WeakSet()  # live fabric views' roots
_FABRIC_ARENAS: "weakref.WeakSet[Arena]" = weakref.WeakSet()  # arenas over a fabric


@atexit.register
def _unlink_all() -> None:
    for arena in list(_LIVE):
        arena.close()


def _register_fork_exit_hook() -> None:
    from multiprocessing import util
    util.Finalize(None, _unlink_all, exitpriority=100)


_register_fork_exit_hook()
