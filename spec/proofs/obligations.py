"""Proof obligations: one per (initial condition, invariant) and one per (action, invariant).

The inductive invariant is the conjunction of every ``StateInvariant`` in ``invariants`` (the
properties and their strengthenings). Obligations, mypyvy's ``verify``:

- ``init``: ``axioms and init(s) and not I(s)`` is unsatisfiable, for every state invariant ``I``;
- consecution: ``axioms and Inv(pre) and action(pre, post) and not I(post)`` is unsatisfiable, for
  every action of ``encoding.Protocol`` and every state invariant ``I``;
- transition properties: ``axioms and Inv(pre) and action(pre, post) and not P(pre, post)`` is
  unsatisfiable, for every action and every ``StepInvariant``.

Unsatisfiable means proved, for every number of nodes, keys, locations and messages, every lease
term and skew bound, every lease id, epoch, generation and tick count. A satisfiable query yields a
counterexample to induction, shrunk and turned into model states by ``concretize`` and re-checked
by the Python predicates; an ``unknown`` (a timeout) is reported as not proved, without one.

One solver per action holds ``Inv(pre) and action``; each invariant is a push/pop on it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import z3

from ..layout import Layout
from .concretize import Concrete, bound_integers, concretize, python_params, shrink
from .encoding import SUPPORTED_BUGS, Action, Protocol, State, config_axioms, initial
from .invariants import NOT_COVERED, PROPERTIES, STATE_INVARIANTS, STEP_INVARIANTS, STRENGTHENINGS, StateInvariant

# For each supported mutant flag: the invariant whose obligation its CTI breaks (see the report in
# ``MUTANT_NOTES`` for how it relates to the property ``mutants.py`` names).
MUTANT_OBLIGATIONS: dict[str, str] = {
    "holder_ignores_skew": "PendingBudget",
    "holder_counts_from_receipt": "LeaseKnownToDirectory",
    "invalidation_ignores_leases": "DirectoryDataAgreement",
    "evict_under_lease": "DirectoryDataAgreement",
    "restart_without_grace": "LeaseKnownToDirectory",
    "no_fencing": "FencingHolds",
    "renew_revives_expired": "RenewalNeverRevives",
    "late_commit_accepted": "CommittedBytesIntact",
    "ack_before_drop": "NoReadAfterAck",
    "lease_id_reuse_after_restart": "LeaseIdsFresh",
    "grant_during_invalidation": "LeasesGrantedOnlyOnCommitted",
    "no_namespace_check": "NamespaceIsolation",
}

MUTANT_NOTES: dict[str, str] = {
    "holder_ignores_skew": (
        "mutants.py names LeaseKnownToDirectory. A holder budget of the full term breaks that property "
        "only after further clock steps (grant, trust, the directory's clock ahead, the holder's behind); "
        "its one-step CTI is the budget bound LeaseKnownToDirectory rests on: a pending request whose budget "
        "plus the skew its clock may still lose exceeds the term (acquire, renew)."
    ),
}


@dataclass
class ObligationResult:
    action: str
    invariant: str
    proved: bool
    seconds: float
    counterexample: dict | None = None
    status: str = "proved"  # proved | cti | unknown | disagreement
    kind: str = ""  # property | strengthening | transition property

    def to_json(self) -> dict:
        return asdict(self)


def results_to_json(results: list[ObligationResult]) -> str:
    return json.dumps([r.to_json() for r in results], indent=2)


def _kind_of(inv) -> str:
    return inv.kind


def _check(solver: z3.Solver, goal: z3.BoolRef) -> tuple[z3.CheckSatResult, float]:
    solver.push()
    solver.add(z3.Not(goal))
    started = time.perf_counter()
    verdict = solver.check()
    return verdict, time.perf_counter() - started


def prove_all(
    bugs: frozenset[str] = frozenset(),
    timeout_ms: int = 20_000,
    invariants: tuple[str, ...] | None = None,
    actions: tuple[str, ...] | None = None,
    counterexamples: bool = True,
) -> list[ObligationResult]:
    """Discharge every obligation (or those of the named invariants / actions).

    ``bugs``: mutant flags (``encoding.SUPPORTED_BUGS``) switched on in the transition relation; the
    invariant stays the design's, so a bug shows up as failed obligations with re-checked CTIs.
    """
    bugs = frozenset(bugs)
    unknown = bugs - SUPPORTED_BUGS
    assert not unknown, f"bug flags the z3 encoding does not implement: {sorted(unknown)}"
    protocol = Protocol(bugs)
    state_invs = [i for i in STATE_INVARIANTS if invariants is None or i.name in invariants]
    step_invs = [i for i in STEP_INVARIANTS if invariants is None or i.name in invariants]
    results: list[ObligationResult] = []

    # Initial states.
    if actions is None or "init" in actions:
        s0 = State.fresh("init_")
        solver = z3.Solver()
        solver.set(timeout=timeout_ms)
        solver.add(config_axioms(), initial(s0))
        for inv in state_invs:
            verdict, secs = _check(solver, inv.z3(s0))
            results.append(_result("init", inv, verdict, secs, None))
            solver.pop()

    pre = State.fresh("pre_")
    hypothesis = [config_axioms()] + [inv.z3(pre) for inv in STATE_INVARIANTS]
    for act in protocol.actions(pre):
        if actions is not None and act.name not in actions:
            continue
        solver = z3.Solver()
        solver.set(timeout=timeout_ms)
        solver.add(hypothesis)
        solver.add(act.relation())
        for inv in state_invs + step_invs:
            goal = inv.z3(act.post) if isinstance(inv, StateInvariant) else inv.z3(pre, act)
            verdict, secs = _check(solver, goal)
            cex = None
            if verdict == z3.sat and counterexamples:
                cex = _counterexample(solver, pre, act, inv, bugs)
            results.append(_result(act.name, inv, verdict, secs, cex))
            solver.pop()
    return results


def _result(action: str, inv, verdict, secs: float, cex: dict | None) -> ObligationResult:
    if verdict == z3.unsat:
        return ObligationResult(action, inv.name, True, secs, None, "proved", _kind_of(inv))
    if verdict == z3.unknown:
        return ObligationResult(action, inv.name, False, secs, None, "unknown", _kind_of(inv))
    status = "cti"
    if cex is not None and not cex.get("rechecked"):
        status = "disagreement"
    return ObligationResult(action, inv.name, False, secs, cex, status, _kind_of(inv))


# ------------------------------------------------------------------------------ counterexamples


def _counterexample(solver: z3.Solver, pre: State, act: Action, inv, bugs) -> dict:
    """Shrink the model, read it off as model states, re-check it with the Python predicates."""
    scopes = solver.num_scopes()
    try:
        elements = shrink(solver)
        if elements is None:
            return {"rechecked": False, "error": "could not pin the universes"}
        if not bound_integers(solver, pre, act.post, elements):
            return {"rechecked": False, "error": "no model with every value in a byte"}
        zmodel = solver.model()
        conc = concretize(zmodel, pre, act, elements, bugs)
        return _recheck(conc, act, inv, zmodel)
    except Exception as exc:  # report, never hide, a failure to read the model
        return {"rechecked": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        solver.pop(solver.num_scopes() - scopes)


def _recheck(conc: Concrete, act: Action, inv, zmodel) -> dict:
    m, L = conc.model, conc.model.L
    params = python_params(act, zmodel, conc)
    if isinstance(inv, StateInvariant):
        pre_ok = bool(inv.python(m, conc.pre))
        post_ok = bool(inv.python(m, conc.post))
        rechecked = pre_ok and not post_ok
        check = {"predicate_on_pre": pre_ok, "predicate_on_post": post_ok}
    else:
        step_ok = bool(inv.python(m, conc.pre, act.python[0], params, conc.post))
        rechecked = not step_ok
        check = {"predicate_on_step": step_ok}
    # The whole hypothesis, read by Python on the pre-state.
    failing_pre = [i.name for i in STATE_INVARIANTS if not i.python(m, conc.pre)]
    cfg = conc.cfg
    return {
        "action": act.name,
        "model_action": act.python[0],
        "params": list(params),
        "invariant": inv.name,
        "rechecked": rechecked,
        "recheck": check,
        "hypothesis_fails_in_python": failing_pre,
        "config": {
            "nodes": cfg.nodes, "keys": cfg.keys, "tiers_per_node": cfg.tiers_per_node,
            "locations": cfg.locations, "pool_location": cfg.pool_location,
            "lease_term_ticks": cfg.lease_term_ticks, "skew_ticks": cfg.skew_ticks,
            "authorized": [sorted(a) for a in cfg.authorized],
        },
        "pre": L.variables(conc.pre),
        "pre_messages": [L.message_text(x) for x in L.messages(conc.pre)],
        "post_messages": [L.message_text(x) for x in L.messages(conc.post)],
        "changed": {k: list(v) for k, v in L.diff(conc.pre, conc.post).items()},
        "pre_bytes": conc.pre.hex(),
        "post_bytes": conc.post.hex(),
    }


# ------------------------------------------------------------------------------ reporting


def summary(results: list[ObligationResult]) -> dict:
    failed = [r for r in results if not r.proved]
    return {
        "obligations": len(results),
        "proved": len(results) - len(failed),
        "failed": [(r.action, r.invariant, r.status) for r in failed],
        "seconds": round(sum(r.seconds for r in results), 3),
        "slowest": sorted(((round(r.seconds, 3), r.action, r.invariant) for r in results), reverse=True)[:5],
        "properties": [i.name for i in PROPERTIES],
        "strengthenings": [i.name for i in STRENGTHENINGS],
        "transition_properties": [i.name for i in STEP_INVARIANTS],
        "not_covered": NOT_COVERED,
    }
