"""A local cluster on loopback: one directory process and N cache-node processes.

``LocalCluster(workdir, nodes=3, ...)`` writes the deployment file, starts every process with
``python -m kvcc serve ...`` on free ports (each process binds port 0 and reports the port it
got in its ready file), waits until each serves, and stops them all on ``stop()`` -- SIGTERM,
then SIGKILL after ``STOP_GRACE_S``. Nothing is left running: processes are started in their own
process group and ``stop`` is idempotent and also runs at interpreter exit.

Faults act on the real processes: ``kill(node)`` (SIGKILL: no chance to sync anything),
``pause(node)``/``resume(node)`` (SIGSTOP/SIGCONT: a process that stops in the middle of
whatever it was doing, its leases running out on the other clocks), ``restart(node)`` (a new
incarnation on the same state directory), ``restart_directory()``.

Every process writes its protocol events to ``<workdir>/events/<name>.ndjson``; ``events()``
reads them all back (``kvcc.reference.events.read_events``), the input of trace validation.

Clients for the cluster: ``client(client_id)`` returns a ``SyncClient`` of the engine tenant.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcc.spec.keys import Namespace

START_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0
ENGINE_TENANT = "engine"
NODE_TENANT = "nodes"
DEFAULT_TIERS = ("dram=8MiB", "nvme=32MiB")
DEFAULT_BLOCK_BYTES = 64 << 10


class ClusterError(RuntimeError):
    """A process of the cluster did not start or died; the message has its log's tail."""


class _Proc:
    def __init__(self, name: str, argv: list[str], log_path: Path, ready: Path, env: dict[str, str]) -> None:
        self.name, self.argv, self.log_path, self.ready, self.env = name, argv, log_path, ready, env
        self.popen: subprocess.Popen | None = None
        self.info: dict[str, Any] = {}
        self.paused = False

    def start(self) -> None:
        self.ready.unlink(missing_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child owns it)
        try:
            self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                          start_new_session=True)  # fmt: skip
        finally:
            log.close()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        assert self.popen is not None
        while time.monotonic() < deadline:
            if self.ready.exists():
                self.info = json.loads(self.ready.read_text())
                return self.info
            if self.popen.poll() is not None:
                raise ClusterError(f"{self.name} exited with {self.popen.returncode}:\n{self.tail()}")
            time.sleep(0.02)
        raise ClusterError(f"{self.name} not ready after {timeout_s} s:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.popen is not None
            os.kill(self.popen.pid, sig)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        if self.popen is None:
            return
        if self.alive:
            if self.paused:
                self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(grace_s)
        self.paused = False


class LocalCluster:
    """``LocalCluster(workdir, nodes=3, tiers=DEFAULT_TIERS, lease_term_ms=2000, skew_ms=100,
    namespaces=(), backend="sqlite", etcd_endpoints=None, pool=False)``; ``start()``/``stop()``
    or a context manager."""

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        nodes: int = 3,
        tiers: Sequence[str] = DEFAULT_TIERS,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        lease_term_ms: int = 2000,
        skew_ms: int = 100,
        namespaces: Sequence[Namespace | bytes] = (),
        backend: str = "sqlite",
        etcd_endpoints: str | None = None,
        etcd_prefix: str | None = None,
        pool: bool = False,
        verbose: bool = False,
    ) -> None:
        if nodes < 1:
            raise ValueError("a cluster has at least one node")
        self.workdir = Path(workdir)
        self.node_ids = [f"n{i}" for i in range(1, nodes + 1)]
        self.tiers = list(tiers)
        self.block_bytes = block_bytes
        self.lease_term_ms = lease_term_ms
        self.skew_ms = skew_ms
        self.backend = backend
        self.etcd_endpoints = etcd_endpoints
        self.etcd_prefix = etcd_prefix or f"kvcc-{secrets.token_hex(4)}"
        self.pool = pool
        self.verbose = verbose
        digests = [ns.digest() if isinstance(ns, Namespace) else ns for ns in namespaces]
        self.engine_token = secrets.token_bytes(32)
        self.config = {
            "lease_term_ms": lease_term_ms,
            "skew_ms": skew_ms,
            "node_tenant": NODE_TENANT,
            "tenants": {
                ENGINE_TENANT: {"token": self.engine_token.hex(), "namespaces": [d.hex() for d in digests]},
                NODE_TENANT: {"token": secrets.token_bytes(32).hex(), "operator": True},
            },
        }
        self.procs: dict[str, _Proc] = {}
        self._clients: list[Any] = []
        self._fault_log: Any = None
        self._started = False

    # ------------------------------------------------------------------ processes

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("PYTHONSAFEPATH", "1")
        for k, v in {"DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false",
                     "HF_HUB_OFFLINE": "1"}.items():  # fmt: skip
            env.setdefault(k, v)
        return env

    def _argv(self, *args: str) -> list[str]:
        verbose = ["--verbose"] if self.verbose else []
        return [sys.executable, "-m", "kvcc", "serve", *args, "--config", str(self.config_path), *verbose]

    @property
    def config_path(self) -> Path:
        return self.workdir / "cluster.json"

    @property
    def directory_address(self) -> tuple[str, int]:
        return ("127.0.0.1", int(self.procs["directory"].info["port"]))

    def start(self) -> LocalCluster:
        for sub in ("events", "logs", "state", "run"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(json.dumps(self.config, indent=1))
        atexit.register(self.stop)
        self._started = True
        try:
            argv = ["directory", "--state", str(self.workdir / "state" / "directory"), "--backend", self.backend,
                    "--events", str(self.workdir / "events" / "directory.ndjson")]  # fmt: skip
            if self.backend == "etcd":
                argv += ["--etcd-endpoints", str(self.etcd_endpoints), "--etcd-prefix", self.etcd_prefix]
            self._launch("directory", argv)
            for node in self.node_ids:
                self._launch(node, self._node_argv(node))
        except BaseException:
            self.stop()
            raise
        return self

    def _node_argv(self, node: str) -> list[str]:
        host, port = self.directory_address
        argv = ["node", "--id", node, "--directory", f"{host}:{port}",
                "--state", str(self.workdir / "state" / node), "--block-bytes", str(self.block_bytes),
                "--events", str(self.workdir / "events" / f"{node}.ndjson")]  # fmt: skip
        for t in self.tiers:
            argv += ["--tier", t]
        if self.pool:
            argv += ["--pool", str(self.workdir / "state" / "pool")]
        return argv

    def _launch(self, name: str, args: list[str]) -> None:
        ready = self.workdir / "run" / f"{name}.ready"
        argv = self._argv(*args, "--ready-file", str(ready))
        proc = self.procs[name] = _Proc(name, argv, self.workdir / "logs" / f"{name}.log", ready, self._env())
        proc.start()
        proc.wait_ready()

    def stop(self) -> None:
        for c in self._clients:
            try:
                c.close()
            except Exception:
                pass
        self._clients.clear()
        # The directory first: a node it saw go away for a lease term would be declared down (P4),
        # a step of the trace that no crash explains -- a stop is not a crash.
        for name in ["directory", *self.node_ids]:
            proc = self.procs.get(name)
            if proc is not None:
                proc.stop()
        if self._fault_log is not None:
            self._fault_log.close()
            self._fault_log = None
        atexit.unregister(self.stop)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ faults

    def kill(self, name: str) -> None:
        """SIGKILL: the process dies where it stands. The crash is logged (spec ``crash``) in the
        fault injector's event log, since the dead process cannot log it."""
        proc = self.procs[name]
        proc.signal(signal.SIGKILL)
        assert proc.popen is not None
        proc.popen.wait(STOP_GRACE_S)
        proc.paused = False
        if name != "directory":  # a directory crash is its restart_directory, logged on restart
            self.note_crash(name)

    def note_crash(self, name: str, lose_disk: bool = False) -> None:
        """Log that ``name`` (a node, or a client this process killed) crashed."""
        from .events import EventLog

        if self._fault_log is None:
            self._fault_log = EventLog(self.workdir / "events" / "faults.ndjson", "faults", 1)
        self._fault_log.emit("crash", crashed=name, lose_disk=lose_disk)

    def pause(self, name: str) -> None:
        self.procs[name].signal(signal.SIGSTOP)
        self.procs[name].paused = True

    def resume(self, name: str) -> None:
        self.procs[name].signal(signal.SIGCONT)
        self.procs[name].paused = False

    def restart(self, name: str) -> None:
        """Start ``name`` again on its state (a node comes back as a new incarnation)."""
        proc = self.procs[name]
        if proc.alive:
            self.kill(name)
        proc.start()
        proc.wait_ready()

    def restart_directory(self, kill: bool = True) -> None:
        """Kill -9 (or stop) the directory and start it again on its durable log. The nodes
        reconnect (with Hello) on their next request."""
        proc = self.procs["directory"]
        if kill:
            self.kill("directory")
        else:
            proc.stop()
        # The directory takes a new port: the nodes would not find it. Keep the old one.
        port = int(proc.info["port"])
        proc.argv = [a for a in proc.argv]
        if "--port" not in proc.argv:
            proc.argv += ["--port", str(port)]
        proc.start()
        proc.wait_ready()

    def alive(self, name: str) -> bool:
        return self.procs[name].alive

    # ------------------------------------------------------------------ use

    def client(self, client_id: str, *, events: bool = True, timeout_ms: int | None = None) -> Any:
        from .client import SyncClient
        from .events import EventLog

        ev = EventLog(self.workdir / "events" / f"{client_id}.ndjson", client_id, 1) if events else None
        c = SyncClient(self.directory_address, ENGINE_TENANT, self.engine_token, client_id=client_id,
                       skew_ms=self.skew_ms, events=ev, timeout_ms=timeout_ms)  # fmt: skip
        self._clients.append(c)
        return c

    def events(self) -> list[dict[str, Any]]:
        from .events import read_events

        import heapq

        logs: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for path in sorted((self.workdir / "events").glob("*.ndjson")):
            for e in read_events(path, contiguous=False):
                logs.setdefault((e["node"], e["incarnation"]), []).append(e)
        # One order for all: by wall time, each log kept in its own (seq) order. Every process
        # runs on this machine, so wall times agree far better than epsilon.
        return list(heapq.merge(*logs.values(), key=lambda e: e["t_wall_ns"]))
