"""Chains, not blocks (issue 13): a chain's read leases taken, its bytes read and its leases given
back in one round trip each (``Batch``), with the per-key rules intact.

Against a ``LocalCluster`` of real processes: ``acquire_chain`` leases the longest leased prefix and
never leaves a gap (a lease granted past a refusal is released at once), ``read_many`` reads every
node's blocks in one request per node and returns exactly the committed bytes, ``release_many``
ends every lease -- and the merged trace, one event per key as ever, is ACCEPTED by the validator.

Against an in-process directory and node (the ``World`` of ``test_directory_server``): a batch the
receiver does not take is refused whole before any item changed state; another tenant's items are
refused each as alone; a node answers each batched read as it would alone (an ungranted one
refused), and a read past the batch's data bound ``batch_full``, which the client reads alone.
"""

from __future__ import annotations

import json

import pytest

from kvcc.reference.client import Refused
from kvcc.reference.errors import ConnectionFailed
from kvcc.reference.wire import (
    Acquire,
    Batch,
    Batched,
    BeginWrite,
    BytesRead,
    Invalidate,
    Lookup,
    ReadBytes,
    ReadLeaseGranted,
    ReadRefused,
    Release,
    decode,
    encode,
)
from kvcc.spec.keys import Namespace, chain_keys
from kvcc.spec.rules import COMMITTED
from kvcc.spec.vocabulary import (
    REASON_NOT_ABSENT,
    REASON_NOT_COMMITTED,
    REASON_PARENT_NOT_COMMITTED,
    REASON_UNAUTHORIZED,
)

from cluster_support import BLOCK_BYTES, block_bytes
from test_directory_server import NS, OTHER, World, block, keys, world_test

TERM_MS, EPS_MS = 3_000, 100
CHAIN_NS = Namespace("model-chain", "rev1", "bfloat16", 2, cache_salt=b"chains")


def _validate(cluster) -> None:
    from kvcc.conformance.validate import ACCEPTED, TraceParams, validate_trace

    events = sorted(cluster.events(), key=lambda e: (e["t_wall_ns"], e["node"], e["seq"]))
    params = TraceParams(TERM_MS, EPS_MS, locations={f"{n}/dram": n for n in ("n1", "n2")})
    verdict = validate_trace(events, params)
    assert verdict.status == ACCEPTED, json.dumps(verdict.to_json(), default=str)[:1500]


def test_a_chain_is_leased_read_and_released_in_one_round_trip_each_and_its_trace_is_accepted(tmp_path):
    from kvcc.reference.cluster import LocalCluster

    cluster = LocalCluster(tmp_path / "cluster", nodes=2, tiers=("dram=256KiB",), block_bytes=BLOCK_BYTES,
                           lease_term_ms=TERM_MS, skew_ms=EPS_MS, namespaces=[CHAIN_NS])  # fmt: skip
    with cluster:
        w1, w2, reader = (cluster.client(c, timeout_ms=5_000) for c in ("n1.w", "n2.w", "n1.r"))
        a = chain_keys(CHAIN_NS, list(range(1, 7)))  # written next to n1: its blocks live there
        b = chain_keys(CHAIN_NS, list(range(101, 107)))  # ... and next to n2
        written = {k: block_bytes(k, 0, "w", 1) for k in a + b}
        # Chain a: its first two blocks one put at a time, then the whole chain in 2n + 1 round
        # trips (the first two are not_absent, the rest committed). Chain b: one put at a time.
        assert not isinstance(w1.put(CHAIN_NS, a[0], None, written[a[0]]), Refused)
        assert not isinstance(w1.put(CHAIN_NS, a[1], a[0], written[a[1]]), Refused)
        out = w1.put_chain(CHAIN_NS, [(k, a[i - 1] if i else None, written[k]) for i, k in enumerate(a)])
        assert [getattr(x, "reason", "committed") for x in out] == ["not_absent"] * 2 + ["committed"], out
        parent = None
        for k in b:
            assert not isinstance(w2.put(CHAIN_NS, k, parent, written[k]), Refused)
            parent = k

        # The whole chain: every key leased, on both nodes, read in one batch per node.
        leases, why = reader.acquire_chain(CHAIN_NS, a + b)
        assert why is None and [lease.key for lease in leases] == a + b
        assert {lease.location for lease in leases} == {"n1/dram", "n2/dram"}
        got = reader.read_many(leases)
        assert got == [written[k] for k in a + b]
        reader.release_many(leases)
        assert all(reader.lease_of(k) is None for k in a + b)

        # A gap: the key after a0 was never written. a0 is leased; b0, granted past the gap, is
        # given back at once; the refusal names the gap's reason.
        absent = chain_keys(CHAIN_NS, [999, 998])[0]
        leases, why = reader.acquire_chain(CHAIN_NS, [a[0], absent, b[0]])
        assert [lease.key for lease in leases] == [a[0]] and why == Refused(REASON_NOT_COMMITTED), (leases, why)
        assert reader.lease_of(b[0]) is None
        buf = bytearray(len(written[a[0]]))
        assert reader.read_many(leases, [buf]) == [len(written[a[0]])] and bytes(buf) == written[a[0]]
        reader.release_many(leases)

        # Many roots written at once (three round trips), on both nodes, then read back as one batch.
        roots = [chain_keys(CHAIN_NS, [500 + i, 0])[0] for i in range(6)]
        datas = [block_bytes(k, 0, "m", 2) for k in roots]
        out = w1.put_many(CHAIN_NS, [(k, None, d) for k, d in zip(roots[:3], datas[:3])])
        out += w2.put_many(CHAIN_NS, [(k, None, d) for k, d in zip(roots[3:], datas[3:])])
        assert all(not isinstance(x, Refused) for x in out), out
        leases, why = reader.acquire_chain(CHAIN_NS, roots)
        assert why is None and {lease.location for lease in leases} == {"n1/dram", "n2/dram"}
        assert reader.read_many(leases) == datas
        reader.release_many(leases)

        # A local refusal ends the chain before it is asked: a key whose lease is still trusted.
        held = reader.acquire(CHAIN_NS, a[2])
        assert not isinstance(held, Refused)
        leases, why = reader.acquire_chain(CHAIN_NS, a)
        assert [lease.key for lease in leases] == a[:2] and why is not None and why.reason == "already_leased"
        reader.release_many([*leases, held])
    _validate(cluster)


# -- the batch at the wire ---------------------------------------------------------------------------


def test_a_batch_is_one_message_and_a_batch_inside_one_is_malformed():
    ks = keys(2, salt=71)
    batch = Batch((Acquire("c", ks[0], NS.digest(), 1), Release("c", ks[1], 4)))
    assert decode(encode(batch)) == batch
    with pytest.raises(Exception, match="batch inside a batch"):
        encode(Batch((batch,)))


def test_a_batch_the_directory_does_not_take_is_refused_whole_and_changes_nothing(directory_store_factory):
    async def body(w: World):
        a = await w.client("a")
        ks = keys(2, salt=72)
        await w.put_chain(a, ks)
        r = w.raw()
        before = dict(w.core.read_leases)
        # An Acquire the directory would grant, then an item it does not batch: nothing is granted.
        with pytest.raises(ConnectionFailed) as caught:
            await r.request(Batch((Acquire("a", ks[0], NS.digest(), 1), Invalidate(NS.digest(), "key", ks[0]))))
        assert caught.value.code == "unexpected_message" and "batches" in str(caught.value)
        assert w.core.read_leases == before and w.core.records[ks[0]].phase == COMMITTED
        # ... or a lookup in a namespace this tenant may not use (alone, it raises): nothing granted.
        with pytest.raises(ConnectionFailed) as caught:
            await w.raw(OTHER).request(Batch((Acquire("x", ks[0], NS.digest(), 1), Lookup(NS.digest(), tuple(ks)))))
        assert caught.value.code == "unauthorized" and w.core.read_leases == before
        # Lookups, many in one round trip, each answered as alone.
        absent = keys(1, salt=79)[0]
        hits = await a.lookup_many(NS, [[ks[0]], ks, [absent], [ks[1]]])
        assert [h.blocks for h in hits] == [1, 2, 0, 0]  # ks[1] alone is no chain: its parent is missing
        # Another tenant's items are each refused as they would be alone (no grant in its namespace).
        reply = await w.raw(OTHER).request(Batch((Acquire("x", ks[0], NS.digest(), 2),)))
        assert reply.replies[0].reason == REASON_UNAUTHORIZED and w.core.read_leases == before
        # A well-formed batch: each item answered as alone, in order.
        reply = await w.raw().request(Batch((Acquire("q", ks[0], NS.digest(), 3), Acquire("q", ks[1], NS.digest(), 4))))
        assert type(reply) is Batched and [type(x) for x in reply.replies] == [ReadLeaseGranted, ReadLeaseGranted]
        assert [x.request for x in reply.replies] == [3, 4] and {e.node for e in w.core.leases_on(ks[1])} == {"q"}

    world_test(directory_store_factory, body)


def test_a_node_answers_each_batched_read_as_alone_and_a_full_batch_is_read_again(directory_store_factory, monkeypatch):
    import kvcc.reference.node as node_module

    monkeypatch.setattr(node_module, "MAX_BATCH_DATA_BYTES", 2 * 4096)  # two of this test's blocks a batch

    async def body(w: World):
        a, b = await w.client("a"), await w.client("b")
        ks = keys(5, salt=73)
        await w.put_chain(a, ks)
        leases, why = await b.acquire_chain(NS, ks)
        assert why is None and len(leases) == 5
        got = await b.read_many(leases)
        assert got == [block(k) for k in ks]  # the reads past each batch's bound, read alone
        # An ungranted read in a batch is refused, the others answered.
        peer = await b._peer(leases[0].location)
        same = [lease for lease in leases if lease.location == leases[0].location]
        forged = ReadBytes("b", same[0].key, same[0].lease, same[0].location, same[0].gen, b"")
        honest = ReadBytes("b", same[-1].key, same[-1].lease, same[-1].location, same[-1].gen, same[-1].grant)
        reply = await peer.request(Batch((forged, honest)))
        assert type(reply) is Batched
        assert reply.replies[0] == ReadRefused("b", same[0].key, same[0].location, REASON_UNAUTHORIZED)
        assert type(reply.replies[1]) is BytesRead and reply.replies[1].data == block(same[-1].key)
        # A node batches reads only.
        with pytest.raises(ConnectionFailed) as caught:
            await peer.request(Batch((Release("b", ks[0], leases[0].lease),)))
        assert caught.value.code == "unexpected_message"
        await b.release_many(leases)
        assert not w.core.read_leases

    world_test(directory_store_factory, body)


def test_many_writes_take_three_round_trips_and_each_answers_as_a_put(directory_store_factory):
    async def body(w: World):
        a, b = await w.client("a"), await w.client("b")
        roots = [keys(1, salt=80 + i)[0] for i in range(6)]
        requests = w.server.stats["requests"]
        out = await a.put_many(NS, [(k, None, block(k)) for k in roots])
        assert [type(x).__name__ for x in out] == ["Committed"] * 6, out
        assert w.server.stats["requests"] - requests == 12  # 6 begin_write + 6 commit, in two batches
        assert {w.core.records[k].owner for k in roots} == {"n1/dram", "n2/dram"}
        leases, why = await b.acquire_chain(NS, roots)
        assert why is None and await b.read_many(leases) == [block(k) for k in roots]
        await b.release_many(leases)
        # A chain in one call: the child's parent is not committed when its write begins.
        chain = keys(2, salt=90)
        out = await a.put_many(NS, [(chain[0], None, block(chain[0])), (chain[1], chain[0], block(chain[1]))])
        assert type(out[0]).__name__ == "Committed" and out[1] == Refused(REASON_PARENT_NOT_COMMITTED), out
        # A key already written: refused as put would be; one under way here: busy, not asked.
        wl = await a.begin_write(NS, chain[1], chain[0])
        assert not isinstance(wl, Refused)
        extra = keys(1, salt=91)[0]
        out = await a.put_many(NS, [(roots[0], None, block(roots[0])), (chain[1], chain[0], b"x"),
                                    (extra, None, block(extra))])  # fmt: skip
        assert out[0] == Refused(REASON_NOT_ABSENT) and out[1].reason == "busy" and type(out[2]).__name__ == "Committed"
        a.abort(wl)
        with pytest.raises(ValueError):
            await a.put_many(NS, [(extra, None, b"1"), (extra, None, b"2")])
        # Two parents for one key in one batch: the first item is taken, the second refused
        # (key_identity: the key is known under the first parent), and the session goes on.
        fresh = keys(1, salt=92)[0]
        raw = w.raw()
        got = await raw.request(Batch((BeginWrite("q", fresh, NS.digest(), None, 1),
                                       BeginWrite("q", fresh, NS.digest(), roots[0], 2))))  # fmt: skip
        first, second = got.replies
        assert type(first).__name__ == "WriteLeaseGranted" and second.reason == "key_identity", got
        assert w.core.records[fresh].parent is None
        assert (await raw.request(Lookup(NS.digest(), (fresh,)))).blocks_matched == 0

    world_test(directory_store_factory, body)


def test_a_chain_is_written_with_each_commit_beside_the_next_write(directory_store_factory):
    async def body(w: World):
        a, b = await w.client("a"), await w.client("b")
        chain = keys(5, salt=95)
        blocks = [(k, chain[i - 1] if i else None, block(k)) for i, k in enumerate(chain)]
        with pytest.raises(ValueError):
            await a.put_chain(NS, blocks[1:] + blocks[:1])
        requests = w.server.stats["requests"]
        out = await a.put_chain(NS, blocks)
        assert [type(x).__name__ for x in out] == ["Committed"] * 5, out
        assert w.server.stats["requests"] - requests == 10  # 5 begin_write + 5 commit, in 6 frames
        leases, why = await b.acquire_chain(NS, chain)
        assert why is None and await b.read_many(leases) == [block(k) for k in chain]
        await b.release_many(leases)
        # A block someone else is writing: refused not_absent; its child, asked, has no committed parent.
        more = keys(8, salt=95)[5:]
        first = await b.put(NS, more[0], chain[-1], block(more[0]))
        assert type(first).__name__ == "Committed"
        wl = await b.begin_write(NS, more[1], more[0])
        assert not isinstance(wl, Refused)
        out = await a.put_chain(NS, [(more[0], chain[-1], block(more[0])), (more[1], more[0], block(more[1])),
                                     (more[2], more[1], block(more[2]))])  # fmt: skip
        assert out[0] == Refused(REASON_NOT_ABSENT) and out[1] == Refused(REASON_NOT_ABSENT)
        assert out[2] == Refused(REASON_PARENT_NOT_COMMITTED)
        b.abort(wl)

    world_test(directory_store_factory, body)


def test_a_batch_of_steps_is_flushed_once_at_its_end(tmp_path):
    from kvcc.reference.events import EventLog, read_events

    path = tmp_path / "ev.ndjson"
    with EventLog(path, "directory", 1) as log:
        log.emit("release", key=keys(1, salt=96)[0], lease=1)
        assert len(read_events(path)) == 1  # one line, on disk at once
        with log.flushed_at_end():
            for lease in (2, 3, 4):
                log.emit("release", key=keys(1, salt=96)[0], lease=lease)
            assert len(read_events(path)) == 1  # written, not yet flushed
        assert [e["lease"] for e in read_events(path)] == [1, 2, 3, 4]
        log.emit("release", key=keys(1, salt=96)[0], lease=5)
        assert len(read_events(path)) == 5  # line by line again
