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

- ``records``: one row per key (primary key: the key's 32 bytes), the ``core.Record`` fields;
- ``tickets``: one row per remembered invalidation ticket (keys as concatenated digests);
- ``meta``: ``lease_id_limit`` (every lease id below it may have been handed out: written
  *before* any of them is used, so a restart never reuses one), ``ticket_high_water`` (one above
  the highest ticket ever issued), ``incarnation`` (bumped by every ``load``: the event log's
  incarnation), ``schema_version``.

``load()`` reads everything back for ``DirectoryCore.restarted``. One ``DirectoryStore`` belongs
to one thread (SQLite's default); the directory process owns the file alone.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable

from attrs import frozen

from kvcc.spec.keys import DIGEST_BYTES, BlockKey, LocationId, NamespaceDigest, NodeId

from .core import (
    DURABLE_EFFECTS,
    FIRST_LEASE_ID,
    FIRST_TICKET,
    Effect,
    ForgetTicket,
    Persist,
    PersistTicket,
    Record,
    ReserveLeaseIds,
    Ticket,
)

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
    committed_lease INTEGER NOT NULL
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
CREATE TABLE IF NOT EXISTS meta (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
) WITHOUT ROWID;
"""

_RECORD_COLUMNS = (
    "key", "namespace", "parent", "phase", "gen", "epoch", "owner", "moving_to", "draining", "writer",
    "writer_tenant", "write_lease", "write_lease_expires_at_ms", "committed_lease",
)  # fmt: skip
_TICKET_COLUMNS = ("ticket", "keys", "pending", "started_at_ms", "completed_at_ms", "acked", "expired", "restarts")


@frozen
class Loaded:
    """What a restart recovers: ``DirectoryCore.restarted(records, next_lease_id, now_ms,
    tickets, next_ticket)``. ``fresh``: the log was empty (a first start)."""

    records: tuple[Record, ...]
    next_lease_id: int
    tickets: tuple[Ticket, ...]
    next_ticket: int
    incarnation: int
    fresh: bool


def _keys_blob(keys: Iterable[BlockKey]) -> bytes:
    return b"".join(k.digest for k in sorted(keys))


def _keys_from_blob(blob: bytes) -> tuple[BlockKey, ...]:
    assert len(blob) % DIGEST_BYTES == 0
    return tuple(BlockKey(blob[i : i + DIGEST_BYTES]) for i in range(0, len(blob), DIGEST_BYTES))


class DirectoryStore:
    """``DirectoryStore(path, *, synchronous="FULL")``: open (or create) the log at ``path``.
    ``commit(effects)`` makes a call's durable effects durable, ``load()`` reads the log back."""

    def __init__(self, path: str | os.PathLike[str], *, synchronous: str = "FULL") -> None:
        if synchronous not in _SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {_SYNCHRONOUS}: a reply must survive power loss")
        self.path = os.fspath(path)
        # isolation_level=None: we issue BEGIN / COMMIT ourselves, one transaction per commit().
        self._db = sqlite3.connect(self.path, isolation_level=None)
        mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise OSError(f"{self.path}: SQLite refused WAL mode (got {mode!r})")
        self._db.execute(f"PRAGMA synchronous={synchronous}")
        self._db.executescript(_SCHEMA)
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

    def load(self) -> Loaded:
        """Everything a restart recovers, and a new incarnation (made durable before returning)."""
        records = tuple(self._record(row) for row in self._db.execute(
            f"SELECT {', '.join(_RECORD_COLUMNS)} FROM records ORDER BY key"
        ))  # fmt: skip
        tickets = tuple(self._ticket(row) for row in self._db.execute(
            f"SELECT {', '.join(_TICKET_COLUMNS)} FROM tickets ORDER BY ticket"
        ))  # fmt: skip
        fresh = not records and not tickets and self._meta("lease_id_limit") is None
        incarnation = self.incarnation + 1
        with self._transaction():
            self._set_meta("incarnation", incarnation)
        next_ticket = max([self._meta("ticket_high_water") or FIRST_TICKET, *[t.ticket + 1 for t in tickets]])
        return Loaded(records, self.lease_id_limit, tickets, next_ticket, incarnation, fresh)

    @staticmethod
    def _record(row: tuple) -> Record:
        values = dict(zip(_RECORD_COLUMNS, row, strict=True))
        return Record(
            key=BlockKey(values["key"]),
            namespace=NamespaceDigest(values["namespace"]),
            parent=None if values["parent"] is None else BlockKey(values["parent"]),
            phase=values["phase"],
            gen=values["gen"],
            epoch=values["epoch"],
            owner=None if values["owner"] is None else LocationId(values["owner"]),
            moving_to=None if values["moving_to"] is None else LocationId(values["moving_to"]),
            draining=None if values["draining"] is None else LocationId(values["draining"]),
            writer=None if values["writer"] is None else NodeId(values["writer"]),
            writer_tenant=values["writer_tenant"],
            write_lease=values["write_lease"],
            write_lease_expires_at_ms=values["write_lease_expires_at_ms"],
            committed_lease=values["committed_lease"],
        )

    @staticmethod
    def _ticket(row: tuple) -> Ticket:
        v = dict(zip(_TICKET_COLUMNS, row, strict=True))
        return Ticket(
            ticket=v["ticket"],
            keys=_keys_from_blob(v["keys"]),
            pending=frozenset(_keys_from_blob(v["pending"])),
            started_at_ms=v["started_at_ms"],
            completed_at_ms=v["completed_at_ms"],
            acked=v["acked"],
            expired=v["expired"],
            restarts=v["restarts"],
        )

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

    def commit(self, effects: Iterable[Effect]) -> int:
        """Make every durable effect of ``effects`` durable, in order, in one transaction; the
        others are skipped. Returns how many were written. Call it before anything of the same
        call is sent."""
        durable = [e for e in effects if isinstance(e, DURABLE_EFFECTS)]
        if not durable:
            return 0
        with self._transaction():
            for e in durable:
                if isinstance(e, Persist):
                    r = e.record
                    self._db.execute(
                        f"INSERT OR REPLACE INTO records ({', '.join(_RECORD_COLUMNS)}) "
                        f"VALUES ({', '.join('?' * len(_RECORD_COLUMNS))})",
                        (
                            r.key.digest, bytes(r.namespace), None if r.parent is None else r.parent.digest,
                            r.phase, r.gen, r.epoch, r.owner, r.moving_to, r.draining, r.writer,
                            r.writer_tenant, r.write_lease, r.write_lease_expires_at_ms, r.committed_lease,
                        ),
                    )  # fmt: skip
                elif isinstance(e, PersistTicket):
                    t = e.ticket
                    self._db.execute(
                        f"INSERT OR REPLACE INTO tickets ({', '.join(_TICKET_COLUMNS)}) "
                        f"VALUES ({', '.join('?' * len(_TICKET_COLUMNS))})",
                        (
                            t.ticket, _keys_blob(t.keys), _keys_blob(t.pending), t.started_at_ms,
                            t.completed_at_ms, t.acked, t.expired, t.restarts,
                        ),
                    )  # fmt: skip
                    self._raise_meta("ticket_high_water", t.ticket + 1)
                elif isinstance(e, ForgetTicket):
                    self._db.execute("DELETE FROM tickets WHERE ticket = ?", (e.ticket,))
                else:
                    self._raise_meta("lease_id_limit", e.limit)
        return len(durable)

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
