"""kvcc's command line: ``kvcc check | mutants | prove | verify | accel | bench checker | bench tiers | bench directory | bench validator | bench routing | bench suite | bench compare | bench sglang | bench vllm``.

Exit codes: 0 when everything asked for holds, 1 when something fails (a violation, an unreached
``sometimes``, a manifest mismatch, a mutant not caught by its property, an unproved obligation),
2 on bad usage (an unknown configuration or mutant, or a part of the project not there yet).
With ``--json`` a command prints exactly one JSON object on stdout and nothing else.

The spec (``kvcc.spec``) is imported inside the commands, so ``kvcc --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from . import report
from .console import positive_int, print_json, stderr_console, stdout_console

PROG = "kvcc"
DEFAULT_CONFIG = "small"  # pinned and exhaustive: a writer, a reader, two generations, a node crash; seconds
MUTANT_WORKERS = 2  # the CI machines have two cores; the mutants are independent
# Checker worker processes for one search: one per core, at most two.
DEFAULT_WORKERS = max(1, min(2, os.cpu_count() or 1))

# Manifest fields that a run reproduces exactly (timings are never pinned).
MANIFEST_FIELDS = ("distinct_states", "generated_states", "depth", "ok")


class UsageError(Exception):
    """Bad input from the user: reported as one line on stderr, exit code 2."""


# ------------------------------------------------------------------------------------- utilities


def _usage_error(command: str, message: str) -> int:
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)
    return 2


def resolve_config(name: str) -> str:
    from kvcc.spec.config import CONFIGS

    if name not in CONFIGS:
        raise UsageError(f"unknown configuration {name!r} (known: {', '.join(CONFIGS)})")
    return name


def resolve_mutant(name: str) -> str:
    from kvcc.spec.mutants import MUTANTS

    if name not in MUTANTS:
        raise UsageError(f"unknown mutant {name!r} (known: {', '.join(MUTANTS)})")
    return name


# ----------------------------------------------------------------------------------------- check


def manifest_status(config: str, mutant: str | None, res: Mapping[str, Any]) -> dict[str, Any] | None:
    """Compare a run with ``spec/manifest.json``'s pinned figures for its configuration.

    Returns None for a mutant run (the manifest pins the real protocol), else a dict with
    ``status``: ``match`` / ``mismatch`` (then ``expected`` and ``actual``), or ``absent`` /
    ``unpinned`` / ``skipped`` / ``unreadable`` with ``why``."""
    if mutant is not None:
        return None
    from kvcc.spec.config import load_manifest

    try:
        manifest = load_manifest()
    except FileNotFoundError:
        return {"status": "absent", "why": "no spec/manifest.json: nothing pinned"}
    except Exception as exc:  # noqa: BLE001 - a broken manifest is reported, not fatal
        return {"status": "unreadable", "why": f"cannot read spec/manifest.json: {exc}"}
    table = manifest.get("configs", manifest) if isinstance(manifest, Mapping) else {}
    entry = table.get(config) if isinstance(table, Mapping) else None
    pinned = {k: entry[k] for k in MANIFEST_FIELDS if isinstance(entry, Mapping) and k in entry}
    if "distinct_states" not in pinned:
        return {"status": "unpinned", "why": f"spec/manifest.json pins no state count for {config!r}"}
    if res.get("truncated"):
        return {"status": "skipped", "why": "not compared with the manifest: the run was truncated (--max-states)"}
    actual = {k: res.get(k) for k in pinned}
    status = "match" if actual == pinned else "mismatch"
    fmt = lambda d: ", ".join(f"{k}={v}" for k, v in d.items())  # noqa: E731
    return {"status": status, "expected": fmt(pinned), "actual": fmt(actual)}


def run_check(config: str, mutant: str | None, max_states: int | None, progress=None,
              workers: int | None = None) -> tuple[dict, dict | None, int]:
    """Run the checker; return (``to_json()`` (+ ``manifest_match``), manifest status, exit code).

    Without a mutant the search uses one worker process per core (at most 2); a mutant's search
    uses one, so that its counterexample -- the first violation found at the shortest depth --
    is the same on every run."""
    from kvcc.spec.checker import check
    from kvcc.spec.config import get_config

    if workers is None:
        workers = 1 if mutant else DEFAULT_WORKERS
    result = check(get_config(config), mutant=mutant, max_states=max_states, progress=progress, workers=workers)
    res = result.to_json()
    manifest = manifest_status(config, mutant, res)
    if manifest is not None and manifest["status"] in ("match", "mismatch"):
        res["manifest_match"] = manifest["status"] == "match"
    code = 0 if res["ok"] and res.get("manifest_match", True) else 1
    return res, manifest, code


def check_one_of_all(config: str, workers: int | None = None) -> dict[str, Any]:
    """One configuration of ``check --all``: exhaustive, or sampled (swarm) where the manifest
    says the scope is too large to exhaust in CI; a row of the summary, with what failed."""
    from kvcc.spec.checker import swarm
    from kvcc.spec.config import get_config, load_manifest
    from kvcc.spec.model import Model

    pinned = load_manifest().get(config, {})
    mode = pinned.get("mode", "exhaustive")
    started = time.perf_counter()
    if mode == "sampled":
        walks = pinned["swarm"]
        res = swarm(Model(get_config(config)), seeds=walks["seeds"], depth=walks["depth"],
                    max_states=walks["max_states"], first_seed=walks["first_seed"]).to_json()
        manifest = sampled_manifest_status(config, pinned, res)
        res["manifest_match"] = manifest["status"] == "match"
        code = 0 if res["ok"] and res["manifest_match"] else 1
    else:
        res, manifest, code = run_check(config, None, None, workers=workers)
    props = res["properties"]
    return {
        "config": config,
        "mode": mode,
        "ok": code == 0 and res.get("manifest_match") is True,
        "distinct_states": res["distinct_states"],
        "depth": res["depth"],
        "seconds": round(time.perf_counter() - started, 3),
        "states_per_second": res["states_per_second"],
        "manifest": None if manifest is None else manifest["status"],
        "violation": None if res["violation"] is None else
        {k: res["violation"][k] for k in ("property", "kind", "depth", "steps")},
        "unreached": [n for n, v in props.items() if v == "unreached"],
        "refuted_exemptions": res["refuted_exemptions"],
        "uncovered_actions": res["uncovered_actions"],
        "exempt_sometimes": res["exempt_sometimes"],
        "covered_actions": sorted(a for a, n in res["coverage"].items() if n),
        "coverage": res["coverage"],
    }


def sampled_manifest_status(config: str, pinned: Mapping[str, Any], res: Mapping[str, Any]) -> dict[str, Any]:
    """A sampled configuration's walks are seeded, so they visit the same states on every run:
    the distinct-state count they reach is pinned like an exhaustive one's (a change in the model
    or the walks shows as a mismatch, not as a silently different sample)."""
    if "distinct_states" not in pinned:
        return {"status": "unpinned", "why": f"spec/manifest.json pins no state count for {config!r}"}
    status = "match" if res["distinct_states"] == pinned["distinct_states"] else "mismatch"
    return {"status": status, "expected": f"distinct_states={pinned['distinct_states']}",
            "actual": f"distinct_states={res['distinct_states']}"}


def all_detail(row: Mapping[str, Any]) -> str:
    parts = [f"{row['mode']}", f"{report.fmt_int(row['distinct_states'])} states", f"depth {row['depth']}",
             f"{report.fmt_seconds(row['seconds'])}s"]
    if row["mode"] == "sampled":
        parts.append(f"{len(row['covered_actions'])} action labels covered")
    if row["violation"]:
        parts.append(f"{row['violation']['property']} violated in {row['violation']['steps']} steps")
    for key in ("unreached", "refuted_exemptions", "uncovered_actions"):
        if row[key]:
            parts.append(f"{key.replace('_', ' ')}: {', '.join(row[key])}")
    if row["manifest"] not in (None, "match"):
        parts.append(f"manifest {row['manifest']}")
    return ", ".join(parts)


def cmd_check_all(args: argparse.Namespace) -> int:
    """Every configuration of the manifest, one line each; then every action label must be
    covered by at least one of them."""
    from kvcc.spec.checker import LABELS
    from kvcc.spec.config import CONFIGS, load_manifest

    manifest = load_manifest()
    chosen = getattr(args, "set", "all")
    names = [n for n in CONFIGS if chosen == "all" or manifest.get(n, {}).get("set", "fast") == chosen]
    out = None if args.json else stdout_console()
    started = time.perf_counter()
    rows = []
    for name in names:
        row = check_one_of_all(name, workers=args.workers)
        if name not in manifest:
            row["ok"], row["manifest"] = False, "unpinned"
        rows.append(row)
        if out is not None:
            out.print(report.verdict_line(row["ok"], f"check {name}", all_detail(row)), soft_wrap=True)
    covered = {a for row in rows for a in row["covered_actions"]}
    uncovered = [a for a in LABELS if a not in covered]
    unknown = sorted(set(manifest) - set(CONFIGS))  # a pinned configuration that no longer exists
    # Every action label must be covered by the whole manifest; one set alone is judged only on
    # its own configurations (a label only the full set reaches is listed, not a failure).
    ok = all(row["ok"] for row in rows) and not unknown and (chosen != "all" or not uncovered)
    payload = {"ok": ok, "set": chosen, "configs": rows, "uncovered_anywhere": uncovered, "unknown_in_manifest": unknown,
               "exhaustive": [r["config"] for r in rows if r["mode"] == "exhaustive"],
               "sampled": [r["config"] for r in rows if r["mode"] == "sampled"],
               "seconds": round(time.perf_counter() - started, 3)}
    if out is None:
        print_json(payload)
    else:
        detail = (f"{len(rows)} configurations ({len(payload['exhaustive'])} exhaustive, {len(payload['sampled'])} sampled), "
                  f"{report.fmt_int(sum(r['distinct_states'] for r in rows))} states, {report.fmt_seconds(payload['seconds'])}s")
        if uncovered:
            detail += (f"; covered by no configuration of the {chosen} set: " if chosen != "all" else
                       "; covered by no configuration: ") + ", ".join(uncovered)
        if unknown:
            detail += "; pinned but unknown: " + ", ".join(unknown)
        out.print(report.verdict_line(ok, "check --all", detail), soft_wrap=True)
    return 0 if ok else 1


def cmd_check(args: argparse.Namespace) -> int:
    if args.all:
        if args.config or args.mutant or args.max_states:
            return _usage_error("check", "--all checks every configuration of the manifest, without a mutant or a cap")
        return cmd_check_all(args)
    try:
        mutant = resolve_mutant(args.mutant) if args.mutant else None
        if args.config is None:
            from kvcc.spec.mutants import MUTANTS

            args.config = MUTANTS[mutant].config if mutant else DEFAULT_CONFIG
        config = resolve_config(args.config)
    except UsageError as exc:
        return _usage_error("check", str(exc))
    if args.json:
        res, _, code = run_check(config, mutant, args.max_states, workers=args.workers)
        print_json(res)
        return code
    out = stdout_console()
    label = config + (f" + mutant {mutant}" if mutant else "")
    with report.CheckProgress(stderr_console(), label) as progress:
        res, manifest, code = run_check(config, mutant, args.max_states, progress, workers=args.workers)
    report.render_check(out, res, manifest, args.max_states)
    out.print(report.verdict_line(code == 0, f"check {label}", report.check_detail(res, manifest)), soft_wrap=True)
    return code


# --------------------------------------------------------------------------------------- mutants


def mutant_job(name: str, max_states: int | None = None) -> dict[str, Any]:
    """Check one mutant in its own configuration (runs in a worker process)."""
    from kvcc.spec.checker import check
    from kvcc.spec.config import get_config
    from kvcc.spec.mutants import MUTANTS

    m = MUTANTS[name]
    started = time.perf_counter()
    r = check(get_config(m.config), mutant=name, max_states=max_states)
    v = r.violation
    return {
        "name": name,
        "expected_property": m.expected_property,
        "caught": v is not None and v.property == m.expected_property,
        "caught_by": None if v is None else v.property,
        "steps": None if v is None else max(len(v.trace) - 1, 0),
        "seconds": round(time.perf_counter() - started, 3),
        "config": m.config,
        "distinct_states": r.distinct_states,
        "truncated": r.truncated,
    }


def _failed_job(name: str, exc: BaseException) -> dict[str, Any]:
    from kvcc.spec.mutants import MUTANTS

    m = MUTANTS[name]
    return {"name": name, "expected_property": m.expected_property, "caught": False, "caught_by": None,
            "steps": None, "seconds": None, "config": m.config, "distinct_states": None, "truncated": False,
            "error": f"{type(exc).__name__}: {exc}"}


def run_mutants(names: Sequence[str], max_states: int | None = None, jobs: int = MUTANT_WORKERS,
                on_done=None) -> dict[str, Any]:
    """Check each mutant (in worker processes when there are several); ``{"ok", "mutants"}``."""
    started = time.perf_counter()
    rows: dict[str, dict] = {}
    if len(names) == 1 or jobs == 1:
        for name in names:
            try:
                rows[name] = mutant_job(name, max_states)
            except Exception as exc:  # noqa: BLE001 - one broken mutant must not hide the others
                rows[name] = _failed_job(name, exc)
            if on_done:
                on_done(rows[name])
    else:
        # spawn, not fork: the parent may hold a live display's thread, and fork copies locks.
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(jobs, len(names)), mp_context=ctx) as pool:
            futures = {pool.submit(mutant_job, name, max_states): name for name in names}
            try:
                for fut in as_completed(futures):
                    name = futures[fut]
                    try:
                        rows[name] = fut.result()
                    except Exception as exc:  # noqa: BLE001
                        rows[name] = _failed_job(name, exc)
                    if on_done:
                        on_done(rows[name])
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    ordered = [rows[n] for n in names]
    return {"ok": all(r["caught"] for r in ordered), "mutants": ordered,
            "seconds": round(time.perf_counter() - started, 3)}


def _mutants_progress(console: Console, total: int) -> Progress:
    return Progress(SpinnerColumn(), TextColumn("[bold]mutants[/]"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True,
                    disable=not console.is_terminal)


def _selected_mutants(only: Sequence[str] | None) -> list[str]:
    from kvcc.spec.mutants import MUTANTS

    if not only:
        return list(MUTANTS)
    names: list[str] = []
    for name in only:
        resolve_mutant(name)
        if name not in names:
            names.append(name)
    return names


def cmd_mutants(args: argparse.Namespace) -> int:
    try:
        names = _selected_mutants(args.only)
    except UsageError as exc:
        return _usage_error("mutants", str(exc))
    if args.json:
        payload = run_mutants(names, args.max_states, args.jobs)
        print_json(payload)
        return 0 if payload["ok"] else 1
    out = stdout_console()
    err = stderr_console()
    with _mutants_progress(err, len(names)) as prog:
        task = prog.add_task("", total=len(names))
        payload = run_mutants(names, args.max_states, args.jobs,
                              on_done=lambda row: prog.update(task, advance=1, description=row["name"]))
    out.print(report.mutants_table(payload["mutants"]))
    out.print(report.verdict_line(payload["ok"], "mutants", mutants_detail(payload)), soft_wrap=True)
    return 0 if payload["ok"] else 1


def mutants_detail(payload: Mapping[str, Any]) -> str:
    rows = payload["mutants"]
    caught = sum(1 for r in rows if r["caught"])
    text = f"{caught}/{len(rows)} caught by their expected property, {report.fmt_seconds(payload.get('seconds'))}s"
    missed = [r for r in rows if not r["caught"]]
    if missed:
        text += "; not: " + ", ".join(
            r["name"] + (f" (by {r['caught_by']})" if r.get("caught_by") else " (error)" if r.get("error") else "")
            for r in missed)
    return text


# ----------------------------------------------------------------------------------------- prove


class ProofsUnavailable(Exception):
    pass


def _load_prove_all():
    try:
        from kvcc.spec.proofs import prove_all
    except ImportError as exc:
        raise ProofsUnavailable(f"the z3 proofs are not available (kvcc.spec.proofs.prove_all): {exc}") from None
    return prove_all


def _obligation_json(o: Any) -> dict[str, Any]:
    d = dict(o.to_json()) if hasattr(o, "to_json") else {}
    for key in ("action", "invariant", "proved", "seconds", "counterexample"):
        if key not in d and hasattr(o, key):
            d[key] = getattr(o, key)
    d["proved"] = bool(d.get("proved"))
    return d


def run_refinement() -> dict[str, Any]:
    """Does the z3 encoding refine model.py? Every step of every configuration's reachable states
    (a covering subset for the large ones), per configuration and label (``spec.proofs.refinement``)."""
    try:
        from kvcc.spec.proofs.refinement import check_all
    except ImportError as exc:
        raise ProofsUnavailable(f"the refinement check is not available: {exc}") from None
    return check_all()


def run_prove(mutant: str | None, refinement: bool = True) -> dict[str, Any]:
    """The obligations and, for the design (no mutant), the refinement check of the encoding
    against model.py: ``ok`` only if every obligation is proved and every model step refined.
    Raises ``ProofsUnavailable`` until ``kvcc.spec.proofs.prove_all`` exists."""
    prove_all = _load_prove_all()
    bugs: frozenset[str] = frozenset()
    if mutant is not None:
        from kvcc.spec.mutants import MUTANTS

        bugs = frozenset(MUTANTS[mutant].bugs)
    started = time.perf_counter()
    obligations = [_obligation_json(o) for o in prove_all(bugs=bugs)]
    proved = sum(1 for o in obligations if o["proved"])
    obligations_seconds = round(time.perf_counter() - started, 3)
    payload: dict[str, Any] = {
        "ok": bool(obligations) and proved == len(obligations),
        "mutant": mutant,
        "proved": proved,
        "total": len(obligations),
        "obligations_seconds": obligations_seconds,
        "obligations": obligations,
    }
    if refinement and mutant is None:
        # A proof about the encoding is about model.py only if the encoding refines it.
        ref = run_refinement()
        payload["refinement"] = ref
        payload["ok"] = payload["ok"] and bool(ref.get("ok"))
    payload["seconds"] = round(time.perf_counter() - started, 3)
    return payload


def cmd_accel(args: argparse.Namespace) -> int:
    from kvcc import accel

    return accel.run(args.action, force=args.force)


def cmd_prove(args: argparse.Namespace) -> int:
    try:
        mutant = resolve_mutant(args.mutant) if args.mutant else None
    except UsageError as exc:
        return _usage_error("prove", str(exc))
    try:
        refine = not args.no_refinement
        if args.json:
            payload = run_prove(mutant, refine)
        else:
            with stderr_console().status("proving ..." if mutant is None else f"proving with mutant {mutant} ..."):
                payload = run_prove(mutant, refine)
    except ProofsUnavailable as exc:
        if args.json:
            print_json({"ok": False, "mutant": mutant, "error": str(exc), "obligations": []})
        return _usage_error("prove", str(exc))
    if args.json:
        print_json(payload)
        return 0 if payload["ok"] else 1
    out = stdout_console()
    out.print(report.proofs_table(payload["obligations"]))
    for o in payload["obligations"]:
        if not o["proved"]:
            report.render_counterexample(out, f"counterexample: {o.get('action')} breaks {o.get('invariant')}",
                                         o.get("counterexample"))
    if "refinement" in payload:
        out.print(refinement_table(payload["refinement"]))
        for name, c in payload["refinement"].get("configs", {}).items():
            for f in c.get("failures", []):
                report.render_counterexample(out, f"{name}: model step {f['label']} {tuple(f['params'])} "
                                                  "is no step of the encoding", f.get("diff"))
    out.print(report.verdict_line(payload["ok"], "prove" + (f" (mutant {mutant})" if mutant else ""),
                                  prove_detail(payload)), soft_wrap=True)
    return 0 if payload["ok"] else 1


def refinement_table(ref: Mapping[str, Any]):
    """Per configuration: how it was covered, the steps compared, the labels compared least."""
    from rich import box
    from rich.table import Table

    t = Table(title="Refinement: model.py steps that are steps of the z3 encoding", box=box.SIMPLE,
              title_justify="left")
    for col in ("configuration", "coverage", "states", "steps", "labels", "fewest", "verdict"):
        t.add_column(col, justify="right" if col in ("states", "steps", "labels") else "left")
    for name, c in ref.get("configs", {}).items():
        labels = c.get("labels", {})
        fewest = ", ".join(f"{k} {v}" for k, v in sorted(labels.items(), key=lambda kv: kv[1])[:2])
        ok = bool(c.get("ok"))
        verdict = "refined" if ok else f"FAILED ({c.get('failure_count', 0)} steps, missing {c.get('missing')})"
        t.add_row(name, "exhaustive" if c.get("exhaustive") else "covering subset", str(c.get("states")),
                  str(c.get("steps")), str(len(labels)), fewest, Text(verdict, style="green" if ok else "bold red"))
    return t


def prove_detail(payload: Mapping[str, Any]) -> str:
    text = f"{payload['proved']}/{payload['total']} obligations proved, {report.fmt_seconds(payload.get('seconds'))}s"
    failed = [f"{o.get('action')}/{o.get('invariant')}" for o in payload["obligations"] if not o["proved"]]
    if failed:
        text += "; failed: " + ", ".join(failed[:5]) + (" ..." if len(failed) > 5 else "")
    ref = payload.get("refinement")
    if ref is not None:
        text += (f"; refinement: {ref.get('steps')} model steps in {len(ref.get('configs', {}))} scopes "
                 + ("refined" if ref.get("ok") else "NOT refined"))
        if ref.get("never_compared"):
            text += f", never compared: {', '.join(ref['never_compared'])}"
    return text


# ---------------------------------------------------------------------------------------- verify


def cmd_verify(args: argparse.Namespace) -> int:
    """The main job today: ``check --config small``, then ``mutants``, then ``prove``."""
    out, err = stdout_console(), stderr_console()
    quiet = args.json
    verdicts: dict[str, bool] = {}
    payload: dict[str, Any] = {}

    def stage_failed(name: str, exc: BaseException) -> None:
        verdicts[name] = False
        payload[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if not quiet:
            traceback.print_exc(file=sys.stderr)
            out.print(report.verdict_line(False, name, payload[name]["error"]), soft_wrap=True)

    # 1. check
    try:
        with report.CheckProgress(err, DEFAULT_CONFIG, enabled=None if not quiet else False) as progress:
            res, manifest, code = run_check(DEFAULT_CONFIG, None, None, progress)
        verdicts["check"] = code == 0
        payload["check"] = res
        if not quiet:
            detail = report.check_detail(res, manifest)
            out.print(report.verdict_line(code == 0, f"check {DEFAULT_CONFIG}", detail), soft_wrap=True)
            if res.get("violation"):
                report.render_trace(out, res["violation"], res.get("config"))
    except Exception as exc:  # noqa: BLE001
        stage_failed("check", exc)

    # 2. mutants
    try:
        names = _selected_mutants(None)
        if quiet:
            mp = run_mutants(names)
        else:
            with _mutants_progress(err, len(names)) as prog:
                task = prog.add_task("", total=len(names))
                mp = run_mutants(names, on_done=lambda row: prog.update(task, advance=1, description=row["name"]))
        verdicts["mutants"] = mp["ok"]
        payload["mutants"] = mp
        if not quiet:
            out.print(report.verdict_line(mp["ok"], "mutants", mutants_detail(mp)), soft_wrap=True)
    except Exception as exc:  # noqa: BLE001
        stage_failed("mutants", exc)

    # 3. prove
    try:
        if quiet:
            pp = run_prove(None)
        else:
            with err.status("proving ..."):
                pp = run_prove(None)
        verdicts["prove"] = pp["ok"]
        payload["prove"] = pp
        if not quiet:
            out.print(report.verdict_line(pp["ok"], "prove", prove_detail(pp)), soft_wrap=True)
    except ProofsUnavailable as exc:
        verdicts["prove"] = False
        payload["prove"] = {"ok": False, "error": str(exc), "obligations": []}
        if not quiet:
            out.print(report.verdict_line(False, "prove", str(exc)), soft_wrap=True)
    except Exception as exc:  # noqa: BLE001
        stage_failed("prove", exc)

    ok = all(verdicts.get(s, False) for s in ("check", "mutants", "prove"))
    if quiet:
        print_json({"ok": ok, **payload})
    else:
        failed = [s for s in ("check", "mutants", "prove") if not verdicts.get(s, False)]
        final = Text("verify: ", style="bold")
        final.append("PASS" if ok else "FAIL", style="bold green" if ok else "bold red")
        if failed:
            final.append(f" ({', '.join(failed)})")
        out.print(final, soft_wrap=True)
    return 0 if ok else 1


# ----------------------------------------------------------------------------------------- bench


def cmd_bench_checker(args: argparse.Namespace) -> int:
    from kvcc.bench import checker as bench_checker

    try:
        resolve_config(args.config)
    except UsageError as exc:
        return _usage_error("bench checker", str(exc))
    return bench_checker.run(args)


# name -> (help, description) of the benchmarks whose module ``kvcc.bench.<name>`` has
# ``add_arguments(parser)`` and ``cli(args) -> int``.
BENCHMARKS = {
    "tiers": ("storage-tier bandwidth as a fraction of the raw limit",
              "Read and write bandwidth of each storage tier (DRAM, GPU, NVMe, pool) per block size, as a "
              "fraction of the raw limit measured in the same run."),
    "directory": ("lease acquire+release throughput and latency, embedded and etcd",
                  "Read-lease acquire+release pairs per second and p50/p99 latency over loopback TCP with "
                  "concurrent clients, for the directory on SQLite (embedded) and on etcd, each beside a raw "
                  "baseline from the same run (Ping round trips; raw etcd puts)."),
    "validator": ("trace validator throughput and memory, on a load trace and a generated one",
                  "Events per second and peak RSS of the trace validator on the load profile's trace of a real "
                  "run and on a trace of at least a million events made from it; a mutated copy must be REJECTED."),
    "routing": ("request routing policies replayed on Mooncake's traces, against hit-ratio bounds",
                "Hit ratio, load balance and modelled TTFT of each routing policy on a simulated cluster "
                "replaying Mooncake's request traces, beside the infinite-cache and pooled-LRU bounds; "
                "--calibrate measures the per-block costs first, --live also replays through a local kvcc cluster."),
    "suite": ("the performance suite every adapter runs, into a bundle",
              "Lease and lookup latency, block bandwidth, invalidation completion and a Mooncake trace replay "
              "through the adapter contract, each figure beside a baseline from the same run; writes "
              "results.json, plots, report.html and a MANIFEST into --out."),
    "sglang": ("kvcc's SGLang HiCache backend vs SGLang's HiCacheFile: bandwidth and batch_exists latency",
               "batch_set and batch_get bandwidth per page size and batch_exists p50/p99 latency through kvcc's "
               "SGLang HiCache storage backend on a LocalCluster started on loopback, beside SGLang's own "
               "HiCacheFile on the same pages in the same run (interleaved trials, medians, ratio kvcc/file)."),
    "vllm": ("a real vLLM engine's TTFT with the prefix from kvcc's DRAM or NVMe tier vs computed",
             "Time to first token of a real vLLM engine on CPU for prefixes of 512 to 8192 tokens: served from kvcc "
             "(the connector loads every block from the node's DRAM or NVMe tier) against computed with the "
             "connector (a miss: computed and saved) and without it (plain vLLM), medians of interleaved trials, "
             "ratios in the same run."),
    "compare": ("adapters side by side from their bench suite bundles",
                "Verify each bundle's MANIFEST, then print every workload's metrics with one column per bundle."),
    "fuzz": ("live fuzzing of a running deployment: no crash, no state change, memory bounded",
             "Start a directory and two cache nodes as processes on loopback, commit a known state, then attack "
             "every port for --seconds with random, mutated, oversized and slow frames, connection floods and "
             "replays; check that every process lives, the state is unchanged, RSS stayed bounded and a "
             "legitimate client is served after each flood."),
    "soak": ("a bounded soak of a real deployment under load and faults: nothing committed lost, no wrong bytes",
             "Start a directory and three cache nodes as processes on loopback, run --clients threads of seeded "
             "puts, reads, lookups and invalidations for the duration (at most 60 minutes), with --faults also "
             "node kill -9/restart, SIGSTOP/SIGCONT and directory kill -9/restart; then check every acknowledged "
             "commit is still readable with its exact bytes unless invalidated or lost with a killed node's DRAM, "
             "and validate the run's merged trace."),
}  # fmt: skip


# ---------------------------------------------------------------------------------------- parser


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``argv``, a bench module is imported only when ``argv`` names it
    (each costs tens of milliseconds of imports, on every start)."""
    parser = argparse.ArgumentParser(prog=PROG, description="kvcc: a formally checked KV-cache coherence protocol.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("check", help="model-check one configuration (optionally with a mutant)",
                       description="Explore every reachable state of a configuration and check every property.")
    p.add_argument("--config", metavar="NAME",
                   help=f"model configuration (default: the mutant's own, else {DEFAULT_CONFIG})")
    p.add_argument("--all", action="store_true",
                   help="every configuration of the manifest, one line each (exhaustive or sampled, as pinned); "
                        "fails unless each passes and every action is covered by one of them")
    p.add_argument("--set", choices=("fast", "full", "all"), default="all",
                   help="with --all: the fast set (about 9 minutes on two idle cores, for a quick loop), the full "
                        "set (configurations that alone take longer), or both (the default; CI runs both)")
    p.add_argument("--mutant", metavar="NAME", help="switch on one mutant's bugs")
    p.add_argument("--workers", type=positive_int, metavar="N",
                   help=f"worker processes (default: {DEFAULT_WORKERS}, or 1 with a mutant)")
    p.add_argument("--max-states", type=positive_int, metavar="N",
                   help="stop after N distinct states (the run is then not exhaustive and not ok)")
    p.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("mutants", help="check that every mutant is caught by its expected property",
                       description="Check each mutant in its configuration; "
                                   "each must violate exactly its expected property.")
    p.add_argument("--only", nargs="+", metavar="NAME", help="only these mutants")
    p.add_argument("--max-states", type=positive_int, metavar="N",
                   help="cap each mutant's search at N distinct states")
    p.add_argument("--jobs", type=positive_int, default=MUTANT_WORKERS, metavar="N",
                   help=f"worker processes (default {MUTANT_WORKERS})")
    p.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    p.set_defaults(func=cmd_mutants)

    p = sub.add_parser("prove", help="discharge the z3 proof obligations",
                       description="Prove every (action, invariant) obligation with z3, and check that the "
                                   "encoding refines model.py on every configuration's reachable steps.")
    p.add_argument("--mutant", metavar="NAME", help="prove with one mutant's bugs switched on (expected to fail)")
    p.add_argument("--no-refinement", action="store_true",
                   help="skip the refinement check of the encoding against model.py (run without --mutant)")
    p.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    p.set_defaults(func=cmd_prove)

    p = sub.add_parser("verify", help="the main job: check small, mutants, prove",
                       description=f"Run check --config {DEFAULT_CONFIG}, then mutants, then prove; "
                                   "pass only if all three pass.")
    p.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("accel", help="compile the spec's and the validator's hot modules, or say which are current",
                       description="build: compile kvcc.spec.model, kvcc.spec.properties, kvcc.spec.checker and kvcc.conformance.validate "
                                   "with Cython into the environment (only those whose source changed; a compiled "
                                   "module is loaded only while its source is unchanged). status: which are current.")
    p.add_argument("action", choices=("build", "status"))
    p.add_argument("--force", action="store_true", help="with build: compile every module")
    p.set_defaults(func=cmd_accel)

    p = sub.add_parser("bench", help="benchmarks", description="Benchmarks.")
    bsub = p.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    from kvcc.bench.checker import add_arguments

    b = bsub.add_parser("checker", help="model-checker throughput and memory per state",
                        description="Distinct states per second and bytes per state of the model checker.")
    add_arguments(b)
    b.set_defaults(func=cmd_bench_checker)
    wanted = argv[1] if argv is not None and len(argv) > 1 and argv[0] == "bench" else None
    for name, (help_, description) in BENCHMARKS.items():
        b = bsub.add_parser(name, help=help_, description=description)
        if argv is None or name == wanted:
            module = importlib.import_module(f"kvcc.bench.{name}")
            module.add_arguments(b)
            b.set_defaults(func=module.cli)

    from kvcc.cli_runtime import add_parsers as add_runtime_parsers

    add_runtime_parsers(sub)

    from kvcc.cli_admin import add_parsers as add_admin_parsers

    add_admin_parsers(sub)  # kvcc admin nodes, kvcc admin invalidate

    from kvcc.conformance.command import add_parsers as add_conformance_parsers

    add_conformance_parsers(sub)  # kvcc conform, kvcc certify verify
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is, so that it ends as Ctrl-C ends it."""


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated


def main(argv: Sequence[str] | None = None) -> int:
    """The ``kvcc`` command. SIGTERM ends a command as Ctrl-C does (``Terminated``): its
    ``finally`` blocks stop what it started -- a benchmark's local cluster, an smg router --
    where the default action would kill this process alone and leave them running (``kill`` of
    a live routing replay left a directory and four nodes behind). Servers install their own
    handlers; the previous handler is back when ``main`` returns."""
    parser = build_parser(list(sys.argv[1:] if argv is None else argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or argparse's own usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    previous = None
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return args.func(args)
    except Terminated:
        print(f"{PROG}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
