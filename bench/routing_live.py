"""Live mode of ``kvcc bench routing`` (``--live``): a trace routed through a local kvcc cluster.

Theory of operation
-------------------
The simulator (``kvcc.reference.routing.sim``) gives each node an LRU cache of its own. Here the
caches are a real kvcc cluster (``LocalCluster``: a directory and N cache nodes, processes on
loopback), one fresh cluster per (N, F, U, policy): node *i*'s engine is a client co-located with
cache node *i* (client id ``<node>.router``), so the directory places its writes on that node's
DRAM tier, sized to its share of the capacity (F of the trace's unique blocks, ``BLOCK_BYTES``
each, split evenly). Per request, in the trace's order:

1. ``lookup`` of the request's chain (hash ids -> chained keys, as the performance suite's replay
   maps them): the committed prefix and where each block of it is. The policy's view is the
   simulator's (queues, assigned work, occupancy), except ``matched[j]``: the leading blocks of
   that prefix that node *j* holds -- what a router fed by kvcc's directory knows;
2. the chosen node's engine leases and reads the whole committed prefix (``acquire_chain``,
   ``read_many``, ``release_many``), from its own node and from the others -- kvcc's nodes are one
   pool -- and checks every byte (a block's bytes derive from its key);
3. it writes the rest of the chain (``put_chain``) on its own node, making room first as an LRU
   cache does before it inserts: it evicts its node's least recently used blocks that the
   directory lets go (leaves, not leased, not of this chain) until the rest fits; what does not
   fit even then is not written (``no_room``);
4. its service time is the blocks it did not read times the prefill time of a block (``Costs``,
   modelled or ``--calibrate``d) plus the *measured* time of steps 1 and 2; queueing follows the
   simulator's FIFO model on that service time, with arrivals scaled to utilisation U.

Reported per row, beside the simulator's columns: ``hit_ratio`` (blocks read / block refs),
``local_share`` (of the blocks read, those on the serving node), ``written`` (blocks committed),
``evictions`` (by the engines; ``gone`` counts stale candidates, blocks their node had let go
itself), ``refused_writes`` (chains cut short, by reason), and the measured ``cache_ms_p50`` (lookup and
reads) and ``write_ms_p50`` per request. Because the nodes are one pool, every policy can reach the
pooled bound's hits; what routing changes here is locality and balance.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcc.reference.routing import sim
from kvcc.reference.routing.policies import POLICIES, Request, View
from kvcc.spec.keys import BlockKey, Namespace

BLOCK_BYTES = 4096  # a block's bytes in the live cluster (the trace's KV scaled down to fit here)
DEFAULT_LIMIT = 300  # requests per live replay unless --limit says otherwise
LEASE_TERM_MS = 10_000
SKEW_MS = 50
EVICT_TRIES = 16  # LRU candidates asked per refused write before the write is given up
NS = Namespace(model_id="kvcc/routing-live", model_revision="r1", kv_dtype="bfloat16", block_tokens=sim.BLOCK_TOKENS)


class LiveError(Exception):
    """The live replay could not run: the cluster did not start, or a read returned wrong bytes."""


@dataclass(kw_only=True)
class _Engine(sim.Queue):
    """One serving engine beside one cache node: the simulator's queue, its kvcc client, and its
    node's blocks in recency order."""

    node: str
    client: Any
    capacity: int | None = None  # blocks its node's tier holds (None: not known, no room made ahead)
    lru: OrderedDict[BlockKey, None] = field(default_factory=OrderedDict)


def _node_of(location: str) -> str:
    return str(location).split("/", 1)[0]


def _payload(key: BlockKey) -> bytes:
    return (key.digest * (BLOCK_BYTES // len(key.digest) + 1))[:BLOCK_BYTES]


def _chain_keys(trace: sim.Trace) -> list[list[BlockKey]]:
    from kvcc.bench.suite import ChainKeys

    keys_of = ChainKeys(NS)
    return [keys_of.chain(blocks) for blocks in trace.blocks]


def _read_prefix(engine: _Engine, keys: Sequence[BlockKey]) -> int:
    """Lease and read ``keys`` (a committed prefix) with the engine's client: how many leading
    blocks it read; wrong bytes raise ``LiveError``."""
    if not keys:
        return 0
    c = engine.client
    leases, _ = c.acquire_chain(NS, list(keys))
    try:
        got = c.read_many(leases) if leases else []
    finally:
        if leases:
            c.release_many(leases)
    served = 0
    for lease, data in zip(leases, got, strict=True):
        if not isinstance(data, bytes | bytearray):
            break
        if bytes(data) != _payload(lease.key):
            raise LiveError(f"a read of {lease.key.hex[:16]} returned other bytes")
        served += 1
    return served


@dataclass
class _Pool:
    """What the engines know of the cluster's blocks: where each committed block is, its parent,
    and how many of its children are cached (the directory evicts leaves before their ancestors)."""

    location: dict[BlockKey, str] = field(default_factory=dict)
    parent: dict[BlockKey, BlockKey | None] = field(default_factory=dict)
    children: dict[BlockKey, int] = field(default_factory=dict)
    owner: dict[BlockKey, _Engine] = field(default_factory=dict)

    def add(self, engine: _Engine, key: BlockKey, parent: BlockKey | None) -> None:
        """``engine`` committed ``key`` on its node. An entry of the key from before is stale (its
        node evicted it to make room, and now it was written again): forgotten first."""
        if key in self.owner:
            self.remove(key)
        self.location[key], self.parent[key], self.owner[key] = f"{engine.node}/dram", parent, engine
        engine.lru[key] = None  # a co-located writer's blocks go to its own node's tier
        if parent is not None:
            self.children[parent] = self.children.get(parent, 0) + 1

    def remove(self, key: BlockKey) -> None:
        del self.location[key]
        self.owner.pop(key).lru.pop(key, None)
        parent = self.parent.pop(key)
        if parent is not None:
            self.children[parent] -= 1


def _evict_one(engine: _Engine, pool: _Pool, counts: dict[str, Any], protect: set[BlockKey]) -> bool:
    """Evict the engine's least recently used leaf that the directory lets go, never one of
    ``protect`` (the chain being written); True if one went."""
    tried = 0
    for key in list(engine.lru):
        if pool.children.get(key, 0) or key in protect:
            continue
        r = engine.client.evict(key, pool.location[key])
        reason = None if type(r).__name__ == "Evicted" else str(getattr(r, "reason", type(r).__name__))
        if reason in (None, "not_committed", "not_found"):  # gone now (the node made room itself: stale)
            pool.remove(key)
            if reason is None:
                return True
            counts["gone"] += 1
            continue
        counts["evict_refusals"][reason] = counts["evict_refusals"].get(reason, 0) + 1
        tried += 1
        if tried >= EVICT_TRIES:
            break
    return False


def _make_room(engine: _Engine, pool: _Pool, counts: dict[str, Any], protect: set[BlockKey], blocks: int) -> int:
    """Evict from the engine's node until ``blocks`` more fit it (or nothing more may go); how many
    fit now (``blocks`` when its capacity is not known)."""
    if engine.capacity is None:
        return blocks
    while len(engine.lru) + blocks > engine.capacity and _evict_one(engine, pool, counts, protect):
        counts["evictions"] += 1
    return max(0, min(blocks, engine.capacity - len(engine.lru)))


def _refused(counts: dict[str, Any], reason: str) -> None:
    """A chain cut short, by ``reason``."""
    counts["refused_writes"] += 1
    counts["write_refusals"][reason] = counts["write_refusals"].get(reason, 0) + 1


def _write_rest(engine: _Engine, keys: Sequence[BlockKey], start: int, pool: _Pool, counts: dict[str, Any]) -> None:
    """Write ``keys[start:]`` (whose parent ``keys[start - 1]`` is committed) on the engine's node,
    making room on it first, as an LRU cache does before it inserts; stops at a write that cannot
    be placed.

    Room is made *before* a write, not after a refusal: a write refused ``no_space`` by the node
    leaves its write lease at the directory until the lease expires (the writer's abort is local),
    so the block stays WRITING for a lease term, and a retry would find it ``not_absent`` and its
    child ``parent_not_committed``."""
    i = start
    budget = 4 * len(keys) + 4  # put_chain calls at most: each makes progress, evicts or steps back
    while i < len(keys) and budget > 0:
        budget -= 1
        base = i
        fits = _make_room(engine, pool, counts, set(keys), len(keys) - base)
        if fits == 0:
            _refused(counts, "no_room")
            return
        end = base + fits
        blocks = [(keys[j], keys[j - 1] if j else None, _payload(keys[j])) for j in range(base, end)]
        results = engine.client.put_chain(NS, blocks)
        refused = None
        for k, r in zip(keys[base:end], results, strict=True):
            if type(r).__name__ == "Committed":
                pool.add(engine, k, keys[i - 1] if i else None)
                counts["written"] += 1
            elif getattr(r, "reason", None) != "not_absent":  # not_absent: another engine committed it
                refused = r
                break
            i += 1
        if refused is None:
            continue
        if getattr(refused, "reason", None) == "parent_not_committed" and i == base and base > 0:
            # the parent, a leaf until now, was evicted since it was read (its node made room):
            # write it again first, as an engine that recomputed it would
            counts["parents_rewritten"] += 1
            i = base - 1
            continue
        _refused(counts, str(getattr(refused, "reason", type(refused).__name__)))
        return


def replay(trace: sim.Trace, keys: list[list[BlockKey]], nodes: int, capacity: int, scale: float,
           costs: sim.Costs, policy_name: str, workdir: Path, seed: int = sim.DEFAULT_SEED,
           step: Callable[[str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """One live replay of ``trace`` through ``policy_name`` on a fresh cluster of ``nodes`` nodes
    holding ``capacity`` blocks in all; the row's measured columns."""
    from kvcc.reference.cluster import LocalCluster

    per_node = max(1, capacity // nodes)
    tier = f"dram={per_node * BLOCK_BYTES}"
    policy = POLICIES[policy_name](nodes, seed)
    counts: dict[str, Any] = {"evictions": 0, "refused_writes": 0, "write_refusals": {}, "evict_refusals": {},
                              "gone": 0, "parents_rewritten": 0, "written": 0}
    hits = refs = local = 0
    ttfts: list[float] = []
    cache_ms: list[float] = []
    write_ms: list[float] = []
    pool = _Pool()
    try:
        cluster = LocalCluster(workdir, nodes=nodes, tiers=(tier,), block_bytes=BLOCK_BYTES,
                               lease_term_ms=LEASE_TERM_MS, skew_ms=SKEW_MS, namespaces=(NS,))  # fmt: skip
        cluster.start()
    except Exception as e:  # noqa: BLE001 -- reported as a typed error with the cause
        raise LiveError(f"the kvcc cluster did not start: {type(e).__name__}: {e}") from e
    try:
        engines = [_Engine(node=n, client=cluster.client(f"{n}.router", events=False), capacity=per_node)
                   for n in cluster.node_ids]  # fmt: skip
        probe = engines[0].client
        t0 = trace.timestamps[0]
        for i, (timestamp, blocks, chain) in enumerate(zip(trace.timestamps, trace.blocks, keys, strict=True)):
            if step is not None and i % 50 == 0:
                step(f"live: {policy_name} on {nodes} nodes: request {i}/{len(trace.blocks)}")
            now = (timestamp - t0) * scale
            for e in engines:
                e.advance(now)
            started = time.perf_counter()
            found = probe.lookup(NS, chain)
            lookup_s = time.perf_counter() - started
            where = [_node_of(loc) for loc in found.locations[: found.blocks]]
            matched = []
            for e in engines:
                n = 0
                while n < len(where) and where[n] == e.node:
                    n += 1
                matched.append(n)
            view = View(matched=matched, outstanding=[len(e.outstanding) for e in engines],
                        queued_ms=[max(e.busy_until - now, 0.0) for e in engines],
                        queued_prefill_blocks=[e.prefill_blocks for e in engines],
                        active_blocks=[e.active_blocks for e in engines], assigned_ms=[e.assigned_ms for e in engines],
                        occupancy=[len(e.lru) for e in engines], prefill_ms=costs.prefill_ms, load_ms=costs.load_ms)  # fmt: skip
            chosen = engines[policy.choose(Request(now, blocks), view)]
            started = time.perf_counter()
            served = _read_prefix(chosen, chain[: found.blocks])
            read_s = time.perf_counter() - started
            for k in chain[:served]:
                owner = next((e for e in engines if k in e.lru), None)
                if owner is not None:
                    owner.lru.move_to_end(k)
            local += sum(1 for n in where[:served] if n == chosen.node)
            started = time.perf_counter()
            if served == found.blocks:
                _write_rest(chosen, chain, served, pool, counts)
            write_ms.append((time.perf_counter() - started) * 1000)
            cache_ms.append((lookup_s + read_s) * 1000)
            service = (len(blocks) - served) * costs.prefill_ms + cache_ms[-1]
            ttfts.append(chosen.serve(now, service, len(blocks), served))
            hits, refs = hits + served, refs + len(blocks)
    finally:
        cluster.stop()
    mean_work = sum(e.assigned_ms for e in engines) / nodes
    return {
        "hit_ratio": hits / max(refs, 1),
        "local_share": local / hits if hits else None,
        "max_mean_load": max(e.assigned_ms for e in engines) / mean_work if mean_work > 0 else 1.0,
        "ttft_p50": sim.percentile(ttfts, 50),
        "ttft_p99": sim.percentile(ttfts, 99),
        "cache_ms_p50": statistics.median(cache_ms),
        "write_ms_p50": statistics.median(write_ms),
        **counts,
    }


def run(trace: sim.Trace, nodes_list: Sequence[int], capacities: Sequence[float], utilisations: Sequence[float],
        policy_names: Sequence[str], costs: sim.Costs, workdir: Path | None = None,
        step: Callable[[str], None] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Every (N, F, U, policy) live row for ``trace`` (already cut to the requests to replay)."""
    keys = _chain_keys(trace)
    infinite = sim.bound_infinite(trace)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvcc-routing-live-", dir=workdir) as tmp:
        for nodes in nodes_list:
            for fraction in capacities:
                capacity = sim.capacity_blocks(trace, fraction)
                pooled_hits = sim.pooled_hits(trace, capacity)
                pooled = sum(pooled_hits) / max(sim.block_refs(trace), 1)
                for utilisation in utilisations:
                    scale = sim.time_scale(trace, pooled_hits, nodes, utilisation, costs)
                    for name in policy_names:
                        work = Path(tmp) / f"{nodes}-{fraction:g}-{utilisation:g}-{name}"
                        r = replay(trace, keys, nodes, capacity, scale, costs, name, work, step=step)
                        rows.append({"trace": trace.name, "nodes": nodes, "capacity": fraction,
                                     "utilisation": utilisation, "policy": name, "requests": len(trace.blocks),
                                     "bound_infinite": infinite, "bound_pooled": pooled,
                                     "vs_pooled": r["hit_ratio"] / pooled if pooled > 0 else None, **r})  # fmt: skip
    return rows
