"""A local cluster on loopback: one directory process (or one per shard) and N cache-node processes.

``LocalCluster(workdir, nodes=3, ...)`` writes the deployment file, starts every process as
``kvcc serve ...`` on free ports (each process binds port 0 and reports the port it got in its
ready file) -- the directory first, then the nodes side by side -- waits until each serves, and
stops them all on ``stop()`` -- SIGTERM, then SIGKILL after ``STOP_GRACE_S``. The processes are
forked by a warm zygote (``WARM_MODULES``), so each starts without a fresh interpreter's imports. Nothing is left running: processes are started in their own
process group and ``stop`` is idempotent and also runs at interpreter exit.

Faults act on the real processes: ``kill(node)`` (SIGKILL: no chance to sync anything),
``pause(node)``/``resume(node)`` (SIGSTOP/SIGCONT: a process that stops in the middle of
whatever it was doing, its leases running out on the other clocks), ``restart(node)`` (a new
incarnation on the same state directory), ``restart_directory()``.

A sharded directory (docs/sharding.md): ``LocalCluster(..., shards=N)`` runs N directory
processes, ``directory-0`` .. ``directory-{N-1}``, shard ``i`` with its own state
(``state/directory-i``), events file (``events/directory-i.ndjson``) and, on etcd, its own prefix
(``<etcd_prefix>-s<i>``); every node registers with every shard. ``directory_addresses`` lists
them in shard order; ``restart_directory(shard=i)`` restarts one; ``kill``/``pause``/``resume``
take a shard's process name. ``client()`` is then a synchronous ``ShardedClient``
(``kvcc.reference.sharded``), which routes each request to its key's shard.

Every process writes its protocol events to ``<workdir>/events/<name>.ndjson``; ``events()``
reads them all back (``kvcc.reference.events.read_events``), the input of trace validation.

Clients for the cluster: ``client(client_id)`` returns a ``SyncClient`` of the engine tenant (under
TLS when the cluster was given a ``tls`` section: ``LocalCluster(tls=...)``).

Credentials: the deployment file gives the engine tenant its namespaces, and every node a credential
of its own (a ``nodes`` section, ``kvcc.reference.serve``), generated here: a tenant can never act as
a node, nor a node as another (issue 14). ``node_token(node)`` is a node's.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvcc.spec.keys import Namespace

from . import procs

START_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0
ENGINE_TENANT = "engine"
NODE_TENANT = "nodes"
OPERATOR = "ops"  # the deployment's operator (``operator_client``)
DEFAULT_TIERS = ("dram=8MiB", "nvme=32MiB")
DEFAULT_BLOCK_BYTES = 64 << 10


# What every process of a cluster imports before it serves (the directory, the node, its
# tiers -- torch, for the DRAM arena: seconds of CPU per process): imported once per interpreter
# by a warm *zygote* process, which forks each cluster process. Each is still a process of its
# own, in a session of its own, entered through the CLI as ``python -m kvcc`` would be; it is
# only spared the imports. (Not the CLI itself: the reference is below it in the layers, and its
# import costs a forked process about 35 ms of CPU.)
WARM_MODULES = ("kvcc.reference.serve", "kvcc.reference.node", "kvcc.reference.directory.server",
                "kvcc.reference.directory.core", "kvcc.reference.tiers.dram", "kvcc.reference.tiers.nvme", "torch")

# The zygote: reads one JSON request a line ({"args", "log", "env"}), forks, answers {"pid"}; reports
# each child's end as {"exit": pid, "code": status} (it is their parent: it reaps them).
_ZYGOTE = r"""
import importlib, json, os, signal, sys, traceback
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ImportError:
        pass  # a module this install lacks: its processes import what they need themselves
out = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)

def reap(*_):
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])  # one report at a time on ``out``
    try:
        while True:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            out.write(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")
    except ChildProcessError:
        return
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])

def child(req):
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    out.close()
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(req["env"])
    sys.argv = ["kvcc", *req["args"]]
    code = 1
    try:
        from kvcc.cli import main
        code = main(req["args"]) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

signal.signal(signal.SIGCHLD, reap)
for line in sys.stdin:
    req = json.loads(line)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])  # no report before the pid
    pid = os.fork()
    if pid == 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
        child(req)
    out.write(json.dumps({"pid": pid}) + "\n")
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
"""


UNKNOWN_EXIT = -1  # the exit status of a forked process that outlived its zygote


class ClusterError(RuntimeError):
    """A process of the cluster did not start or died; the message has its log's tail."""


class _Zygote:
    """This interpreter's zygote (started on first use), and what it reported."""

    _lock = threading.Lock()
    _current: _Zygote | None = None

    def __init__(self, env: dict[str, str]) -> None:
        self.popen = subprocess.Popen([sys.executable, "-c", _ZYGOTE, *WARM_MODULES], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env, text=True, bufsize=1)  # fmt: skip
        self.codes: dict[int, int] = {}
        self.ended = threading.Condition()
        self.pids: queue.Queue[int | None] = queue.Queue()
        self.gone = False  # it exited: the processes it forked report no exit status any more
        # No atexit hook: when this interpreter exits its end of the pipe closes, and so does the
        # zygote (after the clusters' own atexit stops, which still get their exit statuses).
        threading.Thread(target=self._read, name="cluster-zygote", daemon=True).start()

    @classmethod
    def get(cls, env: dict[str, str]) -> _Zygote:
        with cls._lock:
            if cls._current is None or cls._current.popen.poll() is not None:
                cls._current = _Zygote(env)
            return cls._current

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            msg = json.loads(line)
            if "pid" in msg:
                self.pids.put(msg["pid"])
            else:
                with self.ended:
                    self.codes[msg["exit"]] = msg["code"]
                    self.ended.notify_all()
        self.pids.put(None)  # the zygote is gone: no answer will come
        with self.ended:
            self.gone = True
            self.ended.notify_all()

    def fork(self, args: list[str], log_path: Path, env: dict[str, str]) -> int:
        assert self.popen.stdin is not None
        with self._lock:
            self.popen.stdin.write(json.dumps({"args": args, "log": str(log_path), "env": env}) + "\n")
            self.popen.stdin.flush()
            pid = self.pids.get(timeout=START_TIMEOUT_S)
        if pid is None:
            raise ClusterError("the zygote that starts cluster processes exited")
        return pid


class _Forked:
    """A process the zygote forked, behind the part of ``subprocess.Popen`` that ``_Proc`` uses."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str]) -> None:
        self._zygote = _Zygote.get(env)
        self.pid = self._zygote.fork(args, log_path, env)

    @property
    def returncode(self) -> int | None:
        code = self._zygote.codes.get(self.pid)
        if code is None and self._zygote.gone and not _exists(self.pid):
            code = UNKNOWN_EXIT  # it ended after the zygote did (init reaped it)
        return code

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # it just ended: the zygote reaped it
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._zygote.ended:
            while (code := self.returncode) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
                # Woken by the zygote's reports; polled while it is gone (no report will come).
                self._zygote.ended.wait(min(left or 0.05, 0.05) if self._zygote.gone else left)
        return code


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Proc:
    def __init__(self, name: str, argv: list[str], log_path: Path, ready: Path, env: dict[str, str]) -> None:
        self.name, self.argv, self.log_path, self.ready, self.env = name, argv, log_path, ready, env
        self.popen: subprocess.Popen | _Forked | None = None
        self.info: dict[str, Any] = {}
        self.paused = False

    def start(self) -> None:
        self.ready.unlink(missing_ok=True)
        if self.argv[1:3] == ["-m", "kvcc"]:
            self.popen = _Forked(self.argv[3:], self.log_path, self.env)
            return
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child owns it)
        try:
            self.popen = procs.spawn(self.argv, log, env=self.env)
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
        return procs.log_tail(self.log_path, lines)

    @property
    def alive(self) -> bool:
        return procs.is_running(self.popen)

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.popen is not None:
            procs.stop_process(self.popen, timeout_s=STOP_GRACE_S)
        self.paused = False

    def pause(self) -> None:
        if self.alive:
            assert self.popen is not None
            procs.pause(self.popen)
            self.paused = True

    def resume(self) -> None:
        procs.resume(self.popen)
        self.paused = False

    def terminate(self) -> None:
        """Ask the process to shut down (SIGTERM; SIGCONT first if paused); ``stop`` waits: a
        cluster tells all its nodes at once, then waits for them together."""
        if self.alive:
            assert self.popen is not None
            with contextlib.suppress(ProcessLookupError):  # a forked process that just ended
                if self.paused:
                    os.kill(self.popen.pid, signal.SIGCONT)
                    self.paused = False
                self.popen.terminate()

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM (a paused process continued first), then SIGKILL to its process group."""
        if self.popen is not None:
            procs.stop_process(self.popen, grace_s=grace_s, paused=self.paused, group=True, timeout_s=grace_s)
        self.paused = False


def _sync_sharded() -> Any:
    """``kvcc.reference.sharded.SyncShardedClient``, imported on first use (a cluster's sharded
    directory)."""
    from .sharded import SyncShardedClient

    return SyncShardedClient


class LocalCluster:
    """``LocalCluster(workdir, nodes=3, tiers=DEFAULT_TIERS, lease_term_ms=2000, skew_ms=100,
    namespaces=(), backend="sqlite", etcd_endpoints=None, pool=False, metrics=False, transport=None,
    tls=None, shards=1)``; ``start()``/``stop()`` or a context manager. With ``metrics`` every process serves
    Prometheus metrics on a free port (``metrics_url(name)``). ``tls``: the deployment file's
    ``"tls"`` section (``kvcc.reference.serve``; relative paths from ``workdir``): every process
    serves TLS, and ``client()`` connects with it. ``shard=(i, n)``: the directory serves shard
    ``i`` of ``n`` of a sharded directory (``kvcc serve directory --shard I --shards N``; the other
    shards are not started: docs/sharding.md). ``shards=N``: the whole directory sharded N ways,
    one process per shard (``directory-0`` .. ``directory-{N-1}``), every node registered with
    every shard."""

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
        metrics: bool = False,
        transport: Mapping[str, int] | None = None,
        tls: Mapping[str, Any] | None = None,
        shard: tuple[int, int] | None = None,
        shards: int = 1,
    ) -> None:
        if nodes < 1:
            raise ValueError("a cluster has at least one node")
        if type(shards) is not int or shards < 1:
            raise ValueError(f"shards is a count of at least 1, got {shards!r}")
        if shard is not None and shards > 1:
            raise ValueError("shard=(i, n) runs one shard of a directory; shards=N runs all N: not both")
        self.shard = shard
        self.shards = shards
        # The directory's processes, in shard order: "directory" (the one directory, or the one
        # shard of ``shard``), or "directory-0" .. "directory-{N-1}".
        self.directory_names = ["directory"] if shards == 1 else [f"directory-{i}" for i in range(shards)]
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
        self.metrics = metrics
        digests = [ns.digest() if isinstance(ns, Namespace) else ns for ns in namespaces]
        self.engine_token = secrets.token_bytes(32)
        self.config = {
            "lease_term_ms": lease_term_ms,
            "skew_ms": skew_ms,
            "tenants": {
                ENGINE_TENANT: {"token": self.engine_token.hex(), "namespaces": [d.hex() for d in digests]},
                # A tenant of no namespace, under the name the nodes shared before they had
                # credentials of their own: kept for the tools that connect as a second tenant.
                NODE_TENANT: {"token": secrets.token_bytes(32).hex()},
            },
            # Each node's own credential, bound to its id (issue 14): the directory takes a node's
            # messages only under it, and a tenant's credential can never act as a node.
            "nodes": {node: {"token": secrets.token_bytes(32).hex()} for node in self.node_ids},
            # The operator's credential: invalidates and looks up in every namespace, nothing else.
            "operators": {OPERATOR: {"token": secrets.token_bytes(32).hex()}},
        }
        if transport:
            self.config["transport"] = dict(transport)  # the servers' ServerLimits (kvcc.reference.serve)
        self.tls = None  # the TlsConfig that clients of this cluster connect with
        if tls is not None:
            from .transport import TlsConfig

            self.config["tls"] = dict(tls)
            self.tls = TlsConfig.from_dict(tls, base=self.workdir)  # a bad section fails here, not in a process
        self.procs: dict[str, _Proc] = {}
        self._clients: list[Any] = []
        self._fault_log: Any = None
        self._keys: dict[str, bytes] | None = None  # the nodes' grant keys (read_grant)
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
        metrics = ["--metrics-port", "0"] if self.metrics else []
        return [sys.executable, "-m", "kvcc", "serve", *args, "--config", str(self.config_path), *verbose, *metrics]

    @property
    def config_path(self) -> Path:
        return self.workdir / "cluster.json"

    @property
    def directory_address(self) -> tuple[str, int]:
        """The directory's address (a cluster of one directory process; ``directory_addresses``
        for a sharded one)."""
        if self.shards > 1:
            raise ClusterError(f"this cluster's directory is sharded {self.shards} ways: it has no one address "
                               "(directory_addresses lists each shard's, in shard order)")  # fmt: skip
        return ("127.0.0.1", int(self.procs["directory"].info["port"]))

    @property
    def directory_addresses(self) -> list[tuple[str, int]]:
        """Each directory process's address, in shard order (one for an unsharded directory)."""
        return [("127.0.0.1", int(self.procs[name].info["port"])) for name in self.directory_names]

    def metrics_url(self, name: str) -> str:
        """Where process ``name`` serves its Prometheus metrics (``metrics=True``)."""
        if not self.metrics:
            raise ClusterError("this cluster was started without metrics (LocalCluster(metrics=True))")
        scheme = "https" if self.tls is not None and self.tls.on else "http"
        return f"{scheme}://127.0.0.1:{int(self.procs[name].info['metrics_port'])}/metrics"

    def start(self) -> LocalCluster:
        for sub in ("events", "logs", "state", "run"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(json.dumps(self.config, indent=1))
        atexit.register(self.stop)
        self._started = True
        try:
            # The shards start side by side, as the nodes do (they need nothing of each other).
            for proc in [self._launch(name, self._directory_argv(i)) for i, name in enumerate(self.directory_names)]:
                proc.wait_ready()
            # The nodes need only the directory's address: they start side by side, so a
            # deployment is up in about one process's start-up time, not one per node.
            for proc in [self._launch(node, self._node_argv(node)) for node in self.node_ids]:
                proc.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _directory_argv(self, i: int) -> list[str]:
        """Directory process ``i``'s arguments: shard ``i`` of ``shards`` when sharded."""
        name = self.directory_names[i]
        argv = ["directory", "--state", str(self.workdir / "state" / name), "--backend", self.backend,
                "--events", str(self.workdir / "events" / f"{name}.ndjson")]  # fmt: skip
        if self.backend == "etcd":
            prefix = self.etcd_prefix if self.shards == 1 else f"{self.etcd_prefix}-s{i}"
            argv += ["--etcd-endpoints", str(self.etcd_endpoints), "--etcd-prefix", prefix]
        if self.shard is not None:
            argv += ["--shard", str(self.shard[0]), "--shards", str(self.shard[1])]
        elif self.shards > 1:
            argv += ["--shard", str(i), "--shards", str(self.shards)]
        return argv

    def _node_argv(self, node: str) -> list[str]:
        argv = ["node", "--id", node]
        for host, port in self.directory_addresses:  # every shard, in shard order
            argv += ["--directory", f"{host}:{port}"]
        argv += ["--state", str(self.workdir / "state" / node), "--block-bytes", str(self.block_bytes),
                "--events", str(self.workdir / "events" / f"{node}.ndjson")]  # fmt: skip
        for t in self.tiers:
            argv += ["--tier", t]
        if self.pool:
            argv += ["--pool", str(self.workdir / "state" / "pool")]
        return argv

    def _launch(self, name: str, args: list[str]) -> _Proc:
        """Start ``name``; the caller waits until it is ready."""
        ready = self.workdir / "run" / f"{name}.ready"
        argv = self._argv(*args, "--ready-file", str(ready))
        proc = self.procs[name] = _Proc(name, argv, self.workdir / "logs" / f"{name}.log", ready, self._env())
        proc.start()
        return proc

    def stop(self) -> None:
        for c in self._clients:
            try:
                c.close()
            except Exception:
                pass
        self._clients.clear()
        # The directory first: a node it saw go away for a lease term would be declared down (P4),
        # a step of the trace that no crash explains -- a stop is not a crash. Then every node
        # is told at once and waited for together (each syncs its tiers as it goes). The shards
        # of a sharded directory are told at once too, and waited for before any node.
        directories = [p for p in (self.procs.get(n) for n in self.directory_names) if p is not None]
        for proc in directories:
            proc.terminate()
        for proc in directories:
            proc.stop()
        nodes = [p for p in (self.procs.get(n) for n in self.node_ids) if p is not None]
        for proc in nodes:
            proc.terminate()
        for proc in nodes:
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
        self.procs[name].kill()
        if name not in self.directory_names:  # a directory crash is its restart_directory, logged on restart
            self.note_crash(name)

    def note_crash(self, name: str, lose_disk: bool = False) -> None:
        """Log that ``name`` (a node, or a client this process killed) crashed."""
        from .events import EventLog

        if self._fault_log is None:
            self._fault_log = EventLog(self.workdir / "events" / "faults.ndjson", "faults", 1)
        self._fault_log.emit("crash", crashed=name, lose_disk=lose_disk)

    def pause(self, name: str) -> None:
        self.procs[name].pause()

    def resume(self, name: str) -> None:
        self.procs[name].resume()

    def restart(self, name: str) -> None:
        """Start ``name`` again on its state (a node comes back as a new incarnation)."""
        proc = self.procs[name]
        if proc.alive:
            self.kill(name)
        proc.start()
        proc.wait_ready()

    def restart_directory(self, kill: bool = True, shard: int | None = None) -> None:
        """Kill -9 (or stop) the directory and start it again on its durable log. The nodes
        reconnect (with Hello) on their next request. Sharded: shard ``shard`` alone (the others
        go on serving), or with ``shard=None`` every shard, one after another."""
        if shard is None:
            for name in self.directory_names:
                self._restart_directory(name, kill)
            return
        if type(shard) is not int or not 0 <= shard < self.shards:
            raise ValueError(f"shard {shard!r}: this cluster's directory has shards 0 .. {self.shards - 1}")
        self._restart_directory(self.directory_names[shard], kill)

    def _restart_directory(self, name: str, kill: bool) -> None:
        proc = self.procs[name]
        if kill:
            self.kill(name)
        else:
            proc.stop()
        # The directory takes a new port: the nodes would not find it. Keep the old one.
        port = int(proc.info["port"])
        proc.argv = [a for a in proc.argv]
        if "--port" not in proc.argv:
            proc.argv += ["--port", str(port)]
        if self.metrics:  # and its metrics where a scraper looks for them
            at = proc.argv.index("--metrics-port") + 1
            proc.argv[at] = str(proc.info["metrics_port"])
        proc.start()
        proc.wait_ready()

    def alive(self, name: str) -> bool:
        return self.procs[name].alive

    # ------------------------------------------------------------------ use

    def node_token(self, node: str) -> bytes:
        """Node ``node``'s own credential's token (its name is ``wire.node_credential(node)``)."""
        return bytes.fromhex(self.config["nodes"][node]["token"])

    def read_grant(self, location: str, key: Any, gen: int, *, lease: int = 1, ttl_ms: int = 60_000) -> bytes:
        """A data-plane read grant of (key, gen) at ``location`` to the engine tenant, signed with
        the deployment's grant key as the directory signs one (``wire.grants``): what a tool that
        inspects what a node holds presents -- an operator's, who holds the deployment file.
        Holders get theirs from the directory with their leases."""
        from .wire.grants import GRANT_READ, sign_grant

        keys = self._grant_keys()
        expires_ms = time.time_ns() // 1_000_000 + ttl_ms
        return sign_grant([keys[n] for n in sorted(keys)], GRANT_READ, ENGINE_TENANT, key.digest, gen, 0, location,
                          lease, expires_ms)  # fmt: skip

    def _grant_keys(self) -> dict[str, bytes]:
        """The nodes' grant keys, read from the deployment file once."""
        if self._keys is None:
            from .serve import ClusterConfig
            from .wire.grants import grant_keys

            self._keys = grant_keys(ClusterConfig.load(self.config_path).tenants)
        return self._keys

    def client(self, client_id: str, *, events: bool = True, timeout_ms: int | None = None) -> Any:
        """A client of the engine tenant: a ``SyncClient``, or for a sharded directory a
        synchronous ``ShardedClient`` (one session per shard, one event log for them all)."""
        from .client import SyncClient
        from .events import EventLog

        ev = EventLog(self.workdir / "events" / f"{client_id}.ndjson", client_id, 1) if events else None
        if self.shards > 1:
            c = _sync_sharded()([(addr, ENGINE_TENANT, self.engine_token) for addr in self.directory_addresses],
                                client_id=client_id, skew_ms=self.skew_ms, events=ev, timeout_ms=timeout_ms,
                                tls=self.tls)  # fmt: skip
        else:
            c = SyncClient(self.directory_address, ENGINE_TENANT, self.engine_token, client_id=client_id,
                           skew_ms=self.skew_ms, events=ev, timeout_ms=timeout_ms, tls=self.tls)  # fmt: skip
        self._clients.append(c)
        return c

    def operator_client(self, client_id: str, *, timeout_ms: int | None = None) -> Any:
        """A client under the deployment's operator credential (``wire.operator_credential``): it
        invalidates and looks up in every namespace and lists the nodes; the directory refuses it
        anything else. It logs no events: it takes no step of a holder or a writer."""
        from .client import SyncClient
        from .wire import operator_credential

        token = bytes.fromhex(self.config["operators"][OPERATOR]["token"])
        if self.shards > 1:
            c = _sync_sharded()([(addr, operator_credential(OPERATOR), token) for addr in self.directory_addresses],
                                client_id=client_id, skew_ms=self.skew_ms, timeout_ms=timeout_ms,
                                tls=self.tls)  # fmt: skip
        else:
            c = SyncClient(self.directory_address, operator_credential(OPERATOR), token, client_id=client_id,
                           skew_ms=self.skew_ms, timeout_ms=timeout_ms, tls=self.tls)  # fmt: skip
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
