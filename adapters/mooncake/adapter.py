"""``mooncake``: Mooncake Store holding the bytes, kvcc's directory deciding who may do what with them.

Theory of operation
-------------------
The store is a good home for bytes -- its put is two-phase, its objects immutable, its transfers
real -- but it has no generations, epochs, write leases, revocation, prefix chains or tenants
(see ``kvcc.adapters.mooncake.raw``, the direct mapping). This adapter adds exactly those, in
the adapter process, and leaves the bytes to the store:

- **The directory** is ``kvcc.reference.directory.core.DirectoryCore``, in-process, behind one
  lock, on the adapter's monotonic clock (milliseconds since start). Every contract operation
  becomes the wire message the core takes (``Acquire``, ``BeginWrite``, ``Commit``, ...), and
  the core's effects are carried out in order: ``Emit`` lines go to the directory's event log
  under the lock (so its log is in the core's order); ``Send(Revoke)`` is queued for the
  holder's client; ``FreeAt`` removes the store objects; ``CompleteTicket`` wakes waiters -- after
  the frees of the same call, so a completed ticket means the bytes are gone. A timer thread
  calls ``tick`` at the core's next deadline (lease and write-lease expiry, completion of an
  invalidation by expiry). Tenancy: one tenant, authorised for ``RunContext.namespaces``.
- **Locations** are the nodes' own segments: a granted write goes to the writer's node
  (``place_write``), and the writer's store client puts it with ``preferred_segment`` = its own
  segment. So a killed node loses exactly its own location, and on restart the directory voids
  what was there (``node_rejoined(lost_locations=[node])``) and the location restores its fences.
  Each location keeps a fence per key (the highest epoch whose bytes landed): bytes under a lower
  epoch are refused ``fenced`` (``fence_stale_write``), as are frees (``fence_stale_free``).
- **Bytes** are stored under ``kvcc/<key>/g<gen>/e<epoch>``: a generation's bytes can never be
  read as another's, and a stale writer can never overwrite anything. Each value carries a header
  (magic, key, gen, epoch, length, SHA-256 of the data) that the reader verifies: anything else
  (a torn transfer, a missing object, an object of another key) is ``Refused(REASON_MISS)``, never
  wrong bytes.
- **Holders** (each node's client, in the adapter process) trust a lease from when they *sent*
  the request until ``sent + term - skew`` on their own clock (``skew_clock`` offsets it), refuse
  reads after that, and drop the lease and acknowledge when revoked (a paused node's revocations
  wait for ``resume``; a killed node's are lost, and its leases expire).
- **Events** are ``native``: the directory's ``Emit`` lines (log ``directory``), each node's
  holder and writer steps and its location's data-plane steps (log ``n<i>``, a new incarnation
  per restart).

- **Directory restart**: the directory's durable effects go to a SQLite (WAL) log in the run's
  workdir before anything of the same step leaves; ``restart_directory`` reloads it into a fresh
  core (a new incarnation and clock) that honours the restart grace.

Not supported: transfers between tiers (no tiering profile).
"""

from __future__ import annotations

import hashlib
import queue
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from attrs import frozen

from kvcc.conformance.contract import (
    AdapterError,
    Capabilities,
    Committed,
    Evicted,
    InvalidationTicket,
    NotSupported,
    ReadGrant,
    Refused,
    Stored,
    WriteGrant,
)
from kvcc.reference import wire
from kvcc.reference.directory.core import (
    WRITING,
    CompleteTicket,
    DirectoryConfig,
    DirectoryCore,
    Emit,
    FreeAt,
    Send,
    TICKET_COMPLETED,
)
from kvcc.reference.directory.host import CoreHost
from kvcc.reference.errors import Unauthorized
from kvcc.reference.holder import Holder, Trust
from kvcc.spec.keys import BlockKey, LocationId, Namespace, NodeId
from kvcc.spec.rules import fence_accepts
from kvcc.spec.vocabulary import (
    REASON_FENCED,
    REASON_LEASE_EXPIRED,
    REASON_MISS,
    REASON_NOT_ABSENT,
    REASON_NOT_COMMITTED,
    REASON_NOT_FOUND,
    REASON_UNKNOWN_LEASE,
    SCOPE_NAMESPACE,
    SCOPES,
)

from .base import RC_OBJECT_NOT_FOUND, RC_OK, MooncakeDeployment

TENANT = "tenant"
DIRECTORY_LOG = "directory"
TIMER_MAX_SLEEP_S = 0.05  # the timer thread re-reads the core's next deadline at least this often
STORE_LEASE_MS = 1000  # the store's own object lease; irrelevant here (frees are forced)
WAIT_POLL_S = 0.05
CLOCK_GRAIN_MS = 1  # the directory clock's resolution
_INVALIDATE_EVENTS = frozenset({"invalidate", "invalidate_namespace"})

VALUE_MAGIC = b"KVCC"
_HEADER = struct.Struct(">4s32sQQQ32s")  # magic, key, gen, epoch, data length, sha256(data)
VALUE_HEADER_BYTES = _HEADER.size


def object_name(key: BlockKey, gen: int, epoch: int) -> str:
    return f"kvcc/{key.hex}/g{gen}/e{epoch}"


def encode_value(key: BlockKey, gen: int, epoch: int, data: bytes) -> bytes:
    return _HEADER.pack(VALUE_MAGIC, key.digest, gen, epoch, len(data), hashlib.sha256(data).digest()) + data


def decode_value(blob: bytes, key: BlockKey, gen: int, epoch: int) -> bytes | None:
    """The data if ``blob`` is exactly the value of (key, gen, epoch) with a matching checksum."""
    if len(blob) < VALUE_HEADER_BYTES:
        return None
    magic, kd, g, e, n, digest = _HEADER.unpack_from(blob)
    data = blob[VALUE_HEADER_BYTES:]
    if (magic, kd, g, e, n) != (VALUE_MAGIC, key.digest, gen, epoch, len(data)):
        return None
    if hashlib.sha256(data).digest() != digest:
        return None
    return data


@frozen
class _Writing:
    grant: WriteGrant
    stored: bool = False
    fenced: bool = False
    started: bool = False  # start_writing logged: the bytes count as sent
    zombie: bool = False  # given up by the client; its bytes may still land (or be fenced)


class MooncakeKvccAdapter(MooncakeDeployment):
    """Mooncake Store under kvcc's directory; see the module docstring."""

    name = "mooncake"

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.RLock()  # the core, holders, writers, fences, stored objects
        self._changed = threading.Condition(self._lock)
        self._host: CoreHost | None = None  # the directory core, its clock and its durable log
        self._holders: dict[str, Holder] = {}  # each node's client's read leases, on its own clock
        self._writing: dict[int, _Writing] = {}
        self._write_in_progress: set[tuple[str, BlockKey]] = set()  # (writer, key): one at a time
        self._fence: dict[tuple[str, BlockKey], int] = {}  # (location, key) -> highest epoch landed
        self._objects: dict[tuple[str, BlockKey], set[tuple[int, int]]] = {}  # (loc, key) -> {(gen, epoch)}
        self._skew_ns: dict[str, int] = {}
        self._down: set[str] = set()
        self._paused: set[str] = set()
        self._held_back: dict[str, list[wire.Revoke]] = {}  # revokes for paused nodes
        self._revokes: queue.Queue[tuple[str, wire.Revoke] | None] = queue.Queue()
        self._done_tickets: set[int] = set()
        self._noop_tickets: set[int] = set()
        self._threads: list[threading.Thread] = []

    def capabilities(self) -> Capabilities:
        return Capabilities(
            profiles=frozenset({"core", "leases", "invalidation", "faults"}),
            faults=frozenset({"kill", "restart", "pause", "resume", "skew_clock", "restart_directory", "intrude"}),
            scopes=frozenset(SCOPES),
            events="native",
            leases="enforced",
            frees_acknowledged=True,
            notes=(
                "kvcc's directory core in the adapter process (leases, epochs, generations, "
                "invalidation, prefix chains, tenants); Mooncake Store holds the bytes, one object per "
                "(key, generation, epoch) with a verified SHA-256 header, placed in the writer node's "
                "own segment; locations fence by epoch."
            ),
        )

    def _store_lease_ms(self, ctx) -> int:
        return STORE_LEASE_MS

    # ------------------------------------------------------------------ lifecycle
    def _new_core(self, ctx) -> DirectoryCore:
        allowed = frozenset(ns.digest() for ns in ctx.namespaces)
        return DirectoryCore(
            # One millisecond more than epsilon: the core's clock is whole milliseconds (rounded
            # down), so a lease it grants would otherwise end up to 1 ms before grant + term + eps.
            DirectoryConfig(lease_term_ms=ctx.lease_term_ms, skew_ms=ctx.skew_ms + CLOCK_GRAIN_MS),
            lambda tenant, digest: tenant == TENANT and bytes(digest) in allowed,
            place_write=lambda node, key: LocationId(node),
        )

    def start(self, ctx) -> None:
        from kvcc.reference.directory.store import DirectoryStore

        self._ctx_for_restart = ctx
        self._store_path = ctx.workdir / "directory.db"
        self._store = DirectoryStore(self._store_path)  # the directory's durable log (SQLite WAL)
        self._store.load()
        # As the server: a free retried to a dead node's location is not sent, so not logged.
        self._host = CoreHost(self._new_core(ctx), commit=self._commit, emit=self._emit_step,
                              reachable=lambda location: location not in self._down)  # fmt: skip
        self.logs.log(DIRECTORY_LOG)
        super().start(ctx)
        for node in self.nodes():
            self.logs.log(node)
        for target, name in ((self._timer_loop, "mooncake-directory-timer"), (self._revoke_loop, "mooncake-revokes")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stopped.set()
        self._revokes.put(None)
        with self._changed:
            self._changed.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)
        self._threads = []
        store, self._store = getattr(self, "_store", None), None
        if store is not None:
            try:
                store.close()
            except Exception:  # noqa: BLE001 - stop never raises
                pass
        super().stop()

    def events(self) -> list[dict] | None:
        return self.logs.all()

    # ------------------------------------------------------------------ clocks
    def _dir_now_ms(self) -> int:
        return self._host.now_ms() if self._host is not None else 0

    def _node_now_ns(self, node: str) -> int:
        return time.monotonic_ns() + self._skew_ns.get(node, 0)

    def skew_clock(self, node: str, offset_ms: int) -> None:
        self._check_node(node)
        with self._lock:
            self._skew_ns[node] = int(offset_ms) * 1_000_000

    # ------------------------------------------------------------------ the directory
    @property
    def core(self) -> DirectoryCore:
        if self._host is None:
            raise AdapterError("the adapter was not started")
        return self._host.core

    def _commit(self, durable: list) -> None:
        if getattr(self, "_store", None) is not None:
            self._store.commit(durable)  # before any reply or directive of this call leaves

    def _emit_step(self, e: Emit, late_ns: Callable[[], int]) -> None:
        self.logs.emit(DIRECTORY_LOG, e.event, late_ns=late_ns, **dict(e.fields))

    def _handle(self, msg: Any) -> tuple[Any, list]:
        """One message through the core (lock held by the caller); Emit lines are logged now, in
        the core's order; the directives are returned for ``_carry_out`` after the lock."""
        declared = self._host.detect()  # a node silent a term is declared down first
        reply, effects = self.core.handle(msg, self._dir_now_ms(), TENANT)
        return reply, declared + self._log_emits(effects)

    def _log_emits(self, effects: list) -> list:
        # The core emits an invalidation's own step after the steps it caused (a key completed at
        # once because no lease was on it); the spec's order is the invalidation first.
        first = [e for e in effects if isinstance(e, Emit) and e.event in _INVALIDATE_EVENTS]
        rest = [e for e in effects if not (isinstance(e, Emit) and e.event in _INVALIDATE_EVENTS)]
        return self._host.record(first + rest)

    def _carry_out(self, effects: list) -> None:
        """The I/O effects of one core call, in order, without the lock."""
        for e in effects:
            if isinstance(e, Send) and isinstance(e.msg, wire.Revoke):
                self._revokes.put((str(e.node), e.msg))
            elif isinstance(e, FreeAt):
                self._free(str(e.location), e.key, e.epoch)
            elif isinstance(e, CompleteTicket):
                with self._changed:
                    self._done_tickets.add(e.ticket.ticket)
                    self._changed.notify_all()
            # Persist/PersistTicket/ForgetTicket/ReserveLeaseIds: committed in _log_emits;
            # CopyAt: no transfers are started.

    def _timer_loop(self) -> None:
        while not self._stopped.is_set():
            with self._lock:
                directives = self._host.tick() if self._host.due() else []
                wait_s = self._host.wait_s(TIMER_MAX_SLEEP_S)
            if directives:
                self._carry_out(directives)
                continue
            self._stopped.wait(wait_s)

    # ------------------------------------------------------------------ locations
    def _free(self, location: str, key: BlockKey, epoch: int) -> None:
        """The location frees its copy of ``key`` unless fenced by a higher epoch."""
        with self._lock:
            if location in self._down:
                return  # the copy died with the node
            fenced = not fence_accepts(epoch, self._fence.get((location, key), 0))
            if fenced:
                self.logs.emit(location, "fence_stale_free", key=key, epoch=epoch, location=location)
            else:
                victims = sorted(self._objects.pop((location, key), set()))
                self._fence[(location, key)] = max(epoch, self._fence.get((location, key), 0))
        if not fenced:
            for gen, ep in victims:
                self._remove_object(location, key, gen, ep)
        with self._lock:
            if not fenced:
                self.logs.emit(location, "free_slot", key=key, epoch=epoch, location=location)
            # Acknowledge, as the reference node does (``Freed``): without it the directory keeps
            # the free owed and sends it again, every retry wait, forever.
            _, effects = self._handle(wire.Freed(LocationId(location), key, epoch))
        self._carry_out(effects)

    def _remove_object(self, location: str, key: BlockKey, gen: int, epoch: int) -> None:
        """Forced remove (the store's own object lease is not kvcc's): by the location's node, or
        any running node when it cannot answer (the master removes, whoever asks)."""
        candidates = [location] + [n for n in self.nodes() if n != location]
        for node in candidates:
            if node in self._down or node in self._paused:
                continue
            try:
                rc = self.rc(node, "remove", key=object_name(key, gen, epoch), force=True)
            except AdapterError:
                continue
            if rc in (RC_OK, RC_OBJECT_NOT_FOUND):
                return
        # No node could remove it: the bytes stay unreachable (their name is never read again).

    # ------------------------------------------------------------------ writes
    def lookup(self, node: str, ns: Namespace, keys: Sequence[BlockKey]) -> int:
        self._node_up(node)
        with self._lock:
            try:
                reply, effects = self._handle(wire.Lookup(ns.digest(), tuple(keys)))
            except Unauthorized:
                return 0
        self._carry_out(effects)
        return reply.blocks_matched

    def begin_write(self, node: str, ns: Namespace, key: BlockKey, parent: BlockKey | None) -> WriteGrant | Refused:
        self._node_up(node)
        with self._lock:
            if (node, key) in self._write_in_progress and not self._abandon_dead_write(node, key):
                # A client has one write of a key in progress at a time (as the spec's writer):
                # a second request of the same node is answered by the client itself.
                return Refused(REASON_NOT_ABSENT, "this node's client already has a write of the key in progress")
            self._write_in_progress.add((node, key))
            sent = time.monotonic_ns()
            request = self.next_id()
            self.logs.emit(node, "begin_write", key=key, writer=node)
            reply, effects = self._handle(wire.BeginWrite(NodeId(node), key, ns.digest(), parent, request))
            if isinstance(reply, wire.LeaseRefused):
                # The writer gives up the write it asked for (spec: abort from "requested").
                self._write_in_progress.discard((node, key))
                self.logs.emit(node, "abort", key=key, writer=node)
                out: WriteGrant | Refused = Refused(reply.reason)
            else:
                assert isinstance(reply, wire.WriteLeaseGranted)
                out = WriteGrant(
                    node=node, key=key, gen=reply.gen, epoch=reply.epoch, lease=reply.lease,
                    location=str(reply.location), term_ms=reply.term_ms, requested_at_ns=sent,
                )  # fmt: skip
                self._writing[out.lease] = _Writing(out)
        self._carry_out(effects)
        return out

    def _abandon_dead_write(self, node: str, key: BlockKey) -> bool:
        """(Lock held.) The node's write of ``key`` in progress is dead at the directory (voided by
        an invalidation, or its write lease expired): the client gives it up, its bytes counted as
        sent (``start_writing``) so that, when they come, the location judges them by their epoch
        -- a zombie write. False if that write is still alive."""
        rec = self.core.records.get(key)
        mine = [(lease, w) for lease, w in self._writing.items() if w.grant.node == node and w.grant.key == key]
        for lease, w in mine:
            if rec is not None and rec.phase == WRITING and rec.write_lease == lease:
                return False
        for lease, w in mine:
            g = w.grant
            if not w.started:
                self.logs.emit(node, "start_writing", key=key, gen=g.gen, epoch=g.epoch, lease=lease, writer=node, location=g.location)
            if not w.stored and not w.fenced:
                self.logs.emit(node, "abort", key=key, gen=g.gen, epoch=g.epoch, lease=lease, writer=node)
            self._writing[lease] = attrs.evolve(w, started=True, zombie=True)
        self._write_in_progress.discard((node, key))
        return True

    def write_bytes(self, grant: WriteGrant, data: bytes) -> Stored | Refused:
        self._node_up(grant.node)
        loc = grant.location
        with self._lock:
            w = self._writing.get(grant.lease)
            if w is None or w.grant != grant:
                return Refused(REASON_UNKNOWN_LEASE, "no such write in this client")
            if not w.started and not w.zombie:
                self.logs.emit(grant.node, "start_writing", key=grant.key, gen=grant.gen, epoch=grant.epoch, lease=grant.lease, writer=grant.node, location=loc)
                w = self._writing[grant.lease] = attrs.evolve(w, started=True)
            if loc in self._down:
                return Refused(REASON_MISS, f"location {loc} is down")
            if not fence_accepts(grant.epoch, self._fence.get((loc, grant.key), 0)):
                self.logs.emit(loc, "fence_stale_write", key=grant.key, gen=grant.gen, epoch=grant.epoch, lease=grant.lease, writer=grant.node, location=loc)
                self._writing[grant.lease] = attrs.evolve(w, fenced=True)
                if not w.zombie:
                    self._write_in_progress.discard((grant.node, grant.key))
                return Refused(REASON_FENCED, f"location {loc} has seen epoch {self._fence[(loc, grant.key)]}")
        value = encode_value(grant.key, grant.gen, grant.epoch, bytes(data))
        segment = self.segment(loc) if loc in self.nodes() else ""
        rc = self.rc(grant.node, "put", key=object_name(grant.key, grant.gen, grant.epoch), payload=value, preferred_segment=segment)
        if rc != RC_OK:
            return Refused(REASON_MISS, f"the store refused the put: {rc}")
        with self._lock:
            if not fence_accepts(grant.epoch, self._fence.get((loc, grant.key), 0)):
                # A higher epoch landed while ours was in flight: ours is fenced after all.
                self.logs.emit(loc, "fence_stale_write", key=grant.key, gen=grant.gen, epoch=grant.epoch, lease=grant.lease, writer=grant.node, location=loc)
                w = self._writing.get(grant.lease)
                if w is not None:
                    self._writing[grant.lease] = attrs.evolve(w, fenced=True)
                if not w.zombie:
                    self._write_in_progress.discard((grant.node, grant.key))
                return Refused(REASON_FENCED, "a higher epoch landed first")
            self._fence[(loc, grant.key)] = grant.epoch
            self._objects.setdefault((loc, grant.key), set()).add((grant.gen, grant.epoch))
            self.logs.emit(loc, "store_bytes", key=grant.key, gen=grant.gen, epoch=grant.epoch, lease=grant.lease, writer=grant.node, location=loc)
            w = self._writing.get(grant.lease)
            if w is not None:
                self._writing[grant.lease] = attrs.evolve(w, stored=True)
                if not w.zombie:
                    self._write_in_progress.discard((grant.node, grant.key))
        return Stored()

    def commit(self, grant: WriteGrant) -> Committed | Refused:
        self._node_up(grant.node)
        with self._lock:
            w = self._writing.get(grant.lease)
            if w is None or w.grant != grant:
                # Refused here without asking (as the reference client refuses a write it never
                # stored): nothing reaches the directory, so no step of it is logged.
                return Refused(REASON_NOT_FOUND, "no such write in this client (its node restarted, or never asked)")
            if not w.stored:
                return Refused(REASON_NOT_COMMITTED, "no bytes were stored under this grant")
            reply, effects = self._handle(
                wire.Commit(NodeId(grant.node), grant.key, grant.lease, grant.gen, grant.epoch)
            )
            self._writing.pop(grant.lease, None)
        self._carry_out(effects)
        if isinstance(reply, wire.CommitRejected):
            return Refused(reply.reason)
        assert isinstance(reply, wire.Committed)
        return Committed(gen=reply.gen, epoch=reply.epoch)

    def abort(self, grant: WriteGrant) -> None:
        with self._lock:
            w = self._writing.get(grant.lease)
            if w is None or w.grant != grant or w.zombie:
                return
            self._write_in_progress.discard((grant.node, grant.key))
            if not w.stored and not w.fenced:
                # Once its bytes landed (or were fenced) the writer has nothing left to give up.
                # Bytes the caller may still send under this grant count as sent now (the spec
                # can only fence bytes in flight), then the writer gives up.
                if not w.started:
                    self.logs.emit(grant.node, "start_writing", key=grant.key, gen=grant.gen, epoch=grant.epoch, lease=grant.lease, writer=grant.node, location=grant.location)
                self.logs.emit(grant.node, "abort", key=grant.key, gen=grant.gen, epoch=grant.epoch, lease=grant.lease, writer=grant.node)
            # The write lease expires on its own (the directory has no abort message). The grant
            # stays known as a zombie: bytes sent under it later are judged by the location's
            # fence, as bytes in flight would be.
            self._writing[grant.lease] = attrs.evolve(w, zombie=True, started=True)

    # ------------------------------------------------------------------ reads
    def _holder(self, node: str) -> Holder:
        """(Lock held.) The node's client's holder (``kvcc.reference.holder``)."""
        h = self._holders.get(node)
        if h is None:
            h = self._holders[node] = Holder(self.ctx.skew_ms)
        return h

    def acquire(self, node: str, ns: Namespace, key: BlockKey) -> ReadGrant | Refused:
        self._node_up(node)
        with self._lock:
            h = self._holder(node)
            authorized = any(ns.digest() == n.digest() for n in self._ctx_for_restart.namespaces)
            refusal = h.may_acquire(key, self._node_now_ns(node)) if authorized else None
            if refusal is not None:
                # The spec's holder has one slot per key: renew the lease it trusts instead.
                return Refused(refusal, "this node holds a live lease on the key")
            sent = time.monotonic_ns()
            own_sent = self._node_now_ns(node)
            request = self.next_id()
            h.acquiring(key, request)
            self.logs.emit(node, "acquire", key=key, holder=node)
            try:
                reply, effects = self._handle(wire.Acquire(NodeId(node), key, ns.digest(), request))
            except BaseException:
                h.answered(key, request)
                raise
            if isinstance(reply, wire.LeaseRefused):
                if h.answered(key, request):
                    self.logs.emit(node, "abandon", key=key, result=reply.reason)  # nothing to wait for (spec: abandon)
                out: ReadGrant | Refused = Refused(reply.reason)
            elif h.gave_up(key, request, sent_ns=own_sent, term_ms=reply.term_ms, now_ns=self._node_now_ns(node)):
                out = Refused(REASON_LEASE_EXPIRED, "the grant came after the request's budget ran out")
            else:
                assert isinstance(reply, wire.ReadLeaseGranted)
                trust = h.granted(key, request, lease=reply.lease, gen=reply.gen, epoch=reply.epoch,
                                  location=str(reply.location), term_ms=reply.term_ms, sent_ns=own_sent)  # fmt: skip
                assert trust is not None, "no revocation can overtake a grant under the adapter's lock"
                self.logs.emit(node, "trust_read_lease", key=key, gen=reply.gen, epoch=reply.epoch, lease=reply.lease, holder=node, location=str(reply.location))
                out = ReadGrant(
                    node=node, key=key, gen=reply.gen, epoch=reply.epoch, lease=reply.lease,
                    location=str(reply.location), term_ms=reply.term_ms, requested_at_ns=sent,
                )  # fmt: skip
        self._carry_out(effects)
        return out

    def _trusted(self, grant: ReadGrant) -> Trust | Refused:
        """The holder's own check (lock held): the lease is still its own and not past its budget."""
        h = self._holder(grant.node)
        held = h.held(grant.key)
        if held is None or held.lease != grant.lease:
            return Refused(REASON_UNKNOWN_LEASE, "the holder has no such lease (released, revoked or expired)")
        trust = h.trusted(grant.key, grant.lease, self._node_now_ns(grant.node))
        if trust is None:
            return Refused(REASON_LEASE_EXPIRED, "past the holder's own deadline (sent + term - skew)")
        return trust

    def renew(self, grant: ReadGrant) -> ReadGrant | Refused:
        self._node_up(grant.node)
        with self._lock:
            held = self._trusted(grant)
            if isinstance(held, Refused):
                return held
            h = self._holder(grant.node)
            sent = time.monotonic_ns()
            own_sent = self._node_now_ns(grant.node)
            request = self.next_id()
            h.renewing(grant.key, request)
            self.logs.emit(grant.node, "renew", key=grant.key, lease=grant.lease, holder=grant.node)
            try:
                reply, effects = self._handle(
                    wire.Renew(NodeId(grant.node), grant.key, grant.lease, LocationId(held.location), request)
                )
            except BaseException:
                h.answered(grant.key, request)
                raise
            if isinstance(reply, wire.LeaseRefused):
                if h.answered(grant.key, request):
                    self.logs.emit(grant.node, "abandon", key=grant.key, lease=grant.lease, result=reply.reason)
                out: ReadGrant | Refused = Refused(reply.reason)
            elif h.gave_up(grant.key, request, sent_ns=own_sent, term_ms=reply.term_ms, now_ns=self._node_now_ns(grant.node)):
                out = Refused(REASON_LEASE_EXPIRED, "the renewal came after the request's budget ran out")
            else:
                assert isinstance(reply, wire.LeaseRenewed)
                renewed = h.renewed(grant.key, request, lease=grant.lease, term_ms=reply.term_ms, sent_ns=own_sent)
                assert renewed is not None, "no revocation can overtake a renewal under the adapter's lock"
                self.logs.emit(grant.node, "trust_renewal", key=grant.key, lease=grant.lease, holder=grant.node)
                out = attrs.evolve(grant, term_ms=reply.term_ms, requested_at_ns=sent)
        self._carry_out(effects)
        return out

    def read(self, grant: ReadGrant) -> bytes | Refused:
        self._node_up(grant.node)
        with self._lock:
            held = self._trusted(grant)
            if isinstance(held, Refused):
                return held
            if held.location in self._down:
                return Refused(REASON_MISS, f"location {held.location} is down")
        rc, blob = self.call(grant.node, "get", key=object_name(grant.key, held.gen, held.epoch))
        if type(rc) is not int:
            raise AdapterError(f"get answered {rc!r:.80}")
        data = decode_value(blob, grant.key, held.gen, held.epoch) if rc >= 0 else None
        with self._lock:
            # Served only if the holder still trusts the lease now, after the transfer.
            again = self._trusted(grant)
            if isinstance(again, Refused):
                return again
            if data is None:
                return Refused(REASON_MISS, f"no valid bytes at {held.location} (get: {rc})")
            self.logs.emit(grant.node, "read", key=grant.key, gen=held.gen, epoch=held.epoch, lease=held.lease, holder=grant.node, location=held.location)
        return data

    def intrude(self, grant: ReadGrant | WriteGrant, how: str, data: bytes | None = None) -> bytes | Stored | Refused:
        """Through another client of the store (``outsider``), get the grant's object or put
        ``data`` as it: the bytes live in Mooncake Store, which any of its clients reaches by name."""
        via = self.outsider(grant, how)
        name = object_name(grant.key, grant.gen, grant.epoch)
        if data is None:
            rc, blob = self.call(via, "get", key=name)
            if type(rc) is not int:
                raise AdapterError(f"get answered {rc!r:.80}")
            got = decode_value(blob, grant.key, grant.gen, grant.epoch) if rc >= 0 else None
            return got if got is not None else Refused(REASON_MISS, f"no valid object {name} (get: {rc})")
        rc = self.rc(via, "put", key=name, payload=encode_value(grant.key, grant.gen, grant.epoch, bytes(data)))
        return Stored() if rc == RC_OK else Refused(REASON_MISS, f"the store refused the put: {rc}")

    def release(self, grant: ReadGrant) -> None:
        with self._lock:
            trust = self._holder(grant.node).release(grant.key, grant.lease, self._node_now_ns(grant.node))
            if trust is None or grant.node in self._down:
                return  # not trusted (any more): the directory lets it expire
            self.logs.emit(grant.node, "release", key=grant.key, lease=grant.lease, holder=grant.node)
            _, effects = self._handle(wire.Release(NodeId(grant.node), grant.key, grant.lease))
        self._carry_out(effects)

    def _revoke_loop(self) -> None:
        while True:
            item = self._revokes.get()
            if item is None or self._stopped.is_set():
                return
            node, msg = item
            try:
                self._deliver_revoke(node, msg)
            except Exception:  # a bug here must not silence later revocations
                import traceback

                traceback.print_exc()

    def _deliver_revoke(self, node: str, msg: wire.Revoke) -> None:
        with self._lock:
            if node in self._down:
                return  # lost with the node: the lease expires instead
            if node in self._paused:
                self._held_back.setdefault(node, []).append(msg)
                return
            self._holder(node).revoked(msg.key, msg.lease, msg.gen)  # drop first, then acknowledge
            self.logs.emit(node, "drop_and_ack", key=msg.key, gen=msg.gen, lease=msg.lease, holder=node)
            _, effects = self._handle(wire.RevokeAcked(NodeId(node), msg.key, msg.lease))
        self._carry_out(effects)

    # ------------------------------------------------------------------ invalidation, eviction
    def invalidate(self, node: str, ns: Namespace, scope: str, key: BlockKey | None) -> InvalidationTicket:
        if scope not in SCOPES:
            raise NotSupported(f"invalidate scope {scope!r}")
        if (key is None) != (scope == SCOPE_NAMESPACE):
            raise ValueError(f"scope {scope!r} {'needs' if key is None else 'takes no'} key")
        self._node_up(node)
        with self._lock:
            try:
                reply, effects = self._handle(wire.Invalidate(ns.digest(), scope, key))
            except Unauthorized:
                # Nothing of a namespace this tenant may not use is touched: an empty ticket.
                t = self.core.next_ticket + 10**9 + self.next_id()
                self._noop_tickets.add(t)
                return InvalidationTicket(id=t, keys=0)
            assert isinstance(reply, wire.InvalidationStarted)
            ticket = self.core.tickets.get(reply.ticket)
            keys = 0 if ticket is None else len(ticket.keys)
        self._carry_out(effects)
        return InvalidationTicket(id=reply.ticket, keys=keys)

    def wait_invalidation(self, ticket: InvalidationTicket, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                if ticket.id in self._noop_tickets or ticket.id in self._done_tickets:
                    return True
                status = self.core.tickets.get(ticket.id)
                if status is None and ticket.id < self.core.next_ticket:
                    return True  # completed long ago and forgotten
                if status is not None and status.state == TICKET_COMPLETED and ticket.id in self._done_tickets:
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or self._stopped.is_set():
                    return False
                self._changed.wait(min(left, WAIT_POLL_S))

    def evict(self, node: str, ns: Namespace, key: BlockKey) -> Evicted | Refused:
        self._node_up(node)
        with self._lock:
            reply, effects = self._handle(wire.Evict(NodeId(node), key, LocationId(node)))
            victims: list[tuple[int, int]] = []
            if isinstance(reply, wire.Evicted):
                victims = sorted(self._objects.pop((node, key), set()))
        self._carry_out(effects)
        if isinstance(reply, wire.EvictRefused):
            return Refused(reply.reason)
        # The directory's evict step empties the slot (no Free message in the spec): the node
        # drops the bytes now.
        for gen, ep in victims:
            self._remove_object(node, key, gen, ep)
        return Evicted()

    # ------------------------------------------------------------------ faults
    def _on_killed(self, node: str) -> None:
        with self._lock:
            self._down.add(node)
            self._paused.discard(node)
            self._held_back.pop(node, None)
            self._holder(node).forget()
            for lease in [lease for lease, w in self._writing.items() if w.grant.node == node]:
                del self._writing[lease]
            self._write_in_progress = {(n, k) for n, k in self._write_in_progress if n != node}
            self.logs.emit(node, "crash")
            # The directory stops hearing from it: one term later it declares it down (spec:
            # declare_node_down), unless it rejoined first (``CoreHost.killed``).
            self._host.killed(node, [LocationId(node)])

    def _on_restarted(self, node: str) -> None:
        with self._lock:
            self.logs.new_incarnation(node)
            # The node's segment came back empty: what the directory placed there is lost.
            for k in [k for k in self._objects if k[0] == node]:
                del self._objects[k]
            declared = self._host.detect()  # declared down first, if it stayed down a term
            self._host.rejoined(node)
            # Up again before the core hears of it: what it sends the node from now on is sent
            # (and its steps logged: ``_emit_step``).
            self._down.discard(node)
            self._paused.discard(node)
            fences, effects = self.core.node_rejoined(
                NodeId(node), [LocationId(node)], self._dir_now_ms(), [LocationId(node)]
            )
            # Back, as at the server's Hello: leased and placed on again, what is owed to it sent.
            effects = declared + self._log_emits(effects)
            effects += self._log_emits(self.core.locations_up([LocationId(node)], self._dir_now_ms()))
            for key, epoch in fences.items():
                self._fence[(node, key)] = max(epoch, self._fence.get((node, key), 0))
        self._carry_out(effects)

    def pause(self, node: str) -> None:
        super().pause(node)
        with self._lock:
            self._paused.add(node)

    def _on_resumed(self, node: str) -> None:
        with self._lock:
            self._paused.discard(node)
            pending = self._held_back.pop(node, [])
        for msg in pending:
            self._revokes.put((node, msg))

    def restart_directory(self) -> None:
        """The directory crashes and restarts on its durable log (a new incarnation and clock):
        records and tickets come back, the lease table does not, and for the restart grace it
        grants nothing that could conflict with a lease it may have issued (protocol property 12)."""
        from kvcc.reference.directory.store import DirectoryStore

        with self._lock:
            early = self._host.detect()  # what the crashed incarnation declared before it crashed
            self._store.close()
            self._store = DirectoryStore(self._store_path)
            loaded = self._store.load()
            core = self._new_core(self._ctx_for_restart)
            self._host.restart(core, new_clock=True)
            self.logs.new_incarnation(DIRECTORY_LOG)
            effects = self._log_emits(
                core.restarted(loaded.records, loaded.next_lease_id, 0, loaded.tickets, loaded.next_ticket)
            )
            self._host.restore_declared()
        self._carry_out(early + effects)


def factory() -> MooncakeKvccAdapter:
    return MooncakeKvccAdapter()
