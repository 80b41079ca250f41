"""TCP transport on 127.0.0.1 (kvcc.reference.transport) and the protocol event log
(kvcc.reference.events)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from kvcc.reference import wire
from kvcc.reference.errors import ConnectionFailed, Malformed, ProtocolViolation, TimeoutError_, Unauthorized
from kvcc.reference.events import EventLog, events_from_text, read_events
from kvcc.reference.transport import Client, Server
from kvcc.reference.wire import (
    Acquire,
    Error,
    Evict,
    InvalidationCompleted,
    InvalidationPending,
    LeaseRefused,
    Ping,
    Pong,
    ReadLeaseGranted,
    Tenants,
    WaitTicket,
)
from kvcc.spec.keys import BlockKey
from kvcc.spec import vocabulary

TOKEN = b"t" * 32
OTHER_TOKEN = b"o" * 32
NS = hashlib.sha256(b"ns").digest()
KEY = BlockKey(hashlib.sha256(b"key").digest())
TENANTS = Tenants({"alpha": TOKEN, "beta": OTHER_TOKEN}, namespaces={"alpha": [NS]})


async def directory_like(tenant: str, msg):
    """A toy handler: grants Acquire where the tenant may use the namespace, long-polls tickets."""
    match msg:
        case Acquire(node=node, key=key, namespace=ns, request=request):
            if not TENANTS.allows(tenant, ns):
                return LeaseRefused(node=node, key=key, request=request, reason=vocabulary.REASON_UNAUTHORIZED)
            return ReadLeaseGranted(node=node, key=key, lease=request, location="n1/gpu", gen=1, epoch=1,
                                    term_ms=1000, request=request)  # fmt: skip
        case WaitTicket(ticket=ticket, timeout_ms=timeout_ms):
            if ticket % 2:
                await asyncio.sleep(timeout_ms / 1000)
                return InvalidationPending(ticket)
            return InvalidationCompleted(ticket)
        case Pong(nonce=nonce):  # the test's "slow request": sleeps nonce ms
            await asyncio.sleep(nonce / 1000)
            return Pong(nonce)
        case Evict(node="raise"):
            raise Unauthorized("the handler found a violation")
        case Evict(node="crash"):
            raise RuntimeError("a bug in the handler")
        case Evict(node="bad_reply"):
            return "not a message"
    return Error("unexpected", type(msg).__name__)


def run(coro, timeout_s: float = 20):
    async def bounded():
        async with asyncio.timeout(timeout_s):
            return await coro

    return asyncio.run(bounded())


def _evict(node: str) -> Evict:
    return Evict(node=node, key=KEY, location="n1/dram")


async def _eventually(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def _acquire(request: int = 1, ns: bytes = NS) -> Acquire:
    return Acquire(node="n7", key=KEY, namespace=ns, request=request)


async def _raw_exchange(port: int, data: bytes) -> tuple[bytes, bool]:
    """Send raw bytes, read until the server closes; return what came back."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    got = await asyncio.wait_for(reader.read(), 5)  # until EOF
    writer.close()
    return got, reader.at_eof()


def _only_error(data: bytes) -> Error:
    """The single frame in ``data``, opened as a client would, must be a final Error."""
    client = wire.Session.client("alpha", TOKEN)
    (r,) = client.receive_data(data)
    assert r.final
    return r.msg


# -- request / response -----------------------------------------------------------------------------


def test_request_response_and_authorization_refusal():
    async def main():
        async with Server(directory_like, TENANTS) as server, Client("127.0.0.1", server.port, "alpha", TOKEN) as client:
            assert server.port > 0
            reply = await client.request(_acquire(5))
            assert reply == ReadLeaseGranted(
                node="n7", key=KEY, lease=5, location="n1/gpu", gen=1, epoch=1, term_ms=1000, request=5
            )
            other = hashlib.sha256(b"other").digest()
            refused = await client.request(_acquire(6, ns=other))
            assert refused == LeaseRefused(node="n7", key=KEY, request=6, reason="unauthorized")
            assert await client.request(WaitTicket(2, 1000)) == InvalidationCompleted(2)
            assert client.stats["connects"] == 1

    run(main())


def test_pipelined_requests_are_answered_out_of_order():
    async def main():
        async with Server(directory_like, TENANTS) as server, Client("127.0.0.1", server.port, "alpha", TOKEN) as client:
            done = []

            async def one(ms):
                reply = await client.request(Pong(ms))
                done.append(ms)
                assert reply == Pong(ms)

            await asyncio.gather(one(300), one(10), one(150), *(one(0) for _ in range(20)))
            assert done[-1] == 300, "a slow request does not hold up faster ones"
            assert done.index(10) < done.index(150)
            assert client.stats["connects"] == 1

    run(main())


def test_garbage_gets_an_error_and_a_disconnect_while_another_client_keeps_working():
    async def main():
        async with Server(directory_like, TENANTS) as server, Client("127.0.0.1", server.port, "alpha", TOKEN) as client:
            assert await client.request(Ping(1)) == Pong(1)
            got, eof = await _raw_exchange(server.port, b"\x00\x00\x00\x05hello, this is not kvcc")
            assert eof
            assert _only_error(got).code == "malformed"
            # Oversized length header: refused on the header alone.
            got, eof = await _raw_exchange(server.port, struct.pack(">I", 2**32 - 1) + b"xyz")
            assert eof and _only_error(got).code == "frame_too_large"
            assert await client.request(Ping(2)) == Pong(2)
            assert server.stats["peer_violations"] == 2
            # Two Pings and the client's opening Ping (every connection opens with one).
            assert server.stats["requests"] == 3, "garbage never became a request"
            assert client.stats["connects"] == 1

    run(main())


def test_unauthorised_tenants_are_rejected():
    async def main():
        async with Server(directory_like, TENANTS) as server:
            for tenant, token in (("alpha", OTHER_TOKEN), ("mallory", TOKEN)):
                async with Client("127.0.0.1", server.port, tenant, token) as bad:
                    with pytest.raises(ConnectionFailed) as info:
                        await bad.request(Ping(1))
                    assert info.value.code == "unauthorized"
            assert server.stats["peer_violations"] == 2
            assert server.stats["requests"] == 0, "the handler never ran"

    run(main())


def test_control_only_server_limits_frames():
    async def main():
        async with Server(directory_like, TENANTS, max_frame_bytes=wire.MAX_CONTROL_FRAME_BYTES) as server:
            async with Client("127.0.0.1", server.port, "alpha", TOKEN) as client:
                big = wire.WriteBytes(node="n", key=KEY, lease=1, location="l", gen=0, epoch=1, data=b"x" * (5 << 20))
                with pytest.raises(ConnectionFailed) as info:
                    await client.request(big)
                assert info.value.code == "frame_too_large"
                assert await client.request(Ping(3)) == Pong(3), "the next request reconnects"
                assert client.stats["connects"] == 2

    run(main())


# -- timeouts and failures ------------------------------------------------------------------------


def test_client_timeout_raises_the_typed_error_and_the_connection_survives():
    async def main():
        async with Server(directory_like, TENANTS) as server, Client("127.0.0.1", server.port, "alpha", TOKEN) as client:
            with pytest.raises(TimeoutError_) as info:
                await client.request(Pong(500), timeout_ms=50)
            assert info.value.timeout_ms == 50 and "Pong request" in info.value.what
            assert isinstance(info.value, TimeoutError)
            assert await client.request(Ping(4)) == Pong(4)
            await _eventually(lambda: client.stats["stale_replies"] == 1)  # the late reply, dropped
            assert client.stats["connects"] == 1

    run(main())


def test_server_request_timeout_answers_timeout():
    async def main():
        async with Server(directory_like, TENANTS, request_timeout_ms=100) as server:
            async with Client("127.0.0.1", server.port, "alpha", TOKEN) as client:
                reply = await client.request(WaitTicket(1, 5000))
                assert type(reply) is Error and reply.code == "timeout"
                assert server.stats["timeouts"] == 1

    run(main())


def test_handler_errors():
    async def main():
        async with Server(directory_like, TENANTS) as server, Client("127.0.0.1", server.port, "alpha", TOKEN) as client:
            # A bug in the handler: answered "internal", the connection stays.
            reply = await client.request(_evict("crash"))
            assert reply.code == "internal"
            reply = await client.request(_evict("bad_reply"))
            assert reply.code == "internal"
            assert client.stats["connects"] == 1
            # A violation found by the handler: final Error, connection closed.
            with pytest.raises(ConnectionFailed) as info:
                await client.request(_evict("raise"))
            assert info.value.code == "unauthorized"
            assert await client.request(Ping(5)) == Pong(5)
            assert client.stats["connects"] == 2

    run(main())


def test_handler_now_answers_from_the_read_loop_and_defers_the_rest():
    """``handler_now``: its replies go out with no task (the async handler never runs for them),
    ``DEFER`` hands the request to the async handler, and errors end as the async handler's do."""
    from kvcc.reference.transport import DEFER, current_connection

    seen: list[str] = []

    def now(tenant: str, msg):
        seen.append(type(msg).__name__)
        assert current_connection.get() is not None, "the connection is known, as in a handler"
        if type(msg) is WaitTicket:
            return DEFER
        if type(msg) is Acquire:
            return ReadLeaseGranted(node=msg.node, key=msg.key, lease=99, location="n1/gpu", gen=1, epoch=1,
                                    term_ms=1000, request=msg.request)  # fmt: skip
        return run_sync(directory_like(tenant, msg))

    def run_sync(coro):
        try:
            coro.send(None)
        except StopIteration as stop:
            return stop.value
        raise AssertionError("directory_like waited")

    async def main():
        async with Server(directory_like, TENANTS, handler_now=now) as server, \
                Client("127.0.0.1", server.port, "alpha", TOKEN) as client:  # fmt: skip
            reply = await client.request(_acquire(7))
            assert type(reply) is ReadLeaseGranted and reply.lease == 99 and reply.request == 7
            assert await client.request(WaitTicket(2, 100)) == InvalidationCompleted(2)  # deferred
            assert (await client.request(_evict("crash"))).code == "internal"
            assert (await client.request(_evict("bad_reply"))).code == "internal"
            assert server.stats["handler_errors"] == 2 and client.stats["connects"] == 1
            with pytest.raises(ConnectionFailed) as info:
                await client.request(_evict("raise"))
            assert info.value.code == "unauthorized"
            assert server.stats["peer_violations"] == 1
            assert await client.request(Ping(3)) == Pong(3)  # the transport's own, never handler_now
            assert client.stats["connects"] == 2
        assert seen == ["Acquire", "WaitTicket", "Evict", "Evict", "Evict"]

    run(main())


def test_connect_failures_are_typed():
    async def main():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # bound, not listening: connections are refused
            async with Client("127.0.0.1", port, "alpha", TOKEN) as client:
                with pytest.raises(ConnectionFailed) as info:
                    await client.request(Ping(1))
                assert info.value.code == "refused"
        with pytest.raises(ProtocolViolation):
            await Client("127.0.0.1", 1, "alpha", TOKEN).request(Ping(-1))

    run(main())


def test_idle_timeout_and_reconnect():
    async def main():
        async with Server(directory_like, TENANTS, idle_timeout_ms=100) as server:
            async with Client("127.0.0.1", server.port, "alpha", TOKEN) as client:
                assert await client.request(Ping(1)) == Pong(1)
                await _eventually(lambda: not client.connected)
                assert client._conn.failure.code == "idle"
                assert await client.request(Ping(2)) == Pong(2)
                assert client.stats["connects"] == 2
                # Busy is not idle: a request running three idle periods keeps its connection.
                assert await client.request(Pong(300)) == Pong(300)
                assert client.stats["connects"] == 2 and client.connected

    run(main())


def test_input_moves_the_idle_deadline_on():
    # Requests 0.3 s apart for 2.4 s keep a connection whose idle timeout is 1.5 s: were the
    # deadline not moved by input, it would end at 1.5 s. (The margins are wide so that a loaded
    # machine's scheduling delays cannot fail it: a request would have to be held up 1.2 s.)
    async def main():
        async with Server(directory_like, TENANTS, idle_timeout_ms=1500) as server:
            async with Client("127.0.0.1", server.port, "alpha", TOKEN) as client:
                for n in range(8):
                    assert await client.request(Ping(n)) == Pong(n)
                    await asyncio.sleep(0.3)
                assert client.stats["connects"] == 1 and client.connected

    run(main())


def test_max_connections():
    async def main():
        async with Server(directory_like, TENANTS, max_connections=1) as server:
            async with Client("127.0.0.1", server.port, "alpha", TOKEN) as first, \
                       Client("127.0.0.1", server.port, "alpha", TOKEN) as second:  # fmt: skip
                assert await first.request(Ping(1)) == Pong(1)
                with pytest.raises(ConnectionFailed) as info:
                    await second.request(Ping(1))
                assert info.value.code == "busy"
                assert server.stats["refused_busy"] == 1
                assert await first.request(Ping(2)) == Pong(2)

    run(main())


def test_clean_close_with_requests_in_flight():
    async def main():
        server = await Server(directory_like, TENANTS).start()
        client = Client("127.0.0.1", server.port, "alpha", TOKEN)
        assert await client.request(Ping(1)) == Pong(1)
        slow = asyncio.create_task(client.request(WaitTicket(1, 10_000)))
        await asyncio.sleep(0.1)
        # close does not wait for the request in flight (it would hold the server 10 s): a
        # deadline below that fails the test where a close that waits would.
        await asyncio.wait_for(server.close(), timeout=8)
        with pytest.raises(ConnectionFailed) as info:
            await slow
        assert info.value.code == "shutdown"
        assert server.connection_count == 0
        with pytest.raises(ConnectionFailed):
            await client.request(Ping(2))  # nobody listens any more
        await client.close()
        with pytest.raises(ConnectionFailed) as info:
            await client.request(Ping(3))
        assert info.value.code == "closed"

    run(main())


_PING_SERVER = """
import asyncio, sys
from kvcc.reference.transport import Server

async def handler(tenant, msg):
    return msg

async def main():
    async with Server(handler, {"alpha": b"t" * 32}) as server:
        print(server.port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until stdin closes

asyncio.run(main())
"""


def test_ping_round_trips_per_second():
    """The rate is measured, not asserted (the raw transport baseline; the server answers Ping
    itself, the handler is never called; it runs in its own process, so each side has a core).
    Asserted: every client completed round trips, each answered with its own nonce (``ping``
    raises otherwise) in a positive time, and the connections stay usable after the load."""
    proc = subprocess.Popen([sys.executable, "-c", _PING_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())

        async def main():
            for clients_n in (1, 4, 16):
                clients = [Client("127.0.0.1", port, "alpha", TOKEN) for _ in range(clients_n)]
                for c in clients:
                    await c.ping()
                count = 0
                per_client = [0] * clients_n
                started = time.perf_counter()

                async def loop(i, c, deadline=started + 0.7):
                    nonlocal count
                    while time.perf_counter() < deadline:
                        took_s = await c.ping(count)  # raises unless the Pong echoes this nonce
                        assert took_s > 0
                        count += 1
                        per_client[i] += 1

                await asyncio.gather(*(loop(i, c) for i, c in enumerate(clients)))
                rate = count / (time.perf_counter() - started)
                print(f"\nPing round trips: {rate:,.0f}/s with {clients_n} concurrent client(s), server in another process")
                assert all(n > 0 for n in per_client), per_client
                assert sum(per_client) == count
                for c in clients:
                    assert await c.ping(-1 & 0xFFFF) > 0  # still usable after the load
                    await c.close()

        run(main())
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)


def test_reference_runtime_does_not_import_checker_z3_or_hypothesis():
    code = (
        "import sys; import kvcc.reference.transport, kvcc.reference.events, kvcc.reference.wire; "
        "bad = [m for m in ('kvcc.spec.checker', 'z3', 'hypothesis') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- event log --------------------------------------------------------------------------------------


def test_event_log_lines():
    clock = iter(range(100, 10_000, 10))
    stream = io.StringIO()
    with EventLog(stream, "n1", 3, monotonic_ns=lambda: next(clock), wall_ns=lambda: 1_700_000_000_000_000_000) as log:
        first = log.emit("grant_read_lease", key=KEY, gen=2, epoch=5, lease=41, result="ok", holder="n2")
        log.emit("evict_refused", key=KEY.hex, result="leased", location="n1/dram")
        log.emit("restart_directory")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    assert json.loads(lines[0]) == first == {
        "node": "n1", "incarnation": 3, "seq": 1, "t_local_ns": 100, "t_wall_ns": 1_700_000_000_000_000_000,
        "event": "grant_read_lease", "key": KEY.hex, "gen": 2, "epoch": 5, "lease": 41, "result": "ok",
        "holder": "n2",
    }  # fmt: skip
    events = events_from_text(stream.getvalue())
    assert [e["seq"] for e in events] == [1, 2, 3]
    assert events[1]["key"] == KEY.hex and events[2]["key"] is None


def test_event_log_refuses_our_mistakes():
    log = EventLog(io.StringIO(), "n1", 0)
    for bad in (
        lambda: log.emit("tick"),  # the environment's, not a process's
        lambda: log.emit("grant_lease"),  # not a spec action
        lambda: log.emit("evict", seq=4),  # shadows a standard field
        lambda: log.emit("evict", blob=object()),  # no JSON form
        lambda: log.emit("evict", key="ABC"),  # not a key
    ):
        with pytest.raises(ProtocolViolation):
            bad()
    assert log.last_seq == 0


def test_event_log_file_is_flushed_per_line_and_thread_safe(tmp_path):
    path = tmp_path / "events.ndjson"
    log = EventLog(path, "n1", 1)
    log.emit("acquire", key=KEY)
    assert len(path.read_text().splitlines()) == 1, "visible before close"

    def worker(i):
        for j in range(200):
            log.emit("read", key=KEY, lease=i * 1000 + j)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    EventLog(path, "n1", 2).close()  # a restart appends under a new incarnation
    with EventLog(path, "n1", 2) as again:
        pass
    with EventLog(path, "n2", 1) as other:
        other.emit("store_bytes", key=KEY, epoch=1)
    events = read_events(path)
    assert len(events) == 802
    assert [e["seq"] for e in events if e["node"] == "n1"] == list(range(1, 802))
    del again


def test_read_events_catches_broken_sequences():
    def line(seq, node="n1", inc=0, event="evict"):
        return json.dumps({"node": node, "incarnation": inc, "seq": seq, "t_local_ns": 1, "t_wall_ns": 2,
                           "event": event, "key": None, "gen": None, "epoch": None, "lease": None, "result": None},
                          separators=(",", ":"))  # fmt: skip

    assert len(events_from_text("\n".join([line(1), line(1, node="n2"), line(2), line(1, inc=1)]))) == 4
    for text in (
        "\n".join([line(1), line(2), line(1)]),  # an engine restart that reset its sequence
        "\n".join([line(1), line(3)]),  # a lost line
        "\n".join([line(2), line(1)]),  # reordered
        line(1, event="tick"),
        line(1).replace('"key":null', '"key":"zz"'),
        line(1).replace('"seq":1', '"seq":"1"'),
        '{"node": "n1"}',
        "not json",
    ):
        with pytest.raises(Malformed):
            events_from_text(text)
    assert len(events_from_text("\n".join([line(5), line(9)]), contiguous=False)) == 2
    with pytest.raises(Malformed):
        events_from_text("\n".join([line(5), line(5)]), contiguous=False)
