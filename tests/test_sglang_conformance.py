"""The conformance suite through SGLang's HiCache storage backends: ``sglang`` (kvcc's
``KvccHiCacheStorage`` on a real kvcc cluster, processes on loopback) certifies; ``hicache-file``
(SGLang's own ``HiCacheFile``, nothing added) runs and fails where the file store lacks the protocol,
without ERROR.

Needs SGLang (``bash scripts/setup.sh --with sglang``; ``--with vllm`` includes it); without it the
tests fail naming that command (a skipped test is not a passing one).
"""

from __future__ import annotations

import importlib.util

import pytest

from kvcc.conformance.contract import Committed, ReadGrant, RunContext, Stored, WriteGrant
from kvcc.conformance.registry import BUILTINS, describe, resolve
from kvcc.conformance.runner import ERROR, PASS, run_conformance
from kvcc.spec.keys import Namespace, chain_keys

_MISSING = "" if importlib.util.find_spec("sglang") else "no module named 'sglang'"

TERM_MS, SKEW_MS = 400, 20
NS = Namespace(model_id="kvcc/sglang-conformance", model_revision="r1", kv_dtype="float16", block_tokens=4)


@pytest.fixture(autouse=True)
def _needs_sglang():
    if _MISSING:
        pytest.fail(f"SGLang is required (bash scripts/setup.sh --with sglang): {_MISSING}")


def _failures(report, profiles):
    return [(r.id, r.status, r.message) for r in report.results if r.profile in profiles and r.status != PASS]


def test_both_adapters_are_registered():
    for name in ("sglang", "hicache-file"):
        assert name in BUILTINS and describe(name)
        assert resolve(name)().name == name


def test_sglang_adapter_reads_commits_and_clears_through_the_backend(tmp_path):
    """The contract's read, commit and namespace invalidation are SGLang's get, set and clear on
    the node's backend (its counters move), and the events are the cluster's own."""
    a = resolve("sglang")()
    a.start(RunContext(tmp_path, 1, nodes=2, lease_term_ms=TERM_MS, skew_ms=SKEW_MS, namespaces=(NS,)))
    try:
        (key,) = chain_keys(NS, [1, 2, 3, 4])
        g = a.begin_write("n1", NS, key, None)
        assert isinstance(g, WriteGrant) and a.write_bytes(g, b"page bytes") == Stored()
        assert isinstance(a.commit(g), Committed)
        r = a.acquire("n2", NS, key)
        assert isinstance(r, ReadGrant) and a.read(r) == b"page bytes"
        a.release(r)
        ticket = a.invalidate("n2", NS, "namespace", None)
        assert ticket.keys == 1 and a.wait_invalidation(ticket, 10)
        assert a.lookup("n1", NS, [key]) == 0
        writer, reader = a._backend("n1", NS.digest()), a._backend("n2", NS.digest())
        assert writer.get_stats().kvcc["write_committed"] == 1
        stats = reader.get_stats().kvcc
        assert stats["read_hits"] == 1 and stats["clears_completed"] == 1
        events = a.events()
        assert {"read", "commit_write", "invalidate_namespace", "complete_invalidation"} <= {e["event"] for e in events}
        assert {e["node"] for e in events} >= {"directory", "n1.engine", "n2.engine"}  # native, the nodes' holders
    finally:
        a.stop()


def test_sglang_certifies_core_leases_and_invalidation(tmp_path):
    profiles = ["core", "leases", "invalidation"]
    report = run_conformance(resolve("sglang"), profiles=profiles, seed=1, out=tmp_path / "bundle",
                             lease_term_ms=TERM_MS, skew_ms=SKEW_MS)  # fmt: skip
    assert not _failures(report, profiles), _failures(report, profiles)
    assert report.certified
    verdicts = [r.verdict for r in report.results if r.verdict]
    assert verdicts and all(v["status"] == "ACCEPTED" for v in verdicts)


def test_hicache_file_runs_and_fails_without_error(tmp_path):
    ids = ["KVCC-CORE-002", "KVCC-CORE-006", "KVCC-CORE-013", "KVCC-INVAL-004", "KVCC-LEASE-004"]
    report = run_conformance(resolve("hicache-file"), profiles=["core", "leases", "invalidation"], seed=1,
                             lease_term_ms=TERM_MS, skew_ms=SKEW_MS, ids=ids)  # fmt: skip
    status = {r.id: r.status for r in report.results}
    assert not [r for r in report.results if r.status == ERROR], [(r.id, r.message) for r in report.results]
    # one writer per generation, namespace isolation (begin_write and clear), no overwrite in place
    for test in ("KVCC-CORE-002", "KVCC-CORE-006", "KVCC-CORE-013", "KVCC-INVAL-004"):
        assert status[test] == "FAIL", (test, status[test])
    assert status["KVCC-LEASE-004"] == "NOT_APPLICABLE"  # no per-page eviction call
    assert not report.certified


def test_the_engine_profile_is_reported_not_applicable_with_why_not_left_out(tmp_path):
    # No SGLang server runs without CUDA: the default run lists the engine profile's tests with
    # the reason, claims only the cache profiles, and starts nothing for them.
    from kvcc.adapters.sglang.conformance import ENGINE_UNAVAILABLE, PROFILES_CLAIMED

    caps = resolve("sglang")().capabilities()
    assert caps.unavailable == {"engine": ENGINE_UNAVAILABLE} and "engine" not in caps.profiles
    report = run_conformance(resolve("sglang"), seed=1, lease_term_ms=TERM_MS, skew_ms=SKEW_MS,
                             ids=_engine_ids())  # fmt: skip
    assert "engine" in report.profiles and set(report.claimed) == set(PROFILES_CLAIMED)
    engine = [r for r in report.results if r.profile == "engine"]
    assert {r.id for r in engine} == set(_engine_ids())
    assert all(r.status == "NOT_APPLICABLE" and ENGINE_UNAVAILABLE in r.message for r in engine), engine


def _engine_ids() -> list[str]:
    from kvcc.conformance.catalogue import CATALOGUE

    return [t.id for t in CATALOGUE if t.profile == "engine"]
