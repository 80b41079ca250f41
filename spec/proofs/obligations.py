"""Proof obligations: one per (initial condition, invariant) and one per (action, invariant).

The inductive invariant ``Inv`` is the conjunction of every ``StateInvariant`` of ``invariants``
(the properties of ``properties.py`` and the strengthenings they need). Obligations, as mypyvy's
``verify`` issues them:

- ``init``: ``axioms and init(s) and not I(s)`` is unsatisfiable, for every state invariant ``I``;
- consecution: ``axioms and Inv(pre) and action(pre, post) and not I(post)`` is unsatisfiable, for
  every action of ``encoding.Protocol`` and every state invariant ``I``;
- transition properties: ``axioms and Inv(pre) and action(pre, post) and not P(pre, post)`` is
  unsatisfiable, for every action and every ``StepInvariant`` ``P``; and ``P(s, s)`` is valid
  (action ``identity``), which justifies the frame rule below for them.

Unsatisfiable means proved, for every number of nodes, keys, locations and messages, every lease
term and skew bound, every lease id, epoch, generation and tick count. A satisfiable query yields a
counterexample to induction (CTI), shrunk and turned into model states by ``concretize`` and
re-checked by the Python predicates; ``unknown`` (a timeout) is reported as not proved.

How the queries are kept to milliseconds:

- *conjuncts*: a goal is split into its top-level conjuncts, one query each (the obligation is
  proved iff all are);
- *frame*: a conjunct that reads no variable the action writes is ``I(pre)`` itself (for a
  transition property ``P(pre, pre)``, valid by the ``identity`` obligations) and needs no query;
- *one solver per action*: the transition and the hypotheses are internalised once, each conjunct
  is a push/pop;
- *hints*: each hypothesis is guarded by an assumption literal; a query first assumes only the
  hypotheses its last proof needed (its unsat core, cached in ``hints.json``), and falls back to all
  of them when that is not enough. Fewer hypotheses can only make a query harder to refute, so a
  hint never makes a proof unsound; a stale or missing hint only costs time.
  ``refresh_hints()`` rewrites the file from full-hypothesis proofs.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import z3

from .bounded import action_terms, find_model, find_model_states
from .concretize import concretize, concretize_states, python_params, step_in_model
from .encoding import STATE_VARS, SUPPORTED_BUGS, Action, Protocol, State, config_axioms, initial
from .invariants import (
    NOT_COVERED, PROPERTIES, STATE_INVARIANTS, STEP_INVARIANTS, STRENGTHENINGS, StateInvariant,
    by_name,
)

HINTS_FILE = Path(__file__).with_name("hints.json")
# Refutations take milliseconds (the slowest under its hint about 10 ms): a check that runs past
# these is most likely z3 looking for a model of a satisfiable query.
HINTED_TIMEOUT_MS = 250
QUICK_TIMEOUT_MS = 1_000

# For each supported mutant flag: the invariant one of whose obligations its CTI breaks. It is the
# property ``mutants.py`` names, except where ``MUTANT_NOTES`` says why a one-step CTI cannot be.
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
    "evict_parent_first": "PrefixClosed",
    "invalidate_without_cascade": "PrefixClosed",
    "horizon_forgets_grace": "LeaseKnownToDirectory",
    "horizon_short_by_a_tick": "LeaseKnownToDirectory",
}

# Where each mutant's CTI for its mapped invariant appears: the actions whose obligation fails.
MUTANT_CTI_ACTIONS: dict[str, tuple[str, ...]] = {
    "holder_ignores_skew": ("acquire", "renew"),
    "holder_counts_from_receipt": ("trust_read_lease",),
    "invalidation_ignores_leases": ("complete_invalidation",),
    "evict_under_lease": ("evict_owner", "evict_draining"),
    "restart_without_grace": ("restart_directory",),
    "no_fencing": ("store_bytes", "store_copy"),
    "renew_revives_expired": ("renew_lease",),
    "late_commit_accepted": ("commit_write",),
    "ack_before_drop": ("drop_and_ack",),
    "lease_id_reuse_after_restart": ("restart_directory",),
    "grant_during_invalidation": ("grant_read_lease",),
    "no_namespace_check": ("grant_read_lease",),
    "evict_parent_first": ("evict_owner",),
    "invalidate_without_cascade": ("invalidate",),
    "horizon_forgets_grace": ("restart_directory",),
    "horizon_short_by_a_tick": ("restart_directory",),
}

MUTANT_NOTES: dict[str, str] = {
    "holder_counts_from_receipt": (
        "mutants.py names RequestEndsInTime, a progress property the proofs leave to the model checker (a "
        "holder whose clock does not run while it waits never times out). The safety property the bug breaks "
        "is LeaseKnownToDirectory: trust counted from receipt can outlive the directory's view of the lease."
    ),
    "holder_ignores_skew": (
        "mutants.py names LeaseKnownToDirectory. A holder budget of the full term breaks that property only "
        "after three more steps (grant, trust, then the directory's clock ahead and the holder's behind), and "
        "the inductive invariant already excludes the states one step before it; the step that leaves the "
        "invariant is the request itself: its budget plus the skew the holder's clock may still lose exceeds "
        "the term (PendingBudget, the bound LeaseKnownToDirectory rests on, at acquire and renew)."
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
    method: str = "z3"  # z3 | frame (the action writes nothing the invariant reads)
    hypotheses: list[str] = field(default_factory=list)  # the invariants the proof used (unsat cores)

    def to_json(self) -> dict:
        return asdict(self)


def results_to_json(results: list[ObligationResult]) -> str:
    return json.dumps([r.to_json() for r in results], indent=2)


# ------------------------------------------------------------------------------ formula plumbing


def conjuncts(f: z3.BoolRef) -> list[z3.BoolRef]:
    """The top-level conjuncts of a formula, each checked as its own query. The split is structural,
    so a formula over the pre-state and the same formula over the post-state split alike."""
    if z3.is_and(f):
        out = []
        for c in f.children():
            out += conjuncts(c)
        return out
    return [f]


def state_vars_in(f: z3.ExprRef, prefix: str) -> set[str]:
    """The state variables (constants named ``prefix + name``) a formula mentions."""
    found: set[str] = set()
    seen: set[int] = set()
    todo = [f]
    while todo:
        e = todo.pop()
        if e.get_id() in seen:
            continue
        seen.add(e.get_id())
        if z3.is_quantifier(e):
            todo.append(e.body())
            continue
        if z3.is_const(e) and e.decl().kind() == z3.Z3_OP_UNINTERPRETED:
            name = e.decl().name()
            if name.startswith(prefix) and name[len(prefix):] in STATE_VARS:
                found.add(name[len(prefix):])
        todo.extend(e.children())
    return found


def writes(act: Action, pre: State) -> set[str]:
    """The variables an action may change: those whose post-state term is not the pre-state's."""
    return {name for name in STATE_VARS if not act.post.terms[name].eq(pre.terms[name])}


def load_hints(path: Path = HINTS_FILE) -> dict[str, list[str]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# ------------------------------------------------------------------------------ the prover


class _ActionSolver:
    """``axioms and action and (lit_I -> I(pre))`` for every state invariant ``I``, one solver."""

    def __init__(self, pre: State, act: Action, hypotheses: dict[str, z3.BoolRef], timeout_ms: int,
                 ground_cache: dict):
        self.pre, self.act, self.timeout_ms, self.ground_cache = pre, act, timeout_ms, ground_cache
        relation = act.relation()
        self.base = [config_axioms(), relation] + list(hypotheses.values())
        self.solver = z3.Solver()
        self.solver.set(timeout=timeout_ms)
        self.lits = {name: z3.Bool(f"hyp!{name}") for name in hypotheses}
        self.names = {str(lit): name for name, lit in self.lits.items()}
        self.solver.add(config_axioms(), relation)
        for name, formula in hypotheses.items():
            self.solver.add(z3.Implies(self.lits[name], formula))

    def refute(self, goal: z3.BoolRef, hint: list[str] | None, minimize: bool = False,
               prefer_models: bool = False):
        """Try to refute ``not goal`` under the hypotheses. Returns (verdict, seconds, core, finite):
        ``core`` the hypotheses an unsat verdict used; ``finite`` a (solver, elements) pair holding a
        small finite model when the verdict is sat and one was found (``bounded.find_model``).

        Refutations take milliseconds, while z3 may search for a model of a satisfiable query until
        the timeout; so the cheap attempts come first, each with a short timeout: the hinted
        hypotheses (or, without a hint, all of them -- skipped when ``prefer_models``, i.e. when a
        bug is on and a failure is likely), then a small finite model, then all hypotheses with the
        full timeout."""
        s = self.solver
        s.push()
        s.add(z3.Not(goal))
        started = time.perf_counter()
        all_lits = list(self.lits.values())
        steps: list = []
        if minimize:
            # Recording cores (``refresh_hints``): every hypothesis, the full timeout, nothing else.
            steps.append((all_lits, self.timeout_ms))
        else:
            if hint is not None and all(h in self.lits for h in hint):
                steps.append(([self.lits[h] for h in hint], HINTED_TIMEOUT_MS))
            elif not prefer_models:
                steps.append((all_lits, QUICK_TIMEOUT_MS))
            steps += ["model", (all_lits, self.timeout_ms)]
        if minimize:
            s.set("core.minimize", True)
        try:
            verdict, finite = z3.unknown, None
            for step in steps:
                if step == "model":
                    finite = find_model(self.base + [z3.Not(goal)], self.pre, self.act, cache=self.ground_cache)
                    if finite is not None:
                        verdict = z3.sat
                        break
                    continue
                assumed, timeout = step
                s.set(timeout=min(timeout, self.timeout_ms))
                verdict = s.check(*assumed)
                if verdict == z3.unsat:
                    break
            core = None
            if verdict == z3.unsat:
                core = sorted(self.names[str(c)] for c in s.unsat_core())
            return verdict, time.perf_counter() - started, core, finite
        finally:
            s.set(timeout=self.timeout_ms)
            if minimize:
                s.set("core.minimize", False)
            s.pop()


def prove_all(
    bugs: frozenset[str] = frozenset(),
    timeout_ms: int = 20_000,
    invariants: tuple[str, ...] | None = None,
    actions: tuple[str, ...] | None = None,
    counterexamples: bool = True,
    frame: bool = True,
    hints: bool | dict = True,
    record_hints: dict | None = None,
) -> list[ObligationResult]:
    """Discharge every obligation (or those of the named invariants and actions).

    ``bugs``: mutant flags (``encoding.SUPPORTED_BUGS``) switched on in the transition relation; the
    invariant stays the design's, so a bug shows up as failed obligations with re-checked CTIs.
    ``hints``: use ``hints.json`` (True), none (False), or the given mapping; ``record_hints``: a dict
    that receives every query's unsat core (what ``refresh_hints`` writes).
    """
    bugs = frozenset(bugs)
    unknown_bugs = bugs - SUPPORTED_BUGS
    assert not unknown_bugs, f"bug flags the z3 encoding does not implement: {sorted(unknown_bugs)}"
    hint_map = load_hints() if hints is True else (hints or {})
    protocol = Protocol(bugs)
    state_invs = [i for i in STATE_INVARIANTS if invariants is None or i.name in invariants]
    step_invs = [i for i in STEP_INVARIANTS if invariants is None or i.name in invariants]
    results: list[ObligationResult] = []

    if actions is None or "init" in actions:
        results += _initial_obligations(state_invs, timeout_ms)
    if actions is None or "identity" in actions:
        results += _identity_obligations(step_invs, timeout_ms)

    pre = State.fresh("pre_")
    hypotheses = {inv.name: inv.z3(pre) for inv in STATE_INVARIANTS}
    ground_cache: dict = {}  # groundings of the hypotheses over small universes (bounded.find_model)
    # Which variables each conjunct reads, from its pre-state form (same structure as the post's).
    state_reads = {inv.name: [state_vars_in(c, "pre_") for c in conjuncts(inv.z3(pre))] for inv in state_invs}
    for act in protocol.actions(pre):
        if actions is not None and act.name not in actions:
            continue
        changed = writes(act, pre)
        solver = _ActionSolver(pre, act, hypotheses, timeout_ms, ground_cache)
        for inv in state_invs + step_invs:
            if isinstance(inv, StateInvariant):
                goals = conjuncts(inv.z3(act.post))
                part_reads = state_reads[inv.name]
            else:
                goals = conjuncts(inv.z3(pre, act))
                part_reads = [state_vars_in(c, "pre_") for c in conjuncts(inv.z3(pre, replace(act, post=pre)))]
            assert len(goals) == len(part_reads), inv.name
            results.append(_obligation(solver, act, inv, goals, part_reads, changed, pre, bugs, counterexamples,
                                       frame, hint_map, record_hints))
    return results


def _obligation(solver: _ActionSolver, act, inv, goals, part_reads, changed, pre, bugs, counterexamples, frame,
                hint_map, record_hints) -> ObligationResult:
    """One obligation, one query per conjunct of the goal (proved iff every one is)."""
    seconds, queried, unknown = 0.0, False, False
    used: set[str] = set()
    for index, (goal, reads) in enumerate(zip(goals, part_reads)):
        if frame and not (changed & reads):
            continue  # the frame rule (module docstring)
        queried = True
        key = f"{act.name}|{inv.name}|{index}"
        verdict, secs, core, finite = solver.refute(goal, hint_map.get(key), minimize=record_hints is not None,
                                                    prefer_models=bool(bugs))
        seconds += secs
        if verdict == z3.unsat:
            used.update(core)
            if record_hints is not None:
                record_hints[key] = core
        elif verdict == z3.unknown:
            unknown = True
        else:
            cex = None
            if counterexamples:
                cex = _counterexample(finite, pre, act, inv, bugs) if finite else {
                    "rechecked": False, "error": "z3 found a model but none in the small universes tried"}
            agrees = cex is None or (cex.get("rechecked") and not cex.get("hypothesis_fails_in_python"))
            status = "cti" if agrees else "disagreement"
            return ObligationResult(act.name, inv.name, False, seconds, cex, status, inv.kind)
    if unknown:
        return ObligationResult(act.name, inv.name, False, seconds, None, "unknown", inv.kind)
    return ObligationResult(act.name, inv.name, True, seconds, None, "proved", inv.kind,
                            "z3" if queried else "frame", sorted(used))


def _verdict_result(action: str, inv, verdict, secs: float) -> ObligationResult:
    if verdict == z3.unsat:
        return ObligationResult(action, inv.name, True, secs, None, "proved", inv.kind)
    return ObligationResult(action, inv.name, False, secs, None, "unknown" if verdict == z3.unknown else "cti",
                            inv.kind)


def _timed(solver: z3.Solver, goal: z3.BoolRef):
    solver.push()
    solver.add(z3.Not(goal))
    started = time.perf_counter()
    verdict = solver.check()
    secs = time.perf_counter() - started
    solver.pop()
    return verdict, secs


def _initial_obligations(state_invs, timeout_ms: int) -> list[ObligationResult]:
    s0 = State.fresh("init_")
    solver = z3.Solver()
    solver.set(timeout=timeout_ms)
    solver.add(config_axioms(), initial(s0))
    return [_verdict_result("init", inv, *_timed(solver, inv.z3(s0))) for inv in state_invs]


def _identity_obligations(step_invs, timeout_ms: int) -> list[ObligationResult]:
    """``P(s, s)`` for every transition property: a step that changes nothing satisfies it."""
    s = State.fresh("id_")
    stay = Action("identity", ("identity",), {}, z3.BoolVal(True), s)
    solver = z3.Solver()
    solver.set(timeout=timeout_ms)
    solver.add(config_axioms())
    return [_verdict_result("identity", inv, *_timed(solver, inv.z3(s, stay))) for inv in step_invs]


def refresh_hints(path: Path = HINTS_FILE, timeout_ms: int = 60_000) -> dict:
    """Prove everything with every hypothesis available and write each query's unsat core. A query
    that fails records no core (a hint only saves time; the failure is the proofs' report)."""
    cores: dict[str, list[str]] = {}
    prove_all(timeout_ms=timeout_ms, hints=False, record_hints=cores, counterexamples=False)
    lines = [f"{json.dumps(key)}: {json.dumps(core)}" for key, core in sorted(cores.items())]
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    return cores


# ------------------------------------------------------------------------------ counterexamples


def _counterexample(finite, pre: State, act: Action, inv, bugs) -> dict:
    """Read a small finite model off as model states and re-check it with the Python predicates."""
    solver, elements = finite
    try:
        zmodel = solver.model()
        conc = concretize(zmodel, pre, act, elements, bugs)
        return _recheck(conc, act, inv, zmodel)
    except Exception as exc:  # report, never hide, a failure to read the model
        return {"rechecked": False, "error": f"{type(exc).__name__}: {exc}"}


def _recheck(conc, act: Action, inv, zmodel) -> dict:
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
    # The whole hypothesis, read by Python on the pre-state: it must hold there too.
    failing_pre = [i.name for i in STATE_INVARIANTS if not i.python(m, conc.pre)]
    in_model = any(step_in_model(m, conc.pre, label, conc.post) for label in act.python)
    cfg = conc.cfg
    return {
        "action": act.name,
        "model_action": act.python[0],
        "params": list(params),
        "invariant": inv.name,
        "rechecked": rechecked,
        "recheck": check,
        "hypothesis_fails_in_python": failing_pre,
        "step_in_model": in_model,
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


# ------------------------------------------------------------------------------ non-vacuity


def enabled_witnesses(bugs: frozenset[str] = frozenset(), actions: tuple[str, ...] | None = None) -> dict:
    """For every action, a small state that satisfies the whole inductive invariant and enables it
    (a finite model of ``axioms and Inv(pre) and action``), or None. An invariant no state satisfies,
    or an action it never enables, would make obligations hold vacuously: every action must have one.
    Returns {action: {"pre": ..., "changed": ...} or None}."""
    pre = State.fresh("pre_")
    hypotheses = [inv.z3(pre) for inv in STATE_INVARIANTS]
    cache: dict = {}
    out = {}
    for act in Protocol(bugs).actions(pre):
        if actions is not None and act.name not in actions:
            continue
        found = find_model([config_axioms(), act.relation()] + hypotheses, pre, act, cache=cache, tidy=False)
        if found is None:
            out[act.name] = None
            continue
        solver, elements = found
        conc = concretize(solver.model(), pre, act, elements, bugs)
        L = conc.model.L
        out[act.name] = {
            "pre_holds_in_python": [i.name for i in STATE_INVARIANTS if not i.python(conc.model, conc.pre)] == [],
            "changed": {k: list(v) for k, v in L.diff(conc.pre, conc.post).items()},
        }
    return out


def violation_path(bugs: frozenset[str], steps: tuple[str, ...], invariant: str, sizes=None) -> dict | None:
    """A path of the named actions from a state satisfying the whole inductive invariant to a state
    violating ``invariant`` (a finite model, read off as model states), or None.

    For a mutant whose one-step CTI breaks a strengthening, this shows where it leads: e.g. under
    ``holder_ignores_skew``, acquire -> grant -> trust -> clock steps ends in a state that breaks
    ``LeaseKnownToDirectory`` itself. Every state is re-checked by Python: the hypothesis on the
    first, the property's predicate on the last, and each step as a step of ``model.py``."""
    protocol = Protocol(bugs)
    s0 = State.fresh("path0_")
    states, acts = [s0], []
    for name in steps:
        act = getattr(protocol, name)(states[-1])
        acts.append(act)
        states.append(act.post)
    target = by_name(invariant)
    query = [config_axioms()] + [inv.z3(s0) for inv in STATE_INVARIANTS] + [a.relation() for a in acts]
    query.append(z3.Not(target.z3(states[-1])))
    found = find_model_states(query, states, action_terms(acts), **({"sizes": sizes} if sizes else {}))
    if found is None:
        return None
    solver, elements = found
    conc = concretize_states(solver.model(), states, elements, bugs)
    m, L = conc.model, conc.model.L
    path = [{"action": "start", "state": L.variables(conc.states[0]),
             "messages": [L.message_text(x) for x in L.messages(conc.states[0])]}]
    model_steps = []
    for act, before, after in zip(acts, conc.states, conc.states[1:]):
        model_steps.append(any(step_in_model(m, before, label, after) for label in act.python))
        path.append({"action": act.name, "changed": {k: list(v) for k, v in L.diff(before, after).items()}})
    return {
        "steps": list(steps),
        "invariant": invariant,
        "hypothesis_fails_in_python": [i.name for i in STATE_INVARIANTS if not i.python(m, conc.states[0])],
        "violated_at_end": not target.python(m, conc.states[-1]),
        "holds_before": [bool(target.python(m, st)) for st in conc.states[:-1]],
        "steps_in_model": model_steps,
        "config": {"nodes": conc.cfg.nodes, "keys": conc.cfg.keys, "lease_term_ticks": conc.cfg.lease_term_ticks,
                   "skew_ticks": conc.cfg.skew_ticks},
        "path": path,
    }


# ------------------------------------------------------------------------------ reporting


def summary(results: list[ObligationResult]) -> dict:
    failed = [r for r in results if not r.proved]
    needs: dict[str, set[str]] = {}
    for r in results:
        needs.setdefault(r.invariant, set()).update(h for h in r.hypotheses if h != r.invariant)
    return {
        "obligations": len(results),
        "proved": len(results) - len(failed),
        "by_frame": sum(1 for r in results if r.proved and r.method == "frame"),
        "failed": [(r.action, r.invariant, r.status) for r in failed],
        "solver_seconds": round(sum(r.seconds for r in results), 3),
        "slowest": sorted(((round(r.seconds, 3), r.action, r.invariant) for r in results), reverse=True)[:5],
        "properties": [i.name for i in PROPERTIES],
        "strengthenings": [i.name for i in STRENGTHENINGS],
        "transition_properties": [i.name for i in STEP_INVARIANTS],
        "uses": {k: sorted(v) for k, v in sorted(needs.items())},
        "not_covered": NOT_COVERED,
    }


_DEFAULTS = {"0", "-", "EMPTY", "NONE", "ABSENT"}


def format_counterexample(cex: dict) -> str:
    """A CTI as text: the scope, the pre-state's non-initial variables, the step, what changed."""
    if not cex:
        return "(no counterexample)"
    if "error" in cex:
        return f"(counterexample not read: {cex['error']})"
    cfg = cex["config"]
    lines = [
        f"CTI for {cex['invariant']} at {cex['action']} (model action {cex['model_action']}"
        f"{' ' + str(tuple(cex['params'])) if cex['params'] else ''}): re-checked={cex['rechecked']}",
        f"  scope: {cfg['nodes']} node(s), {cfg['keys']} key(s), locations 0..{cfg['locations'] - 1} "
        f"(pool l{cfg['pool_location']}), term={cfg['lease_term_ticks']}, eps={cfg['skew_ticks']}",
        "  pre-state (variables not at their initial value):",
    ]
    for name, value in cex["pre"].items():
        if name.startswith("budget.") or value in _DEFAULTS or (name.endswith(".up") and value == "up"):
            continue
        lines.append(f"    {name} = {value}")
    for msg in cex["pre_messages"]:
        lines.append(f"    in flight: {msg}")
    lines.append("  step changes:")
    for name, (before, after) in cex["changed"].items():
        lines.append(f"    {name}: {before} -> {after}")
    lines.append(f"  Python predicate: {cex['recheck']}; hypothesis failing in Python: "
                 f"{cex['hypothesis_fails_in_python'] or 'none'}; a step of model.py: {cex['step_in_model']}")
    return "\n".join(lines)
