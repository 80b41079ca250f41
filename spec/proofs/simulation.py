"""Does the z3 encoding over-approximate ``model.py``? Checked step by step.

A proof about ``encoding.Protocol`` says something about ``model.Model`` only if every step of the
model is a step of the encoding. ``simulates(m, pre, label, post)`` checks one concrete step: the
model's ``pre`` and ``post`` bytes become constraints over named elements (one per node, key and
location, one per message in flight), and z3 is asked whether some encoded action whose labels
include the model's, followed by dropping messages (the encoding never loses a send and keeps a
delivered message in flight), leads from the one to the other:

- every state variable of ``post`` (over the named elements) equals the encoded post-state's;
- every message in flight in ``post`` is in flight in the encoded post-state (the encoding's extra
  messages, the delivered one and any the model lost on a full network, are then dropped).

Steps that only consume a message (refusals, stale replies, fenced frees, ...) are ``drop``; steps
that change nothing (``read``, ``evict_refused``, ``duplicate`` of a set element) are the identity;
a step that invalidates several keys (a subtree, a namespace, a lost owner at ``restart_node``) is
the labelled action followed by up to ``max_extra`` single-key invalidations.

``check_model_steps`` runs it over the steps of a breadth-first exploration of a configuration.
"""

from __future__ import annotations

import random
from collections import deque

import z3

from .. import layout as LY
from ..model import Model
from .bounded import closure, ground
from .encoding import (
    EPS, INT, KIND_NAMES, K_, Key, Loc, Msg, NOLOC, Node, Pending, Phase, STATE_VARS, SlotStatus, Stage, T,
    Action, Protocol, State, allowed, config_axioms, has_parent, is_pool, kind, locnode, parent, m_epoch, m_gen, m_key, m_lease, m_loc,
    m_node, m_req, m_src, m_what,
)

_ENUM_SORTS = (Phase, SlotStatus, Stage, Pending)
_CODE_TO_KIND = {getattr(LY, "M_" + name): name for name in KIND_NAMES}
# Model labels whose step only consumes the delivered message, or changes nothing the encoding has:
# the same lists as ``refinement``'s.
from .refinement import CONSUMING, UNCHANGED  # noqa: E402



class Simulator:
    """The encoding's actions, built once, and the named elements for one configuration."""

    def __init__(self, model: Model, bugs=frozenset()) -> None:
        self.m = model
        cfg = model.cfg
        self.pre = State.fresh("sim_pre_")
        self.protocol = Protocol(bugs)
        self.actions = self.protocol.actions(self.pre)
        self.by_label: dict[str, list[Action]] = {}
        for act in self.actions:
            for label in act.python:
                self.by_label.setdefault(label, []).append(act)
        self.nodes = [z3.Const(f"sim_n{i}", Node) for i in range(cfg.nodes)]
        self.keys = [z3.Const(f"sim_k{i}", Key) for i in range(cfg.keys)]
        self.locs = [z3.Const(f"sim_l{i}", Loc) for i in range(cfg.locations)]
        # Follow-up steps of one model step that touches several keys.
        self.followups = [a for a in self.actions if a.name in ("invalidate", "invalidate_writing")]

    # -- values ------------------------------------------------------------------------------

    def _loc(self, code: int):
        return NOLOC if code == LY.NO_LOCATION else self.locs[code - 1]

    def _value(self, sort, v: int):
        if sort == INT:
            return z3.IntVal(v)
        if sort == z3.BoolSort():
            return z3.BoolVal(v == 1)
        if sort == Loc:
            return self._loc(v)
        if sort == Node:
            return None if v == 0 else self.nodes[v - 1]
        if sort in _ENUM_SORTS:
            return sort.constructor(v)()
        raise TypeError(sort)

    def state_constraints(self, state: State, s: bytes) -> list:
        """Every state variable of ``s`` (bytes) as equations on ``state``'s cells."""
        L = self.m.L
        out = []
        index = {Node: self.nodes, Key: self.keys, Loc: self.locs}
        for name, (idx, val) in STATE_VARS.items():
            if name == "inflight":
                continue
            arr, pos = getattr(state, name), getattr(L, name)
            if not idx:
                cells = [(arr, pos)]
            elif len(idx) == 1:
                cells = [(arr[e], pos[i]) for i, e in enumerate(index[idx[0]])]
            else:
                cells = [(arr[a, b], pos[i][j]) for i, a in enumerate(index[idx[0]])
                         for j, b in enumerate(index[idx[1]])]
            for term, p in cells:
                v = self._value(val, s[p])
                if v is not None:
                    out.append(term == v)
        return out

    def message_fields(self, e, msg: bytes) -> z3.BoolRef:
        code, n, k, a, b, c, d = msg
        name = _CODE_TO_KIND[code]
        conj = [kind(e) == K_[name], m_key(e) == self.keys[k]]
        if name not in ("FREE", "COPY", "COPIED", "FREED"):
            conj.append(m_node(e) == self.nodes[n])
        f = {
            "ACQUIRE": dict(req=a),
            "RENEW": dict(lease=a, loc=b, req=c),
            "GRANT_READ": dict(lease=a, loc=b, gen=c, req=d),
            "RENEWED": dict(lease=a, req=d),
            "RELEASE": dict(lease=a), "REVOKE": dict(lease=a, gen=c), "ACK": dict(lease=a),
            "BEGIN_WRITE": {},
            "GRANT_WRITE": dict(lease=a, loc=b, gen=c, epoch=d),
            "WRITE_BYTES": dict(lease=a, loc=b, gen=c, epoch=d),
            "COMMIT": dict(lease=a, epoch=d),
            "FREE": dict(loc=a, epoch=d),
            "COPY": dict(loc=a, src=b, gen=c, epoch=d),
            "COPIED": dict(loc=a, epoch=d),
            "REFUSE": dict(req=a, what=b),
            "FREED": dict(loc=a, epoch=d),
        }[name]
        funs = dict(lease=m_lease, loc=m_loc, src=m_src, gen=m_gen, epoch=m_epoch, req=m_req, what=m_what)
        for field, v in f.items():
            conj.append(funs[field](e) == (self._loc(v) if field in ("loc", "src") else v))
        return z3.And(conj)

    # -- one step ----------------------------------------------------------------------------

    def simulates(self, pre_bytes: bytes, label: str, post_bytes: bytes) -> str | None:
        """The encoded action (or sequence) that covers the model's step, or None."""
        candidates = list(self.by_label.get(label, []))
        if label in CONSUMING:
            candidates += self.by_label["drop"]
        candidates.append(None)  # the identity: a stutter, when nothing the encoding has changed
        for act in candidates:
            if self._check([act], pre_bytes, post_bytes):
                return "identity" if act is None else act.name
        # Several keys at once: the labelled action, then single-key invalidations.
        sequences = [[a, f] for a in self.by_label.get(label, []) for f in self.followups]
        if self.m.cfg.keys > 1:
            sequences += [[a, f, g] for a in self.by_label.get(label, []) for f in self.followups
                          for g in self.followups]
        for seq in sequences:
            if self._check(seq, pre_bytes, post_bytes):
                return " ; ".join(a.name for a in seq)
        return None

    def _chain(self, seq: list[Action | None]):
        """Instantiate a sequence of actions on consecutive states: (relations, states, acts)."""
        relations, states, acts = [], [self.pre], []
        for i, act in enumerate(seq):
            cur = states[-1]
            if act is None:
                states.append(cur)
                continue
            if i == 0:
                inst = act
            else:
                # Rebuild the follow-up on the current state (fresh parameters).
                inst = getattr(self.protocol, act.name)(cur)
            relations.append(inst.relation())
            states.append(inst.post)
            acts.append(inst)
        return relations, states, acts

    def _check(self, seq: list[Action | None], pre_bytes: bytes, post_bytes: bytes) -> bool:
        L, m = self.m.L, self.m
        relations, states, acts = self._chain(seq)
        pre_msgs = L.messages(pre_bytes)
        post_msgs = L.messages(post_bytes)
        pm = [z3.Const(f"sim_m{i}", Msg) for i in range(len(pre_msgs))]
        extra = []
        for a in acts:
            extra += list(a.params.values()) + list(a.sent.values())
            if a.delivered is not None:
                extra.append(a.delivered)
        # Spare elements: a multi-send (``invalidate``'s revokes) puts in flight every element with
        # the right fields, so the universe must have room for what the model sends.
        spare = [z3.Const(f"sim_spare{i}", Msg) for i in range(len(post_msgs))]
        msgs = pm + [e for e in extra if e.sort() == Msg] + spare
        elements = {Node: self.nodes, Key: self.keys, Loc: [NOLOC] + self.locs, Msg: msgs}
        s = z3.Solver()
        s.set(timeout=10_000)
        cfg = m.cfg
        s.add(config_axioms(), T == cfg.lease_term_ticks, EPS == cfg.skew_ticks)
        s.add([ground(r, elements) for r in relations])
        if len(self.nodes) > 1:
            s.add(z3.Distinct(self.nodes))
        if len(self.keys) > 1:
            s.add(z3.Distinct(self.keys))
        s.add(z3.Distinct([NOLOC] + self.locs))
        for i, l in enumerate(self.locs):
            node = m.loc_node[i]
            s.add(is_pool(l) == (node < 0))
            if node >= 0:
                s.add(locnode(l) == self.nodes[node])
        for i, n in enumerate(self.nodes):
            for j, k in enumerate(self.keys):
                s.add(allowed(n, k) == bool(m.allowed[i][j]))
        for j, k in enumerate(self.keys):
            p = cfg.parents[j]
            s.add(has_parent(k) == (p >= 0))
            if p >= 0:
                s.add(parent(k) == self.keys[p])
        # Closed world for nodes, keys and locations; messages: the ones named.
        s.add(closure(elements, states, [e for e in extra if e.sort() != Msg]))
        s.add(self.state_constraints(self.pre, pre_bytes))
        for e, msg in zip(pm, pre_msgs):
            s.add(self.pre.inflight[e], self.message_fields(e, msg))
        for e in msgs[len(pm):]:
            s.add(self.pre.inflight[e] == z3.Or([e == p for p in pm]))
        post = states[-1]
        s.add(self.state_constraints(post, post_bytes))
        for msg in post_msgs:
            s.add(z3.Or([z3.And(post.inflight[e], self.message_fields(e, msg)) for e in msgs]))
        return s.check() == z3.sat


def model_steps(model: Model, max_states: int = 2000, seed: int = 0):
    """Breadth-first states of a model (up to ``max_states``), with all their steps."""
    init = model.init_states()
    seen = set(init)
    frontier = deque(init)
    while frontier and len(seen) < max_states:
        s = frontier.popleft()
        for label, params, t in model.successors(s):
            yield s, label, params, t
            if t not in seen:
                seen.add(t)
                frontier.append(t)


def random_steps(model: Model, walks: int = 200, depth: int = 40, seed: int = 0):
    """Steps along random walks from the initial state: they reach deep actions a small BFS misses.
    Half of the moves take the least-seen action label, so rare actions get reached too."""
    rng = random.Random(seed)
    counts: dict[str, int] = {}
    for _ in range(walks):
        s = model.init_states()[0]
        for _ in range(depth):
            succ = model.successors(s)
            if not succ:
                break
            for label, params, t in succ:
                counts[label] = counts.get(label, 0) + 1
                yield s, label, params, t
            if rng.random() < 0.5:
                rarest = min(counts.get(label, 0) for label, _, _ in succ)
                s = rng.choice([t for label, _, t in succ if counts.get(label, 0) == rarest])
            else:
                s = rng.choice(succ)[2]


def check_model_steps(model: Model, per_label: int = 6, max_states: int = 2000, seed: int = 0,
                      bugs=frozenset(), walks: int = 200, depth: int = 40) -> dict:
    """Sample up to ``per_label`` steps of every model action label (from a BFS and from random walks)
    and check each is simulated. Returns {"checked": n, "labels": {...}, "failures": [...]}."""
    rng = random.Random(seed)
    by_label: dict[str, list] = {}
    for s, label, params, t in model_steps(model, max_states):
        by_label.setdefault(label, []).append((s, params, t))
    for s, label, params, t in random_steps(model, walks, depth, seed):
        steps = by_label.setdefault(label, [])
        if len(steps) < 50 * per_label:
            steps.append((s, params, t))
    sim = Simulator(model, bugs)
    failures, checked = [], 0
    for label, steps in sorted(by_label.items()):
        chosen = steps if len(steps) <= per_label else rng.sample(steps, per_label)
        for s, params, t in chosen:
            checked += 1
            if sim.simulates(s, label, t) is None:
                failures.append({"label": label, "params": params, "diff": model.L.diff(s, t),
                                 "pre": s.hex(), "post": t.hex()})
    return {"checked": checked, "labels": {k: len(v) for k, v in by_label.items()}, "failures": failures}
