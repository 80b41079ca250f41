"""The one host of the directory core: its clock, its durable effects first, its steps logged in
order, its directives handed on in order, its timers.

Theory of operation
-------------------
``DirectoryCore`` decides and does no I/O. Every deployment of it -- the directory server (TCP on
asyncio, ``server.py``), the suite's in-process kit (``kvcc.conformance.testing``) and the
Mooncake adapter (``kvcc.adapters.mooncake.adapter``) -- does the same things around each call,
in the order the core's docstring requires, and ``CoreHost`` is that, once:

1. **The clock**: milliseconds since the host started, on an injectable monotonic clock
   (``monotonic_ns``; tests pass a manual one). ``restart`` installs a new core -- a directory
   restarted on its durable log -- and, if asked, a new clock (the core allows it: ``restarted``
   re-bases write leases).
2. **Durable effects first** (``Persist``, ``PersistTicket``, ``ForgetTicket``,
   ``ReserveLeaseIds``): handed to ``commit`` in one call before anything of the same step is
   logged or leaves. A ``commit`` that raises stops the step there (the caller decides what a
   failed durable log means: the server stops serving).
3. **The steps logged**: each ``Emit`` that is a spec action goes to ``emit(Emit, late_ns)``, in
   the core's order, before any directive of the step leaves (a step's event is stamped before
   what it sends). ``late_ns`` is how long after the directory time the core took the step at (a
   request's arrival, a timer's due time) it gets logged: the log stamps it back to then -- a
   durable commit, a slow timer or a descheduled thread in between is no time the spec sees.
4. **The directives** (``Send``, ``FreeAt``, ``CopyAt``, ``CompleteTicket``) come back in order
   from ``record`` / ``handle`` / ``tick``: how one travels -- a push on a connection, a call in
   the same process, a queue to a thread -- is all that differs between the hosts, so each
   carries them out itself (under its lock, or after it).
5. **Timers**: ``due`` says whether the core's next deadline has come, ``tick`` runs it, and
   ``wait_s`` says how long a timer may sleep before the next one (capped: a host's timer
   re-reads the deadline at least that often).
6. **Failure detection**, for a host that sees its own nodes die (the kit, the Mooncake adapter;
   the server has its watchdog of connections and heartbeats instead): ``killed(node,
   locations)`` starts the node's registration running out -- one lease term on the directory's
   clock, the spec's failure-detection time -- and the first ``handle``, ``tick`` or ``detect``
   at or after that time declares it down (``core.node_down``, the spec's urgent
   ``declare_node_down``), stamped when it fell due. ``rejoined(node)`` stops it; the caller then
   has the core take the rejoin and brings the node's locations back (``core.locations_up``, as
   the server does at a Hello: what is owed to them leaves at once); after ``restart``,
   ``restore_declared`` tells the new core what was declared (the spec keeps it across a
   directory restart). A host that calls the core directly calls
   ``detect`` first.
7. **Frees to a location that is down are not sent**: with ``reachable(location)`` given, a
   ``retry_free`` to a location no live node serves is not logged (its ``FreeAt`` is dropped by
   the host, which has nowhere to send it): the spec retries a free only to a location that is
   up. The core tries again later, and at once when the node is back (``locations_up``).

The host holds no lock: the server calls it from its event loop's one thread, the threaded hosts
under their own lock, so the core is never entered twice at once.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .core import DURABLE_EFFECTS, DirectoryCore, Effect, Emit


class Journal(Protocol):
    """Where a host with durable steps logs them (see ``CoreHost``)."""

    def stage(self, e: Emit, late_ns: Callable[[], int]) -> str | None: ...
    def write(self, lines: list[str]) -> None: ...
    def discard(self, lines: list[str]) -> None: ...


class CoreHost:
    """``CoreHost(core, *, commit=None, emit=None, journal=None, monotonic_ns=time.monotonic_ns)``
    (see the module docstring). ``commit(durable_effects)``: make them durable (``None``: nothing
    is); ``emit(Emit, late_ns)``: log one spec action, stamped ``late_ns`` earlier -- a function
    the log calls once it has read its clocks (``EventLog.emit``) -- (``None``: nothing is
    logged). ``journal``: a step with durable effects is then staged (``journal.stage(Emit,
    late_ns)``: its line, or ``None`` for none), committed with its lines (``commit(durable,
    lines)``) and written (``journal.write(lines)``); a commit that raises gives them up
    (``journal.discard(lines)``). ``reachable(location)``: whether a live node serves the
    location (``None``: every location is; see 7. in the module docstring)."""

    def __init__(
        self,
        core: DirectoryCore,
        *,
        commit: Callable[[list[Effect]], Any] | None = None,
        emit: Callable[[Emit, Callable[[], int]], Any] | None = None,
        journal: Journal | None = None,
        reachable: Callable[[str], bool] | None = None,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.core = core
        self._reachable = reachable
        self._commit = commit
        self._emit = emit
        self._silent: dict[str, tuple[int, tuple[str, ...]]] = {}  # node -> (ms it is declared down, its locations)
        self.declared: dict[str, tuple[str, ...]] = {}  # node declared down -> its locations
        self._journal = journal
        self._monotonic_ns = monotonic_ns
        self._start_ns = self._read_ns = monotonic_ns()

    def now_ms(self) -> int:
        """The directory time, in ms since the host started. The reading is kept to the
        nanosecond: the steps a core call takes at it are stamped there (``late_ns``)."""
        self._read_ns = self._monotonic_ns()
        return (self._read_ns - self._start_ns) // 1_000_000

    def late_ns(self, e: Emit) -> int:
        """How long after the directory time the core took the step ``e`` logs at (``Emit.at_ms``:
        a request's arrival, a timer's due time; to the nanosecond of the clock reading the call
        was made at, when the step was taken then) it is logged now: the event log stamps it that
        much earlier, when the spec takes it (``EventLog.emit(late_ns=...)``; the log never
        stamps before its previous line). The core decides on that time alone, and the host
        holds it (one thread, or its lock) until the step is logged: nothing observes the
        directory in between, so a durable commit or a descheduled thread there is no time the
        spec sees -- stamped at the log's own clock, a commit decided just before a write lease
        ran out would read as taken after its expiry was due (the late-commit flake)."""
        return max(0, self._monotonic_ns() - self._taken_ns(e))

    def _taken_ns(self, e: Emit) -> int:
        read = self._read_ns  # the reading the call was made at, unless it took a timer due earlier
        return read if (read - self._start_ns) // 1_000_000 == e.at_ms else self._start_ns + e.at_ms * 1_000_000

    def _late_from(self, taken_ns: int) -> int:
        return max(0, self._monotonic_ns() - taken_ns)

    def restart(self, core: DirectoryCore, *, new_clock: bool = False) -> None:
        """Host ``core`` from now on (a directory restarted on its durable log); with
        ``new_clock`` its clock starts again at 0, as a restarted process's would."""
        self.core = core
        if new_clock:
            now = self.now_ms()
            self._start_ns = self._read_ns = self._monotonic_ns()
            # A silent node's registration keeps running out, on the new clock from its reading.
            self._silent = {n: (max(0, due - now), locs) for n, (due, locs) in self._silent.items()}

    def restore_declared(self) -> None:
        """After ``restart`` and the core's ``restarted``: the nodes declared down stay down."""
        self.core.down_locations |= {loc for locs in self.declared.values() for loc in locs}

    def killed(self, node: str, locations: Sequence[str]) -> None:
        """``node`` (serving ``locations``) died now: declared down one lease term from now."""
        self._silent[node] = (self.now_ms() + self.core.config.lease_term_ms, tuple(locations))

    def rejoined(self, node: str) -> None:
        """``node`` is back (before the core takes its rejoin): no longer silent, nor declared down."""
        self._silent.pop(node, None)
        self.declared.pop(node, None)

    def detect(self) -> list[Effect]:
        """Declare down every killed node whose detection time has come, at that time, earliest
        first: the directives it left."""
        if not self._silent:
            return []
        now = self.now_ms()
        directives: list[Effect] = []
        for node, (due, locations) in sorted(self._silent.items(), key=lambda item: item[1][0]):
            if due > now:
                break
            del self._silent[node]
            self.declared[node] = locations
            directives += self.record(self.core.node_down(node, locations, max(due, self.core.now_ms)))
        return directives

    def _logged(self, e: Emit) -> bool:
        """Whether ``e`` is a step the log takes: a spec action, and not a free retried to a
        location that is down (7. in the module docstring)."""
        if not e.is_spec_action:
            return False
        return e.event != "retry_free" or self._reachable is None or self._reachable(e.fields["location"])

    def record(self, effects: Sequence[Effect]) -> list[Effect]:
        """Commit the durable effects, then log the spec steps, in order; the directives, in order."""
        durable = [e for e in effects if isinstance(e, DURABLE_EFFECTS)]
        if durable and self._commit is not None and self._journal is not None:
            return self._record_journaled(effects)
        if durable and self._commit is not None:
            self._commit(durable)
        directives = []
        for e in effects:
            if type(e) is Emit:
                if self._emit is not None and self._logged(e):
                    # How late, measured by the log once it has read its clocks (a wait for the
                    # log's lock or clock in between would otherwise count as time the step took).
                    self._emit(e, functools.partial(self._late_from, self._taken_ns(e)))
            elif not isinstance(e, DURABLE_EFFECTS):
                directives.append(e)
        return directives

    def prepare(self, effects: Sequence[Effect]) -> tuple[list[Effect], list[str], list[Effect]]:
        """For a host that commits elsewhere (the directory server's commit thread): the durable
        effects, every spec step's line staged (numbered and stamped now, ``journal.stage``),
        and the directives -- nothing committed or written. The caller commits the effects with
        the lines, then writes the lines, then carries out the directives, in this order."""
        assert self._journal is not None, "prepare needs a journal"
        lines = []
        for e in effects:
            if type(e) is Emit and self._logged(e):
                line = self._journal.stage(e, functools.partial(self._late_from, self._taken_ns(e)))
                if line is not None:
                    lines.append(line)
        durable = [e for e in effects if isinstance(e, DURABLE_EFFECTS)]
        return durable, lines, [e for e in effects if type(e) is not Emit and not isinstance(e, DURABLE_EFFECTS)]

    def _record_journaled(self, effects: Sequence[Effect]) -> list[Effect]:
        durable, lines, directives = self.prepare(effects)
        assert self._journal is not None and self._commit is not None
        try:
            self._commit(durable, lines)  # type: ignore[call-arg]  (a journaled host's commit takes its lines)
        except BaseException:
            self._journal.discard(lines)
            raise
        self._journal.write(lines)
        return directives

    def handle(self, msg: Any, tenant: str) -> tuple[Any, list[Effect]]:
        """One request: the core's reply and the directives it left, its step recorded."""
        declared = self.detect()
        reply, effects = self.core.handle(msg, self.now_ms(), tenant)
        return reply, declared + self.record(effects)

    def _next_deadline_ms(self) -> int | None:
        deadlines = [d for d in (self.core.next_deadline_ms(), *(due for due, _ in self._silent.values())) if d is not None]
        return min(deadlines, default=None)

    def due(self) -> bool:
        deadline = self._next_deadline_ms()
        return deadline is not None and deadline <= self.now_ms()

    def tick(self) -> list[Effect]:
        """Let time pass to now (detections, expiries, completions, retries): the directives it left."""
        declared = self.detect()
        return declared + self.record(self.core.tick(self.now_ms()))

    def wait_s(self, cap_s: float) -> float:
        """How long a timer may sleep: until the next deadline (the core's, a detection's), at
        most ``cap_s``."""
        deadline = self._next_deadline_ms()
        if deadline is None:
            return cap_s
        return min(cap_s, max(0.0, (deadline - self.now_ms()) / 1000))
