"""Local NVMe tier: fixed-size slots in slab files, direct I/O, one-sync crash-safe publish.

Theory of operation
-------------------
On disk, a tier is a directory::

    tier.json          geometry (block size, slots, slots per slab), written once
    slab-00000.kvs     slots; slot i of a slab at offset i * slot_bytes
    fences.journal     fixed-size records (key, fence, kill sequence), each with its own CRC

A slot is one header page (``PAGE_BYTES``, the 80-byte header of ``base`` then zeros) and the
payload padded to a page, so every I/O is page-aligned and can use ``O_DIRECT`` (the page cache
would only double the memory a block takes; the node's DRAM tier is the cache). Where the
filesystem refuses ``O_DIRECT`` (EINVAL), the tier uses buffered I/O with ``fdatasync``, logs that
once, and says so in ``tier.direct_io``.

**Publish** (``_store``): the committed header and the payload in one write, then one
``fdatasync``; ``Stored`` is returned only after it. The header's block checksum covers the
block's identity and every payload byte, and recovery verifies it for every committed header, so
the checksum is what makes a block valid on disk, not the order in which its pages landed:

- a slot being written never held a valid committed header before (a slot is reused only after
  its block was tombstoned, see *Free*; a fresh slot is blank), so whatever mix of old and new
  pages a crash leaves, the slot holds either no valid header (blank, tombstone, or a header page
  failing its CRC: dropped) or the new header over a payload that either matches its checksum
  in full (the write landed: the block is kept, exactly as if the crash came a moment after
  ``Stored``) or does not (a torn write: dropped);
- a torn write was never acknowledged, so nothing was promised about it; the key's previous
  block, if it was replacing one, is still published (it is tombstoned only after the new block
  is synced) and recovery keeps it: recovery keeps a key's newest *intact* committed block;
- the header's epoch counts toward the key's fence even when the payload is torn (the write
  passed the fence check; a fence may only err high).

A damaged block can also be media corruption of an acknowledged block; with no intact block of
the key left, recovery reports the key as lost. (If the tombstone of a replaced block failed to
be written, logged as ``erase_failed``, and the newer block is later damaged on the medium, the
older one comes back: a double fault the directory's generation check catches.) Two synced
phases (payload, then a commit record) would only prove what the checksum already proves, at
the price of a second flush per write. The header page is written together with the payload, so
a write is one I/O; writes of different keys run concurrently from the callers' threads.

**Free** overwrites the slot's header with a *tombstone* (key, gen, the fence, the freed block's
publish sequence), synced before ``Freed``. The tombstone keeps the fence on disk and kills the
block and any older block of that key: recovery keeps a block only if its sequence is higher than
every tombstone of its key. Before a tombstoned slot is reused, its tombstone is copied into the
fence journal (and synced), so neither the fence nor the kill is ever lost with the slot; all
pending tombstones go in one append, so a burst of frees costs one journal sync.
``restore_fences`` appends to the journal too.

**Recovery** (``recover()``, run on open) reads every header (in parallel), verifies every
committed payload, and rebuilds the index: per key the intact committed block with the highest
publish sequence, if that is above the key's kill sequence; fence = the highest epoch in any
decodable header or journal record of the key (a torn block's epoch counts too). Corrupt headers,
torn or corrupt payloads and superseded blocks are dropped (the last two are tombstoned on disk so
that they are not considered again); a key whose newest committed block fails verification and
that has no intact block left is reported as lost.

**Reads** check the header in a page-aligned staging buffer, then the checksum as the payload is
copied into the caller's buffer (``base.verified_copy``: ``out`` holds no byte of a block that
fails it). ``os.preadv`` releases the GIL, so reads run in
parallel on a thread pool: ``read_many`` submits whole blocks, and a single large read is split in
``READ_CHUNK_BYTES`` pieces read concurrently.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import secrets
import struct
import threading
import time
import zlib
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from attrs import frozen

from .base import (
    FLAG_COMMITTED,
    FLAG_TOMBSTONE,
    HEADER_BYTES,
    PAGE_BYTES,
    Header,
    Hit,
    Miss,
    MissReason,
    OutOfSpace,
    ReadOutcome,
    RecoveryReport,
    SlotTier,
    _Entry,
    block_checksum,
    copy_checksum,
    decode_header,
    event,
    make_header,
    round_up,
    verified_copy,
)

FORMAT_VERSION = 2  # 1: two-phase publish, CRC-32 checksums; 2: one-sync publish, XXH3 checksums
GEOMETRY_NAME = "tier.json"
JOURNAL_NAME = "fences.journal"
SLAB_PATTERN = "slab-{:05d}.kvs"

DEFAULT_SLAB_BYTES = 1 << 30
DEFAULT_READ_THREADS = 4
READ_CHUNK_BYTES = 1 << 20  # a large read is split in pieces of this size, read concurrently
PARALLEL_READ_MIN_BYTES = 4 << 20  # ... when it is at least this large
MIN_BUFFER_BYTES = 64 << 10
HUGE_PAGE_BYTES = 2 << 20
JOURNAL_COMPACT_MIN_RECORDS = 4096  # recovery rewrites a journal this long if mostly redundant

_JOURNAL_RECORD = struct.Struct("<4s32sQQ")  # magic, key, fence, kill sequence; then CRC-32
JOURNAL_RECORD_BYTES = 64
JOURNAL_MAGIC = b"KVCJ"
_ZERO_PAGE = bytes(PAGE_BYTES)

assert READ_CHUNK_BYTES % PAGE_BYTES == 0
assert PARALLEL_READ_MIN_BYTES >= 2 * READ_CHUNK_BYTES
assert _JOURNAL_RECORD.size + 4 <= JOURNAL_RECORD_BYTES
assert MIN_BUFFER_BYTES % PAGE_BYTES == 0

# ------------------------------------------------------------------------------------ direct I/O

_fallback_logged: set[str] = set()
_fallback_lock = threading.Lock()


def probe_direct_io(directory: str | os.PathLike) -> tuple[bool, str]:
    """Whether files in ``directory`` accept page-aligned ``O_DIRECT`` writes and reads, and why not."""
    if not hasattr(os, "O_DIRECT"):
        return False, "os.O_DIRECT does not exist on this platform"
    path = Path(directory) / f".kvcc-direct-io-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False, f"open(O_DIRECT) failed: {exc.strerror}"
        raise
    try:
        buf = mmap.mmap(-1, PAGE_BYTES)
        try:
            os.pwrite(fd, buf, 0)
            os.preadv(fd, [buf], 0)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return False, f"an aligned O_DIRECT write failed: {exc.strerror}"
            raise
        finally:
            buf.close()
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return True, "ok"


def resolve_direct_io(directory: Path, requested: bool | None, tier: str) -> bool:
    """``requested`` None: use O_DIRECT where it works, else fall back (logged once per directory).
    True: require it (``OSError`` if refused). False: buffered I/O + fdatasync."""
    if requested is False:
        return False
    ok, why = probe_direct_io(directory)
    if ok:
        return True
    if requested:
        raise OSError(errno.EINVAL, f"O_DIRECT unavailable in {directory}: {why}")
    with _fallback_lock:
        first = str(directory) not in _fallback_logged
        _fallback_logged.add(str(directory))
    if first:
        event(logging.WARNING, "direct_io_unavailable", tier, directory=str(directory), reason=why,
              fallback="buffered I/O + fdatasync")
    return False


# ------------------------------------------------------------------------------------ files


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes, *, sync_dir: bool = True) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one: a temp file,
    fsync, rename over, fsync of the directory (left to the caller with ``sync_dir=False``, who
    then fsyncs the directory itself before relying on the new file)."""
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.rename(tmp, path)
    if sync_dir:
        fsync_dir(path.parent)


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.pwritev(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"pwritev wrote {n} bytes")
        done += n


def pread_upto(fd: int, view: memoryview, offset: int) -> int:
    """Read up to ``len(view)`` bytes; fewer only at end of file."""
    done = 0
    while done < len(view):
        want = len(view) - done
        n = os.preadv(fd, [view[done:]], offset + done)
        done += n
        if n < want:
            break  # end of file (a regular file never returns short otherwise)
    return done


class AlignedBuffers:
    """Reusable page-aligned buffers (anonymous ``mmap``), at most ``limit`` outstanding at once;
    ``get`` blocks when all are in use."""

    def __init__(self, limit: int) -> None:
        assert limit >= 1
        self._limit = limit
        self._cv = threading.Condition()
        self._idle: list[mmap.mmap] = []
        self._count = 0

    @contextmanager
    def get(self, nbytes: int) -> Iterator[memoryview]:
        buf = self._acquire(nbytes)
        view = memoryview(buf)
        try:
            yield view
        finally:
            view.release()
            with self._cv:
                self._idle.append(buf)
                self._cv.notify()

    def _acquire(self, nbytes: int) -> mmap.mmap:
        with self._cv:
            while True:
                fits = [b for b in self._idle if len(b) >= nbytes]
                if fits:
                    best = min(fits, key=len)
                    self._idle.remove(best)
                    return best
                if self._count < self._limit:
                    self._count += 1
                    break
                if self._idle:  # all idle ones too small: replace the smallest
                    self._idle.remove(min(self._idle, key=len))
                    break
                self._cv.wait()
        size = max(MIN_BUFFER_BYTES, 1 << (max(nbytes, 1) - 1).bit_length())
        buf = mmap.mmap(-1, round_up(size))
        if size >= HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
            buf.madvise(mmap.MADV_HUGEPAGE)  # fewer TLB misses copying blocks in and out
        return buf


# ------------------------------------------------------------------------------------ journal


@frozen
class JournalState:
    fences: dict[bytes, int]
    kills: dict[bytes, int]
    records: int
    bad_records: int


class FenceJournal:
    """Append-only fixed-size records (key, fence, kill sequence), each with its own CRC; a torn
    last record (a crash mid-append, never acknowledged) is cut off on load."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd: int | None = None

    @staticmethod
    def encode(key: bytes, fence: int, kill_seq: int) -> bytes:
        body = _JOURNAL_RECORD.pack(JOURNAL_MAGIC, key, fence, kill_seq)
        rec = body + zlib.crc32(body).to_bytes(4, "little")
        return rec + bytes(JOURNAL_RECORD_BYTES - len(rec))

    def load(self) -> JournalState:
        fences: dict[bytes, int] = {}
        kills: dict[bytes, int] = {}
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return JournalState({}, {}, 0, 0)
        whole = len(raw) - len(raw) % JOURNAL_RECORD_BYTES
        if whole != len(raw):
            os.truncate(self.path, whole)  # a torn append: it was never acknowledged
        bad = 0
        for off in range(0, whole, JOURNAL_RECORD_BYTES):
            rec = raw[off:off + JOURNAL_RECORD_BYTES]
            body = rec[:_JOURNAL_RECORD.size]
            crc = int.from_bytes(rec[_JOURNAL_RECORD.size:_JOURNAL_RECORD.size + 4], "little")
            magic, key, fence, kill = _JOURNAL_RECORD.unpack(body)
            if magic != JOURNAL_MAGIC or zlib.crc32(body) != crc:
                bad += 1
                continue
            fences[key] = max(fences.get(key, 0), fence)
            if kill:
                kills[key] = max(kills.get(key, 0), kill)
        return JournalState(fences, kills, whole // JOURNAL_RECORD_BYTES, bad)

    def append(self, records: Sequence[tuple[bytes, int, int]]) -> None:
        data = b"".join(self.encode(*r) for r in records)
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            os.fdatasync(self._fd)

    def rewrite(self, fences: dict[bytes, int], kills: dict[bytes, int]) -> None:
        data = b"".join(self.encode(k, fences.get(k, 0), kills.get(k, 0)) for k in sorted(fences.keys() | kills.keys()))
        with self._lock:
            self._close_locked()
            write_file_atomic(self.path, data)

    def _close_locked(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()


# ------------------------------------------------------------------------------------ tier


class NvmeTier(SlotTier):
    """Slots of ``block_bytes`` in slab files under ``path``; ``capacity_bytes // block_bytes`` slots.

    Opening an existing directory reads its geometry (``block_bytes`` and ``capacity_bytes`` may be
    omitted; if given they must match) and runs ``recover()``; the report is ``tier.recovery``.
    ``read_into`` and ``write`` take host buffers, CPU tensors, and device tensors (through host
    staging). ``direct_io``: None = use O_DIRECT where the filesystem allows it.
    """

    def __init__(self, path: str | os.PathLike, block_bytes: int | None = None, capacity_bytes: int | None = None,
                 *, slab_bytes: int = DEFAULT_SLAB_BYTES, direct_io: bool | None = None,
                 read_threads: int = DEFAULT_READ_THREADS,
                 name: str = "nvme") -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        geometry = self._geometry(block_bytes, capacity_bytes, slab_bytes)
        super().__init__(name, geometry["num_slots"], geometry["block_bytes"])
        self.slot_bytes = PAGE_BYTES + round_up(self.block_bytes)
        self.slots_per_slab = geometry["slots_per_slab"]
        self.num_slabs = -(-self.num_slots // self.slots_per_slab)
        self.direct_io = resolve_direct_io(self.path, direct_io, name)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_DIRECT if self.direct_io else 0)
        self._fds: list[int] = []
        created = False
        for i in range(self.num_slabs):
            slab = self.path / SLAB_PATTERN.format(i)
            created |= not slab.exists()
            self._fds.append(os.open(slab, flags, 0o644))
        if created:
            fsync_dir(self.path)
        self._journal = FenceJournal(self.path / JOURNAL_NAME)
        self._tomb_of: dict[int, tuple[bytes, int, int]] = {}  # slot -> (key, fence, kill seq) on disk
        self._journaling: set[int] = set()  # slots whose tombstones a journal batch is writing
        self._journal_batch = threading.Lock()
        self._buffers = AlignedBuffers(limit=2 * read_threads + 8)
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max(1, read_threads), thread_name_prefix=f"kvcc-{name}-io",
                                        initializer=self._mark_pool_thread)
        # Test hook: how a slot's header page and payload reach the file (a test tears the write).
        self._write_slot: Callable[[int, memoryview, int], None] = pwrite_all
        self.recovery = self.recover()

    # -- geometry -----------------------------------------------------------------------------

    def _geometry(self, block_bytes: int | None, capacity_bytes: int | None, slab_bytes: int) -> dict[str, int]:
        meta = self.path / GEOMETRY_NAME
        if meta.exists():
            g = json.loads(meta.read_text())
            if g.get("format") != FORMAT_VERSION or g.get("page_bytes") != PAGE_BYTES:
                raise ValueError(f"{meta}: unknown tier format {g.get('format')}")
            if block_bytes is not None and block_bytes != g["block_bytes"]:
                raise ValueError(f"{self.path} holds {g['block_bytes']}-byte blocks, not {block_bytes}")
            if capacity_bytes is not None and capacity_bytes // g["block_bytes"] != g["num_slots"]:
                raise ValueError(f"{self.path} holds {g['num_slots']} slots, not {capacity_bytes // g['block_bytes']}")
            return g
        if block_bytes is None or capacity_bytes is None:
            raise ValueError(f"{self.path} is not a tier yet: give block_bytes and capacity_bytes")
        if any(self.path.glob("slab-*.kvs")):
            raise ValueError(f"{self.path} has slab files but no {GEOMETRY_NAME}: refusing to guess")
        if block_bytes < 1 or capacity_bytes < block_bytes:
            raise ValueError(f"need 0 < block_bytes <= capacity_bytes, got {block_bytes}, {capacity_bytes}")
        slot_bytes = PAGE_BYTES + round_up(block_bytes)
        g = {"format": FORMAT_VERSION, "page_bytes": PAGE_BYTES, "block_bytes": block_bytes,
             "num_slots": capacity_bytes // block_bytes, "slots_per_slab": max(1, slab_bytes // slot_bytes)}
        write_file_atomic(meta, json.dumps(g, indent=1).encode())
        return g

    def _where(self, slot: int) -> tuple[int, int]:
        assert 0 <= slot < self.num_slots
        return self._fds[slot // self.slots_per_slab], (slot % self.slots_per_slab) * self.slot_bytes

    def _mark_pool_thread(self) -> None:
        self._local.in_pool = True

    # -- I/O ----------------------------------------------------------------------------------

    def _read_span(self, fd: int, view: memoryview, offset: int) -> int:
        """Read ``view`` from ``offset``; large spans in concurrent chunks (unless already on the
        pool, where waiting on the pool could deadlock). Returns the contiguous bytes read."""
        if len(view) < PARALLEL_READ_MIN_BYTES or getattr(self._local, "in_pool", False):
            return pread_upto(fd, view, offset)
        starts = range(0, len(view), READ_CHUNK_BYTES)
        futures = [self._pool.submit(pread_upto, fd, view[s:s + READ_CHUNK_BYTES], offset + s) for s in starts]
        got = 0
        short = False
        for s, fut in zip(starts, futures):
            n = fut.result()
            if not short:
                got = s + n
                short = n < min(READ_CHUNK_BYTES, len(view) - s)
        return got

    def _write_header(self, slot: int, header: Header) -> None:
        fd, off = self._where(slot)
        with self._buffers.get(PAGE_BYTES) as buf:
            page = buf[:PAGE_BYTES]
            page[:HEADER_BYTES] = header.pack()
            page[HEADER_BYTES:] = _ZERO_PAGE[HEADER_BYTES:]
            pwrite_all(fd, page, off)
        os.fdatasync(fd)

    def _journal_tombstone(self, slot: int) -> None:
        """Before ``slot`` is overwritten, make sure its tombstone (the only durable copy of that
        key's fence and kill sequence) is in the journal. Every pending tombstone goes in the same
        append, so a burst of frees costs one journal sync, not one per reused slot; a writer whose
        slot is in a batch still being written waits for that batch."""
        with self._mu:
            if slot not in self._tomb_of and slot not in self._journaling:
                return
        with self._journal_batch:
            with self._mu:
                if slot not in self._tomb_of:
                    return  # journalled by the batch we waited for (it finished: we hold the lock)
                batch, self._tomb_of = self._tomb_of, {}
                self._journaling = set(batch)
            try:
                self._journal.append(list(batch.values()))
            except BaseException:
                with self._mu:
                    self._tomb_of.update(batch)
                raise
            finally:
                with self._mu:
                    self._journaling = set()

    def _store(self, slot: int, key: bytes, gen: int, epoch: int, seq: int, src: Any, n: int) -> int:
        self._journal_tombstone(slot)  # the slot's tombstone must outlive the slot's old header
        fd, off = self._where(slot)
        padded = round_up(n)
        with self._buffers.get(PAGE_BYTES + padded) as buf:
            payload = buf[PAGE_BYTES:PAGE_BYTES + n]
            checksum = copy_checksum(payload, src, n, key, gen, epoch, seq)
            buf[PAGE_BYTES + n:PAGE_BYTES + padded] = _ZERO_PAGE[:padded - n]
            header = Header(FLAG_COMMITTED, key, gen, epoch, n, seq, checksum)
            buf[:HEADER_BYTES] = header.pack()
            buf[HEADER_BYTES:PAGE_BYTES] = _ZERO_PAGE[HEADER_BYTES:]
            try:
                # Header and payload in one write, one flush: the checksum decides validity (above).
                self._write_slot(fd, buf[:PAGE_BYTES + padded], off)
                os.fdatasync(fd)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise OutOfSpace(str(exc)) from exc
                raise
        return checksum

    def _load(self, entry: _Entry, sink: Any) -> ReadOutcome:
        fd, off = self._where(entry.slot)
        n = entry.length
        want = PAGE_BYTES + round_up(n)
        with self._buffers.get(want) as buf:
            view = buf[:want]
            try:
                got = self._read_span(fd, view, off)
            except OSError as exc:
                if exc.errno not in (errno.EIO, errno.ENXIO, errno.ENODEV):
                    raise
                event(logging.WARNING, "read_io_error", self.name, entry.key, gen=entry.gen, error=str(exc))
                return Miss(MissReason.LOST)
            if got < PAGE_BYTES + n:
                return Miss(MissReason.TRUNCATED)
            header, _ = decode_header(view)
            if (header is None or header.flags != FLAG_COMMITTED or header.block_crc != entry.crc
                    or not header.same_block(entry.key, entry.gen, entry.epoch, n, entry.seq)):
                return Miss(MissReason.CORRUPT)
            if not verified_copy(sink, view[PAGE_BYTES:PAGE_BYTES + n], n, entry.key, entry.gen, entry.epoch,
                                 entry.seq, entry.crc):  # fmt: skip
                return Miss(MissReason.CORRUPT)
        return Hit(n)

    def _erase(self, entry: _Entry, fence: int) -> None:
        tomb = make_header(FLAG_TOMBSTONE, entry.key, entry.gen, fence, entry.seq, b"", 0)
        self._write_header(entry.slot, tomb)
        with self._mu:
            self._tomb_of[entry.slot] = (entry.key, fence, entry.seq)

    def _persist_fences(self, raised: Sequence[tuple[bytes, int]]) -> None:
        self._journal.append([(k, e, 0) for k, e in raised])

    def read_many(self, requests: Sequence[tuple[bytes, int, Any]]) -> list[ReadOutcome]:
        return list(self._pool.map(lambda r: self.read_into(*r), requests))

    # -- recovery -----------------------------------------------------------------------------

    def _scan_slot(self, slot: int) -> tuple[str, Header | None, str]:
        """(kind, header, why): blank, corrupt, tombstone, truncated, bad_payload, committed."""
        fd, off = self._where(slot)
        with self._buffers.get(PAGE_BYTES) as buf:
            got = pread_upto(fd, buf[:PAGE_BYTES], off)
            header, why = decode_header(buf[:got])
        if header is None:
            if got == 0 or why == "blank":
                return "blank", None, ""
            return "corrupt", None, why
        if header.flags == FLAG_TOMBSTONE:
            return "tombstone", header, ""
        if header.flags != FLAG_COMMITTED or header.length > self.block_bytes:
            return "corrupt", None, f"impossible header (flags {header.flags}, length {header.length})"
        # Always verified: with one-sync publish a committed header alone does not prove that its
        # payload landed (module docstring).
        n = header.length
        with self._buffers.get(PAGE_BYTES + round_up(n)) as buf:
            view = buf[:PAGE_BYTES + round_up(n)]
            got = pread_upto(fd, view, off)
            if got < PAGE_BYTES + n:
                return "truncated", header, f"{got - PAGE_BYTES} of {n} payload bytes"
            payload = view[PAGE_BYTES:PAGE_BYTES + n]
            if block_checksum(header.key, header.gen, header.epoch, n, header.seq, payload) != header.block_crc:
                return "bad_payload", header, "payload checksum mismatch"
        return "committed", header, ""

    def recover(self) -> RecoveryReport:
        """Rebuild index, fences, free list and LRU order from the disk (see the module docstring).
        Runs on open; a later call must not overlap other calls on this tier."""
        started = time.perf_counter()
        for lock in self._key_locks:
            lock.acquire()
        try:
            self._check_open()
            return self._recover(started)
        finally:
            for lock in reversed(self._key_locks):
                lock.release()

    def _recover(self, started: float) -> RecoveryReport:
        journal = self._journal.load()
        fences: dict[bytes, int] = dict(journal.fences)
        kills: dict[bytes, int] = dict(journal.kills)
        max_seq = max(kills.values(), default=0)
        scans = list(self._pool.map(self._scan_slot, range(self.num_slots)))
        counts: dict[str, int] = defaultdict(int)
        blank: list[int] = []
        tomb_of: dict[int, tuple[bytes, int, int]] = {}
        committed: dict[bytes, list[tuple[int, Header, bool]]] = defaultdict(list)  # (slot, header, intact)
        damage: dict[int, tuple[str, str]] = {}  # slot -> (kind, why) of a damaged committed block
        for slot, (kind, header, why) in enumerate(scans):
            if header is not None:
                max_seq = max(max_seq, header.seq)
                fences[header.key] = max(fences.get(header.key, 0), header.epoch)
            if kind == "corrupt":
                counts["corrupt"] += 1
                event(logging.WARNING, "recover_corrupt", self.name, None, slot=slot, detail=why)
            if kind in ("truncated", "bad_payload"):
                damage[slot] = (kind, why)
            if kind in ("blank", "corrupt"):
                blank.append(slot)
            elif kind == "tombstone":
                assert header is not None
                kills[header.key] = max(kills.get(header.key, 0), header.seq)
                tomb_of[slot] = (header.key, header.epoch, header.seq)
            else:
                assert header is not None
                committed[header.key].append((slot, header, kind == "committed"))

        index: dict[bytes, tuple[int, Header]] = {}
        lost: dict[bytes, int] = {}
        # Committed headers to tombstone, with the sequence the tombstone kills up to.
        doomed: list[tuple[int, Header, int]] = []
        for key, found in committed.items():
            found.sort(key=lambda f: f[1].seq, reverse=True)
            kill = kills.get(key, 0)  # freed up to here: a tombstone (on disk or journalled) says so
            alive = [f for f in found if f[1].seq > kill]
            kept = next((f for f in alive if f[2]), None)
            for slot, header, intact in found:
                if kept is not None and slot == kept[0]:
                    index[key] = (slot, header)
                    continue
                newer = kept is not None and header.seq > kept[1].seq
                if intact:
                    counts["superseded"] += 1
                elif newer:
                    # Damaged and newer than an intact block of the key: a write torn by a crash,
                    # never acknowledged; the older block is still the published one. Its
                    # tombstone keeps its fence but kills nothing (sequence 0).
                    counts["torn"] += 1
                    event(logging.WARNING, "recover_torn", self.name, key, gen=header.gen, slot=slot,
                          detail=damage[slot][1])
                else:
                    kind, why = damage[slot]
                    counts[kind] += 1
                    event(logging.WARNING, f"recover_{kind}", self.name, key, gen=header.gen, slot=slot, detail=why)
                doomed.append((slot, header, 0 if newer else header.seq))
            if kept is None and alive:
                lost[key] = alive[0][1].gen  # the newest committed copy is damaged: lost, not replaced
        for slot, header, kill_seq in doomed:
            fence = fences[header.key]
            self._write_header(slot, make_header(FLAG_TOMBSTONE, header.key, header.gen, fence, kill_seq, b"", 0))
            tomb_of[slot] = (header.key, fence, kill_seq)

        if journal.records > JOURNAL_COMPACT_MIN_RECORDS and journal.records > 2 * len(journal.fences.keys() | journal.kills.keys()):
            self._journal.rewrite(journal.fences, journal.kills)

        with self._mu:
            self._by_key = {k: _Entry(s, k, h.gen, h.epoch, h.length, h.seq, h.block_crc) for k, (s, h) in index.items()}
            self._lru = OrderedDict((k, None) for k, _ in sorted(index.items(), key=lambda kv: kv[1][1].seq))
            self._fences = {k: e for k, e in fences.items() if e > 0}
            self._lost = lost
            # Blank slots first: reusing a tombstoned one costs a journal append.
            self._free = deque(blank + sorted(tomb_of))
            self._tomb_of = tomb_of
            self._journaling = set()
            self._seq = max_seq
        report = RecoveryReport(
            kept=len(index),
            dropped_corrupt=counts["corrupt"] + counts["bad_payload"],
            dropped_truncated=counts["truncated"],
            dropped_uncommitted=counts["torn"],
            superseded=counts["superseded"],
            tombstones=sum(1 for kind, _, _ in scans if kind == "tombstone"),
            journal_records=journal.records,
            lost=tuple(sorted(lost)),
            seconds=round(time.perf_counter() - started, 6),
        )
        event(logging.INFO, "recovered", self.name, None, directory=str(self.path), kept=report.kept,
              dropped_corrupt=report.dropped_corrupt, dropped_truncated=report.dropped_truncated,
              dropped_uncommitted=report.dropped_uncommitted, superseded=report.superseded,
              tombstones=report.tombstones, lost=len(lost), seconds=report.seconds)
        return report

    # -- lifecycle ----------------------------------------------------------------------------

    def slab_path(self, slot: int) -> tuple[Path, int]:
        """The slab file and byte offset of ``slot`` (its header page; the payload follows)."""
        return self.path / SLAB_PATTERN.format(slot // self.slots_per_slab), (slot % self.slots_per_slab) * self.slot_bytes

    def slot_of(self, key: bytes) -> int | None:
        with self._mu:
            entry = self._by_key.get(key)
            return entry.slot if entry is not None else None

    def close(self) -> None:
        with self._mu:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        self._journal.close()
        for fd in self._fds:
            os.close(fd)
        self._fds = []

