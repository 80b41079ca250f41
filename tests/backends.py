"""The directory's store backends for tests: ``directory_store_factory``, parameterised over
``sqlite`` (``DirectoryStore`` on a file of the test's tmp_path) and ``etcd``
(``EtcdDirectoryStore`` on the session's one-member cluster, under a prefix of the test's own).

``factory.open(**kw)`` opens one more store on the same log (a restart, or a second directory);
the fixture closes whatever is still open at the end. ``factory.spec`` is a JSON-able description
that a child process turns into a store with ``open_store(spec)`` (crash tests).
``factory.fingerprint()`` changes whenever anything is written to the log (for "changes
nothing" checks). The etcd parameter is marked ``integration``, like the other etcd tests.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvcc.reference.directory import DirectoryStore, EtcdDirectoryStore

BACKENDS = ("sqlite", "etcd")
ETCD_REQUEST_TIMEOUT_S = 2.0
ETCD_FAILOVER_TIMEOUT_S = 20.0


def open_store(spec: dict[str, Any], **kw: Any):
    """A store on the log ``spec`` describes (``StoreFactory.spec``)."""
    if spec["backend"] == "sqlite":
        return DirectoryStore(spec["path"], **kw)
    assert spec["backend"] == "etcd", spec
    kw.setdefault("request_timeout_s", ETCD_REQUEST_TIMEOUT_S)
    kw.setdefault("failover_timeout_s", ETCD_FAILOVER_TIMEOUT_S)
    return EtcdDirectoryStore(spec["endpoints"], spec["prefix"], **kw)


class StoreFactory:
    """Opens stores on one log of one backend (see the module docstring)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.backend: str = spec["backend"]
        self._open: list[Any] = []

    @classmethod
    def sqlite(cls, directory: Path) -> StoreFactory:
        return cls({"backend": "sqlite", "path": str(directory / "directory.sqlite")})

    @classmethod
    def etcd(cls, endpoints: list[str], prefix: str | None = None) -> StoreFactory:
        return cls({"backend": "etcd", "endpoints": list(endpoints), "prefix": prefix or f"test-{uuid.uuid4().hex[:10]}"})

    def open(self, **kw: Any):
        store = open_store(self.spec, **kw)
        self._open.append(store)
        return store

    def kv(self):
        """A plain etcd client on the log's cluster (etcd only); the caller closes it."""
        from kvcc.reference.etcd_client import EtcdKV

        assert self.backend == "etcd"
        return EtcdKV(self.spec["endpoints"], request_timeout_s=ETCD_REQUEST_TIMEOUT_S, failover_timeout_s=ETCD_FAILOVER_TIMEOUT_S)

    def fingerprint(self) -> Any:
        """Something that changes whenever the log is written to: the SQLite files' bytes, the
        etcd keys under the prefix with their revisions."""
        if self.backend == "sqlite":
            h = hashlib.sha256()
            for suffix in ("", "-wal"):
                p = self.spec["path"] + suffix
                h.update(Path(p).read_bytes() if os.path.exists(p) else b"-")
            return h.hexdigest()
        with self.kv() as kv:
            kvs, _ = kv.range_prefix(self.spec["prefix"] + "/")
        return sorted((x.key, x.mod_revision) for x in kvs)

    def keys_under(self, sub: str) -> list[bytes]:
        """The etcd keys under ``<prefix>/<sub>`` (etcd only)."""
        with self.kv() as kv:
            return [x.key for x in kv.range_prefix(f"{self.spec['prefix']}/{sub}")[0]]

    def close_all(self) -> None:
        for store in self._open:
            store.close()
        self._open.clear()


@pytest.fixture(params=[BACKENDS[0], pytest.param(BACKENDS[1], marks=pytest.mark.integration)])
def directory_store_factory(request, tmp_path):
    """A ``StoreFactory`` for each store backend (etcd: on the session's one-member cluster)."""
    if request.param == "sqlite":
        factory = StoreFactory.sqlite(tmp_path)
    else:
        cluster = request.getfixturevalue("etcd1")
        factory = StoreFactory.etcd(cluster.endpoints)
    try:
        yield factory
    finally:
        factory.close_all()
