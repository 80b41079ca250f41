"""The directory's durable log on etcd: the same interface as ``store.DirectoryStore``.

Theory of operation
-------------------
``EtcdDirectoryStore(endpoints, prefix)`` keeps what the SQLite store keeps (``durable``: record
and ticket rows, the lease-id limit, the ticket high-water mark, the incarnation) as etcd keys,
so that a directory can restart on another machine, and routers and nodes can follow the records
by watching etcd. Every value is canonical CBOR (``kvcc.spec.keys.cbor_encode``). Under
``P = prefix``:

====================================  ========================================================
``P/owner``                           ``{"incarnation", "token"}``, attached to the owner's etcd
                                      lease (kept alive): who writes now
``P/meta/incarnation``                bumped by compare-and-swap on every takeover and ``load``
``P/meta/commit``                     ``{"incarnation", "seq", "journal", "jid"}``: put by every
                                      commit; the fencing and exactly-once anchor
``P/meta/lease_id_limit``             every lease id below it may have been handed out
``P/meta/ticket_high_water``          one above the highest ticket ever issued
``P/meta/lease_mirror``               True while every lease granted is mirrored (below)
``P/meta/schema_version``             ``SCHEMA_VERSION``
``P/meta/shard``                      ``[shard, shards]`` of a sharded directory (``claim_shard``)
``P/rec/<key hex>``                   a record row (``durable.record_row``)
``P/ticket/<n, 20 digits>``           a ticket row (``durable.ticket_row``)
``P/journal/<jid>/<i>``               a batch too large for one transaction (below)
``P/events_tail/<i, 8 digits>``       the event-log lines of the last commit that logged any,
                                      in pieces, put in that commit (``Loaded.events_tail``)
``P/leases/<etcd lease id, hex>``     ``{"incarnation", "ttl_s"}``, attached to a bucket lease
====================================  ========================================================

*Ownership and fencing.* One directory writes at a time. Opening the store grants an etcd lease
(``lease_ttl_s``, kept alive by a thread) and takes the log over in one transaction: it compares
the revisions of ``meta/incarnation`` and ``meta/commit`` it just read (so two openers race on a
compare-and-swap and one retries), bumps the incarnation and puts ``owner`` (with a random token)
on its lease. A second directory opening the same prefix thus deposes the first (unless opened
with ``take_over=False``: then a live owner key -- its lease not yet expired -- raises
``OwnerAlive``, which is how a standby waits for a crashed owner). ``load()`` bumps the incarnation
again, fenced like a commit.

*Commits.* ``commit(effects)`` checks its input (``durable.durable_effects``: bad input raises
``InvalidEffect`` before any etcd call), folds the call's durable effects into one put or delete
per key (the last one wins: a record invalidated and completed in one call is written once; the
lease-id limit and ticket high-water mark only ever rise), and writes them in ONE etcd
transaction whose compare checks that ``owner`` still holds our value and that ``meta/commit``
is at the revision our previous commit left it at, and whose success branch also puts
``meta/commit`` = our next sequence number. A deposed directory's commit (or one whose ownership
lease expired) fails that compare, raises ``Deposed`` and wrote nothing. A commit with nothing
durable makes no etcd call.

*Exactly once.* When etcd's answer is lost (``EtcdIndeterminate``: timeout or a connection reset
after sending, a member killed mid-request), the same transaction is sent again. If the first one
was applied, the retry fails its compare and reads ``meta/commit`` back: it holds our sequence
number, so the commit is done (with the revision it got). If it was not applied, the retry is;
a first attempt still in flight then fails for good, since ``meta/commit`` moved. A commit whose
outcome stays unknown for ``commit_retry_s``, or that fails in any other way, raises
``StoreFailed`` and the store refuses everything after: the core already moved on, so the
directory must restart from ``load`` anyway.

*Large batches.* etcd refuses a transaction with more than ``--max-txn-ops`` (128 by default)
operations or a request over ``--max-request-bytes`` (1.5 MiB). A call that voids a whole
namespace can persist thousands of records, so a batch over ``max_txn_ops`` / ``max_txn_bytes``
goes through a journal: its operations are written as chunks under ``journal/<jid>/`` (fenced,
invisible to readers of records), then one transaction puts ``meta/commit`` naming the journal --
the commit point -- then the operations are applied in transactions of bounded size, and a last
one deletes the journal and clears its name. A directory that takes the log over with a journal
named in ``meta/commit`` applies it first. Watchers then see one batch across several revisions.

*Read leases, mirrored in time buckets.* The core keeps read leases in memory; a restarted core
frees nothing for the full grace (``rules.restart_grace``: term + 2 epsilon) because it cannot
know the longest lease its predecessor granted. An etcd lease per read lease would tell it, but
costs a grant and a revoke per lease (about 500 pairs/s on one member here, below the directory's
target). Instead, with ``restart_grace_ms`` given, ``mirror_leases(remaining_ms)`` -- to be called
before any lease grant leaves, with how long that lease may run on the directory's view -- keeps
one etcd lease per *bucket*: when the current bucket lease would not outlive the new lease, it
grants one with TTL ``remaining + lease_bucket_ms`` (rounded up to seconds) and puts a marker key
``leases/<id>`` on it (fenced, like a commit); every grant in the next ``lease_bucket_ms`` is then
covered with no etcd call. An etcd lease only lives longer than asked (etcd counts from when it
received the grant, and a new etcd leader renews leases in full), so a marker outlives every lease
it covers. A directory that takes over reads the markers left and their remaining TTLs
(``Loaded.lease_horizon_ms``, at most ``restart_grace_ms``): the longest a predecessor's lease may
still run, to wait instead of the full grace. That is trusted only while ``meta/lease_mirror``
says every earlier incarnation mirrored its leases: a store opened without ``restart_grace_ms``
sets it False; a mirroring store that finds it False (or missing on a non-empty log) reports
``None`` (wait the full grace), puts a marker covering that grace, and only then sets it True.
A deposed directory still serving from memory learns of its deposition at its next bucket; the
leases it grants until then are covered by a marker that existed before the takeover.

*Watches.* ``watch_records(callback, start_revision)`` (and the module function of the same name,
for routers and nodes, which do not own the log) deliver every change of a record
(``RecordChange``: revision, key, the new record or ``None``) in revision order; the client's
watch resumes after a broken stream (member killed or paused) from the revision after the last
one delivered, on another endpoint if need be, so no change is lost or delivered twice.
``read_records`` returns a snapshot and its revision, to watch from ``revision + 1``. If that
revision has been compacted the watch ends with ``EtcdCompacted``: re-read and watch again.

One store belongs to one thread (its calls block on etcd); its keep-alive and watches run on
threads of their own.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from attrs import frozen

from kvcc.spec.keys import CborError, BlockKey, cbor_decode, cbor_encode

from ..etcd_client import (
    DEFAULT_FAILOVER_TIMEOUT_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    Cmp,
    EtcdError,
    EtcdIndeterminate,
    EtcdKV,
    KeyValue,
    Op,
    Watch,
    WatchEvent,
)
from .core import (
    FIRST_LEASE_ID, FIRST_TICKET, Effect, ForgetTicket, MirrorLeases, Persist, PersistTicket, Record, ReserveLeaseIds, Ticket,
)  # fmt: skip
from .durable import (
    Deposed,
    DurableEffect,
    InvalidEffect,
    Loaded,
    OwnerAlive,
    StoreCorrupt,
    StoreFailed,
    durable_effects,
    events_tail_text,
    record_from_row,
    record_row,
    ticket_from_row,
    ticket_row,
)

__all__ = ["EtcdDirectoryStore", "RecordChange", "RecordWatch", "read_records", "watch_records", "SCHEMA_VERSION"]

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
FIRST_LOAD_INCARNATION = 2  # a first start: the open bumps the incarnation to 1, its load to 2
DEFAULT_PREFIX = "kvcc"
OWNER_LEASE_TTL_S = 10  # a crashed owner's key lingers this long (a standby waits for it)
ETCD_MAX_TXN_OPS = 128  # etcd's --max-txn-ops default: operations in one branch of a transaction
TXN_MAX_BYTES = 1 << 20  # keys + values per transaction, under etcd's 1.5 MiB --max-request-bytes
VALUE_MAX_BYTES = 768 << 10  # one value (a ticket voiding many keys is the largest)
JOURNAL_CHUNK_BYTES = 256 << 10  # one journal key's value (one larger value makes a chunk alone)
TXN_OVERHEAD_BYTES = 4096  # a transaction's compares, meta/commit put and framing, besides its operations
LEASE_BUCKET_MS = 1000  # read leases granted within this long share one etcd lease
COMMIT_RETRY_S = 30.0  # a commit whose outcome is unknown is retried this long, then StoreFailed
TAKEOVER_ATTEMPTS = 32  # compare-and-swap races lost in a row before giving up
ETCD_TTL_TRUNCATION_S = 1  # etcd reports a lease's remaining TTL in whole seconds, rounded down
TICKET_DIGITS = 20  # ticket numbers zero-padded so that etcd lists them in order
assert JOURNAL_CHUNK_BYTES * 2 <= TXN_MAX_BYTES
assert VALUE_MAX_BYTES + TXN_OVERHEAD_BYTES <= TXN_MAX_BYTES
assert TAKEOVER_ATTEMPTS > 1


@frozen
class RecordChange:
    """One committed change of a record, as a watcher sees it: at etcd ``revision``, ``key``'s
    record became ``record`` (``None``: the record was deleted)."""

    revision: int
    key: BlockKey
    record: Record | None


def _enc(value: Any) -> bytes:
    return cbor_encode(value)


def _dec(data: bytes, where: str) -> Any:
    try:
        return cbor_decode(data)
    except CborError as e:
        raise StoreCorrupt(f"{where}: {e}", where=where) from None


def _check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not prefix or not prefix.isascii() or not prefix.isprintable():
        raise ValueError(f"prefix must be non-empty printable ASCII, got {prefix!r}")
    if prefix.startswith("/") or prefix.endswith("/") or " " in prefix or "//" in prefix:
        raise ValueError(f"prefix must not start or end with '/', hold '//' or spaces: {prefix!r}")
    return prefix


class _Keys:
    """The etcd keys of one prefix."""

    def __init__(self, prefix: str) -> None:
        p = _check_prefix(prefix)
        self.root = f"{p}/".encode()
        self.owner = f"{p}/owner".encode()
        self.meta = f"{p}/meta/".encode()
        self.incarnation = self.meta + b"incarnation"
        self.commit = self.meta + b"commit"
        self.lease_id_limit = self.meta + b"lease_id_limit"
        self.ticket_high_water = self.meta + b"ticket_high_water"
        self.lease_mirror = self.meta + b"lease_mirror"
        self.schema_version = self.meta + b"schema_version"
        self.shard = self.meta + b"shard"
        self.rec = f"{p}/rec/".encode()
        self.ticket = f"{p}/ticket/".encode()
        self.journal = f"{p}/journal/".encode()
        self.events_tail = f"{p}/events_tail/".encode()
        self.leases = f"{p}/leases/".encode()

    def record(self, key: BlockKey) -> bytes:
        return self.rec + key.hex.encode()

    def ticket_key(self, n: int) -> bytes:
        return self.ticket + f"{n:0{TICKET_DIGITS}d}".encode()

    def events_tail_chunk(self, i: int) -> bytes:
        return self.events_tail + f"{i:08d}".encode()

    def journal_chunk(self, jid: str, i: int) -> bytes:
        return self.journal + f"{jid}/{i:08d}".encode()


def _record_at(keys: _Keys, key: bytes, value: bytes | None) -> tuple[BlockKey, Record | None]:
    where = key.decode("utf-8", "replace")
    try:
        block = BlockKey.from_hex(key[len(keys.rec) :].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise StoreCorrupt(f"{where}: not a record key", where=where) from None
    if value is None:
        return block, None
    rec = record_from_row(_dec(value, where), where)
    if rec.key != block:
        raise StoreCorrupt(f"{where}: holds the record of {rec.key}", where=where)
    return block, rec


# ----------------------------------------------------------------------------- readers (no ownership)


def read_records(kv: EtcdKV, prefix: str = DEFAULT_PREFIX) -> tuple[dict[BlockKey, Record], int]:
    """Every record under ``prefix`` and the etcd revision of that snapshot (watch from
    ``revision + 1`` to follow it). Needs no ownership: for routers, nodes and tests."""
    keys = _Keys(prefix)
    kvs, revision = kv.range_prefix(keys.rec)
    out: dict[BlockKey, Record] = {}
    for item in kvs:
        block, rec = _record_at(keys, item.key, item.value)
        assert rec is not None
        out[block] = rec
    return out, revision


class RecordWatch:
    """A running watch of the records (see ``watch_records``). Without a callback, ``get`` or
    iterate it for ``RecordChange`` values; ``cancel()`` ends it; ``revision`` is the last one
    delivered; ``reconnects`` counts the streams it resumed."""

    def __init__(self, keys: _Keys) -> None:
        self._keys = keys
        self._watch: Watch | None = None

    def _change(self, ev: WatchEvent) -> RecordChange:
        block, rec = _record_at(self._keys, ev.key, None if ev.type == "DELETE" else ev.value)
        return RecordChange(ev.mod_revision, block, rec)

    @property
    def revision(self) -> int:
        assert self._watch is not None
        return self._watch.revision

    @property
    def reconnects(self) -> int:
        assert self._watch is not None
        return self._watch.reconnects

    @property
    def error(self) -> EtcdError | None:
        assert self._watch is not None
        return self._watch.error

    def get(self, timeout_s: float | None = None) -> RecordChange | None:
        """The next change, or ``None`` on timeout or after the watch ended; raises the watch's
        terminal error, or ``StoreCorrupt`` for a value that is not a record."""
        assert self._watch is not None
        ev = self._watch.get(timeout_s)
        return None if ev is None else self._change(ev)

    def __iter__(self) -> Iterator[RecordChange]:
        while True:
            change = self.get()
            if change is None:
                return
            yield change

    def cancel(self) -> None:
        if self._watch is not None:
            self._watch.cancel()


def watch_records(
    kv: EtcdKV,
    prefix: str = DEFAULT_PREFIX,
    callback: Callable[[RecordChange], None] | None = None,
    *,
    start_revision: int | None = None,
    on_error: Callable[[Exception], None] | None = None,
) -> RecordWatch:
    """Follow every committed change of a record under ``prefix``, in revision order, from
    ``start_revision`` (``None``: from now on), resuming across broken streams and failed
    members (see the module docstring). With ``callback``, changes go to it on the watch's
    thread and errors (``StoreCorrupt`` for a value that is not a record: that change is
    skipped; the watch's terminal ``EtcdError``) to ``on_error``; without, iterate the result."""
    if start_revision is not None and (type(start_revision) is not int or start_revision < 1):
        raise ValueError(f"start_revision must be an int >= 1 or None, got {start_revision!r}")
    keys = _Keys(prefix)
    rw = RecordWatch(keys)

    def deliver(ev: WatchEvent) -> None:
        assert callback is not None
        try:
            change = rw._change(ev)
        except StoreCorrupt as e:
            if on_error is None:
                log.error("record watch on %r: %s", prefix, e)
            else:
                on_error(e)
            return
        callback(change)

    rw._watch = kv.watch_prefix(
        keys.rec, start_revision or 0, deliver if callback is not None else None, on_error=on_error
    )
    return rw


# ----------------------------------------------------------------------------- the store


class EtcdDirectoryStore:
    """``EtcdDirectoryStore(endpoints, prefix="kvcc")``: take the directory log under ``prefix``
    over (see the module docstring) and commit to it; the interface of ``DirectoryStore``
    (``load``, ``commit``, ``lease_id_limit``, ``incarnation``, ``close``, context manager) plus
    ``mirror_leases`` and ``watch_records``.

    ``lease_ttl_s``: TTL of the ownership lease. ``restart_grace_ms``: the core's
    ``DirectoryConfig.restart_grace_ms``; given, leases are mirrored (``mirror_leases``) and
    ``load`` reports ``lease_horizon_ms``. ``take_over=False``: raise ``OwnerAlive`` instead of
    deposing a live owner. ``max_txn_ops`` / ``max_txn_bytes``: the etcd cluster's limits on one
    transaction (larger batches go through the journal)."""

    # A commit is a network round trip (and waits out a leader election): the directory server
    # commits from its commit thread, never on its event loop. One thread at a time uses a store.
    commits_off_loop = True

    def __init__(
        self,
        endpoints: Sequence[str] | str,
        prefix: str = DEFAULT_PREFIX,
        *,
        lease_ttl_s: int = OWNER_LEASE_TTL_S,
        restart_grace_ms: int | None = None,
        lease_bucket_ms: int = LEASE_BUCKET_MS,
        take_over: bool = True,
        max_txn_ops: int = ETCD_MAX_TXN_OPS,
        max_txn_bytes: int = TXN_MAX_BYTES,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        failover_timeout_s: float = DEFAULT_FAILOVER_TIMEOUT_S,
        commit_retry_s: float = COMMIT_RETRY_S,
    ) -> None:
        self._keys = _Keys(prefix)
        self.prefix = prefix
        for name, value, low in (
            ("lease_ttl_s", lease_ttl_s, 1),
            ("lease_bucket_ms", lease_bucket_ms, 1),
            ("max_txn_ops", max_txn_ops, 8),
            ("max_txn_bytes", max_txn_bytes, VALUE_MAX_BYTES + TXN_OVERHEAD_BYTES),
        ):
            if type(value) is not int or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if restart_grace_ms is not None and (type(restart_grace_ms) is not int or restart_grace_ms < 1):
            raise ValueError(f"restart_grace_ms must be an int >= 1 or None, got {restart_grace_ms!r}")
        self._max_txn_ops = max_txn_ops
        self._max_txn_bytes = max_txn_bytes
        self._restart_grace_ms = restart_grace_ms
        self._lease_bucket_ms = lease_bucket_ms
        self._commit_retry_s = commit_retry_s
        self._failure: Exception | None = None  # once set, every call raises it (Deposed / StoreFailed)
        self.unknown_outcomes = 0  # transactions whose answer was lost and that were sent again
        self._closed = False
        self._mirror_until = 0.0  # time.monotonic() until which the newest bucket lease surely lives
        self._owner_value = b""
        self._commit_rev = 0
        self._seq = 0
        self._tail_pieces = 0  # how many events_tail/<i> keys the log holds
        self._incarnation = 0
        self._lease_id_limit: int | None = None  # the durable values, as we last wrote or read them
        self._ticket_high_water: int | None = None
        self._prev_lease_mirror: bool | None = None  # meta/lease_mirror as found at the last takeover
        self._kv = EtcdKV(endpoints, request_timeout_s=request_timeout_s, failover_timeout_s=failover_timeout_s)
        self._keepalive = None
        try:
            self._owner_lease = self._kv.grant_lease(lease_ttl_s)
            self._keepalive = self._kv.start_keepalive(self._owner_lease, on_lost=self._ownership_lost)
            self._take_over(first=True, take_over=take_over)
        except BaseException:
            self._closed = True
            if self._keepalive is not None:
                self._keepalive.stop()
            self._kv.close()
            raise

    # ------------------------------------------------------------------ reading

    @property
    def lease_id_limit(self) -> int:
        """The durable lease-id high-water mark."""
        return self._lease_id_limit or FIRST_LEASE_ID

    @property
    def incarnation(self) -> int:
        return self._incarnation

    def claim_shard(self, shard: int, shards: int) -> None:
        """Record that this log is shard ``shard`` of ``shards``'s, or check that it is
        (``store.shard_to_claim``; raises ``ShardMismatch``, changing nothing). Before ``load``."""
        from .store import shard_to_claim

        self._usable()
        k = self._keys
        meta = self._read_meta()
        item = meta.get(k.shard)
        stored = None
        if item is not None:
            value = _dec(item.value, k.shard.decode())
            if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value)):
                raise StoreCorrupt(f"{k.shard.decode()}: {value!r}", where=k.shard.decode())
            stored = (value[0], value[1])
        # Opening bumped the incarnation to 1 on a new log; any earlier open or load left more. A
        # record is written only after a load, so this also covers every log that holds one.
        has_state = (self._meta_int(meta, k.incarnation) or 0) > 1 or k.lease_id_limit in meta
        if shard_to_claim(stored, has_state, shard, shards, self.prefix):
            self._fenced_txn([Op.put(k.shard, _enc([shard, shards]))], advances=None)

    @property
    def endpoints(self) -> list[str]:
        return list(self._kv.endpoints)

    def load(self) -> Loaded:
        """Everything a restart recovers, and a new incarnation (made durable, fenced, before
        returning): the log is read in one snapshot after the incarnation was bumped."""
        self._usable()
        self._take_over(first=False)
        kvs, _ = self._kv.range_prefix(self._keys.root)
        state = {item.key: item for item in kvs}
        k = self._keys
        records: list[Record] = []
        tickets: list[Ticket] = []
        markers: list[KeyValue] = []
        tail_pieces: list[tuple[bytes, bytes]] = []
        orphans = False
        for key, item in state.items():
            if key.startswith(k.rec):
                _, rec = _record_at(k, key, item.value)
                assert rec is not None  # a range returns values
                records.append(rec)
            elif key.startswith(k.ticket):
                where = key.decode("utf-8", "replace")
                tickets.append(ticket_from_row(_dec(item.value, where), where))
            elif key.startswith(k.leases):
                markers.append(item)
            elif key.startswith(k.journal):
                orphans = True  # a journal being applied was applied by _take_over: these were never committed
            elif key.startswith(k.events_tail):
                tail_pieces.append((key, item.value))
        if orphans:
            self._fenced_txn([Op.delete(k.journal, prefix=True)], advances=None)
        tail_pieces.sort()
        self._tail_pieces = len(tail_pieces)
        try:
            text = b"".join(v for _, v in tail_pieces).decode()
        except UnicodeDecodeError:
            raise StoreCorrupt(f"{k.events_tail.decode()}: not text", where=k.events_tail.decode()) from None
        tail = tuple(text.split("\n")) if text else ()
        records.sort(key=lambda r: r.key)
        tickets.sort(key=lambda t: t.ticket)
        fresh = not records and not tickets and self._lease_id_limit is None
        next_ticket = max([self._ticket_high_water or FIRST_TICKET, *[t.ticket + 1 for t in tickets]])
        horizon = self._lease_horizon(markers, fresh)
        # A first start: the open and this load are the log's first two incarnations. A restart
        # with an empty log is a restart still (spec: restart_directory, its grace).
        first = fresh and self._incarnation <= FIRST_LOAD_INCARNATION
        return Loaded(tuple(records), self.lease_id_limit, tuple(tickets), next_ticket, self._incarnation, first, horizon,
                      events_tail=tail)  # fmt: skip

    def _lease_horizon(self, markers: list[KeyValue], fresh: bool) -> int | None:
        """``Loaded.lease_horizon_ms`` (see "Read leases" in the module docstring)."""
        grace = self._restart_grace_ms
        if grace is None:
            return None
        if fresh or self._prev_lease_mirror:
            horizon = 0
            for item in markers:
                left = self._kv.lease_ttl(item.lease) if item.lease else None
                if left is not None:  # None: expired since the snapshot
                    horizon = max(horizon, (left[0] + ETCD_TTL_TRUNCATION_S) * 1000)
            if not self._prev_lease_mirror:
                self._fenced_txn([Op.put(self._keys.lease_mirror, _enc(True))], advances=None)
                self._prev_lease_mirror = True
            return min(horizon, grace)
        # An earlier incarnation did not mirror its leases: wait the full grace, and mirror it, so
        # that the next directory knows this wait too; only then may it trust the markers.
        self.mirror_leases(grace)
        self._fenced_txn([Op.put(self._keys.lease_mirror, _enc(True))], advances=None)
        self._prev_lease_mirror = True
        return None

    # ------------------------------------------------------------------ ownership

    def _read_meta(self) -> dict[bytes, KeyValue]:
        kvs, _ = self._kv.range_prefix(self._keys.meta)
        return {item.key: item for item in kvs}

    def _meta_int(self, meta: dict[bytes, KeyValue], key: bytes) -> int | None:
        item = meta.get(key)
        if item is None:
            return None
        value = _dec(item.value, key.decode())
        if type(value) is not int or value < 0:
            raise StoreCorrupt(f"{key.decode()}: {value!r} is not a count", where=key.decode())
        return value

    def _take_over(self, *, first: bool, take_over: bool = True) -> None:
        """Bump the incarnation and own the log, in one compare-and-swap transaction (retried
        when another opener won a race), then apply any journal a predecessor committed."""
        k = self._keys
        for _ in range(TAKEOVER_ATTEMPTS):
            meta = self._read_meta()
            version = self._meta_int(meta, k.schema_version)
            if version is not None and version != SCHEMA_VERSION:
                raise StoreCorrupt(f"{k.schema_version.decode()}: {version}, this code reads {SCHEMA_VERSION}")
            incarnation = (self._meta_int(meta, k.incarnation) or 0) + 1
            commit_item = meta.get(k.commit)
            commit = self._commit_value(commit_item)
            token = uuid.uuid4().hex
            owner_value = _enc({"incarnation": incarnation, "token": token})
            new_commit = _enc({"incarnation": incarnation, "seq": 0, "journal": commit["journal"], "jid": commit["jid"]})
            compare = [
                Cmp.mod_revision(k.incarnation, meta[k.incarnation].mod_revision if k.incarnation in meta else 0),
                Cmp.mod_revision(k.commit, commit_item.mod_revision if commit_item else 0),
            ]
            if not first:
                compare.append(Cmp.value(k.owner, self._owner_value))  # load(): only while we own it
            elif not take_over:
                compare.append(Cmp.version(k.owner, 0))  # no live owner
            success = [
                Op.put(k.incarnation, _enc(incarnation)),
                Op.put(k.owner, owner_value, lease=self._owner_lease),
                Op.put(k.commit, new_commit),
                Op.put(k.schema_version, _enc(SCHEMA_VERSION)),
            ]
            if self._restart_grace_ms is None:
                success.append(Op.put(k.lease_mirror, _enc(False)))  # our leases are not mirrored
            try:
                r = self._kv.txn(compare, success, [Op.get(k.owner)])
                applied, revision = r.succeeded, r.revision
                owner_now = self._first_value(r.responses[0]) if not applied and r.responses else None
            except EtcdIndeterminate:
                now = self._kv.get_kv(k.owner)
                applied = now is not None and now.value == owner_value
                revision, owner_now = (now.mod_revision if now else 0), (now.value if now else None)
            if applied:
                self._incarnation, self._owner_value, self._commit_rev, self._seq = incarnation, owner_value, revision, 0
                self._lease_id_limit = self._meta_int(meta, k.lease_id_limit)
                self._ticket_high_water = self._meta_int(meta, k.ticket_high_water)
                mirror = meta.get(k.lease_mirror)
                self._prev_lease_mirror = None if mirror is None else _dec(mirror.value, "lease_mirror") is True
                if commit["journal"]:
                    self._apply_journal(commit["jid"], commit["journal"])
                return
            if not first and owner_now != self._owner_value:
                self._failure = Deposed(f"{self.prefix}: another directory owns the log", prefix=self.prefix)
                raise self._failure
            if first and not take_over and owner_now is not None:
                raise OwnerAlive(f"{self.prefix}: a directory owns the log ({_dec(owner_now, 'owner')})")
        raise StoreFailed(f"{self.prefix}: lost {TAKEOVER_ATTEMPTS} takeover races in a row")

    def _commit_value(self, item: KeyValue | None) -> dict[str, Any]:
        if item is None:
            return {"incarnation": 0, "seq": 0, "journal": 0, "jid": ""}
        value = _dec(item.value, "commit")
        if not isinstance(value, dict) or set(value) != {"incarnation", "seq", "journal", "jid"}:
            raise StoreCorrupt(f"{self._keys.commit.decode()}: {value!r}", where="commit")
        return value

    @staticmethod
    def _first_value(response: dict) -> bytes | None:
        kvs = (response.get("response_range") or {}).get("kvs") or []
        return KeyValue._from(kvs[0]).value if kvs else None

    def _ownership_lost(self, error: EtcdError) -> None:
        # Runs on the keep-alive thread. The owner key went with the lease: the next fenced write
        # fails its compare and raises Deposed; nothing to do here but say so.
        log.warning("%s: ownership lease lost (%s); the next write will be refused", self.prefix, error)

    def _usable(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise StoreFailed(f"{self.prefix}: store closed")

    # ------------------------------------------------------------------ writing

    def _fenced_txn(self, success: list[dict], *, advances: bytes | None) -> int:
        """Run ``success`` in one transaction that holds only while we own the log and nothing
        moved ``meta/commit`` since our last commit; ``advances``: the new ``meta/commit`` value
        that ``success`` puts (how a retry recognises its own earlier attempt). Returns the
        revision. Raises ``Deposed``, or ``StoreFailed`` when the outcome stays unknown."""
        k = self._keys
        compare = [Cmp.value(k.owner, self._owner_value), Cmp.mod_revision(k.commit, self._commit_rev)]
        failure = [Op.get(k.owner), Op.get(k.commit)]
        deadline = time.monotonic() + self._commit_retry_s
        unknown = 0
        while True:
            try:
                r = self._kv.txn(compare, success, failure)
            except EtcdIndeterminate as e:
                unknown += 1
                self.unknown_outcomes += 1
                if time.monotonic() > deadline:
                    self._failure = StoreFailed(f"{self.prefix}: outcome unknown after {unknown} attempts: {e}")
                    raise self._failure from e
                continue  # the same transaction again: it applies at most once (module docstring)
            except EtcdError as e:
                self._failure = StoreFailed(f"{self.prefix}: write failed: {e}" + (" (after an unknown outcome)" if unknown else ""))
                raise self._failure from e
            if r.succeeded:
                return r.revision
            owner_now = self._first_value(r.responses[0])
            if owner_now != self._owner_value:
                self._failure = Deposed(f"{self.prefix}: another directory owns the log; nothing written", prefix=self.prefix)
                raise self._failure
            kvs = (r.responses[1].get("response_range") or {}).get("kvs") or []
            now = KeyValue._from(kvs[0]) if kvs else None
            if advances is not None and unknown and now is not None and now.value == advances:
                return now.mod_revision  # an earlier attempt was applied
            self._failure = StoreFailed(f"{self.prefix}: meta/commit moved under its owner")
            raise self._failure

    def _ops(self, durable: list[DurableEffect]) -> tuple[dict[bytes, bytes | None], int | None, int | None]:
        """One put (value) or delete (None) per key, the last effect on a key winning; and the
        lease-id limit and ticket high-water mark after them."""
        k = self._keys
        ops: dict[bytes, bytes | None] = {}
        limit, high = self._lease_id_limit, self._ticket_high_water
        for e in durable:
            if isinstance(e, Persist):
                ops[k.record(e.record.key)] = _enc(record_row(e.record))
            elif isinstance(e, PersistTicket):
                ops[k.ticket_key(e.ticket.ticket)] = _enc(ticket_row(e.ticket))
                high = max(high or 0, e.ticket.ticket + 1)
            elif isinstance(e, ForgetTicket):
                ops[k.ticket_key(e.ticket)] = None
            elif isinstance(e, ReserveLeaseIds):
                limit = max(limit or 0, e.limit)
        if limit != self._lease_id_limit:
            ops[k.lease_id_limit] = _enc(limit)
        if high != self._ticket_high_water:
            ops[k.ticket_high_water] = _enc(high)
        for key, value in ops.items():
            if value is not None and len(value) > VALUE_MAX_BYTES:
                raise InvalidEffect(f"{key.decode()}: {len(value)} bytes, over the {VALUE_MAX_BYTES} an etcd value may hold")
        return ops, limit, high

    def commit(self, effects: Iterable[Effect], *, events_tail: Sequence[str] | None = None) -> int:
        """Make every durable effect of ``effects`` durable, in one etcd transaction (or, for a
        batch over etcd's limits, one journal commit point); the others are skipped. Returns how
        many were written. Call it before anything of the same call is sent. ``events_tail``: the
        event-log lines of the call's steps, kept with them (replacing the last ones) when there
        are any (``events_tail/<i>``, in pieces of at most ``JOURNAL_CHUNK_BYTES``). Raises
        ``InvalidEffect`` (nothing written), ``Deposed`` (nothing written), ``StoreFailed``."""
        durable = durable_effects(effects)  # InvalidEffect before anything is written
        tail = events_tail_text(events_tail).encode()
        self._usable()
        if not durable:
            return 0
        # Leases first: a marker must outlive every lease the reply about to leave grants.
        for e in durable:
            if type(e) is MirrorLeases:
                self._mirror_for(e.remaining_ms)
        ops, limit, high = self._ops(durable)
        pieces = [tail[i : i + JOURNAL_CHUNK_BYTES] for i in range(0, len(tail), JOURNAL_CHUNK_BYTES)]
        for i in range(max(len(pieces), self._tail_pieces) if pieces else 0):
            ops[self._keys.events_tail_chunk(i)] = pieces[i] if i < len(pieces) else None
        if ops:
            items = list(ops.items())
            if len(items) + 1 <= self._max_txn_ops and _size(items) + TXN_OVERHEAD_BYTES <= self._max_txn_bytes:
                self._seq += 1
                value = self._commit_record(0, "")
                success = [_op(key, v) for key, v in items] + [Op.put(self._keys.commit, value)]
                self._commit_rev = self._fenced_txn(success, advances=value)
            else:
                self._commit_journal(items)
        self._lease_id_limit, self._ticket_high_water = limit, high
        self._tail_pieces = len(pieces) or self._tail_pieces
        return len(durable)

    def _commit_record(self, journal: int, jid: str) -> bytes:
        return _enc({"incarnation": self._incarnation, "seq": self._seq, "journal": journal, "jid": jid})

    def _groups(self, items: Sequence[tuple[bytes, bytes | None]], reserve_ops: int) -> Iterator[list]:
        """``items`` cut into runs that fit one transaction beside ``reserve_ops`` more operations."""
        run: list = []
        size = 0
        for item in items:
            n = len(item[0]) + len(item[1] or b"")
            if run and (len(run) + 1 + reserve_ops > self._max_txn_ops or size + n + TXN_OVERHEAD_BYTES > self._max_txn_bytes):
                yield run
                run, size = [], 0
            run.append(item)
            size += n
        if run:
            yield run

    def _commit_journal(self, items: list[tuple[bytes, bytes | None]]) -> None:
        """A batch too large for one transaction: chunks, commit point, apply (module docstring)."""
        self._seq += 1
        jid = f"{self._incarnation}-{self._seq}"
        chunks: list[bytes] = []
        run: list = []
        size = 0
        for key, value in items:
            n = len(key) + len(value or b"") + 16
            if run and size + n > JOURNAL_CHUNK_BYTES:
                chunks.append(_enc(run))
                run, size = [], 0
            run.append([key, value])
            size += n
        chunks.append(_enc(run))
        puts = [(self._keys.journal_chunk(jid, i), c) for i, c in enumerate(chunks)]
        for group in self._groups(puts, reserve_ops=0):
            self._fenced_txn([_op(key, v) for key, v in group], advances=None)
        value = self._commit_record(len(chunks), jid)
        self._commit_rev = self._fenced_txn([Op.put(self._keys.commit, value)], advances=value)  # the commit point
        self._apply(items, jid)

    def _apply_journal(self, jid: str, n: int) -> None:
        """Apply a journal committed (by us or a predecessor) but maybe not applied."""
        k = self._keys
        kvs, _ = self._kv.range_prefix(k.journal + f"{jid}/".encode())
        chunks = {item.key: item.value for item in kvs}
        items: list[tuple[bytes, bytes | None]] = []
        for i in range(n):
            key = k.journal_chunk(jid, i)
            if key not in chunks:
                raise StoreCorrupt(f"{key.decode()}: a committed journal chunk is missing", where=key.decode())
            ops = _dec(chunks[key], key.decode())
            if not isinstance(ops, list) or not all(
                isinstance(o, list) and len(o) == 2 and type(o[0]) is bytes and o[0].startswith(k.root) and (o[1] is None or type(o[1]) is bytes)
                for o in ops
            ):
                raise StoreCorrupt(f"{key.decode()}: not a list of operations", where=key.decode())
            items.extend((o[0], o[1]) for o in ops)
        self._apply(items, jid)
        meta = self._read_meta()  # the journal may have moved the high-water marks
        self._lease_id_limit = self._meta_int(meta, k.lease_id_limit)
        self._ticket_high_water = self._meta_int(meta, k.ticket_high_water)

    def _apply(self, items: list[tuple[bytes, bytes | None]], jid: str) -> None:
        for group in self._groups(items, reserve_ops=0):
            self._fenced_txn([_op(key, v) for key, v in group], advances=None)  # idempotent: retried freely
        value = self._commit_record(0, "")
        done = [Op.delete(self._keys.journal + f"{jid}/".encode(), prefix=True), Op.put(self._keys.commit, value)]
        self._commit_rev = self._fenced_txn(done, advances=value)

    # ------------------------------------------------------------------ read leases

    @property
    def lease_bucket_ms(self) -> int:
        """How long the read leases granted share one etcd lease (``DirectoryConfig.lease_mirror_bucket_ms``)."""
        return self._lease_bucket_ms

    def mirror_leases(self, remaining_ms: int) -> None:
        """Before a lease that may run ``remaining_ms`` more (on the directory's view) is granted:
        make sure a bucket lease outlives it (module docstring, "Read leases"). No etcd call for
        every grant within ``lease_bucket_ms`` of the last bucket; nothing at all when the store
        was opened without ``restart_grace_ms``. Raises ``Deposed`` when a bucket write finds
        another owner."""
        if type(remaining_ms) is not int or remaining_ms < 0:
            raise ValueError(f"remaining_ms must be an int >= 0, got {remaining_ms!r}")
        self._usable()
        if time.monotonic() + remaining_ms / 1000 <= self._mirror_until:
            return
        self._mirror_for(remaining_ms + self._lease_bucket_ms)

    def _mirror_for(self, cover_ms: int) -> None:
        """A bucket lease that outlives ``cover_ms`` from now, unless the last one does (the
        core's ``MirrorLeases`` already adds its bucket)."""
        if self._restart_grace_ms is None:
            return
        if time.monotonic() + cover_ms / 1000 <= self._mirror_until:
            return
        ttl_s = math.ceil(cover_ms / 1000)
        sent = time.monotonic()
        try:
            lease = self._kv.grant_lease(ttl_s)
        except EtcdError as e:
            self._failure = StoreFailed(f"{self.prefix}: could not grant a bucket lease: {e}")
            raise self._failure from e
        marker = _enc({"incarnation": self._incarnation, "ttl_s": ttl_s})
        try:
            self._fenced_txn([Op.put(self._keys.leases + f"{lease:x}".encode(), marker, lease=lease)], advances=None)
        except (Deposed, StoreFailed):
            try:
                self._kv.revoke(lease)
            except EtcdError:
                pass  # it expires on its own
            raise
        self._mirror_until = sent + ttl_s  # etcd starts counting when it receives the grant: later

    # ------------------------------------------------------------------ watching

    def watch_records(
        self,
        callback: Callable[[RecordChange], None] | None = None,
        start_revision: int | None = None,
        *,
        on_error: Callable[[Exception], None] | None = None,
    ) -> RecordWatch:
        """``watch_records`` on this store's prefix and client (see the module function)."""
        self._usable()
        return watch_records(self._kv, self.prefix, callback, start_revision=start_revision, on_error=on_error)

    def read_records(self) -> tuple[dict[BlockKey, Record], int]:
        return read_records(self._kv, self.prefix)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop the keep-alive and revoke the ownership lease (the owner key goes with it, so a
        standby may take over at once). Bucket leases stay: the leases they cover may be live."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._keepalive is not None:
                self._keepalive.stop()
            try:
                self._kv.revoke(self._owner_lease)
            except EtcdError as e:
                log.info("%s: ownership lease not revoked (%s); it expires on its own", self.prefix, e)
        finally:
            self._kv.close()

    def __enter__(self) -> EtcdDirectoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _op(key: bytes, value: bytes | None) -> dict:
    return Op.delete(key) if value is None else Op.put(key, value)


def _size(items: list[tuple[bytes, bytes | None]]) -> int:
    return sum(len(key) + len(value or b"") for key, value in items)
