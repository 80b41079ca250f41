"""The storage-tier contract: what one location (GPU memory, host DRAM, local NVMe, a shared pool)
must and must not do with the bytes of KV blocks.

Theory of operation
-------------------
A tier holds at most one block per key, like a storage slot in the spec (``spec/model.py``:
``_on_write_bytes``, ``_on_free``, ``_crash``). A block is named by ``key`` (32 bytes, a SHA-256
digest) and ``gen`` (its generation) and is written under an ``epoch``, the fencing token of the
ownership grant that allowed the write.

- **Fences.** Every key has a fence: the highest epoch the tier has stored under. ``write`` and
  ``free`` carrying a lower epoch are refused with ``Fenced`` and change nothing; an equal epoch is
  accepted (a retried or duplicated message of the current owner). A stored write raises the fence
  to its epoch; a free leaves it where it is; the fence outlives the block (a freed key keeps its
  fence). A free also remembers the epoch it freed (``rules.slot_accepts``): a write (or copy)
  under that epoch or below is refused like a fenced one, so the bytes of a generation already
  deleted here that land late (a paused writer, a slow copy) cannot bring it back. (SlotTiers
  keep that mark in memory: a restarted node keeps its fences but not its freed epochs.) A node
  that lost its disk lost its fences too, and takes them back from the directory with
  ``restore_fences``.
- **Atomic publish.** A block becomes visible all at once, after all of its bytes are in place (and,
  for the durable tiers, on disk). Replacing a key's block (a new generation, or the same one again)
  writes the new block elsewhere and then switches over; a reader sees the old block or the new
  one, never a mix. A tier may therefore answer ``NoSpace`` to a replacement when it is full.
- **Checked reads.** Every block carries a header (key, gen, epoch, length, publish sequence), a
  64-bit block checksum over the header's identity fields and the payload, and a CRC-32 over the
  header itself; every read checks all of them before a byte reaches the caller (the DRAM and GPU
  tiers check a slot's header in full at a block's first read and then, on every read, compare its
  bytes with the ones that passed: the same check, ``DramTier._checked``). Corrupt, truncated or
  lost data is a ``Miss`` with a reason and a log record on the ``kvcc.tiers`` logger, never other
  bytes (spec property 4).
- **No policy.** A tier never evicts on its own: the node knows the leases (spec property 5) and
  decides what to free; the tier only reports ``used_bytes``, ``capacity_bytes`` and ``lru()``.

Three kinds of failure, as everywhere in kvcc: a stale or refused request is an outcome
(``Fenced``, ``Absent``, ``Miss``); a caller breaking the contract (a key of the wrong length, a
buffer too small, a block larger than the tier's slots, use after ``close``) raises
``ValueError``/``TypeError``/``TierClosed``; our own bug is an ``assert``. I/O errors other than a
full device propagate as ``OSError``.

Block checksum (header version 2): the payload is cut in ``CHECKSUM_PIECE_BYTES`` pieces, each
hashed with XXH3-64; the checksum is XXH3-64 over the identity fields followed by the piece
digests. XXH3 runs at 30-60 GB/s per core (``zlib.crc32``, version 1, ran at 3-4 GB/s and capped
every verified read of a memory tier at a fifth of memcpy). Pieces let a writer hash each piece
right after copying it, while it is still in cache (``copy_checksum``), let the GPU tier hash a
piece while the next one is in flight over PCIe, and let large blocks be verified in parallel.
A 64-bit hash misses a random corruption with probability 2^-64; it is not a CRC, so it does not
guarantee to catch every burst of up to 32 bits, which matters for noisy links, not for memory
or disks that report their own uncorrectable errors. The 84-byte header keeps a CRC-32: a flipped
bit there is always caught. ``xxhash`` releases the GIL, so concurrent reads checksum in parallel.
"""

from __future__ import annotations

import abc
import enum
import logging
import queue
import struct
import sys
import threading
import zlib
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash
from attrs import define, frozen

from kvcc.spec.rules import fence_accepts, free_takes, slot_accepts

log = logging.getLogger("kvcc.tiers")

# ------------------------------------------------------------------------------------ limits

KEY_BYTES = 32  # a SHA-256 digest
PAGE_BYTES = 4096  # alignment of every on-disk header and payload (O_DIRECT needs <= this)
MAX_EPOCH = 2**63 - 1  # headers store epochs, generations and sequences as unsigned 64-bit
MAX_GEN = 2**63 - 1
KEY_LOCK_STRIPES = 64  # writes and frees of one key are serialised on one of these locks

HEADER_MAGIC = b"KVCB"
HEADER_VERSION = 2  # 1: CRC-32 block checksums; 2: piecewise XXH3-64 (see the module docstring)
CHECKSUM_PIECE_BYTES = 512 << 10  # hashed right after it is copied, while in L2; see copy_checksum
# Header flags: exactly one is set in a valid header. A committed header vouches for its payload
# only together with the block checksum; a tombstone says the key's blocks up to its sequence are
# gone and keeps the key's fence.
FLAG_COMMITTED = 1
FLAG_TOMBSTONE = 2

# magic, version, flags, key, gen, epoch, length, seq, block checksum, header CRC-32
_HEADER = struct.Struct("<4sHH32sQQQQQI")
HEADER_BYTES = _HEADER.size
# The identity a block's checksum covers together with its payload (flags are the header CRC's).
_IDENTITY = struct.Struct("<32sQQQQ")

assert HEADER_BYTES == 84
assert CHECKSUM_PIECE_BYTES % PAGE_BYTES == 0
assert HEADER_BYTES <= PAGE_BYTES
assert PAGE_BYTES & (PAGE_BYTES - 1) == 0


def round_up(n: int, to: int = PAGE_BYTES) -> int:
    return (n + to - 1) // to * to


# ------------------------------------------------------------------------------------ outcomes


class MissReason(enum.StrEnum):
    ABSENT = "absent"  # no block for this key here
    OTHER_GENERATION = "other_generation"  # the key is here, under another generation
    CORRUPT = "corrupt"  # header or payload failed its checksum or does not match the request
    TRUNCATED = "truncated"  # the medium holds fewer bytes than the header promises
    LOST = "lost"  # the copy is known to have been lost (crash, I/O error, failed recovery)


@frozen
class Stored:
    """The block is published: every later read of (key, gen) returns exactly its bytes."""

    nbytes: int


@frozen
class Fenced:
    """Refused: the request's epoch is below the key's fence -- or, for a write, at or below the
    epoch last freed there (``rules.slot_accepts``). Nothing changed."""

    fence: int


@frozen
class NoSpace:
    """Refused: no room for a block of ``nbytes`` (nothing is evicted to make room). Nothing changed."""

    nbytes: int


@frozen
class Hit:
    """``out[:nbytes]`` holds exactly the committed bytes of (key, gen)."""

    nbytes: int


@frozen
class Miss:
    """No bytes for (key, gen). ``out`` holds no bytes of any block that this read vouched for."""

    reason: MissReason


@frozen
class Freed:
    """The block is gone (durably, for the durable tiers); its space is reusable; the fence stays."""


@frozen
class Absent:
    """Nothing to free: no block for this key here. Nothing changed."""


WriteOutcome = Stored | Fenced | NoSpace
ReadOutcome = Hit | Miss
FreeOutcome = Freed | Fenced | Absent


@frozen
class BlockInfo:
    key: bytes
    gen: int
    epoch: int
    nbytes: int


@frozen
class RecoveryReport:
    """What a recovery scan found. ``lost`` lists keys whose block was there but failed
    verification (the node must tell the directory those copies are lost); ``fences_corrupt`` lists
    keys whose fence could not be read back (the node must ``restore_fences`` them from the
    directory before writing or freeing them). ``republished`` counts whole blocks found off their
    name (a publish a crash undid) and published again, as their write would have."""

    kept: int = 0
    dropped_corrupt: int = 0
    dropped_truncated: int = 0
    dropped_uncommitted: int = 0
    republished: int = 0
    superseded: int = 0
    tombstones: int = 0
    journal_records: int = 0
    lost: tuple[bytes, ...] = ()
    fences_corrupt: tuple[bytes, ...] = ()
    seconds: float = 0.0


class TierClosed(RuntimeError):
    """The tier was used after ``close()``."""


class OutOfSpace(Exception):
    """Raised by a slot tier's ``_store`` when the medium is full (ENOSPC); becomes ``NoSpace``."""


class CorruptFence(RuntimeError):
    """A durable fence could not be read back; writes and frees of that key are refused until
    ``restore_fences`` sets it again from the directory (failing safe: a lost fence could let a
    stale writer in)."""


# ------------------------------------------------------------------------------------ headers


@frozen
class Header:
    flags: int
    key: bytes
    gen: int
    epoch: int
    length: int
    seq: int
    block_crc: int

    def pack(self) -> bytes:
        body = _HEADER.pack(HEADER_MAGIC, HEADER_VERSION, self.flags, self.key, self.gen, self.epoch,
                            self.length, self.seq, self.block_crc, 0)
        crc = zlib.crc32(body[: HEADER_BYTES - 4])
        return body[: HEADER_BYTES - 4] + crc.to_bytes(4, "little")

    def with_flags(self, flags: int) -> Header:
        return Header(flags, self.key, self.gen, self.epoch, self.length, self.seq, self.block_crc)

    def same_block(self, key: bytes, gen: int, epoch: int, length: int, seq: int) -> bool:
        return (self.key, self.gen, self.epoch, self.length, self.seq) == (key, gen, epoch, length, seq)


_piece_digest = xxhash.xxh3_64_intdigest


def combine_digests(key: bytes, gen: int, epoch: int, length: int, seq: int, digests: Sequence[int]) -> int:
    """The block checksum from its identity and the XXH3-64 digests of its pieces, in order."""
    assert len(digests) == -(-length // CHECKSUM_PIECE_BYTES)
    return xxhash.xxh3_64_intdigest(_IDENTITY.pack(key, gen, epoch, length, seq)
                                    + struct.pack(f"<{len(digests)}Q", *digests))


def piece_digests(payload: Any, length: int) -> list[int]:
    """XXH3-64 of each ``CHECKSUM_PIECE_BYTES`` piece of ``payload[:length]`` (a flat byte view)."""
    view = payload if isinstance(payload, memoryview) else memoryview(payload)
    assert view.nbytes >= length
    return [_piece_digest(view[a:a + CHECKSUM_PIECE_BYTES] if length - a > CHECKSUM_PIECE_BYTES else view[a:length])
            for a in range(0, length, CHECKSUM_PIECE_BYTES)]


def block_checksum(key: bytes, gen: int, epoch: int, length: int, seq: int, payload: Any) -> int:
    """The block checksum over the block's identity and its payload (any contiguous buffer of at
    least ``length`` bytes; ``payload[:length]`` is checked)."""
    return combine_digests(key, gen, epoch, length, seq, piece_digests(payload, length))


def copy_checksum(dst: memoryview, src: Any, n: int, key: bytes, gen: int, epoch: int, seq: int) -> int:
    """``dst[:n] = src[:n]`` and the block checksum of the bytes as they landed in ``dst``, piece by
    piece: each piece is hashed right after it is copied, while it is still in cache, so the data
    comes from memory once. Only for a ``dst`` nobody else reads until the caller publishes it."""
    import numpy as np

    d = np.frombuffer(dst, dtype=np.uint8, count=n)
    s = np.frombuffer(src, dtype=np.uint8, count=n)
    digests = []
    for a in range(0, n, CHECKSUM_PIECE_BYTES):
        b = min(n, a + CHECKSUM_PIECE_BYTES)
        np.copyto(d[a:b], s[a:b])
        digests.append(_piece_digest(dst[a:b]))
    return combine_digests(key, gen, epoch, n, seq, digests)


def hash_copy_pieces(dst: memoryview, src: Any, n: int) -> list[int]:
    """``dst[:n] = src[:n]`` piece by piece, each piece hashed (XXH3-64) just before it is copied,
    and the pieces' digests (``combine_digests`` makes the block checksum of them). The piece is
    read from memory once, by the hash, and copied from cache: a verified read then costs a copy
    plus a hash from cache, where hashing the whole block and then copying it reads the block
    from memory twice once it outgrows the cache (README, "Tier bandwidth"). ``dst`` holds the
    bytes before they are verified: the caller checks the digests and, on a mismatch, must not
    hand ``dst`` out (``poison``)."""
    import numpy as np

    d = np.frombuffer(dst, dtype=np.uint8, count=n)
    s = np.frombuffer(src, dtype=np.uint8, count=n)
    view = src if isinstance(src, memoryview) else memoryview(src)
    digests = []
    for a in range(0, n, CHECKSUM_PIECE_BYTES):
        b = min(n, a + CHECKSUM_PIECE_BYTES)
        digests.append(_piece_digest(view[a:b]))
        np.copyto(d[a:b], s[a:b])
    return digests


def identity_bytes(key: bytes, gen: int, epoch: int, length: int, seq: int) -> bytes:
    """The identity fields a block checksum covers, packed as ``combine_digests`` hashes them
    ahead of the piece digests: a tier that checks one block again and again packs them once."""
    return _IDENTITY.pack(key, gen, epoch, length, seq)


_DIGEST_STRUCTS: dict[int, struct.Struct] = {}


def digests_struct(count: int) -> struct.Struct:
    """The struct that packs ``count`` piece digests as ``combine_digests`` hashes them after the
    identity: ``XXH3-64(identity_bytes(...) + digests_struct(k).pack(*digests))`` is the block
    checksum, made without packing the identity or compiling a format per call."""
    s = _DIGEST_STRUCTS.get(count)
    if s is None:
        s = _DIGEST_STRUCTS.setdefault(count, struct.Struct(f"<{count}Q"))
    return s


def source_pieces(src: memoryview, n: int) -> tuple[tuple[int, int, memoryview, Any], ...]:
    """The ``CHECKSUM_PIECE_BYTES`` pieces of ``src[:n]`` (a flat byte view), each as (start, stop,
    byte view, numpy view): made once for a buffer that is read again and again (a DRAM slot),
    they spare each read building views and slicing per piece. They are views of the memory,
    not of its contents: they stay right whatever is written there later."""
    import numpy as np

    arr = np.frombuffer(src, dtype=np.uint8, count=n)
    return tuple((a, min(n, a + CHECKSUM_PIECE_BYTES), src[a:min(n, a + CHECKSUM_PIECE_BYTES)],
                  arr[a:min(n, a + CHECKSUM_PIECE_BYTES)]) for a in range(0, n, CHECKSUM_PIECE_BYTES))


def verified_copy_pieces(sink: Any, pieces: Sequence[tuple[int, int, memoryview, Any]], identity: bytes,
                         pack: Any, crc: int) -> bool:
    """``verified_copy`` of a source cut once into ``source_pieces``, into ``sink``, a flat
    writable ``numpy.uint8`` array, with the block's ``identity_bytes`` and the ``pack`` of
    ``digests_struct`` for its number of pieces: the same order and the same guarantees. A block of
    several pieces is hashed and copied piece by piece (each piece hashed, then copied from cache,
    as ``hash_copy_pieces`` does) and zeroed on a mismatch (``poison``); a block of one piece is
    verified before its first byte is copied (``sink`` untouched on a mismatch). False, and no byte
    of the block left in ``sink``, when the block checksum is not ``crc``."""
    import numpy as np

    copyto, digests = np.copyto, []
    if len(pieces) > 1:
        for lo, hi, view, arr in pieces:
            digests.append(_piece_digest(view))
            copyto(sink[lo:hi], arr)
        if xxhash.xxh3_64_intdigest(identity + pack(*digests)) == crc:
            return True
        poison(sink, pieces[-1][1])
        return False
    for _, _, view, _ in pieces:
        digests.append(_piece_digest(view))
    if xxhash.xxh3_64_intdigest(identity + pack(*digests)) != crc:
        return False
    for lo, hi, _, arr in pieces:
        copyto(sink[lo:hi], arr)
    return True


def poison(dst: memoryview, n: int) -> None:
    """Zero ``dst[:n]``: a read that copied before it verified (``hash_copy_pieces``) and then
    found the block corrupt leaves no byte of it behind."""
    import numpy as np

    np.frombuffer(dst, dtype=np.uint8, count=n).fill(0)


def verified_copy(sink: Any, payload: Any, n: int, key: bytes, gen: int, epoch: int, seq: int, crc: int) -> bool:
    """Copy the ``n`` bytes of ``payload`` (host memory) into ``sink`` (from ``prepare_sink``) if
    their block checksum is ``crc``; False, and no byte of the block left in ``sink``, if not. A
    block of several pieces going to host memory is hashed and copied piece by piece
    (``hash_copy_pieces``, zeroed on a mismatch: the block is read from memory once); anything
    else is verified before its first byte is copied (``sink`` untouched on a mismatch)."""
    if n > CHECKSUM_PIECE_BYTES and not is_tensor(sink):
        if combine_digests(key, gen, epoch, n, seq, hash_copy_pieces(sink, payload, n)) == crc:
            return True
        poison(sink, n)
        return False
    if block_checksum(key, gen, epoch, n, seq, payload) != crc:
        return False
    copy_out(sink, payload, n)
    return True


class HalfHelper:
    """One helper thread that may run the first half of a job while the calling thread runs the
    second (``run``). The halves are claimed, not assigned: the helper runs the first half only
    if it gets to it before the caller has finished the second, else the caller runs it too. So
    the caller never waits for work that has not started (a helper that is slow to wake, or
    descheduled on a busy machine, cannot stall it beyond the half it is already running), and
    when ``run`` returns or raises, neither half is running or will run.

    For halves that release the GIL (XXH3 over large buffers, numpy copies). What it costs is a
    thread wake-up per ``run``: about 40 us on an idle 2-vCPU VM, a few us on a busy one (``kvcc
    bench tiers`` measures it as ``thread_handoff_us``); worth it from a few MiB."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Half | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.take()

    def run(self, first: Any, second: Any) -> tuple[Any, Any]:
        """``(first(), second())``, the first maybe on the helper thread. An exception of either
        half is raised here, after both halves have ended."""
        job = _Half(first)
        self._jobs.put(job)
        try:
            b = second()
        except BaseException:
            if not job.claim.acquire(blocking=False):  # the helper has it: let it end first
                job.done.wait()
            raise
        if not job.take():  # the helper has it: it is running or done
            job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result, b

    def close(self) -> None:
        """Stop the thread (after the job it may be running); a later ``run`` runs both halves on
        the calling thread."""
        self._jobs.put(None)


class _Half:
    __slots__ = ("fn", "claim", "done", "result", "error")

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.claim = threading.Lock()
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def take(self) -> bool:
        """Run the half here if nobody has claimed it yet; False if it was claimed before."""
        if not self.claim.acquire(blocking=False):
            return False
        try:
            self.result = self.fn()
        except BaseException as exc:  # re-raised by HalfHelper.run in the calling thread
            self.error = exc
        finally:
            self.fn = None
            self.done.set()
        return True


def make_header(flags: int, key: bytes, gen: int, epoch: int, seq: int, payload: Any, length: int) -> Header:
    return Header(flags, key, gen, epoch, length, seq, block_checksum(key, gen, epoch, length, seq, payload))


def decode_header(raw: Any) -> tuple[Header | None, str]:
    """(header, "") when ``raw`` starts with a valid header; else (None, why): "blank" for all-zero
    bytes (a slot never written), or "bad magic", "bad version", "bad header checksum"."""
    raw = bytes(raw[:HEADER_BYTES])
    if len(raw) < HEADER_BYTES:
        return None, "short header"
    magic, version, flags, key, gen, epoch, length, seq, block_crc, crc = _HEADER.unpack(raw)
    if magic != HEADER_MAGIC:
        return None, "blank" if raw.count(0) == HEADER_BYTES else "bad magic"
    if zlib.crc32(raw[: HEADER_BYTES - 4]) != crc:
        return None, "bad header checksum"
    if version != HEADER_VERSION:
        return None, "bad version"
    return Header(flags, key, gen, epoch, length, seq, block_crc), ""


# ------------------------------------------------------------------------------------ arguments


def check_key(key: Any) -> bytes:
    if type(key) is bytes and len(key) == KEY_BYTES:  # the usual case, answered at once
        return key
    if not isinstance(key, bytes | bytearray | memoryview):
        raise TypeError(f"key must be bytes, not {type(key).__name__}")
    key = bytes(key)
    if len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes (a SHA-256 digest), got {len(key)}")
    return key


def _check_int(name: str, value: Any, top: int) -> int:
    if type(value) is int and 0 <= value <= top:  # the usual case, answered at once
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not 0 <= value <= top:
        raise ValueError(f"{name} out of range [0, {top}]: {value}")
    return value


def check_gen(gen: Any) -> int:
    if type(gen) is int and 0 <= gen <= MAX_GEN:  # the usual case, answered at once
        return gen
    return _check_int("gen", gen, MAX_GEN)


def check_epoch(epoch: Any) -> int:
    return _check_int("epoch", epoch, MAX_EPOCH)


# ------------------------------------------------------------------------------------ buffers
# torch is optional here: the file tiers take torch tensors when the caller has torch loaded, and
# never import it themselves (a crash-test child starts in a fraction of a second without it).


def _torch() -> Any:
    return sys.modules.get("torch")


def is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # _torch(), without a call: on every read's path
    return torch is not None and isinstance(obj, torch.Tensor)


def _check_tensor(t: Any, what: str) -> Any:
    torch = _torch()
    if t.dtype != torch.uint8:
        raise TypeError(f"{what} tensor must be torch.uint8, not {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{what} tensor must be contiguous")
    return t.reshape(-1)


def source_bytes(data: Any) -> memoryview:
    """A flat, read-only byte view of ``data``: bytes, bytearray, memoryview, a contiguous numpy
    array, or a contiguous ``torch.uint8`` tensor (a device tensor is copied to host memory)."""
    if is_tensor(data):
        t = _check_tensor(data, "data")
        if t.device.type != "cpu":
            t = t.cpu()
        return memoryview(t.numpy()).cast("B")
    if isinstance(data, str):
        raise TypeError("data must be bytes-like, not str")
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise ValueError("data must be contiguous")
    return mv if (mv.format == "B" and mv.ndim == 1) else mv.cast("B")


def sink_bytes(out: Any) -> memoryview:
    """A flat, writable byte view of a host buffer: bytearray, writable memoryview, numpy array, or
    a CPU ``torch.uint8`` tensor."""
    if is_tensor(out):
        t = _check_tensor(out, "out")
        if t.device.type != "cpu":
            raise TypeError(f"out is on {t.device}; this path takes host buffers only")
        return memoryview(t.numpy()).cast("B")
    mv = memoryview(out)
    if mv.readonly:
        raise TypeError("out must be writable (bytearray, memoryview of one, numpy array or tensor)")
    if not mv.c_contiguous:
        raise ValueError("out must be contiguous")
    return mv if (mv.format == "B" and mv.ndim == 1) else mv.cast("B")


def prepare_sink(out: Any) -> tuple[Any, int]:
    """(sink, room): a flat writable host view, or a flat ``torch.uint8`` tensor on a device."""
    if is_tensor(out) and out.device.type != "cpu":
        return _check_tensor(out, "out"), out.numel()
    mv = sink_bytes(out)
    return mv, mv.nbytes


def copy_out(sink: Any, src: Any, n: int) -> None:
    """Copy ``n`` verified bytes from a host buffer into a sink from ``prepare_sink``."""
    if is_tensor(sink):
        import numpy as np

        torch = _torch()
        sink[:n].copy_(torch.from_numpy(np.frombuffer(src, dtype=np.uint8, count=n)))  # synchronous
    else:
        copy_into(sink, src, n)


def copy_into(dst: memoryview, src: Any, n: int) -> None:
    """``dst[:n] = src[:n]`` with numpy (a plain memcpy that releases the GIL)."""
    import numpy as np

    np.copyto(np.frombuffer(dst, dtype=np.uint8, count=n), np.frombuffer(src, dtype=np.uint8, count=n))


def event(level: int, name: str, tier: str, key: bytes | None = None, **fields: Any) -> None:
    """A structured record on ``kvcc.tiers``: ``record.event`` names it, ``record.tier`` the tier,
    ``record.key`` the key in hex, and every other field is an attribute of its own."""
    extra = {"event": name, "tier": tier, "key": key.hex() if key is not None else None, **fields}
    detail = " ".join(f"{k}={v}" for k, v in extra.items() if k not in ("event", "tier") and v is not None)
    log.log(level, "%s %s %s", tier, name, detail, extra=extra)


# ------------------------------------------------------------------------------------ contract


class Tier(abc.ABC):
    """One storage location's slots. Every method is thread-safe.

    Implementations must keep the rules of the module docstring; ``tests/test_tiers*.py`` check them
    for every tier in this package and can be pointed at a new one.
    """

    name: str

    @abc.abstractmethod
    def write(self, key: bytes, gen: int, epoch: int, data: Any) -> WriteOutcome:
        """Store ``data`` (bytes, bytearray, memoryview, numpy array or a contiguous 1-D
        ``torch.uint8`` tensor) as block (key, gen) under ``epoch``.

        Must return ``Fenced(fence)`` and change no state when ``epoch < fence(key)``.
        Must publish atomically: a concurrent reader sees the previous block of the key (or none)
        until the new block is complete; after a crash at any instruction the block is either
        fully there with a valid checksum or absent. Durable tiers must have the block on stable
        storage before returning ``Stored``. On ``Stored`` the fence becomes ``max(fence, epoch)``
        and a previous block of the key (any generation) is gone.
        Returns ``NoSpace`` when there is no free room (even when replacing the key's own block:
        the new block is written before the old one is dropped); must not evict to make room.
        Raises ``ValueError`` for a block larger than the tier's slots, ``TierClosed`` after close.
        """

    def fits(self, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` can ever be stored here (``write`` raises ``ValueError``
        for one that cannot); tiers without a per-block limit say yes."""
        return True

    @abc.abstractmethod
    def read_into(self, key: bytes, gen: int, out: Any) -> ReadOutcome:
        """Copy block (key, gen) into ``out`` (bytearray, writable memoryview, numpy array, or a
        ``torch.uint8`` tensor on the CPU or, for the tiers that say so, on their device).

        Must verify the header (key, gen, epoch, length) and the checksum on every read.
        ``Hit(n)``: ``out[:n]`` holds exactly the committed bytes; bytes past ``n`` are untouched.
        ``Miss(reason)``: no block vouched for; must never hand out other bytes as a hit. On a miss
        the contract allows ``out`` to have been overwritten (its contents are then unspecified);
        the tiers in this package verify before copying and leave ``out`` untouched, except
        their verified reads of blocks of several pieces into host memory, which copy each piece
        as it is hashed and zero what they copied on a miss (``verified_copy``): a miss never
        leaves a byte of the block in ``out``.
        Corrupt, truncated or lost data must be logged (``kvcc.tiers``).
        A hit makes the key the most recently used. Raises ``ValueError`` if ``out`` is smaller
        than the block.
        """

    def read(self, key: bytes, gen: int) -> bytes | None:
        """The block's bytes, or None on any miss."""
        for _ in range(3):  # the block may be replaced between sizing and reading
            n = self.nbytes(key, gen)
            if n is None:
                return None
            buf = bytearray(n)
            try:
                outcome = self.read_into(key, gen, buf)
            except ValueError:
                continue
            return bytes(buf[: outcome.nbytes]) if isinstance(outcome, Hit) else None
        return None

    def read_many(self, requests: Sequence[tuple[bytes, int, Any]]) -> list[ReadOutcome]:
        """``read_into`` for each (key, gen, out); tiers with I/O queues run them in parallel."""
        return [self.read_into(k, g, o) for k, g, o in requests]

    @abc.abstractmethod
    def free(self, key: bytes, epoch: int) -> FreeOutcome:
        """Drop the key's block. ``Fenced`` (no change) when the block was stored under a higher
        epoch, or, with no block, when ``epoch < fence(key)`` (``rules.free_takes``); ``Absent`` when
        there is nothing to drop; ``Freed`` once the block is gone for good (durable tiers: a crash
        after ``Freed`` must not bring it back). The fence stays. A block that readers are copying
        right now is dropped for new readers at once and its space is reused after they finish."""

    @abc.abstractmethod
    def fence(self, key: bytes) -> int:
        """The highest epoch this location has stored under for ``key`` (0 when never written)."""

    @abc.abstractmethod
    def restore_fences(self, fences: Mapping[bytes, int]) -> None:
        """Set ``fence(k) = max(fence(k), e)`` for each item (durably, for the durable tiers): a node
        that lost its disk takes its fences back from the directory (spec: ``_restart_node``)."""

    @abc.abstractmethod
    def contains(self, key: bytes, gen: int) -> bool:
        """Whether (key, gen) is published here (without reading or verifying its bytes)."""

    @abc.abstractmethod
    def nbytes(self, key: bytes, gen: int) -> int | None:
        """The length of block (key, gen), or None when it is not here."""

    @abc.abstractmethod
    def keys(self) -> list[bytes]:
        """Keys with a published block (a snapshot)."""

    @abc.abstractmethod
    def blocks(self) -> list[BlockInfo]:
        """Every published block (what a restarted node re-registers with the directory)."""

    @abc.abstractmethod
    def lru(self) -> list[bytes]:
        """Published keys from least to most recently used (written or read). The node picks
        eviction victims from this list, skipping leased ones; the tier never evicts."""

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Capacity in use (for slot tiers: occupied slots x slot size)."""

    @property
    @abc.abstractmethod
    def capacity_bytes(self) -> int:
        """Total capacity."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release memory, files and threads; later calls raise ``TierClosed``. Idempotent."""

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------ slot tiers


@define(eq=False)
class _Entry:
    """One published block in a slot tier (the in-memory copy of its header), plus who uses it."""

    slot: int
    key: bytes
    gen: int
    epoch: int
    length: int
    seq: int
    crc: int
    pins: int = 0  # readers copying out of the slot right now
    live: bool = True  # published and not yet replaced or freed
    erased: bool = False  # the slot's header no longer vouches for the block (tombstoned)
    released: bool = False  # the slot is back on the free list

    def header(self) -> Header:
        return Header(FLAG_COMMITTED, self.key, self.gen, self.epoch, self.length, self.seq, self.crc)


class SlotTier(Tier):
    """Fencing, publish, pins and LRU for tiers of fixed-size slots (DRAM, GPU, NVMe).

    Subclasses move the bytes: ``_store`` (write payload and header, durably where that applies;
    return the block checksum), ``_load`` (verify and copy out), ``_erase`` (make the slot's header
    stop vouching for its block, durably where that applies).

    Locking: ``_mu`` guards the tables and is never held across I/O or copies. Writes, frees and
    fence restores of one key take that key's stripe lock first, so the fence cannot move between
    a write's check and its publish. A slot leaves the free list when a write takes it and returns
    when its block is replaced or freed, erased, and no reader has it pinned: a reader never sees
    its slot reused under it.
    """

    def __init__(self, name: str, num_slots: int, block_bytes: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a tier needs at least one slot, got {num_slots}")
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.name = name
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self._mu = threading.Lock()
        self._key_locks = [threading.Lock() for _ in range(KEY_LOCK_STRIPES)]
        self._free: deque[int] = deque(range(num_slots))
        self._by_key: dict[bytes, _Entry] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._fences: dict[bytes, int] = {}
        # key -> the highest epoch freed here since the last store (``rules.slot_accepts``): bytes
        # under it that land late (a paused writer, a slow copy) are refused, or a deletion would
        # not stay done. Volatile: a restarted node keeps its fences, not these.
        self._freed: dict[bytes, int] = {}
        self._lost: dict[bytes, int] = {}  # key -> generation whose copy was lost
        self._seq = 0
        self._closed = False

    # -- hooks ------------------------------------------------------------------------------

    def _prepare_source(self, data: Any) -> tuple[Any, int]:
        src = source_bytes(data)
        return src, src.nbytes

    def _prepare_sink(self, out: Any) -> tuple[Any, int]:
        return prepare_sink(out)

    @abc.abstractmethod
    def _store(self, slot: int, key: bytes, gen: int, epoch: int, seq: int, src: Any, n: int) -> int: ...

    @abc.abstractmethod
    def _load(self, entry: _Entry, sink: Any) -> ReadOutcome: ...

    @abc.abstractmethod
    def _erase(self, entry: _Entry, fence: int) -> None: ...

    def _persist_fences(self, raised: Sequence[tuple[bytes, int]]) -> None:
        """Make raised fences durable (durable tiers); called with the keys' stripe locks held."""

    # -- helpers ----------------------------------------------------------------------------

    def _key_lock(self, key: bytes) -> threading.Lock:
        return self._key_locks[int.from_bytes(key[:4], "little") % KEY_LOCK_STRIPES]

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosed(f"tier {self.name} is closed")

    def _release_locked(self, entry: _Entry) -> None:
        """Give the slot back once nothing refers to its block any more. Caller holds ``_mu``."""
        if not entry.live and entry.erased and entry.pins == 0 and not entry.released:
            entry.released = True
            self._free.append(entry.slot)

    def _retire(self, entry: _Entry, fence: int) -> None:
        """A replaced or freed block: erase its header, then free its slot when unpinned."""
        assert not entry.live
        try:
            self._erase(entry, fence)
        except OSError as exc:
            # Only for a *replaced* block (free re-raises): the newer block has the higher publish
            # sequence, which is what recovery keeps; the slot is reused (and overwritten) later.
            event(logging.WARNING, "erase_failed", self.name, entry.key, gen=entry.gen, error=str(exc))
        with self._mu:
            entry.erased = True
            self._release_locked(entry)

    # -- contract ---------------------------------------------------------------------------

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.block_bytes

    def write(self, key: bytes, gen: int, epoch: int, data: Any) -> WriteOutcome:
        key, gen, epoch = check_key(key), check_gen(gen), check_epoch(epoch)
        src, n = self._prepare_source(data)
        if n > self.block_bytes:
            raise ValueError(f"{self.name}: a {n}-byte block does not fit {self.block_bytes}-byte slots")
        with self._key_lock(key):
            with self._mu:
                self._check_open()
                fence = self._fences.get(key, 0)
                freed = self._freed.get(key)
                if not (fence_accepts(epoch, fence) if freed is None else slot_accepts(epoch, fence, freed)):
                    # A stale writer, refused where the data lives; or bytes of a generation
                    # already freed here, landing late (then ``epoch`` may equal the fence).
                    return Fenced(fence)
                if not self._free:
                    return NoSpace(n)
                slot = self._free.popleft()
                self._seq += 1
                seq = self._seq
            try:
                crc = self._store(slot, key, gen, epoch, seq, src, n)
            except OutOfSpace:
                with self._mu:
                    self._free.appendleft(slot)
                return NoSpace(n)
            except BaseException:
                with self._mu:
                    self._free.appendleft(slot)
                raise
            entry = _Entry(slot, key, gen, epoch, n, seq, crc)
            with self._mu:
                # The key's stripe lock is held: nothing else moved this key's fence or block.
                assert self._fences.get(key, 0) == fence
                old = self._by_key.get(key)
                self._by_key[key] = entry
                self._lru[key] = None
                self._lru.move_to_end(key)
                self._fences[key] = max(fence, epoch)
                self._freed.pop(key, None)  # the fence (>= epoch > freed) refuses all it did
                self._lost.pop(key, None)
                if old is not None:
                    old.live = False
            if old is not None:
                self._retire(old, max(fence, epoch))
        return Stored(n)

    def read_into(self, key: bytes, gen: int, out: Any) -> ReadOutcome:
        key, gen = check_key(key), check_gen(gen)
        sink, room = self._prepare_sink(out)
        with self._mu:
            self._check_open()
            entry = self._by_key.get(key)
            if entry is None:
                return Miss(MissReason.LOST if self._lost.get(key) == gen else MissReason.ABSENT)
            if entry.gen != gen:
                return Miss(MissReason.OTHER_GENERATION)
            if entry.length > room:
                raise ValueError(f"out has {room} bytes, block is {entry.length}")
            entry.pins += 1
        outcome: ReadOutcome | None = None
        try:
            outcome = self._load(entry, sink)
        finally:
            with self._mu:
                entry.pins -= 1
                raced = not entry.live
                if isinstance(outcome, Hit) and not raced:
                    self._lru.move_to_end(key)
                self._release_locked(entry)
                current = self._by_key.get(key)
        assert outcome is not None
        if isinstance(outcome, Miss) and raced:
            # Replaced or freed while we copied: its header may have been erased under us. That is
            # a race with a free (the node should not free under a lease), not corruption.
            return Miss(MissReason.OTHER_GENERATION if current is not None else MissReason.ABSENT)
        if isinstance(outcome, Miss):
            event(logging.WARNING, f"read_{outcome.reason.value}", self.name, key, gen=gen, slot=entry.slot)
        return outcome

    def free(self, key: bytes, epoch: int) -> FreeOutcome:
        key, epoch = check_key(key), check_epoch(epoch)
        with self._key_lock(key):
            with self._mu:
                self._check_open()
                fence = self._fences.get(key, 0)
                entry = self._by_key.get(key)
                # The block's own epoch decides, not only the fence (rules.free_takes): a fence
                # raised without new bytes (restored on rejoin) must not make an ended
                # generation's bytes undeletable; bytes of a newer epoch are never dropped.
                if not free_takes(epoch, fence, entry is not None, 0 if entry is None else entry.epoch):
                    return Fenced(fence)
                # Whatever happens below, bytes under this epoch are not taken here any more.
                self._freed[key] = max(epoch, self._freed.get(key, 0))
                entry = self._by_key.pop(key, None)
                if entry is None:
                    return Freed() if self._lost.pop(key, None) is not None else Absent()
                self._lru.pop(key, None)
                entry.live = False
            try:
                self._erase(entry, fence)
            except BaseException:
                with self._mu:  # not freed after all: the block stays published
                    entry.live = True
                    self._by_key[key] = entry
                    self._lru[key] = None
                raise
            with self._mu:
                entry.erased = True
                self._release_locked(entry)
        return Freed()

    def fence(self, key: bytes) -> int:
        key = check_key(key)
        with self._mu:
            return self._fences.get(key, 0)

    def restore_fences(self, fences: Mapping[bytes, int]) -> None:
        wanted = {check_key(k): check_epoch(e) for k, e in fences.items()}
        stripes = sorted({id(self._key_lock(k)): self._key_lock(k) for k in wanted}.items())
        for _, lock in stripes:  # in a fixed order: no deadlock with another restore
            lock.acquire()
        try:
            with self._mu:
                self._check_open()
                raised = [(k, e) for k, e in wanted.items() if e > self._fences.get(k, 0)]
            if raised:
                self._persist_fences(raised)
                with self._mu:
                    for k, e in raised:
                        self._fences[k] = max(e, self._fences.get(k, 0))
                        if self._fences[k] > self._freed.get(k, 0):
                            self._freed.pop(k, None)  # the fence refuses all it did
        finally:
            for _, lock in reversed(stripes):
                lock.release()

    def contains(self, key: bytes, gen: int) -> bool:
        key = check_key(key)
        with self._mu:
            entry = self._by_key.get(key)
            return entry is not None and entry.gen == gen

    def nbytes(self, key: bytes, gen: int) -> int | None:
        key = check_key(key)
        with self._mu:
            entry = self._by_key.get(key)
            return entry.length if entry is not None and entry.gen == gen else None

    def keys(self) -> list[bytes]:
        with self._mu:
            return list(self._by_key)

    def blocks(self) -> list[BlockInfo]:
        with self._mu:
            return [BlockInfo(e.key, e.gen, e.epoch, e.length) for e in self._by_key.values()]

    def lru(self) -> list[bytes]:
        with self._mu:
            return list(self._lru)

    def lost(self) -> dict[bytes, int]:
        """Keys whose copy was lost (found corrupt by recovery), with the lost generation."""
        with self._mu:
            return dict(self._lost)

    @property
    def used_bytes(self) -> int:
        with self._mu:
            return (self.num_slots - len(self._free)) * self.block_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.block_bytes

    def close(self) -> None:
        with self._mu:
            self._closed = True
