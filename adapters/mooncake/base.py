"""What both Mooncake adapters share: the deployment, node faults, store calls and event logs.

Theory of operation
-------------------
``MooncakeDeployment`` brings up, for one ``RunContext``, a real ``mooncake_master`` and
``ctx.nodes`` store-node processes (``kvcc.adapters.mooncake.harness``) under ``ctx.workdir``,
and names the nodes ``n0 .. n{k-1}``. Every operation of the contract that names a node is
carried out by *that node's* store client process; ``call`` maps the harness's failures onto the
contract's ``AdapterError`` (a node that is paused, killed or gone, a master that does not answer).

Node faults are the processes' own: ``kill`` is SIGKILL (the node's segment, and every object
placed in it, is gone), ``restart`` starts a new process (a new incarnation, with an empty
segment), ``pause``/``resume`` are SIGSTOP/SIGCONT. While a node is paused or dead, operations
naming it raise ``AdapterError`` -- at once for those that would not reach the process, after the
request timeout for those that do.

``EventLogs`` keeps one ``kvcc.reference.events.EventLog`` per (component, incarnation) in
memory, so ``events()`` works after ``stop`` and includes killed incarnations.
"""

from __future__ import annotations

import io
import itertools
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvcc.conformance.contract import Adapter, AdapterError, RunContext
from kvcc.reference.events import EventLog, read_events

from . import harness

ADAPTER_VERSION = "0.1.0"
NODE_PREFIX = "n"
STORE_CALL_TIMEOUT_S = 5.0  # one store call; a paused peer's segment makes reads wait this long
SEGMENT_BYTES = 32 << 20  # each node's share of the pool: far above what a conformance run writes
LOCAL_BUFFER_BYTES = 16 << 20
CLIENT_TTL_S = 10  # the master drops a silent client's segment after this

# Mooncake's error codes that the adapters tell apart (mooncake-store types.h ErrorCode).
RC_OK = 0
RC_NO_SPACE = -200
RC_OBJECT_NOT_FOUND = -704
RC_OBJECT_HAS_LEASE = -706
RC_TRANSFER_FAIL = -800
RC_RPC_FAIL = -900


class EventLogs:
    """In-memory protocol event logs, one per (component, incarnation); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._logs: dict[str, EventLog] = {}
        self._streams: list[io.StringIO] = []
        self._incarnations: dict[str, int] = {}

    def log(self, component: str) -> EventLog:
        with self._lock:
            log = self._logs.get(component)
            if log is None:
                log = self._new(component, 0)
            return log

    def new_incarnation(self, component: str) -> EventLog:
        with self._lock:
            return self._new(component, self._incarnations.get(component, -1) + 1)

    def _new(self, component: str, incarnation: int) -> EventLog:
        stream = io.StringIO()
        log = EventLog(stream, component, incarnation)
        self._streams.append(stream)
        self._logs[component] = log
        self._incarnations[component] = incarnation
        return log

    def emit(self, component: str, event: str, **fields: Any) -> None:
        self.log(component).emit(event, **fields)

    def all(self) -> list[dict]:
        """Every record of every log, merged in the order they were emitted (one process's
        monotonic clock), each log's seq intact."""
        with self._lock:
            texts = [s.getvalue() for s in self._streams]
        records = [r for text in texts for r in read_events(io.StringIO(text))]
        return sorted(records, key=lambda r: (r["t_local_ns"], r["node"], r["seq"]))


class MooncakeDeployment(Adapter):
    """The lifecycle, node faults and store calls of both Mooncake adapters."""

    store_lease_ms: int = 0  # set by start: the master's --default_kv_lease_ttl

    def __init__(self) -> None:
        self._master: harness.MooncakeMaster | None = None
        self._node_ids: tuple[str, ...] = ()
        self._segments: dict[str, str] = {}  # node -> its segment name (host:port)
        self._state_lock = threading.Lock()
        self._ctx: RunContext | None = None
        self._stopped = threading.Event()
        self._ids = itertools.count(1)
        self.logs = EventLogs()

    # ------------------------------------------------------------------ lifecycle
    def _store_lease_ms(self, ctx: RunContext) -> int:
        return ctx.lease_term_ms

    def start(self, ctx: RunContext) -> None:
        self._ctx = ctx
        self.store_lease_ms = self._store_lease_ms(ctx)
        try:
            master = harness.MooncakeMaster(
                ctx.workdir / "mooncake", lease_ttl_ms=self.store_lease_ms, client_ttl_s=CLIENT_TTL_S
            )
            self._master = master
            master.start()
            ids = tuple(f"{NODE_PREFIX}{i}" for i in range(ctx.nodes))
            for node in ids:
                master.start_node(node, segment_bytes=SEGMENT_BYTES, buffer_bytes=LOCAL_BUFFER_BYTES)
                self._segments[node] = str(master.node(node).call("hostname")[0])
            self._node_ids = ids
        except (harness.MooncakeHarnessError, OSError) as e:
            self.stop()
            raise AdapterError(f"Mooncake deployment did not come up: {e}") from None

    def stop(self) -> None:
        self._stopped.set()
        master, self._master = self._master, None
        if master is not None:
            try:
                master.stop()
            except Exception:  # stop must not raise; the harness's atexit hook reaps the rest
                pass

    def nodes(self) -> Sequence[str]:
        return self._node_ids

    def versions(self) -> Mapping[str, str]:
        try:
            store = harness.mooncake_version()
        except harness.MooncakeNotInstalled:
            store = "not installed"
        return {f"kvcc-adapter-{self.name}": ADAPTER_VERSION, harness.MOONCAKE_DIST: store}

    # ------------------------------------------------------------------ nodes
    def _check_node(self, node: str) -> harness.StoreNode:
        if node not in self._node_ids:
            raise AdapterError(f"unknown node {node!r} (nodes: {list(self._node_ids)})")
        master = self._master
        if master is None:
            raise AdapterError("the deployment is not running")
        try:
            return master.node(node)
        except harness.MooncakeHarnessError as e:
            raise AdapterError(str(e)) from None

    def _node_up(self, node: str) -> harness.StoreNode:
        """The node's process, which must be running and not paused (else ``AdapterError``)."""
        n = self._check_node(node)
        if not n.is_running():
            raise AdapterError(f"node {node} is down (killed)")
        if n.paused:
            raise AdapterError(f"node {node} is paused")
        return n

    def outsider(self, grant: Any, how: str) -> str:
        """The node whose store client an outsider's request (``Adapter.intrude``) goes through:
        another node's where one is up. Mooncake Store has no principals -- every client of the
        master reaches every object by name, and no grant is presented or checked -- so another
        client is an outsider, and ``how`` (``INTRUSIONS``) changes nothing."""
        from kvcc.conformance.contract import INTRUSIONS

        if how not in INTRUSIONS:
            raise ValueError(f"intrude presents one of {list(INTRUSIONS)}, got {how!r}")
        for node in [n for n in self._node_ids if n != grant.node] + [grant.node]:
            n = self._check_node(node)
            if n.is_running() and not n.paused:
                return node
        raise AdapterError("no node's store client is up")

    def call(self, node: str, op: str, *, payload: bytes = b"", **args: Any) -> tuple[Any, bytes]:
        n = self._check_node(node)
        try:
            return n.call(op, payload=payload, timeout_s=STORE_CALL_TIMEOUT_S, **args)
        except harness.NodeTimeout as e:
            raise AdapterError(f"timeout: {e}") from None
        except harness.NodeGone as e:
            raise AdapterError(f"node down: {e}") from None
        except harness.MooncakeHarnessError as e:
            raise AdapterError(str(e)) from None

    def rc(self, node: str, op: str, **args: Any) -> int:
        result, _ = self.call(node, op, **args)
        if type(result) is not int:
            raise AdapterError(f"node {node}: {op} answered {result!r:.80}, not a return code")
        return result

    def segment(self, node: str) -> str:
        return self._segments[node]

    # ------------------------------------------------------------------ faults
    def kill(self, node: str) -> None:
        n = self._check_node(node)
        n.kill()
        self._on_killed(node)

    def restart(self, node: str) -> None:
        n = self._check_node(node)
        if n.is_running():
            n.kill()
            self._on_killed(node)
        try:
            n.start()
            self._segments[node] = str(n.call("hostname", timeout_s=STORE_CALL_TIMEOUT_S)[0])
        except harness.MooncakeHarnessError as e:
            raise AdapterError(f"node {node} did not restart: {e}") from None
        self._on_restarted(node)

    def pause(self, node: str) -> None:
        n = self._check_node(node)
        try:
            n.pause()
        except harness.MooncakeHarnessError as e:
            raise AdapterError(str(e)) from None

    def resume(self, node: str) -> None:
        self._check_node(node).resume()
        self._on_resumed(node)

    def _on_killed(self, node: str) -> None:
        pass

    def _on_restarted(self, node: str) -> None:
        pass

    def _on_resumed(self, node: str) -> None:
        pass

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def now_ns() -> int:
        return time.monotonic_ns()

    def next_id(self) -> int:
        return next(self._ids)

    @property
    def ctx(self) -> RunContext:
        if self._ctx is None:
            raise AdapterError("the adapter was not started")
        return self._ctx
