"""Block identity: canonical CBOR, namespaces, chained block keys (kvcc.spec.keys)."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcc.spec.keys import (
    BlockKey,
    CborError,
    Epoch,
    Generation,
    Namespace,
    cbor_decode,
    cbor_encode,
    cbor_head,
    chain_keys,
)

# -- the golden vector ------------------------------------------------------------------------------
#
# Any engine, in any language, must reproduce these bytes and digests. The CBOR below is derived by
# hand from RFC 8949 §4.2.1 (it was also cross-checked once against the `cbor2` package with
# canonical=True, which agrees for maps whose keys are all text).

GOLDEN_NAMESPACE = Namespace(model_id="m", model_revision="r1", kv_dtype="bf16", block_tokens=4)

# A map of 12 entries (0xa0 | 12). Keys sort by their encodings: a shorter text head sorts first
# (0x61 < 0x67 < 0x68 ...), equal lengths compare bytewise.
GOLDEN_NAMESPACE_CBOR = b"".join([
    b"\xac",
    b"\x61v", b"\x01",                              # "v": 1 (format version)
    b"\x67adapter", b"\x60",                        # "adapter": ""
    b"\x67pp_rank", b"\x00",                        # "pp_rank": 0
    b"\x67pp_size", b"\x01",                        # "pp_size": 1
    b"\x67tp_rank", b"\x00",                        # "tp_rank": 0
    b"\x67tp_size", b"\x01",                        # "tp_size": 1
    b"\x68kv_dtype", b"\x64bf16",                   # "kv_dtype": "bf16"
    b"\x68model_id", b"\x61m",                      # "model_id": "m"
    b"\x69kv_layout", b"\x60",                      # "kv_layout": ""
    b"\x6acache_salt", b"\x40",                     # "cache_salt": h''
    b"\x6cblock_tokens", b"\x04",                   # "block_tokens": 4
    b"\x6emodel_revision", b"\x62r1",               # "model_revision": "r1"
])  # fmt: skip
GOLDEN_NAMESPACE_DIGEST = "a0e555425de3103fdaae908e689edb423739d9d4a792b13d2c0d230dc23167f1"

# Block 1: tokens [1, 23, 24, 70000] -- one token per integer width: inline (< 24), inline at the
# edge (23 = 0x17), one byte (24 = 0x18 0x18), four bytes (70000 = 0x1a 00 01 11 70).
GOLDEN_TOKENS_1 = [1, 23, 24, 70000]
GOLDEN_KEY_1 = "77da73003f997c9b12a361b889817bc1a389772f0e93ebb073209b49c4c62537"
# Block 2: [255, 256, 65535, 65536] -- the edges of the one-, two- and four-byte forms.
GOLDEN_TOKENS_2 = [255, 256, 65535, 65536]
GOLDEN_KEY_2 = "83041792f098635f3bf27e47aa67c60bd76c432542bca121497b87b06af050d5"


def test_golden_namespace_bytes_and_digest():
    assert cbor_encode(GOLDEN_NAMESPACE.canonical_map()) == GOLDEN_NAMESPACE_CBOR
    assert hashlib.sha256(GOLDEN_NAMESPACE_CBOR).hexdigest() == GOLDEN_NAMESPACE_DIGEST
    assert GOLDEN_NAMESPACE.digest().hex() == GOLDEN_NAMESPACE_DIGEST


def test_golden_block_keys():
    ns = bytes.fromhex(GOLDEN_NAMESPACE_DIGEST)
    # [ns digest, null, [1, 23, 24, 70000]]: array(3), bytes(32), null, array(4) of uints.
    root_cbor = b"\x83" + b"\x58\x20" + ns + b"\xf6" + b"\x84" + b"\x01" + b"\x17" + b"\x18\x18" + b"\x1a\x00\x01\x11\x70"
    assert cbor_encode([ns, None, GOLDEN_TOKENS_1]) == root_cbor
    k1 = BlockKey.chain(GOLDEN_NAMESPACE, None, GOLDEN_TOKENS_1)
    assert k1.hex == hashlib.sha256(root_cbor).hexdigest() == GOLDEN_KEY_1

    child_cbor = (
        b"\x83" + b"\x58\x20" + ns + b"\x58\x20" + k1.digest
        + b"\x84" + b"\x18\xff" + b"\x19\x01\x00" + b"\x19\xff\xff" + b"\x1a\x00\x01\x00\x00"
    )
    assert cbor_encode([ns, k1.digest, GOLDEN_TOKENS_2]) == child_cbor
    k2 = BlockKey.chain(GOLDEN_NAMESPACE, k1, GOLDEN_TOKENS_2)
    assert k2.hex == hashlib.sha256(child_cbor).hexdigest() == GOLDEN_KEY_2

    assert chain_keys(GOLDEN_NAMESPACE, GOLDEN_TOKENS_1 + GOLDEN_TOKENS_2 + [7, 8, 9]) == [k1, k2]


# -- namespaces and chaining --------------------------------------------------------------------------

BASE = Namespace(
    model_id="meta-llama/Llama-3-8B", model_revision="abc123", kv_dtype="bfloat16", block_tokens=4,
    kv_layout="NHD", tp_rank=0, tp_size=2, pp_rank=0, pp_size=1, adapter="", cache_salt=b"tenant-a",
)  # fmt: skip

VARIANTS = {
    "model_id": "meta-llama/Llama-3-70B",
    "model_revision": "abc124",
    "kv_dtype": "fp8_e4m3",
    "kv_layout": "HND",
    "tp_rank": 1,
    "tp_size": 4,
    "pp_size": 2,
    "adapter": "lora-sql",
    "cache_salt": b"tenant-b",
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_namespace_field_changes_every_key(name):
    other = attrs.evolve(BASE, **{name: VARIANTS[name]})
    tokens = list(range(100, 112))
    assert other.digest() != BASE.digest()
    ours, theirs = chain_keys(BASE, tokens), chain_keys(other, tokens)
    assert len(ours) == len(theirs) == 3
    assert not set(ours) & set(theirs), f"a change of {name} must change every block key"


def test_block_size_is_part_of_the_namespace():
    two = attrs.evolve(BASE, block_tokens=2)
    assert two.digest() != BASE.digest()
    assert not set(chain_keys(BASE, list(range(8)))) & set(chain_keys(two, list(range(8))))
    with pytest.raises(ValueError):
        chain_keys(BASE, list(range(8)), block_tokens=2)


def test_a_key_depends_on_its_whole_prefix():
    a = chain_keys(BASE, [1, 2, 3, 4, 5, 6, 7, 8])
    b = chain_keys(BASE, [9, 2, 3, 4, 5, 6, 7, 8])
    assert a[1] != b[1], "same tokens in block 2, different block 1: different key"
    assert chain_keys(BASE, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])[:2] == a, "a prefix's keys are a prefix"
    assert chain_keys(BASE, [5, 6, 7, 8], parent=a[0]) == a[1:]
    assert chain_keys(BASE, [1, 2, 3]) == [], "a partial block has no key"


def test_integer_like_token_ids():
    import numpy as np

    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    assert chain_keys(BASE, np.array(tokens, dtype=np.int64)) == chain_keys(BASE, tokens)
    assert chain_keys(BASE, tuple(tokens)) == chain_keys(BASE, tokens)
    with pytest.raises(TypeError):
        BlockKey.chain(BASE, None, [1, 2, 3, 4.0])


def test_namespace_validation():
    with pytest.raises(ValueError):
        attrs.evolve(BASE, tp_rank=2)  # rank below size
    with pytest.raises(ValueError):
        attrs.evolve(BASE, model_id="")
    with pytest.raises(TypeError):
        attrs.evolve(BASE, block_tokens=True)
    with pytest.raises(TypeError):
        attrs.evolve(BASE, cache_salt="text")
    with pytest.raises(ValueError):
        attrs.evolve(BASE, block_tokens=0)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        BASE.kv_dtype = "float16"  # type: ignore[misc]


def test_block_key_validation_and_text_form():
    k = chain_keys(BASE, [1, 2, 3, 4])[0]
    assert BlockKey.from_hex(k.hex) == k
    assert str(k) == k.hex and len(k.hex) == 64
    for bad in (k.hex.upper(), k.hex[:-1], "0x" + k.hex[2:], k.hex[:-1] + "g", " " + k.hex[1:], 42):
        with pytest.raises(ValueError):
            BlockKey.from_hex(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        BlockKey(b"\x00" * 31)
    with pytest.raises(TypeError):
        BlockKey("00" * 32)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        BlockKey.chain(BASE, None, [1, 2, 3])  # a block holds block_tokens tokens
    with pytest.raises(ValueError):
        BlockKey.chain(BASE, None, [1, 2, 3, -1])
    with pytest.raises(ValueError):
        BlockKey.chain(BASE, None, [1, 2, 3, 2**32])
    with pytest.raises(TypeError):
        BlockKey.chain(BASE, None, [1, 2, 3, True])
    with pytest.raises(TypeError):
        BlockKey.chain(BASE, b"\x00" * 32, [1, 2, 3, 4])  # type: ignore[arg-type]


@given(st.lists(st.binary(min_size=32, max_size=32), min_size=2, max_size=10))
def test_block_keys_order_by_their_bytes(digests):
    keys = [BlockKey(d) for d in digests]
    assert [k.digest for k in sorted(keys)] == sorted(digests)
    assert len({*keys}) == len({*digests})


def test_plain_value_names():
    assert Generation(3) == 3 and Epoch(4) == 4  # NewType: ints on the wire, names in signatures


def test_keys_module_imports_only_stdlib_and_attrs():
    code = (
        "import sys; before = set(sys.modules); import kvcc.spec.keys; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "bad = sorted(m for m in new if m not in sys.stdlib_module_names and m not in ('attr', 'attrs', 'kvcc'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- canonical CBOR ----------------------------------------------------------------------------------

_uint64 = st.integers(0, 2**64 - 1)
_int = st.integers(-(2**64), 2**64 - 1)
_scalars = st.none() | st.booleans() | _int | st.binary(max_size=40) | st.text(max_size=20)
_keys = _int | st.text(max_size=10) | st.binary(max_size=10)
cbor_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(_keys, inner, max_size=5),
    max_leaves=25,
)


def _tagged(v):
    """A form where True != 1 and tuples equal lists: for exact round-trip comparisons."""
    if v is None or isinstance(v, bool):
        return ("simple", v)
    if isinstance(v, int):
        return ("int", v)
    if isinstance(v, (bytes, str)):
        return (type(v).__name__, v)
    if isinstance(v, (list, tuple)):
        return ("array", [_tagged(x) for x in v])
    return ("map", sorted((repr(_tagged(k)), _tagged(x)) for k, x in v.items()))


@given(cbor_values)
def test_cbor_round_trip(value):
    data = cbor_encode(value)
    assert _tagged(cbor_decode(data)) == _tagged(value)
    assert cbor_encode(cbor_decode(data)) == data, "decode-then-encode is the identity on canonical bytes"


@given(st.dictionaries(_keys, _scalars, min_size=2, max_size=8), st.randoms())
def test_cbor_map_insertion_order_is_irrelevant(mapping, rnd):
    items = list(mapping.items())
    rnd.shuffle(items)
    assert cbor_encode(dict(items)) == cbor_encode(mapping)


@given(st.lists(_keys, min_size=2, max_size=6, unique_by=lambda k: (type(k), k)))
def test_cbor_map_keys_sorted_by_encoded_bytes(keys):
    data = cbor_encode({k: 0 for k in keys})
    encoded = sorted(cbor_encode(k) for k in keys)
    assert data == cbor_head(5, len(keys)) + b"".join(e + b"\x00" for e in encoded)


def test_cbor_tuple_and_list_encode_alike():
    assert cbor_encode((1, "a")) == cbor_encode([1, "a"]) == b"\x82\x01\x61a"


@given(_uint64, st.sampled_from([24, 25, 26, 27]), st.integers(0, 5))
def test_cbor_decoder_rejects_non_shortest_arguments(value, ai, major):
    """Any integer or length in a wider form than its shortest is refused, and refused for that
    reason (the head is checked before any content is read)."""
    width = {24: 1, 25: 2, 26: 4, 27: 8}[ai]
    encoded = bytes([(major << 5) | ai]) + value.to_bytes(width, "big") if value < 1 << (8 * width) else None
    if encoded is None or encoded == cbor_head(major, value):
        return  # does not fit this width, or this width is the shortest
    with pytest.raises(CborError, match="non-canonical"):
        cbor_decode(encoded + b"\x00" * 8)


@pytest.mark.parametrize(
    "data",
    [
        b"\x18\x05",  # 5 in a one-byte argument
        b"\x19\x00\x05",
        b"\x1a\x00\x00\x00\x05",
        b"\x1b\x00\x00\x00\x00\x00\x00\x00\x05",
        b"\x38\x00",  # -1 in a one-byte argument
        b"\x58\x01a",  # bytes of length 1 with a long length
        b"\x9f\x01\xff",  # indefinite array
        b"\x5f\x41a\xff",  # indefinite bytes
        b"\x7f\x61a\xff",  # indefinite text
        b"\xbf\x61a\x01\xff",  # indefinite map
        b"\xa2\x61b\x01\x61a\x02",  # map keys out of order
        b"\xa2\x61a\x01\x61a\x02",  # duplicate map key
        b"\xa2\x02\x00\x01\x00",  # int keys out of order
        b"\x01\x01",  # trailing byte
        b"",  # nothing
        b"\xf9\x3c\x00",  # half float
        b"\xfa\x3f\x80\x00\x00",  # single float
        b"\xfb\x3f\xf0\x00\x00\x00\x00\x00\x00",  # double float
        b"\xf7",  # undefined
        b"\xf8\x20",  # simple value in the next byte
        b"\xe0",  # simple value 0
        b"\xc2\x41\x01",  # a tag (bignum)
        b"\x1c",  # reserved additional information
        b"\xff",  # a lone break
        b"\x61\xff",  # invalid UTF-8
        b"\x19\x01",  # truncated argument
        b"\x62a",  # truncated text
        b"\x83\x01\x02",  # truncated array
        b"\xa1\x81\x01\x02",  # an array as a map key
        b"\xa1\xf6\x01",  # null as a map key
        b"\xa1\xf5\x01",  # true as a map key
        b"\x5b\xff\xff\xff\xff\xff\xff\xff\xff",  # a 2**64-1 byte string claimed
        b"\x9b\x00\x00\x00\x00\xff\xff\xff\xff",  # 4 billion items claimed
    ],
)
def test_cbor_decoder_rejects_non_canonical_and_unsupported(data):
    with pytest.raises(CborError):
        cbor_decode(data)


def test_cbor_decoder_limits():
    nested = b"\x81" * 16 + b"\x00"
    assert cbor_decode(nested) == [[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]
    with pytest.raises(CborError, match="nesting"):
        cbor_decode(b"\x81" + nested)
    with pytest.raises(CborError, match="nesting"):
        cbor_decode(b"\x81\x81\x00", max_depth=1)
    with pytest.raises(CborError, match="items"):
        cbor_decode(cbor_encode(list(range(10))), max_items=9)
    assert cbor_decode(cbor_encode(list(range(9))), max_items=9) == list(range(9))
    with pytest.raises(CborError, match="limit"):
        cbor_decode(cbor_encode(b"x" * 100), max_string_bytes=99)


def test_cbor_encoder_refuses_what_it_cannot_carry():
    for bad in (1.5, 2**64, -(2**64) - 1, {(1, 2): 3}, {None: 1}, {True: 1}, object(), "\ud800"):
        with pytest.raises(CborError):
            cbor_encode(bad)
    assert cbor_encode(2**64 - 1) == b"\x1b" + b"\xff" * 8
    assert cbor_encode(-(2**64)) == b"\x3b" + b"\xff" * 8
    assert cbor_encode(-1) == b"\x20" and cbor_encode(-24) == b"\x37" and cbor_encode(-25) == b"\x38\x18"


@settings(max_examples=300)
@given(st.binary(max_size=64))
def test_cbor_decoder_on_garbage_raises_only_cbor_error(data):
    try:
        value = cbor_decode(data)
    except CborError:
        return
    assert cbor_encode(value) == data, "whatever decodes was canonical"
