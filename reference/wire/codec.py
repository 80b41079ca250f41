"""The message codec: canonical CBOR of a message and back, checked field by field. No I/O.

``encode(msg)`` is the canonical CBOR of ``{"kind": <class name>, <field>: <value>, ...}``
(``kvcc.spec.keys.cbor_encode``); block keys travel as their 32-byte digests. ``decode(body)``
accepts exactly what ``encode`` produces: unknown kind, missing or extra field, wrong type or a
value out of range raises ``Malformed``, and nothing else. Each field's wire type follows from its
annotation (``WIRE_TYPES``), checked at import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import attrs

from kvcc.spec.keys import DIGEST_BYTES, BlockKey, CborError, cbor_decode, cbor_encode, cbor_head
from kvcc.spec.vocabulary import SCOPE_NAMESPACE, SCOPES

from ..errors import Malformed, ProtocolViolation
from .limits import (
    MAX_BATCH_ITEMS,
    MAX_BLOCK_BYTES,
    MAX_CODE_BYTES,
    MAX_ID_BYTES,
    MAX_LOOKUP_KEYS,
    MAX_MESSAGE_FIELDS,
    MAX_TEXT_BYTES,
    MAX_WAIT_TICKET_MS,
    MAX_WIRE_INT,
)
from .messages import (
    CODE_RE,
    MESSAGE_TYPES,
    Batch,
    Batched,
    Invalidate,
    NodeList,
    Located,
    PrefixFound,
    WaitTicket,
    Welcome,
    kind_of,
)

# -- field codecs ----------------------------------------------------------------------------------


class WireType(NamedTuple):
    """How one annotation travels: ``check(python value)`` -> problem or None; ``to_wire(value)``
    -> CBOR-able; ``from_wire(decoded CBOR)`` -> python value, or raises ValueError with the
    problem."""

    check: Callable[[Any], str | None]
    to_wire: Callable[[Any], Any]
    from_wire: Callable[[Any], Any]


class FieldCodec(NamedTuple):
    """One field of one message class: its name and its wire type's three functions."""

    name: str
    check: Callable[[Any], str | None]
    to_wire: Callable[[Any], Any]
    from_wire: Callable[[Any], Any]


class PlanEntry(NamedTuple):
    """One map entry of an encoded message, in canonical order: the encoded map key, then either
    the field it holds and that field's ``to_wire`` or, for ``"kind"`` (``field`` None), the
    encoded class name itself."""

    encoded_key: bytes
    field: str | None
    value: Any


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
    if not CODE_RE.fullmatch(v):
        return f"{v[:80]!r} is not a code ([a-z][a-z0-9_]*, at most {MAX_CODE_BYTES} bytes)"
    return None


def _check_data(v: Any) -> str | None:
    if type(v) is not bytes:
        return f"expected bytes, got {type(v).__name__}"
    if len(v) > MAX_BLOCK_BYTES:
        return f"{len(v)} bytes of data, more than {MAX_BLOCK_BYTES}"
    return None


def check_digest(v: Any) -> str | None:
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


def _plain(check: Callable[[Any], str | None]) -> WireType:
    def from_wire(v: Any) -> Any:
        problem = check(v)
        if problem:
            raise ValueError(problem)
        return v

    return WireType(check, lambda v: v, from_wire)


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


def _check_batch_items(v: Any) -> str | None:
    """A Batch's items or a Batched's replies: a tuple of valid messages, none a batch."""
    if type(v) is not tuple:
        return f"expected a tuple, got {type(v).__name__}"
    if len(v) > MAX_BATCH_ITEMS:
        return f"{len(v)} items, more than {MAX_BATCH_ITEMS}"
    for i, m in enumerate(v):
        if type(m) in (Batch, Batched):
            return f"item {i}: a batch inside a batch"
        try:
            check_message(m)
        except ProtocolViolation as e:
            return f"item {i}: {e}"
    return None


def _batch_items_from_wire(v: Any) -> tuple[Any, ...]:
    if type(v) is not list or len(v) > MAX_BATCH_ITEMS:
        raise ValueError(f"expected an array of at most {MAX_BATCH_ITEMS} encoded messages")
    out = []
    for i, body in enumerate(v):
        if type(body) is not bytes:
            raise ValueError(f"item {i}: expected an encoded message")
        try:
            m = decode(body)
        except Malformed as e:
            raise ValueError(f"item {i}: {e}") from None
        if type(m) in (Batch, Batched):
            raise ValueError(f"item {i}: a batch inside a batch")
        out.append(m)
    return tuple(out)


# annotation text -> its wire type
WIRE_TYPES: dict[str, WireType] = {
    "int": _plain(_check_uint),
    "Generation": _plain(_check_uint),
    "Epoch": _plain(_check_uint),
    "LeaseId": _plain(_check_uint),
    "NodeId": _plain(_check_id),
    "LocationId": _plain(_check_id),
    "Code": _plain(_check_code),
    "str": _plain(_check_text),
    "bytes": _plain(_check_data),
    "NamespaceDigest": _plain(check_digest),
    "BlockKey": WireType(_check_key, lambda v: v.digest, _key_from_wire),
    "BlockKey | None": WireType(
        _check_opt_key,
        lambda v: None if v is None else v.digest,
        lambda v: None if v is None else _key_from_wire(v),
    ),
    "tuple[BlockKey, ...]": WireType(_tuple_checker(_check_key), lambda v: [k.digest for k in v], _keys_from_wire),
    "tuple[LocationId, ...]": WireType(_tuple_checker(_check_id), list, _ids_from_wire),
    "tuple[NodeId, ...]": WireType(_tuple_checker(_check_id), list, _ids_from_wire),
    "tuple[int, ...]": WireType(_tuple_checker(_check_uint), list, _uints_from_wire),
    # Each item travels as its own encoded message (a byte string): the frame stays a flat map.
    "tuple[Message, ...]": WireType(_check_batch_items, lambda v: [_encode_checked(m) for m in v], _batch_items_from_wire),
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
    elif type(msg) is Located:
        if any(v > 2 for v in msg.known) or msg.authorized > 1:
            return "known holds 0, 1 or 2 per key, authorized 0 or 1"
        if not msg.authorized and any(msg.known):
            return "a namespace the tenant may not use is told no key"
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
_SCHEMA: dict[type, tuple[FieldCodec, ...]] = {}
for _cls in MESSAGE_TYPES.values():
    _fields = []
    for _a in attrs.fields(_cls):
        assert _a.type in WIRE_TYPES, f"{_cls.__name__}.{_a.name}: no wire type for {_a.type!r}"
        assert _a.name != "kind"
        _fields.append(FieldCodec(_a.name, *WIRE_TYPES[_a.type]))
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
# encodings) is computed once: a plan of ``PlanEntry``.
_ENCODE_PLANS: dict[type, tuple[bytes, tuple[PlanEntry, ...]]] = {}
for _message_cls, _schema in _SCHEMA.items():
    _plan = [PlanEntry(cbor_encode("kind"), None, cbor_encode(_message_cls.__name__))]
    _plan += [PlanEntry(cbor_encode(f.name), f.name, f.to_wire) for f in _schema]
    _plan.sort(key=lambda e: e.encoded_key)
    assert len({e.encoded_key for e in _plan}) == len(_plan)
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
    return _encode_checked(msg)


def _encode_checked(msg: Any) -> bytes:
    """``encode`` of a message ``check_message`` passed (a batch's items: checked with it)."""
    head, plan = _ENCODE_PLANS[type(msg)]
    parts = [head]
    for encoded_key, name, value in plan:
        parts.append(encoded_key)
        parts.append(value if name is None else _value_cbor(value(getattr(msg, name))))
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


def flat_map(data: bytes, max_entries: int, arrays: bool) -> dict[str, Any] | None:
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
    body = flat_map(data, MAX_MESSAGE_FIELDS, True) if type(data) is bytes else None
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
        expected = {"kind", *(f.name for f in schema)}
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
