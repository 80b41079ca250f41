"""Helpers shared by the storage-tier tests (``test_tiers``, ``test_tiers_recovery``,
``test_tiers_stateful``): the tier kinds, keys, the one true payload of a (key, gen), making and
reopening a tier, and the ``kind`` and ``tier`` fixtures (a test module imports them)."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest

from kvcc.reference.tiers import DramTier, GpuTier, NvmeTier, SharedPoolTier
from kvcc.reference.tiers.base import HEADER_BYTES, PAGE_BYTES, round_up

torch = pytest.importorskip("torch")

BLOCK = 64 << 10
SLOTS = 8
KINDS = ["dram", "gpu", "nvme", "pool"]
DURABLE = ["nvme", "pool"]
CUDA = torch.cuda.is_available()


def K(i: int) -> bytes:
    return hashlib.sha256(f"kvcc-test-key-{i}".encode()).digest()


def payload(key: bytes, gen: int, n: int, salt: int = 0) -> bytes:
    """The one true content of (key, gen): anything else read back is wrong bytes."""
    return hashlib.shake_256(key + gen.to_bytes(8, "little") + salt.to_bytes(8, "little")).digest(n)


def pool_capacity(blocks: int, block: int = BLOCK) -> int:
    return blocks * (PAGE_BYTES + round_up(block))


def make(kind: str, path: Path, slots: int = SLOTS, block: int = BLOCK, **kw):
    if kind == "dram":
        return DramTier(slots, block, **kw)
    if kind == "gpu":
        # scripts/gpu_check.sh sets KVCC_TEST_GPU_DEVICE=cuda: there a CPU fallback is a failure.
        return GpuTier(slots, block, **{"device": os.environ.get("KVCC_TEST_GPU_DEVICE"), **kw})
    if kind == "nvme":
        return NvmeTier(path / "nvme", block, slots * block, **kw)
    if kind == "pool":
        return SharedPoolTier(path / "pool", pool_capacity(slots, block), **kw)
    raise AssertionError(kind)


def reopen(kind: str, tier, path: Path):
    tier.close()
    if kind == "nvme":
        return NvmeTier(path / "nvme")
    return SharedPoolTier(path / "pool", tier.capacity_bytes)


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


@pytest.fixture
def tier(kind, tmp_path):
    t = make(kind, tmp_path)
    yield t
    t.close()


def corrupt(kind: str, tier, key: bytes, gen: int, offset: int, *, header: bool = False) -> None:
    """Flip one byte of the stored block: at ``offset`` into its payload, or into its header."""
    if kind in ("dram", "gpu"):
        slot = tier._by_key[key].slot
        if header:
            tier._headers[slot * HEADER_BYTES + offset] ^= 0xFF
        else:
            i = slot * tier.block_bytes + offset
            tier._arena[i] = int(tier._arena[i]) ^ 0xFF
        return
    if kind == "nvme":
        path, base = tier.slab_path(tier.slot_of(key))
    else:
        path, base = tier._block_path(key), 0  # one file per key: its current generation
    pos = base + offset + (0 if header else PAGE_BYTES)
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


def tier_events(caplog, name: str) -> list[logging.LogRecord]:
    """The tiers' structured log records of event ``name`` (``kvcc.tiers``)."""
    return [r for r in caplog.records if r.name == "kvcc.tiers" and getattr(r, "event", None) == name]
