"""Live routing through real vLLM engines (``kvcc bench routing --live-vllm``).

Theory of operation
-------------------
N real vLLM engines (the CPU build, ``kvcc.adapters.vllm.harness``; the project's random-weight
Llama, 32-token blocks) share one kvcc cluster (a directory and N cache nodes, processes on
loopback) through ``KvccConnector``: engine *i* runs beside cache node *i*
(``colocated_node``), so its saves land on that node's DRAM tier, and it loads from any node. Two
levels of cache, as in a real deployment: each engine's own prefix cache (``--num-gpu-blocks-override``:
about one long request's worth) and kvcc's pool (F of the requests' unique blocks, split evenly
across the nodes).

Each engine computes on its own share of the CPUs (``cores``). The trace's requests are replayed
in order, one at a time (a closed loop: nothing queues, so TTFT
is each request's own service). A trace block (one hash id) becomes one 32-token engine block,
its tokens drawn from a generator seeded by the id, so requests that share hash ids share token
prefixes; a request's prompt is its blocks' tokens and one more token (vLLM computes at least
one). Per request:

1. the router's view of each engine is what the engine's **KV events** say it holds
   (``kvcc.adapters.vllm.events``: ``matched[j]`` is the leading blocks of the prompt engine *j*
   has in its own prefix cache), its load the engine's measured busy time so far; the policy
   (``kvcc.reference.routing.policies``) chooses an engine;
2. the completion (``max_tokens=1``) is timed on loopback: ``ttft``;
3. the engine's own account of its hit (``usage.prompt_tokens_details.cached_tokens``: its own
   prefix cache plus what its connector loaded) and the connector's counters (``loaded_blocks``:
   the blocks read from kvcc) split the hit into ``local`` and ``kvcc``; every save is waited for
   before the next request, and the events of the step are pumped, so each request sees
   everything the ones before it left.

Between policies every engine's prefix cache and kvcc's pool are emptied
(``POST /reset_prefix_cache?reset_external=true``: the connector's namespace invalidation,
completed before it answers) and the event views restart from an empty cache, so each policy
starts cold on the same engines. Reported per policy: ``hit_ratio`` (blocks the engine did not
compute / block refs), ``local_hit_ratio`` and ``kvcc_hit_ratio``, ``max_mean_load`` (busy time),
``ttft_p50``/``ttft_p99`` (ms), ``saves`` (the connectors' counts over the replay: blocks planned
for save and saved, refused by reason -- a refused save is a block the pool will not have -- and load errors), and
beside them, for the same requests, the infinite-cache bound
and the pooled LRU bound of kvcc's capacity (``kvcc.reference.routing.sim``).
"""

from __future__ import annotations

import json as _json
import os
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvcc.reference.routing import sim
from kvcc.reference.routing.policies import POLICIES, Request, View

BLOCK_TOKENS = 32  # one trace block is one engine block here (the trace's 512 tokens scaled down)
SLOT_BYTES = 64 << 10  # a node slot; one tiny-Llama block is 32 KiB
MODEL_ID = "kvcc/tiny-llama-routing"
VOCAB = range(3, 512)  # the tiny model's ids without its special tokens
DEFAULT_LIMIT = 100
DEFAULT_POLICIES = ("round_robin", "cache_aware", "sglang_cache_aware", "dynamo_cost")
LEASE_TERM_MS = 10_000
SKEW_MS = 100
REQUEST_TIMEOUT_S = 600.0
EVENTS_WAIT_S = 5.0  # how long the events of a request's step may take to arrive

WARM_UP_PARAMS = {"kvcc": "skip"}  # the connector neither looks a warm-up prompt up nor saves it (``_warm``)


class LiveVllmError(Exception):
    """The replay could not run: an engine or the cluster did not start, a request failed, or the
    engine's account of a hit disagrees with its connector's."""


def cores(i: int, engines: int) -> str:
    """The CPUs engine ``i`` of ``engines`` computes on (``VLLM_CPU_OMP_THREADS_BIND``): an equal
    share of this process's, its own where there are enough. An idle vLLM engine's compute threads
    spin for a while after each request; engines sharing cores would slow whichever ran next, so
    a policy that alternates engines would pay for it in TTFT."""
    cpus = sorted(os.sched_getaffinity(0))
    share = max(1, len(cpus) // engines)
    mine = [cpus[(i * share + k) % len(cpus)] for k in range(share)]
    return ",".join(map(str, mine))


def block_tokens(block_id: int) -> list[int]:
    """The 32 token ids trace block ``block_id`` stands for (the same for every request)."""
    rng = random.Random(block_id * 1_000_003 + 7)
    return [rng.choice(VOCAB) for _ in range(BLOCK_TOKENS)]


def prompt_of(blocks: Sequence[int]) -> list[int]:
    tokens = [t for b in blocks for t in block_tokens(b)]
    return tokens + [VOCAB[0]]


def _connector_stats(stats: Path, side: str) -> dict[str, int]:
    try:
        return _json.loads((stats.parent / f"{stats.name}.{side}.json").read_text())
    except (OSError, ValueError):
        return {}


def _worker_stats(stats: Path) -> dict[str, int]:
    return _connector_stats(stats, "worker")


def _save_stats(stats: Path) -> dict[str, int]:
    """The connector's save counters: planned (its scheduler side), saved, refused by reason,
    dropped, and its load errors (its worker side)."""
    worker = _worker_stats(stats)
    out = {k: v for k, v in worker.items() if k in ("saved_blocks", "already_stored", "load_errors")
           or k.startswith(("save_refused_", "saves_dropped_"))}  # fmt: skip
    out["blocks_planned_for_save"] = _connector_stats(stats, "scheduler").get("blocks_planned_for_save", 0)
    return out


def _cached_tokens(out: dict[str, Any]) -> int:
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


class _Deployment:
    """The engines, the cluster they share, and the events subscriber that follows them."""

    def __init__(self, nodes: int, pool_blocks: int, longest: int, workdir: Path, step: Callable[[str], None]) -> None:
        from kvcc.adapters.vllm import harness
        from kvcc.adapters.vllm.events import KeyMapper, KvEventSubscriber
        from kvcc.adapters.vllm.model import TinyLlamaSpec, engine_namespace, tiny_llama
        from kvcc.reference.cluster import LocalCluster

        self.engines: list[Any] = []
        self.cluster = None
        self.sub = None
        step("model")
        model = tiny_llama(TinyLlamaSpec(model_id=MODEL_ID, max_position_embeddings=max(4096, 2 * longest * BLOCK_TOKENS)))
        self.mapper = KeyMapper(engine_namespace(model, MODEL_ID, block_tokens=BLOCK_TOKENS))
        per_node = max(1, pool_blocks // nodes)
        try:
            step("kvcc cluster")
            self.cluster = LocalCluster(workdir / "cluster", nodes=nodes, tiers=(f"dram={per_node * SLOT_BYTES}",),
                                        block_bytes=SLOT_BYTES, lease_term_ms=LEASE_TERM_MS, skew_ms=SKEW_MS,
                                        namespaces=[self.mapper.base])  # fmt: skip
            self.cluster.start()
            host, port = self.cluster.directory_address
            self.sub = KvEventSubscriber()
            self.stats: list[Path] = []
            self.views: list[Any] = []
            for i, node in enumerate(self.cluster.node_ids):
                stats = workdir / f"engine{i}-stats"
                extra = {"directory": f"{host}:{port}", "tenant": "engine", "token_hex": self.cluster.engine_token.hex(),
                         "model_id": MODEL_ID, "client_id": f"route{i}", "colocated_node": node, "skew_ms": SKEW_MS,
                         "stats_path": str(stats)}  # fmt: skip
                transfer = {"kv_connector": "KvccConnector", "kv_connector_module_path": "kvcc.adapters.vllm.connector",
                            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
                engine = harness.VllmEngine(model, served_name=MODEL_ID, num_blocks=longest + 16,
                                            max_model_len=(longest + 2) * BLOCK_TOKENS,
                                            extra_args=("--kv-transfer-config", _json.dumps(transfer)),
                                            extra_env={"VLLM_CPU_OMP_THREADS_BIND": cores(i, nodes)})  # fmt: skip
                self.engines.append(engine)
                self.stats.append(stats)
                step(f"vLLM engine {i + 1}/{nodes}")
                engine.start()
                self._warm(engine, longest)
                self.views.append(self.sub.add_engine(f"engine{i}", engine.events_endpoint, engine.replay_endpoint,
                                                      topic=engine.topic, keys=self.mapper))  # fmt: skip
        except harness.EngineError as e:
            self.close()
            raise LiveVllmError(f"a vLLM engine did not start: {e}") from e
        except Exception as e:
            self.close()
            raise LiveVllmError(f"the deployment did not start: {type(e).__name__}: {e}") from e

    @staticmethod
    def _warm(engine: Any, longest: int) -> None:
        """The first prefill of each length pays for the engine's buffers: prompts of 1, 2, 4 ...
        and ``longest`` blocks of one repeated token, untimed; ``empty`` then drops their blocks.
        The connector leaves them alone (``kvcc: skip``): each engine computes them itself. Loaded
        from kvcc, where the engine before had saved them, they would not warm the prefill; and
        on an AMX machine (this project's VM, vLLM 0.32's CPU attention) an engine whose first
        attention step ran over blocks the connector loaded died of SIGILL in
        ``cpu_attention_with_kv_cache`` -- the second engine, every time."""
        n = 1
        while True:
            engine.complete([VOCAB[2]] * (min(n, longest) * BLOCK_TOKENS + 1), max_tokens=1, timeout_s=REQUEST_TIMEOUT_S,
                            kv_transfer_params=WARM_UP_PARAMS)  # fmt: skip
            if n >= longest:
                return
            n *= 2

    def empty(self) -> None:
        """Every engine's prefix cache and kvcc's pool emptied; the views from an empty cache."""
        for i, engine in enumerate(self.engines):
            if not engine.reset_prefix_cache(REQUEST_TIMEOUT_S, external=True):
                sched = _connector_stats(self.stats[i], "scheduler")
                raise LiveVllmError(f"engine {i} refused to reset its prefix cache and kvcc's (its connector: "
                                    f"{sched.get('namespace_invalidations_unfinished', 0)} namespace invalidations "
                                    f"unfinished); its log ends:\n{engine.logs(15)}")  # fmt: skip
            # Its AllBlocksCleared goes out with the next step: a prompt shorter than a block
            # runs one and caches nothing.
            engine.complete([VOCAB[1]] * (BLOCK_TOKENS // 2), max_tokens=1, timeout_s=REQUEST_TIMEOUT_S)
        if not self.sub.wait_for(lambda: all(not v.hashes() for v in self.views), EVENTS_WAIT_S):
            raise LiveVllmError("an engine's events did not show its cache cleared")

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
        if self.sub is not None:
            self.sub.close()
        if self.cluster is not None:
            self.cluster.stop()


def replay(dep: _Deployment, trace: sim.Trace, policy_name: str, costs: sim.Costs,
           step: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """One policy's replay of ``trace`` on ``dep`` (emptied first)."""
    from kvcc.adapters.vllm.connector import wait_saves_settled

    nodes = len(dep.engines)
    dep.empty()
    before = [_save_stats(st) for st in dep.stats]
    policy = POLICIES[policy_name](nodes, sim.DEFAULT_SEED)
    busy_ms = [0.0] * nodes
    served = [0] * nodes
    ttfts: list[float] = []
    refs = local = loaded = events_late = 0
    for i, blocks in enumerate(trace.blocks):
        if i % 10 == 0:
            step(f"live vLLM: {policy_name}: request {i}/{len(trace.blocks)}")
        prompt = prompt_of(blocks)
        keys = dep.mapper.keys(prompt)
        dep.sub.pump(0.0)
        matched = [v.matched_blocks(keys) for v in dep.views]
        view = View(matched=matched, outstanding=[0] * nodes, queued_ms=[0.0] * nodes,
                    queued_prefill_blocks=[0] * nodes, active_blocks=[0] * nodes, assigned_ms=list(busy_ms),
                    occupancy=[len(v.hashes()) for v in dep.views], prefill_ms=costs.prefill_ms,
                    load_ms=costs.load_ms)  # fmt: skip
        j = policy.choose(Request(float(i), tuple(blocks)), view)
        engine, stats = dep.engines[j], dep.stats[j]
        loaded_before = _worker_stats(stats).get("loaded_blocks", 0)
        t0 = time.perf_counter()
        try:
            out = engine.complete(prompt, max_tokens=1, timeout_s=REQUEST_TIMEOUT_S)
        except Exception as e:
            raise LiveVllmError(f"request {i} to engine {j} failed: {type(e).__name__}: {e}") from e
        ttft_ms = (time.perf_counter() - t0) * 1000
        if not wait_saves_settled(lambda: _worker_stats(stats), REQUEST_TIMEOUT_S):
            raise LiveVllmError(f"request {i}: engine {j}'s saves did not finish")
        got = _worker_stats(stats).get("loaded_blocks", 0) - loaded_before
        hit = _cached_tokens(out) // BLOCK_TOKENS
        if not 0 <= got <= hit <= len(blocks):
            raise LiveVllmError(f"request {i}: engine {j} reports {hit} cached blocks of {len(blocks)}, "
                                f"its connector loaded {got}")  # fmt: skip
        refs += len(blocks)
        local += hit - got
        loaded += got
        busy_ms[j] += ttft_ms
        served[j] += 1
        ttfts.append(ttft_ms)
        if not dep.sub.wait_for(lambda: dep.views[j].matched_blocks(keys) == len(keys), EVENTS_WAIT_S):
            events_late += 1  # the router routes the next request on an older view
    mean = sum(busy_ms) / nodes
    saves: dict[str, int] = {}  # the connectors' save outcomes over this replay, every engine
    for st, was in zip(dep.stats, before, strict=True):
        for name, value in _save_stats(st).items():
            saves[name] = saves.get(name, 0) + value - was.get(name, 0)
    return {
        "hit_ratio": (local + loaded) / max(refs, 1),
        "local_hit_ratio": local / max(refs, 1),
        "kvcc_hit_ratio": loaded / max(refs, 1),
        "block_refs": refs,
        "max_mean_load": max(busy_ms) / mean if mean > 0 else 1.0,
        "requests_per_engine": served,
        "ttft_p50": sim.percentile(ttfts, 50),
        "ttft_p99": sim.percentile(ttfts, 99),
        "busy_s": round(sum(busy_ms) / 1000, 2),
        "events_late": events_late,
        "saves": {k: v for k, v in sorted(saves.items()) if v},
    }


def run(trace: sim.Trace, nodes_list: Sequence[int], capacities: Sequence[float], policy_names: Sequence[str],
        workdir: Path | None = None, step: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:  # fmt: skip
    """Every (N, F, policy) row for ``trace`` (already cut to the requests to replay): one
    deployment per (N, F), the policies in turn on it."""
    from kvcc.adapters.vllm import harness

    try:
        harness.check_installed()
    except harness.VllmNotInstalled as e:
        raise LiveVllmError(f"the vllm extra is required (bash scripts/setup.sh --with vllm): {e}") from e
    costs = sim.Costs()
    longest = max(len(b) for b in trace.blocks)
    infinite = sim.bound_infinite(trace)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvcc-routing-vllm-", dir=workdir) as tmp:
        for nodes in nodes_list:
            for fraction in capacities:
                capacity = sim.capacity_blocks(trace, fraction)
                pooled = sim.bound_pooled(trace, capacity)
                dep = _Deployment(nodes, capacity, longest, Path(tmp) / f"{nodes}-{fraction:g}", step)
                try:
                    for name in policy_names:
                        began = time.monotonic()
                        r = replay(dep, trace, name, costs, step)
                        rows.append({"trace": trace.name, "nodes": nodes, "capacity": fraction, "policy": name,
                                     "requests": len(trace.blocks), "engine_blocks": longest + 16,
                                     "bound_infinite": infinite, "bound_pooled": pooled,
                                     "vs_pooled": r["hit_ratio"] / pooled if pooled > 0 else None,
                                     "seconds": round(time.monotonic() - began, 1), **r})  # fmt: skip
                finally:
                    dep.close()
    return rows

