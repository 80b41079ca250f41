"""Typed errors of the reference implementation.

Three kinds of failure (STYLE 5), and only the last two are exceptions here:

- stale, duplicated or reordered messages are normal network weather: handlers ignore them with a
  reason, they raise nothing;
- ``PeerViolation``: the *remote* peer broke the protocol -- malformed or oversized input, a bad
  or missing credential, a replayed frame, an unknown message. The process that detects it answers
  with an ``Error`` frame where it can, drops the connection and changes no state. Garbage input
  only ever produces this kind (the h11 fuzz invariant, tested in ``tests/test_wire.py``);
- ``ProtocolViolation``: *we* broke it -- sending an invalid message, sending on a failed session.
  It is a bug on our side, never caused by what a peer sent.

Besides these, operational errors a caller handles: ``TimeoutError_`` (it names what timed out)
and ``ConnectionFailed`` (could not connect, or the connection broke with requests outstanding).

Every error carries a stable ``code`` string (for ``Error`` frames, logs and reports) and a
``detail`` sentence; ``to_json()`` gives both, plus any context, for a log line.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar, TypeVar


class KvccError(Exception):
    """Base of every kvcc error. ``code`` is stable; ``detail`` is for people."""

    code: ClassVar[str] = "kvcc_error"

    def __init__(self, detail: str = "", **context: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.context = context

    def to_json(self) -> dict[str, Any]:
        return {"error": type(self).__name__, "code": self.code, "detail": self.detail, **self.context}

    def __str__(self) -> str:
        return f"{self.code}: {self.detail}" if self.detail else self.code


class ProtocolViolation(KvccError):
    """We broke the protocol: a bug on our side (an invalid message built locally, a send on a
    session that already failed). Never raised because of anything a peer sent."""

    code: ClassVar[str] = "protocol_violation"


class PeerViolation(KvccError):
    """The remote peer broke the protocol. The session that raised it is closed for good: more
    input raises again and changes nothing. ``code`` goes into the ``Error`` frame we answer with.

    ``PeerViolation(detail)`` uses the class's code; ``PeerViolation(detail, code="...")``
    overrides it for a violation without a subclass of its own."""

    code: ClassVar[str] = "peer_violation"

    def __init__(self, detail: str = "", *, code: str | None = None, **context: Any) -> None:
        super().__init__(detail, **context)
        if code is not None:
            self.code = code  # instance attribute shadows the class default


PeerViolationT = TypeVar("PeerViolationT", bound=PeerViolation)


def detached(violation: PeerViolationT) -> PeerViolationT:
    """A copy of ``violation`` with no traceback and no chained exception. A session keeps its
    failure to raise it again; the original's traceback holds the frames it was raised through,
    whose locals hold the session and the offending frame's bytes: kept, that is a reference cycle
    that pins megabytes per rejected connection until the cycle collector happens to run."""
    clone = copy.copy(violation)
    clone.__traceback__ = clone.__context__ = clone.__cause__ = None
    return clone


class Malformed(PeerViolation):
    """Bytes that are not a valid frame, envelope or message: bad CBOR, unknown kind, missing or
    extra field, wrong type, value out of range."""

    code: ClassVar[str] = "malformed"


class FrameTooLarge(PeerViolation):
    """A length header above the receiver's limit; raised before the frame is buffered."""

    code: ClassVar[str] = "frame_too_large"

    def __init__(self, detail: str = "", *, length_bytes: int = 0, limit_bytes: int = 0, **context: Any) -> None:
        super().__init__(detail, length_bytes=length_bytes, limit_bytes=limit_bytes, **context)
        self.length_bytes = length_bytes
        self.limit_bytes = limit_bytes


class Unauthorized(PeerViolation):
    """Unknown tenant, bad MAC, a tenant switch on one connection, or a namespace the tenant may
    not use."""

    code: ClassVar[str] = "unauthorized"


class Replayed(PeerViolation):
    """A frame whose sequence number is not the next one on its connection and direction:
    replayed, reordered, or with frames before it deleted."""

    code: ClassVar[str] = "replayed"


class TimeoutError_(KvccError, TimeoutError):
    """Something did not happen in time. ``what`` names it (``"Acquire request"``, ``"connect to
    127.0.0.1:7000"``); ``timeout_ms`` is the budget that ran out. Also a builtin ``TimeoutError``."""

    code: ClassVar[str] = "timeout"

    def __init__(self, what: str, timeout_ms: int, **context: Any) -> None:
        super().__init__(f"{what} did not complete within {timeout_ms} ms", what=what, timeout_ms=timeout_ms, **context)
        self.what = what
        self.timeout_ms = timeout_ms


class ConnectionFailed(KvccError):
    """No connection could be made, or it broke while requests were outstanding. ``code`` says
    why: ``"refused"`` (connect failed), ``"eof"``/``"reset"`` (the peer went away), ``"closed"``
    (we closed it), or the ``code`` of the final ``Error`` frame the peer sent (e.g.
    ``"unauthorized"``, ``"busy"``, ``"idle"``). A request that fails this way may or may not have
    reached the peer; the protocol's request numbers make a retry safe."""

    code: ClassVar[str] = "connection_failed"

    def __init__(self, detail: str = "", *, code: str = "connection_failed", **context: Any) -> None:
        super().__init__(detail, **context)
        self.code = code
