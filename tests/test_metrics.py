"""Prometheus metrics of a real directory and a real node, scraped over HTTP (``curl``) while a
workload of known outcome runs: the counters and gauges move exactly as the protocol says.

The cluster is ``LocalCluster(metrics=True)``: each process binds ``--metrics-port 0`` and reports
the port in its ready file. Nothing asserts how long anything took: each check polls (up to
``UNTIL_S``, never reached unless broken) for a state to be reached.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

from prometheus_client.parser import text_string_to_metric_families

from kvcc.reference.client import Refused
from kvcc.reference.cluster import ENGINE_TENANT, LocalCluster
from kvcc.reference.directory import DirectoryConfig
from kvcc.reference.directory.server import DirectoryServer
from kvcc.reference.directory.store import DirectoryStore
from kvcc.reference.metrics import DirectoryCounts, MetricsEndpoint, directory_registry
from kvcc.reference.transport import Client
from kvcc.reference.wire import Acquire, BeginWrite, Committed, LeaseRefused, ReadLeaseGranted, Tenants
from kvcc.spec.keys import Namespace, chain_keys
from kvcc.spec.vocabulary import REASON_INVALIDATING, REASON_NOT_ABSENT

QUIET_ENV = {"DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false", "HF_HUB_OFFLINE": "1"}
for _k, _v in QUIET_ENV.items():
    os.environ.setdefault(_k, _v)

NS = Namespace("metrics-model", "r1", "bfloat16", 4, cache_salt=b"metrics")
TERM_MS = 5000  # the open write lease and the read leases outlive the first scrape, even under load
SKEW_MS = 50
BLOCK_BYTES = 64 << 10
UNTIL_S = 30.0
POLL_S = 0.05
LOCATION = "n1/nvme"


def until(what: str, condition, timeout_s: float = UNTIL_S):
    deadline = time.monotonic() + timeout_s
    while True:
        got = condition()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not reached within {timeout_s} s"
        time.sleep(POLL_S)


def curl(url: str) -> str:
    """``curl`` the endpoint, as an operator (or the acceptance test of the issue) would."""
    r = subprocess.run(["curl", "--silent", "--show-error", "--fail", "--max-time", "10", url],
                       capture_output=True, text=True, timeout=30)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample: (name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(curl(url)):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def value(samples, name: str, **labels: str) -> float:
    return samples[name, tuple(sorted(labels.items()))]


def payload(tag: str) -> bytes:
    return (tag.encode() * (BLOCK_BYTES // len(tag) + 1))[:BLOCK_BYTES]


def hold_without_acking(cl: LocalCluster, key) -> tuple[asyncio.AbstractEventLoop, Client]:
    """A read lease on ``key`` held by a holder that never answers a Revoke: an invalidation of
    ``key`` stays pending until the lease expires at the directory."""
    loop = asyncio.new_event_loop()
    holder = Client(*cl.directory_address, ENGINE_TENANT, cl.engine_token)
    reply = loop.run_until_complete(holder.request(Acquire("silent", key, NS.digest(), 1)))
    assert type(reply) is ReadLeaseGranted, reply
    return loop, holder


def test_directory_and_node_metrics_move_with_the_protocol(tmp_path):
    cl = LocalCluster(tmp_path / "cluster", nodes=1, tiers=("nvme=8MiB",), block_bytes=BLOCK_BYTES,
                      lease_term_ms=TERM_MS, skew_ms=SKEW_MS, namespaces=[NS], metrics=True)  # fmt: skip
    with cl:
        dir_url, node_url = cl.metrics_url("directory"), cl.metrics_url("n1")
        before = scrape(dir_url)
        assert value(before, "kvcc_directory_read_leases_live") == 0
        assert value(before, "kvcc_directory_grants_total", request="acquire") == 0
        assert value(before, "kvcc_directory_nodes", state="up") == 1
        assert value(scrape(node_url), "kvcc_node_directory_connected") == 1

        a, b = cl.client("a"), cl.client("b")
        k1, k2 = chain_keys(NS, list(range(2 * NS.block_tokens)))
        k3 = chain_keys(NS, [7] * NS.block_tokens)[0]  # a root of its own
        assert isinstance(a.put(NS, k1, None, payload("one")), Committed)  # a write lease, its bytes, a commit
        assert a.begin_write(NS, k1, None) == Refused(REASON_NOT_ABSENT)  # a refusal
        open_write = a.begin_write(NS, k2, k1)  # a write lease left open
        assert a.write_bytes(open_write, payload("two")) is None
        la, lb = a.acquire(NS, k1), b.acquire(NS, k1)  # two read leases ...
        assert a.read(la) == payload("one")  # ... and one read of the block
        loop, silent = hold_without_acking(cl, k1)  # a third one, whose holder never acks
        try:
            d, n = scrape(dir_url), scrape(node_url)
            assert value(d, "kvcc_directory_read_leases_live") == 3
            assert value(d, "kvcc_directory_write_leases_live") == 1
            assert value(d, "kvcc_directory_grants_total", request="begin_write") == 2
            assert value(d, "kvcc_directory_grants_total", request="commit") == 1
            assert value(d, "kvcc_directory_grants_total", request="acquire") == 3
            assert value(d, "kvcc_directory_refusals_total", request="begin_write", reason=REASON_NOT_ABSENT) == 1
            assert value(d, "kvcc_directory_connections") >= 4  # the node, a, b, the silent holder
            assert value(n, "kvcc_node_tier_written_bytes_total", location=LOCATION) == 2 * BLOCK_BYTES
            assert value(n, "kvcc_node_tier_read_bytes_total", location=LOCATION) == BLOCK_BYTES
            assert value(n, "kvcc_node_tier_blocks", location=LOCATION) == 2
            assert value(n, "kvcc_node_tier_used_bytes", location=LOCATION) >= 2 * BLOCK_BYTES
            assert value(n, "kvcc_node_tier_capacity_bytes", location=LOCATION) == 8 << 20
            assert value(n, "kvcc_node_connections") >= 1

            # An invalidation: a and b acknowledge their Revoke at once, the silent holder never.
            ticket = a.invalidate(NS, "key", k1)
            d = until("the invalidation is pending on the silent lease", lambda: _pending(dir_url))
            assert value(d, "kvcc_directory_invalidations_pending") == 1
            assert value(d, "kvcc_directory_grants_total", request="invalidate") == 1
            assert value(d, "kvcc_directory_invalidation_completion_seconds_count") == 0
            assert b.acquire(NS, k1) == Refused(REASON_INVALIDATING)
            aged = until("the pending invalidation ages",
                         lambda: _older_than(dir_url, "kvcc_directory_oldest_pending_invalidation_age_seconds", 0))
            assert value(aged, "kvcc_directory_refusals_total", request="acquire", reason=REASON_INVALIDATING) == 1
            assert a.wait(ticket, UNTIL_S)  # the silent lease expired
        finally:
            loop.run_until_complete(silent.close())
            loop.close()
        d = scrape(dir_url)
        assert value(d, "kvcc_directory_invalidations_pending") == 0
        assert value(d, "kvcc_directory_oldest_pending_invalidation_age_seconds") == 0
        assert value(d, "kvcc_directory_invalidation_completion_seconds_count") == 1
        assert value(d, "kvcc_directory_invalidation_completion_seconds_bucket", le="+Inf") == 1
        assert value(d, "kvcc_directory_invalidation_completion_seconds_sum") > 0
        assert value(d, "kvcc_directory_read_leases_live") == 0

        # A fenced write: a's write lease on k3 expires unused, b writes k3 under a newer epoch at
        # the same location, then a's late bytes arrive -- and are refused by the fence.
        stale = a.begin_write(NS, k3, None)
        assert not isinstance(stale, Refused), stale
        until("a's write lease expired", lambda: value(scrape(dir_url), "kvcc_directory_write_leases_live") == 0)
        fresh = until("k3 is writable again", lambda: _granted(b.begin_write(NS, k3, None)))
        assert fresh.location == stale.location == LOCATION and fresh.epoch > stale.epoch
        assert b.write_bytes(fresh, payload("fresh")) is None
        assert a.write_bytes(stale, payload("stale")).reason == "fenced"
        n = scrape(node_url)
        assert value(n, "kvcc_node_fenced_writes_total", location=LOCATION) == 1
        assert value(n, "kvcc_node_tier_written_bytes_total", location=LOCATION) == 3 * BLOCK_BYTES


def test_a_restarted_directory_serves_metrics_where_it_did_and_counts_the_write_leases_of_its_log(tmp_path):
    cl = LocalCluster(tmp_path / "cluster", nodes=1, tiers=("nvme=8MiB",), block_bytes=BLOCK_BYTES,
                      lease_term_ms=TERM_MS, skew_ms=SKEW_MS, namespaces=[NS], metrics=True)  # fmt: skip
    with cl:
        url = cl.metrics_url("directory")
        a = cl.client("a")
        key = chain_keys(NS, [5] * NS.block_tokens)[0]
        open_write = a.begin_write(NS, key, None)
        assert not isinstance(open_write, Refused), open_write
        assert value(scrape(url), "kvcc_directory_grants_total", request="begin_write") == 1
        cl.restart_directory()
        assert cl.metrics_url("directory") == url, "a scraper finds it where it was"
        d = scrape(url)
        assert value(d, "kvcc_directory_write_leases_live") == 1, "the WRITING record came back from the log"
        assert value(d, "kvcc_directory_grants_total", request="begin_write") == 0, "counters start again"


def _pending(url: str):
    d = scrape(url)
    return d if value(d, "kvcc_directory_invalidations_pending") == 1 else None


def _older_than(url: str, name: str, seconds: float):
    d = scrape(url)
    return d if value(d, name) > seconds else None


def _granted(wl):
    return None if isinstance(wl, Refused) else wl


# -- in one process: registries apart, the endpoint's HTTP ---------------------------------------------

TOKEN = b"t" * 32


async def _http(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return await reader.read()
    except ConnectionResetError:  # a request dropped with bytes unread may end in a reset
        return b""
    finally:
        writer.close()


def test_two_directories_in_one_process_keep_their_metrics_apart(tmp_path):
    """Each server has its own registry: what one counts never shows in the other's scrape."""
    tenants = Tenants({ENGINE_TENANT: TOKEN}, {ENGINE_TENANT: [NS.digest()]})
    key = chain_keys(NS, [3] * NS.block_tokens)[0]

    async def go():
        servers, endpoints = [], []
        for name in ("one", "two"):
            store = DirectoryStore(tmp_path / f"{name}.db")
            server = await DirectoryServer(DirectoryConfig(lease_term_ms=TERM_MS, skew_ms=SKEW_MS), tenants, store,
                                           counts=DirectoryCounts()).start()  # fmt: skip
            servers.append((server, store))
            endpoints.append(await MetricsEndpoint(directory_registry(server), "127.0.0.1", 0).start())
        try:
            async with Client("127.0.0.1", servers[0][0].port, ENGINE_TENANT, TOKEN) as c:
                for request in (1, 2):  # granted, then refused: the key is WRITING
                    reply = await c.request(BeginWrite("w", key, NS.digest(), None, request))
                assert type(reply) is LeaseRefused
            pages = [await _http(e.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n") for e in endpoints]
            wrong_path = await _http(endpoints[0].port, b"GET / HTTP/1.1\r\n\r\n")
            wrong_method = await _http(endpoints[0].port, b"POST /metrics HTTP/1.1\r\n\r\n")
            head = await _http(endpoints[0].port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
            garbage = await _http(endpoints[0].port, b"x" * 20_000)
        finally:
            for e in endpoints:
                await e.close()
            for server, store in servers:
                await server.close()
                store.close()
        return pages, wrong_path, wrong_method, head, garbage

    pages, wrong_path, wrong_method, head, garbage = asyncio.run(go())
    parsed = []
    for page in pages:
        status, _, body = page.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 200 OK") and b"text/plain; version=0.0.4" in status
        samples = {}
        for family in text_string_to_metric_families(body.decode()):
            for smp in family.samples:
                samples[smp.name, tuple(sorted(smp.labels.items()))] = smp.value
        parsed.append(samples)
    one, two = parsed
    assert value(one, "kvcc_directory_grants_total", request="begin_write") == 1
    assert value(one, "kvcc_directory_refusals_total", request="begin_write", reason=REASON_NOT_ABSENT) == 1
    assert value(one, "kvcc_directory_write_leases_live") == 1
    assert value(two, "kvcc_directory_grants_total", request="begin_write") == 0
    assert value(two, "kvcc_directory_write_leases_live") == 0
    assert ("kvcc_directory_refusals_total", (("reason", REASON_NOT_ABSENT), ("request", "begin_write"))) not in two
    assert wrong_path.startswith(b"HTTP/1.1 404 ")
    assert wrong_method.startswith(b"HTTP/1.1 405 ")
    assert head.startswith(b"HTTP/1.1 200 OK") and head.endswith(b"\r\n\r\n")  # no body
    assert garbage == b""  # a request head past the limit is dropped unanswered


def test_a_bad_metrics_port_is_refused_before_anything_starts(tmp_path):
    cfg = {"lease_term_ms": 2000, "skew_ms": 100, "node_tenant": "nodes",
           "tenants": {"nodes": {"token": "ab" * 16, "operator": True}}}  # fmt: skip
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-m", "kvcc", "serve", "node", "--config", str(tmp_path / "c.json"), "--id",
                        "n1", "--directory", "127.0.0.1:1", "--state", str(tmp_path / "n1"), "--tier", "dram=1MiB",
                        "--metrics-port", "70000"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2
    assert "--metrics-port takes 0 .. 65535" in r.stderr
    assert not (tmp_path / "n1").exists(), "no incarnation was taken"


def test_a_failing_collector_answers_500_and_the_endpoint_keeps_serving():
    from prometheus_client import CollectorRegistry

    class Flaky:
        """Raises on its first collection (a collector's bug), then reports a constant."""

        calls = 0

        def collect(self):
            from prometheus_client.core import GaugeMetricFamily

            Flaky.calls += 1
            if Flaky.calls == 1:
                raise RuntimeError("a collector's bug")
            yield GaugeMetricFamily("kvcc_test_value", "a constant", value=7)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Flaky())

    async def go(off_loop: bool):
        Flaky.calls = 0
        endpoint = await MetricsEndpoint(registry, "127.0.0.1", 0, off_loop=off_loop).start()
        try:
            request = b"GET /metrics HTTP/1.1\r\n\r\n"
            return await _http(endpoint.port, request), await _http(endpoint.port, request)
        finally:
            await endpoint.close()

    for off_loop in (False, True):
        first, second = asyncio.run(go(off_loop))
        assert first.startswith(b"HTTP/1.1 500 "), first
        assert second.startswith(b"HTTP/1.1 200 OK") and b"kvcc_test_value 7.0" in second, second
