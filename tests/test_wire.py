"""The wire (kvcc.reference.wire): message codec, frames, authenticated sessions, and the h11
fuzz invariant -- garbage only ever raises a PeerViolation, and nothing is yielded after one."""

from __future__ import annotations

import gc
import hashlib
import hmac
import random
import struct
import weakref

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcc.reference import wire
from kvcc.reference.errors import (
    FrameTooLarge,
    KvccError,
    Malformed,
    PeerViolation,
    ProtocolViolation,
    Replayed,
    Unauthorized,
)
from kvcc.reference.wire import (
    MAX_UNAUTHENTICATED_FRAME_BYTES,
    MESSAGE_TYPES,
    Acquire,
    Batch,
    Batched,
    Error,
    FrameDecoder,
    Invalidate,
    Ping,
    Pong,
    PrefixFound,
    Release,
    Session,
    Tenants,
    NodeList,
    WaitTicket,
    Welcome,
    WriteBytes,
    decode,
    encode,
)
from kvcc.spec.keys import BlockKey, CborError, cbor_decode, cbor_encode
from kvcc.spec.layout import MESSAGE_NAMES

TOKEN_A = b"a" * 32
TOKEN_B = b"b" * 32
TENANTS = {"alpha": TOKEN_A, "beta": TOKEN_B}
KEY = BlockKey(hashlib.sha256(b"k").digest())
NS = hashlib.sha256(b"ns").digest()

# -- strategies built from the schema ----------------------------------------------------------------

_ids = st.text(min_size=1, max_size=12).filter(lambda s: len(s.encode()) <= wire.MAX_ID_BYTES)
_codes = st.from_regex(r"[a-z][a-z0-9_]{0,20}", fullmatch=True)
_keys = st.binary(min_size=32, max_size=32).map(BlockKey)
_uint = st.integers(0, wire.MAX_WIRE_INT)
FIELD_STRATEGIES = {
    "int": _uint,
    "Generation": _uint,
    "Epoch": _uint,
    "LeaseId": _uint,
    "NodeId": _ids,
    "LocationId": _ids,
    "Code": _codes,
    "str": st.text(max_size=40),
    "bytes": st.binary(max_size=300),
    "NamespaceDigest": st.binary(min_size=32, max_size=32),
    "BlockKey": _keys,
    "BlockKey | None": st.none() | _keys,
    "tuple[BlockKey, ...]": st.lists(_keys, max_size=6).map(tuple),
    "tuple[LocationId, ...]": st.lists(_ids, max_size=6).map(tuple),
    "tuple[NodeId, ...]": st.lists(_ids, max_size=6).map(tuple),
    "tuple[int, ...]": st.lists(_uint, max_size=6).map(tuple),
}


def message_strategy(cls: type) -> st.SearchStrategy:
    if cls is Invalidate:
        ns = FIELD_STRATEGIES["NamespaceDigest"]
        return st.one_of(
            st.builds(Invalidate, namespace=ns, scope=st.sampled_from(["key", "prefix"]), key=_keys),
            st.builds(Invalidate, namespace=ns, scope=st.just("namespace"), key=st.none()),
        )
    if cls is PrefixFound:
        return st.lists(_ids, max_size=6).flatmap(
            lambda locs: st.builds(PrefixFound, namespace=FIELD_STRATEGIES["NamespaceDigest"],
                                   blocks_matched=st.just(len(locs)), locations=st.just(tuple(locs)))
        )  # fmt: skip
    if cls is wire.Located:
        return st.one_of(
            st.builds(wire.Located, namespace=FIELD_STRATEGIES["NamespaceDigest"],
                      known=st.lists(st.integers(0, 2), max_size=6).map(tuple), authorized=st.just(1)),
            st.builds(wire.Located, namespace=FIELD_STRATEGIES["NamespaceDigest"],
                      known=st.lists(st.just(0), max_size=6).map(tuple), authorized=st.just(0)),
        )
    if cls is Welcome:
        return st.lists(st.tuples(_keys, _uint), max_size=6).flatmap(
            lambda pairs: st.builds(Welcome, node=_ids, incarnation=_uint,
                                    fence_keys=st.just(tuple(k for k, _ in pairs)),
                                    fence_epochs=st.just(tuple(e for _, e in pairs)), term_ms=_uint)
        )  # fmt: skip
    if cls is NodeList:
        return st.lists(_ids, max_size=6).flatmap(
            lambda ids: st.builds(NodeList, nodes=st.just(tuple(ids)), addresses=st.just(tuple(reversed(ids))))
        )
    if cls is WaitTicket:
        return st.builds(WaitTicket, ticket=_uint, timeout_ms=st.integers(0, wire.MAX_WAIT_TICKET_MS))
    if cls in (Batch, Batched):  # of any messages but batches
        return st.lists(_unbatched, max_size=4).map(lambda items: cls(tuple(items)))
    return st.builds(cls, **{a.name: FIELD_STRATEGIES[a.type] for a in attrs.fields(cls)})


_unbatched = st.deferred(lambda: st.one_of([message_strategy(c) for c in MESSAGE_TYPES.values() if c not in (Batch, Batched)]))
any_message = st.one_of([message_strategy(cls) for cls in MESSAGE_TYPES.values()])
# What a peer sends unprompted: anything but Error (an Error with re=0 is final; see send_error).
any_request = any_message.filter(lambda m: type(m) is not Error)


# -- the message vocabulary ---------------------------------------------------------------------------


def test_spec_messages_have_wire_messages_of_the_same_name():
    assert set(MESSAGE_NAMES.values()) == set(wire.SPEC_MESSAGES)
    for name in MESSAGE_NAMES.values():
        assert MESSAGE_TYPES[name].__name__ == name


@settings(max_examples=100)
@given(any_message)
def test_every_message_is_frozen(msg):
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(msg, attrs.fields(type(msg))[0].name, None)


@pytest.mark.parametrize("kind", sorted(MESSAGE_TYPES))
@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip_every_message(kind, data):
    msg = data.draw(message_strategy(MESSAGE_TYPES[kind]))
    body = encode(msg)
    assert decode(body) == msg
    assert encode(decode(body)) == body


def test_body_is_canonical_cbor_of_kind_and_fields():
    msg = Acquire(node="n1", key=KEY, namespace=NS, request=7)
    expected = cbor_encode({"kind": "Acquire", "node": "n1", "key": KEY.digest, "namespace": NS, "request": 7})
    assert encode(msg) == expected


def _generic_body(msg) -> dict:
    body = {"kind": type(msg).__name__}
    for name, _, to_wire, _ in wire.codec._SCHEMA[type(msg)]:
        body[name] = to_wire(getattr(msg, name))
    return body


def _generic_outcome(data: bytes, **limits):
    try:
        return ("ok", cbor_decode(data, **limits))
    except CborError:
        return ("error", None)


def _mutate(data: bytes, draw) -> bytes:
    b = bytearray(data)
    i = draw(st.integers(0, max(0, len(b) - 1)))
    how = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
    if how == "flip" and b:
        b[i] ^= draw(st.integers(1, 255))
    elif how == "insert":
        b[i:i] = draw(st.binary(min_size=1, max_size=4))
    elif how == "delete":
        del b[i : i + draw(st.integers(1, 4))]
    else:
        del b[i:]
    return bytes(b)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(any_message, st.data())
def test_fast_codec_paths_agree_with_the_generic_codec(msg, data):
    """``encode`` and the flat-map decoder (messages and envelopes) are fast paths of the generic
    canonical codec: the same bytes out; on any input, valid, mutated or random, either the
    generic decoder's value or None (then the generic decoder decides)."""
    body = encode(msg)
    assert body == cbor_encode(_generic_body(msg))
    env = wire.encode_envelope("alpha", 3, 2, b"m" * 32, body)
    cases = [(body, wire.MAX_MESSAGE_FIELDS, True, dict(max_depth=2, max_items=wire.MAX_LOOKUP_KEYS,
                                                         max_string_bytes=wire.MAX_BLOCK_BYTES)),
             (env, 5, False, dict(max_depth=1, max_items=5, max_string_bytes=len(env)))]  # fmt: skip
    for valid, entries, arrays, limits in cases:
        for sample in (valid, _mutate(valid, data.draw), data.draw(st.binary(max_size=80))):
            fast = wire.codec.flat_map(sample, entries, arrays)
            kind, value = _generic_outcome(sample, **limits)
            if sample is valid:
                assert fast is not None and fast == value  # the fast path takes every valid frame
            elif fast is not None:
                assert kind == "ok" and fast == value, sample.hex()
                assert [type(v) for v in fast.values()] == [type(v) for v in value.values()]
    mutated = _mutate(body, data.draw)
    try:
        got = ("ok", decode(mutated))
    except Malformed:
        got = ("malformed", None)
    generic = _generic_outcome(mutated, max_depth=2, max_items=wire.MAX_LOOKUP_KEYS,
                               max_string_bytes=wire.MAX_BLOCK_BYTES)  # fmt: skip
    if generic[0] == "error":
        assert got[0] == "malformed"


@pytest.mark.parametrize(
    "data, entries, arrays",
    [
        (b"\xa2\x64kind\x64Ping\x65nonce\x18\x01", 16, True),  # int not in its shortest form
        (b"\xa2\x64kind\x64Ping\x65nonce\x19\x00\x01", 16, True),
        (b"\xa2\x64kind\x64Ping\x65nonce\x1a\x00\x00\x00\x01", 16, True),
        (b"\xa2\x64kind\x64Ping\x65nonce\x1b" + bytes(7) + b"\x01", 16, True),
        (b"\xa2\x64kind\x78\x04Ping\x65nonce\x01", 16, True),  # a length not in its shortest form
        (b"\xa2\x65nonce\x01\x64kind\x64Ping", 16, True),  # keys out of canonical order
        (b"\xa2\x64kind\x64Ping\x64kind\x64Ping", 16, True),  # a duplicate key
        (b"\xa2\x64kind\x62\xff\xfe\x65nonce\x01", 16, True),  # text that is not UTF-8
        (b"\xa1\x64keys\x81\x81\x01", 16, True),  # an array in an array: deeper than allowed
        (b"\xa1\x62re\x81\x01", 5, False),  # an array in an envelope
        (b"\xa6" + b"".join(bytes((0x61, c, 0)) for c in b"abcdef"), 5, False),  # six envelope entries
        (b"\xa1\x61a\xf7", 16, True),  # undefined
        (b"\xa1\x61a\xf8\x20", 16, True),  # a one-byte simple value
        (b"\xa1\x61a\xf9\x00\x00", 16, True),  # a float
        (b"\xa1\x61a\x20", 16, True),  # a negative int (no field holds one)
        (b"\xa1\x61a\xc2\x41\x01", 16, True),  # a tag
        (b"\xa1\x61a\x01\x00", 16, True),  # a trailing byte
        (b"\xa1\x61a\x42\x01", 16, True),  # a truncated string
        (b"\xa1\x61a\x83\x01\x02", 16, True),  # a truncated array
        (b"\xbf\x61a\x01\xff", 16, True),  # an indefinite-length map
    ],
)
def test_fast_map_leaves_non_canonical_and_odd_input_to_the_generic_decoder(data, entries, arrays):
    assert wire.codec.flat_map(data, entries, arrays) is None


def _body(**fields) -> bytes:
    return cbor_encode(fields)


@pytest.mark.parametrize(
    "body",
    [
        _body(kind="Nope", nonce=1),  # unknown kind
        _body(nonce=1),  # no kind
        _body(kind=7, nonce=1),  # kind not text
        _body(kind="Ping"),  # missing field
        _body(kind="Ping", nonce=1, extra=2),  # extra field
        _body(kind="Ping", nonse=1),  # misspelt field
        _body(kind="Ping", nonce=True),  # bool for int
        _body(kind="Ping", nonce=-1),  # negative
        _body(kind="Ping", nonce=2**63),  # beyond int64
        _body(kind="Ping", nonce="1"),  # text for int
        _body(kind="Acquire", node="n", key=b"\x00" * 31, namespace=NS, request=1),  # short key
        _body(kind="Acquire", node="", key=KEY.digest, namespace=NS, request=1),  # empty node id
        _body(kind="Acquire", node="n", key=KEY.digest, namespace=NS[:5], request=1),  # short digest
        _body(kind="Error", code="Bad Code", text="x"),  # not a code
        _body(kind="Invalidate", namespace=NS, scope="namespace", key=KEY.digest),  # cross-field
        _body(kind="Invalidate", namespace=NS, scope="key", key=None),
        _body(kind="Invalidate", namespace=NS, scope="everything", key=None),
        _body(kind="PrefixFound", namespace=NS, blocks_matched=2, locations=["l0"]),
        _body(kind="WaitTicket", ticket=1, timeout_ms=wire.MAX_WAIT_TICKET_MS + 1),
        _body(kind="Lookup", namespace=NS, keys=[KEY.digest, 5]),
        cbor_encode(["Ping", 1]),  # not a map
        b"\xa2\x64kind\x64Ping\x65nonce\x18\x01",  # non-canonical int inside
        b"\xff",  # not CBOR
    ],
)
def test_decode_rejects_invalid_bodies(body):
    with pytest.raises(Malformed):
        decode(body)


def test_encoding_an_invalid_message_is_our_bug():
    for bad in (
        Ping(nonce=-1), Ping(nonce=True), Acquire(node="", key=KEY, namespace=NS, request=1),
        Invalidate(namespace=NS, scope="key", key=None), Error(code="NOT A CODE", text=""), "Ping", None,
    ):  # fmt: skip
        with pytest.raises(ProtocolViolation):
            encode(bad)


# -- frames -----------------------------------------------------------------------------------------


@given(st.lists(st.binary(min_size=1, max_size=50), max_size=8), st.randoms())
def test_frame_decoder_accepts_any_chunking(payloads, rnd):
    stream = b"".join(wire.encode_frame(p) for p in payloads)
    cuts = sorted(rnd.sample(range(len(stream) + 1), min(len(stream) + 1, rnd.randint(0, 10))))
    decoder = FrameDecoder()
    out = []
    for a, b in zip([0, *cuts], [*cuts, len(stream)]):
        out += decoder.feed(stream[a:b])
    assert out == payloads
    assert decoder.buffered_bytes == 0


def test_oversized_length_header_is_refused_before_buffering():
    decoder = FrameDecoder(max_frame_bytes=1024)
    assert decoder.feed(b"\x00\x00\x04") == []  # three bytes of a header: nothing to judge yet
    with pytest.raises(FrameTooLarge) as info:
        decoder.feed(b"\x01")  # the header is complete: 0x00000401 = 1025 bytes announced
    assert info.value.length_bytes == 1025 and info.value.limit_bytes == 1024
    assert decoder.buffered_bytes == 0
    with pytest.raises(FrameTooLarge):
        decoder.feed(b"")  # failed for good

    decoder = FrameDecoder()
    with pytest.raises(FrameTooLarge):
        decoder.feed(b"\xff\xff\xff\xff" + b"x" * 100)  # 4 GiB announced: nothing allocated
    assert decoder.buffered_bytes == 0


def test_session_refuses_an_oversized_frame_by_its_header():
    server = Session.server(TENANTS, max_frame_bytes=wire.MAX_CONTROL_FRAME_BYTES)
    with pytest.raises(FrameTooLarge):
        server.receive_data(struct.pack(">I", wire.MAX_CONTROL_FRAME_BYTES + 1))
    assert server.failure is not None


# -- sessions ---------------------------------------------------------------------------------------


def _pair(tenant="alpha", token=TOKEN_A):
    return Session.client(tenant, token), Session.server(Tenants(TENANTS))


def _opened(tenant="alpha", token=TOKEN_A):
    """A pair past the opening exchange (as ``Client`` does it): the client's Ping, the server's
    Pong -- the first frame of each direction, with its nonce -- so both hold the session key."""
    client, server = _pair(tenant, token)
    (ping,) = server.receive_data(client.send(Ping(0)))
    client.receive_data(server.send(Pong(0), re=ping.seq))
    assert client.keyed and server.keyed
    return client, server


def test_request_and_reply_through_sessions():
    client, server = _pair()
    frame = client.send(Ping(1))
    (got,) = server.receive_data(frame)
    assert got.msg == Ping(1) and got.seq == 1 and got.re == 0 and got.tenant == "alpha" and got.authenticated
    (reply,) = client.receive_data(server.send(Pong(1), re=got.seq))
    assert reply.msg == Pong(1) and reply.re == 1


def test_mac_and_envelope_are_the_documented_formulas():
    client, server = _pair()
    payload = client.send(Ping(9))[4:]
    env = cbor_decode(payload)
    body = encode(Ping(9))
    # A direction's first frame: keyed by the token, its nonce inside the MAC and the envelope.
    expected_mac = hmac.new(TOKEN_A, cbor_encode(["c2s", "alpha", 1, 0, body, client.nonce]), hashlib.sha256).digest()
    assert env == {"tenant": "alpha", "seq": 1, "re": 0, "mac": expected_mac, "body": body, "nonce": client.nonce}
    assert payload == cbor_encode(env)
    server.receive_data(b"".join([len(payload).to_bytes(4, "big"), payload]))
    pong = server.send(Pong(9), re=1)[4:]
    assert cbor_decode(pong)["nonce"] == server.nonce != client.nonce
    client.receive_data(len(pong).to_bytes(4, "big") + pong)
    # Every later frame, both ways: keyed by HMAC(token, "kvcc session key\0" || client nonce || server nonce).
    key = hmac.new(TOKEN_A, b"kvcc session key\x00" + client.nonce + server.nonce, hashlib.sha256).digest()
    assert key == wire.session.session_key(TOKEN_A, client.nonce, server.nonce)
    env = cbor_decode(client.send(Ping(10))[4:])
    expected_mac = hmac.new(key, cbor_encode(["c2s", "alpha", 2, 0, encode(Ping(10))]), hashlib.sha256).digest()
    assert env == {"tenant": "alpha", "seq": 2, "re": 0, "mac": expected_mac, "body": encode(Ping(10))}


def test_a_frame_of_another_connection_does_not_verify():
    """A recorded connection replayed whole on a new one (issue 14: a read after its lease ended,
    an invalidation): its first frame opens the new session, but every later frame was keyed by
    the old server's nonce and is refused. A client likewise refuses a recorded server's frames."""
    client, server = _opened()
    recorded = client.send(Ping(5))
    assert [r.msg for r in server.receive_data(recorded)] == [Ping(5)]
    replay = Session.server(Tenants(TENANTS))
    replay.receive_data(_pair()[0].send(Ping(0)))  # any first frame of the tenant opens it
    with pytest.raises(Unauthorized):
        replay.receive_data(recorded)
    # The server side: a frame for one client's session does not verify in another's.
    other_client, _ = _opened()
    with pytest.raises(Unauthorized):
        other_client.receive_data(server.send(Pong(5), re=2))


def test_a_connection_opens_with_a_ping():
    """Only the first frame is keyed by the token alone: it must be one whose answer gives
    nothing away, so that replaying a recorded one on a new connection gains nothing."""
    client, server = _pair()
    with pytest.raises(Unauthorized):
        server.receive_data(client.send(Release("n1", KEY, 1)))


def test_a_client_sends_nothing_after_its_first_frame_until_the_session_is_keyed():
    client, _ = _pair()
    client.send(Ping(0))
    assert not client.keyed
    with pytest.raises(ProtocolViolation):
        client.send(Ping(1))


@pytest.mark.parametrize("size", [0, 100, 1 << 20])
def test_mac_is_the_documented_formula_for_every_frame_of_a_session(size):
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    key = wire.session._MacKey(TOKEN_A)
    for direction, seq, re in (("c2s", 1, 0), ("s2c", 2**40, 7), ("c2s", 3, 2)):  # the prefix is reused
        expected = hmac.new(TOKEN_A, cbor_encode([direction, "alpha", seq, re, body]), hashlib.sha256).digest()
        assert key.mac(direction, "alpha", seq, re, body) == expected
        assert wire.frame_mac(TOKEN_A, direction, "alpha", seq, re, body) == expected


def test_large_block_bytes_travel():
    client, server = _opened()  # a connection opens with a small frame (Client does)
    data = random.Random(1).randbytes(3 << 20)
    msg = WriteBytes(node="n1", key=KEY, lease=1, location="n2/dram", gen=1, epoch=2, data=data)
    frame = client.send(msg)
    got = []
    for i in range(0, len(frame), 1 << 16):
        got += server.receive_data(frame[i : i + (1 << 16)])
    assert [r.msg for r in got] == [msg]


def test_nothing_above_the_unauthenticated_limit_before_a_frame_authenticated():
    # A block as a connection's first frame is refused on its length header alone: an
    # unauthenticated peer never makes a server buffer more than MAX_UNAUTHENTICATED_FRAME_BYTES.
    client, server = _pair()
    data = random.Random(1).randbytes(1 << 20)
    frame = client.send(WriteBytes(node="n1", key=KEY, lease=1, location="n2/dram", gen=1, epoch=2, data=data))
    with pytest.raises(FrameTooLarge):
        server.receive_data(frame[: 1 << 16])
    client, server = _opened()
    big = client.send(WriteBytes(node="n1", key=KEY, lease=1, location="n2/dram", gen=1, epoch=2, data=data))
    assert [type(r.msg) for r in server.receive_data(big)] == [WriteBytes]
    assert MAX_UNAUTHENTICATED_FRAME_BYTES < len(big)


def test_replayed_frame_is_refused():
    client, server = _pair()
    f1 = client.send(Ping(1))
    server.receive_data(f1)
    with pytest.raises(Replayed):
        server.receive_data(f1)


def test_reordered_and_deleted_frames_are_refused():
    client, server = _opened()
    f2, f3 = client.send(Ping(2)), client.send(Ping(3))
    with pytest.raises(Replayed):
        server.receive_data(f3)  # frame 2 deleted (or arriving late)
    client, server = _opened()
    f2, f3, f4 = client.send(Ping(2)), client.send(Ping(3)), client.send(Ping(4))
    server.receive_data(f2)
    with pytest.raises(Replayed):
        server.receive_data(f4)
    client, server = _pair()
    client.send(Ping(1))
    client._session_mac = _opened()[0]._session_mac  # a second frame sent before the first
    with pytest.raises(Unauthorized):
        server.receive_data(client.send(Ping(2)))  # the server has no session key: nothing verifies


def test_wrong_token_unknown_tenant_and_tenant_switch_are_unauthorized():
    client, server = _pair(token=b"z" * 32)
    with pytest.raises(Unauthorized):
        server.receive_data(client.send(Ping(1)))

    client, server = _pair(tenant="gamma", token=TOKEN_A)
    with pytest.raises(Unauthorized):
        server.receive_data(client.send(Ping(1)))

    alpha, server = _opened()
    beta, _ = _opened("beta", TOKEN_B)  # beta's next frame has seq 2, the next one the server expects
    with pytest.raises(Unauthorized):
        server.receive_data(beta.send(Ping(2)))


def test_a_reflected_frame_does_not_verify():
    client, _ = _pair()
    with pytest.raises(Unauthorized):
        client.receive_data(client.send(Ping(1)))  # direction is inside the MAC


def test_tampered_body_does_not_verify():
    client, server = _pair()
    frame = bytearray(client.send(Ping(1)))
    frame[-20] ^= 0x01
    with pytest.raises(PeerViolation):
        server.receive_data(bytes(frame))


def test_a_failed_session_stays_failed_and_changes_nothing():
    client, server = _pair()
    good = client.send(Ping(1))
    with pytest.raises(Malformed):
        server.receive_data(b"\x00\x00\x00\x02\xff\xff")
    before = (server.last_received_seq, server.tenant)
    for _ in range(3):
        with pytest.raises(Malformed):
            server.receive_data(good)
    assert (server.last_received_seq, server.tenant) == before
    with pytest.raises(ProtocolViolation):
        server.send(Pong(1))
    server.send_error("malformed", "bye")  # the final Error is still allowed



@pytest.mark.parametrize("frame", [
    (1 << 20).to_bytes(4, "big") + bytes(1 << 20),  # a whole frame that is not an envelope
    b"\xff\xff\xff\xff",  # a header over the limit
], ids=["malformed-1MiB", "too-large-header"])  # fmt: skip
def test_a_failed_session_is_freed_without_the_cycle_collector(frame):
    """What a rejected connection sent is let go with the session: the failure it keeps to raise
    again holds no traceback (whose frames would hold the session and the frame's bytes), so
    reference counting alone frees it (a fuzzed node once kept 136 MiB per rejected 68 MiB frame)."""
    gc.disable()
    try:
        _, server = _pair()
        gone = weakref.ref(server)
        for _ in range(2):  # the first failure, then the one it raises again
            with pytest.raises(PeerViolation) as info:
                server.receive_data(frame)
            assert info.value.__traceback__ is not None  # the raised one has its own
        assert server.failure.__traceback__ is None and server.failure.__context__ is None
        del server, info
        assert gone() is None, "the session outlived its last reference"
    finally:
        gc.enable()

def test_final_errors_authenticated_or_not():
    # Before any tenant is known the server cannot sign: the client accepts only a final Error.
    client, server = _pair()
    (r,) = client.receive_data(server.send_error("busy", "too many connections"))
    assert r.final and not r.authenticated and r.msg == Error("busy", "too many connections")
    with pytest.raises(Malformed):
        client.receive_data(wire.encode_frame(b"\x00"))  # nothing may follow a final Error
    # After authentication the final Error is signed.
    client, server = _pair()
    (got,) = server.receive_data(client.send(Ping(1)))
    (r,) = client.receive_data(server.send_error("idle", "bye"))
    assert r.final and r.authenticated and r.tenant == "alpha"
    with pytest.raises(ProtocolViolation):
        server.send(Pong(1), re=got.seq)  # nothing after the final Error


def test_unauthenticated_frames_other_than_a_final_error_are_refused():
    client, server = _pair()
    forged = wire.encode_frame(wire.encode_envelope("", 1, 0, b"", encode(Pong(1))))
    with pytest.raises(Unauthorized):
        client.receive_data(forged)
    forged_request = wire.encode_frame(wire.encode_envelope("", 1, 0, b"", encode(Ping(1))))
    with pytest.raises(Unauthorized):
        server.receive_data(forged_request)


def test_local_misuse_is_a_protocol_violation():
    client, server = _pair()
    with pytest.raises(ProtocolViolation):
        server.send(Pong(1))  # the server does not speak first
    with pytest.raises(ProtocolViolation):
        client.send(Pong(1), re=1)  # answers a frame never received
    with pytest.raises(ProtocolViolation):
        client.send(Error("x", "final errors go through send_error"))
    with pytest.raises(ProtocolViolation):
        client.send(Ping(-1))
    with pytest.raises(ValueError):
        Session.client("alpha", b"short")
    with pytest.raises(ValueError):
        Tenants({"alpha": b"short"})


def test_reply_to_a_frame_never_sent_is_refused():
    client, server = _opened()
    for _ in range(4):
        server.receive_data(client.send(Ping(1)))
    with pytest.raises(Malformed):
        client.receive_data(_reply_naming(server, client, 9))  # the client sent only frames 1 to 5


def _reply_naming(server: Session, client: Session, re: int) -> bytes:
    """A server frame answering frame ``re`` of the client, correctly keyed (which ``send``
    refuses to build for a frame it never received)."""
    server.last_received_seq, real = max(server.last_received_seq, re), server.last_received_seq
    try:
        return server.send(Pong(1), re=re)
    finally:
        server.last_received_seq = real


def test_authorize_namespaces_per_tenant():
    other_ns = hashlib.sha256(b"other").digest()
    tenants = Tenants(TENANTS, namespaces={"alpha": [NS]})
    tenants.authorize("alpha", NS)
    assert tenants.allows("alpha", NS) and not tenants.allows("beta", NS)
    for tenant, ns in (("alpha", other_ns), ("beta", NS), ("nobody", NS)):
        with pytest.raises(Unauthorized):
            tenants.authorize(tenant, ns)
    tenants.authorize_message("alpha", Acquire(node="n", key=KEY, namespace=NS, request=1))
    tenants.authorize_message("beta", Ping(1))  # names no namespace
    with pytest.raises(Unauthorized):
        tenants.authorize_message("beta", Acquire(node="n", key=KEY, namespace=NS, request=1))


def test_error_codes_are_stable():
    assert [c.code for c in (Malformed, FrameTooLarge, Unauthorized, Replayed)] == [
        "malformed", "frame_too_large", "unauthorized", "replayed",
    ]  # fmt: skip
    for cls in (Malformed, FrameTooLarge, Unauthorized, Replayed):
        assert issubclass(cls, PeerViolation) and issubclass(cls, KvccError)
        assert not issubclass(cls, ProtocolViolation)
        assert wire.codec._check_code(cls.code) is None  # usable as Error.code
    e = Malformed("bad", where="x")
    assert e.to_json() == {"error": "Malformed", "code": "malformed", "detail": "bad", "where": "x"}


# -- the fuzz invariant -----------------------------------------------------------------------------


def _valid_stream(messages) -> tuple[Session, bytes]:
    """A client's opening Ping then its frames of ``messages``, and the fresh server they are
    for: the client is keyed by a twin of that server (its nonce), which answered the Ping."""
    server, twin = Session.server(TENANTS), Session.server(TENANTS)
    twin.nonce = server.nonce
    client = Session.client("alpha", TOKEN_A)
    first = client.send(Ping(0))
    (got,) = twin.receive_data(first)
    client.receive_data(twin.send(Pong(0), re=got.seq))
    return server, first + b"".join(client.send(m) for m in messages)


def _feed_and_check(server: Session, stream: bytes, cuts: list[int]) -> list:
    """Feed ``stream`` in pieces; only PeerViolation may escape, and once one has, every later
    call raises again and yields nothing."""
    out = []
    violation = None
    for a, b in zip([0, *cuts], [*cuts, len(stream)]):
        try:
            got = server.receive_data(stream[a:b])
        except PeerViolation as v:  # anything else fails the test
            violation = violation or v
            continue
        assert violation is None, "a message was yielded after a violation"
        out += got
    if violation is not None:
        with pytest.raises(PeerViolation):
            server.receive_data(b"")
        failure = server.failure  # kept as a copy without a traceback: the same violation
        assert (type(failure), failure.code, str(failure)) == (type(violation), violation.code, str(violation))
    return out


_messages = st.lists(any_request, min_size=1, max_size=4)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=5))
def test_fuzz_random_bytes(data, cuts):
    _feed_and_check(Session.server(TENANTS), data, sorted(c for c in cuts if c <= len(data)))


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(_messages, st.data())
def test_fuzz_mutated_valid_frames(messages, data):
    server, stream = _valid_stream(messages)
    stream = bytearray(stream)
    mutation = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate", "duplicate", "swap", "length"]))
    i = data.draw(st.integers(0, len(stream) - 1))
    if mutation == "flip":
        stream[i] ^= data.draw(st.integers(1, 255))
    elif mutation == "insert":
        stream[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    elif mutation == "delete":
        del stream[i : i + data.draw(st.integers(1, 8))]
    elif mutation == "truncate":
        del stream[i:]
    elif mutation == "length":
        stream[0:4] = struct.pack(">I", data.draw(st.integers(0, 2**32 - 1)))
    else:
        frames = wire.FrameDecoder().feed(bytes(stream))
        framed = [wire.encode_frame(f) for f in frames]
        if mutation == "duplicate":
            j = data.draw(st.integers(0, len(framed) - 1))
            framed.insert(j + 1, framed[j])
        elif len(framed) > 1:
            j = data.draw(st.integers(0, len(framed) - 2))
            framed[j], framed[j + 1] = framed[j + 1], framed[j]
        stream = bytearray(b"".join(framed))
    stream = bytes(stream)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=4)))
    out = _feed_and_check(server, stream, cuts)
    # Whatever got through is a prefix of what was sent: nothing forged, nothing reordered.
    assert [r.msg for r in out] == [Ping(0), *messages][: len(out)]


@settings(max_examples=60)
@given(_messages, st.lists(st.integers(0, 10_000), max_size=6))
def test_unmutated_streams_arrive_whole_in_any_chunking(messages, cuts):
    server, stream = _valid_stream(messages)
    out = _feed_and_check(server, stream, sorted(c for c in cuts if c <= len(stream)))
    assert [r.msg for r in out] == [Ping(0), *messages]
    assert [r.seq for r in out] == list(range(1, len(messages) + 2))


@settings(max_examples=100)
@given(any_message, st.binary(max_size=40))
def test_fuzz_client_side_against_garbage_replies(msg, garbage):
    client, server = _pair()
    (got,) = server.receive_data(client.send(Ping(1)))
    frame = server.send(msg, re=got.seq)  # an Error is a plain reply here (re > 0)
    corrupted = frame[: len(frame) // 2] + garbage
    try:
        client.receive_data(corrupted)
    except PeerViolation:
        with pytest.raises(PeerViolation):
            client.receive_data(frame)


# -- data-plane grants (wire/grants.py) -------------------------------------------------------------


def test_a_grant_is_good_only_for_its_tenant_block_location_lease_and_time():
    from kvcc.reference.wire.grants import GRANT_READ, GRANT_WRITE, SHARED, Grants, grant_keys, node_grant_key, sign_grant

    nodes = Tenants({"t": TOKEN_A, "node:n1": b"n" * 32, "node:n2": b"m" * 32}, nodes={"node:n1": "n1", "node:n2": "n2"})
    keys = grant_keys(nodes)
    assert set(keys) == {"n1", "n2"} and keys["n1"] != keys["n2"]
    assert node_grant_key(nodes, "node:n1", "n1") == keys["n1"]  # a node derives its own from its own token
    assert node_grant_key(nodes, "node:n1", "n2") is None and node_grant_key(nodes, "t", "n1") is None
    shared = Tenants({"t": TOKEN_A, "ops": b"o" * 32}, operators={"ops"})
    assert set(grant_keys(shared)) == {SHARED} and node_grant_key(shared, "ops", "n7") == grant_keys(shared)[SHARED]
    assert grant_keys(Tenants({"t": TOKEN_A})) == {}  # no node secret: nothing to sign with
    now = [1_000_000]
    g = Grants(keys["n1"], 50, wall_ms=lambda: now[0])
    args = ("t", KEY.digest, 3, 7, "n1/dram", 11)
    grant = sign_grant([keys["n1"]], GRANT_WRITE, *args, now[0] + 1000)
    assert g.problem(grant, GRANT_WRITE, *args) is None
    assert Grants(keys["n2"], 50).problem(grant, GRANT_WRITE, *args) is not None  # another node's: not checkable
    pool = sign_grant([keys["n1"], keys["n2"]], GRANT_WRITE, "t", KEY.digest, 3, 7, "pool", 11, now[0] + 1000)
    for k in ("n1", "n2"):  # the shared pool's: every node checks it
        assert Grants(keys[k], 50).problem(pool, GRANT_WRITE, "t", KEY.digest, 3, 7, "pool", 11) is None
    for kind, tenant, digest, gen, epoch, location, lease in (
        (GRANT_READ, *args), (GRANT_WRITE, "u", *args[1:]), (GRANT_WRITE, "t", bytes(32), *args[2:]),
        (GRANT_WRITE, "t", KEY.digest, 4, 7, "n1/dram", 11), (GRANT_WRITE, "t", KEY.digest, 3, 8, "n1/dram", 11),
        (GRANT_WRITE, "t", KEY.digest, 3, 7, "n2/dram", 11), (GRANT_WRITE, "t", KEY.digest, 3, 7, "n1/dram", 12),
    ):  # fmt: skip
        assert g.problem(grant, kind, tenant, digest, gen, epoch, location, lease) is not None
    for bad in (b"", grant[:-1], grant[:8] + bytes(32), (now[0] + 10**6).to_bytes(8, "big") + grant[8:]):
        assert g.problem(bad, GRANT_WRITE, *args) is not None  # absent, cut, forged, its expiry moved
    read = sign_grant([keys["n1"]], GRANT_READ, "t", KEY.digest, 3, 0, "n1/dram", 11, now[0] + 1000)
    now[0] += 1000 + 50  # its end plus epsilon: still taken
    assert g.problem(read, GRANT_READ, "t", KEY.digest, 3, 0, "n1/dram", 11) is None
    now[0] += 1
    assert g.problem(read, GRANT_READ, "t", KEY.digest, 3, 0, "n1/dram", 11) == "the grant ran out"
    # A write grant is judged by its epoch at the location (the fence), not by time.
    assert g.problem(grant, GRANT_WRITE, *args) is None
