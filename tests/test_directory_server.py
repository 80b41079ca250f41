"""The directory server, cache nodes and the client library in one process over real TCP,
parameterised over the directory's store backend (``directory_store_factory``: SQLite, etcd).

Every test runs the same protocol paths on both backends: writes, commits, lookups, leased reads,
refusals with their reasons, renewals and releases, invalidation of a key, a prefix or a
namespace completing by acknowledgement (a live holder) or by expiry (an unreachable one),
eviction refused under a lease or with children, a restart of the server on the same log, and
malformed or unauthorised input answered with a typed error and no state change.

Leases are short (``TERM_MS``, ``SKEW_MS``) so that expiries happen within a test; nothing here
asserts how long anything took on the wall clock -- where time matters, the assertion is on the
directory's own clock (when a ticket completed against when a lease or the grace ran out), and
the restart test drives the restarted directory with a manual clock.
"""

from __future__ import annotations

import asyncio
import hashlib
import os

import attrs
import pytest

from kvcc.reference.client import KvccClient, Refused
from kvcc.reference.directory import DirectoryConfig
from kvcc.reference.directory.server import DirectoryServer
from kvcc.reference.errors import ConnectionFailed
from kvcc.reference.node import CacheNode
from kvcc.reference.tiers import DramTier
from kvcc.reference.transport import Client
from kvcc.reference.wire import (
    Acquire,
    BeginWrite,
    Commit,
    CommitRejected,
    Committed,
    Error,
    Free,
    LeaseRefused,
    LeaseReleased,
    Lookup,
    ReadBytes,
    Release,
    Renew,
    Session,
    Tenants,
    WaitTicket,
)
from kvcc.spec.keys import Namespace, chain_keys
from kvcc.spec.rules import COMMITTED, INVALIDATING, WRITING
from kvcc.spec.vocabulary import (
    REASON_HAS_CHILDREN,
    REASON_LEASE_EXPIRED,
    REASON_LEASED,
    REASON_LOCATION_DOWN,
    REASON_NOT_ABSENT,
    REASON_NOT_COMMITTED,
    REASON_NOT_FOUND,
    REASON_PARENT_NOT_COMMITTED,
    REASON_RESTARTING,
    REASON_STALE_EPOCH,
    REASON_TOO_LARGE,
    REASON_UNAUTHORIZED,
    REASON_UNKNOWN_LEASE,
    SCOPE_KEY,
    SCOPE_NAMESPACE,
    SCOPE_PREFIX,
)

QUIET_ENV = {"DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false", "HF_HUB_OFFLINE": "1"}
for _k, _v in QUIET_ENV.items():
    os.environ.setdefault(_k, _v)

TERM_MS = 600
SKEW_MS = 50
LEASE_ID_BLOCK = 4  # small, so that restarts cross reservation blocks
BLOCK_BYTES = 4096
NODE_BLOCKS = 64
TEST_TIMEOUT_S = 60.0
READ_TRIES = 5
WAIT_S = 20.0  # upper bound for an invalidation to complete; never reached unless broken

NS = Namespace("ds-model", "r1", "bfloat16", 4, cache_salt=b"engine")
NS_OTHER = Namespace("ds-model", "r1", "bfloat16", 4, cache_salt=b"other")
ENGINE, OTHER, NODES = "engine", "other", "nodes"
TOKENS = {ENGINE: b"e" * 32, OTHER: b"o" * 32, NODES: b"n" * 32}
TENANTS = Tenants(TOKENS, {ENGINE: [NS.digest()], OTHER: [NS_OTHER.digest()]}, operators=frozenset({NODES}))
CONFIG = DirectoryConfig(lease_term_ms=TERM_MS, skew_ms=SKEW_MS, lease_id_block=LEASE_ID_BLOCK)


def run(coro, timeout_s: float = TEST_TIMEOUT_S):
    async def bounded():
        async with asyncio.timeout(timeout_s):
            return await coro

    return asyncio.run(bounded())


def block(key, size: int = BLOCK_BYTES) -> bytes:
    seed = hashlib.sha256(key.digest).digest()
    return (seed * (size // len(seed) + 1))[:size]


def keys(n: int, salt: int = 0, ns: Namespace = NS):
    return chain_keys(ns, [salt * 1000 + t for t in range(n * ns.block_tokens)])


class ManualClock:
    """A ``monotonic_ns`` the test moves forward by hand."""

    def __init__(self) -> None:
        self.now_ns = 0

    def __call__(self) -> int:
        return self.now_ns

    def advance_ms(self, ms: int) -> None:
        self.now_ns += ms * 1_000_000


class World:
    """One directory server on a store of the backend under test, two cache nodes (one DRAM tier
    each) and clients of both tenants, all on loopback."""

    def __init__(self, factory) -> None:
        self.factory = factory
        self.store = None
        self.server: DirectoryServer | None = None
        self.nodes: list[CacheNode] = []
        self.clients: list[KvccClient] = []
        self.raws: list[Client] = []

    async def __aenter__(self) -> World:
        self.store = self.factory.open()
        self.server = await DirectoryServer(CONFIG, TENANTS, self.store).start()
        for name in ("n1", "n2"):
            node = CacheNode(name, {"dram": DramTier(NODE_BLOCKS, BLOCK_BYTES)}, TENANTS, self.address,
                             directory_tenant=NODES)  # fmt: skip
            self.nodes.append(await node.start())
        return self

    async def __aexit__(self, *exc) -> None:
        for c in self.clients:
            await c.close()
        for r in self.raws:
            await r.close()
        for n in self.nodes:
            await n.close()
            for t in n.tiers.values():
                t.close()
        if self.server is not None:
            await self.server.close()
        if self.store is not None:
            self.store.close()

    @property
    def address(self) -> tuple[str, int]:
        assert self.server is not None
        return ("127.0.0.1", self.server.port)

    @property
    def core(self):
        assert self.server is not None
        return self.server.core

    async def client(self, client_id: str, tenant: str = ENGINE) -> KvccClient:
        c = await KvccClient(self.address, tenant, TOKENS[tenant], client_id=client_id, skew_ms=SKEW_MS).start()
        self.clients.append(c)
        return c

    def raw(self, tenant: str = ENGINE, token: bytes | None = None) -> Client:
        """A bare transport client: sends exactly the messages a test builds (no Hello, so the
        directory's pushes never reach it -- an unreachable holder)."""
        r = Client(*self.address, tenant, TOKENS[tenant] if token is None else token)
        self.raws.append(r)
        return r

    async def restart_directory(self, clock=None) -> None:
        """Stop the server and close its store, then serve again on the same log and port."""
        assert self.server is not None and self.store is not None
        port = self.server.port
        await self.server.close()
        self.store.close()
        self.server = None
        self.store = self.factory.open()
        kw = {} if clock is None else {"monotonic_ns": clock}
        self.server = await DirectoryServer(CONFIG, TENANTS, self.store, port=port, **kw).start()

    async def put_chain(self, writer: KvccClient, ks, ns: Namespace = NS) -> None:
        parent = None
        for k in ks:
            out = await writer.put(ns, k, parent, block(k))
            assert isinstance(out, Committed), out
            parent = k


def ran_out(answer) -> bool:
    """A read refused because the holder's own deadline passed (before it or while it was in flight)."""
    return isinstance(answer, Refused) and answer.reason == REASON_LEASE_EXPIRED


async def read_leased(c: KvccClient, key) -> bytes | Refused:
    """Take a lease on ``key``, read, release. A lease whose budget ran out before the read (a
    slow machine, short leases) is refused ``lease_expired`` -- correct, so try again."""
    for _ in range(READ_TRIES):
        lease = await c.acquire(NS, key)
        if isinstance(lease, Refused):
            return lease
        got = await c.read(lease)
        await c.release(lease)
        if not ran_out(got):
            return got
    raise AssertionError(f"no read within {READ_TRIES} fresh leases")


def world_test(factory, body):
    async def main():
        async with World(factory) as w:
            await body(w)
            w.core.check_invariants()

    run(main())


# -- writes, lookups, leased reads ---------------------------------------------------------------------


def test_write_commit_lookup_and_leased_read(directory_store_factory):
    async def body(w: World):
        a, b = await w.client("a"), await w.client("b")
        ks = keys(4)
        await w.put_chain(a, ks)
        for k in ks:
            rec = w.core.records[k]
            assert rec.phase == COMMITTED and rec.gen == 0 and rec.owner in ("n1/dram", "n2/dram")
        hit = await b.lookup(NS, ks + keys(1, salt=9))
        assert hit.blocks == 4 and hit.locations == tuple(w.core.records[k].owner for k in ks)
        assert (await b.lookup(NS, keys(2, salt=9))).blocks == 0
        for k in ks:
            for _ in range(READ_TRIES):  # a lease that ran out before both reads (a loaded machine): again
                lease = await b.acquire(NS, k)
                assert not isinstance(lease, Refused), lease
                assert lease.location == w.core.records[k].owner and lease.term_ms == TERM_MS
                assert {e.node for e in w.core.leases_on(k)} == {"b"}
                buf = bytearray(BLOCK_BYTES + 7)
                got = await b.read(lease), await b.read(lease, out=buf)
                await b.release(lease)
                if not any(map(ran_out, got)):
                    break
            assert got == (block(k), BLOCK_BYTES) and bytes(buf[:BLOCK_BYTES]) == block(k), got
        assert sum(n.stats["stored"] for n in w.nodes) == 4

    world_test(directory_store_factory, body)


def test_refusals_name_their_reason(directory_store_factory):
    async def body(w: World):
        a, b, x = await w.client("a"), await w.client("b"), await w.client("x", OTHER)
        ks = keys(3, salt=1)
        assert await a.acquire(NS, ks[0]) == Refused(REASON_NOT_COMMITTED)  # absent
        wl = await a.begin_write(NS, ks[0], None)
        assert not isinstance(wl, Refused)
        assert await b.acquire(NS, ks[0]) == Refused(REASON_NOT_COMMITTED)  # writing
        assert await b.begin_write(NS, ks[0], None) == Refused(REASON_NOT_ABSENT)  # someone writes it
        assert await b.begin_write(NS, ks[1], ks[0]) == Refused(REASON_PARENT_NOT_COMMITTED)
        assert await a.write_bytes(wl, block(ks[0])) is None
        # A commit under an epoch that is not the key's, or a lease that is not the write's.
        assert await a.commit(attrs.evolve(wl, epoch=wl.epoch + 1)) == Refused(REASON_STALE_EPOCH)
        assert await a.commit(attrs.evolve(wl, lease=wl.lease + 100)) == Refused(REASON_UNKNOWN_LEASE)
        assert await b.commit(wl) == Refused(REASON_UNKNOWN_LEASE), "only the writer may commit its lease"
        assert w.core.records[ks[0]].phase == WRITING
        done = await a.commit(wl)
        assert isinstance(done, Committed)
        assert await a.commit(wl) == done, "a retried commit gets the same answer"
        assert await a.begin_write(NS, ks[0], None) == Refused(REASON_NOT_ABSENT)  # committed
        # Another tenant: refused in a namespace it may not use, and cannot read this one's keys
        # by naming its own namespace.
        assert await x.acquire(NS, ks[0]) == Refused(REASON_UNAUTHORIZED)
        assert await x.begin_write(NS, ks[1], ks[0]) == Refused(REASON_UNAUTHORIZED)
        assert await x.acquire(NS_OTHER, ks[0]) == Refused(REASON_UNAUTHORIZED)
        assert await x.begin_write(NS_OTHER, ks[1], ks[0]) == Refused(REASON_PARENT_NOT_COMMITTED)
        # Unknown leases: renewals and commits the directory never granted.
        r = w.raw()
        refused = await r.request(Renew("a", ks[0], 999_999, w.core.records[ks[0]].owner, 1))
        assert refused == LeaseRefused("a", ks[0], 1, REASON_UNKNOWN_LEASE)
        rejected = await r.request(Commit("a", ks[2], 5, 0, 1))
        assert rejected == CommitRejected("a", ks[2], 5, REASON_UNKNOWN_LEASE)
        assert ks[2] not in w.core.records
        assert not w.core.read_leases

    world_test(directory_store_factory, body)



def test_a_block_larger_than_the_slots_is_refused_too_large_and_stores_nothing(directory_store_factory):
    """A node answers a write that can never fit its slots with a typed refusal (not ``internal``
    and a traceback), stores nothing, and goes on serving."""

    async def body(w: World):
        a = await w.client("a")
        k0, k1, k2 = keys(3, salt=3)
        wl = await a.begin_write(NS, k0, None)
        assert not isinstance(wl, Refused), wl
        refused = await a.write_bytes(wl, b"x" * (BLOCK_BYTES + 1))
        assert isinstance(refused, Refused) and refused.reason == REASON_TOO_LARGE, refused
        assert "does not fit" in refused.detail
        refused = await a.put(NS, k1, None, b"y" * (2 * BLOCK_BYTES))
        assert isinstance(refused, Refused) and refused.reason == REASON_TOO_LARGE, refused
        assert sum(n.stats["stored"] for n in w.nodes) == 0
        assert isinstance(await a.put(NS, k2, None, block(k2)), Committed)
        assert await read_leased(a, k2) == block(k2)

    world_test(directory_store_factory, body)


def test_renew_and_release(directory_store_factory):
    async def body(w: World):
        a, b = await w.client("a"), await w.client("b")
        ks = keys(1, salt=2)
        await w.put_chain(a, ks)
        lease = await b.acquire(NS, ks[0])
        assert not isinstance(lease, Refused)
        entry = w.core.read_leases[lease.lease]
        renewed = await b.renew(lease)
        assert not isinstance(renewed, Refused)
        assert renewed.lease == lease.lease and renewed.trusted_until_ns >= lease.trusted_until_ns
        assert w.core.read_leases[lease.lease].expires_at_ms >= entry.expires_at_ms
        assert await b.read(renewed) == block(ks[0])
        await b.release(renewed)
        assert not w.core.read_leases and b.lease_of(ks[0]) is None
        assert await b.read(renewed) == Refused("revoked", "the lease is no longer held")
        assert await b.renew(renewed) == Refused("revoked", "not held")
        # At the directory: a released lease renews as unknown; a second release changes nothing.
        r = w.raw()
        assert await r.request(Renew("b", ks[0], lease.lease, lease.location, 7)) == LeaseRefused(
            "b", ks[0], 7, REASON_UNKNOWN_LEASE
        )
        assert await r.request(Release("b", ks[0], lease.lease)) == LeaseReleased("b", ks[0], lease.lease)
        # A fresh acquire gets a fresh id.
        again = await b.acquire(NS, ks[0])
        assert not isinstance(again, Refused) and again.lease > lease.lease

    world_test(directory_store_factory, body)


# -- invalidation ------------------------------------------------------------------------------------------


def _scope_target(scope: str, ks):
    """(key argument, keys voided, keys kept) for invalidating ``scope`` from ``ks[1]`` on."""
    if scope == SCOPE_KEY:
        return ks[-1], [ks[-1]], ks[:-1]
    if scope == SCOPE_PREFIX:
        return ks[1], ks[1:], ks[:1]
    return None, ks, []


@pytest.mark.parametrize("scope", [SCOPE_KEY, SCOPE_PREFIX, SCOPE_NAMESPACE])
def test_invalidation_with_a_live_holder_completes_by_ack(directory_store_factory, scope):
    async def body(w: World):
        a, b = await w.client("a"), await w.client("b")
        ks = keys(3, salt=3)
        await w.put_chain(a, ks)
        leases = [await b.acquire(NS, k) for k in ks]
        assert not any(isinstance(x, Refused) for x in leases)
        target, voided, kept = _scope_target(scope, ks)
        ticket = int(await a.invalidate(NS, scope, target))
        assert await a.wait(ticket, WAIT_S)
        t = w.core.tickets[ticket]
        assert t.completed_by == "acks" and t.acked == len(voided) and t.expired == 0
        for k, lease in zip(ks, leases):
            if k in voided:
                assert w.core.records[k].phase not in (COMMITTED, INVALIDATING)
                assert w.core.records[k].gen == 1, "the old generation ended"
                assert b.lease_of(k) is None and isinstance(await b.read(lease), Refused)
            else:
                assert w.core.records[k].phase == COMMITTED and w.core.leases_on(k)
                await b.release(lease)
                assert await read_leased(b, k) == block(k)
        assert (await b.lookup(NS, ks)).blocks == len(kept)
        assert b.stats["revoked"] == len(voided)
        # The copies are freed (pushed Free), and the key can be written again.
        first = voided[0]
        wl = await a.begin_write(NS, first, None if first == ks[0] else ks[ks.index(first) - 1])
        assert not isinstance(wl, Refused) and wl.gen == 1

    world_test(directory_store_factory, body)


@pytest.mark.parametrize("scope", [SCOPE_KEY, SCOPE_PREFIX, SCOPE_NAMESPACE])
def test_invalidation_with_an_unreachable_holder_completes_by_expiry(directory_store_factory, scope):
    async def body(w: World):
        a = await w.client("a")
        ks = keys(3, salt=4)
        await w.put_chain(a, ks)
        ghost = w.raw()  # never says Hello: the directory's Revoke cannot reach it
        granted = []
        for i, k in enumerate(ks):
            g = await ghost.request(Acquire("ghost", k, NS.digest(), i + 1))
            granted.append(w.core.read_leases[g.lease])
        await ghost.close()
        target, voided, _ = _scope_target(scope, ks)
        lost_before = w.server.stats["lost_directives"]
        ticket = int(await a.invalidate(NS, scope, target))
        assert w.server.stats["lost_directives"] - lost_before == len(voided), "the Revokes were lost"
        assert await a.wait(ticket, WAIT_S)
        t = w.core.tickets[ticket]
        assert t.completed_by == "expiry" and t.expired == len(voided)
        # Not before any voided lease ran out (term + epsilon after its grant, directory clock).
        latest = max(e.expires_at_ms for e in granted if e.key in voided)
        assert t.completed_at_ms >= latest
        for e in granted:
            assert e.expires_at_ms - TERM_MS - SKEW_MS <= t.started_at_ms, "granted before the invalidation"
        assert all(w.core.records[k].gen == 1 for k in voided)

    world_test(directory_store_factory, body)


# -- eviction -------------------------------------------------------------------------------------------------


def test_eviction_refused_under_a_lease_and_with_children(directory_store_factory):
    async def body(w: World):
        a, b = await w.client("a"), await w.client("b")
        root, leaf = keys(2, salt=5)
        await w.put_chain(a, [root, leaf])
        root_at, leaf_at = w.core.records[root].owner, w.core.records[leaf].owner
        assert await a.evict(root, root_at) == Refused(REASON_HAS_CHILDREN)
        lease = await b.acquire(NS, leaf)
        assert not isinstance(lease, Refused)
        assert await a.evict(leaf, leaf_at) == Refused(REASON_LEASED)
        other_at = "n2/dram" if leaf_at == "n1/dram" else "n1/dram"
        assert await a.evict(leaf, other_at) == Refused(REASON_NOT_FOUND), "no copy there"
        await b.release(lease)
        assert await read_leased(b, leaf) == block(leaf), "the refused evictions dropped nothing"
        evicted = await a.evict(leaf, leaf_at)
        assert not isinstance(evicted, Refused), evicted
        assert w.core.records[leaf].phase not in (COMMITTED, INVALIDATING) and w.core.records[leaf].gen == 1
        node = next(n for n in w.nodes if leaf_at.startswith(n.node_id + "/"))
        assert leaf.digest not in node.tiers["dram"].keys(), "the node dropped the granted copy"
        assert not isinstance(await a.evict(root, root_at), Refused), "leaves first, then the root"
        assert (await b.lookup(NS, [root, leaf])).blocks == 0
        x = await w.client("x", OTHER)
        await w.put_chain(a, [root])
        assert await x.evict(root, w.core.records[root].owner) == Refused(REASON_UNAUTHORIZED)
        assert w.core.records[root].phase == COMMITTED

    world_test(directory_store_factory, body)


# -- restart --------------------------------------------------------------------------------------------------


def test_restart_recovers_every_record_and_honours_leases(directory_store_factory):
    async def body(w: World):
        a, b = await w.client("a"), await w.client("b")
        ks = keys(4, salt=6)
        await w.put_chain(a, ks)
        held = await b.acquire(NS, ks[2])  # a lease the restarted directory cannot know of
        assert not isinstance(held, Refused)
        pending = keys(1, salt=7)[0]
        wl = await a.begin_write(NS, pending, None)  # a write in progress across the restart
        assert not isinstance(wl, Refused)
        assert await a.write_bytes(wl, block(pending)) is None
        # Invalidate one more block with a live unreachable holder: its ticket is pending.
        extra = keys(1, salt=8)[0]
        await w.put_chain(a, [extra])
        ghost = w.raw()
        g = await ghost.request(Acquire("ghost", extra, NS.digest(), 1))
        await ghost.close()
        open_ticket = int(await a.invalidate(NS, SCOPE_KEY, extra))
        issued = max(held.lease, wl.lease, g.lease)
        before = dict(w.core.records)
        tickets_before = dict(w.core.tickets)

        clock = ManualClock()
        await w.restart_directory(clock)
        core = w.core
        assert w.server.restarted and core.in_grace and core.grace_until_ms == CONFIG.restart_grace_ms
        # Every record is back, exactly; the write in progress keeps its lease (re-based clock).
        assert set(core.records) == set(before)
        for k, rec in before.items():
            got = core.records[k]
            if rec.phase == WRITING:
                assert attrs.evolve(got, write_lease_expires_at_ms=0) == attrs.evolve(rec, write_lease_expires_at_ms=0)
                assert got.write_lease_expires_at_ms == CONFIG.restart_grace_ms
            else:
                assert got == rec
        assert set(core.tickets) == set(tickets_before) and core.tickets[open_ticket].pending == {extra}
        assert not core.read_leases, "the lease table does not survive"
        # Reads go on (a read lease conflicts with nothing), under never-reused ids.
        assert (await b.lookup(NS, ks)).blocks == 4
        fresh = await b.acquire(NS, ks[0])
        assert not isinstance(fresh, Refused) and fresh.lease > issued
        assert await b.read(fresh) == block(ks[0])
        # The pre-restart write may still commit: its writer may hold its lease for the grace.
        assert isinstance(await a.commit(wl), Committed)
        # Nothing conflicting during the grace: no eviction, no invalidation completes, so no
        # write on an invalidated key is granted while the old lease on it may still be trusted.
        assert await a.evict(ks[3], core.records[ks[3]].owner) == Refused(REASON_RESTARTING)
        assert await a.evict(ks[1], core.records[ks[1]].owner) == Refused(REASON_RESTARTING)
        ticket = int(await a.invalidate(NS, SCOPE_PREFIX, ks[2]))
        assert core.records[ks[2]].phase == INVALIDATING
        assert await a.begin_write(NS, ks[2], ks[1]) == Refused(REASON_NOT_ABSENT)
        assert not await a.wait(ticket, 0) and not await a.wait(open_ticket, 0)
        clock.advance_ms(CONFIG.restart_grace_ms - 1)
        assert await a.begin_write(NS, ks[2], ks[1]) == Refused(REASON_NOT_ABSENT)
        assert await a.evict(ks[1], core.records[ks[1]].owner) == Refused(REASON_RESTARTING)
        clock.advance_ms(1)  # the grace is over: every lease the old incarnation granted expired
        assert await a.wait(ticket, WAIT_S) and await a.wait(open_ticket, WAIT_S)
        assert core.tickets[open_ticket].completed_by == "expiry", "its lease was lost to the restart"
        assert core.tickets[ticket].completed_at_ms >= CONFIG.restart_grace_ms
        again = await a.begin_write(NS, ks[2], ks[1])
        assert not isinstance(again, Refused) and again.gen == 1 and again.lease > fresh.lease
        # A second restart: ids keep rising past everything handed out.
        issued = again.lease
        await w.restart_directory()
        lease = await b.acquire(NS, ks[1])
        assert not isinstance(lease, Refused) and lease.lease > issued

    world_test(directory_store_factory, body)


# -- deletion reaches everywhere; a silent node is down ----------------------------------------------------


async def until(what: str, condition, timeout_s: float = WAIT_S):
    """Poll ``condition`` (every 20 ms) until it holds; fail after ``timeout_s`` (never reached
    unless broken: nothing here asserts how long anything took)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not reached within {timeout_s} s"
        await asyncio.sleep(0.02)


def test_frees_are_acknowledged_and_leave_the_to_free_set(directory_store_factory):
    async def body(w: World):
        a = await w.client("n1.a")  # co-located with n1: its writes land on n1/dram
        ks = keys(2, salt=11)
        await w.put_chain(a, ks)
        tier = w.nodes[0].tiers["dram"]
        assert all(k.digest in tier.keys() for k in ks)
        assert await a.wait(int(await a.invalidate(NS, SCOPE_KEY, ks[0])), WAIT_S)  # and its child
        await until("the node acknowledged both frees", lambda: not w.core.pending_frees())
        assert not any(k.digest in tier.keys() for k in ks), "the bytes left the node"
        # A write given up: its bytes leave the slot once the write lease expired.
        wl = await a.begin_write(NS, ks[0], None)
        assert not isinstance(wl, Refused) and wl.location == "n1/dram"
        assert await a.write_bytes(wl, block(ks[0])) is None and ks[0].digest in tier.keys()
        a.abort(wl)
        await until("the write lease expired", lambda: w.core.records[ks[0]].phase != WRITING)
        await until("its bytes were freed and acknowledged",
                    lambda: ks[0].digest not in tier.keys() and not w.core.pending_frees())  # fmt: skip

    world_test(directory_store_factory, body)


def test_a_silent_node_is_down_its_keys_come_back_and_frees_reach_it_when_back(directory_store_factory):
    async def body(w: World):
        a, b = await w.client("n1.a"), await w.client("n2.b")
        k = keys(1, salt=12)[0]
        await w.put_chain(a, [k])
        assert w.core.records[k].owner == "n1/dram"
        n1 = w.nodes.pop(0)
        await n1.close()  # killed: no heartbeat, no connection
        await until("n1 is down", lambda: "n1/dram" in w.core.down_locations)
        got = await b.acquire(NS, k)
        assert isinstance(got, Refused) and got.reason in (REASON_LOCATION_DOWN, REASON_NOT_COMMITTED), got
        wl = await b.begin_write(NS, k, None)  # the dead owner's key is writable again, elsewhere
        assert not isinstance(wl, Refused) and wl.location == "n2/dram" and wl.gen == 1
        assert await b.write_bytes(wl, block(k)) is None and isinstance(await b.commit(wl), Committed)
        assert await read_leased(b, k) == block(k)
        assert w.core.pending_frees("n1/dram") == [(k, "n1/dram", 1)], "the lost copy waits for n1"
        # n1 is back (a new incarnation; its DRAM came back empty): the free reaches it, is acked.
        node = CacheNode("n1", {"dram": DramTier(NODE_BLOCKS, BLOCK_BYTES)}, TENANTS, w.address,
                         directory_tenant=NODES, incarnation=2, lost=("dram",))  # fmt: skip
        w.nodes.append(await node.start())
        await until("n1 is up and acknowledged the free", lambda: not w.core.pending_frees())
        assert "n1/dram" not in w.core.down_locations
        for t in n1.tiers.values():
            t.close()

    world_test(directory_store_factory, body)


def test_the_to_free_set_is_durable_in_both_stores(directory_store_factory):
    from kvcc.reference.directory import Persist, Record
    from kvcc.spec.rules import ABSENT

    store = directory_store_factory.open()
    store.load()
    k = keys(1, salt=13)[0]
    rec = Record(key=k, namespace=NS.digest(), parent=None, phase=ABSENT, gen=2, epoch=3,
                 to_free=(("n1/nvme", 3), ("pool", 2)))  # fmt: skip
    assert store.commit([Persist(rec)]) == 1
    store.close()
    store = directory_store_factory.open()
    assert {r.key: r for r in store.load().records} == {k: rec}
    assert store.commit([Persist(attrs.evolve(rec, to_free=(("pool", 2),)))]) == 1  # one acknowledged
    store.close()
    assert [r.to_free for r in directory_store_factory.open().load().records] == [(("pool", 2),)]


def test_records_from_before_the_to_free_set_load_with_an_empty_one(tmp_path):
    import sqlite3

    from kvcc.reference.directory import DirectoryStore, Persist, Record
    from kvcc.reference.directory.durable import StoreCorrupt, record_from_row, record_row
    from kvcc.spec.rules import ABSENT

    k = keys(1, salt=14)[0]
    rec = Record(key=k, namespace=NS.digest(), parent=None, phase=ABSENT, gen=1, epoch=1)
    # An etcd row (a CBOR map) written before: no "to_free" field.
    row = record_row(rec)
    del row["to_free"]
    assert record_from_row(row) == rec
    with pytest.raises(StoreCorrupt):
        record_from_row({**row, "to_free": b"junk"})
    # An SQLite log written before: no to_free column; opening it adds one, empty.
    path = tmp_path / "old.sqlite"
    with DirectoryStore(path) as store:
        store.load()
        store.commit([Persist(rec)])
    db = sqlite3.connect(path)
    db.execute("ALTER TABLE records DROP COLUMN to_free")
    db.commit()
    db.close()
    with DirectoryStore(path) as store:
        assert store.load().records == (rec,)


def test_first_start_serves_without_grace(directory_store_factory):
    async def body(w: World):
        assert not w.server.restarted and not w.core.in_grace

    world_test(directory_store_factory, body)


# -- bad input ------------------------------------------------------------------------------------------------


async def _raw_exchange(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    got = await asyncio.wait_for(reader.read(), 5)  # until EOF
    writer.close()
    return got


def test_malformed_and_unauthorised_input_gets_typed_errors_and_changes_nothing(directory_store_factory):
    async def body(w: World):
        a = await w.client("a")
        ks = keys(2, salt=9)
        await w.put_chain(a, ks[:1])
        state = (dict(w.core.records), dict(w.core.tickets), w.core.next_lease_id)
        fingerprint = w.factory.fingerprint()

        def unchanged():
            assert (dict(w.core.records), dict(w.core.tickets), w.core.next_lease_id) == state
            assert w.factory.fingerprint() == fingerprint

        # Garbage bytes and an oversized frame: a final Error, then the connection closes.
        for data, code in ((b"\x00\x00\x00\x05hello, this is not kvcc", "malformed"),
                           ((1 << 31).to_bytes(4, "big") + b"xyz", "frame_too_large")):  # fmt: skip
            (r,) = Session.client(ENGINE, TOKENS[ENGINE]).receive_data(await _raw_exchange(w.server.port, data))
            assert r.final and type(r.msg) is Error and r.msg.code == code
        # A wrong token, an unknown tenant.
        for tenant, token in ((ENGINE, b"x" * 32), ("nobody", b"y" * 32)):
            r = w.raw(ENGINE, token) if tenant == ENGINE else Client(*w.address, tenant, token)
            with pytest.raises(ConnectionFailed) as e:
                await r.request(Release("a", ks[0], 1))
            assert e.value.code == "unauthorized"
            await r.close()
        # Another tenant naming this tenant's namespace where there is no refusal to carry it.
        x = await w.client("x", OTHER)
        with pytest.raises(ConnectionFailed) as e:
            await x.lookup(NS, ks)
        assert e.value.code == "unauthorized"
        with pytest.raises(ConnectionFailed) as e:
            await x.invalidate(NS, SCOPE_NAMESPACE)
        assert e.value.code == "unauthorized"
        # Messages the directory does not take, tickets never issued.
        for msg, code in ((Free("n1/dram", ks[0], 1), "unexpected_message"),
                          (ReadBytes("a", ks[0], 1, "n1/dram", 0), "unexpected_message"),
                          (WaitTicket(12345, 0), "unknown_ticket")):  # fmt: skip
            r = w.raw()
            with pytest.raises(ConnectionFailed) as e:
                await r.request(msg)
            assert e.value.code == code, msg
        unchanged()
        # A key under a second parent: refused (key_identity), nothing changed, the session goes on.
        r = w.raw()
        refused = await r.request(BeginWrite("a", ks[0], NS.digest(), ks[1], 1))
        assert type(refused).__name__ == "LeaseRefused" and refused.reason == "key_identity", refused
        unchanged()
        assert (await r.request(Lookup(NS.digest(), tuple(ks)))).blocks_matched == 1
        # The directory still serves, the same as before.
        assert (await a.lookup(NS, ks)).blocks == 1
        unchanged()

    world_test(directory_store_factory, body)


def test_a_node_copies_and_evicts_one_key_one_at_a_time_and_logs_no_refused_copy():
    """Two node defects KVCC-TIER-006 found on the reference (its traces REJECTED). A node making
    room evicted the key whose demotion it was copying, between the copy's read of the source and
    its ``store_copy``: the log showed a copy landing after the directory's ``evict`` of its source.
    Now making room skips a key being copied (and a copy waits for an eviction of its key under
    way). And a copy the destination's fence refused was logged as ``fence_stale_write`` with no
    writer, where the spec's ``fence_stale_copy`` is no logged step: now nothing is logged."""
    import io
    import threading

    from kvcc.reference.events import EventLog, events_from_text
    from kvcc.reference.wire import Copy, Evict, Evicted

    async def body() -> None:
        dram, nvme = DramTier(1, BLOCK_BYTES), DramTier(4, BLOCK_BYTES)
        sink = io.StringIO()
        node = CacheNode("n1", {"dram": dram, "nvme": nvme}, TENANTS, ("127.0.0.1", 9), directory_tenant=NODES,
                         events=EventLog(sink, "n1", 1))  # fmt: skip
        k, fenced = keys(2, salt=21)
        dram.write(k.digest, 0, 1, block(k))
        sent: list = []

        async def to_directory(msg):
            sent.append(msg)
            return Evicted(msg.node, msg.key, msg.location) if isinstance(msg, Evict) else None

        node._to_directory = to_directory
        reading, release = threading.Event(), threading.Event()
        read = dram.read

        def slow_read(key, gen):
            reading.set()
            release.wait(5)
            return read(key, gen)

        dram.read = slow_read
        copy = asyncio.create_task(node._copy(Copy("n1/nvme", k, "n1/dram", 0, 2)))
        await asyncio.to_thread(reading.wait, 5)  # the copy is reading its source
        await node._make_room(dram, "n1/dram", BLOCK_BYTES)  # the only block there is k's
        release.set()
        await copy
        assert [type(m).__name__ for m in sent] == ["Copied"]  # no Evict of a key being copied
        assert dram.contains(k.digest, 0) and nvme.contains(k.digest, 0)
        # A copy under an epoch the destination's fence refuses: nothing moves, nothing is logged.
        dram.read = read
        dram.free(k.digest, dram.fence(k.digest))
        dram.write(fenced.digest, 0, 1, block(fenced))
        nvme.restore_fences({fenced.digest: 5})
        await node._copy(Copy("n1/nvme", fenced, "n1/dram", 0, 2))
        logged = [(e["event"], e["key"]) for e in events_from_text(sink.getvalue())]
        assert logged == [("store_copy", k.hex)], logged
        assert len(sent) == 1 and not nvme.contains(fenced.digest, 0)
        await node.close()

    asyncio.run(body())


def test_a_full_node_asks_about_parents_last_when_it_makes_room():
    """A prefix cache touches a chain's root first, so a full node's least recently used blocks
    are mostly parents, which the directory lets go only after their children. A node that asked
    about its 64 least recently used blocks in that order refused every write under a chain of
    more than 64 (the performance suite's full trace replay: a write at 510 ms, 0.195 of the
    pooled bound). Now a key refused for its children is asked after every other: the second
    attempt reaches the leaf; and a parent whose children have gone is still asked, last."""
    from kvcc.reference.wire import Evict, Evicted, EvictRefused

    async def body() -> None:
        from kvcc.reference import node as node_module

        n = node_module.EVICT_SCAN_MAX + 36
        dram = DramTier(n, BLOCK_BYTES)
        node = CacheNode("n1", {"dram": dram}, TENANTS, ("127.0.0.1", 9), directory_tenant=NODES)
        chain = keys(n, salt=33)  # written root first: the root is the least recently used
        for k in chain:
            dram.write(k.digest, 0, 1, block(k))
        leaves = {chain[-1].digest}
        asked: list[int] = []
        index = {k.digest: i for i, k in enumerate(chain)}

        async def to_directory(msg):
            assert isinstance(msg, Evict)
            asked.append(index[msg.key.digest])
            if msg.key.digest in leaves:
                return Evicted(msg.node, msg.key, msg.location)
            return EvictRefused(msg.node, msg.key, msg.location, REASON_HAS_CHILDREN)

        node._to_directory = to_directory
        await node._make_room(dram, "n1/dram", BLOCK_BYTES)  # asks run out on the 64 oldest parents
        assert asked == list(range(node_module.EVICT_SCAN_MAX)) and dram.contains(chain[-1].digest, 0)
        asked.clear()
        await node._make_room(dram, "n1/dram", BLOCK_BYTES)  # the rest first: the leaf goes
        assert asked == list(range(node_module.EVICT_SCAN_MAX, n)) and not dram.contains(chain[-1].digest, 0)
        # The root's children have gone (say): refused before, it is still asked -- after the
        # blocks not refused yet -- and goes.
        extra = keys(1, salt=34)[0]
        dram.write(extra.digest, 0, 1, block(extra))  # the tier is full again
        index[extra.digest] = -1
        leaves.add(chain[0].digest)
        asked.clear()
        await node._make_room(dram, "n1/dram", BLOCK_BYTES)
        assert asked == [-1, 0] and not dram.contains(chain[0].digest, 0), asked
        await node.close()

    asyncio.run(body())
