"""``kvcc certify verify DIR``: re-check a report bundle without trusting its author.

1. Every file is listed in ``MANIFEST.sha256`` with its SHA-256, and nothing else is there.
2. ``run_info.json`` and ``report.json`` agree (suite version, adapter, seed, parameters) and
   the run had trace validation on.
3. Every test's trace is validated again, offline, against the spec with the run's lease term
   and epsilon: it must not be REJECTED, and a verdict recorded as ACCEPTED must be ACCEPTED
   again. A required test (other than an audit) must have its trace file, non-empty, recorded
   ACCEPTED and re-validated ACCEPTED: a missing, empty or undecided trace certifies nothing.
4. Every required test of every claimed profile is present and PASS, and every claimed
   profile was run.

``verify_bundle(dir) -> list[str]``: the problems found, empty when the bundle verifies.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import catalogue
from .bundle import MANIFEST, sha256_file
from .runner import PASS, validate_events


def _load_json(path: Path, problems: list[str]) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        problems.append(f"{path.name}: unreadable ({e})")
        return None


def verify_bundle(root: str | Path, *, revalidate: bool = True) -> list[str]:
    root = Path(root)
    problems: list[str] = []
    manifest = root / MANIFEST
    if not manifest.is_file():
        return [f"{MANIFEST} missing"]
    listed: dict[str, str] = {}
    for n, line in enumerate(manifest.read_text(encoding="utf-8").splitlines(), 1):
        digest, sep, rel = line.partition("  ")
        if not sep or len(digest) != 64 or not rel or rel.startswith("/") or ".." in Path(rel).parts:
            problems.append(f"{MANIFEST} line {n}: malformed")
            continue
        listed[rel] = digest
    present = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST}
    for rel in sorted(present - set(listed)):
        problems.append(f"{rel}: not in the manifest")
    for rel, digest in sorted(listed.items()):
        path = root / rel
        if not path.is_file():
            problems.append(f"{rel}: listed but missing")
        elif sha256_file(path) != digest:
            problems.append(f"{rel}: SHA-256 differs from the manifest")
    info = _load_json(root / "run_info.json", problems)
    report = _load_json(root / "report.json", problems)
    if not isinstance(info, dict) or not isinstance(report, dict):
        return problems + ["run_info.json or report.json is not an object"]
    for name in ("suite_version", "adapter", "seed", "params"):
        if info.get(name) != report.get(name):
            problems.append(f"run_info.json and report.json disagree on {name}")
    if report.get("suite_version") != catalogue.SUITE_VERSION:
        problems.append(f"suite version {report.get('suite_version')!r} is not this verifier's {catalogue.SUITE_VERSION}")
    params = report.get("params") or {}
    if not params.get("validate", False):
        problems.append("the run had trace validation off")
    results = {r.get("id"): r for r in report.get("results", []) if isinstance(r, dict)}
    claimed = [p for p in report.get("profiles", []) if p in (report.get("capabilities") or {}).get("profiles", [])]
    if not claimed:
        problems.append("no claimed profile was run")
    required = catalogue.required_ids(claimed, (report.get("capabilities") or {}).get("faults", ()))
    must_trace = {tid for tid in required if not catalogue.BY_ID[tid].audit}
    for tid, r in sorted(results.items()):
        if not isinstance(tid, str) or tid not in catalogue.BY_ID:
            problems.append(f"{tid!r}: not a test of this suite")
            continue
        trace = root / "traces" / f"{tid}.ndjson"
        recorded = (r.get("verdict") or {}).get("status")
        if tid in must_trace and recorded != "ACCEPTED":
            problems.append(f"{tid}: required, trace recorded {recorded}, not ACCEPTED")
        if not trace.is_file():
            if tid in must_trace:
                problems.append(f"{tid}: required, its trace file traces/{tid}.ndjson is missing")
            continue
        try:
            events = [json.loads(line) for line in trace.read_text(encoding="utf-8").splitlines() if line.strip()]
        except ValueError as e:
            problems.append(f"{tid}: trace is not NDJSON ({e})")
            continue
        if not events:
            if tid in must_trace:
                problems.append(f"{tid}: required, its trace is empty")
            continue
        if not (revalidate and params.get("validate", False)):
            continue
        again = validate_events(events, int(params["lease_term_ms"]), int(params["skew_ms"]))
        if again["status"] == "REJECTED":
            problems.append(f"{tid}: trace REJECTED at event {again['event_index']}: {again['reason']}")
        elif (recorded == "ACCEPTED" or tid in must_trace) and again["status"] != "ACCEPTED":
            problems.append(f"{tid}: trace recorded {recorded}, re-validated {again['status']}: {again['reason']}")
    for tid in sorted(required):
        r = results.get(tid)
        if r is None:
            problems.append(f"{tid}: required for {catalogue.BY_ID[tid].profile} but missing")
        elif r.get("status") != PASS:
            problems.append(f"{tid}: required, status {r.get('status')}")
    return problems
