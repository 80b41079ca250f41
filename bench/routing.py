"""Benchmark: request routing on Mooncake's traces (``kvcc bench routing``).

What is measured
----------------
``kvcc.reference.routing.sim`` replays each trace through each routing policy on a simulated
cluster (N nodes, LRU caches of a fraction F of the trace's unique blocks in all, arrivals scaled
to a utilisation U) and reports, per (trace, N, F, U, policy): ``hit_ratio`` (cached blocks used /
block refs), ``bound_infinite`` and ``bound_pooled`` (one LRU of the total capacity),
``vs_pooled`` = hit_ratio / bound_pooled, ``max_mean_load`` (the busiest node's assigned service
work / the mean) and ``ttft_p50`` / ``ttft_p99`` (queueing + service, ms). Service times are
modelled (``sim.Costs``: a 70B-class model on a GPU node) unless ``--calibrate`` measures them first,
in the same run, for what runs here (``calibrate``: the tiny Llama's prefill on this CPU, the
reference DRAM tier's read of its KV block).

Target (the routing issue): a kvcc policy (``KVCC_POLICIES``) at least ``TARGET_VS_POOLED`` of
the pooled bound with max/mean load at most ``TARGET_MAX_MEAN_LOAD``, and a hit ratio above the
SGLang and Dynamo baselines', on the conversation trace. A benchmark reports; it does not fail on a
missed target. Exit code 2 on bad input (a missing or malformed trace, a configuration out of
range, ``--smg`` without the smg router installed, smg failing to start or to route every request
once).

``--smg`` adds the real SGLang router (``smg``, ``bench/smg_router.py``): for each trace, N and
``--smg-policy``, smg routes the trace's requests to N stand-in workers on loopback, and its
assignment is replayed through the simulator as the row ``smg:<policy>`` of every (F, U)
configuration, so that the ``sglang_cache_aware`` model can be read against the router itself.
``smg:cache_aware`` then counts as a baseline for the target. ``--limit N`` keeps the first N
requests of each trace (a live run sends every request through smg).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from itertools import groupby
from pathlib import Path
from typing import Any

from kvcc.bench import smg_router
from kvcc.reference.routing import sim
from kvcc.reference.routing.policies import KVCC_POLICIES, POLICIES

DEFAULT_NODES = (4, 8)
DEFAULT_CAPACITIES = (0.25, 0.5)
DEFAULT_UTILISATIONS = (0.7, 0.9)
TARGET_VS_POOLED = 0.95
TARGET_MAX_MEAN_LOAD = 1.1
BASELINES = ("sglang_cache_aware", "dynamo_cost", "smg:cache_aware")
CONFIG_KEYS = ("trace", "nodes", "capacity", "utilisation")
LIVE_DEFAULT_LIMIT = 300  # = routing_live.DEFAULT_LIMIT (not imported here: it pulls the cluster in)
VLLM_DEFAULT_LIMIT = 100  # = routing_vllm.DEFAULT_LIMIT


def check_target(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """For one configuration's rows: kvcc's best policy within the load bound, and whether it
    reaches the pooled-bound fraction and beats each baseline that was run."""
    by_policy = {r["policy"]: r for r in rows}
    balanced = [r for r in rows if r["policy"] in KVCC_POLICIES and r["max_mean_load"] <= TARGET_MAX_MEAN_LOAD]
    best = max(balanced, key=lambda r: r["hit_ratio"], default=None)
    out = {k: rows[0][k] for k in CONFIG_KEYS}
    if best is None:
        return {**out, "best": None, "met": False}
    ahead = all(best["hit_ratio"] > by_policy[b]["hit_ratio"] for b in BASELINES if b in by_policy)
    met = (best["vs_pooled"] or 0) >= TARGET_VS_POOLED and ahead
    return {**out, "best": best["policy"], "vs_pooled": best["vs_pooled"], "ahead_of_baselines": ahead, "met": met}


def targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``check_target`` for each configuration that ran at least one kvcc policy."""
    out = []
    for _, group in groupby(rows, key=lambda r: tuple(r[k] for k in CONFIG_KEYS)):
        group = list(group)
        if any(r["policy"] in KVCC_POLICIES for r in group):
            out.append(check_target(group))
    return out


def smg_replays(trace: sim.Trace, nodes: Sequence[int], policies: Sequence[str],
                concurrency: int) -> tuple[dict[str, dict[int, tuple[int, ...]]], list[dict[str, Any]]]:  # fmt: skip
    """Route ``trace`` through smg once per (policy, N): the assignments (row name -> N -> node per
    request) and what each run took."""
    replays: dict[str, dict[int, tuple[int, ...]]] = {}
    runs = []
    for policy in policies:
        for n in nodes:
            run = smg_router.route(trace.blocks, policy, n, concurrency)
            replays.setdefault(f"smg:{policy}", {})[n] = run.assignment
            runs.append({"trace": trace.name, "nodes": n, "policy": policy, "requests": len(trace.blocks),
                         "wall_s": run.wall_s, "probes": sorted(run.probes)})  # fmt: skip
    return replays, runs


CALIBRATION_REPS = 5  # timed prefills of one block, after one untimed
CALIBRATION_TIER_TRIALS = 3
CALIBRATION_MEMORY_BYTES = 64 << 20  # bytes moved per timed tier trial (DRAM)
CALIBRATION_FILE_BYTES = 32 << 20  # ... (NVMe)


class CalibrationError(Exception):
    """The costs could not be measured here (the vllm extra missing, the model not built)."""


def calibrate(on_progress: Any = None) -> tuple[sim.Costs, dict[str, Any]]:
    """The simulator's costs measured on this machine, in this run, for the model the vLLM adapter
    serves here (``kvcc.adapters.vllm.model``'s tiny Llama): its prefill speed, the median of
    ``CALIBRATION_REPS`` forward passes of one block (``sim.BLOCK_TOKENS`` random tokens, KV cache
    on, ``transformers`` on CPU, every core torch uses); its KV bytes per token from its shape; and
    loading a cached block at the verified read bandwidth of the reference's DRAM tier for a block
    of that size (``kvcc bench tiers``' measurement). The NVMe tier's read is reported beside it.
    Returns the costs and what was measured."""
    import statistics
    import time

    try:
        import torch
        from transformers import AutoModelForCausalLM

        from kvcc.adapters.vllm.model import TinyLlamaSpec, read_revision, tiny_llama
    except ImportError as e:
        raise CalibrationError(f"--calibrate needs the vllm extra (bash scripts/setup.sh --with vllm): {e}") from None
    from kvcc.bench import tiers

    step = on_progress or (lambda text: None)
    spec = TinyLlamaSpec()
    step("calibrate: the tiny Llama")
    path = tiny_llama(spec)
    dtype = getattr(torch, spec.torch_dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    tokens = torch.randint(0, spec.vocab_size, (1, sim.BLOCK_TOKENS), generator=torch.Generator().manual_seed(0))
    times = []
    with torch.inference_mode():
        for i in range(CALIBRATION_REPS + 1):
            t0 = time.perf_counter()
            out = model(input_ids=tokens, use_cache=True)
            if i:
                times.append(time.perf_counter() - t0)
    if out.past_key_values is None:
        raise CalibrationError("the model's forward pass returned no KV cache")
    prefill_tokens_per_s = sim.BLOCK_TOKENS / statistics.median(times)
    kv_bytes_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * dtype.itemsize
    block_bytes = kv_bytes_per_token * sim.BLOCK_TOKENS
    step(f"calibrate: tier reads of {block_bytes >> 10} KiB blocks")
    t = tiers.measure(sizes=[block_bytes], tiers=("dram", "nvme"), trials=CALIBRATION_TIER_TRIALS,
                      memory_trial_bytes=CALIBRATION_MEMORY_BYTES, file_trial_bytes=CALIBRATION_FILE_BYTES)  # fmt: skip
    reads = {r["tier"]: r["tier_gb_per_s"] for r in t["rows"] if r["op"] == "read"}
    costs = sim.Costs(prefill_tokens_per_s=prefill_tokens_per_s, load_gbps=reads["dram"],
                      kv_bytes_per_token=kv_bytes_per_token)  # fmt: skip
    measured = {
        "model": spec.model_id, "revision": read_revision(path)[:16], "layers": spec.num_layers,
        "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "dtype": spec.torch_dtype,
        "prefill_s_per_block": sorted(times), "prefill_tokens_per_s": prefill_tokens_per_s,
        "torch_threads": torch.get_num_threads(), "block_bytes": block_bytes,
        "dram_read_gb_per_s": reads["dram"], "nvme_read_gb_per_s": reads.get("nvme"),
        "nvme_load_ms_per_block": 1000.0 * block_bytes / (reads["nvme"] * 1e9) if reads.get("nvme") else None,
        "against": "prefill: transformers forward of one block on this CPU; load: the reference DRAM tier's "
                   "verified read of one block (kvcc bench tiers), same run",
    }  # fmt: skip
    return costs, measured


def measure(traces: Iterable[Path], nodes: Sequence[int], capacities: Sequence[float],
            utilisations: Sequence[float], policies: Sequence[str], limit: int | None = None,
            smg_policies: Sequence[str] = (), smg_concurrency: int = 1,
            sla_ms: float | None = None, costs: sim.Costs | None = None,
            calibration: dict[str, Any] | None = None, live: bool = False,
            step: Any = None, live_vllm: bool = False) -> dict[str, Any]:  # fmt: skip
    """Every (trace, N, F, U, policy) row; ``costs`` the simulator's per-block times (default
    ``sim.Costs()``, modelled), ``calibration`` what measured them when they were measured;
    ``live``: also each row replayed through a local kvcc cluster (``routing_live``), on the first
    ``limit`` requests (``routing_live.DEFAULT_LIMIT`` if none); ``live_vllm``: also through real
    vLLM engines sharing a kvcc cluster (``routing_vllm``, ``routing_vllm.DEFAULT_LIMIT`` if no
    ``limit``)."""
    from kvcc.bench import routing_live

    costs = costs or sim.Costs()
    rows = []
    sla_rows: list[dict[str, Any]] = []
    smg_runs: list[dict[str, Any]] = []
    live_rows: list[dict[str, Any]] = []
    vllm_rows: list[dict[str, Any]] = []
    for path in traces:
        trace = sim.load_trace(path, limit)
        replays, runs = smg_replays(trace, nodes, smg_policies, smg_concurrency)
        smg_runs += runs
        rows += sim.run(trace, nodes, capacities, utilisations, policies, costs, replays=replays)
        if sla_ms is not None:
            sla_rows += sim.sla(trace, nodes, capacities, policies, sla_ms, costs)
        if live:
            cut = trace if limit is not None else sim.load_trace(path, routing_live.DEFAULT_LIMIT)
            live_rows += routing_live.run(cut, nodes, capacities, utilisations, policies, costs, step=step)
        if live_vllm:
            from kvcc.bench import routing_vllm

            cut = trace if limit is not None else sim.load_trace(path, routing_vllm.DEFAULT_LIMIT)
            vllm_rows += routing_vllm.run(cut, nodes, capacities, policies, step=step or (lambda _: None))
    out = {
        "costs": {"prefill_ms_per_block": costs.prefill_ms, "load_ms_per_block": costs.load_ms,
                  "block_tokens": sim.BLOCK_TOKENS, "prefill_tokens_per_s": costs.prefill_tokens_per_s,
                  "load_gbps": costs.load_gbps, "kv_bytes_per_token": costs.kv_bytes_per_token,
                  "measured": calibration},
        "limit": limit,
        "rows": rows,
        "targets": targets(rows),
        "beats_pooled": [{k: r[k] for k in (*CONFIG_KEYS, "policy", "vs_pooled")}
                         for r in rows if r["hit_ratio"] > r["bound_pooled"]],
    }  # fmt: skip
    if smg_policies:
        out["smg"] = {"concurrency": smg_concurrency, "runs": smg_runs}
    if live:
        out["live"] = {"block_bytes": routing_live.BLOCK_BYTES, "rows": live_rows,
                       "against": "bound_pooled and bound_infinite of the same requests, same run; ttft: the "
                                  "prefill of the blocks not read (costs above) plus the measured lookup and reads"}  # fmt: skip
    if live_vllm:
        out["live_vllm"] = {"block_tokens": 32, "rows": vllm_rows,
                            "against": "bound_pooled (kvcc's capacity) and bound_infinite of the same requests, same "
                                       "run; ttft: each request's completion on loopback, one request at a time"}  # fmt: skip
    if sla_ms is not None:
        out["sla"] = {"bound": f"p99 TTFT <= {sla_ms:g} ms", "rows": sla_rows,
                      "recompute_vs_load_per_block": costs.prefill_ms / costs.load_ms}  # fmt: skip
    return out


def render(console: Any, r: dict[str, Any]) -> None:
    from rich.table import Table

    c = r["costs"]
    how = "modelled" if c.get("measured") is None else "measured here, the tiny Llama"
    t = Table(title=f"routing on Mooncake traces ({how}: prefill {c['prefill_ms_per_block']:.2f} ms/block, "
                    f"load {c['load_ms_per_block']:.3f} ms/block)")  # fmt: skip
    for col in ("trace", "N", "cap", "U", "policy", "hit", "pooled", "infinite", "vs pooled", "max/mean",
                "p50 ms", "p99 ms"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("trace", "policy") else "right")
    for x in r["rows"]:
        t.add_row(x["trace"].split("_trace")[0], str(x["nodes"]), f"{x['capacity']:g}", f"{x['utilisation']:g}",
                  x["policy"], f"{x['hit_ratio']:.4f}", f"{x['bound_pooled']:.4f}", f"{x['bound_infinite']:.4f}",
                  "-" if x["vs_pooled"] is None else f"{x['vs_pooled']:.3f}", f"{x['max_mean_load']:.3f}",
                  f"{x['ttft_p50']:,.0f}", f"{x['ttft_p99']:,.0f}")  # fmt: skip
    console.print(t)
    for x in r["targets"]:
        verdict = "met" if x["met"] else "missed"
        if x["best"] and not x["ahead_of_baselines"]:
            verdict += " (a baseline hits more)"
        best = f"{x['best']} {x['vs_pooled']:.3f} of pooled" if x["best"] else "no kvcc policy within the load bound"
        console.print(f"target {x['trace'].split('_trace')[0]} N={x['nodes']} cap={x['capacity']:g} "
                      f"U={x['utilisation']:g}: {best}: {verdict}")  # fmt: skip
    for x in r.get("smg", {}).get("runs", []):
        console.print(f"[dim]smg {x['policy']} routed {x['requests']} requests of {x['trace']} over {x['nodes']} "
                      f"stand-in workers in {x['wall_s']:.1f} s[/]")  # fmt: skip
    if "sla" in r:
        render_sla(console, r["sla"])
    if "live" in r:
        render_live(console, r["live"])
    if "live_vllm" in r:
        render_live_vllm(console, r["live_vllm"])
    for x in r["beats_pooled"]:
        console.print(f"[dim]{x['policy']} beats the pooled LRU on {x['trace']} N={x['nodes']} "
                      f"cap={x['capacity']:g} U={x['utilisation']:g} ({x['vs_pooled']:.4f})[/]")  # fmt: skip


def render_sla(console: Any, s: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"throughput at {s['bound']} (recompute baseline: no cache; round robin: node-local caches; "
                    f"a cached block loads {s['recompute_vs_load_per_block']:.1f}x faster than it recomputes)")
    for col in ("trace", "N", "cap", "policy", "max req/s", "vs recompute", "vs round robin", "hit", "p50 ms",
                "p99 ms"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("trace", "policy") else "right")
    for x in s["rows"]:
        rps = "misses the bound" if x["max_rps"] is None else f"{x['max_rps']:.3f}" + ("+" if x["capped"] else "")
        t.add_row(x["trace"].split("_trace")[0], str(x["nodes"]), f"{x['capacity']:g}", x["policy"], rps,
                  _fmt_ratio(x["vs_recompute"]), _fmt_ratio(x["vs_round_robin"]), f"{x['hit_ratio']:.4f}",
                  f"{x['ttft_p50']:,.0f}", f"{x['ttft_p99']:,.0f}")  # fmt: skip
    console.print(t)


def render_live(console: Any, live: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"live: through a local kvcc cluster ({live['block_bytes']} B blocks; {live['against']})")
    for col in ("trace", "N", "cap", "U", "policy", "requests", "hit", "pooled", "vs pooled", "local", "max/mean",
                "p50 ms", "p99 ms", "cache ms p50", "write ms p50", "evictions", "refused"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("trace", "policy") else "right")
    for x in live["rows"]:
        t.add_row(x["trace"].split("_trace")[0], str(x["nodes"]), f"{x['capacity']:g}", f"{x['utilisation']:g}",
                  x["policy"], str(x["requests"]), f"{x['hit_ratio']:.4f}", f"{x['bound_pooled']:.4f}",
                  _fmt_ratio(x["vs_pooled"]), _fmt_ratio(x["local_share"]), f"{x['max_mean_load']:.3f}",
                  f"{x['ttft_p50']:,.0f}", f"{x['ttft_p99']:,.0f}", f"{x['cache_ms_p50']:.2f}",
                  f"{x['write_ms_p50']:.2f}", str(x["evictions"]), str(x["refused_writes"]))  # fmt: skip
    console.print(t)


def render_live_vllm(console: Any, live: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"live: through vLLM engines sharing a kvcc cluster ({live['block_tokens']}-token blocks; "
                    f"{live['against']})")  # fmt: skip
    for col in ("trace", "N", "cap", "policy", "requests", "hit", "local", "kvcc", "pooled", "vs pooled", "infinite",
                "max/mean", "p50 ms", "p99 ms", "per engine", "saved", "refused"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("trace", "policy") else "right")
    for x in live["rows"]:
        t.add_row(x["trace"].split("_trace")[0], str(x["nodes"]), f"{x['capacity']:g}", x["policy"], str(x["requests"]),
                  f"{x['hit_ratio']:.4f}", f"{x['local_hit_ratio']:.4f}", f"{x['kvcc_hit_ratio']:.4f}",
                  f"{x['bound_pooled']:.4f}", _fmt_ratio(x["vs_pooled"]), f"{x['bound_infinite']:.4f}",
                  f"{x['max_mean_load']:.3f}", f"{x['ttft_p50']:,.1f}", f"{x['ttft_p99']:,.1f}",
                  "/".join(map(str, x["requests_per_engine"])), str(x["saves"].get("saved_blocks", 0)),
                  str(sum(v for k, v in x["saves"].items() if k.startswith("save_refused_"))))  # fmt: skip
    console.print(t)


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


# ------------------------------------------------------------------------------- entry points


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, action="append", metavar="FILE",
                        help="a Mooncake JSON Lines trace, repeatable (default: both shared traces)")
    parser.add_argument("--nodes", type=int, nargs="+", default=list(DEFAULT_NODES), metavar="N",
                        help=f"cluster sizes (default {' '.join(map(str, DEFAULT_NODES))})")
    parser.add_argument("--capacity", type=float, nargs="+", default=list(DEFAULT_CAPACITIES), metavar="F",
                        help="total cache as a fraction of the trace's unique blocks, in (0, 1] "
                             f"(default {' '.join(map(str, DEFAULT_CAPACITIES))})")
    parser.add_argument("--utilisation", type=float, nargs="+", default=list(DEFAULT_UTILISATIONS), metavar="U",
                        help="target utilisation at the pooled bound's hit ratio "
                             f"(default {' '.join(map(str, DEFAULT_UTILISATIONS))})")
    parser.add_argument("--policy", nargs="+", choices=list(POLICIES), default=list(POLICIES), metavar="NAME",
                        help=f"policies (default all: {', '.join(POLICIES)})")
    parser.add_argument("--limit", type=int, metavar="N",
                        help="the first N requests of each trace (default all)")
    parser.add_argument("--smg", action="store_true",
                        help="also route each trace through the real SGLang router (smg) over stand-in workers "
                             "and replay its assignment as rows smg:<policy>")
    parser.add_argument("--smg-policy", nargs="+", choices=list(smg_router.SMG_POLICIES), metavar="NAME",
                        help="smg's policies (implies --smg; default cache_aware): "
                             + ", ".join(smg_router.SMG_POLICIES))
    parser.add_argument("--smg-concurrency", type=int, default=1, metavar="C",
                        help="requests in flight at smg at most (default 1: smg routes in the trace's order; "
                             "the stand-ins answer at once, so smg's load rules see at most C outstanding)")
    parser.add_argument("--sla-ms", type=float, metavar="MS",
                        help="also report each policy's throughput at p99 TTFT <= MS (MLPerf-style), beside a "
                             "recompute baseline (no cache) and round robin with node-local caches")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure the per-block costs here first (the tiny Llama's prefill on this CPU, the "
                             "reference DRAM tier's read of its KV block) instead of the modelled 70B-class ones")
    parser.add_argument("--live", action="store_true",
                        help="also replay each configuration through a local kvcc cluster (a directory and N cache "
                             "nodes on loopback, one per replay), on the first --limit requests (default "
                             f"{LIVE_DEFAULT_LIMIT}): hits read from kvcc, evictions by kvcc's rules, lookups and "
                             "reads timed")
    parser.add_argument("--live-vllm", action="store_true",
                        help="also replay each (N, F) through N real vLLM engines (the vllm extra) sharing a kvcc "
                             "cluster, routed by their KV events, on the first --limit requests (default "
                             f"{VLLM_DEFAULT_LIMIT}), one at a time; --utilisation does not apply")
    parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")  # fmt: skip


def cli(args: argparse.Namespace) -> int:
    from kvcc.bench import routing_live, routing_vllm
    from kvcc.console import print_json, stdout_console

    smg_policies = args.smg_policy or (["cache_aware"] if args.smg else [])
    try:
        for nodes in args.nodes:
            for capacity in args.capacity:
                for utilisation in args.utilisation:
                    sim.check_configuration(nodes, capacity, utilisation)
        if smg_policies:
            smg_router.require_smg()
            if args.smg_concurrency < 1:
                raise ValueError(f"--smg-concurrency must be at least 1: {args.smg_concurrency}")
        if args.sla_ms is not None and not args.sla_ms > 0:
            raise ValueError(f"--sla-ms must be positive: {args.sla_ms}")
        traces = args.trace or sim.default_traces()
        for path in traces:
            sim.load_trace(path, 1)  # a bad trace is refused before anything is measured
        from kvcc.bench.suite import _progress

        with _progress(not args.json and (args.calibrate or args.live or args.live_vllm)) as progress:
            task = progress.add_task("bench routing", total=None)

            def step(text: str) -> None:
                progress.update(task, description=text)

            costs, calibration = calibrate(step) if args.calibrate else (None, None)
            step("simulating")
            r = measure(traces, args.nodes, args.capacity, args.utilisation, args.policy, args.limit, smg_policies,
                        args.smg_concurrency, args.sla_ms, costs, calibration, args.live, step, args.live_vllm)  # fmt: skip
    except (ValueError, sim.TraceError, smg_router.SmgError, CalibrationError, routing_live.LiveError,
            routing_vllm.LiveVllmError) as exc:
        print(f"kvcc bench routing: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print_json(r)
    else:
        render(stdout_console(), r)
    return 0


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcc.bench.routing", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return cli(parser.parse_args(list(argv) if argv is not None else None))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
