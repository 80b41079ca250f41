"""From a finite z3 model to concrete ``model.py`` states, and back to the predicates.

A counterexample to induction (CTI) is a finite model of ``hypothesis(pre) and action(pre, post) and
not invariant(post)``, found by ``bounded.find_model`` over a few named elements per sort with every
integer bounded to a byte. It is read off element by element into a ``ModelConfig`` sized to it
(nodes and keys as found, each node's locations as its tiers, one shared pool, the prefix tree as
found, every chain its own namespace so that any authorisation relation is expressible) and ``bytes`` states laid out by
``Layout``, with the messages in flight as sorted 7-byte records built with ``layout.message``.

The Python predicates are then evaluated on those bytes (``obligations._recheck``): a CTI is
*re-checked* when the invariant's Python form holds on the pre-state and fails on the post-state
(for a transition property: fails on the step), and every other invariant's Python form must hold on
the pre-state too. ``step_in_model`` asks whether the step is literally one of
``Model.successors(pre)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import z3

from .. import layout as LY
from ..config import ModelConfig
from ..model import Model
from .encoding import (
    EPS, INT, KIND_NAMES, Kind, Loc, Msg, NOLOC, Node, Key, Pending, Phase, STATE_VARS, SlotStatus, Stage, T,
    Action, State, allowed, has_parent, is_pool, kind, locnode, m_epoch, m_gen, m_key, m_lease, m_loc, m_node, m_req,
    m_src, m_what, parent,
)

_ENUMS = {Phase: 4, SlotStatus: 3, Stage: 3, Pending: 3}
_PY_KIND = {name: getattr(LY, "M_" + name) for name in KIND_NAMES}


def _enum_index(model, value, sort) -> int:
    v = model.eval(value, model_completion=True)
    for i in range(_ENUMS[sort]):
        if z3.is_true(model.eval(v == sort.constructor(i)(), model_completion=True)):
            return i
    raise ValueError(f"no constructor of {sort} matches {v}")


def _int(model, term) -> int:
    return model.eval(term, model_completion=True).as_long()


def _bool(model, term) -> bool:
    return z3.is_true(model.eval(term, model_completion=True))


def _index_of(model, elems, value) -> int:
    for i, e in enumerate(elems):
        if _bool(model, value == e):
            return i
    raise ValueError(f"{value} is not among the named elements")


@dataclass
class Concrete:
    cfg: ModelConfig
    model: Model
    pre: bytes
    post: bytes
    node_of: list  # z3 element per Python node
    key_of: list
    loc_of: list  # z3 element per Python location (None for unused ones)
    states: list  # every state read off (``pre`` and ``post`` are the first and the last)


def concretize(zmodel: z3.ModelRef, pre: State, act: Action, elements, bugs=frozenset()) -> Concrete:
    return concretize_states(zmodel, [pre, act.post], elements, bugs)


def concretize_states(zmodel: z3.ModelRef, states: list[State], elements, bugs=frozenset()) -> Concrete:
    """Read states off a finite z3 model: a configuration sized to it and one ``bytes`` per state."""
    nodes, keys, all_locs, msgs = elements[Node], elements[Key], elements[Loc], elements[Msg]
    noloc_i = _index_of(zmodel, all_locs, NOLOC)
    real = [l for i, l in enumerate(all_locs) if i != noloc_i]
    pool = [l for l in real if _bool(zmodel, is_pool(l))]
    per_node: list[list] = [[] for _ in nodes]
    for l in real:
        if l in pool:
            continue
        per_node[_index_of(zmodel, nodes, locnode(l))].append(l)
    tiers = max([1] + [len(x) for x in per_node])
    loc_of: list = []
    for i in range(len(nodes)):
        row = per_node[i] + [None] * (tiers - len(per_node[i]))
        loc_of += row
    loc_of.append(pool[0] if pool else None)
    term, eps = _int(zmodel, T), _int(zmodel, EPS)
    # The prefix tree (``bounded.forest`` keeps parents before children); a key's namespace is its
    # chain's root, and a node is authorised for a namespace as for the keys of the chain.
    parents = tuple(_index_of(zmodel, keys, parent(k)) if _bool(zmodel, has_parent(k)) else -1 for k in keys)
    roots = []
    for i, p in enumerate(parents):
        roots.append(i if p < 0 else roots[p])
    authorized = tuple(
        frozenset(roots[j] for j, k in enumerate(keys) if _bool(zmodel, allowed(n, k))) for n in nodes
    )
    cfg = ModelConfig(
        name="cti", nodes=len(nodes), parents=parents, namespaces=tuple(roots),
        authorized=authorized, tiers_per_node=tiers, shared_pool=True, tiering=True,
        lease_term_ticks=term, skew_ticks=eps, max_epoch=200, max_lease_id=200, max_requests=250,
        max_messages=250, max_duplications=0, max_node_crashes=1, max_directory_restarts=1,
        # The encoding's restart takes the full grace or a mirrored horizon: both are the model's then.
        mirrored_leases=True,
        description="a counterexample to induction, read off a z3 model",
    )
    model = Model(cfg, bugs)
    L = model.L

    def loc_code(value) -> int:
        v = zmodel.eval(value, model_completion=True)
        if _bool(zmodel, v == NOLOC):
            return LY.NO_LOCATION
        for i, l in enumerate(loc_of):
            if l is not None and _bool(zmodel, v == l):
                return i + 1
        raise ValueError(f"location {v} not mapped")

    def build(state: State) -> bytes:
        b = bytearray(L.fixed)
        index = {Node: nodes, Key: keys}
        for name, (idx, val) in STATE_VARS.items():
            if name == "inflight":
                continue
            arr = getattr(state, name)
            pos = getattr(L, name)
            if idx and idx[0] == Loc:
                rows = [(i, l) for i, l in enumerate(loc_of) if l is not None]
            elif idx:
                rows = list(enumerate(index[idx[0]]))
            if not idx:
                cells = [(pos, arr)]
            elif len(idx) == 1:
                cells = [(pos[i], arr[e]) for i, e in rows]
            else:
                cols = list(enumerate(index[idx[1]]))
                cells = [(pos[i][j], arr[e, f]) for i, e in rows for j, f in cols]
            for p, term_ in cells:
                if val == INT:
                    v = _int(zmodel, term_)
                elif val == z3.BoolSort():
                    v = 1 if _bool(zmodel, term_) else 0
                elif val == Loc:
                    v = loc_code(term_)
                elif val == Node:
                    v = 0  # ``writer``: filled below from the phase
                else:
                    v = _enum_index(zmodel, term_, val)
                if not 0 <= v < 256:
                    raise ValueError(f"{L.names[p]} = {v} does not fit a byte")
                b[p] = v
        for j, k in enumerate(keys):
            if b[L.phase[j]] == LY.WRITING:
                b[L.writer[j]] = _index_of(zmodel, nodes, state.writer[k]) + 1
        b[L.crashes_left] = 1
        b[L.restarts_left] = 1
        net = []
        for m in msgs:
            if not _bool(zmodel, state.inflight[m]):
                continue
            net.append(_message(zmodel, m, nodes, keys, loc_code))
        return bytes(b) + b"".join(sorted(net))

    built = [build(st) for st in states]
    return Concrete(cfg, model, built[0], built[-1], nodes, keys, loc_of, built)


def step_in_model(model: Model, pre: bytes, label: str, post: bytes) -> bool:
    """Is ``post`` a successor of ``pre`` under ``model.successors`` with that label -- up to the
    encoding's set network (a delivered message may stay in flight) and the variables the encoding
    does not have (the bounded-response ghost and the fault budgets)?"""
    L = model.L
    ignore = set(L.inval_age) | {L.crashes_left, L.restarts_left, L.dups_left}
    keep = [i for i in range(L.fixed) if i not in ignore]
    want = bytes(post[i] for i in keep)
    post_msgs = set(L.messages(post))
    pre_msgs = set(L.messages(pre))
    for lab, _params, t in model.successors(pre):
        if lab != label or bytes(t[i] for i in keep) != want:
            continue
        got = set(L.messages(t))
        if got <= post_msgs <= got | pre_msgs:
            return True
    return False


def _message(zmodel, m, nodes, keys, loc_code) -> bytes:
    name = KIND_NAMES[_enum_index_kind(zmodel, m)]
    node = _index_of(zmodel, nodes, m_node(m)) if name not in ("FREE", "COPY", "COPIED", "FREED") else 0
    key = _index_of(zmodel, keys, m_key(m))
    lease, gen, epoch, req = (_int(zmodel, f(m)) for f in (m_lease, m_gen, m_epoch, m_req))
    code = _PY_KIND[name]
    fields = {
        "ACQUIRE": (req, 0, 0, 0),
        "RENEW": (lease, loc_code(m_loc(m)), req, 0),
        "GRANT_READ": (lease, loc_code(m_loc(m)), gen, req),
        "RENEWED": (lease, 0, 0, req),
        "RELEASE": (lease, 0, 0, 0),
        "BEGIN_WRITE": (0, 0, 0, 0),
        "GRANT_WRITE": (lease, loc_code(m_loc(m)), gen, epoch),
        "WRITE_BYTES": (lease, loc_code(m_loc(m)), gen, epoch),
        "COMMIT": (lease, 0, 0, epoch),
        "REVOKE": (lease, 0, gen, 0),
        "ACK": (lease, 0, 0, 0),
        "FREE": (loc_code(m_loc(m)), 0, 0, epoch),
        "COPY": (loc_code(m_loc(m)), loc_code(m_src(m)), gen, epoch),
        "COPIED": (loc_code(m_loc(m)), 0, 0, epoch),
        "REFUSE": (req, _int(zmodel, m_what(m)), 0, 0),
        "FREED": (loc_code(m_loc(m)), 0, 0, epoch),
    }[name]
    for v in fields:
        if not 0 <= v < 256:
            raise ValueError(f"a {name} message field {v} does not fit a byte")
    return LY.message(code, node, key, *fields)


def _enum_index_kind(zmodel, m) -> int:
    v = zmodel.eval(kind(m), model_completion=True)
    for i in range(len(KIND_NAMES)):
        if _bool(zmodel, v == Kind.constructor(i)()):
            return i
    raise ValueError(v)


def python_params(act: Action, zmodel, conc: Concrete) -> tuple:
    """The model's parameter tuple for the step (what the transition properties look at)."""
    if act.python[0] == "crash":
        n = _index_of(zmodel, conc.node_of, act.params["n"])
        return (n, 1 if act.lose_disk else 0)
    return ()
