"""``kvcc cluster up`` and ``kvcc serve``: real processes, started and stopped by the command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcc.reference.serve import ClusterConfig, ConfigError, parse_size, parse_tier
from kvcc.reference.transport import ServerLimits

ENV = dict(os.environ, PYTHONSAFEPATH="1", DO_NOT_TRACK="1", VLLM_NO_USAGE_STATS="1",
           LMCACHE_TRACK_USAGE="false", HF_HUB_OFFLINE="1")  # fmt: skip


def _kvcc(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcc", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_cluster_up_runs_the_demo_and_stops_cleanly(tmp_path):
    r = _kvcc("cluster", "up", "--nodes", "3", "--workdir", str(tmp_path), "--json", "--metrics")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["ok"] is True
    # --metrics: every process served them on loopback (what they show: tests/test_metrics.py)
    assert len(out["metrics_urls"]) == 4
    assert all(u.startswith("http://127.0.0.1:") and u.endswith("/metrics") for u in out["metrics_urls"].values())
    steps = {s[0]: s[2] for s in out["steps"]}
    assert "6/6 leased reads from" in steps["lookup+read"]
    assert "returned the committed bytes" in steps["lookup+read"]
    assert steps["invalidate"].startswith("completed")
    assert "read under a revoked lease: revoked" in steps["invalidate"]
    assert steps["evict"] == "refused (leased) / refused (has_children) / evicted"
    assert "stale bytes: fenced" in steps["fencing"] and "readers see engine-b's bytes: True" in steps["fencing"]
    # every spec-visible step of the demo is in the trace
    for event in ("grant_write_lease", "commit_write", "grant_read_lease", "read", "drop_and_ack", "revoke_acked",
                  "complete_invalidation", "evict", "evict_refused", "fence_stale_write", "reject_stale_commit"):
        assert out["events"].get(event, 0) >= 1, event
    # and every process it started is gone
    pids = [json.loads(p.read_text())["pid"] for p in (tmp_path / "run").glob("*.ready")]
    assert len(pids) == 4
    assert not [p for p in pids if _alive(p)]


def test_a_command_stopped_by_sigterm_stops_what_it_started(tmp_path):
    """SIGTERM to ``kvcc`` ends it as Ctrl-C would: ``cluster up --serve`` stops its directory and
    node before it exits -- 143 if the signal came during its demo, 0 in its serving loop (the
    default action killed the command alone and left them running)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvcc", "cluster", "up", "--nodes", "1", "--workdir",
                             str(tmp_path), "--serve", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(list((tmp_path / "run").glob("*.ready"))) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
            time.sleep(0.2)
        pids = [json.loads(p.read_text())["pid"] for p in (tmp_path / "run").glob("*.ready")]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM and "kvcc: terminated" in err or proc.returncode == 0, err[-3000:]
    assert not [p for p in pids if _alive(p)]


def test_serve_node_and_directory_shut_down_on_sigterm(tmp_path):
    cfg = {
        "lease_term_ms": 2000, "skew_ms": 100, "node_tenant": "nodes",
        "tenants": {"nodes": {"token": "ab" * 16, "operator": True}},
    }  # fmt: skip
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    ready = tmp_path / "dir.ready"
    d = subprocess.Popen([sys.executable, "-m", "kvcc", "serve", "directory", "--config", str(tmp_path / "c.json"),
                          "--state", str(tmp_path / "d"), "--ready-file", str(ready)], env=ENV)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert d.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        port = json.loads(ready.read_text())["port"]
        nready = tmp_path / "n.ready"
        n = subprocess.Popen([sys.executable, "-m", "kvcc", "serve", "node", "--config", str(tmp_path / "c.json"),
                              "--id", "n1", "--directory", f"127.0.0.1:{port}", "--state", str(tmp_path / "n1"),
                              "--tier", "dram=1MiB", "--block-bytes", "65536", "--ready-file", str(nready)],
                             env=ENV)  # fmt: skip
        try:
            while not nready.exists():
                assert n.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            assert json.loads(nready.read_text())["incarnation"] == 1
        finally:
            n.send_signal(signal.SIGTERM)
            assert n.wait(20) == 0
    finally:
        d.send_signal(signal.SIGTERM)
        assert d.wait(20) == 0


@pytest.mark.parametrize(
    "raw",
    [
        {},  # nothing
        {"lease_term_ms": 2000, "skew_ms": 100, "node_tenant": "nodes", "tenants": {"nodes": {"token": "zz"}}},
        {"lease_term_ms": 2000, "skew_ms": 100, "node_tenant": "nodes", "tenants": {"nodes": {"token": "ab"}}},
        {"lease_term_ms": 2000, "skew_ms": 100, "node_tenant": "x",
         "tenants": {"x": {"token": "ab" * 16}}},  # a node tenant must be an operator
        *({"lease_term_ms": 2000, "skew_ms": 100, "node_tenant": "nodes",
           "tenants": {"nodes": {"token": "ab" * 16, "operator": True}}, "transport": transport}
          for transport in ({"handshake_timeout_ms": 0}, {"frame_grace_ms": "10"}, {"max_conections": 3}, [1])),
    ],
)
def test_bad_deployment_files_are_typed_errors(raw):
    with pytest.raises(ConfigError):
        ClusterConfig.from_dict(raw)


def test_transport_limits_come_from_the_deployment_file():
    raw = {"lease_term_ms": 2000, "skew_ms": 100, "node_tenant": "nodes",
           "tenants": {"nodes": {"token": "ab" * 16, "operator": True}}}  # fmt: skip
    assert ClusterConfig.from_dict(raw).transport == ServerLimits()
    got = ClusterConfig.from_dict({**raw, "transport": {"handshake_timeout_ms": 250, "max_unauthenticated": 4}})
    assert got.transport == ServerLimits(handshake_timeout_ms=250, max_unauthenticated=4)


def test_serve_with_a_bad_config_exits_2(tmp_path):
    (tmp_path / "c.json").write_text("{not json")
    r = _kvcc("serve", "directory", "--config", str(tmp_path / "c.json"), "--state", str(tmp_path / "d"), timeout=60)
    assert r.returncode == 2 and "cannot read deployment file" in r.stderr


def test_sizes_and_tiers_parse():
    assert parse_size("64MiB") == 64 << 20 and parse_size("1g") == 1 << 30 and parse_size("4096") == 4096
    assert parse_tier("nvme=2GiB") == ("nvme", 2 << 30)
    for bad in ("tape=1G", "dram", "dram=lots"):
        with pytest.raises(ConfigError):
            parse_tier(bad)
