"""Writes held until their commit, for the raw adapters over stores whose put is the commit
(``mooncake-raw``, ``hicache-file``, ``lmcache-raw``).

Such a store has no write in progress: the contract's ``begin_write`` / ``write_bytes`` /
``commit`` become a grant the adapter invents, bytes the adapter holds, and the store's one put at
``commit``. ``BufferedWrites`` is that bookkeeping, one table for the three: a grant maps to the
store's handle for the block (its key, or what the put needs) and to the bytes once written. A
grant this writer did not issue, or one already committed or aborted, is refused
``unknown_lease``; a commit before any bytes, ``not_committed``. Nothing reaches the store here.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from kvcc.conformance.contract import Refused, Stored, WriteGrant
from kvcc.spec.vocabulary import REASON_NOT_COMMITTED, REASON_UNKNOWN_LEASE

H = TypeVar("H")


class BufferedWrites(Generic[H]):
    """lease -> (grant, the store's handle for its block, the bytes once ``store``d); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writes: dict[int, tuple[WriteGrant, H, bytes | None]] = {}

    def open(self, grant: WriteGrant, handle: H) -> WriteGrant:
        """Hold ``grant`` (just issued) with ``handle``, no bytes yet; return it."""
        with self._lock:
            self._writes[grant.lease] = (grant, handle, None)
        return grant

    def store(self, grant: WriteGrant, data: bytes) -> Stored | Refused:
        """``write_bytes``: keep a copy of ``data`` under ``grant``."""
        with self._lock:
            entry = self._writes.get(grant.lease)
            if entry is None or entry[0] != grant:
                return Refused(REASON_UNKNOWN_LEASE, "no such write in this writer")
            self._writes[grant.lease] = (grant, entry[1], bytes(data))
        return Stored()

    def pending(self, grant: WriteGrant) -> tuple[H, bytes] | Refused:
        """What ``commit`` puts: the handle and the bytes, still held until ``close``."""
        with self._lock:
            entry = self._writes.get(grant.lease)
        if entry is None or entry[0] != grant:
            return Refused(REASON_UNKNOWN_LEASE, "no such write in this writer")
        if entry[2] is None:
            return Refused(REASON_NOT_COMMITTED, "no bytes were written under this grant")
        return entry[1], entry[2]

    def close(self, grant: WriteGrant) -> None:
        """The write is over (committed, or aborted): forget it."""
        with self._lock:
            self._writes.pop(grant.lease, None)

    def handle(self, lease: int) -> H | None:
        """The handle of write ``lease``, if this writer holds it."""
        with self._lock:
            entry = self._writes.get(lease)
        return None if entry is None else entry[1]
