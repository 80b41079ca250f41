"""The performance suite's bundle: what ``kvcc bench suite`` leaves behind and ``kvcc bench
compare`` reads back.

Layout of ``DIR``::

    results.json                   every workload's figures, status and baseline, and the run's
                                   info (adapter, versions(), profile, seed, python, platform, CPUs, date)
    latency_vs_clients.png         lease and lookup p50/p99 latency and ops/s per client count
    bandwidth_vs_size.png          read and write bandwidth over the raw copy per block size
    invalidation_vs_holders.png    invalidation completion per number of holders
    report.html                    self-contained: the tables and the plots embedded
    MANIFEST                       "<sha256>  <path>" for every file above, sorted by path

A plot is written only for a workload that ran. The manifest is written last (a bundle with a
manifest is complete), and ``verify`` rejects a bundle in which any file differs from it, is
missing, or is not listed: figures someone edited are not figures the suite measured.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcc.console import jsonable

MANIFEST = "MANIFEST"
RESULTS = "results.json"
FORMAT = "kvcc-perf-suite/1"  # results.json's "format"
KiB = 1 << 10


class BundleError(Exception):
    """A directory that is not a complete, unmodified bundle (the message says why)."""


# ------------------------------------------------------------------------------------ metrics


def size_text(n: int) -> str:
    return f"{n // (1 << 20)} MiB" if n >= 1 << 20 else f"{n // KiB} KiB"


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _ratio(x: float | None) -> str:
    """Three significant digits: a ratio of 0.0004 is a finding, not 0.000."""
    return "-" if x is None else f"{x:.3g}"


Metric = tuple[Any, str]  # (value for JSON, text for a table)


def _lease_metrics(w: dict[str, Any]) -> dict[str, Metric]:
    out: dict[str, Metric] = {}
    for r in w["rows"]:
        at = f"{r['op']}, {r['clients']} client(s)"
        out[f"{at}: p50 µs"] = (r["p50_us"], _num(r["p50_us"], 1))
        out[f"{at}: p99 µs"] = (r["p99_us"], _num(r["p99_us"], 1))
        out[f"{at}: ops/s"] = (r["ops_per_s"], _num(r["ops_per_s"], 0))
        out[f"{at}: vs 1 client"] = (r["vs_1_client"], _ratio(r["vs_1_client"]))
        if r["failed"]:
            out[f"{at}: failed ops"] = (r["failed"], str(r["failed"]))
    return out


def _bandwidth_metrics(w: dict[str, Any]) -> dict[str, Metric]:
    out: dict[str, Metric] = {}
    for r in w["rows"]:
        at = size_text(r["size"])
        if "refused" in r:
            out[f"{at}: refused"] = (r["refused"], r["refused"])
            continue
        for op in ("write", "read"):
            out[f"{at}: {op} MB/s"] = (r[f"{op}_bytes_per_s"], _num(r[f"{op}_bytes_per_s"] / 1e6, 1))
            out[f"{at}: {op} vs raw"] = (r[f"{op}_vs_raw"], _ratio(r[f"{op}_vs_raw"]))
        out[f"{at}: raw MB/s"] = (r["raw_bytes_per_s"], _num(r["raw_bytes_per_s"] / 1e6, 1))
    return out


def _invalidation_metrics(w: dict[str, Any]) -> dict[str, Metric]:
    out: dict[str, Metric] = {}
    for r in w["rows"]:
        at = f"by {r['mode']}, {r['holders']} holder(s)"
        out[f"{at}: p50 ms"] = (r["p50_ms"], _num(r["p50_ms"], 3))
        out[f"{at}: grants"] = (r["grants"], f"{r['grants']} of {r['holders'] * r['reps']}")
        ratio = "vs_term_plus_skew" if r["mode"] == "expiry" else "vs_0_holders"
        out[f"{at}: {ratio.replace('_', ' ')}"] = (r.get(ratio), _ratio(r.get(ratio)))
    if w.get("expiry_skipped"):
        out["by expiry: skipped"] = (w["expiry_skipped"], w["expiry_skipped"])
    return out


def _trace_metrics(w: dict[str, Any]) -> dict[str, Metric]:
    out: dict[str, Metric] = {
        "requests": (w["requests"], f"{w['requests']:,}"),
        "hit ratio": (w["hit_ratio"], _num(w["hit_ratio"], 4)),
        "bound_infinite": (w["bound_infinite"], _num(w["bound_infinite"], 4)),
        "hit vs bound_infinite": (w["vs_bound_infinite"], _ratio(w["vs_bound_infinite"])),
        "bound_pooled (declared capacity)": (w.get("bound_pooled"), _num(w.get("bound_pooled"), 4)),
        "hit vs bound_pooled": (w.get("vs_bound_pooled"), _ratio(w.get("vs_bound_pooled"))),
        "bytes moved": (w["bytes_moved"], f"{w['bytes_moved'] / (1 << 20):,.1f} MiB"),
        "lookup+reads per request p50 ms": (w["cache_ms_p50"], _num(w["cache_ms_p50"], 3)),
        "writes per request p50 ms": (w["write_ms_p50"], _num(w["write_ms_p50"], 3)),
        "modelled TTFT mean ms": (w["ttft_ms_mean"], _num(w["ttft_ms_mean"], 1)),
        "TTFT vs no cache": (w["vs_no_cache"], _ratio(w["vs_no_cache"])),
    }
    for what, n in sorted(w["refused"].items()):
        out[f"refused {what}"] = (n, f"{n:,}")
    return out


METRICS: dict[str, Callable[[dict[str, Any]], dict[str, Metric]]] = {
    "lease_lookup": _lease_metrics, "bandwidth": _bandwidth_metrics,
    "invalidation": _invalidation_metrics, "trace_replay": _trace_metrics,
}  # fmt: skip


def metrics(results: dict[str, Any]) -> dict[str, dict[str, Metric]]:
    """Workload -> metric label -> (value, text): one flat view of a run, for the console and
    for ``compare`` (a skipped or failed workload is one ``status`` metric saying why)."""
    out: dict[str, dict[str, Metric]] = {}
    for name, w in results["workloads"].items():
        if w["status"] == "ok":
            out[name] = METRICS[name](w)
        else:
            why = w.get("reason") or w.get("error") or ""
            out[name] = {"status": (f"{w['status']}: {why}", f"{w['status']}: {why}")}
    return out


def render(console: Any, results: dict[str, Any]) -> None:
    """One table per workload on the console, each titled with what it was measured against."""
    from rich.table import Table

    run = results["run"]
    console.print(f"[bold]kvcc bench suite[/]: adapter {run['adapter']}, profile {run['profile']}, seed {run['seed']}")
    for name, rows in metrics(results).items():
        w = results["workloads"][name]
        t = Table(title=f"{name} ({w['status']}, {w.get('seconds', 0):.1f} s)", title_justify="left")
        t.add_column("metric")
        t.add_column("value", justify="right")
        for label, (_, text) in rows.items():
            t.add_row(label, text)
        console.print(t)
        if w.get("baseline"):
            console.print(f"[dim]against: {w['baseline']}[/]")


# -------------------------------------------------------------------------------------- plots


def _figure(width: float = 6.4, height: float = 3.6):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    return plt, plt.subplots(figsize=(width, height))


def _png(plt: Any, fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def plot_latency(w: dict[str, Any]) -> bytes:
    plt, (fig, ax) = _figure()
    for op in dict.fromkeys(r["op"] for r in w["rows"]):
        rows = [r for r in w["rows"] if r["op"] == op]
        xs = [r["clients"] for r in rows]
        ax.plot(xs, [r["p50_us"] for r in rows], marker="o", label=f"{op} p50")
        ax.plot(xs, [r["p99_us"] for r in rows], marker="x", linestyle="--", label=f"{op} p99")
    ax.set(xlabel="concurrent clients", ylabel="latency (µs)", title="lease and lookup latency vs clients")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_yscale("log")
    ax.legend(fontsize="small")
    return _png(plt, fig)


def plot_bandwidth(w: dict[str, Any]) -> bytes:
    plt, (fig, ax) = _figure()
    rows = [r for r in w["rows"] if "refused" not in r]
    for op in ("write", "read"):
        ax.plot([r["size"] for r in rows], [r[f"{op}_vs_raw"] for r in rows], marker="o", label=op)
    ax.axhline(1.0, color="grey", linewidth=0.8, label="raw copy")
    ax.set(xlabel="block size", ylabel="bandwidth / raw copy", title="bandwidth vs block size")
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["size"] for r in rows], [size_text(r["size"]) for r in rows])
    ax.legend(fontsize="small")
    return _png(plt, fig)


def plot_invalidation(w: dict[str, Any]) -> bytes:
    plt, (fig, ax) = _figure()
    ack = [r for r in w["rows"] if r["mode"] == "ack"]
    ax.plot([r["holders"] for r in ack], [r["p50_ms"] for r in ack], marker="o", label="by ack (p50)")
    ax.plot([r["holders"] for r in ack], [r["max_ms"] for r in ack], marker="x", linestyle="--", label="by ack (max)")
    for r in (r for r in w["rows"] if r["mode"] == "expiry"):
        ax.scatter([r["holders"]], [r["p50_ms"]], color="red", label="by expiry (p50)")
        ax.axhline(r["term_plus_skew_ms"], color="grey", linewidth=0.8, label="term + epsilon")
    ax.set_xticks(sorted({r["holders"] for r in w["rows"]}))
    ax.set(xlabel="holders of read leases", ylabel="completion (ms)", title="invalidation vs holders")
    ax.legend(fontsize="small")
    return _png(plt, fig)


PLOTS: dict[str, tuple[str, Callable[[dict[str, Any]], bytes]]] = {
    "lease_lookup": ("latency_vs_clients.png", plot_latency),
    "bandwidth": ("bandwidth_vs_size.png", plot_bandwidth),
    "invalidation": ("invalidation_vs_holders.png", plot_invalidation),
}


def plots(results: dict[str, Any]) -> dict[str, bytes]:
    """File name -> PNG for each plotted workload that ran and has something to plot."""
    out = {}
    for name, (file, draw) in PLOTS.items():
        w = results["workloads"].get(name, {})
        if w.get("status") == "ok" and any("refused" not in r for r in w["rows"]):
            out[file] = draw(w)
    return out


# --------------------------------------------------------------------------------------- html


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {n}" for k, n in v.items()) or "-"
    return "-" if v is None else str(v)


def _rows_table(rows: list[dict[str, Any]]) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _workload_html(name: str, w: dict[str, Any], pngs: dict[str, bytes]) -> str:
    parts = [f"<h2>{html.escape(name)}</h2><p>status: <b>{html.escape(w['status'])}</b>"
             f" ({w.get('seconds', 0):.1f} s)</p>"]  # fmt: skip
    for field in ("reason", "error", "baseline", "timed", "ttft_model", "expiry_skipped"):
        if w.get(field):
            parts.append(f"<p>{field}: {html.escape(str(w[field]))}</p>")
    if w["status"] == "ok":
        rows = w.get("rows") or [{k: v for k, v in w.items() if k not in ("status", "baseline", "ttft_model")}]
        parts.append(_rows_table(rows))
    file = PLOTS.get(name, ("", None))[0]
    if file in pngs:
        data = base64.b64encode(pngs[file]).decode()
        parts.append(f'<p><img alt="{file}" src="data:image/png;base64,{data}"></p>')
    return "\n".join(parts)


def report_html(results: dict[str, Any], pngs: dict[str, bytes]) -> str:
    """A page that opens from disk: the run's info, then each workload's table and plot."""
    run = results["run"]
    info = {k: v for k, v in run.items() if k not in ("capabilities", "profile_params")}
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:.5em 0}"
             "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}th{background:#eee}")  # fmt: skip
    body = [f"<h1>kvcc bench suite: {html.escape(str(run['adapter']))}</h1>", _rows_table([jsonable(info)])]
    body += [_workload_html(name, w, pngs) for name, w in results["workloads"].items()]
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>kvcc bench suite: "
            f"{html.escape(str(run['adapter']))}</title><style>{style}</style></head><body>"
            + "\n".join(body) + "</body></html>\n")  # fmt: skip


# ------------------------------------------------------------------------------ write, verify


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def manifest_text(root: Path) -> str:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    return "".join(f"{sha256_file(p)}  {p.relative_to(root).as_posix()}\n" for p in files)


def write_bundle(results: dict[str, Any], out: Path) -> Path:
    """Write the bundle of ``results`` into ``out`` (existing; the caller checked it is empty)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pngs = plots(results)
    _write(out / RESULTS, (json.dumps(jsonable(results), indent=2, allow_nan=False) + "\n").encode())
    for file, data in pngs.items():
        _write(out / file, data)
    _write(out / "report.html", report_html(results, pngs).encode())
    _write(out / MANIFEST, manifest_text(out).encode())
    return out


def verify(root: Path) -> list[str]:
    """What is wrong with the bundle at ``root``: empty when every file matches its MANIFEST line
    and every file is listed."""
    root = Path(root)
    if not (root / MANIFEST).is_file():
        return [f"{root}: no {MANIFEST}"]
    problems, listed = [], set()
    for n, line in enumerate((root / MANIFEST).read_text(encoding="utf-8").splitlines(), start=1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or not name or ".." in Path(name).parts or Path(name).is_absolute():
            problems.append(f"{MANIFEST}:{n}: malformed line")
            continue
        listed.add(name)
        path = root / name
        if not path.is_file():
            problems.append(f"{name}: listed in {MANIFEST} but missing")
        elif sha256_file(path) != digest:
            problems.append(f"{name}: sha256 differs from {MANIFEST} (the file was changed)")
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST):
        if path.relative_to(root).as_posix() not in listed:
            problems.append(f"{path.relative_to(root).as_posix()}: not in {MANIFEST}")
    if RESULTS not in listed:
        problems.append(f"{RESULTS}: not in {MANIFEST}")
    return problems


def load(root: Path) -> dict[str, Any]:
    """The results of a verified bundle; ``BundleError`` saying why otherwise."""
    root = Path(root)
    if not root.is_dir():
        raise BundleError(f"{root}: not a directory")
    problems = verify(root)
    if problems:
        raise BundleError(f"{root} does not verify: " + "; ".join(problems))
    results = json.loads((root / RESULTS).read_text(encoding="utf-8"))
    if not isinstance(results, dict) or results.get("format") != FORMAT:
        raise BundleError(f"{root}: {RESULTS} is not a {FORMAT} result")
    return results
