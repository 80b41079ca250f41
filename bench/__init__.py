"""kvcc.bench (placeholder)."""
