"""``lmcache-raw``: LMCache's own storage engine (its CPU and local-disk tiers, in this process)
under the conformance and performance suites, nothing added, as ``mooncake-raw`` is for Mooncake.

The adapter's calls reach LMCache's storage manager (its tiers hold the bytes); what LMCache does on
its own -- the behaviours the README's table reports -- is asserted here, so a new LMCache that
changes one fails a test instead of leaving the table wrong; and the suite finds each of them.

Needs LMCache (``bash scripts/setup.sh --with lmcache``; ``--with vllm`` includes it); without it
the tests fail naming that command (a skipped test is not a passing one).
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import time
from dataclasses import replace

import pytest

from kvcc.bench import suite
from kvcc.conformance.contract import Committed, Evicted, ReadGrant, Refused, RunContext, Stored, WriteGrant
from kvcc.conformance.registry import BUILTINS, describe, resolve
from kvcc.conformance.runner import ERROR, FAIL, run_conformance
from kvcc.spec.keys import Namespace, chain_keys

_MISSING = "" if importlib.util.find_spec("lmcache") else "no module named 'lmcache'"

TERM_MS, SKEW_MS = 400, 20
NS = Namespace(model_id="kvcc/lmcache-raw", model_revision="r1", kv_dtype="float16", block_tokens=4)
DISK_WAIT_S = 5.0


@pytest.fixture(autouse=True)
def _needs_lmcache():
    if _MISSING:
        pytest.fail(f"LMCache is required (bash scripts/setup.sh --with lmcache): {_MISSING}")


@pytest.fixture
def adapter(tmp_path):
    a = resolve("lmcache-raw")()
    a.start(RunContext(tmp_path, 1, nodes=2, lease_term_ms=TERM_MS, skew_ms=SKEW_MS, namespaces=(NS,)))
    yield a
    a.stop()


def _commit(a, key, data, node="n0"):
    g = a.begin_write(node, NS, key, None)
    assert isinstance(g, WriteGrant) and a.write_bytes(g, data) == Stored()
    assert a.commit(g) == Committed(gen=0, epoch=0)


def _read(a, key, node="n1"):
    r = a.acquire(node, NS, key)
    if not isinstance(r, ReadGrant):
        return r
    try:
        return a.read(r)
    finally:
        a.release(r)


def _on_disk(a, lkey) -> bool:
    deadline = time.monotonic() + DISK_WAIT_S
    while time.monotonic() < deadline:
        if a._sm.contains(lkey, ["LocalDiskBackend"]) is not None:
            return True
        time.sleep(0.01)
    return False


def test_lmcache_raw_is_registered():
    assert "lmcache-raw" in BUILTINS and "LMCache" in describe("lmcache-raw")
    assert resolve("lmcache-raw")().name == "lmcache-raw"


def test_blocks_live_in_lmcache_tiers_under_its_own_keys(adapter):
    """A commit is a put into LMCache's CPU tier, written to its disk tier in the background, under
    LMCache's key (model name, world size, worker id, dtype, chunk hash); a read whose CPU copy is gone
    comes from the disk file."""
    key, child = chain_keys(NS, list(range(8)))
    _commit(adapter, key, b"kv bytes of one block")
    lkey = adapter._key(NS, key)
    assert (lkey.model_name, lkey.world_size, lkey.worker_id) == (NS.model_id, NS.tp_size, NS.tp_rank)
    assert adapter._sm.contains(lkey, ["LocalCPUBackend"]) == "LocalCPUBackend"
    assert _on_disk(adapter, lkey)
    disk = adapter._sm.storage_backends["LocalDiskBackend"]
    assert os.path.getsize(disk._key_to_path(lkey)) == len(b"kv bytes of one block")  # raw bytes, no header
    assert adapter.lookup("n1", NS, [key, child]) == 1
    assert adapter._sm.remove(lkey, ["LocalCPUBackend"]) == 1
    assert _read(adapter, key) == b"kv bytes of one block"  # from the disk tier
    assert adapter._sm.contains(lkey, ["LocalCPUBackend"]) == "LocalCPUBackend"  # copied back up
    assert multiprocessing.get_start_method() != "spawn" or os.name != "posix"  # the engine's override undone


def test_what_lmcache_does_on_its_own(adapter):
    """The behaviours the README reports, each as LMCache 0.5.6 shows them through the adapter."""
    first, second, third, fourth = chain_keys(NS, list(range(16)))
    # a second writer's put of a cached key is accepted and keeps the first value
    g1, g2 = adapter.begin_write("n0", NS, first, None), adapter.begin_write("n1", NS, first, None)
    assert isinstance(g1, WriteGrant) and isinstance(g2, WriteGrant)
    for g, data in ((g1, b"first"), (g2, b"second")):
        assert adapter.write_bytes(g, data) == Stored() and isinstance(adapter.commit(g), Committed)
    assert _read(adapter, first) == b"first"
    # a read lease (LMCache's lookup pin) does not stop a removal
    r = adapter.acquire("n1", NS, first)
    assert isinstance(r, ReadGrant) and adapter.evict("n0", NS, first) == Evicted()
    assert isinstance(adapter.read(r), Refused)
    adapter.release(r)
    # a namespace invalidation (clear) skips the disk tier: the block is still found and read
    _commit(adapter, second, b"before the clear")
    assert _on_disk(adapter, adapter._key(NS, second))
    ticket = adapter.invalidate("n0", NS, "namespace", None)
    assert ticket.keys == 1 and adapter.wait_invalidation(ticket, 1.0)
    assert adapter._sm.contains(adapter._key(NS, second), ["LocalCPUBackend"]) is None
    assert adapter.lookup("n1", NS, [second]) == 1 and _read(adapter, second) == b"before the clear"
    # no checksum: a damaged byte on disk is served as the block
    _commit(adapter, third, b"\x00" * 64)
    adapter.corrupt("n0", third, "payload", 5)
    got = _read(adapter, third)
    assert got == b"\x00" * 5 + b"\xff" + b"\x00" * 58
    # the index of both tiers is in memory: after a restart the disk file is there, the block is not
    _commit(adapter, fourth, b"committed before the restart")
    lkey = adapter._key(NS, fourth)
    assert _on_disk(adapter, lkey)
    path = adapter._sm.storage_backends["LocalDiskBackend"]._key_to_path(lkey)
    adapter.restart_directory()
    assert os.path.exists(path) and adapter.lookup("n1", NS, [fourth]) == 0


def test_bad_input_is_refused_and_changes_nothing(adapter):
    (key,) = chain_keys(NS, [1, 2, 3, 4])
    g = adapter.begin_write("n0", NS, key, None)
    assert isinstance(g, WriteGrant) and adapter.write_bytes(g, b"") == Stored()
    assert adapter.commit(g) == Refused("no_space", "LMCache allocates no empty memory object")
    assert adapter.lookup("n0", NS, [key]) == 0
    with pytest.raises(ValueError):
        adapter.corrupt("n0", key, "trailer", 0)
    forged = ReadGrant(node="n1", key=key, gen=0, epoch=0, lease=999, location="lmcache", term_ms=TERM_MS,
                       requested_at_ns=time.monotonic_ns())  # fmt: skip
    assert adapter.read(forged).reason == "unknown_lease"


FINDINGS = {  # test -> what the suite must say of LMCache on its own
    "KVCC-CORE-013": "OneWriterPerGeneration",  # a second put of a key: first value kept, both "committed"
    "KVCC-LEASE-004": "NoReclaimUnderLease",  # remove ignores the lookup pin
    "KVCC-INVAL-004": "NoStaleRead",  # clear skips the disk tier
    "KVCC-TIER-001": "PrefixClosed",  # a parent chunk evicted before its child
    "KVCC-FAULT-003": "caching",  # the index is in memory: a restart loses every committed block
    "KVCC-FAULT-010": "CommittedBytesIntact",  # no checksum: corrupt bytes at rest are served
}


def test_the_suite_finds_what_lmcache_lacks(tmp_path):
    report = run_conformance(resolve("lmcache-raw"), profiles=["core", "leases", "invalidation", "tiering", "faults"],
                             seed=1, lease_term_ms=TERM_MS, skew_ms=SKEW_MS, ids=list(FINDINGS))  # fmt: skip
    assert not [r for r in report.results if r.status == ERROR], [(r.id, r.message) for r in report.results]
    got = {r.id: (r.status, r.message) for r in report.results}
    for test, prop in FINDINGS.items():
        status, message = got[test]
        assert status == FAIL and message.startswith(prop), (test, status, message)
    assert not report.certified


def test_the_performance_suite_runs_through_lmcache(tmp_path):
    small = replace(suite.PROFILES["quick"], ops_per_client=20, chain_len=4, sizes=(4 << 10, 64 << 10),
                    bandwidth_reps=2, invalidation_reps=2, trace_requests=20)  # fmt: skip
    results = suite.run_suite(resolve("lmcache-raw"), "lmcache-raw", small, seed=3)
    w = results["workloads"]
    assert {w[name]["status"] for name in suite.WORKLOADS} == {"ok"}, w
    rows = w["bandwidth"]["rows"]
    assert {r["size"] for r in rows} == set(small.sizes) and all(r["read_vs_raw"] > 0 for r in rows), rows
