"""The storage-tier contract (kvcc.reference.tiers.base), checked on every tier.

Each contract test runs on all four tiers (the GPU tier on the CPU device unless CUDA is present);
corruption and recovery tests on the durable ones; crash tests kill a real writer process with
SIGKILL at random points and check what a reopened tier serves; stateful tests drive a tier and a
dict model with the same random operations.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvcc.spec import rules
from kvcc.reference.tiers import (
    Absent,
    CorruptFence,
    DramTier,
    Fenced,
    Freed,
    GpuTier,
    Hit,
    Miss,
    MissReason,
    NoSpace,
    NvmeTier,
    SharedPoolTier,
    Stored,
    TierClosed,
)
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


# ------------------------------------------------------------------------------- round trips


def test_round_trip_bytes_tensor_numpy(tier):
    data = payload(K(1), 1, 5000)
    assert tier.write(K(1), 1, 1, data) == Stored(5000)
    assert tier.read(K(1), 1) == data
    assert tier.contains(K(1), 1) and not tier.contains(K(1), 2)
    assert tier.nbytes(K(1), 1) == 5000

    out = torch.full((BLOCK,), 7, dtype=torch.uint8)
    assert tier.read_into(K(1), 1, out) == Hit(5000)
    assert bytes(out[:5000].numpy()) == data
    assert bool((out[5000:] == 7).all()), "bytes past the block must be untouched"

    import numpy as np

    arr = np.zeros(6000, dtype=np.uint8)
    assert tier.read_into(K(1), 1, arr) == Hit(5000)
    assert arr[:5000].tobytes() == data

    src = torch.frombuffer(bytearray(payload(K(2), 3, BLOCK)), dtype=torch.uint8)
    assert tier.write(K(2), 3, 1, src) == Stored(BLOCK)
    assert tier.read(K(2), 3) == payload(K(2), 3, BLOCK)
    assert tier.write(K(3), 1, 1, b"") == Stored(0)
    assert tier.read(K(3), 1) == b""
    assert sorted(tier.keys()) == sorted([K(1), K(2), K(3)])
    assert {(b.key, b.gen, b.nbytes) for b in tier.blocks()} == {(K(1), 1, 5000), (K(2), 3, BLOCK), (K(3), 1, 0)}


def test_misses_and_replacement(tier):
    assert tier.read_into(K(1), 1, bytearray(10)) == Miss(MissReason.ABSENT)
    assert tier.write(K(1), 1, 1, b"one") == Stored(3)
    assert tier.read_into(K(1), 2, bytearray(10)) == Miss(MissReason.OTHER_GENERATION)
    assert tier.write(K(1), 2, 2, b"two!") == Stored(4)  # a new generation replaces the old
    assert tier.read(K(1), 1) is None
    assert tier.read(K(1), 2) == b"two!"
    assert tier.write(K(1), 2, 2, b"TWO!") == Stored(4)  # same epoch again: accepted (a retry)
    assert tier.read(K(1), 2) == b"TWO!"
    assert tier.keys() == [K(1)]


def test_caller_errors_raise(tier):
    tier.write(K(1), 1, 1, b"x" * 100)
    with pytest.raises(ValueError):
        tier.read_into(K(1), 1, bytearray(99))
    with pytest.raises(ValueError):
        tier.write(b"short", 1, 1, b"x")
    with pytest.raises(TypeError):
        tier.write(K(1), 1, True, b"x")
    with pytest.raises(ValueError):
        tier.write(K(1), -1, 1, b"x")
    with pytest.raises(TypeError):
        tier.read_into(K(1), 1, b"read-only" * 20)
    if tier.name != "pool":
        with pytest.raises(ValueError):
            tier.write(K(2), 1, 1, bytes(BLOCK + 1))
    tier.close()
    with pytest.raises(TierClosed):
        tier.write(K(1), 1, 1, b"x")
    with pytest.raises(TierClosed):
        tier.read_into(K(1), 1, bytearray(100))


# ------------------------------------------------------------------------------- fencing


def _snapshot(tier):
    lru = tier.lru()
    # Reading in LRU order leaves the LRU order as it was.
    return sorted(tier.keys()), lru, tier.used_bytes, {k: tier.read(k, 1) for k in lru}


def test_lower_epoch_refused_without_change(tier):
    assert tier.write(K(1), 1, 5, b"five") == Stored(4)
    assert tier.fence(K(1)) == 5
    before = _snapshot(tier)
    assert tier.write(K(1), 1, 4, b"four") == Fenced(5)
    assert tier.write(K(1), 2, 4, b"four") == Fenced(5)
    assert tier.free(K(1), 4) == Fenced(5)
    assert _snapshot(tier) == before
    assert tier.fence(K(1)) == 5


def test_fence_survives_free(tier):
    assert tier.write(K(1), 1, 5, b"five") == Stored(4)
    assert tier.free(K(1), 5) == Freed()
    assert tier.read_into(K(1), 1, bytearray(4)) == Miss(MissReason.ABSENT)
    assert tier.free(K(1), 5) == Absent()
    assert tier.fence(K(1)) == 5
    assert tier.write(K(1), 2, 4, b"zombie") == Fenced(5)  # a stale writer after the free
    assert tier.read(K(1), 2) is None
    assert tier.write(K(1), 2, 5, b"owner") == Fenced(5)  # rules.slot_accepts: the freed epoch's late bytes too
    assert tier.write(K(1), 3, 7, b"later") == Stored(5)
    assert tier.fence(K(1)) == 7
    assert tier.free(K(2), 0) == Absent()
    assert tier.fence(K(2)) == 0


def test_late_bytes_of_a_freed_epoch_are_refused(tier):
    """rules.slot_accepts: a free under epoch e refuses later writes under e (a paused writer's
    bytes landing after its generation was deleted), not the next grant's."""
    assert tier.write(K(2), 1, 3, b"abandoned") == Stored(9)
    assert tier.free(K(2), 3) == Freed()
    assert tier.write(K(2), 1, 3, b"abandoned") == Fenced(3), "late bytes of the freed epoch"
    assert tier.read_into(K(2), 1, bytearray(9)) == Miss(MissReason.ABSENT)
    assert tier.free(K(2), 3) == Absent()  # a retried free is still taken (and answered)
    assert tier.write(K(2), 2, 4, b"next") == Stored(4)  # the next grant's epoch is
    assert tier.free(K(2), 3) == Fenced(4)
    # A free of a key never written here marks it too (the write may still be in flight).
    assert tier.free(K(3), 2) == Absent()
    assert tier.write(K(3), 1, 2, b"late") == Fenced(0)
    assert tier.write(K(3), 1, 3, b"new") == Stored(3)
    # A fence restored above a block's epoch (a node that rejoined) does not keep the block from
    # its free: the block's own epoch decides (rules.free_takes); a newer block is never freed.
    assert tier.write(K(5), 1, 2, b"ended") == Stored(5)
    tier.restore_fences({K(5): 4})
    assert tier.free(K(5), 2) == Freed()
    assert tier.write(K(5), 2, 4, b"newer") == Stored(5)
    assert tier.free(K(5), 3) == Fenced(4)
    # A fence restored above the mark makes the mark moot (the fence refuses all it did).
    assert tier.free(K(4), 5) == Absent()
    tier.restore_fences({K(4): 7})
    assert tier.write(K(4), 1, 7, b"owner") == Stored(5)


def test_restore_fences(tier):
    tier.write(K(1), 1, 3, b"x")
    tier.restore_fences({K(1): 9, K(2): 4})
    assert tier.fence(K(1)) == 9 and tier.fence(K(2)) == 4
    tier.restore_fences({K(1): 2})
    assert tier.fence(K(1)) == 9, "restore never lowers a fence"
    assert tier.read(K(1), 1) == b"x", "restoring fences does not drop blocks"
    assert tier.write(K(1), 2, 8, b"y") == Fenced(9)
    # rules.free_takes: the block's own epoch (3) decides, not the restored fence: a free under 8
    # drops bytes stored under 3 (an ended generation a rejoined node still held).
    assert tier.free(K(1), 8) == Freed() and tier.fence(K(1)) == 9
    assert tier.write(K(2), 1, 3, b"y") == Fenced(4)
    assert tier.write(K(2), 1, 4, b"y") == Stored(1)


# ------------------------------------------------------------------------------- space and LRU


def test_no_space_and_reuse(tier):
    for i in range(SLOTS):
        assert tier.write(K(i), 1, 1, payload(K(i), 1, BLOCK)) == Stored(BLOCK)
    assert tier.used_bytes <= tier.capacity_bytes
    before = _snapshot(tier)
    assert tier.write(K(99), 1, 1, payload(K(99), 1, BLOCK)) == NoSpace(BLOCK)
    # Replacing a key's own block needs room for the new one first: the tier never evicts.
    assert tier.write(K(0), 2, 1, payload(K(0), 2, BLOCK)) == NoSpace(BLOCK)
    assert _snapshot(tier) == before
    assert tier.free(K(3), 1) == Freed()
    assert tier.write(K(99), 1, 1, payload(K(99), 1, BLOCK)) == Stored(BLOCK)
    for i in [0, 1, 2, 4, 5, 6, 7, 99]:
        assert tier.read(K(i), 1) == payload(K(i), 1, BLOCK)


def test_lru_order_updates_on_read(tier):
    for i in range(4):
        tier.write(K(i), 1, 1, bytes([i]) * 10)
    assert tier.lru() == [K(0), K(1), K(2), K(3)]
    assert isinstance(tier.read_into(K(1), 1, bytearray(10)), Hit)
    assert tier.lru() == [K(0), K(2), K(3), K(1)]
    tier.read_into(K(0), 2, bytearray(10))  # a miss does not count as a use
    assert tier.lru() == [K(0), K(2), K(3), K(1)]
    tier.write(K(0), 2, 1, b"new")
    assert tier.lru() == [K(2), K(3), K(1), K(0)]
    tier.free(K(3), 1)
    assert tier.lru() == [K(2), K(1), K(0)]


# ------------------------------------------------------------------------------- corruption


def _corrupt(kind: str, tier, key: bytes, gen: int, offset: int, *, header: bool = False) -> None:
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
        path, base = tier._block_path(key, gen), 0
    pos = base + offset + (0 if header else PAGE_BYTES)
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


def _events(caplog, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kvcc.tiers" and getattr(r, "event", None) == name]


@pytest.mark.parametrize("where", ["payload", "header"])
def test_corruption_reads_as_miss(kind, tmp_path, caplog, where):
    tier = make(kind, tmp_path)
    data = payload(K(1), 1, 10_000)
    tier.write(K(1), 1, 1, data)
    tier.write(K(2), 1, 1, payload(K(2), 1, 10_000))
    _corrupt(kind, tier, K(1), 1, 7777 if where == "payload" else 40, header=where == "header")
    out = bytearray(b"\xaa" * 10_000)
    with caplog.at_level(logging.WARNING, logger="kvcc.tiers"):
        assert tier.read_into(K(1), 1, out) == Miss(MissReason.CORRUPT)
    assert out == b"\xaa" * 10_000, "a miss must not hand out bytes"
    (rec,) = _events(caplog, "read_corrupt")
    assert rec.tier == tier.name and rec.key == K(1).hex() and rec.gen == 1
    assert tier.read(K(2), 1) == payload(K(2), 1, 10_000), "other blocks are unaffected"
    tier.close()


@pytest.mark.parametrize("kind", DURABLE)
def test_truncation_reads_as_miss(kind, tmp_path, caplog):
    tier = make(kind, tmp_path)
    tier.write(K(1), 1, 1, payload(K(1), 1, 20_000))
    if kind == "nvme":
        path, base = tier.slab_path(tier.slot_of(K(1)))
    else:
        path, base = tier._block_path(K(1), 1), 0
    os.truncate(path, base + PAGE_BYTES + 10_001)
    out = bytearray(20_000)
    with caplog.at_level(logging.WARNING, logger="kvcc.tiers"):
        assert tier.read_into(K(1), 1, out) == Miss(MissReason.TRUNCATED)
    assert out == bytes(20_000)
    assert len(_events(caplog, "read_truncated")) == 1
    os.truncate(path, base + 100)  # into the header itself
    assert tier.read(K(1), 1) is None
    tier.close()


def test_dram_damage_is_a_logged_miss_and_the_key_is_writable_again(caplog):
    """DramTier.damage (the conformance kit's corrupt fault) inverts one byte at rest: every
    damaged header or payload byte is a logged Miss(corrupt) with ``out`` untouched, and the key
    takes a new block once the damaged one is freed."""
    tier = DramTier(4, BLOCK, pin_memory=False)
    probes = [("header", i) for i in range(HEADER_BYTES)] + [("payload", 0), ("payload", 2999), ("payload", 3000)]
    for i, (region, offset) in enumerate(probes):
        k = K(100 + i)
        assert tier.write(k, 1, 1, payload(k, 1, 3000)) == Stored(3000)
        assert tier.damage(k, region, offset)
        out = bytearray(3000)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvcc.tiers"):
            assert tier.read_into(k, 1, out) == Miss(MissReason.CORRUPT), (region, offset)
        assert out == bytes(3000)
        assert len(_events(caplog, "read_corrupt")) == 1
        assert tier.free(k, 1) == Freed()
        assert tier.write(k, 2, 2, payload(k, 2, 3000)) == Stored(3000)
        assert tier.read(k, 2) == payload(k, 2, 3000)
        assert tier.free(k, 2) == Freed()
    assert tier.damage(K(9), "payload", 0) is False
    with pytest.raises(ValueError):
        tier.damage(K(9), "footer", 0)
    with pytest.raises(ValueError):
        tier.damage(K(9), "payload", -1)
    tier.close()


def test_gpu_verify_reads_can_be_switched_off(tmp_path):
    tier = GpuTier(2, 4096, verify_reads=False)
    tier.write(K(1), 1, 1, b"a" * 100)
    _corrupt("gpu", tier, K(1), 1, 5)
    assert isinstance(tier.read_into(K(1), 1, bytearray(100)), Hit)  # trusted memory, unchecked
    _corrupt("gpu", tier, K(1), 1, 20, header=True)
    assert tier.read_into(K(1), 1, bytearray(100)) == Miss(MissReason.CORRUPT), "headers are always checked"


# ------------------------------------------------------------------------------- recovery


class SimulatedCrash(BaseException):
    """Raised by a test hook where a kill -9 would stop the process."""


def _tear(keep: str):
    """A ``_write_slot`` hook that lands only part of a slot write, then 'crashes': ``keep`` is
    "header" (header page and the first payload page) or "payload" (every page but the header's)."""

    def write(fd: int, view: memoryview, offset: int) -> None:
        # Slices of the tier's page-aligned buffer, so that this works under O_DIRECT too.
        if keep == "header":
            os.pwritev(fd, [view[:2 * PAGE_BYTES]], offset)
        else:
            os.pwritev(fd, [view[PAGE_BYTES:]], offset + PAGE_BYTES)
        raise SimulatedCrash

    return write


@pytest.mark.parametrize("keep", ["header", "payload"])
def test_nvme_recovery_drops_torn_and_freed(tmp_path, caplog, keep):
    tier = make("nvme", tmp_path)
    tier.write(K(1), 1, 3, payload(K(1), 1, 9000))
    tier.write(K(2), 1, 3, payload(K(2), 1, 9000))
    assert tier.free(K(2), 3) == Freed()
    tier._write_slot = _tear(keep)  # a crash in the middle of the one write
    with pytest.raises(SimulatedCrash):
        tier.write(K(3), 1, 4, payload(K(3), 1, 9000))
    with caplog.at_level(logging.WARNING, logger="kvcc.tiers"):
        tier = reopen("nvme", tier, tmp_path)
    r = tier.recovery
    # Header landed over a torn payload: a damaged block with no intact one of its key (reported
    # lost: the node cannot tell it from media damage). Payload without header: nothing at all.
    assert (r.kept, r.tombstones) == (1, 1)
    assert r.dropped_corrupt + r.dropped_truncated == (1 if keep == "header" else 0)
    assert r.lost == ((K(3),) if keep == "header" else ())
    damaged = _events(caplog, "recover_bad_payload") + _events(caplog, "recover_truncated")
    assert len(damaged) == (1 if keep == "header" else 0)
    assert tier.read(K(1), 1) == payload(K(1), 1, 9000)
    assert tier.read_into(K(2), 1, bytearray(9000)) == Miss(MissReason.ABSENT)
    out = bytearray(b"\xaa" * 9000)
    assert isinstance(tier.read_into(K(3), 1, out), Miss) and out == b"\xaa" * 9000
    assert tier.fence(K(2)) == 3, "the freed key's fence comes back from its tombstone"
    assert tier.write(K(2), 2, 2, b"zombie") == Fenced(3)
    if keep == "header":
        assert tier.fence(K(3)) == 4, "a torn write's epoch still counts toward the fence"
    tier = reopen("nvme", tier, tmp_path)
    r = tier.recovery
    assert tier.keys() == [K(1)] and r.dropped_corrupt + r.dropped_truncated == 0, "dropped for good"
    tier.close()


@pytest.mark.parametrize("keep", ["header", "payload"])
def test_nvme_torn_replacement_keeps_previous_block(tmp_path, caplog, keep):
    """A write replacing a key's block tears: the previous block is still the published one."""
    tier = make("nvme", tmp_path)
    tier.write(K(1), 1, 1, payload(K(1), 1, 9000))
    tier._write_slot = _tear(keep)
    with pytest.raises(SimulatedCrash):
        tier.write(K(1), 2, 2, payload(K(1), 2, 9000))
    with caplog.at_level(logging.WARNING, logger="kvcc.tiers"):
        tier = reopen("nvme", tier, tmp_path)
    r = tier.recovery
    assert (r.kept, r.lost, r.dropped_corrupt, r.dropped_truncated) == (1, (), 0, 0)
    assert r.dropped_uncommitted == (1 if keep == "header" else 0)
    assert len(_events(caplog, "recover_torn")) == r.dropped_uncommitted
    assert tier.read(K(1), 1) == payload(K(1), 1, 9000)
    assert tier.read(K(1), 2) is None
    assert tier.fence(K(1)) == (2 if keep == "header" else 1)
    # The torn block's tombstone keeps its fence but must not kill the older block: it is still
    # there after another restart, and is replaced normally.
    tier = reopen("nvme", tier, tmp_path)
    assert tier.read(K(1), 1) == payload(K(1), 1, 9000) and tier.recovery.dropped_uncommitted == 0
    assert tier.write(K(1), 3, 2, payload(K(1), 3, 500)) == Stored(500)
    tier = reopen("nvme", tier, tmp_path)
    assert [b.gen for b in tier.blocks()] == [3] and tier.read(K(1), 3) == payload(K(1), 3, 500)
    tier.close()


def test_nvme_bit_flip_anywhere_is_caught(tmp_path):
    """Every single-bit flip of a stored payload reads as a miss, at piece boundaries too."""
    from kvcc.reference.tiers.base import CHECKSUM_PIECE_BYTES

    n = CHECKSUM_PIECE_BYTES + 3 * PAGE_BYTES + 17
    tier = make("nvme", tmp_path, slots=2, block=n)
    data = payload(K(1), 1, n)
    tier.write(K(1), 1, 1, data)
    path, base = tier.slab_path(tier.slot_of(K(1)))
    rng = random.Random(7)
    spots = [0, n - 1, CHECKSUM_PIECE_BYTES - 1, CHECKSUM_PIECE_BYTES] + [rng.randrange(n) for _ in range(12)]
    for pos in spots:
        bit = 1 << rng.randrange(8)
        with open(path, "r+b") as f:
            f.seek(base + PAGE_BYTES + pos)
            b = f.read(1)[0]
            f.seek(base + PAGE_BYTES + pos)
            f.write(bytes([b ^ bit]))
        assert tier.read_into(K(1), 1, bytearray(n)) == Miss(MissReason.CORRUPT), pos
        with open(path, "r+b") as f:
            f.seek(base + PAGE_BYTES + pos)
            f.write(bytes([b]))
        assert tier.read(K(1), 1) == data
    tier.close()


def test_nvme_fences_survive_slot_reuse_and_restore(tmp_path):
    tier = make("nvme", tmp_path, slots=2)
    tier.write(K(1), 1, 7, b"a")
    tier.free(K(1), 7)
    # Reuse every slot (the tombstone of K(1) is overwritten): its fence moves to the journal.
    for i in (2, 3):
        assert tier.write(K(i), 1, 1, b"b") == Stored(1)
    tier.restore_fences({K(9): 11})
    tier = reopen("nvme", tier, tmp_path)
    assert tier.fence(K(1)) == 7 and tier.fence(K(9)) == 11
    assert tier.recovery.journal_records == 2
    assert sorted(tier.keys()) == sorted([K(2), K(3)])
    tier.free(K(2), 1)
    assert tier.write(K(1), 2, 6, b"zombie") == Fenced(7)
    tier.close()


def test_nvme_replacement_interrupted_keeps_newest(tmp_path):
    tier = make("nvme", tmp_path)
    tier.write(K(1), 1, 1, payload(K(1), 1, 100))

    def crash(entry, fence):
        raise SimulatedCrash  # the new block is published; the old one is not yet tombstoned

    tier._erase = crash
    with pytest.raises(SimulatedCrash):
        tier.write(K(1), 2, 2, payload(K(1), 2, 100))
    tier._erase = NvmeTier._erase.__get__(tier)
    tier = reopen("nvme", tier, tmp_path)
    assert tier.recovery.superseded == 1 and tier.recovery.kept == 1
    assert tier.read(K(1), 2) == payload(K(1), 2, 100)
    assert tier.read(K(1), 1) is None
    tier.free(K(1), 2)
    tier = reopen("nvme", tier, tmp_path)
    assert tier.keys() == [], "neither generation comes back after the free"
    tier.close()


def test_nvme_recovery_reports_lost_block(tmp_path, caplog):
    tier = make("nvme", tmp_path)
    tier.write(K(1), 4, 1, payload(K(1), 4, 9000))
    tier.write(K(2), 1, 1, payload(K(2), 1, 9000))
    _corrupt("nvme", tier, K(1), 4, 123)
    with caplog.at_level(logging.WARNING, logger="kvcc.tiers"):
        tier = reopen("nvme", tier, tmp_path)
    assert tier.recovery.lost == (K(1),) and tier.recovery.dropped_corrupt == 1
    assert len(_events(caplog, "recover_bad_payload")) == 1
    assert tier.read_into(K(1), 4, bytearray(9000)) == Miss(MissReason.LOST)
    assert tier.fence(K(1)) == 1
    assert tier.free(K(1), 1) == Freed()
    tier = reopen("nvme", tier, tmp_path)
    assert tier.keys() == [K(2)] and tier.recovery.lost == ()
    tier.close()


def test_pool_recovery(tmp_path, caplog):
    tier = make("pool", tmp_path)
    tier.write(K(1), 0, 1, payload(K(1), 0, 5000))
    shutil.copy(tier._block_path(K(1), 0), tmp_path / "gen0")
    tier.write(K(1), 1, 2, payload(K(1), 1, 5000))
    tier.write(K(2), 1, 2, payload(K(2), 1, 5000))
    tier.free(K(2), 2)
    d = tier._dir(K(1))
    (d / ".tmp-9-1-abandoned").write_bytes(b"half a block")  # a writer killed mid-write
    shutil.copy(tmp_path / "gen0", tier._block_path(K(1), 0))  # an older generation left behind
    tier.write(K(3), 1, 1, payload(K(3), 1, 5000))
    _corrupt("pool", tier, K(3), 1, 99)
    with caplog.at_level(logging.WARNING, logger="kvcc.tiers"):
        tier = reopen("pool", tier, tmp_path)
    r = tier.recovery
    assert (r.kept, r.dropped_uncommitted, r.superseded, r.dropped_corrupt, r.tombstones) == (1, 1, 1, 1, 1)
    assert r.lost == (K(3),)
    assert sorted(os.listdir(d)) == sorted([f"{K(1).hex()}-1", f"{K(1).hex()}.fence", f"{K(1).hex()}.lock"])
    assert tier.read(K(1), 1) == payload(K(1), 1, 5000)
    assert tier.read(K(2), 1) is None and tier.fence(K(2)) == 2
    tier.close()


def test_pool_corrupt_fence_fails_safe(tmp_path):
    tier = make("pool", tmp_path)
    tier.write(K(1), 1, 5, b"x")
    tier._fence_path(K(1)).write_bytes(b"garbage")
    with pytest.raises(CorruptFence):
        tier.write(K(1), 2, 1, b"stale?")
    with pytest.raises(CorruptFence):
        tier.free(K(1), 1)
    assert reopen("pool", tier, tmp_path).recovery.fences_corrupt == (K(1),)
    tier = SharedPoolTier(tmp_path / "pool", pool_capacity(SLOTS))
    tier.restore_fences({K(1): 6})
    assert tier.fence(K(1)) == 6
    assert tier.write(K(1), 2, 5, b"stale") == Fenced(6)
    tier.close()


def test_pool_fencing_across_processes(tmp_path):
    root = tmp_path / "pool"
    here = SharedPoolTier(root, 1 << 24)
    assert here.write(K(1), 1, 3, b"from here") == Stored(9)
    code = textwrap.dedent(f"""
        from kvcc.reference.tiers.pool import SharedPoolTier
        import hashlib
        t = SharedPoolTier({str(root)!r}, 1 << 24)
        key = hashlib.sha256(b"kvcc-test-key-1").digest()
        print(t.write(key, 2, 10, b"from there"), t.write(key, 3, 9, b"stale"))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["Stored(nbytes=10)", "Fenced(fence=10)"]
    assert here.fence(K(1)) == 10
    assert here.write(K(1), 4, 9, b"stale here") == Fenced(10)
    assert here.read(K(1), 1) is None and here.read(K(1), 2) == b"from there"
    here.close()


def test_direct_io_fallback_is_logged_once(tmp_path, monkeypatch, caplog):
    from kvcc.reference.tiers import nvme

    monkeypatch.setattr(nvme, "probe_direct_io", lambda d: (False, "EINVAL (simulated)"))
    with caplog.at_level(logging.WARNING, logger="kvcc.tiers"):
        a = NvmeTier(tmp_path / "n", BLOCK, 2 * BLOCK)
        a.close()
        b = NvmeTier(tmp_path / "n")
    assert not b.direct_io
    assert len(_events(caplog, "direct_io_unavailable")) == 1
    assert b.write(K(1), 1, 1, b"buffered") == Stored(8) and b.read(K(1), 1) == b"buffered"
    b.close()
    with pytest.raises(OSError):
        NvmeTier(tmp_path / "m", BLOCK, 2 * BLOCK, direct_io=True)


def test_geometry_must_match(tmp_path):
    NvmeTier(tmp_path / "n", BLOCK, 4 * BLOCK).close()
    with pytest.raises(ValueError):
        NvmeTier(tmp_path / "n", 2 * BLOCK, 4 * BLOCK)
    with pytest.raises(ValueError):
        NvmeTier(tmp_path / "fresh")


# ------------------------------------------------------------------------------- concurrency


@pytest.mark.parametrize("kind", KINDS)
def test_concurrent_reads_never_see_wrong_bytes(kind, tmp_path):
    """Readers race writers that replace and free blocks: every hit is exact, no miss is 'corrupt'."""
    tier = make(kind, tmp_path, slots=12, block=16384)
    stop = time.monotonic() + 0.6
    bad: list[str] = []

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        epoch = 1
        while time.monotonic() < stop:
            k = rng.randrange(4)
            gen = rng.randrange(3)
            if rng.random() < 0.3:
                tier.free(K(k), 10**6)
            else:
                tier.write(K(k), gen, epoch, payload(K(k), gen, 16384))

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        out = bytearray(16384)
        while time.monotonic() < stop:
            k, gen = rng.randrange(4), rng.randrange(3)
            r = tier.read_into(K(k), gen, out)
            if isinstance(r, Hit) and bytes(out) != payload(K(k), gen, 16384):
                bad.append(f"wrong bytes for {k}/{gen}")
            if isinstance(r, Miss) and r.reason not in (MissReason.ABSENT, MissReason.OTHER_GENERATION):
                bad.append(f"{r} for {k}/{gen}")

    threads = [threading.Thread(target=writer, args=(1,))] + [threading.Thread(target=reader, args=(i,)) for i in (2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad, bad[:5]
    if kind != "pool":
        assert tier.used_bytes == len(tier.keys()) * 16384, "every retired slot went back to the free list"
    tier.close()


def test_read_many_in_parallel(tmp_path):
    tier = make("nvme", tmp_path, slots=6, block=8 << 20)
    for i in range(6):
        tier.write(K(i), 1, 1, payload(K(i), 1, 8 << 20))
    outs = [bytearray(8 << 20) for _ in range(6)]
    assert tier.read_many([(K(i), 1, outs[i]) for i in range(6)]) == [Hit(8 << 20)] * 6
    assert all(outs[i] == payload(K(i), 1, 8 << 20) for i in range(6))
    tier.close()


# ------------------------------------------------------------------------------- crash safety

CHILD = r"""
import hashlib, os, random, sys
kind, path, log_path, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
from kvcc.reference.tiers.base import Fenced, Freed, Absent, Stored

NKEYS, BLOCK = 6, 20000
def K(i): return hashlib.sha256(f"kvcc-test-key-{i}".encode()).digest()
def size(k, g): return hashlib.sha256(K(k) + g.to_bytes(8, "little")).digest()[0] * 77
def payload(k, g): return hashlib.shake_256(K(k) + g.to_bytes(8, "little") + bytes(8)).digest(size(k, g))

gens = [0] * NKEYS
if os.path.exists(log_path):
    for line in open(log_path).read().splitlines():
        p = line.split()
        if p and p[0] == "W":
            gens[int(p[1])] = max(gens[int(p[1])], int(p[2]))
if kind == "nvme":
    from kvcc.reference.tiers.nvme import NvmeTier
    tier = NvmeTier(path, BLOCK, BLOCK * (NKEYS + 2))
else:
    from kvcc.reference.tiers.pool import SharedPoolTier
    tier = SharedPoolTier(path, 1 << 30)
fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
def note(line):
    os.write(fd, (line + "\n").encode())
    os.fsync(fd)
print("ready", flush=True)
rng = random.Random(seed)
while True:
    k = rng.randrange(NKEYS)
    x = rng.random()
    if x < 0.2 and gens[k]:
        note(f"f {k}")
        r = tier.free(K(k), gens[k])
        assert isinstance(r, (Freed, Absent)), r
        note(f"F {k}")
    elif x < 0.3 and tier.fence(K(k)) > 0:
        r = tier.write(K(k), gens[k] + 1, tier.fence(K(k)) - 1, b"stale")
        assert isinstance(r, Fenced), r
    else:
        gens[k] += 1
        note(f"W {k} {gens[k]}")
        r = tier.write(K(k), gens[k], gens[k], payload(k, gens[k]))
        assert isinstance(r, Stored), r
        note(f"S {k} {gens[k]}")
"""


def _truth(k: int, g: int) -> bytes:
    n = hashlib.sha256(K(k) + g.to_bytes(8, "little")).digest()[0] * 77
    return payload(K(k), g, n)


def _check_after_crash(kind: str, path: Path, log_path: Path) -> None:
    """What a reopened tier holds must be explained by the writer's log: per key, the generation
    its last completed operation left (None after a free), or what an operation interrupted by a
    kill would have left (the writer is sequential, so an intent line followed by another intent
    line was interrupted)."""
    text = log_path.read_text() if log_path.exists() else ""
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    allowed: dict[int, set[int | None]] = {k: {None} for k in range(6)}
    history: dict[int, list[str]] = {k: [] for k in range(6)}
    pending: tuple[int, int | None] | None = None  # (key, what it leaves if it completed)

    def interrupted() -> None:
        if pending is not None:
            allowed[pending[0]].add(pending[1])

    for line in lines:
        p = line.split()
        k = int(p[1])
        history[k].append(line)
        if p[0] in ("W", "f"):
            interrupted()
            pending = (k, int(p[2]) if p[0] == "W" else None)
        elif p[0] == "S":
            assert pending == (k, int(p[2])), line
            allowed[k], pending = {int(p[2])}, None
        elif p[0] == "F":
            assert pending == (k, None), line
            allowed[k], pending = {None}, None
    interrupted()
    tier = NvmeTier(path) if kind == "nvme" else SharedPoolTier(path, 1 << 30)
    try:
        found = {b.key: b.gen for b in tier.blocks()}
        for k in range(6):
            present = found.get(K(k))
            assert present in allowed[k], f"key {k}: found gen {present}, allowed {allowed[k]}: {history[k][-6:]}"
            if present is not None:
                data = tier.read(K(k), present)
                assert data == _truth(k, present), f"key {k} gen {present}: wrong bytes after recovery"
            stored = [int(line.split()[2]) for line in history[k] if line.startswith("S")]
            if stored:
                assert tier.fence(K(k)) >= max(stored), f"key {k}: fence went back"
        assert set(found) <= {K(k) for k in range(6)}
    finally:
        tier.close()


@pytest.mark.parametrize("kind", DURABLE)
def test_crash_kill_9_loses_no_acknowledged_write(kind, tmp_path):
    path, log_path = tmp_path / kind, tmp_path / "log"
    rng = random.Random(20240601)
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    wanted = int(os.environ.get("KVCC_CRASH_ITERATIONS", "8"))  # raise it for a soak run
    deadline = time.monotonic() + max(12, 1.5 * wanted)
    iterations = 0
    while iterations < wanted and time.monotonic() < deadline:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, kind, str(path), str(log_path), str(rng.randrange(1 << 30))],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
            time.sleep(rng.uniform(0.02, 0.35))
            assert proc.poll() is None, f"the writer died on its own:\n{proc.stderr.read()}"
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        _check_after_crash(kind, path, log_path)
        iterations += 1
    assert iterations >= 3
    assert sum(1 for line in log_path.read_text().splitlines() if line.startswith("S")) >= 10


# ------------------------------------------------------------------------------- stateful


class TierMachine(RuleBasedStateMachine):
    """The tier against a dict model: same outcomes, same bytes, same fences, across reopens."""

    kind = "nvme"
    slots = 4

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvcc-tiers-"))
        # The pool's quota is in bytes; give it room for every key so the model stays a dict.
        self.tier = make(self.kind, self.dir, slots=self.slots if self.kind != "pool" else 8, block=8192)
        self.blocks: dict[int, tuple[int, bytes]] = {}
        self.fences: dict[int, int] = {}
        self.freed: dict[int, int] = {}  # rules.slot_accepts (in memory; the pool's in its fence files)
        self.epochs: dict[int, int] = {}  # the epoch each block was stored under

    def teardown(self) -> None:
        self.tier.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(k=st.integers(0, 4), gen=st.integers(0, 3), epoch=st.integers(0, 5),
          n=st.sampled_from([0, 1, 4095, 4096, 5000, 8192]), salt=st.integers(0, 3))
    def write(self, k, gen, epoch, n, salt):
        data = payload(K(k), gen, n, salt)
        got = self.tier.write(K(k), gen, epoch, data)
        fence = self.fences.get(k, 0)
        freed = self.freed.get(k)
        if not (rules.fence_accepts(epoch, fence) if freed is None else rules.slot_accepts(epoch, fence, freed)):
            assert got == Fenced(fence)
        elif self.kind != "pool" and len(self.blocks) == self.slots:
            assert got == NoSpace(n)
        else:
            assert got == Stored(n)
            self.blocks[k] = (gen, data)
            self.fences[k] = epoch
            self.epochs[k] = epoch
            self.freed.pop(k, None)

    @rule(k=st.integers(0, 4), epoch=st.integers(0, 5))
    def free(self, k, epoch):
        got = self.tier.free(K(k), epoch)
        fence = self.fences.get(k, 0)
        if not rules.free_takes(epoch, fence, k in self.blocks, self.epochs.get(k, 0)):
            assert got == Fenced(fence)
            return
        self.freed[k] = max(epoch, self.freed.get(k, 0))
        if k in self.blocks:
            assert got == Freed()
            del self.blocks[k]
        else:
            assert got == Absent()

    @rule(k=st.integers(0, 4), gen=st.integers(0, 3))
    def read(self, k, gen):
        out = bytearray(8192)
        got = self.tier.read_into(K(k), gen, out)
        if k not in self.blocks:
            assert got == Miss(MissReason.ABSENT)
        elif self.blocks[k][0] != gen:
            assert got == Miss(MissReason.OTHER_GENERATION)
        else:
            data = self.blocks[k][1]
            assert got == Hit(len(data)) and bytes(out[:len(data)]) == data

    @rule(k=st.integers(0, 4), epoch=st.integers(0, 7))
    def restore(self, k, epoch):
        self.tier.restore_fences({K(k): epoch})
        self.fences[k] = max(self.fences.get(k, 0), epoch)
        if self.fences[k] > self.freed.get(k, 0):
            self.freed.pop(k, None)

    @rule()
    def reopen(self):
        if self.kind in DURABLE:
            self.tier = reopen(self.kind, self.tier, self.dir)
            if self.kind != "pool":
                self.freed.clear()  # the slot tiers' marks are volatile; the pool's are in its fence files
            r = self.tier.recovery
            assert (r.dropped_corrupt, r.dropped_truncated, r.dropped_uncommitted, r.lost) == (0, 0, 0, ())

    @invariant()
    def agrees(self):
        assert {k: self.tier.fence(K(k)) for k in range(5)} == {k: self.fences.get(k, 0) for k in range(5)}
        assert sorted(self.tier.keys()) == sorted(K(k) for k in self.blocks)
        if self.kind != "pool":
            assert self.tier.used_bytes == len(self.blocks) * 8192


_STATEFUL = settings(max_examples=25, stateful_step_count=25, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


class NvmeMachine(TierMachine):
    kind = "nvme"


class DramMachine(TierMachine):
    kind = "dram"


class PoolMachine(TierMachine):
    kind = "pool"


TestNvmeStateful = NvmeMachine.TestCase
TestNvmeStateful.settings = _STATEFUL
TestDramStateful = DramMachine.TestCase
TestDramStateful.settings = _STATEFUL
TestPoolStateful = PoolMachine.TestCase
TestPoolStateful.settings = settings(_STATEFUL, max_examples=15)


# ------------------------------------------------------------------------------- layering and CUDA


def test_file_tiers_import_neither_torch_nor_test_tools():
    code = ("import sys, kvcc.reference.tiers.nvme, kvcc.reference.tiers.pool; "
            "bad = [m for m in ('torch', 'hypothesis', 'z3', 'kvcc.spec.checker') if m in sys.modules]; "
            "sys.exit(f'imported: {bad}' if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(not CUDA, reason="needs CUDA: torch.cuda.is_available() is False (CPU-only torch here)")
def test_gpu_tier_on_cuda_device_tensors():
    tier = GpuTier(4, 1 << 20)
    assert tier.device.type == "cuda"
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    assert tier.write(K(1), 1, 1, src) == Stored(1 << 20)
    out = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    assert tier.read_into(K(1), 1, out) == Hit(1 << 20)
    assert torch.equal(out, src)
    host = bytearray(1 << 20)
    assert tier.read_into(K(1), 1, host) == Hit(1 << 20)
    assert bytes(host) == bytes(src.cpu().numpy())
    assert tier.write(K(2), 1, 1, bytes(host)) == Stored(1 << 20)
    assert tier.read(K(2), 1) == bytes(host)
    tier._arena[tier._by_key[K(2)].slot * (1 << 20) + 3] += 1
    assert tier.read_into(K(2), 1, out) == Miss(MissReason.CORRUPT)
    assert torch.equal(out, src), "a verified miss leaves out untouched"
    tier.close()


@pytest.mark.skipif(not CUDA, reason="needs CUDA: torch.cuda.is_available() is False (CPU-only torch here)")
def test_dram_tier_pinned_to_and_from_cuda():
    tier = DramTier(2, 4096)
    assert tier.pinned
    src = torch.arange(4096, device="cuda").to(torch.uint8)
    assert tier.write(K(1), 1, 1, src) == Stored(4096)
    out = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    assert tier.read_into(K(1), 1, out) == Hit(4096) and torch.equal(out, src)
    tier.close()


def test_pool_fence_behind_its_block_still_fences(tmp_path):
    """A crash can persist a block's rename but not its fence file's (one directory flush covers
    both): the block's epoch fences writers and frees until the fence file catches up, and a
    free keeps it."""
    tier = make("pool", tmp_path)
    assert tier.write(K(1), 1, 5, b"x" * 100) == Stored(100)
    tier._write_fence(K(1), 1)  # as if the fence file's rename had been lost
    assert tier.write(K(1), 2, 3, b"zombie") == Fenced(5)
    assert tier.free(K(1), 4) == Fenced(5)
    assert tier.free(K(1), 5) == Freed()
    assert tier.fence(K(1)) == 5
    assert tier.write(K(1), 3, 4, b"zombie") == Fenced(5)
    tier.close()
