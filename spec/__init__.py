"""kvcc's executable specification of KV-cache ownership, leases and invalidation.

The vocabulary (``keys``, ``layout``), the protocol model (``model``), its properties
(``properties``) and configurations (``config``) import only the standard library and attrs. The
checker, the mutants and the z3 proofs build on them; the reference implementation imports the
vocabulary and the model's transitions, never the checker, z3 or hypothesis.
"""
