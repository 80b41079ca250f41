"""The wire: messages, their canonical CBOR codec, frames and authenticated sessions. No I/O.

Theory of operation
-------------------
Three layers, each a pure function of bytes in and bytes out (h11-style: the caller owns the
socket, the clock and the event loop; ``kvcc.reference.transport`` is one such caller).

1. **Messages** are frozen attrs values, one class per protocol noun. Their kind names are the
   spec's message names (``spec/layout.py``: ``Acquire`` ... ``Copied``) plus the replies and
   client-facing requests the spec abstracts away. ``encode(msg)`` is the canonical CBOR of
   ``{"kind": <class name>, <field>: <value>, ...}`` (``kvcc.spec.keys.cbor_encode``); block keys
   travel as their 32-byte digests. ``decode(body)`` accepts exactly what ``encode`` produces:
   unknown kind, missing or extra field, wrong type or a value out of range raises ``Malformed``.
   Each field's wire type follows from its annotation (``_WIRE_TYPES``), checked at import.

2. **Frames**: ``[4-byte big-endian length][payload]``. ``FrameDecoder`` takes bytes in any
   chunking and returns whole payloads; a length header above its limit raises ``FrameTooLarge``
   before a byte of that frame is buffered. Limits: ``MAX_FRAME_BYTES`` (64 MiB of block data
   plus ``MAX_CONTROL_FRAME_BYTES`` of headroom) for connections that carry block bytes (nodes,
   locations); ``MAX_CONTROL_FRAME_BYTES`` (4 MiB, enough for a ``Lookup`` of the longest prompt)
   for connections that carry only control messages (the directory) -- the receiver chooses.

3. **Sessions** authenticate frames per tenant. A payload is the canonical CBOR map
   ``{"tenant", "seq", "re", "mac", "body"}``: ``body`` is an encoded message, ``seq`` numbers the
   frames of one connection and direction from 1 with no gaps, ``re`` is the ``seq`` of the
   peer's frame this one answers (0: answers nothing), and

       mac = HMAC-SHA256(tenant token, canonical CBOR [direction, tenant, seq, re, body])

   with ``direction`` = ``"c2s"`` or ``"s2c"``. The design brief's MAC covers ``[tenant, seq,
   body]``; ``re`` is added because replies are pipelined and must name their request, and the
   direction because one token serves both directions, so a frame reflected back to its sender
   must not verify. Checks, in order: a well-formed envelope (else ``Malformed``), a known tenant,
   the same tenant as earlier frames on this connection and a MAC that verifies in constant time
   (else ``Unauthorized``), ``seq`` exactly one above the last (else ``Replayed``: a replayed,
   reordered or deleted frame), ``re`` naming a frame we sent, then the body (``Malformed``).

   The first ``PeerViolation`` closes the session for good: ``receive_data`` raises it again on
   any later input and changes nothing (h11's invariant: garbage only ever produces the peer's
   error, never another exception, never a message after it). A chunk of input that contains a
   violation yields nothing, not even the good frames before it: the connection is being torn
   down and their answers could not be sent anyway.

   An ``Error`` frame with ``re == 0`` is *final*: its sender closes the connection after it. A
   server that fails a connection before it knows the tenant (garbage, unknown tenant, bad MAC,
   too many connections) cannot sign, so it sends its final ``Error`` unauthenticated (tenant
   ``""``, empty MAC); a client accepts an unauthenticated frame only if it is such a final Error.
   Forging one can only close a connection, which anyone on the path can do with a TCP reset.

   Known limit: the MAC authenticates frames, it does not hide them, and since sequence numbers
   restart on every connection, a recorded connection can be replayed whole on a new one. Run
   over TLS (or a tunnel) where the network is not trusted.

``Tenants`` holds each tenant's token and the namespace digests it may use; ``authorize`` raises
``Unauthorized`` for any other namespace (DESIGN property 11). The directory calls it.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import re as _re
import struct
from collections.abc import Callable, Mapping
from typing import Any, NewType, Union

import attrs
from attrs import field, frozen

from kvcc.spec.keys import (
    DIGEST_BYTES,
    BlockKey,
    CborError,
    Epoch,
    Generation,
    LeaseId,
    LocationId,
    NamespaceDigest,
    NodeId,
    cbor_decode,
    cbor_encode,
    cbor_head,
)

from .errors import FrameTooLarge, Malformed, PeerViolation, ProtocolViolation, Replayed, Unauthorized


# -- limits -----------------------------------------------------------------------------------------

FRAME_HEADER_BYTES = 4
MAX_BLOCK_BYTES = 64 << 20  # block data carried by WriteBytes / BytesRead
MAX_CONTROL_FRAME_BYTES = 4 << 20  # any frame without block data fits (see the asserts below)
MAX_FRAME_BYTES = MAX_BLOCK_BYTES + MAX_CONTROL_FRAME_BYTES  # data connections
MAX_WIRE_INT = 2**63 - 1  # every int field: 0 .. 2**63-1, a signed 64-bit int in any language
MAX_ID_BYTES = 128  # node and location ids (UTF-8)
MAX_TENANT_BYTES = 128
MAX_CODE_BYTES = 64  # error codes, refusal reasons, scopes: [a-z][a-z0-9_]*
MAX_TEXT_BYTES = 4096  # Error.text (UTF-8)
MAX_LOOKUP_KEYS = 16384  # keys in one Lookup, locations in one PrefixFound
MAX_MESSAGE_FIELDS = 16  # entries of one message map, kind included
MAX_WAIT_TICKET_MS = 30_000  # longest WaitTicket.timeout_ms; servers' request timeouts exceed it
MIN_TOKEN_BYTES = 16  # a tenant token shorter than 128 bits is refused at configuration
MAC_BYTES = 32  # HMAC-SHA256

_ENVELOPE_OVERHEAD_BYTES = 64 + MAX_TENANT_BYTES + MAC_BYTES  # map, field names, ints, heads
assert MAX_FRAME_BYTES < 2**32, "the length header is 4 bytes"
assert MAX_LOOKUP_KEYS * (DIGEST_BYTES + 3) + 1024 + _ENVELOPE_OVERHEAD_BYTES <= MAX_CONTROL_FRAME_BYTES
assert MAX_LOOKUP_KEYS * (MAX_ID_BYTES + 3) + 1024 + _ENVELOPE_OVERHEAD_BYTES <= MAX_CONTROL_FRAME_BYTES
assert MAX_BLOCK_BYTES + 4096 + _ENVELOPE_OVERHEAD_BYTES <= MAX_FRAME_BYTES

# -- vocabulary of codes ------------------------------------------------------------------------------

Code = NewType("Code", str)  # a stable machine-readable word: [a-z][a-z0-9_]*, at most 64 bytes
_CODE_RE = _re.compile(r"[a-z][a-z0-9_]{0,63}")

# Refusal reasons (LeaseRefused, CommitRejected, EvictRefused, ReadRefused, CopyFailed). Servers
# may use others that fit ``Code``; these are the ones the spec's refusals name.
REASON_NOT_COMMITTED = "not_committed"  # no committed generation to lease (ABSENT or WRITING)
REASON_INVALIDATING = "invalidating"  # no new leases while an invalidation runs
REASON_NOT_ABSENT = "not_absent"  # begin_write on a key that has a generation
REASON_PARENT_NOT_COMMITTED = "parent_not_committed"  # prefix chains are written root first
REASON_UNAUTHORIZED = "unauthorized"  # namespace not allowed for this tenant
REASON_UNKNOWN_LEASE = "unknown_lease"  # expired, revoked, released or never granted
REASON_STALE_EPOCH = "stale_epoch"  # a commit under an epoch that is no longer the key's
REASON_LEASE_EXPIRED = "lease_expired"
REASON_LEASED = "leased"  # eviction refused: a live read lease on that location
REASON_HAS_CHILDREN = "has_children"  # eviction refused: leaves before their ancestors
REASON_RESTARTING = "restarting"  # a restarted directory's grace period
REASON_NOT_FOUND = "not_found"
REASON_WRONG_GENERATION = "wrong_generation"

# Invalidate.scope
SCOPE_KEY = "key"  # one key's generation -- and, by the cascade rule, its descendants
SCOPE_PREFIX = "prefix"  # the subtree under the last key of a prefix chain
SCOPE_NAMESPACE = "namespace"  # every key of one namespace
SCOPES = (SCOPE_KEY, SCOPE_PREFIX, SCOPE_NAMESPACE)

# Error.code values sent by the transport itself (PeerViolation codes are also used verbatim).
ERROR_BUSY = "busy"  # too many connections
ERROR_IDLE = "idle"  # closed after the idle timeout
ERROR_TIMEOUT = "timeout"  # the handler did not answer within the request timeout
ERROR_INTERNAL = "internal"  # the handler failed: a bug on the server's side
ERROR_SHUTDOWN = "shutdown"  # the server is closing

# -- messages ----------------------------------------------------------------------------------------
#
# Field order and names follow spec/layout.py's message tuples where the spec has the message.
# ``node`` is the node a request comes from, or the node a reply or directive is addressed to;
# ``location`` names one tier of one node (or the shared pool). Lease terms travel as durations:
# clocks differ, so a holder counts ``term_ms`` from when it *sent* its request and stops trusting
# at ``term_ms - epsilon`` on its own clock (DESIGN: leases); the directory keeps the lease live
# for ``term_ms + epsilon`` on its clock from the grant.


# Read leases: node <-> directory (M_ACQUIRE, M_RENEW, M_GRANT_READ, M_RENEWED, M_RELEASE).
@frozen
class Acquire:
    """Ask for a read lease on ``key``; ``request`` is a fresh number the answer echoes."""

    node: NodeId
    key: BlockKey
    namespace: NamespaceDigest
    request: int


@frozen
class Renew:
    node: NodeId
    key: BlockKey
    lease: LeaseId
    location: LocationId
    request: int


@frozen
class ReadLeaseGranted:
    node: NodeId
    key: BlockKey
    lease: LeaseId
    location: LocationId
    gen: Generation
    epoch: Epoch
    term_ms: int
    request: int


@frozen
class LeaseRenewed:
    node: NodeId
    key: BlockKey
    lease: LeaseId
    term_ms: int
    request: int


@frozen
class LeaseRefused:
    """Answer to Acquire, Renew or BeginWrite: no lease, and why (``REASON_*``)."""

    node: NodeId
    key: BlockKey
    request: int
    reason: Code


@frozen
class Release:
    node: NodeId
    key: BlockKey
    lease: LeaseId


@frozen
class LeaseReleased:
    node: NodeId
    key: BlockKey
    lease: LeaseId


# Writes (M_BEGIN_WRITE, M_GRANT_WRITE, M_WRITE_BYTES, M_COMMIT).
@frozen
class BeginWrite:
    """Ask for the write lease of ``key`` (ABSENT, its ``parent`` COMMITTED, or None at the root)."""

    node: NodeId
    key: BlockKey
    namespace: NamespaceDigest
    parent: BlockKey | None
    request: int


@frozen
class WriteLeaseGranted:
    node: NodeId
    key: BlockKey
    lease: LeaseId
    location: LocationId
    gen: Generation
    epoch: Epoch
    term_ms: int
    request: int


@frozen
class WriteBytes:
    """Writer -> location: the block's bytes, tagged with the epoch the location fences on."""

    node: NodeId
    key: BlockKey
    lease: LeaseId
    location: LocationId
    gen: Generation
    epoch: Epoch
    data: bytes


@frozen
class BytesStored:
    location: LocationId
    key: BlockKey
    gen: Generation
    epoch: Epoch


@frozen
class Commit:
    node: NodeId
    key: BlockKey
    lease: LeaseId
    gen: Generation
    epoch: Epoch


@frozen
class Committed:
    node: NodeId
    key: BlockKey
    lease: LeaseId
    gen: Generation
    epoch: Epoch


@frozen
class CommitRejected:
    node: NodeId
    key: BlockKey
    lease: LeaseId
    reason: Code


# Revocation (M_REVOKE, M_ACK).
@frozen
class Revoke:
    """Directory -> holder: drop your copy and trust in ``lease``, then acknowledge."""

    node: NodeId
    key: BlockKey
    lease: LeaseId
    gen: Generation


@frozen
class RevokeAcked:
    node: NodeId
    key: BlockKey
    lease: LeaseId


# The data plane at a location (M_FREE, M_COPY, M_COPIED) and remote reads.
@frozen
class Free:
    location: LocationId
    key: BlockKey
    epoch: Epoch


@frozen
class Freed:
    location: LocationId
    key: BlockKey
    epoch: Epoch


@frozen
class Copy:
    """Directory -> destination location: copy generation ``gen`` from ``source``, under ``epoch``."""

    location: LocationId
    key: BlockKey
    source: LocationId
    gen: Generation
    epoch: Epoch


@frozen
class Copied:
    location: LocationId
    key: BlockKey
    epoch: Epoch


@frozen
class CopyFailed:
    location: LocationId
    key: BlockKey
    reason: Code


@frozen
class Fenced:
    """A location refused WriteBytes, Free or Copy: ``epoch`` is below its ``fence``."""

    location: LocationId
    key: BlockKey
    epoch: Epoch
    fence: Epoch


@frozen
class ReadBytes:
    """Holder -> location: the bytes of ``gen``, under read lease ``lease``."""

    node: NodeId
    key: BlockKey
    lease: LeaseId
    location: LocationId
    gen: Generation


@frozen
class BytesRead:
    location: LocationId
    key: BlockKey
    gen: Generation
    epoch: Epoch
    data: bytes


@frozen
class ReadRefused:
    node: NodeId
    key: BlockKey
    location: LocationId
    reason: Code


# Client-facing: lookup, invalidation, eviction.
@frozen
class Lookup:
    """Longest cached prefix: ``keys`` are a prompt's chain keys, root first."""

    namespace: NamespaceDigest
    keys: tuple[BlockKey, ...]


@frozen
class PrefixFound:
    """The first ``blocks_matched`` keys are COMMITTED; ``locations[i]`` owns key ``i``."""

    namespace: NamespaceDigest
    blocks_matched: int
    locations: tuple[LocationId, ...]


@frozen
class Invalidate:
    """Void a generation: ``scope`` is ``"key"`` or ``"prefix"`` (with ``key``) or
    ``"namespace"`` (``key`` None). Answered at once by InvalidationStarted."""

    namespace: NamespaceDigest
    scope: Code
    key: BlockKey | None


@frozen
class InvalidationStarted:
    """``keys``: how many keys the invalidation voided (0: nothing was cached under the scope)."""

    ticket: int
    keys: int


@frozen
class WaitTicket:
    """Wait up to ``timeout_ms`` (at most ``MAX_WAIT_TICKET_MS``) for an invalidation."""

    ticket: int
    timeout_ms: int


@frozen
class InvalidationCompleted:
    ticket: int


@frozen
class InvalidationPending:
    ticket: int


@frozen
class Evict:
    """Node -> directory: may I drop my copy of ``key`` at ``location``?"""

    node: NodeId
    key: BlockKey
    location: LocationId


@frozen
class Evicted:
    node: NodeId
    key: BlockKey
    location: LocationId


@frozen
class EvictRefused:
    node: NodeId
    key: BlockKey
    location: LocationId
    reason: Code


# Membership and tiering: node/client <-> directory.
@frozen
class Hello:
    """Node or client -> directory, first on every connection: who is on this connection (the
    directory pushes the directives for ``node`` -- ``Revoke``, ``Free``, ``Copy`` -- on it), its
    ``incarnation`` (higher after every restart), where its data server listens (``address``
    "host:port", "" for a client without one), the ``locations`` it serves and those of them that
    came back empty after a restart (``lost``)."""

    node: NodeId
    incarnation: int
    address: str
    locations: tuple[LocationId, ...]
    lost: tuple[LocationId, ...]


@frozen
class Welcome:
    """Directory -> a node that said Hello. After a restart (a new ``incarnation``) it carries the
    fences the node must restore: for every key owned at (or moving to) one of its locations, the
    key's epoch, which bounds every epoch ever issued for it (``rules.restored_fence``)."""

    node: NodeId
    incarnation: int
    fence_keys: tuple[BlockKey, ...]
    fence_epochs: tuple[int, ...]


@frozen
class ListNodes:
    nonce: int


@frozen
class NodeList:
    """The nodes that said Hello with a data address, and those addresses ("host:port")."""

    nodes: tuple[NodeId, ...]
    addresses: tuple[NodeId, ...]


@frozen
class Transfer:
    """Node -> directory: move the owner copy of ``key`` to ``destination`` (promotion or
    demotion between tiers: an ownership transfer under ``epoch + 1``)."""

    node: NodeId
    key: BlockKey
    destination: LocationId


@frozen
class TransferStarted:
    key: BlockKey
    destination: LocationId
    epoch: Epoch


@frozen
class TransferRefused:
    key: BlockKey
    destination: LocationId
    reason: Code


@frozen
class Noted:
    """The directory took a one-way message (``RevokeAcked``, ``Copied``, ``Freed``): the
    transport answers every request, and this answer says only that it arrived."""

    what: Code


# Generic.
@frozen
class Error:
    """Something failed. As a reply (``re`` > 0) it answers one request; with ``re == 0`` it is
    final: the sender closes the connection after it."""

    code: Code
    text: str


@frozen
class Ping:
    nonce: int


@frozen
class Pong:
    nonce: int


_ALL = (
    Acquire, Renew, ReadLeaseGranted, LeaseRenewed, LeaseRefused, Release, LeaseReleased,
    BeginWrite, WriteLeaseGranted, WriteBytes, BytesStored, Commit, Committed, CommitRejected,
    Revoke, RevokeAcked,
    Free, Freed, Copy, Copied, CopyFailed, Fenced, ReadBytes, BytesRead, ReadRefused,
    Lookup, PrefixFound, Invalidate, InvalidationStarted, WaitTicket, InvalidationCompleted,
    InvalidationPending, Evict, Evicted, EvictRefused,
    Hello, Welcome, ListNodes, NodeList, Transfer, TransferStarted, TransferRefused, Noted,
    Error, Ping, Pong,
)  # fmt: skip

Message = Union[_ALL]  # type: ignore[valid-type]
MESSAGE_TYPES: dict[str, type] = {cls.__name__: cls for cls in _ALL}
# The messages the spec models (spec/layout.py MESSAGE_NAMES), by the same names.
SPEC_MESSAGES = (
    "Acquire", "Renew", "ReadLeaseGranted", "LeaseRenewed", "Release", "BeginWrite",
    "WriteLeaseGranted", "WriteBytes", "Commit", "Revoke", "RevokeAcked", "Free", "Copy", "Copied",
    "LeaseRefused", "Freed",
)  # fmt: skip
assert set(SPEC_MESSAGES) <= set(MESSAGE_TYPES)


def kind_of(msg: Any) -> str:
    """The wire kind name of a message (its class name); ``ProtocolViolation`` for a non-message."""
    name = type(msg).__name__
    if MESSAGE_TYPES.get(name) is not type(msg):
        raise ProtocolViolation(f"not a wire message: {type(msg).__name__}")
    return name


# -- field codecs ----------------------------------------------------------------------------------
#
# Each wire type: check(python value) -> problem or None; to_wire(value) -> CBOR-able;
# from_wire(decoded CBOR) -> python value, or raises ValueError with the problem.


def _check_uint(v: Any) -> str | None:
    if type(v) is not int:
        return f"expected an int, got {type(v).__name__}"
    if not 0 <= v <= MAX_WIRE_INT:
        return f"{v} outside 0..2**63-1"
    return None


def _text_checker(min_bytes: int, max_bytes: int) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if type(v) is not str:
            return f"expected text, got {type(v).__name__}"
        try:
            n = len(v.encode("utf-8"))
        except UnicodeEncodeError:
            return "text is not valid Unicode"
        if not min_bytes <= n <= max_bytes:
            return f"text of {n} bytes outside {min_bytes}..{max_bytes}"
        return None

    return check


_check_id = _text_checker(1, MAX_ID_BYTES)
_check_text = _text_checker(0, MAX_TEXT_BYTES)


def _check_code(v: Any) -> str | None:
    if type(v) is not str:
        return f"expected a code, got {type(v).__name__}"
    if not _CODE_RE.fullmatch(v):
        return f"{v[:80]!r} is not a code ([a-z][a-z0-9_]*, at most {MAX_CODE_BYTES} bytes)"
    return None


def _check_data(v: Any) -> str | None:
    if type(v) is not bytes:
        return f"expected bytes, got {type(v).__name__}"
    if len(v) > MAX_BLOCK_BYTES:
        return f"{len(v)} bytes of data, more than {MAX_BLOCK_BYTES}"
    return None


def _check_digest(v: Any) -> str | None:
    if type(v) is not bytes or len(v) != DIGEST_BYTES:
        return f"expected a {DIGEST_BYTES}-byte digest"
    return None


def _check_key(v: Any) -> str | None:
    return None if type(v) is BlockKey else f"expected a BlockKey, got {type(v).__name__}"


def _check_opt_key(v: Any) -> str | None:
    return None if v is None else _check_key(v)


def _tuple_checker(item: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if type(v) is not tuple:
            return f"expected a tuple, got {type(v).__name__}"
        if len(v) > MAX_LOOKUP_KEYS:
            return f"{len(v)} items, more than {MAX_LOOKUP_KEYS}"
        for i, x in enumerate(v):
            problem = item(x)
            if problem:
                return f"item {i}: {problem}"
        return None

    return check


def _key_from_wire(v: Any) -> BlockKey:
    if type(v) is not bytes or len(v) != DIGEST_BYTES:
        raise ValueError(f"expected a {DIGEST_BYTES}-byte key digest")
    return BlockKey(v)


def _plain(check: Callable[[Any], str | None]) -> tuple:
    def from_wire(v: Any) -> Any:
        problem = check(v)
        if problem:
            raise ValueError(problem)
        return v

    return (check, lambda v: v, from_wire)


def _keys_from_wire(v: Any) -> tuple[BlockKey, ...]:
    if type(v) is not list or len(v) > MAX_LOOKUP_KEYS:
        raise ValueError(f"expected an array of at most {MAX_LOOKUP_KEYS} keys")
    return tuple(_key_from_wire(x) for x in v)


def _ids_from_wire(v: Any) -> tuple[str, ...]:
    if type(v) is not list:
        raise ValueError("expected an array of ids")
    t = tuple(v)
    problem = _tuple_checker(_check_id)(t)
    if problem:
        raise ValueError(problem)
    return t


def _uints_from_wire(v: Any) -> tuple[int, ...]:
    if type(v) is not list:
        raise ValueError("expected an array of ints")
    t = tuple(v)
    problem = _tuple_checker(_check_uint)(t)
    if problem:
        raise ValueError(problem)
    return t


# annotation text -> (check, to_wire, from_wire)
_WIRE_TYPES: dict[str, tuple] = {
    "int": _plain(_check_uint),
    "Generation": _plain(_check_uint),
    "Epoch": _plain(_check_uint),
    "LeaseId": _plain(_check_uint),
    "NodeId": _plain(_check_id),
    "LocationId": _plain(_check_id),
    "Code": _plain(_check_code),
    "str": _plain(_check_text),
    "bytes": _plain(_check_data),
    "NamespaceDigest": _plain(_check_digest),
    "BlockKey": (_check_key, lambda v: v.digest, _key_from_wire),
    "BlockKey | None": (
        _check_opt_key,
        lambda v: None if v is None else v.digest,
        lambda v: None if v is None else _key_from_wire(v),
    ),
    "tuple[BlockKey, ...]": (_tuple_checker(_check_key), lambda v: [k.digest for k in v], _keys_from_wire),
    "tuple[LocationId, ...]": (_tuple_checker(_check_id), list, _ids_from_wire),
    "tuple[NodeId, ...]": (_tuple_checker(_check_id), list, _ids_from_wire),
    "tuple[int, ...]": (_tuple_checker(_check_uint), list, _uints_from_wire),
}


def _cross_field_problem(msg: Any) -> str | None:
    """Rules that tie fields of one message together."""
    if type(msg) is Invalidate:
        if msg.scope not in SCOPES:
            return f"scope {msg.scope!r} is not one of {SCOPES}"
        if (msg.key is None) != (msg.scope == SCOPE_NAMESPACE):
            return "a key or prefix invalidation names a key; a namespace invalidation does not"
    elif type(msg) is PrefixFound:
        if len(msg.locations) != msg.blocks_matched:
            return f"{len(msg.locations)} locations for {msg.blocks_matched} matched blocks"
    elif type(msg) is Welcome:
        if len(msg.fence_keys) != len(msg.fence_epochs):
            return f"{len(msg.fence_keys)} fence keys for {len(msg.fence_epochs)} epochs"
    elif type(msg) is NodeList:
        if len(msg.nodes) != len(msg.addresses):
            return f"{len(msg.nodes)} nodes for {len(msg.addresses)} addresses"
    elif type(msg) is WaitTicket:
        if msg.timeout_ms > MAX_WAIT_TICKET_MS:
            return f"timeout_ms {msg.timeout_ms} above {MAX_WAIT_TICKET_MS}"
    return None


# Per class: ((field name, check, to_wire, from_wire), ...), from the annotations (asserted here).
_SCHEMA: dict[type, tuple[tuple[str, Callable, Callable, Callable], ...]] = {}
for _cls in _ALL:
    _fields = []
    for _a in attrs.fields(_cls):
        assert _a.type in _WIRE_TYPES, f"{_cls.__name__}.{_a.name}: no wire type for {_a.type!r}"
        assert _a.name != "kind"
        _fields.append((_a.name, *_WIRE_TYPES[_a.type]))
    assert len(_fields) + 1 <= MAX_MESSAGE_FIELDS
    _SCHEMA[_cls] = tuple(_fields)
del _cls, _fields, _a


def check_message(msg: Any) -> None:
    """Raise ``ProtocolViolation`` unless ``msg`` is a valid message (every field in range)."""
    kind = kind_of(msg)
    for name, check, _, _ in _SCHEMA[type(msg)]:
        problem = check(getattr(msg, name))
        if problem:
            raise ProtocolViolation(f"{kind}.{name}: {problem}")
    problem = _cross_field_problem(msg)
    if problem:
        raise ProtocolViolation(f"{kind}: {problem}")


# -- the codec's fast paths -------------------------------------------------------------------------
#
# Every frame is a flat map (the envelope) holding a flat map (the message): the generic canonical
# codec of ``kvcc.spec.keys`` is exact but walks them item by item. These produce the same bytes
# and the same values for what they take, and hand anything else to the generic codec, which then
# decides (tests compare the two on valid, mutated and random input).
#
# Encoding: a message's map keys are fixed per class, so their canonical order (by their
# encodings) is computed once: a plan of (encoded key, field name or None for "kind", to_wire).
_ENCODE_PLANS: dict[type, tuple[bytes, tuple[tuple[bytes, str | None, Any], ...]]] = {}
for _message_cls, _schema in _SCHEMA.items():
    _plan: list[tuple[bytes, str | None, Any]] = [(cbor_encode("kind"), None, cbor_encode(_message_cls.__name__))]
    _plan += [(cbor_encode(_name), _name, _to_wire) for _name, _, _to_wire, _ in _schema]
    _plan.sort(key=lambda e: e[0])
    assert len({e[0] for e in _plan}) == len(_plan)
    _ENCODE_PLANS[_message_cls] = (cbor_head(5, len(_plan)), tuple(_plan))
del _message_cls, _schema, _plan


def _value_cbor(v: Any) -> bytes:
    """``cbor_encode(v)``, with the scalar cases a message field holds done inline."""
    t = type(v)
    if t is int and 0 <= v <= MAX_WIRE_INT:
        return cbor_head(0, v)
    if t is bytes:
        return cbor_head(2, len(v)) + v
    if t is str and v.isascii():
        return cbor_head(3, len(v)) + v.encode("ascii")
    if v is None:
        return b"\xf6"
    return cbor_encode(v)


def encode(msg: Any) -> bytes:
    """Canonical CBOR of ``{"kind": ..., fields...}``. An invalid message is our bug:
    ``ProtocolViolation``."""
    check_message(msg)
    head, plan = _ENCODE_PLANS[type(msg)]
    parts = [head]
    for key, name, to_wire in plan:
        parts.append(key)
        parts.append(to_wire if name is None else _value_cbor(to_wire(getattr(msg, name))))
    return b"".join(parts)


_WIDTHS = {24: (1, 24), 25: (2, 0x100), 26: (4, 0x10000), 27: (8, 0x100000000)}  # shortest forms only


def _flat_scalar(data: bytes, i: int, end: int, arrays: bool) -> tuple[Any, int]:
    """One value at ``i``: an unsigned int, a byte or text string, null, true, false -- or, with
    ``arrays``, an array of those. ``(None, -1)`` for anything else (the generic decoder decides)."""
    if i >= end:
        return None, -1
    ib = data[i]
    major, ai = ib >> 5, ib & 0x1F
    if major == 7:
        return (False, i + 1) if ai == 20 else (True, i + 1) if ai == 21 else (None, i + 1 if ai == 22 else -1)
    if ai < 24:
        arg, j = ai, i + 1
    elif ai <= 27:
        width, smallest = _WIDTHS[ai]
        j = i + 1 + width
        if j > end:
            return None, -1
        arg = int.from_bytes(data[i + 1 : j], "big")
        if arg < smallest:
            return None, -1
    else:
        return None, -1
    if major == 0:
        return arg, j
    if major == 2 or major == 3:
        if arg > MAX_BLOCK_BYTES or j + arg > end:
            return None, -1
        raw = data[j : j + arg]
        if major == 2:
            return raw, j + arg
        try:
            return raw.decode("utf-8"), j + arg
        except UnicodeDecodeError:
            return None, -1
    if major == 4 and arrays and arg <= MAX_LOOKUP_KEYS and arg <= end - j:
        items = []
        for _ in range(arg):
            value, j = _flat_scalar(data, j, end, False)
            if j < 0:
                return None, -1
            items.append(value)
        return items, j
    return None, -1


def _flat_map(data: bytes, max_entries: int, arrays: bool) -> dict[str, Any] | None:
    """``cbor_decode(data)`` of a canonical map with short text keys and ``_flat_scalar`` values
    (at most ``max_entries``), or ``None``: not that shape, the generic decoder decides."""
    end = len(data)
    if not end or data[0] >> 5 != 5 or (data[0] & 0x1F) > min(23, max_entries):
        return None
    out: dict[str, Any] = {}
    previous = b""
    i = 1
    for _ in range(data[0] & 0x1F):
        if i >= end or data[i] >> 5 != 3 or (data[i] & 0x1F) >= 24:
            return None
        k_end = i + 1 + (data[i] & 0x1F)
        encoded_key = data[i:k_end]
        if k_end > end or encoded_key <= previous:  # canonical: strictly ascending encoded keys
            return None
        previous = encoded_key
        try:
            key = data[i + 1 : k_end].decode("utf-8")
        except UnicodeDecodeError:
            return None
        value, i = _flat_scalar(data, k_end, end, arrays)
        if i < 0:
            return None
        out[key] = value
    return out if i == end else None


def decode(data: bytes) -> Any:
    """The message encoded in ``data``; anything else raises ``Malformed`` (and only that)."""
    body = _flat_map(data, MAX_MESSAGE_FIELDS, True) if type(data) is bytes else None
    if body is None:
        try:
            body = cbor_decode(data, max_depth=2, max_items=MAX_LOOKUP_KEYS, max_string_bytes=MAX_BLOCK_BYTES)
        except CborError as e:
            raise Malformed(f"message body: {e}") from None
    if type(body) is not dict:
        raise Malformed("message body is not a map")
    kind = body.get("kind")
    if type(kind) is not str:
        raise Malformed("message body has no text 'kind'")
    cls = MESSAGE_TYPES.get(kind)
    if cls is None:
        raise Malformed(f"unknown message kind {kind[:80]!r}", kind=kind[:80])
    schema = _SCHEMA[cls]
    if len(body) != len(schema) + 1:
        expected = {"kind", *(f[0] for f in schema)}
        missing = sorted(expected - set(body))
        extra = sorted(repr(k)[:40] for k in set(body) - expected)
        raise Malformed(f"{kind}: missing fields {missing}, extra fields {extra}")
    values = {}
    for name, _, _, from_wire in schema:
        if name not in body:
            raise Malformed(f"{kind}: missing field {name!r}")
        try:
            values[name] = from_wire(body[name])
        except ValueError as e:
            raise Malformed(f"{kind}.{name}: {e}") from None
    msg = cls(**values)
    problem = _cross_field_problem(msg)
    if problem:
        raise Malformed(f"{kind}: {problem}")
    return msg


# -- frames --------------------------------------------------------------------------------------------

_LENGTH = struct.Struct(">I")


def encode_frame(payload: bytes, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """``[4-byte big-endian length][payload]``; a payload over the limit is our bug."""
    if not 0 < len(payload) <= max_frame_bytes:
        raise ProtocolViolation(f"frame payload of {len(payload)} bytes outside 1..{max_frame_bytes}")
    return _LENGTH.pack(len(payload)) + payload


class FrameDecoder:
    """Whole frame payloads out of bytes in any chunking. Holds at most one partial frame, and
    never more than ``max_frame_bytes`` of it: an oversized length header raises
    ``FrameTooLarge`` as soon as its 4 bytes are in, before the frame's payload is accumulated
    (at most the chunk that carried the header is ever held).

    ``add(data)`` then ``next_frame()`` until it returns None: frames come out one at a time, so a
    violation is reported where it is in the stream (``Session`` uses this). ``feed(data)`` does
    both and returns every whole frame, raising at the first violation."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        assert 0 < max_frame_bytes < 2**32
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self._pos = 0  # start of the unread part of _buffer
        self._failure: PeerViolation | None = None

    @property
    def buffered_bytes(self) -> int:
        return len(self._buffer) - self._pos

    def add(self, data: bytes) -> None:
        if self._failure is not None:
            raise self._failure
        self._buffer += data

    def next_frame(self) -> bytes | None:
        if self._failure is not None:
            raise self._failure
        buf, pos = self._buffer, self._pos
        if len(buf) - pos < FRAME_HEADER_BYTES:
            self._compact()
            return None
        (length,) = _LENGTH.unpack_from(buf, pos)
        if length > self.max_frame_bytes:
            self._fail(FrameTooLarge(
                f"frame of {length} bytes announced, the limit is {self.max_frame_bytes}",
                length_bytes=length, limit_bytes=self.max_frame_bytes,
            ))  # fmt: skip
        if length == 0:
            self._fail(Malformed("empty frame"))
        start = pos + FRAME_HEADER_BYTES
        if len(buf) - start < length:
            self._compact()
            return None
        self._pos = start + length
        return bytes(buf[start : start + length])

    def feed(self, data: bytes) -> list[bytes]:
        self.add(data)
        frames = []
        while (frame := self.next_frame()) is not None:
            frames.append(frame)
        return frames

    def _compact(self) -> None:
        if self._pos:
            del self._buffer[: self._pos]
            self._pos = 0

    def _fail(self, violation: PeerViolation) -> None:
        self._failure = violation
        self._buffer = bytearray()  # nothing more of this connection is kept
        self._pos = 0
        raise violation


# -- tenants --------------------------------------------------------------------------------------------


def _tenant_problem(name: Any) -> str | None:
    if type(name) is not str or not name:
        return "a tenant name is non-empty text"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_TENANT_BYTES:
        return f"tenant name longer than {MAX_TENANT_BYTES} bytes"
    return None


def _tokens(value: Mapping[str, bytes]) -> dict[str, bytes]:
    out = {}
    for tenant, token in dict(value).items():
        problem = _tenant_problem(tenant)
        if problem:
            raise ValueError(problem)
        if type(token) is not bytes or len(token) < MIN_TOKEN_BYTES:
            raise ValueError(f"tenant {tenant!r}: a token is at least {MIN_TOKEN_BYTES} bytes")
        out[tenant] = token
    return out


def _namespaces(value: Mapping[str, Any]) -> dict[str, frozenset[bytes]]:
    out = {}
    for tenant, digests in dict(value).items():
        ds = frozenset(digests)
        if any(_check_digest(d) for d in ds):
            raise ValueError(f"tenant {tenant!r}: namespace digests are {DIGEST_BYTES} bytes")
        out[tenant] = ds
    return out


@frozen(eq=False)
class Tenants:
    """Who may connect (``tokens``: tenant -> shared secret, at least ``MIN_TOKEN_BYTES``) and
    which namespaces each may use (``namespaces``: tenant -> namespace digests; a tenant absent
    from it may use none)."""

    tokens: Mapping[str, bytes] = field(converter=_tokens)
    namespaces: Mapping[str, frozenset[bytes]] = field(factory=dict, converter=_namespaces)
    # Tenants that act on every namespace: the cache nodes' own identity (a node evicts and
    # demotes whatever it stores). Never give it to an engine.
    operators: frozenset[str] = field(default=frozenset(), converter=frozenset)

    def token(self, tenant: str) -> bytes | None:
        return self.tokens.get(tenant)

    def allows(self, tenant: str, namespace_digest: bytes) -> bool:
        return tenant in self.operators or namespace_digest in self.namespaces.get(tenant, frozenset())

    def authorize(self, tenant: str, namespace_digest: bytes) -> None:
        """Raise ``Unauthorized`` unless ``tenant`` may use the namespace (DESIGN property 11)."""
        if not self.allows(tenant, namespace_digest):
            raise Unauthorized(
                f"tenant {tenant[:80]!r} may not use namespace {bytes(namespace_digest).hex()[:16]}…",
                tenant=tenant[:80],
            )

    def authorize_message(self, tenant: str, msg: Any) -> None:
        """``authorize`` the namespace a message names, if it names one."""
        ns = getattr(msg, "namespace", None)
        if ns is not None:
            self.authorize(tenant, ns)


# -- sessions --------------------------------------------------------------------------------------------


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


_DIRECTION = {Role.CLIENT: "c2s", Role.SERVER: "s2c"}  # the direction a role *sends* in
_PEER = {Role.CLIENT: Role.SERVER, Role.SERVER: Role.CLIENT}
_ENVELOPE_FIELDS = frozenset({"tenant", "seq", "re", "mac", "body"})


def frame_mac(token: bytes, direction: str, tenant: str, seq: int, re: int, body: bytes) -> bytes:
    """HMAC-SHA256(token, canonical CBOR [direction, tenant, seq, re, body]), streamed so that a
    64 MiB body is not copied to compute it."""
    return _MacKey(token).mac(direction, tenant, seq, re, body)


class _MacKey:
    """One token's HMAC state, keyed once and copied per frame (cheaper than re-keying; cheaper
    than ``hmac.digest``'s one-shot too, measured). The CBOR head of ``[direction, tenant`` is the
    same for every frame of a session and is kept."""

    __slots__ = ("_base", "_prefixes")

    def __init__(self, token: bytes) -> None:
        self._base = hmac.new(token, digestmod=hashlib.sha256)
        self._prefixes: dict[tuple[str, str], bytes] = {}

    def mac(self, direction: str, tenant: str, seq: int, re: int, body: bytes) -> bytes:
        prefix = self._prefixes.get((direction, tenant))
        if prefix is None:
            prefix = b"\x85" + cbor_encode(direction) + cbor_encode(tenant)
            if len(self._prefixes) < 4:  # a session MACs one tenant in two directions
                self._prefixes[(direction, tenant)] = prefix
        h = self._base.copy()
        h.update(b"".join((prefix, cbor_head(0, seq), cbor_head(0, re), cbor_head(2, len(body)))))
        h.update(body)  # streamed: a 64 MiB body is not copied
        return h.digest()


# The envelope's keys in canonical order (sorted by their encodings: shorter first, then bytewise).
_ENV_RE, _ENV_MAC, _ENV_SEQ, _ENV_BODY, _ENV_TENANT = (cbor_encode(k) for k in ("re", "mac", "seq", "body", "tenant"))
assert [_ENV_RE, _ENV_MAC, _ENV_SEQ, _ENV_BODY, _ENV_TENANT] == sorted([_ENV_RE, _ENV_MAC, _ENV_SEQ, _ENV_BODY, _ENV_TENANT])


def encode_envelope(tenant: str, seq: int, re: int, mac: bytes, body: bytes) -> bytes:
    """Canonical CBOR of ``{"tenant", "seq", "re", "mac", "body"}``, built directly (one copy
    of the body); equal to ``cbor_encode`` of that map (tested)."""
    return b"".join((
        b"\xa5",
        _ENV_RE, cbor_head(0, re),
        _ENV_MAC, cbor_head(2, len(mac)), mac,
        _ENV_SEQ, cbor_head(0, seq),
        _ENV_BODY, cbor_head(2, len(body)), body,
        _ENV_TENANT, _tenant_cbor(tenant),
    ))  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _tenant_cbor(tenant: str) -> bytes:
    """``cbor_encode(tenant)``: the same few names on every frame."""
    return cbor_encode(tenant)


@frozen
class Received:
    """One message off the wire, with its envelope: ``seq`` (reply to it with ``re=seq``), ``re``
    (the seq of our frame it answers, 0 for none), and whether it was authenticated (only a
    final unauthenticated ``Error`` is ever yielded with ``authenticated=False``)."""

    msg: Any
    seq: int
    re: int
    tenant: str
    authenticated: bool = True

    @property
    def final(self) -> bool:
        """A final Error: the peer closes the connection after it."""
        return self.re == 0 and type(self.msg) is Error


class Session:
    """One connection's protocol state, both directions, without I/O.

    - ``Session.client(tenant, token)`` / ``Session.server(tenants)``;
    - ``send(msg, re=0) -> bytes``: the frame to write; ``re`` is the ``seq`` of the received
      frame this answers. Raises ``ProtocolViolation`` for an invalid message, a reply to a frame
      never received, a server send before any client frame authenticated, any send after a
      final Error was sent, or after the session failed;
    - ``send_error(code, text) -> bytes``: a final ``Error`` frame (``re = 0``), allowed in any
      state, unauthenticated when no tenant is known yet; nothing may be sent after it;
    - ``receive_data(data) -> list[Received]``: raises ``PeerViolation`` subclasses only; the
      first one closes the session (``failure``) and every later call raises it again.

    State worth reading: ``tenant`` (None on a server until a frame authenticated),
    ``last_sent_seq`` (the seq of the frame ``send`` just returned: a client files its request
    under it and matches the reply's ``re``), ``last_received_seq``, ``failure``,
    ``peer_closed`` (the peer's final Error arrived), ``sent_final``.
    """

    def __init__(
        self,
        role: Role,
        *,
        tenant: str | None = None,
        token: bytes | None = None,
        tenants: Tenants | Mapping[str, bytes] | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        self.role = role
        self.max_frame_bytes = max_frame_bytes
        self._frames = FrameDecoder(max_frame_bytes)
        if role is Role.CLIENT:
            assert tenant is not None and token is not None, "a client session has a tenant and a token"
            problem = _tenant_problem(tenant)
            if problem:
                raise ValueError(problem)
            if type(token) is not bytes or len(token) < MIN_TOKEN_BYTES:
                raise ValueError(f"a token is at least {MIN_TOKEN_BYTES} bytes")
            self.tenants = Tenants({tenant: token})
            self.tenant: str | None = tenant
        else:
            assert tenants is not None, "a server session has its tenants"
            self.tenants = tenants if isinstance(tenants, Tenants) else Tenants(tenants)
            self.tenant = None  # learned from the first authenticated frame
        self.last_sent_seq = 0
        self.last_received_seq = 0
        self.failure: PeerViolation | None = None
        self.peer_closed = False  # the peer sent its final Error
        self.sent_final = False  # we sent our final Error
        self._mac_tenant: str | None = None
        self._mac_cache: _MacKey | None = None

    @classmethod
    def client(cls, tenant: str, token: bytes, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> Session:
        return cls(Role.CLIENT, tenant=tenant, token=token, max_frame_bytes=max_frame_bytes)

    @classmethod
    def server(cls, tenants: Tenants | Mapping[str, bytes], *, max_frame_bytes: int = MAX_FRAME_BYTES) -> Session:
        return cls(Role.SERVER, tenants=tenants, max_frame_bytes=max_frame_bytes)

    # -- sending -------------------------------------------------------------------------------

    def send(self, msg: Any, *, re: int = 0) -> bytes:
        if self.failure is not None:
            raise ProtocolViolation(f"send on a failed session ({self.failure.code})")
        if self.sent_final:
            raise ProtocolViolation("send after our final Error")
        if self.tenant is None:
            raise ProtocolViolation("no authenticated tenant yet: a server answers, it does not speak first")
        if type(re) is not int or not 0 <= re <= self.last_received_seq:
            raise ProtocolViolation(f"re={re!r} names no frame received (last {self.last_received_seq})")
        if type(msg) is Error and re == 0:
            raise ProtocolViolation("a final Error goes through send_error")
        return self._seal(encode(msg), re, authenticated=True)

    def send_error(self, code: str, text: str = "") -> bytes:
        """A final Error frame. Text is cut to fit ``MAX_TEXT_BYTES``."""
        if self.sent_final:
            raise ProtocolViolation("a second final Error")
        text = text.encode("utf-8", "replace")[: MAX_TEXT_BYTES].decode("utf-8", "ignore")
        body = encode(Error(code, text))
        self.sent_final = True
        return self._seal(body, 0, authenticated=self.tenant is not None)

    def _seal(self, body: bytes, re: int, *, authenticated: bool) -> bytes:
        self.last_sent_seq += 1
        seq = self.last_sent_seq
        if authenticated:
            assert self.tenant is not None
            tenant = self.tenant
            mac = self._mac_key(tenant).mac(_DIRECTION[self.role], tenant, seq, re, body)
        else:
            tenant, mac = "", b""
        return encode_frame(encode_envelope(tenant, seq, re, mac, body), self.max_frame_bytes)

    def _mac_key(self, tenant: str) -> _MacKey:
        if self._mac_tenant != tenant:
            token = self.tenants.token(tenant)
            assert token is not None
            self._mac_cache = _MacKey(token)
            self._mac_tenant = tenant
        assert self._mac_cache is not None
        return self._mac_cache

    # -- receiving -----------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> list[Received]:
        if self.failure is not None:
            raise self.failure
        try:
            self._frames.add(data)
            out = []
            while (payload := self._frames.next_frame()) is not None:
                if self.peer_closed:
                    raise Malformed("a frame after the peer's final Error")
                out.append(self._open(payload))
            return out
        except PeerViolation as violation:
            self.failure = violation
            raise

    def _open(self, payload: bytes) -> Received:
        env = _flat_map(payload, len(_ENVELOPE_FIELDS), False) if type(payload) is bytes else None
        if env is None:
            try:
                env = cbor_decode(payload, max_depth=1, max_items=len(_ENVELOPE_FIELDS), max_string_bytes=len(payload))
            except CborError as e:
                raise Malformed(f"envelope: {e}") from None
        if type(env) is not dict or env.keys() != _ENVELOPE_FIELDS:
            raise Malformed(f"an envelope is a map of exactly {sorted(_ENVELOPE_FIELDS)}")
        tenant, seq, re, mac, body = env["tenant"], env["seq"], env["re"], env["mac"], env["body"]
        if type(tenant) is not str or type(mac) is not bytes or type(body) is not bytes:
            raise Malformed("envelope field of the wrong type")
        if type(seq) is not int or type(re) is not int or not 0 < seq <= MAX_WIRE_INT or not 0 <= re <= MAX_WIRE_INT:
            raise Malformed("envelope seq and re are ints, seq from 1")

        if tenant == "" and mac == b"":
            return self._open_unauthenticated(seq, re, body)

        token = self.tenants.token(tenant)
        if token is None:
            raise Unauthorized(f"unknown tenant {tenant[:80]!r}")
        if self.tenant is not None and tenant != self.tenant:
            raise Unauthorized(f"tenant {tenant[:80]!r} on a connection of tenant {self.tenant!r}")
        expected = self._mac_key(tenant).mac(_DIRECTION[_PEER[self.role]], tenant, seq, re, body)
        if not hmac.compare_digest(expected, mac):
            raise Unauthorized(f"bad MAC on frame {seq} of tenant {tenant[:80]!r}")
        if self.tenant is None:
            self.tenant = tenant
        if seq != self.last_received_seq + 1:
            raise Replayed(f"frame {seq} after frame {self.last_received_seq}", seq=seq, last_seq=self.last_received_seq)
        if re > self.last_sent_seq:
            raise Malformed(f"frame {seq} answers frame {re}, which was never sent")
        msg = decode(body)
        self.last_received_seq = seq
        if re == 0 and type(msg) is Error:
            self.peer_closed = True
        return Received(msg, seq, re, tenant, True)

    def _open_unauthenticated(self, seq: int, re: int, body: bytes) -> Received:
        if self.role is Role.SERVER:
            raise Unauthorized("unauthenticated frame")
        if re != 0:
            raise Unauthorized("an unauthenticated frame other than a final Error")
        msg = decode(body)
        if type(msg) is not Error:
            raise Unauthorized(f"unauthenticated {type(msg).__name__}")
        self.peer_closed = True
        return Received(msg, seq, 0, "", False)
