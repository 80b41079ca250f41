"""What the directory keeps durable, whatever keeps it: rows, checked effects, what a load returns.

Theory of operation
-------------------
Both stores -- the embedded SQLite log (``store.DirectoryStore``) and etcd
(``etcd_store.EtcdDirectoryStore``) -- keep the same things: one *row* per record (the fields of
``core.Record``), one per remembered ticket (``core.Ticket``), and a few integers (the lease-id
limit, the ticket high-water mark, the incarnation). This module is the one place that maps
records and tickets to rows of plain values (bytes, str, int, None: what an SQLite column and a
canonical-CBOR value both hold) and back, so the two stores cannot drift apart.

``durable_effects`` is the first thing a store's ``commit`` calls: it keeps the durable effects
of one core call and checks every effect *before* anything is written, so that bad input raises
``InvalidEffect`` and changes nothing. ``record_from_row`` / ``ticket_from_row`` check what is
read back (the store's file or etcd keys may have been written by something else, or damaged):
a row that is not a valid record raises ``StoreCorrupt`` naming it.

Errors (``StoreError`` and below) are typed like the rest of the reference (``errors.KvccError``,
a stable ``code``): ``InvalidEffect`` (the caller handed ``commit`` something that is not a
durable effect of the core: a bug of the runtime, raised rather than asserted because the store
is the last line before the disk), ``StoreCorrupt``, ``Deposed`` (another directory took the log
over: this one must stop serving), ``OwnerAlive`` (a directory that asked not to take over found
one running), ``StoreFailed`` (an earlier commit's outcome is unknown: the store is unusable and
the directory must restart from ``load``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, Union

from attrs import frozen

from kvcc.spec.keys import DIGEST_BYTES, BlockKey, CborError, LocationId, NamespaceDigest, NodeId, cbor_decode, cbor_encode
from kvcc.spec.rules import PHASES

from ..errors import KvccError
from .core import (
    DURABLE_EFFECTS,
    FIRST_LEASE_ID,
    FIRST_TICKET,
    CompleteTicket,
    CopyAt,
    Emit,
    ForgetTicket,
    FreeAt,
    MirrorLeases,
    Persist,
    PersistTicket,
    Record,
    ReserveLeaseIds,
    Send,
    Ticket,
)

__all__ = [
    "RECORD_FIELDS",
    "TICKET_FIELDS",
    "ROW_INT_LIMIT",
    "DurableEffect",
    "Loaded",
    "StoreError",
    "InvalidEffect",
    "StoreCorrupt",
    "Deposed",
    "OwnerAlive",
    "StoreFailed",
    "events_tail_text",
    "record_row",
    "record_from_row",
    "ticket_row",
    "ticket_from_row",
    "keys_blob",
    "keys_from_blob",
    "durable_effects",
]

RECORD_FIELDS = (
    "key", "namespace", "parent", "phase", "gen", "epoch", "owner", "moving_to", "draining", "writer",
    "writer_tenant", "write_lease", "write_lease_expires_at_ms", "committed_lease", "to_free",
)  # fmt: skip
# Fields a row written by an earlier version may lack, and what they then hold.
RECORD_FIELD_DEFAULTS = {"to_free": b""}
TICKET_FIELDS = ("ticket", "keys", "pending", "started_at_ms", "completed_at_ms", "acked", "expired", "restarts")
ROW_INT_LIMIT = 2**63  # exclusive: SQLite's INTEGER and etcd's int64 both hold less
_ALL_EFFECTS = (
    Send, FreeAt, CopyAt, Persist, PersistTicket, ForgetTicket, ReserveLeaseIds, MirrorLeases, Emit, CompleteTicket
)

DurableEffect = Union[Persist, PersistTicket, ForgetTicket, ReserveLeaseIds, MirrorLeases]


# -- errors ---------------------------------------------------------------------------------------


class StoreError(KvccError):
    """Base of the directory stores' errors."""

    code: ClassVar[str] = "store_error"


class InvalidEffect(StoreError):
    """``commit`` was given something that is not a valid effect of the core; nothing was written."""

    code: ClassVar[str] = "invalid_effect"


class StoreCorrupt(StoreError):
    """What the store read back is not a valid record, ticket or mark (``where`` names it)."""

    code: ClassVar[str] = "store_corrupt"


class Deposed(StoreError):
    """Another directory owns the log now (or this one lost its ownership lease): this store's
    write was refused and changed nothing. The directory must stop serving."""

    code: ClassVar[str] = "deposed"


class OwnerAlive(StoreError):
    """Opened with ``take_over=False`` while another directory holds the log."""

    code: ClassVar[str] = "owner_alive"


class StoreFailed(StoreError):
    """A commit failed and its outcome is unknown, or the store was closed: nothing more is
    written through this store; the directory restarts from ``load`` on a new one."""

    code: ClassVar[str] = "store_failed"


# -- what a load returns --------------------------------------------------------------------------


@frozen
class Loaded:
    """What a restart recovers: ``DirectoryCore.restarted(records, next_lease_id, now_ms,
    tickets, next_ticket)``. ``fresh``: a first start -- no earlier incarnation loaded the log (a
    restart whose predecessor wrote nothing is a restart: it logs ``restart_directory`` and waits
    its grace).
    ``lease_horizon_ms``: how long, from the load, a lease granted by an earlier incarnation may
    still run (on the store's clock; add the skew), when the store mirrors leases and knows it;
    ``None`` when it does not (assume the full restart grace).
    ``events_tail``: the event-log lines committed with the last step that had any (``commit(...,
    events_tail=)``): the restarted directory appends those its predecessor's log lacks
    (``events.append_missing``)."""

    records: tuple[Record, ...]
    next_lease_id: int
    tickets: tuple[Ticket, ...]
    next_ticket: int
    incarnation: int
    fresh: bool
    lease_horizon_ms: int | None = None
    events_tail: tuple[str, ...] = ()


# -- rows -----------------------------------------------------------------------------------------


def keys_blob(keys: Iterable[BlockKey]) -> bytes:
    """Keys as their concatenated digests, sorted (a ticket's ``pending`` is a set)."""
    return b"".join(k.digest for k in sorted(keys))


def keys_from_blob(blob: bytes) -> tuple[BlockKey, ...]:
    if not isinstance(blob, bytes) or len(blob) % DIGEST_BYTES:
        raise ValueError(f"a key list is a multiple of {DIGEST_BYTES} bytes")
    return tuple(BlockKey(blob[i : i + DIGEST_BYTES]) for i in range(0, len(blob), DIGEST_BYTES))


def frees_blob(to_free: Iterable[tuple[str, int]]) -> bytes:
    """A record's to-free set as canonical CBOR ``[[location, epoch], ...]``; empty: ``b""``
    (what a row from before the to-free set holds)."""
    entries = [[loc, epoch] for loc, epoch in to_free]
    return cbor_encode(entries) if entries else b""


def frees_from_blob(blob: Any) -> tuple[tuple[LocationId, int], ...]:
    if type(blob) is not bytes:
        raise ValueError("a to-free set is bytes")
    if not blob:
        return ()
    try:
        entries = cbor_decode(blob)
    except CborError as e:
        raise ValueError(f"a to-free set is not canonical CBOR: {e}") from None
    if type(entries) is not list or not all(
        type(e) is list and len(e) == 2 and type(e[0]) is str and _int(e[1]) for e in entries
    ):
        raise ValueError("a to-free set is a list of [location, epoch]")
    return tuple((LocationId(loc), epoch) for loc, epoch in entries)


def _int(v: Any, low: int = 0) -> bool:
    return type(v) is int and low <= v < ROW_INT_LIMIT


def _opt_str(v: Any) -> bool:
    return v is None or type(v) is str


def _digest(v: Any) -> bool:
    return type(v) is bytes and len(v) == DIGEST_BYTES


def record_row(r: Record) -> dict[str, Any]:
    """``r`` as a row of plain values, one entry per ``RECORD_FIELDS``."""
    return {
        "key": r.key.digest,
        "namespace": bytes(r.namespace),
        "parent": None if r.parent is None else r.parent.digest,
        "phase": r.phase,
        "gen": r.gen,
        "epoch": r.epoch,
        "owner": r.owner,
        "moving_to": r.moving_to,
        "draining": r.draining,
        "writer": r.writer,
        "writer_tenant": r.writer_tenant,
        "write_lease": r.write_lease,
        "write_lease_expires_at_ms": r.write_lease_expires_at_ms,
        "committed_lease": r.committed_lease,
        "to_free": frees_blob(r.to_free),
    }


def _row_problem(row: Mapping[str, Any]) -> str | None:
    if not set(RECORD_FIELDS) - set(RECORD_FIELD_DEFAULTS) <= set(row) <= set(RECORD_FIELDS):
        return f"fields {sorted(row)}"
    if not _digest(row["key"]) or not _digest(row["namespace"]):
        return "key or namespace is not a digest"
    if row["parent"] is not None and not _digest(row["parent"]):
        return "parent is not a digest"
    if row["phase"] not in PHASES or type(row["phase"]) is not int:
        return f"phase {row['phase']!r}"
    for name in ("gen", "epoch", "write_lease", "write_lease_expires_at_ms", "committed_lease"):
        if not _int(row[name], low=-ROW_INT_LIMIT if name == "write_lease_expires_at_ms" else 0):
            return f"{name} {row[name]!r}"
    for name in ("owner", "moving_to", "draining", "writer", "writer_tenant"):
        if not _opt_str(row[name]):
            return f"{name} {row[name]!r}"
    return None


def record_from_row(row: Mapping[str, Any], where: str = "record") -> Record:
    """The record a row holds; ``StoreCorrupt`` if it holds none."""
    if not isinstance(row, Mapping):
        raise StoreCorrupt(f"{where}: not a row: {type(row).__name__}", where=where)
    problem = _row_problem(row)
    if problem is None:
        row = {**RECORD_FIELD_DEFAULTS, **row}
        try:
            to_free = frees_from_blob(row["to_free"])
        except ValueError as e:
            raise StoreCorrupt(f"{where}: {e}", where=where) from None
        try:
            return Record(
                key=BlockKey(row["key"]),
                namespace=NamespaceDigest(row["namespace"]),
                parent=None if row["parent"] is None else BlockKey(row["parent"]),
                phase=row["phase"],
                gen=row["gen"],
                epoch=row["epoch"],
                owner=None if row["owner"] is None else LocationId(row["owner"]),
                moving_to=None if row["moving_to"] is None else LocationId(row["moving_to"]),
                draining=None if row["draining"] is None else LocationId(row["draining"]),
                writer=None if row["writer"] is None else NodeId(row["writer"]),
                writer_tenant=row["writer_tenant"],
                write_lease=row["write_lease"],
                write_lease_expires_at_ms=row["write_lease_expires_at_ms"],
                committed_lease=row["committed_lease"],
                to_free=to_free,
            )
        except AssertionError as e:  # Record's own invariants: data from outside this process
            problem = f"violates a record invariant ({e})"
    raise StoreCorrupt(f"{where}: {problem}", where=where)


def ticket_row(t: Ticket) -> dict[str, Any]:
    """``t`` as a row of plain values, one entry per ``TICKET_FIELDS``."""
    return {
        "ticket": t.ticket,
        "keys": keys_blob(t.keys),
        "pending": keys_blob(t.pending),
        "started_at_ms": t.started_at_ms,
        "completed_at_ms": t.completed_at_ms,
        "acked": t.acked,
        "expired": t.expired,
        "restarts": t.restarts,
    }


def ticket_from_row(row: Mapping[str, Any], where: str = "ticket") -> Ticket:
    """The ticket a row holds; ``StoreCorrupt`` if it holds none."""
    if not isinstance(row, Mapping) or set(row) != set(TICKET_FIELDS):
        raise StoreCorrupt(f"{where}: not a ticket row", where=where)
    ok = (
        _int(row["ticket"], FIRST_TICKET)
        and _int(row["started_at_ms"], -ROW_INT_LIMIT)
        and (row["completed_at_ms"] is None or _int(row["completed_at_ms"], -ROW_INT_LIMIT))
        and all(_int(row[n]) for n in ("acked", "expired", "restarts"))
    )
    if not ok:
        raise StoreCorrupt(f"{where}: a field is out of range", where=where)
    try:
        keys, pending = keys_from_blob(row["keys"]), frozenset(keys_from_blob(row["pending"]))
    except ValueError as e:
        raise StoreCorrupt(f"{where}: {e}", where=where) from None
    return Ticket(
        ticket=row["ticket"],
        keys=keys,
        pending=pending,
        started_at_ms=row["started_at_ms"],
        completed_at_ms=row["completed_at_ms"],
        acked=row["acked"],
        expired=row["expired"],
        restarts=row["restarts"],
    )


# -- commit input ---------------------------------------------------------------------------------


def events_tail_text(lines: Sequence[str] | None) -> str:
    """``commit``'s ``events_tail`` as one text (lines joined by newlines; empty for none);
    ``InvalidEffect`` for anything but lines of text without a newline."""
    if not lines:
        return ""
    if isinstance(lines, (str, bytes)) or any(type(line) is not str or not line or "\n" in line for line in lines):
        raise InvalidEffect("events_tail: a sequence of lines of text, each without a newline")
    return "\n".join(lines)


def durable_effects(effects: Iterable[Any]) -> list[DurableEffect]:
    """The durable effects of one core call, in order, each checked; ``InvalidEffect`` (before
    anything is written) for anything that is not an effect of the core or holds a bad value."""
    if isinstance(effects, (str, bytes, Mapping)):
        raise InvalidEffect(f"effects must be a sequence of effects, got {type(effects).__name__}")
    try:
        items = list(effects)
    except TypeError:
        raise InvalidEffect(f"effects must be iterable, got {type(effects).__name__}") from None
    out: list[DurableEffect] = []
    for i, e in enumerate(items):
        if not isinstance(e, _ALL_EFFECTS):
            raise InvalidEffect(f"effect {i} is a {type(e).__name__}, not an effect of the core", index=i)
        if not isinstance(e, DURABLE_EFFECTS):
            continue
        problem = None
        if isinstance(e, Persist):
            if not isinstance(e.record, Record):
                problem = f"Persist of a {type(e.record).__name__}"
            else:
                problem = _row_problem(record_row(e.record))
        elif isinstance(e, PersistTicket):
            t = e.ticket
            if not isinstance(t, Ticket):
                problem = f"PersistTicket of a {type(t).__name__}"
            elif not _int(t.ticket, FIRST_TICKET):
                problem = f"ticket number {t.ticket!r}"
            else:
                try:
                    ticket_from_row(ticket_row(t))
                except (StoreCorrupt, AttributeError, TypeError) as err:
                    problem = str(err)
        elif isinstance(e, ForgetTicket):
            if not _int(e.ticket, FIRST_TICKET):
                problem = f"ForgetTicket of {e.ticket!r}"
        elif isinstance(e, MirrorLeases):
            if not _int(e.remaining_ms, 0):
                problem = f"MirrorLeases for {e.remaining_ms!r} ms"
        elif not _int(e.limit, FIRST_LEASE_ID):
            problem = f"ReserveLeaseIds up to {e.limit!r}"
        if problem is not None:
            raise InvalidEffect(f"effect {i}: {problem}", index=i)
        out.append(e)
    return out
