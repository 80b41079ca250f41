"""Benchmark: each storage tier's read and write bandwidth as a fraction of the raw limit measured
in the same run, on the same memory or directory, with the same block size and thread count
(``kvcc bench tiers``).

Raw limits, exactly (each measured in the same run, interleaved with the tier's trials):

- DRAM, and GPU on the CPU device: one ``numpy.copyto`` per block (a single-threaded memcpy)
  between a source buffer and a ring of as many blocks as the tier holds, in the same thread, one
  block at a time, as the tier is driven. With CUDA, the GPU tier is compared with one ``torch``
  copy per block, pinned host -> device (write) and device -> pinned host (read), with
  ``non_blocking=True`` and a synchronisation per block, as the tier synchronises per call.
- NVMe and pool: a plain preallocated file in the same directory, one ``pwrite`` + one
  ``fdatasync`` per block (one flush per block, the durability the tiers give before ``Stored``)
  and one ``preadv`` per block, through ``O_DIRECT`` when the tier uses it (else buffered; the
  report says which), from ``threads`` threads: ``threads`` blocks in flight on both sides.

What the tiers do on top: every write checksums the block (XXH3-64 in 512 KiB pieces, hashed
right after each piece is copied) and every verified read checksums it before copying it out
(the caller's buffer is untouched on a miss, so the copy cannot start before the check ends);
the memory tiers also run with ``verify_reads=False`` (rows marked "no verify") to show the copy
alone, and the DRAM tier with ``split_reads=True`` (row "dram (split reads)": blocks from 4 MiB
are hashed, then copied, in two halves, one maybe on a helper thread). An NVMe write copies the block into an aligned buffer behind its header page and writes
both with one ``pwrite`` + ``fdatasync``; reads stage through an aligned buffer. A pool write
creates the key's directory and fence file, writes and fsyncs a temp file, renames it and fsyncs
the directory. Writes go to fresh keys (a node storing new blocks) in slots that were written
before (the NVMe tier is warmed up as the raw file is: steady state, not first allocation); their
frees are not timed. Reads reread a fixed set of blocks.

A benchmark reports; it does not fail on a missed target. The exit code is 1 only when measuring
fails (an exception, or a tier returning a miss or wrong bytes).
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

KIB, MIB = 1 << 10, 1 << 20
SIZES = (64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB)
TIERS = ("dram", "gpu", "nvme", "pool")
TARGET_RATIO = 0.8
TARGET_MIN_SIZE = 1 * MIB
DEFAULT_THREADS = 4
DEFAULT_TRIALS = 3
MEMORY_TRIAL_BYTES = 256 * MIB  # bytes moved per timed trial, memory tiers
FILE_TRIAL_BYTES = 64 * MIB  # ... file tiers
MEMORY_RING_BLOCKS = (4, 64)  # min, max blocks the memory tiers and their raw copies cycle over
FILE_BLOCKS = (8, 512)  # min, max blocks per file-tier trial


class BenchError(Exception):
    pass


def _key(*parts: object) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


def _clamp(x: int, bounds: tuple[int, int]) -> int:
    return max(bounds[0], min(bounds[1], x))


def _filesystem(path: Path) -> str:
    """The filesystem type holding ``path`` (from /proc/mounts), or "unknown"."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "unknown"
    real = str(path.resolve())
    best = ("", "unknown")
    for m in mounts:
        if len(m) >= 3 and (real == m[1] or real.startswith(m[1].rstrip("/") + "/")) and len(m[1]) >= len(best[0]):
            best = (m[1], m[2])
    return best[1]


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------ memory tiers


def _bench_memory(kind: str, size: int, verify: bool, trials: int, trial_bytes: int,
                  split: bool = False) -> dict[str, Any]:
    import numpy as np
    import torch

    from kvcc.reference.tiers import DramTier, GpuTier, Hit

    ring = _clamp(trial_bytes // size, MEMORY_RING_BLOCKS)
    ops = max(ring, trial_bytes // size)
    tier = (DramTier(ring + 1, size, verify_reads=verify, split_reads=split) if kind == "dram"
            else GpuTier(ring + 1, size, verify_reads=verify))
    cuda = kind == "gpu" and tier.device.type == "cuda"
    pin = torch.cuda.is_available()
    src = torch.from_numpy(np.frombuffer(os.urandom(size), dtype=np.uint8).copy())
    out = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
    if pin:
        src = src.pin_memory()
    keys = [_key("mem", kind, size, i) for i in range(ring)]
    try:
        if cuda:
            raw_ring = torch.empty((ring, size), dtype=torch.uint8, device=tier.device)

            def raw_write() -> None:
                for i in range(ops):
                    raw_ring[i % ring].copy_(src, non_blocking=True)
                    torch.cuda.synchronize(tier.device)

            def raw_read() -> None:
                for i in range(ops):
                    out.copy_(raw_ring[i % ring], non_blocking=True)
                    torch.cuda.synchronize(tier.device)

            raw_name = "torch copy pinned host <-> device"
        else:
            ring_np = np.empty((ring, size), dtype=np.uint8)
            src_np, out_np = src.numpy(), out.numpy()

            def raw_write() -> None:
                for i in range(ops):
                    np.copyto(ring_np[i % ring], src_np)

            def raw_read() -> None:
                for i in range(ops):
                    np.copyto(out_np, ring_np[i % ring])

            raw_name = "memcpy (numpy.copyto)"

        def tier_write() -> None:
            for i in range(ops):
                tier.write(keys[i % ring], 1, 1, src)  # replaces the key's block: one spare slot

        def tier_read() -> None:
            for i in range(ops):
                if tier.read_into(keys[i % ring], 1, out) != Hit(size):
                    raise BenchError(f"{kind}: read of a stored block missed")

        tier_write()  # warm-up: fills the ring
        raw_write()
        res = _trials(trials, ops * size, raw_write, tier_write, raw_read, tier_read)
        if not torch.equal(out.cpu(), src.cpu()):
            raise BenchError(f"{kind}: a read returned other bytes than were written")
        res["raw"] = raw_name
        res["device"] = str(tier.device) if kind == "gpu" else ("pinned host" if tier.pinned else "host")
        return res
    finally:
        tier.close()


def _trials(trials: int, nbytes: int, raw_write: Callable[[], object], tier_write: Callable[[], object],
            raw_read: Callable[[], object], tier_read: Callable[[], object],
            after_write: Callable[[], None] | None = None) -> dict[str, Any]:
    """Interleaved trials (raw, tier, raw, tier, ...) so drift hits both; medians in GB/s, and the
    least and greatest ratio of one trial's tier figure to the raw one timed just before it
    (``spread_write``, ``spread_read``): how far one trial could be off on a shared machine."""
    times: dict[str, list[float]] = {"raw_write": [], "tier_write": [], "raw_read": [], "tier_read": []}
    for t in range(trials):
        times["raw_write"].append(_timed(raw_write))
        times["tier_write"].append(_timed(tier_write))
        if after_write is not None:
            after_write()
        times["raw_read"].append(_timed(raw_read))
        times["tier_read"].append(_timed(tier_read))
    res: dict[str, Any] = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    for op in ("write", "read"):
        pairs = [raw / tier for raw, tier in zip(times[f"raw_{op}"], times[f"tier_{op}"], strict=True)]
        res[f"spread_{op}"] = (min(pairs), max(pairs))
    return res


# ------------------------------------------------------------------------------------ memory limits


def probe_memory(block: int = 1 * MIB, ring_bytes: int = 64 * MIB, rounds: int = 3) -> dict[str, Any]:
    """The limits a verified memory-tier read runs into, measured on this machine (reported next
    to the table; README "Tier bandwidth" reads them). A verified read must hash the whole block
    before its first byte reaches the caller's buffer (the buffer stays untouched on a miss), so
    it costs a hash pass plus a copy, against the raw limit's copy alone; doing better needs a
    second core, and a second core helps only if handing it work is cheap. Figures (GB/s unless
    named otherwise), each the best of ``rounds``:

    - ``xxh3_cached``, ``xxh3_memory``: XXH3-64 over one 512 KiB piece kept in cache, and over
      ``block``-sized blocks of a ``ring_bytes`` ring (each from memory, as the tiers read them);
    - ``memcpy``: ``numpy.copyto`` of those blocks into one buffer (the raw limit's copy);
    - ``hash_then_copy_ratio``: memcpy time / (hash + memcpy time) per block, one thread: the
      ceiling of a verified read on one core, before any per-call overhead;
    - ``gil_free_share``: how much of a pure-Python loop's speed survives while another thread
      hashes large buffers (near 1: the hash releases the GIL; near 0.5 or below: it does not);
    - ``hash_two_threads_speedup``: two threads hashing the two halves of the ring at once, against
      one thread hashing both;
    - ``thread_handoff_us``: half a round trip between two threads over ``queue.SimpleQueue``
      (what handing one piece of a read to a helper thread costs before it starts);
    - ``torch_copy``: ``torch`` CPU ``copy_`` of the same blocks with its intra-op threads
      (``torch_threads``), which split one copy across cores.
    """
    import queue

    import numpy as np
    import torch
    import xxhash

    from kvcc.reference.tiers.base import CHECKSUM_PIECE_BYTES

    h = xxhash.xxh3_64_intdigest
    count = max(2, ring_bytes // block)
    ring = np.frombuffer(os.urandom(count * block), dtype=np.uint8).copy()
    view = memoryview(ring)
    out = np.empty(block, dtype=np.uint8)
    piece = CHECKSUM_PIECE_BYTES

    def hash_block(i: int) -> None:
        a = (i % count) * block
        for p in range(a, a + block, piece):
            h(view[p:min(p + piece, a + block)])

    def copy_block(i: int) -> None:
        a = (i % count) * block
        np.copyto(out, ring[a:a + block])

    def best(fn: Callable[[], object]) -> float:
        return min(_timed(fn) for _ in range(rounds))

    cached = view[:piece]
    t_cached = best(lambda: [h(cached) for _ in range(64)]) / (64 * piece)
    t_hash = best(lambda: [hash_block(i) for i in range(count)]) / (count * block)
    t_copy = best(lambda: [copy_block(i) for i in range(count)]) / (count * block)
    t_both = best(lambda: [(hash_block(i), copy_block(i)) for i in range(count)]) / (count * block)

    def spin(seconds: float, hashing: bool) -> float:
        """Pure-Python loop iterations per second while another thread hashes (or sleeps)."""
        stop = threading.Event()

        def other() -> None:
            while not stop.is_set():
                if hashing:
                    h(view)
                else:
                    time.sleep(0.001)

        t = threading.Thread(target=other, daemon=True)
        t.start()
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            n += 1
        stop.set()
        t.join()
        return n / seconds

    gil_free_share = spin(0.2, True) / spin(0.2, False)

    half = count * block // 2

    def hash_range(lo: int, hi: int) -> None:
        for p in range(lo, hi, piece):
            h(view[p:min(p + piece, hi)])

    def two_threads() -> None:
        t = threading.Thread(target=hash_range, args=(0, half))
        t.start()
        hash_range(half, 2 * half)
        t.join()

    t_one = best(lambda: hash_range(0, 2 * half))
    t_two = best(two_threads)

    ping: queue.SimpleQueue = queue.SimpleQueue()
    pong: queue.SimpleQueue = queue.SimpleQueue()

    def echo() -> None:
        while (x := ping.get()) is not None:
            pong.put(x)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    trips = 200

    def round_trips() -> None:
        for i in range(trips):
            ping.put(i)
            pong.get()

    t_trip = best(round_trips) / trips
    ping.put(None)
    t.join()

    ring_t, out_t = torch.from_numpy(ring), torch.from_numpy(out)
    t_torch = best(lambda: [out_t.copy_(ring_t[(i % count) * block:(i % count + 1) * block])
                            for i in range(count)]) / (count * block)
    return {
        "block": block, "ring_bytes": count * block,
        "xxh3_cached": round(1 / t_cached / 1e9, 2), "xxh3_memory": round(1 / t_hash / 1e9, 2),
        "memcpy": round(1 / t_copy / 1e9, 2), "hash_then_copy_ratio": round(t_copy / t_both, 3),
        "gil_free_share": round(gil_free_share, 2), "hash_two_threads_speedup": round(t_one / t_two, 2),
        "thread_handoff_us": round(t_trip / 2 * 1e6, 1),
        "torch_copy": round(1 / t_torch / 1e9, 2), "torch_threads": torch.get_num_threads(),
    }


# ------------------------------------------------------------------------------------ file tiers


def _bench_file(kind: str, size: int, directory: Path, threads: int, trials: int, trial_bytes: int) -> dict[str, Any]:
    from kvcc.reference.tiers import Hit, NvmeTier, SharedPoolTier, Stored
    from kvcc.reference.tiers.base import round_up
    from kvcc.reference.tiers.nvme import pread_upto, pwrite_all

    n = _clamp(trial_bytes // size, FILE_BLOCKS)
    here = directory / f"{kind}-{size}"
    if kind == "nvme":
        tier: Any = NvmeTier(here, size, 2 * n * size, read_threads=threads)
    else:
        tier = SharedPoolTier(here, 1 << 62, threads=threads)
    data = os.urandom(size)
    read_keys = [_key("read", kind, size, i) for i in range(n)]
    outs = [bytearray(size) for _ in range(min(n, 4 * threads))]
    pool = ThreadPoolExecutor(threads)
    stride = round_up(size)
    raw_path = directory / f"raw-{kind}-{size}.bin"
    fd = os.open(raw_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_DIRECT if tier.direct_io else 0), 0o600)
    local = threading.local()
    trial = [0]

    def buf() -> memoryview:
        if not hasattr(local, "view"):
            local.mm = mmap.mmap(-1, stride)
            local.mm.write(data + bytes(stride - size))
            local.view = memoryview(local.mm)
        return local.view

    def raw_write_one(i: int) -> None:
        pwrite_all(fd, buf(), i * stride)
        os.fdatasync(fd)

    def raw_read_one(i: int) -> None:
        if pread_upto(fd, buf(), i * stride) != stride:
            raise BenchError("raw read came back short")

    def write_keys(t: int) -> list[bytes]:
        return [_key("write", kind, size, t, i) for i in range(n)]

    def tier_write() -> None:
        keys = write_keys(trial[0])
        for r in pool.map(lambda k: tier.write(k, 1, 1, data), keys):
            if r != Stored(size):
                raise BenchError(f"{kind}: write returned {r}")

    def free_written() -> None:
        for k in write_keys(trial[0]):
            tier.free(k, 1)
        trial[0] += 1

    def tier_read() -> None:
        got = tier.read_many([(k, 1, outs[i % len(outs)]) for i, k in enumerate(read_keys)])
        if any(r != Hit(size) for r in got):
            raise BenchError(f"{kind}: a read of a stored block missed: {next(r for r in got if r != Hit(size))}")

    try:
        for r in pool.map(lambda k: tier.write(k, 1, 1, data), read_keys):  # the read set
            if r != Stored(size):
                raise BenchError(f"{kind}: write returned {r}")
        list(pool.map(raw_write_one, range(n)))  # warm-up: allocate the raw file's blocks
        tier_write()  # ... and every slot of the tier's
        free_written()
        res = _trials(trials, n * size, lambda: list(pool.map(raw_write_one, range(n))), tier_write,
                      lambda: list(pool.map(raw_read_one, range(n))), tier_read, after_write=free_written)
        if any(bytes(o) != data for o in outs):
            raise BenchError(f"{kind}: a read returned other bytes than were written")
        res["raw"] = ("O_DIRECT" if tier.direct_io else "buffered") + " pwrite+fdatasync / preadv"
        res["direct_io"] = tier.direct_io
        return res
    finally:
        pool.shutdown()
        os.close(fd)
        tier.close()
        raw_path.unlink(missing_ok=True)
        shutil.rmtree(here, ignore_errors=True)


# ------------------------------------------------------------------------------------ measure


def measure(sizes: Sequence[int] = SIZES, tiers: Sequence[str] = TIERS, directory: str | os.PathLike | None = None,
            threads: int = DEFAULT_THREADS, trials: int = DEFAULT_TRIALS,
            memory_trial_bytes: int = MEMORY_TRIAL_BYTES, file_trial_bytes: int = FILE_TRIAL_BYTES,
            on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the benchmark; return a JSON-able dict (see ``render`` for what it holds)."""
    import torch

    from kvcc.reference.tiers.nvme import probe_direct_io

    started = time.perf_counter()
    parent = Path(directory) if directory is not None else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvcc-bench-tiers-", dir=parent))
    rows: list[dict[str, Any]] = []
    direct, why = probe_direct_io(work)
    try:
        plan: list[tuple[str, str, bool, bool]] = []  # label, tier, verify, split reads
        for t in tiers:
            if t in ("dram", "gpu"):
                plan += [(t, t, True, False), (f"{t} (no verify)", t, False, False)]
                if t == "dram":
                    plan.append(("dram (split reads)", t, True, True))
            else:
                plan.append((t, t, True, False))
        for label, kind, verify, split in plan:
            for size in sizes:
                if on_progress is not None:
                    on_progress(f"{label} {_fmt_size(size)}")
                if kind in ("dram", "gpu"):
                    r = _bench_memory(kind, size, verify, trials, memory_trial_bytes, split)
                else:
                    r = _bench_file(kind, size, work, threads, trials, file_trial_bytes)
                # Writes always checksum; the "no verify" and "split reads" variants differ only in
                # reads.
                for op in ("write", "read") if verify and not split else ("read",):
                    ratio = r[f"tier_{op}"] / r[f"raw_{op}"]
                    rows.append({
                        "tier": label, "op": op, "size": size,
                        "tier_gb_per_s": round(r[f"tier_{op}"], 3), "raw_gb_per_s": round(r[f"raw_{op}"], 3),
                        "ratio": round(ratio, 3), "ratio_min": round(r[f"spread_{op}"][0], 3),
                        "ratio_max": round(r[f"spread_{op}"][1], 3), "raw": r["raw"],
                        "meets_target": (ratio >= TARGET_RATIO) if size >= TARGET_MIN_SIZE else None,
                    })
        limits = probe_memory() if any(t in ("dram", "gpu") for t in tiers) else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary: dict[str, bool | None] = {}
    for row in rows:
        name = f"{row['tier']}/{row['op']}"
        if row["meets_target"] is not None:
            summary[name] = summary.get(name) is not False and row["meets_target"]
        else:
            summary.setdefault(name, None)
    return {
        "sizes": list(sizes),
        "threads": threads,
        "trials": trials,
        "directory": str(parent),
        "filesystem": _filesystem(work.parent),
        "direct_io": direct,
        "direct_io_detail": why,
        "cuda": torch.cuda.is_available(),
        "target": {"ratio": TARGET_RATIO, "min_size": TARGET_MIN_SIZE},
        "rows": rows,
        "met": summary,
        "memory_limits": limits,
        "seconds": round(time.perf_counter() - started, 1),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }


# ------------------------------------------------------------------------------------ output


def _fmt_size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def render(console: Any, r: dict[str, Any]) -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    t = Table(title=f"Tier bandwidth / raw limit, {r['threads']} threads, median of {r['trials']} "
                    f"(target >= {r['target']['ratio']} from {_fmt_size(r['target']['min_size'])})",
              box=box.SIMPLE_HEAVY, title_justify="left")
    t.add_column("tier")
    t.add_column("op")
    for size in r["sizes"]:
        t.add_column(_fmt_size(size), justify="right")
    t.add_column("target")
    by = {(row["tier"], row["op"], row["size"]): row for row in r["rows"]}
    for name, met in r["met"].items():
        tier, op = name.rsplit("/", 1)
        cells = []
        for size in r["sizes"]:
            row = by.get((tier, op, size))
            if row is None:
                cells.append(Text("-"))
                continue
            style = "green" if row["ratio"] >= r["target"]["ratio"] else ("yellow" if size < r["target"]["min_size"] else "red")
            cell = Text(f"{row['ratio']:.2f}", style=style)
            cell.append(f"\n{row['tier_gb_per_s']:.2f}/{row['raw_gb_per_s']:.2f}", style="dim")
            if "ratio_min" in row and r["trials"] > 1:
                cell.append(f"\n{row['ratio_min']:.2f}-{row['ratio_max']:.2f}", style="dim")
            cells.append(cell)
        verdict = Text("-") if met is None else (Text("met", style="green") if met else Text("missed", style="bold yellow"))
        t.add_row(tier, op, *cells, verdict)
    console.print(t)
    raws = sorted({(row["tier"].split(" ")[0], row["raw"]) for row in r["rows"]})
    console.print(Text("cells: ratio, then tier/raw GB/s" + (", then the least and greatest ratio of one trial"
                       if r["trials"] > 1 else "") + ". raw limits: " + "; ".join(f"{k}: {v}" for k, v in raws), style="dim"))
    m = r.get("memory_limits")
    if m:
        console.print(Text(
            f"memory limits ({_fmt_size(m['block'])} blocks, GB/s): XXH3 {m['xxh3_cached']} in cache, "
            f"{m['xxh3_memory']} from memory; memcpy {m['memcpy']}; one core hash+copy = "
            f"{m['hash_then_copy_ratio']} of copy; GIL-free share while hashing {m['gil_free_share']}; "
            f"two hashing threads {m['hash_two_threads_speedup']}x; thread handoff {m['thread_handoff_us']} us; "
            f"torch copy ({m['torch_threads']} threads) {m['torch_copy']}", style="dim"))
    console.print(Text(f"directory {r['directory']} ({r['filesystem']}): O_DIRECT "
                       f"{'used' if r['direct_io'] else 'unavailable (' + r['direct_io_detail'] + '), buffered + fdatasync'}; "
                       f"CUDA {'yes' if r['cuda'] else 'no (gpu tier on the cpu device)'}; {r['seconds']} s", style="dim"))


def _parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": KIB, "M": MIB, "G": 1 << 30}.get(t[-1:], 1)
    try:
        n = int(t[:-1] if t[-1:] in "KMG" else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64K, 1M)") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return n


def _sizes(text: str) -> list[int]:
    return [_parse_size(s) for s in text.split(",") if s.strip()]


def _tiers(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in TIERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"tiers are {', '.join(TIERS)}; got {text!r}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvcc.console import positive_int

    parser.add_argument("--sizes", type=_sizes, default=list(SIZES), metavar="LIST",
                        help="block sizes, comma-separated (default 64K,256K,1M,4M,16M)")
    parser.add_argument("--tiers", type=_tiers, default=list(TIERS), metavar="LIST",
                        help=f"tiers, comma-separated (default {','.join(TIERS)})")
    parser.add_argument("--dir", metavar="PATH", help="directory for the NVMe and pool tiers (default: the system temp dir)")
    parser.add_argument("--threads", type=positive_int, default=DEFAULT_THREADS, metavar="N",
                        help=f"concurrent blocks for the file tiers and their raw limit (default {DEFAULT_THREADS})")
    parser.add_argument("--trials", type=positive_int, default=DEFAULT_TRIALS, metavar="N",
                        help=f"timed trials per figure, median reported (default {DEFAULT_TRIALS})")
    parser.add_argument("--memory-trial-bytes", type=_parse_size, default=MEMORY_TRIAL_BYTES, metavar="SIZE",
                        help=f"bytes moved per timed trial, memory tiers (default {MEMORY_TRIAL_BYTES // MIB}M)")
    parser.add_argument("--file-trial-bytes", type=_parse_size, default=FILE_TRIAL_BYTES, metavar="SIZE",
                        help=f"bytes moved per timed trial, file tiers (default {FILE_TRIAL_BYTES // MIB}M)")
    parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")


def run(json: bool = False, **options: Any) -> dict[str, Any]:
    """Measure (``options`` as for ``measure``), print rich tables (or JSON with ``json=True``),
    return the result."""
    from kvcc.console import measure_and_show

    return measure_and_show("tiers", measure, render, json, **options)


def cli(args: argparse.Namespace) -> int:
    """``kvcc bench tiers`` with the arguments of ``add_arguments``; 0, or 1 if measuring failed."""
    try:
        run(json=args.json, sizes=args.sizes, tiers=args.tiers, directory=args.dir, threads=args.threads,
            trials=args.trials, memory_trial_bytes=args.memory_trial_bytes, file_trial_bytes=args.file_trial_bytes)
    except (BenchError, OSError) as exc:
        print(f"kvcc bench tiers: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcc.bench.tiers", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return cli(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
