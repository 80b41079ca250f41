"""``reference.sharded.ShardedClient`` against two real directory shards (``kvcc serve directory
--shard I --shards 2``, each with a cache node of its own, as ``LocalCluster(shard=...)`` runs
them): chains written, looked up, leased, read and released at their root's shard; a client that
has never seen a key finds its shard; a child follows its parent; a key invalidation reaches one
shard and a namespace invalidation both. A request sent to the wrong shard would be refused
(``wrong_shard``, or a miss), so every check below also checks the routing.
"""

from __future__ import annotations

import asyncio

import pytest

from kvcc.reference.client import KvccClient, ReadLease, Refused
from kvcc.reference.cluster import ENGINE_TENANT, LocalCluster
from kvcc.reference.sharded import ShardedClient
from kvcc.reference.wire import Committed
from kvcc.spec.keys import Namespace, chain_keys, shard_of
from kvcc.spec.vocabulary import SCOPE_KEY, SCOPE_NAMESPACE

NS = Namespace(model_id="sharded-client", model_revision="r1", kv_dtype="float16", block_tokens=4)
NS2 = Namespace(model_id="sharded-client", model_revision="r2", kv_dtype="float16", block_tokens=4)
BLOCKS = 4


def chain_in(shard: int, shards: int = 2, skip: int = 0) -> list:
    """A chain of ``BLOCKS`` keys whose root shard ``shard`` of ``shards`` owns."""
    found = 0
    for base in range(1000):
        chain = chain_keys(NS, list(range(base * 100, base * 100 + (BLOCKS + 1) * 4)))
        if shard_of(chain[0].digest, shards) == shard:
            if found == skip:
                return chain
            found += 1
    raise AssertionError("no chain found")


def data(key) -> bytes:
    return key.digest * 8


@pytest.fixture
def shards(tmp_path):
    clusters = [LocalCluster(tmp_path / f"s{i}", nodes=1, tiers=("dram=1MiB",), namespaces=[NS, NS2], shard=(i, 2))
                for i in range(2)]  # fmt: skip
    try:
        for c in clusters:
            c.start()
        yield [(c.directory_address, ENGINE_TENANT, c.engine_token) for c in clusters]
    finally:
        for c in clusters:
            c.stop()


def client(shards) -> ShardedClient:
    return ShardedClient(shards, skew_ms=100)


def test_a_sharded_client_routes_every_operation_to_its_keys_shard(shards):
    c0, c1 = chain_in(0)[:BLOCKS], chain_in(1)[:BLOCKS]

    async def run() -> None:
        async with client(shards) as w:
            for chain in (c0, c1):
                out = await w.put_chain(NS, [(k, p, data(k)) for k, p in zip(chain, [None, *chain[:-1]])])
                assert all(isinstance(x, Committed) for x in out), out
            hits = await w.lookup_many(NS, [c0, c1])
            assert [h.blocks for h in hits] == [BLOCKS, BLOCKS]
        async with client(shards) as r:  # a client that has seen none of these keys
            lease = await r.acquire(NS, c1[2])
            assert isinstance(lease, ReadLease) and lease.lease % 2 == 1, lease
            assert await r.read(lease) == data(c1[2])
            await r.release(lease)
            leases = await r.acquire_many(NS, [c0[1], c1[3]])
            assert [x.lease % 2 for x in leases] == [0, 1], leases
            assert await r.read_many(leases) == [data(c0[1]), data(c1[3])]
            await r.release_many(leases)
            leases, why = await r.acquire_chain(NS, c0)
            assert why is None and len(leases) == BLOCKS and {x.lease % 2 for x in leases} == {0}
            await r.release_many(leases)
            child = chain_in(1)[BLOCKS]  # written under c1's last block: in c1's shard, whatever its own hash
            assert isinstance(await r.put(NS, child, c1[-1], data(child)), Committed)
            assert (await r.lookup(NS, [*c1, child])).blocks == BLOCKS + 1
            stranger = chain_in(0, skip=1)[1]  # a child key nobody wrote
            assert isinstance(await r.acquire(NS, stranger), Refused)

            ticket = await r.invalidate(NS, SCOPE_KEY, c0[2])
            assert [s for s, _ in ticket.parts] == [0] and await r.wait(ticket, 10.0)
            assert (await r.lookup(NS, c0)).blocks == 2
            assert (await r.lookup(NS, c1)).blocks == BLOCKS
            ticket = await r.invalidate(NS, SCOPE_NAMESPACE)
            assert [s for s, _ in ticket.parts] == [0, 1] and await r.wait(ticket, 10.0)
            assert [h.blocks for h in await r.lookup_many(NS, [c0, c1])] == [0, 0]

    asyncio.run(run())


def test_a_sharded_client_needs_a_shard():
    with pytest.raises(ValueError):
        ShardedClient([], skew_ms=100)


def test_a_namespace_invalidation_completes_once_every_shards_part_has(shards):
    """A namespace invalidation is one ticket per shard; ``wait`` is true only once all are. A
    read lease in shard 1 whose holder no longer answers (it crashed: the revocation is never
    acknowledged) holds shard 1's part until the lease runs out, while shard 0's completes."""
    c0, c1 = chain_in(0)[:1], chain_in(1)[:1]

    async def run() -> None:
        async with client(shards) as w, client(shards) as h:
            for key in (c0[0], c1[0]):
                assert isinstance(await w.put(NS, key, None, data(key)), Committed)
            lease = await h.acquire(NS, c1[0])
            assert isinstance(lease, ReadLease) and lease.lease % 2 == 1
            await h.crash()  # the holder is gone: the revocation goes unanswered
            ticket = await w.invalidate(NS, SCOPE_NAMESPACE)
            assert [s for s, _ in ticket.parts] == [0, 1] and ticket.keys == 2
            (_, part0), (_, part1) = ticket.parts
            assert await w.clients[0].wait(part0, 5.0)
            assert not await w.clients[1].wait(part1, 0.2)
            assert not await w.wait(ticket, 0.2)  # shard 1's part is pending: the whole is
            assert await w.wait(ticket, 10.0)  # once the lease ran out (term + epsilon)
            assert [h.blocks for h in await w.lookup_many(NS, [c0, c1])] == [0, 0]

    asyncio.run(run())


def test_a_refused_write_teaches_the_client_nothing_and_a_record_of_the_digest_elsewhere_hides_nothing(shards):
    """Two ways a client could learn a wrong shard for a key, neither of which it may: a write of
    a child under a parent no shard holds yet, refused where the parent's own hash points (the
    parent turns out to be a child of another shard's chain); and a record another namespace
    made of the same digest in another shard (a digest is the client's to choose). Either way a
    later key invalidation must reach the key's own shard and void it, not complete at once
    where the key is not."""
    # A chain of shard 1 (its root's) whose second key's own hash points at shard 0.
    chain = next(c for c in (chain_in(1, skip=i) for i in range(50)) if shard_of(c[1].digest, 2) == 0)
    parent, child = chain[1], chain[2]

    async def run() -> None:
        address, tenant, token = shards[0]
        # x: a client of shard 0 alone (as any tenant may run), which routes nothing.
        async with client(shards) as r, client(shards) as w, KvccClient(address, tenant, token, skew_ms=100) as x:
            early = await r.put(NS, child, parent, data(child))  # no shard holds the parent yet
            assert isinstance(early, Refused), early
            out = await w.put_chain(NS, [(k, p, data(k)) for k, p in zip(chain[:3], [None, *chain[:2]])])
            assert all(isinstance(o, Committed) for o in out), out
            ticket = await r.invalidate(NS, SCOPE_KEY, child)
            assert [s for s, _ in ticket.parts] == [1] and ticket.keys == 1 and await r.wait(ticket, 10.0)
            assert (await w.lookup(NS, chain[:3])).blocks == 2
            # Another namespace's record of the parent's digest, made in shard 0 (its hash's) as a root.
            assert isinstance(await x.put(NS2, parent, None, b"planted"), Committed)
            async with client(shards) as fresh:
                ticket = await fresh.invalidate(NS, SCOPE_KEY, parent)
                assert [s for s, _ in ticket.parts] == [1] and ticket.keys == 1 and await fresh.wait(ticket, 10.0)
            assert (await w.lookup(NS, chain[:3])).blocks == 1
            lease = await x.acquire(NS2, parent)  # the other record, untouched, its own bytes
            assert isinstance(lease, ReadLease) and lease.lease % 2 == 0 and await x.read(lease) == b"planted"
            await x.release(lease)

    asyncio.run(run())


def test_one_shard_down_fails_only_what_it_might_decide(tmp_path):
    """Shard 1's process killed: a client still starts; shard 0's roots are written and its
    children leased by a client that never saw them; a key no answering shard holds in the
    namespace is not refused as missing (shard 1 may hold it): the shard's failure is raised."""
    from kvcc.reference.errors import ConnectionFailed

    cluster = LocalCluster(tmp_path / "c", nodes=1, tiers=("dram=1MiB",), namespaces=[NS], shards=2)
    with cluster:
        w = cluster.client("w", timeout_ms=3000)
        c0, c1, fresh0 = chain_in(0), chain_in(1), chain_in(0, skip=1)
        for chain in (c0, c1):
            out = w.put_chain(NS, [(k, p, data(k)) for k, p in zip(chain[:2], [None, chain[0]])])
            assert all(isinstance(o, Committed) for o in out), out
        cluster.kill("directory-1")
        late = cluster.client("late", timeout_ms=3000)  # started while shard 1 is down
        assert isinstance(late.put(NS, fresh0[0], None, data(fresh0[0])), Committed)
        lease = late.acquire(NS, c0[1])
        assert isinstance(lease, ReadLease) and late.read(lease) == data(c0[1])
        late.release(lease)
        with pytest.raises(ConnectionFailed):
            late.acquire(NS, c1[1])
