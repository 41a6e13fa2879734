"""The CUDA code paths, checked without a GPU: device resolution and its typed error, the default
dtype by compute capability, the memory budget from the CUDA allocator (torch.cuda mocked), and
the forward with CUDA's attention kernel on the `meta` device (shapes, no host syncs). What only
a GPU can show (numerics, measured memory, speed) is in tests/engine/test_cuda.py (`gpu` marker) and
`scripts/dev.sh gpu-check`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import transformers

from po_backend import DeviceUnavailableError, Engine
from po_backend.core.settings import CPU_HYBRID_CHUNK_SIZE, CUDA_CHUNK_SIZE, DEFAULT_CHUNK_SIZE
from po_backend.engine import attention, engine
from po_backend.engine.cache.kv_pool import KVPool
from po_backend.engine.config import ModelConfig, default_chunk_size, default_dtype, parse_dtype
from po_backend.engine.device import cuda_dtype, describe, resolve_device
from po_backend.engine.memory import MEMORY_CACHE_ENV, PeakMemory, available_bytes
from po_backend.engine.models import model_class
from po_backend.engine.runner import SeqPlan, make_runner
from tests.conftest import TINY_BASE
from tests.deps import require

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without CUDA gives")


def fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int, current: int = 0, capability=(9, 0)) -> None:
    """torch.cuda as on a machine with `count` GPUs of one compute capability."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)


# ---- which device ------------------------------------------------------------------------------


def test_auto_is_cuda_only_where_there_is_one(monkeypatch) -> None:
    fake_gpus(monkeypatch, 0)
    assert resolve_device(None) == resolve_device("auto") == torch.device("cpu")
    fake_gpus(monkeypatch, 2, current=1)
    assert resolve_device(None) == torch.device("cuda", 1)  # a bare "cuda" gets its index
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


def test_cuda_asked_but_absent_is_a_typed_error(monkeypatch) -> None:
    fake_gpus(monkeypatch, 0)
    with pytest.raises(DeviceUnavailableError, match="device='cuda' asks for CUDA.*use device=cpu"):
        resolve_device("cuda")
    fake_gpus(monkeypatch, 2)
    with pytest.raises(DeviceUnavailableError, match=r"2 visible CUDA device\(s\) \(cuda:0..cuda:1\)"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "xla", ""])
def test_unknown_device_names_are_refused(name: str) -> None:
    with pytest.raises(DeviceUnavailableError, match="device="):
        resolve_device(name)


def test_device_error_is_a_value_error() -> None:
    """Entry points that report ValueErrors as bad arguments (the settings' callers) keep doing so."""
    assert issubclass(DeviceUnavailableError, ValueError)


@no_gpu
def test_engine_with_cuda_fails_before_loading(tiny_model, monkeypatch) -> None:
    path, _ = tiny_model("llama")
    monkeypatch.setattr(engine, "load_model", lambda *a: pytest.fail("loaded weights for an absent device"))
    with pytest.raises(DeviceUnavailableError, match="CUDA"):
        Engine.from_pretrained(path, device="cuda")


@no_gpu
def test_server_with_cuda_exits_with_the_reason(tiny_model, capsys) -> None:
    require("uvicorn", "the server extras: pip install '.[server]'")
    from po_backend.entrypoints.launch_server import main

    path, _ = tiny_model("llama")
    with pytest.raises(SystemExit) as exc:
        main(["--model-path", str(path), "--device", "cuda"])
    assert exc.value.code == 2
    assert "device='cuda' asks for CUDA" in capsys.readouterr().err


# ---- which dtype -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capability", "want"),
    [((9, 0), torch.bfloat16), ((8, 0), torch.bfloat16), ((8, 9), torch.bfloat16), ((7, 5), torch.float16)],
)
def test_auto_dtype_on_cuda_by_compute_capability(monkeypatch, capability, want) -> None:
    fake_gpus(monkeypatch, 1, capability=capability)
    cuda = torch.device("cuda", 0)
    assert cuda_dtype(cuda) == want
    assert default_dtype(cuda) == want
    assert parse_dtype("auto", cuda) == parse_dtype(None, cuda) == want
    assert parse_dtype("fp32", cuda) == torch.float32  # an explicit dtype is kept


@pytest.mark.parametrize(("device", "want"), [("cpu", CPU_HYBRID_CHUNK_SIZE), ("cuda", CUDA_CHUNK_SIZE)])
def test_default_chunk_by_device(tiny_model, monkeypatch, device: str, want: int) -> None:
    """Unset, the hybrid chunk is the device's: longer on CUDA, where a small model is bound by
    the kernel launches of each chunk. An explicit one is kept."""
    fake_gpus(monkeypatch, 1)
    path, _ = tiny_model("llama")
    seen: dict[str, Any] = {}
    monkeypatch.setattr(engine, "load_model", lambda *a: None)  # no weights on the absent GPU
    monkeypatch.setattr(engine, "describe", str)  # nor its properties
    monkeypatch.setattr(Engine, "__init__", lambda self, model, tok, config, **kw: seen.update(config=config))
    Engine.from_pretrained(path, device=device)
    assert seen["config"].chunk_size == want == default_chunk_size(torch.device(device))
    Engine.from_pretrained(path, device=device, chunk_size=128)
    assert seen["config"].chunk_size == 128
    # The chunked baseline keeps Sarathi's chunk on a CPU.
    Engine.from_pretrained(path, device=device, prefill_mode="chunked")
    assert seen["config"].chunk_size == (DEFAULT_CHUNK_SIZE if device == "cpu" else CUDA_CHUNK_SIZE)


# ---- memory ------------------------------------------------------------------------------------


def test_cuda_budget_counts_the_allocators_cached_blocks(monkeypatch) -> None:
    """The driver counts blocks torch's allocator keeps for reuse as used; they are ours to fill."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (1000 << 20, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 700 << 20)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 300 << 20)
    assert available_bytes(cuda) == (1000 + 400) << 20
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 300 << 20)
    assert available_bytes(cuda) == 1000 << 20  # nothing cached


def test_peak_memory_on_cuda_reads_the_allocator(monkeypatch) -> None:
    state = {"allocated": 100, "peak": 100, "synced": 0}

    def reset(d=None) -> None:
        state["peak"] = state["allocated"]

    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda d=None: state.__setitem__("synced", state["synced"] + 1)
    )
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: state["peak"])
    state["peak"] = 10_000  # an earlier, larger peak must not count
    with PeakMemory("cuda:0") as pm:
        state["peak"] = 600  # the work's high-water mark
        state["allocated"] = 150
    assert pm.method == "cuda-allocator"
    assert pm.peak == 500  # above the level at entry
    assert state["synced"] == 2  # kernels in flight are finished before each reading


def test_engine_budget_on_cuda(tiny_model, monkeypatch, tmp_path) -> None:
    """The profile run on CUDA: the budget is 85% of what is available (cached blocks included),
    the activation share covers the measured full-length peak and the analytic bound with CUDA's
    attention fallback, and the pool takes the rest (the pool itself on `meta`, no GPU here)."""
    # Its own memory-profile cache: a measurement stored by an earlier CUDA case of the session
    # would otherwise answer for the profile run this test counts.
    monkeypatch.setenv(MEMORY_CACHE_ENV, str(tmp_path))
    path, _ = tiny_model("llama")
    eng = Engine.from_pretrained(path, device="cpu", dtype="bf16", max_input_len=256, max_batch_tokens=256)
    cuda = torch.device("cuda", 0)
    avail = 512 << 20
    seen: dict[str, Any] = {}
    monkeypatch.setattr(
        "po_backend.engine.memory.available_bytes", lambda d: seen.setdefault("avail", d) and avail
    )
    monkeypatch.setattr(Engine, "_profile", lambda self, n: seen.setdefault("profiled", n) and 3 << 20)

    class MetaPool(KVPool):
        def __init__(self, *args: Any) -> None:
            assert args[-1] == cuda, "the pool goes on the engine's device"
            super().__init__(*args[:-1], device="meta")

    monkeypatch.setattr(engine, "KVPool", MetaPool)
    eng.config = replace(eng.config, device=cuda, memory_budget=None, profile_full=True)
    eng.runner.device = cuda  # what its activation bound depends on (moving its tensors needs a GPU)
    eng._size_memory()
    assert seen == {"avail": cuda, "profiled": 256}  # full length, once
    mcfg = eng.model_config
    bound = eng.runner.activation_bound(256, prefix_tokens=256)
    eng.runner.device = torch.device("cpu")
    assert bound > eng.runner.activation_bound(256, prefix_tokens=256)  # CUDA's attention fallback
    assert eng.activation_budget == int(max(bound, 3 << 20) * 1.1)
    assert eng.cache is not None
    per_slot = KVPool.bytes_per_slot(mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim, torch.bfloat16)
    want = min((int(avail * 0.85) - eng.activation_budget) // per_slot, 64 * 256)
    assert eng.cache.pool.num_total == want


# ---- the forward with CUDA's attention, on meta --------------------------------------------------


@pytest.fixture()
def meta_model():
    cfg = ModelConfig.from_hf(transformers.LlamaConfig(**TINY_BASE).to_dict())
    with torch.device("meta"):
        model = model_class(cfg)(cfg, torch.bfloat16)
    return cfg, model


@pytest.mark.parametrize("mode", ["hybrid", "chunked"])
def test_forward_with_the_cuda_kernel_on_meta(meta_model, monkeypatch, mode) -> None:
    """Cold, cached-prefix and multi-item forwards with items over a prefix on CUDA's
    memory-efficient kernel (its meta implementation): every shape and dtype lines up, and the
    forward never reads a value back to the host (a meta tensor has none: `.item()` or
    `.tolist()` inside it would raise), so on a GPU it queues work without syncing."""
    cfg, model = meta_model
    meta = torch.device("meta")
    calls: list[tuple[int, ...]] = []

    def efficient(q, k, v, causal, scale):
        calls.append(tuple(q.shape))
        return attention.efficient_lse(q, k, v, causal, scale)

    monkeypatch.setattr(attention, "lse_attention", lambda d, t: efficient)
    pool = KVPool(cfg.num_layers, 100, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, meta)
    runner = make_runner(model, meta, 7, mode)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, cfg.vocab_size, (20,), generator=gen)
    slots = pool.alloc(20)
    assert slots is not None
    cold = runner.forward([SeqPlan(prefix, torch.tensor([3, 19]), store_slots=slots)], pool)
    # Hidden states come back in the residual stream's dtype (fp32 under bf16 weights by default).
    assert (cold.shape, cold.dtype, cold.device) == ((2, cfg.hidden_size), runner.resid_dtype, meta)
    items = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (5, 9, 3)]
    plans = [
        SeqPlan(it, torch.tensor([len(it) - 1]), start_pos=20, prefix_slots=slots, prefix_group=0)
        for it in items
    ]
    hidden = runner.forward(plans, pool)
    assert hidden.shape == (3, cfg.hidden_size)
    logits = model.final_logits(hidden)
    assert (logits.shape, logits.dtype) == ((3, cfg.vocab_size), torch.float32)
    if mode == "hybrid":
        # Per layer: the prefix once for all items' queries, then each item causally on itself.
        assert calls == [(17, cfg.num_heads, cfg.head_dim), (5,) + calls[0][1:], (9,) + calls[0][1:],
                         (3,) + calls[0][1:]] * cfg.num_layers  # fmt: skip
    else:
        assert calls == []  # the chunked baseline concatenates the prefix (SDPA with a mask)


def test_cuda_kernel_lse_is_trimmed_to_the_queries(monkeypatch) -> None:
    """The kernel pads the log-sum-exp's query axis to a multiple of 32; `efficient_lse` returns
    exactly one per query and head, whatever the padding."""
    q = torch.empty(45, 4, 16, device="meta", dtype=torch.float16)
    k = torch.empty(70, 2, 16, device="meta", dtype=torch.float16)
    out, lse = attention.efficient_lse(q, k, k, False, 0.25)
    assert tuple(out.shape) == (45, 4, 16) and tuple(lse.shape) == (45, 4)
    assert out.dtype == lse.dtype == torch.float32


def test_describe_names_the_gpu(monkeypatch) -> None:
    """Logs and the GPU check's report name the hardware a figure comes from."""
    fake_gpus(monkeypatch, 1, capability=(8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A10")

    class Props:
        total_memory = 24 << 30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: Props())
    assert describe(torch.device("cuda", 0)) == "cuda:0: NVIDIA A10 (compute capability 8.6, 24 GiB)"
    assert describe(torch.device("cpu")).startswith("cpu: ")
