"""The protocol event log: one JSON object per line (NDJSON), one line per protocol step.

Trace validation (docs/protocol.md: "How the pieces check each other") replays what implementations did
through the spec's successor function, so every event is named by the spec action it performs
(``EVENTS``: ``kvcc.spec.vocabulary``, the model's ``ACTIONS`` but the environment's). What the spec
only lets the *environment* do -- time passing, clock steps, the network losing or duplicating
a message -- no process can observe, so it is not an event.

A line::

    {"node": "n1", "incarnation": 3, "seq": 17, "t_local_ns": ..., "t_wall_ns": ...,
     "event": "grant_read_lease", "key": "<64 hex>", "gen": 2, "epoch": 5, "lease": 41,
     "result": "ok", ...extra fields}

- ``seq`` starts at 1 and increases by one per line of one log; ``(node, incarnation)`` names the
  log. A node that restarts takes a new, higher incarnation; a restarted engine that reused its
  incarnation would restart ``seq`` and be caught by ``read_events`` (docs/protocol.md: "an engine restart
  that resets its event sequence → stale routing index").
- ``t_local_ns`` is ``time.monotonic_ns()``: it orders one process's events and never steps back,
  but means nothing across machines. ``t_wall_ns`` is ``time.time_ns()``: the node's wall clock,
  within epsilon of the others' (the spec's clock assumption), and it may step. The validator
  reads time as intervals from both. Both clocks are injectable (tests use mock clocks).
- ``key`` (a ``BlockKey`` or 64 hex digits), ``gen``, ``epoch``, ``lease`` and ``result`` are on
  every line, ``null`` when the event has none. Extra fields are JSON values; ``BlockKey`` values
  become hex and ``bytes`` become hex text.

``EventLog.emit`` is thread-safe and writes each line in one call, flushed at once unless
``flush_each_line=False``. ``emit(..., late_ns=d)`` stamps a step logged ``d`` ns after the
directory took it (a timer's due time, a request's arrival) at that time (both clocks ``d``
earlier), never before the log's previous line: the step is the spec's at that time, unobserved
until it is logged (``CoreHost.late_ns``). ``d`` may be a function, called once the line's clocks
are read: a wait for the log (its lock, a shared clock's) between the caller's measure and the
stamp would otherwise be stamped as if the step had been taken after it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

from kvcc.spec.keys import BlockKey
from kvcc.spec.vocabulary import ENVIRONMENT_ACTIONS, EVENTS

from .errors import Malformed, ProtocolViolation

# The spec's action names that a process can log, and the environment's, which none logs: the
# protocol's words (``kvcc.spec.vocabulary``).
_EVENT_SET = frozenset(EVENTS)
assert len(_EVENT_SET) == len(EVENTS)
assert not _EVENT_SET & set(ENVIRONMENT_ACTIONS)

STANDARD_FIELDS = ("node", "incarnation", "seq", "t_local_ns", "t_wall_ns", "event", "key", "gen", "epoch", "lease", "result")
MAX_EVENT_LINE_BYTES = 1 << 20  # read_events refuses longer lines


def _json_default(value: Any) -> Any:
    if isinstance(value, BlockKey):
        return value.hex
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"an event field of type {type(value).__name__} has no JSON form")


class EventLog:
    """Appends protocol events of one process incarnation to a file (path) or a text stream.

    ``EventLog(sink, node_id, incarnation, *, flush_each_line=True, monotonic_ns=time.monotonic_ns,
    wall_ns=time.time_ns)``. ``emit(event, key=None, gen=None, epoch=None, lease=None,
    result=None, **fields) -> dict`` writes and returns the record. An event name that is not in
    ``EVENTS``, an extra field that shadows a standard one, or a value without a JSON form is our
    bug: ``ProtocolViolation``. Use as a context manager, or call ``close()``.
    """

    def __init__(
        self,
        sink: str | os.PathLike[str] | IO[str],
        node_id: str,
        incarnation: int,
        *,
        flush_each_line: bool = True,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
        wall_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        if type(node_id) is not str or not node_id:
            raise ValueError("node_id is non-empty text")
        if type(incarnation) is not int or incarnation < 0:
            raise ValueError("incarnation is an int >= 0")
        if isinstance(sink, (str, os.PathLike)):
            self._stream: IO[str] = open(sink, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
            self._owns_stream = True
        else:
            self._stream = sink
            self._owns_stream = False
        self.node_id = node_id
        self.incarnation = incarnation
        self.flush_each_line = flush_each_line
        self._monotonic_ns = monotonic_ns
        self._wall_ns = wall_ns
        self._lock = threading.Lock()
        self._seq = 0  # the last line's number, staged or written
        self._written_seq = 0
        self._staged_from = (0, 0)  # the stamps before the first line still staged
        self._last_local_ns = 0
        self._last_wall_ns = 0
        self._closed = False

    @property
    def last_seq(self) -> int:
        return self._seq

    def emit(
        self,
        event: str,
        *,
        key: BlockKey | str | None = None,
        gen: int | None = None,
        epoch: int | None = None,
        lease: int | None = None,
        result: str | None = None,
        late_ns: int | Callable[[], int] = 0,
        **fields: Any,
    ) -> dict[str, Any]:
        with self._lock:
            record, line = self._stage(event, key, gen, epoch, lease, result, late_ns, fields)
            self._write(line)
        return record

    def stage(self, event: str, *, late_ns: int | Callable[[], int] = 0, **fields: Any) -> str:
        """``emit``'s line (the same fields), stamped and numbered now but not written: the
        caller writes it with ``write_staged`` (after making it durable with the step it logs:
        the directory's events tail), every staged line in the order staged and before any
        ``emit``, or gives up all it staged with ``discard_staged`` (the step did not happen)."""
        pop = fields.pop
        with self._lock:
            return self._stage(event, pop("key", None), pop("gen", None), pop("epoch", None), pop("lease", None),
                               pop("result", None), late_ns, fields)[1]  # fmt: skip

    def write_staged(self, lines: Iterable[str]) -> None:
        """Write lines ``stage`` returned, in their order (flushed unless ``flush_each_line`` is off)."""
        with self._lock:
            for line in lines:
                self._write(line)

    def discard_staged(self, count: int) -> None:
        """Give up the ``count`` lines staged and not written -- all of them: their numbers are
        used again, so the log stays contiguous."""
        with self._lock:
            if count != self._seq - self._written_seq:
                raise ProtocolViolation(f"discard_staged({count}) with {self._seq - self._written_seq} lines staged")
            if count:
                self._seq -= count
                self._last_local_ns, self._last_wall_ns = self._staged_from

    def _stage(self, event: str, key: Any, gen: Any, epoch: Any, lease: Any, result: Any,
               late_ns: int | Callable[[], int], fields: dict[str, Any]) -> tuple[dict[str, Any], str]:  # fmt: skip
        if event not in _EVENT_SET:
            raise ProtocolViolation(f"{event!r} is not a spec action that a process logs (see EVENTS)")
        clash = set(fields) & set(STANDARD_FIELDS)
        if clash:
            raise ProtocolViolation(f"extra fields shadow standard ones: {sorted(clash)}")
        if isinstance(key, BlockKey):
            key = key.hex
        elif key is not None:
            try:
                BlockKey.from_hex(key)  # 64 lowercase hex digits
            except ValueError as e:
                raise ProtocolViolation(f"event {event!r}: {e}") from None
        if self._closed:
            raise ProtocolViolation("emit on a closed EventLog")
        t_local, t_wall = self._monotonic_ns(), self._wall_ns()
        if callable(late_ns):  # how late, measured now that this line's clocks are read
            late_ns = late_ns()
        if late_ns > 0:  # back to the due time, but not before the previous line
            t_local = max(t_local - late_ns, min(self._last_local_ns, t_local))
            t_wall = max(t_wall - late_ns, min(self._last_wall_ns, t_wall))
        record: dict[str, Any] = {
            "node": self.node_id,
            "incarnation": self.incarnation,
            "seq": self._seq + 1,
            "t_local_ns": t_local,
            "t_wall_ns": t_wall,
            "event": event,
            "key": key,
            "gen": gen,
            "epoch": epoch,
            "lease": lease,
            "result": result,
            **fields,
        }
        try:
            line = json.dumps(record, default=_json_default, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ProtocolViolation(f"event {event!r}: {e}") from None
        if self._seq == self._written_seq:
            self._staged_from = (self._last_local_ns, self._last_wall_ns)
        self._seq += 1
        self._last_local_ns, self._last_wall_ns = t_local, t_wall
        return record, line

    def _write(self, line: str) -> None:
        self._stream.write(line + "\n")  # one write per line: lines never interleave
        if self.flush_each_line:
            self._stream.flush()
        self._written_seq += 1

    def flush(self) -> None:
        with self._lock:
            self._stream.flush()

    @contextlib.contextmanager
    def flushed_at_end(self) -> Iterator[None]:
        """Within: lines are written but flushed once, at the end (a batch of steps answered
        together: one system call, not one per line). The caller flushes earlier (``flush``)
        before anything a buffered step sends leaves the process, so a killed process's log
        still holds every step anyone saw the effect of."""
        with self._lock:
            before, self.flush_each_line = self.flush_each_line, False
        try:
            yield
        finally:
            with self._lock:
                self.flush_each_line = before
                if not self._closed:
                    self._stream.flush()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stream.flush()
            if self._owns_stream:
                self._stream.close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def append_missing(path: str | os.PathLike[str], lines: Iterable[str]) -> int:
    """Append to the log file ``path`` those of ``lines`` -- one log's last lines, as ``stage``
    made them and a durable store kept them with the step they log (the directory's events tail)
    -- that the file lacks: the ones numbered past the last line of their ``(node,
    incarnation)`` in it. A process killed after its step was durable but before its line was
    written loses no line this way. A torn last line (killed mid-write) is cut first. Returns how
    many were appended. Call it before anything else writes to ``path``."""
    wanted = [(json.loads(line), line) for line in lines]
    if not wanted:
        return 0
    log = (wanted[0][0]["node"], wanted[0][0]["incarnation"])
    if any((r["node"], r["incarnation"]) != log for r, _ in wanted):
        raise ValueError("the lines of more than one log")
    last = 0
    with open(path, "a+b") as f:
        f.seek(0)
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            f.truncate(end)  # a torn last line: its whole form is in ``lines``, or it never counted
        prefix = f'{{"node":{json.dumps(log[0])},"incarnation":{log[1]},"seq":'.encode()
        at = data.rfind(prefix, 0, end)
        while at > 0 and data[at - 1 : at] != b"\n":
            at = data.rfind(prefix, 0, at)
        if at >= 0:
            last = json.loads(data[at : data.index(b"\n", at)])["seq"]
        missing = [line for r, line in wanted if r["seq"] > last]
        f.seek(0, os.SEEK_END)
        f.write("".join(line + "\n" for line in missing).encode())
        f.flush()
    return len(missing)


def _check_record(record: Any, where: str) -> None:
    if type(record) is not dict:
        raise Malformed(f"{where}: not a JSON object")
    for name in STANDARD_FIELDS:
        if name not in record:
            raise Malformed(f"{where}: missing {name!r}")
    if type(record["node"]) is not str or not record["node"]:
        raise Malformed(f"{where}: node is non-empty text")
    for name in ("incarnation", "seq", "t_local_ns", "t_wall_ns"):
        if type(record[name]) is not int or record[name] < 0:
            raise Malformed(f"{where}: {name} is an int >= 0")
    if record["event"] not in _EVENT_SET:
        raise Malformed(f"{where}: {record['event']!r} is not a spec action (EVENTS)")
    key = record["key"]
    if key is not None:
        if type(key) is not str:
            raise Malformed(f"{where}: key is hex text or null")
        try:
            BlockKey.from_hex(key)
        except ValueError as e:
            raise Malformed(f"{where}: {e}") from None
    for name in ("gen", "epoch", "lease"):
        v = record[name]
        if v is not None and (type(v) is not int or v < 0):
            raise Malformed(f"{where}: {name} is an int >= 0 or null")
    if record["result"] is not None and type(record["result"]) is not str:
        raise Malformed(f"{where}: result is text or null")


def _lines(source: str | os.PathLike[str] | IO[str] | Iterable[str]) -> Iterable[str]:
    if isinstance(source, (str, os.PathLike)):
        with open(source, encoding="utf-8") as f:
            yield from f
    else:
        yield from source


def read_events(
    source: str | os.PathLike[str] | IO[str] | Iterable[str], *, contiguous: bool = True
) -> list[dict[str, Any]]:
    """Parse and validate an event log (a path, a text stream or an iterable of lines), possibly
    the concatenation of several nodes' and incarnations' logs. Checks every standard field and,
    per ``(node, incarnation)``, that ``seq`` strictly increases; with ``contiguous`` (the
    default) also that it starts at 1 and rises by exactly one per line, so that a lost line is
    caught too (pass ``contiguous=False`` for a log cut from the middle). Raises ``Malformed``
    naming the line."""
    events: list[dict[str, Any]] = []
    last: dict[tuple[str, int], int] = {}
    for number, line in enumerate(_lines(source), start=1):
        where = f"line {number}"
        if len(line) > MAX_EVENT_LINE_BYTES:
            raise Malformed(f"{where}: longer than {MAX_EVENT_LINE_BYTES} bytes")
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise Malformed(f"{where}: not JSON ({e})") from None
        _check_record(record, where)
        log = (record["node"], record["incarnation"])
        previous = last.get(log, 0)
        if record["seq"] <= previous or (contiguous and record["seq"] != previous + 1):
            raise Malformed(
                f"{where}: seq {record['seq']} of node {log[0]!r} incarnation {log[1]} follows seq {previous}"
            )
        last[log] = record["seq"]
        events.append(record)
    return events


def events_from_text(text: str, *, contiguous: bool = True) -> list[dict[str, Any]]:
    """``read_events`` over a string (convenient in tests)."""
    return read_events(io.StringIO(text), contiguous=contiguous)
