"""Benchmark: the performance suite every adapter runs (``kvcc bench suite``).

What is measured
----------------
The same workloads for every adapter, through the adapter contract only
(``kvcc.conformance.contract``), each on a fresh deployment (``Adapter.start`` with
``PROFILES[name].nodes`` nodes, the contract's default lease term and epsilon, one namespace):

1. **lease_lookup**: with 1, 2, 4 (quick) or up to 16 (full) client threads, each looping
   read-lease ``acquire`` + ``release`` on committed keys of its own (one lease per node and key:
   clients never share a key), then ``lookup`` of one committed chain of ``chain_len`` keys.
   Per op: p50 / p99 latency (µs); per phase: ops/s. Baseline: the same phase with 1 client in
   the same run (``vs_1_client``: ops/s over the 1-client ops/s).
2. **bandwidth**: per block size, ``write_bytes`` with its ``commit`` (begin_write not timed: an
   adapter whose store's put is its commit holds the bytes until then) and ``read``
   under a read lease (acquire and release not timed) by the writer's own node, median of
   ``bandwidth_reps``; every read is checked to return exactly the bytes written. Baseline: a copy
   of the same number of bytes in this process, ``bytes(memoryview(buf))``, median of as many
   runs (``vs_raw``: adapter bandwidth over raw copy bandwidth). A size the adapter refuses
   (``too_large``, ``no_space``: its slots are smaller) is listed with the refusal, and so is a size
   whose ``write_bytes`` raises anything but ``AdapterError`` (marked "not a contract refusal").
3. **invalidation**: completion latency of ``invalidate`` (scope ``key``) with 0, 1, 2, 4 nodes
   holding read leases on the key: from the call until ``wait_invalidation`` returns True.
   *ack*: each holder calls ``release`` right after ``invalidate`` returns (the contract's
   adapter also drops and acks on the revoke itself; ``release`` is then a no-op); baseline: 0
   holders (``vs_0_holders``). *expiry* (full profile, needs the ``pause`` and ``resume``
   faults): the holder's node is paused, so it never acks; baseline: the lease term plus epsilon
   (``vs_term_plus_skew``).
4. **trace_replay**: the first ``trace_requests`` requests of Mooncake's conversation trace,
   one client, requests round-robin over the nodes. A request's hash ids are a chain of keys in
   one namespace (block ``i`` chained on block ``i-1``; a block's 512 token ids are its hash id),
   each block ``trace_block_bytes`` bytes (KV bytes scaled down so the trace fits in a test
   deployment). Per request: ``lookup`` the chain, read-lease and read the cached prefix, then
   ``begin_write`` + ``write_bytes`` + ``commit`` each missing block. Baselines: ``bound_infinite``
   of the same slice (``kvcc.reference.routing.sim``: a block seen before is a hit) and
   ``bound_pooled`` (one LRU cache of the deployment's declared ``capacity_bytes`` in blocks of
   this size, or of its ``slot_bytes`` where a location keeps each block in a slot; none when it
   declares no capacity), computed in the same run. Modelled TTFT per request: the blocks not served recomputed at
   ``sim.DEFAULT_PREFILL_TOKENS_PER_S`` tokens/s (``sim.Costs().prefill_ms`` per block) plus the
   *measured* time of the request's lookup, leases and reads (its writes follow the prefill: their
   time is reported apart, ``write_ms``); baseline: every block recomputed (``vs_no_cache``).

A workload the adapter's capabilities do not support is skipped with the reason; one that raises
``NotSupported`` is skipped with the operation; one that raises anything else (``AdapterError``)
is an error, recorded in ``results.json``. Exit 0 when every workload ran or was skipped, 1 when
one failed, 2 on bad input. No figure is a target: the suite reports.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvcc.conformance.contract import (
    Adapter,
    AdapterError,
    Committed,
    NotSupported,
    ReadGrant,
    Refused,
    RunContext,
    Stored,
)
from kvcc.bench.perf_bundle import FORMAT
from kvcc.reference.routing import sim
from kvcc.spec.keys import BlockKey, Namespace, chain_keys

BLOCK_TOKENS = sim.BLOCK_TOKENS  # Mooncake's traces hash 512-token blocks
LEASE_TERM_MS = 1000  # the contract's defaults (RunContext), as kvcc conform uses them
SKEW_MS = 50
SETUP_BLOCK_BYTES = 64  # blocks that only need to exist (leases, lookups, invalidations)
KEYS_PER_CLIENT = 8
WAIT_SLACK_S = 5.0  # how long past the lease term an invalidation may take before it counts as stuck
WORKLOADS = ("lease_lookup", "bandwidth", "invalidation", "trace_replay")
KiB, MiB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class Profile:
    """The sizes of one run; ``quick`` and ``full`` are ``PROFILES``, tests pass smaller ones."""

    name: str
    nodes: int
    clients: tuple[int, ...]
    ops_per_client: int
    chain_len: int
    sizes: tuple[int, ...]
    bandwidth_reps: int
    holders: tuple[int, ...]
    invalidation_reps: int
    expiry: bool
    trace_requests: int
    trace_block_bytes: int


PROFILES = {
    "quick": Profile("quick", nodes=4, clients=(1, 2, 4), ops_per_client=200, chain_len=16,
                     sizes=(4 * KiB, 64 * KiB, MiB), bandwidth_reps=5, holders=(0, 1, 2, 4), invalidation_reps=5,
                     expiry=False, trace_requests=200, trace_block_bytes=4 * KiB),
    "full": Profile("full", nodes=4, clients=(1, 2, 4, 8, 16), ops_per_client=1000, chain_len=16,
                    sizes=(4 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB), bandwidth_reps=10,
                    holders=(0, 1, 2, 4), invalidation_reps=10, expiry=True, trace_requests=2000,
                    trace_block_bytes=4 * KiB),
}  # fmt: skip


class BadInput(Exception):
    """The user's input cannot be run (an unknown profile, an unwritable --out, a bad trace): exit 2."""


class WorkloadFailed(Exception):
    """The adapter answered in a way no benchmark can go on from (other bytes than written, a
    refusal while setting up); recorded as the workload's error."""


Step = Callable[[str], None]


# ------------------------------------------------------------------------------------ helpers


def bench_namespace(rng: random.Random) -> Namespace:
    """A namespace of this run alone (seeded), as the conformance suite makes them."""
    return Namespace(model_id=f"bench/model-{rng.randrange(1 << 32):08x}", model_revision="perf-suite",
                     kv_dtype="bfloat16", block_tokens=BLOCK_TOKENS, cache_salt=rng.randbytes(16))  # fmt: skip


def root_keys(ns: Namespace, rng: random.Random, n: int) -> list[BlockKey]:
    """``n`` fresh root keys (random tokens: no other run or workload meets them)."""
    return [chain_keys(ns, [rng.randrange(1 << 31) for _ in range(BLOCK_TOKENS)])[0] for _ in range(n)]


def write_block(adapter: Adapter, node: str, ns: Namespace, key: BlockKey, parent: BlockKey | None,
                data: bytes) -> Committed | Refused:  # fmt: skip
    """begin_write + write_bytes + commit; the first refusal (the grant aborted if one was given)."""
    grant = adapter.begin_write(node, ns, key, parent)
    if isinstance(grant, Refused):
        return grant
    stored = adapter.write_bytes(grant, data)
    if not isinstance(stored, Stored):
        adapter.abort(grant)
        return stored
    return adapter.commit(grant)


def must_commit(adapter: Adapter, node: str, ns: Namespace, key: BlockKey, parent: BlockKey | None) -> None:
    """Write a setup block; a refusal here leaves nothing to measure."""
    done = write_block(adapter, node, ns, key, parent, bytes(SETUP_BLOCK_BYTES))
    if not isinstance(done, Committed):
        raise WorkloadFailed(f"setup write of {key.hex[:12]} on {node} refused: {done.reason} {done.detail}".strip())


def refusal(r: Refused) -> str:
    return f"{r.reason}: {r.detail}" if r.detail else r.reason


@dataclass
class Deployment:
    """One started adapter and what the workloads need of it."""

    adapter: Adapter
    ns: Namespace
    nodes: tuple[str, ...]
    rng: random.Random
    profile: Profile

    def node(self, i: int) -> str:
        return self.nodes[i % len(self.nodes)]


@contextmanager
def deployment(factory: Callable[[], Adapter], profile: Profile, seed: int, workdir: Path) -> Iterator[Deployment]:
    """A fresh deployment for one workload: every workload starts from empty state."""
    rng = random.Random(seed)
    ns = bench_namespace(rng)
    workdir.mkdir(parents=True)
    adapter = factory()
    ctx = RunContext(workdir, seed, nodes=profile.nodes, lease_term_ms=LEASE_TERM_MS, skew_ms=SKEW_MS, namespaces=(ns,))
    try:
        adapter.start(ctx)
        yield Deployment(adapter, ns, tuple(adapter.nodes()), rng, profile)
    finally:
        adapter.stop()


# ----------------------------------------------------------------------- 1. leases and lookups


def _run_clients(clients: int, op: Callable[[int, int], bool], ops: int) -> dict[str, Any]:
    """``clients`` threads, each calling ``op(client, i)`` ``ops`` times after a common start;
    latencies of every op, the phase's wall time, and how many ops returned False."""
    latencies: list[list[int]] = [[] for _ in range(clients)]
    failed = [0] * clients
    errors: list[BaseException] = []
    start = threading.Barrier(clients + 1)

    def client(c: int) -> None:
        start.wait()
        try:
            for i in range(ops):
                t0 = time.perf_counter_ns()
                ok = op(c, i)
                latencies[c].append(time.perf_counter_ns() - t0)
                failed[c] += not ok
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=client, args=(c,), name=f"kvcc-bench-client-{c}") for c in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    flat = [x / 1000 for per in latencies for x in per]
    return {"clients": clients, "ops": len(flat), "seconds": seconds, "ops_per_s": len(flat) / seconds,
            "p50_us": sim.percentile(flat, 50), "p99_us": sim.percentile(flat, 99), "failed": sum(failed)}  # fmt: skip


def lease_lookup(d: Deployment, step: Step) -> dict[str, Any]:
    """Workload 1 (module docstring)."""
    a, ns, p = d.adapter, d.ns, d.profile
    most = max(p.clients)
    keys = [root_keys(ns, d.rng, KEYS_PER_CLIENT) for _ in range(most)]
    for c, mine in enumerate(keys):
        for k in mine:
            must_commit(a, d.node(c), ns, k, None)
    chain = chain_keys(ns, [d.rng.randrange(1 << 31) for _ in range(BLOCK_TOKENS * p.chain_len)])
    for i, k in enumerate(chain):
        must_commit(a, d.node(0), ns, k, chain[i - 1] if i else None)

    def lease_op(c: int, i: int) -> bool:
        grant = a.acquire(d.node(c), ns, keys[c][i % KEYS_PER_CLIENT])
        if not isinstance(grant, ReadGrant):
            return False
        a.release(grant)
        return True

    def lookup_op(c: int, i: int) -> bool:
        return a.lookup(d.node(c), ns, chain) == len(chain)

    rows = []
    for op_name, op in (("acquire+release", lease_op), (f"lookup({p.chain_len})", lookup_op)):
        for clients in p.clients:
            step(f"lease_lookup: {op_name}, {clients} client(s)")
            rows.append({"op": op_name, **_run_clients(clients, op, p.ops_per_client)})
        one = next(r["ops_per_s"] for r in rows if r["op"] == op_name and r["clients"] == 1)
        for r in rows:
            if r["op"] == op_name:
                r["vs_1_client"] = r["ops_per_s"] / one
    return {"baseline": "the same op with 1 client, same run (vs_1_client = ops/s over 1-client ops/s)",
            "keys_per_client": KEYS_PER_CLIENT, "rows": rows}  # fmt: skip


# ----------------------------------------------------------------------------- 2. bandwidth


def raw_copy_seconds(data: bytes, reps: int) -> float:
    """Median time of ``bytes(memoryview(data))``: one copy of the block in this process."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        copy = bytes(memoryview(data))
        times.append(time.perf_counter() - t0)
        del copy
    return statistics.median(times)


def _one_transfer(d: Deployment, data: bytes) -> tuple[float, float] | Refused:
    """Write ``data`` as a fresh block and read it back by the writer's node: (write s, read s)."""
    a, ns, node = d.adapter, d.ns, d.node(0)
    key = root_keys(ns, d.rng, 1)[0]
    grant = a.begin_write(node, ns, key, None)
    if isinstance(grant, Refused):
        return grant
    t0 = time.perf_counter()
    try:
        stored = a.write_bytes(grant, data)
    except (AdapterError, NotSupported):
        raise
    except Exception as e:  # noqa: BLE001 - a size the adapter cannot take, said by raising: reported per size
        a.abort(grant)
        return Refused("raised", f"{type(e).__name__}: {e} (not a contract refusal)")
    if not isinstance(stored, Stored):
        a.abort(grant)
        return stored
    # The commit is timed with the bytes: an adapter may hold them until it (a store whose put is
    # its commit: lmcache-raw, mooncake-raw, hicache-file), and a write is done once it is published.
    done = a.commit(grant)
    write_s = time.perf_counter() - t0
    if not isinstance(done, Committed):
        return done
    lease = a.acquire(node, ns, key)
    if isinstance(lease, Refused):
        return lease
    t0 = time.perf_counter()
    got = a.read(lease)
    read_s = time.perf_counter() - t0
    a.release(lease)
    if isinstance(got, Refused):
        return got
    if got != data:
        raise WorkloadFailed(f"read of a {len(data)}-byte block returned other bytes ({len(got)} bytes)")
    return write_s, read_s


def bandwidth(d: Deployment, step: Step) -> dict[str, Any]:
    """Workload 2 (module docstring)."""
    rows = []
    for size in d.profile.sizes:
        step(f"bandwidth: {size // KiB} KiB")
        data = d.rng.randbytes(size)
        writes, reads = [], []
        for _ in range(d.profile.bandwidth_reps):
            t = _one_transfer(d, data)
            if isinstance(t, Refused):
                rows.append({"size": size, "refused": refusal(t)})
                break
            writes.append(t[0])
            reads.append(t[1])
        else:
            raw = size / raw_copy_seconds(data, d.profile.bandwidth_reps)
            w, r = size / statistics.median(writes), size / statistics.median(reads)
            rows.append({"size": size, "reps": len(writes), "write_bytes_per_s": w, "read_bytes_per_s": r,
                         "raw_bytes_per_s": raw, "write_vs_raw": w / raw, "read_vs_raw": r / raw})  # fmt: skip
    return {"baseline": "raw: bytes(memoryview(buf)) of the same size in this process, median of as many runs "
                        "(vs_raw = adapter bytes/s over raw bytes/s)",
            "timed": "write: write_bytes and commit; read: read under a lease by the writer's node (begin_write, "
                     "acquire and release not timed)",
            "rows": rows}  # fmt: skip


# -------------------------------------------------------------------------- 3. invalidation


def _invalidate_with_holders(d: Deployment, holders: int, pause: bool) -> tuple[float, int, int]:
    """One invalidation of a fresh key leased by ``holders`` nodes: (seconds to completion,
    grants the holders got, keys the ticket covered). With ``pause`` the holders' nodes are
    paused across the invalidation (they never ack); else each releases once it is revoked."""
    a, ns = d.adapter, d.ns
    invalidator = d.node(len(d.nodes) - 1) if pause else d.node(0)
    key = root_keys(ns, d.rng, 1)[0]
    must_commit(a, invalidator, ns, key, None)
    grants = [g for g in (a.acquire(d.node(h), ns, key) for h in range(holders)) if isinstance(g, ReadGrant)]
    if pause:
        for g in grants:
            a.pause(g.node)
    try:
        t0 = time.perf_counter()
        ticket = a.invalidate(invalidator, ns, "key", key)
        if not pause:
            for g in grants:
                a.release(g)
        done = a.wait_invalidation(ticket, LEASE_TERM_MS / 1000 + WAIT_SLACK_S)
        seconds = time.perf_counter() - t0
    finally:
        if pause:
            for g in grants:
                a.resume(g.node)
    if not done:
        raise WorkloadFailed(f"invalidation with {holders} holder(s) did not complete within "
                             f"{LEASE_TERM_MS / 1000 + WAIT_SLACK_S:.1f} s")  # fmt: skip
    return seconds, len(grants), ticket.keys


def _invalidation_row(d: Deployment, mode: str, holders: int) -> dict[str, Any]:
    runs = [_invalidate_with_holders(d, holders, mode == "expiry") for _ in range(d.profile.invalidation_reps)]
    ms = [r[0] * 1000 for r in runs]
    return {"mode": mode, "holders": holders, "reps": len(runs), "grants": sum(r[1] for r in runs),
            "ticket_keys": sum(r[2] for r in runs), "p50_ms": sim.percentile(ms, 50), "max_ms": max(ms)}  # fmt: skip


def expiry_skip_reason(d: Deployment) -> str | None:
    """Why the expiry half cannot run here, or None."""
    if not d.profile.expiry:
        return f"by expiry runs in the full profile only (this is {d.profile.name})"
    missing = {"pause", "resume"} - set(d.adapter.capabilities().faults)
    if missing:
        return f"by expiry needs the {' and '.join(sorted(missing))} fault(s), which the adapter does not declare"
    if len(d.nodes) < 2:
        return "by expiry needs a node to invalidate from besides the paused holder"
    return None


def invalidation(d: Deployment, step: Step) -> dict[str, Any]:
    """Workload 3 (module docstring)."""
    if max(d.profile.holders) > len(d.nodes):
        raise WorkloadFailed(f"{max(d.profile.holders)} holders need as many nodes; the deployment has {len(d.nodes)}")
    rows = []
    for holders in d.profile.holders:
        step(f"invalidation: by ack, {holders} holder(s)")
        rows.append(_invalidation_row(d, "ack", holders))
    zero = next((r["p50_ms"] for r in rows if r["holders"] == 0), None)
    for r in rows:
        r["vs_0_holders"] = r["p50_ms"] / zero if zero else None
    why = expiry_skip_reason(d)
    if why is None:
        step("invalidation: by expiry, 1 paused holder")
        row = _invalidation_row(d, "expiry", 1)
        row["term_plus_skew_ms"] = LEASE_TERM_MS + SKEW_MS
        row["vs_term_plus_skew"] = row["p50_ms"] / (LEASE_TERM_MS + SKEW_MS)
        rows.append(row)
    return {"baseline": "by ack: the same invalidation with 0 holders (vs_0_holders, p50 over p50); by expiry: "
                        f"the lease term plus epsilon, {LEASE_TERM_MS} + {SKEW_MS} ms (vs_term_plus_skew)",
            "timed": "from the invalidate call until wait_invalidation returned True; holders on distinct nodes",
            "lease_term_ms": LEASE_TERM_MS, "skew_ms": SKEW_MS, "rows": rows,
            "expiry_skipped": why}  # fmt: skip


# -------------------------------------------------------------------------- 4. trace replay


class ChainKeys:
    """Hash ids -> chained kvcc keys, memoised per (parent, hash id): a Mooncake hash id stands
    for its block's 512 tokens, so the same id after the same parent is the same key."""

    def __init__(self, ns: Namespace) -> None:
        self.ns = ns
        self._memo: dict[tuple[bytes | None, int], BlockKey] = {}

    def chain(self, hash_ids: Sequence[int]) -> list[BlockKey]:
        keys: list[BlockKey] = []
        for h in hash_ids:
            parent = keys[-1] if keys else None
            memo_key = (None if parent is None else parent.digest, h)
            key = self._memo.get(memo_key)
            if key is None:
                key = self._memo[memo_key] = chain_keys(self.ns, [h % (1 << 32)] * BLOCK_TOKENS, parent=parent)[0]
            keys.append(key)
        return keys


def block_payload(key: BlockKey, size: int) -> bytes:
    """A block's bytes, derived from its key: a read can be checked without keeping every block."""
    return (key.digest * (size // len(key.digest) + 1))[:size]


@dataclass
class Replay:
    """Counters of one trace replay."""

    refs: int = 0
    looked_up: int = 0
    served: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    written: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    ttft_ms: list[float] = field(default_factory=list)
    cache_ms: list[float] = field(default_factory=list)
    write_ms: list[float] = field(default_factory=list)

    def refuse(self, op: str, r: Refused) -> None:
        self.refused[f"{op}: {r.reason}"] = self.refused.get(f"{op}: {r.reason}", 0) + 1


def _read_prefix(d: Deployment, node: str, keys: Sequence[BlockKey], size: int, rep: Replay) -> int:
    """Lease and read the committed prefix; how many blocks were served (a failed read ends the
    usable prefix: KV after a gap cannot be used)."""
    a = d.adapter
    for n, key in enumerate(keys):
        grant = a.acquire(node, d.ns, key)
        if isinstance(grant, Refused):
            rep.refuse("acquire", grant)
            return n
        data = a.read(grant)
        a.release(grant)
        if isinstance(data, Refused):
            rep.refuse("read", data)
            return n
        if data != block_payload(key, size):
            raise WorkloadFailed(f"read of {key.hex[:12]} returned other bytes than written")
        rep.bytes_read += len(data)
    return len(keys)


def _write_rest(d: Deployment, node: str, keys: Sequence[BlockKey], start: int, size: int, rep: Replay) -> None:
    """Write and commit ``keys[start:]`` in order; the first refusal ends the chain (a child needs
    its parent committed)."""
    for i in range(start, len(keys)):
        done = write_block(d.adapter, node, d.ns, keys[i], keys[i - 1] if i else None, block_payload(keys[i], size))
        if not isinstance(done, Committed):
            rep.refuse("write", done)
            return
        rep.written += 1
        rep.bytes_written += size


def trace_replay_on(d: Deployment, trace: sim.Trace, step: Step) -> dict[str, Any]:
    """Workload 4 (module docstring) on ``trace``."""
    size = d.profile.trace_block_bytes
    prefill_ms = sim.Costs().prefill_ms
    keys_of = ChainKeys(d.ns)
    rep = Replay()
    for i, hash_ids in enumerate(trace.blocks):
        if i % 50 == 0:
            step(f"trace_replay: request {i}/{len(trace.blocks)}")
        node = d.node(i)
        keys = keys_of.chain(hash_ids)
        t0 = time.perf_counter()
        cached = d.adapter.lookup(node, d.ns, keys)
        served = _read_prefix(d, node, keys[:cached], size, rep)
        t_read = time.perf_counter()
        if served == cached:
            _write_rest(d, node, keys, cached, size, rep)
        rep.refs += len(keys)
        rep.looked_up += cached
        rep.served += served
        rep.cache_ms.append((t_read - t0) * 1000)
        rep.write_ms.append((time.perf_counter() - t_read) * 1000)
        rep.ttft_ms.append((len(keys) - served) * prefill_ms + rep.cache_ms[-1])
    no_cache = [len(h) * prefill_ms for h in trace.blocks]
    bound = sim.bound_infinite(trace)
    hit = rep.served / max(rep.refs, 1)
    # The pooled bound: one LRU cache of the blocks the deployment declares it holds (every tier of
    # every node, Capabilities.capacity_bytes, a block taking a slot where it has slots), over the
    # same slice; none without a declared capacity.
    caps = d.adapter.capabilities()
    capacity = caps.capacity_bytes // max(size, caps.slot_bytes)
    pooled = sim.bound_pooled(trace, capacity) if capacity else None
    return {
        "trace": trace.name, "requests": len(trace.blocks), "block_refs": rep.refs,
        "unique_blocks": sim.unique_blocks(trace), "block_bytes": size,
        "hit_ratio": hit, "lookup_hit_ratio": rep.looked_up / max(rep.refs, 1),
        "bound_infinite": bound, "vs_bound_infinite": hit / bound if bound else None,
        "capacity_blocks": capacity or None, "bound_pooled": pooled, "vs_bound_pooled": hit / pooled if pooled else None,
        "bytes_read": rep.bytes_read, "bytes_written": rep.bytes_written,
        "bytes_moved": rep.bytes_read + rep.bytes_written, "blocks_written": rep.written,
        "refused": rep.refused,
        "cache_ms_p50": sim.percentile(rep.cache_ms, 50), "cache_ms_p99": sim.percentile(rep.cache_ms, 99),
        "write_ms_p50": sim.percentile(rep.write_ms, 50), "write_ms_p99": sim.percentile(rep.write_ms, 99),
        "ttft_ms_mean": statistics.fmean(rep.ttft_ms), "ttft_ms_p50": sim.percentile(rep.ttft_ms, 50),
        "ttft_ms_p99": sim.percentile(rep.ttft_ms, 99), "no_cache_ttft_ms_mean": statistics.fmean(no_cache),
        "vs_no_cache": statistics.fmean(rep.ttft_ms) / statistics.fmean(no_cache),
        "baseline": "hit ratio: bound_infinite of the same slice (a block id seen before is a hit) and bound_pooled "
                    "(one LRU of the declared capacity_bytes in blocks of this size or of its slot_bytes; none if undeclared), same run; "
                    "TTFT: every block recomputed (vs_no_cache = mean modelled TTFT over mean no-cache TTFT)",
        "ttft_model": f"blocks not served x {prefill_ms:.1f} ms (recompute of {BLOCK_TOKENS} tokens at "
                      f"{sim.DEFAULT_PREFILL_TOKENS_PER_S:,.0f} tokens/s, modelled) + the request's measured "
                      f"lookup, lease and read time ({size} B blocks); writing the missing blocks follows the "
                      "prefill, so its measured time (write_ms) is reported, not added",
    }  # fmt: skip


def trace_slice(path: Path, requests: int) -> sim.Trace:
    """The first ``requests`` requests of the trace at ``path``."""
    t = sim.load_trace(path)
    return sim.Trace(t.name, t.timestamps[:requests], t.blocks[:requests])


# ----------------------------------------------------------------------------------- runner


def skip_reason(name: str, adapter: Adapter, trace: sim.Trace | None, trace_why: str | None) -> str | None:
    """Why workload ``name`` cannot run on this adapter (its declared capabilities), or None."""
    caps = adapter.capabilities()
    if name in ("lease_lookup", "invalidation") and caps.leases == "none":
        return "the adapter declares no read leases (Capabilities.leases == 'none')"
    if name == "invalidation" and "key" not in caps.scopes:
        return "the adapter does not declare the 'key' invalidation scope"
    if name == "trace_replay" and trace is None:
        return trace_why
    return None


def run_workload(body: Callable[[Deployment, Step], dict[str, Any]], factory: Callable[[], Adapter],
                 profile: Profile, seed: int, workdir: Path, step: Step) -> dict[str, Any]:  # fmt: skip
    """One workload on a fresh deployment: its figures with status ``ok``, or status ``skipped``
    (``NotSupported``) or ``error`` with what went wrong."""
    t0 = time.perf_counter()
    try:
        with deployment(factory, profile, seed, workdir) as d:
            out = {"status": "ok", **body(d, step)}
    except NotSupported as e:
        out = {"status": "skipped", "reason": f"the adapter raised NotSupported({e.op})"}
    except Exception as e:  # noqa: BLE001 - an adapter's failure is the workload's result, not a crash
        tb = traceback.format_exception(type(e), e, e.__traceback__)
        out = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": "".join(tb[-4:])}
    out["seconds"] = time.perf_counter() - t0
    return out


def _run_info(adapter_name: str, probe: Adapter, profile: Profile, seed: int) -> dict[str, Any]:
    try:
        versions = {k: str(v) for k, v in probe.versions().items()}
    except Exception as e:  # noqa: BLE001 - versions() before start may fail; the run goes on
        versions = {"error": f"versions() failed: {e}"}
    return {
        "adapter": adapter_name, "adapter_class": type(probe).__name__,
        "capabilities": probe.capabilities().to_json(), "versions": versions, "profile": profile.name,
        "profile_params": asdict(profile), "seed": seed, "python": platform.python_version(),
        "platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "lease_term_ms": LEASE_TERM_MS, "skew_ms": SKEW_MS,
    }  # fmt: skip


def run_suite(factory: Callable[[], Adapter], adapter_name: str, profile: Profile, seed: int,
              trace_path: Path | None = None, step: Step | None = None) -> dict[str, Any]:  # fmt: skip
    """Every workload against adapters made by ``factory``: the content of ``results.json``.
    ``trace_path`` None: the shared conversation trace, the workload skipped if it is not here."""
    step = step or (lambda text: None)
    trace, trace_why = None, None
    try:
        trace = trace_slice(trace_path or sim.default_traces()[0], profile.trace_requests)
    except sim.TraceError as e:
        if trace_path is not None:
            raise BadInput(str(e)) from None
        trace_why = f"no Mooncake trace here ({e})"
    probe = factory()
    info = _run_info(adapter_name, probe, profile, seed)
    bodies: dict[str, Callable[[Deployment, Step], dict[str, Any]]] = {
        "lease_lookup": lease_lookup, "bandwidth": bandwidth, "invalidation": invalidation,
        "trace_replay": lambda d, s: trace_replay_on(d, trace, s),
    }  # fmt: skip
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvcc-bench-suite-") as tmp:
        for i, name in enumerate(WORKLOADS):
            why = skip_reason(name, probe, trace, trace_why)
            if why is not None:
                results[name] = {"status": "skipped", "reason": why}
            else:
                step(f"{name}: starting a deployment")
                results[name] = run_workload(bodies[name], factory, profile, seed + i, Path(tmp) / name, step)
    info["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    ok = all(w["status"] != "error" for w in results.values())
    return {"format": FORMAT, "run": info, "workloads": results, "ok": ok}


# ------------------------------------------------------------------------------- entry points


def prepare_out(out: Path) -> None:
    """``out`` must be absent or empty, and writable: checked before anything is measured."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInput(f"{out} is not an empty directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise BadInput(f"cannot write to {out}: {e.strerror or e}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--adapter", required=True,
                        help="a built-in or entry-point name (kvcc.adapters), or package.module:factory")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="the bundle's directory (empty or absent)")
    parser.add_argument("--profile", default="quick", metavar="NAME",
                        help=f"sizes of the run: {' or '.join(PROFILES)} (default quick)")
    parser.add_argument("--seed", type=int, default=1, help="seed of namespaces, keys and payloads (default 1)")
    parser.add_argument("--trace", type=Path, metavar="FILE",
                        help="a Mooncake JSON Lines trace (default: the shared conversation trace)")
    parser.add_argument("--json", action="store_true", help="print results.json's object and nothing else")  # fmt: skip


def _progress(enabled: bool):
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from kvcc.console import stderr_console

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                    console=stderr_console(), transient=True, disable=not enabled)  # fmt: skip


def cli(args: argparse.Namespace) -> int:
    from kvcc.conformance import registry
    from kvcc.console import print_json, stdout_console

    from kvcc.bench import perf_bundle

    try:
        if args.profile not in PROFILES:
            raise BadInput(f"unknown profile {args.profile!r} (known: {', '.join(PROFILES)})")
        if args.seed < 0:
            raise BadInput(f"--seed must be >= 0, got {args.seed}")
        try:
            factory = registry.resolve(args.adapter)
        except registry.UnknownAdapter as e:
            raise BadInput(str(e)) from None
        prepare_out(args.out)
        with _progress(not args.json) as progress:
            task = progress.add_task("bench suite", total=None)
            results = run_suite(factory, args.adapter, PROFILES[args.profile], args.seed, args.trace,
                                step=lambda text: progress.update(task, description=text))  # fmt: skip
    except BadInput as e:
        print(f"kvcc bench suite: error: {e}", file=sys.stderr)
        return 2
    perf_bundle.write_bundle(results, args.out)
    if args.json:
        print_json(results)
    else:
        console = stdout_console()
        perf_bundle.render(console, results)
        console.print(f"bundle: {args.out} (open {args.out}/report.html; compare with: kvcc bench compare DIR DIR...)")
    return 0 if results["ok"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcc.bench.suite", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return cli(parser.parse_args(list(argv) if argv is not None else None))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
