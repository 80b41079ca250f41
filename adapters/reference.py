"""The ``reference`` and ``reference-etcd`` adapters: kvcc's reference implementation, as real
processes, under the conformance contract (``kvcc.conformance.contract``).

Theory of operation
-------------------
``start`` brings up a ``LocalCluster`` in the run's workdir: one directory process (SQLite log,
or the etcd backend on a real etcd started here on loopback) and ``ctx.nodes`` cache-node
processes (a DRAM tier and an NVMe tier each). The contract's node ``n`` is cache node ``n`` plus
a client co-located with it (client id ``"<n>.engine"``, a ``SyncClient`` in this process): the
directory places that client's writes on its own node, and its reads go to whichever node
holds the block -- remote reads from peers.

Faults act on the real processes and on the co-located client:

- ``kill``: SIGKILL the node process and drop its client (its leases are never renewed or
  released); ``restart``: start the node on its state directory as a new incarnation and a new
  client incarnation (the directory forgets what the old ones held: spec ``restart_node``);
- ``pause``/``resume``: SIGSTOP/SIGCONT the node process *and* freeze the client's event loop
  (no revokes read, nothing acknowledged), which is what a stopped engine process would do;
- ``skew_clock``: steps the client's (the holder's) clock by the offset from now on;
- ``restart_directory``: kill -9 the directory and restart it on its log, same port.

Events are native: the directory, every node and every client write NDJSON event logs under
``workdir/events``; ``events()`` reads them all back.
"""

from __future__ import annotations

import contextlib
import platform
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvcc.conformance.contract import (
    FAULTS,
    INTRUSIONS,
    CACHE_PROFILES,
    Adapter,
    AdapterError,
    Capabilities,
    Committed,
    Evicted,
    InvalidationTicket,
    Moving,
    NotSupported,
    ReadGrant,
    Refused,
    RunContext,
    Stored,
    WriteGrant,
)
from kvcc.spec.keys import BlockKey, Namespace
from kvcc.spec.vocabulary import REASON_NOT_FOUND, REASON_REVOKED, REASON_UNAUTHORIZED, REASON_UNKNOWN_LEASE, SCOPES

CLIENT_SUFFIX = ".engine"
NODE_TIERS = ("dram=4MiB", "nvme=16MiB")
NODE_CAPACITY_BYTES = (4 + 16) << 20  # what NODE_TIERS hold together (``Capabilities.capacity_bytes``)
NODE_TIER_NAMES = tuple(t.partition("=")[0] for t in NODE_TIERS)  # a location is "<node>/<tier name>"
NODE_BLOCK_BYTES = 64 << 10
OP_TIMEOUT_MS = 10_000
REGISTER_TIMEOUT_S = 10.0  # a restarted directory hears every running node's Hello within a heartbeat
EMPTY_TICKETS_FROM = 1 << 40  # ids of the empty tickets of invalidations in a namespace the tenant may not use


def _infra(exc: BaseException) -> AdapterError:
    return AdapterError(f"{type(exc).__name__}: {exc}")


class ReferenceAdapter(Adapter):
    """``ReferenceAdapter(backend="sqlite" | "etcd", shards=1)``. ``shards`` > 1: the directory is
    that many shard processes (docs/sharding.md), every node registered with each, every client
    a ``ShardedClient``; ``restart_directory`` restarts every shard, one after another."""

    def __init__(self, backend: str = "sqlite", shards: int = 1) -> None:
        if backend not in ("sqlite", "etcd"):
            raise ValueError(f"backend is sqlite or etcd, got {backend!r}")
        if type(shards) is not int or shards < 1:
            raise ValueError(f"shards is a positive int, got {shards!r}")
        self.backend = backend
        self.shards = shards
        self.name = ("reference" if backend == "sqlite" else "reference-etcd") + ("-sharded" if shards > 1 else "")
        self._tickets: dict[int, Any] = {}  # a sharded deployment's tickets (one per shard) by the id the suite got
        self._cluster: Any = None
        self._etcd: Any = None
        self._clients: dict[str, Any] = {}
        self._frozen: dict[str, threading.Event] = {}
        self._logs: dict[str, Any] = {}
        self._writes: dict[tuple[str, bytes, int], Any] = {}
        self._crashed_writes: set[tuple[str, bytes, int]] = set()  # grants whose writer died with its node
        self._reads: dict[tuple[str, bytes, int], Any] = {}
        self._lock = threading.Lock()
        self._ctx: RunContext | None = None
        self._allowed: list[Namespace] = []  # the namespaces the deployment's tenant may use
        self._empty_tickets = 0  # tickets of invalidations in a namespace the tenant may not use

    # ------------------------------------------------------------------ lifecycle

    # The nodes' tiers (``kvcc serve node --tier``): two, the first the one a block lands in; a
    # subclass may name others of the same sizes (the vLLM adapter on CUDA: a GPU tier first).
    node_tiers: tuple[str, ...] = NODE_TIERS

    def capabilities(self) -> Capabilities:
        return Capabilities(
            profiles=frozenset(CACHE_PROFILES),
            faults=frozenset(FAULTS) - {"corrupt"},
            scopes=frozenset(SCOPES),
            events="native",
            leases="enforced",
            frees_acknowledged=True,
            capacity_bytes=self._node_count() * NODE_CAPACITY_BYTES,
            block_bytes=NODE_BLOCK_BYTES,
            slot_bytes=NODE_BLOCK_BYTES,
            notes=f"kvcc reference implementation: directory ({self.backend}"
            + (f", {self.shards} shards by chain root, each node registered with every shard" if self.shards > 1 else "")
            + ") and cache nodes (DRAM + NVMe) as "
            "processes on loopback; clients co-located with nodes; clock skew steps the holder's clock; no corrupt "
            "fault (a block lands in the node process's DRAM tier first, out of the adapter's reach)",
        )

    def _node_count(self) -> int:
        """The deployment's nodes: as started, else as a run starts them by default."""
        from kvcc.conformance.runner import DEFAULT_NODES

        return self._ctx.nodes if self._ctx is not None else DEFAULT_NODES

    def versions(self) -> Mapping[str, str]:
        from importlib.metadata import version

        out = {"kvcc": version("kvcc"), "python": platform.python_version(), "backend": self.backend}
        if self.shards > 1:
            out["directory_shards"] = str(self.shards)
        if self._etcd is not None:
            from kvcc.reference.etcd_harness import etcd_binary

            out["etcd_binary"] = str(etcd_binary())
        return out

    def start(self, ctx: RunContext) -> None:
        from kvcc.reference.cluster import LocalCluster

        self._ctx = ctx
        self._allowed = self._cluster_namespaces(ctx)
        try:
            endpoints = None
            if self.backend == "etcd":
                from kvcc.reference.etcd_harness import EtcdCluster

                self._etcd = EtcdCluster(1, ctx.workdir / "etcd").start()
                endpoints = ",".join(self._etcd.endpoints)
            self._cluster = LocalCluster(
                ctx.workdir / "cluster", nodes=ctx.nodes, tiers=self.node_tiers, block_bytes=NODE_BLOCK_BYTES,
                lease_term_ms=ctx.lease_term_ms, skew_ms=ctx.skew_ms, namespaces=self._allowed,
                backend=self.backend, etcd_endpoints=endpoints, shards=self.shards,
            ).start()  # fmt: skip
            for node in self._cluster.node_ids:
                self._clients[node] = self._new_client(node)
        except Exception as e:
            self.stop()
            raise _infra(e) from e

    def _cluster_namespaces(self, ctx: RunContext) -> list[Namespace]:
        """The namespaces the deployment's tenant may use: the run's (an adapter running engines
        adds theirs)."""
        return list(ctx.namespaces)

    def _new_client(self, node: str) -> Any:
        """The client co-located with ``node``. It keeps one identity and one event log for the
        whole run: to the directory and to the spec it is part of ``node`` (``"<node>.engine"``),
        so a crash of the node is its crash too, and the node's rejoin forgets its leases."""
        from kvcc.reference.client import SyncClient
        from kvcc.reference.cluster import ENGINE_TENANT
        from kvcc.reference.events import EventLog

        cid = f"{node}{CLIENT_SUFFIX}"
        inc = 1
        ev = self._logs.get(node)
        if ev is None:
            ev = self._logs[node] = EventLog(self._cluster.workdir / "events" / f"{cid}.ndjson", cid, inc)
        assert self._ctx is not None
        if self.shards > 1:
            from kvcc.reference.sharded import SyncShardedClient

            shards = [(address, ENGINE_TENANT, self._cluster.engine_token) for address in self._cluster.directory_addresses]
            return SyncShardedClient(shards, client_id=cid, skew_ms=self._ctx.skew_ms, events=ev, incarnation=inc,
                                     timeout_ms=OP_TIMEOUT_MS)  # fmt: skip
        return SyncClient(self._cluster.directory_address, ENGINE_TENANT, self._cluster.engine_token, client_id=cid,
                          skew_ms=self._ctx.skew_ms, events=ev, incarnation=inc, timeout_ms=OP_TIMEOUT_MS)  # fmt: skip

    def stop(self) -> None:
        for ev in self._frozen.values():
            ev.set()
        self._frozen.clear()
        for c in self._clients.values():
            try:
                c.close()
            except Exception:
                pass
        self._clients.clear()
        for ev in self._logs.values():
            ev.close()
        self._logs.clear()
        if self._cluster is not None:
            try:
                self._cluster.stop()
            except Exception:
                pass
        if self._etcd is not None:
            try:
                self._etcd.stop()
            except Exception:
                pass

    def nodes(self) -> Sequence[str]:
        return list(self._cluster.node_ids) if self._cluster is not None else []

    def events(self) -> list[dict] | None:
        if self._cluster is None:
            return []
        return self._cluster.events()

    # ------------------------------------------------------------------ plumbing

    def _client(self, node: str) -> Any:
        c = self._clients.get(node)
        if c is None:
            if self._cluster is None or node not in self._cluster.node_ids:
                raise AdapterError(f"no node {node!r}")
            raise AdapterError(f"node {node!r} is down (killed)")
        return c

    def _call(self, node: str, method: str, *args: Any) -> Any:
        from kvcc.reference.errors import ConnectionFailed, TimeoutError_

        try:
            return getattr(self._client(node), method)(*args)
        except (ConnectionFailed, TimeoutError_, TimeoutError, OSError) as e:
            raise _infra(e) from e

    @staticmethod
    def _refused(r: Any) -> Refused:
        return Refused(r.reason, r.detail)

    # ------------------------------------------------------------------ writes

    def lookup(self, node: str, ns: Namespace, keys: Sequence[BlockKey]) -> int:
        from kvcc.reference.errors import Unauthorized

        try:
            return self._call(node, "lookup", ns, list(keys)).blocks
        except AdapterError as e:
            if REASON_UNAUTHORIZED in e.reason or "Unauthorized" in e.reason:
                return 0
            raise
        except Unauthorized:
            return 0

    def begin_write(self, node: str, ns: Namespace, key: BlockKey, parent: BlockKey | None) -> WriteGrant | Refused:
        from kvcc.reference.client import Refused as R

        wl = self._call(node, "begin_write", ns, key, parent)
        if isinstance(wl, R):
            return self._refused(wl)
        c = self._client(node).client
        with self._lock:
            self._writes[(node, key.digest, wl.lease)] = wl
        return WriteGrant(node, key, wl.gen, wl.epoch, wl.lease, wl.location, wl.term_ms,
                          max(0, wl.sent_ns - c.clock_offset_ns))  # fmt: skip

    def _write_lease(self, grant: WriteGrant) -> Any:
        with self._lock:
            wl = self._writes.get((grant.node, grant.key.digest, grant.lease))
        if wl is None:
            raise AdapterError(f"write grant {grant.lease} was not issued by this adapter")
        return wl

    def write_bytes(self, grant: WriteGrant, data: bytes) -> Stored | Refused:
        from kvcc.reference.client import Refused as R

        wl = self._write_lease(grant)
        with self._lock:
            crashed = (grant.node, grant.key.digest, grant.lease) in self._crashed_writes
        if crashed:  # the co-located client that held the grant died with the node: nothing is sent
            return Refused(REASON_NOT_FOUND, f"the writer of grant {grant.lease} crashed with node {grant.node}")
        out = self._call(grant.node, "write_bytes", wl, data)
        return self._refused(out) if isinstance(out, R) else Stored()

    def commit(self, grant: WriteGrant) -> Committed | Refused:
        from kvcc.reference.client import Refused as R

        out = self._call(grant.node, "commit", self._write_lease(grant))
        return self._refused(out) if isinstance(out, R) else Committed(out.gen, out.epoch)

    def abort(self, grant: WriteGrant) -> None:
        with self._lock:  # kept: bytes of an aborted grant may still be sent (and are fenced)
            wl = self._writes.get((grant.node, grant.key.digest, grant.lease))
        c = self._clients.get(grant.node)
        if wl is not None and c is not None:
            c.abort(wl)

    # ------------------------------------------------------------------ reads

    def acquire(self, node: str, ns: Namespace, key: BlockKey) -> ReadGrant | Refused:
        from kvcc.reference.client import Refused as R

        lease = self._call(node, "acquire", ns, key)
        if isinstance(lease, R):
            return self._refused(lease)
        return self._grant(node, lease)

    def _grant(self, node: str, lease: Any) -> ReadGrant:
        c = self._client(node).client
        with self._lock:
            self._reads[(node, lease.key.digest, lease.lease)] = lease
        return ReadGrant(node, lease.key, lease.gen, lease.epoch, lease.lease, lease.location, lease.term_ms,
                         max(0, lease.sent_ns - c.clock_offset_ns))  # fmt: skip

    def _read_lease(self, grant: ReadGrant) -> Any:
        with self._lock:
            lease = self._reads.get((grant.node, grant.key.digest, grant.lease))
        if lease is None:
            raise AdapterError(f"read grant {grant.lease} was not issued by this adapter")
        return lease

    def renew(self, grant: ReadGrant) -> ReadGrant | Refused:
        from kvcc.reference.client import Refused as R

        c = self._client(grant.node)
        current = c.lease_of(grant.key)
        if current is None or current.lease != grant.lease:
            return Refused(REASON_UNKNOWN_LEASE, "not held (released, revoked or expired)")
        out = self._call(grant.node, "renew", current)
        return self._refused(out) if isinstance(out, R) else self._grant(grant.node, out)

    def read(self, grant: ReadGrant) -> bytes | Refused:
        from kvcc.reference.client import Refused as R

        c = self._client(grant.node)
        current = c.lease_of(grant.key)
        lease = current if current is not None and current.lease == grant.lease else self._read_lease(grant)
        out = self._call(grant.node, "read", lease)
        if isinstance(out, R):
            reason = REASON_UNKNOWN_LEASE if out.reason == REASON_REVOKED else out.reason
            return Refused(reason, out.detail)
        return out

    def release(self, grant: ReadGrant) -> None:
        c = self._clients.get(grant.node)
        if c is None:
            return
        current = c.lease_of(grant.key)
        lease = current if current is not None and current.lease == grant.lease else None
        with self._lock:
            lease = lease or self._reads.get((grant.node, grant.key.digest, grant.lease))
        if lease is not None:
            self._call(grant.node, "release", lease)

    # ------------------------------------------------------------------ an outsider at the data plane

    def intrude(self, grant: ReadGrant | WriteGrant, how: str, data: bytes | None = None) -> bytes | Stored | Refused:
        """As the deployment's second tenant (``nodes``: a valid credential of no namespace), on a
        connection of its own to the node that serves ``grant.location``, send ``ReadBytes`` (or
        ``WriteBytes`` of ``data``) for the grant's key, generation and epoch under no grant, the
        owner's grant with its MACs inverted, or the owner's grant as the directory sent it."""
        from kvcc.reference.cluster import NODE_TENANT
        from kvcc.reference.errors import ConnectionFailed
        from kvcc.reference.wire import BytesRead, BytesStored, Error, ReadBytes, ReadRefused, WriteBytes
        from kvcc.spec.vocabulary import location_host

        if how not in INTRUSIONS:
            raise ValueError(f"intrude presents one of {list(INTRUSIONS)}, got {how!r}")
        owner = self._write_lease(grant) if isinstance(grant, WriteGrant) else self._read_lease(grant)
        proof = {"absent": b"", "forged": owner.grant[:8] + bytes(b ^ 0xFF for b in owner.grant[8:]),
                 "stolen": owner.grant}[how]  # fmt: skip
        node = location_host(grant.location)
        proc = self._cluster.procs.get(node) if self._cluster is not None else None
        if proc is None or not proc.alive:
            raise AdapterError(f"location {grant.location!r} is down")
        token = bytes.fromhex(self._cluster.config["tenants"][NODE_TENANT]["token"])
        msg: Any = (
            ReadBytes("outsider", grant.key, grant.lease, grant.location, grant.gen, proof) if data is None
            else WriteBytes("outsider", grant.key, grant.lease, grant.location, grant.gen, grant.epoch, data, proof)
        )  # fmt: skip

        try:
            reply = self._ask_as(NODE_TENANT, token, ("127.0.0.1", int(proc.info["port"])), msg)
        except ConnectionFailed as e:  # the node ended the session instead of answering
            return Refused(e.code or REASON_UNAUTHORIZED, str(e))
        match reply:
            case BytesRead():
                return reply.data
            case BytesStored():
                return Stored()
            case ReadRefused():
                return Refused(reply.reason, "the location refused the outsider")
            case Error():
                return Refused(reply.code, reply.text)
        raise AdapterError(f"the location answered the outsider {type(reply).__name__}")

    def _ask_as(self, principal: str, token: bytes, address: tuple[str, int], msg: Any) -> Any:
        """One request on a connection of its own under ``principal``'s credential: the reply
        (``ConnectionFailed`` when the peer ended the session instead of answering)."""
        import asyncio

        from kvcc.reference.errors import TimeoutError_
        from kvcc.reference.transport import Client

        async def ask() -> Any:
            async with Client(address[0], int(address[1]), principal, token, tls=self._cluster.tls) as c:
                return await c.request(msg, timeout_ms=OP_TIMEOUT_MS)

        try:
            return asyncio.run(ask())
        except (TimeoutError_, TimeoutError, OSError) as e:
            raise _infra(e) from e

    # ------------------------------------------------------------------ tier transfers

    def move(self, grant: ReadGrant) -> Moving | Refused:
        """As the node that serves ``grant.location`` -- under its own credential, as its demoter
        does -- ask the directory to move the block to that node's other tier (DRAM to NVMe, NVMe
        to DRAM: the node copies between its own tiers, then says ``Copied``)."""
        from kvcc.reference.errors import ConnectionFailed
        from kvcc.reference.wire import Transfer, TransferRefused, TransferStarted, node_credential
        from kvcc.spec.vocabulary import LOCATION_SEPARATOR, location_host

        node = location_host(grant.location)
        proc = self._cluster.procs.get(node) if self._cluster is not None else None
        if proc is None or not proc.alive:
            raise AdapterError(f"location {grant.location!r} is down")
        tier = grant.location.partition(LOCATION_SEPARATOR)[2]
        names = tuple(t.partition("=")[0] for t in self.node_tiers)
        dest = next((f"{node}{LOCATION_SEPARATOR}{t}" for t in names if t != tier), None)
        if dest is None or tier not in names:
            return Refused(REASON_NOT_FOUND, f"{grant.location} is not one of {node}'s tiers")
        try:
            # Sharded: to the shard that granted the lease (shard i hands out ids congruent to i).
            directory = (self._cluster.directory_addresses[grant.lease % self.shards] if self.shards > 1
                         else self._cluster.directory_address)  # fmt: skip
            reply = self._ask_as(node_credential(node), self._cluster.node_token(node), directory,
                                 Transfer(node, grant.key, grant.gen, grant.location, dest))  # fmt: skip
        except ConnectionFailed as e:
            raise _infra(e) from e
        match reply:
            case TransferStarted():
                return Moving(grant.location, dest, reply.epoch)
            case TransferRefused():
                return Refused(reply.reason, f"the directory did not move the block to {dest}")
        raise AdapterError(f"the directory answered a Transfer with {type(reply).__name__}")

    # ------------------------------------------------------------------ invalidation, eviction

    def invalidate(self, node: str, ns: Namespace, scope: str, key: BlockKey | None) -> InvalidationTicket:
        if scope not in self.capabilities().scopes:
            raise NotSupported(f"invalidate:{scope}")
        assert self._ctx is not None
        if ns not in self._allowed:
            # Contract: a namespace the tenant may not use voids nothing and logs nothing; a ticket
            # of 0 keys, complete at once. Not sent: the directory ends the session of a tenant
            # that names a namespace it may not use where no refusal can carry it (Invalidate).
            with self._lock:
                self._empty_tickets += 1
                return InvalidationTicket(EMPTY_TICKETS_FROM + self._empty_tickets, 0)
        ticket = self._call(node, "invalidate", ns, scope, key)
        if self.shards == 1:
            return InvalidationTicket(ticket.id, ticket.keys)
        with self._lock:  # one id for the shards' tickets together (``ShardedTicket``)
            self._tickets[len(self._tickets) + 1] = ticket
            return InvalidationTicket(len(self._tickets), ticket.keys)

    def wait_invalidation(self, ticket: InvalidationTicket, timeout_s: float) -> bool:
        if EMPTY_TICKETS_FROM < ticket.id <= EMPTY_TICKETS_FROM + self._empty_tickets:
            return True
        # Any client will do but a paused node's: its loop is frozen (``pause``), and a wait sent
        # through it came back only as a timeout (the performance suite's invalidation by expiry,
        # whose paused holder is the first node, found it).
        node = next((n for n in self._clients if n not in self._frozen), None)
        if node is None:
            raise AdapterError("no live client to wait with: every node is down or paused")
        if self.shards > 1:
            with self._lock:
                parts = self._tickets.get(ticket.id)
            if parts is None:
                raise AdapterError(f"invalidation ticket {ticket.id} was not issued by this adapter")
            return bool(self._call(node, "wait", parts, timeout_s))
        return bool(self._call(node, "wait", ticket.id, timeout_s))

    def evict(self, node: str, ns: Namespace, key: BlockKey) -> Evicted | Refused:
        from kvcc.reference.client import Refused as R

        out = self._call(node, "evict", key, node)  # the node finds the tier that holds it
        return self._refused(out) if isinstance(out, R) else Evicted()

    # ------------------------------------------------------------------ faults

    def kill(self, node: str) -> None:
        self._cluster.kill(node)
        with self._lock:
            self._crashed_writes |= {w for w in self._writes if w[0] == node}
        c = self._clients.pop(node, None)
        if c is not None:  # its memory goes with it (its log stays: the node's crash is logged)
            self._thaw(node)
            try:
                c.close()
            except Exception:
                pass

    def restart(self, node: str) -> None:
        if node in self._clients:
            self.kill(node)
        try:
            self._cluster.restart(node)
        except Exception as e:
            raise _infra(e) from e
        self._clients[node] = self._new_client(node)

    def pause(self, node: str) -> None:
        self._cluster.pause(node)
        c = self._clients.get(node)
        if c is not None and node not in self._frozen:
            gate = self._frozen[node] = threading.Event()
            c._loop.call_soon_threadsafe(gate.wait)  # the client's loop stops, as in SIGSTOP

    def resume(self, node: str) -> None:
        self._cluster.resume(node)
        self._thaw(node)

    def _thaw(self, node: str) -> None:
        gate = self._frozen.pop(node, None)
        if gate is not None:
            gate.set()

    def skew_clock(self, node: str, offset_ms: int) -> None:
        self._client(node).client.clock_offset_ns = offset_ms * 1_000_000

    def restart_directory(self) -> None:
        try:
            self._cluster.restart_directory()
        except Exception as e:
            raise _infra(e) from e
        self._wait_registered()

    def _wait_registered(self) -> None:
        """Return once every running node has said Hello to the restarted directory (its next
        heartbeat), as a deployment is back only then: before it, the directory knows no node,
        and places a co-located writer's block nowhere (``location_down``). A paused node cannot
        say Hello until it resumes; a node that does not register in time is left to the tests."""
        from kvcc.reference.errors import ConnectionFailed, TimeoutError_

        running = [n for n in self._clients if n not in self._frozen]
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while running and time.monotonic() < deadline:
            with contextlib.suppress(ConnectionFailed, TimeoutError_, TimeoutError, OSError):
                if set(self._clients[running[0]].refresh_nodes()) >= set(running):
                    return
            time.sleep(0.02)


def reference() -> ReferenceAdapter:
    """The reference deployment (directory on its SQLite log, cache nodes, TCP) on loopback."""
    return ReferenceAdapter("sqlite")


def reference_etcd() -> ReferenceAdapter:
    """The reference deployment with its directory on a loopback etcd cluster."""
    return ReferenceAdapter("etcd")


def reference_sharded() -> ReferenceAdapter:
    """The reference deployment with its directory in two shards (SQLite logs), nodes registered with both."""
    return ReferenceAdapter("sqlite", shards=2)
