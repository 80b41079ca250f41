"""Finding counterexamples to induction in small finite universes.

z3 refutes the quantified obligations quickly, but *building a model* of a satisfiable one (the
hypothesis is some thirty quantified formulas mixing arrays and integers) often ends in
``unknown``. Every quantifier of the encoding ranges over an uninterpreted sort (``Node``, ``Key``,
``Loc``, ``Msg``), so a model with finitely many elements can be searched for directly:

1. name ``n`` distinct elements of each sort;
2. *ground* the query: every ``forall`` becomes a conjunction, every ``exists`` a disjunction, over
   the named elements (array lambdas are left alone: they are terms, not assertions);
3. add *closure*: every ground term of an uninterpreted sort (a field of a message, the location a
   record names, an action parameter, a sent message, ``NOLOC``) equals a named element.

Groundings are cached per run (``cache``): the hypotheses are the same formulas in every query.

A model of the ground query, restricted to the named elements, is a model of the quantified query:
quantifiers range over exactly those elements and every term the formula can reach stays inside
them. Sizes are tried from small to large, so the first model found is already a small CTI.
"""

from __future__ import annotations

import itertools

import z3

from .encoding import (
    INT, STATE_VARS, Action, Key, Loc, Msg, Node, State, allowed, has_parent, is_pool, locnode, m_key, m_loc,
    m_node, m_src, NOLOC, EPS, T, m_epoch, m_gen, m_lease, m_req, m_what, parent,
)

SORTS = (Node, Key, Loc, Msg)
# (nodes, keys, locations including NOLOC, messages), smallest first.
SIZES = (
    (1, 1, 2, 1), (1, 1, 2, 2), (2, 1, 2, 2), (1, 1, 3, 2), (2, 1, 3, 2), (1, 1, 2, 3), (2, 1, 2, 3),
    (2, 1, 3, 3), (1, 1, 3, 4), (2, 1, 3, 4), (2, 2, 3, 3), (2, 1, 4, 4), (3, 1, 4, 4), (2, 2, 4, 5),
)


def _is_uninterpreted_sort(sort) -> bool:
    return sort in SORTS


def ground(f: z3.ExprRef, elements: dict) -> z3.ExprRef:
    """``f`` with every forall/exists over the sorts expanded over the named elements."""
    memo: dict[int, z3.ExprRef] = {}

    def go(e: z3.ExprRef) -> z3.ExprRef:
        key = e.get_id()
        if key in memo:
            return memo[key]
        if z3.is_quantifier(e):
            if e.is_lambda():
                out = e
            else:
                sorts = [e.var_sort(i) for i in range(e.num_vars())]
                choices = [elements[s] for s in sorts]
                instances = []
                for combo in itertools.product(*choices):
                    # de Bruijn: variable 0 is the last bound one.
                    body = z3.substitute_vars(e.body(), *reversed(combo))
                    instances.append(go(body))
                out = z3.And(instances) if e.is_forall() else z3.Or(instances)
        elif z3.is_app(e) and e.num_args() > 0:
            args = [go(c) for c in e.children()]
            if all(a.eq(c) for a, c in zip(args, e.children())):
                out = e
            else:
                out = e.decl()(*args)
        else:
            out = e
        memo[key] = out
        return out

    return go(f)


def _state_cells(state: State, elements: dict):
    """Every cell of every state variable over the named elements: (value sort, term)."""
    for name, (idx, val) in STATE_VARS.items():
        arr = getattr(state, name)
        if not idx:
            yield val, arr
        elif len(idx) == 1:
            for a in elements[idx[0]]:
                yield val, arr[a]
        else:
            for a in elements[idx[0]]:
                for b in elements[idx[1]]:
                    yield val, arr[a, b]


def closure(elements: dict, states: list[State], extra: list[z3.ExprRef]) -> list:
    """Every term of an uninterpreted sort the encoding builds is a constant (``NOLOC``, an action
    parameter, a sent or delivered message, a named element), a message field or ``locnode`` of such
    a term, or a state cell at such terms. Pinning those over the named elements pins them all (by
    congruence)."""
    terms = []
    for m in elements[Msg]:
        terms += [m_node(m), m_key(m), m_loc(m), m_src(m)]
    for l in elements[Loc]:
        terms.append(locnode(l))
    for k in elements[Key]:
        terms.append(parent(k))
    for st in states:
        terms += [t for sort, t in _state_cells(st, elements) if _is_uninterpreted_sort(sort)]
    terms += extra + [NOLOC]
    named = {e.get_id() for es in elements.values() for e in es}
    out, seen = [], set()
    for t in terms:
        if t.get_id() in named or t.get_id() in seen:
            continue
        seen.add(t.get_id())
        out.append(z3.Or([t == e for e in elements[t.sort()]]))
    return out


def forest(elements: dict) -> list:
    """The prefix tree of a ``ModelConfig``: parents come before their children (so it is a
    forest), and a chain stays in one namespace (a node authorised for a key is for its parent)."""
    keys, out = elements[Key], []
    for i, k in enumerate(keys):
        out.append(z3.Implies(has_parent(k), z3.Or([parent(k) == j for j in keys[:i]]) if i else z3.BoolVal(False)))
        for n in elements[Node]:
            out.append(z3.Implies(has_parent(k), allowed(n, k) == allowed(n, parent(k))))
    return out


def integer_cells(states: list[State], elements: dict) -> list[z3.ArithRef]:
    cells = [t for st in states for sort, t in _state_cells(st, elements) if sort == INT]
    for m in elements[Msg]:
        cells += [m_lease(m), m_gen(m), m_epoch(m), m_req(m), m_what(m)]
    return cells + [T, EPS]


def find_model(assertions: list[z3.BoolRef], pre: State, act: Action, timeout_ms: int = 5_000,
               sizes=SIZES, value_bounds=(8, 40, 250), tidy: bool = True, cache: dict | None = None):
    """The smallest finite model of ``assertions`` (a query about one step of ``act`` from ``pre``)."""
    return find_model_states(assertions, [pre, act.post], action_terms([act]), timeout_ms, sizes, value_bounds,
                             tidy, cache)


def action_terms(acts: list[Action]) -> list[z3.ExprRef]:
    """The constants an action introduces: its parameters, sent and delivered messages."""
    out = []
    for act in acts:
        out += [p for p in act.params.values() if _is_uninterpreted_sort(p.sort())] + list(act.sent.values())
        if act.delivered is not None:
            out.append(act.delivered)
    return out


def find_model_states(assertions: list[z3.BoolRef], states: list[State], extra: list[z3.ExprRef],
                      timeout_ms: int = 5_000, sizes=SIZES, value_bounds=(8, 40, 250), tidy: bool = True,
                      cache: dict | None = None):
    """The smallest finite model of ``assertions`` over ``states`` found, as (solver, elements), or None.

    The returned solver is satisfiable with its model in ``solver.model()``; elements are the named,
    pairwise distinct elements of each sort (``NOLOC`` is one of the locations). Values are bounded
    to a byte, as tightly as the model allows; ``tidy`` then resets what the model does not need.
    """
    for size in sizes:
        elements = {
            sort: [z3.Const(f"cti_{tag}{i}", sort) for i in range(n)]
            for sort, tag, n in zip(SORTS, ("n", "k", "l", "m"), size)
        }
        grounded = []
        for a in assertions:
            key = (a.get_id(), size)
            if cache is None or key not in cache:
                g = ground(a, elements)
                if cache is None:
                    grounded.append(g)
                    continue
                cache[key] = (a, g)  # holding ``a`` keeps its id from being reused
            grounded.append(cache[key][1])
        solver = z3.Solver()
        solver.set(timeout=timeout_ms)
        solver.add(grounded)
        solver.add(closure(elements, states, extra))
        for es in elements.values():
            if len(es) > 1:
                solver.add(z3.Distinct(es))
        locs = elements[Loc]
        for i, a in enumerate(locs):  # the model has at most one shared pool
            for b in locs[i + 1:]:
                solver.add(z3.Not(z3.And(a != NOLOC, b != NOLOC, is_pool(a), is_pool(b))))
        solver.add(forest(elements))
        if solver.check() != z3.sat:
            continue
        cells = integer_cells(states, elements)
        for bound in value_bounds:
            solver.push()
            solver.add([z3.And(c >= 0, c <= bound) for c in cells])
            if solver.check() == z3.sat:
                if tidy:
                    tidy_model(solver, states[0], elements)
                return solver, elements
            solver.pop()
        return None
    return None


def _default(sort) -> z3.ExprRef | None:
    """The value a cell has in an initial state (None: leave it)."""
    from .encoding import ABSENT, EMPTY, P_NONE, Pending, Phase, SlotStatus, Stage, W_NONE
    if sort == INT:
        return z3.IntVal(0)
    if sort == z3.BoolSort():
        return None  # ``up`` and ``inflight``: handled below
    return {Phase: ABSENT, SlotStatus: EMPTY, Stage: W_NONE, Pending: P_NONE, Loc: NOLOC}.get(sort)


def tidy_model(solver: z3.Solver, pre: State, elements: dict) -> None:
    """Greedily reset pre-state cells to their initial values, and drop messages from the network,
    keeping each reset that leaves the query satisfiable: what is left is what the CTI needs."""
    candidates = [z3.And(T == 2, EPS == 1), z3.And(T == 3, EPS == 1)]
    candidates += [z3.Not(has_parent(k)) for k in elements[Key]]
    candidates += [z3.Not(pre.inflight[m]) for m in elements[Msg]]
    for n in elements[Node]:
        candidates.append(pre.up[n])
    for sort, term in _state_cells(pre, elements):
        default = _default(sort)
        if default is not None:
            candidates.append(term == default)
    for c in candidates:
        solver.push()
        solver.add(c)
        if solver.check() == z3.sat:
            continue  # keep it (the scope stays pushed)
        solver.pop()
    solver.check()
