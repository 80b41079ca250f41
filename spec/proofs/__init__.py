"""z3 proofs of the core safety properties: one obligation per (action, invariant)."""
