"""Benchmark: the model checker's throughput and memory per state (``kvcc bench checker``).

The check runs in a fresh interpreter (``sys.executable``), so its peak resident set is its own:

- ``distinct_states_per_second``: the checker's own figure (distinct states / search seconds).
- ``bytes_per_state``: peak RSS growth over the search (``ru_maxrss`` after the run, minus a
  baseline taken after the imports and the model's construction) divided by distinct states. It
  includes the frontier queues, the interpreter's allocator slack and everything else the search
  touches: the figure that decides how big a model fits in memory.
- ``visited_set_bytes_per_state``: the deterministic part, ``sys.getsizeof`` of the visited set
  plus its fingerprints, per state. It does not depend on the allocator or on timing.

A benchmark reports; it does not fail on a missed target. The exit code is 1 only when the check
itself fails (a property violated, or the measuring process dying).

The child streams one JSON object per line on stdout: ``{"event": "progress", ...}`` per
breadth-first level, then ``{"event": "result", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

TARGETS = {"distinct_states_per_second": 100_000, "bytes_per_state": 200}
# Below this much growth the peak RSS mostly reflects heap slack left by the imports: too small a
# run to say anything about memory per state.
RELIABLE_RSS_GROWTH = 8 * 1024 * 1024
DEFAULT_CONFIG = "medium"
# One checker worker per core of this project's machines.
DEFAULT_WORKERS = max(1, min(2, os.cpu_count() or 1))


# ------------------------------------------------------------------------------------ child side


def _maxrss_bytes() -> int:
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def child_main(config: str, max_states: int | None, workers: int = 1) -> None:
    """Runs in the fresh interpreter: build the model, take the baseline, search, measure."""
    import gc

    from kvcc.spec.checker import Checker
    from kvcc.spec.config import get_config
    from kvcc.spec.model import Model

    cfg = get_config(config)
    model = Model(cfg, ())
    frontier_peak = 0

    def progress(depth: int, distinct: int, frontier: int) -> None:
        nonlocal frontier_peak
        frontier_peak = max(frontier_peak, frontier)
        _emit({"event": "progress", "depth": depth, "distinct": distinct, "frontier": frontier})

    checker = Checker(model, max_states=max_states, progress=progress)
    gc.collect()
    baseline = _maxrss_bytes()
    result = checker.run(workers=workers)
    res = result.to_json()
    v = res.get("violation")
    _emit({
        "event": "result",
        "config": config,
        "workers": workers,
        "ok": res["ok"],
        "truncated": res["truncated"],
        "violation": None if v is None else {"property": v["property"], "kind": v["kind"], "steps": v["steps"]},
        "distinct_states": res["distinct_states"],
        "generated_states": res["generated_states"],
        "depth": res["depth"],
        "seconds": result.seconds,
        # Each forked worker starts from this process's pages, so its peak counts the baseline.
        "baseline_rss_bytes": baseline * workers,
        "peak_rss_bytes": result.peak_rss_bytes,
        "visited_set_bytes": result.visited_bytes,
        "visited_set_measure": "measured",
        "frontier_peak": frontier_peak,
    })


# ----------------------------------------------------------------------------------- parent side


class BenchError(Exception):
    pass


def measure(config: str = DEFAULT_CONFIG, max_states: int | None = None, on_progress=None,
            workers: int = DEFAULT_WORKERS) -> dict[str, Any]:
    """Run the check in a fresh interpreter and return the benchmark's figures."""
    code = "import sys; from kvcc.bench.checker import child_main; " \
           "child_main(sys.argv[1], int(sys.argv[2]) if sys.argv[2] else None, int(sys.argv[3]))"
    cmd = [sys.executable, "-c", code, config, "" if max_states is None else str(max_states), str(workers)]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")})
    final: dict[str, Any] | None = None
    assert proc.stdout is not None and proc.stderr is not None
    try:
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("event") == "progress" and on_progress is not None:
                on_progress(event["depth"], event["distinct"], event["frontier"])
            elif event.get("event") == "result":
                final = event
        stderr = proc.stderr.read()
        rc = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if rc != 0 or final is None:
        tail = "\n".join(stderr.strip().splitlines()[-15:])
        raise BenchError(f"the measuring process failed (exit {rc}):\n{tail}")

    n = final["distinct_states"]
    seconds = final["seconds"]
    growth = max(final["peak_rss_bytes"] - final["baseline_rss_bytes"], 0)
    rate = n / seconds if seconds > 0 else None
    bps = growth / n if n else None
    out = {
        "config": config,
        "workers": final["workers"],
        "distinct_states": n,
        "generated_states": final["generated_states"],
        "depth": final["depth"],
        "seconds": round(seconds, 3),
        "distinct_states_per_second": None if rate is None else round(rate, 1),
        "bytes_per_state": None if bps is None else round(bps, 1),
        "peak_rss_bytes": final["peak_rss_bytes"],
        "baseline_rss_bytes": final["baseline_rss_bytes"],
        "rss_growth_bytes": growth,
        "rss_growth_reliable": growth >= RELIABLE_RSS_GROWTH,
        "visited_set_bytes": final["visited_set_bytes"],
        "visited_set_bytes_per_state": round(final["visited_set_bytes"] / n, 1) if n else None,
        "visited_set_measure": final["visited_set_measure"],
        "frontier_peak": final["frontier_peak"],
        "max_states": max_states,
        "truncated": final["truncated"],
        "check_ok": final["ok"],
        "violation": final["violation"],
        "wall_seconds": round(time.perf_counter() - started, 3),
        "python": sys.version.split()[0],
        "targets": dict(TARGETS),
    }
    out["met"] = {
        "distinct_states_per_second": rate is not None and rate >= TARGETS["distinct_states_per_second"],
        "bytes_per_state": bps is not None and bps <= TARGETS["bytes_per_state"],
    }
    return out


def render(console, r: dict[str, Any]) -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from kvcc.report import fmt_bytes, fmt_int, fmt_rate, fmt_seconds

    def met(ok: bool) -> Text:
        return Text("met", style="green") if ok else Text("missed", style="bold yellow")

    title = f"Checker benchmark: {r['config']}, {r['workers']} worker(s)"
    if r["truncated"]:
        title += f" (capped at {fmt_int(r['max_states'])} states)"
    t = Table(title=title, box=box.SIMPLE_HEAVY, title_justify="left")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_column("target", justify="right")
    t.add_column("")
    t.add_row("distinct states/s", fmt_rate(r["distinct_states_per_second"]),
              f">= {TARGETS['distinct_states_per_second']:,}", met(r["met"]["distinct_states_per_second"]))
    bps = r["bytes_per_state"]
    t.add_row("bytes/state (peak RSS growth)", "-" if bps is None else f"{bps:,.1f}",
              f"<= {TARGETS['bytes_per_state']:,}", met(r["met"]["bytes_per_state"]))
    vps = r["visited_set_bytes_per_state"]
    t.add_row(f"bytes/state (visited set, {r['visited_set_measure']})", "-" if vps is None else f"{vps:,.1f}", "", "")
    t.add_row("distinct states", fmt_int(r["distinct_states"]), "", "")
    t.add_row("generated states", fmt_int(r["generated_states"]), "", "")
    t.add_row("depth", fmt_int(r["depth"]), "", "")
    t.add_row("peak frontier", fmt_int(r["frontier_peak"]), "", "")
    t.add_row("search seconds", fmt_seconds(r["seconds"]), "", "")
    t.add_row("peak RSS", fmt_bytes(r["peak_rss_bytes"]), "", "")
    t.add_row("RSS growth", fmt_bytes(r["rss_growth_bytes"]), "", "")
    console.print(t)
    if not r["rss_growth_reliable"]:
        console.print(Text(f"note: the RSS grew by only {fmt_bytes(r['rss_growth_bytes'])}; too small a run to "
                           "measure bytes per state reliably (the visited-set figure still holds)", style="yellow"))
    if r["violation"]:
        v = r["violation"]
        console.print(Text(f"the check failed: {v['property']} ({v['kind']}) violated in {v['steps']} steps",
                           style="bold red"))
    elif not r["check_ok"] and not r["truncated"]:
        console.print(Text("note: the check did not pass (an unreached sometimes); see kvcc check", style="yellow"))


# ------------------------------------------------------------------------------------ entry points


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvcc.console import positive_int

    parser.add_argument("--config", default=DEFAULT_CONFIG, metavar="NAME",
                        help=f"model configuration (default {DEFAULT_CONFIG})")
    parser.add_argument("--max-states", type=positive_int, metavar="N", help="stop after N distinct states")
    parser.add_argument("--workers", type=positive_int, default=DEFAULT_WORKERS, metavar="N",
                        help=f"checker worker processes (default {DEFAULT_WORKERS})")
    parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")


def run(args: argparse.Namespace) -> int:
    """``kvcc bench checker``: measure, print, exit 1 only if the check itself failed."""
    from kvcc.console import print_json, stderr_console, stdout_console
    from kvcc.report import CheckProgress

    err = stderr_console()
    try:
        if args.json:
            r = measure(args.config, args.max_states, workers=args.workers)
        else:
            with CheckProgress(err, f"{args.config} (benchmark)") as progress:
                r = measure(args.config, args.max_states, on_progress=progress, workers=args.workers)
    except BenchError as exc:
        print(f"kvcc bench checker: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print_json(r)
    else:
        render(stdout_console(), r)
    return 1 if r["violation"] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcc.bench.checker", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
