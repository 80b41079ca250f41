"""kvcc.reference.procs: the harnesses' shared process helpers, on real child processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from kvcc.reference import procs

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _poll_until(pred, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def _gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped by its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_free_ports_are_distinct_and_bindable_on_loopback():
    ports = procs.free_ports(4)
    assert len(set(ports)) == 4
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((procs.LOOPBACK_HOST, port))


def test_sweep_removes_only_folders_whose_owner_is_gone(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / "kvcc-test-stale"
    stale.mkdir()
    (stale / procs.OWNER_FILE).write_text(str(dead.pid))
    unowned = tmp_path / "kvcc-test-unowned"
    unowned.mkdir()
    mine = procs.owned_temp_dir("kvcc-test-")  # sweeps first
    assert not stale.exists()
    assert unowned.exists(), "a folder without an owner file is not ours to remove"
    assert (mine / procs.OWNER_FILE).read_text() == str(os.getpid())
    procs.sweep_stale_dirs("kvcc-test-")
    assert mine.exists(), "a folder of a live owner stays"


def test_pause_resume_and_reap_a_paused_child(tmp_path):
    live = procs.ProcessSet()
    with open(tmp_path / "log", "ab") as log:
        p = live.register(procs.spawn(SLEEPER, log, env=dict(os.environ)))
    assert live.live_pids() == [p.pid]
    assert os.getsid(p.pid) == p.pid, "a child runs in a session of its own"
    procs.pause(p)
    assert _poll_until(lambda: _state(p.pid) == "T")
    procs.resume(p)
    assert _poll_until(lambda: _state(p.pid) != "T")
    procs.pause(p)
    live.reap(p, grace_s=5.0, paused=True)  # SIGCONT so that SIGTERM can act
    assert p.returncode == -signal.SIGTERM
    assert live.live_pids() == []


def test_stop_kills_the_process_group_when_sigterm_is_ignored(tmp_path):
    ignores_term = [sys.executable, "-c",
                    "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                    f"c = subprocess.Popen({SLEEPER!r}); print(c.pid, flush=True); time.sleep(60)"]  # fmt: skip
    p = subprocess.Popen(ignores_term, stdout=subprocess.PIPE, start_new_session=True)
    assert p.stdout is not None
    grandchild = int(p.stdout.readline())
    procs.stop_process(p, grace_s=0.2, group=True, timeout_s=10.0)
    assert p.returncode == -signal.SIGKILL
    assert _poll_until(lambda: _gone(grandchild)), "SIGKILL reached the whole group"


def test_reap_all_ends_every_registered_child(tmp_path):
    live = procs.ProcessSet()
    with open(tmp_path / "log", "ab") as log:
        children = [live.register(procs.spawn(SLEEPER, log, env=dict(os.environ))) for _ in range(2)]
    procs.pause(children[0])
    live.reap_all()
    assert live.live_pids() == []
    assert all(c.returncode == -signal.SIGKILL for c in children)
