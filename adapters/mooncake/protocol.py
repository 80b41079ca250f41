"""The tiny request/response protocol between the harness and a store-node worker process.

Theory of operation
-------------------
A store node (``kvcc.adapters.mooncake.worker``) is a Mooncake Store client in its own process,
so that it can be killed (SIGKILL), paused (SIGSTOP) and restarted like a real serving node. The
harness (``kvcc.adapters.mooncake.harness.StoreNode``) talks to it over two inherited pipes, one
per direction. Each message is one frame::

    u32 header_len | u32 payload_len | header (UTF-8 JSON object) | payload (raw bytes)

big-endian, both lengths capped by named limits so that a torn or garbage frame is a typed
``FrameError`` and never an unbounded read. The header of a request is ``{"id", "op", "args"}``;
the header of a reply is ``{"id", "ok", "result"}`` or ``{"id", "ok": false, "error"}``. Values
(what ``put`` stores, what ``get`` returns) travel as the payload, never inside JSON.

Request ids are what makes timeouts safe: the harness gives up on a request after its timeout
and later drops the reply that still carries that id, so a slow reply can never be taken for the
answer to a newer request. Id 0 is the worker's one unsolicited frame, ``ready``, sent once after
the store client is set up.

Standard library only: the worker imports this before it imports the store.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

HEADER_MAX_BYTES = 64 << 10  # one JSON header (keys, regex patterns, small results)
PAYLOAD_MAX_BYTES = 256 << 20  # one value; far above any block the suite writes
READY_ID = 0  # the worker's unsolicited "ready" frame

_PREFIX = struct.Struct(">II")


class FrameError(Exception):
    """A frame that is not one: a length over its limit, a header that is not a JSON object, or
    a stream that ended inside a frame."""


class PipeClosed(FrameError):
    """The other end closed the pipe at a frame boundary (the process exited or was killed)."""


def encode(header: dict[str, Any], payload: bytes = b"") -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    if len(head) > HEADER_MAX_BYTES:
        raise FrameError(f"header of {len(head)} bytes is over {HEADER_MAX_BYTES}")
    if len(payload) > PAYLOAD_MAX_BYTES:
        raise FrameError(f"payload of {len(payload)} bytes is over {PAYLOAD_MAX_BYTES}")
    return _PREFIX.pack(len(head), len(payload)) + head + bytes(payload)


def _read_exact(fd: int, n: int, at_boundary: bool) -> bytes:
    chunks: list[bytes] = []
    left = n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            if at_boundary and left == n:
                raise PipeClosed("pipe closed")
            raise FrameError(f"pipe closed inside a frame ({n - left} of {n} bytes read)")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> tuple[dict[str, Any], bytes]:
    """One frame from ``fd`` (blocking). Raises ``PipeClosed`` at a clean end, ``FrameError``
    for anything else that is not a frame."""
    head_len, payload_len = _PREFIX.unpack(_read_exact(fd, _PREFIX.size, at_boundary=True))
    if head_len > HEADER_MAX_BYTES:
        raise FrameError(f"header length {head_len} over {HEADER_MAX_BYTES}")
    if payload_len > PAYLOAD_MAX_BYTES:
        raise FrameError(f"payload length {payload_len} over {PAYLOAD_MAX_BYTES}")
    try:
        header = json.loads(_read_exact(fd, head_len, at_boundary=False))
    except (UnicodeDecodeError, ValueError) as e:
        raise FrameError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("id"), int):
        raise FrameError("header is not a JSON object with an integer id")
    payload = _read_exact(fd, payload_len, at_boundary=False) if payload_len else b""
    return header, payload


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
