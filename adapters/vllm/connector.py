"""A vLLM KV connector (``KVConnectorBase_V1``) that stores and loads KV blocks through kvcc.

    --kv-transfer-config '{"kv_connector": "KvccConnector",
                           "kv_connector_module_path": "kvcc.adapters.vllm.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"directory": "127.0.0.1:7000",
                               "tenant": "engine", "token_hex": "...", "skew_ms": 100,
                               "model_id": "kvcc/tiny-llama", "client_id": "vllm-a"}}'

Extra config: ``directory`` (``host:port``), ``tenant`` (default ``engine``), ``token_hex`` or
``token_file`` (a file holding the token in hex), ``skew_ms`` (the deployment's epsilon, default
100), ``timeout_ms`` (one kvcc request, default 10 s), ``reset_timeout_s`` (see Reset),
``events_dir`` (optional: a folder where each of its clients logs its protocol events,
``<client_id>.ndjson``, for kvcc's conformance suite to validate), ``model_id`` (default: the
served model name), ``client_id`` (default ``vllm<pid>``), ``colocated_node`` (optional: the
cache node this engine runs beside; its clients are then ``<node>.<client_id>-s`` and ``-w``,
and the directory places the engine's writes on that node), ``load_hold_ms`` (fault injection,
default 0: hold each read lease this long before reading, so that a test can stop the engine
while it holds one), ``async_saves`` (default true; see Worker side, saves), ``save_priority`` (``normal`` or ``idle``, default ``normal``;
likewise), ``stats_path`` (optional; see Counting),
``deployment_file`` (optional; see Deployment file). The tenant must be allowed the
engine's namespace (``engine_namespace``, plus each cache salt used).

Theory of operation
-------------------
vLLM builds two instances of a connector: one beside the scheduler (``KVConnectorRole.SCHEDULER``)
and one in each worker (``KVConnectorRole.WORKER``), possibly in another process. Each is its own
kvcc client (``<client_id>-s`` and ``<client_id>-w``; no ``.`` in them, since ``<node>.<name>``
means a client co-located with a cache node: that only with ``colocated_node``), connected lazily
on first use so that no thread exists before a fork.

**Keys.** A kvcc block is one vLLM block: ``block_size`` tokens of one request's prompt, the KV of
*every* layer. Its key is ``kvcc.adapters.vllm.events.KeyMapper``'s -- the same chain the KV-events
view gives the blocks an engine announces -- over the namespace
``kvcc.adapters.vllm.model.engine_namespace`` derives from the served model folder (model id,
revision = content digest, KV dtype, block size, layer layout ``L<layers>.H<kv heads>.D<head dim>``,
tensor-parallel rank) with the request's cache salt. Requests with LoRA, multimodal or
prompt-embedding inputs are neither looked up nor saved (their KV depends on more than tokens);
nor is a request that opts out with ``kv_transfer_params: {"kvcc": "skip"}`` (an operator's
per-request choice, and the benchmark's baseline in the same engine process).

**Byte layout of a block** (independent of the engine's own paged layout): for each attention
layer in model order (``extract_layer_index``), K then V, each ``[block_tokens, kv_heads,
head_dim]`` in row-major order, elements in the KV dtype, native (little-endian) byte order. So
``L * 2 * block_tokens * kv_heads * head_dim * itemsize`` bytes; 32 KiB for the tiny Llama
(2 x 2 x 32 x 2 x 64 x 2). vLLM's CPU attention keeps a layer's cache as ``[num_blocks, kv_heads,
block_size, 2 * head_dim]``, but the inside of a block is its kernel's business and depends on
the instruction set it picked (on this machine's ``vec`` kernel K is stored head-dim major, V
token major; other instruction sets may pack otherwise). So the worker does not assume it:
``CpuBlockLayout.probe`` runs vLLM's own ``cpu_attn_reshape_and_cache``, with the instruction set
the engine uses, on a scratch block filled with each element's token, head, dim and K/V index,
and reads off where each canonical element lands: a permutation, checked to be one, that packs and
unpacks whole blocks with one gather or scatter per layer. Any other cache shape, and quantized
(fp8) KV caches, are refused at ``register_kv_caches``.

**On CUDA** (the KV tensors vLLM registers are on a GPU) the layout is another one. vLLM's CUDA
attention backends (``FLASH_ATTN`` on Hopper and older, ``FLASHINFER`` on Blackwell, ``TRITON_ATTN``)
hand the connector, per layer, a view of logical shape ``[num_blocks, kv_heads, block_size,
2 * head_dim]`` (``vllm.v1.kv_cache_interface.create_kv_cache_views``) whose physical stride order
is the KV cache layout vLLM resolved (``vllm.v1.kv_cache_layout.KVCacheLayout``: ``LBNHC``,
``LBHNC``, ``BLHNC``...; the content axis always innermost), and split it, in every backend's
forward, as ``kv_cache.transpose(1, 2).split(head_dim, dim=-1)``: K is the first ``head_dim`` of
the content axis, V the second, written by ``reshape_and_cache_flash``. ``DeviceBlockLayout``
indexes that *logical* view, so the physical stride order never matters: ``probe`` runs vLLM's own
``reshape_and_cache_flash`` on a scratch block of the engine's strides on the device (the mapping
is the kernel's), and falls back, if that op cannot be run, to the mapping the logical shape
documents (``derived``). Packing is one gather per layer on the device and one copy to the host;
unpacking one copy to the device and one scatter per layer. Any other shape or stride (the content
axis not innermost, layers of different strides), and quantized KV caches, are refused
(``UnsupportedKvLayout``).

**Scheduler side.** ``get_num_new_matched_tokens`` asks the directory one ``Lookup`` for the keys
of the request's full prompt blocks (not the block holding the last prompt token: vLLM must compute
at least one token) and answers how many tokens past the engine's own hit the committed prefix
covers. It changes nothing in kvcc and answers the same for the same cache, however often it is
called (it only remembers, per request, where the engine's own hit ended). ``update_state_after_alloc``
turns a positive answer into a load plan (key -> the block vLLM allocated for it);
``build_connector_meta`` hands the step's loads to the worker, with the saves of the step: every
prompt block that becomes full in this step (``num_computed_tokens`` to ``+ num_scheduled``), that
is, neither found in the engine's cache nor loaded.

**Worker side, loads** (``start_load_kv``, before the forward pass: vLLM starts synchronous loads
there). Per run of up to ``LOAD_CHAIN_BLOCKS`` planned blocks, in prefix order, one round trip
each (the client's batched chain operations): take read leases on the run's longest leased prefix
(``acquire_chain``), read their bytes into one staging tensor (``read_many``: one request per node),
check each length, copy each block into every layer's paged tensor, release the leases
(``release_many``).
A read lease is the only thing that makes bytes trustworthy, and a lease belongs to the client
that acquired it; on CPU the worker is another process than the scheduler (vLLM's CPU platform
switches the executor to ``mp``), so the worker -- the process that reads -- holds it: taken as
the step that scheduled the load begins, released as soon as its run is copied. A refused
acquire (the key was invalidated, is being written or drained), a
read refused because the lease was revoked or expired (the client refuses a read whose lease ended
while the bytes were in flight), a miss or an unreachable node: that block *and every later block
of the request* are reported by ``get_block_ids_with_load_errors`` and never copied. With
``kv_load_failure_policy: "recompute"`` vLLM then recomputes from the first failed block; with
vLLM's default (``"fail"``) it fails the request. The request's saves of that step are dropped
(they were computed over the blocks that failed).

**Worker side, saves** (``wait_for_save``, after the forward pass, when every layer's KV of the
step is in the paged tensors; ``save_kv_layer`` does nothing). Per planned block, in prefix order:
``begin_write`` (the write lease; the parent must be committed: chains are written root first),
``write_bytes``, ``commit`` -- two round trips a block, each commit sent with the next block's
``begin_write`` (the client's ``put_chain``). A refusal is a lost save, never an error: ``not_absent`` (someone
committed it first), ``parent_not_committed``, ``invalidating``, a fenced or expired write. The
blocks' bytes are packed out of the paged tensors before ``wait_for_save`` returns, so
``request_finished`` never holds the request's blocks; the writes then run on a saver thread
(``async_saves``, default true: the engine's step, and so its time to first token, does not wait
for kvcc; a request's blocks are committed shortly after it is answered, and at most
``SAVE_QUEUE_MAX`` requests' saves wait, more are dropped as lost saves), or in ``wait_for_save``
itself with ``async_saves: false``. ``save_priority: idle`` puts the saver thread alone in Linux's
``SCHED_IDLE`` (nice 19 where the OS has no such class), so that on cores the engine shares a save
waits for them to be free: where the engine computes on the cores the saver runs on (vLLM on CPU),
this is the setting that keeps a miss within 5 % of the TTFT it has without the connector (README,
TTFT through the engine: +0.0 % to +5.5 % against up to +13.7 % at ``normal``, for a model with a
real model's compute per byte of KV). The default, ``normal``, keeps the engine's priority: an
engine that keeps its cores busy for good would starve an idle saver until its queue fills and
saves are lost (an unprivileged thread cannot leave ``SCHED_IDLE`` again to catch up). Counters ``save_batches_queued``/``save_batches_done`` say when
every save handed over is done.

**Reset.** ``POST /reset_prefix_cache?reset_external=true`` makes vLLM call the scheduler
connector's ``reset_cache``: a namespace invalidation of every namespace of this engine's blocks
(its own and each cache salt's seen since it started), waited for until complete; vLLM's reset
answers ``success: false`` if one did not complete within ``reset_timeout_s`` (default 60).

**Counting.** Each instance keeps counters (``stats``: blocks, refusals, and the wall time spent
in lookups, loads and saves, ``lookup_us``/``load_us``/``save_us``) and, with ``stats_path`` in
the extra config, writes them after each step that changed them to
``<stats_path>.<scheduler|worker>.json`` (replaced atomically): the tests count loads there.

**Deployment file.** With ``deployment_file`` (a path) in the extra config, the settings that
name the kvcc deployment -- ``directory``, ``tenant``, ``token_hex``/``token_file``, ``skew_ms``,
``timeout_ms``, ``client_id``, ``colocated_node``, ``events_dir``, ``stats_path``,
``load_hold_ms`` -- are read from that JSON object, over the extra config's, when the connector is
built, and again whenever the file changes: a running engine can be moved to another deployment
(kvcc's conformance suite keeps its engines up across its tests, each on a cluster of its own).
Each instance checks the file with one ``os.stat`` (inode, times, size) at the start of
``get_num_new_matched_tokens``, ``build_connector_meta`` and ``reset_cache`` (scheduler) and of
``start_load_kv`` and ``wait_for_save`` (worker); when it changed, the instance closes its kvcc
client (the next call opens one from the new settings: a new client id, event log and stats file),
and its counters and the namespaces it has seen start afresh. Blocks packed for a save before the
switch are not sent to the new deployment (``saves_dropped_deployment_switched``); whoever
rewrites the file should first wait until the engine's saves settled (``wait_saves_settled``).
Rewrite it atomically (``write_deployment``: a temporary file, then a rename). Without the key,
nothing is re-read: the extra config is the deployment for the engine's life.

Limits: tensor and pipeline parallelism are refused (the scheduler's lookup would speak for rank 0
only); one KV cache group; saves and loads block the engine's step.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from attrs import evolve
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvcc.adapters.vllm.events import KeyMapper
from kvcc.adapters.vllm.model import engine_namespace
from kvcc.spec.keys import BlockKey
from kvcc.spec.vocabulary import REASON_NOT_ABSENT, SCOPE_NAMESPACE

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["DeviceBlockLayout", "KvccConnector", "KvccConnectorMetadata", "UnsupportedKvLayout", "block_layout",
           "device_block_layout", "saves_settled", "wait_saves_settled", "write_deployment"]

log = logging.getLogger("kvcc.vllm.connector")

SKEW_MS_DEFAULT = 100
CLIENT_TIMEOUT_MS_DEFAULT = 10_000  # one directory or node request; a slow kvcc is a miss, not a hang
RESET_TIMEOUT_S_DEFAULT = 60.0  # reset_cache's wait for its namespace invalidations to complete
MAX_BLOCKS_PER_LOOKUP = 4096
LOAD_CHAIN_BLOCKS = 64  # blocks leased, read and released per round trip in a load (bounds its staging)
SKIP = "skip"  # kv_transfer_params {"kvcc": "skip"}: a request the connector leaves alone
SAVE_QUEUE_MAX = 64  # request batches packed and waiting for the saver thread; more are dropped (lost saves)
SAVER_STOP_S = 30.0  # shutdown's wait for the saves already queued  # a prompt longer than this many blocks is looked up only this far


# -- metadata (scheduler -> worker; pickled when the worker is another process) --------------------


@dataclass
class _Load:
    req_id: str
    namespace: bytes  # the namespace digest
    blocks: list[tuple[BlockKey, int]]  # (key, vLLM block id), in prefix order


@dataclass
class _Save:
    req_id: str
    namespace: bytes
    blocks: list[tuple[BlockKey, BlockKey | None, int]]  # (key, parent key, vLLM block id)


@dataclass
class KvccConnectorMetadata(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)
    saves: list[_Save] = field(default_factory=list)


# -- scheduler-side bookkeeping -------------------------------------------------------------------------


@dataclass
class _Request:
    keys: list[BlockKey]  # of every full prompt block
    namespace: bytes
    prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    local_hit_tokens: int | None = None  # what get_num_new_matched_tokens was last told


def saves_settled(worker_stats: dict[str, Any]) -> bool:
    """Whether a worker's counters (its ``stats`` or stats file) show every save it handed to its
    saver thread done (committed, refused or failed)."""
    return worker_stats.get("save_batches_done", 0) >= worker_stats.get("save_batches_queued", 0)


def wait_saves_settled(read_stats: Any, timeout_s: float, poll_s: float = 0.02) -> bool:
    """Poll ``read_stats()`` (a worker's counters, e.g. read from its stats file) until
    ``saves_settled``; ``False`` if ``timeout_s`` passed first."""
    deadline = time.monotonic() + timeout_s
    while not saves_settled(read_stats()):
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def block_layout(namespace_layout: str) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` from a namespace layout ``"L<n>.H<n>.D<n>"``."""
    try:
        parts = dict((p[0], int(p[1:])) for p in namespace_layout.split("."))
        return parts["L"], parts["H"], parts["D"]
    except (KeyError, ValueError, IndexError):
        raise ValueError(f"namespace layout {namespace_layout!r} is not L<layers>.H<kv heads>.D<head dim>") from None


def _token(extra: dict[str, Any]) -> bytes:
    if "token_hex" in extra:
        return bytes.fromhex(str(extra["token_hex"]))
    if "token_file" in extra:
        return bytes.fromhex(Path(extra["token_file"]).read_text().strip())
    raise ValueError("kv_connector_extra_config needs token_hex or token_file (the tenant's token, hex)")


# What _configure sets: the deployment's settings (see Deployment file).
_DEPLOYMENT_ATTRS = ("_address", "_tenant", "_token", "_skew_ms", "_timeout_ms", "client_id", "_events_dir",
                     "_load_hold_s", "_stats_file")  # fmt: skip


def _file_sig(path: Path) -> tuple[int, ...] | None:
    """What changes when a file is replaced or rewritten (``None``: no such file)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns, st.st_size)


def _read_deployment(path: Path) -> dict[str, Any]:
    settings = json.loads(path.read_text())
    if not isinstance(settings, dict):
        raise ValueError(f"deployment file {path}: not a JSON object")
    return settings


def write_deployment(path: str | os.PathLike[str], settings: dict[str, Any]) -> None:
    """Write a connector's deployment file atomically (a temporary file, then a rename): a
    connector reading it sees the old settings or the new ones, never part of them."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(settings, sort_keys=True))
    os.replace(tmp, path)


def _layer_order(name: str) -> tuple[int, str]:
    try:
        from vllm.model_executor.models.utils import extract_layer_index

        return extract_layer_index(name), name
    except Exception:  # a name without one index: keep vLLM's name order among those
        return 1 << 30, name


PROBE_EXACT_MAX = 256  # the largest integer up to which every one is exact in bfloat16


class CpuBlockLayout:
    """Where each element of a canonical block (``[2, block_size, kv_heads, head_dim]``: K, V)
    lives inside one block of vLLM's CPU attention cache (``[kv_heads, block_size, 2 * head_dim]``),
    learnt from vLLM's own cache-writing kernel (see the module docstring)."""

    def __init__(self, canon_of_slot: torch.Tensor) -> None:
        n = canon_of_slot.numel()
        if not torch.equal(torch.sort(canon_of_slot).values, torch.arange(n)):
            raise NotImplementedError("vLLM's CPU kernel does not store a block as a permutation of its K and V")
        self.canon_of_slot = canon_of_slot  # slot s of the paged block holds canonical element canon_of_slot[s]
        self.slot_of_canon = torch.argsort(canon_of_slot)

    @classmethod
    def probe(cls, dtype: torch.dtype, block_size: int, kv_heads: int, head_dim: int, isa: str) -> CpuBlockLayout:
        from vllm import _custom_ops as ops

        if max(block_size, kv_heads, head_dim) > PROBE_EXACT_MAX:
            raise NotImplementedError(f"probing a block of {block_size}x{kv_heads}x{head_dim}: indices over {PROBE_EXACT_MAX}")
        shape = (block_size, kv_heads, head_dim)
        index = {
            "t": torch.arange(block_size).view(-1, 1, 1).expand(shape),
            "h": torch.arange(kv_heads).view(1, -1, 1).expand(shape),
            "d": torch.arange(head_dim).view(1, 1, -1).expand(shape),
        }
        zeros = torch.zeros(shape, dtype=torch.int64)
        found = {}
        for name, (k_ids, v_ids) in {"part": (zeros, zeros + 1), **{n: (i, i) for n, i in index.items()}}.items():
            cache = torch.full((1, kv_heads, block_size, 2 * head_dim), -1, dtype=dtype)
            key_cache, value_cache = cache.view(1, kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(k_ids.to(dtype).contiguous(), v_ids.to(dtype).contiguous(), key_cache,
                                           value_cache, torch.arange(block_size, dtype=torch.int64), isa,
                                           kv_cache_dtype="auto")  # fmt: skip
            found[name] = cache.reshape(-1).to(torch.int64)
            if bool((found[name] < 0).any()):
                raise NotImplementedError("vLLM's CPU kernel left part of a block unwritten")
        canon = ((found["part"] * block_size + found["t"]) * kv_heads + found["h"]) * head_dim + found["d"]
        return cls(canon)

    def pack(self, layers: list[torch.Tensor], block_id: int) -> torch.Tensor:
        """The canonical ``[layers, 2 * block_size * kv_heads * head_dim]`` of one block."""
        return torch.stack([t[block_id].reshape(-1)[self.slot_of_canon] for t in layers])

    def unpack(self, layers: list[torch.Tensor], block_id: int, canonical: torch.Tensor) -> None:
        """Write a canonical block into vLLM's tensors, every layer."""
        for layer, t in enumerate(layers):
            t[block_id].view(-1).copy_(canonical[layer][self.canon_of_slot])


class UnsupportedKvLayout(NotImplementedError):
    """vLLM registered KV tensors whose layout the connector does not understand (refused, never guessed)."""


def _flash_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:  # fmt: skip
    """vLLM's CUDA cache write (``reshape_and_cache_flash``, what ``FLASH_ATTN`` and ``FLASHINFER``
    call in ``do_kv_cache_update``), unquantized."""
    from vllm import _custom_ops as ops

    scale = torch.ones(1, dtype=torch.float32, device=key.device)
    ops.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, "auto", scale, scale)


class DeviceBlockLayout:
    """Where each element of a canonical block (``[2, block_size, kv_heads, head_dim]``: K, V)
    lives inside one block of a layer's *logical* KV view ``[kv_heads, block_size, 2 * head_dim]``
    (vLLM's CUDA backends; see the module docstring), as three index tensors (head, token, content)
    on the cache's device: whatever the view's strides, ``t[block][index]`` gathers the canonical
    block and ``t[block].index_put_(index, ...)`` scatters it."""

    def __init__(self, canon_of_slot: torch.Tensor, block_size: int, kv_heads: int, head_dim: int,
                 device: torch.device | str = "cpu", source: str = "derived") -> None:  # fmt: skip
        n = 2 * block_size * kv_heads * head_dim
        canon_of_slot = canon_of_slot.reshape(-1).to(torch.int64).cpu()
        if canon_of_slot.numel() != n or not torch.equal(torch.sort(canon_of_slot).values, torch.arange(n)):
            raise UnsupportedKvLayout("vLLM's CUDA cache write does not store a block as a permutation of its K and V")
        self.canon_of_slot = canon_of_slot  # logical slot s of the block view holds canonical element canon_of_slot[s]
        self.slot_of_canon = torch.argsort(canon_of_slot)
        self.source = source  # "probe": learnt from vLLM's kernel; "derived": from the documented logical shape
        c = 2 * head_dim
        slot = self.slot_of_canon
        self.device = torch.device(device)
        self.index = tuple(i.to(self.device) for i in (slot // (block_size * c), (slot // c) % block_size, slot % c))

    @classmethod
    def derived(cls, block_size: int, kv_heads: int, head_dim: int, device: torch.device | str = "cpu") -> DeviceBlockLayout:
        """The mapping vLLM's logical shape documents: canonical ``(part, token, head, d)`` is at
        ``(head, token, part * head_dim + d)`` of the block view (K the first half of the content)."""
        h = torch.arange(kv_heads).view(-1, 1, 1)
        t = torch.arange(block_size).view(1, -1, 1)
        c = torch.arange(2 * head_dim).view(1, 1, -1)
        part, d = c // head_dim, c % head_dim
        canon = ((part * block_size + t) * kv_heads + h) * head_dim + d
        return cls(canon, block_size, kv_heads, head_dim, device, "derived")

    @classmethod
    def probe(cls, like: torch.Tensor, block_size: int, kv_heads: int, head_dim: int, write: Any = None) -> DeviceBlockLayout:
        """Learn the mapping from vLLM's cache write (``write``, default ``reshape_and_cache_flash``;
        same arguments, unquantized) on a scratch block with the strides, dtype and device of
        ``like`` (a layer's registered KV view), split into K and V as the backends split it."""
        write = write or _flash_write
        if max(block_size, kv_heads, head_dim) > PROBE_EXACT_MAX:
            raise UnsupportedKvLayout(f"probing a block of {block_size}x{kv_heads}x{head_dim}: indices over {PROBE_EXACT_MAX}")
        dev, dtype = like.device, like.dtype
        shape = (block_size, kv_heads, head_dim)  # the cache write's key and value: [tokens, kv heads, head dim]
        index = {
            "t": torch.arange(block_size).view(-1, 1, 1).expand(shape),
            "h": torch.arange(kv_heads).view(1, -1, 1).expand(shape),
            "d": torch.arange(head_dim).view(1, 1, -1).expand(shape),
        }
        zeros = torch.zeros(shape, dtype=torch.int64)
        slots = torch.arange(block_size, dtype=torch.int64, device=dev)
        found = {}
        for name, (k_ids, v_ids) in {"part": (zeros, zeros + 1), **{n: (i, i) for n, i in index.items()}}.items():
            scratch = torch.empty_strided((1, *like.shape[1:]), like.stride(), dtype=dtype, device=dev)
            scratch.fill_(-1)
            # (B, H, N, 2D) -> ((B, N, H, D), (B, N, H, D)): vLLM's split (flash_attn.py do_kv_cache_update)
            key_cache, value_cache = scratch.transpose(1, 2).split(head_dim, dim=-1)
            write(k_ids.to(dtype).to(dev).contiguous(), v_ids.to(dtype).to(dev).contiguous(), key_cache, value_cache, slots)
            found[name] = scratch[0].reshape(-1).to(torch.int64).cpu()
            if bool((found[name] < 0).any()):
                raise UnsupportedKvLayout("vLLM's CUDA cache write left part of a block unwritten")
        canon = ((found["part"] * block_size + found["t"]) * kv_heads + found["h"]) * head_dim + found["d"]
        return cls(canon, block_size, kv_heads, head_dim, dev, "probe")

    def pack(self, layers: list[torch.Tensor], block_id: int) -> torch.Tensor:
        """The canonical ``[layers, 2 * block_size * kv_heads * head_dim]`` of one block, on the host."""
        return torch.stack([t[block_id][self.index] for t in layers]).cpu()

    def unpack(self, layers: list[torch.Tensor], block_id: int, canonical: torch.Tensor) -> None:
        """Write a canonical block (host or device) into vLLM's tensors, every layer."""
        canonical = canonical.to(self.device)
        for layer, t in enumerate(layers):
            t[block_id].index_put_(self.index, canonical[layer])


def device_block_layout(tensors: list[torch.Tensor], names: list[str], block_size: int, kv_heads: int, head_dim: int,
                        kv_cache_dtype: str = "auto", write: Any = None) -> DeviceBlockLayout:  # fmt: skip
    """The ``DeviceBlockLayout`` of KV tensors in the layout vLLM's CUDA backends register
    (``UnsupportedKvLayout`` for anything else): learnt with ``DeviceBlockLayout.probe`` (``write``:
    the cache write, default vLLM's ``reshape_and_cache_flash``), or, when that op cannot be run
    here, ``DeviceBlockLayout.derived``."""
    expected = (kv_heads, block_size, 2 * head_dim)
    for name, t in zip(names, tensors):
        if t.dim() != 4 or tuple(t.shape[1:]) != expected or t.stride(-1) != 1:
            raise UnsupportedKvLayout(
                f"KvccConnector: layer {name} has a KV cache of shape {tuple(t.shape)}, strides {tuple(t.stride())}; "
                f"only vLLM's logical layout [num_blocks, {expected[0]}, {expected[1]}, {expected[2]}] with the content "
                "axis innermost (K then V) is supported on CUDA"
            )
        if t.stride() != tensors[0].stride() or t.dtype != tensors[0].dtype or t.device != tensors[0].device:
            raise UnsupportedKvLayout(f"KvccConnector: layer {name}'s KV cache differs from {names[0]}'s in strides, dtype "
                                      "or device")  # fmt: skip
    if kv_cache_dtype != "auto" or tensors[0].dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise UnsupportedKvLayout(f"KvccConnector: KV cache dtype {kv_cache_dtype}/{tensors[0].dtype} (quantized) is not supported")
    derived = DeviceBlockLayout.derived(block_size, kv_heads, head_dim, tensors[0].device)
    try:
        probed = DeviceBlockLayout.probe(tensors[0], block_size, kv_heads, head_dim, write)
    except UnsupportedKvLayout:
        raise
    except Exception as e:  # noqa: BLE001 -- the op is not in this build: the documented layout
        log.warning("KvccConnector: vLLM's cache write could not be probed (%s: %s); using the documented layout",
                    type(e).__name__, e)  # fmt: skip
        return derived
    if not torch.equal(probed.canon_of_slot, derived.canon_of_slot):
        log.warning("KvccConnector: vLLM's cache write places K/V otherwise than its documented layout; following the kernel")
    return probed


def engine_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The instruction set vLLM's CPU attention picks for this cache (it sets it on each layer
    from the same function; vLLM has no public name for it)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_dim, "auto")


SAVE_PRIORITIES = ("idle", "normal")


def lower_thread_priority() -> str:
    """Put the calling thread (only it: Linux schedules threads) in ``SCHED_IDLE``, or at nice 19
    where that class is missing; returns which, or ``""`` when neither was allowed."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return "idle"
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return "nice"
    except (AttributeError, OSError):
        return ""


class KvccConnector(KVConnectorBase_V1):
    """kvcc as vLLM's external KV cache. See the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise NotImplementedError("KvccConnector: tensor and pipeline parallelism are not supported yet")
        self.block_size = int(vllm_config.cache_config.block_size)
        model = vllm_config.model_config
        served = model.served_model_name
        served = served[0] if isinstance(served, (list, tuple)) and served else served
        model_id = str(extra.get("model_id") or served or model.model)
        namespace = engine_namespace(Path(model.model), model_id, block_tokens=self.block_size)
        self.kv_cache_dtype = str(vllm_config.cache_config.cache_dtype)
        if self.kv_cache_dtype != "auto":
            namespace = evolve(namespace, kv_dtype=self.kv_cache_dtype)
        self.mapper = KeyMapper(namespace)
        self.layers, self.kv_heads, self.head_dim = block_layout(namespace.kv_layout)
        self._role_side = "s" if role == KVConnectorRole.SCHEDULER else "w"
        self._async_saves = bool(extra.get("async_saves", True))
        self._save_priority = str(extra.get("save_priority", "normal"))
        if self._save_priority not in SAVE_PRIORITIES:
            raise ValueError(f"kv_connector_extra_config save_priority must be one of {SAVE_PRIORITIES}, not {self._save_priority!r}")
        self._save_queue: queue.Queue | None = None
        self._saver: threading.Thread | None = None
        self._stats_lock = threading.Lock()
        self._client_lock = threading.Lock()  # making or swapping the client (the worker's thread and the saver's)
        self._save_lock = threading.Lock()  # a save sending: a deployment switch waits for it (never taken by a load)
        # A deployment file (see Deployment file): its settings over the extra config's, re-read when it changes.
        self._extra = extra
        self._deployment_file = Path(extra["deployment_file"]) if extra.get("deployment_file") else None
        self._deployment_sig: tuple[int, ...] | None = None
        self.deployment_generation = 0  # deployments switched to since start
        settings = dict(extra)
        if self._deployment_file is not None:
            self._deployment_sig = _file_sig(self._deployment_file)
            if self._deployment_sig is None:
                raise ValueError(f"KvccConnector: deployment_file {str(self._deployment_file)!r} does not exist")
            settings.update(_read_deployment(self._deployment_file))
        self._configure(settings)
        self._client: Any = None
        self.stats: dict[str, Any] = {}
        # scheduler side
        self._requests: dict[str, _Request] = {}
        self._loads: list[_Load] = []
        # every namespace of this engine's blocks kvcc may hold: its own, and each cache salt's seen
        self._namespaces: set[bytes] = {bytes(self.mapper.namespace(None).digest())}
        self._reset_timeout_s = float(extra.get("reset_timeout_s", RESET_TIMEOUT_S_DEFAULT))
        # worker side
        self._kv: list[torch.Tensor] = []
        self._load_errors: set[int] = set()
        self._failed_requests: set[str] = set()  # requests whose load failed in this step

    # ---------------------------------------------------------------- plumbing
    def _configure(self, extra: dict[str, Any]) -> None:
        """The settings that name the kvcc deployment this connector talks to (and its identity,
        event log and stats file there): from the extra config, or the deployment file over it."""
        host, _, port = str(extra["directory"]).rpartition(":")
        self._address = (host, int(port))
        self._tenant = str(extra.get("tenant", "engine"))
        self._token = _token(extra)
        self._skew_ms = int(extra.get("skew_ms", SKEW_MS_DEFAULT))
        self._timeout_ms = int(extra.get("timeout_ms", CLIENT_TIMEOUT_MS_DEFAULT))
        side = self._role_side
        base = f"{extra.get('client_id') or f'vllm{os.getpid()}'}-{side}"
        if "." in base:
            raise ValueError(f"KvccConnector: client_id {base!r}: a '.' would make it co-located with a cache node")
        colocated = extra.get("colocated_node")
        self.client_id = f"{colocated}.{base}" if colocated else base
        self._events_dir = Path(extra["events_dir"]) if extra.get("events_dir") else None
        self._load_hold_s = float(extra.get("load_hold_ms", 0)) / 1000
        stats_path = extra.get("stats_path")
        self._stats_file = None if not stats_path else Path(f"{stats_path}.{'scheduler' if side == 's' else 'worker'}.json")

    def _follow_deployment(self) -> None:
        """With a deployment file: if it changed since last read (``os.stat``: inode, times, size),
        switch to what it now names -- close the old kvcc client (the next call opens one with the
        new settings), counters and the namespaces seen start afresh. A file that cannot be read
        or parsed keeps the current deployment (a warning)."""
        path = self._deployment_file
        if path is None:
            return
        sig = _file_sig(path)
        if sig is None or sig == self._deployment_sig:
            return
        try:
            settings = {**self._extra, **_read_deployment(path)}
            with self._save_lock, self._client_lock:
                kept = {k: getattr(self, k) for k in _DEPLOYMENT_ATTRS}
                try:
                    self._configure(settings)
                except BaseException:
                    self.__dict__.update(kept)  # all of the current deployment, not part of each
                    raise
                old, self._client = self._client, None
                self._deployment_sig = sig
                self.deployment_generation += 1
                with self._stats_lock:
                    self.stats = {}
                self._namespaces = {bytes(self.mapper.namespace(None).digest())}
        except (OSError, ValueError, KeyError) as e:
            self._deployment_sig = sig  # not again until it changes
            log.warning("KvccConnector: deployment file %s unusable, keeping the current deployment: %s", path, e)
            return
        log.info("KvccConnector: switched to the deployment of %s (client %s)", path, self.client_id)
        if old is not None:
            try:
                old.close()
            except Exception as e:  # the old deployment may be gone already
                log.info("kvcc client: close failed: %s", e)

    @property
    def client(self) -> Any:
        with self._client_lock:
            return self._make_client()

    def _make_client(self) -> Any:
        if self._client is None:
            from kvcc.reference.client import SyncClient

            events = None
            if self._events_dir is not None:
                from kvcc.reference.events import EventLog

                events = EventLog(self._events_dir / f"{self.client_id}.ndjson", self.client_id, 1)
            self._client = SyncClient(self._address, self._tenant, self._token, client_id=self.client_id,
                                      skew_ms=self._skew_ms, timeout_ms=self._timeout_ms, events=events)  # fmt: skip
        return self._client

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[name] = self.stats.get(name, 0) + n

    def _publish_stats(self) -> None:
        if self._stats_file is None:
            return
        with self._stats_lock:
            tmp = self._stats_file.with_name(self._stats_file.name + ".tmp")
            tmp.write_text(json.dumps(self.stats, sort_keys=True))
            os.replace(tmp, self._stats_file)

    def shutdown(self) -> None:
        if self._saver is not None:
            self._save_queue.put(None)  # after the saves already queued
            self._saver.join(SAVER_STOP_S)
            self._saver = None
        if self._client is not None:
            try:
                self._client.close()
            except Exception as e:  # the engine is going away either way
                log.info("kvcc client %s: close failed: %s", self.client_id, e)
            self._client = None

    # ================================================================ scheduler side
    def on_new_request(self, request: Request) -> None:
        tokens = request.prompt_token_ids
        if tokens is None or request.lora_request is not None or request.mm_features or request.prompt_embeds is not None:
            return  # KV that depends on more than the tokens: not ours to key
        if (request.kv_transfer_params or {}).get("kvcc") == SKIP:
            self._count("requests_skipped")
            return  # the request opted out: neither looked up nor saved
        keys = self.mapper.keys(tokens[: MAX_BLOCKS_PER_LOOKUP * self.block_size], request.cache_salt)
        ns = bytes(self.mapper.namespace(request.cache_salt).digest())
        self._namespaces.add(ns)
        self._requests[request.request_id] = _Request(keys, ns, len(tokens))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._follow_deployment()
        state = self._requests.get(request.request_id)
        if state is None:
            return 0, False
        assert num_computed_tokens % self.block_size == 0, "vLLM presents a block-aligned local hit"
        # The block that holds the last prompt token is never loaded: vLLM computes at least one.
        candidates = min(len(state.keys), (state.prompt_tokens - 1) // self.block_size)
        local_blocks = num_computed_tokens // self.block_size
        state.local_hit_tokens = num_computed_tokens
        if candidates <= local_blocks:
            return 0, False
        began = time.perf_counter()
        try:
            hit = self.client.lookup(state.namespace, state.keys[:candidates])
        except Exception as e:  # kvcc unreachable: a miss
            log.warning("kvcc lookup failed: %s", e)
            self._count("lookup_failures")
            return 0, False
        self._count("lookups")
        self._count("lookup_us", round((time.perf_counter() - began) * 1e6))
        assert 0 <= hit.blocks <= candidates
        if hit.blocks <= local_blocks:
            return 0, False
        return (hit.blocks - local_blocks) * self.block_size, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        state = self._requests[request.request_id]
        assert state.local_hit_tokens is not None, "a load vLLM scheduled without asking us"
        assert num_external_tokens % self.block_size == 0
        first = state.local_hit_tokens // self.block_size
        count = num_external_tokens // self.block_size
        (block_ids,) = blocks.get_block_ids()
        assert first + count <= len(block_ids) and first + count <= len(state.keys)
        plan = [(state.keys[i], block_ids[i]) for i in range(first, first + count)]
        self._loads.append(_Load(request.request_id, state.namespace, plan))
        self._count("loads_scheduled")
        self._count("blocks_scheduled", count)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvccConnectorMetadata:
        self._follow_deployment()
        meta = KvccConnectorMetadata(loads=self._loads)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                self._plan_saves(meta, new.req_id, state, new.num_computed_tokens, scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # after a preemption: the whole list, anew
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            self._plan_saves(meta, req_id, state, cached.num_computed_tokens[i], scheduled.get(req_id, 0))
        if meta.loads or meta.saves:
            self._publish_stats()
        return meta

    def _plan_saves(self, meta: KvccConnectorMetadata, req_id: str, state: _Request, computed: int, scheduled: int) -> None:
        """The prompt blocks that become full in this step: block ``b`` does iff
        ``computed < (b + 1) * block_size <= computed + scheduled``."""
        first = computed // self.block_size
        last = min(computed + scheduled, state.prompt_tokens) // self.block_size
        last = min(last, len(state.keys), len(state.block_ids))
        blocks = [(state.keys[b], state.keys[b - 1] if b else None, state.block_ids[b]) for b in range(first, last)]
        if blocks:
            meta.saves.append(_Save(req_id, state.namespace, blocks))
            self._count("blocks_planned_for_save", len(blocks))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return False, None  # the worker packs a step's saves before the step ends: the blocks are free to go

    def reset_cache(self) -> bool | None:
        """``POST /reset_prefix_cache?reset_external=true`` (vLLM asks the scheduler's connector):
        a namespace invalidation of each namespace this engine's blocks may be under in kvcc (its
        own, and every cache salt's it has seen since it started), each waited for until it
        completed -- every copy freed, every read lease revoked or expired. ``True`` only if all
        completed in time; vLLM then reports the reset as failed."""
        if self._role != KVConnectorRole.SCHEDULER:
            return None
        self._follow_deployment()
        done = True
        for ns in sorted(self._namespaces):
            try:
                ticket = self.client.invalidate(ns, SCOPE_NAMESPACE)
                completed = bool(self.client.wait(ticket, self._reset_timeout_s))
            except Exception as e:  # kvcc unreachable: the reset did not happen
                log.warning("kvcc namespace invalidation failed: %s", e)
                completed = False
            self._count("namespace_invalidations" if completed else "namespace_invalidations_unfinished")
            done = done and completed
        self._publish_stats()
        return done

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=_layer_order)
        tensors = [kv_caches[n] for n in names]
        if len(tensors) != self.layers:
            raise ValueError(f"KvccConnector: {len(tensors)} KV layers, the namespace says {self.layers}")
        if tensors[0].device.type != "cpu":  # vLLM's CUDA backends (see the module docstring)
            self._kv = tensors
            self.layout = device_block_layout(tensors, names, self.block_size, self.kv_heads, self.head_dim,
                                              self.kv_cache_dtype)  # fmt: skip
            self.block_bytes = self.layers * 2 * self.block_size * self.kv_heads * self.head_dim * tensors[0].element_size()
            log.info("KvccConnector %s: %d layers on %s (%s layout), %d bytes a block, namespace %s", self.client_id,
                     len(tensors), tensors[0].device, self.layout.source, self.block_bytes, self.mapper.base)  # fmt: skip
            return
        for name, t in zip(names, tensors):
            expected = (self.kv_heads, self.block_size, 2 * self.head_dim)
            if t.dim() != 4 or tuple(t.shape[1:]) != expected or not t[0].is_contiguous():
                raise NotImplementedError(
                    f"KvccConnector: layer {name} has a KV cache of shape {tuple(t.shape)}; only vLLM's CPU "
                    f"attention layout [num_blocks, {expected[0]}, {expected[1]}, {expected[2]}] is supported"
                )
        if self.kv_cache_dtype != "auto":
            raise NotImplementedError(f"KvccConnector: KV cache dtype {self.kv_cache_dtype} (quantized) is not supported")
        self._kv = tensors
        dtype = tensors[0].dtype
        self.layout = CpuBlockLayout.probe(dtype, self.block_size, self.kv_heads, self.head_dim,
                                           engine_isa(dtype, self.block_size, self.head_dim))  # fmt: skip
        self.block_bytes = self.layers * 2 * self.block_size * self.kv_heads * self.head_dim * tensors[0].element_size()
        log.info("KvccConnector %s: %d layers, %d bytes a block, namespace %s", self.client_id, len(tensors),
                 self.block_bytes, self.mapper.base)  # fmt: skip

    def _block_bytes(self, block_id: int) -> bytes:
        canonical = self.layout.pack(self._kv, block_id)
        assert canonical.numel() * canonical.element_size() == self.block_bytes
        return canonical.view(torch.uint8).numpy().tobytes()

    def _copy_in(self, block_id: int, staging: torch.Tensor) -> None:
        self.layout.unpack(self._kv, block_id, staging.view(self._kv[0].dtype).view(self.layers, -1))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._follow_deployment()
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvccConnectorMetadata)
        self._failed_requests = set()
        if not meta.loads:
            return
        began = time.perf_counter()
        for load in meta.loads:
            for start in range(0, len(load.blocks), LOAD_CHAIN_BLOCKS):
                part = load.blocks[start : start + LOAD_CHAIN_BLOCKS]
                loaded, reason = self._load_chain(load.namespace, part)
                if loaded:
                    self._count("loaded_blocks", loaded)
                if reason is not None:
                    failed = [b for _, b in load.blocks[start + loaded :]]
                    self._load_errors.update(failed)
                    self._failed_requests.add(load.req_id)
                    self._count("load_errors", len(failed))
                    self._count(f"load_refused_{reason}")
                    key = part[loaded][0]
                    log.warning("kvcc load of %s refused (%s): %d blocks to recompute", key.hex[:16], reason, len(failed))
                    break
        self._count("load_us", round((time.perf_counter() - began) * 1e6))
        self._publish_stats()

    def _load_chain(self, namespace: bytes, blocks: list[tuple[BlockKey, int]]) -> tuple[int, str | None]:
        """Copy a run of a chain's committed blocks into vLLM's tensors under read leases, one
        round trip each to lease, read and release them: ``(n, why)``, the first ``n`` blocks
        copied, and why the next was not (``None``: all were). Nothing is copied past the first
        block that failed."""
        from kvcc.reference.client import Refused

        try:
            leases, refused = self.client.acquire_chain(namespace, [key for key, _ in blocks])
        except Exception as e:
            return 0, f"acquire_failed:{type(e).__name__}"
        loaded, reason = 0, None if refused is None else refused.reason
        try:
            if leases:
                if self._load_hold_s:
                    time.sleep(self._load_hold_s)  # fault injection: a slow load (see load_hold_ms)
                staging = torch.empty((len(leases), self.block_bytes), dtype=torch.uint8)
                got = self.client.read_many(leases, [staging[i] for i in range(len(leases))])
                for i, answer in enumerate(got):
                    if isinstance(answer, Refused) or answer != self.block_bytes:
                        reason = answer.reason if isinstance(answer, Refused) else "wrong_size"
                        break
                    self._copy_in(blocks[i][1], staging[i])
                    loaded += 1
        except Exception as e:
            reason = f"read_failed:{type(e).__name__}"
        finally:
            try:
                self.client.release_many(leases)
            except Exception as e:  # the leases then end by expiry: slower, never unsafe
                log.info("kvcc release failed: %s", e)
        return loaded, reason

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous: done before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # a kvcc block holds every layer: saved whole in wait_for_save

    def wait_for_save(self) -> None:
        """Pack the step's newly full prompt blocks out of the paged tensors now (vLLM may reuse
        the blocks once the step ends), and save them: on the saver thread (``async_saves``, the
        default; the engine's step does not wait for kvcc), else here."""
        self._follow_deployment()
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvccConnectorMetadata)
        if not meta.saves:
            return
        began = time.perf_counter()
        batches = []
        for save in meta.saves:
            if save.req_id in self._failed_requests:
                self._count("saves_dropped_after_load_error", len(save.blocks))
                continue  # computed over blocks that did not load
            blocks = [(key, parent, self._block_bytes(block_id)) for key, parent, block_id in save.blocks]
            batches.append((self.deployment_generation, save.namespace, blocks))
        if not self._async_saves:
            for batch in batches:
                self._save_batch(*batch)
        else:
            for batch in batches:
                self._enqueue_save(batch)
        self._count("save_us", round((time.perf_counter() - began) * 1e6))
        self._publish_stats()

    def _enqueue_save(self, batch: tuple[int, bytes, list[tuple[BlockKey, BlockKey | None, bytes]]]) -> None:
        if self._saver is None:  # started on first use: no thread exists before vLLM forks
            self._save_queue = queue.Queue(SAVE_QUEUE_MAX)
            self._saver = threading.Thread(target=self._save_loop, name="kvcc-saver", daemon=True)
            self._saver.start()
        try:
            self._save_queue.put_nowait(batch)
        except queue.Full:  # kvcc is behind: a lost save, never a stalled engine
            self._count("saves_dropped_queue_full", len(batch[2]))
            return
        self._count("save_batches_queued")

    def _save_loop(self) -> None:
        if self._save_priority == "idle":
            lower_thread_priority()
        while True:
            batch = self._save_queue.get()
            if batch is None:
                return
            try:
                self._save_batch(*batch)
            except Exception as e:  # noqa: BLE001 -- a lost save; the thread lives on
                log.warning("kvcc save failed: %s", e)
            self._count("save_batches_done")
            self._publish_stats()

    def _save_batch(self, generation: int, namespace: bytes, blocks: list[tuple[BlockKey, BlockKey | None, bytes]]) -> None:
        """Write and commit one request's blocks of a step, root first (``put_chain``: each
        commit travels with the next block's write lease request). A refusal is a lost save.
        Blocks packed under an earlier deployment (the deployment file changed meanwhile) are
        never sent to the new one: lost saves too."""
        from kvcc.reference.client import Refused

        with self._save_lock:  # a deployment switch waits for a save in progress
            if generation != self.deployment_generation:
                self._count("saves_dropped_deployment_switched", len(blocks))
                return
            try:
                outs = self.client.put_chain(namespace, blocks)
            except Exception as e:
                outs = [Refused(f"put_failed:{type(e).__name__}")] * len(blocks)
        for out in outs:
            if isinstance(out, Refused):
                self._count("already_stored" if out.reason == REASON_NOT_ABSENT else f"save_refused_{out.reason}")
            else:
                self._count("saved_blocks")

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
