"""The trace validator as it was before issue 9's redesign (``conformance.validate``), kept as an
oracle: the corpus test (``tests/test_validate.py``, ``tests/corpus/validate``) checks that both
give the same verdicts, and says why where they do not. Not used by the suite; do not extend it
(only keep it importable against the spec: the spec-model branch's edit of the old validator for
its new actions is applied here too). Its own theory of operation follows.

Trace validation: replay what processes logged through the spec's successor function.

Theory of operation
-------------------
An implementation logs one NDJSON line per spec action it performed (``kvcc.reference.events``).
This module answers whether *some* behaviour of the spec (``kvcc.spec.model``) explains the whole
merged log -- ACCEPTED --, or names the first event no spec state could take -- REJECTED, with a
diff --, or gives up within named bounds -- INCONCLUSIVE. It is TLC's trace validation (a
frontier of possible states, time as intervals) over the same ``Model.successors`` the checker
explores, in plain Python.

1. **Checks before replay** (typed reasons, never exceptions): every line is an object with the
   standard fields, a known event name (``EVENTS``) and the fields the event needs
   (``REQUIRED_FIELDS``); ``seq`` starts at 1 and rises by one per ``(node, incarnation)`` log;
   ``t_local_ns`` never goes back within a log. Then what the per-key projection cannot see is
   checked directly, in the directory's own (total) log order: lease ids are never reused (any
   key, any kind, protocol property 8); a write is granted only under a COMMITTED parent and a copy is
   evicted only once its children are ABSENT (protocol property 10). A small shadow of the directory's
   records (phase, owner, parent, namespace) follows the directory's events for these checks
   and to resolve cascades.

2. **Projection per key.** The protocol is per key except for chains; each key of the trace gets
   its own one-key ``ModelConfig``, sized to its projection: every node of the trace, their tiers
   and one shared pool, lease term and epsilon in ticks, and budgets (epochs, lease ids, requests,
   crashes, restarts) at least what the projection uses, so that no scope bound ever refuses
   what the trace did. A projection holds the key's events, the failures (``crash``,
   ``restart_node``, ``restart_directory``: they apply to every key) and the cascades: an
   invalidation of an ancestor or of the key's namespace does to this key exactly what the
   spec's atomic multi-key step does to it (``Model._invalidate_into`` on this key alone).
   Real ids become spec indices: nodes and locations by a global table (``TraceParams.locations``
   says which node hosts a location, or ``None`` for the shared pool; otherwise it is inferred
   from who logs the location's data-plane events); lease ids by a *binding* carried in each
   frontier element (the spec numbers leases per projection, so only the correspondence is
   checked, one-to-one); generations and epochs by value (both start at 0 for a fresh key, which
   is why a trace must start from a fresh directory).

3. **Frontier search.** A frontier element is ``(state, T, positions, binding)``: the spec state,
   true time in ticks since the first event, how far each log of the projection was consumed,
   and the lease binding. One level consumes one event: from each element, each *eligible* next
   event (the head of a log, no more than ``reorder_window_ms`` later in wall time than the
   earliest head -- the caller's order is one such linearisation), after any silent
   environment steps, must be matched by a spec step with the event's name and fields.
   ``reorder="lazy"`` (the default) leaves the caller's order only where an element is stuck on
   the caller's next event (a receive logged before its send, clocks within epsilon);
   ``"full"`` tries every eligible event from every element (complete within the window, and
   exponential in the number of concurrent events); ``"none"`` keeps the caller's order. Lazy
   reordering can miss an order in which the caller's next event was possible but wrong (say a
   crash logged before a grant it truly followed); re-check such a rejection with ``"full"``.
   Elements are deduplicated; more than ``max_frontier`` is INCONCLUSIVE.

4. **Silent steps and time.** Between two events, the environment may let time pass (``tick``)
   and step clocks (``clock_forward``, ``clock_back``), within the spec's own bounds. Clock steps
   multiply the frontier (each clock, stepped at each moment, leaves different timers), so they
   are taken only at the ticks an event may happen at; and an
   event's true time is already an interval of epsilon around its own clock's reading, which
   absorbs any constant offset; so by default (``clock_steps="on_reject"``) a projection is first
   replayed without them and, only if that rejects it, replayed again with them: leaving steps
   out can only reject more, so the second pass decides. Messages are
   never dropped by the validator: a message that is never delivered explains everything a lost
   one does, as long as the network has room (``max_messages``; filling it is INCONCLUSIVE, not
   REJECTED). Duplication is allowed up to ``max_duplications`` per projection. A delivery the
   receiver ignores (a stale grant, a write to a down location, ...) changes nothing but the
   network and is likewise never needed.

   Time: tick ``T`` covers true times ``[T, T+1) * tick_ms`` after the first event. An event with
   wall time ``w`` happened at a true time within ``skew_ms`` of ``w`` (the spec's clock
   assumption: clocks differ by at most epsilon), so its tick lies in the *interval*
   ``[floor((w - w0 - skew) / tick), ceil((w - w0 + skew) / tick)]`` -- never a point. ``tick_ms``
   must divide the lease term and epsilon, so that the model's term and epsilon in ticks are the
   real ones exactly; rounding happens only in that interval, widened outward on both sides,
   which can only make the validator accept more, never reject a behaviour the real clocks
   allowed. Directory timers are urgent in the spec (``tick`` is disabled while a write lease's
   time is up or an invalidation may complete), so a directory that logs such a step later
   than epsilon after it was due is REJECTED.

5. **Verdicts.** ``Verdict.status`` is ACCEPTED, REJECTED (``event_index``, ``event``, a
   ``code`` among ``REJECT_CODES``, ``reason``, and ``diff``: the event, what it needed, and the
   relevant variables of the closest frontier states) or INCONCLUSIVE (``code`` among
   ``INCONCLUSIVE_CODES``). Every matched step's post-state is also checked against the spec's
   invariants and step properties (``check_invariants``).

Fields each event must carry (beyond the standard ``node, incarnation, seq, t_local_ns,
t_wall_ns, event, key, gen, epoch, lease, result``; ``node`` is the logging process):

=======================  ============================================================================
event                    required (non-null)                                 [checked if present]
=======================  ============================================================================
acquire                  key                                     (node = the holder)
renew                    key, lease
abandon                  key                                     (the holder gives up its request)
read                     key, lease, location                    [gen; result "ok" = bytes returned]
release                  key, lease
trust_read_lease         key, lease, location, gen
trust_renewal            key, lease
drop_and_ack             key, lease
begin_write              key                                     (node = the writer)
abort                    key
start_writing            key, lease, location, gen, epoch
grant_read_lease         key, lease, gen, epoch, holder, location  (node = the directory)
refuse_read_lease        key, holder, result
renew_lease              key, lease, holder
refuse_renewal           key, lease, holder
release_lease            key, lease, holder
grant_write_lease        key, lease, gen, epoch, writer, location  [parent, namespace: SHOULD;
                                                                 MUST for chains / namespace scope]
refuse_write_lease       key, writer, result                     [parent]
commit_write             key, lease, gen, epoch, writer
reject_stale_commit      key, lease                              [writer, epoch]
expire_write_lease(_of_crashed)  key, lease                      [writer]
invalidate               key                                     (the root of the voided subtree)
invalidate_namespace     namespace                               (hex digest)
revoke_acked             key, lease, holder
complete_invalidation    key, gen
evict, evict_refused     key, location
start_transfer           key, location (the destination), epoch
finish_transfer          key, location
free_drained             key, location
retry_free, free_acked   key, location                           [epoch: the Free owed]
declare_node_down        down (the node declared down)           (node = the directory)
cancel_transfer          key
store_bytes              key, location, writer, lease, gen, epoch  (node = the location's host)
fence_stale_write        key, location, writer, lease, epoch
store_copy               key, location, epoch
free_slot                key, location, epoch
fence_stale_free         key, location, epoch
crash                    crashed (default: node)                 [lose_disk]  (a fault injector)
restart_node             rejoined, lost (list of locations)      (node = the directory)
restart_directory        -                                       (node = the directory)
=======================  ============================================================================

Not checked here: namespace authorisation (protocol property 11: the trace does not say which tenant may
use which namespace), and a directory's refusals for reasons outside the one-key model (an
unauthorised tenant, a parent not committed) are taken as the request being consumed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from attrs import field, frozen

from kvcc.reference.events import ENVIRONMENT_ACTIONS, EVENTS, STANDARD_FIELDS
from kvcc.spec.config import STATE_VALUE_LIMIT, ModelConfig
from kvcc.spec.layout import (
    COMMITTED,
    FULL,
    INVALIDATING,
    M_ACQUIRE,
    M_BEGIN_WRITE,
    MESSAGE_WIDTH,
    WRITING,
    ABSENT,
)
from kvcc.spec.model import SILENT_ACTIONS, Model
from kvcc.spec.vocabulary import LOCATION_SEPARATOR, location_host
from kvcc.spec.properties import INVARIANTS, TRANSITION_PROPERTIES

from ._render import RenderedWalk, ScriptError, events_from_spec_walk, render, scripted_walk, spec_walk  # noqa: F401 (re-exported)

ACCEPTED, REJECTED, INCONCLUSIVE = "ACCEPTED", "REJECTED", "INCONCLUSIVE"
COLOCATED_SEPARATOR = "."  # "<host>.<name>" logs as part of spec node <host> (see _Roles)
REJECT_CODES = (
    "malformed",  # not an object, a standard field missing or of the wrong type
    "unknown_event",  # an event name that is not a spec action a process logs
    "missing_field",  # a field the event needs (REQUIRED_FIELDS) is absent or null
    "seq_gap",  # seq of one (node, incarnation) log does not start at 1 or rise by one
    "clock_back",  # t_local_ns went back within one log
    "lease_id_reused",  # a lease id granted twice (protocol property 8)
    "parent_not_committed",  # a write granted under a parent that is not COMMITTED (protocol property 10)
    "evict_parent_first",  # a copy evicted while a child is not ABSENT (protocol property 10)
    "unknown_location",  # a location that cannot be placed on a node or the pool
    "no_spec_step",  # no frontier state can take the event
    "invariant",  # the only spec steps matching the event break a property
)
PROPERTY_MEMO_MAX = 200_000  # memoised property verdicts per projection (then the memo starts over)
INCONCLUSIVE_CODES = ("frontier_limit", "network_limit", "scope_limit")

# Spec steps no process logs: the environment's, and deliveries the receiver ignores (their state
# is the network without the message, the same as a loss, which the validator never needs). One
# list, the spec's (``kvcc.spec.model.SILENT_ACTIONS``).
assert set(ENVIRONMENT_ACTIONS) <= SILENT_ACTIONS and not SILENT_ACTIONS & set(EVENTS)

DIRECTORY_EVENTS = frozenset({
    "grant_read_lease", "refuse_read_lease", "renew_lease", "refuse_renewal", "release_lease",
    "grant_write_lease", "refuse_write_lease", "commit_write", "reject_stale_commit",
    "expire_write_lease", "expire_write_lease_of_crashed", "invalidate", "invalidate_namespace",
    "revoke_acked", "complete_invalidation", "evict", "evict_refused", "start_transfer",
    "finish_transfer", "free_drained", "cancel_transfer", "retry_free", "free_acked", "declare_node_down",
    "restart_node", "restart_directory",
})  # fmt: skip
HOLDER_EVENTS = frozenset({"acquire", "renew", "abandon", "read", "release", "trust_read_lease", "trust_renewal",
                           "drop_and_ack"})  # fmt: skip
WRITER_EVENTS = frozenset({"begin_write", "abort", "start_writing"})
LOCATION_EVENTS = frozenset({"store_bytes", "fence_stale_write", "store_copy", "free_slot", "fence_stale_free"})
FAILURE_EVENTS = frozenset({"crash", "restart_node", "restart_directory", "declare_node_down"})
assert DIRECTORY_EVENTS | HOLDER_EVENTS | WRITER_EVENTS | LOCATION_EVENTS | FAILURE_EVENTS == set(EVENTS)

REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "acquire": ("key",),
    "renew": ("key", "lease"),
    "abandon": ("key",),
    "read": ("key", "lease", "location"),
    "release": ("key", "lease"),
    "trust_read_lease": ("key", "lease", "location", "gen"),
    "trust_renewal": ("key", "lease"),
    "drop_and_ack": ("key", "lease"),
    "begin_write": ("key",),
    "abort": ("key",),
    "start_writing": ("key", "lease", "location", "gen", "epoch"),
    "grant_read_lease": ("key", "lease", "gen", "epoch", "holder", "location"),
    "refuse_read_lease": ("key", "holder", "result"),
    "renew_lease": ("key", "lease", "holder"),
    "refuse_renewal": ("key", "lease", "holder"),
    "release_lease": ("key", "lease", "holder"),
    "grant_write_lease": ("key", "lease", "gen", "epoch", "writer", "location"),
    "refuse_write_lease": ("key", "writer", "result"),
    "commit_write": ("key", "lease", "gen", "epoch", "writer"),
    "reject_stale_commit": ("key", "lease"),
    "expire_write_lease": ("key", "lease"),
    "expire_write_lease_of_crashed": ("key", "lease"),
    "invalidate": ("key",),
    "invalidate_namespace": ("namespace",),
    "revoke_acked": ("key", "lease", "holder"),
    "complete_invalidation": ("key", "gen"),
    "evict": ("key", "location"),
    "evict_refused": ("key", "location"),
    "start_transfer": ("key", "location", "epoch"),
    "finish_transfer": ("key", "location"),
    "free_drained": ("key", "location"),
    "retry_free": ("key", "location"),
    "free_acked": ("key", "location"),
    "declare_node_down": ("down",),
    "cancel_transfer": ("key",),
    "store_bytes": ("key", "location", "writer", "lease", "gen", "epoch"),
    "fence_stale_write": ("key", "location", "writer", "lease", "epoch"),
    "store_copy": ("key", "location", "epoch"),
    "free_slot": ("key", "location", "epoch"),
    "fence_stale_free": ("key", "location", "epoch"),
    "crash": (),
    "restart_node": ("rejoined", "lost"),
    "restart_directory": (),
}
assert set(REQUIRED_FIELDS) == set(EVENTS)

# What each event needs of the spec state, for the reader of a rejection.
NEEDS: dict[str, str] = {
    "acquire": "the holder up, no request pending on the key, room in the network",
    "abandon": "the holder up with a request pending on the key",
    "renew": "the holder trusting this lease, no request pending",
    "read": "the holder trusting this lease on this location (not expired on its clock)",
    "release": "the holder trusting this lease",
    "trust_read_lease": "a grant answering the holder's pending acquire in flight",
    "trust_renewal": "a renewal answering the holder's pending renew in flight",
    "drop_and_ack": "a revocation of this lease in flight to the holder",
    "begin_write": "the writer up with no write in progress on the key",
    "abort": "a write in progress at the writer",
    "start_writing": "a write grant in flight to a writer that asked",
    "grant_read_lease": "an acquire in flight; the key COMMITTED; no live lease of that holder",
    "refuse_read_lease": "an acquire in flight that the rules refuse (key not COMMITTED or already leased)",
    "renew_lease": "a renew in flight naming the live lease on the owner of a COMMITTED key",
    "refuse_renewal": "a renew in flight that the rules refuse",
    "release_lease": "a release of this lease in flight",
    "grant_write_lease": "a begin_write in flight; the key ABSENT (parent COMMITTED)",
    "refuse_write_lease": "a begin_write in flight that the rules refuse",
    "commit_write": "a commit in flight under the live write lease and the key's epoch",
    "reject_stale_commit": "a commit in flight that the rules reject",
    "expire_write_lease": "a WRITING key whose write lease ran out on the directory's clock",
    "expire_write_lease_of_crashed": "a WRITING key whose write lease ran out on the directory's clock",
    "invalidate": "the key COMMITTED (or nothing to void)",
    "invalidate_namespace": "-",
    "revoke_acked": "an acknowledgement in flight",
    "complete_invalidation": "the key INVALIDATING with no live lease, outside restart grace",
    "evict": "the copy known to the directory, unleased, children ABSENT, outside restart grace",
    "evict_refused": "a live lease on the copy",
    "start_transfer": "the key COMMITTED with no transfer or draining copy",
    "finish_transfer": "a copied notice in flight for the transfer under way",
    "free_drained": "a draining copy with no live lease on it, outside restart grace",
    "retry_free": "a Free owed to an up location, neither it nor its Freed in flight",
    "free_acked": "a Freed in flight answering the Free owed (epoch at least the owed one)",
    "declare_node_down": "the node down, undeclared, its failure-detection time run out",
    "cancel_transfer": "a transfer under way",
    "store_bytes": "the writer's bytes in flight to an up location, epoch at least the slot's fence",
    "fence_stale_write": "bytes in flight under an epoch below the slot's fence",
    "store_copy": "a copy order in flight, source holding the generation, epoch at least the fence",
    "free_slot": "a free in flight under an epoch at least the slot's fence",
    "fence_stale_free": "a free in flight under an epoch below the slot's fence",
    "crash": "the node up (and crash budget)",
    "restart_node": "the node down (a crash before it)",
    "restart_directory": "-",
}
assert set(NEEDS) == set(EVENTS)

MAX_TERM_TICKS = 100  # the model's counters are bytes: term + 2 epsilon must stay well below 256
MAX_PROJECTION_COUNT = STATE_VALUE_LIMIT - 6  # lease ids, epochs, requests per key projection


# -------------------------------------------------------------------------------------- values


def _positive_ms(instance: Any, attribute: Any, value: int) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


@frozen
class TraceParams:
    """How to read a trace. ``lease_term_ms`` and ``skew_ms`` (epsilon) are the implementation's;
    ``tick_ms`` quantises time (default: their greatest common divisor) and must divide both.
    ``locations`` maps each location id to the node hosting it, or ``None`` for the shared pool
    (inferred from the data-plane events where absent). ``reorder_window_ms`` (default
    ``skew_ms``): how much later in wall time than the earliest pending event of another log an
    event may still be taken first. Bounds: ``max_frontier`` elements per level,
    ``max_messages`` in flight per key, ``max_duplications`` per key."""

    lease_term_ms: int = field(validator=_positive_ms)
    skew_ms: int
    tick_ms: int | None = None
    max_frontier: int = 20_000
    max_env_steps: int = 8  # clock steps and duplications between two events of one projection
    max_duplications: int = 0
    max_messages: int = 32
    locations: Mapping[str, str | None] | None = None
    reorder: str | bool = "lazy"  # "lazy", "full" or "none" (True: "lazy", False: "none")
    reorder_window_ms: int | None = None
    check_invariants: bool = True
    diff_states: int = 3
    drift_ppm: int = 200  # how far a monotonic clock's rate may be off true time
    clock_steps: str = "on_reject"  # "never", "on_reject" (re-check a rejection with them), "always"

    def __attrs_post_init__(self) -> None:
        if type(self.skew_ms) is not int or not 0 <= self.skew_ms < self.lease_term_ms:
            raise ValueError("skew_ms must be an int in 0 .. lease_term_ms - 1")
        tick = self.effective_tick_ms
        if self.lease_term_ms % tick or self.skew_ms % tick:
            raise ValueError(f"tick_ms {tick} must divide lease_term_ms and skew_ms")
        if (self.lease_term_ms + 2 * self.skew_ms) // tick > MAX_TERM_TICKS:
            raise ValueError(f"lease term + 2 epsilon is over {MAX_TERM_TICKS} ticks of {tick} ms: pass a larger tick_ms")
        if self.reorder_mode not in ("lazy", "full", "none"):
            raise ValueError("reorder is 'lazy', 'full' or 'none'")
        if self.clock_steps not in ("never", "on_reject", "always"):
            raise ValueError("clock_steps is 'never', 'on_reject' or 'always'")
        for name in ("max_frontier", "max_messages"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1")

    @property
    def effective_tick_ms(self) -> int:
        if self.tick_ms is not None:
            if type(self.tick_ms) is not int or self.tick_ms < 1:
                raise ValueError("tick_ms must be an int >= 1")
            return self.tick_ms
        return math.gcd(self.lease_term_ms, self.skew_ms) if self.skew_ms else self.lease_term_ms

    @property
    def reorder_mode(self) -> str:
        if self.reorder is True:
            return "lazy"
        if self.reorder is False:
            return "none"
        return self.reorder

    @property
    def window_ms(self) -> int:
        return self.skew_ms if self.reorder_window_ms is None else self.reorder_window_ms


@frozen
class Verdict:
    status: str
    event_index: int | None = None
    event: dict | None = None
    reason: str = ""
    diff: dict | None = None
    frontier_max: int = 0
    states_explored: int = 0
    code: str | None = None

    @property
    def accepted(self) -> bool:
        return self.status == ACCEPTED

    def to_json(self) -> dict:
        return {
            "status": self.status, "code": self.code, "event_index": self.event_index, "event": self.event,
            "reason": self.reason, "diff": self.diff, "frontier_max": self.frontier_max,
            "states_explored": self.states_explored,
        }  # fmt: skip


class _Stop(Exception):
    """A verdict reached inside the replay (rejection or bound), carried out to the caller."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.reason)
        self.verdict = verdict


def _reject(index: int | None, event: Any, code: str, reason: str, diff: dict | None = None) -> _Stop:
    assert code in REJECT_CODES, code
    return _Stop(Verdict(REJECTED, index, event if isinstance(event, dict) else None, reason, diff, code=code))


def _inconclusive(index: int | None, event: Any, code: str, reason: str) -> _Stop:
    assert code in INCONCLUSIVE_CODES, code
    return _Stop(Verdict(INCONCLUSIVE, index, event if isinstance(event, dict) else None, reason, code=code))


# ------------------------------------------------------------------------------- checks, shadow


def _check_shapes(events: Sequence[Any]) -> None:
    last: dict[tuple[str, int], tuple[int, int]] = {}
    for i, ev in enumerate(events):
        if type(ev) is not dict:
            raise _reject(i, None, "malformed", f"event {i} is not a JSON object")
        for name in STANDARD_FIELDS:
            if name not in ev:
                if name == "event" or name in ("node", "incarnation", "seq", "t_local_ns", "t_wall_ns"):
                    raise _reject(i, ev, "malformed", f"event {i}: standard field {name!r} missing")
        if ev.get("event") not in REQUIRED_FIELDS:
            raise _reject(i, ev, "unknown_event", f"event {i}: {ev.get('event')!r} is not a spec action a process logs")
        if type(ev["node"]) is not str or not ev["node"]:
            raise _reject(i, ev, "malformed", f"event {i}: node is non-empty text")
        for name in ("incarnation", "seq", "t_local_ns", "t_wall_ns"):
            if type(ev[name]) is not int or ev[name] < 0:
                raise _reject(i, ev, "malformed", f"event {i}: {name} is an int >= 0")
        for name in ("gen", "epoch", "lease"):
            v = ev.get(name)
            if v is not None and (type(v) is not int or v < 0):
                raise _reject(i, ev, "malformed", f"event {i}: {name} is an int >= 0 or null")
        if ev.get("key") is not None and type(ev["key"]) is not str:
            raise _reject(i, ev, "malformed", f"event {i}: key is hex text or null")
        for name in REQUIRED_FIELDS[ev["event"]]:
            if ev.get(name) is None:
                raise _reject(i, ev, "missing_field", f"event {i} ({ev['event']}) needs {name!r}")
        if ev["event"] == "restart_node" and not isinstance(ev["lost"], list):
            raise _reject(i, ev, "malformed", f"event {i}: lost is a list of locations")
        log = (ev["node"], ev["incarnation"])
        prev_seq, prev_t = last.get(log, (0, -1))
        if ev["seq"] != prev_seq + 1:
            raise _reject(i, ev, "seq_gap", f"event {i}: seq {ev['seq']} of {log[0]!r} incarnation {log[1]} follows seq {prev_seq}")
        if ev["t_local_ns"] < prev_t:
            raise _reject(i, ev, "clock_back", f"event {i}: t_local_ns went back within {log[0]!r} incarnation {log[1]}")
        last[log] = (ev["seq"], ev["t_local_ns"])


class _Shadow:
    """The directory's records as its own events tell them (phase, owner, parent, namespace), for
    what a one-key projection cannot see: chains, cascades, lease-id uniqueness."""

    def __init__(self, host_of: Any) -> None:
        self.host_of = host_of  # the node a location is a tier of (None: the pool), as _Roles places it
        self.phase: dict[str, int] = {}
        self.owner: dict[str, Any] = {}
        self.parent: dict[str, str | None] = {}
        self.namespace: dict[str, str] = {}
        self.granted: dict[int, int] = {}  # lease id -> index of its grant

    def children(self, key: str) -> list[str]:
        return [k for k, p in self.parent.items() if p == key]

    def subtree(self, key: str) -> list[str]:
        out, stack = [], [key]
        while stack:
            k = stack.pop()
            if k not in out:
                out.append(k)
                stack.extend(self.children(k))
        return out

    def void(self, keys: Iterable[str]) -> None:
        for k in keys:
            ph = self.phase.get(k, ABSENT)
            if ph == COMMITTED:
                self.phase[k] = INVALIDATING
            elif ph == WRITING:
                self.phase[k] = ABSENT

    def step(self, i: int, ev: dict) -> list[str]:
        """Apply one directory event; return the keys (other than ``ev['key']``) it cascades to."""
        name, key = ev["event"], ev.get("key")
        if name in ("grant_read_lease", "grant_write_lease"):
            lease = ev["lease"]
            if lease in self.granted:
                raise _reject(i, ev, "lease_id_reused", f"event {i}: lease id {lease} was granted before, at event {self.granted[lease]}")
            self.granted[lease] = i
        if name == "grant_write_lease":
            parent = ev.get("parent")
            if parent is not None and self.phase.get(parent, ABSENT) != COMMITTED:
                raise _reject(i, ev, "parent_not_committed", f"event {i}: write granted under parent {str(parent)[:16]}… that is not COMMITTED")
            if "parent" in ev:
                self.parent[key] = parent
            if ev.get("namespace") is not None:
                self.namespace[key] = ev["namespace"]
            self.phase[key] = WRITING
            self.owner[key] = ev["location"]
        elif name == "commit_write":
            self.phase[key] = COMMITTED
        elif name in ("expire_write_lease", "expire_write_lease_of_crashed", "complete_invalidation"):
            self.phase[key] = ABSENT
        elif name == "finish_transfer":
            self.owner[key] = ev["location"]
        elif name == "evict":
            if ev["location"] == self.owner.get(key):
                if any(self.phase.get(c, ABSENT) != ABSENT for c in self.children(key)):
                    raise _reject(i, ev, "evict_parent_first", f"event {i}: a copy evicted while a child key is not ABSENT")
                self.phase[key] = ABSENT
        elif name == "invalidate":
            sub = self.subtree(key)
            if self.phase.get(key, ABSENT) == COMMITTED:
                self.void(sub)
            return sub[1:]
        elif name == "invalidate_namespace":
            keys = sorted(k for k, ns in self.namespace.items() if ns == ev["namespace"])
            self.void(keys)
            return keys
        elif name == "restart_node":
            lost = set(map(str, ev["lost"]))
            voided: list[str] = []
            for k in sorted(self.phase):
                owner, ph = self.owner.get(k), self.phase[k]
                if (ph == COMMITTED and str(owner) in lost) or (ph == WRITING and self.host_of(owner) == ev["rejoined"]):
                    voided += [j for j in self.subtree(k) if j not in voided]
            self.void(voided)
            return voided
        return []


# ---------------------------------------------------------------------------------------- roles


class _Roles:
    """Spec indices for real names: nodes, locations, the directory."""

    def __init__(self, events: Sequence[dict], params: TraceParams) -> None:
        nodes: list[str] = []
        # Co-located processes: a process named "<host>.<name>" (an engine's client next to cache
        # node <host>, which also logs under its own name) is the same spec node as <host>: the
        # spec's node is holder, writer and locations in one.
        # A location "<host>/<tier>" names its host likewise (LOCATION_SEPARATOR).
        hosts_named = {ev["node"] for ev in events} | {
            location_host(str(ev["location"]))
            for ev in events if isinstance(ev.get("location"), str) and LOCATION_SEPARATOR in ev["location"]
        }  # fmt: skip
        self._alias = {p: p.split(COLOCATED_SEPARATOR, 1)[0] for p in {ev["node"] for ev in events}
                       if COLOCATED_SEPARATOR in p and p.split(COLOCATED_SEPARATOR, 1)[0] in hosts_named}  # fmt: skip

        def node(name: Any) -> None:
            name = self._alias.get(name, name)
            if isinstance(name, str) and name and name not in nodes:
                nodes.append(name)

        directories: set[str] = set()
        for ev in events:
            name = ev["event"]
            if name in HOLDER_EVENTS or name in WRITER_EVENTS:
                node(ev["node"])
            if name in DIRECTORY_EVENTS:
                directories.add(ev["node"])
            for f in ("holder", "writer", "rejoined", "down"):
                node(ev.get(f))
            if name == "crash":
                node(ev.get("crashed") or ev["node"])
        self.nodes = nodes
        self.node_index = {n: i for i, n in enumerate(nodes)}
        self.directories = directories
        # Locations: given, else hosted by the spec node that logs its data-plane events, else by
        # the node of the same name, else the shared pool.
        hosts: dict[str, str | None] = {}
        if params.locations:
            hosts.update({str(k): v for k, v in params.locations.items()})
        seen: list[str] = []
        for ev in events:
            for f in ("location",):
                loc = ev.get(f)
                if loc is not None and str(loc) not in seen:
                    seen.append(str(loc))
            for loc in ev.get("lost") or () if ev["event"] == "restart_node" else ():
                if str(loc) not in seen:
                    seen.append(str(loc))
            if ev["event"] in LOCATION_EVENTS and ev.get("location") is not None:
                loc = str(ev["location"])
                if loc not in hosts:
                    host = self._alias.get(ev["node"], ev["node"])
                    hosts[loc] = host if host in self.node_index else None
        for loc in seen:
            if loc not in hosts:
                named = location_host(loc)
                hosts[loc] = loc if loc in self.node_index else (named if named in self.node_index else None)
        pools = [loc for loc in seen if hosts.get(loc) is None]
        if len(pools) > 1:
            raise _reject(None, None, "unknown_location", f"the spec has one shared pool; these locations are on no node: {pools}")
        tiers: dict[str, list[str]] = {}
        for loc in seen:
            h = hosts[loc]
            if h is not None:
                if h not in self.node_index:
                    node(h)
                    self.node_index[h] = len(self.nodes) - 1
                tiers.setdefault(h, []).append(loc)
        self.hosts = hosts
        self.tiers_per_node = max([1] + [len(v) for v in tiers.values()])
        self.pool = pools[0] if pools else None
        self.location_index: dict[str, int] = {}
        for h, locs in tiers.items():
            for t, loc in enumerate(locs):
                self.location_index[loc] = self.node_index[h] * self.tiers_per_node + t
        if self.pool is not None:
            self.location_index[self.pool] = len(self.nodes) * self.tiers_per_node
        if not self.nodes:
            self.nodes.append("-")  # a trace of directory events alone still needs one node
            self.node_index["-"] = 0

    def n(self, name: Any) -> int | None:
        return self.node_index.get(self._alias.get(name, name)) if isinstance(name, str) else None

    def host(self, location: Any) -> str | None:
        """The node (as the trace names it) that ``location`` is a tier of; ``None``: the pool."""
        return None if location is None else self.hosts.get(str(location))

    def loc(self, name: Any) -> int | None:
        return None if name is None else self.location_index.get(str(name))


# ----------------------------------------------------------------------------------- projection


@frozen
class _PEvent:
    index: int  # in the caller's order
    ev: dict
    mode: str  # "own", "cascade", "global"
    lo: int  # tick interval of the event's true time
    hi: int
    wall: int
    local: int


class _Replay:
    """The frontier search over one key's projection."""

    def __init__(
        self, key: str, pevents: list[_PEvent], roles: _Roles, params: TraceParams, counts: dict, clock_steps: bool
    ) -> None:
        self.key, self.roles, self.params = key, roles, params
        self.clock_steps = clock_steps
        self._property_memo: dict[tuple, str | None] = {}
        tick = params.effective_tick_ms
        nodes = len(roles.nodes)
        for name, value in counts.items():
            if value + 2 > MAX_PROJECTION_COUNT:
                raise _inconclusive(None, None, "scope_limit", f"key {key[:16]}…: {value} {name} in one projection, over the model's {MAX_PROJECTION_COUNT}")
        self.cfg = ModelConfig(
            name=f"trace:{key[:12]}", nodes=nodes, parents=(-1,), namespaces=(0,),
            authorized=tuple(frozenset({0}) for _ in range(nodes)), tiers_per_node=roles.tiers_per_node,
            shared_pool=True, tiering=counts["transfers"] > 0,
            lease_term_ticks=params.lease_term_ms // tick, skew_ticks=params.skew_ms // tick,
            max_epoch=counts["epochs"] + 1, max_lease_id=counts["leases"] + 1, max_requests=counts["requests"] + 1,
            max_messages=params.max_messages, max_duplications=params.max_duplications,
            max_node_crashes=counts["crashes"], max_directory_restarts=counts["restarts"],
        )  # fmt: skip
        self.model = Model(self.cfg)
        self.L = self.model.L
        logs: dict[tuple[str, int], list[_PEvent]] = {}
        for pe in pevents:
            logs.setdefault((pe.ev["node"], pe.ev["incarnation"]), []).append(pe)
        self.logs = list(logs.values())
        self.total = len(pevents)
        self._succ: dict[bytes, list] = {}
        self.states_explored = 0
        self.frontier_max = 1

    # -- spec access --------------------------------------------------------------------------

    def successors(self, s: bytes) -> list:
        out = self._succ.get(s)
        if out is None:
            out = self.model.successors(s)
            self.states_explored += 1
            if len(self._succ) > 200_000:
                self._succ.clear()
            self._succ[s] = out
        return out

    def _time_steps(self, s: bytes) -> list:
        L = self.L
        out: list = []
        fixed = s[: L.fixed]
        net = [s[i : i + MESSAGE_WIDTH] for i in range(L.fixed, len(s), MESSAGE_WIDTH)]
        self.model._time(s, fixed, net, out)
        if not self.clock_steps:
            out = [st for st in out if st[0] == "tick"]
        return out

    def _env_closure(self, states: set[bytes]) -> set[bytes]:
        """Clock steps (and duplications, within budget) from ``states``, time standing still."""
        if not self.clock_steps and not self.params.max_duplications:
            return states
        seen = set(states)
        todo = list(states)
        rounds = 0
        while todo and rounds < self.params.max_env_steps:
            rounds += 1
            nxt = []
            for s in todo:
                steps = [st for st in self._time_steps(s) if st[0] != "tick"]
                if self.params.max_duplications and s[self.L.dups_left]:
                    steps += [st for st in self.successors(s) if st[0] == "duplicate"]
                for _, _, s2 in steps:
                    if s2 not in seen:
                        seen.add(s2)
                        nxt.append(s2)
            todo = nxt
        return seen

    def _closure(self, s: bytes, T: int, lo: int, hi: int) -> list[tuple[bytes, int]]:
        """Every (state, tick) the environment can reach from ``(s, T)`` with the tick in ``[lo, hi]``."""
        # Clock steps are taken only at the moments events may happen (ticks in ``[lo, hi]``),
        # not at every tick of the gap: fewer behaviours, each one the spec's.
        out: list[tuple[bytes, int]] = []
        layer = {s}
        t = T
        while True:
            if t >= lo:
                out.extend((x, t) for x in self._env_closure(layer))
            if t >= hi:
                break
            nxt: set[bytes] = set()
            for x in layer:
                for name, _, x2 in self._time_steps(x):
                    if name == "tick":
                        nxt.add(x2)
            if not nxt:
                break  # a directory timer is due: time cannot pass until its step is taken
            self.states_explored += len(nxt)
            if nxt == layer and t + 1 < lo:
                t = lo  # nothing runs any more: jump to the interval
                layer = nxt
                continue
            layer = nxt
            t += 1
        return out

    # -- matching ------------------------------------------------------------------------------

    def _bind(self, binding: tuple, real: int, spec: int) -> tuple | None:
        """Extend the lease binding with ``real <-> spec`` if one-to-one; ``None`` if it clashes."""
        for r, sp in binding:
            if r == real:
                return binding if sp == spec else None
            if sp == spec:
                return None
        return tuple(sorted(binding + ((real, spec),)))

    def _match(self, pe: _PEvent, s: bytes, binding: tuple) -> list[tuple[bytes, tuple, str, tuple, bytes]]:
        """Spec steps from ``s`` that ``pe`` may be: ``(post, binding, label, params, pre)``."""
        ev, L, R = pe.ev, self.L, self.roles
        name = ev["event"]
        out: list = []
        if pe.mode == "cascade":
            # The spec's atomic multi-key invalidation (of an ancestor, or of the namespace), as
            # it acts on this key.
            assert name in ("invalidate", "invalidate_namespace"), name
            return [(self._void(s), binding, "invalidate", (0,), s)]

        def bound(b: tuple | None, real: Any, spec: int) -> tuple | None:
            if b is None:
                return None
            if real is None:
                return b
            return self._bind(b, real, spec)

        if name == "restart_node":
            n = R.n(ev["rejoined"])
            starts = [s]
            if s[L.up[n]]:
                # kill -9 is logged by no one: a rejoin implies the crash before it.
                lose = 1 if ev["lost"] else 0
                starts = [s2 for lab, p, s2 in self.successors(s) if lab == "crash" and p == (n, lose)]
                if not starts and lose == 1:
                    starts = [s2 for lab, p, s2 in self.successors(s) if lab == "crash" and p == (n, 0)]
            for s1 in starts:
                for lab, p, s2 in self.successors(s1):
                    if lab == "restart_node" and p == (n,):
                        if ev.get("_cascade"):
                            s2 = self._void(s2)
                        out.append((s2, binding, lab, p, s1))
            return out
        if name == "invalidate":
            if s[L.phase[0]] != COMMITTED and s[L.phase[0]] != WRITING:
                return [(s, binding, "invalidate", (0,), s)]  # nothing to void: no step
            labels = ("invalidate",)
        elif name == "invalidate_namespace":
            return [(self._void(s), binding, "invalidate", (0,), s)]
        elif name in ("expire_write_lease", "expire_write_lease_of_crashed"):
            labels = ("expire_write_lease", "expire_write_lease_of_crashed")
        else:
            labels = (name,)
        for lab, p, s2 in self.successors(s):
            if lab not in labels:
                if lab == "drop" and name in ("refuse_read_lease", "refuse_write_lease"):
                    # A refusal for a reason outside the one-key model (tenant, parent): the
                    # request is consumed and nothing else changes.
                    kind = M_ACQUIRE if name == "refuse_read_lease" else M_BEGIN_WRITE
                    who = R.n(ev["holder"] if name == "refuse_read_lease" else ev["writer"])
                    if p[0] == kind and p[1] == who and ev.get("result") in ("unauthorized", "parent_not_committed"):
                        out.append((s2, binding, lab, p, s))
                continue
            b = self._check(pe, lab, p, s, s2, binding, bound)
            if b is not None:
                out.append((s2, b, lab, p, s))
        return out

    def _void(self, s: bytes) -> bytes:
        m, L = self.model, self.L
        b = bytearray(s[: L.fixed])
        net = [s[i : i + MESSAGE_WIDTH] for i in range(L.fixed, len(s), MESSAGE_WIDTH)]
        m._invalidate_into(s, b, net, (0,))
        return m._pack(b, net)

    def _check(self, pe: _PEvent, lab: str, p: tuple, s: bytes, s2: bytes, binding: tuple, bound) -> tuple | None:
        """Do the step's parameters and effects agree with the event's fields? The new binding."""
        ev, L, R = pe.ev, self.L, self.roles
        name = ev["event"]
        lease = ev.get("lease")
        actor = R.n(ev["node"])
        loc = R.loc(ev.get("location"))

        def eq(a: Any, b: Any) -> bool:
            return a is None or a == b

        if name in HOLDER_EVENTS or name in WRITER_EVENTS:
            if p[0] != actor:
                return None
            n = actor
            if name in ("renew", "release", "read"):
                if name == "read":
                    if not eq(loc, s[L.h_loc[n][0]] - 1) or not eq(ev.get("gen"), s[L.h_gen[n][0]]):
                        return None
                    if ev.get("result") == "ok":
                        # A completed read returns the leased generation's bytes (protocol property 4).
                        if s[L.s_status[loc][0]] != FULL or s[L.s_gen[loc][0]] != s[L.h_gen[n][0]]:
                            return None
                return bound(binding, lease, s[L.h_id[n][0]])
            if name in ("trust_read_lease", "trust_renewal", "drop_and_ack"):
                b = bound(binding, lease, p[2])
                if b is not None and name == "trust_read_lease":
                    if not (eq(loc, s2[L.h_loc[n][0]] - 1) and eq(ev.get("gen"), s2[L.h_gen[n][0]])):
                        return None
                return b
            if name == "start_writing":
                if not (eq(loc, s2[L.wr_loc[n][0]] - 1) and eq(ev["gen"], s2[L.wr_gen[n][0]]) and eq(ev["epoch"], s2[L.wr_epoch[n][0]])):
                    return None
                return bound(binding, lease, p[2])
            return binding  # acquire, begin_write, abort
        if name in LOCATION_EVENTS:
            if name in ("store_bytes", "fence_stale_write"):
                if p != (R.n(ev["writer"]), 0, loc):
                    return None
                # The bytes that landed (or were fenced) are the message's.
                msgs = self._delivered(s, s2)
                if name == "store_bytes":
                    if s2[L.s_gen[loc][0]] != ev["gen"] or s2[L.s_epoch[loc][0]] != ev["epoch"]:
                        return None
                    spec_lease = msgs[0][3] if msgs else None
                else:
                    spec_lease = msgs[0][3] if msgs else None
                    if msgs and msgs[0][6] != ev["epoch"]:
                        return None
                return binding if spec_lease is None else bound(binding, lease, spec_lease)
            if p[1] != loc:
                return None
            msgs = self._delivered(s, s2)
            if msgs and msgs[0][6] != ev["epoch"]:
                return None
            return binding
        # Directory events.
        if name in ("grant_read_lease", "refuse_read_lease", "renew_lease", "refuse_renewal", "release_lease", "revoke_acked"):
            if p[0] != R.n(ev["holder"]):
                return None
            if name == "grant_read_lease":
                n = p[0]
                if not (eq(loc, s2[L.r_loc[0][n]] - 1) and ev["gen"] == s[L.gen[0]] and ev["epoch"] == s[L.epoch[0]]):
                    return None
            return binding if len(p) < 3 else bound(binding, lease, p[2])
        if name in ("grant_write_lease", "refuse_write_lease", "commit_write", "reject_stale_commit"):
            w = R.n(ev.get("writer"))
            if ev.get("writer") is not None and p[0] != w:
                return None
            if name == "grant_write_lease":
                if p[2] != loc or ev["gen"] != s2[L.gen[0]] or ev["epoch"] != s2[L.epoch[0]]:
                    return None
                return bound(binding, lease, s2[L.w_id[0]])
            if name == "commit_write":
                if ev["gen"] != s2[L.gen[0]] or ev["epoch"] != s2[L.epoch[0]]:
                    return None
            return binding if len(p) < 3 else bound(binding, lease, p[2])
        if name in ("expire_write_lease", "expire_write_lease_of_crashed"):
            return bound(binding, lease, s[L.w_id[0]])
        if name in ("evict", "evict_refused", "start_transfer", "finish_transfer"):
            if p[1] != loc:
                return None
            if name == "start_transfer" and ev["epoch"] != s2[L.epoch[0]]:
                return None
            return binding
        if name == "free_drained":
            return binding if s[L.draining[0]] - 1 == loc else None
        if name in ("retry_free", "free_acked"):
            if p[1] != loc:
                return None
            owed = s[L.to_free[loc][0]]
            return binding if ev.get("epoch") is None or ev["epoch"] == owed else None
        if name == "complete_invalidation":
            return binding if ev["gen"] == s[L.gen[0]] else None
        if name == "declare_node_down":
            return binding if p[0] == R.n(ev["down"]) else None
        if name == "crash":
            n = R.n(ev.get("crashed") or ev["node"])
            lose = ev.get("lose_disk")
            if p[0] != n or (lose is not None and p[1] != int(bool(lose))):
                return None
            return binding
        return binding  # invalidate, cancel_transfer, restart_directory

    def _delivered(self, s: bytes, s2: bytes) -> list[bytes]:
        """The message(s) the step took off the network."""
        L = self.L
        old = [s[i : i + MESSAGE_WIDTH] for i in range(L.fixed, len(s), MESSAGE_WIDTH)]
        new = [s2[i : i + MESSAGE_WIDTH] for i in range(L.fixed, len(s2), MESSAGE_WIDTH)]
        for m in new:
            if m in old:
                old.remove(m)
        return old

    def _properties(self, lab: str, p: tuple, pre: bytes, post: bytes) -> str | None:
        """The first property the step breaks, or None. The frontier meets the same steps again
        and again (one per frontier element that can take them), so verdicts are memoised: the
        predicates are pure functions of (pre, label, params, post)."""
        memo = self._property_memo
        k = (pre, lab, p, post)
        if k in memo:
            return memo[k]
        if len(memo) >= PROPERTY_MEMO_MAX:
            memo.clear()
        m = self.model
        verdict = None
        for inv in INVARIANTS:
            if not inv.holds(m, post):
                verdict = inv.name
                break
        else:
            for tp in TRANSITION_PROPERTIES:
                if not tp.holds(m, pre, lab, p, post):
                    verdict = tp.name
                    break
        memo[k] = verdict
        return verdict

    # -- the search ----------------------------------------------------------------------------

    def _window(self, pe: _PEvent, j: int, pos: tuple[int, ...], last: tuple[int, ...]) -> tuple[int, int]:
        """The ticks ``pe`` may happen at: its wall-clock interval, narrowed by its own process's
        monotonic clock since that log's previous event (true time passes at the clock's rate,
        up to ``drift_ppm``): ``Δlocal`` crosses ``floor`` or ``ceil(Δlocal / tick)`` ticks."""
        lo, hi = pe.lo, pe.hi
        if pos[j] > 0:
            prev = self.logs[j][pos[j] - 1]
            d = pe.local - prev.local
            slack = d * self.params.drift_ppm // 1_000_000
            tick_ns = self.params.effective_tick_ms * 1_000_000
            lo = max(lo, last[j] + (d - slack) // tick_ns)
            hi = min(hi, last[j] - (-(d + slack) // tick_ns))
        return lo, hi

    def _eligible(self, pos: tuple[int, ...]) -> list[int]:
        heads = [(self.logs[j][pos[j]], j) for j in range(len(self.logs)) if pos[j] < len(self.logs[j])]
        if not heads:
            return []
        if self.params.reorder_mode == "none":
            return [min(heads, key=lambda h: h[0].index)[1]]
        earliest = min(h[0].wall for h in heads)
        window = self.params.window_ms * 1_000_000
        heads.sort(key=lambda h: h[0].index)
        # The caller's next event is always a candidate; others within the clock window too.
        return [j for n, (pe, j) in enumerate(heads) if n == 0 or pe.wall <= earliest + window]

    def run(self) -> None:
        init = self.model.init_states()[0]
        # (state, tick, events consumed per log, lease binding, tick of each log's last event)
        frontier: dict[tuple, None] = {(init, 0, (0,) * len(self.logs), (), (-1,) * len(self.logs)): None}
        for _level in range(self.total):
            nxt: dict[tuple, None] = {}
            broke: str | None = None
            full = False
            lazy = self.params.reorder_mode == "lazy"
            for s, T, pos, binding, last in frontier:
                before = len(nxt)
                for n_choice, j in enumerate(self._eligible(pos)):
                    if lazy and n_choice > 0 and len(nxt) > before:
                        break  # the caller's next event could be taken: keep the caller's order
                    pe = self.logs[j][pos[j]]
                    lo, hi = self._window(pe, j, pos, last)
                    if hi < max(lo, T):
                        continue
                    pos2 = pos[:j] + (pos[j] + 1,) + pos[j + 1 :]
                    for x, t in self._closure(s, T, max(lo, T), hi):
                        last2 = last[:j] + (t,) + last[j + 1 :]
                        for post, b2, lab, p, pre in self._match(pe, x, binding):
                            if len(post) >= self.L.fixed + MESSAGE_WIDTH * self.cfg.max_messages:
                                full = True
                            if self.params.check_invariants:
                                bad = self._properties(lab, p, pre, post)
                                if bad is not None:
                                    broke = bad
                                    continue
                            nxt[(post, t, pos2, b2, last2)] = None
                    if len(nxt) > self.params.max_frontier:
                        raise _inconclusive(pe.index, pe.ev, "frontier_limit", f"key {self.key[:16]}…: more than {self.params.max_frontier} possible states at event {pe.index}")
            if not nxt:
                self._fail(frontier, broke, full)
            self.frontier_max = max(self.frontier_max, len(nxt))
            frontier = nxt

    def _fail(self, frontier: dict, broke: str | None, full: bool) -> None:
        # The event to blame: the earliest (caller's order) that some element could have taken.
        best: _PEvent | None = None
        for _, _, pos, _, _ in frontier:
            for j in self._eligible(pos):
                pe = self.logs[j][pos[j]]
                if best is None or pe.index < best.index:
                    best = pe
        assert best is not None
        ev = best.ev
        if full:
            raise _inconclusive(best.index, ev, "network_limit", f"key {self.key[:16]}…: the network of the projection filled up (max_messages={self.cfg.max_messages})")
        diff = self._diff(frontier, best)
        if broke is not None:
            raise _reject(best.index, ev, "invariant", f"event {best.index} ({ev['event']}): the only matching spec steps break {broke}", diff)
        raise _reject(
            best.index, ev, "no_spec_step",
            f"event {best.index} ({ev['event']} by {ev['node']!r}, key {str(ev.get('key'))[:16]}…): no spec state can take it; "
            f"it needs {NEEDS[ev['event']]}", diff,
        )  # fmt: skip

    def _diff(self, frontier: dict, pe: _PEvent) -> dict:
        L, R, ev = self.L, self.roles, pe.ev
        nodes = {R.n(ev.get(f)) for f in ("node", "holder", "writer", "rejoined", "crashed")} - {None}
        locs = {R.loc(ev.get("location"))} - {None}

        def relevant(name: str) -> bool:
            if name.startswith(("record[", "directory.", "ghost.")):
                return True
            if any(f"n{n}," in name or f"n{n}]" in name for n in nodes):
                return True
            return any(f"l{loc}," in name for loc in locs)

        closest = []
        for s, T, pos, binding, _ in list(frontier)[: self.params.diff_states]:
            reach = self._closure(s, T, max(pe.lo, T), pe.hi) or [(s, T)]
            x, t = reach[-1]
            vars_ = {k: v for k, v in L.variables(x).items() if relevant(k)}
            closest.append({
                "tick": t, "variables": vars_, "in_flight": [L.message_text(m) for m in L.messages(x)],
                "leases": {str(r): sp for r, sp in binding}, "time_reachable": bool(self._closure(s, T, max(pe.lo, T), pe.hi)),
            })  # fmt: skip
        return {
            "event": {k: v for k, v in ev.items() if not str(k).startswith("_")},
            "needed": NEEDS[ev["event"]],
            "tick_interval": [pe.lo, pe.hi],
            "nodes": {n: R.nodes[n] for n in sorted(nodes)},
            "closest": closest,
        }


# ------------------------------------------------------------------------------------ top level


def _interval(wall: int, w0: int, params: TraceParams) -> tuple[int, int]:
    tick_ns = params.effective_tick_ms * 1_000_000
    eps_ns = params.skew_ms * 1_000_000
    d = wall - w0
    lo = max(0, math.floor((d - eps_ns) / tick_ns))
    hi = max(0, math.ceil((d + eps_ns) / tick_ns))
    return lo, hi


def validate_trace(events: Sequence[dict], params: TraceParams) -> Verdict:
    """Replay ``events`` (every component's protocol events of one run, merged in one order
    consistent with each log's ``seq`` and with causality; see the module docstring) through the
    spec and return the verdict."""
    try:
        return _validate(events, params)
    except _Stop as stop:
        return stop.verdict


def _validate(events: Sequence[dict], params: TraceParams) -> Verdict:
    _check_shapes(events)
    if not events:
        return Verdict(ACCEPTED, reason="an empty trace", frontier_max=1)
    roles = _Roles(events, params)
    for i, ev in enumerate(events):
        for f in ("location",):
            if ev.get(f) is not None and roles.loc(ev[f]) is None:
                raise _reject(i, ev, "unknown_location", f"event {i}: location {ev[f]!r} is on no node and not the pool")
        for f in ("holder", "writer", "rejoined"):
            if ev.get(f) is not None and roles.n(ev[f]) is None:
                raise _reject(i, ev, "malformed", f"event {i}: {f} {ev[f]!r} is not a node name")
    shadow = _Shadow(roles.host)
    w0 = min(ev["t_wall_ns"] for ev in events)
    keys: list[str] = []
    for ev in events:
        k = ev.get("key")
        if k is not None and ev["event"] != "invalidate_namespace" and k not in keys:
            keys.append(k)
    per_key: dict[str, list[_PEvent]] = {k: [] for k in keys}
    counts = {k: {"epochs": 0, "leases": 0, "requests": 0, "transfers": 0, "crashes": 0, "restarts": 0} for k in keys}
    requests: dict[tuple[str, str], int] = {}
    for i, ev in enumerate(events):
        name = ev["event"]
        lo, hi = _interval(ev["t_wall_ns"], w0, params)
        cascade: list[str] = []
        if name in DIRECTORY_EVENTS:
            cascade = shadow.step(i, ev)
        if name in FAILURE_EVENTS:
            extra = {"_cascade": True} if name == "restart_node" else {}
            for k in keys:
                e = dict(ev, **extra) if (extra and k in cascade) else ev
                per_key[k].append(_PEvent(i, e, "global", lo, hi, ev["t_wall_ns"], ev["t_local_ns"]))
                if name != "declare_node_down":
                    counts[k]["crashes" if name != "restart_directory" else "restarts"] += 1
            continue
        own = ev.get("key") if name != "invalidate_namespace" else None
        if own is not None:
            per_key[own].append(_PEvent(i, ev, "own", lo, hi, ev["t_wall_ns"], ev["t_local_ns"]))
            c = counts[own]
            if name in ("grant_write_lease", "start_transfer"):
                c["epochs"] += 1
            if name in ("grant_read_lease", "grant_write_lease"):
                c["leases"] += 1
            if name in ("acquire", "renew"):
                r = requests[(own, ev["node"])] = requests.get((own, ev["node"]), 0) + 1
                c["requests"] = max(c["requests"], r)
            if name == "start_transfer":
                c["transfers"] += 1
        for k in cascade:
            if k != own and k in per_key:
                per_key[k].append(_PEvent(i, ev, "cascade", lo, hi, ev["t_wall_ns"], ev["t_local_ns"]))
    explored, fmax = 0, 1
    verdicts: list[Verdict] = []
    passes = {"never": (False,), "on_reject": (False, True), "always": (True,)}[params.clock_steps]
    for k in keys:
        for clock_steps in passes:
            replay = None
            try:
                replay = _Replay(k, per_key[k], roles, params, counts[k], clock_steps)
                replay.run()
                verdict = None
            except _Stop as stop:
                verdict = stop.verdict
            if replay is not None:
                explored += replay.states_explored
                fmax = max(fmax, replay.frontier_max)
            if verdict is None or verdict.status != REJECTED or verdict.code not in ("no_spec_step", "invariant"):
                break  # accepted, inconclusive, or rejected for a reason clocks cannot change
        if verdict is not None:
            verdicts.append(verdict)
    rejected = [v for v in verdicts if v.status == REJECTED]
    if rejected:
        first = min(rejected, key=lambda v: -1 if v.event_index is None else v.event_index)
        return _with_stats(first, fmax, explored)
    if verdicts:
        return _with_stats(verdicts[0], fmax, explored)
    return Verdict(ACCEPTED, reason=f"{len(events)} events, {len(keys)} keys", frontier_max=fmax, states_explored=explored)


def _with_stats(v: Verdict, fmax: int, explored: int) -> Verdict:
    return Verdict(v.status, v.event_index, v.event, v.reason, v.diff, fmax, explored, v.code)


def params_for_walk(walk: RenderedWalk, **overrides: Any) -> TraceParams:
    """The ``TraceParams`` a rendered spec walk is read with (its term, epsilon, tick, locations)."""
    kw: dict[str, Any] = dict(tick_ms=walk.tick_ms, locations=walk.locations)
    kw.update(overrides)
    return TraceParams(walk.lease_term_ms, walk.skew_ms, **kw)


def validate_file(path: str | os.PathLike[str], params: TraceParams) -> Verdict:
    """Validate an NDJSON trace file (the merged log, in the order to replay)."""
    events: list[Any] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                events.append(json.loads(line))
            except ValueError as e:
                return Verdict(REJECTED, len(events), None, f"line {number}: not JSON ({e})", code="malformed")
    return validate_trace(events, params)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvcc.conformance.validate TRACE --lease-term-ms N --skew-ms N``: prints the
    verdict as JSON; exit status 0 ACCEPTED, 1 REJECTED, 2 INCONCLUSIVE."""
    ap = argparse.ArgumentParser(prog="kvcc-validate", description="validate an NDJSON protocol trace against the spec")
    ap.add_argument("trace")
    ap.add_argument("--lease-term-ms", type=int, required=True)
    ap.add_argument("--skew-ms", type=int, required=True)
    ap.add_argument("--tick-ms", type=int, default=None)
    ap.add_argument("--max-frontier", type=int, default=20_000)
    ap.add_argument("--reorder", choices=("lazy", "full", "none"), default="lazy")
    args = ap.parse_args(argv)
    params = TraceParams(
        args.lease_term_ms, args.skew_ms, tick_ms=args.tick_ms, max_frontier=args.max_frontier, reorder=args.reorder
    )
    verdict = validate_file(args.trace, params)
    json.dump(verdict.to_json(), sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    return {ACCEPTED: 0, REJECTED: 1, INCONCLUSIVE: 2}[verdict.status]


if __name__ == "__main__":
    raise SystemExit(main())


validate_trace_reference = validate_trace
