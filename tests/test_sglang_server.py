"""The SGLang server harness and the engine profile's SGLang side, as far as they run without CUDA.

SGLang's server needs a CUDA GPU (``scripts/sglang_cuda.sh`` runs the engine profile where one
is). What is checked here is every piece that talks to SGLang, against SGLang's own code: the
server's command line parses with SGLang's own argument parser, and the backend settings in it
with SGLang's own parser of the storage extra config; a request body builds SGLang's own
``GenerateReqInput``; the page keys of a prompt are SGLang's own page hashes, chained page by page
as its radix tree stores them; the KV-event view follows events that SGLang's own publisher
(``ZmqEventPublisher``, SGLang's ``BlockStored``/``BlockRemoved``/``AllBlocksCleared``) sends over
a real socket; and without CUDA the adapter reports the engine profile unavailable, and a server
refuses to start, each saying why.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import random
import time
from pathlib import Path

import pytest

PAGE = 32


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


def _server(**kw):
    from kvcc.adapters.sglang.server import SglangServer

    extra = {"kvcc_directory": "127.0.0.1:1", "kvcc_token_hex": "00" * 16, "kvcc_client_id": "sglang-s1-1"}
    return SglangServer("/models/tiny", extra_config=extra, page_size=PAGE, **kw)


def _sglang_source(module: str) -> ast.Module:
    """The parsed source of one of SGLang's modules (some import, through SGLang's model configs,
    torchvision, which is never installed here: they are read, not imported)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, module
    return ast.parse(Path(spec.origin).read_text())


def _class_fields(tree: ast.Module, name: str) -> set[str]:
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    return {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def _parse(argv: list[str]) -> argparse.Namespace:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(argv)


def test_the_servers_command_line_parses_with_sglangs_own_parser():
    """Every flag is one SGLang 0.5.23 knows, with the value kvcc means; the backend's settings
    carry the prefetch threshold (one page) under the key SGLang's extra-config parser takes it from."""
    server = _server()
    try:
        argv = server.argv()
        assert argv[1:3] == ["-m", "sglang.launch_server"]
        args = _parse(argv[3:])
        assert (args.model_path, args.host, args.port, args.page_size) == ("/models/tiny", "127.0.0.1", server.port, PAGE)
        assert args.enable_hierarchical_cache and args.enable_cache_report and args.max_total_tokens > 1000
        assert args.cuda_graph_backend_decode == args.cuda_graph_backend_prefill == "disabled"
        assert (args.hicache_storage_backend, args.hicache_write_policy, args.hicache_storage_prefetch_policy,
                args.hicache_mem_layout) == ("dynamic", "write_through", "wait_complete", "page_first")  # fmt: skip
        events = json.loads(args.kv_events_config)
        assert events["endpoint"] == server.events_endpoint and events["replay_endpoint"] == server.replay_endpoint
        extra = json.loads(args.hicache_storage_backend_extra_config)
        assert extra["prefetch_threshold"] == PAGE
        tree = _sglang_source("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller")
        parser = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "parse_storage_backend_extra_config")
        popped = {c.args[0].value for c in ast.walk(parser) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                  and c.func.attr == "pop" and c.args and isinstance(c.args[0], ast.Constant)}  # fmt: skip
        assert "prefetch_threshold" in popped
        assert extra["module_path"] == "kvcc.adapters.sglang.backend" and extra["class_name"] == "KvccHiCacheStorage"
        assert extra["kvcc_client_id"] == "sglang-s1-1"
    finally:
        server.close()
    # The check can fail: a flag SGLang does not know is refused by its parser.
    bad = _server(extra_args=("--no-such-sglang-flag",))
    try:
        with pytest.raises(SystemExit):
            _parse(bad.argv()[3:])
    finally:
        bad.close()


def test_a_callable_extra_config_is_asked_at_every_start():
    """A restarted server gets new settings (a new client id): the command line asks again."""
    from kvcc.adapters.sglang.server import SglangServer

    gens = iter(range(1, 10))
    server = SglangServer("/models/tiny", extra_config=lambda: {"kvcc_client_id": f"sglang-s1-{next(gens)}"})
    try:
        ids = [json.loads(_parse(server.argv()[3:]).hicache_storage_backend_extra_config)["kvcc_client_id"]
               for _ in range(2)]  # fmt: skip
        assert ids == ["sglang-s1-1", "sglang-s1-2"]
    finally:
        server.close()


def test_a_generate_body_names_fields_of_sglangs_own_request_and_sampling_params():
    """``/generate`` builds SGLang's ``GenerateReqInput(**body)`` and its sampling params
    ``SamplingParams(**sampling_params)``: every name kvcc sends is a field of the first (read
    from SGLang's source: ``io_struct`` imports torchvision through the model configs), and the
    second is built."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    from kvcc.adapters.sglang.server import generate_body

    body = generate_body([5, 6, 7], 4, cache_salt="tenant-a", top_logprobs=5)
    assert body["input_ids"] == [5, 6, 7] and body["cache_salt"] == "tenant-a" and body["top_logprobs_num"] == 5
    request = _class_fields(_sglang_source("sglang.srt.managers.io_struct"), "GenerateReqInput")
    assert set(body) <= request, set(body) - request
    params = SamplingParams(**body["sampling_params"])
    assert (params.top_k, params.max_new_tokens, params.ignore_eos) == (1, 4, True)  # temperature 0: greedy
    assert "no_such_field" not in request  # the checks can fail: a name SGLang does not have
    with pytest.raises(TypeError):
        SamplingParams(no_such_field=1)
    assert "cache_salt" not in generate_body([5], 1, cache_salt=None, top_logprobs=0)


def test_page_hashes_are_sglangs_chained_page_by_page_and_seeded_by_the_salt():
    """A page's hash from its parent's equals the whole prompt's chain (how the event view
    recomputes pages one event at a time); a partial page has none; the salt seeds the chain."""
    from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed

    from kvcc.adapters.sglang.server import page_hashes

    tokens = _tokens(random.Random(3), 3 * PAGE + 5)
    whole = page_hashes(tokens, PAGE, cache_salt="t")
    assert len(whole) == 3
    assert page_hashes(tokens[PAGE : 2 * PAGE], PAGE, prior=whole[0]) == [whole[1]]
    assert whole[0] == get_hash_str(tokens[:PAGE], storage_namespace_seed(None, "t"))
    assert page_hashes(tokens, PAGE, cache_salt="u")[0] != whole[0]
    assert page_hashes(tokens, PAGE)[0] != whole[0]
    assert page_hashes(tokens[: PAGE - 1], PAGE) == []


def test_the_event_view_follows_sglangs_own_publisher(tmp_path):
    """Stores (one chain split over two events, the second naming the first's last page as its
    parent), a removal, a clear, sent by SGLang's ``ZmqEventPublisher``: the view holds exactly
    the kvcc keys the backend gives those pages (``engine_page_keys``), per salt; a page whose
    parent it never saw gets no key."""
    from sglang.srt.disaggregation.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )
    from sglang.srt.mem_cache.utils import hash_str_to_int64

    from kvcc.adapters.sglang.backend import page_key
    from kvcc.adapters.sglang.conformance import engine_namespace, engine_page_keys
    from kvcc.adapters.sglang.server import SglangEngineView, page_hashes
    from kvcc.adapters.vllm.events import KvEventSubscriber

    ens = engine_namespace("r1")
    rng = random.Random(5)
    a, b = _tokens(rng, 4 * PAGE + 3), _tokens(rng, 2 * PAGE)
    ha, hb = page_hashes(a, PAGE, cache_salt="x"), page_hashes(b, PAGE, cache_salt="y")
    ids_a, ids_b = [hash_str_to_int64(h) for h in ha], [hash_str_to_int64(h) for h in hb]

    def stored(ids, parent, tokens, salt):
        return BlockStored(block_hashes=ids, parent_block_hash=parent, token_ids=tokens, block_size=PAGE, lora_id=None,
                           medium="GPU", cache_salt=salt)  # fmt: skip

    endpoint, replay = f"ipc://{tmp_path}/ev.sock", f"ipc://{tmp_path}/replay.sock"
    pub = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay, topic="kv")
    sub = KvEventSubscriber()
    view = sub.add_engine("s1", endpoint, replay, topic="kv", view=SglangEngineView("s1", PAGE, lambda h: page_key(ens.digest(), h)))
    try:
        time.sleep(0.3)  # the SUB socket's subscription reaches the publisher

        def send(*events):
            pub.publish(KVEventBatch(ts=time.time(), events=list(events)))
            assert sub.wait_for(lambda: view.batches >= sent[0] + 1, 10.0), view.errors
            sent[0] += 1

        sent = [view.batches]
        send(stored(ids_a[:2], None, a[: 2 * PAGE], "x"))
        send(stored(ids_a[2:], ids_a[1], a[2 * PAGE : 4 * PAGE], "x"), stored(ids_b, None, b, "y"))
        keys_a, keys_b = engine_page_keys(ens, a, "x"), engine_page_keys(ens, b, "y")
        assert view.keys() == set(keys_a) | set(keys_b)
        send(BlockRemoved(block_hashes=ids_a[2:], medium="GPU"))
        assert view.keys() == set(keys_a[:2]) | set(keys_b)
        send(stored([hash_str_to_int64("ab" * 32)], 12345, b[:PAGE], "y"))  # a parent never seen
        assert view.keys() == set(keys_a[:2]) | set(keys_b)
        send(AllBlocksCleared())
        assert view.keys() == set()
    finally:
        sub.close()
        pub.shutdown()


def test_without_cuda_the_engine_profile_is_unavailable_and_a_server_will_not_start():
    import torch

    from kvcc.adapters.sglang.conformance import ENGINE_UNAVAILABLE, factory
    from kvcc.adapters.vllm.harness import EngineError

    if torch.cuda.is_available():  # scripts/sglang_cuda.sh runs the profile there
        assert "engine" in factory().capabilities().profiles
        return
    caps = factory().capabilities()
    assert caps.unavailable == {"engine": ENGINE_UNAVAILABLE} and "engine" not in caps.profiles
    assert factory().engines() == []
    server = _server()
    try:
        with pytest.raises(EngineError, match="CUDA"):
            server.start()
    finally:
        server.close()
