"""``hicache-file``: SGLang's own ``HiCacheFile`` storage backend, unmodified, mapped onto the adapter
contract, and nothing more.

Theory of operation
-------------------
Like ``mooncake-raw`` for Mooncake Store (``kvcc.adapters.mooncake.raw``), this adapter adds no
protocol: each contract operation is the ``HiCacheFile`` call that comes closest, made by the named
node's backend, and its answer is translated, not corrected. What the suite then finds is what
SGLang's file backend provides on its own; the ``sglang`` adapter (``kvcc.adapters.sglang.conformance``)
is SGLang with kvcc's backend, and the two reports side by side show what kvcc adds.

The deployment: one shared directory (``workdir/hicache``, a shared file system as SGLang's L3)
and, per contract node and namespace, a ``HiCacheFile`` made by SGLang's ``StorageBackendFactory``
(backend ``file``), in this process. A namespace becomes what ``HiCacheFile`` keys files by: the
storage config's model name (``model_id``), TP and PP rank and size; the rest of the namespace
(revision, KV dtype, page size, layout, LoRA adapter, cache salt) does not reach its file names.
A page is the file ``<key hex><config suffix>.bin``. The mapping:

- ``lookup``: ``batch_exists`` on the chain's page keys (per page, no chain: every page is a root).
  No tenants: every namespace is visible to everyone.
- ``begin_write``: ``exists`` -- refused ``not_absent`` if the page exists. The grant is the
  adapter's own (a local lease id): the file backend has no write leases, generations or epochs
  (``gen = 0``, ``epoch = 0``) and no prefix chains (the parent is not checked).
- ``write_bytes``: the bytes wait in the writer; ``commit`` is ``set`` (write a temporary file,
  rename it into place). ``set`` of an existing page answers ``True`` and keeps the first file.
  ``Committed(gen=0, epoch=0)``; ``set`` answering ``False`` is ``Refused("store_error")``.
- ``abort``: the writer drops the buffered bytes.
- ``acquire`` / ``renew``: ``exists``; the grant is advisory (the store has no leases: nothing
  stops a delete under it). ``read``: ``get`` into a buffer of the page file's size (SGLang always
  knows its page size; the suite's blocks vary, so the file's size stands in for it); a missing
  file or a short read is ``Refused("miss")``. ``release``: nothing.
- ``invalidate``: ``clear``, whatever the scope -- the file backend's only removal, which deletes
  every page file of the directory, every namespace's. It has no per-page delete, so a ``key`` or
  ``prefix`` invalidation is a ``clear`` too (the closest call: it does cover the key); holders
  are not told anything. ``wait_invalidation``: ``clear`` is synchronous.
- ``evict``: not supported (the file backend evicts on its own, by LRU, when its disk budget is
  exceeded; it has no call to drop one page).
- faults: none (no processes). Events: ``inferred`` -- the file backend logs no protocol events.
"""

from __future__ import annotations

import itertools
import os
import platform
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvcc.adapters.buffered import BufferedWrites
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
from kvcc.spec.vocabulary import REASON_MISS, REASON_NOT_ABSENT, REASON_NOT_COMMITTED, REASON_NOT_FOUND, REASON_UNKNOWN_LEASE

LOCATION = "file"
NO_GENERATION = 0  # the file backend has none
NO_EPOCH = 0  # the file backend has none


class HiCacheFileAdapter(Adapter):
    """SGLang's ``HiCacheFile`` under the contract; see the module docstring."""

    name = "hicache-file"

    def __init__(self) -> None:
        self._ctx: RunContext | None = None
        self._dir: str | None = None
        self._nodes: tuple[str, ...] = ()
        self._backends: dict[tuple[str, bytes], Any] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._writes: BufferedWrites[Namespace] = BufferedWrites()  # the grant's namespace, and its bytes
        self._reads: dict[int, Namespace] = {}

    def capabilities(self) -> Capabilities:
        return Capabilities(
            profiles=frozenset({"core", "leases", "invalidation"}),
            faults=frozenset(),
            scopes=frozenset({"key", "prefix", "namespace"}),
            events="inferred",
            leases="advisory",
            notes="SGLang's own HiCacheFile storage backend, nothing added: set is the commit (first file wins), "
            "exists the lookup and the (advisory) lease, get the read, clear (every page file of the directory) "
            "the only invalidation, of any scope; no leases, generations, epochs, fencing, prefix chains, tenants, per-page "
            "delete or eviction call in the store",
        )

    def versions(self) -> Mapping[str, str]:
        from importlib.metadata import version

        return {"kvcc": version("kvcc"), "sglang": version("sglang"), "python": platform.python_version()}

    # ------------------------------------------------------------------ lifecycle

    def start(self, ctx: RunContext) -> None:
        self._ctx = ctx
        self._dir = str(ctx.workdir / "hicache")
        os.makedirs(self._dir, exist_ok=True)
        if os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"):  # HiCacheFile would use it over ours
            raise AdapterError("unset SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR: HiCacheFile would store there")
        self._nodes = tuple(f"n{i}" for i in range(1, ctx.nodes + 1))
        try:
            for node in self._nodes:
                for ns in ctx.namespaces:
                    self._backend(node, ns)
        except Exception as e:
            self.stop()
            raise AdapterError(f"HiCacheFile did not come up: {type(e).__name__}: {e}") from e

    def stop(self) -> None:
        self._backends.clear()
        self._nodes = ()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def nodes(self) -> Sequence[str]:
        return list(self._nodes)

    def events(self) -> list[dict] | None:
        return None

    def _node(self, node: str) -> None:
        if node not in self._nodes:
            raise AdapterError(f"no node {node!r}")

    def _backend(self, node: str, ns: Namespace) -> Any:
        """Node ``node``'s ``HiCacheFile`` for ``ns``, made by SGLang's factory on first use."""
        self._node(node)
        with self._lock:
            b = self._backends.get((node, ns.digest()))
            if b is None:
                from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
                from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

                config = HiCacheStorageConfig(
                    tp_rank=ns.tp_rank, tp_size=ns.tp_size, pp_rank=ns.pp_rank, pp_size=ns.pp_size, attn_cp_rank=0,
                    attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                    model_name=ns.model_id, extra_config={"file_storage_path": self._dir},
                )  # fmt: skip
                b = self._backends[(node, ns.digest())] = StorageBackendFactory.create_backend("file", config, None)
            return b

    @staticmethod
    def _page(key: BlockKey) -> str:
        return key.hex

    def _path(self, b: Any, key: BlockKey) -> str:
        return os.path.join(b.file_path, f"{self._page(key)}{b.config_suffix}.bin")

    # ------------------------------------------------------------------ writes

    def lookup(self, node: str, ns: Namespace, keys: Sequence[BlockKey]) -> int:
        if not keys:
            return 0
        return int(self._backend(node, ns).batch_exists([self._page(k) for k in keys]))

    def begin_write(self, node: str, ns: Namespace, key: BlockKey, parent: BlockKey | None) -> WriteGrant | Refused:
        b = self._backend(node, ns)
        sent = time.monotonic_ns()
        if b.exists(self._page(key)):
            return Refused(REASON_NOT_ABSENT, "the page file exists")
        assert self._ctx is not None
        grant = WriteGrant(node=node, key=key, gen=NO_GENERATION, epoch=NO_EPOCH, lease=next(self._ids),
                           location=LOCATION, term_ms=self._ctx.lease_term_ms, requested_at_ns=sent)  # fmt: skip
        return self._writes.open(grant, ns)

    def write_bytes(self, grant: WriteGrant, data: bytes) -> Stored | Refused:
        return self._writes.store(grant, data)

    def commit(self, grant: WriteGrant) -> Committed | Refused:
        import torch

        pending = self._writes.pending(grant)
        if isinstance(pending, Refused):
            return pending
        ns, data = pending
        value = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        if not self._backend(grant.node, ns).set(self._page(grant.key), value):
            return Refused("store_error", "HiCacheFile.set returned False")
        self._writes.close(grant)
        return Committed(gen=NO_GENERATION, epoch=NO_EPOCH)

    def abort(self, grant: WriteGrant) -> None:
        self._writes.close(grant)

    # ------------------------------------------------------------------ reads

    def _grant(self, node: str, ns: Namespace, key: BlockKey, lease: int | None) -> ReadGrant | Refused:
        sent = time.monotonic_ns()
        if not self._backend(node, ns).exists(self._page(key)):
            return Refused(REASON_NOT_COMMITTED if lease is None else REASON_NOT_FOUND, "no such page file")
        assert self._ctx is not None
        return ReadGrant(node=node, key=key, gen=NO_GENERATION, epoch=NO_EPOCH,
                         lease=next(self._ids) if lease is None else lease, location=LOCATION,
                         term_ms=self._ctx.lease_term_ms, requested_at_ns=sent)  # fmt: skip

    def acquire(self, node: str, ns: Namespace, key: BlockKey) -> ReadGrant | Refused:
        grant = self._grant(node, ns, key, None)
        if isinstance(grant, ReadGrant):
            with self._lock:
                self._reads[grant.lease] = ns
        return grant

    def renew(self, grant: ReadGrant) -> ReadGrant | Refused:
        with self._lock:
            ns = self._reads.get(grant.lease)
        if ns is None:
            return Refused(REASON_UNKNOWN_LEASE, "no such lease in this reader")
        return self._grant(grant.node, ns, grant.key, grant.lease)

    def read(self, grant: ReadGrant) -> bytes | Refused:
        import torch

        with self._lock:
            ns = self._reads.get(grant.lease)
        if ns is None:
            return Refused(REASON_UNKNOWN_LEASE, "no such lease in this reader")
        b = self._backend(grant.node, ns)
        try:
            size = os.path.getsize(self._path(b, grant.key))
        except FileNotFoundError:
            return Refused(REASON_MISS, "no page file")
        target = torch.empty(size, dtype=torch.uint8)
        try:
            got = b.get(self._page(grant.key), target)
        except OSError as e:  # HiCacheFile raises on a short read (a file replaced under it)
            return Refused(REASON_MISS, f"HiCacheFile.get: {e}")
        if got is None:
            return Refused(REASON_MISS, "HiCacheFile.get missed")
        return got.numpy().tobytes()

    def release(self, grant: ReadGrant) -> None:
        with self._lock:
            self._reads.pop(grant.lease, None)

    # ------------------------------------------------------------------ invalidation, eviction

    def invalidate(self, node: str, ns: Namespace, scope: str, key: BlockKey | None) -> InvalidationTicket:
        if scope not in self.capabilities().scopes:
            raise NotSupported(f"invalidate:{scope}")
        b = self._backend(node, ns)
        if scope == "namespace":
            suffix = f"{b.config_suffix}.bin"
            try:
                keys = sum(1 for f in os.listdir(b.file_path) if f.endswith(suffix))
            except FileNotFoundError:
                keys = 0
        else:  # what the store can say of the subtree: whether the root page exists
            keys = int(key is not None and b.exists(self._page(key)))
        if not b.clear():
            raise AdapterError("HiCacheFile.clear returned False")
        return InvalidationTicket(id=next(self._ids), keys=keys)

    def wait_invalidation(self, ticket: InvalidationTicket, timeout_s: float) -> bool:
        return True  # clear() is synchronous

    def evict(self, node: str, ns: Namespace, key: BlockKey) -> Evicted | Refused:
        raise NotSupported("evict")


def factory() -> HiCacheFileAdapter:
    """SGLang's own HiCacheFile storage backend mapped onto the contract, nothing added."""
    return HiCacheFileAdapter()
