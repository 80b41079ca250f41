"""Benchmark: adapters side by side from their performance bundles (``kvcc bench compare``).

``kvcc bench compare DIR DIR... [--json]`` verifies each bundle's MANIFEST first (a bundle whose
files were changed is refused, never compared), then prints one table per workload: a row per
metric, a column per bundle, each cell the figure as that bundle's run measured it (ratios are
against baselines measured in the bundle's own run, so they compare across machines better than
the absolute figures do). A metric one run has and another has not (a size one adapter refused, a
workload it skipped) shows "-". With ``--json``: ``{"bundles": [...], "workloads": {workload:
{metric: [value per bundle]}}}``.

``--plots DIR`` also draws the bundles together, one line or bar per bundle, into DIR:
``latency_vs_clients.png`` (acquire+release p50 against concurrent clients),
``bandwidth_vs_size.png`` (write and read over the raw copy of the same run, against block size),
``invalidation_vs_holders.png`` (completion by acknowledgement, p50, against holders) and
``trace_replay.png`` (the replay's hit ratio as a fraction of its infinite-cache and pooled bounds).
A bundle that has nothing for a plot (a workload skipped, every size refused) is left out of it
and the plot's legend says so.

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


def _ok_rows(results: dict[str, Any], workload: str) -> list[dict[str, Any]]:
    w = results["workloads"].get(workload) or {}
    return [r for r in w.get("rows", []) if "refused" not in r] if w.get("status") == "ok" else []


def _legend(ax: Any, left_out: list[str]) -> None:
    if left_out:
        ax.plot([], [], " ", label=f"nothing to plot: {', '.join(left_out)}")
    ax.legend(fontsize="x-small")


def _plot_lines(names: Sequence[str], bundles: Sequence[dict[str, Any]], rows_of: Any, x: str, y: str, *,
                xlabel: str, ylabel: str, title: str, log_x: bool) -> bytes:
    """One line per bundle of ``y`` against ``x`` over the rows ``rows_of(bundle)`` gives."""
    plt, (fig, ax) = perf_bundle._figure(7.2, 4.0)
    left_out, xs = [], set()
    for name, b in zip(names, bundles):
        rows = rows_of(b)
        if not rows:
            left_out.append(name)
            continue
        xs.update(r[x] for r in rows)
        ax.plot([r[x] for r in rows], [r[y] for r in rows], marker="o", label=name)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted(xs), [str(v) for v in sorted(xs)])
    _legend(ax, left_out)
    return perf_bundle._png(plt, fig)


def plot_latency(names: Sequence[str], bundles: Sequence[dict[str, Any]]) -> bytes:
    return _plot_lines(names, bundles, lambda b: [r for r in _ok_rows(b, "lease_lookup") if r["op"] == "acquire+release"],
                       "clients", "p50_us", xlabel="concurrent clients", ylabel="acquire+release p50 (µs)",
                       title="lease latency vs clients", log_x=True)  # fmt: skip


def plot_invalidation(names: Sequence[str], bundles: Sequence[dict[str, Any]]) -> bytes:
    return _plot_lines(names, bundles, lambda b: [r for r in _ok_rows(b, "invalidation") if r["mode"] == "ack"],
                       "holders", "p50_ms", xlabel="holders of read leases", ylabel="completion by ack, p50 (ms)",
                       title="invalidation vs holders", log_x=False)  # fmt: skip


def plot_bandwidth(names: Sequence[str], bundles: Sequence[dict[str, Any]]) -> bytes:
    plt, (fig, _) = perf_bundle._figure(9.6, 4.0)
    fig.clf()
    axes = fig.subplots(1, 2, sharey=True)
    left_out, sizes = [], set()
    for i, (name, b) in enumerate(zip(names, bundles)):
        rows = _ok_rows(b, "bandwidth")
        if not rows:
            left_out.append(name)
            continue
        sizes.update(r["size"] for r in rows)
        for ax, op in zip(axes, ("write", "read")):
            ax.plot([r["size"] for r in rows], [r[f"{op}_vs_raw"] for r in rows], marker="o", label=name, color=f"C{i}")
    for ax, op in zip(axes, ("write", "read")):
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(xlabel="block size", title=f"{op} / raw copy of the same run")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted(sizes), [perf_bundle.size_text(x) for x in sorted(sizes)])
    axes[0].set_ylabel("bandwidth / raw copy")
    _legend(axes[1], left_out)
    return perf_bundle._png(plt, fig)


def plot_trace_replay(names: Sequence[str], bundles: Sequence[dict[str, Any]]) -> bytes:
    plt, (fig, ax) = perf_bundle._figure(7.2, 4.0)
    shown, inf, pooled = [], [], []
    for name, b in zip(names, bundles):
        w = b["workloads"].get("trace_replay") or {}
        if w.get("status") != "ok":
            continue
        shown.append(name)
        inf.append(w["vs_bound_infinite"])
        pooled.append(w.get("vs_bound_pooled"))
    xs = list(range(len(shown)))
    ax.bar([x - 0.2 for x in xs], inf, width=0.4, label="hit ratio / infinite-cache bound")
    ax.bar([x + 0.2 for x in xs], [0 if p is None else p for p in pooled], width=0.4,
           label="hit ratio / pooled bound (0: no capacity declared)")  # fmt: skip
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(xs, shown, rotation=30, ha="right", fontsize="small")
    ax.set(ylabel="fraction of the bound", title="trace replay: hit ratio against its bounds")
    _legend(ax, [n for n in names if n not in shown])
    return perf_bundle._png(plt, fig)


COMBINED_PLOTS = {
    "latency_vs_clients.png": plot_latency,
    "bandwidth_vs_size.png": plot_bandwidth,
    "invalidation_vs_holders.png": plot_invalidation,
    "trace_replay.png": plot_trace_replay,
}


def write_plots(out: Path, names: Sequence[str], bundles: Sequence[dict[str, Any]]) -> list[Path]:
    """Draw every combined plot into ``out`` (created if missing); the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for file, draw in COMBINED_PLOTS.items():
        path = out / file
        path.write_bytes(draw(names, bundles))
        written.append(path)
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="bundles written by kvcc bench suite")
    parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    parser.add_argument("--plots", type=Path, metavar="DIR", default=None,
                        help="also draw the bundles together into PNG plots in DIR")


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
    plotted: list[Path] = []
    if args.plots is not None:
        try:
            plotted = write_plots(args.plots, [f"{b['run']['adapter']} ({b['run']['profile']})" for b in bundles], bundles)
        except OSError as e:
            print(f"kvcc bench compare: error: cannot write plots to {args.plots}: {e}", file=sys.stderr)
            return 2
    if args.json:
        print_json({
            "bundles": [{"dir": str(d), "adapter": b["run"]["adapter"], "profile": b["run"]["profile"],
                         "date": b["run"]["date"]} for d, b in zip(args.dirs, bundles)],
            "workloads": {w: {label: [None if c is None else c[0] for c in cells] for label, cells in rows.items()}
                          for w, rows in table.items()},
            **({"plots": [str(p) for p in plotted]} if args.plots is not None else {}),
        })  # fmt: skip
    else:
        render(stdout_console(), [column_name(b, d) for d, b in zip(args.dirs, bundles)], table)
        for p in plotted:
            print(f"plot: {p}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcc.bench.compare", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return cli(parser.parse_args(list(argv) if argv is not None else None))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
