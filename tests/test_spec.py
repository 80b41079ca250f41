"""The spec checked three ways here: exhaustively (pinned counts), by its mutants, and by random
walks that must agree with the checker's verdicts."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcc.spec.checker import Checker, check
from kvcc.spec.config import CONFIGS, get_config, load_manifest
from kvcc.spec.model import Model
from kvcc.spec.mutants import MUTANTS
from kvcc.spec.properties import INVARIANTS, SOMETIMES, TRANSITION_PROPERTIES, applicable_sometimes

FAST_CONFIGS = ("tiny", "renewal", "restart")


@pytest.mark.parametrize("name", FAST_CONFIGS)
def test_fast_configs_hold_and_match_manifest(name):
    result = check(get_config(name))
    pinned = load_manifest()[name]
    assert result.distinct_states == pinned["distinct_states"]
    assert result.ok is pinned["ok"] is True
    assert not [p for p, v in result.properties.items() if v in ("violated", "unreached")]


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_every_mutant_is_caught_by_its_property(name):
    mutant = MUTANTS[name]
    result = check(get_config(mutant.config), name)
    assert result.violation is not None, f"{name} was not caught"
    assert result.violation.property == mutant.expected_property
    trace = result.violation.trace
    # The counterexample is a path from an initial state with the violation at its end.
    assert trace[0]["action"] == "init"
    assert len(trace) - 1 == result.violation.depth


def test_every_always_has_a_sometimes():
    names = {p.name for p in INVARIANTS + TRANSITION_PROPERTIES}
    companions = {c for sm in SOMETIMES for c in sm.companion_of}
    # Progress properties are witnessed by the invalidation sometimes; the rest by a companion.
    uncovered = names - companions - {"LeaseIdsFresh", "LeasesGrantedOnlyOnCommitted", "WriteLeaseEndsInTime"}
    assert not uncovered, uncovered


def test_design_non_vacuity_list_is_required_in_small():
    required = {sm.name for sm in applicable_sometimes(get_config("small"))}
    for name in (
        "RemoteReadUnderLease",
        "InvalidationCompletedByAcks",
        "InvalidationCompletedByExpiry",
        "FencedStaleWrite",
        "RefusedEvictionOfLeasedBlock",
        "OwnershipHandoffAfterCrash",
    ):
        assert name in required


def test_a_model_that_never_reads_fails_its_sometimes():
    """Vacuity is an error: with no readers the checker must refuse to call the model ok."""
    import attrs

    cfg = attrs.evolve(get_config("tiny"), readers=())
    result = check(cfg)
    assert result.violation is None
    assert result.ok is False
    assert result.properties["RemoteReadUnderLease"] == "unreached"


def test_layout_names_are_unique_and_diff_is_empty_on_equal_states():
    for cfg in CONFIGS.values():
        model = Model(cfg)
        assert len(set(model.L.names)) == len(model.L.names)
        (s,) = model.init_states()
        assert model.L.diff(s, s) == {}


def _walk(model: Model, seed: int, steps: int) -> list[tuple[str, tuple, bytes]]:
    rng = random.Random(seed)
    (s,) = model.init_states()
    path = [("init", (), s)]
    for _ in range(steps):
        successors = model.successors(s)
        assert successors, "the model never deadlocks"
        action, params, s = rng.choice(successors)
        path.append((action, params, s))
    return path


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), config=st.sampled_from(["small", "chain", "medium", "tiering", "tenants"]))
def test_random_walks_never_violate_an_invariant(seed, config):
    model = Model(get_config(config))
    path = _walk(model, seed, 60)
    for (_, _, pre), (action, params, post) in zip(path, path[1:]):
        for inv in INVARIANTS:
            assert inv.holds(model, post), (inv.name, action, params)
        for tp in TRANSITION_PROPERTIES:
            assert tp.holds(model, pre, action, params, post), (tp.name, action, params)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_same_seed_same_trace(seed):
    model = Model(get_config("small"))
    assert _walk(model, seed, 40) == _walk(model, seed, 40)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_state_round_trips_through_its_variables(seed):
    """Printing a state names every variable; rebuilding it from the names gives the same bytes."""
    model = Model(get_config("small"))
    L = model.L
    _, _, s = _walk(model, seed, 30)[-1]
    raw = {name: s[i] for i, name in enumerate(L.names)}
    rebuilt = bytes(raw[name] for name in L.names) + b"".join(L.messages(s))
    assert rebuilt == s
    assert len(L.variables(s)) == L.fixed


@pytest.mark.parametrize("name", ["tiny", "renewal"])
def test_checker_verdict_agrees_with_predicates_on_every_state(name):
    """Explore without fingerprints, skipping nothing: every invariant on every reachable state
    and every step property on every step must hold, as the checker (which skips predicates
    whose inputs did not change, and hashes states) says."""
    model = Model(get_config(name))
    seen, frontier = set(model.init_states()), list(model.init_states())
    steps = 0
    while frontier:
        nxt = []
        for s in frontier:
            for action, params, t in model.successors(s):
                steps += 1
                for tp in TRANSITION_PROPERTIES:
                    assert tp.holds(model, s, action, params, t), (tp.name, action)
                if t not in seen:
                    seen.add(t)
                    nxt.append(t)
        frontier = nxt
    result = Checker(model).run()
    assert result.ok
    assert len(seen) == result.distinct_states
    assert steps == result.generated_states
    for s in seen:
        assert all(inv.holds(model, s) for inv in INVARIANTS)


@pytest.mark.parametrize("name", ["tiny", "renewal", "restart"])
def test_parallel_search_finds_the_same_states(name):
    one = check(get_config(name))
    two = check(get_config(name), workers=2)
    assert (two.distinct_states, two.generated_states, two.depth, two.ok) == (
        one.distinct_states,
        one.generated_states,
        one.depth,
        one.ok,
    )
    assert two.coverage == one.coverage
    assert two.properties == one.properties


def test_parallel_search_catches_a_mutant_at_the_shortest_depth():
    mutant = MUTANTS["holder-ignores-skew"]
    one = check(get_config(mutant.config), mutant.name)
    two = check(get_config(mutant.config), mutant.name, workers=2)
    assert two.violation is not None
    assert two.violation.depth == one.violation.depth
