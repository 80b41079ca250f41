"""Compiled copies of the spec's and the trace validator's hot modules, used only while they match
their source.

The trace validator and the model checker spend their time in four pure-Python modules: the
model's steps (``kvcc.spec.model``), the properties every step is checked against
(``kvcc.spec.properties``), the checker's search (``kvcc.spec.checker``) and the validator's
(``kvcc.conformance.validate``). Compiled as they are by Cython (no annotations read as C types,
so the semantics are Python's), they run 1.5 to 1.8 times as fast (README, "Compiled hot modules").

``build()`` compiles each into ``<venv>/kvcc-accel/`` (``KVCC_ACCEL_DIR`` overrides) and records
the SHA-256 of the source it was compiled from in ``manifest.json``. ``install()`` (run by
``kvcc/__init__.py``, before any of them can be imported) puts a finder in front of the import
system that loads a compiled copy only if its source still hashes to the recorded digest: an
edited source is imported as source, never a stale build. ``KVCC_ACCEL=0`` turns the finder off.

    kvcc accel build    # what scripts/setup.sh runs; compiles only the modules whose source changed
    kvcc accel status   # which modules are compiled and current (JSON)
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

MODULES = ("kvcc.spec.model", "kvcc.spec.properties", "kvcc.spec.checker", "kvcc.conformance.validate")
MANIFEST = "manifest.json"
# Python's semantics as far as Cython allows: annotations are not C types (``x: float`` would
# become a C double and turn an int into a float), and no local variable is inferred a C type
# (an int that outgrows 64 bits would wrap). What Cython still does in C: arithmetic on C values
# it is given, ``len()`` and literals, so ``1 << len(x)`` wraps past 63 (the validator spells
# such shifts with a Python int: ``_low_bits``); tests/test_accel.py runs the corpus both ways.
DIRECTIVES = {"language_level": 3, "annotation_typing": False, "infer_types": False, "binding": True}


class AccelError(Exception):
    """The compiled modules could not be built."""


def accel_dir() -> Path:
    return Path(os.environ.get("KVCC_ACCEL_DIR") or Path(sys.prefix) / "kvcc-accel")


def enabled() -> bool:
    return os.environ.get("KVCC_ACCEL", "1") != "0"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_manifest(root: Path) -> dict[str, dict[str, str]]:
    try:
        data = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("abi") != _abi():
        return {}  # built by another interpreter: its extensions would not load
    modules = data.get("modules")
    return modules if isinstance(modules, dict) else {}


def _abi() -> str:
    return f"{sys.implementation.cache_tag}{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def _why_stale(root: Path, entry: dict[str, str] | None, digest: str) -> str | None:
    """Why the compiled copy a manifest ``entry`` names may not stand for a source hashing to
    ``digest``, or None when it may."""
    if entry is None:
        return "never compiled"
    if digest != entry.get("source_sha256"):
        return "its source changed since it was compiled (kvcc accel build)"
    if not (root / entry.get("file", "")).is_file():
        return f"{entry.get('file')} is missing"
    return None


def _source(name: str) -> Path:
    """The source file of module ``name``, found without importing it (its parent is imported)."""
    parent, _, _ = name.rpartition(".")
    path = importlib.import_module(parent).__path__
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise AccelError(f"{name}: no Python source found")
    return Path(spec.origin)


# -------------------------------------------------------------------------------- loading


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the compiled copy of a listed module while its source hashes to the digest it was
    compiled from; returns None (the source is imported) for anything else."""

    def __init__(self, root: Path, manifest: dict[str, dict[str, str]]) -> None:
        self.root, self.manifest = root, manifest
        self.stale: dict[str, str] = {}  # module -> why its compiled copy was not used

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        entry = self.manifest.get(name)
        if entry is None or path is None:
            return None
        source = importlib.machinery.PathFinder.find_spec(name, path)
        if source is None or not source.origin:
            return None
        try:
            why = _why_stale(self.root, entry, _digest(Path(source.origin)))
        except OSError:
            return None
        if why is not None:
            self.stale[name] = why
            return None
        return importlib.util.spec_from_file_location(name, self.root / entry["file"])


_finder: _Finder | None = None


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once), if compiled modules were built."""
    global _finder
    if _finder is not None or not enabled():
        return
    root = accel_dir()
    manifest = _read_manifest(root)
    if not manifest:
        return
    _finder = _Finder(root, manifest)
    sys.meta_path.insert(0, _finder)


def status() -> dict[str, Any]:
    """For each listed module: whether a compiled copy is current (its source unchanged) and
    whether this process runs it (importing it)."""
    root = accel_dir()
    manifest = _read_manifest(root)
    out: dict[str, Any] = {"enabled": enabled(), "dir": str(root), "modules": {}}
    for name in MODULES:
        entry = manifest.get(name)
        try:
            current = _why_stale(root, entry, _digest(_source(name))) is None
        except (AccelError, OSError):
            current = False
        module = importlib.import_module(name)
        out["modules"][name] = {"built": entry is not None, "current": bool(current), "loaded": is_compiled(module)}
    return out


def is_compiled(module: Any) -> bool:
    return not str(getattr(module, "__file__", "") or "").endswith(".py")


def compiled_modules() -> list[str]:
    """The listed modules this process runs compiled (importing them)."""
    return [name for name in MODULES if is_compiled(importlib.import_module(name))]


# -------------------------------------------------------------------------------- building


def build(modules: tuple[str, ...] = MODULES, root: Path | None = None, force: bool = False, quiet: bool = True) -> list[str]:
    """Compile each of ``modules`` whose recorded digest differs from its source's (all with
    ``force``) into ``root``; the names compiled. Raises ``AccelError`` when Cython or a C
    compiler is missing or a compilation fails (the manifest then keeps only what is current)."""
    import shutil
    import tempfile

    root = root or accel_dir()
    try:
        from Cython.Build import cythonize
        from setuptools import Distribution, Extension
    except ImportError as e:
        raise AccelError(f"Cython and setuptools are needed to build the compiled modules ({e})") from e
    manifest = _read_manifest(root)
    sources = {name: _source(name) for name in modules}
    digests = {name: _digest(path) for name, path in sources.items()}
    todo = [n for n in modules if force or _why_stale(root, manifest.get(n), digests[n]) is not None]
    if not todo:
        return []
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvcc-accel-") as tmp:
        work = Path(tmp)
        # Compile copies (the .c files and any build output stay out of the source tree).
        exts = []
        for name in todo:
            copy = work / "src" / (name.replace(".", "/") + ".py")
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(sources[name], copy)
            exts.append(Extension(name, [str(copy)]))
        try:
            compiled = cythonize(exts, compiler_directives=DIRECTIVES, build_dir=str(work / "c"), quiet=quiet, nthreads=0)
            dist = Distribution({"ext_modules": compiled, "script_args": ["build_ext"]})
            cmd = dist.get_command_obj("build_ext")
            cmd.build_lib, cmd.build_temp = str(work / "lib"), str(work / "tmp")
            cmd.parallel = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            dist.run_command("build_ext")
        except (Exception, SystemExit) as e:  # setuptools reports a compiler failure as SystemExit
            raise AccelError(f"compiling {', '.join(todo)} failed: {e}") from e
        for name in todo:
            base = work / "lib" / Path(*name.split("."))
            built = [p for p in base.parent.glob(base.name + ".*") if p.name.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))]
            if len(built) != 1:
                raise AccelError(f"compiling {name} produced {len(built)} extension files")
            target = root / built[0].name.replace(base.name, name, 1)
            tmp_target = target.with_name(target.name + ".tmp")
            shutil.copyfile(built[0], tmp_target)
            os.replace(tmp_target, target)  # a process that has the old one mapped keeps it
            manifest[name] = {"file": target.name, "source_sha256": digests[name]}
    data = {"abi": _abi(), "modules": {n: manifest[n] for n in sorted(manifest)}}
    tmp_manifest = root / (MANIFEST + ".tmp")
    tmp_manifest.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp_manifest, root / MANIFEST)
    return todo


def run(action: str, force: bool = False) -> int:
    """``kvcc accel build|status``."""
    if action == "status":
        print(json.dumps(status(), indent=1))
        return 0
    try:
        done = build(force=force)
    except AccelError as e:
        print(f"kvcc accel: {e}; the modules run as Python source", file=sys.stderr)
        return 1
    print(f"kvcc accel: compiled {', '.join(done)}" if done else "kvcc accel: the compiled modules are current")
    return 0
