"""kvcc top-level package."""

from kvcc import accel as _accel

# Compiled copies of the spec's and the validator's hot modules, only while they match their
# source (kvcc/accel.py): installed before anything can import them.
_accel.install()
