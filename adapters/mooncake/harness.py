"""A real Mooncake Store deployment on loopback: one ``mooncake_master`` and store-node processes.

    with MooncakeMaster(lease_ttl_ms=2000) as master:
        a = master.start_node("n0"); b = master.start_node("n1")
        assert a.call("put", key="k", payload=b"v")[0] == 0
        assert b.call("get", key="k") == (1, b"v")
        master.kill_node("n1"); master.restart_node("n1")
        master.kill(); master.restart()          # the master itself: SIGKILL and start again
        master.pause(); master.resume()          # SIGSTOP / SIGCONT

Theory of operation
-------------------
``MooncakeMaster`` runs the ``mooncake_master`` binary that the ``mooncake-transfer-engine-non-cuda``
wheel ships, with its RPC port, its embedded HTTP metadata server and its metrics/admin port on
free loopback ports and its working directory in a temporary folder (log in ``master.log``). It is
ready when the admin port answers ``/health``; the RPC port is then also open. A restart reuses
the same ports, so that store nodes reconnect to it; without HA the restarted master has lost all
object metadata (Mooncake's documented behaviour), which the adapters must cope with.

``StoreNode`` is one store client in its own process (``kvcc.adapters.mooncake.worker``), so that
the deployment has real, separately failing nodes: each mounts a segment of its own memory into
the pool, objects any node puts may be placed in any node's segment, and killing a node loses the
objects placed there. The harness speaks ``kvcc.adapters.mooncake.protocol`` to it over two pipes;
a reader thread matches replies to requests by id, so ``call`` is thread-safe, concurrent
requests to one node overlap, and a request that times out (a paused node) raises ``NodeTimeout``
while its late reply is dropped. A node that exits fails every outstanding request with
``NodeGone``.

No process is left behind: ``stop()`` SIGKILLs and reaps every node and the master (paused ones
too), an ``atexit`` hook stops anything still running, nodes ask the kernel to kill them when
their parent dies, and the master runs under ``setpriv --pdeathsig KILL`` where util-linux has it
(``kvcc.reference.procs``, which the other harnesses share: the parent-death signal fires when the
*thread* that started it exits, so start deployments from a long-lived thread, normally the main
one). ``live_pids()`` lists what is still running, for leak checks in tests.

Environment: every child gets ``MC_TCP_BIND_ADDRESS=127.0.0.1`` (the transfer engine would
otherwise bind the first non-loopback interface) and the project's no-telemetry variables.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import importlib.util
import itertools
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any

from kvcc.adapters.mooncake.protocol import READY_ID, FrameError, PipeClosed, encode, read_frame, write_all
from kvcc.reference import procs

__all__ = [
    "MOONCAKE_DIST",
    "MooncakeHarnessError",
    "MooncakeMaster",
    "MooncakeNotInstalled",
    "NodeGone",
    "NodeTimeout",
    "StoreNode",
    "live_pids",
    "master_binary",
    "mooncake_version",
]

MOONCAKE_DIST = "mooncake-transfer-engine-non-cuda"

# -- limits -----------------------------------------------------------------------------------
MASTER_START_TIMEOUT_S = 30.0  # the master is ready in about 1 s here
NODE_START_TIMEOUT_S = 60.0  # python start + import of the store + setup (~0.2 s of setup)
NODE_CALL_TIMEOUT_S = 10.0  # default for one request to a node
NODE_CLOSE_TIMEOUT_S = 5.0  # a graceful close (unmount) before SIGKILL
REAP_TIMEOUT_S = procs.REAP_TIMEOUT_S
SEGMENT_BYTES_DEFAULT = 64 << 20  # each node's share of the pool
LOCAL_BUFFER_BYTES_DEFAULT = 16 << 20  # each node's transfer buffer
LEASE_TTL_MS_DEFAULT = 5000  # the store's per-object read lease (--default_kv_lease_ttl)
CLIENT_TTL_S_DEFAULT = 10  # a silent client's segment is dropped after this (--client_ttl)
POLL_INTERVAL_S = 0.05

assert NODE_CLOSE_TIMEOUT_S < REAP_TIMEOUT_S


class MooncakeHarnessError(RuntimeError):
    """The deployment could not be started, or a process did not behave (the message carries the
    tail of its log)."""


class MooncakeNotInstalled(MooncakeHarnessError):
    """The Mooncake wheel is not installed (``pip install 'kvcc[mooncake]'``), or its master binary
    cannot run (it needs the system library ``libibverbs.so.1`` even for TCP)."""


class NodeTimeout(MooncakeHarnessError, TimeoutError):
    """A request to a store node got no reply in time (the node is paused, or stuck in the store)."""


class NodeGone(MooncakeHarnessError):
    """The store node process is not running (killed, crashed, or stopped by the harness)."""


# -- locating the installation ------------------------------------------------------------------


def _package_dir() -> Path:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise MooncakeNotInstalled(f"the Python package 'mooncake' is not installed (pip install {MOONCAKE_DIST})")
    return Path(list(spec.submodule_search_locations)[0])


def master_binary() -> str:
    """Absolute path of the ``mooncake_master`` ELF binary inside the installed wheel (the
    ``mooncake_master`` on PATH is a Python shim around it). ``KVCC_MOONCAKE_MASTER`` overrides."""
    path = os.environ.get("KVCC_MOONCAKE_MASTER") or str(_package_dir() / "mooncake_master")
    if not os.access(path, os.X_OK):
        raise MooncakeNotInstalled(f"mooncake_master not found or not executable at {path}")
    return path


def mooncake_version() -> str:
    try:
        return importlib.metadata.version(MOONCAKE_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise MooncakeNotInstalled(f"{MOONCAKE_DIST} is not installed") from None


def check_installed() -> None:
    """Raise ``MooncakeNotInstalled`` (with the reason) unless the wheel is installed and its
    master binary finds every shared library it needs."""
    binary = master_binary()
    mooncake_version()
    ldd = shutil.which("ldd")
    if ldd is None:
        return
    out = subprocess.run([ldd, binary], capture_output=True, text=True, timeout=30).stdout
    missing = [line.split()[0] for line in out.splitlines() if "not found" in line]
    if missing:
        raise MooncakeNotInstalled(
            f"mooncake_master needs missing system libraries {missing} (Debian: apt-get install libibverbs1 libnuma1 libcurl4)"
        )


# -- process bookkeeping ---------------------------------------------------------------------------

# Every master and store node this module started and has not reaped yet.
_LIVE = procs.ProcessSet()
_MASTERS: "set[MooncakeMaster]" = set()
_DIR_PREFIX = "kvcc-mooncake-"


def live_pids() -> list[int]:
    """PIDs of masters and store nodes started by this process and still running."""
    return _LIVE.live_pids()


def _reap(p: subprocess.Popen | None) -> None:
    """SIGKILL (which also ends a SIGSTOPped process) and wait."""
    _LIVE.reap(p, timeout_s=REAP_TIMEOUT_S)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(procs.NO_TELEMETRY_ENV, MC_TCP_BIND_ADDRESS=procs.LOOPBACK_HOST)
    # The worker imports kvcc.adapters.mooncake.worker from the same installation as we do
    # (sys.executable, the project installed into its environment).
    return env



# -- store nodes -------------------------------------------------------------------------------------


class StoreNode:
    """One store client process; see the module docstring. Made by ``MooncakeMaster.start_node``."""

    def __init__(self, name: str, master: "MooncakeMaster", segment_bytes: int, buffer_bytes: int) -> None:
        self.name = name
        self.master = master
        self.segment_bytes = segment_bytes
        self.buffer_bytes = buffer_bytes
        self.log_path = master.workdir / f"node-{name}.log"
        self.proc: subprocess.Popen | None = None
        self.paused = False
        self.starts = 0
        self._req_w: int | None = None
        self._resp_r: int | None = None
        self._reader: threading.Thread | None = None
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()  # _pending, _req_w writes, process state
        self._ids = itertools.count(1)
        self._log: IO[bytes] | None = None

    # ---------------------------------------------------------------- lifecycle
    def start(self, timeout_s: float = NODE_START_TIMEOUT_S) -> None:
        assert self.proc is None or self.proc.poll() is not None, f"node {self.name} is running"
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        self._log = open(self.log_path, "ab", buffering=0)
        self._log.write(f"=== start #{self.starts} ===\n".encode())
        self.starts += 1
        args = [
            sys.executable,
            "-m",
            "kvcc.adapters.mooncake.worker",
            f"--req-fd={req_r}",
            f"--resp-fd={resp_w}",
            f"--master={self.master.rpc_address}",
            f"--metadata={self.master.metadata_url}",
            f"--segment-bytes={self.segment_bytes}",
            f"--buffer-bytes={self.buffer_bytes}",
        ]
        try:
            proc = _LIVE.register(
                procs.spawn(args, self._log, env=_child_env(), cwd=self.master.workdir, pass_fds=(req_r, resp_w))
            )
        finally:
            os.close(req_r)
            os.close(resp_w)
        ready: Future = Future()
        with self._lock:
            self.proc = proc
            self.paused = False
            self._req_w, self._resp_r = req_w, resp_r
            self._pending = {READY_ID: ready}
        self._reader = threading.Thread(
            target=self._read_loop, args=(resp_r, proc), name=f"mooncake-node-{self.name}", daemon=True
        )
        self._reader.start()
        try:
            header, _ = ready.result(timeout=timeout_s)
        except Exception as e:
            self.kill()
            raise MooncakeHarnessError(f"store node {self.name} did not start: {e}\n{self.logs()}") from None
        if not header.get("ok"):
            self.kill()
            raise MooncakeHarnessError(f"store node {self.name} setup failed: {header.get('result')}\n{self.logs()}")
        self.pid = header["result"]["pid"]

    def close(self, timeout_s: float = NODE_CLOSE_TIMEOUT_S) -> None:
        """Graceful stop: the node unmounts its segment and exits; SIGKILL if it does not."""
        p = self.proc
        if p is None or p.poll() is not None:
            self.kill()
            return
        if not self.paused:
            try:
                with self._lock:
                    if self._req_w is not None:
                        write_all(self._req_w, encode({"id": next(self._ids), "op": "close", "args": {}}))
                p.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL and reap (a paused node too); outstanding requests fail with ``NodeGone``."""
        with self._lock:
            p, self.proc = self.proc, None
            req_w, self._req_w = self._req_w, None
        _reap(p)
        if req_w is not None:
            try:
                os.close(req_w)
            except OSError:
                pass
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=REAP_TIMEOUT_S)
        self._reader = None
        if self._log is not None:
            try:
                self._log.close()
            except OSError:
                pass
            self._log = None
        self.paused = False

    def pause(self) -> None:
        procs.pause(self._running())
        self.paused = True

    def resume(self) -> None:
        procs.resume(self.proc)
        self.paused = False

    def is_running(self) -> bool:
        return procs.is_running(self.proc)

    def logs(self, lines: int = 40) -> str:
        return f"--- node {self.name} ({self.log_path.name}) ---\n{procs.log_tail(self.log_path, lines)}"

    def _running(self) -> subprocess.Popen:
        p = self.proc
        if p is None or p.poll() is not None:
            raise NodeGone(f"store node {self.name} is not running")
        return p

    # ---------------------------------------------------------------- requests
    def call(self, op: str, *, payload: bytes = b"", timeout_s: float = NODE_CALL_TIMEOUT_S, **args: Any) -> tuple[Any, bytes]:
        """Send one request and wait for its reply: ``(result, payload)``. Raises ``NodeTimeout``
        (no reply in time; a late one is dropped), ``NodeGone`` (the process is not running or
        died meanwhile) or ``MooncakeHarnessError`` (the node answered with an error)."""
        fut: Future = Future()
        with self._lock:
            p = self.proc
            if p is None or p.poll() is not None or self._req_w is None:
                raise NodeGone(f"store node {self.name} is not running")
            req_id = next(self._ids)
            self._pending[req_id] = fut
            try:
                write_all(self._req_w, encode({"id": req_id, "op": op, "args": args}, payload))
            except (OSError, FrameError) as e:
                self._pending.pop(req_id, None)
                raise NodeGone(f"store node {self.name}: cannot send {op}: {e}") from None
        try:
            header, out = fut.result(timeout=timeout_s)
        except TimeoutError:
            with self._lock:
                self._pending.pop(req_id, None)
            raise NodeTimeout(f"store node {self.name}: {op} got no reply within {timeout_s} s") from None
        if not header.get("ok"):
            raise MooncakeHarnessError(f"store node {self.name}: {op} failed: {header.get('error')}")
        return header.get("result"), out

    def _read_loop(self, fd: int, proc: subprocess.Popen) -> None:
        reason = "exited"
        try:
            while True:
                header, payload = read_frame(fd)
                with self._lock:
                    fut = self._pending.pop(header["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result((header, payload))
        except PipeClosed:
            pass
        except (FrameError, OSError) as e:
            reason = f"sent a bad frame ({e})"
        finally:
            try:
                os.close(fd)
            except OSError:
                pass
            with self._lock:
                pending, self._pending = self._pending, {}
            for fut in pending.values():
                if not fut.done():
                    fut.set_exception(NodeGone(f"store node {self.name} {reason}"))


# -- the master ----------------------------------------------------------------------------------------


class MooncakeMaster:
    """One ``mooncake_master`` on loopback and the store nodes attached to it; see the module
    docstring."""

    def __init__(
        self,
        workdir: str | os.PathLike | None = None,
        *,
        lease_ttl_ms: int = LEASE_TTL_MS_DEFAULT,
        client_ttl_s: int = CLIENT_TTL_S_DEFAULT,
        extra_args: tuple[str, ...] = (),
        start_timeout_s: float = MASTER_START_TIMEOUT_S,
    ) -> None:
        if lease_ttl_ms <= 0:
            raise ValueError(f"lease_ttl_ms must be positive, not {lease_ttl_ms}")
        if client_ttl_s <= 0:
            raise ValueError(f"client_ttl_s must be positive, not {client_ttl_s}")
        self.binary = master_binary()
        self.version = mooncake_version()
        self.lease_ttl_ms = lease_ttl_ms
        self.client_ttl_s = client_ttl_s
        self.extra_args = tuple(extra_args)
        self.start_timeout_s = start_timeout_s
        self._given_dir = Path(workdir) if workdir is not None else None
        self.workdir = Path(".")
        self.rpc_port = self.http_port = self.metrics_port = 0
        self.proc: subprocess.Popen | None = None
        self.paused = False
        self.starts = 0
        self.nodes: dict[str, StoreNode] = {}
        self._log: IO[bytes] | None = None
        self._own_dir = False
        self._started = False

    @property
    def rpc_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    @property
    def log_path(self) -> Path:
        return self.workdir / "master.log"

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> "MooncakeMaster":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> "MooncakeMaster":
        if self._started:
            return self
        self._started = True
        _MASTERS.add(self)
        try:
            if self._given_dir is None:
                self.workdir = procs.owned_temp_dir(_DIR_PREFIX)
                self._own_dir = True
            else:
                self._given_dir.mkdir(parents=True, exist_ok=True)
                self.workdir = self._given_dir
            # A port picked free can be taken before the master binds it: retry with new ones.
            for attempt in range(3):
                self.rpc_port, self.http_port, self.metrics_port = procs.free_ports(3)
                self._spawn()
                try:
                    self._wait_ready(self.start_timeout_s)
                    break
                except MooncakeHarnessError:
                    _reap(self.proc)
                    if attempt == 2 or "in use" not in procs.log_tail(self.log_path, 80).lower():
                        raise
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Kill every node and the master (paused ones too), reap them, remove a temporary dir."""
        errors: list[BaseException] = []
        for node in list(self.nodes.values()):
            try:
                node.kill()
            except Exception as e:  # keep stopping the others
                errors.append(e)
        try:
            self.kill()
        except Exception as e:
            errors.append(e)
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self._own_dir = False
        _MASTERS.discard(self)
        self._started = False
        if errors:
            raise errors[0]

    def _args(self) -> list[str]:
        return [
            self.binary,
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            f"--client_ttl={self.client_ttl_s}",
            *self.extra_args,
        ]

    def _spawn(self) -> None:
        self._log = open(self.log_path, "ab", buffering=0)
        self._log.write(f"=== start #{self.starts} ===\n".encode())
        self.starts += 1
        self.proc = _LIVE.register(
            procs.spawn(self._args(), self._log, env=_child_env(), cwd=self.workdir, die_with_parent=True)
        )
        self.paused = False

    def healthy(self, timeout_s: float = 1.0) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/health", timeout=timeout_s) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def metrics(self, timeout_s: float = 2.0) -> str:
        """The master's Prometheus metrics text."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=timeout_s) as r:
            return r.read().decode("utf-8", "replace")

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            p = self.proc
            if p is None or p.poll() is not None:
                code = None if p is None else p.returncode
                raise MooncakeHarnessError(f"mooncake_master exited (code {code}) during start\n{self.logs()}")
            if self.healthy(timeout_s=0.5):
                return
            if time.monotonic() > deadline:
                raise MooncakeHarnessError(f"mooncake_master not ready within {timeout_s} s\n{self.logs()}")
            time.sleep(POLL_INTERVAL_S)

    # ---------------------------------------------------------------- master faults
    def is_running(self) -> bool:
        return procs.is_running(self.proc)

    def kill(self) -> None:
        """SIGKILL the master and reap it (nodes keep running and will try to reconnect)."""
        p, self.proc = self.proc, None
        _reap(p)
        if self._log is not None:
            try:
                self._log.close()
            except OSError:
                pass
            self._log = None
        self.paused = False

    def restart(self, timeout_s: float | None = None) -> None:
        """Kill (if running) and start again on the same ports; all object metadata is lost."""
        self.kill()
        self._spawn()
        self._wait_ready(self.start_timeout_s if timeout_s is None else timeout_s)

    def pause(self) -> None:
        if not self.is_running():
            raise MooncakeHarnessError("mooncake_master is not running")
        assert self.proc is not None
        procs.pause(self.proc)
        self.paused = True

    def resume(self) -> None:
        procs.resume(self.proc)
        self.paused = False

    # ---------------------------------------------------------------- nodes
    def start_node(
        self,
        name: str,
        *,
        segment_bytes: int = SEGMENT_BYTES_DEFAULT,
        buffer_bytes: int = LOCAL_BUFFER_BYTES_DEFAULT,
    ) -> StoreNode:
        if not self._started:
            raise MooncakeHarnessError("start the master before its nodes")
        if name in self.nodes and self.nodes[name].is_running():
            raise MooncakeHarnessError(f"store node {name} is already running")
        node = self.nodes.get(name) or StoreNode(name, self, segment_bytes, buffer_bytes)
        self.nodes[name] = node
        node.start()
        return node

    def node(self, name: str) -> StoreNode:
        try:
            return self.nodes[name]
        except KeyError:
            raise MooncakeHarnessError(f"no store node named {name!r}") from None

    def kill_node(self, name: str) -> None:
        self.node(name).kill()

    def restart_node(self, name: str) -> StoreNode:
        node = self.node(name)
        node.kill()
        node.start()
        return node

    def logs(self, lines: int = 40) -> str:
        parts = [f"--- mooncake_master ({self.log_path.name}) ---\n{procs.log_tail(self.log_path, lines)}"]
        parts += [n.logs(lines) for n in self.nodes.values()]
        return "\n".join(parts)

    def __repr__(self) -> str:
        return f"MooncakeMaster(rpc={self.rpc_address}, nodes={sorted(self.nodes)})"


@atexit.register
def _stop_all() -> None:
    for m in list(_MASTERS):
        try:
            m.stop()
        except Exception:
            pass
    _LIVE.reap_all()
