"""tide_torch: TIDE's FSDP2 adapter.

    fully_shard(block) for each block; fully_shard(model)
    handle = tide_torch.enable(model, mode="in_place")   # or "slot_reuse"
    ... train ...
    handle.disable()

All-gathers land shards directly in the unsharded parameters' storage (arena ring slots);
reduce-scatters read per-parameter gradients and reduce them straight into FSDP2's fp32 sharded
gradients. Importing tide_torch imports torch, never jax.
"""
from tide_torch._patches import TideTorchVersionError
from tide_torch.agreement import TideAgreementError
from tide_torch.enable import TideHandle, enable
from tide_torch.groups import TideEnableError

__all__ = ["TideAgreementError", "TideEnableError", "TideHandle", "TideTorchVersionError",
           "enable"]
