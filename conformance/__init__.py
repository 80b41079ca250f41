"""kvcc.conformance: the adapter contract, the catalogue and ``run_conformance``.

``from kvcc.conformance import run_conformance`` runs the suite from any test runner; see
``contract`` for what an adapter implements and ``testing`` for the in-process kit.
"""


def __getattr__(name: str):
    # Lazy, so that importing a submodule (the contract, the validator) stays light.
    if name in ("run_conformance", "Report", "TestResult"):
        from . import runner

        return getattr(runner, name)
    raise AttributeError(name)
