"""Trace validation: replay what processes logged through the spec's successor function.

Theory of operation
-------------------
An implementation logs one NDJSON line per spec action it performed (``kvcc.reference.events``).
This module answers whether *some* behaviour of the spec (``kvcc.spec.model``) explains the whole
merged log -- ACCEPTED --, or names the first event no spec state could take -- REJECTED, with a
diff --, or gives up within named bounds -- INCONCLUSIVE. It is TLC's trace validation (a
frontier of possible states, time as intervals) over the same transitions the checker explores
(``Model.apply``, the successors of one action), in plain Python.

1. **Checks before replay** (typed reasons, never exceptions): every line is an object with the
   standard fields, a known event name (``EVENTS``) and the fields the event needs
   (``REQUIRED_FIELDS``); ``seq`` starts at 1 and rises by one per ``(node, incarnation)`` log;
   ``t_local_ns`` never goes back within a log. Then what the per-key projection cannot see is
   checked directly, in the directory's own (total) log order: lease ids are never reused (any
   key, any kind, protocol property 8); a write is granted only under a COMMITTED parent and a copy is
   evicted only once its children are ABSENT (protocol property 10). A small shadow of the directory's
   records (phase, owner, parent, namespace) follows the directory's events for these checks
   and to resolve cascades (one shadow per shard of a sharded directory, section 6).

2. **Projection per key.** The protocol is per key except for chains; each key of the trace gets
   its own one-key ``ModelConfig``, sized to its projection: every node of the trace, their tiers
   and one shared pool, lease term and epsilon in ticks, and budgets (epochs, lease ids, requests,
   crashes, restarts) at least what the projection uses, so that no scope bound ever refuses
   what the trace did. A projection holds the key's events, the failures (``crash``,
   ``restart_node``, ``restart_directory``, ``declare_node_down``: they apply to every key, or
   to every key of the shard that logged them, section 6) and the cascades: an
   invalidation of an ancestor or of the key's namespace does to this key exactly what the
   spec's atomic multi-key step does to it (``Model._invalidate_into`` on this key alone).
   Real ids become spec indices: nodes and locations by a global table (``TraceParams.locations``
   says which node hosts a location, or ``None`` for the shared pool; otherwise it is inferred
   from who logs the location's data-plane events); lease ids by a *binding* carried in each
   frontier element (the spec numbers leases per projection, so only the correspondence is
   checked, one-to-one, for the spec ids still in use: ``_Replay._live``); generations and epochs by value (both start at 0 for a fresh key, which
   is why a trace must start from a fresh directory).

3. **Frontier search.** A frontier element is ``(state, T, positions, binding, shared ticks)``:
   the spec state, true time in ticks since the first event, how far each log of the projection
   was consumed, the lease binding, and the ticks it gave the failures (below). One level
   consumes one event: each event is replayed as its own action with its own parameters
   (``Model.apply(label, params, state)``: the one generator of the spec that can produce it,
   never the whole successor set), after time has passed, and must agree with the event's
   fields. *Eligible* next events are log heads no more than ``reorder_window_ms`` later in
   wall time than the earliest head, and never the events of a process's incarnation while an
   earlier incarnation of it has events left (a restarted process acts after its old
   incarnation ended, whatever the clocks say). ``reorder="lazy"`` (the default) searches in
   passes, each run only if the one before rejected the projection: *narrow* (every element
   takes the caller's next event of its own cut; only if no element can, an element tries the
   others), *lazy* (each element leaves the caller's order where it alone is stuck), the same
   without merging ghost ages (below), then with clock steps (4). Each pass explores a superset
   of the one before, so the last pass run decides. ``"full"`` tries every eligible event from
   every element; ``"none"`` keeps the caller's order. Lazy reordering can miss an order in
   which the caller's next event was possible but wrong; re-check such a rejection with
   ``"full"``. Elements are deduplicated; more than ``max_frontier`` is INCONCLUSIVE.

   What keeps the frontier small: elements that differ only in the ticks of their logs' last
   events are one element (the monotonic-clock narrowing of ``_clock_steps`` then uses the union:
   looser than any one of them, never looser than the wall-clock interval); elements that
   differ only in *ghost ages* (true ticks since a phase began, a request left, ...; read only
   by the progress properties, as ``age <= bound``, and by no guard) are one element with the
   oldest age of each, so that a merged survivor stands for survivors (sound), and a rejection
   it causes is re-checked without merging; replies to a holder's request that is no longer
   pending are dropped (request numbers only grow: they are ignored for ever; the spec may lose
   any message); each (event, state, binding) is matched once per level. Spec lease ids and
   request numbers in use are renumbered in order past ``RENUMBER_AT``, so a projection may hold
   any number of leases and requests.

   One time for shared events. A failure is in every projection, a cascade in each of its
   subtree's: each element of a projection carries the ticks its behaviours gave the failures
   as a *box*, a set of ticks per failure (settled out of the elements once all agree), and the
   projections must share one assignment of ticks to all failures; each cascade needs one tick
   every projection of its subtree took it at (``shared_event_time``). Elements alike but for
   one failure's ticks are one, with the union of those ticks (two boxes that differ in one
   coordinate are exactly one box): without it, n failures (a directory restarted fourteen
   times) multiply the frontier by the product of their windows.

4. **Silent steps and time.** Between two events, the environment may let time pass (``tick``,
   the model's own, ``Model.tick``, memoised; a gap in which a tick changes nothing is skipped
   at once) and step clocks (``clock_forward``, ``clock_back``), within the spec's own bounds.
   Clock steps multiply the frontier (each clock, stepped at each moment, leaves different
   timers), so they are taken only at the ticks an event may happen at; and an event's true
   time is already an interval of epsilon around its own clock's reading, which absorbs any
   constant offset; so by default (``clock_steps="on_reject"``) a projection is first
   replayed without them and, only if that rejects it, replayed again with them: leaving steps
   out can only reject more, so the last pass decides. Messages are
   never dropped by the validator but for the stale replies above: a message that is never
   delivered explains everything a lost one does, as long as the network has room
   (``max_messages`` per projection: the spec's network bound is the checker's scope, not a real
   network's, and it is not summed over projections; once a projection's network has filled --
   a send into it lost -- a rejection of it is INCONCLUSIVE, not REJECTED, at whatever event). Duplication is allowed up to
   ``max_duplications`` per projection. A delivery the receiver ignores (a stale grant, a write
   to a down location, ...) changes nothing but the network and is likewise never needed.

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

   Wall-clock steps: ``w`` is ``t_wall_ns`` with the forward steps of the wall clock taken out
   (``_Shapes.wall_steps``): a line of a log whose wall time is more than epsilon further
   ahead of its ``t_local_ns`` than the line before, and the log's next line as far, shows a
   step (a virtual machine paused while its monotonic clock stood still and then set right:
   seen on CI as a write-lease expiry "logged 1475 ms late" that no process's clock had seen
   pass; one line ahead and the next back is a thread descheduled between its two clock
   reads). The step is no time the processes saw, so every event after it, in every log on
   that clock, is placed that much earlier; a log whose lines on both sides of it do not show
   it is on another clock and keeps its stamps. A step on both clocks (a directory that took
   its timer late) is not a wall-clock step.

   Memory: two streaming passes (shapes and roles, then the shadow and each key's projection as
   packed indices, 4 bytes an event), and each key's events fetched again only for its replay;
   ``validate_file`` keeps 4 bytes of offset per line (of a file under 4 GiB), not the events.
   The verdict stops early once no key left can be rejected before a rejection found.

5. **Verdicts.** ``Verdict.status`` is ACCEPTED, REJECTED (``event_index``, ``event``, a
   ``code`` among ``REJECT_CODES``, ``reason``, and ``diff``: the event, what it needed, and the
   relevant variables of the closest frontier states) or INCONCLUSIVE (``code`` among
   ``INCONCLUSIVE_CODES``). Every matched step's post-state is also checked against the spec's
   invariants and step properties (``check_invariants``). As in the checker, an invariant is
   re-evaluated only where a group it reads (``Invariant.reads``) differs from a state it held
   on: the frontier element the step was taken from, when that is a post-state as checked; the
   other invariants hold on the post-state as they did there.

6. **Sharded directories** (``docs/sharding.md``). A trace in which several processes log
   directory events (``"directory-0"``, ``"directory-1"``, ...: one per shard, each with its own
   incarnations) is N independent directories over disjoint keys sharing the nodes. A key
   belongs to the process that logs its first directory step other than a refusal of a lease
   (``_Roles.key_directory``; a key only ever refused belongs to the first process that refused
   it); a directory step of it logged by another is REJECTED (``key_in_two_shards``: a chain
   lives in its root's shard, and a child granted in a shard that does not hold its parent is
   ``parent_not_committed`` there), except a refusal of a read or write lease, which a shard
   holding no record of the key gives a client that asked it before the key existed where it
   does (a ``wrong_shard``, or a child under a parent no shard held yet): such a refusal changes
   nothing of the key in any shard, and is replayed as the request's loss (``_foreign``). Each shard has its own shadow, in its own log order (chains,
   cascades, eviction order); lease ids are checked across all of them (the shards hand out
   disjoint ids). The failure events a directory logs -- ``restart_directory``,
   ``declare_node_down``, ``restart_node`` (a node's rejoin, as that shard took it) -- and its
   cascades (a namespace's invalidation voids that shard's keys of it) enter only its own keys'
   projections, at their own times; a ``crash`` is every key's. A key no directory logged a step
   of (requests never answered) takes the failures of the first directory to log an event. The
   check of one time per failure (``_shared_time_conflict``) then spans the projections that
   hold the failure. A trace of one directory process is replayed exactly as before.

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
grant_write_lease        key, lease, gen, epoch, writer, location, namespace; parent present
                                                                 (null for a root block)
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
import functools
import json
import math
import operator
import os
import pickle
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from attrs import define, field, frozen

try:  # parsing is most of the validator's single-process passes over a file
    from orjson import loads as _fast_loads
except ImportError:  # optional: the standard parser gives the same events
    _fast_loads = None

from kvcc.reference.events import ENVIRONMENT_ACTIONS, EVENTS, STANDARD_FIELDS
from kvcc.spec.config import STATE_VALUE_LIMIT, ModelConfig
from kvcc.spec.layout import (
    COMMITTED,
    FULL,
    INVALIDATING,
    M_ACQUIRE,
    M_BEGIN_WRITE,
    M_GRANT_READ,
    M_REFUSE,
    M_RENEWED,
    MESSAGE_WIDTH,
    NO_LEASE,
    P_NONE,
    REFUSED_READ,
    W_REQUESTED,
    WRITING,
    ABSENT,
)
from kvcc.spec import model as model_module
from kvcc.spec import properties
from kvcc.spec.model import SILENT_ACTIONS, Model
from kvcc.spec.properties import INVARIANTS, TRANSITION_PROPERTIES
from kvcc.spec.vocabulary import (
    HOLDER,
    LOCATION,
    LOCATION_SEPARATOR,
    REASON_KEY_IDENTITY,
    REASON_LOCATION_DOWN,
    REASON_PARENT_NOT_COMMITTED,
    REASON_UNAUTHORIZED,
    REASON_WRONG_SHARD,
    WRITER,
    location_host,
    taken_by,
)

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
    "shared_event_time",  # a failure or cascade each projection explains only at other times
    "key_in_two_shards",  # a key's directory steps logged by two directory processes (a sharded directory)
)
PROPERTY_MEMO_MAX = 200_000  # memoised property verdicts per projection (then the memo starts over)
ADVANCE_MEMO_MAX = 100_000  # memoised ticks per projection (then the memo starts over)
_NO_BOXES = frozenset({()})  # an element's shared ticks before any shared event: one empty box
# Boxes an element keeps exactly; past it, their hull (per shared event, every tick any of them
# gave it). The search is not affected -- boxes are only what the projection tells the check
# across projections (``_shared_time_conflict``) -- and the hull is a superset, so that check
# may then miss a conflict among those events' ticks (it never finds one that is not there).
# Without a bound, a projection through 16 failures kept thousands of boxes per element, and
# joining them took more time than the search.
MAX_BOXES = 64
MATCH_MEMO_MAX = 200_000  # memoised matches per model (``_Replay._matched``; then the memo starts over)
# The fields of an event that matching it reads (``_Replay._match``, ``_check``, ``_step_params``),
# but its lease id, which only the binding reads: with the event's mode, the event in model terms.
_MATCHED_FIELDS = ("event", "node", "location", "gen", "epoch", "result", "holder", "writer", "down", "crashed",
                   "lose_disk", "rejoined", "lost", "grace_ms", "_cascade")
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
HOLDER_EVENTS, WRITER_EVENTS, LOCATION_EVENTS = taken_by(HOLDER), taken_by(WRITER), taken_by(LOCATION)
# Refusals for reasons the one-key model has no rule for: each is replayed as the request's loss.
_DROPPING_REFUSALS = {
    "refuse_read_lease": (REASON_UNAUTHORIZED, REASON_PARENT_NOT_COMMITTED),
    "refuse_write_lease": (REASON_UNAUTHORIZED, REASON_PARENT_NOT_COMMITTED, REASON_LOCATION_DOWN, REASON_KEY_IDENTITY,
                           REASON_WRONG_SHARD),
}
FAILURE_EVENTS = frozenset({"crash", "restart_node", "restart_directory", "declare_node_down"})
assert DIRECTORY_EVENTS | HOLDER_EVENTS | WRITER_EVENTS | LOCATION_EVENTS | FAILURE_EVENTS == set(EVENTS)
# The directory's steps on one key: the process that logs them owns the key (one shard of a
# sharded directory, ``_Roles.key_directory``). The directory's failure events and a namespace's
# invalidation name no key of their own; and a ``wrong_shard`` refusal is by its nature the step
# of a shard that does not own the key (``_owns``).
_KEYED_DIRECTORY_EVENTS = DIRECTORY_EVENTS - FAILURE_EVENTS - {"invalidate_namespace"}


def _owns(name: str, ev: dict) -> bool:
    """Whether the directory event ``ev`` (named ``name``) is a step of the shard that owns its key."""
    return name in _KEYED_DIRECTORY_EVENTS and not (name == "refuse_write_lease" and ev.get("result") == REASON_WRONG_SHARD)


# A refusal of a lease: the one step of a key a shard that holds no record of it may take (a
# client that asked there before the key existed where it does), so it names no owner unless no
# other step of the key does, and from another shard than the owner it is the request's loss.
_LEASE_REFUSALS = frozenset({"refuse_read_lease", "refuse_write_lease"})

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
    "grant_write_lease": ("key", "lease", "gen", "epoch", "writer", "location", "namespace"),  # and "parent", present (null for a root)
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
MAX_PROJECTION_COUNT = STATE_VALUE_LIMIT - 6  # epochs (and lease ids, requests before renumbering) per projection
RENUMBER_AT = 200  # spec lease ids and request numbers past this are renumbered (``_Replay._renumber``)
RENUMBERED = ("leases", "requests")
assert RENUMBER_AT + 32 < MAX_PROJECTION_COUNT  # room for the ids one level can add before renumbering


# Messages that carry a lease id (at field a, index 3), and where a request number sits in those
# that carry one: the spec's own tables (its properties and its lost-message ghost read them).
_CARRIES_LEASE = properties._CARRIES_LEASE
_REQUEST_FIELD = model_module._READ_EXCHANGE_REQUEST
# Replies to a holder's request, and where they carry the request number.
_READ_REPLY = {kind: f for kind, f in _REQUEST_FIELD.items() if kind in (M_GRANT_READ, M_RENEWED, M_REFUSE)}
_READ_REPLY_KINDS = frozenset(_READ_REPLY)
_READ_REQUEST = {kind: f for kind, f in _REQUEST_FIELD.items() if kind not in _READ_REPLY}  # acquire, renew
_READ_EXCHANGE_KINDS = _READ_REPLY_KINDS | frozenset(_READ_REQUEST)
STALE_REQUEST = 0  # the number every stale request is renumbered to (``_drop_stale``; real ones start at 1)
_PROGRESS_NAMES = frozenset(inv.name for inv in INVARIANTS if inv.kind == "progress")


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
    max_messages: int = 64
    locations: Mapping[str, str | None] | None = None
    reorder: str | bool = "lazy"  # "lazy", "full" or "none" (True: "lazy", False: "none")
    reorder_window_ms: int | None = None
    check_invariants: bool = True
    diff_states: int = 3
    drift_ppm: int = 200  # how far a monotonic clock's rate may be off true time
    clock_steps: str = "on_reject"  # "never", "on_reject" (re-check a rejection with them), "always"
    jobs: int | None = None  # processes replaying key projections (None: one per CPU, on long traces)

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
        if self.jobs is not None and (type(self.jobs) is not int or self.jobs < 1):
            raise ValueError("jobs must be None or an int >= 1")

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


URGENT_STEPS = frozenset({"expire_write_lease", "expire_write_lease_of_crashed", "complete_invalidation", "retry_free"})


def _reject(index: int | None, event: Any, code: str, reason: str, diff: dict | None = None) -> _Stop:
    assert code in REJECT_CODES, code
    return _Stop(Verdict(REJECTED, index, event if isinstance(event, dict) else None, reason, diff, code=code))


def _inconclusive(index: int | None, event: Any, code: str, reason: str) -> _Stop:
    assert code in INCONCLUSIVE_CODES, code
    return _Stop(Verdict(INCONCLUSIVE, index, event if isinstance(event, dict) else None, reason, code=code))


# ------------------------------------------------------------------------------- checks, shadow


def _check_shapes(events: Iterable[Any]) -> int | None:
    """Check every event's shape; the earliest wall time, or ``None`` for no events."""
    shapes = _Shapes()
    for _ in shapes.checked(events):
        pass
    return shapes.w0


@define
class _LogClock:
    """What ``_Shapes`` follows of one log's clocks: its first and last wall time, the offset
    ``t_wall_ns - t_local_ns`` of its clock so far and the wall time of the line that set it,
    and a step seen on one line, not yet confirmed (wall before, wall at, gain)."""

    first: int
    last: int
    offset: int
    at: int
    pending: tuple[int, int, int] | None = None


class _Shapes:
    """Every event's shape checked as it passes (``checked``), so that the pass that reads the
    roles checks the shapes too (one parse of a file fewer); the earliest wall time seen; and the
    wall-clock steps the logs show (``wall_steps``, then ``wall``: module docstring, section 4)."""

    def __init__(self, step_ns: int | None = None) -> None:
        self.w0: int | None = None
        self._step_ns = step_ns  # a wall clock that gains more than this on t_local has stepped
        self._walls: dict[tuple[str, int], _LogClock] = {}
        self._seen: list[tuple[int, int, int, tuple[str, int], bool]] = []  # (wall before, wall after, gain, log, confirmed)
        self._steps: list[tuple[int, int, frozenset]] = []  # (cut, gain, logs that showed it), by cut
        self._skip: dict[tuple[str, int], list[tuple[int, int]]] = {}  # per log: the steps not its own

    def wall_steps(self) -> list[tuple[int, int, frozenset]]:
        """The forward steps of the wall clock the logs show, once the events have passed:
        ``(cut, gain, logs)``: events stamped at or after ``cut`` (wall ns) were stamped ``gain``
        ns late. A step shows in a log as a line whose ``t_wall_ns`` is more than ``step_ns``
        further ahead of its ``t_local_ns`` than before, and stays so on the log's next line (a
        virtual machine paused while its monotonic clock stood still, then its wall clock set
        right; an NTP step). One line ahead and the next back is not a step: the thread was
        descheduled between reading its two clocks. A log's last line cannot be confirmed by its
        own log, so it counts only with a confirmed detection of the same step in another log.
        Detections whose gains agree within ``step_ns`` and whose moments overlap are one step.
        The cut is where no line of any log on that clock can be (between the last moment before
        the step and the first after), so each event falls on its side."""
        seen = list(self._seen)
        for log, c in self._walls.items():
            if c.pending is not None:
                seen.append((*c.pending, log, False))
        clusters: list[list] = []  # [post lo, post hi, gain, logs, confirmed]
        for before, after, gain, log, confirmed in sorted(seen, key=lambda d: d[0] + d[2]):
            lo, hi = before + gain, after  # the step's moment, on the clock after it
            c = clusters[-1] if clusters else None
            if c is not None and lo <= c[1] and hi >= c[0] and abs(gain - c[2]) <= (self._step_ns or 0):
                c[0], c[1] = max(c[0], lo), min(c[1], hi)
                c[3].add(log)
                c[4] = c[4] or confirmed
            else:
                clusters.append([lo, hi, gain, {log}, confirmed])
        self._steps = [((hi - gain + lo) // 2, gain, frozenset(logs)) for lo, hi, gain, logs, ok in clusters if ok]
        self._skip = {}
        for log, c in self._walls.items():
            # A log with lines on both sides of a step that did not show it is on another clock.
            self._skip[log] = [(cut, gain) for cut, gain, logs in self._steps if log not in logs and c.first < cut <= c.last]
        return self._steps

    def wall(self, ev: dict) -> int:
        """``ev``'s wall time with the steps before it taken out (``wall_steps`` first)."""
        w = ev["t_wall_ns"]
        if not self._steps:
            return w
        skip = self._skip.get((ev["node"], ev["incarnation"]), ())
        return w - sum(gain for cut, gain, _ in self._steps if cut <= w and (cut, gain) not in skip)

    def checked(self, events: Iterable[Any]) -> Iterator[dict]:
        last: dict[tuple[str, int], tuple[int, int]] = {}
        for i, ev in enumerate(events):
            self._check(i, ev, last)
            yield ev

    def _check(self, i: int, ev: Any, last: dict[tuple[str, int], tuple[int, int]]) -> None:
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
        if ev["event"] == "grant_write_lease" and "parent" not in ev:
            # null is a root block; absent, the chain (and every cascade along it) is unknowable.
            raise _reject(i, ev, "missing_field", f"event {i} (grant_write_lease) needs 'parent' (the parent key's hex, or null for a root block)")
        if ev["event"] == "restart_node" and not isinstance(ev["lost"], list):
            raise _reject(i, ev, "malformed", f"event {i}: lost is a list of locations")
        log = (ev["node"], ev["incarnation"])
        prev_seq, prev_t = last.get(log, (0, -1))
        if ev["seq"] != prev_seq + 1:
            raise _reject(i, ev, "seq_gap", f"event {i}: seq {ev['seq']} of {log[0]!r} incarnation {log[1]} follows seq {prev_seq}")
        if ev["t_local_ns"] < prev_t:
            raise _reject(i, ev, "clock_back", f"event {i}: t_local_ns went back within {log[0]!r} incarnation {log[1]}")
        last[log] = (ev["seq"], ev["t_local_ns"])
        wall = ev["t_wall_ns"]
        if self.w0 is None or wall < self.w0:
            self.w0 = wall
        if self._step_ns is not None:
            self._follow_offset(log, wall, wall - ev["t_local_ns"])

    def _follow_offset(self, log: tuple[str, int], wall: int, offset: int) -> None:
        """One line of ``log``: its wall time and ``t_wall_ns - t_local_ns`` (see ``wall_steps``)."""
        c = self._walls.get(log)
        if c is None:
            self._walls[log] = _LogClock(wall, wall, offset, wall)
            return
        c.last = max(c.last, wall)
        pending, limit = c.pending, self._step_ns
        if pending is not None:
            c.pending = None
            before, at, gain = pending
            if abs(offset - (c.offset + gain)) <= limit:  # still ahead: the clock stepped
                self._seen.append((before, at, gain, log, True))
                c.offset, c.at = offset, wall
                return
        if offset - c.offset > limit:
            c.pending = (c.at, wall, offset - c.offset)  # confirmed, or not, by the next line
        else:
            c.offset, c.at = offset, wall  # the clock as it is now (a drift, or back from a glitch)


class _Shadow:
    """The directory's records as its own events tell them (phase, owner, parent, namespace), for
    what a one-key projection cannot see: chains, cascades, lease-id uniqueness. One per
    directory process (each shard of a sharded directory has its own records and log order)."""

    def __init__(self, host_of: Callable[[Any], str | None], granted: dict[int, int] | None = None) -> None:
        self.host_of = host_of  # the node a location is a tier of (None: the pool), as _Roles places it
        self.phase: dict[str, int] = {}
        self.owner: dict[str, Any] = {}
        self.parent: dict[str, str | None] = {}
        self.namespace: dict[str, str] = {}
        # lease id -> index of its grant; one table for every shard's shadow (ids are unique
        # across the shards of a sharded directory: shard i hands out ids = i mod N)
        self.granted: dict[int, int] = {} if granted is None else granted

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
            home = ev["rejoined"]
            for k in sorted(self.phase):
                # A committed copy the node came back without, or a write in progress to one of its
                # tiers (``rules.lost_copy_invalidates``): the key is voided, the write aborted.
                owner = self.owner.get(k)
                ph = self.phase[k]
                if (ph == COMMITTED and str(owner) in lost) or (ph == WRITING and self.host_of(owner) == home):
                    voided += [j for j in self.subtree(k) if j not in voided]
            self.void(voided)
            return voided
        return []


# ---------------------------------------------------------------------------------------- roles


class _Roles:
    """Spec indices for real names: nodes, locations, the directory process(es) and which one
    owns each key."""

    def __init__(self, events: Iterable[dict], params: TraceParams) -> None:
        # One pass over the events (a trace may be a file read line by line), keeping only the
        # names; then the same placement as if each question were asked of the whole trace.
        processes: set[str] = set()
        named_hosts: set[str] = set()
        raw_nodes: dict[str, None] = {}  # in order of first appearance, before aliasing
        directories: dict[str, int] = {}  # directory process -> its number, in order of first event
        key_directory: dict[str, int] = {}  # key -> the directory process that logged its first step
        key_refuser: dict[str, int] = {}  # key -> the first directory process that refused it a lease
        seen: dict[str, None] = {}
        logged_by: dict[str, str] = {}  # location -> the first process logging its data plane
        for ev in events:
            name = ev["event"]
            processes.add(ev["node"])
            loc = ev.get("location")
            if isinstance(loc, str) and LOCATION_SEPARATOR in loc:
                named_hosts.add(location_host(loc))
            if name in HOLDER_EVENTS or name in WRITER_EVENTS:
                raw_nodes.setdefault(ev["node"])
            if name in DIRECTORY_EVENTS:
                d = directories.get(ev["node"])
                if d is None:
                    d = directories[ev["node"]] = len(directories)
                if _owns(name, ev):
                    k = ev.get("key")
                    if k is not None and k not in key_directory:
                        if name not in _LEASE_REFUSALS:
                            key_directory[k] = d
                        else:
                            key_refuser.setdefault(k, d)
            for f in ("holder", "writer", "rejoined", "down"):
                v = ev.get(f)
                if isinstance(v, str) and v:
                    raw_nodes.setdefault(v)
            if name == "crash":
                v = ev.get("crashed") or ev["node"]
                if isinstance(v, str) and v:
                    raw_nodes.setdefault(v)
                    named_hosts.add(v)  # a crashed host names a node, whether or not it logged
            if loc is not None:
                seen.setdefault(str(loc))
            if name == "restart_node":
                for lost in ev.get("lost") or ():
                    seen.setdefault(str(lost))
                    if LOCATION_SEPARATOR in str(lost):
                        named_hosts.add(location_host(str(lost)))
                if isinstance(ev.get("rejoined"), str) and ev["rejoined"]:
                    named_hosts.add(ev["rejoined"])
            if name in LOCATION_EVENTS and loc is not None:
                logged_by.setdefault(str(loc), ev["node"])
                if isinstance(loc, str) and LOCATION_SEPARATOR in loc and location_host(loc) == ev["node"]:
                    # A cache node that only stores and serves (every holder and writer is a
                    # process of its own, e.g. an engine's client) is a spec node all the same.
                    raw_nodes.setdefault(ev["node"])
        # Co-located processes: a process named "<host>.<name>" (an engine's client next to cache
        # node <host>, which also logs under its own name) is the same spec node as <host>: the
        # spec's node is holder, writer and locations in one.
        # A location "<host>/<tier>" names its host likewise (LOCATION_SEPARATOR).
        hosts_named = processes | named_hosts
        self._alias = {p: p.split(COLOCATED_SEPARATOR, 1)[0] for p in processes
                       if COLOCATED_SEPARATOR in p and p.split(COLOCATED_SEPARATOR, 1)[0] in hosts_named}  # fmt: skip
        nodes: list[str] = []

        def node(name: Any) -> None:
            name = self._alias.get(name, name)
            if isinstance(name, str) and name and name not in nodes:
                nodes.append(name)

        for raw in raw_nodes:
            node(raw)
        self.nodes = nodes
        self.node_index = {n: i for i, n in enumerate(nodes)}
        # The processes that log directory steps: one for a directory, one per shard for a sharded
        # one (``"directory-<i>"``); each key's steps must all come from one of them (its shard).
        self.directories = directories
        for k, d in key_refuser.items():  # a key only ever refused: the first refuser's
            key_directory.setdefault(k, d)
        self.key_directory = key_directory
        # Locations: given, else hosted by the spec node that logs its data-plane events, else by
        # the node of the same name, else the shared pool.
        hosts: dict[str, str | None] = {}
        if params.locations:
            hosts.update({str(k): v for k, v in params.locations.items()})
        for loc, process in logged_by.items():
            if loc not in hosts:
                host = self._alias.get(process, process)
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

    def loc(self, name: Any) -> int | None:
        return None if name is None else self.location_index.get(str(name))

    def host(self, location: Any) -> str | None:
        """The node (as the trace names it) that ``location`` is a tier of; ``None``: the pool."""
        return None if location is None else self.hosts.get(str(location))


GHOST_AGES = ("phase_age", "owner_down_age", "orphan_age", "p_age")  # Layout fields; see _Replay


def ghost_age_indices(L: Any) -> list[int]:
    """The state indices of the ghost ages (``GHOST_AGES``) this layout has."""
    out: list[int] = []

    def walk(v: Any) -> None:
        if isinstance(v, int):
            out.append(v)
        else:
            for x in v:
                walk(x)

    for name in GHOST_AGES:
        walk(getattr(L, name, ()))
    return sorted(out)


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


def _event_signature(pe: _PEvent) -> tuple:
    """What matching reads of ``pe`` (``_MATCHED_FIELDS`` and its mode), hashable."""
    values = tuple(map(pe.ev.get, _MATCHED_FIELDS))
    try:
        hash(values)
    except TypeError:  # a list ("lost") or another unhashable value: as JSON text
        values = tuple(json.dumps(v, sort_keys=True, default=str) if isinstance(v, (list, dict)) else v for v in values)
    return (pe.mode, "_foreign" in pe.ev) + values  # a foreign refusal is matched apart (``_foreign``)


class _InvariantReads:
    """What each invariant reads, by group (``Invariant.reads``: the layout's groups and
    "messages", the contract the checker's incremental re-evaluation relies on; none declared:
    everything), and the invariants to evaluate on a state that differs from one where all held
    in a given set of groups (``to_check``, memoised per set: a bit per group, the network last)."""

    def __init__(self, L: Any) -> None:
        self.slices = tuple(L.groups.values()) + (slice(L.fixed, None),)
        bit = {name: 1 << i for i, name in enumerate(L.groups)}
        bit["messages"] = 1 << len(L.groups)
        everything = (bit["messages"] << 1) - 1
        self.checks = tuple((inv.holds, inv.name) for inv in INVARIANTS)
        self.masks = tuple(sum(bit[g] for g in set(inv.reads)) or everything for inv in INVARIANTS)
        self._memo: dict[int, tuple[tuple[Callable, str], ...]] = {}

    def to_check(self, ref: bytes, post: bytes) -> tuple[tuple[Callable, str], ...]:
        """The invariants (``(predicate, name)``, in ``INVARIANTS`` order) that read a group in
        which ``post`` differs from ``ref``."""
        changed, bit = 0, 1
        for sl in self.slices:
            if ref[sl] != post[sl]:
                changed |= bit
            bit <<= 1
        got = self._memo.get(changed)
        if got is None:
            got = self._memo[changed] = tuple(c for c, mask in zip(self.checks, self.masks) if changed & mask)
        return got


class _SpecContext:
    """One ``Model`` and the memos of its pure functions (successors, a tick, the invariants,
    the step properties, the steps an event may be), shared by every projection of one
    ``validate_trace`` call with the same model configuration (and ghost-age merging): each memo
    is keyed by everything its value depends on (states as bytes, events in model terms), so an
    entry is valid in any projection with the same model."""

    def __init__(self, cfg: ModelConfig, contexts: dict) -> None:
        model = None
        for other in contexts.values():
            if other.model.cfg == cfg:
                model = other.model  # the same model, with or without merging ghost ages
                break
        self.model = model if model is not None else Model(cfg)
        self.succ: dict[bytes, list] = {}
        self.tick_memo: dict[bytes, bytes | None] = {}
        self.invariant_memo: dict[bytes, str | None] = {}
        self.property_memo: dict[tuple, str | None] = {}
        self.invariant_reads = _InvariantReads(self.model.L)
        self.match_memo: dict[tuple, tuple] = {}
        self.signatures: dict[tuple, int] = {}  # ``_event_signature`` -> a small int, its name in ``match_memo``
        self.next_signature = 0


class _Replay:
    """The frontier search over one key's projection."""

    def __init__(
        self, key: str, pevents: list[_PEvent], roles: _Roles, params: TraceParams, counts: dict, clock_steps: bool,
        narrow: bool = False, shared: frozenset[int] = frozenset(), cascades: frozenset[int] = frozenset(),
        merge_ages: bool = True, contexts: dict | None = None, share_matches: bool = False,
    ) -> None:
        self.key, self.roles, self.params = key, roles, params
        # Events in other projections too (failures, cascades): the ticks each accepted
        # behaviour gave them, settled (one tick in every behaviour) or per behaviour.
        self.shared = shared
        # Cascades (an invalidation of an ancestor or a namespace, in each key's projection):
        # the ticks any element took each at. Carrying them in the elements as the failures are
        # would keep apart elements that never meet again, for every invalidation of a prefix.
        self.cascades = cascades
        self.cascade_ticks: dict[int, set[int]] = {}
        self.settled: dict[int, frozenset[int]] = {}
        self.shared_ticks: set[tuple] = set()
        self.clock_steps = clock_steps
        self.narrow = narrow
        self._tick_ns = params.effective_tick_ms * 1_000_000
        self._eligible_memo: dict[tuple[int, ...], list[int]] = {}
        tick = params.effective_tick_ms
        nodes = len(roles.nodes)
        for name, value in counts.items():
            if name in RENUMBERED:
                continue  # renumbered as the replay goes (``_renumber``): no bound
            if value + 2 > MAX_PROJECTION_COUNT:
                raise _inconclusive(None, None, "scope_limit", f"key {key[:16]}…: {value} {name} in one projection, over the model's {MAX_PROJECTION_COUNT}")
        # The epoch, lease-id and request budgets are guards only (``Model``: a grant or a request
        # the budget refuses), never state: each is set to the most the state's bytes allow
        # (``MAX_PROJECTION_COUNT``), not to the projection's own count. In a projection the
        # spec's epoch rises only at the key's own logged grants and transfers, its lease counter
        # only at its logged grants (renumbering only lowers it) and a node's request number only
        # at its logged requests, so a budget of the projection's count never refused a step of
        # any element either: the successors of every reachable state are the same. So
        # projections alike in nodes, tiers, failures and tiering share one ``Model`` and the
        # memos of its pure functions (``_SpecContext``).
        self.cfg = ModelConfig(
            name="trace", nodes=nodes, parents=(-1,), namespaces=(0,),
            authorized=tuple(frozenset({0}) for _ in range(nodes)), tiers_per_node=roles.tiers_per_node,
            shared_pool=True, tiering=counts["transfers"] > 0,
            lease_term_ticks=params.lease_term_ms // tick, skew_ticks=params.skew_ms // tick,
            max_epoch=MAX_PROJECTION_COUNT, max_lease_id=MAX_PROJECTION_COUNT, max_requests=MAX_PROJECTION_COUNT,
            max_messages=params.max_messages, max_duplications=params.max_duplications,
            max_node_crashes=counts["crashes"], max_directory_restarts=counts["restarts"],
            mirrored_leases=True,  # a restart's grace is logged (``_grace_ticks``): a full one is one of these
        )  # fmt: skip
        if contexts is None:
            contexts = {}
        ctx = contexts.get((self.cfg, merge_ages))
        if ctx is None:
            ctx = contexts[(self.cfg, merge_ages)] = _SpecContext(self.cfg, contexts)
        self.model = ctx.model
        self.L = self.model.L
        # The ghost ages (true ticks since a phase began, a request left, an owner went down, bytes
        # were orphaned) only the progress properties read, each as "age <= its bound"; no guard
        # reads them (``tests/test_validate.py`` checks that on the model). Elements that differ
        # only in them behave alike: merged into one with the oldest age of each, which breaks
        # a bound whenever one of them does. So a merged element that survives stands for
        # behaviours that all survive (sound); a rejection it causes may be one of the merge's
        # (re-checked by a pass without merging).
        self._age_index = [i for i in ghost_age_indices(self.L)] if merge_ages else []
        # Reads them all in one call (``itemgetter`` of one index gives a value, not a tuple).
        self._get_ages = operator.itemgetter(*self._age_index) if len(self._age_index) > 1 else None
        # Each node's last request number, as a tuple (``_matched_uncached``: renumber past RENUMBER_AT?).
        self._last_requests = operator.itemgetter(*self.L.req, self.L.req[0])
        logs: dict[tuple[str, int], list[_PEvent]] = {}
        for pe in pevents:
            logs.setdefault((pe.ev["node"], pe.ev["incarnation"]), []).append(pe)
        self.logs = list(logs.values())
        self._steps = [self._clock_steps(log) for log in self.logs]
        self._given: dict[int, tuple] = {}  # each event's ``_step_params``, by index
        self._actor: dict[int, tuple] = {}  # each event's acting node and location (``_check``), by index
        # The logs of the same process's earlier incarnations, for each log.
        names = list(logs)
        self._earlier = [[e for e, (p2, i2) in enumerate(names) if p2 == p and i2 < i] for p, i in names]
        self.total = len(pevents)
        self._succ = ctx.succ
        self._tick_memo = ctx.tick_memo
        self._boxes_memo: dict[frozenset, frozenset] = {}  # a set of boxes -> the same, joined
        self.boxes_hulled = False  # some element's boxes were replaced by their hull (MAX_BOXES)
        self._invariant_memo = ctx.invariant_memo
        self._invariant_reads = ctx.invariant_reads
        self._property_memo = ctx.property_memo
        self._match_memo = ctx.match_memo
        self._signatures = ctx.signatures
        self._context = ctx
        self._signature: dict[int, tuple] = {}  # each event's ``_event_signature``, by index
        if not share_matches:
            self._matched = self._matched_uncached  # type: ignore[method-assign]
        self.states_explored = 0
        self.frontier_max = 1
        self.aged_drop = False  # a step dropped for a progress property (``_validate``'s passes)
        # Whether any element's network ever filled (a send into it was lost): the spec's
        # network bound is the checker's scope, not the real network's, so a rejection after
        # it is INCONCLUSIVE (an acceptance stands: a loss is a step the spec always allows).
        self.network_filled = False

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

    def _advance(self, s: bytes, d: int) -> bytes | None:
        """``s`` after ``d`` ticks of true time and no step, or ``None`` if a directory timer
        falls due first (time cannot pass an urgent step). Each tick is the model's own
        (``Model.tick``: ``Model.apply("tick", ...)`` without the clock steps), memoised; once a
        tick changes nothing, none after it does (nothing is counting down), so the rest of the
        gap is skipped."""
        x: bytes | None = s
        memo = self._tick_memo
        tick = self.model.tick
        for _ in range(d):
            assert x is not None
            nxt = memo.get(x, False)
            if nxt is False:
                nxt = tick(x)
                if len(memo) >= ADVANCE_MEMO_MAX:
                    memo.clear()
                memo[x] = nxt
            if nxt is None or nxt == x:
                return nxt
            x = nxt
        return x

    def _closure(self, s: bytes, T: int, lo: int, hi: int) -> list[tuple[bytes, int]]:
        """Every (state, tick) the environment can reach from ``(s, T)`` with the tick in ``[lo, hi]``."""
        if self.clock_steps or self.params.max_duplications:
            return self._closure_stepwise(s, T, lo, hi)
        out: list[tuple[bytes, int]] = []
        t = max(lo, T)
        x = self._advance(s, t - T)
        while x is not None:
            out.append((x, t))
            if t >= hi:
                break
            x = self._advance(x, 1)
            t += 1
        return out

    def _closure_stepwise(self, s: bytes, T: int, lo: int, hi: int) -> list[tuple[bytes, int]]:
        """``_closure`` with clock steps or duplications between ticks: one tick at a time."""
        # Clock steps are taken only at the moments events may happen (ticks in ``[lo, hi]``),
        # not at every tick of the gap: fewer behaviours, each one the spec's.
        out: list[tuple[bytes, int]] = []
        layer = {s}
        t = T
        while True:
            if t >= lo:
                # In the states' order, not a set's (which varies with the hash seed): the
                # frontier's order decides which event a lazy search blames for a rejection.
                out.extend((x, t) for x in sorted(self._env_closure(layer)))
            if t >= hi:
                break
            nxt: set[bytes] = set()
            for x in sorted(layer):
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

        m = self.model
        if name == "restart_node":
            n = R.n(ev["rejoined"])
            starts = [s]
            if s[L.up[n]]:
                # kill -9 is logged by no one: a rejoin implies the crash before it.
                starts = [s2 for _, _, s2 in self._crash_steps(n, 1 if ev["lost"] else 0, s)]
            for s1 in starts:
                for lab, p, s2 in m.apply("restart_node", (n,), s1):
                    if ev.get("_cascade"):
                        s2 = self._void(s2)
                    out.append((s2, binding, lab, p, s1))
            return out
        if name == "crash":
            steps = self._crash_steps(*self._step_params(pe), s)
            self.states_explored += len(steps)
            return [(s2, binding, lab, p, s) for lab, p, s2 in steps]
        if name == "invalidate":
            if s[L.phase[0]] != COMMITTED and s[L.phase[0]] != WRITING:
                return [(s, binding, "invalidate", (0,), s)]  # nothing to void: no step
            labels: tuple[str, ...] = ("invalidate",)
        elif name == "invalidate_namespace":
            return [(self._void(s), binding, "invalidate", (0,), s)]
        elif name in ("expire_write_lease", "expire_write_lease_of_crashed"):
            labels = ("expire_write_lease", "expire_write_lease_of_crashed")
        else:
            labels = (name,)
        given = self._given.get(pe.index)
        if given is None:
            given = self._given[pe.index] = self._step_params(pe)
        for lab in labels:
            steps = m.apply(lab, given, s)
            self.states_explored += len(steps)
            for _, p, s2 in steps:
                b = self._check(pe, lab, p, s, s2, binding, bound)
                if b is not None:
                    out.append((s2, b, lab, p, s))
        if name in _LEASE_REFUSALS and (ev.get("result") in _DROPPING_REFUSALS[name] or ev.get("_foreign")):
            # A refusal for a reason outside the one-key model (tenant, parent; for a write, a key
            # named under another parent than its own (``key_identity``), a root written to a
            # shard that does not own its chain (``wrong_shard``, docs/sharding.md), or no
            # location the writer may write to is up: the spec's directory grants no write then,
            # and its request waits or is lost): the request is consumed and nothing else
            # changes -- the spec's ``drop``, the writer then giving up.
            kind = M_ACQUIRE if name == "refuse_read_lease" else M_BEGIN_WRITE
            who = R.n(ev["holder"] if name == "refuse_read_lease" else ev["writer"])
            for lab, p, s2 in m.apply("drop", (kind, who), s):
                out.append((s2, binding, lab, p, s))
        return out

    def _crash_steps(self, n: int, lose: int | None, s: bytes) -> list:
        """The model's crash of node ``n`` from ``s``, losing its disk if ``lose`` is 1 (``None``:
        either). With nothing of the key on the disk, losing it changes nothing, and the model has
        that crash once, as ``(n, 0)`` (``Model._failures``)."""
        steps = self.model.apply("crash", (n, lose), s)
        if not steps and lose == 1:
            steps = self.model.apply("crash", (n, 0), s)
        return steps

    def _step_params(self, pe: _PEvent) -> tuple:
        """The spec step's parameters as far as the event names them (``None``: any): the
        acting node, the key (always 0 in a projection), the location. Lease ids are left
        open: ``_check`` matches them through the binding."""
        ev, R = pe.ev, self.roles
        name = ev["event"]
        if name in HOLDER_EVENTS or name in WRITER_EVENTS:
            if name == "read":
                return (R.n(ev["node"]), 0, R.loc(ev["location"]))
            return (R.n(ev["node"]), 0)
        if name in ("grant_read_lease", "refuse_read_lease", "renew_lease", "refuse_renewal", "release_lease", "revoke_acked"):
            return (R.n(ev["holder"]), 0)
        if name in ("grant_write_lease", "refuse_write_lease", "commit_write", "reject_stale_commit"):
            w = R.n(ev.get("writer"))
            if name == "grant_write_lease":
                return (w, 0, R.loc(ev["location"]))
            return (w, 0)
        if name in ("store_bytes", "fence_stale_write"):
            return (R.n(ev["writer"]), 0, R.loc(ev["location"]))
        if name in ("store_copy", "free_slot", "fence_stale_free", "evict", "evict_refused", "start_transfer",
                    "finish_transfer", "retry_free", "free_acked"):
            return (0, R.loc(ev["location"]))
        if name == "declare_node_down":
            return (R.n(ev["down"]),)
        if name == "crash":
            lose = ev.get("lose_disk")
            return (R.n(ev.get("crashed") or ev["node"]), None if lose is None else int(bool(lose)))
        if name == "restart_directory":
            return (self._grace_ticks(ev.get("grace_ms")),)
        return (0,)  # the directory's own steps on the key

    def _grace_ticks(self, grace_ms: Any) -> int | None:
        """A restart's logged grace in ticks (``None``, not logged: any the spec allows). Rounded
        up: the spec's restart takes a grace from its horizon up (``Model.restart_graces``), and a
        grace that covers a lease to within the tick that quantises time covers it. Longer than
        the full grace is the full grace: what is freed later than the spec must is checked by
        the events' times, as without a mirror."""
        if type(grace_ms) is not int or grace_ms < 0:
            return None
        tick = self.params.effective_tick_ms
        return min(self.model.restart_grace, -(-grace_ms // tick))

    def _drop_stale(self, s: bytes) -> bytes:
        """``s`` without the replies of a holder's request exchange (grant, renewal, refusal)
        that answer a request other than the one pending: request numbers only grow, so their
        delivery is ignored now and ever after. Losing them is a spec step (``drop``; no lost
        request ghost, which marks only the pending exchange's), and a state that kept them
        can do nothing more than one without: kept, they only tell apart elements that
        explain the trace alike (an ``abandon`` on a refusal, or on a timeout with the refusal
        still coming). Likewise a write refusal while its writer is not waiting for a grant:
        delivered later, it would only abort the writer as the writer itself may.

        A stale *request* (an acquire or renewal whose holder no longer waits for it) may still
        reach the directory, which may log a grant or refusal for it, so it stays; but its number
        is never pending again, and the directory only echoes it in a reply that is then stale
        too, so every stale request carries ``STALE_REQUEST`` instead. Kept apart by their
        numbers, a holder's unanswered requests (a directory killed under them) told apart
        elements by which of them a later refusal consumed: thousands of elements alike on a
        one-minute soak trace, and the frontier bound reached."""
        L = self.L
        fixed = L.fixed
        if len(s) == fixed or _READ_EXCHANGE_KINDS.isdisjoint(s[fixed::MESSAGE_WIDTH]):
            return s  # no exchange in flight (each message's first byte is its kind)
        net = [s[i : i + MESSAGE_WIDTH] for i in range(fixed, len(s), MESSAGE_WIDTH)]
        keep = []
        renumbered = False
        for m in net:
            kind = m[0]
            if kind in _READ_REPLY:
                if kind == M_REFUSE and m[4] != REFUSED_READ:
                    # A write refusal carries no request number; while its writer waits for no
                    # grant it only ever does, delivered, what the writer's own abort does.
                    if s[L.w_stage[m[1]][m[2]]] != W_REQUESTED:
                        continue
                    keep.append(m)
                    continue
                n, k, req = m[1], m[2], m[_READ_REPLY[kind]]
                if s[L.p_kind[n][k]] == P_NONE or s[L.p_id[n][k]] != req:
                    continue  # answers a request no longer pending: ignored for ever
            elif kind in _READ_REQUEST:
                f = _READ_REQUEST[kind]
                n, k, req = m[1], m[2], m[f]
                if req != STALE_REQUEST and (s[L.p_kind[n][k]] == P_NONE or s[L.p_id[n][k]] != req):
                    m = m[:f] + bytes((STALE_REQUEST,)) + m[f + 1 :]
                    renumbered = True
            keep.append(m)
        if renumbered:
            return self.model._pack(bytearray(s[:fixed]), keep)  # sorted again: a renumbered request moves
        if len(keep) == len(net):
            return s
        return s[:fixed] + b"".join(keep)  # still sorted: a subsequence of a sorted network

    def _split_ages(self, s: bytes) -> tuple[bytes, tuple[int, ...]]:
        """``s`` with its ghost ages zeroed, and the ages."""
        idx = self._age_index
        if not idx:
            return s, ()
        ages = self._get_ages(s) if self._get_ages else tuple(s[i] for i in idx)
        if not any(ages):
            return s, ages
        b = bytearray(s)
        for i in idx:
            b[i] = 0
        return bytes(b), ages

    def _with_ages(self, s: bytes, ages: tuple[int, ...]) -> bytes:
        if not any(ages):
            return s
        b = bytearray(s)
        for i, v in zip(self._age_index, ages):
            b[i] = v
        return bytes(b)

    def _renumber(self, s: bytes, binding: tuple) -> tuple[bytes, tuple]:
        """The same state with the spec's lease ids (and each node's request numbers) renumbered
        1, 2, ... in their order, keeping only those in use anywhere (directory, holders,
        writers, messages), and the lease binding to match. The properties compare ids only for
        equality and against the directory's counter, which order-preserving renumbering keeps;
        real ids stay checked for reuse by the shadow. So a projection may hold any number of
        leases and requests, where the state's bytes hold 250."""
        L = self.L
        fixed = bytearray(s[: L.fixed])
        net = [bytearray(s[i : i + MESSAGE_WIDTH]) for i in range(L.fixed, len(s), MESSAGE_WIDTH)]
        if s[L.next_id] > RENUMBER_AT:
            new = {v: i + 1 for i, v in enumerate(sorted(self._leases_in_use(s)))}
            for blk in L.lease_id_blocks:
                for i in range(blk.start, blk.stop):
                    if fixed[i]:
                        fixed[i] = new[fixed[i]]
            for m in net:
                if m[0] in _CARRIES_LEASE and m[3]:
                    m[3] = new[m[3]]
            fixed[L.next_id] = len(new) + 1
            binding = tuple(sorted((r, new[sp]) for r, sp in binding if sp in new))
        for n in range(self.model.N):
            if s[L.req[n]] <= RENUMBER_AT:
                continue
            # Where node n's request numbers sit: its pending requests, its acquires and renews,
            # and the grants and renewals answering them.
            slots = [(m, _REQUEST_FIELD[m[0]]) for m in net if m[0] in _REQUEST_FIELD and m[1] == n]
            used = {fixed[L.p_id[n][k]] for k in range(self.model.K)} | {m[f] for m, f in slots}
            used.discard(0)
            new = {v: i + 1 for i, v in enumerate(sorted(used))}
            for k in range(self.model.K):
                if fixed[L.p_id[n][k]]:
                    fixed[L.p_id[n][k]] = new[fixed[L.p_id[n][k]]]
            for m, f in slots:
                if m[f]:
                    m[f] = new[m[f]]
            fixed[L.req[n]] = len(new)
        return self.model._pack(fixed, [bytes(m) for m in net]), binding

    def _leases_in_use(self, s: bytes) -> set[int]:
        """The spec lease ids anywhere in ``s``: the directory's, holders', writers', in flight."""
        L = self.L
        used: set[int] = set()
        for blk in L.lease_id_blocks:
            used.update(s[blk])
        used.update(s[i + 3] for i in range(L.fixed, len(s), MESSAGE_WIDTH) if s[i] in _CARRIES_LEASE)
        used.discard(NO_LEASE)
        return used

    def _live(self, s: bytes, binding: tuple) -> tuple:
        """The lease binding without the spec ids in use nowhere in ``s`` (as ``_renumber``
        drops them). Spec ids are only ever new (renumbering keeps their order), so such an id
        never comes back; an event under its real id must match an id in use, which is bound
        to another real id (one-to-one: no match), or be a new grant, which the shadow refuses
        as a reused id. Kept, the pairs of every lease the projection ever had would grow
        each element (hashed at every step) and keep apart elements whose futures are alike."""
        if not binding:
            return binding
        L = self.L
        for _, sp in binding:  # each spec id looked for where it may be, until one is missing
            if sp == NO_LEASE:
                break
            for blk in L.lease_id_blocks:
                if sp in s[blk]:
                    break
            else:
                if not any(s[i + 3] == sp and s[i] in _CARRIES_LEASE for i in range(L.fixed, len(s), MESSAGE_WIDTH)):
                    break
        else:
            return binding
        used = self._leases_in_use(s)
        return tuple(pair for pair in binding if pair[1] in used)

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
        names = self._actor.get(pe.index)
        if names is None:
            names = self._actor[pe.index] = (R.n(ev["node"]), R.loc(ev.get("location")))
        actor, loc = names

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

    def _properties(self, lab: str, p: tuple, pre: bytes, post: bytes, ref: bytes | None = None) -> str | None:
        """The first property the step breaks, or None. The frontier meets the same steps again
        and again (one per frontier element that can take them), so verdicts are memoised: the
        predicates are pure functions of (pre, label, params, post).

        ``ref``: a state every invariant was evaluated on and held (in the memo as ``None``; the
        frontier element the step was taken from, before time passed, is one when it is a post
        as checked). An invariant that reads no group (``Invariant.reads``) in which ``post``
        differs from ``ref`` holds on ``post`` too, as the checker re-evaluates only those that
        read a group changed from the parent."""
        m = self.model
        inv_memo = self._invariant_memo
        verdict = inv_memo.get(post, False)
        if verdict is False:
            verdict = None
            reads = self._invariant_reads
            checks = reads.to_check(ref, post) if ref is not None and inv_memo.get(ref, False) is None else reads.checks
            for holds, name in checks:
                if not holds(m, post):
                    verdict = name
                    break
            if len(inv_memo) >= PROPERTY_MEMO_MAX:
                inv_memo.clear()
            inv_memo[post] = verdict
        if verdict is not None:
            return verdict
        memo = self._property_memo
        k = (pre, lab, p, post)
        if k in memo:
            return memo[k]
        if len(memo) >= PROPERTY_MEMO_MAX:
            memo.clear()
        for tp in TRANSITION_PROPERTIES:
            if not tp.holds(m, pre, lab, p, post):
                verdict = tp.name
                break
        memo[k] = verdict
        return verdict

    # -- the search ----------------------------------------------------------------------------

    def _clock_steps(self, log: list[_PEvent]) -> list[tuple[int, int] | None]:
        """For each event of ``log``, the least and most ticks that passed since the log's
        previous event (``None`` for the first): true time passes at the clock's rate, up to
        ``drift_ppm``, so ``Δlocal`` crosses ``floor`` or ``ceil(Δlocal / tick)`` ticks. An
        event's window is its wall-clock interval narrowed by these from the previous event's
        ticks (``_level``). The previous event's tick is an interval: elements that differ only
        in it are one element (``run``), whose narrowing is the union of theirs -- looser than
        any one of them, never looser than the wall-clock interval that the clock bound gives.
        Fixed per event, so computed once, not per element and level."""
        out: list[tuple[int, int] | None] = [None]
        for prev, pe in zip(log, log[1:]):
            d = pe.local - prev.local
            slack = d * self.params.drift_ppm // 1_000_000
            out.append(((d - slack) // self._tick_ns, -(-(d + slack) // self._tick_ns)))
        return out

    def _eligible(self, pos: tuple[int, ...]) -> list[int]:
        got = self._eligible_memo.get(pos)
        if got is not None:
            return got
        logs, earlier = self.logs, self._earlier
        # (index, log, wall) of each log's next event; an event is in one log, so indices differ.
        heads = []
        for j, log in enumerate(logs):
            at = pos[j]
            # A process's new incarnation starts after its previous one ended: its events are
            # not candidates while an earlier incarnation's are pending (a restarted directory
            # that lost state must not be read as acting before it lost it).
            if at < len(log) and (not earlier[j] or all(pos[e] == len(logs[e]) for e in earlier[j])):
                pe = log[at]
                heads.append((pe.index, j, pe.wall))
        if not heads:
            out: list[int] = []
        elif self.params.reorder_mode == "none":
            out = [min(heads)[1]]
        else:
            latest = min(h[2] for h in heads) + self.params.window_ms * 1_000_000
            heads.sort()
            # The caller's next event is always a candidate; others within the clock window too.
            out = [j for n, (_, j, wall) in enumerate(heads) if n == 0 or wall <= latest]
        if len(self._eligible_memo) >= ADVANCE_MEMO_MAX:
            self._eligible_memo.clear()
        self._eligible_memo[pos] = out
        return out

    def run(self) -> None:
        init = self.model.init_states()[0]
        # (state, tick, events consumed per log, lease binding) -> the interval of ticks of each
        # log's last event (lowest, highest), the ghost ages, and the *boxes*: the ticks the
        # behaviours that reach this element gave the events shared with other projections, each
        # a tuple ((index, ticks), ...) in order -- one time for one event, across projections.
        # The element's future depends on its state alone, so the behaviours that differ only in
        # those past ticks are one element with a set of boxes: the search steps each state
        # once, not once per combination of failure ticks (which multiplied a fault-dense
        # projection's frontier a hundredfold).
        none = (-1,) * len(self.logs)
        init_q, init_ages = self._split_ages(init)
        frontier: dict[tuple, tuple] = {(init_q, 0, (0,) * len(self.logs), ()): (none, none, init_ages, _NO_BOXES)}
        lazy = self.params.reorder_mode == "lazy"
        for _level in range(self.total):
            # Every element first tries the caller's next event of its own cut ("narrow"); only if
            # no element can does any element try another order.
            nxt, broke, full = self._level(frontier, "first" if (lazy and self.narrow) else ("lazy" if lazy else "all"))
            if not nxt and lazy and self.narrow:
                nxt, broke2, full2 = self._level(frontier, "lazy")
                broke, full = broke or broke2, full or full2
            self.network_filled = self.network_filled or full
            if not nxt:
                self._fail(frontier, broke, self.network_filled)
            if len(nxt) > 1 and self.shared:
                nxt = self._merge_shared(nxt)
            self.frontier_max = max(self.frontier_max, len(nxt))
            frontier = self._settle(nxt)
        self.shared_ticks = set().union(*(v[3] for v in frontier.values()))

    def _level(self, frontier: dict, how: str) -> tuple[dict, str | None, bool]:
        """One event further from every element: ``how`` is "first" (the caller's next event
        only), "lazy" (others only if that one cannot be taken) or "all". The hot loop of the
        validator: what depends only on the element and the event (its window, the next cut,
        the logs' last ticks but the one consumed) is computed once, not once per state the
        element can wait into and step the event from."""
        nxt: dict[tuple, tuple] = {}
        broke: str | None = None
        full = False
        logs = self.logs
        memo: dict[tuple, list] = {}
        shared, cascades = self.shared, self.cascades
        eligible, eligible_memo, steps = self._eligible, self._eligible_memo, self._steps
        closure, matched_of = self._closure, self._matched
        # Without clock steps or duplications, ``_closure`` is inlined: one memoised tick at a time.
        stepwise = self.clock_steps or self.params.max_duplications
        advance, tick_memo, tick = self._advance, self._tick_memo, self.model.tick
        first_only, lazy = how == "first", how == "lazy"
        max_frontier = self.params.max_frontier
        for (s, T, pos, binding), (last_lo, last_hi, ages, gts) in frontier.items():
            if ages and any(ages):
                s = self._with_ages(s, ages)
            before = len(nxt)
            choices = eligible_memo.get(pos)
            if choices is None:
                choices = eligible(pos)
            for n_choice, j in enumerate(choices):
                if n_choice > 0 and (first_only or (lazy and len(nxt) > before)):
                    break  # the caller's next event could be taken: keep the caller's order
                at = pos[j]
                pe = logs[j][at]
                lo, hi = pe.lo, pe.hi  # narrowed by the clock (``_clock_steps``)
                step = steps[j][at]
                if step is not None:
                    if last_lo[j] + step[0] > lo:
                        lo = last_lo[j] + step[0]
                    if last_hi[j] + step[1] < hi:
                        hi = last_hi[j] + step[1]
                if lo < T:
                    lo = T
                if hi < lo:
                    continue
                index = pe.index
                pos2 = pos[:j] + (at + 1,) + pos[j + 1 :]
                is_shared = index in shared
                cascade_ticks = self.cascade_ticks.setdefault(index, set()) if index in cascades else None
                lo_head, lo_tail, hi_head, hi_tail = last_lo[:j], last_lo[j + 1 :], last_hi[:j], last_hi[j + 1 :]
                if stepwise:
                    reach = closure(s, T, lo, hi)
                else:
                    reach = []
                    t = lo  # at least T
                    x = advance(s, t - T) if t > T else s
                    while x is not None:
                        reach.append((x, t))
                        if t >= hi:
                            break
                        x2 = tick_memo.get(x, False)
                        if x2 is False:
                            x2 = tick(x)
                            if len(tick_memo) >= ADVANCE_MEMO_MAX:
                                tick_memo.clear()
                            tick_memo[x] = x2
                        x = x2
                        t += 1
                for x, t in reach:
                    # Elements that differ only in when their timers were set meet the same
                    # states again at other ticks: each (event, state, binding) is matched once.
                    mkey = (index, x, binding)
                    matched = memo.get(mkey)
                    if matched is None:
                        matched = memo[mkey] = matched_of(pe, x, binding, s)
                    if not matched:
                        continue
                    new_lo, new_hi = lo_head + (t,) + lo_tail, hi_head + (t,) + hi_tail
                    gts2 = frozenset([gt + ((index, frozenset((t,))),) for gt in gts]) if is_shared else gts
                    for q, post_ages, b2, bad, filled in matched:
                        if filled:
                            full = True
                        if bad is not None:
                            broke = bad
                            if bad in _PROGRESS_NAMES:
                                self.aged_drop = True  # perhaps only because ages were merged
                            continue
                        key = (q, t, pos2, b2)
                        if cascade_ticks is not None:
                            cascade_ticks.add(t)
                        had = nxt.get(key)
                        if had is None:
                            nxt[key] = (new_lo, new_hi, post_ages, gts2)
                        else:
                            lo_, hi_, ages_, gts_ = had
                            if lo_ != new_lo or hi_ != new_hi or ages_ != post_ages or gts_ is not gts2:
                                nxt[key] = (lo_ if lo_ == new_lo else tuple(map(min, lo_, new_lo)),
                                            hi_ if hi_ == new_hi else tuple(map(max, hi_, new_hi)),
                                            ages_ if ages_ == post_ages else tuple(map(max, ages_, post_ages)),
                                            gts_ if gts_ is gts2 else gts_ | gts2)  # fmt: skip
                if len(nxt) > max_frontier:
                    raise _inconclusive(index, pe.ev, "frontier_limit", f"key {self.key[:16]}…: more than {max_frontier} possible states at event {index}")
        return nxt, broke, full

    def _matched(self, pe: _PEvent, x: bytes, binding: tuple, ref: bytes | None = None) -> list[tuple[bytes, tuple, tuple, str | None, bool]]:
        """The steps ``pe`` may be from ``x``, each as ``(post without ghost ages, its ages,
        binding, the property it breaks or None, whether the network was full)``: posts with
        ids renumbered and stale replies dropped, once for every element that meets ``x``.

        Memoised across levels and projections of one model (``_SpecContext.match_memo``) by
        the event in model terms (``_event_signature``: every field matching reads but the real
        lease id), the state, and the binding in the event's terms: its spec ids, and where the
        event's real lease id falls among its real ids (equal to one, or between two). Real ids
        are only compared, for equality and (keeping bindings sorted) order, so the steps, the
        spec ids and which real id each new pair holds are the same for any two (event, binding)
        alike in those terms; the memo keeps each new binding as references to the old one's
        pairs and to the event's lease."""
        sig = self._signature.get(pe.index)
        if sig is None:
            # Interned as a small int per model (cheaper to hash than the tuple, at every call).
            sigs = self._signatures
            full = _event_signature(pe)
            sig = sigs.get(full)
            if sig is None:
                # Never an int given before, even once the memo started over (below): a
                # projection's own cache of its events' ints never names another signature.
                sig = sigs[full] = self._context.next_signature
                self._context.next_signature += 1
            self._signature[pe.index] = sig
        lease = pe.ev.get("lease")
        if not binding:
            mkey = (sig, x, (), None if lease is None else 0)
        elif lease is None:
            mkey = (sig, x, tuple([sp for _, sp in binding]), None)
        else:
            rel = len(binding)
            for i, (r, _) in enumerate(binding):
                if r >= lease:
                    rel = i if r > lease else -1 - i  # before the i-th real id, or equal to it
                    break
            mkey = (sig, x, tuple([sp for _, sp in binding]), rel)
        memo = self._match_memo
        coded = memo.get(mkey)
        if coded is not None:
            if not coded:
                return coded
            return [(q, ages, binding if code is None else tuple([(binding[i][0] if i >= 0 else lease, sp) for i, sp in code]),
                     bad, filled) for q, ages, code, bad, filled in coded]  # fmt: skip
        out = self._matched_uncached(pe, x, binding, ref)
        coded = []
        index = None
        for q, ages, b2, bad, filled in out:
            if b2 is binding or b2 == binding:
                code = None
            else:
                if index is None:
                    index = {r: i for i, (r, _) in enumerate(binding)}
                code = []
                for r, sp in b2:
                    i = index.get(r, -1)
                    if i < 0 and r != lease:
                        return out  # a real id from neither: not expressible, not memoised
                    code.append((i, sp))
                code = tuple(code)
            coded.append((q, ages, code, bad, filled))
        if len(memo) >= MATCH_MEMO_MAX:
            memo.clear()
            self._signatures.clear()
        # A tuple, not a list: once its items are, it is untracked by the cyclic garbage
        # collector, which would otherwise walk every entry of the memo at each full collection.
        memo[mkey] = tuple(coded)
        return out

    def _matched_uncached(self, pe: _PEvent, x: bytes, binding: tuple, ref: bytes | None = None) -> list[tuple[bytes, tuple, tuple, str | None, bool]]:
        out = []
        check = self.params.check_invariants
        limit = self.L.fixed + MESSAGE_WIDTH * self.cfg.max_messages
        next_id, last_requests = self.L.next_id, self._last_requests
        for post, b2, lab, p, pre in self._match(pe, x, binding):
            bad = self._properties(lab, p, pre, post, ref) if check else None
            filled = len(post) >= limit
            if bad is None:
                if post[next_id] > RENUMBER_AT or max(last_requests(post)) > RENUMBER_AT:
                    post, b2 = self._renumber(post, b2)
                post = self._drop_stale(post)
                b2 = self._live(post, b2)
            q, post_ages = self._split_ages(post)
            out.append((q, post_ages, b2, bad, filled))
        return out

    def _merge_shared(self, nxt: dict) -> dict:
        """Each element's boxes that differ in the ticks of one shared event (a failure) only,
        joined into one with the union of those ticks (``_merge_box_set``): the boxes stay few,
        and their union -- the ticks the accepted behaviours gave the shared events -- exact."""
        memo = self._boxes_memo
        out = nxt
        for key, (lo, hi, ages, gts) in nxt.items():
            if len(gts) < 2:
                continue
            merged = memo.get(gts)
            if merged is None:
                if len(memo) >= ADVANCE_MEMO_MAX:
                    memo.clear()
                merged = _merge_box_set(gts)
                if len(merged) > MAX_BOXES:
                    hull = _hull(merged)
                    if hull is not None:
                        merged = frozenset((hull,))
                        self.boxes_hulled = True
                memo[gts] = merged
            if merged is not gts:
                if out is nxt:
                    out = dict(nxt)
                out[key] = (lo, hi, ages, merged)
        return out

    def _settle(self, frontier: dict) -> dict:
        """Move the oldest shared ticks that every box of every element agrees on out of the
        boxes (into ``settled``): they no longer tell behaviours apart, and the boxes stay short."""
        settled = self.settled
        while True:
            first = None
            for _, _, _, gts in frontier.values():
                for gt in gts:
                    if not gt or (first is not None and gt[0] != first):
                        return frontier
                    first = gt[0]
            if first is None:
                return frontier
            settled[first[0]] = first[1]  # the set of ticks every behaviour gave it
            frontier = {key: (lo, hi, ages, frozenset([gt[1:] for gt in gts])) for key, (lo, hi, ages, gts) in frontier.items()}

    def _fail(self, frontier: dict, broke: str | None, full: bool) -> None:
        # The event to blame: the earliest (caller's order) that some element could have taken.
        best: _PEvent | None = None
        for _, _, pos, _ in frontier:
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
        timing = self._placement(best) or self._fencing(frontier, best) or self._timing(frontier, best)
        if timing:
            diff["timing"] = timing
        raise _reject(
            best.index, ev, "no_spec_step",
            f"event {best.index} ({ev['event']} by {ev['node']!r}, key {str(ev.get('key'))[:16]}…): "
            + (f"{timing}; " if timing else "no spec state can take it; ")
            + f"it needs {NEEDS[ev['event']]}", diff,
        )  # fmt: skip

    def _placement(self, pe: _PEvent) -> str | None:
        """When a write grant names a location the spec never sends that writer to (its own
        node's tiers or the shared pool: ``ModelConfig.write_targets``), the words saying so: no
        state of any timing takes it."""
        ev, R = pe.ev, self.roles
        if ev["event"] != "grant_write_lease":
            return None
        w, loc = R.n(ev.get("writer")), R.loc(ev.get("location"))
        if w is None or loc is None or loc in self.cfg.write_targets(w):
            return None
        host = next((h for h in R.nodes if R.node_index[h] == loc // R.tiers_per_node), "?")
        return (f"a write placed outside the spec: the spec grants writer {ev['writer']!r} (node "
                f"{R.nodes[w]!r}) a write only to its own node's tiers or the shared pool, and "
                f"{ev['location']!r} is a tier of node {host!r}")

    def _fencing(self, frontier: dict, pe: _PEvent) -> str | None:
        """When a write grant carries an epoch no state of the frontier would give it (every
        grant takes the key's epoch + 1, its fencing token, so never 0), the words saying so:
        the commonest cause, an adapter over a store with no fencing tokens logging epoch 0."""
        ev = pe.ev
        if ev["event"] != "grant_write_lease" or type(ev.get("epoch")) is not int:
            return None
        epochs = sorted({s[self.L.epoch[0]] for (s, *_), _ in list(frontier.items())[: self.params.diff_states]})
        if not epochs or ev["epoch"] in {e + 1 for e in epochs}:
            return None
        due = " or ".join(str(e + 1) for e in epochs)
        if ev["epoch"] == 0:
            return (f"a write grant under epoch 0: every grant of a key takes its epoch + 1 (here {due}), its "
                    "fencing token, so no grant carries 0 -- an implementation without fencing tokens cannot "
                    "log one (docs/protocol.md section 3, docs/events.md)")
        return (f"a write grant under epoch {ev['epoch']}: every grant of a key takes its epoch + 1, here {due} "
                "(docs/protocol.md section 3): an epoch skipped, reused or gone back")

    def _timing(self, frontier: dict, pe: _PEvent) -> str | None:
        """When time, not the state, is why no element takes ``pe``: the words saying so (a
        directory timer due before the event's timestamp and not logged by then; or another
        log's event that must come first but is stamped more than epsilon later), else None."""
        tick_ms = self.params.effective_tick_ms
        eps = self.params.skew_ms
        at = (pe.lo + pe.hi) * tick_ms / 2
        blocked: list[tuple[int, str]] = []
        for (s, T, pos, binding), (_, _, ages, _) in list(frontier.items())[: self.params.diff_states]:
            s = self._with_ages(s, ages) if ages else s
            if self._closure(s, T, max(pe.lo, T), pe.hi):
                blocked = []
                break
            # Time stops before the event's interval: find the tick where an urgent step is due.
            x, t = s, T
            while t < pe.lo:
                x2 = self._advance(x, 1)
                if x2 is None:
                    break
                x, t = x2, t + 1
            due = sorted({st[0] for st in self.successors(x) if st[0] in URGENT_STEPS})
            blocked.append((t, ", ".join(due) or "a directory timer", bool(self._match(pe, x, binding))))
        if blocked:
            t, what, takes = min(blocked)
            if takes and pe.ev["event"] in what.split(", "):
                return (f"logged too late: due at +{t * tick_ms} ms (trace time), logged at about +{at:.0f} ms, about "
                        f"{at - t * tick_ms:.0f} ms after, beyond epsilon ({eps} ms): the spec lets no time pass "
                        f"while it is due (docs/events.md section 4); the closest states would take it on time")
            return (f"logged too late, or an earlier step missing: {what} was due at +{t * tick_ms} ms (trace "
                    f"time) and is not logged before this event (logged at about +{at:.0f} ms, beyond epsilon "
                    f"{eps} ms): time cannot pass an urgent directory step, so this event cannot happen yet")
        # The state that takes it is reached only after its timestamp (plus epsilon).
        for (s, T, pos, binding), (_, _, ages, _) in list(frontier.items())[: self.params.diff_states]:
            s = self._with_ages(s, ages) if ages else s
            if T > pe.hi and self._match(pe, s, binding):
                return (f"logged too early: stamped at about +{at:.0f} ms (trace time), but the state that can "
                        f"take it is reached only at +{T * tick_ms} ms, after an event it depends on: timestamps "
                        f"out of order across logs beyond epsilon ({eps} ms), or the processes' clocks differ "
                        f"by more than epsilon")
        # Another log's next event, stamped later than epsilon allows, would let it happen first.
        for (s, T, pos, binding), (_, _, ages, _) in list(frontier.items())[: self.params.diff_states]:
            s = self._with_ages(s, ages) if ages else s
            for j, log in enumerate(self.logs):
                if pos[j] >= len(log) or log[pos[j]] is pe:
                    continue
                other = log[pos[j]]
                if other.wall <= pe.wall:
                    continue
                for post, b2, *_ in self._match(other, s, binding):
                    if self._match(pe, post, b2):
                        gap = (other.wall - pe.wall) / 1e6
                        return (f"timestamps out of order across logs beyond epsilon: it needs event {other.index} "
                                f"({other.ev['event']} by {other.ev['node']!r}) first, but that one's t_wall_ns is "
                                f"{gap:.0f} ms later (epsilon {eps} ms): this event is logged too early, or the "
                                f"clocks of the two processes differ by more than epsilon")
        return None

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
        for (s, T, pos, binding), (_, _, ages, _) in list(frontier.items())[: self.params.diff_states]:
            s = self._with_ages(s, ages) if ages else s
            reach = self._closure(s, T, max(pe.lo, T), pe.hi) or [(s, T)]
            x, t = reach[-1]
            vars_ = {k: v for k, v in L.variables(x).items() if relevant(k)}
            closest.append({
                "tick": t, "variables": vars_, "in_flight": [L.message_text(m) for m in L.messages(x)],
                "leases": {str(r): sp for r, sp in binding}, "time_reachable": bool(self._closure(s, T, max(pe.lo, T), pe.hi)),
            })  # fmt: skip
        return {
            "event": {k: v for k, v in ev.items() if not str(k).startswith("_")},
            "key": self.key,  # the projection's k0 (kvcc.conformance.names)
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


# How an event enters a key's projection (``_validate``): packed with its index as ``i * 4 + mode``.
_OWN, _CASCADE, _GLOBAL, _GLOBAL_CASCADE = 0, 1, 2, 3
_MODE_NAMES = ("own", "cascade", "global", "global")


def _validate(events: Sequence[dict], params: TraceParams) -> Verdict:
    # Two passes over the events, none holding more than names, counters and one int per
    # event: shapes (and the earliest wall time) with roles, then the shadow and each key's
    # projection as indices. Each key's events are fetched again only for its replay, so a
    # trace read from a file (``validate_file``) is never in memory as a whole.
    shapes = _Shapes(params.skew_ms * 1_000_000)
    roles = _Roles(shapes.checked(events), params)
    w0 = shapes.w0
    if w0 is None:
        return Verdict(ACCEPTED, reason="an empty trace", frontier_max=1)
    shapes.wall_steps()
    # A sharded directory (several processes logging directory steps, each owning the keys it
    # logged steps of): each has its own shadow (its own records, in its own log order) but one
    # table of lease ids, and its failure events (its restarts, its declarations, the rejoins it
    # took) are its keys' alone. A key no directory logged a step of (requests never answered)
    # takes the first directory's.
    sharded = len(roles.directories) > 1
    shadow = _Shadow(roles.host)
    if sharded:
        shadows = [_Shadow(roles.host, shadow.granted) for _ in roles.directories]
        directory_of, key_directory = roles.directories, roles.key_directory
    per_key: dict[str, array] = {}
    counts: dict[str, dict[str, int]] = {}
    failures: list[int] = []  # indices of the global events so far
    failure_names: list[str] = []  # and their event names
    failure_scopes: list[int] = []  # and the directory whose keys each applies to (-1: every key)
    cascades: set[int] = set()  # indices of invalidations in more than one projection
    foreign: set[int] = set()  # indices of lease refusals by a shard that does not own the key
    requests: dict[tuple[str, str], int] = {}
    # Each key's own events in model terms, hashed: keys alike (a workload repeated on fresh keys)
    # replay alike, so only their replays memoise matches across projections (``_matched``; a
    # memo that never hits costs a trace of unlike keys more than it saves).
    shape: dict[str, int] = {}

    def projection(k: str) -> array:
        got = per_key.get(k)
        if got is None:
            # A key first seen now still lived through every failure before it.
            got = per_key[k] = _int_array(4 * len(events))
            counts[k] = {"epochs": 0, "leases": 0, "requests": 0, "transfers": 0, "crashes": 0, "restarts": 0}
            if sharded:
                mine = key_directory.get(k, 0)
                kept = [(i, name) for i, name, scope in zip(failures, failure_names, failure_scopes) if scope < 0 or scope == mine]
                got.extend(i * 4 + _GLOBAL for i, _ in kept)
                names: Iterable[str] = [name for _, name in kept]
            else:
                got.extend(i * 4 + _GLOBAL for i in failures)
                names = failure_names
            # The failures' names as kept, not read again: reading ``events[i]`` of a file
            # (``_FileEvents``) here would move the file under the pass iterating it.
            for name in names:
                if name != "declare_node_down":
                    counts[k]["restarts" if name == "restart_directory" else "crashes"] += 1
        return got

    for i, ev in enumerate(events):
        loc = ev.get("location")
        if loc is not None and roles.loc(loc) is None:
            raise _reject(i, ev, "unknown_location", f"event {i}: location {loc!r} is on no node and not the pool")
        for f in ("holder", "writer", "rejoined"):
            if ev.get(f) is not None and roles.n(ev[f]) is None:
                raise _reject(i, ev, "malformed", f"event {i}: {f} {ev[f]!r} is not a node name")
        name = ev["event"]
        own = ev.get("key") if name != "invalidate_namespace" else None
        if own is not None:
            projection(own)
        cascade: list[str] = []
        scope = -1
        if name in DIRECTORY_EVENTS:
            if sharded:
                scope = directory_of[ev["node"]]
                if own is not None and key_directory.get(own, 0) != scope and _owns(name, ev) and name in _LEASE_REFUSALS:
                    foreign.add(i)  # a shard with no record of the key refused it: replayed as the request's loss
                elif own is not None and key_directory.get(own, 0) != scope and _owns(name, ev):
                    first = next(d for d, n in directory_of.items() if n == key_directory[own])
                    raise _reject(i, ev, "key_in_two_shards", (
                        f"event {i} ({name}): key {own[:16]}… has directory steps logged by {first!r} and by "
                        f"{ev['node']!r}; each shard of a sharded directory owns its keys (a chain lives in its root's shard)"))
                cascade = shadows[scope].step(i, ev)
            else:
                cascade = shadow.step(i, ev)
        if name in FAILURE_EVENTS:
            voided = set(cascade) if name == "restart_node" else set()
            if scope < 0:
                for k, idx in per_key.items():
                    idx.append(i * 4 + (_GLOBAL_CASCADE if k in voided else _GLOBAL))
                    if name != "declare_node_down":
                        counts[k]["crashes" if name != "restart_directory" else "restarts"] += 1
            else:
                # One shard's restart, declaration or rejoin: its own keys' failure alone.
                for k, idx in per_key.items():
                    if key_directory.get(k, 0) == scope:
                        idx.append(i * 4 + (_GLOBAL_CASCADE if k in voided else _GLOBAL))
                        if name != "declare_node_down":
                            counts[k]["crashes" if name != "restart_directory" else "restarts"] += 1
            failures.append(i)
            failure_names.append(name)
            failure_scopes.append(scope)
            continue
        if own is not None:
            per_key[own].append(i * 4 + _OWN)
            try:
                shape[own] = hash((shape.get(own), tuple(map(ev.get, _MATCHED_FIELDS))))
            except TypeError:
                shape[own] = hash((shape.get(own), name))
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
                per_key[k].append(i * 4 + _CASCADE)
                cascades.add(i)
    keys = list(per_key)

    def pevents(k: str) -> list[_PEvent]:
        out = []
        for packed in per_key[k]:
            i, mode = divmod(packed, 4)
            ev = events[i]
            if mode == _GLOBAL_CASCADE:
                ev = dict(ev, _cascade=True)
            elif i in foreign:
                ev = dict(ev, _foreign=True)
            wall = shapes.wall(ev)
            lo, hi = _interval(wall, w0, params)
            out.append(_PEvent(i, ev, _MODE_NAMES[mode], lo, hi, wall, ev["t_local_ns"]))
        return out

    explored, fmax = 0, 1
    contexts: dict[tuple, _SpecContext] = {}  # shared by the projections alike (``_SpecContext``)
    verdicts: list[Verdict] = []
    timings: list[tuple[dict[int, int], set[tuple], dict[int, set[int]]]] = []
    frozen_shared, frozen_cascades = frozenset(failures), frozenset(cascades)
    twins: dict[int, int] = {}
    for h in shape.values():
        twins[h] = twins.get(h, 0) + 1
    # Passes, each run only if the one before rejected the projection: the narrow search (every
    # element keeps the caller's order unless none can), the lazy one (each element leaves it
    # where it is stuck), the lazy one without merging ghost ages, then with clock steps. Each
    # later pass explores a superset of the behaviours of the one before, so the last pass run
    # decides.
    #
    # A pass that merges ghost ages decides exactly what the same pass without merging would,
    # unless it dropped a step because a progress property failed on the merged (oldest) ages:
    # no guard, no step's effect but on the ages themselves, and no safety property reads a
    # ghost age (tests/test_validate.py, test_no_guard_reads_a_ghost_age), so the two searches
    # keep the same states but for the ages. So a pass without merging (the last item, True)
    # runs only after such a drop: the clock-step re-check of a long projection then stays
    # within the frontier bound instead of coming back INCONCLUSIVE.
    passes = {
        "never": ((True, False, True, False), (False, False, True, False), (False, False, False, True)),
        "on_reject": ((True, False, True, False), (False, False, True, False), (False, False, False, True),
                      (False, True, True, False), (False, True, False, True)),
        "always": ((True, True, True, False), (False, True, True, False), (False, True, False, True)),
    }[params.clock_steps]

    def replay_key(k: str) -> tuple[Verdict | None, tuple | None, int, int]:
        """One key's projection through its passes: (verdict or None, its shared timing or
        None, states explored, largest frontier)."""
        explored, fmax, verdict = 0, 1, None
        aged_drop = False
        for narrow, clock_steps, merge_ages, after_aged_drop in passes:
            if after_aged_drop and not aged_drop:
                continue  # the merged pass before it decided exactly
            replay = None
            try:
                replay = _Replay(k, pevents(k), roles, params, counts[k], clock_steps, narrow, frozen_shared, frozen_cascades,
                                 merge_ages, contexts, twins.get(shape.get(k), 0) > 1)
                replay.run()
                verdict = None
            except _Stop as stop:
                verdict = stop.verdict
            if replay is not None:
                explored += replay.states_explored
                fmax = max(fmax, replay.frontier_max)
                aged_drop = merge_ages and replay.aged_drop
            if verdict is None or verdict.status != REJECTED or verdict.code not in ("no_spec_step", "invariant"):
                break  # accepted, inconclusive, or rejected for a reason clocks cannot change
        timing = None
        if verdict is None and replay is not None and (frozen_shared or frozen_cascades):
            timing = (replay.settled, replay.shared_ticks, replay.cascade_ticks)
        return verdict, timing, explored, fmax

    def replay_keys(ks: Sequence[str]) -> dict[str, tuple]:
        # Keys in the trace's order; once one is rejected, a key whose events all come after
        # that rejection cannot give an earlier one (the verdict is the earliest rejection).
        out: dict[str, tuple] = {}
        first: int | None = None
        for k in ks:
            if first is not None and per_key[k][0] // 4 > first:
                break
            out[k] = got = replay_key(k)
            v = got[0]
            if v is not None and v.status == REJECTED and v.event_index is not None:
                first = v.event_index if first is None else min(first, v.event_index)
        return out

    results = _replay_in_parallel(keys, replay_keys, events, per_key, shape, _jobs(params, len(events), len(keys)))
    # Gathered in the trace's key order with the same stopping rule, so the verdict does not
    # depend on how the keys were shared out.
    for k in keys:
        first = [v.event_index for v in verdicts if v.status == REJECTED and v.event_index is not None]
        if first and per_key[k][0] // 4 > min(first):
            break  # this key's events, and every later key's, all come after a rejection
        got = results.get(k)
        if got is None:
            got = replay_key(k)  # a worker stopped before it (or failed): replay it here
        verdict, timing, n_explored, n_fmax = got
        explored += n_explored
        fmax = max(fmax, n_fmax)
        if verdict is not None:
            verdicts.append(verdict)
        elif timing is not None:
            timings.append(timing)
    rejected = [v for v in verdicts if v.status == REJECTED]
    conflict = _shared_time_conflict(timings, failures, sparse=sharded)
    if conflict is not None:
        rejected.append(Verdict(
            REJECTED, conflict, events[conflict], f"event {conflict} ({events[conflict]['event']}) is in several key "
            "projections, and no one time of it (and of the failures before it) explains them all", code="shared_event_time",
        ))  # fmt: skip
    if rejected:
        first = min(rejected, key=lambda v: -1 if v.event_index is None else v.event_index)
        return _with_stats(first, fmax, explored)
    if verdicts:
        return _with_stats(verdicts[0], fmax, explored)
    return Verdict(ACCEPTED, reason=f"{len(events)} events, {len(keys)} keys", frontier_max=fmax, states_explored=explored)


# Traces shorter than this are replayed in one process: a fork costs more than it saves.
PARALLEL_MIN_EVENTS = 5_000
MAX_JOBS = 8


def _jobs(params: TraceParams, n_events: int, n_keys: int) -> int:
    """How many processes replay the key projections: ``params.jobs``, or by default one per
    CPU this process may run on for a trace of at least ``PARALLEL_MIN_EVENTS`` events; never
    more than there are keys, and one where ``fork`` is unavailable."""
    if not hasattr(os, "fork") or n_keys < 2:
        return 1
    if params.jobs is not None:
        return min(params.jobs, n_keys)
    if n_events < PARALLEL_MIN_EVENTS:
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, n_keys, MAX_JOBS))


def _share_out(keys: Sequence[str], per_key: Mapping[str, Sequence[int]], shape: Mapping[str, int], jobs: int) -> list[list[str]]:
    """``keys`` in ``jobs`` groups of about equal events, each in the trace's key order. Keys
    alike (one shape: a workload repeated on fresh keys) go to one group, where they share the
    memo of matches (``_SpecContext``)."""
    alike: dict[int | str, list[str]] = {}
    for k in keys:
        alike.setdefault(shape.get(k, k), []).append(k)
    units = sorted(alike.values(), key=lambda ks: -sum(len(per_key[k]) for k in ks))
    loads, groups = [0] * jobs, [[] for _ in range(jobs)]  # type: list[int], list[list[str]]
    for unit in units:  # the largest first, each to the least loaded group
        g = loads.index(min(loads))
        groups[g].extend(unit)
        loads[g] += sum(len(per_key[k]) for k in unit)
    order = {k: n for n, k in enumerate(keys)}
    return [sorted(g, key=order.__getitem__) for g in groups if g]


def _replay_in_parallel(keys: Sequence[str], replay_keys: Any, events: Sequence[dict], per_key: Mapping[str, Sequence[int]],
                        shape: Mapping[str, int], jobs: int) -> dict[str, tuple]:
    """``replay_keys`` over ``keys`` shared out among ``jobs`` processes: this one and
    ``jobs - 1`` forked workers, each sending back its keys' results pickled through a pipe.
    Projections are independent (memos are caches of pure functions), so each key's result is
    the one this process would get. A worker that fails sends nothing: the caller replays the
    keys missing from the result itself."""
    if jobs <= 1:
        return replay_keys(keys)
    groups = _share_out(keys, per_key, shape, jobs)
    workers: list[tuple[int, int]] = []
    for group in groups[1:]:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker: nothing of the parent's but this computation, then _exit
            code = 1
            try:
                os.close(r)
                if isinstance(events, _FileEvents):
                    events.reopen()
                data = pickle.dumps(replay_keys(group), protocol=pickle.HIGHEST_PROTOCOL)
                with os.fdopen(w, "wb") as out:
                    out.write(data)
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        workers.append((pid, r))
    results: dict[str, tuple] = {}
    try:
        results.update(replay_keys(groups[0]))
    finally:
        for pid, r in workers:
            with os.fdopen(r, "rb") as f:
                data = f.read()
            _, status = os.waitpid(pid, 0)
            if status == 0 and data:
                results.update(pickle.loads(data))
    return results


class _FileEvents(Sequence):
    """An NDJSON trace as a sequence of events, read from the file each time it is iterated or
    indexed: only each line's offset is kept (4 bytes an event in a file under 4 GiB)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._file = open(path, "rb")  # noqa: SIM115 (closed in close())
        self._offsets = _int_array(os.fstat(self._file.fileno()).st_size + 1)
        at = 0
        for line in self._file:
            if line.strip():
                self._offsets.append(at)
            at += len(line)

    def close(self) -> None:
        self._file.close()

    def reopen(self) -> None:
        """A file of its own (in a forked worker: the parent's shares one read position)."""
        self._file = open(self._file.name, "rb")  # noqa: SIM115 (closed in close())

    def __len__(self) -> int:
        return len(self._offsets)

    def _parse(self, i: int, line: bytes) -> Any:
        if _fast_loads is not None:
            try:
                return _fast_loads(line)
            except ValueError:
                pass  # the standard parser's verdict and words (it also takes NaN and big ints)
        try:
            return json.loads(line)
        except ValueError as e:
            raise _reject(i, None, "malformed", f"line {self._line_number(i)}: not JSON ({e})") from None

    def _line_number(self, i: int) -> int:
        """The file's line number of event ``i`` (blank lines hold no event), counted again
        only for a rejection's words rather than kept for every line."""
        self._file.seek(0)
        left, lines = self._offsets[i], 1
        while left > 0:
            chunk = self._file.read(min(left, 1 << 20))
            if not chunk:
                break  # the file shrank under us: the count so far
            lines += chunk.count(b"\n")
            left -= len(chunk)
        return lines

    def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        self._file.seek(self._offsets[i])
        return self._parse(i, self._file.readline())

    def __iter__(self) -> Iterator[Any]:
        self._file.seek(0)
        i = 0
        for line in self._file:
            if line.strip():
                yield self._parse(i, line)
                i += 1


def _int_array(limit: int) -> array:
    """An empty array of the narrowest unsigned type that holds every value below ``limit``:
    offsets and packed indices, one per event, are most of what a long trace costs in memory."""
    for code in ("I", "L", "Q"):
        if limit <= 1 << (8 * array(code).itemsize):
            return array(code)
    raise ValueError(f"no array type holds values up to {limit}")


def _join_values(va: tuple, vb: tuple) -> tuple:
    """The ghost bounds of two merged elements: the least of the first, the most of the others."""
    return (tuple(map(min, va[0], vb[0])), tuple(map(max, va[1], vb[1])), tuple(map(max, va[2], vb[2])))


def _merge_boxes(members: dict[tuple, Any], join: Callable[[Any, Any], Any] | None = None) -> dict[tuple, Any]:
    """Join boxes that differ in the ticks of one event only, until no two do (``_join_boxes``,
    many at once): per event position, the boxes alike everywhere else are one box with the union
    of their ticks there. The union of the boxes is kept exactly; a pass costs a dictionary
    insert per box and position, where joining pairs one at a time cost a cube of the number of
    boxes (a real cluster trace has hundreds)."""
    changed = True
    while changed and len(members) > 1:
        changed = False
        # Only a position where the boxes differ can join two (they must agree everywhere else).
        width = max(len(box) for box in members)
        varied = [at for at in range(width) if len({box[at] for box in members if len(box) > at}) > 1]
        for at in varied:
            buckets: dict[tuple, list[tuple]] = {}
            for box in members:
                if len(box) > at:
                    buckets.setdefault((len(box), box[at][0], box[:at], box[at + 1 :]), []).append(box)
            for boxes in buckets.values():
                if len(boxes) < 2:
                    continue
                ticks = functools.reduce(operator.or_, (box[at][1] for box in boxes))
                joined = boxes[0][:at] + ((boxes[0][at][0], ticks),) + boxes[0][at + 1 :]
                value = functools.reduce(join or _join_values, (members.pop(box) for box in boxes))
                if joined in members:
                    value = (join or _join_values)(value, members[joined])
                members[joined] = value
                changed = True
    return members


def _hull(boxes: frozenset) -> tuple | None:
    """The smallest box holding ``boxes`` (per position, the union of their ticks); ``None``
    unless they name the same events in the same order."""
    first = next(iter(boxes))
    if any(len(b) != len(first) or any(x[0] != y[0] for x, y in zip(b, first)) for b in boxes):
        return None
    return tuple((first[at][0], frozenset().union(*(b[at][1] for b in boxes))) for at in range(len(first)))


def _merge_box_set(boxes: frozenset) -> frozenset:
    """``_merge_boxes`` on a set of boxes (no values): the same boxes joined, the same union.
    Returns ``boxes`` itself when no two join."""
    members = _merge_boxes(dict.fromkeys(boxes, ()), join=lambda a, b: a)
    return boxes if len(members) == len(boxes) else frozenset(members)


def _join_boxes(a: tuple, b: tuple) -> tuple | None:
    """Two boxes (``((event index, ticks), ...)``) that differ in the ticks of one event only, as
    one box; ``None`` if they differ in more (their union is no box)."""
    if len(a) != len(b):
        return None
    at = -1
    for n, (x, y) in enumerate(zip(a, b)):
        if x != y:
            if x[0] != y[0] or at >= 0:
                return None
            at = n
    if at < 0:
        return a
    return a[:at] + ((a[at][0], a[at][1] | b[at][1]),) + a[at + 1 :]


def _shared_time_conflict(timings: list[tuple[dict[int, frozenset[int]], set[tuple], dict[int, set[int]]]],
                          failures: list[int], sparse: bool = False) -> int | None:
    """The first event shared by projections that no single tick explains in all of them, or
    ``None``. Failures are in every projection: some assignment of ticks to all of them must be
    one that every projection accepted (joint). Each projection accepted a union of boxes (a set
    of ticks per failure); the failures' longest prefix that some one tick each explains in a
    box of every projection is found (``_longest_joint_prefix``), and the failure after it is
    the conflict. A cascade is in its subtree's projections: some one tick of it must be one
    each of them took it at (per event; the ticks any element took, surviving or not: weaker
    than the failures' check). ``sparse`` (a sharded directory): a shard's failures are in its
    keys' projections only; a failure a projection does not hold is ``None`` in its boxes (any
    tick)."""
    if not timings:
        return None
    projections: set[frozenset[tuple[frozenset[int], ...]]] = set()  # projections alike are one
    cascade_ticks: dict[int, set[int]] = {}
    for settled, boxes, ticks in timings:
        got = []
        for gt in boxes or {()}:
            full = dict(settled)
            full.update(gt)
            got.append(tuple(full.get(i) for i in failures) if sparse else tuple(full[i] for i in failures if i in full))
        projections.add(frozenset(got))
        for i, ts in ticks.items():
            cascade_ticks[i] = set(ts) if i not in cascade_ticks else cascade_ticks[i] & ts
    met = _longest_joint_prefix([_maximal_boxes(p) for p in projections], len(failures))
    if met < len(failures):
        return failures[met]
    empty = sorted(i for i, ts in cascade_ticks.items() if not ts)
    return empty[0] if empty else None


def _maximal_boxes(boxes: Iterable[tuple[frozenset[int], ...]]) -> list[tuple[frozenset[int], ...]]:
    """``boxes`` less every box inside another (per position, a subset of its ticks): a choice
    of boxes that meets with the smaller one meets with the larger, so the joint check's answer
    is the same with fewer boxes."""
    out: list[tuple[frozenset[int], ...]] = []
    for box in sorted(set(boxes), key=lambda b: -sum(len(x) for x in b if x is not None)):
        # None: any tick (a failure of a shard the projection is not of), inside no set of ticks.
        if not any(len(box) == len(o) and all(y is None or (x is not None and x <= y) for x, y in zip(box, o)) for o in out):
            out.append(box)
    return out


def _longest_joint_prefix(per_projection: Sequence[Sequence[tuple[frozenset[int], ...]]], width: int) -> int:
    """The most failures ``m`` (of ``width``) that one tick each can be given, the first ``m`` in
    order, such that every projection has a box holding all ``m`` ticks: a search over the
    failures in order, one tick at a time, each state the boxes of each projection still alive
    (bit masks), a state inside one searched before (each projection's live boxes a subset)
    not searched. Carrying every distinct intersection of one box per projection instead (what
    this replaced) grew to thousands of boxes on a minute of soak faults -- minutes of CPU --
    where this visits about one state per failure."""
    # at[p][i]: tick -> the boxes of projection p that hold that tick at failure i; any_tick[p][i]:
    # the boxes too short to name failure i (any tick of it).
    at: list[list[dict[int, int]]] = []
    any_tick: list[list[int]] = []
    for boxes in per_projection:
        per_failure: list[dict[int, int]] = [{} for _ in range(width)]
        short = [0] * width
        for bit, box in enumerate(boxes):
            for i in range(width):
                if i >= len(box) or box[i] is None:
                    short[i] |= 1 << bit
                    continue
                d = per_failure[i]
                for t in box[i]:
                    d[t] = d.get(t, 0) | (1 << bit)
        at.append(per_failure)
        any_tick.append(short)
    if not at:
        return width
    best = 0
    # The states searched, per failure: one whose boxes are each a subset of a searched one's
    # can reach no further (every tick choice open to it is open to the larger).
    searched: list[list[tuple[int, ...]]] = [[] for _ in range(width)]
    stack = [(0, tuple(_low_bits(len(boxes)) for boxes in per_projection))]
    while stack:
        i, alive = stack.pop()
        best = max(best, i)
        if best == width:
            break
        if any(_within(alive, other) for other in searched[i]):
            continue
        searched[i].append(alive)
        # The ticks to try: those of a projection whose live boxes all name failure i (the
        # fewest), else every tick any box names and one that none does (None).
        strict = [p for p in range(len(at)) if not alive[p] & any_tick[p][i]]
        if strict:
            ticks: Iterable[int | None] = at[min(strict, key=lambda p: len(at[p][i]))][i]
        else:
            ticks = [*{t for per_failure in at for t in per_failure[i]}, None]
        nexts: list[tuple[int, ...]] = []
        for t in ticks:
            nxt = []
            for p, per_failure in enumerate(at):
                m = alive[p] & (per_failure[i].get(t, 0) | any_tick[p][i])
                if not m:
                    break
                nxt.append(m)
            else:
                nexts.append(tuple(nxt))
        # Only the ticks that keep the most boxes alive (no other keeps a superset), the one
        # keeping the most tried first.
        nexts.sort(key=lambda n: sum(map(int.bit_count, n)))
        for n, nxt in enumerate(nexts):
            if not any(_within(nxt, other) for other in nexts[n + 1 :]):
                stack.append((i + 1, nxt))
    return best


def _low_bits(n: Any) -> int:
    """``2**n - 1``, a Python int however large ``n`` is. Not ``(1 << len(x)) - 1`` inline: compiled
    (``kvcc accel``), ``len()`` is a C integer and so is the literal, and the shift is done in C,
    wrong past 63 boxes (a sharded run's 166-box projection was REJECTED for it)."""
    return (1 << n) - 1


def _within(alive: tuple[int, ...], other: tuple[int, ...]) -> bool:
    """Whether each projection's live boxes in ``alive`` are a subset of those in ``other``."""
    return all(a & ~b == 0 for a, b in zip(alive, other))


def _with_stats(v: Verdict, fmax: int, explored: int) -> Verdict:
    return Verdict(v.status, v.event_index, v.event, v.reason, v.diff, fmax, explored, v.code)


def model_names(events: Sequence[dict], params: TraceParams) -> dict[str, str]:
    """The trace's real names by the spec ids a rejection's diff uses: ``n<i>`` for nodes and
    ``l<i>`` for locations (the shared pool last), as ``validate_trace`` assigns them; empty for
    a trace whose shapes it rejects. ``kvcc.conformance.names`` maps a verdict back with it."""
    try:
        _check_shapes(events)  # raises _Stop on a malformed trace
        roles = _Roles(events, params)
    except (_Stop, KeyError, TypeError):
        return {}
    names = {f"n{i}": name for i, name in enumerate(roles.nodes)}
    # Every location of the model, the ones no event names too (each node has as many tiers as
    # the node with most, and there is one shared pool): a diff may show their (empty) slots.
    by_index = {i: loc for loc, i in roles.location_index.items()}
    for n, node in enumerate(roles.nodes):
        for t in range(roles.tiers_per_node):
            i = n * roles.tiers_per_node + t
            names[f"l{i}"] = by_index.get(i, f"{node}/(tier {t}: in no event)")
    pool = len(roles.nodes) * roles.tiers_per_node
    names[f"l{pool}"] = by_index.get(pool, "(the shared pool: in no event)")
    return names


def params_for_walk(walk: RenderedWalk, **overrides: Any) -> TraceParams:
    """The ``TraceParams`` a rendered spec walk is read with (its term, epsilon, tick, locations)."""
    kw: dict[str, Any] = dict(tick_ms=walk.tick_ms, locations=walk.locations)
    kw.update(overrides)
    return TraceParams(walk.lease_term_ms, walk.skew_ms, **kw)


def validate_file(path: str | os.PathLike[str], params: TraceParams) -> Verdict:
    """Validate an NDJSON trace file (the merged log, in the order to replay), reading it line
    by line: memory grows with the longest key projection, not with the file."""
    events = _FileEvents(path)
    try:
        return validate_trace(events, params)
    finally:
        events.close()


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
