"""Benchmark: the directory's lease throughput and latency, embedded and on etcd, each beside a
raw baseline measured in the same run (``kvcc bench directory``).

What is measured
----------------
The directory runs as its own process (``kvcc serve directory`` under ``reference.cluster.
LocalCluster``, with its protocol event log on, as deployed), beside one cache node that stores
the blocks. The benchmark process commits ``keys`` blocks (4 KiB each) through the client library,
then drives the directory from ``clients`` concurrent ``KvccClient`` s -- each its own TCP
connection, session and holder id -- on one asyncio loop:

- **pairs**: each client loops ``acquire(ns, key)`` + ``release(lease)`` over the committed keys
  (its own rotation, so clients overlap on keys as readers of a hot prefix do). One pair is one
  read lease granted and ended: two requests, two protocol events at the directory. Its latency is
  ``time.perf_counter_ns`` around the two calls.
- **chains** (issue 13): each client loops ``acquire_chain(ns, chain)`` + ``release_many(leases)``
  over a chain of ``CHAIN_BLOCKS`` committed keys (one ``Batch`` request each way): the blocks of
  a whole prompt prefix leased and ended in two round trips. ``blocks_per_s`` is chain ops/s times
  the chain's length; ``chain_blocks_per_pair`` is that over pairs/s (the same blocks, leased one
  round trip at a time). Each block keeps its own lease and its own two protocol events.
- **ping** (the raw baseline): the same clients send ``Ping`` on the same connections; the
  directory's transport answers it without reaching the directory (``transport.answer_ping``):
  framing, MAC, CBOR and the event loop, nothing else. ``pair_per_ping`` is pairs/s divided by
  ping round trips/s: the fraction of the transport's own rate the lease protocol keeps (a pair
  is two round trips, so 0.5 would mean the directory's work costs nothing).
- **etcd** (backend ``etcd``): the same pairs against a directory whose durable log is a real
  etcd (``reference.etcd_harness``, one member on loopback), and beside it raw etcd
  ``EtcdKV.put`` s of a record-sized value (``reference.etcd_client``, the client library the
  store uses), from ``clients`` threads of this process: ``etcd_pairs_per_put`` is directory
  pairs/s over raw puts/s. Note what a pair costs the log: nothing per pair -- read leases are
  volatile (protocol property 12) and lease ids are reserved durably in blocks (``lease_id_block``), so
  the log sees one commit per block of grants.

- **shards** (``--shards N``, docs/sharding.md): the same load against N directory processes, each
  serving one shard (``kvcc serve directory --shard I --shards N``) with a cache node of its own,
  in the same run as the one directory: a row per backend and shard count. The load holds one
  chain of ``keys`` blocks per shard, rooted in that shard (with one shard, the same chain as
  without the option), and each client has a connection to every shard and sends each request to
  the shard of its key's chain (its root's: ``keys.shard_of``), as a sharded client would; a pair
  is the same two requests as with one directory. ``shard_scaling`` gives pairs/s and chain
  blocks/s with N shards over one, and the directory CPU per operation summed over the shards
  (what projects to more cores: one dedicated core per shard sustains ``1e6 / cpu_us`` each). A
  node registers with one shard here, its own: a deployment's nodes registering with every shard,
  and clients routing by themselves, are steps 3 and later of the design (not built); neither is
  on the path of a lease pair, which never reaches a node.

Trials interleave (ping, pairs, chains[, etcd puts]) ``trials`` times after a warm-up; every figure is the
median over trials (latency percentiles are taken per trial, then the median). The benchmark
process's and the directory process's CPU time over each trial are reported (``client_cpu``,
``directory_cpu``: CPU-seconds per second) to show which side limits the run, and the directory's
CPU time per operation (``directory_cpu_us_per_op``): on a shared, noisy machine the figure least
moved by what else runs (``1e6 / directory_cpu_us_per_op`` estimates what one dedicated core
would sustain).

Why one client process: on the project's 2-core machines the directory takes one core; a second
load process would take the other core's time from this one, not add any, and the CPU figures
above show whether the directory (``directory_cpu`` near 1) or the load (``client_cpu`` near 1)
limits a run. Pass ``--clients`` to change the offered concurrency.

Targets (issue): embedded >= ``TARGET_PAIRS_PER_S`` pairs/s with p99 <= ``TARGET_P99_MS``; chains
>= ``TARGET_CHAIN_BLOCKS_PER_S`` blocks/s with p99 per chain op <= ``TARGET_CHAIN_P99_MS``;
etcd >= ``TARGET_ETCD_RATIO`` of raw etcd puts/s. A benchmark reports; it does not fail on a
missed target. The exit code is 1 only when measuring fails (a process not starting, a request
refused or failing).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BACKENDS = ("embedded", "etcd")
TARGET_PAIRS_PER_S = 20_000
TARGET_P99_MS = 2.0
TARGET_ETCD_RATIO = 0.5
TARGET_CHAIN_BLOCKS_PER_S = 100_000  # issue 13, embedded, 16 clients
TARGET_CHAIN_P99_MS = 5.0  # per chain op: acquire_chain + release_many
CHAIN_BLOCKS = 64
DEFAULT_CLIENTS = 16
DEFAULT_SECONDS = 2.0  # one timed trial of one figure
DEFAULT_TRIALS = 3
DEFAULT_KEYS = 64
WARMUP_S = 0.5
BLOCK_BYTES = 4096
ETCD_VALUE_BYTES = 160  # about one record row (durable.record_row) in canonical CBOR
CLIENT_TIMEOUT_MS = 10_000
CPU_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class BenchError(Exception):
    """Measuring failed (not a missed target)."""


def bench_namespace() -> Any:
    from kvcc.spec.keys import Namespace

    return Namespace("bench-directory", "rev-1", "bfloat16", 16, cache_salt=b"bench")


# ------------------------------------------------------------------------------------ statistics


def _quantile_ms(sorted_ns: Sequence[int], q: float) -> float:
    assert sorted_ns and 0 <= q <= 1
    return sorted_ns[min(len(sorted_ns) - 1, int(q * len(sorted_ns)))] / 1e6


def _trial(ops: int, seconds: float, latencies_ns: list[int]) -> dict[str, float]:
    if ops == 0 or not latencies_ns:
        raise BenchError("a timed trial completed no operation")
    lat = sorted(latencies_ns)
    return {"ops": ops, "seconds": seconds, "per_s": ops / seconds,
            "p50_ms": _quantile_ms(lat, 0.50), "p99_ms": _quantile_ms(lat, 0.99)}  # fmt: skip


def _median(trials: list[dict[str, float]], name: str) -> float:
    return statistics.median(t[name] for t in trials)


def _summary(trials: list[dict[str, float]]) -> dict[str, Any]:
    return {"per_s": _median(trials, "per_s"), "p50_ms": _median(trials, "p50_ms"),
            "p99_ms": _median(trials, "p99_ms"), "ops": sum(int(t["ops"]) for t in trials),
            "trials": trials}  # fmt: skip


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc; 0 where unavailable)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CPU_TICKS_PER_S


# ------------------------------------------------------------------------------------ the load


class _Load:
    """``clients`` load clients, each a KvccClient per shard (one cluster per shard; one cluster for
    the one directory), on the caller's event loop."""

    def __init__(self, clusters: Sequence[Any], clients: int, keys: int) -> None:
        from kvcc.reference.cluster import ENGINE_TENANT
        from kvcc.spec.keys import chain_keys, shard_of

        self.clusters = list(clusters)  # cluster s: the directory serving shard s of len(clusters)
        shards = len(self.clusters)
        self.ns = bench_namespace()
        self.ns_digest = self.ns.digest()  # as an engine keeps it: hashing per request is the load's cost
        # One chain of ``keys`` blocks (each block's parent the one before: a prompt's blocks) per
        # shard, rooted in it; with one shard, the chain of tokens 0, 1, 2, ...
        self.shard_chains: list[list[Any]] = []
        for shard in range(shards):
            for base in itertools.count():
                chain = chain_keys(self.ns, list(range(base, base + keys * self.ns.block_tokens)))
                if shard_of(chain[0].digest, shards) == shard:
                    self.shard_chains.append(chain)
                    break
        # Pairs rotate over every shard's keys, shards interleaved: (shard, key).
        self.keys = [(s, chain[j]) for j in range(keys) for s, chain in enumerate(self.shard_chains)]
        self.chain_keys = [chain[:CHAIN_BLOCKS] for chain in self.shard_chains]
        self.n_clients = clients
        self.tenant = ENGINE_TENANT
        self.clients: list[list[Any]] = []  # per load client, a KvccClient per shard

    async def start(self) -> None:
        from kvcc.reference.client import KvccClient, Refused
        from kvcc.spec.vocabulary import REASON_NOT_ABSENT

        for i in range(self.n_clients):
            per_shard = []
            for s, cluster in enumerate(self.clusters):
                c = KvccClient(cluster.directory_address, self.tenant, cluster.engine_token, client_id=f"bench-{i}-{s}",
                               skew_ms=cluster.skew_ms, timeout_ms=CLIENT_TIMEOUT_MS)  # fmt: skip
                per_shard.append(c)
                await c.start()
            self.clients.append(per_shard)
        for s, chain in enumerate(self.shard_chains):
            writer = self.clients[0][s]
            parent = None
            for key in chain:
                out = await writer.put(self.ns, key, parent, key.digest * (BLOCK_BYTES // len(key.digest)))
                if isinstance(out, Refused) and out.reason != REASON_NOT_ABSENT:
                    raise BenchError(f"committing the benchmark's blocks: {out}")
                parent = key

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for per_shard in self.clients for c in per_shard), return_exceptions=True)

    async def _run(self, one: Callable[[Any, int], Any], seconds: float) -> dict[str, float]:
        """Every client runs ``one(client, i)`` in a loop for ``seconds``; latency per call."""
        latencies: list[int] = []
        counts = [0] * len(self.clients)
        stop = False

        async def loop(idx: int, client: Any) -> None:
            append, clock = latencies.append, time.perf_counter_ns
            i = idx * 7919  # each client its own rotation over the keys
            while not stop:
                t0 = clock()
                await one(client, i)
                append(clock() - t0)
                counts[idx] += 1
                i += 1

        tasks = [asyncio.create_task(loop(idx, c)) for idx, c in enumerate(self.clients)]
        start = time.perf_counter()
        try:
            await asyncio.sleep(seconds)
            stop = True
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        elapsed = time.perf_counter() - start
        return _trial(sum(counts), elapsed, latencies)

    async def pair(self, client: Any, i: int) -> None:
        from kvcc.reference.client import Refused

        shard, key = self.keys[i % len(self.keys)]
        lease = await client[shard].acquire(self.ns_digest, key)
        if isinstance(lease, Refused):
            raise BenchError(f"acquire refused: {lease}")
        await client[shard].release(lease)

    async def chain(self, client: Any, i: int) -> None:
        shard = i % len(self.chain_keys)
        chain = self.chain_keys[shard]
        leases, why = await client[shard].acquire_chain(self.ns_digest, chain)
        if why is not None or len(leases) != len(chain):
            raise BenchError(f"acquire_chain leased {len(leases)} of {len(chain)}: {why}")
        await client[shard].release_many(leases)

    async def chains(self, seconds: float) -> dict[str, float]:
        return await self._run(self.chain, seconds)

    async def ping(self, client: Any, i: int) -> None:
        await client[i % len(client)]._dir.ping(i & 0xFFFF)  # the same connections the leases use

    async def pairs(self, seconds: float) -> dict[str, float]:
        return await self._run(self.pair, seconds)

    async def pings(self, seconds: float) -> dict[str, float]:
        return await self._run(self.ping, seconds)


def _etcd_puts(endpoints: list[str], prefix: str, threads: int, seconds: float) -> dict[str, float]:
    """Raw etcd: ``threads`` threads putting record-sized values for ``seconds`` with one
    shared ``EtcdKV`` (a connection per thread, as the store uses it)."""
    from kvcc.reference.etcd_client import EtcdKV

    kv = EtcdKV(endpoints)
    value = bytes(range(256))[:ETCD_VALUE_BYTES]
    latencies: list[list[int]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []
    deadline = time.perf_counter() + seconds

    def run(idx: int) -> None:
        lat, clock = latencies[idx], time.perf_counter_ns
        try:
            for n in itertools.count():
                if time.perf_counter() >= deadline:
                    return
                t0 = clock()
                kv.put(f"{prefix}/raw/{idx}/{n % 64}", value)
                lat.append(clock() - t0)
        except BaseException as e:  # reported below, in the calling thread
            errors.append(e)

    start = time.perf_counter()
    workers = [threading.Thread(target=run, args=(i,), name=f"etcd-put-{i}") for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - start
    kv.close()
    if errors:
        raise BenchError(f"raw etcd put failed: {errors[0]!r}")
    flat = [x for lat in latencies for x in lat]
    return _trial(len(flat), elapsed, flat)


# ------------------------------------------------------------------------------------ one backend


def _measure_backend(backend: str, *, clients: int, seconds: float, trials: int, keys: int,
                     workdir: Path, progress: Callable[[str], None], shards: int = 1) -> dict[str, Any]:  # fmt: skip
    from contextlib import ExitStack

    from kvcc.reference.cluster import LocalCluster

    with ExitStack() as stack:
        etcd = None
        kwargs: dict[str, Any] = {}
        if backend == "etcd":
            from kvcc.reference.etcd_harness import EtcdCluster

            progress("etcd: starting one member on loopback")
            etcd = stack.enter_context(EtcdCluster(members=1))
            kwargs = {"backend": "etcd", "etcd_endpoints": ",".join(etcd.endpoints)}
        label = backend if shards == 1 else f"{backend}, {shards} shards"
        progress(f"{label}: starting the directory and a node" if shards == 1
                 else f"{label}: starting {shards} directory shards, each with a node")  # fmt: skip
        clusters = [stack.enter_context(LocalCluster(
            workdir / (backend if shards == 1 else f"{backend}-shard{s}-of-{shards}"), nodes=1,
            tiers=(f"dram={max(1, keys * BLOCK_BYTES * 2 // (1 << 20) + 1)}MiB",), block_bytes=BLOCK_BYTES,
            namespaces=[bench_namespace()], shard=None if shards == 1 else (s, shards), **kwargs))
            for s in range(shards)]  # fmt: skip
        cluster = clusters[0]
        directory_pids = [c.procs["directory"].popen.pid for c in clusters]
        from kvcc.reference.loop import loop_factory

        runner = stack.enter_context(asyncio.Runner(loop_factory=loop_factory()))
        load = _Load(clusters, clients, keys)
        try:
            progress(f"{label}: {clients} clients, committing {keys * shards} blocks")
            runner.run(load.start())
            runner.run(load.pings(WARMUP_S))
            runner.run(load.pairs(WARMUP_S))
            runner.run(load.chains(WARMUP_S))
            pings, pairs, chains, puts = [], [], [], []
            def timed(what: Any) -> dict[str, float]:
                d0, c0, w0 = sum(map(_proc_cpu_s, directory_pids)), time.process_time(), time.perf_counter()
                r = runner.run(what)
                wall = time.perf_counter() - w0
                d = sum(map(_proc_cpu_s, directory_pids)) - d0  # every shard's directory
                r.update(directory_cpu=d / wall, client_cpu=(time.process_time() - c0) / wall,
                         directory_cpu_us_per_op=d * 1e6 / r["ops"])  # fmt: skip
                return r

            for t in range(trials):
                progress(f"{label}: trial {t + 1}/{trials}: ping")
                pings.append(timed(load.pings(seconds)))
                progress(f"{label}: trial {t + 1}/{trials}: acquire+release")
                pairs.append(timed(load.pairs(seconds)))
                progress(f"{label}: trial {t + 1}/{trials}: chains of {len(load.chain_keys[0])}")
                chains.append(timed(load.chains(seconds)))
                if etcd is not None:
                    progress(f"{label}: trial {t + 1}/{trials}: raw etcd put")
                    puts.append(_etcd_puts(etcd.endpoints, f"{cluster.etcd_prefix}-raw", clients, seconds))
            for c in clusters:
                if not c.alive("directory"):
                    raise BenchError(f"the directory died:\n{c.procs['directory'].tail()}")
        finally:
            runner.run(load.close())
    cpu = ("directory_cpu", "client_cpu", "directory_cpu_us_per_op")
    out: dict[str, Any] = {
        "backend": backend,
        "shards": shards,
        "pairs": {**_summary(pairs), **{k: _median(pairs, k) for k in cpu}},
        "ping": {**_summary(pings), **{k: _median(pings, k) for k in cpu}},
    }
    out["pair_per_ping"] = out["pairs"]["per_s"] / out["ping"]["per_s"]
    chain_blocks = min(keys, CHAIN_BLOCKS)
    out["chains"] = {**_summary(chains), **{k: _median(chains, k) for k in cpu}, "blocks": chain_blocks}
    out["chains"]["blocks_per_s"] = out["chains"]["per_s"] * chain_blocks
    out["chains"]["directory_cpu_us_per_block"] = out["chains"]["directory_cpu_us_per_op"] / chain_blocks
    out["chain_blocks_per_pair"] = out["chains"]["blocks_per_s"] / out["pairs"]["per_s"]
    out["chains_meet_target"] = (out["chains"]["blocks_per_s"] >= TARGET_CHAIN_BLOCKS_PER_S
                                 and out["chains"]["p99_ms"] <= TARGET_CHAIN_P99_MS)  # fmt: skip
    if puts:
        out["etcd_put"] = _summary(puts)
        out["etcd_pairs_per_put"] = out["pairs"]["per_s"] / out["etcd_put"]["per_s"]
    if backend == "embedded":
        out["meets_target"] = out["pairs"]["per_s"] >= TARGET_PAIRS_PER_S and out["pairs"]["p99_ms"] <= TARGET_P99_MS
    else:
        out["meets_target"] = out["etcd_pairs_per_put"] >= TARGET_ETCD_RATIO
    return out


def shard_scaling(one: dict[str, Any], many: dict[str, Any]) -> dict[str, Any]:
    """A sharded row against the one-directory row of the same backend, same run."""
    return {
        "backend": one["backend"], "shards": many["shards"],
        "pairs_ratio": many["pairs"]["per_s"] / one["pairs"]["per_s"],
        "chain_blocks_ratio": many["chains"]["blocks_per_s"] / one["chains"]["blocks_per_s"],
        "directory_cpu": {"one": one["pairs"]["directory_cpu"], "sharded": many["pairs"]["directory_cpu"]},
        "load_cpu": {"one": one["pairs"]["client_cpu"], "sharded": many["pairs"]["client_cpu"]},
        "directory_cpu_us_per_pair": {"one": one["pairs"]["directory_cpu_us_per_op"],
                                      "sharded": many["pairs"]["directory_cpu_us_per_op"]},
        # What one dedicated core per shard would sustain, from the CPU each pair cost the shards.
        "projected_pairs_per_s_per_shard_core": 1e6 / many["pairs"]["directory_cpu_us_per_op"],
    }  # fmt: skip


def measure(backends: Sequence[str] = BACKENDS, clients: int = DEFAULT_CLIENTS, seconds: float = DEFAULT_SECONDS,
            trials: int = DEFAULT_TRIALS, keys: int = DEFAULT_KEYS,
            on_progress: Callable[[str], None] | None = None, shards: int = 1) -> dict[str, Any]:  # fmt: skip
    """Run the benchmark; returns one JSON-able object (see the module docstring)."""
    for b in backends:
        if b not in BACKENDS:
            raise BenchError(f"backends are {', '.join(BACKENDS)}; got {b!r}")
    assert clients >= 1 and seconds > 0 and trials >= 1 and keys >= 1 and shards >= 1
    progress = on_progress or (lambda what: None)
    started = time.perf_counter()
    rows, sharded, scaling = [], [], []
    with tempfile.TemporaryDirectory(prefix="kvcc-bench-directory-") as tmp:
        for backend in backends:
            rows.append(_measure_backend(backend, clients=clients, seconds=seconds, trials=trials, keys=keys,
                                         workdir=Path(tmp), progress=progress))  # fmt: skip
            if shards > 1:
                sharded.append(_measure_backend(backend, clients=clients, seconds=seconds, trials=trials, keys=keys,
                                                workdir=Path(tmp), progress=progress, shards=shards))  # fmt: skip
                scaling.append(shard_scaling(rows[-1], sharded[-1]))
    return {
        "clients": clients, "seconds": seconds, "trials": trials, "keys": keys, "cpus": os.cpu_count(),
        "target": {"embedded_pairs_per_s": TARGET_PAIRS_PER_S, "embedded_p99_ms": TARGET_P99_MS,
                   "etcd_pairs_per_put": TARGET_ETCD_RATIO, "embedded_chain_blocks_per_s": TARGET_CHAIN_BLOCKS_PER_S,
                   "embedded_chain_p99_ms": TARGET_CHAIN_P99_MS},
        "rows": rows,
        "shards": shards,
        "sharded_rows": sharded,
        "shard_scaling": scaling,
        "met": {row["backend"]: row["meets_target"] for row in rows},
        "chains_met": {row["backend"]: row["chains_meet_target"] for row in rows if row["backend"] == "embedded"},
        "elapsed_s": round(time.perf_counter() - started, 1),
    }  # fmt: skip


# ------------------------------------------------------------------------------------ output


def render(console: Any, r: dict[str, Any]) -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    t = Table(title=f"Directory leases: acquire+release pairs, {r['clients']} clients, median of {r['trials']} "
                    f"x {r['seconds']} s", box=box.SIMPLE_HEAVY, title_justify="left")  # fmt: skip
    for name, justify in (("backend", "left"), ("what", "left"), ("per s", "right"), ("p50 ms", "right"),
                          ("p99 ms", "right"), ("ratio", "right"), ("target", "left")):  # fmt: skip
        t.add_column(name, justify=justify)
    for row in r["rows"]:
        b = row["backend"]
        met = Text("met", style="green") if row["meets_target"] else Text("missed", style="bold yellow")
        p = row["pairs"]
        if b == "embedded":
            goal = f">= {r['target']['embedded_pairs_per_s']:,}/s, p99 <= {r['target']['embedded_p99_ms']} ms: "
            t.add_row(b, "acquire+release", f"{p['per_s']:,.0f}", f"{p['p50_ms']:.2f}", f"{p['p99_ms']:.2f}",
                      f"{row['pair_per_ping']:.2f} of ping", Text(goal).append_text(met))  # fmt: skip
        else:
            goal = f">= {r['target']['etcd_pairs_per_put']} of etcd put: "
            t.add_row(b, "acquire+release", f"{p['per_s']:,.0f}", f"{p['p50_ms']:.2f}", f"{p['p99_ms']:.2f}",
                      f"{row['etcd_pairs_per_put']:.2f} of put", Text(goal).append_text(met))  # fmt: skip
        c = row["chains"]
        goal = ""
        if b == "embedded":
            chains_met = Text("met", style="green") if row["chains_meet_target"] else Text("missed", style="bold yellow")
            goal = Text(f">= {r['target']['embedded_chain_blocks_per_s']:,} blocks/s, p99 <= "
                        f"{r['target']['embedded_chain_p99_ms']} ms: ").append_text(chains_met)  # fmt: skip
        t.add_row("", f"chains of {c['blocks']}: blocks", f"{c['blocks_per_s']:,.0f}", f"{c['p50_ms']:.2f}",
                  f"{c['p99_ms']:.2f}", f"{row['chain_blocks_per_pair']:.1f} x pairs", goal)  # fmt: skip
        q = row["ping"]
        t.add_row("", "raw: ping round trip", f"{q['per_s']:,.0f}", f"{q['p50_ms']:.2f}", f"{q['p99_ms']:.2f}",
                  f"pairs {row['pair_per_ping']:.2f}", "")  # fmt: skip
        if "etcd_put" in row:
            e = row["etcd_put"]
            t.add_row("", "raw: etcd put", f"{e['per_s']:,.0f}", f"{e['p50_ms']:.2f}", f"{e['p99_ms']:.2f}", "", "")
    console.print(t)
    if r.get("shard_scaling"):
        s = Table(title=f"Sharded directory: {r['shards']} shards against one, same run", box=box.SIMPLE_HEAVY,
                  title_justify="left")  # fmt: skip
        for name in ("backend", "pairs/s", "x one", "chain blocks/s", "x one", "directory CPU", "us a pair",
                     "load CPU"):  # fmt: skip
            s.add_column(name, justify="left" if name == "backend" else "right")
        for row, sc in zip(r["sharded_rows"], r["shard_scaling"]):
            s.add_row(f"{row['backend']}, {row['shards']} shards", f"{row['pairs']['per_s']:,.0f}",
                      f"{sc['pairs_ratio']:.2f}", f"{row['chains']['blocks_per_s']:,.0f}",
                      f"{sc['chain_blocks_ratio']:.2f}", f"{row['pairs']['directory_cpu']:.2f}",
                      f"{row['pairs']['directory_cpu_us_per_op']:.0f}", f"{row['pairs']['client_cpu']:.2f}")  # fmt: skip
        console.print(s)
    cpu = "; ".join(f"{row['backend']}: directory {row['pairs']['directory_cpu']:.2f} "
                    f"({row['pairs']['directory_cpu_us_per_op']:.0f} us per pair, "
                    f"{row['ping']['directory_cpu_us_per_op']:.0f} per ping), "
                    f"load {row['pairs']['client_cpu']:.2f}" for row in r["rows"])  # fmt: skip
    console.print(Text(f"CPU-seconds per second during the pairs ({r['cpus']} cpus): {cpu}. {r['elapsed_s']} s",
                       style="dim"))  # fmt: skip


def _backends(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in BACKENDS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"backends are {', '.join(BACKENDS)}; got {text!r}")
    return names


def _seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not s > 0 or s > 3600:
        raise argparse.ArgumentTypeError(f"seconds must be in (0, 3600]: {text!r}")
    return s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvcc.console import positive_int

    parser.add_argument("--backends", type=_backends, default=list(BACKENDS), metavar="LIST",
                        help=f"directory backends, comma-separated (default {','.join(BACKENDS)})")
    parser.add_argument("--clients", type=positive_int, default=DEFAULT_CLIENTS, metavar="N",
                        help=f"concurrent clients, one connection each (default {DEFAULT_CLIENTS})")
    parser.add_argument("--seconds", type=_seconds, default=DEFAULT_SECONDS, metavar="S",
                        help=f"length of one timed trial (default {DEFAULT_SECONDS})")
    parser.add_argument("--trials", type=positive_int, default=DEFAULT_TRIALS, metavar="N",
                        help=f"timed trials per figure, median reported (default {DEFAULT_TRIALS})")
    parser.add_argument("--keys", type=positive_int, default=DEFAULT_KEYS, metavar="N",
                        help=f"committed blocks the clients lease (default {DEFAULT_KEYS})")
    parser.add_argument("--shards", type=positive_int, default=1, metavar="N",
                        help="also measure N directory shards against one, in the same run (default 1: not)")
    parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")


def run(json: bool = False, **options: Any) -> dict[str, Any]:
    """Measure (``options`` as for ``measure``), print rich tables (or JSON with ``json=True``),
    return the result."""
    from kvcc.console import measure_and_show

    return measure_and_show("directory", measure, render, json, **options)


def cli(args: argparse.Namespace) -> int:
    """``kvcc bench directory`` with the arguments of ``add_arguments``; 0, or 1 if measuring failed."""
    from kvcc.reference.cluster import ClusterError
    from kvcc.reference.errors import ConnectionFailed, TimeoutError_
    from kvcc.reference.etcd_harness import EtcdHarnessError

    try:
        run(json=args.json, backends=args.backends, clients=args.clients, seconds=args.seconds,
            trials=args.trials, keys=args.keys, shards=args.shards)  # fmt: skip
    except (BenchError, ClusterError, EtcdHarnessError, ConnectionFailed, TimeoutError_, OSError) as exc:
        print(f"kvcc bench directory: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcc.bench.directory", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return cli(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
