"""The reference runtime's state, mapped onto the spec's state, and the spec's invariants on it.

Theory of operation
-------------------
The spec (``kvcc.spec.layout``) packs one protocol state into bytes: the directory's records and
lease table, each node's holder and writer tables, the storage slots and fences of every
location, the network. The reference keeps the same things in other shapes: ``DirectoryCore``
records and its ``read_leases`` table, what each ``KvccClient`` trusts (``lease_of``), the write
leases a writer holds, the blocks and fences of each node's ``Tier``. ``SpecMap`` turns a
``Snapshot`` of those into a spec state of a ``ModelConfig`` built for the deployment, and
evaluates the spec's own predicates (``kvcc.spec.properties``) on it -- the same functions the
model checker, the proofs and the trace validator use.

Naming. Spec nodes are the cache nodes first, then the clients (holders and writers). Every spec
node has ``tiers_per_node`` locations; a cache node's are ``"<node>/<tier>"`` in the order given,
a client's stay empty. ``shared_pool`` adds location ``"pool"``. Keys are indexed in the order
given (parents first, as the spec requires); namespaces by digest. Each spec node's tenant is
authorised for the namespaces given (cache nodes: operators, every namespace).

Values. The spec stores every value below 256. Generations and epochs are stored as they are
(``Unexpressible`` if one is not below the bound). Lease ids, which the reference reserves in
blocks, are renumbered by rank (order and equality kept: ``LeaseIdsFresh`` compares ids with the
counter, ``LeaseKnownToDirectory`` compares them for equality). Times left (a holder's trust, a
directory lease, a write lease, the restart grace) are in nanoseconds, each on the clock that owns
it, and are likewise renumbered by rank, 0 kept for "expired": the spec compares them only with
each other (all clocks run at one rate, so ticks left on one's own clock are true time left).
The ghost ``inval_age`` (true time since a key began invalidating) is in ticks of
``tick_ms = gcd(term, epsilon)``, rounded down, and compared with the spec's deadline for the
number of directory restarts the run has seen.

Messages. A snapshot is taken between requests, so the network is mapped as empty except for
acknowledgements: every ``RevokeAcked`` a holder has sent is put in flight (``M_ACK``), so that
``NoReadAfterAck`` asks that no holder still trusts a lease it acknowledged. (Lease ids are never
reused and a revoked lease is never renewed, so an ack stays true once sent.)

What is evaluated
-----------------
Every state invariant of ``INVARIANTS`` is evaluated on every snapshot:
OneWriterPerGeneration (the write leases writers hold), OneOwnerPerEpoch, EpochsBoundFences,
NoDirtyRead, CommittedBytesIntact, NoReclaimUnderLease, NoStaleRead, NoReadAfterAck (acks as
above), LeaseIdsFresh, LeaseKnownToDirectory, DirectoryDataAgreement, PrefixClosed,
NamespaceIsolation, and the progress invariant InvalidationCompletesInTime (when the caller
supplies invalidation ages). ``WriteLeaseEndsInTime`` is evaluated as "time may not pass here"
(a WRITING record whose write lease's time is up is a violation): call it only once the
directory has had the chance to run its timers.

Between two snapshots, the step properties EpochMonotonic and FencingHolds are evaluated with
the spec's predicates (``crashed_with_disk_loss`` plays the spec's ``crash(n, lose_disk=1)``,
after which a fence may start again from zero). RenewalNeverRevives is restated for composite
steps: the spec's predicate asks that a new lease-table entry carry exactly the counter's
previous value, which only holds for single steps; the restatement asks that it be at least that
(a fresh id, never one that was in use). LeasesGrantedOnlyOnCommitted is not evaluated between
snapshots: a composite step may grant a lease and then start an invalidation, which the spec
takes as two steps; NoDirtyRead on every snapshot and the directory's own rule calls cover it.

Not expressible here: the holders' and writers' pending requests (``pending``, ``stage``
REQUESTED) -- a snapshot is between requests; messages other than acks; the fault budgets;
clock offsets (only the times left matter to the predicates). A slot that a node lost in a crash
is ``LOST`` (a read fails, it never returns other bytes) until that location stores the key again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from attrs import field, frozen

from kvcc.spec.config import STATE_VALUE_LIMIT, ModelConfig
from kvcc.spec.keys import BlockKey
from kvcc.spec.layout import (
    EMPTY,
    FULL,
    LOST,
    M_ACK,
    NO_LEASE,
    NO_LOCATION,
    NO_NODE,
    W_BYTES_SENT,
    message,
)
from kvcc.spec.model import Model
from kvcc.spec.properties import INVARIANTS, epoch_monotonic, fencing_holds, write_lease_ends_in_time
from kvcc.spec.rules import lease_live

POOL = "pool"
NS_PER_MS = 1_000_000
# Every invariant the mapping evaluates, by its name in kvcc.spec.properties.
EVALUATED = tuple(inv.name for inv in INVARIANTS)
STEP_PROPERTIES = ("EpochMonotonic", "FencingHolds", "RenewalNeverRevives")
PROGRESS = ("InvalidationCompletesInTime", "WriteLeaseEndsInTime")


class Unexpressible(Exception):
    """The runtime's state does not fit the spec's encoding (a value past the byte bound, a
    location or key the map was not told about)."""


# -- what a snapshot holds ----------------------------------------------------------------------


@frozen
class RecordView:
    """A directory record (``core.Record``), with the write lease's time left on the directory's
    clock (0 when its time is up)."""

    key: BlockKey
    phase: int
    gen: int
    epoch: int
    owner: str | None
    moving_to: str | None
    draining: str | None
    writer: str | None
    write_lease: int
    write_left_ns: int


@frozen
class LeaseView:
    """A live entry of the directory's read-lease table, its time left on the directory's clock."""

    lease: int
    holder: str
    key: BlockKey
    location: str
    left_ns: int


@frozen
class TrustView:
    """A read lease a holder trusts, its trust left on the holder's own clock (> 0)."""

    holder: str
    key: BlockKey
    lease: int
    location: str
    gen: int
    left_ns: int


@frozen
class WriterView:
    """A write lease a writer holds (granted, bytes sent or about to be), not yet committed,
    aborted or fenced."""

    writer: str
    key: BlockKey
    lease: int
    location: str
    gen: int
    epoch: int


@frozen
class SlotView:
    """What one location holds of one key: ``gen``/``epoch`` of a stored block, or ``lost``."""

    location: str
    key: BlockKey
    gen: int = 0
    epoch: int = 0
    lost: bool = False


@frozen
class Snapshot:
    records: tuple[RecordView, ...]
    leases: tuple[LeaseView, ...]
    next_lease_id: int
    grace_left_ns: int
    trusted: tuple[TrustView, ...]
    writers: tuple[WriterView, ...]
    slots: tuple[SlotView, ...]
    fences: Mapping[tuple[str, BlockKey], int]
    acks: tuple[tuple[str, BlockKey, int], ...] = ()  # (holder, key, lease) acknowledged
    inval_age_ms: Mapping[BlockKey, int] = field(factory=dict)
    directory_restarts: int = 0
    down: frozenset[str] = frozenset()


# -- reading the reference's objects --------------------------------------------------------------


def directory_view(core: Any, now_ms: int) -> tuple[tuple[RecordView, ...], tuple[LeaseView, ...], int, int]:
    """Records, live leases, the lease-id counter and the grace left of a ``DirectoryCore`` whose
    clock reads ``now_ms``. Times left are rounded *down* to what the directory surely still has
    (its clock may be up to 1 ms past ``now_ms``)."""

    def left(expires_at_ms: int) -> int:
        return max(0, (expires_at_ms - now_ms) * NS_PER_MS - (NS_PER_MS - 1)) if lease_live(now_ms, expires_at_ms) else 0

    records = tuple(
        RecordView(
            rec.key, rec.phase, rec.gen, rec.epoch, rec.owner, rec.moving_to, rec.draining, rec.writer,
            rec.write_lease, left(rec.write_lease_expires_at_ms) if rec.write_lease else 0,
        )  # fmt: skip
        for rec in core.records.values()
    )
    leases = tuple(
        LeaseView(e.lease, e.node, e.key, e.location, left(e.expires_at_ms))
        for e in core.read_leases.values()
        if lease_live(now_ms, e.expires_at_ms)
    )
    grace = 0 if core.grace_until_ms is None else left(core.grace_until_ms)
    return records, leases, core.next_lease_id, grace


def client_trust(client: Any, keys: Iterable[BlockKey], now_ns: int | None = None) -> tuple[TrustView, ...]:
    """What a ``KvccClient`` trusts now (``lease_of`` and its trust budget on its own clock)."""
    if now_ns is None:
        now_ns = time.monotonic_ns() + getattr(client, "clock_offset_ns", 0)
    out = []
    for key in keys:
        lease = client.lease_of(key)
        if lease is not None and now_ns < lease.trusted_until_ns:
            out.append(TrustView(client.client_id, key, lease.lease, lease.location, lease.gen,
                                 lease.trusted_until_ns - now_ns))  # fmt: skip
    return tuple(out)


def tier_slots(location: str, tier: Any, keys: Iterable[BlockKey]) -> tuple[tuple[SlotView, ...], dict]:
    """The blocks a ``Tier`` holds of ``keys`` and its fences."""
    wanted = {k.digest: k for k in keys}
    slots = tuple(
        SlotView(location, wanted[b.key], b.gen, b.epoch) for b in tier.blocks() if b.key in wanted
    )
    fences = {(location, k): tier.fence(d) for d, k in wanted.items() if tier.fence(d)}
    return slots, fences


# -- the map ------------------------------------------------------------------------------------------


class SpecMap:
    """``SpecMap(keys, parents, namespaces, cache_nodes, tiers, clients, authorized, term_ms,
    skew_ms, shared_pool=False)``: ``violations(snapshot)`` names the invariants that fail,
    ``step_violations(pre, post)`` the step properties; ``encode(snapshot)`` is the spec state."""

    def __init__(
        self,
        *,
        keys: Sequence[BlockKey],
        parents: Mapping[BlockKey, BlockKey | None],
        namespaces: Mapping[BlockKey, bytes],
        cache_nodes: Sequence[str],
        tiers: Sequence[str],
        clients: Sequence[str],
        authorized: Mapping[str, Iterable[bytes]],
        term_ms: int,
        skew_ms: int,
        shared_pool: bool = False,
    ) -> None:
        self.keys = list(keys)
        self.key_index = {k: i for i, k in enumerate(self.keys)}
        assert len(self.key_index) == len(self.keys), "keys are distinct"
        self.nodes = [*cache_nodes, *clients]
        self.node_index = {n: i for i, n in enumerate(self.nodes)}
        assert len(self.node_index) == len(self.nodes), "node and client ids are distinct"
        digests = sorted({namespaces[k] for k in self.keys})
        self.ns_index = {d: i for i, d in enumerate(digests)}
        self.locations: dict[str, int] = {}
        for i, node in enumerate(cache_nodes):
            for j, tier in enumerate(tiers):
                self.locations[f"{node}/{tier}"] = i * len(tiers) + j
        if shared_pool:
            self.locations[POOL] = len(self.nodes) * len(tiers)
        parent_idx = []
        for k in self.keys:
            p = parents.get(k)
            if p is not None and p not in self.key_index:
                raise Unexpressible(f"the parent of {k.hex[:12]} is not one of the keys")
            parent_idx.append(-1 if p is None else self.key_index[p])
        self.tick_ms = math.gcd(term_ms, skew_ms) if skew_ms else term_ms
        self.term_ms, self.skew_ms = term_ms, skew_ms
        self._cfg_args = dict(
            nodes=len(self.nodes),
            parents=tuple(parent_idx),
            namespaces=tuple(self.ns_index[namespaces[k]] for k in self.keys),
            authorized=tuple(
                frozenset(self.ns_index[d] for d in (digests if n in cache_nodes else authorized.get(n, ())) if d in self.ns_index)
                for n in self.nodes
            ),
            tiers_per_node=len(tiers),
            shared_pool=shared_pool,
            lease_term_ticks=term_ms // self.tick_ms,
            skew_ticks=skew_ms // self.tick_ms,
            max_epoch=STATE_VALUE_LIMIT - 3,
            max_lease_id=STATE_VALUE_LIMIT - 3,
            max_messages=STATE_VALUE_LIMIT,
        )
        self._models: dict[int, Model] = {}

    def model(self, directory_restarts: int = 0) -> Model:
        """The spec model of this deployment; its invalidation deadline allows ``restarts``."""
        m = self._models.get(directory_restarts)
        if m is None:
            cfg = ModelConfig(name="reference", max_directory_restarts=directory_restarts, **self._cfg_args)
            m = self._models[directory_restarts] = Model(cfg)
        return m

    # -- encoding ---------------------------------------------------------------------------

    def _loc1(self, location: str | None) -> int:
        if location is None:
            return NO_LOCATION
        try:
            return self.locations[location] + 1
        except KeyError:
            raise Unexpressible(f"location {location!r} is not in the map") from None

    def _node(self, node: str) -> int:
        try:
            return self.node_index[node]
        except KeyError:
            raise Unexpressible(f"node or client {node!r} is not in the map") from None

    def _key(self, key: BlockKey) -> int:
        try:
            return self.key_index[key]
        except KeyError:
            raise Unexpressible(f"key {key.hex[:12]} is not in the map") from None

    @staticmethod
    def _value(name: str, v: int) -> int:
        if not 0 <= v < STATE_VALUE_LIMIT:
            raise Unexpressible(f"{name} {v} does not fit the spec's encoding (0..{STATE_VALUE_LIMIT - 1})")
        return v

    @staticmethod
    def _ranks(values: Iterable[int], what: str) -> dict[int, int]:
        """Order-preserving renumbering of positive values to 1, 2, ...; 0 stays 0."""
        ranks = {0: 0}
        for i, v in enumerate(sorted({v for v in values if v > 0}), start=1):
            ranks[v] = i
        if len(ranks) >= STATE_VALUE_LIMIT:
            raise Unexpressible(f"{len(ranks)} distinct {what}: more than the spec's encoding holds")
        return ranks

    def encode(self, s: Snapshot) -> bytes:
        m = self.model(s.directory_restarts)
        L = m.L
        b = bytearray(L.fixed)
        ids = self._ranks(
            [s.next_lease_id]
            + [r.write_lease for r in s.records]
            + [e.lease for e in s.leases]
            + [t.lease for t in s.trusted]
            + [w.lease for w in s.writers]
            + [a[2] for a in s.acks],
            "lease ids",
        )
        times = self._ranks(
            [r.write_left_ns for r in s.records]
            + [e.left_ns for e in s.leases]
            + [t.left_ns for t in s.trusted]
            + [s.grace_left_ns],
            "times",
        )
        for r in s.records:
            k = self._key(r.key)
            b[L.phase[k]] = r.phase
            b[L.gen[k]] = self._value("generation", r.gen)
            b[L.epoch[k]] = self._value("epoch", r.epoch)
            b[L.owner[k]] = self._loc1(r.owner)
            b[L.moving[k]] = self._loc1(r.moving_to)
            b[L.draining[k]] = self._loc1(r.draining)
            b[L.writer[k]] = NO_NODE if r.writer is None else self._node(r.writer) + 1
            b[L.w_id[k]] = ids[r.write_lease]
            b[L.w_left[k]] = times[r.write_left_ns]
        b[L.next_id] = ids[s.next_lease_id]
        b[L.grace] = times[s.grace_left_ns]
        tick_ms = self.tick_ms
        for key, age_ms in s.inval_age_ms.items():
            b[L.inval_age[self._key(key)]] = min(STATE_VALUE_LIMIT - 1, max(0, age_ms) // tick_ms)
        for n, node in enumerate(self.nodes):
            b[L.up[n]] = 0 if node in s.down else 1
        for e in s.leases:
            k, n = self._key(e.key), self._node(e.holder)
            if b[L.r_id[k][n]] != NO_LEASE:
                raise Unexpressible(f"two leases of {e.holder} on one key: the spec's table has one entry")
            b[L.r_id[k][n]] = ids[e.lease]
            b[L.r_loc[k][n]] = self._loc1(e.location)
            b[L.r_left[k][n]] = times[e.left_ns]
        for t in s.trusted:
            n, k = self._node(t.holder), self._key(t.key)
            b[L.h_id[n][k]] = ids[t.lease]
            b[L.h_loc[n][k]] = self._loc1(t.location)
            b[L.h_gen[n][k]] = self._value("generation", t.gen)
            b[L.h_left[n][k]] = times[t.left_ns]
        for w in s.writers:
            n, k = self._node(w.writer), self._key(w.key)
            b[L.w_stage[n][k]] = W_BYTES_SENT
            b[L.wr_id[n][k]] = ids[w.lease]
            b[L.wr_gen[n][k]] = self._value("generation", w.gen)
            b[L.wr_epoch[n][k]] = self._value("epoch", w.epoch)
            b[L.wr_loc[n][k]] = self._loc1(w.location)
        for slot in s.slots:
            loc, k = self._loc1(slot.location) - 1, self._key(slot.key)
            if slot.lost:
                if b[L.s_status[loc][k]] == EMPTY:
                    b[L.s_status[loc][k]] = LOST
                continue
            b[L.s_status[loc][k]] = FULL
            b[L.s_gen[loc][k]] = self._value("generation", slot.gen)
            b[L.s_epoch[loc][k]] = self._value("epoch", slot.epoch)
        for (location, key), fence in s.fences.items():
            b[L.fence[self._loc1(location) - 1][self._key(key)]] = self._value("fence", fence)
        net = sorted(message(M_ACK, self._node(h), self._key(k), ids[lease]) for h, k, lease in s.acks)
        return bytes(b) + b"".join(net)

    # -- evaluation ------------------------------------------------------------------------------

    def violations(self, s: Snapshot, *, progress: bool = True) -> list[str]:
        """The names of the spec's invariants that fail on ``s`` (progress ones too unless not
        ``progress``), and ``WriteLeaseEndsInTime`` read as "time may not pass here"."""
        m = self.model(s.directory_restarts)
        state = self.encode(s)
        bad = [inv.name for inv in INVARIANTS if (progress or inv.kind != "progress") and not inv.holds(m, state)]
        if progress and not write_lease_ends_in_time(m, state, "tick", (), state):
            bad.append("WriteLeaseEndsInTime")
        return bad

    def step_violations(self, pre: Snapshot, post: Snapshot, *, crashed_with_disk_loss: str | None = None) -> list[str]:
        """The step properties that fail from ``pre`` to ``post`` (any number of spec steps)."""
        m = self.model(max(pre.directory_restarts, post.directory_restarts))
        a, b = self.encode(pre), self.encode(post)
        action, params = ("crash", (self._node(crashed_with_disk_loss), 1)) if crashed_with_disk_loss else ("step", ())
        bad = []
        if not epoch_monotonic(m, a, action, params, b):
            bad.append("EpochMonotonic")
        if not fencing_holds(m, a, action, params, b):
            bad.append("FencingHolds")
        before = {e.lease for e in pre.leases}
        if any(e.lease not in before and e.lease < pre.next_lease_id for e in post.leases):
            bad.append("RenewalNeverRevives")
        return bad

    def explain(self, s: Snapshot) -> str:
        """The non-zero variables of the encoded state, one per line (for failure messages)."""
        m = self.model(s.directory_restarts)
        state = self.encode(s)
        lines = [f"{name} = {text}" for name, text in m.L.variables(state).items() if text not in ("0", "-", "EMPTY", "NONE", "ABSENT")]
        lines += [f"net: {m.L.message_text(msg)}" for msg in m.L.messages(state)]
        return "\n".join(lines)
