"""Every property of the protocol, written once as a pure predicate over model states.

Three kinds:

- ``Invariant``: must hold in every reachable state (``always``).
- ``TransitionProperty``: must hold on every step ``(pre, action, post)`` (``always [][P]``).
- ``Sometimes``: must hold in *some* reachable state or step; one per ``always``, so that a model
  which never reaches the situation an invariant talks about fails instead of passing vacuously.

Progress is stated as bounded response, each bound on a ghost age that counts true ticks (the
model's ``ghost.*`` variables, which no step reads): an invalidation completes
(``InvalidationCompletesInTime``) and a write lease ends (``WriteLeaseEndsInTime``) within their
deadlines, also when the directory's clock lags (``ModelConfig.directory_clock_lags``); a lease
request ends within its deadline (``RequestEndsInTime``) and is never left unanswered unless a
message of it was lost (``RequestAnswered``); an ended generation's bytes never sit at a location
that is up with no Free on its way (``DeletionReachesEverywhere``).

Assumptions of the bounded-response properties, exactly: time is true ticks; the directory's
timers (lease expiry, completion, the retry of an owed Free) fire before time passes once due;
messages may be lost, duplicated, reordered and delayed without bound -- so no bound here counts
on a message arriving: a lost or late answer is ended by the holder's timeout, and a lost Free
by the directory's retry (a fair-lossy link then delivers one of the retries: a deployment's
deletion bound is its attempts times its retry interval plus message delay).

The checker, the proofs' re-check of counterexamples, the property tests, the reference's own
assertions and the conformance oracle all call these same functions. Each predicate receives the
``Model`` (for its configuration and layout) and a state (``bytes``).

Numbering follows docs/protocol.md's property list.
"""

from __future__ import annotations

from collections.abc import Callable

from attrs import frozen

from .layout import (
    ABSENT,
    COMMITTED,
    FULL,
    INVALIDATING,
    LOST,
    M_ACK,
    M_ACQUIRE,
    M_BEGIN_WRITE,
    M_COMMIT,
    M_COPY,
    M_GRANT_READ,
    M_GRANT_WRITE,
    M_REFUSE,
    M_RELEASE,
    M_RENEW,
    M_RENEWED,
    M_REVOKE,
    M_WRITE_BYTES,
    MESSAGE_WIDTH,
    NO_LEASE,
    NO_LOCATION,
    P_NONE,
    REFUSED_READ,
    REFUSED_WRITE,
    W_BYTES_SENT,
    W_REQUESTED,
    WRITING,
)
from .config import ModelConfig
from .rules import fence_accepts, slot_accepts
from .model import Model

StatePredicate = Callable[[Model, bytes], bool]
StepPredicate = Callable[[Model, bytes, str, tuple, bytes], bool]


@frozen
class Invariant:
    name: str
    design: str  # which docs/protocol.md property this states
    text: str
    holds: StatePredicate
    kind: str = "safety"  # or "progress"
    # The layout groups (see ``Layout.groups``) and "messages" the predicate reads: the checker
    # skips it on a state whose parent agrees on all of them. Declaring too few is unsound;
    # ``tests/test_spec.py`` re-evaluates every invariant on every state of a configuration.
    reads: tuple[str, ...] = ()


@frozen
class TransitionProperty:
    name: str
    design: str
    text: str
    holds: StepPredicate
    kind: str = "safety"


# Why a configuration's scope cannot contain a situation, as a sentence; None when it can.
ScopeArgument = Callable[[ModelConfig], "str | None"]


def _always_in_scope(cfg: ModelConfig) -> str | None:
    return None


@frozen
class Sometimes:
    name: str
    text: str
    reached_state: StatePredicate | None = None
    reached_step: StepPredicate | None = None
    companion_of: tuple[str, ...] = ()
    # The actions a ``reached_step`` can fire on (empty: any); the checker asks only on those.
    on_actions: tuple[str, ...] = ()
    # As ``Invariant.reads``, for a ``reached_state``: the checker asks it of a new state only
    # when one of these groups changed from the parent, on which it was false (a ``sometimes``
    # is asked until it is reached). Declaring too few could only leave it unreached -- a failed
    # check, never a hidden one; ``tests/test_spec.py`` checks every declaration on random walks.
    reads: tuple[str, ...] = ()
    # The argument, per configuration, that its scope cannot contain this situation. The checker
    # requires every ``sometimes`` this returns None for, and rejects an argument the search
    # refutes (an exempt ``sometimes`` that is reached after all).
    outside_scope: ScopeArgument = _always_in_scope


# --------------------------------------------------------------------------------- helpers


def _trusted(m: Model, s: bytes):
    """Every lease a holder currently trusts: (node, key, lease, location, gen, trust_left)."""
    L = m.L
    if not any(s[L.holder_block]):
        return
    for n in range(m.N):
        for k in range(m.K):
            lease = s[L.h_id[n][k]]
            if lease != NO_LEASE:
                yield n, k, lease, s[L.h_loc[n][k]] - 1, s[L.h_gen[n][k]], s[L.h_left[n][k]]


def _messages(m: Model, s: bytes):
    for i in range(m.L.fixed, len(s), MESSAGE_WIDTH):
        yield s[i : i + MESSAGE_WIDTH]


def _slot_holds(m: Model, s: bytes, loc: int, k: int, gen: int) -> bool:
    """The slot holds exactly generation ``gen`` of ``k`` -- or lost it in a crash, so that a read
    fails instead of returning other bytes."""
    L = m.L
    status = s[L.s_status[loc][k]]
    return status == LOST or (status == FULL and s[L.s_gen[loc][k]] == gen)


def _holder_block(m: Model, s: bytes) -> bool:
    """Fast path: does any holder trust any lease at all?"""
    L = m.L
    return any(s[L.h_id[n][k]] for n in range(m.N) for k in range(m.K))


# --------------------------------------------------------------------------------- invariants


def one_writer_per_generation(m: Model, s: bytes) -> bool:
    """At most one node ever holds the write lease of a key's generation."""
    L = m.L
    seen: dict[tuple[int, int], int] = {}
    for n in range(m.N):
        for k in range(m.K):
            if s[L.w_stage[n][k]] >= W_BYTES_SENT:
                if seen.setdefault((k, s[L.wr_gen[n][k]]), n) != n:
                    return False
    for msg in _messages(m, s):
        if msg[0] == M_GRANT_WRITE:
            if seen.setdefault((msg[2], msg[5]), msg[1]) != msg[1]:
                return False
    return True


def one_owner_per_epoch(m: Model, s: bytes) -> bool:
    """No two locations hold a key's bytes under the same epoch."""
    L = m.L
    for k in range(m.K):
        epochs = [
            s[L.s_epoch[loc][k]]
            for loc in range(m.LOCS)
            if s[L.s_status[loc][k]] == FULL
        ]
        if len(epochs) != len(set(epochs)):
            return False
    return True


def epochs_bound_fences(m: Model, s: bytes) -> bool:
    """The directory's epoch of a key is the highest one anywhere: no fence, stored copy or
    message carries a higher one (so ``epoch + 1`` is always fresh)."""
    L = m.L
    for k in range(m.K):
        top = s[L.epoch[k]]
        for loc in range(m.LOCS):
            if s[L.fence[loc][k]] > top or s[L.s_epoch[loc][k]] > top:
                return False
    for msg in _messages(m, s):
        if msg[0] in (M_GRANT_WRITE, M_WRITE_BYTES, M_COPY) and msg[6] > s[L.epoch[msg[2]]]:
            return False
    return True


def no_dirty_read(m: Model, s: bytes) -> bool:
    """A holder trusts a lease only on a COMMITTED (or still-invalidating) generation."""
    L = m.L
    for _, k, _, _, _, _ in _trusted(m, s):
        if s[L.phase[k]] not in (COMMITTED, INVALIDATING):
            return False
    return True


def committed_bytes_intact(m: Model, s: bytes) -> bool:
    """The committed generation's bytes sit unchanged at its owner (and at a draining copy)."""
    L = m.L
    for k in range(m.K):
        if s[L.phase[k]] in (COMMITTED, INVALIDATING):
            for idx in (L.owner[k], L.draining[k]):
                loc1 = s[idx]
                if loc1 != NO_LOCATION and not _slot_holds(m, s, loc1 - 1, k, s[L.gen[k]]):
                    return False
    return True


def lost_copy_voided_on_rejoin(m: Model, s: bytes) -> bool:
    """A COMMITTED key's owner copy is LOST only while its node is down: a node that rejoins
    without it voids the key (``rules.lost_copy_invalidates``), and a commit of bytes its location
    lost is refused. Otherwise the key stays COMMITTED with no bytes anywhere: every lookup finds
    it, every read misses, and it can never be written again (issue 14: a commit that reached the
    directory after the writer's node restarted without its memory)."""
    L = m.L
    for k in range(m.K):
        if s[L.phase[k]] != COMMITTED or s[L.owner[k]] == NO_LOCATION:
            continue
        loc = s[L.owner[k]] - 1
        node = m.loc_node[loc]
        if node >= 0 and s[L.up[node]] and s[L.s_status[loc][k]] == LOST:
            return False
    return True


def no_reclaim_under_lease(m: Model, s: bytes) -> bool:
    """No location a holder trusts a lease on has been freed, evicted, moved or overwritten."""
    for _, k, _, loc, gen, _ in _trusted(m, s):
        if not _slot_holds(m, s, loc, k, gen):
            return False
    return True


def no_stale_read(m: Model, s: bytes) -> bool:
    """Once an invalidation completed (the generation moved on), nobody trusts the old one."""
    L = m.L
    for _, k, _, _, gen, _ in _trusted(m, s):
        if gen != s[L.gen[k]]:
            return False
    return True


def no_read_after_ack(m: Model, s: bytes) -> bool:
    """A holder that acknowledged a revocation never again trusts (and so reads) that generation:
    a history property, on the ghost set of (node, key) that acked the key's current generation
    -- not only while the acknowledgement is in flight."""
    L = m.L
    for n, k, lease, _, gen, _ in _trusted(m, s):
        if s[L.acked[n][k]] and gen == s[L.gen[k]]:
            return False
    for msg in _messages(m, s):
        if msg[0] == M_ACK and s[L.h_id[msg[1]][msg[2]]] == msg[3]:
            return False
    return True


def lease_ids_fresh(m: Model, s: bytes) -> bool:
    """Every lease id in use anywhere is below the directory's counter: ids are never reused."""
    L = m.L
    top = s[L.next_id]
    for block in L.lease_id_blocks:
        if max(s[block]) >= top:
            return False
    for msg in _messages(m, s):
        if msg[0] in _CARRIES_LEASE and msg[3] >= top:
            return False
    return True


_CARRIES_LEASE = frozenset(
    (M_RENEW, M_GRANT_READ, M_RENEWED, M_RELEASE, M_GRANT_WRITE, M_WRITE_BYTES, M_COMMIT, M_REVOKE, M_ACK)
)


def lease_known_to_directory(m: Model, s: bytes) -> bool:
    """Holder-side validity under skew: whatever a holder trusts, the directory still counts as
    live at least as long (or frees nothing during its restart grace for at least as long)."""
    L = m.L
    grace = s[L.grace]
    for n, k, lease, _, _, left in _trusted(m, s):
        if s[L.r_id[k][n]] == lease and s[L.r_left[k][n]] >= left:
            continue
        if grace >= left:
            continue
        return False
    return True


def directory_data_agreement(m: Model, s: bytes) -> bool:
    """The directory never points a live lease at a location without the leased bytes."""
    L = m.L
    for k in range(m.K):
        gen = s[L.gen[k]]
        for n in range(m.N):
            if s[L.r_id[k][n]] != NO_LEASE:
                loc1 = s[L.r_loc[k][n]]
                if loc1 == NO_LOCATION or not _slot_holds(m, s, loc1 - 1, k, gen):
                    return False
    return True


def prefix_closed(m: Model, s: bytes) -> bool:
    """A written or committed block's parent is committed: a request's blocks form one chain."""
    L = m.L
    for k, parent in enumerate(m.cfg.parents):
        if parent >= 0 and s[L.phase[k]] in (WRITING, COMMITTED) and s[L.phase[parent]] != COMMITTED:
            return False
    return True


def namespace_isolation(m: Model, s: bytes) -> bool:
    """No node holds a lease or a write grant in a namespace its tenant is not authorised for."""
    L = m.L
    for n in range(m.N):
        for k in range(m.K):
            if m.allowed[n][k]:
                continue
            if s[L.r_id[k][n]] or s[L.h_id[n][k]] or s[L.w_stage[n][k]] >= W_BYTES_SENT:
                return False
    return True


def invalidation_completes_in_time(m: Model, s: bytes) -> bool:
    """Bounded response (P1): an invalidation completes within the deadline (term + 2 epsilon,
    plus a grace period per directory restart), acknowledged or not, whichever way the
    directory's clock errs. (Completion waits for no message: message delay adds nothing.)"""
    L = m.L
    return all(s[L.phase_age[k]] <= m.deadline for k in range(m.K) if s[L.phase[k]] == INVALIDATING)


def write_lease_ended_in_time(m: Model, s: bytes) -> bool:
    """Bounded response (P2): a write lease ends -- commit, abort or expiry -- within the write
    deadline of its grant, on the ghost age of the WRITING phase (true ticks)."""
    L = m.L
    return all(s[L.phase_age[k]] <= m.write_deadline for k in range(m.K) if s[L.phase[k]] == WRITING)


def request_ends_in_time(m: Model, s: bytes) -> bool:
    """Bounded response (P3): a holder's lease request ends -- granted, refused, or given up by its
    timeout when a message of it was lost -- within the request deadline (true ticks)."""
    L = m.L
    for n in range(m.N):
        for k in range(m.K):
            if s[L.p_age[n][k]] > m.request_deadline:
                return False
    return True


def request_answered(m: Model, s: bytes) -> bool:
    """P3: a request is never left without an answer: while a holder (or writer) waits, its request
    or the answer (grant or refusal) is in flight -- unless one of them was lost, which only the
    requester's timeout answers."""
    L = m.L
    waiting = []
    for n in range(m.N):
        if not s[L.up[n]]:
            continue
        for k in range(m.K):
            if s[L.p_kind[n][k]] != P_NONE and not s[L.read_lost[n][k]]:
                waiting.append((n, k, s[L.p_id[n][k]]))
            if s[L.w_stage[n][k]] == W_REQUESTED and not s[L.write_lost[n][k]]:
                waiting.append((n, k, -1))
    if not waiting:
        return True
    in_flight = set()
    for msg in _messages(m, s):
        kind, n, k = msg[0], msg[1], msg[2]
        if kind == M_ACQUIRE or (kind == M_REFUSE and msg[4] == REFUSED_READ):
            in_flight.add((n, k, msg[3]))
        elif kind == M_RENEW:
            in_flight.add((n, k, msg[5]))
        elif kind in (M_GRANT_READ, M_RENEWED):
            in_flight.add((n, k, msg[6]))
        elif kind in (M_BEGIN_WRITE, M_GRANT_WRITE) or (kind == M_REFUSE and msg[4] == REFUSED_WRITE):
            in_flight.add((n, k, -1))
    return all(w in in_flight for w in waiting)


def crashed_owner_writable_in_time(m: Model, s: bytes) -> bool:
    """Bounded response (P4): a committed key whose owner copy is on a crashed node is writable
    again (ABSENT) within the failover deadline: detection, then invalidation (ghost age)."""
    L = m.L
    return all(s[L.owner_down_age[k]] <= m.failover_deadline for k in range(m.K))


def deletion_reaches_everywhere(m: Model, s: bytes) -> bool:
    """Deletion reaches everywhere: no location that is up holds an ended generation's bytes for
    longer than the deletion deadline with no Free on its way (ghost age, true ticks). A lost
    Free, a forgotten one, or bytes that land after their Free all leave such an orphan; a down
    location counts from when it is back."""
    L = m.L
    bound = m.deletion_deadline
    for row in L.orphan_age:
        for i in row:
            if s[i] > bound:
                return False
    return True


# --------------------------------------------------------------------------------- steps


def epoch_monotonic(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    """Epochs never decrease: not at the directory, not at a fence (unless that disk was lost)."""
    L = m.L
    if pre[L.epoch_block] == post[L.epoch_block] and pre[L.fence_block] == post[L.fence_block]:
        return True
    for k in range(m.K):
        if post[L.epoch[k]] < pre[L.epoch[k]]:
            return False
    if action == "crash" and params[1] == 1:
        return True
    for k in range(m.K):
        for loc in range(m.LOCS):
            if post[L.fence[loc][k]] < pre[L.fence[loc][k]]:
                return False
    return True


def fencing_holds(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    """Where data lives, new bytes never carry an epoch below the slot's fence."""
    L = m.L
    if pre[L.slot_epoch_block] == post[L.slot_epoch_block]:
        return True
    for k in range(m.K):
        for loc in range(m.LOCS):
            e = L.s_epoch[loc][k]
            if post[e] != pre[e] and post[L.s_status[loc][k]] == FULL and post[e] < pre[L.fence[loc][k]]:
                return False
    return True


def leases_granted_only_on_committed(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    """A lease is granted or extended only on a COMMITTED key: never while writing, never during
    an invalidation (no new leases once it began)."""
    if action in ("clock_forward", "clock_back"):
        return True  # a clock moved (a lagging directory clock lengthens leases); nothing was granted
    L = m.L
    if pre[L.lease_left_block] == post[L.lease_left_block] or action == "tick":
        return True  # a tick only runs leases down
    for k in range(m.K):
        for n in range(m.N):
            r = L.r_left[k][n]
            if post[r] > pre[r] and post[L.phase[k]] != COMMITTED:
                return False
    return True


def renewal_never_revives(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    """A lease-table entry appears only as a fresh grant with a new id: renewal never brings back
    a lease that expired or was revoked."""
    L = m.L
    if pre[L.lease_id_block] == post[L.lease_id_block]:
        return True
    for k in range(m.K):
        for n in range(m.N):
            i = L.r_id[k][n]
            if pre[i] == NO_LEASE and post[i] != NO_LEASE and post[i] != pre[L.next_id]:
                return False
    return True


def write_lease_ends_in_time(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    """The urgency rule itself, as a step predicate: time does not pass a write lease whose term
    is up. Not a property of the checker any more (``WriteLeaseEndsInTime`` is the ghost age);
    kept for callers that map a runtime without ghost ages (``tests/specmap.py``)."""
    if action != "tick":
        return True
    L = m.L
    return not any(pre[L.phase[k]] == WRITING and pre[L.w_left[k]] == 0 for k in range(m.K))


# --------------------------------------------------------------------------------- sometimes


def _remote_read(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    """A read of the leased bytes from another node's tier: not the reader's own, not the pool."""
    if action != "read":
        return False
    n, k, loc = params
    return m.loc_node[loc] >= 0 and m.loc_node[loc] != n and _leased_bytes_there(m, pre, n, k, loc)


def _pool_read(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    if action != "read":
        return False
    n, k, loc = params
    return m.loc_node[loc] < 0 and _leased_bytes_there(m, pre, n, k, loc)


def _leased_bytes_there(m: Model, s: bytes, n: int, k: int, loc: int) -> bool:
    L = m.L
    return s[L.s_status[loc][k]] == FULL and s[L.s_gen[loc][k]] == s[L.h_gen[n][k]]


def _completed_by_acks(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    if action != "revoke_acked":
        return False
    n, k, _ = params
    return pre[m.L.phase[k]] == INVALIDATING and m.has_live_lease(pre, k) and not m.has_live_lease(post, k)


def _completed_by_expiry(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    if action not in ("tick", "clock_forward"):
        return False
    return any(
        pre[m.L.phase[k]] == INVALIDATING and m.has_live_lease(pre, k) and not m.has_live_lease(post, k)
        for k in range(m.K)
    )


def _multi_holder_invalidation(m: Model, s: bytes) -> bool:
    L = m.L
    return any(
        s[L.phase[k]] == INVALIDATING and sum(1 for n in range(m.N) if s[L.r_id[k][n]]) >= 2
        for k in range(m.K)
    )


def _step(name: str) -> StepPredicate:
    return lambda m, pre, action, params, post: action == name


def _trusting_while_invalidating(m: Model, s: bytes) -> bool:
    return any(s[m.L.phase[k]] == INVALIDATING for _, k, *_ in _trusted(m, s))


def _ack_in_flight(m: Model, s: bytes) -> bool:
    return any(msg[0] == M_ACK for msg in _messages(m, s))


def _trust_during_grace(m: Model, s: bytes) -> bool:
    return s[m.L.grace] > 0 and _holder_block(m, s)


def _short_grace_under_trust(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    """A restarted directory takes less than the full grace (its mirrored horizon) while a holder
    still trusts a lease it forgot: the horizon is what keeps that lease safe."""
    return action == "restart_directory" and params[0] < m.restart_grace and _holder_block(m, post)


def _restart_in_grace_under_trust(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    """The directory restarts again while still in a grace, a holder trusting a lease it forgot
    before: the new horizon must cover the old grace."""
    L = m.L
    return action == "restart_directory" and pre[L.grace] > 0 and _holder_block(m, pre) and all(
        not pre[L.r_id[k][n]] for k in range(m.K) for n in range(m.N))


def _child_committed(m: Model, s: bytes) -> bool:
    L = m.L
    return any(p >= 0 and s[L.phase[k]] == COMMITTED for k, p in enumerate(m.cfg.parents))


def _committed_at_owner(m: Model, s: bytes) -> bool:
    L = m.L
    return any(s[L.phase[k]] == COMMITTED and s[L.s_status[s[L.owner[k]] - 1][k]] == FULL for k in range(m.K))


def _two_epochs_stored(m: Model, s: bytes) -> bool:
    L = m.L
    return any(
        len({s[L.s_epoch[loc][k]] for loc in range(m.LOCS) if s[L.s_status[loc][k]] == FULL}) >= 2
        for k in range(m.K)
    )


def _unauthorised_refused(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    return action in ("refuse_read_lease", "refuse_write_lease") and not m.allowed[params[0]][params[1]]


def _crash_handoff(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    if action == "expire_write_lease_of_crashed":
        return True
    if action == "restart_node":
        L = m.L
        return any(pre[L.phase[k]] == COMMITTED and post[L.phase[k]] == INVALIDATING for k in range(m.K))
    return False


def _write_aborted_on_rejoin(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    if action != "restart_node":
        return False
    L = m.L
    return any(pre[L.phase[k]] == WRITING and post[L.phase[k]] == ABSENT for k in range(m.K))


def _renewal(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    return action == "trust_renewal"


def _consumed(m: Model, pre: bytes, post: bytes, kind: int) -> bool:
    """Did the step take a message of ``kind`` off the network?"""
    return sum(1 for msg in _messages(m, pre) if msg[0] == kind) > sum(1 for msg in _messages(m, post) if msg[0] == kind)


def _refusal_answered(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    return action in ("abandon", "abort") and _consumed(m, pre, post, M_REFUSE)


def _request_timed_out(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    if action not in ("tick", "clock_back", "clock_forward"):
        return False
    L = m.L
    return any(
        pre[L.p_kind[n][k]] != P_NONE and post[L.p_kind[n][k]] == P_NONE for n in range(m.N) for k in range(m.K)
    )


def _late_bytes_refused(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    """Bytes of a generation already freed at that slot land late and are refused (the fence
    alone would have taken them)."""
    if action != "fence_stale_write":
        return False
    n, k, loc = params
    L = m.L
    for msg in _messages(m, pre):
        if msg[0] == M_WRITE_BYTES and msg[1] == n and msg[2] == k and msg[4] == loc + 1:
            epoch = msg[6]
            if fence_accepts(epoch, pre[L.fence[loc][k]]) and not slot_accepts(epoch, pre[L.fence[loc][k]], pre[L.freed[loc][k]]):
                return True
    return False


def _owner_declared_down(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    L = m.L
    return action == "declare_node_down" and any(
        pre[L.phase[k]] == COMMITTED and post[L.phase[k]] == INVALIDATING for k in range(m.K)
    )


def _lagging_completion(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    return action == "complete_invalidation" and pre[m.L.dir_off] > 0


def _acquire_refused_uncommitted(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    """An authorised acquire refused because its key is not COMMITTED (being written or
    invalidated): the situation LeasesGrantedOnlyOnCommitted forbids granting in."""
    if action != "refuse_read_lease":
        return False
    n, k = params[0], params[1]
    return m.allowed[n][k] and pre[m.L.phase[k]] in (WRITING, INVALIDATING)


def _fence_at_the_bound(m: Model, s: bytes) -> bool:
    """A slot's fence has reached the directory's epoch for its key: EpochsBoundFences is tight."""
    L = m.L
    return any(0 < s[L.epoch[k]] == s[L.fence[loc][k]] for k in range(m.K) for loc in range(m.LOCS))


def _restart_with_epochs(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    """The directory restarts after handing out an epoch: its log must keep it."""
    return action == "restart_directory" and any(pre[m.L.epoch[k]] for k in range(m.K))


def _writers_race(m: Model, s: bytes) -> bool:
    """Two nodes have asked to write the same key and neither has given up."""
    L = m.L
    return any(sum(1 for n in range(m.N) if s[L.w_stage[n][k]]) >= 2 for k in range(m.K))


def _owner_crashed_while_draining(m: Model, s: bytes) -> bool:
    """A key's owner node is down while its previous copy drains on another node, under a lease
    a third node trusts."""
    L = m.L
    for n, k, _, loc, _, _ in _trusted(m, s):
        owner, draining = s[L.owner[k]] - 1, s[L.draining[k]] - 1
        if owner < 0 or draining != loc:
            continue
        owner_node, draining_node = m.loc_node[owner], m.loc_node[draining]
        if owner_node >= 0 and not s[L.up[owner_node]] and draining_node >= 0 and len({owner_node, draining_node, n}) == 3:
            return True
    return False


def _parent_rewritten_under_cached_child(m: Model, s: bytes) -> bool:
    """A parent's next generation is being written while a holder still trusts its child's
    copy from under the previous one."""
    L = m.L
    for _, k, _, _, _, _ in _trusted(m, s):
        parent = m.cfg.parents[k]
        if parent >= 0 and s[L.phase[parent]] in (WRITING, COMMITTED) and s[L.gen[parent]] > 0:
            return True
    return False


def _namespace_races_key(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    """invalidate(namespace) starts while one of its keys is already being invalidated alone."""
    if action != "invalidate_namespace":
        return False
    return any(pre[m.L.phase[k]] == INVALIDATING for k in m.ns_keys[params[0]])


def _demotion_within_node(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    """Ownership moves between two tiers of one node."""
    if action != "finish_transfer":
        return False
    k, dest = params
    old = pre[m.L.owner[k]] - 1
    return old >= 0 and m.loc_node[old] >= 0 and m.loc_node[old] == m.loc_node[dest]


def _regrant_after_restart(m: Model, pre: bytes, action: str, params: tuple, post: bytes) -> bool:
    """A restarted directory, still in its grace period, grants a read lease again."""
    return action == "grant_read_lease" and pre[m.L.grace] > 0


def _duplicate_in_flight(m: Model, s: bytes) -> bool:
    """The network duplicated a message, and the copy is in flight beside the original (equal
    messages also arise without duplication, e.g. two frees: the budget tells them apart)."""
    if s[m.L.dups_left] == m.cfg.max_duplications:
        return False
    msgs = list(_messages(m, s))
    return len(msgs) != len(set(msgs))


def _three_in_flight(m: Model, s: bytes) -> bool:
    return len(s) - m.L.fixed >= 3 * MESSAGE_WIDTH


# ------------------------------------------------------------------ scope arguments, per config


def _role_count(cfg: ModelConfig, role: tuple[int, ...] | None) -> int:
    return cfg.nodes if role is None else len(role)


def _no_readers(cfg: ModelConfig) -> str | None:
    if _role_count(cfg, cfg.readers) == 0:
        return "no node takes read leases"
    return None


def _no_remote_copy(cfg: ModelConfig) -> str | None:
    if _no_readers(cfg):
        return _no_readers(cfg)
    if cfg.writes_to_pool_only and not cfg.tiering:
        return "every block is written to the shared pool and never moves: no node tier holds a copy"
    writers = set(range(cfg.nodes)) if cfg.writers is None else set(cfg.writers)
    readers = set(range(cfg.nodes)) if cfg.readers is None else set(cfg.readers)
    if not cfg.tiering and len(writers) == 1 and readers <= writers:
        return "without transfers only the writer's tiers hold copies, and the writer is the only reader"
    return None


def _no_pool_read(cfg: ModelConfig) -> str | None:
    if not cfg.shared_pool:
        return "there is no shared pool"
    return _no_readers(cfg)


def _one_reader(cfg: ModelConfig) -> str | None:
    if _role_count(cfg, cfg.readers) < 2:
        return "fewer than two nodes take read leases"
    return None


def _one_write_epoch(cfg: ModelConfig) -> str | None:
    if cfg.max_epoch < 2:
        return "one epoch per key (max_epoch 1): no copy or write is ever under a stale epoch"
    return None


def _no_crash(cfg: ModelConfig) -> str | None:
    if cfg.max_node_crashes == 0:
        return "no node crashes"
    return None


def _no_owner_crash(cfg: ModelConfig) -> str | None:
    if cfg.max_node_crashes == 0:
        return "no node crashes"
    if cfg.writes_to_pool_only and not cfg.tiering:
        return "every owner copy is in the shared pool, which no node crash takes down"
    return None


def _no_write_to_a_crashing_node(cfg: ModelConfig) -> str | None:
    if cfg.max_node_crashes == 0:
        return "no node crashes"
    if cfg.writes_to_pool_only:
        return "every write goes to the shared pool, which no node crash takes down"
    return None


def _no_restart(cfg: ModelConfig) -> str | None:
    if cfg.max_directory_restarts == 0:
        return "the directory never restarts"
    return _no_readers(cfg)


def _no_mirror(cfg: ModelConfig) -> str | None:
    if not cfg.mirrored_leases:
        return "the directory does not mirror its leases: every restart takes the full grace"
    return _no_restart(cfg)


def _no_second_restart(cfg: ModelConfig) -> str | None:
    if cfg.max_directory_restarts < 2:
        return "at most one directory restart"
    return _no_mirror(cfg)


def _no_renewal(cfg: ModelConfig) -> str | None:
    if cfg.max_requests < 2:
        return "one lease request per node (max_requests 1): nothing to renew with"
    return _no_readers(cfg)


def _no_chain(cfg: ModelConfig) -> str | None:
    if all(p < 0 for p in cfg.parents):
        return "every key is a root: no prefix chain"
    return None


def _no_parent_rewrite(cfg: ModelConfig) -> str | None:
    return _no_chain(cfg) or _one_write_epoch(cfg) or _no_readers(cfg)


def _single_copy(cfg: ModelConfig) -> str | None:
    if cfg.max_epoch < 2:
        return "one epoch per key (max_epoch 1): every copy carries the same epoch"
    if cfg.writes_to_pool_only and not cfg.tiering:
        return "every copy lives in the one shared-pool slot: two epochs never coexist"
    return None


def _everyone_authorised(cfg: ModelConfig) -> str | None:
    if all(len(a) == len(set(cfg.namespaces)) for a in cfg.authorized):
        return "every node is authorised for every namespace"
    return None


def _one_key_per_namespace(cfg: ModelConfig) -> str | None:
    if all(cfg.namespaces.count(ns) < 2 for ns in cfg.namespaces):
        return "no namespace has two keys: invalidate(namespace) is invalidate(key)"
    return None


def _no_within_node_transfer(cfg: ModelConfig) -> str | None:
    if not cfg.tiering:
        return "blocks never move between locations"
    if cfg.tiers_per_node < 2:
        return "one tier per node: a transfer always leaves the node"
    return None


def _no_draining_third(cfg: ModelConfig) -> str | None:
    if cfg.nodes < 3:
        return "fewer than three nodes: owner, draining copy and reader cannot be three"
    return _no_crash(cfg) or (None if cfg.tiering else "blocks never move: nothing drains") or _no_readers(cfg)


def _no_race(cfg: ModelConfig) -> str | None:
    if _role_count(cfg, cfg.writers) < 2:
        return "fewer than two nodes write"
    return None


def _no_duplication(cfg: ModelConfig) -> str | None:
    if cfg.max_duplications == 0:
        return "messages are never duplicated"
    return None


def _two_messages(cfg: ModelConfig) -> str | None:
    if cfg.max_messages < 3:
        return "at most two messages in flight"
    return None


INVARIANTS: tuple[Invariant, ...] = (
    Invariant("OneWriterPerGeneration", "1", "at most one node holds the write lease of a (key, generation)", one_writer_per_generation, reads=('writers', 'messages')),
    Invariant("OneOwnerPerEpoch", "1", "no two locations hold a key's bytes under one epoch", one_owner_per_epoch, reads=('slots',)),
    Invariant("EpochsBoundFences", "2", "no fence, copy or message carries an epoch above the directory's", epochs_bound_fences, reads=('epochs', 'slots', 'messages')),
    Invariant("NoDirtyRead", "3", "holders trust leases only on committed generations", no_dirty_read, reads=('holders', 'records')),
    Invariant("CommittedBytesIntact", "4", "the committed generation's bytes sit unchanged at its owner", committed_bytes_intact, reads=('records', 'slots')),
    Invariant("LostCopyVoidedOnRejoin", "4", "a committed key's owner copy is lost only while its node is down", lost_copy_voided_on_rejoin, reads=('records', 'slots', 'nodes')),
    Invariant("NoReclaimUnderLease", "5", "no location under a trusted lease is freed, evicted, moved or overwritten", no_reclaim_under_lease, reads=('holders', 'slots')),
    Invariant("NoStaleRead", "6", "after an invalidation completes nobody trusts the old generation", no_stale_read, reads=('holders', 'records')),
    Invariant("NoReadAfterAck", "7", "a holder that acked a revocation no longer trusts the lease", no_read_after_ack, reads=('holders', 'messages')),
    Invariant("LeaseIdsFresh", "8", "every lease id in use is below the directory's counter", lease_ids_fresh, reads=('directory', 'records', 'leases', 'holders', 'writers', 'messages')),
    Invariant("LeaseKnownToDirectory", "8,12", "a holder's trust never outlives the directory's view of the lease (skew, restart)", lease_known_to_directory, reads=('holders', 'leases', 'directory')),
    Invariant("DirectoryDataAgreement", "9", "a live lease never points at a location without the leased bytes", directory_data_agreement, reads=('records', 'leases', 'slots')),
    Invariant("PrefixClosed", "10", "a written or committed block's parent is committed", prefix_closed, reads=('records',)),
    Invariant("NamespaceIsolation", "11", "no lease or write grant outside the tenant's namespaces", namespace_isolation, reads=('leases', 'holders', 'writers')),
    Invariant("InvalidationCompletesInTime", "progress", "an invalidation completes within its deadline", invalidation_completes_in_time, kind="progress", reads=('directory', 'records')),
    Invariant("WriteLeaseEndsInTime", "progress", "a write lease ends (commit, abort, expiry) within its deadline", write_lease_ended_in_time, kind="progress", reads=('directory', 'records')),
    Invariant("RequestEndsInTime", "progress", "a lease request ends (granted, refused, timed out) within its deadline", request_ends_in_time, kind="progress", reads=('holders',)),
    Invariant("RequestAnswered", "progress", "a waiting request or its answer is in flight unless one was lost", request_answered, kind="progress", reads=('nodes', 'holders', 'writers', 'messages')),
    Invariant("CrashedOwnerWritableInTime", "progress", "a crashed owner's keys are writable again within the failover deadline", crashed_owner_writable_in_time, kind="progress", reads=('directory',)),
    Invariant("DeletionReachesEverywhere", "progress", "no up location keeps an ended generation's bytes with no Free on its way", deletion_reaches_everywhere, kind="progress", reads=('directory',)),
)

TRANSITION_PROPERTIES: tuple[TransitionProperty, ...] = (
    TransitionProperty("EpochMonotonic", "2", "epochs never decrease, at the directory or at a fence", epoch_monotonic),
    TransitionProperty("FencingHolds", "2", "a slot never accepts bytes under an epoch below its fence", fencing_holds),
    TransitionProperty("LeasesGrantedOnlyOnCommitted", "3,6", "leases are granted or extended only on committed keys", leases_granted_only_on_committed),
    TransitionProperty("RenewalNeverRevives", "8", "a lease appears only as a fresh grant; renewal never revives", renewal_never_revives),
)

SOMETIMES: tuple[Sometimes, ...] = (
    Sometimes("RemoteReadUnderLease", "a node reads, under a trusted lease, a copy on another node's tier", reached_step=_remote_read,
              companion_of=("NoReclaimUnderLease", "NoDirtyRead", "DirectoryDataAgreement"), on_actions=('read',),
              outside_scope=_no_remote_copy),
    Sometimes("PoolReadUnderLease", "a node reads, under a trusted lease, the copy in the shared pool", reached_step=_pool_read,
              companion_of=("NoReclaimUnderLease", "NoDirtyRead", "DirectoryDataAgreement"), on_actions=('read',),
              outside_scope=_no_pool_read),
    Sometimes("InvalidationCompletedByAcks", "the last lease of an invalidating key ends by acknowledgement", reached_step=_completed_by_acks,
              companion_of=("NoReadAfterAck",), on_actions=('revoke_acked',), outside_scope=_no_readers),
    Sometimes("InvalidationCompletedByExpiry", "the last lease of an invalidating key ends by expiry", reached_step=_completed_by_expiry,
              companion_of=("InvalidationCompletesInTime",), on_actions=('tick', 'clock_forward'), outside_scope=_no_readers),
    Sometimes("InvalidationWithTwoHolders", "an invalidation waits on leases held by two nodes", reached_state=_multi_holder_invalidation,
              companion_of=("InvalidationCompletesInTime", "NoStaleRead"), outside_scope=_one_reader, reads=('records', 'leases')),
    Sometimes("FencedStaleWrite", "a stale writer's bytes are refused by a fence", reached_step=_step("fence_stale_write"), on_actions=('fence_stale_write',),
              companion_of=("FencingHolds", "OneOwnerPerEpoch")),
    Sometimes("StaleCommitRejected", "the directory rejects a late commit", reached_step=_step("reject_stale_commit"), on_actions=('reject_stale_commit',),
              companion_of=("OneWriterPerGeneration",)),
    Sometimes("AcquireRefusedUncommitted", "an authorised acquire is refused because its key is being written or invalidated",
              reached_step=_acquire_refused_uncommitted, on_actions=('refuse_read_lease',),
              companion_of=("LeasesGrantedOnlyOnCommitted",), outside_scope=_no_readers),
    Sometimes("TwoWritersRace", "two nodes race to write one key", reached_state=_writers_race,
              companion_of=("OneWriterPerGeneration",), outside_scope=_no_race, reads=('writers',)),
    Sometimes("RefusedEvictionOfLeasedBlock", "an eviction is refused because the copy is leased", reached_step=_step("evict_refused"), on_actions=('evict_refused',),
              companion_of=("NoReclaimUnderLease",), outside_scope=_no_readers),
    Sometimes("Eviction", "an unleased copy is evicted", reached_step=_step("evict"), on_actions=('evict',)),
    Sometimes("OwnershipHandoffAfterCrash", "a crashed owner's key becomes writable again", reached_step=_crash_handoff, on_actions=('expire_write_lease_of_crashed', 'restart_node'),
              outside_scope=_no_crash),
    Sometimes("WriteAbortedOnRejoin", "a node rejoins while a write to it is in progress, and the write is aborted",
              reached_step=_write_aborted_on_rejoin, companion_of=("LostCopyVoidedOnRejoin",), on_actions=('restart_node',),
              outside_scope=_no_write_to_a_crashing_node),
    Sometimes("OwnerCrashedWhileDraining", "an owner's node is down while its previous copy drains on a second node under a third's lease",
              reached_state=_owner_crashed_while_draining, companion_of=("NoReclaimUnderLease",), outside_scope=_no_draining_third, reads=('holders', 'records', 'nodes')),
    Sometimes("TrustedDuringInvalidation", "a holder still trusts a lease while its key is invalidating", reached_state=_trusting_while_invalidating,
              companion_of=("NoStaleRead",), outside_scope=_no_readers, reads=('holders', 'records')),
    Sometimes("AckInFlight", "an acknowledgement of a revocation is in flight", reached_state=_ack_in_flight,
              companion_of=("NoReadAfterAck",), outside_scope=_no_readers, reads=('messages',)),
    Sometimes("TrustedDuringRestartGrace", "a holder trusts a lease the restarted directory forgot", reached_state=_trust_during_grace,
              companion_of=("LeaseKnownToDirectory",), outside_scope=_no_restart, reads=('directory', 'holders')),
    Sometimes("FenceAtDirectoryEpoch", "a slot's fence has reached the directory's epoch for its key", reached_state=_fence_at_the_bound,
              companion_of=("EpochsBoundFences", "FencingHolds"), reads=('epochs', 'slots')),
    Sometimes("RestartAfterEpochs", "the directory restarts after handing out an epoch", reached_step=_restart_with_epochs,
              on_actions=('restart_directory',), companion_of=("EpochMonotonic", "EpochsBoundFences"),
              outside_scope=lambda cfg: "the directory never restarts" if cfg.max_directory_restarts == 0 else None),
    Sometimes("RegrantAfterRestart", "a restarted directory, still in its grace period, grants a read lease again", reached_step=_regrant_after_restart,
              on_actions=('grant_read_lease',), companion_of=("LeaseIdsFresh", "LeaseKnownToDirectory"), outside_scope=_no_restart),
    Sometimes("ShortGraceUnderTrustedLease", "a restarted directory that mirrors its leases takes less than the full grace "
              "while a holder trusts a lease it forgot", reached_step=_short_grace_under_trust, on_actions=('restart_directory',),
              companion_of=("LeaseKnownToDirectory",), outside_scope=_no_mirror),
    Sometimes("RestartInGraceUnderTrustedLease", "the directory restarts again in its grace, with no lease in its table and a "
              "holder trusting one an earlier incarnation granted", reached_step=_restart_in_grace_under_trust,
              on_actions=('restart_directory',), companion_of=("LeaseKnownToDirectory",), outside_scope=_no_second_restart),
    Sometimes("LeaseRenewed", "a holder extends its trust by a renewal", reached_step=_renewal, companion_of=("RenewalNeverRevives",), on_actions=('trust_renewal',),
              outside_scope=_no_renewal),
    Sometimes("ChildCommitted", "a block is committed under a committed parent", reached_state=_child_committed,
              companion_of=("PrefixClosed",), outside_scope=_no_chain, reads=('records',)),
    Sometimes("ParentRewrittenUnderCachedChild", "a parent's next generation is written while a holder trusts its child from before",
              reached_state=_parent_rewritten_under_cached_child, companion_of=("PrefixClosed", "NoStaleRead"), outside_scope=_no_parent_rewrite, reads=('holders', 'records')),
    Sometimes("NamespaceInvalidationRacesKey", "invalidate(namespace) starts while one of its keys is already invalidating",
              reached_step=_namespace_races_key, on_actions=('invalidate_namespace',), companion_of=("PrefixClosed",),
              outside_scope=_one_key_per_namespace),
    Sometimes("DemotionWithinNode", "ownership moves between two tiers of one node", reached_step=_demotion_within_node,
              on_actions=('finish_transfer',), companion_of=("OneOwnerPerEpoch", "CommittedBytesIntact"), outside_scope=_no_within_node_transfer),
    Sometimes("CommittedAtOwner", "a committed block's bytes are at its owner", reached_state=_committed_at_owner,
              companion_of=("CommittedBytesIntact",), reads=('records', 'slots')),
    Sometimes("TwoEpochsStored", "copies of one key under two epochs coexist", reached_state=_two_epochs_stored,
              companion_of=("EpochsBoundFences", "EpochMonotonic", "OneOwnerPerEpoch"), outside_scope=_single_copy, reads=('slots',)),
    Sometimes("WriteLeaseExpired", "a write lease ends by expiry", reached_step=lambda m, pre, a, p, post: True,
              companion_of=("WriteLeaseEndsInTime",), on_actions=('expire_write_lease', 'expire_write_lease_of_crashed')),
    Sometimes("RequestRefused", "a refusal reaches the requester, which stops waiting", reached_step=_refusal_answered,
              companion_of=("RequestAnswered",), on_actions=('abandon', 'abort')),
    Sometimes("RequestTimedOut", "a holder gives up a request whose answer never came, on its timeout", reached_step=_request_timed_out,
              companion_of=("RequestEndsInTime",), on_actions=('tick', 'clock_back'), outside_scope=_no_readers),
    Sometimes("FreeRetried", "the directory re-sends a Free that was lost", reached_step=_step("retry_free"), on_actions=('retry_free',),
              companion_of=("DeletionReachesEverywhere",)),
    Sometimes("FreeAcknowledged", "a location's Freed settles an owed Free", reached_step=_step("free_acked"), on_actions=('free_acked',)),
    Sometimes("LateBytesRefusedAfterFree", "bytes of a generation freed at a slot land late and are refused", reached_step=_late_bytes_refused,
              on_actions=('fence_stale_write',)),
    Sometimes("InvalidationCompletedOnLaggingClock", "an invalidation completes after the directory's clock fell behind",
              reached_step=_lagging_completion, companion_of=("InvalidationCompletesInTime",), on_actions=('complete_invalidation',)),
    Sometimes("CrashedOwnerDeclaredDown", "the failure detector declares a crashed owner's node down and its keys are voided",
              reached_step=_owner_declared_down, companion_of=("CrashedOwnerWritableInTime",), on_actions=('declare_node_down',),
              outside_scope=_no_owner_crash),
    Sometimes("UnauthorisedRequestRefused", "a request outside the tenant's namespaces is refused", reached_step=_unauthorised_refused,
              companion_of=("NamespaceIsolation",), on_actions=('refuse_read_lease', 'refuse_write_lease'), outside_scope=_everyone_authorised),
    Sometimes("DuplicateInFlight", "a message and its duplicate are in flight together", reached_state=_duplicate_in_flight,
              companion_of=("LeaseIdsFresh", "RenewalNeverRevives"), outside_scope=_no_duplication, reads=('budgets', 'messages')),
    Sometimes("ThreeMessagesInFlight", "three messages are in flight at once", reached_state=_three_in_flight, outside_scope=_two_messages, reads=('messages',)),
)


def scope_exemptions(cfg: ModelConfig) -> dict[str, str]:
    """The ``sometimes`` a configuration's scope cannot contain, each with the argument why."""
    return {sm.name: why for sm in SOMETIMES if (why := sm.outside_scope(cfg)) is not None}


def applicable_sometimes(cfg: ModelConfig) -> tuple[Sometimes, ...]:
    """The ``sometimes`` a configuration must reach: every one its scope can contain."""
    exempt = scope_exemptions(cfg)
    return tuple(sm for sm in SOMETIMES if sm.name not in exempt)


def by_name(name: str):
    for prop in INVARIANTS + TRANSITION_PROPERTIES:
        if prop.name == name:
            return prop
    raise KeyError(name)
