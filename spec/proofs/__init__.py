"""z3 proofs of the core safety properties: one obligation per (action, invariant).

``encoding`` states the protocol of ``spec/model.py`` as a z3 transition system over unbounded
scopes; ``invariants`` holds the inductive invariant (the properties of ``spec/properties.py`` and
the strengthenings they need, each with a Python twin); ``obligations`` discharges the obligations
and turns failures into re-checked counterexamples to induction (``concretize``, ``bounded``);
``simulation`` checks, step by step, that the encoding over-approximates the model.

    from kvcc.spec.proofs import prove_all
    results = prove_all()                      # the design: every obligation proved
    results = prove_all({"no_fencing"})        # a mutant: failed obligations with CTIs
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
