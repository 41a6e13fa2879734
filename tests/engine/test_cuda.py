"""The engine's numerics on each device against transformers on the same device and weights
(tiny random configs, fp32): cold forwards, cache hits, multi-item batches over a shared prefix,
the auto dtype, and the memory budget measured with the device's own accounting (the CUDA
allocator's peak on a GPU). The `cuda` cases carry the `gpu` marker (skipped without CUDA, run by
`scripts/dev.sh gpu-check`); the `cpu` cases run everywhere, so the checks themselves are tested.
"""

from __future__ import annotations

import copy
import random

import httpx
import pytest
import torch

from po_backend import Engine, ScoreRequest
from po_backend.engine.config import default_dtype
from po_backend.engine.memory import PeakMemory
from tests.conftest import MID_LLAMA, TINY_CONFIGS, save_llama
from tests.server_utils import ServerProcess

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TOL = 1e-4  # fp32 against transformers
LABELS = (0, 7, 101, 299)


def _rand(n: int, seed: int, vocab: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def hf_on():
    """transformers' model of a tiny config on a device (a copy: the session's CPU model is shared)."""
    moved: dict[tuple[str, str], torch.nn.Module] = {}

    def get(model: torch.nn.Module, kind: str, device: str) -> torch.nn.Module:
        if (kind, device) not in moved:
            moved[kind, device] = copy.deepcopy(model).to(device)
        return moved[kind, device]

    return get


def _hf_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    dev = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=dev)).logits[0, -1].float()
    return torch.log_softmax(logits, -1).cpu()


def _assert_matches(results, prompts, hf, tol: float = TOL) -> None:
    for ids, res in zip(prompts, results, strict=True):
        ref = _hf_logprobs(hf, ids)
        worst = max(abs(a - b) for a, b in zip(res.logprobs, ref[list(LABELS)].tolist(), strict=True))
        assert worst <= tol, (len(ids), worst)
        assert [t for t, _ in res.top_logprobs] == ref.topk(len(res.top_logprobs)).indices.tolist()


def _req(ids: list[int], cache_len: int | None = None) -> ScoreRequest:
    return ScoreRequest(tuple(ids), LABELS, top_k=3, cache_prefix_len=cache_len)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_cold_matches_transformers(tiny_model, hf_on, device: str, kind: str) -> None:
    path, hf = tiny_model(kind)
    eng = Engine.from_pretrained(path, device=device, dtype="fp32", chunk_size=16, enable_cache=False)
    assert eng.config.device.type == device and eng.model.embed_tokens.device.type == device
    prompts = [_rand(n, n) for n in (1, 7, 40, 200)]
    results = eng.run([_req(p) for p in prompts])  # one packed forward of different lengths
    _assert_matches(results, prompts, hf_on(hf, kind, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["hybrid", "chunked"])
def test_cache_hits_match_transformers(tiny_model, hf_on, device: str, mode: str) -> None:
    path, hf = tiny_model("qwen2")
    eng = Engine.from_pretrained(
        path, device=device, dtype="fp32", chunk_size=32, cache_policy="declared", prefill_mode=mode
    )
    assert eng.cache is not None and eng.cache.pool.k.device.type == device
    prefix = _rand(120, 1)
    prompts = [prefix + _rand(30, s) for s in range(2, 6)]
    warm = [eng.run([_req(p, len(prefix))])[0] for p in prompts]
    assert [r.cached_tokens for r in warm] == [0, 120, 120, 120]
    _assert_matches(warm, prompts, hf_on(hf, "qwen2", device))
    eng.cache.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_multi_item_batch_matches_transformers(tiny_model, hf_on, device: str) -> None:
    """Items of two users in one forward: each user's first item computes the shared prefix, the
    others read its K/V in the same forward (partial attentions merged by log-sum-exp: CUDA's
    memory-efficient kernel on a GPU)."""
    path, hf = tiny_model("llama")
    eng = Engine.from_pretrained(path, device=device, dtype="fp32", chunk_size=16, cache_policy="declared")
    users = [_rand(100, 200 + u) for u in range(2)]
    prompts = [u + _rand(15 + 3 * i, 300 + 10 * k + i) for k, u in enumerate(users) for i in range(5)]
    results = eng.run([_req(p, 100) for p in prompts])
    assert eng.stats().forwards == 1
    assert [r.cached_tokens for r in results] == [0, 100, 100, 100, 100] * 2
    _assert_matches(results, prompts, hf_on(hf, "llama", device))


@pytest.mark.parametrize("device", DEVICES)
def test_auto_dtype_close_to_fp32(tiny_model, device: str) -> None:
    """--dtype auto (bf16 on a GPU of compute capability >= 8.0, fp16 below; the CPU's choice on
    a CPU) scores within low-precision distance of fp32, cold and from the cache."""
    path, _ = tiny_model("llama")
    auto = Engine.from_pretrained(path, device=device, chunk_size=16, cache_policy="declared")
    fp32 = Engine.from_pretrained(path, device=device, dtype="fp32", chunk_size=16, enable_cache=False)
    assert auto.config.dtype == default_dtype(auto.config.device)
    prefix = _rand(80, 9)
    reqs = [_req(prefix + _rand(20, s), 80) for s in range(3)]
    for a, b in zip(auto.run(reqs) + auto.run(reqs), fp32.run(reqs) * 2, strict=True):
        # bf16 keeps ~3 significant digits; the tiny random model has large logits.
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 0.5


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_llama(tmp_path_factory.mktemp("mid-cuda"), **MID_LLAMA, max_position_embeddings=4096)


@pytest.mark.parametrize("device", DEVICES)
def test_memory_budget_holds_when_measured(mid_model: str, device: str) -> None:
    """The pool plus the largest forward stay within the budget, measured by the device's own
    accounting (the CUDA allocator's peak on a GPU, the process RSS high-water mark on a CPU)."""
    budget = 256 << 20
    eng = Engine.from_pretrained(
        mid_model, device=device, dtype="fp32", max_input_len=2048, memory_budget=budget
    )
    assert eng.cache is not None
    pool = eng.cache.pool
    assert pool.nbytes + eng.activation_budget <= budget
    ids = tuple(int(t) for t in torch.randint(0, 4000, (2048,), generator=torch.Generator().manual_seed(0)))
    eng.run([ScoreRequest(ids[:256], (1,), cache_prefix_len=0)])  # warm-up; stores nothing
    with PeakMemory(eng.config.device) as pm:
        # A full-length request that also fills the pool with 2047 prefix tokens.
        eng.run([ScoreRequest(ids, (1,), cache_prefix_len=2047)])
    written = 2047 * pool.bytes_per_slot(2, 2, 32, torch.float32)
    print(
        f"{device}: peak {pm.peak >> 20} MiB ({pm.method}), activation budget {eng.activation_budget >> 20} MiB"
    )
    assert pm.peak <= eng.activation_budget + written, (pm.peak, eng.activation_budget)
    if device == "cuda":  # the allocator saw the forward's buffers (RSS on a CPU may not)
        assert pm.method == "cuda-allocator" and pm.peak > 0


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_server_matches_transformers(tokenized_llama, tiny_model, hf_on, device: str) -> None:
    """The HTTP server on the device, as launch_server starts it there: /generate's label
    log-probs, cold and then read from the prefix cache, equal transformers' on that device, and
    /server_info reports the device it resolved."""
    hf = hf_on(tiny_model("llama")[1], "llama", device)
    server = ServerProcess(["--model-path", str(tokenized_llama), "--device", device, "--dtype", "fp32"])
    prefix = _rand(120, 21)
    prompts = [prefix + _rand(25, s) for s in (22, 23, 24)]
    with server:
        info = httpx.get(server.url + "/server_info", timeout=30.0).json()
        assert str(info["device"]).startswith(device)
        cached = []
        for ids in prompts:
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                "return_logprob": True,
                "top_logprobs_num": 3,
                "token_ids_logprob": list(LABELS),
            }
            resp = httpx.post(server.url + "/generate", json=body, timeout=120.0)
            assert resp.status_code == 200, resp.text
            meta = resp.json()["meta_info"]
            cached.append(meta["cached_tokens"])
            ref = _hf_logprobs(hf, ids)
            (row,) = meta["output_token_ids_logprobs"]
            assert [e[1] for e in row] == list(LABELS)
            assert [e[0] for e in row] == pytest.approx(ref[list(LABELS)].tolist(), abs=TOL)
            (top,) = meta["output_top_logprobs"]
            assert [e[1] for e in top] == ref.topk(3).indices.tolist()
    assert cached[0] == 0 and min(cached[1:]) >= len(prefix) - 1, cached
