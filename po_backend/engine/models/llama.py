"""The Llama-family decoder: Llama 2/3, SmolLM2, Mistral, Qwen2 (qkv bias)
and Qwen3 (per-head q/k RMSNorm) differ only in those two flags, so one file serves them all.
Gemma (`gemma.py`) and Phi-3 (`phi.py`) subclass these classes.

The modules hold weights and expose per-chunk operations; `runner.py` decides how tokens are
chunked and where attention runs (hybrid prefilling), so no op here sees more than one chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, cast

import torch
from torch import nn

from po_backend.engine.config import ModelConfig
from po_backend.engine.models.int8 import linear
from po_backend.engine.models.layers import add_rms_norm, qk_norm_rope_, rms_norm, silu_mul
from po_backend.engine.models.lora import LayerLoRA

WeightLoader = Callable[[torch.Tensor, torch.Tensor, "str | int | None"], None]


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def copy_loader(param: torch.Tensor, loaded: torch.Tensor, shard: str | int | None = None) -> None:
    assert param.shape == loaded.shape, f"shape mismatch: {tuple(param.shape)} vs {tuple(loaded.shape)}"
    param.copy_(loaded)


class FusedParam:
    """Loader for a parameter that is several checkpoint tensors stacked along dim 0."""

    def __init__(self, sizes: dict[str | int, int]) -> None:
        self.offsets: dict[str | int, tuple[int, int]] = {}
        start = 0
        for name, size in sizes.items():
            self.offsets[name] = (start, size)
            start += size

    def __call__(self, param: torch.Tensor, loaded: torch.Tensor, shard: str | int | None = None) -> None:
        if shard is None:  # a checkpoint that stores the fused tensor itself (Phi-3's qkv_proj)
            copy_loader(param, loaded, None)
            return
        assert shard in self.offsets, f"unknown shard {shard!r} (known: {list(self.offsets)})"
        start, size = self.offsets[shard]
        copy_loader(param.narrow(0, start, size), loaded, None)


def _set_loader(param: nn.Parameter, loader: FusedParam) -> None:
    # A fused parameter carries the loader that places each checkpoint shard (nano-vllm's rule);
    # torch Parameters take such attributes, its stubs do not declare them.
    param.weight_loader = loader  # type: ignore[attr-defined]


class DecoderLayer(nn.Module):
    # The LoRA adapter of the running forward (`LoRARegistry.applied`); None: the base weights.
    lora: LayerLoRA | None = None
    # The gated MLP's activation times the up projection (a gate_up buffer into act).
    act_mul = staticmethod(silu_mul)
    # The plain RMSNorm (x * w) right before a projection: int8's smoothing folds into its weight.
    smooth_norms: ClassVar[dict[str, str]] = {
        "qkv_proj": "input_layernorm",
        "gate_up_proj": "post_attention_layernorm",
    }

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        qkv_out = cfg.q_size + 2 * cfg.kv_size
        self.input_layernorm = _param(cfg.hidden_size, dtype=dtype)
        self.qkv_proj = _param(qkv_out, cfg.hidden_size, dtype=dtype)
        _set_loader(self.qkv_proj, FusedParam({"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size}))
        self.qkv_bias = _param(qkv_out, dtype=dtype) if cfg.qkv_bias else None
        if self.qkv_bias is not None:
            _set_loader(self.qkv_bias, FusedParam({"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size}))
        self.q_norm = _param(cfg.head_dim, dtype=dtype) if cfg.qk_norm else None
        self.k_norm = _param(cfg.head_dim, dtype=dtype) if cfg.qk_norm else None
        self.o_proj = _param(cfg.hidden_size, cfg.q_size, dtype=dtype)
        self.post_attention_layernorm = _param(cfg.hidden_size, dtype=dtype)
        self.gate_up_proj = _param(2 * cfg.intermediate_size, cfg.hidden_size, dtype=dtype)
        _set_loader(self.gate_up_proj, FusedParam({0: cfg.intermediate_size, 1: cfg.intermediate_size}))
        self.down_proj = _param(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)

    def qkv_chunk(
        self, h: torch.Tensor, x: torch.Tensor, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """h [c, hidden] -> qkv [c, q+k+v] with q/k rotated. `x` is a [c, hidden] scratch buffer."""
        cfg = self.cfg
        rms_norm(h, self.input_layernorm, cfg.rms_norm_eps, out=x)
        self.project("qkv", x, self.qkv_proj, qkv, self.qkv_bias)
        c = qkv.shape[0]
        # q and k are adjacent in the fused buffer: one view rotates both heads' sets at once
        # (half the op calls of rotating them apart, on a memory-bound step).
        qk = qkv[:, : cfg.q_size + cfg.kv_size].view(c, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        norms = None
        if self.q_norm is not None:
            assert self.k_norm is not None, "q_norm and k_norm come together"
            norms = (self.q_norm, self.k_norm)
        qk_norm_rope_(qk, cos, sin, cfg.num_heads, cfg.rms_norm_eps, norms)

    def out_mlp_chunk(
        self, h: torch.Tensor, attn: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor, act: torch.Tensor
    ) -> None:
        """h += o_proj(attn); h += mlp(norm(h)), all in place on the chunk view `h`.

        x [c, hidden], gate_up [c, 2*inter] and act [c, inter] are scratch buffers reused by every
        chunk and layer: the MLP intermediate, the largest activation, never exceeds one chunk.
        """
        self.project("o", attn, self.o_proj, x)
        add_rms_norm(h, x, self.post_attention_layernorm, self.cfg.rms_norm_eps, out=x)
        self.mlp(x, gate_up, act)
        h.add_(x)

    def project(
        self,
        name: str,
        x: torch.Tensor,
        weight: torch.Tensor,
        out: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> None:
        """out = x @ weight.T (+ bias), plus the running LoRA adapter's part for `name`."""
        linear(x, weight, out, bias)
        if self.lora is not None:
            self.lora.add(name, x, out)

    def mlp(self, x: torch.Tensor, gate_up: torch.Tensor, act: torch.Tensor) -> None:
        """x = down(act_fn(gate_up(x))), in place: x is read before it is overwritten."""
        self.project("gate_up", x, self.gate_up_proj, gate_up)
        self.act_mul(gate_up, out=act)
        self.project("down", act, self.down_proj, x)


# Head weights upcast to fp32 at a time by `final_logits` (16 MiB): its memory whatever the vocabulary.
HEAD_CHUNK_ELEMS = 1 << 22


class LlamaForCausalLM(nn.Module):
    # The decoder layer's class (subclasses of this model swap in their own).
    layer_class: type[DecoderLayer] = DecoderLayer
    # checkpoint name fragment -> (our parameter name, shard of a fused parameter)
    packed_modules_mapping: dict[str, tuple[str, str | int | None]] = {
        "self_attn.q_proj.weight": ("qkv_proj", "q"),
        "self_attn.k_proj.weight": ("qkv_proj", "k"),
        "self_attn.v_proj.weight": ("qkv_proj", "v"),
        "self_attn.q_proj.bias": ("qkv_bias", "q"),
        "self_attn.k_proj.bias": ("qkv_bias", "k"),
        "self_attn.v_proj.bias": ("qkv_bias", "v"),
        "mlp.gate_proj.weight": ("gate_up_proj", 0),
        "mlp.up_proj.weight": ("gate_up_proj", 1),
    }
    renamed: dict[str, str] = {
        "input_layernorm.weight": "input_layernorm",
        "post_attention_layernorm.weight": "post_attention_layernorm",
        "self_attn.o_proj.weight": "o_proj",
        "self_attn.q_norm.weight": "q_norm",
        "self_attn.k_norm.weight": "k_norm",
        "mlp.down_proj.weight": "down_proj",
    }

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(self.layer_class(cfg, dtype) for _ in range(cfg.num_layers))
        # The same modules, typed: the runners call their chunk methods.
        self.decoder_layers: list[DecoderLayer] = [cast(DecoderLayer, m) for m in self.layers]
        self.norm = _param(cfg.hidden_size, dtype=dtype)
        # Tied models share the embedding matrix: no second [vocab, hidden] copy in memory.
        self.lm_head = (
            self.embed_tokens
            if cfg.tie_word_embeddings
            else _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        )
        # What token embeddings are multiplied by (Gemma: sqrt(hidden), rounded to the dtype as
        # transformers does); None: nothing.
        self.embed_scale: torch.Tensor | None = None

    def embed(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Token embeddings of ids [c] into out [c, hidden] (which may be wider than the weights:
        an fp32 residual stream)."""
        if out.dtype == self.embed_tokens.dtype:
            torch.index_select(self.embed_tokens, 0, ids, out=out)
        else:
            out.copy_(self.embed_tokens.index_select(0, ids))
        if self.embed_scale is not None:
            out.mul_(self.embed_scale)

    def resolve(self, name: str) -> tuple[torch.Tensor, WeightLoader, str | int | None] | None:
        """Map a checkpoint tensor name to (our parameter, its loader, shard); None = not ours."""
        if name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                return None  # some tied checkpoints still store a copy; the embedding wins
            attr = {"model.embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head"}.get(
                name, "norm"
            )
            return getattr(self, attr), copy_loader, None
        if not name.startswith("model.layers."):
            return None
        idx, rest = name[len("model.layers.") :].split(".", 1)
        layer = self.layers[int(idx)]
        if rest in self.packed_modules_mapping:
            attr, shard = self.packed_modules_mapping[rest]
            param = getattr(layer, attr)
            return (param, getattr(param, "weight_loader"), shard) if param is not None else None  # noqa: B009
        if rest in self.renamed:
            param = getattr(layer, self.renamed[rest])
            return (param, copy_loader, None) if param is not None else None
        return None

    def final_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """h [m, hidden] -> the final norm of it in fp32: what the LM head, a classifier head and
        an embedding's pooling read (transformers' `last_hidden_state`). An architecture with
        another final norm overrides this, and every head follows."""
        x = torch.empty(h.shape, dtype=torch.float32, device=h.device)
        rms_norm(h.float(), self.norm.float(), self.cfg.rms_norm_eps, out=x)
        return x

    def final_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [m, hidden] at the scored positions only -> logits [m, vocab], computed in fp32.

        A bf16 head rounds its outputs to 8 mantissa bits (a logit near 16 moves in steps of
        0.125), so different prompts get identical probabilities and rankings tie. The scored rows
        are few, so the final norm and the head run in fp32; the head's weight is upcast
        `HEAD_CHUNK_ELEMS` at a time, which bounds the extra memory for any vocabulary."""
        x = self.final_hidden(h)
        if self.lm_head.dtype == torch.float32:
            out = torch.matmul(x, self.lm_head.t())
        else:
            vocab, hidden = self.lm_head.shape
            out = torch.empty(h.shape[0], vocab, dtype=torch.float32, device=h.device)
            rows = max(1, HEAD_CHUNK_ELEMS // hidden)
            for a in range(0, vocab, rows):
                out[:, a : a + rows] = torch.matmul(x, self.lm_head[a : a + rows].float().t())
        cap = self.cfg.final_softcap
        return out.div_(cap).tanh_().mul_(cap) if cap is not None else out
