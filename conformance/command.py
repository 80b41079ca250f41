"""The ``kvcc conform`` and ``kvcc certify verify`` commands (wired into ``kvcc.cli``).

``kvcc conform --adapter NAME|module:factory [--profile P ...] [--seed N] [--out DIR]``
runs the suite with a rich progress bar and prints a summary table; exit 0 when every required
test of the claimed, requested profiles PASSed, 1 otherwise, 2 on bad usage.
``kvcc conform --catalogue-md`` prints the catalogue document (``docs/conformance.md``).
``kvcc certify verify DIR`` re-checks a bundle: exit 0 when it verifies, 1 with the reasons.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .contract import PROFILES

_STYLE = {"PASS": "green", "FAIL": "bold red", "ERROR": "yellow", "SKIP": "dim", "NOT_APPLICABLE": "dim"}


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("conform", help="run the conformance suite against an adapter",
                       description="Run the conformance suite against an adapter and write a report bundle.")
    p.add_argument("--adapter", help="a built-in or entry-point name (kvcc.adapters), or package.module:factory")
    p.add_argument("--profile", action="append", choices=PROFILES, help="profile to run (repeatable; default: claimed)")
    p.add_argument("--seed", type=int, default=None, help="seed for keys, namespaces and workloads (default: random)")
    p.add_argument("--out", help="directory for the report bundle (must be empty or absent)")
    p.add_argument("--id", action="append", dest="ids", help="run only this test id (repeatable; others are SKIP)")
    p.add_argument("--lease-term-ms", type=int, default=None, help="lease term the deployment grants")
    p.add_argument("--skew-ms", type=int, default=None, help="epsilon, the clock bound")
    p.add_argument("--nodes", type=int, default=None, help="cache nodes per deployment")
    p.add_argument("--no-validate", action="store_true", help="skip trace validation (the report cannot certify)")
    p.add_argument("--catalogue-md", action="store_true", help="print the catalogue document and exit")
    p.add_argument("--list-adapters", action="store_true", help="print the adapters known here and exit")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--mutation-score", action="store_true",
                   help="measure the suite's mutation score on mutants of the in-process deployment (conformance.mutation)")
    p.add_argument("--jobs", type=int, default=None, help="with --mutation-score: mutants run at once (default 2)")
    p.add_argument("--limit", type=int, default=None, help="with --mutation-score: run at most N mutants, spread evenly")
    p.add_argument("--rerun", help="with --mutation-score: rerun only the survivors of this earlier full run's JSON")
    p.add_argument("--whole-suite", action="store_true", help="with --mutation-score: run every test on every mutant "
                   "(default: only the tests that ran the mutated function in the baseline)")
    p.add_argument("--module", action="append", help="with --mutation-score: mutate only the targets whose module "
                   "name contains this (repeatable; the score is then theirs)")
    p.set_defaults(func=cmd_conform)

    c = sub.add_parser("certify", help="certification bundles", description="Certification bundles.")
    csub = c.add_subparsers(dest="certify", metavar="ACTION", required=True)
    v = csub.add_parser("verify", help="re-check a report bundle (hashes, traces, required tests)")
    v.add_argument("dir", help="the bundle directory")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=cmd_certify_verify)


def cmd_conform(args: argparse.Namespace) -> int:
    from . import catalogue, registry, runner

    if args.catalogue_md:
        sys.stdout.write(catalogue.catalogue_markdown())
        return 0
    if args.mutation_score:
        from .mutation import cmd_mutation_score

        return cmd_mutation_score(args)
    if args.list_adapters:
        for name, spec in sorted(registry.available().items()):
            print(f"{name}\t{registry.describe(name)}\t{spec}")
        return 0
    if not args.adapter:
        print("kvcc conform: error: --adapter is required", file=sys.stderr)
        return 2
    try:
        factory = registry.resolve(args.adapter)
    except registry.UnknownAdapter as e:
        print(f"kvcc conform: error: {e}", file=sys.stderr)
        return 2
    kwargs = {}
    for name in ("lease_term_ms", "skew_ms", "nodes"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    console = Console(stderr=True, highlight=False)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=True, disable=args.json)  # fmt: skip
    profiles = args.profile
    total = len(catalogue.tests_for(profiles or PROFILES))
    with progress:
        task = progress.add_task("conformance", total=total)

        def on(event: str, test, result) -> None:
            if event == "start":
                progress.update(task, description=f"{test.id} {test.title[:40]}")
            else:
                progress.advance(task)
                if not args.json:
                    progress.console.print(f"[{_STYLE[result.status]}]{result.status:>14}[/] {test.id} "
                                           f"{result.duration_s:6.2f}s {result.message[:100]}")  # fmt: skip

        try:
            rep = runner.run_conformance(factory, profiles, args.seed, args.out, ids=args.ids,
                                         validate=not args.no_validate, progress=on, **kwargs)  # fmt: skip
        except (ValueError, FileExistsError, TypeError) as e:
            print(f"kvcc conform: error: {e}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(rep.to_json(), default=str))
    else:
        _summary(rep)
        if args.out:
            Console(highlight=False).print(
                f"report bundle: {args.out} (open {args.out}/report.html in a browser; "
                f"re-check it with: kvcc certify verify {args.out})"
            )
    return 0 if rep.certified else 1


def _summary(rep) -> None:
    from . import names, registry

    console = Console(highlight=False)
    table = Table(title=f"kvcc conformance: {rep.adapter} (seed {rep.seed})")
    table.add_column("profile")
    for s in ("PASS", "FAIL", "ERROR", "SKIP", "NOT_APPLICABLE"):
        table.add_column(s, justify="right", style=_STYLE[s])
    table.add_column("counted", justify="right")  # PASS with the trace ACCEPTED: what certifies
    table.add_column("claimed")
    for p in rep.profiles:
        rs = [r for r in rep.results if r.profile == p]
        table.add_row(p, *[str(sum(r.status == s for r in rs)) for s in ("PASS", "FAIL", "ERROR", "SKIP", "NOT_APPLICABLE")],
                      f"{sum(r.counts for r in rs)}/{len(rs)}", "yes" if p in rep.claimed else "no")  # fmt: skip
    console.print(table)
    for r in rep.results:
        if r.status in ("FAIL", "ERROR"):
            console.print(f"[{_STYLE[r.status]}]{r.status}[/] {r.id}: {r.message}")
            if r.verdict.get("status") == "REJECTED":  # the validator's ids in this adapter's names
                console.print("  spec ids:", names.map_line(r.verdict.get("names") or {}), markup=False)
    if not rep.claimed:
        console.print(f"[bold red]NOT CERTIFIED[/]: {registry.unclaimed_advice(rep.profiles, rep.capabilities, rep.adapter)}")
        return
    console.print("[bold green]CERTIFIED[/]" if rep.certified else "[bold red]NOT CERTIFIED[/]",
                  f"for {', '.join(rep.claimed)}")  # fmt: skip


def cmd_certify_verify(args: argparse.Namespace) -> int:
    from .certify import verify_bundle

    problems = verify_bundle(args.dir)
    if args.json:
        print(json.dumps({"ok": not problems, "problems": problems}))
    else:
        for p in problems:
            print(f"FAIL {p}")
        print("bundle verifies" if not problems else f"{len(problems)} problem(s)")
    return 0 if not problems else 1
