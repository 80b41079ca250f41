"""The adapter contract: what an implementation exposes to the conformance suite.

Theory of operation
-------------------
The suite (``kvcc.conformance.runner``) drives a cache deployment -- a directory and cache
nodes, real processes or in-process objects -- through an ``Adapter``. The adapter is a thin
translation layer: every method names the *node* whose client performs the operation, so the
suite can run a workload of several nodes reading, writing, invalidating and evicting at once
(from several threads: every method must be thread-safe) and inject faults into one node.

What the suite judges is *behaviour*, not return codes. After every test it takes the protocol
events of the run (``Adapter.events()``, NDJSON records in the ``kvcc.reference.events``
format, or -- for an adapter that cannot log them -- events the suite infers from the
operation history it saw) and replays them through the spec (``kvcc.conformance.validate``).
Per-test oracles then check what the spec cannot see from the trace alone (that a read
returned exactly the committed bytes, that an invalidation ticket completed), and audits check
that the run was not vacuous (leased hits served, evictions refused, stale writes fenced).

Values crossing the contract are frozen attrs classes (below). Keys are
``kvcc.spec.keys.BlockKey``; namespaces ``kvcc.spec.keys.Namespace``. Refusals are values
(``Refused(reason)``), not exceptions: a refusal is an allowed protocol outcome. Exceptions are
for what is *not* a protocol outcome:

- ``NotSupported(op)``: the adapter did not declare that operation or fault in
  ``capabilities()``; the suite marks tests that need it NOT_APPLICABLE (or SKIP).
- ``AdapterError(reason)``: the infrastructure broke (a process died, a connection was refused,
  an answer could not be parsed). The suite marks the test ERROR with the reason and the trace
  so far, calls ``stop()`` and continues with a fresh adapter.

Any other exception, a wrong return type, or a method that does not return within the test's
time limit is also ERROR. Wrong *data* (bytes other than the committed ones, a lease the
directory never granted) is FAIL.

Lease timing (DESIGN "Leases"): a grant carries ``term_ms`` and ``requested_at_ns``, the
adapter's ``time.monotonic_ns()`` when it *sent* the request. A holder trusts the lease until
``requested_at_ns + term_ms - skew_ms`` on its own clock and never later; the directory treats
it as live until expiry plus ``skew_ms``.

Standard library, attrs and ``kvcc.spec`` only.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

from attrs import field, frozen

from kvcc.spec.keys import BlockKey, Namespace

# -- vocabulary ------------------------------------------------------------------------------------

PROFILES = ("core", "leases", "invalidation", "tiering", "faults", "load")
FAULTS = ("kill", "restart", "pause", "resume", "skew_clock", "restart_directory")
SCOPES = ("key", "prefix", "namespace")
EVENT_SOURCES = ("native", "inferred")
LEASE_MODES = ("enforced", "advisory", "none")

# Refusal reasons (kvcc.reference.wire REASON_* where one fits, plus "miss" and "fenced").
REASON_NOT_COMMITTED = "not_committed"
REASON_INVALIDATING = "invalidating"
REASON_NOT_ABSENT = "not_absent"
REASON_PARENT_NOT_COMMITTED = "parent_not_committed"
REASON_UNAUTHORIZED = "unauthorized"
REASON_UNKNOWN_LEASE = "unknown_lease"
REASON_STALE_EPOCH = "stale_epoch"
REASON_LEASE_EXPIRED = "lease_expired"
REASON_LEASED = "leased"
REASON_HAS_CHILDREN = "has_children"
REASON_RESTARTING = "restarting"
REASON_NOT_FOUND = "not_found"
REASON_WRONG_GENERATION = "wrong_generation"
REASON_MISS = "miss"  # a read found no valid bytes at the leased location
REASON_FENCED = "fenced"  # a location refused an operation carrying a stale epoch
REASONS = (
    REASON_NOT_COMMITTED, REASON_INVALIDATING, REASON_NOT_ABSENT, REASON_PARENT_NOT_COMMITTED,
    REASON_UNAUTHORIZED, REASON_UNKNOWN_LEASE, REASON_STALE_EPOCH, REASON_LEASE_EXPIRED,
    REASON_LEASED, REASON_HAS_CHILDREN, REASON_RESTARTING, REASON_NOT_FOUND,
    REASON_WRONG_GENERATION, REASON_MISS, REASON_FENCED,
)  # fmt: skip
assert len(set(REASONS)) == len(REASONS)

# Deletion reaches everywhere (DESIGN progress). The longest a location that is up may keep an
# ended generation's bytes once the generation ended, unless an adapter declares its own
# (``Capabilities.free_bound_ms``): the reference directory sends a free at once and, while
# unacknowledged, again after 1 s, the wait doubling up to 8 s, so a free reaches a reachable
# location within 8 s plus a message delay (``kvcc.reference.directory.core``
# ``FREE_RETRY_MAX_MS_DEFAULT``).
FREE_BOUND_MS_DEFAULT = 8_000


def deletion_deadline_ms(term_ms: int, skew_ms: int, free_bound_ms: int) -> tuple[int, int]:
    """The deletion bound, as the suite checks it: ``(after_end, after_write_grant)``. A location
    must have freed an ended generation's bytes within ``after_end`` ms of the generation's end
    as the suite saw it (a completed invalidation, an abort) -- the free bound plus one lease
    term of message delay -- and the bytes of a write whose lease expired within
    ``after_write_grant`` ms of the write grant's answer: the directory holds a write lease live
    until term + epsilon after the grant, plus epsilon for its clock, then the same bound."""
    after_end = free_bound_ms + term_ms
    return after_end, term_ms + 2 * skew_ms + after_end


REASON_MAX_CHARS = 64
DETAIL_MAX_CHARS = 4096


# -- errors ----------------------------------------------------------------------------------------


class ContractError(Exception):
    """Base of the errors an adapter raises through the contract."""


class NotSupported(ContractError):
    """The operation or fault ``op`` is not among the adapter's declared capabilities."""

    def __init__(self, op: str) -> None:
        super().__init__(op)
        self.op = op


class AdapterError(ContractError):
    """The infrastructure under the adapter broke: a process died, a connection was refused or
    reset, an answer could not be parsed. ``reason`` says which, in words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# -- values ----------------------------------------------------------------------------------------


def _nonneg_int(instance, attribute, value) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(f"{attribute.name} is an int >= 0, got {value!r}")


def _text(instance, attribute, value) -> None:
    if type(value) is not str or not value:
        raise ValueError(f"{attribute.name} is non-empty text, got {value!r}")


def _key(instance, attribute, value) -> None:
    if not isinstance(value, BlockKey):
        raise TypeError(f"{attribute.name} is a BlockKey, got {type(value).__name__}")


def _subset(allowed: tuple[str, ...]):
    def check(instance, attribute, value) -> None:
        if not isinstance(value, frozenset):
            raise TypeError(f"{attribute.name} is a frozenset")
        bad = value - set(allowed)
        if bad:
            raise ValueError(f"{attribute.name}: unknown {sorted(bad)}; allowed {list(allowed)}")

    return check


def _one_of(allowed: tuple[str, ...]):
    def check(instance, attribute, value) -> None:
        if value not in allowed:
            raise ValueError(f"{attribute.name} is one of {list(allowed)}, got {value!r}")

    return check


@frozen
class Capabilities:
    """What an adapter can do and what it claims.

    - ``profiles``: the profiles it claims (``PROFILES``); certification requires every required
      test of each to PASS.
    - ``faults``: the fault operations it implements (``FAULTS``); a test needing another is
      NOT_APPLICABLE.
    - ``scopes``: invalidation scopes it implements (``SCOPES``).
    - ``events``: ``"native"`` if ``events()`` returns the deployment's protocol events,
      ``"inferred"`` if it returns ``None`` and the suite infers them from the history.
    - ``leases``: ``"enforced"`` (the system refuses to free leased bytes), ``"advisory"``
      (leases are tracked but not enforced) or ``"none"``.
    - ``free_bound_ms``: the deletion bound the deployment promises (DESIGN progress: deletion
      reaches everywhere): every location that held a generation MUST free its bytes -- and,
      with native events, log ``free_slot`` (or ``fence_stale_free`` when a later epoch already
      replaced them) -- within this many ms of the generation ending (an invalidation
      completing, a write aborted or its write lease expired), plus a message delay, while the
      location is up, even when frees are lost on the way (a lost free MUST be sent again).
      Default ``FREE_BOUND_MS_DEFAULT`` (what the reference directory's retry schedule meets).
    - ``notes``: free text for the report.
    """

    profiles: frozenset[str] = field(converter=frozenset, validator=_subset(PROFILES))
    faults: frozenset[str] = field(default=frozenset(), converter=frozenset, validator=_subset(FAULTS))
    scopes: frozenset[str] = field(default=frozenset({"key"}), converter=frozenset, validator=_subset(SCOPES))
    events: Literal["native", "inferred"] = field(default="inferred", validator=_one_of(EVENT_SOURCES))
    leases: Literal["enforced", "advisory", "none"] = field(default="enforced", validator=_one_of(LEASE_MODES))
    notes: str = ""
    free_bound_ms: int = field(default=FREE_BOUND_MS_DEFAULT, validator=_nonneg_int)

    def to_json(self) -> dict[str, object]:
        return {
            "profiles": sorted(self.profiles),
            "faults": sorted(self.faults),
            "scopes": sorted(self.scopes),
            "events": self.events,
            "leases": self.leases,
            "notes": self.notes,
            "free_bound_ms": self.free_bound_ms,
        }


@frozen
class RunContext:
    """What ``Adapter.start`` needs to bring a deployment up for one test.

    - ``workdir``: an empty directory the adapter may use (data, logs, sockets); the suite
      deletes it afterwards unless the report keeps it.
    - ``seed``: the test's seed (the adapter may use it for its own randomness).
    - ``nodes``: how many cache nodes (>= 1).
    - ``lease_term_ms``, ``skew_ms``: the lease term the directory grants and the clock bound
      epsilon; the suite's oracles and the validator use the same values.
    - ``namespaces``: the tenant namespaces the deployment must authorise; any other namespace
      must be refused (``Refused("unauthorized")``).
    """

    workdir: Path
    seed: int = field(validator=_nonneg_int)
    nodes: int = field(default=2)
    lease_term_ms: int = field(default=2000)
    skew_ms: int = field(default=50)
    namespaces: tuple[Namespace, ...] = field(default=(), converter=tuple)

    @nodes.validator
    def _check_nodes(self, attribute, value) -> None:
        if type(value) is not int or value < 1:
            raise ValueError(f"nodes is an int >= 1, got {value!r}")

    @lease_term_ms.validator
    def _check_term(self, attribute, value) -> None:
        if type(value) is not int or value < 1:
            raise ValueError(f"lease_term_ms is an int >= 1, got {value!r}")

    @skew_ms.validator
    def _check_skew(self, attribute, value) -> None:
        if type(value) is not int or value < 0 or 2 * value >= self.lease_term_ms:
            raise ValueError(f"skew_ms is an int >= 0 and below half the lease term, got {value!r}")


@frozen
class WriteGrant:
    """A write lease: the right of ``node`` to fill ``key`` (generation ``gen``) at ``location``
    under fencing token ``epoch``, for ``term_ms`` from ``requested_at_ns`` (adapter's
    ``time.monotonic_ns()`` when it sent the request)."""

    node: str = field(validator=_text)
    key: BlockKey = field(validator=_key)
    gen: int = field(validator=_nonneg_int)
    epoch: int = field(validator=_nonneg_int)
    lease: int = field(validator=_nonneg_int)
    location: str = field(validator=_text)
    term_ms: int = field(validator=_nonneg_int)
    requested_at_ns: int = field(validator=_nonneg_int)

    def trusted_until_ns(self, skew_ms: int) -> int:
        """The holder's own deadline: requested_at + term - skew (DESIGN "Leases")."""
        return self.requested_at_ns + (self.term_ms - skew_ms) * 1_000_000


@frozen
class ReadGrant:
    """A read lease: the right of ``node`` to read ``key`` generation ``gen`` at ``location``
    (whose epoch is ``epoch``) for ``term_ms`` from ``requested_at_ns``."""

    node: str = field(validator=_text)
    key: BlockKey = field(validator=_key)
    gen: int = field(validator=_nonneg_int)
    epoch: int = field(validator=_nonneg_int)
    lease: int = field(validator=_nonneg_int)
    location: str = field(validator=_text)
    term_ms: int = field(validator=_nonneg_int)
    requested_at_ns: int = field(validator=_nonneg_int)

    def trusted_until_ns(self, skew_ms: int) -> int:
        """The holder's own deadline: requested_at + term - skew (DESIGN "Leases")."""
        return self.requested_at_ns + (self.term_ms - skew_ms) * 1_000_000


@frozen
class Stored:
    """``write_bytes`` put the bytes at the grant's location (not yet visible: commit does that)."""


@frozen
class Committed:
    """``commit`` published the block: it is COMMITTED at generation ``gen`` under ``epoch``."""

    gen: int = field(validator=_nonneg_int)
    epoch: int = field(validator=_nonneg_int)


@frozen
class Evicted:
    """``evict`` dropped the node's copy of the block."""


@frozen
class Refused:
    """An allowed refusal, with a reason from ``REASONS`` where one fits and free ``detail``."""

    reason: str = field()
    detail: str = ""

    @reason.validator
    def _check_reason(self, attribute, value) -> None:
        if type(value) is not str or not value or len(value) > REASON_MAX_CHARS:
            raise ValueError(f"reason is non-empty text of at most {REASON_MAX_CHARS} chars, got {value!r:.80}")


@frozen
class InvalidationTicket:
    """Handle on a started invalidation: ``id`` (adapter-chosen, unique per run) and how many
    ``keys`` it covers (0 if nothing was committed under the scope)."""

    id: int = field(validator=_nonneg_int)
    keys: int = field(validator=_nonneg_int)


# -- the adapter -------------------------------------------------------------------------------------


class Adapter(abc.ABC):
    """One deployment of a cache layer, as the conformance suite sees it.

    Every method is synchronous and must be thread-safe: the suite calls them concurrently
    from several threads, each acting as one node's client. Every method except ``stop`` may
    raise ``AdapterError`` when the infrastructure breaks; every operation not declared in
    ``capabilities()`` raises ``NotSupported``. No method may block longer than the longest
    lease term plus a few seconds: the suite's watchdog turns a hang into ERROR.
    """

    name: str = "adapter"

    # -- lifecycle ---------------------------------------------------------------------------

    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """The profiles claimed and the operations supported.

        Must: return the same value for the adapter's whole life; be callable before ``start``.
        Must not: claim a profile whose tests need operations it raises ``NotSupported`` for.
        """

    @abc.abstractmethod
    def start(self, ctx: RunContext) -> None:
        """Bring a fresh, empty deployment up: a directory with ``ctx.lease_term_ms`` and
        ``ctx.skew_ms``, ``ctx.nodes`` cache nodes, tenants authorised for ``ctx.namespaces``.

        Must: return only when every node answers; start from empty state (no block of an
        earlier run visible); put every file it writes under ``ctx.workdir``.
        Must not: reuse processes or state of another ``start``.
        Raises: ``AdapterError`` if the deployment does not come up (after cleaning up what it
        started).
        """

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop every process and thread the adapter started and release its ports.

        Must: succeed after any error, after a partial ``start``, when called twice, and when
        called from another thread while an operation hangs (making that operation fail).
        Must not: raise (log and swallow instead); leave a process behind.
        """

    @abc.abstractmethod
    def nodes(self) -> Sequence[str]:
        """The node ids of the running deployment, stable from ``start`` to ``stop`` (a
        restarted node keeps its id)."""

    @abc.abstractmethod
    def versions(self) -> Mapping[str, str]:
        """Name -> version of the adapter and of every system under it (for ``run_info.json``)."""

    # -- data plane: writes ------------------------------------------------------------------

    @abc.abstractmethod
    def lookup(self, node: str, ns: Namespace, keys: Sequence[BlockKey]) -> int:
        """How many blocks of ``keys`` (a chain, root first) are COMMITTED, counting from the
        first: the longest committed prefix, as the directory sees it.

        Must: count a key only if every key before it counts; refuse nothing (an unauthorised
        namespace counts 0). Must not: take or change any lease.
        """

    @abc.abstractmethod
    def begin_write(self, node: str, ns: Namespace, key: BlockKey, parent: BlockKey | None) -> WriteGrant | Refused:
        """Ask the directory for the write lease of ABSENT ``key`` (whose chain parent is
        ``parent``, ``None`` for a root block), to be filled at a location of ``node``.

        Must: grant at most one write lease per key and generation (DESIGN property 1), with an
        epoch above every earlier epoch of the key (property 2); refuse
        ``not_absent`` if the key has a generation, ``parent_not_committed`` if the parent is
        not COMMITTED, ``unauthorized`` for a namespace not in ``RunContext.namespaces``,
        ``restarting`` during a restarted directory's grace period.
        Must not: make the key readable before ``commit``.
        """

    @abc.abstractmethod
    def write_bytes(self, grant: WriteGrant, data: bytes) -> Stored | Refused:
        """Store ``data`` at ``grant.location`` under ``grant.epoch``.

        Must: refuse ``fenced`` when the location has seen a higher epoch for the key (property
        2). May refuse ``lease_expired`` when the writer's own deadline has passed -- but bytes
        already in flight are judged by their epoch where they land, so a location must fence
        them whatever the writer believes.
        Must not: overwrite bytes under a live read lease (property 5) or committed bytes
        (property 4).
        """

    @abc.abstractmethod
    def commit(self, grant: WriteGrant) -> Committed | Refused:
        """Publish the block written under ``grant``: WRITING -> COMMITTED.

        Must: refuse ``stale_epoch`` / ``unknown_lease`` / ``lease_expired`` when the write
        lease expired or was superseded (the late writer is fenced).
        Must not: publish bytes that were not all stored.
        """

    @abc.abstractmethod
    def abort(self, grant: WriteGrant) -> None:
        """Give up a write lease: the key returns to ABSENT, at once or when the write lease
        expires. Bytes stored under it MUST then be freed within
        ``capabilities().free_bound_ms`` (as for an invalidation), and so MUST those of a write
        whose lease expired unused. Idempotent; never raises for an already expired or unknown grant. The suite
        may still call ``write_bytes`` with an aborted grant: bytes that were in flight when
        the writer gave up, which the location must judge by their epoch."""

    # -- data plane: reads -------------------------------------------------------------------

    @abc.abstractmethod
    def acquire(self, node: str, ns: Namespace, key: BlockKey) -> ReadGrant | Refused:
        """A read lease on one location holding COMMITTED ``key`` for ``node``'s client.

        Must: refuse ``not_committed`` for an ABSENT or WRITING key, ``invalidating`` while an
        invalidation covers it, ``unauthorized`` outside the tenant's namespaces (property 11);
        use a lease id never used before (property 8).
        Must not: point the lease at a location that does not hold the bytes (property 9).
        """

    @abc.abstractmethod
    def renew(self, grant: ReadGrant) -> ReadGrant | Refused:
        """Extend a live read lease; the new grant has a new ``requested_at_ns``.

        Must: refuse ``unknown_lease`` / ``lease_expired`` for a lease that expired, was
        released or revoked. Must not: revive such a lease (property 8).
        """

    @abc.abstractmethod
    def read(self, grant: ReadGrant) -> bytes | Refused:
        """The bytes of the leased block.

        Must: return exactly the committed bytes (property 4) or a refusal (``miss``,
        ``lease_expired``, ``invalidating``, ``unknown_lease``); refuse once the holder's own
        deadline ``grant.trusted_until_ns(skew_ms)`` has passed, and once the holder acked an
        invalidation of that generation (property 7).
        Must not: return other bytes, partial bytes, or bytes of another generation.
        """

    @abc.abstractmethod
    def release(self, grant: ReadGrant) -> None:
        """End a read lease early. Idempotent; never raises for an expired or unknown lease."""

    # -- invalidation and eviction -----------------------------------------------------------

    @abc.abstractmethod
    def invalidate(self, node: str, ns: Namespace, scope: str, key: BlockKey | None) -> InvalidationTicket:
        """Start invalidating ``key`` (``scope="key"``, with its descendants), the chain from
        ``key`` down (``"prefix"``) or every block of ``ns`` (``"namespace"``, ``key`` None).

        Must: stop granting leases on the covered keys at once; tell holders to drop and ack;
        complete only when every holder acked or its lease expired plus ``skew_ms``
        (property 6), then free the locations and move keys to ABSENT at generation + 1.
        Every location that held a voided generation MUST free its bytes within
        ``capabilities().free_bound_ms`` of the completion (plus a message delay), logging
        ``free_slot`` / ``fence_stale_free`` with native events, even when frees are lost
        (DESIGN progress: deletion reaches everywhere; KVCC-INVAL-006).
        Raises: ``NotSupported`` for a scope not in ``capabilities().scopes``.
        """

    @abc.abstractmethod
    def wait_invalidation(self, ticket: InvalidationTicket, timeout_s: float) -> bool:
        """Block until the invalidation completes (True) or ``timeout_s`` passes (False).

        Must: return True only after completion as defined in ``invalidate``; return promptly
        for a completed ticket.
        """

    @abc.abstractmethod
    def evict(self, node: str, ns: Namespace, key: BlockKey) -> Evicted | Refused:
        """Drop ``node``'s copy of ``key`` as a tier would under memory pressure.

        Must: refuse ``leased`` while a live read lease names that copy (property 5),
        ``has_children`` while a descendant is cached there (leaves before ancestors),
        ``not_found`` when the node holds no copy.
        Must not: free bytes a live lease points at.
        """

    # -- faults ------------------------------------------------------------------------------

    def kill(self, node: str) -> None:
        """Crash ``node`` (kill -9): its memory and unsynced state are gone; its leases simply
        stop being renewed. Raises ``NotSupported`` unless ``"kill"`` is declared."""
        raise NotSupported("kill")

    def restart(self, node: str) -> None:
        """Restart a killed ``node`` with a new incarnation; it rejoins empty or with its disk.
        Raises ``NotSupported`` unless ``"restart"`` is declared."""
        raise NotSupported("restart")

    def pause(self, node: str) -> None:
        """Stop ``node`` (SIGSTOP) without killing it; operations naming it block or fail.
        Raises ``NotSupported`` unless ``"pause"`` is declared."""
        raise NotSupported("pause")

    def resume(self, node: str) -> None:
        """Continue a paused ``node`` (SIGCONT). It must discover that its leases expired.
        Raises ``NotSupported`` unless ``"resume"`` is declared."""
        raise NotSupported("resume")

    def skew_clock(self, node: str, offset_ms: int) -> None:
        """Offset ``node``'s clock by ``offset_ms`` (|offset| <= skew_ms keeps within the spec's
        assumption). Raises ``NotSupported`` unless ``"skew_clock"`` is declared."""
        raise NotSupported("skew_clock")

    def restart_directory(self) -> None:
        """Crash and restart the directory from its durable log; it must then grant nothing
        conflicting until the longest outstanding lease expired (property 12).
        Raises ``NotSupported`` unless ``"restart_directory"`` is declared."""
        raise NotSupported("restart_directory")

    # -- trace -------------------------------------------------------------------------------

    @abc.abstractmethod
    def events(self) -> list[dict] | None:
        """All protocol events of every component since ``start`` (``kvcc.reference.events``
        records: per ``(node, incarnation)`` seq from 1 rising by one), or ``None`` when
        ``capabilities().events == "inferred"``: the suite then infers the adapter-side events
        from the history of operations it performed.

        Must: include events of killed incarnations; be callable after ``stop``.
        """


AdapterFactory = Callable[[], Adapter]  # what --adapter names: a zero-argument callable

__all__ = [
    "FAULTS", "FREE_BOUND_MS_DEFAULT", "PROFILES", "REASONS", "SCOPES", "Adapter", "AdapterError", "AdapterFactory", "Capabilities", "Committed",
    "ContractError", "Evicted", "InvalidationTicket", "NotSupported", "ReadGrant", "Refused", "RunContext",
    "Stored", "WriteGrant", "deletion_deadline_ms",
]  # fmt: skip
