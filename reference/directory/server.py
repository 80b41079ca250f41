"""The directory server: the sans-IO core wired to a clock, a durable store, TCP and an event log.

Theory of operation
-------------------
``DirectoryCore`` decides; this module carries its decisions out, in the order the core's
docstring requires (the clock, the durable commit and the logging of steps are ``CoreHost``'s,
``host.py``, shared with the suite's kit and the Mooncake adapter):

1. Every request is one ``core.handle(msg, now_ms, tenant)`` call on the event loop's thread --
   the core is never entered twice at once, and nothing awaits between the call and carrying out
   its effects, so effects leave in the order they were produced. Every request but
   ``WaitTicket`` is answered straight from the transport's read loop (``handler_now``): no task
   per request.
2. Durable effects (``Persist``, ``PersistTicket``, ``ForgetTicket``, ``ReserveLeaseIds``) are
   committed to the store in one transaction *before* the reply or any directive leaves, with
   the call's event lines (the store's events tail: a directory killed after the commit and
   before its log loses no line, its next incarnation appends them). A store
   that fails raises, the request is answered ``Error("internal")``, and this directory stops
   serving (``fatal``): what the core believes is no longer what the log holds, and a restart
   from the log is the only safe way on. The call's events are logged next, then its
   directives leave in order -- a ``Revoke`` only if its lease is still live on the clock read
   after the events were stamped (``Send.due``): the spec steps at the logged time.
3. Directives go to nodes as **pushes** on the connection the node last said ``Hello`` on
   (``transport.current_connection``): ``Revoke`` to a holder, ``Free`` and ``Copy`` to the node
   serving the location (location ids are ``"<node>/<tier>"``; the shared pool, which every node
   mounts, is served by any connected node that lists it). A directive for a node that is not
   connected is lost -- exactly the network loss the spec allows: a lost ``Revoke`` ends by lease
   expiry, a lost ``Free`` is sent again by the core until the location answers ``Freed`` (and
   at once when the node says Hello again).
4. Timers: one task sleeps until ``core.next_deadline_ms()`` (woken early only when a request
   moved it before the deadline the task sleeps towards) and calls ``core.tick``; lease expiry,
   write-lease expiry, restart grace and the invalidations waiting on them happen there.
5. ``WaitTicket`` long-polls: it waits (up to its ``timeout_ms``) on an ``asyncio.Event`` that
   the ``CompleteTicket`` effect sets.

Commits off the event loop. With a store whose commits should leave the loop (``commits_off_loop``:
etcd's, each a network round trip; ``commit_thread=`` overrides), a call's durable effects go to the commit
thread (``_Committer``) and the call joins the *pipeline*: its lines staged (numbered and stamped
at the step, as the spec takes it), its directives and its reply held until its commit and every
one before it are done, then carried out in the pipeline's order (``_committed``). The core goes on
deciding meanwhile, on the state it decided last; what a call reads may be a step still being
committed, so every reply waits for the pipeline as it stood when the call was taken
(``_once_caught_up``) -- a reply never tells what the log may yet lose -- except a lookup that
changed nothing and whose keys no call in the pipeline changes (it read only what is durable). A
call with nothing durable and an empty pipeline is carried out at once, as inline. The commit
thread commits every call waiting together (a group commit). So an etcd leader election holds the
calls that need the log, in order, and nothing else: the loop goes on answering heartbeats,
lookups and node lists, declaring nodes down, and serving metrics
(``tests/test_faults.py::test_an_etcd_stall_holds_the_writes_not_the_directory``).

The clock is ``time.monotonic_ns`` in ms from the server's start (injectable): a restarted
directory starts a new clock, which the core allows (``restarted`` re-bases write leases).

A first start (an empty log) serves at once; a restart (a log with an earlier incarnation)
calls ``core.restarted`` and so grants nothing conflicting for the restart grace (protocol property 12).

Failure detection (P4, the spec's ``declare_node_down``). A node whose connection is gone -- a
kill -9 closes it at once, so the loss dates the crash -- is declared down
``config.disconnect_detection_ms`` later (default: a lease term, the spec's failure-detection
time) unless it said Hello again by then. A node whose connection stays open but silent -- every
node pings the directory every ``HEARTBEAT_INTERVAL_MS``, which the transport answers and the
connection notes -- is declared down after ``config.node_down_after_ms`` (longer: a stopped
process comes back, and the spec declares only crashed nodes), measured by the clock *and* in
sweeps of the watchdog, so neither a clock jump nor a stalled loop fakes it. Down:
``core.node_down`` (no leases or writes there, its owner copies voided). Heard again, or a
Hello: ``core.locations_up``. The shared pool is never down with one node. Placement skips down
nodes.

Identities (issue 14). Every request is checked against its credential before anything else
(``_check_identity``), and a request its credential may not make is refused with
``Unauthorized`` -- the connection's final ``Error("unauthorized")`` -- before any state changes
or any event is logged. A cache node's messages (a ``Hello`` with an address, locations or lost
locations; ``Freed``, ``Copied``, ``Transfer``; an ``Evict`` in its own name) are taken only under
the credential bound to that node (``Tenants.nodes``), and only about its own locations (its
tiers, and the shared pool if it mounts it); a node credential makes no client request. A tenant
registers only as a client (a ``Hello`` with no address, locations or losses), never under a
node's id, nor under a client id another credential registered. A deployment without node
credentials keeps one shared one for all its nodes (``Tenants.shared_node_credential``): it may
act as any node, as before; tenants still may not. An operator credential (``Tenants.operator_names``)
may invalidate, wait for its invalidations, look up (in every namespace) and list the nodes, and
register as a client to do so -- nothing else: no lease, no write, no node's message.

Membership: ``Hello(node, incarnation, address, locations, lost)`` registers the connection.
A node seen before under another incarnation, or one that lost locations, has restarted:
``core.node_rejoined`` forgets its leases and voids what it lost, and the ``Welcome`` carries
the fences the node restores for the keys owned at its locations.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from kvcc.spec.keys import BlockKey, LocationId, NodeId
from kvcc.spec.vocabulary import LOCATION_SEPARATOR, REASON_NOT_FOUND, REASON_NOT_TRANSFERABLE, location_host

from ..errors import PeerViolation, Unauthorized
from ..events import EventLog
from ..failpoints import failpoint
from ..transport import DEFER, Server, ServerLimits, TlsConfig, current_connection
from ..wire import (
    BATCH_DIRECTORY_KINDS,
    HEARTBEAT_INTERVAL_MS,
    MAX_CONTROL_FRAME_BYTES,
    MAX_LOOKUP_KEYS,
    MAX_WAIT_TICKET_MS,
    Acquire,
    Batch,
    Batched,
    BeginWrite,
    Commit,
    Copied,
    Evict,
    Free,
    Freed,
    Lost,
    Hello,
    Invalidate,
    InvalidationCompleted,
    InvalidationPending,
    LeaseRenewed,
    ListNodes,
    Locate,
    Lookup,
    NodeList,
    Noted,
    ReadLeaseGranted,
    Release,
    Renew,
    RevokeAcked,
    Tenants,
    Transfer,
    TransferRefused,
    TransferStarted,
    WaitTicket,
    Welcome,
    WriteLeaseGranted,
    kind_of,
)
from ..wire.grants import GRANT_READ, GRANT_WRITE, SHARED, grant_keys, sign_grant
from .core import (
    COLOCATED_SEPARATOR,
    TICKET_PENDING,
    CompleteTicket,
    CopyAt,
    DirectoryConfig,
    DirectoryCore,
    Effect,
    Emit,
    FreeAt,
    Persist,
    Send,
)
from .host import CoreHost
from .store import Loaded

if TYPE_CHECKING:
    from ..metrics import DirectoryCounts

log = logging.getLogger("kvcc.directory")

POOL_LOCATION = "pool"  # the shared pool's location id: every node mounts it
HOME_SEPARATOR = COLOCATED_SEPARATOR  # a client id "<node>.<name>" lives next to <node>
TIMER_SLACK_MS = 1  # sleep this much past a deadline: the core expires at deadline, not before
CLOSE_COMMITS_S = 10.0  # close() waits this long for the commit thread to finish what it took
# What only a client (a tenant's credential) asks: a node credential is refused each (issue 14).
CLIENT_REQUESTS = (Acquire, Renew, Release, BeginWrite, Commit, RevokeAcked, Lookup, Locate, Invalidate, WaitTicket, Batch)
# What only a cache node sends, about its own locations (issue 14).
NODE_REQUESTS = (Freed, Copied, Transfer, Lost)


class Store(Protocol):
    """What the server needs of a durable log (``store.DirectoryStore``, ``etcd_store``)."""

    def load(self) -> Loaded: ...

    def commit(self, effects: list[Effect], *, events_tail: Sequence[str] | None = None) -> int: ...

    def close(self) -> None: ...


@attrs.define(eq=False)
class _Pending:
    """One core call's effects in the commit pipeline: its durable effects (committed by the
    commit thread, with the lines not yet written), its staged lines, its directives."""

    durable: list[Effect]
    lines: list[str]
    directives: list[Effect]
    effects: list[Effect]
    done: asyncio.Future
    committed: bool = False
    keys: tuple[BlockKey, ...] = ()


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # a failure is everyone's (``fatal``): not one future's unretrieved one


def _keys_of(effects: list[Effect]) -> tuple[BlockKey, ...]:
    """The keys one call's effects change (its records, the keys its steps name)."""
    keys = set()
    for e in effects:
        if type(e) is Persist:
            keys.add(e.record.key)
        elif type(e) is Emit:
            k = e.fields.get("key")
            if k is not None:
                keys.add(k if isinstance(k, BlockKey) else BlockKey.from_hex(k))
    return tuple(keys)


class _Committer:
    """The commit thread (stores whose commits are network round trips: etcd). It takes the
    pipeline's commits in order and commits every one waiting together, in one ``store.commit``
    (a group commit: one round trip for all the calls taken while the last one was in flight),
    then reports to the event loop. After a failure it commits nothing more."""

    GROUP_MAX = 256  # calls in one group commit

    def __init__(self, store: Store, loop: asyncio.AbstractEventLoop, report: Callable[[list[_Pending], BaseException | None], None]) -> None:
        self._store = store
        self._loop = loop
        self._report = report
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvcc-directory-commits", daemon=True)
        self._thread.start()

    def submit(self, entry: _Pending, tail: list[str]) -> None:
        self._queue.put((entry, tail))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            group = [item]
            stop = False
            while len(group) < self.GROUP_MAX:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                group.append(more)
            entries = [entry for entry, _ in group]
            tail = group[-1][1]
            error: BaseException | None = None
            try:
                self._store.commit([e for entry in entries for e in entry.durable], events_tail=tail)
            except BaseException as e:
                error = e
            if error is None and tail:
                failpoint("directory.committed_unlogged")
            try:
                self._loop.call_soon_threadsafe(self._report, entries, error)
            except RuntimeError:
                return  # the loop is closed: the server is gone
            if error is not None or stop:
                return

    def stop(self, timeout_s: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)


class _StepJournal:
    """``CoreHost``'s journal for the server: a step with durable effects has its lines staged,
    kept by the store in the step's own commit (``events_tail``) and written after it."""

    def __init__(self, server: DirectoryServer) -> None:
        self._server = server

    def stage(self, e: Emit, late_ns: Callable[[], int]) -> str | None:
        return self._server._stage_step(e, late_ns)

    def write(self, lines: list[str]) -> None:
        if lines:
            assert self._server.events is not None
            self._server.events.write_staged(lines)

    def discard(self, lines: list[str]) -> None:
        if lines:
            assert self._server.events is not None
            self._server.events.discard_staged(len(lines))


def node_of(location: LocationId) -> NodeId | None:
    """The node serving ``location`` (``None`` for the shared pool: any node can)."""
    if location == POOL_LOCATION:
        return None
    return NodeId(location_host(location))


def rendezvous_placement(nodes: Callable[[], dict[NodeId, tuple[LocationId, ...]]]) -> Callable:
    """Place a write on the writer's home node if it has one (a client id ``"<node>.<name>"``
    next to a registered node writes to that node's fastest tier), else on the first location of
    the node with the highest hash of (node, key): blocks spread over the nodes, and a key stays
    with its node while membership holds (rendezvous hashing). With no node registered the
    writer's own id names the location. ``nodes()``: each node that is up, with its locations
    (the shared pool among them where it mounts it).

    A co-located writer whose home is not up -- not registered again yet after a directory
    restart, or declared down -- goes to the shared pool if one is mounted, else nowhere
    (``None``: the core refuses, ``location_down``). Its bytes on another node's tier would be
    safe (fencing and leases do not care where a block lives), but the spec's node is holder,
    writer and tiers in one and writes only to its own tiers or the pool
    (``ModelConfig.write_targets``): that is the scope the model checker verified and the trace
    validator holds a run to, so the reference stays inside it."""
    import hashlib

    def place(writer: NodeId, key: BlockKey) -> LocationId | None:
        up = nodes()
        own = {n: tuple(loc for loc in locs if loc != POOL_LOCATION) for n, locs in up.items()}
        candidates = {n: locs for n, locs in own.items() if locs}
        home, colocated, _ = writer.partition(HOME_SEPARATOR)
        if home in candidates:  # a client co-located with a node ("n1.engine") writes locally
            return candidates[home][0]
        if colocated:
            return POOL_LOCATION if any(POOL_LOCATION in locs for locs in up.values()) else None
        if not candidates:
            return LocationId(f"{writer}{LOCATION_SEPARATOR}dram")
        best = max(candidates, key=lambda n: hashlib.blake2b(n.encode() + key.digest, digest_size=8).digest())
        return candidates[best][0]

    return place


class _Member:
    __slots__ = ("node", "incarnation", "address", "locations", "conn", "last_heard_ms", "silent_sweeps", "down",
                 "credential")  # fmt: skip

    def __init__(
        self, node: NodeId, incarnation: int, address: str, locations: tuple[LocationId, ...], conn: Any, now_ms: int,
        credential: str = "",
    ) -> None:
        self.node = node
        self.credential = credential  # what it said Hello under: a client id stays that credential's
        self.incarnation = incarnation
        self.address = address
        self.locations = locations
        self.conn = conn
        self.last_heard_ms = now_ms  # the last request (a heartbeat Ping at least) on ``conn``
        self.silent_sweeps = 0  # watchdog sweeps since then
        self.down = False  # told the core its locations are down; a request on ``conn`` revives it

    @property
    def own_locations(self) -> tuple[LocationId, ...]:
        """Its tiers: the shared pool is never down with one node (any node serves it)."""
        return tuple(loc for loc in self.locations if loc != POOL_LOCATION)


class DirectoryServer:
    """``DirectoryServer(config, tenants, store, *, host, port, events=None)``; ``await start()``
    (or ``async with``), then ``port``; ``await close()``. ``fatal`` is set once the store failed.
    ``counts`` (a ``metrics.DirectoryCounts``): count grants, refusals and write leases for the
    metrics endpoint; ``None`` (the default) counts nothing. ``limits``, ``tls``: the transport's
    (``kvcc.reference.transport.Server``)."""

    def __init__(
        self,
        config: DirectoryConfig,
        tenants: Tenants,
        store: Store,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        events: EventLog | None = None,
        events_factory: Callable[[int], EventLog] | None = None,
        commit_thread: bool | None = None,
        recover_events: Callable[[Sequence[str]], int] | None = None,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
        request_timeout_ms: int | None = None,
        counts: DirectoryCounts | None = None,
        limits: ServerLimits | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        self.config = config
        self.tenants = tenants
        # Every lease granted carries the data-plane grant its location checks (wire/grants.py).
        self.grant_keys = grant_keys(tenants)
        self.store = store
        self.events = events
        self._events_factory = events_factory  # incarnation -> the event log (known once loaded)
        self._recover_events = recover_events  # the store's events tail -> lines appended to the log
        # Commits off the event loop (module docstring) where the store asks for it
        # (``commits_off_loop``: etcd); inline for any other (SQLite: a local fsync).
        self._commit_thread = getattr(store, "commits_off_loop", False) if commit_thread is None else commit_thread
        self._committer: _Committer | None = None
        self._pipeline: deque[_Pending] = deque()
        self._pending_keys: dict[BlockKey, int] = {}  # key -> calls in the pipeline that change it
        self._members: dict[NodeId, _Member] = {}
        core = DirectoryCore(config, tenants.allows, rendezvous_placement(self._locations_by_node))
        # A retry to a location no connected node serves is not sent (its FreeAt, with the
        # directives, is lost), so not logged (``CoreHost``, 7.).
        self.host = CoreHost(core, commit=self._commit, emit=self._emit_step, journal=_StepJournal(self),
                             reachable=lambda location: self._serving_node(location) is not None,
                             monotonic_ns=monotonic_ns)  # fmt: skip
        kwargs = {} if request_timeout_ms is None else {"request_timeout_ms": request_timeout_ms}
        self._server = Server(self._handle, tenants, host=host, port=port, max_frame_bytes=MAX_CONTROL_FRAME_BYTES,
                              handler_now=self._handle_now, limits=limits, tls=tls, **kwargs)  # fmt: skip
        self._member_of_conn: dict[Any, NodeId] = {}
        self._watch_task: asyncio.Task | None = None
        self._gone_timers: set[asyncio.TimerHandle] = set()
        self._closing = False
        self._ticket_events: dict[int, asyncio.Event] = {}
        self._timer_task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        # The deadline the timer task sleeps towards (None: none, it sleeps until woken). A call
        # that leaves the core's next deadline at or after it need not wake the timer: most
        # requests only push a later expiry (a new lease), and a wake per request costs a task
        # switch and a heap read per request.
        self._timer_deadline_ms: int | None = None
        self.fatal: BaseException | None = None
        self.incarnation = 0
        self.restarted = False
        self.stats = {"requests": 0, "pushes": 0, "lost_directives": 0, "commits": 0, "copies_lost": 0}
        self.counts = counts  # what the metrics export (``kvcc.reference.metrics``); None: not counted

    # ------------------------------------------------------------------ lifecycle

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def core(self) -> DirectoryCore:
        return self.host.core

    def now_ms(self) -> int:
        return self.host.now_ms()

    @property
    def connection_count(self) -> int:
        return self._server.connection_count

    @property
    def commits_in_flight(self) -> int:
        """Calls in the commit pipeline: waiting for their commit or for one before theirs."""
        return len(self._pipeline)

    def member_counts(self) -> tuple[int, int]:
        """Registered cache nodes (members with tiers): (up, declared down)."""
        nodes = [m for m in self._members.values() if m.own_locations]
        down = sum(m.down for m in nodes)
        return len(nodes) - down, down

    async def start(self) -> DirectoryServer:
        loaded = self.store.load()
        self.incarnation = loaded.incarnation
        if loaded.events_tail and self._recover_events is not None:
            # Steps the previous incarnation made durable but was killed before it logged.
            recovered = self._recover_events(loaded.events_tail)
            if recovered:
                log.warning("%d event line(s) of the previous incarnation recovered from the store", recovered)
        if self._events_factory is not None:
            self.events = self._events_factory(self.incarnation)
        # The store says whether its log was empty: an etcd store bumps its incarnation on open
        # and on load, so a first start there is incarnation 2 and the count proves nothing.
        fresh = loaded.fresh
        if not fresh:
            # protocol property 12: honour every lease the previous incarnation may have granted.
            self.restarted = True
            effects = self.core.restarted(
                loaded.records, loaded.next_lease_id, self.now_ms(), loaded.tickets, loaded.next_ticket,
                lease_horizon_ms=self._horizon_ms(loaded.lease_horizon_ms),
            )
            self._apply(effects)
            if self.counts is not None:
                self.counts.seed(self.core.records.values())
        if self._commit_thread:
            self._committer = _Committer(self.store, asyncio.get_running_loop(), self._committed)
        await self._server.start()
        self._timer_task = asyncio.create_task(self._timer())
        self._watch_task = asyncio.create_task(self._watch_members())
        log.info("directory incarnation %d on port %d (%s)", self.incarnation, self.port, "restarted" if self.restarted else "fresh")
        return self

    def _horizon_ms(self, loaded_ms: int | None) -> int | None:
        """The store's lease horizon (``Loaded.lease_horizon_ms``) on this directory's clock: it
        was counted on the store's (etcd's lease TTLs), so epsilon more."""
        return None if loaded_ms is None else loaded_ms + self.core.config.skew_ms

    async def close(self) -> None:
        self._closing = True
        for handle in self._gone_timers:
            handle.cancel()
        for task in (self._timer_task, self._watch_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        await self._server.close()
        if self._committer is not None:
            # What is in the pipeline is committed, logged and carried out before the thread goes.
            with contextlib.suppress(BaseException):
                async with asyncio.timeout(CLOSE_COMMITS_S):
                    await self._caught_up()
            await asyncio.to_thread(self._committer.stop, CLOSE_COMMITS_S)
            self._committer = None
        for ev in self._ticket_events.values():
            ev.set()

    async def __aenter__(self) -> DirectoryServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _locations_by_node(self) -> dict[NodeId, tuple[LocationId, ...]]:
        """Where writes may be placed: the locations of every node not known to be down (its
        tiers, and the shared pool where it mounts it)."""
        return {n: m.locations for n, m in self._members.items() if not m.down}

    # ------------------------------------------------------------------ requests

    async def _handle(self, tenant: str, msg: Any) -> Any:
        if type(msg) is WaitTicket:
            self._check_identity(tenant, msg)
            if self.fatal is not None:
                raise RuntimeError(f"the directory stopped serving: its store failed ({self.fatal})")
            self.stats["requests"] += 1
            return await self._wait_ticket(tenant, msg)
        return self._handle_now(tenant, msg)

    def _handle_now(self, tenant: str, msg: Any) -> Any:
        """Every request but ``WaitTicket`` completes without waiting: the transport calls this
        in its read loop (``handler_now``), with no task per request."""
        if type(msg) is WaitTicket:
            return DEFER
        self._check_identity(tenant, msg)  # before anything changes: a refusal leaves no trace
        if self.fatal is not None:
            raise RuntimeError(f"the directory stopped serving: its store failed ({self.fatal})")
        self.stats["requests"] += 1
        self._heard_from(current_connection.get())  # a request is a sign of life, as a Ping is
        match msg:
            case Hello():
                return self._once_caught_up(self._hello(tenant, msg))
            case ListNodes():
                nodes = sorted(n for n, m in self._members.items() if m.address)[:MAX_LOOKUP_KEYS]
                return NodeList(tuple(nodes), tuple(self._members[n].address for n in nodes))
            case Transfer():
                return self._once_caught_up(self._answer(msg, self._transfer(tenant, msg), tenant))
            case Lost():
                return self._once_caught_up(self._lost(msg))
            case Free():
                raise PeerViolation("Free is a directive, not a request", code="unexpected_message")
            case Batch():
                return self._once_caught_up(self._batch(tenant, msg))
        reply, effects = self.core.handle(msg, self.now_ms(), tenant)
        self._apply(effects)
        reply = self._answer(msg, reply, tenant)
        if reply is None:
            assert type(msg) in (RevokeAcked, Copied, Freed)
            reply = Noted({RevokeAcked: "revoke_acked", Copied: "copied", Freed: "freed"}[type(msg)])
        if type(msg) in (Lookup, Locate) and not effects and not any(k in self._pending_keys for k in msg.keys):
            return reply  # it read only what is durable: nothing in the pipeline touches its keys
        return self._once_caught_up(reply)

    def _batch(self, tenant: str, msg: Batch) -> Batched:
        """Each item in order, exactly as if it had come alone (``Batch``), at one directory time.
        Every item is checked first: one the directory does not batch, or one this credential may
        not send, refuses the batch before any item changes state. Their durable effects are
        committed together (one transaction: a group commit), their steps logged and flushed
        together, before the answer -- or anything an item sends -- leaves."""
        for i, item in enumerate(msg.items):
            if type(item) not in BATCH_DIRECTORY_KINDS:
                names = ", ".join(k.__name__ for k in BATCH_DIRECTORY_KINDS)
                raise PeerViolation(f"Batch item {i}: the directory batches {names}, not {kind_of(item)}",
                                    code="unexpected_message")  # fmt: skip
            self._check_identity(tenant, item)
            self.core.check_request(item, tenant)
        self.stats["requests"] += len(msg.items) - 1  # the items count, not the batch
        now_ms = self.now_ms()
        replies: list[Any] = []
        effects: list[Effect] = []
        for item in msg.items:
            reply, item_effects = self.core.handle(item, now_ms, tenant)
            effects += item_effects
            replies.append(self._answer(item, reply, tenant))  # its grant: the lease as this item left it
        if self.events is None:
            self._apply(effects)
        else:
            with self.events.flushed_at_end():  # before the answer leaves (and before any push: _apply)
                self._apply(effects)
        return Batched(tuple(replies))

    def _answer(self, msg: Any, reply: Any, tenant: str) -> Any:
        """The core's ``reply`` to ``msg`` as it leaves: counted, and a lease's with its grant."""
        if self.counts is not None:
            self.counts.replied(msg, reply)
        if self.grant_keys and type(reply) in (ReadLeaseGranted, LeaseRenewed, WriteLeaseGranted):
            return self._with_grant(reply, tenant)
        return reply

    def _with_grant(self, reply: Any, tenant: str) -> Any:
        """``reply`` with the data-plane grant of its lease to ``tenant``, valid until the
        directory stops holding the lease live, on the wall clock (wire/grants.py): checkable by
        the node of its location, or by every node for the shared pool."""
        if type(reply) is WriteLeaseGranted:
            expires_at_ms = self.core.records[reply.key].write_lease_expires_at_ms
            kind, gen, epoch, location = GRANT_WRITE, reply.gen, reply.epoch, reply.location
        else:
            entry = self.core.read_leases[reply.lease]
            kind, gen, epoch, location, expires_at_ms = GRANT_READ, entry.gen, 0, entry.location, entry.expires_at_ms
        expires_ms = time.time_ns() // 1_000_000 + max(0, expires_at_ms - self.now_ms())
        keys = self.grant_keys
        host = location_host(location)
        signers = [keys[SHARED]] if SHARED in keys else [keys[host]] if host in keys else [keys[n] for n in sorted(keys)]
        grant = sign_grant(signers, kind, tenant, reply.key.digest, gen, epoch, location, reply.lease, expires_ms)
        return attrs.evolve(reply, grant=grant)

    # ------------------------------------------------------------------ identities (issue 14)

    def _check_identity(self, credential: str, msg: Any) -> None:
        """Raise ``Unauthorized`` unless ``credential`` may send ``msg`` (see the module's
        "Identities"). Reads state, changes none."""
        node = self.tenants.node_of(credential)
        if node is None and self.tenants.shared_node_credential(credential):
            # The shared node credential of a deployment without node credentials: any node, as
            # before issue 14; its locations are still its own (below, for a Hello).
            if type(msg) is Hello:
                self._check_own_locations(msg.node, msg.locations, msg.lost, msg.locations)
            return
        operator = self.tenants.operator_of(credential)
        if operator is not None:
            if not self.tenants.may_operate(msg):
                raise Unauthorized(f"operator {operator!r} may not send {kind_of(msg)}: an operator invalidates, looks "
                                   "up and lists nodes; it holds no lease and writes nothing", tenant=credential)  # fmt: skip
            self._check_tenant(credential, msg)  # its Hello is a client's
            return
        if node is None:
            self._check_tenant(credential, msg)
            return
        match msg:
            case Hello():
                if msg.node != node:
                    raise Unauthorized(f"the credential of node {node!r} said Hello as {msg.node[:80]!r}",
                                       tenant=credential)  # fmt: skip
                self._check_own_locations(node, msg.locations, msg.lost, msg.locations)
            case Freed() | Copied():
                self._check_own_locations(node, (msg.location,), (), self._registered_locations(node))
            case Lost():
                if msg.node != node:
                    raise Unauthorized(f"node {node!r} reported a lost copy as {msg.node[:80]!r}", tenant=credential)
                self._check_own_locations(node, (msg.location,), (), self._registered_locations(node))
            case Transfer():
                if msg.node != node:
                    raise Unauthorized(f"node {node!r} asked a transfer as {msg.node[:80]!r}", tenant=credential)
                # Where the key is now is the transfer's to refuse (``_transfer``): a node's stale
                # LRU may name a key that moved away meanwhile, which is no attack.
                self._check_own_locations(node, (msg.destination,), (), self._registered_locations(node))
            case Evict():
                if msg.node != node:
                    raise Unauthorized(f"node {node!r} asked an eviction as {msg.node[:80]!r}", tenant=credential)
                self._check_own_locations(node, (msg.location,), (), self._registered_locations(node))
            case _ if isinstance(msg, CLIENT_REQUESTS):
                raise Unauthorized(f"node {node!r}'s credential is not a client's: no {kind_of(msg)}",
                                   tenant=credential)  # fmt: skip

    def _check_tenant(self, tenant: str, msg: Any) -> None:
        if isinstance(msg, NODE_REQUESTS):
            raise Unauthorized(f"tenant {tenant[:80]!r} may not send {kind_of(msg)}: only a cache node does",
                               tenant=tenant)  # fmt: skip
        if type(msg) is not Hello:
            return
        if msg.address or msg.locations or msg.lost:
            raise Unauthorized(f"tenant {tenant[:80]!r} said Hello as a cache node ({msg.node[:80]!r}, address "
                               f"{msg.address[:80]!r}, locations {list(msg.locations)[:4]}): a tenant registers "
                               "clients only", tenant=tenant)  # fmt: skip
        known = self._members.get(msg.node)
        if self.tenants.is_node_id(msg.node) or (known is not None and (known.own_locations or known.address)):
            raise Unauthorized(f"tenant {tenant[:80]!r} may not use cache node {msg.node[:80]!r}'s id",
                               tenant=tenant)  # fmt: skip
        if known is not None and known.credential != tenant:
            raise Unauthorized(f"client {msg.node[:80]!r} is another credential's", tenant=tenant)

    def _registered_locations(self, node: NodeId) -> tuple[LocationId, ...]:
        m = self._members.get(node)
        return () if m is None else m.locations

    @staticmethod
    def _check_own_locations(node: NodeId, locations: Any, lost: Any, mounted: Any) -> None:
        """Every location named is ``node``'s own tier (``"<node>/<tier>"``) or the shared pool
        it mounts; what it reports lost is among what it serves."""
        for loc in (*locations, *lost):
            owner = node_of(loc)
            if owner is None and loc not in mounted:
                raise Unauthorized(f"node {node!r} does not mount the shared pool")
            if owner is not None and owner != node:
                raise Unauthorized(f"node {node!r} named {loc[:80]!r}, a location of node {owner[:80]!r}")
        if not set(lost) <= set(locations):
            raise Unauthorized(f"node {node!r} reported lost a location it does not serve")

    def _heard_from(self, conn: Any) -> None:
        """A request on a node's connection: it is alive. One that was taken for down is up again
        (it was paused, or its heartbeats were late): what it may serve again."""
        node = None if conn is None else self._member_of_conn.get(conn)
        m = None if node is None else self._members.get(node)
        if m is None or m.conn is not conn:
            return
        m.last_heard_ms = self.now_ms()
        m.silent_sweeps = 0
        if m.down:
            m.down = False
            log.info("node %s is heard from again", m.node)
            self._apply(self.core.locations_up(m.own_locations, self.now_ms()))

    def _hello(self, tenant: str, msg: Hello) -> Welcome:
        conn = current_connection.get()
        known = self._members.get(msg.node)
        fence_keys: list[BlockKey] = []
        fence_epochs: list[int] = []
        if known is not None and known.credential != tenant and not known.own_locations and not known.address:
            # A client that took this id first (a shared-credential deployment cannot tell a node's
            # id from a client's before the node says Hello): not this node, whatever its
            # incarnation. The node takes its id over.
            known = None
        rejoined = (known is not None and known.incarnation != msg.incarnation) or bool(msg.lost)
        if known is not None and msg.incarnation < known.incarnation:
            raise PeerViolation(
                f"node {msg.node} said Hello as incarnation {msg.incarnation} after {known.incarnation}",
                code="stale_incarnation",
            )
        if rejoined:
            fences, effects = self.core.node_rejoined(msg.node, msg.lost, self.now_ms(), msg.locations)
            self._apply(effects)
            mine = set(msg.locations)
            for key, epoch in sorted(fences.items()):
                rec = self.core.records[key]
                if rec.owner in mine or rec.moving_to in mine or rec.draining in mine:
                    fence_keys.append(key)
                    fence_epochs.append(epoch)
            fence_keys, fence_epochs = fence_keys[:MAX_LOOKUP_KEYS], fence_epochs[:MAX_LOOKUP_KEYS]
        self._members[msg.node] = _Member(msg.node, msg.incarnation, msg.address, msg.locations, conn, self.now_ms(),
                                          tenant)  # fmt: skip
        if conn is not None:
            self._member_of_conn[conn] = msg.node
            conn.on_close.append(lambda c, node=msg.node: self._disconnected(node, c))
        # Back (or new): it may be leased and placed on again, and every free pending for its
        # locations goes out on this connection now (those sent while it was away were lost).
        self._apply(self.core.locations_up(msg.locations, self.now_ms()))
        self._wake.set()
        return Welcome(msg.node, msg.incarnation, tuple(fence_keys), tuple(fence_epochs), self.core.config.lease_term_ms)

    def _disconnected(self, node: NodeId, conn: Any) -> None:
        self._member_of_conn.pop(conn, None)
        m = self._members.get(node)
        if m is not None and m.conn is conn:
            m.conn = None  # directives for it are lost until it says Hello again
            if m.own_locations and not self._closing:
                # A kill -9 closes the connection at once: the loss dates the crash, and the spec
                # declares a crashed node down one registration term later, unless it is back.
                loop = asyncio.get_running_loop()
                delay_s = self.config.disconnect_detection_ms / 1000 + TIMER_SLACK_MS / 1000
                self._gone_timers = {h for h in self._gone_timers if h.when() > loop.time()}  # fired ones
                self._gone_timers.add(loop.call_later(delay_s, self._gone_too_long, m))

    def _gone_too_long(self, m: _Member) -> None:
        """A member's connection has been gone for ``disconnect_detection_ms``: unless it said
        Hello since (a new ``_Member``) or is declared already, it is down."""
        if self.fatal is not None or self._members.get(m.node) is not m or m.conn is not None or m.down:
            return
        m.down = True
        log.warning("node %s is down: its connection has been gone for %d ms", m.node, self.config.disconnect_detection_ms)
        self._apply(self.core.node_down(m.node, m.own_locations, self.now_ms()))

    def _lost(self, msg: Lost) -> Noted:
        """A node's read found no valid bytes of a generation at its location (``Lost``): the
        core voids the key if that copy was its owner (``DirectoryCore.copy_lost``)."""
        voided, effects = self.core.copy_lost(msg.key, msg.location, msg.gen, self.now_ms())
        self._apply(effects)
        if voided:
            self.stats["copies_lost"] += 1
            log.warning("%s lost its copy of %s (generation %d): the key is voided", msg.location, msg.key.hex[:16], msg.gen)
        return Noted("lost")

    def _transfer(self, tenant: str, msg: Transfer) -> Any:
        rec = self.core.records.get(msg.key)
        if rec is None or not self.tenants.allows(tenant, rec.namespace):
            return TransferRefused(msg.key, msg.destination, REASON_NOT_FOUND)
        node = self.tenants.node_of(tenant)
        if node is not None and rec.owner is not None and node_of(rec.owner) not in (node, None):
            return TransferRefused(msg.key, msg.destination, REASON_NOT_TRANSFERABLE)  # another node's copy
        if rec.gen != msg.gen or rec.owner != msg.source:
            return TransferRefused(msg.key, msg.destination, REASON_NOT_FOUND)  # rewritten or moved since
        ok, effects = self.core.start_transfer(msg.key, msg.destination, self.now_ms())
        self._apply(effects)
        if not ok:
            return TransferRefused(msg.key, msg.destination, REASON_NOT_TRANSFERABLE)
        return TransferStarted(msg.key, msg.destination, self.core.records[msg.key].epoch)

    async def _wait_ticket(self, tenant: str, msg: WaitTicket) -> Any:
        timeout_ms = min(msg.timeout_ms, MAX_WAIT_TICKET_MS)
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            self._apply(self.core.tick(self.now_ms()))
            await self._caught_up()  # a completion still being committed is not one yet
            ticket = self.core.ticket_status(msg.ticket)  # PeerViolation for a ticket never issued
            if ticket is None or ticket.state != TICKET_PENDING:
                return InvalidationCompleted(msg.ticket)
            left = deadline - time.monotonic()
            if left <= 0:
                return InvalidationPending(msg.ticket)
            ev = self._ticket_events.setdefault(msg.ticket, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await ev.wait()

    # ------------------------------------------------------------------ effects

    def _commit(self, durable: list[Effect], lines: Sequence[str] = ()) -> None:
        if self.events is not None and lines:
            # The lines before these are on their way to the file before the store holds only these.
            self.events.flush()
        try:
            self.store.commit(durable, events_tail=lines)
        except BaseException as e:
            self.fatal = e
            log.critical("the durable log failed; this directory stops serving: %r", e)
            raise
        self.stats["commits"] += 1
        if lines:
            failpoint("directory.committed_unlogged")

    def _stage_step(self, e: Emit, late_ns: Callable[[], int]) -> str | None:
        """``_emit_step``'s line, staged (``CoreHost``'s journal)."""
        if self.events is None:
            return None
        return self.events.stage(e.event, late_ns=late_ns, **dict(e.fields))

    def _emit_step(self, e: Emit, late_ns: Callable[[], int]) -> None:
        if self.events is not None:
            self.events.emit(e.event, late_ns=late_ns, **dict(e.fields))

    def _apply(self, effects: list[Effect]) -> asyncio.Future | None:
        """Carry out one core call's effects: commit the durable ones, log the steps (stamped at
        the time the core took them), then carry out the directives (``_carry_out``). Inline
        (``None``), or -- with a commit thread -- in the pipeline's order once its commit and
        every one before it are done (the future of that; module docstring, "Commits off the
        event loop")."""
        if self._committer is None:
            directives = self.host.record(effects)
            if directives and self.events is not None and not self.events.flush_each_line:
                self.events.flush()  # a batch's steps are on disk before anything they send leaves
            self._carry_out(directives, effects)
            self._wake_if_earlier()
            return None
        durable, lines, directives = self.host.prepare(effects)
        if not durable and not self._pipeline:
            if lines:
                self._write_lines(lines, bool(directives))
            self._carry_out(directives, effects)
            self._wake_if_earlier()
            return None
        if not durable and not lines and not directives:
            self._wake_if_earlier()
            return None
        entry = _Pending(durable, lines, directives, effects, asyncio.get_running_loop().create_future())
        entry.done.add_done_callback(_retrieved)
        entry.keys = _keys_of(effects)
        for k in entry.keys:
            self._pending_keys[k] = self._pending_keys.get(k, 0) + 1
        if durable:
            # The events tail: every line not written yet, its own last (a superset of what a
            # kill now would leave unwritten; ``append_missing`` skips the ones written by then).
            tail = [line for p in self._pipeline for line in p.lines] + lines
            self._committer.submit(entry, tail)
        else:
            entry.committed = True
        self._pipeline.append(entry)
        self._wake_if_earlier()
        return entry.done

    def _write_lines(self, lines: list[str], flush: bool) -> None:
        assert self.events is not None
        self.events.write_staged(lines)
        if flush and not self.events.flush_each_line:
            self.events.flush()  # on disk before anything the steps send leaves

    def _carry_out(self, directives: list[Effect], effects: list[Effect]) -> None:
        # The steps are logged; then the directives leave: a step's event is stamped before
        # anything it sends, and the clock is read again after the commit -- a Revoke whose
        # lease ran out by then is not sent (``Send.due``): a message the spec need never
        # deliver, and one the holder could only answer after its lease had gone.
        sent_ms = self.now_ms()
        for e in directives:
            match e:
                case Send():
                    if e.due(sent_ms):
                        self._push(e.node, e.msg)
                    else:
                        self.stats["lost_directives"] += 1
                case FreeAt():
                    self._push_to_location(e.location, Free(e.location, e.key, e.epoch))
                case CopyAt():
                    self._push_to_location(e.location, e.message())
                case CompleteTicket():
                    ev = self._ticket_events.pop(e.ticket.ticket, None)
                    if ev is not None:
                        ev.set()
        if self.counts is not None:
            self.counts.applied(effects)

    def _wake_if_earlier(self) -> None:
        deadline = self.core.next_deadline_ms()
        if deadline is not None and (self._timer_deadline_ms is None or deadline < self._timer_deadline_ms):
            self._wake.set()  # the next deadline moved earlier than the timer sleeps

    # ------------------------------------------------------------------ the commit pipeline

    def _committed(self, entries: list[_Pending], error: BaseException | None) -> None:
        """The commit thread's report (on the event loop): ``entries`` are durable, or the store
        failed and this directory stops serving."""
        if self._closing and self._committer is None:
            return  # closed: the store keeps these lines (its events tail) for the next start
        if error is not None:
            if self.fatal is None:
                self.fatal = error
                log.critical("the durable log failed; this directory stops serving: %r", error)
            failed = RuntimeError(f"the directory stopped serving: its store failed ({error})")
            for p in self._pipeline:
                if not p.done.done():
                    p.done.set_exception(failed)
            self._pipeline.clear()
            self._pending_keys.clear()
            return
        self.stats["commits"] += 1
        for p in entries:
            p.committed = True
        while self._pipeline and self._pipeline[0].committed:
            p = self._pipeline.popleft()
            for k in p.keys:
                n = self._pending_keys[k] - 1
                if n:
                    self._pending_keys[k] = n
                else:
                    del self._pending_keys[k]
            if p.lines:
                self._write_lines(p.lines, bool(p.directives))
            self._carry_out(p.directives, p.effects)
            if not p.done.done():
                p.done.set_result(None)

    def _once_caught_up(self, reply: Any) -> Any:
        """``reply`` now, or -- while commits are in flight -- a future of it once everything the
        directory did so far is durable and logged: a reply never tells what the log may lose."""
        if not self._pipeline:
            return reply
        answered: asyncio.Future = asyncio.get_running_loop().create_future()

        def done(last: asyncio.Future) -> None:
            if answered.done():
                return  # the request timed out meanwhile
            if last.cancelled() or last.exception() is not None:
                answered.set_exception(RuntimeError(f"the directory stopped serving: its store failed ({self.fatal})"))
            else:
                answered.set_result(reply)

        self._pipeline[-1].done.add_done_callback(done)
        return answered

    async def _caught_up(self) -> None:
        if self._pipeline:
            await asyncio.shield(self._pipeline[-1].done)

    def _push(self, node: NodeId, msg: Any) -> None:
        m = self._members.get(node)
        if m is None or m.conn is None or not m.conn.push(msg):
            self.stats["lost_directives"] += 1
            log.info("%s for %s lost: not connected", kind_of(msg), node)
            return
        self.stats["pushes"] += 1

    def _serving_node(self, location: LocationId) -> NodeId | None:
        """The connected node a directive for ``location`` goes to, if any."""
        node = node_of(location)
        if node is None:  # the shared pool: any connected node that mounts it
            return next(
                (n for n, m in sorted(self._members.items()) if location in m.locations and m.conn and not m.down), None
            )
        m = self._members.get(node)
        return node if m is not None and m.conn is not None else None

    def _push_to_location(self, location: LocationId, msg: Any) -> None:
        node = self._serving_node(location) or node_of(location)
        if node is None:
            self.stats["lost_directives"] += 1
            return
        self._push(node, msg)

    # ------------------------------------------------------------------ failure detection

    async def _watch_members(self) -> None:
        """P4: a node silent on its open connection for ``node_down_after_ms`` -- its heartbeats
        missed many times over (stopped, hung) -- is down: the core voids the keys it owns and
        grants nothing there. (One whose connection is gone: ``_gone_too_long``.)

        Silence is measured twice, and both must exceed the bound: on the directory's clock, and
        in sweeps of this loop (one per heartbeat interval) -- so a clock that jumps (a test's
        manual clock) or a loop that stalled (this process paused) never takes a node for down
        before it had the time to say something."""
        sweeps_down = -(-self.config.node_down_after_ms // HEARTBEAT_INTERVAL_MS)
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_MS / 1000)
            if self.fatal is not None:
                return
            now = self.now_ms()
            loop_now_s = asyncio.get_running_loop().time()
            for m in sorted(self._members.values(), key=lambda m: m.node):
                if not m.own_locations or m.conn is None:
                    continue  # a client (nothing of it can be down), or gone: ``_gone_too_long``
                # The node's heartbeat is a Ping, which the transport answers without calling
                # the handler (cheap, and the baseline of bench/directory.py); its connection
                # notes when it last received anything.
                if m.conn is not None and loop_now_s - m.conn.last_input < HEARTBEAT_INTERVAL_MS * 2 / 1000:
                    self._heard_from(m.conn)
                m.silent_sweeps += 1
                if m.down or now - m.last_heard_ms <= self.config.node_down_after_ms or m.silent_sweeps <= sweeps_down:
                    continue
                m.down = True
                log.warning("node %s is down: not heard from for %d ms", m.node, now - m.last_heard_ms)
                try:
                    self._apply(self.core.node_down(m.node, m.own_locations, now))
                except BaseException:
                    return  # fatal: the store failed

    # ------------------------------------------------------------------ time

    async def _timer(self) -> None:
        while True:
            self._wake.clear()
            deadline = self.core.next_deadline_ms()
            now = self.now_ms()
            if deadline is not None and deadline <= now:
                try:
                    self._apply(self.core.tick(now))
                except BaseException:
                    return  # fatal: the store failed
                await asyncio.sleep(0)
                continue
            wait_s = None if deadline is None else (deadline - now + TIMER_SLACK_MS) / 1000
            self._timer_deadline_ms = deadline  # _apply wakes us only for an earlier one
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._wake.wait()
