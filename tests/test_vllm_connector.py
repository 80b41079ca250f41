"""kvcc as vLLM's external KV cache: ``KvccConnector`` in real vLLM engines (CPU) against a real
kvcc cluster (a directory and one cache node, processes on loopback).

Two engines (A, and B, started when first needed) and one cluster serve the module; every test
uses prompts of fresh random tokens, so no test sees another's blocks in an engine's prefix cache
or in kvcc. Before A serves a prompt it computed earlier, ``_fresh`` clears its prefix cache and
overwrites every physical block (a freed block keeps its KV, which would hide a load that copied
nothing). The connector writes its counters to a file (``stats_path``): that is how a test knows
that the load path ran. The engine's greedy output and logprobs for a prompt computed from scratch
are the oracle for the same prompt served from kvcc; the byte layout is checked against vLLM's own
cache-writing kernel. The last test kills the cache node, so it runs last (file order).

Needs the ``vllm`` extra (``bash scripts/setup.sh --with vllm``); without it the tests fail naming
that command (a skipped test is not a passing one). The module shares test_vllm's xdist group, so
engine starts never run side by side.
"""

from __future__ import annotations

import json
import random
import urllib.request

import pytest

from kvcc.adapters.vllm import harness
from kvcc.adapters.vllm.events import KeyMapper
from kvcc.spec.vocabulary import SCOPE_NAMESPACE

try:
    harness.check_installed()
    _MISSING = ""
except harness.VllmNotInstalled as e:
    _MISSING = str(e)

pytestmark = pytest.mark.xdist_group("vllm-engine")

MODEL_ID = "kvcc/tiny-llama"
BLOCK = 32
NUM_BLOCKS = 32
# _fresh overwrites every block: 3 prompts of 14 blocks each pass over all 31 usable blocks.
SCRUB_PROMPTS = 3
SCRUB_BLOCKS = 14
MAX_MODEL_LEN = 512
BLOCK_BYTES = 64 << 10  # a node slot; one tiny-Llama block is 32 KiB
# Long enough that a killed node is not yet declared down (one lease term after its connection
# drops) while the engine's next request runs: the test of a failed load needs the keys alive.
LEASE_TERM_MS = 15_000
SKEW_MS = 100
INVALIDATION_TIMEOUT_S = 60.0
LOGPROB_TOLERANCE = 0.0
SALT = "tenant-7"  # a cache salt the engine tenant may use (its own namespace)
VOCAB = range(3, 512)  # the tiny model's ids without its special tokens


@pytest.fixture(scope="module")
def model_path():
    if _MISSING:
        pytest.fail(f"the vllm extra is required (bash scripts/setup.sh --with vllm): {_MISSING}")
    from kvcc.adapters.vllm.model import tiny_llama

    return tiny_llama()


@pytest.fixture(scope="module")
def namespace(model_path):
    from kvcc.adapters.vllm.model import engine_namespace

    return engine_namespace(model_path, MODEL_ID, block_tokens=BLOCK)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, namespace):
    from kvcc.reference.cluster import LocalCluster

    cl = LocalCluster(tmp_path_factory.mktemp("kvcc") / "cluster", nodes=1, tiers=("nvme=16MiB",),
                      block_bytes=BLOCK_BYTES, lease_term_ms=LEASE_TERM_MS, skew_ms=SKEW_MS,
                      namespaces=[namespace, KeyMapper(namespace).namespace(SALT)])  # fmt: skip
    cl.start()
    try:
        yield cl
    finally:
        cl.stop()
        assert not harness.live_pids(), f"engine processes left running: {harness.live_pids()}"


def _start_engine(model_path, cluster, stats_path, name: str) -> harness.VllmEngine:
    host, port = cluster.directory_address
    transfer = {
        "kv_connector": "KvccConnector",
        "kv_connector_module_path": "kvcc.adapters.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "directory": f"{host}:{port}",
            "tenant": "engine",
            "token_hex": cluster.engine_token.hex(),
            "skew_ms": SKEW_MS,
            "model_id": MODEL_ID,
            "client_id": f"vllm-{name}",
            "stats_path": str(stats_path),
        },
    }
    e = harness.VllmEngine(model_path, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN,
                           extra_args=("--kv-transfer-config", json.dumps(transfer)))  # fmt: skip
    e.kvcc_stats = stats_path  # where its connector's worker counts what it did
    try:
        e.start()
    except BaseException:
        e.close()
        raise
    return e


def _stop_engine(e: harness.VllmEngine) -> None:
    e.close()
    assert not e.pids(), f"engine processes left running: {e.pids()}"


@pytest.fixture(scope="module")
def engine(model_path, cluster, tmp_path_factory):
    """Engine A: computes, saves, and (once it has forgotten) loads."""
    e = _start_engine(model_path, cluster, tmp_path_factory.mktemp("engine-a") / "stats", "a")
    yield e
    _stop_engine(e)


@pytest.fixture(scope="module")
def engine_b(model_path, cluster, tmp_path_factory):
    """Engine B: a second process, whose memory never held what A computed."""
    e = _start_engine(model_path, cluster, tmp_path_factory.mktemp("engine-b") / "stats", "b")
    yield e
    _stop_engine(e)


@pytest.fixture(scope="module")
def client(cluster):
    return cluster.client("tester", events=False)


@pytest.fixture(scope="module")
def mapper(namespace):
    return KeyMapper(namespace)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.choice(VOCAB) for _ in range(n)]


def _worker_stats(engine) -> dict:
    path = engine.kvcc_stats.parent / f"{engine.kvcc_stats.name}.worker.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _complete(engine, prompt: list[int], max_tokens: int = 8) -> dict:
    """A greedy completion with the top-5 logprobs of every generated token (the harness's
    ``complete`` does not ask for them)."""
    body = {"model": engine.served_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": 5}
    req = urllib.request.Request(f"{engine.base_url}/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=harness.REQUEST_TIMEOUT_S) as r:
        out = json.loads(r.read())
    _saved(engine)
    return out


def _saved(engine) -> None:
    """Wait until the engine's saver thread has done every save handed to it (the connector saves
    after the answer)."""
    from kvcc.adapters.vllm.connector import wait_saves_settled

    assert wait_saves_settled(lambda: _worker_stats(engine), harness.REQUEST_TIMEOUT_S), _worker_stats(engine)


def _generated(out: dict) -> list[int]:
    return out["choices"][0]["token_ids"]


def _logprobs(out: dict) -> list[dict[str, float]]:
    return out["choices"][0]["logprobs"]["top_logprobs"]


def _same_output(served: dict, computed: dict) -> None:
    """The same greedy tokens, and the same top-5 logprobs at every step. Exactly the same: the
    loaded bytes are the computed bytes, and here the engine's arithmetic over them is identical
    (measured: difference 0.0). Exactness matters: the random-weight model attends almost
    uniformly, so a load that lost every K moves a logprob by only ~2e-4 (and no argmax)."""
    assert _generated(served) == _generated(computed)
    steps = list(zip(_logprobs(served), _logprobs(computed)))
    assert len(steps) == len(_generated(computed))
    for step, (a, b) in enumerate(steps):
        # A near tie may swap the 5th and 6th candidates: compare the ones both runs list.
        common = a.keys() & b.keys()
        assert max(a, key=a.get) in common, f"step {step}: {a} against {b}"
        for tok in common:
            assert abs(a[tok] - b[tok]) <= LOGPROB_TOLERANCE, f"step {step}, token {tok!r}: {a[tok]} != {b[tok]}"


def _fresh(engine) -> None:
    """The engine forgets every block, and every physical block is overwritten: a freed block
    keeps its KV, and the next request may well get the very blocks that held its prefix, so a
    load that copied nothing would go unnoticed."""
    assert engine.reset_prefix_cache(), "vLLM refused to clear its prefix cache"
    rng = random.Random()
    for _ in range(SCRUB_PROMPTS):
        engine.complete(_tokens(rng, SCRUB_BLOCKS * BLOCK), max_tokens=1)
    _saved(engine)  # the scrub prompts' saves are not left running into the test
    assert engine.reset_prefix_cache(), "vLLM refused to clear its prefix cache"


def test_the_saver_thread_alone_runs_at_the_lowest_priority():
    """``save_priority: idle``: the saver yields the CPU to the engine; no other thread of the
    engine's process may lose priority with it (Linux schedules threads, and the call names the
    calling one)."""
    import os
    import threading

    from kvcc.adapters.vllm.connector import lower_thread_priority

    seen: dict[str, object] = {}

    def saver() -> None:
        seen["how"] = lower_thread_priority()
        seen["policy"] = os.sched_getscheduler(0)
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    t = threading.Thread(target=saver)
    t.start()
    t.join()
    assert seen["how"] == "idle" and seen["policy"] == os.SCHED_IDLE, seen
    assert (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())) == before


def test_a_block_is_packed_as_k_then_v_token_major_whatever_the_kernel_stores():
    """The byte layout against vLLM's own cache-writing kernel (the one the engine's attention
    layers call, with the instruction set they use): K and V written by the kernel come out of
    ``pack`` as ``[K; V]``, each ``[block_size, kv_heads, head_dim]``, and ``unpack`` puts back
    exactly the bytes the kernel wrote. No engine."""
    if _MISSING:
        pytest.fail(f"the vllm extra is required (bash scripts/setup.sh --with vllm): {_MISSING}")
    import torch
    from vllm import _custom_ops as ops

    from kvcc.adapters.vllm.connector import CpuBlockLayout, engine_isa

    heads, dim, blocks, dtype = 2, 64, 4, torch.bfloat16
    isa = engine_isa(dtype, BLOCK, dim)
    layout = CpuBlockLayout.probe(dtype, BLOCK, heads, dim, isa)
    gen = torch.Generator().manual_seed(7)
    layers = [torch.zeros(blocks, heads, BLOCK, 2 * dim, dtype=dtype) for _ in range(2)]
    written = []
    for cache in layers:
        k, v = (torch.randn(BLOCK, heads, dim, generator=gen).to(dtype) for _ in range(2))
        key_cache, value_cache = cache.view(blocks, heads, 2 * BLOCK, dim).chunk(2, dim=2)
        slots = torch.arange(2 * BLOCK, 3 * BLOCK, dtype=torch.int64)  # block 2
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, kv_cache_dtype="auto")
        written.append(torch.stack((k, v)).reshape(-1))
    assert torch.equal(layout.pack(layers, 2), torch.stack(written))

    copies = [torch.zeros_like(c) for c in layers]
    layout.unpack(copies, 1, layout.pack(layers, 2))
    for cache, copy in zip(layers, copies):
        assert torch.equal(copy[1], cache[2])
        assert not copy[0].any() and not copy[2].any() and not copy[3].any()


def _worker_connector(model_path, cluster):
    """A worker-side connector in this process, as vLLM builds one (only the parts of the config
    it reads), with KV tensors of the engine's shape: a test can drive its load path directly."""
    from types import SimpleNamespace

    import torch
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvcc.adapters.vllm.connector import KvccConnector

    host, port = cluster.directory_address
    extra = {"directory": f"{host}:{port}", "tenant": "engine", "token_hex": cluster.engine_token.hex(),
             "skew_ms": SKEW_MS, "model_id": MODEL_ID, "client_id": "inproc"}  # fmt: skip
    config = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(kv_connector="KvccConnector", kv_role="kv_both", kv_connector_extra_config=extra),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"),
        model_config=SimpleNamespace(model=str(model_path), served_model_name="tiny"),
    )
    conn = KvccConnector(config, KVConnectorRole.WORKER, None)
    conn.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.zeros(8, 2, BLOCK, 128, dtype=torch.bfloat16)
                             for i in range(2)})  # fmt: skip
    return conn


def _load(conn, namespace, plan) -> set[int]:
    """One step's loads through the worker's own path; the block ids it reports as failed."""
    from kvcc.adapters.vllm.connector import KvccConnectorMetadata, _Load

    conn.bind_connector_metadata(KvccConnectorMetadata(loads=[_Load("req", bytes(namespace.digest()), plan)]))
    try:
        conn.start_load_kv(None)
        conn.wait_for_save()
        return conn.get_block_ids_with_load_errors()
    finally:
        conn.clear_connector_metadata()


def test_a_block_whose_lease_is_refused_revoked_or_expired_is_reported_and_never_copied(model_path, cluster, client,
                                                                                         mapper, namespace):
    """The worker's load path against the real cluster, each way a lease can fail between the
    scheduler's lookup and the copy: the failed block and every later block of the request are
    reported as load errors (vLLM recomputes them) and not one byte of them reaches the cache."""
    import torch

    from kvcc.spec.vocabulary import SCOPE_KEY

    conn = _worker_connector(model_path, cluster)
    try:
        tokens = _tokens(random.Random(201), 4 * BLOCK)
        keys = mapper.keys(tokens)
        gen = torch.Generator().manual_seed(201)
        blocks = [torch.randn(2, 2 * BLOCK * 2 * 64, generator=gen).to(torch.bfloat16) for _ in keys]
        for i, key in enumerate(keys):
            data = blocks[i].view(torch.uint8).numpy().tobytes()
            assert len(data) == conn.block_bytes
            assert not hasattr(client.put(namespace, key, keys[i - 1] if i else None, data), "reason")

        def copied(block_id):
            return conn.layout.pack(conn._kv, block_id)

        # A clean load: both blocks arrive, exactly.
        assert _load(conn, namespace, [(keys[0], 1), (keys[1], 2)]) == set()
        assert torch.equal(copied(1), blocks[0]) and torch.equal(copied(2), blocks[1])

        # Revoked after the grant, before the read: the key is invalidated while the lease is out.
        acquire_chain = conn.client.acquire_chain

        def acquire_then_invalidate(ns, chain):
            leases, why = acquire_chain(ns, chain)
            assert len(leases) == 2 and why is None
            ticket = client.invalidate(namespace, SCOPE_KEY, chain[0])  # and, by the cascade, chain[1]
            assert client.wait(ticket, INVALIDATION_TIMEOUT_S)  # completes once the connector acked
            return leases, why

        conn.client.acquire_chain = acquire_then_invalidate
        try:
            assert _load(conn, namespace, [(keys[2], 3), (keys[3], 4)]) == {3, 4}
        finally:
            del conn.client.acquire_chain
        assert not copied(3).any() and not copied(4).any()

        # Refused: the key is gone (invalidated after the lookup that planned the load).
        assert _load(conn, namespace, [(keys[2], 5)]) == {5}
        assert not copied(5).any()

        # Expired: the holder's own clock says the lease ran out before the read was done.
        read_many = conn.client.read_many
        kvcc_client = conn.client.client

        def read_late(leases, outs=None):
            kvcc_client.clock_offset_ns += 10 * LEASE_TERM_MS * 1_000_000
            return read_many(leases, outs)

        conn.client.read_many = read_late
        try:
            assert _load(conn, namespace, [(keys[0], 6), (keys[1], 7)]) == {6, 7}
        finally:
            del conn.client.read_many
            kvcc_client.clock_offset_ns = 0
        assert not copied(6).any() and not copied(7).any()
        counts = {k: v for k, v in conn.stats.items() if not k.endswith("_us")}  # not the timings
        assert counts == {"loaded_blocks": 2, "load_errors": 5, "load_refused_revoked": 1,
                          "load_refused_not_committed": 1, "load_refused_lease_expired": 1}  # fmt: skip
        assert conn.stats["load_us"] > 0
    finally:
        conn.shutdown()


def test_a_computed_prompt_is_committed_in_kvcc(engine, client, mapper, namespace):
    prompt = _tokens(random.Random(101), 3 * BLOCK + 5)
    before = _worker_stats(engine)
    out = _complete(engine, prompt)
    assert len(_generated(out)) == 8
    keys = mapper.keys(prompt)
    assert len(keys) == 3
    # Saves are synchronous (wait_for_save, in the step that computed the blocks), so they are
    # committed before the completion answers.
    assert client.lookup(namespace, keys).blocks == 3
    after = _worker_stats(engine)
    assert after.get("saved_blocks", 0) - before.get("saved_blocks", 0) == 3, after
    assert after.get("loaded_blocks", 0) == before.get("loaded_blocks", 0), "nothing was in kvcc to load"
    # A salted request has keys of its own: not found under the unsalted namespace's keys.
    assert client.lookup(namespace, mapper.keys(prompt, "other-tenant")).blocks == 0


def test_the_prefix_is_loaded_from_kvcc_and_greedy_output_is_unchanged(engine, client, mapper, namespace):
    prompt = _tokens(random.Random(102), 3 * BLOCK + 7)
    computed = _complete(engine, prompt)  # from scratch: the oracle
    _fresh(engine)  # the engine forgets; kvcc does not
    before = _worker_stats(engine)
    served = _complete(engine, prompt)
    after = _worker_stats(engine)
    assert after.get("loaded_blocks", 0) - before.get("loaded_blocks", 0) == 3, after
    assert after.get("load_errors", 0) == before.get("load_errors", 0), after
    _same_output(served, computed)
    assert served["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK

    # A longer prompt on the same prefix: three blocks come from kvcc, the next two are
    # computed and then committed, chained on the loaded ones.
    _fresh(engine)
    longer = prompt[: 3 * BLOCK] + _tokens(random.Random(103), 2 * BLOCK + 3)
    before = _worker_stats(engine)
    engine.complete(longer, max_tokens=2)
    _saved(engine)
    after = _worker_stats(engine)
    assert after.get("loaded_blocks", 0) - before.get("loaded_blocks", 0) == 3, after
    assert after.get("saved_blocks", 0) - before.get("saved_blocks", 0) == 2, after
    assert client.lookup(namespace, mapper.keys(longer)).blocks == 5


def test_another_engine_gets_the_prefix_from_kvcc(engine, engine_b, client, mapper, namespace):
    """What A computed, B (another process, which never saw the prompt) loads: same output."""
    prompt = _tokens(random.Random(106), 3 * BLOCK + 9)
    computed = _complete(engine, prompt)
    assert client.lookup(namespace, mapper.keys(prompt)).blocks == 3
    before = _worker_stats(engine_b)
    served = _complete(engine_b, prompt)
    after = _worker_stats(engine_b)
    assert after.get("loaded_blocks", 0) - before.get("loaded_blocks", 0) == 3, after
    assert after.get("load_errors", 0) == before.get("load_errors", 0), after
    assert after.get("saved_blocks", 0) == before.get("saved_blocks", 0), "B computed no full block of its own"
    assert served["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK
    _same_output(served, computed)


def test_after_a_namespace_invalidation_the_old_blocks_are_not_loaded(engine, client, mapper, namespace):
    prompt = _tokens(random.Random(104), 3 * BLOCK + 1)
    computed = _complete(engine, prompt)
    keys = mapper.keys(prompt)
    assert client.lookup(namespace, keys).blocks == 3
    ticket = client.invalidate(namespace, SCOPE_NAMESPACE)
    assert ticket.keys >= 3
    assert client.wait(ticket, INVALIDATION_TIMEOUT_S), "the invalidation did not complete"
    assert client.lookup(namespace, keys).blocks == 0

    _fresh(engine)
    before = _worker_stats(engine)
    served = _complete(engine, prompt)
    after = _worker_stats(engine)
    assert after.get("loaded_blocks", 0) == before.get("loaded_blocks", 0), "an invalidated block was loaded"
    assert served["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _same_output(served, computed)
    # Recomputed, the blocks are committed again (a new generation of each key).
    assert after.get("saved_blocks", 0) - before.get("saved_blocks", 0) == 3, after
    assert client.lookup(namespace, keys).blocks == 3


def test_resetting_the_external_cache_invalidates_the_engines_namespaces_before_it_answers(engine, client, mapper,
                                                                                          namespace):
    """``POST /reset_prefix_cache?reset_external=true``: vLLM asks the connector to reset, and the
    connector invalidates the engine's namespace and each cache salt's it served, answering once
    both invalidations completed: right after the answer nothing of either is committed."""
    salt = SALT
    prompt = _tokens(random.Random(106), 2 * BLOCK + 1)
    salted = _tokens(random.Random(107), 2 * BLOCK + 1)
    _complete(engine, prompt)
    engine.complete(salted, max_tokens=1, cache_salt=salt)
    _saved(engine)
    salted_ns = mapper.namespace(salt)
    assert client.lookup(namespace, mapper.keys(prompt)).blocks == 2
    assert client.lookup(salted_ns, mapper.keys(salted, salt)).blocks == 2
    assert engine.reset_prefix_cache(external=True), "vLLM reported the reset as failed"
    assert client.lookup(namespace, mapper.keys(prompt)).blocks == 0
    assert client.lookup(salted_ns, mapper.keys(salted, salt)).blocks == 0
    path = engine.kvcc_stats.parent / f"{engine.kvcc_stats.name}.scheduler.json"
    stats = json.loads(path.read_text())
    assert stats.get("namespace_invalidations", 0) >= 2 and not stats.get("namespace_invalidations_unfinished"), stats


def test_a_block_that_cannot_be_read_is_recomputed_never_used(engine, cluster, client, mapper, namespace):
    """The node that holds the blocks is killed after the engine forgot them: the directory still
    has them committed (the node is declared down only a lease term later), so the scheduler plans
    a load, and the worker's read fails. Those blocks are reported as load errors, vLLM recomputes
    them, and the output is the one computed from scratch. Kills the cluster's only node: last."""
    prompt = _tokens(random.Random(105), 3 * BLOCK + 2)
    computed = _complete(engine, prompt)
    assert client.lookup(namespace, mapper.keys(prompt)).blocks == 3
    _fresh(engine)
    cluster.kill("n1")
    before = _worker_stats(engine)
    served = _complete(engine, prompt)
    after = _worker_stats(engine)
    assert after.get("load_errors", 0) - before.get("load_errors", 0) == 3, after
    assert after.get("loaded_blocks", 0) == before.get("loaded_blocks", 0), after
    _same_output(served, computed)
