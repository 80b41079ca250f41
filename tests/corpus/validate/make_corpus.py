"""Build the trace validator's corpus: traces of real runs, and mutations of them, each with the
verdict of the validator (``conformance.validate``) and of the one it replaced
(``conformance.validate_reference``).

    python tests/corpus/validate/make_corpus.py BUNDLE [BUNDLE ...]

Each BUNDLE is a report bundle of ``kvcc conform ... --no-validate`` (its ``traces/*.ndjson`` and
``run_info.json``). Every trace of at most ``MAX_EVENTS`` events is copied here as an ACCEPTED
case; then each mutation below that applies to it makes a case of its own:

- ``read_after_ack``: a holder reads under a lease right after it acknowledged its revocation
  (protocol property 7);
- ``lease_id_reused``: the directory grants a read lease under an id it granted before (protocol property 8);
- ``commit_after_fencing``: the directory commits a write whose bytes were fenced (or one it
  rejected as stale) (protocol property 2);
- ``time_warp``: one holder's events from a read on happen a lease term and three epsilons later
  than logged, beyond the clock bound (its read outlives its lease).

``manifest.json`` records per case the file, the lease term and epsilon, where it came from, the
verdict of each validator (status, code, event index) and ``expected``: the verdict both give
(a case where they differ is listed in ``disagreements`` with the reason, and kept only once
it is understood). ``tests/test_validate.py`` checks the validator against ``expected`` on every
case, and (marked slow) re-runs the old validator.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAX_EVENTS = 600  # the old validator takes minutes beyond a few hundred events


def resequence(events: list[dict]) -> list[dict]:
    seq: dict[tuple, int] = {}
    last: dict[tuple, int] = {}
    out = []
    for e in events:
        e = dict(e)
        log = (e["node"], e["incarnation"])
        seq[log] = e["seq"] = seq.get(log, 0) + 1
        e["t_local_ns"] = last[log] = max(e["t_local_ns"], last.get(log, -1) + 1)
        out.append(e)
    return out


def read_after_ack(events: list[dict]) -> list[dict] | None:
    reads: dict[tuple, dict] = {}
    for i, e in enumerate(events):
        if e["event"] == "read":
            reads[(e["node"], e["key"], e["lease"])] = e
        if e["event"] == "drop_and_ack" and (e["node"], e["key"], e["lease"]) in reads:
            read = dict(reads[(e["node"], e["key"], e["lease"])], t_wall_ns=e["t_wall_ns"], t_local_ns=e["t_local_ns"])
            return resequence(events[: i + 1] + [read] + events[i + 1 :])
    return None


def lease_id_reused(events: list[dict]) -> list[dict] | None:
    granted = [e["lease"] for e in events if e["event"] in ("grant_read_lease", "grant_write_lease")]
    for i, e in enumerate(events):
        if e["event"] == "grant_read_lease" and granted and e["lease"] != granted[0]:
            out = [dict(x) for x in events]
            out[i]["lease"] = granted[0]
            return out
    return None


def commit_after_fencing(events: list[dict]) -> list[dict] | None:
    for i, e in enumerate(events):
        if e["event"] == "fence_stale_write":
            d = next((x for x in events if x["event"] == "grant_write_lease" and x["lease"] == e["lease"]), None)
            if d is None:
                continue
            commit = {k: v for k, v in d.items() if k in ("node", "incarnation", "seq", "key", "gen", "epoch", "lease", "writer")}
            commit.update(event="commit_write", result="ok", t_wall_ns=e["t_wall_ns"], t_local_ns=e["t_local_ns"])
            dir_events = [x for x in events[: i + 1] if x["node"] == d["node"] and x["incarnation"] == d["incarnation"]]
            commit["t_local_ns"] = max(commit["t_local_ns"], dir_events[-1]["t_local_ns"])
            return resequence(events[: i + 1] + [commit] + events[i + 1 :])
    for i, e in enumerate(events):
        if e["event"] == "reject_stale_commit" and e.get("writer") is not None and e.get("epoch") is not None:
            out = [dict(x) for x in events]
            out[i].update(event="commit_write", result="ok")
            if out[i].get("gen") is None:
                continue
            return out
    return None


def time_warp(events: list[dict], lease_term_ms: int, skew_ms: int) -> list[dict] | None:
    reads = [i for i, e in enumerate(events) if e["event"] == "read"]
    if not reads:
        return None
    i = reads[len(reads) // 2]
    log = (events[i]["node"], events[i]["incarnation"])
    shift = (lease_term_ms + 3 * skew_ms) * 1_000_000
    out = []
    for n, e in enumerate(events):
        e = dict(e)
        if n >= i and (e["node"], e["incarnation"]) == log:
            e["t_wall_ns"] += shift
            e["t_local_ns"] += shift
        out.append(e)
    return out


def verdict(module, events: list[dict], term: int, eps: int) -> dict:
    v = module.validate_trace(events, module.TraceParams(term, eps))
    return {"status": v.status, "code": v.code, "event_index": v.event_index}


def main(argv: list[str]) -> int:
    from kvcc.conformance import validate, validate_reference

    manifest = json.loads((HERE / "manifest.json").read_text()) if (HERE / "manifest.json").exists() else {"cases": []}
    known = {c["file"] for c in manifest["cases"]}
    disagreements = manifest.setdefault("disagreements", [])
    for bundle in map(Path, argv):
        info = json.loads((bundle / "run_info.json").read_text())
        term, eps = info["params"]["lease_term_ms"], info["params"]["skew_ms"]
        origin = f"kvcc conform --adapter {info['adapter']} --seed {info['seed']}"
        for path in sorted((bundle / "traces").glob("*.ndjson")):
            events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if not events or len(events) > MAX_EVENTS:
                continue
            stem = f"{info['adapter']}-{path.stem}"
            cases = [("", events, origin)]
            for name, make in (("read_after_ack", read_after_ack), ("lease_id_reused", lease_id_reused),
                               ("commit_after_fencing", commit_after_fencing),
                               ("time_warp", lambda ev: time_warp(ev, term, eps))):  # fmt: skip
                mutated = make(events)
                if mutated is not None:
                    cases.append((f".{name}", mutated, f"{origin}, mutated: {name}"))
            for suffix, evs, where in cases:
                file = f"{stem}{suffix}.ndjson"
                if file in known:
                    continue
                new, old = verdict(validate, evs, term, eps), verdict(validate_reference, evs, term, eps)
                print(file, new, old, flush=True)
                (HERE / file).write_text("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in evs))
                case = {"file": file, "lease_term_ms": term, "skew_ms": eps, "origin": where,
                        "validator": new, "reference": old, "expected": new}  # fmt: skip
                if new != old:
                    disagreements.append({"file": file, "validator": new, "reference": old, "why": "TODO"})
                manifest["cases"].append(case)
                known.add(file)
    (HERE / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
