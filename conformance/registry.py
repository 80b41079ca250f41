"""Adapters by name: ``package.module:factory``, or entry points ``kvcc.adapters`` (the built-ins are
kvcc's own entry points).

A vendor's package declares, in its ``pyproject.toml``::

    [project.entry-points."kvcc.adapters"]
    mycache = "mycache_kvcc.adapter:make_adapter"

and ``kvcc conform --adapter mycache`` finds it. ``--adapter mycache_kvcc.adapter:make_adapter``
works without installing anything: a module that is not importable from ``sys.path`` is looked
for in the current directory too, as ``python -m`` would (so ``--adapter
examples.minimal_adapter:factory`` works from a checkout's root), also when ``PYTHONPATH`` or an
installed distribution holds another package of the same top-level name. A factory takes no arguments
and returns an ``Adapter``.

``describe(name)`` is the one-line description ``kvcc conform --list-adapters`` prints: the
built-in's entry in ``DESCRIPTIONS``, else the first line of the factory's docstring, else the
first line of the docstring of the class it returns (the factory is not called).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from importlib.metadata import entry_points

from .contract import PROFILES, Adapter

ENTRY_POINT_GROUP = "kvcc.adapters"
# The built-in adapters are kvcc's own entry points (pyproject.toml, [project.entry-points."kvcc.adapters"]),
# found the way a vendor's are: the suite names no adapter module (tests/test_layers.py).
BUILTINS: tuple[str, ...] = ("core", "reference", "reference-etcd", "reference-sharded", "mooncake", "mooncake-raw", "sglang", "hicache-file", "vllm", "lmcache-raw")
DESCRIPTIONS: dict[str, str] = {
    "core": "the suite's self-test: the reference directory core and a DRAM tier per node, in one process",
    "reference": "the reference implementation as processes on loopback (directory on its SQLite log)",
    "reference-etcd": "the reference implementation with its directory on a loopback etcd cluster",
    "reference-sharded": "the reference implementation with its directory in two shards by chain root, nodes registered with both",
    "mooncake": "a real Mooncake Store holding the bytes, kvcc's directory in the adapter deciding leases and epochs",
    "mooncake-raw": "a real Mooncake Store's own operations mapped onto the contract, nothing added",
    "sglang": "kvcc's SGLang HiCache storage backend on the reference cluster: reads, commits, clears through SGLang's calls",
    "hicache-file": "SGLang's own HiCacheFile storage backend mapped onto the contract, nothing added",
    "vllm": "kvcc's vLLM KV connector on the reference cluster: loads, saves, resets through the connector's code",
    "lmcache-raw": "LMCache's own storage engine (CPU and disk tiers) mapped onto the contract, nothing added",
}
assert set(DESCRIPTIONS) == set(BUILTINS)
DESCRIPTION_MAX_CHARS = 120


class UnknownAdapter(LookupError):
    """No adapter by that name, or its factory cannot be imported."""


def _load(spec: str) -> Callable[[], Adapter]:
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise UnknownAdapter(f"{spec!r} is not package.module:factory")
    try:
        obj = _import(module)
    except ImportError as e:
        raise UnknownAdapter(f"cannot import {module}: {e}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UnknownAdapter(f"{module} has no {attr}") from None
    if not callable(obj):
        raise UnknownAdapter(f"{spec} is not callable")
    return obj


def _import(module: str):
    """``importlib.import_module``, retried from the current directory when the module is not
    found (a console script's path does not include it, and ``PYTHONPATH`` or an installed
    distribution may hold another package of the same top-level name, e.g. ``examples``)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        top = module.partition(".")[0]
        parts = module.split(".")
        prefixes = {".".join(parts[: i + 1]) for i in range(len(parts))}
        here = os.path.isdir(os.path.join(cwd, top)) or os.path.isfile(os.path.join(cwd, top + ".py"))
        if e.name not in prefixes or not here:
            raise
        if cwd not in sys.path:
            sys.path.append(cwd)  # last: never shadows an installed package that has the module
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as e2:
            if e2.name not in prefixes:
                raise
        # The top-level name resolved elsewhere (PYTHONPATH, site-packages) without the module:
        # load the package of the current directory in its place, for this import only.
        saved = {n: m for n, m in sys.modules.items() if n == top or n.startswith(top + ".")}
        for n in saved:
            del sys.modules[n]
        try:
            # Only the current directory: a directory without __init__.py is a namespace package,
            # which a regular package of that name anywhere on sys.path would otherwise beat.
            spec = importlib.machinery.PathFinder.find_spec(top, [cwd])
            if spec is None:
                raise ModuleNotFoundError(f"No module named {top!r} in {cwd}", name=top)
            pkg = importlib.util.module_from_spec(spec)
            sys.modules[top] = pkg
            spec.loader.exec_module(pkg)
            return importlib.import_module(module)
        except BaseException:
            for n in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
                del sys.modules[n]
            sys.modules.update(saved)
            raise


def _first_line(doc: str | None) -> str:
    line = (doc or "").strip().split("\n", 1)[0].strip()
    return line if len(line) <= DESCRIPTION_MAX_CHARS else line[: DESCRIPTION_MAX_CHARS - 1] + "…"


def describe(name: str) -> str:
    """One line saying what adapter ``name`` is (see the module docstring); never raises."""
    if name in DESCRIPTIONS:
        return DESCRIPTIONS[name]
    spec = available().get(name, name)
    try:
        factory = _load(spec)
    except UnknownAdapter as e:
        return f"(cannot be loaded: {e})"
    line = _first_line(inspect.getdoc(factory))
    if not line:
        returns = inspect.signature(factory).return_annotation if callable(factory) else None
        line = _first_line(getattr(returns, "__doc__", None)) if isinstance(returns, type) else ""
    return line or "(no description: give the factory a docstring)"


def unclaimed_advice(profiles, capabilities, adapter: str = "the adapter") -> str:
    """What to do when a run certified nothing because the adapter claims none of the
    ``profiles`` it ran (``capabilities``: ``Capabilities.to_json()``)."""
    claims = [p for p in PROFILES if p in set(capabilities.get("profiles", ()))]
    ran = ", ".join(profiles) or "none"
    if claims:
        flags = " ".join(f"--profile {p}" for p in claims)
        return (f"{adapter} claims none of the profiles run ({ran}): it claims {', '.join(claims)}. "
                f"Certify those with `{flags}` (or no --profile at all), or add the profile to "
                f"Capabilities.profiles once its tests pass.")  # fmt: skip
    return (f"{adapter} claims no profile (Capabilities.profiles is empty), so nothing can be certified; the "
            f"tests of {ran} ran for information only. Declare the profiles it implements, e.g. "
            f"Capabilities(profiles={{\"core\"}}).")  # fmt: skip


def available() -> dict[str, str]:
    """Name -> factory spec of every adapter known here (the built-ins first, then other entry points).
    A built-in missing from the entry points means a stale install: ``bash scripts/setup.sh``
    reinstalls when pyproject.toml changes."""
    found = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    names = {name: found[name] for name in BUILTINS if name in found}
    names.update((name, spec) for name, spec in sorted(found.items()) if name not in names)
    return names


def resolve(name: str) -> Callable[[], Adapter]:
    """The factory for ``name``: a ``module:factory`` spec, a built-in, or an entry point."""
    if ":" in name:
        return _load(name)
    known = available()
    if name not in known:
        raise UnknownAdapter(f"no adapter {name!r}; known: {', '.join(sorted(known))}")
    return _load(known[name])
