"""Process entry points: ``kvcc serve directory`` and ``kvcc serve node``.

A deployment is described by one JSON file shared by every process (``ClusterConfig``)::

    {"lease_term_ms": 2000, "skew_ms": 100,
     "tenants": {"engine-a": {"token": "<hex, >= 16 bytes>", "namespaces": ["<64 hex>", ...]}},
     "nodes": {"n1": {"token": "<hex, >= 16 bytes>"}, "n2": {"token": "<hex>"}},
     "operators": {"ops": {"token": "<hex, >= 16 bytes>"}},
     "transport": {"handshake_timeout_ms": 5000, ...},
     "tls": {"cert": "server.crt", "key": "server.key", "ca": "ca.crt", "require_client_cert": false}}

``transport`` (optional) sets the servers' ``kvcc.reference.transport.ServerLimits`` (what
unauthenticated and slow peers may hold); the defaults stand for what it leaves out.

``tls`` (optional) is the ``kvcc.reference.transport.TlsConfig`` of every connection: the
directory's and each node's listener, and every client of them (a node to the directory, an engine
to the directory and to the nodes). Relative paths are from the deployment file's directory.
Without a ``tls`` section a process serves plaintext on loopback only: asked to listen on any
other address it refuses to start (``TlsRequired``, exit 2) unless the file says ``"tls":
{"mode": "off"}``. The TLS files are read, and the address checked, before a process changes any
state (its incarnation, its durable log). With ``--metrics-port`` the metrics endpoint takes the
same settings (HTTPS when on, the same loopback rule).

``nodes`` gives each cache node a credential of its own, bound to its id (issue 14; on the wire it
is named ``node:<id>``, ``wire.node_credential``): the directory takes a node's messages (its
``Hello``, ``Freed``, ``Copied``, ``Transfer``, its evictions) only under that node's credential and
about its own locations, and no client request under it. The directory needs every node's entry; a
node needs only its own (and the tenants', to check its clients' frames): a node's copy of the file
may list only its own entry. Tenants are clients only: they get their namespaces (protocol property
11), every namespace for an ``operator`` tenant, and can never act as a node. A file without a
``nodes`` section is the older form: its ``node_tenant`` (an ``operator`` tenant) is every node's
shared credential and may act as any node, as before -- nodes are not told apart there, tenants
still may not be nodes. ``operators`` (optional) gives the people and tools that run the
deployment credentials of their own (on the wire ``operator:<name>``, ``wire.operator_credential``):
they invalidate and look up in every namespace and list the nodes -- no lease, no write, no bytes
(a node does not accept them) -- where an ``operator`` tenant is a client of every namespace.
Each process writes its protocol events to an
NDJSON file (``--events``) and, once it serves, a ready file (``--ready-file``: JSON with ``port``
and ``pid``, written atomically; ``metrics_port`` too with ``--metrics-port``) that scripts and
``kvcc cluster`` wait for. With ``--metrics-port`` a process also serves Prometheus metrics on
``http://127.0.0.1:PORT/metrics`` (``kvcc.reference.metrics``; 0: any free port). SIGINT and SIGTERM
shut a process down cleanly: the server stops accepting, connections get ``Error("shutdown")``,
tiers are closed (their files synced).

A sharded directory (docs/sharding.md) runs one ``kvcc serve directory --shard I --shards N`` per
shard, each logging its events as process ``directory-I`` (the one directory's is ``directory``); a
node is given every shard's address, ``--directory HOST:PORT`` once per shard in shard order, and
registers with each (``kvcc.reference.node``).

A node's incarnation is kept in ``<state>/incarnation`` (read, incremented, fsynced at every
start): a restarted node says Hello under a higher one, and the directory forgets what the old
one held (spec ``restart_node``). Its volatile tiers (``dram``, ``gpu``) come back empty and are
reported lost; ``nvme`` recovers from its slab files.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from attrs import frozen

from .transport import ServerLimits, TlsConfig, TlsConfigError, check_listen
from .wire import Tenants, node_credential, operator_credential

log = logging.getLogger("kvcc.serve")

VOLATILE_TIERS = ("gpu", "dram")
TIER_KINDS = ("gpu", "dram", "nvme")
DEFAULT_BLOCK_BYTES = 1 << 20
DEFAULT_METRICS_HOST = "127.0.0.1"  # metrics say what the cluster holds: not for every interface


class ConfigError(ValueError):
    """The deployment file or a command-line option is wrong; the message says which."""


class TlsSettingError(ConfigError, TlsConfigError):
    """A ``ConfigError`` about TLS: the ``tls`` section, its files, or a listen address that needs
    TLS (``cause`` is the transport's ``TlsConfigError`` or ``TlsRequired``)."""


def _credentials(section: Any, name_of: Any, clash: str, tokens: dict[str, bytes]) -> dict[str, str]:
    """A ``nodes`` or ``operators`` section: credential name -> its id, each token added to
    ``tokens``; a name already there is another credential's: ``ConfigError(clash)`` (formatted
    with ``name`` and ``ident``)."""
    out = {}
    for ident, entry in dict(section or {}).items():
        name = name_of(ident)
        if name in tokens:
            raise ConfigError(clash.format(name=name, ident=ident))
        tokens[name] = bytes.fromhex(entry["token"])
        out[name] = ident
    return out


@frozen
class ClusterConfig:
    lease_term_ms: int
    skew_ms: int
    tenants: Tenants
    node_tenant: str | None  # the older files' shared node credential; None with a ``nodes`` section
    transport: ServerLimits = ServerLimits()
    tls: TlsConfig | None = None  # None: no section (plaintext, loopback only)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, base: str | os.PathLike[str] | None = None) -> ClusterConfig:
        """``base``: where the file's relative TLS paths are from (``load``: the file's directory)."""
        try:
            tokens, namespaces, operators = {}, {}, set()
            for name, t in dict(raw["tenants"]).items():
                tokens[name] = bytes.fromhex(t["token"])
                namespaces[name] = [bytes.fromhex(h) for h in t.get("namespaces", ())]
                if t.get("operator"):
                    operators.add(name)
            node_credentials = _credentials(raw.get("nodes"), node_credential,
                                            "tenant {name!r} has the name of node {ident!r}'s credential", tokens)
            operator_names = _credentials(raw.get("operators"), operator_credential,
                                          "{name!r} is both operator {ident!r}'s credential and another's", tokens)
            tenants = Tenants(tokens, namespaces, operators=frozenset(operators), nodes=node_credentials,
                              operator_names=operator_names)  # fmt: skip
            node_tenant = raw.get("node_tenant") if node_credentials else raw["node_tenant"]
            if node_tenant is not None and node_tenant not in operators:
                raise ConfigError(f"node_tenant {node_tenant!r} must be an operator tenant")
            if node_credentials:
                node_tenant = None  # every node has its own credential: no shared one
            transport = ServerLimits.from_dict(raw.get("transport", {}))
            tls = None if raw.get("tls") is None else TlsConfig.from_dict(raw["tls"], base=base)
            return cls(int(raw["lease_term_ms"]), int(raw["skew_ms"]), tenants, node_tenant, transport, tls)
        except ConfigError:
            raise
        except TlsConfigError as e:
            raise TlsSettingError(f"bad deployment file: {e}") from e
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"bad deployment file: {type(e).__name__}: {e}") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ClusterConfig:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read deployment file {path}: {e}") from None
        return cls.from_dict(raw, base=Path(path).resolve().parent)

    def check_serving(self, *hosts: str) -> None:
        """Before a process changes any state: every address it will listen on may be used with
        this deployment's TLS (``check_listen``), and the TLS files load. Raises
        ``TlsSettingError``."""
        try:
            for host in hosts:
                check_listen(host, self.tls)
            if self.tls is not None:
                self.tls.check()
        except TlsConfigError as e:
            raise TlsSettingError(str(e)) from e

    def node_credential(self, node_id: str) -> str:
        """The credential node ``node_id`` says Hello under: its own (a ``nodes`` section), or the
        older files' shared ``node_tenant``."""
        if self.node_tenant is not None:
            return self.node_tenant
        name = node_credential(node_id)
        if self.tenants.node_of(name) != node_id:
            raise ConfigError(f"no credential for node {node_id!r} in the deployment file's \"nodes\" section")
        return name

    def token(self, tenant: str) -> bytes:
        token = self.tenants.token(tenant)
        if token is None:
            raise ConfigError(f"no tenant {tenant!r} in the deployment file")
        return token


def write_ready(path: str | None, **fields: Any) -> None:
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), **fields}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise ConfigError(f"not a size: {text!r} (e.g. 64MiB, 1GiB, 4096)") from None


def parse_tier(spec: str) -> tuple[str, int]:
    kind, sep, size = spec.partition("=")
    if not sep or kind not in TIER_KINDS:
        raise ConfigError(f"--tier takes KIND=SIZE with KIND one of {TIER_KINDS}, got {spec!r}")
    return kind, parse_size(size)


def next_incarnation(state: Path) -> int:
    state.mkdir(parents=True, exist_ok=True)
    path = state / "incarnation"
    try:
        current = int(path.read_text())
    except FileNotFoundError:
        current = 0
    except ValueError:
        raise ConfigError(f"{path} is corrupt") from None
    nxt = current + 1
    tmp = state / "incarnation.tmp"
    with open(tmp, "w") as f:
        f.write(str(nxt))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(state, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return nxt


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def check_metrics_port(port: int | None) -> None:
    """Before anything starts: a bad ``--metrics-port`` changes no state (no incarnation taken)."""
    if port is not None and not 0 <= port <= 65535:
        raise ConfigError(f"--metrics-port takes 0 .. 65535 (0: any free port), got {port}")


async def _start_metrics(registry: Any, host: str, port: int, *, off_loop: bool = False,
                         tls: TlsConfig | None = None) -> Any:  # fmt: skip
    """Serve ``registry`` on ``GET http://host:port/metrics`` (port 0: any free one; ``https``
    under ``tls``); ``off_loop``: render scrapes in a worker thread (a node's tiers may go to disk)."""
    from .metrics import MetricsEndpoint

    try:
        endpoint = await MetricsEndpoint(registry, host, port, off_loop=off_loop, tls=tls).start()
    except OSError as e:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {e}") from None
    log.info("metrics on %s://%s:%d/metrics", endpoint.scheme, host, endpoint.port)
    return endpoint


def _metrics_fields(endpoint: Any) -> dict[str, int]:
    """What the ready file says of the metrics endpoint: its bound port, if it serves one."""
    return {} if endpoint is None else {"metrics_port": endpoint.port}


def _event_log(path: str | None, node: str, incarnation: int) -> Any:
    from .events import EventLog

    return None if not path else EventLog(path, node, incarnation)


# ---------------------------------------------------------------------------------- directory


def open_store(backend: str, state: Path, etcd_endpoints: str | None, prefix: str,
               restart_grace_ms: int | None = None) -> Any:
    """The directory's durable log. ``restart_grace_ms`` (the core's): on etcd, mirror the read
    leases so that a restart waits only for those outstanding (``EtcdDirectoryStore``)."""
    if backend == "sqlite":
        from .directory.store import DirectoryStore

        state.mkdir(parents=True, exist_ok=True)
        return DirectoryStore(state / "directory.db")
    if backend == "etcd":
        if not etcd_endpoints:
            raise ConfigError("--backend etcd needs --etcd-endpoints http://HOST:PORT[,...]")
        from .directory.etcd_store import EtcdDirectoryStore

        endpoints = [e.strip() for e in etcd_endpoints.split(",") if e.strip()]
        return EtcdDirectoryStore(endpoints, prefix=prefix, restart_grace_ms=restart_grace_ms)
    raise ConfigError(f"unknown backend {backend!r} (sqlite, etcd)")


async def serve_directory(config: ClusterConfig, *, state: Path, host: str, port: int, backend: str = "sqlite",
                          etcd_endpoints: str | None = None, etcd_prefix: str = "kvcc", events: str | None = None,
                          ready_file: str | None = None, metrics_host: str = DEFAULT_METRICS_HOST,
                          metrics_port: int | None = None, shard: int = 0, shards: int = 1) -> None:  # fmt: skip
    """Serve the directory, or shard ``shard`` of ``shards`` of a sharded one (docs/sharding.md:
    its own port, state and log; the shard is recorded in the log, and a log of another shard or
    shard count is refused with ``ConfigError`` before anything changes)."""
    from kvcc.spec.rules import restart_grace

    from .directory.core import DirectoryConfig
    from .directory.server import DirectoryServer
    from .events import append_missing

    from .directory.store import ShardMismatch

    check_metrics_port(metrics_port)
    if type(shards) is not int or shards < 1 or type(shard) is not int or not 0 <= shard < shards:
        raise ConfigError(f"--shard {shard} of --shards {shards}: the shard is one of 0 .. shards - 1")
    config.check_serving(host, *([metrics_host] if metrics_port is not None else []))  # before the store opens
    grace_ms = restart_grace(config.lease_term_ms, config.skew_ms)  # DirectoryConfig.restart_grace_ms
    store = open_store(backend, state, etcd_endpoints, etcd_prefix, restart_grace_ms=grace_ms)
    try:
        store.claim_shard(shard, shards)
    except ShardMismatch as e:
        store.close()
        raise ConfigError(str(e)) from None
    bucket_ms = store.lease_bucket_ms if backend == "etcd" else None  # only etcd mirrors the leases
    cfg = DirectoryConfig(lease_term_ms=config.lease_term_ms, skew_ms=config.skew_ms, lease_mirror_bucket_ms=bucket_ms,
                          shard=shard, shards=shards)  # fmt: skip
    # A shard logs as a directory process of its own ("directory-I"): the trace validator tells a
    # key's directory by it. The one directory is "directory", as it always was.
    process = "directory" if shards == 1 else f"directory-{shard}"
    factory = None if not events else (lambda incarnation: _event_log(events, process, incarnation))
    recover = None if not events else functools.partial(append_missing, events)
    counts = None
    if metrics_port is not None:
        from .metrics import DirectoryCounts

        counts = DirectoryCounts()
    server = DirectoryServer(cfg, config.tenants, store, host=host, port=port, events_factory=factory,
                             recover_events=recover, counts=counts, limits=config.transport, tls=config.tls)  # fmt: skip
    endpoint = None
    try:
        await server.start()
        if metrics_port is not None:
            from .metrics import directory_registry

            endpoint = await _start_metrics(directory_registry(server), metrics_host, metrics_port, tls=config.tls)
        write_ready(ready_file, port=server.port, incarnation=server.incarnation, restarted=server.restarted,
                    **_metrics_fields(endpoint))  # fmt: skip
        log.info("directory%s serving on %s:%d (backend %s, incarnation %d%s)",
                 f" shard {shard} of {shards}" if shards > 1 else "", host, server.port, backend,
                 server.incarnation, ", restart grace" if server.restarted else "")  # fmt: skip
        await _until_signalled()
    finally:
        if endpoint is not None:
            await endpoint.close()
        await server.close()
        if server.events is not None:
            server.events.close()
        store.close()


# ---------------------------------------------------------------------------------- node


def open_tiers(node_id: str, state: Path, tiers: list[tuple[str, int]], block_bytes: int) -> dict[str, Any]:
    from .tiers import DramTier, GpuTier, NvmeTier

    out: dict[str, Any] = {}
    for kind, size in tiers:
        if kind in out:
            raise ConfigError(f"tier {kind} given twice")
        blocks = max(1, size // block_bytes)
        if kind == "dram":
            out[kind] = DramTier(blocks, block_bytes)
        elif kind == "gpu":
            out[kind] = GpuTier(blocks, block_bytes)
        else:
            out[kind] = NvmeTier(state / "nvme", block_bytes=block_bytes, capacity_bytes=size)
    return out


def parse_directories(directory: str | Sequence[str]) -> list[tuple[str, int]]:
    """A node's ``--directory`` values, each ``HOST:PORT``: the directory, or every shard of a
    sharded one in shard order (shard ``i`` the ``i``-th; docs/sharding.md)."""
    values = [directory] if isinstance(directory, str) else list(directory)
    if not values:
        raise ConfigError("a node needs --directory HOST:PORT")
    out = []
    for value in values:
        dhost, _, dport = value.rpartition(":")
        if not dhost or not dport.isdigit():
            raise ConfigError(f"--directory takes HOST:PORT, got {value!r}")
        out.append((dhost, int(dport)))
    if len(set(out)) != len(out):
        raise ConfigError(f"--directory: the same address twice in {', '.join(values)} (one per shard)")
    return out


async def serve_node(config: ClusterConfig, *, node_id: str, directory: str | Sequence[str], state: Path, host: str,
                     port: int, tiers: list[tuple[str, int]], block_bytes: int = DEFAULT_BLOCK_BYTES, pool: str | None = None,
                     pool_bytes: int = 1 << 30, events: str | None = None, ready_file: str | None = None,
                     metrics_host: str = DEFAULT_METRICS_HOST, metrics_port: int | None = None) -> None:  # fmt: skip
    """Serve a cache node. ``directory``: ``HOST:PORT`` of the directory, or a sequence of them,
    one per shard in shard order, for a sharded directory: the node registers with every shard."""
    from .node import CacheNode

    check_metrics_port(metrics_port)
    credential = config.node_credential(node_id)  # before anything changes
    directories = parse_directories(directory)
    if not tiers:
        raise ConfigError("a node needs at least one --tier")
    config.check_serving(host, *([metrics_host] if metrics_port is not None else []))  # before the incarnation
    incarnation = next_incarnation(state)
    opened = open_tiers(node_id, state, tiers, block_bytes)
    pool_tier = None
    if pool:
        from .tiers import SharedPoolTier

        pool_tier = SharedPoolTier(pool, pool_bytes)
    lost = [k for k in opened if k in VOLATILE_TIERS] if incarnation > 1 else []
    ev = _event_log(events, node_id, incarnation)
    counts = None
    if metrics_port is not None:
        from .metrics import NodeCounts

        counts = NodeCounts()
    node = CacheNode(node_id, opened, config.tenants, directories[0] if len(directories) == 1 else directories,
                     directory_tenant=credential,
                     incarnation=incarnation, host=host, port=port, pool=pool_tier, lost=lost, events=ev,
                     counts=counts, limits=config.transport, tls=config.tls, skew_ms=config.skew_ms)  # fmt: skip
    endpoint = None
    try:
        await node.start()  # its Hello is the spec's restart_node, logged by the directory
        if metrics_port is not None:
            from .metrics import node_registry

            endpoint = await _start_metrics(node_registry(node), metrics_host, metrics_port, off_loop=True, tls=config.tls)
        write_ready(ready_file, port=node.port, incarnation=incarnation, **_metrics_fields(endpoint))
        log.info("node %s (incarnation %d) serving on %s, tiers %s", node_id, incarnation, node.address,
                 ", ".join(node.locations))  # fmt: skip
        await _until_signalled()
    finally:
        if endpoint is not None:
            await endpoint.close()
        await node.close()
        for t in opened.values():
            t.close()
        if pool_tier is not None:
            pool_tier.close()
        if ev is not None:
            ev.close()


def configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )


def run(coro: Any) -> int:
    from .loop import loop_factory

    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(coro)
    return 0
