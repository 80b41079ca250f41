"""kvcc top-level package."""
