"""``lmcache-raw``: LMCache's own storage engine mapped onto the adapter contract, and nothing more.

Theory of operation
-------------------
Like ``mooncake-raw`` for Mooncake Store (``kvcc.adapters.mooncake.raw``), this adapter adds no
protocol: each contract operation is the LMCache call that comes closest and its answer is
translated, not corrected. What the suite finds is what LMCache provides on its own.

The deployment: one LMCache engine (``LMCacheEngineBuilder``, LMCache's own configuration) with
its two local tiers, a CPU tier of ``CPU_TIER_BYTES`` and a local-disk tier of
``DISK_TIER_BYTES`` under ``workdir/lmcache-disk``, run in this process. The contract's nodes are
clients of that one cache: this is how LMCache shares a cache among the serving engines of one
host (its multiprocess server mode: one cache process per machine, engines connected to it); the
adapter calls the cache's storage manager directly instead of through the server's transport, so
there are no processes to kill or pause. Every call goes through ``StorageManager``, the layer
LMCache's own ``store``/``retrieve``/``lookup`` use, keyed by an explicit ``CacheEngineKey``:
what LMCache keys a chunk by is the model name (the namespace's ``model_id``), world size and
worker id (``tp_size``, ``tp_rank``), the KV dtype and the chunk hash -- here the suite's block key
(which already chains over the whole namespace digest; LMCache's own token hash does not). A block
is one memory object of its bytes (``uint8``). The mapping:

- ``lookup``: ``batched_contains`` on the chain: the leading chunks found, tier after tier (as
  LMCache's prefix lookup counts them). No tenants: every client sees every key.
- ``begin_write``: ``contains`` -- refused ``not_absent`` if the key is cached. The grant is the
  adapter's own (a local lease id): LMCache has no write leases, generations or epochs (``gen =
  0``, ``epoch = 0``) and no prefix chains (the parent is not checked).
- ``write_bytes``: the bytes wait in the writer; ``commit`` is ``allocate`` (no busy wait: a
  full CPU tier it cannot evict is ``Refused("no_space")``) and ``batched_put``, which stores in
  the CPU tier at once and writes the disk tier in the background. A put of a key already cached
  keeps the first value and says nothing. LMCache allocates no empty object: an empty block is
  ``Refused("no_space")``. ``Committed(gen=0, epoch=0)``.
- ``abort``: the writer drops the buffered bytes.
- ``acquire``: ``contains(pin=True)``, LMCache's own lookup pin (what its vLLM connector takes
  between lookup and retrieve: it keeps LRU eviction off the chunk; it does not stop a
  ``remove``), so ``leases="advisory"``. ``renew``: ``contains``. ``release``: ``batched_unpin``.
- ``read``: ``get`` (CPU tier first, then disk, which copies the chunk back into the CPU tier);
  nothing found is ``Refused("miss")``. A disk read whose file went away under it (LMCache reads
  outside its disk lock) raises ``KeyError`` in LMCache: ``Refused("miss")`` too.
- ``invalidate``: scope ``key``: ``remove`` on every tier; scope ``namespace``: ``clear`` -- the
  cache's only bulk removal, which knows no namespaces (it clears every key), skips chunks pinned
  or being read, and skips the disk tier (LMCache's disk backend has no ``clear``). ``prefix``:
  not supported (the storage layer knows no chains). ``wait_invalidation``: the calls are
  synchronous. Holders are told nothing.
- ``evict``: ``remove`` on every tier, which is forced: pins and children are not checked.
  Nothing removed is ``Refused("not_found")``.
- faults: ``corrupt`` damages the chunk's disk file (``<disk>/<key>.pt``: the raw bytes, no
  header or checksum, so ``"header"`` damages the payload too) and drops its CPU copy, as LRU
  eviction would, so that the next read reaches the copy at rest; ``restart_directory`` rebuilds
  the engine on the same disk directory (LMCache's index of both tiers lives in memory).
- events: ``inferred`` -- LMCache logs no protocol events.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import platform
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvcc.adapters.buffered import BufferedWrites
from kvcc.conformance.contract import (
    CORRUPT_REGIONS,
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
from kvcc.spec.vocabulary import (
    REASON_MISS,
    REASON_NO_SPACE,
    REASON_NOT_ABSENT,
    REASON_NOT_COMMITTED,
    REASON_NOT_FOUND,
    REASON_UNKNOWN_LEASE,
)

LMCACHE_DIST = "lmcache"
LOCATION = "lmcache"
NO_GENERATION = 0  # LMCache has none
NO_EPOCH = 0  # LMCache has none
CPU_TIER_BYTES = 32 << 20  # room for the performance suite's largest block (16 MiB)
DISK_TIER_BYTES = 32 << 20
# The overload test's block (TIER-006): twice the two tiers is 2,048 of them (the suite writes at most
# 4,096). LMCache takes any size up to its CPU tier's.
BLOCK_BYTES = 64 << 10
DISK_TIER = "LocalDiskBackend"
CPU_TIER = "LocalCPUBackend"
DISK_SETTLE_S = 2.0  # how long corrupt waits for a chunk's background disk write
_GB = float(1 << 30)
# The engine's model metadata: LMCache requires one; this adapter stores raw bytes through the
# storage manager, so only the dtype (uint8) reaches what it stores.
_KV_SHAPE = (1, 2, 16, 1, 8)


def _shape(size: int) -> Any:
    """A block of ``size`` bytes as one token of LMCache's default memory format ([2, layers,
    tokens, hidden]: the token axis is what ``clear`` counts, so it answers chunks cleared)."""
    import torch

    return torch.Size([1, 1, 1, size])


def _torch_dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.uint8


class LMCacheRawAdapter(Adapter):
    """LMCache's own CPU and disk tiers under the contract; see the module docstring."""

    name = "lmcache-raw"

    def __init__(self) -> None:
        self._ctx: RunContext | None = None
        self._disk: str | None = None
        self._nodes: tuple[str, ...] = ()
        self._engine: Any = None
        self._instance: str | None = None
        self._incarnation = itertools.count()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._writes: BufferedWrites[Any] = BufferedWrites()  # the grant's LMCache key, and its bytes
        self._reads: dict[int, Any] = {}  # read lease -> LMCache key
        self._committed: dict[BlockKey, set[Any]] = {}  # block -> the LMCache keys it was committed under

    def capabilities(self) -> Capabilities:
        return Capabilities(
            profiles=frozenset({"core", "leases", "invalidation", "tiering", "faults"}),
            faults=frozenset({"corrupt", "restart_directory"}),
            scopes=frozenset({"key", "namespace"}),
            events="inferred",
            leases="advisory",
            capacity_bytes=CPU_TIER_BYTES + DISK_TIER_BYTES,
            block_bytes=BLOCK_BYTES,
            notes="LMCache's own storage engine (CPU and local-disk tiers, one cache the nodes share), nothing "
            "added: batched_put is the commit (first value wins, disk written in the background), contains(pin) "
            "the (advisory) lease, get the read, remove the key invalidation and the eviction (forced), clear "
            "(every key, CPU tier only) the namespace invalidation; no leases, generations, epochs, fencing, "
            "prefix chains, tenants or checksums in the store",
        )

    def versions(self) -> Mapping[str, str]:
        from importlib.metadata import version

        return {"kvcc": version("kvcc"), LMCACHE_DIST: version(LMCACHE_DIST), "torch": version("torch"),
                "python": platform.python_version()}  # fmt: skip

    # ------------------------------------------------------------------ lifecycle

    def start(self, ctx: RunContext) -> None:
        self._ctx = ctx
        self._disk = str(ctx.workdir / "lmcache-disk")
        os.makedirs(self._disk, exist_ok=True)
        self._nodes = tuple(f"n{i}" for i in range(ctx.nodes))
        try:
            self._build()
        except Exception as e:
            self.stop()
            raise AdapterError(f"LMCache did not come up: {type(e).__name__}: {e}") from e

    def _build(self) -> None:
        """A new LMCache engine on ``self._disk``, with LMCache's own builder and configuration."""
        import torch
        from lmcache.utils import mock_up_broadcast_fn, mock_up_broadcast_object_fn
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
        from lmcache.v1.metadata import LMCacheMetadata

        instance = f"kvcc-lmcache-raw-{os.getpid()}-{id(self):x}-{next(self._incarnation)}"
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=_KV_SHAPE[2], local_cpu=True, max_local_cpu_size=CPU_TIER_BYTES / _GB,
            local_disk=f"file://{self._disk}/", max_local_disk_size=DISK_TIER_BYTES / _GB,
            lmcache_instance_id=instance, py_enable_gc=True,
        )  # fmt: skip
        metadata = LMCacheMetadata(model_name="kvcc", world_size=1, local_world_size=1, worker_id=0,
                                   local_worker_id=0, kv_dtype=torch.uint8, kv_shape=_KV_SHAPE, role="worker")  # fmt: skip
        # LMCacheEngine forces the "spawn" start method on the whole process: keep the process's own.
        method = multiprocessing.get_start_method(allow_none=True)
        try:
            engine = LMCacheEngineBuilder.get_or_create(instance, config, metadata, MockGPUConnector(_KV_SHAPE),
                                                        mock_up_broadcast_fn, mock_up_broadcast_object_fn)  # fmt: skip
            engine.post_init()
        finally:
            multiprocessing.set_start_method(method, force=True)
        self._engine, self._instance = engine, instance

    def _teardown(self) -> None:
        engine = self._engine
        instance, self._instance, self._engine = self._instance, None, None
        if engine is not None:
            # LMCache closes its CPU tier (freeing the memory its objects live in) before its disk
            # tier waits for the disk writes still copying from them: a write in flight then
            # reads freed memory (a segfault). Let the disk writes finish first.
            disk = engine.storage_manager.storage_backends.get(DISK_TIER)
            deadline = time.monotonic() + DISK_SETTLE_S * 5
            while disk is not None and disk.disk_worker.put_tasks and time.monotonic() < deadline:
                time.sleep(0.005)
        if instance is not None:
            from lmcache.v1.cache_engine import LMCacheEngineBuilder

            try:
                LMCacheEngineBuilder.destroy(instance)
            except Exception:  # stop must not raise
                pass

    def stop(self) -> None:
        self._teardown()
        self._nodes = ()
        if self._disk is not None:
            shutil.rmtree(self._disk, ignore_errors=True)

    def nodes(self) -> Sequence[str]:
        return list(self._nodes)

    def events(self) -> list[dict] | None:
        return None

    @property
    def _sm(self) -> Any:
        engine = self._engine
        if engine is None:
            raise AdapterError("the LMCache engine is not running")
        return engine.storage_manager

    def _node(self, node: str) -> None:
        if node not in self._nodes:
            raise AdapterError(f"no node {node!r}")

    @staticmethod
    def _key(ns: Namespace, key: BlockKey) -> Any:
        from lmcache.utils import CacheEngineKey

        return CacheEngineKey(ns.model_id, ns.tp_size, ns.tp_rank, int.from_bytes(key.digest, "big"),
                              _torch_dtype(ns.kv_dtype))  # fmt: skip

    # ------------------------------------------------------------------ writes

    def lookup(self, node: str, ns: Namespace, keys: Sequence[BlockKey]) -> int:
        self._node(node)
        if not keys:
            return 0
        hits, _ = self._sm.batched_contains([self._key(ns, k) for k in keys])
        return int(hits)

    def begin_write(self, node: str, ns: Namespace, key: BlockKey, parent: BlockKey | None) -> WriteGrant | Refused:
        self._node(node)
        lkey = self._key(ns, key)
        sent = time.monotonic_ns()
        if self._sm.contains(lkey) is not None:
            return Refused(REASON_NOT_ABSENT, "the chunk is cached")
        assert self._ctx is not None
        grant = WriteGrant(node=node, key=key, gen=NO_GENERATION, epoch=NO_EPOCH, lease=next(self._ids),
                           location=LOCATION, term_ms=self._ctx.lease_term_ms, requested_at_ns=sent)  # fmt: skip
        return self._writes.open(grant, lkey)

    def write_bytes(self, grant: WriteGrant, data: bytes) -> Stored | Refused:
        return self._writes.store(grant, data)

    def commit(self, grant: WriteGrant) -> Committed | Refused:
        import torch

        pending = self._writes.pending(grant)
        if isinstance(pending, Refused):
            return pending
        lkey, data = pending
        if not data:
            return Refused(REASON_NO_SPACE, "LMCache allocates no empty memory object")
        sm = self._sm
        obj = sm.allocate(_shape(len(data)), torch.uint8, eviction=True, busy_loop=False)
        if obj is None:
            return Refused(REASON_NO_SPACE, "LMCache's CPU tier has no room it can evict")
        obj.tensor.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        sm.batched_put([lkey], [obj])  # takes the allocation's reference
        self._writes.close(grant)
        with self._lock:
            self._committed.setdefault(grant.key, set()).add(lkey)
        return Committed(gen=NO_GENERATION, epoch=NO_EPOCH)

    def abort(self, grant: WriteGrant) -> None:
        self._writes.close(grant)

    # ------------------------------------------------------------------ reads

    def _grant(self, node: str, key: BlockKey, lkey: Any, lease: int | None) -> ReadGrant | Refused:
        self._node(node)
        sent = time.monotonic_ns()
        if self._sm.contains(lkey, pin=lease is None) is None:
            return Refused(REASON_NOT_COMMITTED if lease is None else REASON_NOT_FOUND, "the chunk is not cached")
        assert self._ctx is not None
        return ReadGrant(node=node, key=key, gen=NO_GENERATION, epoch=NO_EPOCH,
                         lease=next(self._ids) if lease is None else lease, location=LOCATION,
                         term_ms=self._ctx.lease_term_ms, requested_at_ns=sent)  # fmt: skip

    def acquire(self, node: str, ns: Namespace, key: BlockKey) -> ReadGrant | Refused:
        lkey = self._key(ns, key)
        grant = self._grant(node, key, lkey, None)
        if isinstance(grant, ReadGrant):
            with self._lock:
                self._reads[grant.lease] = lkey
        return grant

    def renew(self, grant: ReadGrant) -> ReadGrant | Refused:
        with self._lock:
            lkey = self._reads.get(grant.lease)
        if lkey is None:
            return Refused(REASON_UNKNOWN_LEASE, "no such lease in this reader")
        return self._grant(grant.node, grant.key, lkey, grant.lease)

    def read(self, grant: ReadGrant) -> bytes | Refused:
        with self._lock:
            lkey = self._reads.get(grant.lease)
        if lkey is None:
            return Refused(REASON_UNKNOWN_LEASE, "no such lease in this reader")
        self._node(grant.node)
        try:
            obj = self._sm.get(lkey)
        except KeyError as e:  # the disk file went away during the read
            return Refused(REASON_MISS, f"LMCache get raised KeyError({e})")
        if obj is None:
            return Refused(REASON_MISS, "LMCache get found nothing")
        try:
            return obj.tensor.numpy().tobytes()  # the object's shape is the block's: no padding
        finally:
            obj.ref_count_down()

    def release(self, grant: ReadGrant) -> None:
        with self._lock:
            lkey = self._reads.pop(grant.lease, None)
        if lkey is not None and self._engine is not None:
            self._sm.batched_unpin([lkey])

    # ------------------------------------------------------------------ invalidation, eviction

    def invalidate(self, node: str, ns: Namespace, scope: str, key: BlockKey | None) -> InvalidationTicket:
        if scope not in self.capabilities().scopes:
            raise NotSupported(f"invalidate:{scope}")
        self._node(node)
        if scope == "key":
            if key is None:
                raise ValueError("scope 'key' needs a key")
            keys = int(self._sm.remove(self._key(ns, key)) > 0)
        else:
            keys = int(self._sm.clear())  # one token a chunk: the chunks cleared
        return InvalidationTicket(id=next(self._ids), keys=keys)

    def wait_invalidation(self, ticket: InvalidationTicket, timeout_s: float) -> bool:
        return True  # remove and clear are synchronous

    def evict(self, node: str, ns: Namespace, key: BlockKey) -> Evicted | Refused:
        self._node(node)
        if self._sm.remove(self._key(ns, key)) == 0:
            return Refused(REASON_NOT_FOUND, "the chunk is not cached")
        return Evicted()

    # ------------------------------------------------------------------ faults

    def corrupt(self, node: str, key: BlockKey, region: str, offset: int) -> None:
        if region not in CORRUPT_REGIONS or offset < 0:
            raise ValueError(f"corrupt takes a region of {list(CORRUPT_REGIONS)} and an offset >= 0")
        self._node(node)
        sm = self._sm
        disk = sm.storage_backends.get(DISK_TIER)
        if disk is None:
            raise AdapterError("the engine has no disk tier")
        with self._lock:
            lkeys = list(self._committed.get(key, ()))
        for lkey in lkeys:
            deadline = time.monotonic() + DISK_SETTLE_S
            while sm.contains(lkey, [DISK_TIER]) is None and time.monotonic() < deadline:
                time.sleep(0.01)  # the background disk write of a fresh chunk
            if sm.contains(lkey, [DISK_TIER]) is None:
                continue
            path = disk._key_to_path(lkey)
            with open(path, "r+b") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    continue
                f.seek(offset % size)
                byte = f.read(1)[0]
                f.seek(offset % size)
                f.write(bytes([byte ^ 0xFF]))
            sm.remove(lkey, [CPU_TIER])  # the copy at rest is what the next read reaches

    def restart_directory(self) -> None:
        """LMCache's index of both tiers is in memory: a new engine on the same disk directory."""
        if self._engine is None:
            raise AdapterError("the LMCache engine is not running")
        self._teardown()
        try:
            self._build()
        except Exception as e:
            raise AdapterError(f"LMCache did not restart: {type(e).__name__}: {e}") from e


def factory() -> LMCacheRawAdapter:
    """LMCache's own storage engine (CPU and disk tiers) mapped onto the contract, nothing added."""
    return LMCacheRawAdapter()
