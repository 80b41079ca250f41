"""Crafted cases of the trace validator's corpus: what a redesign of its time handling could
get wrong, each a small trace of the reference directory core driven by simulated processes
(``tests/test_validate.py``'s ``Run``), with the verdict of the validator and of the old one.

    python tests/corpus/validate/make_crafted.py

(from the repository root). Each case below says what it pins: a directory restart within
epsilon (its new incarnation's events stamped before its old one's last), two events whose order
within epsilon decides the verdict, a failure shared by two keys' projections, a write placed on
another node's tier. Cases are added to ``manifest.json`` as ``make_corpus.py`` adds its own
(``expected`` is the validator's verdict; where the old validator differs the case is listed in
``disagreements`` with ``why`` to fill in); a case already there is left as it is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

import test_validate as T  # noqa: E402  (tests/, for its Run and scenarios)

from kvcc.conformance import validate, validate_reference  # noqa: E402
from kvcc.reference import wire  # noqa: E402
from kvcc.reference.events import EventLog  # noqa: E402
from kvcc.spec.keys import chain_keys  # noqa: E402

CASES: dict[str, tuple[str, list[dict]]] = {}


def dump(name: str, events: list[dict], what: str) -> None:
    CASES[name] = (what, events)


def restarted_directory_that_kept_the_commit(gap_ms: int) -> list[dict]:
    """The directory commits A0, restarts ``gap_ms`` later (its new incarnation's clock may read
    behind) and grants a read of A0 (it kept the record, as it must); merged by wall time."""
    run = T.Run()
    g = run.write(T.A0)
    run.now_ms += gap_ms
    clock = lambda: run.now_ms * 1_000_000  # noqa: E731
    run.logs["dir"] = EventLog(run.buf, "dir", 2, monotonic_ns=clock, wall_ns=clock)
    run.log("dir", "restart_directory", records=1, grace_ms=T.TERM_MS + 2 * T.EPS_MS)
    run.now_ms += 1
    lease = dict(key=T.A0, lease=g.lease + 1, gen=g.gen, location="pool")
    run.log("r1", "acquire", key=T.A0)
    run.log("dir", "grant_read_lease", epoch=g.epoch, holder="r1", result="ok", **lease)
    run.log("r1", "trust_read_lease", **lease)
    run.log("r1", "read", result="ok", **lease)
    return sorted(run.events(), key=lambda e: e["t_wall_ns"])


def swapped(shift_ms: int) -> list[dict]:
    """A read lease whose holder's acquire is listed after the directory's grant, the holder's
    log ``shift_ms`` later than the directory's."""
    run = T.Run()
    run.write(T.A0)
    run.now_ms += 5
    run.lease("r1", T.A0)
    events = run.events()
    a, g = T.index_of(events, "acquire"), T.index_of(events, "grant_read_lease")
    events[a], events[g] = events[g], events[a]
    for e in events[g:]:
        if e["node"] == "r1":
            e["t_wall_ns"] += shift_ms * 1_000_000
            e["t_local_ns"] += shift_ms * 1_000_000
    return events


B0 = chain_keys(T._NS, [7, 8])[0]


def crash_across_keys() -> list[dict]:
    """r1 holds a lease on A0; a fault injector logs r1's crash, the directory its rejoin, and
    r1's next incarnation, its clock an epsilon behind the injector's, reads B0. r1's last read
    of A0 is listed before the crash. The crash and the rejoin are in both keys' projections,
    which must explain them at one tick."""
    run = T.Run()
    run.write(T.A0)
    run.write(B0)
    run.now_ms += 5
    run.req += 1
    run.log("r1", "acquire", key=T.A0)
    grant, _ = run.send(wire.Acquire("r1", T.A0, T._NS.digest(), run.req))
    run.log("r1", "trust_read_lease", key=T.A0, lease=grant.lease, gen=grant.gen, location=grant.location)
    run.now_ms += 30
    crash_at = run.now_ms
    clock = lambda: run.now_ms * 1_000_000  # noqa: E731
    faults = EventLog(run.buf, "faults", 1, monotonic_ns=clock, wall_ns=clock)
    run.log("r1", "read", key=T.A0, lease=grant.lease, gen=grant.gen, location=grant.location, result="ok")
    run.now_ms = crash_at
    faults.emit("crash", crashed="r1")
    run.now_ms = crash_at + 5
    run.log("dir", "restart_node", rejoined="r1", lost=[])
    run.now_ms = crash_at - 10  # the new incarnation's clock reads behind the injector's
    run.logs["r1"] = EventLog(run.buf, "r1", 2, monotonic_ns=clock, wall_ns=clock)
    run.req += 1
    run.log("r1", "acquire", key=B0)
    run.now_ms = crash_at + 6
    grant2, _ = run.send(wire.Acquire("r1", B0, T._NS.digest(), run.req))
    run.log("r1", "trust_read_lease", key=B0, lease=grant2.lease, gen=grant2.gen, location=grant2.location)
    run.log("r1", "read", key=B0, lease=grant2.lease, gen=grant2.gen, location=grant2.location, result="ok")
    return run.events()


def write_on_another_node() -> list[dict]:
    """The directory grants writer w a write to r1's tier (as the reference server's rendezvous
    placement may); the spec sends a writer only to its own node's tiers or the shared pool."""
    run = T.Run()
    run.write(T.A0)
    run.now_ms += 5
    key, fields = B0, dict(key=B0, lease=2, gen=0, epoch=1)
    run.log("w", "begin_write", key=key)
    run.log("dir", "grant_write_lease", writer="w", location="r1/dram", parent=None, namespace=T._NS.digest().hex(),
            result="ok", **fields)  # fmt: skip
    run.log("w", "start_writing", location="r1/dram", **fields)
    run.log("r1", "store_bytes", location="r1/dram", writer="w", result="ok", **fields)
    run.log("dir", "commit_write", writer="w", result="ok", **fields)
    run.log("r1", "acquire", key=T.A0)  # r1 is a node (its tier is not the shared pool)
    return run.events()


dump("crafted-restart-within-eps", restarted_directory_that_kept_the_commit(-5),
     "a directory restart within epsilon, its new incarnation stamped 5 ms before its old one's last event")
dump("crafted-restart-within-eps.forgot_commit", T._restarted_directory_that_forgot_the_commit(gap_ms=-5),
     "the same, the new incarnation refusing a read of the block its old one committed (it lost a durable record)")
dump("crafted-restart-beyond-eps.forgot_commit", T._restarted_directory_that_forgot_the_commit(gap_ms=200),
     "the same refusal, the restart 200 ms after the commit")
dump("crafted-order-within-eps", swapped(0),
     "an acquire listed after the grant answering it, both stamped alike: the order within epsilon is the search's")
dump("crafted-order-beyond-eps", swapped(3 * T.EPS_MS),
     "the same, the holder's log 3 epsilon later: the grant cannot precede its acquire")
dump("crafted-crash-across-keys", crash_across_keys(),
     "a node crash and rejoin in two keys' projections, the node's next incarnation stamped before the crash")
dump("crafted-write-on-another-node", write_on_another_node(),
     "a write granted on another node's tier (outside the spec's placement)")  # fmt: skip


def verdict(module, events: list[dict]) -> dict:
    v = module.validate_trace(events, module.TraceParams(T.TERM_MS, T.EPS_MS))
    return {"status": v.status, "code": v.code, "event_index": v.event_index}


def main() -> int:
    manifest = json.loads((HERE / "manifest.json").read_text())
    known = {c["file"] for c in manifest["cases"]}
    disagreements = manifest.setdefault("disagreements", [])
    for name, (what, events) in CASES.items():
        file = f"{name}.ndjson"
        if file in known:
            continue
        (HERE / file).write_text("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events))
        new, old = verdict(validate, events), verdict(validate_reference, events)
        manifest["cases"].append({"file": file, "lease_term_ms": T.TERM_MS, "skew_ms": T.EPS_MS,
                                  "origin": f"crafted (make_crafted.py): {what}", "validator": new, "reference": old,
                                  "expected": new})  # fmt: skip
        if new != old:
            disagreements.append({"file": file, "validator": new, "reference": old, "why": "TODO"})
        print(file, new, old)
    (HERE / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
