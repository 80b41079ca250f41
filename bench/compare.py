"""Benchmark: adapters side by side from their performance bundles (``kvcc bench compare``).

``kvcc bench compare DIR DIR... [--json]`` verifies each bundle's MANIFEST first (a bundle whose
files were changed is refused, never compared), then prints one table per workload: a row per
metric, a column per bundle, each cell the figure as that bundle's run measured it (ratios are
against baselines measured in the bundle's own run, so they compare across machines better than
the absolute figures do). A metric one run has and another has not (a size one adapter refused, a
workload it skipped) shows "-". With ``--json``: ``{"bundles": [...], "workloads": {workload:
{metric: [value per bundle]}}}``.

Exit 0 when every bundle verified, 1 when one did not (the reasons on stderr), 2 on bad input (a
path that is no directory).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcc.bench import perf_bundle


def column_name(results: dict[str, Any], path: Path) -> str:
    run = results["run"]
    return f"{run['adapter']} ({run['profile']})\n{path}"


def side_by_side(bundles: Sequence[dict[str, Any]]) -> dict[str, dict[str, list[perf_bundle.Metric | None]]]:
    """Workload -> metric -> one (value, text) per bundle (None where that bundle has no such
    metric), metrics in the order they first appear."""
    views = [perf_bundle.metrics(b) for b in bundles]
    out: dict[str, dict[str, list[perf_bundle.Metric | None]]] = {}
    for workload in dict.fromkeys(w for v in views for w in v):
        labels = merged_order([list(v.get(workload, {})) for v in views])
        out[workload] = {label: [v.get(workload, {}).get(label) for v in views] for label in labels}
    return out


def merged_order(orders: Sequence[Sequence[str]]) -> list[str]:
    """Every label once, each one a run has and the first has not placed after the label it
    followed in that run (a size one adapter refused stays beside the sizes around it)."""
    merged: list[str] = []
    for labels in orders:
        at = 0
        for label in labels:
            if label in merged:
                at = merged.index(label) + 1
            else:
                merged.insert(at, label)
                at += 1
    return merged


def render(console: Any, names: Sequence[str], table: dict[str, dict[str, list[perf_bundle.Metric | None]]]) -> None:
    from rich.table import Table

    for workload, rows in table.items():
        t = Table(title=workload, title_justify="left")
        t.add_column("metric")
        for name in names:
            t.add_column(name, justify="right")
        for label, cells in rows.items():
            t.add_row(label, *["-" if c is None else c[1] for c in cells])
        console.print(t)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="bundles written by kvcc bench suite")
    parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")


def cli(args: argparse.Namespace) -> int:
    from kvcc.console import print_json, stdout_console

    missing = [str(d) for d in args.dirs if not d.is_dir()]
    if missing:
        print(f"kvcc bench compare: error: not a directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    bundles, bad = [], []
    for d in args.dirs:
        try:
            bundles.append(perf_bundle.load(d))
        except perf_bundle.BundleError as e:
            bad.append(str(e))
    if bad:
        for line in bad:
            print(f"kvcc bench compare: error: {line}", file=sys.stderr)
        return 1
    table = side_by_side(bundles)
    if args.json:
        print_json({
            "bundles": [{"dir": str(d), "adapter": b["run"]["adapter"], "profile": b["run"]["profile"],
                         "date": b["run"]["date"]} for d, b in zip(args.dirs, bundles)],
            "workloads": {w: {label: [None if c is None else c[0] for c in cells] for label, cells in rows.items()}
                          for w, rows in table.items()},
        })  # fmt: skip
    else:
        render(stdout_console(), [column_name(b, d) for d, b in zip(args.dirs, bundles)], table)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcc.bench.compare", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return cli(parser.parse_args(list(argv) if argv is not None else None))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
