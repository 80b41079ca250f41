"""kvcc.reference (placeholder)."""
