"""The command line: exit codes, ``--json`` shapes, error lines, counterexample rendering.

Fast by construction: ``main([...])`` runs in-process (capsys), on the ``tiny`` configuration or
with ``--max-states`` caps, because no configuration is guaranteed to finish fast while the model
is being tuned. One test runs the real console script in a subprocess.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from kvcc import cli, report

REPO = Path(__file__).resolve().parents[1]
CHECK_KEYS = {"ok", "config", "distinct_states", "states_per_second", "properties"}
MUTANT_KEYS = {"name", "expected_property", "caught", "caught_by", "steps", "seconds", "config"}
CAP = "20000"  # distinct states: a few seconds at most on tiny


@pytest.fixture(autouse=True)
def _wide(monkeypatch):
    # One rendered line per fact, whatever the terminal the tests run in.
    monkeypatch.setenv("COLUMNS", "200")


def _one_json(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, f"--json must print exactly one line, got {len(lines)}:\n{out[:2000]}"
    return json.loads(lines[0])


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected a one-line error, got:\n{err}"
    assert "Traceback" not in err
    return lines[0]


# ------------------------------------------------------------------------------------ check


def test_check_json_has_required_keys(capsys):
    code = cli.main(["check", "--config", "tiny", "--max-states", CAP, "--json"])
    out = capsys.readouterr().out
    res = _one_json(out)
    assert CHECK_KEYS <= res.keys()
    assert res["config"] == "tiny"
    assert isinstance(res["properties"], dict) and res["properties"]
    assert set(res["properties"].values()) <= {"holds", "violated", "reached", "unreached"}
    assert res["distinct_states"] > 0
    assert code == (0 if res["ok"] and res.get("manifest_match", True) else 1)


def test_check_rich_summary(capsys):
    code = cli.main(["check", "--config", "tiny", "--max-states", "2000"])
    out = capsys.readouterr().out
    for word in ("config", "distinct states", "generated", "depth", "seconds", "states/s", "collision probability",
                 "Properties"):
        assert word in out, word
    # 2000 states cannot exhaust tiny: the run is truncated, so not ok, and says so.
    assert "truncated" in out
    assert code == 1
    assert "FAIL check tiny" in out


@pytest.mark.parametrize(
    "argv, what",
    [
        (["check", "--config", "no-such-config"], "unknown configuration 'no-such-config'"),
        (["check", "--config", "tiny", "--mutant", "no-such-mutant"], "unknown mutant 'no-such-mutant'"),
        (["check", "--config", "tiny", "--mutant", "no-such-mutant", "--json"], "unknown mutant 'no-such-mutant'"),
        (["mutants", "--only", "no-such-mutant"], "unknown mutant 'no-such-mutant'"),
        (["prove", "--mutant", "no-such-mutant"], "unknown mutant 'no-such-mutant'"),
        (["bench", "checker", "--config", "no-such-config"], "unknown configuration 'no-such-config'"),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(capsys, argv, what):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    line = _one_error_line(captured.err)
    assert what in line and "error" in line
    assert captured.out == ""


def test_argparse_defaults(capsys):
    assert cli.main(["--help"]) == 0
    assert "check" in capsys.readouterr().out
    assert cli.main(["no-such-command"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_mutant_counterexample_shows_only_changed_variables(capsys):
    # The JSON trace is the ground truth for what changed at each step.
    argv = ["check", "--mutant", "no-fencing", "--config", "small", "--max-states", "100000"]
    code = cli.main(argv + ["--json"])
    res = _one_json(capsys.readouterr().out)
    assert code == 1 and not res["ok"]
    # A mutant the checker does not catch is a failure of the checker, not a reason to skip.
    assert res["violation"] is not None, f"no-fencing was not caught within the cap: {res}"
    trace = res["violation"]["trace"]
    assert trace[0]["action"] == "init"

    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert f"Counterexample: {res['violation']['property']}" in out
    blocks = re.split(r"^Step (\d+)  ", out.split("Counterexample:", 1)[1], flags=re.M)[1:]
    shown = {int(blocks[i]): blocks[i + 1] for i in range(0, len(blocks), 2)}
    assert sorted(shown) == [s["step"] for s in trace]

    all_vars = {name for name in trace[0]["changes"] if not name.startswith("net: ")}
    for step in trace[1:]:
        body = shown[step["step"]]
        header, *lines = [line for line in body.splitlines() if line.strip()]
        if lines and lines[-1].startswith(("PASS", "FAIL")):
            lines = lines[:-1]
        assert header.startswith(step["action"])
        assert len(lines) == len(step["changes"]), (step, lines)
        for name, (before, after) in step["changes"].items():
            if name.startswith("net: "):
                assert any(name[len("net: "):] in line for line in lines)
            else:
                assert before != after
                assert f"  {name}: {before} -> {after}" in lines
        # Nothing that did not change is printed.
        printed = {line.split(":", 1)[0].strip() for line in lines if not line.lstrip().startswith("net ")}
        assert printed <= all_vars and printed == {n for n in step["changes"] if not n.startswith("net: ")}
    assert f"violates {res['violation']['property']}" in shown[trace[-1]["step"]]


def test_render_trace_is_compact():
    trace = [
        {"step": 0, "action": "init", "params": [], "changes": {
            "record[k0].phase": ["", "ABSENT"], "record[k0].gen": ["", "0"], "node[n0].up": ["", "up"],
            "directory.next_lease_id": ["", "1"], "net: Acquire(n1, k0, request=1)": ["-", "in flight"]}},
        {"step": 1, "action": "grant_read_lease", "params": [1, 0], "changes": {
            "record[k0].gen": ["0", "1"], "net: Acquire(n1, k0, request=1)": ["in flight", "gone"]}},
    ]
    buf = io.StringIO()
    violation = {"property": "P", "kind": "invariant", "steps": 1, "trace": trace}
    report.render_trace(Console(file=buf, width=200), violation)
    text = buf.getvalue()
    init = text.split("Step 0  init", 1)[1].split("Step 1", 1)[0]
    assert "node[n0].up=up" in init and "directory.next_lease_id=1" in init
    assert "ABSENT" not in init and "record[k0].gen" not in init  # defaults hidden
    assert "(+2 at default)" in init and "Acquire(n1, k0, request=1) in flight" in init
    step1 = text.split("Step 1  ", 1)[1]
    assert step1.startswith("grant_read_lease(1, 0)")
    assert "record[k0].gen: 0 -> 1" in step1 and "phase" not in step1
    assert "net - Acquire(n1, k0, request=1)" in step1 and "violates P" in step1


# ------------------------------------------------------------------------------- manifest


def _fake_result(**over):
    from kvcc.spec.checker import CheckResult

    fields = dict(config="tiny", mutant=None, ok=True, distinct_states=123, generated_states=456, depth=7,
                  seconds=0.5, properties={"Inv": "holds", "Some": "reached"}, coverage={"tick": 3})
    fields.update(over)
    return CheckResult(**fields)


@pytest.mark.parametrize("pinned, expect_code, expect_match", [(123, 0, True), (124, 1, False), (None, 0, None)])
def test_manifest_comparison(monkeypatch, capsys, pinned, expect_code, expect_match):
    import kvcc.spec.checker
    import kvcc.spec.config

    monkeypatch.setattr(kvcc.spec.checker, "check", lambda *a, **k: _fake_result())
    manifest = {} if pinned is None else {"tiny": {"distinct_states": pinned, "ok": True}}
    monkeypatch.setattr(kvcc.spec.config, "load_manifest", lambda: manifest)
    assert cli.main(["check", "--config", "tiny", "--json"]) == expect_code
    res = _one_json(capsys.readouterr().out)
    assert res.get("manifest_match") == expect_match
    assert ("manifest_match" in res) == (pinned is not None)
    assert cli.main(["check", "--config", "tiny"]) == expect_code
    out = capsys.readouterr().out
    if pinned is not None:
        assert ("manifest: match" in out) == expect_match and ("MISMATCH" in out) == (not expect_match)


def test_manifest_not_compared_for_mutants_or_truncated_runs():
    assert cli.manifest_status("tiny", "no-fencing", {"distinct_states": 1}) is None
    status = cli.manifest_status("tiny", None, {"distinct_states": 1, "truncated": True})
    assert status["status"] in ("absent", "unpinned", "skipped", "unreadable")


def test_json_never_prints_infinity(capsys):
    cli.print_json({"states_per_second": float("inf"), "x": [1.5, float("nan")]})
    assert json.loads(capsys.readouterr().out) == {"states_per_second": None, "x": [1.5, None]}


# -------------------------------------------------------------------------------- mutants


def _check_mutants_payload(payload: dict, names: list[str]) -> None:
    assert set(payload) >= {"ok", "mutants"}
    assert [m["name"] for m in payload["mutants"]] == names
    for m in payload["mutants"]:
        assert MUTANT_KEYS <= m.keys()
        assert m["caught"] == (m["caught_by"] == m["expected_property"])
        assert (m["steps"] is None) == (m["caught_by"] is None)
    assert payload["ok"] == all(m["caught"] for m in payload["mutants"])


def test_mutants_only_json_shape(capsys):
    code = cli.main(["mutants", "--only", "lease-id-reuse", "--max-states", "50000", "--json"])
    payload = _one_json(capsys.readouterr().out)
    _check_mutants_payload(payload, ["lease-id-reuse"])
    assert code == (0 if payload["ok"] else 1)


def test_mutants_in_worker_processes(capsys):
    names = ["lease-id-reuse", "write-lease-never-expires"]
    code = cli.main(["mutants", "--only", *names, "--max-states", "50000", "--json"])
    payload = _one_json(capsys.readouterr().out)
    _check_mutants_payload(payload, names)
    assert code == (0 if payload["ok"] else 1)
    cli.main(["mutants", "--only", *names, "--max-states", "50000"])
    out = capsys.readouterr().out
    assert all(n in out for n in names) and "mutants" in out


# ---------------------------------------------------------------------------------- prove


def test_prove_without_proofs_module(capsys, monkeypatch):
    # z3 missing (the proofs module cannot import): a typed one-line error, not a traceback.
    monkeypatch.setitem(sys.modules, "kvcc.spec.proofs", None)
    assert cli.main(["prove"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "not available" in line
    assert cli.main(["prove", "--json"]) == 2
    captured = capsys.readouterr()
    payload = _one_json(captured.out)
    assert payload["ok"] is False and "error" in payload


class _Obligation:
    def __init__(self, action, invariant, proved, cex=None):
        self.action, self.invariant, self.proved = action, invariant, proved
        self.seconds, self.counterexample = 0.01, cex

    def to_json(self):
        return {"action": self.action, "invariant": self.invariant, "proved": self.proved, "seconds": self.seconds,
                "counterexample": self.counterexample}


def test_prove_with_stub(monkeypatch, capsys):
    import kvcc.spec.proofs

    def prove_all(bugs=frozenset()):
        broken = "no_fencing" in bugs
        cex = {"pre": {"fence": 2}, "post": {"fence": 1}} if broken else None
        return [_Obligation("tick", "NoStaleRead", True),
                _Obligation("store_bytes", "CommittedBytesIntact", not broken, cex)]

    monkeypatch.setattr(kvcc.spec.proofs, "prove_all", prove_all, raising=False)
    monkeypatch.setattr(cli, "run_refinement", lambda: {"ok": True, "configs": {}, "steps": 0})  # minutes for real
    assert cli.main(["prove", "--json"]) == 0
    payload = _one_json(capsys.readouterr().out)
    assert payload["ok"] is True and len(payload["obligations"]) == 2
    assert {"action", "invariant", "proved", "seconds"} <= payload["obligations"][0].keys()
    assert cli.main(["prove", "--mutant", "no-fencing"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "store_bytes breaks CommittedBytesIntact" in out and "fence = 1" in out


# --------------------------------------------------------------------------------- verify


@pytest.mark.parametrize("failing", [None, "check", "mutants", "prove"])
def test_verify_passes_only_if_all_three_pass(monkeypatch, capsys, failing):
    check_res = _fake_result(ok=failing != "check").to_json()
    monkeypatch.setattr(cli, "run_check", lambda *a, **k: (check_res, None, 0 if failing != "check" else 1))
    monkeypatch.setattr(cli, "run_mutants", lambda *a, **k: {"ok": failing != "mutants", "mutants": [], "seconds": 0})
    monkeypatch.setattr(cli, "run_prove", lambda *a, **k: {"ok": failing != "prove", "mutant": None, "proved": 0,
                                                           "total": 0, "seconds": 0, "obligations": []})
    code = cli.main(["verify"])
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert code == (0 if failing is None else 1)
    assert last.startswith("verify: " + ("PASS" if failing is None else "FAIL"))
    if failing:
        assert failing in last
    assert cli.main(["verify", "--json"]) == code
    payload = _one_json(capsys.readouterr().out)
    assert payload["ok"] == (failing is None) and {"check", "mutants", "prove"} <= payload.keys()


# ---------------------------------------------------------------------------------- bench


def test_bench_checker_json(capsys):
    code = cli.main(["bench", "checker", "--config", "tiny", "--max-states", "3000", "--json"])
    r = _one_json(capsys.readouterr().out)
    assert code == 0
    assert {"config", "distinct_states", "seconds", "distinct_states_per_second", "bytes_per_state",
            "peak_rss_bytes", "targets", "met"} <= r.keys()
    assert r["config"] == "tiny" and r["distinct_states"] >= 3000
    assert r["targets"] == {"distinct_states_per_second": 100_000, "bytes_per_state": 200}
    assert set(r["met"]) == set(r["targets"])
    assert r["visited_set_bytes_per_state"] > 0


# ------------------------------------------------------------------------- console script


def test_console_script_subprocess():
    exe = shutil.which("kvcc", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("the kvcc console script is not installed next to this interpreter (run scripts/setup.sh)")
    proc = subprocess.run([exe, "check", "--config", "tiny", "--max-states", "2000", "--json"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    res = _one_json(proc.stdout)
    assert CHECK_KEYS <= res.keys() and proc.returncode == (0 if res["ok"] else 1)
    proc = subprocess.run([exe, "check", "--config", "nope"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "unknown configuration 'nope'" in _one_error_line(proc.stderr)
