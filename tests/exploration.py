"""Seeded exploration for the stateful machines, with their ``sometimes`` checks.

A machine's ``always`` (its invariants) is checked after every step of every run; its
``sometimes`` (the situations the invariants talk about were reached, or passing them proves
nothing) needs runs that reach them. One derandomized Hypothesis run is not a fixed exploration:
``sampled_from`` labels hash their elements (rules hash by identity), and the labels steer
generation, so the same seed explores differently under another memory layout (another checkout
path, another set of tests before it in the worker). A ``sometimes`` that one seed reaches here
can be missed in CI.

``explore`` therefore runs seeded batches (seeds 0, 1, ...) and stops as soon as every wanted
situation was reached; it fails only when ``batches`` batches all missed one. Every batch checks
every invariant, so more batches only ever check more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from hypothesis import seed
from hypothesis import settings as Settings
from hypothesis.stateful import RuleBasedStateMachine, get_state_machine_test


def run_seeded(machine: type[RuleBasedStateMachine], settings: Settings, n: int) -> None:
    """One run of ``machine`` under ``settings``, seeded with ``n`` (overrides derandomize)."""
    seed(n)(get_state_machine_test(machine, settings=settings))()


def explore(
    machine: type[RuleBasedStateMachine],
    settings: Settings,
    missing: Callable[[], Iterable[str]],
    *,
    batches: int = 4,
) -> int:
    """Seeded runs of ``machine`` until ``missing()`` (the wanted situations not reached so far,
    counted across the runs) is empty; returns how many runs it took. Fails after ``batches``."""
    for n in range(batches):
        run_seeded(machine, settings, n)
        left = sorted(missing())
        if not left:
            return n + 1
    raise AssertionError(f"{machine.__name__}: {batches} seeded runs never reached {left}")


def explore_until_failure(machine: type[RuleBasedStateMachine], settings: Settings, *, batches: int = 4) -> AssertionError:
    """Seeded runs of ``machine`` (with a deliberate bug) until one fails an invariant; returns
    the failure. Fails itself when ``batches`` runs all pass."""
    for n in range(batches):
        try:
            run_seeded(machine, settings, n)
        except AssertionError as failure:
            return failure
    raise AssertionError(f"{machine.__name__}: {batches} seeded runs never caught the bug")
