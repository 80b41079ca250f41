"""``mooncake-raw``: the adapter contract mapped onto Mooncake Store's own operations, and nothing more.

Theory of operation
-------------------
This adapter adds no protocol of its own: each contract operation is the store operation that
comes closest, performed by the named node's store client, and its answer is translated, not
corrected. What the conformance suite then finds is what the store provides natively; the
``mooncake`` adapter (``kvcc.adapters.mooncake.adapter``) is the same store with kvcc's directory
on top, and the two reports side by side show what had to be added.

The mapping (one store object per block, named ``kvcc/<namespace digest>/<key>``):

- ``lookup``: ``batch_is_exist`` on the chain, counting the leading hits. The store has no
  tenants here: every namespace is visible to every client.
- ``begin_write``: ``is_exist`` -- refused ``not_absent`` if the object exists. The grant is the
  client's own (lease id from a local counter): the store grants no write leases, has no
  generations and no epochs, so every grant carries ``gen = 0``, ``epoch = 0``, and the parent is
  not checked (the store knows no prefix chains).
- ``write_bytes``: the bytes wait in the writer's client; ``commit`` is ``put``. Mooncake's put is
  itself two-phase (PutStart reserves, the transfer fills, PutEnd publishes), so readers never see
  a partial object -- that is the store's commit. A put of an existing key answers success and
  keeps the first value (objects are immutable); a put after the writer's deadline is not fenced.
  ``Committed(gen=0, epoch=0)``: there is nothing else to report.
- ``abort``: the client drops the buffered bytes.
- ``acquire`` / ``renew``: ``is_exist``, which grants the store's per-object read lease of
  ``--default_kv_lease_ttl`` (set to the run's lease term). Lease ids are the client's counter;
  ``location`` is the pool.
- ``read``: ``get_into``; a negative code is ``Refused("miss")``. The client keeps no lease state:
  the store does not tell a client that its lease ended.
- ``release``: nothing (the store has no release).
- ``invalidate``: scope ``key``: ``remove`` (non-forced: the store refuses while its lease runs);
  scope ``namespace``: ``remove_by_regex`` on the namespace's prefix (leased objects are skipped).
  ``wait_invalidation`` repeats the remove until it no longer finds a leased object. The store
  does not know descendants (keys are digests), so ``prefix`` is not supported and ``key`` removes
  only that key; holders are not told anything.
- ``evict``: ``remove`` without force: ``-706`` (object has a lease) is ``Refused("leased")``,
  ``-704`` is ``Refused("not_found")``. No has-children check.
- faults: node ``kill``/``restart``/``pause``/``resume`` are the store node processes';
  ``restart_directory`` restarts the master (without HA it loses every object's metadata).
- events: ``inferred`` -- the store logs no protocol events.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence

from attrs import frozen

from kvcc.adapters.buffered import BufferedWrites
from kvcc.conformance.contract import (
    AdapterError,
    Capabilities,
    Committed,
    Evicted,
    InvalidationTicket,
    NotSupported,
    ReadGrant,
    Refused,
    Stored,
    WriteGrant,
)
from kvcc.spec.keys import BlockKey, Namespace
from kvcc.spec.vocabulary import (
    REASON_LEASED,
    REASON_MISS,
    REASON_NOT_ABSENT,
    REASON_NOT_COMMITTED,
    REASON_NOT_FOUND,
    REASON_UNKNOWN_LEASE,
)

from . import harness
from .base import (
    RC_OBJECT_HAS_LEASE,
    RC_OBJECT_NOT_FOUND,
    RC_OK,
    MooncakeDeployment,
)

POOL_LOCATION = "pool"
NO_GENERATION = 0  # the store has none
NO_EPOCH = 0  # the store has none
INVALIDATION_RETRY_S = 0.05


def store_key(ns: Namespace, key: BlockKey) -> str:
    return f"kvcc/{ns.digest().hex()}/{key.hex}"


def namespace_pattern(ns: Namespace) -> str:
    return f"^{re.escape(f'kvcc/{ns.digest().hex()}/')}"


@frozen
class _RawTicket:
    id: int
    node: str
    scope: str
    target: str  # the store key (scope "key") or the regex (scope "namespace")
    keys: int


class MooncakeRawAdapter(MooncakeDeployment):
    """Mooncake Store's native operations under the contract; see the module docstring."""

    name = "mooncake-raw"

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._writes: BufferedWrites[str] = BufferedWrites()  # the grant's store key, and its bytes
        self._tickets: dict[int, _RawTicket] = {}
        self._read_keys: dict[int, str] = {}  # read lease -> store key

    def capabilities(self) -> Capabilities:
        return Capabilities(
            profiles=frozenset({"core", "leases", "invalidation", "faults"}),
            faults=frozenset({"kill", "restart", "pause", "resume", "restart_directory", "intrude"}),
            scopes=frozenset({"key", "namespace"}),
            events="inferred",
            leases="enforced",
            notes=(
                "Mooncake Store's own operations, nothing added: put is the commit (two-phase in the "
                "store), is_exist/get grant the store's per-object lease (default_kv_lease_ttl = lease "
                "term), remove without force is refused under it; no generations, epochs, fencing, "
                "prefix chains, tenants, revocation or lease ids in the store."
            ),
        )

    def events(self) -> list[dict] | None:
        return None

    # ------------------------------------------------------------------ writes
    def lookup(self, node: str, ns: Namespace, keys: Sequence[BlockKey]) -> int:
        self._node_up(node)
        if not keys:
            return 0
        result, _ = self.call(node, "batch_is_exist", keys=[store_key(ns, k) for k in keys])
        if not isinstance(result, list) or len(result) != len(keys):
            raise AdapterError(f"batch_is_exist answered {result!r:.80}")
        count = 0
        for hit in result:
            if hit != 1:
                break
            count += 1
        return count

    def begin_write(self, node: str, ns: Namespace, key: BlockKey, parent: BlockKey | None) -> WriteGrant | Refused:
        self._node_up(node)
        skey = store_key(ns, key)
        sent = self.now_ns()
        rc = self.rc(node, "is_exist", key=skey)
        if rc == 1:
            return Refused(REASON_NOT_ABSENT, "the object exists in the store")
        if rc != 0:
            raise AdapterError(f"is_exist returned {rc}")
        grant = WriteGrant(
            node=node, key=key, gen=NO_GENERATION, epoch=NO_EPOCH, lease=self.next_id(), location=POOL_LOCATION,
            term_ms=self.ctx.lease_term_ms, requested_at_ns=sent,
        )  # fmt: skip
        return self._writes.open(grant, skey)

    def write_bytes(self, grant: WriteGrant, data: bytes) -> Stored | Refused:
        return self._writes.store(grant, data)

    def commit(self, grant: WriteGrant) -> Committed | Refused:
        pending = self._writes.pending(grant)
        if isinstance(pending, Refused):
            return pending
        skey, data = pending
        self._node_up(grant.node)
        rc = self.rc(grant.node, "put", key=skey, payload=data)
        if rc != RC_OK:
            return Refused(f"store_{-rc}" if rc < 0 else "store_error", f"put returned {rc}")
        self._writes.close(grant)
        return Committed(gen=NO_GENERATION, epoch=NO_EPOCH)

    def abort(self, grant: WriteGrant) -> None:
        self._writes.close(grant)

    # ------------------------------------------------------------------ reads
    def _lease(self, node: str, key: BlockKey, ns_digest_key: str, lease: int | None) -> ReadGrant | Refused:
        self._node_up(node)
        sent = self.now_ns()
        rc = self.rc(node, "is_exist", key=ns_digest_key)
        if rc == 0:
            return Refused(REASON_NOT_COMMITTED if lease is None else REASON_NOT_FOUND, "no such object in the store")
        if rc != 1:
            raise AdapterError(f"is_exist returned {rc}")
        return ReadGrant(
            node=node, key=key, gen=NO_GENERATION, epoch=NO_EPOCH,
            lease=self.next_id() if lease is None else lease, location=POOL_LOCATION,
            term_ms=self.store_lease_ms, requested_at_ns=sent,
        )  # fmt: skip

    def acquire(self, node: str, ns: Namespace, key: BlockKey) -> ReadGrant | Refused:
        grant = self._lease(node, key, store_key(ns, key), None)
        if isinstance(grant, ReadGrant):
            with self._lock:
                self._read_keys[grant.lease] = store_key(ns, key)
        return grant

    def renew(self, grant: ReadGrant) -> ReadGrant | Refused:
        with self._lock:
            skey = self._read_keys.get(grant.lease)
        if skey is None:
            return Refused(REASON_UNKNOWN_LEASE, "no such lease in this client")
        return self._lease(grant.node, grant.key, skey, grant.lease)

    def read(self, grant: ReadGrant) -> bytes | Refused:
        with self._lock:
            skey = self._read_keys.get(grant.lease)
        if skey is None:
            return Refused(REASON_UNKNOWN_LEASE, "no such lease in this client")
        self._node_up(grant.node)
        rc, data = self.call(grant.node, "get", key=skey)
        if type(rc) is not int:
            raise AdapterError(f"get answered {rc!r:.80}")
        if rc < 0:
            return Refused(REASON_MISS, f"get_into returned {rc}")
        if rc != len(data):
            raise AdapterError(f"get_into returned {rc} but {len(data)} bytes came back")
        return data

    def release(self, grant: ReadGrant) -> None:
        with self._lock:
            self._read_keys.pop(grant.lease, None)

    def intrude(self, grant: ReadGrant | WriteGrant, how: str, data: bytes | None = None) -> bytes | Stored | Refused:
        """Through another client of the store (``outsider``), get the grant's object or put
        ``data`` under its name: nothing in the store says whose it is."""
        via = self.outsider(grant, how)
        if isinstance(grant, WriteGrant):
            skey = self._writes.handle(grant.lease)
        else:
            with self._lock:
                skey = self._read_keys.get(grant.lease)
        if skey is None:
            raise AdapterError(f"grant {grant.lease} is not held in this client")
        if data is None:
            rc, got = self.call(via, "get", key=skey)
            if type(rc) is not int:
                raise AdapterError(f"get answered {rc!r:.80}")
            return got if rc >= 0 else Refused(REASON_MISS, f"get_into returned {rc}")
        rc = self.rc(via, "put", key=skey, payload=bytes(data))
        return Stored() if rc == RC_OK else Refused(f"store_{-rc}" if rc < 0 else "store_error", f"put returned {rc}")

    # ------------------------------------------------------------------ invalidation, eviction
    def invalidate(self, node: str, ns: Namespace, scope: str, key: BlockKey | None) -> InvalidationTicket:
        if scope not in self.capabilities().scopes:
            raise NotSupported(f"invalidate scope {scope!r}")
        self._node_up(node)
        if scope == "key":
            if key is None:
                raise ValueError("scope 'key' needs a key")
            skey = store_key(ns, key)
            rc = self.rc(node, "remove", key=skey)
            keys = 0 if rc == RC_OBJECT_NOT_FOUND else 1
            done = rc in (RC_OK, RC_OBJECT_NOT_FOUND)
            ticket = _RawTicket(self.next_id(), node, scope, skey, keys)
        else:
            pattern = namespace_pattern(ns)
            removed = self.rc(node, "remove_by_regex", pattern=pattern)
            if removed < 0:
                raise AdapterError(f"remove_by_regex returned {removed}")
            ticket = _RawTicket(self.next_id(), node, scope, pattern, removed)
            done = False  # leased objects were skipped, if any: wait_invalidation retries
        if not done or scope == "namespace":
            with self._lock:
                self._tickets[ticket.id] = ticket
        return InvalidationTicket(id=ticket.id, keys=ticket.keys)

    def wait_invalidation(self, ticket: InvalidationTicket, timeout_s: float) -> bool:
        with self._lock:
            t = self._tickets.get(ticket.id)
        if t is None:
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            if t.scope == "key":
                rc = self.rc(t.node, "remove", key=t.target)
                done = rc in (RC_OK, RC_OBJECT_NOT_FOUND)
            else:
                # remove_by_regex skips leased objects and answers how many it removed; the
                # store cannot say how many it skipped, so "done" is: a pass that removed none.
                removed = self.rc(t.node, "remove_by_regex", pattern=t.target)
                if removed < 0:
                    raise AdapterError(f"remove_by_regex returned {removed}")
                done = removed == 0
            if done:
                with self._lock:
                    self._tickets.pop(t.id, None)
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(INVALIDATION_RETRY_S)

    def evict(self, node: str, ns: Namespace, key: BlockKey) -> Evicted | Refused:
        self._node_up(node)
        rc = self.rc(node, "remove", key=store_key(ns, key))
        if rc == RC_OK:
            return Evicted()
        if rc == RC_OBJECT_HAS_LEASE:
            return Refused(REASON_LEASED, "the store's object lease is running")
        if rc == RC_OBJECT_NOT_FOUND:
            return Refused(REASON_NOT_FOUND, "no such object in the store")
        raise AdapterError(f"remove returned {rc}")

    # ------------------------------------------------------------------ the master as directory
    def restart_directory(self) -> None:
        master = self._master
        if master is None:
            raise AdapterError("the deployment is not running")
        try:
            master.restart()
        except harness.MooncakeHarnessError as e:
            raise AdapterError(f"mooncake_master did not restart: {e}") from None


def factory() -> MooncakeRawAdapter:
    return MooncakeRawAdapter()
