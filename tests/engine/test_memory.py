"""The profile run's activation budget must bound what a forward really uses, and the pool plus
the largest forward, as measured, must fit the configured memory budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from po_backend import Engine
from po_backend.engine.memory import MEMORY_CACHE_ENV
from tests.conftest import MID_LLAMA, save_llama
from tests.memory_probe import in_fresh_process


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_llama(tmp_path_factory.mktemp("mid"), **MID_LLAMA, max_position_embeddings=8192)


@pytest.mark.parametrize("chunk_size", [256, 0])
def test_measured_peak_within_activation_budget(mid_model: str, chunk_size: int, tmp_path: Path) -> None:
    # Measured in a fresh interpreter, the budget's profile run included (tests/memory_probe.py):
    # in this worker the peak would also count what earlier tests left behind.
    got = in_fresh_process(
        "request_peak", tmp_path, model=mid_model, n=6144, prefix_len=6143, fill_pool=True,
        dtype="fp32", max_input_len=6144, chunk_size=chunk_size, memory_budget=1 << 30,
    )  # fmt: skip
    print(
        f"pool resident + full-length forward: {got['whole_peak'] >> 20} MiB of {1 << 30 >> 20} MiB; "
        f"peak {got['peak'] >> 20} MiB, pool written {got['pool_written'] >> 20} MiB, "
        f"budget {got['budget'] >> 20} MiB"
    )
    assert got["whole_peak"] >= 0.9 * got["pool_nbytes"], got  # the pool was really counted
    assert got["whole_peak"] <= 1 << 30, got
    # A full-length request that also fills the pool with 6143 prefix tokens.
    assert got["peak"] <= got["budget"] + got["pool_written"], got


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


def test_default_cpu_budget_does_not_follow_free_memory(monkeypatch) -> None:
    """Two processes given the same arguments on one machine size the same prefix pool: the CPU
    default is a quarter of the RAM, not of what happens to be free at start (unless less is)."""
    import torch

    import po_backend.engine.memory as memory

    cpu = torch.device("cpu")
    monkeypatch.setattr(memory, "total_bytes", lambda: 16 << 30)
    for free in (5 << 30, 9 << 30, 15 << 30):
        monkeypatch.setattr(memory, "available_bytes", lambda d, free=free: free)
        assert memory.default_budget(cpu) == 4 << 30
    monkeypatch.setattr(memory, "available_bytes", lambda d: 1 << 30)
    assert memory.default_budget(cpu) == 1 << 30
