"""The prefix cache must never change an answer: hits, splits, evictions and multi-item batches
all equal a cold run (fp32, 1e-5)."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from po_backend import CapacityError, Engine, PromptTooLongError, ScoreRequest
from po_backend.engine.cache import CacheInUseError
from po_backend.engine.cache.kv_pool import KVPool
from tests.conftest import TINY_BASE, randomize_

TOL = 1e-5
LABELS = (3, 17, 101, 250)


def _rand(n: int, seed: int, vocab: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def engines(tiny_model):
    path, _ = tiny_model("qwen2")
    cold = Engine.from_pretrained(path, dtype="fp32", enable_cache=False, chunk_size=32)
    return path, cold


def _assert_same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) <= TOL
        assert [t for t, _ in x.top_logprobs] == [t for t, _ in y.top_logprobs]


def _req(ids: list[int], cache_len: int | None = None, **kw) -> ScoreRequest:
    return ScoreRequest(tuple(ids), LABELS, top_k=3, cache_prefix_len=cache_len, **kw)


def test_hit_equals_cold_run(engines) -> None:
    path, cold = engines
    eng = Engine.from_pretrained(path, dtype="fp32", chunk_size=32, cache_policy="declared")
    prefix = _rand(120, 1)
    prompts = [prefix + _rand(30, s) for s in range(2, 6)]
    warm = [eng.run([_req(p, len(prefix))])[0] for p in prompts]
    assert [r.cached_tokens for r in warm] == [0, 120, 120, 120]
    _assert_same(warm, cold.run([_req(p) for p in prompts]))
    eng.cache.check_integrity()
    assert eng.cache.protected_size() == 0


def test_partial_match_splits_node(engines) -> None:
    path, cold = engines
    eng = Engine.from_pretrained(path, dtype="fp32", chunk_size=32, cache_policy="declared")
    base = _rand(80, 7)
    first = base + _rand(10, 8)
    second = base[:50] + _rand(40, 9)  # shares only 50 tokens: the 80-token node splits
    r1 = eng.run([_req(first, 80)])[0]
    r2 = eng.run([_req(second, 0)])[0]
    assert (r1.cached_tokens, r2.cached_tokens) == (0, 50)
    _assert_same([r1, r2], cold.run([_req(first), _req(second)]))
    eng.cache.check_integrity()


def test_evictions_keep_answers_and_pool_bounds(engines, monkeypatch) -> None:
    path, cold = engines
    # The activation peak is measured as process RSS, which moves by pages between two engines;
    # here only the pool arithmetic matters, so the profile run gives the analytic bound each time.
    monkeypatch.setattr(Engine, "_profile", lambda self, n_tokens: 0)
    probe = Engine.from_pretrained(path, dtype="fp32", chunk_size=32, max_input_len=256, enable_cache=False)
    cfg = probe.model_config
    per_slot = KVPool.bytes_per_slot(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    budget = probe.activation_budget + 300 * per_slot  # room for two prefixes of 120 tokens only
    eng = Engine.from_pretrained(
        path, dtype="fp32", chunk_size=32, max_input_len=256, memory_budget=budget, cache_policy="declared"
    )
    assert eng.cache.pool.num_total == 300
    prompts = []
    for u in range(5):  # five users, two items each, round-robin twice: forces evictions
        prefix = _rand(120, 100 + u)
        for i in range(2):
            prompts.append(prefix + _rand(20, 1000 * u + i))
    results = []
    for p in prompts + prompts:
        results.append(eng.run([_req(p, 120)])[0])
        eng.cache.check_integrity()
    assert eng.cache.stats().evicted_tokens_total > 0
    assert any(r.cached_tokens == 120 for r in results)
    _assert_same(results, cold.run([_req(p) for p in prompts + prompts]))
    # Measured on the tensors the engine allocated, not its own accounting: 300 slots of K and V.
    pool = eng.cache.pool
    allocated = pool.k.untyped_storage().nbytes() + pool.v.untyped_storage().nbytes()
    assert allocated == 300 * per_slot and eng.activation_budget + allocated <= budget


def test_multi_item_batch_equals_one_by_one(engines) -> None:
    path, cold = engines
    eng = Engine.from_pretrained(path, dtype="fp32", chunk_size=16, cache_policy="declared")
    users = [_rand(100, 200 + u) for u in range(2)]
    reqs = [
        _req(u + _rand(15 + 3 * i, 300 + 10 * k + i), len(u)) for k, u in enumerate(users) for i in range(6)
    ]
    batched = eng.run(reqs)
    # One forward: each user's first item computes the user's prefix and stores it, the other 5
    # read it from that item in the same forward (the hybrid runner writes a layer's K/V before
    # that layer's attention).
    assert eng.stats().forwards == 1
    assert [r.cached_tokens for r in batched] == [0, 100, 100, 100, 100, 100] * 2
    _assert_same(batched, cold.run(reqs))
    _assert_same(batched, [eng.run([r])[0] for r in reqs])
    # The chunked baseline reads prefixes before computing anything: first items, then the rest.
    chunked = Engine.from_pretrained(
        path, dtype="fp32", chunk_size=16, cache_policy="declared", prefill_mode="chunked"
    )
    _assert_same(chunked.run(reqs), batched)
    assert chunked.stats().forwards == 2


def test_a_mate_without_pool_room_falls_back_to_one_forward_each(engines, monkeypatch) -> None:
    """The batch was priced with the items reading their prefix from the first item, but the pool
    has no room for that prefix: running them together would compute every prefix in one forward,
    past max_batch_tokens (the activation bound), so each runs alone; answers unchanged."""
    path, cold = engines
    monkeypatch.setattr(Engine, "_profile", lambda self, n_tokens: 0)
    probe = Engine.from_pretrained(
        path, dtype="fp32", chunk_size=32, max_input_len=256, max_batch_tokens=200, enable_cache=False
    )
    cfg = probe.model_config
    per_slot = KVPool.bytes_per_slot(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    eng = Engine.from_pretrained(
        path,
        dtype="fp32",
        chunk_size=32,
        max_input_len=256,
        max_batch_tokens=200,
        memory_budget=probe.activation_budget + 50 * per_slot,  # less than one 100-token prefix
        cache_policy="declared",
    )
    prefix = _rand(100, 77)
    reqs = [_req(prefix + _rand(15, 780 + i), len(prefix)) for i in range(4)]
    assert [i for i, _ in eng.batchable(reqs)] == [0, 1, 2, 3]  # 115 + 3 x 15 tokens, priced shared
    results = eng.run(reqs)
    assert eng.stats().forwards == 4 and all(r.cached_tokens == 0 for r in results)
    _assert_same(results, cold.run(reqs))
    eng.cache.check_integrity()
    assert eng.cache.protected_size() == 0 and eng.cache.pool.num_free == 50


def test_prompt_logprobs_not_served_from_cache(engines) -> None:
    """Prompt-token log-probs need hidden states the cache does not keep: the match is capped."""
    path, cold = engines
    eng = Engine.from_pretrained(path, dtype="fp32", chunk_size=16)
    ids = _rand(90, 42)
    eng.run([_req(ids)])  # policy all-but-last-k caches 89 tokens
    (res,) = eng.run([_req(ids, logprob_start_len=40)])
    (ref,) = cold.run([_req(ids, logprob_start_len=40)])
    assert res.cached_tokens == 40
    assert (
        max(abs(a - b) for a, b in zip(res.input_token_logprobs, ref.input_token_logprobs, strict=True))
        <= TOL
    )


def test_errors_leave_nothing_locked(engines, monkeypatch) -> None:
    path, _ = engines
    eng = Engine.from_pretrained(path, dtype="fp32", chunk_size=16, max_input_len=200)
    prefix = _rand(60, 5)
    eng.run([_req(prefix + [1, 2], 60)])
    with pytest.raises(PromptTooLongError, match="max_input_len=200"):
        eng.run([_req(prefix + [3], 60), _req(_rand(201, 6))])
    assert eng.stats().requests == 1  # validation rejected the call before any work

    def boom(*a, **k):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(eng.runner, "forward", boom)
    with pytest.raises(RuntimeError, match="injected"):
        eng.run([_req(prefix + [4, 5, 6], 62)])
    assert eng.cache.protected_size() == 0
    eng.cache.check_integrity()
    monkeypatch.undo()
    eng.flush_cache()
    assert eng.cache.stats().cached_tokens == 0


def test_flush_while_locked_is_refused(engines) -> None:
    path, _ = engines
    eng = Engine.from_pretrained(path, dtype="fp32")
    eng.run([_req(_rand(30, 1), 20)])
    m = eng.cache.match_prefix(_rand(30, 1))
    eng.cache.lock(m.node)
    with pytest.raises(CacheInUseError):
        eng.flush_cache()
    eng.cache.unlock(m.node)
    eng.flush_cache()


def test_start_fails_when_max_input_len_cannot_fit(engines) -> None:
    path, _ = engines
    with pytest.raises(CapacityError, match="memory_budget"):
        Engine.from_pretrained(path, dtype="fp32", max_input_len=1024, memory_budget=1 << 20)


def _windowed(root) -> str:
    """A tiny Mistral whose sliding window is shorter than the prompts: the windowed path."""
    cfg = transformers.MistralConfig(**{**TINY_BASE, "sliding_window": 24})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_(model, 0)
    model.save_pretrained(root / "mistral-window")
    return str(root / "mistral-window")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["qwen2", "windowed"])
def test_declared_prefix_hit_is_the_cold_run_bit_for_bit(tiny_model, tmp_path, kind: str, dtype: str) -> None:
    """A request that declares its prefix computes it as the requests that later find it cached
    read it, so a hit, a multi-item batch over it and a cold run agree: in bf16 to 1e-3 (0 on the
    CPUs measured: their bf16 matrix products give a row the same bits whatever the batch, and a
    different attention split's last-bit differences would otherwise grow through the layers into
    differences of 0.1), in fp32 to the usual tolerance; also on the sliding-window path."""
    path = tiny_model("qwen2")[0] if kind == "qwen2" else _windowed(tmp_path)
    eng = Engine.from_pretrained(path, dtype=dtype, chunk_size=32)
    prefix = _rand(70, 11)
    # enough items that a batch has more queries than one item (the kernels block them by count)
    prompts = [prefix + _rand(20 + 3 * s, 20 + s) for s in range(12)]
    cold = []
    for p in prompts:
        eng.flush_cache()
        cold += eng.run([_req(p, len(prefix))])
    eng.flush_cache()
    eng.run([_req(prefix, len(prefix))])
    one = [eng.run([_req(p, len(prefix))])[0] for p in prompts]
    many = eng.run([_req(p, len(prefix)) for p in prompts])
    assert all(r.cached_tokens == len(prefix) for r in one + many)
    tol = 1e-3 if dtype == "bf16" else TOL
    for got in (one, many):
        for r, c in zip(got, cold, strict=True):
            assert max(abs(x - y) for x, y in zip(r.logprobs, c.logprobs, strict=True)) <= tol


def test_cached_len_is_remembered_until_the_cache_changes_on_its_path(engines) -> None:
    """A waiting request is walked again only when a step stores or evicts on its path, and then
    gets the new answer; `cache_changes` names the prefixes of what moved."""
    path, _ = engines
    eng = Engine.from_pretrained(path, dtype="fp32", chunk_size=32, cache_policy="declared")
    a, b = _rand(64, 11), _rand(64, 12)
    wait_a, wait_b = _req(a + _rand(8, 13)), _req(b + _rand(8, 14))
    walks: list[tuple[int, ...]] = []
    match_len = eng.cache.match_len
    eng.cache.match_len = lambda ids: walks.append(tuple(ids)) or match_len(ids)  # type: ignore[method-assign]
    assert (eng.cached_len(wait_a), eng.cached_len(wait_b)) == (0, 0)
    assert eng.cache_changes() == []
    eng.step([_req(a + _rand(4, 15), len(a))])  # stores a's prefix
    changes = eng.cache_changes()
    assert changes and all(wait_a.input_ids[: len(p)] == p for p in changes)
    assert not any(wait_b.input_ids[: len(p)] == p for p in changes)
    walks.clear()
    assert (eng.cached_len(wait_a), eng.cached_len(wait_b)) == (64, 0)
    assert walks == [wait_a.input_ids[: wait_a.reusable_len]], (
        "only the request on the changed path is walked"
    )
    eng.flush_cache()
    assert eng.cache_changes() is None
    assert eng.cached_len(wait_a) == 0
