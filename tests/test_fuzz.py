"""Live fuzzing (``kvcc bench fuzz``, ``kvcc.bench.fuzz``) against a real deployment: a directory
and two cache-node processes on loopback, attacked for a few seconds with a fixed seed. Every
invariant must hold -- and the state check must catch a change made during a run, so that it
cannot pass by comparing nothing.
"""

from __future__ import annotations

import os

import pytest

from kvcc import cli
from kvcc.bench import fuzz
from kvcc.reference.client import Refused
from kvcc.spec.keys import chain_keys

for _name, _value in {"DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false",
                      "HF_HUB_OFFLINE": "1"}.items():  # fmt: skip
    os.environ.setdefault(_name, _value)

SECONDS = 5
SEED = 20261201


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with fuzz.Deployment(tmp_path_factory.mktemp("fuzz") / "cluster") as d:
        yield d
    assert not any(p.alive for p in d.cluster.procs.values()), "a process outlived the deployment"


def test_a_fuzzed_deployment_keeps_every_invariant(deployment):
    r = fuzz.fuzz(deployment, SECONDS, SEED)
    targets = {t.name for t in deployment.targets}
    # The attacks happened: every kind reached every port and was refused with typed errors.
    for kind in fuzz.KINDS:
        if kind == "flood":
            continue
        for target in targets:
            counts = r["attacks"][kind][target]
            assert counts["sent"] > 0, (kind, target)
            if kind != "slow":
                assert counts["typed_error"] > 0, (kind, target, counts)
    assert sum(r["floods"].values()) >= 1
    for target, n in r["floods"].items():
        assert n == 0 or r["flood_recovery_ms"][target] <= fuzz.FLOOD_RECOVERY_DEADLINE_S * 1000
    assert r["probes"]["sent"] >= len(targets) and r["probes"]["failed"] == 0
    # The invariants, each with what broke it.
    assert r["crashes"] == 0, (r["crashed"], r["tracebacks"])
    assert not r["state_changed"], r["state_changes"]
    assert [p for p in r["problems"] if "RSS" not in p] == []
    # A refused connection's buffers must not stay resident (they did: its failure's traceback kept
    # the session and the frame alive until a cycle collection; tests/test_wire.py has the unit case).
    assert all(g <= fuzz.RSS_GROWTH_LIMIT_BYTES for g in r["rss_growth_bytes"].values()), r["rss_bytes"]
    assert r["ok"]


def test_a_block_written_during_the_run_is_caught_as_a_state_change(deployment):
    ns = deployment.namespace
    tokens = list(range(fuzz.BLOCK_TOKENS * (fuzz.SETUP_BLOCKS + 1)))
    new_key = chain_keys(ns, tokens)[-1]
    assert new_key not in deployment.keys

    def write_once_attacks_start(text: str) -> None:
        if text.startswith("attacking"):
            out = deployment.client.put(ns, new_key, deployment.keys[-1], b"written during the run")
            assert not isinstance(out, Refused), out

    r = fuzz.fuzz(deployment, 1, SEED, on_step=write_once_attacks_start)
    assert r["state_changed"] and not r["ok"]
    assert "directory_log changed" in r["state_changes"] and "metrics changed" in r["state_changes"]
    assert any(p.startswith("state changed") for p in r["problems"])


def test_bad_input_exits_2():
    assert cli.main(["bench", "fuzz", "--seconds", "0"]) == 2


def test_the_attacker_reads_a_refusal_that_came_before_a_reset():
    """A server refuses, then resets the connection (its linger ran out while the attacker was
    still sending); the attacker reads only afterwards, as on a loaded machine. asyncio's own
    reader raises the reset and loses the refusal; the fuzzer's reader hands it out, then EOF."""
    import asyncio
    import socket
    import struct

    async def scenario(open_stream):
        reset = asyncio.Event()

        async def refuse_then_reset(reader, writer):
            writer.write(b"refused")
            await writer.drain()
            await asyncio.sleep(0.05)  # the refusal is in the peer's receive buffer
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # linger 0: RST
            reset.set()

        server = await asyncio.start_server(refuse_then_reset, "127.0.0.1", 0)
        async with server:
            reader, writer = await open_stream(server.sockets[0].getsockname()[1])
            await reset.wait()
            await asyncio.sleep(0.2)  # the attacker was busy: the reset arrived first
            try:
                return await reader.read(100), await reader.read(100)
            except ConnectionResetError:
                return "reset"
            finally:
                writer.transport.abort()

    assert asyncio.run(scenario(lambda port: asyncio.open_connection("127.0.0.1", port))) == "reset"
    assert asyncio.run(scenario(fuzz._open)) == (b"refused", b"")
