"""Prometheus metrics of the reference processes (``kvcc serve directory | node --metrics-port``).

Theory of operation
-------------------
Counting is on the hot path; exporting is not. A server that has metrics keeps a counts object
(``DirectoryCounts``, ``NodeCounts``) and bumps plain ints in it on its event loop's thread: a
dict increment per request, no lock, no allocation beyond the first time a label is seen. A
server without metrics has ``counts = None`` and pays one ``is None`` test. Everything else is
read only when scraped: a custom collector turns the counts, and gauges read from the live state
at that moment (the directory's lease table and tickets, each tier's occupancy), into metric
families.

The endpoint (``MetricsEndpoint``: ``GET /metrics``, one request per connection) is served from
the *same* event loop as the server it describes; where a scrape is rendered depends on what it
reads:

- the directory's state is in memory and owned by its loop (dicts the loop mutates), so a
  directory scrape is rendered *on* the loop, between two requests -- never while one is half
  done, with no lock to take -- at the cost of O(remembered invalidation tickets) of loop time
  (measured: about 170 us with a few tickets, 320 us of CPU with the default
  ``max_completed_tickets``, 10,000, remembered);
- a node's gauges ask its tiers, which may go to disk (the shared pool scans its directory) and
  are thread-safe (the node already calls them from worker threads), and its counts are read by
  key (atomic): a node scrape is rendered in a worker thread (``off_loop``), so a slow disk
  never stalls the node's loop.

A scrape of a stalled loop stalls too, which is the truth about that process. Each process has
its own ``CollectorRegistry`` (never the global default), so several servers in one test process
do not collide.

Names follow Prometheus conventions: ``kvcc_<process>_<what>_<unit>``, counters end in
``_total``, durations are seconds and sizes bytes. Refusal reasons are the protocol's words
(``kvcc.spec.vocabulary.DIRECTORY_REASONS``), exactly as the reply on
the wire carries them.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from kvcc.spec.keys import BlockKey
from kvcc.spec.rules import WRITING

from .directory.core import CompleteTicket, Persist
from .transport import TlsConfig, check_listen
from .wire import (
    Acquire,
    BeginWrite,
    Commit,
    CommitRejected,
    Evict,
    EvictRefused,
    Invalidate,
    LeaseRefused,
    Renew,
    Transfer,
    TransferRefused,
)

log = logging.getLogger("kvcc.metrics")

MAX_REQUEST_HEAD_BYTES = 8 << 10  # a scrape's request line and headers
REQUEST_TIMEOUT_S = 5.0  # a client that has not sent its request by then is dropped
MAX_SCRAPE_CONNECTIONS = 16  # beyond this many at once a connection is closed unanswered
# Invalidation completion: from the request to the last lease on the voided keys acknowledged or
# expired -- milliseconds when every holder answers its Revoke, up to term + epsilon when one
# does not (protocol property 7), longer across a directory restart.
INVALIDATION_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
assert list(INVALIDATION_BUCKETS_S) == sorted(set(INVALIDATION_BUCKETS_S))

# The requests the directory grants or refuses, by the name a metric labels them with.
REQUEST_NAMES: dict[type, str] = {
    Acquire: "acquire",
    Renew: "renew",
    BeginWrite: "begin_write",
    Commit: "commit",
    Evict: "evict",
    Transfer: "transfer",
    Invalidate: "invalidate",
}
REFUSAL_TYPES = frozenset({LeaseRefused, CommitRejected, EvictRefused, TransferRefused})


class _Histogram:
    """Cumulative-on-export bucket counts; ``observe`` is a bisect and two additions."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        buckets, running = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts):
            running += n
            buckets.append((bound, running))
        return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=self.sum)


# ------------------------------------------------------------------------------------ directory


class DirectoryCounts:
    """What a ``DirectoryServer`` counts as it goes. ``replied`` once per answered request,
    ``applied`` once per list of effects carried out, ``seed`` once after a restart."""

    __slots__ = ("grants", "refusals", "writing", "invalidation_s")

    def __init__(self) -> None:
        self.grants: Counter[str] = Counter()  # request name -> granted (or started)
        self.refusals: Counter[tuple[str, str]] = Counter()  # (request name, reason) -> refused
        self.writing: set[BlockKey] = set()  # keys WRITING: each holds one live write lease
        self.invalidation_s = _Histogram(INVALIDATION_BUCKETS_S)

    def replied(self, msg: Any, reply: Any) -> None:
        request = REQUEST_NAMES.get(type(msg))
        if request is None:
            return  # not a request that is granted or refused (Lookup, Release, an ack, ...)
        if type(reply) in REFUSAL_TYPES:
            self.refusals[request, reply.reason] += 1
        else:
            self.grants[request] += 1

    def applied(self, effects: Iterable[Any]) -> None:
        for e in effects:
            if type(e) is Persist:
                # Every record change is persisted: a key is WRITING from the grant of its write
                # lease to its commit, abort or expiry (the record's invariant).
                (self.writing.add if e.record.phase == WRITING else self.writing.discard)(e.record.key)
            elif type(e) is CompleteTicket:
                t = e.ticket
                assert t.completed_at_ms is not None
                self.invalidation_s.observe((t.completed_at_ms - t.started_at_ms) / 1000)

    def seed(self, records: Iterable[Any]) -> None:
        """A restarted directory's write leases come from its log, not from effects."""
        self.writing = {r.key for r in records if r.phase == WRITING}


class DirectoryCollector:
    """The directory's metric families, read from a ``DirectoryServer`` when scraped."""

    def __init__(self, server: Any) -> None:
        assert server.counts is not None, "a directory exports metrics only if it counts"
        self.server = server

    def describe(self) -> list[Any]:
        return []  # names are fixed here; nothing to check against other collectors

    def collect(self) -> Iterator[Any]:
        s, counts = self.server, self.server.counts
        core = s.core
        yield _gauge("kvcc_directory_read_leases_live", "Read leases granted and not yet ended.", len(core.read_leases))
        yield _gauge("kvcc_directory_write_leases_live", "Write leases granted and not yet committed, aborted or "
                     "expired (keys WRITING).", len(counts.writing))  # fmt: skip
        grants = CounterMetricFamily("kvcc_directory_grants", "Requests granted (a lease, a renewal, a commit, an "
                                     "eviction, a transfer, an invalidation started), by request.",
                                     labels=["request"])  # fmt: skip
        for request in REQUEST_NAMES.values():
            grants.add_metric([request], counts.grants[request])
        yield grants
        refusals = CounterMetricFamily("kvcc_directory_refusals", "Requests refused, by request and by the "
                                       "protocol's reason.", labels=["request", "reason"])  # fmt: skip
        for (request, reason), n in sorted(counts.refusals.items()):
            refusals.add_metric([request, reason], n)
        yield refusals
        # Remembered tickets are bounded (``max_completed_tickets`` completed ones, plus the pending).
        pending = [t.started_at_ms for t in core.tickets.values() if t.completed_at_ms is None]
        # A ticket recovered by a restarted directory dates from the old clock: never a negative age.
        oldest_s = max(0, s.now_ms() - min(pending)) / 1000 if pending else 0
        yield _gauge("kvcc_directory_invalidations_pending", "Invalidations started and not completed (their "
                     "voided keys still have live leases).", len(pending))  # fmt: skip
        yield _gauge("kvcc_directory_oldest_pending_invalidation_age_seconds", "How long the oldest pending "
                     "invalidation has waited (0 with none pending).", oldest_s)  # fmt: skip
        yield counts.invalidation_s.family("kvcc_directory_invalidation_completion_seconds",
                                           "From an invalidation's start to its completion.")  # fmt: skip
        yield _gauge("kvcc_directory_connections", "Open client and node connections.", s.connection_count)
        up, down = s.member_counts()
        nodes = GaugeMetricFamily("kvcc_directory_nodes", "Registered cache nodes, up or declared down (P4).",
                                  labels=["state"])  # fmt: skip
        nodes.add_metric(["up"], up)
        nodes.add_metric(["down"], down)
        yield nodes
        yield _counter("kvcc_directory_requests", "Requests handled.", s.stats["requests"])
        yield _counter("kvcc_directory_lost_directives", "Directives (Revoke, Free, Copy) for a node not connected.",
                       s.stats["lost_directives"])  # fmt: skip
        yield _counter("kvcc_directory_log_commits", "Transactions committed to the durable log.", s.stats["commits"])
        yield _gauge("kvcc_directory_commits_in_flight", "Calls waiting for their durable commit, or for one before "
                     "theirs (with a commit thread: etcd).", s.commits_in_flight)  # fmt: skip


def directory_registry(server: Any) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DirectoryCollector(server))
    return registry


# ------------------------------------------------------------------------------------ node


class NodeCounts:
    """What a ``CacheNode`` counts, per location: bytes written (stored blocks, a client's or a
    transfer's copy), bytes read (served, or the source of a copy), writes refused by the fence."""

    __slots__ = ("read_bytes", "written_bytes", "fenced_writes")

    def __init__(self) -> None:
        self.read_bytes: Counter[str] = Counter()
        self.written_bytes: Counter[str] = Counter()
        self.fenced_writes: Counter[str] = Counter()


class NodeCollector:
    """The node's metric families, read from a ``CacheNode`` when scraped; safe to run in a
    worker thread (``MetricsEndpoint(off_loop=True)``): tiers are thread-safe, and the node's
    counts are read by key, never iterated."""

    def __init__(self, node: Any) -> None:
        assert node.counts is not None, "a node exports metrics only if it counts"
        self.node = node

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        node, counts = self.node, self.node.counts
        tiers = node.tier_locations()
        families = {
            "used": GaugeMetricFamily("kvcc_node_tier_used_bytes", "Capacity in use, per location (tier).",
                                      labels=["location"]),
            "capacity": GaugeMetricFamily("kvcc_node_tier_capacity_bytes", "Capacity, per location.",
                                          labels=["location"]),
            "blocks": GaugeMetricFamily("kvcc_node_tier_blocks", "Blocks stored, per location.", labels=["location"]),
            "read": CounterMetricFamily("kvcc_node_tier_read_bytes", "Bytes read, per location.", labels=["location"]),
            "written": CounterMetricFamily("kvcc_node_tier_written_bytes", "Bytes written, per location.",
                                           labels=["location"]),
            "fenced": CounterMetricFamily("kvcc_node_fenced_writes", "Writes refused by the location's fence "
                                          "(an epoch below it: a stale writer), per location.", labels=["location"]),
        }  # fmt: skip
        for loc, tier in tiers.items():
            families["used"].add_metric([loc], tier.used_bytes)
            families["capacity"].add_metric([loc], tier.capacity_bytes)
            families["blocks"].add_metric([loc], len(tier.keys()))
            families["read"].add_metric([loc], counts.read_bytes[loc])
            families["written"].add_metric([loc], counts.written_bytes[loc])
            families["fenced"].add_metric([loc], counts.fenced_writes[loc])
        yield from families.values()
        yield _gauge("kvcc_node_connections", "Open connections to the node's data server.", node.connection_count)
        yield _gauge("kvcc_node_directory_connected", "1 while the node's link to the directory is connected.",
                     int(node.directory_connected))  # fmt: skip
        for stat, name, doc in _NODE_STATS:
            yield _counter(name, doc, node.stats[stat])


_NODE_STATS = (
    ("misses", "kvcc_node_read_misses", "Reads answered miss (the block is not here under that generation)."),
    ("evicted", "kvcc_node_evictions", "Copies dropped after the directory granted their eviction."),
    ("evict_refused", "kvcc_node_eviction_refusals", "Evictions the directory refused while making room."),
    ("freed", "kvcc_node_frees", "Copies freed on the directory's Free."),
    ("demotions", "kvcc_node_demotions", "Transfers to a slower tier asked of the directory."),
)


def node_registry(node: Any) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(node))
    return registry


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


# ------------------------------------------------------------------------------------ endpoint


class MetricsEndpoint:
    """``MetricsEndpoint(registry, host, port, *, off_loop=False)``: ``await start()``, then
    ``port`` (the bound one when asked for 0); ``await close()``. Answers ``GET /metrics`` (and
    ``HEAD``) with the registry in the Prometheus text format; any other path 404, any other
    method 405, a request head too long or too slow is dropped. Serves on the caller's event
    loop; ``off_loop``: render each scrape in a worker thread, for collectors that may block
    and are safe to call from one (see the module docstring). ``tls``: the deployment's
    ``transport.TlsConfig``, as for its other servers: on, HTTPS with the same certificate (and the
    same client certificates required); ``None``, plaintext on loopback only (``TlsRequired``)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int = 0, *, off_loop: bool = False,
                 tls: TlsConfig | None = None) -> None:  # fmt: skip
        self.registry = registry
        self.off_loop = off_loop
        self.tls = tls
        self.host = host
        self._port = port
        self._server: asyncio.base_events.Server | None = None
        self._open = 0

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return self._port

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None and self.tls.on else "http"

    async def start(self) -> MetricsEndpoint:
        check_listen(self.host, self.tls)
        if self.scheme == "http":
            self._server = await asyncio.start_server(self._serve, self.host, self._port, limit=MAX_REQUEST_HEAD_BYTES)
        else:
            assert self.tls is not None
            self._server = await asyncio.start_server(self._serve, self.host, self._port, limit=MAX_REQUEST_HEAD_BYTES,
                                                      ssl=self.tls.server_context(),
                                                      ssl_handshake_timeout=REQUEST_TIMEOUT_S)  # fmt: skip
        self._port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open += 1
        try:
            if self._open <= MAX_SCRAPE_CONNECTIONS:
                await self._answer(reader, writer)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError, ValueError):
            pass  # a client that went away or sent garbage: nothing to answer
        finally:
            self._open -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            head = await reader.readuntil(b"\r\n\r\n")
        method, _, rest = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
        path = rest.partition(" ")[0].partition("?")[0]
        if method not in ("GET", "HEAD"):
            status, body, ctype = "405 Method Not Allowed", b"GET /metrics\n", "text/plain"
        elif path != "/metrics":
            status, body, ctype = "404 Not Found", b"GET /metrics\n", "text/plain"
        else:
            status, body, ctype = await self._render()
        head_out = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                    "Connection: close\r\n\r\n").encode()  # fmt: skip
        writer.write(head_out if method == "HEAD" else head_out + body)
        async with asyncio.timeout(REQUEST_TIMEOUT_S):  # a scraper that stops reading is dropped
            await writer.drain()

    async def _render(self) -> tuple[str, bytes, str]:
        try:
            if self.off_loop:
                body = await asyncio.to_thread(generate_latest, self.registry)
            else:
                body = generate_latest(self.registry)
        except Exception:  # a collector's bug: the scraper sees a 500, the log says why, serving goes on
            log.exception("rendering the metrics failed")
            return "500 Internal Server Error", b"rendering the metrics failed; see the process log\n", "text/plain"
        return "200 OK", body, CONTENT_TYPE_PLAIN_0_0_4
