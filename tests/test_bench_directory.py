"""``kvcc bench directory``: real directory processes (SQLite and etcd) under a tiny load, each
beside its raw baseline from the same run. This checks the report's shape and that every figure is
a real measurement (ratios > 0, latencies ordered); it never asserts a speed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvcc import cli

TINY = ["--clients", "2", "--seconds", "0.3", "--trials", "1", "--keys", "3"]
FIGURES = {"per_s", "p50_ms", "p99_ms", "ops", "trials", "directory_cpu", "client_cpu", "directory_cpu_us_per_op"}


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    for k, v in {"DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false",
                 "HF_HUB_OFFLINE": "1"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)


def _one_json(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, f"--json must print exactly one line, got {len(lines)}:\n{out[:2000]}"
    return json.loads(lines[0])


def _serving_children() -> list[int]:
    """PIDs of ``kvcc serve`` processes whose parent is this process (none may outlive a run)."""
    me, out = os.getpid(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            cmdline = (d / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me and b"serve" in cmdline and b"kvcc" in cmdline:
            out.append(int(d.name))
    return out


def _check_figures(f: dict) -> None:
    assert FIGURES <= f.keys(), f
    assert f["ops"] > 0 and f["per_s"] > 0
    assert 0 < f["p50_ms"] <= f["p99_ms"]
    assert f["directory_cpu_us_per_op"] >= 0 and f["directory_cpu"] >= 0 and f["client_cpu"] > 0
    assert len(f["trials"]) == 1


def _check_row(row: dict) -> None:
    _check_figures(row["pairs"])
    _check_figures(row["ping"])
    assert row["pair_per_ping"] == pytest.approx(row["pairs"]["per_s"] / row["ping"]["per_s"])
    assert row["pair_per_ping"] > 0
    assert isinstance(row["meets_target"], bool)
    _check_figures(row["chains"])
    chains = row["chains"]
    assert chains["blocks"] == 3  # TINY's keys: the chain is every committed key
    assert chains["blocks_per_s"] == pytest.approx(chains["per_s"] * 3)
    assert row["chain_blocks_per_pair"] == pytest.approx(chains["blocks_per_s"] / row["pairs"]["per_s"])


def test_bench_directory_embedded_json(capsys):
    code = cli.main(["bench", "directory", "--backends", "embedded", *TINY, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    r = _one_json(captured.out)
    assert (r["clients"], r["trials"], r["keys"], r["seconds"]) == (2, 1, 3, 0.3)
    assert r["target"] == {"embedded_pairs_per_s": 20_000, "embedded_p99_ms": 2.0, "etcd_pairs_per_put": 0.5,
                           "embedded_chain_blocks_per_s": 100_000, "embedded_chain_p99_ms": 5.0}
    [row] = r["rows"]
    assert row["backend"] == "embedded" and "etcd_put" not in row
    _check_row(row)
    met = row["pairs"]["per_s"] >= 20_000 and row["pairs"]["p99_ms"] <= 2.0
    assert r["met"] == {"embedded": met} and row["meets_target"] is met
    chains_met = row["chains"]["blocks_per_s"] >= 100_000 and row["chains"]["p99_ms"] <= 5.0
    assert r["chains_met"] == {"embedded": chains_met} and row["chains_meet_target"] is chains_met
    assert not _serving_children(), "the benchmark must stop its processes"


def test_bench_directory_etcd_json(capsys, etcd_leak_check):
    code = cli.main(["bench", "directory", "--backends", "etcd", *TINY, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    [row] = _one_json(captured.out)["rows"]
    assert row["backend"] == "etcd"
    _check_row(row)
    put = row["etcd_put"]
    assert put["ops"] > 0 and put["per_s"] > 0 and 0 < put["p50_ms"] <= put["p99_ms"]
    assert row["etcd_pairs_per_put"] == pytest.approx(row["pairs"]["per_s"] / put["per_s"])
    assert row["meets_target"] is (row["etcd_pairs_per_put"] >= 0.5)
    assert not _serving_children(), "the benchmark must stop its processes"


def test_bench_directory_shards_json(capsys):
    """``--shards 2``: the one directory, then two shard processes in the same run, each leasing
    its own chain (a request sent to the wrong shard would be refused, and the run fail)."""
    code = cli.main(["bench", "directory", "--backends", "embedded", *TINY, "--shards", "2", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    r = _one_json(captured.out)
    [one] = r["rows"]
    [two] = r["sharded_rows"]
    assert (r["shards"], one["shards"], two["shards"]) == (2, 1, 2)
    _check_row(one)
    _check_row(two)
    [scaling] = r["shard_scaling"]
    assert scaling["pairs_ratio"] == pytest.approx(two["pairs"]["per_s"] / one["pairs"]["per_s"])
    assert scaling["chain_blocks_ratio"] == pytest.approx(two["chains"]["blocks_per_s"] / one["chains"]["blocks_per_s"])
    assert scaling["projected_pairs_per_s_per_shard_core"] == pytest.approx(1e6 / two["pairs"]["directory_cpu_us_per_op"])
    assert not _serving_children(), "the benchmark must stop its processes"


def test_bench_directory_table(capsys):
    code = cli.main(["bench", "directory", "--backends", "embedded", *TINY])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    for text in ("acquire+release", "raw: ping round trip", "of ping", "us per pair"):
        assert text in captured.out, captured.out


@pytest.mark.parametrize("bad", [["--backends", "zookeeper"], ["--clients", "0"], ["--seconds", "-1"]])
def test_bench_directory_usage_errors(capsys, bad):
    assert cli.main(["bench", "directory", *bad]) == 2
    assert "error" in capsys.readouterr().err
