"""The vLLM connector's CUDA block layout (``DeviceBlockLayout``) and CUDA engine command line, as
far as they run without CUDA.

vLLM's CUDA backends register per layer a view of logical shape ``[blocks, kv heads, block size,
2 x head dim]`` whose strides follow the KV cache layout vLLM resolved; the views here are built by
vLLM's own ``create_kv_cache_views`` (CPU tensors, every ``KVCacheLayout``). Checked: a canonical
block scattered into every layout and gathered back is unchanged; an element lands where the
documented layout puts it (hand-computed, in the raw bytes); the probe, driven with a reference
cache write honouring the views' strides, learns that same mapping on every layout; shapes and
strides the connector does not understand are refused. vLLM's real ``reshape_and_cache_flash`` is
not in its CPU build: the probe with it runs only on CUDA (``scripts/vllm_cuda.sh``). The CUDA
engine's command line parses with vLLM's own argument parser.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the vllm extra is not installed")

H, N, D = 2, 32, 64  # the tiny Llama: kv heads, block tokens, head dim
LAYERS, BLOCKS = 2, 3


def _views(layout, dtype=None):
    """Two layers' KV views of ``BLOCKS`` blocks as vLLM's worker builds them (its own
    ``create_kv_cache_views``) in ``layout``, on the CPU; and the raw buffer under them."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, compute_layout_strides, create_kv_cache_views

    spec = FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=dtype or torch.bfloat16)
    strides = compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    size = LAYERS * BLOCKS * spec.page_size_bytes
    raw = torch.zeros(size, dtype=torch.int8)
    tensor = KVCacheTensor(size=size, layers=[f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)],
                           layer_stride=strides[0], block_stride=strides[1])  # fmt: skip
    return create_kv_cache_views(raw, spec, BLOCKS, layout, tensor), raw, strides


def _layouts():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return list(KVCacheLayout)


def _reference_write(key, value, key_cache, value_cache, slot_mapping):
    """What ``reshape_and_cache_flash`` does (unquantized): token ``i`` of ``key``/``value``
    (``[tokens, heads, head dim]``) to slot ``slot_mapping[i]`` = block * block size + offset of
    ``key_cache``/``value_cache`` (``[blocks, block size, heads, head dim]``, any strides)."""
    block_size = key_cache.shape[1]
    key_cache[slot_mapping // block_size, slot_mapping % block_size] = key
    value_cache[slot_mapping // block_size, slot_mapping % block_size] = value


def _canonical(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn((LAYERS, 2 * N * H * D), generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("name", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_round_trip_through_every_cuda_layout(name):
    """canonical -> engine layout -> canonical is the identity, in every stride order vLLM has,
    and the other blocks are untouched."""
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvcc.adapters.vllm.connector import device_block_layout

    assert {layout.name for layout in _layouts()} == {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"}
    views, raw, _ = _views(KVCacheLayout[name])
    layout = device_block_layout(views, ["a", "b"], N, H, D, write=_reference_write)
    assert layout.source == "probe"
    canonical = _canonical(1)
    layout.unpack(views, 1, canonical)
    assert torch.equal(layout.pack(views, 1), canonical)
    assert int((raw != 0).sum()) > 0
    for other in (0, 2):
        assert not bool(views[0][other].any()) and not bool(views[1][other].any())
    assert layout.pack(views, 1).dtype == torch.bfloat16 and layout.pack(views, 1).device.type == "cpu"


def test_an_element_lands_where_the_documented_layout_puts_it():
    """Hand-computed: in vLLM's default CUDA layout (LBNHC: layer, block, token, head, content in
    memory), canonical element (V, token 5, head 1, d 7) of layer 1, block 2 is at byte
    ``layer_stride + 2 * block_stride + (5 * H * 2D + 1 * 2D + D + 7) * 2`` of the raw buffer."""
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvcc.adapters.vllm.connector import DeviceBlockLayout

    views, raw, strides = _views(KVCacheLayout.LBNHC)
    layout = DeviceBlockLayout.derived(N, H, D)
    canonical = torch.zeros((LAYERS, 2 * N * H * D), dtype=torch.bfloat16)
    part, t, h, d = 1, 5, 1, 7
    canonical[1, ((part * N + t) * H + h) * D + d] = 3.0
    layout.unpack(views, 2, canonical)
    offset = strides[0] + 2 * strides[1] + (t * H * 2 * D + h * 2 * D + D + d) * 2
    assert raw[offset : offset + 2].view(torch.bfloat16).item() == 3.0
    assert int((raw != 0).sum()) == 2  # the two bytes of that element, nothing else
    # the same element through the backend's own split of the view (flash_attn.py: do_kv_cache_update)
    key_cache, value_cache = views[1].transpose(1, 2).split(D, dim=-1)
    assert value_cache[2, t, h, d].item() == 3.0 and not bool(key_cache.any())


def test_the_probe_learns_the_documented_mapping_on_every_layout():
    import torch

    from kvcc.adapters.vllm.connector import DeviceBlockLayout

    derived = DeviceBlockLayout.derived(N, H, D)
    for layout in _layouts():
        views, _, _ = _views(layout)
        probed = DeviceBlockLayout.probe(views[0], N, H, D, write=_reference_write)
        assert torch.equal(probed.canon_of_slot, derived.canon_of_slot), layout.name


def test_without_the_cuda_op_the_documented_layout_is_used():
    """A build without ``reshape_and_cache_flash`` (vLLM's CPU build: the op raises AttributeError,
    as the stand-in below does on every machine): the probe cannot run, the documented layout is used."""
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvcc.adapters.vllm.connector import DeviceBlockLayout, device_block_layout

    def missing_op(*args):
        raise AttributeError("'_OpNamespace' '_C_cache_ops' object has no attribute 'reshape_and_cache_flash'")

    views, _, _ = _views(KVCacheLayout.LBNHC)
    layout = device_block_layout(views, ["a", "b"], N, H, D, write=missing_op)
    assert layout.source == "derived"
    assert torch.equal(layout.canon_of_slot, DeviceBlockLayout.derived(N, H, D).canon_of_slot)


def test_unknown_layouts_are_refused():
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvcc.adapters.vllm.connector import DeviceBlockLayout, UnsupportedKvLayout, device_block_layout

    ok, _, _ = _views(KVCacheLayout.LBNHC)
    bad = {
        "5D [2, blocks, tokens, heads, D]": [torch.zeros(2, BLOCKS, N, H, D)] * 2,
        "other heads": [torch.zeros(BLOCKS, H + 1, N, 2 * D)] * 2,
        "other block size": [torch.zeros(BLOCKS, H, 16, 2 * D)] * 2,
        "content axis not innermost": [torch.zeros(BLOCKS, H, 2 * D, N).transpose(2, 3)] * 2,
        "layers of other strides": [ok[0], torch.zeros(BLOCKS, H, N, 2 * D, dtype=torch.bfloat16)],
        "layers of other dtypes": [ok[0], ok[1].float()],
    }
    for why, tensors in bad.items():
        with pytest.raises(UnsupportedKvLayout):
            device_block_layout(tensors, ["a", "b"], N, H, D, write=_reference_write)
        assert issubclass(UnsupportedKvLayout, NotImplementedError), why
    with pytest.raises(UnsupportedKvLayout, match="quantized"):
        device_block_layout(ok, ["a", "b"], N, H, D, kv_cache_dtype="fp8", write=_reference_write)

    def holes(key, value, key_cache, value_cache, slots):
        _reference_write(key[:-1], value[:-1], key_cache, value_cache, slots[:-1])  # the last token not written

    with pytest.raises(UnsupportedKvLayout, match="unwritten"):
        DeviceBlockLayout.probe(ok[0], N, H, D, write=holes)

    def collide(key, value, key_cache, value_cache, slots):
        _reference_write(key, value, key_cache, value_cache, slots)
        key_cache[0, 1] = key_cache[0, 0]  # two tokens' K in one place, one token's K nowhere

    with pytest.raises(UnsupportedKvLayout, match="permutation"):
        DeviceBlockLayout.probe(ok[0], N, H, D, write=collide)


@pytest.mark.skipif(not importlib.util.find_spec("torch") or not __import__("torch").cuda.is_available(),
                    reason="needs CUDA: vLLM's CPU build has no reshape_and_cache_flash (scripts/vllm_cuda.sh runs this)")
def test_the_real_cuda_write_probes_to_the_documented_layout():
    """On CUDA: vLLM's own ``reshape_and_cache_flash`` on a scratch block of every layout's strides
    places K and V as the documented layout says, and a round trip through GPU views holds."""
    import torch

    from kvcc.adapters.vllm.connector import DeviceBlockLayout, device_block_layout

    derived = DeviceBlockLayout.derived(N, H, D)
    for layout in _layouts():
        views, _, _ = _views(layout)
        views = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cuda").zero_() for v in views]
        got = device_block_layout(views, ["a", "b"], N, H, D)
        assert got.source == "probe", layout.name
        assert torch.equal(got.canon_of_slot, derived.canon_of_slot), layout.name
        canonical = _canonical(2)
        got.unpack(views, 1, canonical)
        assert torch.equal(got.pack(views, 1), canonical), layout.name


# -- the CUDA engine's command line --------------------------------------------------------------


def _parse(argv):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser()).parse_args(argv)


def test_the_cuda_engines_command_line_parses_with_vllms_own_parser(tmp_path):
    from kvcc.adapters.vllm import harness

    e = harness.VllmEngine(tmp_path, num_blocks=64, device="cuda", extra_args=("--kv-transfer-config", "{}"))
    try:
        argv = e.argv()
        assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        args = _parse(argv[3:])
        assert args.gpu_memory_utilization == harness.GPU_MEMORY_UTILIZATION
        assert args.num_gpu_blocks_override == 64 and args.block_size == 32
        assert args.enforce_eager is True and args.dtype == "bfloat16"
        assert args.enable_prefix_caching is True and args.prefix_caching_hash_algo == "sha256_cbor"
        env = e.env()
        assert "VLLM_CPU_KVCACHE_SPACE" not in env and env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] == "0"
        assert harness.vllm_distribution("cuda") == "vllm" and harness.vllm_distribution("cpu") == "vllm-cpu"
        # The check can fail: a flag vLLM does not know is refused by its parser.
        with pytest.raises(SystemExit):
            _parse([*argv[3:], "--no-such-kvcc-flag", "1"])
    finally:
        e.close()


def test_the_cpu_engines_command_line_is_unchanged(tmp_path):
    from kvcc.adapters.vllm import harness

    e = harness.VllmEngine(tmp_path, num_blocks=64, device="cpu")
    try:
        argv = e.argv()
        assert "--gpu-memory-utilization" not in argv and "--enforce-eager" not in argv
        assert e.env()["VLLM_CPU_KVCACHE_SPACE"] == str(harness.KVCACHE_SPACE_GIB)
        args = _parse(argv[3:])
        assert args.num_gpu_blocks_override == 64
    finally:
        e.close()


def test_engine_block_size_and_device_rules(tmp_path, monkeypatch):
    from kvcc.adapters.vllm import harness

    with pytest.raises(ValueError, match="multiple of 16"):
        harness.VllmEngine(tmp_path, block_size=24, device="cuda")
    with pytest.raises(ValueError, match="multiple of 32"):
        harness.VllmEngine(tmp_path, block_size=16, device="cpu")
    with pytest.raises(ValueError, match="device"):
        harness.VllmEngine(tmp_path, device="tpu")
    monkeypatch.setenv(harness.DEVICE_ENV, "cpu")
    assert harness.default_device() == "cpu"
    monkeypatch.setenv(harness.DEVICE_ENV, "gpu")
    with pytest.raises(ValueError):
        harness.default_device()


def test_the_index_of_a_hand_computed_element_with_four_heads():
    """With 4 KV heads (with 2, swapping K/V for the head is its own inverse and hides a mix-up of
    the permutation and its inverse): canonical (V, token 5, head 3, d 7) gathers from view
    position (head 3, token 5, content D + 7)."""
    from kvcc.adapters.vllm.connector import DeviceBlockLayout

    heads, tokens = 4, 16
    layout = DeviceBlockLayout.derived(tokens, heads, D)
    i = ((1 * tokens + 5) * heads + 3) * D + 7
    assert tuple(int(x[i]) for x in layout.index) == (3, 5, D + 7)
    assert int(layout.canon_of_slot[(3 * tokens + 5) * 2 * D + D + 7]) == i
