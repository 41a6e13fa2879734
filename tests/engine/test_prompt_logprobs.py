"""Log-probs at prompt positions (SGLang's input_top_logprobs / input_token_ids_logprobs, OpenAI's
echo with logprobs), computed, never null, against transformers on the same weights (fp32)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from po_backend import Engine, ScoreRequest
from po_backend.engine.hf_scorer import HFScorer
from tests.conftest import hf_all_logprobs
from tests.deps import require
from tests.server_utils import ServerProcess

pytestmark = pytest.mark.slow  # real servers in subprocesses


TOP = 3
WATCH = (5, 17, 40)  # token ids whose log-probs are asked at every position
PROMPT = "User profile:\nlikes cats and dogs\nPost: a cat video\nAnswer:"


@pytest.fixture(scope="module")
def model_dir(tokenized_llama: Path) -> Path:
    return tokenized_llama


@pytest.fixture(scope="module")
def hf(tiny_model: Any) -> torch.nn.Module:
    return tiny_model("llama")[1]


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return Engine.from_pretrained(model_dir, dtype="fp32", max_input_len=256)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[str]:
    proc = ServerProcess(["--model-path", str(model_dir), "--dtype", "fp32", "--max-input-len", "256"])
    proc.start()
    try:
        proc.wait_ready()
        yield proc.url
    finally:
        proc.stop()


def _check_rows(ids: list[int], start: int, ref: torch.Tensor, top: list[Any], watched: list[Any]) -> None:
    """Rows for positions start+1..n-1 (each predicts ids[p] from ids[:p])."""
    assert len(top) == len(watched) == len(ids) - start - 1
    for row_top, row_ids, p in zip(top, watched, range(start + 1, len(ids)), strict=True):
        dist = ref[p - 1]
        values, best = dist.topk(TOP)
        assert [t for t, _ in row_top] == best.tolist()
        assert [v for _, v in row_top] == pytest.approx(values.tolist(), abs=1e-4)
        assert row_ids == pytest.approx(dist[list(WATCH)].tolist(), abs=1e-4)


@pytest.mark.parametrize("start", [0, 4])
def test_engine_and_baseline_match_transformers(engine: Engine, hf: torch.nn.Module, start: int) -> None:
    ids = list(range(3, 30))
    ref = hf_all_logprobs(hf, ids)
    req = ScoreRequest(tuple(ids), (7,), logprob_start_len=start, input_top_k=TOP, input_token_ids=WATCH)
    scorer = HFScorer(hf, engine.tokenizer, max_input_len=256)
    for res in (engine.run([req])[0], engine.run([req])[0], scorer.run([req])[0]):  # cold, cached, hf
        _check_rows(ids, start, ref, res.input_top_logprobs, res.input_token_ids_logprobs)
        assert len(res.input_token_logprobs) == len(ids) - start - 1


def test_generate_input_rows_are_computed(server: str, engine: Engine, hf: torch.nn.Module) -> None:
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 1},
        "return_logprob": True,
        "logprob_start_len": 2,
        "top_logprobs_num": TOP,
        "token_ids_logprob": list(WATCH),
    }
    r = httpx.post(server + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    ids = list(engine.tokenizer.encode(PROMPT))
    ref = hf_all_logprobs(hf, ids)
    # SGLang's lists start at logprob_start_len itself: the row of position p predicts ids[p].
    top = [[(e[1], e[0]) for e in row] for row in meta["input_top_logprobs"]]
    watched = [[e[0] for e in row] for row in meta["input_token_ids_logprobs"]]
    assert None not in top and len(top) == len(ids) - 2
    _check_rows(ids, 1, ref, top, watched)


def test_generate_first_position_has_no_distribution(server: str) -> None:
    body = {"text": PROMPT, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    meta = httpx.post(server + "/generate", json=body, timeout=60).json()["meta_info"]
    rows = meta["input_top_logprobs"]
    assert rows[0] is None and all(isinstance(row, list) and len(row) == 2 for row in rows[1:])


def test_top_logprobs_num_is_capped(server: str) -> None:
    body = {"text": PROMPT, "return_logprob": True, "top_logprobs_num": 49152}
    r = httpx.post(server + "/generate", json=body, timeout=60)
    assert r.status_code == 400 and "max-top-logprobs" in r.json()["error"]["message"]
    # Asked ids at every prompt position are bounded too (ids x positions values).
    body = {
        "input_ids": [5] * 200,
        "return_logprob": True,
        "logprob_start_len": 0,
        "token_ids_logprob": list(range(250)) * 30,
    }
    r = httpx.post(server + "/generate", json=body, timeout=60)
    assert r.status_code == 400 and "token_ids_logprob" in r.json()["error"]["message"]


def test_openai_echo_logprobs_with_the_real_client(server: str, engine: Engine, hf: torch.nn.Module) -> None:
    openai = require("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    for max_tokens in (0, 1):
        out = client.completions.create(
            model="m", prompt=PROMPT, max_tokens=max_tokens, echo=True, logprobs=TOP
        )
        lp = out.choices[0].logprobs
        ids = list(engine.tokenizer.encode(PROMPT))
        n = len(ids)
        assert lp.top_logprobs[0] is None and lp.token_logprobs[0] is None
        # lm-evaluation-harness reads every position after the context: no nulls there.
        assert all(isinstance(row, dict) and row for row in lp.top_logprobs[1:])
        assert len(lp.tokens) == n + max_tokens
        ref = hf_all_logprobs(hf, ids)
        for p in range(1, n):
            # OpenAI keys alternatives by token text, so two tokens that decode alike share a key:
            # check that each value is one of the reference top-k (or the token's own) log-probs.
            allowed = [*ref[p - 1].topk(TOP).values.tolist(), ref[p - 1, ids[p]].item()]
            got = list(lp.top_logprobs[p].values())
            assert max(got) == pytest.approx(allowed[0], abs=1e-4)
            assert all(min(abs(v - a) for a in allowed) < 1e-4 for v in got)
            assert lp.token_logprobs[p] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
