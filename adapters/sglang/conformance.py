"""``sglang``: kvcc's SGLang HiCache storage backend (``KvccHiCacheStorage``) under the conformance
contract, on a real kvcc cluster.

Theory of operation
-------------------
``start`` brings up the reference deployment exactly as the ``reference`` adapter does
(``kvcc.adapters.reference``: a ``LocalCluster`` of real processes -- a directory on its SQLite
log and ``ctx.nodes`` cache nodes -- and, per contract node ``n``, a client co-located with it,
``"<n>.engine"``, logging its protocol events). Then, for every node and every namespace of
``ctx.namespaces``, it builds a ``KvccHiCacheStorage`` through SGLang's own
``StorageBackendFactory.create_backend("dynamic", ...)`` (as SGLang's ``HiCacheController`` does).
The backend is SGLang's code path; three things are set on it by this adapter, because the
contract, not SGLang, names keys, namespaces and the holder:

- its kvcc client is the node's co-located client (the backend's own connection, made by its
  constructor, is closed): whatever the backend does is done by node ``n``'s holder, in ``n``'s
  event log, on that client's event loop;
- its namespace is the contract's namespace (SGLang derives one from its storage config and host
  pool; the suite's namespaces are arbitrary);
- its page key naming is the identity: the SGLang page key of contract key ``k`` is ``k.hex`` and
  names kvcc key ``k`` (the backend's ``page_key`` hashes the page key into the namespace: the
  contract's keys are already kvcc keys, with parents).

Which contract operations go through SGLang's calls, and which through the kvcc client
----------------------------------------------------------------------------------------
Through the backend, the way SGLang's cache controller calls it:

- ``read(grant)``: ``KvccHiCacheStorage.get(k.hex)`` -- the backend's read path (``batch_get``:
  acquire, read into a staging buffer, release; only bytes read under trust reach SGLang's
  tensor). The contract splits a read into ``acquire`` / ``read`` / ``release``; SGLang's get does
  all three, so during ``get`` the backend's client hands it the lease the contract acquired
  (instead of a second acquire, which one holder may not make) and its release is the contract's
  own ``release`` step, later. A miss (``None``) is the refusal the kvcc read gave.
- ``commit(grant)``: ``KvccHiCacheStorage.set(k.hex, page)`` -- the backend's write path
  (begin_write, write_bytes, commit only once the node stored every byte; a refused commit is a
  failed save). The contract splits a write into ``begin_write`` / ``write_bytes`` / ``commit``;
  during ``set`` (of an empty page: the bytes went out in the contract's ``write_bytes`` step) the
  backend's client answers its begin_write with the contract's write grant and its write_bytes with
  "stored" (the real commit then refuses ``not_found`` if the bytes were not), and its commit is
  sent for real. The answer is the commit's (``Committed(gen, epoch)`` or the refusal).
- ``invalidate(scope="namespace")``: ``KvccHiCacheStorage.clear()`` (a namespace invalidation,
  waited for), run on a thread of its own: the contract's ``invalidate`` returns the ticket as
  soon as the directory answered it, ``wait_invalidation`` waits for ``clear()`` to return (it
  returns ``True`` once the directory completed the invalidation).

Through the node's kvcc client, exactly as the ``reference`` adapter (the contract needs finer
steps, or a chain, than SGLang's calls expose): ``lookup`` (a prompt chain; SGLang's
``batch_exists`` asks page by page, every page a root, and would count 0 for a chained key),
``begin_write``, ``write_bytes``, ``abort``, ``acquire``, ``renew``, ``release``,
``invalidate`` of scope ``key`` / ``prefix`` and ``wait_invalidation`` of their tickets (and of a
``clear`` whose node went down meanwhile), ``evict`` and every fault
(``kill``/``restart``/``pause``/``resume`` of node processes and their clients, ``skew_clock`` of
the holder's clock, ``restart_directory``).

A kvcc call that raised inside the backend (which makes it a miss or a failed save) is
``AdapterError``, as in ``reference``. Not exercised: ``batch_exists`` (see ``lookup``), the v1
zero-copy calls (they need a host pool of fixed page size; the suite's blocks vary in size).

Events are native: the directory's, every node's and every co-located client's NDJSON logs (the
backend's operations are the co-located client's, so they are in the node's log).

The ``engine`` profile, on a machine with a CUDA GPU (``_SglangEngines``): two real SGLang
servers (``kvcc.adapters.sglang.server``), each beside one cache node, their HiCache L3 this backend
on the test's cluster, loaded by SGLang's own ``dynamic`` factory from the server's command line;
``complete`` is the server's ``/generate``, ``forget`` its ``/flush_cache``, kills and pauses go to
its process group, ``engine_index`` follows its KV events. Without CUDA (SGLang's server has no CPU
build) the profile is reported unavailable, with that reason; ``scripts/sglang_cuda.sh`` runs it.

Every cache profile is claimed (``tiering`` exercises the kvcc nodes' tiers behind the backend, through
``evict``; ``load`` runs reads and commits through SGLang's calls concurrently); the ``corrupt``
fault is not declared, as for ``reference`` (a block lands in the node process's DRAM tier first,
out of the adapter's reach).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import json
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvcc.adapters.engine_calls import ClearingAdapter, Step, TicketHandover, current
from kvcc.adapters.reference import NODE_BLOCK_BYTES, NODE_CAPACITY_BYTES
from kvcc.conformance.contract import (
    CACHE_PROFILES,
    ENGINE_PROFILE,
    AdapterError,
    Capabilities,
    Committed,
    Completion,
    InvalidationTicket,
    NotSupported,
    ReadGrant,
    Refused,
    WriteGrant,
)
from kvcc.reference.client import Refused as ClientRefused
from kvcc.spec.keys import BlockKey, Namespace
from kvcc.spec.vocabulary import REASON_MISS, REASON_NOT_FOUND, REASON_REVOKED, REASON_UNKNOWN_LEASE, SCOPE_NAMESPACE

PROFILES_CLAIMED = frozenset(CACHE_PROFILES)
# The engine profile needs serving engines; SGLang's server has no CPU build (it needs CUDA and its
# own kernels), so where the suite runs without a GPU its tests are reported, not run.
ENGINE_UNAVAILABLE = ("needs SGLang servers, and SGLang's server does not run without CUDA; the backend's own calls "
                      "are what this adapter drives here")
FAULTS_CLAIMED = frozenset({"kill", "restart", "pause", "resume", "skew_clock", "restart_directory", "intrude", "move"})
SCOPES_CLAIMED = frozenset({"key", "prefix", "namespace"})
MODEL = "kvcc/conformance"  # SGLang's model name in the storage config (the namespace is the contract's)
CLEAR_TIMEOUT_S = 60.0  # clear()'s own wait (the contract waits with wait_invalidation)
CALL_TIMEOUT_S = 60.0  # one backend call on the node client's loop


class _NodeLoop:
    """Stands in for the backend's private loop thread: runs its coroutines on the event loop of
    the node's current co-located client (a restarted node gets a new client)."""

    def __init__(self, adapter: SglangAdapter, node: str) -> None:
        self._adapter, self._node = adapter, node

    def run(self, coro: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        try:
            sync = self._adapter._client(self._node)
        except AdapterError:
            coro.close()
            raise
        fut = asyncio.run_coroutine_threadsafe(coro, sync._loop)
        return fut.result(min(timeout_s, CALL_TIMEOUT_S + CLEAR_TIMEOUT_S))

    def close(self) -> None:
        pass  # the loop is the node client's


class _HolderView:
    """The backend's kvcc client: node ``node``'s co-located ``KvccClient``, except that the
    steps the contract performs on its own (acquire/release around ``get``, begin_write and
    write_bytes before ``set``) are handed over from the contract step in progress. The backend
    calls the client's batched operations; the contract's get and set are of one page."""

    def __init__(self, adapter: SglangAdapter, node: str) -> None:
        self._adapter, self._node = adapter, node
        self.tickets = TicketHandover()  # clear() -> the contract's invalidate

    @property
    def _real(self) -> Any:
        return self._adapter._client(self._node).client

    # the read path (get / batch_get of one page): acquire_many -> read_many -> release_many
    async def acquire_many(self, ns: Any, keys: list[BlockKey]) -> Any:
        step = current.get()
        if step is None or step.read_lease is None or [step.read_lease.key] != list(keys):
            return [ClientRefused(REASON_UNKNOWN_LEASE, "no read lease handed over")] * len(keys)  # never reached by the suite
        return [step.read_lease]

    def lease_of(self, key: BlockKey) -> None:
        return None  # the backend keeps no lease of its own here: each read's is handed over

    def trusted(self, lease: Any) -> bool:
        return self._real.trusted(lease)

    async def read_many(self, leases: list[Any], outs: list[Any] | None = None) -> Any:
        step = current.get()
        try:
            got = await self._real.read_many(leases, outs)
        except Exception as e:  # the backend turns it into a miss; the contract step into AdapterError
            if step is not None:
                step.failure = e
            raise
        if step is not None and got:
            step.read_result = got[0]
        return got

    async def release_many(self, leases: list[Any]) -> None:
        return None  # the contract's release step ends the lease

    # the write path (set / batch_set of one page): put_many = begin_write -> write_bytes -> commit
    async def put_many(self, ns: Any, blocks: list[Any]) -> Any:
        step = current.get()
        if step is None or step.write_lease is None or len(blocks) != 1:
            return [ClientRefused(REASON_NOT_FOUND, "no write grant handed over")] * len(blocks)
        # begin_write is the contract's grant and write_bytes its own step; the commit is sent for real
        try:
            got = await self._real.commit(step.write_lease)
        except Exception as e:  # the backend turns it into a failed save; the contract step into AdapterError
            step.failure = e
            raise
        step.commit_result = got
        return [got]

    async def lookup(self, ns: Any, keys: Any) -> Any:
        return await self._real.lookup(ns, keys)

    # clear(): a namespace invalidation, waited for
    async def invalidate(self, ns: Any, scope: str, key: Any = None) -> Any:
        ticket = await self._real.invalidate(ns, scope, key)
        self.tickets.deliver(ticket)
        return ticket

    async def wait(self, ticket: Any, timeout_s: float) -> bool:
        return await self._real.wait(ticket, timeout_s)

    async def close(self) -> None:
        return None  # the node's client is the adapter's to close


# -- the engine profile: real SGLang servers (CUDA only) -----------------------------------------------

ENGINES = ("s1", "s2")
ENGINE_MODEL_ID = "kvcc/tiny-llama"
ENGINE_PAGE_TOKENS = 32
ENGINE_KV_DTYPE = "bfloat16"  # the servers run --dtype bfloat16
ENGINE_LAYOUT = "page_first"  # the servers' --hicache-mem-layout
TOP_LOGPROBS = 5
# The servers' backends hold each read lease this long before reading (kvcc_load_hold_ms): a
# window in which pause_engine_reading can stop a server holding one.
LOAD_HOLD_MS = 50
ENGINE_REQUEST_TIMEOUT_S = 120.0
# A request is done once its backups are: the server's backend idle, its counters unchanged this long.
SAVES_QUIET_S, SAVES_TIMEOUT_S = 1.0, 60.0
FLUSH_TIMEOUT_S = 30.0  # flush_cache is refused while a request runs: retried this long
INDEX_QUIET_S, INDEX_WAIT_S = 0.3, 5.0  # engine_index: the KV events quiet this long (waiting at most this)
PUMP_INTERVAL_S = 0.01


def engines_available() -> str:
    """Why SGLang servers cannot run here ("" when they can: a CUDA GPU and SGLang installed)."""
    try:
        import torch
    except ImportError:
        return "needs torch"
    if not torch.cuda.is_available():
        return ENGINE_UNAVAILABLE
    return ""


def engine_namespace(model_revision: str) -> Namespace:
    """The kvcc namespace the servers' backends file their pages under (``storage_namespace`` of
    TP rank 0 of 1, the servers' page size, KV dtype and host layout, the tiny Llama and its
    revision); each backend checks the host pool agrees, and the status file shows its digest."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from kvcc.adapters.sglang.backend import storage_namespace

    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                  model_name=ENGINE_MODEL_ID, extra_config={})  # fmt: skip
    return storage_namespace(config, page_size=ENGINE_PAGE_TOKENS, kv_dtype=ENGINE_KV_DTYPE, kv_layout=ENGINE_LAYOUT,
                             model_id=ENGINE_MODEL_ID, model_revision=model_revision)  # fmt: skip


def engine_page_keys(engine_ns: Namespace, tokens: Sequence[int], salt: str) -> list[BlockKey]:
    """The kvcc keys of a prompt's full pages as the servers' backends name them: SGLang's own page
    hashes (seeded by the request's cache salt), each hashed into the engine namespace. (SGLang
    loads no page holding a prompt's last token: the suite's prompts end in a partial page, so
    every page listed here can be loaded.)"""
    from kvcc.adapters.sglang.backend import page_key
    from kvcc.adapters.sglang.server import page_hashes

    digest = engine_ns.digest()
    return [page_key(digest, h) for h in page_hashes(tokens, ENGINE_PAGE_TOKENS, cache_salt=salt)]


def _salt(ns: Namespace) -> str:
    """The cache salt of the servers' requests in test namespace ``ns``."""
    return (ns.cache_salt or b"").hex() or "kvcc-unsalted"


class _SglangEngines:
    """The ``engine`` profile on a CUDA machine: two real SGLang servers
    (``kvcc.adapters.sglang.server.SglangServer``), each beside one cache node of the test's
    cluster, its L3 storage kvcc's backend on that cluster (its client ``<node>.sglang-<engine>-
    <generation>``, co-located with the node; its protocol events logged beside the cluster's, so
    the servers' own reads and writes are validated with the rest); ``SglangEngineView`` follows
    their KV events for ``engine_index``. Started at a test's first engine call and stopped with
    the test (an SGLang server on a GPU starts in well under a minute; the engines are not kept
    up across tests). ``complete`` is ``POST /generate`` (greedy, top log-probabilities), done
    once the server's backend has gone quiet (its write-through backups are asynchronous), with
    the pages it loaded and failed to load counted from the backend's status file; ``forget`` is
    ``POST /flush_cache`` (GPU and host caches; storage untouched)."""

    _servers: dict[str, Any]
    _gens: dict[str, int]

    def _engines_init(self) -> None:
        self._servers = {}
        self._gens = {}
        self._next_gen = itertools.count(1)
        self._revision: str | None = None
        self._ens: Namespace | None = None
        self._subscriber: Any = None
        self._index_lock = threading.Lock()
        self._last_event = 0.0
        self._pumping = threading.Event()
        self._pump_thread: threading.Thread | None = None
        self._engine_lock = threading.Lock()

    def _engine_ns(self) -> Namespace:
        if self._revision is None:
            from kvcc.adapters.vllm.model import read_revision, tiny_llama

            self._revision = read_revision(tiny_llama())
        if self._ens is None or self._ens.model_revision != self._revision:
            self._ens = engine_namespace(self._revision)
        return self._ens

    def engines(self) -> list[str]:
        return [] if engines_available() else list(ENGINES)

    def _engine_lookup(self, node: str, ns: Namespace, keys: list[BlockKey]) -> int | None:
        """``lookup`` in the servers' namespace: SGLang's pages are kvcc roots (its page hash
        already chains over the prefix; the backend's docstring), so a prompt's pages are not a
        kvcc chain and the directory's chain lookup would stop after the first. Counted as SGLang's
        prefetch counts them: the leading pages each committed (one ``Lookup`` per page, in one
        round trip). ``None`` for any other namespace (and before the servers' namespace is known:
        ``_cluster_namespaces`` learns it at ``start`` where servers run)."""
        if self._revision is None or ns != self._engine_ns():
            return None
        hits = self._call(node, "lookup_many", ns, [[k] for k in keys])
        return next((i for i, hit in enumerate(hits) if hit.blocks != 1), len(keys))

    def engine_keys(self, ns: Namespace, tokens) -> tuple[Namespace, list[BlockKey]]:
        ens = self._engine_ns()
        return ens, engine_page_keys(ens, list(tokens), _salt(ns))

    def _engine_node(self, name: str) -> str:
        nodes = list(self._cluster.node_ids)
        return nodes[ENGINES.index(name) % len(nodes)]

    def _status_path(self, name: str) -> Any:
        return self._ctx.workdir / f"sglang-{name}-{self._gens[name]}.status.json"

    def _client_log(self, name: str) -> Any:
        return self._cluster.workdir / "events" / f"{self._engine_node(name)}.sglang-{name}-{self._gens[name]}.ndjson"

    def _extra_config(self, name: str) -> dict[str, Any]:
        """Engine ``name``'s backend settings, under a new generation (a new client id, event log
        and status file at every start)."""
        self._gens[name] = next(self._next_gen)
        host, port = self._cluster.directory_address
        return {"kvcc_directory": f"{host}:{port}", "kvcc_tenant": "engine",
                "kvcc_token_hex": self._cluster.engine_token.hex(), "kvcc_skew_ms": self._ctx.skew_ms,
                "kvcc_client_id": f"sglang-{name}-{self._gens[name]}", "kvcc_colocated_node": self._engine_node(name),
                "kvcc_events_dir": str(self._cluster.workdir / "events"), "kvcc_status_file": str(self._status_path(name)),
                "kvcc_load_hold_ms": LOAD_HOLD_MS, "kvcc_model_id": ENGINE_MODEL_ID,
                "kvcc_model_revision": self._revision, "kvcc_page_size": ENGINE_PAGE_TOKENS,
                "kvcc_kv_dtype": ENGINE_KV_DTYPE, "kvcc_kv_layout": ENGINE_LAYOUT}  # fmt: skip

    def _engine(self, name: str) -> Any:
        if name not in ENGINES or engines_available():
            raise AdapterError(f"no engine {name!r}: {engines_available() or 'not one of ' + ', '.join(ENGINES)}")
        with self._engine_lock:
            if not self._servers:
                self._start_engines()
            return self._servers[name]

    def _start_engines(self) -> None:
        from kvcc.adapters.sglang.backend import page_key
        from kvcc.adapters.sglang.server import SglangEngineView, SglangServer
        from kvcc.adapters.vllm.events import KvEventSubscriber
        from kvcc.adapters.vllm.model import tiny_llama

        if self._cluster is None:
            raise AdapterError("the adapter is stopped: its test has no engines any more")
        ens = self._engine_ns()
        servers = {name: SglangServer(tiny_llama(), served_name=ENGINE_MODEL_ID, page_size=ENGINE_PAGE_TOKENS,
                                      extra_config=lambda n=name: self._extra_config(n))
                   for name in ENGINES}  # fmt: skip
        self._servers.update(servers)  # stop() closes whatever started
        # One after the other: a server sizes its KV pool from the GPU memory free when it starts,
        # so two starting at once can each count the other's memory as free.
        from kvcc.adapters.vllm.harness import EngineError

        for s in servers.values():
            try:
                s.start()
            except EngineError as exc:
                raise AdapterError(f"an SGLang server did not start: {exc}") from exc
        for name in ENGINES:
            got = self._status(name).get("namespace")
            if got != ens.digest().hex():
                raise AdapterError(f"engine {name}'s backend files pages under namespace {got}, not the expected "
                                   f"{ens.digest().hex()} (page size, KV dtype or layout differ)")  # fmt: skip
        sub = KvEventSubscriber()
        name_of = functools.partial(page_key, ens.digest())
        for name, s in servers.items():
            sub.add_engine(name, s.events_endpoint, s.replay_endpoint, topic=s.topic,
                           view=SglangEngineView(name, ENGINE_PAGE_TOKENS, name_of))  # fmt: skip
        self._subscriber = sub
        self._pumping.set()
        self._pump_thread = threading.Thread(target=self._pump, name="sglang-kv-events", daemon=True)
        self._pump_thread.start()

    def _pump(self) -> None:
        sub = self._subscriber
        while self._pumping.is_set():
            with self._index_lock:
                if sub.pump(0.0):
                    self._last_event = time.monotonic()
            time.sleep(PUMP_INTERVAL_S)

    def _stop_engines(self) -> None:
        self._pumping.clear()
        if self._pump_thread is not None:
            self._pump_thread.join(5)
            self._pump_thread = None
        for s in self._servers.values():
            try:
                s.close()
            except Exception:  # noqa: BLE001 -- stopping regardless
                pass
        self._servers.clear()
        if self._subscriber is not None:
            self._subscriber.close()
            self._subscriber = None

    def _status(self, name: str) -> dict[str, Any]:
        try:
            return json.loads(self._status_path(name).read_text())
        except (OSError, ValueError):
            return {}

    def _saves_settled(self, name: str) -> bool:
        """Wait until engine ``name``'s backend runs no call and its counters stay unchanged for
        ``SAVES_QUIET_S`` (its backups after a request are asynchronous); ``False`` on timeout."""
        deadline = time.monotonic() + SAVES_TIMEOUT_S
        last, since = None, time.monotonic()
        while time.monotonic() < deadline:
            status = self._status(name)
            now = (status.get("busy"), status.get("counts"))
            if now != last:
                last, since = now, time.monotonic()
            elif status.get("busy") == 0 and time.monotonic() - since >= SAVES_QUIET_S:
                return True
            time.sleep(PUMP_INTERVAL_S * 10)
        return False

    @staticmethod
    def _loads(counts: dict[str, int]) -> tuple[int, int]:
        """(pages read into SGLang's buffers, pages whose read was refused)."""
        return counts.get("read_hits", 0), sum(n for k, n in counts.items() if k.startswith("read_refused_"))

    def complete(self, engine: str, ns: Namespace, tokens, max_tokens: int) -> Completion:
        from kvcc.adapters.vllm.harness import EngineError

        s = self._engine(engine)
        before = self._loads(self._status(engine).get("counts", {}))
        try:
            out = s.generate(list(tokens), max_tokens=max_tokens, cache_salt=_salt(ns), top_logprobs=TOP_LOGPROBS,
                             timeout_s=ENGINE_REQUEST_TIMEOUT_S)  # fmt: skip
        except EngineError as exc:
            raise AdapterError(f"engine {engine}: {exc}") from exc
        if not self._saves_settled(engine) or not s.is_running():
            raise AdapterError(f"engine {engine}: its backups of a request did not settle in {SAVES_TIMEOUT_S:g} s")
        after = self._loads(self._status(engine).get("counts", {}))
        meta = out.get("meta_info") or {}
        steps = meta.get("output_top_logprobs") or []
        return Completion(
            tuple(out["output_ids"]),
            tuple(tuple(sorted((int(tok), float(lp)) for lp, tok, *_ in step or ())) for step in steps),
            int(meta.get("prompt_tokens", len(tokens))), int(meta.get("cached_tokens") or 0),
            after[0] - before[0], after[1] - before[1],
        )  # fmt: skip

    def forget(self, engine: str) -> None:
        from kvcc.adapters.vllm.harness import EngineError

        s = self._engine(engine)
        deadline = time.monotonic() + FLUSH_TIMEOUT_S
        try:
            while not s.flush_cache():
                if time.monotonic() > deadline:
                    raise AdapterError(f"engine {engine} refused to flush its cache for {FLUSH_TIMEOUT_S:g} s")
                time.sleep(0.2)
        except EngineError as exc:
            raise AdapterError(f"engine {engine}: {exc}") from exc

    def kill_engine(self, engine: str) -> None:
        self._engine(engine).kill()

    def restart_engine(self, engine: str) -> None:
        from kvcc.adapters.vllm.harness import EngineError

        s = self._engine(engine)
        s.kill()
        try:
            s.start()  # a new generation: a new client, event log and status file
        except EngineError as exc:
            raise AdapterError(f"engine {engine} did not start again: {exc}") from exc

    def pause_engine(self, engine: str) -> None:
        self._engine(engine).pause()

    def resume_engine(self, engine: str) -> None:
        self._engine(engine).resume()

    def pause_engine_reading(self, engine: str, timeout_s: float) -> bool:
        from kvcc.adapters.vllm.conformance import pause_while_reading

        return pause_while_reading(self._engine(engine), self._client_log(engine), timeout_s)

    def engine_index(self, engine: str, ns: Namespace) -> set[BlockKey]:
        """The view, once no KV event came for ``INDEX_QUIET_S`` (at most ``INDEX_WAIT_S``)."""
        self._engine(engine)
        deadline = time.monotonic() + INDEX_WAIT_S
        time.sleep(INDEX_QUIET_S)
        while time.monotonic() - self._last_event < INDEX_QUIET_S and time.monotonic() < deadline:
            time.sleep(PUMP_INTERVAL_S)
        with self._index_lock:
            return set(self._subscriber.view(engine).keys())


class SglangAdapter(_SglangEngines, ClearingAdapter):
    """kvcc's SGLang HiCache backend on a real kvcc cluster; see the module docstring."""

    ENGINE_VERSION = ("sglang", "sglang")

    def __init__(self) -> None:
        super().__init__("sqlite")
        self.name = "sglang"
        self._backends: dict[tuple[str, bytes], Any] = {}
        self._views: dict[str, _HolderView] = {}
        self._stored: dict[tuple[str, bytes, int], Any] = {}
        self._seq = itertools.count(1)
        self._engines_init()

    def capabilities(self) -> Capabilities:
        why = engines_available()
        return Capabilities(
            profiles=PROFILES_CLAIMED if why else PROFILES_CLAIMED | {ENGINE_PROFILE},
            faults=FAULTS_CLAIMED,
            scopes=SCOPES_CLAIMED,
            events="native",
            leases="enforced",
            frees_acknowledged=True,
            capacity_bytes=self._node_count() * NODE_CAPACITY_BYTES,
            block_bytes=NODE_BLOCK_BYTES,
            slot_bytes=NODE_BLOCK_BYTES,
            unavailable={ENGINE_PROFILE: why} if why else {},
            notes="SGLang's HiCache storage backend KvccHiCacheStorage (loaded by SGLang's dynamic backend factory) "
            "on the kvcc reference cluster (processes on loopback): read is the backend's get, commit its set, a "
            "namespace invalidation its clear; begin_write, write_bytes, acquire, renew, release, lookup, key and "
            "prefix invalidation, evict and faults use the same node's kvcc client. Not declared: the corrupt fault "
            "(as the reference adapter: a block lands in the node process's DRAM tier first). The engine profile, "
            "where a CUDA GPU is: two SGLang servers with this backend as their HiCache L3",
        )

    # ------------------------------------------------------------------ lifecycle

    def start(self, ctx) -> None:
        super().start(ctx)
        try:
            for node in self._cluster.node_ids:
                self._views[node] = _HolderView(self, node)
                for ns in ctx.namespaces:
                    self._backends[(node, ns.digest())] = self._make_backend(node, ns)
        except Exception as e:
            self.stop()
            raise AdapterError(f"the SGLang backend did not come up: {type(e).__name__}: {e}") from e

    def _make_backend(self, node: str, ns: Namespace) -> Any:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        host, port = self._cluster.directory_address
        extra = {"backend_name": "kvcc", "module_path": "kvcc.adapters.sglang.backend",
                 "class_name": "KvccHiCacheStorage", "kvcc_directory": f"{host}:{port}", "kvcc_tenant": "engine",
                 "kvcc_token_hex": self._cluster.engine_token.hex(), "kvcc_skew_ms": self._ctx.skew_ms,
                 "kvcc_client_id": f"sglang-{node}-{next(self._seq)}", "kvcc_page_size": ns.block_tokens or 1,
                 "kvcc_kv_dtype": ns.kv_dtype or "uint8", "kvcc_kv_layout": "contract",
                 "kvcc_clear_timeout_s": CLEAR_TIMEOUT_S}  # fmt: skip
        config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                      is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                      model_name=MODEL, extra_config=extra)  # fmt: skip
        backend = StorageBackendFactory.create_backend("dynamic", config, None)
        backend.close()  # its own connection: the node's co-located client takes its place
        backend._loop = _NodeLoop(self, node)
        backend.client = self._views[node]
        backend.namespace, backend._ns_digest = ns, ns.digest()
        backend.kvcc_key = lambda page: BlockKey(bytes.fromhex(page))
        return backend

    def _cluster_namespaces(self, ctx) -> list[Namespace]:
        """The run's namespaces, and the servers' (where they run)."""
        return [*ctx.namespaces, *(() if engines_available() else (self._engine_ns(),))]

    def stop(self) -> None:
        self._stop_engines()  # before the cluster: their backups end with them
        for view in self._views.values():
            view.tickets.fail_all("stopped")
        self._backends.clear()
        super().stop()

    def _backend(self, node: str, ns_digest: bytes) -> Any:
        b = self._backends.get((node, ns_digest))
        if b is None:
            raise AdapterError(f"no SGLang backend for node {node!r} in that namespace")
        return b

    def _run_step(self, step: Step, fn) -> Any:
        """``fn()`` (a backend call) with ``step`` handed to the coroutines it runs. A kvcc call
        that raised inside (the backend made it a miss or a failed save) is ``AdapterError``, as
        in ``reference``: the infrastructure broke, the outcome is unknown."""
        from kvcc.reference.errors import ConnectionFailed, TimeoutError_

        token = current.set(step)
        try:
            out = fn()
        except (ConnectionFailed, TimeoutError_, TimeoutError, OSError, concurrent.futures.TimeoutError) as e:
            raise AdapterError(f"{type(e).__name__}: {e}") from e
        finally:
            current.reset(token)
        if step.failure is not None:
            raise AdapterError(f"{type(step.failure).__name__}: {step.failure}") from step.failure
        return out

    # ------------------------------------------------------------------ writes

    def lookup(self, node: str, ns: Namespace, keys) -> int:
        n = self._engine_lookup(node, ns, list(keys))
        return super().lookup(node, ns, keys) if n is None else n

    def begin_write(self, node, ns, key, parent):
        out = super().begin_write(node, ns, key, parent)
        if isinstance(out, WriteGrant):
            with self._lock:
                self._stored[(node, key.digest, out.lease)] = ns.digest()
        return out

    def commit(self, grant: WriteGrant) -> Committed | Refused:
        import torch

        wl = self._write_lease(grant)
        with self._lock:
            ns_digest = self._stored.get((grant.node, grant.key.digest, grant.lease))
            crashed = (grant.node, grant.key.digest, grant.lease) in self._crashed_writes
        if crashed or ns_digest is None:
            return Refused(REASON_NOT_FOUND, f"the writer of grant {grant.lease} is gone")
        backend = self._backend(grant.node, ns_digest)
        step = Step()
        step.write_lease = wl
        self._client(grant.node)  # a killed node's writer commits nothing
        self._run_step(step, lambda: backend.set(grant.key.hex, torch.zeros(0, dtype=torch.uint8)))
        out = step.commit_result
        if out is None:  # the backend's set never reached its commit
            return Refused(REASON_NOT_FOUND, "the SGLang backend did not commit")
        return Refused(out.reason, out.detail) if isinstance(out, ClientRefused) else Committed(out.gen, out.epoch)

    # ------------------------------------------------------------------ reads

    def acquire(self, node, ns, key):
        out = super().acquire(node, ns, key)
        if isinstance(out, ReadGrant):
            with self._lock:
                self._stored[(node, key.digest, -out.lease)] = ns.digest()
        return out

    def read(self, grant: ReadGrant) -> bytes | Refused:
        c = self._client(grant.node)
        current = c.lease_of(grant.key)
        lease = current if current is not None and current.lease == grant.lease else self._read_lease(grant)
        with self._lock:
            ns_digest = self._stored.get((grant.node, grant.key.digest, -grant.lease))
        if ns_digest is None:
            raise AdapterError(f"read grant {grant.lease} was not issued by this adapter")
        backend = self._backend(grant.node, ns_digest)
        step = Step()
        step.read_lease = lease
        try:
            tensor = self._run_step(step, lambda: backend.get(grant.key.hex))
        except ValueError:  # torch cannot hold an empty page (frombuffer of 0 bytes)
            if isinstance(step.read_result, (bytes, bytearray)) and len(step.read_result) == 0:
                return b""
            raise
        if tensor is not None:
            return tensor.contiguous().view(-1).numpy().tobytes()
        got = step.read_result
        if isinstance(got, ClientRefused):
            reason = REASON_UNKNOWN_LEASE if got.reason == REASON_REVOKED else got.reason
            return Refused(reason, got.detail)
        return Refused(REASON_MISS, "the SGLang backend's get missed")

    # ------------------------------------------------------------------ invalidation

    def invalidate(self, node: str, ns: Namespace, scope: str, key: BlockKey | None) -> InvalidationTicket:
        if scope not in self.capabilities().scopes:
            raise NotSupported(f"invalidate:{scope}")
        assert self._ctx is not None
        if scope != SCOPE_NAMESPACE or ns not in self._ctx.namespaces:
            return super().invalidate(node, ns, scope, key)
        backend = self._backend(node, ns.digest())
        return self._invalidate_through(node, self._views[node].tickets, backend.clear, "sglang-clear")


def factory() -> SglangAdapter:
    """kvcc's SGLang HiCache storage backend on a real kvcc cluster (reads, commits, clears through SGLang's calls)."""
    return SglangAdapter()
