"""The suite's mutation score (``kvcc.conformance.mutation``): the mutator makes the mutants it
should on a small module, a mutant the suite must catch is caught while the unmutated deployment
certifies, the reviewed list of equivalent mutants names real mutants, and the command's JSON has
its shape."""

from __future__ import annotations

import ast
import json

import pytest

from kvcc.cli import main
from kvcc.conformance import mutation
from kvcc.conformance.mutation import RunParams, Target

SAMPLE = '''\
"""A sample module."""

LIMIT = 5


def guard(x, limit):
    """Docstring."""
    if x < limit and x != 0:
        return True
    return False


class Box:
    def __init__(self):
        self.items = set()

    def put(self, v):
        assert v is not None
        self.items.add(v)
        self.count = len(self.items) + 1
'''


@pytest.fixture
def sample(tmp_path, monkeypatch):
    def make(prefix: str = "") -> Target:
        (tmp_path / "kvcc_mutation_sample.py").write_text(prefix + SAMPLE)
        return Target("kvcc_mutation_sample")

    monkeypatch.syspath_prepend(str(tmp_path))
    return make


def _pairs(mutants):
    return {(m.operator, m.before, m.after) for m in mutants}


def test_mutator_makes_the_expected_mutants(sample):
    target = sample()
    mutants = mutation.generate([target])
    pairs = _pairs(mutants)
    expected = {
        ("cmp-swap", "x < limit", "(x <= limit)"),
        ("cmp-swap", "x != 0", "(x == 0)"),
        ("boolop-swap", "x < limit and x != 0", "(x < limit or x != 0)"),
        ("boolop-drop", "x < limit and x != 0", "(x != 0)"),
        ("boolop-drop", "x < limit and x != 0", "(x < limit)"),
        ("negate-cond", "x < limit and x != 0", "(not (x < limit and x != 0))"),
        ("cond-true", "x < limit and x != 0", "(True)"),
        ("cond-false", "x < limit and x != 0", "(False)"),
        ("return-negate", "True", "(False)"),
        ("return-negate", "False", "(True)"),
        ("const-off", "0", "(1)"),
        ("const-off", "0", "(-1)"),
        ("const-off", "1", "(2)"),
        ("const-off", "1", "(0)"),
        ("stmt-drop", "self.items = set()", "pass"),
        ("stmt-drop", "self.items.add(v)", "pass"),
        ("stmt-drop", "self.count = len(self.items) + 1", "pass"),
        ("return-early", "", "return"),
    }
    assert expected <= pairs, expected - pairs
    # nothing else: module-level constants, docstrings and asserts are not decisions
    assert pairs == expected
    assert not any("assert" in m.before or (m.line == 18 and m.operator != "return-early") for m in mutants)
    assert sorted(m.function for m in mutants if m.operator == "return-early") == ["Box.__init__", "Box.put"]
    source = target.path().read_bytes()
    for m in mutants:
        new = m.source(source)
        compile(new, "sample", "exec")
        changed = [a for a, b in zip(source.decode().splitlines(), new.splitlines()) if a != b]
        assert len(changed) == 1 or m.operator == "return-early", m
        assert m.diff(source, "sample.py").count("\n-") <= 1
    assert len({m.id for m in mutants}) == len(mutants)
    assert len({m.fingerprint for m in mutants}) == len(mutants)


def test_fingerprints_survive_edits_elsewhere_in_the_file(sample):
    before = mutation.generate([sample()])
    after = mutation.generate([sample("# a comment\n\n")])
    assert {m.fingerprint for m in before} == {m.fingerprint for m in after}
    assert {m.id for m in before} != {m.id for m in after}  # ids carry line numbers


def test_targets_exist_and_skip_only_real_functions():
    mutants = mutation.generate()
    assert {m.module for m in mutants} == {t.module for t in mutation.TARGETS}
    assert {m.operator for m in mutants} == set(mutation.OPERATORS)
    for t in mutation.TARGETS:
        text = t.path().read_text()
        for name, why in t.skip:
            assert why
            assert f"def {name.split('.')[-1]}" in text or f"class {name.split('.')[-1]}" in text, name
    assert not any(m.function.startswith("DirectoryCore.cancel_transfer") for m in mutants)
    assert any(m.function.startswith("DirectoryCore.start_transfer") for m in mutants)  # the kit moves blocks


def test_equivalents_are_reviewed_and_name_real_mutants():
    entries = json.loads(mutation.EQUIVALENTS_FILE.read_text())
    fingerprints = {m.fingerprint: m for m in mutation.generate()}
    for e in entries:
        assert e["why"].strip(), e
        assert e["fingerprint"] in fingerprints, f"stale equivalent {e}"
        m = fingerprints[e["fingerprint"]]
        assert (m.operator, m.function) == (e["operator"], e["function"]), e


def _find(mutants, function, operator, before):
    found = [m for m in mutants if (m.function, m.operator, m.before) == (function, operator, before)]
    assert len(found) == 1, found
    return found[0]


def test_a_killable_mutant_is_killed_and_the_reference_certifies():
    # The directory grants read leases whatever the rule says (a dirty read): KVCC-CORE-004 must refuse it.
    mutants = mutation.generate(mutation.TARGETS[:1])
    m = _find(mutants, "DirectoryCore._acquire", "cond-false", "reason is not None")
    origin = mutation._origin(m.module)
    with open(origin, "rb") as f:
        source = m.source(f.read())
    params = RunParams(profiles=("core",))
    out = mutation.run_all([("baseline", None, None, None), ("mutant", m.module, source, origin)], params, jobs=2)
    assert not out["baseline"].killed, out["baseline"]
    assert out["mutant"].killed
    assert out["mutant"].test == "KVCC-CORE-004", out["mutant"]


def test_the_names_the_targets_report_when_run_are_the_mutants_functions():
    # A mutant runs only the tests whose baseline ran its function, named by _Reach as the mutator
    # names it (nested functions and methods included): a name that differed would select nothing.
    named: set[str] = set()
    for t in mutation.TARGETS:
        tree = mutation._Reach(t.module).visit(ast.parse(t.path().read_text(encoding="utf-8")))
        named |= {n.args[0].value for n in ast.walk(tree)
                  if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == mutation._REACHED}
    mutants = mutation.generate()
    assert {mutation.reach_name(m.module, m.function) for m in mutants} <= named


def test_a_selection_runs_the_tests_that_reach_the_mutant_and_counts_the_rest_as_the_baseline():
    params = RunParams(profiles=("core",))
    base = mutation.run_all([("baseline", None, None, None)], params, 1, options={"baseline": {"reach": True}})["baseline"]
    assert not base.killed, base
    reached, given = base.extra["reached"], base.extra["results"]
    assert "kvcc.reference.directory.core:DirectoryCore._acquire" in reached["KVCC-CORE-004"]
    assert reached["KVCC-CORE-900"] == []  # the audit runs no deployment
    m = _find(mutation.generate(mutation.TARGETS[:1]), "DirectoryCore._acquire", "cond-false", "reason is not None")
    origin = mutation._origin(m.module)
    with open(origin, "rb") as f:
        source = m.source(f.read())
    jobs = [("with", m.module, source, origin), ("without", m.module, source, origin), ("unmutated", None, None, None)]
    out = mutation.run_all(jobs, params, jobs=2, options={
        "with": {"ids": ["KVCC-CORE-004"], "given": given},
        "without": {"ids": ["KVCC-CORE-001"], "given": given},  # its dirty read is what KVCC-CORE-004 looks for
        "unmutated": {"ids": ["KVCC-CORE-004"], "given": given},
    })  # fmt: skip
    assert (out["with"].killed, out["with"].test) == (True, "KVCC-CORE-004"), out["with"]
    assert not out["without"].killed, out["without"]
    assert not out["unmutated"].killed, out["unmutated"]  # the audit counted over the baseline's other tests
    # An audit short of its count kills a selection too: the baseline's results say nothing ran.
    bare = {t: {"status": "SKIP", "audit": {}} for t in given}
    o = mutation.run_all([("x", None, None, None)], params, 1, options={"x": {"ids": ["KVCC-CORE-004"], "given": bare}})
    assert (o["x"].killed, o["x"].test) == (True, "KVCC-CORE-900"), o["x"]


def test_the_command_prints_the_score_as_json(capsys):
    rc = main(["conform", "--mutation-score", "--json", "--limit", "3", "--profile", "core", "--jobs", "2"])
    out = json.loads(capsys.readouterr().out)
    for key in ("mutants", "killed", "survivors", "equivalent", "score", "baseline", "timeouts", "by_operator"):
        assert key in out, key
    assert out["baseline"]["certified"] is True
    assert out["mutants"] == 3
    assert out["killed"] + len(out["survivors"]) + out["equivalent"] == out["mutants"]
    for s in out["survivors"]:
        assert s["diff"].startswith("--- a/")
    assert rc == (0 if out["score"] is not None and out["score"] >= mutation.TARGET_SCORE else 1)


def test_the_progress_and_survivors_print_ids_and_code_verbatim(monkeypatch, capsys):
    """Rich would print ":100:" in an id as an emoji and take "[key]" in mutant code as markup:
    the command prints both as they are (the full run of 2026-12-05 lost five ids that way)."""
    mid, before = "reference.directory.host:100:cond-true:0", "self._trusts[key] is None"

    def fake_score(params, *, progress, **kw):
        progress(mid, 1, 1, mutation.Outcome("fp", False, False, None, None, "", 1.0))
        survivor = {"id": mid, "function": "CoreHost._taken_ns", "before": before, "after": "(True)"}
        return {"survivors": [survivor], "mutants": 1, "killed": 0, "equivalent": 0, "score": 0.0, "elapsed_s": 1}

    monkeypatch.setattr(mutation, "mutation_score", fake_score)
    assert main(["conform", "--mutation-score"]) == 1
    captured = capsys.readouterr()
    assert f"survived {mid}" in captured.err
    assert f"SURVIVOR {mid} (CoreHost._taken_ns): {before!r} -> '(True)'" in captured.out.replace("\n", "")


def test_a_rerun_runs_only_the_earlier_survivors_and_carries_the_kills():
    mutants = mutation.generate(mutation.TARGETS[:1])
    survivor = _find(mutants, "DirectoryCore._acquire", "cond-false", "reason is not None")  # killed when run
    carried = mutants[0]
    previous = {"params": {"limit": None}, "survivors": [{"fingerprint": survivor.fingerprint}], "equivalent_mutants": [],
                "fingerprints": [survivor.fingerprint, carried.fingerprint], "mutants": 2, "killed": 1, "score": 0.5}
    res = mutation.mutation_score(RunParams(profiles=("core",)), jobs=1, mutants=[survivor, carried], equivalents={},
                                  previous=previous)
    assert res["baseline"]["certified"] is True
    assert (res["mutants"], res["killed"], res["carried"], res["survivors"]) == (2, 2, 1, [])
    assert res["kills_by_test"] == {"CARRIED": 1, "KVCC-CORE-004": 1}
    assert res["rerun_of"]["score"] == 0.5


def test_a_kill_that_does_not_repeat_counts_as_a_survivor(monkeypatch):
    # The suite's timing tests run at a 200 ms term: on a loaded machine one can fail an unbroken
    # deployment. A mutant "killed" that way, then certified when run again, is no kill.
    mutants = mutation.generate(mutation.TARGETS[:1])[:2]
    runs: dict[str, int] = {}

    def flaky_run_all(jobs_in, params, jobs=1, on_done=None, options=None):
        out = {}
        for key, module, _source, _origin in jobs_in:
            runs[key] = runs.get(key, 0) + 1
            if module is None:  # the baselines and the checks of a selection
                out[key] = mutation.Outcome(key, False, False, None, None, "", 0.0)
            elif key == mutants[0].fingerprint:  # killed every time: a kill
                out[key] = mutation.Outcome(key, True, False, "KVCC-CORE-004", "FAIL", "dirty read", 0.0)
            else:  # killed the first time only: a flake
                killed = runs[key] == 1
                out[key] = mutation.Outcome(key, killed, False, "KVCC-CORE-007" if killed else None,
                                            "FAIL" if killed else None, "late" if killed else "", 0.0)  # fmt: skip
            if on_done is not None and module is not None:
                on_done(out[key])
        return out

    monkeypatch.setattr(mutation, "run_all", flaky_run_all)
    res = mutation.mutation_score(RunParams(profiles=("core",)), jobs=1, mutants=mutants, equivalents={})
    assert (res["mutants"], res["killed"], len(res["survivors"])) == (2, 1, 1)
    assert [u["id"] for u in res["unconfirmed_kills"]] == [mutants[1].id]
    assert res["survivors"][0]["id"] == mutants[1].id
    assert runs[mutants[0].fingerprint] == runs[mutants[1].fingerprint] == 2
    assert res["selection"]["by_reach"] is False  # the fake baselines reached nothing: every test runs
    runs.clear()
    off = mutation.mutation_score(RunParams(profiles=("core",)), jobs=1, mutants=mutants, equivalents={},
                                  confirm_kills=False)  # fmt: skip
    assert off["killed"] == 2 and off["unconfirmed_kills"] == []  # unconfirmed, the flake counted as a kill
