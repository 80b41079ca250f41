"""kvcc.adapters (placeholder)."""
