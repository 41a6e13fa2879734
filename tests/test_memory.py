"""The profile run's activation budget must bound what a forward really uses, and the pool plus
the largest forward, as measured, must fit the configured memory budget."""

from __future__ import annotations

import pytest
import torch

from po_backend import Engine, ScoreRequest
from po_backend.engine.memory import MEMORY_CACHE_ENV, PeakMemory
from tests.conftest import MID_LLAMA, save_llama


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_llama(tmp_path_factory.mktemp("mid"), **MID_LLAMA, max_position_embeddings=8192)


@pytest.mark.parametrize("chunk_size", [256, 0])
def test_measured_peak_within_activation_budget(
    mid_model: str, chunk_size: int, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The budget's profile measured in this process, like the peaks it must bound (the session's
    # shared profiles may hold one measured by another process).
    monkeypatch.setenv(MEMORY_CACHE_ENV, str(tmp_path))
    eng = Engine.from_pretrained(
        mid_model, dtype="fp32", max_input_len=6144, chunk_size=chunk_size, memory_budget=1 << 30
    )
    ids = tuple(int(t) for t in torch.randint(0, 4000, (6144,), generator=torch.Generator().manual_seed(0)))
    eng.run([ScoreRequest(ids[:256], (1,), cache_prefix_len=0)])  # warm-up; stores nothing
    pool = eng.cache.pool
    with PeakMemory(torch.device("cpu")) as whole:
        # Measured, not the arithmetic the pool was sized by: every page of the pool made resident
        # (torch.empty leaves them unmapped until written) plus the largest forward.
        pool.k.fill_(0)
        pool.v.fill_(0)
        eng.run([ScoreRequest(ids, (1,), cache_prefix_len=0)])
    print(f"pool resident + full-length forward: {whole.peak >> 20} MiB of {1 << 30 >> 20} MiB")
    assert whole.peak >= 0.9 * pool.nbytes, (whole.peak, pool.nbytes)  # the pool was really counted
    assert whole.peak <= 1 << 30, (whole.peak, eng.activation_budget, pool.nbytes)
    with PeakMemory(torch.device("cpu")) as pm:
        # A full-length request that also fills the pool with 6143 prefix tokens.
        eng.run([ScoreRequest(ids, (1,), cache_prefix_len=6143)])
    pool_written = 6143 * eng.cache.pool.bytes_per_slot(2, 2, 32, torch.float32)
    print(
        f"peak {pm.peak >> 20} MiB, pool written {pool_written >> 20} MiB, budget {eng.activation_budget >> 20} MiB"
    )
    assert pm.peak <= eng.activation_budget + pool_written, (pm.peak, eng.activation_budget)


def test_hybrid_chunking_lowers_activation_bound(mid_model: str) -> None:
    chunked = Engine.from_pretrained(
        mid_model, dtype="fp32", max_input_len=6144, chunk_size=256, enable_cache=False
    )
    whole = Engine.from_pretrained(
        mid_model, dtype="fp32", max_input_len=6144, chunk_size=0, enable_cache=False
    )
    assert chunked.activation_budget < whole.activation_budget


def test_profile_run_is_measured_once_and_reused(tiny_model, monkeypatch, tmp_path) -> None:
    """A later start reads the measured peaks instead of running the profile forwards again; what
    decides the peak (here the chunk size) is part of the key, and a damaged file is re-measured."""
    monkeypatch.setenv(MEMORY_CACHE_ENV, str(tmp_path))
    path, _ = tiny_model("llama")
    first = Engine.from_pretrained(path, dtype="fp32", max_input_len=256)
    assert len(list(tmp_path.glob("*.json"))) == 1

    def no_profile(self: Engine, n: int) -> int:
        raise AssertionError("profiled again")

    monkeypatch.setattr(Engine, "_profile", no_profile)
    again = Engine.from_pretrained(path, dtype="fp32", max_input_len=256)
    assert again.activation_budget == first.activation_budget

    calls: list[int] = []
    monkeypatch.setattr(Engine, "_profile", lambda self, n: calls.append(n) or 1 << 20)
    Engine.from_pretrained(path, dtype="fp32", max_input_len=256, chunk_size=64)
    assert calls == [128, 512]  # two short lengths, extrapolated to the longest forward
    assert len(list(tmp_path.glob("*.json"))) == 2

    for f in tmp_path.glob("*.json"):
        f.write_text("{")
    calls.clear()
    Engine.from_pretrained(path, dtype="fp32", max_input_len=256)
    assert calls == [128, 512]
