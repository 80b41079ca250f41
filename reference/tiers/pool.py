"""Shared-pool tier: one file per key in a directory many processes (and hosts) share.

Theory of operation
-------------------
Layout: 256 bucket directories and a spare-file directory, made (and the root fsynced) by every
process that opens the pool, so that a write never makes a directory::

    <root>/<hh>/<hex>            the key's block, one generation: header page + payload padded to
                                 a page (as on NVMe); <hh> is the first byte of the key in hex
    <root>/<hh>/<hex>.fence      the key's fence file and freed mark: magic, epoch, freed epoch,
                                 CRC-32; written by a free, ``restore_fences`` and recovery only,
                                 replaced by write-temp-rename
    <root>/<hh>/.tmp-<hex>...    a block or fence file being written (invisible to readers)
    <root>/spares/<size>-<who>-..  freed blocks' files, kept (up to ``spare_bytes``) to be rewritten
                                 in place by writes of the same size; <who> names the block its
                                 free took off (key, epoch, publish sequence)
    <root>/.lock                 byte-range locks (``F_OFD_SETLKW``), one byte per key: they
                                 serialise the writers and freers of a key, across processes, with
                                 no file per key

What a write costs the filesystem decides its speed: a new file's blocks are allocated, and its
``fdatasync`` then commits the journal, as every ``rename`` made durable does; rewriting allocated
blocks in place needs no commit. So a write adds no directory and no fence file, and reuses a
freed block's file when one of its size is spare: then no journal commit of its own (its
``rename`` is not flushed: see *Write*).

**The fence** of a key is the higher of its fence file's epoch (0 without one) and the epoch in
the header of its block: a block carries its own fence, so a write adds no file and no flush for
it. Whatever removes a block keeps that maximum: a write replaces the block with one of an epoch
at least the fence (one ``rename``: the old block is gone exactly when the new one is there); a
free records the fence in the fence file, durably, before it removes the block; recovery, before
it removes a damaged block whose header still reads, raises the fence file to that header's epoch.
The fence file only ever rises, so ``fence()``, which takes no lock, reads the block's header
first and the file after: a block removed in between wrote its epoch to the file first.

**Write**: the block goes to a temp file in its bucket, flocked exclusively by its writer while it
holds it: a spare of the block's size, taken by renaming it out of ``spares/`` (one that a reader
still holds, or that is linked anywhere else too, is not taken), else a new file. It is written with ``O_DIRECT`` and
``fdatasync``-ed: its bytes and size are durable before it has a name. Then, under the key's lock:
read the fence, refuse a lower epoch, or one at or below the key's freed mark
(``rules.slot_accepts``; the temp file is removed, durably -- a rare path -- so that no crash
brings it back: no state changed), and ``rename`` the temp
file over ``<hex>`` (the atomic publish: bytes, generation and fence together, replacing the
previous generation in the same step). ``Stored`` is answered then, with no flush of the bucket:
the bytes are durable (the ``fdatasync``), the rename is not yet. A crash that undoes it leaves
the new block whole, off its name -- under its temp name, or, for a reused spare whose rename out
of ``spares/`` was undone too, back in ``spares/`` -- and the previous block, if any, at the name.
Recovery publishes such a file again exactly when the write would publish it now
(``_publishable``: the key's marks accept its epoch, the block is newer than the published one --
a later epoch, or for two generations under one epoch, which the protocol never asks, the later
write -- and every payload byte checks), so what ``Stored`` acknowledges (bytes, fence) is never
lost: a crash delays the publish to the next open. Publishing a block late is what the fence rules
already allow at any moment (a paused writer's bytes landing late: a free or a newer write in
between has raised the marks, and then it is refused). The renames become durable with the next
journal commit (a new file's ``fdatasync``, a free's flush, the filesystem's interval), so a
write costs no journal commit of its own when it reuses a spare. The check-fence-then-publish
runs under the lock, so fencing holds across processes.

**Read** takes no lock of the key: it opens ``<hex>``, takes a shared flock on the file (without
waiting), and checks that ``<hex>`` still names it. While it holds the flock the file's bytes stay
as they are: a file is written only by a writer that holds it exclusively, a new one before its
publish, a spare (which its free took off its name) only if no reader holds it. A file that left
its name before the flock was taken, or that a writer holds, is not the block any more (or has
just become it): the read starts again with what ``<hex>`` names now. The header (key, gen, committed flag) is verified in a staging buffer (a block of
another generation is ``Miss(other_generation)``), the block checksum as the payload is copied
out (``base.verified_copy``: ``out`` holds no byte of a block that fails it); a file shorter than
its header says is ``Miss(truncated)``.

**Free** (under the key's lock) is taken by ``rules.free_takes``: the key's block decides by its
own epoch, an empty key by its fence. It first makes the fence and the freed mark durable in the
fence file (the fence the block carried, which must outlive it; and the highest epoch freed: bytes
under it that land late, from a paused writer or a slow copy, are refused as fenced, or a deletion
would not stay done), then takes the block off its name: renamed into ``spares/``, or unlinked if
the spares hold ``spare_bytes`` already; the bucket is fsynced before ``Freed`` is answered. The
fence file stays. A crash between the two leaves the block and the mark; the free was not
answered, and its retry removes it. Unlike the SlotTiers' mark, which is volatile, this one
survives restarts with the fence (a fence file of the earlier format, without a mark, reads as
none).

**Recovery** (on open, and ``recover()``): first the spares that hold a block a write would
publish (a power cut undid a reused spare's renames after its bytes were synced). A spare that
still holds the block its free took off never qualifies, whatever the marks say (they may have
been lost and restored): its name says which block that was. A spare is published by the file
we hold flocked, not by its name (linked through ``/proc/self/fd``, then renamed over the key's
block): a writer of another process may rename it away an instant before, find our flock, and put
it back. Then per key, under its lock, each temp file whose writer is gone (a block's temp file
is flocked by its writer; a fence file's is written under the key's lock) is published if it
qualifies the same way (also when a crash kept both names of its rename out of spares/: a writer
never takes a spare also linked as a block), else removed; a temp holding another key's block (a
spare a writer took and left) goes back to spares/ under that block's name; and a block that
fails verification is removed (after raising the fence file to its header's epoch, if the header
still reads). A fence file that cannot be read back is reported, not guessed: writes and frees of
that key raise ``CorruptFence`` until ``restore_fences`` sets it. Its key's candidates are kept
until then under temp names (a spare candidate moved there, out of writers' reach), and
``restore_fences`` publishes each one newer than the key's block before it writes the fence: a
published block is removed only by a free or a newer write, never by a fence, and the marks that
could have refused them are gone.

I/O uses ``O_DIRECT`` where the filesystem allows it (as the NVMe tier does; on a network
filesystem this also keeps a host from reading stale cached pages), else buffered I/O + fsync.

Across processes, ``capacity_bytes`` is a soft quota on blocks: ``used_bytes`` is a scan of the
buckets, refreshed every ``USAGE_REFRESH_S`` and adjusted by this process's own writes and frees;
spares, outside it, are held to ``spare_bytes`` (a quarter of the capacity, at most 1 GiB, unless
given). The filesystem's ENOSPC is always ``NoSpace``. ``lru()`` orders by this process's own uses,
after the blocks it has not touched (by file modification time).
"""

from __future__ import annotations

import contextlib
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
SPARES_DIR = "spares"
DEFAULT_SPARE_BYTES = 1 << 30
FENCE_SUFFIX = ".fence"
LOCK_NAME = ".lock"
FENCE_MAGIC = b"KVCF"
_FENCE_V1 = struct.Struct("<4sQ")  # magic, fence; then CRC-32 (no freed mark)
_FENCE = struct.Struct("<4sQQ")  # magic, fence, freed mark + 1 (0: none); then CRC-32
_FLOCK = struct.Struct("hhqqi4x")  # struct flock (Linux): type, whence, start, len, pid
_ZERO_PAGE = bytes(PAGE_BYTES)
_HEX_DIGITS = frozenset("0123456789abcdef")
_BUCKETS = [f"{i:02x}" for i in range(256)]


def _accepts(epoch: int, fence: int, freed: int | None) -> bool:
    """Whether a write under ``epoch`` may land: at least the fence, and above the freed mark if
    there is one (``rules.slot_accepts``)."""
    return fence_accepts(epoch, fence) if freed is None else slot_accepts(epoch, fence, freed)


def _key_of(name: str) -> bytes | None:
    """The key a block file, fence file or temp file of a bucket belongs to, from its name."""
    if name.startswith(TEMP_PREFIX):
        name = name[len(TEMP_PREFIX):]
    hex_key = name[:2 * KEY_BYTES]
    if len(hex_key) == 2 * KEY_BYTES and set(hex_key) <= _HEX_DIGITS:
        return bytes.fromhex(hex_key)
    return None


def _newer(header: Header, published: Header) -> bool:
    """Whether a block found off its name replaces the published one: a later epoch (one owner
    per epoch: an equal epoch is the same block), or, where a caller wrote two generations under
    one epoch (outside the protocol), the later write of the same epoch."""
    if header.epoch != published.epoch:
        return header.epoch > published.epoch
    return header.gen != published.gen and header.seq > published.seq


def _publish_spare(path: Path, fd: int, bucket: Path, hex_key: str, publish: bool) -> None:
    """Take the spare we hold open (``fd``, flocked) at ``path`` out of spares/: published as the
    key's block (``publish``), else kept under a temp name of the key. By the file itself, not by
    ``path``: a writer in another process may have renamed the spare away an instant before
    (``_take_spare`` renames, then tries the flock we hold, then puts it back). Linked to a fresh
    temp name through /proc/self/fd (wherever its name is now), renamed over the key's block
    (atomic, replacing an older one), then its spare name dropped if it still names this file; a
    spare name put back later links a published block, which no writer takes (``_take_spare``
    checks the link count)."""
    held = bucket / f"{TEMP_PREFIX}{hex_key}-held-{secrets.token_hex(6)}"
    at = os.open(bucket, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:  # a directory fd makes os.link call linkat, which AT_SYMLINK_FOLLOW lets follow the /proc link
        os.link(f"/proc/self/fd/{fd}", held.name, dst_dir_fd=at, follow_symlinks=True)
    finally:
        os.close(at)
    if publish:
        os.rename(held, bucket / hex_key)
    with contextlib.suppress(FileNotFoundError):
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            os.unlink(path)


class IncompatiblePool(RuntimeError):
    """The pool directory was written in another layout (see ``SharedPoolTier.__init__``)."""


def _spare_size(name: str) -> int:
    """The size of a spare file, from its name ("<size>-..."); 0 for another name."""
    size = name.split("-", 1)[0]
    return int(size) if size.isdigit() else 0


_NO_BLOCK = "x"  # a spare's name for "its free found no block header that reads back"


def _spare_name(size: int, freed: Header | None) -> str:
    """A spare's name: its size, then the identity of the block its free took off (key, epoch,
    publish sequence; ``_NO_BLOCK`` if none read back), then a unique tail. Recovery publishes a
    spare only if it now holds another block than that one: a rewrite whose renames a crash undid,
    never the freed block itself, whatever the key's marks say (``_recover_spares``)."""
    who = _NO_BLOCK if freed is None else f"{freed.key.hex()}.{freed.epoch}.{freed.seq}"
    return f"{size}-{who}-{os.getpid()}-{secrets.token_hex(6)}"


def _spare_holds_its_freed_block(name: str, header: Header) -> bool | None:
    """Whether a spare named ``name`` still holds the block its free took off (None: a name of
    the earlier form, which does not say)."""
    parts = name.split("-")
    if len(parts) != 4:
        return None
    who = parts[1]
    return who != _NO_BLOCK and who == f"{header.key.hex()}.{header.epoch}.{header.seq}"


def _is_block(name: str) -> bool:
    return len(name) == 2 * KEY_BYTES and set(name) <= _HEX_DIGITS


class SharedPoolTier(Tier):
    """Blocks as files under ``root``, shared by every process that opens the same directory."""

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, *, direct_io: bool | None = None,
                 threads: int = DEFAULT_THREADS, recover: bool = True, verify_on_recover: bool = True,
                 spare_bytes: int | None = None, name: str = "pool") -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.name = name
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        earlier = [n for n in os.listdir(self.root) if _is_block(n) and (self.root / n).is_dir()]
        if earlier:
            # The earlier layout (a directory per key, its fence file inside): this code would
            # not see those blocks' fences, so a late writer's stale epoch could land. Refused,
            # before anything is made here.
            raise IncompatiblePool(f"{self.root} holds {len(earlier)} keys in the earlier one-directory-per-key "
                                   "layout: empty it (its blocks are lost, as on a node rejoining without its "
                                   "disk) or open it with the version that wrote it")  # fmt: skip
        for bucket in [*_BUCKETS, SPARES_DIR]:
            (self.root / bucket).mkdir(exist_ok=True)
        # Every process, not only the one that made them: a bucket another process has just made
        # may not be durable yet, and no write of ours may be acknowledged in it before it is.
        fsync_dir(self.root)
        self._bucket_dirs = [str(self.root / bucket) for bucket in _BUCKETS]
        self._spares_str = str(self.root / SPARES_DIR)
        self._lock_str = str(self.root / LOCK_NAME)
        os.close(os.open(self._lock_str, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))
        self._capacity = capacity_bytes
        self.spare_bytes = min(capacity_bytes // 4, DEFAULT_SPARE_BYTES) if spare_bytes is None else spare_bytes
        self._spares: dict[int, list[str]] = defaultdict(list)  # by file size: names seen in spares/
        self._spares_listed = 0.0
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

    def _bucket(self, key: bytes) -> Path:
        return self.root / _BUCKETS[key[0]]

    def _block_path(self, key: bytes) -> Path:
        return self._bucket(key) / key.hex()

    def _fence_path(self, key: bytes) -> Path:
        return self._bucket(key) / f"{key.hex()}{FENCE_SUFFIX}"

    # The same paths as strings, for the per-call paths (a ``Path`` costs microseconds to build).

    def _bucket_str(self, key: bytes) -> str:
        return self._bucket_dirs[key[0]]

    def _block_str(self, key: bytes) -> str:
        return f"{self._bucket_dirs[key[0]]}/{key.hex()}"

    @contextmanager
    def _locked(self, key: bytes) -> Iterator[None]:
        """The key's lock: an open-file-description lock on one byte of the pool's lock file (at an
        offset taken from the key), exclusive between threads as between processes, released when
        the descriptor is closed (also when its process dies)."""
        fd = os.open(self._lock_str, os.O_RDWR | os.O_CLOEXEC)
        try:
            start = int.from_bytes(key[:8], "little") >> 1  # an off_t: below 2**63
            fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, 1, 0))
            yield
        finally:
            os.close(fd)  # releases the lock

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosed(f"tier {self.name} is closed")

    # -- fences -------------------------------------------------------------------------------

    def _marks(self, key: bytes) -> tuple[int, int | None]:
        """(the key's fence, the highest epoch freed or None): the fence is the higher of the fence
        file's and the epoch the key's block carries (module docstring). The header is read first,
        the file after: the file only rises, and a free writes the block's epoch to it before it
        removes the block, so the fence read is one the key had during the call. Needs no lock;
        raises ``CorruptFence`` as ``_read_marks`` does."""
        return self._marks_sized(key)[:2]

    def _marks_sized(self, key: bytes) -> tuple[int, int | None, int]:
        """``_marks`` and the size of the key's block file (0 without one)."""
        header, size = self._published(self._block_str(key))
        carried = header.epoch if header is not None and header.key == key else 0
        fence, freed = self._read_marks(key)
        return max(fence, carried), freed, size

    def _read_marks(self, key: bytes) -> tuple[int, int | None]:
        """(fence, the highest epoch freed or None) from the key's fence file alone; (0, None)
        without one. The key's fence also counts its block's epoch: see ``_marks``."""
        try:
            fd = os.open(f"{self._bucket_dirs[key[0]]}/{key.hex()}{FENCE_SUFFIX}", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return 0, None
        try:
            raw = os.read(fd, _FENCE.size + 5)
        finally:
            os.close(fd)
        for form in (_FENCE, _FENCE_V1):
            if len(raw) == form.size + 4 and zlib.crc32(raw[:form.size]) == int.from_bytes(raw[form.size:], "little"):
                magic, epoch, *freed = form.unpack(raw[:form.size])
                if magic == FENCE_MAGIC:
                    return epoch, (freed[0] - 1 if freed and freed[0] else None)
        event(logging.ERROR, "fence_corrupt", self.name, key, path=str(self._fence_path(key)))
        raise CorruptFence(f"{self._fence_path(key)} cannot be read back; restore_fences it from the directory")

    def _write_fence(self, key: bytes, epoch: int, freed: int | None = None) -> None:
        """Replace the key's fence file, durably (its bucket fsynced) before returning."""
        body = _FENCE.pack(FENCE_MAGIC, epoch, 0 if freed is None else freed + 1)
        write_file_atomic(self._fence_path(key), body + zlib.crc32(body).to_bytes(4, "little"))

    # -- usage --------------------------------------------------------------------------------

    def _block_files(self) -> Iterator[os.DirEntry[str]]:
        for bucket in _BUCKETS:
            with os.scandir(self.root / bucket) as it:
                yield from (f for f in it if _is_block(f.name))

    def _scan_usage(self) -> int:
        total = 0
        for f in self._block_files():
            try:
                total += f.stat().st_size
            except FileNotFoundError:
                pass  # freed or replaced meanwhile
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
        size = PAGE_BYTES + round_up(n)
        if self.used_bytes + size > self._capacity:
            return NoSpace(n)
        # No fence check before the bytes are written: the one that decides is under the key's
        # lock, and a stale writer (rare) only costs its own I/O.
        bucket, tag = self._bucket_str(key), key.hex()
        tmp: str | None
        fd: int | None
        tmp, fd = self._take_spare(bucket, tag, size) or self._create_temp(bucket, tag)
        replaced = 0
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
            os.fdatasync(fd)  # the data and the file size, before the file has a name
            with self._locked(key):
                fence, freed, replaced = self._marks_sized(key)
                if not _accepts(epoch, fence, freed):
                    # A stale writer; or bytes of a generation already freed here, landing late.
                    # Its file is removed durably (a rare path): no crash may bring it back for
                    # a recovery that has lost the marks that refused it.
                    os.close(fd)
                    fd = None
                    os.unlink(tmp)
                    tmp = None
                    fsync_dir(bucket)
                    return Fenced(fence)
                final = f"{bucket}/{tag}"
                # The publish: the bytes, their generation and the fence their header carries, in
                # place of the previous generation.
                os.rename(tmp, final)
                tmp = None
                os.close(fd)  # drops our flock: readers of the new block wait for it
                fd = None
            # No flush of the bucket: the bytes are durable (the fdatasync above), and a crash that
            # undoes the rename leaves the block whole under its temp name, or back in spares/,
            # where recovery publishes it again as this write would (``_publishable``). A crash
            # can delay the publish, not lose it; the rename is made durable by the next journal
            # commit (a new file's fdatasync, a free, the filesystem's own interval).
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                return NoSpace(n)
            raise
        finally:
            if fd is not None:
                os.close(fd)
            if tmp is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        self._adjust_usage(size - replaced)
        with self._mu:
            self._lru[key] = None
            self._lru.move_to_end(key)
        return Stored(n)

    def _create_temp(self, bucket: str, tag: str) -> tuple[str, int]:
        """A new temp file, flocked for as long as we hold it open. ``recover`` in another process
        removes only temp files whose flock it can take; if it removed ours between our create and
        our flock, the link count says so and we start again."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if self.direct_io else 0)
        while True:
            tmp = f"{bucket}/{TEMP_PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(6)}"
            fd = os.open(tmp, flags, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink > 0:
                return tmp, fd
            os.close(fd)

    def _take_spare(self, bucket: str, tag: str, size: int) -> tuple[str, int] | None:
        """A spare file of exactly ``size`` bytes as our temp file, or None. Its blocks are allocated
        and written, so rewriting it in place needs no allocation, and its ``fdatasync`` no journal
        commit. Taken by a rename (one process wins it), then flocked exclusively without waiting:
        a reader that opened it while it was published holds a shared flock until it is done, and
        a spare still being read (maybe by a paused process) goes back for a later write."""
        for name in self._spare_names(size):
            spare = f"{self._spares_str}/{name}"
            tmp = f"{bucket}/{TEMP_PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(6)}"
            try:
                os.rename(spare, tmp)
            except FileNotFoundError:
                continue  # taken by another process
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC | (os.O_DIRECT if self.direct_io else 0))
            except FileNotFoundError:
                continue  # removed as abandoned by a recovery in another process
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.rename(tmp, spare)
                continue
            links = os.fstat(fd).st_nlink
            if links == 1:
                return tmp, fd
            os.close(fd)
            if links > 1:
                # Also linked as a block: a crash kept its free's rename into spares/ but undid
                # the rename of its bucket. Not a spare; drop our name for it.
                os.unlink(tmp)
        return None

    def _spare_names(self, size: int) -> Iterator[str]:
        """Names in spares/ of files of ``size`` bytes, popped from this process's list (refilled by
        its own frees, and by listing the directory at most every ``USAGE_REFRESH_S``)."""
        with self._mu:
            if not self._spares[size]:
                self._list_spares()
        while True:
            with self._mu:
                if not self._spares[size]:
                    return
                name = self._spares[size].pop()
            yield name

    def _list_spares(self) -> None:
        """Refill this process's view of spares/ from the directory, at most every
        ``USAGE_REFRESH_S`` (the caller holds ``_mu``): between listings it is adjusted by this
        process's own frees and takes, as ``used_bytes`` is."""
        now = time.monotonic()
        if now - self._spares_listed >= USAGE_REFRESH_S:
            self._spares_listed = now
            self._spares.clear()
            for name in os.listdir(self.root / SPARES_DIR):
                self._spares[_spare_size(name)].append(name)

    def _retire(self, path: Path, size: int, freed: Header | None) -> None:
        """Take a block file off its published name, under its key's lock: into spares/ while they
        hold less than ``spare_bytes`` (a soft bound across processes, as ``capacity_bytes`` is:
        counted on this process's view of spares/, not a listing per free), else unlinked. Either
        way the name is gone in one step."""
        with self._mu:
            self._list_spares()
            held = sum(n * len(names) for n, names in self._spares.items())
        if held + size > self.spare_bytes:
            path.unlink()
            return
        name = _spare_name(size, freed)
        os.rename(path, self.root / SPARES_DIR / name)
        with self._mu:
            self._spares[size].append(name)

    def _open_published(self, path: Path | str, flags: int) -> int | None:
        """The file published at ``path``, opened for reading with a shared flock held; None if
        there is none. Its bytes stay as they are while we hold the flock: a freed block's file is
        rewritten as a spare only under an exclusive one. The flock is taken without waiting, then
        ``path`` is checked to still name the file; a file that left it meanwhile (freed, maybe
        being rewritten) is not the block any more, and we open what is there now. The flock is
        refused only by a writer of a file that left ``path``, or by the one that has just
        published it there, until its next step (it closes the file under the key's lock)."""
        while True:
            try:
                fd = os.open(path, flags | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                still = os.stat(path).st_ino == os.fstat(fd).st_ino
            except (BlockingIOError, FileNotFoundError):
                still = False
            if still:
                return fd
            os.close(fd)
            time.sleep(0)  # let a writer that has just published it close it

    def read_into(self, key: bytes, gen: int, out: Any) -> ReadOutcome:
        key, gen = check_key(key), check_gen(gen)
        sink, room = prepare_sink(out)
        with self._mu:
            self._check_open()
        path = self._block_str(key)
        fd = self._open_published(path, os.O_RDONLY | (os.O_DIRECT if self.direct_io else 0))
        if fd is None:
            return Miss(MissReason.ABSENT)
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
            if outcome.reason != MissReason.OTHER_GENERATION:
                event(logging.WARNING, f"read_{outcome.reason.value}", self.name, key, gen=gen, path=path)
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
            if header is None or header.flags != FLAG_COMMITTED or header.key != key:
                return Miss(MissReason.CORRUPT)
            if header.gen != gen:
                return Miss(MissReason.OTHER_GENERATION)
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
        path = self._block_path(key)
        with self._locked(key):
            header = self._block_header(key)
            present = path.exists()  # with a header that reads back or not
            kept, freed = self._read_marks(key)
            block_epoch = header.epoch if header is not None else 0
            fence = max(kept, block_epoch)
            # The block's own epoch decides, not only the fence (rules.free_takes): a fence raised
            # without new bytes (restored on rejoin) must not make an ended generation's bytes
            # undeletable; bytes of a newer epoch are never dropped.
            if not free_takes(epoch, fence, present, block_epoch):
                return Fenced(fence)
            if kept < fence or freed is None or freed < epoch:
                # Durable before the block goes: the block carried the fence (the file keeps it when
                # it goes), and late bytes under this epoch are refused from now on.
                self._write_fence(key, fence, epoch if freed is None else max(freed, epoch))
            if not present:
                return Absent()
            removed = path.stat().st_size
            self._retire(path, removed, header)
        fsync_dir(path.parent)  # the removal is durable before Freed, as the mark is before it
        self._adjust_usage(-removed)
        with self._mu:
            self._lru.pop(key, None)
        return Freed()

    def fence(self, key: bytes) -> int:
        return self._marks(check_key(key))[0]

    def restore_fences(self, fences: Mapping[bytes, int]) -> None:
        with self._mu:
            self._check_open()
        for key, epoch in fences.items():
            key, epoch = check_key(key), check_epoch(epoch)
            with self._locked(key):
                try:
                    current, freed = self._marks(key)
                except CorruptFence:
                    # The mark went with the file, as a SlotTier's goes with a restart. First the
                    # blocks recovery kept off their name for want of it (a publish a crash undid,
                    # so possibly acknowledged): published if newer than the key's block, as a
                    # published block is never removed by a fence, only by a free or a newer write.
                    bucket = self._bucket(key)
                    for name in sorted(os.listdir(bucket)):
                        if name.startswith(TEMP_PREFIX) and _key_of(name) == key:
                            self._settle_temp(bucket / name, key, marks=False)
                    header = self._header_of(self._block_path(key))
                    self._write_fence(key, max(header.epoch if header is not None else 0, epoch))
                    continue
                if epoch > current:
                    self._write_fence(key, epoch, freed)

    def _header_of(self, path: Path | str) -> Header | None:
        return self._published(path)[0]

    def _published(self, path: Path | str) -> tuple[Header | None, int]:
        """The header of the file published at ``path`` (None if it does not decode) and the
        file's size; (None, 0) without one."""
        fd = self._open_published(path, os.O_RDONLY)
        if fd is None:
            return None, 0
        try:
            raw = os.pread(fd, HEADER_BYTES, 0)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        header, _ = decode_header(raw)
        return header, size

    def _block_header(self, key: bytes) -> Header | None:
        """The header of the key's block, if it reads back and is the key's."""
        header = self._header_of(self._block_str(key))
        return header if header is not None and header.key == key else None

    def contains(self, key: bytes, gen: int) -> bool:
        header = self._block_header(check_key(key))
        return header is not None and header.gen == gen

    def nbytes(self, key: bytes, gen: int) -> int | None:
        header = self._block_header(check_key(key))
        return header.length if header is not None and header.gen == gen else None

    def keys(self) -> list[bytes]:
        return [bytes.fromhex(f.name) for f in self._block_files()]

    def blocks(self) -> list[BlockInfo]:
        out = []
        for key in self.keys():
            h = self._block_header(key)
            if h is not None:
                out.append(BlockInfo(key, h.gen, h.epoch, h.length))
        return out

    def lru(self) -> list[bytes]:
        present = self.keys()
        here = set(present)
        with self._mu:
            mine = [k for k in self._lru if k in here]
        seen = set(mine)

        def mtime(k: bytes) -> float:
            try:
                return self._block_path(k).stat().st_mtime
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

    def _verify_file(self, path: Path, key: bytes) -> tuple[str, Header | None]:
        """ok / corrupt / truncated, checking the payload when ``verify_on_recover``."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if self.direct_io else 0))
        try:
            return self._verify_fd(fd, key, self.verify_on_recover)
        finally:
            os.close(fd)

    def _verify_fd(self, fd: int, key: bytes, payload_too: bool) -> tuple[str, Header | None]:
        size = os.fstat(fd).st_size
        want = PAGE_BYTES if not payload_too else round_up(max(size, PAGE_BYTES))
        with self._buffers.get(want) as buf:
            got = pread_upto(fd, buf[:want], 0)
            header, _ = decode_header(buf[:got])
            if header is None or header.flags != FLAG_COMMITTED or header.key != key:
                return ("truncated" if got < HEADER_BYTES else "corrupt"), None
            if size < PAGE_BYTES + header.length:
                return "truncated", header
            if payload_too:
                payload = buf[PAGE_BYTES:PAGE_BYTES + header.length]
                if block_checksum(key, header.gen, header.epoch, header.length, header.seq,
                                  payload) != header.block_crc:  # fmt: skip
                    return "corrupt", header
        return "ok", header

    def _publishable(self, fd: int, key: bytes, *, marks: bool = True) -> bool:
        """Whether the file open at ``fd`` (flocked exclusively by the caller, under the key's
        lock) holds a block a write would publish now: the key's, committed, accepted by the
        key's marks (``_accepts``, as under the write's lock; skipped with ``marks=False``, for
        ``restore_fences`` after the marks were lost), newer than the key's published block, and
        whole (every payload byte checked, last: the cheap refusals first). A crash that undid a
        write's publish leaves such a file; publishing it is the state the write would have
        reached a moment later, which the fence rules allow at any time (a paused writer's bytes
        landing late). Raises ``CorruptFence`` as ``_read_marks``."""
        with self._buffers.get(PAGE_BYTES) as buf:  # aligned: the file may be open with O_DIRECT
            header, _ = decode_header(buf[:pread_upto(fd, buf[:PAGE_BYTES], 0)])
        if header is None or header.flags != FLAG_COMMITTED or header.key != key:
            return False
        if marks:
            fence, freed = self._read_marks(key)
            if not _accepts(header.epoch, fence, freed):
                return False
        published = self._block_header(key)
        if published is not None and not _newer(header, published):
            return False
        verdict, _ = self._verify_fd(fd, key, True)
        return verdict == "ok"

    def _open_orphan(self, path: Path | str) -> int | None:
        """``path`` opened and flocked exclusively without waiting; None if it is gone or in use (a
        live writer's temp file, a spare a reader still holds)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if self.direct_io else 0))
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def _settle_temp(self, path: Path, key: bytes, *, marks: bool = True) -> str | None:
        """A temp file of ``key`` (the caller holds the key's lock): "republished" if it holds a
        block its write would publish (a crash undid the publish: the write may have been
        acknowledged), "removed" if not (a write that never finished), None if its writer is alive
        or the key's fence file cannot be read (kept: ``restore_fences`` settles it). A file also
        linked elsewhere (a crash that kept both names of its rename out of spares/) is published
        all the same: a writer never takes a spare that is also linked as a block."""
        fd = self._open_orphan(path)
        if fd is None:
            return None
        try:
            with self._buffers.get(PAGE_BYTES) as buf:
                header, _ = decode_header(buf[:pread_upto(fd, buf[:PAGE_BYTES], 0)])
            if header is not None and header.flags == FLAG_COMMITTED and header.key != key:
                # Another key's block under this key's temp name: a spare a writer took and then
                # left (killed before rewriting it, or an instant before putting it back). Back
                # to spares/, named as the block it holds (so never published from there).
                with contextlib.suppress(FileNotFoundError):
                    os.rename(path, self.root / SPARES_DIR / _spare_name(os.fstat(fd).st_size, header))
                return "removed"
            try:
                publish = self._publishable(fd, key, marks=marks)
            except CorruptFence:
                return None
            if publish:
                os.fsync(fd)  # its bytes, if the writer was killed before its fdatasync
                os.rename(path, self._block_path(key))
                return "republished"
            os.unlink(path)
            return "removed"
        finally:
            os.close(fd)

    def _recover_spares(self) -> int:
        """Publish again the spares that hold a write's block: a spare is rewritten only after a
        writer renamed it out of spares/ to its temp name, but a power cut can undo that rename
        after the rewrite's fdatasync (the rename is not flushed), leaving the new block here.
        The freed block a spare was made from never qualifies: the spare's name says which block
        that was (``_spare_name``). A candidate whose key's fence file cannot be read is moved to
        a temp name of its key (so that no writer takes it) and kept there until
        ``restore_fences``. Returns how many were published."""
        spares = self.root / SPARES_DIR
        changed: set[Path] = set()
        published = 0
        for name in os.listdir(spares):
            path = spares / name
            header = self._spare_header(path)
            if header is None or _spare_holds_its_freed_block(name, header):
                continue
            key = header.key
            with self._locked(key):
                fd = self._open_orphan(path)
                if fd is None:
                    continue
                try:
                    if os.fstat(fd).st_nlink != 1:
                        continue  # also linked as a temp or a block: the bucket's pass settles it
                    try:
                        publish = self._publishable(fd, key)
                        if not publish:
                            continue
                        published += 1
                    except CorruptFence:
                        if self._verify_fd(fd, key, True)[0] != "ok":
                            continue
                        publish = False
                    _publish_spare(path, fd, self._bucket(key), key.hex(), publish)
                    changed.add(self._bucket(key))
                finally:
                    os.close(fd)
        for bucket in changed:
            fsync_dir(bucket)
        if changed:
            fsync_dir(spares)
        return published

    def _spare_header(self, path: Path) -> Header | None:
        """The committed header a spare file starts with, if it has one (read without a lock: a
        first filter, checked again under the key's lock)."""
        try:
            with open(path, "rb") as f:
                header, _ = decode_header(f.read(HEADER_BYTES))
        except FileNotFoundError:
            return None
        return header if header is not None and header.flags == FLAG_COMMITTED else None

    def recover(self) -> RecoveryReport:
        """Clean up after crashed writers and damaged files (see the module docstring). Safe to run
        while other processes use the pool: each key is handled under its lock."""
        started = time.perf_counter()
        with self._mu:
            self._check_open()
        counts: dict[str, int] = defaultdict(int)
        lost: list[bytes] = []
        fences_corrupt: list[bytes] = []
        counts["republished"] = self._recover_spares()
        for bucket in _BUCKETS:
            d = self.root / bucket
            by_key: dict[bytes, list[str]] = defaultdict(list)
            for name in os.listdir(d):
                key = _key_of(name)
                if key is not None:
                    by_key[key].append(name)
            changed = False
            for key, names in by_key.items():
                with self._locked(key):
                    for name in sorted(n for n in names if n.startswith(TEMP_PREFIX)):
                        settled = self._settle_temp(d / name, key)
                        if settled is not None:
                            counts["uncommitted" if settled == "removed" else settled] += 1
                            changed = True
                    verdict = self._recover_block(key, counts, lost, fences_corrupt)
                    changed |= verdict == "dropped"
            if changed:
                fsync_dir(d)
        with self._mu:
            self._usage = None
        report = RecoveryReport(
            kept=counts["kept"], dropped_corrupt=counts["corrupt"], dropped_truncated=counts["truncated"],
            dropped_uncommitted=counts["uncommitted"], republished=counts["republished"],
            tombstones=counts["tombstones"],
            lost=tuple(sorted(lost)), fences_corrupt=tuple(sorted(fences_corrupt)),
            seconds=round(time.perf_counter() - started, 6))
        event(logging.INFO, "recovered", self.name, None, directory=str(self.root), kept=report.kept,
              dropped_corrupt=report.dropped_corrupt, dropped_truncated=report.dropped_truncated,
              dropped_uncommitted=report.dropped_uncommitted, republished=report.republished,
              superseded=report.superseded,
              tombstones=report.tombstones, lost=len(lost), fences_corrupt=len(fences_corrupt),
              seconds=report.seconds)
        return report

    def _recover_block(self, key: bytes, counts: dict[str, int], lost: list[bytes],
                       fences_corrupt: list[bytes]) -> str:
        """Verify the key's block, under its lock: "kept", "dropped" (damaged: removed, its epoch
        kept in the fence file if its header still tells it), or "none" (no block)."""
        path = self._block_path(key)
        try:
            fence, freed = self._read_marks(key)
        except CorruptFence:
            fences_corrupt.append(key)
            fence, freed = None, None
        if not path.exists():
            if fence:
                counts["tombstones"] += 1  # a freed key: only its fence is left
            return "none"
        verdict, header = self._verify_file(path, key)
        if verdict == "ok":
            counts["kept"] += 1
            return "kept"
        counts[verdict] += 1
        lost.append(key)
        event(logging.WARNING, f"recover_{verdict}", self.name, key, path=str(path))
        if fence is not None and header is not None and header.epoch > fence:
            # The damaged block carried the key's fence: the file keeps it, durably, before the
            # block goes (as a free does).
            self._write_fence(key, header.epoch, freed)
        path.unlink()
        return "dropped"

    def close(self) -> None:
        with self._mu:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)


# The brief's name for it, and the short one the package exports.
PoolTier = SharedPoolTier
