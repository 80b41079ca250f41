"""kvcc.conformance.names: a rejection read in the deployment's own names, with the whole map."""

from __future__ import annotations

import copy
import importlib.util
import json
import random
import re
import sys
from pathlib import Path

from kvcc.conformance.contract import RunContext, WriteGrant
from kvcc.conformance.names import rename_verdict
from kvcc.conformance.validate import ACCEPTED, REJECTED, TraceParams, model_names, validate_trace
from kvcc.spec.keys import Namespace, chain_keys

ROOT = Path(__file__).resolve().parents[1]
PARAMS = TraceParams(1000, 50)
NS = Namespace("names/model", "r1", "float16", 4, cache_salt=b"t")
SPEC_ID = re.compile(r"(?<![\w/.-])[nlk]\d+(?![\w])")


def _example():
    spec = importlib.util.spec_from_file_location("kvcc_example_minimal_adapter_names", ROOT / "examples" / "minimal_adapter.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


M = _example()


class _AbortFreesAtOnce(M.MinimalCache):
    def abort(self, grant):
        super().abort(grant)
        with self._lock:
            self._end_generation(self._records[grant.key])


def _rejected_trace():
    """A writer aborts, the directory frees the key at once, another node is granted it: the
    validator rejects the second grant. Lease ids are shifted so that real and model ids differ."""
    a = _AbortFreesAtOnce()
    a.start(RunContext(ROOT, 1, nodes=2, lease_term_ms=1000, skew_ms=50, namespaces=(NS,)))
    try:
        (key,) = chain_keys(NS, [random.Random(3).randrange(1 << 20) for _ in range(4)])
        g = a.begin_write("cache-1", NS, key, None)
        a.abort(g)
        assert isinstance(a.begin_write("cache-2", NS, key, None), WriteGrant)
        events = a.events()
    finally:
        a.stop()
    return [dict(e, lease=None if e["lease"] is None else e["lease"] + 40) for e in events], key


def test_a_rejection_speaks_the_deployments_names():
    events, key = _rejected_trace()
    verdict = validate_trace(events, PARAMS).to_json()
    assert verdict["status"] == REJECTED
    before = copy.deepcopy(verdict)
    out = rename_verdict(verdict, events, PARAMS)
    assert verdict == before  # pure
    names = out["names"]
    assert names["nodes"] == {"n0": "cache-1", "n1": "cache-2"}
    assert names["locations"] == {"l0": "cache-1/dram", "l1": "cache-2/dram", "l2": "(the shared pool: in no event)"}
    assert names["keys"] == {"k0": key.hex}
    assert names["leases"] and all(m == {"1": 41} for m in names["leases"])
    state = out["diff"]["closest"][0]
    text = json.dumps([state["variables"], state["in_flight"]])
    assert not SPEC_ID.findall(text), SPEC_ID.findall(text)
    assert state["variables"][f"record[{key.hex[:16]}…].writer"] == "cache-1"
    assert state["variables"][f"record[{key.hex[:16]}…].write_lease"] == "41"  # the real id
    assert any("lease=41" in m and "to=cache-1/dram" in m for m in state["in_flight"])
    assert out["diff"]["event"] == before["diff"]["event"]  # the deployment's own record, untouched
    assert "'directory'" in out["reason"]


def test_model_like_names_map_in_one_pass():
    events, _ = _rejected_trace()
    # A deployment that names its nodes like the model does, crossed over: cache-1 -> "n1", cache-2 -> "n0".
    swap = {"cache-1": "n1", "cache-2": "n0", "cache-1/dram": "n1/dram", "cache-2/dram": "n0/dram"}
    crossed = [{k: swap.get(v, v) if isinstance(v, str) else v for k, v in e.items()} for e in events]
    assert model_names(crossed, PARAMS)["n0"] == "n1"
    out = rename_verdict(validate_trace(crossed, PARAMS).to_json(), crossed, PARAMS)
    variables = out["diff"]["closest"][0]["variables"]
    writer = [v for k, v in variables.items() if k.endswith("].writer")]
    assert writer == ["n1"]  # the model's n0 is the deployment's "n1", renamed once, not twice
    assert any(k.startswith("holder[n0,") for k in variables)  # the model's n1 is the deployment's "n0"


def test_an_accepted_verdict_carries_an_empty_map():
    a = M.MinimalCache()
    a.start(RunContext(ROOT, 1, nodes=2, lease_term_ms=1000, skew_ms=50, namespaces=(NS,)))
    try:
        (key,) = chain_keys(NS, list(range(4)))
        g = a.begin_write("cache-1", NS, key, None)
        a.write_bytes(g, b"x")
        a.commit(g)
        events = a.events()
    finally:
        a.stop()
    verdict = validate_trace(events, PARAMS).to_json()
    assert verdict["status"] == ACCEPTED
    out = rename_verdict(verdict, events, PARAMS)
    assert out["names"] == {"nodes": {}, "locations": {}, "keys": {}, "leases": []}
    assert {k: v for k, v in out.items() if k != "names"} == verdict


def test_model_names_of_a_malformed_trace_is_empty():
    assert model_names([{"event": "nonsense"}], PARAMS) == {}


def test_the_report_carries_the_rejection_in_the_adapters_names():
    from kvcc.conformance.runner import run_conformance

    rep = run_conformance(_AbortFreesAtOnce, ["core"], 5, ids=["KVCC-CORE-007"])
    (r,) = [r for r in rep.results if r.id == "KVCC-CORE-007"]
    assert r.status == "FAIL" and r.verdict["status"] == REJECTED, r.message
    names = r.verdict["names"]
    assert set(names["nodes"].values()) <= {"cache-1", "cache-2", "cache-3"} and names["nodes"]
    assert names["keys"]["k0"] == r.verdict["diff"]["event"]["key"]
    text = json.dumps([s["variables"] for s in r.verdict["diff"]["closest"]])
    assert not SPEC_ID.findall(text)
    assert "'directory'" in r.message  # the failure message quotes the deployment's own names


def test_the_console_prints_the_map_of_a_rejection(capsys, monkeypatch):
    from kvcc.conformance import command
    from kvcc.conformance.names import map_line
    from kvcc.conformance.runner import run_conformance

    rep = run_conformance(_AbortFreesAtOnce, ["core"], 5, ids=["KVCC-CORE-007"])
    (r,) = [r for r in rep.results if r.id == "KVCC-CORE-007"]
    line = map_line(r.verdict["names"])
    assert "n0=cache-" in line and "l0=cache-" in line and "k0=" in line
    command._summary(rep)
    out = capsys.readouterr().out
    assert "spec ids: " + line.split(" leases")[0] in " ".join(out.split())
