"""Unrelated prompts in one forward: each attends only to itself, so a step of many gives each the
scores it gets alone and that transformers gives (fp32); the serving loop runs a burst of small
unrelated calls in few steps."""

from __future__ import annotations

import random

import pytest
import torch

from po_backend import Engine, ScoreRequest
from po_backend.serving.loop import EngineLoop
from tests.conftest import hf_next_logprobs

TOL = 1e-5
LABELS = (3, 17, 101, 250)


def _rand(n: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(300) for _ in range(n))


@pytest.fixture(scope="module")
def model(tiny_model):  # type: ignore[no-untyped-def]
    return tiny_model("llama")


def test_unrelated_prompts_in_one_forward_equal_each_alone_and_transformers(model) -> None:  # type: ignore[no-untyped-def]
    path, hf = model
    eng = Engine.from_pretrained(path, dtype="fp32", chunk_size=16, cache_policy="declared")
    # A cached prefix for two of them: cache hits beside cold prompts in the same forward.
    shared = _rand(40, 1)
    eng.run([ScoreRequest(shared + _rand(3, 2), LABELS, cache_prefix_len=40)])
    prompts = [_rand(n, 10 + n) for n in (1, 4, 9, 33, 70)] + [shared + _rand(5, 3), shared + _rand(12, 4)]
    reqs = [
        ScoreRequest(p, LABELS, top_k=3, cache_prefix_len=40 if p[:40] == shared else None) for p in prompts
    ]
    before = eng.stats().forwards
    together = eng.step(reqs)
    assert eng.stats().forwards == before + 1  # one forward for all seven
    assert [r.cached_tokens for r in together][-2:] == [40, 40]
    alone = [eng.step([r])[0] for r in reqs]
    for t, a, p in zip(together, alone, prompts, strict=True):
        want = hf_next_logprobs(hf, list(p))[list(LABELS)]
        assert torch.allclose(torch.tensor(t.logprobs, dtype=torch.float64), want.double(), atol=TOL)
        assert max(abs(x - y) for x, y in zip(t.logprobs, a.logprobs, strict=True)) <= TOL
        assert [i for i, _ in t.top_logprobs] == [i for i, _ in a.top_logprobs]
    eng.cache.check_integrity()  # type: ignore[union-attr]


def test_a_burst_of_small_unrelated_calls_runs_in_few_steps(model) -> None:  # type: ignore[no-untyped-def]
    """32 unrelated 4-token calls queued together: the loop fills steps with them (fcfs: no JCT
    model needed) instead of one step per call; every call gets its own answer."""
    path, _ = model
    eng = Engine.from_pretrained(path, dtype="fp32", chunk_size=16)
    reqs = [ScoreRequest(_rand(4, 100 + k), LABELS) for k in range(32)]
    alone = [eng.run([r])[0] for r in reqs]
    with EngineLoop(eng, policy="fcfs", start=False) as loop:
        futs = loop.submit_many(reqs)
        loop.start()
        got = [f.result(60.0) for f in futs]
        steps = len(loop.step_log())
    assert steps <= 8, steps
    for g, a in zip(got, alone, strict=True):
        assert max(abs(x - y) for x, y in zip(g.logprobs, a.logprobs, strict=True)) <= TOL
