"""The vocabulary of block identity: namespaces, block keys, and the canonical CBOR they hash.

Theory of operation
-------------------
A *block* is the KV of ``block_tokens`` consecutive tokens of one prompt, computed by one model
in one configuration. Its **key** must change whenever anything that changes those bytes changes,
or two engines would share KV that is not the same (docs/protocol.md: "incomplete key identity → silent
wrong KV"). So a key is a hash chain:

    namespace digest = SHA-256( CBOR {"v": 1, "model_id": ..., "model_revision": ..., "kv_dtype": ...,
                                      "block_tokens": ..., "kv_layout": ..., "tp_rank": ..., "tp_size": ...,
                                      "pp_rank": ..., "pp_size": ..., "adapter": ..., "cache_salt": ...} )
    key(block i)     = SHA-256( CBOR [namespace digest, key(block i-1) or null, [token ids of block i]] )

where CBOR is the *deterministic* encoding of RFC 8949 §4.2.1 (preferred-serialisation integers,
definite lengths, map keys sorted by their encoded bytes). Because that encoding is unique for a
value, **any engine in any language computes the same key for the same prefix**: it needs a SHA-256
and the ~40 lines of CBOR below, nothing else. ``tests/test_keys.py`` pins one golden vector with the
CBOR bytes derived by hand.

This is the shape of vLLM's ``--prefix-caching-hash-algo sha256_cbor`` (SHA-256 over canonical
CBOR of ``(parent, tokens, extra_keys)``), with two deliberate differences: the root's parent is
CBOR ``null`` rather than a magic seed hash, and everything vLLM carries in ``extra_keys`` that is
the same for every block of a request (LoRA, cache salt) lives in the namespace digest instead,
together with what vLLM leaves out of the hash altogether (model revision, KV dtype, layout,
shard). Per-block extra inputs (multimodal content hashes) are not part of this key: an engine
must replace placeholder token ids by content-derived ids before chaining.

The CBOR decoder exists for the wire (``kvcc.reference.wire``): it accepts only what the encoder
produces (canonical, definite, no floats, no tags, no trailing bytes), under explicit limits on
nesting depth, item counts and string lengths, and reports every refusal as ``CborError``. Any
garbage input raises ``CborError`` and nothing else.

``shard_of`` names the shard of a sharded directory that owns a chain: a hash of the chain's
root key, computed the same way everywhere (docs/sharding.md).

Generations, epochs, lease ids, node and location ids are plain ints and strings on the wire; the
``NewType`` names below say which is which in signatures.

Standard library and attrs only: this module is part of the vocabulary every layer imports.
"""

from __future__ import annotations

import hashlib
import operator
import re
import struct
from collections.abc import Sequence
from typing import Any, NewType

from attrs import field, frozen

# -- names for plain values ---------------------------------------------------------------------

Generation = NewType("Generation", int)  # a rewrite of a logical key is a new generation
Epoch = NewType("Epoch", int)  # ownership epoch: the fencing token
LeaseId = NewType("LeaseId", int)  # never reused (protocol property 8)
NodeId = NewType("NodeId", str)
LocationId = NewType("LocationId", str)  # one tier of one node, or the shared pool
NamespaceDigest = NewType("NamespaceDigest", bytes)  # Namespace.digest(): 32 bytes

# -- limits ---------------------------------------------------------------------------------------

DIGEST_BYTES = 32  # SHA-256
CBOR_UINT_LIMIT = 2**64  # exclusive; CBOR's major types 0 and 1 carry 64-bit arguments
CBOR_MAX_DEPTH_DEFAULT = 16  # nested arrays/maps the decoder follows
CBOR_MAX_ITEMS_DEFAULT = 1 << 16  # entries of one array or map
CBOR_MAX_STRING_BYTES_DEFAULT = 64 << 20  # one byte or text string
TOKEN_ID_LIMIT = 2**32  # exclusive; every tokenizer's vocabulary fits
NAMESPACE_TEXT_MAX_BYTES = 256  # model id, revision, dtype, layout, adapter (UTF-8)
CACHE_SALT_MAX_BYTES = 256
BLOCK_TOKENS_MAX = 1 << 16
NAMESPACE_FORMAT_VERSION = 1  # the "v" entry of the namespace map; bump on any change of fields

assert TOKEN_ID_LIMIT <= CBOR_UINT_LIMIT
assert BLOCK_TOKENS_MAX <= CBOR_MAX_ITEMS_DEFAULT


class CborError(ValueError):
    """A value that canonical CBOR cannot carry (encoding), or bytes that are not the canonical
    encoding of a supported value, or that exceed a decoding limit (decoding)."""


# -- canonical CBOR: encoder ----------------------------------------------------------------------

_MAJOR_UINT, _MAJOR_NINT, _MAJOR_BYTES, _MAJOR_TEXT, _MAJOR_ARRAY, _MAJOR_MAP, _MAJOR_TAG, _MAJOR_SIMPLE = range(8)
_FALSE, _TRUE, _NULL = b"\xf4", b"\xf5", b"\xf6"
_SMALL_HEADS = tuple(tuple(bytes(((major << 5) | n,)) for n in range(24)) for major in range(8))


def cbor_head(major: int, argument: int) -> bytes:
    """The initial byte(s) of a data item: major type and argument in the shortest form
    (RFC 8949 §4.2.1, "preferred serialization" of integers and lengths)."""
    if 0 <= argument < 24:
        return _SMALL_HEADS[major][argument]
    assert 0 <= major <= 7
    if not 0 <= argument < CBOR_UINT_LIMIT:
        raise CborError(f"CBOR argument {argument} outside 0..2**64-1")
    mt = major << 5
    if argument < 0x100:
        return bytes((mt | 24, argument))
    if argument < 0x10000:
        return bytes((mt | 25,)) + struct.pack(">H", argument)
    if argument < 0x100000000:
        return bytes((mt | 26,)) + struct.pack(">I", argument)
    return bytes((mt | 27,)) + struct.pack(">Q", argument)


def _encode_into(value: Any, out: bytearray) -> None:
    # Exact-type dispatch first (the common case, and fast); subclasses fall through to the
    # isinstance chain. bool before int: True is an int in Python, a simple value in CBOR.
    t = type(value)
    if t is str:
        try:
            b = value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise CborError(f"text is not valid Unicode: {e}") from None
        out += cbor_head(_MAJOR_TEXT, len(b))
        out += b
    elif t is int:
        out += cbor_head(_MAJOR_UINT, value) if value >= 0 else cbor_head(_MAJOR_NINT, -1 - value)
    elif t is bytes:
        out += cbor_head(_MAJOR_BYTES, len(value))
        out += value
    elif value is None:
        out += _NULL
    elif value is True:
        out += _TRUE
    elif value is False:
        out += _FALSE
    elif isinstance(value, int):
        _encode_into(int(value), out)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        _encode_into(bytes(value), out)
    elif isinstance(value, str):
        _encode_into(str(value), out)
    elif isinstance(value, (list, tuple)):
        out += cbor_head(_MAJOR_ARRAY, len(value))
        for item in value:
            _encode_into(item, out)
    elif isinstance(value, dict):
        entries = []
        for k, v in value.items():
            if k is None or isinstance(k, bool) or not isinstance(k, (int, str, bytes)):
                raise CborError(f"map key of type {type(k).__name__}: only int, str and bytes keys")
            kb = bytearray()
            _encode_into(k, kb)
            entries.append((bytes(kb), v))
        # §4.2.1: keys sorted by the bytewise lexicographic order of their deterministic encodings.
        entries.sort(key=lambda e: e[0])
        for (a, _), (b, _) in zip(entries, entries[1:]):
            if a == b:
                raise CborError("duplicate map key")
        out += cbor_head(_MAJOR_MAP, len(entries))
        for kb, v in entries:
            out += kb
            _encode_into(v, out)
    else:
        raise CborError(f"no canonical CBOR for {type(value).__name__}")


def cbor_encode(value: Any) -> bytes:
    """Deterministic CBOR (RFC 8949 §4.2.1) of None, bool, int (-2**64 .. 2**64-1), bytes, str,
    list/tuple and dict (int, str or bytes keys). The encoding of a value is unique: a dict's
    insertion order does not matter, a tuple and a list encode alike. Raises ``CborError``."""
    out = bytearray()
    _encode_into(value, out)
    return bytes(out)


# -- canonical CBOR: decoder ----------------------------------------------------------------------

# The smallest argument allowed for each additional-information width (shortest form only).
_MIN_FOR_WIDTH = {24: (1, 24), 25: (2, 0x100), 26: (4, 0x10000), 27: (8, 0x100000000)}


class _Decoder:
    __slots__ = ("data", "end", "max_depth", "max_items", "max_string_bytes")

    def __init__(self, data: bytes, max_depth: int, max_items: int, max_string_bytes: int) -> None:
        self.data = data
        self.end = len(data)
        self.max_depth = max_depth
        self.max_items = max_items
        self.max_string_bytes = max_string_bytes

    def head(self, i: int) -> tuple[int, int, int, int]:
        """(major, additional info, argument, next offset); the argument in shortest form."""
        if i >= self.end:
            raise CborError(f"truncated: data item expected at offset {i}")
        ib = self.data[i]
        major, ai = ib >> 5, ib & 0x1F
        if ai < 24:
            return major, ai, ai, i + 1
        if ai > 27:
            # 28-30 are reserved; 31 is an indefinite length (or "break"): never canonical.
            what = "indefinite length" if ai == 31 else "reserved additional information"
            raise CborError(f"{what} at offset {i}")
        if major == _MAJOR_SIMPLE:
            # ai 24: a one-byte simple value; 25-27: floats. Neither is part of this profile.
            raise CborError(f"unsupported simple value or float at offset {i}")
        width, smallest = _MIN_FOR_WIDTH[ai]
        if i + 1 + width > self.end:
            raise CborError(f"truncated argument at offset {i}")
        arg = int.from_bytes(self.data[i + 1 : i + 1 + width], "big")
        if arg < smallest:
            raise CborError(f"non-canonical: argument {arg} not in its shortest form at offset {i}")
        return major, ai, arg, i + 1 + width

    def item(self, i: int, depth: int) -> tuple[Any, int]:
        major, ai, arg, j = self.head(i)
        if major == _MAJOR_UINT:
            return arg, j
        if major == _MAJOR_NINT:
            return -1 - arg, j
        if major in (_MAJOR_BYTES, _MAJOR_TEXT):
            if arg > self.max_string_bytes:
                raise CborError(f"string of {arg} bytes exceeds the limit of {self.max_string_bytes}")
            if j + arg > self.end:
                raise CborError(f"truncated string at offset {i}")
            raw = self.data[j : j + arg]
            if major == _MAJOR_BYTES:
                return raw, j + arg
            try:
                return raw.decode("utf-8"), j + arg
            except UnicodeDecodeError:
                raise CborError(f"text string at offset {i} is not valid UTF-8") from None
        if major == _MAJOR_ARRAY:
            self._check_container(arg, 1, depth, i, j)
            items = []
            for _ in range(arg):
                value, j = self.item(j, depth + 1)
                items.append(value)
            return items, j
        if major == _MAJOR_MAP:
            self._check_container(arg, 2, depth, i, j)
            result: dict = {}
            previous = b""
            for n in range(arg):
                k_start = j
                key, j = self.item(j, depth + 1)
                encoded_key = self.data[k_start:j]
                if n and encoded_key <= previous:
                    raise CborError(f"non-canonical: map keys not in strictly ascending order at offset {k_start}")
                if key is None or isinstance(key, (bool, list, dict)):
                    raise CborError(f"map key of unsupported type at offset {k_start}")
                previous = encoded_key
                value, j = self.item(j, depth + 1)
                result[key] = value
            return result, j
        if major == _MAJOR_TAG:
            raise CborError(f"tags are not supported (tag {arg} at offset {i})")
        # Major 7 with a small argument: 20 false, 21 true, 22 null; anything else is refused.
        if ai == 20:
            return False, j
        if ai == 21:
            return True, j
        if ai == 22:
            return None, j
        raise CborError(f"unsupported simple value {ai} at offset {i}")

    def _check_container(self, count: int, min_bytes_each: int, depth: int, i: int, j: int) -> None:
        if depth >= self.max_depth:
            raise CborError(f"nesting deeper than {self.max_depth} at offset {i}")
        if count > self.max_items:
            raise CborError(f"container of {count} items exceeds the limit of {self.max_items}")
        # Every item takes at least one byte: a huge claimed count fails here, before any work.
        if count * min_bytes_each > self.end - j:
            raise CborError(f"truncated: {count} items claimed at offset {i}, too few bytes left")


def cbor_decode(
    data: bytes,
    *,
    max_depth: int = CBOR_MAX_DEPTH_DEFAULT,
    max_items: int = CBOR_MAX_ITEMS_DEFAULT,
    max_string_bytes: int = CBOR_MAX_STRING_BYTES_DEFAULT,
) -> Any:
    """Decode exactly one canonical CBOR data item that fills ``data``. Arrays come back as
    lists, byte strings as bytes. Raises ``CborError`` (and nothing else) for anything
    ``cbor_encode`` would not have produced, trailing bytes, or input beyond the limits."""
    if not isinstance(data, bytes):
        data = bytes(data)
    d = _Decoder(data, max_depth, max_items, max_string_bytes)
    value, end = d.item(0, 0)
    if end != len(data):
        raise CborError(f"{len(data) - end} trailing bytes after the data item")
    return value


# -- namespaces -----------------------------------------------------------------------------------


def _text(max_bytes: int, *, nonempty: bool):
    def check(instance, attribute, value) -> None:
        if not isinstance(value, str):
            raise TypeError(f"{attribute.name} must be str, not {type(value).__name__}")
        if nonempty and not value:
            raise ValueError(f"{attribute.name} must not be empty")
        try:
            n = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise ValueError(f"{attribute.name} is not valid Unicode") from None
        if n > max_bytes:
            raise ValueError(f"{attribute.name} is {n} bytes, more than {max_bytes}")

    return check


def _count(low: int, high: int):
    def check(instance, attribute, value) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{attribute.name} must be int, not {type(value).__name__}")
        if not low <= value <= high:
            raise ValueError(f"{attribute.name}={value} outside {low}..{high}")

    return check


def _salt(instance, attribute, value) -> None:
    if not isinstance(value, bytes):
        raise TypeError(f"cache_salt must be bytes, not {type(value).__name__}")
    if len(value) > CACHE_SALT_MAX_BYTES:
        raise ValueError(f"cache_salt is {len(value)} bytes, more than {CACHE_SALT_MAX_BYTES}")


@frozen
class Namespace:
    """Everything that, if it differed, would make two blocks with the same tokens hold
    different KV bytes -- plus the tenant's cache salt, which keeps tenants from sharing (or
    probing for) each other's blocks even when everything else matches (protocol property 11).

    - ``model_id``, ``model_revision``: weights (a revision is a commit hash or a version tag);
    - ``kv_dtype``: e.g. ``"bfloat16"``, ``"fp8_e4m3"``; ``kv_layout``: the engine's page layout
      (e.g. ``"NHD"``, ``"HND"``, ``"mla"``), ``""`` when the engine has only one;
    - ``block_tokens``: tokens per block (the page size);
    - ``tp_rank``/``tp_size``, ``pp_rank``/``pp_size``: which shard of the KV this node holds;
    - ``adapter``: LoRA adapter id, ``""`` for the base model;
    - ``cache_salt``: the tenant's salt, opaque bytes.
    """

    model_id: str = field(validator=_text(NAMESPACE_TEXT_MAX_BYTES, nonempty=True))
    model_revision: str = field(validator=_text(NAMESPACE_TEXT_MAX_BYTES, nonempty=True))
    kv_dtype: str = field(validator=_text(NAMESPACE_TEXT_MAX_BYTES, nonempty=True))
    block_tokens: int = field(validator=_count(1, BLOCK_TOKENS_MAX))
    kv_layout: str = field(default="", validator=_text(NAMESPACE_TEXT_MAX_BYTES, nonempty=False))
    tp_rank: int = field(default=0, validator=_count(0, 1 << 16))
    tp_size: int = field(default=1, validator=_count(1, 1 << 16))
    pp_rank: int = field(default=0, validator=_count(0, 1 << 16))
    pp_size: int = field(default=1, validator=_count(1, 1 << 16))
    adapter: str = field(default="", validator=_text(NAMESPACE_TEXT_MAX_BYTES, nonempty=False))
    cache_salt: bytes = field(default=b"", validator=_salt)

    def __attrs_post_init__(self) -> None:
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} must be below tp_size {self.tp_size}")
        if self.pp_rank >= self.pp_size:
            raise ValueError(f"pp_rank {self.pp_rank} must be below pp_size {self.pp_size}")

    def canonical_map(self) -> dict[str, object]:
        """The map whose canonical CBOR is hashed; fixed string keys plus a format version."""
        return {
            "v": NAMESPACE_FORMAT_VERSION,
            "model_id": self.model_id,
            "model_revision": self.model_revision,
            "kv_dtype": self.kv_dtype,
            "block_tokens": self.block_tokens,
            "kv_layout": self.kv_layout,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "pp_rank": self.pp_rank,
            "pp_size": self.pp_size,
            "adapter": self.adapter,
            "cache_salt": self.cache_salt,
        }

    def digest(self) -> NamespaceDigest:
        """SHA-256 of the canonical CBOR of ``canonical_map()``: 32 bytes."""
        return NamespaceDigest(hashlib.sha256(cbor_encode(self.canonical_map())).digest())


# -- block keys -----------------------------------------------------------------------------------

_HEX_RE = re.compile(r"[0-9a-f]{64}")


def _digest32(instance, attribute, value) -> None:
    if not isinstance(value, bytes):
        raise TypeError(f"BlockKey digest must be bytes, not {type(value).__name__}")
    if len(value) != DIGEST_BYTES:
        raise ValueError(f"BlockKey digest must be {DIGEST_BYTES} bytes, not {len(value)}")


@frozen(order=True, repr=False)
class BlockKey:
    """The identity of one block: a 32-byte SHA-256 digest, chained over the namespace, the
    parent block's key and the block's token ids. Ordered by its bytes; hashable."""

    digest: bytes = field(validator=_digest32)

    @classmethod
    def chain(cls, namespace: Namespace, parent: BlockKey | None, token_ids: Sequence[int]) -> BlockKey:
        """The key of the block holding ``token_ids`` (exactly ``namespace.block_tokens`` of
        them) after the prefix whose last block is ``parent`` (``None`` for the first block):
        SHA-256(canonical CBOR [namespace.digest(), parent digest or null, [token ids]])."""
        return cls._chain(namespace.digest(), namespace.block_tokens, parent, token_ids)

    @classmethod
    def _chain(cls, ns_digest: bytes, block_tokens: int, parent: BlockKey | None, token_ids: Sequence[int]) -> BlockKey:
        if parent is not None and not isinstance(parent, BlockKey):
            raise TypeError(f"parent must be a BlockKey or None, not {type(parent).__name__}")
        tokens = []
        for t in token_ids:
            # Any integer type (numpy, torch scalars) via __index__; never a bool.
            if isinstance(t, bool):
                raise TypeError("token ids are ints, got bool")
            try:
                t = operator.index(t)
            except TypeError:
                raise TypeError(f"token ids are ints, got {type(t).__name__}") from None
            if not 0 <= t < TOKEN_ID_LIMIT:
                raise ValueError(f"token id {t} outside 0..{TOKEN_ID_LIMIT - 1}")
            tokens.append(t)
        if len(tokens) != block_tokens:
            raise ValueError(f"a block holds {block_tokens} tokens, got {len(tokens)}")
        payload = cbor_encode([ns_digest, None if parent is None else parent.digest, tokens])
        return cls(hashlib.sha256(payload).digest())

    @property
    def hex(self) -> str:
        """64 lowercase hex digits."""
        return self.digest.hex()

    @classmethod
    def from_hex(cls, text: str) -> BlockKey:
        """Parse ``hex``: exactly 64 lowercase hex digits, nothing else (no prefix, no spaces),
        so that a key has one text form. Raises ``ValueError``."""
        if not isinstance(text, str) or not _HEX_RE.fullmatch(text):
            raise ValueError(f"a block key is 64 lowercase hex digits, got {text!r:.80}")
        return cls(bytes.fromhex(text))

    def __repr__(self) -> str:
        return f"BlockKey({self.hex[:16]}…)"

    def __str__(self) -> str:
        return self.hex


def chain_keys(
    namespace: Namespace,
    tokens: Sequence[int],
    block_tokens: int | None = None,
    *,
    parent: BlockKey | None = None,
) -> list[BlockKey]:
    """The keys of every *full* block of ``tokens`` (a trailing partial block has no key), in
    prefix order, each chained on the one before (the first on ``parent``). ``block_tokens``
    defaults to ``namespace.block_tokens``; passing a different value is an error, since the
    block size is part of the namespace."""
    if block_tokens is None:
        block_tokens = namespace.block_tokens
    if block_tokens != namespace.block_tokens:
        raise ValueError(f"block_tokens {block_tokens} differs from the namespace's {namespace.block_tokens}")
    ns_digest = namespace.digest()
    keys: list[BlockKey] = []
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        parent = BlockKey._chain(ns_digest, block_tokens, parent, tokens[start : start + block_tokens])
        keys.append(parent)
    return keys


# -- shards ---------------------------------------------------------------------------------------
# docs/sharding.md: a sharded directory is N whole directories, each owning the chains whose root
# hashes to it. A chain lives in its root's shard -- every rule that spans keys (a COMMITTED
# parent, an invalidation's subtree, leaves evicted first) spans one chain, so each stays one
# shard's decision. The root's digest already chains over its namespace; the domain prefix keeps
# this hash apart from every other use of a key's digest.
SHARD_DOMAIN = b"kvcc shard\0"
SHARD_HASH_BYTES = 8  # the leading bytes of the SHA-256 read as a big-endian int


def shard_of(root_digest: bytes, shards: int) -> int:
    """The shard, in ``0 .. shards - 1``, that owns the chain whose root block's digest is
    ``root_digest`` (``BlockKey.digest`` of the block with parent ``None``)::

        int.from_bytes(SHA-256(b"kvcc shard\\0" + root_digest)[:8], "big") % shards

    Pure and total over its domain, and the same in every process and language (like the key
    itself), so a client, a cache node and every shard agree on a chain's shard without asking.
    Raises ``TypeError`` for a digest that is not ``bytes`` or a shard count that is not an
    ``int``, ``ValueError`` for a digest that is not ``DIGEST_BYTES`` long or fewer than one shard."""
    if not isinstance(root_digest, bytes):
        raise TypeError(f"a root digest is bytes, not {type(root_digest).__name__}")
    if len(root_digest) != DIGEST_BYTES:
        raise ValueError(f"a root digest is {DIGEST_BYTES} bytes, not {len(root_digest)}")
    if type(shards) is not int:  # not a bool either: True shards is a bug, not one shard
        raise TypeError(f"the shard count is an int, not {type(shards).__name__}")
    if shards < 1:
        raise ValueError(f"the shard count is at least 1, got {shards}")
    head = hashlib.sha256(SHARD_DOMAIN + root_digest).digest()[:SHARD_HASH_BYTES]
    return int.from_bytes(head, "big") % shards
