"""Benchmark: a bounded soak of a real deployment under load and faults (``kvcc bench soak``).

What runs
---------
A ``LocalCluster`` on loopback (a directory process and ``NODES`` cache-node processes, DRAM
tier only; ``--backend etcd`` puts the directory's log on a one-member etcd started for the run).
``--clients M`` threads, each a ``SyncClient`` co-located with a node (``n1.c0``, ``n2.c1``, ...:
its writes land on that node, and that node's crash is its crash), run a seeded random workload
for the duration over a bounded key space (``NAMESPACES`` x ``CHAINS`` chains of
``CHAIN_BLOCKS`` blocks, ``CHAINS`` more for every ``CHAINS_SCALE_S`` of run, so that no key outlives
the validator's model; the tiers never evict):

- **put chain**: a ``lookup`` of a chain's first 1 .. ``CHAIN_BLOCKS`` blocks, then
  ``begin_write`` / ``write_bytes`` / ``commit`` of those not cached, root first. Each
  generation's bytes are derived from (key, generation, writer, nonce) and recorded by digest
  *before* they are sent; a commit is *acknowledged* when the directory answered ``Committed``,
  *uncertain* when the answer was lost (a directory killed under it) -- both are legitimate
  contents of the key later.
- **read**: ``acquire`` (or ``renew`` of a lease still held), ``read``, sometimes ``renew`` and
  read again, usually ``release`` (sometimes the lease is kept, to be revoked or to expire).
  Every read's bytes must be exactly the recorded bytes of the generation its lease names:
  anything else -- a mix, a truncation, another generation's bytes, bytes of a generation nobody
  wrote -- counts in ``wrong_bytes``.
- **lookup** of a chain; **invalidate** of a key, a prefix or (rarely) a namespace, then wait
  for the ticket.

With ``--faults`` a fault thread, every ``FAULT_INTERVAL_S`` (seeded), does one of: kill -9 of a
node and its restart (the node's co-located clients crash with it: their operations are held off
while it happens, and they forget every lease and write, as a crashed process would), SIGSTOP of
a node for ``PAUSE_S`` then SIGCONT, kill -9 of the directory and its restart on its durable log
(at most ``MAX_DIRECTORY_RESTARTS`` per run: each restart is a shared event of every key's
projection in trace validation, whose cost grows with them; the fault thread then waits until
every node has registered again), and with ``--backend etcd`` kill -9 and restart of the etcd
member (same cap). By default the clients keep running while the directory dies (requests in
flight are lost: the client logs ``abandon`` or ``abort`` for each, as the spec's holder and writer
give them up); ``--quiesce-directory-restarts`` holds their operations meanwhile. A directory
killed after a step is durable and before its line is logged loses no line: the restarted one
appends the lines its store kept with the step (``events.append_missing``; this soak found it).

After the run the faults stop, every process is up, the cluster settles for two lease terms, and
a fresh client checks every key that ever had an acknowledged commit. Then every process stops
and the merged event trace of the run (every process's log, the clients' and the fault
injector's crash events), written to ``<workdir>/cluster/trace.ndjson``, is replayed through the
spec by the trace validator in a child process stopped after ``--validate-timeout`` seconds
(then INCONCLUSIVE, ``time_limit``). A REJECTED verdict fails the run.

What "lost" means
-----------------
For a key, let *g* be its newest acknowledged generation and *t* the moment its ``begin_write``
was sent (the write may land on the node from then on). At the end the key is:

- ``intact``: a lease is granted on generation >= *g* and the read returns that generation's
  recorded bytes (a newer generation is one of ours whose commit answer was lost);
- ``invalidated``: not readable, and an invalidation covering it -- its own key, an ancestor (key
  scope cascades to descendants), a prefix at or above it, its namespace -- was *answered* at or
  after *t* (or never answered): it was asked to go, so its absence is not a loss;
- ``lost_to_crash``: not readable, not invalidated, and a node that held any generation of the
  key or of one of its ancestors was down at or after *t* (killed then, or killed before and back
  only then: the directory voids a lost copy's subtree when its node says Hello again, so a child
  committed under a parent already lost goes with it). DRAM is volatile: a kill -9 of the
  only copy's node loses it (a lost ancestor takes its subtree with it: the directory voids the
  keys of a node declared down, and a rejoined node has nothing);
- ``lost_committed`` (must be 0): anything else -- an acknowledged commit that no invalidation
  and no node crash explains, yet is unreadable, or reads as an *older* generation. A directory
  crash never excuses a loss: commits are durable in its log before they are acknowledged.

Figures
-------
``ops`` (per kind and outcome), ``faults`` (per kind), ``commits`` (acknowledged, uncertain),
``reads_verified``, ``wrong_bytes``, the end check's classes, ``violations`` (each named in
``problems``: a trace REJECTED, a client call failing other than with a ``KvccError``, a worker
thread dying or not stopping, a process log holding a traceback, a node not registering again
after a directory restart, a process not running at the end, the validator failing), the
trace's verdict (INCONCLUSIVE is reported as such, and is not a failure: a validator bound, not
evidence of a bug; the validator's cost grows with the crashes and restarts every key's
projection shares, so runs much past 30 s with faults usually end at the time limit), latency
per operation, and timings.

Exit code: 0 when ``lost_committed``, ``wrong_bytes`` and ``violations`` are 0 and the trace was
not REJECTED; 1 otherwise (or if the deployment did not start); 2 on bad input.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import heapq
import json
import math
import random
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from kvcc.reference.client import Refused
from kvcc.reference.cluster import ClusterError, LocalCluster
from kvcc.reference.errors import KvccError
from kvcc.reference.routing.sim import percentile
from kvcc.spec.keys import BlockKey, Namespace, chain_keys
from kvcc.spec.vocabulary import SCOPE_KEY, SCOPE_NAMESPACE, SCOPE_PREFIX

DEFAULT_SECONDS = 60
MAX_SECONDS = 60 * 60  # a soak is bounded: an hour at most
DEFAULT_CLIENTS = 3
MAX_CLIENTS = 16
DEFAULT_SEED = 1
NODES = 3
BLOCK_TOKENS = 2
BLOCK_BYTES = 4096
TIER_MIB = 8  # each node's DRAM: 2,048 slots for at most NAMESPACES * CHAINS * CHAIN_BLOCKS live keys
NAMESPACES = 2
CHAINS = 16  # per namespace, per CHAINS_SCALE_S of run (tiers scaled alike)
# A longer run gets more chains, so that no key lives through more than the trace validator's model
# holds in one projection (``validate.MAX_PROJECTION_COUNT`` epochs: a 10-minute run over one
# CHAINS' worth took a key through 312). About 30 epochs a key a minute at the workload's rates.
CHAINS_SCALE_S = 240
CHAIN_BLOCKS = 4
LEASE_TERM_MS, SKEW_MS = 1500, 100
REQUEST_TIMEOUT_MS = 1500  # a request to a SIGSTOPped node gives up after this
TICKET_WAIT_S = 3 * LEASE_TERM_MS / 1000  # an invalidation completes within a term after its leases end
THINK_S = (0.0, 0.02)  # a worker's pause between two operations
FAULT_INTERVAL_S = (2.0, 5.0)
PAUSE_S = (0.2, 1.0)  # well under the directory's 10 s silence detector (a paused node comes back)
MAX_DIRECTORY_RESTARTS = 4  # per run, directory and etcd together: see the module docstring
REGISTER_TIMEOUT_S = 20.0
SETTLE_S = 2 * (LEASE_TERM_MS + SKEW_MS) / 1000  # leases end, invalidations complete, frees go out
FINAL_ATTEMPTS = 20  # per key, at the end: refusals that pass (invalidating, busy) are retried
FINAL_RETRY_S = 0.25
JOIN_TIMEOUT_S = 150.0  # a worker's current call may take SyncClient's 120 s at most
DEFAULT_VALIDATE_TIMEOUT_S = 600.0
DETAILS_MAX = 20  # listed cases per figure
OPS = ("put_chain", "read", "lookup", "invalidate")
OP_WEIGHTS = (3, 5, 2, 1)
FAULT_KINDS = ("kill_node", "pause_node", "restart_directory", "restart_etcd")

assert PAUSE_S[1] * 1000 < 10_000  # NODE_DOWN_AFTER_MS_DEFAULT: a pause must not be taken for a crash
assert REQUEST_TIMEOUT_MS <= LEASE_TERM_MS
assert NAMESPACES * CHAINS * CHAIN_BLOCKS * 4 * BLOCK_BYTES < TIER_MIB << 20  # no eviction, even with frees pending


def key_space_scale(seconds: float) -> int:
    """How many times ``CHAINS`` chains a namespace (and ``TIER_MIB`` a node) a run of ``seconds`` gets."""
    return max(1, math.ceil(seconds / CHAINS_SCALE_S))


class SoakError(Exception):
    """The soak could not be set up (bad input or a deployment that would not start)."""


class KeyInfo(NamedTuple):
    ns: int  # index into Run.namespaces
    chain: int
    index: int  # position in its chain: keys[:index] are its ancestors


class Gen(NamedTuple):
    """One write this soak made: a (key, generation) and what it sent there."""

    digest: bytes
    length: int
    node: str
    writer: str
    begin_s: float  # monotonic: when its begin_write was sent


class Invalidation(NamedTuple):
    ns: int
    scope: str
    chain: int
    index: int
    answered_s: float  # monotonic; inf: never answered (it may still have happened)


class Worker:
    def __init__(self, name: str, home: str, client: Any) -> None:
        self.name, self.home, self.client = name, home, client
        self.lock = threading.Lock()  # held for each operation; the fault thread takes it to crash the node
        self.thread: threading.Thread | None = None


def block_data(key: BlockKey, gen: int, writer: str, nonce: int) -> bytes:
    """A generation's bytes: distinct per (key, generation, writer, nonce), of a length that
    varies, so a truncation or another write's bytes never pass for them."""
    seed = hashlib.sha256(b"kvcc-soak/%s/%d/%s/%d" % (key.digest, gen, writer.encode(), nonce)).digest()
    length = BLOCK_BYTES // 2 + int.from_bytes(seed[:2], "big") % (BLOCK_BYTES // 2)
    return (seed * (length // len(seed) + 1))[:length]


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


@dataclasses.dataclass
class Outage:
    """A node killed (``killed_s``, monotonic) and back (``back_s``: None until then). Its loss
    reaches the directory when it says Hello again (spec: restart_node voids the lost copies with
    their subtrees), so a key written between the two is lost too."""

    node: str
    killed_s: float
    back_s: float | None = None


class Ledger:
    """What the soak did that the end check judges by: every write (by digest), every
    acknowledged commit, every invalidation, every kill. Shared by the threads (one lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: dict[BlockKey, KeyInfo] = {}
        self.written: dict[tuple[BlockKey, int], list[Gen]] = {}
        self.acked: dict[BlockKey, tuple[int, Gen]] = {}  # the newest acknowledged generation
        self.uncertain = 0
        self.invalidations: list[Invalidation] = []
        self.kills: list[Outage] = []
        self.gen_reused = 0  # a (key, generation) granted to two writes

    def wrote(self, key: BlockKey, gen: int, g: Gen) -> None:
        with self.lock:
            same = self.written.setdefault((key, gen), [])
            if same:
                self.gen_reused += 1
            same.append(g)

    def commit_acked(self, key: BlockKey, gen: int, g: Gen) -> None:
        with self.lock:
            if key not in self.acked or self.acked[key][0] < gen:
                self.acked[key] = (gen, g)

    def kill(self, node: str) -> Outage:
        with self.lock:
            outage = Outage(node, time.monotonic())
            self.kills.append(outage)
            return outage

    def back(self, outage: Outage) -> None:
        with self.lock:
            outage.back_s = time.monotonic()

    def matches(self, key: BlockKey, gen: int, data: bytes) -> bool:
        with self.lock:
            gens = list(self.written.get((key, gen), ()))
        d = _digest(data)
        return any(g.digest == d and g.length == len(data) for g in gens)

    def nodes_of(self, key: BlockKey) -> set[str]:
        return {g.node for (k, _), gens in self.written.items() if k == key for g in gens}

    def invalidated_since(self, info: KeyInfo, since_s: float) -> bool:
        for inv in self.invalidations:
            if inv.ns != info.ns or inv.answered_s < since_s:
                continue
            if inv.scope == SCOPE_NAMESPACE or (inv.chain == info.chain and inv.index <= info.index):
                return True
        return False

    def killed_since(self, nodes: set[str], since_s: float) -> bool:
        """A node of ``nodes`` was down at or after ``since_s``: killed then, or killed before and
        back (its Hello, which voids what it lost) only then."""
        return any(o.node in nodes and (o.back_s is None or o.back_s >= since_s) for o in self.kills)


class Run:
    """One soak's mutable record."""

    def __init__(self, cluster: LocalCluster, namespaces: list[Namespace], seed: int, etcd: Any = None,
                 chains: int = CHAINS) -> None:
        self.cluster = cluster
        self.etcd = etcd
        self.namespaces = namespaces
        self.seed = seed
        self.ledger = Ledger()
        self.chains = [[chain_keys(ns, [1000 * c + t for t in range(BLOCK_TOKENS * CHAIN_BLOCKS)])
                        for c in range(chains)] for ns in namespaces]  # fmt: skip
        self.chain_count = chains
        for n, chains in enumerate(self.chains):
            for c, keys in enumerate(chains):
                for i, key in enumerate(keys):
                    self.ledger.keys[key] = KeyInfo(n, c, i)
        self.stop = threading.Event()
        self.faults_done = threading.Event()
        self.finished = threading.Event()  # every process of the soak stopped
        self.lock = threading.Lock()
        self.ops: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.latency_s: dict[str, list[float]] = {op: [] for op in OPS}
        self.reads_verified = 0
        self.wrong_bytes: list[str] = []
        self.problems: list[str] = []
        self.nonce = 0
        self.workers: list[Worker] = []
        self.notes: list[str] = []
        self.quiesce_directory = False

    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.ops[what] += n

    def problem(self, text: str) -> None:
        with self.lock:
            if text not in self.problems:
                self.problems.append(text)

    def next_nonce(self) -> int:
        with self.lock:
            self.nonce += 1
            return self.nonce

    def check_read(self, key: BlockKey, gen: int, data: bytes, where: str) -> bool:
        """The one judge of a read: exactly the recorded bytes of the generation the lease named."""
        if self.ledger.matches(key, gen, data):
            with self.lock:
                self.reads_verified += 1
            return True
        with self.lock:
            self.wrong_bytes.append(f"{where}: {key.hex[:16]} generation {gen}: {len(data)} bytes that no write of "
                                    f"that generation sent")  # fmt: skip
        return False

    # ------------------------------------------------------------------ operations

    def op_put_chain(self, w: Worker, rng: random.Random) -> None:
        n, c = rng.randrange(NAMESPACES), rng.randrange(self.chain_count)
        ns, keys = self.namespaces[n], self.chains[n][c]
        depth = rng.randint(1, CHAIN_BLOCKS)
        cached = w.client.lookup(ns, keys[:depth]).blocks  # as an engine would: write only what is missing
        if cached == depth:
            self.count("put_cached")
        for i in range(cached, depth):
            key, parent = keys[i], (keys[i - 1] if i else None)
            begin_s = time.monotonic()
            wl = w.client.begin_write(ns, key, parent)
            if isinstance(wl, Refused):
                self.count(f"put_begin_refused_{wl.reason}")
                continue  # not_absent: the block is there already, its children may not be
            data = block_data(key, wl.gen, w.name, self.next_nonce())
            g = Gen(_digest(data), len(data), str(wl.location).split("/", 1)[0], w.name, begin_s)
            self.ledger.wrote(key, wl.gen, g)  # before the bytes leave: a read of them can come at once
            try:
                stored = w.client.write_bytes(wl, data)
            except BaseException:
                w.client.abort(wl)
                raise
            if stored is not None:
                w.client.abort(wl)
                self.count(f"put_write_refused_{stored.reason}")
                break
            try:
                out = w.client.commit(wl)
            except BaseException:
                with self.ledger.lock:
                    self.ledger.uncertain += 1
                raise
            if isinstance(out, Refused):
                self.count(f"put_commit_refused_{out.reason}")
                break
            self.ledger.commit_acked(key, wl.gen, g)
            self.count("put_committed")

    def op_read(self, w: Worker, rng: random.Random) -> None:
        n, c = rng.randrange(NAMESPACES), rng.randrange(self.chain_count)
        key = self.chains[n][c][rng.randrange(CHAIN_BLOCKS)]
        c_ = w.client
        held = c_.lease_of(key)
        lease = c_.renew(held) if held is not None else c_.acquire(self.namespaces[n], key)
        if isinstance(lease, Refused):
            self.count(f"read_{'renew' if held is not None else 'acquire'}_refused_{lease.reason}")
            return
        for _ in range(2):
            data = c_.read(lease)
            if isinstance(data, Refused):
                self.count(f"read_refused_{data.reason}")
                return
            self.count("read_ok" if self.check_read(key, lease.gen, data, f"{w.name} read") else "read_wrong")
            if rng.random() < 0.7:
                break
            lease = c_.renew(lease)
            if isinstance(lease, Refused):
                self.count(f"read_renew_refused_{lease.reason}")
                return
            self.count("read_renewed")
        if rng.random() < 0.8:
            c_.release(lease)  # else kept: revoked by an invalidation, or expired

    def op_lookup(self, w: Worker, rng: random.Random) -> None:
        n, c = rng.randrange(NAMESPACES), rng.randrange(self.chain_count)
        hit = w.client.lookup(self.namespaces[n], self.chains[n][c])
        assert 0 <= hit.blocks <= CHAIN_BLOCKS and len(hit.locations) == hit.blocks, hit
        self.count(f"lookup_{'hit' if hit.blocks else 'miss'}")

    def op_invalidate(self, w: Worker, rng: random.Random) -> None:
        n, c, i = rng.randrange(NAMESPACES), rng.randrange(self.chain_count), rng.randrange(CHAIN_BLOCKS)
        scope = rng.choices((SCOPE_KEY, SCOPE_PREFIX, SCOPE_NAMESPACE), (9, 9, 1))[0]
        key = None if scope == SCOPE_NAMESPACE else self.chains[n][c][i]
        at = len(self.ledger.invalidations)
        with self.ledger.lock:  # unanswered until it is: it may have happened
            self.ledger.invalidations.append(Invalidation(n, scope, c, i, math.inf))
        ticket = w.client.invalidate(self.namespaces[n], scope, key)
        with self.ledger.lock:
            self.ledger.invalidations[at] = Invalidation(n, scope, c, i, time.monotonic())
        done = w.client.wait(ticket, TICKET_WAIT_S)
        self.count(f"invalidate_{scope}_{'completed' if done else 'pending'}")

    def work(self, w: Worker) -> None:
        rng = random.Random(f"{self.seed}/{w.name}")
        while not self.stop.is_set():
            op = rng.choices(OPS, OP_WEIGHTS)[0]
            with w.lock:
                start = time.perf_counter()
                try:
                    getattr(self, f"op_{op}")(w, rng)
                except (KvccError, concurrent.futures.TimeoutError) as e:
                    self.count(f"{op}_failed_{type(e).__name__}")
                except Exception as e:  # a client library's own bug, or the soak's
                    self.count(f"{op}_error")
                    self.problem(f"{w.name} {op}: {type(e).__name__}: {e}"[:300])
                self.latency_s[op].append(time.perf_counter() - start)
            time.sleep(rng.uniform(*THINK_S))

    # ------------------------------------------------------------------ faults

    def fault_loop(self, helper: Any, kinds: list[str]) -> None:
        """Faults until ``stop``; then ``faults_done``, and the thread lives on until ``finished``:
        an etcd member it restarted runs under ``setpriv --pdeathsig`` (``procs.spawn``), which
        kills it when the *thread* that started it exits."""
        try:
            self._faults(helper, kinds)
        finally:
            self.faults_done.set()
            self.finished.wait()

    def _faults(self, helper: Any, kinds: list[str]) -> None:
        rng = random.Random(f"{self.seed}/faults")
        while not self.stop.wait(rng.uniform(*FAULT_INTERVAL_S)):
            capped = self.faults["restart_directory"] + self.faults["restart_etcd"] >= MAX_DIRECTORY_RESTARTS
            kind = rng.choice([k for k in kinds if not (capped and k in ("restart_directory", "restart_etcd"))])
            node = rng.choice(self.cluster.node_ids)
            try:
                getattr(self, f"fault_{kind}")(node, rng, helper)
            except (ClusterError, KvccError, OSError) as e:
                self.problem(f"fault {kind} of {node}: {type(e).__name__}: {e}"[:300])
            self.faults[kind] += 1

    def fault_kill_node(self, node: str, rng: random.Random, helper: Any) -> None:
        """kill -9 of ``node`` and its co-located clients (their operations held off), restart."""
        home = sorted((w for w in self.workers if w.home == node), key=lambda w: w.name)
        with contextlib.ExitStack() as held:
            for w in home:
                held.enter_context(w.lock)
            for w in home:  # down first: a Revoke it took after the node's crash would be a dead node's step
                w.client.crash()
            outage = self.ledger.kill(node)
            self.cluster.kill(node)
            self.cluster.restart(node)  # ready once its Hello was answered
            self.ledger.back(outage)
            for w in home:
                w.client.rejoin()
                with contextlib.suppress(KvccError, concurrent.futures.TimeoutError):
                    w.client.refresh_nodes()

    def fault_pause_node(self, node: str, rng: random.Random, helper: Any) -> None:
        self.cluster.pause(node)
        try:
            time.sleep(rng.uniform(*PAUSE_S))
        finally:
            self.cluster.resume(node)

    def fault_restart_directory(self, node: str, rng: random.Random, helper: Any) -> None:
        with self.quiesced():
            self.cluster.restart_directory()
            self.wait_registered(helper)

    def fault_restart_etcd(self, node: str, rng: random.Random, helper: Any) -> None:
        with self.quiesced():
            self.etcd.kill(0)
            time.sleep(rng.uniform(*PAUSE_S))
            self.etcd.restart(0)
            self.wait_registered(helper)

    @contextlib.contextmanager
    def quiesced(self) -> Any:
        """With ``quiesce_directory``: every worker's operations held off (none in flight) while
        the directory's log goes away and comes back."""
        with contextlib.ExitStack() as held:
            if self.quiesce_directory:
                for w in sorted(self.workers, key=lambda w: w.name):
                    held.enter_context(w.lock)
            yield

    def wait_registered(self, helper: Any) -> bool:
        """Until every node has said Hello to the (restarted) directory: a node that crashed
        before it registered again would never be declared down there (README, Known limits)."""
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(KvccError, concurrent.futures.TimeoutError):
                if set(helper.refresh_nodes()) >= set(self.cluster.node_ids):
                    return True
            time.sleep(0.05)
        self.problem(f"the nodes did not all register with the directory within {REGISTER_TIMEOUT_S} s")
        return False

    # ------------------------------------------------------------------ the end check

    def final_check(self, checker: Any) -> dict[str, Any]:
        """Judge every key with an acknowledged commit (module docstring: what "lost" means)."""
        classes: Counter[str] = Counter()
        details: dict[str, list[str]] = {"lost_committed": [], "lost_to_crash": []}
        for key, (gen, g) in sorted(self.ledger.acked.items(), key=lambda kv: kv[1][1].begin_s):
            info = self.ledger.keys[key]
            what, seen = self._final_read(checker, key)
            if what == "read":
                read_gen, data = seen
                if not self.check_read(key, read_gen, data, "end check"):
                    classes["wrong"] += 1
                    continue
                if read_gen >= gen:
                    classes["intact"] += 1
                    continue
                cls, why = "lost_committed", f"reads as generation {read_gen}, older than acknowledged {gen}"
            else:
                ancestors = self.chains[info.ns][info.chain][: info.index + 1]
                nodes = set().union(*(self.ledger.nodes_of(k) for k in ancestors))
                if self.ledger.invalidated_since(info, g.begin_s):
                    cls, why = "invalidated", ""
                elif self.ledger.killed_since(nodes, g.begin_s):
                    cls, why = "lost_to_crash", f"a node of {sorted(nodes)} was killed after its write began"
                else:
                    cls, why = "lost_committed", f"unreadable ({seen}), not invalidated, no crash of {sorted(nodes)}"
            classes[cls] += 1
            if cls in details and len(details[cls]) < DETAILS_MAX:
                details[cls].append(f"{key.hex[:16]} (ns {info.ns} chain {info.chain} block {info.index}) "
                                    f"generation {gen} by {g.writer} on {g.node}: {why}")  # fmt: skip
        return {"keys": len(self.ledger.acked), "classes": dict(classes), "details": details}

    def _final_read(self, checker: Any, key: BlockKey) -> tuple[str, Any]:
        """("read", (generation, bytes)) or ("unreadable", the last refusal)."""
        ns = self.namespaces[self.ledger.keys[key].ns]
        last = ""
        for _ in range(FINAL_ATTEMPTS):
            try:
                lease = checker.acquire(ns, key)
                if isinstance(lease, Refused):
                    last = lease.reason
                    if lease.reason in ("not_committed", "location_down"):
                        return "unreadable", last
                else:
                    data = checker.read(lease)
                    with contextlib.suppress(KvccError):
                        checker.release(lease)
                    if not isinstance(data, Refused):
                        return "read", (lease.gen, data)
                    last = data.reason
                    if data.reason == "miss":
                        return "unreadable", last
            except (KvccError, concurrent.futures.TimeoutError) as e:
                last = type(e).__name__
            time.sleep(FINAL_RETRY_S)
        return "unreadable", last


def _percentiles(samples: list[float]) -> dict[str, Any]:
    if not samples:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"n": len(samples), "p50_ms": round(percentile(samples, 50) * 1000, 2),
            "p99_ms": round(percentile(samples, 99) * 1000, 2), "max_ms": round(max(samples) * 1000, 2)}  # fmt: skip


# ------------------------------------------------------------------------------- the soak


def soak(
    workdir: Path,
    seconds: float,
    *,
    clients: int = DEFAULT_CLIENTS,
    faults: bool = False,
    seed: int = DEFAULT_SEED,
    backend: str = "sqlite",
    on_step: Callable[[str], None] | None = None,
    before_check: Callable[[Run], None] | None = None,
    validate_timeout_s: float = DEFAULT_VALIDATE_TIMEOUT_S,
    quiesce_directory: bool = False,
) -> dict[str, Any]:
    """Run the soak in ``workdir`` (module docstring) and return its report; every process it
    started is stopped however it ends. ``before_check(run)`` is called once the run settled,
    before the end check (tests use it to corrupt the bookkeeping and see the check fail)."""
    if not 0 < seconds <= MAX_SECONDS:
        raise SoakError(f"a soak runs 1 s .. {MAX_SECONDS} s, not {seconds}")
    if not 1 <= clients <= MAX_CLIENTS:
        raise SoakError(f"1 .. {MAX_CLIENTS} clients, not {clients}")
    if backend not in ("sqlite", "etcd"):
        raise SoakError(f"backend is sqlite or etcd, not {backend!r}")
    step = on_step or (lambda text: None)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    finished = threading.Event()
    with contextlib.ExitStack() as stack:
        stack.callback(finished.set)  # the first in, so the last out: once the cluster and etcd stopped
        etcd = None
        if backend == "etcd":
            from kvcc.reference.etcd_harness import EtcdCluster

            step("starting a one-member etcd")
            etcd = stack.enter_context(EtcdCluster(members=1, data_dir=workdir / "etcd"))
        namespaces = [Namespace("kvcc-soak", "rev1", "bfloat16", BLOCK_TOKENS, cache_salt=b"ns%d" % i)
                      for i in range(NAMESPACES)]  # fmt: skip
        scale = key_space_scale(seconds)
        cluster = LocalCluster(workdir / "cluster", nodes=NODES, tiers=(f"dram={TIER_MIB * scale}MiB",), block_bytes=BLOCK_BYTES,
                               lease_term_ms=LEASE_TERM_MS, skew_ms=SKEW_MS, namespaces=namespaces, backend=backend,
                               etcd_endpoints=",".join(etcd.endpoints) if etcd else None)  # fmt: skip
        step(f"starting a directory ({backend}) and {NODES} nodes on loopback")
        stack.enter_context(cluster)
        run = Run(cluster, namespaces, seed, etcd, chains=CHAINS * scale)
        run.quiesce_directory = quiesce_directory
        run.finished = finished
        if etcd is not None and faults:
            run.notes.append("etcd: its one member is killed -9 and restarted on its data (restart_etcd); a "
                             "multi-member failover is not exercised here (tests/test_faults.py does)")
        for i in range(clients):
            home = cluster.node_ids[i % NODES]
            name = f"{home}.c{i}"
            run.workers.append(Worker(name, home, cluster.client(name, timeout_ms=REQUEST_TIMEOUT_MS)))
        helper = cluster.client("soak-faults", events=False, timeout_ms=REQUEST_TIMEOUT_MS)
        timings["start_s"] = time.perf_counter() - t0

        kinds = ["kill_node", "pause_node", "restart_directory"] + (["restart_etcd"] if etcd else [])
        step(f"running {clients} clients for {seconds} s{' with faults (' + ', '.join(kinds) + ')' if faults else ''}"
             f", seed {seed}")  # fmt: skip
        t1 = time.perf_counter()
        for w in run.workers:
            w.thread = threading.Thread(target=_guarded, args=(run, w.name, run.work, w), name=f"soak-{w.name}",
                                        daemon=True)  # fmt: skip
            w.thread.start()
        fault_thread = None
        if faults:
            fault_thread = threading.Thread(target=_guarded, args=(run, "faults", run.fault_loop, helper, kinds),
                                            name="soak-faults", daemon=True)  # fmt: skip
            fault_thread.start()
        run.stop.wait(seconds)
        run.stop.set()
        if fault_thread is not None and not run.faults_done.wait(JOIN_TIMEOUT_S):
            run.problem(f"the fault thread did not stop within {JOIN_TIMEOUT_S} s")
        for t in [w.thread for w in run.workers]:
            assert t is not None
            t.join(JOIN_TIMEOUT_S)
            if t.is_alive():
                run.problem(f"thread {t.name} did not stop within {JOIN_TIMEOUT_S} s")
        timings["run_s"] = time.perf_counter() - t1

        step("faults off: every process up, settling")
        t2 = time.perf_counter()
        for name, proc in cluster.procs.items():
            if proc.paused:
                cluster.resume(name)
            if not cluster.alive(name):
                run.problem(f"{name} was not running at the end of the run")
        run.wait_registered(helper)
        time.sleep(SETTLE_S)
        timings["settle_s"] = time.perf_counter() - t2
        if before_check is not None:
            before_check(run)

        step(f"checking {len(run.ledger.acked)} keys with acknowledged commits")
        t3 = time.perf_counter()
        checker = cluster.client(f"{cluster.node_ids[0]}.check", timeout_ms=REQUEST_TIMEOUT_MS)
        end = run.final_check(checker)
        timings["check_s"] = time.perf_counter() - t3
        for name in cluster.procs:
            if not cluster.alive(name):
                run.problem(f"{name} was not running at the end check")
    # Every process stopped: the logs are whole.
    from kvcc.bench.fuzz import tracebacks

    for name, n in tracebacks(types.SimpleNamespace(cluster=cluster)).items():
        if n:
            run.problem(f"{name}'s log holds {n} traceback(s)")
    step("validating the merged trace")
    t4 = time.perf_counter()
    trace = validate(cluster, validate_timeout_s)
    timings["validate_s"] = time.perf_counter() - t4
    if trace["status"] in ("REJECTED", "ERROR"):
        run.problem(f"the trace was REJECTED: {trace.get('code')}: {trace.get('reason')}"[:400])
    timings["total_s"] = time.perf_counter() - t0
    return report(run, end, trace, timings, seconds=seconds, clients=clients, fault_injection=faults, backend=backend,
                  quiesce_directory=quiesce_directory)


def _guarded(run: Run, name: str, fn: Callable[..., None], *args: Any) -> None:
    try:
        fn(*args)
    except BaseException as e:  # the thread's death is a finding, not a silent stop
        run.problem(f"thread {name} died: {type(e).__name__}: {e}"[:300])
        run.stop.set()


def validate(cluster: LocalCluster, timeout_s: float) -> dict[str, Any]:
    """The trace validator's verdict on the run's merged trace, written first to
    ``<workdir>/trace.ndjson`` (in the order replayed). The validator runs in a child process,
    stopped after ``timeout_s``: its cost grows with the crashes and restarts every key's
    projection shares, and past the limit the verdict is INCONCLUSIVE (``time_limit``)."""
    path = cluster.workdir / "trace.ndjson"
    count = write_merged_trace(cluster.workdir / "events", path)
    locations = {f"{n}/dram": n for n in cluster.node_ids}
    out: dict[str, Any] = {"events": count, "trace": str(path)}
    try:
        done = subprocess.run([sys.executable, "-c", _VALIDATE, str(path), str(LEASE_TERM_MS), str(SKEW_MS),
                               json.dumps(locations)], capture_output=True, text=True, timeout=timeout_s)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {**out, "status": "INCONCLUSIVE", "code": "time_limit",
                "reason": f"the validator did not decide within {timeout_s:g} s"}  # fmt: skip
    if done.returncode != 0:
        return {**out, "status": "ERROR", "code": "validator_failed", "reason": done.stderr[-2000:]}
    v = json.loads(done.stdout)
    out.update(status=v["status"], frontier_max=v["frontier_max"])
    if v["status"] != "ACCEPTED":
        out.update(code=v["code"], reason=v["reason"], event_index=v["event_index"], event=v["event"])
    return out


def write_merged_trace(events_dir: Path, path: Path) -> int:
    """Merge every log of ``events_dir`` into ``path`` in the order ``LocalCluster.events()``
    gives (by wall time, each log in its own order), streaming: an hour's soak logs millions of
    events, which ``events()`` would hold in memory as dicts. Returns the number of events."""

    def lines(log: Path) -> Any:
        with open(log, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    e = json.loads(line)
                    yield (e["t_wall_ns"], e["node"], e["seq"]), line if line.endswith("\n") else line + "\n"

    count = 0
    with open(path, "w", encoding="utf-8") as out:
        for _, line in heapq.merge(*(lines(log) for log in sorted(events_dir.glob("*.ndjson")))):
            out.write(line)
            count += 1
    return count


_VALIDATE = """
import json, sys
from kvcc.conformance.validate import TraceParams, validate_file
params = TraceParams(int(sys.argv[2]), int(sys.argv[3]), locations=json.loads(sys.argv[4]))
print(json.dumps(validate_file(sys.argv[1], params).to_json(), default=str))
"""


def report(run: Run, end: dict[str, Any], trace: dict[str, Any], timings: dict[str, float], **config: Any) -> dict:
    classes = end["classes"]
    ops_total = sum(len(v) for v in run.latency_s.values())
    out = {
        **config, "seed": run.seed, "key_space": len(run.ledger.keys),
        "ops": ops_total, "ops_per_s": round(ops_total / timings["run_s"], 1) if timings.get("run_s") else None,
        "op_outcomes": dict(sorted(run.ops.items())),
        "faults": sum(run.faults.values()), "faults_by_kind": dict(run.faults),
        "commits_acked": run.ops["put_committed"],
        "commits_uncertain": run.ledger.uncertain,
        "reads_verified": run.reads_verified,
        "keys_checked": end["keys"],
        "intact": classes.get("intact", 0), "invalidated": classes.get("invalidated", 0),
        "lost_to_crash": classes.get("lost_to_crash", 0), "lost_committed": classes.get("lost_committed", 0),
        "lost_committed_cases": end["details"]["lost_committed"], "lost_to_crash_cases": end["details"]["lost_to_crash"],
        "wrong_bytes": len(run.wrong_bytes), "wrong_bytes_cases": run.wrong_bytes[:DETAILS_MAX],
        "gen_reused": run.ledger.gen_reused,
        "violations": len(run.problems), "problems": run.problems,
        "trace": trace,
        "latency": {op: _percentiles(v) for op, v in run.latency_s.items()},
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "notes": run.notes,
    }  # fmt: skip
    out["ok"] = (out["lost_committed"] == 0 and out["wrong_bytes"] == 0 and out["violations"] == 0
                 and trace["status"] != "REJECTED")  # fmt: skip
    return out


def run_soak(seconds: float, **kwargs: Any) -> dict[str, Any]:
    """The soak in a temporary folder (removed after)."""
    with tempfile.TemporaryDirectory(prefix="kvcc-bench-soak-") as tmp:
        return soak(Path(tmp), seconds, **kwargs)


# ------------------------------------------------------------------------------- output


def render(console: Any, r: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"soak: {r['seconds']} s, {r['clients']} clients, faults {'on' if r['fault_injection'] else 'off'}, "
                    f"{r['backend']}, seed {r['seed']}")  # fmt: skip
    t.add_column("figure")
    t.add_column("value", justify="right")
    for name in ("ops", "ops_per_s", "faults", "commits_acked", "commits_uncertain", "reads_verified", "keys_checked",
                 "intact", "invalidated", "lost_to_crash", "lost_committed", "wrong_bytes", "violations"):
        t.add_row(name, str(r[name]))
    tr = r["trace"]
    t.add_row("trace", f"{tr['status']} ({tr['events']} events)")
    console.print(t)
    console.print(f"faults: {r['faults_by_kind']}")
    console.print("latency: " + ", ".join(f"{op} p50 {v['p50_ms']} ms p99 {v['p99_ms']} ms"
                                         for op, v in r["latency"].items() if v["n"]))  # fmt: skip
    console.print(f"timings (s): {r['timings_s']}")
    for p in r["problems"] + r["lost_committed_cases"] + r["wrong_bytes_cases"]:
        console.print(f"[bold red]{p}[/]")
    if tr["status"] != "ACCEPTED":
        console.print(f"trace {tr['status']}: {tr.get('code')}: {tr.get('reason')}")
    console.print("[bold green]every figure held[/]" if r["ok"] else "[bold red]a figure broke[/]")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=int, default=0, metavar="N", help="how long to run, in minutes")
    parser.add_argument("--seconds", type=int, default=0, metavar="N",
                        help=f"how long to run, in seconds (added to --minutes; default {DEFAULT_SECONDS} s in all, "
                             f"at most {MAX_SECONDS // 60} minutes)")  # fmt: skip
    parser.add_argument("--clients", type=int, default=DEFAULT_CLIENTS, metavar="M",
                        help=f"client threads, each co-located with a node (default {DEFAULT_CLIENTS}, "
                             f"at most {MAX_CLIENTS})")  # fmt: skip
    parser.add_argument("--faults", action="store_true",
                        help="inject node kill -9 and restart, SIGSTOP/SIGCONT and directory kill -9 and restart")
    parser.add_argument("--quiesce-directory-restarts", action="store_true",
                        help="hold every client's operations while the directory (or etcd) is killed and restarted: "
                             "no request in flight when it dies")  # fmt: skip
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"seed of the workload (default {DEFAULT_SEED})")
    parser.add_argument("--backend", choices=("sqlite", "etcd"), default="sqlite",
                        help="the directory's log (etcd: a one-member etcd, killed and restarted with --faults)")
    parser.add_argument("--validate-timeout", type=int, default=int(DEFAULT_VALIDATE_TIMEOUT_S), metavar="S",
                        help=f"stop the trace validator after S seconds: INCONCLUSIVE, time_limit (default "
                             f"{int(DEFAULT_VALIDATE_TIMEOUT_S)})")  # fmt: skip
    parser.add_argument("--workdir", metavar="DIR",
                        help="keep the run's files here (events, merged trace, process logs); default: a temporary "
                             "folder, removed")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")


def cli(args: argparse.Namespace) -> int:
    from kvcc.console import print_json, stderr_console, stdout_console

    seconds = args.minutes * 60 + args.seconds or DEFAULT_SECONDS
    if args.minutes < 0 or args.seconds < 0 or seconds > MAX_SECONDS:
        print(f"kvcc bench soak: error: the run must be 1 s .. {MAX_SECONDS // 60} minutes", file=sys.stderr)
        return 2
    if not 1 <= args.clients <= MAX_CLIENTS:
        print(f"kvcc bench soak: error: --clients must be 1 .. {MAX_CLIENTS}", file=sys.stderr)
        return 2
    if args.validate_timeout < 1:
        print("kvcc bench soak: error: --validate-timeout must be at least 1", file=sys.stderr)
        return 2
    err = stderr_console()
    step = None if args.json else (lambda text: err.print(f"[dim]{text}[/]"))
    try:
        kwargs = dict(clients=args.clients, faults=args.faults, seed=args.seed, backend=args.backend, on_step=step,
                      validate_timeout_s=args.validate_timeout,
                      quiesce_directory=args.quiesce_directory_restarts)  # fmt: skip
        if args.workdir:
            workdir = Path(args.workdir)
            workdir.mkdir(parents=True, exist_ok=True)
            r = soak(workdir, seconds, **kwargs)
        else:
            r = run_soak(seconds, **kwargs)
    except (SoakError, ClusterError, KvccError, OSError) as exc:
        print(f"kvcc bench soak: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print_json(r)
    else:
        render(stdout_console(), r)
    return 0 if r["ok"] else 1
