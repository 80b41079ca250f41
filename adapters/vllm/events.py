"""kvcc's view of what each vLLM engine holds in its prefix cache, kept from vLLM's KV events.

    sub = KvEventSubscriber()
    view = sub.add_engine("e0", engine.events_endpoint, engine.replay_endpoint, topic="kv",
                          keys=KeyMapper(Namespace("kvcc/tiny-llama", rev, "bfloat16", 32)))
    sub.wait_for(lambda: view.holds(h), timeout_s=30)
    view.matched_blocks(keys)        # how many leading blocks of a prompt this engine holds

Theory of operation
-------------------
**The wire.** vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``) sends one
multipart message per scheduler step that produced events: ``(topic, seq, payload)``, ``seq`` an
8-byte big-endian counter that starts at 0 with the engine and grows by one per message, the
payload msgpack of ``[ts, [event, ...], data_parallel_rank]`` where each event is a map tagged by
``"type"``. It keeps the last ``buffer_steps`` payloads; its ROUTER replay socket answers a request
``[b"", start seq]`` with every buffered ``[b"", topic, seq, payload]`` from ``start`` on, then
``[b"", b"", -1, b""]``. PUB drops messages when a subscriber is slow or not yet connected, so the
subscriber trusts only the sequence: a jump forward is a gap, filled from the replay socket; a
first message with ``seq > 0`` means we joined late, so everything from 0 is replayed; a sequence
that goes *back* (or a dropped connection, seen by a socket monitor) means a new engine process
behind the same endpoint, whose cache starts empty: that engine's view is reset and rebuilt from
the new process's sequence 0. (On a dropped connection the SUB socket is replaced by a fresh one,
which connects whenever the new process binds; messages it publishes before that are missed like
any slow joiner's and replayed when the next one arrives.) What the replay buffer no longer holds cannot be recovered: the
view is then marked ``complete = False`` (and stays so until the engine's cache is cleared).

**What the events mean** (``vllm/v1/core/block_pool.py``). The prefix cache maps a block hash to
*one or more* physical blocks: vLLM does not de-duplicate (a block that fills up during decoding
is cached even when another block already holds the same hash). Each physical block that becomes
cached emits ``BlockStored`` (a run of consecutive blocks of one request in one event: the first
block's ``parent_block_hash``, all their ``token_ids``, ``block_size``, ``medium``, per-block
``extra_keys``), and each physical block whose hash is dropped (evicted for reuse, or re-hashed)
emits ``BlockRemoved`` for that one copy. So a hash stays cached until as many removals as stores
have arrived: the view counts copies per ``(medium, group, hash)`` and an engine holds a hash while
any count is positive. ``AllBlocksCleared`` (``/reset_prefix_cache``, which vLLM refuses while any
block is in use) empties the cache without any ``BlockRemoved``. Caveat: a request sent with
``vllm_xargs={"kv_cache_report_mode": "full"}`` makes vLLM re-announce the blocks it *reused* as
``BlockStored`` with no new copy and no later removal; such requests would leave stale entries,
and the harness never sends them.

**Block hashes and kvcc keys.** With ``--prefix-caching-hash-algo sha256_cbor`` vLLM's block hash is
``SHA-256(canonical CBOR [parent hash or NONE_HASH, [token ids], extra keys])`` with ``NONE_HASH =
SHA-256(CBOR "vllm-none-hash")`` and, for a plain request, extra keys ``[["cache_salt", salt]]`` on
the first block only (``null`` otherwise). kvcc's own CBOR encoder produces the same bytes, so
the subscriber *recomputes* every hash it is sent (from the parent's, which it learnt earlier) and
rejects a batch whose hashes do not match: an engine with another hash algorithm, or with
``PYTHONHASHSEED`` set (which changes the seed), would otherwise be keyed wrongly. Events carry
full 32-byte hashes when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` (the harness sets it); the
default low-64-bit integers are accepted and checked against the low 64 bits of the recomputation.

Each verified block also gets its kvcc key, ``BlockKey.chain(namespace, parent key, tokens)``,
where the namespace (``kvcc.spec.keys.Namespace``) is the engine's (model and revision, KV dtype,
block size, layout, tensor- and pipeline-parallel rank) with the request's cache salt: the salt
that vLLM folds into the first block's hash lives in kvcc's namespace digest instead, and the
chain carries it to every later block, as in vLLM. Blocks whose key cannot be derived (a LoRA
request, whose event omits the adapter path vLLM hashes; multimodal or prompt-embedding inputs;
a block whose parent the view never saw) are still held by hash, with no key.

One ``KvEventSubscriber`` follows any number of engines from the calling thread: ``pump()`` applies
what has arrived, ``wait_for()`` pumps until a condition holds or a deadline passes.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgpack
from attrs import define, evolve, field, frozen

from kvcc.spec.keys import BlockKey, Namespace, cbor_encode

try:  # the vllm extra brings pyzmq; decoding, hashing and the view need only msgpack
    import zmq
    from zmq.utils.monitor import recv_monitor_message
except ModuleNotFoundError:  # pragma: no cover - depends on the environment
    zmq = None

__all__ = [
    "NONE_HASH",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineView",
    "KeyMapper",
    "KvEventError",
    "KvEventSubscriber",
    "decode_batch",
    "vllm_block_hash",
    "vllm_block_hashes",
]

NONE_HASH_SEED = "vllm-none-hash"  # vllm.v1.core.kv_cache_utils.DEFAULT_NONE_HASH_SEED
NONE_HASH = hashlib.sha256(cbor_encode(NONE_HASH_SEED)).digest()
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay socket's end-of-replay marker
REPLAY_TIMEOUT_S = 5.0
MAX_EVENTS_PER_BATCH = 1 << 16
_LOW64 = (1 << 64) - 1

ExternalHash = bytes | int  # vLLM's ExternalBlockHash: 32 bytes, or the low 64 bits as an int


class KvEventError(ValueError):
    """A payload that is not a well-formed KV event batch, or whose block hashes do not match
    their recomputation from parent and tokens. The view is left as it was."""


# -- events -----------------------------------------------------------------------------------------


@frozen
class BlockStored:
    """One run of consecutive full blocks of one request became cached (one copy each)."""

    block_hashes: tuple[ExternalHash, ...]
    parent_block_hash: ExternalHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None
    group_idx: int
    lora_name: str | None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None  # one entry per block, untagged
    cache_salt: str | None = None  # the request's salt, where the engine sends it (SGLang does)


@frozen
class BlockRemoved:
    """One cached copy of each of ``block_hashes`` was dropped."""

    block_hashes: tuple[ExternalHash, ...]
    medium: str | None
    group_idx: int


@frozen
class AllBlocksCleared:
    """The engine dropped every cached block (``/reset_prefix_cache``)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


def _hash(value: Any, what: str) -> ExternalHash:
    if isinstance(value, bytes) and len(value) == 32:
        return value
    # vLLM's low 64 bits are unsigned; SGLang publishes signed int64 (``hash_str_to_int64``)
    if isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value <= _LOW64:
        return value
    raise KvEventError(f"{what}: a block hash is 32 bytes or a 64-bit int, got {value!r:.80}")


def _int(value: Any, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise KvEventError(f"{what}: expected an int >= {low}, got {value!r:.80}")
    return value


def _opt_str(value: Any, what: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise KvEventError(f"{what}: expected a string or nil, got {value!r:.80}")
    return value


def _hashes(value: Any, what: str) -> tuple[ExternalHash, ...]:
    if not isinstance(value, list) or not value:
        raise KvEventError(f"{what}: block_hashes must be a non-empty list")
    return tuple(_hash(h, what) for h in value)


def _freeze(value: Any) -> Any:
    return tuple(_freeze(v) for v in value) if isinstance(value, list) else value


def _decode_event(raw: Any, i: int) -> Event:
    what = f"event {i}"
    if not isinstance(raw, dict):
        raise KvEventError(f"{what}: expected a map, got {type(raw).__name__}")
    kind = raw.get("type")
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(raw.get("block_hashes"), what), _opt_str(raw.get("medium"), what), _int(raw.get("group_idx", 0) or 0, what))
    if kind != "BlockStored":
        raise KvEventError(f"{what}: unknown event type {kind!r:.40}")
    hashes = _hashes(raw.get("block_hashes"), what)
    parent = raw.get("parent_block_hash")
    parent = None if parent is None else _hash(parent, what)
    tokens = raw.get("token_ids")
    if not isinstance(tokens, list):
        raise KvEventError(f"{what}: token_ids must be a list")
    tokens = tuple(_int(t, what) for t in tokens)
    block_size = _int(raw.get("block_size"), what, low=1)
    if len(tokens) != block_size * len(hashes):
        raise KvEventError(f"{what}: {len(tokens)} token ids for {len(hashes)} blocks of {block_size}")
    extra = raw.get("extra_keys")
    if extra is not None:
        if not isinstance(extra, list) or len(extra) != len(hashes):
            raise KvEventError(f"{what}: extra_keys must hold one entry per block")
        extra = tuple(None if e is None else _freeze(e) if isinstance(e, list) else (e,) for e in extra)
    return BlockStored(
        hashes, parent, tokens, block_size, _opt_str(raw.get("medium"), what),
        _int(raw.get("group_idx", 0) or 0, what), _opt_str(raw.get("lora_name"), what), extra,
        _opt_str(raw.get("cache_salt"), what),
    )  # fmt: skip


def decode_batch(payload: bytes) -> tuple[float, list[Event], int | None]:
    """``(ts, events, data_parallel_rank)`` from one message's payload. Raises ``KvEventError``."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, max_array_len=MAX_EVENTS_PER_BATCH * 64)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise KvEventError(f"payload is not msgpack: {e}") from None
    if not isinstance(raw, list) or len(raw) not in (2, 3):
        raise KvEventError("payload must be [ts, [events], dp_rank]")
    ts, events = raw[0], raw[1]
    dp_rank = raw[2] if len(raw) == 3 else None
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise KvEventError(f"ts must be a number, got {ts!r:.40}")
    if not isinstance(events, list) or len(events) > MAX_EVENTS_PER_BATCH:
        raise KvEventError(f"events must be a list of at most {MAX_EVENTS_PER_BATCH}")
    if dp_rank is not None:
        _int(dp_rank, "data_parallel_rank")
    return float(ts), [_decode_event(e, i) for i, e in enumerate(events)], dp_rank


# -- vLLM's block hash (sha256_cbor) ------------------------------------------------------------------


def vllm_block_hash(parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...] | None = None) -> bytes:
    """vLLM's ``hash_block_tokens`` with ``sha256_cbor``: SHA-256 of the canonical CBOR of
    ``(parent or NONE_HASH, tuple(token_ids), extra_keys)`` (extra keys tagged, as vLLM hashes them)."""
    return hashlib.sha256(cbor_encode([parent or NONE_HASH, list(token_ids), extra_keys])).digest()


def vllm_block_hashes(tokens: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """The hashes vLLM gives the full blocks of a plain (no LoRA, text-only) prompt."""
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
        hashes.append(vllm_block_hash(hashes[-1] if hashes else None, tokens[start : start + block_size], extra))
    return hashes


def _tagged_extra(event: BlockStored, i: int, first_of_request: bool) -> tuple[bool, tuple[Any, ...] | None, str | None]:
    """``(supported, extra keys as vLLM hashed them, cache salt)`` for block ``i`` of ``event``.
    Only plain requests are supported: no LoRA (the event omits the path vLLM hashes), no
    multimodal or prompt-embedding keys; a cache salt is a lone string on a request's first block."""
    if event.lora_name is not None:
        return False, None, None
    entry = None if event.extra_keys is None else event.extra_keys[i]
    if entry is None:
        return True, None, None
    if first_of_request and len(entry) == 1 and isinstance(entry[0], str):
        return True, (("cache_salt", entry[0]),), entry[0]
    return False, None, None


# -- keys ---------------------------------------------------------------------------------------------


class KeyMapper:
    """kvcc's keys for one engine's blocks. ``base`` is the engine's namespace: model id and
    revision, KV dtype, block size, layout, tensor/pipeline rank; its ``cache_salt`` must be
    empty, since the salt comes with each request."""

    def __init__(self, base: Namespace) -> None:
        if base.cache_salt:
            raise ValueError("the engine's namespace takes no cache salt: each request brings its own")
        self.base = base
        self._by_salt: dict[str | None, Namespace] = {}

    @property
    def block_tokens(self) -> int:
        return self.base.block_tokens

    def namespace(self, cache_salt: str | None) -> Namespace:
        """The namespace of a request with ``cache_salt`` (``None`` or ``""``: unsalted)."""
        ns = self._by_salt.get(cache_salt)
        if ns is None:
            ns = evolve(self.base, cache_salt=(cache_salt or "").encode("utf-8"))
            self._by_salt[cache_salt] = ns
        return ns

    def key(self, cache_salt: str | None, parent: BlockKey | None, token_ids: Sequence[int]) -> BlockKey:
        return BlockKey.chain(self.namespace(cache_salt), parent, token_ids)

    def keys(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[BlockKey]:
        """The kvcc keys of every full block of a prompt."""
        keys: list[BlockKey] = []
        size = self.block_tokens
        for start in range(0, len(tokens) - size + 1, size):
            keys.append(self.key(cache_salt, keys[-1] if keys else None, tokens[start : start + size]))
        return keys


# -- one engine's view ----------------------------------------------------------------------------


@frozen
class _Record:
    """What the view knows of a hash it holds: vLLM's full hash (``None`` if not derivable), its
    kvcc key (``None`` if not derivable), and the request's cache salt that the chain carries."""

    full: bytes | None
    key: BlockKey | None
    salt: str | None


@define
class EngineView:
    """What one engine holds, as its events say. ``copies`` counts cached copies per
    ``(medium, group, hash)``; ``records`` has the full hash and kvcc key of every hash held."""

    engine_id: str
    mapper: KeyMapper | None = None
    copies: Counter = field(factory=Counter)
    records: dict[ExternalHash, _Record] = field(factory=dict)
    next_seq: int | None = None  # the sequence number expected next; None before the first message
    disconnected: bool = False  # the publisher went away: the next message may be a new process's
    complete: bool = True  # False once events were lost beyond what the replay buffer held
    batches: int = 0
    restarts: int = 0
    gaps_filled: int = 0
    replayed: int = 0  # batches applied from the replay socket
    stored_blocks: int = 0  # BlockStored copies applied
    removed_blocks: int = 0  # BlockRemoved copies applied
    unknown_removals: int = 0  # removals of a hash the view did not hold (events lost earlier)
    unkeyed: int = 0  # blocks stored with no derivable kvcc key
    errors: list[str] = field(factory=list)
    _totals: Counter = field(factory=Counter, repr=False)
    _key_index: dict[BlockKey, ExternalHash] = field(factory=dict, repr=False)

    # ---------------------------------------------------------------- queries
    def holds(self, block_hash: ExternalHash) -> bool:
        return self._totals[block_hash] > 0

    def copies_of(self, block_hash: ExternalHash) -> int:
        return self._totals[block_hash]

    def hashes(self) -> set[ExternalHash]:
        return set(self._totals)

    def keys(self) -> set[BlockKey]:
        return set(self._key_index)

    def holds_key(self, key: BlockKey) -> bool:
        return key in self._key_index

    def matched_blocks(self, keys: Iterable[BlockKey]) -> int:
        """How many leading blocks of a prompt (its kvcc keys, in order) this engine holds."""
        n = 0
        for k in keys:
            if k not in self._key_index:
                break
            n += 1
        return n

    # ---------------------------------------------------------------- updates
    def reset(self) -> None:
        """Forget everything (a new engine process: its cache starts empty)."""
        self.copies.clear()
        self._totals.clear()
        self.records.clear()
        self._key_index.clear()
        self.complete = True

    def apply_batch(self, events: Sequence[Event]) -> None:
        """Apply one batch atomically: every stored hash is verified first; on ``KvEventError``
        nothing changes."""
        new_records = self._verify(events)
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.reset()
            elif isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    self._add(ev.medium, ev.group_idx, h, new_records[h])
            else:
                for h in ev.block_hashes:
                    self._remove(ev.medium, ev.group_idx, h)
        self.batches += 1

    def _verify(self, events: Sequence[Event]) -> dict[ExternalHash, _Record]:
        """The record of every hash stored in ``events``, each recomputed from its parent's."""
        staged: dict[ExternalHash, _Record] = {}
        for ev in events:
            if not isinstance(ev, BlockStored):
                continue
            parent_hash = ev.parent_block_hash
            parent = None if parent_hash is None else staged.get(parent_hash) or self.records.get(parent_hash)
            for i, h in enumerate(ev.block_hashes):
                staged[h] = parent = self._record(ev, i, parent_hash, parent, h)
                parent_hash = h
        return staged

    def _record(self, ev: BlockStored, i: int, parent_hash: ExternalHash | None, parent: _Record | None, h: ExternalHash) -> _Record:
        first = parent_hash is None
        supported, extra, salt = _tagged_extra(ev, i, first)
        if not first:
            salt = None if parent is None else parent.salt
        if not supported or (not first and (parent is None or parent.full is None)):
            return _Record(None, None, salt)
        tokens = ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size]
        full = vllm_block_hash(None if first else parent.full, tokens, extra)
        expected = full if isinstance(h, bytes) else int.from_bytes(full, "big") & _LOW64
        if expected != h:
            raise KvEventError(
                f"engine {self.engine_id}: block hash {h!r:.70} is not sha256_cbor of its parent and tokens "
                "(is the engine run with --prefix-caching-hash-algo sha256_cbor and without PYTHONHASHSEED?)"
            )
        key = None
        m = self.mapper
        if m is not None and ev.block_size == m.block_tokens and (first or parent.key is not None):
            key = m.key(salt, None if first else parent.key, tokens)
        return _Record(full, key, salt)

    def _add(self, medium: str | None, group: int, h: ExternalHash, record: _Record) -> None:
        self.copies[(medium, group, h)] += 1
        self.stored_blocks += 1
        self._totals[h] += 1
        if h not in self.records:
            self.records[h] = record
            if record.key is None:
                self.unkeyed += 1
            else:
                self._key_index[record.key] = h

    def _remove(self, medium: str | None, group: int, h: ExternalHash) -> None:
        slot = (medium, group, h)
        if self.copies[slot] <= 0:
            self.copies.pop(slot, None)
            self.unknown_removals += 1
            return
        self.copies[slot] -= 1
        self.removed_blocks += 1
        if not self.copies[slot]:
            del self.copies[slot]
        self._totals[h] -= 1
        if not self._totals[h]:
            del self._totals[h]
            record = self.records.pop(h, None)
            if record is not None and record.key is not None:
                self._key_index.pop(record.key, None)


# -- the subscriber ---------------------------------------------------------------------------------


@define(eq=False)
class _Feed:
    view: EngineView
    endpoint: str
    replay_endpoint: str | None
    topic: bytes
    sub: Any
    monitor: Any


class KvEventSubscriber:
    """Follows the KV events of any number of engines (one SUB socket each) from the calling
    thread. Not thread-safe: pump from one thread."""

    def __init__(self, *, replay_timeout_s: float = REPLAY_TIMEOUT_S) -> None:
        if zmq is None:
            raise ModuleNotFoundError("pyzmq is not installed: install the vllm extra (bash scripts/setup.sh --with vllm)")
        self._ctx = zmq.Context()
        self._feeds: dict[str, _Feed] = {}
        self._poller = zmq.Poller()
        self.replay_timeout_s = replay_timeout_s

    def add_engine(
        self, engine_id: str, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
        keys: KeyMapper | None = None, view: EngineView | None = None,
    ) -> EngineView:
        """Follow engine ``engine_id``'s events into ``view`` (default: a vLLM ``EngineView`` with ``keys``)."""
        if engine_id in self._feeds:
            raise ValueError(f"engine {engine_id!r} is already followed")
        view = EngineView(engine_id, keys) if view is None else view
        feed = _Feed(view, endpoint, replay_endpoint, topic.encode("utf-8"), None, None)
        self._open(feed)
        self._feeds[engine_id] = feed
        return feed.view

    def _open(self, feed: _Feed) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)  # never drop on our side; the sequence check covers PUB's drops
        sub.setsockopt(zmq.SUBSCRIBE, feed.topic)
        feed.monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(feed.endpoint)
        feed.sub = sub
        self._poller.register(sub, zmq.POLLIN)
        self._poller.register(feed.monitor, zmq.POLLIN)

    def _close(self, feed: _Feed) -> None:
        self._poller.unregister(feed.sub)
        self._poller.unregister(feed.monitor)
        feed.sub.disable_monitor()
        feed.monitor.close(linger=0)
        feed.sub.close(linger=0)

    def view(self, engine_id: str) -> EngineView:
        try:
            return self._feeds[engine_id].view
        except KeyError:
            raise KeyError(f"engine {engine_id!r} is not followed") from None

    def views(self) -> dict[str, EngineView]:
        return {name: f.view for name, f in self._feeds.items()}

    def engines_holding(self, key: BlockKey) -> list[str]:
        return sorted(name for name, f in self._feeds.items() if f.view.holds_key(key))

    def close(self) -> None:
        for f in self._feeds.values():
            self._close(f)
        self._feeds.clear()
        self._ctx.term()

    def __enter__(self) -> KvEventSubscriber:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------- pumping
    def pump(self, timeout_s: float = 0.0) -> int:
        """Apply the messages that arrive within ``timeout_s`` (at least one round of what is
        already queued); returns the number of messages handled."""
        handled = 0
        deadline = time.monotonic() + timeout_s
        while True:
            wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
            ready = dict(self._poller.poll(wait_ms))
            if not ready:
                return handled
            for feed in list(self._feeds.values()):
                if feed.sub in ready or feed.monitor in ready:
                    handled += self._drain(feed)
                if feed.monitor in ready and self._disconnected(feed):
                    handled += self._drain(feed)  # what the old process sent before it went
                    self._close(feed)
                    self._open(feed)
                    feed.view.disconnected = True
            if time.monotonic() >= deadline:
                return handled  # a busy engine must not keep the caller here forever

    def _drain(self, feed: _Feed) -> int:
        n = 0
        while True:
            try:
                frames = feed.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return n
            self._on_frames(feed, frames)
            n += 1

    def wait_for(self, condition: Callable[[], bool], timeout_s: float) -> bool:
        """Pump until ``condition()`` holds (True) or ``timeout_s`` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.pump(min(left, 0.2))
        return True

    def _disconnected(self, feed: _Feed) -> bool:
        """Whether the publisher went away (whatever comes next may be a new process). The
        socket is then replaced by a fresh one: a SUB socket left to reconnect by itself was
        seen here never to receive from the engine's next process on the same ipc path."""
        lost = False
        while True:
            try:
                msg = recv_monitor_message(feed.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return lost
            lost = lost or msg["event"] == zmq.EVENT_DISCONNECTED

    def _on_frames(self, feed: _Feed, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            feed.view.errors.append(f"malformed message of {len(frames)} frames")
            return
        self._on_live(feed, int.from_bytes(frames[1], "big"), frames[2])

    def _on_live(self, feed: _Feed, seq: int, payload: bytes) -> None:
        """One message from the PUB socket: check its sequence number, fill gaps, apply.
        Live messages of one publisher arrive in order and a replay stops short of the live one,
        so a sequence number below the expected one can only come from a new process."""
        view = feed.view
        if view.disconnected or (view.next_seq is not None and seq < view.next_seq):
            if view.next_seq is not None:
                view.restarts += 1
            view.disconnected = False
            view.reset()
            view.next_seq = 0
        if view.next_seq is None:
            view.next_seq = 0  # first contact: everything from the engine's start is replayed
        if seq > view.next_seq:
            self._fill(feed, view.next_seq, seq)
        if seq > view.next_seq:
            view.complete = False  # neither the live stream nor the replay buffer had them
        self._apply(feed, seq, payload)

    def _apply(self, feed: _Feed, seq: int, payload: bytes) -> None:
        view = feed.view
        try:
            _, events, _ = decode_batch(payload)
            view.apply_batch(events)
        except KvEventError as e:
            view.errors.append(f"seq {seq}: {e}")
            view.complete = False
        view.next_seq = seq + 1

    def _fill(self, feed: _Feed, start: int, live_seq: int) -> None:
        """Ask the engine's replay socket for batches ``start`` onward and apply those up to
        the live message ``live_seq``; a batch the buffer no longer has leaves the view incomplete."""
        view = feed.view
        if feed.replay_endpoint is None:
            return
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(feed.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not dealer.poll(left_ms):
                    view.errors.append(f"replay from {start}: no end marker within {self.replay_timeout_s} s")
                    return
                frames = dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    view.errors.append(f"replay: malformed reply of {len(frames)} frames")
                    return
                _, _, seq_bytes, payload = frames
                if seq_bytes == END_SEQ:
                    view.gaps_filled += 1
                    return
                seq = int.from_bytes(seq_bytes, "big")
                if seq < view.next_seq or seq >= live_seq:
                    continue
                if seq > view.next_seq:
                    view.complete = False  # the buffer no longer holds what came before
                self._apply(feed, seq, payload)
                view.replayed += 1
        finally:
            dealer.close(linger=0)
