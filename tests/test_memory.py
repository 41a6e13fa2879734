"""The profile run's activation budget must bound what a forward really uses, and the pool plus
that budget must fit the configured memory budget."""

from __future__ import annotations

import pytest
import torch

from po_backend import Engine, ScoreRequest
from po_backend.memory import PeakMemory
from tests.conftest import save_llama


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_llama(
        tmp_path_factory.mktemp("mid"),
        vocab_size=4000,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )


@pytest.mark.parametrize("chunk_size", [256, 0])
def test_measured_peak_within_activation_budget(mid_model: str, chunk_size: int) -> None:
    eng = Engine.from_pretrained(
        mid_model, dtype="fp32", max_input_len=6144, chunk_size=chunk_size, memory_budget=1 << 30
    )
    assert eng.activation_budget + eng.cache.pool.nbytes <= 1 << 30
    ids = tuple(int(t) for t in torch.randint(0, 4000, (6144,), generator=torch.Generator().manual_seed(0)))
    eng.run([ScoreRequest(ids[:256], (1,))])  # warm-up
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
