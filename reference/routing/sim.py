"""A discrete-event cluster simulator that replays Mooncake's request traces through routing
policies, with two hit-ratio bounds.

The cluster: N nodes, each a FIFO server with an LRU cache of C blocks (the total, a fraction F of
the trace's unique blocks, split evenly). A request arrives at its (time-scaled) timestamp, is
routed by a policy, and is served by its node in arrival order: service time = uncached blocks x
the prefill time of a block + cached blocks x the load time of a block. A request's cached blocks
are the consecutive prefix its node holds when service starts (later blocks cannot be reused
without the earlier ones); on service its blocks enter the node's cache (LRU, in order).

Because each node serves its queue in order and only its own requests change its cache, the cache
a request meets at service start is the cache after every request routed to that node before it.
The simulator therefore serves a request the moment it is routed (its hits and its finish time
are then known exactly), and a node's cache as policies see it holds the blocks of its queued
requests too: kvcc's directory knows of those from the write leases taken at admission.

Times are modelled by default (``Costs``; ``kvcc bench routing --calibrate`` measures them instead,
``kvcc.bench.routing.calibrate``): a block is 512 tokens; prefill at
``DEFAULT_PREFILL_TOKENS_PER_S`` (a 70B-class model's prefill on one 8-GPU node), loading a cached
block at ``DEFAULT_LOAD_GBPS`` with ``DEFAULT_KV_BYTES_PER_TOKEN`` (Llama-2-70B with GQA in fp16:
2 x 80 layers x 8 KV heads x 128 x 2 bytes). Decode is not modelled: the nodes are the prefill
instances of a disaggregated deployment, as in Mooncake.

Time scaling: arrivals are stretched or squeezed so that the cluster would run at utilisation U
if every node hit as well as the pooled bound: U = (service work under the pooled LRU) / (N x the
trace's span). A policy that hits worse runs hotter than U.

Bounds (block-granular, per trace and capacity): ``bound_infinite`` counts a block reference as a
hit if its id was seen before; ``bound_pooled`` runs one LRU cache of the total capacity over the
trace in arrival order, with no balance constraint. A routed cluster can beat the pooled LRU
slightly (N separate LRUs evict differently from one), never the infinite cache.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .policies import POLICIES, Policy, Replay, Request, View, cached_prefix

BLOCK_TOKENS = 512
DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0
DEFAULT_KV_BYTES_PER_TOKEN = 2 * 80 * 8 * 128 * 2
DEFAULT_LOAD_GBPS = 25.0
DEFAULT_SEED = 0
TRACES_DIR = Path("shared") / "data" / "mooncake-traces"
DEFAULT_TRACE_FILES = ("conversation_trace.first_half.jsonl", "synthetic_trace.jsonl")


class TraceError(Exception):
    """A trace file is missing or malformed (the message names the file and line)."""


# ------------------------------------------------------------------------------------- traces


@dataclass(frozen=True)
class Trace:
    """A trace as read: its name, arrival timestamps (ms, from the file) and prefix-block ids."""

    name: str
    timestamps: tuple[float, ...]
    blocks: tuple[tuple[int, ...], ...]

    @property
    def span_ms(self) -> float:
        return self.timestamps[-1] - self.timestamps[0] if self.timestamps else 0.0


def default_traces() -> list[Path]:
    """The shared Mooncake traces: ``shared/data`` sits in the repository or beside it (a
    worktree's checkout shares the main one's data)."""
    repo = Path(__file__).resolve().parents[2]
    for base in (repo, repo.parent):
        if (base / TRACES_DIR).is_dir():
            return [base / TRACES_DIR / name for name in DEFAULT_TRACE_FILES]
    raise TraceError(f"no {TRACES_DIR} in {repo} or {repo.parent}; pass --trace FILE")


def _parse_line(line: str, where: str) -> tuple[float, tuple[int, ...]]:
    try:
        record = json.loads(line)
        timestamp, hash_ids = record["timestamp"], record["hash_ids"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise TraceError(f"{where}: not a request with timestamp and hash_ids ({exc})") from None
    if not isinstance(timestamp, (int, float)) or isinstance(timestamp, bool):
        raise TraceError(f"{where}: timestamp is not a number")
    if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
        raise TraceError(f"{where}: hash_ids is not a list of integers")
    return float(timestamp), tuple(hash_ids)


def load_trace(path: Path, limit: int | None = None) -> Trace:
    """Read a JSON Lines trace (blank lines skipped), its first ``limit`` requests if given (a short
    slice, for a run that sends the requests to a real router); timestamps must not decrease."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1: {limit}")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from None
    timestamps: list[float] = []
    blocks: list[tuple[int, ...]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if limit is not None and len(timestamps) == limit:
            break
        if not line.strip():
            continue
        timestamp, hash_ids = _parse_line(line, f"{path}:{number}")
        if timestamps and timestamp < timestamps[-1]:
            raise TraceError(f"{path}:{number}: timestamp goes back in time")
        timestamps.append(timestamp)
        blocks.append(hash_ids)
    if not timestamps:
        raise TraceError(f"{path}: no requests")
    return Trace(Path(path).name, tuple(timestamps), tuple(blocks))


def unique_blocks(trace: Trace) -> int:
    return len({b for request in trace.blocks for b in request})


def block_refs(trace: Trace) -> int:
    return sum(len(request) for request in trace.blocks)


# ------------------------------------------------------------------------------------- bounds


def bound_infinite(trace: Trace) -> float:
    """Block refs whose id was seen before / block refs: no cache does better."""
    seen: set[int] = set()
    hits = 0
    for request in trace.blocks:
        hits += sum(1 for b in request if b in seen)
        seen.update(request)
    return hits / max(block_refs(trace), 1)


class LruCache:
    """An LRU set of block ids of a fixed capacity; a request touches its blocks in order, so an
    earlier block of a prefix is always evicted before a later one."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def prefix(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks``, from the first, are cached (a walk until the first miss)."""
        return cached_prefix(blocks, self._blocks)

    def touch(self, blocks: Iterable[int]) -> None:
        """Use ``blocks`` in order: each becomes the most recent; evict the least recent beyond capacity."""
        cache = self._blocks
        for b in blocks:
            if b in cache:
                cache.move_to_end(b)
            else:
                cache[b] = None
                if len(cache) > self.capacity:
                    cache.popitem(last=False)


def capacity_blocks(trace: Trace, fraction: float) -> int:
    """The total cache, ``fraction`` of the trace's unique blocks (as in the traces' README)."""
    return int(fraction * unique_blocks(trace))


def pooled_hits(trace: Trace, capacity: int) -> list[int]:
    """Per request, the cached prefix of one LRU cache of ``capacity`` blocks over the whole trace."""
    cache = LruCache(capacity)
    hits = []
    for request in trace.blocks:
        hits.append(cache.prefix(request))
        cache.touch(request)
    return hits


def bound_pooled(trace: Trace, capacity: int) -> float:
    """Block refs one LRU cache of ``capacity`` blocks hits / block refs (``pooled_hits``)."""
    return sum(pooled_hits(trace, capacity)) / max(block_refs(trace), 1)


# ---------------------------------------------------------------------------------- simulator


@dataclass(frozen=True)
class Costs:
    """Per-block times: modelled by default, or from what ``kvcc.bench.routing.calibrate`` measured."""

    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    load_gbps: float = DEFAULT_LOAD_GBPS
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN

    @property
    def prefill_ms(self) -> float:
        return 1000.0 * BLOCK_TOKENS / self.prefill_tokens_per_s

    @property
    def load_ms(self) -> float:
        return 1000.0 * BLOCK_TOKENS * self.kv_bytes_per_token / (self.load_gbps * 1e9)

    def service_ms(self, blocks: int, hits: int) -> float:
        return (blocks - hits) * self.prefill_ms + hits * self.load_ms


@dataclass
class Queue:
    """One server's FIFO queue: its finish time, the work assigned to it, and its outstanding
    requests as (finish ms, uncached blocks, blocks), in finish order."""

    busy_until: float = 0.0
    assigned_ms: float = 0.0
    outstanding: deque[tuple[float, int, int]] = field(default_factory=deque)
    prefill_blocks: int = 0
    active_blocks: int = 0

    def advance(self, now: float) -> None:
        """Retire the requests finished by ``now``."""
        while self.outstanding and self.outstanding[0][0] <= now:
            _, uncached, blocks = self.outstanding.popleft()
            self.prefill_blocks -= uncached
            self.active_blocks -= blocks

    def serve(self, now: float, service_ms: float, blocks: int, hits: int) -> float:
        """Queue a request of ``blocks`` blocks (``hits`` of them cached) arriving at ``now`` and
        taking ``service_ms``: its time to first token (queueing + service)."""
        self.busy_until = max(self.busy_until, now) + service_ms
        self.assigned_ms += service_ms
        self.outstanding.append((self.busy_until, blocks - hits, blocks))
        self.prefill_blocks += blocks - hits
        self.active_blocks += blocks
        return self.busy_until - now


@dataclass
class Node(Queue):
    """One simulated server: its queue and its LRU cache."""

    cache: LruCache = field(default_factory=lambda: LruCache(0))


def _view(nodes: list[Node], request: Request, now: float, costs: Costs) -> View:
    return View(
        matched=[n.cache.prefix(request.blocks) for n in nodes],
        outstanding=[len(n.outstanding) for n in nodes],
        queued_ms=[max(n.busy_until - now, 0.0) for n in nodes],
        queued_prefill_blocks=[n.prefill_blocks for n in nodes],
        active_blocks=[n.active_blocks for n in nodes],
        assigned_ms=[n.assigned_ms for n in nodes],
        occupancy=[len(n.cache) for n in nodes],
        prefill_ms=costs.prefill_ms,
        load_ms=costs.load_ms,
    )


def time_scale(trace: Trace, hits: Sequence[int], nodes: int, utilisation: float, costs: Costs) -> float:
    """The factor on inter-arrival times that makes the cluster run at ``utilisation`` when every
    request hits as in ``hits`` (the pooled bound's)."""
    work = sum(costs.service_ms(len(b), h) for b, h in zip(trace.blocks, hits, strict=True))
    if trace.span_ms <= 0:
        return 1.0  # every request at one instant: no spacing to scale
    return work / (nodes * utilisation * trace.span_ms)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (nearest rank) of ``values``; None for none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n q / 100) in integers: no float rounding up
    return ordered[int(rank) - 1]


def simulate(trace: Trace, policy: Policy, nodes: int, capacity: int, scale: float, costs: Costs) -> dict[str, float]:
    """Replay ``trace`` through ``policy`` on ``nodes`` servers with ``capacity`` blocks in all."""
    cluster = [Node(cache=LruCache(capacity // nodes)) for _ in range(nodes)]
    t0 = trace.timestamps[0]
    hits = refs = 0
    ttfts = []
    for timestamp, blocks in zip(trace.timestamps, trace.blocks, strict=True):
        now = (timestamp - t0) * scale
        for node in cluster:
            node.advance(now)
        request = Request(now, blocks)
        chosen = policy.choose(request, _view(cluster, request, now, costs))
        node = cluster[chosen]
        hit = node.cache.prefix(blocks)
        node.cache.touch(blocks)
        ttfts.append(node.serve(now, costs.service_ms(len(blocks), hit), len(blocks), hit))
        hits, refs = hits + hit, refs + len(blocks)
    mean_work = sum(n.assigned_ms for n in cluster) / nodes
    return {
        "hit_ratio": hits / max(refs, 1),
        "max_mean_load": max(n.assigned_ms for n in cluster) / mean_work if mean_work > 0 else 1.0,
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
    }


# ---------------------------------------------------------------------------------- SLA


SLA_UTILISATION_RANGE = (0.02, 2.0)  # the utilisations the search spans (at the pooled bound's hits)
SLA_STEPS = 14  # bisection steps: the range to about 1/8000 of its width
RECOMPUTE = "recompute"  # the baseline row: no cache at all, round robin


def throughput_rps(trace: Trace, scale: float) -> float:
    """Requests per second when the trace's arrivals are stretched by ``scale``."""
    span_s = trace.span_ms * scale / 1000.0
    return len(trace.blocks) / span_s if span_s > 0 else math.inf


def sla_point(trace: Trace, make_policy: Callable[[], Policy], nodes: int, capacity: int, pooled: Sequence[int],
              bound_ms: float, costs: Costs) -> dict[str, Any]:  # fmt: skip
    """The highest load at which the p99 TTFT stays within ``bound_ms`` (MLPerf's server scenario:
    throughput at a latency bound), by bisection over the utilisation the arrivals are scaled to
    (``time_scale``, against the pooled bound's hits, so that every policy is offered the same
    arrival rates). ``max_rps`` is None when even the lightest load in ``SLA_UTILISATION_RANGE``
    misses the bound; ``capped`` says the heaviest load still met it."""
    lo, hi = SLA_UTILISATION_RANGE
    at_lo = simulate(trace, make_policy(), nodes, capacity, time_scale(trace, pooled, nodes, lo, costs), costs)
    if at_lo["ttft_p99"] > bound_ms:
        return {"max_rps": None, "utilisation": None, **at_lo, "capped": False}
    at_hi = simulate(trace, make_policy(), nodes, capacity, time_scale(trace, pooled, nodes, hi, costs), costs)
    if at_hi["ttft_p99"] <= bound_ms:
        best, best_u, capped = at_hi, hi, True
    else:
        best, best_u, capped = at_lo, lo, False
        for _ in range(SLA_STEPS):
            mid = (lo + hi) / 2
            result = simulate(trace, make_policy(), nodes, capacity, time_scale(trace, pooled, nodes, mid, costs), costs)
            if result["ttft_p99"] <= bound_ms:
                lo, best, best_u = mid, result, mid
            else:
                hi = mid
    scale = time_scale(trace, pooled, nodes, best_u, costs)
    return {"max_rps": throughput_rps(trace, scale), "utilisation": best_u, **best, "capped": capped}


def sla(trace: Trace, nodes_list: Sequence[int], capacities: Sequence[float], policy_names: Sequence[str],
        bound_ms: float, costs: Costs = Costs(), seed: int = DEFAULT_SEED) -> list[dict[str, Any]]:  # fmt: skip
    """Per (N, F): each policy's throughput at the p99 TTFT bound, beside the ``RECOMPUTE`` baseline
    (no cache, round robin) and round robin with its node-local caches (caching without routing for
    it), each as a ratio (``vs_recompute``, ``vs_round_robin``)."""
    if bound_ms <= 0:
        raise ValueError(f"the TTFT bound must be positive: {bound_ms}")
    rows = []
    for capacity in capacities:
        total = capacity_blocks(trace, capacity)
        pooled = pooled_hits(trace, total)
        for nodes in nodes_list:
            check_configuration(nodes, capacity, 1.0)
            points = {RECOMPUTE: sla_point(trace, lambda: POLICIES["round_robin"](nodes, seed), nodes, 0, pooled,
                                           bound_ms, costs)}  # fmt: skip
            for name in dict.fromkeys(("round_robin", *policy_names)):
                points[name] = sla_point(trace, lambda name=name: POLICIES[name](nodes, seed), nodes, total, pooled,
                                         bound_ms, costs)  # fmt: skip
            base, local = points[RECOMPUTE]["max_rps"], points["round_robin"]["max_rps"]
            for name, p in points.items():
                rows.append({
                    "trace": trace.name, "nodes": nodes, "capacity": capacity, "bound_ms": bound_ms, "policy": name,
                    **p,
                    "vs_recompute": _ratio(p["max_rps"], base), "vs_round_robin": _ratio(p["max_rps"], local),
                })  # fmt: skip
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def check_configuration(nodes: int, capacity: float, utilisation: float) -> None:
    """Raise ValueError on a configuration the simulator cannot run."""
    if nodes < 1:
        raise ValueError(f"nodes must be at least 1: {nodes}")
    if not 0 < capacity <= 1:
        raise ValueError(f"capacity must be in (0, 1]: {capacity}")
    if utilisation <= 0:
        raise ValueError(f"utilisation must be positive: {utilisation}")


def _row(trace: Trace, nodes: int, capacity: float, utilisation: float, name: str, result: dict[str, float],
         infinite: float, bound_pooled: float) -> dict[str, Any]:  # fmt: skip
    return {
        "trace": trace.name, "nodes": nodes, "capacity": capacity, "utilisation": utilisation,
        "policy": name, **result, "bound_infinite": infinite, "bound_pooled": bound_pooled,
        "vs_pooled": result["hit_ratio"] / bound_pooled if bound_pooled > 0 else None,
    }  # fmt: skip


def run(trace: Trace, nodes_list: Sequence[int], capacities: Sequence[float], utilisations: Sequence[float],
        policy_names: Sequence[str], costs: Costs = Costs(), seed: int = DEFAULT_SEED,
        replays: Mapping[str, Mapping[int, Sequence[int]]] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """One row per (nodes, capacity, utilisation, policy) on ``trace``, with the bounds; then, per
    configuration, one row per recorded assignment in ``replays`` (row name -> nodes -> the node of
    each request, as a router outside the simulator chose it) that has one for its N."""
    infinite = bound_infinite(trace)
    refs = max(block_refs(trace), 1)
    for name, by_nodes in (replays or {}).items():
        for nodes, assignment in by_nodes.items():
            if len(assignment) != len(trace.blocks):
                raise ValueError(f"{name} at N={nodes}: {len(assignment)} recorded requests, "
                                 f"{len(trace.blocks)} in {trace.name}")  # fmt: skip
    rows = []
    for capacity in capacities:
        total = capacity_blocks(trace, capacity)
        pooled = pooled_hits(trace, total)
        bound_pooled = sum(pooled) / refs
        for nodes in nodes_list:
            for utilisation in utilisations:
                check_configuration(nodes, capacity, utilisation)
                scale = time_scale(trace, pooled, nodes, utilisation, costs)
                policies: list[tuple[str, Policy]] = [(name, POLICIES[name](nodes, seed)) for name in policy_names]
                policies += [(name, Replay(by_nodes[nodes])) for name, by_nodes in (replays or {}).items()
                             if nodes in by_nodes]  # fmt: skip
                for name, policy in policies:
                    result = simulate(trace, policy, nodes, total, scale, costs)
                    rows.append(_row(trace, nodes, capacity, utilisation, name, result, infinite, bound_pooled))
    return rows
