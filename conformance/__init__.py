"""kvcc.conformance (placeholder)."""
