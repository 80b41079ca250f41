"""The layers, read from the import graph: spec <- reference <- conformance <- adapters <- bench <- cli.

A module may import its own layer and the layers below it, never one above: the spec knows nothing
of the implementation, the reference nothing of the suite that judges it, the suite nothing of the
adapters it certifies (they register themselves as ``kvcc.adapters`` entry points), and the
benchmarks nothing of the command line. Every import counts, at module level or inside a function
(a lazy import is still a dependency), and so does a string naming a module, ``kvcc.x.y`` or
``kvcc.x.y:attr`` (what ``importlib`` and entry-point specs load) when it names one of kvcc's modules -- a
``module:attr`` spec naming any, a bare name only a module that is not a package (a logger called
``kvcc.client`` or the entry-point group ``kvcc.adapters`` is not an import).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# package directory -> (dotted package, rank); kvcc/ holds the command line and its helpers.
PACKAGES = {
    "spec": ("kvcc.spec", 0),
    "reference": ("kvcc.reference", 1),
    "conformance": ("kvcc.conformance", 2),
    "adapters": ("kvcc.adapters", 3),
    "bench": ("kvcc.bench", 4),
    "kvcc": ("kvcc", 5),
}
# Modules of kvcc/ below the command line: the console helpers and renderers the benchmarks share
# with it (they import nothing above the spec), and the loader of the compiled hot modules (it
# names the spec's and the suite's, and the validator benchmark says which ran compiled).
RANK_OVERRIDES = {"kvcc.console": 4, "kvcc.report": 4, "kvcc.accel": 4}
NAMES = ["spec", "reference", "conformance", "adapters", "bench", "cli"]
MODULE_STRING = re.compile(r"kvcc(\.[A-Za-z_][A-Za-z0-9_]*)+(:[A-Za-z_][A-Za-z0-9_.]*)?")


def rank_of(module: str) -> int | None:
    """The layer of a dotted kvcc module name (None: not kvcc's)."""
    if module in RANK_OVERRIDES:
        return RANK_OVERRIDES[module]
    best = None
    for dotted, rank in PACKAGES.values():
        if dotted != "kvcc" and (module == dotted or module.startswith(dotted + ".")):
            return rank
        if module == "kvcc" or module.startswith("kvcc."):
            best = PACKAGES["kvcc"][1]
    return best


def modules() -> dict[str, Path]:
    found = {}
    for directory, (dotted, _) in PACKAGES.items():
        for path in sorted((ROOT / directory).rglob("*.py")):
            parts = list(path.relative_to(ROOT / directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([dotted, *parts])] = path
    return found


def imports_of(module: str, path: Path, known: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, imported kvcc module) for every import in ``path``, and every string naming one of
    the ``known`` modules."""
    is_package = path.name == "__init__.py"
    here = module.split(".") if is_package else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            if node.module is None:  # from . import a, b: each name may be a module
                out += [(node.lineno, f"{target}.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, target))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            named, colon, _ = node.value.partition(":")
            if MODULE_STRING.fullmatch(node.value) and named in known:
                if colon or known[named].name != "__init__.py":
                    out.append((node.lineno, named))
    return [(line, name) for line, name in out if name == "kvcc" or name.startswith("kvcc.")]


def test_no_module_imports_a_layer_above_its_own():
    known = modules()
    assert len(known) > 60, "the walk found the packages"
    upward = []
    for module, path in known.items():
        mine = rank_of(module)
        for line, target in imports_of(module, path, known):
            theirs = rank_of(target)
            if theirs is not None and theirs > mine:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {NAMES[mine]} imports {target} ({NAMES[theirs]})")
    assert upward == [], "imports against the layers:\n" + "\n".join(upward)


def test_the_walk_sees_lazy_relative_and_string_imports(tmp_path):
    """The checker itself can fail: each kind of import it must see, seen."""
    src = tmp_path / "m.py"
    src.write_text(
        "import kvcc.spec.model\n"
        "from ..adapters import reference\n"
        "def f():\n    from kvcc.bench import tiers\n"
        "SPEC = 'kvcc.adapters.mooncake.adapter:factory'\n"
        "log = 'kvcc.client'\n",
        encoding="utf-8",
    )
    known = {name: Path(name.replace(".", "/") + ".py") for name in ("kvcc.spec.model", "kvcc.adapters.mooncake.adapter")}
    names = [name for _, name in imports_of("kvcc.conformance.m", src, known)]
    assert names == ["kvcc.spec.model", "kvcc.adapters", "kvcc.bench", "kvcc.adapters.mooncake.adapter"]
    assert [rank_of(n) for n in names] == [0, 3, 4, 3]
