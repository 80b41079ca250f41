"""The performance suite (``kvcc bench suite``, ``kvcc bench compare``) on the in-process ``core``
adapter, with profiles cut down to seconds: every workload runs or says why not, holders are really
there when an invalidation is timed, the trace replay stays under its bound, and a bundle whose
bytes changed is refused. No test asserts a wall-clock figure."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import attrs
import pytest

from kvcc.bench import perf_bundle, suite
from kvcc.cli import main as kvcc_main
from kvcc.conformance.contract import AdapterError
from kvcc.conformance.testing import CoreAdapter, core_factory
from kvcc.reference.routing import sim

SMALL = replace(suite.PROFILES["quick"], ops_per_client=20, chain_len=4, sizes=(4 << 10, 64 << 10),
                bandwidth_reps=2, invalidation_reps=2, trace_requests=30)  # fmt: skip


class NoLeasesAdapter(CoreAdapter):
    """Declares no read leases: the lease and invalidation workloads must be skipped with a reason."""

    name = "core-no-leases"

    def capabilities(self):
        return attrs.evolve(super().capabilities(), leases="none")


class NamespaceScopeOnly(CoreAdapter):
    def capabilities(self):
        return attrs.evolve(super().capabilities(), scopes=frozenset({"namespace"}))


class LookupFails(CoreAdapter):
    """Its infrastructure breaks on every lookup: the workloads that look up are errors."""

    def lookup(self, node, ns, keys):
        raise AdapterError("the directory connection was reset")


def lookup_fails() -> CoreAdapter:
    return LookupFails()


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    """A Mooncake-format trace whose requests share prefixes: [0, 1, 100 + i % 5, 200 + i]."""
    path = tmp_path_factory.mktemp("trace") / "tiny.jsonl"
    lines = [json.dumps({"timestamp": i, "hash_ids": [0, 1, 100 + i % 5, 200 + i]}) for i in range(40)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def core_bundle(tmp_path_factory, trace) -> Path:
    results = suite.run_suite(core_factory, "core", SMALL, seed=3, trace_path=trace)
    return perf_bundle.write_bundle(results, tmp_path_factory.mktemp("perf") / "core")


@pytest.fixture(scope="module")
def no_leases_bundle(tmp_path_factory, trace) -> Path:
    results = suite.run_suite(NoLeasesAdapter, "core-no-leases", SMALL, seed=4, trace_path=trace)
    return perf_bundle.write_bundle(results, tmp_path_factory.mktemp("perf") / "no-leases")


def results_of(bundle: Path) -> dict:
    return json.loads((bundle / "results.json").read_text())


def copy_of(bundle: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(bundle, tmp_path / bundle.name))


def test_every_workload_ran_or_says_why(core_bundle):
    r = results_of(core_bundle)
    assert r["ok"] and list(r["workloads"]) == list(suite.WORKLOADS)
    assert {w["status"] for w in r["workloads"].values()} == {"ok"}
    assert r["run"]["adapter"] == "core" and r["run"]["profile"] == "quick" and r["run"]["seed"] == 3
    assert {"versions", "python", "platform", "cpu_count", "date"} <= set(r["run"])
    # The core adapter's slots are 4 KiB: a larger block is listed with what the adapter said.
    sizes = {row["size"]: row for row in r["workloads"]["bandwidth"]["rows"]}
    assert sizes[4 << 10]["read_vs_raw"] > 0 and sizes[64 << 10]["refused"]
    assert r["workloads"]["invalidation"]["expiry_skipped"]
    for name in ("latency_vs_clients.png", "bandwidth_vs_size.png", "invalidation_vs_holders.png", "report.html"):
        assert (core_bundle / name).stat().st_size > 0
    assert "data:image/png;base64," in (core_bundle / "report.html").read_text()


def test_workloads_the_capabilities_exclude_are_skipped_with_a_reason(no_leases_bundle):
    w = results_of(no_leases_bundle)["workloads"]
    assert w["lease_lookup"]["status"] == "skipped" and "leases" in w["lease_lookup"]["reason"]
    assert w["invalidation"]["status"] == "skipped" and "leases" in w["invalidation"]["reason"]
    assert w["bandwidth"]["status"] == w["trace_replay"]["status"] == "ok"
    assert "'key' invalidation scope" in suite.skip_reason("invalidation", NamespaceScopeOnly(), None, None)
    assert "no Mooncake trace" in suite.skip_reason("trace_replay", CoreAdapter(), None, "no Mooncake trace here")


def test_invalidation_is_timed_with_the_holders_leased(core_bundle):
    rows = results_of(core_bundle)["workloads"]["invalidation"]["rows"]
    assert [r["holders"] for r in rows] == list(SMALL.holders)
    for r in rows:
        assert r["grants"] == r["holders"] * SMALL.invalidation_reps  # every holder's acquire was granted
        assert r["ticket_keys"] == SMALL.invalidation_reps  # every ticket voided its key


def test_invalidation_by_expiry_pauses_the_holder(tmp_path):
    profile = replace(SMALL, holders=(0,), invalidation_reps=1, expiry=True)
    out = suite.run_workload(suite.invalidation, core_factory, profile, 5, tmp_path / "work",
                             lambda text: None)  # fmt: skip
    assert out["status"] == "ok" and out["expiry_skipped"] is None
    (expiry,) = [r for r in out["rows"] if r["mode"] == "expiry"]
    assert expiry["grants"] == 1 and expiry["ticket_keys"] == 1 and expiry["vs_term_plus_skew"] is not None


def test_trace_replay_stays_under_bound_infinite(core_bundle):
    w = results_of(core_bundle)["workloads"]["trace_replay"]
    assert w["requests"] == SMALL.trace_requests
    assert 0 < w["hit_ratio"] <= w["bound_infinite"]
    # core declares its capacity: the pooled bound of that many blocks, at most the infinite one
    assert w["capacity_blocks"] and 0 < w["bound_pooled"] <= w["bound_infinite"]
    assert w["vs_bound_pooled"] == pytest.approx(w["hit_ratio"] / w["bound_pooled"])
    assert w["bytes_read"] > 0 and w["bytes_moved"] == w["bytes_read"] + w["bytes_written"]
    assert w["vs_no_cache"] is not None and not w["refused"]


def test_verify_passes_then_rejects_a_changed_byte(core_bundle, tmp_path):
    bundle = copy_of(core_bundle, tmp_path)
    assert perf_bundle.verify(bundle) == []
    data = bytearray((bundle / "results.json").read_bytes())
    data[len(data) // 2] ^= 0x01
    (bundle / "results.json").write_bytes(bytes(data))
    problems = perf_bundle.verify(bundle)
    assert problems and "results.json" in problems[0]
    with pytest.raises(perf_bundle.BundleError):
        perf_bundle.load(bundle)


def test_verify_rejects_a_missing_or_unlisted_file(core_bundle, tmp_path):
    bundle = copy_of(core_bundle, tmp_path)
    (bundle / "latency_vs_clients.png").unlink()
    (bundle / "extra.txt").write_text("not measured")
    problems = " ".join(perf_bundle.verify(bundle))
    assert "latency_vs_clients.png: listed" in problems and "extra.txt: not in" in problems


def test_compare_prints_both_adapters(core_bundle, no_leases_bundle, capsys):
    assert kvcc_main(["bench", "compare", str(core_bundle), str(no_leases_bundle)]) == 0
    out = capsys.readouterr().out
    assert "core (quick)" in out and "core-no-leases (quick)" in out and "hit ratio" in out
    assert kvcc_main(["bench", "compare", "--json", str(core_bundle), str(no_leases_bundle)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert [b["adapter"] for b in r["bundles"]] == ["core", "core-no-leases"]
    hit = r["workloads"]["trace_replay"]["hit ratio"]
    assert len(hit) == 2 and all(0 < h <= 1 for h in hit)
    assert r["workloads"]["lease_lookup"]["status"][0] is None  # core ran it; the other one says why not


def test_compare_draws_the_bundles_together(core_bundle, no_leases_bundle, tmp_path, capsys):
    from kvcc.bench import compare

    out = tmp_path / "plots"
    assert kvcc_main(["bench", "compare", "--json", "--plots", str(out), str(core_bundle), str(no_leases_bundle)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert sorted(Path(p).name for p in r["plots"]) == sorted(compare.COMBINED_PLOTS)
    for name in compare.COMBINED_PLOTS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Each plot draws every bundle it can: one bundle alone draws another picture.
    bundles = [perf_bundle.load(core_bundle), perf_bundle.load(no_leases_bundle)]
    for draw in compare.COMBINED_PLOTS.values():
        assert draw(["a", "b"], bundles) != draw(["a"], bundles[:1])
    (tmp_path / "file").write_text("")
    assert kvcc_main(["bench", "compare", "--plots", str(tmp_path / "file" / "p"), str(core_bundle)]) == 2
    assert "cannot write plots" in capsys.readouterr().err


def test_compare_rejects_a_tampered_bundle(core_bundle, no_leases_bundle, tmp_path, capsys):
    bundle = copy_of(core_bundle, tmp_path)
    (bundle / "report.html").write_text("<html>faster than ever</html>")
    assert kvcc_main(["bench", "compare", str(bundle), str(no_leases_bundle)]) == 1
    err = capsys.readouterr().err
    assert "does not verify" in err and "report.html" in err


@pytest.mark.parametrize("argv, says", [
    (["--adapter", "no-such-adapter"], "no adapter"),
    (["--adapter", "core", "--profile", "huge"], "unknown profile"),
    (["--adapter", "core", "--seed", "-1"], "--seed"),
])  # fmt: skip
def test_suite_bad_input_is_exit_2_with_one_line(argv, says, tmp_path, capsys):
    assert kvcc_main(["bench", "suite", *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_suite_refuses_an_unwritable_or_used_out(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert kvcc_main(["bench", "suite", "--adapter", "core", "--out", str(tmp_path / "file" / "out")]) == 2
    assert "cannot write" in capsys.readouterr().err
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    assert kvcc_main(["bench", "suite", "--adapter", "core", "--out", str(tmp_path / "used")]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert kvcc_main(["bench", "compare", str(tmp_path / "absent")]) == 2


def test_suite_command_writes_a_verified_bundle(trace, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(suite.PROFILES, "quick", SMALL)
    out = tmp_path / "bundle"
    assert kvcc_main(["bench", "suite", "--adapter", "core", "--trace", str(trace), "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["ok"] and perf_bundle.verify(out) == []
    assert perf_bundle.load(out)["workloads"].keys() == printed["workloads"].keys()


def test_an_adapter_error_is_exit_1_with_the_error_recorded(trace, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(suite.PROFILES, "quick", SMALL)
    out = tmp_path / "bundle"
    code = kvcc_main(["bench", "suite", "--adapter", f"{__name__}:lookup_fails", "--trace", str(trace),
                      "--out", str(out), "--json"])  # fmt: skip
    assert code == 1
    w = perf_bundle.load(out)["workloads"]
    assert w["lease_lookup"]["status"] == w["trace_replay"]["status"] == "error"
    assert "connection was reset" in w["trace_replay"]["error"]
    assert w["bandwidth"]["status"] == "ok"  # one workload's failure does not stop the others
    capsys.readouterr()


def test_percentile_is_nearest_rank():
    assert sim.percentile(list(range(1, 101)), 99) == 99
    assert sim.percentile([4, 1, 3, 2], 50) == 2 and sim.percentile([5, 1, 4, 2, 3], 50) == 3
    assert sim.percentile([], 50) is None


def test_compare_keeps_each_runs_metric_order():
    from kvcc.bench.compare import merged_order

    ran = ["4 KiB: write", "64 KiB: write", "1 MiB: refused"]
    refused = ["4 KiB: write", "64 KiB: refused", "1 MiB: refused"]
    assert merged_order([ran, refused]) == ["4 KiB: write", "64 KiB: refused", "64 KiB: write", "1 MiB: refused"]


class SlottedCore(CoreAdapter):
    """core declaring that each block takes a 16 KiB slot, whatever its size."""

    def capabilities(self):
        return attrs.evolve(super().capabilities(), slot_bytes=16 << 10)


def test_the_pooled_bound_counts_a_slotted_adapters_capacity_in_slots(trace, tmp_path):
    """A store that keeps each 4 KiB block in a 16 KiB slot holds a quarter of the blocks its
    bytes would say (the reference's tiers: 64 KiB slots under a 4 KiB-block replay, 16x)."""
    sliced = suite.trace_slice(trace, SMALL.trace_requests)
    runs = {}
    for name, factory in (("plain", core_factory), ("slotted", SlottedCore)):
        runs[name] = suite.run_workload(lambda d, step: suite.trace_replay_on(d, sliced, step), factory, SMALL, 5,
                                        tmp_path / name, lambda text: None)  # fmt: skip
    assert SMALL.trace_block_bytes == 4 << 10 and runs["plain"]["capacity_blocks"] % 4 == 0
    assert runs["slotted"]["capacity_blocks"] == runs["plain"]["capacity_blocks"] // 4 > 0

