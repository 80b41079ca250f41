"""Console helpers shared by the command line and the benchmarks: rich consoles sized for logs,
JSON output that never prints a non-finite number, and argument types.

Below the command line in the layers (tests/test_layers.py): the benchmarks use these without
importing ``kvcc.cli``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping
from typing import Any

from rich.console import Console


def stdout_console() -> Console:
    console = Console(highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        # Piped or logged (CI): rich would assume 80 columns and squeeze the tables.
        console = Console(highlight=False, width=140)
    return console


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def jsonable(obj: Any) -> Any:
    """JSON-safe copy: non-finite floats (``inf`` states/s of a zero-second run) become null, tuples lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return [jsonable(v) for v in sorted(obj, key=repr)]
    return obj


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(jsonable(obj), allow_nan=False) + "\n")
    sys.stdout.flush()


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {n}")
    return n


def measure_and_show(name: str, measure: Any, render: Any, json: bool = False, **options: Any) -> Any:
    """A benchmark's ``run``: ``measure(**options)`` with its progress on a stderr status line,
    then ``render(console, result)`` on stdout; with ``json``, no status and one JSON object. The
    result."""
    if json:
        r = measure(**options)
        print_json(r)
        return r
    with stderr_console().status(f"{name} benchmark") as status:
        r = measure(on_progress=lambda what: status.update(f"{name} benchmark: {what}"), **options)
    render(stdout_console(), r)
    return r
