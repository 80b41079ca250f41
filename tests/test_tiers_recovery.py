"""Storage tiers after a crash: what a reopened tier serves when its process died at any point
(simulated in-process, and a real writer process killed with SIGKILL at random points), on the
durable tiers. Shared helpers: ``tier_support``."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvcc.reference.tiers import (
    Absent,
    CorruptFence,
    Fenced,
    Freed,
    Miss,
    MissReason,
    NvmeTier,
    SharedPoolTier,
    Stored,
)
from kvcc.reference.tiers.base import PAGE_BYTES

from tier_support import (  # noqa: F401 (kind, tier: fixtures)
    tier_events,
    corrupt,
    BLOCK,
    SLOTS,
    DURABLE,
    K,
    payload,
    pool_capacity,
    make,
    reopen,
    kind,
    tier,
)


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
    damaged = tier_events(caplog, "recover_bad_payload") + tier_events(caplog, "recover_truncated")
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
    assert len(tier_events(caplog, "recover_torn")) == r.dropped_uncommitted
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
    corrupt("nvme", tier, K(1), 4, 123)
    with caplog.at_level(logging.WARNING, logger="kvcc.tiers"):
        tier = reopen("nvme", tier, tmp_path)
    assert tier.recovery.lost == (K(1),) and tier.recovery.dropped_corrupt == 1
    assert len(tier_events(caplog, "recover_bad_payload")) == 1
    assert tier.read_into(K(1), 4, bytearray(9000)) == Miss(MissReason.LOST)
    assert tier.fence(K(1)) == 1
    assert tier.free(K(1), 1) == Freed()
    tier = reopen("nvme", tier, tmp_path)
    assert tier.keys() == [K(2)] and tier.recovery.lost == ()
    tier.close()


def test_pool_recovery(tmp_path, caplog):
    tier = make("pool", tmp_path)
    tier.write(K(1), 0, 1, payload(K(1), 0, 5000))
    tier.write(K(1), 1, 2, payload(K(1), 1, 5000))  # replaces generation 0 in the same rename
    tier.write(K(2), 1, 2, payload(K(2), 1, 5000))
    tier.free(K(2), 2)
    d = tier._block_path(K(1)).parent
    (d / f".tmp-{K(1).hex()}-9-abandoned").write_bytes(b"half a block")  # a writer killed mid-write
    tier.write(K(3), 1, 3, payload(K(3), 1, 5000))
    corrupt("pool", tier, K(3), 1, 99)
    with caplog.at_level(logging.WARNING, logger="kvcc.tiers"):
        tier = reopen("pool", tier, tmp_path)
    r = tier.recovery
    assert (r.kept, r.dropped_uncommitted, r.superseded, r.dropped_corrupt, r.tombstones) == (1, 1, 0, 1, 1)
    assert r.lost == (K(3),)
    # One file per written key, no fence file: its block carries the fence.
    assert sorted(n for n in os.listdir(d) if n.startswith(K(1).hex()) or n.startswith(".tmp")) == [K(1).hex()]
    assert tier.fence(K(1)) == 2
    assert tier.read(K(1), 0) is None
    assert tier.read(K(1), 1) == payload(K(1), 1, 5000)
    assert tier.read(K(2), 1) is None and tier.fence(K(2)) == 2
    # The damaged block's header still told its epoch: the fence file keeps it after the block went.
    assert tier._read_marks(K(3)) == (3, None) and tier.fence(K(3)) == 3
    assert tier.write(K(3), 2, 2, b"stale") == Fenced(3)
    tier.close()


def _crash_on_bucket_fsync(monkeypatch, tier):
    """Make the pool 'crash' at its next fsync of a bucket: after the rename that frees a block,
    before it is durable or answered."""
    from kvcc.reference.tiers import pool

    def fsync_dir(path):
        if Path(path).parent == tier.root:
            raise SimulatedCrash
        return real(path)

    real = pool.fsync_dir
    monkeypatch.setattr(pool, "fsync_dir", fsync_dir)


def _undo_publish(tier, key: bytes, to: Path, previous: Path | None = None) -> None:
    """What a power cut does to a write acknowledged before its rename was flushed: the block goes
    back off its name (to ``to``: its temp name, or spares/ for a reused spare), and the name holds
    the previous generation again (``previous``, a copy of it) or nothing."""
    os.rename(tier._block_path(key), to)
    if previous is not None:
        shutil.copy(previous, tier._block_path(key))


def test_pool_crash_undoing_an_acknowledged_publish_loses_nothing(tmp_path):
    """A write is acknowledged once its bytes are synced and its rename done, before the rename is
    flushed. A power cut that undoes the rename leaves the block whole off its name -- under its
    temp name, or back in spares/ when it reused a spare -- and the previous generation at the name:
    recovery publishes it again, with its fence. A file a write would not publish now is not: one
    of an older epoch than the published block, one at or under the key's freed mark (a freed
    block's spare among them), a torn one."""
    tier = make("pool", tmp_path)
    bucket = tier._bucket(K(1))
    assert tier.write(K(1), 1, 2, payload(K(1), 1, 5000)) == Stored(5000)
    shutil.copy(tier._block_path(K(1)), tmp_path / "gen1")
    assert tier.write(K(1), 2, 5, payload(K(1), 2, 5000)) == Stored(5000)
    _undo_publish(tier, K(1), bucket / f".tmp-{K(1).hex()}-1-undone", previous=tmp_path / "gen1")
    # A reused spare: K(2)'s freed file rewritten in place for K(3); both renames undone.
    assert tier.write(K(2), 1, 3, payload(K(2), 1, 5000)) == Stored(5000)
    assert tier.free(K(2), 3) == Freed()
    [spare] = os.listdir(tier.root / "spares")
    assert tier.write(K(3), 1, 4, payload(K(3), 1, 5000)) == Stored(5000)
    assert os.listdir(tier.root / "spares") == [], "the write took the spare"
    _undo_publish(tier, K(3), tier.root / "spares" / spare)
    # Not to publish: an older epoch than K(1)'s published block; a block of K(4)'s freed epoch; a
    # torn block of K(5).
    shutil.copy(tmp_path / "gen1", bucket / f".tmp-{K(1).hex()}-1-older")
    assert tier.write(K(4), 1, 6, payload(K(4), 1, 3000)) == Stored(3000)
    shutil.copy(tier._block_path(K(4)), tmp_path / "k4")
    assert tier.free(K(4), 6) == Freed()
    shutil.copy(tmp_path / "k4", tier._bucket(K(4)) / f".tmp-{K(4).hex()}-1-freed")
    assert tier.write(K(5), 1, 2, payload(K(5), 1, 3000)) == Stored(3000)
    corrupt("pool", tier, K(5), 1, 99)
    _undo_publish(tier, K(5), tier._bucket(K(5)) / f".tmp-{K(5).hex()}-1-torn")

    tier = reopen("pool", tier, tmp_path)
    r = tier.recovery
    assert (r.republished, r.dropped_uncommitted, r.lost, r.dropped_corrupt) == (2, 3, (), 0)
    assert tier.read(K(1), 2) == payload(K(1), 2, 5000)
    assert tier.read_into(K(1), 1, bytearray(5000)) == Miss(MissReason.OTHER_GENERATION)
    assert tier.fence(K(1)) == 5 and tier.write(K(1), 3, 4, b"stale") == Fenced(5)
    assert tier.read(K(3), 1) == payload(K(3), 1, 5000) and tier.fence(K(3)) == 4
    assert tier.read(K(2), 1) is None and tier.read(K(4), 1) is None and tier.fence(K(4)) == 6
    assert tier.read(K(5), 1) is None
    assert not [n for b in (bucket, tier._bucket(K(4)), tier._bucket(K(5))) for n in os.listdir(b)
                if n.startswith(".tmp")]
    assert not tier._fence_path(K(1)).exists(), "a write writes no fence file"
    assert tier.recover().republished == 0, "nothing left to publish"
    tier.close()


def test_pool_crash_with_a_write_unfinished_keeps_the_previous_block(tmp_path):
    """A write whose bytes are not all there when the crash comes (never acknowledged) is dropped;
    the key keeps its previous block and fence."""
    tier = make("pool", tmp_path)
    assert tier.write(K(1), 1, 2, payload(K(1), 1, 5000)) == Stored(5000)
    shutil.copy(tier._block_path(K(1)), tmp_path / "gen1")
    assert tier.write(K(1), 2, 5, payload(K(1), 2, 5000)) == Stored(5000)
    half = tier._block_path(K(1)).read_bytes()[:PAGE_BYTES + 2000]  # gen 2's header, part of its bytes
    shutil.copy(tmp_path / "gen1", tier._block_path(K(1)))
    (tier._bucket(K(1)) / f".tmp-{K(1).hex()}-1-half").write_bytes(half)
    tier = reopen("pool", tier, tmp_path)
    assert (tier.recovery.republished, tier.recovery.dropped_uncommitted) == (0, 1)
    assert tier.read(K(1), 1) == payload(K(1), 1, 5000) and tier.fence(K(1)) == 2
    tier.close()


def test_pool_crash_in_free(tmp_path, monkeypatch):
    """A free makes the fence its block carried, and its freed mark, durable in the fence file
    before the block goes. A crash after the mark leaves the block and the mark (the free was not
    answered; its retry removes the block); a crash after the unlink, before the bucket's fsync,
    leaves the mark and maybe the block, which the retry removes. The fence stays either way."""
    tier = make("pool", tmp_path)
    assert tier.write(K(1), 1, 4, payload(K(1), 1, 3000)) == Stored(3000)
    real = tier._write_fence

    def write_fence_then_crash(*args, **kwargs):
        real(*args, **kwargs)
        raise SimulatedCrash

    tier._write_fence = write_fence_then_crash
    with pytest.raises(SimulatedCrash):
        tier.free(K(1), 4)
    tier = reopen("pool", tier, tmp_path)
    assert tier.read(K(1), 1) == payload(K(1), 1, 3000) and tier._read_marks(K(1)) == (4, 4)
    assert tier.write(K(1), 2, 4, b"late bytes of the freed epoch") == Fenced(4)
    assert tier.free(K(1), 4) == Freed() and tier.read(K(1), 1) is None
    assert tier.write(K(2), 1, 6, b"x") == Stored(1)
    _crash_on_bucket_fsync(monkeypatch, tier)
    with pytest.raises(SimulatedCrash):
        tier.free(K(2), 6)
    monkeypatch.undo()
    tier = reopen("pool", tier, tmp_path)
    assert tier.keys() == [] and tier.recovery.tombstones == 2
    assert (tier.fence(K(1)), tier.fence(K(2))) == (4, 6)
    assert tier.write(K(2), 2, 6, b"late") == Fenced(6) and tier.free(K(2), 6) == Absent()
    tier.close()


def test_pool_spare_still_linked_as_a_block_is_not_taken(tmp_path):
    """A crash can keep a free's rename into spares/ and undo the bucket's side of it (on a
    filesystem that does not journal a rename as one): the file is then a block and a spare. A
    writer never rewrites such a file; it drops the spare's name for it."""
    tier = make("pool", tmp_path)
    assert tier.write(K(1), 1, 1, payload(K(1), 1, BLOCK)) == Stored(BLOCK)
    block = tier._block_path(K(1))
    os.link(block, tier.root / "spares" / f"{block.stat().st_size}-1-crashed")
    tier = reopen("pool", tier, tmp_path)
    assert tier.recovery.kept == 1
    assert tier.write(K(2), 1, 1, payload(K(2), 1, BLOCK)) == Stored(BLOCK)
    assert tier.read(K(1), 1) == payload(K(1), 1, BLOCK) and block.stat().st_nlink == 1
    assert not list((tier.root / "spares").iterdir())
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
    assert len(tier_events(caplog, "direct_io_unavailable")) == 1
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


