"""The protocol of ``spec/model.py`` as a z3 transition system over unbounded scopes.

Theory of operation
-------------------
``model.py`` explores a finite scope: a state is a ``bytes`` value with one byte per variable per
node, key and location. Here the same state is a *first-order structure*, in the style of mypyvy and
Ivy: nodes, keys, locations and messages are elements of uninterpreted sorts (``Node``, ``Key``,
``Loc``, ``Msg``), so a proof quantifies over every number of them; lease ids, request numbers,
generations, epochs and every tick counter are unbounded integers; the lease term ``T`` and the
skew bound ``EPS`` are symbolic (any ``T > EPS >= 0``), so one proof covers every configuration.

Vocabulary (same names as ``layout.Layout``, same index order):

- the directory's record per key: ``phase`` (ABSENT/WRITING/COMMITTED/INVALIDATING), ``gen``,
  ``epoch``, ``owner``, ``moving``, ``draining``, ``writer``, ``w_id``, ``w_left``;
- its read-lease table per (key, node): ``r_id``, ``r_loc``, ``r_left`` (ticks left on the
  directory's clock), and ``dir_off``, ``grace``, ``next_id``;
- per node: ``up``, ``off`` (how far its clock fell behind), ``req`` (last request number);
- holder state per (node, key): ``h_id``, ``h_loc``, ``h_gen``, ``h_left`` (trust left on the
  holder's clock) and the pending request ``p_kind``, ``p_id``, ``p_left`` (budget counted from
  *sending* the request);
- writer state per (node, key): ``w_stage``, ``wr_id``, ``wr_gen``, ``wr_epoch``, ``wr_loc``;
- storage per (location, key): ``s_status`` (EMPTY/FULL/LOST), ``s_gen``, ``s_epoch``, ``fence``;
- the network: ``inflight`` (a set of ``Msg`` elements). A message's kind and fields are rigid
  functions of the element (``kind``, ``m_node``, ``m_key``, ``m_lease``, ``m_loc``, ``m_src``,
  ``m_gen``, ``m_epoch``, ``m_req``); sending asserts a fresh element with the right fields.
- rigid topology: ``NOLOC`` (the model's ``NO_LOCATION``), ``is_pool(l)``, ``locnode(l)``;
  ``allowed(n, k)`` (the tenant's namespaces); the prefix tree: ``has_parent(k)`` and ``parent(k)``
  (any relation at all: the proofs hold for every forest, and for structures that are none).

Time is exactly the model's: there is no absolute clock, every deadline is a counter of ticks left on
the clock that owns it. ``tick`` runs every counter down by one; a counter that reaches zero expires
and clears what it guards (a lease-table entry, a trusted lease, a pending request); a counter that
is already zero stays zero. ``clock_forward`` steps the directory's clock ahead (``dir_off + 1``,
its counters run down by one); ``clock_back(n)`` steps node ``n``'s clock back (``off[n] + 1``, its
counters run *up* by one, expired ones stay expired). Each clock moves at most ``EPS`` in all, as in
the model.

Abstractions (each an over-approximation, so a proof here covers ``model.py``):

- The network is a set, not a bounded multiset. A sent message is always added; a delivered message
  *stays* in flight (it may be delivered again: duplication), and ``drop`` removes any message
  (loss, including the model's "network full" loss on send). Every handler outcome that only
  consumes its message (``ignore_stale_*``, a fenced copy, a failed copy, a message to a down
  location or node) is therefore ``drop``.
- Any request may be refused (``refuse_*`` answer with a ``LeaseRefused``): the model refuses by its
  rules and by its scope budgets, the encoding at any time.
- Scope budgets are dropped: ``max_epoch``, ``max_lease_id``, ``max_requests``, ``max_messages``,
  crash/restart/duplication budgets, the ``readers``/``writers`` roles, ``writes_to_pool_only``.
- An invalidation of a subtree (or a namespace, or the lost-owner invalidation in
  ``restart_node``) is a sequence of single-key steps ``invalidate(k)`` / ``invalidate_writing(k)``,
  children first: ``invalidate(k)`` is enabled when the key is COMMITTED and none of its children
  is WRITING or COMMITTED any more (``invalidate_writing(k)`` whenever the key is WRITING). Every
  subtree and every namespace (chains stay in one) can be voided in that order, so the sequence
  reaches the model's successor, through states the invariant also covers (``refinement`` checks
  that it does, step by step). The other prefix guards are the model's: a write is granted only
  under a COMMITTED parent (``may_begin_write``), a copy is evicted only when every child is ABSENT
  (``may_evict``). With them ``PrefixClosed`` (protocol property 10) is proved like any other property.
- ``tick`` is enabled even when a directory timer is due (the model's urgency rule only serves
  bounded response).
- ``restart_node(n)`` is the model's restart without its invalidation part (see above).
- The directory's failure detector (``detect_left``, ``known_down``) is not encoded: it decides only
  when a down node's keys are voided (``declare_node_down``: here, invalidations, allowed at any
  time) and refuses leases on a copy declared down (here, granted).
- Ghost variables of the progress properties (ages, lost-exchange flags) are not encoded; the
  ``acked`` ghost is, because ``NoReadAfterAck`` (a safety property, on history) reads it.
- ``read`` changes nothing and is omitted; ``evict_refused`` likewise. ``refinement`` checks every
  one of these claims on the model's reachable steps and lists what it projects away.

Mutant flags of ``mutants.py`` are honoured at the same lines as in ``model.py``
(``SUPPORTED_BUGS``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import z3

# ---------------------------------------------------------------------------------------- sorts

Node = z3.DeclareSort("Node")
Key = z3.DeclareSort("Key")
Loc = z3.DeclareSort("Loc")
Msg = z3.DeclareSort("Msg")
INT = z3.IntSort()
BOOL = z3.BoolSort()

Phase, (ABSENT, WRITING, COMMITTED, INVALIDATING) = z3.EnumSort(
    "Phase", ("ABSENT", "WRITING", "COMMITTED", "INVALIDATING")
)
SlotStatus, (EMPTY, FULL, LOST) = z3.EnumSort("SlotStatus", ("EMPTY", "FULL", "LOST"))
Stage, (W_NONE, W_REQUESTED, W_BYTES_SENT) = z3.EnumSort("Stage", ("NONE", "REQUESTED", "BYTES_SENT"))
Pending, (P_NONE, P_ACQUIRE, P_RENEW) = z3.EnumSort("Pending", ("P_NONE", "ACQUIRE", "RENEW"))

KIND_NAMES = (
    "ACQUIRE", "RENEW", "GRANT_READ", "RENEWED", "RELEASE", "BEGIN_WRITE", "GRANT_WRITE",
    "WRITE_BYTES", "COMMIT", "REVOKE", "ACK", "FREE", "COPY", "COPIED", "REFUSE", "FREED",
)
Kind, _kinds = z3.EnumSort("Kind", KIND_NAMES)
K_ = dict(zip(KIND_NAMES, _kinds))
(M_ACQUIRE, M_RENEW, M_GRANT_READ, M_RENEWED, M_RELEASE, M_BEGIN_WRITE, M_GRANT_WRITE,
 M_WRITE_BYTES, M_COMMIT, M_REVOKE, M_ACK, M_FREE, M_COPY, M_COPIED, M_REFUSE, M_FREED) = _kinds

# Rigid symbols: configuration, topology, message fields.
T = z3.Int("lease_term")
EPS = z3.Int("skew")
NOLOC = z3.Const("NOLOC", Loc)
is_pool = z3.Function("is_pool", Loc, BOOL)
locnode = z3.Function("locnode", Loc, Node)
allowed = z3.Function("allowed", Node, Key, BOOL)
has_parent = z3.Function("has_parent", Key, BOOL)
parent = z3.Function("parent", Key, Key)

kind = z3.Function("kind", Msg, Kind)
m_node = z3.Function("m_node", Msg, Node)
m_key = z3.Function("m_key", Msg, Key)
m_lease = z3.Function("m_lease", Msg, INT)
m_loc = z3.Function("m_loc", Msg, Loc)  # the location a message names (dest for copies)
m_src = z3.Function("m_src", Msg, Loc)  # a copy's source
m_gen = z3.Function("m_gen", Msg, INT)
m_epoch = z3.Function("m_epoch", Msg, INT)
m_req = z3.Function("m_req", Msg, INT)
m_what = z3.Function("m_what", Msg, INT)  # what a refusal answers: REFUSED_READ (0) or REFUSED_WRITE (1)
REFUSED_READ, REFUSED_WRITE = 0, 1

# Which fields each kind uses (the others are don't-cares), in the model's message vocabulary.
KIND_FIELDS: dict[str, tuple[str, ...]] = {
    "ACQUIRE": ("node", "key", "req"),
    "RENEW": ("node", "key", "lease", "loc", "req"),
    "GRANT_READ": ("node", "key", "lease", "loc", "gen", "req"),
    "RENEWED": ("node", "key", "lease", "req"),
    "RELEASE": ("node", "key", "lease"),
    "BEGIN_WRITE": ("node", "key"),
    "GRANT_WRITE": ("node", "key", "lease", "loc", "gen", "epoch"),
    "WRITE_BYTES": ("node", "key", "lease", "loc", "gen", "epoch"),
    "COMMIT": ("node", "key", "lease", "epoch"),
    "REVOKE": ("node", "key", "lease", "gen"),
    "ACK": ("node", "key", "lease"),
    "FREE": ("key", "loc", "epoch"),
    "COPY": ("key", "loc", "src", "gen", "epoch"),
    "COPIED": ("key", "loc", "epoch"),
    "REFUSE": ("node", "key", "req", "what"),
    "FREED": ("key", "loc", "epoch"),
}
FIELD_FUNS = {
    "node": m_node, "key": m_key, "lease": m_lease, "loc": m_loc, "src": m_src,
    "gen": m_gen, "epoch": m_epoch, "req": m_req, "what": m_what,
}

# Mutant flags (names as in model.MUTANT_FLAGS) this encoding implements.
SUPPORTED_BUGS = frozenset(
    {
        "holder_ignores_skew",
        "holder_counts_from_receipt",
        "invalidation_ignores_leases",
        "evict_under_lease",
        "restart_without_grace",
        "no_fencing",
        "renew_revives_expired",
        "late_commit_accepted",
        "ack_before_drop",
        "lease_id_reuse_after_restart",
        "grant_during_invalidation",
        "no_namespace_check",
        "invalidation_waits_for_acks",
        "write_lease_never_expires",
        "evict_parent_first",
        "invalidate_without_cascade",
        "horizon_forgets_grace",
        "horizon_short_by_a_tick",
    }
)


def config_axioms() -> z3.BoolRef:
    """What ``ModelConfig`` asserts about the lease term and the skew bound."""
    return z3.And(T > EPS, EPS >= 0)


def directory_lease_ticks() -> z3.ArithRef:
    return T + EPS


def restart_grace_ticks() -> z3.ArithRef:
    return T + 2 * EPS


def design_holder_budget() -> z3.ArithRef:
    """The holder budget the design prescribes: term - epsilon (``holder_budget_ticks``)."""
    return T - EPS


def holder_budget(bugs: frozenset[str]) -> z3.ArithRef:
    return T if "holder_ignores_skew" in bugs else T - EPS


def loc_up(s: "State", loc: z3.ExprRef) -> z3.BoolRef:
    """``Model.location_up``: the shared pool never goes down; a node's tier is up with its node."""
    return z3.Or(is_pool(loc), s.up[locnode(loc)])


def children_not_live(s: "State", k: z3.ExprRef) -> z3.BoolRef:
    """No child of ``k`` is WRITING or COMMITTED: ``k`` may be voided without orphaning one."""
    c = z3.Const("ch_c", Key)
    return z3.ForAll([c], z3.Implies(z3.And(has_parent(c), parent(c) == k),
                                     z3.And(s.phase[c] != WRITING, s.phase[c] != COMMITTED)))


def children_absent(s: "State", k: z3.ExprRef) -> z3.BoolRef:
    """Every child of ``k`` is ABSENT (``may_evict``: leaves before their ancestors, protocol property 10)."""
    c = z3.Const("ch_c", Key)
    return z3.ForAll([c], z3.Implies(z3.And(has_parent(c), parent(c) == k), s.phase[c] == ABSENT))


def parent_committed(s: "State", k: z3.ExprRef) -> z3.BoolRef:
    """A root, or a key whose parent is COMMITTED (``may_begin_write``, protocol property 10)."""
    return z3.Implies(has_parent(k), s.phase[parent(k)] == COMMITTED)


def on_node(loc: z3.ExprRef, n: z3.ExprRef) -> z3.BoolRef:
    """``loc_node[loc] == n`` for a real location."""
    return z3.And(loc != NOLOC, z3.Not(is_pool(loc)), locnode(loc) == n)


# ---------------------------------------------------------------------------------------- state

# name -> (index sorts, value sort); index order as in ``Layout``.
STATE_VARS: dict[str, tuple[tuple[z3.SortRef, ...], z3.SortRef]] = {
    "phase": ((Key,), Phase),
    "gen": ((Key,), INT),
    "epoch": ((Key,), INT),
    "owner": ((Key,), Loc),
    "moving": ((Key,), Loc),
    "draining": ((Key,), Loc),
    "writer": ((Key,), Node),
    "w_id": ((Key,), INT),
    "w_left": ((Key,), INT),
    "to_free": ((Loc, Key), INT),
    "r_id": ((Key, Node), INT),
    "r_loc": ((Key, Node), Loc),
    "r_left": ((Key, Node), INT),
    "dir_off": ((), INT),
    "grace": ((), INT),
    "next_id": ((), INT),
    "up": ((Node,), BOOL),
    "off": ((Node,), INT),
    "req": ((Node,), INT),
    "h_id": ((Node, Key), INT),
    "h_loc": ((Node, Key), Loc),
    "h_gen": ((Node, Key), INT),
    "h_left": ((Node, Key), INT),
    "p_kind": ((Node, Key), Pending),
    "p_id": ((Node, Key), INT),
    "p_left": ((Node, Key), INT),
    "w_stage": ((Node, Key), Stage),
    "wr_id": ((Node, Key), INT),
    "wr_gen": ((Node, Key), INT),
    "wr_epoch": ((Node, Key), INT),
    "wr_loc": ((Node, Key), Loc),
    "s_status": ((Loc, Key), SlotStatus),
    "s_gen": ((Loc, Key), INT),
    "s_epoch": ((Loc, Key), INT),
    "fence": ((Loc, Key), INT),
    "freed": ((Loc, Key), INT),
    "acked": ((Node, Key), BOOL),
    "inflight": ((Msg,), BOOL),
}


class State:
    """One copy of the vocabulary: each variable is a z3 array (or a scalar) term."""

    def __init__(self, terms: dict[str, z3.ExprRef]) -> None:
        self.terms = dict(terms)

    @classmethod
    def fresh(cls, prefix: str) -> "State":
        terms = {}
        for name, (idx, val) in STATE_VARS.items():
            if idx:
                terms[name] = z3.Array(f"{prefix}{name}", *idx, val)
            else:
                terms[name] = z3.Const(f"{prefix}{name}", val)
        return cls(terms)

    def __getattr__(self, name: str) -> z3.ExprRef:
        try:
            return self.__dict__["terms"][name]
        except KeyError:
            raise AttributeError(name) from None

    def update(self, **changes: z3.ExprRef) -> "State":
        for name in changes:
            assert name in STATE_VARS, name
        return State({**self.terms, **changes})


# ---------------------------------------------------------------------------------------- helpers

_fresh_counter = [0]


def fresh(name: str, sort: z3.SortRef) -> z3.ExprRef:
    _fresh_counter[0] += 1
    return z3.Const(f"{name}!{_fresh_counter[0]}", sort)


def fields_are(m: z3.ExprRef, kind_name: str, **values) -> z3.BoolRef:
    """``m`` is a message of that kind with those fields."""
    conj = [kind(m) == K_[kind_name]]
    for fname, value in values.items():
        assert fname in KIND_FIELDS[kind_name], (kind_name, fname)
        conj.append(FIELD_FUNS[fname](m) == value)
    return z3.And(conj)


def msg_of(s: State, m: z3.ExprRef, kind_name: str) -> z3.BoolRef:
    return z3.And(s.inflight[m], kind(m) == K_[kind_name])


def run_counter(v: z3.ArithRef, delta: int) -> tuple[z3.ArithRef, z3.BoolRef]:
    """``Model._run_down`` on one counter: (new value, expired now)."""
    expired = z3.And(v != 0, v - delta <= 0)
    return z3.If(v == 0, v, z3.If(v - delta <= 0, 0, v - delta)), expired


@dataclass
class Action:
    """One transition: parameters, guard, post-state (and extra side constraints on fresh terms)."""

    name: str
    python: tuple[str, ...]  # the model's action labels this action stands for
    params: dict[str, z3.ExprRef]
    guard: z3.BoolRef
    post: State
    side: list[z3.BoolRef] = field(default_factory=list)  # constraints on sent messages
    sent: dict[str, z3.ExprRef] = field(default_factory=dict)  # fresh message elements
    delivered: z3.ExprRef | None = None  # the delivered message, if any
    lose_disk: bool = False  # the one action EpochMonotonic exempts for fences

    def relation(self) -> z3.BoolRef:
        return z3.And(self.guard, *self.side)


# ---------------------------------------------------------------------------------------- actions


class Protocol:
    """Every action of ``model.py`` (abstracted as the module docstring says), for a set of bugs."""

    def __init__(self, bugs: Iterable[str] = ()) -> None:
        self.bugs = frozenset(bugs)
        unknown = self.bugs - SUPPORTED_BUGS
        assert not unknown, f"bug flags the z3 encoding does not implement: {sorted(unknown)}"

    def bug(self, name: str) -> bool:
        assert name in SUPPORTED_BUGS
        return name in self.bugs

    # -- shared pieces ----------------------------------------------------------------------

    def _send(self, s: State, act_sent: dict, side: list, label: str, kind_name: str, **values):
        m = fresh(f"sent_{label}", Msg)
        side.append(fields_are(m, kind_name, **values))
        act_sent[label] = m
        return z3.Store(s.inflight, m, True), m

    def _end_generation(self, s: State, k) -> dict:
        """``Model._end_generation``: back to ABSENT with the next generation (acks were of the one
        that ended)."""
        nn, kk = z3.Const("eg_n", Node), z3.Const("eg_k", Key)
        return dict(
            acked=z3.Lambda([nn, kk], z3.If(kk == k, False, s.acked[nn, kk])),
            phase=z3.Store(s.phase, k, ABSENT),
            gen=z3.Store(s.gen, k, s.gen[k] + 1),
            owner=z3.Store(s.owner, k, NOLOC),
            moving=z3.Store(s.moving, k, NOLOC),
            draining=z3.Store(s.draining, k, NOLOC),
            w_id=z3.Store(s.w_id, k, 0),
            w_left=z3.Store(s.w_left, k, 0),
        )

    def _clear_writer(self, s: State, n, k) -> dict:
        return dict(
            w_stage=z3.Store(s.w_stage, n, k, W_NONE),
            wr_id=z3.Store(s.wr_id, n, k, 0),
            wr_gen=z3.Store(s.wr_gen, n, k, 0),
            wr_epoch=z3.Store(s.wr_epoch, n, k, 0),
            wr_loc=z3.Store(s.wr_loc, n, k, NOLOC),
        )

    def _clear_lease_entry(self, s: State, k, n) -> dict:
        return dict(
            r_id=z3.Store(s.r_id, k, n, 0),
            r_loc=z3.Store(s.r_loc, k, n, NOLOC),
            r_left=z3.Store(s.r_left, k, n, 0),
        )

    def _clear_holder(self, s: State, n, k) -> dict:
        return dict(
            h_id=z3.Store(s.h_id, n, k, 0),
            h_loc=z3.Store(s.h_loc, n, k, NOLOC),
            h_gen=z3.Store(s.h_gen, n, k, 0),
            h_left=z3.Store(s.h_left, n, k, 0),
        )

    def _clear_pending(self, s: State, n, k) -> dict:
        return dict(
            p_kind=z3.Store(s.p_kind, n, k, P_NONE),
            p_id=z3.Store(s.p_id, n, k, 0),
            p_left=z3.Store(s.p_left, n, k, 0),
        )

    def _owe_free(self, s: State, to_free, infl, sent: dict, side: list, label: str, k, loc, epoch, when=None):
        """``Model._owe_free``: record the Free as owed (the highest epoch owed covers the lower
        ones) and send it; ``when``: only if that holds (the location may be ``NOLOC``)."""
        m = fresh(f"sent_{label}", Msg)
        side.append(fields_are(m, "FREE", key=k, loc=loc, epoch=epoch))
        sent[label] = m
        owed = z3.Store(to_free, loc, k, z3.If(epoch > to_free[loc, k], epoch, to_free[loc, k]))
        infl2 = z3.Store(infl, m, True)
        if when is None:
            return owed, infl2
        return z3.If(when, owed, to_free), z3.If(when, infl2, infl)

    def live_lease_on(self, s: State, k, loc) -> z3.BoolRef:
        n = z3.Const("lo_n", Node)
        return z3.Exists([n], z3.And(s.r_id[k, n] != 0, s.r_loc[k, n] == loc))

    def has_live_lease(self, s: State, k) -> z3.BoolRef:
        n = z3.Const("hl_n", Node)
        return z3.Exists([n], s.r_id[k, n] != 0)

    def _directory_timers(self, s: State, delta: int) -> dict:
        """Run the directory's counters (grace, write-lease timers, the lease table) by ``delta``."""
        k, n = z3.Const("dt_k", Key), z3.Const("dt_n", Node)
        grace, _ = run_counter(s.grace, delta)
        w_left, _ = run_counter(s.w_left[k], delta)
        r_left, expired = run_counter(s.r_left[k, n], delta)
        if self.bug("invalidation_waits_for_acks"):
            frozen = s.phase[k] == INVALIDATING
            r_left = z3.If(frozen, s.r_left[k, n], r_left)
            expired = z3.And(z3.Not(frozen), expired)
        return dict(
            grace=grace,
            w_left=z3.Lambda([k], w_left),
            r_left=z3.Lambda([k, n], r_left),
            r_id=z3.Lambda([k, n], z3.If(expired, 0, s.r_id[k, n])),
            r_loc=z3.Lambda([k, n], z3.If(expired, NOLOC, s.r_loc[k, n])),
        )

    def _node_timers(self, s: State, delta: int, only=None) -> dict:
        """Run holders' counters (trust, pending budget) by ``delta``, for every node or ``only``."""
        n, k = z3.Const("nt_n", Node), z3.Const("nt_k", Key)
        applies = z3.BoolVal(True) if only is None else (n == only)
        h_left, h_exp = run_counter(s.h_left[n, k], delta)
        p_left, p_exp = run_counter(s.p_left[n, k], delta)
        h_exp = z3.And(applies, h_exp)
        p_exp = z3.And(applies, p_exp)
        out = dict(
            h_left=z3.Lambda([n, k], z3.If(applies, h_left, s.h_left[n, k])),
            h_id=z3.Lambda([n, k], z3.If(h_exp, 0, s.h_id[n, k])),
            h_loc=z3.Lambda([n, k], z3.If(h_exp, NOLOC, s.h_loc[n, k])),
            h_gen=z3.Lambda([n, k], z3.If(h_exp, 0, s.h_gen[n, k])),
        )
        if not self.bug("holder_counts_from_receipt"):
            # (The bug: nothing runs on the holder's clock until the grant arrives.)
            out.update(
                p_left=z3.Lambda([n, k], z3.If(applies, p_left, s.p_left[n, k])),
                p_kind=z3.Lambda([n, k], z3.If(p_exp, P_NONE, s.p_kind[n, k])),
                p_id=z3.Lambda([n, k], z3.If(p_exp, 0, s.p_id[n, k])),
            )
        return out

    # -- the actions ------------------------------------------------------------------------

    def actions(self, s: State) -> list[Action]:
        out: list[Action] = []
        for make in (
            self.tick, self.clock_forward, self.clock_back,
            self.acquire, self.renew, self.abandon, self.release, self.begin_write, self.abort,
            self.expire_write_lease, self.invalidate, self.invalidate_writing,
            self.complete_invalidation, self.evict_owner, self.evict_draining,
            self.start_transfer, self.cancel_transfer, self.free_drained,
            self.grant_read_lease, self.renew_lease, self.release_lease, self.grant_write_lease,
            self.commit_write, self.revoke_acked, self.finish_transfer,
            self.trust_read_lease, self.trust_renewal, self.start_writing, self.drop_and_ack,
            self.store_bytes, self.fence_stale_write, self.free_slot, self.store_copy,
            self.crash, self.crash_lose_disk, self.restart_node, self.restart_directory, self.drop,
            self.clock_lag, self.refuse_read_lease, self.refuse_renewal, self.refuse_write_lease,
            self.retry_free, self.free_acked, self.fence_stale_free,
        ):
            out.append(make(s))
        return out

    # time

    def tick(self, s: State) -> Action:
        upd = self._directory_timers(s, 1)
        upd.update(self._node_timers(s, 1))
        return Action("tick", ("tick",), {}, z3.BoolVal(True), s.update(**upd))

    def clock_forward(self, s: State) -> Action:
        upd = self._directory_timers(s, 1)
        upd["dir_off"] = s.dir_off + 1
        return Action("clock_forward", ("clock_forward",), {}, s.dir_off < EPS, s.update(**upd))

    def clock_lag(self, s: State) -> Action:
        """A directory clock that falls behind (``directory_clock_lags``): its counters run up."""
        upd = self._directory_timers(s, -1)
        upd["dir_off"] = s.dir_off + 1
        return Action("clock_lag", ("clock_back",), {}, s.dir_off < EPS, s.update(**upd))

    def clock_back(self, s: State) -> Action:
        n = fresh("n", Node)
        upd = self._node_timers(s, -1, only=n)
        upd["off"] = z3.Store(s.off, n, s.off[n] + 1)
        guard = z3.And(s.up[n], s.off[n] < EPS)
        return Action("clock_back", ("clock_back",), {"n": n}, guard, s.update(**upd))

    # holder side

    def _request(self, s: State, name: str, renew: bool) -> Action:
        n, k = fresh("n", Node), fresh("k", Key)
        req = s.req[n] + 1
        guard = z3.And(s.up[n], s.p_kind[n, k] == P_NONE, (s.h_id[n, k] != 0) if renew else (s.h_id[n, k] == 0))
        side, sent = [], {}
        if renew:
            infl, _ = self._send(s, sent, side, "renew", "RENEW", node=n, key=k, lease=s.h_id[n, k],
                                 loc=s.h_loc[n, k], req=req)
        else:
            infl, _ = self._send(s, sent, side, "acquire", "ACQUIRE", node=n, key=k, req=req)
        post = s.update(
            req=z3.Store(s.req, n, req),
            p_id=z3.Store(s.p_id, n, k, req),
            p_left=z3.Store(s.p_left, n, k, holder_budget(self.bugs)),
            p_kind=z3.Store(s.p_kind, n, k, P_RENEW if renew else P_ACQUIRE),
            inflight=infl,
        )
        return Action(name, (name,), {"n": n, "k": k}, guard, post, side, sent)

    def acquire(self, s: State) -> Action:
        return self._request(s, "acquire", renew=False)

    def renew(self, s: State) -> Action:
        return self._request(s, "renew", renew=True)

    def abandon(self, s: State) -> Action:
        n, k = fresh("n", Node), fresh("k", Key)
        guard = z3.And(s.up[n], s.p_kind[n, k] != P_NONE)
        return Action("abandon", ("abandon",), {"n": n, "k": k}, guard, s.update(**self._clear_pending(s, n, k)))

    def release(self, s: State) -> Action:
        n, k = fresh("n", Node), fresh("k", Key)
        guard = z3.And(s.up[n], s.h_id[n, k] != 0)
        side, sent = [], {}
        infl, _ = self._send(s, sent, side, "release", "RELEASE", node=n, key=k, lease=s.h_id[n, k])
        upd = self._clear_holder(s, n, k)
        renewing = s.p_kind[n, k] == P_RENEW
        cleared = self._clear_pending(s, n, k)
        for name, term in cleared.items():
            upd[name] = z3.If(renewing, term, getattr(s, name))
        upd["inflight"] = infl
        return Action("release", ("release",), {"n": n, "k": k}, guard, s.update(**upd), side, sent)

    # writer side

    def begin_write(self, s: State) -> Action:
        n, k = fresh("n", Node), fresh("k", Key)
        guard = z3.And(s.up[n], s.w_stage[n, k] == W_NONE)
        side, sent = [], {}
        infl, _ = self._send(s, sent, side, "begin_write", "BEGIN_WRITE", node=n, key=k)
        post = s.update(w_stage=z3.Store(s.w_stage, n, k, W_REQUESTED), inflight=infl)
        return Action("begin_write", ("begin_write",), {"n": n, "k": k}, guard, post, side, sent)

    def abort(self, s: State) -> Action:
        n, k = fresh("n", Node), fresh("k", Key)
        guard = z3.And(s.up[n], z3.Or(s.w_stage[n, k] == W_REQUESTED, s.w_stage[n, k] == W_BYTES_SENT))
        return Action("abort", ("abort",), {"n": n, "k": k}, guard, s.update(**self._clear_writer(s, n, k)))

    # directory internal actions

    def expire_write_lease(self, s: State) -> Action:
        k = fresh("k", Key)
        guard = z3.And(s.phase[k] == WRITING, s.w_left[k] == 0)
        if self.bug("write_lease_never_expires"):
            guard = z3.BoolVal(False)
        upd, sent, side = self._free_ended_write(s, k)
        return Action("expire_write_lease", ("expire_write_lease", "expire_write_lease_of_crashed"),
                      {"k": k}, guard, s.update(**upd), side, sent)

    def _free_ended_write(self, s: State, k) -> tuple[dict, dict, list]:
        """End the generation of a write that never committed, and free what it may have stored."""
        sent, side = {}, []
        to_free, infl = self._owe_free(s, s.to_free, s.inflight, sent, side, "free_write", k, s.owner[k], s.epoch[k],
                                       when=s.owner[k] != NOLOC)
        upd = self._end_generation(s, k)
        upd.update(to_free=to_free, inflight=infl)
        return upd, sent, side

    def invalidate(self, s: State) -> Action:
        """One COMMITTED key of an invalidated subtree / namespace / lost owner: revoke its leases."""
        k = fresh("k", Key)
        m = z3.Const("inv_m", Msg)
        revoke = z3.And(
            kind(m) == M_REVOKE, m_key(m) == k, s.r_id[k, m_node(m)] != 0, m_lease(m) == s.r_id[k, m_node(m)],
            m_gen(m) == s.gen[k],
        )
        sent, side = {}, []
        # An unfinished transfer is abandoned, its destination freed.
        to_free, infl = self._owe_free(s, s.to_free, z3.Lambda([m], z3.Or(s.inflight[m], revoke)), sent, side,
                                       "free_moving", k, s.moving[k], s.epoch[k], when=s.moving[k] != NOLOC)
        post = s.update(
            phase=z3.Store(s.phase, k, INVALIDATING),
            moving=z3.Store(s.moving, k, NOLOC),
            inflight=infl,
            to_free=to_free,
        )
        guard = s.phase[k] == COMMITTED
        if not self.bug("invalidate_without_cascade"):
            guard = z3.And(guard, children_not_live(s, k))  # children first (module docstring)
        return Action("invalidate", ("invalidate", "invalidate_namespace", "restart_node", "declare_node_down"), {"k": k},
                      guard, post,
                      side, sent)

    def invalidate_writing(self, s: State) -> Action:
        """A WRITING key below an invalidated prefix: the write is aborted (end of generation)."""
        k = fresh("k", Key)
        upd, sent, side = self._free_ended_write(s, k)
        return Action("invalidate_writing", ("invalidate", "invalidate_namespace", "restart_node", "declare_node_down"),
                      {"k": k},
                      s.phase[k] == WRITING, s.update(**upd), side, sent)

    def completion_enabled(self, s: State, k) -> z3.BoolRef:
        conj = [s.phase[k] == INVALIDATING]
        if not self.bug("restart_without_grace"):
            conj.append(s.grace == 0)
        if not self.bug("invalidation_ignores_leases"):
            conj.append(z3.Not(self.has_live_lease(s, k)))
        return z3.And(conj)

    def complete_invalidation(self, s: State) -> Action:
        k = fresh("k", Key)
        side, sent = [], {}
        infl, to_free = s.inflight, s.to_free
        for label, loc in (("free_owner", s.owner[k]), ("free_draining", s.draining[k])):
            to_free, infl = self._owe_free(s, to_free, infl, sent, side, label, k, loc, s.epoch[k], when=loc != NOLOC)
        upd = self._end_generation(s, k)
        upd["inflight"] = infl
        upd["to_free"] = to_free
        return Action("complete_invalidation", ("complete_invalidation",), {"k": k},
                      self.completion_enabled(s, k), s.update(**upd), side, sent)

    def _evict(self, s: State, which: str) -> Action:
        k = fresh("k", Key)
        loc = s.owner[k] if which == "owner" else s.draining[k]
        conj = [s.phase[k] == COMMITTED, loc != NOLOC, loc_up(s, loc)]
        if not self.bug("restart_without_grace"):
            conj.append(s.grace == 0)
        if not self.bug("evict_parent_first"):
            conj.append(children_absent(s, k))
        if not self.bug("evict_under_lease"):
            conj.append(z3.Not(self.live_lease_on(s, k, loc)))
        if which == "owner":
            conj.append(s.draining[k] == NOLOC)  # the draining copy goes first
        upd = dict(
            s_status=z3.Store(s.s_status, loc, k, EMPTY),
            s_gen=z3.Store(s.s_gen, loc, k, 0),
            s_epoch=z3.Store(s.s_epoch, loc, k, 0),
            # As a Free would, the slot remembers the epoch it dropped: late bytes are refused
            # (model.py's eviction; found in the `dup` configuration).
            freed=z3.Store(s.freed, loc, k, z3.If(s.s_epoch[loc, k] > s.freed[loc, k], s.s_epoch[loc, k], s.freed[loc, k])),
        )
        sent, side = {}, []
        if which == "owner":
            upd.update(self._end_generation(s, k))
            # A transfer under way: its copy may land, and belongs to a generation that ends.
            upd["to_free"], upd["inflight"] = self._owe_free(s, s.to_free, s.inflight, sent, side, "free_moving", k,
                                                             s.moving[k], s.epoch[k], when=s.moving[k] != NOLOC)
        else:
            upd["draining"] = z3.Store(s.draining, k, NOLOC)
        return Action(f"evict_{which}", ("evict",), {"k": k}, z3.And(conj), s.update(**upd), side, sent)

    def evict_owner(self, s: State) -> Action:
        return self._evict(s, "owner")

    def evict_draining(self, s: State) -> Action:
        return self._evict(s, "draining")

    def start_transfer(self, s: State) -> Action:
        k, dest = fresh("k", Key), fresh("dest", Loc)
        guard = z3.And(
            s.phase[k] == COMMITTED, s.moving[k] == NOLOC, s.draining[k] == NOLOC,
            dest != NOLOC, dest != s.owner[k], loc_up(s, dest),
        )
        epoch = s.epoch[k] + 1
        side, sent = [], {}
        infl, _ = self._send(s, sent, side, "copy", "COPY", key=k, loc=dest, src=s.owner[k], gen=s.gen[k], epoch=epoch)
        post = s.update(epoch=z3.Store(s.epoch, k, epoch), moving=z3.Store(s.moving, k, dest), inflight=infl)
        return Action("start_transfer", ("start_transfer",), {"k": k, "dest": dest}, guard, post, side, sent)

    def cancel_transfer(self, s: State) -> Action:
        k = fresh("k", Key)
        guard = z3.And(s.phase[k] == COMMITTED, s.moving[k] != NOLOC)
        sent, side = {}, []
        # The copy may land after all: its destination is freed under the transfer's epoch.
        to_free, infl = self._owe_free(s, s.to_free, s.inflight, sent, side, "free_moving", k, s.moving[k],
                                       s.epoch[k])
        return Action("cancel_transfer", ("cancel_transfer",), {"k": k}, guard,
                      s.update(moving=z3.Store(s.moving, k, NOLOC), to_free=to_free, inflight=infl), side, sent)

    def free_drained(self, s: State) -> Action:
        k = fresh("k", Key)
        conj = [s.phase[k] == COMMITTED, s.draining[k] != NOLOC, z3.Not(self.live_lease_on(s, k, s.draining[k]))]
        if not self.bug("restart_without_grace"):
            conj.append(s.grace == 0)
        side, sent = [], {}
        to_free, infl = self._owe_free(s, s.to_free, s.inflight, sent, side, "free", k, s.draining[k], s.epoch[k])
        post = s.update(draining=z3.Store(s.draining, k, NOLOC), inflight=infl, to_free=to_free)
        return Action("free_drained", ("free_drained",), {"k": k}, z3.And(conj), post, side, sent)

    # directory-bound messages

    def _delivery(self, s: State, kind_name: str):
        m = fresh(f"msg_{kind_name.lower()}", Msg)
        return m, msg_of(s, m, kind_name)

    def grant_read_lease(self, s: State) -> Action:
        m, inflight = self._delivery(s, "ACQUIRE")
        n, k, req = m_node(m), m_key(m), m_req(m)
        grantable = s.phase[k] == COMMITTED
        if self.bug("grant_during_invalidation"):
            grantable = z3.Or(grantable, s.phase[k] == INVALIDATING)
        conj = [inflight, grantable, s.r_id[k, n] == 0]
        if not self.bug("no_namespace_check"):
            conj.append(allowed(n, k))
        lease = s.next_id
        side, sent = [], {}
        infl, _ = self._send(s, sent, side, "grant", "GRANT_READ", node=n, key=k, lease=lease, loc=s.owner[k],
                             gen=s.gen[k], req=req)
        post = s.update(
            next_id=lease + 1,
            r_id=z3.Store(s.r_id, k, n, lease),
            r_loc=z3.Store(s.r_loc, k, n, s.owner[k]),
            r_left=z3.Store(s.r_left, k, n, directory_lease_ticks()),
            inflight=infl,
        )
        return Action("grant_read_lease", ("grant_read_lease",), {"m": m}, z3.And(conj), post, side, sent, m)

    def renew_lease(self, s: State) -> Action:
        m, inflight = self._delivery(s, "RENEW")
        n, k, lease, loc, req = m_node(m), m_key(m), m_lease(m), m_loc(m), m_req(m)
        live = s.r_id[k, n] == lease
        if self.bug("renew_revives_expired"):
            revive = s.r_id[k, n] == 0
            ok = z3.And(z3.Or(live, revive), s.phase[k] == COMMITTED, z3.Or(loc == s.owner[k], revive))
        else:
            ok = z3.And(live, s.phase[k] == COMMITTED, loc == s.owner[k])
        side, sent = [], {}
        infl, _ = self._send(s, sent, side, "renewed", "RENEWED", node=n, key=k, lease=lease, req=req)
        post = s.update(
            r_id=z3.Store(s.r_id, k, n, lease),
            r_loc=z3.Store(s.r_loc, k, n, loc),
            r_left=z3.Store(s.r_left, k, n, directory_lease_ticks()),
            inflight=infl,
        )
        return Action("renew_lease", ("renew_lease",), {"m": m}, z3.And(inflight, ok), post, side, sent, m)

    def release_lease(self, s: State) -> Action:
        m, inflight = self._delivery(s, "RELEASE")
        n, k, lease = m_node(m), m_key(m), m_lease(m)
        match = s.r_id[k, n] == lease
        upd = {name: z3.If(match, term, getattr(s, name)) for name, term in self._clear_lease_entry(s, k, n).items()}
        return Action("release_lease", ("release_lease",), {"m": m}, inflight, s.update(**upd), delivered=m)

    def grant_write_lease(self, s: State) -> Action:
        m, inflight = self._delivery(s, "BEGIN_WRITE")
        n, k = m_node(m), m_key(m)
        loc = fresh("loc", Loc)  # one of ``write_targets(n)`` that is up
        conj = [inflight, s.phase[k] == ABSENT, parent_committed(s, k), loc != NOLOC,
                z3.Or(is_pool(loc), locnode(loc) == n), loc_up(s, loc)]
        if not self.bug("no_namespace_check"):
            conj.append(allowed(n, k))
        lease, epoch = s.next_id, s.epoch[k] + 1
        side, sent = [], {}
        infl, _ = self._send(s, sent, side, "grant", "GRANT_WRITE", node=n, key=k, lease=lease, loc=loc,
                             gen=s.gen[k], epoch=epoch)
        post = s.update(
            next_id=lease + 1,
            phase=z3.Store(s.phase, k, WRITING),
            epoch=z3.Store(s.epoch, k, epoch),
            owner=z3.Store(s.owner, k, loc),
            writer=z3.Store(s.writer, k, n),
            w_id=z3.Store(s.w_id, k, lease),
            w_left=z3.Store(s.w_left, k, directory_lease_ticks()),
            inflight=infl,
        )
        return Action("grant_write_lease", ("grant_write_lease",), {"m": m, "loc": loc}, z3.And(conj), post,
                      side, sent, m)

    def commit_write(self, s: State) -> Action:
        m, inflight = self._delivery(s, "COMMIT")
        k, lease, epoch = m_key(m), m_lease(m), m_epoch(m)
        ok = z3.And(s.phase[k] == WRITING, s.w_id[k] == lease, s.epoch[k] == epoch, s.w_left[k] > 0)
        if self.bug("late_commit_accepted"):
            ok = s.phase[k] == WRITING
        post = s.update(phase=z3.Store(s.phase, k, COMMITTED), w_id=z3.Store(s.w_id, k, 0),
                        w_left=z3.Store(s.w_left, k, 0))
        return Action("commit_write", ("commit_write",), {"m": m}, z3.And(inflight, ok), post, delivered=m)

    def revoke_acked(self, s: State) -> Action:
        m, inflight = self._delivery(s, "ACK")
        n, k, lease = m_node(m), m_key(m), m_lease(m)
        match = z3.And(s.phase[k] == INVALIDATING, s.r_id[k, n] == lease)
        upd = {name: z3.If(match, term, getattr(s, name)) for name, term in self._clear_lease_entry(s, k, n).items()}
        return Action("revoke_acked", ("revoke_acked",), {"m": m}, inflight, s.update(**upd), delivered=m)

    def finish_transfer(self, s: State) -> Action:
        m, inflight = self._delivery(s, "COPIED")
        k, dest, epoch = m_key(m), m_loc(m), m_epoch(m)
        ok = z3.And(s.phase[k] == COMMITTED, s.moving[k] == dest, s.epoch[k] == epoch)
        post = s.update(
            draining=z3.Store(s.draining, k, s.owner[k]),
            owner=z3.Store(s.owner, k, dest),
            moving=z3.Store(s.moving, k, NOLOC),
        )
        return Action("finish_transfer", ("finish_transfer",), {"m": m}, z3.And(inflight, ok), post, delivered=m)

    # node-bound messages

    def trust_read_lease(self, s: State) -> Action:
        m, inflight = self._delivery(s, "GRANT_READ")
        n, k = m_node(m), m_key(m)
        ok = z3.And(s.up[n], s.p_kind[n, k] == P_ACQUIRE, s.p_id[n, k] == m_req(m), s.h_id[n, k] == 0)
        budget = holder_budget(self.bugs) if self.bug("holder_counts_from_receipt") else s.p_left[n, k]
        upd = dict(
            h_id=z3.Store(s.h_id, n, k, m_lease(m)),
            h_loc=z3.Store(s.h_loc, n, k, m_loc(m)),
            h_gen=z3.Store(s.h_gen, n, k, m_gen(m)),
            h_left=z3.Store(s.h_left, n, k, budget),
        )
        upd.update(self._clear_pending(s, n, k))
        return Action("trust_read_lease", ("trust_read_lease",), {"m": m}, z3.And(inflight, ok), s.update(**upd),
                      delivered=m)

    def trust_renewal(self, s: State) -> Action:
        m, inflight = self._delivery(s, "RENEWED")
        n, k = m_node(m), m_key(m)
        ok = z3.And(s.up[n], s.p_kind[n, k] == P_RENEW, s.p_id[n, k] == m_req(m), s.h_id[n, k] == m_lease(m))
        upd = dict(h_left=z3.Store(s.h_left, n, k, s.p_left[n, k]))  # counted from sending the renewal
        upd.update(self._clear_pending(s, n, k))
        return Action("trust_renewal", ("trust_renewal",), {"m": m}, z3.And(inflight, ok), s.update(**upd),
                      delivered=m)

    def start_writing(self, s: State) -> Action:
        m, inflight = self._delivery(s, "GRANT_WRITE")
        n, k = m_node(m), m_key(m)
        ok = z3.And(s.up[n], s.w_stage[n, k] == W_REQUESTED)
        side, sent = [], {}
        infl, _ = self._send(s, sent, side, "bytes", "WRITE_BYTES", node=n, key=k, lease=m_lease(m), loc=m_loc(m),
                             gen=m_gen(m), epoch=m_epoch(m))
        post = s.update(
            w_stage=z3.Store(s.w_stage, n, k, W_BYTES_SENT),
            wr_id=z3.Store(s.wr_id, n, k, m_lease(m)),
            wr_gen=z3.Store(s.wr_gen, n, k, m_gen(m)),
            wr_epoch=z3.Store(s.wr_epoch, n, k, m_epoch(m)),
            wr_loc=z3.Store(s.wr_loc, n, k, m_loc(m)),
            inflight=infl,
        )
        return Action("start_writing", ("start_writing",), {"m": m}, z3.And(inflight, ok), post, side, sent, m)

    def drop_and_ack(self, s: State) -> Action:
        m, inflight = self._delivery(s, "REVOKE")
        n, k, lease = m_node(m), m_key(m), m_lease(m)
        upd: dict = {}
        if not self.bug("ack_before_drop"):
            # A revocation of the generation ends every lease of it the holder trusts (model.py).
            drop = z3.Or(s.h_id[n, k] == lease, z3.And(s.h_id[n, k] != 0, s.h_gen[n, k] == m_gen(m)))
            upd.update({name: z3.If(drop, t, getattr(s, name)) for name, t in self._clear_holder(s, n, k).items()})
        upd.update(self._clear_pending(s, n, k))  # clearing an empty pending request changes nothing
        # Ghost (NoReadAfterAck on history): this node acknowledged the current generation's end.
        upd["acked"] = z3.Store(s.acked, n, k, z3.Or(s.acked[n, k], m_gen(m) == s.gen[k]))
        side, sent = [], {}
        infl, _ = self._send(s, sent, side, "ack", "ACK", node=n, key=k, lease=lease)
        upd["inflight"] = infl
        return Action("drop_and_ack", ("drop_and_ack",), {"m": m}, z3.And(inflight, s.up[n]), s.update(**upd),
                      side, sent, m)

    # data plane

    def _writer_waiting(self, s: State, m) -> z3.BoolRef:
        n, k = m_node(m), m_key(m)
        return z3.And(s.up[n], s.w_stage[n, k] == W_BYTES_SENT, s.wr_id[n, k] == m_lease(m))

    def slot_accepts(self, s: State, loc, k, epoch) -> z3.BoolRef:
        """``rules.slot_accepts``: at least the fence, above the highest epoch freed there."""
        if self.bug("no_fencing"):
            return epoch > s.freed[loc, k]  # the bug drops the fence, not the freed epoch
        return z3.And(epoch >= s.fence[loc, k], epoch > s.freed[loc, k])

    def store_bytes(self, s: State) -> Action:
        m, inflight = self._delivery(s, "WRITE_BYTES")
        n, k, loc, epoch = m_node(m), m_key(m), m_loc(m), m_epoch(m)
        conj = [inflight, loc_up(s, loc), self.slot_accepts(s, loc, k, epoch)]
        waiting = self._writer_waiting(s, m)
        side, sent = [], {}
        infl, _ = self._send(s, sent, side, "commit", "COMMIT", node=n, key=k, lease=m_lease(m), epoch=epoch)
        upd = dict(
            s_status=z3.Store(s.s_status, loc, k, FULL),
            s_gen=z3.Store(s.s_gen, loc, k, m_gen(m)),
            s_epoch=z3.Store(s.s_epoch, loc, k, epoch),
            fence=z3.Store(s.fence, loc, k, z3.If(epoch > s.fence[loc, k], epoch, s.fence[loc, k])),
            freed=z3.Store(s.freed, loc, k, 0),  # the fence now refuses all the freed epoch did
            inflight=z3.If(waiting, infl, s.inflight),
        )
        for name, t in self._clear_writer(s, n, k).items():
            upd[name] = z3.If(waiting, t, getattr(s, name))
        return Action("store_bytes", ("store_bytes",), {"m": m}, z3.And(conj), s.update(**upd), side, sent, m)

    def fence_stale_write(self, s: State) -> Action:
        m, inflight = self._delivery(s, "WRITE_BYTES")
        n, k, loc = m_node(m), m_key(m), m_loc(m)
        guard = z3.And(inflight, loc_up(s, loc), z3.Not(self.slot_accepts(s, loc, k, m_epoch(m))))
        waiting = self._writer_waiting(s, m)
        upd = {name: z3.If(waiting, t, getattr(s, name)) for name, t in self._clear_writer(s, n, k).items()}
        return Action("fence_stale_write", ("fence_stale_write",), {"m": m}, guard, s.update(**upd), delivered=m)

    def free_takes(self, s: State, loc, k, epoch) -> z3.BoolRef:
        """``rules.free_takes``: a Free deletes bytes of its epoch or older, never newer ones; an
        empty slot takes it (to remember the epoch freed) only if its fence would."""
        if self.bug("no_fencing"):
            return z3.BoolVal(True)
        return z3.If(s.s_status[loc, k] == FULL, s.s_epoch[loc, k] <= epoch, epoch >= s.fence[loc, k])

    def free_slot(self, s: State) -> Action:
        m, inflight = self._delivery(s, "FREE")
        k, loc = m_key(m), m_loc(m)
        conj = [inflight, loc_up(s, loc), self.free_takes(s, loc, k, m_epoch(m))]
        epoch = m_epoch(m)
        freed = z3.If(epoch > s.freed[loc, k], epoch, s.freed[loc, k])
        side, sent = [], {}
        infl, _ = self._send(s, sent, side, "freed", "FREED", key=k, loc=loc, epoch=epoch)
        upd = dict(
            s_status=z3.Store(s.s_status, loc, k, EMPTY),
            s_gen=z3.Store(s.s_gen, loc, k, 0),
            s_epoch=z3.Store(s.s_epoch, loc, k, 0),
            # The epoch freed, unless the fence already refuses all it would.
            freed=z3.Store(s.freed, loc, k, z3.If(s.fence[loc, k] > freed, 0, freed)),
            inflight=infl,
        )
        return Action("free_slot", ("free_slot",), {"m": m}, z3.And(conj), s.update(**upd), side, sent, m)

    def fence_stale_free(self, s: State) -> Action:
        """A Free that takes nothing (newer bytes are there): nothing freed, but answered (``Freed``)."""
        m, inflight = self._delivery(s, "FREE")
        k, loc, epoch = m_key(m), m_loc(m), m_epoch(m)
        guard = z3.And(inflight, loc_up(s, loc), z3.Not(self.free_takes(s, loc, k, epoch)))
        side, sent = [], {}
        infl, _ = self._send(s, sent, side, "freed", "FREED", key=k, loc=loc, epoch=epoch)
        return Action("fence_stale_free", ("fence_stale_free",), {"m": m}, guard, s.update(inflight=infl), side,
                      sent, m)

    def free_acked(self, s: State) -> Action:
        """A ``Freed`` at least as recent as the Free owed settles it (``rules.free_acknowledged``)."""
        m, inflight = self._delivery(s, "FREED")
        k, loc = m_key(m), m_loc(m)
        guard = z3.And(inflight, s.to_free[loc, k] != 0, m_epoch(m) >= s.to_free[loc, k])
        return Action("free_acked", ("free_acked",), {"m": m}, guard,
                      s.update(to_free=z3.Store(s.to_free, loc, k, 0)), delivered=m)

    def retry_free(self, s: State) -> Action:
        """The directory re-sends an owed Free to a location that is up (``rules.may_retry_free``)."""
        k, loc = fresh("k", Key), fresh("loc", Loc)
        guard = z3.And(loc != NOLOC, s.to_free[loc, k] != 0, loc_up(s, loc))
        side, sent = [], {}
        infl, _ = self._send(s, sent, side, "free", "FREE", key=k, loc=loc, epoch=s.to_free[loc, k])
        return Action("retry_free", ("retry_free",), {"k": k, "loc": loc}, guard, s.update(inflight=infl), side, sent)

    def _refuse(self, s: State, name: str, kind_name: str, what: int) -> Action:
        """A request answered with a refusal. Any request may be: the model refuses for its rules
        and for its scope budgets, which the encoding does not have."""
        m, inflight = self._delivery(s, kind_name)
        req = m_req(m) if what == REFUSED_READ else z3.IntVal(0)
        side, sent = [], {}
        infl, _ = self._send(s, sent, side, "refusal", "REFUSE", node=m_node(m), key=m_key(m), req=req, what=what)
        return Action(name, (name,), {"m": m}, inflight, s.update(inflight=infl), side, sent, m)

    def refuse_read_lease(self, s: State) -> Action:
        return self._refuse(s, "refuse_read_lease", "ACQUIRE", REFUSED_READ)

    def refuse_renewal(self, s: State) -> Action:
        return self._refuse(s, "refuse_renewal", "RENEW", REFUSED_READ)

    def refuse_write_lease(self, s: State) -> Action:
        return self._refuse(s, "refuse_write_lease", "BEGIN_WRITE", REFUSED_WRITE)

    def store_copy(self, s: State) -> Action:
        m, inflight = self._delivery(s, "COPY")
        k, dest, src, gen, epoch = m_key(m), m_loc(m), m_src(m), m_gen(m), m_epoch(m)
        conj = [
            inflight, loc_up(s, src), s.s_status[src, k] == FULL, s.s_gen[src, k] == gen, loc_up(s, dest),
            self.slot_accepts(s, dest, k, epoch),
        ]
        side, sent = [], {}
        infl, _ = self._send(s, sent, side, "copied", "COPIED", key=k, loc=dest, epoch=epoch)
        upd = dict(
            s_status=z3.Store(s.s_status, dest, k, FULL),
            s_gen=z3.Store(s.s_gen, dest, k, gen),
            s_epoch=z3.Store(s.s_epoch, dest, k, epoch),
            fence=z3.Store(s.fence, dest, k, z3.If(epoch > s.fence[dest, k], epoch, s.fence[dest, k])),
            freed=z3.Store(s.freed, dest, k, 0),
            inflight=infl,
        )
        return Action("store_copy", ("store_copy",), {"m": m}, z3.And(conj), s.update(**upd), side, sent, m)

    # failures

    def _crash(self, s: State, lose_disk: bool) -> Action:
        n = fresh("n", Node)
        nn, kk, ll = z3.Const("cr_n", Node), z3.Const("cr_k", Key), z3.Const("cr_l", Loc)
        mine = nn == n

        def wipe(name, zero):
            arr = getattr(s, name)
            return z3.Lambda([nn, kk], z3.If(mine, zero, arr[nn, kk]))

        upd = dict(up=z3.Store(s.up, n, False))
        for name, zero in (("h_id", 0), ("h_loc", NOLOC), ("h_gen", 0), ("h_left", 0), ("p_kind", P_NONE),
                           ("p_id", 0), ("p_left", 0), ("w_stage", W_NONE), ("wr_id", 0), ("wr_gen", 0),
                           ("wr_epoch", 0), ("wr_loc", NOLOC)):
            upd[name] = wipe(name, zero)
        if lose_disk:
            lost = on_node(ll, n)
            upd["s_status"] = z3.Lambda(
                [ll, kk], z3.If(z3.And(lost, s.s_status[ll, kk] == FULL), LOST, s.s_status[ll, kk])
            )
            upd["fence"] = z3.Lambda([ll, kk], z3.If(lost, 0, s.fence[ll, kk]))
            upd["freed"] = z3.Lambda([ll, kk], z3.If(lost, 0, s.freed[ll, kk]))
        name = "crash_lose_disk" if lose_disk else "crash"
        return Action(name, ("crash",), {"n": n}, s.up[n], s.update(**upd), lose_disk=lose_disk)

    def crash(self, s: State) -> Action:
        return self._crash(s, lose_disk=False)

    def crash_lose_disk(self, s: State) -> Action:
        return self._crash(s, lose_disk=True)

    def restart_node(self, s: State) -> Action:
        n = fresh("n", Node)
        kk, nn, ll = z3.Const("rn_k", Key), z3.Const("rn_n", Node), z3.Const("rn_l", Loc)
        mine = nn == n
        restore = z3.And(on_node(ll, n), s.fence[ll, kk] < s.epoch[kk])
        fence = z3.If(restore, s.epoch[kk], s.fence[ll, kk])
        # ``rules.restored_freed_epoch``: where the directory wants no bytes of the key, the key's
        # epoch counts as freed (bytes that land late there are refused).
        wanted = z3.Or(ll == s.owner[kk], ll == s.draining[kk], ll == s.moving[kk])
        restored_freed = z3.If(z3.And(z3.Not(wanted), s.epoch[kk] > s.freed[ll, kk]), s.epoch[kk], s.freed[ll, kk])
        moving_lost = z3.And(s.moving[kk] != NOLOC, on_node(s.moving[kk], n))
        # The copy in progress died with the node (or landed): its destination is freed.
        m = z3.Const("rn_m", Msg)
        mk = m_key(m)
        free_moving = z3.And(kind(m) == M_FREE, z3.substitute(moving_lost, (kk, mk)), m_loc(m) == s.moving[mk],
                             m_epoch(m) == s.epoch[mk])
        owed = z3.If(s.epoch[kk] > s.to_free[ll, kk], s.epoch[kk], s.to_free[ll, kk])
        post = s.update(
            to_free=z3.Lambda([ll, kk], z3.If(z3.And(moving_lost, ll == s.moving[kk]), owed, s.to_free[ll, kk])),
            inflight=z3.Lambda([m], z3.Or(s.inflight[m], free_moving)),
            freed=z3.Lambda([ll, kk], z3.If(on_node(ll, n), z3.If(fence > restored_freed, 0, restored_freed),
                                            s.freed[ll, kk])),
            up=z3.Store(s.up, n, True),
            r_id=z3.Lambda([kk, nn], z3.If(mine, 0, s.r_id[kk, nn])),
            r_loc=z3.Lambda([kk, nn], z3.If(mine, NOLOC, s.r_loc[kk, nn])),
            r_left=z3.Lambda([kk, nn], z3.If(mine, 0, s.r_left[kk, nn])),
            fence=z3.Lambda([ll, kk], fence),
            moving=z3.Lambda([kk], z3.If(moving_lost, NOLOC, s.moving[kk])),
        )
        return Action("restart_node", ("restart_node",), {"n": n}, z3.Not(s.up[n]), post)

    def restart_directory(self, s: State) -> Action:
        kk, nn = z3.Const("rd_k", Key), z3.Const("rd_n", Node)
        upd = dict(
            r_id=z3.Lambda([kk, nn], z3.IntVal(0)),
            r_loc=z3.Lambda([kk, nn], NOLOC),
            r_left=z3.Lambda([kk, nn], z3.IntVal(0)),
            w_left=z3.Lambda([kk], z3.If(s.phase[kk] == WRITING, restart_grace_ticks(), s.w_left[kk])),
        )
        # The grace taken (``Model.restart_graces``): the full one, or -- a directory that mirrors
        # its leases -- any from the horizon (the longest lease in its table may still run, and
        # the grace it is in) up to the full one. Both models' restarts are instances.
        grace = fresh("rd_grace", INT)
        slack = 1 if self.bug("horizon_short_by_a_tick") else 0
        covers = [z3.ForAll([kk, nn], z3.Implies(s.r_id[kk, nn] != 0, s.r_left[kk, nn] <= grace + slack))]
        if not self.bug("horizon_forgets_grace"):
            covers.append(s.grace <= grace + slack)
        guard = z3.Or(grace == restart_grace_ticks(), z3.And(grace <= restart_grace_ticks(), *covers))
        if not self.bug("restart_without_grace"):
            upd["grace"] = grace
        else:
            guard = z3.BoolVal(True)
        if self.bug("lease_id_reuse_after_restart"):
            upd["next_id"] = z3.IntVal(1)
        return Action("restart_directory", ("restart_directory",), {"grace": grace}, guard, s.update(**upd))

    def drop(self, s: State) -> Action:
        m = fresh("msg_dropped", Msg)
        post = s.update(inflight=z3.Store(s.inflight, m, False))
        return Action("drop", ("drop",), {"m": m}, s.inflight[m], post, delivered=m)


def initial(s: State) -> z3.BoolRef:
    """``Model.init_states``: every node up, nothing written, lease ids from 1, an empty network."""
    n, k, l, m = z3.Const("i_n", Node), z3.Const("i_k", Key), z3.Const("i_l", Loc), z3.Const("i_m", Msg)
    return z3.And(
        s.dir_off == 0, s.grace == 0, s.next_id == 1,
        z3.ForAll([k], z3.And(
            s.phase[k] == ABSENT, s.gen[k] == 0, s.epoch[k] == 0, s.owner[k] == NOLOC, s.moving[k] == NOLOC,
            s.draining[k] == NOLOC, s.w_id[k] == 0, s.w_left[k] == 0,
        )),
        z3.ForAll([l, k], z3.And(s.to_free[l, k] == 0, s.freed[l, k] == 0)),
        z3.ForAll([n, k], z3.Not(s.acked[n, k])),
        z3.ForAll([k, n], z3.And(s.r_id[k, n] == 0, s.r_loc[k, n] == NOLOC, s.r_left[k, n] == 0)),
        z3.ForAll([n], z3.And(s.up[n], s.off[n] == 0, s.req[n] == 0)),
        z3.ForAll([n, k], z3.And(
            s.h_id[n, k] == 0, s.h_loc[n, k] == NOLOC, s.h_gen[n, k] == 0, s.h_left[n, k] == 0,
            s.p_kind[n, k] == P_NONE, s.p_id[n, k] == 0, s.p_left[n, k] == 0,
            s.w_stage[n, k] == W_NONE, s.wr_id[n, k] == 0, s.wr_gen[n, k] == 0, s.wr_epoch[n, k] == 0,
            s.wr_loc[n, k] == NOLOC,
        )),
        z3.ForAll([l, k], z3.And(s.s_status[l, k] == EMPTY, s.s_gen[l, k] == 0, s.s_epoch[l, k] == 0,
                                 s.fence[l, k] == 0)),
        z3.ForAll([m], z3.Not(s.inflight[m])),
    )
