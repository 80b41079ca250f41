"""The client library an inference engine uses: lookups, leases, reads, writes, invalidation.

Theory of operation
-------------------
A ``KvccClient`` is one *holder* and one *writer* in the spec's sense, named by ``client_id``.
It talks to the directory over one authenticated connection (pipelined requests; the directory
pushes ``Revoke`` on it) and to cache nodes' data servers for the bytes.

**Leases** (docs/protocol.md: leases). A read lease is trusted from when its ``Acquire`` was *sent* for
``term - epsilon`` on this process's monotonic clock (``holder_budget``): whatever the directory's
clock or the network did, the directory keeps the lease live for ``term + epsilon`` from the
grant, which is later. ``read`` refuses (``lease_expired``) once the budget is spent. ``renew``
extends the budget counted from when the renewal was sent. A ``Revoke`` drops the lease *first*
and acknowledges *after* (Chubby's flush-then-ack; spec ``drop_and_ack``); a revoke that overtakes
the grant it revokes cancels the pending acquire, so the late grant is never trusted (the
checker found that one: ``NoReadAfterAck``).

**Writes.** ``begin_write`` takes the key's write lease (the directory picks the location and the
epoch); ``write_bytes`` sends the block to that location tagged with the epoch, and the location
refuses it if a newer owner has come since (fencing); ``commit`` publishes it at the directory,
which refuses a commit after the lease expired or under a stale epoch. ``abort`` gives up: the
write lease expires at the directory. ``put`` does all three.

**Reads** go to the location's node (addresses from ``ListNodes``, refreshed on a miss). The
node verifies the block's checksum and generation: the bytes a read returns are the committed
bytes of exactly that generation, or the read fails (protocol property 4). ``read`` copies into the
caller's buffer when given one (bytearray, memoryview, numpy array, ``torch.uint8`` tensor).

**Results.** Expected refusals are values (``Refused(reason)``, reasons from ``kvcc.spec.vocabulary``
plus ``"miss"``, ``"fenced"``, ``"revoked"``, ``"no_space"``); infrastructure failure raises
``ConnectionFailed`` / ``TimeoutError_``; a caller's mistake raises ``ValueError``/``TypeError``.

**Events.** With an ``EventLog`` the client logs its spec actions under ``client_id``:
``acquire``, ``trust_read_lease``, ``read``, ``renew``, ``trust_renewal``, ``release``,
``drop_and_ack``, ``begin_write``, ``start_writing``, ``abort``.

``SyncClient`` runs a ``KvccClient`` on a private event loop thread for synchronous callers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from attrs import frozen

from kvcc.spec.keys import BlockKey, LocationId, Namespace
from kvcc.spec.vocabulary import (
    REASON_ALREADY_LEASED,
    REASON_BATCH_FULL,
    REASON_BUSY,
    REASON_FENCED,
    REASON_LEASE_EXPIRED,
    REASON_MISS,
    REASON_NOT_ABSENT,
    REASON_NOT_FOUND,
    REASON_PARENT_NOT_COMMITTED,
    REASON_REVOKED,
    REASON_UNKNOWN_LEASE,
    REASON_UNREACHABLE,
    SCOPE_KEY,
    SCOPES,
    location_host,
)

from .errors import ConnectionFailed, TimeoutError_
from .events import EventLog
from .holder import Holder, Trust
from .tiers.base import copy_into, sink_bytes, source_bytes
from .transport import Client, TlsConfig
from .wire import (
    MAX_BATCH_DATA_BYTES,
    MAX_BATCH_ITEMS,
    MAX_FRAME_BYTES,
    MAX_LOOKUP_KEYS,
    MAX_WAIT_TICKET_MS,
    Acquire,
    Batch,
    Batched,
    BeginWrite,
    BytesRead,
    BytesStored,
    Commit,
    CommitRejected,
    Committed,
    Error,
    Evict,
    Evicted,
    EvictRefused,
    Fenced,
    Hello,
    Invalidate,
    InvalidationCompleted,
    InvalidationStarted,
    LeaseRefused,
    LeaseRenewed,
    ListNodes,
    Located,
    Locate,
    Lookup,
    NodeList,
    PrefixFound,
    ReadBytes,
    ReadLeaseGranted,
    ReadRefused,
    Release,
    Renew,
    Revoke,
    RevokeAcked,
    WaitTicket,
    Welcome,
    WriteBytes,
    WriteLeaseGranted,
)

log = logging.getLogger("kvcc.client")

_GRANTED, _STORED, _ABORTED, _FENCED = "granted", "stored", "aborted", "fenced"  # a write lease's progress here
BATCH_ITEMS = 16  # blocks per Batch in read_many and put_many; a node's batches are in flight together
BATCH_BYTES = 1 << 20  # ... and bytes per Batch, past its first block (known sizes: writes, reads into buffers)
SYNC_CALL_TIMEOUT_S = 120.0  # SyncClient: longest any one call may take (WaitTicket included)


@frozen
class Refused:
    """An expected refusal: ``reason`` is a ``kvcc.spec.vocabulary`` reason or one of this module's."""

    reason: str
    detail: str = ""


@frozen
class ReadLease:
    key: BlockKey
    lease: int
    location: LocationId
    gen: int
    epoch: int
    term_ms: int
    sent_ns: int  # when the request that (re)started the budget was sent (monotonic)
    trusted_until_ns: int
    grant: bytes = b""  # the directory's data-plane grant: the location serves nothing without it


@frozen
class WriteLease:
    key: BlockKey
    namespace: bytes
    parent: BlockKey | None
    lease: int
    location: LocationId
    gen: int
    epoch: int
    term_ms: int
    sent_ns: int
    trusted_until_ns: int
    grant: bytes = b""  # the directory's data-plane grant: the location stores nothing without it


@frozen
class Ticket:
    """A started invalidation: wait on ``id``; ``keys`` it voided (0: nothing was cached)."""

    id: int
    keys: int

    def __int__(self) -> int:
        return self.id


@frozen
class PrefixHit:
    """The first ``blocks`` keys of a lookup are cached; ``locations[i]`` holds key ``i``."""

    blocks: int
    locations: tuple[LocationId, ...]


def _batches(items: list[Any], size: Any) -> list[list[Any]]:
    """``items`` in order, cut into batches of at most ``BATCH_ITEMS`` and, past the first item,
    ``BATCH_BYTES`` (``size(item)``: its block's bytes, 0 when unknown). A node's batches travel
    together, each answered whole: big blocks go a few a batch, so that they stream as separate
    frames instead of one frame built, sent and parsed before any of it is used."""
    out: list[list[Any]] = []
    carried = 0
    for item in items:
        n = size(item)
        if not out or len(out[-1]) >= BATCH_ITEMS or carried + n > BATCH_BYTES:
            out.append([])
            carried = 0
        out[-1].append(item)
        carried += n
    return out


def _read_lease(t: Trust) -> ReadLease:
    return ReadLease(t.key, t.lease, LocationId(t.location), t.gen, t.epoch, t.term_ms, t.sent_ns, t.until_ns,
                     t.grant)  # fmt: skip


def _digest(ns: Namespace | bytes) -> bytes:
    if isinstance(ns, Namespace):
        return ns.digest()
    if type(ns) is bytes and len(ns) == 32:
        return ns
    raise TypeError("a namespace is a Namespace or its 32-byte digest")


class KvccClient:
    """``KvccClient(directory, tenant, token, *, client_id, skew_ms, events=None, tls=None)``; ``await
    start()``. ``tls``: the deployment's ``TlsConfig`` (``kvcc.reference.transport``), for its
    connections to the directory and to every node; ``None``: plaintext."""

    def __init__(
        self,
        directory: tuple[str, int],
        tenant: str,
        token: bytes,
        *,
        client_id: str | None = None,
        skew_ms: int,
        events: EventLog | None = None,
        incarnation: int = 1,
        timeout_ms: int | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        self.client_id = client_id or f"c{os.getpid()}-{id(self) & 0xFFFF:x}"
        self.tenant = tenant
        self.token = token
        self.skew_ms = skew_ms
        self.events = events
        self.incarnation = incarnation
        kwargs = {} if timeout_ms is None else {"timeout_ms": timeout_ms}
        self.tls = tls
        self._dir = Client(*directory, tenant, token, on_push=self._on_push, tls=tls, **kwargs)
        self._hello_connects = -1
        self._term_ms: int | None = None  # the lease term the directory's Welcome stated
        self._requests = itertools.count(1)
        self.holder = Holder(skew_ms)  # the read leases this client trusts (kvcc.reference.holder)
        self._writes: dict[tuple[BlockKey, int], str] = {}  # (key, write lease) -> progress
        self._writing: dict[BlockKey, WriteLease | None] = {}  # writes under way: begin_write .. commit/abort
        self._nodes: dict[str, str] = {}
        self._peers: dict[str, Client] = {}
        self._acks: set[asyncio.Task] = set()
        self._down = False  # crashed with its node (``crash``) until ``rejoin``
        self._timeout_ms = timeout_ms
        # A holder's clock may be off by up to epsilon (docs/protocol.md: leases); tests and the
        # conformance suite's clock-skew fault set this offset on this holder's clock.
        self.clock_offset_ns = 0
        self.stats = {"hits": 0, "misses": 0, "revoked": 0, "expired_reads": 0, "revoked_in_flight": 0}

    async def start(self) -> KvccClient:
        await self._ensure_hello()
        await self.refresh_nodes()
        return self

    async def close(self) -> None:
        for t in list(self._acks):
            t.cancel()
        await asyncio.gather(*self._acks, return_exceptions=True)
        for c in self._peers.values():
            await c.close()
        await self._dir.close()

    async def __aenter__(self) -> KvccClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ plumbing

    async def _ensure_hello(self) -> None:
        await self._dir.connect()
        if self._hello_connects == self._dir.stats["connects"]:
            return
        self._hello_connects = self._dir.stats["connects"]
        reply = await self._dir.request(Hello(self.client_id, self.incarnation, "", (), ()))
        if type(reply) is not Welcome:
            raise ConnectionFailed(f"Hello answered with {reply!r}", code="unexpected_reply")
        self._term_ms = reply.term_ms

    async def _ask(self, msg: Any) -> Any:
        await self._ensure_hello()
        reply = await self._dir.request(msg)
        if type(reply) is Error:
            raise ConnectionFailed(f"the directory failed {type(msg).__name__}: {reply.code}: {reply.text}", code=reply.code)
        return reply

    async def _ask_by_budget(self, msg: Any, sent_ns: int, term_ms: int | None = None) -> Any:
        """``_ask`` for a lease request sent at ``sent_ns`` (holder's clock), given up
        (``TimeoutError_``) once the holder's budget from then is spent: the spec's pending timer.
        Past it the holder must have abandoned the request, whatever the transport's timeout (a
        reply held behind a stalled store can come later than that budget plus epsilon). ``term_ms``:
        the term of the lease renewed; ``None``: the term the directory's ``Welcome`` stated."""
        if term_ms is None:
            if self._term_ms is None:
                await self._ensure_hello()
            term_ms = self._term_ms
            assert term_ms is not None  # set by every Welcome
        left_ms = (sent_ns + self.holder.budget_ns(term_ms) - self._now_ns()) / 1_000_000
        try:
            async with asyncio.timeout(max(0.0, left_ms) / 1000):
                return await self._ask(msg)
        except TimeoutError_:
            raise
        except TimeoutError:
            raise TimeoutError_(f"{type(msg).__name__} request within the holder's budget", max(0, int(left_ms))) from None

    async def _ask_batch(self, items: Sequence[Any], sent_ns: int | None = None) -> tuple[Any, ...]:
        """The directory's answers to ``items``, sent as one ``Batch``: ``answers[i]`` answers
        ``items[i]``. ``sent_ns``: lease requests, given up by the budget from then
        (``_ask_by_budget``)."""
        batch = Batch(tuple(items))
        reply = await (self._ask(batch) if sent_ns is None else self._ask_by_budget(batch, sent_ns))
        assert type(reply) is Batched and len(reply.replies) == len(items), reply
        return reply.replies

    def _now_ns(self) -> int:
        return time.monotonic_ns() + self.clock_offset_ns

    def _emit(self, event: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(event, **fields)

    async def crash(self) -> None:
        """The process embedding this client crashed with its node (a co-located client,
        ``"<node>.<name>"``, which the trace validator takes for that node): every lease it
        trusted, every request it waited on and every write it had under way are gone, and until
        ``rejoin`` nothing the directory pushes reaches it -- a ``Revoke`` to a dead process is
        lost, and its lease ends by expiry. The node's rejoin makes the directory forget them too.
        Call it before the node is killed (a harness that keeps this client alive across its node's
        crash): a revocation handled in between would be a step of a node the trace shows down."""
        self.holder.forget()
        self._writes.clear()
        self._writing.clear()
        self._down = True

    async def rejoin(self) -> None:
        """The process came back with its node (``crash``): pushes reach it again."""
        self._down = False

    async def refresh_nodes(self) -> dict[str, str]:
        reply = await self._ask(ListNodes(0))
        assert type(reply) is NodeList
        self._nodes = dict(zip(reply.nodes, reply.addresses))
        return dict(self._nodes)

    async def _peer(self, location: LocationId) -> Client:
        node = location.split("/", 1)[0] if location != "pool" else None
        if node is None or node not in self._nodes:
            await self.refresh_nodes()
        if node is None:
            node = min(self._nodes) if self._nodes else None  # any node serves the shared pool
        if node is None or node not in self._nodes:
            raise ConnectionFailed(f"no node serves {location}", code="no_node")
        address = self._nodes[node]
        client = self._peers.get(address)
        if client is None:
            host, port = address.rsplit(":", 1)
            kwargs = {} if self._timeout_ms is None else {"timeout_ms": self._timeout_ms}
            client = self._peers[address] = Client(host, int(port), self.tenant, self.token, max_frame_bytes=MAX_FRAME_BYTES,
                                                   tls=self.tls, **kwargs)  # fmt: skip
        return client

    async def _to_peer(self, location: LocationId, msg: Any) -> Any:
        """Send ``msg`` to the node serving ``location``. A node that restarted listens on a new
        port: when its old address refuses, learn the addresses again and try once more (the
        requests are idempotent at the node: a write is fenced by epoch, a read or evict is a
        question)."""
        peer = await self._peer(location)
        try:
            return await peer.request(msg)
        except ConnectionFailed as e:
            if e.code not in ("refused", "eof", "reset"):
                raise
            stale = self._peers.pop(f"{peer.host}:{peer.port}", None)
            if stale is not None:
                await stale.close()
            await self.refresh_nodes()
            return await (await self._peer(location)).request(msg)

    def _on_push(self, msg: Any) -> None:
        if self._down:
            log.info("%s is down (crashed with its node): %s lost", self.client_id, type(msg).__name__)
            return
        if type(msg) is not Revoke:
            log.warning("%s ignores a pushed %s", self.client_id, type(msg).__name__)
            return
        # Drop first (every lease of the revoked generation; a request of the key still on its
        # way is over: a grant answering it is never trusted) ...
        if self.holder.revoked(msg.key, msg.lease, msg.gen) is not None:
            self.stats["revoked"] += 1
        self._emit("drop_and_ack", key=msg.key, gen=msg.gen, lease=msg.lease)
        task = asyncio.create_task(self._ack(msg))  # ... then acknowledge
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)

    async def _ack(self, msg: Revoke) -> None:
        try:
            await self._dir.request(RevokeAcked(self.client_id, msg.key, msg.lease))
        except Exception as e:  # the lease then ends by expiry: slower, never unsafe
            log.info("%s: ack of lease %d lost: %s", self.client_id, msg.lease, e)

    # ------------------------------------------------------------------ lookup

    async def lookup(self, ns: Namespace | bytes, keys: Sequence[BlockKey]) -> PrefixHit:
        reply = await self._ask(Lookup(_digest(ns), tuple(keys)))
        assert type(reply) is PrefixFound
        return PrefixHit(reply.blocks_matched, reply.locations)

    async def lookup_many(self, ns: Namespace | bytes, chains: Sequence[Sequence[BlockKey]]) -> list[PrefixHit]:
        """``lookup`` of each chain, in one round trip (one ``Batch`` of ``Lookup``)."""
        digest = _digest(ns)
        hits: list[PrefixHit] = []
        for part in range(0, len(chains), MAX_BATCH_ITEMS):
            chunk = chains[part : part + MAX_BATCH_ITEMS]
            for answer in await self._ask_batch([Lookup(digest, tuple(keys)) for keys in chunk]):
                assert type(answer) is PrefixFound
                hits.append(PrefixHit(answer.blocks_matched, answer.locations))
        return hits

    async def locate(self, ns: Namespace | bytes, keys: Sequence[BlockKey]) -> tuple[int, ...] | None:
        """Per key, whether the directory holds a record of it: 2 in ``ns``, 1 in another
        namespace, 0 none (``Locate``: read-only, no lease); ``None``: this tenant may not use
        ``ns``. A sharded directory's client asks every shard about a key it has not seen."""
        digest, keys = _digest(ns), list(keys)
        known: list[int] = []
        for part in range(0, len(keys), MAX_LOOKUP_KEYS):
            reply = await self._ask(Locate(digest, tuple(keys[part : part + MAX_LOOKUP_KEYS])))
            assert type(reply) is Located and len(reply.known) == len(keys[part : part + MAX_LOOKUP_KEYS])
            if not reply.authorized:
                return None
            known += reply.known
        return tuple(known)

    # ------------------------------------------------------------------ read leases

    def lease_of(self, key: BlockKey) -> ReadLease | None:
        trust = self.holder.held(key)
        return None if trust is None else _read_lease(trust)

    async def acquire(self, ns: Namespace | bytes, key: BlockKey) -> ReadLease | Refused:
        """A new read lease. One request per key at a time, and none while a lease on it is
        trusted (renew that instead): the spec's holder has one slot per key."""
        started = self._acquire_start(key)
        if isinstance(started, Refused):
            return started
        request, sent = started
        try:
            reply = await self._ask_by_budget(Acquire(self.client_id, key, _digest(ns), request), sent)
        except BaseException:
            self._acquire_unanswered(key, request)
            raise
        return self._acquire_answered(key, request, sent, reply)

    async def acquire_many(self, ns: Namespace | bytes, keys: Sequence[BlockKey]) -> list[ReadLease | Refused]:
        """``acquire`` of each key, in one round trip (one ``Batch`` of ``Acquire`` per
        ``MAX_BATCH_ITEMS`` keys): ``results[i]`` answers ``keys[i]`` exactly as ``acquire`` would,
        each key its own request, lease and steps."""
        keys = list(keys)
        if len(set(keys)) != len(keys):
            raise ValueError("acquire_many names each key once")
        digest = _digest(ns)
        results: list[Any] = [None] * len(keys)
        asked: list[tuple[int, int, int]] = []  # (index, request, sent)
        for i, key in enumerate(keys):
            started = self._acquire_start(key)
            if isinstance(started, Refused):
                results[i] = started
            else:
                asked.append((i, *started))
        for part in range(0, len(asked), MAX_BATCH_ITEMS):
            chunk = asked[part : part + MAX_BATCH_ITEMS]
            try:
                answers = await self._ask_batch([Acquire(self.client_id, keys[i], digest, r) for i, r, _ in chunk],
                                                sent_ns=min(sent for _, _, sent in chunk))  # fmt: skip
            except BaseException:
                for i, r, _ in asked[part:]:
                    self._acquire_unanswered(keys[i], r)
                granted = [x for x in results if isinstance(x, ReadLease)]
                if granted:  # the call fails: none of its leases is the caller's to release
                    with contextlib.suppress(Exception):
                        await self.release_many(granted)
                raise
            for (i, r, sent), answer in zip(chunk, answers):
                results[i] = self._acquire_answered(keys[i], r, sent, answer)
        return results

    async def acquire_chain(self, ns: Namespace | bytes, keys: Sequence[BlockKey]) -> tuple[list[ReadLease], Refused | None]:
        """Read leases on the longest leased prefix of a chain, in one round trip
        (``acquire_many``): ``(leases, why)``, where ``leases`` lease ``keys[:len(leases)]`` and
        ``why`` says why the next key has none (``None``: every key is leased). Never a gap: a
        lease granted past the first refusal is released at once."""
        results = await self.acquire_many(ns, keys)
        gap = next((i for i, x in enumerate(results) if isinstance(x, Refused)), len(results))
        past_gap = [x for x in results[gap:] if isinstance(x, ReadLease)]
        if past_gap:
            await self.release_many(past_gap)
        return results[:gap], None if gap == len(results) else results[gap]

    def _acquire_start(self, key: BlockKey) -> tuple[int, int] | Refused:
        """The holder's side of sending an Acquire of ``key``: ``(request, sent_ns)``, logged."""
        refusal = self.holder.may_acquire(key, self._now_ns())
        if refusal is not None:
            detail = ("this client trusts a live lease on the key: renew it" if refusal == REASON_ALREADY_LEASED
                      else "an acquire or renewal of this key is under way here")  # fmt: skip
            return Refused(refusal, detail)
        request = next(self._requests)
        sent = self._now_ns()
        self.holder.acquiring(key, request)
        self._emit("acquire", key=key, request=request)
        return request, sent

    def _acquire_unanswered(self, key: BlockKey, request: int) -> None:
        """No answer (the directory unreachable, the call timed out or was cancelled): the holder
        gives up the request (spec: abandon), so that its next one is explained."""
        if self.holder.answered(key, request):
            self._emit("abandon", key=key, request=request, result=REASON_UNREACHABLE)

    def _acquire_answered(self, key: BlockKey, request: int, sent: int, reply: Any) -> ReadLease | Refused:
        if type(reply) is LeaseRefused:
            if not self.holder.answered(key, request):
                return Refused(REASON_REVOKED, "revoked before the answer arrived")
            self._emit("abandon", key=key, request=request, result=reply.reason)  # nothing to wait for
            return Refused(reply.reason)
        assert type(reply) is ReadLeaseGranted and reply.request == request and reply.key == key, reply
        if self.holder.gave_up(key, request, sent_ns=sent, term_ms=reply.term_ms, now_ns=self._now_ns()):
            return Refused(REASON_LEASE_EXPIRED, "the grant came after the request's budget ran out")
        trust = self.holder.granted(key, request, lease=reply.lease, gen=reply.gen, epoch=reply.epoch,
                                    location=reply.location, term_ms=reply.term_ms, sent_ns=sent,
                                    grant=reply.grant)  # fmt: skip
        if trust is None:
            return Refused(REASON_REVOKED, "revoked before the answer arrived")
        self._emit("trust_read_lease", key=key, gen=reply.gen, epoch=reply.epoch, lease=reply.lease,
                   location=reply.location, request=request)  # fmt: skip
        return _read_lease(trust)

    async def renew(self, lease: ReadLease) -> ReadLease | Refused:
        held = self.holder.may_renew(lease.key, lease.lease, self._now_ns())
        if held == REASON_UNKNOWN_LEASE:
            return Refused(REASON_REVOKED, "not held")
        if held == REASON_LEASE_EXPIRED:
            # Past its own budget the holder trusts nothing: a renewal would revive a lease the
            # directory may already have let go of (protocol property 8). Acquire anew.
            return Refused(REASON_LEASE_EXPIRED, "the holder's budget ran out")
        if isinstance(held, str):
            return Refused(held, "a request of this key is under way here")
        request = next(self._requests)
        sent = self._now_ns()
        self.holder.renewing(lease.key, request)
        self._emit("renew", key=lease.key, gen=held.gen, lease=held.lease, request=request)
        try:
            reply = await self._ask_by_budget(Renew(self.client_id, lease.key, held.lease, held.location, request), sent,
                                              held.term_ms)  # fmt: skip
        except BaseException:
            if self.holder.answered(lease.key, request):  # no answer: given up (spec: abandon)
                self._emit("abandon", key=lease.key, lease=held.lease, request=request, result=REASON_UNREACHABLE)
            raise
        if type(reply) is LeaseRefused:
            if not self.holder.answered(lease.key, request):
                return Refused(REASON_REVOKED, "revoked while renewing")
            self._emit("abandon", key=lease.key, lease=held.lease, request=request, result=reply.reason)
            return Refused(reply.reason)
        assert type(reply) is LeaseRenewed
        if self.holder.gave_up(lease.key, request, sent_ns=sent, term_ms=reply.term_ms, now_ns=self._now_ns()):
            return Refused(REASON_LEASE_EXPIRED, "the renewal came after the request's budget ran out")
        renewed = self.holder.renewed(lease.key, request, lease=held.lease, term_ms=reply.term_ms, sent_ns=sent,
                                      grant=reply.grant)  # fmt: skip
        if renewed is None:
            return Refused(REASON_REVOKED, "revoked while renewing")
        self._emit("trust_renewal", key=lease.key, gen=held.gen, lease=held.lease, request=request)
        return _read_lease(renewed)

    async def release(self, lease: ReadLease) -> None:
        """Stop trusting ``lease``, then tell the directory -- only if it was still trusted: a
        lease past the holder's own budget, revoked or released is already gone here, and the
        directory lets it expire."""
        if self.holder.release(lease.key, lease.lease, self._now_ns()) is None:
            return
        self._emit("release", key=lease.key, gen=lease.gen, lease=lease.lease)
        await self._ask(Release(self.client_id, lease.key, lease.lease))

    async def release_many(self, leases: Sequence[ReadLease]) -> None:
        """``release`` of each, in one round trip (one ``Batch``; ``MAX_BATCH_ITEMS`` a batch)."""
        now = self._now_ns()
        gone = [lease for lease in leases if self.holder.release(lease.key, lease.lease, now) is not None]
        for lease in gone:
            self._emit("release", key=lease.key, gen=lease.gen, lease=lease.lease)
        for i in range(0, len(gone), MAX_BATCH_ITEMS):
            part = gone[i : i + MAX_BATCH_ITEMS]
            await self._ask_batch([Release(self.client_id, lease.key, lease.lease) for lease in part])

    def trusted(self, lease: ReadLease, now_ns: int | None = None) -> bool:
        now = self._now_ns() if now_ns is None else now_ns
        return self.holder.trusted(lease.key, lease.lease, now) is not None

    async def read(self, lease: ReadLease, out: Any = None) -> bytes | int | Refused:
        """The block's bytes (or, with ``out``, their length, copied into ``out``)."""
        held = self._readable(lease)
        if isinstance(held, Refused):
            return held
        try:
            reply = await self._to_peer(held.location, self._read_request(held))
        except ConnectionFailed as e:  # the node is down: no bytes, and certainly no other bytes
            self.stats["misses"] += 1
            return Refused(REASON_MISS, f"{held.location} unreachable: {e.code}")
        return self._read_answered(lease, held, reply, out)

    async def read_many(self, leases: Sequence[ReadLease], outs: Sequence[Any] | None = None) -> list[bytes | int | Refused]:
        """``read`` of each lease, one round trip per node (``Batch`` es of at most ``BATCH_ITEMS``
        reads and ``BATCH_BYTES`` of buffers to each node that holds some, all in flight at once): ``results[i]`` answers ``leases[i]`` exactly as
        ``read(leases[i], outs[i])`` would (``outs[i]`` may be ``None``: its bytes returned), except
        that a block longer than its buffer is ``Refused("miss")`` here, not a ``ValueError``."""
        if outs is not None and len(outs) != len(leases):
            raise ValueError(f"{len(outs)} buffers for {len(leases)} leases")
        results: list[Any] = [None] * len(leases)
        by_node: dict[str, list[tuple[int, Trust]]] = {}
        for i, lease in enumerate(leases):
            held = self._readable(lease)
            if isinstance(held, Refused):
                results[i] = held
            else:
                by_node.setdefault(location_host(held.location), []).append((i, held))

        async def one_batch(chunk: list[tuple[int, Trust]]) -> list[tuple[int, Trust]]:
            """Read ``chunk`` in one request; the reads answered ``batch_full``, to ask again."""
            if len(chunk) == 1:  # one block: a plain read
                i = chunk[0][0]
                try:
                    results[i] = await self.read(leases[i], None if outs is None else outs[i])
                except ValueError as e:
                    results[i] = Refused(REASON_MISS, str(e))
                return []
            try:
                reply = await self._to_peer(chunk[0][1].location, Batch(tuple(self._read_request(h) for _, h in chunk)))
            except ConnectionFailed as e:
                for i, held in chunk:
                    self.stats["misses"] += 1
                    results[i] = Refused(REASON_MISS, f"{held.location} unreachable: {e.code}")
                return []
            if type(reply) is not Batched or len(reply.replies) != len(chunk):
                raise ConnectionFailed(f"a Batch of reads answered with {type(reply).__name__}", code="unexpected_reply")
            again = []
            for n, ((i, held), answer) in enumerate(zip(chunk, reply.replies)):
                out = None if outs is None else outs[i]
                try:
                    if type(answer) is ReadRefused and answer.reason == REASON_BATCH_FULL:
                        if n:
                            again.append((i, held))  # the batch's answer was full: in the next one
                        else:  # a block too large for any batch: alone
                            results[i] = await self.read(leases[i], out)
                    else:
                        results[i] = self._read_answered(leases[i], held, answer, out)
                except ValueError as e:  # longer than its buffer: nothing copied, the others go on
                    results[i] = Refused(REASON_MISS, str(e))
            return again

        sizes = [0] * len(leases) if outs is None else [0 if o is None else len(sink_bytes(o)) for o in outs]

        async def one_node(items: list[tuple[int, Trust]]) -> None:
            while items:  # batches of a node in flight together; what came back full, again
                chunks = _batches(items, lambda item: sizes[item[0]])
                items = [x for again in await asyncio.gather(*(one_batch(c) for c in chunks)) for x in again]

        await asyncio.gather(*(one_node(items) for items in by_node.values()))
        return results

    def _readable(self, lease: ReadLease) -> Trust | Refused:
        held = self.holder.held(lease.key)
        if held is None or held.lease != lease.lease:
            return Refused(REASON_REVOKED, "the lease is no longer held")
        if not self.trusted(lease):
            self.stats["expired_reads"] += 1
            return Refused(REASON_LEASE_EXPIRED)
        return held

    def _read_request(self, held: Trust) -> ReadBytes:
        return ReadBytes(self.client_id, held.key, held.lease, held.location, held.gen, held.grant)

    def _read_answered(self, lease: ReadLease, held: Trust, reply: Any, out: Any) -> bytes | int | Refused:
        if type(reply) is not BytesRead or reply.gen != held.gen or reply.key != held.key:
            self.stats["misses"] += 1
            reason = reply.reason if type(reply) is ReadRefused else REASON_MISS
            return Refused(reason)
        now, latest = self._now_ns(), self.holder.held(lease.key)  # a renewal may have moved the deadline
        if not self.trusted(lease, now):
            # Revoked (dropped and acknowledged) or expired while the bytes were on their way:
            # serving them now would be a read after the ack (protocol property 7), or past the holder's
            # own deadline. The read happens -- and is logged -- only under trust. The two are told
            # apart: an expiry is the caller's to retry under a fresh lease (a loaded machine).
            if latest is not None and latest.lease == lease.lease and now >= latest.until_ns:
                self.stats["expired_reads"] += 1
                return Refused(REASON_LEASE_EXPIRED, "the lease ran out while the read was in flight")
            self.stats["revoked_in_flight"] += 1
            return Refused(REASON_REVOKED, "revoked while the read was in flight")
        self.stats["hits"] += 1
        self._emit("read", key=held.key, gen=held.gen, epoch=held.epoch, lease=held.lease, location=held.location,
                   nbytes=len(reply.data))  # fmt: skip
        if out is None:
            return reply.data
        sink = sink_bytes(out)
        if len(sink) < len(reply.data):
            raise ValueError(f"buffer of {len(sink)} bytes for a block of {len(reply.data)}")
        copy_into(sink, reply.data, len(reply.data))
        return len(reply.data)

    # ------------------------------------------------------------------ writes

    async def begin_write(self, ns: Namespace | bytes, key: BlockKey, parent: BlockKey | None) -> WriteLease | Refused:
        """The key's write lease. One write per key at a time from this client (the spec's writer
        has one slot per key): a second one while the first is under way is refused here."""
        started = self._begin_write_start(key, parent)
        if isinstance(started, Refused):
            return started
        request, sent = started
        digest = _digest(ns)
        try:
            reply = await self._ask(BeginWrite(self.client_id, key, digest, parent, request))
        except BaseException:
            self._begin_write_unanswered(key, request)
            raise
        return self._begin_write_answered(key, digest, parent, request, sent, reply)

    def _begin_write_start(self, key: BlockKey, parent: BlockKey | None) -> tuple[int, int] | Refused:
        """The writer's side of sending a BeginWrite of ``key``: ``(request, sent_ns)``, logged."""
        if key in self._writing:
            earlier = self._writing[key]
            if earlier is None or self._now_ns() < earlier.trusted_until_ns:
                return Refused(REASON_BUSY, "a write of this key is under way here")
            self.abort(earlier)  # its lease is over by this writer's own clock: give it up first
        self._writing[key] = None
        request = next(self._requests)
        sent = self._now_ns()
        self._emit("begin_write", key=key, request=request, parent=None if parent is None else parent.hex)
        return request, sent

    def _begin_write_unanswered(self, key: BlockKey, request: int) -> None:
        """No answer: this writer gives up the write it asked for (spec: abort), so that its next
        begin_write of the key is explained; a grant that still comes is one nobody waits for."""
        self._writing.pop(key, None)
        self._emit("abort", key=key, request=request, result=REASON_UNREACHABLE)

    def _begin_write_answered(self, key: BlockKey, digest: bytes, parent: BlockKey | None, request: int, sent: int,
                              reply: Any) -> WriteLease | Refused:  # fmt: skip
        if type(reply) is LeaseRefused:
            self._writing.pop(key, None)
            self._emit("abort", key=key, request=request, result=reply.reason)  # this writer gives up
            return Refused(reply.reason)
        assert type(reply) is WriteLeaseGranted and reply.request == request and reply.key == key, reply
        # The spec's writer sends its bytes on the grant (start_writing); however late they
        # actually leave, the epoch they carry is what the location judges them by.
        self._emit("start_writing", key=key, gen=reply.gen, epoch=reply.epoch, lease=reply.lease,
                   location=reply.location)  # fmt: skip
        self._writes[(key, reply.lease)] = _GRANTED
        wl = WriteLease(key, digest, parent, reply.lease, reply.location, reply.gen, reply.epoch, reply.term_ms,
                        sent, sent + self.holder.budget_ns(reply.term_ms), reply.grant)  # fmt: skip
        self._writing[key] = wl
        return wl

    async def write_bytes(self, wl: WriteLease, data: Any) -> None | Refused:
        """Send the block to its location (once; a stored block is not sent again)."""
        state = self._writes.get((wl.key, wl.lease))
        if state is None:
            raise ValueError(f"write lease {wl.lease} was not granted to this client")
        if state == _STORED:
            return None
        try:
            reply = await self._to_peer(wl.location, self._write_request(wl, data))
        except ConnectionFailed as e:
            return Refused(REASON_UNREACHABLE, f"{wl.location}: {e.code}")
        return self._write_answered(wl, reply)

    def _write_request(self, wl: WriteLease, data: Any) -> WriteBytes:
        payload = data if type(data) is bytes else bytes(source_bytes(data))
        return WriteBytes(self.client_id, wl.key, wl.lease, wl.location, wl.gen, wl.epoch, payload, wl.grant)

    def _write_answered(self, wl: WriteLease, reply: Any) -> None | Refused:
        if type(reply) is BytesStored:
            if self._writes.get((wl.key, wl.lease)) == _GRANTED:
                self._writes[(wl.key, wl.lease)] = _STORED
            return None
        if type(reply) is Fenced:
            # The spec's writer is done with this write (fence_stale_write clears it): nothing to
            # abort later, and the key is free for this client's next write.
            self._writes[(wl.key, wl.lease)] = _FENCED
            if self._writing.get(wl.key) == wl:
                del self._writing[wl.key]
            return Refused(REASON_FENCED, f"fence {reply.fence} above epoch {reply.epoch}")
        if type(reply) is Error:
            return Refused(reply.code, reply.text)
        return Refused(REASON_MISS, f"unexpected {type(reply).__name__}")

    async def commit(self, wl: WriteLease) -> Committed | Refused:
        """Publish what ``write_bytes`` stored. A write never stored, or given up (``abort``),
        is not committed: refused here, without asking."""
        refused = self._commit_refused_here(wl)
        if refused is not None:
            return refused
        return self._commit_answered(wl, await self._ask(Commit(self.client_id, wl.key, wl.lease, wl.gen, wl.epoch)))

    def _commit_refused_here(self, wl: WriteLease) -> Refused | None:
        state = self._writes.get((wl.key, wl.lease))
        if state == _ABORTED:
            return Refused(REASON_UNKNOWN_LEASE, "aborted")
        if state in (_GRANTED, _FENCED):
            return Refused(REASON_NOT_FOUND, "no bytes stored under this write lease")
        return None  # stored -- or a lease this client never held, which only the directory can judge

    def _commit_answered(self, wl: WriteLease, reply: Any) -> Committed | Refused:
        self._writes.pop((wl.key, wl.lease), None)
        if self._writing.get(wl.key) == wl:
            del self._writing[wl.key]
        if type(reply) is CommitRejected:
            return Refused(reply.reason)
        assert type(reply) is Committed and reply.key == wl.key, reply
        return reply

    def abort(self, wl: WriteLease) -> None:
        """Give up the write: the directory expires the write lease; bytes already sent are
        never readable (the generation never commits) and a late one is fenced. Logged as the
        spec's ``abort`` only while the bytes are not stored: once they are (``store_bytes``),
        the spec's writer has handed the write to its commit and has nothing left to give up --
        a commit that then goes unanswered (the directory killed) ends by the write lease's
        expiry, and this writer forgets it silently (kvcc bench soak found an ``abort`` logged
        there REJECTED: "it needs a write in progress at the writer")."""
        state = self._writes.get((wl.key, wl.lease))
        if state in (_GRANTED, _STORED):
            if self._writing.get(wl.key) == wl:
                del self._writing[wl.key]
            self._writes[(wl.key, wl.lease)] = _ABORTED
            if state == _GRANTED:
                self._emit("abort", key=wl.key, gen=wl.gen, epoch=wl.epoch, lease=wl.lease)

    async def put(self, ns: Namespace | bytes, key: BlockKey, parent: BlockKey | None, data: Any) -> Committed | Refused:
        wl = await self.begin_write(ns, key, parent)
        if isinstance(wl, Refused):
            return wl
        stored = await self.write_bytes(wl, data)
        if stored is not None:
            self.abort(wl)
            return stored
        return await self.commit(wl)

    async def put_many(self, ns: Namespace | bytes, blocks: Sequence[tuple[BlockKey, BlockKey | None, Any]]) -> list[Committed | Refused]:
        """``put`` of each ``(key, parent, data)``, in three round trips: the write leases (one
        ``Batch`` to the directory), the bytes (``Batch`` es of at most ``BATCH_ITEMS`` blocks and
        ``BATCH_BYTES`` to each node, all in flight together; a block above
        ``MAX_BATCH_DATA_BYTES`` alone) and the commits (one ``Batch``).
        ``results[i]`` answers ``blocks[i]`` exactly as ``put`` would, each block its own write
        lease, generation and steps. A parent must be committed before its child's write begins
        (the spec's rule): a chain's blocks written in one call are refused
        ``parent_not_committed`` past the first -- write a chain root first, a ``put`` (or a
        ``put_many`` of each level) at a time."""
        keys = [key for key, _, _ in blocks]
        if len(set(keys)) != len(keys):
            raise ValueError("put_many names each key once")
        digest = _digest(ns)
        results: list[Any] = [None] * len(blocks)
        asked: list[tuple[int, int, int]] = []  # (index, request, sent)
        for i, (key, parent, _) in enumerate(blocks):
            started = self._begin_write_start(key, parent)
            if isinstance(started, Refused):
                results[i] = started
            else:
                asked.append((i, *started))
        grants: list[tuple[int, WriteLease]] = []
        for part in range(0, len(asked), MAX_BATCH_ITEMS):
            chunk = asked[part : part + MAX_BATCH_ITEMS]
            try:
                answers = await self._ask_batch([BeginWrite(self.client_id, blocks[i][0], digest, blocks[i][1], r)
                                                 for i, r, _ in chunk])  # fmt: skip
            except BaseException:
                for i, r, _ in asked[part:]:
                    self._begin_write_unanswered(blocks[i][0], r)
                for _, wl in grants:
                    self.abort(wl)
                raise
            for (i, r, sent), answer in zip(chunk, answers):
                got = self._begin_write_answered(blocks[i][0], digest, blocks[i][1], r, sent, answer)
                if isinstance(got, Refused):
                    results[i] = got
                else:
                    grants.append((i, got))
        # The bytes: batches to each node (``_batches``), all in flight together.
        by_node: dict[str, list[tuple[int, WriteLease, WriteBytes]]] = {}
        for i, wl in grants:
            by_node.setdefault(location_host(wl.location), []).append(
                (i, wl, self._write_request(wl, blocks[i][2])))

        async def one_batch(batch: list[tuple[int, WriteLease, WriteBytes]]) -> None:
            if len(batch) == 1 or any(len(m.data) > MAX_BATCH_DATA_BYTES for _, _, m in batch):
                for i, wl, _ in batch:
                    results[i] = await self.write_bytes(wl, blocks[i][2])
                return
            try:
                reply = await self._to_peer(batch[0][1].location, Batch(tuple(m for _, _, m in batch)))
            except ConnectionFailed as e:
                for i, wl, _ in batch:
                    results[i] = Refused(REASON_UNREACHABLE, f"{wl.location}: {e.code}")
                return
            if type(reply) is not Batched or len(reply.replies) != len(batch):
                raise ConnectionFailed(f"a Batch of writes answered with {type(reply).__name__}", code="unexpected_reply")
            for (i, wl, _), answer in zip(batch, reply.replies):
                results[i] = self._write_answered(wl, answer)

        batches = [b for items in by_node.values() for b in _batches(items, lambda item: len(item[2].data))]
        await asyncio.gather(*(one_batch(b) for b in batches))  # all in flight together
        # The commits of every block stored; the rest given up, as ``put`` does.
        stored: list[tuple[int, WriteLease]] = []
        for i, wl in grants:
            if results[i] is not None:
                self.abort(wl)
                continue
            refused = self._commit_refused_here(wl)
            if refused is not None:
                results[i] = refused
            else:
                stored.append((i, wl))
        for part in range(0, len(stored), MAX_BATCH_ITEMS):
            chunk = stored[part : part + MAX_BATCH_ITEMS]
            answers = await self._ask_batch([Commit(self.client_id, wl.key, wl.lease, wl.gen, wl.epoch) for _, wl in chunk])
            for (i, wl), answer in zip(chunk, answers):
                results[i] = self._commit_answered(wl, answer)
        return results

    async def put_chain(self, ns: Namespace | bytes, blocks: Sequence[tuple[BlockKey, BlockKey | None, Any]]) -> list[Committed | Refused]:
        """``put`` of each block of a chain, root first (``blocks[i]``'s parent is
        ``blocks[i - 1]``'s key), in 2n + 1 round trips instead of 3n: each block's commit travels
        with the next block's ``BeginWrite`` in one ``Batch``, the commit first, so that the child's
        parent is committed when its write begins (the spec's rule). ``results[i]`` answers
        ``blocks[i]`` as ``put`` would; ``not_absent`` (someone committed it first) lets the chain
        go on. After any other refusal the rest are refused ``parent_not_committed`` without
        being asked."""
        for i in range(1, len(blocks)):
            if blocks[i][1] != blocks[i - 1][0]:
                raise ValueError(f"block {i}'s parent is not block {i - 1}: not a chain")
        digest = _digest(ns)
        results: list[Any] = [None] * len(blocks)
        pending: tuple[int, WriteLease] | None = None  # stored, its commit not sent yet
        stop: Refused | None = None
        for i, (key, parent, data) in enumerate(blocks):
            started = self._begin_write_start(key, parent)
            if isinstance(started, Refused):
                results[i], stop = started, started
                break
            request, sent = started
            items: tuple[Any, ...] = (BeginWrite(self.client_id, key, digest, parent, request),)
            if pending is not None:
                pwl = pending[1]
                items = (Commit(self.client_id, pwl.key, pwl.lease, pwl.gen, pwl.epoch), *items)
            try:
                answers = await self._ask_batch(items)
            except BaseException:
                self._begin_write_unanswered(key, request)
                raise
            if pending is not None:
                results[pending[0]] = self._commit_answered(pending[1], answers[0])
                pending = None
            wl = self._begin_write_answered(key, digest, parent, request, sent, answers[-1])
            if isinstance(wl, Refused):
                results[i] = wl
                if wl.reason != REASON_NOT_ABSENT:
                    stop = wl
                    break
                continue
            refused = await self.write_bytes(wl, data)
            if refused is not None:
                self.abort(wl)
                results[i], stop = refused, refused
                break
            pending = (i, wl)
        if pending is not None:
            results[pending[0]] = await self.commit(pending[1])
        for i in range(len(blocks)):
            if results[i] is None:
                results[i] = Refused(REASON_PARENT_NOT_COMMITTED, f"not asked: an earlier block was refused ({stop})")
        return results

    # ------------------------------------------------------------------ invalidation and eviction

    async def invalidate(self, ns: Namespace | bytes, scope: str = SCOPE_KEY, key: BlockKey | None = None) -> Ticket:
        if scope not in SCOPES:
            raise ValueError(f"scope {scope!r} is not one of {SCOPES}")
        reply = await self._ask(Invalidate(_digest(ns), scope, key))
        assert type(reply) is InvalidationStarted
        return Ticket(reply.ticket, reply.keys)

    async def wait(self, ticket: Ticket | int, timeout_s: float) -> bool:
        """Whether invalidation ``ticket`` completed within ``timeout_s``."""
        ticket = int(ticket)
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            reply = await self._ask(WaitTicket(ticket, max(0, min(left_ms, MAX_WAIT_TICKET_MS))))
            if type(reply) is InvalidationCompleted:
                return True
            if left_ms <= 0 or time.monotonic() >= deadline:
                return False

    async def evict(self, key: BlockKey, location: LocationId) -> Evicted | Refused:
        """Ask the node serving ``location`` to evict its copy of ``key`` (the directory decides)."""
        reply = await self._to_peer(location, Evict(self.client_id, key, location))
        if type(reply) is EvictRefused:
            return Refused(reply.reason)
        if type(reply) is Error:
            return Refused(reply.code, reply.text)
        assert type(reply) is Evicted
        return reply


class SyncClient:
    """A ``KvccClient`` for synchronous callers: its own event loop on a daemon thread. Every
    method of ``KvccClient`` is available with the same arguments, blocking."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from .loop import loop_factory

        self._loop = loop_factory()()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvcc-client", daemon=True)
        self._thread.start()
        self._client = self._call_sync(self._make(args, kwargs))

    async def _make(self, args: tuple, kwargs: dict) -> KvccClient:
        return await KvccClient(*args, **kwargs).start()

    def _call_sync(self, coro: Any, timeout_s: float = SYNC_CALL_TIMEOUT_S) -> Any:
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout_s)

    @property
    def client(self) -> KvccClient:
        return self._client

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not asyncio.iscoroutinefunction(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._call_sync(attr(*args, **kwargs))

        return call

    def abort(self, wl: WriteLease) -> None:
        self._loop.call_soon_threadsafe(self._client.abort, wl)

    def close(self) -> None:
        try:
            self._call_sync(self._client.close(), 10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
