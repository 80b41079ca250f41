"""Frames: ``[4-byte big-endian length][payload]``, in and out, under a size limit. No I/O.

``FrameDecoder`` takes bytes in any chunking and returns whole payloads; a length header above its
limit raises ``FrameTooLarge`` before a byte of that frame is buffered. The receiver chooses the
limit: ``MAX_FRAME_BYTES`` for connections that carry block bytes, ``MAX_CONTROL_FRAME_BYTES`` for
those that carry only control messages.
"""

from __future__ import annotations

import struct

from ..errors import FrameTooLarge, Malformed, PeerViolation, ProtocolViolation, detached
from .limits import FRAME_HEADER_BYTES, MAX_FRAME_BYTES

_LENGTH = struct.Struct(">I")


def encode_frame(payload: bytes, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """``[4-byte big-endian length][payload]``; a payload over the limit is our bug."""
    if not 0 < len(payload) <= max_frame_bytes:
        raise ProtocolViolation(f"frame payload of {len(payload)} bytes outside 1..{max_frame_bytes}")
    return _LENGTH.pack(len(payload)) + payload


class FrameDecoder:
    """Whole frame payloads out of bytes in any chunking. Holds at most one partial frame, and
    never more than ``max_frame_bytes`` of it: an oversized length header raises
    ``FrameTooLarge`` as soon as its 4 bytes are in, before the frame's payload is accumulated
    (at most the chunk that carried the header is ever held).

    ``add(data)`` then ``next_frame()`` until it returns None: frames come out one at a time, so a
    violation is reported where it is in the stream (``Session`` uses this). ``feed(data)`` does
    both and returns every whole frame, raising at the first violation."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        assert 0 < max_frame_bytes < 2**32
        self.max_frame_bytes = max_frame_bytes  # may be raised between frames (``Session``: once authenticated)
        self._buffer = bytearray()
        self._pos = 0  # start of the unread part of _buffer
        self._failure: PeerViolation | None = None

    @property
    def buffered_bytes(self) -> int:
        return len(self._buffer) - self._pos

    @property
    def pending_frame_bytes(self) -> int | None:
        """The announced length of the frame partly received (0 while its length header is not
        whole yet), or None when nothing is buffered."""
        left = len(self._buffer) - self._pos
        if left == 0:
            return None
        if left < FRAME_HEADER_BYTES:
            return 0
        return _LENGTH.unpack_from(self._buffer, self._pos)[0]

    def add(self, data: bytes) -> None:
        if self._failure is not None:
            raise detached(self._failure)
        self._buffer += data

    def next_frame(self) -> bytes | None:
        if self._failure is not None:
            raise detached(self._failure)
        buf, pos = self._buffer, self._pos
        if len(buf) - pos < FRAME_HEADER_BYTES:
            self._compact()
            return None
        (length,) = _LENGTH.unpack_from(buf, pos)
        if length > self.max_frame_bytes:
            self._fail(FrameTooLarge(
                f"frame of {length} bytes announced, the limit is {self.max_frame_bytes}",
                length_bytes=length, limit_bytes=self.max_frame_bytes,
            ))  # fmt: skip
        if length == 0:
            self._fail(Malformed("empty frame"))
        start = pos + FRAME_HEADER_BYTES
        if len(buf) - start < length:
            self._compact()
            return None
        self._pos = start + length
        return bytes(buf[start : start + length])

    def feed(self, data: bytes) -> list[bytes]:
        self.add(data)
        frames = []
        while (frame := self.next_frame()) is not None:
            frames.append(frame)
        return frames

    def _compact(self) -> None:
        if self._pos:
            del self._buffer[: self._pos]
            self._pos = 0

    def discard(self) -> None:
        """Let go of everything buffered (the connection failed: nothing more of it is read)."""
        self._buffer = bytearray()
        self._pos = 0

    def _fail(self, violation: PeerViolation) -> None:
        # Kept, and raised, as copies: the one raised carries this frame (which holds ``violation``),
        # so raising ``violation`` itself would make a cycle that pins the decoder until a collection.
        self._failure = detached(violation)
        self.discard()  # nothing more of this connection is kept
        raise detached(violation)
