"""The suite's view of one test: every call to the adapter recorded, checked and counted.

Theory of operation
-------------------
A workload never calls the adapter directly: it calls a ``Session``, which forwards each
operation, checks that the answer is a value of the contract (anything else is
``GarbageAnswer`` -> ERROR), appends it to the *history*, and applies the oracles that hold in
every test whatever it does:

- **exact bytes** (protocol property 4): a read that returns bytes must return exactly what the suite wrote
  under the grant that committed that (key, generation). A generation is *possibly committed*
  from the moment the suite calls ``commit`` (the directory may commit it long before the answer
  arrives): a read overlapping the call may return its bytes, and FAILs only if the commit is
  then refused. A (key, generation) committed under two write leases FAILs (protocol property 1);
- **no stale read** (protocol properties 6/7): once the suite saw an invalidation of a key complete, no read
  under a lease of an older generation may return bytes;
- **holder deadline** (docs/protocol.md leases): no read may return bytes when it started after the
  holder's own deadline (requested_at + term - epsilon), with epsilon of slack for the holder's
  clock; requested_at is taken as late as it can be (when the grant reached the suite), so a
  request that waited before it was sent is never mistaken for a holder that trusts too long;
- **fresh lease ids** (protocol property 8): no grant may carry a lease id granted before in the test.

A violation raises ``OracleFailure`` (FAIL) naming the rule and the history index. Per-test
oracles are ``Session.check`` calls in the workloads.

The session also counts what the audits need (``Audit``): remote leased hits, evictions,
evictions refused under a live lease, stale writes fenced, invalidations completed by
acknowledgement and by expiry.

For an adapter whose events are ``"inferred"`` the session builds the trace from what it saw:
the spec actions each call and its answer imply, on the party that performed them -- the
holder's or writer's request, the directory's decision (``grant_*`` / ``refuse_*``,
``commit_write``, ``evict``, ``invalidate`` ...), the location's ``store_bytes`` -- in causal
order. What the suite cannot see is inferred from what it can: an invalidation it saw complete
revoked every lease it still held on a voided key (``drop_and_ack`` / ``revoke_acked``, unless
the holder's own deadline had passed, or a directory restart lost the lease table: then it
completed by expiry) and then completed each voided generation; an answer that shows a key
ABSENT (a new write granted, its parent's last copy evicted) shows that its write lease expired
or its invalidation completed first; a refused commit of the write the directory still had open
shows that lease expired; a fenced write shows the Free of its ended write reached the location;
a refusal a correct client gives without asking (a lease it no longer trusts, a second lease or
write of a key it is busy with) implies no event at all.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from attrs import define, field

from kvcc.spec.keys import BlockKey, Namespace
from kvcc.spec.vocabulary import (
    REASON_ALREADY_LEASED,
    REASON_BUSY,
    REASON_FENCED,
    REASON_INVALIDATING,
    REASON_KEY_IDENTITY,
    REASON_LEASE_EXPIRED,
    REASON_LEASED,
    REASON_LOCATION_DOWN,
    REASON_MISS,
    REASON_NOT_ABSENT,
    REASON_NOT_COMMITTED,
    REASON_NOT_FOUND,
    REASON_NOT_OWNER,
    REASON_PARENT_NOT_COMMITTED,
    REASON_STALE_EPOCH,
    REASON_UNKNOWN_LEASE,
    REASON_WRONG_GENERATION,
    REASON_WRONG_SHARD,
    location_host,
)

from .contract import (
    Adapter,
    Committed,
    Completion,
    Evicted,
    InvalidationTicket,
    Moving,
    ReadGrant,
    Refused,
    Stored,
    WriteGrant,
)

INFERRED_INCARNATION = 0  # a node's first incarnation in an inferred trace (a restart takes the next)
INFERRED_DIRECTORY = "directory"  # the node name of the directory's inferred events
# Refusals a correct client gives on its own, without asking the directory (no event).
LOCAL_REFUSALS = frozenset({REASON_ALREADY_LEASED, REASON_BUSY})
LATE_GRANT_RETRIES = 3  # acquires answered lease_expired (a grant after the request's budget), asked again


class OracleFailure(AssertionError):
    """The adapter's behaviour broke a rule: the test FAILs."""

    def __init__(self, rule: str, detail: str, history_index: int | None = None) -> None:
        super().__init__(f"{rule}: {detail}" + ("" if history_index is None else f" (history #{history_index})"))
        self.rule = rule
        self.detail = detail
        self.history_index = history_index


class GarbageAnswer(Exception):
    """The adapter answered with something that is not a value of the contract: ERROR."""


@define
class Audit:
    remote_hits: int = 0
    hits: int = 0
    evictions: int = 0
    refused_evictions_leased: int = 0
    fenced_writes: int = 0
    stale_commits_refused: int = 0
    invalidations_by_ack: int = 0
    invalidations_by_expiry: int = 0

    def add(self, other: Audit) -> None:
        for name in self.__attrs_attrs__:
            setattr(self, name.name, getattr(self, name.name) + getattr(other, name.name))

    def to_json(self) -> dict[str, int]:
        return {a.name: getattr(self, a.name) for a in self.__attrs_attrs__}


def _ordered(method: Callable) -> Callable:
    """In inferred mode, one operation at a time, its inferred events logged before the next
    starts: the order of the inferred directory log is then the order the adapter decided in (a
    native trace carries its own order, so native adapters keep full concurrency). An
    invalidation whose wait came back complete is logged first: the next operation may already
    see it complete (the lock is not fair, and the wait's own thread may be the last to get it)."""

    @functools.wraps(method)
    def in_order(self: Session, *args: Any, **kwargs: Any) -> Any:
        if not self.infer:
            return method(self, *args, **kwargs)
        with self.order:
            self._infer_due_completions()
            return method(self, *args, **kwargs)

    return in_order


@define
class Session:
    """What a workload gets: the adapter behind a recording proxy, the run's parameters and a
    seeded random source. ``ns`` is the test's authorised namespace(s), randomised per run;
    ``foreign`` one that is not authorised."""

    adapter: Adapter
    rng: Any
    namespaces: tuple[Namespace, ...]
    foreign: Namespace
    nodes: tuple[str, ...]
    lease_term_ms: int
    skew_ms: int
    history: list[dict] = field(factory=list)
    audit: Audit = field(factory=Audit)
    lock: Any = field(factory=threading.Lock)
    committed: dict = field(factory=dict)  # (key, gen) -> (bytes, writer node, write lease)
    committing: dict = field(factory=dict)  # (key, gen) -> {write lease: (bytes, writer node)} while commit runs
    read_while_committing: dict = field(factory=dict)  # (key, gen, lease) -> history index of the first such read
    pending_bytes: dict = field(factory=dict)  # (key, lease) -> bytes stored
    invalidated_below: dict = field(factory=dict)  # key -> [(generations below this are void, from this suite time)]
    lease_ids: dict = field(factory=dict)  # lease id -> history index of its grant
    # The holder's deadline is requested_at + term - epsilon on its clock, and the suite does not
    # see when the request left: somewhere between the call's start and its answer. A read is
    # judged against the latest the deadline can be (the answer's time: never a false FAIL under
    # load, when a call waits long before it is sent), an early completion against the earliest.
    deadlines_ns: dict = field(factory=dict)  # (node, lease) -> latest holder deadline (suite clock)
    earliest_deadlines_ns: dict = field(factory=dict)  # (node, lease) -> earliest holder deadline
    snapshots: dict = field(factory=dict)  # ticket id -> {key: top generation committed at its start}
    voiding: dict = field(factory=dict)  # ticket id -> {key: generation it voids}, until it completes (inference)
    voiding_since: dict = field(factory=dict)  # ticket id -> suite time its invalidate call started
    inferred: list[dict] = field(factory=list)
    infer: bool = False
    # What inference needs to know beyond the oracles' state:
    parents: dict = field(factory=dict)  # key -> parent key (None for a root), from begin_write
    key_ns: dict = field(factory=dict)  # key -> namespace digest
    writing: dict = field(factory=dict)  # (key, write lease) -> the grant, until its bytes land or are fenced
    read_grants: dict = field(factory=dict)  # (node, read lease) -> the grant, while the holder trusts it
    copies: dict = field(factory=dict)  # key -> location of its committed copy
    lost_at: dict = field(factory=dict)  # key -> inferred stamp of the node restart that lost its copy
    incarnations: dict = field(factory=dict)  # node -> incarnation of its inferred log
    open_writes: dict = field(factory=dict)  # key -> its uncommitted write grant at the directory
    completed: dict = field(factory=dict)  # key -> every generation below this completed an invalidation
    down: set = field(factory=set)  # nodes killed and not restarted
    crashed_at: dict = field(factory=dict)  # node killed, not restarted nor declared down -> stamp of its crash
    declared_at: dict = field(factory=dict)  # node declared down and not restarted -> stamp of the declaration
    dead_grants: dict = field(factory=dict)  # (node, read lease) of a killed holder -> (grant, when the directory drops it)
    stored_epochs: dict = field(factory=dict)  # (key, location) -> highest epoch whose bytes landed there
    due_completions: list = field(factory=list)  # tickets whose wait came back complete, not yet logged
    forgotten: set = field(factory=set)  # (node, read lease) the directory's lease table lost in a restart
    seqs: dict = field(factory=dict)  # (node, incarnation) -> last seq
    stopped: Any = field(factory=threading.Event)
    order: Any = field(factory=threading.RLock)  # see _ordered

    # -- plumbing --------------------------------------------------------------------------------

    @property
    def ns(self) -> Namespace:
        return self.namespaces[0]

    @property
    def term_s(self) -> float:
        return self.lease_term_ms / 1000

    def _record(self, op: str, node: str | None, args: dict, result: Any, t0: int) -> int:
        with self.lock:
            i = len(self.history)
            self.history.append({"i": i, "t_ns": t0, "dt_ns": time.monotonic_ns() - t0, "op": op, "node": node,
                                 **args, "result": _summary(result)})  # fmt: skip
            return i

    def _emit(self, node: str, event: str, **fields: Any) -> None:
        if not self.infer:
            return
        if self.down:
            self._infer_what_fell_due()
        with self.lock:
            inc = self.incarnations.get(node, INFERRED_INCARNATION)
            seq = self.seqs[(node, inc)] = self.seqs.get((node, inc), 0) + 1
            rec = {"node": node, "incarnation": inc, "seq": seq, "t_local_ns": time.monotonic_ns(),
                   "t_wall_ns": time.time_ns(), "event": event, "key": None, "gen": None, "epoch": None, "lease": None,
                   "result": None, "inferred": True}  # fmt: skip
            for k, v in fields.items():
                rec[k] = v.hex if isinstance(v, BlockKey) else v
            self.inferred.append(rec)

    def _emit_dir(self, event: str, **fields: Any) -> None:
        self._emit(INFERRED_DIRECTORY, event, **fields)

    def _live_at_directory(self, node: str, lease: int, at_ns: int) -> bool:
        """Whether the directory may still hold ``lease`` live at ``at_ns``: granted (or renewed)
        no earlier than the call's start, live for term + epsilon after, and not lost with the
        lease table in a directory restart since (then it can only run out at its holder)."""
        earliest = self.earliest_deadlines_ns.get((node, lease))
        if (node, lease) not in self.read_grants or (node, lease) in self.forgotten or earliest is None:
            return False
        return at_ns < earliest + 2 * self.skew_ms * 1_000_000

    def _trusted_ns(self, node: str, lease: int, now_ns: int) -> bool:
        """Whether a correct holder still trusts ``lease`` at ``now_ns`` (suite clock): granted,
        not released or revoked, its own deadline not passed."""
        deadline = self.deadlines_ns.get((node, lease))
        return deadline is not None and (node, lease) in self.read_grants and now_ns < deadline

    def check(self, condition: bool, rule: str, detail: str) -> None:
        """A per-test oracle: FAIL with ``rule`` unless ``condition``."""
        if not condition:
            raise OracleFailure(rule, detail, len(self.history) - 1 if self.history else None)

    def sleep_ms(self, ms: float) -> None:
        if self.stopped.wait(ms / 1000):
            raise TimeoutError("the test was stopped")

    def fresh_tokens(self, blocks: int, ns: Namespace | None = None) -> list[int]:
        ns = ns or self.ns
        return [self.rng.randrange(1, 1 << 31) for _ in range(blocks * ns.block_tokens)]

    def payload(self, size: int | None = None) -> bytes:
        n = size if size is not None else self.rng.randrange(64, 2048)
        return self.rng.randbytes(n)

    # -- the contract, recorded --------------------------------------------------------------------

    def lookup(self, node: str, ns: Namespace, keys: Sequence[BlockKey]) -> int:
        t0 = time.monotonic_ns()
        n = self.adapter.lookup(node, ns, list(keys))
        if type(n) is not int or not 0 <= n <= len(keys):
            raise GarbageAnswer(f"lookup answered {n!r:.80}")
        self._record("lookup", node, {"keys": len(keys)}, n, t0)
        return n

    @_ordered
    def begin_write(self, node: str, ns: Namespace, key: BlockKey, parent: BlockKey | None) -> WriteGrant | Refused:
        t0 = time.monotonic_ns()
        if self.infer:
            with self.lock:
                self.parents.setdefault(key, parent)
                self.key_ns.setdefault(key, ns.digest())
        # The request is logged when it leaves, unless the answer says the client never sent it.
        sent = self._emit_later(node, "begin_write", key=key)
        g = self.adapter.begin_write(node, ns, key, parent)
        _expect(g, (WriteGrant, Refused), "begin_write")
        i = self._record("begin_write", node, {"key": key.hex}, g, t0)
        parent_hex = None if parent is None else parent.hex
        if isinstance(g, WriteGrant) or g.reason not in LOCAL_REFUSALS:
            self._infer_given_up(node, key)
        if isinstance(g, WriteGrant):
            self._check_grant(g, node, key, i)
            sent()
            self._infer_key_free(key, g)
            self._emit_dir("grant_write_lease", key=key, gen=g.gen, epoch=g.epoch, lease=g.lease, writer=node,
                           location=g.location, parent=parent_hex, namespace=ns.digest().hex())  # fmt: skip
            self._backdate_newest(self._answered_ns(i))  # at the answer
            self._emit(node, "start_writing", key=key, gen=g.gen, epoch=g.epoch, lease=g.lease, location=g.location)
            with self.lock:
                self.writing[(key, g.lease)] = g
        elif g.reason not in LOCAL_REFUSALS:
            sent()
            self._emit_dir("refuse_write_lease", key=key, writer=node, result=g.reason, parent=parent_hex)
            self._emit(node, "abort", key=key)  # the client gives up on this write
        return g

    def _infer_given_up(self, node: str, key: BlockKey) -> None:
        """``node`` asked for a new write of ``key`` while its earlier grant of it had sent no
        bytes: it gave that write up first (spec: abort) -- a writer has one write of a key at a
        time, and asks again only once the earlier one is over by its own clock."""
        if not self.infer:
            return
        with self.lock:
            given_up = [g for (k, _), g in sorted(self.writing.items(), key=lambda kv: kv[0][1])
                        if k == key and g.node == node]  # fmt: skip
            for g in given_up:
                del self.writing[(key, g.lease)]
        for g in given_up:
            self._emit(node, "abort", key=key, gen=g.gen, epoch=g.epoch, lease=g.lease)

    def _infer_key_free(self, key: BlockKey, grant: WriteGrant) -> None:
        """A new write of ``key`` was granted, so the key was ABSENT (``_infer_absent``)."""
        if not self.infer:
            return
        self._infer_absent(key)
        with self.lock:
            self.open_writes[key] = grant

    def _infer_absent(self, key: BlockKey) -> None:
        """The directory's answer shows ``key`` ABSENT (a write of it was granted, or its parent's
        last copy evicted): what made it so and the suite could not see happened first -- its
        write lease expired, or a committed generation was invalidated and completed (its copy
        lost in a crash, or its invalidation's wait not yet back at the suite)."""
        acks: list[ReadGrant] = []
        with self.lock:
            earlier = self.open_writes.pop(key, None)
            tops = [gen for (k, gen) in self.committed if k == key and gen >= self.completed.get(key, 0)]
            if tops:
                self.completed[key] = max(tops) + 1
                # Its leases were revoked and acknowledged, or ran out, before it completed.
                since = min([t for tid, t in self.voiding_since.items() if key in self.voiding.get(tid, ())],
                            default=time.monotonic_ns())  # fmt: skip
                acks = [g for (n, lease), g in sorted(self.read_grants.items(), key=lambda kv: kv[0][1])
                        if g.key == key and g.gen <= max(tops) and self._live_at_directory(n, lease, since)]  # fmt: skip
                for g in acks:
                    self.read_grants.pop((g.node, g.lease), None)
                for voided in self.voiding.values():
                    voided.pop(key, None)  # completed: no longer INVALIDATING for later invalidations
        if earlier is not None:
            self._emit_write_expired(earlier)
        if tops:
            self._emit_acks(acks)
            self._emit_dir("complete_invalidation", key=key, gen=max(tops))
            if not acks and earlier is None:
                self._stamp_completion_when_due(key, max(tops))

    def _stamp_completion_when_due(self, key: BlockKey, top: int) -> None:
        """Stamp the newest inferred event, the completion of ``key`` whose last copy a node
        restart lost, when it was due: at that restart, or when the last lease on the key that
        the directory may still have held then ran out (``_live_at_directory``'s bound), if
        later -- not when the suite learnt of it from a later grant: the spec's completion is
        urgent, so one stamped a stalled call later (a lease request that stalled past a term
        before it left, KVCC-FAULT-017 in inferred mode) reads as a step logged too late."""
        with self.lock:
            lost = self.lost_at.pop(key, None)
            if lost is None:
                return
            ends = [self.earliest_deadlines_ns[(n, lease)] + 2 * self.skew_ms * 1_000_000
                    for (n, lease), g in self.read_grants.items()
                    if g.key == key and g.gen <= top and (n, lease) in self.earliest_deadlines_ns
                    and (n, lease) not in self.forgotten]  # fmt: skip
            self._place_newest(max([lost, *ends]))

    def _infer_what_fell_due(self) -> None:
        """The directory's urgent steps that fell due while a node was dead, inferred and stamped
        when they were due, before any later event: a correct directory took them then, though
        nothing the suite did showed it (a kill and a restart a term apart on a loaded machine:
        KVCC-FAULT-006, -008, -009 and -015 in inferred mode) --

        - the write lease of a dead writer ran out, term + epsilon after its grant
          (``expire_write_lease_of_crashed``);
        - a dead node's failure-detection time, one term from its crash, ran out
          (``declare_node_down``);
        - an invalidation waiting only on dead holders' leases completed once the last of them
          ran out, or was forgotten by their node's restart (``complete_invalidation``)."""
        now = time.monotonic_ns()
        span = self.lease_term_ms * 1_000_000
        with self.lock:
            expired = [g for g in self.open_writes.values() if g.node in self.down
                       and (self._write_due_ns(g.lease) or now) < now]  # fmt: skip
            for g in expired:
                del self.open_writes[g.key]
            declared = sorted((at + span, node) for node, at in self.crashed_at.items() if at + span < now)
            for _, node in declared:
                del self.crashed_at[node]
            completed = self._completions_due(now)
        for g in expired:
            self._emit_write_expired(g)
        for at, node in declared:
            self._emit_dir("declare_node_down", down=node, locations=[node])
            with self.lock:
                self._place_newest(at)
                self.declared_at[node] = at
        for at, voided in completed:
            for key, gen in voided.items():
                self._emit_dir("complete_invalidation", key=key, gen=gen)
                with self.lock:
                    self._place_newest(at)

    def _completions_due(self, now: int) -> list[tuple[int, dict]]:
        """The invalidations held up only by dead holders' leases whose completion fell due
        before ``now`` (under ``lock``): each one's time and the generations it voided, taken out
        of ``voiding`` as completed. One a live holder may still acknowledge is left to its wait."""
        out = []
        for tid, voided in list(self.voiding.items()):
            keys = {k: gen for k, gen in voided.items() if gen >= self.completed.get(k, 0)}
            since = self.voiding_since.get(tid, 0)
            if not keys or any(g.key in keys and g.gen <= keys[g.key] and self._live_at_directory(n, lease, since)
                               for (n, lease), g in self.read_grants.items()):  # fmt: skip
                continue
            ends = [end for g, end in self.dead_grants.values() if g.key in keys and g.gen <= keys[g.key] and end > since]
            if not ends or max(ends) >= now:
                continue  # nothing held it up (it completed at once), or not yet
            del self.voiding[tid]
            self.voiding_since.pop(tid, None)
            for key, gen in keys.items():
                self.completed[key] = max(self.completed.get(key, 0), gen + 1)
            out.append((max(ends), keys))
        return out

    def _emit_write_expired(self, grant: WriteGrant) -> None:
        """The directory's timer ended write lease ``grant`` (its writer crashed or stalled)."""
        name = "expire_write_lease_of_crashed" if grant.node in self.down else "expire_write_lease"
        self._emit_dir(name, key=grant.key, lease=grant.lease, writer=grant.node)
        self._stamp_when_due(grant.lease)

    def _stamp_when_due(self, lease: int) -> None:
        """Stamp the newest inferred event, the expiry of write lease ``lease`` that the suite
        learns of only from the next grant, when it was due -- term + epsilon after the grant as
        stamped in the same inferred log (at its answer, or later if the log had gone past it) --
        and not when the suite noticed: the spec's directory timers are urgent, so an expiry
        stamped later than epsilon after it was due is unexplainable (vendor-docs), and one
        stamped less than term + epsilon after its grant's line cannot have happened yet (a
        loaded machine between the answer and the grant's line: core-inferred, KVCC-INVAL-004)."""
        with self.lock:
            self._grant_line_by(lease, self.inferred[-1]["t_local_ns"])
            due = self._write_due_ns(lease)
            if due is not None:
                self._place_newest(due)

    def _place_newest(self, t_local: int) -> None:
        """Stamp the newest inferred event at ``t_local`` (never later than it is) and put it in
        its log where that time falls, the log's later lines renumbered after it (under
        ``lock``): a directory timer the suite learns of late took its step when it was due,
        before the lines of other keys the directory logged since -- stamped after them, it reads
        as an urgent step logged too late (KVCC-TIER-006 in inferred mode, a write refused for
        space long after its lease ran out)."""
        if not self.infer:
            return
        rec = self.inferred.pop()
        t = min(rec["t_local_ns"], t_local)
        rec["t_wall_ns"] -= rec["t_local_ns"] - t
        rec["t_local_ns"] = t
        at = len(self.inferred)
        while at > 0 and self.inferred[at - 1]["t_local_ns"] > t:
            at -= 1
        later = [e for e in self.inferred[at:] if e["node"] == rec["node"] and e["incarnation"] == rec["incarnation"]]
        if later:
            rec["seq"] = later[0]["seq"]
            for e in later:
                e["seq"] += 1
        self.inferred.insert(at, rec)

    def _grant_line_by(self, lease: int, by_ns: int) -> None:
        """Write lease ``lease`` had ended by ``by_ns`` (the suite saw it then): if its grant's
        line is later than term + epsilon before that, move the line back -- the grant happened
        while its call ran and the answer came late (a 200 ms ``begin_write`` on a loaded machine,
        KVCC-TIER-006 in inferred mode) -- but never before the call's start, nor before its log's
        line before it (under ``lock``)."""
        span = (self.lease_term_ms + self.skew_ms) * 1_000_000
        at = next((i for i in range(len(self.inferred) - 1, -1, -1) if self.inferred[i]["node"] == INFERRED_DIRECTORY
                   and self.inferred[i]["event"] == "grant_write_lease" and self.inferred[i]["lease"] == lease), None)  # fmt: skip
        if at is None or self.inferred[at]["t_local_ns"] + span <= by_ns:
            return
        line = self.inferred[at]
        start = next((h["t_ns"] for h in reversed(self.history) if h.get("op") == "begin_write"
                      and ((h.get("result") or {}).get("WriteGrant") or {}).get("lease") == lease), line["t_local_ns"])  # fmt: skip
        before = next((e["t_local_ns"] for e in reversed(self.inferred[:at]) if e["node"] == line["node"]
                       and e["incarnation"] == line["incarnation"]), 0)  # fmt: skip
        new = max(by_ns - span, start, before)
        if new < line["t_local_ns"]:
            line["t_wall_ns"] -= line["t_local_ns"] - new
            line["t_local_ns"] = new

    def _write_due_ns(self, lease: int) -> int | None:
        """When the directory's timer ends write lease ``lease``: term + epsilon after its grant's
        inferred line (under ``lock``); None if no grant of it was inferred."""
        for e in reversed(self.inferred):
            if e["node"] == INFERRED_DIRECTORY and e["event"] == "grant_write_lease" and e["lease"] == lease:
                return e["t_local_ns"] + (self.lease_term_ms + self.skew_ms) * 1_000_000
        return None

    def _emit_later(self, node: str, event: str, **fields: Any) -> Callable[[], None]:
        """An event of a request whose answer decides whether it was sent: call the result to log
        it, stamped with the time it was sent (now)."""
        if not self.infer:
            return lambda at_ns=None, answered_ns=None: None
        t_local = time.monotonic_ns()

        def emit(at_ns: int | None = None, *, answered_ns: int | None = None) -> None:
            """``at_ns``: when the request was sent, if the answer tells. Else the call's start --
            unless ``answered_ns`` (a lease request's refusal: when it came back) is more than half
            a request's budget (term - epsilon) after it: a holder takes an answer only within
            that budget of sending, so a call that stalled before it sent (a loaded machine)
            sent within it; then half the budget before the answer, inside what both ends allow
            (stamped at the start, the refusal reads as answering a request its holder had given
            up)."""
            self._emit(node, event, **fields)
            if at_ns is None:
                at_ns = t_local
                if answered_ns is not None:
                    at_ns = max(t_local, min(answered_ns, time.monotonic_ns()) - self._half_budget_ns())
            self._backdate_newest(at_ns)

        return emit

    def _half_budget_ns(self) -> int:
        """Half a holder's request budget, term - epsilon (``_emit_later``)."""
        return (self.lease_term_ms - self.skew_ms) * 500_000

    def _answered_ns(self, i: int) -> int:
        """When the answer of history entry ``i`` came back."""
        return self.history[i]["t_ns"] + self.history[i]["dt_ns"]

    def _backdate_newest(self, t_local: int) -> int:
        """Stamp the newest inferred event at ``t_local``, the earliest the suite saw it can have
        happened (its call's start), never before its node's previous event: the suite learns of
        it only from an answer that, on a loaded machine, can come back long after. Returns the
        stamp (0 when nothing is inferred)."""
        if not self.infer:
            return 0
        with self.lock:
            rec = self.inferred[-1]
            local = min(rec["t_local_ns"], max(t_local, self._last_local(rec["node"])))
            rec["t_wall_ns"] -= rec["t_local_ns"] - local
            rec["t_local_ns"] = local
            return local

    def _last_local(self, node: str) -> int:
        """The last t_local_ns of ``node``'s current inferred log before its newest event."""
        inc = self.incarnations.get(node, INFERRED_INCARNATION)
        for e in reversed(self.inferred[:-1]):
            if e["node"] == node and e["incarnation"] == inc:
                return e["t_local_ns"]
        return 0

    @_ordered
    def write_bytes(self, grant: WriteGrant, data: bytes) -> Stored | Refused:
        t0 = time.monotonic_ns()
        r = self.adapter.write_bytes(grant, data)
        _expect(r, (Stored, Refused), "write_bytes")
        self._record("write_bytes", grant.node, {"key": grant.key.hex, "lease": grant.lease, "bytes": len(data)}, r, t0)
        fields = dict(key=grant.key, gen=grant.gen, epoch=grant.epoch, lease=grant.lease, location=grant.location,
                      writer=grant.node)  # fmt: skip
        host = location_host(grant.location)  # a location "<host>/<tier>" logs as its host
        if isinstance(r, Stored):
            with self.lock:
                self.pending_bytes[(grant.key, grant.lease)] = bytes(data)
                landed = self.writing.pop((grant.key, grant.lease), None) is not None
                if self.infer:
                    top = self.stored_epochs.get((grant.key, grant.location), 0)
                    self.stored_epochs[(grant.key, grant.location)] = max(top, grant.epoch)
            if landed:  # the spec's writer sends its bytes once; a second store is the same bytes
                self._emit(host, "store_bytes", **fields)
        elif r.reason == REASON_FENCED:
            with self.lock:
                self.audit.fenced_writes += 1
                self.writing.pop((grant.key, grant.lease), None)
            if self.infer:
                self._infer_write_freed(grant)
            self._emit(host, "fence_stale_write", **fields)
        return r

    def _infer_write_freed(self, grant: WriteGrant) -> None:
        """The location fenced the bytes of ``grant``. Unless newer bytes of the key landed there,
        the directory ended that write -- its lease expired (logged now if the suite had not seen
        it), or an invalidation aborted it -- and its Free reached the location first."""
        with self.lock:
            if self.stored_epochs.get((grant.key, grant.location), 0) >= grant.epoch:
                return  # newer bytes there fence it: no Free needed
            expired = self.open_writes.get(grant.key) == grant
            if expired:
                del self.open_writes[grant.key]
        if expired:
            self._emit_write_expired(grant)
        self._emit(location_host(grant.location), "free_slot", key=grant.key, epoch=grant.epoch,
                   location=grant.location, result="ok")  # fmt: skip

    @_ordered
    def commit(self, grant: WriteGrant) -> Committed | Refused:
        t0 = time.monotonic_ns()
        slot = (grant.key, grant.gen)
        with self.lock:
            # The commit may land at the directory at any moment from here on, and its answer
            # arrive much later: a read overlapping this call may see the new generation, so its
            # bytes are possibly-committed from the call's start (settled by the answer below).
            data = self.pending_bytes.get((grant.key, grant.lease))
            if data is not None and slot not in self.committed:
                self.committing.setdefault(slot, {})[grant.lease] = (data, grant.node)
        r: Any = None
        try:
            r = self.adapter.commit(grant)
            _expect(r, (Committed, Refused), "commit")
        finally:
            if not isinstance(r, Committed):  # a commit stays possibly-committed until recorded as committed
                with self.lock:
                    self._drop_committing(slot, grant.lease)
        i = self._record("commit", grant.node, {"key": grant.key.hex, "lease": grant.lease}, r, t0)
        with self.lock:
            early = self.read_while_committing.pop((grant.key, grant.gen, grant.lease), None)
        if isinstance(r, Committed):
            # The directory decided while the call ran, under a write lease it still held live then:
            # stamped at the call's start, not when its answer came back (CI saw an answer late
            # enough on a loaded machine that the write lease had run out by the suite's clock).
            self._emit_dir("commit_write", key=grant.key, gen=r.gen, epoch=r.epoch, lease=grant.lease, writer=grant.node)
            self._backdate_newest(t0)
            with self.lock:
                self.copies[grant.key] = grant.location
                self.lost_at.pop(grant.key, None)
                if self.open_writes.get(grant.key) == grant:
                    del self.open_writes[grant.key]
                if data is None:
                    raise OracleFailure("CommittedBytesIntact", "a commit was accepted for bytes never stored", i)
                if r.gen != grant.gen:
                    raise OracleFailure("OneWriterPerGeneration", f"committed gen {r.gen}, granted {grant.gen}", i)
                first = self.committed.get((grant.key, r.gen))
                if first is not None and first[2] != grant.lease:
                    raise OracleFailure("OneWriterPerGeneration", f"generation {r.gen} of {grant.key.hex[:16]} committed "
                                        f"twice: under lease {first[2]} and again under lease {grant.lease}", i)  # fmt: skip
                self.committed[(grant.key, r.gen)] = (data, grant.node, grant.lease)
                self._drop_committing(slot, grant.lease)
        else:
            if data is not None and r.reason not in (REASON_NOT_FOUND, *LOCAL_REFUSALS):
                with self.lock:
                    # The directory turned down the commit of the write it still had open: only
                    # its timer can have ended that lease, and it ran before the commit arrived.
                    expired = self.infer and self.open_writes.get(grant.key) == grant
                    if expired:
                        del self.open_writes[grant.key]
                if expired:
                    self._emit_write_expired(grant)
                # Stored bytes sent the spec's commit; the directory turned it down.
                self._emit_dir("reject_stale_commit", key=grant.key, lease=grant.lease, writer=grant.node,
                               epoch=grant.epoch, result=r.reason)  # fmt: skip
            if early is not None:
                raise OracleFailure("NoDirtyRead", f"history #{early} read bytes of generation {grant.gen} while its "
                                    f"commit was under way, and the commit was refused ({r.reason})", i)  # fmt: skip
            if r.reason in (REASON_STALE_EPOCH, REASON_UNKNOWN_LEASE, REASON_LEASE_EXPIRED, REASON_WRONG_GENERATION, REASON_FENCED):
                with self.lock:
                    self.audit.stale_commits_refused += 1
        return r

    def _drop_committing(self, slot: tuple, lease: int) -> None:
        """The commit under ``lease`` is settled (under ``lock``): no longer possibly-committed."""
        pending = self.committing.get(slot, {})
        pending.pop(lease, None)
        if not pending:
            self.committing.pop(slot, None)

    @_ordered
    def abort(self, grant: WriteGrant) -> None:
        t0 = time.monotonic_ns()
        self.adapter.abort(grant)
        self._record("abort", grant.node, {"key": grant.key.hex, "lease": grant.lease}, None, t0)
        with self.lock:
            under_way = self.writing.pop((grant.key, grant.lease), None) is not None
        if under_way:  # a write whose bytes landed or were fenced is over: nothing to abort
            self._infer_write_expired_by_now(grant)
            self._emit(grant.node, "abort", key=grant.key, gen=grant.gen, epoch=grant.epoch, lease=grant.lease)

    def _infer_write_expired_by_now(self, grant: WriteGrant) -> None:
        """If the directory's timer has ended write lease ``grant`` by now -- term + epsilon after
        its grant's line -- log that expiry (at its due time) before what the writer does next: the
        spec's timers are urgent, so a step logged after the due time needs the expiry before it
        (a writer whose bytes were refused for space and that gives up late, on a loaded machine
        or behind other operations in inferred mode)."""
        if not self.infer:
            return
        with self.lock:
            due = self._write_due_ns(grant.lease) if self.open_writes.get(grant.key) == grant else None
            if due is None or time.monotonic_ns() < due:
                return
            del self.open_writes[grant.key]
        self._emit_write_expired(grant)

    def acquire(self, node: str, ns: Namespace, key: BlockKey) -> ReadGrant | Refused:
        """The adapter's ``acquire``, asked again (up to ``LATE_GRANT_RETRIES`` times, once the
        lease the directory granted has run out there too) while it answers ``lease_expired``: the
        grant came after the request's own budget ran out, so the holder gave it up -- what a
        correct holder does on a stalled machine, and no answer about the block. A holder that
        gives up every grant is still refused in the end."""
        for _ in range(LATE_GRANT_RETRIES):
            g = self._acquire_once(node, ns, key)
            if not (isinstance(g, Refused) and g.reason == REASON_LEASE_EXPIRED):
                return g
            self.sleep_ms(self.lease_term_ms + 2 * self.skew_ms)
        return self._acquire_once(node, ns, key)

    @_ordered
    def _acquire_once(self, node: str, ns: Namespace, key: BlockKey) -> ReadGrant | Refused:
        t0 = time.monotonic_ns()
        sent = self._emit_later(node, "acquire", key=key)
        g = self.adapter.acquire(node, ns, key)
        _expect(g, (ReadGrant, Refused), "acquire")
        i = self._record("acquire", node, {"key": key.hex}, g, t0)
        if isinstance(g, ReadGrant):
            self._check_grant(g, node, key, i)
            if self.infer:
                self._infer_revoked(node, key, t0)
            with self.lock:
                t1 = time.monotonic_ns()
                # The request left when the holder says (its clock is the suite's, for the kit and
                # most in-process adapters), somewhere in the call; the grant was taken and trusted
                # by the time the answer came back. Stamped later, a trust reads as past the
                # request's budget on a loaded machine -- the holder had given it up
                # (``Holder.gave_up``). The directory granted after it, so held the lease live at
                # least until term + epsilon after it (``_live_at_directory``); the call's start
                # is earlier still when the call stalled before sending.
                sent_ns = min(max(g.requested_at_ns, t0), t1)
                self.deadlines_ns[(node, g.lease)] = t1 + (g.term_ms - self.skew_ms) * 1_000_000
                self.earliest_deadlines_ns[(node, g.lease)] = sent_ns + (g.term_ms - self.skew_ms) * 1_000_000
                self.read_grants[(node, g.lease)] = g
            sent(sent_ns)
            self._emit_dir("grant_read_lease", key=key, gen=g.gen, epoch=g.epoch, lease=g.lease, holder=node,
                           location=g.location)  # fmt: skip
            granted_ns = self._backdate_newest(t1)
            self._emit(node, "trust_read_lease", key=key, gen=g.gen, epoch=g.epoch, lease=g.lease, location=g.location)
            self._backdate_newest(max(t1, granted_ns) + 1)
        elif g.reason not in LOCAL_REFUSALS and g.reason != REASON_LEASE_EXPIRED:
            # (``lease_expired``: the grant came after the request's own budget ran out and the
            # holder gave it up -- nothing a correct holder logs, the directory's grant unseen.)
            if self.infer:
                self._infer_revoked(node, key, t0)
            sent(answered_ns=self._answered_ns(i))
            self._emit_dir("refuse_read_lease", key=key, holder=node, result=g.reason)
            self._emit(node, "abandon", key=key, result=g.reason)  # a refusal answers: the holder stops waiting
        return g

    @_ordered
    def renew(self, grant: ReadGrant) -> ReadGrant | Refused:
        t0 = time.monotonic_ns()
        with self.lock:
            # A holder that no longer trusts the lease refuses on its own, without asking.
            asks = self._trusted_ns(grant.node, grant.lease, t0)
        sent = self._emit_later(grant.node, "renew", key=grant.key, lease=grant.lease) if asks else (lambda *a, **k: None)
        g = self.adapter.renew(grant)
        _expect(g, (ReadGrant, Refused), "renew")
        i = self._record("renew", grant.node, {"key": grant.key.hex, "lease": grant.lease}, g, t0)
        if isinstance(g, ReadGrant):
            if g.lease != grant.lease or g.key != grant.key:
                raise GarbageAnswer(f"renew answered another lease: {g!r:.120}")
            with self.lock:
                old = self.deadlines_ns.get((grant.node, grant.lease))
                if old is not None and t0 > old + self.skew_ms * 1_000_000:
                    raise OracleFailure("RenewalNeverRevives", f"lease {grant.lease} renewed after its deadline", i)
                t1 = time.monotonic_ns()
                sent_ns = min(max(g.requested_at_ns, t0), t1)  # as ``acquire``'s
                self.deadlines_ns[(grant.node, grant.lease)] = t1 + (g.term_ms - self.skew_ms) * 1_000_000
                self.earliest_deadlines_ns[(grant.node, grant.lease)] = sent_ns + (g.term_ms - self.skew_ms) * 1_000_000
            sent(sent_ns)
            with self.lock:
                self.forgotten.discard((grant.node, grant.lease))  # renewed: the directory holds it again
            self._emit_dir("renew_lease", key=grant.key, lease=grant.lease, holder=grant.node)
            self._emit(grant.node, "trust_renewal", key=grant.key, gen=g.gen, epoch=g.epoch, lease=g.lease)
        elif asks and g.reason not in LOCAL_REFUSALS and g.reason != REASON_LEASE_EXPIRED:
            sent(answered_ns=self._answered_ns(i))
            self._emit_dir("refuse_renewal", key=grant.key, lease=grant.lease, holder=grant.node, result=g.reason)
            self._emit(grant.node, "abandon", key=grant.key, lease=grant.lease, result=g.reason)
        return g

    @_ordered
    def read(self, grant: ReadGrant) -> bytes | Refused:
        t0 = time.monotonic_ns()
        data = self.adapter.read(grant)
        _expect(data, (bytes, Refused), "read")
        i = self._record("read", grant.node, {"key": grant.key.hex, "lease": grant.lease, "gen": grant.gen}, data, t0)
        if isinstance(data, bytes):
            with self.lock:
                deadline = self.deadlines_ns.get((grant.node, grant.lease))
                if deadline is not None and t0 > deadline + self.skew_ms * 1_000_000:
                    raise OracleFailure(
                        "holder_deadline",
                        f"read under lease {grant.lease} served {(t0 - deadline) / 1e6:.1f} ms after the holder's deadline",
                        i,
                    )
                # Judged by when the read *started*: a read under way while another thread saw the
                # invalidation complete may legitimately return the old bytes (protocol property 6: no read of
                # the invalidated generation starts after completion).
                for below, seen_ns in self.invalidated_below.get(grant.key, ()):
                    if grant.gen < below and t0 >= seen_ns:
                        raise OracleFailure("NoStaleRead", f"read of generation {grant.gen} started "
                                            f"{(t0 - seen_ns) / 1e6:.1f} ms after its invalidation completed", i)  # fmt: skip
                expected = self.committed.get((grant.key, grant.gen))
                if expected is None:
                    # A commit of this generation under way: bytes equal to one of its writers'.
                    racing = self.committing.get((grant.key, grant.gen), {})
                    for lease, candidate in racing.items():
                        if candidate[0] == data:
                            self.read_while_committing.setdefault((grant.key, grant.gen, lease), i)
                            expected = (*candidate, lease)
                            break
                    else:
                        if racing:
                            expected = (*next(iter(racing.values())), None)
                if expected is None:
                    raise OracleFailure("NoDirtyRead", f"read returned bytes of a generation never committed: {grant.gen}", i)
                if data != expected[0]:
                    raise OracleFailure("CommittedBytesIntact", f"read returned {len(data)} bytes that differ from the committed {len(expected[0])}", i)
                self.audit.hits += 1
                if expected[1] != grant.node:
                    self.audit.remote_hits += 1
            self._emit(grant.node, "read", key=grant.key, gen=grant.gen, epoch=grant.epoch, lease=grant.lease,
                       location=grant.location, result="ok")  # fmt: skip
            self._backdate_newest(t0)
        elif data.reason == REASON_MISS and self._trusted_ns(grant.node, grant.lease, t0):
            self._emit(grant.node, "read", key=grant.key, gen=grant.gen, epoch=grant.epoch, lease=grant.lease,
                       location=grant.location, result=REASON_MISS)  # fmt: skip
            self._backdate_newest(t0)
        return data

    @_ordered
    def release(self, grant: ReadGrant) -> None:
        t0 = time.monotonic_ns()
        self.adapter.release(grant)
        self._record("release", grant.node, {"key": grant.key.hex, "lease": grant.lease}, None, t0)
        with self.lock:
            trusted = self._trusted_ns(grant.node, grant.lease, t0)
            self.deadlines_ns.pop((grant.node, grant.lease), None)
            self.read_grants.pop((grant.node, grant.lease), None)
        if trusted:  # a lease the holder no longer trusts is let go without a message
            self._emit(grant.node, "release", key=grant.key, gen=grant.gen, lease=grant.lease)
            self._backdate_newest(t0)
            self._emit_dir("release_lease", key=grant.key, lease=grant.lease, holder=grant.node)

    @_ordered
    def invalidate(self, node: str, ns: Namespace, scope: str, key: BlockKey | None) -> InvalidationTicket:
        t0 = time.monotonic_ns()
        with self.lock:
            # Every generation committed before the invalidation started is void once it completes.
            snapshot: dict[BlockKey, int] = {}
            for k, g in self.committed:
                snapshot[k] = max(snapshot.get(k, -1), g)
        t = self.adapter.invalidate(node, ns, scope, key)
        _expect(t, (InvalidationTicket,), "invalidate")
        self._record("invalidate", node, {"scope": scope, "key": None if key is None else key.hex}, t, t0)
        voids = False
        with self.lock:
            self.snapshots[t.id] = snapshot
            if self.infer:
                # The spec's invalidation voids something COMMITTED (the root, or a key of the
                # namespace); otherwise it starts nothing and its ticket waits for what is
                # INVALIDATING already (the reference directory's rule too).
                invalidating = {k for v in self.voiding.values() for k in v}
                subtree, voided = self._voided(ns.digest(), scope, key)
                voided = {k: gen for k, gen in voided.items() if k not in invalidating}
                voids = bool(voided) if scope == "namespace" else key in voided
                self.voiding[t.id] = voided if voids else {}
                self.voiding_since[t.id] = t0
                if voids:
                    for k in subtree:
                        if k not in voided:
                            self.open_writes.pop(k, None)  # a write under way below is aborted at once
        if voids and scope == "namespace":
            self._emit_dir("invalidate_namespace", namespace=ns.digest().hex())
        elif voids:
            self._emit_dir("invalidate", key=key)
        return t

    def _voided(self, digest: bytes, scope: str, key: BlockKey | None) -> tuple[set, dict[BlockKey, int]]:
        """The keys an invalidation reaches (a key's subtree, or a namespace) and the committed
        generation of each it voids."""
        if scope == "namespace":
            keys = {k for k, d in self.key_ns.items() if d == digest}
        elif self.key_ns.get(key) != digest:
            # A key named through a namespace it does not belong to reaches nothing: the key is
            # another namespace's, and a prefix subtree never leaves its namespace (protocol properties 10, 11).
            return set(), {}
        else:
            keys, frontier = {key}, [key]
            while frontier:
                k = frontier.pop()
                children = [c for c, p in self.parents.items() if p == k and c not in keys]
                keys.update(children)
                frontier += children
        out: dict[BlockKey, int] = {}
        for k, gen in self.committed:
            if k in keys and gen >= self.completed.get(k, 0):
                out[k] = max(out.get(k, -1), gen)
        return keys, out

    def wait_invalidation(self, ticket: InvalidationTicket, timeout_s: float, voids: Sequence[BlockKey] = ()) -> bool:
        """Wait; on completion every generation of ``voids`` committed before the invalidation
        started is void for the no-stale-read oracle."""
        t0 = time.monotonic_ns()
        done = self.adapter.wait_invalidation(ticket, timeout_s)
        done_ns = time.monotonic_ns()
        if type(done) is not bool:
            raise GarbageAnswer(f"wait_invalidation answered {done!r:.80}")
        self._record("wait_invalidation", None, {"ticket": ticket.id}, done, t0)
        if done and self.infer:
            with self.lock:
                self.due_completions.append(ticket)
            with self.order:
                self._infer_due_completions()
        if done:
            with self.lock:
                snapshot = self.snapshots.get(ticket.id, {})
                for key in voids:
                    top = snapshot.get(key)
                    if top is not None:
                        self.invalidated_below.setdefault(key, []).append((top + 1, done_ns))
        return done

    def _infer_due_completions(self) -> None:
        """Log the completions of the invalidations whose waits came back (under ``order``)."""
        with self.lock:
            due, self.due_completions = self.due_completions, []
        for ticket in due:
            self._infer_completion(ticket)

    def _infer_completion(self, ticket: InvalidationTicket) -> None:
        """The invalidation completed: every lease of the suite's holders on a voided key that the
        directory still held live when the invalidation started was revoked and acknowledged (a
        lease that had run out, term + epsilon after its grant, got no revocation: it expired),
        then each voided generation completed."""
        with self.lock:
            since = self.voiding_since.pop(ticket.id, 0)
            voided = self.voiding.pop(ticket.id, None)
            if voided is None:
                return  # completed before (a second wait on the ticket)
            # A generation a later grant already showed complete (another thread got there first).
            voided = {k: gen for k, gen in voided.items() if gen >= self.completed.get(k, 0)}
            acks = [g for (n, lease), g in sorted(self.read_grants.items(), key=lambda kv: kv[0][1])
                    if g.key in voided and g.gen <= voided[g.key] and self._live_at_directory(n, lease, since)]  # fmt: skip
            for g in acks:
                self.read_grants.pop((g.node, g.lease), None)
            for key, gen in voided.items():
                self.completed[key] = max(self.completed.get(key, 0), gen + 1)
        self._emit_acks(acks)
        for key, gen in voided.items():
            self._emit_dir("complete_invalidation", key=key, gen=gen)

    def _emit_acks(self, acks: Sequence[ReadGrant]) -> None:
        for g in acks:
            self._emit(g.node, "drop_and_ack", key=g.key, gen=g.gen, lease=g.lease)
            self._emit_dir("revoke_acked", key=g.key, lease=g.lease, holder=g.node)

    def _infer_revoked(self, node: str, key: BlockKey, now_ns: int) -> None:
        """``node`` asked for a new lease on ``key`` while the suite thought it trusted one: if an
        invalidation of the key is under way, the revocation reached it first (a holder that
        acquires while trusting is left for the validator to reject)."""
        with self.lock:
            voiding = any(key in v for v in self.voiding.values())
            acks = [g for (n, lease), g in self.read_grants.items()
                    if n == node and g.key == key and self._trusted_ns(n, lease, now_ns)] if voiding else []  # fmt: skip
            for g in acks:
                self.read_grants.pop((g.node, g.lease), None)
        self._emit_acks(acks)

    @_ordered
    def evict(self, node: str, ns: Namespace, key: BlockKey, *, leased: bool = False) -> Evicted | Refused:
        """``leased``: the workload knows a live lease names this copy (for the audit)."""
        t0 = time.monotonic_ns()
        r = self.adapter.evict(node, ns, key)
        _expect(r, (Evicted, Refused), "evict")
        self._record("evict", node, {"key": key.hex}, r, t0)
        with self.lock:
            if isinstance(r, Evicted):
                self.audit.evictions += 1
            elif r.reason == REASON_LEASED and leased:
                self.audit.refused_evictions_leased += 1
            location = self.copies.get(key, node)
        if location_host(location) != node:
            location = node
        if isinstance(r, Evicted):
            with self.lock:
                last = self.infer and self.copies.get(key) == location
                children = [c for c, p in self.parents.items() if p == key] if last else []
            for child in children:
                # A last copy goes only once every child is ABSENT (the spec's evict_parent_first).
                self._infer_absent(child)
            self._emit_dir("evict", key=key, location=location)
            with self.lock:
                if self.copies.get(key) == location:
                    # The owner's copy went: the generation ended with it (lookup finds nothing).
                    tops = [gen for (k, gen) in self.committed if k == key]
                    self.completed[key] = max([self.completed.get(key, 0), *(t + 1 for t in tops)])
        elif r.reason == REASON_LEASED:
            self._emit_dir("evict_refused", key=key, location=location)
        return r

    # faults: recorded, never checked here

    @_ordered
    def intrude(self, grant: WriteGrant | ReadGrant, how: str, data: bytes | None = None) -> bytes | Stored | Refused:
        """``Adapter.intrude``, recorded: what the location answered an outsider. No event is
        inferred (a refused request is no step of the spec; bytes served or stored for an
        outsider are the failure the workload checks)."""
        t0 = time.monotonic_ns()
        got = self.adapter.intrude(grant, how, data)
        _expect(got, (bytes, Stored, Refused), "intrude")
        self._record("intrude", grant.node, {"key": grant.key.hex, "lease": grant.lease, "how": how,
                                             "bytes_sent": None if data is None else len(data)}, got, t0)  # fmt: skip
        return got

    def move(self, grant: ReadGrant) -> Moving | Refused:
        """``Adapter.move``, recorded. No event is inferred: the transfer's copy lands on its own,
        out of the suite's sight (the test that moves blocks needs native events)."""
        t0 = time.monotonic_ns()
        got = self.adapter.move(grant)
        _expect(got, (Moving, Refused), "move")
        self._record("move", grant.node, {"key": grant.key.hex, "gen": grant.gen, "location": grant.location}, got, t0)
        return got

    def fault(self, op: str, *args: Any) -> None:
        t0 = time.monotonic_ns()
        getattr(self.adapter, op)(*args)
        self._record(op, args[0] if args else None, {"args": list(args)}, None, t0)
        if not self.infer:
            return
        if op == "kill":
            node = args[0]
            self._emit(node, "crash", lose_disk=True)
            with self.lock:
                self.crashed_at[node] = self.inferred[-1]["t_local_ns"]
                # Its volatile state is gone: no trust, no write under way survives a crash. The
                # directory keeps its leases until they run out or the node rejoins.
                for held in [h for h in self.read_grants if h[0] == node]:
                    g = self.read_grants.pop(held)
                    if held in self.earliest_deadlines_ns and held not in self.forgotten:
                        self.dead_grants[held] = (g, self.earliest_deadlines_ns[held] + 2 * self.skew_ms * 1_000_000)
                for w in [w for w, g in self.writing.items() if g.node == node]:
                    self.writing.pop(w)
                self.incarnations[node] = self.incarnations.get(node, INFERRED_INCARNATION) + 1
                self.down.add(node)
        elif op == "restart":
            node = args[0]
            self._infer_what_fell_due()
            with self.lock:
                self.down.discard(node)
                self.crashed_at.pop(node, None)  # back within its detection time: never declared
                declared = self.declared_at.pop(node, None)
                lost = sorted({loc for loc in self.copies.values() if location_host(loc) == node} | {node})
                # The rejoin ends every write in progress to one of the node's tiers
                # (``rules.lost_copy_invalidates``): no expiry of it is left to infer.
                for key in [k for k, g in self.open_writes.items() if location_host(g.location) == node]:
                    del self.open_writes[key]
            self._emit_dir("restart_node", rejoined=node, lost=lost)
            with self.lock:
                at = self.inferred[-1]["t_local_ns"]
                # The copies it had are void from the declaration on, if it came first.
                for key, loc in self.copies.items():
                    if location_host(loc) == node:
                        self.lost_at[key] = at if declared is None else declared
                # Its leases are forgotten now: an invalidation waiting on them completes.
                for held, (g, end) in list(self.dead_grants.items()):
                    if held[0] == node:
                        self.dead_grants[held] = (g, min(end, at))
            self._infer_what_fell_due()
        elif op == "restart_directory":
            with self.lock:
                self.incarnations[INFERRED_DIRECTORY] = self.incarnations.get(INFERRED_DIRECTORY, INFERRED_INCARNATION) + 1
                self.forgotten |= set(self.read_grants)  # records survive a restart, the lease table does not
            self._emit_dir("restart_directory")

    def engine(self, op: str, *args: Any) -> Any:
        """An engine method of the adapter (``complete``, ``forget``, ``kill_engine``, ...: the
        ``engine`` profile), recorded. Engines are deployments with native events only: nothing
        is inferred."""
        t0 = time.monotonic_ns()
        out = getattr(self.adapter, op)(*args)
        if op == "complete" and not isinstance(out, Completion):
            raise GarbageAnswer(f"complete answered {out!r:.80}")
        self._record(op, args[0] if args and isinstance(args[0], str) else None,
                     {"args": [a if isinstance(a, (str, int)) else type(a).__name__ for a in args]},
                     out if op != "engine_keys" else None, t0)  # fmt: skip
        return out

    def _check_grant(self, g: WriteGrant | ReadGrant, node: str, key: BlockKey, i: int) -> None:
        if g.node != node or g.key != key:
            raise GarbageAnswer(f"a grant for another node or key: {g!r:.160}")
        with self.lock:
            if g.lease in self.lease_ids:
                raise OracleFailure("LeaseIdsFresh", f"lease id {g.lease} granted again (first at history #{self.lease_ids[g.lease]})", i)
            self.lease_ids[g.lease] = i


# -- completeness of a native trace ---------------------------------------------------------------------

# Events an answer the suite saw implies exactly as often as it saw it: a served read (the holder's
# client is the suite), a commit (the directory commits a lease's write once).
_EXACT_PER_LEASE = ("read", "commit_write")
# Client-side events an answer allows but does not force (the spec's grant may stay in flight: a
# writer may log start_writing only when it sends its bytes; a read under the lease would need the
# trust, which the validator checks): never more than the suite saw.
_AT_MOST_PER_LEASE = ("start_writing", "trust_read_lease", "trust_renewal")
# Events a served operation implies at least once (a duplicated message may store twice; a
# deployment may evict on its own; failures may be logged by more than one party).
_AT_LEAST = ("grant_write_lease", "grant_read_lease", "renew_lease", "store_bytes", "fence_stale_write", "evict",
             "crash", "restart_node", "restart_directory")  # fmt: skip
# Refusals, counted per key whatever the lease (a refused acquire has none): at least as many as
# the suite saw (``_DIRECTORY_REFUSALS``).
_REFUSAL_EVENTS = ("refuse_read_lease", "refuse_renewal", "refuse_write_lease", "reject_stale_commit", "abandon",
                   "evict_refused")


# Refusals only the directory can give (``spec.rules``' may_grant_read, may_renew, may_begin_write,
# may_commit): the suite saw one, so the directory decided it and logged its refusal, and a holder
# turned down that way stops waiting (``abandon``). Reasons a client may also give on its own
# (``already_leased``, ``busy``, ``revoked``, ``lease_expired`` or ``unknown_lease`` of a renewal of a
# lease it no longer holds, ``not_found``), and refusals a client may give knowing its own earlier
# requests (``_maybe_local``), imply nothing.
_DIRECTORY_REFUSALS = {
    "acquire": ("refuse_read_lease", frozenset({REASON_NOT_COMMITTED, REASON_INVALIDATING})),
    "renew": ("refuse_renewal", frozenset({REASON_NOT_COMMITTED, REASON_INVALIDATING, REASON_NOT_OWNER})),
    # A key's parent, a location's liveness, a key's shard: what only a directory knows.
    "begin_write": ("refuse_write_lease", frozenset({REASON_NOT_ABSENT, REASON_PARENT_NOT_COMMITTED, REASON_KEY_IDENTITY,
                                                     REASON_LOCATION_DOWN, REASON_WRONG_SHARD})),
    "commit": ("reject_stale_commit", frozenset({REASON_STALE_EPOCH, REASON_LEASE_EXPIRED, REASON_WRONG_GENERATION})),
}  # fmt: skip


def _maybe_local(history: Sequence[dict]) -> set[int]:
    """History indices of refusals a client may have given on its own, knowing its own earlier
    requests: a begin_write of a key the node was granted before (its write may still be under
    way); a commit of a grant whose bytes that node never stored, or that was already committed,
    refused or aborted (its one commit was spent)."""
    granted: set[tuple] = set()
    stored: set[tuple] = set()
    spent: set[tuple] = set()
    out: set[int] = set()
    for h in history:
        op, node, key, lease, res = h.get("op"), h.get("node"), h.get("key"), h.get("lease"), h.get("result")
        if op == "begin_write":
            if (node, key) in granted:
                out.add(h.get("i", -1))
            if isinstance(res, dict) and "WriteGrant" in res:
                granted.add((node, key))
        elif op == "write_bytes" and res == "Stored":
            stored.add((node, key, lease))
        elif op in ("commit", "abort"):
            if op == "commit" and ((key, lease) in spent or (node, key, lease) not in stored):
                out.add(h.get("i", -1))
            spent.add((key, lease))
    return out


def _implied(h: dict, local: set[int] = frozenset()) -> list[tuple]:
    """The trace events one history entry implies: ``(event, key, lease)`` (``None`` = any).
    ``local``: the history indices of refusals the client may have given on its own."""
    op, res, key, lease = h.get("op"), h.get("result"), h.get("key"), h.get("lease")
    grant = res.get("WriteGrant") or res.get("ReadGrant") if isinstance(res, dict) else None
    out: list[tuple] = []
    refused = res.get("refused") if isinstance(res, dict) and h.get("i", -1) not in local else None
    if op == "commit" and refused == REASON_UNKNOWN_LEASE:
        # A commit whose grant was neither committed nor aborted: only the directory knows it is gone.
        out.append(("reject_stale_commit", key, None))
    if op in _DIRECTORY_REFUSALS and refused in _DIRECTORY_REFUSALS[op][1]:
        out.append((_DIRECTORY_REFUSALS[op][0], key, None))
        if op in ("acquire", "renew"):
            out.append(("abandon", key, None))
    if op == "evict" and refused == REASON_LEASED:
        # Only the directory knows a lease is live on the copy: the spec's evict_refused step.
        out.append(("evict_refused", key, None))
    if op == "begin_write" and grant:
        out += [("start_writing", key, grant["lease"]), ("grant_write_lease", key, grant["lease"])]
    elif op == "acquire" and grant:
        out += [("trust_read_lease", key, grant["lease"]), ("grant_read_lease", key, grant["lease"])]
    elif op == "renew" and grant:
        out += [("trust_renewal", key, lease), ("renew_lease", key, lease)]
    elif op == "write_bytes" and res == "Stored":
        out.append(("store_bytes", key, lease))
    elif op == "write_bytes" and isinstance(res, dict) and res.get("refused") == REASON_FENCED:
        out.append(("fence_stale_write", key, lease))
    elif op == "commit" and isinstance(res, dict) and "committed" in res:
        out.append(("commit_write", key, lease))
    elif op == "read" and isinstance(res, dict) and "bytes" in res:
        out.append(("read", key, lease))
    elif op == "evict" and res == "Evicted":
        out.append(("evict", key, None))
    elif op == "kill":
        out.append(("crash", None, None))
    elif op == "restart":
        out.append(("restart_node", None, None))
    elif op == "restart_directory":
        out.append(("restart_directory", None, None))
    return out


def completeness_problems(history: Sequence[dict], events: Sequence[dict], own_leases_only: bool = False) -> list[str]:
    """Cross-check the suite's own history against an adapter's native trace: what each answer
    implies must be logged (``_EXACT_PER_LEASE`` exactly as often as the suite saw it, ``_AT_LEAST``
    and the refusals only a directory gives at least that often), and ``_AT_MOST_PER_LEASE`` events never more often than the suite saw
    the answer that allows them. An empty list when the trace is complete.

    ``own_leases_only``: where the deployment has actors of its own beside the suite's (an
    engine's kvcc clients, profile ``engine``), an event of a lease the suite was never granted
    is no operation of the suite's: not counted."""
    from collections import Counter

    wanted: Counter = Counter()
    where: dict[tuple, int] = {}
    local = _maybe_local(history)
    for h in history:
        for sig in _implied(h, local):
            wanted[sig] += 1
            where.setdefault(sig, h.get("i", -1))
    granted = {lease for sig in wanted for lease in (sig[2],) if lease is not None}
    seen: Counter = Counter()
    for e in events:
        if not isinstance(e, dict):
            continue
        if own_leases_only and e.get("lease") is not None and e.get("lease") not in granted:
            continue
        name = e.get("event")
        if name == "read" and e.get("result") not in ("ok", None):
            continue  # a miss returned no bytes: the suite saw a refusal (no result: bytes returned)
        if name in _EXACT_PER_LEASE or name in _AT_MOST_PER_LEASE:
            seen[(name, e.get("key"), e.get("lease"))] += 1
        elif name == "evict" or name in _REFUSAL_EVENTS:
            seen[(name, e.get("key"), None)] += 1
        elif name in _AT_LEAST and name in ("crash", "restart_node", "restart_directory"):
            seen[(name, None, None)] += 1
        elif name in _AT_LEAST:
            seen[(name, e.get("key"), e.get("lease"))] += 1
    problems = []
    for sig, n in sorted(wanted.items(), key=lambda kv: where[kv[0]]):
        if seen[sig] < n and sig[0] not in _AT_MOST_PER_LEASE:
            name, key, lease = sig
            what = name + ("" if key is None else f" of {key[:16]}") + ("" if lease is None else f" lease {lease}")
            problems.append(f"{what}: history #{where[sig]} implies {n}, the trace has {seen[sig]}")
    for sig, n in sorted(seen.items(), key=lambda kv: (kv[0][0], str(kv[0][1]), str(kv[0][2]))):
        if (sig[0] in _EXACT_PER_LEASE or sig[0] in _AT_MOST_PER_LEASE) and n > wanted[sig]:
            name, key, lease = sig
            problems.append(f"{name} of {str(key)[:16]} lease {lease}: the trace has {n}, the suite saw {wanted[sig]}")
    return problems


def _expect(value: Any, types: tuple[type, ...], op: str) -> None:
    if not isinstance(value, types):
        raise GarbageAnswer(f"{op} answered {type(value).__name__}: {value!r:.80}")


def _summary(result: Any) -> Any:
    if result is None or isinstance(result, (bool, int, str)):
        return result
    if isinstance(result, bytes):
        return {"bytes": len(result)}
    if isinstance(result, Refused):
        return {"refused": result.reason, "detail": result.detail[:200]}
    if isinstance(result, (WriteGrant, ReadGrant)):
        return {type(result).__name__: {"gen": result.gen, "epoch": result.epoch, "lease": result.lease,
                                        "location": result.location, "term_ms": result.term_ms}}  # fmt: skip
    if isinstance(result, Committed):
        return {"committed": {"gen": result.gen, "epoch": result.epoch}}
    if isinstance(result, InvalidationTicket):
        return {"ticket": result.id, "keys": result.keys}
    if isinstance(result, Moving):
        return {"moving": {"source": result.source, "destination": result.destination, "epoch": result.epoch}}
    if isinstance(result, Completion):
        return {"completion": {"tokens": list(result.tokens), "prompt_tokens": result.prompt_tokens,
                               "cached_tokens": result.cached_tokens, "loaded_blocks": result.loaded_blocks,
                               "load_errors": result.load_errors}}
    if isinstance(result, (set, frozenset)):
        return {"keys": len(result)}
    return type(result).__name__


# -- deletion reaches everywhere (KVCC-INVAL-009) ---------------------------------------------------
# Events that show a location let go of a generation's bytes: the location freed them (or found
# nothing there), a fence showed a later epoch already replaced them, or the node evicted them.
_GONE_EVENTS = ("free_slot", "fence_stale_free", "evict")


def unfreed_locations(events: Sequence[dict], ended: dict[str, int], settled: bool = False) -> list[str]:
    """docs/protocol.md progress, deletion reaches everywhere, checked on a native trace: for each key
    (hex) of ``ended`` and the generation of it that ended, every location whose bytes of that
    generation the trace shows (``store_bytes`` / ``store_copy``) must also show them gone --
    ``free_slot`` or ``fence_stale_free`` under an epoch at least the stored one, or an
    ``evict`` there. With ``settled`` (the adapter declares ``Capabilities.frees_acknowledged``)
    each such free must also show settled: the directory's ``free_acked`` for that key and
    location under an epoch at least the stored one -- else the directory keeps the free owed
    and sends it again forever. Returns ``"key@location"`` for each location still holding them,
    ``"key@location (free never acknowledged)"`` for one freed but not settled (empty: deletion
    reached everywhere)."""
    held: dict[tuple[str, str], int] = {}  # (key, location) -> highest epoch stored there
    for e in events:
        if not isinstance(e, dict) or e.get("event") not in ("store_bytes", "store_copy"):
            continue
        key, loc = e.get("key"), e.get("location")
        if key in ended and e.get("gen") == ended[key] and loc is not None:
            held[(key, loc)] = max(held.get((key, loc), 0), int(e.get("epoch") or 0))
    acked: dict[tuple[str, str], int] = {}  # (key, location) -> highest epoch a free_acked settled
    for e in events if settled else ():
        if isinstance(e, dict) and e.get("event") == "free_acked" and (e.get("key"), e.get("location")) in held:
            kl = (e["key"], e["location"])
            acked[kl] = max(acked.get(kl, 0), int(e.get("freed_epoch") or 0), int(e.get("epoch") or 0))
    gone: set[tuple[str, str]] = set()
    unsettled: set[tuple[str, str]] = set()
    for e in events:
        if not isinstance(e, dict) or e.get("event") not in _GONE_EVENTS:
            continue
        key, loc = e.get("key"), e.get("location")
        if (key, loc) not in held:
            continue
        if e["event"] == "evict":
            if e.get("gen") in (None, ended[key]):
                gone.add((key, loc))
        elif int(e.get("epoch") or 0) >= held[(key, loc)]:
            if settled and acked.get((key, loc), -1) < held[(key, loc)]:
                unsettled.add((key, loc))
            else:
                gone.add((key, loc))
    return sorted(
        f"{key[:16]}@{loc}" + (" (free never acknowledged)" if (key, loc) in unsettled else "")
        for key, loc in held
        if (key, loc) not in gone
    )
