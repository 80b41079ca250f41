"""Rejections in the adapter's own names: the validator's spec ids mapped back.

Theory of operation
-------------------
The validator replays each key of a trace through a one-key model whose nodes are ``n0, n1,
...``, whose locations are ``l0, l1, ...`` (the shared pool last), whose key is ``k0`` and whose
lease ids are the model's own, bound one-to-one to the trace's (``kvcc.conformance.validate``).
A rejection's ``diff`` speaks those ids: ``holder[n1,k0].lease = 1``,
``WriteBytes(from=n0, k0, lease=1, to=l0, ...)``. A vendor reading it has to redo the
validator's numbering to know that ``n1`` is ``cache-2``.

``rename_verdict(verdict, events, params)`` post-processes a verdict (``Verdict.to_json()``, or
the runner's dict) so that it reads in the trace's names: node and location ids become the names
the deployment logged (``validate.model_names``), ``k0`` becomes the first 16 hex digits of the
projection's key and ``…``, and each closest state's lease ids become the deployment's lease ids
through that state's binding (an unbound model lease keeps its number, marked ``model lease``).
The whole map goes into the verdict as ``names``:

    {"nodes": {"n0": "cache-1", ...}, "locations": {"l0": "cache-1/dram", ...},
     "keys": {"k0": "<64 hex>"}, "leases": [{"1": 7}, ...]}   # per closest state: model -> real

Only the validator's own text is rewritten: the rejected ``event`` (the deployment's record, in
its names already) is left as it is, and so is every quoted name of the ``reason``. A verdict
that is not a rejection with a diff is returned unchanged but for ``names`` (empty maps), so a
report always carries the map. Pure: the input is not modified.

Standard library and ``kvcc.conformance.validate`` only.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .validate import TraceParams, model_names

KEY_LABEL_HEX_CHARS = 16  # how much of a key's hex a rewritten label shows (the map has all of it)
# Spec ids as the diff writes them: n<i> (node), l<i> (location), k<i> (key of the projection).
_ID_RE = re.compile(r"(?<![\w/.-])([nlk])(\d+)(?![\w])")
_LEASE_IN_MESSAGE_RE = re.compile(r"\blease=(\d+)")
_QUOTED_RE = re.compile(r"('[^']*')")
# Variables whose value is a lease id (spec/layout.py): what the directory granted, what a holder
# trusts, what a writer writes under. 0 is "no lease".
_LEASE_VARIABLES = (".write_lease", ".lease", "].id")


def name_map(events: Sequence[dict], params: TraceParams, key: str | None) -> dict[str, dict[str, str]]:
    """The spec ids of a trace's projection on ``key`` and the trace's names for them."""
    table = model_names(events, params)
    return {
        "nodes": {i: n for i, n in table.items() if i.startswith("n")},
        "locations": {i: n for i, n in table.items() if i.startswith("l")},
        "keys": {} if key is None else {"k0": key},
    }


def _label(kind: str, ident: str, names: Mapping[str, Mapping[str, str]]) -> str | None:
    if kind == "n":
        return names["nodes"].get(ident)
    if kind == "l":
        return names["locations"].get(ident)
    key = names["keys"].get(ident)
    return None if key is None else f"{key[:KEY_LABEL_HEX_CHARS]}…"


def rename_text(text: str, names: Mapping[str, Mapping[str, str]]) -> str:
    """``text`` with every spec id it can map replaced by the trace's name."""

    def sub(m: re.Match) -> str:
        label = _label(m.group(1), m.group(1) + m.group(2), names)
        return m.group(0) if label is None else label

    return _ID_RE.sub(sub, text)


def _rename_prose(text: str, names: Mapping[str, Mapping[str, str]]) -> str:
    # A quoted name is the deployment's own (``by 'cache-2'``): never rewritten.
    return "".join(part if _QUOTED_RE.fullmatch(part) else rename_text(part, names) for part in _QUOTED_RE.split(text))


def _real_lease(model: int, back: Mapping[int, int]) -> str:
    if model == 0:
        return "0"
    return str(back[model]) if model in back else f"{model} (model lease)"


def _rename_state(state: dict, names: Mapping[str, Mapping[str, str]]) -> tuple[dict, dict[str, int]]:
    binding = state.get("leases") or {}
    back = {int(model): int(real) for real, model in binding.items()}  # the diff keeps real -> model
    out = dict(state)
    variables = {}
    for name, value in (state.get("variables") or {}).items():
        if name.endswith(_LEASE_VARIABLES) and str(value).isdigit():
            value = _real_lease(int(value), back)
        else:
            value = rename_text(str(value), names)
        variables[rename_text(name, names)] = value
    out["variables"] = variables
    out["in_flight"] = [
        _LEASE_IN_MESSAGE_RE.sub(lambda m: "lease=" + _real_lease(int(m.group(1)), back), rename_text(msg, names))
        for msg in state.get("in_flight") or ()
    ]
    return out, {str(model): real for model, real in sorted(back.items())}


def map_line(names: Mapping[str, Any]) -> str:
    """The name map of a verdict on one line: ``n0=cache-1 n1=cache-2 l0=cache-1/dram k0=0fe3…``."""
    pairs = [f"{i}={n}" for group in ("nodes", "locations") for i, n in (names.get(group) or {}).items()]
    pairs += [f"{i}={k[:KEY_LABEL_HEX_CHARS]}…" for i, k in (names.get("keys") or {}).items()]
    leases = names.get("leases") or []
    if leases and leases[0]:
        pairs.append("leases " + " ".join(f"{m}={r}" for m, r in leases[0].items()))
    return " ".join(pairs) or "(none)"


def rename_verdict(verdict: Mapping[str, Any], events: Sequence[dict], params: TraceParams) -> dict[str, Any]:
    """A copy of ``verdict`` in the trace's names, with the whole map under ``names`` (see the
    module docstring)."""
    out = copy.deepcopy(dict(verdict))
    diff = out.get("diff")
    key = diff.get("key") if isinstance(diff, dict) else None
    if key is None and isinstance(diff, dict) and isinstance(diff.get("event"), dict):
        key = diff["event"].get("key")
    names: dict[str, Any] = name_map(events, params, key) if isinstance(diff, dict) else {
        "nodes": {}, "locations": {}, "keys": {}}  # fmt: skip
    names["leases"] = []
    if isinstance(diff, dict):
        states = []
        for state in diff.get("closest") or ():
            renamed, leases = _rename_state(state, names)
            states.append(renamed)
            names["leases"].append(leases)
        diff["closest"] = states
        if isinstance(diff.get("needed"), str):
            diff["needed"] = rename_text(diff["needed"], names)
        if isinstance(out.get("reason"), str):
            out["reason"] = _rename_prose(out["reason"], names)
    out["names"] = names
    return out
