"""The spec checked three ways here: exhaustively (pinned counts), by its mutants, and by random
walks that must agree with the checker's verdicts."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcc.spec import checker as checker_module
from kvcc.spec import properties as properties_module
from kvcc.spec.checker import LABELS, Checker, actions_outside_scope, check, swarm
from kvcc.spec.config import CONFIGS, get_config, load_manifest
from kvcc.spec.model import MUTANT_FLAGS, Model
from kvcc.spec.mutants import MUTANTS
from kvcc.spec.properties import INVARIANTS, SOMETIMES, TRANSITION_PROPERTIES, applicable_sometimes, scope_exemptions

# Checked here in seconds; every configuration is checked exhaustively (or sampled, where the
# manifest says so) by ``kvcc check --all`` in .ci/run.
FAST_CONFIGS = ("tiny", "lagging")


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


@pytest.mark.parametrize("name", FAST_CONFIGS)
def test_fast_configs_reach_every_sometimes_in_scope_and_cover_every_action(name):
    cfg = get_config(name)
    result = check(cfg)
    required = {sm.name for sm in applicable_sometimes(cfg)}
    assert {n for n, v in result.properties.items() if v == "reached"} >= required
    assert not result.refuted, result.refuted
    assert not result.uncovered_actions
    assert {a for a, n in result.coverage.items() if n} | set(actions_outside_scope(cfg)) == set(LABELS)


def _companion_properties() -> set[str]:
    return {p.name for p in INVARIANTS + TRANSITION_PROPERTIES}


def test_every_always_has_a_sometimes_required_where_its_mutant_fails():
    """Every always has a sometimes that names it, and that sometimes is required (so reached:
    ``kvcc check --all`` fails on an unreached one) in the configuration where the property's own
    mutant makes it fail: the situation the property talks about happens where it can fail."""
    for name in _companion_properties():
        companions = [sm for sm in SOMETIMES if name in sm.companion_of]
        assert companions, f"{name} has no sometimes"
        configs = {m.config for m in MUTANTS.values() if m.expected_property == name}
        assert any(
            sm.name not in scope_exemptions(get_config(c)) for sm in companions for c in configs
        ), f"no companion of {name} is required in {sorted(configs)}"


def test_every_safety_and_progress_property_has_a_mutant_it_catches():
    expected = {m.expected_property for m in MUTANTS.values()}
    missing = _companion_properties() - expected
    assert not missing, missing
    for m in MUTANTS.values():
        assert m.config in CONFIGS and m.config in load_manifest(), m.name
        assert set(m.bugs) <= MUTANT_FLAGS


def test_design_non_vacuity_list_is_required_somewhere():
    """docs/protocol.md's sometimes list, plus two holders during one invalidation, each required (and so
    reached) in at least one configuration."""
    for name in (
        "RemoteReadUnderLease",
        "InvalidationCompletedByAcks",
        "InvalidationCompletedByExpiry",
        "FencedStaleWrite",
        "RefusedEvictionOfLeasedBlock",
        "OwnershipHandoffAfterCrash",
        "InvalidationWithTwoHolders",
    ):
        assert any(name not in scope_exemptions(cfg) for cfg in CONFIGS.values()), name


def test_every_sometimes_and_action_is_required_in_some_configuration():
    for sm in SOMETIMES:
        assert any(sm.name not in scope_exemptions(cfg) for cfg in CONFIGS.values()), sm.name
    for action in LABELS:
        assert any(action not in actions_outside_scope(cfg) for cfg in CONFIGS.values()), action


def test_a_pool_read_is_not_a_remote_read():
    """A remote read is from another node's tier: a scope whose blocks all live in the pool
    cannot contain one, and says why."""
    assert "RemoteReadUnderLease" in scope_exemptions(get_config("tiny"))
    assert "RemoteReadUnderLease" not in scope_exemptions(get_config("tiering"))
    assert "PoolReadUnderLease" not in scope_exemptions(get_config("tiny"))


def test_a_scope_too_tight_to_read_fails_its_sometimes():
    """Vacuity is an error: a lease-id budget that the write lease exhausts leaves the reader
    nothing to read, and the checker must refuse to call the model ok."""
    import attrs

    cfg = attrs.evolve(get_config("tiny"), max_lease_id=1)
    result = check(cfg)
    assert result.violation is None
    assert result.ok is False
    assert result.properties["PoolReadUnderLease"] == "unreached"


def test_an_exemption_the_search_refutes_fails_the_check(monkeypatch):
    """An argument that a scope cannot contain a sometimes is checked: reaching it fails."""
    import attrs

    wrong = tuple(
        attrs.evolve(sm, outside_scope=lambda cfg: "argued wrongly") if sm.name == "Eviction" else sm
        for sm in SOMETIMES
    )
    monkeypatch.setattr(properties_module, "SOMETIMES", wrong)
    monkeypatch.setattr(checker_module, "SOMETIMES", wrong)
    result = check(get_config("tiny"))
    assert result.violation is None
    assert result.properties["Eviction"] == "reached"
    assert result.refuted == ["Eviction"]
    assert result.ok is False


def test_an_action_argued_away_but_covered_fails_the_check(monkeypatch):
    real = checker_module.actions_outside_scope
    monkeypatch.setattr(checker_module, "actions_outside_scope", lambda cfg: {**real(cfg), "evict": "argued wrongly"})
    result = check(get_config("tiny"))
    assert "evict" in result.refuted
    assert result.ok is False


def test_one_writer_checks_a_second_write_grant_clean_and_two_writers_catch_it():
    """Issue 8: a directory that grants a second write lease on a WRITING key cannot fail
    OneWriterPerGeneration with one writer node; with two it does, in 4 steps."""
    clean = check(get_config("tiny"), "second-write-grant")
    assert clean.violation is None
    caught = check(get_config("race"), "second-write-grant")
    assert caught.violation is not None
    assert caught.violation.property == "OneWriterPerGeneration"
    assert caught.violation.depth == 4


def test_symmetry_keeps_roles_and_verdicts():
    """Reduction by role-preserving permutations: fewer states, the same verdict and the same
    sometimes reached, on a two-writer scope small enough to explore both ways."""
    import attrs

    cfg = attrs.evolve(get_config("race"), max_epoch=1, max_lease_id=2, name="race-small")
    full = check(attrs.evolve(cfg, symmetry=False))
    reduced = check(cfg)
    assert reduced.distinct_states < full.distinct_states
    assert (reduced.ok, reduced.properties) == (full.ok, full.properties)
    assert set(reduced.coverage) == set(full.coverage)
    assert get_config("holders").symmetric_permutations() == ((0, 1, 2), (0, 2, 1))  # the writer stays


def _reachable(model: Model) -> set[bytes]:
    """Every reachable state, by a plain breadth-first search (no fingerprints, no symmetry)."""
    (s0,) = model.init_states()
    seen, frontier = {s0}, [s0]
    while frontier:
        frontier = [t for s in frontier for _, _, t in model.successors(s) if t not in seen and not seen.add(t)]
    return seen


def test_symmetry_canonical_form_is_one_per_orbit_and_workers_agree():
    """Each image of a reachable state under a role-preserving permutation is reachable (the
    permutation is a symmetry of the model) and has the state's canonical form; the reduced
    search reaches exactly one state per orbit, with one worker and with two (two workers once
    split an orbit between them by partitioning on a non-canonical state, and message senders
    were permuted off by one, so images were states the model cannot reach)."""
    import attrs

    cfg = attrs.evolve(get_config("race"), max_epoch=1, max_lease_id=2, name="race-small")
    states = _reachable(Model(attrs.evolve(cfg, symmetry=False)))
    symmetry = checker_module.Symmetry(Model(cfg))
    assert symmetry.perms
    for s in states:
        for perm in symmetry.perms:
            image = symmetry._image(s, *perm)
            assert image in states
            assert symmetry.canonical(image) == symmetry.canonical(s)
    orbits = len({symmetry.canonical(s) for s in states})
    assert orbits < len(states)
    one, two = check(cfg, workers=1), check(cfg, workers=2)
    assert one.distinct_states == two.distinct_states == orbits
    assert (one.ok, one.properties, one.coverage) == (two.ok, two.properties, two.coverage)


def test_swarm_finds_a_mutant_and_labels_itself_sampled():
    mutant = MUTANTS["second-write-grant"]
    sampled = swarm(Model(get_config(mutant.config), mutant.bugs), seeds=300, depth=40, max_states=100_000)
    assert sampled.violation is not None  # some property: a walk is not a shortest counterexample
    trace = sampled.violation.trace
    assert trace[0]["action"] == "init" and len(trace) - 1 == sampled.violation.depth
    assert sampled.truncated
    clean = swarm(Model(get_config("tiny")), seeds=20, depth=20, max_states=100_000)
    assert clean.violation is None and clean.truncated  # never mistaken for exhaustive


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


def _unchanged(model: Model, reads: tuple[str, ...], pre: bytes, post: bytes) -> bool:
    """Whether ``pre`` and ``post`` agree on every group in ``reads`` (none declared: all)."""
    L = model.L
    for name in reads or (*L.groups, "messages"):
        sl = slice(L.fixed, None) if name == "messages" else L.groups[name]
        if pre[sl] != post[sl]:
            return False
    return True


# Breadth-first prefixes, in states: deep enough in these configurations to reach the situations
# their ``sometimes`` are about (two holders of an invalidating key, a child committed, a trust
# during restart grace, copies under two epochs); a few thousand states elsewhere.
_READS_PREFIX = {"holders": 60_000, "chain": 60_000, "restart": 60_000, "trio": 40_000, "demote": 40_000}
# State ``sometimes`` whose value no prefix above changes (their situations lie deeper): their
# declarations are checked by the checker's own runs only (a wrong one would leave them
# unreached, and ``kvcc check --all`` fails on that).
_READS_TOO_DEEP = {"OwnerCrashedWhileDraining", "ParentRewrittenUnderCachedChild"}


def test_every_declared_read_set_covers_what_the_sometimes_reads():
    """``Sometimes.reads`` lets the checker skip a state ``sometimes`` on a state whose parent
    agrees on those groups. On every step of a breadth-first prefix of every configuration
    where they agree, its value must not change (else a group it reads is missing); and every
    state ``sometimes`` but the deep ones changes value on some step, so the check is not
    vacuous. (``Invariant.reads`` cannot be checked this way: on the correct model an invariant
    never changes value; ``test_checker_verdict_agrees_with_predicates_on_every_state`` and the
    mutants' runs check those.)"""
    predicates = [(sm.name, sm.reads, sm.reached_state) for sm in SOMETIMES if sm.reached_state is not None]
    flipped: set[str] = set()
    for config in sorted(CONFIGS):
        model = Model(get_config(config))
        seen, frontier = set(model.init_states()), list(model.init_states())
        while frontier and len(seen) < _READS_PREFIX.get(config, 4_000):
            nxt = []
            for pre in frontier:
                before = [holds(model, pre) for _, _, holds in predicates]
                for action, params, post in model.successors(pre):
                    if post is pre:
                        continue
                    for (name, reads, holds), was in zip(predicates, before):
                        if holds(model, post) != was:
                            flipped.add(name)
                            assert not _unchanged(model, reads, pre, post), (config, name, reads, action, params)
                    if post not in seen:
                        seen.add(post)
                        nxt.append(post)
            frontier = nxt
    state_sometimes = {sm.name for sm in SOMETIMES if sm.reached_state is not None}
    assert state_sometimes - _READS_TOO_DEEP <= flipped, sorted(state_sometimes - _READS_TOO_DEEP - flipped)


@pytest.mark.parametrize("name", ["tiny", "lagging"])
def test_the_checker_reaches_every_state_sometimes_a_full_walk_reaches(name):
    """The checker asks a state ``sometimes`` only where a group it reads changed: it must
    still report reached every one that holds on some reachable state (asked of every state
    here, skipping nothing)."""
    model = Model(get_config(name))
    seen, frontier = set(model.init_states()), list(model.init_states())
    while frontier:
        nxt = []
        for s in frontier:
            for _, _, t in model.successors(s):
                if t not in seen:
                    seen.add(t)
                    nxt.append(t)
        frontier = nxt
    state_sms = [sm for sm in SOMETIMES if sm.reached_state is not None]
    everywhere = {sm.name for sm in state_sms if any(sm.reached_state(model, s) for s in seen)}
    result = Checker(model).run()
    reached = {sm.name for sm in state_sms if result.properties.get(sm.name) == "reached"}
    reached |= {sm.name for sm in state_sms if sm.name in result.exempt_sometimes and sm.name in result.refuted}
    assert everywhere, "the configuration reaches some state sometimes: the comparison is not empty"
    assert reached == everywhere


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


@pytest.mark.parametrize("name", ["tiny", "lagging"])
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


@pytest.mark.parametrize("name", ["tiny", "lagging"])
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


def test_check_all_prints_one_row_per_configuration_and_fails_on_uncovered_actions(monkeypatch, capsys):
    """``kvcc check --all --json`` on a two-configuration manifest: each row says whether it was
    exhaustive; the command fails because two small scopes leave actions covered by none."""
    import json

    from kvcc import cli
    from kvcc.spec import config as config_module

    pinned = {name: load_manifest()[name] for name in FAST_CONFIGS}
    monkeypatch.setattr(config_module, "CONFIGS", {name: get_config(name) for name in FAST_CONFIGS})
    monkeypatch.setattr(config_module, "load_manifest", lambda: pinned)
    code = cli.main(["check", "--all", "--json", "--workers", "1"])
    payload = json.loads(capsys.readouterr().out)
    assert [row["config"] for row in payload["configs"]] == list(FAST_CONFIGS)
    assert all(row["ok"] and row["mode"] == "exhaustive" and row["manifest"] == "match" for row in payload["configs"])
    assert payload["exhaustive"] == list(FAST_CONFIGS) and payload["sampled"] == []
    assert "restart_directory" in payload["uncovered_anywhere"]
    assert code == 1 and payload["ok"] is False


def test_check_all_runs_a_sampled_configuration_by_its_pinned_walks(monkeypatch, capsys):
    """A configuration the manifest marks ``sampled`` is checked by the seeded walks it pins, and
    says so on its line; the walks are reproducible, so their state count is pinned, and another
    count fails the configuration."""
    import json

    from kvcc import cli
    from kvcc.spec import config as config_module

    walks = {"seeds": 200, "first_seed": 7, "depth": 30, "max_states": 100_000}
    reached = swarm(Model(get_config("tiny")), seeds=200, depth=30, max_states=100_000, first_seed=7)
    monkeypatch.setattr(config_module, "CONFIGS", {"tiny": get_config("tiny")})
    for pinned, ok in ((reached.distinct_states, True), (reached.distinct_states + 1, False)):
        entry = {"mode": "sampled", "swarm": walks, "distinct_states": pinned, "ok": True}
        monkeypatch.setattr(config_module, "load_manifest", lambda entry=entry: {"tiny": entry})
        cli.main(["check", "--all", "--json"])
        (row,) = json.loads(capsys.readouterr().out)["configs"]
        assert row["mode"] == "sampled" and row["distinct_states"] == reached.distinct_states
        assert row["coverage"] == reached.coverage
        assert row["manifest"] == ("match" if ok else "mismatch")
        assert row["ok"] is (ok and reached.ok)
        cli.main(["check", "--all"])
        line = capsys.readouterr().out.splitlines()[0]
        assert "check tiny" in line and "sampled" in line


def test_rewrite_scope_contains_a_parent_rewritten_under_a_cached_child():
    """A path of 20 steps in ``rewrite`` (the full search is left to ``kvcc check --all``): the
    parent is invalidated, the child's revocation lost, the parent's generation ends and is written
    again while the holder still trusts the child. With three lease ids the rewrite was refused."""
    model = Model(get_config("rewrite"))
    witness = next(sm for sm in SOMETIMES if sm.name == "ParentRewrittenUnderCachedChild")
    script = [
        ("begin_write", (0, 0)), ("grant_write_lease", (0, 0)), ("start_writing", ()), ("store_bytes", ()),
        ("commit_write", ()), ("begin_write", (0, 1)), ("grant_write_lease", (0, 1)), ("start_writing", ()),
        ("store_bytes", ()), ("commit_write", ()), ("acquire", (1, 1)), ("grant_read_lease", ()),
        ("trust_read_lease", ()), ("invalidate", (0,)), ("drop", ()), ("complete_invalidation", ()),
        ("free_slot", ()), ("free_acked", ()), ("begin_write", (0, 0)), ("grant_write_lease", (0, 0)),
    ]
    (s,) = model.init_states()
    for label, prefix in script:
        assert not witness.reached_state(model, s)
        s = next(t for action, params, t in model.successors(s) if action == label and params[: len(prefix)] == prefix)
    assert witness.reached_state(model, s)


def test_check_all_runs_the_fast_or_the_full_set(monkeypatch, capsys):
    """``--set fast`` leaves out a configuration the manifest puts in the full set, ``--set full``
    runs only those, and a label that only the other set covers fails only the whole run."""
    import json

    from kvcc import cli
    from kvcc.spec import config as config_module

    pinned = {name: dict(load_manifest()[name]) for name in FAST_CONFIGS}
    slow = FAST_CONFIGS[-1]
    pinned[slow]["set"] = "full"
    monkeypatch.setattr(config_module, "CONFIGS", {name: get_config(name) for name in FAST_CONFIGS})
    monkeypatch.setattr(config_module, "load_manifest", lambda: pinned)
    for chosen, expected in (("fast", list(FAST_CONFIGS[:-1])), ("full", [slow])):
        code = cli.main(["check", "--all", "--set", chosen, "--json", "--workers", "1"])
        payload = json.loads(capsys.readouterr().out)
        assert payload["set"] == chosen and [row["config"] for row in payload["configs"]] == expected
        assert payload["uncovered_anywhere"] and code == 0 and payload["ok"] is True
    assert cli.main(["check", "--all", "--json", "--workers", "1"]) == 1  # both: every label must be covered
    capsys.readouterr()
