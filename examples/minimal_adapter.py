"""A complete, minimal multi-node cache and its kvcc adapter, written from ``docs/events.md``.

Theory of operation
-------------------
This is the worked example of ``docs/events.md``: a whole cache deployment in one process --
a directory (records, read and write leases, epochs, invalidation tickets), and ``ctx.nodes``
cache nodes, each with one DRAM location (``<node>/dram``), a holder (the read leases it trusts,
each for ``term - epsilon`` from when it sent the request) and a writer (its writes in
progress). It imports nothing of kvcc but the contract and the key types: no reference code, no
testing kit. Run it with::

    kvcc conform --adapter examples.minimal_adapter:factory \\
        --profile core --profile leases --profile invalidation --seed 1

(``examples.minimal_adapter:factory_inferred`` is the same cache with ``events="inferred"``:
it logs nothing and lets the suite infer events from the operations it performed.)

Messages between the pieces are plain calls made under one lock, so the order in which the
events are appended to the one list is an order consistent with causality: a request is
logged before the directory's answer, the answer before the holder acts on it. Each process
(every node, and the directory) keeps its own ``seq`` (``EventSink``). A ticker thread fires the
directory's timers on time: write leases expire, and invalidations whose last lease expired
complete (the spec makes both *urgent*: a directory may not log them late).

Every rule cited below is docs/protocol.md's property number or ``docs/events.md``'s section. The
directory scans its tables linearly (a conformance test holds a few hundred keys at most); a
deployment meant for load would index leases by key and keep its deadlines in a heap.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from attrs import define, evolve, field

from kvcc.conformance.contract import (
    Adapter,
    AdapterError,
    Capabilities,
    Committed,
    Evicted,
    InvalidationTicket,
    NotSupported,
    ReadGrant,
    Refused,
    RunContext,
    Stored,
    WriteGrant,
)
from kvcc.spec.keys import BlockKey, Namespace

ABSENT, WRITING, COMMITTED, INVALIDATING = "ABSENT", "WRITING", "COMMITTED", "INVALIDATING"
DIRECTORY = "directory"  # the directory's log name: not a cache node
LOCATION_SUFFIX = "/dram"  # "<node>/dram": the validator reads the host from the part before "/"
INCARNATION = 1  # nothing restarts in this deployment (it claims no faults)
TICK_IDLE_S = 0.02  # the ticker wakes at least this often
MS = 1_000_000  # nanoseconds per millisecond


# -- the event log -----------------------------------------------------------------------------


class EventSink:
    """Every process's log, appended to one list (docs/events.md, "Standard fields").

    ``seq`` starts at 1 and rises by one per ``(node, incarnation)``; ``t_local_ns`` is that
    process's ``time.monotonic_ns()``, ``t_wall_ns`` its ``time.time_ns()``. ``key``, ``gen``,
    ``epoch``, ``lease`` and ``result`` are on every record, ``None`` where the event has none.
    Callers hold the adapter's lock, so the list order is the order things happened."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._seq: dict[tuple[str, int], int] = {}

    def emit(self, node: str, event: str, *, key: BlockKey | None = None, gen: int | None = None,
             epoch: int | None = None, lease: int | None = None, result: str | None = None,
             **extra: Any) -> dict[str, Any]:  # fmt: skip
        log = (node, INCARNATION)
        seq = self._seq.get(log, 0) + 1
        self._seq[log] = seq
        record = {
            "node": node, "incarnation": INCARNATION, "seq": seq,
            "t_local_ns": time.monotonic_ns(), "t_wall_ns": time.time_ns(), "event": event,
            "key": None if key is None else key.hex, "gen": gen, "epoch": epoch, "lease": lease, "result": result,
            **extra,
        }  # fmt: skip
        self.records.append(record)
        return record


# -- state ---------------------------------------------------------------------------------------


@define
class _Record:
    """The directory's entry for one key."""

    key: BlockKey
    namespace: bytes  # the namespace digest the key was first written under
    parent: BlockKey | None
    phase: str = ABSENT
    gen: int = 0
    epoch: int = 0
    owner: str | None = None  # the location holding the copy
    writer: str | None = None
    write_lease: int = 0
    write_expires_ns: int = 0  # directory clock: grant + term + epsilon


@define
class _ReadLease:
    lease: int
    key: BlockKey
    holder: str
    location: str
    expires_ns: int  # directory clock: grant (or renewal) + term + epsilon


@define
class _Ticket:
    id: int
    keys: int
    pending: set = field(factory=set)


@define
class _Slot:
    """One key's bytes at one location; ``fence`` is the highest epoch the slot has seen."""

    gen: int = 0
    epoch: int = 0
    data: bytes | None = None
    fence: int = 0


@define
class _Trust:
    """A lease the holder trusts, until ``deadline_ns`` on its own clock (sent + term - epsilon)."""

    lease: int
    gen: int
    epoch: int
    location: str
    deadline_ns: int


@define
class _Write:
    """A write in progress at the writer: ``stage`` is "sent" (bytes on their way) or "stored"
    (they landed: the commit may be sent); ``sent_ns``, when the writer asked for it (its lease's
    budget, term - epsilon, counts from then)."""

    lease: int
    stage: str
    sent_ns: int


@define
class _Node:
    id: str
    location: str
    slots: dict = field(factory=dict)  # BlockKey -> _Slot
    trusts: dict = field(factory=dict)  # BlockKey -> _Trust
    writes: dict = field(factory=dict)  # BlockKey -> _Write


# -- the deployment ------------------------------------------------------------------------------


class MinimalCache(Adapter):
    """The in-process deployment of the module docstring; ``events`` is "native" or "inferred"."""

    name = "minimal-example"

    def __init__(self, events: str = "native") -> None:
        self._caps = Capabilities(
            profiles={"core", "leases", "invalidation"}, scopes={"key", "prefix", "namespace"},
            events=events, leases="enforced",
            notes="examples/minimal_adapter.py: the worked example of docs/events.md (in-process)",
        )  # fmt: skip
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._running = False
        self._ticker: threading.Thread | None = None
        self._sink = EventSink()

    # -- lifecycle -----------------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        return self._caps

    def versions(self) -> Mapping[str, str]:
        return {"adapter": f"{self.name} 1", "python": sys.version.split()[0]}

    def start(self, ctx: RunContext) -> None:
        with self._lock:
            self._term_ms, self._skew_ms = ctx.lease_term_ms, ctx.skew_ms
            self._allowed = frozenset(ns.digest() for ns in ctx.namespaces)
            self._nodes = {f"cache-{i}": _Node(f"cache-{i}", f"cache-{i}{LOCATION_SUFFIX}") for i in range(1, ctx.nodes + 1)}
            self._host = {n.location: n for n in self._nodes.values()}
            self._records: dict[BlockKey, _Record] = {}
            self._children: dict[BlockKey, set[BlockKey]] = {}
            self._leases: dict[int, _ReadLease] = {}
            self._lease_of: dict[tuple[BlockKey, str], int] = {}  # (key, holder) -> lease id
            self._next_lease = 1  # read and write leases share one id space, never reused (protocol property 8)
            self._tickets: dict[int, _Ticket] = {}
            self._next_ticket = 1
            self._landed: set[tuple[BlockKey, int]] = set()  # (key, write lease) whose bytes arrived
            self._issued: dict[tuple[BlockKey, int], str] = {}  # (key, write lease) -> the node it was granted to
            self._running = True
            self._ticker = threading.Thread(target=self._tick_loop, name="minimal-cache-ticker", daemon=True)
            self._ticker.start()

    def stop(self) -> None:
        with self._cond:
            self._running = False
            self._cond.notify_all()
        ticker = self._ticker
        if ticker is not None and ticker is not threading.current_thread():
            ticker.join(timeout=5)

    def nodes(self) -> Sequence[str]:
        return tuple(self._nodes)

    def events(self) -> list[dict] | None:
        if self._caps.events == "inferred":
            return None
        with self._lock:
            return list(self._sink.records)

    # -- plumbing ------------------------------------------------------------------------------

    def _log(self, node: str, event: str, **fields: Any) -> dict[str, Any]:
        if self._caps.events == "inferred":
            return {"t_local_ns": time.monotonic_ns()}
        return self._sink.emit(node, event, **fields)

    def _node(self, node_id: str) -> _Node:
        if not self._running:
            raise AdapterError("the deployment is not running")
        node = self._nodes.get(node_id)
        if node is None:
            raise AdapterError(f"no node {node_id!r}")
        return node

    def _budget_ns(self) -> int:
        return (self._term_ms - self._skew_ms) * MS  # holder: term - epsilon, from sending

    def _view_ns(self) -> int:
        return (self._term_ms + self._skew_ms) * MS  # directory: term + epsilon, from granting

    def _state(self, key: BlockKey, rec: _Record | None) -> dict[str, Any]:
        """The standard fields of a directory event about ``key``: its generation and epoch."""
        return {"key": key} if rec is None else {"key": key, "gen": rec.gen, "epoch": rec.epoch}

    # -- directory: time ---------------------------------------------------------------------

    def _advance(self) -> None:
        """Let the directory's time pass: read leases past term + epsilon end (silently: the
        spec has no event for it), then write leases past term + epsilon expire (an event)."""
        now = time.monotonic_ns()
        for entry in [e for e in self._leases.values() if now >= e.expires_ns]:
            self._drop_lease(entry)
        for rec in [r for r in self._records.values() if r.phase == WRITING and now >= r.write_expires_ns]:
            self._log(DIRECTORY, "expire_write_lease", **self._state(rec.key, rec), lease=rec.write_lease,
                      writer=rec.writer)  # fmt: skip
            location, epoch = rec.owner, rec.epoch
            self._end_generation(rec)
            # Deletion reaches everywhere: bytes an expired (or aborted) write left in its slot
            # are freed as an invalidation's are (KVCC-INVAL-009).
            self._free_copy(rec.key, location, epoch)

    def _next_deadline_ns(self) -> int | None:
        deadlines = [e.expires_ns for e in self._leases.values()]
        deadlines += [r.write_expires_ns for r in self._records.values() if r.phase == WRITING]
        return min(deadlines, default=None)

    def _tick_loop(self) -> None:
        with self._cond:
            while self._running:
                self._advance()
                deadline = self._next_deadline_ns()
                wait_s = TICK_IDLE_S
                if deadline is not None:
                    wait_s = min(wait_s, max(0.0, (deadline - time.monotonic_ns()) / 1e9) + 0.0005)
                self._cond.wait(wait_s)

    def _end_generation(self, rec: _Record) -> None:
        """Back to ABSENT with the next generation: the old one can never be read again."""
        rec.phase, rec.gen, rec.owner = ABSENT, rec.gen + 1, None
        rec.writer, rec.write_lease, rec.write_expires_ns = None, 0, 0

    def _drop_lease(self, entry: _ReadLease) -> None:
        del self._leases[entry.lease]
        del self._lease_of[(entry.key, entry.holder)]
        rec = self._records[entry.key]
        if rec.phase == INVALIDATING:
            self._maybe_complete(rec)

    def _live_leases(self, key: BlockKey, location: str | None = None) -> list[_ReadLease]:
        return [e for e in self._leases.values() if e.key == key and location in (None, e.location)]

    # -- data plane: writes ------------------------------------------------------------------

    def lookup(self, node: str, ns: Namespace, keys: Sequence[BlockKey]) -> int:
        with self._lock:
            self._node(node)
            self._advance()
            digest = ns.digest()
            if digest not in self._allowed:
                return 0
            count, parent = 0, None
            for key in keys:
                rec = self._records.get(key)
                if rec is None or rec.phase != COMMITTED or rec.namespace != digest or rec.parent != parent:
                    break
                count, parent = count + 1, key
            return count

    def begin_write(self, node: str, ns: Namespace, key: BlockKey, parent: BlockKey | None) -> WriteGrant | Refused:
        with self._lock:
            n = self._node(node)
            earlier = n.writes.get(key)
            if earlier is not None:
                if time.monotonic_ns() < earlier.sent_ns + self._budget_ns():
                    # The writer has one write in progress per key: no second request, no event (a
                    # local refusal: "busy", docs/events.md section 5).
                    return Refused("busy", "this node is writing the key already")
                # Its lease is over by the writer's own clock: the writer gives that write up
                # (spec: abort) and may ask again -- or it would never write the key again.
                del n.writes[key]
                self._log(node, "abort", key=key)
            sent_ns = self._log(node, "begin_write", key=key)["t_local_ns"]
            # -- the directory
            self._advance()
            digest = ns.digest()
            rec = self._records.get(key)
            reason = None
            if digest not in self._allowed or (rec is not None and rec.namespace != digest):
                reason = "unauthorized"  # protocol property 11
            elif rec is not None and rec.parent != parent:
                reason = "key_identity"  # a key's digest chains over its parent's: it has one parent
            elif rec is not None and rec.phase != ABSENT:
                reason = "not_absent"  # one writer per key and generation (protocol property 1)
            elif parent is not None:
                p = self._records.get(parent)
                if p is None or p.namespace != digest or p.phase != COMMITTED:
                    reason = "parent_not_committed"  # chains are written root first (protocol property 10)
            if reason is not None:
                self._log(DIRECTORY, "refuse_write_lease", **self._state(key, rec), writer=node,
                          result=reason)  # fmt: skip
                self._log(node, "abort", key=key)  # the writer gives up on this request
                return Refused(reason)
            if rec is None:
                rec = self._records[key] = _Record(key, digest, parent)
                if parent is not None:
                    self._children.setdefault(parent, set()).add(key)
            lease = self._next_lease
            self._next_lease += 1
            rec.phase, rec.epoch, rec.owner = WRITING, rec.epoch + 1, n.location  # a new epoch (protocol property 2)
            rec.writer, rec.write_lease = node, lease
            rec.write_expires_ns = time.monotonic_ns() + self._view_ns()
            self._log(DIRECTORY, "grant_write_lease", **self._state(rec.key, rec), lease=lease, writer=node,
                      location=rec.owner, parent=None if parent is None else parent.hex, namespace=digest.hex())  # fmt: skip
            self._cond.notify_all()  # a new deadline for the ticker
            # -- the writer: the grant arrives, the bytes leave at once (spec: start_writing)
            n.writes[key] = _Write(lease, "sent", sent_ns)
            self._issued[(key, lease)] = node
            self._log(node, "start_writing", key=key, gen=rec.gen, epoch=rec.epoch, lease=lease, location=rec.owner)
            return WriteGrant(node, key, rec.gen, rec.epoch, lease, rec.owner, self._term_ms, sent_ns)

    def write_bytes(self, grant: WriteGrant, data: bytes) -> Stored | Refused:
        with self._lock:
            writer = self._node(grant.node)
            host = self._host.get(grant.location)
            if host is None:
                return Refused("not_found", f"no location {grant.location!r}")
            if self._issued.get((grant.key, grant.lease)) != grant.node:
                # The data plane enforces what the control plane granted (protocol property 13):
                # bytes land only from the node the grant was issued to.
                return Refused("not_found", f"write lease {grant.lease} was not granted to {grant.node}")
            if (grant.key, grant.lease) in self._landed:
                # A grant's bytes are sent once (with start_writing): they land at most once.
                return Refused("busy", "the bytes of this grant were delivered already")
            self._landed.add((grant.key, grant.lease))
            slot = host.slots.setdefault(grant.key, _Slot())
            fields = dict(key=grant.key, gen=grant.gen, epoch=grant.epoch, lease=grant.lease, writer=grant.node,
                          location=grant.location)  # fmt: skip
            waiting = writer.writes.get(grant.key)
            waiting = waiting if waiting is not None and waiting.lease == grant.lease else None
            if grant.epoch < slot.fence:
                # A stale writer is refused where the data lives, whatever it believes (protocol property 2).
                self._log(host.id, "fence_stale_write", **fields, result="fenced", fence=slot.fence)
                if waiting is not None:
                    del writer.writes[grant.key]  # the writer learns its write is over
                return Refused("fenced", f"fence {slot.fence} > epoch {grant.epoch}")
            host.slots[grant.key] = _Slot(grant.gen, grant.epoch, bytes(data), max(slot.fence, grant.epoch))
            self._log(host.id, "store_bytes", **fields)
            if waiting is not None:
                waiting.stage = "stored"
            return Stored()

    def commit(self, grant: WriteGrant) -> Committed | Refused:
        with self._lock:
            n = self._node(grant.node)
            w = n.writes.get(grant.key)
            if w is None or w.lease != grant.lease or w.stage != "stored":
                # No commit leaves a writer whose bytes did not land under this grant (aborted,
                # fenced, never sent): the spec's writer sends Commit only when they did.
                return Refused("not_found", "no bytes stored under this grant")
            del n.writes[grant.key]
            # -- the directory
            self._advance()
            rec = self._records.get(grant.key)
            reason = None
            if rec is None or rec.phase != WRITING or rec.write_lease != grant.lease:
                reason = "unknown_lease"  # expired, voided by an invalidation, or never granted
            elif rec.epoch != grant.epoch:
                reason = "stale_epoch"
            if reason is not None:
                self._log(DIRECTORY, "reject_stale_commit", **self._state(grant.key, rec),
                          lease=grant.lease, writer=grant.node, result=reason)  # fmt: skip
                return Refused(reason)
            rec.phase, rec.writer, rec.write_lease, rec.write_expires_ns = COMMITTED, None, 0, 0
            self._log(DIRECTORY, "commit_write", **self._state(rec.key, rec), lease=grant.lease, writer=grant.node,
                      location=rec.owner)  # fmt: skip
            return Committed(rec.gen, rec.epoch)

    def abort(self, grant: WriteGrant) -> None:
        with self._lock:
            n = self._nodes.get(grant.node)
            w = None if n is None else n.writes.get(grant.key)
            if w is None or w.lease != grant.lease:
                return  # already over: idempotent
            del n.writes[grant.key]
            if w.stage == "sent":
                # The writer gives up; the directory is not told: the key stays WRITING until
                # the write lease expires (term + epsilon), then it is ABSENT again.
                self._log(grant.node, "abort", key=grant.key, gen=grant.gen, epoch=grant.epoch, lease=grant.lease)
            # stage "stored": the commit was sent in the spec's sense; it is simply never
            # delivered, and the write lease expires likewise.

    # -- data plane: reads -------------------------------------------------------------------

    def _trusted(self, n: _Node, key: BlockKey, lease: int | None = None) -> _Trust | None:
        """The holder's trust in its lease on ``key``, dropped once its own deadline passed."""
        trust = n.trusts.get(key)
        if trust is not None and time.monotonic_ns() >= trust.deadline_ns:
            del n.trusts[key]  # the budget ran out: no event (the spec's tick)
            trust = None
        if trust is None or (lease is not None and trust.lease != lease):
            return None
        return trust

    def acquire(self, node: str, ns: Namespace, key: BlockKey) -> ReadGrant | Refused:
        with self._lock:
            n = self._node(node)
            if self._trusted(n, key) is not None:
                return Refused("already_leased", "this node holds a lease on the key: renew it")
            sent_ns = self._log(node, "acquire", key=key)["t_local_ns"]  # the budget starts now
            # -- the directory
            self._advance()
            digest = ns.digest()
            rec = self._records.get(key)
            if digest not in self._allowed or (rec is not None and rec.namespace != digest):
                reason = "unauthorized"
            elif rec is None or rec.phase != COMMITTED:
                reason = "invalidating" if rec is not None and rec.phase == INVALIDATING else "not_committed"
            elif (key, node) in self._lease_of:
                reason = "already_leased"
            else:
                reason = None
            if reason is not None:
                self._log(DIRECTORY, "refuse_read_lease", **self._state(key, rec), holder=node,
                          result=reason)  # fmt: skip
                self._log(node, "abandon", key=key)  # the holder stops waiting
                return Refused(reason)
            assert rec is not None and rec.owner is not None
            lease = self._next_lease
            self._next_lease += 1
            entry = _ReadLease(lease, key, node, rec.owner, time.monotonic_ns() + self._view_ns())
            self._leases[lease] = entry
            self._lease_of[(key, node)] = lease
            self._log(DIRECTORY, "grant_read_lease", **self._state(rec.key, rec), lease=lease, holder=node,
                      location=rec.owner)  # fmt: skip
            # -- the holder: trusts it for term - epsilon from when it sent the request -- unless
            # that budget ran out before the grant came: the request was given up (docs/events.md)
            if time.monotonic_ns() >= sent_ns + self._budget_ns():
                return Refused("lease_expired", "the grant came after the request's budget ran out")
            n.trusts[key] = _Trust(lease, rec.gen, rec.epoch, rec.owner, sent_ns + self._budget_ns())
            self._log(node, "trust_read_lease", key=key, gen=rec.gen, epoch=rec.epoch, lease=lease, location=rec.owner)
            return ReadGrant(node, key, rec.gen, rec.epoch, lease, rec.owner, self._term_ms, sent_ns)

    def renew(self, grant: ReadGrant) -> ReadGrant | Refused:
        with self._lock:
            n = self._node(grant.node)
            trust = self._trusted(n, grant.key, grant.lease)
            if trust is None:
                return Refused("lease_expired", "the holder no longer trusts this lease")  # no event
            sent_ns = self._log(grant.node, "renew", key=grant.key, lease=grant.lease)["t_local_ns"]
            # -- the directory
            self._advance()
            rec = self._records[grant.key]
            entry = self._leases.get(self._lease_of.get((grant.key, grant.node), 0))
            if entry is None or entry.lease != grant.lease:
                reason = "unknown_lease"  # renewal never revives a lease (protocol property 8)
            elif rec.phase != COMMITTED:
                reason = "invalidating" if rec.phase == INVALIDATING else "not_committed"
            else:
                reason = None
            if reason is not None:
                self._log(DIRECTORY, "refuse_renewal", **self._state(rec.key, rec), lease=grant.lease,
                          holder=grant.node, result=reason)  # fmt: skip
                self._log(grant.node, "abandon", key=grant.key)
                return Refused(reason)
            entry.expires_ns = time.monotonic_ns() + self._view_ns()
            self._log(DIRECTORY, "renew_lease", **self._state(rec.key, rec), lease=grant.lease, holder=grant.node)
            # -- the holder: the new budget counts from when the renewal was sent
            trust.deadline_ns = sent_ns + self._budget_ns()
            self._log(grant.node, "trust_renewal", key=grant.key, gen=trust.gen, epoch=trust.epoch, lease=grant.lease)
            return evolve(grant, term_ms=self._term_ms, requested_at_ns=sent_ns)

    def read(self, grant: ReadGrant) -> bytes | Refused:
        with self._lock:
            n = self._node(grant.node)
            trust = self._trusted(n, grant.key, grant.lease)
            if trust is None:
                return Refused("lease_expired", "no trusted lease")  # nothing is read: no event
            host = self._host[trust.location]
            slot = host.slots.get(grant.key)
            data = slot.data if slot is not None and slot.gen == trust.gen else None
            self._log(grant.node, "read", key=grant.key, gen=trust.gen, epoch=trust.epoch, lease=trust.lease,
                      location=trust.location, result="ok" if data is not None else "miss")  # fmt: skip
            return data if data is not None else Refused("miss")

    def release(self, grant: ReadGrant) -> None:
        with self._lock:
            n = self._nodes.get(grant.node)
            if n is None or not self._running or self._trusted(n, grant.key, grant.lease) is None:
                return  # expired, revoked or released already: idempotent
            del n.trusts[grant.key]  # stop trusting first, then tell the directory
            self._log(grant.node, "release", key=grant.key, lease=grant.lease)
            self._advance()
            entry = self._leases.get(self._lease_of.get((grant.key, grant.node), 0))
            if entry is not None and entry.lease == grant.lease:
                self._log(DIRECTORY, "release_lease", **self._state(grant.key, self._records[grant.key]),
                          lease=grant.lease, holder=grant.node)  # fmt: skip
                self._drop_lease(entry)  # may complete an invalidation: a later step

    # -- invalidation and eviction -----------------------------------------------------------

    def _subtree(self, key: BlockKey) -> list[BlockKey]:
        out, todo = [], [key]
        while todo:
            k = todo.pop()
            if k not in out:
                out.append(k)
                todo.extend(sorted(self._children.get(k, ())))
        return out

    def invalidate(self, node: str, ns: Namespace, scope: str, key: BlockKey | None) -> InvalidationTicket:
        with self._lock:
            self._node(node)
            if scope not in self._caps.scopes:
                raise NotSupported(f"invalidate scope {scope}")
            self._advance()
            digest = ns.digest()
            keys: list[BlockKey] = []
            if digest in self._allowed:
                if scope == "namespace":
                    keys = sorted(k for k, r in self._records.items() if r.namespace == digest)
                else:
                    # "key" and "prefix" are one operation: the key and its whole prefix subtree.
                    rec = self._records.get(key)
                    keys = self._subtree(key) if rec is not None and rec.namespace == digest else []
            roots = keys if scope == "namespace" else keys[:1]
            voids = any(self._records[k].phase == COMMITTED for k in roots)
            ticket = _Ticket(self._next_ticket, 0)
            self._next_ticket += 1
            self._tickets[ticket.id] = ticket
            if voids:
                # The step that voids them first; what it lets complete at once comes after.
                if scope == "namespace":
                    self._log(DIRECTORY, "invalidate_namespace", namespace=digest.hex(), ticket=ticket.id)
                else:
                    self._log(DIRECTORY, "invalidate", key=key, scope=scope, ticket=ticket.id)
            revocations = []
            for k in keys:
                rec = self._records[k]
                if voids and rec.phase == COMMITTED:
                    rec.phase = INVALIDATING  # no new lease from here on
                    revocations += self._live_leases(k)
                elif voids and rec.phase == WRITING:
                    self._end_generation(rec)  # the write below a voided prefix: its commit finds it gone
                    ticket.keys += 1
                    continue
                if rec.phase == INVALIDATING:
                    ticket.pending.add(k)
                    ticket.keys += 1
            for entry in revocations:
                self._revoke(entry)  # each holder drops its trust, then acknowledges
            for k in sorted(ticket.pending):
                self._maybe_complete(self._records[k])
            return InvalidationTicket(ticket.id, ticket.keys)

    def _revoke(self, entry: _ReadLease) -> None:
        """Deliver a revocation to the holder: drop the trust first, then acknowledge (protocol property 7)."""
        n = self._nodes[entry.holder]
        trust = n.trusts.get(entry.key)
        if trust is not None and trust.lease == entry.lease:
            del n.trusts[entry.key]
        self._log(n.id, "drop_and_ack", key=entry.key, lease=entry.lease)
        # -- the directory takes the acknowledgement
        if self._leases.get(entry.lease) is entry:
            self._log(DIRECTORY, "revoke_acked", **self._state(entry.key, self._records[entry.key]), lease=entry.lease,
                      holder=entry.holder)  # fmt: skip
            self._drop_lease(entry)

    def _maybe_complete(self, rec: _Record) -> None:
        """Complete the invalidation of ``rec`` once no lease on it is live (protocol property 6): the
        generation ends, then the copy is freed at its location under the key's epoch."""
        if rec.phase != INVALIDATING or self._live_leases(rec.key):
            return
        owner = rec.owner
        self._log(DIRECTORY, "complete_invalidation", **self._state(rec.key, rec))
        epoch = rec.epoch
        self._end_generation(rec)
        self._free_copy(rec.key, owner, epoch)
        for ticket in self._tickets.values():
            ticket.pending.discard(rec.key)
        self._cond.notify_all()

    def _free_copy(self, key: BlockKey, location: str | None, epoch: int) -> None:
        """Free an ended generation's copy at ``location``: the location judges the free by its
        epoch, like bytes (protocol property 2); the fence stays."""
        host = self._host.get(location) if location is not None else None
        if host is None:
            return
        slot = host.slots.get(key)
        if slot is None:
            return  # nothing was stored there: nothing to free
        if epoch >= slot.fence:
            host.slots[key] = _Slot(fence=slot.fence)
            self._log(host.id, "free_slot", key=key, epoch=epoch, location=location, result="ok")
        else:
            self._log(host.id, "fence_stale_free", key=key, epoch=epoch, location=location, fence=slot.fence)

    def wait_invalidation(self, ticket: InvalidationTicket, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            t = self._tickets.get(ticket.id)
            if t is None:
                raise AdapterError(f"no ticket {ticket.id}")
            while t.pending:
                if not self._running:
                    raise AdapterError("the deployment stopped")
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, TICK_IDLE_S))
            return True

    def evict(self, node: str, ns: Namespace, key: BlockKey) -> Evicted | Refused:
        with self._lock:
            n = self._node(node)
            self._advance()
            rec = self._records.get(key)
            if rec is None or ns.digest() not in self._allowed or rec.namespace != ns.digest():
                return Refused("not_found")
            if rec.phase != COMMITTED:
                return Refused("invalidating" if rec.phase == INVALIDATING else "not_committed")
            if rec.owner != n.location:
                return Refused("not_found", "this node holds no copy the directory knows of")
            if any(self._records[c].phase != ABSENT for c in self._children.get(key, ())):
                return Refused("has_children")  # leaves before their ancestors (protocol property 10)
            if self._live_leases(key, n.location):
                # The one refusal that is a spec step (evict_refused): a live lease on the copy.
                self._log(DIRECTORY, "evict_refused", **self._state(rec.key, rec), location=n.location, result="leased")
                return Refused("leased")  # protocol property 5
            self._log(DIRECTORY, "evict", **self._state(rec.key, rec), location=n.location)
            # The node drops the bytes once the directory agreed (part of the evict step: no
            # event of its own); the slot keeps its fence.
            n.slots[key] = _Slot(fence=n.slots[key].fence if key in n.slots else rec.epoch)
            self._end_generation(rec)  # the last copy is gone: ABSENT again
            return Evicted()


def factory() -> MinimalCache:
    """``--adapter examples.minimal_adapter:factory``: native events."""
    return MinimalCache("native")


def factory_inferred() -> MinimalCache:
    """``--adapter examples.minimal_adapter:factory_inferred``: the suite infers the events."""
    return MinimalCache("inferred")
