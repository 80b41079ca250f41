"""Packaging checks: folder->package mapping, no stray top-level modules, CPU torch."""

import importlib
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_kvcc_spec_maps_to_repo_spec_folder():
    mod = importlib.import_module("kvcc.spec")
    assert mod.__file__ is not None
    assert Path(mod.__file__).resolve().parent == REPO / "spec"


def test_no_top_level_spec_module_outside_repo():
    code = (
        "import importlib.util,sys; "
        "sys.exit(0 if importlib.util.find_spec('spec') is None else 1)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True)
    assert proc.returncode == 0, f"a top-level 'spec' module is importable: {proc.stdout}{proc.stderr}"


def test_torch_version():
    import torch

    assert torch.__version__.startswith("2.13.0"), torch.__version__


def test_every_test_module_has_a_cost_class():
    """The fast loop (`-m unit`) is only honest if no module escapes the classes (tests/conftest.py)."""
    from conftest import COST_CLASSES, cost_class

    modules = sorted(p.stem for p in Path(__file__).resolve().parent.glob("test_*.py"))
    assert [m for m in modules if cost_class(m) is None] == []
    classified = set().union(*COST_CLASSES.values())
    assert len(classified) == sum(len(v) for v in COST_CLASSES.values()), "a module in two classes"
