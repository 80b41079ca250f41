"""Host-memory tier: one preallocated arena split into fixed-size slots.

The arena is a ``torch.uint8`` tensor, pinned (page-locked) when CUDA is available so that copies
to and from GPU tensors run as DMA, else plain host memory. Each slot's header (key, gen, epoch,
length, publish sequence, block checksum) lives in a separate header table next to the arena, in
the same format the NVMe tier writes to disk; a read checks the header against the index and the
payload against the checksum before it hands the caller's buffer back as a hit.

A write copies the block into its (not yet published) slot piece by piece and hashes each piece
right after copying it (``base.copy_checksum``), so the bytes come from memory once. A verified
read into host memory hashes each piece of the slot and then copies it from cache
(``base.hash_copy_pieces``), so it too reads the block from memory once; the block checksum is
checked after the last piece, and on a mismatch the bytes copied are zeroed before the miss is
answered (the contract leaves ``out`` unspecified on a miss; here it never holds a byte of a
block that failed verification). A block of one piece, and a read into a device tensor, is
verified before its first byte is copied, so ``out`` is untouched on those misses. Hashing the
whole block and then copying it read a block larger than the cache from memory twice: 0.70-0.76
of a memcpy at 1-16 MiB against 0.82-0.93 piece by piece (README, "Tier bandwidth").

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
    is_tensor,
    make_header,
    piece_digests,
    source_bytes,
    verified_copy,
)

# With ``split_reads``, a verified read of at least this many bytes is split (see the docstring).
SPLIT_READ_BYTES = 8 * CHECKSUM_PIECE_BYTES


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

    # Device tensors are moved with torch copies; everything else through host views.

    def _prepare_source(self, data: Any) -> tuple[Any, int]:
        if is_tensor(data) and data.device.type != "cpu":
            if data.dtype != self._torch.uint8 or not data.is_contiguous():
                raise TypeError("data tensor must be a contiguous torch.uint8 tensor")
            t = data.reshape(-1)
            return t, t.numel()
        src = source_bytes(data)
        return src, src.nbytes

    def _header_at(self, slot: int) -> memoryview:
        return memoryview(self._headers)[slot * HEADER_BYTES:(slot + 1) * HEADER_BYTES]

    def _store(self, slot: int, key: bytes, gen: int, epoch: int, seq: int, src: Any, n: int) -> int:
        a = slot * self.block_bytes
        assert self._host is not None  # the arena is in host memory on this path
        dst = self._host[a:a + n]
        # The checksum covers the bytes as stored, so a read verifies what the arena holds.
        if is_tensor(src):
            self._arena[a:a + n].copy_(src)  # device -> host copy, synchronous
            header = make_header(FLAG_COMMITTED, key, gen, epoch, seq, dst, n)
        else:
            header = Header(FLAG_COMMITTED, key, gen, epoch, n, seq, copy_checksum(dst, src, n, key, gen, epoch, seq))
        self._header_at(slot)[:] = header.pack()
        return header.block_crc

    def _check_header(self, entry: _Entry) -> bool:
        header, _ = decode_header(self._header_at(entry.slot))
        return (header is not None and header.flags == FLAG_COMMITTED and header.block_crc == entry.crc
                and header.same_block(entry.key, entry.gen, entry.epoch, entry.length, entry.seq))

    def _load(self, entry: _Entry, sink: Any) -> ReadOutcome:
        n, a = entry.length, entry.slot * self.block_bytes
        if not self._check_header(entry):
            return Miss(MissReason.CORRUPT)
        assert self._host is not None
        src = self._host[a:a + n]
        if self._helper is not None and self.verify_reads and n >= SPLIT_READ_BYTES and not is_tensor(sink):
            return self._load_split(entry, src, sink)
        if self.verify_reads and not is_tensor(sink):
            # Each piece hashed, then copied from cache (``verified_copy``); a block of one piece
            # is verified before its copy, which costs the same.
            ok = verified_copy(sink, src, n, entry.key, entry.gen, entry.epoch, entry.seq, entry.crc)
            return Hit(n) if ok else Miss(MissReason.CORRUPT)
        if self.verify_reads and block_checksum(entry.key, entry.gen, entry.epoch, n, entry.seq, src) != entry.crc:
            return Miss(MissReason.CORRUPT)
        if is_tensor(sink):
            sink[:n].copy_(self._arena[a:a + n], non_blocking=self.pinned)
            if self.pinned:
                self._torch.cuda.current_stream(sink.device).synchronize()
        else:
            copy_into(sink, src, n)
        return Hit(n)

    def _load_split(self, entry: _Entry, src: memoryview, sink: memoryview) -> ReadOutcome:
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
            view[at] ^= 0xFF
            return True

    def close(self) -> None:
        super().close()
        if self._helper is not None:
            self._helper.close()
