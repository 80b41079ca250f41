"""The protocol model: every protocol action and every failure action as a pure transition.

Theory of operation
-------------------
The state (see ``layout``) holds the directory's records and lease table, each node's holder and
writer state, the storage slots at every location, the clocks and the network. Time is a discrete
true clock; every clock (the directory's and each node's) runs at true rate but may be stepped
forward or back, keeping its offset within ``[0, skew_ticks]``, so any two clocks differ by at most
epsilon. The state stores no absolute time: every deadline is a counter of ticks *left on the clock
that owns it*, so "the same situation, later" is one state (time normalisation). The model steps
clocks only in the harmful direction (the directory's ahead, holders' behind), each by at most
epsilon over a run: the opposite steps only shorten what holders trust, so they add states but
no behaviour that could break safety. A configuration with ``directory_clock_lags`` steps the
directory's clock *behind* instead: harmless for safety, it is the direction that delays the
directory's timers, so the bounded-response deadlines are checked under it.

- ``tick`` advances true time by one: every counter runs down by one; a counter that reaches zero
  has expired (its lease is dropped, its request abandoned). A clock step moves only the counters of
  that clock. ``tick`` is disabled while an *urgent* directory action is enabled (expiring a write
  lease whose time is up, completing an invalidation that may complete, re-sending an owed Free of
  which nothing is on its way, declaring down a node whose failure-detection time ran out): the
  directory's timers fire on time. A tick that changes nothing (no counter or ghost runs) is not a
  step, so a state where nothing else can happen is a deadlock the checker reports.
- Ghost variables (``ghost.*``) record ages in true ticks and a little history; no step reads
  them, the progress properties bound them: how long a key has been WRITING or INVALIDATING, a
  request pending, an owner copy on a down node, a slot holding an ended generation's bytes with
  no Free on its way; whether a message of a pending request was lost; whether a node
  acknowledged the revocation of a key's current generation.
- A holder counts its lease from when it *sent* the request (``pending_budget`` starts when the
  request leaves) and trusts it for ``lease_term - epsilon`` on its own clock. The directory counts
  from when it granted, and treats the lease as live for ``lease_term + epsilon`` on its clock.
- Epochs are fencing tokens. Every ownership change (write grant, transfer) takes ``epoch + 1``; a
  storage slot remembers the highest epoch it has seen (its fence) and refuses bytes, frees or copies
  carrying less.
- Requests, replies and data-plane writes travel as messages in a multiset network of bounded size:
  any message may be delivered (reordering), dropped (loss) or, within a budget, duplicated. A
  message sent into a full network is lost. A paused process is one whose messages sit in the
  network while time passes.
- Deletion reaches everywhere: whenever bytes stop being wanted (an invalidation completes, a write
  lease expires, an invalidation aborts a write, a drained copy goes, a transfer is cancelled) the
  directory *owes* a Free per location (a durable to-free set), sends it, and re-sends it until the
  location answers ``Freed``. A location frees bytes of the Free's epoch or older, never newer,
  and remembers the epoch freed, so bytes of it that land late are refused.
- Every lease request is answered: a grant, or a ``LeaseRefused`` after which the requester stops
  waiting (``abandon``, or ``abort`` for a writer); a lost request or answer is ended by the
  holder's timeout.
- Failures: a node crash loses the node's volatile state and, optionally, its disk (its slots become
  LOST: reads of them fail, they never return other bytes); a restarted node re-registers and the
  directory forgets what the node lost. A node that stays silent for ``failure_detection_ticks``
  on the directory's clock is declared down: no leases there, and its owner copies are voided so
  the keys become writable again. A directory restart loses the lease table and timers, keeps
  every record (they are durable), and frees nothing for a grace period as long as the longest lease
  it may have issued.

Every guard is a rule of ``rules`` (may this lease be granted, may this commit land, may this
invalidation complete, ...), the same functions the reference directory calls: this module only
reads their arguments out of the packed state and turns their answers into successors.

Mutants (deliberate bugs, see ``mutants``) are named flags checked at the exact line they break:
a flag bypasses a rule's call or alters its arguments or answer there; the rules stay correct.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from . import layout
from .config import STATE_VALUE_LIMIT, ModelConfig
from .layout import (
    EMPTY,
    FULL,
    LOST,
    M_ACK,
    M_ACQUIRE,
    M_BEGIN_WRITE,
    M_COMMIT,
    M_COPIED,
    M_COPY,
    M_FREE,
    M_FREED,
    M_GRANT_READ,
    M_GRANT_WRITE,
    M_RELEASE,
    M_RENEW,
    M_RENEWED,
    M_REFUSE,
    M_REVOKE,
    M_WRITE_BYTES,
    MESSAGE_WIDTH,
    NO_LEASE,
    NO_LOCATION,
    NO_NODE,
    P_ACQUIRE,
    P_NONE,
    P_RENEW,
    REFUSED_READ,
    REFUSED_WRITE,
    W_BYTES_SENT,
    W_NONE,
    W_REQUESTED,
    Layout,
    ack_msg,
    acquire_msg,
    begin_write_msg,
    commit_msg,
    copied_msg,
    copy_msg,
    free_msg,
    freed_msg,
    grant_read_msg,
    grant_write_msg,
    refuse_msg,
    release_msg,
    renew_msg,
    renewed_msg,
    revoke_msg,
    write_bytes_msg,
)
from .rules import (
    ABSENT,
    COMMITTED,
    INVALIDATE_ABORT_WRITE,
    INVALIDATE_START,
    INVALIDATING,
    WRITING,
    directory_view,
    down_owner_invalidates,
    failover_deadline,
    free_acknowledged,
    free_takes,
    holder_budget,
    invalidation_deadline,
    invalidation_step,
    lost_copy_invalidates,
    may_ack_revoke,
    may_begin_write,
    may_commit,
    may_complete_invalidation,
    may_evict,
    may_finish_transfer,
    may_free_drained,
    may_grant_read,
    may_release,
    may_renew,
    free_retry_due,
    may_retry_free,
    may_start_transfer,
    next_epoch,
    owe_free,
    request_deadline,
    restart_grace,
    restart_grace_within,
    restored_fence,
    restored_freed_epoch,
    slot_accepts,
    write_lease_deadline,
    write_lease_must_expire,
)
from .vocabulary import REASON_LEASED

# The packed state stores phases as the rules number them.
assert (layout.ABSENT, layout.WRITING, layout.COMMITTED, layout.INVALIDATING) == (ABSENT, WRITING, COMMITTED, INVALIDATING)

# A successor: (action name, parameters, next state).
Step = tuple[str, tuple[int, ...], bytes]

MUTANT_FLAGS = frozenset(
    {
        "no_fencing",
        "late_commit_accepted",
        "invalidation_ignores_leases",
        "holder_ignores_skew",
        "holder_counts_from_receipt",
        "renew_revives_expired",
        "evict_under_lease",
        "evict_parent_first",
        "lease_id_reuse_after_restart",
        "grant_during_invalidation",
        "restart_without_grace",
        "ack_before_drop",
        "invalidate_without_cascade",
        "invalidation_waits_for_acks",
        "no_namespace_check",
        "write_lease_never_expires",
        "second_write_grant",
        "transfer_keeps_epoch",
        "epoch_not_recorded",
        "epochs_not_durable",
        "completion_ignores_grace",
        "grant_names_draining_copy",
        "lost_copy_ends_generation",
        "write_survives_rejoin",
        # progress and deletion (issue 8, section 3)
        "deadline_ignores_lag",
        "free_not_retried",
        "ended_write_not_freed",
        "late_bytes_after_free",
        "silent_refusal",
        "holder_never_times_out",
        "revoke_keeps_pending_acquire",
        "writer_never_gives_up",
        # a restart that waits only for the leases outstanding (issue 14: the mirrored horizon)
        "horizon_forgets_grace",
        "horizon_short_by_a_tick",
        "no_failure_detector",
    }
)

# Steps no process logs, so trace validation takes them silently: the environment's (time, clock
# steps, loss, duplication) and deliveries the receiver ignores (their state is the network without
# the message, the same as a loss). Every other label is an event (``kvcc.reference.events``).
SILENT_ACTIONS = frozenset(
    {
        "tick", "clock_forward", "clock_back", "drop", "duplicate",
        "ignore_stale_grant", "ignore_stale_renewal", "ignore_stale_write_grant", "ignore_stale_copied",
        "ignore_stale_refusal", "ignore_stale_freed",
        "write_to_down_location", "free_at_down_location", "copy_failed", "fence_stale_copy",
    }
)  # fmt: skip


# Where a message of a holder's request exchange carries the request number it belongs to.
_READ_EXCHANGE_REQUEST = {M_ACQUIRE: 3, M_RENEW: 5, M_GRANT_READ: 6, M_RENEWED: 6, M_REFUSE: 3}


class Model:
    """Initial states and the successor relation for one configuration (and optional bugs)."""

    def __init__(self, cfg: ModelConfig, bugs: Iterable[str] = ()) -> None:
        self.cfg = cfg
        self.bugs = frozenset(bugs)
        unknown = self.bugs - MUTANT_FLAGS
        assert not unknown, f"unknown mutant flags: {sorted(unknown)}"
        self.L = Layout(cfg)
        # Plain attributes: the checker reads these millions of times.
        self.N, self.K, self.LOCS = cfg.nodes, cfg.keys, cfg.locations
        self.reads = [cfg.readers is None or n in cfg.readers for n in range(cfg.nodes)]
        self.writes = [cfg.writers is None or n in cfg.writers for n in range(cfg.nodes)]
        cfg_ = cfg
        term, eps = cfg_.lease_term_ticks, cfg_.skew_ticks
        self.holder_budget = holder_budget(term, eps)
        if "holder_ignores_skew" in self.bugs:
            self.holder_budget = term  # bug: the rule is bypassed, the full term trusted
        self.directory_view = directory_view(term, eps)
        self.restart_grace = restart_grace(term, eps)
        self.deadline = invalidation_deadline(term, eps, cfg_.max_directory_restarts)
        self.write_deadline = write_lease_deadline(term, eps, cfg_.max_directory_restarts)
        self.request_deadline = request_deadline(term, eps)
        self.deletion_deadline = cfg_.deletion_deadline_ticks
        self.detection = cfg_.failure_detection_ticks
        self.failover_deadline = failover_deadline(term, eps, cfg_.max_directory_restarts, self.detection)
        assert cfg_.failover_deadline_ticks == self.failover_deadline
        # ``ModelConfig`` spells the same limits out for reports; they must be these.
        assert cfg_.holder_budget_ticks == holder_budget(term, eps)
        assert cfg_.directory_lease_ticks == self.directory_view
        assert cfg_.restart_grace_ticks == self.restart_grace
        assert cfg_.invalidation_deadline_ticks == self.deadline
        assert cfg_.write_lease_deadline_ticks == self.write_deadline
        assert cfg_.request_deadline_ticks == self.request_deadline
        if "deadline_ignores_lag" in self.bugs:
            # Bug: the bound argued with the directory's clock running ahead (the direction that
            # matters for safety), where a lease ends within the directory's view of it.
            self.deadline = self.directory_view + cfg_.max_directory_restarts * self.restart_grace
        # Ghost ages saturate one past their bound: enough to see it broken, and finite. A state
        # byte holds at most 255: a bound that large (the validator sizes a projection's scope to
        # its trace, e.g. fourteen directory restarts, each adding a grace to the deadlines) leaves
        # its age saturated at 255, never past the bound -- that progress property is then not
        # checked there, and no trace is rejected for it.
        age_max = STATE_VALUE_LIMIT - 1
        self.phase_age_cap = min(max(self.deadline, self.write_deadline) + 1, age_max)
        self.request_age_cap = min(self.request_deadline + 1, age_max)
        self.orphan_age_cap = min(self.deletion_deadline + 1, age_max)
        self.owner_down_cap = min(self.failover_deadline + 1, age_max)
        self.node_timers = self.L.node_timers
        if "holder_never_times_out" in self.bugs:
            # Bug: the budget runs out but the holder keeps waiting for its answer.
            self.node_timers = [
                [(c, ()) if c in set(self.L.p_left[n]) else (c, cl) for c, cl in timers]
                for n, timers in enumerate(self.L.node_timers)
            ]
        if "holder_counts_from_receipt" in self.bugs:
            # Bug: nothing runs on the holder's clock until the grant arrives (so no timeout
            # either: RequestEndsInTime sees it first; with a timeout within the budget, the
            # receipt-counted trust stays inside the directory's view and the bug is harmless).
            pending = {self.L.p_left[n][k] for n in range(cfg_.nodes) for k in range(cfg_.keys)}
            self.node_timers = [[t for t in timers if t[0] not in pending] for timers in self.node_timers]
        # Which (node, key) pairs a tenant may touch (protocol property 11).
        self.allowed = [[cfg_.namespaces[k] in cfg_.authorized[n] for k in range(cfg_.keys)] for n in range(cfg_.nodes)]
        self.loc_node = [cfg_.location_node(loc) for loc in range(cfg_.locations)]
        self.children = [cfg_.children(k) for k in range(cfg_.keys)]
        self.subtree = [cfg_.descendants(k) for k in range(cfg_.keys)]
        self.ns_keys = {}
        for k, ns in enumerate(cfg_.namespaces):
            self.ns_keys.setdefault(ns, []).append(k)

    # ------------------------------------------------------------------ initial state

    def init_states(self) -> list[bytes]:
        L, cfg = self.L, self.cfg
        s = bytearray(L.fixed)
        for n in range(cfg.nodes):
            s[L.up[n]] = 1
        s[L.next_id] = 1
        s[L.crashes_left] = cfg.max_node_crashes
        s[L.restarts_left] = cfg.max_directory_restarts
        s[L.dups_left] = cfg.max_duplications
        return [bytes(s)]

    # ------------------------------------------------------------------ helpers

    def _pack(self, fixed: bytearray, net: list[bytes]) -> bytes:
        if len(net) > 1:
            net = sorted(net)
        return bytes(fixed) + b"".join(net)

    def _send(self, net: list[bytes], msg: bytes) -> None:
        """Put a message on the wire; a full network loses it (message loss is a fault we allow)."""
        if len(net) < self.cfg.max_messages:
            net.append(msg)

    def _reply(self, b: bytearray, net: list[bytes], msg: bytes) -> None:
        """Answer a node's request; an answer lost to a full network is a lost exchange (ghost)."""
        if len(net) < self.cfg.max_messages:
            net.append(msg)
        else:
            self._mark_lost(b, msg)

    def _mark_lost(self, b: bytearray, msg: bytes) -> None:
        """Ghost: a message of a node's pending request exchange was lost."""
        L = self.L
        kind, n, k = msg[0], msg[1], msg[2]
        req = _READ_EXCHANGE_REQUEST.get(kind)
        if kind == M_REFUSE and msg[4] == REFUSED_WRITE:
            req = None
        if req is not None:
            if b[L.p_kind[n][k]] != P_NONE and b[L.p_id[n][k]] == msg[req]:
                b[L.read_lost[n][k]] = 1
        elif kind in (M_BEGIN_WRITE, M_GRANT_WRITE, M_REFUSE):
            if b[L.w_stage[n][k]] == W_REQUESTED:
                b[L.write_lost[n][k]] = 1

    def _end_pending(self, b: bytearray, n: int, k: int) -> None:
        """The holder's request is over (answered, refused, given up, cancelled)."""
        L = self.L
        b[L.p_kind[n][k]] = b[L.p_id[n][k]] = b[L.p_left[n][k]] = 0
        b[L.p_age[n][k]] = b[L.read_lost[n][k]] = 0

    def answer_on_its_way(self, s: bytes, k: int, loc1: int, owed: int) -> bool:
        """Is a Free for ``(k, loc)`` covering ``owed``, or its ``Freed``, in flight?"""
        L = self.L
        for i in range(L.fixed, len(s), MESSAGE_WIDTH):
            kind = s[i]
            if (kind == M_FREE or kind == M_FREED) and s[i + 2] == k and s[i + 3] == loc1 and s[i + 6] >= owed:
                return True
        return False

    def free_retry_enabled(self, s: bytes, k: int, loc: int) -> bool:
        """May the directory re-send its owed Free to ``loc`` (its retry timer fires whenever)?"""
        L = self.L
        owed = s[L.to_free[loc][k]]
        if owed == 0 or "free_not_retried" in self.bugs:
            return False
        if len(s) >= L.fixed + MESSAGE_WIDTH * self.cfg.max_messages:
            return False  # nothing can be sent into a full network; the retry waits for room
        return may_retry_free(owed, self.location_up(s, loc))

    def free_retry_is_due(self, s: bytes, k: int, loc: int) -> bool:
        """Must the directory re-send it before time passes (nothing of it is on its way)?"""
        L = self.L
        owed = s[L.to_free[loc][k]]
        return self.free_retry_enabled(s, k, loc) and free_retry_due(
            owed, True, self.answer_on_its_way(s, k, loc + 1, owed)
        )

    def orphaned(self, s: bytes, loc: int, k: int) -> bool:
        """Ghost condition: an up location holds an ended generation's bytes, no Free it would take
        is on its way, and the directory could send one (the network has room)."""
        L = self.L
        if s[L.s_status[loc][k]] != FULL or s[L.s_gen[loc][k]] >= s[L.gen[k]] or not self.location_up(s, loc):
            return False
        if len(s) >= L.fixed + MESSAGE_WIDTH * self.cfg.max_messages:
            return False
        slot_epoch = s[L.s_epoch[loc][k]]
        for i in range(L.fixed, len(s), MESSAGE_WIDTH):
            if s[i] == M_FREE and s[i + 2] == k and s[i + 3] == loc + 1 and s[i + 6] >= slot_epoch:
                return False  # a Free that will take it is on its way
        return True

    def live_lease_on(self, s: bytes, k: int, loc_plus_1: int) -> bool:
        L = self.L
        for n in range(self.N):
            if s[L.r_id[k][n]] != NO_LEASE and s[L.r_loc[k][n]] == loc_plus_1:
                return True
        return False

    def has_live_lease(self, s: bytes, k: int) -> bool:
        L = self.L
        for n in range(self.N):
            if s[L.r_id[k][n]] != NO_LEASE:
                return True
        return False

    def location_up(self, s: bytes, loc: int) -> bool:
        node = self.loc_node[loc]
        return node < 0 or s[self.L.up[node]] == 1

    def completion_enabled(self, s: bytes, k: int) -> bool:
        """May the invalidation of ``k`` complete now? (Gray & Cheriton's write rule.)"""
        L = self.L
        phase = s[L.phase[k]]
        if phase != INVALIDATING:
            return False  # fast path: the rule would say no without looking at the leases
        in_grace = s[L.grace] > 0 and not self.bugs & {"restart_without_grace", "completion_ignores_grace"}
        if "invalidation_ignores_leases" in self.bugs:
            return may_complete_invalidation(phase, in_grace, 0)  # bug: leases not counted
        return may_complete_invalidation(phase, in_grace, self.has_live_lease(s, k))

    def urgent(self, s: bytes) -> bool:
        """Is a directory timer due? Time does not pass until it has fired."""
        L = self.L
        for k in range(self.K):
            phase = s[L.phase[k]]
            if phase == WRITING:
                if write_lease_must_expire(phase, s[L.w_left[k]] > 0) and "write_lease_never_expires" not in self.bugs:
                    return True
            elif phase == INVALIDATING and self.completion_enabled(s, k):
                return True
            for loc in range(self.LOCS):
                if s[L.to_free[loc][k]] and self.free_retry_is_due(s, k, loc):
                    return True
        for n in range(self.N):
            if self.down_declaration_due(s, n):
                return True
        return False

    def down_declaration_due(self, s: bytes, n: int) -> bool:
        """Has the failure detector's time for the crashed node ``n`` run out?"""
        L = self.L
        if s[L.up[n]] or s[L.known_down[n]] or s[L.detect_left[n]] or "no_failure_detector" in self.bugs:
            return False
        return True

    def declared_down_at(self, s: bytes, loc1: int) -> bool:
        """Is location ``loc1`` (stored plus one) on a node the directory declared down?"""
        if loc1 == NO_LOCATION:
            return False
        node = self.loc_node[loc1 - 1]
        return node >= 0 and s[self.L.known_down[node]] == 1

    def owner_declared_down(self, s: bytes, k: int) -> bool:
        return self.declared_down_at(s, s[self.L.owner[k]])

    # ------------------------------------------------------------------ successors

    def successors(self, s: bytes) -> list[Step]:
        out: list[Step] = []
        L, cfg = self.L, self.cfg
        fixed = s[: L.fixed]
        net = [s[i : i + MESSAGE_WIDTH] for i in range(L.fixed, len(s), MESSAGE_WIDTH)]

        self._time(s, fixed, net, out)
        if out and out[0][0] == "tick" and out[0][2] == s:
            # Time passing where nothing counts changes nothing: a stutter, not a step. Without
            # it, a state where nothing else can happen is a deadlock the checker reports.
            del out[0]
        for n in range(self.N):
            if s[L.up[n]]:
                for k in range(self.K):
                    if self.reads[n]:
                        self._holder_actions(s, fixed, net, n, k, out)
                    if self.writes[n]:
                        self._writer_actions(s, fixed, net, n, k, out)
        for k in range(self.K):
            self._directory_actions(s, fixed, net, k, out)
        for ns, keys in self.ns_keys.items():
            # invalidate(namespace): every key of one tenant's model namespace at once.
            if len(keys) > 1 and any(s[L.phase[j]] == COMMITTED for j in keys):
                out.append(("invalidate_namespace", (ns,), self._start_invalidation(s, fixed, net, keys)))
        # Each distinct message once: delivering either of two equal messages is one step.
        for i, msg in enumerate(net):
            if msg in net[:i]:
                continue
            rest = net[:i] + net[i + 1 :]
            delivered = len(out)
            self._deliver(s, fixed, rest, msg, out)
            lossy = bytearray(fixed)
            self._mark_lost(lossy, msg)
            dropped = self._pack(lossy, rest)
            # A delivery the receiver ignores (a refusal, a stale reply) is the same step as
            # losing the message: keep the step that says why.
            if all(step[2] != dropped for step in out[delivered:]):
                out.append(("drop", tuple(msg), dropped))
            if s[L.dups_left] > 0 and len(net) < cfg.max_messages:
                b = bytearray(fixed)
                b[L.dups_left] -= 1
                out.append(("duplicate", tuple(msg), self._pack(b, net + [msg])))
        self._failures(s, fixed, net, out)
        return out

    # -- one action ---------------------------------------------------------------------------

    def apply(self, label: str, params: tuple, s: bytes) -> list[Step]:
        """The steps of ``successors(s)`` named ``label`` whose parameters match ``params``,
        computed without generating the others. Trace validation replays each logged action with
        its parameters; building every successor to keep the one that matches is what made it
        slow. A parameter given as ``None`` matches any value (a spec lease id the replay has
        not bound yet); ``params`` may be shorter than the step's. Only the generator that can
        produce ``label`` runs (``_APPLY_SOURCES``): the holder's or writer's actions of one
        (node, key), the directory's of one key, the deliveries of the messages that handler
        takes, time, or failures (some labels have two: a holder abandons on its own or on a
        refusal); a label without an entry falls back to ``successors``, so an action added
        later is still found, only not faster. ``tests/test_validate.py``
        checks that the union over every (label, params) of a state's successors is the
        successors."""
        L = self.L
        sources = _APPLY_SOURCES.get(label)
        out: list[Step] = []
        if sources is None:
            out = self.successors(s)
            sources = ()
        fixed = s[: L.fixed]
        net = [s[i : i + MESSAGE_WIDTH] for i in range(L.fixed, len(s), MESSAGE_WIDTH)]
        for source in sources:
            kind = source[0]
            if kind == "holder" or kind == "writer":
                n, k = params[0], params[1]
                if n is None or k is None:
                    return [st for st in self.successors(s) if st[0] == label and _params_match(params, st[1])]
                if s[L.up[n]]:
                    if kind == "holder" and self.reads[n]:
                        self._holder_actions(s, fixed, net, n, k, out)
                    elif kind == "writer" and self.writes[n]:
                        self._writer_actions(s, fixed, net, n, k, out)
            elif kind == "directory":
                keys = range(self.K) if params[0] is None else (params[0],)
                for k in keys:
                    self._directory_actions(s, fixed, net, k, out)
            elif kind == "deliver":
                kinds = source[1]
                for i, msg in enumerate(net):
                    if msg[0] in kinds and msg not in net[:i]:
                        self._deliver(s, fixed, net[:i] + net[i + 1 :], msg, out)
            elif kind == "time":
                self._time(s, fixed, net, out)
            else:
                assert kind == "failures", kind
                self._failures(s, fixed, net, out)
        return [st for st in out if st[0] == label and _params_match(params, st[1])]

    def tick(self, s: bytes) -> bytes | None:
        """The state after the ``tick`` step from ``s`` (``apply("tick", (), s)``'s one step), or
        ``None`` where it is disabled (an urgent directory step is due): the clock steps
        ``_time`` also generates are not built. Trace validation waits tick by tick between
        events; ``tests/test_validate.py`` checks it against ``apply``."""
        if self.urgent(s):
            return None
        L = self.L
        b = bytearray(s[: L.fixed])
        self._run_down(b, self._directory_timers(s), 1)
        for n in range(self.N):
            self._run_down(b, self.node_timers[n], 1)
        self._age_ghosts(s, b)
        return bytes(b) + s[L.fixed :]

    # -- time ---------------------------------------------------------------------------------

    def _run_down(self, b: bytearray, timers: list[tuple[int, tuple[int, ...]]], delta: int) -> None:
        """Move every running counter of one clock by ``delta`` ticks; zero means expired."""
        for counter, cleared in timers:
            v = b[counter]
            if v == 0:
                continue  # expiry is final: stepping a clock back does not revive a lease
            v -= delta
            if v <= 0:
                b[counter] = 0
                for idx in cleared:
                    b[idx] = 0
            else:
                b[counter] = v

    def _age_ghosts(self, s: bytes, b: bytearray) -> None:
        """One true tick passes: every ghost age that runs counts it, saturating one past its bound."""
        L = self.L
        for k in range(self.K):
            phase = s[L.phase[k]]
            if phase in (WRITING, INVALIDATING) and b[L.phase_age[k]] < self.phase_age_cap:
                b[L.phase_age[k]] += 1
            owner = s[L.owner[k]]
            if phase in (COMMITTED, INVALIDATING) and owner != NO_LOCATION and not self.location_up(s, owner - 1):
                if b[L.owner_down_age[k]] < self.owner_down_cap:
                    b[L.owner_down_age[k]] += 1
            else:
                b[L.owner_down_age[k]] = 0
            for loc in range(self.LOCS):
                i = L.orphan_age[loc][k]
                if self.orphaned(s, loc, k):
                    if b[i] < self.orphan_age_cap:
                        b[i] += 1
                else:
                    b[i] = 0
        for n in range(self.N):
            for k in range(self.K):
                # A request given up by its timeout on this tick is over: its ghosts were cleared.
                if b[L.p_kind[n][k]] != P_NONE and b[L.p_age[n][k]] < self.request_age_cap:
                    b[L.p_age[n][k]] += 1

    def _directory_timers(self, s: bytes) -> list[tuple[int, tuple[int, ...]]]:
        timers = self.L.directory_timers
        if "invalidation_waits_for_acks" in self.bugs:
            # Bug: leases on an invalidating key are kept until acknowledged, never expired.
            L = self.L
            frozen = {
                L.r_left[k][n]
                for k in range(self.K)
                if s[L.phase[k]] == INVALIDATING
                for n in range(self.N)
            }
            timers = [t for t in timers if t[0] not in frozen]
        return timers

    def _time(self, s: bytes, fixed: bytes, net: list[bytes], out: list[Step]) -> None:
        L, cfg = self.L, self.cfg
        tail = s[L.fixed :]
        if not self.urgent(s):
            b = bytearray(fixed)
            self._run_down(b, self._directory_timers(s), 1)
            for n in range(self.N):
                self._run_down(b, self.node_timers[n], 1)
            self._age_ghosts(s, b)
            out.append(("tick", (), bytes(b) + tail))
        # Clock steps, in the direction that can hurt (Gray & Cheriton: a fast server clock or a
        # slow holder clock breaks leases; the opposite errors only delay): the directory's clock
        # may jump ahead, a holder's clock may fall behind, each by at most epsilon in all.
        # A step while no counter of that clock runs changes nothing but the skew left to
        # spend, and a state with more skew left can do everything that one can: such steps are
        # not generated.
        eps = cfg.skew_ticks
        if s[L.dir_off] < eps and any(s[c] for c, _ in L.directory_timers):
            b = bytearray(fixed)
            b[L.dir_off] += 1
            if cfg.directory_clock_lags:
                # The directory's clock falls behind: its leases and grace last longer in true
                # time (harmless for safety, harmful for the bounded-response deadlines).
                self._run_down(b, self._directory_timers(s), -1)
                out.append(("clock_back", (-1,), bytes(b) + tail))
            else:
                self._run_down(b, self._directory_timers(s), 1)
                out.append(("clock_forward", (-1,), bytes(b) + tail))
        for n in range(self.N):
            if s[L.up[n]] and s[L.off[n]] < eps and any(s[c] for c, _ in self.node_timers[n]):
                b = bytearray(fixed)
                b[L.off[n]] += 1  # the offset counts how far this clock has fallen behind
                self._run_down(b, self.node_timers[n], -1)
                out.append(("clock_back", (n,), bytes(b) + tail))

    # -- holder (reader) side -----------------------------------------------------------------

    def _holder_actions(self, s: bytes, fixed: bytes, net: list[bytes], n: int, k: int, out: list[Step]) -> None:
        L = self.L
        h_id = s[L.h_id[n][k]]
        if s[L.p_kind[n][k]] == P_NONE and len(net) < self.cfg.max_messages and s[L.req[n]] < self.cfg.max_requests:
            # Every request carries a fresh request number, echoed by its answer: a grant or a
            # renewal that answers an earlier request (delayed, duplicated, or addressed to the
            # node before a crash) is never taken for the answer to this one. The budget starts
            # now, when the request leaves (docs/protocol.md: leases).
            req = s[L.req[n]] + 1
            b = bytearray(fixed)
            b[L.req[n]] = req
            b[L.p_id[n][k]] = req
            b[L.p_left[n][k]] = self.holder_budget
            if h_id == NO_LEASE:
                b[L.p_kind[n][k]] = P_ACQUIRE
                out.append(("acquire", (n, k), self._pack(b, net + [acquire_msg(n, k, req)])))
            else:
                b[L.p_kind[n][k]] = P_RENEW
                renew = renew_msg(n, k, h_id, s[L.h_loc[n][k]], req)
                out.append(("renew", (n, k), self._pack(b, net + [renew])))
        if s[L.p_kind[n][k]] != P_NONE:
            # The client gives up on its request before its answer or its timeout (a caller that
            # cancels): a grant or renewal that still comes answers a request nobody waits for
            # and is ignored. (A refusal that arrives ends the request the same way: ``_on_refuse``.)
            b = bytearray(fixed)
            self._end_pending(b, n, k)
            out.append(("abandon", (n, k), self._pack(b, net)))
        if h_id != NO_LEASE:
            # A read under a trusted lease: observes the slot (the properties judge what it sees).
            loc = s[L.h_loc[n][k]] - 1
            out.append(("read", (n, k, loc), s))
            # Release: stop trusting first, then tell the directory.
            b = bytearray(fixed)
            b[L.h_id[n][k]] = b[L.h_loc[n][k]] = b[L.h_gen[n][k]] = b[L.h_left[n][k]] = 0
            if s[L.p_kind[n][k]] == P_RENEW:
                self._end_pending(b, n, k)
            rest = list(net)
            self._send(rest, release_msg(n, k, h_id))
            out.append(("release", (n, k), self._pack(b, rest)))

    # -- writer side --------------------------------------------------------------------------

    def _writer_actions(self, s: bytes, fixed: bytes, net: list[bytes], n: int, k: int, out: list[Step]) -> None:
        L = self.L
        stage = s[L.w_stage[n][k]]
        if stage == W_NONE:
            if len(net) < self.cfg.max_messages:
                b = bytearray(fixed)
                b[L.w_stage[n][k]] = W_REQUESTED
                b[L.write_lost[n][k]] = 0
                out.append(("begin_write", (n, k), self._pack(b, net + [begin_write_msg(n, k)])))
            return
        if stage in (W_REQUESTED, W_BYTES_SENT) and "writer_never_gives_up" not in self.bugs:
            # The client gives up (a timeout): a late grant finds nobody waiting, bytes still in
            # flight land or are fenced, and the write lease expires.
            b = bytearray(fixed)
            self._clear_writer(b, n, k)
            out.append(("abort", (n, k), self._pack(b, net)))

    def _clear_writer(self, b: bytearray, n: int, k: int) -> None:
        L = self.L
        b[L.w_stage[n][k]] = W_NONE
        b[L.wr_id[n][k]] = b[L.wr_gen[n][k]] = b[L.wr_epoch[n][k]] = b[L.wr_loc[n][k]] = 0
        b[L.write_lost[n][k]] = 0

    # -- directory internal actions -----------------------------------------------------------

    def _directory_actions(self, s: bytes, fixed: bytes, net: list[bytes], k: int, out: list[Step]) -> None:
        L, cfg = self.L, self.cfg
        phase = s[L.phase[k]]
        for loc in range(self.LOCS):
            if s[L.to_free[loc][k]] and self.free_retry_enabled(s, k, loc):
                # The owed Free or its Freed may have been lost (or a down location swallowed
                # it): again. Idempotent at the location; due once nothing of it is on its way.
                rest = list(net)
                self._send(rest, free_msg(k, loc + 1, s[L.to_free[loc][k]]))
                out.append(("retry_free", (k, loc), self._pack(bytearray(fixed), rest)))
        if phase == WRITING:
            if write_lease_must_expire(phase, s[L.w_left[k]] > 0) and "write_lease_never_expires" not in self.bugs:
                # The write lease expired: the key is writable again, the late writer is fenced
                # by the next grant's higher epoch, and whatever it stored is freed.
                writer = s[L.writer[k]] - 1
                b = bytearray(fixed)
                rest = list(net)
                self._free_ended_write(s, b, rest, k)
                self._end_generation(b, k)
                name = "expire_write_lease_of_crashed" if not s[L.up[writer]] else "expire_write_lease"
                out.append((name, (k,), self._pack(b, rest)))
        elif phase == COMMITTED:
            self._invalidate_actions(s, fixed, net, k, out)
            self._evict_actions(s, fixed, net, k, out)
            if cfg.tiering:
                self._transfer_actions(s, fixed, net, k, out)
        elif phase == INVALIDATING:
            if self.completion_enabled(s, k):
                b = bytearray(fixed)
                rest = list(net)
                self._free_copies(s, b, rest, k)
                self._end_generation(b, k)
                out.append(("complete_invalidation", (k,), self._pack(b, rest)))

    def _end_generation(self, b: bytearray, k: int) -> None:
        """Back to ABSENT with the next generation: the old one can never be read again."""
        L = self.L
        b[L.phase[k]] = ABSENT
        b[L.gen[k]] += 1
        b[L.owner[k]] = b[L.moving[k]] = b[L.draining[k]] = NO_LOCATION
        b[L.writer[k]] = NO_NODE
        b[L.w_id[k]] = b[L.w_left[k]] = 0
        b[L.phase_age[k]] = 0
        for n in range(self.N):
            b[L.acked[n][k]] = 0  # acks were of the generation that just ended

    def _owe_free(self, b: bytearray, net: list[bytes], k: int, loc1: int, epoch: int) -> None:
        """Free ``k`` at ``loc`` under ``epoch``, and keep owing it until a ``Freed`` says so."""
        L = self.L
        i = L.to_free[loc1 - 1][k]
        b[i] = owe_free(b[i], epoch)
        self._send(net, free_msg(k, loc1, epoch))

    def _free_copies(self, s: bytes, b: bytearray, net: list[bytes], k: int) -> None:
        L = self.L
        for idx in (L.owner[k], L.draining[k]):
            loc = s[idx]
            if loc != NO_LOCATION:
                self._owe_free(b, net, k, loc, s[L.epoch[k]])

    def _free_ended_write(self, s: bytes, b: bytearray, net: list[bytes], k: int) -> None:
        """A write that ends without a commit (its lease expired, an invalidation aborted it) may
        have stored bytes at its location: they belong to a generation that is over."""
        L = self.L
        if "ended_write_not_freed" not in self.bugs and s[L.owner[k]] != NO_LOCATION:
            self._owe_free(b, net, k, s[L.owner[k]], s[L.epoch[k]])

    def _invalidate_actions(self, s: bytes, fixed: bytes, net: list[bytes], k: int, out: list[Step]) -> None:
        """invalidate(key) voids the key and its whole prefix subtree (docs/protocol.md: invalidation)."""
        keys = self.subtree[k] if "invalidate_without_cascade" not in self.bugs else (k,)
        out.append(("invalidate", (k,), self._start_invalidation(s, fixed, net, keys)))

    def _start_invalidation(self, s: bytes, fixed: bytes, net: list[bytes], keys: Iterable[int]) -> bytes:
        b = bytearray(fixed)
        rest = list(net)
        self._invalidate_into(s, b, rest, keys)
        return self._pack(b, rest)

    def _invalidate_into(self, s: bytes, b: bytearray, net: list[bytes], keys: Iterable[int]) -> None:
        """Move every committed key of ``keys`` to INVALIDATING and revoke its leases."""
        L = self.L
        for j in keys:
            step = invalidation_step(s[L.phase[j]])
            if step == INVALIDATE_START:
                b[L.phase[j]] = INVALIDATING
                b[L.phase_age[j]] = 0
                if s[L.moving[j]] != NO_LOCATION:
                    # An unfinished transfer is abandoned, its destination freed.
                    b[L.moving[j]] = NO_LOCATION
                    self._owe_free(b, net, j, s[L.moving[j]], s[L.epoch[j]])
                for n in range(self.N):
                    lease = b[L.r_id[j][n]]
                    if lease != NO_LEASE:
                        self._send(net, revoke_msg(n, j, lease, s[L.gen[j]]))
            elif step == INVALIDATE_ABORT_WRITE:
                # A write in progress below an invalidated prefix is aborted; its commit will
                # find the generation gone, and whatever it stored is freed.
                self._free_ended_write(s, b, net, j)
                self._end_generation(b, j)

    def _evict_actions(self, s: bytes, fixed: bytes, net: list[bytes], k: int, out: list[Step]) -> None:
        """A node asks to evict its copy of ``k`` under memory pressure; the directory decides."""
        L = self.L
        for idx in (L.owner[k], L.draining[k]):
            loc1 = s[idx]
            if loc1 == NO_LOCATION or not self.location_up(s, loc1 - 1):
                continue  # a copy the directory knows of, on a node that is up to ask
            reason = may_evict(
                s[L.phase[k]],
                True,
                "evict_parent_first" in self.bugs or all(s[L.phase[c]] == ABSENT for c in self.children[k]),
                self.live_lease_on(s, k, loc1) and "evict_under_lease" not in self.bugs,
                s[L.grace] > 0 and "restart_without_grace" not in self.bugs,
                idx == L.owner[k] and s[L.draining[k]] != NO_LOCATION,
            )
            if reason == REASON_LEASED:
                out.append(("evict_refused", (k, loc1 - 1), s))
                continue
            if reason is not None:
                continue  # refusals other than a lease are not steps the properties talk about
            b = bytearray(fixed)
            loc = loc1 - 1
            b[L.s_status[loc][k]] = EMPTY  # the node drops the bytes once the directory agreed
            b[L.s_gen[loc][k]] = b[L.s_epoch[loc][k]] = 0
            b[L.freed[loc][k]] = max(s[L.s_epoch[loc][k]], s[L.freed[loc][k]])  # as a Free would: late bytes are refused (found in dup)
            rest = net
            if idx == L.draining[k]:
                b[L.draining[k]] = NO_LOCATION
            else:
                if s[L.moving[k]] != NO_LOCATION:
                    # A transfer was under way: its copy may land, and belongs to a generation
                    # that is ending. (Found by the checker: DeletionReachesEverywhere.)
                    rest = list(net)
                    self._owe_free(b, rest, k, s[L.moving[k]], s[L.epoch[k]])
                self._end_generation(b, k)  # the last copy is gone: the key is ABSENT again
            out.append(("evict", (k, loc), self._pack(b, rest)))

    def _transfer_actions(self, s: bytes, fixed: bytes, net: list[bytes], k: int, out: list[Step]) -> None:
        """Promotion / demotion: move the owner copy to another location as an ownership transfer."""
        L, cfg = self.L, self.cfg
        moving, draining = s[L.moving[k]], s[L.draining[k]]
        if not may_start_transfer(s[L.phase[k]], moving != NO_LOCATION, draining != NO_LOCATION):
            if draining != NO_LOCATION:
                in_grace = s[L.grace] > 0 and "restart_without_grace" not in self.bugs
                if may_free_drained(in_grace, self.live_lease_on(s, k, draining)):
                    # The old copy's leases drained: free it.
                    b = bytearray(fixed)
                    rest = list(net)
                    self._owe_free(b, rest, k, draining, s[L.epoch[k]])
                    b[L.draining[k]] = NO_LOCATION
                    out.append(("free_drained", (k,), self._pack(b, rest)))
            if moving != NO_LOCATION:
                # The copy may land after all: its destination is freed under the transfer's
                # epoch, which then refuses it.
                b = bytearray(fixed)
                rest = list(net)
                b[L.moving[k]] = NO_LOCATION
                self._owe_free(b, rest, k, moving, s[L.epoch[k]])
                out.append(("cancel_transfer", (k,), self._pack(b, rest)))
            return
        if s[L.epoch[k]] >= cfg.max_epoch or len(net) >= cfg.max_messages:
            return
        owner = s[L.owner[k]]
        for dest in range(self.LOCS):
            if dest + 1 == owner or not self.location_up(s, dest):
                continue
            b = bytearray(fixed)
            b[L.epoch[k]] = s[L.epoch[k]] if "transfer_keeps_epoch" in self.bugs else next_epoch(s[L.epoch[k]])
            b[L.moving[k]] = dest + 1
            copy = copy_msg(k, dest + 1, owner, s[L.gen[k]], b[L.epoch[k]])
            out.append(("start_transfer", (k, dest), self._pack(b, net + [copy])))

    # -- message delivery ---------------------------------------------------------------------

    def _deliver(self, s: bytes, fixed: bytes, net: list[bytes], msg: bytes, out: list[Step]) -> None:
        kind = msg[0]
        handler = self._handlers[kind]
        handler(self, s, fixed, net, msg, out)

    # directory-bound requests

    def _on_acquire(self, s, fixed, net, msg, out):
        L, cfg = self.L, self.cfg
        _, n, k, req, *_ = msg
        phase = s[L.phase[k]]
        if phase == INVALIDATING and "grant_during_invalidation" in self.bugs:
            phase = COMMITTED  # bug: an invalidating key looks grantable
        authorized = self.allowed[n][k] or "no_namespace_check" in self.bugs
        refusal = may_grant_read(phase, authorized, s[L.r_id[k][n]] != NO_LEASE, self.owner_declared_down(s, k))
        if refusal is not None or s[L.next_id] > cfg.max_lease_id:
            b = bytearray(fixed)
            rest = list(net)
            self._refuse(b, rest, refuse_msg(n, k, req, REFUSED_READ))
            out.append(("refuse_read_lease", (n, k), self._pack(b, rest)))
            return
        b = bytearray(fixed)
        lease = s[L.next_id]
        b[L.next_id] = lease + 1
        loc1 = s[L.owner[k]]
        b[L.r_id[k][n]] = lease
        b[L.r_loc[k][n]] = loc1
        b[L.r_left[k][n]] = self.directory_view
        rest = list(net)
        grant_loc1 = s[L.draining[k]] or loc1 if "grant_names_draining_copy" in self.bugs else loc1
        self._reply(b, rest, grant_read_msg(n, k, lease, grant_loc1, s[L.gen[k]], req))
        out.append(("grant_read_lease", (n, k, lease), self._pack(b, rest)))

    def _on_renew(self, s, fixed, net, msg, out):
        L, cfg = self.L, self.cfg
        _, n, k, lease, loc1, req, _ = msg
        entry = s[L.r_id[k][n]]
        # Renew only a live lease on the current owner of a committed key: never revive one that
        # expired or was revoked, never extend a lease on a copy that is draining.
        if entry == NO_LEASE and "renew_revives_expired" in self.bugs:
            # Bug: the expired entry is taken for a live one, on the owner.
            refusal = may_renew(s[L.phase[k]], True, lease, lease, loc1, loc1)
        else:
            refusal = may_renew(s[L.phase[k]], entry != NO_LEASE, entry, lease, loc1, s[L.owner[k]])
        if refusal is None:
            b = bytearray(fixed)
            b[L.r_id[k][n]] = lease
            b[L.r_loc[k][n]] = loc1
            b[L.r_left[k][n]] = self.directory_view
            rest = list(net)
            self._reply(b, rest, renewed_msg(n, k, lease, req))
            out.append(("renew_lease", (n, k, lease), self._pack(b, rest)))
        else:
            b = bytearray(fixed)
            rest = list(net)
            self._refuse(b, rest, refuse_msg(n, k, req, REFUSED_READ))
            out.append(("refuse_renewal", (n, k, lease), self._pack(b, rest)))

    def _on_release(self, s, fixed, net, msg, out):
        L = self.L
        _, n, k, lease, *_ = msg
        b = bytearray(fixed)
        if may_release(s[L.r_id[k][n]], lease):
            b[L.r_id[k][n]] = b[L.r_loc[k][n]] = b[L.r_left[k][n]] = 0
        out.append(("release_lease", (n, k, lease), self._pack(b, net)))

    def _on_begin_write(self, s, fixed, net, msg, out):
        L, cfg = self.L, self.cfg
        _, n, k, *_ = msg
        parent = cfg.parents[k]
        refusal = may_begin_write(
            ABSENT if "second_write_grant" in self.bugs and s[L.phase[k]] == WRITING else s[L.phase[k]],
            None if parent < 0 else s[L.phase[parent]],
            self.allowed[n][k] or "no_namespace_check" in self.bugs,
        )
        # The epoch and lease-id budgets are scope bounds of the model, not protocol rules.
        if refusal is not None or s[L.epoch[k]] >= cfg.max_epoch or s[L.next_id] > cfg.max_lease_id:
            b = bytearray(fixed)
            rest = list(net)
            self._refuse(b, rest, refuse_msg(n, k, 0, REFUSED_WRITE))
            out.append(("refuse_write_lease", (n, k), self._pack(b, rest)))
            return
        lease = s[L.next_id]
        epoch = next_epoch(s[L.epoch[k]])  # every ownership change takes a new epoch: the fencing token
        for loc in cfg.write_targets(n):
            if not self.location_up(s, loc):
                continue
            b = bytearray(fixed)
            b[L.next_id] = lease + 1
            b[L.phase[k]] = WRITING
            b[L.epoch[k]] = s[L.epoch[k]] if "epoch_not_recorded" in self.bugs else epoch
            b[L.owner[k]] = loc + 1
            b[L.writer[k]] = n + 1
            b[L.w_id[k]] = lease
            b[L.w_left[k]] = self.directory_view
            rest = list(net)
            self._reply(b, rest, grant_write_msg(n, k, lease, loc + 1, s[L.gen[k]], epoch))
            out.append(("grant_write_lease", (n, k, loc), self._pack(b, rest)))

    def _on_commit(self, s, fixed, net, msg, out):
        L = self.L
        _, n, k, lease, _, _, epoch = msg
        phase = s[L.phase[k]]
        refusal = may_commit(
            phase, s[L.w_id[k]], lease, s[L.epoch[k]], epoch, s[L.w_left[k]] > 0, self.declared_down_at(s, s[L.owner[k]])
        )
        if refusal is not None and phase == WRITING and "late_commit_accepted" in self.bugs:
            refusal = None  # bug: any commit of a WRITING key is taken
        b = bytearray(fixed)
        if refusal is None:
            b[L.phase[k]] = COMMITTED
            b[L.writer[k]] = NO_NODE
            b[L.w_id[k]] = b[L.w_left[k]] = 0
            b[L.phase_age[k]] = 0
            out.append(("commit_write", (n, k, lease), self._pack(b, net)))
        else:
            out.append(("reject_stale_commit", (n, k, lease), self._pack(b, net)))

    def _on_ack(self, s, fixed, net, msg, out):
        L = self.L
        _, n, k, lease, *_ = msg
        b = bytearray(fixed)
        if may_ack_revoke(s[L.phase[k]], s[L.r_id[k][n]], lease):
            b[L.r_id[k][n]] = b[L.r_loc[k][n]] = b[L.r_left[k][n]] = 0
        out.append(("revoke_acked", (n, k, lease), self._pack(b, net)))

    def _on_copied(self, s, fixed, net, msg, out):
        L = self.L
        _, _, k, dest1, _, _, epoch = msg
        b = bytearray(fixed)
        if may_finish_transfer(s[L.phase[k]], s[L.moving[k]], dest1, s[L.epoch[k]], epoch, self.declared_down_at(s, dest1)):
            # The new copy is the owner; the old one drains its leases before it is freed.
            b[L.draining[k]] = s[L.owner[k]]
            b[L.owner[k]] = dest1
            b[L.moving[k]] = NO_LOCATION
            out.append(("finish_transfer", (k, dest1 - 1), self._pack(b, net)))
        else:
            out.append(("ignore_stale_copied", (k, dest1 - 1), self._pack(b, net)))

    # node-bound replies

    def _on_grant_read(self, s, fixed, net, msg, out):
        L = self.L
        _, n, k, lease, loc1, gen, req = msg
        b = bytearray(fixed)
        if (
            s[L.up[n]]
            and s[L.p_kind[n][k]] == P_ACQUIRE
            and s[L.p_id[n][k]] == req
            and s[L.h_id[n][k]] == NO_LEASE
        ):
            budget = s[L.p_left[n][k]]
            if "holder_counts_from_receipt" in self.bugs:
                budget = self.holder_budget
            b[L.h_id[n][k]] = lease
            b[L.h_loc[n][k]] = loc1
            b[L.h_gen[n][k]] = gen
            b[L.h_left[n][k]] = budget
            self._end_pending(b, n, k)
            out.append(("trust_read_lease", (n, k, lease), self._pack(b, net)))
        else:
            out.append(("ignore_stale_grant", (n, k, lease), self._pack(b, net)))

    def _on_renewed(self, s, fixed, net, msg, out):
        L = self.L
        _, n, k, lease, _, _, req = msg
        b = bytearray(fixed)
        if (
            s[L.up[n]]
            and s[L.p_kind[n][k]] == P_RENEW
            and s[L.p_id[n][k]] == req
            and s[L.h_id[n][k]] == lease
        ):
            b[L.h_left[n][k]] = s[L.p_left[n][k]]  # counted from when the renewal was sent
            self._end_pending(b, n, k)
            out.append(("trust_renewal", (n, k, lease), self._pack(b, net)))
        else:
            out.append(("ignore_stale_renewal", (n, k, lease), self._pack(b, net)))

    def _on_grant_write(self, s, fixed, net, msg, out):
        L = self.L
        _, n, k, lease, loc1, gen, epoch = msg
        b = bytearray(fixed)
        if s[L.up[n]] and s[L.w_stage[n][k]] == W_REQUESTED:
            # Send the bytes to the granted location at once, tagged with the epoch (the fencing
            # token). However long they take to land -- a pause, a slow network -- the tag is
            # what the location judges them by.
            b[L.w_stage[n][k]] = W_BYTES_SENT
            b[L.write_lost[n][k]] = 0  # the request was answered
            b[L.wr_id[n][k]] = lease
            b[L.wr_gen[n][k]] = gen
            b[L.wr_epoch[n][k]] = epoch
            b[L.wr_loc[n][k]] = loc1
            rest = list(net)
            self._send(rest, write_bytes_msg(n, k, lease, loc1, gen, epoch))
            out.append(("start_writing", (n, k, lease), self._pack(b, rest)))
        else:
            out.append(("ignore_stale_write_grant", (n, k, lease), self._pack(b, net)))

    def _on_revoke(self, s, fixed, net, msg, out):
        L = self.L
        _, n, k, lease, _, gen, _ = msg
        b = bytearray(fixed)
        rest = list(net)
        if s[L.up[n]]:
            trusts = s[L.h_id[n][k]]
            if (trusts == lease or (trusts != 0 and s[L.h_gen[n][k]] == gen)) and "ack_before_drop" not in self.bugs:
                # Drop the copy first, then acknowledge (Chubby's flush-then-ack). A revocation of
                # the generation ends every lease of it this holder trusts, not only the one it
                # names: after a directory restart a holder may trust lease A and be revoked lease B
                # of the same generation (granted to a request it had given up), and acknowledging
                # B while still reading under A breaks NoReadAfterAck. (Found by the z3 proofs.)
                b[L.h_id[n][k]] = b[L.h_loc[n][k]] = b[L.h_gen[n][k]] = b[L.h_left[n][k]] = 0
            if s[L.p_kind[n][k]] != P_NONE and "revoke_keeps_pending_acquire" not in self.bugs:
                # The revocation may overtake the grant it revokes: an acquire still waiting for
                # its grant is cancelled too, or the holder would trust a lease the directory is
                # about to forget on this very ack. (Found by the checker: NoReadAfterAck.)
                self._end_pending(b, n, k)
            if gen == s[L.gen[k]]:
                b[L.acked[n][k]] = 1  # ghost: this node acknowledged the current generation's end
            self._send(rest, ack_msg(n, k, lease))
        out.append(("drop_and_ack", (n, k, lease), self._pack(b, rest)))

    # data plane, at a location

    def _on_write_bytes(self, s, fixed, net, msg, out):
        L = self.L
        _, n, k, lease, loc1, gen, epoch = msg
        loc = loc1 - 1
        b = bytearray(fixed)
        if not self.location_up(s, loc):
            out.append(("write_to_down_location", (n, k, loc), self._pack(b, net)))
            return
        writer_waiting = s[L.up[n]] and s[L.w_stage[n][k]] == W_BYTES_SENT and s[L.wr_id[n][k]] == lease
        if not self._slot_accepts(s, loc, k, epoch):
            # A stale writer (paused past its lease, or a zombie) is refused where the data lives.
            if writer_waiting:
                self._clear_writer(b, n, k)
            out.append(("fence_stale_write", (n, k, loc), self._pack(b, net)))
            return
        b[L.s_status[loc][k]] = FULL
        b[L.s_gen[loc][k]] = gen
        b[L.s_epoch[loc][k]] = epoch
        b[L.fence[loc][k]] = max(epoch, s[L.fence[loc][k]])
        b[L.freed[loc][k]] = 0  # the fence now refuses all it did (states that agree are one)
        rest = net
        if writer_waiting:
            # Published (written, synced, then made visible): the writer asks to commit.
            self._clear_writer(b, n, k)
            rest = list(net)
            self._send(rest, commit_msg(n, k, lease, epoch))
        out.append(("store_bytes", (n, k, loc), self._pack(b, rest)))

    def _slot_accepts(self, s: bytes, loc: int, k: int, epoch: int) -> bool:
        """Does the slot take bytes (a write or a copy) under ``epoch``?"""
        L = self.L
        freed = s[L.freed[loc][k]] if "late_bytes_after_free" not in self.bugs else 0
        fence = s[L.fence[loc][k]] if "no_fencing" not in self.bugs else 0  # bug: no fence
        return slot_accepts(epoch, fence, freed)

    def _on_free(self, s, fixed, net, msg, out):
        L = self.L
        _, _, k, loc1, _, _, epoch = msg
        loc = loc1 - 1
        b = bytearray(fixed)
        if not self.location_up(s, loc):
            out.append(("free_at_down_location", (k, loc), self._pack(b, net)))
            return
        rest = list(net)
        full = s[L.s_status[loc][k]] == FULL
        if not free_takes(epoch, s[L.fence[loc][k]], full, s[L.s_epoch[loc][k]]) and "no_fencing" not in self.bugs:
            # Newer bytes are here (or a newer epoch was seen by an empty slot): whatever that
            # Free was for is gone already.
            self._send(rest, freed_msg(k, loc1, epoch))
            out.append(("fence_stale_free", (k, loc), self._pack(b, rest)))
        else:
            b[L.s_status[loc][k]] = EMPTY
            b[L.s_gen[loc][k]] = b[L.s_epoch[loc][k]] = 0
            b[L.freed[loc][k]] = max(epoch, s[L.freed[loc][k]])
            if b[L.fence[loc][k]] > b[L.freed[loc][k]]:
                b[L.freed[loc][k]] = 0  # the fence refuses all it did
            self._send(rest, freed_msg(k, loc1, epoch))
            out.append(("free_slot", (k, loc), self._pack(b, rest)))

    def _on_freed(self, s, fixed, net, msg, out):
        L = self.L
        _, _, k, loc1, _, _, epoch = msg
        b = bytearray(fixed)
        i = L.to_free[loc1 - 1][k]
        if free_acknowledged(s[i], epoch):
            b[i] = 0
            out.append(("free_acked", (k, loc1 - 1), self._pack(b, net)))
        else:
            out.append(("ignore_stale_freed", (k, loc1 - 1), self._pack(b, net)))

    def _refuse(self, b: bytearray, net: list[bytes], msg: bytes) -> None:
        """Answer a request with a refusal (docs/protocol.md progress: every lease request is answered)."""
        if "silent_refusal" not in self.bugs:
            self._reply(b, net, msg)

    def _on_refuse(self, s, fixed, net, msg, out):
        L = self.L
        _, n, k, req, what, _, _ = msg
        b = bytearray(fixed)
        if what == REFUSED_WRITE:
            if s[L.up[n]] and s[L.w_stage[n][k]] == W_REQUESTED:
                self._clear_writer(b, n, k)  # the writer gives up: nothing to wait for
                out.append(("abort", (n, k), self._pack(b, net)))
                return
        elif s[L.up[n]] and s[L.p_kind[n][k]] != P_NONE and s[L.p_id[n][k]] == req:
            self._end_pending(b, n, k)  # the holder gives up its request: nothing to wait for
            out.append(("abandon", (n, k), self._pack(b, net)))
            return
        out.append(("ignore_stale_refusal", (n, k), self._pack(b, net)))

    def _on_copy(self, s, fixed, net, msg, out):
        L = self.L
        _, _, k, dest1, src1, gen, epoch = msg
        dest, src = dest1 - 1, src1 - 1
        b = bytearray(fixed)
        source_ok = (
            self.location_up(s, src)
            and s[L.s_status[src][k]] == FULL
            and s[L.s_gen[src][k]] == gen
        )
        if not self.location_up(s, dest) or not source_ok:
            out.append(("copy_failed", (k, dest), self._pack(b, net)))
            return
        if not self._slot_accepts(s, dest, k, epoch):
            out.append(("fence_stale_copy", (k, dest), self._pack(b, net)))
            return
        b[L.s_status[dest][k]] = FULL
        b[L.s_gen[dest][k]] = gen
        b[L.s_epoch[dest][k]] = epoch
        b[L.fence[dest][k]] = max(epoch, s[L.fence[dest][k]])
        b[L.freed[dest][k]] = 0  # the fence now refuses all it did
        rest = list(net)
        self._send(rest, copied_msg(k, dest1, epoch))
        out.append(("store_copy", (k, dest), self._pack(b, rest)))

    _handlers: dict[int, Callable] = {
        M_ACQUIRE: _on_acquire,
        M_RENEW: _on_renew,
        M_RELEASE: _on_release,
        M_BEGIN_WRITE: _on_begin_write,
        M_COMMIT: _on_commit,
        M_ACK: _on_ack,
        M_COPIED: _on_copied,
        M_GRANT_READ: _on_grant_read,
        M_RENEWED: _on_renewed,
        M_GRANT_WRITE: _on_grant_write,
        M_REVOKE: _on_revoke,
        M_WRITE_BYTES: _on_write_bytes,
        M_FREE: _on_free,
        M_COPY: _on_copy,
        M_REFUSE: _on_refuse,
        M_FREED: _on_freed,
    }

    # -- failures -----------------------------------------------------------------------------

    def _failures(self, s: bytes, fixed: bytes, net: list[bytes], out: list[Step]) -> None:
        L, cfg = self.L, self.cfg
        for n in range(self.N):
            if s[L.up[n]]:
                if s[L.crashes_left] > 0:
                    kept = self._crash(s, fixed, n, lose_disk=False)
                    lost = self._crash(s, fixed, n, lose_disk=True)
                    out.append(("crash", (n, 0), self._pack(kept, net)))
                    if lost != kept:  # with nothing on its disk, losing it changes nothing
                        out.append(("crash", (n, 1), self._pack(lost, net)))
            else:
                out.append(("restart_node", (n,), self._restart_node(s, fixed, net, n)))
                if self.down_declaration_due(s, n):
                    out.append(("declare_node_down", (n,), self._declare_down(s, fixed, net, n)))
        if s[L.restarts_left] > 0:
            for grace in self.restart_graces(s):
                out.append(("restart_directory", (grace,), self._pack(self._restart_directory(s, fixed, grace), net)))

    def lease_horizon(self, s: bytes) -> int:
        """What a directory that mirrors its leases knows at a restart (``mirrored_leases``): the
        longest any lease it holds may still run on its clock, and the grace it is still in (which
        covers the leases an earlier incarnation granted). Its clock's offset survives the
        restart, so no skew is added: the leases' time left was counted on that clock."""
        L = self.L
        horizon = 0 if "horizon_forgets_grace" in self.bugs else s[L.grace]
        for k in range(self.K):
            for n in range(self.N):
                if s[L.r_id[k][n]]:
                    horizon = max(horizon, s[L.r_left[k][n]])
        if "horizon_short_by_a_tick" in self.bugs:
            horizon = max(0, horizon - 1)
        return horizon

    def restart_graces(self, s: bytes) -> range:
        """The graces a restarted directory may take: the full ``restart_grace`` without a mirror
        of the leases; with one (``mirrored_leases``), any from the horizon (``lease_horizon``,
        ``rules.restart_grace_within``) up to the full grace -- a deployment's horizon is a bound
        it measured, rounded up (etcd counts a lease's time left in whole seconds)."""
        full = self.restart_grace
        if not self.cfg.mirrored_leases:
            return range(full, full + 1)
        return range(restart_grace_within(self.cfg.lease_term_ticks, self.cfg.skew_ticks, self.lease_horizon(s)), full + 1)

    def _crash(self, s: bytes, fixed: bytes, n: int, lose_disk: bool) -> bytearray:
        """kill -9: volatile state is gone; the disk survives unless ``lose_disk``."""
        L, cfg = self.L, self.cfg
        b = bytearray(fixed)
        b[L.up[n]] = 0
        b[L.crashes_left] -= 1
        b[L.detect_left[n]] = self.detection  # the node's registration runs out on the directory
        for k in range(self.K):
            for idx in (L.h_id, L.h_loc, L.h_gen, L.h_left):
                b[idx[n][k]] = 0
            self._end_pending(b, n, k)
            self._clear_writer(b, n, k)
        if lose_disk:
            for loc in range(self.LOCS):
                if self.loc_node[loc] != n:
                    continue
                for k in range(self.K):
                    if b[L.s_status[loc][k]] == FULL:
                        b[L.s_status[loc][k]] = LOST  # a read fails; it never returns other bytes
                    b[L.fence[loc][k]] = 0  # the fence was on that disk too
                    b[L.freed[loc][k]] = 0
        return b

    def _restart_node(self, s: bytes, fixed: bytes, net: list[bytes], n: int) -> bytes:
        """The node comes back (recovery scan done) and re-registers with the directory, which
        forgets the node's leases and every copy the node lost. A lost owner copy is invalidated
        like any other: other nodes may still trust leases on it, so the key becomes writable
        again only once those have been acknowledged or expired. A write in progress to the node is
        aborted: its commit may be on its way, and the bytes it would publish may be gone."""
        L, cfg = self.L, self.cfg
        b = bytearray(fixed)
        rest = list(net)
        b[L.up[n]] = 1
        b[L.known_down[n]] = b[L.detect_left[n]] = 0  # registered again
        for k in range(self.K):
            b[L.r_id[k][n]] = b[L.r_loc[k][n]] = b[L.r_left[k][n]] = 0
            # A node that lost its disk lost its fences too: it takes them back from the
            # directory, whose epoch bounds every epoch ever issued, so that no message from
            # before the crash (a stale free, a zombie's bytes) can land. (Found by the checker:
            # a stale Free of the lost copy was accepted under a reset fence.)
            for loc in range(self.LOCS):
                if self.loc_node[loc] == n:
                    b[L.fence[loc][k]] = restored_fence(b[L.fence[loc][k]], s[L.epoch[k]])
                    # Likewise what it freed: bytes the directory does not want may still be on
                    # their way (a paused writer's, a cancelled transfer's).
                    wanted = loc + 1 in (s[L.owner[k]], s[L.draining[k]], s[L.moving[k]])
                    b[L.freed[loc][k]] = restored_freed_epoch(b[L.freed[loc][k]], wanted, s[L.epoch[k]])
                    if b[L.fence[loc][k]] > b[L.freed[loc][k]]:
                        b[L.freed[loc][k]] = 0  # the fence refuses all it did
        for k in range(self.K):
            for idx in (L.owner[k], L.draining[k], L.moving[k]):
                loc1 = s[idx]
                if loc1 == NO_LOCATION or self.loc_node[loc1 - 1] != n:
                    continue
                if idx == L.moving[k]:
                    b[idx] = NO_LOCATION  # the copy in progress died with the node (or landed):
                    self._owe_free(b, rest, k, loc1, s[L.epoch[k]])
                elif lost_copy_invalidates(b[L.phase[k]], idx == L.owner[k], s[L.s_status[loc1 - 1][k]] == LOST) and not (
                    "write_survives_rejoin" in self.bugs and b[L.phase[k]] == WRITING  # bug: the write goes on
                ):
                    committed = b[L.phase[k]] == COMMITTED
                    self._invalidate_into(s, b, rest, self.subtree[k])
                    b[L.gen[k]] += committed and "lost_copy_ends_generation" in self.bugs  # bug: the next generation at once
        return self._pack(b, rest)

    def _declare_down(self, s: bytes, fixed: bytes, net: list[bytes], n: int) -> bytes:
        """The failure detector declares the silent node ``n`` down (its registration ran out). The
        directory leases nothing there any more, and voids every COMMITTED key whose owner copy is
        there, with its subtree: the leases on it are revoked and expire, and the key is writable
        again within the failover deadline (P4). The copies themselves are freed when the
        invalidation completes, and reach the node when it is back (docs/protocol.md: deletion).

        Why a detector with a bound and not the crash itself: the directory cannot see a kill -9;
        it sees a node stop renewing its registration (a lease of one term). A node that comes back
        before that (``restart_node``) re-registers, and the directory forgets what it lost."""
        L = self.L
        b = bytearray(fixed)
        rest = list(net)
        b[L.known_down[n]] = 1
        for k in range(self.K):
            loc1 = s[L.owner[k]]
            on_n = loc1 != NO_LOCATION and self.loc_node[loc1 - 1] == n
            if down_owner_invalidates(b[L.phase[k]], on_n):
                self._invalidate_into(s, b, rest, self.subtree[k])
        return self._pack(b, rest)

    def _restart_directory(self, s: bytes, fixed: bytes, grace: int) -> bytearray:
        """The directory process restarts from its durable log: records survive, the lease table
        and timers do not. It frees nothing for ``grace`` (``restart_graces``)."""
        L, cfg = self.L, self.cfg
        b = bytearray(fixed)
        b[L.restarts_left] -= 1
        for k in range(self.K):
            for n in range(self.N):
                b[L.r_id[k][n]] = b[L.r_loc[k][n]] = b[L.r_left[k][n]] = 0
            if s[L.phase[k]] == WRITING:
                b[L.w_left[k]] = self.restart_grace  # the writer may still hold its lease
        if "epochs_not_durable" in self.bugs:
            b[L.epoch_block] = bytes(self.K)  # bug: epochs were kept in memory only
        if "restart_without_grace" not in self.bugs:
            b[L.grace] = grace
        if "lease_id_reuse_after_restart" in self.bugs:
            b[L.next_id] = 1  # the counter was not in the durable log
        return b


def _params_match(given: tuple, step: tuple) -> bool:
    for g, v in zip(given, step):
        if g is not None and g != v:
            return False
    return True


# Which generator of ``successors`` produces each label (``Model.apply``). Deliveries name the
# message kinds whose handler may answer with the label.
_APPLY_SOURCES: dict[str, tuple[tuple, ...]] = {
    **{a: (("holder",),) for a in ("acquire", "renew", "read", "release")},
    "abandon": (("holder",), ("deliver", (M_REFUSE,))),
    "begin_write": (("writer",),),
    "abort": (("writer",), ("deliver", (M_REFUSE,))),
    **{a: (("directory",),) for a in (
        "expire_write_lease", "expire_write_lease_of_crashed", "invalidate", "complete_invalidation", "evict",
        "evict_refused", "start_transfer", "free_drained", "cancel_transfer", "retry_free",
    )},  # fmt: skip
    **{a: (("deliver", (M_ACQUIRE,)),) for a in ("grant_read_lease", "refuse_read_lease")},
    **{a: (("deliver", (M_RENEW,)),) for a in ("renew_lease", "refuse_renewal")},
    "release_lease": (("deliver", (M_RELEASE,)),),
    **{a: (("deliver", (M_BEGIN_WRITE,)),) for a in ("grant_write_lease", "refuse_write_lease")},
    **{a: (("deliver", (M_COMMIT,)),) for a in ("commit_write", "reject_stale_commit")},
    "revoke_acked": (("deliver", (M_ACK,)),),
    **{a: (("deliver", (M_COPIED,)),) for a in ("finish_transfer", "ignore_stale_copied")},
    **{a: (("deliver", (M_GRANT_READ,)),) for a in ("trust_read_lease", "ignore_stale_grant")},
    **{a: (("deliver", (M_RENEWED,)),) for a in ("trust_renewal", "ignore_stale_renewal")},
    **{a: (("deliver", (M_GRANT_WRITE,)),) for a in ("start_writing", "ignore_stale_write_grant")},
    "drop_and_ack": (("deliver", (M_REVOKE,)),),
    **{a: (("deliver", (M_WRITE_BYTES,)),) for a in ("store_bytes", "fence_stale_write", "write_to_down_location")},
    **{a: (("deliver", (M_FREE,)),) for a in ("free_slot", "fence_stale_free", "free_at_down_location")},
    **{a: (("deliver", (M_COPY,)),) for a in ("store_copy", "copy_failed", "fence_stale_copy")},
    "ignore_stale_refusal": (("deliver", (M_REFUSE,)),),
    **{a: (("deliver", (M_FREED,)),) for a in ("free_acked", "ignore_stale_freed")},
    **{a: (("time",),) for a in ("tick", "clock_forward", "clock_back")},
    **{a: (("failures",),) for a in ("crash", "restart_node", "restart_directory", "declare_node_down")},
}
