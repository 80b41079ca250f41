"""Identities are authenticated (issue 14): nodes, tenants and each node's credential are told
apart, on a real deployment (a directory and two cache-node processes on loopback,
``LocalCluster``, which gives every node a credential of its own).

Each attack is made as a peer holding a credential would, with a raw transport client, and each
is refused with a typed error (the connection's final ``Error("unauthorized")``) leaving the
directory as it was: the nodes it lists and their addresses, the owners of a committed chain, and
its event log. Before the fix a tenant's credential could say ``Hello`` as any node: it learned
the fences (keys and epochs) of the node's locations, voided a chain by reporting its location
lost, registered an address of its own where writes were then placed, and -- under a higher
incarnation -- kept the real node from rejoining; the tests marked so failed on that code.

- a tenant says Hello as node ``n1``: with an address of its own, reporting ``n1``'s location
  lost, under ``n1``'s id as a client id, as a node of its own with an address (``n9``);
- a tenant sends what only nodes send (``Freed``, ``Copied``, ``Transfer``);
- ``n2``'s credential says Hello as ``n1``, names ``n1``'s locations, acks, evicts or transfers
  there, or moves ``n1``'s copy onto its own tier;
- a node's credential asks what only clients ask, or connects to a node's data port;
- a client id is another tenant's;
- the operator's credential invalidates and looks up in the engine's namespace, and asks nothing
  else: no lease, no write, no node's message, no connection to a node's data port;
- after the attempts the real ``n1`` restarts and rejoins; normal operation is unchanged: puts and
  reads (co-located too), a client's eviction through a node, a transfer asked under ``n1``'s own
  credential that the real node carries out (``Copy``, then ``Copied`` under its credential).

The deployment file's forms (``ClusterConfig``): the ``nodes`` section, and the older form whose
nodes share one operator credential, still loaded and still served (``shared_node_credential``).
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from kvcc.reference.cluster import ENGINE_TENANT, NODE_TENANT, OPERATOR, LocalCluster
from kvcc.reference.errors import ConnectionFailed
from kvcc.reference.serve import ClusterConfig, ConfigError
from kvcc.reference.transport import Client
from kvcc.reference.wire import (
    Acquire,
    BeginWrite,
    Copied,
    Error,
    Evict,
    Freed,
    Hello,
    Invalidate,
    ListNodes,
    Lookup,
    NodeList,
    Ping,
    PrefixFound,
    ReadBytes,
    ReadRefused,
    Tenants,
    Transfer,
    TransferRefused,
    TransferStarted,
    Welcome,
    WriteBytes,
    node_credential,
    operator_credential,
)
from kvcc.spec.keys import BlockKey, Namespace, chain_keys

for _name, _value in {"DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false",
                      "HF_HUB_OFFLINE": "1"}.items():  # fmt: skip
    os.environ.setdefault(_name, _value)

NS = Namespace("identities", "r1", "bfloat16", 4)
BLOCK_BYTES = 64 << 10
CHAIN = list(chain_keys(NS, list(range(16))))  # four blocks of four tokens
assert len(CHAIN) == 4
SETTLE_S = 0.3  # the directory logs a step within this of the request that caused it
WAIT_S = 15.0
HUGE_INCARNATION = 2**40  # a Hello under it used to keep the real node from ever rejoining


def _block(key: BlockKey) -> bytes:
    return (key.digest * (BLOCK_BYTES // len(key.digest) + 1))[:BLOCK_BYTES]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("identities"), nodes=2, tiers=["dram=8MiB", "nvme=32MiB"],
                      block_bytes=BLOCK_BYTES, namespaces=[NS]) as c:  # fmt: skip
        w = c.client("n1.writer")  # co-located with n1: the chain lives on n1's DRAM
        for i, key in enumerate(CHAIN):
            assert not hasattr(w.put(NS, key, CHAIN[i - 1] if i else None, _block(key)), "reason")
        yield c


# ---------------------------------------------------------------------------------- helpers


def _credential(cluster: LocalCluster, who: str) -> tuple[str, bytes]:
    """(credential name, token) of a tenant (``engine``, ``nodes``), a node (``n1``, ``n2``) or the
    operator (``OPERATOR``)."""
    if who in cluster.node_ids:
        return node_credential(who), cluster.node_token(who)
    if who == OPERATOR:
        return operator_credential(OPERATOR), bytes.fromhex(cluster.config["operators"][OPERATOR]["token"])
    return who, bytes.fromhex(cluster.config["tenants"][who]["token"])


def _ask(cluster: LocalCluster, who: str, msg, *, port: int | None = None):
    """One request on a fresh connection under ``who``'s credential: its reply."""
    name, token = _credential(cluster, who)

    async def go():
        async with Client("127.0.0.1", port or cluster.directory_address[1], name, token) as c:
            return await c.request(msg, timeout_ms=int(WAIT_S * 1000))

    return asyncio.run(go())


def _refused(cluster: LocalCluster, who: str, msg, *, port: int | None = None) -> str:
    """``msg`` under ``who``'s credential is refused as unauthorized; the refusal's text."""
    with pytest.raises(ConnectionFailed) as failed:
        reply = _ask(cluster, who, msg, port=port)
        pytest.fail(f"{type(msg).__name__} under {who}'s credential was answered: {reply!r}")
    assert failed.value.code == "unauthorized", failed.value
    return str(failed.value)


def _directory_events(cluster: LocalCluster) -> list[str]:
    path = cluster.workdir / "events" / "directory.ndjson"
    return path.read_text().splitlines() if path.exists() else []


def _state(cluster: LocalCluster):
    """What the directory says of the members and of the chain, and its event log, once quiet."""
    before, deadline = None, time.monotonic() + WAIT_S
    while time.monotonic() < deadline:  # quiet: no step logged for SETTLE_S
        events = _directory_events(cluster)
        if events == before:
            break
        before = events
        time.sleep(SETTLE_S)
    nodes = _ask(cluster, ENGINE_TENANT, ListNodes(1))
    found = _ask(cluster, ENGINE_TENANT, Lookup(NS.digest(), tuple(CHAIN)))
    assert type(nodes) is NodeList and type(found) is PrefixFound
    return dict(zip(nodes.nodes, nodes.addresses)), found, before


def _address(cluster: LocalCluster, node: str) -> str:
    return f"127.0.0.1:{int(cluster.procs[node].info['port'])}"


def _assert_chain_readable(cluster: LocalCluster, client_id: str) -> None:
    c = cluster.client(client_id, events=False)
    for key in CHAIN:
        lease = c.acquire(NS, key)
        assert not hasattr(lease, "reason"), lease
        assert lease.location.startswith("n1/"), lease
        assert c.read(lease) == _block(key)
        c.release(lease)


@pytest.fixture
def unchanged(cluster):
    """The test's attacks change nothing the directory says, and log no step."""
    members, owners, events = _state(cluster)
    assert set(members) >= {"n1", "n2"} and members["n1"] == _address(cluster, "n1")
    assert owners.blocks_matched == len(CHAIN)
    yield
    time.sleep(SETTLE_S)
    after_members, after_owners, after_events = _state(cluster)
    assert after_members == members
    assert after_owners == owners
    assert after_events == events, after_events[len(events):]


# ---------------------------------------------------------------------------------- a tenant as a node


def test_a_tenant_cannot_say_hello_as_a_node(cluster, unchanged):
    """Failed before: the engine's credential registered as ``n1`` at an address of its own
    (writes and directives went there) under an incarnation the real node never reaches."""
    text = _refused(cluster, ENGINE_TENANT, Hello("n1", HUGE_INCARNATION, "127.0.0.1:9", ("n1/dram", "n1/nvme"), ()))
    assert "cache node" in text
    # The tenant that the nodes used to share is a tenant now, and no more a node than the engine.
    _refused(cluster, NODE_TENANT, Hello("n1", HUGE_INCARNATION, "127.0.0.1:9", ("n1/dram",), ()))


def test_a_tenant_cannot_report_a_nodes_location_lost(cluster, unchanged):
    """Failed before: the chain on ``n1/dram`` was voided, and the Welcome told the tenant every
    key there with its epoch."""
    port = int(cluster.procs["n1"].info["port"])
    _refused(cluster, ENGINE_TENANT, Hello("n1", 1, f"127.0.0.1:{port}", ("n1/dram", "n1/nvme"), ("n1/dram",)))


def test_a_tenant_cannot_register_a_node_address(cluster, unchanged):
    """Failed before: ``n9`` was listed with the tenant's address, and writes placed on it."""
    _refused(cluster, ENGINE_TENANT, Hello("n9", 1, "127.0.0.1:9", ("n9/dram",), ()))
    _refused(cluster, ENGINE_TENANT, Hello("n9", 1, "127.0.0.1:9", (), ()))  # an address is a node's


def test_a_tenant_cannot_use_a_nodes_id_as_a_client_id(cluster, unchanged):
    """Failed before: the client took ``n1``'s registration, and directives for ``n1`` with it."""
    _refused(cluster, ENGINE_TENANT, Hello("n1", 1, "", (), ()))
    _refused(cluster, ENGINE_TENANT, Hello("n2", HUGE_INCARNATION, "", (), ()))


def test_a_tenant_cannot_send_what_only_nodes_send(cluster, unchanged):
    key = CHAIN[0]
    _refused(cluster, ENGINE_TENANT, Freed("n1/dram", key, 1))
    _refused(cluster, ENGINE_TENANT, Copied("n1/nvme", key, 2))
    _refused(cluster, ENGINE_TENANT, Transfer("n1", key, 0, "n1/dram", "n1/nvme"))


# ---------------------------------------------------------------------------------- a node as another


def test_a_node_cannot_act_as_another_node(cluster, unchanged):
    key = CHAIN[-1]
    _refused(cluster, "n2", Hello("n1", HUGE_INCARNATION, "127.0.0.1:9", ("n1/dram",), ()))
    # Its own id, another's locations: reporting them lost would void them.
    _refused(cluster, "n2", Hello("n2", HUGE_INCARNATION, "127.0.0.1:9", ("n1/dram",), ("n1/dram",)))
    _refused(cluster, "n2", Hello("n2", HUGE_INCARNATION, "127.0.0.1:9", ("n2/dram",), ("n1/dram",)))
    _refused(cluster, "n2", Freed("n1/dram", key, 1))
    _refused(cluster, "n2", Copied("n1/nvme", key, 2))
    _refused(cluster, "n2", Evict("n1", key, "n1/dram"))
    _refused(cluster, "n2", Evict("n2", key, "n1/dram"))
    _refused(cluster, "n2", Transfer("n2", key, 0, "n1/dram", "n1/nvme"))
    _refused(cluster, "n2", Transfer("n1", key, 0, "n1/dram", "n1/nvme"))
    # Onto its own tier, but the copy is n1's: refused as a transfer, nothing moves.
    refused = _ask(cluster, "n2", Transfer("n2", key, 0, "n1/dram", "n2/nvme"))
    assert type(refused) is TransferRefused and refused.reason == "not_transferable", refused


def test_a_node_credential_is_no_client(cluster, unchanged):
    _refused(cluster, "n1", Lookup(NS.digest(), tuple(CHAIN)))
    _refused(cluster, "n1", BeginWrite("n1", BlockKey(os.urandom(32)), NS.digest(), None, 1))
    _refused(cluster, "n1", Hello("n1.engine", 1, "", (), ()))  # not a client id under it either
    # Nor does a node's data server take it (nodes do not dial each other).
    _refused(cluster, "n1", Ping(1), port=int(cluster.procs["n2"].info["port"]))
    _refused(cluster, "n2", Ping(1), port=int(cluster.procs["n2"].info["port"]))


def test_a_client_id_stays_its_tenants(cluster, unchanged):
    _ask(cluster, ENGINE_TENANT, Hello("engine-client", 1, "", (), ()))
    _refused(cluster, NODE_TENANT, Hello("engine-client", 1, "", (), ()))


# ---------------------------------------------------------------------------------- the operator


def test_an_operator_invalidates_in_any_namespace(cluster):
    """Operators had no credential of their own: an ``operator`` tenant was a client of every
    namespace, leases and writes included. The operator's credential invalidates a block of the
    engine's namespace (which it holds no tenant right to) and looks it up, and the block is gone
    for the engine; a tenant without the namespace may not."""
    engine = cluster.client("n1.operated", events=False)  # co-located with n1, as the chain's writer
    key = BlockKey(os.urandom(32))
    assert not hasattr(engine.put(NS, key, None, _block(key)), "reason")
    op = cluster.operator_client("ops.console")
    assert op.lookup(NS, [key]).blocks == 1
    _refused(cluster, NODE_TENANT, Invalidate(NS.digest(), "key", key))  # a tenant of no namespace
    ticket = op.invalidate(NS, "key", key)
    assert ticket.keys == 1 and op.wait(ticket, WAIT_S)
    assert engine.lookup(NS, [key]).blocks == 0
    assert op.lookup(NS, [key]).blocks == 0
    assert set(op.refresh_nodes()) >= {"n1", "n2"}


def test_kvcc_admin_invalidates_as_the_operator_and_refuses_bad_input(cluster, capsys):
    """``kvcc admin``: the operator's actions from the command line, under its credential from the
    deployment file. Bad input is refused before anything is sent (exit 2, one line)."""
    import json

    from kvcc.cli import main

    engine = cluster.client("n1.admin", events=False)
    key = BlockKey(os.urandom(32))
    assert not hasattr(engine.put(NS, key, None, _block(key)), "reason")
    base = ["--config", str(cluster.config_path), "--operator", OPERATOR,
            "--directory", "%s:%d" % cluster.directory_address, "--json"]  # fmt: skip
    capsys.readouterr()
    assert main(["admin", "nodes", *base]) == 0
    assert {"n1", "n2"} <= set(json.loads(capsys.readouterr().out)["nodes"])
    invalidate = ["admin", "invalidate", *base, "--namespace", NS.digest().hex()]
    assert main([*invalidate, "--scope", "key", "--key", key.digest.hex(), "--wait", str(WAIT_S)]) == 0
    assert json.loads(capsys.readouterr().out) == {"ticket": ANY_TICKET, "keys": 1, "completed": True}
    assert engine.lookup(NS, [key]).blocks == 0 and engine.lookup(NS, CHAIN).blocks == len(CHAIN)
    bad = [
        [*invalidate, "--scope", "key"],  # no key
        [*invalidate, "--scope", "key", "--key", "zz"],
        [*invalidate, "--scope", "namespace", "--key", key.digest.hex()],
        ["admin", "invalidate", *base[:3], "nobody", *base[4:], "--namespace", NS.digest().hex(), "--scope", "namespace"],
        ["admin", "nodes", *base[:5], "no-port", "--json"],
    ]  # fmt: skip
    for argv in bad:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("kvcc admin") and err.count("\n") == 1, err
    assert engine.lookup(NS, CHAIN).blocks == len(CHAIN)  # nothing of the chain was voided
    assert main(["admin", "nodes", *base[:5], "127.0.0.1:1", "--json"]) == 3  # nothing listens there
    assert "failed" in capsys.readouterr().err


class _AnyTicket:
    def __eq__(self, other: object) -> bool:
        return type(other) is int and other > 0


ANY_TICKET = _AnyTicket()


def test_an_operator_holds_no_lease_writes_nothing_and_is_no_node(cluster, unchanged):
    text = _refused(cluster, OPERATOR, Acquire("ops.console", CHAIN[0], NS.digest(), 1))
    assert "operator" in text
    _refused(cluster, OPERATOR, BeginWrite("ops.console", BlockKey(os.urandom(32)), NS.digest(), None, 1))
    _refused(cluster, OPERATOR, Hello("n1", HUGE_INCARNATION, "127.0.0.1:9", ("n1/dram",), ()))
    _refused(cluster, OPERATOR, Hello("n1", 1, "", (), ()))  # nor a node's id as a client id
    _refused(cluster, OPERATOR, Freed("n1/dram", CHAIN[0], 1))
    _refused(cluster, OPERATOR, Evict("n1", CHAIN[0], "n1/dram"))
    # No bytes: a node's data server does not take the operator's credential.
    _refused(cluster, OPERATOR, Ping(1), port=int(cluster.procs["n1"].info["port"]))


# ---------------------------------------------------------------------------------- normal operation


def test_a_tenant_gets_no_bytes_at_a_node_without_the_directorys_grant_to_it(cluster):
    """Tenant isolation at the data plane. Failed before: a node served and stored a block's bytes
    for any tenant with a valid token -- another tenant read a committed block at its node, then
    overwrote it, and the owner's next leased read returned the attacker's bytes. Now a node
    serves or stores bytes only under the directory's grant of that block, location and lease to
    the very tenant asking (``wire.grants``): none, a forged one, or the owner's own (sniffed)
    grant presented under another credential is refused, and nothing lands."""
    owner = cluster.client("n2.owner")  # co-located with n2: its blocks land on n2's DRAM
    key = BlockKey(os.urandom(32))
    data = _block(key)
    assert not hasattr(owner.put(NS, key, None, data), "reason")
    lease = owner.acquire(NS, key)
    port = int(cluster.procs[lease.location.split("/")[0]].info["port"])
    forged = lease.grant[:8] + os.urandom(32)
    for grant in (b"", forged, lease.grant):
        got = _ask(cluster, NODE_TENANT, ReadBytes("thief", key, lease.lease, lease.location, lease.gen, grant), port=port)
        assert type(got) is ReadRefused and got.reason == "unauthorized", (grant[:8], got)
        put = _ask(cluster, NODE_TENANT, WriteBytes("thief", key, lease.lease, lease.location, lease.gen, lease.epoch,
                                                    bytes(len(data)), grant), port=port)  # fmt: skip
        assert type(put) is Error and put.code == "unauthorized", (grant[:8], put)
    assert owner.read(lease) == data  # the owner's grant, under the owner's credential
    owner.release(lease)
    # A write grant is the writer's alone too: the owner's, presented by another tenant, stores nothing.
    fresh = BlockKey(os.urandom(32))
    wl = owner.begin_write(NS, fresh, None)
    put = _ask(cluster, NODE_TENANT, WriteBytes("thief", fresh, wl.lease, wl.location, wl.gen, wl.epoch,
                                                b"x" * BLOCK_BYTES, wl.grant), port=port)  # fmt: skip
    assert type(put) is Error and put.code == "unauthorized", put
    mine = _block(fresh)
    assert owner.write_bytes(wl, mine) is None and not hasattr(owner.commit(wl), "reason")
    for k, expected in ((key, data), (fresh, mine)):
        again = owner.acquire(NS, k)
        assert owner.read(again) == expected
        owner.release(again)


def test_normal_operation_is_unchanged(cluster):
    _assert_chain_readable(cluster, "reader")
    _assert_chain_readable(cluster, "n2.reader")  # co-located with n2, reading from n1
    # A client evicts a block of its own through the node that holds it (the node asks the
    # directory under the client's tenant).
    c = cluster.client("n2.evicter")
    key = BlockKey(os.urandom(32))
    committed = c.put(NS, key, None, _block(key))
    assert not hasattr(committed, "reason"), committed
    lease = c.acquire(NS, key)
    location = lease.location
    assert location.startswith("n2/")
    c.release(lease)
    assert type(c.evict(key, location)).__name__ == "Evicted"
    # A node's own credential moves a block between its own tiers: the directory pushes Copy to
    # the real n1, which copies and acknowledges (Copied) under its own credential.
    key = CHAIN[1]
    # Naming a generation the key does not have, or a copy it has not, moves nothing: the node's
    # view is stale (the key rewritten, or moved, since it looked).
    for stale in (Transfer("n1", key, 1, "n1/dram", "n1/nvme"), Transfer("n1", key, 0, "n1/nvme", "n1/dram")):
        refused = _ask(cluster, "n1", stale)
        assert type(refused) is TransferRefused and refused.reason == "not_found", refused
    started = _ask(cluster, "n1", Transfer("n1", key, 0, "n1/dram", "n1/nvme"))
    assert type(started) is TransferStarted, started
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        found = _ask(cluster, ENGINE_TENANT, Lookup(NS.digest(), tuple(CHAIN)))
        if found.blocks_matched == len(CHAIN) and found.locations[1] == "n1/nvme":
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the transfer did not complete: {found!r}")
    _assert_chain_readable(cluster, "after-transfer")


def test_the_real_node_rejoins_after_impersonation_attempts(cluster):
    """Failed before: a tenant's Hello as ``n1`` under a huge incarnation was accepted, and the
    real ``n1``, restarted, was refused as ``stale_incarnation`` and could not start."""
    for who in (ENGINE_TENANT, "n2"):
        try:
            _ask(cluster, who, Hello("n1", HUGE_INCARNATION, "127.0.0.1:9", ("n1/dram", "n1/nvme"), ()))
        except ConnectionFailed:
            pass
    old = _address(cluster, "n1")
    cluster.restart("n1")  # a new incarnation; its DRAM comes back empty, reported lost
    new = _address(cluster, "n1")
    assert new != old
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        listed = _ask(cluster, ENGINE_TENANT, ListNodes(2))
        members = dict(zip(listed.nodes, listed.addresses))
        if members.get("n1") == new:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"n1 did not rejoin at {new}: {members}")
    rejoins = [e for e in _directory_events(cluster) if '"restart_node"' in e and '"n1"' in e]
    assert rejoins, "the directory logged no restart_node for n1"
    w = cluster.client("n1.after")
    key = BlockKey(os.urandom(32))
    assert not hasattr(w.put(NS, key, None, _block(key)), "reason")
    lease = w.acquire(NS, key)
    assert lease.location == "n1/dram" and w.read(lease) == _block(key)


# ---------------------------------------------------------------------------------- the file's forms


def _raw(**extra):
    return {"lease_term_ms": 2000, "skew_ms": 100, "tenants": {"engine": {"token": "ab" * 16}}} | extra


def test_a_deployment_file_gives_each_node_its_own_credential():
    cfg = ClusterConfig.from_dict(_raw(nodes={"n1": {"token": "01" * 16}, "n2": {"token": "02" * 16}}))
    assert cfg.node_credential("n1") == node_credential("n1") == "node:n1"
    assert cfg.tenants.token("node:n2") == bytes.fromhex("02" * 16)
    assert cfg.tenants.node_of("node:n1") == "n1" and cfg.tenants.node_of("engine") is None
    assert cfg.tenants.is_node_id("n2") and not cfg.tenants.is_node_id("engine")
    assert not cfg.tenants.shared_node_credential("engine")
    assert set(cfg.tenants.without_nodes().tokens) == {"engine"}
    with pytest.raises(ConfigError, match="no credential for node 'n3'"):
        cfg.node_credential("n3")
    with pytest.raises(ConfigError, match="name of node"):
        ClusterConfig.from_dict(_raw(tenants={"node:n1": {"token": "ab" * 16}}, nodes={"n1": {"token": "01" * 16}}))
    with pytest.raises(ConfigError):
        ClusterConfig.from_dict(_raw(nodes={"n1": {"token": "01"}}))  # too short
    with pytest.raises(ConfigError):
        ClusterConfig.from_dict(_raw())  # neither nodes nor a node_tenant


def test_a_deployment_file_gives_operators_credentials_of_their_own():
    cfg = ClusterConfig.from_dict(_raw(nodes={"n1": {"token": "01" * 16}}, operators={"ops": {"token": "0f" * 16}}))
    assert operator_credential("ops") == "operator:ops"
    assert cfg.tenants.operator_of("operator:ops") == "ops" and cfg.tenants.operator_of("engine") is None
    assert cfg.tenants.token("operator:ops") == bytes.fromhex("0f" * 16)
    assert cfg.tenants.node_of("operator:ops") is None and not cfg.tenants.shared_node_credential("operator:ops")
    assert set(cfg.tenants.without_nodes().tokens) == {"engine"}  # a node's data server takes no operator
    assert cfg.tenants.may_operate(Invalidate(NS.digest(), "namespace", None))
    assert not cfg.tenants.may_operate(Acquire("c", CHAIN[0], NS.digest(), 1))
    with pytest.raises(ConfigError, match="operator 'ops'"):
        ClusterConfig.from_dict(_raw(tenants={"operator:ops": {"token": "ab" * 16}}, nodes={"n1": {"token": "01" * 16}},
                                     operators={"ops": {"token": "0f" * 16}}))  # fmt: skip
    with pytest.raises(ConfigError):
        ClusterConfig.from_dict(_raw(nodes={"n1": {"token": "01" * 16}}, operators={"ops": {"token": "0f"}}))  # too short


def test_the_older_form_still_loads_with_one_shared_node_credential():
    cfg = ClusterConfig.from_dict(_raw(node_tenant="nodes", tenants={"nodes": {"token": "cd" * 16, "operator": True}}))
    assert cfg.node_credential("n1") == cfg.node_credential("n7") == "nodes"
    assert cfg.tenants.shared_node_credential("nodes")
    with pytest.raises(ValueError):
        Tenants({"a": b"a" * 16}, nodes={"node:n1": "n1"})  # a node credential without a token


async def _legacy_directory(tmp_path):
    from kvcc.reference.directory.core import DirectoryConfig
    from kvcc.reference.directory.server import DirectoryServer
    from kvcc.reference.directory.store import DirectoryStore

    tenants = Tenants({"engine": b"e" * 16, "nodes": b"n" * 16}, {"engine": [NS.digest()]}, operators={"nodes"})
    store = DirectoryStore(tmp_path / "directory.db")
    return DirectoryServer(DirectoryConfig(lease_term_ms=2000, skew_ms=100), tenants, store), store


def test_the_older_form_refuses_tenants_as_nodes(tmp_path):
    """A deployment without node credentials: its shared node credential still registers any node
    (on its own locations), and a tenant still may not."""

    async def go():
        server, store = await _legacy_directory(tmp_path)
        async with server:
            async def ask(tenant, msg):
                async with Client("127.0.0.1", server.port, tenant, tenant[0].encode() * 16) as c:
                    return await c.request(msg)

            for msg in (Hello("n1", 1, "127.0.0.1:9", ("n1/dram",), ()), Hello("n1", 1, "127.0.0.1:9", (), ()),
                        Freed("n1/dram", CHAIN[0], 1)):  # fmt: skip
                with pytest.raises(ConnectionFailed) as failed:
                    await ask("engine", msg)
                assert failed.value.code == "unauthorized"
            with pytest.raises(ConnectionFailed) as failed:
                await ask("nodes", Hello("n1", 1, "127.0.0.1:9", ("n1/dram", "n2/dram"), ("n2/dram",)))
            assert failed.value.code == "unauthorized"
            assert not server._members
            welcome = await ask("nodes", Hello("n1", 1, "127.0.0.1:9", ("n1/dram",), ()))
            assert type(welcome) is Welcome
            with pytest.raises(ConnectionFailed) as failed:
                await ask("engine", Hello("n1", 1, "", (), ()))  # now a node's id
            assert failed.value.code == "unauthorized"
        store.close()

    asyncio.run(go())
