"""The runners on explicit prefix groups: hybrid and chunked agree with a plain forward over the
whole prompt, whatever the grouping (shared, split into runs, or a prefix of its own)."""

from __future__ import annotations

import pytest
import torch

from po_backend import Engine
from po_backend.engine import attention
from po_backend.engine.runner import ChunkedRunner, HybridRunner, SeqPlan, make_runner


def test_make_runner_picks_by_prefill_mode(tiny_model) -> None:
    path, _ = tiny_model("llama")
    engine = Engine.from_pretrained(path, dtype="fp32", enable_cache=False)
    cpu = torch.device("cpu")
    assert isinstance(make_runner(engine.model, cpu, 8, "hybrid"), HybridRunner)
    assert isinstance(make_runner(engine.model, cpu, 8, "chunked"), ChunkedRunner)
    assert isinstance(engine.runner, HybridRunner)
    with pytest.raises(ValueError, match="prefill_mode"):
        make_runner(engine.model, cpu, 8, "sarathi")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["hybrid", "chunked", "hybrid-torch-attention"])
def test_prefix_groups_are_explicit(tiny_model, mode: str, monkeypatch) -> None:
    if mode == "hybrid-torch-attention":
        # Items over a prefix as on a device without the CPU flash op (attention's plain-torch
        # partials merged by log-sum-exp: the path CUDA falls back to).
        monkeypatch.setattr(attention, "_CPU_FLASH", None)
        mode = "hybrid"
    path, _ = tiny_model("llama")
    engine = Engine.from_pretrained(path, dtype="fp32", chunk_size=7)
    assert engine.cache is not None
    pool = engine.cache.pool
    runner = make_runner(engine.model, torch.device("cpu"), 7, mode)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size
    prefix = torch.randint(0, vocab, (20,), generator=gen)
    slots = pool.alloc(20)
    assert slots is not None
    last = torch.tensor([19])
    runner.forward([SeqPlan(prefix, last, store_slots=slots)], pool)  # the prefix K/V into the pool
    items = [torch.randint(0, vocab, (n,), generator=gen) for n in (5, 9, 3, 12)]
    # Group 0 twice, then a prefix of its own (no group), then group 0 again (a second run), each
    # with its own copy of the slots: the runner must group on the id, not on tensor identity.
    groups = [0, 0, None, 0]
    plans = [
        SeqPlan(it, torch.tensor([len(it) - 1]), start_pos=20, prefix_slots=slots.clone(), prefix_group=g)
        for it, g in zip(items, groups, strict=True)
    ]
    hidden = runner.forward(plans, pool)
    for row, it in enumerate(items):
        whole = torch.cat([prefix, it])
        (ref,) = runner.forward([SeqPlan(whole, torch.tensor([len(whole) - 1]))])
        torch.testing.assert_close(hidden[row], ref, atol=1e-4, rtol=1e-4)


def test_hybrid_items_over_a_prefix_computed_in_the_same_forward(tiny_model) -> None:
    """HybridRunner writes every sequence's store_slots of a layer before that layer's attention,
    so items may read a prefix that a sequence of the SAME forward computes: a shared prefix and
    its items (multi-token labels over their prompt) in one forward. ChunkedRunner reads prefixes
    before it computes anything, so there the prefix must be cached by an earlier forward."""
    path, _ = tiny_model("llama")
    engine = Engine.from_pretrained(path, dtype="fp32", chunk_size=7)
    assert engine.cache is not None
    pool = engine.cache.pool
    runner = make_runner(engine.model, torch.device("cpu"), 7, "hybrid")
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, engine.vocab_size, (20,), generator=gen)
    items = [torch.randint(0, engine.vocab_size, (n,), generator=gen) for n in (4, 1, 9)]
    slots = pool.alloc(20)
    assert slots is not None
    producer = SeqPlan(prefix, torch.empty(0, dtype=torch.int64), store_slots=slots)
    plans = [producer] + [
        SeqPlan(it, torch.tensor([len(it) - 1]), start_pos=20, prefix_slots=slots, prefix_group=0)
        for it in items
    ]
    hidden = runner.forward(plans, pool)
    assert hidden.shape[0] == len(items)  # the producer asked for no logits
    for row, it in enumerate(items):
        whole = torch.cat([prefix, it])
        (ref,) = runner.forward([SeqPlan(whole, torch.tensor([len(whole) - 1]))])
        torch.testing.assert_close(hidden[row], ref, atol=1e-4, rtol=1e-4)


def test_items_get_their_own_bits_under_bf16_weights_on_a_cpu(tiny_model) -> None:
    """The runner asks attention for per-item prefix calls (`attend_items`' per_item) where the
    last bits matter, under bf16 weights, and keeps one call for all items in fp32."""
    path = tiny_model("llama")[0]
    assert Engine.from_pretrained(path, dtype="bf16").runner.items_alone
    assert not Engine.from_pretrained(path, dtype="fp32").runner.items_alone
