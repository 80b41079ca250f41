"""Two promises of vLLM's connector contract that ``KvccConnector``'s design rests on, each checked
against a real kvcc cluster (a directory and one cache node, processes on loopback).

1. The scheduler side's ``get_num_new_matched_tokens`` may be called many times for one request
   and must be side-effect free (vLLM's ``KVConnectorBase_V1`` docstring). The connector is built
   in this process as vLLM's scheduler builds it (``KVConnectorFactory`` over a ``VllmConfig``
   made from engine arguments) and asked again and again; the oracle for "no side effect" is kvcc's
   own state on both sides: the connector's client trusts no lease and has none under way, and the
   directory's metrics and event trace show no read lease granted to it.

2. ``request_finished`` answers ``(False, None)``: vLLM frees a finished request's blocks at once
   and may hand them to the next request. That is safe only because the worker packs a step's
   saves out of the paged tensors before the step ends (``wait_for_save``); the kvcc writes come
   later, on the saver thread. A real engine with a KV cache of 8 usable blocks checks it: the saver
   is held back (the cache node is stopped) while a second request takes every block of the first,
   and the bytes kvcc ends up holding for the first request are the ones the engine computes for
   its prompt when nothing is in the way.

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
from kvcc.spec.vocabulary import SCOPE_KEY

try:
    harness.check_installed()
    _MISSING = ""
except harness.VllmNotInstalled as e:
    _MISSING = str(e)

pytestmark = pytest.mark.xdist_group("vllm-engine")

MODEL_ID = "kvcc/tiny-llama"
BLOCK = 32
# The engine's whole KV cache: 8 usable blocks (vLLM reserves one), so one prompt of 8 blocks
# takes every block, whatever the order of the free queue.
NUM_BLOCKS = 9
MAX_MODEL_LEN = (NUM_BLOCKS - 1) * BLOCK
TINY_BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 64 * 2  # layers x (K, V) x tokens x kv heads x head dim x bf16
SLOT_BYTES = 64 << 10  # a node slot
# Longer than the node is kept stopped (a few requests' time): a write lease granted before the
# stop must still be live when the node comes back.
LEASE_TERM_MS = 15_000
SKEW_MS = 100
INVALIDATION_TIMEOUT_S = 60.0
SALT = "tenant-7"  # a cache salt the engine tenant may use (its own namespace)
REPEATS = 5  # how many times the scheduler asks the same question
VOCAB = range(3, 512)  # the tiny model's ids without its special tokens


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.choice(VOCAB) for _ in range(n)]


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
def mapper(namespace):
    return KeyMapper(namespace)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, namespace, mapper):
    from kvcc.reference.cluster import LocalCluster

    cl = LocalCluster(tmp_path_factory.mktemp("kvcc") / "cluster", nodes=1, tiers=("nvme=16MiB",),
                      block_bytes=SLOT_BYTES, lease_term_ms=LEASE_TERM_MS, skew_ms=SKEW_MS, metrics=True,
                      namespaces=[namespace, mapper.namespace(SALT)])  # fmt: skip
    cl.start()
    try:
        yield cl
    finally:
        cl.stop()
        assert not harness.live_pids(), f"engine processes left running: {harness.live_pids()}"


@pytest.fixture(scope="module")
def client(cluster):
    return cluster.client("tester", events=False)


def _extra_config(cluster, client_id: str, **more) -> dict:
    host, port = cluster.directory_address
    return {"directory": f"{host}:{port}", "tenant": "engine", "token_hex": cluster.engine_token.hex(),
            "skew_ms": SKEW_MS, "model_id": MODEL_ID, "client_id": client_id, **more}  # fmt: skip


def _directory_metrics(cluster) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(cluster.metrics_url("directory"), timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip


def _read_blocks(client, ns, keys) -> list[bytes]:
    """The committed bytes of each key, read under a read lease of the tester's own."""
    out = []
    for key in keys:
        lease = client.acquire(ns, key)
        assert not hasattr(lease, "reason"), f"{key.hex[:16]}: {lease}"
        try:
            data = client.read(lease)
        finally:
            client.release(lease)
        assert isinstance(data, bytes), f"{key.hex[:16]}: {data}"
        out.append(data)
    return out


# -- 1. get_num_new_matched_tokens is repeatable and side-effect free ---------------------------------


def _scheduler_connector(model_path, cluster, client_id: str):
    """A scheduler-side connector, built as vLLM's scheduler builds it: the factory, over the
    ``VllmConfig`` the engine arguments make (the ones ``harness.VllmEngine`` passes). Its client
    logs its protocol events into the cluster's trace. No ``KVCacheConfig``: the connector reads none."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    extra = _extra_config(cluster, client_id, events_dir=str(cluster.workdir / "events"))
    transfer = KVTransferConfig(kv_connector="KvccConnector", kv_connector_module_path="kvcc.adapters.vllm.connector",
                                kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    args = EngineArgs(model=str(model_path), served_model_name=["tiny"], block_size=BLOCK, max_model_len=MAX_MODEL_LEN,
                      enable_prefix_caching=True, kv_transfer_config=transfer)  # fmt: skip
    return KVConnectorFactory.create_connector(args.create_engine_config(), KVConnectorRole.SCHEDULER, None)


def _request(request_id: str, tokens: list[int], salt: str | None = None, kv_transfer_params: dict | None = None):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
    return Request(request_id, tokens, SamplingParams(max_tokens=1, extra_args=extra), None, cache_salt=salt)


def test_matching_a_prefix_is_repeatable_and_takes_no_lease(model_path, cluster, client, mapper, namespace):
    """A prompt of four full blocks whose first three are committed in kvcc. Asked again and again,
    with the engine's own hit at 0, at one block and past kvcc's prefix, the scheduler's connector
    answers the same each time, however the questions are interleaved; a prompt kvcc does not hold,
    and the same prompt under another cache salt (another namespace), answer 0. After the
    questions: no lease trusted or under way in the connector's client, none granted to it in the
    directory's trace or counted in its metrics, and an invalidation of the prefix completes
    at once, with no holder to revoke. Then the connector answers 0: it follows kvcc, it does not
    remember its answers."""
    rng = random.Random(301)
    tokens = _tokens(rng, 4 * BLOCK + 5)
    keys = mapper.keys(tokens)
    assert len(keys) == 4
    for i, key in enumerate(keys[:3]):
        put = client.put(namespace, key, keys[i - 1] if i else None, rng.randbytes(TINY_BLOCK_BYTES))
        assert not hasattr(put, "reason"), put
    assert client.lookup(namespace, keys).blocks == 3

    conn = _scheduler_connector(model_path, cluster, "sched")
    try:
        holder = conn.client.holder
        client_id = conn.client_id

        def no_side_effect() -> None:
            assert holder.leases() == {}, "the scheduler's client trusts a lease"
            assert not any(holder.busy(k) for k in keys), "the scheduler's client has a lease request under way"
            mine = [(e["node"], e["event"]) for e in cluster.events() if client_id in (e["node"], e.get("holder"))]
            assert mine == [], f"{len(mine)} protocol steps of or for the scheduler's client: {mine[:6]}"
            metrics = _directory_metrics(cluster)
            assert metrics[("kvcc_directory_read_leases_live", ())] == 0
            assert metrics[("kvcc_directory_grants_total", (("request", "acquire"),))] == 0

        hit = _request("hit", tokens)
        conn.on_new_request(hit)
        asked = [(0, 3 * BLOCK), (BLOCK, 2 * BLOCK), (0, 3 * BLOCK), (3 * BLOCK, 0), (4 * BLOCK, 0), (0, 3 * BLOCK),
                 (2 * BLOCK, BLOCK), (BLOCK, 2 * BLOCK)]  # fmt: skip
        for computed, expected in asked:
            for _ in range(REPEATS):
                assert conn.get_num_new_matched_tokens(hit, computed) == (expected, False), computed
        no_side_effect()

        elsewhere = _request("miss", _tokens(rng, 4 * BLOCK + 5))
        salted = _request("salted", tokens, salt=SALT)
        for request in (elsewhere, salted):
            conn.on_new_request(request)
            for _ in range(REPEATS):
                assert conn.get_num_new_matched_tokens(request, 0) == (0, False), request.request_id
        assert conn.get_num_new_matched_tokens(hit, 0) == (3 * BLOCK, False)  # misses changed nothing either
        no_side_effect()
        assert conn.stats.get("lookup_failures", 0) == 0 and not conn.stats.get("loads_scheduled"), conn.stats

        ticket = client.invalidate(namespace, SCOPE_KEY, keys[0])
        assert ticket.keys == 3
        assert client.wait(ticket, 0), "the invalidation waited on a holder"
        assert not [e for e in cluster.events() if e["event"] == "revoke_acked"]
        for _ in range(REPEATS):
            assert conn.get_num_new_matched_tokens(hit, 0) == (0, False)
        no_side_effect()
    finally:
        conn.shutdown()


def test_a_request_that_opts_out_is_neither_looked_up_nor_tracked(model_path, cluster, client, mapper, namespace):
    """``kv_transfer_params: {"kvcc": "skip"}``: a prompt whose prefix kvcc holds answers 0 without
    a lookup, and the connector keeps nothing of the request (so it plans no save for it); the same
    prompt without the opt-out finds the prefix."""
    rng = random.Random(302)
    tokens = _tokens(rng, 3 * BLOCK + 5)
    keys = mapper.keys(tokens)
    for i, key in enumerate(keys[:2]):
        put = client.put(namespace, key, keys[i - 1] if i else None, rng.randbytes(TINY_BLOCK_BYTES))
        assert not hasattr(put, "reason"), put
    conn = _scheduler_connector(model_path, cluster, "sched-skip")
    try:
        for other in ({"kvcc": "load"}, {"other_connector": "skip"}):  # only the exact opt-out opts out
            asked = _request(f"asked-{len(conn.stats)}", tokens, kv_transfer_params=other)
            conn.on_new_request(asked)
            assert conn.get_num_new_matched_tokens(asked, 0) == (2 * BLOCK, False)
        lookups = conn.stats.get("lookups", 0)
        skipped = _request("skipped", tokens, kv_transfer_params={"kvcc": "skip"})
        conn.on_new_request(skipped)
        for _ in range(REPEATS):
            assert conn.get_num_new_matched_tokens(skipped, 0) == (0, False)
        assert conn.stats.get("lookups", 0) == lookups and conn.stats["requests_skipped"] == 1
        assert "skipped" not in conn._requests  # nothing to plan a load or a save from
        assert conn.request_finished(skipped, []) == (False, None)
    finally:
        conn.shutdown()


# -- 2. a finished request's blocks, reused at once, are saved with its own bytes ---------------------


@pytest.fixture(scope="module")
def engine(model_path, cluster, tmp_path_factory):
    """An engine whose KV cache is 8 usable blocks, with the connector's default (asynchronous)
    saves: its counters go to ``stats_path``."""
    stats_path = tmp_path_factory.mktemp("engine") / "stats"
    transfer = {
        "kv_connector": "KvccConnector",
        "kv_connector_module_path": "kvcc.adapters.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": _extra_config(cluster, "vllm-tiny", stats_path=str(stats_path)),
    }
    e = harness.VllmEngine(model_path, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN,
                           extra_args=("--kv-transfer-config", json.dumps(transfer)))  # fmt: skip
    e.kvcc_stats = stats_path
    try:
        e.start()
        yield e
    finally:
        e.close()
        assert not e.pids(), f"engine processes left running: {e.pids()}"


def _worker_stats(engine) -> dict:
    path = engine.kvcc_stats.parent / f"{engine.kvcc_stats.name}.worker.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _saved(engine) -> None:
    from kvcc.adapters.vllm.connector import wait_saves_settled

    assert wait_saves_settled(lambda: _worker_stats(engine), harness.REQUEST_TIMEOUT_S), _worker_stats(engine)


def _delta(before: dict, after: dict, name: str) -> int:
    return after.get(name, 0) - before.get(name, 0)


def test_blocks_reused_at_once_after_a_request_finished_are_saved_with_its_bytes(engine, cluster, client, mapper,
                                                                                 namespace):
    """The saver is held back: the cache node is stopped, so the save of a first prompt (``z``)
    hangs on the node and the saves queued behind it wait. Meanwhile request ``a`` (three full
    blocks) is computed and answered -- vLLM frees its blocks as it finishes, since
    ``request_finished`` keeps none -- and request ``b`` then fills all 8 blocks of the cache, so
    it overwrites every block ``a`` had, while ``a``'s save is still queued. Once the node is back
    and every save is done, kvcc holds for ``a``'s keys exactly the bytes the engine computes for
    ``a``'s prompt on its own (the same prompt under another cache salt: other keys, the same KV),
    and not ``b``'s. And ``a`` served again loads its three blocks from kvcc (the engine had indeed
    lost them) with the output it had when computed."""
    rng = random.Random(401)
    z = _tokens(rng, BLOCK + 1)
    a = _tokens(rng, 3 * BLOCK + 5)
    b = _tokens(rng, MAX_MODEL_LEN - 1)  # with its one generated token: every block of the cache
    a_keys, b_keys = mapper.keys(a), mapper.keys(b)
    assert len(a_keys) == 3 and len(b_keys) == NUM_BLOCKS - 2

    before = _worker_stats(engine)
    cluster.pause("n1")
    try:
        engine.complete(z, max_tokens=1)
        computed = engine.complete(a, max_tokens=1)
        engine.complete(b, max_tokens=1)
        during = _worker_stats(engine)
    finally:
        cluster.resume("n1")
    # The window the test is about was open: z, a and b were each handed to the saver, and not one
    # of them was done when b (which took a's blocks) had been computed.
    assert _delta(before, during, "save_batches_queued") == 3, during
    assert _delta(before, during, "save_batches_done") == 0, during
    _saved(engine)
    after = _worker_stats(engine)
    assert _delta(before, after, "saved_blocks") == 1 + 3 + len(b_keys), after
    assert client.lookup(namespace, a_keys).blocks == 3

    saved = _read_blocks(client, namespace, a_keys)
    assert all(len(block) == TINY_BLOCK_BYTES for block in saved)
    assert saved != _read_blocks(client, namespace, b_keys[:3]), "a's and b's blocks hold the same bytes"

    # a again, before anything else runs: its blocks come from kvcc, so the engine had none of
    # them left (b took them).
    served = engine.complete(a, max_tokens=1)
    _saved(engine)
    again = _worker_stats(engine)
    assert _delta(after, again, "loaded_blocks") == 3 and _delta(after, again, "load_errors") == 0, again

    # The oracle: a's prompt computed by the engine with nothing in the way, under another salt.
    engine.complete(a, max_tokens=1, cache_salt=SALT)
    _saved(engine)
    oracle = _read_blocks(client, mapper.namespace(SALT), mapper.keys(a, SALT))
    for i, (got, want) in enumerate(zip(saved, oracle, strict=True)):
        assert got == want, f"block {i} of a: kvcc holds other bytes than the engine computes for it"
    assert served["choices"][0]["token_ids"] == computed["choices"][0]["token_ids"]
