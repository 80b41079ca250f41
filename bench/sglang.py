"""Benchmark: kvcc's SGLang HiCache storage backend beside SGLang's own ``HiCacheFile``, on the same
pages in the same run (``kvcc bench sglang``).

What runs, exactly:

- kvcc: ``KvccHiCacheStorage`` built by SGLang's own ``StorageBackendFactory`` (the ``dynamic``
  backend, as ``--hicache-storage-backend dynamic`` loads it), one per page size (the page size is
  part of the kvcc namespace), against a real ``LocalCluster`` that this benchmark starts and stops:
  a directory (SQLite) and one cache node as processes on 127.0.0.1, the node's one tier ``dram``
  (or ``nvme`` with ``--tier nvme``) with slots of the largest page size, sized so nothing is
  evicted.
- SGLang: ``HiCacheFile`` built by the same factory (``file``) over a fresh temporary directory
  (under ``--dir``, default the system temp dir), metadata cache off (SGLang's default), no
  eviction cap. It writes each page with ``tofile`` to a temp file and a rename (no fsync), and
  reads with one ``readinto``: buffered I/O through the page cache. Reads fetch the pages written
  in the same trial, so the page cache is warm (nothing here can drop it).

The calls are the non-v1 ones, with CPU tensors as SGLang's controller passes them when
``interface_v1`` is off: ``batch_set(keys, values)`` with one flat ``float16`` CPU tensor per page,
``batch_get(keys, target_locations)`` into preallocated flat ``float16`` CPU tensors (both backends
copy into the target), ``batch_exists(keys)`` (the number of consecutive present pages from the
start). Keys are SGLang-shaped (64 hex digits), fresh for every trial and backend: kvcc refuses an
overwrite (and counts an already-committed page as stored), ``HiCacheFile`` skips an existing file,
so a rewritten key would measure neither.

Figures (each the median of ``--trials`` interleaved trials: kvcc, file, kvcc, file, ... after one
untimed warm-up trial):

- ``batch_set`` / ``batch_get`` bandwidth, bytes per second: one call of ``--pages`` pages per
  trial and backend; every ``batch_set`` must answer True and every ``batch_get`` must return every
  page with exactly the bytes written (checked after the timed call).
- ``batch_exists`` latency per call of ``--exists-keys`` keys (pages of the smallest size), p50 and
  p99 of ``--exists-calls`` calls per trial: all keys present, and half present (the first half
  present, the rest never written: a prefix hit, as ``HiCacheController`` meets it). Each timed
  call is a prefetch's decision, and each is followed by the untimed read of what it counted, as
  the prefetch reads it (``batch_get``): kvcc leases every key of the call in one round trip (one
  ``Acquire`` per page) and keeps the leases for that read, which releases them, so every timed
  call takes its leases anew; ``HiCacheFile`` stats one file per key and stops at the first miss.

Ratios are kvcc / ``HiCacheFile``: above 1 kvcc has more bandwidth, or (for latency) takes longer.
A benchmark reports; it does not fail on a slow figure. The exit code is 1 only when measuring
fails (an exception, a refused write, a miss or wrong bytes).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

KIB, MIB = 1 << 10, 1 << 20
PAGE_KIB = (64, 256, 1024)
DEFAULT_PAGES = 64
DEFAULT_TRIALS = 3
DEFAULT_EXISTS_KEYS = 64
DEFAULT_EXISTS_CALLS = 100
TIERS = ("dram", "nvme")
MODEL = "kvcc/bench-sglang"
REVISION = "bench"
BYTES_PER_TOKEN = 4 * KIB  # the page-size-in-tokens of the namespace: page bytes / this (at least 1)
DTYPE_NAME = "float16"
LAYOUT = "layer_first"
SETUP_HINT = "bash scripts/setup.sh --with sglang"


class BenchError(Exception):
    pass


def _config(extra: dict) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                model_name=MODEL, extra_config=extra)  # fmt: skip


def _tokens(page_bytes: int) -> int:
    return max(1, page_bytes // BYTES_PER_TOKEN)


def _namespace(page_bytes: int) -> Any:
    from kvcc.adapters.sglang.backend import storage_namespace

    return storage_namespace(_config({}), page_size=_tokens(page_bytes), kv_dtype=DTYPE_NAME, kv_layout=LAYOUT,
                             model_id=MODEL, model_revision=REVISION)  # fmt: skip


def _keys(nonce: str, *parts: object, n: int) -> list[str]:
    """``n`` SGLang-shaped page keys (64 hex digits), distinct for every ``parts``."""
    return [hashlib.sha256(repr((nonce, *parts, i)).encode()).hexdigest() for i in range(n)]


def _pages(page_bytes: int, n: int) -> list[Any]:
    """``n`` flat float16 CPU pages of random bit patterns (compared as bytes)."""
    import torch

    return [torch.frombuffer(bytearray(os.urandom(page_bytes)), dtype=torch.uint8).view(torch.float16)
            for _ in range(n)]  # fmt: skip


def _same(a: Any, b: Any) -> bool:
    import torch

    return torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _filesystem(path: Path) -> str:
    from kvcc.bench.tiers import _filesystem as fs

    return fs(path)


# ------------------------------------------------------------------------------------ bandwidth


def _bench_bandwidth(name_backend: dict[str, Any], page_bytes: int, pages: int, trials: int,
                     nonce: str) -> dict[str, dict[str, float]]:  # fmt: skip
    """Median bytes/s of ``batch_set`` and ``batch_get`` per backend, interleaved trials."""
    values = _pages(page_bytes, pages)
    targets = _pages(page_bytes, pages)
    times: dict[tuple[str, str], list[float]] = {(n, op): [] for n in name_backend for op in ("set", "get")}
    for trial in range(-1, trials):  # trial -1: the untimed warm-up
        keys = {n: _keys(nonce, "bw", page_bytes, trial, n, n=pages) for n in name_backend}
        for name, b in name_backend.items():
            dt, ok = _timed(lambda: b.batch_set(keys[name], values))
            if ok is not True:
                raise BenchError(f"{name}: batch_set of {pages} fresh pages of {page_bytes} bytes answered {ok!r}")
            if trial >= 0:
                times[(name, "set")].append(dt)
        for name, b in name_backend.items():
            for t in targets:
                t.zero_()
            dt, got = _timed(lambda: b.batch_get(keys[name], targets))
            if len(got) != pages or any(g is None for g in got):
                raise BenchError(f"{name}: batch_get of stored pages missed {sum(g is None for g in got)} of {pages}")
            if not all(_same(t, v) for t, v in zip(targets, values)):
                raise BenchError(f"{name}: batch_get returned other bytes than were written")
            if trial >= 0:
                times[(name, "get")].append(dt)
    nbytes = pages * page_bytes
    return {name: {op: nbytes / statistics.median(times[(name, op)]) for op in ("set", "get")}
            for name in name_backend}  # fmt: skip


# ------------------------------------------------------------------------------------ exists


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _bench_exists(name_backend: dict[str, Any], page_bytes: int, nkeys: int, calls: int, trials: int,
                  nonce: str) -> dict[str, dict[str, dict[str, float]]]:  # fmt: skip
    """Per case and backend: median over trials of the p50 and p99 seconds per ``batch_exists`` call."""
    half = nkeys // 2
    values = _pages(page_bytes, nkeys)
    targets = [v.clone() for v in values]
    cases: dict[str, dict[str, tuple[list[str], int]]] = {"all present": {}, "half present": {}}
    for name, b in name_backend.items():
        present = _keys(nonce, "exists", name, n=nkeys)
        if b.batch_set(present, values) is not True:
            raise BenchError(f"{name}: batch_set of the exists pages failed")
        absent = _keys(nonce, "absent", name, n=nkeys - half)
        cases["all present"][name] = (present, nkeys)
        cases["half present"][name] = (present[:half] + absent, half)
    stats: dict[str, dict[str, dict[str, list[float]]]] = {
        c: {n: {"p50": [], "p99": []} for n in name_backend} for c in cases}
    for trial in range(-1, trials):
        for case, per in cases.items():
            for name, b in name_backend.items():
                keys, want = per[name]
                lat = []
                for _ in range(calls if trial >= 0 else min(calls, 10)):
                    dt, n = _timed(lambda: b.batch_exists(keys))
                    if n != want:
                        raise BenchError(f"{name}: batch_exists ({case}) answered {n}, expected {want}")
                    lat.append(dt)
                    # The prefetch then reads what it decided on (untimed): kvcc's leases end there.
                    if any(page is None for page in b.batch_get(keys[:n], targets[:n])):
                        raise BenchError(f"{name}: a page batch_exists counted ({case}) was a miss")
                if trial >= 0:
                    stats[case][name]["p50"].append(_quantile(lat, 0.50))
                    stats[case][name]["p99"].append(_quantile(lat, 0.99))
    return {c: {n: {q: statistics.median(v) for q, v in qs.items()} for n, qs in per.items()}
            for c, per in stats.items()}  # fmt: skip


# ------------------------------------------------------------------------------------ measure


def measure(page_kib: Sequence[int] = PAGE_KIB, pages: int = DEFAULT_PAGES, trials: int = DEFAULT_TRIALS,
            exists_keys: int = DEFAULT_EXISTS_KEYS, exists_calls: int = DEFAULT_EXISTS_CALLS, tier: str = "dram",
            directory: str | os.PathLike | None = None,
            on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Run the benchmark; return a JSON-able dict (see ``render`` for what it holds)."""
    try:
        import sglang
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    except ImportError as e:
        raise BenchError(f"SGLang is required ({SETUP_HINT}): {e}") from None
    import torch

    from kvcc.reference.cluster import LocalCluster

    if tier not in TIERS:
        raise BenchError(f"tier is one of {', '.join(TIERS)}; got {tier!r}")
    if os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"):
        raise BenchError("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR is set: HiCacheFile would use that directory, "
                         "not this benchmark's; unset it")  # fmt: skip
    progress = on_progress or (lambda what: None)
    sizes = [k * KIB for k in page_kib]
    exists_size = min(sizes)
    started = time.perf_counter()
    nonce = secrets.token_hex(8)
    parent = Path(directory) if directory is not None else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvcc-bench-sglang-", dir=parent))
    # Slots: every page written (the warm-up trial too) fits, each in a slot of the largest size.
    slots = len(sizes) * (trials + 1) * pages + exists_keys + 16
    block_bytes = max(sizes)
    namespaces = {s: _namespace(s) for s in sorted(set(sizes))}
    cluster = LocalCluster(work / "cluster", nodes=1, tiers=(f"{tier}={slots * block_bytes}",), block_bytes=block_bytes,
                           namespaces=list(namespaces.values()))  # fmt: skip
    kvcc_backends: dict[int, Any] = {}
    file_dir = work / "hicache"
    try:
        progress("starting a kvcc cluster (directory + one node)")
        cluster.start()
        host, port = cluster.directory_address
        for s in namespaces:
            extra = {"backend_name": "kvcc", "module_path": "kvcc.adapters.sglang.backend",
                     "class_name": "KvccHiCacheStorage", "kvcc_directory": f"{host}:{port}", "kvcc_tenant": "engine",
                     "kvcc_token_hex": cluster.engine_token.hex(), "kvcc_client_id": f"bench-sglang-{s}",
                     "kvcc_model_revision": REVISION, "kvcc_page_size": _tokens(s), "kvcc_kv_dtype": DTYPE_NAME,
                     "kvcc_kv_layout": LAYOUT}  # fmt: skip
            kvcc_backends[s] = StorageBackendFactory.create_backend("dynamic", _config(extra), None)
            if kvcc_backends[s].namespace != namespaces[s]:
                raise BenchError("the backend derived another namespace than the cluster allows")
        hfile = StorageBackendFactory.create_backend("file", _config({"file_storage_path": str(file_dir)}), None)
        if type(hfile) is not HiCacheFile or Path(hfile.file_path) != file_dir:
            raise BenchError(f"SGLang's factory built {type(hfile).__name__} on {getattr(hfile, 'file_path', '?')}, "
                             f"not HiCacheFile on {file_dir}")  # fmt: skip

        bandwidth: list[dict[str, Any]] = []
        for s in sizes:
            progress(f"batch_set / batch_get, {_fmt_size(s)} pages")
            r = _bench_bandwidth({"kvcc": kvcc_backends[s], "file": hfile}, s, pages, trials, nonce)
            for op in ("set", "get"):
                k, f = r["kvcc"][op], r["file"][op]
                bandwidth.append({"op": f"batch_{op}", "page_bytes": s, "kvcc_bytes_per_s": round(k),
                                  "file_bytes_per_s": round(f), "ratio": round(k / f, 4)})  # fmt: skip
        progress(f"batch_exists, {exists_keys} keys per call")
        ex = _bench_exists({"kvcc": kvcc_backends[exists_size], "file": hfile}, exists_size, exists_keys,
                           exists_calls, trials, nonce)  # fmt: skip
        exists = []
        for case, per in ex.items():
            row: dict[str, Any] = {"case": case, "keys": exists_keys,
                                   "present": exists_keys if case == "all present" else exists_keys // 2}
            for q in ("p50", "p99"):
                k, f = per["kvcc"][q], per["file"][q]
                row[f"kvcc_{q}_ms"] = round(k * 1e3, 4)
                row[f"file_{q}_ms"] = round(f * 1e3, 4)
                row[f"ratio_{q}"] = round(k / f, 3)
            exists.append(row)
        counts = {s: dict(b.get_stats().kvcc) for s, b in kvcc_backends.items()}
    finally:
        for b in kvcc_backends.values():
            try:
                b.close()
            except Exception:
                pass
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    refused = {k: v for c in counts.values() for k, v in c.items() if "refused" in k or "failed" in k}
    return {
        "page_sizes": sizes,
        "pages": pages,
        "trials": trials,
        "exists_keys": exists_keys,
        "exists_calls": exists_calls,
        "exists_page_bytes": exists_size,
        "api": "non-v1: batch_set(keys, values), batch_get(keys, target_locations), batch_exists(keys); "
               "flat float16 CPU tensors, one per page",
        "kvcc": {"cluster": "LocalCluster on 127.0.0.1: a directory (sqlite) and one cache node, processes",
                 "tier": tier, "block_bytes": block_bytes, "refusals": refused},
        "hicache_file": {"directory": str(parent), "filesystem": _filesystem(parent),
                         "page_cache": "warm (reads fetch pages written in the same trial; no fsync on write)",
                         "metadata_cache": bool(hfile.enable_metadata_cache)},
        "bandwidth": bandwidth,
        "exists": exists,
        "seconds": round(time.perf_counter() - started, 1),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "sglang": getattr(sglang, "__version__", "unknown"),
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


# ------------------------------------------------------------------------------------ output


def _fmt_size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB and n % MIB == 0 else f"{n // KIB} KiB" if n % KIB == 0 else f"{n} B"


def render(console: Any, r: dict[str, Any]) -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    t = Table(title=f"kvcc SGLang backend vs HiCacheFile: bandwidth, {r['pages']} pages per call, "
                    f"median of {r['trials']}", box=box.SIMPLE_HEAVY, title_justify="left")  # fmt: skip
    for col, just in (("call", "left"), ("page", "right"), ("kvcc MB/s", "right"), ("HiCacheFile MB/s", "right"),
                      ("kvcc / file", "right")):  # fmt: skip
        t.add_column(col, justify=just)
    for row in r["bandwidth"]:
        t.add_row(row["op"], _fmt_size(row["page_bytes"]), f"{row['kvcc_bytes_per_s'] / 1e6:,.1f}",
                  f"{row['file_bytes_per_s'] / 1e6:,.1f}", f"{row['ratio']:.3f}")  # fmt: skip
    console.print(t)
    e = Table(title=f"batch_exists latency per call of {r['exists_keys']} keys, ms, {r['exists_calls']} calls "
                    f"per trial, median of {r['trials']}", box=box.SIMPLE_HEAVY, title_justify="left")  # fmt: skip
    for col in ("case", "kvcc p50", "file p50", "kvcc/file p50", "kvcc p99", "file p99", "kvcc/file p99"):
        e.add_column(col, justify="left" if col == "case" else "right")
    for row in r["exists"]:
        e.add_row(row["case"], f"{row['kvcc_p50_ms']:.3f}", f"{row['file_p50_ms']:.3f}", f"{row['ratio_p50']:.2f}",
                  f"{row['kvcc_p99_ms']:.3f}", f"{row['file_p99_ms']:.3f}", f"{row['ratio_p99']:.2f}")  # fmt: skip
    console.print(e)
    hf = r["hicache_file"]
    console.print(Text(f"calls: {r['api']}. kvcc: {r['kvcc']['cluster']}, tier {r['kvcc']['tier']}. HiCacheFile: "
                       f"{hf['directory']} ({hf['filesystem']}), page cache {hf['page_cache']}. Bandwidth ratio > 1: "
                       f"kvcc faster; latency ratio > 1: kvcc slower. SGLang {r['sglang']}, {r['cpus']} CPUs, load "
                       f"{r['load_average']}; {r['seconds']} s", style="dim"))  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvcc.console import positive_int

    parser.add_argument("--pages", type=positive_int, default=DEFAULT_PAGES, metavar="N",
                        help=f"pages per batch_set/batch_get call, one call per trial (default {DEFAULT_PAGES})")
    parser.add_argument("--page-kib", type=positive_int, nargs="+", default=list(PAGE_KIB), metavar="K",
                        help=f"page sizes in KiB (default {' '.join(map(str, PAGE_KIB))})")
    parser.add_argument("--trials", type=positive_int, default=DEFAULT_TRIALS, metavar="T",
                        help=f"timed trials per figure, median reported (default {DEFAULT_TRIALS})")
    parser.add_argument("--exists-keys", type=positive_int, default=DEFAULT_EXISTS_KEYS, metavar="N",
                        help=f"keys per batch_exists call (default {DEFAULT_EXISTS_KEYS})")
    parser.add_argument("--exists-calls", type=positive_int, default=DEFAULT_EXISTS_CALLS, metavar="N",
                        help=f"batch_exists calls per trial and case, for p50/p99 (default {DEFAULT_EXISTS_CALLS})")
    parser.add_argument("--tier", choices=TIERS, default="dram",
                        help="the kvcc node's one storage tier (default dram)")
    parser.add_argument("--dir", metavar="PATH",
                        help="parent of the HiCacheFile directory and the cluster's state (default: the system temp dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")


def run(json: bool = False, **options: Any) -> dict[str, Any]:
    """Measure (``options`` as for ``measure``), print rich tables (or JSON with ``json=True``),
    return the result."""
    from kvcc.console import measure_and_show

    return measure_and_show("sglang", measure, render, json, **options)


def cli(args: argparse.Namespace) -> int:
    """``kvcc bench sglang`` with the arguments of ``add_arguments``; 0, or 1 if measuring failed."""
    from kvcc.reference.cluster import ClusterError

    try:
        run(json=args.json, page_kib=args.page_kib, pages=args.pages, trials=args.trials,
            exists_keys=args.exists_keys, exists_calls=args.exists_calls, tier=args.tier, directory=args.dir)
    except (BenchError, ClusterError, OSError) as exc:
        print(f"kvcc bench sglang: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcc.bench.sglang", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return cli(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
