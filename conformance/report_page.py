"""The bundle's ``report.html``: one self-contained page a reviewer reads instead of the NDJSON.

For every test: the statement it checks and the spec properties behind it (from the catalogue
and ``kvcc.spec.properties``), the outcome and the trace verdict -- for a rejection, the event
the validator could not explain, the events just before it, the reason and the diff (the
states that came closest and what each needed) --, the audit counters, and a timeline of the
trace: one row per process, read and write leases as bars from grant to their end (release,
acknowledged revocation, commit, expiry), invalidations, crashes, restarts and refusals as
marks, every event a dot with its fields on hover, and the rejected event as a red line.

Everything a vendor's adapter logged (node names, keys, field names and values) is escaped
(``html.escape`` with quotes) before it is written, in text and in attributes alike; the page
has no script, no stylesheet or font from elsewhere, and opens from disk.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Sequence
from typing import Any

from .catalogue import BY_ID

STATUS_COLOURS = {"PASS": "#1a7f37", "FAIL": "#cf222e", "ERROR": "#9a6700", "SKIP": "#57606a",
                  "NOT_APPLICABLE": "#57606a"}  # fmt: skip
VERDICT_COLOURS = {"ACCEPTED": "#1a7f37", "REJECTED": "#cf222e", "INCONCLUSIVE": "#9a6700"}
MAX_TIMELINE_EVENTS = 2_000  # a longer trace is drawn around its rejected event (or from its start)
CONTEXT_EVENTS = 5  # events shown before a rejected one
ROW_HEIGHT_PX = 24
LABEL_WIDTH_PX = 150
PLOT_WIDTH_PX = 860
AXIS_HEIGHT_PX = 22
READ_COLOUR, WRITE_COLOUR = "#0969da", "#bc4c00"
# How a lease ends, by the event that ends it (matched on the lease id).
READ_LEASE_ENDS = ("release_lease", "revoke_acked")
WRITE_LEASE_ENDS = ("commit_write", "reject_stale_commit", "expire_write_lease", "expire_write_lease_of_crashed")
# Marks: event -> (the field naming the row it belongs on, or None for its own process; shape; colour).
MARKS = {
    "invalidate": (None, "down", "#8250df"),
    "invalidate_namespace": (None, "down", "#8250df"),
    "complete_invalidation": (None, "up", "#8250df"),
    "crash": ("crashed", "cross", "#cf222e"),
    "declare_node_down": ("down", "cross", "#57606a"),
    "restart_node": ("rejoined", "bar", "#1f2328"),
    "restart_directory": (None, "bar", "#1f2328"),
    "fence_stale_write": (None, "cross", "#bc4c00"),
    "reject_stale_commit": (None, "cross", "#bc4c00"),
    "refuse_read_lease": ("holder", "tick", "#57606a"),
    "refuse_write_lease": ("writer", "tick", "#57606a"),
    "refuse_renewal": ("holder", "tick", "#57606a"),
    "evict_refused": (None, "tick", "#57606a"),
}


def e(value: Any) -> str:
    """Any value as escaped text (quotes too: the same text goes into attributes)."""
    return html.escape(value if isinstance(value, str) else str(value), quote=True)


def report_html(report: Any, info: dict[str, Any]) -> str:
    """The page for ``report`` (a ``runner.Report``) and its ``run_info``."""
    counts = ", ".join(f"{k} {v}" for k, v in report.counts().items() if v)
    verdict = "CERTIFIED" if report.certified else "NOT CERTIFIED"
    summary = "".join(_summary_row(r) for r in report.results)
    sections = "".join(_section(r, report.params) for r in report.results)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>kvcc conformance: {e(report.adapter)}</title>
<style>{_STYLE}</style>
</head><body>
<h1>kvcc conformance report: {e(report.adapter)}</h1>
<p><b>{verdict}</b> for profiles {e(", ".join(report.claimed) or "(none claimed)")} &mdash; {e(counts)}</p>
<p>Suite {e(report.suite_version)}, harness commit <code>{e(info["git"].get("commit"))}</code>
(dirty: {e(info["git"].get("dirty"))}), seed {e(report.seed)}, {e(json.dumps(report.params))},
{e(info["started_at"])} to {e(info["finished_at"])}.</p>
<p>Versions: {e(json.dumps(report.versions))}</p>
<table><tr><th>id</th><th>profile</th><th>status</th><th>trace</th><th>s</th><th>test</th></tr>
{summary}
</table>
<p>Re-verify with <code>kvcc certify verify DIR</code>. Each test below: what it checks, its verdict, its audit
counters and its trace's timeline (hover a mark or a bar for its event).</p>
{sections}
</body></html>
"""


_STYLE = (
    "body{font-family:sans-serif;margin:2em;color:#1f2328}table{border-collapse:collapse}"
    "td,th{border:1px solid #d0d7de;padding:4px 8px;vertical-align:top;text-align:left}"
    "section{border-top:2px solid #d0d7de;margin-top:1.5em}pre{background:#f6f8fa;padding:8px;overflow:auto;"
    "max-height:30em}.k{color:#57606a}.rej{background:#ffebe9}svg{font:11px sans-serif}"
    "details>summary{cursor:pointer;font-weight:bold}"
)


def _summary_row(r: Any) -> str:
    t = BY_ID[r.id]
    v = str(r.verdict.get("status", ""))
    return (f"<tr><td><a href='#{e(r.id)}'><code>{e(r.id)}</code></a></td><td>{e(r.profile)}</td>"
            f"<td style='color:{STATUS_COLOURS.get(r.status, '#1f2328')};font-weight:bold'>{e(r.status)}</td>"
            f"<td style='color:{VERDICT_COLOURS.get(v, '#1f2328')}'>{e(v)}</td><td>{r.duration_s:.2f}</td>"
            f"<td>{e(t.title)}<br><small>{e(r.message)}</small></td></tr>")  # fmt: skip


def _section(r: Any, params: dict[str, Any]) -> str:
    t = BY_ID[r.id]
    colour = STATUS_COLOURS.get(r.status, "#1f2328")
    files = ""
    if not t.audit and r.status not in ("SKIP", "NOT_APPLICABLE"):
        files = (f" &mdash; <a href='traces/{e(r.id)}.ndjson'>trace</a> "
                 f"<a href='traces/{e(r.id)}.history.json'>history</a>")  # fmt: skip
    parts = [
        f"<section id='{e(r.id)}'><h2><code>{e(r.id)}</code> {e(t.title)} "
        f"<span style='color:{colour}'>{e(r.status)}</span></h2>",
        f"<p>{e(t.text)}{files}</p>",
        _properties(t),
        f"<p><b>Outcome</b>: {e(r.status)}{' &mdash; ' + e(r.message) if r.message else ''}</p>",
        _verdict(r),
        _audit(r.audit),
    ]
    if r.events:
        parts.append(_timeline(r.events, r.verdict.get("event_index"), params))
    parts.append("</section>")
    return "\n".join(parts)


def _properties(t: Any) -> str:
    """The spec properties the test checks, each with the spec's own words for it."""
    items = []
    for name in t.properties:
        prop = _spec_property(name)
        text = getattr(prop, "text", "") if prop is not None else ""
        design = getattr(prop, "design", "") if prop is not None else ""
        kind = type(prop).__name__ if prop is not None else "property"
        where = f" (docs/protocol.md {e(design)})" if design else ""
        items.append(f"<li><b>{e(name)}</b> <span class='k'>{e(kind)}{where}</span>: {e(text)}</li>")
    design = f" docs/protocol.md sections {e(t.design)}." if t.design else ""
    return f"<p><b>Spec properties</b> checked ({e(t.profile)} profile).{design}</p><ul>{''.join(items)}</ul>"


def _spec_property(name: str) -> Any:
    from kvcc.spec import properties

    for prop in (*properties.INVARIANTS, *properties.TRANSITION_PROPERTIES, *properties.SOMETIMES):
        if prop.name == name:
            return prop
    return None


def _verdict(r: Any) -> str:
    v = r.verdict or {}
    status = str(v.get("status", "(none)"))
    out = [f"<p><b>Trace verdict</b>: <span style='color:{VERDICT_COLOURS.get(status, '#1f2328')};"
           f"font-weight:bold'>{e(status)}</span> &mdash; {e(v.get('reason', ''))}</p>"]  # fmt: skip
    index = v.get("event_index")
    if status == "REJECTED" and isinstance(index, int) and 0 <= index < len(r.events):
        out.append(f"<p>Rejected at event {index} of {len(r.events)} (0-based, in the trace's order); "
                   f"the {CONTEXT_EVENTS} events before it for context:</p>")  # fmt: skip
        out.append(_events_table(r.events, max(0, index - CONTEXT_EVENTS), index))
    diff = v.get("diff")
    if diff:
        out.append("<details open><summary>Diff: the closest states and what the event needed</summary>"
                   f"<pre>{e(json.dumps(diff, indent=1, sort_keys=True, default=str))}</pre></details>")  # fmt: skip
    names = v.get("names")
    if names and any(names.values()):
        out.append("<details><summary>Names: the adapter's own, as the validator saw them</summary>"
                   f"<pre>{e(json.dumps(names, indent=1, sort_keys=True, default=str))}</pre></details>")  # fmt: skip
    return "\n".join(out)


BOOKKEEPING_FIELDS = ("incarnation", "seq", "t_local_ns", "t_wall_ns")  # shown for the rejected event only


def _events_table(events: Sequence[dict], start: int, rejected: int) -> str:
    """Events ``start .. rejected`` (inclusive), one row each with its time since the trace's
    first event; the last one (the rejected event) highlighted, with every field it has (its
    clocks and sequence number too: a rejection may be about time)."""
    t0 = min((t for t in map(_time_ns, events) if t is not None), default=None)
    rows = []
    for i in range(start, rejected + 1):
        ev = events[i]
        hidden = ("node", "event") if i == rejected else ("node", "event", *BOOKKEEPING_FIELDS)
        fields = " ".join(f"<span class='k'>{e(k)}</span>={e(json.dumps(val, default=str))}"
                          for k, val in ev.items() if k not in hidden)  # fmt: skip
        t = _time_ns(ev)
        at = "" if t is None or t0 is None else f"+{(t - t0) / 1e6:.3f}"
        cls = " class='rej'" if i == rejected else ""
        rows.append(f"<tr{cls}><td>{i}</td><td>{at}</td><td>{e(ev.get('node'))}</td>"
                    f"<td><b>{e(ev.get('event'))}</b></td><td><small>{fields}</small></td></tr>")  # fmt: skip
    return ("<table><tr><th>#</th><th>ms</th><th>process</th><th>event</th><th>fields</th></tr>"
            f"{''.join(rows)}</table>")  # fmt: skip


def _audit(audit: dict[str, Any]) -> str:
    if not audit:
        return "<p><b>Audit counters</b>: none (no session).</p>"
    counters = ", ".join(f"<code>{e(k)}</code>={'<b>' + e(v) + '</b>' if v else e(v)}" for k, v in audit.items())
    return f"<p><b>Audit counters</b> (what the suite saw happen; non-zero in bold): {counters}</p>"


# ------------------------------------------------------------------------------------ timeline


def _window(n: int, rejected: int | None) -> tuple[int, int]:
    """Which events the timeline draws: all of them, or ``MAX_TIMELINE_EVENTS`` around the rejected one."""
    if n <= MAX_TIMELINE_EVENTS:
        return 0, n
    if rejected is None or not 0 <= rejected < n:
        return 0, MAX_TIMELINE_EVENTS
    start = max(0, min(rejected - MAX_TIMELINE_EVENTS // 2, n - MAX_TIMELINE_EVENTS))
    return start, start + MAX_TIMELINE_EVENTS


def _time_ns(ev: dict) -> int | None:
    t = ev.get("t_wall_ns")
    return t if type(t) is int else None


def _leases(events: Sequence[dict], t_end: int, term_ns: int) -> list[tuple[str, str, int, int, str]]:
    """``(kind, holder, start_ns, end_ns, how it ended)`` for every lease granted in ``events``:
    from its grant to the event that ended it, else to its expiry (the last grant or renewal plus
    the term), drawn no further than the trace's end."""
    open_: dict[tuple[str, Any], list] = {}
    out: list[tuple[str, str, int, int, str]] = []
    for ev in events:
        t, name, lease = _time_ns(ev), ev.get("event"), ev.get("lease")
        if t is None or lease is None:
            continue
        if name == "grant_read_lease":
            open_[("read", lease)] = ["read", str(ev.get("holder")), t, t]
        elif name == "grant_write_lease":
            open_[("write", lease)] = ["write", str(ev.get("writer")), t, t]
        elif name == "renew_lease" and ("read", lease) in open_:
            open_[("read", lease)][3] = t
        elif name in READ_LEASE_ENDS or name in WRITE_LEASE_ENDS:
            kind = "read" if name in READ_LEASE_ENDS else "write"
            bar = open_.pop((kind, lease), None)
            if bar is not None:
                out.append((bar[0], bar[1], bar[2], t, str(name)))
    for kind, holder, start, renewed in open_.values():
        end = renewed + term_ns
        out.append((kind, holder, start, min(end, t_end), "expired" if end <= t_end else "live at the trace's end"))
    return out


def _rows(events: Iterable[dict], leases: Iterable[tuple]) -> list[str]:
    """The directory first, then every other process or lease holder in name order; the fault
    injector gets no row (its crashes are drawn on the crashed node's)."""
    names = {str(ev.get("node")) for ev in events} | {holder for _, holder, *_ in leases}
    for ev in events:
        field = MARKS.get(ev.get("event"), (None,))[0]
        if field is not None and ev.get(field) is not None:
            names.add(str(ev.get(field)))
    names.discard("faults")
    first = ["directory"] if "directory" in names else []
    return first + sorted(names - {"directory"})


def _timeline(all_events: Sequence[dict], rejected: int | None, params: dict[str, Any]) -> str:
    start, stop = _window(len(all_events), rejected)
    events = all_events[start:stop]
    times = [t for t in map(_time_ns, events) if t is not None]
    if not times:
        return "<p>Timeline: the events carry no wall-clock time.</p>"
    t0, t1 = min(times), max(times)
    span = max(t1 - t0, 1)
    term_ns = int(params.get("lease_term_ms") or 0) * 1_000_000
    leases = _leases(events, t1, term_ns)
    rows = _rows(events, leases)
    y_of = {name: AXIS_HEIGHT_PX + i * ROW_HEIGHT_PX for i, name in enumerate(rows)}
    height = AXIS_HEIGHT_PX + len(rows) * ROW_HEIGHT_PX + 4
    width = LABEL_WIDTH_PX + PLOT_WIDTH_PX + 10

    def x(t: int) -> float:
        return round(LABEL_WIDTH_PX + (t - t0) * PLOT_WIDTH_PX / span, 1)

    svg = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' role='img' "
           f"aria-label='timeline'>"]  # fmt: skip
    for i, name in enumerate(rows):
        y = y_of[name]
        fill = "#f6f8fa" if i % 2 == 0 else "#ffffff"
        svg.append(f"<rect x='0' y='{y}' width='{width}' height='{ROW_HEIGHT_PX}' fill='{fill}'/>")
        svg.append(f"<text x='4' y='{y + 15}'>{e(name[:24])}<title>{e(name)}</title></text>")
    for k in range(6):  # the axis: milliseconds since the first event drawn
        t = t0 + span * k // 5
        svg.append(f"<line x1='{x(t)}' y1='{AXIS_HEIGHT_PX - 4}' x2='{x(t)}' y2='{height}' stroke='#d0d7de'/>")
        svg.append(f"<text x='{x(t)}' y='12' text-anchor='middle'>{_ms(t - t0, span)} ms</text>")
    for kind, holder, a, b, how in leases:
        if holder not in y_of:
            continue
        y = y_of[holder] + (3 if kind == "read" else 13)
        colour = READ_COLOUR if kind == "read" else WRITE_COLOUR
        svg.append(f"<rect x='{x(a)}' y='{y}' width='{max(round(x(b) - x(a), 1), 2)}' height='8' "
                   f"fill='{colour}' fill-opacity='0.45'><title>{e(kind)} lease of {e(holder)}: {_ms(a - t0, span)} "
                   f"ms to {_ms(b - t0, span)} ms, {e(how)}</title></rect>")  # fmt: skip
    for i, ev in enumerate(events, start):
        svg.append(_mark(ev, i, x, y_of))
    if rejected is not None and start <= rejected < stop and _time_ns(all_events[rejected]) is not None:
        xr = x(_time_ns(all_events[rejected]))  # type: ignore[arg-type]
        svg.append(f"<line x1='{xr}' y1='{AXIS_HEIGHT_PX - 6}' x2='{xr}' y2='{height}' stroke='#cf222e' "
                   f"stroke-width='2'><title>REJECTED: event {rejected}</title></line>")  # fmt: skip
    svg.append("</svg>")
    note = "" if (start, stop) == (0, len(all_events)) else f" (events {start} to {stop - 1} of {len(all_events)})"
    legend = (f"<span style='color:{READ_COLOUR}'>&#9644; read lease</span> "
              f"<span style='color:{WRITE_COLOUR}'>&#9644; write lease</span> "
              "<span style='color:#8250df'>&#9660; invalidate &#9650; completed</span> "
              "<span style='color:#cf222e'>&#10005; crash</span> &#9646; restart "
              "<span style='color:#bc4c00'>&#10005; fenced / stale commit</span> "
              "<span style='color:#57606a'>| refused</span> &middot; other event "
              "<span style='color:#cf222e'>| rejected event</span>")  # fmt: skip
    return (f"<details open><summary>Timeline{note}</summary><p><small>{legend}</small></p>"
            f"<div style='overflow-x:auto'>{''.join(svg)}</div></details>")  # fmt: skip


def _ms(ns: int, span_ns: int) -> str:
    """Milliseconds with as many decimals as a timeline of ``span_ns`` needs to tell ticks apart."""
    decimals = 0 if span_ns >= 50_000_000 else 1 if span_ns >= 5_000_000 else 2 if span_ns >= 500_000 else 3
    return f"{ns / 1e6:.{decimals}f}"


def _mark(ev: dict, index: int, x: Any, y_of: dict[str, int]) -> str:
    t = _time_ns(ev)
    if t is None:
        return ""
    name = ev.get("event")
    field, shape, colour = MARKS.get(name, (None, "dot", "#8c959f"))
    row = str(ev.get(field)) if field is not None and ev.get(field) is not None else str(ev.get("node"))
    if row not in y_of:
        return ""
    cx, cy = x(t), y_of[row] + ROW_HEIGHT_PX // 2
    fields = ", ".join(f"{k}={json.dumps(v, default=str)}" for k, v in ev.items())
    title = f"<title>#{index} {e(ev.get('node'))}: {e(name)} ({e(fields)})</title>"
    if shape == "dot":
        return f"<circle cx='{cx}' cy='{cy}' r='2' fill='{colour}'>{title}</circle>"
    if shape == "tick":
        return (f"<line x1='{cx}' y1='{cy - 5}' x2='{cx}' y2='{cy + 5}' stroke='{colour}' "
                f"stroke-width='2'>{title}</line>")  # fmt: skip
    if shape == "bar":
        return f"<rect x='{cx - 2}' y='{cy - 10}' width='4' height='20' fill='{colour}'>{title}</rect>"
    if shape == "cross":
        return (f"<path d='M{cx - 5},{cy - 5}L{cx + 5},{cy + 5}M{cx - 5},{cy + 5}L{cx + 5},{cy - 5}' "
                f"stroke='{colour}' stroke-width='2.5'>{title}</path>")  # fmt: skip
    points = (f"{cx - 6},{cy - 6} {cx + 6},{cy - 6} {cx},{cy + 5}" if shape == "down"
              else f"{cx - 6},{cy + 6} {cx + 6},{cy + 6} {cx},{cy - 5}")  # fmt: skip
    return f"<polygon points='{points}' fill='{colour}'>{title}</polygon>"
