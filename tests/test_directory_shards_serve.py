"""Step 2 of the sharded directory (docs/sharding.md): ``kvcc serve directory --shard I --shards N``,
a real directory process serving one shard beside real cache nodes, on SQLite and on etcd.

The shard owns the chains whose root hashes to it: its roots are written, read and leased under
its own lease ids (odd ones, for shard 1 of 2), their children follow them, and another shard's
root is refused ``wrong_shard``. The log records the shard, so a directory started on it as
another shard or with another shard count -- or a sharded one on the one directory's log -- exits
with a clear error before it changes anything.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kvcc.reference.client import Refused, SyncClient
from kvcc.reference.cluster import ENGINE_TENANT, LocalCluster
from kvcc.reference.wire import Committed
from kvcc.spec.keys import Namespace, chain_keys, shard_of
from kvcc.spec.vocabulary import REASON_WRONG_SHARD

NS = Namespace(model_id="shards", model_revision="r1", kv_dtype="float16", block_tokens=4)


def roots(shard: int, shards: int, n: int) -> list:
    """``n`` chains (their keys) whose root shard ``shard`` of ``shards`` owns."""
    out = []
    for i in range(1000):
        chain = chain_keys(NS, list(range(i, i + 8)))
        if shard_of(chain[0].digest, shards) == shard:
            out.append(chain)
            if len(out) == n:
                return out
    raise AssertionError("not enough roots")


def serve_refused(cluster: LocalCluster, *args: str) -> str:
    """Start a directory on the cluster's log with ``args``; it must exit 2 at once. Its stderr."""
    argv = [sys.executable, "-m", "kvcc", "serve", "directory", "--config", str(cluster.config_path),
            "--state", str(cluster.workdir / "state" / "directory"), "--backend", cluster.backend]  # fmt: skip
    if cluster.backend == "etcd":
        argv += ["--etcd-endpoints", str(cluster.etcd_endpoints), "--etcd-prefix", cluster.etcd_prefix]
    done = subprocess.run([*argv, *args], capture_output=True, text=True, timeout=60, env=cluster._env())
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    return done.stderr


@pytest.fixture(params=["sqlite", "etcd"])
def backend(request):
    if request.param == "etcd":
        return {"backend": "etcd", "etcd_endpoints": ",".join(request.getfixturevalue("etcd1").endpoints)}
    return {"backend": "sqlite"}


def test_a_served_shard_owns_its_chains_and_its_log(tmp_path, backend):
    cluster = LocalCluster(tmp_path / "c", nodes=1, tiers=("dram=1MiB",), namespaces=[NS], shard=(1, 2), **backend)
    with cluster:
        c = cluster.client("c1")
        [mine, mine2] = roots(1, 2, 2)
        [theirs] = roots(0, 2, 1)
        assert isinstance(c.put(NS, mine[0], None, b"root of shard 1"), Committed)
        assert isinstance(c.put(NS, mine[1], mine[0], b"its child"), Committed)  # a child follows its root
        lease = c.acquire(NS, mine[1])
        assert not isinstance(lease, Refused), lease
        assert lease.lease % 2 == 1, f"shard 1 of 2 hands out odd lease ids, not {lease.lease}"
        assert c.read(lease) == b"its child"
        c.release(lease)
        assert c.begin_write(NS, theirs[0], None) == Refused(REASON_WRONG_SHARD, "")
        refused = c.put(NS, theirs[0], None, b"another shard's root")
        assert isinstance(refused, Refused) and refused.reason == REASON_WRONG_SHARD
        assert c.lookup(NS, theirs).blocks == 0
        grant = c.begin_write(NS, mine2[0], None)
        assert not isinstance(grant, Refused) and grant.lease % 2 == 1
        c.abort(grant)

        cluster.procs["directory"].stop()
        for args, found in ((("--shard", "0", "--shards", "2"), "shard 1 of 2"),
                            (("--shard", "1", "--shards", "3"), "shard 1 of 2"),
                            ((), "shard 1 of 2"),
                            (("--shard", "2", "--shards", "2"), "one of 0 .. shards - 1")):  # fmt: skip
            err = serve_refused(cluster, *args)
            assert found in err, err
        cluster.restart_directory(kill=False)  # as shard 1 of 2 again: its log, its blocks
        lease = c.acquire(NS, mine[0])
        assert not isinstance(lease, Refused) and lease.lease % 2 == 1
        assert c.read(lease) == b"root of shard 1"
        c.release(lease)


def test_a_log_of_the_one_directory_is_not_served_as_a_shard(tmp_path):
    """A log written before sharding is shard 0 of 1: serving it as one of two would refuse (and
    so lose) the chains of its other half."""
    cluster = LocalCluster(tmp_path / "c", nodes=1, tiers=("dram=1MiB",), namespaces=[NS])
    with cluster:
        c = cluster.client("c1")
        [chain] = roots(1, 2, 1)
        assert isinstance(c.put(NS, chain[0], None, b"x"), Committed)
        cluster.procs["directory"].stop()
        assert "shard 0 of 1" in serve_refused(cluster, "--shard", "1", "--shards", "2")
        assert "shard 0 of 1" in serve_refused(cluster, "--shard", "0", "--shards", "2")
        cluster.restart_directory(kill=False)
        lease = c.acquire(NS, chain[0])
        assert not isinstance(lease, Refused) and c.read(lease) == b"x"
        c.release(lease)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
        return f.read().split(") ", 1)[1][0] != "Z"


def _wait_for(check, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = check()
        if out:
            return out
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_serve_directory_with_shards_and_no_shard_serves_every_shard_and_stops_them_together(tmp_path):
    """``kvcc serve directory --shards 2`` (no ``--shard``): one process per shard, each its own
    state, port and event log, each refusing the other's roots; SIGTERM stops both; a shard that
    dies stops the other, and the command's exit status says so."""
    cluster = LocalCluster(tmp_path / "c", nodes=1, namespaces=[NS])  # only for its deployment file
    cluster.workdir.mkdir(parents=True)
    cluster.config_path.write_text(json.dumps(cluster.config))
    ready = tmp_path / "ready.json"
    argv = [sys.executable, "-m", "kvcc", "serve", "directory", "--config", str(cluster.config_path),
            "--state", str(tmp_path / "state"), "--shards", "2", "--ready-file", str(ready),
            "--events", str(tmp_path / "events.ndjson")]  # fmt: skip

    for ending in ("sigterm", "a shard dies"):
        ready.unlink(missing_ok=True)
        sup = subprocess.Popen(argv, env=cluster._env(), stderr=subprocess.PIPE, text=True)
        try:
            info = _wait_for(lambda: ready.exists() and json.loads(ready.read_text()), "every shard serving")
            shards = info["shards"]
            assert [s["shard"] for s in shards] == [0, 1] and info["port"] == shards[0]["port"]
            for i, s in enumerate(shards):
                c = SyncClient(("127.0.0.1", s["port"]), ENGINE_TENANT, cluster.engine_token, client_id=f"c{i}",
                               skew_ms=100)  # fmt: skip
                try:
                    [theirs] = roots(1 - i, 2, 1)
                    assert c.begin_write(NS, theirs[0], None) == Refused(REASON_WRONG_SHARD, ""), f"shard {i}"
                finally:
                    c.close()
                assert (tmp_path / "state" / f"shard-{i}").is_dir()
                assert (tmp_path / f"events-{i}.ndjson").is_file()
            if ending == "sigterm":
                sup.send_signal(signal.SIGTERM)
                assert sup.wait(60) == 0
            else:
                os.kill(shards[1]["pid"], signal.SIGKILL)
                assert sup.wait(60) == 1
                assert "shard 1 of 2 exited" in sup.stderr.read()
            for s in shards:
                _wait_for(lambda: not _alive(s["pid"]), f"shard {s['shard']} to exit", 30)
        finally:
            if sup.poll() is None:
                sup.kill()
                sup.wait(30)

    # Either layout's log is refused by the other: an empty directory beside it would serve under
    # nodes holding the old one's fences and epochs.
    at = argv.index("--shards")
    one = [*argv[:at], *argv[at + 2 :], "--shard", "0", "--shards", "2"]  # one shard, on STATE itself
    done = subprocess.run(one, capture_output=True, text=True, timeout=60, env=cluster._env())
    assert done.returncode == 2 and "every shard's logs" in done.stderr, done.stderr[-2000:]
    (tmp_path / "state" / "shard-0").rename(tmp_path / "elsewhere")
    (tmp_path / "state" / "shard-1").rename(tmp_path / "elsewhere-1")
    (tmp_path / "state" / "directory.db").touch()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=cluster._env())
    assert done.returncode == 2 and "holds a directory's log" in done.stderr, done.stderr[-2000:]
