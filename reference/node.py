"""A cache node: storage tiers served over TCP, kept coherent by the directory's directives.

Theory of operation
-------------------
A node owns *locations*, one per tier, named ``"<node>/<tier>"`` (``n1/gpu``, ``n1/dram``,
``n1/nvme``), and may mount the shared pool (location ``"pool"``). It holds no protocol state of
its own beyond what its tiers keep -- the blocks and, per key, the fence -- and it never decides
whether a block may be dropped: the directory does (docs/protocol.md: directory).

- **Data server** (``transport.Server``, data-sized frames). ``WriteBytes`` from a writer is
  stored under its epoch: a tier refuses a lower epoch than its fence (spec ``fence_stale_write``),
  so a writer that paused past its lease cannot land bytes after a newer owner. A full tier first
  makes room by eviction (below). ``ReadBytes`` returns the bytes of exactly (key, gen), verified
  against their checksum, or ``ReadRefused("miss")``: never other bytes (protocol property 4). ``Evict`` from
  a client asks the directory on the client's behalf. Every request is authenticated per tenant
  (the same tenant tokens as the directory's; no node credential: nodes do not dial each other).
- **Directory link** (``transport.Client`` with ``on_push``), one per shard of a sharded
  directory (docs/sharding.md; one link for the one directory). The node says ``Hello`` on every
  new connection (its incarnation, data address, locations, and the locations that came back empty
  after a restart); the ``Welcome`` carries the fences to restore (spec ``restart_node``). The
  directory pushes ``Free`` (drop a copy unless fenced: ``free_slot`` / ``fence_stale_free``,
  then ``Freed`` whatever the outcome: the directory sends a free until it is acknowledged) and
  ``Copy`` (a transfer's new copy under ``epoch + 1``: ``store_copy``, then ``Copied``). It pings
  the directory every ``HEARTBEAT_INTERVAL_MS``: a node the directory stops hearing from is
  down (its keys voided, no lease pointed at it).
- **Shards** (``directory`` given as N addresses, shard ``i`` at index ``i``): every link says
  Hello and heartbeats on its own (each shard's failure detector hears the node), each Welcome's
  fences are restored as that link's (a shard answers only for its own keys), and a pushed Free
  or Copy is answered on the link it came on. A key's shard needs no field of its own: shard
  ``i`` hands out only lease ids ``= i (mod N)``, so a ``WriteBytes`` or ``ReadBytes`` names it
  as ``lease % N`` (under the grant's MAC), a Copy by the link it came on, and a restarted node's
  recovered blocks by the shard whose Welcome restores their fence. The node keeps that per key
  (in memory, forgetting keys no tier holds any more) and sends ``Lost`` (by the read's lease),
  ``Evict`` and demotion ``Transfer`` to the key's shard; a key whose shard it does not know is
  neither evicted nor demoted on its own say, and a client's ``Evict`` of it is refused
  ``shard_unknown`` (asking a shard that does not own the key would log a step of that key in a
  directory that is not its own).
- **Eviction** (docs/protocol.md: eviction and tiering). When a tier is full the node walks its
  least-recently-used keys and asks the directory ``Evict`` for each; the directory refuses a copy
  under a live read lease (``leased``) or one whose children are still cached (``has_children``:
  leaves go before their ancestors), and the node frees only what was granted. The node never
  frees a block on its own say.
- **Demotion**: above ``demote_watermark`` of a tier's capacity, the node asks the directory to
  ``Transfer`` its least recently used blocks to the next (slower) tier: an ownership transfer,
  not a copy behind the directory's back; the old copy is freed by the directory's ``Free`` once
  its leases drained.

Events (``kvcc.reference.events``): ``store_bytes``, ``fence_stale_write``, ``store_copy``,
``free_slot``, ``fence_stale_free``, ``crash``/``restart_node`` are logged by the node under its
own id and incarnation; ``location`` names the tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvcc.spec.keys import BlockKey, LocationId, NodeId
from kvcc.spec.rules import SKEW_MS_DEFAULT
from kvcc.spec.vocabulary import (
    REASON_BATCH_FULL,
    REASON_FENCED,
    REASON_HAS_CHILDREN,
    REASON_MISS,
    REASON_NO_SPACE,
    REASON_NOT_FOUND,
    REASON_TOO_LARGE,
    REASON_UNAUTHORIZED,
)

from .errors import ConnectionFailed, PeerViolation, TimeoutError_
from .events import EventLog
from .tiers import Fenced as TierFenced
from .tiers import Freed as TierFreed
from .tiers import NoSpace, Stored, Tier
from .transport import Client, Server, ServerLimits, TlsConfig
from .wire import (
    BATCH_NODE_KINDS,
    HEARTBEAT_INTERVAL_MS,
    MAX_BATCH_DATA_BYTES,
    MAX_FRAME_BYTES,
    Batch,
    Batched,
    BytesRead,
    BytesStored,
    Copied,
    Copy,
    Error,
    Evict,
    Evicted,
    EvictRefused,
    Fenced,
    Free,
    Freed,
    Hello,
    ReadBytes,
    ReadRefused,
    Revoke,
    Tenants,
    Transfer,
    Lost,
    Welcome,
    WriteBytes,
)
from .wire.grants import GRANT_READ, GRANT_WRITE, Grants, node_grant_key

if TYPE_CHECKING:
    from .metrics import NodeCounts

log = logging.getLogger("kvcc.node")

POOL_LOCATION = "pool"
EVICT_SCAN_MAX = 64  # keys asked about per attempt to make room
DEMOTE_INTERVAL_MS = 200
DEMOTE_WATERMARK_DEFAULT = 0.9
DEMOTE_BATCH = 8
DIRECTORY_RETRY_MS = 200
WELCOME_WAIT_S = 30.0  # a pushed Free or Copy waits this long for its connection's Hello to restore the fences
HEARTBEAT_TIMEOUT_MS = 4 * HEARTBEAT_INTERVAL_MS  # one Ping waits this long (the next one follows anyway)
SHARD_PRUNE_INTERVAL_MS = 5_000  # how often a sharded node forgets the shards of keys no tier holds any more
# A client's Evict of a key whose shard this node does not know (a sharded directory): asking a
# shard that does not own it would log a step of the key in another shard's directory.
REASON_SHARD_UNKNOWN = "shard_unknown"


def location_id(node: NodeId, tier: str) -> LocationId:
    return LocationId(f"{node}/{tier}")


def _is_address(a: Any) -> bool:
    """Whether ``a`` is one (host, port) address, not a sequence of them."""
    return isinstance(a, (tuple, list)) and len(a) == 2 and isinstance(a[0], str) and isinstance(a[1], int)


NODE_MAX_IN_FLIGHT = 8  # requests in flight per connection to a node (each may hold a block)
NODE_BATCH_PARALLEL = 8  # a batch's items a node takes at once (each may hold a block)


class CacheNode:
    """``CacheNode(node_id, tiers, tenants, directory, *, incarnation, ...)``.

    ``tiers``: tier name -> ``Tier``, fastest first (the demotion order); ``pool``: the shared
    pool's tier if this node mounts it. ``directory``: (host, port), or a sequence of N of them,
    shard ``i``'s at index ``i``, for a directory sharded N ways (docs/sharding.md). ``directory_tenant``: the
    credential this node authenticates as with the directory (its token is in ``tenants``): its own node
    credential (``wire.node_credential(node_id)``), or a deployment's shared one. The data server
    takes tenants' credentials only (``Tenants.without_nodes``).
    ``lost``: tier names that came back empty after a restart (volatile tiers always do).
    ``counts`` (a ``metrics.NodeCounts``): count bytes read and written and fenced writes per
    location for the metrics endpoint; ``None`` (the default) counts nothing. ``limits``, ``tls``:
    the transport's (``kvcc.reference.transport``); ``tls`` also for its connections to the directory.
    """

    def __init__(
        self,
        node_id: str,
        tiers: Mapping[str, Tier],
        tenants: Tenants,
        directory: tuple[str, int] | Sequence[tuple[str, int]],
        *,
        directory_tenant: str,
        incarnation: int = 1,
        host: str = "127.0.0.1",
        port: int = 0,
        pool: Tier | None = None,
        lost: Sequence[str] = (),
        events: EventLog | None = None,
        demote_watermark: float = DEMOTE_WATERMARK_DEFAULT,
        counts: NodeCounts | None = None,
        limits: ServerLimits | None = None,
        tls: TlsConfig | None = None,
        skew_ms: int = SKEW_MS_DEFAULT,
    ) -> None:
        assert tiers, "a node has at least one tier"
        assert 0 < demote_watermark <= 1
        self.node_id = NodeId(node_id)
        self.tiers = dict(tiers)
        self.pool = pool
        self.tenants = tenants
        # The directory's data-plane grants, checked before a block's bytes are served or stored
        # (wire/grants.py); ``skew_ms``: epsilon, how long past its end a grant is still taken.
        grant_key = node_grant_key(tenants, directory_tenant, node_id)
        self.grants = None if grant_key is None else Grants(grant_key, skew_ms)
        self.incarnation = incarnation
        self.events = events
        self.demote_watermark = demote_watermark
        self._locations: dict[LocationId, Tier] = {location_id(self.node_id, n): t for n, t in self.tiers.items()}
        if pool is not None:
            self._locations[LocationId(POOL_LOCATION)] = pool
        token = tenants.token(directory_tenant)
        assert token is not None, f"no token for tenant {directory_tenant!r}"
        self.tls = tls  # its server's, and its connections' to the directory
        addresses = [tuple(directory)] if _is_address(directory) else [tuple(a) for a in directory]
        assert addresses and all(_is_address(a) for a in addresses), f"not (host, port) addresses: {directory!r}"
        self.shards = len(addresses)
        # One link per shard (one for the one directory), each with its own Hello bookkeeping:
        # ``_hello_connects[i]`` is the connect count of shard i's link at its last Hello, and
        # ``_welcomed[i]`` is set once that connection's Hello restored the fences its Welcome
        # carried (a Free or Copy the shard pushes right behind the Welcome waits for it:
        # ``_welcome_first``). ``_lost[i]``: the locations still to report lost to shard i.
        self._dirs = [Client(*a, directory_tenant, token, tls=tls,
                             on_push=self._on_push if i == 0 else functools.partial(self._on_push, shard=i))
                      for i, a in enumerate(addresses)]  # fmt: skip
        self._dir = self._dirs[0]
        self._hello_connects = [-1] * self.shards
        self._welcomed = [asyncio.Event() for _ in range(self.shards)]
        self._lost = [tuple(location_id(self.node_id, n) for n in lost)] * self.shards
        # A sharded directory: tier key (``_tkey``) -> (key digest, shard), for every block a tier
        # here holds whose key this node learned (``_note``), with the stamp of the note
        # (``_prune_shards``): what a tier lists (its LRU order, its blocks) named again.
        self._blocks: dict[bytes, tuple[bytes, int, int]] = {}
        self._shard_notes = 0
        # Few requests in flight per connection: each read holds its block until the reply leaves,
        # and a peer that pipelines reads and never collects them holds no more than these.
        self._server = Server(self._handle, tenants.without_nodes(), host=host, port=port, max_frame_bytes=MAX_FRAME_BYTES, limits=limits,
                              max_in_flight_per_connection=NODE_MAX_IN_FLIGHT, tls=tls)  # fmt: skip
        self._tasks: set[asyncio.Task] = set()
        self._demoter: asyncio.Task | None = None
        self._hearts: list[asyncio.Task] = []  # one heartbeat per shard
        self._evict_lock = asyncio.Lock()
        # Per location: keys the directory last refused to evict for their cached children
        # (``_make_room`` asks them after the others).
        self._parents: dict[LocationId, set[bytes]] = {}
        # Per key: a transfer's copy and an eviction of the same key never overlap (``_one_key``).
        self._key_locks: dict[bytes, list] = {}
        self.stats = {"stored": 0, "fenced": 0, "reads": 0, "misses": 0, "freed": 0, "evicted": 0, "ungranted": 0,
                      "evict_refused": 0, "copies": 0, "demotions": 0}  # fmt: skip
        self.counts = counts  # bytes and fenced writes per location, for the metrics; None: not counted

    # ------------------------------------------------------------------ lifecycle

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def address(self) -> str:
        return f"{self._server.host}:{self.port}"

    @property
    def locations(self) -> tuple[LocationId, ...]:
        return tuple(self._locations)

    def tier_locations(self) -> dict[LocationId, Tier]:
        """Each location this node serves and its tier (the shared pool's too, if mounted)."""
        return dict(self._locations)

    @property
    def connection_count(self) -> int:
        return self._server.connection_count

    @property
    def directory_connected(self) -> bool:
        """Whether the link to the directory -- to every shard of a sharded one -- is connected."""
        return all(d.connected for d in self._dirs)

    async def start(self) -> CacheNode:
        await self._server.start()
        if self.shards == 1:
            await self._ensure_hello()
        else:
            await asyncio.gather(*(self._ensure_hello(i) for i in range(self.shards)))
        self._demoter = asyncio.create_task(self._demote_loop())
        self._hearts = [asyncio.create_task(self._heartbeat_loop(i)) for i in range(self.shards)]
        return self

    async def close(self) -> None:
        for task in (self._demoter, *self._hearts):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.close()
        for d in self._dirs:
            await d.close()

    async def __aenter__(self) -> CacheNode:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ the directory link

    async def _ensure_hello(self, shard: int = 0) -> None:
        """Say Hello on the directory connection (shard ``shard``'s) if it is a new one (after any
        reconnect)."""
        link = self._dirs[shard]
        await link.connect()
        if self._hello_connects[shard] == link.stats["connects"]:
            return
        self._hello_connects[shard] = link.stats["connects"]
        self._welcomed[shard].clear()
        reply = await link.request(
            Hello(self.node_id, self.incarnation, self.address, self.locations, self._lost[shard])
        )
        if type(reply) is not Welcome:
            raise ConnectionFailed(f"Hello answered with {type(reply).__name__}: {reply!r}", code="unexpected_reply")
        if reply.fence_keys:
            # A shard's Welcome names only its own keys: they are its keys here too.
            fences = {self._note(k.digest, shard): e for k, e in zip(reply.fence_keys, reply.fence_epochs)}
            for tier in self._locations.values():
                await asyncio.to_thread(tier.restore_fences, fences)
            log.info("%s restored %d fences%s", self.node_id, len(fences),
                     f" from shard {shard}" if self.shards > 1 else "")  # fmt: skip
        self._lost[shard] = ()  # reported once (to each shard)
        self._welcomed[shard].set()

    # ------------------------------------------------------------------ keys' shards

    def _tkey(self, digest: bytes, shard: int) -> bytes:
        """The tier key of ``digest``'s block as shard ``shard``'s. The one directory's: the
        digest itself. A sharded directory's: a hash of the shard and the digest, so that each
        shard's blocks are apart in every tier, the shared pool's included -- a digest is the
        client's to choose, and a second record of it in another shard (another namespace or
        parent, which the one directory would refuse but a shard that never saw the digest
        grants) must never take, free, fence or serve the bytes of the first: its writes, reads,
        frees and copies reach only its own shard's block."""
        if self.shards == 1:
            return digest
        return hashlib.sha256(b"kvcc shard block\0" + shard.to_bytes(4, "big") + digest).digest()

    def _note(self, digest: bytes, shard: int) -> bytes:
        """Remember that ``digest``'s block is shard ``shard``'s here; its tier key."""
        tkey = self._tkey(digest, shard)
        if self.shards > 1:
            self._shard_notes += 1
            self._blocks[tkey] = (digest, shard, self._shard_notes)
        return tkey

    def _known(self, tkey: bytes) -> tuple[bytes, int] | None:
        """The key digest and shard of the block a tier holds as ``tkey``, or None where this node
        never learned them (a pool block another node wrote, a recovered block no shard's
        Welcome named)."""
        if self.shards == 1:
            return tkey, 0
        entry = self._blocks.get(tkey)
        return None if entry is None else entry[:2]

    async def _prune_shards(self) -> None:
        """Forget the shards of keys no tier here holds any more (freed, evicted, moved): the map
        stays as large as what the node holds. A key noted after the tiers were listed is kept
        (its stamp is newer): it may have been stored since."""
        mark = self._shard_notes
        tiers = list(self._locations.values())
        held = await asyncio.to_thread(lambda: set().union(*(t.keys() for t in tiers)))
        for tkey in [t for t, (_, _, stamp) in self._blocks.items() if stamp <= mark and t not in held]:
            del self._blocks[tkey]

    async def _to_shard(self, shard: int, msg: Any) -> Any:
        """``msg`` to shard ``shard`` of the directory (to the directory when it is not sharded)."""
        if self.shards == 1:
            return await self._to_directory(msg)
        return await self._to_directory(msg, shard)

    async def _welcome_first(self, shard: int = 0) -> bool:
        """Whether the directory connection's Hello has restored the fences its Welcome carried.
        The directory sends the frees it owes a rejoining node at once, on the connection the
        Hello came on, and the Welcome's future resolves a loop turn after the push is handled: a
        Free applied before the fences would free under the fences from before the crash, which
        the spec's ``restart_node`` never does (the soak's trace was REJECTED at the ``free_slot``
        of a Free the restored fence refuses). Not welcomed in time: the push is dropped unanswered,
        and the directory sends it again."""
        try:
            await asyncio.wait_for(self._welcomed[shard].wait(), WELCOME_WAIT_S)
        except TimeoutError:
            log.warning("%s: a push waited %.0f s for the directory's Welcome; dropped", self.node_id, WELCOME_WAIT_S)
            return False
        return True

    async def _after_welcome(self, handle: Callable[..., Awaitable[None]], msg: Any, shard: int = 0) -> None:
        """A pushed Free or Copy, handled once the Welcome's fences (of the shard that pushed it)
        are restored."""
        if await self._welcome_first(shard):
            await (handle(msg) if self.shards == 1 else handle(msg, shard))

    async def _to_directory(self, msg: Any, shard: int = 0) -> Any:
        await self._ensure_hello(shard)
        return await self._dirs[shard].request(msg)

    def _on_push(self, msg: Any, shard: int = 0) -> None:
        """A directive pushed on shard ``shard``'s link (the directory's, when not sharded)."""
        match msg:
            case Free():
                self._spawn(self._after_welcome(self._free, msg, shard))
            case Copy():
                self._spawn(self._after_welcome(self._copy, msg, shard))
            case Revoke():
                # A node holds no read leases itself (clients do): nothing to drop. Acknowledge
                # anyway, so the directory is not left waiting for an expiry.
                log.warning("%s got a Revoke for lease %d it never held", self.node_id, msg.lease)
            case _:
                log.warning("%s ignores a pushed %s", self.node_id, type(msg).__name__)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _tier(self, location: LocationId) -> Tier | None:
        return self._locations.get(location)

    def _emit(self, event: str, key: BlockKey, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(event, key=key, **fields)

    async def _free(self, msg: Free, shard: int = 0) -> None:
        """Free the key's block at ``msg.location`` under the fence rule, then acknowledge
        (``Freed``) whatever the outcome: freed, absent (nothing there: an earlier try freed it,
        or the bytes never landed) or fenced. A fenced free is acknowledged too: the directory
        frees under the key's highest epoch, so a fence above it means a later grant here, whose
        bytes replaced the old ones or whose own end is freed in turn; holding the ack back would
        only make the directory send it forever. The directory sends a free again until it hears
        ``Freed``, so an ack lost on the way costs one more free, nothing else."""
        tier = self._tier(msg.location)
        if tier is None:
            log.warning("%s: Free for a location it does not serve: %s", self.node_id, msg.location)
            return  # not acknowledged: the directory tries again (the pool: maybe another node)
        tkey = self._tkey(msg.key.digest, shard)  # only the pushing shard's block
        async with self._one_key(tkey):  # never between a copy's read of its source and its log
            outcome = await asyncio.to_thread(tier.free, tkey, msg.epoch)
            if isinstance(outcome, TierFenced):
                self._emit("fence_stale_free", msg.key, epoch=msg.epoch, result=REASON_FENCED, location=msg.location,
                           fence=outcome.fence)  # fmt: skip
            else:
                self.stats["freed"] += isinstance(outcome, TierFreed)
                self._emit("free_slot", msg.key, epoch=msg.epoch,
                           result="ok" if isinstance(outcome, TierFreed) else "absent", location=msg.location)  # fmt: skip
        with contextlib.suppress(ConnectionFailed, TimeoutError_):
            await self._to_shard(shard, Freed(msg.location, msg.key, msg.epoch))  # on the link it came on

    @contextlib.asynccontextmanager
    async def _one_key(self, key: bytes) -> Any:
        """Hold ``key`` against this node's other copies, evictions and frees of it. A transfer's
        copy reads the source, stores the destination and logs ``store_copy`` in one step of the
        spec; an eviction the directory agreed to empties the source at the directory's step, and
        a free at its own. Had an eviction of the source been asked and granted between the copy's
        read and its log, ``store_copy`` would follow the directory's ``evict`` -- a copy the spec
        cannot deliver (its source is gone), REJECTED (KVCC-TIER-006, a node making room while
        demoting); likewise a free of the source sent by an invalidation racing the transfer
        (tests/test_deletion.py, about one run in four)."""
        entry = self._key_locks.get(key)
        if entry is None:
            entry = self._key_locks[key] = [asyncio.Lock(), 0]
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._key_locks[key]

    async def _copy(self, msg: Copy, shard: int = 0) -> None:
        tkey = self._tkey(msg.key.digest, shard)  # the shard that pushed the Copy owns the key
        async with self._one_key(tkey):
            copied = await self._copy_one(msg, tkey)
            if copied:
                self._note(msg.key.digest, shard)
        if copied:
            with contextlib.suppress(ConnectionFailed, TimeoutError_):
                await self._to_shard(shard, Copied(msg.location, msg.key, msg.epoch))  # on the link it came on

    async def _copy_one(self, msg: Copy, tkey: bytes) -> bool:
        dest, src = self._tier(msg.location), self._tier(msg.source)
        reason = None
        if dest is None or src is None:
            reason = "not_local"  # transfers run between tiers of one node (and its pool)
        else:
            data = await asyncio.to_thread(src.read, tkey, msg.gen)
            if data is None:
                reason = REASON_MISS
            elif not dest.fits(len(data)):
                reason = REASON_TOO_LARGE
            else:
                if self.counts is not None:
                    self.counts.read_bytes[msg.source] += len(data)
                outcome = await self._store(dest, msg.location, msg.key, msg.gen, msg.epoch, data, tkey=tkey)
                if isinstance(outcome, TierFenced):
                    reason = REASON_FENCED
                elif not isinstance(outcome, Stored):
                    reason = REASON_NO_SPACE
        if reason is not None:
            log.info("%s: copy of %s to %s failed: %s", self.node_id, msg.key.hex[:12], msg.location, reason)
            return False  # the directory's transfer stays pending until cancelled; nothing moved
        self.stats["copies"] += 1
        self._emit("store_copy", msg.key, gen=msg.gen, epoch=msg.epoch, location=msg.location, source=msg.source)
        return True

    # ------------------------------------------------------------------ the data server

    async def _handle(self, tenant: str, msg: Any) -> Any:
        match msg:
            case WriteBytes():
                problem = self._grant_problem(tenant, GRANT_WRITE, msg, msg.epoch)
                if problem is not None:
                    self.stats["ungranted"] += 1
                    return Error(REASON_UNAUTHORIZED, problem)
                return await self._write_bytes(msg)
            case ReadBytes():
                problem = self._grant_problem(tenant, GRANT_READ, msg, 0)
                if problem is not None:
                    self.stats["ungranted"] += 1
                    return ReadRefused(msg.node, msg.key, msg.location, REASON_UNAUTHORIZED)
                return await self._read_bytes(msg)
            case Evict():
                return await self._evict_for(tenant, msg)
            case Batch():
                return await self._batch(tenant, msg)
        raise PeerViolation(f"a node does not take {type(msg).__name__}", code="unexpected_message")

    async def _batch(self, tenant: str, msg: Batch) -> Batched:
        """Many blocks' reads or writes in one round trip (``Batch``): each item as if it came
        alone, ``NODE_BATCH_PARALLEL`` at a time (as that many requests in flight would be).
        Once the replies carry ``MAX_BATCH_DATA_BYTES`` of blocks, the reads left are answered
        ``batch_full``, untouched: the holder asks for them again. Memory stays bounded by that
        and one wave of blocks."""
        for i, item in enumerate(msg.items):
            if type(item) not in BATCH_NODE_KINDS:
                raise PeerViolation(f"Batch item {i}: a node batches reads and writes, not {type(item).__name__}",
                                    code="unexpected_message")  # fmt: skip
        replies: list[Any] = []
        carried = 0
        items = list(msg.items)
        for start in range(0, len(items), NODE_BATCH_PARALLEL):
            wave = items[start : start + NODE_BATCH_PARALLEL]
            if carried >= MAX_BATCH_DATA_BYTES:
                answers = [self._batch_full(item) if type(item) is ReadBytes else None for item in wave]
                todo = [item for item, a in zip(wave, answers) if a is None]
                done = iter(await asyncio.gather(*(self._handle(tenant, item) for item in todo)))
                replies += [a if a is not None else next(done) for a in answers]
                continue
            for item, reply in zip(wave, await asyncio.gather(*(self._handle(tenant, item) for item in wave))):
                if type(reply) is BytesRead:
                    if carried + len(reply.data) > MAX_BATCH_DATA_BYTES:
                        reply = self._batch_full(item)
                    else:
                        carried += len(reply.data)
                replies.append(reply)
        return Batched(tuple(replies))

    @staticmethod
    def _batch_full(item: ReadBytes) -> ReadRefused:
        return ReadRefused(item.node, item.key, item.location, REASON_BATCH_FULL)

    def _grant_problem(self, tenant: str, kind: str, msg: ReadBytes | WriteBytes, epoch: int) -> str | None:
        """Why ``tenant`` may not have ``msg`` done here: its grant is not the directory's grant
        of that block, location and lease to that tenant, or ran out (``None``: it may). Before
        any tier is touched: bytes under a foreign or absent grant never land, never leave."""
        if self.grants is None:
            return "this node holds no grant key: it serves no bytes"
        return self.grants.problem(msg.grant, kind, tenant, msg.key.digest, msg.gen, epoch, msg.location, msg.lease)

    async def _write_bytes(self, msg: WriteBytes) -> Any:
        tier = self._tier(msg.location)
        if tier is None:
            return Error("not_here", f"{msg.location} is not a location of {self.node_id}")
        if not tier.fits(len(msg.data)):  # a typed refusal, before any state changes
            return Error(REASON_TOO_LARGE, f"a {len(msg.data)}-byte block does not fit {msg.location}'s slots")
        shard = msg.lease % self.shards  # shard i grants only lease ids = i (mod N), under the grant's MAC
        outcome = await self._store(tier, msg.location, msg.key, msg.gen, msg.epoch, msg.data, writer=msg.node,
                                    lease=msg.lease, tkey=self._tkey(msg.key.digest, shard))  # fmt: skip
        if isinstance(outcome, TierFenced):
            return Fenced(msg.location, msg.key, msg.epoch, outcome.fence)
        if not isinstance(outcome, Stored):
            return Error(REASON_NO_SPACE, f"{msg.location} is full of leased blocks")
        self._note(msg.key.digest, shard)
        return BytesStored(msg.location, msg.key, msg.gen, msg.epoch)

    async def _store(self, tier: Tier, location: LocationId, key: BlockKey, gen: int, epoch: int, data: Any,
                     *, tkey: bytes, writer: str | None = None, lease: int | None = None) -> Any:  # fmt: skip
        outcome = await asyncio.to_thread(tier.write, tkey, gen, epoch, data)
        if isinstance(outcome, NoSpace):
            await self._make_room(tier, location, len(data))
            outcome = await asyncio.to_thread(tier.write, tkey, gen, epoch, data)
        if isinstance(outcome, TierFenced):
            self.stats["fenced"] += 1
            if self.counts is not None:
                self.counts.fenced_writes[location] += 1
            if writer is not None:  # a transfer's copy refused by the fence is the spec's
                # fence_stale_copy, which is not logged (the Copy is consumed; nothing moved)
                self._emit("fence_stale_write", key, gen=gen, epoch=epoch, lease=lease, result=REASON_FENCED,
                           location=location, writer=writer, fence=outcome.fence)  # fmt: skip
        elif isinstance(outcome, Stored):
            self.stats["stored"] += 1
            if self.counts is not None:
                self.counts.written_bytes[location] += outcome.nbytes
            if writer is not None:
                self._emit("store_bytes", key, gen=gen, epoch=epoch, lease=lease, location=location, writer=writer,
                           nbytes=outcome.nbytes)  # fmt: skip
        return outcome

    async def _read_bytes(self, msg: ReadBytes) -> Any:
        tier = self._tier(msg.location)
        if tier is None:
            return ReadRefused(msg.node, msg.key, msg.location, "not_here")
        shard = msg.lease % self.shards  # the granting shard's block only
        data, fence = await asyncio.to_thread(self._read_and_fence, tier, self._tkey(msg.key.digest, shard), msg.gen)
        self.stats["reads"] += 1
        if data is None:
            self.stats["misses"] += 1
            self._spawn(self._report_lost(msg))
            return ReadRefused(msg.node, msg.key, msg.location, REASON_MISS)
        if self.counts is not None:
            self.counts.read_bytes[msg.location] += len(data)
        self._note(msg.key.digest, shard)  # a granted read names its shard too
        return BytesRead(msg.location, msg.key, msg.gen, fence, data)

    @staticmethod
    def _read_and_fence(tier: Tier, digest: bytes, gen: int) -> tuple[Any, int]:
        """The block's bytes (None: a miss) and then the key's fence, both off the event loop: a
        file tier's fence is a read of its block's header and its fence file."""
        data = tier.read(digest, gen)
        return data, (tier.fence(digest) if data is not None else 0)

    async def _report_lost(self, msg: ReadBytes) -> None:
        """A read the directory granted found no valid bytes here (gone, or failing their
        checksum): tell the directory (``Lost``), which voids the key if this was the generation's
        owner copy -- else every lookup would find it, every read miss, and no one could write it
        again. A report lost on the way is made again by the next read that misses. It goes to the
        shard that granted the read (``lease % N``)."""
        with contextlib.suppress(ConnectionFailed, TimeoutError_, OSError):
            await self._to_shard(msg.lease % self.shards, Lost(self.node_id, msg.key, msg.location, msg.gen))

    async def _evict_for(self, tenant: str, msg: Evict) -> Any:
        """A client asks to evict the copy at one of our locations: the directory decides (with
        the client's tenant, so that it may only evict in its own namespaces)."""
        location = msg.location
        tkeys = [self._tkey(msg.key.digest, s) for s in range(self.shards)]
        if location == self.node_id:  # "whichever of my tiers holds it"
            location = next((loc for loc, t in self._locations.items() if loc != POOL_LOCATION
                             and not set(tkeys).isdisjoint(t.keys())), None)  # fmt: skip
            if location is None:
                return EvictRefused(msg.node, msg.key, msg.location, REASON_NOT_FOUND)
        tier = self._tier(location)
        if tier is None:
            return EvictRefused(msg.node, msg.key, msg.location, "not_here")
        shard = 0
        if self.shards > 1:  # the shard whose block of this key the tier holds (exactly one)
            held = set(tier.keys())
            shards = [s for s, t in enumerate(tkeys) if t in held]
            if len(shards) != 1:
                log.info("%s: a client's Evict of %s refused: %s", self.node_id, msg.key.hex[:12],
                         "no shard's block is here" if not shards else "several shards' blocks are here")  # fmt: skip
                return EvictRefused(msg.node, msg.key, msg.location, REASON_SHARD_UNKNOWN)
            shard = shards[0]
        tkey = tkeys[shard]
        token = self.tenants.token(tenant)
        assert token is not None
        link = self._dirs[shard]
        async with self._one_key(tkey):
            fence = tier.fence(tkey)  # before asking: see _drop_evicted
            async with Client(link.host, link.port, tenant, token, tls=self.tls) as dir_as_tenant:
                reply = await dir_as_tenant.request(Evict(self.node_id, msg.key, location))
            if type(reply) is Evicted:
                await self._drop_evicted(tier, location, msg.key, fence, tkey)
        return reply

    async def _drop_evicted(self, tier: Tier, location: LocationId, key: BlockKey, fence: int, tkey: bytes) -> None:
        """Free the copy the directory let go of. ``fence`` is the key's fence read *before*
        asking: once the directory said Evicted the key is ABSENT, a new write may be granted
        here at once and land before this free runs; its higher epoch fences this free, so the
        new block stays (freeing with the fence read now would drop it)."""
        outcome = await asyncio.to_thread(tier.free, tkey, fence)
        self.stats["evicted"] += 1
        log.debug("%s evicted %s from %s: %s", self.node_id, key.hex[:12], location, type(outcome).__name__)

    # ------------------------------------------------------------------ capacity

    async def _make_room(self, tier: Tier, location: LocationId, nbytes: int) -> None:
        """Evict least-recently-used blocks the directory agrees to, until ``nbytes`` fit; at most
        ``EVICT_SCAN_MAX`` asks.

        Candidates go in recency order, except that a key the directory last refused for its
        cached children is asked after every other. A prefix cache touches a chain root first, so
        its least recently used blocks are mostly parents, which the directory lets go only after
        their children (leaves first): asked in plain LRU order, the asks ran out on parents and
        a full node refused ``no_space`` at a directory round trip each (the performance suite's
        full trace replay measured a write at 510 ms and 0.184 of the infinite-cache bound). The order
        is a hint only: the directory decides every eviction, and a parent whose children have
        gone is asked again once the others are."""
        async with self._evict_lock:
            lru = tier.lru()
            parents = self._parents.setdefault(location, set())
            parents &= set(lru)  # forget keys no longer here
            asked = 0
            unreachable: set[int] = set()  # shards that did not answer: their keys wait
            for tkey in sorted(lru, key=parents.__contains__):  # stable: recency order within each part
                if tier.capacity_bytes - tier.used_bytes >= nbytes or asked >= EVICT_SCAN_MAX:
                    return
                if tkey in self._key_locks:
                    continue  # being copied or evicted right now: another victim (never wait here,
                    # a copy that holds its own key may be the one making room)
                known = self._known(tkey)
                if known is None:
                    log.info("%s: a block not evicted from %s: its key and shard are unknown here", self.node_id,
                             location)  # fmt: skip
                    continue
                raw, shard = known
                if shard in unreachable:
                    continue
                asked += 1
                key = BlockKey(raw)
                async with self._one_key(tkey):
                    fence = tier.fence(tkey)
                    try:
                        reply = await self._to_shard(shard, Evict(self.node_id, key, location))
                    except (ConnectionFailed, TimeoutError_) as e:
                        log.warning("%s: cannot make room, directory%s unreachable: %s", self.node_id,
                                    f" shard {shard}" if self.shards > 1 else "", e)  # fmt: skip
                        unreachable.add(shard)
                        if len(unreachable) == self.shards:
                            return
                        continue
                    if type(reply) is Evicted:
                        await self._drop_evicted(tier, location, key, fence, tkey)
                        parents.discard(tkey)
                    else:
                        self.stats["evict_refused"] += 1
                        if getattr(reply, "reason", None) == REASON_HAS_CHILDREN:
                            parents.add(tkey)
                        else:
                            parents.discard(tkey)

    async def _heartbeat_loop(self, shard: int = 0) -> None:
        """Ping the directory (shard ``shard``: one loop per shard, so that a slow or paused
        shard delays no other's) every ``HEARTBEAT_INTERVAL_MS`` (saying Hello first on a new
        connection): a node it stops hearing from is down (P4), its keys voided, no lease
        pointed at it; a node that reconnects after a directory restart or a dropped connection
        gets the frees it missed at once."""
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_MS / 1000)
            with contextlib.suppress(ConnectionFailed, TimeoutError_, OSError):
                await self._ensure_hello(shard)
                await self._dirs[shard].ping(timeout_ms=HEARTBEAT_TIMEOUT_MS)

    async def _demote_loop(self) -> None:
        names = list(self.tiers)
        pruned = time.monotonic()
        while True:
            await asyncio.sleep(DEMOTE_INTERVAL_MS / 1000)
            # Stay registered: after a directory restart (or a lost connection) say Hello again
            # at once, so directives reach us and writes can be placed here. (Sharded: each
            # shard's heartbeat loop does, so that a shard that does not answer holds up no
            # demotion of another's keys.)
            if self.shards == 1:
                with contextlib.suppress(ConnectionFailed, TimeoutError_, OSError):
                    await self._ensure_hello()
            elif time.monotonic() - pruned >= SHARD_PRUNE_INTERVAL_MS / 1000:
                pruned = time.monotonic()
                await self._prune_shards()
            for upper, lower in zip(names, names[1:]):
                tier = self.tiers[upper]
                if tier.used_bytes <= self.demote_watermark * tier.capacity_bytes:
                    continue
                gens = {b.key: b.gen for b in tier.blocks()}
                for tkey in tier.lru()[:DEMOTE_BATCH]:
                    if tkey not in gens:
                        continue  # freed since
                    known = self._known(tkey)
                    if known is None:
                        log.info("%s: a block not demoted: its key and shard are unknown here", self.node_id)
                        continue
                    raw, shard = known
                    key = BlockKey(raw)
                    source, dest = location_id(self.node_id, upper), location_id(self.node_id, lower)
                    with contextlib.suppress(ConnectionFailed, TimeoutError_):
                        await self._to_shard(shard, Transfer(self.node_id, key, gens[tkey], source, dest))
                        self.stats["demotions"] += 1

    def snapshot(self) -> dict[str, Any]:
        """What each tier holds (for ``kvcc cluster`` output and tests)."""
        return {
            loc: {"blocks": len(t.keys()), "used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes}
            for loc, t in self._locations.items()
        } | {"stats": dict(self.stats), "time_ns": time.monotonic_ns()}
