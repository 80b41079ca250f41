"""Crashes at exact points of the directory's code, on real processes (``reference.failpoints``):
what each leaves behind must still be a trace the spec explains.

``directory.committed_unlogged``: the directory is killed after a step is durable and before its
event line is written. The restarted directory acts on that state (here: the write lease it
granted runs out, ``expire_write_lease``), so a trace without the step is unexplainable -- the
soak found it (README, Soak: "a step the trace never shows"). The store keeps each commit's lines
(its events tail) and the restarted directory appends the ones its predecessor's log lacks; the
trace is then ACCEPTED, and the same trace with the recovered line taken out is REJECTED (so the
test can fail).
"""

from __future__ import annotations

import json
import time

import pytest

from kvcc.reference.cluster import LocalCluster
from kvcc.reference.client import Refused, WriteLease
from kvcc.reference.errors import ConnectionFailed, TimeoutError_
from kvcc.reference.failpoints import ENV
from kvcc.spec.keys import Namespace, chain_keys

TERM_MS, SKEW_MS = 1_000, 100
BLOCK_BYTES = 4096
NS = Namespace("model-crash", "rev1", "bfloat16", 2)
NODES = ("n1", "n2")


def _validate(events):
    from kvcc.conformance.validate import TraceParams, validate_trace

    params = TraceParams(TERM_MS, SKEW_MS, locations={f"{n}/dram": n for n in NODES})
    return validate_trace(sorted(events, key=lambda e: (e["t_wall_ns"], e["node"], e["seq"])), params)


def _until(what: str, condition, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (got := condition()):
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)
    return got


def _registered(client) -> bool:
    try:
        return set(client.refresh_nodes()) >= set(NODES)
    except (ConnectionFailed, TimeoutError_):
        return False


@pytest.mark.parametrize("backend", ["sqlite", "etcd"])
def test_a_directory_killed_between_its_commit_and_its_log_loses_no_line(tmp_path, backend, request):
    kw = {}
    if backend == "etcd":
        etcd1 = request.getfixturevalue("etcd1")
        kw = {"backend": "etcd", "etcd_endpoints": ",".join(etcd1.endpoints), "etcd_prefix": f"crash-{tmp_path.name}"}
    k0, k1 = chain_keys(NS, list(range(2 * NS.block_tokens)))
    with LocalCluster(tmp_path / "cluster", nodes=2, tiers=("dram=1MiB",), block_bytes=BLOCK_BYTES,
                      lease_term_ms=TERM_MS, skew_ms=SKEW_MS, namespaces=[NS], **kw) as cluster:  # fmt: skip
        c = cluster.client("n1.c0", timeout_ms=2_000)
        wl = c.begin_write(NS, k0, None)
        assert isinstance(wl, WriteLease)
        assert c.write_bytes(wl, b"a" * BLOCK_BYTES) is None and not isinstance(c.commit(wl), Refused)
        # Armed for the restarted directory's first step that logs a line with its commit.
        directory = cluster.procs["directory"]
        directory.env[ENV] = "directory.committed_unlogged=1"
        cluster.restart_directory()
        _until("the nodes are registered again", lambda: _registered(c))

        def granted_and_killed() -> bool:
            try:
                got = c.begin_write(NS, k1, k0)
            except (ConnectionFailed, TimeoutError_):
                return True  # granted and durable, then the directory died before logging it
            assert isinstance(got, Refused), got  # the restart grace: nothing granted, nothing durable
            time.sleep(0.1)
            return False

        _until("the armed directory dies on the write it grants", granted_and_killed)
        _until("the directory is gone", lambda: not cluster.alive("directory"))
        del directory.env[ENV]
        cluster.restart_directory()
        _until("the nodes are registered again", lambda: _registered(c))
        # The write lease granted before the kill runs out under the restarted directory: a step
        # on state only the recovered line shows. Then the key is written again.
        def writable():
            got = c.begin_write(NS, k1, k0)
            if isinstance(got, WriteLease):
                return got
            time.sleep(0.1)
            return None

        wl = _until("the key is writable again", writable)
        assert c.write_bytes(wl, b"b" * BLOCK_BYTES) is None and not isinstance(c.commit(wl), Refused)
        lease = c.acquire(NS, k1)
        assert c.read(lease) == b"b" * BLOCK_BYTES
        c.release(lease)
    events = cluster.events()
    log = cluster.workdir / "logs" / "directory.log"
    assert "recovered from the store" in log.read_text(), "the restarted directory recovered no line"
    grants = [e for e in events if e["node"] == "directory" and e["event"] == "grant_write_lease" and e["key"] == k1.hex]
    killed = sorted({e["incarnation"] for e in events if e["node"] == "directory"})[-2]
    recovered = [e for e in grants if e["incarnation"] == killed]
    assert len(recovered) == 1, json.dumps(grants)
    assert any(e["event"] == "expire_write_lease" and e["key"] == k1.hex for e in events)
    verdict = _validate(events)
    assert verdict.status == "ACCEPTED", json.dumps(verdict.to_json(), default=str)[:1500]
    # Without the recovered line (a directory that kept no events tail) the trace is unexplainable.
    without = [e for e in events if e is not recovered[0]]
    assert _validate(without).status == "REJECTED"
