"""The report bundle: what a certification run leaves behind, and anyone can re-verify.

Layout of ``DIR``::

    run_info.json     suite version, git commit and dirty flag of the harness, SHA-256 of every
                      harness file, adapter and system versions, seed, parameters, start/end
    report.json       every test's status, message, verdict and audit counts
    junit.xml         one <testcase> per test id (classname = profile)
    report.html       a self-contained page that opens from disk: per test, the spec properties
                      it checks, its verdict (a rejected event with the events before it, the
                      reason and the diff), its audit counters and a timeline of its trace
                      (``report_page``)
    traces/ID.ndjson  the test's protocol events, one JSON object per line
    traces/ID.history.json  the operations the suite performed and what came back
    MANIFEST.sha256   "<sha256>  <path>" for every file above, sorted by path

Files are written, flushed and fsynced, the manifest last: a bundle with a manifest is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

from .report_page import report_html
from .runner import Report

MANIFEST = "MANIFEST.sha256"
HARNESS_PARTS = ("conformance", "spec")  # the files whose hashes identify the harness


def _package_root() -> Path:
    return Path(__file__).resolve().parent


def harness_files() -> dict[str, str]:
    """SHA-256 of every Python file of the suite and the spec it validates against, by
    ``kvcc.<part>/<file>`` (installed or source layout alike)."""
    out: dict[str, str] = {}
    import kvcc.spec

    roots = {"conformance": _package_root(), "spec": Path(kvcc.spec.__file__).resolve().parent}
    for part in HARNESS_PARTS:
        for path in sorted(roots[part].rglob("*.py")):
            rel = path.relative_to(roots[part]).as_posix()
            out[f"kvcc.{part}/{rel}"] = sha256_file(path)
    return out


def git_state() -> dict[str, Any]:
    """Commit and dirty flag of the checkout the harness runs from (None outside a checkout)."""
    root = _package_root().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if commit.returncode != 0:
            return {"commit": None, "dirty": None}
        status = subprocess.run(["git", "status", "--porcelain", "--", *HARNESS_PARTS], cwd=root,
                                capture_output=True, text=True, timeout=10)  # fmt: skip
        return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def run_info(report: Report) -> dict[str, Any]:
    return {
        "suite_version": report.suite_version,
        "git": git_state(),
        "harness_sha256": harness_files(),
        "adapter": report.adapter,
        "capabilities": report.capabilities,
        "versions": report.versions,
        "system": {"python": sys.version.split()[0], "platform": platform.platform(), "machine": platform.machine()},
        "seed": report.seed,
        "profiles": report.profiles,
        "params": report.params,
        "started_at": _iso(report.started_at),
        "finished_at": _iso(report.finished_at),
    }


def junit_xml(report: Report) -> str:
    counts = report.counts()
    suite = ET.Element("testsuite", name=f"kvcc-conformance-{report.adapter}", tests=str(len(report.results)),
                       failures=str(counts["FAIL"]), errors=str(counts["ERROR"]),
                       skipped=str(counts["SKIP"] + counts["NOT_APPLICABLE"]),
                       time=f"{sum(r.duration_s for r in report.results):.3f}")  # fmt: skip
    for r in report.results:
        case = ET.SubElement(suite, "testcase", classname=r.profile, name=r.id, time=f"{r.duration_s:.3f}")
        if r.status == "FAIL":
            ET.SubElement(case, "failure", message=r.message[:500]).text = r.message
        elif r.status == "ERROR":
            ET.SubElement(case, "error", message=r.message[:500]).text = r.message
        elif r.status in ("SKIP", "NOT_APPLICABLE"):
            ET.SubElement(case, "skipped", message=f"{r.status}: {r.message}"[:500])
        props = ET.SubElement(case, "properties")
        ET.SubElement(props, "property", name="verdict", value=str(r.verdict.get("status")))
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_bundle(report: Report, out: Path) -> Path:
    """Write the bundle of ``report`` into ``out`` (created; must be empty or absent)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    info = run_info(report)
    for r in report.results:
        if r.status in ("SKIP", "NOT_APPLICABLE") or r.id.endswith("-900"):
            continue
        _write(out / "traces" / f"{r.id}.ndjson", "".join(json.dumps(ev, separators=(",", ":")) + "\n" for ev in r.events))
        _write(out / "traces" / f"{r.id}.history.json", json.dumps(r.history, indent=1, default=str) + "\n")
    _write(out / "run_info.json", json.dumps(info, indent=2, sort_keys=True) + "\n")
    _write(out / "report.json", json.dumps(report.to_json(), indent=2, default=str) + "\n")
    _write(out / "junit.xml", junit_xml(report))
    _write(out / "report.html", report_html(report, info))
    _write(out / MANIFEST, manifest_text(out))
    return out


def manifest_text(root: Path) -> str:
    lines = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST):
        lines.append(f"{sha256_file(path)}  {path.relative_to(root).as_posix()}")
    return "\n".join(lines) + "\n"
