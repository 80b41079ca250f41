"""``KvccConnector``'s deployment file: a running engine's connector follows the file's settings
(the cluster, client id, event log folder, stats file) to a new kvcc deployment when the file
changes, in both roles; without the file it keeps its extra config for life. The connectors are
built in this process as vLLM builds them (the parts of the config they read), their kvcc client
replaced by a fake that records which deployment each call went to: no cluster, no engine."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvcc.adapters.vllm import harness

try:
    harness.check_installed()
    _MISSING = ""
except harness.VllmNotInstalled as e:
    _MISSING = str(e)

MODEL_ID = "kvcc/tiny-llama"
BLOCK = 32


class FakeClient:
    """Stands for ``SyncClient``: records its settings and every call, answers misses."""

    made: list[FakeClient] = []

    def __init__(self, address, tenant, token, *, client_id, skew_ms, timeout_ms, events) -> None:
        self.address, self.token, self.client_id, self.events = address, token, client_id, events
        self.calls: list[str] = []
        self.closed = False
        FakeClient.made.append(self)

    def lookup(self, ns, keys):
        self.calls.append("lookup")
        return SimpleNamespace(blocks=0)

    def acquire_chain(self, ns, keys):
        from kvcc.reference.client import Refused

        self.calls.append("acquire_chain")
        return [], Refused("miss", "fake")

    def release_many(self, leases):
        self.calls.append("release_many")

    def put_chain(self, ns, blocks):
        from kvcc.reference.client import Refused

        self.calls.append("put_chain")
        return [Refused("not_found", "fake")] * len(blocks)

    def invalidate(self, ns, scope, key=None):
        self.calls.append("invalidate")
        return object()

    def wait(self, ticket, timeout_s):
        return True

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_clients(monkeypatch):
    if _MISSING:
        pytest.fail(f"the vllm extra is required (bash scripts/setup.sh --with vllm): {_MISSING}")
    import kvcc.reference.client as client_mod

    FakeClient.made = []
    monkeypatch.setattr(client_mod, "SyncClient", FakeClient)
    return FakeClient.made


def _deployment(tmp_path, port: int, client_id: str) -> dict:
    (tmp_path / f"events-{port}").mkdir(exist_ok=True)
    return {"directory": f"127.0.0.1:{port}", "tenant": "engine", "token_hex": f"{port:04x}" * 8,
            "client_id": client_id, "colocated_node": "n1", "stats_path": str(tmp_path / client_id),
            "events_dir": str(tmp_path / f"events-{port}")}  # fmt: skip


def _connector(extra: dict, worker: bool):
    import torch
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvcc.adapters.vllm.connector import KvccConnector
    from kvcc.adapters.vllm.model import tiny_llama

    config = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(kv_connector="KvccConnector", kv_role="kv_both", kv_connector_extra_config=extra),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"),
        model_config=SimpleNamespace(model=str(tiny_llama()), served_model_name=MODEL_ID),
    )
    conn = KvccConnector(config, KVConnectorRole.WORKER if worker else KVConnectorRole.SCHEDULER, None)
    if worker:
        shape = (2, conn.kv_heads, BLOCK, 2 * conn.head_dim)
        conn.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=torch.bfloat16)
                                 for i in range(conn.layers)})  # fmt: skip
    return conn


def _request(conn, n: int):
    tokens = list(range(3, 3 + 3 * BLOCK + 1))
    req = SimpleNamespace(request_id=f"r{n}", prompt_token_ids=tokens, lora_request=None, mm_features=None,
                          prompt_embeds=None, kv_transfer_params=None, cache_salt=None)  # fmt: skip
    conn.on_new_request(req)
    return req


def _ask(conn, n: int) -> None:
    conn.get_num_new_matched_tokens(_request(conn, n), 0)


def _load_and_save(conn, n: int) -> None:
    from kvcc.adapters.vllm.connector import KvccConnectorMetadata, _Load, _Save

    key = conn.mapper.keys(list(range(3, 3 + BLOCK)))[0]
    conn.bind_connector_metadata(KvccConnectorMetadata(loads=[_Load(f"l{n}", b"ns", [(key, 0)])]))
    conn.start_load_kv(None)
    conn.get_block_ids_with_load_errors()
    conn.clear_connector_metadata()
    conn.bind_connector_metadata(KvccConnectorMetadata(saves=[_Save(f"s{n}", b"ns", [(key, None, 1)])]))
    conn.wait_for_save()
    conn.clear_connector_metadata()


def test_a_scheduler_follows_its_deployment_file(tmp_path, fake_clients):
    from kvcc.adapters.vllm.connector import write_deployment

    path = tmp_path / "deployment.json"
    write_deployment(path, _deployment(tmp_path, 7001, "vllm-e1-0"))
    conn = _connector({"model_id": MODEL_ID, "deployment_file": str(path)}, worker=False)
    _ask(conn, 1)
    _ask(conn, 2)
    assert [c.address for c in fake_clients] == [("127.0.0.1", 7001)]
    first = fake_clients[0]
    assert first.client_id == "n1.vllm-e1-0-s" and first.calls == ["lookup", "lookup"]
    assert conn.stats["lookups"] == 2

    write_deployment(path, _deployment(tmp_path, 7002, "vllm-e1-1"))
    _ask(conn, 3)
    assert [c.address for c in fake_clients] == [("127.0.0.1", 7001), ("127.0.0.1", 7002)]
    second = fake_clients[1]
    assert first.closed and first.calls == ["lookup", "lookup"]  # nothing more went to the old deployment
    assert second.client_id == "n1.vllm-e1-1-s" and second.calls == ["lookup"]
    assert second.token == bytes.fromhex(f"{7002:04x}" * 8)
    assert (tmp_path / "events-7002" / "n1.vllm-e1-1-s.ndjson").exists()  # its event log, in the new folder
    assert conn.stats == {"lookups": 1, "lookup_us": conn.stats["lookup_us"]}  # counters start afresh
    assert conn._stats_file == tmp_path / "vllm-e1-1.scheduler.json"
    assert conn.deployment_generation == 1

    # reset_cache switches too, and invalidates only what this deployment has seen
    write_deployment(path, _deployment(tmp_path, 7003, "vllm-e1-2"))
    assert conn.reset_cache() is True
    assert fake_clients[2].address == ("127.0.0.1", 7003) and fake_clients[2].calls == ["invalidate"]


def test_a_worker_follows_its_deployment_file_and_drops_saves_packed_for_the_old_one(tmp_path, fake_clients):
    from kvcc.adapters.vllm.connector import write_deployment

    path = tmp_path / "deployment.json"
    write_deployment(path, _deployment(tmp_path, 7001, "vllm-e2-0"))
    conn = _connector({"model_id": MODEL_ID, "deployment_file": str(path), "async_saves": False}, worker=True)
    _load_and_save(conn, 1)
    assert [c.address for c in fake_clients] == [("127.0.0.1", 7001)]
    assert fake_clients[0].client_id == "n1.vllm-e2-0-w"
    assert fake_clients[0].calls == ["acquire_chain", "release_many", "put_chain"]

    stale = (conn.deployment_generation, b"ns", [(conn.mapper.keys(list(range(3, 3 + BLOCK)))[0], None, b"x")])
    write_deployment(path, _deployment(tmp_path, 7002, "vllm-e2-1"))
    _load_and_save(conn, 2)
    assert [c.address for c in fake_clients] == [("127.0.0.1", 7001), ("127.0.0.1", 7002)]
    assert fake_clients[0].closed and fake_clients[0].calls == ["acquire_chain", "release_many", "put_chain"]
    assert fake_clients[1].calls == ["acquire_chain", "release_many", "put_chain"]
    assert json.loads((tmp_path / "vllm-e2-1.worker.json").read_text())["load_errors"] == 1  # the new stats file

    conn._save_batch(*stale)  # a save packed before the switch never reaches the new deployment
    assert fake_clients[1].calls == ["acquire_chain", "release_many", "put_chain"]
    assert conn.stats["saves_dropped_deployment_switched"] == 1


def test_without_a_deployment_file_the_extra_config_is_the_deployment_for_life(tmp_path, fake_clients):
    extra = {"model_id": MODEL_ID, **_deployment(tmp_path, 7001, "vllm-a")}
    conn = _connector(extra, worker=False)
    for n in range(3):
        _ask(conn, n)
    assert [c.address for c in fake_clients] == [("127.0.0.1", 7001)]
    assert fake_clients[0].calls == ["lookup"] * 3 and not fake_clients[0].closed
    assert conn.deployment_generation == 0 and conn.stats["lookups"] == 3


def test_an_unusable_deployment_file_keeps_the_current_deployment(tmp_path, fake_clients):
    from kvcc.adapters.vllm.connector import write_deployment

    path = tmp_path / "deployment.json"
    write_deployment(path, _deployment(tmp_path, 7001, "vllm-e1-0"))
    conn = _connector({"model_id": MODEL_ID, "deployment_file": str(path)}, worker=False)
    _ask(conn, 1)
    path.write_text("{not json")
    _ask(conn, 2)
    path.unlink()
    _ask(conn, 3)
    no_directory = _deployment(tmp_path, 7002, "vllm-e1-1")
    del no_directory["directory"]
    write_deployment(path, no_directory)
    _ask(conn, 4)
    assert [c.address for c in fake_clients] == [("127.0.0.1", 7001)] and fake_clients[0].calls == ["lookup"] * 4
    assert conn.client_id == "n1.vllm-e1-0-s" and conn.deployment_generation == 0  # none of it taken


def test_a_missing_deployment_file_is_refused_at_start(tmp_path, fake_clients):
    with pytest.raises(ValueError, match="deployment_file"):
        _connector({"model_id": MODEL_ID, "deployment_file": str(tmp_path / "nowhere.json")}, worker=False)
