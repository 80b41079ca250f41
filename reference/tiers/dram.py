"""Host-memory tier: one preallocated arena split into fixed-size slots.

The arena is a ``torch.uint8`` tensor, pinned (page-locked) when CUDA is available so that copies
to and from GPU tensors run as DMA, else plain host memory. Each slot's header (key, gen, epoch,
length, publish sequence, block checksum) lives in a separate header table next to the arena, in
the same format the NVMe tier writes to disk; a read checks the header against the index and the
payload against the checksum before it hands the caller's buffer back as a hit.

A write copies the block into its (not yet published) slot piece by piece and hashes each piece
right after copying it (``base.copy_checksum``), so the bytes come from memory once. A verified
read into host memory hashes each piece of the slot and then copies it from cache
(``base.verified_copy_pieces``, as ``base.verified_copy`` does), so it too reads the block from
memory once; the block checksum is checked after the last piece, and on a mismatch the bytes
copied are zeroed before the miss is answered (the contract leaves ``out`` unspecified on a miss;
here it never holds a byte of a block that failed verification). A block of one piece, and a
read into a device tensor, is verified before its first byte is copied, so ``out`` is untouched
on those misses. Hashing the whole block and then copying it read a block larger than the cache
from memory twice: 0.70-0.76 of a memcpy at 1-16 MiB against 0.82-0.93 piece by piece (README,
"Tier bandwidth").

What a read does besides hashing and copying is kept short, since at 1 MiB it is a large part of
the cost (the copy has just evicted the interpreter's data from the CPU caches, so each Python
step costs several times what it does in a loop): 29 us a read of 1 MiB before, 9 us now. Two
things are cached, both checked on every use:

- per slot (``_checked``), what the full check of its block's header found: the header bytes that
  passed, the packed identity the block checksum covers, views of the slot's pieces. A read reuses
  them only for the same block (the same index entry) and only while the slot's header bytes are,
  byte for byte, the ones that passed (an 84-byte compare instead of decoding them and checking
  their CRC and fields): damage, an erase or a rewrite changes those bytes, and then the header is
  checked in full again. So the cache never vouches for bytes it has not seen: the header is read
  on every read, and every piece of the payload is hashed on every read, as before. Writes and
  erases drop the slot's entry as well (the compare alone would catch them); ``damage`` does not,
  as a failing memory would not tell the tier (the conformance kit reads blocks before damaging
  them, so the compare is what it tests). A slot is only rewritten once it is free, i.e. once no
  reader has its block pinned.
- the numpy view of the last CPU tensor given as ``out`` (``_Sinks``; ``Tensor.numpy`` is most of
  the cost of taking a tensor), reused for the same tensor while its data pointer, size, dtype and
  contiguity are unchanged, so that it always covers the tensor's memory as it is now; dropped
  when the caller's tensor is (the view would keep its memory alive).

Nothing here survives the process: a restarted node starts with an empty tier and takes its fences
back from the directory (``restore_fences``), as the spec's ``_crash`` with ``lose_disk`` says.

``verify_reads`` (default on) may be switched off for this tier: the arena is private memory of
this process, trusted like GPU memory; the write-time checksum is kept either way. Verification
is what a read costs beyond a memcpy (XXH3 at 30-60 GB/s against a memcpy at 10-25 GB/s, one
core each); ``bench/tiers.py`` measures both.

``split_reads`` (default off) gives the tier one helper thread for verified reads of at least
``SPLIT_READ_BYTES`` into host buffers: the block's pieces are hashed in two halves, one maybe
on the helper (``base.HalfHelper``, which never makes a read wait for a half that has not
started), the checksum is checked, and then the two halves are copied the same way. The order is
the unsplit one's, so ``out`` is untouched on a miss. It can pay only where a second core is
idle and waking a thread is cheap next to hashing and copying the block (hence blocks from
4 MiB); on a machine whose cores are busy it gains nothing and costs a thread wake-up per read
(README, "Tier bandwidth", has the figures). Off by default.
"""

from __future__ import annotations

import weakref
from typing import Any

from .base import (
    CHECKSUM_PIECE_BYTES,
    FLAG_COMMITTED,
    HEADER_BYTES,
    HalfHelper,
    Header,
    Hit,
    Miss,
    MissReason,
    ReadOutcome,
    SlotTier,
    _Entry,
    block_checksum,
    check_key,
    combine_digests,
    copy_checksum,
    copy_into,
    decode_header,
    digests_struct,
    identity_bytes,
    is_tensor,
    make_header,
    piece_digests,
    prepare_sink,
    source_bytes,
    source_pieces,
    verified_copy_pieces,
)

# With ``split_reads``, a verified read of at least this many bytes is split (see the docstring).
SPLIT_READ_BYTES = 8 * CHECKSUM_PIECE_BYTES


class _Checked:
    """What a read of one published block may reuse (``DramTier._checked``): the header bytes it
    verified, the packed identity its checksum covers and the packer of its piece digests (the
    block checksum is ``XXH3-64(identity + pack(*digests))``, as ``combine_digests`` makes it),
    the shared ``Hit``, and views of its slot's pieces (``base.source_pieces``; None when the
    arena is not in host memory). Valid for ``entry`` only, and only as long as the slot's header
    still holds exactly ``header``: every read compares them."""

    __slots__ = ("entry", "header", "identity", "pack", "hit", "pieces")

    def __init__(self, entry: _Entry, header: bytes, pieces: Any) -> None:
        self.entry = entry
        self.header = header
        self.identity = identity_bytes(entry.key, entry.gen, entry.epoch, entry.length, entry.seq)
        self.pack = digests_struct(-(-entry.length // CHECKSUM_PIECE_BYTES)).pack
        self.hit = Hit(entry.length)
        self.pieces = pieces


class _Sinks:
    """What ``DramTier._prepare_sink`` does (buffer plumbing, as ``base.prepare_sink``): a flat
    ``numpy.uint8`` array for a host ``out`` (the copies are numpy's), or a flat device tensor.

    A contiguous CPU uint8 tensor, the usual ``out``, takes a short path, and the same tensor again
    (a caller reading into one buffer) reuses the numpy view made for it (``Tensor.numpy`` is most
    of the short path's cost) if its memory is still where the view points: same data pointer and
    size, still uint8 and contiguous (``set_``, ``resize_``, ``as_strided_`` or ``.data =`` can
    change any of them in place; a CPU data pointer names the device too). The view keeps the
    tensor's memory alive, so it is dropped when the caller's tensor goes. Anything else goes
    through ``base.prepare_sink`` and its checks and errors."""

    __slots__ = ("_np", "_tensor", "_u8", "last", "__weakref__")

    def __init__(self, torch: Any, np: Any) -> None:
        self._np, self._tensor, self._u8 = np, torch.Tensor, torch.uint8
        # The last CPU tensor taken: (weak reference to it, data pointer, size, numpy view).
        self.last: tuple[Any, int, int, Any] | None = None

    def prepare(self, out: Any) -> tuple[Any, int]:
        last = self.last
        if (last is not None and last[0]() is out and out.data_ptr() == last[1] and out.numel() == last[2]
                and out.dtype is self._u8 and out.is_contiguous()):
            return last[3], last[2]
        if type(out) is self._tensor and out.is_cpu and out.dtype is self._u8 and out.is_contiguous():
            arr = out.numpy()
            arr = arr if arr.ndim == 1 else arr.reshape(-1)
            self.last = (weakref.ref(out, self._dropper()), out.data_ptr(), arr.size, arr)
            return arr, arr.size
        sink, room = prepare_sink(out)
        return (sink if is_tensor(sink) else self._np.frombuffer(sink, dtype=self._np.uint8)), room

    def _dropper(self) -> Any:
        sinks = weakref.ref(self)  # the callback keeps neither this nor the tier alive

        def drop(ref: Any) -> None:
            s = sinks()
            if s is not None and s.last is not None and s.last[0] is ref:
                s.last = None

        return drop


class DramTier(SlotTier):
    """``num_blocks`` slots of ``block_bytes`` each in one host-memory arena.

    ``write`` takes host buffers or tensors (a device tensor is copied straight into the arena);
    ``read_into`` fills host buffers or tensors on any device.
    """

    def __init__(self, num_blocks: int, block_bytes: int, *, verify_reads: bool = True,
                 split_reads: bool = False, pin_memory: bool | None = None, name: str = "dram") -> None:
        import torch

        super().__init__(name, num_blocks, block_bytes)
        self._torch = torch
        self.verify_reads = verify_reads
        self._helper = HalfHelper(f"kvcc-{name}-read") if split_reads else None
        self.pinned = torch.cuda.is_available() if pin_memory is None else pin_memory
        if self.pinned:
            self._arena = torch.empty(num_blocks * block_bytes, dtype=torch.uint8, pin_memory=True)
        else:
            import numpy as np

            # numpy asks for transparent huge pages on large arrays (torch's allocator does not):
            # copies in and out of the arena run ~20% faster where THP is in "madvise" mode.
            self._arena = torch.from_numpy(np.empty(num_blocks * block_bytes, dtype=np.uint8))
        self._host: memoryview | None = memoryview(self._arena.numpy()).cast("B")  # type: ignore[arg-type]
        self._headers = bytearray(num_blocks * HEADER_BYTES)
        self._init_read_cache()

    def _init_read_cache(self) -> None:
        import numpy as np

        # slot -> what the last full header check of its block left for the next read (``_checked``)
        self._checked_slots: list[_Checked | None] = [None] * self.num_slots
        self._sinks = _Sinks(self._torch, np)

    # Device tensors are moved with torch copies; everything else through host views.

    def _prepare_source(self, data: Any) -> tuple[Any, int]:
        if is_tensor(data) and data.device.type != "cpu":
            if data.dtype != self._torch.uint8 or not data.is_contiguous():
                raise TypeError("data tensor must be a contiguous torch.uint8 tensor")
            t = data.reshape(-1)
            return t, t.numel()
        src = source_bytes(data)
        return src, src.nbytes

    def _prepare_sink(self, out: Any) -> tuple[Any, int]:
        return self._sinks.prepare(out)

    def _header_at(self, slot: int) -> memoryview:
        return memoryview(self._headers)[slot * HEADER_BYTES:(slot + 1) * HEADER_BYTES]

    def _store(self, slot: int, key: bytes, gen: int, epoch: int, seq: int, src: Any, n: int) -> int:
        a = slot * self.block_bytes
        assert self._host is not None  # the arena is in host memory on this path
        dst = self._host[a:a + n]
        self._checked_slots[slot] = None  # a free slot has none; made sure before it is reused
        # The checksum covers the bytes as stored, so a read verifies what the arena holds.
        if is_tensor(src):
            self._arena[a:a + n].copy_(src)  # device -> host copy, synchronous
            header = make_header(FLAG_COMMITTED, key, gen, epoch, seq, dst, n)
        else:
            header = Header(FLAG_COMMITTED, key, gen, epoch, n, seq, copy_checksum(dst, src, n, key, gen, epoch, seq))
        self._header_at(slot)[:] = header.pack()
        return header.block_crc

    def _check_header(self, entry: _Entry, raw: bytes) -> bool:
        """Whether ``raw`` (a slot's header bytes) is a valid committed header of exactly
        ``entry``'s block."""
        header, _ = decode_header(raw)
        return (header is not None and header.flags == FLAG_COMMITTED and header.block_crc == entry.crc
                and header.same_block(entry.key, entry.gen, entry.epoch, entry.length, entry.seq))

    def _checked(self, entry: _Entry) -> _Checked | None:
        """Check the slot's header against ``entry``; None if it fails. The header bytes are read
        on every call: when they equal, byte for byte, the bytes a full check of this very entry
        passed before, they pass again (the check is a function of those bytes and the entry), so
        only the first read of a block decodes them and checks their CRC and fields
        (``_check_header``). Any change to them (damage, an erase, a rewrite of the slot) makes
        them differ: a full check again."""
        slot = entry.slot
        done = self._checked_slots[slot]
        at = slot * HEADER_BYTES
        if done is not None and done.entry is entry and self._headers[at:at + HEADER_BYTES] == done.header:
            return done
        raw = bytes(self._headers[at:at + HEADER_BYTES])  # what is checked is what is kept
        if not self._check_header(entry, raw):
            return None
        a = slot * self.block_bytes
        done = _Checked(entry, raw, None if self._host is None else source_pieces(self._host[a:a + entry.length],
                                                                                  entry.length))
        self._checked_slots[slot] = done
        return done

    def _load(self, entry: _Entry, sink: Any) -> ReadOutcome:
        n, a = entry.length, entry.slot * self.block_bytes
        checked = self._checked(entry)
        if checked is None:
            return Miss(MissReason.CORRUPT)
        assert self._host is not None
        if self._helper is not None and self.verify_reads and n >= SPLIT_READ_BYTES and not is_tensor(sink):
            return self._load_split(entry, self._host[a:a + n], sink)
        if self.verify_reads and not is_tensor(sink):
            # Each piece hashed, then copied from cache, over the slot's cached piece views
            # (``verified_copy_pieces``, as ``verified_copy``); a block of one piece is verified
            # before its copy, which costs the same.
            ok = verified_copy_pieces(sink, checked.pieces, checked.identity, checked.pack, entry.crc)
            return checked.hit if ok else Miss(MissReason.CORRUPT)
        src = self._host[a:a + n]
        if self.verify_reads and block_checksum(entry.key, entry.gen, entry.epoch, n, entry.seq, src) != entry.crc:
            return Miss(MissReason.CORRUPT)
        if is_tensor(sink):
            sink[:n].copy_(self._arena[a:a + n], non_blocking=self.pinned)
            if self.pinned:
                self._torch.cuda.current_stream(sink.device).synchronize()
        else:
            copy_into(sink, src, n)
        return Hit(n)

    def _load_split(self, entry: _Entry, src: memoryview, sink: Any) -> ReadOutcome:
        """A verified read in two halves, one maybe on the helper thread: both halves' pieces are
        hashed, the block checksum is checked, and only then are both halves copied. Nothing
        reaches ``sink`` before every piece has been verified, so on a miss it is untouched."""
        assert self._helper is not None
        n = entry.length
        mid = n // CHECKSUM_PIECE_BYTES // 2 * CHECKSUM_PIECE_BYTES  # on a piece boundary
        first, second = self._helper.run(lambda: piece_digests(src[:mid], mid),
                                         lambda: piece_digests(src[mid:], n - mid))
        if combine_digests(entry.key, entry.gen, entry.epoch, n, entry.seq, first + second) != entry.crc:
            return Miss(MissReason.CORRUPT)
        self._helper.run(lambda: copy_into(sink[:mid], src[:mid], mid),
                         lambda: copy_into(sink[mid:n], src[mid:], n - mid))
        return Hit(n)

    def _erase(self, entry: _Entry, fence: int) -> None:
        self._checked_slots[entry.slot] = None
        self._header_at(entry.slot)[:] = bytes(HEADER_BYTES)

    def damage(self, key: bytes, region: str, offset: int) -> bool:
        """Fault injection for tests (the conformance kit's ``corrupt``): invert one byte of the
        block of ``key`` in the arena -- of its payload (``region="payload"``) or of its header
        (``"header"``), at ``offset`` modulo that region's length -- as a failing memory would,
        without touching the index. Returns False when no block of ``key`` is here."""
        if region not in ("payload", "header"):
            raise ValueError(f"region is payload or header, got {region!r}")
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        with self._mu:
            self._check_open()
            entry = self._by_key.get(check_key(key))
            if entry is None:
                return False
            if region == "header" or entry.length == 0:
                view, at = self._header_at(entry.slot), offset % HEADER_BYTES
            else:
                assert self._host is not None
                view, at = self._host, entry.slot * self.block_bytes + offset % entry.length
            view[at] ^= 0xFF  # the tier is not told, as it is not by a failing memory: reads must find it
            return True

    def close(self) -> None:
        super().close()
        if self._helper is not None:
            self._helper.close()
