"""The bundle's ``report.html`` on a real bundle (``kvcc conform --adapter core --profile core``):
every test shows the spec properties it checks, its verdict, its audit counters and a timeline
of its trace whose bars and marks are the trace's leases and events; a real rejection (a
mutated trace, judged by the validator) shows the rejected event, the events before it and the
diff; text a vendor logged is escaped, and the page loads nothing from elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

from kvcc.conformance.bundle import report_html
from kvcc.conformance.catalogue import BY_ID
from kvcc.conformance.runner import Report, TestResult, validate_events

ENV = dict(os.environ, PYTHONSAFEPATH="1", DO_NOT_TRACK="1", VLLM_NO_USAGE_STATS="1",
           LMCACHE_TRACK_USAGE="false", HF_HUB_OFFLINE="1")  # fmt: skip
SVG_NS = "{http://www.w3.org/2000/svg}"
VENDOR_FIELD = "<script>alert(1)</script>"
VENDOR_VALUE = "<script>alert(2)</script>"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("render") / "bundle"
    r = subprocess.run([sys.executable, "-m", "kvcc", "conform", "--adapter", "core", "--profile", "core", "--seed",
                        "1", "--out", str(out)], capture_output=True, text=True, env=ENV, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def load_report(bundle: Path) -> tuple[Report, dict]:
    """The ``Report`` a bundle was written from, rebuilt from its report.json and traces."""
    r = json.loads((bundle / "report.json").read_text())
    info = json.loads((bundle / "run_info.json").read_text())
    results = []
    for x in r["results"]:
        trace = bundle / x["trace"]
        events = [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []
        results.append(TestResult(x["id"], x["profile"], x["status"], x["message"], x["duration_s"], x["verdict"],
                                  x["audit"], events, [], x["seed"]))  # fmt: skip
    report = Report(r["suite_version"], r["adapter"], r["capabilities"], r["versions"], r["profiles"], r["seed"],
                    r["params"], r["started_at"], r["finished_at"], results)  # fmt: skip
    return report, info


def sections(page: str) -> dict[str, str]:
    parts = re.split(r"(?=<section id=')", page)
    return {re.match(r"<section id='([^']*)'", p).group(1): p for p in parts if p.startswith("<section id='")}


def svg_of(section: str) -> ET.Element:
    """The section's timeline, parsed as XML: an unescaped ``<`` or ``&`` would not parse."""
    m = re.search(r"<svg.*?</svg>", section, re.S)
    assert m, "no timeline"
    return ET.fromstring(m.group(0))


def titles(svg: ET.Element) -> list[str]:
    return [t.text or "" for t in svg.iter(f"{SVG_NS}title")]


def assert_self_contained(page: str) -> None:
    lowered = page.lower()
    assert "<script" not in lowered
    assert "<link" not in lowered and "<iframe" not in lowered and "@import" not in lowered
    assert not re.search(r"""(src|href)\s*=\s*['"]?\s*(https?:|//)""", lowered)


def test_every_test_shows_its_properties_verdict_audit_and_timeline(bundle):
    page = (bundle / "report.html").read_text()
    assert_self_contained(page)
    report, _ = load_report(bundle)
    by_section = sections(page)
    assert set(by_section) == {r.id for r in report.results}
    drawn = 0
    for r in report.results:
        s = by_section[r.id]
        t = BY_ID[r.id]
        for prop in t.properties:
            assert f"<b>{prop}</b>" in s, (r.id, prop)
        assert f">{r.verdict.get('status', '(none)')}</span>" in s, r.id
        for counter, value in r.audit.items():
            shown = f"<code>{counter}</code>=" + (f"<b>{value}</b>" if value else f"{value}")
            assert shown in s, (r.id, counter)
        if not r.events:
            assert "<svg" not in s
            continue
        drawn += 1
        svg = svg_of(s)
        rows = {t.text for t in svg.iter(f"{SVG_NS}text") if not (t.text or "").endswith(" ms")}
        expected = {e["node"] for e in r.events} - {"faults"}
        expected |= {e.get("crashed") for e in r.events if e["event"] == "crash"}
        assert rows == expected, r.id
        names = titles(svg)
        grants = sum(e["event"] in ("grant_read_lease", "grant_write_lease") for e in r.events)
        assert sum(n.startswith(("read lease of", "write lease of")) for n in names) == grants, r.id
        # Every event is drawn once, as a mark whose tooltip names it.
        marks = sorted(int(n[1:].split(" ", 1)[0]) for n in names if n.startswith("#"))
        assert marks == list(range(len(r.events))), r.id
    assert drawn >= 5, "the core profile's traces are drawn"


def test_a_lease_bar_runs_from_its_grant_to_its_release(bundle):
    report, info = load_report(bundle)
    r = next(r for r in report.results if any(e["event"] == "release_lease" for e in r.events))
    svg = svg_of(sections(report_html(report, info))[r.id])
    reads = [n for n in titles(svg) if n.startswith("read lease of")]
    released = sum(e["event"] == "release_lease" for e in r.events)
    assert sum(n.endswith(", release_lease") for n in reads) == released >= 1


def test_a_rejected_trace_shows_the_event_before_it_and_the_diff_escaped(bundle):
    report, info = load_report(bundle)
    r = next(r for r in report.results if any(e["event"] == "grant_read_lease" for e in r.events))
    events = [dict(e) for e in r.events]
    bad = next(i for i, e in enumerate(events) if e["event"] == "grant_read_lease")
    events[bad]["gen"] += 7  # a generation never committed: no spec state can grant it
    events[bad][VENDOR_FIELD] = VENDOR_VALUE  # a vendor's field, name and value both markup
    verdict = validate_events(events, report.params["lease_term_ms"], report.params["skew_ms"])
    assert verdict["status"] == "REJECTED" and verdict["event_index"] == bad, verdict
    r.status, r.message, r.verdict, r.events = "FAIL", f"trace REJECTED at event {bad}", verdict, events
    page = report_html(report, info)

    assert_self_contained(page)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "alert(2)" in page
    s = sections(page)[r.id]
    assert ">REJECTED</span>" in s
    assert f"Rejected at event {bad} of {len(events)}" in s
    table = s[s.index("<table><tr><th>#</th><th>ms</th>"):]
    table = table[: table.index("</table>")]
    assert table.count("<tr") - 1 == min(bad, 5) + 1  # the rejected event and those before it
    assert f"<tr class='rej'><td>{bad}</td>" in table
    rejected_row = table[table.index("<tr class='rej'>"):]
    assert "t_wall_ns</span>=" in rejected_row and table.count("t_wall_ns</span>=") == 1  # its clocks only
    assert "&lt;script&gt;alert(1)&lt;/script&gt;</span>=" in table
    diff = s[s.index("<summary>Diff"):]
    assert "&quot;needed&quot;" in diff and "&quot;closest&quot;" in diff
    svg = svg_of(s)  # parses: the vendor's markup is text
    assert f"REJECTED: event {bad}" in titles(svg)
    assert any(VENDOR_FIELD in n for n in titles(svg)), "the tooltip shows the field, as text"


def test_a_crash_is_marked_on_the_crashed_nodes_row_and_an_invalidation_on_the_directorys(bundle):
    """The fault injector logs a crash under its own name ("faults"): the mark belongs on the row
    of the node that crashed, and the injector gets no row of its own."""
    report, info = load_report(bundle)
    r = next(r for r in report.results if {"n2", "directory"} <= {e["node"] for e in r.events})
    last = r.events[-1]
    crash = {"node": "faults", "incarnation": 1, "seq": 1, "t_local_ns": 1, "t_wall_ns": last["t_wall_ns"] + 1000,
             "event": "crash", "key": None, "gen": None, "epoch": None, "lease": None, "result": None,
             "crashed": "n2", "lose_disk": False}  # fmt: skip
    invalidate = dict(last, node="directory", seq=10_000, event="invalidate", t_wall_ns=last["t_wall_ns"] + 2000)
    r.events = [*r.events, crash, invalidate]
    svg = svg_of(sections(report_html(report, info))[r.id])
    row_top = {t.text: float(t.get("y")) - 15 for t in svg.iter(f"{SVG_NS}text") if not t.text.endswith(" ms")}
    assert "faults" not in row_top

    def centre_y(title_prefix: str) -> float:
        (shape,) = [el for el in svg.iter() if (el.findtext(f"{SVG_NS}title") or "").startswith(title_prefix)]
        if shape.tag == f"{SVG_NS}path":  # a cross: "M x,y L ..." from its top left corner
            return float(shape.get("d")[1:].split("L")[0].split(",")[1]) + 5
        ys = [float(p.split(",")[1]) for p in shape.get("points").split()]
        return (min(ys) + max(ys)) / 2

    crash_y = centre_y(f"#{len(r.events) - 2} faults: crash")
    assert row_top["n2"] < crash_y < row_top["n2"] + 24
    invalidate_y = centre_y(f"#{len(r.events) - 1} directory: invalidate")
    assert row_top["directory"] < invalidate_y < row_top["directory"] + 24
