"""``kvcc bench sglang``: kvcc's SGLang HiCache backend on a real LocalCluster (a directory and one
cache node on loopback) beside SGLang's own ``HiCacheFile``, under a tiny load. This checks the
report's shape and that every figure is a real measurement (positive, p50 <= p99); it never
asserts a speed. Needs SGLang (``bash scripts/setup.sh --with sglang``): without it the command
fails, naming that command, and so does this test."""

from __future__ import annotations

import json

import pytest

from kvcc import cli

TINY = ["--page-kib", "4", "16", "--pages", "3", "--trials", "1", "--exists-keys", "4", "--exists-calls", "3"]
TOP_KEYS = {"page_sizes", "pages", "trials", "exists_keys", "exists_calls", "exists_page_bytes", "api", "kvcc",
            "hicache_file", "bandwidth", "exists", "seconds", "python", "torch", "sglang"}
BANDWIDTH_KEYS = {"op", "page_bytes", "kvcc_bytes_per_s", "file_bytes_per_s", "ratio"}
EXISTS_KEYS = {"case", "keys", "present", "kvcc_p50_ms", "file_p50_ms", "ratio_p50", "kvcc_p99_ms", "file_p99_ms",
               "ratio_p99"}


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    for k, v in {"DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false",
                 "HF_HUB_OFFLINE": "1"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)


def _one_json(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, f"--json must print exactly one line, got {len(lines)}:\n{out[:2000]}"
    return json.loads(lines[0])


def test_bench_sglang_json(capsys, tmp_path):
    code = cli.main(["bench", "sglang", *TINY, "--dir", str(tmp_path), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    r = _one_json(captured.out)
    assert TOP_KEYS <= r.keys()
    assert r["page_sizes"] == [4 << 10, 16 << 10] and r["pages"] == 3 and r["trials"] == 1
    assert r["exists_keys"] == 4 and r["exists_page_bytes"] == 4 << 10
    assert r["kvcc"]["tier"] == "dram" and r["kvcc"]["refusals"] == {}
    assert r["hicache_file"]["metadata_cache"] is False and r["hicache_file"]["filesystem"]
    assert {(row["op"], row["page_bytes"]) for row in r["bandwidth"]} == {
        (op, s) for op in ("batch_set", "batch_get") for s in r["page_sizes"]}
    for row in r["bandwidth"]:
        assert BANDWIDTH_KEYS <= row.keys()
        assert row["kvcc_bytes_per_s"] > 0 and row["file_bytes_per_s"] > 0 and row["ratio"] > 0, row
    assert [row["case"] for row in r["exists"]] == ["all present", "half present"]
    assert [row["present"] for row in r["exists"]] == [4, 2]
    for row in r["exists"]:
        assert EXISTS_KEYS <= row.keys()
        for who in ("kvcc", "file"):
            assert 0 < row[f"{who}_p50_ms"] <= row[f"{who}_p99_ms"], row
        assert row["ratio_p50"] > 0 and row["ratio_p99"] > 0, row
    assert not list(tmp_path.iterdir()), "the benchmark must remove its files"


def test_bench_sglang_table(capsys, tmp_path):
    code = cli.main(["bench", "sglang", "--page-kib", "8", "--pages", "2", "--trials", "1", "--exists-keys", "2",
                     "--exists-calls", "2", "--dir", str(tmp_path)])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "kvcc SGLang backend vs HiCacheFile" in captured.out
    assert "batch_exists latency" in captured.out and "half present" in captured.out
    assert "8 KiB" in captured.out


@pytest.mark.parametrize("argv, fragment", [
    (["--page-kib", "0"], "at least 1"),
    (["--trials", "0"], "at least 1"),
    (["--tier", "tape"], "invalid choice"),
])
def test_bench_sglang_bad_arguments(capsys, argv, fragment):
    code = cli.main(["bench", "sglang", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert fragment in err
