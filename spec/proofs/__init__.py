"""z3 proofs of the core safety properties: one obligation per (action, invariant).

``encoding`` states the protocol of ``spec/model.py`` as a z3 transition system over unbounded
scopes; ``invariants`` holds the inductive invariant (the properties of ``spec/properties.py`` and
the strengthenings they need, each with a Python twin); ``obligations`` discharges the obligations
and turns failures into re-checked counterexamples to induction (``concretize``, ``bounded``);
``refinement`` checks that the encoding refines the model on every step of every configuration's
reachable states (a covering subset of the large ones), by evaluating the encoding's terms;
``simulation`` asks z3 the same question for sampled steps.

    from kvcc.spec.proofs import prove_all
    results = prove_all()                      # the design: every obligation proved
    results = prove_all({"no_fencing"})        # a mutant: failed obligations with CTIs
    from kvcc.spec.proofs.refinement import check_all
    check_all()["ok"]                          # every model step is a step of the encoding
"""

from .obligations import (
    MUTANT_CTI_ACTIONS,
    MUTANT_NOTES,
    MUTANT_OBLIGATIONS,
    ObligationResult,
    enabled_witnesses,
    format_counterexample,
    prove_all,
    refresh_hints,
    results_to_json,
    summary,
)

__all__ = [
    "MUTANT_CTI_ACTIONS",
    "MUTANT_NOTES",
    "MUTANT_OBLIGATIONS",
    "ObligationResult",
    "enabled_witnesses",
    "format_counterexample",
    "prove_all",
    "refresh_hints",
    "results_to_json",
    "summary",
]
