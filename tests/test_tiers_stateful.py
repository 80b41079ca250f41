"""Storage tiers under concurrency and random operation sequences: readers racing writers never see
wrong bytes, and a Hypothesis state machine drives each tier and a dict model with the same
operations. Shared helpers: ``tier_support``."""

from __future__ import annotations

import random
import shutil
import tempfile
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
    Fenced,
    Freed,
    Hit,
    Miss,
    MissReason,
    NoSpace,
    Stored,
)

from tier_support import (  # noqa: F401 (kind, tier: fixtures)
    KINDS,
    DURABLE,
    K,
    payload,
    make,
    reopen,
    kind,
    tier,
)


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


