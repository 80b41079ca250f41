"""``kvcc bench tiers``: the command runs every tier end to end and reports ratios against a raw
limit measured in the same run. Tiny sizes and one trial: this checks the shape of the report and
that every figure is a real measurement, never a speed (no time is asserted here)."""

from __future__ import annotations

import json

import pytest

from kvcc import cli

pytest.importorskip("torch")

ROW_KEYS = {"tier", "op", "size", "tier_gb_per_s", "raw_gb_per_s", "ratio", "ratio_min", "ratio_max", "raw",
            "meets_target"}
TINY = ["--sizes", "64K,1M", "--trials", "1", "--threads", "2",
        "--memory-trial-bytes", "4M", "--file-trial-bytes", "8M"]


@pytest.fixture(autouse=True)
def _wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")


def _one_json(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, f"--json must print exactly one line, got {len(lines)}:\n{out[:2000]}"
    return json.loads(lines[0])


def test_bench_tiers_json_every_tier(capsys, tmp_path):
    code = cli.main(["bench", "tiers", *TINY, "--dir", str(tmp_path), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    r = _one_json(captured.out)
    assert r["sizes"] == [64 << 10, 1 << 20]
    assert r["trials"] == 1 and r["threads"] == 2
    assert r["target"] == {"ratio": 0.8, "min_size": 1 << 20}
    rows = r["rows"]
    assert rows and all(ROW_KEYS <= row.keys() for row in rows)
    seen = {(row["tier"], row["op"], row["size"]) for row in rows}
    for tier in ("dram", "gpu", "nvme", "pool"):
        for op in ("read", "write"):
            for size in r["sizes"]:
                assert (tier, op, size) in seen, (tier, op, size)
    for tier in ("dram (no verify)", "gpu (no verify)", "dram (split reads)"):
        assert {(tier, "read", s) for s in r["sizes"]} <= seen
        assert not any(t == tier and op == "write" for t, op, _ in seen), "only reads differ"
    for row in rows:
        assert row["tier_gb_per_s"] > 0 and row["raw_gb_per_s"] > 0 and row["ratio"] > 0, row
        # One trial here: the spread of per-trial ratios is that trial's ratio.
        assert row["ratio_min"] == row["ratio_max"] == pytest.approx(row["ratio"], abs=0.0015), row
        assert row["raw"], row
        # The target applies from 1 MiB; below it the row says so with null.
        assert (row["meets_target"] is None) == (row["size"] < r["target"]["min_size"]), row
    assert set(r["met"]) == {f"{row['tier']}/{row['op']}" for row in rows}
    assert isinstance(r["direct_io"], bool) and r["filesystem"]
    assert not list(tmp_path.iterdir()), "the benchmark must remove its files"
    _check_memory_limits(r["memory_limits"])


LIMIT_KEYS = {"block", "ring_bytes", "xxh3_cached", "xxh3_memory", "memcpy", "hash_then_copy_ratio",
              "gil_free_share", "hash_two_threads_speedup", "thread_handoff_us", "torch_copy", "torch_threads"}


def _check_memory_limits(m: dict) -> None:
    """Every figure of the memory-limits probe is there and is a measurement (positive)."""
    assert set(m) == LIMIT_KEYS, set(m) ^ LIMIT_KEYS
    assert all(isinstance(v, int | float) and v > 0 for v in m.values()), m
    assert m["ring_bytes"] % m["block"] == 0 and m["ring_bytes"] >= 2 * m["block"]


def test_memory_limits_probe_alone():
    from kvcc.bench.tiers import probe_memory

    m = probe_memory(block=256 << 10, ring_bytes=1 << 20, rounds=1)
    _check_memory_limits(m)
    assert m["block"] == 256 << 10 and m["ring_bytes"] == 1 << 20


def test_file_tiers_only_skip_the_memory_probe(capsys, tmp_path):
    code = cli.main(["bench", "tiers", "--tiers", "nvme", "--sizes", "64K", "--trials", "1",
                     "--file-trial-bytes", "1M", "--dir", str(tmp_path), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert _one_json(captured.out)["memory_limits"] is None


def test_bench_tiers_table(capsys, tmp_path):
    code = cli.main(["bench", "tiers", "--tiers", "dram,nvme", "--sizes", "64K", "--trials", "1",
                     "--memory-trial-bytes", "1M", "--file-trial-bytes", "1M", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "Tier bandwidth / raw limit" in out
    for tier in ("dram", "nvme"):
        assert tier in out
    assert "memory limits (" in out, "the probe's figures are printed under the table"
    assert "pool" not in out.split("raw limits:")[0]


@pytest.mark.parametrize("argv, fragment", [
    (["--tiers", "tape"], "tiers are"),
    (["--sizes", "big"], "not a size"),
    (["--trials", "0"], "at least 1"),
])
def test_bench_tiers_bad_arguments(capsys, argv, fragment):
    code = cli.main(["bench", "tiers", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert fragment in err
