"""Micro-benchmark of the directory's durable stores (``python -m kvcc.bench.directory_store``).

``bench_store(store, n)``: commits per second of ``n`` effect batches a real ``DirectoryCore``
produced -- a ``BeginWrite`` and a ``Commit`` of fresh keys, alternately, so one ``Persist`` per
batch and a ``ReserveLeaseIds`` every ``lease_id_block`` grants -- timing ``store.commit`` only.
``bench_acquire_release(store, n)``: acquire + release pairs per second through the core with
the store in the loop as a server runs it (``commit`` of each call's effects, ``mirror_leases``
before each grant leaves): what the directory's read path costs in the store.
``bench_raw_put(endpoints, n)``: plain etcd puts per second from one client, the baseline both
are compared with in the same run (the directory bench target: acquire+release pairs >= 0.5 of
it). ``main`` runs all three on SQLite (in a temporary directory) and on a one-member etcd
started on loopback, and prints the ratios. A benchmark reports; it does not assert a target.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from kvcc.reference import wire
from kvcc.reference.directory import DirectoryConfig, DirectoryCore, Effect
from kvcc.spec.keys import BlockKey, Namespace

DEFAULT_COMMITS = 2000
BENCH_TERM_MS = 10_000
BENCH_SKEW_MS = 500
_TENANT = "bench"


def _core() -> DirectoryCore:
    cfg = DirectoryConfig(lease_term_ms=BENCH_TERM_MS, skew_ms=BENCH_SKEW_MS, pool_location="pool")
    return DirectoryCore(cfg, lambda tenant, namespace: True)


def commit_batches(n: int) -> list[list[Effect]]:
    """The effects of ``n`` core calls writing fresh keys (``BeginWrite``, ``Commit``, ...)."""
    assert n >= 1
    core = _core()
    ns = Namespace(f"bench-{uuid.uuid4().hex[:8]}", "rev1", "bfloat16", 1)
    out: list[list[Effect]] = []
    i = 0
    while len(out) < n:
        key = BlockKey.chain(ns, None, [i])
        grant, effects = core.handle(wire.BeginWrite("w", key, ns.digest(), None, i + 1), 0, _TENANT)
        assert isinstance(grant, wire.WriteLeaseGranted), grant
        out.append(effects)
        reply, effects = core.handle(wire.Commit("w", key, grant.lease, grant.gen, grant.epoch), 0, _TENANT)
        assert isinstance(reply, wire.Committed), reply
        out.append(effects)
        i += 1
    return out[:n]


def bench_store(store: Any, n: int = DEFAULT_COMMITS) -> float:
    """Commits per second of ``n`` one-record batches on ``store`` (a ``DirectoryStore`` or an
    ``EtcdDirectoryStore`` that owns its log). The batches are built before the clock starts."""
    batches = commit_batches(n)
    t = time.perf_counter()
    for effects in batches:
        store.commit(effects)
    return n / (time.perf_counter() - t)


def bench_acquire_release(store: Any, n: int = DEFAULT_COMMITS) -> float:
    """Acquire + release pairs per second through a core, with ``store`` in the loop."""
    core = _core()
    ns = Namespace(f"bench-{uuid.uuid4().hex[:8]}", "rev1", "bfloat16", 1)
    key = BlockKey.chain(ns, None, [0])
    grant, effects = core.handle(wire.BeginWrite("w", key, ns.digest(), None, 1), 0, _TENANT)
    store.commit(effects)
    store.commit(core.handle(wire.Commit("w", key, grant.lease, grant.gen, grant.epoch), 0, _TENANT)[1])
    view_ms = core.config.directory_view_ms
    t0 = time.monotonic()
    t = time.perf_counter()
    for i in range(n):
        now_ms = int((time.monotonic() - t0) * 1000)
        lease, effects = core.handle(wire.Acquire("r", key, ns.digest(), 2 * i + 2), now_ms, _TENANT)
        assert isinstance(lease, wire.ReadLeaseGranted), lease
        store.commit(effects)
        store.mirror_leases(view_ms)
        _, effects = core.handle(wire.Release("r", key, lease.lease), now_ms, _TENANT)
        store.commit(effects)
    return n / (time.perf_counter() - t)


def bench_raw_put(endpoints: list[str], n: int = DEFAULT_COMMITS) -> float:
    """Plain puts per second of a record-sized value from one etcd client (the baseline)."""
    from kvcc.reference.etcd_client import EtcdKV

    prefix = f"bench-raw-{uuid.uuid4().hex[:8]}/"
    value = b"v" * 200  # about a record row in canonical CBOR
    with EtcdKV(endpoints) as kv:
        t = time.perf_counter()
        for i in range(n):
            kv.put(f"{prefix}{i % 256}", value)
        rate = n / (time.perf_counter() - t)
        kv.delete(prefix, prefix=True)
    return rate


def main(argv: list[str] | None = None) -> int:
    from kvcc.reference.directory import DirectoryStore, EtcdDirectoryStore
    from kvcc.reference.etcd_harness import EtcdCluster, EtcdNotInstalled

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=DEFAULT_COMMITS, help="commits (and pairs) per measurement")
    args = ap.parse_args(argv)
    rows: list[tuple[str, float, str]] = []
    with tempfile.TemporaryDirectory(prefix="kvcc-bench-") as tmp:
        with DirectoryStore(Path(tmp) / "directory.sqlite") as store:
            store.load()
            rows.append(("sqlite commit", bench_store(store, args.n), "commits/s"))
            rows.append(("sqlite acquire+release", bench_acquire_release(store, args.n), "pairs/s"))
    try:
        with EtcdCluster(members=1) as cluster:
            raw = bench_raw_put(cluster.endpoints, args.n)
            rows.append(("etcd raw put (baseline)", raw, "puts/s"))
            grace_ms = DirectoryConfig(lease_term_ms=BENCH_TERM_MS, skew_ms=BENCH_SKEW_MS).restart_grace_ms
            with EtcdDirectoryStore(cluster.endpoints, "bench", restart_grace_ms=grace_ms) as store:
                store.load()
                commit = bench_store(store, args.n)
                pairs = bench_acquire_release(store, args.n)
            rows.append(("etcd commit", commit, f"commits/s ({commit / raw:.2f} x raw put)"))
            rows.append(("etcd acquire+release", pairs, f"pairs/s ({pairs / raw:.2f} x raw put; target >= 0.5)"))
    except EtcdNotInstalled as e:
        print(f"etcd skipped: {e}", file=sys.stderr)
    width = max(len(name) for name, _, _ in rows)
    for name, rate, unit in rows:
        print(f"{name:<{width}}  {rate:>12,.0f} {unit}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
