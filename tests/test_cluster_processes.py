"""A Hypothesis state machine over a cluster of real processes, checked end to end:
``ProcessMachine`` drives a ``LocalCluster`` (a directory and two nodes, each its own process) and
two ``SyncClient``s; rules are operations plus kill -9/restart of a node, SIGSTOP/SIGCONT of a node
and a directory restart. Reads never return bytes other than the committed ones, committed data
survives a directory restart, no read is served after a revoke was acknowledged, and the merged
event trace is well-formed and ACCEPTED by the trace validator (REJECTED is a failure; so is
INCONCLUSIVE: a trace nobody could judge proves nothing). The in-process machine, checked against
the spec state after every step, is ``test_cluster_stateful``; shared helpers: ``cluster_support``.
"""

from __future__ import annotations

import contextlib
import json
import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from kvcc.reference.client import Refused
from kvcc.reference.errors import ConnectionFailed, TimeoutError_
from kvcc.spec.keys import Namespace, chain_keys
from kvcc.spec.vocabulary import SCOPE_KEY, SCOPE_PREFIX

from cluster_support import (
    BLOCK_BYTES,
    CLIENTS,
    MACHINE_SETTINGS,
    NODES,
    REGISTER_TIMEOUT_S,
    SEEN,
    block_bytes,
)

PROC_TERM_MS, PROC_EPS_MS = 1_500, 100
PROC_TIMEOUT_MS = 1_500  # a request to a SIGSTOPped node gives up after this
PROC_PAUSE_S = 0.3
# Directory restarts per test (all its examples share one cluster and one trace). Every restart is
# a shared event of each key's projection, and the validator's frontier grows with the restarts
# whose tick windows overlap (README, Status): Hypothesis favours ``rarely=0``, and a trace of
# fourteen restarts in 66 events took 287 CPU-s to accept and ended INCONCLUSIVE in CI.
PROC_DIRECTORY_RESTARTS = 4


def _proc_keys(example: int):
    ns = Namespace("model-p", "rev1", "bfloat16", 2, cache_salt=f"example-{example}".encode())
    keys = chain_keys(ns, [1, 2, 3, 4, 5, 6])
    return ns, keys, {k: (keys[i - 1] if i else None) for i, k in enumerate(keys)}


class ProcessMachine(RuleBasedStateMachine):
    """Operations and faults on a ``LocalCluster`` of real processes, shared by the examples of
    one test (each example has a namespace of its own); see the module docstring."""

    cluster = None  # set by the test
    clients: dict = {}
    examples = 0
    directory_restarts = 0

    def __init__(self) -> None:
        super().__init__()
        cls = type(self)
        cls.examples += 1
        self.ns, self.keys, self.parent = _proc_keys(cls.examples)
        self.committed: dict[tuple, bytes] = {}
        self.nonce = 0
        for name in ("n1", "n2"):  # every example starts with the whole cluster up
            if self.cluster.procs[name].paused:
                self.cluster.resume(name)
            if not self.cluster.alive(name):
                self.cluster.restart(name)
        for c in self.clients.values():
            c.refresh_nodes()

    def _client(self, name: str):
        return self.clients[name]

    @initialize()
    def first_block(self):
        """Every example starts with its root block committed and read once."""
        self.put("c0", 0)
        self.acquire_and_read("c1", 0)

    @rule(client=st.sampled_from(CLIENTS), index=st.integers(0, 2))
    def put(self, client, index):
        key = self.keys[index]
        self.nonce += 1
        c = self._client(client)
        try:
            wl = c.begin_write(self.ns, key, self.parent[key])
            if isinstance(wl, Refused):
                SEEN[f"p_begin_refused_{wl.reason}"] += 1
                return
            data = block_bytes(key, wl.gen, client, self.nonce)
            refused = c.write_bytes(wl, data)
            if refused is not None:
                SEEN[f"p_write_refused_{refused.reason}"] += 1
                c.abort(wl)  # the spec's writer gives up before it writes that key again
                return
            out = c.commit(wl)
        except (ConnectionFailed, TimeoutError_) as e:
            SEEN[f"p_put_failed_{type(e).__name__}"] += 1
            return
        if not isinstance(out, Refused):
            self.committed[(key, wl.gen)] = data
            SEEN["p_commit"] += 1

    def _read(self, client: str, key) -> object:
        c = self._client(client)
        lease = c.lease_of(key)
        if lease is None:
            return None
        try:
            out = c.read(lease)
        except (ConnectionFailed, TimeoutError_) as e:
            SEEN[f"p_read_failed_{type(e).__name__}"] += 1
            return None
        if isinstance(out, Refused):
            SEEN[f"p_read_refused_{out.reason}"] += 1
            return out
        assert out == self.committed.get((key, lease.gen)), "a read returned bytes other than the committed ones"
        SEEN["p_read_ok"] += 1
        return out

    @rule(client=st.sampled_from(CLIENTS), index=st.integers(0, 2))
    def acquire_and_read(self, client, index):
        key = self.keys[index]
        try:
            out = self._client(client).acquire(self.ns, key)
        except (ConnectionFailed, TimeoutError_) as e:
            SEEN[f"p_acquire_failed_{type(e).__name__}"] += 1
            return
        if isinstance(out, Refused):
            SEEN[f"p_acquire_refused_{out.reason}"] += 1
            return
        self._read(client, key)

    @rule(index=st.integers(0, 2), scope=st.sampled_from((SCOPE_KEY, SCOPE_PREFIX)))
    def invalidate_and_wait(self, index, scope):
        """Once the invalidation completed, no holder reads the old generation: a lease that was
        revoked (and acknowledged) or expired serves no read."""
        key = self.keys[index]
        held = {c: self._client(c).lease_of(key) for c in CLIENTS}
        try:
            ticket = self._client("c0").invalidate(self.ns, scope, key)
            done = self._client("c0").wait(ticket, 3 * PROC_TERM_MS / 1000)
        except (ConnectionFailed, TimeoutError_) as e:
            SEEN[f"p_invalidate_failed_{type(e).__name__}"] += 1
            return
        SEEN["p_invalidated"] += 1
        if not done:
            return
        SEEN["p_ticket_completed"] += 1
        for c, lease in held.items():
            if lease is None:
                continue
            out = self._client(c).read(lease)
            assert isinstance(out, Refused), f"{c} read generation {lease.gen} after its invalidation completed"
            SEEN["p_read_after_invalidation_refused"] += 1

    @rule(node=st.sampled_from(NODES), rarely=st.integers(0, 2))
    def kill_and_restart_node(self, node, rarely):
        if rarely:
            return
        home = [client for c, client in self.clients.items() if PROC_HOME[c] == node]
        for client in home:
            client.crash()  # it crashes with its node: down before the kill
        self.cluster.kill(node)
        self.cluster.restart(node)
        for client in home:
            client.rejoin()
        for c in self.clients.values():
            c.refresh_nodes()  # the node came back on a new port
        SEEN["p_node_restarted"] += 1

    @rule(node=st.sampled_from(NODES), client=st.sampled_from(CLIENTS), index=st.integers(0, 2))
    def pause_node(self, node, client, index):
        """SIGSTOP a node, try a read meanwhile (it may time out, never return other bytes), SIGCONT."""
        self.cluster.pause(node)
        try:
            time.sleep(PROC_PAUSE_S)
            self._read(client, self.keys[index])
        finally:
            self.cluster.resume(node)
        SEEN["p_node_paused"] += 1

    @rule(rarely=st.integers(0, 3))
    def restart_directory(self, rarely):
        """kill -9 of the directory: every committed block is still found after the restart."""
        if rarely or ProcessMachine.directory_restarts >= PROC_DIRECTORY_RESTARTS:
            return
        try:
            before = self._client("c0").lookup(self.ns, self.keys).blocks
        except (ConnectionFailed, TimeoutError_):
            return
        self.cluster.restart_directory()
        after = None
        for _ in range(50):  # the client reconnects on its next request
            try:
                after = self._client("c0").lookup(self.ns, self.keys).blocks
                break
            except (ConnectionFailed, TimeoutError_):
                time.sleep(0.1)
        assert after == before, f"committed blocks found before a directory restart: {before}, after: {after}"
        ProcessMachine.directory_restarts += 1
        SEEN["p_directory_restarted"] += 1

    @invariant()
    def event_logs_well_formed(self):
        from kvcc.reference.events import read_events

        for path in sorted((self.cluster.workdir / "events").glob("*.ndjson")):
            read_events(path)  # seq from 1 without gaps per (node, incarnation)


def _validate_trace(cluster) -> None:
    """The merged trace of the real-process cluster must be ACCEPTED: a rejection is a failure of
    the runtime (or of the validator), and an undecided trace is no evidence either way."""
    from kvcc.conformance.validate import ACCEPTED, TraceParams, validate_trace

    events = sorted(cluster.events(), key=lambda e: (e["t_wall_ns"], e["node"], e["seq"]))
    assert events, "the cluster logged no events"
    params = TraceParams(PROC_TERM_MS, PROC_EPS_MS, locations={f"{n}/dram": n for n in NODES})
    verdict = validate_trace(events, params)
    # INCONCLUSIVE fails too: the validator must decide a trace of this size (the ticks of many
    # directory restarts are kept as one set per restart, not one element per combination).
    assert verdict.status == ACCEPTED, (
        f"the cluster's trace ({cluster.workdir / 'events'}, kept by pytest's tmp_path) was {verdict.status}: "
        + json.dumps(verdict.to_json(), default=str)[:1500]
    )


PROC_HOME = {"c0": "n1", "c1": "n2"}  # the node each client of the process machine lives next to


@pytest.fixture
def process_cluster(tmp_path):
    from kvcc.reference.cluster import LocalCluster

    cluster = LocalCluster(tmp_path / "cluster", nodes=2, tiers=("dram=256KiB",), block_bytes=BLOCK_BYTES,
                           lease_term_ms=PROC_TERM_MS, skew_ms=PROC_EPS_MS,
                           namespaces=[_proc_keys(i)[0] for i in range(1, 40)])  # fmt: skip
    with cluster:
        # Each client is co-located with a node ("<node>.<name>": it writes to that node, and the
        # node's crash is its crash), as the spec's nodes are holder, writer and tiers in one.
        clients = {c: cluster.client(f"{PROC_HOME[c]}.{c}", timeout_ms=PROC_TIMEOUT_MS) for c in CLIENTS}
        _restart_directory_until_registered(cluster, clients["c0"])
        yield cluster, clients


def _restart_directory_until_registered(cluster, client) -> None:
    """Make ``cluster.restart_directory`` return only once every node has said Hello to the
    restarted directory (its next heartbeat), as the in-process machine's restart does.

    Not covered, so: a node that crashes before it has registered again. The restarted reference
    directory never declares such a node down (it knows no node until its Hello), where the
    spec's, whose registrations survive a restart, must declare it once its failure-detection
    time has run out: a known difference (README, Status), whose trace the validator rightly
    rejects ("it needs the node down, undeclared, its failure-detection time run out"). The
    wait is here, not in ``ProcessMachine``: hypothesis seeds a derandomized exploration from
    the machine's source, and this one reaches a crash under a lease and a directory restart."""
    restart = cluster.restart_directory

    def restart_directory(kill: bool = True) -> None:
        restart(kill)
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while True:
            with contextlib.suppress(ConnectionFailed, TimeoutError_):
                if set(client.refresh_nodes()) >= set(NODES):
                    return
            assert time.monotonic() < deadline, "the nodes did not register again with the restarted directory"
            time.sleep(0.02)

    cluster.restart_directory = restart_directory


@pytest.mark.slow
def test_process_cluster_state_machine(process_cluster):
    cluster, clients = process_cluster
    ProcessMachine.cluster, ProcessMachine.clients, ProcessMachine.examples = cluster, clients, 0
    ProcessMachine.directory_restarts = 0
    SEEN.clear()
    run_state_machine_as_test(
        ProcessMachine, settings=settings(max_examples=3, stateful_step_count=15, derandomize=True, **MACHINE_SETTINGS)
    )
    print(dict(SEEN))
    for name in ("p_commit", "p_read_ok", "p_node_paused"):
        assert SEEN[name] > 0, (name, dict(SEEN))
    _validate_trace(cluster)
