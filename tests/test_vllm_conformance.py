"""The conformance suite through kvcc's vLLM KV connector: ``vllm`` (``KvccConnector``'s worker and
scheduler code on a real kvcc cluster, processes on loopback) certifies, and it does so only
because the connector's load, save and reset paths work: with any of them broken the same tests
FAIL or ERROR.

Needs the ``vllm`` extra (``bash scripts/setup.sh --with vllm``); without it the tests fail
naming that command (a skipped test is not a passing one).
"""

from __future__ import annotations

import pytest

from kvcc.adapters.vllm import harness
from kvcc.conformance.contract import Committed, ReadGrant, RunContext, Stored, WriteGrant
from kvcc.conformance.registry import BUILTINS, describe, resolve
from kvcc.conformance.runner import PASS, run_conformance
from kvcc.spec.keys import Namespace, chain_keys

try:
    harness.check_installed()
    _MISSING = ""
except harness.VllmNotInstalled as e:
    _MISSING = str(e)

TERM_MS, SKEW_MS = 400, 20
NS = Namespace(model_id="kvcc/vllm-conformance", model_revision="r1", kv_dtype="bfloat16", block_tokens=32)


@pytest.fixture(autouse=True)
def _needs_vllm():
    if _MISSING:
        pytest.fail(f"the vllm extra is required (bash scripts/setup.sh --with vllm): {_MISSING}")


def _failures(report, profiles):
    return [(r.id, r.status, r.message) for r in report.results if r.profile in profiles and r.status != PASS]


def _stats(connectors) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in connectors:
        for k, v in c.stats.items():
            out[k] = out.get(k, 0) + v
    return out


def test_the_adapter_is_registered():
    assert "vllm" in BUILTINS and describe("vllm")
    assert resolve("vllm")().name == "vllm"


def test_a_frame_carries_any_payload_and_a_block_that_is_not_one_is_returned_whole():
    from kvcc.adapters.vllm.conformance import ENGINE_BLOCK_BYTES, FRAME_PAYLOAD_MAX, frame, unframe

    for data in (b"", b"\x00" * 5, b"page", bytes(range(256)) * 3, b"\xff" * FRAME_PAYLOAD_MAX):
        framed = frame(data)
        assert len(framed) == ENGINE_BLOCK_BYTES and unframe(framed) == data
    good = frame(b"abc")
    zeros = bytes(ENGINE_BLOCK_BYTES)  # a block a load never copied into
    past_end = good[:4] + (FRAME_PAYLOAD_MAX + 1).to_bytes(4, "little") + good[8:]
    dirty_padding = good[:-1] + b"\x01"
    for bad in (zeros, past_end, dirty_padding, good[:-1]):
        assert unframe(bad) == bad


def test_reads_commits_and_namespace_invalidations_go_through_the_connector(tmp_path):
    """The contract's read is the worker's ``start_load_kv``, its commit the worker's
    ``wait_for_save`` and a namespace invalidation the scheduler's ``reset_cache``: the
    connectors' own counters move; the events are the cluster's own."""
    a = resolve("vllm")()
    a.start(RunContext(tmp_path, 1, nodes=2, lease_term_ms=TERM_MS, skew_ms=SKEW_MS, namespaces=(NS,)))
    try:
        (key,) = chain_keys(NS, list(range(32)))
        g = a.begin_write("n1", NS, key, None)
        assert isinstance(g, WriteGrant) and a.write_bytes(g, b"block bytes") == Stored()
        assert isinstance(a.commit(g), Committed)
        r = a.acquire("n2", NS, key)
        assert isinstance(r, ReadGrant) and a.read(r) == b"block bytes"
        a.release(r)
        ticket = a.invalidate("n2", NS, "namespace", None)
        assert ticket.keys == 1 and a.wait_invalidation(ticket, 10)
        assert a.lookup("n1", NS, [key]) == 0
        assert _stats(a._idle["n1"]).get("saved_blocks") == 1
        assert _stats(a._idle["n2"]).get("loaded_blocks") == 1
        assert a._schedulers[("n2", bytes(NS.digest()))].stats.get("namespace_invalidations") == 1
        events = a.events()
        assert {"read", "commit_write", "invalidate_namespace", "complete_invalidation"} <= {e["event"] for e in events}
        assert {e["node"] for e in events} >= {"directory", "n1.engine", "n2.engine"}
    finally:
        a.stop()


def test_vllm_certifies_core_leases_and_invalidation(tmp_path):
    profiles = ["core", "leases", "invalidation"]
    report = run_conformance(resolve("vllm"), profiles=profiles, seed=1, out=tmp_path / "bundle",
                             lease_term_ms=TERM_MS, skew_ms=SKEW_MS)  # fmt: skip
    assert not _failures(report, profiles), _failures(report, profiles)
    assert report.certified
    verdicts = [r.verdict for r in report.results if r.verdict]
    assert verdicts and all(v["status"] == "ACCEPTED" for v in verdicts)


BROKEN = {
    # the load copies nothing into the paged tensors
    "copy_in": ("_copy_in", lambda self, block_id, staging: None),
    # the save never reaches kvcc
    "wait_for_save": ("wait_for_save", lambda self: None),
    # the reset answers without invalidating anything
    "reset_cache": ("reset_cache", lambda self: True),
}


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_a_broken_connector_path_does_not_certify(broken, tmp_path, monkeypatch):
    from kvcc.adapters.vllm.connector import KvccConnector

    name, fn = BROKEN[broken]
    monkeypatch.setattr(KvccConnector, name, fn)
    ids = ["KVCC-CORE-003", "KVCC-INVAL-004"]
    report = run_conformance(resolve("vllm"), profiles=["core", "invalidation"], seed=1, lease_term_ms=TERM_MS,
                             skew_ms=SKEW_MS, ids=ids)  # fmt: skip
    status = {r.id: r.status for r in report.results}
    assert {status[i] for i in ids} != {PASS}, status
    assert not report.certified


@pytest.mark.xdist_group("vllm-engine")  # engine starts never side by side (test_vllm, test_vllm_connector)
def test_the_engine_profile_fails_engines_whose_loads_copy_nothing(tmp_path):
    """Two real engines whose connector reads each block under its lease but copies nothing into
    the paged KV (``known_bad.NoCopyConnector``): KVCC-ENGINE-001 FAILs on the output, with the
    loads counted (the engine believed it loaded them)."""
    from kvcc.adapters.vllm.known_bad import no_copy

    report = run_conformance(no_copy, profiles=["engine"], seed=1, ids=["KVCC-ENGINE-001"])
    (result,) = [r for r in report.results if r.id == "KVCC-ENGINE-001"]
    assert result.status == "FAIL", (result.status, result.message)
    assert "CommittedBytesIntact" in result.message and "output differs" in result.message, result.message


@pytest.mark.xdist_group("vllm-engine")
def test_the_engines_stay_up_across_a_run_and_stop_at_its_end(monkeypatch):
    """Two engine tests in one run: the two engines start once (not once per test), both tests
    PASS with their traces ACCEPTED (each on its own cluster), and ``close_run`` leaves no engine
    process behind."""
    from kvcc.adapters.vllm import conformance as vc

    started: list[object] = []
    real_start = harness.VllmEngine.start

    def start(self, *args, **kwargs):
        started.append(self)
        return real_start(self, *args, **kwargs)

    monkeypatch.setattr(harness.VllmEngine, "start", start)
    before = set(harness.live_pids())
    ids = ["KVCC-ENGINE-001", "KVCC-ENGINE-002"]
    report = run_conformance(vc.factory, profiles=["engine"], seed=1, ids=ids)
    results = {r.id: r for r in report.results if r.id in ids}
    assert all(r.counts for r in results.values()), [(r.id, r.status, r.message, r.verdict.get("status")) for r in results.values()]
    assert report.capabilities["keeps_engines_up"] is True
    assert len(started) == 2, f"{len(started)} engine starts for two tests of two engines"
    assert vc._POOL is None
    assert set(harness.live_pids()) <= before, "close_run left engine processes running"
