"""A SGLang HiCache storage backend (``HiCacheStorage``) that keeps pages in kvcc.

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvcc",
        "module_path": "kvcc.adapters.sglang.backend", "class_name": "KvccHiCacheStorage",
        "interface_v1": 1, "kvcc_directory": "127.0.0.1:7000", "kvcc_tenant": "engine",
        "kvcc_token_file": "/etc/kvcc/engine.token", "kvcc_model_revision": "<weights commit>"}'

SGLang's ``StorageBackendFactory`` imports ``module_path``, checks that ``class_name`` subclasses
``HiCacheStorage`` and calls ``KvccHiCacheStorage(storage_config, kwargs)``; the controller then
calls ``register_mem_pool_host(host_pool)``. ``interface_v1`` makes the controller use the
zero-copy calls (``batch_get_v1``/``batch_set_v1`` on host-pool indices) instead of
``batch_get``/``batch_set`` on tensors; both work.

Where the cluster is: every kvcc setting is an entry of the extra config (the
``--hicache-storage-backend-extra-config`` JSON, i.e. ``HiCacheStorageConfig.extra_config``),
prefixed ``kvcc_`` so as not to collide with SGLang's own entries:

- ``kvcc_directory`` (required): the directory's ``host:port``;
- ``kvcc_tenant`` (default ``engine``) and its token, ``kvcc_token_hex`` or ``kvcc_token_file``
  (a file holding the token in hex): one is required. The tenant must be allowed this backend's
  namespace (``storage_namespace``; one per TP/PP rank);
- ``kvcc_skew_ms`` (the deployment's epsilon, default 100), ``kvcc_timeout_ms`` (one kvcc
  request, default 10 s), ``kvcc_client_id`` (default ``sglang<pid>-tp<rank>``; no ``.``:
  ``<node>.<name>`` means a client co-located with a cache node), ``kvcc_clear_timeout_s``
  (default 60);
- what a test harness reads (``kvcc.adapters.sglang.conformance``, the ``engine`` profile):
  ``kvcc_events_dir`` (a folder where the client logs its protocol events, as
  ``<client id>.ndjson``), ``kvcc_status_file`` (a JSON file this backend replaces atomically
  after every call: its namespace digest, its counters, the calls under way) and
  ``kvcc_load_hold_ms`` (fault injection: a read holds its leases this long before it reads);
  ``kvcc_colocated_node`` (the cache node this server runs beside: its client is then
  ``<node>.<client id>``, part of that node, and the directory places its writes there);
- namespace inputs: ``kvcc_model_id`` (default SGLang's model name), ``kvcc_model_revision``
  (default ``unpinned``: set it to the weights' commit), ``kvcc_cache_salt`` (an operator's salt,
  text); ``kvcc_page_size``, ``kvcc_kv_dtype`` and ``kvcc_kv_layout``, which the registered host
  pool supplies (page size, dtype, layout) and which, when both are given, must agree with it.

Theory of operation
-------------------
**Keys.** SGLang names a page by a hex string: SHA-256 chained over the page's tokens and the
previous page's hash, the chain seeded by the request's extra key and cache salt
(``sglang.srt.mem_cache.utils.get_storage_hash_str``). SGLang folds the salt into the hash itself
and never passes it to the backend. The kvcc key of a page is
``SHA-256(canonical CBOR ["sglang-page", namespace digest, page key])``, so the same page hash
in two namespaces is two kvcc keys. The namespace (``kvcc.spec.keys.Namespace``) covers what
SGLang's page hash does not: model id and revision, KV dtype, page size (``block_tokens``), the
host pool's layout (it decides the byte order of a flat page), the TP rank and size (MLA pages are
the same on every TP rank: they share rank 0 of 1), the PP rank and size, the attention
context-parallel shard, and ``kvcc_cache_salt``.

Every page is a kvcc *root* (parent ``None``). kvcc makes a key's parent part of its identity (a
second parent for one key is refused, ``key_identity``), and SGLang tells the backend a page's
predecessor only with ``--hicache-storage-pass-prefix-keys`` (``extra_info.prefix_keys``); its page
hash already chains over the whole prefix, so nothing is lost for lookups. What is lost: a
``prefix`` invalidation does not cascade along a SGLang chain (``clear``, a namespace
invalidation, covers every page).

**Exists.** ``batch_exists`` is where a prefetch decides what to load
(SGLang 0.5.23's ``HybridCacheController`` asks once with every page hash of a prefetch, then
reads the pages counted in batches), so it takes the read leases: per page a lease (``Acquire``), a batch's in one round trip
(the client's ``acquire_many``); it answers the number of consecutive pages leased from the start,
releases any lease granted past the first miss, and keeps the others for the read. A page it
counted cannot then be evicted or replaced before the prefetch reads it; one invalidated in
between is revoked (the client acknowledges) and the read is a miss. A page whose lease this
backend still holds and trusts is counted without asking the directory again. A decision never
read (a prefetch SGLang terminated) leaves its leases to end at the holder's deadline.
``exists`` is a side-effect-free ``Lookup``.

**Reads** (``get``, ``batch_get``, ``batch_get_v1``): per page, the read lease ``batch_exists``
kept (a page decided on whose lease was lost since is a miss: recomputed, not leased again), or a
new one for a page no decision covers, the bytes read from the lease's location into a staging
buffer of the page's size, then the lease released once no other decision or read of this
backend needs it -- for a whole batch in one round trip each (the client's ``acquire_many``,
``read_many``: one request per node, ``release_many``). A refused acquire (not committed,
invalidating), a read refused because the lease was revoked or ran past the holder's budget
while the bytes were in flight (the client checks trust *after* they arrive), a short or long
page, an unreachable node or directory: a miss (``None``/``False``), never stale bytes. Only a
read that completed under trust is copied into SGLang's buffer (the target tensor, or the host
pool page via ``set_from_flat_data_page``).

**Writes** (``set``, ``batch_set``, ``batch_set_v1``): per page, ``begin_write`` (the write
lease), ``write_bytes`` (the node fences stale epochs), ``commit`` -- only once the node said the
bytes are stored; for a whole batch in three round trips (the client's ``put_many``: pages are
roots, so no page waits for another's commit). ``not_absent`` on a page that a lookup then finds
committed (pages are content-addressed, so it holds the same KV) counts as stored, as
``HiCacheFile`` counts an existing file: the first committed bytes stay; ``not_absent`` on a page
someone else is still writing is a failed save. Any other refusal is a failed save (``False``),
and the write is aborted.

**Clear** (``clear``): a ``namespace`` invalidation of this backend's namespace, waited for until
the directory completes it (every read lease revoked and acknowledged or expired); returns
``True`` then, ``False`` after ``kvcc_clear_timeout_s``.

**Threads.** SGLang calls the backend from its prefetch and backup threads at once. The kvcc client
runs on a private event loop thread; each call submits one coroutine there and waits for it. Two
threads reading the same page at once share the lease when it is already held here (the backend
counts the reads under way and releases after the last); while the first is still acquiring it,
the second's acquire is refused (one request per key and holder) and its read is a miss.

Limits: the v2 calls (``batch_exists_v2``/``batch_get_v2``/``batch_set_v2``: hybrid models' extra
pools), head-split TP (``tp_lcm_size``) and decode context parallelism (DCP) are not supported (the
constructor refuses the last two).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvcc.reference.client import KvccClient, ReadLease, Refused
from kvcc.reference.loop import loop_factory
from kvcc.reference.tiers.base import copy_into, sink_bytes, source_bytes
from kvcc.spec.keys import BlockKey, Namespace, cbor_encode
from kvcc.spec.vocabulary import REASON_MISS, REASON_NOT_ABSENT, SCOPE_NAMESPACE

__all__ = ["KvccHiCacheStorage", "KvccStorageMetrics", "page_key", "storage_namespace"]

log = logging.getLogger("kvcc.sglang")

SKEW_MS_DEFAULT = 100
CLIENT_TIMEOUT_MS_DEFAULT = 10_000  # one directory or node request; a slow kvcc is a miss, not a hang
CLEAR_TIMEOUT_S_DEFAULT = 60.0
CALL_TIMEOUT_S = 300.0  # one backend call (a batch of up to STORAGE_BATCH_SIZE pages) at most
MODEL_REVISION_DEFAULT = "unpinned"
PAGE_KEY_DOMAIN = "sglang-page"  # the first item of the CBOR a page's kvcc key hashes
PAGE_KEY_MAX_CHARS = 256  # SGLang's keys are 64 hex digits, v2 pools append ".<pool>"

assert CLIENT_TIMEOUT_MS_DEFAULT / 1000 * 8 < CALL_TIMEOUT_S  # a batch's round trips fit in one call


def _dtype_name(dtype: Any) -> str:
    text = str(dtype)
    return text.removeprefix("torch.")


def storage_namespace(
    storage_config: HiCacheStorageConfig,
    *,
    page_size: int,
    kv_dtype: str,
    kv_layout: str,
    model_id: str | None = None,
    model_revision: str = MODEL_REVISION_DEFAULT,
    cache_salt: str = "",
) -> Namespace:
    """The kvcc namespace of one SGLang storage rank: what a page's bytes depend on beyond its
    tokens. ``kv_layout`` is the host pool's layout (``layer_first``, ``page_first``, ...)."""
    model = model_id or storage_config.model_name
    if not model:
        raise ValueError("a kvcc namespace needs a model: SGLang passed no model name and kvcc_model_id is unset")
    layout = f"sglang:{kv_layout}"
    tp_rank, tp_size = storage_config.tp_rank, storage_config.tp_size
    if storage_config.is_mla_model:
        # MLA KV is replicated across TP ranks (SGLang shares one file per page too).
        layout += ":mla"
        tp_rank, tp_size = 0, 1
    if storage_config.attn_cp_size > 1:
        # Each attention-CP rank holds a disjoint slice of every page.
        layout += f":cp{storage_config.attn_cp_rank}of{storage_config.attn_cp_size}"
    return Namespace(model_id=model, model_revision=model_revision, kv_dtype=kv_dtype, block_tokens=page_size,
                     kv_layout=layout, tp_rank=tp_rank, tp_size=tp_size, pp_rank=storage_config.pp_rank,
                     pp_size=storage_config.pp_size, cache_salt=cache_salt.encode())  # fmt: skip


def page_key(namespace_digest: bytes, key: str) -> BlockKey:
    """The kvcc key of SGLang page ``key`` in the namespace with this digest."""
    if not isinstance(key, str) or not 0 < len(key) <= PAGE_KEY_MAX_CHARS:
        raise ValueError(f"a SGLang page key is a string of 1..{PAGE_KEY_MAX_CHARS} characters, got {key!r:.80}")
    assert len(namespace_digest) == 32
    return BlockKey(hashlib.sha256(cbor_encode([PAGE_KEY_DOMAIN, namespace_digest, key])).digest())


@dataclass
class KvccStorageMetrics:
    """What ``get_stats`` returns: the fields SGLang's ``StorageMetrics`` has (pages and GB/s per
    prefetch and backup call since the last ``get_stats``), plus kvcc's counters since the start."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)
    kvcc: dict[str, int] = field(default_factory=dict)


class _LoopThread:
    """An event loop on a daemon thread; ``run(coro)`` from any other thread."""

    def __init__(self) -> None:
        self.loop = loop_factory()()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kvcc-sglang", daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        assert threading.current_thread() is not self.thread, "a blocking call on the loop's own thread"
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()


def _token(extra: dict) -> bytes:
    if extra.get("kvcc_token_hex"):
        return bytes.fromhex(str(extra["kvcc_token_hex"]))
    if extra.get("kvcc_token_file"):
        return bytes.fromhex(Path(extra["kvcc_token_file"]).read_text().strip())
    raise ValueError("the kvcc backend needs kvcc_token_hex or kvcc_token_file in the extra config")


def _address(text: Any) -> tuple[str, int]:
    if not isinstance(text, str) or ":" not in text:
        raise ValueError(f"kvcc_directory must be 'host:port', got {text!r}")
    host, port = text.rsplit(":", 1)
    return host, int(port)


# Past this many pages with a prefetch decision pending, forget those whose lease ran out: a
# decision SGLang never reads (a terminated prefetch) would otherwise be remembered for ever.
DECIDED_SWEEP_AT = 4096

class KvccHiCacheStorage(HiCacheStorage):
    """``KvccHiCacheStorage(storage_config, kwargs=None)``: SGLang's dynamic factory passes its
    keyword arguments as one dict. See the module docstring for the extra config."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        extra = dict(storage_config.extra_config or {})
        if storage_config.should_split_heads:
            raise NotImplementedError("the kvcc backend does not split heads across TP sizes (tp_lcm_size)")
        if storage_config.dcp_size > 1:
            raise NotImplementedError("the kvcc backend does not support decode context parallelism")
        self.storage_config = storage_config
        self.mem_pool_host: Any = None
        self._model_id = extra.get("kvcc_model_id") or storage_config.model_name
        self._model_revision = str(extra.get("kvcc_model_revision") or MODEL_REVISION_DEFAULT)
        self._cache_salt = str(extra.get("kvcc_cache_salt") or "")
        self._page_size = int(extra["kvcc_page_size"]) if extra.get("kvcc_page_size") else None
        self._kv_dtype = str(extra["kvcc_kv_dtype"]) if extra.get("kvcc_kv_dtype") else None
        self._kv_layout = str(extra.get("kvcc_kv_layout") or "") or None
        self._page_bytes: int | None = None  # a flat page's size, once a host pool says it
        self._clear_timeout_s = float(extra.get("kvcc_clear_timeout_s") or CLEAR_TIMEOUT_S_DEFAULT)
        self.namespace: Namespace | None = None
        self._ns_digest: bytes | None = None
        if self._page_size and self._kv_dtype and self._kv_layout:
            self._set_namespace()
        self.counts: dict[str, int] = {}
        # Read leases kept between a prefetch's decision and its read (``batch_exists`` ..
        # ``batch_get``): per page, the decisions not yet read and the reads under way. Touched
        # only on the client's loop thread.
        self._decided: dict[BlockKey, int] = {}
        self._reading: dict[BlockKey, int] = {}
        self._metrics = KvccStorageMetrics()
        self._metrics_lock = threading.Lock()
        client_id = str(extra.get("kvcc_client_id") or f"sglang{os.getpid()}-tp{storage_config.tp_rank}")
        if "." in client_id:
            raise ValueError(f"kvcc_client_id {client_id!r} has a '.': that names a client co-located with a node")
        if extra.get("kvcc_colocated_node"):  # the server runs beside that cache node: its client is part of it
            client_id = f"{extra['kvcc_colocated_node']}.{client_id}"
        self.client_id = client_id
        self._load_hold_s = float(extra.get("kvcc_load_hold_ms") or 0) / 1000
        self._status_file = Path(extra["kvcc_status_file"]) if extra.get("kvcc_status_file") else None
        self._calls = 0  # backend calls under way (the status file's ``busy``)
        events = None
        if extra.get("kvcc_events_dir"):
            from kvcc.reference.events import EventLog

            events = EventLog(Path(extra["kvcc_events_dir"]) / f"{client_id}.ndjson", client_id, 1)
        self._loop = _LoopThread()
        try:
            self.client = self._loop.run(self._connect(
                _address(extra.get("kvcc_directory")), str(extra.get("kvcc_tenant") or "engine"), _token(extra),
                client_id, int(extra.get("kvcc_skew_ms") or SKEW_MS_DEFAULT),
                int(extra.get("kvcc_timeout_ms") or CLIENT_TIMEOUT_MS_DEFAULT), events))  # fmt: skip
        except BaseException:
            self._loop.close()
            raise
        self._publish()

    @staticmethod
    async def _connect(directory, tenant, token, client_id, skew_ms, timeout_ms, events=None) -> KvccClient:
        return await KvccClient(directory, tenant, token, client_id=client_id, skew_ms=skew_ms,
                                timeout_ms=timeout_ms, events=events).start()  # fmt: skip

    def _run(self, coro: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        """``coro`` on the client's loop, counted as a call under way in the status file."""
        with self._metrics_lock:
            self._calls += 1
        self._publish()
        try:
            return self._loop.run(coro, timeout_s)
        finally:
            with self._metrics_lock:
                self._calls -= 1
            self._publish()

    def _publish(self) -> None:
        """Replace the status file (``kvcc_status_file``), if one is configured."""
        if self._status_file is None:
            return
        with self._metrics_lock:
            status = {"client_id": self.client_id, "busy": self._calls, "counts": dict(self.counts),
                      "namespace": None if self._ns_digest is None else self._ns_digest.hex()}  # fmt: skip
            tmp = self._status_file.with_name(f".{self._status_file.name}.{threading.get_ident()}")
            tmp.write_text(json.dumps(status))
            os.replace(tmp, self._status_file)

    def close(self) -> None:
        try:
            self._loop.run(self.client.close(), 10)
        finally:
            self._loop.close()

    # ------------------------------------------------------------------ namespace and keys

    def _set_namespace(self) -> None:
        assert self._page_size and self._kv_dtype and self._kv_layout
        self.namespace = storage_namespace(self.storage_config, page_size=self._page_size, kv_dtype=self._kv_dtype,
                                           kv_layout=self._kv_layout, model_id=self._model_id,
                                           model_revision=self._model_revision, cache_salt=self._cache_salt)  # fmt: skip
        self._ns_digest = self.namespace.digest()

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The host pool fixes the page size, KV dtype and layout: the namespace follows from them.
        Values the extra config gave must agree (a mismatch would file pages under the wrong name)."""
        super().register_mem_pool_host(mem_pool_host)
        pool = {"page size": int(mem_pool_host.page_size), "KV dtype": _dtype_name(mem_pool_host.dtype),
                "layout": str(mem_pool_host.layout)}  # fmt: skip
        given = {"page size": self._page_size, "KV dtype": self._kv_dtype, "layout": self._kv_layout}
        for what, value in given.items():
            if value is not None and value != pool[what]:
                raise ValueError(f"the extra config says {what} {value!r}, the host pool {pool[what]!r}")
        self._page_size, self._kv_dtype, self._kv_layout = pool["page size"], pool["KV dtype"], pool["layout"]
        page = mem_pool_host.get_dummy_flat_data_page()
        self._page_bytes = page.numel() * page.element_size()
        self._set_namespace()
        self._publish()

    def _digest(self) -> bytes:
        if self._ns_digest is None:
            raise RuntimeError("the kvcc namespace needs the page size, KV dtype and layout: register a host pool "
                               "or set kvcc_page_size, kvcc_kv_dtype and kvcc_kv_layout")  # fmt: skip
        return self._ns_digest

    def kvcc_key(self, key: str) -> BlockKey:
        return page_key(self._digest(), key)

    def _count(self, what: str, n: int = 1) -> None:
        with self._metrics_lock:
            self.counts[what] = self.counts.get(what, 0) + n

    # ------------------------------------------------------------------ exists

    def _kept(self, key: BlockKey) -> ReadLease | None:
        """The read lease this backend holds and still trusts on ``key``, or ``None`` (then no
        prefetch decision on it is pending any more: an expired or revoked lease protects nothing)."""
        lease = self.client.lease_of(key)
        if lease is not None and self.client.trusted(lease):
            return lease
        self._decided.pop(key, None)
        return None

    async def _lease(self, keys: list[BlockKey]) -> dict[BlockKey, ReadLease | Refused]:
        """A trusted read lease on each of ``keys`` (distinct): the one this backend keeps, else a
        new one, all new ones in one round trip (``acquire_many``); a ``Refused`` where none."""
        out: dict[BlockKey, ReadLease | Refused] = {}
        ask = []
        for k in keys:
            lease = self._kept(k)
            if lease is None:
                ask.append(k)
            else:
                out[k] = lease
        if ask:
            try:
                answers = await self.client.acquire_many(self._digest(), ask)
            except Exception as e:  # the directory unreachable: nothing leased
                log.warning("kvcc acquire failed: %s", e)
                answers = [Refused("unreachable")] * len(ask)
            out.update(zip(ask, answers))
        return out

    def _claim(self, keys: list[BlockKey], by: int = 1) -> None:
        """Count (or, ``by=-1``, uncount) a call of this backend using the leases of ``keys``."""
        for k in keys:
            n = self._reading.get(k, 0) + by
            if n:
                self._reading[k] = n
            else:
                del self._reading[k]

    async def _release_unless_kept(self, keys: list[BlockKey]) -> None:
        """Release the leases on ``keys`` that no pending decision or read still needs."""
        done = []
        for k in keys:
            if self._reading.get(k) or self._decided.get(k):
                continue
            self._decided.pop(k, None)
            lease = self.client.lease_of(k)
            if lease is not None:
                done.append(lease)
        if done:
            try:
                await self.client.release_many(done)
            except Exception as e:  # the leases then end by expiry
                log.info("kvcc release failed: %s", e)

    async def _lease_prefix(self, keys: list[BlockKey]) -> int:
        """The number of consecutive committed pages from the start of ``keys``, each now under a
        read lease this backend keeps for the read that follows (see ``batch_exists``); leases
        granted past the first miss are released at once."""
        if len(self._decided) > DECIDED_SWEEP_AT:
            for k in list(self._decided):  # decisions never read (terminated prefetches) whose leases ran out
                self._kept(k)
        unique = list(dict.fromkeys(keys))
        self._claim(unique)  # while leasing: no other call of this backend releases these keys' leases
        try:
            leases = await self._lease(unique)
        finally:
            self._claim(unique, -1)
        n = 0
        for k in keys:
            if isinstance(leases[k], Refused):
                self._count(f"exists_miss_{leases[k].reason}")
                break
            n += 1
        counted = set(keys[:n])
        for k in counted:
            self._decided[k] = self._decided.get(k, 0) + 1
        await self._release_unless_kept([k for k, lease in leases.items() if k not in counted and not isinstance(lease, Refused)])
        return n

    async def _exists(self, keys: list[BlockKey]) -> list[bool]:
        """Whether each page is committed: one ``Lookup`` per page (a page is a root), all in one
        round trip (``lookup_many``)."""
        try:
            hits = await self.client.lookup_many(self._digest(), [[k] for k in keys])
        except Exception as e:  # the directory unreachable: nothing is known to exist
            log.warning("kvcc lookup failed: %s", e)
            self._count("lookup_failed")
            return [False] * len(keys)
        return [hit.blocks == 1 for hit in hits]

    def exists(self, key: str) -> bool:
        return self._run(self._exists([self.kvcc_key(key)]))[0]

    def batch_exists(self, keys: list[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """The number of consecutive committed pages from the start of ``keys``, each leased until
        it is read (SGLang's cache controller decides with this what its prefetch loads): a page counted here cannot be evicted or replaced before the read, and a page
        invalidated in between is revoked and then a miss."""
        if not keys:
            return 0
        return self._run(self._lease_prefix([self.kvcc_key(k) for k in keys]))

    # ------------------------------------------------------------------ reads

    async def _read_many(self, keys: list[BlockKey], nbytes: list[int | None]) -> list[bytes | bytearray | None]:
        """Each page's committed bytes, read under a read lease, or ``None`` (a miss), in one
        round trip each to lease (``acquire_many``), read (``read_many``: one per node) and
        release (``release_many``) the batch's pages."""
        # One holder has one request per key at a time: a key twice in a batch is read once.
        first: dict[BlockKey, int] = {}
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        unique = list(first)
        c = self.client
        by_key: dict[BlockKey, bytes | bytearray | None] = dict.fromkeys(unique)
        # A page a prefetch decided on (batch_exists) whose lease was lost since -- expired or
        # revoked before the read -- is a miss, recomputed: never leased again behind SGLang's back.
        lost = {k for k in unique if self._decided.get(k) and self._kept(k) is None}
        self._claim(unique)  # until read: no other call of this backend releases these keys' leases
        granted = []
        try:
            leases = await self._lease([k for k in unique if k not in lost])
            leases.update((k, Refused("lease_lost", "the lease its prefetch decision took ended before the read")) for k in lost)
            for k in unique:
                lease = leases[k]
                if isinstance(lease, Refused):
                    self._count(f"read_refused_{lease.reason}")
                else:
                    granted.append((k, lease))
            sizes = [nbytes[first[k]] for k, _ in granted]
            if self._load_hold_s and granted:
                await asyncio.sleep(self._load_hold_s)  # fault injection: a slow read (kvcc_load_hold_ms)
            outs = [None if n is None else bytearray(n) for n in sizes]
            try:
                got = await c.read_many([lease for _, lease in granted], outs)
            except Exception as e:
                log.warning("kvcc read failed: %s", e)
                got = [Refused("unreachable")] * len(granted)
        finally:
            self._claim(unique, -1)
            for k, _ in granted:  # read: one decision taken on the page is served
                if self._decided.get(k):
                    self._decided[k] -= 1
            await self._release_unless_kept(unique)
        for (k, _), n, out, answer in zip(granted, sizes, outs, got):
            if isinstance(answer, Refused) and answer.reason == REASON_MISS and "buffer" in answer.detail:
                answer = Refused("wrong_size")  # longer than the page
            elif not isinstance(answer, Refused) and n is not None and answer != n:
                answer = Refused("wrong_size")  # shorter
            if isinstance(answer, Refused):
                # Revoked or expired before the bytes were here, a miss at the node, a wrong size:
                # nothing reaches SGLang's buffers.
                self._count(f"read_refused_{answer.reason}")
                continue
            self._count("read_hits")
            by_key[k] = answer if out is None else out
        # A repeated key with another target size than its first occurrence is a miss there.
        return [d if (d := by_key[k]) is None or nbytes[i] in (None, len(d)) else None for i, k in enumerate(keys)]

    @staticmethod
    def _into(target: torch.Tensor, data: bytes | bytearray) -> torch.Tensor:
        dst = target.view(-1).view(torch.uint8)  # a flat page; view() fails on a non-contiguous one
        copy_into(sink_bytes(dst), data, len(data))
        return target

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:  # fmt: skip
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> list[torch.Tensor | None]:  # fmt: skip
        """Per page, the target tensor filled with the page's bytes (a new ``uint8`` tensor when no
        target is given), or ``None``: a miss, and the target is untouched."""
        if not keys:
            return []
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        assert len(targets) == len(keys)
        sizes = [None if t is None else t.numel() * t.element_size() for t in targets]
        start = time.perf_counter()
        datas = self._run(self._read_many([self.kvcc_key(k) for k in keys], sizes))
        out: list[torch.Tensor | None] = []
        for t, d in zip(targets, datas):
            if d is None:
                out.append(None)
            elif t is None:
                out.append(torch.frombuffer(bytearray(d), dtype=torch.uint8))
            else:
                out.append(self._into(t, d))
        self._note("prefetch", sum(d is not None for d in datas), sum(len(d) for d in datas if d is not None), start)
        return out

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> list[bool]:  # fmt: skip
        """Read each page straight into the registered host pool at ``host_indices[i * page_size]``."""
        pool = self._pool()
        if not keys:
            return []
        assert host_indices.numel() == len(keys) * self._page_size, "one page of host indices per key"
        start = time.perf_counter()
        datas = self._run(self._read_many([self.kvcc_key(k) for k in keys], [self._page_bytes] * len(keys)))
        ok = []
        for i, d in enumerate(datas):
            if d is not None:
                page = torch.frombuffer(d, dtype=torch.uint8).view(pool.dtype)
                pool.set_from_flat_data_page(int(host_indices[i * self._page_size]), page)
            ok.append(d is not None)
        self._note("prefetch", sum(ok), sum(ok) * self._page_bytes, start)
        return ok

    # ------------------------------------------------------------------ writes

    async def _write_many(self, keys: list[BlockKey], datas: list[bytes]) -> list[bool]:
        """Each page stored and committed (``True``) or not, in three round trips for the batch
        (``put_many``: pages are roots, written once)."""
        first: dict[BlockKey, int] = {}
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        c = self.client
        try:
            out = await c.put_many(self._digest(), [(k, None, datas[i]) for k, i in first.items()])
        except Exception as e:
            log.warning("kvcc write failed: %s", e)
            self._count("write_failed", len(first))
            return [False] * len(keys)
        done: dict[BlockKey, bool] = {}
        for k, result in zip(first, out):
            if not isinstance(result, Refused):
                self._count("write_committed")
                done[k] = True
            elif result.reason == REASON_NOT_ABSENT and (await self._exists([k]))[0]:
                # Committed already: a page key names its tokens' KV, so those are the same bytes.
                self._count("write_already_committed")
                done[k] = True
            else:
                # Someone else's write of the page is under way (or it is being invalidated), or
                # the node refused the bytes: not stored by this call.
                self._count(f"write_refused_{result.reason}")
                done[k] = False
        return [done[k] for k in keys]

    def _page_bytes_of(self, value: torch.Tensor) -> bytes:
        data = bytes(source_bytes(value.detach().contiguous().view(-1).view(torch.uint8)))
        if self._page_bytes is not None and len(data) != self._page_bytes:
            raise ValueError(f"a page of {len(data)} bytes; this host pool's pages have {self._page_bytes}")
        return data

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:  # fmt: skip
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:  # fmt: skip
        """Whether every page is committed in kvcc (or was already)."""
        if not keys:
            return True
        assert values is not None and len(values) == len(keys)
        datas = [self._page_bytes_of(v) for v in values]
        start = time.perf_counter()
        ok = self._run(self._write_many([self.kvcc_key(k) for k in keys], datas))
        self._note("backup", sum(ok), sum(len(d) for d, o in zip(datas, ok) if o), start)
        return all(ok)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> list[bool]:  # fmt: skip
        """Write each page from the registered host pool at ``host_indices[i * page_size]``."""
        pool = self._pool()
        if not keys:
            return []
        assert host_indices.numel() == len(keys) * self._page_size, "one page of host indices per key"
        datas = [self._page_bytes_of(pool.get_data_page(int(host_indices[i * self._page_size]), flat=True))
                 for i in range(len(keys))]  # fmt: skip
        start = time.perf_counter()
        ok = self._run(self._write_many([self.kvcc_key(k) for k in keys], datas))
        self._note("backup", sum(ok), sum(ok) * self._page_bytes, start)
        return ok

    def _pool(self) -> Any:
        pool = self.mem_pool_host
        if pool is None:
            raise RuntimeError("batch_get_v1/batch_set_v1 need a host pool: register_mem_pool_host first")
        return pool

    # ------------------------------------------------------------------ clear and stats

    async def _clear(self) -> bool:
        ticket = await self.client.invalidate(self._digest(), SCOPE_NAMESPACE)
        return await self.client.wait(ticket, self._clear_timeout_s)

    def clear(self) -> bool:
        """Invalidate every page of this namespace; ``True`` once the invalidation completed (no
        read lease on any of them is trusted anywhere), ``False`` if it did not in time."""
        done = self._run(self._clear(), self._clear_timeout_s + CALL_TIMEOUT_S)
        self._count("clears_completed" if done else "clears_timed_out")
        if not done:
            log.error("kvcc: the namespace invalidation did not complete within %.0f s", self._clear_timeout_s)
        return done

    def _note(self, kind: str, pages: int, nbytes: int, start: float) -> None:
        elapsed = max(time.perf_counter() - start, 1e-9)
        with self._metrics_lock:
            getattr(self._metrics, f"{kind}_pgs").append(pages)
            getattr(self._metrics, f"{kind}_bandwidth").append(nbytes / elapsed / 1e9)

    def get_stats(self) -> KvccStorageMetrics:
        """Per-call pages and GB/s since the last call (SGLang's ``StorageMetrics`` fields), and
        kvcc's counters since the start (``kvcc``: hits, refusals by reason, commits, clears)."""
        with self._metrics_lock:
            out, self._metrics = self._metrics, KvccStorageMetrics()
            out.kvcc = dict(self.counts)
        return out
