"""Does the z3 encoding refine ``model.py``? Checked on every step of the reachable states.

A proof about ``encoding.Protocol`` says something about ``model.Model`` only if every step the
model can take is a step the encoding allows. ``simulation`` asks z3 that question for a sample of
steps; this module answers it for *every* step of every reachable state of a configuration (or, for
the configurations too large for that, for a documented covering subset), fast enough for CI.

Theory of operation
-------------------
The encoding's actions are z3 terms. Over one configuration every quantifier of an action ranges
over a finite set (its nodes, keys, locations), so the terms can be *evaluated* on a concrete state
instead of solved: ``_Compiler`` turns each action's guard, the fields of each message it sends and
each post-state term into Python closures, once, and evaluates them on the model's states. The
terms evaluated are the very terms the obligations are proved about (same ``Protocol``, same
``Action`` objects), so a wrong encoding is caught here exactly where it differs from the model.

Concrete values: a node or key is its index, a location its model code (``NO_LOCATION`` = 0 =
``NOLOC``, else location + 1), an enum its model code (the orders agree; ``model.py`` asserts the
phases), a message element a pair ``(fields, tag)`` where ``fields`` is
``(KIND, node, key, lease, loc, src, gen, epoch, req)`` with the fields a kind does not carry at 0,
and ``tag`` tells elements with equal fields apart (the n-th copy in flight, the message an action
sent, a spare element). An array is a Python function of its indices; ``Store`` and ``Lambda``
build new functions. ``is_pool``, ``locnode``, ``allowed``, ``has_parent`` and ``parent`` are the configuration's topology;
reading a cell the encoding leaves unconstrained (the slot at ``NOLOC``, the node of the pool)
raises ``DontCare``: the action's outcome then depends on a value z3 may choose, which the check
reports rather than guesses.

The refinement relation, for a model state ``s`` and an encoded state ``e``:

- every state variable of ``STATE_VARS`` has the same value in every cell (``writer`` only while the
  key is WRITING: the model clears it, the encoding never reads it and leaves it stale);
- the messages in flight in ``s``, as a set, are exactly ``inflight`` of ``e``.

The model's variables the encoding does not have are projected away, each for a reason
(``PROJECTED_AWAY``); every other byte of the model's fixed state must belong to a variable of
``STATE_VARS``, so a variable added to ``model.py`` fails this check until the encoding follows it
or it is projected away here with its reason.

A model step ``s --label--> t`` is *refined* when some encoded action standing for ``label``
(``Action.python``), under some binding of its parameters, is enabled in ``s``, and its post-state
``e'`` satisfies: every state variable equal to ``t``'s, and every message in flight in ``t`` in
flight in ``e'`` (``e'`` may have more: the delivered message, which the encoding keeps, and sends the
model lost on a full network; ``drop`` removes them, so ``e'`` reaches the state related to ``t``).
Steps that only consume a message (``CONSUMING``) may also be the encoding's ``drop``; steps that
change nothing the encoding sees (``UNCHANGED``) the identity. A model step that invalidates
several keys at once (a subtree, a namespace, a lost owner at ``restart_node``) is the labelled
action followed by up to one single-key ``invalidate`` / ``invalidate_writing`` per key.

Functional per binding: every action's post-state is a function of the pre-state, its parameters
and the messages it sends, and every sent message has every field of its kind fixed by the action
(``_Compiled`` asserts both while compiling). So, given the binding, the encoding allows exactly
one post-state (up to the names of fresh message elements), and comparing it with ``t`` is the
whole question; the bindings themselves are enumerated over the configuration.

Scope: ``check_config`` explores a configuration breadth first from its initial state with the
model's own successor function (deterministic: the order of ``Model.successors``). Every step of
the first ``state_budget`` states is compared; a configuration with no more reachable states is
checked exhaustively. Past the budget, breadth first goes on (generating states is cheap, comparing
steps is not) and compares only the steps of labels compared fewer than ``label_quota`` times, until
every label generated so far, and every label of ``reachable_labels.json`` for the configuration (the labels an exhaustive
exploration reaches there, pinned with the manifest's state count; for a configuration the manifest
samples, ``tiering`` and ``medium``, the labels its pinned walks cover) has had its quota, or
``cover_budget`` states were expanded. Labels still below their quota then are looked for by seeded
random walks (``WALKS`` of ``WALK_DEPTH`` steps), which compare only their steps.
Every report lists per label the steps compared; ``check_all`` fails if a label a configuration
reaches was never compared there, or a label of ``model.py`` was compared in no scope. Labels no
configuration of ``CONFIGS`` reaches (``duplicate``: no configuration duplicates messages; a copy
fenced as stale needs a third epoch) are compared on ``SUPPLEMENTS``, scopes derived from one
configuration for this check only.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import resources

import attrs
import z3

from .. import layout as LY
from ..config import CONFIGS, ModelConfig
from ..model import Model
from .encoding import (
    BOOL, EPS, INT, KIND_FIELDS, KIND_NAMES, NOLOC, STATE_VARS, T, Action, Key, Loc, Msg, Node, Pending, Phase,
    Protocol, SlotStatus, Stage, State, allowed, is_pool, locnode,
)

# Every label ``Model.successors`` can emit; ``test_proofs`` keeps this equal to the checker's list.
MODEL_LABELS = (
    "tick", "clock_forward", "clock_back",
    "acquire", "renew", "abandon", "read", "release",
    "begin_write", "abort",
    "grant_read_lease", "refuse_read_lease", "renew_lease", "refuse_renewal", "release_lease",
    "grant_write_lease", "refuse_write_lease", "commit_write", "reject_stale_commit",
    "expire_write_lease", "expire_write_lease_of_crashed",
    "invalidate", "invalidate_namespace", "drop_and_ack", "revoke_acked", "complete_invalidation",
    "evict", "evict_refused",
    "start_transfer", "store_copy", "finish_transfer", "free_drained", "cancel_transfer",
    "trust_read_lease", "trust_renewal", "start_writing", "ignore_stale_grant", "ignore_stale_renewal",
    "ignore_stale_write_grant", "ignore_stale_copied", "copy_failed", "fence_stale_copy",
    "write_to_down_location", "free_at_down_location",
    "store_bytes", "fence_stale_write", "free_slot", "fence_stale_free",
    "retry_free", "free_acked", "ignore_stale_refusal", "ignore_stale_freed",
    "drop", "duplicate", "crash", "restart_node", "restart_directory", "declare_node_down",
)

# Model labels whose step only consumes the delivered message (the encoding: ``drop``), when the
# handler changes nothing else.
CONSUMING = frozenset({
    "refuse_read_lease", "refuse_write_lease", "refuse_renewal", "ignore_stale_grant", "ignore_stale_renewal",
    "ignore_stale_write_grant", "reject_stale_commit", "fence_stale_copy", "copy_failed",
    "write_to_down_location", "free_at_down_location", "ignore_stale_copied", "drop", "drop_and_ack",
    "release_lease", "revoke_acked", "ignore_stale_refusal", "ignore_stale_freed",
})
# Model labels whose step changes nothing the encoding sees: a read observes, a refused eviction
# refuses, a duplicate adds a second copy of a message to what is, for the encoding, a set.
UNCHANGED = frozenset({"read", "evict_refused", "duplicate"})
# Model labels that may touch several keys in one step (a subtree, a namespace, a lost owner).
MULTI_KEY = frozenset({"invalidate", "invalidate_namespace", "restart_node", "declare_node_down"})

# Bytes of the model state that are not variables of the encoding, and why that is sound.
PROJECTED_AWAY: dict[str, str] = {
    "phase_age": "ghost age of bounded response (InvalidationCompletesInTime, WriteLeaseEndsInTime)",
    "orphan_age": "ghost age of bounded response (DeletionReachesEverywhere)",
    "p_age": "ghost age of bounded response (RequestEndsInTime)",
    "read_lost": "ghost of progress (RequestAnswered): a message of a read request's exchange was lost",
    "write_lost": "ghost of progress (RequestAnswered): a message of a write request's exchange was lost",
    "owner_down_age": "ghost age of bounded response (CrashedOwnerWritableInTime)",
    "detect_left": "the failure detector's timer: it only decides when a down node's keys are voided, which "
                   "the encoding allows at any time (invalidate)",
    "known_down": "the failure detector's verdict: it only refuses leases (the encoding may grant them) and "
                  "voids keys (the encoding may at any time)",
    "crashes_left": "scope budget (max_node_crashes): the encoding allows any number of crashes",
    "restarts_left": "scope budget (max_directory_restarts): the encoding allows any number of restarts",
    "dups_left": "scope budget (max_duplications): the encoding's network is a set that keeps delivered messages",
}

# Where each field of a message sits in the model's bytes (kind, node, key, a, b, c, d).
_BYTE_OF: dict[str, dict[str, int]] = {
    "ACQUIRE": dict(req=3),
    "RENEW": dict(lease=3, loc=4, req=5),
    "GRANT_READ": dict(lease=3, loc=4, gen=5, req=6),
    "RENEWED": dict(lease=3, req=6),
    "RELEASE": dict(lease=3), "REVOKE": dict(lease=3, gen=5), "ACK": dict(lease=3),
    "BEGIN_WRITE": {},
    "GRANT_WRITE": dict(lease=3, loc=4, gen=5, epoch=6),
    "WRITE_BYTES": dict(lease=3, loc=4, gen=5, epoch=6),
    "COMMIT": dict(lease=3, epoch=6),
    "FREE": dict(loc=3, epoch=6),
    "COPY": dict(loc=3, src=4, gen=5, epoch=6),
    "COPIED": dict(loc=3, epoch=6),
    "REFUSE": dict(req=3, what=4),
    "FREED": dict(loc=3, epoch=6),
}
FIELDS = ("node", "key", "lease", "loc", "src", "gen", "epoch", "req", "what")
_FIELD_POS = {f: i + 1 for i, f in enumerate(FIELDS)}  # position in a message's field tuple
_CODE_TO_KIND = {getattr(LY, "M_" + name): name for name in KIND_NAMES}
for _name in KIND_NAMES:
    assert set(_BYTE_OF[_name]) | {"node", "key"} >= set(KIND_FIELDS[_name]), _name
    assert set(_BYTE_OF[_name]) <= set(KIND_FIELDS[_name]), _name


def message_fields(msg: bytes) -> tuple:
    """A model message as the encoding's fields: (KIND, node, key, lease, loc, src, gen, epoch, req)."""
    name = _CODE_TO_KIND[msg[0]]
    values = dict.fromkeys(FIELDS, 0)
    values["key"] = msg[2]
    if "node" in KIND_FIELDS[name]:
        values["node"] = msg[1]
    for f, pos in _BYTE_OF[name].items():
        values[f] = msg[pos]
    return (name,) + tuple(values[f] for f in FIELDS)


class DontCare(Exception):
    """The encoding read a value it leaves unconstrained (a cell at ``NOLOC``, the pool's node)."""


# ------------------------------------------------------------------------------ evaluating z3 terms

_ENUMS = (Phase, SlotStatus, Stage, Pending)


def _enum_code(decl) -> int | str:
    sort = decl.range()
    for i in range(sort.num_constructors()):
        if sort.constructor(i) == decl:
            return decl.name() if sort.name() == "Kind" else i
    raise AssertionError(decl)


class _Ctx:
    """What closures read: the topology of one configuration, the state's arrays, the bindings."""

    __slots__ = ("topo", "arrays", "binds")

    def __init__(self, topo: "_Topology", arrays: dict, binds: dict) -> None:
        self.topo, self.arrays, self.binds = topo, arrays, binds


@dataclass
class _Topology:
    nodes: int
    keys: int
    locations: int
    loc_node: list[int]  # per location code - 1: its node, or -1 for the pool
    allowed: list[list[bool]]
    parents: tuple[int, ...]
    term: int
    eps: int

    def domain(self, sort) -> range:
        if sort == Node:
            return range(self.nodes)
        if sort == Key:
            return range(self.keys)
        if sort == Loc:
            return range(self.locations + 1)
        if sort == INT:  # a number of ticks an action chooses (restart_directory's grace)
            return range(self.term + 2 * self.eps + 1)
        raise DontCare(f"a quantifier over {sort} has no finite domain here")


_FIELD_FUNS = {"m_" + f: _FIELD_POS[f] for f in FIELDS}


class _Compiler:
    """z3 term -> closure ``(ctx, bound) -> value``; ``bound`` holds quantified variables (de Bruijn)."""

    def __init__(self, prefix: str, params: set[str]) -> None:
        self.prefix = prefix
        self.params = params  # names of constants bound per evaluation (parameters, sent messages)
        self.memo: dict[int, Callable] = {}

    def __call__(self, e: z3.ExprRef) -> Callable:
        key = e.get_id()
        f = self.memo.get(key)
        if f is None:
            f = self._compile(e)
            self.memo[key] = f
        return f

    def _compile(self, e: z3.ExprRef) -> Callable:  # noqa: C901 -- one case per operator
        if z3.is_quantifier(e):
            body = self(e.body())
            sorts = [e.var_sort(i) for i in range(e.num_vars())]
            if e.is_lambda():
                return lambda ctx, bound: (lambda *idx: body(ctx, bound + idx))
            test = all if e.is_forall() else any

            def quantified(ctx, bound):
                domains = [ctx.topo.domain(s) for s in sorts]
                return test(body(ctx, bound + combo) for combo in itertools.product(*domains))
            return quantified
        if z3.is_var(e):
            i = z3.get_var_index(e)
            return lambda ctx, bound: bound[-1 - i]
        if z3.is_int_value(e):
            v = e.as_long()
            return lambda ctx, bound: v
        if z3.is_true(e):
            return lambda ctx, bound: True
        if z3.is_false(e):
            return lambda ctx, bound: False
        decl = e.decl()
        k = decl.kind()
        args = [self(c) for c in e.children()]
        if k == z3.Z3_OP_DT_CONSTRUCTOR and not args:
            v = _enum_code(decl)
            return lambda ctx, bound: v
        if k == z3.Z3_OP_AND:
            return lambda ctx, bound: all(a(ctx, bound) for a in args)
        if k == z3.Z3_OP_OR:
            return lambda ctx, bound: any(a(ctx, bound) for a in args)
        if k == z3.Z3_OP_NOT:
            (a,) = args
            return lambda ctx, bound: not a(ctx, bound)
        if k == z3.Z3_OP_IMPLIES:
            a, b = args
            return lambda ctx, bound: (not a(ctx, bound)) or b(ctx, bound)
        if k == z3.Z3_OP_ITE:
            c, a, b = args
            return lambda ctx, bound: a(ctx, bound) if c(ctx, bound) else b(ctx, bound)
        if k == z3.Z3_OP_EQ:
            a, b = args
            return lambda ctx, bound: a(ctx, bound) == b(ctx, bound)
        if k == z3.Z3_OP_DISTINCT:
            return lambda ctx, bound: len({a(ctx, bound) for a in args}) == len(args)
        if k == z3.Z3_OP_ADD:
            return lambda ctx, bound: sum(a(ctx, bound) for a in args)
        if k == z3.Z3_OP_SUB:
            a, b = args
            return lambda ctx, bound: a(ctx, bound) - b(ctx, bound)
        if k == z3.Z3_OP_UMINUS:
            (a,) = args
            return lambda ctx, bound: -a(ctx, bound)
        if k == z3.Z3_OP_MUL:
            a, b = args
            return lambda ctx, bound: a(ctx, bound) * b(ctx, bound)
        if k in (z3.Z3_OP_LE, z3.Z3_OP_LT, z3.Z3_OP_GE, z3.Z3_OP_GT):
            a, b = args
            op = {z3.Z3_OP_LE: int.__le__, z3.Z3_OP_LT: int.__lt__, z3.Z3_OP_GE: int.__ge__,
                  z3.Z3_OP_GT: int.__gt__}[k]
            return lambda ctx, bound: op(a(ctx, bound), b(ctx, bound))
        if k == z3.Z3_OP_SELECT:
            arr, idx = args[0], args[1:]
            return lambda ctx, bound: arr(ctx, bound)(*[i(ctx, bound) for i in idx])
        if k == z3.Z3_OP_STORE:
            arr, idx, val = args[0], args[1:-1], args[-1]

            def store(ctx, bound):
                old = arr(ctx, bound)
                at = tuple(i(ctx, bound) for i in idx)
                v = val(ctx, bound)
                return lambda *j: v if j == at else old(*j)
            return store
        if k == z3.Z3_OP_UNINTERPRETED:
            return self._uninterpreted(e, decl, args)
        raise NotImplementedError(f"operator {decl.name()} in {e}")

    def _uninterpreted(self, e, decl, args) -> Callable:
        name = decl.name()
        if not args:
            if e.eq(T):
                return lambda ctx, bound: ctx.topo.term
            if e.eq(EPS):
                return lambda ctx, bound: ctx.topo.eps
            if e.eq(NOLOC):
                return lambda ctx, bound: 0
            if name.startswith(self.prefix) and name[len(self.prefix):] in STATE_VARS:
                var = name[len(self.prefix):]
                return lambda ctx, bound: ctx.arrays[var]
            if name in self.params:
                return lambda ctx, bound: ctx.binds[name]
            # A constant the action neither binds nor defines: the relation would not be a function
            # of the pre-state and the parameters.
            raise NotImplementedError(f"free constant {name}: the action is not functional per binding")
        if name in _FIELD_FUNS:
            (m,) = args
            pos = _FIELD_POS[name[2:]]
            return lambda ctx, bound: m(ctx, bound)[0][pos]
        if name == "kind":
            (m,) = args
            return lambda ctx, bound: m(ctx, bound)[0][0]
        if name == "is_pool":
            (loc,) = args

            def pool(ctx, bound):
                code = loc(ctx, bound)
                if code == 0:
                    raise DontCare("is_pool(NOLOC)")
                return ctx.topo.loc_node[code - 1] < 0
            return pool
        if name == "locnode":
            (loc,) = args

            def node_of(ctx, bound):
                code = loc(ctx, bound)
                if code == 0 or ctx.topo.loc_node[code - 1] < 0:
                    raise DontCare("locnode of NOLOC or the pool")
                return ctx.topo.loc_node[code - 1]
            return node_of
        if name == "allowed":
            n, k = args
            return lambda ctx, bound: ctx.topo.allowed[n(ctx, bound)][k(ctx, bound)]
        if name == "has_parent":
            (k,) = args
            return lambda ctx, bound: ctx.topo.parents[k(ctx, bound)] >= 0
        if name == "parent":
            (k,) = args

            def parent_of(ctx, bound):
                p = ctx.topo.parents[k(ctx, bound)]
                if p < 0:
                    raise DontCare("the parent of a root")
                return p
            return parent_of
        raise NotImplementedError(f"function {name}")


def _eq_sides(c: z3.BoolRef):
    """``f(m) == v`` as (f's name, m, v), whichever side the application is on."""
    assert z3.is_eq(c), c
    a, b = c.children()
    if z3.is_app(a) and a.num_args() == 1 and a.decl().kind() == z3.Z3_OP_UNINTERPRETED and a.arg(0).sort() == Msg:
        return a.decl().name(), a.arg(0), b
    return b.decl().name(), b.arg(0), a


class _Compiled:
    """One encoded action, compiled: its parameters, guard, sent messages and post-state."""

    def __init__(self, act: Action, pre: State, writes: set[str]) -> None:
        self.act = act
        self.name = act.name
        self.params = [(str(c), c.sort()) for c in act.params.values()]
        sent_names = {str(m) for m in act.sent.values()}
        comp = _Compiler(prefix=_PREFIX, params={n for n, _ in self.params} | sent_names)
        self.guard = comp(act.guard)
        # Each sent message: every field of its kind fixed by the side constraints (a function).
        self.sent: list[tuple[str, str, list[tuple[int, Callable]]]] = []
        specs: dict[str, dict] = {name: {} for name in sent_names}
        for side in act.side:
            parts = side.children() if z3.is_and(side) else [side]
            for c in parts:
                fname, m, v = _eq_sides(c)
                assert str(m) in specs, f"{act.name}: a side constraint on {m}, which the action does not send"
                specs[str(m)][fname] = v
        for mname, spec in specs.items():
            kind_term = spec.pop("kind")
            kind_name = _enum_code(kind_term.decl())
            fields = {fname[2:]: comp(v) for fname, v in spec.items()}
            missing = set(KIND_FIELDS[kind_name]) - set(fields)
            assert not missing, f"{act.name} sends {kind_name} without fixing {sorted(missing)}: not functional"
            self.sent.append((mname, kind_name, [(_FIELD_POS[f], fn) for f, fn in fields.items()]))
        self.writes = sorted(writes)
        self.post = {name: comp(act.post.terms[name]) for name in self.writes}

    def bindings(self, topo: _Topology, messages: list) -> list[dict]:
        domains = []
        for name, sort in self.params:
            if sort == Msg:
                domains.append([(name, m) for m in messages])
            else:
                domains.append([(name, v) for v in topo.domain(sort) if not (sort == Loc and v == 0)])
        return [dict(combo) for combo in itertools.product(*domains)]

    def run(self, topo: _Topology, arrays: dict, binds: dict) -> dict | None:
        """The post-state's arrays (only those written, the rest are the pre-state's), or None when
        the guard does not hold."""
        ctx = _Ctx(topo, arrays, dict(binds))
        if not self.guard(ctx, ()):
            return None
        for mname, kind_name, fields in self.sent:
            values = [kind_name] + [0] * len(FIELDS)
            for pos, fn in fields:
                values[pos] = fn(ctx, ())
            ctx.binds[mname] = (tuple(values), ("sent", self.name, mname))
        post = dict(arrays)
        for name in self.writes:
            post[name] = self.post[name](ctx, ())
        return post


_PREFIX = "rf_pre_"


# ------------------------------------------------------------------------------ states

def _decoder(sort) -> Callable[[int], object]:
    if sort == BOOL:
        return lambda v: v == 1
    if sort == Node:
        return lambda v: None if v == LY.NO_NODE else v - 1
    return lambda v: v  # integers, locations (codes) and enums (codes) as the model stores them


def _encoder(sort) -> Callable[[object], int]:
    if sort == BOOL:
        return lambda v: 1 if v else 0
    if sort == Node:
        return lambda v: LY.NO_NODE if v is None else v + 1
    return lambda v: v


def _cells(L, name: str, idx: tuple, cfg: ModelConfig):
    """(byte position, index tuple) of every cell of a state variable, in the model's layout."""
    pos = getattr(L, name)
    if not idx:
        return [(pos, ())]
    doms = []
    for sort in idx:
        if sort == Loc:
            doms.append([(i, i + 1) for i in range(cfg.locations)])  # (layout index, location code)
        else:
            n = cfg.nodes if sort == Node else cfg.keys
            doms.append([(i, i) for i in range(n)])
    out = []
    for combo in itertools.product(*doms):
        p = pos
        for i, _ in combo:
            p = p[i]
        out.append((p, tuple(v for _, v in combo)))
    return out


class Refinement:
    """The compiled encoding, for one configuration: refines(s, label, t) and the projection."""

    def __init__(self, model: Model, protocol: Protocol | None = None) -> None:
        self.m = model
        cfg = model.cfg
        L = model.L
        self.topo = _Topology(cfg.nodes, cfg.keys, cfg.locations, list(model.loc_node),
                              [list(row) for row in model.allowed], cfg.parents, cfg.lease_term_ticks,
                              cfg.skew_ticks)
        self.protocol = protocol if protocol is not None else Protocol()
        pre = State.fresh(_PREFIX)
        self.actions: list[_Compiled] = []
        for act in self.protocol.actions(pre):
            written = {n for n in STATE_VARS if not act.post.terms[n].eq(pre.terms[n])}
            self.actions.append(_Compiled(act, pre, written))
        self.by_label: dict[str, list[_Compiled]] = {}
        for c in self.actions:
            for label in c.act.python:
                self.by_label.setdefault(label, []).append(c)
        self.drop = [c for c in self.actions if c.name == "drop"]
        self.followups = [c for c in self.actions if c.name in ("invalidate", "invalidate_writing")]
        # Cells of every state variable, and the model bytes the relation compares.
        self.cells = {name: _cells(L, name, idx, cfg) for name, (idx, _) in STATE_VARS.items() if name != "inflight"}
        self.decode = {name: _decoder(val) for name, (idx, val) in STATE_VARS.items()}
        self.encode = {name: _encoder(val) for name, (idx, val) in STATE_VARS.items()}
        covered = sorted(p for cells in self.cells.values() for p, _ in cells)
        away = []
        for name in PROJECTED_AWAY:
            todo = [getattr(L, name)]
            while todo:
                pos = todo.pop()
                if isinstance(pos, list):
                    todo += pos
                else:
                    away.append(pos)
        assert len(covered) == len(set(covered)), "two encoding variables share a byte"
        unexplained = sorted(set(range(L.fixed)) - set(covered) - set(away))
        assert not unexplained, (
            "model variables the encoding neither has nor projects away: "
            + ", ".join(L.names[i] for i in unexplained))
        self.compared = [p for p in range(L.fixed) if p not in set(away)]
        self.writer_phase = {L.writer[k]: L.phase[k] for k in range(cfg.keys)}
        # Per action: the bytes of the variables it does not write (they must not change) and of
        # those it does (evaluated on its post-state).
        away_set = set(away)
        self.frame: dict[str, list[int]] = {}
        self.written: dict[str, list[int]] = {}
        for c in self.actions:
            mine = {p for name in c.writes if name != "inflight" for p, _ in self.cells[name]}
            self.frame[c.name] = [p for p in self.compared if p not in mine]
            self.written[c.name] = [p for p in self.compared if p in mine and p not in away_set]
            c.state_writes = [name for name in c.writes if name != "inflight"]

    # -- the abstraction ---------------------------------------------------------------------

    def arrays(self, s: bytes) -> dict:
        """The encoded state of model state ``s`` (without ``inflight``)."""
        out = {}
        for name, (idx, _) in STATE_VARS.items():
            if name == "inflight":
                continue
            pos, dec = getattr(self.m.L, name), self.decode[name]
            if not idx:
                out[name] = dec(s[pos])
            else:
                out[name] = _reader(s, pos, idx, dec)
        return out

    def messages(self, s: bytes) -> list:
        """The message elements in flight: one per copy (copies are distinct elements)."""
        seen: Counter = Counter()
        out = []
        for raw in self.m.L.messages(s):
            f = message_fields(raw)
            out.append((f, ("copy", seen[f])))
            seen[f] += 1
        return out

    def project(self, post: dict, names=None) -> list:
        """An encoded state's variables (all, or ``names``) as the model's fixed bytes (the others
        left 0). A value no byte can hold (a negative counter, say) stays as it is and equals no byte."""
        b = [0] * self.m.L.fixed
        for name in self.cells if names is None else names:
            cells, value, enc = self.cells[name], post[name], self.encode[name]
            if not cells[0][1]:
                b[cells[0][0]] = enc(value)
                continue
            for p, idx in cells:
                b[p] = enc(value(*idx))
        return b

    def _same(self, b, t: bytes, positions) -> bool:
        for p in positions:
            if b[p] != t[p]:
                # ``writer`` is compared only while the key is WRITING (module docstring).
                if p in self.writer_phase and t[self.writer_phase[p]] != LY.WRITING:
                    continue
                return False
        return True

    # -- one step ----------------------------------------------------------------------------

    def refines(self, s: bytes, label: str, t: bytes, cache: dict | None = None) -> str | None:
        """The encoded action (or sequence) that takes ``s`` to a state related to ``t``, or None."""
        cache = {} if cache is None else cache
        state = cache.get("state")
        if state is None:
            msgs = self.messages(s)
            arrays = self.arrays(s)
            members = {e for e in msgs}
            arrays["inflight"] = lambda e, members=members: e in members
            state = cache["state"] = (arrays, msgs)
        arrays, msgs = state
        # One element per distinct message: delivering either of two copies is the same step.
        distinct = [e for e in msgs if e[1] == ("copy", 0)]
        want = {message_fields(raw) for raw in self.m.L.messages(t)}
        candidates = list(self.by_label.get(label, ()))
        if label in CONSUMING:
            candidates += self.drop
        # A step that changes nothing the encoding has is a stutter: the identity refines it (a read,
        # a refused eviction, a duplicate, a step of projected-away variables only).
        if self._same(s, t, self.compared) and self._related(arrays, msgs, t, want, (), ()):
            return "identity"
        multi = label in MULTI_KEY
        posts = []
        for c in candidates:
            # What the action does not write must be as it was: checked on bytes, before running it.
            if not multi and not self._same(s, t, self.frame[c.name]):
                continue
            for binds in c.bindings(self.topo, distinct):
                post = self._run(cache, c, arrays, binds)
                if post is None:
                    continue
                if multi:
                    if self._related(post, msgs, t, want):
                        return c.name
                    posts.append((c.name, post))
                elif self._related(post, msgs, t, want, c.state_writes, self.written[c.name]):
                    return c.name
        # Several keys at once: the labelled action, then single-key invalidations.
        if multi:
            # The first invalidation may come after a step of projected-away variables only (the
            # failure detector's verdict at ``declare_node_down``).
            frontier = [(name, post) for name, post in posts] + [("identity", arrays)]
            for _ in range(self.topo.keys):
                nxt = []
                for path, post in frontier:
                    for c in self.followups:
                        for binds in c.bindings(self.topo, []):
                            after = _safe_run(c, self.topo, post, binds)
                            if after is None:
                                continue
                            step = f"{path} ; {c.name}"
                            if self._related(after, msgs, t, want):
                                return step
                            nxt.append((step, after))
                frontier = nxt
        return None

    def _run(self, cache: dict, c: _Compiled, arrays: dict, binds: dict):
        key = (c.name, tuple(sorted(binds.items())))
        if key not in cache:
            cache[key] = _safe_run(c, self.topo, arrays, binds)
        return cache[key]

    def _related(self, post: dict, msgs: list, t: bytes, want: set, names=None, positions=None) -> bool:
        """``post`` (encoded) has ``t``'s variables (or those of ``names``, at ``positions``) and every
        message ``t`` has in flight."""
        try:
            b = self.project(post, names)
        except DontCare:
            return False
        if not self._same(b, t, self.compared if positions is None else positions):
            return False
        inflight = post["inflight"]
        copies: dict = {}
        for f, tag in msgs:
            copies.setdefault(f, []).append(tag)
        for f in want:
            # Some element with these fields is in flight: a copy the pre-state had, one an action
            # sent, or a spare element put in flight by its fields alone (a lambda over elements).
            tags = copies.get(f, []) + post.get("_sent_tags", []) + [("spare",)]
            if not any(inflight((f, tag)) for tag in tags):
                return False
        return True


def _safe_run(c: _Compiled, topo: _Topology, arrays: dict, binds: dict):
    try:
        post = c.run(topo, arrays, binds)
    except DontCare:
        return None
    if post is None:
        return None
    tags = list(arrays.get("_sent_tags", []))
    tags += [("sent", c.name, mname) for mname, _, _ in c.sent]
    post["_sent_tags"] = tags
    return post


def _reader(s: bytes, pos, idx, dec):
    if len(idx) == 1:
        (sort,) = idx
        if sort == Loc:
            def read1(i):
                if i == 0:
                    raise DontCare("a cell at NOLOC")
                return dec(s[pos[i - 1]])
            return read1
        return lambda i: dec(s[pos[i]])
    a, b = idx
    if a == Loc:
        def read_loc(i, j):
            if i == 0:
                raise DontCare("a cell at NOLOC")
            return dec(s[pos[i - 1][j]])
        return read_loc
    return lambda i, j: dec(s[pos[i][j]])


# ------------------------------------------------------------------------------ configurations

# How many states are expanded breadth first with every step compared; how many in all may be
# expanded to give every label its quota of compared steps. Sized so that every configuration
# together fits in CI (a few minutes).
STATE_BUDGET = 5_000
COVER_BUDGET = 120_000
LABEL_QUOTA = 20
# Labels not compared within the cover budget are looked for by up to this many seeded random
# walks of this many steps.
WALKS = 20_000
WALK_DEPTH = 80
# A configuration with at most this many reachable states (``reachable_labels.json``) is checked
# exhaustively.
EXHAUSTIVE_UP_TO_STATES = 20_000

# Scopes derived for this check only, each for the labels no configuration of CONFIGS reaches.
SUPPLEMENTS: dict[str, tuple[ModelConfig, tuple[str, ...], str]] = {
    "tiny+duplicates": (
        attrs.evolve(CONFIGS["tiny"], name="tiny+duplicates", max_duplications=1), ("duplicate",),
        "no configuration duplicates messages (max_duplications = 0 everywhere): duplicate is reached nowhere else",
    ),
    "tiering+epochs": (
        attrs.evolve(CONFIGS["tiering"], name="tiering+epochs", max_epoch=3, max_node_crashes=0),
        ("fence_stale_copy",),
        "a copy fenced as stale (fence_stale_copy) needs a third epoch: a transfer, then one overtaking it",
    ),
}


@dataclass
class ConfigReport:
    config: str
    exhaustive: bool  # every reachable state was expanded
    states: int  # states expanded: every step of the first ``state_budget`` compared, then rare labels
    steps: int  # steps compared
    labels: dict[str, int]  # label -> steps compared
    expected: list[str]  # labels the model checker reaches in this configuration (pinned)
    missing: list[str]  # expected labels never compared
    failures: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    # The inductive invariant's Python forms (properties and strengthenings), evaluated on every
    # state expanded: a strengthening false in a reachable state is wrong, whatever z3 says.
    invariant_states: int = 0
    invariant_violations: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures and not self.missing and not self.invariant_violations

    def to_json(self) -> dict:
        return {
            "config": self.config, "ok": self.ok, "exhaustive": self.exhaustive, "states": self.states,
            "steps": self.steps, "labels": dict(sorted(self.labels.items())), "missing": self.missing,
            "failures": self.failures[:5], "failure_count": len(self.failures), "seconds": round(self.seconds, 2),
            "invariant_states": self.invariant_states, "invariant_violations": self.invariant_violations[:5],
        }


def pinned_scopes() -> dict[str, dict]:
    """Per configuration of the manifest (``reachable_labels.json``): its pinned state count and
    the labels its steps carry -- every label not argued out of its scope, since ``kvcc check
    --all`` covers each of them there and no other. ``sampled`` marks a configuration the
    manifest checks by seeded walks: its count is of the states they visit, not all reachable."""
    text = resources.files(__package__).joinpath("reachable_labels.json").read_text()
    return json.loads(text)


def reachable_labels() -> dict[str, list[str]]:
    """The labels an exhaustive exploration reaches in each pinned configuration."""
    return {name: entry["labels"] for name, entry in pinned_scopes().items()}


def check_config(model: Model, protocol: Protocol | None = None, state_budget: int = STATE_BUDGET,
                 cover_budget: int = COVER_BUDGET, label_quota: int = LABEL_QUOTA,
                 expected: list[str] | None = None, max_failures: int = 20,
                 stop_on_failure: bool = False, invariants: tuple | None = None) -> ConfigReport:
    """Compare every step of the first ``state_budget`` states (breadth first), then the steps of
    labels below their quota; see the module docstring."""
    started = time.perf_counter()
    ref = Refinement(model, protocol)
    cfg = model.cfg
    if expected is None:
        expected = reachable_labels().get(cfg.name, [])
    if invariants is None:
        from .invariants import STATE_INVARIANTS as invariants
    labels: Counter = Counter()
    failures: list[dict] = []
    violations: list[dict] = []
    steps = 0

    def compare(s: bytes, succ, only_rare: bool) -> int:
        nonlocal steps
        cache: dict = {}
        compared = 0
        for label, params, t in succ:
            if only_rare and labels[label] >= label_quota:
                continue
            compared += 1
            steps += 1
            labels[label] += 1
            if ref.refines(s, label, t, cache) is None and len(failures) < max_failures:
                failures.append({"label": label, "params": list(params), "pre": s.hex(), "post": t.hex(),
                                 "diff": {k: list(v) for k, v in model.L.diff(s, t).items()}})
        return compared

    init = model.init_states()
    seen = set(init)
    frontier = deque(init)
    expanded = 0
    wanted = set(expected)  # the pinned labels, and every label breadth first has generated
    invariant_states = 0  # the states whose steps were compared: each is checked against the invariant
    while frontier and not (stop_on_failure and failures):
        if expanded >= state_budget:
            # Past the budget, breadth first goes on (generating is cheap) but compares only the
            # steps of labels compared fewer than ``label_quota`` times, until every label the
            # configuration reaches has had its quota.
            if expanded >= cover_budget or all(labels[x] >= label_quota for x in wanted):
                break
        s = frontier.popleft()
        succ = model.successors(s)
        wanted.update(label for label, _, _ in succ)
        covering = expanded >= state_budget
        compared = compare(s, succ, only_rare=covering)
        expanded += 1
        if compared or not covering:
            # Every state whose steps were compared is checked against the whole invariant.
            invariant_states += 1
            for inv in invariants:
                if not inv.python(model, s) and len(violations) < max_failures:
                    violations.append({"invariant": inv.name, "state": s.hex(), "variables": {
                        k: v for k, v in model.L.variables(s).items()
                        if v not in ("0", "-", "EMPTY", "NONE", "ABSENT")}})
        for _, _, t in succ:
            if t not in seen:
                seen.add(t)
                frontier.append(t)
    exhaustive = not frontier
    if not exhaustive and not (stop_on_failure and failures):
        # Labels breadth first did not compare within its budget lie deep (a renewal answered
        # after the holder gave up on it, under a directory restart): seeded random walks look
        # for them until each has a compared step, comparing only the steps of labels still
        # below their quota.
        for seed in range(WALKS):
            if all(labels[x] > 0 for x in expected) or (stop_on_failure and failures):
                break
            _walk(model, random.Random(seed), lambda s, succ: compare(s, succ, only_rare=True))
    missing = [x for x in expected if labels[x] == 0]
    return ConfigReport(cfg.name, exhaustive, expanded, steps, dict(labels), list(expected), missing, failures,
                        time.perf_counter() - started, invariant_states, violations)


def _walk(model: Model, rng: random.Random, visit: Callable[[bytes, list], int]) -> None:
    """One random walk of ``WALK_DEPTH`` steps from the initial state, calling ``visit`` on each
    state with its successors. Like the checker's swarm walks, it leaves out a random half of the
    labels (while another is enabled): a uniform walk keeps to the few states near the start."""
    left_out = {label for label in MODEL_LABELS if rng.random() < 0.5}
    (s,) = model.init_states()
    for _ in range(WALK_DEPTH):
        succ = model.successors(s)
        if not succ:
            return
        visit(s, succ)
        s = rng.choice([step for step in succ if step[0] not in left_out] or succ)[2]


def state_budget_for(cfg: ModelConfig) -> int:
    """Exhaustive for a configuration small enough, ``STATE_BUDGET`` states otherwise."""
    entry = pinned_scopes().get(cfg.name, {})
    pinned = entry.get("states")
    if pinned is not None and not entry.get("sampled") and pinned <= EXHAUSTIVE_UP_TO_STATES:
        return EXHAUSTIVE_UP_TO_STATES
    return STATE_BUDGET


def scopes(configs: dict[str, ModelConfig] | None = None) -> dict[str, ModelConfig]:
    """Every configuration of ``CONFIGS`` (or those given), then the supplements."""
    out = dict(CONFIGS if configs is None else configs)
    if configs is None:
        out.update({name: cfg for name, (cfg, _, _) in SUPPLEMENTS.items()})
    return out


def check_all(configs: dict[str, ModelConfig] | None = None, protocol: Protocol | None = None,
              progress: Callable[[ConfigReport], None] | None = None, **kw) -> dict:
    """Every configuration and supplement; fails (``ok`` false) on a step not refined, a label a
    configuration reaches but never compared there, or a label of ``model.py`` compared nowhere."""
    started = time.perf_counter()
    reports = []
    fixed_budget = kw.pop("state_budget", None)
    for name, cfg in scopes(configs).items():
        budget = fixed_budget or state_budget_for(cfg)
        expected = list(SUPPLEMENTS[name][1]) if name in SUPPLEMENTS else None
        r = check_config(Model(cfg), protocol, state_budget=budget, expected=expected, **kw)
        reports.append(r)
        if progress is not None:
            progress(r)
    compared: Counter = Counter()
    for r in reports:
        compared.update(r.labels)
    never = [x for x in MODEL_LABELS if compared[x] == 0]
    unknown = sorted(set(compared) - set(MODEL_LABELS))
    return {
        "ok": all(r.ok for r in reports) and not never and not unknown,
        "configs": {r.config: r.to_json() for r in reports},
        "labels": {x: compared[x] for x in MODEL_LABELS},
        "never_compared": never,
        "unknown_labels": unknown,
        "supplements": {name: {"labels": list(labels), "why": why} for name, (_, labels, why) in SUPPLEMENTS.items()},
        "steps": sum(r.steps for r in reports),
        "seconds": round(time.perf_counter() - started, 2),
    }


# ------------------------------------------------------------------------------ mutants of the encoding
#
# A refinement check that cannot fail proves nothing: each of these is the encoding with one
# deliberate mistake of the kind a hand translation of ``model.py`` makes (a constant off by the
# skew, a forgotten update, a guard too strong, a clock forgotten, a timer kept), and the check
# must reject it at the named label in the named configuration.


class _ReadLeaseWithoutSkew(Protocol):
    """grant_read_lease: the directory's view is the term, not term + epsilon."""

    def grant_read_lease(self, s: State) -> Action:
        act = super().grant_read_lease(s)
        m = act.params["m"]
        from .encoding import m_key, m_node
        return replace(act, post=act.post.update(r_left=z3.Store(s.r_left, m_key(m), m_node(m), T)))


class _FenceNotRaised(Protocol):
    """store_bytes: the slot takes the bytes but forgets to raise its fence."""

    def store_bytes(self, s: State) -> Action:
        act = super().store_bytes(s)
        return replace(act, post=act.post.update(fence=s.fence))


class _CommitNeedsSlack(Protocol):
    """commit_write: a guard too strong (a commit in the last tick of the write lease is refused)."""

    def commit_write(self, s: State) -> Action:
        act = super().commit_write(s)
        from .encoding import m_key
        return replace(act, guard=z3.And(act.guard, s.w_left[m_key(act.params["m"])] > 1))


class _TickForgetsHolders(Protocol):
    """tick: only the directory's counters run down; holders' trust never ends."""

    def tick(self, s: State) -> Action:
        act = super().tick(s)
        keep = {name: s.terms[name] for name in ("h_left", "h_id", "h_loc", "h_gen", "p_left", "p_kind", "p_id")}
        return replace(act, post=act.post.update(**keep))


class _RenewalKeepsBudget(Protocol):
    """trust_renewal: the holder keeps its old trust instead of the renewal's budget."""

    def trust_renewal(self, s: State) -> Action:
        act = super().trust_renewal(s)
        return replace(act, post=act.post.update(h_left=s.h_left))


class _RestartKeepsLeases(Protocol):
    """restart_directory: the volatile lease table survives the restart."""

    def restart_directory(self, s: State) -> Action:
        act = super().restart_directory(s)
        return replace(act, post=act.post.update(r_id=s.r_id, r_loc=s.r_loc, r_left=s.r_left))


class _CrashKeepsFences(Protocol):
    """crash_lose_disk: the fences survive a lost disk."""

    def crash_lose_disk(self, s: State) -> Action:
        act = super().crash_lose_disk(s)
        return replace(act, post=act.post.update(fence=s.fence))


@dataclass(frozen=True)
class EncodingMutant:
    name: str
    protocol: type
    config: str  # a configuration whose reachable states expose it
    label: str  # the model label whose steps it no longer refines


ENCODING_MUTANTS: tuple[EncodingMutant, ...] = (
    EncodingMutant("read_lease_without_skew", _ReadLeaseWithoutSkew, "tiny", "grant_read_lease"),
    EncodingMutant("fence_not_raised", _FenceNotRaised, "tiny", "store_bytes"),
    EncodingMutant("commit_needs_slack", _CommitNeedsSlack, "tiny", "commit_write"),
    EncodingMutant("tick_forgets_holders", _TickForgetsHolders, "tiny", "tick"),
    EncodingMutant("renewal_keeps_budget", _RenewalKeepsBudget, "renewal", "trust_renewal"),
    EncodingMutant("restart_keeps_leases", _RestartKeepsLeases, "restart", "restart_directory"),
    EncodingMutant("crash_keeps_fences", _CrashKeepsFences, "tiering", "crash"),
)


def check_mutant(mutant: EncodingMutant, **kw) -> ConfigReport:
    """The refinement check of one configuration against a mutant of the encoding."""
    kw.setdefault("max_failures", 1)
    kw.setdefault("stop_on_failure", True)
    return check_config(Model(CONFIGS[mutant.config]), mutant.protocol(), **kw)
