"""Step 3 of the sharded directory, node side (docs/sharding.md): cache nodes registered with every
shard, ``LocalCluster(shards=N)`` and ``kvcc serve node --directory`` given once per shard.

A node says Hello to and heartbeats every shard, restores each shard's fences from that shard's
Welcome, answers each shard's pushes on that shard's link, and sends ``Lost``, ``Evict`` and
demotion ``Transfer`` to the key's shard, which it learns from the lease ids (shard ``i`` grants
only ids ``= i mod N``) and from the links pushes and Welcomes come on. These tests drive the
shards with plain one-directory clients, each connected to the shard that owns its chains (the
sharded client is tested in ``tests/test_sharded_client.py``; two-shard traces are validated by
``kvcc conform --adapter reference-sharded``, which CI runs).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import tempfile
import time
from pathlib import Path

import pytest

from kvcc.reference.client import Refused, SyncClient
from kvcc.reference.cluster import ENGINE_TENANT, ClusterError, LocalCluster
from kvcc.reference.events import EventLog, read_events
from kvcc.reference.node import REASON_SHARD_UNKNOWN, CacheNode
from kvcc.reference.serve import ConfigError, parse_directories
from kvcc.reference.tiers import DramTier, SharedPoolTier
from kvcc.reference.wire import BytesRead, BytesStored, Committed, Evict, EvictRefused, Free, ReadBytes, Tenants, WriteBytes
from kvcc.spec.keys import Namespace, chain_keys, shard_of

NS = Namespace(model_id="node-shards", model_revision="r1", kv_dtype="float16", block_tokens=4)
SHARDS = 2
SIZE = 4000  # bytes per block (a slot each: the cluster's blocks are 64 KiB)
WAIT_S = 30.0


def roots(shard: int, n: int, start: int = 0) -> list:
    """``n`` chains (each a root and its child) whose root shard ``shard`` of ``SHARDS`` owns."""
    out = []
    for i in range(start, start + 10_000):
        chain = chain_keys(NS, list(range(i * 10, i * 10 + 8)))
        if shard_of(chain[0].digest, SHARDS) == shard:
            out.append(chain)
            if len(out) == n:
                return out
    raise AssertionError("not enough roots")


def data(key) -> bytes:
    seed = hashlib.sha256(key.digest).digest()
    return (seed * (SIZE // len(seed) + 1))[:SIZE]


def shard_client(cluster: LocalCluster, shard: int, client_id: str) -> SyncClient:
    """A plain client of one shard (logging its events beside the cluster's)."""
    ev = EventLog(cluster.workdir / "events" / f"{client_id}.ndjson", client_id, 1)
    c = SyncClient(cluster.directory_addresses[shard], ENGINE_TENANT, cluster.engine_token, client_id=client_id,
                   skew_ms=cluster.skew_ms, events=ev, tls=cluster.tls)  # fmt: skip
    cluster._clients.append(c)
    return c


def directory_events(cluster: LocalCluster, shard: int) -> list[dict]:
    return read_events(cluster.workdir / "events" / f"directory-{shard}.ndjson", contiguous=False)


def read_back(c: SyncClient, key, shard: int) -> bytes | Refused:
    lease = c.acquire(NS, key)
    if isinstance(lease, Refused):
        return lease
    assert lease.lease % SHARDS == shard, f"shard {shard} granted lease {lease.lease}"
    try:
        return c.read(lease)
    finally:
        c.release(lease)


def until(what: str, check, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while True:
        out = check()
        if out:
            return out
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.1)


def test_directories_are_given_once_per_shard_in_order():
    assert parse_directories("127.0.0.1:7000") == [("127.0.0.1", 7000)]
    assert parse_directories(["h:1", "h:2"]) == [("h", 1), ("h", 2)]
    for bad in (["h:1", "h:1"], ["h"], []):
        with pytest.raises(ConfigError):
            parse_directories(bad)
    with pytest.raises(ValueError):
        LocalCluster("/nonexistent", shards=0)
    with pytest.raises(ValueError):
        LocalCluster("/nonexistent", shards=2, shard=(0, 2))


def test_a_sharded_node_routes_each_key_to_its_shard():
    """In process, no directory: a block's key and shard are learned from what put it there, and
    each request about it goes to that shard; a block of no known key and shard is neither
    evicted on the node's own say nor for a client (refused ``shard_unknown``)."""
    tokens = {"engine": b"e" * 32, "nodes": b"n" * 32}
    tenants = Tenants(tokens, {"engine": [NS.digest()]}, operators=frozenset({"nodes"}))

    async def body() -> None:
        dram = DramTier(4, 4096)
        node = CacheNode("n1", {"dram": dram}, tenants, [("127.0.0.1", 9), ("127.0.0.1", 10)], directory_tenant="nodes")
        assert node.shards == 2 and not node.directory_connected
        keys = [c[0] for c in roots(0, 2)] + [c[0] for c in roots(1, 2)]
        shards = [0, 0, 1, 1]
        tkeys = [node._tkey(k.digest, s) for k, s in zip(keys, shards)]
        for t in tkeys:
            dram.write(t, 1, 1, b"x" * 100)
        for k, s in list(zip(keys, shards))[:3]:  # keys[3]: never learned
            node._note(k.digest, s)
        sent: list = []

        async def to_directory(msg, shard=0):
            sent.append((type(msg).__name__, msg.key, shard))
            if isinstance(msg, Evict):
                return EvictRefused(msg.node, msg.key, msg.location, "leased")
            return None

        node._to_directory = to_directory
        await node._make_room(dram, "n1/dram", 4096)
        assert sorted(sent, key=lambda s: keys.index(s[1])) == [("Evict", keys[0], 0), ("Evict", keys[1], 0),
                                                                   ("Evict", keys[2], 1)]  # fmt: skip
        # A client's Evict finds the one shard whose block of the key is here; none: refused.
        stranger = roots(1, 3)[2][0]  # a root of shard 1's that no tier holds
        refused = await node._evict_for("engine", Evict("c1", stranger, "n1/dram"))
        assert refused == EvictRefused("c1", stranger, "n1/dram", REASON_SHARD_UNKNOWN)
        sent.clear()
        # A pushed Free is answered on the link it came on, and frees that shard's block only.
        node._welcomed[1].set()
        await node._after_welcome(node._free, Free("n1/dram", keys[3], 1), 1)
        assert sent == [("Freed", keys[3], 1)] and not dram.contains(tkeys[3], 1)
        # Forgotten once no tier holds the block; kept while one does.
        await node._prune_shards()
        assert node._known(tkeys[2]) == (keys[2].digest, 1)
        dram.free(tkeys[2], 1)
        await node._prune_shards()
        assert node._known(tkeys[2]) is None and node._known(tkeys[0]) == (keys[0].digest, 0)
        await node.close()

    asyncio.run(body())


def test_one_digest_in_two_shards_is_two_blocks_that_never_touch():
    """Each shard is a whole directory, and a digest is the client's to choose: a second record of
    a key's digest in another shard (another namespace or parent, which the one directory would
    refuse but a shard that never saw the digest grants) must never take, serve, free or fence
    the first record's bytes. A node keeps each shard's block of a digest apart (its tier key is
    a hash of the shard and the digest), so shard 1's write, read and free of the digest reach
    only shard 1's block, here and in the shared pool, whichever node wrote it."""
    tokens = {"engine": b"e" * 32, "nodes": b"n" * 32}
    tenants = Tenants(tokens, {"engine": [NS.digest()]}, operators=frozenset({"nodes"}))
    key = roots(0, 1)[0][0]
    dirs = [("127.0.0.1", 9), ("127.0.0.1", 10)]

    async def body(tmp: Path) -> None:
        pool_dir = tmp / "pool"
        n1 = CacheNode("n1", {"dram": DramTier(4, 4096)}, tenants, dirs, directory_tenant="nodes",
                       pool=SharedPoolTier(pool_dir, 1 << 20))  # fmt: skip
        n2 = CacheNode("n2", {"dram": DramTier(4, 4096)}, tenants, dirs, directory_tenant="nodes",
                       pool=SharedPoolTier(pool_dir, 1 << 20))  # fmt: skip
        ours, theirs = b"o" * 100, b"t" * 100
        for where in ("n1/dram", "pool"):
            other = n2 if where == "pool" else n1  # the pool: shard 1's writer comes through another node
            # lease 2: shard 0's (ids = shard mod 2); lease 3: shard 1's, for the same digest, generation, epoch
            assert isinstance(await n1._write_bytes(WriteBytes("w", key, 2, where, 0, 1, ours)), BytesStored)
            assert isinstance(await other._write_bytes(WriteBytes("x", key, 3, where, 0, 1, theirs)), BytesStored)
            for node in (n1, n2) if where == "pool" else (n1,):
                mine = await node._read_bytes(ReadBytes("r", key, 4, where, 0))
                assert isinstance(mine, BytesRead) and bytes(mine.data) == ours, (where, node.node_id, mine)
                other_read = await node._read_bytes(ReadBytes("x", key, 5, where, 0))
                assert isinstance(other_read, BytesRead) and bytes(other_read.data) == theirs
            # Shard 1 frees its record's copy: shard 0's block stays, whole.
            other._welcomed[1].set()
            other._to_directory = _ignore
            await other._after_welcome(other._free, Free(where, key, 1), 1)
            assert (await other._read_bytes(ReadBytes("x", key, 5, where, 0))).reason == "miss"
            mine = await n1._read_bytes(ReadBytes("r", key, 4, where, 0))
            assert isinstance(mine, BytesRead) and bytes(mine.data) == ours, where
        await n1.close()
        await n2.close()

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(body(Path(tmp)))


async def _ignore(msg, shard=0):
    return None


def test_nodes_register_with_every_shard_and_serve_both_shards_chains(tmp_path):
    cluster = LocalCluster(tmp_path / "c", nodes=2, tiers=("nvme=4MiB",), namespaces=[NS], shards=SHARDS,
                           verbose=True)  # fmt: skip
    with cluster:
        assert list(cluster.procs)[:2] == ["directory-0", "directory-1"]
        with pytest.raises(ClusterError, match="sharded 2 ways"):
            cluster.directory_address
        c = [shard_client(cluster, s, f"c{s}") for s in range(SHARDS)]
        for s in range(SHARDS):
            assert set(c[s].refresh_nodes()) == {"n1", "n2"}, f"shard {s} does not know every node"

        # Each shard's roots and their children, until each shard has a chain on n1.
        written: dict[int, list] = {0: [], 1: []}
        on_n1 = {0: 0, 1: 0}
        for s in range(SHARDS):
            for chain in roots(s, 12):
                root, child = chain[0], chain[1]
                assert isinstance(c[s].put(NS, root, None, data(root)), Committed)
                assert isinstance(c[s].put(NS, child, root, data(child)), Committed)
                written[s].append((root, child))
                hit = c[s].lookup(NS, [root, child])
                assert hit.blocks == 2, hit
                on_n1[s] += hit.locations[0].startswith("n1/")
                if on_n1[s] and len(written[s]) >= 3:
                    break
            assert on_n1[s], f"no chain of shard {s} placed on n1"
            assert {e["node"] for e in directory_events(cluster, s)} == {f"directory-{s}"}  # its own process name
            for root, child in written[s]:
                assert read_back(c[s], root, s) == data(root)
                assert read_back(c[s], child, s) == data(child)

        # n1 killed and restarted: it says Hello to both shards under its new incarnation, gets
        # each shard's fences from that shard, and its NVMe blocks are read again through both.
        cluster.restart("n1")
        new = cluster.procs["n1"].info["port"]
        for s in range(SHARDS):
            until(f"shard {s} sees n1 again", lambda s=s: c[s].refresh_nodes().get("n1") == f"127.0.0.1:{new}")
            until(f"shard {s} logged n1's restart",
                  lambda s=s: any(e["event"] == "restart_node" for e in directory_events(cluster, s)))
        log = (cluster.workdir / "logs" / "n1.log").read_text()
        for s in range(SHARDS):
            assert re.search(rf"n1 restored \d+ fences from shard {s}", log), log[-3000:]
        for s in range(SHARDS):
            for root, child in written[s]:
                assert read_back(c[s], root, s) == data(root)
                assert read_back(c[s], child, s) == data(child)
            assert set(c[s].refresh_nodes()) == {"n1", "n2"}


@pytest.fixture(params=["sqlite", "etcd"])
def backend(request):
    if request.param == "etcd":
        return {"backend": "etcd", "etcd_endpoints": ",".join(request.getfixturevalue("etcd1").endpoints)}
    return {"backend": "sqlite"}


def test_one_shard_restarts_while_the_other_serves(tmp_path, backend):
    cluster = LocalCluster(tmp_path / "c", nodes=1, tiers=("dram=1MiB",), namespaces=[NS], shards=SHARDS, **backend)
    with cluster:
        c = [shard_client(cluster, s, f"c{s}") for s in range(SHARDS)]
        chains = {s: roots(s, 2) for s in range(SHARDS)}
        for s in range(SHARDS):
            for chain in chains[s][:1]:
                assert isinstance(c[s].put(NS, chain[0], None, data(chain[0])), Committed)
                assert isinstance(c[s].put(NS, chain[1], chain[0], data(chain[1])), Committed)
        restarts = [sum(e["event"] == "restart_directory" for e in directory_events(cluster, s)) for s in range(SHARDS)]
        cluster.restart_directory(shard=1)
        # Shard 0 serves on at once: reads and a new chain (shard 1 is in its grace period).
        assert read_back(c[0], chains[0][0][1], 0) == data(chains[0][0][1])
        new = chains[0][1]
        assert isinstance(c[0].put(NS, new[0], None, data(new[0])), Committed)
        assert read_back(c[0], new[0], 0) == data(new[0])
        # Shard 1's blocks are read again once it serves (after its grace), the node with it.
        got = until("shard 1's root read again",
                    lambda: (lambda r: r if not isinstance(r, Refused) else None)(read_back(c[1], chains[1][0][0], 1)))
        assert got == data(chains[1][0][0])
        assert read_back(c[1], chains[1][0][1], 1) == data(chains[1][0][1])
        until("shard 1 knows n1 again", lambda: "n1" in c[1].refresh_nodes())
        after = [sum(e["event"] == "restart_directory" for e in directory_events(cluster, s)) for s in range(SHARDS)]
        assert after == [restarts[0], restarts[1] + 1], (restarts, after)
        if backend["backend"] == "etcd":
            assert [a[a.index("--etcd-prefix") + 1] for a in (cluster.procs[f"directory-{s}"].argv for s in range(2))] \
                == [f"{cluster.etcd_prefix}-s0", f"{cluster.etcd_prefix}-s1"]


def test_eviction_and_demotion_go_to_the_keys_shard(tmp_path):
    """A small DRAM tier over a small NVMe one, filled with both shards' roots: the node demotes
    (``Transfer``) and evicts (``Evict``) each key at its own shard -- no shard is asked about
    another's key -- and every block still cached reads back as written."""
    cluster = LocalCluster(tmp_path / "c", nodes=1, tiers=("dram=256KiB", "nvme=512KiB"), namespaces=[NS],
                           shards=SHARDS)  # fmt: skip
    with cluster:
        c = [shard_client(cluster, s, f"c{s}") for s in range(SHARDS)]
        keys = {s: [chain[0] for chain in roots(s, 10)] for s in range(SHARDS)}
        for i in range(10):
            for s in range(SHARDS):
                out = c[s].put(NS, keys[s][i], None, data(keys[s][i]))
                assert isinstance(out, Committed), out
            time.sleep(0.25)  # the node's demotion runs every 200 ms
        time.sleep(1.0)
        present = 0
        for s in range(SHARDS):
            for k in keys[s]:
                if c[s].lookup(NS, [k]).blocks:
                    got = read_back(c[s], k, s)
                    if not isinstance(got, Refused):
                        assert got == data(k), "wrong bytes"
                        present += 1
        assert 0 < present < 20
        kinds = {"evict": 0, "start_transfer": 0}
        for s in range(SHARDS):
            mine = {k.hex for k in keys[s]}
            events = directory_events(cluster, s)
            asked = [e for e in events if e["event"] in ("evict", "ignore_evict", "start_transfer")]
            assert asked, f"shard {s} was asked about none of its keys"
            for e in asked:
                assert e["key"] in mine, f"shard {s} was asked about another shard's key: {e}"
                assert e["event"] != "ignore_evict" or e.get("result") != "not_found", e
                kinds[e["event"]] = kinds.get(e["event"], 0) + 1
        assert kinds["evict"] > 0 and kinds["start_transfer"] > 0, kinds


def test_a_sharded_cluster_client_routes_to_both_shards(tmp_path):
    """``LocalCluster(shards=2).client()``: a synchronous ``ShardedClient`` over both shards."""
    pytest.importorskip("kvcc.reference.sharded")
    cluster = LocalCluster(tmp_path / "c", nodes=2, tiers=("dram=1MiB",), namespaces=[NS], shards=SHARDS)
    with cluster:
        c = cluster.client("engine")
        for s in range(SHARDS):
            [chain] = roots(s, 1)
            assert isinstance(c.put(NS, chain[0], None, data(chain[0])), Committed)
            assert isinstance(c.put(NS, chain[1], chain[0], data(chain[1])), Committed)
            assert c.lookup(NS, chain[:2]).blocks == 2
            for k in chain[:2]:
                lease = c.acquire(NS, k)
                assert not isinstance(lease, Refused) and lease.lease % SHARDS == s
                assert c.read(lease) == data(k)
                c.release(lease)
        ops = cluster.operator_client("ops")
        assert ops is not None
