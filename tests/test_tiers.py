"""The storage-tier contract (kvcc.reference.tiers.base), checked on every tier.

Each contract test runs on all four tiers (the GPU tier on the CPU device unless CUDA is present);
corruption tests on the durable ones. Recovery and crash safety are in ``test_tiers_recovery``,
concurrency and the stateful machines in ``test_tiers_stateful``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import pytest

from kvcc.reference.tiers import (
    Absent,
    DramTier,
    Fenced,
    Freed,
    GpuTier,
    Hit,
    Miss,
    MissReason,
    NoSpace,
    Stored,
    TierClosed,
)
from kvcc.reference.tiers.base import CHECKSUM_PIECE_BYTES, HEADER_BYTES, PAGE_BYTES, HalfHelper
from kvcc.reference.tiers.dram import SPLIT_READ_BYTES

from tier_support import (  # noqa: F401 (kind, tier: fixtures)
    tier_events,
    corrupt,
    BLOCK,
    SLOTS,
    DURABLE,
    CUDA,
    K,
    payload,
    make,
    kind,
    tier,
    torch,
)


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
    assert tier.fits(BLOCK)
    if tier.name != "pool":
        assert not tier.fits(BLOCK + 1), "fits() says what write() refuses"
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


@pytest.mark.parametrize("where", ["payload", "header"])
def test_corruption_reads_as_miss(kind, tmp_path, caplog, where):
    tier = make(kind, tmp_path)
    data = payload(K(1), 1, 10_000)
    tier.write(K(1), 1, 1, data)
    tier.write(K(2), 1, 1, payload(K(2), 1, 10_000))
    corrupt(kind, tier, K(1), 1, 7777 if where == "payload" else 40, header=where == "header")
    out = bytearray(b"\xaa" * 10_000)
    with caplog.at_level(logging.WARNING, logger="kvcc.tiers"):
        assert tier.read_into(K(1), 1, out) == Miss(MissReason.CORRUPT)
    assert out == b"\xaa" * 10_000, "a miss must not hand out bytes"
    (rec,) = tier_events(caplog, "read_corrupt")
    assert rec.tier == tier.name and rec.key == K(1).hex() and rec.gen == 1
    assert tier.read(K(2), 1) == payload(K(2), 1, 10_000), "other blocks are unaffected"
    tier.close()


@pytest.mark.parametrize("piece", [0, 1, 2])
def test_a_block_of_several_pieces_copied_before_its_check_leaves_no_byte_on_a_miss(kind, tmp_path, piece):
    """A verified read of a block of several pieces into host memory copies each piece as it
    hashes it (``base.verified_copy``) and checks the block checksum after the last: a damaged
    byte in the first, a middle or the last piece is a Miss(corrupt) and ``out`` holds zeros
    where the block would be -- none of its bytes, damaged or not -- and is untouched past it;
    an undamaged block reads back exactly."""
    n = 2 * CHECKSUM_PIECE_BYTES + 5000  # three pieces, the last one short
    tier = make(kind, tmp_path, slots=2, block=n)
    data = payload(K(1), 1, n)
    assert tier.write(K(1), 1, 1, data) == Stored(n) and tier.write(K(2), 1, 1, data) == Stored(n)
    out = bytearray(b"\xaa" * (n + 100))
    assert tier.read_into(K(2), 1, out) == Hit(n)
    assert out[:n] == data and out[n:] == b"\xaa" * 100
    corrupt(kind, tier, K(1), 1, piece * CHECKSUM_PIECE_BYTES + 17)
    out = bytearray(b"\xaa" * (n + 100))
    assert tier.read_into(K(1), 1, out) == Miss(MissReason.CORRUPT)
    assert out[:n] == bytes(n) and out[n:] == b"\xaa" * 100
    tier.close()


@pytest.mark.parametrize("kind", DURABLE)
def test_truncation_reads_as_miss(kind, tmp_path, caplog):
    tier = make(kind, tmp_path)
    tier.write(K(1), 1, 1, payload(K(1), 1, 20_000))
    if kind == "nvme":
        path, base = tier.slab_path(tier.slot_of(K(1)))
    else:
        path, base = tier._block_path(K(1)), 0
    os.truncate(path, base + PAGE_BYTES + 10_001)
    out = bytearray(20_000)
    with caplog.at_level(logging.WARNING, logger="kvcc.tiers"):
        assert tier.read_into(K(1), 1, out) == Miss(MissReason.TRUNCATED)
    assert out == bytes(20_000)
    assert len(tier_events(caplog, "read_truncated")) == 1
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
        assert len(tier_events(caplog, "read_corrupt")) == 1
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
    corrupt("gpu", tier, K(1), 1, 5)
    assert isinstance(tier.read_into(K(1), 1, bytearray(100)), Hit)  # trusted memory, unchecked
    corrupt("gpu", tier, K(1), 1, 20, header=True)
    assert tier.read_into(K(1), 1, bytearray(100)) == Miss(MissReason.CORRUPT), "headers are always checked"


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
    """A write leaves the key's fence in its block's header, not in the fence file: the block's
    epoch fences writers and frees above a fence file left behind (by a free before a later
    write), and a free keeps it in the file."""
    tier = make("pool", tmp_path)
    assert tier.write(K(1), 1, 5, b"x" * 100) == Stored(100)
    tier._write_fence(K(1), 1)
    assert tier.write(K(1), 2, 3, b"zombie") == Fenced(5)
    assert tier.free(K(1), 4) == Fenced(5)
    assert tier.free(K(1), 5) == Freed()
    assert tier.fence(K(1)) == 5
    assert tier.write(K(1), 3, 4, b"zombie") == Fenced(5)
    tier.close()


def test_pool_key_lock_excludes_threads_and_processes(tmp_path):
    """The key's lock (a byte-range lock of the open file description) excludes another thread of
    the same process as well as another process, and only for that key."""
    tier = make("pool", tmp_path)
    held, release, got = threading.Event(), threading.Event(), threading.Event()

    def holder():
        with tier._locked(K(1)):
            held.set()
            release.wait(30)

    def waiter():
        with tier._locked(K(1)):
            got.set()

    threads = [threading.Thread(target=holder), threading.Thread(target=waiter)]
    threads[0].start()
    assert held.wait(30)
    threads[1].start()
    assert not got.wait(0.3), "a second thread took a held key lock"
    with tier._locked(K(2)):
        pass  # another key's lock is free
    release.set()
    assert got.wait(30)
    for t in threads:
        t.join(30)
    code = (f"import sys, time; from kvcc.reference.tiers.pool import SharedPoolTier; "
            f"t = SharedPoolTier({str(tier.root)!r}, 1 << 20, recover=False)\n"
            f"with t._locked(bytes.fromhex({K(1).hex()!r})):\n"
            f"    print('locked', flush=True); time.sleep(1.0)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        assert tier.write(K(1), 1, 1, b"after") == Stored(5)
        assert time.monotonic() - t0 > 0.5, "the write did not wait for the other process's lock"
    finally:
        proc.wait(30)
        proc.stdout.close()
    tier.close()


def test_pool_freed_file_is_rewritten_in_place_only_without_readers(tmp_path):
    """A free keeps its block's file as a spare; a write of that size rewrites it in place (no
    allocation), but never while a reader that opened it when it was published still reads it:
    that write takes a new file, and the spare waits for a later one."""
    tier = make("pool", tmp_path)
    spares = tier.root / "spares"
    assert tier.write(K(1), 1, 1, payload(K(1), 1, BLOCK)) == Stored(BLOCK)
    path = tier._block_path(K(1))
    inode = path.stat().st_ino
    fd = tier._open_published(path, os.O_RDONLY)  # a reader, mid-read
    assert tier.free(K(1), 1) == Freed() and not path.exists()
    assert [f.stat().st_ino for f in spares.iterdir()] == [inode]
    assert tier.write(K(2), 1, 1, payload(K(2), 1, BLOCK)) == Stored(BLOCK)
    assert tier._block_path(K(2)).stat().st_ino != inode
    assert os.pread(fd, BLOCK, PAGE_BYTES) == payload(K(1), 1, BLOCK), "the spare was rewritten under a reader"
    os.close(fd)
    assert [f.stat().st_ino for f in spares.iterdir()] == [inode]
    tier._spares_listed = 0.0  # as after USAGE_REFRESH_S: the write lists spares/ again
    assert tier.write(K(3), 1, 1, payload(K(3), 1, BLOCK)) == Stored(BLOCK)
    assert tier._block_path(K(3)).stat().st_ino == inode and not list(spares.iterdir())
    assert tier.read(K(3), 1) == payload(K(3), 1, BLOCK) and tier.read(K(2), 1) == payload(K(2), 1, BLOCK)
    tier.close()


def test_pool_read_of_a_file_freed_and_rewritten_before_its_flock(tmp_path, monkeypatch, caplog):
    """A read that opened a block's file which was then freed and rewritten as a spare (between
    its open and its flock) sees that the file left its name: a miss for the free, not damage."""
    from kvcc.reference.tiers import pool

    tier = make("pool", tmp_path)
    assert tier.write(K(1), 1, 1, payload(K(1), 1, BLOCK)) == Stored(BLOCK)
    real, fired = pool.fcntl.flock, []

    def flock(fd, op):
        if op & pool.fcntl.LOCK_SH and not fired:
            fired.append(True)
            monkeypatch.setattr(pool.fcntl, "flock", real)
            assert tier.free(K(1), 1) == Freed()
            assert tier.write(K(2), 1, 1, payload(K(2), 1, BLOCK)) == Stored(BLOCK)  # takes the spare
        return real(fd, op)

    monkeypatch.setattr(pool.fcntl, "flock", flock)
    with caplog.at_level(logging.WARNING, logger="kvcc.tiers"):
        assert tier.read_into(K(1), 1, bytearray(BLOCK)) == Miss(MissReason.ABSENT)
    assert fired and not tier_events(caplog, "read_corrupt")
    assert tier.read(K(2), 1) == payload(K(2), 1, BLOCK)
    tier.close()


def test_a_pool_of_the_earlier_layout_is_refused_untouched(tmp_path):
    """A directory per key (the layout before buckets) keeps its fence inside: opened by this code,
    those fences would be unseen. The open is refused and makes nothing."""
    from kvcc.reference.tiers.pool import IncompatiblePool, SharedPoolTier

    old = tmp_path / "pool" / bytes(range(32)).hex()
    old.mkdir(parents=True)
    (old / f"{old.name}.fence").write_bytes(b"KVCF")
    before = sorted(p.name for p in (tmp_path / "pool").iterdir())
    with pytest.raises(IncompatiblePool, match="earlier one-directory-per-key layout"):
        SharedPoolTier(tmp_path / "pool", 1 << 20)
    assert sorted(p.name for p in (tmp_path / "pool").iterdir()) == before


def test_pool_spares_are_bounded(tmp_path):
    tier = make("pool", tmp_path, spare_bytes=0)
    assert tier.write(K(1), 1, 1, payload(K(1), 1, BLOCK)) == Stored(BLOCK)
    assert tier.free(K(1), 1) == Freed()
    assert not list((tier.root / "spares").iterdir()), "a free beyond spare_bytes unlinks"
    tier.close()


def test_pool_fence_never_reads_back_lower(tmp_path):
    """``fence()`` takes no lock, while the fence moves from block to block (replacements) and from
    a block to the fence file (frees): every value it reads is one the key had, so it never goes
    back."""
    tier = make("pool", tmp_path)
    done = threading.Event()
    seen: list[int] = []

    def reader():
        while not done.is_set():
            seen.append(tier.fence(K(1)))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for epoch in range(1, 120):
            assert tier.write(K(1), epoch, epoch, b"x" * 64) == Stored(64)
            if epoch % 3 == 0:
                assert tier.free(K(1), epoch) == Freed()
    finally:
        done.set()
        t.join(30)
    assert len(seen) > 10 and all(a <= b for a, b in zip(seen, seen[1:], strict=False)), "the fence went back"
    tier.close()


# ------------------------------------------------------------------------------- split reads


def _run_on_helper(helper: HalfHelper, first, second):
    """``helper.run``, with the caller waiting until the helper has started the first half: the
    helper thread runs it, every time (plain ``run`` leaves that to timing)."""
    started = threading.Event()

    def helper_half():
        started.set()
        return first()

    def caller_half():
        assert started.wait(30), "the helper never started the first half"
        return second()

    return HalfHelper.run(helper, helper_half, caller_half)


class _HelperTakesFirst(HalfHelper):
    def run(self, first, second):
        return _run_on_helper(self, first, second)


def _split_tier(kind: str, helper: str, n: int):
    tier = (DramTier(2, n, split_reads=True, pin_memory=False) if kind == "dram"
            else GpuTier(2, n, device="cpu", split_reads=True))
    if helper == "helper thread":
        tier._helper.close()
        tier._helper = _HelperTakesFirst("test-helper")
    else:
        tier._helper.close()  # no helper thread left: the calling thread claims both halves
    return tier


@pytest.mark.parametrize("kind", ["dram", "gpu"])
@pytest.mark.parametrize("helper", ["helper thread", "caller only"])
def test_split_reads_verify_every_piece_before_copying(kind, helper, caplog):
    """split_reads: hits are exact; a corrupt byte in either half (the one the helper verifies or
    the caller's) is a logged Miss(corrupt) and ``out`` is untouched; blocks below the split size
    take the unsplit path."""
    n = SPLIT_READ_BYTES + 3 * CHECKSUM_PIECE_BYTES + 4097  # halves of 5 and 6 pieces
    tier = _split_tier(kind, helper, n)
    data = payload(K(1), 1, n)
    assert tier.write(K(1), 1, 1, data) == Stored(n)
    out = bytearray(b"\x07" * (n + 10))
    assert tier.read_into(K(1), 1, out) == Hit(n)
    assert bytes(out[:n]) == data and out[n:] == b"\x07" * 10
    mid = n // CHECKSUM_PIECE_BYTES // 2 * CHECKSUM_PIECE_BYTES
    for spot in (0, mid - 1, mid, n - 1):
        corrupt(kind, tier, K(1), 1, spot)
        out = bytearray(b"\xaa" * n)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvcc.tiers"):
            assert tier.read_into(K(1), 1, out) == Miss(MissReason.CORRUPT), spot
        assert out == b"\xaa" * n, f"a miss must not hand out bytes (corrupt byte at {spot})"
        assert len(tier_events(caplog, "read_corrupt")) == 1
        corrupt(kind, tier, K(1), 1, spot)  # flipped back
        assert tier.read(K(1), 1) == data
    small = payload(K(2), 1, SPLIT_READ_BYTES - 1)
    assert tier.write(K(2), 1, 1, small) == Stored(len(small))
    assert tier.read(K(2), 1) == small
    tier.close()


def test_half_helper_runs_halves_once_and_never_waits_for_an_unstarted_one():
    helper = HalfHelper("test-helper")
    main = threading.get_ident()
    ran: list[tuple[str, int]] = []

    # The helper runs the first half while the caller runs the second.
    a, b = _run_on_helper(helper, lambda: ran.append(("first", threading.get_ident())) or 1,
                          lambda: ran.append(("second", threading.get_ident())) or 2)
    assert (a, b) == (1, 2)
    threads = dict(ran)
    assert len(ran) == 2 and threads["second"] == main and threads["first"] != main
    ran.clear()

    # The helper is busy: the caller claims the first half itself rather than wait for it.
    gate, busy = threading.Event(), threading.Event()
    blocker = threading.Thread(target=helper.run, args=(lambda: (busy.set(), gate.wait(30)), lambda: busy.wait(30)))
    blocker.start()
    assert busy.wait(30)
    a, b = helper.run(lambda: ran.append(("first", threading.get_ident())) or 1, lambda: 2)
    assert (a, b) == (1, 2) and ran == [("first", main)]
    gate.set()
    blocker.join(30)
    helper.run(lambda: None, lambda: None)  # the helper has drained its queue up to here
    assert ran == [("first", main)], "a half claimed by the caller is not run again by the helper"

    # Errors: either half's is raised by run; a first half not yet started is not run afterwards.
    with pytest.raises(KeyError):
        _run_on_helper(helper, lambda: {}["x"], lambda: 2)
    with pytest.raises(KeyError):
        helper.run(lambda: 1, lambda: {}["y"])
    helper.close()
    late: list[int] = []
    with pytest.raises(ZeroDivisionError):
        helper.run(lambda: late.append(1), lambda: 1 / 0)  # no helper thread: never started
    assert late == [], "the first half must not run after run() raised for the second"
    assert helper.run(lambda: 3, lambda: 4) == (3, 4), "after close, the caller runs both halves"


# ------------------------------------------------------------------------------- DRAM read caches


@pytest.mark.parametrize("kind", ["dram", "gpu"])
@pytest.mark.parametrize("n", [3000, 2 * CHECKSUM_PIECE_BYTES + 5000])
def test_a_cached_header_check_never_outlives_its_block(kind, tmp_path, n):
    """DramTier (and GpuTier) keep per slot what the full check of its block's header found
    (``DramTier._checked``: reused while the header bytes are the ones checked, for the same
    block). After reads have filled it, a rewrite of the key (another generation, or the same
    one with other bytes), a free, the slot taken by another key, ``damage`` and a byte flipped
    behind the tier's back all make the next read a miss or exactly the new block: never the old
    bytes, and on a miss no byte of the block in ``out``."""
    tier = make(kind, tmp_path, slots=2, block=n)
    out = torch.full((n,), 7, dtype=torch.uint8)

    def read(key: bytes, gen: int, salt: int = 0):
        out.fill_(7)
        got = tier.read_into(key, gen, out)
        if isinstance(got, Hit):
            assert bytes(out.numpy()) == payload(key, gen, n, salt), (key, gen)
        else:
            assert bool((out == 7).all()) or bool((out == 0).all()), "a miss leaves no byte of the block"
        return got

    assert tier.write(K(1), 1, 1, payload(K(1), 1, n)) == Stored(n)
    slot = tier._by_key[K(1)].slot
    assert read(K(1), 1) == Hit(n) and read(K(1), 1) == Hit(n)  # the second from the cache
    assert tier._checked_slots[slot] is not None
    # Rewritten under another generation (into the other slot; this one erased and freed) ...
    assert tier.write(K(1), 2, 2, payload(K(1), 2, n)) == Stored(n)
    assert read(K(1), 1) == Miss(MissReason.OTHER_GENERATION)
    assert read(K(1), 2) == Hit(n) and read(K(1), 2) == Hit(n)
    # ... and the slot taken by another key.
    assert tier.write(K(2), 1, 1, payload(K(2), 1, n)) == Stored(n)
    assert tier._by_key[K(2)].slot == slot
    assert read(K(2), 1) == Hit(n) and read(K(1), 2) == Hit(n)
    # The same key and generation again, with other bytes: the new bytes, never the cached block's.
    assert tier.free(K(2), 1) == Freed()
    assert read(K(2), 1) == Miss(MissReason.ABSENT)
    assert tier.write(K(2), 1, 2, payload(K(2), 1, n, salt=1)) == Stored(n)
    assert read(K(2), 1, salt=1) == Hit(n) and read(K(2), 1, salt=1) == Hit(n)
    assert tier.free(K(1), 2) == Freed() and read(K(1), 2) == Miss(MissReason.ABSENT)
    assert tier.write(K(2), 1, 3, payload(K(2), 1, n, salt=2)) == Stored(n)  # replaced, same generation
    assert read(K(2), 1, salt=2) == Hit(n) and read(K(2), 1, salt=2) == Hit(n)
    # Damage after cached reads: header (through the tier and behind its back) and payload.
    for header, offset in ((True, 40), (True, HEADER_BYTES - 1), (False, 17), (False, n - 1)):
        corrupt(kind, tier, K(2), 1, offset, header=header)
        assert read(K(2), 1, salt=2) == Miss(MissReason.CORRUPT), (header, offset)
        corrupt(kind, tier, K(2), 1, offset, header=header)  # flipped back: the same block again
        assert read(K(2), 1, salt=2) == Hit(n), (header, offset)
    if kind == "dram" or not tier.on_cuda:  # DramTier.damage, the conformance kit's corrupt
        assert tier.damage(K(2), "header", 3)
        assert read(K(2), 1, salt=2) == Miss(MissReason.CORRUPT)
        assert tier.damage(K(2), "header", 3) and read(K(2), 1, salt=2) == Hit(n)
        assert tier.damage(K(2), "payload", n // 2)
        assert read(K(2), 1, salt=2) == Miss(MissReason.CORRUPT)
    tier.close()


@pytest.mark.parametrize("kind", ["dram", "gpu"])
def test_cached_reads_race_rewrites_and_frees_and_never_hand_out_wrong_bytes(kind, tmp_path):
    """Readers into tensors (their numpy views and the slots' header checks cached) race a writer
    that replaces and frees blocks of several pieces, reusing slots: every hit is exact, and no
    miss is 'corrupt'."""
    n = CHECKSUM_PIECE_BYTES + 4096
    tier = make(kind, tmp_path, slots=5, block=n)
    stop = time.monotonic() + 0.8
    bad: list[str] = []

    def writer() -> None:
        i = 0
        while time.monotonic() < stop:
            i += 1
            k, gen = i % 3, i % 4
            if i % 5 == 0:
                tier.free(K(k), 10**6)
            else:
                tier.write(K(k), gen, 1, payload(K(k), gen, n))

    def reader(seed: int) -> None:
        out = torch.empty(n, dtype=torch.uint8)
        i = seed
        while time.monotonic() < stop:
            i += 1
            k, gen = i % 3, (i // 3) % 4
            r = tier.read_into(K(k), gen, out)
            if isinstance(r, Hit) and bytes(out.numpy()) != payload(K(k), gen, n):
                bad.append(f"wrong bytes for {k}/{gen}")
            if isinstance(r, Miss) and r.reason not in (MissReason.ABSENT, MissReason.OTHER_GENERATION):
                bad.append(f"{r} for {k}/{gen}")

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(s,)) for s in (0, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad, bad[:5]
    tier.close()


def test_dram_reuses_a_tensor_view_only_while_the_tensor_keeps_its_memory():
    """``DramTier._prepare_sink`` (``dram._Sinks``) reuses the numpy view of the last CPU tensor it was given while
    the tensor still has the same memory, size, dtype and layout: after ``set_``, ``resize_``,
    ``as_strided_`` or ``.data =`` the bytes land in the tensor's memory as it is now, or the read
    raises as it would for a tensor seen for the first time."""
    tier = DramTier(2, BLOCK, pin_memory=False)
    data = payload(K(1), 1, 5000)
    assert tier.write(K(1), 1, 1, data) == Stored(5000)
    out = torch.zeros(BLOCK, dtype=torch.uint8)
    first = out.view(-1)  # the first storage, kept alive
    assert tier.read_into(K(1), 1, out) == Hit(5000) and bytes(out[:5000].numpy()) == data
    first.zero_()
    other = torch.zeros(BLOCK, dtype=torch.uint8)
    out.set_(other)
    assert tier.read_into(K(1), 1, out) == Hit(5000)
    assert bytes(other[:5000].numpy()) == data and not bool(first.any()), "the tensor's memory as it is now"
    out.resize_(100)
    with pytest.raises(ValueError):
        tier.read_into(K(1), 1, out)
    out.resize_(BLOCK)
    out.zero_()
    assert tier.read_into(K(1), 1, out) == Hit(5000) and bytes(out[:5000].numpy()) == data
    out.as_strided_((BLOCK // 2,), (2,))
    with pytest.raises(ValueError):
        tier.read_into(K(1), 1, out)
    out.data = torch.zeros(BLOCK, dtype=torch.int8)
    with pytest.raises(TypeError):
        tier.read_into(K(1), 1, out)
    out.data = torch.zeros((2, BLOCK // 2), dtype=torch.uint8)  # 2-D and contiguous: a flat view of it
    assert tier.read_into(K(1), 1, out) == Hit(5000) and bytes(out.reshape(-1)[:5000].numpy()) == data

    def read_into_a_new_tensor() -> None:
        t = torch.zeros(BLOCK, dtype=torch.uint8)
        assert tier.read_into(K(1), 1, t) == Hit(5000) and tier._sinks.last is not None

    read_into_a_new_tensor()
    assert tier._sinks.last is None, "the cached view goes with the caller's tensor, not keeping its memory"
    tier.close()
