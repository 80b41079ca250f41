"""Adapters by name: the built-ins, ``package.module:factory``, or entry points ``kvcc.adapters``.

A vendor's package declares, in its ``pyproject.toml``::

    [project.entry-points."kvcc.adapters"]
    mycache = "mycache_kvcc.adapter:make_adapter"

and ``kvcc conform --adapter mycache`` finds it. ``--adapter mycache_kvcc.adapter:make_adapter``
works without installing anything but the module. A factory takes no arguments and returns an
``Adapter``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points

from .contract import Adapter

ENTRY_POINT_GROUP = "kvcc.adapters"
BUILTINS: dict[str, str] = {
    "core": "kvcc.conformance.testing:core_factory",
    "reference": "kvcc.conformance.registry:reference_sqlite",
    "reference-etcd": "kvcc.conformance.registry:reference_etcd",
    "mooncake": "kvcc.adapters.mooncake.adapter:factory",
    "mooncake-raw": "kvcc.adapters.mooncake.raw:factory",
}


def reference_sqlite() -> Adapter:
    """The reference deployment (directory on its SQLite log, cache nodes, TCP) on loopback."""
    from kvcc.adapters.reference import ReferenceAdapter

    return ReferenceAdapter("sqlite")


def reference_etcd() -> Adapter:
    """The reference deployment with its directory on a loopback etcd cluster."""
    from kvcc.adapters.reference import ReferenceAdapter

    return ReferenceAdapter("etcd")


class UnknownAdapter(LookupError):
    """No adapter by that name, or its factory cannot be imported."""


def _load(spec: str) -> Callable[[], Adapter]:
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise UnknownAdapter(f"{spec!r} is not package.module:factory")
    try:
        obj = importlib.import_module(module)
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


def available() -> dict[str, str]:
    """Name -> factory spec of every adapter known here (built-ins, then entry points)."""
    names = dict(BUILTINS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        names.setdefault(ep.name, ep.value)
    return names


def resolve(name: str) -> Callable[[], Adapter]:
    """The factory for ``name``: a ``module:factory`` spec, a built-in, or an entry point."""
    if ":" in name:
        return _load(name)
    known = available()
    if name not in known:
        raise UnknownAdapter(f"no adapter {name!r}; known: {', '.join(sorted(known))}")
    return _load(known[name])
