"""GPU-memory tier: a torch block pool, one preallocated ``torch.uint8`` tensor of N blocks.

On CUDA (the default when available) copies run on a dedicated ``torch.cuda.Stream`` with
``non_blocking=True`` and an event synchronisation before a call returns, so the caller may reuse
or read its buffer at once. Host data is staged through pinned buffers (a pool of
``staging_buffers``), which DMA requires for asynchronous copies.

Checksums are computed on the host: XXH3 has no torch kernel, so a block's bytes are staged to
pinned host memory to be checksummed. The cost:

- every ``write`` from a device tensor copies the block device->host once more (PCIe, tens of GB/s)
  to checksum it; a write from host memory checksums the staging copy it makes anyway;
- every verified ``read_into`` copies the block device->host and checksums it (XXH3, 30-60 GB/s
  per core) before anything reaches ``out`` (a device ``out`` then gets a device-to-device copy).

GPU memory is trusted (no other process writes it, and the copy engines do not corrupt data), so
``verify_reads`` may be switched off for this tier: a read is then one copy at device bandwidth.
The header (key, gen, epoch, length, sequence) is checked on every read either way. Default: on.

Without CUDA the pool lives on the CPU and the same code path runs (CI exercises it): checksums
then read the pool directly, no staging needed.
"""

from __future__ import annotations

import queue
from contextlib import contextmanager
from typing import Any

from .base import (
    FLAG_COMMITTED,
    HEADER_BYTES,
    Hit,
    Miss,
    MissReason,
    ReadOutcome,
    SlotTier,
    _Entry,
    block_checksum,
    copy_into,
    is_tensor,
    make_header,
)
from .dram import DramTier

DEFAULT_STAGING_BUFFERS = 2


class GpuTier(DramTier):
    """``num_blocks`` blocks of ``block_bytes`` in one tensor on ``device`` (default: ``cuda`` when
    available, else ``cpu``). ``read_into`` fills host buffers or tensors on any device."""

    def __init__(self, num_blocks: int, block_bytes: int, *, device: Any = None, verify_reads: bool = True,
                 split_reads: bool = False, staging_buffers: int = DEFAULT_STAGING_BUFFERS,
                 name: str = "gpu") -> None:
        import torch

        dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self._on_cuda = dev.type == "cuda"  # read on every call of _load and _store
        if dev.type == "cpu":
            # The same slot machinery on a CPU tensor: DramTier's host paths are this tier's paths.
            super().__init__(num_blocks, block_bytes, verify_reads=verify_reads, split_reads=split_reads,
                             pin_memory=False, name=name)
            return
        if dev.type != "cuda":
            raise ValueError(f"GpuTier supports cuda and cpu devices, not {dev}")
        if split_reads:
            raise ValueError("split_reads is for the CPU device (a CUDA read verifies a staging copy)")
        # DramTier.__init__ would allocate a host arena; set up the shared state by hand instead.
        SlotTier.__init__(self, name, num_blocks, block_bytes)
        self._torch = torch
        self.verify_reads = verify_reads
        self.pinned = True
        self._arena = torch.empty(num_blocks * block_bytes, dtype=torch.uint8, device=dev)
        self._host = None
        self._helper = None
        self._headers = bytearray(num_blocks * HEADER_BYTES)
        self._init_read_cache()
        self._stream = torch.cuda.Stream(dev)
        self._staging: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(max(1, staging_buffers)):
            t = torch.empty(block_bytes, dtype=torch.uint8, pin_memory=True)
            self._staging.put((t, memoryview(t.numpy()).cast("B")))  # type: ignore[arg-type]

    @property
    def on_cuda(self) -> bool:
        return self._on_cuda

    @contextmanager
    def _stage(self):
        item = self._staging.get()  # blocks while every staging buffer is in use
        try:
            yield item
        finally:
            self._staging.put(item)

    def _sync(self) -> None:
        done = self._torch.cuda.Event()
        done.record(self._stream)
        done.synchronize()

    def _store(self, slot: int, key: bytes, gen: int, epoch: int, seq: int, src: Any, n: int) -> int:
        if not self._on_cuda:
            return DramTier._store(self, slot, key, gen, epoch, seq, src, n)
        torch = self._torch
        a = slot * self.block_bytes
        dst = self._arena[a:a + n]
        self._checked_slots[slot] = None  # a free slot has none; made sure before it is reused
        with self._stage() as (stage, stage_mv):
            if is_tensor(src):
                if src.device.type == "cuda":
                    self._stream.wait_stream(torch.cuda.current_stream(src.device))
                with torch.cuda.stream(self._stream):
                    dst.copy_(src, non_blocking=True)
                    stage[:n].copy_(dst, non_blocking=True)  # back to the host, to checksum
                self._sync()
                crc_over = stage_mv[:n]
            else:
                copy_into(stage_mv, src, n)
                with torch.cuda.stream(self._stream):
                    dst.copy_(stage[:n], non_blocking=True)
                crc_over = stage_mv[:n]  # checksum while the DMA runs; both only read the buffer
            header = make_header(FLAG_COMMITTED, key, gen, epoch, seq, crc_over, n)
            self._sync()
        self._header_at(slot)[:] = header.pack()
        return header.block_crc

    def _load(self, entry: _Entry, sink: Any) -> ReadOutcome:
        if not self._on_cuda:
            return DramTier._load(self, entry, sink)
        torch = self._torch
        n, a = entry.length, entry.slot * self.block_bytes
        if self._checked(entry) is None:  # the header, checked in full once per block (DramTier)
            return Miss(MissReason.CORRUPT)
        src = self._arena[a:a + n]
        if self.verify_reads:
            with self._stage() as (stage, stage_mv):
                with torch.cuda.stream(self._stream):
                    stage[:n].copy_(src, non_blocking=True)
                self._sync()
                if block_checksum(entry.key, entry.gen, entry.epoch, n, entry.seq, stage_mv[:n]) != entry.crc:
                    return Miss(MissReason.CORRUPT)
                if not is_tensor(sink):
                    copy_into(sink, stage_mv, n)
                    return Hit(n)
        if is_tensor(sink):
            dst = sink[:n]
            if dst.device.type == "cuda":
                # Work the caller queued on ``out`` (a kernel still reading it) comes first.
                self._stream.wait_stream(torch.cuda.current_stream(dst.device))
        else:
            import numpy as np

            dst = torch.from_numpy(np.frombuffer(sink, dtype=np.uint8, count=n))
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
        self._sync()
        return Hit(n)
