"""The directory's durable stores, one suite over both backends (``directory_store_factory``:
SQLite and etcd), driven by the real ``DirectoryCore`` with real messages; then what only the etcd
store does: deposing a directory, journalled large batches and their recovery, mirrored leases,
record watches, and a member killed mid-stream in a three-member cluster.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import pytest

from backends import StoreFactory
from kvcc.reference import wire
from kvcc.reference.directory import (
    Deposed,
    DirectoryCore,
    EtcdDirectoryStore,
    ForgetTicket,
    InvalidEffect,
    OwnerAlive,
    Persist,
    PersistTicket,
    ReserveLeaseIds,
    StoreFailed,
)
from kvcc.reference.directory.etcd_store import read_records, watch_records
from kvcc.bench.directory_store import bench_store
from kvcc.reference.etcd_client import EtcdIndeterminate
from kvcc.spec.keys import BlockKey, Namespace, chain_keys
from kvcc.spec.rules import ABSENT, COMMITTED, INVALIDATING, WRITING
from kvcc.spec import vocabulary
from test_directory_core import _NS_A, A0, A1, A1X, A2, B0, CFG, NS_A, Directory, authorize, of

TESTS = Path(__file__).resolve().parent
GRACE_MS = 30_000  # restart grace given to mirroring etcd stores: far above a test's duration
WATCH_WAIT_S = 10.0  # how long a test waits for one watched change before failing
CHILD_LINES = 25  # commits a crash-test child reports before it is killed


def attach(store) -> Directory:
    """A core (test_directory_core's harness) committing to ``store``, which was just loaded."""
    d = Directory()
    d.store = store
    return d


def restart(d: Directory, store):
    """The directory restarts on ``store`` (a new one on the same log): load -- which must hold
    exactly what the old core had -- then restarted, and its effects committed."""
    loaded = store.load()
    assert_same_log(loaded, d.core)
    d.store = store
    d.core = DirectoryCore(CFG, authorize)
    effects = d.core.restarted(loaded.records, loaded.next_lease_id, d.now, loaded.tickets, loaded.next_ticket)
    d.apply(effects)
    d.core.check_invariants()
    return loaded


def assert_same_log(loaded, core: DirectoryCore) -> None:
    assert {r.key: r for r in loaded.records} == core.records
    assert [r.key for r in loaded.records] == sorted(core.records)
    assert {t.ticket: t for t in loaded.tickets} == core.tickets
    assert loaded.next_lease_id == core.lease_id_limit
    assert loaded.next_ticket == core.next_ticket


def chain(n: int, first_token: int) -> list[BlockKey]:
    """``n`` keys of one chain in test_directory_core's namespace A (its tenants may use it)."""
    return chain_keys(_NS_A, list(range(first_token, first_token + n * _NS_A.block_tokens)))


def write_chain(d: Directory, keys: list[BlockKey], parent: BlockKey | None = None) -> None:
    ns = NS_A
    for k in keys:
        d.req += 1
        grant, _ = d.send(wire.BeginWrite("w", k, ns, parent, d.req))
        assert isinstance(grant, wire.WriteLeaseGranted), grant
        reply, _ = d.commit(grant)
        assert isinstance(reply, wire.Committed), reply
        parent = k


# ------------------------------------------------------------------------------------------ both backends


def test_round_trip_restart_and_continue(directory_store_factory):
    f = directory_store_factory
    store = f.open()
    first = store.load()
    assert first.fresh and first.records == () and first.tickets == ()
    d = attach(store)
    for k in (A0, A1, A2, B0):
        d.write(k)
    grant, _ = d.acquire(A1)
    _, effects = d.invalidate(A1)  # A1 and its child A2: INVALIDATING, a ticket pending on the lease
    assert of(effects, PersistTicket)
    forgotten = []
    for _ in range(6):  # more completed tickets than CFG remembers: ForgetTicket
        d.write(A1X)
        forgotten += of(d.invalidate(A1X)[1], ForgetTicket)
    assert forgotten
    assert d.core.records[A1].phase == INVALIDATING and d.core.records[A1X].phase == ABSENT
    store.close()

    loaded = restart(d, f.open())
    assert not loaded.fresh and loaded.incarnation > first.incarnation
    d.tick(dt=CFG.restart_grace_ms + 1)  # the lease on A1 ended with the old incarnation
    assert d.core.records[A1].phase == ABSENT and d.core.records[A1].gen == 1
    d.write(A1)  # the next generation
    again = f.open().load()
    assert again.incarnation > loaded.incarnation
    assert_same_log(again, d.core)


def test_commit_with_nothing_durable_writes_nothing(directory_store_factory):
    f = directory_store_factory
    store = f.open()
    store.load()
    d = attach(store)
    d.write(A0)
    before = f.fingerprint()
    _, effects = d.acquire(A0)  # a lease id from the block already reserved: nothing durable
    assert effects and not of(effects, ReserveLeaseIds)
    assert store.commit(effects) == 0 and store.commit([]) == 0
    assert f.fingerprint() == before


def test_lease_id_limit_never_goes_down(directory_store_factory):
    f = directory_store_factory
    store = f.open()
    store.load()
    assert store.commit([ReserveLeaseIds(100)]) == 1
    assert store.commit([ReserveLeaseIds(50), ReserveLeaseIds(70)]) == 2
    assert store.lease_id_limit == 100
    store.close()
    store = f.open()
    loaded = store.load()
    assert loaded.next_lease_id == 100 == store.lease_id_limit
    # A core restarted at the mark reserves above it before handing out any id.
    d = attach(store)
    d.core = DirectoryCore(CFG, authorize)
    d.apply(d.core.restarted(loaded.records, loaded.next_lease_id, d.now, loaded.tickets, loaded.next_ticket))
    _, effects = d.begin_write(A0)
    assert [e.limit for e in of(effects, ReserveLeaseIds)] == [100 + CFG.lease_id_block]
    assert f.open().load().next_lease_id == 100 + CFG.lease_id_block


def test_bad_input_raises_typed_errors_and_changes_nothing(directory_store_factory):
    f = directory_store_factory
    store = f.open()
    store.load()
    d = attach(store)
    d.write(A0)
    rec = d.core.records[A0]
    before, limit = f.fingerprint(), store.lease_id_limit
    bad = [
        [ReserveLeaseIds(limit + 10), PersistTicket(None)],  # the good effect before it is not written either
        [ReserveLeaseIds(limit + 10), "junk"],
        [ReserveLeaseIds(0)],
        [ReserveLeaseIds(2**63)],
        [ReserveLeaseIds(True)],
        [ForgetTicket(0)],
        [Persist("record")],
        [Persist(attrs.evolve(rec, owner=5))],  # a record whose owner is not a location
        [Persist(attrs.evolve(rec, epoch=2**64))],
        [Persist(attrs.evolve(rec, writer_tenant=b"tenant"))],
        "effects",
        None,
        7,
    ]
    for effects in bad:
        with pytest.raises(InvalidEffect):
            store.commit(effects)
    with pytest.raises(ValueError):
        store.mirror_leases(-1)
    assert f.fingerprint() == before and store.lease_id_limit == limit
    assert store.commit([ReserveLeaseIds(limit + 1)]) == 1  # still usable
    store.close()
    loaded = f.open().load()
    assert {r.key: r for r in loaded.records} == {A0: rec} and loaded.next_lease_id == limit + 1


def test_the_events_tail_is_kept_with_its_commit(directory_store_factory):
    """The event-log lines committed with a step come back with the log (``Loaded.events_tail``),
    replaced by the next commit that has lines, kept by one without; bad lines change nothing."""
    f = directory_store_factory
    store = f.open()
    assert store.load().events_tail == ()
    limit = store.lease_id_limit
    store.commit([ReserveLeaseIds(limit + 1)], events_tail=["a", "b"])
    assert f.open().load().events_tail == ("a", "b")
    store = f.open()
    store.load()
    big = ["x" * 1000 + str(i) for i in range(700)]  # 700 KB: more than one piece on etcd
    store.commit([ReserveLeaseIds(limit + 2)], events_tail=big)
    store.commit([ReserveLeaseIds(limit + 3)])  # no lines: the tail stays
    assert f.open().load().events_tail == tuple(big)
    store = f.open()
    store.load()
    store.commit([ReserveLeaseIds(limit + 4)], events_tail=["c"])  # fewer pieces than before
    before = f.fingerprint()
    for bad in ("line", ["two\nlines"], [""], [b"bytes"], [7]):
        with pytest.raises(InvalidEffect):
            store.commit([ReserveLeaseIds(limit + 5)], events_tail=bad)
    assert f.fingerprint() == before
    assert f.open().load().events_tail == ("c",)


_CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[2])
    from backends import open_store
    from kvcc.reference import wire
    from kvcc.reference.directory import DirectoryConfig, DirectoryCore
    from kvcc.spec.keys import BlockKey, Namespace

    ns = Namespace("crash", "rev1", "bfloat16", 1)
    store = open_store(json.loads(sys.argv[1]))
    store.load()
    core = DirectoryCore(DirectoryConfig(lease_term_ms=100, skew_ms=10, lease_id_block=3, pool_location="pool"), lambda t, n: True)
    parent, now = None, 0
    for i in range(100_000):
        key = BlockKey.chain(ns, parent, [i])
        grant, effects = core.handle(wire.BeginWrite("w", key, ns.digest(), parent, 2 * i + 1), now, "t")
        store.commit(effects)
        reply, effects = core.handle(wire.Commit("w", key, grant.lease, grant.gen, grant.epoch), now, "t")
        store.commit(effects)
        assert isinstance(reply, wire.Committed)
        print(key.hex, store.lease_id_limit, flush=True)
        parent, now = key, now + 1
    """
)


def test_kill_9_while_committing_loses_nothing_reported(directory_store_factory):
    f = directory_store_factory
    env = dict(os.environ, PYTHONSAFEPATH="1", DO_NOT_TRACK="1", VLLM_NO_USAGE_STATS="1", LMCACHE_TRACK_USAGE="false", HF_HUB_OFFLINE="1")
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, json.dumps(f.spec), str(TESTS)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    reported: list[tuple[str, int]] = []
    try:
        assert child.stdout is not None
        while len(reported) < CHILD_LINES:
            line = child.stdout.readline()
            assert line, f"child ended early: {child.stderr.read().decode() if child.stderr else ''}"
            key, limit = line.split()
            reported.append((key.decode(), int(limit)))
    finally:
        child.send_signal(signal.SIGKILL)  # mid-commit, most likely
        child.wait()
        assert child.stdout is not None and child.stderr is not None
        rest = child.stdout.read()  # what it reported before it died
        child.stdout.close()
        child.stderr.close()
    for line in rest.split(b"\n")[:-1]:  # the last piece is cut or empty
        key, limit = line.split()
        reported.append((key.decode(), int(limit)))
    assert child.returncode == -signal.SIGKILL
    store = f.open()
    loaded = store.load()
    records = {r.key.hex: r for r in loaded.records}
    assert len(records) - len(reported) in (0, 1)  # at most one commit landed unreported
    for key, _ in reported:
        assert records[key].phase == COMMITTED, key
    assert loaded.next_lease_id >= max(limit for _, limit in reported)
    leases = [max(r.write_lease, r.committed_lease) for r in loaded.records]
    assert max(leases) < loaded.next_lease_id, "a lease id at or above the durable mark"


def test_bench_store_commits_what_it_times(directory_store_factory):
    store = directory_store_factory.open()
    store.load()
    assert bench_store(store, 20) > 0
    loaded = directory_store_factory.open().load()
    assert [r.phase for r in loaded.records].count(COMMITTED) == 10  # 10 writes, 2 commits each


# ------------------------------------------------------------------------------------------ etcd only


@pytest.fixture
def etcd_factory(etcd1):
    factory = StoreFactory.etcd(etcd1.endpoints)
    try:
        yield factory
    finally:
        factory.close_all()


pytestmark_etcd = pytest.mark.integration


@pytestmark_etcd
def test_a_second_store_deposes_the_first(etcd_factory):
    f = etcd_factory
    first = f.open(restart_grace_ms=GRACE_MS)
    first.load()
    d = attach(first)
    d.write(A0)
    second = f.open(restart_grace_ms=GRACE_MS)
    assert second.incarnation > first.incarnation
    before = f.fingerprint()
    with pytest.raises(Deposed):
        d.begin_write(A1)  # its commit is refused
    with pytest.raises(Deposed):
        first.commit([ReserveLeaseIds(10**6)])
    with pytest.raises(Deposed):
        first.load()
    assert f.fingerprint() == before
    loaded = second.load()
    assert [r.key for r in loaded.records] == [A0] and loaded.next_lease_id < 10**6
    # A deposed directory that only serves reads learns it at its next lease bucket.
    third = f.open(restart_grace_ms=GRACE_MS)
    with pytest.raises(Deposed):
        second.mirror_leases(100)
    # A standby does not depose a live owner; once the owner is gone it takes over.
    with pytest.raises(OwnerAlive):
        f.open(take_over=False)
    third.close()
    with pytest.raises(StoreFailed):
        third.commit([ReserveLeaseIds(10**6)])
    standby = f.open(take_over=False)
    assert standby.load().records == loaded.records


@pytestmark_etcd
@pytest.mark.parametrize("applied", [True, False], ids=["lost-answer", "lost-request"])
def test_a_commit_whose_outcome_is_unknown_applies_exactly_once(etcd_factory, monkeypatch, applied):
    f = etcd_factory
    store = f.open()
    store.load()
    _, start = store.read_records()  # (the session cluster's older revisions may be compacted)
    d = attach(store)
    d.write(A0)
    real, calls = store._kv.txn, []

    def flaky(compare, success, failure):
        calls.append(len(success))
        if len(calls) == 1:  # the first commit attempt: its answer (or the request itself) is lost
            if applied:
                real(compare, success, failure)
            raise EtcdIndeterminate("simulated lost answer", "test")
        return real(compare, success, failure)

    monkeypatch.setattr(store._kv, "txn", flaky)
    d.write(A1)  # BeginWrite's commit: sent twice, applied once
    assert store.unknown_outcomes == 1 and len(calls) >= 3
    monkeypatch.undo()
    d.write(A2)  # later commits still fenced on the right revision
    with f.kv() as kv:
        history = []
        w = watch_records(kv, f.spec["prefix"], start_revision=start + 1)
        try:
            while (c := w.get(1.0)) is not None:
                history.append((c.key, c.record.phase))
        finally:
            w.cancel()
    assert history == [(k, p) for k in (A0, A1, A2) for p in (WRITING, COMMITTED)]  # each change once
    assert_same_log(f.open().load(), d.core)


@pytestmark_etcd
def test_bad_prefix_and_limits_are_refused(etcd1):
    for prefix in ("", "/kvcc", "kvcc/", "a b", "a//b", "k\u00e9"):
        with pytest.raises(ValueError):
            EtcdDirectoryStore(etcd1.endpoints, prefix)
    with pytest.raises(ValueError):
        EtcdDirectoryStore(etcd1.endpoints, "ok", max_txn_ops=2)


@pytestmark_etcd
def test_large_batches_go_through_a_journal_and_survive_a_crash(etcd_factory, monkeypatch):
    f = etcd_factory
    keys = chain(12, 100)
    small = dict(max_txn_ops=8)  # 12 records and a ticket cannot go in one transaction
    invalidate_all = wire.Invalidate(NS_A, vocabulary.SCOPE_NAMESPACE, None)
    journal = f.spec["prefix"] + "/journal/"

    def log_records():
        with f.kv() as kv:
            return read_records(kv, f.spec["prefix"])[0]

    def journal_keys():
        with f.kv() as kv:
            return kv.range_prefix(journal)[0]

    store = f.open(**small)
    store.load()
    d = attach(store)
    write_chain(d, keys)
    _, effects = d.send(invalidate_all)
    assert len(of(effects, Persist)) >= len(keys)
    assert_same_log(f.open(**small).load(), d.core)
    assert journal_keys() == []

    class Crash(Exception):
        pass

    # A crash after the commit point, before the journal is applied: the next owner applies it.
    store = f.open(**small)
    restart(d, store)
    d.tick(dt=CFG.restart_grace_ms + 1)  # past the grace: invalidations complete at once again
    write_chain(d, keys)  # generation 1
    committed = log_records()
    monkeypatch.setattr(store, "_apply", lambda *a, **kw: (_ for _ in ()).throw(Crash()))
    with pytest.raises(Crash):
        d.send(invalidate_all)
    assert journal_keys(), "the journal was written"
    assert log_records() == committed, "...and not applied"
    store = f.open(**small)
    assert log_records() == d.core.records  # applied when the next owner took over
    assert journal_keys() == []
    restart(d, store)
    d.tick(dt=CFG.restart_grace_ms + 1)

    # A crash before the commit point: the chunks are orphans, removed; the batch never happened.
    write_chain(d, keys)  # generation 2
    committed = log_records()
    assert committed == d.core.records
    real = store._fenced_txn

    def no_commit_point(success, *, advances):
        if advances is not None:
            raise Crash
        return real(success, advances=advances)

    monkeypatch.setattr(store, "_fenced_txn", no_commit_point)
    with pytest.raises(Crash):
        d.send(invalidate_all)
    assert journal_keys()
    loaded = f.open(**small).load()
    assert {r.key: r for r in loaded.records} == committed
    assert journal_keys() == []


@pytestmark_etcd
def test_leases_are_mirrored_in_buckets(etcd_factory):
    f = etcd_factory
    markers = lambda: len(f.keys_under("leases/"))  # noqa: E731
    mirroring = dict(restart_grace_ms=GRACE_MS)
    store = f.open(**mirroring)
    assert store.load().lease_horizon_ms == 0  # a fresh log: no lease was ever granted
    store.commit([ReserveLeaseIds(10)])
    assert markers() == 0
    store.mirror_leases(1100)
    assert markers() == 1
    before = f.fingerprint()
    for _ in range(50):
        store.mirror_leases(1100)  # the same bucket: no etcd call
    assert f.fingerprint() == before
    # The next owner waits what is left of that bucket lease (<= 1.1 s + bucket, in whole
    # seconds, + etcd's truncation), not the full grace.
    horizon = f.open(**mirroring).load().lease_horizon_ms
    assert horizon is not None and 0 <= horizon <= 4000 < GRACE_MS
    store = f.open(**mirroring)
    store.load()
    store.mirror_leases(GRACE_MS * 2)
    assert f.open(**mirroring).load().lease_horizon_ms == GRACE_MS  # never more than the grace

    # An owner that does not mirror: the next mirroring one cannot know, waits the full grace
    # (None) and mirrors that wait, so the one after it knows again.
    plain = f.open()
    assert plain.load().lease_horizon_ms is None
    n = markers()
    plain.mirror_leases(1100)  # nothing: not mirroring
    assert markers() == n
    assert f.open(**mirroring).load().lease_horizon_ms is None
    assert markers() == n + 1
    assert f.open(**mirroring).load().lease_horizon_ms == GRACE_MS


def _changes(w, n: int) -> list:
    out = []
    for _ in range(n):
        change = w.get(WATCH_WAIT_S)
        assert change is not None, f"watch stalled after {out}"
        out.append(change)
    return out


@pytestmark_etcd
def test_watch_sees_invalidating_then_absent(etcd_factory):
    f = etcd_factory
    store = f.open()
    store.load()
    w = store.watch_records()
    try:
        d = attach(store)
        d.write(A0)
        grant, _ = d.acquire(A0)
        d.invalidate(A0)
        d.send(wire.RevokeAcked("r1", A0, grant.lease))
        assert d.core.records[A0].phase == ABSENT
        got = _changes(w, 4)
        assert w.get(0.3) is None
    finally:
        w.cancel()
    assert [(c.key, c.record.phase, c.record.gen, c.record.epoch, c.record.owner) for c in got] == [
        (A0, WRITING, 0, 1, "pool"),
        (A0, COMMITTED, 0, 1, "pool"),
        (A0, INVALIDATING, 0, 1, "pool"),
        (A0, ABSENT, 1, 1, None),
    ]
    revisions = [c.revision for c in got]
    assert revisions == sorted(set(revisions))
    # Routers and nodes: a snapshot and a watch from a revision, with a client of their own.
    with f.kv() as kv:
        snapshot, revision = read_records(kv, f.spec["prefix"])
        assert snapshot == d.core.records and revision >= revisions[-1]
        seen = []
        replay = watch_records(kv, f.spec["prefix"], seen.append, start_revision=revisions[1])
        try:
            d.write(A0)  # generation 1 is written after the replayed history
            _wait(lambda: len(seen) >= 5)
        finally:
            replay.cancel()
    assert seen[:3] == got[1:]
    assert [(c.record.phase, c.record.gen) for c in seen[3:5]] == [(WRITING, 1), (COMMITTED, 1)]


def _wait(pred) -> None:
    import time

    deadline = time.monotonic() + WATCH_WAIT_S
    while not pred():
        assert time.monotonic() < deadline, "timed out waiting for watched changes"
        time.sleep(0.02)


@pytestmark_etcd
def test_three_members_kill_one_mid_stream(etcd3):
    c = etcd3
    leader = c.leader()
    order = [c.endpoint(i) for i in [leader] + [i for i in range(3) if i != leader]]  # start on the leader
    f = StoreFactory.etcd(order)
    keys = chain(16, 200)
    ns = NS_A
    try:
        store = f.open()
        d = attach(store)
        store.load()
        with f.kv() as kv:
            _, revision = read_records(kv, f.spec["prefix"])
            w = watch_records(kv, f.spec["prefix"], start_revision=revision + 1)  # a router's view
            try:
                write_chain(d, keys[:8])
                c.kill(leader)  # SIGKILL, mid-stream: the client fails over, commits go on
                write_chain(d, keys[8:], parent=keys[7])
                leaf = keys[-1]
                d.req += 1
                grant, _ = d.send(wire.Acquire("r1", leaf, ns, d.req))
                d.invalidate(leaf, namespace=ns)
                d.send(wire.RevokeAcked("r1", leaf, grant.lease))
                assert d.core.records[leaf].phase == ABSENT
                got = _changes(w, 2 * len(keys) + 2)
                assert w.get(0.3) is None
                assert w.reconnects >= 1
            finally:
                w.cancel()
        revisions = [ch.revision for ch in got]
        assert revisions == sorted(set(revisions)), "a change lost, repeated or out of order"
        assert {ch.key for ch in got} == set(keys)
        assert [(ch.record.phase, ch.record.gen) for ch in got if ch.key == keys[-1]] == [
            (WRITING, 0), (COMMITTED, 0), (INVALIDATING, 0), (ABSENT, 1),
        ]  # fmt: skip
        loaded = f.open().load()
        assert {r.key: r for r in loaded.records} == d.core.records
        print(f"member killed mid-stream: {store.unknown_outcomes} commits sent again after a lost answer")
    finally:
        f.close_all()
