"""The CUDA backend of tide.VirtualCluster: every rank of a topology on this process's GPU(s).

The CUDA executor (csrc/exec/cuda) runs the same programs the CPU executor runs, over an
in-process fabric: each rank has its own zeroed cudaMalloc arena and its own named streams, and
peers are addressed by plain device pointers. Arrays are torch CUDA tensors or any DLPack device
array (converted with torch.from_dlpack); numpy inputs are copied to the GPU. Outputs are torch
tensors (copies out of the landing / output buffers).

[Note: stream handoff] Inputs are produced on torch's current stream of each rank's device, which
the session passes as that rank's caller stream: the call's streams wait for its prior work and it
waits for the call (no host sync inside the executor). The virtual cluster is synchronous like the
CPU one, so each call then synchronises the executor (its watchdog reports a late wait) and the
current streams.
"""
from __future__ import annotations

from tide import _core

_TORCH_DTYPES = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16", "uint8": "uint8"}
KIND = dict(_core.buf_kinds)


def _torch():
    import torch
    return torch


class CudaBackend:
    """Arrays and arenas of the CUDA virtual cluster (torch tensors; InProcessFabric arenas)."""

    name = "cuda"

    def __init__(self, vc, device: int = 0, devices=None):
        if not _core.cuda.built or not _core.cuda.available():
            raise _core.PlanError("VirtualCluster(backend='cuda') needs a CUDA build of tide._core and a GPU")
        self.vc = vc
        self.devices = [int(d) for d in devices] if devices else [int(device)]
        n_dev = _core.cuda.device_count()
        for d in self.devices:
            if not 0 <= d < n_dev:
                raise _core.PlanError(f"VirtualCluster.devices: device {d} does not exist ({n_dev} usable)")
        self.keep: list = []
        self._fabrics: dict[int, tuple] = {}  # id(executor) -> (fabric, regions)

    def device_of(self, rank: int) -> int:
        return self.devices[rank % len(self.devices)]

    def executor(self, plan, kinds, pull_landing: bool = False):
        regions, total = _core.session_arena(plan, kinds, pull_landing=pull_landing)
        devices = [self.device_of(r) for r in range(self.vc.world)]
        name, (_, nbytes) = max(regions.items(), key=lambda kv: kv[1][1])
        for d in sorted(set(devices)):  # before any arena is allocated, naming what makes it large
            _core.cuda.check_device_room(d, devices.count(d), total, "VirtualCluster",
                                         f"the largest region is '{name}' ({nbytes} bytes per rank)")
        fabric = _core.cuda.InProcessFabric(devices, total)
        ex = _core.cuda.ClusterExecutor(fabric, options=self.vc.options.as_dict())
        self._fabrics[id(ex)] = (fabric, regions)
        return ex

    def region(self, ex, r: int, kind: str) -> tuple[int, int]:
        fabric, regions = self._fabrics[id(ex)]
        off, nbytes = regions[kind]
        return fabric.arena_ptr(r) + off, nbytes

    def _as_cuda(self, x, dtype, device: int, what: str = "input"):
        torch = _torch()
        if not isinstance(x, torch.Tensor):
            try:
                x = torch.from_dlpack(x)
            except Exception:  # noqa: BLE001 - numpy / lists
                import numpy as np
                a = np.asarray(x)
                if a.dtype.name == "bfloat16":
                    x = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
                else:
                    x = torch.from_numpy(np.ascontiguousarray(a))
        x = x.to(device=f"cuda:{device}")
        if dtype.itemsize == 1 and x.element_size() == 1 and x.dtype != dtype and not x.dtype.is_complex:
            x = x.contiguous().view(dtype)  # 1-byte items (e.g. float8 data) are bytes: bitwise
        if x.dtype != dtype:  # a lossless conversion only: TIDE never rounds an input
            y = x.to(dtype) if not (x.is_complex() or x.dtype == torch.bool) else None
            if y is None or not torch.equal(torch.nan_to_num(y.double(), nan=0.5),
                                            torch.nan_to_num(x.double(), nan=0.5)):
                name = str(dtype).replace("torch.", "")
                raise _core.PlanError(f"{what}: dtype {x.dtype}, the plan's is {name}, and its values are not all "
                                      f"exactly {name}: convert it yourself (TIDE never rounds an input)")
            x = y
        return x.contiguous().reshape(-1)

    def _dtype(self, name: str):
        return getattr(_torch(), _TORCH_DTYPES[name])

    def binding(self, kind: str, index: int, t) -> tuple:
        self.keep.append(t)
        return (KIND[kind], index, t.data_ptr(), t.numel() * t.element_size())

    def flat(self, x, dtype_name: str, r: int, what: str = "input"):
        return self._as_cuda(x, self._dtype(dtype_name), self.device_of(r), what)

    @staticmethod
    def pad(x, n: int):
        if x.numel() == n:
            return x
        torch = _torch()
        buf = torch.zeros(n, dtype=x.dtype, device=x.device)
        buf[: x.numel()] = x
        return buf

    def out(self, n: int, r: int, init, poison: bool):
        torch = _torch()
        if init is None:
            return torch.full((n,), float("nan") if poison else 0.0, dtype=torch.float32,
                              device=f"cuda:{self.device_of(r)}")
        return self._as_cuda(init, torch.float32, self.device_of(r), f"reduce_scatter: accumulate[{r}]").clone()

    @staticmethod
    def size(t) -> int:
        return int(t.numel())

    def _stream(self, r: int) -> int:
        torch = _torch()
        return torch.cuda.current_stream(self.device_of(r)).cuda_stream

    def write_region(self, ex, r: int, kind: str, offset: int, t) -> None:
        base, _ = self.region(ex, r, kind)
        self.keep.append(t)
        _core.cuda.copies([(base + offset, t.data_ptr(), t.numel() * t.element_size(), 1, 0, 0)], self._stream(r))

    def fill_region(self, ex, r: int, kind: str, value: int) -> None:
        base, nbytes = self.region(ex, r, kind)
        _core.cuda.memset(base, value, nbytes, self._stream(r))

    def read_region(self, ex, r: int, kind: str, nbytes: int):
        torch = _torch()
        base, _ = self.region(ex, r, kind)
        d = self.device_of(r)
        land = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{d}")
        _core.cuda.copies([(land.data_ptr(), base, nbytes, 1, 0, 0)], self._stream(r))
        torch.cuda.current_stream(d).synchronize()
        return land

    def view(self, raw, begin: int, nbytes: int, dtype_name: str, shape):
        return raw[begin: begin + nbytes].view(self._dtype(dtype_name)).reshape(shape)

    def streams(self) -> list:
        return [self._stream(r) for r in range(self.vc.world)]

    def finish(self, ex) -> None:
        pass  # the GPU may still read the call's buffers: wait() releases them

    def wait(self, ex) -> None:
        torch = _torch()
        ex.synchronize()
        for d in self.devices:
            torch.cuda.current_stream(d).synchronize()
        self.keep.clear()

    def add(self, a, b):
        return a + b

    def copy(self, a):
        return a.clone()
