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

Every profile is claimed (``tiering`` exercises the kvcc nodes' tiers behind the backend, through
``evict``; ``load`` runs reads and commits through SGLang's calls concurrently); the ``corrupt``
fault is not declared, as for ``reference`` (a block lands in the node process's DRAM tier first,
out of the adapter's reach).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from typing import Any

from kvcc.adapters.engine_calls import ClearingAdapter, Step, TicketHandover, current
from kvcc.adapters.reference import NODE_BLOCK_BYTES, NODE_CAPACITY_BYTES
from kvcc.conformance.contract import (
    CACHE_PROFILES,
    ENGINE_PROFILE,
    AdapterError,
    Capabilities,
    Committed,
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


class SglangAdapter(ClearingAdapter):
    """kvcc's SGLang HiCache backend on a real kvcc cluster; see the module docstring."""

    ENGINE_VERSION = ("sglang", "sglang")

    def __init__(self) -> None:
        super().__init__("sqlite")
        self.name = "sglang"
        self._backends: dict[tuple[str, bytes], Any] = {}
        self._views: dict[str, _HolderView] = {}
        self._stored: dict[tuple[str, bytes, int], Any] = {}
        self._seq = itertools.count(1)

    def capabilities(self) -> Capabilities:
        return Capabilities(
            profiles=PROFILES_CLAIMED,
            faults=FAULTS_CLAIMED,
            scopes=SCOPES_CLAIMED,
            events="native",
            leases="enforced",
            frees_acknowledged=True,
            capacity_bytes=self._node_count() * NODE_CAPACITY_BYTES,
            block_bytes=NODE_BLOCK_BYTES,
            slot_bytes=NODE_BLOCK_BYTES,
            unavailable={ENGINE_PROFILE: ENGINE_UNAVAILABLE},
            notes="SGLang's HiCache storage backend KvccHiCacheStorage (loaded by SGLang's dynamic backend factory) "
            "on the kvcc reference cluster (processes on loopback): read is the backend's get, commit its set, a "
            "namespace invalidation its clear; begin_write, write_bytes, acquire, renew, release, lookup, key and "
            "prefix invalidation, evict and faults use the same node's kvcc client. Not declared: the corrupt fault "
            "(as the reference adapter: a block lands in the node process's DRAM tier first)",
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

    def stop(self) -> None:
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
