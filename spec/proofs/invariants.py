"""The inductive invariant: the properties of ``spec/properties.py`` and the strengthenings they need.

Each ``StateInvariant`` has a z3 form over a ``State`` and a Python form over a model state
(``bytes``): for a property of ``properties.py`` the Python form *is* that predicate (so the z3 form
must say exactly the same thing on every state the model can represent); for a strengthening it is
a twin written here from the same definition. The twins serve three purposes: a counterexample to
induction is re-checked by them, a CTI's pre-state is checked against all of them (the z3 and the
Python readings of the hypothesis must agree), and the tests run them over every reachable state of
the model checker's small configurations (a strengthening that is false in a reachable state is a
wrong strengthening, whatever z3 says).

A *claim* is something a holder may act on: a trusted lease (``holder``), a read grant in flight
that answers the holder's pending acquire (``grant``: trusting it is one delivery away), or a
renewal in flight that answers its pending renewal (``renewed``). Every claim carries a lease id,
a location, a generation and the ticks it will be trusted for (its budget, for the last two).

Skew, exactly: the directory's clock may still jump ahead by ``EPS - dir_off`` ticks (each jump
runs its counters down), a holder's clock may still fall back by ``EPS - off[n]`` (each step runs
its counters up). So a claim with ``left`` ticks is safe while the directory's entry satisfies
``r_left - (EPS - dir_off) >= left + (EPS - off[n])`` (``LeaseKnownUnderSkew``), which is what makes
``LeaseKnownToDirectory`` (``r_left >= left``) survive every clock step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import z3

from .. import properties as P
from ..layout import (
    ABSENT as PY_ABSENT,
    COMMITTED as PY_COMMITTED,
    EMPTY as PY_EMPTY,
    FULL as PY_FULL,
    INVALIDATING as PY_INVALIDATING,
    LOST as PY_LOST,
    M_ACK as PY_M_ACK,
    M_ACQUIRE as PY_M_ACQUIRE,
    M_COMMIT as PY_M_COMMIT,
    M_COPIED as PY_M_COPIED,
    M_COPY as PY_M_COPY,
    M_FREED as PY_M_FREED,
    M_FREE as PY_M_FREE,
    M_GRANT_READ as PY_M_GRANT_READ,
    M_GRANT_WRITE as PY_M_GRANT_WRITE,
    M_RELEASE as PY_M_RELEASE,
    M_RENEW as PY_M_RENEW,
    M_RENEWED as PY_M_RENEWED,
    M_REVOKE as PY_M_REVOKE,
    M_WRITE_BYTES as PY_M_WRITE_BYTES,
    MESSAGE_WIDTH,
    P_ACQUIRE as PY_P_ACQUIRE,
    P_NONE as PY_P_NONE,
    P_RENEW as PY_P_RENEW,
    W_BYTES_SENT as PY_W_BYTES_SENT,
    W_NONE as PY_W_NONE,
    WRITING as PY_WRITING,
)
from ..model import Model
from .encoding import (
    ABSENT, COMMITTED, EMPTY, EPS, FULL, INVALIDATING, LOST, NOLOC, P_ACQUIRE, P_NONE, P_RENEW, T,
    W_BYTES_SENT, W_NONE, WRITING, Action, FIELD_FUNS, KIND_FIELDS, Key, Loc, Msg, Node, State, allowed, has_parent,
    kind, loc_up, m_epoch, parent,
    m_gen, m_key, m_lease, m_loc, m_node, m_req, m_src, K_,
)

PyPred = Callable[[Model, bytes], bool]

_bv_counter = [0]


def bv(name: str, sort: z3.SortRef) -> z3.ExprRef:
    """A fresh bound variable."""
    _bv_counter[0] += 1
    return z3.Const(f"{name}{_bv_counter[0]}", sort)


def ForAll(vs, body):
    return z3.ForAll(vs, body) if vs else body


@dataclass
class StateInvariant:
    name: str
    kind: str  # "property" (from properties.py) or "strengthening"
    text: str
    z3: Callable[[State], z3.BoolRef]
    python: PyPred
    design: str = ""


@dataclass
class StepInvariant:
    """A transition property of ``properties.py``: ``z3(pre, action)`` over the action's post-state."""

    name: str
    text: str
    z3: Callable[[State, Action], z3.BoolRef]
    python: Callable
    kind: str = "transition property"
    design: str = ""


# ============================================================================ z3 building blocks


def in_phase(s: State, k, *phases) -> z3.BoolRef:
    return z3.Or([s.phase[k] == p for p in phases])


def slot_holds(s: State, loc, k, gen) -> z3.BoolRef:
    """``properties._slot_holds``: exactly generation ``gen`` -- or lost in a crash."""
    return z3.Or(s.s_status[loc, k] == LOST, z3.And(s.s_status[loc, k] == FULL, s.s_gen[loc, k] == gen))


def slot_current_exact(s: State, loc, k) -> z3.BoolRef:
    """The slot holds (or lost) the key's current generation, and nothing else."""
    return z3.And(z3.Or(s.s_status[loc, k] == FULL, s.s_status[loc, k] == LOST), s.s_gen[loc, k] == s.gen[k])


def protected(s: State, loc, k) -> z3.BoolRef:
    """An authoritative copy of a committed (or invalidating) generation: its owner or draining copy."""
    return z3.And(
        in_phase(s, k, COMMITTED, INVALIDATING),
        z3.Or(loc == s.owner[k], z3.And(loc == s.draining[k], s.draining[k] != NOLOC)),
    )


def msg_is(s: State, m, kind_name: str) -> z3.BoolRef:
    return z3.And(s.inflight[m], kind(m) == K_[kind_name])


@dataclass
class Item:
    vars: list
    cond: z3.BoolRef
    f: dict = field(default_factory=dict)


def _msg_item(s: State, kind_name: str, **extra) -> Item:
    m = bv(f"m_{kind_name.lower()}_", Msg)
    # Only the fields this kind carries: the others are don't-cares of the element.
    f = {name: FIELD_FUNS[name](m) for name in KIND_FIELDS[kind_name]}
    f["msg"] = m
    return Item([m], msg_is(s, m, kind_name), f)


def write_tokens(s: State, with_commits: bool = False) -> list[Item]:
    """Everything that carries a write grant: grants, bytes in flight, a writer that sent bytes."""
    n, k = bv("wt_n", Node), bv("wt_k", Key)
    items = [
        _msg_item(s, "GRANT_WRITE"),
        _msg_item(s, "WRITE_BYTES"),
        Item([n, k], s.w_stage[n, k] == W_BYTES_SENT,
             dict(key=k, node=n, lease=s.wr_id[n, k], loc=s.wr_loc[n, k], gen=s.wr_gen[n, k], epoch=s.wr_epoch[n, k])),
    ]
    if with_commits:
        c = _msg_item(s, "COMMIT")
        c.f = {k_: v for k_, v in c.f.items() if k_ in ("key", "node", "lease", "epoch", "msg")}
        items.append(c)
    return items


def epoch_items(s: State) -> list[Item]:
    """Everything that names (key, generation, epoch, location): write tokens, copies, stored bytes."""
    l, k = bv("ei_l", Loc), bv("ei_k", Key)
    items = write_tokens(s)
    items.append(_msg_item(s, "COPY"))
    items.append(Item(
        [l, k],
        z3.And(l != NOLOC, z3.Or(s.s_status[l, k] == FULL, s.s_status[l, k] == LOST)),
        dict(key=k, loc=l, gen=s.s_gen[l, k], epoch=s.s_epoch[l, k]),
    ))
    return items


def lease_items(s: State) -> list[Item]:
    """Everything that names (node, key, read lease, location): the table, holders, grants, renewals."""
    k1, n1, n2, k2 = bv("li_k", Key), bv("li_n", Node), bv("li_n", Node), bv("li_k", Key)
    return [
        Item([k1, n1], s.r_id[k1, n1] != 0, dict(node=n1, key=k1, lease=s.r_id[k1, n1], loc=s.r_loc[k1, n1])),
        Item([n2, k2], s.h_id[n2, k2] != 0,
             dict(node=n2, key=k2, lease=s.h_id[n2, k2], loc=s.h_loc[n2, k2], gen=s.h_gen[n2, k2])),
        _msg_item(s, "GRANT_READ"),
        _msg_item(s, "RENEW"),
    ]


def matched_grant(s: State, g) -> z3.BoolRef:
    """A read grant in flight that answers the holder's pending acquire."""
    n, k = m_node(g), m_key(g)
    return z3.And(msg_is(s, g, "GRANT_READ"), s.p_kind[n, k] == P_ACQUIRE, s.p_id[n, k] == m_req(g))


def claims(s: State) -> list[Item]:
    """What a holder may act on (see the module docstring), with the ticks it will trust it for."""
    n, k = bv("cl_n", Node), bv("cl_k", Key)
    g, r = bv("cl_g", Msg), bv("cl_r", Msg)
    rn, rk = m_node(r), m_key(r)
    return [
        Item([n, k], s.h_id[n, k] != 0,
             dict(node=n, key=k, lease=s.h_id[n, k], loc=s.h_loc[n, k], gen=s.h_gen[n, k], left=s.h_left[n, k])),
        Item([g], matched_grant(s, g),
             dict(node=m_node(g), key=m_key(g), lease=m_lease(g), loc=m_loc(g), gen=m_gen(g),
                  left=s.p_left[m_node(g), m_key(g)])),
        Item([r], z3.And(msg_is(s, r, "RENEWED"), s.p_kind[rn, rk] == P_RENEW, s.p_id[rn, rk] == m_req(r),
                         s.h_id[rn, rk] == m_lease(r)),
             dict(node=rn, key=rk, lease=m_lease(r), loc=s.h_loc[rn, rk], gen=s.h_gen[rn, rk],
                  left=s.p_left[rn, rk])),
    ]


def pairwise(items: list[Item], same: Callable[[dict, dict], z3.BoolRef],
             then: Callable[[dict, dict], z3.BoolRef], reflexive: bool = True) -> z3.BoolRef:
    """For every two items (of the families given, each pair of families once): ``same => then``."""
    conj = []
    for i, a in enumerate(items):
        for j in range(i, len(items)):
            b = items[j]
            if j == i:
                # A second copy of the family, with its own bound variables.
                b = _rebind(a)
            conj.append(ForAll(a.vars + b.vars, z3.Implies(z3.And(a.cond, b.cond, same(a.f, b.f)), then(a.f, b.f))))
    return z3.And(conj)


def _rebind(item: Item) -> Item:
    new_vars = [bv(str(v) + "_", v.sort()) for v in item.vars]
    sub = list(zip(item.vars, new_vars))
    return Item(new_vars, z3.substitute(item.cond, *sub),
                {k: z3.substitute(v, *sub) for k, v in item.f.items()})


def each(items: list[Item], body: Callable[[dict], z3.BoolRef]) -> z3.BoolRef:
    return z3.And([ForAll(it.vars, z3.Implies(it.cond, body(it.f))) for it in items])


def _has(keys):
    return lambda a, b: all(k in a and k in b for k in keys)


# ============================================================================ Python building blocks


def _msgs(m: Model, s: bytes):
    for i in range(m.L.fixed, len(s), MESSAGE_WIDTH):
        yield s[i : i + MESSAGE_WIDTH]


def _py_slot_current_exact(m: Model, s: bytes, loc1: int, k: int) -> bool:
    L = m.L
    if loc1 == 0:
        return False
    loc = loc1 - 1
    return s[L.s_status[loc][k]] in (PY_FULL, PY_LOST) and s[L.s_gen[loc][k]] == s[L.gen[k]]


def _py_protected(m: Model, s: bytes, loc1: int, k: int) -> bool:
    L = m.L
    if s[L.phase[k]] not in (PY_COMMITTED, PY_INVALIDATING):
        return False
    return loc1 != 0 and (loc1 == s[L.owner[k]] or loc1 == s[L.draining[k]])


def _py_loc_up(m: Model, s: bytes, loc: int) -> bool:
    return m.location_up(s, loc)


def _py_write_tokens(m: Model, s: bytes, with_commits: bool = False) -> list[dict]:
    L = m.L
    out = []
    for n in range(m.cfg.nodes):
        for k in range(m.cfg.keys):
            if s[L.w_stage[n][k]] == PY_W_BYTES_SENT:
                out.append(dict(key=k, node=n, lease=s[L.wr_id[n][k]], loc=s[L.wr_loc[n][k]], gen=s[L.wr_gen[n][k]],
                                epoch=s[L.wr_epoch[n][k]]))
    for msg in _msgs(m, s):
        kind_, n, k, a, b, c, d = msg
        if kind_ in (PY_M_GRANT_WRITE, PY_M_WRITE_BYTES):
            out.append(dict(key=k, node=n, lease=a, loc=b, gen=c, epoch=d))
        elif kind_ == PY_M_COMMIT and with_commits:
            out.append(dict(key=k, node=n, lease=a, epoch=d))
    return out


def _py_epoch_items(m: Model, s: bytes) -> list[dict]:
    L = m.L
    out = _py_write_tokens(m, s)
    for msg in _msgs(m, s):
        kind_, n, k, a, b, c, d = msg
        if kind_ == PY_M_COPY:
            out.append(dict(key=k, loc=a, gen=c, epoch=d))
    for loc in range(m.cfg.locations):
        for k in range(m.cfg.keys):
            if s[L.s_status[loc][k]] in (PY_FULL, PY_LOST):
                out.append(dict(key=k, loc=loc + 1, gen=s[L.s_gen[loc][k]], epoch=s[L.s_epoch[loc][k]]))
    return out


def _py_lease_items(m: Model, s: bytes) -> list[dict]:
    L = m.L
    out = []
    for k in range(m.cfg.keys):
        for n in range(m.cfg.nodes):
            if s[L.r_id[k][n]]:
                out.append(dict(node=n, key=k, lease=s[L.r_id[k][n]], loc=s[L.r_loc[k][n]]))
            if s[L.h_id[n][k]]:
                out.append(dict(node=n, key=k, lease=s[L.h_id[n][k]], loc=s[L.h_loc[n][k]], gen=s[L.h_gen[n][k]]))
    for msg in _msgs(m, s):
        kind_, n, k, a, b, c, d = msg
        if kind_ == PY_M_GRANT_READ:
            out.append(dict(node=n, key=k, lease=a, loc=b, gen=c))
        elif kind_ == PY_M_RENEW:
            out.append(dict(node=n, key=k, lease=a, loc=b))
    return out


def _py_matched_grant(m: Model, s: bytes, msg: bytes) -> bool:
    L = m.L
    kind_, n, k, a, b, c, d = msg
    return kind_ == PY_M_GRANT_READ and s[L.p_kind[n][k]] == PY_P_ACQUIRE and s[L.p_id[n][k]] == d


def _py_claims(m: Model, s: bytes) -> list[dict]:
    L = m.L
    out = []
    for n in range(m.cfg.nodes):
        for k in range(m.cfg.keys):
            if s[L.h_id[n][k]]:
                out.append(dict(node=n, key=k, lease=s[L.h_id[n][k]], loc=s[L.h_loc[n][k]], gen=s[L.h_gen[n][k]],
                                left=s[L.h_left[n][k]], source="holder"))
    for msg in _msgs(m, s):
        kind_, n, k, a, b, c, d = msg
        if _py_matched_grant(m, s, msg):
            out.append(dict(node=n, key=k, lease=a, loc=b, gen=c, left=s[L.p_left[n][k]], source="grant"))
        elif (kind_ == PY_M_RENEWED and s[L.p_kind[n][k]] == PY_P_RENEW and s[L.p_id[n][k]] == d
              and s[L.h_id[n][k]] == a):
            out.append(dict(node=n, key=k, lease=a, loc=s[L.h_loc[n][k]], gen=s[L.h_gen[n][k]],
                            left=s[L.p_left[n][k]], source="renewed"))
    return out


def _py_pairs(items: list[dict]):
    for i, a in enumerate(items):
        for b in items[i:]:
            yield a, b


# ============================================================================ the properties


def z_one_writer_per_generation(s: State) -> z3.BoolRef:
    n1, k1, n2, k2 = bv("ow_n", Node), bv("ow_k", Key), bv("ow_n", Node), bv("ow_k", Key)
    g1, g2 = bv("ow_g", Msg), bv("ow_g", Msg)
    wr1 = (s.w_stage[n1, k1] == W_BYTES_SENT, k1, s.wr_gen[n1, k1], n1)
    wr2 = (s.w_stage[n2, k2] == W_BYTES_SENT, k2, s.wr_gen[n2, k2], n2)
    gw1 = (msg_is(s, g1, "GRANT_WRITE"), m_key(g1), m_gen(g1), m_node(g1))
    gw2 = (msg_is(s, g2, "GRANT_WRITE"), m_key(g2), m_gen(g2), m_node(g2))

    def clause(vs, a, b):
        return z3.ForAll(vs, z3.Implies(z3.And(a[0], b[0], a[1] == b[1], a[2] == b[2]), a[3] == b[3]))

    return z3.And(clause([n1, k1, n2, k2], wr1, wr2), clause([n1, k1, g1], wr1, gw1), clause([g1, g2], gw1, gw2))


def z_one_owner_per_epoch(s: State) -> z3.BoolRef:
    l1, l2, k = bv("oo_l", Loc), bv("oo_l", Loc), bv("oo_k", Key)
    return z3.ForAll([l1, l2, k], z3.Implies(
        z3.And(l1 != NOLOC, l2 != NOLOC, s.s_status[l1, k] == FULL, s.s_status[l2, k] == FULL,
               s.s_epoch[l1, k] == s.s_epoch[l2, k]),
        l1 == l2))


def z_epochs_bound_fences(s: State) -> z3.BoolRef:
    l, k, m = bv("eb_l", Loc), bv("eb_k", Key), bv("eb_m", Msg)
    return z3.And(
        z3.ForAll([l, k], z3.Implies(l != NOLOC, z3.And(s.fence[l, k] <= s.epoch[k], s.s_epoch[l, k] <= s.epoch[k]))),
        z3.ForAll([m], z3.Implies(
            z3.And(s.inflight[m], z3.Or(kind(m) == K_["GRANT_WRITE"], kind(m) == K_["WRITE_BYTES"], kind(m) == K_["COPY"])),
            m_epoch(m) <= s.epoch[m_key(m)])),
    )


def z_no_dirty_read(s: State) -> z3.BoolRef:
    n, k = bv("nd_n", Node), bv("nd_k", Key)
    return z3.ForAll([n, k], z3.Implies(s.h_id[n, k] != 0, in_phase(s, k, COMMITTED, INVALIDATING)))


def z_committed_bytes_intact(s: State) -> z3.BoolRef:
    k = bv("cb_k", Key)
    return z3.ForAll([k], z3.Implies(in_phase(s, k, COMMITTED, INVALIDATING), z3.And(
        z3.Implies(s.owner[k] != NOLOC, slot_holds(s, s.owner[k], k, s.gen[k])),
        z3.Implies(s.draining[k] != NOLOC, slot_holds(s, s.draining[k], k, s.gen[k])),
    )))


def z_no_reclaim_under_lease(s: State) -> z3.BoolRef:
    n, k = bv("nr_n", Node), bv("nr_k", Key)
    return z3.ForAll([n, k], z3.Implies(s.h_id[n, k] != 0, slot_holds(s, s.h_loc[n, k], k, s.h_gen[n, k])))


def z_no_stale_read(s: State) -> z3.BoolRef:
    n, k = bv("ns_n", Node), bv("ns_k", Key)
    return z3.ForAll([n, k], z3.Implies(s.h_id[n, k] != 0, s.h_gen[n, k] == s.gen[k]))


def z_no_read_after_ack(s: State) -> z3.BoolRef:
    m = bv("na_m", Msg)
    n, k = bv("na_n", Node), bv("na_k", Key)
    return z3.And(
        z3.ForAll([n, k], z3.Implies(z3.And(s.h_id[n, k] != 0, s.acked[n, k]), s.h_gen[n, k] != s.gen[k])),
        z3.ForAll([m], z3.Implies(msg_is(s, m, "ACK"), s.h_id[m_node(m), m_key(m)] != m_lease(m))),
    )


_LEASE_KINDS = ("RENEW", "GRANT_READ", "RENEWED", "RELEASE", "GRANT_WRITE", "WRITE_BYTES", "COMMIT", "REVOKE", "ACK")


def z_lease_ids_fresh(s: State) -> z3.BoolRef:
    k, n, m = bv("lf_k", Key), bv("lf_n", Node), bv("lf_m", Msg)
    top = s.next_id
    return z3.And(
        z3.ForAll([k], s.w_id[k] < top),
        z3.ForAll([k, n], z3.And(s.r_id[k, n] < top, s.h_id[n, k] < top, s.wr_id[n, k] < top)),
        z3.ForAll([m], z3.Implies(z3.And(s.inflight[m], z3.Or([kind(m) == K_[x] for x in _LEASE_KINDS])),
                                  m_lease(m) < top)),
    )


def z_lease_known_to_directory(s: State) -> z3.BoolRef:
    n, k = bv("lk_n", Node), bv("lk_k", Key)
    left = s.h_left[n, k]
    return z3.ForAll([n, k], z3.Implies(s.h_id[n, k] != 0, z3.Or(
        z3.And(s.r_id[k, n] == s.h_id[n, k], s.r_left[k, n] >= left), s.grace >= left)))


def z_directory_data_agreement(s: State) -> z3.BoolRef:
    k, n = bv("dd_k", Key), bv("dd_n", Node)
    return z3.ForAll([k, n], z3.Implies(s.r_id[k, n] != 0, z3.And(
        s.r_loc[k, n] != NOLOC, slot_holds(s, s.r_loc[k, n], k, s.gen[k]))))


def z_prefix_closed(s: State) -> z3.BoolRef:
    k = bv("pf_k", Key)
    return z3.ForAll([k], z3.Implies(z3.And(has_parent(k), in_phase(s, k, WRITING, COMMITTED)),
                                     s.phase[parent(k)] == COMMITTED))


def z_namespace_isolation(s: State) -> z3.BoolRef:
    n, k = bv("ni_n", Node), bv("ni_k", Key)
    return z3.ForAll([n, k], z3.Implies(z3.Not(allowed(n, k)), z3.And(
        s.r_id[k, n] == 0, s.h_id[n, k] == 0, s.w_stage[n, k] != W_BYTES_SENT)))


# ============================================================================ the strengthenings


def z_clocks_in_range(s: State) -> z3.BoolRef:
    n = bv("cr_n", Node)
    return z3.And(
        s.dir_off >= 0, s.dir_off <= EPS, s.grace >= 0, s.next_id >= 1,
        z3.ForAll([n], z3.And(s.off[n] >= 0, s.off[n] <= EPS, s.req[n] >= 0)),
    )


def py_clocks_in_range(m: Model, s: bytes) -> bool:
    L, eps = m.L, m.cfg.skew_ticks
    return (s[L.dir_off] <= eps and s[L.next_id] >= 1
            and all(s[L.off[n]] <= eps for n in range(m.cfg.nodes)))


def z_record_shape(s: State) -> z3.BoolRef:
    k = bv("rs_k", Key)
    ph = s.phase[k]
    return z3.ForAll([k], z3.And(
        s.gen[k] >= 0, s.epoch[k] >= 0, s.w_left[k] >= 0, s.w_id[k] >= 0,
        z3.Implies(ph == ABSENT, z3.And(s.owner[k] == NOLOC, s.moving[k] == NOLOC, s.draining[k] == NOLOC,
                                        s.w_id[k] == 0, s.w_left[k] == 0)),
        z3.Implies(ph == WRITING, z3.And(s.owner[k] != NOLOC, s.moving[k] == NOLOC, s.draining[k] == NOLOC,
                                         s.w_id[k] >= 1)),
        z3.Implies(ph != ABSENT, s.epoch[k] >= 1),  # a write grant took an epoch (bytes are under epochs from 1)
        z3.Implies(in_phase(s, k, COMMITTED, INVALIDATING), z3.And(s.owner[k] != NOLOC, s.w_id[k] == 0,
                                                                   s.w_left[k] == 0)),
        z3.Implies(ph == INVALIDATING, s.moving[k] == NOLOC),
        z3.Implies(s.moving[k] != NOLOC, z3.And(s.draining[k] == NOLOC, s.moving[k] != s.owner[k])),
        z3.Implies(s.draining[k] != NOLOC, s.draining[k] != s.owner[k]),
    ))


def py_record_shape(m: Model, s: bytes) -> bool:
    L = m.L
    for k in range(m.cfg.keys):
        ph, owner, moving, draining = s[L.phase[k]], s[L.owner[k]], s[L.moving[k]], s[L.draining[k]]
        w_id, w_left = s[L.w_id[k]], s[L.w_left[k]]
        if ph == PY_ABSENT and (owner or moving or draining or w_id or w_left):
            return False
        if ph == PY_WRITING and (not owner or moving or draining or not w_id):
            return False
        if ph != PY_ABSENT and s[L.epoch[k]] < 1:
            return False
        if ph in (PY_COMMITTED, PY_INVALIDATING) and (not owner or w_id or w_left):
            return False
        if ph == PY_INVALIDATING and moving:
            return False
        if moving and (draining or moving == owner):
            return False
        if draining and draining == owner:
            return False
    return True


def z_lease_table_shape(s: State) -> z3.BoolRef:
    k, n = bv("ts_k", Key), bv("ts_n", Node)
    return z3.ForAll([k, n], z3.And(
        s.r_id[k, n] >= 0, s.r_left[k, n] >= 0,
        (s.r_id[k, n] == 0) == (s.r_left[k, n] == 0),
        z3.Implies(s.r_id[k, n] == 0, s.r_loc[k, n] == NOLOC),
    ))


def py_lease_table_shape(m: Model, s: bytes) -> bool:
    L = m.L
    for k in range(m.cfg.keys):
        for n in range(m.cfg.nodes):
            rid, rleft, rloc = s[L.r_id[k][n]], s[L.r_left[k][n]], s[L.r_loc[k][n]]
            if (rid == 0) != (rleft == 0) or (rid == 0 and rloc):
                return False
    return True


def z_holder_shape(s: State) -> z3.BoolRef:
    n, k = bv("hs_n", Node), bv("hs_k", Key)
    hid, pk = s.h_id[n, k], s.p_kind[n, k]
    return z3.ForAll([n, k], z3.And(
        hid >= 0, s.h_left[n, k] >= 0, s.h_gen[n, k] >= 0,
        (hid == 0) == (s.h_left[n, k] == 0),
        z3.Implies(hid == 0, z3.And(s.h_loc[n, k] == NOLOC, s.h_gen[n, k] == 0)),
        z3.Implies(hid != 0, s.h_loc[n, k] != NOLOC),
        s.p_left[n, k] >= 0,
        (pk == P_NONE) == (s.p_left[n, k] == 0),
        z3.Implies(pk == P_NONE, s.p_id[n, k] == 0),
        z3.Implies(pk != P_NONE, z3.And(s.p_id[n, k] >= 1, s.p_id[n, k] <= s.req[n])),
        z3.Implies(pk == P_ACQUIRE, hid == 0),
        z3.Implies(z3.Not(s.up[n]), z3.And(hid == 0, pk == P_NONE, s.w_stage[n, k] == W_NONE)),
    ))


def py_holder_shape(m: Model, s: bytes) -> bool:
    L = m.L
    for n in range(m.cfg.nodes):
        for k in range(m.cfg.keys):
            hid, hleft, hloc, hgen = s[L.h_id[n][k]], s[L.h_left[n][k]], s[L.h_loc[n][k]], s[L.h_gen[n][k]]
            pk, pid, pleft = s[L.p_kind[n][k]], s[L.p_id[n][k]], s[L.p_left[n][k]]
            if (hid == 0) != (hleft == 0):
                return False
            if hid == 0 and (hloc or hgen):
                return False
            if hid and not hloc:
                return False
            if (pk == PY_P_NONE) != (pleft == 0):
                return False
            if pk == PY_P_NONE and pid:
                return False
            if pk != PY_P_NONE and not (1 <= pid <= s[L.req[n]]):
                return False
            if pk == PY_P_ACQUIRE and hid:
                return False
            if not s[L.up[n]] and (hid or pk != PY_P_NONE or s[L.w_stage[n][k]] != PY_W_NONE):
                return False
    return True


def z_writer_shape(s: State) -> z3.BoolRef:
    n, k = bv("ws_n", Node), bv("ws_k", Key)
    sent = s.w_stage[n, k] == W_BYTES_SENT
    return z3.ForAll([n, k], z3.And(
        z3.Implies(z3.Not(sent), z3.And(s.wr_id[n, k] == 0, s.wr_gen[n, k] == 0, s.wr_epoch[n, k] == 0,
                                        s.wr_loc[n, k] == NOLOC)),
        z3.Implies(sent, z3.And(s.wr_id[n, k] >= 1, s.wr_gen[n, k] >= 0, s.wr_epoch[n, k] >= 1,
                                s.wr_loc[n, k] != NOLOC)),
    ))


def py_writer_shape(m: Model, s: bytes) -> bool:
    L = m.L
    for n in range(m.cfg.nodes):
        for k in range(m.cfg.keys):
            fields = (s[L.wr_id[n][k]], s[L.wr_gen[n][k]], s[L.wr_epoch[n][k]], s[L.wr_loc[n][k]])
            if s[L.w_stage[n][k]] != PY_W_BYTES_SENT:
                if any(fields):
                    return False
            elif not (fields[0] >= 1 and fields[2] >= 1 and fields[3]):
                return False
    return True


def z_slot_shape(s: State) -> z3.BoolRef:
    l, k = bv("ss_l", Loc), bv("ss_k", Key)
    return z3.ForAll([l, k], z3.Implies(l != NOLOC, z3.And(
        s.s_gen[l, k] >= 0, s.s_epoch[l, k] >= 0, s.fence[l, k] >= 0, s.freed[l, k] >= 0, s.to_free[l, k] >= 0,
        z3.Implies(s.s_status[l, k] == EMPTY, z3.And(s.s_gen[l, k] == 0, s.s_epoch[l, k] == 0)),
    )))


def py_slot_shape(m: Model, s: bytes) -> bool:
    L = m.L
    return all(
        s[L.s_status[loc][k]] != PY_EMPTY or (s[L.s_gen[loc][k]] == 0 and s[L.s_epoch[loc][k]] == 0)
        for loc in range(m.cfg.locations) for k in range(m.cfg.keys)
    )


# Per message kind: what its fields satisfy (in z3: over the element; in Python: over the record).
def _z_msg_shape(s: State, m) -> z3.BoolRef:
    def req_ok():
        return z3.And(m_req(m) >= 1, m_req(m) <= s.req[m_node(m)])

    lease_ok = m_lease(m) >= 1
    cases = {
        "ACQUIRE": req_ok(),
        "RENEW": z3.And(lease_ok, m_loc(m) != NOLOC, req_ok()),
        "GRANT_READ": z3.And(lease_ok, m_loc(m) != NOLOC, m_gen(m) >= 0, req_ok()),
        "RENEWED": z3.And(lease_ok, req_ok()),
        "RELEASE": lease_ok,
        "BEGIN_WRITE": z3.BoolVal(True),
        "GRANT_WRITE": z3.And(lease_ok, m_loc(m) != NOLOC, m_gen(m) >= 0, m_epoch(m) >= 1),
        "WRITE_BYTES": z3.And(lease_ok, m_loc(m) != NOLOC, m_gen(m) >= 0, m_epoch(m) >= 1),
        "COMMIT": z3.And(lease_ok, m_epoch(m) >= 1),
        "REVOKE": lease_ok,
        "ACK": lease_ok,
        "FREE": z3.And(m_loc(m) != NOLOC, m_epoch(m) >= 0),
        "COPY": z3.And(m_loc(m) != NOLOC, m_src(m) != NOLOC, m_gen(m) >= 0, m_epoch(m) >= 1),
        "COPIED": z3.And(m_loc(m) != NOLOC, m_epoch(m) >= 1),
        "REFUSE": z3.BoolVal(True),
        "FREED": m_loc(m) != NOLOC,
    }
    return z3.And([z3.Implies(kind(m) == K_[name], body) for name, body in cases.items()])


def z_message_shape(s: State) -> z3.BoolRef:
    m = bv("ms_m", Msg)
    return z3.ForAll([m], z3.Implies(s.inflight[m], _z_msg_shape(s, m)))


def py_message_shape(m: Model, s: bytes) -> bool:
    L = m.L
    for msg in _msgs(m, s):
        kind_, n, k, a, b, c, d = msg
        if kind_ == PY_M_ACQUIRE and not (1 <= a <= s[L.req[n]]):
            return False
        if kind_ == PY_M_RENEW and not (a >= 1 and b and 1 <= c <= s[L.req[n]]):
            return False
        if kind_ == PY_M_GRANT_READ and not (a >= 1 and b and 1 <= d <= s[L.req[n]]):
            return False
        if kind_ == PY_M_RENEWED and not (a >= 1 and 1 <= d <= s[L.req[n]]):
            return False
        if kind_ in (PY_M_RELEASE, PY_M_REVOKE, PY_M_ACK) and a < 1:
            return False
        if kind_ in (PY_M_GRANT_WRITE, PY_M_WRITE_BYTES) and not (a >= 1 and b and d >= 1):
            return False
        if kind_ == PY_M_COMMIT and not (a >= 1 and d >= 1):
            return False
        if kind_ == PY_M_FREE and not a:
            return False
        if kind_ == PY_M_COPY and not (a and b and d >= 1):
            return False
        if kind_ == PY_M_COPIED and not (a and d >= 1):
            return False
        if kind_ == PY_M_FREED and not a:
            return False
    return True


def z_pending_budget(s: State) -> z3.BoolRef:
    n, k = bv("pb_n", Node), bv("pb_k", Key)
    return z3.ForAll([n, k], z3.Implies(s.p_kind[n, k] != P_NONE, s.p_left[n, k] + EPS <= T + s.off[n]))


def py_pending_budget(m: Model, s: bytes) -> bool:
    L, cfg = m.L, m.cfg
    return all(
        s[L.p_kind[n][k]] == PY_P_NONE or s[L.p_left[n][k]] + cfg.skew_ticks <= cfg.lease_term_ticks + s[L.off[n]]
        for n in range(cfg.nodes) for k in range(cfg.keys)
    )


def z_trust_budget(s: State) -> z3.BoolRef:
    n, k = bv("tb_n", Node), bv("tb_k", Key)
    return z3.ForAll([n, k], z3.Implies(s.h_id[n, k] != 0, s.h_left[n, k] + EPS <= T + s.off[n]))


def py_trust_budget(m: Model, s: bytes) -> bool:
    L, cfg = m.L, m.cfg
    return all(
        s[L.h_id[n][k]] == 0 or s[L.h_left[n][k]] + cfg.skew_ticks <= cfg.lease_term_ticks + s[L.off[n]]
        for n in range(cfg.nodes) for k in range(cfg.keys)
    )


def z_lease_known_under_skew(s: State) -> z3.BoolRef:
    def covered(f):
        n, k = f["node"], f["key"]
        need = f["left"] + (EPS - s.off[n])
        slack_dir = EPS - s.dir_off
        return z3.Or(
            z3.And(s.r_id[k, n] == f["lease"], s.r_left[k, n] - slack_dir >= need),
            s.grace - slack_dir >= need,
        )

    return each(claims(s), covered)


def py_lease_known_under_skew(m: Model, s: bytes) -> bool:
    L, eps = m.L, m.cfg.skew_ticks
    slack_dir = eps - s[L.dir_off]
    for c in _py_claims(m, s):
        n, k = c["node"], c["key"]
        need = c["left"] + eps - s[L.off[n]]
        if s[L.r_id[k][n]] == c["lease"] and s[L.r_left[k][n]] - slack_dir >= need:
            continue
        if s[L.grace] - slack_dir >= need:
            continue
        return False
    return True


def z_claims_placed(s: State) -> z3.BoolRef:
    def placed(f):
        k, loc = f["key"], f["loc"]
        return z3.And(
            in_phase(s, k, COMMITTED, INVALIDATING), f["gen"] == s.gen[k],
            z3.Or(loc == s.owner[k], z3.And(loc == s.draining[k], s.draining[k] != NOLOC)),
        )

    return each(claims(s), placed)


def py_claims_placed(m: Model, s: bytes) -> bool:
    L = m.L
    for c in _py_claims(m, s):
        k = c["key"]
        if s[L.phase[k]] not in (PY_COMMITTED, PY_INVALIDATING) or c["gen"] != s[L.gen[k]]:
            return False
        if not (c["loc"] and (c["loc"] == s[L.owner[k]] or c["loc"] == s[L.draining[k]])):
            return False
    return True


def z_lease_placed(s: State) -> z3.BoolRef:
    k, n = bv("lp_k", Key), bv("lp_n", Node)
    loc = s.r_loc[k, n]
    return z3.ForAll([k, n], z3.Implies(s.r_id[k, n] != 0, z3.And(
        in_phase(s, k, COMMITTED, INVALIDATING),
        z3.Or(loc == s.owner[k], z3.And(loc == s.draining[k], s.draining[k] != NOLOC)),
    )))


def py_lease_placed(m: Model, s: bytes) -> bool:
    L = m.L
    for k in range(m.cfg.keys):
        for n in range(m.cfg.nodes):
            if s[L.r_id[k][n]]:
                loc = s[L.r_loc[k][n]]
                if s[L.phase[k]] not in (PY_COMMITTED, PY_INVALIDATING):
                    return False
                if not (loc and (loc == s[L.owner[k]] or loc == s[L.draining[k]])):
                    return False
    return True


def z_lease_fields_agree(s: State) -> z3.BoolRef:
    same = lambda a, b: z3.And(a["node"] == b["node"], a["key"] == b["key"], a["lease"] == b["lease"])

    def then(a, b):
        conj = [a["loc"] == b["loc"]]
        if "gen" in a and "gen" in b:
            conj.append(a["gen"] == b["gen"])
        return z3.And(conj)

    return pairwise(lease_items(s), same, then)


def py_lease_fields_agree(m: Model, s: bytes) -> bool:
    for a, b in _py_pairs(_py_lease_items(m, s)):
        if (a["node"], a["key"], a["lease"]) == (b["node"], b["key"], b["lease"]):
            if a["loc"] != b["loc"] or ("gen" in a and "gen" in b and a["gen"] != b["gen"]):
                return False
    return True


def z_revoked_not_claimed(s: State) -> z3.BoolRef:
    conj = []
    for kind_name in ("ACK", "RELEASE"):
        r, g = bv("rv_m", Msg), bv("rv_g", Msg)
        n, k, lease = m_node(r), m_key(r), m_lease(r)
        conj.append(z3.ForAll([r], z3.Implies(msg_is(s, r, kind_name), z3.And(
            s.h_id[n, k] != lease,
            z3.ForAll([g], z3.Not(z3.And(matched_grant(s, g), m_node(g) == n, m_key(g) == k, m_lease(g) == lease))),
        ))))
    return z3.And(conj)


def py_revoked_not_claimed(m: Model, s: bytes) -> bool:
    L = m.L
    msgs = list(_msgs(m, s))
    for r in msgs:
        kind_, n, k, a, *_ = r
        if kind_ not in (PY_M_ACK, PY_M_RELEASE):
            continue
        if s[L.h_id[n][k]] == a:
            return False
        for g in msgs:
            if _py_matched_grant(m, s, g) and (g[1], g[2], g[3]) == (n, k, a):
                return False
    return True


def z_epochs_order_generations(s: State) -> z3.BoolRef:
    same = lambda a, b: a["key"] == b["key"]

    def then(a, b):
        return z3.And(
            z3.Implies(a["epoch"] == b["epoch"], z3.And(a["gen"] == b["gen"], a["loc"] == b["loc"])),
            z3.Implies(a["epoch"] < b["epoch"], a["gen"] <= b["gen"]),
            z3.Implies(b["epoch"] < a["epoch"], b["gen"] <= a["gen"]),
        )

    return pairwise(epoch_items(s), same, then)


def py_epochs_order_generations(m: Model, s: bytes) -> bool:
    for a, b in _py_pairs(_py_epoch_items(m, s)):
        if a["key"] != b["key"]:
            continue
        if a["epoch"] == b["epoch"] and (a["gen"] != b["gen"] or a["loc"] != b["loc"]):
            return False
        if a["epoch"] < b["epoch"] and a["gen"] > b["gen"]:
            return False
        if b["epoch"] < a["epoch"] and b["gen"] > a["gen"]:
            return False
    return True


def z_items_behind_record(s: State) -> z3.BoolRef:
    def body(f):
        k = f["key"]
        ph = s.phase[k]
        return z3.And(
            f["epoch"] <= s.epoch[k], f["gen"] <= s.gen[k],
            z3.Implies(ph == ABSENT, f["gen"] < s.gen[k]),
            z3.Implies(z3.And(ph == WRITING, f["gen"] == s.gen[k]), z3.And(f["epoch"] == s.epoch[k], f["loc"] == s.owner[k])),
            z3.Implies(z3.And(ph != ABSENT, f["epoch"] == s.epoch[k]), f["gen"] == s.gen[k]),
            z3.Implies(z3.And(s.moving[k] != NOLOC, f["epoch"] == s.epoch[k]), f["loc"] == s.moving[k]),
        )

    m = bv("ir_m", Msg)
    k = m_key(m)
    # An owed Free (the directory re-sends it as it is) is behind the record like one in flight.
    ol, ok_ = bv("ir_l", Loc), bv("ir_k", Key)
    owed = s.to_free[ol, ok_]
    owed_behind = z3.ForAll([ol, ok_], z3.Implies(owed != 0, z3.And(
        owed <= s.epoch[ok_],
        z3.Implies(z3.Or(s.phase[ok_] == WRITING, s.moving[ok_] != NOLOC), owed < s.epoch[ok_]),
    )))
    other = z3.ForAll([m], z3.Implies(s.inflight[m], z3.And(
        z3.Implies(z3.Or(kind(m) == K_["COMMIT"], kind(m) == K_["COPIED"], kind(m) == K_["FREE"]),
                   m_epoch(m) <= s.epoch[k]),
        z3.Implies(z3.And(kind(m) == K_["FREE"], z3.Or(s.phase[k] == WRITING, s.moving[k] != NOLOC)),
                   m_epoch(m) < s.epoch[k]),
    )))
    return z3.And(each(epoch_items(s), body), other, owed_behind)


def py_items_behind_record(m: Model, s: bytes) -> bool:
    L = m.L
    for it in _py_epoch_items(m, s):
        k = it["key"]
        ph, gen, epoch = s[L.phase[k]], s[L.gen[k]], s[L.epoch[k]]
        if it["epoch"] > epoch or it["gen"] > gen:
            return False
        if ph == PY_ABSENT and it["gen"] >= gen:
            return False
        if ph == PY_WRITING and it["gen"] == gen and (it["epoch"] != epoch or it["loc"] != s[L.owner[k]]):
            return False
        if ph != PY_ABSENT and it["epoch"] == epoch and it["gen"] != gen:
            return False
        if s[L.moving[k]] and it["epoch"] == epoch and it["loc"] != s[L.moving[k]]:
            return False
    for msg in _msgs(m, s):
        kind_, n, k, a, b, c, d = msg
        if kind_ in (PY_M_COMMIT, PY_M_COPIED, PY_M_FREE) and d > s[L.epoch[k]]:
            return False
        if kind_ == PY_M_FREE and (s[L.phase[k]] == PY_WRITING or s[L.moving[k]]) and d >= s[L.epoch[k]]:
            return False
    for loc in range(m.cfg.locations):
        for k in range(m.cfg.keys):
            owed = s[L.to_free[loc][k]]
            if owed and owed > s[L.epoch[k]]:
                return False
            if owed and (s[L.phase[k]] == PY_WRITING or s[L.moving[k]]) and owed >= s[L.epoch[k]]:
                return False
    return True


def z_write_tokens_agree(s: State) -> z3.BoolRef:
    items = write_tokens(s, with_commits=True)

    def same(a, b):
        return a["key"] == b["key"]

    def then(a, b):
        conj = []
        if "gen" in a and "gen" in b:
            conj.append(z3.Implies(a["gen"] == b["gen"], z3.And(a["node"] == b["node"], a["lease"] == b["lease"])))
        lease_same = [a["node"] == b["node"], a["epoch"] == b["epoch"]]
        for f in ("gen", "loc"):
            if f in a and f in b:
                lease_same.append(a[f] == b[f])
        conj.append(z3.Implies(a["lease"] == b["lease"], z3.And(lease_same)))
        return z3.And(conj)

    return pairwise(items, same, then)


def py_write_tokens_agree(m: Model, s: bytes) -> bool:
    for a, b in _py_pairs(_py_write_tokens(m, s, with_commits=True)):
        if a["key"] != b["key"]:
            continue
        if "gen" in a and "gen" in b and a["gen"] == b["gen"] and (a["node"], a["lease"]) != (b["node"], b["lease"]):
            return False
        if a["lease"] == b["lease"]:
            if a["node"] != b["node"] or a["epoch"] != b["epoch"]:
                return False
            for f in ("gen", "loc"):
                if f in a and f in b and a[f] != b[f]:
                    return False
    return True


def z_current_write_tokens(s: State) -> z3.BoolRef:
    def body(f):
        k = f["key"]
        return z3.Implies(z3.And(s.phase[k] == WRITING, f["lease"] == s.w_id[k]), f["gen"] == s.gen[k])

    return each(write_tokens(s), body)


def py_current_write_tokens(m: Model, s: bytes) -> bool:
    L = m.L
    for t in _py_write_tokens(m, s):
        k = t["key"]
        if s[L.phase[k]] == PY_WRITING and t["lease"] == s[L.w_id[k]] and t["gen"] != s[L.gen[k]]:
            return False
    return True


def z_commit_ready(s: State) -> z3.BoolRef:
    c = bv("cr_c", Msg)
    k = m_key(c)
    return z3.ForAll([c], z3.Implies(
        z3.And(msg_is(s, c, "COMMIT"), s.phase[k] == WRITING, s.w_id[k] == m_lease(c), s.epoch[k] == m_epoch(c)),
        z3.And(slot_current_exact(s, s.owner[k], k), s.s_epoch[s.owner[k], k] == s.epoch[k]),
    ))


def py_commit_ready(m: Model, s: bytes) -> bool:
    L = m.L
    for msg in _msgs(m, s):
        kind_, n, k, a, b, c, d = msg
        if kind_ == PY_M_COMMIT and s[L.phase[k]] == PY_WRITING and s[L.w_id[k]] == a and s[L.epoch[k]] == d:
            owner = s[L.owner[k]]
            if not _py_slot_current_exact(m, s, owner, k) or s[L.s_epoch[owner - 1][k]] != s[L.epoch[k]]:
                return False
    return True


def z_copied_ready(s: State) -> z3.BoolRef:
    c = bv("cp_c", Msg)
    k, dest = m_key(c), m_loc(c)
    return z3.ForAll([c], z3.Implies(
        z3.And(msg_is(s, c, "COPIED"), s.phase[k] == COMMITTED, s.moving[k] == dest, s.epoch[k] == m_epoch(c)),
        z3.And(slot_current_exact(s, dest, k), s.s_epoch[dest, k] == s.epoch[k]),
    ))


def py_copied_ready(m: Model, s: bytes) -> bool:
    L = m.L
    for msg in _msgs(m, s):
        kind_, n, k, a, b, c, d = msg
        if kind_ == PY_M_COPIED and s[L.phase[k]] == PY_COMMITTED and s[L.moving[k]] == a and s[L.epoch[k]] == d:
            if not _py_slot_current_exact(m, s, a, k) or s[L.s_epoch[a - 1][k]] != s[L.epoch[k]]:
                return False
    return True


def z_fences_cover_slots(s: State) -> z3.BoolRef:
    l, k = bv("fc_l", Loc), bv("fc_k", Key)
    return z3.ForAll([l, k], z3.Implies(
        z3.And(l != NOLOC, loc_up(s, l), z3.Or(s.s_status[l, k] == FULL, s.s_status[l, k] == LOST)),
        s.fence[l, k] >= s.s_epoch[l, k],
    ))


def py_fences_cover_slots(m: Model, s: bytes) -> bool:
    L = m.L
    for loc in range(m.cfg.locations):
        if not m.location_up(s, loc):
            continue
        for k in range(m.cfg.keys):
            if s[L.s_status[loc][k]] in (PY_FULL, PY_LOST) and s[L.fence[loc][k]] < s[L.s_epoch[loc][k]]:
                return False
    return True


def z_protected_copies_current(s: State) -> z3.BoolRef:
    k = bv("pc_k", Key)
    return z3.ForAll([k], z3.Implies(in_phase(s, k, COMMITTED, INVALIDATING), z3.And(
        slot_current_exact(s, s.owner[k], k),
        z3.Implies(s.draining[k] != NOLOC, slot_current_exact(s, s.draining[k], k)),
    )))


def py_protected_copies_current(m: Model, s: bytes) -> bool:
    L = m.L
    for k in range(m.cfg.keys):
        if s[L.phase[k]] in (PY_COMMITTED, PY_INVALIDATING):
            if not _py_slot_current_exact(m, s, s[L.owner[k]], k):
                return False
            if s[L.draining[k]] and not _py_slot_current_exact(m, s, s[L.draining[k]], k):
                return False
    return True


def z_frees_fenced(s: State) -> z3.BoolRef:
    f = bv("ff_m", Msg)
    k, loc = m_key(f), m_loc(f)
    ol, ok_ = bv("ff_l", Loc), bv("ff_k", Key)
    return z3.And(
        z3.ForAll([f], z3.Implies(z3.And(msg_is(s, f, "FREE"), protected(s, loc, k)), m_epoch(f) < s.s_epoch[loc, k])),
        # An owed Free is one the directory may send again.
        z3.ForAll([ol, ok_], z3.Implies(z3.And(ol != NOLOC, s.to_free[ol, ok_] != 0, protected(s, ol, ok_)),
                                        s.to_free[ol, ok_] < s.s_epoch[ol, ok_])),
    )


def py_frees_fenced(m: Model, s: bytes) -> bool:
    L = m.L
    for msg in _msgs(m, s):
        kind_, n, k, a, b, c, d = msg
        if kind_ == PY_M_FREE and _py_protected(m, s, a, k) and d >= s[L.s_epoch[a - 1][k]]:
            return False
    for loc in range(m.cfg.locations):
        for k in range(m.cfg.keys):
            owed = s[L.to_free[loc][k]]
            if owed and _py_protected(m, s, loc + 1, k) and owed >= s[L.s_epoch[loc][k]]:
                return False
    return True


def z_grants_authorised(s: State) -> z3.BoolRef:
    m = bv("ga_m", Msg)
    return z3.ForAll([m], z3.Implies(
        z3.And(s.inflight[m], z3.Or(kind(m) == K_["GRANT_READ"], kind(m) == K_["GRANT_WRITE"])),
        allowed(m_node(m), m_key(m))))


def py_grants_authorised(m: Model, s: bytes) -> bool:
    return all(
        m.allowed[msg[1]][msg[2]] for msg in _msgs(m, s) if msg[0] in (PY_M_GRANT_READ, PY_M_GRANT_WRITE)
    )


def z_acks_close_the_generation(s: State) -> z3.BoolRef:
    n, k, r, g = bv("ac_n", Node), bv("ac_k", Key), bv("ac_r", Msg), bv("ac_g", Msg)
    return z3.And(
        # A revocation of the current generation is sent when its invalidation starts, and the
        # generation ends with the invalidation: so it is INVALIDATING while such a one is about ...
        z3.ForAll([r], z3.Implies(msg_is(s, r, "REVOKE"), z3.And(
            m_gen(r) <= s.gen[m_key(r)],
            z3.Implies(m_gen(r) == s.gen[m_key(r)], s.phase[m_key(r)] == INVALIDATING)))),
        # ... and while a node's acknowledgement of it stands (it is cleared when the generation ends);
        z3.ForAll([n, k], z3.Implies(s.acked[n, k], s.phase[k] == INVALIDATING)),
        # no grant of that generation is about to be trusted by a node that acknowledged its end.
        z3.ForAll([g], z3.Implies(z3.And(matched_grant(s, g), s.acked[m_node(g), m_key(g)]),
                                  m_gen(g) != s.gen[m_key(g)])),
    )


def py_acks_close_the_generation(m: Model, s: bytes) -> bool:
    L = m.L
    for msg in _msgs(m, s):
        kind_, n, k, a, b, c, d = msg
        if kind_ == PY_M_REVOKE and (c > s[L.gen[k]] or (c == s[L.gen[k]] and s[L.phase[k]] != PY_INVALIDATING)):
            return False
        if _py_matched_grant(m, s, msg) and s[L.acked[n][k]] and c == s[L.gen[k]]:
            return False
    for n in range(m.cfg.nodes):
        for k in range(m.cfg.keys):
            if s[L.acked[n][k]] and s[L.phase[k]] != PY_INVALIDATING:
                return False
    return True


def _prop(name: str, z) -> StateInvariant:
    p = P.by_name(name)
    return StateInvariant(name, "property", p.text, z, p.holds, p.design)


def _str(name: str, text: str, z, py) -> StateInvariant:
    return StateInvariant(name, "strengthening", text, z, py)


PROPERTIES: tuple[StateInvariant, ...] = (
    _prop("OneWriterPerGeneration", z_one_writer_per_generation),
    _prop("OneOwnerPerEpoch", z_one_owner_per_epoch),
    _prop("EpochsBoundFences", z_epochs_bound_fences),
    _prop("NoDirtyRead", z_no_dirty_read),
    _prop("CommittedBytesIntact", z_committed_bytes_intact),
    _prop("NoReclaimUnderLease", z_no_reclaim_under_lease),
    _prop("NoStaleRead", z_no_stale_read),
    _prop("NoReadAfterAck", z_no_read_after_ack),
    _prop("LeaseIdsFresh", z_lease_ids_fresh),
    _prop("LeaseKnownToDirectory", z_lease_known_to_directory),
    _prop("DirectoryDataAgreement", z_directory_data_agreement),
    _prop("PrefixClosed", z_prefix_closed),
    _prop("NamespaceIsolation", z_namespace_isolation),
)

STRENGTHENINGS: tuple[StateInvariant, ...] = (
    _str("ClocksInRange", "clock offsets in [0, eps]; grace, request numbers non-negative; lease ids from 1",
         z_clocks_in_range, py_clocks_in_range),
    _str("RecordShape", "a record's owner/moving/draining/write lease match its phase",
         z_record_shape, py_record_shape),
    _str("LeaseTableShape", "a lease-table entry is live iff its timer runs; a dead one names no location",
         z_lease_table_shape, py_lease_table_shape),
    _str("HolderShape", "trust and pending requests are well formed; a down node trusts, asks and writes nothing",
         z_holder_shape, py_holder_shape),
    _str("WriterShape", "a writer's fields are set exactly when it has sent bytes", z_writer_shape, py_writer_shape),
    _str("SlotShape", "an empty slot holds no generation or epoch", z_slot_shape, py_slot_shape),
    _str("MessageShape", "message fields are well formed; request numbers were issued", z_message_shape,
         py_message_shape),
    _str("PendingBudget", "a pending request's budget, plus the skew its clock may still lose, is at most the term",
         z_pending_budget, py_pending_budget),
    _str("TrustBudget", "a trusted lease's ticks, plus the skew its clock may still lose, are at most the term",
         z_trust_budget, py_trust_budget),
    _str("LeaseKnownUnderSkew",
         "every claim (trusted lease, answering grant or renewal) is covered by the directory's entry or grace "
         "with the remaining skew of both clocks accounted", z_lease_known_under_skew, py_lease_known_under_skew),
    _str("ClaimsPlaced", "every claim is on the current generation of a committed key, at its owner or draining copy",
         z_claims_placed, py_claims_placed),
    _str("LeasePlaced", "a live lease-table entry is on a committed key, at its owner or draining copy",
         z_lease_placed, py_lease_placed),
    _str("LeaseFieldsAgree", "table, holders, grants and renewals agree on a lease's location and generation",
         z_lease_fields_agree, py_lease_fields_agree),
    _str("RevokedNotClaimed", "an acknowledged or released lease is neither trusted nor about to be",
         z_revoked_not_claimed, py_revoked_not_claimed),
    _str("EpochsOrderGenerations",
         "grants, bytes, copies and stored slots of a key: one epoch names one generation at one location, "
         "and a later epoch never names an earlier generation", z_epochs_order_generations, py_epochs_order_generations),
    _str("ItemsBehindRecord", "no item is ahead of its key's record; the current epoch names the current generation",
         z_items_behind_record, py_items_behind_record),
    _str("WriteTokensAgree", "a generation has one write grant: one node, one lease, one epoch, one location",
         z_write_tokens_agree, py_write_tokens_agree),
    _str("CurrentWriteTokens", "tokens of the current write lease carry the current generation",
         z_current_write_tokens, py_current_write_tokens),
    _str("CommitReady", "a commit the directory would accept finds the bytes at the owner",
         z_commit_ready, py_commit_ready),
    _str("CopiedReady", "a transfer the directory would finish finds the copy at the destination",
         z_copied_ready, py_copied_ready),
    _str("FencesCoverSlots", "at a live location a slot's fence is at least its stored epoch",
         z_fences_cover_slots, py_fences_cover_slots),
    _str("ProtectedCopiesCurrent", "a committed key's owner and draining copies hold (or lost) its generation",
         z_protected_copies_current, py_protected_copies_current),
    _str("FreesFenced", "a free in flight or owed carries an epoch below that of any protected copy it names",
         z_frees_fenced, py_frees_fenced),
    _str("AcksCloseTheGeneration",
         "a node that acknowledged the end of the current generation is never granted it again: the key "
         "is INVALIDATING while such an acknowledgement (or its revocation) stands",
         z_acks_close_the_generation, py_acks_close_the_generation),
    _str("GrantsAuthorised", "grants go only to nodes authorised for the key's namespace",
         z_grants_authorised, py_grants_authorised),
)

STATE_INVARIANTS: tuple[StateInvariant, ...] = PROPERTIES + STRENGTHENINGS


# ============================================================================ transition properties


def t_epoch_monotonic(pre: State, act: Action) -> z3.BoolRef:
    post = act.post
    k, l = bv("em_k", Key), bv("em_l", Loc)
    conj = [z3.ForAll([k], post.epoch[k] >= pre.epoch[k])]
    if not act.lose_disk:
        conj.append(z3.ForAll([l, k], z3.Implies(l != NOLOC, post.fence[l, k] >= pre.fence[l, k])))
    return z3.And(conj)


def t_fencing_holds(pre: State, act: Action) -> z3.BoolRef:
    post = act.post
    l, k = bv("fh_l", Loc), bv("fh_k", Key)
    return z3.ForAll([l, k], z3.Implies(
        z3.And(l != NOLOC, post.s_epoch[l, k] != pre.s_epoch[l, k], post.s_status[l, k] == FULL),
        post.s_epoch[l, k] >= pre.fence[l, k]))


def t_leases_granted_only_on_committed(pre: State, act: Action) -> z3.BoolRef:
    if act.python[0] in ("tick", "clock_forward", "clock_back"):
        return z3.BoolVal(True)  # as the predicate: a clock step grants nothing
    post = act.post
    k, n = bv("lg_k", Key), bv("lg_n", Node)
    return z3.ForAll([k, n], z3.Implies(post.r_left[k, n] > pre.r_left[k, n], post.phase[k] == COMMITTED))


def t_renewal_never_revives(pre: State, act: Action) -> z3.BoolRef:
    post = act.post
    k, n = bv("rn_k", Key), bv("rn_n", Node)
    return z3.ForAll([k, n], z3.Implies(
        z3.And(pre.r_id[k, n] == 0, post.r_id[k, n] != 0), post.r_id[k, n] == pre.next_id))


def _tprop(name: str, z) -> StepInvariant:
    p = P.by_name(name)
    return StepInvariant(name, p.text, z, p.holds, design=p.design)


STEP_INVARIANTS: tuple[StepInvariant, ...] = (
    _tprop("EpochMonotonic", t_epoch_monotonic),
    _tprop("FencingHolds", t_fencing_holds),
    _tprop("LeasesGrantedOnlyOnCommitted", t_leases_granted_only_on_committed),
    _tprop("RenewalNeverRevives", t_renewal_never_revives),
)

# What these proofs leave to the model checker (with why).
_PROGRESS = (
    "progress (bounded response on a ghost age, with the urgency rule): the encoding projects ghost ages "
    "away and lets time pass a due timer; the model checker checks it on every configuration"
)
NOT_COVERED = {
    "InvalidationCompletesInTime": _PROGRESS,
    "WriteLeaseEndsInTime": _PROGRESS,
    "RequestEndsInTime": _PROGRESS,
    "CrashedOwnerWritableInTime": _PROGRESS,
    "DeletionReachesEverywhere": _PROGRESS,
    "RequestAnswered": "progress (every request is answered unless a message of it was lost): read off the "
                       "lost-exchange ghosts, which the encoding projects away; the model checker checks it",
    "LostCopyVoidedOnRejoin": "the encoding splits restart_node from the invalidations it starts (single-key steps "
                              "allowed at any time), so a rejoined node's lost committed copy is COMMITTED for a few "
                              "steps there: not inductive in the encoding; the model checker checks it",
}


def by_name(name: str):
    for inv in STATE_INVARIANTS + STEP_INVARIANTS:
        if inv.name == name:
            return inv
    raise KeyError(name)
