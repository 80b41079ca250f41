"""Child processes of the test and benchmark harnesses: ports, folders, start, signals, reaping.

Theory of operation
-------------------
Three harnesses start real processes on loopback -- the local cluster (``kvcc.reference.cluster``:
a directory and cache nodes), etcd (``kvcc.reference.etcd_harness``) and Mooncake
(``kvcc.adapters.mooncake.harness``: a master and store nodes) -- and inject faults into them by
signal. What they share lives here, once:

- **ports** (``free_ports``): picked by the OS on ``127.0.0.1``, held open together so that they
  differ. A port picked free can be taken before the child binds it: a harness that passes ports
  in (etcd, Mooncake) retries its start with new ones; the cluster's processes bind port 0 and
  report the port they got instead;
- **folders** (``owned_temp_dir``): a temporary folder records the pid that made it, and the next
  harness of the same kind removes every such folder whose owner is gone -- SIGKILL skips
  ``atexit``, so a killed test run would otherwise leave them behind;
- **start** (``spawn``): in a session of its own (a ^C at the terminal does not reach it; the
  harness stops it itself), its output appended to its log, no stdin, and -- where util-linux
  ``setpriv`` exists and the caller asks -- the parent-death signal SIGKILL, so that it dies with
  the Python process that started it even when that one is SIGKILLed. (Linux delivers that signal
  when the *thread* that forked the child exits: start children from a long-lived thread.);
- **signals**: ``pause`` (SIGSTOP: a process that stops wherever it is, its sockets open and
  unanswered), ``resume`` (SIGCONT), ``stop_process`` (SIGTERM and a grace period when asked,
  then SIGKILL -- which also ends a stopped process -- and wait);
- **reaping** (``ProcessSet``): every child a harness started and has not reaped, so that
  ``live_pids()`` can prove in a test that nothing leaked and an ``atexit`` hook can kill the rest.
"""

from __future__ import annotations

import os
import platform
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO

LOOPBACK_HOST = "127.0.0.1"
REAP_TIMEOUT_S = 30.0  # the longest a harness waits for a SIGKILLed child to be reaped
OWNER_FILE = "owner.pid"  # in an owned temporary folder: the pid of the process that made it

# The project's no-telemetry settings, for every child that may load an engine's libraries.
NO_TELEMETRY_ENV = {
    "DO_NOT_TRACK": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "LMCACHE_TRACK_USAGE": "false",
    "HF_HUB_OFFLINE": "1",
}


def _pdeathsig_prefix() -> list[str]:
    """``setpriv --pdeathsig KILL --`` where util-linux has it and it works here, else nothing."""
    setpriv = shutil.which("setpriv")
    if not setpriv or platform.system() != "Linux":
        return []
    argv = [setpriv, "--pdeathsig", "KILL", "--"]
    try:
        ok = subprocess.run([*argv, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return []
    return argv if ok else []


PDEATHSIG_PREFIX = _pdeathsig_prefix()


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK_HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def log_tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of a child's log, for an error message; "(no log)" if unreadable."""
    try:
        data = path.read_bytes()
    except OSError:
        return "(no log)"
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def sweep_stale_dirs(prefix: str) -> None:
    """Remove the temporary folders named ``prefix*`` whose owner process is gone. A folder without
    a readable owner, or whose owner is alive (or another user's), is left alone."""
    for d in Path(tempfile.gettempdir()).glob(prefix + "*"):
        try:
            owner = int((d / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if owner == os.getpid():
            continue
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass  # alive (another user's) or unknown: leave it


def owned_temp_dir(prefix: str) -> Path:
    """A new temporary folder ``prefix*`` that records this process as its owner, after sweeping
    the stale ones of the same prefix."""
    sweep_stale_dirs(prefix)
    path = Path(tempfile.mkdtemp(prefix=prefix))
    (path / OWNER_FILE).write_text(str(os.getpid()))
    return path


def spawn(
    argv: Sequence[str],
    log: IO[bytes],
    *,
    env: dict[str, str],
    cwd: Path | None = None,
    pass_fds: Sequence[int] = (),
    die_with_parent: bool = False,
) -> subprocess.Popen:
    """Start ``argv`` in a session of its own, stdout and stderr to ``log``, no stdin. With
    ``die_with_parent``, under ``PDEATHSIG_PREFIX`` (where it exists) -- from the main thread only:
    Linux sends the parent-death signal when the *thread* that forked the child exits, so a child
    started from a worker thread (a fault injector's) would die with that thread, not with this
    process (found by ``kvcc bench soak``: an etcd member restarted from a fault thread died when
    the thread ended). Elsewhere the caller's stop is what ends it."""
    main = threading.current_thread() is threading.main_thread()
    prefix = PDEATHSIG_PREFIX if die_with_parent and main else []
    return subprocess.Popen(
        [*prefix, *argv],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=None if cwd is None else str(cwd),
        pass_fds=tuple(pass_fds),
        start_new_session=True,
        close_fds=True,
    )


def is_running(p: subprocess.Popen | None) -> bool:
    return p is not None and p.poll() is None


def pause(p: subprocess.Popen) -> None:
    """SIGSTOP: the process stops where it stands (it keeps its sockets but answers nothing)."""
    os.kill(p.pid, signal.SIGSTOP)


def resume(p: subprocess.Popen | None) -> None:
    """SIGCONT, if the process is still running."""
    if is_running(p):
        assert p is not None
        os.kill(p.pid, signal.SIGCONT)


def stop_process(
    p: subprocess.Popen,
    *,
    grace_s: float = 0.0,
    paused: bool = False,
    group: bool = False,
    timeout_s: float = REAP_TIMEOUT_S,
) -> None:
    """End ``p`` and wait for it. With ``grace_s``, SIGTERM first (a paused process is continued
    so that it can act on it) and up to ``grace_s`` for it to exit; then SIGKILL -- to its whole
    process group with ``group`` -- and up to ``timeout_s``. A process already gone is reaped."""
    try:
        if p.poll() is None and grace_s > 0:
            if paused:
                os.kill(p.pid, signal.SIGCONT)
            p.terminate()
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        if p.poll() is None:
            if group:
                os.killpg(p.pid, signal.SIGKILL)
            else:
                p.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
        p.wait(timeout_s)
    except ProcessLookupError:
        pass


class ProcessSet:
    """The children one harness started and has not reaped yet (pid -> Popen), thread-safe."""

    def __init__(self) -> None:
        self._live: dict[int, subprocess.Popen] = {}
        self._lock = threading.Lock()

    def register(self, p: subprocess.Popen) -> subprocess.Popen:
        with self._lock:
            self._live[p.pid] = p
        return p

    def live_pids(self) -> list[int]:
        """PIDs of the children still running, for leak checks."""
        with self._lock:
            return [pid for pid, p in self._live.items() if p.poll() is None]

    def reap(
        self, p: subprocess.Popen | None, *, grace_s: float = 0.0, paused: bool = False, timeout_s: float = REAP_TIMEOUT_S
    ) -> None:
        """``stop_process(p, ...)``, then forget ``p`` once it is gone."""
        if p is None:
            return
        try:
            stop_process(p, grace_s=grace_s, paused=paused, timeout_s=timeout_s)
        finally:
            with self._lock:
                if p.poll() is not None:
                    self._live.pop(p.pid, None)

    def reap_all(self) -> None:
        """SIGKILL and reap every child still registered (an ``atexit`` hook's last resort)."""
        with self._lock:
            procs = list(self._live.values())
        for p in procs:
            try:
                self.reap(p)
            except Exception:
                pass
