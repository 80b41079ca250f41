"""kvcc as SGLang's HiCache storage: ``KvccHiCacheStorage`` loaded by SGLang's own
``StorageBackendFactory`` (the ``dynamic`` backend) against a real kvcc cluster (a directory and one
cache node, processes on loopback), and SGLang's own ``HiCacheFile`` on the same calls.

What runs of SGLang here: its real storage classes (``HiCacheStorage``, ``HiCacheStorageConfig``,
``StorageBackendFactory``, ``HiCacheFile``), never its server (no CPU build). Two stand-ins, each
because the real thing does not load on this machine: the host KV pool is ``_HostPool`` below, a
copy of the page geometry of SGLang's ``MHATokenToKVPoolHost`` with the ``layer_first`` layout
(the real class's module imports SGLang's model configs, which import torchvision -- never
installed here, it would replace the CPU torch); page keys are SHA-256 chains in SGLang's form
(64 hex digits, each page's hash over the previous one's) computed with hashlib, since SGLang's
own ``get_hash_str`` compiles a C++ extension on first use. The test of per-request tenants does
call SGLang's ``get_storage_hash_str`` (that extension: it needs a C++ compiler and OpenSSL's
headers), on a stand-in for ``RadixKey`` (whose module imports those model configs).

Each test uses pages of fresh random tokens, so tests do not see each other's pages. Needs SGLang
(``bash scripts/setup.sh --with sglang``; ``--with vllm``, the README's test command, includes it);
without it the tests fail naming that command (a skipped test is not a passing one).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from kvcc.reference.wire import Batch

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorage, HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    _MISSING = ""
except ImportError as e:  # the test fails below, naming the install command
    _MISSING = str(e)

MODEL = "kvcc/sglang-test"
OTHER_MODEL = "kvcc/sglang-other"
SALT = "tenant-b"
REVISION = "r1"
PAGE = 4  # tokens per page
LAYERS, HEADS, HEAD_DIM = 2, 2, 8
DTYPE = torch.float16
PAGE_BYTES = 2 * LAYERS * PAGE * HEADS * HEAD_DIM * 2  # K and V, float16: 512 bytes
HOST_PAGES = 16
BLOCK_BYTES = 64 << 10  # a node slot
LEASE_TERM_MS = 1000
SKEW_MS = 50
INVALIDATION_TIMEOUT_S = 30.0
UNTIL_S = 20.0
VOCAB = range(3, 30_000)


# ---------------------------------------------------------------------------- SGLang-side helpers


class _HostPool:
    """The page geometry of SGLang's ``MHATokenToKVPoolHost``, layout ``layer_first``: a
    ``[2, layers, tokens, heads, head_dim]`` buffer, page ``i`` at tokens ``i .. i + page_size``;
    the three methods SGLang's storage paths call, with the same semantics."""

    layout = "layer_first"

    def __init__(self, pages: int = HOST_PAGES) -> None:
        self.page_size, self.dtype, self.device = PAGE, DTYPE, "cpu"
        self.kv_buffer = torch.zeros((2, LAYERS, pages * PAGE, HEADS, HEAD_DIM), dtype=DTYPE)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, :, index : index + self.page_size, :, :]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, LAYERS, PAGE, HEADS, HEAD_DIM), dtype=DTYPE).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, :, index : index + self.page_size, :, :] = data_page.reshape(2, LAYERS, PAGE, HEADS, HEAD_DIM)


def _config(extra: dict, model: str = MODEL) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                model_name=model, extra_config=extra)  # fmt: skip


def _page_keys(rng: random.Random, pages: int) -> list[str]:
    """SGLang-shaped page keys of a fresh random prompt: hex SHA-256, each over the previous."""
    keys, prior = [], b""
    for _ in range(pages):
        tokens = [rng.choice(VOCAB) for _ in range(PAGE)]
        prior = hashlib.sha256(prior + b"".join(t.to_bytes(4, "little") for t in tokens)).digest()
        keys.append(prior.hex())
    return keys


def _page(rng: random.Random) -> torch.Tensor:
    """A flat float16 page of random bit patterns (NaNs and all: compared as bytes)."""
    raw = bytes(rng.getrandbits(8) for _ in range(PAGE_BYTES))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(DTYPE).clone()


def _bytes(t: torch.Tensor | None) -> bytes | None:
    return None if t is None else t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _sglang_page_keys(tokens: list[int], extra_key: str | None = None, cache_salt: str | None = None) -> list[str]:
    """The page keys SGLang gives a request's tokens in storage: its own ``get_storage_hash_str``,
    the chain seeded by extra key and cache salt (``kvcc.adapters.sglang.server.page_hashes``)."""
    from kvcc.adapters.sglang.server import page_hashes

    return page_hashes(tokens, PAGE, extra_key=extra_key, cache_salt=cache_salt)


class _Paused:
    """A page tensor whose ``method`` first sets ``reached`` and waits for ``go``: it stops a SGLang
    storage call at the point where the call uses the tensor (``HiCacheFile.set`` calls
    ``contiguous`` after deciding to write, before writing; ``HiCacheFile.get`` calls ``view`` after
    opening the page's file, before reading it). Everything else is the tensor's."""

    def __init__(self, tensor: torch.Tensor, method: str, reached: threading.Event, go: threading.Event) -> None:
        self.tensor, self._method, self._reached, self._go = tensor, method, reached, go

    def __getattr__(self, name: str):
        attr = getattr(self.tensor, name)
        if name != self._method:
            return attr

        def paused(*args, **kwargs):
            self._reached.set()
            assert self._go.wait(UNTIL_S), "never let go"
            return attr(*args, **kwargs)

        return paused


def _pause_client(client, method: str, reached: threading.Event, go: threading.Event, *, after: bool) -> None:
    """Make the kvcc client's ``method`` (a coroutine) set ``reached`` and wait for ``go`` before it
    runs, or ``after`` it ran and before its caller sees the answer. It waits on a thread: the
    client's loop keeps running (and acknowledging revocations). ``del client.<method>`` undoes it."""
    original = getattr(client, method)

    async def paused(*args, **kwargs):
        answer = await original(*args, **kwargs) if after else None
        reached.set()
        assert await asyncio.to_thread(go.wait, UNTIL_S), "never let go"
        return answer if after else await original(*args, **kwargs)

    setattr(client, method, paused)


def _until(pred, timeout_s: float = UNTIL_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


# ---------------------------------------------------------------------------- fixtures


def _namespace(model: str = MODEL, salt: str = ""):
    from kvcc.adapters.sglang.backend import storage_namespace

    return storage_namespace(_config({}, model), page_size=PAGE, kv_dtype="float16", kv_layout="layer_first",
                             model_id=model, model_revision=REVISION, cache_salt=salt)  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if _MISSING:
        pytest.fail(f"SGLang is required (bash scripts/setup.sh --with sglang): {_MISSING}")
    from kvcc.adapters.sglang.conformance import engine_namespace
    from kvcc.reference.cluster import LocalCluster

    cl = LocalCluster(tmp_path_factory.mktemp("kvcc") / "cluster", nodes=1, tiers=("nvme=16MiB",),
                      block_bytes=BLOCK_BYTES, lease_term_ms=LEASE_TERM_MS, skew_ms=SKEW_MS,
                      namespaces=[_namespace(), _namespace(OTHER_MODEL), _namespace(MODEL, SALT),
                                  engine_namespace(REVISION)])  # fmt: skip
    cl.start()
    try:
        yield cl
    finally:
        cl.stop()


@pytest.fixture(scope="module")
def tester(cluster):
    """A plain kvcc client of the same tenant: invalidates, and writes as another engine would."""
    return cluster.client("tester", events=False)


def _extra(cluster, client_id: str, salt: str = "") -> dict:
    host, port = cluster.directory_address
    return {"backend_name": "kvcc", "module_path": "kvcc.adapters.sglang.backend",
            "class_name": "KvccHiCacheStorage", "interface_v1": 1, "kvcc_directory": f"{host}:{port}",
            "kvcc_tenant": "engine", "kvcc_token_hex": cluster.engine_token.hex(), "kvcc_skew_ms": SKEW_MS,
            "kvcc_client_id": client_id, "kvcc_model_revision": REVISION, "kvcc_cache_salt": salt}  # fmt: skip


@pytest.fixture(scope="module")
def make_backend(cluster):
    """``make_backend(name, model=MODEL, salt="")``: a backend as SGLang's ``HiCacheController``
    attaches one: the factory's ``dynamic`` path, then ``register_mem_pool_host``."""
    made = []

    def make(name: str, model: str = MODEL, salt: str = ""):
        backend = StorageBackendFactory.create_backend("dynamic", _config(_extra(cluster, name, salt), model), None)
        backend.register_mem_pool_host(_HostPool())
        made.append(backend)
        return backend

    yield make
    for b in made:
        b.close()


@pytest.fixture(scope="module")
def backend(make_backend):
    return make_backend("sglang-a")


@pytest.fixture
def hicache_file(tmp_path, monkeypatch):
    """SGLang's own file backend on a fresh directory, through the same factory (``file``)."""
    if _MISSING:
        pytest.fail(f"SGLang is required (bash scripts/setup.sh --with sglang): {_MISSING}")
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)

    def make(model: str = MODEL):
        b = StorageBackendFactory.create_backend("file", _config({"file_storage_path": str(tmp_path / "hicache")},
                                                                 model), None)  # fmt: skip
        assert type(b) is HiCacheFile
        return b

    return make


# ---------------------------------------------------------------------------- tests


def test_sglangs_dynamic_factory_loads_the_backend(backend):
    from kvcc.adapters.sglang.backend import KvccHiCacheStorage, page_key

    assert type(backend) is KvccHiCacheStorage and isinstance(backend, HiCacheStorage)
    assert backend.namespace == _namespace()
    key = "ab" * 32
    assert backend.kvcc_key(key) == page_key(_namespace().digest(), key)
    assert backend.kvcc_key(key) != page_key(_namespace(OTHER_MODEL).digest(), key)


def test_a_set_page_reads_back_exactly_by_every_call(backend, make_backend):
    rng = random.Random(1)
    keys = _page_keys(rng, 3)
    pages = [_page(rng) for _ in keys]
    assert backend.batch_set(keys, pages) is True

    # get / batch_get into SGLang's flat page buffers, and get without a target.
    target = _HostPool().get_dummy_flat_data_page()
    assert backend.get(keys[0], target) is target and _bytes(target) == _bytes(pages[0])
    got = backend.batch_get(keys, [_HostPool().get_dummy_flat_data_page() for _ in keys])
    assert [_bytes(t) for t in got] == [_bytes(p) for p in pages]
    assert _bytes(backend.get(keys[2])) == _bytes(pages[2])

    # The zero-copy calls, host pool to host pool, through a second engine's backend.
    src, indices = backend.mem_pool_host, torch.arange(4 * PAGE, 7 * PAGE, dtype=torch.int64)
    v1_keys = _page_keys(rng, 3)
    v1_pages = [_page(rng) for _ in v1_keys]
    for i, p in enumerate(v1_pages):
        src.set_from_flat_data_page(int(indices[i * PAGE]), p)
    assert backend.batch_set_v1(v1_keys, indices) == [True, True, True]
    other = make_backend("sglang-b")
    dst_indices = torch.arange(9 * PAGE, 12 * PAGE, dtype=torch.int64)
    assert other.batch_get_v1(v1_keys, dst_indices) == [True, True, True]
    for i, p in enumerate(v1_pages):
        assert _bytes(other.mem_pool_host.get_data_page(int(dst_indices[i * PAGE]))) == _bytes(p)
    assert other.batch_exists(v1_keys + keys) == 6
    stats = other.get_stats()
    assert stats.prefetch_pgs == [3] and stats.kvcc["read_hits"] == 3
    assert backend.get_stats().kvcc["write_committed"] == 6


def test_batch_exists_counts_the_consecutive_hits_from_the_start(backend):
    rng = random.Random(2)
    keys = _page_keys(rng, 5)
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set([keys[0], keys[1], keys[3]], [_page(rng) for _ in range(3)])
    assert backend.batch_exists(keys) == 2  # the hit at 3 does not count: 2 is missing
    assert backend.batch_exists(keys[3:]) == 1
    assert backend.batch_exists(keys[2:]) == 0
    assert backend.batch_exists([]) == 0
    assert [backend.exists(k) for k in keys] == [True, True, False, True, False]


def test_batch_exists_leases_what_it_counts_until_the_prefetch_reads_it(make_backend, tester):
    """Where SGLang's prefetch decides what to load, the pages are leased: none of them can be
    evicted before the read, one invalidated in between is a miss, one whose lease ran out before
    the read is a miss (recomputed, never leased again behind the decision), and the read lets
    them go."""
    from kvcc.reference.client import Refused as ClientRefused
    from kvcc.spec.vocabulary import SCOPE_KEY

    rng = random.Random(12)
    backend = make_backend("sglang-prefetch")
    client = backend.client
    keys = _page_keys(rng, 4)
    pages = {k: _page(rng) for k in keys}
    assert backend.batch_set([keys[0], keys[1], keys[3]], [pages[keys[0]], pages[keys[1]], pages[keys[3]]])

    def held(key):
        lease = client.lease_of(backend.kvcc_key(key))
        return lease if lease is not None and client.trusted(lease) else None

    asked: list[int] = []
    acquire_many = client.acquire_many

    async def counting(ns, batch):
        asked.append(len(batch))
        return await acquire_many(ns, batch)

    client.acquire_many = counting
    try:
        assert backend.batch_exists(keys) == 2
        assert [held(k) is not None for k in keys] == [True, True, False, False]  # none past the gap
        # Counted, so leased: the node may not evict it before the prefetch reads it.
        lease = held(keys[0])
        assert isinstance(tester.evict(backend.kvcc_key(keys[0]), lease.location), ClientRefused)
        # A second decision on the same pages reuses the leases: no new acquire.
        assert backend.batch_exists(keys[:2]) == 2 and asked == [4]
        indices = torch.arange(0, 2 * PAGE, dtype=torch.int64)
        assert backend.batch_get_v1(keys[:2], indices) == [True, True] and asked == [4]
        assert [_bytes(backend.mem_pool_host.get_data_page(int(i))) for i in indices[::PAGE]] == \
            [_bytes(pages[k]) for k in keys[:2]]
        assert held(keys[0]) is not None, "released while the second decision was still to be read"
        assert backend.batch_get(keys[:2], [_HostPool().get_dummy_flat_data_page() for _ in range(2)])[0] is not None
        assert held(keys[0]) is None and held(keys[1]) is None, "read twice as decided: released"
        assert not isinstance(tester.evict(backend.kvcc_key(keys[0]), lease.location), ClientRefused)

        # Decided, then invalidated before the read: the lease is revoked, the read a miss.
        assert backend.batch_exists([keys[3]]) == 1 and held(keys[3]) is not None
        ticket = tester.invalidate(backend.namespace, SCOPE_KEY, backend.kvcc_key(keys[3]))
        assert tester.wait(ticket, INVALIDATION_TIMEOUT_S)  # the backend acknowledged the revocation
        target = _HostPool().get_dummy_flat_data_page()
        assert backend.get(keys[3], target) is None and held(keys[3]) is None
        assert not target.view(torch.uint8).any()

        # Decided, then the lease ran out before the read (the engine stalled): a miss, not a
        # lease taken again behind the decision; a page no decision covers is leased and read.
        assert backend.batch_exists([keys[1]]) == 1 and held(keys[1]) is not None
        before, lost = len(asked), backend.counts.get("read_refused_lease_lost", 0)
        time.sleep((LEASE_TERM_MS + 2 * SKEW_MS) / 1000)
        assert held(keys[1]) is None
        assert backend.batch_get([keys[1]]) == [None] and len(asked) == before
        assert backend.counts.get("read_refused_lease_lost") == lost + 1
        assert _bytes(backend.batch_get([keys[1]])[0]) == _bytes(pages[keys[1]])  # no decision now: leased, read
    finally:
        del client.acquire_many


def test_a_kept_lease_is_not_released_under_a_read_still_leasing_its_other_pages(make_backend):
    """Two reads of a page ``batch_exists`` leased: the one that finishes first lets go of the
    decision, not of the lease the other is still counting on while it leases its other pages."""
    rng = random.Random(13)
    backend = make_backend("sglang-two-reads")
    client = backend.client
    kept, other = _page_keys(rng, 2)
    pages = {k: _page(rng) for k in (kept, other)}
    assert backend.batch_set([kept, other], [pages[kept], pages[other]])
    assert backend.batch_exists([kept]) == 1

    reached, go = threading.Event(), threading.Event()
    _pause_client(client, "acquire_many", reached, go, after=False)  # A stops while leasing `other`
    got: dict[str, list] = {}
    a = threading.Thread(target=lambda: got.setdefault("a", backend.batch_get([kept, other], [
        _HostPool().get_dummy_flat_data_page() for _ in range(2)])))  # fmt: skip
    a.start()
    try:
        assert reached.wait(UNTIL_S)
        del client.acquire_many  # B leases nothing new: it reads under the kept lease
        got["b"] = backend.batch_get([kept], [_HostPool().get_dummy_flat_data_page()])
    finally:
        go.set()
        a.join(UNTIL_S)
    assert [_bytes(t) for t in got["b"]] == [_bytes(pages[kept])]
    assert [_bytes(t) for t in got["a"]] == [_bytes(pages[kept]), _bytes(pages[other])], "A lost its lease to B's release"
    assert client.lease_of(backend.kvcc_key(kept)) is None and client.lease_of(backend.kvcc_key(other)) is None


def test_two_namespaces_never_share_a_page(backend, make_backend):
    rng = random.Random(3)
    other_model = make_backend("sglang-other-model", model=OTHER_MODEL)
    salted = make_backend("sglang-salted", salt=SALT)
    keys = _page_keys(rng, 2)
    mine = [_page(rng) for _ in keys]
    assert backend.batch_set(keys, mine)
    for b in (other_model, salted):
        assert b.batch_exists(keys) == 0 and b.batch_get(keys, [None, None]) == [None, None]
    # Each namespace's own bytes under the same SGLang page key.
    theirs = [_page(rng) for _ in keys]
    assert other_model.batch_set(keys, theirs) and salted.batch_set(keys, theirs)
    assert [_bytes(t) for t in backend.batch_get(keys)] == [_bytes(p) for p in mine]
    assert [_bytes(t) for t in other_model.batch_get(keys)] == [_bytes(p) for p in theirs]
    assert [_bytes(t) for t in salted.batch_get(keys)] == [_bytes(p) for p in theirs]


def test_a_requests_cache_salt_and_extra_key_seed_its_page_keys_so_tenants_never_share_a_page(make_backend, hicache_file):
    """A request's cache salt and extra key never reach a storage backend: SGLang seeds the request's
    page-hash chain with them (``storage_namespace_seed``). Tenant A's pages, stored through kvcc
    and through ``HiCacheFile``, are misses under the keys every other tenant gets for the same
    tokens, and read back exactly under A's."""
    rng = random.Random(9)
    tokens = [rng.choice(VOCAB) for _ in range(3 * PAGE)]
    seeds = {"salt a": {"cache_salt": "tenant-a"}, "salt b": {"cache_salt": "tenant-b"},
             "extra key": {"extra_key": "lora-x"}, "neither": {},
             "extra key, salt a": {"extra_key": "lora-x", "cache_salt": "tenant-a"}}  # fmt: skip
    keys = {tenant: _sglang_page_keys(tokens, **seed) for tenant, seed in seeds.items()}
    # The same salt gives the same keys (A's next request finds its pages), every other seed a
    # chain of its own from the first page on.
    assert _sglang_page_keys(tokens, cache_salt="tenant-a") == keys["salt a"]
    every_key = [k for ks in keys.values() for k in ks]
    assert len(set(every_key)) == len(every_key)

    pages = [_page(rng) for _ in tokens[::PAGE]]
    indices = torch.arange(0, 3 * PAGE, dtype=torch.int64)

    def targets():
        return [_HostPool().get_dummy_flat_data_page() for _ in pages]

    backend = make_backend("sglang-tenants")  # one engine serves every tenant's requests
    record: dict[str, dict[str, object]] = {}
    for name, b in (("kvcc", backend), ("file", hicache_file())):
        assert b.batch_set(keys["salt a"], pages)
        record[name] = {tenant: (b.batch_exists(ks), [_bytes(t) for t in b.batch_get(ks, targets())])
                        for tenant, ks in keys.items()}  # fmt: skip
    # And through the zero-copy calls, into the host pool.
    record["kvcc v1"] = {tenant: backend.batch_get_v1(ks, indices) for tenant, ks in keys.items() if tenant != "salt a"}
    assert not backend.mem_pool_host.kv_buffer.view(torch.uint8).any(), "a miss reached the host pool"
    record["kvcc v1"]["salt a"] = backend.batch_get_v1(keys["salt a"], indices)
    assert [_bytes(backend.mem_pool_host.get_data_page(int(i))) for i in indices[::PAGE]] == [_bytes(p) for p in pages]

    a_only = {tenant: (0, [None] * 3) for tenant in keys} | {"salt a": (3, [_bytes(p) for p in pages])}
    assert record == {"kvcc": a_only, "file": a_only,
                      "kvcc v1": {tenant: [tenant == "salt a"] * 3 for tenant in keys}}  # fmt: skip


def test_clear_completes_and_makes_every_page_of_the_namespace_a_miss(backend, make_backend, tester):
    rng = random.Random(4)
    other_model = make_backend("sglang-other-model-2", model=OTHER_MODEL)
    keys = _page_keys(rng, 4)
    pages = [_page(rng) for _ in keys]
    assert backend.batch_set(keys, pages) and other_model.batch_set(keys, pages)
    # Another engine holds a read lease on a page and never acknowledges its revocation (the ack
    # is lost): the invalidation completes only when that lease has run out, and so does clear.
    lease = tester.acquire(backend.namespace, backend.kvcc_key(keys[0]))
    assert tester.trusted(lease)

    async def ack_lost(msg):
        return None

    tester.client._ack = ack_lost
    try:
        started = time.monotonic()
        assert backend.clear() is True  # returns once the namespace invalidation completed
        elapsed_ms = (time.monotonic() - started) * 1000
    finally:
        del tester.client._ack
    assert not tester.trusted(lease)
    assert elapsed_ms >= LEASE_TERM_MS - SKEW_MS - 100, f"clear returned after {elapsed_ms:.0f} ms, before it ended"
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get(keys) == [None] * 4
    assert backend.batch_get_v1(keys, torch.arange(0, 4 * PAGE)) == [False] * 4
    assert other_model.batch_exists(keys) == 4, "clear reached another namespace"
    # The cleared pages can be stored again, with new bytes.
    fresh = [_page(rng) for _ in keys]
    assert _until(lambda: backend.batch_set(keys, fresh))
    assert [_bytes(t) for t in backend.batch_get(keys)] == [_bytes(p) for p in fresh]


def test_a_page_whose_lease_is_revoked_before_its_bytes_arrive_is_a_miss(backend, tester):
    from kvcc.spec.vocabulary import SCOPE_KEY

    rng = random.Random(5)
    keys = _page_keys(rng, 2)
    assert backend.batch_set(keys, [_page(rng) for _ in keys])
    client = backend.client

    def invalidate(key):
        ticket = tester.invalidate(backend.namespace, SCOPE_KEY, key)
        assert tester.wait(ticket, INVALIDATION_TIMEOUT_S)  # completes once the backend acked

    # Revoked after the grant, before the read is sent.
    acquire_many = client.acquire_many

    async def acquire_then_revoke(ns, batch):
        leases = await acquire_many(ns, batch)
        for key in batch:
            await asyncio.to_thread(invalidate, key)
        return leases

    target = _HostPool().get_dummy_flat_data_page()
    client.acquire_many = acquire_then_revoke
    try:
        assert backend.get(keys[0], target) is None
    finally:
        del client.acquire_many
    assert not target.view(torch.uint8).any(), "bytes of a revoked lease reached SGLang's buffer"

    # Revoked while the bytes are on their way: they arrive, and are refused.
    to_peer = client._to_peer

    async def revoke_in_flight(location, msg):
        reply = await to_peer(location, msg)
        for item in msg.items if type(msg) is Batch else (msg,):  # a batch of reads, or one read
            await asyncio.to_thread(invalidate, item.key)
        return reply

    client._to_peer = revoke_in_flight
    try:
        assert backend.batch_get_v1([keys[1]], torch.arange(0, PAGE)) == [False]
    finally:
        del client._to_peer
    assert not backend.mem_pool_host.get_data_page(0).view(torch.uint8).any()
    counts = backend.get_stats().kvcc
    assert counts["read_refused_revoked"] >= 2
    assert backend.batch_exists(keys) == 0


def test_an_unfinished_write_is_never_read_and_concurrent_writers_leave_whole_pages(backend, make_backend, tester):
    rng = random.Random(6)
    [key] = _page_keys(rng, 1)
    other = make_backend("sglang-c")
    # A writer that stored its bytes and never committed (it crashed): a miss, and not writable
    # until its write lease has expired.
    ns, kkey = backend.namespace, backend.kvcc_key(key)
    wl = tester.begin_write(ns, kkey, None)
    assert tester.write_bytes(wl, _bytes(_page(rng))) is None
    assert not backend.exists(key) and backend.get(key) is None
    page = _page(rng)
    assert backend.set(key, page) is False
    tester.abort(wl)
    assert _until(lambda: backend.set(key, page))
    assert _bytes(other.get(key)) == _bytes(page)

    # Two engines write the same pages with different bytes at once while a third reads: every
    # page read is one writer's page, whole, and every later read agrees with the first.
    keys = _page_keys(rng, 8)
    a_pages, b_pages = [_page(rng) for _ in keys], [_page(rng) for _ in keys]
    seen: list[list[bytes | None]] = []
    stop = threading.Event()

    def read_loop():
        reader = make_backend("sglang-reader")
        while not stop.is_set():
            seen.append([_bytes(t) for t in reader.batch_get(keys)])

    t = threading.Thread(target=read_loop)
    t.start()
    results = {}
    start = threading.Barrier(2)

    def write(name, b, ks, ps):
        start.wait()
        results[name] = b.batch_set(ks, ps)

    # B writes the pages in the other order: the two meet in the middle.
    writers = [threading.Thread(target=write, args=("a", backend, keys, a_pages)),
               threading.Thread(target=write, args=("b", other, keys[::-1], b_pages[::-1]))]  # fmt: skip
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    time.sleep(0.2)
    stop.set()
    t.join()
    final = [_bytes(t) for t in backend.batch_get(keys)]
    for i, page_bytes in enumerate(final):
        assert page_bytes in (_bytes(a_pages[i]), _bytes(b_pages[i]))
    for snapshot in seen:
        for i, page_bytes in enumerate(snapshot):
            assert page_bytes in (None, final[i]), "a reader saw bytes that are not the committed page"
    # A set that lost the race to a committed page reports it stored (the first bytes stay);
    # one that lost to a write still under way reports a failure.
    assert results["a"] or results["b"]


def _flip_stored_byte(cluster, data: bytes) -> None:
    """Corrupt one payload byte of the node's on-disk copy of ``data`` (a torn or rotten page)."""
    slabs = sorted(Path(cluster.workdir).rglob("slab-*.kvs"))
    for slab in slabs:
        raw = slab.read_bytes()
        at = raw.find(data)
        if at >= 0:
            with open(slab, "r+b") as f:
                f.seek(at + 17)
                f.write(bytes([raw[at + 17] ^ 0xFF]))
            return
    raise AssertionError(f"the page's bytes are in none of {slabs}")


LOST_COPY_VOIDED_S = 30.0  # the node's Lost report reaches the directory (never this long unless broken)


def test_kvcc_and_hicache_file_side_by_side(backend, make_backend, cluster, hicache_file, tester):
    """The same calls against SGLang's own ``HiCacheFile`` and the kvcc backend; what each returned
    is recorded, printed and pinned (the README's table is this record)."""
    rng = random.Random(7)
    file_a, file_other = hicache_file(), hicache_file(OTHER_MODEL)
    kvcc_other = make_backend("sglang-other-model-3", model=OTHER_MODEL)
    record: dict[str, dict[str, object]] = {}

    def target():
        return _HostPool().get_dummy_flat_data_page()

    for name, b, b_other in (("kvcc", backend, kvcc_other), ("file", file_a, file_other)):
        r = record[name] = {}
        keys = _page_keys(random.Random(70), 6)  # the same page keys for both backends
        first, second = _page(rng), _page(rng)
        # Missing page.
        r["missing: exists, get"] = (b.exists(keys[0]), b.get(keys[0], target()))
        # Overwritten: a second set of the same key with other bytes.
        r["overwrite: set, set"] = (b.set(keys[1], first), b.set(keys[1], second))
        got = _bytes(b.get(keys[1], target()))
        r["overwrite: get returns"] = {_bytes(first): "first", _bytes(second): "second"}.get(got, got)
        # Cleared: this model's pages, and another model's in the same store.
        assert b.set(keys[2], first) and b_other.set(keys[2], first)
        cleared = b.clear()
        r["clear: returns"] = cleared
        r["clear: own page exists, get"] = (b.exists(keys[2]), b.get(keys[2], target()))
        r["clear: other model's page exists"] = b_other.exists(keys[2])
        # Torn on disk: the stored bytes no longer match what was written.
        page = _page(rng)
        assert b.set(keys[3], page)
        if name == "kvcc":
            _flip_stored_byte(cluster, _bytes(page))
        else:
            path = next(Path(file_a.file_path).glob(f"{keys[3]}*.bin"))
            raw = bytearray(path.read_bytes())
            raw[17] ^= 0xFF
            path.write_bytes(bytes(raw))
        got = _bytes(b.get(keys[3], target()))
        verdict = "miss" if got is None else "exact" if got == _bytes(page) else "wrong bytes"
        exists = b.exists(keys[3])
        if name == "kvcc":  # the node reports the lost copy, and the directory voids it (asynchronously)
            deadline = time.monotonic() + LOST_COPY_VOIDED_S
            while exists and time.monotonic() < deadline:
                time.sleep(0.05)
                exists = b.exists(keys[3])
        r["corrupted byte: exists, get"] = (exists, verdict)
        page = _page(rng)
        assert b.set(keys[4], page)
        if name == "kvcc":
            r["truncated: exists, get"] = "n/a (fixed slots, checksummed: as a corrupted byte)"
        else:
            path = next(Path(file_a.file_path).glob(f"{keys[4]}*.bin"))
            path.write_bytes(path.read_bytes()[: PAGE_BYTES // 2])
            try:
                got = b.get(keys[4], target())
                r["truncated: exists, get"] = (b.exists(keys[4]), "miss" if got is None else "bytes")
            except OSError as e:
                r["truncated: exists, get"] = (b.exists(keys[4]), f"raises {type(e).__name__}")
        # An interrupted write (bytes stored, never published).
        if name == "kvcc":
            wl = tester.begin_write(b.namespace, b.kvcc_key(keys[5]), None)
            assert tester.write_bytes(wl, _bytes(page)) is None
        else:  # HiCacheFile writes a temporary file, then renames it: a crash between the two
            (Path(file_a.file_path) / ".deadbeef.tmp").write_bytes(_bytes(page))
        r["unfinished write: exists, get"] = (b.exists(keys[5]), b.get(keys[5], target()))
        if name == "kvcc":
            tester.abort(wl)

    print(json.dumps(record, indent=1, default=str))
    assert record == {
        "kvcc": {
            "missing: exists, get": (False, None),
            "overwrite: set, set": (True, True),
            "overwrite: get returns": "first",
            "clear: returns": True,
            "clear: own page exists, get": (False, None),
            "clear: other model's page exists": True,
            "corrupted byte: exists, get": (False, "miss"),
            "truncated: exists, get": "n/a (fixed slots, checksummed: as a corrupted byte)",
            "unfinished write: exists, get": (False, None),
        },
        "file": {
            "missing: exists, get": (False, None),
            "overwrite: set, set": (True, True),
            "overwrite: get returns": "first",
            "clear: returns": True,
            "clear: own page exists, get": (False, None),
            "clear: other model's page exists": False,
            "corrupted byte: exists, get": (True, "wrong bytes"),
            "truncated: exists, get": (True, "raises OSError"),
            "unfinished write: exists, get": (False, None),
        },
    }


RACE_ROUNDS = 30  # free-running rounds of two writers and a reader, per backend


def test_kvcc_and_hicache_file_side_by_side_under_concurrent_calls(backend, make_backend, hicache_file):
    """Concurrent calls on one page against SGLang's own ``HiCacheFile`` and the kvcc backend: two
    writers of different bytes, and a read racing ``clear``, each first in a forced order (one call
    stopped where it has decided to write, or has opened the page, and let go after the other
    call returned), then the writers free-running. What each returned is recorded, printed and
    pinned where it is decided by the code and not by timing (the README's table is this record)."""
    rng = random.Random(10)
    kvcc = [backend, make_backend("sglang-racer-b"), make_backend("sglang-racer-reader")]
    files = [hicache_file(), hicache_file(), hicache_file()]  # three engines on one directory
    record: dict[str, dict[str, object]] = {}

    def fresh_key() -> str:
        return rng.getrandbits(256).to_bytes(32, "big").hex()

    def target():
        return _HostPool().get_dummy_flat_data_page()

    def label(got, pages: dict[str, torch.Tensor]) -> str:
        """Which of ``pages`` a read returned (its name), ``miss``, or none of them."""
        data = _bytes(got.tensor if type(got) is _Paused else got)
        names = {None: "miss"} | {_bytes(page): name for name, page in pages.items()}
        return names.get(data, "neither (a mix?)")

    for name, (a, b, reader) in (("kvcc", kvcc), ("file", files)):
        r = record[name] = {}

        # Two writers, forced: A has decided to write (kvcc: its write lease granted; HiCacheFile:
        # no file yet) and waits while B sets the page and a reader reads it; then A goes on.
        key, a_page, b_page = fresh_key(), _page(rng), _page(rng)
        reached, go, a_set = threading.Event(), threading.Event(), []
        if name == "kvcc":
            _pause_client(a.client, "write_bytes", reached, go, after=False)  # the write lease is granted
            a_value = a_page
        else:
            a_value = _Paused(a_page, "contiguous", reached, go)
        writer = threading.Thread(target=lambda: a_set.append(a.set(key, a_value)))
        writer.start()
        try:
            assert reached.wait(UNTIL_S)
            b_set = b.set(key, b_page)
            read_between = label(reader.get(key, target()), {"A": a_page, "B": b_page})
        finally:
            go.set()
            writer.join()
            if name == "kvcc":
                del a.client.write_bytes
        r["two writers, B while A is under way: B set, read, A set, read"] = (
            b_set, read_between, a_set[0], label(reader.get(key, target()), {"A": a_page, "B": b_page}))

        # A read racing clear, forced: the reader has opened the page (kvcc: its read lease
        # granted; HiCacheFile: the page's file open) and reads it only after clear returned.
        key, a_page = fresh_key(), _page(rng)
        assert a.set(key, a_page)
        reached, go, got = threading.Event(), threading.Event(), []
        if name == "kvcc":
            _pause_client(a.client, "acquire_many", reached, go, after=True)  # the read lease is granted
            into, revoked_reads = target(), a.get_stats().kvcc.get("read_refused_revoked", 0)
        else:
            into = _Paused(target(), "view", reached, go)
        read = threading.Thread(target=lambda: got.append(a.get(key, into)))
        read.start()
        try:
            assert reached.wait(UNTIL_S)
            cleared = a.clear()
            exists_after_clear = a.exists(key)
        finally:
            go.set()
            read.join()
            if name == "kvcc":
                del a.client.acquire_many
        if name == "kvcc":  # the read held a lease when clear began, and clear revoked it
            assert a.get_stats().kvcc.get("read_refused_revoked", 0) == revoked_reads + 1
        r["read racing clear: clear, exists, then the read returns"] = (
            cleared, exists_after_clear, label(got[0], {"the cleared page": a_page}))

        # Two writers, free-running: released together while a reader reads until both returned.
        sets, reads = [], []
        for _ in range(RACE_ROUNDS):
            key, a_page, b_page = fresh_key(), _page(rng), _page(rng)
            start, done, round_sets, round_reads = threading.Barrier(3), threading.Event(), {}, []

            def write(who, backend_, page):
                start.wait()
                round_sets[who] = backend_.set(key, page)

            def read_until_done():
                start.wait()
                while not done.is_set():
                    round_reads.append(label(reader.get(key, target()), {"A": a_page, "B": b_page}))

            threads = [threading.Thread(target=write, args=("A", a, a_page)),
                       threading.Thread(target=write, args=("B", b, b_page)),
                       threading.Thread(target=read_until_done)]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads[:2]:
                t.join()
            done.set()
            threads[2].join()
            round_reads.append(label(reader.get(key, target()), {"A": a_page, "B": b_page}))
            sets.append((round_sets["A"], round_sets["B"]))
            reads.append(round_reads)
        r["free-running: rounds"] = RACE_ROUNDS
        r["free-running: rounds with both sets True"] = sum(sa and sb for sa, sb in sets)
        r["free-running: rounds with a set False"] = sum(not (sa and sb) for sa, sb in sets)
        r["free-running: reads of neither writer's page"] = sum(x == "neither (a mix?)" for rs in reads for x in rs)
        r["free-running: rounds whose reads saw A's page and B's"] = sum({"A", "B"} <= set(rs) for rs in reads)
        r["free-running: rounds ending in a miss"] = sum(rs[-1] == "miss" for rs in reads)

    print(json.dumps(record, indent=1, default=str))
    kvcc_record, file_record = record["kvcc"], record["file"]
    # kvcc: the first write under way wins; B's set fails, the page is a miss until A's commit and
    # then A's, whole, for good; a read lease granted before clear is revoked before clear
    # returns, so the read is a miss.
    assert kvcc_record["two writers, B while A is under way: B set, read, A set, read"] == (False, "miss", True, "A")
    assert kvcc_record["read racing clear: clear, exists, then the read returns"] == (True, False, "miss")
    # HiCacheFile: each set writes a temporary file and renames it over the page's: both sets
    # succeed, a reader reads B's page, then A's (the last rename wins); a page file opened before
    # clear deleted it is still read, whole, after clear returned.
    assert file_record["two writers, B while A is under way: B set, read, A set, read"] == (True, "B", True, "A")
    assert file_record["read racing clear: clear, exists, then the read returns"] == (True, False, "the cleared page")
    # Free-running: never a mix for either (kvcc: one committed generation; HiCacheFile: a rename
    # replaces a whole file); kvcc's readers never see the page change and every round ends with a
    # page; HiCacheFile's set never fails (no eviction configured). How often HiCacheFile's readers
    # see both pages is timing: printed, not pinned.
    for rec in (kvcc_record, file_record):
        assert rec["free-running: reads of neither writer's page"] == 0
        assert rec["free-running: rounds ending in a miss"] == 0
    assert kvcc_record["free-running: rounds whose reads saw A's page and B's"] == 0
    assert file_record["free-running: rounds with a set False"] == 0


def test_a_servers_backend_reports_its_namespace_calls_and_counts_and_logs_as_part_of_its_node(cluster, tmp_path):
    """What the engine profile's harness reads of a server's backend (``kvcc_status_file``,
    ``kvcc_events_dir``, ``kvcc_colocated_node``): the status file names the namespace digest the
    pages are filed under, says a call is under way while one is (a request's backups are done
    once it says none is, and the counts stay put), and counts pages read and refused; the client
    is ``<node>.<id>``, part of the node, and logs its leases, reads and writes."""
    from kvcc.adapters.sglang.backend import page_key

    node = cluster.node_ids[0]
    status, events = tmp_path / "status.json", tmp_path / "events"
    events.mkdir()
    extra = {**_extra(cluster, "sglang-status"), "kvcc_colocated_node": node, "kvcc_status_file": str(status),
             "kvcc_events_dir": str(events)}  # fmt: skip
    backend = StorageBackendFactory.create_backend("dynamic", _config(extra), None)
    try:
        assert json.loads(status.read_text())["namespace"] is None  # no host pool yet: no namespace
        backend.register_mem_pool_host(_HostPool())
        assert json.loads(status.read_text())["namespace"] == _namespace().digest().hex()
        rng = random.Random(31)
        keys, pages = _page_keys(rng, 2), [_page(rng) for _ in range(2)]
        assert backend.batch_set(keys, pages)
        assert backend.batch_exists(keys) == 2
        reached, go = threading.Event(), threading.Event()
        _pause_client(backend.client, "read_many", reached, go, after=False)
        reader = threading.Thread(target=lambda: backend.batch_get(keys), daemon=True)
        reader.start()
        try:
            assert reached.wait(UNTIL_S)
            assert json.loads(status.read_text())["busy"] == 1
        finally:
            go.set()
            reader.join(UNTIL_S)
            del backend.client.read_many
        got = json.loads(status.read_text())
        assert got["busy"] == 0 and got["client_id"] == f"{node}.sglang-status"
        assert got["counts"]["write_committed"] == 2 and got["counts"]["read_hits"] == 2
        # A page never written: refused at the acquire, counted as a refusal.
        assert backend.batch_get(_page_keys(rng, 1)) == [None]
        assert sum(n for k, n in json.loads(status.read_text())["counts"].items() if k.startswith("read_refused_")) == 1
        log = [json.loads(line) for line in (events / f"{node}.sglang-status.ndjson").read_text().splitlines()]
        wanted = {page_key(_namespace().digest(), k).hex for k in keys}
        assert {e["event"] for e in log if e.get("key") in wanted} >= {"trust_read_lease", "read", "begin_write"}
    finally:
        backend.close()


def test_the_engine_profiles_server_settings_make_a_backend_that_names_pages_as_the_suite_expects(cluster, tester, tmp_path):
    """The settings the ``sglang`` adapter gives each SGLang server (``_extra_config``) build, through
    SGLang's factory, a backend whose client is co-located with the server's node, whose status
    file names the namespace ``engine_namespace`` computes, and which names SGLang's page hashes
    of a prompt with the keys ``engine_keys`` gives the suite; the adapter's ``lookup`` there counts
    the leading committed pages as SGLang's prefetch does (pages are kvcc roots: a chain lookup
    would stop after the first)."""
    import types

    from kvcc.adapters.sglang.conformance import ENGINE_PAGE_TOKENS, engine_namespace, factory
    from attrs import evolve

    from kvcc.adapters.sglang.server import BACKEND, page_hashes

    adapter = factory()
    adapter._cluster = cluster
    adapter._ctx = types.SimpleNamespace(skew_ms=SKEW_MS, workdir=tmp_path)
    adapter._revision = REVISION
    (tmp_path / "events").mkdir(exist_ok=True)
    cluster_workdir, cluster.workdir = cluster.workdir, tmp_path  # the backend's event log goes to tmp_path/events
    try:
        extra = adapter._extra_config("s2")
    finally:
        cluster.workdir = cluster_workdir
    backend = StorageBackendFactory.create_backend("dynamic", _config({**BACKEND, **extra}, "served-name"), None)
    try:
        ens = engine_namespace(REVISION)
        assert backend.namespace == ens
        status = json.loads(adapter._status_path("s2").read_text())
        assert status["namespace"] == ens.digest().hex()
        assert status["client_id"] == f"{adapter._engine_node('s2')}.sglang-s2-{adapter._gens['s2']}"
        tokens = [random.Random(4).choice(VOCAB) for _ in range(3 * ENGINE_PAGE_TOKENS + 7)]
        got_ns, keys = adapter.engine_keys(evolve(ens, cache_salt=b"\x01\x02"), tokens)  # a test namespace's salt
        assert got_ns == ens and len(keys) == 3
        hashes = page_hashes(tokens, ENGINE_PAGE_TOKENS, cache_salt="0102")
        assert keys == [backend.kvcc_key(h) for h in hashes]
        node = adapter._engine_node("s2")
        adapter._clients[node] = tester
        try:
            assert adapter.lookup(node, ens, keys) == 0
            assert backend.batch_set([hashes[0], hashes[2]], [_page(random.Random(5)) for _ in range(2)])
            assert adapter.lookup(node, ens, keys) == 1  # the second page is missing
            assert backend.batch_set([hashes[1]], [_page(random.Random(6))])
            assert adapter.lookup(node, ens, keys) == 3
            assert tester.lookup(ens, keys).blocks == 1  # the directory's chain lookup
        finally:
            adapter._clients.clear()
    finally:
        backend.close()
