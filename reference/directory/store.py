"""The directory's embedded durable log: one SQLite database in WAL mode, synchronous=FULL.

Theory of operation
-------------------
The core (``core.DirectoryCore``) says what must be durable before a reply leaves: its
``Persist``, ``PersistTicket``, ``ForgetTicket`` and ``ReserveLeaseIds`` effects. ``commit``
writes all of one call's durable effects in *one* transaction and returns only once SQLite has
made it durable: with ``journal_mode=WAL`` and ``synchronous=FULL`` a commit fsyncs the
write-ahead log, so a crash (kill -9, power loss) after ``commit`` returned keeps it, and a crash
before loses the whole call, reply included -- nobody was told anything the log forgot.

Tables:

- ``records``: one row per key (primary key: the key's 32 bytes), the ``core.Record`` fields
  (``to_free``, the key's to-free set, as a CBOR blob: a log from before it gets the column,
  empty, when opened);
- ``tickets``: one row per remembered invalidation ticket (keys as concatenated digests);
- ``events_tail``: one row, the event-log lines of the last commit that logged any, written in
  its transaction (``commit(..., events_tail=)``; ``Loaded.events_tail``);
- ``meta``: ``lease_id_limit`` (every lease id below it may have been handed out: written
  *before* any of them is used, so a restart never reuses one), ``ticket_high_water`` (one above
  the highest ticket ever issued), ``incarnation`` (bumped by every ``load``: the event log's
  incarnation), ``schema_version``.

``load()`` reads everything back for ``DirectoryCore.restarted``. One thread at a time uses a
``DirectoryStore`` (with a commit thread, the directory server's event loop loads and the thread
commits); the directory process owns the file alone.

Rows, the checks of ``commit``'s input and of what is read back, ``Loaded`` and the typed errors
are shared with the etcd store (``durable``). Read leases are not mirrored here
(``mirror_leases`` does nothing, ``Loaded.lease_horizon_ms`` is ``None``): a restarted embedded
directory cannot compare its new monotonic clock with the old one, so it waits the full grace.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable, Sequence

from .core import (
    FIRST_LEASE_ID, FIRST_TICKET, Effect, ForgetTicket, MirrorLeases, Persist, PersistTicket, Record, Ticket,
)  # fmt: skip
from .durable import (
    RECORD_FIELDS,
    TICKET_FIELDS,
    Loaded,
    durable_effects,
    events_tail_text,
    record_from_row,
    record_row,
    ticket_from_row,
    ticket_row,
)

__all__ = ["DirectoryStore", "Loaded", "SCHEMA_VERSION"]

SCHEMA_VERSION = 1
_SYNCHRONOUS = ("FULL", "EXTRA")  # never NORMAL or OFF: a committed reply must survive power loss

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    key BLOB PRIMARY KEY,
    namespace BLOB NOT NULL,
    parent BLOB,
    phase INTEGER NOT NULL,
    gen INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    owner TEXT,
    moving_to TEXT,
    draining TEXT,
    writer TEXT,
    writer_tenant TEXT,
    write_lease INTEGER NOT NULL,
    write_lease_expires_at_ms INTEGER NOT NULL,
    committed_lease INTEGER NOT NULL,
    to_free BLOB NOT NULL DEFAULT x''
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tickets (
    ticket INTEGER PRIMARY KEY,
    keys BLOB NOT NULL,
    pending BLOB NOT NULL,
    started_at_ms INTEGER NOT NULL,
    completed_at_ms INTEGER,
    acked INTEGER NOT NULL,
    expired INTEGER NOT NULL,
    restarts INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS events_tail (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    lines TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
) WITHOUT ROWID;
"""

_RECORD_COLUMNS = RECORD_FIELDS
_TICKET_COLUMNS = TICKET_FIELDS


class ShardMismatch(ValueError):
    """The log belongs to another shard of a sharded directory, or to a deployment with another
    shard count (docs/sharding.md): its keys are that shard's chains, and serving them as this one
    would refuse or lose them. Nothing was changed."""


def shard_to_claim(stored: tuple[int, int] | None, has_state: bool, shard: int, shards: int, where: str) -> bool:
    """Whether a directory serving shard ``shard`` of ``shards`` may use a log that records
    ``stored`` (None: no shard recorded), and must record it (True) or finds it there (False).
    A log without a record but with state was written by the one directory: shard 0 of 1.
    Raises ``ShardMismatch`` for any other shard or count."""
    found = stored if stored is not None else ((0, 1) if has_state else None)
    if found is not None and found != (shard, shards):
        raise ShardMismatch(f"{where} is the log of shard {found[0]} of {found[1]}, not of shard {shard} of {shards}: "
                            "serve it as that shard, or give this one a log of its own")  # fmt: skip
    return stored is None


class DirectoryStore:
    """``DirectoryStore(path, *, synchronous="FULL")``: open (or create) the log at ``path``.
    ``commit(effects)`` makes a call's durable effects durable, ``load()`` reads the log back."""

    # The directory server commits inline (on its event loop): a local fsync is bounded, and the
    # hand-over to a commit thread cost a lone writer more than group commits gave eight (README,
    # "Commits off the event loop": 0.77x and 1.18-1.29x puts/s). It may (``commit_thread=True``).
    commits_off_loop = False

    def __init__(self, path: str | os.PathLike[str], *, synchronous: str = "FULL") -> None:
        if synchronous not in _SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {_SYNCHRONOUS}: a reply must survive power loss")
        self.path = os.fspath(path)
        # isolation_level=None: we issue BEGIN / COMMIT ourselves, one transaction per commit().
        # check_same_thread=False: callers that share one store between threads serialise its use
        # under their own lock (the conformance adapters do); the directory server uses one thread.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise OSError(f"{self.path}: SQLite refused WAL mode (got {mode!r})")
        self._db.execute(f"PRAGMA synchronous={synchronous}")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(records)")}
        if "to_free" not in columns:
            # A log from before the to-free set: every record's set is empty.
            self._db.execute("ALTER TABLE records ADD COLUMN to_free BLOB NOT NULL DEFAULT x''")
        version = self._meta("schema_version")
        if version is None:
            self._db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (SCHEMA_VERSION,))
        elif version != SCHEMA_VERSION:
            raise OSError(f"{self.path}: schema version {version}, this code reads {SCHEMA_VERSION}")

    # ------------------------------------------------------------------ reading

    def _meta(self, name: str) -> int | None:
        row = self._db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return None if row is None else int(row[0])

    @property
    def lease_id_limit(self) -> int:
        """The durable lease-id high-water mark."""
        return self._meta("lease_id_limit") or FIRST_LEASE_ID

    @property
    def incarnation(self) -> int:
        return self._meta("incarnation") or 0

    def claim_shard(self, shard: int, shards: int) -> None:
        """Record that this log is shard ``shard`` of ``shards``'s, or check that it is
        (``shard_to_claim``; raises ``ShardMismatch``, changing nothing). Before ``load``."""
        stored = None if self._meta("shards") is None else (self._meta("shard") or 0, self._meta("shards") or 0)
        has_state = (self.incarnation > 0 or self._meta("lease_id_limit") is not None
                     or self._db.execute("SELECT 1 FROM records LIMIT 1").fetchone() is not None)  # fmt: skip
        if shard_to_claim(stored, has_state, shard, shards, self.path):
            with self._transaction():
                self._set_meta("shard", shard)
                self._set_meta("shards", shards)

    def load(self) -> Loaded:
        """Everything a restart recovers, and a new incarnation (made durable before returning)."""
        records = tuple(self._record(row) for row in self._db.execute(
            f"SELECT {', '.join(_RECORD_COLUMNS)} FROM records ORDER BY key"
        ))  # fmt: skip
        tickets = tuple(self._ticket(row) for row in self._db.execute(
            f"SELECT {', '.join(_TICKET_COLUMNS)} FROM tickets ORDER BY ticket"
        ))  # fmt: skip
        # A first start: no incarnation ever loaded this log. A restart with an empty log is a
        # restart still (spec: restart_directory, its grace): the previous incarnation may have
        # been killed before it wrote anything, and the trace of a deployment shows it restarting.
        fresh = self.incarnation == 0 and not records and not tickets and self._meta("lease_id_limit") is None
        incarnation = self.incarnation + 1
        with self._transaction():
            self._set_meta("incarnation", incarnation)
        next_ticket = max([self._meta("ticket_high_water") or FIRST_TICKET, *[t.ticket + 1 for t in tickets]])
        row = self._db.execute("SELECT lines FROM events_tail WHERE id = 0").fetchone()
        tail = tuple(row[0].split("\n")) if row is not None and row[0] else ()
        return Loaded(records, self.lease_id_limit, tickets, next_ticket, incarnation, fresh, events_tail=tail)

    def _record(self, row: tuple) -> Record:
        return record_from_row(dict(zip(_RECORD_COLUMNS, row, strict=True)), f"{self.path}: record")

    def _ticket(self, row: tuple) -> Ticket:
        return ticket_from_row(dict(zip(_TICKET_COLUMNS, row, strict=True)), f"{self.path}: ticket")

    # ------------------------------------------------------------------ writing

    def _set_meta(self, name: str, value: int) -> None:
        self._db.execute(
            "INSERT INTO meta VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = excluded.value", (name, value)
        )

    def _raise_meta(self, name: str, value: int) -> None:
        """Set a high-water mark; it never goes down."""
        self._db.execute(
            "INSERT INTO meta VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = max(value, excluded.value)",
            (name, value),
        )

    def _transaction(self):
        return _Transaction(self._db)

    def commit(self, effects: Iterable[Effect], *, events_tail: Sequence[str] | None = None) -> int:
        """Make every durable effect of ``effects`` durable, in order, in one transaction; the
        others are skipped. Returns how many were written. Call it before anything of the same
        call is sent. ``events_tail``: the event-log lines of the call's steps, kept in the same
        transaction (replacing the last ones) when there are any."""
        # InvalidEffect before anything is written; leases are not mirrored here (module docstring).
        durable = [e for e in durable_effects(effects) if type(e) is not MirrorLeases]
        tail = events_tail_text(events_tail)
        if not durable:
            return 0
        with self._transaction():
            if tail:
                self._db.execute("INSERT OR REPLACE INTO events_tail VALUES (0, ?)", (tail,))
            for e in durable:
                if isinstance(e, Persist):
                    row = record_row(e.record)
                    self._db.execute(
                        f"INSERT OR REPLACE INTO records ({', '.join(_RECORD_COLUMNS)}) "
                        f"VALUES ({', '.join('?' * len(_RECORD_COLUMNS))})",
                        tuple(row[c] for c in _RECORD_COLUMNS),
                    )
                elif isinstance(e, PersistTicket):
                    trow = ticket_row(e.ticket)
                    self._db.execute(
                        f"INSERT OR REPLACE INTO tickets ({', '.join(_TICKET_COLUMNS)}) "
                        f"VALUES ({', '.join('?' * len(_TICKET_COLUMNS))})",
                        tuple(trow[c] for c in _TICKET_COLUMNS),
                    )
                    self._raise_meta("ticket_high_water", e.ticket.ticket + 1)
                elif isinstance(e, ForgetTicket):
                    self._db.execute("DELETE FROM tickets WHERE ticket = ?", (e.ticket,))
                else:
                    self._raise_meta("lease_id_limit", e.limit)
        return len(durable)

    def mirror_leases(self, remaining_ms: int) -> None:
        """Nothing: the embedded store does not mirror leases (see the module docstring)."""
        if type(remaining_ms) is not int or remaining_ms < 0:
            raise ValueError(f"remaining_ms must be an int >= 0, got {remaining_ms!r}")

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> DirectoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on an exception: all of a call's effects or none."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self._db.execute("COMMIT")
        else:
            self._db.execute("ROLLBACK")
