"""Shared-pool tier: one file per block in a directory many processes (and hosts) share.

Theory of operation
-------------------
Layout, one directory per key (so that a key's generations are found without listing the pool)::

    <root>/<hex>/<hex>-<gen>     a block: header page + payload padded to a page (as on NVMe)
    <root>/<hex>/<hex>.fence     the key's fence and freed mark: magic, epoch, freed epoch, CRC-32;
                                 replaced by write-temp-rename
    <root>/<hex>/<hex>.lock      fcntl.flock target serialising writers and freers of the key
    <root>/<hex>/.tmp-...        a block or fence being written (invisible to readers)

**Write**: the block goes to a temp file (flocked by its writer while it exists), fsynced; then,
under the key's flock: read the fence, refuse a lower epoch, or one at or below the key's freed
mark (``rules.slot_accepts``; the temp file is removed: no state changed), raise the fence file first if the epoch is higher (its own temp file, fsynced and
renamed: other processes see the raised fence before the block), ``rename`` the temp file over
``<hex>-<gen>`` (the atomic publish), remove the key's other generations, and fsync the
directory once for both renames. A crash may persist the block's rename and not the fence's; the
block carries its epoch and recovery raises a fence that is behind its block, so the fence never
ends below an epoch that was stored. The check-fence-then-publish runs under ``flock``, so
fencing holds across processes.

**Read** needs no lock: a file, once opened, keeps its bytes even if it is replaced or removed
(POSIX), and a published file is never written again. The header (key, gen, committed flag) is
verified in a staging buffer, the block checksum as the payload is copied out (``base.verified_copy``:
``out`` holds no byte of a block that fails it); a file shorter than its header
says is ``Miss(truncated)``.

**Free** (under the flock) is taken by ``rules.free_takes``: the key's published block decides by
its own epoch, an empty key by its fence. It first makes the freed mark durable in the fence file
(the highest epoch freed: bytes under it that land late, from a paused writer or a slow copy, are
refused as fenced, or a deletion would not stay done), then removes every generation, oldest
first, and fsyncs the directory. The fence file stays. A crash between the two leaves the blocks
and the mark; the free was not answered, and its retry removes them. Unlike the SlotTiers' mark,
which is volatile, this one survives restarts with the fence (a fence file of the earlier format,
without a mark, reads as none).

**Recovery** (on open, and ``recover()``): per key, under its flock, removes temp files whose
writer is gone (their flock is free), removes block files that fail verification, keeps the
block with the highest (epoch, gen, write time) and removes the rest, and raises a fence file
that is behind its block. A fence file that cannot be read back is reported, not guessed: writes
and frees of that key raise ``CorruptFence`` until ``restore_fences`` sets it.

I/O uses ``O_DIRECT`` where the filesystem allows it (as the NVMe tier does; on a network
filesystem this also keeps a host from reading stale cached pages), else buffered I/O + fsync.

Across processes, ``capacity_bytes`` is a soft quota: ``used_bytes`` is a scan of the directory,
refreshed every ``USAGE_REFRESH_S`` and adjusted by this process's own writes and frees; the
filesystem's ENOSPC is always ``NoSpace``. ``lru()`` orders by this process's own uses, after
the blocks it has not touched (by file modification time).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import struct
import threading
import time
import zlib
from collections import OrderedDict, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .base import (
    FLAG_COMMITTED,
    HEADER_BYTES,
    KEY_BYTES,
    PAGE_BYTES,
    Absent,
    BlockInfo,
    CorruptFence,
    Fenced,
    FreeOutcome,
    Freed,
    Header,
    Hit,
    Miss,
    MissReason,
    NoSpace,
    ReadOutcome,
    RecoveryReport,
    Stored,
    Tier,
    TierClosed,
    WriteOutcome,
    block_checksum,
    check_epoch,
    check_gen,
    check_key,
    copy_checksum,
    decode_header,
    event,
    prepare_sink,
    round_up,
    source_bytes,
    verified_copy,
)
from kvcc.spec.rules import fence_accepts, free_takes, slot_accepts

from .nvme import AlignedBuffers, fsync_dir, pread_upto, pwrite_all, resolve_direct_io, write_file_atomic

DEFAULT_THREADS = 4
USAGE_REFRESH_S = 2.0
TEMP_PREFIX = ".tmp-"
FENCE_SUFFIX = ".fence"
LOCK_SUFFIX = ".lock"
FENCE_MAGIC = b"KVCF"
_FENCE_V1 = struct.Struct("<4sQ")  # magic, fence; then CRC-32 (no freed mark)
_FENCE = struct.Struct("<4sQQ")  # magic, fence, freed mark + 1 (0: none); then CRC-32
_ZERO_PAGE = bytes(PAGE_BYTES)
_HEX_DIGITS = frozenset("0123456789abcdef")


def _accepts(epoch: int, fence: int, freed: int | None) -> bool:
    """Whether a write under ``epoch`` may land: at least the fence, and above the freed mark if
    there is one (``rules.slot_accepts``)."""
    return fence_accepts(epoch, fence) if freed is None else slot_accepts(epoch, fence, freed)


def _is_key_dir(name: str) -> bool:
    return len(name) == 2 * KEY_BYTES and set(name) <= _HEX_DIGITS


class SharedPoolTier(Tier):
    """Blocks as files under ``root``, shared by every process that opens the same directory."""

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, *, direct_io: bool | None = None,
                 threads: int = DEFAULT_THREADS, recover: bool = True, verify_on_recover: bool = True,
                 name: str = "pool") -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.name = name
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._capacity = capacity_bytes
        self.verify_on_recover = verify_on_recover
        self.direct_io = resolve_direct_io(self.root, direct_io, name)
        self._buffers = AlignedBuffers(limit=2 * threads + 8)
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix=f"kvcc-{name}-io")
        self._mu = threading.Lock()
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._usage: int | None = None
        self._usage_at = 0.0
        self._closed = False
        self.recovery: RecoveryReport | None = self.recover() if recover else None

    # -- paths and locks ----------------------------------------------------------------------

    def _dir(self, key: bytes) -> Path:
        return self.root / key.hex()

    def _block_path(self, key: bytes, gen: int) -> Path:
        return self._dir(key) / f"{key.hex()}-{gen}"

    def _fence_path(self, key: bytes) -> Path:
        return self._dir(key) / f"{key.hex()}{FENCE_SUFFIX}"

    def _ensure_dir(self, key: bytes) -> Path:
        d = self._dir(key)
        try:
            os.mkdir(d)
        except FileExistsError:
            return d
        fsync_dir(self.root)  # the key's directory entry must survive a crash with its blocks
        return d

    @contextmanager
    def _locked(self, key: bytes) -> Iterator[Path]:
        d = self._ensure_dir(key)
        fd = os.open(d / f"{key.hex()}{LOCK_SUFFIX}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield d
        finally:
            os.close(fd)  # releases the flock

    def _generations(self, key: bytes) -> list[tuple[int, Path]]:
        """The key's block files, oldest generation first."""
        prefix = f"{key.hex()}-"
        try:
            names = os.listdir(self._dir(key))
        except FileNotFoundError:
            return []
        found = [(int(n[len(prefix):]), self._dir(key) / n) for n in names
                 if n.startswith(prefix) and n[len(prefix):].isdigit()]
        return sorted(found)

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosed(f"tier {self.name} is closed")

    # -- fences -------------------------------------------------------------------------------

    def _read_fence(self, key: bytes) -> int:
        return self._read_marks(key)[0]

    def _read_marks(self, key: bytes) -> tuple[int, int | None]:
        """(fence, the highest epoch freed or None) from the key's fence file; (0, None) without one."""
        try:
            raw = self._fence_path(key).read_bytes()
        except FileNotFoundError:
            return 0, None
        for form in (_FENCE, _FENCE_V1):
            if len(raw) == form.size + 4 and zlib.crc32(raw[:form.size]) == int.from_bytes(raw[form.size:], "little"):
                magic, epoch, *freed = form.unpack(raw[:form.size])
                if magic == FENCE_MAGIC:
                    return epoch, (freed[0] - 1 if freed and freed[0] else None)
        event(logging.ERROR, "fence_corrupt", self.name, key, path=str(self._fence_path(key)))
        raise CorruptFence(f"{self._fence_path(key)} cannot be read back; restore_fences it from the directory")

    def _locked_fence(self, key: bytes) -> int:
        """The fence for a decision taken under the key's flock: the fence file, or the epoch of a
        published block if higher (a crash can persist a block's rename without its fence's; see
        the write path). Raises ``CorruptFence`` as ``_read_fence`` does."""
        fence = self._read_fence(key)
        return max([fence] + [h.epoch for h in self._headers_of(key) if h.key == key])

    def _write_fence(self, key: bytes, epoch: int, freed: int | None = None, *, sync_dir: bool = True) -> None:
        body = _FENCE.pack(FENCE_MAGIC, epoch, 0 if freed is None else freed + 1)
        write_file_atomic(self._fence_path(key), body + zlib.crc32(body).to_bytes(4, "little"), sync_dir=sync_dir)

    # -- usage --------------------------------------------------------------------------------

    def _scan_usage(self) -> int:
        total = 0
        with os.scandir(self.root) as it:
            for d in it:
                if not (_is_key_dir(d.name) and d.is_dir()):
                    continue
                prefix = f"{d.name}-"
                with os.scandir(d.path) as files:
                    total += sum(f.stat().st_size for f in files if f.name.startswith(prefix))
        return total

    def _adjust_usage(self, delta: int) -> None:
        with self._mu:
            if self._usage is not None:
                self._usage += delta

    # -- contract -----------------------------------------------------------------------------

    def write(self, key: bytes, gen: int, epoch: int, data: Any) -> WriteOutcome:
        key, gen, epoch = check_key(key), check_gen(gen), check_epoch(epoch)
        src = source_bytes(data)
        n = src.nbytes
        with self._mu:
            self._check_open()
        try:
            fence, freed = self._read_marks(key)  # an early refusal; the check that counts is under the lock
        except CorruptFence:
            fence, freed = 0, None
        if not _accepts(epoch, fence, freed):
            return Fenced(fence)
        size = PAGE_BYTES + round_up(n)
        if self.used_bytes + size > self._capacity:
            return NoSpace(n)
        d = self._ensure_dir(key)
        tmp: Path | None
        tmp, fd = self._create_temp(d, str(gen))
        removed = 0
        try:
            with self._buffers.get(size) as buf:
                payload = buf[PAGE_BYTES:PAGE_BYTES + n]
                seq = time.time_ns()
                checksum = copy_checksum(payload, src, n, key, gen, epoch, seq)
                buf[PAGE_BYTES + n:size] = _ZERO_PAGE[:size - PAGE_BYTES - n]
                header = Header(FLAG_COMMITTED, key, gen, epoch, n, seq, checksum)
                buf[:HEADER_BYTES] = header.pack()
                buf[HEADER_BYTES:PAGE_BYTES] = _ZERO_PAGE[HEADER_BYTES:]
                pwrite_all(fd, buf[:size], 0)
            os.fdatasync(fd)  # the data and the file size; the name is the directory's fsync
            with self._locked(key):
                fence = self._locked_fence(key)
                freed = self._read_marks(key)[1]
                if not _accepts(epoch, fence, freed):
                    # A stale writer; or bytes of a generation already freed here, landing late.
                    return Fenced(fence)  # the finally removes the temp file: nothing changed
                if epoch > fence:
                    # Renamed before the block, made durable by the same directory fsync below: a
                    # crash that keeps the block but not the fence is repaired by recovery (which
                    # raises a fence behind its block), so one directory flush covers both. The
                    # mark stays: below the new fence, it refuses nothing the fence does not.
                    self._write_fence(key, epoch, freed, sync_dir=False)
                final = self._block_path(key, gen)
                old = [(g, p) for g, p in self._generations(key) if g != gen]
                replaced = final.stat().st_size if final.exists() else 0
                os.rename(tmp, final)
                tmp = None
                for _, p in old:
                    removed += p.stat().st_size
                    p.unlink()
                fsync_dir(d)
                removed += replaced
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                return NoSpace(n)
            raise
        finally:
            os.close(fd)
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        self._adjust_usage(size - removed)
        with self._mu:
            self._lru[key] = None
            self._lru.move_to_end(key)
        return Stored(n)

    def _create_temp(self, d: Path, tag: str) -> tuple[Path, int]:
        """A new temp file, flocked for as long as we hold it open. ``recover`` in another process
        removes only temp files whose flock it can take; if it removed ours between our create and
        our flock, the link count says so and we start again."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if self.direct_io else 0)
        while True:
            tmp = d / f"{TEMP_PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(6)}"
            fd = os.open(tmp, flags, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink > 0:
                return tmp, fd
            os.close(fd)

    def read_into(self, key: bytes, gen: int, out: Any) -> ReadOutcome:
        key, gen = check_key(key), check_gen(gen)
        sink, room = prepare_sink(out)
        with self._mu:
            self._check_open()
        path = self._block_path(key, gen)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if self.direct_io else 0))
        except FileNotFoundError:
            return Miss(MissReason.OTHER_GENERATION if self._generations(key) else MissReason.ABSENT)
        try:
            outcome = self._read_file(fd, key, gen, sink, room)
        except OSError as exc:
            if exc.errno not in (errno.EIO, errno.ENXIO, errno.ENODEV, errno.ESTALE):
                raise
            event(logging.WARNING, "read_io_error", self.name, key, gen=gen, error=str(exc))
            return Miss(MissReason.LOST)
        finally:
            os.close(fd)
        if isinstance(outcome, Miss):
            event(logging.WARNING, f"read_{outcome.reason.value}", self.name, key, gen=gen, path=str(path))
        else:
            with self._mu:
                self._lru[key] = None
                self._lru.move_to_end(key)
        return outcome

    def _read_file(self, fd: int, key: bytes, gen: int, sink: Any, room: int) -> ReadOutcome:
        size = os.fstat(fd).st_size
        want = round_up(max(size, PAGE_BYTES))
        with self._buffers.get(want) as buf:
            view = buf[:want]
            got = pread_upto(fd, view, 0)
            if got < HEADER_BYTES:
                return Miss(MissReason.TRUNCATED)
            header, _ = decode_header(view)
            if header is None or header.flags != FLAG_COMMITTED or header.key != key or header.gen != gen:
                return Miss(MissReason.CORRUPT)
            n = header.length
            if got < PAGE_BYTES + n:
                return Miss(MissReason.TRUNCATED)
            if n > room:
                raise ValueError(f"out has {room} bytes, block is {n}")
            if not verified_copy(sink, view[PAGE_BYTES:PAGE_BYTES + n], n, key, gen, header.epoch, header.seq,
                                 header.block_crc):  # fmt: skip
                return Miss(MissReason.CORRUPT)
        return Hit(n)

    def read_many(self, requests: Sequence[tuple[bytes, int, Any]]) -> list[ReadOutcome]:
        return list(self._pool.map(lambda r: self.read_into(*r), requests))

    def free(self, key: bytes, epoch: int) -> FreeOutcome:
        key, epoch = check_key(key), check_epoch(epoch)
        with self._mu:
            self._check_open()
        removed = 0
        with self._locked(key) as d:  # a key never written here gets its directory: the mark lives there
            fence = self._locked_fence(key)
            gens = self._generations(key)
            # The block's own epoch decides, not only the fence (rules.free_takes): a fence raised
            # without new bytes (restored on rejoin) must not make an ended generation's bytes
            # undeletable; bytes of a newer epoch are never dropped.
            block_epoch = max((h.epoch for h in self._headers_of(key) if h.key == key), default=0)
            if not free_takes(epoch, fence, bool(gens), block_epoch):
                return Fenced(fence)
            kept, freed = self._read_marks(key)
            if kept < fence or freed is None or freed < epoch:
                # Durable before any block goes: the blocks carried the fence (keep it when they
                # go), and late bytes under this epoch are refused from now on.
                self._write_fence(key, fence, epoch if freed is None else max(freed, epoch))
            if not gens:
                return Absent()
            for _, p in gens:  # oldest first: a crash part-way leaves the newest, which was current
                removed += p.stat().st_size
                p.unlink()
            fsync_dir(d)
        self._adjust_usage(-removed)
        with self._mu:
            self._lru.pop(key, None)
        return Freed()

    def fence(self, key: bytes) -> int:
        return self._read_fence(check_key(key))

    def restore_fences(self, fences: Mapping[bytes, int]) -> None:
        with self._mu:
            self._check_open()
        for key, epoch in fences.items():
            key, epoch = check_key(key), check_epoch(epoch)
            with self._locked(key):
                try:
                    current, freed = self._read_marks(key)
                except CorruptFence:
                    # The mark went with the file, as a SlotTier's goes with a restart.
                    current = max((h.epoch for h in self._headers_of(key)), default=0)
                    self._write_fence(key, max(current, epoch))
                    continue
                if epoch > current:
                    self._write_fence(key, epoch, freed)

    def _header_of(self, path: Path) -> Header | None:
        try:
            with open(path, "rb") as f:
                raw = f.read(HEADER_BYTES)
        except FileNotFoundError:
            return None
        header, _ = decode_header(raw)
        return header

    def _headers_of(self, key: bytes) -> list[Header]:
        return [h for _, p in self._generations(key) if (h := self._header_of(p)) is not None]

    def contains(self, key: bytes, gen: int) -> bool:
        return self._block_path(check_key(key), gen).exists()

    def nbytes(self, key: bytes, gen: int) -> int | None:
        header = self._header_of(self._block_path(check_key(key), gen))
        return header.length if header is not None and header.key == key and header.gen == gen else None

    def keys(self) -> list[bytes]:
        out = []
        with os.scandir(self.root) as it:
            for d in it:
                if _is_key_dir(d.name) and d.is_dir() and self._generations(bytes.fromhex(d.name)):
                    out.append(bytes.fromhex(d.name))
        return out

    def blocks(self) -> list[BlockInfo]:
        out = []
        for key in self.keys():
            for gen, path in self._generations(key):
                h = self._header_of(path)
                if h is not None and h.key == key and h.gen == gen:
                    out.append(BlockInfo(key, gen, h.epoch, h.length))
        return out

    def lru(self) -> list[bytes]:
        present = self.keys()
        here = set(present)
        with self._mu:
            mine = [k for k in self._lru if k in here]
        seen = set(mine)

        def mtime(k: bytes) -> float:
            gens = self._generations(k)
            try:
                return gens[-1][1].stat().st_mtime if gens else 0.0
            except FileNotFoundError:
                return 0.0

        return sorted((k for k in present if k not in seen), key=mtime) + mine

    @property
    def used_bytes(self) -> int:
        now = time.monotonic()
        with self._mu:
            fresh = self._usage is not None and now - self._usage_at < USAGE_REFRESH_S
            if fresh:
                return self._usage  # type: ignore[return-value]
        usage = self._scan_usage()
        with self._mu:
            self._usage, self._usage_at = usage, now
        return usage

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    # -- recovery -----------------------------------------------------------------------------

    def _verify_file(self, path: Path, key: bytes, gen: int) -> tuple[str, Header | None]:
        """ok / corrupt / truncated, checking the payload when ``verify_on_recover``."""
        flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if self.direct_io else 0)
        fd = os.open(path, flags)
        try:
            size = os.fstat(fd).st_size
            want = PAGE_BYTES if not self.verify_on_recover else round_up(max(size, PAGE_BYTES))
            with self._buffers.get(want) as buf:
                got = pread_upto(fd, buf[:want], 0)
                header, _ = decode_header(buf[:got])
                if header is None or header.flags != FLAG_COMMITTED or header.key != key or header.gen != gen:
                    return ("truncated" if got < HEADER_BYTES else "corrupt"), None
                if size < PAGE_BYTES + header.length:
                    return "truncated", header
                if self.verify_on_recover:
                    payload = buf[PAGE_BYTES:PAGE_BYTES + header.length]
                    if block_checksum(key, gen, header.epoch, header.length, header.seq, payload) != header.block_crc:
                        return "corrupt", header
            return "ok", header
        finally:
            os.close(fd)

    def recover(self) -> RecoveryReport:
        """Clean up after crashed writers and damaged files (see the module docstring). Safe to run
        while other processes use the pool: each key is handled under its flock."""
        started = time.perf_counter()
        with self._mu:
            self._check_open()
        counts: dict[str, int] = defaultdict(int)
        lost: list[bytes] = []
        fences_corrupt: list[bytes] = []
        with os.scandir(self.root) as it:
            key_dirs = [d.name for d in it if _is_key_dir(d.name) and d.is_dir()]
        for name in key_dirs:
            key = bytes.fromhex(name)
            with self._locked(key) as d:
                changed = False
                for entry in os.listdir(d):
                    if entry.startswith(TEMP_PREFIX) and self._remove_abandoned(d / entry):
                        counts["uncommitted"] += 1
                        changed = True
                good: list[tuple[tuple[int, int, int], Path]] = []
                damaged = False
                for gen, path in self._generations(key):
                    verdict, header = self._verify_file(path, key, gen)
                    if verdict == "ok":
                        assert header is not None
                        good.append(((header.epoch, gen, header.seq), path))
                        continue
                    counts[verdict] += 1
                    damaged = True
                    event(logging.WARNING, f"recover_{verdict}", self.name, key, gen=gen, path=str(path))
                    path.unlink()
                    changed = True
                good.sort()
                for _, path in good[:-1]:
                    counts["superseded"] += 1
                    path.unlink()
                    changed = True
                if damaged and not good:
                    lost.append(key)
                try:
                    fence, freed = self._read_marks(key)
                except CorruptFence:
                    fences_corrupt.append(key)
                    fence, freed = None, None
                if good:
                    counts["kept"] += 1
                    top_epoch = good[-1][0][0]
                    if fence is not None and fence < top_epoch:
                        # The fence is raised before a rename; repair if not.
                        self._write_fence(key, top_epoch, freed)
                elif fence and not damaged:
                    counts["tombstones"] += 1  # a freed key: only its fence is left
                if changed:
                    fsync_dir(d)
        with self._mu:
            self._usage = None
        report = RecoveryReport(
            kept=counts["kept"], dropped_corrupt=counts["corrupt"], dropped_truncated=counts["truncated"],
            dropped_uncommitted=counts["uncommitted"], superseded=counts["superseded"],
            tombstones=counts["tombstones"], lost=tuple(sorted(lost)), fences_corrupt=tuple(sorted(fences_corrupt)),
            seconds=round(time.perf_counter() - started, 6))
        event(logging.INFO, "recovered", self.name, None, directory=str(self.root), kept=report.kept,
              dropped_corrupt=report.dropped_corrupt, dropped_truncated=report.dropped_truncated,
              dropped_uncommitted=report.dropped_uncommitted, superseded=report.superseded,
              tombstones=report.tombstones, lost=len(lost), fences_corrupt=len(fences_corrupt),
              seconds=report.seconds)
        return report

    @staticmethod
    def _remove_abandoned(path: Path) -> bool:
        """Remove a temp file whose writer is gone (its flock is free). False if still in use."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            path.unlink(missing_ok=True)
            return True
        finally:
            os.close(fd)

    def close(self) -> None:
        with self._mu:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)


# The brief's name for it, and the short one the package exports.
PoolTier = SharedPoolTier
