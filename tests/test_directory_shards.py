"""Step 1 of the sharded directory (docs/sharding.md): the shard function, the ``wrong_shard``
refusal, and interleaved lease-id spaces, in the directory core.

A chain lives in its root's shard (``keys.shard_of``): a shard refuses a root it does not own
(``wrong_shard``) and changes nothing; a child is written only in its parent's shard, which the
existing ``parent_not_committed`` already ensures. Shard ``i`` of ``N`` hands out only lease ids
congruent to ``i`` modulo ``N``, across restarts too, so ids are unique across the deployment.
With one shard nothing changes. The cores are driven with ``test_directory_core``'s harness.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter

import attrs
import pytest

from test_directory_core import _NS_A, CFG, NS_A, Directory, authorize, events, of

from kvcc.conformance.validate import ACCEPTED, TraceParams, validate_trace
from kvcc.reference import wire
from kvcc.reference.directory import DirectoryCore, DirectoryStore, Emit, Persist, ReserveLeaseIds
from kvcc.spec import vocabulary
from kvcc.spec.keys import DIGEST_BYTES, BlockKey, chain_keys, shard_of
from kvcc.spec.rules import COMMITTED

ROOTS = tuple(chain_keys(_NS_A, [i, i])[0] for i in range(200))  # roots of many chains


def root_of(shard: int, shards: int, nth: int = 0) -> BlockKey:
    """The ``nth`` root of ``ROOTS`` that shard ``shard`` of ``shards`` owns."""
    return [k for k in ROOTS if shard_of(k.digest, shards) == shard][nth]


class Shard(Directory):
    """``test_directory_core.Directory`` whose core is shard ``shard`` of ``shards``."""

    def __init__(self, shard: int, shards: int, path: str | None = None) -> None:
        super().__init__(path)
        self.config = attrs.evolve(CFG, shard=shard, shards=shards)
        self.core = DirectoryCore(self.config, authorize)

    def root(self, key: BlockKey, node: str = "w"):
        """``begin_write`` of ``key`` as a root of namespace A."""
        return self.begin_write(key, node, parent=None, namespace=NS_A)

    def write_root(self, key: BlockKey, node: str = "w") -> wire.WriteLeaseGranted:
        grant, _ = self.root(key, node)
        assert isinstance(grant, wire.WriteLeaseGranted), grant
        assert isinstance(self.commit(grant, node)[0], wire.Committed)
        return grant

    def restart(self, dt: int = 0):
        """kill -9 and restart from the store, as the same shard."""
        assert self.store is not None
        self.store.close()
        self.store = DirectoryStore(self.path)
        loaded = self.store.load()
        self.core = DirectoryCore(self.config, authorize)
        self.now += dt
        self.apply(self.core.restarted(loaded.records, loaded.next_lease_id, self.now, loaded.tickets, loaded.next_ticket))
        self.core.check_invariants()
        return loaded


def state(core: DirectoryCore) -> tuple:
    """Everything a refusal must leave as it was: the records, the lease table, the tickets, the
    lease-id counters (``DirectoryCore``'s public state)."""
    return (dict(core.records), dict(core.read_leases), dict(core.tickets), core.next_lease_id, core.lease_id_limit,
            core.next_ticket, core.grace_until_ms, frozenset(core.down_locations))  # fmt: skip


def leases(d: Directory, key: BlockKey, count: int, prefix: str) -> list[int]:
    """The ids of ``count`` read leases on committed ``key``, one per new holder."""
    out = []
    for i in range(count):
        grant, _ = d.acquire(key, node=f"{prefix}{i}", namespace=NS_A)
        assert isinstance(grant, wire.ReadLeaseGranted), grant
        out.append(grant.lease)
    return out


# ------------------------------------------------------------------------------------ the shard function


def test_shard_of_is_the_documented_hash():
    """docs/sharding.md's formula, pinned on two digests (a change of domain, width or byte
    order moves every chain of a deployment)."""
    zero = bytes(DIGEST_BYTES)
    assert int.from_bytes(hashlib.sha256(b"kvcc shard\0" + zero).digest()[:8], "big") == 379644599922262365
    assert shard_of(zero, 1000003) == 379644599922262365 % 1000003 == 879392
    assert shard_of(bytes(range(DIGEST_BYTES)), 7) == 5
    assert {shard_of(k.digest, 1) for k in ROOTS} == {0}


@pytest.mark.parametrize("shards", [2, 3, 4])
def test_shard_of_spreads_roots_evenly(shards):
    rng = random.Random(13 * shards)
    draws = 6000
    counts = Counter(shard_of(rng.randbytes(DIGEST_BYTES), shards) for _ in range(draws))
    assert set(counts) == set(range(shards))
    expected = draws / shards
    # About 4.5 standard deviations at N = 4: a fair hash passes, a skewed one does not.
    assert all(abs(n - expected) < 0.1 * expected for n in counts.values()), counts


def test_shard_of_refuses_bad_input_with_typed_errors():
    digest = ROOTS[0].digest
    for shards in (0, -1):
        with pytest.raises(ValueError, match="shard count"):
            shard_of(digest, shards)
    for shards in (True, 2.0, "2"):
        with pytest.raises(TypeError, match="shard count"):
            shard_of(digest, shards)  # type: ignore[arg-type]
    for short in (b"", digest[:-1], digest + b"\0"):
        with pytest.raises(ValueError, match="32 bytes"):
            shard_of(short, 2)
    for not_bytes in (ROOTS[0], digest.hex(), bytearray(digest), None):
        with pytest.raises(TypeError, match="root digest"):
            shard_of(not_bytes, 2)  # type: ignore[arg-type]


def test_config_takes_a_shard_of_a_count():
    assert (CFG.shard, CFG.shards) == (0, 1)
    assert attrs.evolve(CFG, shard=2, shards=3).shard == 2
    for shard, shards in ((1, 1), (3, 3), (-1, 2), (True, 2), (0, 0), (0, True)):
        with pytest.raises(ValueError, match="shard"):
            attrs.evolve(CFG, shard=shard, shards=shards)


# ------------------------------------------------------------------------------------ wrong_shard


def test_wrong_shard_is_a_directory_reason():
    assert vocabulary.REASON_WRONG_SHARD == "wrong_shard"
    assert vocabulary.REASON_WRONG_SHARD in vocabulary.DIRECTORY_REASONS


@pytest.mark.parametrize("shards", [2, 3])
def test_a_root_is_refused_by_a_shard_that_does_not_own_it(shards):
    for owner in range(shards):
        root = root_of(owner, shards)
        for other in range(shards):
            if other == owner:
                continue
            d = Shard(other, shards)
            d.write_root(root_of(other, shards))  # some state of its own: a record, lease ids used
            leases(d, root_of(other, shards), 2, "r")
            before = state(d.core)
            refused, effects = d.root(root)
            assert refused == wire.LeaseRefused("w", root, d.req, vocabulary.REASON_WRONG_SHARD)
            wire.check_message(refused)
            # One refusal logged, as any refusal is; nothing durable, no lease id taken.
            assert [type(e) for e in effects] == [Emit] and events(effects) == ["refuse_write_lease"]
            assert effects[0].fields["result"] == vocabulary.REASON_WRONG_SHARD and effects[0].is_spec_action
            assert state(d.core) == before
            assert root not in d.core.records
        # The shard that owns it grants it.
        d = Shard(owner, shards)
        grant, effects = d.root(root)
        assert isinstance(grant, wire.WriteLeaseGranted) and events(effects) == ["grant_write_lease"], grant
        assert isinstance(d.commit(grant)[0], wire.Committed)
        assert d.core.records[root].phase == COMMITTED


def test_a_child_is_refused_under_a_parent_committed_in_another_shard():
    shards = 2
    root = root_of(0, shards)
    # A child whose own digest hashes to the other shard: its chain's shard is its root's all the same.
    children = (BlockKey.chain(_NS_A, root, [j, j]) for j in range(100))
    child = next(c for c in children if shard_of(c.digest, shards) == 1)
    owner, other = Shard(0, shards), Shard(1, shards)
    owner.write_root(root)
    other.write_root(root_of(1, shards))
    before = state(other.core)
    refused, effects = other.begin_write(child, parent=root, namespace=NS_A)
    assert refused.reason == vocabulary.REASON_PARENT_NOT_COMMITTED, refused
    assert events(effects) == ["refuse_write_lease"] and not of(effects, Persist) and not of(effects, ReserveLeaseIds)
    assert state(other.core) == before
    # Its root's shard grants it, though the child itself hashes elsewhere: the rule is the root's.
    grant, _ = owner.begin_write(child, parent=root, namespace=NS_A)
    assert isinstance(grant, wire.WriteLeaseGranted), grant


def test_the_validator_replays_a_wrong_shard_refusal_as_the_requests_loss():
    """A shard logs the refusal as any refusal (``refuse_write_lease``); the trace validator, which
    sees one directory, takes it as a reason outside the one-key model: the request consumed."""
    root = root_of(0, 2)
    d = Shard(1, 2)
    _, [refusal] = d.root(root)
    line = {"incarnation": 1, "gen": None, "epoch": None, "lease": None, "key": root.hex}
    trace = [
        {**line, "node": "w", "seq": 1, "t_local_ns": 1_000_000, "t_wall_ns": 1_000_000, "event": "begin_write",
         "result": None, "request": 1},
        {**line, "node": "directory", "seq": 1, "t_local_ns": 2_000_000, "t_wall_ns": 2_000_000,
         "event": refusal.event, "result": refusal.fields["result"], "writer": refusal.fields["writer"]},
        {**line, "node": "w", "seq": 2, "t_local_ns": 3_000_000, "t_wall_ns": 3_000_000, "event": "abort", "result": None},
    ]  # fmt: skip
    verdict = validate_trace(trace, TraceParams(CFG.lease_term_ms, CFG.skew_ms))
    assert verdict.status == ACCEPTED, verdict


# ------------------------------------------------------------------------------------ lease ids


@pytest.mark.parametrize("shards", [2, 3])
def test_each_shard_hands_out_its_own_lease_ids_across_restarts(tmp_path, shards):
    issued: dict[int, list[int]] = {}
    count = 2 * CFG.lease_id_block + 3  # across several reservations
    for shard in range(shards):
        d = Shard(shard, shards, str(tmp_path / f"shard{shard}.sqlite"))
        root = root_of(shard, shards)
        mine = [d.write_root(root).lease, *leases(d, root, count, "a")]
        for restart in range(2):
            d.restart()
            assert d.core.next_lease_id % shards == shard and d.core.next_lease_id > max(mine)
            mine += leases(d, root, count, f"b{restart}.")
        d.store.close()
        assert all(lease % shards == shard for lease in mine), (shard, mine)
        assert len(set(mine)) == len(mine), "never reused (protocol property 8)"
        assert mine == sorted(mine)
        issued[shard] = mine
    every = [lease for ids in issued.values() for lease in ids]
    assert len(set(every)) == len(every), "unique across the shards"


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_a_restart_starts_at_its_own_first_id_above_the_durable_mark(shards):
    for shard in range(shards):
        config = attrs.evolve(CFG, shard=shard, shards=shards)
        for mark in range(1, 3 * shards + 2):
            core = DirectoryCore(config, authorize)
            core.restarted((), mark, 0)
            first = core.next_lease_id
            assert first % shards == shard and mark <= first < mark + shards, (shard, mark, first)
            core.check_invariants()


# ------------------------------------------------------------------------------------ one shard


def _script(d: Directory) -> list:
    """Replies and effects (``Emit`` as its event, fields and time) of writes, leases and a restart."""
    out = []

    def keep(reply, effects):
        out.append((reply, [(e.event, dict(e.fields), e.at_ms) if isinstance(e, Emit) else e for e in effects]))

    for k in ROOTS[:4]:
        grant, effects = d.begin_write(k, parent=None, namespace=NS_A)
        keep(grant, effects)
        keep(*d.commit(grant))
    for i in range(CFG.lease_id_block + 2):
        keep(*d.acquire(ROOTS[i % 4], node=f"r{i}", namespace=NS_A))
    d.restart()
    for i in range(3):
        keep(*d.acquire(ROOTS[i], node=f"s{i}", namespace=NS_A))
    return out


def test_one_shard_is_the_one_directory(tmp_path):
    plain = Directory(str(tmp_path / "plain.sqlite"))
    one = Shard(0, 1, str(tmp_path / "one.sqlite"))
    got, expected = _script(one), _script(plain)
    assert got == expected
    ids = [r.lease for r, _ in got if isinstance(r, (wire.WriteLeaseGranted, wire.ReadLeaseGranted))]
    block = CFG.lease_id_block
    # Every id in order from 1, as before shards; the restart starts at the durable mark.
    assert ids[: 4 + block + 2] == list(range(1, 4 + block + 3))
    assert ids[4 + block + 2 :] == [1 + 2 * block, 2 + 2 * block, 3 + 2 * block]
    limits = [e.limit for _, effects in got for e in effects if isinstance(e, ReserveLeaseIds)]
    assert limits == [1 + block, 1 + 2 * block, 1 + 3 * block]
    plain.store.close()
    one.store.close()
