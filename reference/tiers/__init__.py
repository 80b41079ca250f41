"""kvcc.reference.tiers: where KV blocks live — GPU memory, host DRAM, local NVMe, a shared pool.

Every tier implements ``base.Tier``: epochs as fencing tokens per key, atomic publish, checksums
verified on every read (a damaged copy reads as a ``Miss``, never as other bytes), no eviction of
its own. ``base`` states the contract; each module opens with how its tier keeps it.

``dram`` and ``gpu`` import torch; ``nvme`` and ``pool`` do not (they take torch tensors when the
caller has torch loaded), so the classes are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import (
    Absent,
    BlockInfo,
    CorruptFence,
    Fenced,
    FreeOutcome,
    Freed,
    Hit,
    Miss,
    MissReason,
    NoSpace,
    ReadOutcome,
    RecoveryReport,
    Stored,
    Tier,
    TierClosed,
    WriteOutcome,
)

if TYPE_CHECKING:
    from .dram import DramTier
    from .gpu import GpuTier
    from .nvme import NvmeTier
    from .pool import SharedPoolTier

_LAZY = {"DramTier": "dram", "GpuTier": "gpu", "NvmeTier": "nvme", "SharedPoolTier": "pool"}

__all__ = [
    "Absent", "BlockInfo", "CorruptFence", "DramTier", "Fenced", "FreeOutcome", "Freed", "GpuTier", "Hit",
    "Miss", "MissReason", "NoSpace", "NvmeTier", "ReadOutcome", "RecoveryReport", "SharedPoolTier", "Stored",
    "Tier", "TierClosed", "WriteOutcome",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
