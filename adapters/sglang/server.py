"""A real SGLang server with kvcc's HiCache storage backend, as a killable, pausable process, and
what kvcc needs to follow it: the page keys SGLang gives a prompt, and a view of its KV events.

    with SglangServer(tiny_llama(), extra_config={"kvcc_directory": ..., ...}) as server:
        out = server.generate([5, 6, 7, 8], max_tokens=4, cache_salt="tenant-a")
        server.flush_cache()                                       # its own GPU and host caches
        server.kill(); server.start()                              # SIGKILL, then a fresh server

Theory of operation
-------------------
``SglangServer`` runs ``python -m sglang.launch_server`` with this interpreter on a free loopback
port, in a session of its own (SGLang's scheduler and detokenizer are child processes: every
signal goes to the group, as for ``kvcc.adapters.vllm.harness.VllmEngine``, whose process
handling it shares). It is configured for kvcc's view of it:

- hierarchical cache on (``--enable-hierarchical-cache``), pages of ``page_size`` tokens, its L3
  the kvcc backend loaded by SGLang's ``dynamic`` factory (``backend_extra_config``: the backend's
  module and class, the prefetch threshold lowered to one page so that a prompt of a few pages is
  loaded from storage at all -- SGLang's default is 256 tokens -- and the caller's ``kvcc_*``
  entries), written through to host and storage as pages are cached (``write_through``), and a
  prefetch waited for to completion (``wait_complete``) so a request's hit does not depend on
  timing;
- the KV events on ``ipc://`` sockets in the server's folder (a publisher and its replay socket:
  nothing reachable from outside the machine), ``--enable-cache-report`` (``cached_tokens`` in
  every answer), bfloat16, a fixed seed, no CUDA graphs (a test server starts faster), a KV pool of
  ``MAX_TOTAL_TOKENS`` (SGLang sizes it from the GPU memory free when it starts, and pins
  ``HICACHE_RATIO`` times as much host memory: two servers on one GPU must each take little).

SGLang's server needs CUDA (there is no CPU build of its kernels here): ``check_installed``
refuses without it. What can be checked without a GPU is checked by ``tests/test_sglang_server.py``:
the command line parses with SGLang's own argument parser, a request body builds SGLang's own
``GenerateReqInput``, the page keys are SGLang's own page hashes, and the event view follows
events built with SGLang's own event classes.

``page_hashes`` is SGLang's storage naming of a prompt's full pages (its own
``get_storage_hash_str``, the chain seeded by the request's extra key and cache salt), and
``SglangEngineView`` keeps the kvcc keys of what one server holds in its GPU and host caches from
its ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events: each stored page's SGLang
hash is recomputed from its parent's (SGLang's events carry the page's tokens, its parent's event
hash and the request's cache salt) and named as the backend names it (``page_key``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import urllib.error
import urllib.request
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvcc.adapters.vllm.events import BlockStored, EngineView, ExternalHash, _Record
from kvcc.adapters.vllm.harness import ENGINE_START_TIMEOUT_S, REQUEST_TIMEOUT_S, EngineError, EngineServer
from kvcc.spec.keys import BlockKey

__all__ = ["SglangEngineView", "SglangServer", "generate_body", "page_hashes"]

BACKEND = {"backend_name": "kvcc", "module_path": "kvcc.adapters.sglang.backend", "class_name": "KvccHiCacheStorage"}
MEM_FRACTION_STATIC = 0.3  # of the GPU: a tiny model needs little, and two servers share one GPU
HICACHE_RATIO = 2.0  # host pool size over the device pool's
MAX_TOTAL_TOKENS = 16384  # the device KV pool, in tokens (a suite prompt is under 1,000)


class _PageKey:
    """What SGLang's storage page hash reads of a ``RadixKey`` (``sglang.srt.mem_cache.radix_cache``):
    the token ids, the request's ``extra_key`` and its ``cache_salt`` (an empty salt is none)."""

    def __init__(self, token_ids: Sequence[int], extra_key: str | None = None, cache_salt: str | None = None) -> None:
        self.token_ids, self.extra_key, self.cache_salt = array("q", token_ids), extra_key, cache_salt or None

    def __len__(self) -> int:
        return len(self.token_ids)


def page_hashes(
    tokens: Sequence[int], page_size: int, *, extra_key: str | None = None, cache_salt: str | None = None,
    prior: str | None = None,
) -> list[str]:  # fmt: skip
    """The names SGLang gives the full pages of ``tokens`` in storage: its own
    ``get_storage_hash_str``, chained from ``prior`` (a page's parent's name) or, for a prompt's
    first page, seeded by the request's extra key and cache salt."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    full = len(tokens) - len(tokens) % page_size
    if not full:
        return []
    out = get_storage_hash_str(_PageKey(list(tokens[:full]), extra_key, cache_salt), prior, page_size=page_size)
    return [out] if isinstance(out, str) else list(out)


def generate_body(tokens: Sequence[int], max_tokens: int, *, cache_salt: str | None, top_logprobs: int) -> dict[str, Any]:
    """The ``POST /generate`` body of a greedy completion of a token-id prompt, with each output
    token's top log-probabilities and the request's cache salt."""
    body: dict[str, Any] = {
        "input_ids": list(tokens),
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": top_logprobs,
    }
    if cache_salt:
        body["cache_salt"] = cache_salt
    return body


class SglangServer(EngineServer):
    """One SGLang server (``sglang.launch_server``) with kvcc's HiCache backend; see the module
    docstring. ``extra_config``: the backend's ``kvcc_*`` entries (directory, token, client id...)."""

    label = "SGLang"

    def __init__(
        self,
        model_path: Path | str,
        *,
        extra_config: dict[str, Any] | Callable[[], dict[str, Any]],
        served_name: str = "tiny",
        page_size: int = 32,
        topic: str = "kv",
        extra_args: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None,
        start_timeout_s: float = ENGINE_START_TIMEOUT_S,
    ) -> None:
        super().__init__(model_path, prefix="kvcc-sglang-", served_name=served_name, topic=topic,
                         extra_args=extra_args, extra_env=extra_env, start_timeout_s=start_timeout_s)  # fmt: skip
        self.page_size = page_size
        # A callable is asked at every start: a restarted server may need a new client id.
        self._extra_config = extra_config

    def check_installed(self) -> None:
        missing = [m for m in ("sglang", "zmq", "msgpack", "torch") if importlib.util.find_spec(m) is None]
        if missing:
            raise EngineError(f"the sglang extra is not installed (missing: {', '.join(missing)}): "
                              "bash scripts/setup.sh --with sglang")  # fmt: skip
        import torch

        if not torch.cuda.is_available():
            raise EngineError("SGLang's server needs a CUDA GPU (its kernels have no CPU build here)")

    def backend_extra_config(self) -> dict[str, Any]:
        extra = self._extra_config() if callable(self._extra_config) else self._extra_config
        return {**BACKEND, "prefetch_threshold": self.page_size, **extra}

    def argv(self) -> list[str]:
        events = {"publisher": "zmq", "endpoint": self.events_endpoint, "replay_endpoint": self.replay_endpoint,
                  "topic": self.topic}  # fmt: skip
        return [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(self.model_path),
            "--served-model-name", self.served_name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--dtype", "bfloat16",
            "--page-size", str(self.page_size),
            "--random-seed", "0",
            "--mem-fraction-static", str(MEM_FRACTION_STATIC),
            "--enable-hierarchical-cache",
            "--hicache-ratio", str(HICACHE_RATIO),
            "--hicache-write-policy", "write_through",
            "--hicache-mem-layout", "page_first",  # the layout the backend's namespace names
            "--hicache-io-backend", "kernel",
            "--hicache-storage-backend", "dynamic",
            "--hicache-storage-backend-extra-config", json.dumps(self.backend_extra_config()),
            "--hicache-storage-prefetch-policy", "wait_complete",
            "--kv-events-config", json.dumps(events),
            "--enable-cache-report",
            # A bounded KV pool: its host pool (HICACHE_RATIO times it, pinned) then stays small, and
            # a second server on the same GPU still finds room.
            "--max-total-tokens", str(MAX_TOTAL_TOKENS),
            "--cuda-graph-backend-decode", "disabled",
            "--cuda-graph-backend-prefill", "disabled",
            *self.extra_args,
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        env = super().env()
        env.update(DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", SGLANG_DISABLE_TELEMETRY="1")
        env.update(self.extra_env)
        return env

    # ---------------------------------------------------------------- HTTP
    def generate(self, tokens: Sequence[int], *, max_tokens: int = 1, cache_salt: str | None = None,
                 top_logprobs: int = 5, timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:  # fmt: skip
        """``POST /generate``: SGLang's answer (``output_ids``; ``meta_info`` with
        ``cached_tokens`` and ``output_top_logprobs``, ``[logprob, token id, text]`` triples)."""
        return self._post("/generate", generate_body(tokens, max_tokens, cache_salt=cache_salt, top_logprobs=top_logprobs),
                          timeout_s)  # fmt: skip

    def flush_cache(self, timeout_s: float = REQUEST_TIMEOUT_S) -> bool:
        """``POST /flush_cache``: True if SGLang dropped its GPU and host prefix caches (it refuses
        while requests run). Storage is not touched (that is ``/hicache/storage-backend/clear``)."""
        req = urllib.request.Request(f"{self.base_url}/flush_cache", data=b"", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return r.status == 200
        except urllib.error.HTTPError:
            return False
        except (OSError, urllib.error.URLError) as e:
            raise EngineError(f"POST /flush_cache: {e}") from None

    def __repr__(self) -> str:
        return f"SglangServer({self.base_url}, pid={self.pid}, page={self.page_size})"


class SglangEngineView(EngineView):
    """What one SGLang server holds in its own prefix caches (GPU and host), as its KV events say,
    with each page's kvcc key: ``name(page hash)`` is the backend's naming (``page_key`` in the
    server's namespace). SGLang publishes an int64 event hash per page, its parent's, the page's
    tokens and the request's cache salt; the view recomputes each page's storage hash from its
    parent's (a first page: seeded by the salt). A page whose parent it never saw has no key."""

    def __init__(self, engine_id: str, page_size: int, name: Callable[[str], BlockKey]) -> None:
        super().__init__(engine_id)
        self.page_size = page_size
        self.name = name

    def _record(self, ev: BlockStored, i: int, parent_hash: ExternalHash | None, parent: _Record | None,
                h: ExternalHash) -> _Record:  # fmt: skip
        first = parent_hash is None
        salt = ev.cache_salt if first else (None if parent is None else parent.salt)
        if ev.block_size != self.page_size or (not first and (parent is None or parent.full is None)):
            return _Record(None, None, salt)
        tokens = ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size]
        prior = None if first else parent.full.decode()
        (page,) = page_hashes(tokens, self.page_size, cache_salt=salt, prior=prior)
        return _Record(page.encode(), self.name(page), salt)
