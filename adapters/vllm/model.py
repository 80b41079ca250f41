"""A tiny random-weight Llama that vLLM can serve, generated here: no download, no network.

    path = tiny_llama()            # built once into the cache folder, then reused
    spec = TinyLlamaSpec(); spec.model_id, read_revision(path)

Theory of operation
-------------------
vLLM needs a Hugging Face model folder (``config.json``, safetensors weights, a fast tokenizer).
The tests need one that is small enough to start and run on two CPU cores in seconds, identical on
every machine, and built without network access. So this module generates it: a
``LlamaForCausalLM`` with ``transformers`` from a seeded ``torch`` generator, and a byte-level BPE
tokenizer trained with ``tokenizers`` on a text that is itself generated from the seed. The model
computes nonsense, but deterministic nonsense: greedy completions are reproducible, which is all an
engine test needs.

vLLM's CPU attention constrains the shape: ``head_dim`` must be 64 (16 fails), so the hidden size
is 64 per head. Everything else is as small as it goes (2 layers, a 512-token vocabulary).

The folder is written under a temporary name and renamed into place, so concurrent builders (test
workers) never see half a model; the loser of the rename uses the winner's folder. Its name carries
a digest of the spec, so a changed spec builds a new folder. The *revision* of the model (for kvcc's
key namespace, ``kvcc.spec.keys.Namespace.model_revision``) is the SHA-256 of the folder's files,
recorded in ``kvcc-model.json`` at build time and checked by ``read_revision``.

Needs the ``vllm`` extra (``torch``, ``transformers``, ``tokenizers``), imported lazily.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from attrs import asdict, frozen

from kvcc.spec.keys import Namespace

__all__ = ["MANIFEST", "ModelCacheError", "TinyLlamaSpec", "default_cache_dir", "engine_namespace", "read_revision", "tiny_llama"]

MANIFEST = "kvcc-model.json"
CACHE_ENV = "KVCC_MODEL_CACHE"
CORPUS_WORDS = 20_000  # words of generated training text for the tokenizer
_SPECIAL_TOKENS = ("<s>", "</s>", "<unk>")


class ModelCacheError(RuntimeError):
    """A cached model folder is incomplete or its files do not match its recorded revision."""


@frozen
class TinyLlamaSpec:
    """The generated model's shape. ``head_dim`` is fixed at 64 by vLLM's CPU attention."""

    model_id: str = "kvcc/tiny-llama"
    seed: int = 0
    vocab_size: int = 512
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 256
    max_position_embeddings: int = 4096
    torch_dtype: str = "bfloat16"

    def digest(self) -> str:
        """Short digest of the spec: the cache folder's suffix."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    """``$KVCC_MODEL_CACHE``, else ``$XDG_CACHE_HOME/kvcc/models``, else ``~/.cache/kvcc/models``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvcc" / "models"


def tiny_llama(spec: TinyLlamaSpec = TinyLlamaSpec(), cache_dir: Path | None = None) -> Path:
    """The folder of the model ``spec`` describes, building it on first use."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"tiny-llama-{spec.digest()}"
    if (target / MANIFEST).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        _build(spec, staging)
        try:
            staging.rename(target)
        except OSError:
            # Another builder won the rename; its folder is complete (it has its manifest).
            if not (target / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def read_revision(path: Path) -> str:
    """The model's revision: SHA-256 over its files (names and bytes), as recorded at build time.
    Raises ``ModelCacheError`` if the folder's files no longer match it."""
    try:
        recorded = json.loads((Path(path) / MANIFEST).read_text())["revision"]
    except (OSError, ValueError, KeyError) as e:
        raise ModelCacheError(f"{path}: no readable {MANIFEST} ({e})") from None
    actual = _files_digest(Path(path))
    if actual != recorded:
        raise ModelCacheError(f"{path}: files hash to {actual}, the manifest records {recorded}")
    return recorded


def engine_namespace(path: Path, model_id: str, *, block_tokens: int, tp_rank: int = 0, tp_size: int = 1) -> Namespace:
    """kvcc's namespace for an engine serving the model folder ``path`` (without a cache salt:
    each request brings its own). The revision is the folder's content digest; the KV dtype is
    the model's (vLLM's ``--kv-cache-dtype auto``); the layout names what one block holds per
    token: layers x KV heads x head dim."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
        dtype = config.get("dtype") or config["torch_dtype"]
        layout = f"L{config['num_hidden_layers']}.H{config['num_key_value_heads']}.D{config['head_dim']}"
    except (OSError, ValueError, KeyError) as e:
        raise ModelCacheError(f"{path}: no usable config.json ({e})") from None
    return Namespace(model_id, read_revision(path), dtype, block_tokens, kv_layout=layout, tp_rank=tp_rank, tp_size=tp_size)


def _files_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST):
        h.update(f.name.encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def _corpus(seed: int) -> list[str]:
    """Generated text: pseudo-words over a small alphabet, with Zipf-like repetition so that BPE
    finds merges. Deterministic in ``seed``."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    lexicon = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(600)]
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    words = rng.choices(lexicon, weights=weights, k=CORPUS_WORDS)
    return [" ".join(words[i : i + 12]) + "." for i in range(0, len(words), 12)]


def _build(spec: TinyLlamaSpec, folder: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>", model_max_length=spec.max_position_embeddings
    )
    tokenizer.save_pretrained(folder)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.num_heads * spec.head_dim,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(getattr(torch, spec.torch_dtype))
    model.save_pretrained(folder, safe_serialization=True)
    (folder / MANIFEST).write_text(
        json.dumps({"spec": asdict(spec), "revision": _files_digest(folder)}, indent=1, sort_keys=True) + "\n"
    )
