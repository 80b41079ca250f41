"""The client library's holder against answers that race a revocation, without a server: the
directory's answers are scripted, so the interleaving that a loaded cluster hits now and then
(``KVCC-LOAD-001`` rejected a trace of it) happens every run.

The spec's ``drop_and_ack`` ends the holder's pending request on the key, acquire or renewal: an
answer that arrives after it ends nothing, so the holder logs no ``abandon`` for it (a validator
finds no pending request to abandon) and never trusts a grant it carries.
"""

from __future__ import annotations

import asyncio
import io
import json

import pytest

from kvcc.reference.client import KvccClient, ReadLease, Refused
from kvcc.reference.errors import ConnectionFailed, TimeoutError_
from kvcc.spec.vocabulary import REASON_REVOKED
from kvcc.reference.events import EventLog
from kvcc.spec.keys import BlockKey
from kvcc.reference.wire import LeaseRefused, LeaseRenewed, ReadLeaseGranted, Revoke

KEY = BlockKey(b"k" * 32)
NODE = "n1.engine"


def _holder() -> tuple[KvccClient, io.StringIO]:
    sink = io.StringIO()
    client = KvccClient(("127.0.0.1", 9), "t", b"s" * 32, client_id=NODE, skew_ms=10, events=EventLog(sink, NODE, 1))
    client._term_ms = 10**6  # as a directory's Welcome would state it (there is no directory here)
    return client, sink


def _events(sink: io.StringIO) -> list[str]:
    return [json.loads(line)["event"] for line in sink.getvalue().splitlines()]


def _answer_after_revoke(client: KvccClient, answer) -> None:
    """The directory revokes the key while the request is in flight, then answers it."""

    async def ask(msg):
        client._on_push(Revoke(NODE, KEY, 7, 1))
        await asyncio.sleep(0)
        return answer(msg)

    async def no_ack(msg):
        raise OSError("no directory in this test")

    client._ask = ask
    client._dir.request = no_ack


def test_a_refusal_after_a_revocation_is_not_an_abandonment():
    async def main():
        client, sink = _holder()
        _answer_after_revoke(client, lambda m: LeaseRefused(NODE, KEY, m.request, "invalidating"))
        out = await client.acquire(b"n" * 32, KEY)
        assert isinstance(out, Refused) and out.reason == REASON_REVOKED
        assert _events(sink) == ["acquire", "drop_and_ack"]
        assert client.holder._cancelled == set() and not client.holder.busy(KEY)

    asyncio.run(main())


def test_a_grant_after_a_revocation_is_never_trusted():
    async def main():
        client, sink = _holder()
        _answer_after_revoke(client, lambda m: ReadLeaseGranted(NODE, KEY, 7, "n1/dram", 1, 1, 1000, m.request))
        out = await client.acquire(b"n" * 32, KEY)
        assert isinstance(out, Refused) and client.lease_of(KEY) is None
        assert _events(sink) == ["acquire", "drop_and_ack"]

    asyncio.run(main())


def test_a_renewal_answered_after_a_revocation_logs_no_abandon():
    async def main():
        for answer in (lambda m: LeaseRefused(NODE, KEY, m.request, "invalidating"),
                       lambda m: LeaseRenewed(NODE, KEY, m.lease, 1000, m.request)):  # fmt: skip
            client, sink = _holder()
            client.holder.acquiring(KEY, 99)
            client.holder.granted(KEY, 99, lease=7, gen=1, epoch=1, location="n1/dram", term_ms=10**6,
                                  sent_ns=client._now_ns())  # fmt: skip
            lease = client.lease_of(KEY)
            assert isinstance(lease, ReadLease)
            _answer_after_revoke(client, answer)
            out = await client.renew(lease)
            assert isinstance(out, Refused) and out.reason == REASON_REVOKED
            assert _events(sink) == ["renew", "drop_and_ack"]
            assert client.holder._cancelled == set() and not client.holder.busy(KEY) and client.lease_of(KEY) is None

    asyncio.run(main())


def test_an_unanswered_request_is_given_up_and_logged():
    # The directory crashed before answering: the spec's holder abandons the acquire, and its
    # writer aborts the write it asked for; unlogged, the next request of the key was unexplained
    # (found by kvcc bench soak: a trace REJECTED at "no request pending on the key").
    async def main():
        client, sink = _holder()

        async def unreachable(msg):
            raise ConnectionFailed("the directory is gone", code="reset")

        client._ask = unreachable
        for call in (lambda: client.acquire(b"n" * 32, KEY), lambda: client.begin_write(b"n" * 32, KEY, None)):
            with pytest.raises(ConnectionFailed):
                await call()
        assert _events(sink) == ["acquire", "abandon", "begin_write", "abort"]
        assert not client.holder.busy(KEY) and client.lease_of(KEY) is None
        # A revocation that already ended the request: nothing left to abandon.
        client2, sink2 = _holder()
        client2._dir.request = unreachable

        async def revoked_then_gone(msg):
            client2._on_push(Revoke(NODE, KEY, 7, 1))
            raise ConnectionFailed("the directory is gone", code="reset")

        client2._ask = revoked_then_gone
        with pytest.raises(ConnectionFailed):
            await client2.acquire(b"n" * 32, KEY)
        assert _events(sink2) == ["acquire", "drop_and_ack"]

    asyncio.run(main())


def test_a_lease_request_is_given_up_within_the_holder_budget():
    # A reply held behind a stalled store (an etcd restart) came 1,506 ms after the acquire, and
    # the client, on its 1,500 ms request timeout, abandoned past its budget of term - epsilon =
    # 1,400 ms plus epsilon: the soak's etcd trace was REJECTED. The spec's pending timer ends at
    # the budget; the client now gives up there, whatever its transport's timeout.
    async def main():
        client, sink = _holder()
        client._term_ms = 200  # the directory's term: a budget of 190 ms
        asked = []

        async def stalled(msg):
            asked.append(msg)
            await asyncio.sleep(60)  # the answer would come long after the budget
            raise AssertionError("not given up")

        client._ask = stalled
        for call in (lambda: client.acquire(b"n" * 32, KEY), lambda: client.acquire_many(b"n" * 32, [KEY])):
            with pytest.raises(TimeoutError_) as e:
                await call()
            assert e.value.timeout_ms <= 190 and not client.holder.busy(KEY)
        client.holder.acquiring(KEY, 99)
        client.holder.granted(KEY, 99, lease=7, gen=1, epoch=1, location="n1/dram", term_ms=100,
                              sent_ns=client._now_ns())  # fmt: skip
        lease = client.lease_of(KEY)
        with pytest.raises(TimeoutError_) as e:
            await client.renew(lease)  # the renewed lease's own term: a budget of 90 ms
        assert e.value.timeout_ms <= 90 and len(asked) == 3
        assert _events(sink) == ["acquire", "abandon", "acquire", "abandon", "renew", "abandon"]

    asyncio.run(main())


def test_a_stored_write_whose_commit_went_unanswered_is_forgotten_without_an_abort():
    """The bytes landed (the spec's writer then hands the write to its commit) and the commit went
    unanswered (the directory was killed): the next write of the key gives the old one up without
    logging ``abort`` -- the spec's writer has no write in progress left to abort (the soak's
    trace was REJECTED there). A write given up before its bytes were stored is an ``abort``."""
    from kvcc.reference.client import WriteLease
    from kvcc.reference.wire import BytesStored, WriteLeaseGranted

    async def main():
        for stored, expected in ((True, ["begin_write", "start_writing", "begin_write"]),
                                 (False, ["begin_write", "start_writing", "abort", "begin_write"])):  # fmt: skip
            client, sink = _holder()
            answers = [lambda m: WriteLeaseGranted(NODE, KEY, 3, "n1/dram", 1, 1, 1000, m.request)]

            async def ask(msg):
                if answers:
                    return answers.pop(0)(msg)
                raise ConnectionFailed("the directory is gone", code="reset")

            client._ask = ask
            wl = await client.begin_write(b"n" * 32, KEY, None)
            assert isinstance(wl, WriteLease)
            if stored:
                assert client._write_answered(wl, BytesStored(wl.location, KEY, wl.gen, wl.epoch)) is None
                with pytest.raises(ConnectionFailed):
                    await client.commit(wl)  # the commit went unanswered
            client._now_ns = lambda: wl.trusted_until_ns + 1  # its lease is over by this writer's clock
            with pytest.raises(ConnectionFailed):
                await client.begin_write(b"n" * 32, KEY, None)
            assert _events(sink)[: len(expected)] == expected, _events(sink)

    asyncio.run(main())


def test_a_client_down_with_its_node_takes_no_revocation():
    """A co-located client crashed with its node (``crash``): the validator takes ``"<node>.<name>"``
    for that node, so a Revoke it handled while the node was down was a dead node's step (the soak's
    trace was REJECTED at the directory's ``revoke_acked`` of it). Down, a push is lost: no event,
    no ack, and nothing trusted; after ``rejoin`` a push is handled again."""

    async def main():
        client, sink = _holder()
        acks: list = []

        async def ack(msg):
            acks.append(msg)

        client._dir.request = ack
        client.holder.acquiring(KEY, 99)
        client.holder.granted(KEY, 99, lease=7, gen=1, epoch=1, location="n1/dram", term_ms=10**6,
                              sent_ns=client._now_ns())  # fmt: skip
        await client.crash()
        assert client.lease_of(KEY) is None, "a crash forgets every lease"
        client._on_push(Revoke(NODE, KEY, 7, 1))
        await asyncio.sleep(0)
        assert _events(sink) == [] and acks == []
        await client.rejoin()
        client._on_push(Revoke(NODE, KEY, 7, 1))
        await asyncio.sleep(0.01)
        assert _events(sink) == ["drop_and_ack"] and len(acks) == 1

    asyncio.run(main())
