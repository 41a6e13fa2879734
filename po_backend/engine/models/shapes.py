"""Real model shapes without their weights: `shape:NAME` as a model path names a registered model's
exact configuration (its config.json, written through transformers' config class) with seeded
random weights. A forward's time and peak memory depend on the shape, not on the weights' values,
so speed and memory figures at a real model's size need no download; its outputs mean nothing.

    shape:llama-3.1-8b                          the registered configuration
    shape:qwen3-0.6b?num_hidden_layers=2        with config.json fields replaced (tests, quick runs)

On a CPU the checkpoint is written once into the cache root (bf16 safetensors, a tokenizer, the
config) so that transformers and llama.cpp read the same weights; on a GPU the engine fills its
parameters in device memory and only the config and tokenizer are written (`needs_weights`)."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import torch
from safetensors.torch import save_file

from po_backend.core.errors import ModelNotFoundError, UnsupportedModelError

PREFIX = "shape:"
MARKER = "shape.json"  # in a shape's folder: what it is, and that weights may be made in memory
WEIGHTS_NOTE = "random weights, real shape"
SEED = 0
INIT_STD = 0.02  # transformers' initializer_range for every registered model
SHARD_BYTES = 1 << 30  # one shard is generated in memory at a time
# Bumped when what is written for a shape changes, so an old cached folder is not reused.
FORMAT = 1

_QWEN_SPECIAL = {"bos_token_id": 151643, "eos_token_id": 151645}
_LLAMA3_SPECIAL = {"bos_token_id": 128000, "eos_token_id": 128001}

# The config.json fields of each model as published (architecture, sizes, RoPE, tying, windows);
# the rest takes the config class's defaults.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 28,
        **_QWEN_SPECIAL,
    },
    # Qwen3-Reranker-0.6B's decoder as a one-logit classifier (the sequence-classification form
    # rerankers are served in by TEI and sentence-transformers' CrossEncoder).
    "qwen3-reranker-0.6b": {
        "architectures": ["Qwen3ForSequenceClassification"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151669,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 28,
        "num_labels": 1,
        "pad_token_id": 151643,
        **_QWEN_SPECIAL,
    },
    "qwen2.5-1.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": 131072,
        "max_window_layers": 28,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        **_LLAMA3_SPECIAL,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        **_LLAMA3_SPECIAL,
    },
    "gemma-2-2b": {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 1,
    },
}


def parse(path: object) -> tuple[str, dict[str, Any]] | None:
    """(name, config.json overrides) of a `shape:` path, None for any other path."""
    text = str(path)
    if not text.startswith(PREFIX):
        return None
    name, _, query = text[len(PREFIX) :].partition("?")
    if name not in SHAPES:
        raise ModelNotFoundError(f"unknown shape {name!r}; registered shapes: {', '.join(sorted(SHAPES))}")
    overrides = {
        k: _value(v) for k, v in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    }
    return name, overrides


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def is_shape(path: object) -> bool:
    return str(path).startswith(PREFIX)


def weights_note(path: object) -> str | None:
    """What a figure made on `path` must say about its weights (None: real weights)."""
    return WEIGHTS_NOTE if is_shape(path) else None


def hf_config(name: str, overrides: dict[str, Any] | None = None) -> Any:
    """transformers' config object of a registered shape (with `overrides`)."""
    import transformers

    fields = {**SHAPES[name], **(overrides or {})}
    model_type = fields.pop("model_type")
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):  # a vocabulary cut by an override
        if isinstance(fields.get(k), int) and fields[k] >= fields["vocab_size"]:
            fields[k] = None
    try:
        return transformers.AutoConfig.for_model(model_type, **fields)
    except (TypeError, ValueError) as e:
        raise UnsupportedModelError(f"shape {name!r} with {overrides}: {e}") from e


def shape_dir(path: object, weights: bool = True) -> Path:
    """The folder of a `shape:` path in the cache root: config.json and a tokenizer, plus the
    seeded random weights when `weights` (built once; processes that start together wait)."""
    from po_backend.engine.models.loader import cache_root, file_lock

    parsed = parse(path)
    assert parsed is not None, f"{path!r} is not a shape path"
    name, overrides = parsed
    config = hf_config(name, overrides).to_dict()
    key = hashlib.sha256(json.dumps([FORMAT, SEED, config], sort_keys=True).encode()).hexdigest()[:12]
    target = cache_root() / "shapes" / f"{name}-{key}"
    with file_lock(target.parent / f".{target.name}.lock", f"another process is building {name}: waiting"):
        if not (target / "config.json").is_file():
            _build_folder(name, overrides, target)
        if weights and not (target / "model.safetensors.index.json").is_file():
            _write_weights(name, overrides, target)
    return target


def needs_weights(device: torch.device) -> bool:
    """Whether a shape's engine reads its weights from files on `device`: on a GPU it fills its
    parameters in device memory instead (an 8B checkpoint is 16 GB that nothing else reads)."""
    return device.type != "cuda"


def _build_folder(name: str, overrides: dict[str, Any], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        cfg = hf_config(name, overrides)
        cfg.dtype = torch.bfloat16
        cfg.save_pretrained(tmp)
        _save_tokenizer(tmp, cfg.vocab_size)
        (tmp / MARKER).write_text(
            json.dumps({"shape": name, "overrides": overrides, "seed": SEED, "weights": WEIGHTS_NOTE})
        )
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _save_tokenizer(folder: Path, vocab_size: int) -> None:
    """The embedded model's tokenizer (49,152 ids, SmolLM2's BPE) where the vocabulary holds it, so
    text has realistic token counts; else a byte-level one (256 ids + one special). Either way
    every id a prompt can produce is < vocab_size."""
    from po_backend.engine.models.loader import load_tokenizer, resolve_model_dir

    if vocab_size >= 49152:
        tok = load_tokenizer(resolve_model_dir("embedded"))
        if tok is not None and len(tok) <= vocab_size:
            tok.save_pretrained(folder)
            return
    if vocab_size < 257:
        raise UnsupportedModelError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer (257)")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(folder)


def _tensor_specs(name: str, overrides: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of every tensor transformers' model class of the shape holds, from
    the class itself on the meta device (no memory): the names a real checkpoint has."""
    import transformers

    cfg = hf_config(name, overrides)
    arch = getattr(transformers, cfg.architectures[0])
    with torch.device("meta"):
        model = arch(cfg)
    for n, p in model.named_parameters():  # tied parameters are listed once, as a checkpoint has them
        yield n, tuple(p.shape)


def fill_value(name: str, model_type: str) -> float | None:
    """A norm weight's constant (transformers' init: ones, zeros for Gemma's 1 + w norms), None for
    a tensor drawn from N(0, INIT_STD)."""
    if name.endswith("norm.weight") or name.endswith("norm"):
        return 0.0 if model_type.startswith("gemma") else 1.0
    return None


def _generator(name: str, device: torch.device | str = "cpu") -> torch.Generator:
    # One seed per tensor name: a tensor's values do not depend on the order tensors are made in.
    return torch.Generator(device=device).manual_seed(SEED * 1_000_003 + zlib.crc32(name.encode()))


def _write_weights(name: str, overrides: dict[str, Any], target: Path) -> None:
    """bf16 safetensors shards of SHARD_BYTES, one shard in memory at a time, and their index."""
    model_type = str(SHAPES[name]["model_type"])
    tmp = Path(tempfile.mkdtemp(prefix=".weights-", dir=target))
    try:
        shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
        size = 0
        for n, shape in _tensor_specs(name, overrides):
            nbytes = 2 * int(torch.Size(shape).numel())
            if shards[-1] and size + nbytes > SHARD_BYTES:
                shards.append([])
                size = 0
            shards[-1].append((n, shape))
            size += nbytes
        weight_map: dict[str, str] = {}
        for i, specs in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for n, shape in specs:
                value = fill_value(n, model_type)
                if value is not None:
                    tensors[n] = torch.full(shape, value, dtype=torch.bfloat16)
                else:
                    t = torch.empty(shape, dtype=torch.float32).normal_(
                        0.0, INIT_STD, generator=_generator(n)
                    )
                    tensors[n] = t.to(torch.bfloat16)
                weight_map[n] = file
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            del tensors
        for f in tmp.iterdir():
            f.rename(target / f.name)
        index = {"metadata": {"note": WEIGHTS_NOTE}, "weight_map": weight_map}
        (target / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def randomize_(model: torch.nn.Module, model_type: str) -> None:
    """Fill a model's parameters in place where they live (a GPU: nothing goes through the host),
    seeded per parameter name: norms as transformers initialises them, the rest N(0, INIT_STD)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            value = fill_value(n, model_type)
            if value is not None:
                p.fill_(value)
            else:
                p.normal_(0.0, INIT_STD, generator=_generator(n, p.device))
