"""LoRA adapters (PEFT folders: `adapter_config.json` + `adapter_model.safetensors`) served beside
the base weights, never merged into them, so several adapters live in one process.

A loaded adapter is, per decoder layer, the low-rank updates of its fused projections (`qkv`,
`o`, `gate_up`, `down`): a projection's output gains `x @ A^T @ B^T * scaling` in the rows of
each targeted checkpoint module (q_proj is the first `q_size` columns of our fused qkv). One
adapter runs per forward (`LoRARegistry.applied` sets it on the layers for that forward); the
engine keeps each adapter's prefixes apart in the cache through `LoRAAdapter.uid`.

Everything an adapter could get wrong (files, PEFT options we do not implement, ranks, shapes
against this base model, the memory limits) is checked in `LoRARegistry.load`, so a bad adapter
is a `LoRAError` naming the problem at load time, never an error inside a request.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from po_backend.core.errors import LoRAError
from po_backend.core.task import ModelTask
from po_backend.engine.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Checkpoint module (as PEFT names it under a decoder layer) -> our fused projection. PEFT
# targets q_proj, k_proj... on Llama-like models and the fused qkv_proj / gate_up_proj on Phi-3.
TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
)
# Modules a sequence-classification adapter saves whole: its own score head (PEFT's default
# modules_to_save for SEQ_CLS names both; "classifier" matches nothing on these models).
HEAD_MODULES = ("score", "classifier")
_TENSOR = re.compile(
    r"(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight"
)
_HEAD = re.compile(r"(?:base_model\.model\.)?score(?:\.modules_to_save)?(?:\.default)?\.weight")


class _Decoder(Protocol):
    """What the registry reads of a model: its config and decoder layers (each takes `lora`)."""

    cfg: ModelConfig

    @property
    def decoder_layers(self) -> list[Any]: ...


@dataclass(frozen=True)
class _Part:
    """One targeted checkpoint module inside a fused projection: its output columns
    [offset, offset + size) and its B (pre-scaled), reading ranks [r0, r1) of the shared A."""

    offset: int
    size: int
    r0: int
    r1: int
    b: torch.Tensor  # [size, rank] * scaling


class LayerLoRA:
    """One adapter's updates of one decoder layer, per fused projection: the A matrices of its
    targeted modules stacked ([sum of ranks, in]: one matmul for q, k and v), and each module's B."""

    def __init__(self, projs: Mapping[str, tuple[torch.Tensor, tuple[_Part, ...]]]) -> None:
        self.projs = dict(projs)

    def add(self, proj: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += the adapter's update of projection `proj` for input rows x (in place)."""
        entry = self.projs.get(proj)
        if entry is None:
            return
        a, parts = entry
        t = torch.matmul(x, a.t())
        for p in parts:
            out[:, p.offset : p.offset + p.size].addmm_(t[:, p.r0 : p.r1], p.b.t())


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str
    uid: int  # never reused: a reloaded name keys new cache entries (`Engine` cache keys)
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    layers: tuple[LayerLoRA | None, ...]
    score: torch.Tensor | None  # its own classifier head (modules_to_save), or None: the base's
    nbytes: int


def _fused(cfg: ModelConfig) -> dict[str, tuple[str, int, int, int]]:
    """Checkpoint module -> (our projection, first output column, output size, input size)."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {
        "q_proj": ("qkv", 0, q, h),
        "k_proj": ("qkv", q, kv, h),
        "v_proj": ("qkv", q + kv, kv, h),
        "qkv_proj": ("qkv", 0, q + 2 * kv, h),
        "o_proj": ("o", 0, h, q),
        "gate_proj": ("gate_up", 0, i, h),
        "up_proj": ("gate_up", i, i, h),
        "gate_up_proj": ("gate_up", 0, 2 * i, h),
        "down_proj": ("down", 0, h, i),
    }


def reserve_bytes(
    cfg: ModelConfig, task: ModelTask, dtype: torch.dtype, max_loras: int, max_rank: int, chunk: int
) -> int:
    """What `max_loras` adapters of rank `max_rank` on every target take at most, plus one
    chunk's update buffers in a forward: the memory budget sets this aside before the prefix pool."""
    it = torch.empty((), dtype=dtype).element_size()
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    # A: q, k, v, gate, up read hidden; o reads q; down reads inter. B: each module's output.
    per_rank = (5 * h + q + i) + (q + 2 * kv + h + 2 * i + h)
    weights = per_rank * max_rank * cfg.num_layers * it
    head = task.num_labels * h * it if task.kind == "classify" else 0
    scratch = chunk * (3 * max_rank + max(q + 2 * kv, 2 * i)) * it
    return max_loras * (weights + head) + scratch


def _read_config(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise LoRAError(f"LoRA adapter folder {folder} does not exist")
    cfg_file = folder / CONFIG_FILE
    if not cfg_file.is_file():
        raise LoRAError(f"{folder} has no {CONFIG_FILE} (a PEFT adapter folder has it)")
    if not (folder / WEIGHTS_FILE).is_file():
        legacy = (
            " (only safetensors are read: re-save it with safe_serialization)"
            if any(folder.glob("adapter_model.bin"))
            else ""
        )
        raise LoRAError(f"{folder} has no {WEIGHTS_FILE}{legacy}")
    try:
        config = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"{cfg_file} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{cfg_file} is not a JSON object")
    return config


def _check_config(config: dict[str, Any], where: Path) -> tuple[int, float]:
    """The PEFT options we implement, or a LoRAError naming the one we do not; (rank, scaling)."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"{where}: peft_type {peft_type!r} is not supported (LORA only)")
    refused = {
        "use_dora": "DoRA (use_dora)",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
        "lora_bias": "lora_bias",
        "layer_replication": "layer_replication",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "trainable_token_indices": "trainable_token_indices (embedding targets)",
    }
    for key, what in refused.items():
        if config.get(key):
            raise LoRAError(f"{where}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{where}: bias={config['bias']!r} is not supported (bias 'none' only)")
    extra = sorted(set(config.get("modules_to_save") or ()) - set(HEAD_MODULES))
    if extra:
        raise LoRAError(
            f"{where}: modules_to_save {extra} are not supported (only a classifier's score head)"
        )
    targets = config.get("target_modules")
    if isinstance(targets, list):
        bad = sorted(set(targets) - set(TARGETS))
        if bad:
            raise LoRAError(
                f"{where}: target_modules {bad} are not supported (the decoder's linear layers "
                f"{list(TARGETS)} only; no embedding or LM-head targets)"
            )
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r < 1:
        raise LoRAError(f"{where}: r must be a positive integer, got {r!r}")
    if alpha is None:
        alpha = r  # PEFT's default lora_alpha is 8 for r=8; an absent alpha scales by 1
    if not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoRAError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return r, float(scaling)


class LoRARegistry:
    """The adapters one engine serves, by name: loaded from PEFT folders (checked whole first),
    unloaded, listed, and set on the model for one forward (`applied`). Load and unload may run
    on any thread (a server's control route); the forward runs on the engine's."""

    def __init__(
        self,
        model: _Decoder,
        task: ModelTask,
        dtype: torch.dtype,
        device: torch.device,
        max_loras: int,
        max_rank: int,
    ) -> None:
        self.model = model
        self.task = task
        self.dtype = dtype
        self.device = device
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._adapters: dict[str, LoRAAdapter] = {}
        self._uids = itertools.count(1)
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return list(self._adapters)

    def adapters(self) -> list[LoRAAdapter]:
        return list(self._adapters.values())

    def find(self, name: str) -> LoRAAdapter | None:
        return self._adapters.get(name)

    def get(self, name: str) -> LoRAAdapter:
        adapter = self._adapters.get(name)
        if adapter is None:
            known = ", ".join(sorted(self._adapters)) or "none loaded"
            raise LoRAError(f"LoRA adapter {name!r} is not loaded (loaded: {known})")
        return adapter

    def load(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read, check and place an adapter; raises LoRAError (nothing loaded) when it cannot serve."""
        if not name or not isinstance(name, str):
            raise LoRAError("a LoRA adapter needs a non-empty name")
        with self._lock:
            if name in self._adapters:
                raise LoRAError(f"a LoRA adapter named {name!r} is already loaded: unload it first")
            if len(self._adapters) >= self.max_loras:
                raise LoRAError(
                    f"{len(self._adapters)} LoRA adapters are loaded, the most --max-loras "
                    f"({self.max_loras}) allows: unload one first"
                )
        adapter = self._read(name, Path(path))
        with self._lock:  # checked again: another load may have finished meanwhile
            if name in self._adapters or len(self._adapters) >= self.max_loras:
                raise LoRAError(f"cannot load {name!r}: the name was taken or --max-loras reached meanwhile")
            self._adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        with self._lock:
            self.get(name)
            del self._adapters[name]

    def _read(self, name: str, folder: Path) -> LoRAAdapter:
        from safetensors import safe_open

        config = _read_config(folder)
        rank, scaling = _check_config(config, folder)
        if rank > self.max_rank:
            raise LoRAError(f"{folder}: rank {rank} is more than --max-lora-rank ({self.max_rank})")
        cfg = self.model.cfg
        fused = _fused(cfg)
        # (layer, module) -> {"A": tensor, "B": tensor}
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        score: torch.Tensor | None = None
        with safe_open(str(folder / WEIGHTS_FILE), framework="pt", device="cpu") as f:
            for key in f.keys():
                m = _TENSOR.fullmatch(key)
                if m is not None:
                    layer, module, side = int(m.group(1)), m.group(3), m.group(4)
                    if module not in fused:
                        raise LoRAError(
                            f"{folder}: tensor {key} targets {module}, which is not supported "
                            f"(the decoder's linear layers {list(TARGETS)} only)"
                        )
                    if layer >= cfg.num_layers:
                        raise LoRAError(
                            f"{folder}: tensor {key} is for layer {layer}, but this model has "
                            f"{cfg.num_layers} layers (an adapter for another base model?)"
                        )
                    pairs.setdefault((layer, module), {})[side] = f.get_tensor(key)
                elif _HEAD.fullmatch(key):
                    score = self._head(f.get_tensor(key), folder)
                elif "lora_embedding" in key:
                    raise LoRAError(f"{folder}: embedding targets ({key}) are not supported")
                elif "lora_magnitude_vector" in key:
                    raise LoRAError(f"{folder}: DoRA ({key}) is not supported")
                else:
                    raise LoRAError(f"{folder}: tensor {key} is not a supported LoRA weight")
        if not pairs and score is None:
            raise LoRAError(f"{folder}: {WEIGHTS_FILE} holds no LoRA weights")
        per_layer: list[dict[str, list[tuple[str, torch.Tensor, torch.Tensor]]]] = [
            {} for _ in range(cfg.num_layers)
        ]
        for (layer, module), ab in sorted(pairs.items()):
            where = f"{folder}: layer {layer} {module}"
            if set(ab) != {"A", "B"}:
                raise LoRAError(f"{where} has lora_{''.join(ab)} without its other half")
            a, b = ab["A"], ab["B"]
            proj, _, size, fan_in = fused[module]
            if a.dim() != 2 or b.dim() != 2:
                raise LoRAError(f"{where}: lora_A and lora_B must be matrices")
            if a.shape[0] != rank or b.shape[1] != rank:
                raise LoRAError(
                    f"{where}: lora_A is {list(a.shape)} and lora_B {list(b.shape)}, but the "
                    f"config's rank r is {rank}"
                )
            if a.shape[1] != fan_in or b.shape[0] != size:
                raise LoRAError(
                    f"{where}: lora_A is {list(a.shape)} and lora_B {list(b.shape)}, but this model's "
                    f"{module} maps {fan_in} inputs to {size} outputs (an adapter for another base model?)"
                )
            per_layer[layer].setdefault(proj, []).append((module, a, b))
        layers: list[LayerLoRA | None] = []
        nbytes = 0 if score is None else score.numel() * score.element_size()
        for mods in per_layer:
            projs: dict[str, tuple[torch.Tensor, tuple[_Part, ...]]] = {}
            for proj, items in mods.items():
                a_cat = torch.cat([a for _, a, _ in items]).to(self.device, self.dtype).contiguous()
                parts = []
                for k, (module, _, b) in enumerate(items):
                    _, offset, size, _ = fused[module]
                    # Scaled in fp32, then rounded once to the model's dtype.
                    bs = (b.float() * scaling).to(self.device, self.dtype).contiguous()
                    parts.append(_Part(offset, size, k * rank, (k + 1) * rank, bs))
                    nbytes += bs.numel() * bs.element_size()
                nbytes += a_cat.numel() * a_cat.element_size()
                projs[proj] = (a_cat, tuple(parts))
            layers.append(LayerLoRA(projs) if projs else None)
        targets = tuple(sorted({module for _, module in pairs}))
        return LoRAAdapter(
            name, str(folder), next(self._uids), rank, scaling, targets, tuple(layers), score, nbytes
        )

    def _head(self, weight: torch.Tensor, folder: Path) -> torch.Tensor:
        if self.task.kind != "classify":
            raise LoRAError(
                f"{folder}: the adapter carries a classifier score head, but the model is served "
                f"for {self.task.kind}"
            )
        want = (self.task.num_labels, self.model.cfg.hidden_size)
        if tuple(weight.shape) != want:
            raise LoRAError(
                f"{folder}: the adapter's score head is {list(weight.shape)}, this model's is {list(want)}"
            )
        return weight.to(self.device, self.dtype)

    @contextmanager
    def applied(self, adapter: LoRAAdapter | None) -> Iterator[None]:
        """`adapter` on the model for the forwards and heads inside (None: the base model)."""
        if adapter is None:
            yield
            return
        model: Any = self.model
        layers = self.model.decoder_layers
        base_score = getattr(model, "score", None)
        try:
            for layer, lora in zip(layers, adapter.layers, strict=True):
                layer.lora = lora
            if adapter.score is not None:
                model.score = torch.nn.Parameter(adapter.score, requires_grad=False)
            yield
        finally:
            for layer in layers:
                layer.lora = None
            if adapter.score is not None:
                model.score = base_score
