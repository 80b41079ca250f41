"""``Capabilities.keeps_engines_up`` and the run-end hook ``close_run()``: the runner calls it once,
after the last test, however the tests ended; never for an adapter that does not declare it; and
an adapter that declares it without the hook is refused before anything runs."""

from __future__ import annotations

import time

import attrs
import pytest

from kvcc.conformance import testing
from kvcc.conformance.contract import AdapterError, Capabilities
from kvcc.conformance.runner import run_conformance

IDS = ["KVCC-CORE-001", "KVCC-CORE-002"]


class _Calls:
    def __init__(self) -> None:
        self.log: list[str] = []  # "start:<n>", "stop", "close_run", in order


def _kept(calls: _Calls, *, fail_start: bool = False, hang: bool = False, declare: bool = True, hook: bool = True):
    """A factory of in-process adapters that declare (or not) keeping engines up, logging calls."""

    class Kept(testing.CoreAdapter):
        def capabilities(self) -> Capabilities:
            return attrs.evolve(super().capabilities(), keeps_engines_up=declare)

        def start(self, ctx) -> None:
            calls.log.append("start")
            if fail_start:
                raise AdapterError("the deployment did not come up")
            super().start(ctx)

        def lookup(self, node, ns, keys):
            if hang:
                time.sleep(3)
            return super().lookup(node, ns, keys)

        def stop(self) -> None:
            calls.log.append("stop")
            super().stop()

    if hook:
        Kept.close_run = lambda self: calls.log.append("close_run")
    else:
        Kept.close_run = None
    return Kept


def test_close_run_is_called_once_after_the_last_test():
    calls = _Calls()
    rep = run_conformance(_kept(calls), profiles=["core"], seed=3, ids=IDS, lease_term_ms=200, skew_ms=20, validate=False)
    assert [r.status for r in rep.results if r.id in IDS] == ["PASS", "PASS"]
    assert calls.log == ["start", "stop", "start", "stop", "close_run"]
    assert rep.capabilities["keeps_engines_up"] is True


def test_close_run_is_called_after_tests_that_errored():
    calls = _Calls()
    rep = run_conformance(_kept(calls, fail_start=True), profiles=["core"], seed=3, ids=IDS, validate=False)
    assert [r.status for r in rep.results if r.id in IDS] == ["ERROR", "ERROR"]
    assert calls.log.count("close_run") == 1 and calls.log[-1] == "close_run"


def test_close_run_is_called_after_a_test_that_timed_out():
    calls = _Calls()
    rep = run_conformance(_kept(calls, hang=True), profiles=["core"], seed=3, ids=IDS[:1], time_limit_s=0.5,
                          validate=False)  # fmt: skip
    assert rep.by_id()["KVCC-CORE-001"].status == "ERROR"
    assert "timed out" in rep.by_id()["KVCC-CORE-001"].message
    assert calls.log.count("close_run") == 1 and calls.log[-1] == "close_run"


def test_close_run_is_not_called_for_an_adapter_that_does_not_keep_engines_up():
    calls = _Calls()
    rep = run_conformance(_kept(calls, declare=False), profiles=["core"], seed=3, ids=IDS[:1], validate=False)
    assert "close_run" not in calls.log
    assert "keeps_engines_up" not in rep.capabilities  # reports of other adapters are unchanged


def test_declaring_it_without_the_hook_is_refused_before_any_test_runs():
    calls = _Calls()
    with pytest.raises(TypeError, match="close_run"):
        run_conformance(_kept(calls, hook=False), profiles=["core"], seed=3, ids=IDS[:1], validate=False)
    assert calls.log == []


def test_the_field_is_a_bool():
    with pytest.raises(TypeError):
        Capabilities(profiles={"core"}, keeps_engines_up="yes")
