"""What unauthenticated and slow peers may hold on a real deployment (``ServerLimits``): a directory
and two cache-node processes on loopback, their limits set small through the deployment file, each
attack made with raw sockets as an outsider would. Each test failed before the limit it shows:

- a block-sized frame before any frame authenticated is refused on its length header (the node
  used to buffer up to 64 MiB per connection before checking the MAC);
- idle unauthenticated sockets are closed by the handshake deadline and cannot fill the
  connection limit: a killed node restarts and rejoins while they keep coming;
- a sender that trickles a frame is closed at the frame deadline (every byte used to reset the
  idle timer);
- one tenant cannot hold more than its quota of connections, and the others still connect;
- a peer that pipelines reads and never collects the replies is closed once it has not read them
  in time, and the node serves others meanwhile;
- a recorded connection replayed whole on a new one, after its lease ended, gets its opening Pong
  and nothing else: the read is refused as ``unauthorized`` (every frame after a connection's
  opening Ping is keyed by both sides' fresh nonces). Before session keys it returned the block.
"""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest

from kvcc.reference.cluster import ENGINE_TENANT, NODE_TENANT, LocalCluster
from kvcc.reference.wire import BytesRead, Error, Ping, Pong, ReadBytes, Session
from kvcc.spec.keys import Namespace, chain_keys

for _name, _value in {"DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false",
                      "HF_HUB_OFFLINE": "1"}.items():  # fmt: skip
    os.environ.setdefault(_name, _value)

LIMITS = {
    "max_connections": 24,
    "handshake_timeout_ms": 1_000,
    "max_unauthenticated": 4,
    "max_connections_per_tenant": 12,
    "frame_grace_ms": 1_000,
    "min_transfer_bytes_per_s": 1 << 20,
}
NS = Namespace("transport-limits", "r1", "bfloat16", 4)
BLOCK_BYTES = 1 << 20
WAIT_S = 15.0  # far above every deadline above: how long a test waits for a close


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("limits"), nodes=2, tiers=["dram=64MiB"], block_bytes=BLOCK_BYTES,
                      namespaces=[NS], transport=LIMITS) as c:  # fmt: skip
        yield c


def _port(cluster: LocalCluster, name: str) -> int:
    return int(cluster.procs[name].info["port"])


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    s.settimeout(WAIT_S)
    return s


def _opened(s: socket.socket, credential: tuple[str, bytes]) -> Session:
    """A session on ``s`` past the opening exchange, as ``Client`` opens one: our Ping, the
    server's Pong (its first frame, whose nonce keys the session for every later frame)."""
    session = Session.client(*credential)
    s.sendall(session.send(Ping(0)))
    while not session.keyed:
        data = s.recv(1 << 16)
        assert data, "the server closed before its opening Pong"
        session.receive_data(data)
    return session


def _until_closed(s: socket.socket, credential: tuple[str, bytes] | Session) -> list:
    """Read until the server closes; the messages it sent (its final Error among them), read by
    the session that sent ours (or a new one of ``credential``: nothing of ours was answered)."""
    decoder = credential if isinstance(credential, Session) else Session.client(*credential)
    got: list = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            data = s.recv(1 << 16)
        except (ConnectionResetError, BrokenPipeError):
            break
        except socket.timeout:
            raise AssertionError(f"the server kept the connection open for {WAIT_S} s") from None
        if not data:
            break
        got += [r.msg for r in decoder.receive_data(data)]
    else:
        raise AssertionError(f"the server kept the connection open for {WAIT_S} s")
    return got


def _final_code(msgs: list) -> str | None:
    errors = [m for m in msgs if type(m) is Error]
    return errors[-1].code if errors else None


def _engine(cluster: LocalCluster) -> tuple[str, bytes]:
    return (ENGINE_TENANT, cluster.engine_token)


def test_a_block_before_any_frame_authenticated_is_refused_on_its_header(cluster):
    s = _connect(_port(cluster, "n1"))
    with s:
        s.sendall(struct.pack(">I", 8 << 20) + os.urandom(1024))  # an 8 MiB frame announced, unsigned
        assert _final_code(_until_closed(s, _engine(cluster))) == "frame_too_large"


def test_idle_unauthenticated_sockets_are_closed_and_cannot_lock_a_node_out(cluster):
    port = _port(cluster, "directory")
    # More idle sockets than the whole connection limit: before, they held every slot (the idle
    # timeout is minutes) and a restarting node's Hello was answered "busy".
    flood = [_connect(port) for _ in range(LIMITS["max_connections"] + 6)]
    try:
        cluster.kill("n2")
        cluster.restart("n2")  # ready only once its Hello was answered
        c = cluster.client("limits.rejoin")
        assert c.lookup(NS, list(chain_keys(NS, [1, 2, 3, 4]))).blocks == 0
        for s in flood:  # each closed: evicted by a newer one, or at the handshake deadline
            assert _final_code(_until_closed(s, _engine(cluster))) in ("idle", "busy")
    finally:
        for s in flood:
            s.close()


def test_a_sender_that_trickles_a_frame_is_closed(cluster):
    s = _connect(_port(cluster, "n1"))
    with s:
        session = _opened(s, _engine(cluster))  # authenticated: only the frame deadline applies now
        frame = session.send(Ping(2))
        closed_at = None
        started = time.monotonic()
        for byte in frame:
            try:
                s.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.monotonic()
                break
            time.sleep(0.2)  # 5 bytes a second; every one of them used to reset the idle timer
        if closed_at is None:
            msgs = _until_closed(s, session)
            assert _final_code(msgs) == "idle", msgs
        assert (closed_at or time.monotonic()) - started < WAIT_S


def test_one_tenant_cannot_hold_every_connection(cluster):
    port = _port(cluster, "n1")
    quota = LIMITS["max_connections_per_tenant"]
    held = []
    try:
        refused_at = None
        for i in range(quota + 1):
            s = _connect(port)
            held.append(s)
            s.sendall(Session.client(*_engine(cluster)).send(Ping(i)))
            s.settimeout(0.5)
            try:
                data = s.recv(1 << 16)  # a Pong, or a final Error "busy" once over the quota
            except socket.timeout:
                continue
            finally:
                s.settimeout(WAIT_S)
            if b"busy" in data:
                refused_at = i
                break
        # Refused at the quota at the latest (the engine's own clients may hold some already).
        assert refused_at is not None and refused_at <= quota
        # Another tenant still gets in.
        node_token = bytes.fromhex(cluster.config["tenants"][NODE_TENANT]["token"])
        other = _connect(port)
        held.append(other)
        session = Session.client(NODE_TENANT, node_token)
        other.sendall(session.send(Ping(7)))
        reply: list = []
        while not reply:
            reply = session.receive_data(other.recv(1 << 16))
        assert type(reply[0].msg) is Pong and reply[0].msg.nonce == 7
    finally:
        for s in held:
            s.close()


def test_a_peer_that_never_reads_its_replies_is_closed_and_others_are_served(cluster):
    c = cluster.client("n1.writer")  # co-located with n1: it writes n1's DRAM
    keys = list(chain_keys(NS, [5, 6, 7, 8]))
    assert not hasattr(c.put(NS, keys[0], None, os.urandom(BLOCK_BYTES)), "reason")
    lease = c.acquire(NS, keys[0])
    s = _connect(_port(cluster, lease.location.split("/")[0]))
    with s:
        session = _opened(s, _engine(cluster))
        read = ReadBytes("n1.writer", keys[0], lease.lease, lease.location, lease.gen, lease.grant)
        for _ in range(64):  # 64 MiB of replies asked for, none read
            try:
                s.sendall(session.send(read))
            except (BrokenPipeError, ConnectionResetError):
                break
        # The node is not stuck on us: another client reads the block meanwhile.
        data = c.read(lease)
        assert isinstance(data, bytes) and len(data) == BLOCK_BYTES
        # Not reading for longer than the reply deadline (grace + the buffered reply at the
        time.sleep(LIMITS["frame_grace_ms"] / 1000 + 2 * BLOCK_BYTES / LIMITS["min_transfer_bytes_per_s"] + 3)
        # minimum rate), then reading: the stream ends -- reset, since the final Error sits behind
        # replies we did not take -- before the 64 replies asked for.
        msgs = _until_closed(s, session)
        assert sum(type(m) is BytesRead for m in msgs) < 64, "every reply was kept for a peer that never read"


def test_a_recorded_connection_replayed_on_a_new_one_gets_nothing_past_its_ping(cluster):
    c = cluster.client("n1.replayed")  # co-located with n1: it writes n1's DRAM
    key = chain_keys(NS, [9, 10, 11, 12])[0]
    data = os.urandom(BLOCK_BYTES)
    assert not hasattr(c.put(NS, key, None, data), "reason")
    lease = c.acquire(NS, key)
    port = _port(cluster, lease.location.split("/")[0])
    session = Session.client(*_engine(cluster))
    opening = session.send(Ping(0))
    with _connect(port) as s:  # recorded: the opening Ping, then a read under the live lease
        s.sendall(opening)
        while not session.keyed:
            session.receive_data(s.recv(1 << 16))
        read = session.send(ReadBytes("n1.replayed", key, lease.lease, lease.location, lease.gen, lease.grant))
        s.sendall(read)
        got: list = []
        while not got:
            got = [r.msg for r in session.receive_data(s.recv(1 << 20))]
        assert type(got[0]) is BytesRead and got[0].data == data, "the recorded read itself is served"
    c.release(lease)
    with _connect(port) as s:  # the recording, replayed on a new connection after the lease ended
        replies = Session.client(*_engine(cluster))
        replies.nonce = session.nonce  # the recorded Ping's: the server keys its later frames with it
        replies.last_sent_seq = 2  # the recorded frames were sealed by the recording session
        s.sendall(opening)
        pong: list = []
        while not pong:
            pong = [r.msg for r in replies.receive_data(s.recv(1 << 16))]
        assert pong == [Pong(0)]  # the opening is answered: it gives nothing away
        s.sendall(read)
        msgs = _until_closed(s, replies)
    assert not any(type(m) is BytesRead for m in msgs), msgs
    assert _final_code(msgs) == "unauthorized", msgs
