"""Benchmark: the trace validator's throughput and memory (``kvcc bench validator``).

What is measured
----------------
``conformance.validate.validate_file`` on two traces, each in a fresh interpreter
(``sys.executable``) so that its peak resident set is its own:

- **load**: the load profile's trace of a real run (the reference adapter's processes on
  loopback, ``run_conformance(..., profiles=["load"], validate=False)``), or ``--trace FILE``.
- **generated**: at least ``--events`` events (default 1,000,000) made from the load trace by
  ``replicate``: copy after copy of its pattern, each later in time than the one before by the
  trace's span plus a lease term and four epsilons (every timer of the copy before has run out),
  with fresh keys and namespaces, lease ids moved past the copy before's, and each process's
  ``seq`` and clocks continuing. A spec behaviour repeated on fresh keys is a spec behaviour, so
  the copy must be ACCEPTED (reported as ``verdict``).
- **mutated**: the same generated trace with one copy (``MUTATED_COPY``) carrying one mutation,
  a read under a lease its holder has just released (``mutate_read_after_release``): it must be
  REJECTED at that read. The validator stops once no key left can be rejected earlier.

- **load as source**: the load trace again with ``KVCC_ACCEL=0``: the validator's modules as Python
  source instead of their compiled copies (``kvcc accel``, which ``scripts/setup.sh`` builds),
  the baseline of ``speedup_of_compiled``. Each figure says which modules ran ``compiled``.

Each figure: ``events``, ``seconds`` (wall), ``cpu_seconds`` (the child's own user + system
time), ``events_per_second`` (events / wall seconds), ``events_per_cpu_second`` (events / CPU
seconds: on a shared machine the figure least moved by what else runs) and ``peak_rss_bytes``
(``ru_maxrss`` of the child). Target (issue 9): ``TARGET_EVENTS_PER_S`` events per second on both
traces. A benchmark reports; it does not fail on a missed target. The exit code is 1 when
measuring fails or when a verdict is not the one expected (the generated trace not ACCEPTED, the
mutated one not REJECTED).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

from kvcc.accel import MODULES

TARGET_EVENTS_PER_S = 20_000
DEFAULT_EVENTS = 1_000_000
DEFAULT_SEED = 9
MUTATED_COPY = 1  # the copy that carries the mutation in the mutated trace
LOAD_TEST_ID = "KVCC-LOAD-001"
CHILD_TIMEOUT_S = 3600


class BenchError(Exception):
    """Measuring failed (not a missed target)."""


# ------------------------------------------------------------------------------ making traces


def _renamed(value: str, copy: int) -> str:
    """A fresh 64-hex key (or namespace digest) for ``copy`` of the trace; copy 0 keeps its own."""
    if copy == 0:
        return value
    return hashlib.sha256(f"{value}:{copy}".encode()).hexdigest()


def replicate(base: Sequence[dict], copies: int, out: IO[str], *, lease_term_ms: int, skew_ms: int,
              mutated: Sequence[dict] | None = None, mutated_copy: int | None = None) -> int:
    """Write ``copies`` copies of ``base`` (one merged trace, every process logging one
    incarnation) to ``out``, one after the other in time; copy ``mutated_copy`` is ``mutated``
    instead. The number of events written."""
    if not base:
        raise BenchError("the trace to replicate has no events")
    incarnations: dict[str, set[int]] = {}
    for ev in base:
        incarnations.setdefault(ev["node"], set()).add(ev["incarnation"])
    if any(len(v) > 1 for v in incarnations.values()):
        raise BenchError("replicate needs a trace in which every process logs one incarnation")
    walls = [ev["t_wall_ns"] for ev in base]
    # Each copy starts once every timer of the copy before has run out (a lease term and the
    # clock bound on both sides, twice over).
    period_ns = max(walls) - min(walls) + (lease_term_ms + 4 * skew_ms) * 1_000_000
    lease_step = max([ev["lease"] or 0 for ev in base] + [ev["lease"] or 0 for ev in mutated or ()]) + 1
    seq_offset: dict[str, int] = {}
    written = 0
    for copy in range(copies):
        events = mutated if (copy == mutated_copy and mutated is not None) else base
        shift = copy * period_ns
        seen: dict[str, int] = {}
        for ev in events:
            e = dict(ev)
            node = e["node"]
            e["seq"] = ev["seq"] + seq_offset.get(node, 0)
            seen[node] = max(seen.get(node, 0), ev["seq"])
            e["t_wall_ns"] += shift
            e["t_local_ns"] += shift
            if e["lease"] is not None:
                e["lease"] += copy * lease_step
            for f in ("key", "parent", "namespace"):
                if isinstance(e.get(f), str):
                    e[f] = _renamed(e[f], copy)
            out.write(json.dumps(e, separators=(",", ":")) + "\n")
            written += 1
        for node, n in seen.items():
            seq_offset[node] = seq_offset.get(node, 0) + n
    return written


def mutate_read_after_release(base: Sequence[dict]) -> tuple[list[dict], int]:
    """``base`` with one read inserted right after a ``release`` by the same holder, under the
    lease it released (protocol property 8: an ended lease is never used again); the read's index."""
    events = [dict(ev) for ev in base]
    reads: dict[tuple[str, int], dict] = {}
    for i, ev in enumerate(events):
        if ev["event"] == "read" and ev["lease"] is not None:
            reads[(ev["node"], ev["lease"])] = ev
        if ev["event"] == "release" and (ev["node"], ev["lease"]) in reads and i > len(events) // 3:
            read = dict(reads[(ev["node"], ev["lease"])])
            read.update(seq=ev["seq"] + 1, t_local_ns=ev["t_local_ns"] + 1, t_wall_ns=ev["t_wall_ns"] + 1)
            for later in events[i + 1 :]:
                if later["node"] == ev["node"] and later["incarnation"] == ev["incarnation"]:
                    later["seq"] += 1
                    later["t_local_ns"] = max(later["t_local_ns"], read["t_local_ns"])
            events.insert(i + 1, read)
            return events, i + 1
    raise BenchError("the trace has no release after a read of the same lease to mutate")


def load_trace(seed: int, lease_term_ms: int, skew_ms: int, workdir: Path) -> Path:
    """Run the load profile against the reference adapter (processes on loopback), without
    validation; the path of its NDJSON trace."""
    from kvcc.conformance import registry, runner

    out = workdir / "load-bundle"
    runner.run_conformance(registry.resolve("reference"), profiles=["load"], seed=seed, out=out,
                           lease_term_ms=lease_term_ms, skew_ms=skew_ms, validate=False)  # fmt: skip
    path = out / "traces" / f"{LOAD_TEST_ID}.ndjson"
    if not path.is_file():
        raise BenchError(f"the load run wrote no trace ({path.name} missing)")
    return path


def read_trace(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------------- measuring


def _cpu_seconds() -> float:
    """User + system time of this process and of its children reaped so far (the validator's
    forked workers)."""
    import resource

    return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))


def child_main(trace: str, lease_term_ms: int, skew_ms: int, jobs: int | None = None) -> None:
    """In the fresh interpreter: validate one file, print one JSON object. ``cpu_seconds``
    counts the validator's worker processes too; ``peak_rss_bytes`` is the largest of this
    process and each worker."""
    import resource

    from kvcc.accel import compiled_modules
    from kvcc.conformance.validate import TraceParams, validate_file

    params = TraceParams(lease_term_ms, skew_ms, jobs=jobs)
    started, cpu0 = time.perf_counter(), _cpu_seconds()
    verdict = validate_file(trace, params)
    seconds, cpu = time.perf_counter() - started, _cpu_seconds() - cpu0
    with open(trace, "rb") as f:
        events = sum(1 for line in f if line.strip())
    rss = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    print(json.dumps({
        "events": events, "jobs": jobs, "seconds": seconds, "cpu_seconds": cpu,
        "events_per_second": events / seconds if seconds else None,
        "events_per_cpu_second": events / cpu if cpu else None,
        "peak_rss_bytes": rss if sys.platform == "darwin" else rss * 1024,
        "verdict": verdict.status, "code": verdict.code, "event_index": verdict.event_index,
        "reason": verdict.reason[:500], "frontier_max": verdict.frontier_max, "states_explored": verdict.states_explored,
        "compiled": compiled_modules(),
    }))  # fmt: skip


def _measure_file(path: Path, lease_term_ms: int, skew_ms: int, jobs: int | None = None, source: bool = False) -> dict[str, Any]:
    """One child's figures; ``source``: with the validator's modules as Python source."""
    cmd = [sys.executable, "-m", "kvcc.bench.validator", "--child", str(path),
           "--lease-term-ms", str(lease_term_ms), "--skew-ms", str(skew_ms)]  # fmt: skip
    if jobs is not None:
        cmd += ["--jobs", str(jobs)]
    try:
        env = dict(os.environ, KVCC_ACCEL="0") if source else None
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False, env=env)
    except subprocess.TimeoutExpired as e:
        raise BenchError(f"validating {path.name} took over {CHILD_TIMEOUT_S} s") from e
    if done.returncode != 0 or not done.stdout.strip():
        raise BenchError(f"validating {path.name} failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(trace: Path | None, events: int, seed: int, lease_term_ms: int, skew_ms: int,
            on_step: Any = None, jobs: int | None = None) -> dict[str, Any]:
    """Every figure of the benchmark (see the module docstring)."""
    step = on_step or (lambda text: None)
    with tempfile.TemporaryDirectory(prefix="kvcc-bench-validator-") as tmp:
        work = Path(tmp)
        if trace is None:
            step("running the load profile against the reference adapter")
            trace = load_trace(seed, lease_term_ms, skew_ms, work)
            source = f"reference adapter, load profile, seed {seed}"
        else:
            source = str(trace)
        base = read_trace(trace)
        copies = max(1, -(-events // len(base)))
        step(f"validating the load trace ({len(base)} events)")
        load = _measure_file(trace, lease_term_ms, skew_ms, jobs)
        step("validating it again in one process (the baseline of the workers' speed-up)")
        load_one = _measure_file(trace, lease_term_ms, skew_ms, 1)
        step("validating it again with the validator's modules as Python source (the baseline of the compiled ones)")
        load_source = _measure_file(trace, lease_term_ms, skew_ms, jobs, source=True)
        generated_path = work / "generated.ndjson"
        step(f"writing {copies} copies of it ({copies * len(base)} events)")
        with open(generated_path, "w", encoding="utf-8") as f:
            n = replicate(base, copies, f, lease_term_ms=lease_term_ms, skew_ms=skew_ms)
        step(f"validating the generated trace ({n} events)")
        generated = _measure_file(generated_path, lease_term_ms, skew_ms, jobs)
        mutated_events, at = mutate_read_after_release(base)
        mutated_path = work / "mutated.ndjson"
        with open(mutated_path, "w", encoding="utf-8") as f:
            replicate(base, copies, f, lease_term_ms=lease_term_ms, skew_ms=skew_ms, mutated=mutated_events,
                      mutated_copy=min(MUTATED_COPY, copies - 1))  # fmt: skip
        generated_path.unlink()
        step("validating the mutated copy")
        mutated = _measure_file(mutated_path, lease_term_ms, skew_ms, jobs)
        expected_at = min(MUTATED_COPY, copies - 1) * len(base) + at
    rates = [r["events_per_second"] or 0.0 for r in (load, generated)]
    return {
        "source": source, "lease_term_ms": lease_term_ms, "skew_ms": skew_ms,
        "jobs": jobs, "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load": load, "load_one_process": load_one, "load_as_source": load_source, "generated": dict(generated, copies=copies),
        "speedup_of_workers": load_one["seconds"] / load["seconds"] if load["seconds"] else None,
        "speedup_of_compiled": load_source["seconds"] / load["seconds"] if load["seconds"] else None,
        "mutated": dict(mutated, mutation="read after release", expected_event_index=expected_at),
        "events_per_second": min(rates),
        "events_per_cpu_second": min(r["events_per_cpu_second"] or 0.0 for r in (load, generated)),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in (load, load_one, load_source, generated, mutated)),
        "target_events_per_second": TARGET_EVENTS_PER_S,
        "verdicts_ok": load["verdict"] == "ACCEPTED" and load_source["verdict"] == "ACCEPTED" and generated["verdict"] == "ACCEPTED"
        and mutated["verdict"] == "REJECTED" and mutated["event_index"] == expected_at,
    }  # fmt: skip


def render(console: Any, r: dict[str, Any]) -> None:
    from rich.table import Table

    from kvcc.report import fmt_bytes, fmt_int, fmt_seconds

    t = Table(title=f"trace validator ({r['source']}; term {r['lease_term_ms']} ms, epsilon {r['skew_ms']} ms)")
    for col in ("trace", "events", "verdict", "seconds", "CPU s", "events/s", "events/CPU-s", "peak RSS", "compiled"):
        t.add_column(col, justify="left" if col in ("trace", "verdict") else "right")
    for name in ("load", "load_one_process", "load_as_source", "generated", "mutated"):
        x = r[name]
        verdict = x["verdict"] + (f" at {x['event_index']} ({x['code']})" if x["verdict"] != "ACCEPTED" else "")
        t.add_row(name, fmt_int(x["events"]), verdict, fmt_seconds(x["seconds"]), fmt_seconds(x["cpu_seconds"]),
                  fmt_int(round(x["events_per_second"] or 0)), fmt_int(round(x["events_per_cpu_second"] or 0)),
                  fmt_bytes(x["peak_rss_bytes"]), f"{len(x['compiled'])} of {len(MODULES)}")  # fmt: skip
    console.print(t)
    met = r["events_per_second"] >= r["target_events_per_second"]
    console.print(f"events/s (the lower of load and generated): {fmt_int(round(r['events_per_second']))} "
                  f"(target {fmt_int(r['target_events_per_second'])}: {'met' if met else 'missed'})")  # fmt: skip
    console.print(f"compiled against source on the load trace: {r['speedup_of_compiled']:.2f}x; "
                  f"workers against one process: {r['speedup_of_workers']:.2f}x")  # fmt: skip
    if not r["verdicts_ok"]:
        console.print(f"[bold red]unexpected verdicts: the mutated trace should be REJECTED at "
                      f"{r['mutated']['expected_event_index']}[/]")  # fmt: skip


# ------------------------------------------------------------------------------- entry points


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvcc.console import positive_int

    parser.add_argument("--trace", type=Path, metavar="FILE",
                        help="an NDJSON trace to measure and replicate (default: a fresh load run of the reference adapter)")
    parser.add_argument("--events", type=positive_int, default=DEFAULT_EVENTS, metavar="N",
                        help=f"at least this many events in the generated trace (default {DEFAULT_EVENTS:,})")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"seed of the load run (default {DEFAULT_SEED})")
    parser.add_argument("--lease-term-ms", type=positive_int, default=1000, metavar="MS")
    parser.add_argument("--skew-ms", type=int, default=50, metavar="MS")
    parser.add_argument("--jobs", type=positive_int, default=None, metavar="N",
                        help="processes replaying key projections (default: one per CPU; the load trace is also measured in one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")  # fmt: skip


def cli(args: argparse.Namespace) -> int:
    from kvcc.console import print_json, stderr_console, stdout_console

    err = stderr_console()
    step = None if args.json else (lambda text: err.print(f"[dim]{text}[/]"))
    try:
        r = measure(args.trace, args.events, args.seed, args.lease_term_ms, args.skew_ms, on_step=step, jobs=args.jobs)
    except BenchError as exc:
        print(f"kvcc bench validator: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print_json(r)
    else:
        render(stdout_console(), r)
    return 0 if r["verdicts_ok"] else 1


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcc.bench.validator", description=__doc__.splitlines()[0])
    parser.add_argument("--child", metavar="TRACE", help=argparse.SUPPRESS)
    add_arguments(parser)
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.child:
        child_main(args.child, args.lease_term_ms, args.skew_ms, args.jobs)
        return 0
    return cli(args)


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("DO_NOT_TRACK", "1")
    sys.exit(main())
