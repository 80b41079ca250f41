"""``python -m kvcc.spec.proofs [--bug FLAG ...] [--json FILE] [--refresh-hints]``.

Discharges every obligation and prints a summary (and every counterexample to induction); exits 1
when an obligation is not proved.
"""

from __future__ import annotations

import argparse
import sys
import time

from .encoding import SUPPORTED_BUGS
from .obligations import format_counterexample, prove_all, refresh_hints, results_to_json, summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcc.spec.proofs", description=__doc__)
    ap.add_argument("--bug", action="append", default=[], choices=sorted(SUPPORTED_BUGS),
                    help="switch on a mutant flag (repeatable)")
    ap.add_argument("--invariant", action="append", default=None, help="only this invariant (repeatable)")
    ap.add_argument("--action", action="append", default=None, help="only this action (repeatable)")
    ap.add_argument("--timeout-ms", type=int, default=20_000)
    ap.add_argument("--json", help="write every result as JSON to this file")
    ap.add_argument("--refresh-hints", action="store_true", help="recompute hints.json (unsat cores)")
    args = ap.parse_args(argv)
    if args.refresh_hints:
        cores = refresh_hints()
        print(f"hints: {len(cores)} queries")
        return 0
    started = time.perf_counter()
    results = prove_all(
        bugs=frozenset(args.bug), timeout_ms=args.timeout_ms,
        invariants=tuple(args.invariant) if args.invariant else None,
        actions=tuple(args.action) if args.action else None,
    )
    wall = time.perf_counter() - started
    info = summary(results)
    print(f"{info['proved']}/{info['obligations']} obligations proved ({info['by_frame']} by frame) "
          f"in {wall:.1f}s wall, {info['solver_seconds']:.1f}s in z3")
    for r in results:
        if not r.proved:
            print(f"\nFAILED {r.action} x {r.invariant}: {r.status}")
            print(format_counterexample(r.counterexample))
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(results_to_json(results))
    return 0 if info["proved"] == info["obligations"] else 1


if __name__ == "__main__":
    sys.exit(main())
