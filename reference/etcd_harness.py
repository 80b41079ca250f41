"""Start and stop a real etcd cluster on loopback, for tests and benchmarks.

``EtcdCluster(members=1|3)`` runs Debian's ``etcd`` (etcd-server, 3.4.x) with
free loopback ports and a temporary data directory, waits until every member
reports healthy, and tears everything down on ``stop()`` / context exit /
interpreter exit::

    with EtcdCluster(members=3) as cluster:
        cluster.endpoints            # ["http://127.0.0.1:P0", ...]
        cluster.leader()             # index of the current leader
        cluster.kill(i); cluster.restart(i)
        cluster.pause(i); cluster.resume(i)

Each member logs to ``<data_dir>/<name>.log``; a start that fails raises
:class:`EtcdHarnessError` carrying the tail of those logs.

Processes are never left behind: ``stop()`` kills every member (also paused
ones) and reaps it, an ``atexit`` hook stops any cluster still running, and
where util-linux ``setpriv`` exists each member is started with
``--pdeathsig KILL`` so it dies with the Python process that started it even
when that process is itself killed with SIGKILL (``kvcc.reference.procs``, which
the other harnesses share: start clusters from a long-lived thread, normally the
main one).

etcd 3.4 serves the v3 JSON gateway under ``/v3/`` on the client port;
``--enable-grpc-gateway`` is passed explicitly (it is the 3.4 default).
"""

from __future__ import annotations

import atexit
import json
import os
import platform
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from . import procs

__all__ = ["EtcdCluster", "EtcdHarnessError", "EtcdNotInstalled", "etcd_binary", "etcd_version", "live_pids"]


class EtcdHarnessError(RuntimeError):
    """The cluster could not be started, or a member did not become healthy."""


class EtcdNotInstalled(EtcdHarnessError):
    """No ``etcd`` binary on PATH (Debian: ``apt-get install etcd-server``)."""


def etcd_binary() -> str:
    """Absolute path of the ``etcd`` server binary, or raise :class:`EtcdNotInstalled`."""
    path = os.environ.get("KVCC_ETCD_BIN") or shutil.which("etcd")
    if not path or not os.access(path, os.X_OK):
        raise EtcdNotInstalled(
            "etcd server binary not found on PATH "
            "(install Debian's etcd-server: apt-get install etcd-server etcd-client, "
            "or set KVCC_ETCD_BIN)"
        )
    return path


def etcd_version(binary: str | None = None) -> str:
    """The server version string, e.g. ``"3.4.23"``."""
    out = subprocess.run(
        [binary or etcd_binary(), "--version"], capture_output=True, text=True, timeout=30, env=_child_env()
    ).stdout
    for line in out.splitlines():
        if line.lower().startswith("etcd version:"):
            return line.split(":", 1)[1].strip()
    raise EtcdHarnessError(f"cannot parse `etcd --version` output: {out!r}")


# Go's names for the architectures etcd 3.4 refuses unless ETCD_UNSUPPORTED_ARCH names them.
_GOARCH = {"aarch64": "arm64", "arm64": "arm64", "s390x": "s390x", "armv7l": "arm", "i686": "386", "i386": "386"}


def _child_env() -> dict[str, str]:
    # ETCD_* variables would configure the member behind our flags' back; drop them.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
    goarch = _GOARCH.get(platform.machine().lower())
    if goarch:  # etcd 3.4 officially supports only amd64 and ppc64le
        env["ETCD_UNSUPPORTED_ARCH"] = goarch
    return env


def _http_json(url: str, body: dict | None = None, timeout_s: float = 1.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read() or b"{}")


_DIR_PREFIX = "kvcc-etcd-"
GRACEFUL_STOP_S = 3.0  # a member with a given data dir gets SIGTERM and this long before SIGKILL

# Every member this module started and has not reaped yet.
_LIVE = procs.ProcessSet()
_CLUSTERS: "set[EtcdCluster]" = set()


def live_pids() -> list[int]:
    """PIDs of etcd members started by this process and still running (for leak checks)."""
    return _LIVE.live_pids()


@dataclass
class _Member:
    index: int
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen | None = None
    log_file: IO[bytes] | None = None
    paused: bool = False
    member_id: str | None = None  # etcd's member id (decimal string, as the gateway prints it)
    starts: int = field(default=0)

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"


class EtcdCluster:
    """A 1- or 3-member (any n >= 1) etcd cluster on loopback; see the module docstring."""

    def __init__(
        self,
        members: int = 1,
        data_dir: str | os.PathLike | None = None,
        *,
        start_timeout_s: float = 30.0,
        heartbeat_ms: int = 100,
        election_ms: int = 1000,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        if members < 1:
            raise ValueError("members must be >= 1")
        self.size = members
        self._given_dir = Path(data_dir) if data_dir is not None else None
        self._own_dir = data_dir is None
        self.start_timeout_s = start_timeout_s
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.extra_args = tuple(extra_args)
        self.binary = etcd_binary()
        self.token = f"kvcc-{uuid.uuid4().hex[:12]}"
        self.data_dir: Path | None = None
        self.members: list[_Member] = []
        self._started = False

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "EtcdCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "EtcdCluster":
        if self._started:
            return self
        self._started = True
        _CLUSTERS.add(self)
        try:
            if self._own_dir:
                self.data_dir = procs.owned_temp_dir(_DIR_PREFIX)
            else:
                assert self._given_dir is not None
                self._given_dir.mkdir(parents=True, exist_ok=True)
                self.data_dir = self._given_dir
            # A port picked free can be taken before etcd binds it: retry with new ports.
            last: Exception | None = None
            for attempt in range(3):
                self._layout(attempt)
                for m in self.members:
                    self._spawn(m, initial=True)
                try:
                    self._wait_healthy(self.members, self.start_timeout_s)
                    break
                except EtcdHarnessError as e:
                    last = e
                    bind_race = any("address already in use" in self._log_tail(m, 50) for m in self.members)
                    self._kill_all()
                    if not bind_race:
                        raise
            else:
                raise last  # type: ignore[misc]
            self._learn_member_ids()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Kill every member (paused ones too), reap it, remove the temporary data dir."""
        try:
            # A temporary cluster's data is deleted anyway: SIGKILL (a graceful stop of a
            # leader waits for a leadership transfer). A given data dir gets SIGTERM first.
            self._kill_all(graceful=not self._own_dir)
        finally:
            if self._own_dir and self.data_dir is not None:
                shutil.rmtree(self.data_dir, ignore_errors=True)
                self.data_dir = None
            _CLUSTERS.discard(self)
            self._started = False

    # ------------------------------------------------------------------ info
    @property
    def endpoints(self) -> list[str]:
        return [m.client_url for m in self.members]

    def endpoint(self, member: int) -> str:
        return self.members[member].client_url

    def pid(self, member: int) -> int | None:
        p = self.members[member].proc
        return p.pid if p is not None and p.poll() is None else None

    def is_running(self, member: int) -> bool:
        return self.pid(member) is not None

    def status(self, member: int, timeout_s: float = 1.0) -> dict:
        """``/v3/maintenance/status`` of one member (raises on connection errors)."""
        return _http_json(self.endpoint(member) + "/v3/maintenance/status", {}, timeout_s=timeout_s)

    def leader(self, timeout_s: float = 10.0) -> int:
        """Index of the member that is leader, as agreed by a reachable member."""
        deadline = time.monotonic() + timeout_s
        while True:
            for m in self.members:
                if not self.is_running(m.index) or m.paused:
                    continue
                try:
                    st = self.status(m.index)
                except (OSError, ValueError):
                    continue
                lead = st.get("leader")
                for other in self.members:
                    if other.member_id is not None and other.member_id == lead:
                        if self.is_running(other.index) and not other.paused:
                            return other.index
            if time.monotonic() > deadline:
                raise EtcdHarnessError(f"no leader within {timeout_s}s\n{self.logs()}")
            time.sleep(0.05)

    def healthy(self, member: int, timeout_s: float = 1.0) -> bool:
        try:
            return _http_json(self.endpoint(member) + "/health", timeout_s=timeout_s).get("health") in ("true", True)
        except (OSError, ValueError):
            return False

    def wait_healthy(self, members: list[int] | None = None, timeout_s: float | None = None) -> None:
        ms = self.members if members is None else [self.members[i] for i in members]
        self._wait_healthy(ms, self.start_timeout_s if timeout_s is None else timeout_s)

    def logs(self, lines: int = 40) -> str:
        return "\n".join(
            f"--- {m.name} ({m.log_path}) ---\n{self._log_tail(m, lines)}" for m in self.members
        )

    # ------------------------------------------------------------------ faults
    def kill(self, member: int) -> None:
        """SIGKILL one member and reap it (its data dir stays, for restart())."""
        self._kill(self.members[member])

    def pause(self, member: int) -> None:
        """SIGSTOP one member (it keeps its sockets but answers nothing)."""
        m = self.members[member]
        if not procs.is_running(m.proc):
            raise EtcdHarnessError(f"{m.name} is not running")
        assert m.proc is not None
        procs.pause(m.proc)
        m.paused = True

    def resume(self, member: int) -> None:
        """SIGCONT a paused member."""
        m = self.members[member]
        procs.resume(m.proc)
        m.paused = False

    def restart(self, member: int, wait: bool = True, timeout_s: float | None = None) -> None:
        """(Kill if running, then) start one member again on its old data dir and ports."""
        m = self.members[member]
        self._kill(m)
        self._spawn(m, initial=False)
        if wait:
            self._wait_healthy([m], self.start_timeout_s if timeout_s is None else timeout_s)

    # ------------------------------------------------------------------ internals
    def _layout(self, attempt: int) -> None:
        assert self.data_dir is not None
        ports = procs.free_ports(2 * self.size)
        self.members = []
        for i in range(self.size):
            name = f"m{i}"
            mdir = self.data_dir / f"{name}.a{attempt}"
            self.members.append(
                _Member(i, name, ports[2 * i], ports[2 * i + 1], mdir, self.data_dir / f"{name}.a{attempt}.log")
            )

    def _args(self, m: _Member) -> list[str]:
        cluster = ",".join(f"{o.name}={o.peer_url}" for o in self.members)
        return [
            self.binary,
            "--name", m.name,
            "--data-dir", str(m.data_dir),
            "--listen-client-urls", m.client_url,
            "--advertise-client-urls", m.client_url,
            "--listen-peer-urls", m.peer_url,
            "--initial-advertise-peer-urls", m.peer_url,
            "--initial-cluster", cluster,
            "--initial-cluster-state", "new",  # ignored once the data dir holds a WAL (restart)
            "--initial-cluster-token", self.token,
            "--heartbeat-interval", str(self.heartbeat_ms),
            "--election-timeout", str(self.election_ms),
            "--enable-grpc-gateway=true",
            "--logger", "zap",
            "--log-outputs", "stderr",
            *self.extra_args,
        ]

    def _spawn(self, m: _Member, initial: bool) -> None:
        m.log_file = open(m.log_path, "ab", buffering=0)
        m.log_file.write(f"=== start #{m.starts} ({'initial' if initial else 'restart'}) ===\n".encode())
        m.starts += 1
        m.proc = _LIVE.register(procs.spawn(self._args(m), m.log_file, env=_child_env(), die_with_parent=True))
        m.paused = False

    def _wait_healthy(self, members: list[_Member], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(members)
        while pending:
            for m in list(pending):
                if m.proc is None or m.proc.poll() is not None:
                    code = None if m.proc is None else m.proc.returncode
                    raise EtcdHarnessError(f"etcd member {m.name} exited (code {code}) during start\n{self.logs()}")
                if self.healthy(m.index, timeout_s=0.5):
                    pending.remove(m)
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(m.name for m in pending)
                raise EtcdHarnessError(f"etcd member(s) {names} not healthy within {timeout_s}s\n{self.logs()}")
            time.sleep(0.05)

    def _learn_member_ids(self) -> None:
        for m in self.members:
            st = self.status(m.index, timeout_s=5.0)
            m.member_id = str(st["header"]["member_id"])

    def _kill(self, m: _Member, graceful: bool = False) -> None:
        # A paused member gets no SIGTERM: it could not act on it.
        _LIVE.reap(m.proc, grace_s=GRACEFUL_STOP_S if graceful and not m.paused else 0.0)
        if m.log_file is not None:
            try:
                m.log_file.close()
            except OSError:
                pass
            m.log_file = None
        m.paused = False

    def _kill_all(self, graceful: bool = False) -> None:
        errors = []
        for m in self.members:
            try:
                self._kill(m, graceful=graceful)
            except Exception as e:  # keep killing the others
                errors.append(e)
        if errors:
            raise errors[0]

    @staticmethod
    def _log_tail(m: _Member, lines: int) -> str:
        return procs.log_tail(m.log_path, lines)

    def __repr__(self) -> str:
        return f"EtcdCluster(members={self.size}, endpoints={self.endpoints})"


@atexit.register
def _stop_all_clusters() -> None:
    for c in list(_CLUSTERS):
        try:
            c.stop()
        except Exception:
            pass
    _LIVE.reap_all()

