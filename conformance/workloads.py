"""The workloads behind the catalogue's tests: one function per ``TestCase.body``.

Each takes a ``Session`` (``kvcc.conformance.oracles``) and drives the adapter through it: keys
are chained over the session's namespaces, which are randomised per run (model id and cache
salt drawn from the seed), so nothing can be precomputed. A workload states its own oracle with
``Session.check``; the session applies the global ones (exact bytes, no stale read, holder
deadline, fresh lease ids) to every call. Waits are multiples of the lease term, never fixed
times, so the same workloads run against millisecond and multi-second terms.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence

import attrs

from kvcc.spec.keys import BlockKey, Namespace, chain_keys
from kvcc.spec.vocabulary import (
    REASON_FENCED,
    REASON_HAS_CHILDREN,
    REASON_LEASED,
    REASON_LEASE_EXPIRED,
    REASON_MISS,
    REASON_NOT_ABSENT,
    REASON_NOT_COMMITTED,
    REASON_NOT_FOUND,
    REASON_PARENT_NOT_COMMITTED,
    REASON_STALE_EPOCH,
    REASON_UNAUTHORIZED,
    REASON_UNKNOWN_LEASE,
    REASON_WRONG_SHARD,
    location_host,
)

from .contract import (
    ENGINE_VOCAB,
    INTRUSIONS,
    AdapterError,
    Committed,
    Completion,
    Evicted,
    Moving,
    NotSupported,
    ReadGrant,
    Refused,
    Stored,
    WriteGrant,
)
from .oracles import OracleFailure, Session

INVALIDATION_SLACK = 4.0  # an invalidation may take this many lease terms before a test gives up
EARLY_PROBE_S = 0.05  # a wait that asks whether an invalidation has completed already, and returns
# Where a holder's deadline is probed, in epsilons past the last instant the oracle lets it read
# (requested_at + term - epsilon, plus epsilon for its clock): a holder that trusts even a
# fraction of epsilon too long is caught by the first probe, one that trusts up to 3 epsilon too
# long (it reasons from the directory's bound, term + epsilon) by every one of them.
DEADLINE_PROBES_EPS = (0.1, 0.5, 1.0, 1.5)
# The first probe is on time when its read starts within this many epsilons of its offset; a later
# one (a loaded machine woke the suite late) is tried again on a fresh lease, up to PROBE_TRIES
# leases: a late probe never fails a correct holder, but it can miss a holder that trusts a little
# too long, and a test that did not look must not pass.
PROBE_LATE_EPS = 0.4
PROBE_TRIES = 5
CONCURRENT_THREADS = 4
LOAD_DURATION_TERMS = 3.0  # the load workload runs this many lease terms


def chain(s: Session, blocks: int, ns: Namespace | None = None) -> list[BlockKey]:
    ns = ns or s.ns
    return chain_keys(ns, s.fresh_tokens(blocks, ns))


PUT_RETRIES = 2  # writes of one put whose lease ran out before their answer (a stalled machine)


def put(s: Session, node: str, key: BlockKey, parent: BlockKey | None, ns: Namespace | None = None,
        data: bytes | None = None) -> bytes:  # fmt: skip
    """Write and commit one block; the test fails if a plain write is refused. A write or commit
    refused only once the writer's own lease had run out (its answer came after the grant's
    ``trusted_until_ns``: the machine stalled for a term) is the protocol working, not a fault:
    the block is written again under a new grant, ``PUT_RETRIES`` times at most."""
    ns = ns or s.ns
    data = s.payload() if data is None else data
    retries, until = 0, 0.0
    while True:
        g = s.begin_write(node, ns, key, parent)
        if retries and isinstance(g, Refused) and g.reason == REASON_NOT_ABSENT and time.monotonic() < until:
            s.sleep_ms(s.lease_term_ms / 10)  # the stalled write's lease is not expired yet
            continue
        s.check(isinstance(g, WriteGrant), "write", f"begin_write of a fresh key refused: {g}")
        r = s.write_bytes(g, data)
        c = s.commit(g) if isinstance(r, Stored) else None
        if isinstance(c, Committed):
            return data
        if retries < PUT_RETRIES and time.monotonic_ns() >= g.trusted_until_ns(s.skew_ms):
            retries += 1
            until = time.monotonic() + INVALIDATION_SLACK * s.term_s
            continue
        s.check(isinstance(r, Stored), "write", f"write_bytes under a fresh grant refused: {r}")
        s.check(False, "write", f"commit under a fresh grant refused: {c}")


def put_chain(s: Session, node: str, keys: list[BlockKey], ns: Namespace | None = None) -> list[bytes]:
    return [put(s, node, k, keys[i - 1] if i else None, ns) for i, k in enumerate(keys)]


def wait_done(s: Session, ticket, voids) -> float:
    """Wait for an invalidation; FAIL if it does not complete in time. Returns seconds waited."""
    t0 = time.monotonic()
    done = s.wait_invalidation(ticket, INVALIDATION_SLACK * s.term_s + 1, voids=voids)
    s.check(done, "InvalidationCompletesInTime", f"invalidation {ticket.id} did not complete within {INVALIDATION_SLACK} terms")
    return time.monotonic() - t0


def read_back(s: Session, node: str, key: BlockKey, expected: bytes, what: str, ns: Namespace | None = None) -> ReadGrant:
    """Acquire, read and release ``key`` on ``node``: the read MUST return exactly ``expected``
    (the state a test's rule protects, looked at rather than assumed). Returns the grant."""
    g = s.acquire(node, ns or s.ns, key)
    s.check(isinstance(g, ReadGrant), "caching", f"acquire of {what} refused: {g}")
    got = s.read(g)
    s.check(got == expected, "caching", f"a leased read of {what} answered {got!r:.60}")
    s.release(g)
    return g


class ProbeLate(RuntimeError):
    """No deadline probe of ``PROBE_TRIES`` leases started on time: the test could not look (ERROR,
    never PASS; the machine was too loaded to probe a bound of epsilon)."""


def probe_past_deadline(s: Session, g: ReadGrant, what: str, again: Callable[[], ReadGrant]) -> ReadGrant:
    """Read under ``g`` at each of ``DEADLINE_PROBES_EPS`` past the holder's deadline plus
    epsilon: every read MUST be refused (the session's holder-deadline oracle also FAILs one
    that returns bytes). If the first read started late (``PROBE_LATE_EPS``), probe again under a
    fresh lease from ``again()``; ``ProbeLate`` after ``PROBE_TRIES`` late ones. Returns the lease
    last probed."""
    eps_ns = s.skew_ms * 1_000_000
    for _ in range(PROBE_TRIES):
        edge_ns = s.deadlines_ns[(g.node, g.lease)] + eps_ns
        on_time = True
        for n, eps in enumerate(DEADLINE_PROBES_EPS):
            at_ns = edge_ns + eps * eps_ns
            wait_ms = (at_ns - time.monotonic_ns()) / 1e6
            if wait_ms > 0:
                s.sleep_ms(wait_ms)
            if n == 0:
                on_time = time.monotonic_ns() <= at_ns + PROBE_LATE_EPS * eps_ns
            got = s.read(g)
            s.check(isinstance(got, Refused), "holder_deadline",
                    f"{what}: a read {eps:g} epsilon past the holder's deadline (+ epsilon) was served")  # fmt: skip
        if on_time:
            return g
        g = again()
    raise ProbeLate(f"{what}: the first deadline probe of each of {PROBE_TRIES} leases started more than "
                    f"{PROBE_LATE_EPS:g} epsilon late")  # fmt: skip


def _leased(s: Session, node: str, key: BlockKey) -> ReadGrant:
    """A fresh read lease of ``key`` on ``node`` (a deadline probe's next try)."""
    g = s.acquire(node, s.ns, key)
    s.check(isinstance(g, ReadGrant), "caching", f"acquire of a committed block refused: {g}")
    return g


def reader(s: Session, writer: str) -> str:
    """A node other than ``writer`` where there is one."""
    others = [n for n in s.nodes if n != writer]
    return s.rng.choice(others) if others else writer


# -- core ------------------------------------------------------------------------------------------


def lookup_prefix(s: Session) -> None:
    w = s.nodes[0]
    keys = chain(s, 4)
    s.check(s.lookup(reader(s, w), s.ns, keys) == 0, "PrefixClosed", "lookup counted blocks of an empty deployment")
    put_chain(s, w, keys[:3])
    n = s.lookup(reader(s, w), s.ns, keys)
    s.check(n == 3, "PrefixClosed", f"lookup of a chain with 3 of 4 blocks committed counted {n}")
    n = s.lookup(w, s.ns, keys[1:])
    s.check(n == 0, "PrefixClosed", f"lookup of a chain without its root counted {n}")
    g = s.begin_write(w, s.ns, keys[3], keys[2])
    s.check(isinstance(g, WriteGrant), "write", f"begin_write refused: {g}")
    n = s.lookup(reader(s, w), s.ns, keys)
    s.check(n == 3, "NoDirtyRead", f"lookup counted a WRITING block: {n}")


def one_writer(s: Session) -> None:
    key = chain(s, 1)[0]
    grants: list = []
    barrier = threading.Barrier(len(s.nodes))

    def attempt(node: str) -> None:
        barrier.wait(timeout=s.term_s * 4 + 5)
        grants.append(s.begin_write(node, s.ns, key, None))

    # One attempt per node: a node's client sends one begin_write per key at a time (the spec's
    # writer has one write in progress per key), so the contention is between nodes.
    threads = [threading.Thread(target=attempt, args=(n,), daemon=True) for n in s.nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [g for g in grants if isinstance(g, WriteGrant)]
    s.check(len(grants) == len(threads), "write", "a begin_write did not answer")
    s.check(len(won) == 1, "OneWriterPerGeneration", f"{len(won)} of {len(grants)} concurrent begin_write were granted")
    s.check(all(g.reason == REASON_NOT_ABSENT for g in grants if isinstance(g, Refused)), "OneWriterPerGeneration",
            f"refusals other than not_absent: {[g.reason for g in grants if isinstance(g, Refused)]}")  # fmt: skip
    g = won[0]
    data = s.payload()
    s.check(isinstance(s.write_bytes(g, data), Stored), "write", "write_bytes refused")
    s.check(isinstance(s.commit(g), Committed), "write", "commit refused")
    again = s.begin_write(reader(s, g.node), s.ns, key, None)
    s.check(isinstance(again, Refused) and again.reason == REASON_NOT_ABSENT, "OneWriterPerGeneration",
            f"begin_write on a COMMITTED key answered {again}")  # fmt: skip
    read_back(s, reader(s, g.node), key, data, "the winner's block")


def remote_read(s: Session) -> None:
    w = s.nodes[0]
    keys = chain(s, 2)
    data = put_chain(s, w, keys)
    r = reader(s, w)
    for key, expected in zip(keys, data):
        g = s.acquire(r, s.ns, key)
        s.check(isinstance(g, ReadGrant), "caching", f"acquire of a committed block refused: {g}")
        got = s.read(g)
        s.check(got == expected, "caching", f"a leased read of a committed block answered {got!r:.60}")
        s.release(g)


def no_dirty_read(s: Session) -> None:
    w = s.nodes[0]
    key = chain(s, 1)[0]
    g = s.begin_write(w, s.ns, key, None)
    s.check(isinstance(g, WriteGrant), "write", f"begin_write refused: {g}")
    # Each refused acquire from another node: the spec models no refusal reply, so a holder's
    # refused request stays pending until its budget runs out (see the report's notes).
    others = [n for n in s.nodes if n != w] or [w]
    for i, stage in enumerate(("granted", "stored")):
        for n in [others[i % len(others)]]:
            a = s.acquire(n, s.ns, key)
            s.check(isinstance(a, Refused) and a.reason == REASON_NOT_COMMITTED, "NoDirtyRead",
                    f"acquire of a WRITING block ({stage}) from {n} answered {a}")  # fmt: skip
        if stage == "granted":
            s.check(isinstance(s.write_bytes(g, s.payload()), Stored), "write", "write_bytes refused")
    s.check(isinstance(s.commit(g), Committed), "write", "commit refused")
    a = s.acquire(w, s.ns, key)
    s.check(isinstance(a, ReadGrant), "LeasesGrantedOnlyOnCommitted", f"acquire after commit answered {a}")
    s.release(a)


def prefix_order(s: Session) -> None:
    w = s.nodes[0]
    keys = chain(s, 3)
    g = s.begin_write(w, s.ns, keys[1], keys[0])
    s.check(isinstance(g, Refused) and g.reason == REASON_PARENT_NOT_COMMITTED, "PrefixClosed",
            f"begin_write under an ABSENT parent answered {g}")  # fmt: skip
    put(s, w, keys[0], None)
    g = s.begin_write(w, s.ns, keys[2], keys[1])
    s.check(isinstance(g, Refused) and g.reason == REASON_PARENT_NOT_COMMITTED, "PrefixClosed",
            f"begin_write under an ABSENT parent answered {g}")  # fmt: skip
    put(s, w, keys[1], keys[0])
    put(s, w, keys[2], keys[1])
    s.check(s.lookup(w, s.ns, keys) == 3, "PrefixClosed", "the written chain is not found")


def namespace_isolation(s: Session) -> None:
    w = s.nodes[0]
    tokens = s.fresh_tokens(2)
    mine, theirs = chain_keys(s.ns, tokens), chain_keys(s.foreign, tokens)
    s.check(not set(mine) & set(theirs), "NamespaceIsolation", "the same tokens gave the same keys in two namespaces")
    g = s.begin_write(w, s.foreign, theirs[0], None)
    s.check(isinstance(g, Refused) and g.reason == REASON_UNAUTHORIZED, "NamespaceIsolation",
            f"begin_write in a foreign namespace answered {g}")  # fmt: skip
    put_chain(s, w, mine)
    for n in s.nodes:
        a = s.acquire(n, s.foreign, mine[0])
        s.check(isinstance(a, Refused) and a.reason == REASON_UNAUTHORIZED, "NamespaceIsolation",
                f"acquire of a block through a foreign namespace answered {a}")  # fmt: skip
        s.check(s.lookup(n, s.foreign, theirs) == 0, "NamespaceIsolation", "lookup counted blocks of a foreign namespace")


def abort_frees(s: Session) -> None:
    w = s.nodes[0]
    key = chain(s, 1)[0]
    g = s.begin_write(w, s.ns, key, None)
    s.check(isinstance(g, WriteGrant), "write", f"begin_write refused: {g}")
    s.abort(g)
    deadline = time.monotonic() + (s.lease_term_ms + 2 * s.skew_ms) / 1000 + s.term_s
    while True:
        g2 = s.begin_write(reader(s, w), s.ns, key, None)
        if isinstance(g2, WriteGrant):
            break
        s.check(g2.reason == REASON_NOT_ABSENT, "write", f"begin_write after abort answered {g2}")
        s.check(time.monotonic() < deadline, "WriteLeaseEndsInTime", "the key stayed WRITING after the writer aborted")
        s.sleep_ms(s.lease_term_ms / 10)
    s.check(g2.epoch > g.epoch, "EpochMonotonic", f"new write epoch {g2.epoch} not above {g.epoch}")
    late = s.commit(g)
    s.check(isinstance(late, Refused), "OneWriterPerGeneration", f"commit under the aborted grant answered {late}")
    data = s.payload()
    s.check(isinstance(s.write_bytes(g2, data), Stored), "write", "write_bytes under the new grant refused")
    s.check(isinstance(s.commit(g2), Committed), "write", "commit under the new grant refused")
    read_back(s, w, key, data, "the block written after the abort")


def concurrent_chains(s: Session) -> None:
    errors: list[BaseException] = []
    seeds = [s.rng.randrange(1 << 30) for _ in range(CONCURRENT_THREADS)]

    def worker(i: int) -> None:
        rng = random.Random(seeds[i])
        try:
            for _ in range(3):
                node = rng.choice(s.nodes)
                keys = chain_keys(s.ns, [rng.randrange(1, 1 << 31) for _ in range(3 * s.ns.block_tokens)])
                put_chain(s, node, keys)
                r = rng.choice(s.nodes)
                matched = s.lookup(r, s.ns, keys)
                s.check(matched == 3, "PrefixClosed", f"a committed chain of 3 was found {matched} deep")
                for key in keys:
                    _read_committed(s, r, key)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)

    run_threads(worker, CONCURRENT_THREADS)
    if errors:
        raise errors[0]


LATE_READ_RETRIES = 3


def _read_committed(s: Session, node: str, key: BlockKey) -> None:
    """Acquire and read a committed ``key`` on ``node``: the read MUST return bytes (checked
    against the committed ones by the session). A read refused as ``lease_expired`` once the
    holder's latest possible deadline had passed was refused rightly -- the suite was held up
    between the grant and the read (with inferred events it runs one operation at a time, so
    behind another thread's stalled request) -- and is asked again under a fresh lease, up to
    ``LATE_READ_RETRIES`` times; refused before that deadline, it is a miss."""
    for _ in range(LATE_READ_RETRIES + 1):
        g = s.acquire(node, s.ns, key)
        s.check(isinstance(g, ReadGrant), "caching", f"acquire of a committed block refused: {g}")
        got = s.read(g)
        answered_ns = time.monotonic_ns()
        if isinstance(got, bytes):
            s.release(g)
            return
        deadline_ns = s.deadlines_ns.get((node, g.lease))
        late = deadline_ns is not None and answered_ns > deadline_ns
        s.check(isinstance(got, Refused) and got.reason == REASON_LEASE_EXPIRED and late, "caching",
                f"a leased read missed: {got}")  # fmt: skip
    s.check(False, "caching", f"{LATE_READ_RETRIES + 1} leased reads in a row were answered after their deadline")


def run_threads(target: Callable[[int], None], count: int) -> None:
    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# -- leases ----------------------------------------------------------------------------------------


def lease_ids_unique(s: Session) -> None:
    keys = chain(s, 2)
    w = s.nodes[0]
    put_chain(s, w, keys)
    for _ in range(2):
        for n in s.nodes:
            for key in keys:
                g = s.acquire(n, s.ns, key)
                s.check(isinstance(g, ReadGrant), "caching", f"acquire refused: {g}")
                s.release(g)  # the session's oracle checks every id against every earlier one


def released_lease(s: Session) -> None:
    w = s.nodes[0]
    key = chain(s, 1)[0]
    put(s, w, key, None)
    g = s.acquire(reader(s, w), s.ns, key)
    s.check(isinstance(g, ReadGrant), "caching", f"acquire refused: {g}")
    s.release(g)
    r = s.renew(g)
    s.check(isinstance(r, Refused), "RenewalNeverRevives", f"renewal of a released lease answered {r}")
    got = s.read(g)
    s.check(isinstance(got, Refused), "RenewalNeverRevives", "a read under a released lease was served")


def holder_deadline(s: Session) -> None:
    w = s.nodes[0]
    key = chain(s, 1)[0]
    put(s, w, key, None)
    g = s.acquire(reader(s, w), s.ns, key)
    s.check(isinstance(g, ReadGrant), "caching", f"acquire refused: {g}")
    got = s.read(g)
    s.check(isinstance(got, bytes), "caching", f"a read right after the grant answered {got!r:.60}")
    # Just past the holder's own deadline plus epsilon for its clock, at several offsets: nothing
    # may be served (one read long after would miss a holder that trusts a little too long).
    g = probe_past_deadline(s, g, "holder", lambda: _leased(s, g.node, key))
    r = s.renew(g)
    s.check(isinstance(r, Refused), "RenewalNeverRevives", f"renewal of an expired lease answered {r}")


def evict_under_lease(s: Session) -> None:
    w = s.nodes[0]
    key = chain(s, 1)[0]
    put(s, w, key, None)
    g = s.acquire(reader(s, w), s.ns, key)
    s.check(isinstance(g, ReadGrant), "caching", f"acquire refused: {g}")
    e = s.evict(w, s.ns, key, leased=True)
    s.check(isinstance(e, Refused) and e.reason == REASON_LEASED, "NoReclaimUnderLease", f"eviction under a live lease answered {e}")
    s.release(g)
    e = s.evict(w, s.ns, key)
    s.check(isinstance(e, Evicted), "eviction", f"eviction of an unleased copy answered {e}")
    s.check(s.lookup(w, s.ns, [key]) == 0, "DirectoryDataAgreement", "lookup still finds an evicted block")


def stale_writer(s: Session) -> None:
    w = s.nodes[0]
    parent, child = chain(s, 2)
    put(s, w, parent, None)
    stale = s.begin_write(w, s.ns, child, parent)
    s.check(isinstance(stale, WriteGrant), "write", f"begin_write refused: {stale}")
    # Invalidating the parent aborts the write in progress (a zombie from here on) ...
    wait_done(s, s.invalidate(w, s.ns, "key", parent), [parent, child])
    s.abort(stale)  # the client gives up; its bytes are still "in flight" (sent below)
    put(s, w, parent, None)
    # ... and a new writer on the same node takes the key under a higher epoch.
    fresh = s.begin_write(w, s.ns, child, parent)
    s.check(isinstance(fresh, WriteGrant), "write", f"begin_write after the invalidation refused: {fresh}")
    s.check(fresh.epoch > stale.epoch, "EpochMonotonic", f"epoch {fresh.epoch} not above {stale.epoch}")
    data = s.payload()
    s.check(isinstance(s.write_bytes(fresh, data), Stored), "write", "write_bytes refused")
    s.check(isinstance(s.commit(fresh), Committed), "write", "commit refused")
    late = s.write_bytes(stale, s.payload())
    s.check(isinstance(late, Refused), "FencingHolds", f"bytes under a superseded epoch answered {late}")
    s.check(late.reason in (REASON_FENCED, REASON_LEASE_EXPIRED, REASON_STALE_EPOCH), "FencingHolds", f"unexpected refusal {late}")
    late_commit = s.commit(stale)
    s.check(isinstance(late_commit, Refused), "OneWriterPerGeneration", f"a superseded commit answered {late_commit}")
    # The fenced bytes must not have changed the committed block: read it, exactly.
    read_back(s, reader(s, w), child, data, "the block after a fenced stale write")


def renewal_extends(s: Session) -> None:
    w = s.nodes[0]
    key = chain(s, 1)[0]
    data = put(s, w, key, None)
    h = reader(s, w)
    g = s.acquire(h, s.ns, key)
    s.check(isinstance(g, ReadGrant), "caching", f"acquire refused: {g}")
    s.sleep_ms(g.term_ms * 0.5)
    r = s.renew(g)
    s.check(isinstance(r, ReadGrant), "RenewalNeverRevives", f"renewal of a live lease answered {r}")
    # Past the first deadline, well before the renewed one.
    s.sleep_ms(g.term_ms * 0.5 + s.skew_ms + 5)
    got = s.read(r)
    s.check(got == data, "caching", f"a read under a renewed lease answered {got!r:.60}")
    s.release(r)
    # The renewal is over with its answer: the holder leases the key again (one that kept counting
    # it as under way would refuse every later acquire of the key).
    g2 = s.acquire(h, s.ns, key)
    s.check(isinstance(g2, ReadGrant), "caching", f"the holder's acquire after its renewal and release answered {g2}")
    # Past the holder's own deadline the lease is no longer its to release: the spec's holder
    # dropped it then, so a release it logs later is no spec step (the trace is rejected).
    s.sleep_ms(g2.term_ms + 2 * s.skew_ms)
    s.release(g2)


# -- invalidation ----------------------------------------------------------------------------------


def invalidate_with_holders(s: Session) -> None:
    w = s.nodes[0]
    key = chain(s, 1)[0]
    data = put(s, w, key, None)
    holders = []
    for n in s.nodes:
        g = s.acquire(n, s.ns, key)
        s.check(isinstance(g, ReadGrant), "caching", f"acquire refused: {g}")
        got = s.read(g)
        s.check(got == data, "caching", f"a leased read answered {got!r:.60}")
        holders.append(g)
    t0 = time.monotonic_ns()
    ticket = s.invalidate(w, s.ns, "key", key)
    s.check(ticket.keys in (0, 1), "invalidate", f"a one-key invalidation covers {ticket.keys} keys")
    a = s.acquire(w, s.ns, key)
    s.check(isinstance(a, Refused), "LeasesGrantedOnlyOnCommitted", f"acquire during invalidation answered {a}")
    wait_done(s, ticket, [key])
    done_ns = time.monotonic_ns()
    if done_ns - t0 < min(g.term_ms for g in holders) * 1_000_000 - s.skew_ms * 1_000_000:
        s.audit.invalidations_by_ack += 1
    for g in holders:
        got = s.read(g)  # the session FAILs the test if bytes come back
        s.check(isinstance(got, Refused), "NoStaleRead", "a read after the invalidation completed was served")
    # Refused acquires on distinct nodes, the last grant on a third (the spec models no refusal
    # reply: a refused holder's request stays pending until its budget runs out).
    a = s.acquire(s.nodes[1 % len(s.nodes)], s.ns, key)
    s.check(isinstance(a, Refused), "NoStaleRead", f"acquire after the invalidation answered {a}")
    s.check(s.lookup(w, s.ns, [key]) == 0, "NoStaleRead", "lookup finds an invalidated block")
    new = put(s, s.nodes[1 % len(s.nodes)], key, None)
    g = s.acquire(s.nodes[2 % len(s.nodes)], s.ns, key)
    s.check(isinstance(g, ReadGrant), "caching", f"acquire of the rewritten block refused: {g}")
    s.check(g.gen > holders[0].gen, "NoStaleRead", f"rewritten generation {g.gen} not above {holders[0].gen}")
    got = s.read(g)
    s.check(got == new, "caching", f"a read of the rewritten block answered {got!r:.60}")
    s.release(g)


def cascade(s: Session) -> None:
    w = s.nodes[0]
    keys = chain(s, 3)
    put_chain(s, w, keys)
    wait_done(s, s.invalidate(w, s.ns, "key", keys[0]), keys)
    s.check(s.lookup(reader(s, w), s.ns, keys) == 0, "PrefixClosed", "lookup finds blocks of an invalidated chain")
    for key in keys:
        a = s.acquire(reader(s, w), s.ns, key)
        s.check(isinstance(a, Refused), "PrefixClosed", f"acquire of an invalidated descendant answered {a}")
    g = s.begin_write(w, s.ns, keys[1], keys[0])
    s.check(isinstance(g, Refused), "PrefixClosed", f"begin_write under an invalidated parent answered {g}")
    rewritten = put_chain(s, w, keys)
    s.check(s.lookup(w, s.ns, keys) == 3, "PrefixClosed", "the rewritten chain is not found")
    for key, data in zip(keys, rewritten):
        read_back(s, reader(s, w), key, data, "a block of the rewritten chain")


def prefix_scope(s: Session) -> None:
    w = s.nodes[0]
    keys = chain(s, 4)
    data = put_chain(s, w, keys)
    wait_done(s, s.invalidate(w, s.ns, "prefix", keys[2]), keys[2:])
    n = s.lookup(reader(s, w), s.ns, keys)
    s.check(n == 2, "PrefixClosed", f"after invalidating the subtree under block 3, lookup counted {n}")
    for key, expected in zip(keys[:2], data[:2]):
        read_back(s, reader(s, w), key, expected, "an ancestor of an invalidated subtree")


def namespace_scope(s: Session) -> None:
    w = s.nodes[0]
    a, b = s.namespaces[0], s.namespaces[1]
    ka, kb = chain(s, 2, a), chain(s, 2, b)
    put_chain(s, w, ka, a)
    data_b = put_chain(s, w, kb, b)
    wait_done(s, s.invalidate(w, a, "namespace", None), ka)
    s.check(s.lookup(w, a, ka) == 0, "NoStaleRead", "lookup finds blocks of an invalidated namespace")
    s.check(s.lookup(w, b, kb) == 2, "NamespaceIsolation", "invalidating one namespace voided another")
    for key, expected in zip(kb, data_b):
        read_back(s, reader(s, w), key, expected, "a block of the other namespace", ns=b)


def empty_invalidation(s: Session) -> None:
    w = s.nodes[0]
    key = chain(s, 1)[0]
    ticket = s.invalidate(w, s.ns, "key", key)
    s.check(ticket.keys == 0, "invalidate", f"an invalidation of an unwritten key covers {ticket.keys} keys")
    wait_done(s, ticket, [key])
    s.check(s.lookup(w, s.ns, [key]) == 0, "invalidate", "an empty invalidation created a block")
    put(s, w, key, None)


# -- tiering ---------------------------------------------------------------------------------------


def leaves_first(s: Session) -> None:
    w = s.nodes[0]
    parent, child = chain(s, 2)
    put_chain(s, w, [parent, child])
    e = s.evict(w, s.ns, parent)
    s.check(isinstance(e, Refused) and e.reason == REASON_HAS_CHILDREN, "PrefixClosed", f"evicting a parent first answered {e}")
    e = s.evict(w, s.ns, child)
    s.check(isinstance(e, Evicted), "eviction", f"evicting an unleased leaf answered {e}")
    e = s.evict(w, s.ns, parent)
    s.check(isinstance(e, Evicted), "eviction", f"evicting the parent after its leaf answered {e}")
    s.check(s.lookup(w, s.ns, [parent, child]) == 0, "DirectoryDataAgreement", "lookup finds evicted blocks")


def rewrite_after_evict(s: Session) -> None:
    w = s.nodes[0]
    key = chain(s, 1)[0]
    put(s, w, key, None)
    e = s.evict(w, s.ns, key)
    s.check(isinstance(e, Evicted), "eviction", f"evicting an unleased block answered {e}")
    data = put(s, w, key, None)
    g = s.acquire(reader(s, w), s.ns, key)
    s.check(isinstance(g, ReadGrant), "caching", f"acquire of the rewritten block refused: {g}")
    got = s.read(g)
    s.check(got == data, "caching", f"a read of the rewritten block answered {got!r:.60}")
    s.release(g)


def evict_absent(s: Session) -> None:
    w = s.nodes[0]
    keys = chain(s, 2)
    data = put(s, w, keys[0], None)
    e = s.evict(w, s.ns, keys[1])
    s.check(isinstance(e, Refused), "DirectoryDataAgreement", f"evicting a never-written key answered {e}")
    if len(s.nodes) > 1:
        e = s.evict(reader(s, w), s.ns, keys[0])
        s.check(isinstance(e, Refused), "DirectoryDataAgreement", f"evicting another node's copy answered {e}")
    s.check(s.lookup(w, s.ns, keys) == 1, "DirectoryDataAgreement", "a refused eviction changed lookup")
    read_back(s, reader(s, w), keys[0], data, "a block whose eviction was refused")


# -- faults ----------------------------------------------------------------------------------------


def paused_holder(s: Session) -> None:
    w = s.nodes[0]
    h = reader(s, w)
    key = chain(s, 1)[0]
    data = put(s, w, key, None)
    g = s.acquire(h, s.ns, key)
    s.check(isinstance(g, ReadGrant), "caching", f"acquire refused: {g}")
    got = s.read(g)
    s.check(got == data, "caching", f"a leased read before the pause answered {got!r:.60}")
    s.fault("pause", h)
    try:
        ticket = s.invalidate(w, s.ns, "key", key)
        done = s.wait_invalidation(ticket, INVALIDATION_SLACK * s.term_s + 1, voids=[key])
        done_ns = time.monotonic_ns()
    finally:
        s.fault("resume", h)
    s.check(done, "InvalidationCompletesInTime", "the invalidation did not complete after the holder's lease expired")
    # The bound itself, on the suite's clock: the holder's deadline counts from no earlier than
    # the start of the suite's acquire call, so a correct directory completes after it (it waits
    # term + epsilon from its grant), and one that completes even a little early is caught.
    holder_deadline_ns = s.earliest_deadlines_ns[(g.node, g.lease)]
    s.check(done_ns >= holder_deadline_ns, "NoStaleRead",
            f"the invalidation completed {(holder_deadline_ns - done_ns) / 1e6:.0f} ms before a paused holder's lease could expire")  # fmt: skip
    s.audit.invalidations_by_expiry += 1
    got = s.read(g)
    s.check(isinstance(got, Refused), "NoStaleRead", "the resumed holder read the invalidated generation")


def _handed_over(s: Session, node: str, key: BlockKey, data: bytes, what: str) -> WriteGrant:
    """A write grant of ``key`` for ``node``, once the key's owner restarted after a kill. The
    block is gone with the owner's memory (the restart voided it), or it survived on a disk that
    came back: then the directory still vouches for it, so it MUST read back exactly, and it is
    invalidated first. Either way the key MUST become writable within a few terms."""
    if s.lookup(node, s.ns, [key]):
        read_back(s, node, key, data, f"{what}, still found by lookup")
        t = s.invalidate(node, s.ns, "key", key)
        wait_done(s, t, [key] if t.keys else [])
    g = poll_until(s, lambda: s.begin_write(node, s.ns, key, None), lambda r: isinstance(r, WriteGrant),
                   "OwnershipHandoffAfterCrash", "the crashed owner's key stayed unwritable")  # fmt: skip
    assert isinstance(g, WriteGrant)
    return g


def crash_handoff(s: Session) -> None:
    if len(s.nodes) < 2:
        raise _not_applicable("needs two nodes")
    w, r = s.nodes[0], s.nodes[1]
    key = chain(s, 1)[0]
    old = put(s, w, key, None)
    s.fault("kill", w)
    g = s.acquire(r, s.ns, key)
    if isinstance(g, ReadGrant):
        got = s.read(g)  # exact bytes or a refusal: the session checks
        s.release(g)
    s.fault("restart", w)
    g2 = _handed_over(s, r, key, old, "a block of a node killed and restarted")
    data = s.payload()
    s.check(isinstance(s.write_bytes(g2, data), Stored), "write", "write_bytes refused")
    s.check(isinstance(s.commit(g2), Committed), "write", "commit refused")
    g = s.acquire(w, s.ns, key)
    s.check(isinstance(g, ReadGrant), "caching", f"acquire after the handoff refused: {g}")
    got = s.read(g)
    s.check(got == data, "caching", f"a read after the handoff answered {got!r:.60}")
    s.release(g)
    del got


def directory_restart(s: Session) -> None:
    w = s.nodes[0]
    keys = chain(s, 2)
    data = put_chain(s, w, keys)
    held = []
    for n in s.nodes:
        g = s.acquire(n, s.ns, keys[1])
        s.check(isinstance(g, ReadGrant), "caching", f"acquire refused: {g}")
        held.append(g)
    s.fault("restart_directory")
    # What was committed survives the restart: read it back, exactly (ids must be fresh: the
    # session checks every grant's id against those of the old incarnation).
    read_back(s, reader(s, w), keys[0], data[0], "a block committed before the directory restart")
    # Leases of the old incarnation may still be trusted: invalidating their key must not
    # complete before they could have expired (protocol property 12), and none of them may read after.
    ticket = s.invalidate(w, s.ns, "key", keys[1])
    wait_done(s, ticket, keys[1:])
    done_ns = time.monotonic_ns()
    first_deadline_ns = min(s.earliest_deadlines_ns.get((g.node, g.lease), done_ns) for g in held)
    s.check(done_ns >= first_deadline_ns, "LeaseKnownToDirectory",
            f"an invalidation completed {(first_deadline_ns - done_ns) / 1e6:.0f} ms before a lease of the previous "
            "directory incarnation could expire")  # fmt: skip
    for g in held:
        got = s.read(g)
        s.check(isinstance(got, Refused), "NoStaleRead", "a lease of the previous incarnation read after the invalidation")
    # The key is writable again under the new incarnation, and its new bytes are read exactly.
    again = put(s, w, keys[1], keys[0])
    read_back(s, reader(s, w), keys[1], again, "a block rewritten after the directory restart")


def clock_skew(s: Session) -> None:
    w = s.nodes[0]
    h = reader(s, w)
    key = chain(s, 1)[0]
    data = put(s, w, key, None)
    s.fault("skew_clock", h, -s.skew_ms)
    try:
        g = s.acquire(h, s.ns, key)
        s.check(isinstance(g, ReadGrant), "caching", f"acquire refused: {g}")
        got = s.read(g)
        s.check(got == data, "caching", f"a skewed holder's read right after the grant answered {got!r:.60}")
        probe_past_deadline(s, g, "skewed holder", lambda: _leased(s, h, key))
    finally:
        s.fault("skew_clock", h, 0)


def _not_applicable(why: str) -> Exception:
    from .contract import NotSupported

    return NotSupported(why)


# -- load ------------------------------------------------------------------------------------------


def mixed_load(s: Session) -> None:
    errors: list[BaseException] = []
    seeds = [s.rng.randrange(1 << 30) for _ in range(CONCURRENT_THREADS)]
    stop_at = time.monotonic() + LOAD_DURATION_TERMS * s.term_s
    # A small shared pool of prefixes so that threads contend on keys.
    pool = [chain(s, 3) for _ in range(4)]

    def worker(i: int) -> None:
        rng = random.Random(seeds[i])
        try:
            while time.monotonic() < stop_at and not s.stopped.is_set():
                keys = rng.choice(pool)
                node = rng.choice(s.nodes)
                op = rng.random()
                if op < 0.3:
                    depth = s.lookup(node, s.ns, keys)
                    if depth < len(keys):
                        g = s.begin_write(node, s.ns, keys[depth], keys[depth - 1] if depth else None)
                        if isinstance(g, WriteGrant) and isinstance(s.write_bytes(g, s.payload()), Stored):
                            s.commit(g)
                elif op < 0.8:
                    key = rng.choice(keys)
                    g = s.acquire(node, s.ns, key)
                    if isinstance(g, ReadGrant):
                        s.read(g)
                        if rng.random() < 0.3:
                            # Counted for the audit only: a concurrent invalidation may have
                            # revoked this lease, so an eviction here may be legitimate.
                            s.evict(g.location if g.location in s.nodes else node, s.ns, key, leased=True)
                        s.release(g)
                elif op < 0.9:
                    key = rng.choice(keys)
                    t = s.invalidate(node, s.ns, "key", key)
                    s.wait_invalidation(t, INVALIDATION_SLACK * s.term_s + 1, voids=keys[keys.index(key):])
                else:
                    key = keys[-1] if rng.random() < 0.5 else rng.choice(keys)
                    s.evict(node, s.ns, key)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)

    run_threads(worker, CONCURRENT_THREADS)
    if errors:
        raise errors[0]


def audit(s: Session) -> None:  # pragma: no cover - audits are evaluated by the runner
    raise AssertionError("audits run no workload")


BODIES: dict[str, Callable[[Session], None]] = {
    name: fn for name, fn in globals().items() if callable(fn) and getattr(fn, "__module__", None) == __name__
    and not name.startswith("_")
    and name not in ("chain", "put", "put_chain", "wait_done", "reader", "run_threads", "read_back", "probe_past_deadline", "ProbeLate")
}  # fmt: skip


# -- tests added for the suite's mutation score (kvcc.conformance.mutation): each one fails
# mutants of the reference that every test above let through -------------------------------------------


def namespace_bound(s: Session) -> None:
    """A block belongs to the namespace it was written in, even for a tenant authorised for two."""
    w = s.nodes[0]
    a, b = s.namespaces[0], s.namespaces[1]
    keys = chain(s, 2, a)
    data = put_chain(s, w, keys, a)
    others = [n for n in s.nodes if n != w] or [w]
    n = s.lookup(others[0], b, keys)
    s.check(n == 0, "NamespaceIsolation", f"lookup under another authorised namespace counted {n} blocks")
    # One refused acquire per node and key (a refused holder's request stays pending in the spec).
    for i, key in enumerate(keys):
        g = s.acquire(others[i % len(others)], b, key)
        s.check(isinstance(g, Refused), "NamespaceIsolation",
                f"acquire of a block through another authorised namespace answered {g}")  # fmt: skip
    child = chain(s, 3, b)[2]
    g = s.begin_write(w, b, child, keys[1])
    s.check(isinstance(g, Refused), "PrefixClosed", f"begin_write under a parent of another namespace answered {g}")
    g = s.begin_write(w, b, keys[1], None)
    s.check(isinstance(g, Refused), "NamespaceIsolation", f"begin_write of a known key through another namespace answered {g}")
    read_back(s, w, keys[0], data[0], "a block of the namespace it was written in", ns=a)
    g = s.acquire(w, s.foreign, chain(s, 1, s.foreign)[0])
    s.check(isinstance(g, Refused) and g.reason == REASON_UNAUTHORIZED, "NamespaceIsolation",
            f"acquire of a never-written key in a namespace the tenant may not use answered {g}")  # fmt: skip


def renewal_protects(s: Session) -> None:
    """A renewed lease protects its copy until the renewed expiry, not the first one."""
    w = s.nodes[0]
    key = chain(s, 1)[0]
    put(s, w, key, None)
    h = reader(s, w)
    g = s.acquire(h, s.ns, key)
    s.check(isinstance(g, ReadGrant), "caching", f"acquire refused: {g}")
    s.sleep_ms(g.term_ms * 0.5)
    r = s.renew(g)
    s.check(isinstance(r, ReadGrant), "RenewalNeverRevives", f"renewal of a live lease answered {r}")
    # Past the first lease's bound on the directory's side (term + epsilon from the grant, and
    # epsilon more for the clocks), well inside the renewed one.
    s.sleep_ms(g.term_ms * 0.5 + 2 * s.skew_ms + 5)
    e = s.evict(w, s.ns, key, leased=True)
    s.check(isinstance(e, Refused) and e.reason == REASON_LEASED, "NoReclaimUnderLease",
            f"evicting a copy under a renewed lease, past its first expiry, answered {e}")  # fmt: skip
    # Past the renewed lease's bound (term + epsilon from the renewal, epsilon more for the
    # clocks): it has expired, and the copy is no longer protected.
    s.sleep_ms((r.requested_at_ns - time.monotonic_ns()) / 1e6 + r.term_ms + 3 * s.skew_ms + 5)
    e = s.evict(w, s.ns, key)
    s.check(isinstance(e, Evicted), "eviction", f"eviction of a copy whose renewed lease expired answered {e}")


def lease_across_restart(s: Session) -> None:
    """A lease granted before a directory restart: its renewal is answered, its copy kept."""
    w = s.nodes[0]
    key = chain(s, 1)[0]
    put(s, w, key, None)
    g = s.acquire(reader(s, w), s.ns, key)
    s.check(isinstance(g, ReadGrant), "caching", f"acquire refused: {g}")
    s.fault("restart_directory")
    # Granted (a directory that keeps its leases) or refused (one that forgot them): either way
    # an answer, never an error.
    s.renew(g)
    e = s.evict(w, s.ns, key)
    s.check(isinstance(e, Refused), "NoReclaimUnderLease", f"evicting a copy a lease of the previous incarnation may protect answered {e}")
    s.release(g)  # the restarted directory may not know it: ignored then, never an error


def restarted_node(s: Session) -> None:
    """A node that read under a lease and released it, then was killed and restarted without its
    memory, works like a new one: its key is handed over, and it reads the new bytes exactly."""
    if len(s.nodes) < 2:
        raise _not_applicable("needs two nodes")
    w, r = s.nodes[0], s.nodes[1]
    key = chain(s, 1)[0]
    data = put(s, w, key, None)
    read_back(s, w, key, data, "a block before the node's restart")
    held = s.acquire(w, s.ns, key)  # and a lease it still holds when it dies
    s.check(isinstance(held, ReadGrant), "caching", f"acquire refused: {held}")
    s.fault("kill", w)
    s.fault("restart", w)
    g = _handed_over(s, r, key, data, "a block of a node killed and restarted")
    new = s.payload()
    s.check(isinstance(s.write_bytes(g, new), Stored), "write", "write_bytes refused")
    s.check(isinstance(s.commit(g), Committed), "write", "commit refused")
    read_back(s, w, key, new, "a block after the node's restart")


def crashed_owner_failover(s: Session) -> None:
    """P4: a committed block whose owner's node is killed and stays down is given up -- the node
    declared down, the block voided -- so that another node writes the key again while the node
    is still down; the new block reads back there, and on the node once it is back, where the
    free of the first block, owed while it was down, arrives within the free bound (native
    traces). Another node's block is served on, exactly, throughout. A block owned at a shared
    location is served on, exactly, while the node is down."""
    if len(s.nodes) < 2:
        raise _not_applicable("needs two nodes")
    w, r = s.nodes[0], s.nodes[1]
    # A node killed and back within its detection time is never declared down: a block it
    # writes once back is still served after that time has passed.
    early_key = chain(s, 1)[0]
    s.fault("kill", w)
    s.fault("restart", w)
    early = put(s, w, early_key, None)
    s.sleep_ms(1.5 * s.lease_term_ms + 2 * s.skew_ms)
    read_back(s, r, early_key, early, f"a block {w} wrote once back from a kill, a detection time later")
    key, bystander = chain(s, 1)[0], chain(s, 1)[0]
    data = put(s, w, key, None)
    g = read_back(s, r, key, data, "a block about to lose its owner's node")
    kept = put(s, r, bystander, None)
    s.fault("kill", w)
    if location_host(g.location) != w:
        read_back(s, r, key, data, f"a block owned at {g.location}, its writer's node {w} down")
        s.fault("restart", w)
        return
    g2 = poll_until(s, lambda: s.begin_write(r, s.ns, key, None), lambda got: isinstance(got, WriteGrant),
                    "CrashedOwnerWritableInTime", f"a key whose owner copy was on {w}, killed and still down, "
                    "stayed unwritable")  # fmt: skip
    assert isinstance(g2, WriteGrant)
    new = _different_payload(s, data)
    s.check(isinstance(s.write_bytes(g2, new), Stored), "write", "write_bytes refused")
    s.check(isinstance(s.commit(g2), Committed), "write", "commit refused")
    read_back(s, r, key, new, f"a block rewritten while its first owner's node {w} was down")
    # Declaring w down gave up w's blocks, no other node's.
    read_back(s, r, bystander, kept, f"a block {r} wrote, after {w} was declared down")
    s.fault("restart", w)
    read_back(s, w, key, new, f"a block rewritten while {w} was down, read on {w} once it is back")
    # The free of the first block, owed to w while it was down, reaches it once it is back (a
    # restarted location judges it by what it holds now: ``fence_stale_free`` frees nothing).
    caps = s.adapter.capabilities()
    _freed_in_time(s, {key.hex: g.gen}, caps.free_bound_ms + s.lease_term_ms,
                   f"the free of a block voided while its node {w} was down, owed to it once back,",
                   rule="DeletionReachesEverywhere")  # fmt: skip
    read_back(s, w, bystander, kept, f"a block {r} wrote, read on {w} once it is back")
    if "restart_directory" in caps.faults:
        # Back is back: a directory restarted since does not take w for down again.
        s.fault("restart_directory")
        after = chain(s, 1)[0]
        read_back(s, r, after, put(s, w, after, None), f"a block {w} wrote after a directory restart, once back")


BODIES["crashed_owner_failover"] = crashed_owner_failover


def late_commit(s: Session) -> None:
    """A writer that stalls past its write lease with its bytes stored, then commits: refused."""
    w = s.nodes[0]
    key = chain(s, 1)[0]
    g = s.begin_write(w, s.ns, key, None)
    s.check(isinstance(g, WriteGrant), "write", f"begin_write refused: {g}")
    s.check(isinstance(s.write_bytes(g, s.payload()), Stored), "write", "write_bytes refused")
    # Past the write lease on the directory's side (term + epsilon from the grant), epsilon more for
    # the clocks: the lease has expired, and the stalled writer wakes up and commits.
    s.sleep_ms((g.requested_at_ns - time.monotonic_ns()) / 1e6 + g.term_ms + 3 * s.skew_ms + 5)
    c = s.commit(g)
    s.check(isinstance(c, Refused), "OneWriterPerGeneration", f"a commit after the write lease expired answered {c}")
    s.check(s.lookup(w, s.ns, [key]) == 0, "NoDirtyRead", "lookup finds a block whose write lease expired")
    r = reader(s, w)
    put(s, r, key, None)


def invalidate_other_namespace(s: Session) -> None:
    """Invalidating a key through another (authorised) namespace voids nothing."""
    w = s.nodes[0]
    a, b = s.namespaces[0], s.namespaces[1]
    keys = chain(s, 2, a)
    data = put_chain(s, w, keys, a)
    wait_done(s, s.invalidate(w, b, "key", keys[0]), [])
    n = s.lookup(w, a, keys)
    s.check(n == 2, "NamespaceIsolation", f"after an invalidation named in another namespace, lookup counted {n} of 2")
    for key, expected in zip(keys, data):
        read_back(s, reader(s, w), key, expected, "a block invalidated through another namespace", ns=a)
    # Voided for real (in its own namespace), the key is ABSENT: it still belongs to that namespace.
    wait_done(s, s.invalidate(w, a, "key", keys[0]), keys)
    g = s.begin_write(w, b, keys[0], None)
    s.check(isinstance(g, Refused), "NamespaceIsolation", f"begin_write of an invalidated key through another namespace answered {g}")
    # Its child, named as a root through the other namespace: refused ``unauthorized`` (or, by a
    # shard that does not own that root, ``wrong_shard``: the contract's order), never
    # ``key_identity``, which would tell that namespace the key exists under a parent elsewhere.
    g = s.begin_write(w, b, keys[1], None)
    s.check(isinstance(g, Refused) and g.reason in (REASON_UNAUTHORIZED, REASON_WRONG_SHARD), "NamespaceIsolation",
            f"begin_write through another namespace of a key recorded in the first, naming another parent, "
            f"answered {g} (the contract: unauthorized, before key_identity)")  # fmt: skip


def invalidate_during_write(s: Session) -> None:
    """Invalidating a key, then a namespace, whose only block is still being written."""
    w = s.nodes[0]
    k1, k2 = chain(s, 1)[0], chain(s, 1)[0]
    g1 = s.begin_write(w, s.ns, k1, None)
    s.check(isinstance(g1, WriteGrant), "write", f"begin_write refused: {g1}")
    wait_done(s, s.invalidate(w, s.ns, "key", k1), [])
    g2 = s.begin_write(w, s.ns, k2, None)
    s.check(isinstance(g2, WriteGrant), "write", f"begin_write refused: {g2}")
    wait_done(s, s.invalidate(w, s.ns, "namespace", None), [])
    # The writes may go on and commit (nothing was readable to void) or have been aborted: either
    # way what is then read is exactly what was committed.
    for g in (g1, g2):
        data = s.payload()
        if isinstance(s.write_bytes(g, data), Stored) and isinstance(s.commit(g), Committed):
            read_back(s, reader(s, w), g.key, data, "a block committed after an invalidation")


def ticket_counts(s: Session) -> None:
    """A ticket counts the COMMITTED blocks its invalidation voids."""
    w = s.nodes[0]
    keys = chain(s, 3)
    put_chain(s, w, keys)
    t = s.invalidate(w, s.ns, "key", keys[1])
    s.check(t.keys == 2, "invalidate", f"invalidating a block with one descendant covers {t.keys} keys, not 2")
    wait_done(s, t, keys[1:])
    t = s.invalidate(w, s.ns, "namespace", None)
    s.check(t.keys == 1, "invalidate", f"invalidating a namespace with one committed block covers {t.keys} keys, not 1")
    wait_done(s, t, keys[:1])


def never_written(s: Session) -> None:
    """A key nobody wrote: no lease, no lookup hit, no eviction."""
    w = s.nodes[0]
    key = chain(s, 1)[0]
    g = s.acquire(reader(s, w), s.ns, key)
    s.check(isinstance(g, Refused), "LeasesGrantedOnlyOnCommitted", f"acquire of a never-written key answered {g}")
    s.check(s.lookup(w, s.ns, [key]) == 0, "PrefixClosed", "lookup counted a never-written key")
    # And a lease released twice: the second release ends nothing, and is no error.
    put(s, w, key, None)
    g = s.acquire(w, s.ns, key)
    s.check(isinstance(g, ReadGrant), "caching", f"acquire refused: {g}")
    s.release(g)
    s.release(g)


def restart_during_invalidation(s: Session) -> None:
    """An invalidation waiting on a paused holder, and a directory restart while it waits: it
    completes no earlier than that holder's lease could expire, and its ticket is not lost."""
    w = s.nodes[0]
    h = reader(s, w)
    keys = chain(s, 2)
    put_chain(s, w, keys)
    g = s.acquire(h, s.ns, keys[1])
    s.check(isinstance(g, ReadGrant), "caching", f"acquire refused: {g}")
    s.fault("pause", h)
    try:
        ticket = s.invalidate(w, s.ns, "key", keys[0])
        # Well before the paused holder's lease can expire, a short wait MUST time out.
        early = s.wait_invalidation(ticket, min(0.05, g.term_ms / 4000), voids=keys)
        s.check(not early, "NoStaleRead", "a wait reported the invalidation complete while a paused holder's lease was live")
        s.fault("restart_directory")
        done = s.wait_invalidation(ticket, INVALIDATION_SLACK * s.term_s + 1, voids=keys)
        done_ns = time.monotonic_ns()
    finally:
        s.fault("resume", h)
    s.check(done, "InvalidationCompletesInTime", "the invalidation did not complete after the directory restarted")
    holder_deadline_ns = s.earliest_deadlines_ns[(g.node, g.lease)]
    s.check(done_ns >= holder_deadline_ns, "NoStaleRead",
            f"the invalidation completed {(holder_deadline_ns - done_ns) / 1e6:.0f} ms before a paused holder's lease could expire")  # fmt: skip
    got = s.read(g)
    s.check(isinstance(got, Refused), "NoStaleRead", "the resumed holder read the invalidated generation")


BODIES.update(namespace_bound=namespace_bound, renewal_protects=renewal_protects, lease_across_restart=lease_across_restart,
              restarted_node=restarted_node, late_commit=late_commit,
              invalidate_other_namespace=invalidate_other_namespace, invalidate_during_write=invalidate_during_write,
              ticket_counts=ticket_counts, never_written=never_written,
              restart_during_invalidation=restart_during_invalidation)


# -- deletion reaches everywhere (KVCC-INVAL-009) ---------------------------------------------------


def deletion_reaches_everywhere(s: Session) -> None:
    """End generations three ways -- a write whose lease expires unused, committed blocks on
    every node invalidated, a write aborted -- then wait the deployment's deletion bound
    (``contract.deletion_deadline_ms`` over its declared ``free_bound_ms``) and require, from the
    native trace, that every location that stored one of those generations freed it in time.
    The contract has no operation that inspects a location, so the trace is the evidence; with
    inferred events the suite sees no location at all and checks only that the generations are
    gone from the directory (lookup counts 0)."""
    from .contract import deletion_deadline_ms
    from .oracles import unfreed_locations

    bound_ms = s.adapter.capabilities().free_bound_ms
    settled = s.adapter.capabilities().frees_acknowledged
    after_end_ms, after_grant_ms = deletion_deadline_ms(s.lease_term_ms, s.skew_ms, bound_ms)
    w = s.nodes[0]
    groups: list[tuple[str, dict[str, int], float, list[BlockKey]]] = []  # (what, key hex -> gen, deadline, keys)
    # 1. A write whose lease runs out: bytes stored, never committed nor aborted.
    expiring = chain(s, 1)[0]
    g = s.begin_write(reader(s, w), s.ns, expiring, None)
    granted = time.monotonic()
    s.check(isinstance(g, WriteGrant), "write", f"begin_write refused: {g}")
    s.check(isinstance(s.write_bytes(g, s.payload()), Stored), "write", "write_bytes under a fresh grant refused")
    groups.append(("a write whose lease expired", {expiring.hex: g.gen}, granted + after_grant_ms / 1000, [expiring]))
    # 2. A committed block written from every node, invalidated.
    voided: dict[str, int] = {}
    keys = []
    for n in s.nodes:
        k = chain(s, 1)[0]
        put(s, n, k, None)
        keys.append(k)
    for k in keys:
        wait_done(s, s.invalidate(w, s.ns, "key", k), [k])
    with s.lock:
        for key, gen in s.committed:
            if key in keys:
                voided[key.hex] = max(voided.get(key.hex, 0), gen)
    groups.append(("an invalidation that completed", voided, time.monotonic() + after_end_ms / 1000, keys))
    # 3. A write aborted while its bytes were in flight: they land (or are fenced) after the
    # abort, and whatever landed is the ended generation's to free. (The spec's writer gives up
    # only before its bytes are known stored: after that it commits.)
    aborted = chain(s, 1)[0]
    g2 = s.begin_write(w, s.ns, aborted, None)
    granted = time.monotonic()
    s.check(isinstance(g2, WriteGrant), "write", f"begin_write refused: {g2}")
    s.abort(g2)  # the key is ABSENT at once or when the lease expires: the later of the two bounds
    landed = s.write_bytes(g2, s.payload())
    s.check(isinstance(landed, (Stored, Refused)), "write", f"bytes in flight after an abort answered {landed}")
    groups.append(("an aborted write", {aborted.hex: g2.gen}, granted + after_grant_ms / 1000, [aborted]))

    pending = list(range(len(groups)))
    late: list[str] = []
    while pending:
        events = s.adapter.events()
        if events is None:
            break  # inferred events: no location is visible, only the directory (below)
        now = time.monotonic()
        for i in list(pending):
            what, ended, deadline, _ = groups[i]
            left = unfreed_locations(events, ended, settled)
            if not left:
                pending.remove(i)
            elif now > deadline:
                late.append(f"{what}: {', '.join(left)} still hold the bytes, or their free never settled, "
                            f"{bound_ms} ms (free bound) + one term after")  # fmt: skip
                pending.remove(i)
        if pending:
            s.sleep_ms(s.lease_term_ms / 10)
    s.check(not late, "DeletionReachesEverywhere", "; ".join(late))
    for _, _, _, ks in groups:
        for k in ks:
            n = s.lookup(reader(s, w), s.ns, [k])
            s.check(n == 0, "DeletionReachesEverywhere", "an ended generation is still found by lookup")


BODIES["deletion_reaches_everywhere"] = deletion_reaches_everywhere


# -- tiers: reclaimed space, late and corrupt bytes, fences after a restart (KVCC-TIER-004/005, KVCC-FAULT-010..012)

# Blocks written and evicted one after another on one node: more than the slots of any tier the
# suite's own adapters configure (the in-process kit holds 512 blocks a node), so a location that
# loses a slot per block -- one freed, one a reader copied from -- fills up.
RECLAIM_BLOCKS = 640
RECLAIM_SIZES = (1, 4096)  # the extremes of the suite's block sizes, written every third block
# Header offsets ``corrupt`` damages, one block each: every byte of a header of up to this many bytes.
CORRUPT_HEADER_BYTES = 96


# Refusals a slow client earns on its own (its lease ran out between two calls, as a loaded machine
# can make it): the step is done again (a write under a fresh key), a bounded number of times.
LEASE_RAN_OUT = (REASON_FENCED, REASON_LEASE_EXPIRED, REASON_UNKNOWN_LEASE, REASON_NOT_FOUND)
RETRIES = 3


def _put_on_time(s: Session, node: str, what: str, size: int | None = None) -> tuple[BlockKey, bytes]:
    """A fresh root block written and committed on ``node``; a write whose lease ran out under
    load is given up and done again under a fresh key. Any other refusal FAILs (``eviction``:
    here that is a location out of room)."""
    for _ in range(RETRIES):
        key = chain(s, 1)[0]
        g = s.begin_write(node, s.ns, key, None)
        s.check(isinstance(g, WriteGrant), "write", f"{what}: begin_write of a fresh key refused: {g}")
        data = s.payload(size)
        stored = s.write_bytes(g, data)
        s.check(isinstance(stored, Stored) or stored.reason in LEASE_RAN_OUT, "eviction",
                f"{what}: write_bytes on {node} answered {stored}")  # fmt: skip
        c = s.commit(g) if isinstance(stored, Stored) else stored
        if isinstance(c, Committed):
            return key, data
        s.check(c.reason in LEASE_RAN_OUT, "write", f"{what}: commit refused: {c}")
        s.abort(g)
    raise OracleFailure("write", f"{what}: the write lease ran out {RETRIES} times in a row")


def _leased_read(s: Session, node: str, key: BlockKey, what: str, rule: str) -> tuple[object, bytes | Refused | None]:
    """A leased read of ``key`` on ``node`` (acquire, read, release): the acquire's answer and
    what the read answered (None when no lease was granted) -- done again when the holder's own
    deadline passed before its read, or before the grant came (a loaded machine), once the lease
    has run out at the directory too, so the next acquire starts clean."""
    for _ in range(RETRIES):
        g = s.acquire(node, s.ns, key)
        if isinstance(g, ReadGrant):
            got = s.read(g)
            s.release(g)
            if not (isinstance(got, Refused) and got.reason == REASON_LEASE_EXPIRED):
                return g, got
        elif not (isinstance(g, Refused) and g.reason == REASON_LEASE_EXPIRED):
            return g, None  # refused by the directory (a late grant, lease_expired, is asked again)
        s.sleep_ms(s.lease_term_ms + 2 * s.skew_ms)
    raise OracleFailure(rule, f"the lease on {what} ran out before its read {RETRIES} times in a row")


def _read_on_time(s: Session, node: str, key: BlockKey, expected: bytes, what: str) -> None:
    """``read_back`` through ``_leased_read``: the acquire MUST be granted, the read MUST answer
    ``expected``."""
    g, got = _leased_read(s, node, key, what, "caching")
    s.check(isinstance(g, ReadGrant), "caching", f"acquire of {what} refused: {g}")
    s.check(got == expected, "caching", f"a leased read of {what} answered {got!r:.60}")


def space_reclaimed(s: Session) -> None:
    """Write, commit, read from another node and evict ``RECLAIM_BLOCKS`` blocks one after another
    on one node: every write MUST still find room, and a block that stays all along (read before
    and after) MUST keep its bytes."""
    w = s.nodes[0]
    r = reader(s, w)
    anchor, kept = _put_on_time(s, w, "a block read before the others were written")  # its space must stay its own
    _read_on_time(s, r, anchor, kept, "a block read before the others were written")
    for i in range(RECLAIM_BLOCKS):
        what = f"block {i} of {RECLAIM_BLOCKS} (written after {i} evictions)"
        key, data = _put_on_time(s, w, what, RECLAIM_SIZES[i // 3 % 2] if i % 3 == 0 else None)
        _read_on_time(s, r, key, data, what)
        e = s.evict(w, s.ns, key)
        s.check(isinstance(e, Evicted), "eviction", f"{what}: evicting an unleased block answered {e}")
    _read_on_time(s, r, anchor, kept, f"a block that stayed while {RECLAIM_BLOCKS} others were written and evicted")


def corrupt_is_a_miss(s: Session) -> None:
    """Damage one byte of a committed block at rest -- each of the first ``CORRUPT_HEADER_BYTES``
    bytes of its header, then its payload's first, last and a random byte -- and read it under a
    lease: the read MUST be refused (miss), never served; evicting the copy MUST succeed and the key
    MUST then take new bytes, read back exactly. Every other block is read back once before it is
    damaged: a location that remembers having verified a block must still catch the damage."""
    w = s.nodes[0]
    r = reader(s, w)
    probes: list[tuple[str, int | None]] = [("header", i) for i in range(CORRUPT_HEADER_BYTES)]
    probes += [("payload", 0), ("payload", -1), ("payload", None), ("payload", None)]
    for i, (region, at) in enumerate(probes):
        key = chain(s, 1)[0]
        data = put(s, w, key, None)
        if i % 2:
            read_back(s, r, key, data, "a committed block before it was damaged")
        offset = len(data) - 1 if at == -1 else s.rng.randrange(len(data)) if at is None else at
        what = f"a block whose {region} byte {offset} was damaged at rest{' after a read' if i % 2 else ''}"
        s.fault("corrupt", w, key, region, offset)
        g = s.acquire(r, s.ns, key)
        s.check(isinstance(g, ReadGrant), "caching", f"acquire of {what} refused: {g}")
        got = s.read(g)
        s.check(isinstance(got, Refused) and got.reason == REASON_MISS, "CommittedBytesIntact",
                f"a read of {what} answered {got!r:.60}, not a miss")  # fmt: skip
        s.release(g)
        e = s.evict(w, s.ns, key)
        s.check(isinstance(e, Evicted), "eviction", f"evicting {what} answered {e}")
        fresh = put(s, w, key, None)
        read_back(s, r, key, fresh, f"new bytes of a key after {what} was evicted")


def _write_after_expiry(s: Session, w: str, other: str, key: BlockKey) -> tuple[WriteGrant, WriteGrant, bytes]:
    """A write lease of ``w`` on ``key`` left to expire with its bytes unsent, then the key
    written and committed by ``other`` under the next epoch: (stale grant, new grant, its bytes)."""
    stale = s.begin_write(w, s.ns, key, None)
    s.check(isinstance(stale, WriteGrant), "write", f"begin_write of a fresh key refused: {stale}")
    deadline = time.monotonic() + (s.lease_term_ms + 2 * s.skew_ms) / 1000 + s.term_s
    while True:
        g = s.begin_write(other, s.ns, key, None)
        if isinstance(g, WriteGrant):
            break
        s.check(g.reason == REASON_NOT_ABSENT, "write", f"begin_write while the first write lease runs out answered {g}")
        s.check(time.monotonic() < deadline, "WriteLeaseEndsInTime", "the key stayed WRITING past its write lease")
        s.sleep_ms(s.lease_term_ms / 10)
    s.check(g.epoch > stale.epoch, "EpochMonotonic", f"new write epoch {g.epoch} not above {stale.epoch}")
    data = s.payload()
    s.check(isinstance(s.write_bytes(g, data), Stored), "write", "write_bytes under the new grant refused")
    s.check(isinstance(s.commit(g), Committed), "write", "commit under the new grant refused")
    return stale, g, data


def late_bytes_stay_deleted(s: Session) -> None:
    """The bytes of a write whose lease expired, sent only after the key was written again
    elsewhere: they MAY land only if the location has not freed that generation yet (the trace
    says which: the validator judges them by the location's fence and freed epoch), and the key's
    block MUST read back exactly. With inferred events the suite sees no location and sends no
    late bytes."""
    if len(s.nodes) < 2:
        raise _not_applicable("needs two nodes")
    w, other = s.nodes[0], s.nodes[1]
    key = chain(s, 1)[0]
    stale, _, data = _write_after_expiry(s, w, other, key)
    if not s.infer:  # an inferred trace has no location whose freed epoch could judge them
        late = s.write_bytes(stale, s.payload())
        s.check(isinstance(late, (Stored, Refused)), "write", f"bytes of an expired write answered {late}")
    s.check(isinstance(s.commit(stale), Refused), "OneWriterPerGeneration", "a commit under the expired grant was accepted")
    read_back(s, w, key, data, "the block written after the first write lease expired")


def fenced_after_restart(s: Session) -> None:
    """A grant's bytes sent before its node crashed, landing at that node after it restarted
    without its memory, below the epoch the key has moved on to: the restarted location MUST
    refuse them (it takes its fences back from the directory), and the key's current block MUST
    read back exactly. With inferred events the suite sees no location and sends no late bytes."""
    if len(s.nodes) < 2:
        raise _not_applicable("needs two nodes")
    w, other = s.nodes[0], s.nodes[1]
    key = chain(s, 1)[0]
    stale, g, data = _write_after_expiry(s, w, other, key)  # the stale bytes are in flight across w's crash
    s.fault("kill", w)
    s.fault("restart", w)
    if not s.infer:  # an inferred trace has no location whose restored fence could judge them
        late = s.write_bytes(stale, s.payload())
        s.check(isinstance(late, Refused), "FencingHolds",
                f"bytes under epoch {stale.epoch}, sent before {w} crashed, landed there after its restart although "
                f"the key is at epoch {g.epoch}: {late}")  # fmt: skip
    read_back(s, other, key, data, "the block written while the stale bytes were in flight")


def free_after_restart(s: Session) -> None:
    """Two blocks are invalidated while the node holding them is down, so the frees the directory
    owes that node find it down. One key is written again elsewhere before the node restarts
    without its memory, the other by the node itself right after. When the owed frees reach it
    (the suite waits up to the free bound plus a term for them in a native trace), the restarted
    location MUST judge each by what it holds now -- the fence it took back from the directory,
    the newer block it stored -- and the trace is validated: both are refused as stale
    (``fence_stale_free``) and free nothing; both keys' new blocks MUST read back exactly."""
    if len(s.nodes) < 2:
        raise _not_applicable("needs two nodes")
    w, other = s.nodes[0], s.nodes[1]
    elsewhere, here = chain(s, 1)[0], chain(s, 1)[0]
    put(s, w, elsewhere, None)
    put(s, w, here, None)
    s.fault("kill", w)
    for key in (elsewhere, here):
        wait_done(s, s.invalidate(other, s.ns, "key", key), [key])
    moved = put(s, other, elsewhere, None)
    s.fault("restart", w)
    kept = put(s, w, here, None)  # a newer block where the stale free is headed
    deadline = time.monotonic() + (s.adapter.capabilities().free_bound_ms + s.lease_term_ms) / 1000
    while time.monotonic() < deadline:
        events = s.adapter.events()
        if events is None:
            break  # inferred events: the suite cannot see the frees arrive
        freed = {e.get("key") for e in events if e.get("event") in ("free_slot", "fence_stale_free")
                 and str(e.get("location", "")).partition("/")[0] == w}  # fmt: skip
        if {elsewhere.hex, here.hex} <= freed:
            break
        s.sleep_ms(s.lease_term_ms / 4)
    read_back(s, w, elsewhere, moved, "a block written elsewhere while its old copy's free was owed to a down node")
    read_back(s, other, here, kept, "a block written by a restarted node before the free owed to it arrived")


BODIES.update(space_reclaimed=space_reclaimed, corrupt_is_a_miss=corrupt_is_a_miss,
              late_bytes_stay_deleted=late_bytes_stay_deleted, fenced_after_restart=fenced_after_restart,
              free_after_restart=free_after_restart)


# -- one request per client, grants of one node, timers under load, overlapping invalidations, paused
# and dead nodes (KVCC-CORE-011/012, KVCC-LEASE-009/010, KVCC-FAULT-008/009/013) ------------


def poll_until(s: Session, attempt: Callable[[], object], done: Callable[[object], bool], rule: str, what: str) -> object:
    """Call ``attempt`` every tenth of a term until ``done`` holds of its answer; FAIL with
    ``rule`` after ``INVALIDATION_SLACK`` terms (plus a second). Returns the answer."""
    deadline = time.monotonic() + INVALIDATION_SLACK * s.term_s + 1
    while True:
        got = attempt()
        if done(got):
            return got
        s.check(time.monotonic() < deadline, rule, f"{what}: still {got}")
        s.sleep_ms(s.lease_term_ms / 10)


def one_write_per_writer(s: Session) -> None:
    """A node's second begin_write of a key it is writing is refused and leaves the first write
    alone; once the first write's lease ran out, the node may write the key again."""
    w = s.nodes[0]
    key, idle = chain(s, 1)[0], chain(s, 1)[0]
    g = s.begin_write(w, s.ns, key, None)
    s.check(isinstance(g, WriteGrant), "write", f"begin_write of a fresh key refused: {g}")
    again = s.begin_write(w, s.ns, key, None)
    s.check(isinstance(again, Refused), "OneWriterPerGeneration", f"a second begin_write of a key being written answered {again}")
    data = s.payload()
    s.check(isinstance(s.write_bytes(g, data), Stored), "write", "write_bytes under the first grant refused after a second begin_write")
    s.check(isinstance(s.commit(g), Committed), "write", "commit under the first grant refused after a second begin_write")
    s.abort(g)  # after the commit: nothing to give up, and it must not disturb the block
    s.abort(g)
    read_back(s, reader(s, w), key, data, "a block whose writer aborted after committing")
    # A write whose lease ran out unused: the same node may write the key again, under a higher epoch.
    first = s.begin_write(w, s.ns, idle, None)
    s.check(isinstance(first, WriteGrant), "write", f"begin_write of a fresh key refused: {first}")
    g2 = poll_until(s, lambda: s.begin_write(w, s.ns, idle, None), lambda r: isinstance(r, WriteGrant),
                    "WriteLeaseEndsInTime", "the writer's own unused write of the key never let it write again")  # fmt: skip
    assert isinstance(g2, WriteGrant) and isinstance(first, WriteGrant)
    s.check(g2.epoch > first.epoch, "EpochMonotonic", f"the new write's epoch {g2.epoch} is not above {first.epoch}")
    data = s.payload()
    s.check(isinstance(s.write_bytes(g2, data), Stored), "write", "write_bytes under the new grant refused")
    s.check(isinstance(s.commit(g2), Committed), "write", "commit under the new grant refused")
    read_back(s, reader(s, w), idle, data, "a block rewritten by the writer of an expired write")


def one_lease_per_holder(s: Session) -> None:
    """A holder's second acquire of a key it trusts is refused and leaves its lease alone; once
    the lease ran out the holder is granted a new one, and the old one stays dead."""
    w = s.nodes[0]
    h = reader(s, w)
    key = chain(s, 1)[0]
    data = put(s, w, key, None)
    g = s.acquire(h, s.ns, key)
    s.check(isinstance(g, ReadGrant), "caching", f"acquire refused: {g}")
    again = s.acquire(h, s.ns, key)
    s.check(isinstance(again, Refused), "LeaseIdsFresh", f"a second acquire of a key the holder trusts answered {again}")
    got = s.read(g)
    s.check(got == data, "caching", f"a read under the first lease after a second acquire answered {got!r:.60}")
    g2 = poll_until(s, lambda: s.acquire(h, s.ns, key), lambda r: isinstance(r, ReadGrant),
                    "LeaseKnownToDirectory", "the holder's expired lease kept it from leasing the key again")  # fmt: skip
    assert isinstance(g2, ReadGrant)
    got = s.read(g)
    s.check(isinstance(got, Refused), "RenewalNeverRevives", f"a read under the expired first lease answered {got!r:.60}")
    renewed = s.renew(g)
    s.check(isinstance(renewed, Refused), "RenewalNeverRevives", f"renewing the expired first lease answered {renewed}")
    s.release(g)  # the old lease: harmless to the new one
    got = s.read(g2)
    s.check(got == data, "caching", f"a read under the new lease after releasing the old one answered {got!r:.60}")
    s.release(g2)


def expiry_under_churn(s: Session) -> None:
    """While other nodes keep writing, leasing and releasing other keys, an unused write lease and
    an unreleased read lease still run out on time: each lease expires on its own deadline,
    whatever was granted after it."""
    if len(s.nodes) < 2:
        raise _not_applicable("needs two nodes")
    w, c = s.nodes[0], s.nodes[-1]
    h = reader(s, w)
    stop = threading.Event()
    failed: list[BaseException] = []

    def churn() -> None:
        try:
            while not stop.is_set():
                k = chain(s, 1)[0]
                put(s, c, k, None)
                g = s.acquire(c, s.ns, k)
                if isinstance(g, ReadGrant):
                    s.release(g)
                s.evict(c, s.ns, k)  # the churn keeps no bytes: however long it runs, the cache has room
                # A few grants per term: each expires after the leases under test (a queue that
                # waits on its latest entry never gets to them), and the trace stays short.
                s.sleep_ms(s.lease_term_ms / 4)
        except BaseException as e:  # noqa: BLE001 - reported by the test's own thread
            failed.append(e)

    key, leased = chain(s, 1)[0], chain(s, 1)[0]
    put(s, w, leased, None)
    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        g = s.begin_write(w, s.ns, key, None)
        s.check(isinstance(g, WriteGrant), "write", f"begin_write of a fresh key refused: {g}")
        s.check(isinstance(s.write_bytes(g, s.payload()), Stored), "write", "write_bytes refused")
        # Never committed: another node may write the key once the write lease ran out.
        poll_until(s, lambda: s.begin_write(h, s.ns, key, None), lambda r: isinstance(r, WriteGrant),
                   "WriteLeaseEndsInTime", "an unused write lease never ran out while other writes were granted")  # fmt: skip
        r = s.acquire(h, s.ns, leased)
        s.check(isinstance(r, ReadGrant), "caching", f"acquire refused: {r}")
        poll_until(s, lambda: s.evict(w, s.ns, leased, leased=True), lambda r: isinstance(r, Evicted),
                   "LeaseKnownToDirectory", "a read lease never ran out while other leases were granted")  # fmt: skip
    finally:
        stop.set()
        t.join()
    if failed:
        raise failed[0]


def _in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, dict]:
    """Run ``fn`` in a daemon thread; the dict gets its ``answer``, or the ``error`` it raised."""
    out: dict = {}

    def run() -> None:
        try:
            out["answer"] = fn()
        except BaseException as e:  # noqa: BLE001 - inspected by the caller
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def idle_nodes(s: Session) -> None:
    """A paused node answers nothing while paused -- its operations block until it resumes, or
    fail -- and an invalidation waiting on its lease completes within a short wait; a killed
    node serves nothing until it restarts."""
    if len(s.nodes) < 2:
        raise _not_applicable("needs two nodes")
    w, h = s.nodes[0], s.nodes[1]
    key, voided, held, writing = (chain(s, 1)[0] for _ in range(4))
    data = put(s, w, key, None)
    put(s, w, voided, None)
    put(s, w, held, None)
    g = s.acquire(h, s.ns, held)
    s.check(isinstance(g, ReadGrant), "caching", f"acquire refused: {g}")
    gw = s.begin_write(h, s.ns, writing, None)
    s.check(isinstance(gw, WriteGrant), "write", f"begin_write refused: {gw}")
    s.fault("pause", h)
    try:
        # With inferred events the suite runs one operation at a time (its log's order is the
        # adapter's), so an operation blocked on the paused node would hold up the rest: the
        # calls on the paused node are made only with native events.
        calls = [] if s.infer else [
            _in_thread(lambda: s.acquire(h, s.ns, key)), _in_thread(lambda: s.write_bytes(gw, s.payload())),
            _in_thread(lambda: s.invalidate(h, s.ns, "key", voided))]  # fmt: skip
        # Blocked by the paused holder, the invalidation completes when its lease runs out: a
        # wait shorter than INVALIDATION_SLACK terms sees it (no wait may give up early).
        ticket = s.invalidate(w, s.ns, "key", held)
        done = s.wait_invalidation(ticket, INVALIDATION_SLACK * s.term_s, voids=[held])
        s.check(done, "InvalidationCompletesInTime", "an invalidation waiting on a paused holder's lease did not complete")
        answered = [out["answer"] for _, out in calls if "answer" in out]
        s.check(not answered, "NodePaused", f"a paused node answered {answered[0]!r:.80}" if answered else "")
    finally:
        s.fault("resume", h)
    for t, out in calls:
        t.join(INVALIDATION_SLACK * s.term_s + 5)
        s.check(not t.is_alive(), "NodePaused", "an operation on a resumed node never returned")
        if "error" in out and not isinstance(out["error"], AdapterError):
            raise out["error"]
        if isinstance(out.get("answer"), ReadGrant):
            s.release(out["answer"])
    got = s.read(g)
    s.check(isinstance(got, Refused), "NoStaleRead", "the resumed holder read an invalidated generation")
    s.fault("kill", h)
    try:
        dead = s.acquire(h, s.ns, key)
    except AdapterError:
        dead = None
    s.fault("restart", h)
    s.check(not isinstance(dead, ReadGrant), "NodeDown", f"a killed node was granted a lease: {dead}")
    read_back(s, w, key, data, "a block after its reader restarted")


def dead_nodes_in_invalidation(s: Session) -> None:
    """Invalidations that reach dead nodes: one whose holder was killed completes once the holder
    restarted (its leases forgotten), one whose only copy's node was killed completes at once; no
    dead process takes part in either, and once the nodes are back the keys are written and read
    again."""
    if len(s.nodes) < 3:
        raise _not_applicable("needs three nodes")
    w, h, x = s.nodes[0], s.nodes[1], s.nodes[2]
    held, stored = chain(s, 1)[0], chain(s, 1)[0]
    put(s, w, held, None)
    put(s, w, stored, None)
    g = s.acquire(h, s.ns, held)
    s.check(isinstance(g, ReadGrant), "caching", f"acquire refused: {g}")
    s.fault("kill", h)
    ticket = s.invalidate(x, s.ns, "key", held)
    s.fault("restart", h)
    wait_done(s, ticket, [held])
    s.fault("kill", w)
    wait_done(s, s.invalidate(x, s.ns, "key", stored), [stored])
    s.fault("restart", w)
    for key in (held, stored):
        g2 = poll_until(s, lambda: s.begin_write(x, s.ns, key, None), lambda r: isinstance(r, WriteGrant),
                        "OwnershipHandoffAfterCrash", "a key invalidated while nodes were dead stayed unwritable")  # fmt: skip
        assert isinstance(g2, WriteGrant)
        data = s.payload()
        s.check(isinstance(s.write_bytes(g2, data), Stored), "write", "write_bytes refused")
        s.check(isinstance(s.commit(g2), Committed), "write", "commit refused")
        read_back(s, w, key, data, "a block rewritten after the nodes restarted")


def grant_of_another_node(s: Session) -> None:
    """A write grant presented on behalf of another node (the grant's node changed) lands nothing
    that commits: the directory publishes a write only for the writer its lease was granted to."""
    if len(s.nodes) < 2:
        raise _not_applicable("needs two nodes")
    w, x = s.nodes[0], s.nodes[1]
    key = chain(s, 1)[0]
    g = s.begin_write(w, s.ns, key, None)
    s.check(isinstance(g, WriteGrant), "write", f"begin_write of a fresh key refused: {g}")
    assert isinstance(g, WriteGrant)
    forged = attrs.evolve(g, node=x)
    try:
        s.write_bytes(forged, s.payload())
        got = s.commit(forged)
    except AdapterError:
        got = None  # the adapter knows the grant is not that node's
    s.check(not isinstance(got, Committed), "OneWriterPerGeneration", "a write grant committed for a node it was not granted to")
    data = s.payload()
    s.check(isinstance(s.write_bytes(g, data), Stored), "write", "write_bytes under the writer's own grant refused")
    s.check(isinstance(s.commit(g), Committed), "write", "commit under the writer's own grant refused")
    read_back(s, x, key, data, "a block whose grant was presented by another node first")


def overlapping_invalidations(s: Session) -> None:
    """A second invalidation of a key already INVALIDATING (waiting on a paused holder) counts it
    and waits with the first; a ticket that completed at once is still complete after a directory
    restart, and one restarted while pending still completes."""
    w = s.nodes[0]
    h = reader(s, w)
    key, quiet = chain(s, 1)[0], chain(s, 1)[0]
    put(s, w, key, None)
    put(s, w, quiet, None)
    at_once = s.invalidate(w, s.ns, "key", quiet)
    wait_done(s, at_once, [quiet])
    g = s.acquire(h, s.ns, key)
    s.check(isinstance(g, ReadGrant), "caching", f"acquire refused: {g}")
    s.fault("pause", h)
    try:
        first = s.invalidate(w, s.ns, "key", key)
        second = s.invalidate(w, s.ns, "key", key)
        s.check(second.keys == 1, "InvalidationCompletesInTime",
                f"a second invalidation of a key being invalidated counts {second.keys} keys, not 1")  # fmt: skip
        # Probed before the restart too: on a loaded machine the restart alone can outlast the
        # paused holder's lease, after which an early completion is indistinguishable from a due one.
        early = s.wait_invalidation(first, EARLY_PROBE_S)
        early_ns = time.monotonic_ns()
        s.check(not early or early_ns >= s.earliest_deadlines_ns[(g.node, g.lease)], "NoStaleRead",
                f"an invalidation waiting on a paused holder completed "
                f"{(s.earliest_deadlines_ns[(g.node, g.lease)] - early_ns) / 1e6:.0f} ms before its lease could expire")  # fmt: skip
        s.fault("restart_directory")
        done = [s.wait_invalidation(t, INVALIDATION_SLACK * s.term_s + 1, voids=[key]) for t in (first, second)]
        done_ns = time.monotonic_ns()
    finally:
        s.fault("resume", h)
    s.check(all(done), "InvalidationCompletesInTime", f"overlapping invalidations completed: {done}")
    holder_deadline_ns = s.earliest_deadlines_ns[(g.node, g.lease)]
    s.check(done_ns >= holder_deadline_ns, "NoStaleRead",
            f"overlapping invalidations completed {(holder_deadline_ns - done_ns) / 1e6:.0f} ms before a paused holder's lease could expire")  # fmt: skip
    s.check(s.wait_invalidation(at_once, s.term_s, voids=[quiet]), "InvalidationCompletesInTime",
            "an invalidation that had completed was not complete after a directory restart")  # fmt: skip
    got = s.read(g)
    s.check(isinstance(got, Refused), "NoStaleRead", "the resumed holder read the invalidated generation")


BODIES.update(one_write_per_writer=one_write_per_writer, one_lease_per_holder=one_lease_per_holder,
              expiry_under_churn=expiry_under_churn, idle_nodes=idle_nodes,
              dead_nodes_in_invalidation=dead_nodes_in_invalidation, grant_of_another_node=grant_of_another_node,
              overlapping_invalidations=overlapping_invalidations)


# -- frees held back by a directory restart's grace (KVCC-FAULT-014) ------------------------------------


def freed_after_grace(s: Session) -> None:
    """Right after a directory restart, every node writes a fresh key and lets its write lease run
    out unused: a lease granted in the first epsilon of the restart grace (term + 2 epsilon) runs
    out inside it, while the restarted directory holds every free back (the old incarnation's
    leases may still be trusted). Those frees MUST leave when the grace ends: every location that
    stored the bytes MUST free them within the deletion bound counted as for any expired write
    (``contract.deletion_deadline_ms``), and the native trace is the evidence, as in
    KVCC-INVAL-009. With inferred events only the directory is visible: lookup counts 0."""
    from .contract import deletion_deadline_ms
    from .oracles import unfreed_locations

    _, after_grant_ms = deletion_deadline_ms(s.lease_term_ms, s.skew_ms, s.adapter.capabilities().free_bound_ms)
    s.fault("restart_directory")
    ended: dict[str, int] = {}  # key hex -> the generation that ran out
    keys: list[BlockKey] = []
    deadline = 0.0
    for n in s.nodes:  # one grant after another, as soon as the restart returned: most inside the grace
        key = chain(s, 1)[0]
        g = s.begin_write(n, s.ns, key, None)
        granted = time.monotonic()
        s.check(isinstance(g, WriteGrant), "write", f"begin_write of a fresh key after a directory restart refused: {g}")
        assert isinstance(g, WriteGrant)
        s.check(isinstance(s.write_bytes(g, s.payload()), Stored), "write", "write_bytes under a fresh grant refused")
        ended[key.hex] = g.gen
        keys.append(key)
        deadline = max(deadline, granted + after_grant_ms / 1000)
    left: list[str] = []
    while (events := s.adapter.events()) is not None:
        left = unfreed_locations(events, ended, s.adapter.capabilities().frees_acknowledged)
        if not left or time.monotonic() > deadline:
            break
        s.sleep_ms(s.lease_term_ms / 10)
    s.check(not left, "DeletionReachesEverywhere",
            f"writes that ran out during a restarted directory's grace: {', '.join(left)} still hold the bytes "
            f"{after_grant_ms} ms after the grant")  # fmt: skip
    for key in keys:
        s.check(s.lookup(reader(s, s.nodes[0]), s.ns, [key]) == 0, "DeletionReachesEverywhere",
                "a write that ran out during a restarted directory's grace is found by lookup")  # fmt: skip


BODIES["freed_after_grace"] = freed_after_grace


# -- a revocation that finds its holder no longer trusting (KVCC-INVAL-011) -----------------------------


def revoke_after_holder_deadline(s: Session) -> None:
    """A holder reads past its own deadline (it stops trusting the lease: the read may still be
    served within epsilon of the deadline, never later) while the directory still holds the lease
    live (term + epsilon from the grant), and an invalidation of the key comes in that window: the
    revocation finds a holder with nothing to drop. It MUST acknowledge it all the same (or let the
    lease run out): the invalidation MUST complete, no read under the old lease may then return
    bytes, and the key MUST take new bytes that the same holder reads exactly. Tried on two keys,
    since the window is two epsilons wide."""
    if len(s.nodes) < 2:
        raise _not_applicable("needs two nodes")
    w = s.nodes[0]
    h = reader(s, w)
    for _ in range(2):
        key = chain(s, 1)[0]
        put(s, w, key, None)
        g = s.acquire(h, s.ns, key)
        s.check(isinstance(g, ReadGrant), "caching", f"acquire of a committed block refused: {g}")
        assert isinstance(g, ReadGrant)
        past_ns = s.earliest_deadlines_ns[(g.node, g.lease)] + s.skew_ms * 1_000_000 // 2
        s.sleep_ms(max(0.0, (past_ns - time.monotonic_ns()) / 1e6))
        s.read(g)  # past the holder's deadline: it stops trusting the lease (the session judges any bytes)
        wait_done(s, s.invalidate(w, s.ns, "key", key), [key])
        got = s.read(g)
        s.check(isinstance(got, Refused), "NoStaleRead", f"a read under a revoked lease, after the invalidation completed, answered {type(got).__name__}")
        data = put(s, w, key, None)
        read_back(s, h, key, data, "a block rewritten after an invalidation whose holder had stopped trusting its lease")


BODIES["revoke_after_holder_deadline"] = revoke_after_holder_deadline


# -- a write across its writer's restart (KVCC-FAULT-015) ----------------------------------------------


def write_across_writer_restart(s: Session) -> None:
    """A node is granted a write and stores its bytes, then is killed and restarted without its
    memory. The write MUST NOT be committed after that: the restarted node's commit of the old
    grant MUST be refused (spec: ``restart_node`` ends every write in progress to the node, whose
    bytes may be gone -- a commit taken then would leave a key that every lookup finds and every
    read misses; ``LostCopyVoidedOnRejoin``). Another node's begin_write MUST be granted once the
    node rejoined or the lease ran out (within a few terms), under a higher epoch; the new block
    MUST read back exactly on the restarted node."""
    if len(s.nodes) < 2:
        raise _not_applicable("needs two nodes")
    w, other = s.nodes[0], s.nodes[1]
    key = chain(s, 1)[0]
    g = s.begin_write(w, s.ns, key, None)
    s.check(isinstance(g, WriteGrant), "write", f"begin_write of a fresh key refused: {g}")
    assert isinstance(g, WriteGrant)
    s.check(isinstance(s.write_bytes(g, s.payload()), Stored), "write", "write_bytes under a fresh grant refused")
    s.fault("kill", w)
    s.fault("restart", w)
    late = s.commit(g)
    s.check(isinstance(late, Refused), "LostCopyVoidedOnRejoin",
            f"the commit of a write whose writer restarted without its memory was taken: {late}")  # fmt: skip
    g2 = poll_until(s, lambda: s.begin_write(other, s.ns, key, None), lambda r: isinstance(r, WriteGrant),
                    "WriteLeaseEndsInTime", "the write of a restarted writer never let another node write the key")  # fmt: skip
    assert isinstance(g2, WriteGrant)
    s.check(g2.epoch > g.epoch, "EpochMonotonic", f"the new write's epoch {g2.epoch} is not above {g.epoch}")
    data = s.payload()
    s.check(isinstance(s.write_bytes(g2, data), Stored), "write", "write_bytes under the new grant refused")
    s.check(isinstance(s.commit(g2), Committed), "write", "commit under the new grant refused")
    read_back(s, w, key, data, "a block written after its first writer restarted mid-write")


BODIES["write_across_writer_restart"] = write_across_writer_restart


# -- an invalidation through a foreign namespace (KVCC-INVAL-012) --------------------------------------


def invalidate_foreign_namespace(s: Session) -> None:
    """Invalidations in a namespace the tenant is not authorised for -- of a key of its own
    namespace named through it, of the whole foreign namespace -- void nothing and answer a
    ticket of 0 keys that is complete at once (contract: ``invalidate``); the block stays
    committed and is read back exactly."""
    w = s.nodes[0]
    key = chain(s, 1)[0]
    data = put(s, w, key, None)
    for scope, named in (("key", key), ("namespace", None)):
        if scope not in s.adapter.capabilities().scopes:
            continue
        t = s.invalidate(w, s.foreign, scope, named)
        s.check(t.keys == 0, "NamespaceIsolation", f"an invalidation ({scope}) in a foreign namespace counted {t.keys} keys")
        s.check(s.wait_invalidation(t, s.term_s, voids=[]), "NamespaceIsolation",
                f"an invalidation ({scope}) in a foreign namespace that voids nothing did not complete at once")  # fmt: skip
    read_back(s, reader(s, w), key, data, "a block after invalidations in a foreign namespace")


BODIES["invalidate_foreign_namespace"] = invalidate_foreign_namespace


# -- overwrites and rewrites racing readers (KVCC-CORE-013, KVCC-INVAL-013) ------------------------


def _different_payload(s: Session, old: bytes) -> bytes:
    """New bytes of the size of ``old`` that differ from them (a rewrite that kept the old bytes
    must not read back as a pass)."""
    while True:
        new = s.payload(len(old))
        if new != old:
            return new


def _rewrite(s: Session, node: str, key: BlockKey, data: bytes) -> WriteGrant:
    """Write and commit ``data`` as a new generation of ``key`` (ABSENT again: its invalidation
    completed); the grant it was written under."""
    g = s.begin_write(node, s.ns, key, None)
    s.check(isinstance(g, WriteGrant), "write", f"begin_write of a key whose invalidation completed refused: {g}")
    stored = s.write_bytes(g, data)
    s.check(isinstance(stored, Stored), "write", f"write_bytes of a rewrite refused: {stored}")
    s.check(isinstance(s.commit(g), Committed), "write", "commit of a rewrite refused")
    return g


def overwrite_refused(s: Session) -> None:
    """Writing a key that holds committed bytes (contract: ``begin_write``) MUST be refused as not
    absent, by the key's own writer and by another node, and the block MUST still read back
    exactly. Once an invalidation of the key completed, the key takes new bytes of the same size:
    written first by the node whose location held the old bytes, then by another, each MUST read
    back exactly on every node -- a store that keeps a key's first bytes (write-once, content
    addressed) fails here. Once invalidated again, a write of the key under another (committed)
    parent MUST be refused: the key is a root (``key_identity``); likewise of a key only another
    node ever wrote."""
    w = s.nodes[0]
    other = reader(s, w)
    key, elsewhere = chain(s, 1)[0], chain(s, 1)[0]
    put(s, w, elsewhere, None)
    data = put(s, w, key, None)
    for node in dict.fromkeys((w, other)):
        g = s.begin_write(node, s.ns, key, None)
        s.check(isinstance(g, Refused) and g.reason == REASON_NOT_ABSENT, "OneWriterPerGeneration",
                f"begin_write of a committed key by {node} answered {g}")  # fmt: skip
    read_back(s, other, key, data, "a committed block after refused overwrites")
    gen = -1
    for node in dict.fromkeys((w, other)):
        wait_done(s, s.invalidate(w, s.ns, "key", key), [key])
        data = _different_payload(s, data)
        g = _rewrite(s, node, key, data)
        s.check(g.gen > gen, "EpochMonotonic", f"a rewrite's generation {g.gen} is not above the one before ({gen})")
        gen = g.gen
        for r in dict.fromkeys((node, other, w)):
            read_back(s, r, key, data, f"a block rewritten by {node}")
    wait_done(s, s.invalidate(w, s.ns, "key", key), [key])
    moved = s.begin_write(other, s.ns, key, elsewhere)
    s.check(isinstance(moved, Refused), "overwrite",
            f"begin_write of a root key, ABSENT again, naming a parent it was never written under answered "
            f"{moved}: a key's digest chains over its parent's (key_identity)")  # fmt: skip
    # Likewise by a node that never wrote the key: only the directory knows the parent it had, so
    # its refusal is the directory's, which a native trace logs (the completeness check).
    fresh = chain(s, 1)[0]
    put(s, w, fresh, None)
    wait_done(s, s.invalidate(w, s.ns, "key", fresh), [fresh])
    moved = s.begin_write(other, s.ns, fresh, elsewhere)
    s.check(isinstance(moved, Refused), "overwrite",
            f"begin_write by {other} of a root key written by {w}, ABSENT again, naming a parent it was never "
            f"written under answered {moved} (key_identity)")  # fmt: skip


BODIES["overwrite_refused"] = overwrite_refused

REWRITE_ROUNDS = 6
RACING_READERS = 3


def rewrite_racing_readers(s: Session) -> None:
    """A key invalidated and rewritten with new bytes of the same size, round after round, by each
    node in turn, while ``RACING_READERS`` readers spread over the nodes keep acquiring, reading
    and releasing it: a read that returns bytes MUST return exactly the bytes of the generation its
    lease names (the session's oracles: never a mix of two, never a generation that was not
    committed, never one read after its invalidation completed); a refusal is allowed. Every
    generation MUST be read by some reader within a few terms of its commit (a cache that refuses
    every racing read would otherwise pass), and the last one MUST read back exactly."""
    w = s.nodes[0]
    key = chain(s, 1)[0]
    data = put(s, w, key, None, data=s.payload(4096))
    read_gens: set[int] = set()
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []

    def read_loop(i: int) -> None:
        node = s.nodes[i % len(s.nodes)]
        try:
            while not stop.is_set():
                g = s.acquire(node, s.ns, key)
                if not isinstance(g, ReadGrant):
                    s.sleep_ms(s.lease_term_ms / 50)  # the key is being invalidated or written
                    continue
                got = s.read(g)  # checked by the session against the generation's committed bytes
                s.release(g)
                if isinstance(got, bytes):
                    with lock:
                        read_gens.add(g.gen)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=read_loop, args=(i,), daemon=True) for i in range(RACING_READERS)]
    for t in threads:
        t.start()
    try:
        gen = None
        for rnd in range(REWRITE_ROUNDS + 1):
            if rnd:
                writer = s.nodes[rnd % len(s.nodes)]
                wait_done(s, s.invalidate(writer, s.ns, "key", key), [key])
                data = _different_payload(s, data)
                gen = _rewrite(s, writer, key, data).gen
            deadline = time.monotonic() + INVALIDATION_SLACK * s.term_s
            while not errors:
                with lock:
                    seen = gen is None and bool(read_gens) or gen in read_gens
                if seen:
                    break
                s.check(time.monotonic() < deadline, "caching",
                        f"no racing reader read {'the first generation' if gen is None else f'generation {gen}'} "
                        f"within {INVALIDATION_SLACK} terms of its commit")  # fmt: skip
                s.sleep_ms(s.lease_term_ms / 50)
            if errors:
                break
    finally:
        stop.set()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    read_back(s, reader(s, w), key, data, "the last rewrite after the race")


BODIES["rewrite_racing_readers"] = rewrite_racing_readers


# -- a commit racing an invalidation (KVCC-INVAL-014) -----------------------------------------------

# Where the invalidation starts, as a fraction of a lease term after the commit started (negative:
# before it): the moment a commit lands at the directory is the adapter's own, so the rounds spread
# the invalidation over the commit's whole call, from just before it to well after it landed.
COMMIT_RACE_OFFSETS = (-0.01, 0.0, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08)


def _race(first: Callable[[], object], second: Callable[[], object], delay_s: float) -> tuple[object, object]:
    """Run ``first`` and, ``delay_s`` after it started, ``second`` -- each on its own thread,
    released together -- and return both answers (an exception in either is raised here)."""
    answers: list[object] = [None, None]
    errors: list[BaseException] = []
    go = threading.Barrier(2)

    def run(i: int, call: Callable[[], object], wait_s: float) -> None:
        try:
            go.wait()
            if wait_s > 0:
                time.sleep(wait_s)
            answers[i] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            errors.append(e)

    threads = [threading.Thread(target=run, args=(0, first, 0.0), daemon=True),
               threading.Thread(target=run, args=(1, second, delay_s), daemon=True)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return answers[0], answers[1]


def _granted_nowhere(s: Session, nodes: Sequence[str], key: BlockKey, what: Callable[[str, ReadGrant], str]) -> None:
    """No node of ``nodes`` is granted ``key`` (a grant is given back at once): FAIL NoStaleRead
    with ``what(node, grant)`` otherwise."""
    for node in nodes:
        got = s.acquire(node, s.ns, key)
        if isinstance(got, ReadGrant):
            s.release(got)
            s.check(False, "NoStaleRead", what(node, got))


def commit_racing_invalidation(s: Session) -> None:
    """A fresh block's commit and an invalidation of its key, sent at once from two nodes, round
    after round with the invalidation a little earlier or later each time. Whatever the order the
    directory took them in, the outcome MUST be one of the two orders: the invalidation counted
    the block (the commit landed first) and, once complete, no node is granted it and lookup does
    not count it; or it did not (it came first, the block was only being written) and the commit,
    if accepted, reads back exactly. An invalidation that counted a block whose commit was
    refused, a block acknowledged and then lost, or a voided block granted again fail."""
    w = s.nodes[0]
    other = reader(s, w)
    for offset in COMMIT_RACE_OFFSETS:
        key = chain(s, 1)[0]
        g = s.begin_write(w, s.ns, key, None)
        s.check(isinstance(g, WriteGrant), "write", f"begin_write of a fresh key refused: {g}")
        data = s.payload()
        s.check(isinstance(s.write_bytes(g, data), Stored), "write", "write_bytes under a fresh grant refused")
        delay_s = abs(offset) * s.lease_term_ms / 1000
        commit = lambda g=g: s.commit(g)  # noqa: E731
        invalidate = lambda key=key: s.invalidate(other, s.ns, "key", key)  # noqa: E731
        if offset < 0:
            ticket, c = _race(invalidate, commit, delay_s)
        else:
            c, ticket = _race(commit, invalidate, delay_s)
        counted = ticket.keys > 0
        committed = isinstance(c, Committed)
        s.check(committed or not counted, "NoDirtyRead",
                f"an invalidation counted {ticket.keys} block(s) of a key whose only commit was refused ({c})")  # fmt: skip
        wait_done(s, ticket, [key] if counted else [])
        where = f"(the invalidation started {offset * s.lease_term_ms:+.1f} ms after the commit)"
        if counted:
            n = s.lookup(other, s.ns, [key])
            s.check(n == 0, "NoStaleRead", f"lookup counted a block its completed invalidation had counted {where}")
            _granted_nowhere(s, (w, other), key, lambda node, g: f"generation {g.gen} was granted on {node} after the "
                             f"invalidation that counted it completed {where}")  # fmt: skip
        elif committed:
            read_back(s, other, key, data, f"a block committed after a racing invalidation that did not count it {where}")
            s.check(s.lookup(w, s.ns, [key]) == 1, "caching",
                    f"lookup did not count a block committed after a racing invalidation {where}")  # fmt: skip
        else:
            got = s.acquire(other, s.ns, key)
            if isinstance(got, ReadGrant):
                s.release(got)
            s.check(not isinstance(got, ReadGrant), "LeasesGrantedOnlyOnCommitted",
                    f"a block whose commit was refused ({c}) was granted {where}")  # fmt: skip


BODIES["commit_racing_invalidation"] = commit_racing_invalidation


# -- tenant isolation where the bytes live (KVCC-FAULT-016) ------------------------------------------------


def _answer(got: object) -> str:
    return f"{len(got)} bytes" if isinstance(got, bytes) else repr(got)[:80]


def outsider_refused_at_the_location(s: Session) -> None:
    """An outsider -- a principal the directory granted nothing -- asks the location of a committed
    block, under a reader's live lease, for its bytes and to overwrite them, and the location of a
    fresh write, under the writer's live grant, to store its own bytes there: with no grant, a forged
    one and the owner's own (``Adapter.intrude``). Every request MUST be refused; the owner's bytes
    MUST then read back exactly, and the writer's write MUST land and commit as if no one had asked."""
    w = s.nodes[0]
    other = reader(s, w)
    key = chain(s, 1)[0]
    data = put(s, w, key, None)
    g = s.acquire(other, s.ns, key)
    s.check(isinstance(g, ReadGrant), "caching", f"acquire of a committed block refused: {g}")
    for how in INTRUSIONS:
        got = s.intrude(g, how)
        s.check(isinstance(got, Refused), "data_plane_grant",
                f"an outsider presenting {how} grant at {g.location} was served {_answer(got)}")  # fmt: skip
        got = s.intrude(g, how, bytes(len(data)))
        s.check(isinstance(got, Refused), "data_plane_grant",
                f"an outsider presenting {how} grant at {g.location} overwrote the block: {_answer(got)}")  # fmt: skip
    got = s.read(g)
    s.check(got == data, "CommittedBytesIntact", f"the owner's read after the outsider's requests answered {_answer(got)}")
    s.release(g)
    fresh = chain(s, 1)[0]
    wg = s.begin_write(w, s.ns, fresh, None)
    s.check(isinstance(wg, WriteGrant), "write", f"begin_write of a fresh key refused: {wg}")
    mine = s.payload()
    for how in INTRUSIONS:
        got = s.intrude(wg, how, s.payload(len(mine)))
        s.check(isinstance(got, Refused), "data_plane_grant",
                f"an outsider presenting {how} write grant at {wg.location} stored its bytes: {_answer(got)}")  # fmt: skip
    stored = s.write_bytes(wg, mine)
    s.check(isinstance(stored, Stored), "write", f"the writer's own bytes after the outsider's were refused: {stored}")
    c = s.commit(wg)
    s.check(isinstance(c, Committed), "write", f"the writer's commit after the outsider's bytes was refused: {c}")
    read_back(s, other, fresh, mine, "a block an outsider tried to write first")


BODIES["outsider_refused_at_the_location"] = outsider_refused_at_the_location


# -- overload beyond the deployment's limits (KVCC-TIER-006) ------------------------------------------------

OVERLOAD_MAX_BLOCKS = 4096  # the most blocks the overload test writes (``Capabilities.capacity_bytes``)
OVERLOAD_BLOCK_BYTES = 4096  # the block size when an adapter declares none (``Capabilities.block_bytes``)
OVERLOAD_SAMPLE = 224  # committed blocks read back afterwards, beside the first and last written
OVERLOAD_ENDS = 16


def _overload_bytes(key: BlockKey, size: int) -> bytes:
    """A block's bytes, a function of its key: distinct per block, checked without keeping them."""
    return (key.digest * (size // len(key.digest) + 1))[:size]


def overload_refused_cleanly(s: Session) -> None:
    """Every node writes at once, fresh blocks of the largest size, twice what the deployment
    declares it holds: each request MUST be answered -- stored and committed, or refused with a
    reason, never an error -- and the overload MUST show (refusals, or blocks no longer found);
    afterwards every committed block the directory still grants MUST read back exactly: a block the
    deployment dropped to make room without telling the directory is a committed block lost."""
    caps = s.adapter.capabilities()
    if caps.capacity_bytes <= 0:
        raise NotSupported("capacity_bytes (declare what the deployment holds)")
    size = caps.block_bytes or OVERLOAD_BLOCK_BYTES
    blocks = -(-2 * caps.capacity_bytes // size)
    if blocks > OVERLOAD_MAX_BLOCKS:
        raise NotSupported(f"capacity_bytes: twice {caps.capacity_bytes} is over {OVERLOAD_MAX_BLOCKS} blocks of {size} bytes")
    keys = [chain(s, 1)[0] for _ in range(blocks)]
    lock = threading.Lock()
    committed: list[int] = []
    refusals: dict[str, int] = {}

    def refused(reason: str) -> None:
        with lock:
            refusals[reason] = refusals.get(reason, 0) + 1

    n = len(s.nodes)
    errors: list[BaseException] = []

    def writer(j: int) -> None:
        try:
            write(s.nodes[j], range(j, blocks, n))
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)

    def write(node: str, mine: range) -> None:
        for i in mine:
            key = keys[i]
            g = s.begin_write(node, s.ns, key, None)
            if isinstance(g, Refused):
                refused(g.reason)
                continue
            r = s.write_bytes(g, _overload_bytes(key, size))
            if isinstance(r, Refused):
                refused(r.reason)
                s.abort(g)
                continue
            c = s.commit(g)
            if isinstance(c, Committed):
                with lock:
                    committed.append(i)
            else:
                refused(c.reason)

    if s.infer:
        # Inferred events: the suite runs one operation at a time anyway (``_ordered``), so the
        # nodes take turns block by block -- in threads, a write's grant and its bytes would sit
        # behind the other threads' operations, long enough on a loaded machine for its lease to
        # run out, and every such write would be refused, not overloaded.
        for i in range(blocks):
            write(s.nodes[i % n], range(i, i + 1))
    else:
        run_threads(writer, n)
    if errors:
        raise errors[0]
    committed.sort()
    r = reader(s, s.nodes[0])
    gone = [i for i in committed if s.lookup(r, s.ns, [keys[i]]) == 0]
    what = f"{blocks} blocks of {size} bytes from {n} nodes at once (twice the declared {caps.capacity_bytes} bytes)"
    s.check(bool(refusals or gone), "overload",
            f"{what}: every block was stored and is still found -- the deployment holds more than it declares")  # fmt: skip
    rest = committed[OVERLOAD_ENDS:-OVERLOAD_ENDS]
    sample = committed[:OVERLOAD_ENDS] + s.rng.sample(rest, min(OVERLOAD_SAMPLE, len(rest))) + committed[-OVERLOAD_ENDS:]
    for i in sorted(set(sample)):
        g, got = _leased_read(s, r, keys[i], f"block #{i} of the overload", "overload")
        if not isinstance(g, ReadGrant):
            continue  # evicted to make room, through the directory
        s.check(got == _overload_bytes(keys[i], size), "overload",
                f"block #{i} of the overload, committed and still granted, read {got!r:.60} ({what}; "
                f"{len(committed)} committed, {len(gone)} no longer found, refusals {refusals})")  # fmt: skip


BODIES["overload_refused_cleanly"] = overload_refused_cleanly


# -- a node killed while a block's bytes land (KVCC-FAULT-017) -----------------------------------------

KILL_BLOCK_BYTES = 1 << 20  # the block a kill cuts short (at most the adapter's ``block_bytes``)
# When the kill comes: that many ms after ``write_bytes`` started (racing it), or (None) right after
# the block's commit was accepted -- where a store that acknowledged bytes not yet on its medium
# still has them in flight.
KILL_OFFSETS_MS: tuple[float | None, ...] = (0.0, 0.5, 1.5, None)


def _or_error(call: Callable[[], object]) -> object:
    """``call()``, or the ``AdapterError`` it raised: an operation of a node killed under it may fail."""
    try:
        return call()
    except AdapterError as e:
        return e


def killed_mid_write(s: Session) -> None:
    """The node holding a fresh block's location (the writer, for a location on no node) is
    killed while the block's bytes land -- racing ``write_bytes`` at several offsets, and right
    after the commit was accepted -- and restarted. No read on any node may then return bytes
    other than the block's own, and those only if its commit was accepted (the session judges
    every read's bytes against what was committed); the key MUST take a new block from another
    node within the bound of a write lease (after an invalidation, where the first block
    survived), which MUST read back exactly. With inferred events the suite runs one operation
    at a time, so the kill comes between calls."""
    if len(s.nodes) < 2:
        raise _not_applicable("needs two nodes")
    caps = s.adapter.capabilities()
    size = min(caps.block_bytes or KILL_BLOCK_BYTES, KILL_BLOCK_BYTES)
    w = s.nodes[0]
    for offset in KILL_OFFSETS_MS:
        key = chain(s, 1)[0]
        g = s.begin_write(w, s.ns, key, None)
        s.check(isinstance(g, WriteGrant), "write", f"begin_write of a fresh key refused: {g}")
        assert isinstance(g, WriteGrant)
        host = location_host(g.location)
        victim = host if host in s.nodes else w
        other = reader(s, victim)
        data = s.payload(size)
        when = "right after its commit" if offset is None else f"{offset} ms into its write_bytes"
        committed = False
        if offset is None or s.infer:
            # A refusal (a write lease that ran out on a stalled machine) is no failure here: the
            # kill then comes after a write that did not commit, which the checks below cover too.
            stored = s.write_bytes(g, data)
            committed = isinstance(stored, Stored) and isinstance(s.commit(g), Committed)
            s.fault("kill", victim)
        else:
            stored, _ = _race(lambda: _or_error(lambda: s.write_bytes(g, data)), lambda: s.fault("kill", victim),
                              offset / 1000)  # fmt: skip
        s.fault("restart", victim)
        if not committed and isinstance(stored, Stored) and victim != w:
            # The writer lived on: its commit of bytes whose location restarted meanwhile is taken
            # only if the bytes survived (the read-back below judges them), refused otherwise.
            committed = isinstance(s.commit(g), Committed)
        where = f"(its location's node {victim} killed {when}, then restarted)"
        for node in s.nodes:
            got = s.acquire(node, s.ns, key)
            if not isinstance(got, ReadGrant):
                continue
            b = s.read(got)  # bytes of no commit fail in the session itself
            s.release(got)
            s.check(not isinstance(b, bytes) or (committed and b == data), "CommittedBytesIntact",
                    f"a read on {node} of a block {where} answered {len(b) if isinstance(b, bytes) else 0} bytes "
                    f"that are not the committed block's")  # fmt: skip
        g2 = _handed_over(s, other, key, data, f"a block {where}")
        new = s.payload(size)
        s.check(isinstance(s.write_bytes(g2, new), Stored), "write", f"write_bytes of a new block of a key {where} refused")
        s.check(isinstance(s.commit(g2), Committed), "write", f"commit of a new block of a key {where} refused")
        read_back(s, victim, key, new, f"a new block of a key {where}")


BODIES["killed_mid_write"] = killed_mid_write


# -- an invalidation racing a tier transfer (KVCC-TIER-007) ----------------------------------------------

# When the invalidation starts, in fractions of a term after the transfer was asked for (negative:
# before): before the transfer, between its start and its copy, around the copy landing, after it.
TRANSFER_RACE_OFFSETS = (-0.005, 0.0, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.12)
DESTINATION_DOWN_MS = 100  # how long a transfer's destination is paused or down (at most a tenth of a term)


def _moved_copy_serves(s: Session, node: str, key: BlockKey, data: bytes) -> str:
    """Acquire, read and release ``key`` on ``node``; the read MUST return exactly ``data``.
    Returns the location the lease named."""
    g = s.acquire(node, s.ns, key)
    s.check(isinstance(g, ReadGrant), "caching", f"acquire of a committed block being moved refused: {g}")
    got = s.read(g)
    s.check(got == data, "CommittedBytesIntact", f"a leased read at {g.location} of a block being moved answered "
            f"{_answer(got) if not isinstance(got, Refused) else got}")  # fmt: skip
    s.release(g)
    return g.location


def _started_move(s: Session, g: ReadGrant) -> Moving:
    """``move(g)``, which MUST start a transfer (the block is committed and nothing moves it)."""
    m = s.move(g)
    s.check(isinstance(m, Moving), "transfer_race", f"a transfer of a committed block was not started: {m}")
    return m


def _await_moved_copy(s: Session, m: Moving, node: str, key: BlockKey, data: bytes) -> None:
    """Read ``key`` on ``node`` until the lease names the transfer's destination (its copy is the
    one read, with exactly ``data``); FAIL ``transfer_race`` past the poll's deadline."""
    poll_until(s, lambda: _moved_copy_serves(s, node, key, data), lambda at: at == m.destination, "transfer_race",
               f"the transfer to {m.destination} did not make its copy the one read")  # fmt: skip


def _freed_in_time(s: Session, ended: dict[str, int], within_ms: float, what: str, location: str | None = None,
                   rule: str = "transfer_race") -> None:
    """Every location the native trace shows holding a generation of ``ended`` (key hex ->
    generation) -- or only ``location`` -- MUST free it within ``within_ms`` (and, where the
    adapter declares ``frees_acknowledged``, see the free settled): FAIL ``rule`` with ``what``
    otherwise."""
    from .oracles import unfreed_locations

    caps = s.adapter.capabilities()
    deadline = time.monotonic() + within_ms / 1000
    while True:
        left = [x for x in unfreed_locations(s.adapter.events() or [], ended, caps.frees_acknowledged)
                if location is None or x.split("@", 1)[1].split(" ")[0] == location]  # fmt: skip
        if not left:
            return
        s.check(time.monotonic() < deadline, rule,
                f"{', '.join(left)}: {what} not freed (or the free never settled) within {caps.free_bound_ms} ms "
                f"(free bound) + one term")  # fmt: skip
        s.sleep_ms(s.lease_term_ms / 10)


def _stale_move_refused(s: Session, g: ReadGrant, node: str, key: BlockKey, data: bytes, m: Moving) -> None:
    """The block, moved once (``m``, asked under ``g``), moved again from where it landed; once
    that copy serves, unless it came back to ``g.location``, a ``move`` under the old grant MUST
    be refused: the copy ``g`` names is gone (a deployment that moves whatever the key's owner is
    would start a third transfer)."""
    g2 = s.acquire(node, s.ns, key)
    s.check(isinstance(g2, ReadGrant), "caching", f"acquire of a moved block refused: {g2}")
    s.check(g2.location == m.destination, "transfer_race",
            f"a lease after the transfer to {m.destination} finished names {g2.location}")  # fmt: skip
    m2 = _started_move(s, g2)
    s.release(g2)
    _await_moved_copy(s, m2, node, key, data)
    if m2.destination != g.location:
        stale = s.move(g)
        s.check(isinstance(stale, Refused), "transfer_race",
                f"a move under a grant on {g.location}, after the block moved on to {m.destination} and then "
                f"{m2.destination}, answered {stale}: the copy it names is gone")  # fmt: skip


def _rewritten_move_refused(s: Session, w: str, other: str) -> None:
    """A block invalidated and written again by the same writer: a ``move`` under a grant on its
    first generation MUST be refused -- the generation it names is gone, even where the new one
    sits at the same location (a deployment that moves whatever the key's owner holds moves the
    new bytes under the old grant)."""
    key = chain(s, 1)[0]
    data = put(s, w, key, None)
    g = read_back(s, other, key, data, "a block about to be rewritten")
    wait_done(s, s.invalidate(other, s.ns, "key", key), [key])
    new = _different_payload(s, data)
    g2 = _rewrite(s, w, key, new)
    stale = s.move(g)
    same = ", at the same location" if g2.location == g.location else ""
    s.check(isinstance(stale, Refused), "transfer_race",
            f"a move under a grant on generation {g.gen} of a block rewritten since (generation {g2.gen}{same}) "
            f"answered {stale}: the generation it names is gone")  # fmt: skip
    read_back(s, other, key, new, "a rewritten block, after a move under its first generation's grant")


def _destination_down_for_a_moment(s: Session, w: str, other: str, down: str, up: str, *,
                                   within_a_node: bool) -> tuple | None:  # fmt: skip
    """A fresh block, moved (``move``), its destination's node put ``down`` (``pause``/``kill``)
    as soon as the transfer started and brought ``up`` again a moment later: ``(key, data,
    Moving)``, or ``None`` where the adapter has no such faults, the destination is a shared
    location, or -- unless ``within_a_node`` -- it is on the source's node."""
    if not {down, up} <= s.adapter.capabilities().faults:
        return None
    key = chain(s, 1)[0]
    data = put(s, w, key, None)
    m = _started_move(s, read_back(s, other, key, data, "a block about to be moved"))
    dest = location_host(m.destination)
    if dest not in s.nodes or (dest == location_host(m.source) and not within_a_node):
        return None
    s.fault(down, dest)
    try:
        s.sleep_ms(min(DESTINATION_DOWN_MS, s.lease_term_ms / 10))
    finally:
        s.fault(up, dest)
    return key, data, m


def _transfer_outlives_a_paused_destination(s: Session, w: str, other: str) -> None:
    """A transfer whose destination's node is paused as soon as it started, for a moment, MUST
    still finish once the node resumes -- its copy then the one read, with exactly the block's
    bytes (a copy that arrives at a paused node is delayed, not dropped)."""
    moved = _destination_down_for_a_moment(s, w, other, "pause", "resume", within_a_node=True)
    if moved is not None:
        key, data, m = moved
        _await_moved_copy(s, m, other, key, data)


def _transfer_to_a_killed_destination(s: Session, w: str, other: str) -> None:
    """A transfer whose destination's node is killed as soon as it started, then restarted, lands
    nothing there (a killed process stores nothing: the trace judges it) and leaves the block with
    its source, which MUST still serve its exact bytes."""
    moved = _destination_down_for_a_moment(s, w, other, "kill", "restart", within_a_node=False)
    if moved is not None:
        key, data, m = moved
        read_back(s, w, key, data, f"a block whose transfer to {m.destination} lost its destination to a kill")


def _transfer_to_a_destination_declared_down(s: Session, w: str, other: str) -> None:
    """A transfer whose destination's node is killed as soon as it started and stays down past
    its failure-detection time (``KVCC-FAULT-018``: a lease term), so that the directory declares
    it down: the transfer MUST be given up -- the block served on, exactly, by its source -- and
    once the node is back, the transfer being over, a new ``move`` of the block MUST start and
    its copy MUST become the one read, with exactly the block's bytes."""
    caps = s.adapter.capabilities()
    if not {"kill", "restart"} <= caps.faults:
        return
    key = chain(s, 1)[0]
    data = put(s, w, key, None)
    m = _started_move(s, read_back(s, other, key, data, "a block about to be moved"))
    dest = location_host(m.destination)
    if dest not in s.nodes or dest == location_host(m.source):
        return
    reader_node = next((n for n in s.nodes if n != dest), w)
    s.fault("kill", dest)
    try:
        s.sleep_ms(1.5 * s.lease_term_ms + 2 * s.skew_ms)  # past the detection time: declared down
        g = read_back(s, reader_node, key, data, f"a block whose transfer's destination {m.destination} was declared down")
    finally:
        s.fault("restart", dest)
    m2 = _started_move(s, g)
    _await_moved_copy(s, m2, reader_node, key, data)


def _no_move_from_a_killed_node(s: Session, w: str, other: str) -> None:
    """Where the adapter can kill and restart nodes: a ``move`` under a grant whose location's
    node is killed MUST raise ``AdapterError`` (the contract: the location's node is down) --
    never start a transfer from a copy nobody can serve."""
    if not {"kill", "restart"} <= s.adapter.capabilities().faults:
        return
    key = chain(s, 1)[0]
    data = put(s, w, key, None)
    g = read_back(s, other, key, data, "a block about to be moved")
    victim = location_host(g.location)
    if victim not in s.nodes:  # a shared location: no node to kill
        return
    s.fault("kill", victim)
    try:
        m = s.move(g)
    except AdapterError:
        m = None
    finally:
        s.fault("restart", victim)
    s.check(m is None, "transfer_race", f"a move under a grant on {g.location}, whose node {victim} was killed, "
            f"answered {m} (the contract: AdapterError)")  # fmt: skip


def invalidation_racing_transfer(s: Session) -> None:
    """A committed block's tier transfer (``Adapter.move``) and an invalidation of its key, sent
    at once from two nodes, round after round with the invalidation a little earlier or later
    each time; then a transfer left to finish, whose destination MUST then serve the block's exact
    bytes and whose source MUST free them within the deletion bound once the lease a reader held on
    it across the transfer is released, then invalidated; then one no reader holds, asked twice in
    a row -- the second ``move`` MUST be refused (a transfer of the block is under way, or its copy
    left ``grant.location``) -- whose source MUST be freed within the bound by the transfer's own
    end (no lease release is left to trigger it), then moved on again, after which a ``move``
    under the first grant MUST be refused unless the block came back to its location, then
    invalidated; where the adapter can pause nodes, a transfer whose destination is paused as it
    starts MUST finish once it resumes; and, where it can kill nodes, a transfer whose
    destination on another node is killed as it starts MUST leave the block served by its source,
    and a ``move`` under a grant whose node was killed MUST raise ``AdapterError``. Once each invalidation
    completed, lookup MUST NOT count the
    block and no node may be granted it; and, within the deployment's deletion bound, every
    location the trace shows holding that generation -- the transfer's source and, wherever the
    copy landed, its destination -- MUST free it (a copy landing after the invalidation MUST be
    fenced or freed)."""
    from .contract import deletion_deadline_ms

    caps = s.adapter.capabilities()  # native events: ``Capabilities`` refuses move with inferred ones
    after_end_ms, _ = deletion_deadline_ms(s.lease_term_ms, s.skew_ms, caps.free_bound_ms)
    w = s.nodes[0]
    other = reader(s, w)
    ended: dict[str, int] = {}  # key hex -> the generation its invalidation ended
    # None: the transfer is left to finish first, a reader holding the source across it; "unread":
    # likewise with no reader, and a second move of the block asked for at once.
    for offset in TRANSFER_RACE_OFFSETS + (None, "unread"):
        key = chain(s, 1)[0]
        data = put(s, w, key, None)
        g = read_back(s, other, key, data, "a block about to be moved")
        where = "after the transfer finished" if offset is None or offset == "unread" else \
            f"{offset * s.lease_term_ms:+.1f} ms after the transfer was asked for"
        invalidate = lambda key=key: s.invalidate(other, s.ns, "key", key)  # noqa: E731
        if offset == "unread":
            m = _started_move(s, g)
            again = s.move(g)
            s.check(isinstance(again, Refused), "transfer_race",
                    f"a second move of a block, asked for as its transfer to {m.destination} had just started, answered "
                    f"{again}: a transfer of it was under way, or its copy had left {g.location}")  # fmt: skip
            _await_moved_copy(s, m, other, key, data)
            _freed_in_time(s, {key.hex: g.gen}, after_end_ms, "the bytes of a finished transfer's source, which no "
                           "reader held,", location=m.source)  # fmt: skip
            _stale_move_refused(s, g, other, key, data, m)
            ticket = invalidate()
        elif offset is None:
            held = s.acquire(w, s.ns, key)  # a reader of the source copy across the transfer
            s.check(isinstance(held, ReadGrant), "caching", f"acquire of a committed block refused: {held}")
            m = _started_move(s, g)
            _await_moved_copy(s, m, other, key, data)
            got = s.read(held)  # the drained source lives on under its lease (protocol property 5)
            ran_out = isinstance(got, Refused) and got.reason in LEASE_RAN_OUT  # a loaded machine: cannot look
            s.check(got == data or ran_out, "NoReclaimUnderLease",
                    f"a read under a lease on the source of a finished transfer answered {_answer(got)}")  # fmt: skip
            # A renewal of that lease: the copy it names is no longer the owner (the spec refuses it,
            # not_owner; the trace must then show the directory's refusal, as for every refusal only
            # a directory can give).
            renewed = s.renew(held)
            held = renewed if isinstance(renewed, ReadGrant) else held
            s.release(held)
            _freed_in_time(s, {key.hex: g.gen}, after_end_ms, "the bytes of a finished transfer's source, once no "
                           "reader held them,", location=m.source)  # fmt: skip
            ticket = invalidate()
        elif offset < 0:
            ticket, m = _race(invalidate, lambda g=g: s.move(g), -offset * s.lease_term_ms / 1000)
        else:
            m, ticket = _race(lambda g=g: s.move(g), invalidate, offset * s.lease_term_ms / 1000)
        s.check(ticket.keys == 1, "caching", f"an invalidation of a committed block counted {ticket.keys} blocks ({where})")
        wait_done(s, ticket, [key])
        ended[key.hex] = g.gen
        s.check(s.lookup(other, s.ns, [key]) == 0, "NoStaleRead",
                f"lookup counted a block whose invalidation completed (it started {where})")  # fmt: skip
        _granted_nowhere(s, (w, other), key, lambda node, g: f"a block whose invalidation completed was granted on "
                         f"{node} at {g.location} (it started {where})")  # fmt: skip
    events = s.adapter.events() or []
    s.check(any(e.get("event") == "store_copy" and e.get("key") == key.hex for e in events), "trace_complete",
            f"a transfer whose copy was read at its destination logged no store_copy for {key.hex[:16]}")  # fmt: skip
    _transfer_outlives_a_paused_destination(s, w, other)
    _transfer_to_a_killed_destination(s, w, other)
    _transfer_to_a_destination_declared_down(s, w, other)
    _no_move_from_a_killed_node(s, w, other)
    _rewritten_move_refused(s, w, other)
    _freed_in_time(s, ended, after_end_ms, "a voided generation's bytes, once its invalidation completed,")


BODIES["invalidation_racing_transfer"] = invalidation_racing_transfer


# -- engine: what only a serving engine shows -------------------------------------------------------
# The first test namespace is the test's; the second is where an engine computes a prompt from
# scratch (its tenant has nothing cached), the output every other serving of it must equal.

ENGINE_PROMPT_BLOCKS = 6  # full blocks of a prompt (plus a partial block: every full one can be loaded)
ENGINE_KILL_BLOCKS = 24  # a longer prompt, so that a kill can land while its blocks are saved
ENGINE_KILL_SPAN = (0.3, 1.1)  # the kill's moment, in fractions of the time serving the prompt takes
ENGINE_MAX_TOKENS = 8
ENGINE_SAVE_TRIES = 3  # servings of a prompt until its blocks are all committed (``_served_and_saved``)
ENGINE_INVALIDATION_TIMEOUT_S = 60.0


def _two_engines(s: Session) -> tuple[str, str]:
    names = list(s.engine("engines"))
    if len(names) < 2:
        raise _not_applicable("needs two engines")
    return names[0], names[1]


def _engine_prompt(s: Session, blocks: int) -> tuple[list[int], Namespace, list[BlockKey]]:
    """A fresh prompt of ``blocks`` full blocks and a partial one, its engine namespace and keys."""
    ens, _ = s.engine("engine_keys", s.ns, [])
    bt = ens.block_tokens
    tokens = [s.rng.randrange(3, ENGINE_VOCAB) for _ in range(blocks * bt + 1 + s.rng.randrange(bt - 1))]
    ens, keys = s.engine("engine_keys", s.ns, tokens)
    if len(keys) != blocks:
        raise AdapterError(f"engine_keys gave {len(keys)} keys for a prompt of {blocks} full blocks")
    return tokens, ens, keys


def _computed(s: Session, engine: str, tokens: list[int]) -> Completion:
    """``engine``'s output for the prompt computed without the cache (in the second namespace)."""
    out = s.engine("complete", engine, s.namespaces[1], tokens, ENGINE_MAX_TOKENS)
    s.check(out.loaded_blocks == 0 and out.cached_tokens == 0, "NamespaceIsolation",
            f"engine {engine} served a prompt new to its namespace with {out.cached_tokens} tokens cached, "
            f"{out.loaded_blocks} blocks loaded")  # fmt: skip
    return out


def _served_and_saved(s: Session, engine: str, tokens: list[int], ens: Namespace, keys: list[BlockKey]) -> Completion:
    """``engine`` serves the prompt in the test namespace until every full block of it is
    committed; the last serving's output. A save is the engine's best effort, not a rule of the
    protocol: a write lease that runs out while a loaded machine starves the engine's saver loses
    the block (its commit refused), and the engine computes it the next time. So the engine forgets
    the prompt and serves it again (loading the committed prefix, computing and saving the rest),
    up to ``ENGINE_SAVE_TRIES`` servings, before the test calls its blocks not cached."""
    for attempt in range(ENGINE_SAVE_TRIES):
        if attempt:
            s.engine("forget", engine)
        out = s.engine("complete", engine, s.ns, tokens, ENGINE_MAX_TOKENS)
        n = s.lookup(s.nodes[0], ens, keys)
        if n == len(keys):
            return out
    s.check(False, "caching", f"{n} of a prompt's {len(keys)} full blocks committed after engine {engine} served "
            f"it {ENGINE_SAVE_TRIES} times")  # fmt: skip
    return out


def _same_output(s: Session, got: Completion, computed: Completion, what: str) -> None:
    why = got.differs_from(computed)
    s.check(not why, "CommittedBytesIntact", f"{what}: the output differs from the one computed without the cache: {why}")


def engine_prefix_reuse(s: Session) -> None:
    """Engine A computes a prompt; every full block is committed; B serving the same prompt in
    the other namespace loads nothing (the output computed without the cache); then B (which
    never saw it in this namespace) and A (once it forgot it) load every block and give that output."""
    a, b = _two_engines(s)
    tokens, ens, keys = _engine_prompt(s, ENGINE_PROMPT_BLOCKS)
    first = _served_and_saved(s, a, tokens, ens, keys)
    # The same prompt in the other namespace (another tenant's cache salt) finds nothing of them.
    computed = _computed(s, b, tokens)
    _same_output(s, first, computed, f"engine {a} computing the prompt")
    for engine, what in ((b, "which never saw the prompt"), (a, "after it forgot the prompt")):
        if engine == a:
            s.engine("forget", a)
        got = s.engine("complete", engine, s.ns, tokens, ENGINE_MAX_TOKENS)
        s.check(got.loaded_blocks == len(keys), "caching",
                f"engine {engine}, {what}, loaded {got.loaded_blocks} of the {len(keys)} committed blocks")  # fmt: skip
        _same_output(s, got, computed, f"engine {engine} serving the prompt from the cache, {what}")


def engine_namespace_invalidation(s: Session) -> None:
    """Engine A computes two prompts; their namespace is invalidated, to completion; then B
    serves one and A (having forgotten both) the other: neither loads a block, and both outputs
    are the ones computed without the cache."""
    a, b = _two_engines(s)
    prompts = [_engine_prompt(s, ENGINE_PROMPT_BLOCKS) for _ in range(2)]
    ens = prompts[0][1]
    computed = [_computed(s, b, tokens) for tokens, _, _ in prompts]
    for tokens, _, keys in prompts:
        _served_and_saved(s, a, tokens, ens, keys)
    ticket = s.invalidate(s.nodes[-1], ens, "namespace", None)
    s.check(s.wait_invalidation(ticket, ENGINE_INVALIDATION_TIMEOUT_S), "InvalidationCompletesInTime",
            f"the invalidation of the engines' namespace did not complete within {ENGINE_INVALIDATION_TIMEOUT_S:g} s")  # fmt: skip
    for tokens, _, keys in prompts:
        n = s.lookup(s.nodes[0], ens, keys)
        s.check(n == 0, "NoStaleRead", f"{n} blocks of a prompt still committed after its namespace's invalidation completed")
    s.engine("forget", a)
    for engine, (tokens, _, keys), out in ((b, prompts[0], computed[0]), (a, prompts[1], computed[1])):
        got = s.engine("complete", engine, s.ns, tokens, ENGINE_MAX_TOKENS)
        s.check(got.loaded_blocks == 0, "NoStaleRead",
                f"engine {engine} loaded {got.loaded_blocks} blocks of a namespace whose invalidation completed")  # fmt: skip
        _same_output(s, got, out, f"engine {engine} after the namespace's invalidation")


def engine_killed_mid_save(s: Session) -> None:
    """Engine A is killed while it computes and saves a long prompt, at a random moment. What is
    committed is a prefix of the prompt's blocks (lookup); engine B loads exactly that prefix,
    recomputes the rest and gives the output computed without the cache."""
    a, b = _two_engines(s)
    tokens, ens, keys = _engine_prompt(s, ENGINE_KILL_BLOCKS)
    computed = _computed(s, b, tokens)
    # How long A takes to serve such a prompt (computing and saving it), once warm: the kill
    # lands from before its first save to after its last.
    _computed(s, a, _engine_prompt(s, ENGINE_PROMPT_BLOCKS)[0])
    t0 = time.monotonic()
    _computed(s, a, _engine_prompt(s, ENGINE_KILL_BLOCKS)[0])
    delay = (time.monotonic() - t0) * s.rng.uniform(*ENGINE_KILL_SPAN)
    _race(lambda: _or_error(lambda: s.engine("complete", a, s.ns, tokens, ENGINE_MAX_TOKENS)),
          lambda: s.engine("kill_engine", a), delay)  # fmt: skip
    n = s.lookup(s.nodes[0], ens, keys)
    got = s.engine("complete", b, s.ns, tokens, ENGINE_MAX_TOKENS)
    s.check(got.loaded_blocks == n, "CommittedBytesIntact",
            f"engine {b} loaded {got.loaded_blocks} blocks of a prompt whose committed prefix, after engine {a} was "
            f"killed {delay * 1000:g} ms into serving it, is {n} blocks")  # fmt: skip
    _same_output(s, got, computed, f"engine {b} serving what engine {a} saved before it was killed ({n} blocks)")


def engine_paused_leases_expire(s: Session) -> None:
    """Engine B serves a prompt A computed and is stopped while it holds a read lease for a block
    it is loading, for longer than a lease term plus epsilon; meanwhile the prompt's namespace is
    invalidated (to completion: by expiry of B's lease) and A computes the prompt again. Once B
    resumes, it MUST NOT use what it reads under the lease that ran out: it recomputes that block
    (a load error) and its output is the one computed without the cache; the trace validates
    B's own reads against its leases."""
    a, b = _two_engines(s)
    tokens, ens, keys = _engine_prompt(s, ENGINE_PROMPT_BLOCKS)
    computed = _computed(s, a, tokens)
    s.engine("complete", a, s.ns, tokens, ENGINE_MAX_TOKENS)
    served: list[object] = []
    worker = threading.Thread(target=lambda: served.append(_or_error(
        lambda: s.engine("complete", b, s.ns, tokens, ENGINE_MAX_TOKENS))), daemon=True)  # fmt: skip
    worker.start()
    paused = s.engine("pause_engine_reading", b, ENGINE_INVALIDATION_TIMEOUT_S)
    try:
        s.check(paused, "holder_expiry", f"engine {b} took no read lease to load the prompt A computed")
        s.sleep_ms(s.lease_term_ms + 2 * s.skew_ms)
        ticket = s.invalidate(s.nodes[-1], ens, "namespace", None)
        s.check(s.wait_invalidation(ticket, ENGINE_INVALIDATION_TIMEOUT_S), "InvalidationCompletesInTime",
                "the invalidation did not complete while an engine holding a lease was stopped")  # fmt: skip
        s.engine("forget", a)
        s.engine("complete", a, s.ns, tokens, ENGINE_MAX_TOKENS)
    finally:
        s.engine("resume_engine", b)
    worker.join(ENGINE_INVALIDATION_TIMEOUT_S)
    got = served[0] if served else None
    s.check(isinstance(got, Completion), "engine", f"engine {b} did not finish serving after it resumed: {got}")
    assert isinstance(got, Completion)
    s.check(got.load_errors >= 1, "holder_expiry",
            f"engine {b}, stopped holding a read lease past its term, recomputed no block after it resumed "
            f"({got.loaded_blocks} loaded)")  # fmt: skip
    _same_output(s, got, computed, f"engine {b}, stopped holding a read lease past its term")


def engine_index_after_restart(s: Session) -> None:
    """The index of what each engine holds (built from what the engines announce) shows the
    prompt engine A computed. A restarts and serves another prompt: the index then shows that
    one's blocks, none of the first's (the new process holds none), and the blocks it shows are
    committed. A then serves the first prompt from the cache (every block loaded, output
    unchanged), and the index shows its blocks again."""
    a, b = _two_engines(s)
    old, ens, old_keys = _engine_prompt(s, ENGINE_PROMPT_BLOCKS)
    new, _, new_keys = _engine_prompt(s, ENGINE_PROMPT_BLOCKS)
    computed = _computed(s, b, old)
    s.engine("complete", a, s.ns, old, ENGINE_MAX_TOKENS)
    held = s.engine("engine_index", a, s.ns)
    s.check(set(old_keys) <= held, "caching",
            f"the index shows {len(set(old_keys) & held)} of the {len(old_keys)} blocks engine {a} computed")  # fmt: skip
    s.engine("restart_engine", a)
    s.engine("complete", a, s.ns, new, ENGINE_MAX_TOKENS)
    held = s.engine("engine_index", a, s.ns)
    stale = set(old_keys) & held
    s.check(not stale, "DirectoryDataAgreement",
            f"after engine {a} restarted the index still says it holds {len(stale)} blocks of the old process")  # fmt: skip
    s.check(set(new_keys) <= held, "DirectoryDataAgreement",
            f"the index shows {len(set(new_keys) & held)} of the {len(new_keys)} blocks the restarted engine {a} computed")  # fmt: skip
    n = s.lookup(s.nodes[0], ens, new_keys)
    s.check(n == len(new_keys), "DirectoryDataAgreement",
            f"the index says engine {a} holds all {len(new_keys)} blocks of a prompt; {n} of them are committed")  # fmt: skip
    got = s.engine("complete", a, s.ns, old, ENGINE_MAX_TOKENS)
    s.check(got.loaded_blocks == len(old_keys), "caching",
            f"the restarted engine {a} loaded {got.loaded_blocks} of the {len(old_keys)} committed blocks")  # fmt: skip
    _same_output(s, got, computed, f"the restarted engine {a} serving the prompt from the cache")
    held = s.engine("engine_index", a, s.ns)
    s.check(set(old_keys) <= held, "DirectoryDataAgreement",
            f"the index shows {len(set(old_keys) & held)} of the {len(old_keys)} blocks the restarted engine {a} loaded")  # fmt: skip


BODIES.update(engine_prefix_reuse=engine_prefix_reuse, engine_namespace_invalidation=engine_namespace_invalidation,
              engine_killed_mid_save=engine_killed_mid_save, engine_paused_leases_expire=engine_paused_leases_expire,
              engine_index_after_restart=engine_index_after_restart)
