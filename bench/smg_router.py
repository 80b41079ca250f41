"""The real SGLang router as a routing baseline: ``smg`` (the Shepherd Model Gateway, sgl-router's
successor on PyPI) routes a trace's requests to stand-in workers on loopback, and the assignment it
made is replayed through the simulator (``policies.Replay``), so that its row in ``kvcc bench
routing`` has the same hit ratio, load and TTFT figures as the modelled policies and checks the
``sglang_cache_aware`` model against the router itself.

How a run goes (``route``):

- ``workers`` stand-in workers (``StandInWorker``, HTTP servers in this process on free loopback
  ports) answer what smg probes when it registers a worker (``/health``, ``/v1/models``; the
  other probes and its load polls get a 404, so smg has no load reports and no overload signal)
  and answer every completion at once with a minimal valid body, recording which request they
  served (the request's index travels in the OpenAI ``user`` field, which smg forwards);
- ``smg launch`` runs as its own process group on a free port (``launch_command``) with the policy's
  defaults (``cache_aware``: cache threshold 0.3, balance abs 64, rel 1.5), or with flags added
  (``MODELLED_RULES_ONLY`` turns off the warm-up rules the simulator's model lacks);
- requests are sent as completions in the trace's order, without real-time pacing, at most
  ``concurrency`` in flight (default 1: smg decides in exactly the trace's order). The stand-ins
  answer at once, so smg sees at most ``concurrency`` outstanding requests and its load rules (the
  spill gate needs a worker 64 requests above the mean) do not fire; the simulator's
  ``sglang_cache_aware`` sees the modelled queues instead. The assignment therefore depends on
  the trace's order alone, not on N's utilisation or capacity;
- the prompt is derived from the request's block ids (``prompt``): block i is a fixed text of
  ``BLOCK_TOKENS`` three-letter words (about four characters a token, like English text), so
  requests that share a prefix of block ids share a text prefix of the same share. smg's
  ``cache_aware`` tree works on characters for HTTP requests (no tokenizer is loaded);
- smg is stopped (SIGTERM to its process group, SIGKILL after a grace period) and the stand-ins
  closed, on success and on error alike.
"""

from __future__ import annotations

import hashlib
import http.client
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from functools import lru_cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvcc.reference.procs import free_ports, log_tail, spawn, stop_process
from kvcc.reference.routing.sim import BLOCK_TOKENS

SMG_VERSION = "1.13.0"
SMG_POLICIES = ("cache_aware", "round_robin", "power_of_two", "prefix_hash", "consistent_hashing")
MODEL = "kvcc-stand-in"
READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0
REQUEST_TIMEOUT_S = 60.0
USER_PREFIX = "kvcc-"
# smg 1.13's cache_aware with only the rules ``policies.SglangCacheAware`` models: its warm-up rules
# (misses offered to workers for 60 s after they register, one hit in 8 diverted to a "thin"
# worker) are off. With them on, its hit ratio on a 200-request slice measured 0.75-0.92 of the
# model's from run to run; without them 0.80-1.00 (median 0.92), and every request sharing more than
# the threshold followed its prefix.
MODELLED_RULES_ONLY = ("--worker-warmup-secs", "0", "--worker-warmup-thin-ratio", "0",
                       "--worker-warmup-divert-every", "0")  # fmt: skip


class SmgError(Exception):
    """smg is missing, did not start, or routed a request other than once (the message says which)."""


def require_smg() -> None:
    """Raise ``SmgError`` unless the ``smg`` package is importable by this interpreter (it is run
    as ``python -m smg``, so that the router is the one installed beside kvcc)."""
    if importlib.util.find_spec("smg") is None:
        raise SmgError(f"the smg router is not installed: pip install smg=={SMG_VERSION} (or kvcc[smg])")


# ------------------------------------------------------------------------------------ prompts


@lru_cache(maxsize=1 << 16)
def block_text(block: int) -> str:
    """Block ``block``'s text: ``BLOCK_TOKENS`` three-letter words drawn from a hash of the id, with
    a trailing space, so that two different ids differ within the first characters with high
    probability and the same id is the same text in every request and every run."""
    stream = hashlib.shake_128(f"kvcc-block:{block}".encode()).digest(3 * BLOCK_TOKENS)
    letters = bytes(97 + b % 26 for b in stream).decode()
    return "".join(f"{letters[i : i + 3]} " for i in range(0, len(letters), 3))


def prompt(blocks: Sequence[int]) -> str:
    """A request's prompt: its blocks' texts in order (a shared block prefix is a shared text prefix)."""
    return "".join(block_text(b) for b in blocks)


# ---------------------------------------------------------------------------------- stand-ins


class _Handler(BaseHTTPRequestHandler):
    """An OpenAI-compatible worker that answers at once: what smg probes at registration, and
    completions (the served request's index is recorded on the server)."""

    server: _WorkerServer
    protocol_version = "HTTP/1.1"  # keep-alive: smg pools its upstream connections

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.server.record_probe(self.path)
        if self.path == "/health":
            self._reply(200, {})
        elif self.path == "/v1/models":
            self._reply(200, {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                          "owned_by": "kvcc"}]})  # fmt: skip
        else:
            self._reply(404, {"error": f"the stand-in has no {self.path}"})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            self._reply(404, {"error": f"the stand-in has no {self.path}"})
            return
        user = str(body.get("user", ""))
        self.server.record_request(int(user[len(USER_PREFIX):]) if user.startswith(USER_PREFIX) else -1)
        chat = self.path == "/v1/chat/completions"
        choice = ({"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"} if chat
                  else {"index": 0, "text": "x", "logprobs": None, "finish_reason": "length"})  # fmt: skip
        self._reply(200, {"id": f"cmpl-{self.server.server_port}", "object": "chat.completion" if chat else
                          "text_completion", "created": 0, "model": MODEL, "choices": [choice],
                          "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})  # fmt: skip

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass  # one line per request on stderr would drown a benchmark's output


class _WorkerServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self._lock = threading.Lock()
        self.probes: set[str] = set()
        self.served: list[int] = []

    def record_probe(self, path: str) -> None:
        with self._lock:
            self.probes.add(path.partition("?")[0])

    def record_request(self, index: int) -> None:
        with self._lock:
            self.served.append(index)


class StandInWorker:
    """One stand-in worker serving on a thread until ``close``."""

    def __init__(self) -> None:
        self._server = _WorkerServer()
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvcc-stand-in", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    @property
    def probes(self) -> frozenset[str]:
        """The paths smg asked for with GET (query strings dropped)."""
        return frozenset(self._server.probes)

    @property
    def served(self) -> list[int]:
        """The indices of the completions this worker answered, in arrival order."""
        return list(self._server.served)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


# ------------------------------------------------------------------------------------- router


def launch_command(policy: str, port: int, prometheus_port: int, worker_urls: Sequence[str],
                   flags: Sequence[str] = ()) -> list[str]:
    """The command that starts smg on loopback with ``policy`` and ``flags`` (its defaults
    otherwise). Every request has been answered when smg is stopped, so its shutdown grace (180 s
    by default, for in-flight requests) is cut to 1 s."""
    return [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
            "--shutdown-grace-period-secs", "1", "--log-level", "warn", *flags]  # fmt: skip


def _get_json(port: int, path: str) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return json.loads(response.read()) if response.status == 200 else None
    finally:
        conn.close()


def _wait_ready(proc: subprocess.Popen[bytes], port: int, workers: int, log: Path) -> None:
    """Until smg's ``/readiness`` counts every worker healthy (it answers before the workers have
    registered, so its status code alone is not enough)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SmgError(f"smg exited with {proc.returncode} at startup:\n{log_tail(log, 20)}")
        try:
            ready = _get_json(port, "/readiness")
        except (OSError, http.client.HTTPException, json.JSONDecodeError):
            ready = None
        if ready and ready.get("healthy_workers") == workers:
            return
        time.sleep(0.2)
    raise SmgError(f"smg did not report {workers} healthy workers within {READY_TIMEOUT_S:g} s:\n{log_tail(log, 20)}")


def stop_process_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, SIGKILL to the group after ``STOP_GRACE_S``; then SIGKILL to whatever of the group
    outlived its leader, so that nothing it started is left behind."""
    stop_process(proc, grace_s=STOP_GRACE_S, group=True)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextmanager
def smg_router(policy: str, worker_urls: Sequence[str],
               flags: Sequence[str] = ()) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """smg running on a free port in front of ``worker_urls``, ready; stopped on exit."""
    require_smg()
    port, prometheus_port = free_ports(2)
    with tempfile.TemporaryDirectory(prefix="kvcc-smg-") as tmp:
        log = Path(tmp) / "smg.log"
        with log.open("wb") as out:
            proc = spawn(launch_command(policy, port, prometheus_port, worker_urls, flags), out, env=dict(os.environ),
                         die_with_parent=True)  # fmt: skip
        try:
            _wait_ready(proc, port, len(worker_urls), log)
            yield port, proc
        finally:
            stop_process_group(proc)


# -------------------------------------------------------------------------------------- route


@dataclass(frozen=True)
class SmgRun:
    """What one live run produced: the worker (index into the stand-ins) of each request, the
    paths smg probed, the process it ran as (stopped by now) and the seconds the requests took."""

    policy: str
    assignment: tuple[int, ...]
    probes: frozenset[str]
    pid: int
    wall_s: float


def _send_all(port: int, requests: Sequence[Sequence[int]], concurrency: int) -> None:
    """POST each request as a completion, in order, at most ``concurrency`` in flight (one
    keep-alive connection per sending thread). On the first failure the unsent ones are dropped."""
    local = threading.local()
    connections: list[http.client.HTTPConnection] = []

    def send(index: int) -> None:
        if not hasattr(local, "conn"):
            local.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
            connections.append(local.conn)
        body = {"model": MODEL, "prompt": prompt(requests[index]), "max_tokens": 1, "user": f"{USER_PREFIX}{index}"}
        local.conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = local.conn.getresponse()
        text = response.read()
        if response.status != 200:
            raise SmgError(f"request {index}: smg answered {response.status}: {text[:300]!r}")

    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="kvcc-smg-client")
    try:
        for future in [pool.submit(send, i) for i in range(len(requests))]:
            future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for conn in connections:
            conn.close()


def _assignment(workers: Sequence[StandInWorker], count: int) -> tuple[int, ...]:
    """Request index -> the worker that served it; every request served exactly once."""
    served: dict[int, list[int]] = {}
    for w, worker in enumerate(workers):
        for index in worker.served:
            served.setdefault(index, []).append(w)
    wrong = {i: ws for i, ws in served.items() if len(ws) != 1 or not 0 <= i < count}
    missing = [i for i in range(count) if i not in served]
    if wrong or missing:
        raise SmgError(f"smg did not route every request exactly once: {len(wrong)} served more than once or "
                       f"unknown (e.g. {dict(list(wrong.items())[:5])}), {len(missing)} never (e.g. {missing[:5]})")
    return tuple(served[i][0] for i in range(count))


def route(requests: Sequence[Sequence[int]], policy: str, workers: int, concurrency: int = 1,
          flags: Sequence[str] = ()) -> SmgRun:
    """Route ``requests`` (each a list of block ids) through smg with ``policy`` (and ``flags``)
    over ``workers`` stand-ins and return where each went; everything started is stopped before
    returning."""
    if policy not in SMG_POLICIES:
        raise ValueError(f"unknown smg policy {policy!r}: one of {', '.join(SMG_POLICIES)}")
    if workers < 1 or concurrency < 1:
        raise ValueError(f"workers and concurrency must be at least 1: {workers}, {concurrency}")
    with ExitStack() as stack:
        stand_ins = []
        for _ in range(workers):
            stand_ins.append(StandInWorker())
            stack.callback(stand_ins[-1].close)
        port, proc = stack.enter_context(smg_router(policy, [w.url for w in stand_ins], flags))
        start = time.monotonic()
        _send_all(port, requests, concurrency)
        wall_s = time.monotonic() - start
    probes = frozenset().union(*(w.probes for w in stand_ins))
    return SmgRun(policy, _assignment(stand_ins, len(requests)), probes, proc.pid, wall_s)
