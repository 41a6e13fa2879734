"""Write a HF safetensors checkpoint (a `shape:` folder, or any Qwen2/Qwen3/Llama folder) as a GGUF
file that llama.cpp and our GGUF loader both read: the same weights, so llama.cpp can be timed
against this engine on them. F16, BF16 or Q8_0 (matrices; norms and biases stay F32), the names and
metadata keys of llama.cpp's own convert_hf_to_gguf.py, and the folder's BPE tokenizer padded to the
model's vocabulary. One tensor is in memory at a time.

    python -m po_backend.engine.models.gguf_export 'shape:qwen3-0.6b' /tmp/q.f16.gguf --type f16
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from po_backend.core.errors import UnsupportedModelError
from po_backend.engine.config import RopeConfig

TYPES = ("f16", "bf16", "q8_0")
ARCHS = {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
# Tokenizer pre-splitting llama.cpp applies before BPE: the shapes' tokenizer is SmolLM2's.
PRE_TOKENIZER = "smollm"
# The checkpoint's RoPE fields (JSON), for our GGUF loader: llama.cpp reads Llama-3's scaling from
# the `rope_freqs` tensor alone, which transformers' GGUF reader drops.
ROPE_KEY = "prefillonly.rope_parameters"


def _qtype(kind: str) -> Any:
    import gguf

    return {
        "f16": gguf.GGMLQuantizationType.F16,
        "bf16": gguf.GGMLQuantizationType.BF16,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
    }[kind]


def _tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else []
    for file in files or ["model.safetensors"]:
        with safe_open(str(model_dir / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF's rotate-half q/k rows into llama.cpp's interleaved RoPE order (convert_hf_to_gguf's)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _encode(data: np.ndarray, kind: str, qtype: Any) -> tuple[np.ndarray, Any]:
    """(bytes or values to write, raw type) of one tensor: 1-D tensors (norms, biases) and matrices
    whose rows do not split into Q8_0 blocks stay F32, as llama.cpp's converter keeps them."""
    import gguf

    if data.ndim == 1:
        return data.astype(np.float32), gguf.GGMLQuantizationType.F32
    if kind == "f16":
        return data.astype(np.float16), qtype
    if kind == "q8_0" and data.shape[-1] % 32:
        return data.astype(np.float16), gguf.GGMLQuantizationType.F16
    return gguf.quants.quantize(data, qtype), qtype


def _rope_freqs(model: str, arch: str, cfg: dict[str, Any], head_dim: int) -> np.ndarray | None:
    """llama.cpp's `rope_freqs` tensor of a Llama with scaled RoPE (Llama-3's "llama3", or
    "linear"): each rotary pair's frequency divisor, the unscaled frequency over the scaled one
    (llama.cpp's converter computes the same from the llama3 formula). None: no scaling."""
    rope = RopeConfig.from_hf(cfg)
    if rope.kind == "default" and rope.partial_rotary_factor == 1.0:
        return None
    if arch != "llama" or rope.kind not in ("llama3", "linear") or rope.partial_rotary_factor != 1.0:
        raise UnsupportedModelError(f"{model}: RoPE {rope.kind!r} on {arch} is not written to GGUF")
    unscaled = RopeConfig(theta=rope.theta).inv_freq(head_dim)
    return (unscaled / rope.inv_freq(head_dim)).numpy().astype(np.float32)


def _vocab(model_dir: Path, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the folder's tokenizer.json (byte-level BPE), padded with
    unused `[PAD<i>]` entries to the model's vocabulary as llama.cpp's converter pads it."""
    import gguf

    spec = json.loads((model_dir / "tokenizer.json").read_text())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise UnsupportedModelError(f"{model_dir}: only byte-level BPE tokenizers are written to GGUF")
    by_id = {i: t for t, i in model["vocab"].items()}
    special = {a["id"]: a["content"] for a in spec.get("added_tokens", [])}
    by_id |= special
    if max(by_id) >= vocab_size:
        raise UnsupportedModelError(
            f"{model_dir}: tokenizer ids reach {max(by_id)}, vocab_size is {vocab_size}"
        )
    tokens, types = [], []
    for i in range(vocab_size):
        if i in special:
            tokens.append(special[i])
            types.append(gguf.TokenType.CONTROL)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, [int(t) for t in types], merges


def write_gguf(model: str | Path, out: Path, kind: str = "f16") -> Path:
    """Write `model` (a model path: a HF folder or `shape:NAME`) to the GGUF file `out` in `kind`."""
    import gguf

    from po_backend.engine.models.loader import resolve_model_dir

    if kind not in TYPES:
        raise ValueError(f"GGUF type {kind!r}: one of {', '.join(TYPES)}")
    model_dir = resolve_model_dir(str(model))
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = ARCHS.get((cfg.get("architectures") or ["?"])[0])
    if arch is None:
        raise UnsupportedModelError(
            f"{model}: GGUF export covers {', '.join(ARCHS)}, not {cfg.get('architectures')}"
        )
    n_layers, n_head = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_head)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // n_head)
    rope_freqs = _rope_freqs(str(model), arch, cfg, head_dim)
    vocab_size = int(cfg["vocab_size"])
    qtype = _qtype(kind)

    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(str(model))
    w.add_description(
        str(json.loads((model_dir / "shape.json").read_text())["weights"])
        if (model_dir / "shape.json").is_file()
        else ""
    )
    w.add_file_type(
        {
            "f16": gguf.LlamaFileType.MOSTLY_F16,
            "bf16": gguf.LlamaFileType.MOSTLY_BF16,
            "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        }[kind]
    )
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(n_layers)
    w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_embedding_length(int(cfg["hidden_size"]))
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    tokens, types, merges = _vocab(model_dir, vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(PRE_TOKENIZER)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id)):
        if isinstance(cfg.get(key), int) and cfg[key] < vocab_size:
            add(cfg[key])
    w.add_add_bos_token(False)
    if rope_freqs is not None:
        rope_fields = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
        w.add_string(ROPE_KEY, json.dumps(rope_fields))

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layers)

    def converted() -> Iterator[tuple[str, np.ndarray, Any]]:
        for hf_name, t in _tensors(model_dir):
            name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise UnsupportedModelError(f"{model}: no GGUF name for tensor {hf_name}")
            t = t.float()
            if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
                t = _permute(t, n_head if "attn_q" in name else n_kv)
            data, raw = _encode(t.numpy(), kind, qtype)
            yield name, data, raw
        if rope_freqs is not None:
            yield (
                gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                rope_freqs,
                gguf.GGMLQuantizationType.F32,
            )

    # Two passes over the checkpoint: the tensor table first (shapes and sizes), then the data, so
    # one tensor is in memory at a time.
    for name, data, raw in converted():
        w.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, data, _ in converted():
        w.write_tensor_data(data)
    w.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a model path: HF folder or shape:NAME")
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", choices=TYPES, default="f16")
    args = ap.parse_args(argv)
    print(write_gguf(args.model, args.out, args.type))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
