"""A testing kit shipped with the suite: an in-process deployment and adapters that break one rule.

Theory of operation
-------------------
``CoreAdapter`` is a whole kvcc deployment in one process: the sans-IO directory
(``kvcc.reference.directory.core.DirectoryCore``) under a lock with a real monotonic clock and
a ticker thread that fires its timers, and one ``DramTier`` per cache node as that node's only
location (``DirectoryCore``'s default placement: a writer writes to its own node). Messages
between the pieces are calls; what the reference runtime would send over TCP is applied in the
order the core returns its effects, durable ones kept in a dict that plays the durable log (so
``restart_directory`` recovers from exactly what was "made durable").

Every piece logs the spec actions it performs (``kvcc.reference.events``), one log per
(node, incarnation) and one for the directory, so ``events()`` is the full trace of the run:

- directory: the core's ``Emit`` effects that are spec actions (its ``ignore_*`` diagnostics
  are not);
- holder side: ``acquire`` / ``trust_read_lease``, ``renew`` / ``trust_renewal``, ``read``,
  ``release``, ``drop_and_ack`` (on a revocation: drop the trust first, then acknowledge),
  ``abandon``; each node's decisions are a ``kvcc.reference.holder.Holder``, the one the client
  and the Mooncake adapter use;
- writer side: ``begin_write`` / ``start_writing``, ``abort``;
- locations: ``store_bytes`` / ``fence_stale_write``, ``free_slot`` / ``fence_stale_free``,
  ``store_copy`` (a transfer's copy: ``move`` asks the directory to move a block to the next
  node's location; the destination reads the source at once, and the copy lands -- then
  ``Copied`` reaches the directory -- a beat later each, on the ticker thread, so that an
  invalidation can come between);
- faults: ``crash`` on the killed incarnation's log (the directory logs ``restart_node`` and
  ``restart_directory`` itself).

All logs draw their ``t_local_ns`` from one strictly increasing clock, so ``events()`` is one
total order consistent with causality.

The adapter is the suite's self-test and the base of the known-bad adapters below, each of which
overrides one hook to break one rule, honestly logging what it did. ``tests/test_conformance*``
asserts that each fails exactly the catalogue tests that cover its rule (``BROKEN_RULE``).
"""

from __future__ import annotations

import io
import json
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from attrs import define

from kvcc.reference.directory.core import (
    FIRST_LEASE_ID,
    FIRST_TICKET,
    TICKET_COMPLETED,
    CompleteTicket,
    CopyAt,
    DirectoryConfig,
    DirectoryCore,
    Emit,
    ForgetTicket,
    FreeAt,
    Persist,
    PersistTicket,
    ReserveLeaseIds,
    Send,
)
from kvcc.reference.directory.host import CoreHost
from kvcc.reference.errors import Unauthorized
from kvcc.reference.events import EventLog
from kvcc.reference.holder import Holder, Trust
from kvcc.reference.tiers.base import Fenced as TierFenced
from kvcc.reference.tiers.base import Freed as TierFreed
from kvcc.reference.tiers.base import Stored as TierStored
from kvcc.reference.tiers.dram import DramTier
from kvcc.reference.wire import (
    Acquire,
    BeginWrite,
    Commit,
    CommitRejected,
    Evict,
    EvictRefused,
    Invalidate,
    InvalidationStarted,
    LeaseRefused,
    LeaseRenewed,
    Lookup,
    PrefixFound,
    ReadLeaseGranted,
    Release,
    Renew,
    Revoke,
    RevokeAcked,
    WriteLeaseGranted,
)
from kvcc.reference.wire import Committed as WireCommitted
from kvcc.reference.wire import Copied as WireCopied
from kvcc.reference.wire import Evicted as WireEvicted
from kvcc.reference.wire import Freed as WireFreed
from kvcc.spec.keys import BlockKey, Namespace
from kvcc.spec.vocabulary import (
    REASON_BUSY,
    REASON_FENCED,
    REASON_LEASED,
    REASON_LEASE_EXPIRED,
    REASON_MISS,
    REASON_NOT_FOUND,
    REASON_NOT_TRANSFERABLE,
    REASON_NO_SPACE,
    REASON_REVOKED,
    REASON_TOO_LARGE,
    REASON_UNAUTHORIZED,
    REASON_UNKNOWN_LEASE,
)

from .contract import (
    CORRUPT_REGIONS,
    FAULTS,
    INTRUSIONS,
    CACHE_PROFILES,
    SCOPES,
    Adapter,
    AdapterError,
    Capabilities,
    Committed,
    Evicted,
    InvalidationTicket,
    Moving,
    NotSupported,
    ReadGrant,
    Refused,
    RunContext,
    Stored,
    WriteGrant,
)

TENANT = "conformance"
OUTSIDER = "outsider"  # the principal ``intrude`` acts as: the directory grants it nothing
FORGED_LEASE_BIT = 1 << 40  # a forged grant: the owner's lease id with this bit flipped
DIRECTORY_NODE = "directory"
KIT_NODES = 3  # the nodes a run gives the kit (``runner.DEFAULT_NODES``; ``start`` counts them again)
BLOCK_SLOTS = 512  # blocks each node's DRAM tier holds
BLOCK_BYTES = 4096  # the largest block a workload writes
TICK_IDLE_MS = 20  # the ticker wakes at least this often while nothing is timed
# A transfer's copy lands this long after the directory started it, and its Copied reaches the
# directory as long again after that: windows an invalidation can fall into (KVCC-TIER-007 races
# one from a fraction of a term before the transfer to a fraction after; a copy between tiers of
# one host takes about as long for the suite's blocks on a loaded machine).
COPY_DELAY_MS = 10
PAUSED_WAIT_S = 0.05  # how often an operation on a paused node re-checks
EMPTY_TICKETS_FROM = 1 << 40  # ids of the empty tickets of invalidations in a namespace the tenant may not use


@define
class _Node:
    id: str
    incarnation: int
    tier: DramTier
    log: EventLog
    stream: io.StringIO
    alive: bool = True
    paused: bool = False
    offset_ns: int = 0
    holder: Holder = attrs.Factory(lambda: Holder(0))  # its read leases (kvcc.reference.holder), on its own clock
    writing: dict = attrs.Factory(dict)  # BlockKey -> WriteGrant: this node's write under way (until commit/abort)
    issued: set = attrs.Factory(set)  # (key, lease) of the write grants this node was given, in any incarnation
    stored: set = attrs.Factory(set)  # (key, lease) whose bytes landed
    parked: list = attrs.Factory(list)  # revocations waiting while paused


class CoreAdapter(Adapter):
    """An in-process deployment on ``DirectoryCore`` and ``DramTier`` (see the module docstring).

    ``CoreAdapter(profiles=CACHE_PROFILES, faults=FAULTS)``; pass fewer to test NOT_APPLICABLE paths.
    """

    name = "core"
    BROKEN_RULE: str | None = None  # the rule a known-bad subclass breaks
    CRASH_LOSES_MEDIUM = True  # a killed node comes back empty (``DurableDiskAdapter``: with its disk)
    CORE: type[DirectoryCore] = DirectoryCore  # the directory's core (a known-bad one breaks it)

    def __init__(self, *, profiles: Sequence[str] = CACHE_PROFILES, faults: Sequence[str] = FAULTS) -> None:
        self._caps = Capabilities(
            profiles=frozenset(profiles), faults=frozenset(faults), scopes=frozenset(SCOPES),
            events="native", leases="enforced", frees_acknowledged=True,
            capacity_bytes=KIT_NODES * BLOCK_SLOTS * BLOCK_BYTES, block_bytes=BLOCK_BYTES,
            notes="in-process DirectoryCore + DramTier per node (the suite's self-test)",
        )  # fmt: skip
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._started = False
        self._stopping = False
        self._ticker: threading.Thread | None = None
        self._ticker_failed: BaseException | None = None  # what killed the timer thread, if anything
        self._logs: list[io.StringIO] = []
        self._later: list[tuple[int, Callable[[], None]]] = []  # (due monotonic ns, step): a transfer's copy, its Copied
        self._last_ns = 0
        self._ns_lock = threading.Lock()

    # -- lifecycle -----------------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        return self._caps

    def versions(self) -> Mapping[str, str]:
        from importlib.metadata import PackageNotFoundError, version

        try:
            kvcc_version = version("kvcc")
        except PackageNotFoundError:  # pragma: no cover - a source checkout without metadata
            kvcc_version = "unknown"
        return {"adapter": f"{self.name} (kvcc.conformance.testing)", "kvcc": kvcc_version, "python": sys.version.split()[0]}

    def start(self, ctx: RunContext) -> None:
        with self._lock:
            assert not self._started, "start once per adapter"
            self._caps = attrs.evolve(self._caps, capacity_bytes=ctx.nodes * BLOCK_SLOTS * BLOCK_BYTES)
            self._ctx = ctx
            self._config = DirectoryConfig(lease_term_ms=ctx.lease_term_ms, skew_ms=ctx.skew_ms)
            self._allowed = frozenset(ns.digest() for ns in ctx.namespaces)
            # As the server: a free retried to a dead node's location is not sent, so not logged.
            self._host = CoreHost(self._new_core(), commit=self._commit, emit=self._emit_step,
                                  reachable=lambda location: self._nodes[location].alive)  # fmt: skip
            self._dir_incarnation = 1
            self._dir_log = self._new_log(DIRECTORY_NODE, 1)
            self._durable_records: dict[BlockKey, Any] = {}
            self._durable_tickets: dict[int, Any] = {}
            self._durable_lease_limit = FIRST_LEASE_ID
            self._inbox: deque = deque()
            self._request = 0
            self._empty_tickets = 0
            self._nodes: dict[str, _Node] = {}
            for i in range(1, ctx.nodes + 1):
                self._nodes[f"n{i}"] = self._new_node(f"n{i}", 1)
            self._started = True
            self._ticker = threading.Thread(target=self._tick_loop, name=f"kvcc-{self.name}-ticker", daemon=True)
            self._ticker.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        t = self._ticker
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)
        with self._lock:
            for node in getattr(self, "_nodes", {}).values():
                try:
                    node.tier.close()
                except Exception:  # noqa: BLE001 - stop never raises
                    pass

    def nodes(self) -> Sequence[str]:
        return tuple(self._nodes)

    def events(self) -> list[dict] | None:
        with self._lock:
            records = []
            for stream in self._logs:
                records.extend(json.loads(line) for line in stream.getvalue().splitlines() if line)
        records.sort(key=lambda r: r["t_local_ns"])
        return records

    # -- plumbing --------------------------------------------------------------------------------

    def _new_core(self) -> DirectoryCore:
        return self.CORE(self._config, lambda tenant, digest: tenant == TENANT and bytes(digest) in self._allowed)

    def _clock_ns(self) -> int:
        # One strictly increasing clock for every log: the merged trace is one total order.
        with self._ns_lock:
            self._last_ns = max(self._last_ns + 1, time.monotonic_ns())
            return self._last_ns

    def _new_log(self, node: str, incarnation: int) -> EventLog:
        stream = io.StringIO()
        self._logs.append(stream)
        return EventLog(stream, node, incarnation, monotonic_ns=self._clock_ns)

    def _new_node(self, node_id: str, incarnation: int) -> _Node:
        log = self._new_log(node_id, incarnation)
        return _Node(node_id, incarnation, self._new_tier(node_id), log, self._logs[-1], holder=Holder(self._ctx.skew_ms))

    def _new_tier(self, node_id: str) -> DramTier:
        return DramTier(BLOCK_SLOTS, BLOCK_BYTES, pin_memory=False, name=node_id)

    @property
    def _core(self) -> DirectoryCore:
        return self._host.core

    def _now_ms(self) -> int:
        return self._host.now_ms()

    def _node_now_ns(self, node: _Node) -> int:
        return time.monotonic_ns() + node.offset_ns

    def _next_request(self) -> int:
        self._request += 1
        return self._request

    def _check_running(self) -> None:
        if not self._started:
            raise AdapterError("adapter not started")
        if self._stopping:
            raise AdapterError("adapter stopped")
        if self._ticker_failed is not None:
            raise AdapterError(f"the directory's timers failed: {self._ticker_failed!r:.200}")

    def _node(self, node_id: str) -> _Node:
        """The node an operation names, once it is running (an operation on a paused node waits
        like a process under SIGSTOP; on a dead one it fails)."""
        self._check_running()
        node = self._nodes.get(node_id)
        if node is None:
            raise AdapterError(f"no node {node_id!r}")
        while node.paused and node.alive and not self._stopping:
            self._cond.wait(PAUSED_WAIT_S)
        self._check_running()
        if not node.alive:
            raise AdapterError(f"node {node_id} is down")
        return node

    def _dir(self, msg: Any) -> Any:
        """One request to the directory, its effects applied in order, then the messages they
        caused delivered (after, so that the logs keep the causal order)."""
        reply, directives = self._host.handle(msg, TENANT)
        self._carry_out(directives)
        self._drain()
        return reply

    def _commit(self, durable: Sequence[Any]) -> None:
        """The durable log (a dict that survives ``restart_directory``)."""
        for e in durable:
            match e:
                case Persist():
                    self._durable_records[e.record.key] = e.record
                case PersistTicket():
                    self._durable_tickets[e.ticket.ticket] = e.ticket
                case ForgetTicket():
                    self._durable_tickets.pop(e.ticket, None)
                case ReserveLeaseIds():
                    self._durable_lease_limit = max(self._durable_lease_limit, e.limit)

    def _emit_step(self, e: Emit, late_ns: Callable[[], int]) -> None:
        self._dir_log.emit(e.event, late_ns=late_ns, **e.fields)

    def _apply(self, effects: Sequence[Any]) -> None:
        self._carry_out(self._host.record(effects))

    def _carry_out(self, directives: Sequence[Any]) -> None:
        """The directives of one core call, in order: revocations and frees wait in the inbox
        until the call's reply is back (``_drain``), so the logs keep the causal order."""
        for e in directives:
            match e:
                case Send():
                    self._inbox.append(e)
                case FreeAt():
                    self._inbox.append(e)
                case CompleteTicket():
                    self._cond.notify_all()
                case CopyAt():
                    self._copy_at(e)

    def _drain(self) -> None:
        while self._inbox:
            e = self._inbox.popleft()
            if isinstance(e, Send):
                self._deliver_revoke(e.node, e.msg)
            else:
                self._free_at(e.location, e.key, e.epoch)

    def _deliver_revoke(self, node_id: str, msg: Revoke) -> None:
        node = self._nodes.get(node_id)
        if node is None or not node.alive:
            return  # lost with the node: the lease will expire
        if node.paused:
            node.parked.append(msg)
            return
        self._holder_revoked(node, msg)

    def _holder_revoked(self, node: _Node, msg: Revoke) -> None:
        """Spec ``drop_and_ack``: drop the trust first, then acknowledge (flush-then-ack)."""
        self._drop_on_revoke(node, msg)
        node.log.emit("drop_and_ack", key=msg.key, gen=msg.gen, lease=msg.lease)
        reply, directives = self._host.handle(RevokeAcked(node.id, msg.key, msg.lease), TENANT)
        assert reply is None
        self._carry_out(directives)

    def _drop_on_revoke(self, node: _Node, msg: Revoke) -> None:
        node.holder.revoked(msg.key, msg.lease, msg.gen)  # the generation's end

    def _free_at(self, location: str, key: BlockKey, epoch: int) -> None:
        node = self._nodes.get(location)
        if node is None or not node.alive:
            return  # free_at_down_location: nothing to log
        outcome = node.tier.free(key.digest, epoch)
        if isinstance(outcome, TierFenced):
            node.log.emit("fence_stale_free", key=key, epoch=epoch, location=location, fence=outcome.fence)
        else:
            result = "ok" if isinstance(outcome, TierFreed) else "absent"
            node.log.emit("free_slot", key=key, epoch=epoch, location=location, result=result)
        self._ack_free(location, key, epoch)

    def _ack_free(self, location: str, key: BlockKey, epoch: int) -> None:
        """Acknowledge, as the reference node does: without the ``Freed`` the directory keeps the
        free owed and sends it again forever (docs/protocol.md: deletion reaches everywhere)."""
        reply, directives = self._host.handle(WireFreed(location, key, epoch), TENANT)
        assert reply is None
        self._carry_out(directives)

    # -- transfers (``move``) ------------------------------------------------------------------

    def _after_copy_delay(self, step: Callable[[], None]) -> None:
        due = time.monotonic_ns() + COPY_DELAY_MS * 1_000_000
        self._later.append((due, step))
        self._later.sort(key=lambda d: d[0])
        self._cond.notify_all()

    def _run_due(self) -> None:
        now = time.monotonic_ns()
        while self._later and self._later[0][0] <= now:
            _, step = self._later.pop(0)
            step()

    def _copy_at(self, e: CopyAt) -> None:
        """The destination reads the block from the source at once and its bytes land a beat
        later (spec ``store_copy``), then the directory hears ``Copied`` a beat after that. A
        source that lost the generation or a destination whose fence refuses the epoch moves
        nothing and logs nothing (the spec's ``copy_failed`` and ``fence_stale_copy`` are not
        logged steps); a node down at either end loses the copy (the directory cancels the
        transfer when the node rejoins)."""
        dest, src = self._nodes.get(e.location), self._nodes.get(e.source)
        if dest is None or src is None or not dest.alive or not src.alive:
            return
        data = src.tier.read(e.key.digest, e.gen)
        if data is not None:
            self._after_copy_delay(lambda: self._land_copy(dest, e, data))

    def _land_copy(self, dest: _Node, e: CopyAt, data: bytes) -> None:
        if not dest.alive:
            return
        if dest.paused:
            self._after_copy_delay(lambda: self._land_copy(dest, e, data))
            return
        if not isinstance(dest.tier.write(e.key.digest, e.gen, e.epoch, data), TierStored):
            return  # fenced (the invalidation freed the destination first) or no room: nothing moved
        dest.log.emit("store_copy", key=e.key, gen=e.gen, epoch=e.epoch, location=dest.id, source=e.source)
        self._after_copy_delay(lambda: self._copied(dest, e))

    def _copied(self, dest: _Node, e: CopyAt) -> None:
        if dest.alive:
            reply, directives = self._host.handle(WireCopied(dest.id, e.key, e.epoch), TENANT)
            assert reply is None
            self._carry_out(directives)

    def _tick_loop(self) -> None:
        with self._cond:
            while not self._stopping:
                try:
                    self._run_due()
                    self._carry_out(self._host.tick())
                    self._drain()
                except Exception as e:  # noqa: BLE001 - a broken core shows up as errors of operations
                    if self._stopping:
                        return
                    self._ticker_failed = e  # every later operation fails with it (_check_running)
                    raise
                wait_s = self._host.wait_s(TICK_IDLE_MS / 1000)
                if self._later:
                    wait_s = min(wait_s, (self._later[0][0] - time.monotonic_ns()) / 1e9)
                self._cond.wait(max(0.001, wait_s))

    # -- data plane ------------------------------------------------------------------------------

    def lookup(self, node: str, ns: Namespace, keys: Sequence[BlockKey]) -> int:
        with self._lock:
            self._node(node)
            try:
                reply = self._dir(Lookup(ns.digest(), tuple(keys)))
            except Unauthorized:
                return 0
            assert isinstance(reply, PrefixFound)
            return reply.blocks_matched

    def begin_write(self, node: str, ns: Namespace, key: BlockKey, parent: BlockKey | None) -> WriteGrant | Refused:
        with self._lock:
            n = self._node(node)
            earlier = n.writing.get(key)
            if earlier is not None:
                # The spec's writer has one write per key: a second one from this node is refused
                # here, without asking, while the first is under way by this node's own clock.
                if self._node_now_ns(n) < earlier.requested_at_ns + (earlier.term_ms - self._ctx.skew_ms) * 1_000_000:
                    return Refused(REASON_BUSY, "a write of this key is under way on this node")
                self._give_up(n, earlier)  # its lease is over by this node's clock: abort it first
            req = self._next_request()
            sent_ns = self._node_now_ns(n)
            n.log.emit("begin_write", key=key, request=req)
            reply = self._dir(BeginWrite(node, key, ns.digest(), parent, req))
            if isinstance(reply, LeaseRefused):
                n.log.emit("abort", key=key)  # the client gives up on this write (spec: abort)
                return Refused(reply.reason)
            assert isinstance(reply, WriteLeaseGranted)
            n.log.emit("start_writing", key=key, gen=reply.gen, epoch=reply.epoch, lease=reply.lease, location=reply.location)
            grant = WriteGrant(node, key, reply.gen, reply.epoch, reply.lease, reply.location, reply.term_ms, sent_ns)
            n.writing[key] = grant
            n.issued.add((key, reply.lease))
            return grant

    def write_bytes(self, grant: WriteGrant, data: bytes) -> Stored | Refused:
        with self._lock:
            writer = self._node(grant.node)
            if (grant.key, grant.lease) not in writer.issued:
                # Only the writer a grant was issued to sends bytes under it (protocol property 13).
                raise AdapterError(f"write grant {grant.lease} was not issued to {grant.node}")
            loc = self._nodes.get(grant.location)
            if loc is None or not loc.alive:
                return Refused(REASON_NOT_FOUND, f"location {grant.location} is down")
            return self._location_write(loc, grant, data)

    def _location_write(self, loc: _Node, grant: WriteGrant, data: bytes) -> Stored | Refused:
        if not loc.tier.fits(len(data)):
            return Refused(REASON_TOO_LARGE, f"a {len(data)}-byte block does not fit {loc.id}'s slots")
        outcome = loc.tier.write(grant.key.digest, grant.gen, grant.epoch, data)
        fields = dict(key=grant.key, gen=grant.gen, epoch=grant.epoch, lease=grant.lease, writer=grant.node, location=loc.id)
        writer = self._nodes[grant.node]
        if isinstance(outcome, TierFenced):
            loc.log.emit("fence_stale_write", **fields, result=REASON_FENCED, fence=outcome.fence)
            self._write_over(writer, grant)
            return Refused(REASON_FENCED, f"fence {outcome.fence} > epoch {grant.epoch}")
        if not isinstance(outcome, TierStored):
            return Refused(REASON_NO_SPACE, str(outcome))
        loc.log.emit("store_bytes", **fields)
        writer.stored.add((grant.key, grant.lease))
        self._write_over(writer, grant)
        return Stored()

    def _write_over(self, writer: _Node, grant: WriteGrant) -> None:
        """The spec's writer is done with a write once its bytes landed or were fenced (it then
        asks to commit): the key is free for its next write."""
        if writer.writing.get(grant.key) == grant:
            del writer.writing[grant.key]

    def commit(self, grant: WriteGrant) -> Committed | Refused:
        with self._lock:
            n = self._node(grant.node)
            if (grant.key, grant.lease) not in n.stored:
                return Refused(REASON_NOT_FOUND, "no bytes stored under this grant")
            reply = self._dir(Commit(grant.node, grant.key, grant.lease, grant.gen, grant.epoch))
            if isinstance(reply, CommitRejected):
                return Refused(reply.reason)
            assert isinstance(reply, WireCommitted)
            return Committed(reply.gen, reply.epoch)

    def abort(self, grant: WriteGrant) -> None:
        with self._lock:
            n = self._node(grant.node)
            n.stored.discard((grant.key, grant.lease))
            if n.writing.get(grant.key) == grant:
                self._give_up(n, grant)

    def _give_up(self, n: _Node, grant: WriteGrant) -> None:
        # No message: the directory lets the write lease expire (spec: abort). A write whose bytes
        # already landed is over in the spec (nothing to abort), so only one under way is logged.
        del n.writing[grant.key]
        n.log.emit("abort", key=grant.key, gen=grant.gen, epoch=grant.epoch, lease=grant.lease)

    def acquire(self, node: str, ns: Namespace, key: BlockKey) -> ReadGrant | Refused:
        with self._lock:
            n = self._node(node)
            refusal = n.holder.may_acquire(key, self._node_now_ns(n))
            if refusal is not None:
                # The spec's holder has one lease per key: it renews a trusted one, never acquires
                # a second (the reference client refuses the same way).
                return Refused(refusal, "this node trusts a live lease on the key: renew it")
            req = self._next_request()
            sent_ns = self._node_now_ns(n)
            n.holder.acquiring(key, req)
            n.log.emit("acquire", key=key, request=req)
            try:
                reply = self._dir(Acquire(node, key, ns.digest(), req))
            except BaseException:
                n.holder.answered(key, req)
                raise
            if isinstance(reply, LeaseRefused):
                # A refusal answers the request: the holder stops waiting (spec: abandon), so
                # that its next acquire of the key is a new request, not a second pending one.
                if n.holder.answered(key, req):
                    n.log.emit("abandon", key=key, request=req, result=reply.reason)
                return Refused(reply.reason)
            assert isinstance(reply, ReadLeaseGranted)
            if n.holder.gave_up(key, req, sent_ns=sent_ns, term_ms=reply.term_ms, now_ns=self._node_now_ns(n)):
                return Refused(REASON_LEASE_EXPIRED, "the grant came after the request's budget ran out")
            trust = n.holder.granted(key, req, lease=reply.lease, gen=reply.gen, epoch=reply.epoch,
                                     location=reply.location, term_ms=reply.term_ms, sent_ns=sent_ns)  # fmt: skip
            if trust is None:
                return Refused(REASON_REVOKED, "revoked before the answer arrived")
            n.log.emit("trust_read_lease", key=key, gen=reply.gen, epoch=reply.epoch, lease=reply.lease,
                       location=reply.location)  # fmt: skip
            return self._read_grant(node, key, reply.gen, reply.epoch, reply.lease, reply.location, reply.term_ms, sent_ns)

    def _read_grant(self, node, key, gen, epoch, lease, location, term_ms, sent_ns) -> ReadGrant:
        return ReadGrant(node, key, gen, epoch, lease, location, term_ms, sent_ns)

    def _trusted(self, n: _Node, grant: ReadGrant) -> Trust | None:
        return n.holder.trusted(grant.key, grant.lease, self._node_now_ns(n))

    def renew(self, grant: ReadGrant) -> ReadGrant | Refused:
        with self._lock:
            n = self._node(grant.node)
            trust = self._trusted(n, grant)
            if trust is None:
                return Refused(REASON_LEASE_EXPIRED, "the holder no longer trusts this lease")
            req = self._next_request()
            sent_ns = self._node_now_ns(n)
            n.holder.renewing(grant.key, req)
            n.log.emit("renew", key=grant.key, lease=grant.lease, request=req)
            try:
                reply = self._dir(Renew(grant.node, grant.key, grant.lease, trust.location, req))
            except BaseException:
                n.holder.answered(grant.key, req)
                raise
            if isinstance(reply, LeaseRefused):
                if n.holder.answered(grant.key, req):
                    n.log.emit("abandon", key=grant.key, lease=grant.lease, request=req, result=reply.reason)
                return Refused(reply.reason)
            assert isinstance(reply, LeaseRenewed)
            if n.holder.gave_up(grant.key, req, sent_ns=sent_ns, term_ms=reply.term_ms, now_ns=self._node_now_ns(n)):
                return Refused(REASON_LEASE_EXPIRED, "the renewal came after the request's budget ran out")
            current = n.holder.renewed(grant.key, req, lease=grant.lease, term_ms=reply.term_ms, sent_ns=sent_ns)
            if current is None:
                return Refused(REASON_UNKNOWN_LEASE, "revoked while renewing")
            n.log.emit("trust_renewal", key=grant.key, gen=current.gen, epoch=current.epoch, lease=grant.lease)
            return attrs.evolve(grant, term_ms=reply.term_ms, requested_at_ns=sent_ns)

    def read(self, grant: ReadGrant) -> bytes | Refused:
        with self._lock:
            n = self._node(grant.node)
            trust = self._trusted(n, grant)
            if trust is None:
                return Refused(REASON_LEASE_EXPIRED, "no trusted lease")
            return self._read_at(n, grant, trust)

    def _read_at(self, n: _Node, grant: ReadGrant, trust: Trust) -> bytes | Refused:
        loc = self._nodes.get(trust.location)
        data = loc.tier.read(grant.key.digest, trust.gen) if loc is not None and loc.alive else None
        n.log.emit("read", key=grant.key, gen=trust.gen, epoch=trust.epoch, lease=trust.lease, location=trust.location,
                   result="ok" if data is not None else "miss")  # fmt: skip
        return data if data is not None else Refused(REASON_MISS)

    def release(self, grant: ReadGrant) -> None:
        with self._lock:
            n = self._node(grant.node)
            trust = n.holder.release(grant.key, grant.lease, self._node_now_ns(n))
            if trust is None:
                return  # not trusted (any more): the directory lets it expire
            n.log.emit("release", key=grant.key, gen=trust.gen, lease=grant.lease)
            self._dir(Release(grant.node, grant.key, grant.lease))

    def invalidate(self, node: str, ns: Namespace, scope: str, key: BlockKey | None) -> InvalidationTicket:
        with self._lock:
            self._node(node)
            if scope not in self._caps.scopes:
                raise NotSupported(f"invalidate scope {scope}")
            try:
                reply = self._dir(Invalidate(ns.digest(), scope, key))
            except Unauthorized:
                return self._empty_ticket()  # a namespace this tenant may not use: nothing of it is touched
            assert isinstance(reply, InvalidationStarted)
            ticket = self._core.tickets.get(reply.ticket)
            return InvalidationTicket(reply.ticket, 0 if ticket is None else len(ticket.keys))

    def _empty_ticket(self) -> InvalidationTicket:
        """The ticket of an invalidation that voids nothing without asking the directory (contract:
        a namespace not in ``RunContext.namespaces``): complete at once, its id from a range of its own."""
        self._empty_tickets += 1
        return InvalidationTicket(EMPTY_TICKETS_FROM + self._empty_tickets, 0)

    def _is_empty_ticket(self, ticket_id: int) -> bool:
        return EMPTY_TICKETS_FROM < ticket_id <= EMPTY_TICKETS_FROM + self._empty_tickets

    def wait_invalidation(self, ticket: InvalidationTicket, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._check_running()
                if self._is_empty_ticket(ticket.id):
                    return True
                t = self._core.tickets.get(ticket.id)
                if ticket.id < FIRST_TICKET or ticket.id >= self._core.next_ticket:
                    raise AdapterError(f"no ticket {ticket.id}")
                if t is None or t.state == TICKET_COMPLETED:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, TICK_IDLE_MS / 1000))

    def evict(self, node: str, ns: Namespace, key: BlockKey) -> Evicted | Refused:
        with self._lock:
            n = self._node(node)
            rec = self._core.records.get(key)
            reply = self._dir(Evict(node, key, node))
            if isinstance(reply, EvictRefused):
                return self._evict_refused(n, key, reply.reason)
            assert isinstance(reply, WireEvicted)
            assert rec is not None
            # The node drops its bytes once the directory agreed (spec: evict).
            n.tier.free(key.digest, n.tier.fence(key.digest))
            return Evicted()

    def _evict_refused(self, n: _Node, key: BlockKey, reason: str) -> Evicted | Refused:
        return Refused(reason)

    # -- faults ----------------------------------------------------------------------------------

    def _fault(self, name: str) -> None:
        if name not in self._caps.faults:
            raise NotSupported(name)

    def kill(self, node: str) -> None:
        self._fault("kill")
        with self._cond:
            self._check_running()
            n = self._nodes[node]
            if not n.alive:
                return
            n.log.emit("crash", lose_disk=self.CRASH_LOSES_MEDIUM)
            # The directory stops hearing from it: one term later it declares it down (spec:
            # declare_node_down, urgent), unless it rejoined first (``CoreHost.killed``).
            self._host.killed(node, [node])
            n.alive = False
            n.paused = False
            n.holder.forget()
            n.writing.clear()
            self._crash_medium(n)
            self._cond.notify_all()

    def _crash_medium(self, n: _Node) -> None:
        """What a crash does to the node's medium: its one DRAM tier is gone with it."""
        n.tier.close()

    def _medium_after_restart(self, old: _Node, n: _Node) -> list[str]:
        """The restarted node ``n``'s medium, after ``old`` crashed: its locations that came back
        empty (here every one: ``n`` has a new DRAM tier)."""
        return [n.id]

    def restart(self, node: str) -> None:
        self._fault("restart")
        with self._cond:
            self._check_running()
            old = self._nodes[node]
            if old.alive:
                raise AdapterError(f"node {node} is running; kill it first")
            n = self._nodes[node] = self._new_node(node, old.incarnation + 1)
            # Bytes its earlier incarnation sent under a grant may still arrive: they are the
            # node's, and the location's restored fence judges them (KVCC-FAULT-011).
            n.issued = old.issued
            lost = self._medium_after_restart(old, n)
            self._carry_out(self._host.detect())  # declared down first, if it stayed down a term
            self._host.rejoined(node)
            fences, effects = self._core.node_rejoined(node, lost, self._now_ms(), [node])
            n.tier.restore_fences({k.digest: e for k, e in fences.items()})
            self._apply(effects)
            # Back, as at the server's Hello: leased and placed on again, what is owed to it sent.
            self._apply(self._core.locations_up([node], self._now_ms()))
            self._drain()

    def pause(self, node: str) -> None:
        self._fault("pause")
        with self._cond:
            self._check_running()
            self._nodes[node].paused = True

    def resume(self, node: str) -> None:
        self._fault("resume")
        with self._cond:
            self._check_running()
            n = self._nodes[node]
            n.paused = False
            parked, n.parked = n.parked, []
            for msg in parked:
                if n.alive:
                    self._holder_revoked(n, msg)
            self._drain()
            self._cond.notify_all()

    def skew_clock(self, node: str, offset_ms: int) -> None:
        self._fault("skew_clock")
        with self._lock:
            self._check_running()
            self._nodes[node].offset_ns = offset_ms * 1_000_000

    def corrupt(self, node: str, key: BlockKey, region: str, offset: int) -> None:
        self._fault("corrupt")
        if region not in CORRUPT_REGIONS or type(offset) is not int or offset < 0:
            raise ValueError(f"corrupt needs a region of {list(CORRUPT_REGIONS)} and an offset >= 0, got {region!r}, {offset!r}")
        with self._cond:
            self._check_running()
            n = self._nodes.get(node)
            if n is None or not n.alive:
                raise AdapterError(f"node {node!r} is not running")
            n.tier.damage(key.digest, region, offset)  # False: no copy here, nothing to damage

    def intrude(self, grant: ReadGrant | WriteGrant, how: str, data: bytes | None = None) -> bytes | Stored | Refused:
        """As ``OUTSIDER``, a principal granted nothing, ask ``grant.location`` for the key's bytes
        (or to store ``data``) under no lease, a forged lease id or the owner's own: the kit's
        locations serve and store only for the holder or writer the directory granted the lease
        to (``_granted``)."""
        self._fault("intrude")
        if how not in INTRUSIONS:
            raise ValueError(f"intrude presents one of {list(INTRUSIONS)}, got {how!r}")
        with self._lock:
            self._check_running()
            loc = self._nodes.get(grant.location)
            if loc is None or not loc.alive:
                raise AdapterError(f"location {grant.location!r} is down")
            lease = {"absent": None, "forged": grant.lease ^ FORGED_LEASE_BIT, "stolen": grant.lease}[how]
            if not self._granted(OUTSIDER, grant.key, lease, write=data is not None):
                return Refused(REASON_UNAUTHORIZED, f"{OUTSIDER} holds no grant of lease {lease} at {loc.id}")
            if data is None:
                got = loc.tier.read(grant.key.digest, grant.gen)
                return got if got is not None else Refused(REASON_MISS)
            fence = loc.tier.fence(grant.key.digest)
            outcome = loc.tier.write(grant.key.digest, grant.gen, max(grant.epoch, fence), data)
            return Stored() if isinstance(outcome, TierStored) else Refused(REASON_NO_SPACE, str(outcome))

    def move(self, grant: ReadGrant) -> Moving | Refused:
        """Ask the directory, as the node holding ``grant.location``, to move the block to the next
        node's location (the kit's nodes have one tier each: a transfer between nodes, which the
        spec allows between any two locations); its copy lands on the ticker thread."""
        self._fault("move")
        with self._lock:
            self._check_running()
            src = self._nodes.get(grant.location)
            if src is None or not src.alive:
                raise AdapterError(f"location {grant.location!r} is down")
            ids = list(self._nodes)
            dest = ids[(ids.index(src.id) + 1) % len(ids)]
            rec = self._core.records.get(grant.key)
            if rec is None or rec.gen != grant.gen or rec.owner != src.id:
                return Refused(REASON_NOT_FOUND, f"generation {grant.gen} is not owned at {src.id}")
            self._carry_out(self._host.detect())
            started, effects = self._core.start_transfer(grant.key, dest, self._now_ms())
            self._apply(effects)
            self._drain()
            if not started:
                return Refused(REASON_NOT_TRANSFERABLE, f"the directory did not start a transfer to {dest}")
            return Moving(src.id, dest, self._core.records[grant.key].epoch)

    def _granted(self, who: str, key: BlockKey, lease: int | None, *, write: bool) -> bool:
        """Whether the directory granted ``lease`` on ``key`` to ``who``: a live read lease, or the
        key's open write lease."""
        if lease is None:
            return False
        if write:
            rec = self._core.records.get(key)
            return rec is not None and rec.write_lease == lease and rec.writer == who
        entry = self._core.read_leases.get(lease)
        return entry is not None and entry.key == key and entry.node == who

    def restart_directory(self) -> None:
        self._fault("restart_directory")
        with self._cond:
            self._check_running()
            self._carry_out(self._host.detect())
            self._host.restart(self._new_core())
            self._dir_incarnation += 1
            self._dir_log = self._new_log(DIRECTORY_NODE, self._dir_incarnation)
            tickets = list(self._durable_tickets.values())
            next_ticket = max([FIRST_TICKET - 1, *self._durable_tickets]) + 1
            effects = self._core.restarted(
                list(self._durable_records.values()), self._restart_lease_id(), self._now_ms(), tickets, next_ticket
            )
            self._host.restore_declared()  # (a silent node's registration keeps running out)
            self._apply(effects)
            self._drain()
            self._cond.notify_all()

    def _restart_lease_id(self) -> int:
        return self._durable_lease_limit



# -- known-bad adapters: each breaks one rule ------------------------------------------------------------


class StaleReadAdapter(CoreAdapter):
    """Acknowledges revocations without dropping its copy, and serves it afterwards from a local
    cache (breaks protocol properties 6/7: no read after ack, no read after the invalidation completed)."""

    name = "bad-stale-read"
    BROKEN_RULE = "read_after_invalidation"

    def start(self, ctx: RunContext) -> None:
        self._cache: dict[tuple[str, BlockKey, int], bytes] = {}
        super().start(ctx)

    def _drop_on_revoke(self, node: _Node, msg: Revoke) -> None:
        pass  # keeps trusting

    def _read_at(self, n, grant, trust):
        cached = self._cache.get((n.id, grant.key, trust.lease))
        if cached is not None:
            n.log.emit("read", key=grant.key, gen=trust.gen, epoch=trust.epoch, lease=trust.lease,
                       location=trust.location, result="ok")  # fmt: skip
            return cached
        data = super()._read_at(n, grant, trust)
        if isinstance(data, bytes):
            self._cache[(n.id, grant.key, trust.lease)] = data
        return data


class NoFencingAdapter(CoreAdapter):
    """Its locations accept bytes under an epoch below their fence (breaks protocol property 2: fencing)."""

    name = "bad-no-fencing"
    BROKEN_RULE = "fencing"

    def _location_write(self, loc, grant, data):
        fence = loc.tier.fence(grant.key.digest)
        if fence > grant.epoch:
            loc.tier.write(grant.key.digest, grant.gen, fence, data)  # overwrite whatever is there
            loc.log.emit("store_bytes", key=grant.key, gen=grant.gen, epoch=grant.epoch, lease=grant.lease,
                         writer=grant.node, location=loc.id)  # fmt: skip
            self._nodes[grant.node].stored.add((grant.key, grant.lease))
            self._write_over(self._nodes[grant.node], grant)
            return Stored()
        return super()._location_write(loc, grant, data)


class DropsWhenFullAdapter(CoreAdapter):
    """A full location makes room by dropping its least recently used block on its own, telling
    the directory nothing: the directory still grants a block whose bytes are gone (breaks
    protocol property 9, directory and data agree; and 5 when the block was leased)."""

    name = "bad-drops-when-full"
    BROKEN_RULE = "overload"

    def _location_write(self, loc, grant, data):
        out = super()._location_write(loc, grant, data)
        if isinstance(out, Refused) and out.reason == REASON_NO_SPACE and loc.tier.lru():
            victim = loc.tier.lru()[0]
            loc.tier.free(victim, loc.tier.fence(victim))
            out = super()._location_write(loc, grant, data)
        return out


class OpenDataPlaneAdapter(CoreAdapter):
    """Its locations serve and store a block's bytes for anyone who asks, granted or not (breaks
    protocol property 13: the data plane enforces the control plane's grants)."""

    name = "bad-open-data-plane"
    BROKEN_RULE = "data_plane_grant"

    def _granted(self, who, key, lease, *, write):
        return True


class EvictsLeasedAdapter(CoreAdapter):
    """Drops a copy under memory pressure even when the directory refuses because it is leased
    (breaks protocol property 5: no eviction under a live lease)."""

    name = "bad-evicts-leased"
    BROKEN_RULE = "evict_under_lease"

    def _evict_refused(self, n, key, reason):
        if reason != REASON_LEASED:
            return Refused(reason)
        rec = self._core.records[key]
        n.tier.free(key.digest, n.tier.fence(key.digest))
        n.log.emit("evict", key=key, gen=rec.gen, epoch=rec.epoch, location=n.id)
        return Evicted()


class NeverCachesAdapter(CoreAdapter):
    """Accepts writes and commits but never keeps bytes: every read misses (breaks non-vacuity:
    a cache that never caches)."""

    name = "bad-never-caches"
    BROKEN_RULE = "caching"

    def _location_write(self, loc, grant, data):
        loc.log.emit("store_bytes", key=grant.key, gen=grant.gen, epoch=grant.epoch, lease=grant.lease,
                     writer=grant.node, location=loc.id)  # what it claims to have done  # fmt: skip
        self._nodes[grant.node].stored.add((grant.key, grant.lease))
        self._write_over(self._nodes[grant.node], grant)
        return Stored()  # and drops the bytes


class NeverEvictsAdapter(CoreAdapter):
    """Refuses every eviction as if the copy were leased (breaks non-vacuity: memory is never
    reclaimed)."""

    name = "bad-never-evicts"
    BROKEN_RULE = "eviction"

    def evict(self, node, ns, key):
        with self._lock:
            self._node(node)
            return Refused(REASON_LEASED, "this cache never evicts")


class ReusedLeaseIdsAdapter(CoreAdapter):
    """Its directory does not keep the lease-id high-water mark durable: after a restart it
    hands out lease ids from the start again (breaks protocol property 8)."""

    name = "bad-reused-lease-ids"
    BROKEN_RULE = "lease_ids"

    def _restart_lease_id(self) -> int:
        return FIRST_LEASE_ID


class EarlyCompletionAdapter(CoreAdapter):
    """Reports an invalidation completed as soon as it started, without waiting for holders to
    acknowledge or their leases to expire (breaks protocol property 6)."""

    name = "bad-early-completion"
    BROKEN_RULE = "early_completion"

    def wait_invalidation(self, ticket, timeout_s):
        with self._lock:
            self._check_running()
            return True


class TrustsExpiredAdapter(CoreAdapter):
    """Its holders keep reading after their own lease deadline (breaks docs/protocol.md leases: a holder
    stops at expiry - epsilon, measured from when it sent the request)."""

    name = "bad-trusts-expired"
    BROKEN_RULE = "holder_expiry"

    def _trusted(self, n, grant):
        trust = n.holder.held(grant.key)
        return trust if trust is not None and trust.lease == grant.lease else None


class TrustsPastSkewAdapter(CoreAdapter):
    """Its holders ignore epsilon the wrong way (the spec's ``holder_ignores_skew``, widened to what
    a holder that reasons from the directory's side would do): they trust a lease until the
    directory's own bound, ``term + epsilon``, plus epsilon for their clock -- ``3 * epsilon`` past
    their deadline (breaks docs/protocol.md leases: a holder stops at expiry - epsilon). Only a read probed
    inside that window catches it."""

    name = "bad-trusts-past-skew"
    BROKEN_RULE = "holder_expiry"

    def _trusted(self, n, grant):
        return n.holder.trusted(grant.key, grant.lease, self._node_now_ns(n) - 3 * self._ctx.skew_ms * 1_000_000)


class SilentReadsAdapter(CoreAdapter):
    """Serves reads correctly but leaves every ``read`` out of its log (breaks the trace
    contract: a native trace that omits what the deployment did validates vacuously)."""

    name = "bad-silent-reads"
    BROKEN_RULE = "trace_complete"

    def _read_at(self, n, grant, trust):
        loc = self._nodes.get(trust.location)
        data = loc.tier.read(grant.key.digest, trust.gen) if loc is not None and loc.alive else None
        return data if data is not None else Refused(REASON_MISS)


class NeverFreesAdapter(CoreAdapter):
    """Its locations ignore every free the directory sends (after an invalidation completes, a
    write aborts or its lease expires): no ``free_slot`` is logged, no ``Freed`` is answered,
    and the bytes of the ended generation stay in the tier (breaks docs/protocol.md progress: deletion
    reaches everywhere). Every read the suite makes is still refused -- the directory voided the
    generation -- so only a check of the locations themselves catches it."""

    name = "bad-never-frees"
    BROKEN_RULE = "deletion"

    def _free_at(self, location: str, key: BlockKey, epoch: int) -> None:
        pass  # the Free is dropped: the bytes stay where they are


class NeverAcksFreesAdapter(CoreAdapter):
    """Its locations free the bytes and log it, but never answer ``Freed``: the directory keeps
    every free owed and sends it again, every retry wait, forever (the Mooncake adapter did this
    until it was fixed). The bytes are gone, so only a check that the frees settle -- the
    directory's ``free_acked`` -- catches it."""

    name = "bad-never-acks-frees"
    BROKEN_RULE = "deletion"

    def _ack_free(self, location: str, key: BlockKey, epoch: int) -> None:
        pass  # no Freed: the directory is never told


class _ForgetsTransferCore(DirectoryCore):
    """A directory that drops a transfer under way from a key's record when an invalidation
    voids the key, instead of owing its destination a free: the copy lands unfenced after the
    invalidation, and nothing ever frees it."""

    def _start_invalidation(self, keys, effects, announce=None):
        keys = list(keys)
        for key in keys:
            rec = self.records.get(key)
            if rec is not None and rec.moving_to is not None:
                self.records[key] = attrs.evolve(rec, moving_to=None)  # the transfer forgotten
        return super()._start_invalidation(keys, effects, announce)


class ForgetsTransferAdapter(CoreAdapter):
    """Its directory forgets a tier transfer an invalidation cut short (``_ForgetsTransferCore``):
    the copy lands at the destination after the invalidation voided the generation and stays
    there for good (breaks docs/protocol.md progress: deletion reaches everywhere, for the
    copies a transfer makes). Every read is still refused -- the generation is gone at the
    directory -- so only a check of the locations, with the invalidation racing the transfer,
    catches it."""

    name = "bad-forgets-transfer"
    BROKEN_RULE = "transfer_race"

    CORE = _ForgetsTransferCore


class WriteOnceAdapter(CoreAdapter):
    """Its locations are write-once and content-addressed, as L3 KV stores assume (the same key
    always has the same bytes): a location that ever stored bytes of a key, asked to store bytes
    of it again of the same size -- the only check it makes -- stores its first bytes again
    ("already have it") and says ``Stored`` (breaks protocol property 4: the committed
    generation's bytes are the ones written under it). Only a rewrite of the same size at the
    same location shows it."""

    name = "bad-write-once"
    BROKEN_RULE = "overwrite"

    def start(self, ctx: RunContext) -> None:
        self._first: dict[tuple[str, BlockKey], bytes] = {}
        super().start(ctx)

    def _location_write(self, loc, grant, data):
        first = self._first.setdefault((loc.id, grant.key), data)
        return super()._location_write(loc, grant, first if len(first) == len(data) else data)


class CommitLostUpdateAdapter(CoreAdapter):
    """Its directory commits by read-modify-write without holding the key's record in between, as
    a store updated with no revision check does: the commit lands, and ``commit_window_s`` later
    (a tenth of a term) the record as the commit left it is written back whole. An invalidation
    that voided the key in between is undone: the voided generation is COMMITTED again after its
    invalidation completed, granted and counted by lookup, its bytes already freed (breaks
    protocol property 6; the reference's core refuses such a write: generations never decrease).
    Only an invalidation racing a commit shows it."""

    name = "bad-commit-lost-update"
    BROKEN_RULE = "commit_race"

    def commit(self, grant):
        r = super().commit(grant)
        if not isinstance(r, Committed):
            return r
        with self._lock:
            written = self._core.records[grant.key]
        time.sleep(self._ctx.lease_term_ms / 10_000)
        with self._lock:
            now = self._core.records[grant.key]
            if (now.phase, now.gen) != (written.phase, written.gen):
                # Written back over the core's own guard (generations never decrease), as a store
                # without one would: every index of the record is as the invalidation left it.
                self._core.records[grant.key] = attrs.evolve(written, to_free=now.to_free)
        return r


# A medium that survives a crash: correct as such (``DurableDiskAdapter``, one of ``CORRECT``), and
# the known-bad write-behind store built on it (``TornWriteAdapter``).


class _TornDram(DramTier):
    """A ``DramTier`` whose medium can keep half of a block: ``tear`` rewrites the second half of
    a stored block's bytes as zeros, under a header and checksum that vouch for what is left (what
    a store that writes its own metadata for a block it has not finished writing comes back with)."""

    def tear(self, key: bytes) -> None:
        with self._mu:
            entry = self._by_key.get(key)
            if entry is None or entry.length < 2:
                return
            a, n = entry.slot * self.block_bytes, entry.length
            assert self._host is not None
            torn = bytes(self._host[a : a + n // 2]) + bytes(n - n // 2)
            entry.crc = self._store(entry.slot, entry.key, entry.gen, entry.epoch, entry.seq, torn, n)


class DurableDiskAdapter(CoreAdapter):
    """Correct, with a medium that survives a crash: a killed node comes back with every block its
    locations stored (logged ``crash`` without ``lose_disk``, and a rejoin that lost nothing), so
    the directory still vouches for them. The contract allows it (``restart``: "it rejoins empty or
    with its disk"); tests that kill a node MUST NOT assume its blocks are gone."""

    name = "durable-disk"
    CRASH_LOSES_MEDIUM = False

    def _crash_medium(self, n):
        """Nothing is lost: every write landed before its ``Stored``."""

    def _medium_after_restart(self, old, n):
        n.tier.close()
        n.tier = old.tier  # the medium came back, and nothing was lost
        return []


class TornWriteAdapter(DurableDiskAdapter):
    """Its locations acknowledge a block once it is in memory and the first half of it is on the
    medium (write-behind: the rest would follow at a clean stop), and the medium survives a crash.
    A node killed after a write comes back holding a torn block -- its first half, then zeros,
    vouched for by its header -- that the directory, told the bytes were stored and then
    committed, grants and serves (breaks protocol property 4: a read returns exactly a committed
    generation's bytes). Only a crash after a write shows it: before one, every read gets the
    block whole."""

    name = "bad-torn-write"
    BROKEN_RULE = "torn_write"

    def _new_tier(self, node_id):
        return _TornDram(BLOCK_SLOTS, BLOCK_BYTES, pin_memory=False, name=node_id)

    def _crash_medium(self, n):
        for key in n.tier.keys():
            n.tier.tear(key)  # what was only in memory is gone


KNOWN_BAD: tuple[type[CoreAdapter], ...] = (
    StaleReadAdapter, NoFencingAdapter, EvictsLeasedAdapter, NeverCachesAdapter, NeverEvictsAdapter,
    ReusedLeaseIdsAdapter, EarlyCompletionAdapter, TrustsExpiredAdapter, TrustsPastSkewAdapter,
    SilentReadsAdapter, NeverFreesAdapter, NeverAcksFreesAdapter, WriteOnceAdapter, CommitLostUpdateAdapter,
    OpenDataPlaneAdapter, DropsWhenFullAdapter, TornWriteAdapter, ForgetsTransferAdapter,
)  # fmt: skip


# -- correct adapters the suite must not fail -----------------------------------------------------------


class LateCommitAnswerAdapter(CoreAdapter):
    """Correct, with a slow reply path: the directory commits at once, and the answer reaches the
    writer only ``answer_delay_s`` later (a loaded network, a writer descheduled under load), or as
    soon as ``answer_commits`` is set. Readers meanwhile see the new generation, as they may.
    ``commit_landed`` is set whenever a commit has landed and its answer is held back."""

    name = "late-commit-answer"

    def __init__(self, *, answer_delay_s: float | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.answer_delay_s = answer_delay_s
        self.commit_landed = threading.Event()
        self.answer_commits = threading.Event()

    def commit(self, grant):
        r = super().commit(grant)  # landed (or refused) at the directory; the lock is released
        self.commit_landed.set()
        delay_s = self.answer_delay_s if self.answer_delay_s is not None else self._ctx.lease_term_ms / 4000
        self.answer_commits.wait(delay_s)
        return r


class InferredCoreAdapter(CoreAdapter):
    """``CoreAdapter`` declaring ``events="inferred"``: it returns no log, and the suite builds the
    trace from what it saw (how most vendors start)."""

    name = "core-inferred"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        # (no ``move``: a transfer's copy lands out of the suite's sight, so only native events show it)
        self._caps = attrs.evolve(self._caps, events="inferred", faults=self._caps.faults - {"move"})

    def events(self):
        return None


CORRECT: tuple[type[CoreAdapter], ...] = (CoreAdapter, LateCommitAnswerAdapter, InferredCoreAdapter, DurableDiskAdapter)


# -- adapters that break the contract itself ----------------------------------------------------------------


class HangingAdapter(CoreAdapter):
    """Every read blocks until ``stop()`` (the suite's watchdog must turn it into ERROR)."""

    name = "bad-hangs"

    def start(self, ctx: RunContext) -> None:
        self._released = threading.Event()
        super().start(ctx)

    def read(self, grant):
        self._released.wait()
        raise AdapterError("stopped while reading")

    def stop(self) -> None:
        released = getattr(self, "_released", None)
        if released is not None:
            released.set()
        super().stop()


class GarbageAdapter(CoreAdapter):
    """Answers ``acquire`` with a value that is not in the contract."""

    name = "bad-garbage"

    def acquire(self, node, ns, key):
        return {"lease": "yes, probably"}  # type: ignore[return-value]


class SilentAdapter(CoreAdapter):
    """Declares native events and logs none: ``events()`` answers ``[]`` (certifies nothing)."""

    name = "bad-silent"

    def events(self):
        return []


def core_factory() -> CoreAdapter:
    return CoreAdapter()
