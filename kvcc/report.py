"""Rich rendering of kvcc's results: model-checking runs, counterexamples, mutants, proofs.

Every renderer takes the plain JSON-shaped dicts the commands produce (``CheckResult.to_json()``
and friends), not the checker's objects, so a stored ``--json`` report renders the same way as a
live run. Nothing here decides a verdict; ``kvcc.cli`` does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

VERDICT_STYLE = {
    "holds": "green",
    "reached": "green",
    "violated": "bold red",
    "unreached": "yellow",
}

# Values a variable holds in the all-zero state, when the layout cannot be asked (see init_defaults).
_DEFAULT_TEXTS = frozenset({"", "0", "-", "NONE", "EMPTY", "ABSENT"})


# ---------------------------------------------------------------------------------------- numbers


def fmt_int(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def fmt_rate(x: float | None) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:,.0f}"


def fmt_seconds(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if x >= 0.01 else f"{x:.3f}"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} GiB"  # pragma: no cover


# ------------------------------------------------------------------------------------ properties


def property_kinds() -> dict[str, str]:
    """``name -> "invariant" | "transition" | "sometimes"`` (``progress`` for bounded response),
    from ``kvcc.spec.properties``; empty when that module cannot be read."""
    try:
        from kvcc.spec import properties as P
    except Exception:  # noqa: BLE001 - the spec is edited concurrently; degrade to verdict-based kinds
        return {}
    kinds: dict[str, str] = {}
    for inv in getattr(P, "INVARIANTS", ()):
        kinds[inv.name] = "invariant" if getattr(inv, "kind", "safety") == "safety" else f"invariant ({inv.kind})"
    for tp in getattr(P, "TRANSITION_PROPERTIES", ()):
        kinds[tp.name] = "transition" if getattr(tp, "kind", "safety") == "safety" else f"transition ({tp.kind})"
    for sm in getattr(P, "SOMETIMES", ()):
        kinds[sm.name] = "sometimes"
    return kinds


def _kind_of(name: str, verdict: str, kinds: Mapping[str, str]) -> str:
    if name in kinds:
        return kinds[name]
    return "sometimes" if verdict in ("reached", "unreached") else "safety"


# ------------------------------------------------------------------------------------ check runs


class CheckProgress:
    """A live line (depth, distinct states, frontier, rate) fed by the checker's ``progress``
    callback, which it calls once per breadth-first level. Silent unless the console is a
    terminal, so that piped output and tests see only the final report."""

    def __init__(self, console: Console, label: str, enabled: bool | None = None) -> None:
        self.console = console
        self.label = label
        self.enabled = console.is_terminal if enabled is None else enabled
        self.started = time.perf_counter()
        self.last: tuple[int, int, int] = (0, 0, 0)
        self._live: Live | None = None

    def _render(self) -> Text:
        depth, distinct, frontier = self.last
        elapsed = time.perf_counter() - self.started
        rate = distinct / elapsed if elapsed > 0 else 0.0
        t = Text()
        t.append("checking ", style="bold")
        t.append(self.label, style="bold cyan")
        t.append(f"  depth {depth}  distinct {distinct:,}  frontier {frontier:,}  ")
        t.append(f"{rate:,.0f} states/s  {elapsed:.1f}s", style="dim")
        return t

    def __call__(self, depth: int, distinct: int, frontier: int) -> None:
        self.last = (depth, distinct, frontier)
        if self._live is not None:
            self._live.update(self._render(), refresh=True)

    def __enter__(self) -> CheckProgress:
        self.started = time.perf_counter()
        if self.enabled:
            self._live = Live(self._render(), console=self.console, transient=True, refresh_per_second=4,
                              get_renderable=self._render)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)  # type: ignore[arg-type]
            self._live = None


def summary_table(res: Mapping[str, Any], max_states: int | None = None) -> Table:
    t = Table(title="Model check", box=box.SIMPLE_HEAVY, show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    t.add_row("config", str(res.get("config")))
    if res.get("mutant"):
        t.add_row("mutant", Text(str(res["mutant"]), style="magenta"))
    distinct = Text(fmt_int(res.get("distinct_states")))
    if res.get("truncated"):
        distinct.append(f"  (truncated at --max-states {fmt_int(max_states)}: not exhaustive)" if max_states
                        else "  (truncated: not exhaustive)", style="yellow")
    t.add_row("distinct states", distinct)
    t.add_row("generated", fmt_int(res.get("generated_states")))
    t.add_row("depth", fmt_int(res.get("depth")))
    t.add_row("seconds", fmt_seconds(res.get("seconds")))
    t.add_row("states/s", fmt_rate(res.get("states_per_second")))
    cp = res.get("collision_probability")
    t.add_row("collision probability", "-" if cp is None else f"{cp:.2e}")
    if res.get("deadlocks"):
        t.add_row("deadlocks", Text(fmt_int(res["deadlocks"]), style="red"))
    return t


def properties_table(res: Mapping[str, Any]) -> Table:
    kinds = property_kinds()
    partial = bool(res.get("truncated"))
    t = Table(title="Properties", box=box.SIMPLE, title_justify="left")
    t.add_column("property")
    t.add_column("kind", style="dim")
    t.add_column("verdict")
    for name, verdict in (res.get("properties") or {}).items():
        shown = verdict + ("*" if partial and verdict == "holds" else "")
        t.add_row(name, _kind_of(name, verdict, kinds), Text(shown, style=VERDICT_STYLE.get(verdict, "")))
    if partial:
        t.caption = "* within the explored states only: the run was truncated"
    return t


def render_manifest(console: Console, manifest: Mapping[str, Any] | None) -> None:
    """``manifest``: ``{"status": "match"|"mismatch"|"absent"|"unpinned"|"skipped", "expected", "actual", "why"}``."""
    if not manifest:
        return
    status = manifest.get("status")
    if status == "match":
        console.print(Text.assemble(("manifest: ", "bold"), ("match", "green"),
                                    f"  (pinned {manifest.get('expected')})"))
    elif status == "mismatch":
        console.print(Text.assemble(("manifest: ", "bold"), ("MISMATCH", "bold red"),
                                    f"  pinned {manifest.get('expected')}, got {manifest.get('actual')}"))
    elif manifest.get("why"):
        console.print(Text.assemble(("manifest: ", "bold"), (str(manifest["why"]), "dim")))


def init_defaults(config_name: str | None) -> dict[str, str]:
    """Each variable's text in the all-zero state, from the spec's layout; empty if unavailable."""
    if not config_name:
        return {}
    try:
        from kvcc.spec.config import get_config
        from kvcc.spec.layout import Layout

        L = Layout(get_config(config_name))
        return {name: L.value_text(i, 0) for i, name in enumerate(L.names)}
    except Exception:  # noqa: BLE001 - decoration only: fall back to a fixed set of default texts
        return {}


def _is_message(name: str) -> bool:
    return name.startswith("net: ")


def _action_text(action: str, params: Sequence[Any]) -> Text:
    t = Text(action, style="bold cyan")
    if params:
        t.append("(" + ", ".join(str(p) for p in params) + ")", style="cyan")
    return t


def init_lines(changes: Mapping[str, Sequence[Any]], defaults: Mapping[str, str]) -> tuple[list[str], int]:
    """The initial state, compactly: ``name=value`` for every variable whose value is not its
    all-zero default, then the messages in flight. Returns (lines, how many defaults were hidden)."""
    shown: list[str] = []
    hidden = 0
    for name, (_, value) in changes.items():
        if _is_message(name):
            continue
        default = defaults.get(name)
        is_default = (value == default) if default is not None else (value in _DEFAULT_TEXTS)
        if is_default:
            hidden += 1
        else:
            shown.append(f"{name}={value}")
    shown += [f"{name} in flight" for name in changes if _is_message(name)]
    return shown, hidden


def change_lines(changes: Mapping[str, Sequence[Any]]) -> list[Text]:
    """One line per changed variable, ``name: before -> after``; messages as sent / gone."""
    lines: list[Text] = []
    for name, (before, after) in changes.items():
        if _is_message(name):
            msg = name[len("net: "):]
            if after == "gone":
                lines.append(Text.assemble(("  net - ", "dim"), (msg, ""), ("  (gone)", "dim")))
            else:
                lines.append(Text.assemble(("  net + ", "dim"), (msg, ""), ("  (sent)", "dim")))
        else:
            lines.append(Text.assemble(f"  {name}: ", (str(before), "red"), " -> ", (str(after), "green")))
    return lines


def render_trace(console: Console, violation: Mapping[str, Any], config_name: str | None = None) -> None:
    """The shortest counterexample, step by step: action and params, then only what changed."""
    trace = violation.get("trace") or []
    steps = violation.get("steps", max(len(trace) - 1, 0))
    head = Text.assemble(
        ("Counterexample: ", "bold"), (str(violation.get("property")), "bold red"),
        f" ({violation.get('kind')}) violated after {steps} step{'s' if steps != 1 else ''}",
    )
    console.print(head)
    if not trace:
        console.print(Text("  (no trace recorded)", style="dim"))
        return
    defaults = init_defaults(config_name)
    last = len(trace) - 1
    for i, step in enumerate(trace):
        header = Text(f"Step {step.get('step', i)}  ", style="bold")
        header.append_text(_action_text(str(step.get("action")), step.get("params") or []))
        if i == last:
            header.append(f"   <- violates {violation.get('property')}", style="bold red")
        console.print(header)
        changes = step.get("changes") or {}
        if step.get("action") == "init":
            shown, hidden = init_lines(changes, defaults)
            body = Text("  " + ", ".join(shown) if shown else "  (every variable at its default)")
            if hidden:
                body.append(f"  (+{hidden} at default)", style="dim")
            console.print(body)
        elif not changes:
            console.print(Text("  (no variable changed)", style="dim"))
        else:
            for line in change_lines(changes):
                console.print(line)


def render_check(console: Console, res: Mapping[str, Any], manifest: Mapping[str, Any] | None = None,
                 max_states: int | None = None) -> None:
    console.print(summary_table(res, max_states))
    console.print(properties_table(res))
    for name, why in (res.get("exempt_sometimes") or {}).items():
        console.print(Text(f"  {name}: out of scope: {why}", style="dim"), soft_wrap=True)
    refuted = res.get("refuted_exemptions") or []
    if refuted:
        console.print(Text.assemble(("argued out of scope but reached or covered: ", "bold red"), ", ".join(refuted)))
    uncovered = res.get("uncovered_actions") or []
    if uncovered:
        console.print(Text.assemble((f"uncovered actions ({len(uncovered)}): ", "yellow"), ", ".join(uncovered)))
    else:
        console.print(Text("every action covered", style="green"))
    render_manifest(console, manifest)
    if res.get("violation"):
        console.print()
        render_trace(console, res["violation"], res.get("config"))


def verdict_line(ok: bool, what: str, detail: str = "") -> Text:
    t = Text()
    t.append("PASS " if ok else "FAIL ", style="bold green" if ok else "bold red")
    t.append(what, style="bold")
    if detail:
        t.append("  " + detail, style="dim" if ok else "")
    return t


def check_detail(res: Mapping[str, Any], manifest: Mapping[str, Any] | None = None) -> str:
    parts = [f"{fmt_int(res.get('distinct_states'))} states", f"{fmt_seconds(res.get('seconds'))}s",
             f"{fmt_rate(res.get('states_per_second'))} states/s"]
    if res.get("truncated"):
        parts.append("truncated")
    v = res.get("violation")
    if v:
        parts.append(f"{v.get('property')} violated in {v.get('steps')} steps")
    unreached = [n for n, s in (res.get("properties") or {}).items() if s == "unreached"]
    if unreached and not v and not res.get("truncated"):
        parts.append("unreached: " + ", ".join(unreached))
    if manifest and manifest.get("status") in ("match", "mismatch"):
        parts.append(f"manifest {manifest['status']}")
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------- mutants


def mutants_table(rows: Iterable[Mapping[str, Any]]) -> Table:
    t = Table(title="Mutants", box=box.SIMPLE, title_justify="left", pad_edge=False)
    t.add_column("mutant", overflow="fold")
    t.add_column("config", style="dim", overflow="fold")
    t.add_column("expected property", overflow="fold")
    t.add_column("verdict", min_width=6, overflow="fold")
    t.add_column("steps", justify="right", no_wrap=True)
    t.add_column("states", justify="right", no_wrap=True)
    t.add_column("seconds", justify="right", no_wrap=True)
    for r in rows:
        if r.get("error"):
            verdict = Text(f"error: {r['error']}", style="bold red")
        elif r.get("caught"):
            verdict = Text("caught", style="green")
        elif r.get("caught_by"):
            verdict = Text(f"caught by {r['caught_by']} instead", style="bold red")
        elif r.get("truncated"):
            verdict = Text("not caught (search truncated)", style="yellow")
        else:
            verdict = Text("NOT CAUGHT", style="bold red")
        t.add_row(
            str(r.get("name")), str(r.get("config")), str(r.get("expected_property")), verdict,
            "-" if r.get("steps") is None else str(r["steps"]),
            fmt_int(r.get("distinct_states")), fmt_seconds(r.get("seconds")),
        )
    return t


# ----------------------------------------------------------------------------------------- proofs


def proofs_table(obligations: Iterable[Mapping[str, Any]]) -> Table:
    t = Table(title="Proof obligations", box=box.SIMPLE, title_justify="left")
    t.add_column("action")
    t.add_column("invariant")
    t.add_column("verdict")
    t.add_column("seconds", justify="right")
    for o in obligations:
        proved = bool(o.get("proved"))
        t.add_row(str(o.get("action")), str(o.get("invariant")),
                  Text("proved" if proved else "FAILED", style="green" if proved else "bold red"),
                  fmt_seconds(o.get("seconds")))
    return t


def render_counterexample(console: Console, title: str, cex: Any) -> None:
    console.print(Text(title, style="bold red"))
    if cex is None:
        console.print(Text("  (no counterexample given)", style="dim"))
    elif isinstance(cex, Mapping):
        for k, v in cex.items():
            if isinstance(v, Mapping):
                console.print(Text(f"  {k}:", style="bold"))
                for k2, v2 in v.items():
                    console.print(f"    {k2} = {v2}", markup=False, highlight=False)
            else:
                console.print(f"  {k} = {v}", markup=False, highlight=False)
    else:
        for line in str(cex).splitlines() or [""]:
            console.print("  " + line, markup=False, highlight=False)
