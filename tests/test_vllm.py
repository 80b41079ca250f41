"""A real vLLM engine (the CPU build) serving a generated tiny Llama, and kvcc's view of its prefix
cache kept from its KV events.

One engine serves the whole module (a start costs ~30 s on two cores); the tests run in file order
and each one starts from a cleared prefix cache. The engine's own account of a prefix hit
(``usage.prompt_tokens_details.cached_tokens``) is the oracle the view is checked against.

Needs the ``vllm`` extra (``bash scripts/setup.sh --with vllm``, which the README's test command
runs). Without it the engine tests fail, naming the command that installs it (a skipped test is not
a passing one); the hashing, decoding and view tests that need no engine run wherever ``msgpack``
is installed. The module is one xdist group, so that one worker starts the one engine.
"""

from __future__ import annotations

import random
import time

import pytest

from kvcc.adapters.vllm import events as ev
from kvcc.adapters.vllm import harness
from kvcc.spec.keys import BlockKey, Namespace

try:
    harness.check_installed()
    _MISSING = ""
except harness.VllmNotInstalled as e:
    _MISSING = str(e)

pytestmark = pytest.mark.xdist_group("vllm-engine")


@pytest.fixture
def vllm_installed():
    if _MISSING:
        pytest.fail(f"the vllm extra is required (bash scripts/setup.sh --with vllm): {_MISSING}")


needs_vllm = pytest.mark.usefixtures("vllm_installed")

BLOCK = 32
NUM_BLOCKS = 32  # 31 usable (vLLM reserves one): a few prompts fill it, so eviction is easy to drive
MAX_MODEL_LEN = 512
EVENT_TIMEOUT_S = 60.0
JOIN_PROBE_S = 2.0  # how long one probe of _joined is waited for before the next
VOCAB = range(3, 512)  # the tiny model's ids without its special tokens


def _namespace(model_id: str = "kvcc/tiny-llama", revision: str = "r1", salt: bytes = b"") -> Namespace:
    return Namespace(model_id, revision, "bfloat16", BLOCK, cache_salt=salt)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.choice(VOCAB) for _ in range(n)]


def _stored(hashes, parent, tokens, *, medium="GPU", extra=None) -> ev.BlockStored:
    return ev.BlockStored(tuple(hashes), parent, tuple(tokens), BLOCK, medium, 0, None, extra)


def _removed(hashes, medium="GPU") -> ev.BlockRemoved:
    return ev.BlockRemoved(tuple(hashes), medium, 0)


# -- vLLM's block hash, recomputed ------------------------------------------------------------------


@needs_vllm
def test_block_hash_is_vllms_own_sha256_cbor():
    """The subscriber's recomputation equals vLLM's hash_block_tokens with sha256_cbor, salt
    and all (vLLM imported in this process, its NONE_HASH initialised as the engine does)."""
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils as kcu

    kcu.init_none_hash(sha256_cbor)
    assert kcu.NONE_HASH == ev.NONE_HASH
    tokens = _tokens(random.Random(1), 3 * BLOCK)
    for salt in (None, "tenant-a"):
        theirs, parent = [], None
        for i in range(3):
            extra = (("cache_salt", salt),) if i == 0 and salt else None
            parent = kcu.hash_block_tokens(sha256_cbor, parent, tokens[i * BLOCK : (i + 1) * BLOCK], extra)
            theirs.append(bytes(parent))
        assert ev.vllm_block_hashes(tokens, BLOCK, salt) == theirs


@needs_vllm
def test_decoder_reads_vllms_own_encoding():
    """A batch encoded by vLLM's own msgspec classes decodes to the same events."""
    import msgspec
    from vllm.distributed import kv_events as vk

    tokens = _tokens(random.Random(2), 2 * BLOCK)
    h = ev.vllm_block_hashes(tokens, BLOCK, "s")
    batch = vk.KVEventBatch(
        ts=1.5,
        events=[
            vk.BlockStored(block_hashes=h, parent_block_hash=None, token_ids=tokens, block_size=BLOCK, lora_id=None,
                           medium="GPU", lora_name=None, extra_keys=[("s",), None], group_idx=0),
            vk.BlockRemoved(block_hashes=[h[1]], medium="GPU", group_idx=0),
            vk.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )  # fmt: skip
    ts, events, rank = ev.decode_batch(msgspec.msgpack.Encoder().encode(batch))
    assert (ts, rank) == (1.5, 0)
    assert events == [
        _stored(h, None, tokens, extra=(("s",), None)),
        _removed([h[1]]),
        ev.AllBlocksCleared(),
    ]


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", b"\x93", __import__("msgpack").packb([1.0, [{"type": "Nope"}], 0]),
     __import__("msgpack").packb([1.0, [{"type": "BlockStored", "block_hashes": [b"x"], "parent_block_hash": None,
                                         "token_ids": [1], "block_size": 1}], 0]),
     __import__("msgpack").packb([1.0, [{"type": "BlockStored", "block_hashes": [b"x" * 32], "parent_block_hash": None,
                                         "token_ids": [1, 2], "block_size": 32}], 0]),
     __import__("msgpack").packb({"ts": 1})],
    ids=["empty", "reserved-byte", "truncated", "unknown-type", "short-hash", "token-count", "not-a-list"],
)  # fmt: skip
def test_decoder_rejects_malformed_payloads(payload):
    with pytest.raises(ev.KvEventError):
        ev.decode_batch(payload)


# -- the view's semantics (vLLM's meaning of each event) ---------------------------------------------


def _view() -> ev.EngineView:
    return ev.EngineView("e", ev.KeyMapper(_namespace()))


def test_a_hash_stored_twice_is_held_until_both_copies_are_removed():
    """vLLM does not de-duplicate: two physical blocks may hold one hash, and BlockRemoved drops
    one copy (block_pool.py, BlockHashToBlockMap)."""
    tokens = _tokens(random.Random(3), BLOCK)
    (h,) = ev.vllm_block_hashes(tokens, BLOCK)
    view = _view()
    view.apply_batch([_stored([h], None, tokens)])
    view.apply_batch([_stored([h], None, tokens)])
    assert view.copies_of(h) == 2
    view.apply_batch([_removed([h])])
    assert view.holds(h) and view.copies_of(h) == 1
    view.apply_batch([_removed([h])])
    assert not view.holds(h) and not view.keys()
    view.apply_batch([_removed([h])])
    assert view.unknown_removals == 1 and view.copies_of(h) == 0


def test_media_are_counted_apart_and_cleared_together():
    tokens = _tokens(random.Random(4), BLOCK)
    (h,) = ev.vllm_block_hashes(tokens, BLOCK)
    view = _view()
    view.apply_batch([_stored([h], None, tokens, medium="GPU"), _stored([h], None, tokens, medium="CPU")])
    view.apply_batch([_removed([h], medium="GPU")])
    assert view.holds(h)
    view.apply_batch([ev.AllBlocksCleared()])
    assert not view.hashes() and not view.keys()


def test_keys_follow_the_chain_and_the_salt():
    tokens = _tokens(random.Random(5), 3 * BLOCK)
    view = _view()
    mapper = view.mapper
    plain = ev.vllm_block_hashes(tokens, BLOCK)
    salted = ev.vllm_block_hashes(tokens, BLOCK, "t")
    # One event for the first block, one for the next two (as vLLM sends a growing prompt).
    view.apply_batch([_stored(plain[:1], None, tokens[:BLOCK])])
    view.apply_batch([_stored(plain[1:], plain[0], tokens[BLOCK:])])
    view.apply_batch([_stored(salted, None, tokens, extra=(("t",), None, None))])
    assert view.keys() == set(mapper.keys(tokens)) | set(mapper.keys(tokens, "t"))
    assert view.matched_blocks(mapper.keys(tokens + tokens[:BLOCK])) == 3
    assert view.matched_blocks(mapper.keys(tokens, "t")) == 3
    assert view.matched_blocks(mapper.keys(tokens, "u")) == 0
    assert view.unkeyed == 0


def test_a_batch_with_a_wrong_hash_changes_nothing():
    tokens = _tokens(random.Random(6), 2 * BLOCK)
    good = ev.vllm_block_hashes(tokens, BLOCK)
    view = _view()
    with pytest.raises(ev.KvEventError, match="sha256_cbor"):
        view.apply_batch([_stored(good[:1], None, tokens[:BLOCK]), _stored([b"\x00" * 32], good[0], tokens[BLOCK:])])
    assert not view.hashes() and view.batches == 0
    # The low-64-bit integer form (vLLM's default) is checked the same way.
    ints = [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in good]
    view.apply_batch([_stored(ints[:1], None, tokens[:BLOCK]), _stored(ints[1:], ints[0], tokens[BLOCK:])])
    assert view.matched_blocks(view.mapper.keys(tokens)) == 2
    with pytest.raises(ev.KvEventError):
        view.apply_batch([_stored([ints[0] ^ 1], None, tokens[:BLOCK])])


def test_a_block_whose_parent_was_never_seen_is_held_without_a_key():
    tokens = _tokens(random.Random(7), 2 * BLOCK)
    h = ev.vllm_block_hashes(tokens, BLOCK)
    view = _view()
    view.apply_batch([_stored(h[1:], h[0], tokens[BLOCK:])])
    assert view.holds(h[1]) and not view.keys() and view.unkeyed == 1


def test_two_salts_or_two_models_never_share_a_key():
    tokens = _tokens(random.Random(8), 2 * BLOCK)
    mappers = {
        "base": ev.KeyMapper(_namespace()),
        "revision": ev.KeyMapper(_namespace(revision="r2")),
        "model": ev.KeyMapper(_namespace(model_id="kvcc/other")),
        "tp": ev.KeyMapper(Namespace("kvcc/tiny-llama", "r1", "bfloat16", BLOCK, tp_rank=1, tp_size=2)),
        "dtype": ev.KeyMapper(Namespace("kvcc/tiny-llama", "r1", "float32", BLOCK)),
    }
    keysets = {(name, salt): tuple(m.keys(tokens, salt)) for name, m in mappers.items() for salt in (None, "a", "b")}
    flat = [k for ks in keysets.values() for k in ks]
    assert len(set(flat)) == len(flat)
    # The salt lives in the namespace: the same salt through kvcc's own chain gives the same keys.
    assert keysets[("base", "a")] == tuple(BlockKey.chain(_namespace(salt=b"a"), p, t) for p, t in [
        (None, tokens[:BLOCK]), (keysets[("base", "a")][0], tokens[BLOCK:])])  # fmt: skip
    with pytest.raises(ValueError, match="cache salt"):
        ev.KeyMapper(_namespace(salt=b"x"))


# -- a real engine -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from kvcc.adapters.vllm.model import tiny_llama

    return tiny_llama()


@pytest.fixture(scope="module")
def engine(model_path):
    if _MISSING:
        pytest.fail(f"the vllm extra is required (bash scripts/setup.sh --with vllm): {_MISSING}")
    e = harness.VllmEngine(model_path, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)
    try:
        e.start()
        assert len(e.pids()) >= 2, f"expected the API server and its engine core, found {e.pids()}"
        yield e
    finally:
        e.close()
        assert not harness.live_pids(), f"processes left running: {harness.live_pids()}"


@pytest.fixture(scope="module")
def mapper(model_path):
    from kvcc.adapters.vllm.model import engine_namespace

    return ev.KeyMapper(engine_namespace(model_path, "kvcc/tiny-llama", block_tokens=BLOCK))


@pytest.fixture(scope="module")
def sub(engine, mapper):
    s = ev.KvEventSubscriber()
    s.add_engine("e0", engine.events_endpoint, engine.replay_endpoint, topic=engine.topic, keys=mapper)
    yield s
    s.close()


@pytest.fixture
def fresh(engine, sub):
    """A cleared prefix cache, and a view that has seen the AllBlocksCleared."""
    view = sub.view("e0")
    _joined(engine, sub)
    assert engine.reset_prefix_cache()
    _sync(engine, sub)
    assert len(view.hashes()) == 1  # the probe's block
    return view


def _joined(engine, sub) -> None:
    """Return once the subscriber hears the engine. A ZMQ SUB socket drops what the engine
    publishes before its subscription has reached the publisher (the slow joiner), and a first
    message lost is a gap no later message reveals: a clean CI run once waited 60 s for a probe
    published then. So probe, a fresh block each time, until one probe's BlockStored arrives."""
    view = sub.view("e0")
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while view.next_seq is None:
        probe = _tokens(random.Random(), BLOCK)
        engine.complete(probe, max_tokens=1)
        (h,) = ev.vllm_block_hashes(probe, BLOCK)
        if sub.wait_for(lambda: view.holds(h), JOIN_PROBE_S):
            return
        assert time.monotonic() < deadline, f"the subscriber heard nothing from the engine\n{view}"


def _sync(engine, sub, salt_probe=None) -> None:
    """Make the engine publish something we can wait for: a one-block prompt of fresh tokens,
    then wait until the view holds it. Events are published in step order, so the view has then
    seen everything before it."""
    probe = _tokens(random.Random(), BLOCK)
    engine.complete(probe, max_tokens=1)
    (h,) = ev.vllm_block_hashes(probe, BLOCK)
    view = sub.view("e0")
    assert sub.wait_for(lambda: view.holds(h), EVENT_TIMEOUT_S), f"no BlockStored for the probe\n{view}"


def _complete_and_wait(engine, sub, prompt, *, max_tokens=1, salt=None) -> dict:
    out = engine.complete(prompt, max_tokens=max_tokens, cache_salt=salt)
    hashes = ev.vllm_block_hashes(prompt, BLOCK, salt)
    view = sub.view("e0")
    assert sub.wait_for(lambda: all(view.holds(h) for h in hashes), EVENT_TIMEOUT_S), f"prompt's blocks not seen\n{view}"
    return out


def _cached(out: dict) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


@needs_vllm
def test_greedy_completions_are_reproducible(engine, fresh):
    prompt = _tokens(random.Random(10), 40)
    a = engine.complete(prompt, max_tokens=8)
    b = engine.complete(prompt, max_tokens=8)
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert len(a["choices"][0]["token_ids"]) == 8
    assert _cached(a) == 0 and _cached(b) == BLOCK
    # The generated tokenizer is the engine's: text goes to ids of the 512-token vocabulary.
    ids = engine.tokenize("bada kemo sipu.")
    assert ids and all(0 <= i < 512 for i in ids)


@needs_vllm
def test_stored_events_carry_the_prompt_blocks_and_their_keys(engine, sub, mapper, fresh):
    prompt = _tokens(random.Random(11), 3 * BLOCK + 5)
    _complete_and_wait(engine, sub, prompt)
    keys = mapper.keys(prompt)
    assert fresh.matched_blocks(keys) == 3
    assert [fresh.records[h].key for h in ev.vllm_block_hashes(prompt, BLOCK)] == keys
    assert sub.engines_holding(keys[2]) == ["e0"] and sub.engines_holding(mapper.keys(prompt, "x")[0]) == []
    assert not fresh.errors and fresh.complete
    # The engine agrees: the same prompt again hits the three blocks the view says it holds.
    assert _cached(engine.complete(prompt, max_tokens=1)) == 3 * BLOCK


@needs_vllm
def test_salted_requests_get_their_own_blocks_and_keys(engine, sub, mapper, fresh):
    prompt = _tokens(random.Random(12), 2 * BLOCK + 1)
    for salt in ("a", "b"):
        _complete_and_wait(engine, sub, prompt, salt=salt)
    ka, kb = mapper.keys(prompt, "a"), mapper.keys(prompt, "b")
    assert not set(ka) & set(kb)
    assert fresh.matched_blocks(ka) == fresh.matched_blocks(kb) == 2
    assert fresh.matched_blocks(mapper.keys(prompt)) == 0
    assert _cached(engine.complete(prompt, max_tokens=1, cache_salt="c")) == 0
    assert _cached(engine.complete(prompt, max_tokens=1, cache_salt="a")) == 2 * BLOCK


@needs_vllm
def test_the_view_predicts_every_prefix_hit_under_eviction(engine, sub, mapper, fresh):
    """A seeded workload of prompts sharing prefixes, several times the cache's size: before
    each request the view predicts the engine's prefix hit, and the engine's reported
    cached_tokens must equal it. Evictions (BlockRemoved) must have happened."""
    rng = random.Random(13)
    stems = [_tokens(rng, BLOCK * rng.randint(1, 4)) for _ in range(4)]
    for _ in range(30):
        prompt = rng.choice(stems) + _tokens(rng, rng.randint(1, 3 * BLOCK))
        predicted = min(fresh.matched_blocks(mapper.keys(prompt)), (len(prompt) - 1) // BLOCK) * BLOCK
        out = _complete_and_wait(engine, sub, prompt)
        assert _cached(out) == predicted, f"engine hit {_cached(out)} tokens, the view predicted {predicted}"
    assert fresh.removed_blocks > 0 and fresh.unknown_removals == 0
    assert len(fresh.hashes()) <= NUM_BLOCKS - 1
    assert fresh.complete and not fresh.errors


@needs_vllm
def test_a_duplicated_block_stays_cached_until_its_last_copy_is_evicted(engine, sub, mapper, fresh):
    """vLLM caches a block that fills up during decoding even when the same hash is already
    cached (no de-duplication). Build that case, then evict one copy at a time: the view holds
    the hash until both removals arrived, and the engine's prefix hits agree."""
    rng = random.Random(14)
    p = _tokens(rng, 2 * BLOCK + BLOCK // 2)  # two full blocks and half of a third
    # 1. Learn the greedy continuation that fills the third block.
    g = engine.complete(p, max_tokens=BLOCK // 2 + 1)["choices"][0]["token_ids"]
    assert engine.reset_prefix_cache()
    _sync(engine, sub)
    filled = p + g[: BLOCK // 2]
    h = ev.vllm_block_hashes(filled, BLOCK)[2]
    # 2. A prompt that holds that third block already: one copy, from its prefill.
    _complete_and_wait(engine, sub, filled + _tokens(rng, 3))
    assert fresh.copies_of(h) == 1
    # 3. p again: it hits two blocks and fills the third by decoding: a second copy.
    again = engine.complete(p, max_tokens=BLOCK // 2 + 1)
    assert _cached(again) == 2 * BLOCK
    assert again["choices"][0]["token_ids"] == g, "greedy decoding was not reproducible"
    assert sub.wait_for(lambda: fresh.copies_of(h) == 2, EVENT_TIMEOUT_S), f"{fresh.copies_of(h)} copies"
    # 4. Push one fresh single-block prompt at a time through the cache until a copy goes.
    def push_until(copies: int) -> None:
        for _ in range(4 * NUM_BLOCKS):
            if fresh.copies_of(h) == copies:
                return
            _complete_and_wait(engine, sub, _tokens(rng, BLOCK))
        pytest.fail(f"{fresh.copies_of(h)} copies of the block left after {4 * NUM_BLOCKS} prompts")

    push_until(1)
    assert fresh.holds(h)
    probe = filled + _tokens(rng, 3)
    assert fresh.matched_blocks(mapper.keys(probe)) == 3
    assert _cached(engine.complete(probe, max_tokens=1)) == 3 * BLOCK
    push_until(0)
    assert not fresh.holds(h) and fresh.unknown_removals == 0
    predicted = fresh.matched_blocks(mapper.keys(probe)) * BLOCK
    assert predicted < 3 * BLOCK
    assert _cached(engine.complete(probe, max_tokens=1)) == predicted


@needs_vllm
def test_reset_prefix_cache_clears_the_view(engine, sub, mapper, fresh):
    """AllBlocksCleared goes out with the next step's events: after the reset, a probe prompt's
    blocks are all the view holds, without a single BlockRemoved."""
    prompt = _tokens(random.Random(15), 2 * BLOCK + 1)
    _complete_and_wait(engine, sub, prompt)
    removed = fresh.removed_blocks
    assert engine.reset_prefix_cache()
    _sync(engine, sub)
    assert len(fresh.hashes()) == 1 and fresh.removed_blocks == removed
    assert fresh.matched_blocks(mapper.keys(prompt)) == 0
    assert _cached(engine.complete(prompt, max_tokens=1)) == 0


class _DroppingSubscriber(ev.KvEventSubscriber):
    """Loses chosen live messages, as a PUB socket does under load."""

    def __init__(self, drop: int) -> None:
        super().__init__()
        self.to_drop = drop
        self.dropped: list[int] = []

    def _on_live(self, feed, seq, payload):
        if feed.view.next_seq is not None and self.to_drop > 0:
            self.to_drop -= 1
            self.dropped.append(seq)
            return
        super()._on_live(feed, seq, payload)


@needs_vllm
def test_late_join_and_gaps_are_filled_from_the_replay_socket(engine, sub, mapper, fresh):
    rng = random.Random(16)
    for _ in range(3):
        _complete_and_wait(engine, sub, _tokens(rng, 2 * BLOCK + 1))
    with _DroppingSubscriber(drop=3) as late:
        view = late.add_engine("e0", engine.events_endpoint, engine.replay_endpoint, topic=engine.topic, keys=mapper)
        for _ in range(5):
            _complete_and_wait(engine, sub, _tokens(rng, 2 * BLOCK + 1))
        _sync(engine, sub)
        assert late.wait_for(lambda: view.next_seq == fresh.next_seq, EVENT_TIMEOUT_S), (view, fresh)
        assert late.dropped, "nothing was dropped: the test did not test the gap path"
        assert view.replayed > 0 and view.gaps_filled >= 2  # the late join, then each drop
        assert view.complete and not view.errors
        assert view.copies == fresh.copies and view.keys() == fresh.keys()


@needs_vllm
def test_pause_and_resume(engine, sub, fresh):
    prompt = _tokens(random.Random(17), BLOCK + 1)
    engine.pause()
    try:
        with pytest.raises(harness.EngineError):
            engine.complete(prompt, timeout_s=2.0)
    finally:
        engine.resume()
    assert engine.healthy(timeout_s=30.0)
    _complete_and_wait(engine, sub, prompt)


@needs_vllm
def test_an_engine_restart_resets_the_view(engine, sub, mapper, fresh):
    """Killed with SIGKILL and started again behind the same sockets: a new process with an empty
    cache and a sequence that starts again at 0. The view forgets the old engine's blocks."""
    rng = random.Random(18)
    old = _tokens(rng, 2 * BLOCK + 1)
    _complete_and_wait(engine, sub, old)
    pids = engine.pids()
    engine.kill()
    assert not engine.pids() and not harness.live_pids(), harness.live_pids()
    assert not set(pids) & set(harness.live_pids())
    # The subscriber notices the dropped connection (and opens a fresh socket) while it pumps.
    assert sub.wait_for(lambda: fresh.disconnected, EVENT_TIMEOUT_S)
    engine.start()
    new = _tokens(rng, 2 * BLOCK + 1)
    _complete_and_wait(engine, sub, new)
    assert fresh.restarts == 1
    assert fresh.matched_blocks(mapper.keys(old)) == 0 and fresh.matched_blocks(mapper.keys(new)) == 2
    assert _cached(engine.complete(old, max_tokens=1)) == 0


# -- the sequence, against a publisher the test controls ----------------------------------------------


@needs_vllm
def test_a_sequence_that_goes_back_resets_the_view_and_lost_history_is_flagged(tmp_path):
    """Without a dropped connection: the sequence starting again means a new engine process;
    a gap the replay buffer cannot fill leaves the view marked incomplete."""
    import threading

    import msgpack
    import zmq

    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)
    pub.bind(f"ipc://{tmp_path}/pub")
    router.bind(f"ipc://{tmp_path}/replay")
    served, stop = [], threading.Event()

    def replay_server():  # a buffer that has lost everything: only the end marker
        while not stop.is_set():
            if router.poll(50):
                client, _, start = router.recv_multipart()
                served.append(int.from_bytes(start, "big"))
                router.send_multipart([client, b"", b"", ev.END_SEQ, b""])

    thread = threading.Thread(target=replay_server, daemon=True)
    thread.start()
    tokens = _tokens(random.Random(20), 3 * BLOCK)
    h = ev.vllm_block_hashes(tokens, BLOCK)

    def send(seq, *events):
        pub.send_multipart([b"kv", seq.to_bytes(8, "big"), msgpack.packb([1.0, list(events), 0])])

    def stored(i):
        return {"type": "BlockStored", "block_hashes": [h[i]], "parent_block_hash": h[i - 1] if i else None,
                "token_ids": tokens[i * BLOCK : (i + 1) * BLOCK], "block_size": BLOCK, "medium": "GPU"}  # fmt: skip

    try:
        with ev.KvEventSubscriber(replay_timeout_s=5.0) as sub:
            view = sub.add_engine("x", f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", topic="kv", keys=ev.KeyMapper(_namespace()))
            assert pub.poll(10_000) and pub.recv() == b"\x01kv"  # the subscription arrived
            send(0, stored(0))
            send(1, stored(1))
            assert sub.wait_for(lambda: view.holds(h[1]), 10.0)
            send(0, {"type": "BlockStored", "block_hashes": [h[0]], "parent_block_hash": None,
                     "token_ids": tokens[:BLOCK], "block_size": BLOCK, "medium": "GPU"})  # fmt: skip
            assert sub.wait_for(lambda: view.restarts == 1, 10.0)
            assert view.hashes() == {h[0]} and view.complete
            send(3, stored(1))  # seq 1 and 2 of the new process were lost, and the buffer has neither
            assert sub.wait_for(lambda: view.next_seq == 4, 10.0)
            assert served == [1] and not view.complete
            assert view.hashes() == {h[0], h[1]} and view.matched_blocks(view.mapper.keys(tokens)) == 2
    finally:
        stop.set()
        thread.join()
        pub.close(linger=0)
        router.close(linger=0)
        ctx.term()
