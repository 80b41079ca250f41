"""A pytest plugin: ``pytest --kvcc-adapter NAME`` runs the conformance suite as one test per id.

Registered through the ``pytest11`` entry point ``kvcc``; in a checkout without installation,
add ``pytest_plugins = ["kvcc.conformance.plugin"]`` to a ``conftest.py``. Options:
``--kvcc-adapter`` (a name or ``module:factory``), ``--kvcc-profile`` (repeatable),
``--kvcc-seed``, ``--kvcc-out`` (bundle directory). Without ``--kvcc-adapter`` the plugin adds
nothing. From a test file, call ``kvcc.conformance.run_conformance(factory)`` directly instead.
"""

from __future__ import annotations

import pytest

_REPORT_KEY = pytest.StashKey[object]() if hasattr(pytest, "StashKey") else None


def pytest_addoption(parser) -> None:
    group = parser.getgroup("kvcc", "kvcc conformance")
    group.addoption("--kvcc-adapter", default=None, help="run the kvcc conformance suite against this adapter")
    group.addoption("--kvcc-profile", action="append", default=None, help="profile (repeatable)")
    group.addoption("--kvcc-seed", type=int, default=None)
    group.addoption("--kvcc-out", default=None, help="write the report bundle here")


def _report(config):
    if _REPORT_KEY is not None and _REPORT_KEY in config.stash:
        return config.stash[_REPORT_KEY]
    from . import registry, runner

    rep = runner.run_conformance(registry.resolve(config.getoption("kvcc_adapter")), config.getoption("kvcc_profile"),
                                 config.getoption("kvcc_seed"), config.getoption("kvcc_out"))  # fmt: skip
    config.stash[_REPORT_KEY] = rep
    return rep


def pytest_collection_modifyitems(session, config, items) -> None:
    if not config.getoption("kvcc_adapter"):
        return
    from . import catalogue, registry

    factory = registry.resolve(config.getoption("kvcc_adapter"))
    profiles = config.getoption("kvcc_profile") or sorted(factory().capabilities().profiles)
    for test in catalogue.tests_for(profiles):
        items.append(KvccItem.from_parent(session, name=test.id, test_id=test.id))


class KvccItem(pytest.Item):
    def __init__(self, *, test_id: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.test_id = test_id

    def runtest(self) -> None:
        r = _report(self.config).by_id()[self.test_id]
        if r.status in ("SKIP", "NOT_APPLICABLE"):
            pytest.skip(f"{r.status}: {r.message}")
        if r.status != "PASS":
            raise AssertionError(f"{r.status}: {r.message}")

    def reportinfo(self):
        return "kvcc-conformance", None, self.test_id
