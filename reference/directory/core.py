"""The directory as a sans-IO core: messages and time in, replies and effects out.

Theory of operation
-------------------
The directory is the authority for every block key: its record (phase, generation, epoch, owner,
transfer, writer and write lease), the read leases on it, and the invalidations that void it.
This module is that authority with no I/O at all (h11 style): it never reads a clock, opens a
socket, touches a disk or draws a random number. The runtime around it supplies

- **time**: every entry point takes ``now_ms``, the directory's *monotonic* clock (never stepped
  back within one incarnation; a restarted directory may start a new clock anywhere). Timers fire
  when the runtime calls ``tick(now_ms)`` at ``next_deadline_ms()`` -- and, since every entry point
  first lets time pass up to ``now_ms``, a late tick only delays, never breaks, anything;
- **messages**: ``handle(msg, now_ms, tenant)`` takes one request of ``kvcc.reference.wire`` from
  an authenticated ``tenant`` and returns ``(reply, effects)``; ``reply`` is ``None`` for the
  one-way messages (``RevokeAcked``, ``Copied``, ``Freed``);
- **effects**, attrs values to carry out *in order*, durable ones first: ``Persist`` (a record),
  ``PersistTicket``, ``ForgetTicket`` and ``ReserveLeaseIds`` must be committed to the durable log
  (``store.DirectoryStore.commit``) before the reply or any ``Send``, ``FreeAt`` or ``CopyAt`` of
  the same call leaves: a directory that crashes after a reply and before its log would otherwise
  forget a commit, a lease id or a completed invalidation it already told someone about.
  ``Emit`` is one line of the protocol event log (``kvcc.reference.events``); ``CompleteTicket``
  wakes whoever waits on that invalidation.

Every decision is a rule of ``kvcc.spec.rules`` -- the functions the model checker explored --
called with arguments read from this module's records and lease table. The mapping onto the
spec's state (``spec/layout.py``):

- ``Record`` is ``record[k]``; a lease-table entry ``ReadLease`` is ``lease[k, n]``, with the
  spec's "ticks left" replaced by ``expires_at_ms`` on the directory clock
  (``rules.lease_expires_at``: grant time + term + epsilon); an entry is live while
  ``rules.lease_live(now, expires_at_ms)``. Write leases likewise.
- ``next_lease_id`` is ``directory.next_lease_id``. The spec keeps it durable; here lease ids are
  reserved in blocks of ``lease_id_block``: the high-water mark ``lease_id_limit`` is made durable
  (``ReserveLeaseIds``) *before* any id below it is handed out, and a restarted directory starts
  at the durable mark, so ids are never reused (protocol property 8), whatever was lost in the crash.
  Shard ``i`` of a sharded directory (``DirectoryConfig.shard``/``shards``, docs/sharding.md)
  hands out only the ids congruent to ``i`` modulo ``shards``, stepping by ``shards``, and a
  restarted shard starts at the first of them at or above its durable mark: ids are then unique
  across the shards too. With one shard that is every id, in order.
- ``grace_until_ms`` is ``directory.restart_grace_left``: after ``restarted`` the directory frees
  nothing for ``rules.restart_grace`` (term + 2 epsilon), the longest lease it may have issued
  plus the skew its own clock may have gathered (protocol property 12).
- Tickets (``Ticket``) are not in the spec: they make an invalidation's completion observable
  (``WaitTicket``). A ticket completes when every key it voided has completed its invalidation.

Deletion reaches everywhere (docs/protocol.md: progress). Every state change that ends a generation --
an invalidation completing, a write aborted by one, a write lease expiring -- and every drained
copy let go puts ``(location, epoch)`` into the record's durable to-free set (``Record.to_free``)
*in the same* ``Persist``, and sends ``FreeAt``. A free is sent again after
``free_retry_first_ms``, the wait doubling up to ``free_retry_max_ms``, until the location
acknowledges it (``Freed``: freed, nothing there, or fenced -- see ``Record.to_free`` for why a
fenced free is done); nothing is sent during restart grace (the retries wait for its end) nor
to a location known to be down (they wait for ``locations_up``). A restarted directory finds
the set in its records. So a generation's bytes leave a location within ``free_retry_max_ms``
(plus a message delay) of the location being reachable. (An eviction is not in the set: the
node asked for it and drops the bytes itself.)

Down nodes (P4). The runtime tells the core which node it stopped hearing from (``node_down``,
the spec's ``declare_node_down``: the server's watchdog, after ``node_down_after_ms`` of missed
heartbeats) and which locations are back (``locations_up``: a Hello, or heartbeats again). A
down location gets no read lease (``rules.may_grant_read``: ``location_down``) and no write
placed on it; every COMMITTED key it owns is voided with its subtree in that step
(``rules.down_owner_invalidates``): its leases are revoked and the key is ABSENT -- writable
again, elsewhere -- once they were acknowledged or expired, within term + epsilon of the
declaration and never sooner.

Handlers follow TigerBeetle's shape: first the message is ignored with a reason if it is stale or
duplicated (network weather: an ``Emit`` of an ``ignore_*`` event, which is a diagnostic and not a
spec action, and no state change); then a rule decides; then the handler asserts what must now
hold. A peer that breaks the protocol in a way no network can (a ticket never issued, a message
the directory does not take) gets ``PeerViolation``; a key claimed under a second parent is refused
(``key_identity``: the writer's session goes on, nothing changes), and so is a root write to a
shard that does not own its chain (``wrong_shard``, docs/sharding.md); a request for a namespace
its tenant may not use, where the reply has no refusal to carry it (``Lookup``, ``Invalidate``),
gets ``Unauthorized``. Anything else that goes wrong is our bug: an ``AssertionError``.

Event names are the spec's action names (``kvcc.reference.events.EVENTS``), except the
``ignore_*`` diagnostics and the ``PROPOSED_EVENTS`` (logged once the spec names them); extra
fields never shadow the log's standard ones (``holder``, ``writer``, ``location`` name the nodes
and locations involved).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Union

import attrs
from attrs import field, frozen

from kvcc.spec.keys import BlockKey, LeaseId, LocationId, NamespaceDigest, NodeId, shard_of
from kvcc.spec.rules import (
    ABSENT,
    COMMITTED,
    INVALIDATE_ABORT_WRITE,
    INVALIDATE_START,
    INVALIDATING,
    PHASE_NAMES,
    PHASES,
    READABLE_PHASES,
    SKEW_MS_DEFAULT,
    WRITING,
    directory_view,
    down_owner_invalidates,
    free_acknowledged,
    holder_budget,
    invalidation_deadline,
    invalidation_step,
    lease_expires_at,
    lease_live,
    lost_copy_invalidates,
    may_ack_revoke,
    may_begin_write,
    may_commit,
    may_complete_invalidation,
    may_evict,
    may_finish_transfer,
    may_free_drained,
    may_grant_read,
    may_release,
    may_renew,
    may_retry_free,
    may_start_transfer,
    next_epoch,
    owe_free,
    restart_grace,
    restart_grace_within,
    write_lease_must_expire,
)
from kvcc.spec.vocabulary import (
    REASON_KEY_IDENTITY,
    REASON_LEASED,
    REASON_LOCATION_DOWN,
    REASON_NOT_FOUND,
    REASON_UNAUTHORIZED,
    REASON_UNKNOWN_LEASE,
    REASON_WRONG_GENERATION,
    REASON_WRONG_SHARD,
    SCOPE_KEY,
    SCOPE_NAMESPACE,
    location_host,
)

from ..errors import PeerViolation, Unauthorized
from ..events import EVENTS
from ..wire import (
    HEARTBEAT_INTERVAL_MS,
    Acquire,
    BeginWrite,
    Commit,
    CommitRejected,
    Committed,
    Copied,
    Copy,
    Evict,
    Evicted,
    EvictRefused,
    Freed,
    Invalidate,
    InvalidationCompleted,
    InvalidationPending,
    InvalidationStarted,
    LeaseRefused,
    LeaseReleased,
    LeaseRenewed,
    Located,
    Locate,
    Lookup,
    PrefixFound,
    ReadLeaseGranted,
    Release,
    Renew,
    Revoke,
    RevokeAcked,
    WaitTicket,
    WriteLeaseGranted,
)

NO_LEASE = 0  # lease ids start at 1, as in the spec
COLOCATED_SEPARATOR = "."  # a holder "<node>.<name>" is a client co-located with <node>
FIRST_LEASE_ID = 1
FIRST_TICKET = 1
TICKET_PENDING = "pending"
TICKET_COMPLETED = "completed"
# Steps the spec does not have (yet): a node taken for down that is heard from again without a
# restart (it was paused). Until ``EVENTS`` lists a name, ``Emit.is_spec_action`` is false and
# the server does not log it (a validator could not replay it).
PROPOSED_EVENTS = ("mark_location_up",)
FREE_RETRY_FIRST_MS_DEFAULT = 1_000  # a Free not acknowledged by then is sent again ...
FREE_RETRY_MAX_MS_DEFAULT = 8_000  # ... with the wait doubling up to this (docs/protocol.md: deletion reaches everywhere)
# A node silent this long on an open connection is down (a stopped or hung process: the spec's
# detector declares only crashed nodes, a paused one comes back). A node whose connection is
# gone is declared after ``DirectoryConfig.disconnect_detection_ms`` (a lease term) instead.
NODE_DOWN_AFTER_MS_DEFAULT = 10_000
# A node's heartbeat must be missed several times over before it counts as down (a slow event
# loop or a busy machine is not a crash).
assert HEARTBEAT_INTERVAL_MS * 4 <= NODE_DOWN_AFTER_MS_DEFAULT
assert FREE_RETRY_FIRST_MS_DEFAULT <= FREE_RETRY_MAX_MS_DEFAULT
_EVENT_SET = frozenset(EVENTS)
_EMITTABLE = _EVENT_SET | frozenset(PROPOSED_EVENTS)


# -- configuration ----------------------------------------------------------------------------------


def _positive(instance: Any, attribute: Any, value: int) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


@frozen
class DirectoryConfig:
    """The directory's limits. ``lease_term_ms`` is what a lease is granted for; ``skew_ms`` is
    epsilon, the bound on the offset between any two clocks (the spec's ``skew_ticks``).
    ``lease_id_block``: lease ids reserved durably at once. ``max_completed_tickets``: completed
    invalidation tickets remembered (older ones are answered "completed" by id alone).
    ``pool_location``: where new blocks are written by default (the shared pool), if anywhere.
    ``free_retry_first_ms`` / ``free_retry_max_ms``: a ``Free`` not acknowledged (``Freed``) is
    sent again after the first, then twice as long each time, up to the max: deletion reaches a
    location within ``free_retry_max_ms`` of its coming back. The runtime declares a node down
    (the core is told: ``node_down``) once its connection has been gone for
    ``disconnected_down_after_ms`` (default: the lease term, the spec's failure-detection time:
    a node's registration is a lease of one term), or once it has been silent on an open
    connection for ``node_down_after_ms`` (a stopped or hung process: longer, since the spec
    declares only crashed nodes and a paused one comes back).

    ``shard`` / ``shards``: this directory is shard ``shard`` of ``shards`` (docs/sharding.md). It
    owns the chains whose root ``keys.shard_of`` maps to ``shard`` (a root write of another shard's
    chain is refused ``wrong_shard``) and hands out the lease ids congruent to ``shard`` modulo
    ``shards``, so that ids stay unique across the deployment and every check naming a lease by
    id alone holds unchanged. ``shards == 1`` (the default) is the one directory, exactly."""

    lease_term_ms: int = field(default=10_000, validator=_positive)
    skew_ms: int = SKEW_MS_DEFAULT
    lease_id_block: int = field(default=1024, validator=_positive)
    max_completed_tickets: int = field(default=10_000, validator=_positive)
    pool_location: LocationId | None = None
    free_retry_first_ms: int = field(default=FREE_RETRY_FIRST_MS_DEFAULT, validator=_positive)
    free_retry_max_ms: int = field(default=FREE_RETRY_MAX_MS_DEFAULT, validator=_positive)
    node_down_after_ms: int = field(default=NODE_DOWN_AFTER_MS_DEFAULT, validator=_positive)
    disconnected_down_after_ms: int | None = None
    # Mirror read leases to the store (``MirrorLeases``), one bucket of this many ms at a time, so
    # that a restart waits only for the leases outstanding (``restarted``'s ``lease_horizon_ms``).
    # None: not mirrored (a restart waits the full grace).
    lease_mirror_bucket_ms: int | None = None
    shard: int = 0
    shards: int = field(default=1, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if type(self.shard) is not int or not 0 <= self.shard < self.shards:
            raise ValueError(f"shard must be an int in 0 .. shards - 1 ({self.shards - 1}), got {self.shard!r}")
        if type(self.skew_ms) is not int or not 0 <= self.skew_ms < self.lease_term_ms:
            raise ValueError("skew_ms must be an int in 0 .. lease_term_ms - 1: a holder must keep a positive budget")
        if self.free_retry_first_ms > self.free_retry_max_ms:
            raise ValueError("free_retry_first_ms must be at most free_retry_max_ms")
        if self.node_down_after_ms < 4 * HEARTBEAT_INTERVAL_MS:
            raise ValueError(f"node_down_after_ms must be at least 4 heartbeats ({4 * HEARTBEAT_INTERVAL_MS} ms)")
        bucket = self.lease_mirror_bucket_ms
        if bucket is not None and (type(bucket) is not int or bucket < 1):
            raise ValueError(f"lease_mirror_bucket_ms must be an int >= 1 or None, got {bucket!r}")
        gone = self.disconnected_down_after_ms
        if gone is not None and (type(gone) is not int or gone < 1):
            raise ValueError(f"disconnected_down_after_ms must be an int >= 1 or None, got {gone!r}")

    @property
    def disconnect_detection_ms(self) -> int:
        """How long a node may be without a connection before it is declared down."""
        if self.disconnected_down_after_ms is not None:
            return self.disconnected_down_after_ms
        return self.lease_term_ms

    @property
    def holder_budget_ms(self) -> int:
        return holder_budget(self.lease_term_ms, self.skew_ms)

    @property
    def directory_view_ms(self) -> int:
        return directory_view(self.lease_term_ms, self.skew_ms)

    @property
    def restart_grace_ms(self) -> int:
        return restart_grace(self.lease_term_ms, self.skew_ms)

    def invalidation_deadline_ms(self, restarts: int = 0) -> int:
        return invalidation_deadline(self.lease_term_ms, self.skew_ms, restarts)


def own_lease_id_from(at_least: int, shard: int, shards: int) -> int:
    """The first lease id at or above ``at_least`` that shard ``shard`` of ``shards`` may hand out:
    the ids congruent to ``shard`` modulo ``shards`` (docs/sharding.md). ``at_least`` itself with
    one shard."""
    assert 0 <= shard < shards
    return at_least + (shard - at_least) % shards


# -- state --------------------------------------------------------------------------------------------


@frozen
class Record:
    """The durable entry of one key (glossary: record). ``namespace`` and ``parent`` are the key's
    identity, learnt from the first ``BeginWrite`` (a key's hash chains over both, so they never
    change). ``write_lease`` is ``NO_LEASE`` unless WRITING; ``committed_lease`` is the write lease
    that committed the current generation (to answer a retried ``Commit`` again).

    ``to_free``: the durable to-free set of this key, ``(location, epoch)`` pairs sorted by
    location, one per location: a generation that ended (invalidation completed, write aborted
    or expired, a drained copy let go) left bytes there, and a ``Free(location, key, epoch)`` is
    sent until the location acknowledges it (``Freed``). One entry per location suffices: a free
    under epoch ``e`` drops the key's block there, whatever generation it holds, unless the
    location's fence is above ``e`` -- and every free carries the key's epoch at the time, the
    highest ever issued, so a fence above it means a later grant at that location whose own
    end is freed in turn (docs/protocol.md: deletion reaches everywhere)."""

    key: BlockKey
    namespace: NamespaceDigest
    parent: BlockKey | None
    phase: int = ABSENT
    gen: int = 0
    epoch: int = 0
    owner: LocationId | None = None
    moving_to: LocationId | None = None
    draining: LocationId | None = None
    writer: NodeId | None = None
    writer_tenant: str | None = None
    write_lease: LeaseId = NO_LEASE
    write_lease_expires_at_ms: int = 0
    committed_lease: LeaseId = NO_LEASE
    to_free: tuple[tuple[LocationId, int], ...] = ()

    def __attrs_post_init__(self) -> None:
        assert self.phase in PHASES
        assert self.gen >= 0 and self.epoch >= 0
        assert (self.owner is not None) == (self.phase != ABSENT), self
        assert (self.phase == WRITING) == (self.write_lease != NO_LEASE) == (self.writer is not None), self
        assert self.moving_to is None or self.phase == COMMITTED, self
        assert self.draining is None or self.phase in READABLE_PHASES, self
        assert self.moving_to is None or self.moving_to != self.owner
        assert list(self.to_free) == sorted(set(self.to_free)), self.to_free
        assert len({loc for loc, _ in self.to_free}) == len(self.to_free), "one entry per location"
        assert all(0 <= e <= self.epoch for _, e in self.to_free), "a free names an epoch issued"

    def freeing(self, location: LocationId, epoch: int) -> tuple[tuple[LocationId, int], ...]:
        """``to_free`` with a Free under ``epoch`` owed to ``location`` (``rules.owe_free``: one
        Free under the highest epoch owed covers the lower ones)."""
        entries = dict(self.to_free)
        entries[location] = owe_free(entries.get(location, 0), epoch)
        return tuple(sorted(entries.items()))

    @property
    def phase_name(self) -> str:
        return PHASE_NAMES[self.phase]


@frozen
class ReadLease:
    """One entry of the directory's (volatile) lease table: ``lease`` lets ``node`` (of
    ``tenant``) read generation ``gen`` of ``key`` at ``location`` until ``expires_at_ms`` on the
    directory's clock."""

    lease: LeaseId
    node: NodeId
    tenant: str
    key: BlockKey
    location: LocationId
    gen: int
    expires_at_ms: int


@frozen
class Ticket:
    """An invalidation the caller can wait on: the keys it voided, those still ``pending``
    (INVALIDATING), and how the leases on them ended: ``acked`` (acknowledged, released, or
    forgotten when their holder rejoined), ``expired``, and the directory ``restarts`` lived
    through (after which the forgotten leases end by expiry too)."""

    ticket: int
    keys: tuple[BlockKey, ...]
    pending: frozenset[BlockKey]
    started_at_ms: int
    completed_at_ms: int | None = None
    acked: int = 0
    expired: int = 0
    restarts: int = 0

    @property
    def state(self) -> str:
        return TICKET_COMPLETED if self.completed_at_ms is not None else TICKET_PENDING

    @property
    def completed_by(self) -> str | None:
        """"expiry" if any lease on it ran out (or was lost to a restart), else "acks" if any was
        acknowledged, else "no_leases"; ``None`` while pending."""
        if self.completed_at_ms is None:
            return None
        if self.expired or self.restarts:
            return "expiry"
        return "acks" if self.acked else "no_leases"


# -- effects --------------------------------------------------------------------------------------------


@frozen
class Send:
    """Send ``msg`` (a ``Revoke``) to ``node`` -- only while ``due``: ``until_ms`` is when the
    revoked lease runs out on the directory's clock. The core decides at the ``now_ms`` it is
    given, but the runtime stamps that step in its event log later (after the durable commit,
    and a loaded process may be descheduled in between): a lease live at the decision may have
    run out by the stamp, and the spec's directory, stepping at the stamp, has no such lease to
    revoke. Not sent, it is a lost directive, which the spec allows: the lease ends by expiry."""

    node: NodeId
    msg: Any
    until_ms: int | None = None  # None: no deadline

    def due(self, now_ms: int) -> bool:
        """Whether the directive still means something at ``now_ms``, read after the step that
        produced it was logged."""
        return self.until_ms is None or lease_live(now_ms, self.until_ms)


@frozen
class FreeAt:
    """Send ``wire.Free(location, key, epoch)``: the location frees its copy unless fenced."""

    location: LocationId
    key: BlockKey
    epoch: int


@frozen
class CopyAt:
    """Send ``wire.Copy(location, key, source, gen, epoch)``: a transfer's new copy."""

    location: LocationId
    key: BlockKey
    source: LocationId
    gen: int
    epoch: int

    def message(self) -> Copy:
        return Copy(self.location, self.key, self.source, self.gen, self.epoch)


@frozen
class Persist:
    """Durable: store ``record`` (replacing the key's previous one)."""

    record: Record


@frozen
class PersistTicket:
    """Durable: store ``ticket``."""

    ticket: Ticket


@frozen
class ForgetTicket:
    """Durable: drop a completed ticket the directory no longer remembers."""

    ticket: int


@frozen
class ReserveLeaseIds:
    """Durable: every lease id below ``limit`` may be in use; a restart starts at ``limit``."""

    limit: int


@frozen
class MirrorLeases:
    """Durable: a read lease that may run ``remaining_ms`` more (the directory's view, from now)
    is about to be granted or renewed; the store must be able to tell a restarted directory that
    a lease may run that long (``Loaded.lease_horizon_ms``). Emitted only with
    ``DirectoryConfig.lease_mirror_bucket_ms``, once per bucket: ``remaining_ms`` covers every
    grant of the next bucket too."""

    remaining_ms: int


@frozen(eq=False)
class Emit:
    """One line of the protocol event log: ``EventLog.emit(event, **fields)``. ``is_spec_action``
    is false for the ``ignore_*`` diagnostics, which a trace validator does not replay.
    ``at_ms``: the directory time the step was taken at -- a request's arrival, or the time a
    timer's step (an expiry, a completion, a retry) fell due; the host stamps the line there
    however late it gets to log it (``CoreHost.late_ns``)."""

    event: str
    fields: Mapping[str, Any]
    at_ms: int

    @property
    def is_spec_action(self) -> bool:
        return self.event in _EVENT_SET


@frozen
class CompleteTicket:
    """Wake whoever waits on ``ticket``: its invalidation completed."""

    ticket: Ticket


Effect = Union[
    Send, FreeAt, CopyAt, Persist, PersistTicket, ForgetTicket, ReserveLeaseIds, MirrorLeases, Emit, CompleteTicket
]
DURABLE_EFFECTS = (Persist, PersistTicket, ForgetTicket, ReserveLeaseIds, MirrorLeases)

Authorization = Callable[[str, bytes], bool]  # (tenant, namespace digest) -> may use it
# (writer, key) -> where it writes; None: no location the writer may write to is up
Placement = Callable[[NodeId, BlockKey], Union[LocationId, None]]


# -- the core ---------------------------------------------------------------------------------------------


class DirectoryCore:
    """``DirectoryCore(config, tenants_authorization, place_write=None)``: a fresh directory with no
    records; ``restarted(...)`` turns it into one recovered from a durable log.

    ``tenants_authorization(tenant, namespace_digest) -> bool`` says whether a tenant may use a
    namespace (``wire.Tenants.allows``). ``place_write(node, key) -> location`` picks where a
    granted write goes; by default ``config.pool_location``, else the writer's node id (its default
    tier), so set one of the two where locations are named otherwise.

    The state is public for reading (tests, metrics, the conformance oracle) and must not be
    changed from outside: ``records``, ``read_leases``, ``tickets``, ``next_lease_id``,
    ``lease_id_limit``, ``grace_until_ms``, ``now_ms``.
    """

    def __init__(
        self,
        config: DirectoryConfig,
        tenants_authorization: Authorization,
        place_write: Placement | None = None,
    ) -> None:
        self.config = config
        self._authorized = tenants_authorization
        self._place_write = place_write or self._default_placement
        self._reset(records=(), next_lease_id=FIRST_LEASE_ID, now_ms=0)

    def _default_placement(self, node: NodeId, key: BlockKey) -> LocationId:
        return self.config.pool_location if self.config.pool_location is not None else LocationId(node)

    def _reset(self, records: Iterable[Record], next_lease_id: int, now_ms: int) -> None:
        assert next_lease_id >= FIRST_LEASE_ID
        # The durable mark may be any id (another shard count's, or a block boundary): start at
        # this shard's first id at or above it, never below it (protocol property 8).
        next_lease_id = own_lease_id_from(next_lease_id, self.config.shard, self.config.shards)
        self.now_ms = now_ms
        self.records: dict[BlockKey, Record] = {}
        self._children: dict[BlockKey, set[BlockKey]] = {}
        self._by_namespace: dict[bytes, set[BlockKey]] = {}
        self._invalidating: set[BlockKey] = set()
        self._draining: set[BlockKey] = set()
        self._write_heap: list[tuple[int, BlockKey, int]] = []  # (expires_at_ms, key, write lease)
        # Locations the runtime reported down (volatile: a restarted directory hears from every
        # node again, or not, and decides anew).
        self.down_locations: set[LocationId] = set()
        # When each pending free is next sent (volatile; the to-free set itself is in the
        # records): a heap of (due_ms, key, location), stale entries skipped (``_free_due`` is the
        # truth); ``_free_waits`` is the wait after the next send (doubling up to
        # ``free_retry_max_ms``); ``_frees_at`` indexes the to-free set by location.
        self._free_heap: list[tuple[int, BlockKey, LocationId]] = []
        self._free_due: dict[tuple[BlockKey, LocationId], int] = {}
        self._free_waits: dict[tuple[BlockKey, LocationId], int] = {}
        self._frees_at: dict[LocationId, set[BlockKey]] = {}
        for rec in records:
            self._index(rec)
        # The read-lease table and its indexes (volatile: a restart loses them).
        self.read_leases: dict[int, ReadLease] = {}
        self._leases_on_key: dict[BlockKey, set[int]] = {}
        self._lease_of_holder: dict[tuple[BlockKey, NodeId], int] = {}
        self._leases_of_node: dict[NodeId, set[int]] = {}
        self._lease_heap: list[tuple[int, int]] = []  # (expires_at_ms, lease); stale entries skipped
        self.next_lease_id = next_lease_id
        self.lease_id_limit = next_lease_id  # nothing reserved yet in this incarnation
        self.grace_until_ms: int | None = None
        self._mirrored_until_ms = 0  # leases expiring by then are covered by a MirrorLeases
        self.tickets: dict[int, Ticket] = {}
        self._tickets_on_key: dict[BlockKey, set[int]] = {}
        self._completed_order: deque[int] = deque()
        self.next_ticket = FIRST_TICKET

    def _index(self, rec: Record) -> None:
        """Put a record in place and keep every index of it current."""
        old = self.records.get(rec.key)
        if old is None:
            if rec.parent is not None:
                self._children.setdefault(rec.parent, set()).add(rec.key)
            self._by_namespace.setdefault(rec.namespace, set()).add(rec.key)
        else:
            assert (old.namespace, old.parent) == (rec.namespace, rec.parent), "a key's identity never changes"
            assert rec.gen >= old.gen and rec.epoch >= old.epoch, "generations and epochs never decrease"
        self.records[rec.key] = rec
        (self._invalidating.add if rec.phase == INVALIDATING else self._invalidating.discard)(rec.key)
        (self._draining.add if rec.draining is not None else self._draining.discard)(rec.key)
        for loc, _ in rec.to_free:
            self._frees_at.setdefault(loc, set()).add(rec.key)
        if old is not None:
            for loc in {loc for loc, _ in old.to_free} - {loc for loc, _ in rec.to_free}:
                self._frees_at[loc].discard(rec.key)
                self._free_due.pop((rec.key, loc), None)
                self._free_waits.pop((rec.key, loc), None)
        if rec.phase == WRITING:
            heapq.heappush(self._write_heap, (rec.write_lease_expires_at_ms, rec.key, rec.write_lease))

    def _put(self, rec: Record, effects: list[Effect]) -> Record:
        self._index(rec)
        effects.append(Persist(rec))
        return rec

    # ------------------------------------------------------------------ reading the state

    @property
    def in_grace(self) -> bool:
        return self.grace_until_ms is not None and lease_live(self.now_ms, self.grace_until_ms)

    def phase_of(self, key: BlockKey) -> int:
        rec = self.records.get(key)
        return ABSENT if rec is None else rec.phase

    def leases_on(self, key: BlockKey) -> list[ReadLease]:
        return [self.read_leases[i] for i in sorted(self._leases_on_key.get(key, ()))]

    def live_lease_on(self, key: BlockKey, location: LocationId) -> bool:
        return any(self.read_leases[i].location == location for i in self._leases_on_key.get(key, ()))

    def children(self, key: BlockKey) -> tuple[BlockKey, ...]:
        return tuple(sorted(self._children.get(key, ())))

    def subtree(self, key: BlockKey) -> list[BlockKey]:
        """``key`` and its descendants (its prefix subtree), parents before children."""
        out, stack = [], [key]
        while stack:
            k = stack.pop()
            out.append(k)
            stack.extend(sorted(self._children.get(k, ()), reverse=True))
        return out

    def next_deadline_ms(self) -> int | None:
        """When ``tick`` next has something to do (a lease or write lease runs out, grace ends);
        ``None`` when nothing is timed. Stale heap entries may make it early, never late."""
        times = []
        if self._lease_heap:
            times.append(self._lease_heap[0][0])
        if self._write_heap:
            times.append(self._write_heap[0][0])
        if self.grace_until_ms is not None:
            times.append(self.grace_until_ms)
        if self._free_heap:
            times.append(self._free_heap[0][0])
        return min(times) if times else None

    def lookup(self, namespace: bytes, keys: Iterable[BlockKey]) -> tuple[LocationId, ...]:
        """The owners of the longest prefix of ``keys`` (a prompt's chain, root first) that is
        COMMITTED in ``namespace``: each key's parent must be the key before it (protocol property 10)."""
        owners: list[LocationId] = []
        parent: BlockKey | None = None
        for key in keys:
            rec = self.records.get(key)
            if rec is None or rec.namespace != namespace or rec.parent != parent or rec.phase != COMMITTED:
                break
            assert rec.owner is not None
            owners.append(rec.owner)
            parent = key
        return tuple(owners)

    def locate(self, namespace: bytes, keys: Iterable[BlockKey]) -> tuple[int, ...]:
        """Per key, 2 if this directory holds a record of it in ``namespace``, 1 if in another
        namespace, 0 if none (in any phase: a record, once made, is kept for its epoch). A
        sharded directory's client asks every shard (docs/sharding.md): a key's record is in its
        root's shard. Another namespace too, so that a request naming the key under another
        namespace reaches the shard that refuses it; told apart, so that a record another tenant
        made of the same digest in another shard does not hide the key's own."""
        records = self.records
        return tuple(0 if rec is None else 2 if rec.namespace == namespace else 1 for rec in map(records.get, keys))

    def ticket_status(self, ticket: int) -> Ticket | None:
        """The ticket, or ``None`` for one completed so long ago it was forgotten."""
        if not FIRST_TICKET <= ticket < self.next_ticket:
            raise PeerViolation(f"no invalidation ticket {ticket} was issued", code="unknown_ticket")
        return self.tickets.get(ticket)

    # ------------------------------------------------------------------ time

    def tick(self, now_ms: int) -> list[Effect]:
        """Let time pass up to ``now_ms``: expire read leases (at grant + term + epsilon) and write
        leases, end the restart grace, complete the invalidations that may now complete, free
        drained copies."""
        effects: list[Effect] = []
        self._advance(now_ms, effects)
        return effects

    def _advance(self, now_ms: int, effects: list[Effect]) -> None:
        """Take every timer due by ``now_ms``, earliest first, each at the time it fell due: the
        spec's timers are urgent (no time passes while one is due), so a timer the host took late
        is still the step the spec took on time -- nothing observed the directory in between,
        for every request advances the clock first. The clock steps to each due time, so what a
        step schedules (a free's retry) counts from then, and its events carry that ``at_ms``."""
        assert now_ms >= self.now_ms, f"the directory clock went back: {now_ms} < {self.now_ms}"
        while (due := self.next_deadline_ms()) is not None and due <= now_ms:
            self.now_ms = max(self.now_ms, due)
            self._take_due(effects)
        self.now_ms = now_ms

    def _take_due(self, effects: list[Effect]) -> None:
        """Every timer due at ``now_ms``."""
        now_ms = self.now_ms
        heap = self._lease_heap
        expired: dict[int, set[BlockKey]] = {}
        while heap and heap[0][0] <= now_ms:
            expires_at, lease = heapq.heappop(heap)
            entry = self.read_leases.get(lease)
            if entry is None or entry.expires_at_ms != expires_at:
                continue  # released, revoked or renewed since
            assert not lease_live(now_ms, entry.expires_at_ms)
            self._drop_lease(entry, "expired", effects, expired)
        self._settle_all(expired, effects)
        if self.grace_until_ms is not None and not lease_live(now_ms, self.grace_until_ms):
            self.grace_until_ms = None
            settled: dict[int, set[BlockKey]] = {}
            for key in sorted(self._invalidating):
                self._maybe_complete(key, effects, settled)
            self._settle_all(settled, effects)
            for key in sorted(self._draining):
                self._maybe_free_drained(key, effects)
        wheap = self._write_heap
        while wheap and wheap[0][0] <= now_ms:
            expires_at, key, lease = heapq.heappop(wheap)
            rec = self.records[key]
            if rec.write_lease != lease or rec.write_lease_expires_at_ms != expires_at:
                continue  # committed, aborted, or given a new expiry by a restart
            live = lease_live(now_ms, rec.write_lease_expires_at_ms)
            assert write_lease_must_expire(rec.phase, live)
            self._emit(effects, "expire_write_lease", rec, lease=lease, writer=rec.writer)
            # The writer's bytes may have landed at its location: they are freed too.
            self._end_generation(rec, effects, frees=(rec.owner,))
        self._retry_frees(effects)

    # ------------------------------------------------------------------ messages

    def handle(self, msg: Any, now_ms: int, tenant: str) -> tuple[Any, list[Effect]]:
        """One request from ``tenant`` (already authenticated by its session) at ``now_ms``."""
        effects: list[Effect] = []
        self._advance(now_ms, effects)
        match msg:
            case Acquire():
                reply = self._acquire(msg, tenant, effects)
            case Renew():
                reply = self._renew(msg, tenant, effects)
            case Release():
                reply = self._release(msg, tenant, effects)
            case BeginWrite():
                reply = self._begin_write(msg, tenant, effects)
            case Commit():
                reply = self._commit(msg, tenant, effects)
            case RevokeAcked():
                self._revoke_acked(msg, tenant, effects)
                reply = None  # one-way
            case Copied():
                self._copied(msg, effects)
                reply = None  # one-way
            case Freed():
                self._freed(msg, tenant, effects)
                reply = None  # one-way
            case Evict():
                reply = self._evict(msg, tenant, effects)
            case Lookup():
                self._authorize(tenant, msg.namespace)
                owners = self.lookup(msg.namespace, msg.keys)
                reply = PrefixFound(msg.namespace, len(owners), owners)
            case Locate():
                # A namespace the tenant may not use is told nothing but that, not a reason to end
                # the session: its client refuses the request itself (``unauthorized``), as any
                # directory would.
                ok = self._authorized(tenant, msg.namespace)
                known = self.locate(msg.namespace, msg.keys) if ok else (0,) * len(msg.keys)
                reply = Located(msg.namespace, known, int(ok))
            case Invalidate():
                reply = self._invalidate(msg, tenant, effects)
            case WaitTicket():
                ticket = self.ticket_status(msg.ticket)
                pending = ticket is not None and ticket.state == TICKET_PENDING
                reply = InvalidationPending(msg.ticket) if pending else InvalidationCompleted(msg.ticket)
            case _:
                raise PeerViolation(f"the directory does not take {type(msg).__name__}", code="unexpected_message")
        self._check_effects(effects)
        return reply, effects

    def _authorize(self, tenant: str, namespace: bytes) -> None:
        if not self._authorized(tenant, namespace):
            raise Unauthorized(f"tenant {tenant[:80]!r} may not use namespace {bytes(namespace).hex()[:16]}…")

    # read leases (docs/protocol.md: leases)

    def _acquire(self, msg: Acquire, tenant: str, effects: list[Effect]) -> Any:
        rec = self.records.get(msg.key)
        phase = ABSENT if rec is None else rec.phase
        # Authorised for the key's own namespace, not merely the one the request names (protocol property 11).
        authorized = self._authorized(tenant, msg.namespace) and (rec is None or rec.namespace == msg.namespace)
        held = (msg.key, msg.node) in self._lease_of_holder
        # A copy on a node declared down is unreachable (P4): no lease there.
        reason = may_grant_read(phase, authorized, held, rec is not None and rec.owner in self.down_locations)
        if reason is not None:
            self._emit(effects, "refuse_read_lease", rec, key=msg.key, result=reason, holder=msg.node)
            return LeaseRefused(msg.node, msg.key, msg.request, reason)
        assert rec is not None and rec.phase == COMMITTED and rec.owner is not None
        lease = self._allocate_lease_id(effects)
        entry = ReadLease(
            lease=lease, node=msg.node, tenant=tenant, key=msg.key, location=rec.owner, gen=rec.gen,
            expires_at_ms=lease_expires_at(self.now_ms, self.config.lease_term_ms, self.config.skew_ms),
        )  # fmt: skip
        self._add_lease(entry)
        self._mirror(entry.expires_at_ms, effects)
        self._emit(effects, "grant_read_lease", rec, lease=lease, holder=msg.node, location=rec.owner)
        assert self.live_lease_on(msg.key, rec.owner)
        return ReadLeaseGranted(
            msg.node, msg.key, lease, rec.owner, rec.gen, rec.epoch, self.config.lease_term_ms, msg.request
        )

    def _renew(self, msg: Renew, tenant: str, effects: list[Effect]) -> Any:
        rec = self.records.get(msg.key)
        entry = self._holder_entry(msg.key, msg.node, tenant)
        reason = may_renew(
            ABSENT if rec is None else rec.phase,
            entry is not None,
            NO_LEASE if entry is None else entry.lease,
            msg.lease,
            msg.location if entry is None else entry.location,
            None if rec is None else rec.owner,
        )
        if reason is not None:
            self._emit(effects, "refuse_renewal", rec, key=msg.key, lease=msg.lease, result=reason, holder=msg.node)
            return LeaseRefused(msg.node, msg.key, msg.request, reason)
        assert entry is not None and rec is not None
        assert entry.gen == rec.gen and entry.location == rec.owner
        renewed = attrs.evolve(
            entry, expires_at_ms=lease_expires_at(self.now_ms, self.config.lease_term_ms, self.config.skew_ms)
        )
        assert renewed.expires_at_ms >= entry.expires_at_ms
        self.read_leases[entry.lease] = renewed
        heapq.heappush(self._lease_heap, (renewed.expires_at_ms, renewed.lease))
        self._mirror(renewed.expires_at_ms, effects)
        self._emit(effects, "renew_lease", rec, lease=msg.lease, holder=msg.node)
        return LeaseRenewed(msg.node, msg.key, msg.lease, self.config.lease_term_ms, msg.request)

    def _release(self, msg: Release, tenant: str, effects: list[Effect]) -> Any:
        entry = self._holder_entry(msg.key, msg.node, tenant)
        if entry is None or not may_release(entry.lease, msg.lease):
            # Released twice, or after it expired or was revoked: nothing to end.
            self._emit(effects, "ignore_stale_release", None, key=msg.key, lease=msg.lease, holder=msg.node)
        else:
            # The event first: ending the lease may complete an invalidation, a later step.
            self._emit(effects, "release_lease", self.records.get(msg.key), lease=msg.lease, holder=msg.node)
            self._drop_lease(entry, "released", effects)
            assert msg.lease not in self.read_leases
        return LeaseReleased(msg.node, msg.key, msg.lease)

    def _revoke_acked(self, msg: RevokeAcked, tenant: str, effects: list[Effect]) -> None:
        rec = self.records.get(msg.key)
        entry = self._holder_entry(msg.key, msg.node, tenant)
        phase = ABSENT if rec is None else rec.phase
        if entry is None or not may_ack_revoke(phase, entry.lease, msg.lease):
            # A duplicated ack, or one that lost the race with the lease's expiry.
            self._emit(effects, "ignore_stale_ack", rec, key=msg.key, lease=msg.lease, holder=msg.node)
            return
        self._emit(effects, "revoke_acked", rec, lease=msg.lease, holder=msg.node)
        self._drop_lease(entry, "acked", effects)  # may complete the invalidation: a later step
        assert msg.lease not in self.read_leases

    def _holder_entry(self, key: BlockKey, node: NodeId, tenant: str) -> ReadLease | None:
        """The live lease-table entry of ``node`` on ``key`` -- as far as ``tenant`` is concerned:
        another tenant's lease is none of its business (it may not renew, release or ack it)."""
        lease = self._lease_of_holder.get((key, node))
        if lease is None:
            return None
        entry = self.read_leases[lease]
        assert lease_live(self.now_ms, entry.expires_at_ms), "expired entries are dropped before any message"
        return entry if entry.tenant == tenant else None

    def _allocate_lease_id(self, effects: list[Effect]) -> int:
        """A fresh lease id. The high-water mark goes to the durable log first (``ReserveLeaseIds``
        precedes the reply carrying the id), so no restart can hand it out again (protocol property 8).
        A shard hands out only its own residue class, one id in ``shards``: a block reserves
        ``lease_id_block`` of its own ids, and ids stay unique across the shards."""
        shards = self.config.shards
        if self.next_lease_id >= self.lease_id_limit:
            self.lease_id_limit = self.next_lease_id + self.config.lease_id_block * shards
            effects.append(ReserveLeaseIds(self.lease_id_limit))
        lease = self.next_lease_id
        self.next_lease_id += shards
        assert FIRST_LEASE_ID <= lease < self.lease_id_limit
        assert lease % shards == self.config.shard, "a shard hands out only its own ids"
        return lease

    def _mirror(self, expires_at_ms: int, effects: list[Effect]) -> None:
        """A ``MirrorLeases`` before a lease expiring at ``expires_at_ms`` leaves, unless the last
        one covers it (``DirectoryConfig.lease_mirror_bucket_ms``): its reply then waits for the
        store, as for ``ReserveLeaseIds``."""
        bucket = self.config.lease_mirror_bucket_ms
        if bucket is None or expires_at_ms <= self._mirrored_until_ms:
            return
        self._mirrored_until_ms = expires_at_ms + bucket
        effects.append(MirrorLeases(self._mirrored_until_ms - self.now_ms))

    def _add_lease(self, entry: ReadLease) -> None:
        assert entry.lease not in self.read_leases
        assert (entry.key, entry.node) not in self._lease_of_holder
        self.read_leases[entry.lease] = entry
        self._leases_on_key.setdefault(entry.key, set()).add(entry.lease)
        self._lease_of_holder[(entry.key, entry.node)] = entry.lease
        self._leases_of_node.setdefault(entry.node, set()).add(entry.lease)
        heapq.heappush(self._lease_heap, (entry.expires_at_ms, entry.lease))

    def _drop_lease(self, entry: ReadLease, cause: str, effects: list[Effect],
                    settled: dict[int, set[BlockKey]] | None = None) -> None:  # fmt: skip
        """End one lease-table entry (``cause``: expired, acked, released, forgotten) and take
        the steps that may have been waiting for it (``settled``: see ``_maybe_complete``)."""
        del self.read_leases[entry.lease]
        on_key = self._leases_on_key[entry.key]
        on_key.discard(entry.lease)
        if not on_key:
            del self._leases_on_key[entry.key]
        del self._lease_of_holder[(entry.key, entry.node)]
        self._leases_of_node[entry.node].discard(entry.lease)
        rec = self.records[entry.key]
        if rec.phase == INVALIDATING:
            for t in sorted(self._tickets_on_key.get(entry.key, ())):
                ticket = self.tickets[t]
                if cause == "expired":
                    self.tickets[t] = attrs.evolve(ticket, expired=ticket.expired + 1)
                else:
                    self.tickets[t] = attrs.evolve(ticket, acked=ticket.acked + 1)
            self._maybe_complete(entry.key, effects, settled)
        elif rec.draining == entry.location:
            self._maybe_free_drained(entry.key, effects)

    # writes

    def check_request(self, msg: Any, tenant: str) -> None:
        """Raise what ``handle(msg)`` would raise for ``msg`` itself (a peer's violation), changing
        nothing: a batch is checked item by item before any item is taken."""
        if type(msg) is Lookup:
            self._authorize(tenant, msg.namespace)

    def _begin_write(self, msg: BeginWrite, tenant: str, effects: list[Effect]) -> Any:
        rec = self.records.get(msg.key)
        shards = self.config.shards
        if msg.parent is None and shards > 1 and shard_of(msg.key.digest, shards) != self.config.shard:
            # A chain lives in its root's shard (docs/sharding.md), and this shard does not own
            # this one: it decides nothing about it, and a client routing with another shard
            # count learns so here. Refused first, nothing changed -- no record, no lease id.
            # A child needs no such check: it is refused ``parent_not_committed`` in any shard
            # but its parent's, hence its root's. Outside the one-key model, like
            # ``key_identity``: each shard is the spec's one directory over its own keys.
            self._emit(effects, "refuse_write_lease", rec, key=msg.key, result=REASON_WRONG_SHARD, writer=msg.node)
            return LeaseRefused(msg.node, msg.key, msg.request, REASON_WRONG_SHARD)
        authorized = self._authorized(tenant, msg.namespace) and (rec is None or rec.namespace == msg.namespace)
        if authorized and rec is not None and rec.parent != msg.parent:
            # A key's digest chains over its parent's: one key under two parents is a forged or
            # broken key (or SHA-256 broke). Refused, nothing changed, the writer's session kept:
            # outside the one-key model, like a parent not committed (the spec's ``drop``).
            self._emit(effects, "refuse_write_lease", rec, key=msg.key, result=REASON_KEY_IDENTITY, writer=msg.node)
            return LeaseRefused(msg.node, msg.key, msg.request, REASON_KEY_IDENTITY)
        parent_phase = None
        if msg.parent is not None:
            parent = self.records.get(msg.parent)
            # A chain stays in one namespace: a parent in another one is no parent here.
            ok_parent = parent is not None and parent.namespace == msg.namespace
            parent_phase = parent.phase if ok_parent else ABSENT  # type: ignore[union-attr]
        reason = may_begin_write(ABSENT if rec is None else rec.phase, parent_phase, authorized)
        if reason is not None:
            self._emit(effects, "refuse_write_lease", rec, key=msg.key, result=reason, writer=msg.node)
            return LeaseRefused(msg.node, msg.key, msg.request, reason)
        location = self._place_write(msg.node, msg.key)
        if location is None or location in self.down_locations:
            # Placement avoids down nodes where it can (the server's), or finds no location the
            # writer may write to up; a fixed pool location that is down cannot take the bytes.
            self._emit(effects, "refuse_write_lease", rec, key=msg.key, result=REASON_LOCATION_DOWN, writer=msg.node)
            return LeaseRefused(msg.node, msg.key, msg.request, REASON_LOCATION_DOWN)
        if rec is None:
            rec = Record(key=msg.key, namespace=msg.namespace, parent=msg.parent)
        lease = self._allocate_lease_id(effects)
        rec = self._put(
            attrs.evolve(
                rec, phase=WRITING, epoch=next_epoch(rec.epoch), owner=location, writer=msg.node,
                writer_tenant=tenant, write_lease=lease, committed_lease=NO_LEASE,
                write_lease_expires_at_ms=lease_expires_at(self.now_ms, self.config.lease_term_ms, self.config.skew_ms),
            ),
            effects,
        )  # fmt: skip
        assert not self._leases_on_key.get(msg.key), "no read lease outlives its generation"
        self._emit(effects, "grant_write_lease", rec, lease=lease, writer=msg.node, location=location,
                   parent=msg.parent, namespace=msg.namespace)  # fmt: skip
        return WriteLeaseGranted(
            msg.node, msg.key, lease, location, rec.gen, rec.epoch, self.config.lease_term_ms, msg.request
        )

    def _commit(self, msg: Commit, tenant: str, effects: list[Effect]) -> Any:
        rec = self.records.get(msg.key)
        if rec is None:
            self._emit(effects, "reject_stale_commit", None, key=msg.key, lease=msg.lease, result=REASON_UNKNOWN_LEASE)
            return CommitRejected(msg.node, msg.key, msg.lease, REASON_UNKNOWN_LEASE)
        if (
            rec.phase in READABLE_PHASES
            and rec.committed_lease == msg.lease
            and (rec.gen, rec.epoch) == (msg.gen, msg.epoch)
        ):
            # A retried Commit (its answer was lost): the same answer again, nothing changes.
            self._emit(effects, "ignore_duplicate_commit", rec, lease=msg.lease, writer=msg.node)
            return Committed(msg.node, msg.key, msg.lease, rec.gen, rec.epoch)
        # Only the writer the lease was granted to may use it.
        own = rec.writer == msg.node and rec.writer_tenant == tenant
        reason = may_commit(
            rec.phase,
            rec.write_lease if own else NO_LEASE,
            msg.lease,
            rec.epoch,
            msg.epoch,
            lease_live(self.now_ms, rec.write_lease_expires_at_ms),
            # Bytes on a node declared down since the grant: published, nobody could read them
            # and no failover would void them; the write lease expires and the slot is freed.
            rec.owner in self.down_locations,
        )
        if reason is None and msg.gen != rec.gen:
            reason = REASON_WRONG_GENERATION  # the right lease and epoch name one generation only
        if reason is not None:
            self._emit(effects, "reject_stale_commit", rec, lease=msg.lease, result=reason, writer=msg.node)
            return CommitRejected(msg.node, msg.key, msg.lease, reason)
        assert rec.phase == WRITING and rec.owner is not None
        parent = None if rec.parent is None else self.records[rec.parent]
        assert parent is None or parent.phase == COMMITTED, "a WRITING key's parent stays COMMITTED (the cascade)"
        rec = self._put(
            attrs.evolve(
                rec, phase=COMMITTED, writer=None, writer_tenant=None, write_lease=NO_LEASE,
                write_lease_expires_at_ms=0, committed_lease=msg.lease,
            ),
            effects,
        )  # fmt: skip
        self._emit(effects, "commit_write", rec, lease=msg.lease, writer=msg.node, location=rec.owner)
        return Committed(msg.node, msg.key, msg.lease, rec.gen, rec.epoch)

    def _end_generation(
        self, rec: Record, effects: list[Effect], frees: Iterable[LocationId | None] = ()
    ) -> Record:
        """Back to ABSENT with the next generation: the old one can never be read again. Its
        copies at ``frees`` join the to-free set in the same durable write, and are freed."""
        assert not self._leases_on_key.get(rec.key), "a generation ends only when no lease on it is live"
        locations = sorted({loc for loc in frees if loc is not None})
        to_free = rec.to_free
        for loc in locations:
            to_free = attrs.evolve(rec, to_free=to_free).freeing(loc, rec.epoch)
        ended = self._put(
            attrs.evolve(
                rec, phase=ABSENT, gen=rec.gen + 1, owner=None, moving_to=None, draining=None, writer=None,
                writer_tenant=None, write_lease=NO_LEASE, write_lease_expires_at_ms=0, committed_lease=NO_LEASE,
                to_free=to_free,
            ),
            effects,
        )  # fmt: skip
        for loc in locations:
            self._send_free(ended, loc, effects, retry=False)
        return ended

    # deletion (docs/protocol.md: deletion reaches everywhere)

    def _schedule_free(self, key: BlockKey, location: LocationId, due_ms: int) -> None:
        self._free_due[(key, location)] = due_ms
        heapq.heappush(self._free_heap, (due_ms, key, location))

    def _send_free(self, rec: Record, location: LocationId, effects: list[Effect], *, retry: bool) -> None:
        """Send the pending free of ``rec`` at ``location`` if it may leave now, and schedule the
        next try. Nothing leaves during restart grace (it waits for the grace to end) nor to a
        location known to be down (it waits for ``locations_up``): either would be lost."""
        key = rec.key
        epoch = dict(rec.to_free)[location]
        if not retry:
            self._free_waits.pop((key, location), None)  # a new free starts with the shortest wait
        if self.in_grace:
            assert self.grace_until_ms is not None
            self._schedule_free(key, location, self.grace_until_ms)
            return
        if not may_retry_free(epoch, location not in self.down_locations):
            self._free_due.pop((key, location), None)
            return
        wait = self._free_waits.get((key, location), self.config.free_retry_first_ms)
        if retry:
            # The event first: the Free it sends is that step's message (a runtime that finds
            # the location unreachable drops both: nothing was sent).
            self._emit(effects, "retry_free", rec, location=location, epoch=epoch, wait_ms=wait)
        effects.append(FreeAt(location, key, epoch))
        self._free_waits[(key, location)] = min(2 * wait, self.config.free_retry_max_ms)
        self._schedule_free(key, location, self.now_ms + wait)

    def _retry_frees(self, effects: list[Effect]) -> None:
        """Send again every free whose wait ran out unacknowledged."""
        heap = self._free_heap
        while heap and heap[0][0] <= self.now_ms:
            due, key, location = heapq.heappop(heap)
            if self._free_due.get((key, location)) != due:
                continue  # acknowledged, rescheduled, or waiting for its location to come back
            del self._free_due[(key, location)]
            self._send_free(self.records[key], location, effects, retry=True)

    def _freed(self, msg: Freed, tenant: str, effects: list[Effect]) -> None:
        """A location acknowledged a free: the entry it covers leaves the to-free set. A free
        under epoch ``e`` covers the pending one at that location if that one's epoch is at most
        ``e`` (the block it names is gone, or the fence showed a later grant there)."""
        rec = self.records.get(msg.key)
        owed = 0 if rec is None else dict(rec.to_free).get(msg.location, 0)
        if (
            rec is None
            or not free_acknowledged(owed, msg.epoch)
            or msg.epoch > rec.epoch  # answers no Free ever sent
            or not self._authorized(tenant, rec.namespace)
        ):
            # A duplicated or late ack (a retry crossed it), or one for a free never sent.
            self._emit(effects, "ignore_stale_freed", rec, key=msg.key, location=msg.location, freed_epoch=msg.epoch)
            return
        rec = self._put(attrs.evolve(rec, to_free=tuple(e for e in rec.to_free if e[0] != msg.location)), effects)
        assert (msg.key, msg.location) not in self._free_due
        self._emit(effects, "free_acked", rec, location=msg.location, epoch=owed, freed_epoch=msg.epoch)

    def pending_frees(self, location: LocationId | None = None) -> list[tuple[BlockKey, LocationId, int]]:
        """The to-free set (of one location, or all): (key, location, epoch), sorted."""
        out = []
        for loc in [location] if location is not None else sorted(self._frees_at):
            for key in sorted(self._frees_at.get(loc, ())):
                out.append((key, loc, dict(self.records[key].to_free)[loc]))
        return out

    # failure detection (P4: a crashed owner's keys come back)

    def node_down(self, node: NodeId, locations: Iterable[LocationId], now_ms: int) -> list[Effect]:
        """The spec's ``declare_node_down``: the runtime has not heard from ``node`` (serving
        ``locations``) for ``node_down_after_ms`` -- missed heartbeats, a lost connection. No
        lease is granted on its copies any more (``location_down``) nor a write placed there;
        every COMMITTED key whose owner copy is there is voided with its subtree, in this same
        step (``rules.down_owner_invalidates``): its leases are revoked, and the key is writable
        again once they were acknowledged or expired -- within term + epsilon of this call, never
        sooner. Transfers to it are cancelled; frees to it wait for ``locations_up``."""
        # Time passes first, checked as it stands: a free to the node whose retry fell due went
        # out before the declaration (and is lost with the node, then sent again once it is up).
        advanced: list[Effect] = []
        self._advance(now_ms, advanced)
        self._check_effects(advanced)
        effects: list[Effect] = []
        down = frozenset(locations) - self.down_locations
        if not down:
            return advanced
        self.down_locations |= down
        voided: list[BlockKey] = []
        seen: set[BlockKey] = set()
        for key in sorted(self.records):
            rec = self.records[key]
            if key not in seen and down_owner_invalidates(rec.phase, rec.owner in down):
                for k in self.subtree(key):
                    if k not in seen:
                        seen.add(k)
                        voided.append(k)
        # The event first: what follows from the voiding (completions) are later steps.
        self._emit(effects, "declare_node_down", None, down=node, locations=sorted(down), voided=len(voided),
                   ticket=self.next_ticket if voided else None)  # fmt: skip
        if voided:
            self._start_invalidation(voided, effects)
        for key in sorted(self.records):
            rec = self.records[key]
            if rec.moving_to is not None and rec.moving_to in down:
                self._abandon_transfer(rec, effects, "cancel_transfer")  # its Copied cannot come
        for loc in down:
            for key in self._frees_at.get(loc, ()):
                self._free_due.pop((key, loc), None)
        self._check_effects(effects)
        return advanced + effects

    def locations_up(self, locations: Iterable[LocationId], now_ms: int) -> list[Effect]:
        """The node serving ``locations`` is heard from again (it said Hello, or its heartbeat is
        back): leases may name them again, and every pending free to them is sent at once, with
        the shortest wait (what was sent while it was away is presumed lost)."""
        effects: list[Effect] = []
        self._advance(now_ms, effects)
        up = frozenset(locations)
        back = sorted(up & self.down_locations)
        self.down_locations -= up
        if back:
            self._emit(effects, "mark_location_up", None, locations=back)
        for loc in sorted(up):
            for key in sorted(self._frees_at.get(loc, ())):
                self._free_waits.pop((key, loc), None)
                self._send_free(self.records[key], loc, effects, retry=True)
        self._check_effects(effects)
        return effects

    # invalidation (docs/protocol.md: invalidation)

    def _invalidate(self, msg: Invalidate, tenant: str, effects: list[Effect]) -> Any:
        self._authorize(tenant, msg.namespace)
        if msg.scope == SCOPE_NAMESPACE:
            keys = sorted(self._by_namespace.get(msg.namespace, ()))
            event = "invalidate_namespace"
        else:
            # A key, or the last key of a prefix chain: either way the key and its prefix subtree.
            assert msg.key is not None
            rec = self.records.get(msg.key)
            ok = rec is not None and rec.namespace == msg.namespace
            keys = self.subtree(msg.key) if ok else []
            event = "invalidate"
        # The spec's invalidate (and invalidate_namespace) voids something COMMITTED: a root being
        # written has no subtree yet (children need a COMMITTED parent) and nothing readable, so
        # its write goes on and commits *after* this invalidation. Without anything COMMITTED,
        # the ticket only waits for what is INVALIDATING already (an invalidation under way).
        voids = any(self.phase_of(k) == COMMITTED for k in keys[:1] if msg.scope != SCOPE_NAMESPACE) or (
            msg.scope == SCOPE_NAMESPACE and any(self.phase_of(k) == COMMITTED for k in keys)
        )
        if not voids:
            keys = [k for k in keys if self.phase_of(k) == INVALIDATING]

        def announce(ticket: int) -> None:
            self._emit(effects, event if voids else "ignore_invalidation_under_way", None, key=msg.key,
                       ticket=ticket, keys=len(keys), scope=msg.scope, namespace=msg.namespace)  # fmt: skip

        ticket = self._start_invalidation(keys, effects, announce)
        return InvalidationStarted(ticket.ticket, len(ticket.keys))

    def _start_invalidation(
        self, keys: Iterable[BlockKey], effects: list[Effect], announce: Callable[[int], None] | None = None
    ) -> Ticket:
        """Void every key of ``keys``: COMMITTED ones go INVALIDATING (their leases revoked), writes
        in progress are aborted; a ticket waits for the keys that are now INVALIDATING.
        ``announce(ticket)`` logs the step that voided them (the spec's ``invalidate``, or
        ``restart_node``) *before* any completion it allows at once: completion is a later step."""
        voided, pending = [], set()
        for key in keys:
            rec = self.records[key]
            step = invalidation_step(rec.phase)
            if step == INVALIDATE_START:
                moving = rec.moving_to
                to_free = rec.to_free if moving is None else rec.freeing(moving, rec.epoch)
                rec = self._put(attrs.evolve(rec, phase=INVALIDATING, moving_to=None, to_free=to_free), effects)
                if moving is not None:
                    # The abandoned transfer's copy may land after all: its destination is freed
                    # under the transfer's epoch, which then refuses it (rules.slot_accepts).
                    self._send_free(rec, moving, effects, retry=False)
                for entry in self.leases_on(key):
                    revoke = Revoke(entry.node, key, entry.lease, entry.gen)
                    effects.append(Send(entry.node, revoke, until_ms=entry.expires_at_ms))
            elif step == INVALIDATE_ABORT_WRITE:
                # The write in progress below a voided prefix: its commit will find the generation
                # gone; what bytes of it landed are freed.
                self._end_generation(rec, effects, frees=(rec.owner,))
            if step is not None or rec.phase == INVALIDATING:
                voided.append(key)
            if rec.phase == INVALIDATING:
                pending.add(key)
        ticket = Ticket(self.next_ticket, tuple(voided), frozenset(pending), started_at_ms=self.now_ms)
        self.next_ticket += 1
        self.tickets[ticket.ticket] = ticket
        for key in pending:
            self._tickets_on_key.setdefault(key, set()).add(ticket.ticket)
        effects.append(PersistTicket(ticket))
        if announce is not None:
            announce(ticket.ticket)
        settled: dict[int, set[BlockKey]] = {}
        for key in sorted(pending):
            self._maybe_complete(key, effects, settled)
        self._settle_all(settled, effects)
        if not ticket.pending:
            self._complete_ticket(ticket.ticket, effects)
        return self.tickets.get(ticket.ticket, ticket)

    def _maybe_complete(self, key: BlockKey, effects: list[Effect], settled: dict[int, set[BlockKey]] | None = None) -> None:
        """Complete the invalidation of ``key`` if the rule allows it now: free its copies, end
        the generation, and let its tickets know -- at once, or, with ``settled`` (a step that
        completes many keys), by adding the key to each ticket's entry there for ``_settle_all``:
        a ticket shrunk and persisted once a step, not once a key (a namespace's thousands of keys
        made that quadratic: 1,845 keys took the directory 6 s to answer)."""
        rec = self.records[key]
        live = len(self._leases_on_key.get(key, ()))
        if not may_complete_invalidation(rec.phase, self.in_grace, live):
            return
        assert rec.owner is not None
        # The to-free set is durable (in the record) before any Free leaves.
        ended = self._end_generation(rec, effects, frees=(rec.owner, rec.draining))
        self._emit(effects, "complete_invalidation", rec, gen=rec.gen, next_gen=ended.gen)
        for t in sorted(self._tickets_on_key.pop(key, ())):
            assert key in self.tickets[t].pending
            if settled is None:
                self._settle(t, frozenset((key,)), effects)
            else:
                settled.setdefault(t, set()).add(key)

    def _settle_all(self, settled: dict[int, set[BlockKey]], effects: list[Effect]) -> None:
        for t, done in sorted(settled.items()):
            self._settle(t, frozenset(done), effects)

    def _settle(self, t: int, done: frozenset[BlockKey], effects: list[Effect]) -> None:
        """Ticket ``t`` waits for the keys of ``done`` no more: persisted, or complete."""
        ticket = self.tickets[t]
        ticket = self.tickets[t] = attrs.evolve(ticket, pending=ticket.pending - done)
        if ticket.pending:
            effects.append(PersistTicket(ticket))  # the log's tickets stay the core's
        else:
            self._complete_ticket(t, effects)

    def _complete_ticket(self, t: int, effects: list[Effect]) -> None:
        ticket = attrs.evolve(self.tickets[t], completed_at_ms=self.now_ms)
        assert not ticket.pending
        assert all(self.phase_of(k) != INVALIDATING or t not in self._tickets_on_key.get(k, ()) for k in ticket.keys)
        self.tickets[t] = ticket
        effects.append(PersistTicket(ticket))
        effects.append(CompleteTicket(ticket))
        self._completed_order.append(t)
        while len(self._completed_order) > self.config.max_completed_tickets:
            old = self._completed_order.popleft()
            del self.tickets[old]
            effects.append(ForgetTicket(old))

    # eviction

    def _evict(self, msg: Evict, tenant: str, effects: list[Effect]) -> Any:
        rec = self.records.get(msg.key)
        if rec is None:
            self._emit(effects, "ignore_evict", None, key=msg.key, result=REASON_NOT_FOUND, location=msg.location)
            return EvictRefused(msg.node, msg.key, msg.location, REASON_NOT_FOUND)
        if not self._authorized(tenant, rec.namespace):
            self._emit(effects, "ignore_evict", rec, result=REASON_UNAUTHORIZED, location=msg.location)
            return EvictRefused(msg.node, msg.key, msg.location, REASON_UNAUTHORIZED)
        is_owner = rec.phase != ABSENT and msg.location == rec.owner
        is_draining = msg.location == rec.draining
        reason = may_evict(
            rec.phase,
            is_owner or is_draining,
            all(self.phase_of(c) == ABSENT for c in self._children.get(msg.key, ())),
            self.live_lease_on(msg.key, msg.location),
            self.in_grace,
            is_owner and rec.draining is not None,
        )
        if reason is not None:
            # Only a refusal because of a lease is a step of the spec (evict_refused); the others
            # are requests the spec's nodes never make.
            event = "evict_refused" if reason == REASON_LEASED else "ignore_evict"
            self._emit(effects, event, rec, result=reason, location=msg.location)
            return EvictRefused(msg.node, msg.key, msg.location, reason)
        assert not self.live_lease_on(msg.key, msg.location)
        self._emit(effects, "evict", rec, location=msg.location)
        if is_draining:
            self._put(attrs.evolve(rec, draining=None), effects)
        else:
            # The last copy is gone: ABSENT again. A transfer under way may still land its copy,
            # of a generation that just ended: its destination is freed (spec: evict).
            self._end_generation(rec, effects, frees=(rec.moving_to,))
        return Evicted(msg.node, msg.key, msg.location)

    # a lost copy (docs/protocol.md §8, a lost copy)

    def copy_lost(self, key: BlockKey, location: LocationId, gen: int, now_ms: int) -> tuple[bool, list[Effect]]:
        """The node of ``location`` found no valid bytes of generation ``gen`` of ``key`` there (a
        leased read missed: the bytes are gone or fail their checksum). If that copy is the
        owner of the COMMITTED generation, nothing can ever read it again: void the key with its
        subtree, as an invalidation (spec ``invalidate``, which the directory may take at any
        time), so that lookups stop finding it and it can be written again. Any other report (a
        draining or stale copy, a generation already over) changes nothing. Returns whether it
        voided the key."""
        effects: list[Effect] = []
        self._advance(now_ms, effects)
        rec = self.records.get(key)
        if rec is None or rec.phase != COMMITTED or rec.gen != gen or rec.owner != location:
            return False, effects
        keys = self.subtree(key)

        def announce(ticket: int) -> None:
            self._emit(effects, "invalidate", None, key=key, ticket=ticket, keys=len(keys), scope=SCOPE_KEY,
                       namespace=rec.namespace, lost=location)  # fmt: skip

        self._start_invalidation(keys, effects, announce)
        self._check_effects(effects)
        return True, effects

    # transfer (promotion / demotion)

    def start_transfer(self, key: BlockKey, dest: LocationId, now_ms: int) -> tuple[bool, list[Effect]]:
        """Move ``key``'s owner copy to ``dest`` (a tiering decision): copy under ``epoch + 1``;
        ``Copied`` makes it the owner; the old copy drains, then is freed."""
        effects: list[Effect] = []
        self._advance(now_ms, effects)
        rec = self.records.get(key)
        if rec is None or dest == rec.owner or dest in self.down_locations:
            return False, effects  # (no transfer onto a node declared down: its copy could not land)
        if not may_start_transfer(rec.phase, rec.moving_to is not None, rec.draining is not None):
            return False, effects
        assert rec.owner is not None
        rec = self._put(attrs.evolve(rec, epoch=next_epoch(rec.epoch), moving_to=dest), effects)
        effects.append(CopyAt(dest, key, rec.owner, rec.gen, rec.epoch))
        self._emit(effects, "start_transfer", rec, location=dest)
        return True, effects

    def cancel_transfer(self, key: BlockKey, now_ms: int) -> list[Effect]:
        """Give up a transfer (its copy failed or timed out); a late ``Copied`` is then ignored."""
        effects: list[Effect] = []
        self._advance(now_ms, effects)
        rec = self.records.get(key)
        if rec is not None and rec.moving_to is not None:
            self._abandon_transfer(rec, effects, "cancel_transfer")
        return effects

    def _abandon_transfer(self, rec: Record, effects: list[Effect], event: str | None) -> None:
        """The transfer of ``rec`` is over without its ``Copied``: its copy may land after all (a
        slow or paused destination), so the destination is owed a Free under the transfer's
        epoch, which then refuses the copy too (``rules.slot_accepts``). ``event``: the spec step
        logged (``cancel_transfer``), or ``None`` where the caller's step covers it."""
        moving = rec.moving_to
        assert moving is not None and rec.phase == COMMITTED
        rec = self._put(attrs.evolve(rec, moving_to=None, to_free=rec.freeing(moving, rec.epoch)), effects)
        if event is not None:
            self._emit(effects, event, rec, location=moving)
        self._send_free(rec, moving, effects, retry=False)

    def _copied(self, msg: Copied, effects: list[Effect]) -> None:
        rec = self.records.get(msg.key)
        if rec is None or not may_finish_transfer(
            rec.phase, rec.moving_to, msg.location, rec.epoch, msg.epoch, msg.location in self.down_locations
        ):
            self._emit(effects, "ignore_stale_copied", rec, key=msg.key, location=msg.location)
            return
        assert rec.owner is not None and rec.draining is None
        rec = self._put(attrs.evolve(rec, draining=rec.owner, owner=msg.location, moving_to=None), effects)
        self._emit(effects, "finish_transfer", rec, location=msg.location)
        self._maybe_free_drained(msg.key, effects)

    def _maybe_free_drained(self, key: BlockKey, effects: list[Effect]) -> None:
        rec = self.records[key]
        if rec.phase != COMMITTED or rec.draining is None:
            return  # an invalidation frees the draining copy with the owner
        if not may_free_drained(self.in_grace, self.live_lease_on(key, rec.draining)):
            return
        drained = rec.draining
        rec = self._put(attrs.evolve(rec, draining=None, to_free=rec.freeing(drained, rec.epoch)), effects)
        self._emit(effects, "free_drained", rec, location=drained)
        self._send_free(rec, drained, effects, retry=False)

    # ------------------------------------------------------------------ failures

    def node_rejoined(
        self,
        node: NodeId,
        lost_locations: Iterable[LocationId],
        now_ms: int,
        locations: Iterable[LocationId] = (),
    ) -> tuple[dict[BlockKey, int], list[Effect]]:
        """``node`` restarted and re-registers (spec: restart_node). The directory forgets its
        leases (it trusts none after a crash), cancels transfers to its ``locations``, and voids
        every COMMITTED key whose owner copy was at one of ``lost_locations`` (a disk that came
        back empty), with the key's subtree -- others may still trust leases on it -- and aborts
        every write in progress to one of its tiers (``rules.lost_copy_invalidates``). Returns the
        fences the node must restore: every key's epoch, which bounds any epoch ever issued
        (``rules.restored_fence``), so nothing sent before the crash can land."""
        effects: list[Effect] = []
        self._advance(now_ms, effects)
        lost = frozenset(lost_locations)
        mine = frozenset(locations) | lost
        # What the restart voids is decided on the records as they stand; the event comes first,
        # since what follows from it (completions of invalidations that waited on this node's
        # leases) are later steps of the spec.
        voided: list[BlockKey] = []
        seen: set[BlockKey] = set()
        for key in sorted(self.records):
            rec = self.records[key]
            # The owner copy (or write) is the node's own: one of its tiers, never the shared pool,
            # which every node mounts and no node's restart takes away.
            owned = rec.owner in mine and location_host(rec.owner) == node
            if owned and lost_copy_invalidates(rec.phase, True, rec.owner in lost):
                for k in self.subtree(key):
                    if k not in seen:
                        seen.add(k)
                        voided.append(k)
        self._emit(effects, "restart_node", None, rejoined=node, lost=sorted(lost), voided=len(voided),
                   ticket=self.next_ticket if voided else None)  # fmt: skip
        for key in sorted(self.records):
            rec = self.records[key]
            if rec.moving_to is not None and rec.moving_to in mine:
                # The copy died with the node, or landed: the restart step frees it (spec).
                self._abandon_transfer(rec, effects, None)
        # The node's own leases, and those of the clients co-located with it ("<node>.<name>":
        # the spec's node is holder, writer and locations in one, and a crash takes them all).
        holders = [node, *sorted(h for h in self._leases_of_node if h.startswith(node + COLOCATED_SEPARATOR))]
        for holder in holders:
            for lease in sorted(self._leases_of_node.get(holder, ())):
                self._drop_lease(self.read_leases[lease], "forgotten", effects)
            self._leases_of_node.pop(holder, None)
        if voided:
            self._start_invalidation(voided, effects)
        fences = {key: rec.epoch for key, rec in self.records.items() if rec.epoch > 0}
        assert node not in self._leases_of_node or not self._leases_of_node[node]
        self._check_effects(effects)
        return fences, effects

    def restarted(
        self,
        records: Iterable[Record],
        next_lease_id: int,
        now_ms: int,
        tickets: Iterable[Ticket] = (),
        next_ticket: int = FIRST_TICKET,
        lease_horizon_ms: int | None = None,
    ) -> list[Effect]:
        """Become the directory recovered from its durable log (spec: restart_directory): the
        records and tickets survive, the lease table does not. ``next_lease_id`` is the durable
        high-water mark (every id below it may have been handed out). For a grace nothing is
        freed: leases the old incarnation granted may still be trusted. The grace is
        ``rules.restart_grace_within``: ``restart_grace`` (term + 2 epsilon), or, when the store
        mirrored the leases, ``lease_horizon_ms`` if shorter -- the longest a lease any earlier
        incarnation granted may still run, counted on this directory's clock from ``now_ms``
        (spec: ``Model.lease_horizon``). A WRITING key's writer may still hold its lease: it gets
        the full grace (write leases are not mirrored)."""
        full = self.config.restart_grace_ms
        if lease_horizon_ms is not None and (type(lease_horizon_ms) is not int or lease_horizon_ms < 0):
            raise ValueError(f"lease_horizon_ms must be an int >= 0 or None, got {lease_horizon_ms!r}")
        grace = restart_grace_within(self.config.lease_term_ms, self.config.skew_ms, lease_horizon_ms)
        recovered = []
        for rec in records:
            if rec.phase == WRITING:
                rec = attrs.evolve(rec, write_lease_expires_at_ms=now_ms + full)  # a new clock
            recovered.append(rec)
        self._reset(recovered, next_lease_id, now_ms)
        self.grace_until_ms = now_ms + grace
        # The to-free set survived in the records; its frees leave when the grace ends.
        for rec in self.records.values():
            for loc, _ in rec.to_free:
                self._schedule_free(rec.key, loc, self.grace_until_ms)
        effects: list[Effect] = []
        for ticket in sorted(tickets, key=lambda t: t.ticket):
            if ticket.state == TICKET_PENDING:
                ticket = attrs.evolve(ticket, restarts=ticket.restarts + 1)
                effects.append(PersistTicket(ticket))
                for key in ticket.pending:
                    assert self.records[key].phase == INVALIDATING, "a pending ticket waits on INVALIDATING keys"
                    self._tickets_on_key.setdefault(key, set()).add(ticket.ticket)
            else:
                self._completed_order.append(ticket.ticket)
            self.tickets[ticket.ticket] = ticket
        self.next_ticket = max([next_ticket, *[t + 1 for t in self.tickets]])
        self._emit(effects, "restart_directory", None, records=len(self.records), grace_ms=grace)
        return effects

    # ------------------------------------------------------------------ bookkeeping

    def _emit(self, effects: list[Effect], event: str, rec: Record | None, **fields: Any) -> None:
        assert event in _EMITTABLE or event.startswith("ignore_"), event
        base: dict[str, Any] = {}
        if rec is not None:
            base = {"key": rec.key, "gen": rec.gen, "epoch": rec.epoch}
        base.update(fields)
        if base.get("result") is None:
            base["result"] = "ok"
        effects.append(Emit(event, base, self.now_ms))

    def _check_effects(self, effects: list[Effect]) -> None:
        """What every call's effects must satisfy: lease ids handed out are reserved, and no free
        leaves while a lease on that copy is live or during restart grace (protocol properties 5, 12)."""
        for e in effects:
            if isinstance(e, FreeAt):
                assert not self.in_grace, "nothing is freed during restart grace"
                assert e.location not in self.down_locations, "a free to a down location would be lost"
                # A free of an ended generation may reach a location that holds a later one
                # (leased): its lower epoch is fenced there. Only a free of the current epoch
                # could drop leased bytes.
                rec = self.records[e.key]
                assert e.epoch < rec.epoch or not self.live_lease_on(e.key, e.location), "no free under a live lease"
        assert self.next_lease_id <= self.lease_id_limit

    def check_invariants(self) -> None:
        """Assert the directory-side invariants of the spec, in its vocabulary (for tests and
        debugging; O(records + leases))."""
        for lease, entry in self.read_leases.items():
            rec = self.records[entry.key]
            assert lease_live(self.now_ms, entry.expires_at_ms), "LeaseTable: expired entries are gone"
            assert rec.phase in READABLE_PHASES, "NoDirtyRead: leases only on readable generations"
            assert entry.gen == rec.gen, "NoStaleRead: a lease names the current generation"
            assert entry.location in (rec.owner, rec.draining), "DirectoryDataAgreement: a lease is on a copy"
            assert lease < self.next_lease_id <= self.lease_id_limit, "LeaseIdsFresh"
            assert lease % self.config.shards == self.config.shard, "LeaseIdsFresh: this shard's ids only"
            assert self._authorized(entry.tenant, rec.namespace), "NamespaceIsolation"
        for key, rec in self.records.items():
            if rec.phase in (WRITING, COMMITTED) and rec.parent is not None:
                assert self.phase_of(rec.parent) == COMMITTED, "PrefixClosed"
            if rec.phase == WRITING:
                assert rec.write_lease < self.next_lease_id, "LeaseIdsFresh"
                assert rec.write_lease % self.config.shards == self.config.shard, "LeaseIdsFresh: this shard's ids only"
            if rec.phase == INVALIDATING and not self.in_grace:
                assert self._leases_on_key.get(key), "an invalidation with no lease left has completed"
            for loc, _ in rec.to_free:
                assert key in self._frees_at[loc]
                assert (key, loc) in self._free_due or loc in self.down_locations, "every pending free is retried"
