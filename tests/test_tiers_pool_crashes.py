"""The pool's crash argument under attack (``reference/tiers/pool.py``: a write is acknowledged
before its rename is flushed, and recovery publishes again the blocks a power cut left off their
name). Written by a reviewer who attacked that change; each ``test_pool_*`` test below failed on
its first version and passes since (the module docstring's *Write* and *Recovery* say how):

- a freed block's spare is never published again, even after its key's fence file was lost and
  restored (the spare's name says which block its free took off);
- an acknowledged block back in spares/ while its key's fence file is unreadable is moved out of
  reach of writers and published by ``restore_fences``;
- a rename out of spares/ that a crash left with both names still publishes the block;
- a recovery publishing a spare that a writer of another process renames away an instant before
  publishes it all the same (by the file, not by its name), without raising;
- two generations written under one epoch (outside the protocol): the later write wins;
- a block pending under a temp name whose key's fence was restored above its epoch is kept, as a
  published block would be.

``test_holds_*``: attacks the first version already withstood. A power cut is simulated as in
``tests/test_tiers_recovery.py``: files are put back where the metadata operations not yet
committed to the journal had left them.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from kvcc.reference.tiers import Absent, Fenced, Freed, SharedPoolTier, Stored
from kvcc.reference.tiers import pool as poolmod
from kvcc.reference.tiers.base import PAGE_BYTES, round_up

from test_tiers_recovery import _undo_publish
from tier_support import K, make, payload, reopen

N = 5000
SIZE = PAGE_BYTES + round_up(N)


def _spares(tier) -> list[str]:
    return sorted(os.listdir(tier.root / "spares"))


# ------------------------------------------------------------------------------ found, fixed


def test_pool_freed_block_republished_after_restore_of_corrupt_fence(tmp_path):
    """(b) A block answered Freed sits in spares/ (its file kept for reuse). Its key's fence file is
    later damaged; restore_fences sets the fence from the directory's epoch -- for a key freed at
    epoch 5 and never written since, the directory's epoch is 5 -- and the corrupt branch writes
    the fence WITHOUT the freed mark. The next recovery's _recover_spares finds the freed file
    'publishable' (whole, fence 5 accepts epoch 5, no block published) and publishes it: the freed
    block comes back. Before 7dec286 a spare was never published, so the lost mark only let a late
    writer of epoch 5 in (as for a SlotTier restart); now the tier resurrects the bytes itself."""
    tier = make("pool", tmp_path)
    assert tier.write(K(1), 1, 5, payload(K(1), 1, N)) == Stored(N)
    assert tier.free(K(1), 5) == Freed()
    assert len(_spares(tier)) == 1, "the freed block's file is kept as a spare"
    tier._fence_path(K(1)).write_bytes(b"garbage")  # media damage on the fence file
    tier = reopen("pool", tier, tmp_path)
    assert tier.recovery.fences_corrupt == (K(1),)
    tier.restore_fences({K(1): 5})  # the directory's epoch of the (ABSENT) key
    r = tier.recover()
    got = tier.read(K(1), 1)
    tier.close()
    assert got is None, f"a Freed block is readable again (recover republished {r.republished})"


def test_pool_acknowledged_block_in_spares_overwritten_while_fence_corrupt(tmp_path):
    """(a) A write that reused a spare is acknowledged; a power cut undoes both its renames (the
    block is whole, back in spares/). If the key's fence file is also unreadable, recovery skips
    the spare (CorruptFence) -- but, unlike a temp file ('kept until restore_fences'), a spare is
    free for any writer of its size to take and rewrite in place: the acknowledged block is then
    destroyed before restore_fences can let recovery publish it. Before 7dec286 the rename was
    flushed before Stored, and the block would simply be at its name."""
    tier = make("pool", tmp_path)
    assert tier.write(K(1), 1, 2, payload(K(1), 1, N)) == Stored(N)
    assert tier.free(K(1), 2) == Freed()  # leaves a fence file (2, freed 2) and a spare
    [spare] = _spares(tier)
    assert tier.write(K(1), 2, 5, payload(K(1), 2, N)) == Stored(N)  # acknowledged, reused the spare
    assert _spares(tier) == []
    _undo_publish(tier, K(1), tier.root / "spares" / spare)  # power cut: both renames undone
    tier._fence_path(K(1)).write_bytes(b"garbage")  # and the fence file reads back damaged
    tier = reopen("pool", tier, tmp_path)
    assert tier.recovery.fences_corrupt == (K(1),)
    # Any process's write of a block of the same size now takes the spare.
    assert tier.write(K(2), 1, 1, payload(K(2), 1, N)) == Stored(N)
    tier.restore_fences({K(1): 5})  # the directory restores the key's epoch, as recovery asked
    r = tier.recover()
    got = tier.read(K(1), 2)
    tier.close()
    assert got == payload(K(1), 2, N), (
        f"acknowledged write (K1 gen 2, epoch 5) lost: read {got!r:.40}, republished {r.republished}")


def test_pool_acknowledged_spare_write_lost_when_rename_out_of_spares_left_two_links(tmp_path):
    """(a) The crash model tests/test_tiers_recovery.py already uses
    (test_pool_spare_still_linked_as_a_block_is_not_taken: 'a filesystem that does not journal a
    rename as one' keeps the new name AND the old one). For a write that reused a spare, its first
    rename spares/S -> bucket/.tmp-T can leave both names linked to the rewritten, acknowledged
    block, and the publish rename undone. Recovery then: _recover_spares skips S (st_nlink 2),
    _settle_temp sees st_nlink 2 and REMOVES the temp name. The block is published by no one: it
    sits in spares/ with one link, where the next write of its size rewrites it."""
    tier = make("pool", tmp_path)
    assert tier.write(K(1), 1, 2, payload(K(1), 1, N)) == Stored(N)
    shutil.copy(tier._block_path(K(1)), tmp_path / "gen1")
    assert tier.write(K(3), 1, 1, payload(K(3), 1, N)) == Stored(N)
    assert tier.free(K(3), 1) == Freed()
    [spare] = _spares(tier)
    assert tier.write(K(1), 2, 5, payload(K(1), 2, N)) == Stored(N)  # reused K3's spare
    spare_path = tier.root / "spares" / spare
    temp_path = tier._bucket(K(1)) / f".tmp-{K(1).hex()}-1-linkedtwice"
    _undo_publish(tier, K(1), spare_path, previous=tmp_path / "gen1")  # publish rename undone
    os.link(spare_path, temp_path)  # the rename out of spares/ left both names
    tier = reopen("pool", tier, tmp_path)
    r = tier.recovery
    after_recovery = tier.read(K(1), 2)
    fence_after = tier.fence(K(1))
    stale = tier.write(K(1), 3, 3, payload(K(1), 3, N))  # epoch 3: refused before the crash (fence 5)
    assert tier.write(K(2), 1, 1, payload(K(2), 1, N)) == Stored(N)  # takes the spare
    tier = reopen("pool", tier, tmp_path)
    later = tier.read(K(1), 2)
    tier.close()
    assert after_recovery == payload(K(1), 2, N) and later == payload(K(1), 2, N), (
        f"acknowledged K1 gen2 e5: after recovery {'present' if after_recovery else 'ABSENT'} "
        f"(republished {r.republished}, dropped_uncommitted {r.dropped_uncommitted}, fence {fence_after}, "
        f"a stale epoch-3 write -> {stale}); after one more same-size write: {'present' if later else 'LOST'}")


def test_pool_recover_raises_when_a_writer_takes_the_spare_it_is_publishing(tmp_path, monkeypatch):
    """(e), then (a). After a power cut, process A's recovery is publishing a spare that holds an
    acknowledged block (it holds the spare's flock, it has checked _publishable). Process B (whose
    own recovery skipped that spare because A held its flock) writes a block of the same size:
    _take_spare renames the spare to its temp name first and only then tries the flock, fails, and
    renames it back. A's os.rename(spares/S, <hex>) in that window raises FileNotFoundError, which
    _recover_spares does not catch: recover() (SharedPoolTier.__init__) raises. Once A is gone, B's
    next listing of spares/ finds S again with no flock on it and rewrites it: the acknowledged
    block is lost. The interleaving is forced with real code in two tier objects (separate open
    file descriptions, so flocks conflict as between processes)."""
    tier = make("pool", tmp_path)
    root, cap = tier.root, tier.capacity_bytes
    assert tier.write(K(1), 1, 2, payload(K(1), 1, N)) == Stored(N)
    assert tier.free(K(1), 2) == Freed()
    [spare] = _spares(tier)
    assert tier.write(K(1), 2, 5, payload(K(1), 2, N)) == Stored(N)
    _undo_publish(tier, K(1), root / "spares" / spare)  # power cut
    tier.close()

    b = SharedPoolTier(root, cap, recover=False)  # its recovery skipped S: A held S's flock
    a = SharedPoolTier(root, cap, recover=False)  # A's recovery is the one below
    b_threads: set[int] = set()
    b_waiting, go = threading.Event(), threading.Event()
    real_rename = os.rename

    def rename(src, dst, *args, **kwargs):
        # B's put-back (temp -> spares/) waits until A has tried its publish.
        if threading.get_ident() in b_threads and str(dst).startswith(str(root / "spares")):
            b_waiting.set()
            go.wait(10)
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(poolmod.os, "rename", rename)
    taken: list = []

    def b_take_spare():
        b_threads.add(threading.get_ident())
        taken.append(b._take_spare(b._bucket_str(K(2)), K(2).hex(), SIZE))

    real_publishable = a._publishable
    started: list[threading.Thread] = []

    def publishable(fd, key, **kw):
        ok = real_publishable(fd, key, **kw)
        if not started:
            t = threading.Thread(target=b_take_spare)
            started.append(t)
            t.start()
            assert b_waiting.wait(10), "B did not reach its put-back"
        return ok

    a._publishable = publishable
    raised = None
    try:
        a.recover()
    except FileNotFoundError as exc:
        import traceback
        frames = traceback.extract_tb(exc.__traceback__)
        raised = f"{exc!r} in {[f'{f.name}:{f.lineno}' for f in frames][-2:]} {frames[-1].line!r}"
    finally:
        go.set()
        for t in started:
            t.join(10)
        monkeypatch.undo()
    a.close()
    assert taken == [None], "B did not take the spare A held"
    # Process A is gone (it died in recover()); B goes on writing.
    b._spares_listed = 0.0  # B lists spares/ again (it does so every USAGE_REFRESH_S)
    assert b.write(K(2), 1, 1, payload(K(2), 1, N)) == Stored(N)
    b.close()
    fresh = SharedPoolTier(root, cap)
    got = fresh.read(K(1), 2)
    fresh.close()
    assert raised is None and got == payload(K(1), 2, N), (
        f"recover() raised {raised}; the acknowledged K1 gen2 e5 afterwards: {'present' if got else 'LOST'}")


def _spares_names(root: Path) -> list[str]:
    return sorted(os.listdir(root / "spares"))


def test_pool_outside_protocol_same_epoch_regeneration_lost(tmp_path):
    """(a), but only for a caller that breaks 'one owner per epoch' (the protocol gives every write
    grant a new epoch, so the reference node never does this): the tier accepts and acknowledges a
    second generation under the same epoch (fence_accepts: epoch >= fence), yet recovery republishes
    only a file of a HIGHER epoch than the published block, so after a power cut the older
    generation stays and the acknowledged one is dropped. The tier's contract and its Stored say
    nothing about this restriction."""
    tier = make("pool", tmp_path)
    assert tier.write(K(1), 1, 5, payload(K(1), 1, N)) == Stored(N)
    shutil.copy(tier._block_path(K(1)), tmp_path / "gen1")
    assert tier.write(K(1), 2, 5, payload(K(1), 2, N)) == Stored(N)  # same epoch, next generation
    _undo_publish(tier, K(1), tier._bucket(K(1)) / f".tmp-{K(1).hex()}-1-undone", previous=tmp_path / "gen1")
    tier = reopen("pool", tier, tmp_path)
    r = tier.recovery
    got2, got1 = tier.read(K(1), 2), tier.read(K(1), 1)
    tier.close()
    assert got2 == payload(K(1), 2, N), (
        f"acknowledged gen 2 lost, gen 1 served again ({got1 is not None}); dropped_uncommitted {r.dropped_uncommitted}")


# ============================================================================ attacks withstood


def _two_spares(tier) -> list[str]:
    for i in (7, 8):
        assert tier.write(K(i), 1, 1, payload(K(i), 1, N)) == Stored(N)
    for i in (7, 8):
        assert tier.free(K(i), 1) == Freed()
    spares = _spares(tier)
    assert len(spares) == 2
    return spares


def _listdir_ordered(monkeypatch, reverse: bool) -> None:
    real = os.listdir

    def listdir(path="."):
        names = real(path)
        return sorted(names, reverse=reverse) if str(path).endswith("spares") else names

    monkeypatch.setattr(poolmod.os, "listdir", listdir)


@pytest.mark.parametrize("reverse", [False, True])
def test_holds_fenced_stale_spare_write_and_acknowledged_block_both_undone(tmp_path, monkeypatch, reverse):
    """A write acknowledged at epoch 5 (reused spare A), then a stale epoch-3 write that reuses spare
    B and is Fenced(5): a power cut undoes the renames of both and the stale write's unlink,
    leaving both rewritten files in spares/. In either order of _recover_spares, the end state is
    epoch 5's block with fence 5 (the refused block, if published first, is replaced at once)."""
    tier = make("pool", tmp_path)
    spares = _two_spares(tier)
    assert tier.write(K(1), 1, 5, payload(K(1), 1, N)) == Stored(N)
    [left] = _spares(tier)
    [used] = [s for s in spares if s != left]
    assert tier.write(K(1), 2, 3, payload(K(1), 2, N)) == Fenced(5)
    assert _spares(tier) == []
    scratch = make("pool", tmp_path / "scratch")  # the stale write's bytes, as it wrote them
    assert scratch.write(K(1), 2, 3, payload(K(1), 2, N)) == Stored(N)
    shutil.copy(scratch._block_path(K(1)), tier.root / "spares" / left)
    scratch.close()
    _undo_publish(tier, K(1), tier.root / "spares" / used)
    _listdir_ordered(monkeypatch, reverse)
    tier = reopen("pool", tier, tmp_path)
    monkeypatch.undo()
    assert tier.read(K(1), 1) == payload(K(1), 1, N)
    assert tier.read(K(1), 2) is None
    assert tier.fence(K(1)) == 5
    assert tier.write(K(1), 3, 4, b"stale") == Fenced(5)
    tier.close()


@pytest.mark.parametrize("reverse", [False, True])
def test_holds_two_undone_spare_writes_of_one_key(tmp_path, monkeypatch, reverse):
    tier = make("pool", tmp_path)
    spares = _two_spares(tier)
    assert tier.write(K(1), 1, 4, payload(K(1), 1, N)) == Stored(N)
    [s_b] = _spares(tier)
    [s_a] = [s for s in spares if s != s_b]
    shutil.copy(tier._block_path(K(1)), tmp_path / "g1")
    assert tier.write(K(1), 2, 6, payload(K(1), 2, N)) == Stored(N)
    os.rename(tier._block_path(K(1)), tier.root / "spares" / s_b)  # second write's renames undone
    shutil.copy(tmp_path / "g1", tier.root / "spares" / s_a)  # the first write's too
    _listdir_ordered(monkeypatch, reverse)
    tier = reopen("pool", tier, tmp_path)
    monkeypatch.undo()
    assert tier.read(K(1), 2) == payload(K(1), 2, N) and tier.fence(K(1)) == 6
    assert tier.read(K(1), 1) is None
    tier.close()


def test_holds_reused_own_spare_then_power_cut(tmp_path):
    """K freed at 5 (spare = its gen 1), then K written at 6 into that very spare, undone: the
    spare holds gen 2/6 (published again), never gen 1 (freed)."""
    tier = make("pool", tmp_path)
    assert tier.write(K(1), 1, 5, payload(K(1), 1, N)) == Stored(N)
    assert tier.free(K(1), 5) == Freed()
    [spare] = _spares(tier)
    assert tier.write(K(1), 2, 6, payload(K(1), 2, N)) == Stored(N)
    _undo_publish(tier, K(1), tier.root / "spares" / spare)
    tier = reopen("pool", tier, tmp_path)
    assert tier.recovery.republished == 1
    assert tier.read(K(1), 2) == payload(K(1), 2, N) and tier.read(K(1), 1) is None
    assert tier.fence(K(1)) == 6 and tier._read_marks(K(1)) == (5, 5)
    assert tier.free(K(1), 6) == Freed()
    tier = reopen("pool", tier, tmp_path)
    assert tier.keys() == [] and tier.recovery.republished == 0
    tier.close()


def test_holds_recover_leaves_a_live_writers_temp(tmp_path):
    """A writer (another 'process': another tier object) is paused between its fdatasync and the
    key's lock, holding its temp file's flock; recover() in the other process leaves it alone."""
    root = tmp_path / "pool"
    a = make("pool", tmp_path)
    b = SharedPoolTier(root, a.capacity_bytes)
    real_locked = b._locked
    synced, go = threading.Event(), threading.Event()

    def locked(key):
        synced.set()
        go.wait(10)
        return real_locked(key)

    b._locked = locked
    out = []
    t = threading.Thread(target=lambda: out.append(b.write(K(1), 1, 3, payload(K(1), 1, N))))
    t.start()
    assert synced.wait(10)
    temps = [n for n in os.listdir(a._bucket(K(1))) if n.startswith(".tmp")]
    r = a.recover()
    still = [n for n in os.listdir(a._bucket(K(1))) if n.startswith(".tmp")]
    go.set()
    t.join(10)
    assert len(temps) == 1 and still == temps and r.republished == 0 and r.dropped_uncommitted == 0
    assert out == [Stored(N)] and a.read(K(1), 1) == payload(K(1), 1, N)
    a.close()
    b.close()


def test_holds_freed_mark_refuses_late_undone_write(tmp_path):
    """A write that was never acknowledged (its process killed after its fdatasync) leaves a whole
    temp file; a free of that epoch on the empty key (the directory's Free after the lease expired)
    makes the mark durable: recovery removes the temp, the freed epoch stays refused."""
    tier = make("pool", tmp_path)
    assert tier.write(K(1), 1, 5, payload(K(1), 1, N)) == Stored(N)
    _undo_publish(tier, K(1), tier._bucket(K(1)) / f".tmp-{K(1).hex()}-1-killed")
    assert tier.free(K(1), 5) == Absent()
    tier = reopen("pool", tier, tmp_path)
    assert tier.recovery.republished == 0 and tier.read(K(1), 1) is None and tier._read_marks(K(1)) == (0, 5)
    assert tier.write(K(1), 2, 5, b"late") == Fenced(0)
    tier.close()


def test_pool_pending_block_dropped_when_restored_fence_is_above_its_epoch(tmp_path):
    """(a) A temp file kept for a key whose fence file is corrupt is published after
    restore_fences only if the RESTORED fence accepts its epoch. A published block survives a fence
    raised without new bytes (free_takes: the block's own epoch decides); a pending one does not.
    Case: the pool owns K at epoch 5 (acknowledged, rename undone by a power cut), the directory has
    started a transfer away (epoch 6, the pool still the owner and copy source), the fence file
    reads back damaged, and the rejoining node's Welcome restores (K, 6) -- the reference
    directory sends exactly this for a key the node owns. Recovery then removes the owner's
    acknowledged block as 'uncommitted'. Before 7dec286 it would have been at its name."""
    tier = make("pool", tmp_path)
    assert tier.write(K(1), 1, 2, payload(K(1), 1, N)) == Stored(N)
    shutil.copy(tier._block_path(K(1)), tmp_path / "gen1")
    tier.restore_fences({K(1): 3})  # some earlier restore: the key has a fence file
    assert tier.write(K(1), 2, 5, payload(K(1), 2, N)) == Stored(N)  # new file: its temp name is durable
    _undo_publish(tier, K(1), tier._bucket(K(1)) / f".tmp-{K(1).hex()}-1-undone", previous=tmp_path / "gen1")
    tier._fence_path(K(1)).write_bytes(b"garbage")
    tier = reopen("pool", tier, tmp_path)
    assert tier.recovery.fences_corrupt == (K(1),)
    tier.restore_fences({K(1): 6})
    r = tier.recover()
    got = tier.read(K(1), 2)
    tier.close()
    assert got == payload(K(1), 2, N), (
        f"acknowledged owner block K1 gen2 e5 removed by recovery (dropped_uncommitted {r.dropped_uncommitted}, "
        f"republished {r.republished})")
