"""The weight loader streams safetensors: every tensor lands as safetensors' own reader gives it
(any block size, fused shards, a dtype change), bad files are typed errors, and loading peaks
near the model's own size (no second copy of the weights: no memory map, no whole-tensor temporary)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch

from po_backend.core.errors import UnsupportedModelError
from po_backend.engine.models import loader
from po_backend.engine.models.loader import load_model
from tests.conftest import save_llama


def _reference(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our parameters as the checkpoint's tensors say, read by safetensors itself."""
    state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(safetensors.torch.load_file(f))
    out = {}
    for i in range(2):
        p = f"model.layers.{i}."
        qkv = [state[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]
        out[f"layers.{i}.qkv_proj"] = torch.cat(qkv)
        out[f"layers.{i}.gate_up_proj"] = torch.cat(
            [state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]
        )
        out[f"layers.{i}.down_proj"] = state[p + "mlp.down_proj.weight"]
        out[f"layers.{i}.o_proj"] = state[p + "self_attn.o_proj.weight"]
        out[f"layers.{i}.input_layernorm"] = state[p + "input_layernorm.weight"]
    out["embed_tokens"] = state["model.embed_tokens.weight"]
    out["lm_head"] = state["lm_head.weight"]
    return {k: v.to(dtype) for k, v in out.items()}


def _tiny(folder: Path, layers: int) -> str:
    """A tiny GQA Llama checkpoint (4 query heads over 2 KV heads)."""
    return save_llama(
        folder,
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [64, 1 << 30])
def test_streamed_weights_equal_safetensors_own_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, block: int
) -> None:
    path = Path(_tiny(tmp_path, layers=2))
    monkeypatch.setattr(loader, "STREAM_BLOCK_BYTES", block)  # 64: a block of one row, many blocks
    model = load_model(path, dtype, torch.device("cpu"))
    params = dict(model.named_parameters())
    for name, want in _reference(path, dtype).items():
        assert torch.equal(params[name], want), name


def test_a_truncated_or_misshapen_checkpoint_is_a_typed_error(tmp_path: Path) -> None:
    path = Path(_tiny(tmp_path, layers=1))
    (file,) = path.glob("*.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    with pytest.raises(UnsupportedModelError, match="shape"):
        load_model(path, torch.float32, torch.device("cpu"))
    (path / "config.json").write_text(json.dumps(cfg))
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(UnsupportedModelError, match="truncated"):
        load_model(path, torch.float32, torch.device("cpu"))


_PEAK = textwrap.dedent(
    """
    import json, re, sys
    from pathlib import Path
    import psutil, torch
    from po_backend.engine.models import loader
    from po_backend.engine.models.loader import load_model

    loader.STREAM_BLOCK_BYTES = 4 << 20  # a small model: blocks well below its tensors' size

    def status(key):
        return int(re.search(key + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) << 10

    load_model(Path(sys.argv[1]), torch.float32, torch.device("cpu"))  # imports, first-use state
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak resident size
    base = status("VmRSS")
    model = load_model(Path(sys.argv[2]), getattr(torch, sys.argv[3]), torch.device("cpu"))
    resident = sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}.values())
    print(json.dumps({"peak": status("VmHWM") - base, "resident": resident}))
    """
)


def _cast_checkpoint(path: Path, dtype: torch.dtype) -> None:
    (file,) = path.glob("*.safetensors")
    state = {k: v.to(dtype) for k, v in safetensors.torch.load_file(file).items()}
    safetensors.torch.save_file(state, file, metadata={"format": "pt"})


@pytest.mark.slow
@pytest.mark.parametrize(("stored", "loaded"), [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_loading_peaks_near_the_models_own_size(tmp_path: Path, stored: str, loaded: str) -> None:
    """A checkpoint whose two largest tensors (the untied embedding and head) are 32k x 512, loaded
    in another dtype: the process's peak above its start stays within 15% (+8 MiB) of the weights
    it keeps. Converting a whole tensor at a time adds up to two copies of the largest one."""
    if not Path("/proc/self/clear_refs").is_file():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak resident size")
    warm = _tiny(tmp_path / "warm", layers=1)
    path = save_llama(
        tmp_path,
        vocab_size=32768,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    _cast_checkpoint(Path(path), getattr(torch, stored))
    run = subprocess.run(
        [sys.executable, "-c", _PEAK, warm, path, loaded],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["resident"] > 60 << 20
    assert got["peak"] <= 1.15 * got["resident"] + (8 << 20), got


def test_one_conversion_per_gguf_content_wherever_the_file_lies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every checkout installs the embedded GGUF into its own environment: the same bytes at a new
    path reuse the conversion (the cache does not grow per install), different bytes get their own,
    and the folder names as its source a file that is there now, as it was when recorded."""
    monkeypatch.setenv("PREFILLONLY_CACHE", str(tmp_path / "cache"))
    converted: list[Path] = []

    def convert(_: Path, target: Path) -> None:
        target.mkdir(mode=0o700)
        (target / "config.json").write_text("{}")
        converted.append(target)

    monkeypatch.setattr(loader, "_convert", convert)
    first, second, other = (tmp_path / d / "m.gguf" for d in ("env1", "env2", "env3"))
    for path, body in ((first, b"GGUF same"), (second, b"GGUF same"), (other, b"GGUF other")):
        path.parent.mkdir()
        path.write_bytes(body)
    a = loader.converted_gguf_dir(first)
    assert loader.converted_gguf_dir(second) == a  # another path, the same content
    assert loader.converted_gguf_dir(first) == a  # again, from the remembered digest
    assert converted == [a]
    assert loader.converted_gguf_dir(other) != a
    assert len(converted) == 2
    assert loader._source_file(a) == first.resolve()  # the path that resolved it last
    first.unlink()  # that checkout is gone: the record no longer names a file
    assert loader._source_file(a) is None
    assert loader.converted_gguf_dir(second) == a
    assert loader._source_file(a) == second.resolve()
    second.write_bytes(b"GGUF edited")  # a record never names a file whose bytes changed since
    assert loader._source_file(a) is None
    before = list(converted)
    assert loader.converted_gguf_dir(second) not in before
    assert len(converted) == 3
