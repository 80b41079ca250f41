"""The conformance suite tested on its own kit: the in-process CoreAdapter passes, each known-bad
adapter fails exactly the tests covering its rule, hangs and garbage are ERROR, and a bundle
verifies until it is tampered with."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from kvcc.cli import main
from kvcc.conformance import catalogue, registry, testing
from kvcc.conformance.catalogue import CATALOGUE
from kvcc.conformance.certify import verify_bundle
from kvcc.conformance.contract import AdapterError, Capabilities, Refused, RunContext
from kvcc.conformance.runner import run_conformance

TERM_MS, SKEW_MS = 200, 20
PROFILES_WITHOUT_LOAD = ("core", "leases", "invalidation", "tiering", "faults")


def _kvcc_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("kvcc-")}


def run(factory, **kw):
    kw.setdefault("lease_term_ms", TERM_MS)
    kw.setdefault("skew_ms", SKEW_MS)
    kw.setdefault("seed", 7)
    return run_conformance(factory, **kw)


def test_catalogue_ids_are_stable_and_complete():
    assert all(catalogue.TEST_ID_RE.fullmatch(t.id) for t in CATALOGUE)
    assert {t.profile for t in CATALOGUE} == set(catalogue.PROFILES)
    for t in CATALOGUE:
        assert any(w in t.text for w in ("MUST", "SHOULD", "MAY")), t.id
        assert t.properties, t.id
    # every rule a known-bad adapter breaks is covered by some test
    assert {cls.BROKEN_RULE for cls in testing.KNOWN_BAD} == set(catalogue.RULES)


def test_core_adapter_passes_every_profile():
    before = _kvcc_threads()
    rep = run(testing.CoreAdapter, validate=False)
    bad = [(r.id, r.status, r.message) for r in rep.results if r.status != "PASS"]
    assert not bad
    assert rep.profiles == list(catalogue.PROFILES)
    assert _kvcc_threads() <= before


def test_core_adapter_traces_validate():
    rep = run(testing.CoreAdapter, profiles=PROFILES_WITHOUT_LOAD)
    assert rep.certified, [(r.id, r.status, r.message) for r in rep.results if r.status != "PASS"]
    statuses = {r.verdict.get("status") for r in rep.results if not catalogue.BY_ID[r.id].audit}
    assert "REJECTED" not in statuses
    assert "ACCEPTED" in statuses


@pytest.mark.parametrize("cls", testing.KNOWN_BAD, ids=lambda c: c.name)
def test_known_bad_adapter_fails_exactly_the_tests_covering_its_rule(cls):
    rep = run(cls, profiles=PROFILES_WITHOUT_LOAD, validate=False)
    expected = {t.id for t in catalogue.tests_for(PROFILES_WITHOUT_LOAD) if cls.BROKEN_RULE in t.covers}
    assert expected, cls.name
    errors = [(r.id, r.message) for r in rep.results if r.status == "ERROR"]
    assert not errors
    assert rep.failed_ids() == expected
    assert not rep.certified


def test_not_applicable_without_declared_faults():
    rep = run(lambda: testing.CoreAdapter(faults=()), profiles=["faults"], validate=False)
    statuses = {r.id: r.status for r in rep.results}
    assert set(statuses.values()) == {"NOT_APPLICABLE"}
    assert not rep.certified


def test_deselected_tests_are_skipped():
    rep = run(testing.CoreAdapter, profiles=["core"], ids=["KVCC-CORE-003"], validate=False)
    statuses = {r.id: r.status for r in rep.results}
    assert statuses["KVCC-CORE-003"] == "PASS"
    assert statuses["KVCC-CORE-001"] == "SKIP"


def test_hanging_adapter_is_error_within_the_time_limit_and_leaves_nothing_behind():
    before = _kvcc_threads()
    rep = run(testing.HangingAdapter, profiles=["core"], ids=["KVCC-CORE-003", "KVCC-CORE-001"], time_limit_s=1.0,
              validate=False)  # fmt: skip
    r = rep.by_id()["KVCC-CORE-003"]
    assert r.status == "ERROR"
    assert "timed out" in r.message
    assert r.history, "the history up to the hang is kept"
    # the next test ran on a fresh adapter
    assert rep.by_id()["KVCC-CORE-001"].status == "PASS"
    assert _kvcc_threads() <= before


def test_garbage_answers_are_error():
    rep = run(testing.GarbageAdapter, profiles=["core"], ids=["KVCC-CORE-003"], validate=False)
    r = rep.by_id()["KVCC-CORE-003"]
    assert r.status == "ERROR"
    assert "garbage" in r.message


class _BrokenStart(testing.CoreAdapter):
    name = "broken-start"

    def start(self, ctx: RunContext) -> None:
        raise AdapterError("directory did not come up")


def test_adapter_error_is_error_with_reason():
    rep = run(_BrokenStart, profiles=["core"], ids=["KVCC-CORE-001"], validate=False)
    r = rep.by_id()["KVCC-CORE-001"]
    assert (r.status, r.message) == ("ERROR", "adapter error: directory did not come up")


def test_contract_values_refuse_bad_input():
    with pytest.raises(ValueError):
        Capabilities(profiles={"gold"})
    with pytest.raises(ValueError):
        Refused("")
    with pytest.raises(ValueError):
        RunContext(Path("."), 1, lease_term_ms=100, skew_ms=60)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "b"
    rep = run(testing.CoreAdapter, profiles=["core", "leases"], out=out)
    assert rep.certified
    return out


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_bundle_has_every_part_and_verifies(bundle):
    for name in ("run_info.json", "report.json", "junit.xml", "report.html", "MANIFEST.sha256"):
        assert (bundle / name).is_file(), name
    info = json.loads((bundle / "run_info.json").read_text())
    assert info["suite_version"] == catalogue.SUITE_VERSION
    assert info["seed"] == 7 and info["params"]["lease_term_ms"] == TERM_MS
    assert any(k.startswith("kvcc.conformance/") for k in info["harness_sha256"])
    assert "dirty" in info["git"]
    assert (bundle / "traces" / "KVCC-CORE-003.ndjson").stat().st_size > 0
    assert verify_bundle(bundle) == []
    assert main(["certify", "verify", str(bundle)]) == 0


def test_tampered_file_fails_verification(bundle, tmp_path):
    b = _copy(bundle, tmp_path / "b")
    report = b / "report.json"
    report.write_text(report.read_text().replace('"FAIL": 0', '"FAIL": 0 '))
    problems = verify_bundle(b)
    assert any("report.json: SHA-256" in p for p in problems)
    assert main(["certify", "verify", str(b)]) == 1


def test_tampered_trace_fails_revalidation_even_with_a_fixed_manifest(bundle, tmp_path):
    from kvcc.conformance.bundle import MANIFEST, manifest_text

    b = _copy(bundle, tmp_path / "b")
    trace = b / "traces" / "KVCC-LEASE-004.ndjson"
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    # Turn the refused eviction under a lease into an eviction: the spec cannot take that step.
    for e in events:
        if e["event"] == "evict_refused":
            e["event"], e["result"] = "evict", "ok"
            break
    else:
        raise AssertionError("the trace has no refused eviction")
    trace.write_text("".join(json.dumps(e) + "\n" for e in events))
    (b / MANIFEST).write_text(manifest_text(b))  # a forger re-hashes
    problems = verify_bundle(b)
    assert any(p.startswith("KVCC-LEASE-004: trace REJECTED") for p in problems), problems


def test_missing_required_test_fails_verification(bundle, tmp_path):
    from kvcc.conformance.bundle import MANIFEST, manifest_text

    b = _copy(bundle, tmp_path / "b")
    report = json.loads((b / "report.json").read_text())
    report["results"] = [r for r in report["results"] if r["id"] != "KVCC-LEASE-003"]
    (b / "report.json").write_text(json.dumps(report))
    (b / MANIFEST).write_text(manifest_text(b))
    problems = verify_bundle(b, revalidate=False)
    assert "KVCC-LEASE-003: required for leases but missing" in problems


def test_catalogue_document_is_current():
    doc = Path(__file__).resolve().parent.parent / "docs" / "conformance.md"
    assert doc.read_text(encoding="utf-8") == catalogue.catalogue_markdown(), "run: kvcc conform --catalogue-md > docs/conformance.md"


def test_registry_resolves_names_and_specs():
    assert registry.resolve("core")().name == "core"
    assert registry.resolve("kvcc.conformance.testing:core_factory")().name == "core"
    with pytest.raises(registry.UnknownAdapter):
        registry.resolve("no-such-adapter")
    with pytest.raises(registry.UnknownAdapter):
        registry.resolve("kvcc.conformance.testing:nothing_here")


def test_cli_conform_writes_a_bundle_and_exit_codes(tmp_path, capsys):
    out = tmp_path / "b"
    rc = main(["conform", "--adapter", "core", "--profile", "core", "--seed", "3", "--lease-term-ms", str(TERM_MS),
               "--skew-ms", str(SKEW_MS), "--id", "KVCC-CORE-003", "--out", str(out), "--json"])  # fmt: skip
    payload = json.loads(capsys.readouterr().out)
    assert payload["adapter"] == "core"
    assert rc == 1  # the other required core tests were deselected: not certified
    assert (out / "MANIFEST.sha256").is_file()
    assert main(["conform", "--adapter", "no-such-adapter"]) == 2
    assert main(["conform", "--catalogue-md"]) == 0
