"""Request-routing policies: which node serves a request, given what the cluster looks like now.

Each policy is a small class with ``choose(request, view) -> node index``. ``view`` (a ``View``) is
a snapshot the simulator takes at the request's arrival: per node, the request's cached prefix
there and the node's load. Policies are pure (no I/O, no clock, no randomness beyond a seed) so
that a run is a function of its trace and configuration. A policy may keep its own state (a
counter, a router-side prefix tree): the baselines reproduce routers that do.

Cache tiers: the simulator models one cache tier per node, host DRAM, from which a cached block
is loaded into the accelerator at a modelled bandwidth. The baselines' tier weights are applied
as for that tier (Dynamo's host-hit credit, llm-d's cpu weight).
"""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_right
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    """One request of a trace: its arrival (ms, after time scaling) and its prefix-block ids (an id
    covers its block and every earlier one, so a prefix match is a walk until the first miss)."""

    arrival_ms: float
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class View:
    """The cluster at a request's arrival, one entry per node.

    ``matched``: the request's consecutive cached prefix on the node, in blocks (what kvcc's
    directory says the node holds); ``outstanding``: requests routed there and not finished;
    ``queued_ms``: service time left on the node's FIFO queue; ``queued_prefill_blocks`` and
    ``active_blocks``: uncached and all blocks of its outstanding requests; ``assigned_ms``: service
    work routed there since the start; ``occupancy``: blocks in its cache. ``prefill_ms`` and
    ``load_ms``: the modelled time to recompute one block and to load one cached block.
    """

    matched: Sequence[int]
    outstanding: Sequence[int]
    queued_ms: Sequence[float]
    queued_prefill_blocks: Sequence[int]
    active_blocks: Sequence[int]
    assigned_ms: Sequence[float]
    occupancy: Sequence[int]
    prefill_ms: float
    load_ms: float

    @property
    def nodes(self) -> int:
        return len(self.matched)

    def service_ms(self, request: Request, node: int) -> float:
        """The modelled service time of ``request`` on ``node``: recompute the uncached blocks,
        load the cached prefix."""
        hit = self.matched[node]
        return (len(request.blocks) - hit) * self.prefill_ms + hit * self.load_ms


def cached_prefix(blocks: Sequence[int], held: Container[int]) -> int:
    """How many of ``blocks``, from the first, are in ``held``: a prefix is reusable up to its first
    miss (an id covers its block and every earlier one)."""
    n = 0
    for b in blocks:
        if b not in held:
            break
        n += 1
    return n


def _argmin(keys: Sequence[tuple[float, ...]]) -> int:
    """The index of the smallest key (ties: the lowest index, so that runs are deterministic)."""
    return min(range(len(keys)), key=keys.__getitem__)


def _least_outstanding(view: View, among: Sequence[int] | None = None) -> int:
    """The node with the fewest outstanding requests (ties: least queued work, lowest index)."""
    nodes = range(view.nodes) if among is None else among
    return min(nodes, key=lambda n: (view.outstanding[n], view.queued_ms[n], n))


# ---------------------------------------------------------------------------------- simple ones


class RoundRobin:
    """Node 0, 1, ..., N-1, 0, ...: the cache-blind baseline."""

    def __init__(self, nodes: int, seed: int = 0) -> None:
        self._next = seed % nodes
        self._nodes = nodes

    def choose(self, request: Request, view: View) -> int:
        node = self._next
        self._next = (node + 1) % self._nodes
        return node


def _hash64(seed: int, value: object) -> int:
    """A stable 64-bit hash (Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{value}".encode(), digest_size=8).digest(), "big")


class ConsistentHash:
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, SODA 2018): the key
    is the request's first block id; a node takes a request only while its outstanding requests are
    below ceil((1 + c) * (total outstanding + 1) / N); otherwise walk the ring clockwise. Each node
    has ``replicas`` points on the ring."""

    def __init__(self, nodes: int, seed: int = 0, c: float = 0.25, replicas: int = 64) -> None:
        points = sorted((_hash64(seed, f"node{n}/{r}"), n) for n in range(nodes) for r in range(replicas))
        self._keys = [p for p, _ in points]
        self._owners = [n for _, n in points]
        self._seed, self._c = seed, c

    def choose(self, request: Request, view: View) -> int:
        bound = math.ceil((1 + self._c) * (sum(view.outstanding) + 1) / view.nodes)
        start = bisect_right(self._keys, _hash64(self._seed, request.blocks[0] if request.blocks else -1))
        for i in range(len(self._keys)):
            node = self._owners[(start + i) % len(self._keys)]
            if view.outstanding[node] < bound:
                return node
        raise AssertionError("the bound always leaves a node below it")  # pragma: no cover


class Capacity:
    """Least outstanding work (the queue drains first), ties to the least KV occupancy (the most
    free cache), then the lowest index. Cache-blind."""

    def __init__(self, nodes: int, seed: int = 0) -> None:
        pass

    def choose(self, request: Request, view: View) -> int:
        return _argmin([(view.queued_ms[n], view.occupancy[n]) for n in range(view.nodes)])


# ---------------------------------------------------------------------------------- kvcc's own


class CacheAware:
    """kvcc's prefix routing: the node with the longest cached prefix (from the nodes' cache
    contents, as kvcc's directory knows them), among the nodes whose assigned work after taking the
    request stays within (1 + g) times the mean after it; ties, and no prefix anywhere, go to the
    node with the least assigned work after the request (a new prefix starts where there is room,
    so that the node does not hit the guard later and repel the prefixes it holds). If no node stays
    within the guard (early in a run, when one request is large against the mean), the node with
    the least assigned work.

    The guard is on assigned work (the service work routed to a node since the start), not on queue
    length: a queue guard lets a popular prefix pile onto one node between bursts, and the node
    that owns the hot prefixes ends up with far more than its share of the work. It counts the
    request's own cost on each node, so that a node is left only once the request would take it
    over the bound (a guard on the work before the request lets a hot node run to the bound and
    then repels all of its prefixes at once, copying them onto the others).
    """

    def __init__(self, nodes: int, seed: int = 0, g: float = 0.1) -> None:
        self._g = g

    def choose(self, request: Request, view: View) -> int:
        cost = [view.service_ms(request, n) for n in range(view.nodes)]
        limit = (1 + self._g) * (sum(view.assigned_ms) + min(cost)) / view.nodes
        allowed = [n for n in range(view.nodes) if view.assigned_ms[n] + cost[n] <= limit]
        if not allowed:
            return _argmin([(view.assigned_ms[n],) for n in range(view.nodes)])
        return min(allowed, key=lambda n: (-view.matched[n], view.assigned_ms[n] + cost[n], n))


class TierCost:
    """kvcc's cost model: cost(w) = recompute time of the blocks not cached on w + load time of the
    cached ones at the tier's bandwidth + the work queued on w, i.e. the request's modelled time to
    first token on w. Pick the minimum (ties: lowest index)."""

    def __init__(self, nodes: int, seed: int = 0) -> None:
        pass

    def choose(self, request: Request, view: View) -> int:
        return _argmin([(view.queued_ms[n] + view.service_ms(request, n),) for n in range(view.nodes)])


# ---------------------------------------------------------------------------------- baselines


class SglangCacheAware:
    """SGLang router's ``cache_aware`` policy (sgl-router; the same in vllm-router), defaults
    cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5:

    - if (max_load - min_load) > balance_abs and max_load > min_load * balance_rel: the least
      loaded worker (load = outstanding requests);
    - else if the best prefix match in the router's tree / the request's length > cache_threshold:
      the worker with that longest match;
    - else the worker with the smallest tree (the most room: the published rule, not least loaded).

    The chosen worker's tree gains the request's prefix. The router's approximate tree is modelled
    at block granularity and never evicts (the default ``max_tree_size`` is far above these
    traces), so it can point at blocks the worker's own cache has already evicted, as the real
    router's tree can.
    """

    def __init__(self, nodes: int, seed: int = 0, cache_threshold: float = 0.3,
                 balance_abs: int = 64, balance_rel: float = 1.5) -> None:  # fmt: skip
        self._trees: list[set[int]] = [set() for _ in range(nodes)]
        self._threshold, self._abs, self._rel = cache_threshold, balance_abs, balance_rel

    def choose(self, request: Request, view: View) -> int:
        loads = view.outstanding
        hi, lo = max(loads), min(loads)
        if hi - lo > self._abs and hi > lo * self._rel:
            node = _argmin([(loads[n],) for n in range(view.nodes)])
        else:
            matches = [cached_prefix(request.blocks, tree) for tree in self._trees]
            best = _argmin([(-m,) for m in matches])
            if request.blocks and matches[best] / len(request.blocks) > self._threshold:
                node = best
            else:
                node = _argmin([(len(t),) for t in self._trees])
        self._trees[node].update(request.blocks)
        return node


class DynamoCost:
    """NVIDIA Dynamo's KV router (temperature 0): cost(w) = prefill_load_scale *
    max(prefill_blocks(w) - overlap_credit(w), 0) + decode_blocks(w), pick the minimum (ties: the
    lowest index). prefill_blocks(w) = the request's blocks + the uncached blocks of w's
    outstanding requests (their prefill is still ahead); decode_blocks(w) = the blocks of w's
    outstanding requests + the request's; overlap_credit(w) = the cached prefix on w weighted by
    its tier (device 1.0, host 0.75, disk 0.25; here every hit is a host hit).
    """

    TIER_CREDIT = {"device": 1.0, "host": 0.75, "disk": 0.25}

    def __init__(self, nodes: int, seed: int = 0, prefill_load_scale: float = 1.0, tier: str = "host") -> None:
        self._scale, self._credit = prefill_load_scale, self.TIER_CREDIT[tier]

    def choose(self, request: Request, view: View) -> int:
        size = len(request.blocks)
        costs = []
        for n in range(view.nodes):
            prefill = view.queued_prefill_blocks[n] + size
            decode = view.active_blocks[n] + size
            costs.append((self._scale * max(prefill - self._credit * view.matched[n], 0.0) + decode,))
        return _argmin(costs)


class LlmdPrefix:
    """llm-d's prefix-cache scorer alone: score(w) = sum over the consecutive matched prefix of the
    best tier weight holding each block (gpu 1.0, cpu 0.8; here every block is in cpu memory);
    pick the highest score, ties to the least loaded (outstanding requests), then lowest index."""

    TIER_WEIGHT = {"gpu": 1.0, "cpu": 0.8}

    def __init__(self, nodes: int, seed: int = 0, tier: str = "cpu") -> None:
        self._weight = self.TIER_WEIGHT[tier]

    def choose(self, request: Request, view: View) -> int:
        return _argmin([(-self._weight * view.matched[n], view.outstanding[n]) for n in range(view.nodes)])


# ---------------------------------------------------------------------------------- replay


class Replay:
    """A recorded assignment, request i to node ``assignment[i]``: the decisions of a router that
    ran outside the simulator (the real SGLang router, bench/smg_router.py), replayed so that they
    get the same hit ratio, load and TTFT figures as the policies here."""

    def __init__(self, assignment: Sequence[int]) -> None:
        self._assignment = assignment
        self._next = 0

    def choose(self, request: Request, view: View) -> int:
        if self._next >= len(self._assignment):
            raise ValueError(f"the recorded assignment has {len(self._assignment)} requests; the trace has more")
        node = self._assignment[self._next]
        if not 0 <= node < view.nodes:
            raise ValueError(f"request {self._next} was routed to node {node}, not one of {view.nodes}")
        self._next += 1
        return node


Policy = (RoundRobin | ConsistentHash | Capacity | CacheAware | TierCost | SglangCacheAware | DynamoCost | LlmdPrefix
          | Replay)

POLICIES: dict[str, Callable[[int, int], Policy]] = {
    "round_robin": RoundRobin,
    "consistent_hash": ConsistentHash,
    "capacity": Capacity,
    "cache_aware": CacheAware,
    "tier_cost": TierCost,
    "sglang_cache_aware": SglangCacheAware,
    "dynamo_cost": DynamoCost,
    "llmd_prefix": LlmdPrefix,
}
KVCC_POLICIES = ("cache_aware", "tier_cost")
