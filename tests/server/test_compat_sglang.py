"""SGLang's Python APIs on our engine in process: `po_backend.compat.sglang.Engine.score` against
transformers and against the server's /v1/score, and unmodified `@sgl.function` programs on
`PrefillOnlyBackend` against the same programs through SGLang's HTTP `RuntimeEndpoint`.
Tiny random-weight Llama with a tiny BPE tokenizer, fp32."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from po_backend import Engine as PoEngine
from po_backend.compat.local_runtime import LocalRuntime
from po_backend.compat.sglang import Engine
from po_backend.core.errors import EmptyPromptError, InvalidRequestError
from po_backend.core.settings import resolve
from po_backend.sched.jct import JCTModel
from tests.conftest import hf_next_logprobs
from tests.server.test_server import MAX_INPUT_LEN, POSTS, PROFILE  # the same prompts as the server tests
from tests.server_utils import ServerProcess, sglang_frontend

CHOICES = [" Yes", " No", " maybe so"]
REVIEWS = ["a cat video", "tax news", "a dog and a cat"]


@pytest.fixture(scope="module")
def model_dir(tokenized_llama: Path) -> Path:
    return tokenized_llama


@pytest.fixture(scope="module")
def hf(tiny_model) -> torch.nn.Module:
    return tiny_model("llama")[1]


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    # The JCT proxy skips the start-up profile (seconds) that Engine(model_path=...) runs once.
    po = PoEngine.from_pretrained(model_dir, dtype="fp32", max_input_len=MAX_INPUT_LEN)
    eng = Engine.from_engine(po, jct=JCTModel.proxy(1.0, 0.1))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[str]:
    proc = ServerProcess(
        ["--model-path", str(model_dir), "--dtype", "fp32", "--max-input-len", str(MAX_INPUT_LEN)]
    )
    with proc:
        yield proc.url


@pytest.fixture(scope="module")
def sgl() -> Any:
    return sglang_frontend()


def tok_id(engine: Engine, text: str) -> int:
    (t,) = engine.tokenizer.encode(text, add_special_tokens=False)
    return t


def hf_probs(hf: torch.nn.Module, ids: list[int], labels: list[int]) -> list[float]:
    return hf_next_logprobs(hf, ids)[labels].exp().tolist()


# ---- sglang.Engine.score ------------------------------------------------------------------------


def test_score_text_matches_transformers(engine: Engine, hf: torch.nn.Module) -> None:
    tok = engine.tokenizer
    labels = [tok_id(engine, " Yes"), tok_id(engine, " No"), 7]
    engine.flush_cache()
    before = engine.runtime.engine.stats()
    out = engine.score(query=PROFILE, items=POSTS, label_token_ids=labels)
    after = engine.runtime.engine.stats()
    assert isinstance(out, list) and out.scores == list(out) and len(out) == len(POSTS)
    for row, post in zip(out, POSTS, strict=True):
        # Plain string join, then full-vocabulary probabilities.
        assert row == pytest.approx(hf_probs(hf, tok.encode(PROFILE + post), labels), abs=1e-5)
    assert out.prompt_tokens == sum(len(tok.encode(PROFILE + p)) for p in POSTS)
    # The query is the cached prefix: the items after the first read it from the cache.
    assert after.cached_tokens - before.cached_tokens >= (len(POSTS) - 1) * (len(tok.encode(PROFILE)) - 1)
    assert after.forwards - before.forwards == 1  # one forward: the first item computes it, the rest read it

    soft = engine.score(
        query=PROFILE, items=POSTS[0], label_token_ids=labels, apply_softmax=True, temperature=0.5
    )
    lp = hf_next_logprobs(hf, tok.encode(PROFILE + POSTS[0]))[labels]
    assert soft[0] == pytest.approx(torch.softmax(lp / 0.5, -1).tolist(), abs=1e-5)
    assert math.fsum(soft[0]) == pytest.approx(1.0)


def test_score_token_ids_item_first_and_edges(engine: Engine, hf: torch.nn.Module) -> None:
    tok = engine.tokenizer
    q = tok.encode("Answer:", add_special_tokens=False)
    items = [tok.encode(p) for p in POSTS[:2]]
    labels = [tok_id(engine, " Yes"), tok_id(engine, " No")]
    out = engine.score(
        query=q, items=items, label_token_ids=labels, item_first=True, return_token_logprobs=True
    )
    for row, lps, it in zip(out, out.token_logprobs or [], items, strict=True):
        ref = hf_next_logprobs(hf, it + q)[labels]
        assert row == pytest.approx(ref.exp().tolist(), abs=1e-5)
        assert lps == pytest.approx(ref.tolist(), abs=1e-4)
    per_item = engine.score(query=items[0], items=[q, q[:1]], label_token_ids=[[labels[0]], [labels[1], 5]])
    assert [len(r) for r in per_item] == [1, 2]
    assert engine.score(query=PROFILE, items=[], label_token_ids=labels) == []
    for kwargs, message in [
        ({"items": POSTS, "label_token_ids": labels, "temperature": 2.0}, "requires apply_softmax"),
        ({"items": POSTS, "label_token_ids": [labels[0], labels[0]]}, "duplicate"),
        ({"items": POSTS, "label_token_ids": [10**6]}, "out of vocabulary"),
        ({"items": POSTS, "label_token_ids": [[1]]}, "one list per item"),
        ({"items": items, "label_token_ids": labels}, "Invalid combination"),
        ({"items": POSTS}, "label_token_ids is required"),
        ({"label_token_ids": labels}, "items must be provided"),
        ({"items": POSTS, "label_token_ids": labels, "score_extraction_token_id": 3}, "not supported"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.score(query=PROFILE, **kwargs)
    with pytest.raises(EmptyPromptError):
        engine.score(query="", items=[""], label_token_ids=labels)


def test_server_args_mapping() -> None:
    """SGLang's keywords map through core.settings.resolve, as the server's flags do (the
    table-driven comparison of every door is tests/server/test_settings.py)."""
    s = resolve(
        "embedded", dtype="float32", context_length=512, chunked_prefill_size=-1, log_level="error",
        disable_radix_cache=True, schedule_policy="lpm", max_queued_requests=8, tp_size=1,
    )  # fmt: skip
    assert (s.dtype, s.max_input_len, s.enable_cache) == ("float32", 512, False)
    assert s.chunk_size == 0  # SGLang's -1: no chunking, which is our chunk size 0
    assert (s.schedule_policy, s.max_queue) == ("lpm", 8)
    with pytest.raises(TypeError, match="unexpected keyword"):
        resolve("embedded", no_such_flag=1)
    with pytest.raises(ValueError, match="tp_size"):
        resolve("embedded", tp_size=2)
    with pytest.raises(ValueError, match="schedule_policy"):
        resolve("embedded", schedule_policy="random")
    assert resolve("embedded", schedule_policy="dfs-weight").schedule_policy == "lpm"


@pytest.mark.slow
def test_engine_from_model_path_and_server_score(model_dir: Path, server: str, engine: Engine) -> None:
    """`Engine(model_path=...)` as SGLang code writes it, and the same numbers as /v1/score."""
    labels = [tok_id(engine, " Yes"), tok_id(engine, " No")]
    with Engine(
        model_path=str(model_dir), dtype="float32", context_length=MAX_INPUT_LEN, log_level="error"
    ) as own:
        for softmax in (False, True):
            body = {"query": PROFILE, "items": POSTS, "label_token_ids": labels, "apply_softmax": softmax}
            resp = httpx.post(server + "/v1/score", json=body, timeout=60.0)
            assert resp.status_code == 200, resp.text
            ours = own.score(query=PROFILE, items=POSTS, label_token_ids=labels, apply_softmax=softmax)
            for a, b in zip(ours, resp.json()["scores"], strict=True):
                assert a == pytest.approx(b, abs=1e-5)
    assert own.runtime.loop.closed


# ---- the SGLang frontend in process -----------------------------------------------------------------


def _program(sgl: Any) -> Any:
    @sgl.function
    def engage(s: Any, post: str) -> None:
        s += PROFILE + f"Post: {post}\nWill the user engage? Answer:"
        s += sgl.select("answer", choices=CHOICES)
        s += "\nOne word:"
        s += sgl.gen("word", max_tokens=1)

    return engage


@pytest.mark.slow
def test_sgl_function_same_decisions_as_http(sgl: Any, engine: Engine, server: str) -> None:
    from po_backend.compat.sgl_backend import PrefillOnlyBackend

    program = _program(sgl)
    args = [{"post": p} for p in REVIEWS]
    remote = program.run_batch(args, backend=sgl.RuntimeEndpoint(server), num_threads=1)
    local_backend = PrefillOnlyBackend(engine)
    local = program.run_batch(args, backend=local_backend, num_threads=2)  # concurrent programs
    for r, loc in zip(remote, local, strict=True):
        assert loc["answer"] == r["answer"] and loc["word"] == r["word"]
        lm, rm = loc.get_meta_info("answer"), r.get_meta_info("answer")
        assert lm["normalized_prompt_logprobs"] == pytest.approx(rm["normalized_prompt_logprobs"], abs=1e-4)
        assert [[e[1] for e in row] for row in lm["input_token_logprobs"]] == [
            [e[1] for e in row] for row in rm["input_token_logprobs"]
        ]
    # set_default_backend: the program runs without naming a backend.
    sgl.set_default_backend(local_backend)
    state = program.run(post=REVIEWS[0])
    state.sync()  # the program's later gen runs on its own thread: let it end before the next test
    assert state["answer"] == remote[0]["answer"]
    local_backend.shutdown()  # shared engine: left running
    assert not engine.runtime.loop.closed


def test_select_is_one_multi_item_forward(sgl: Any, engine: Engine) -> None:
    from po_backend.compat.sgl_backend import PrefillOnlyBackend

    @sgl.function
    def pick(s: Any, post: str) -> None:
        s += PROFILE + f"Post: {post}\nWill the user engage? Answer:"
        s += sgl.select("answer", choices=CHOICES)

    backend = PrefillOnlyBackend(engine)
    stats = engine.runtime.engine.stats
    engine.flush_cache()
    f0 = stats().forwards
    cold = pick.run(post=REVIEWS[1], backend=backend)
    cold.sync()  # programs run on a thread of their own
    f1 = stats().forwards
    assert f1 - f0 == 1  # one forward: the first choice computes the prompt, the other N-1 read it
    warm = pick.run(post=REVIEWS[1], backend=backend)
    warm.sync()
    assert stats().forwards - f1 == 1  # the prompt is cached: all N choices in one forward
    last = engine.runtime.loop.step_log()[-1]
    assert len(last.items) == len(CHOICES) and all(cached > 0 for _, cached in last.items)
    assert warm["answer"] == cold["answer"]
    assert warm.get_meta_info("answer")["normalized_prompt_logprobs"] == pytest.approx(
        cold.get_meta_info("answer")["normalized_prompt_logprobs"], abs=1e-4
    )


def test_choices_methods_and_gen_limits(sgl: Any, engine: Engine, hf: torch.nn.Module) -> None:
    from sglang.lang.choices import greedy_token_selection, unconditional_likelihood_normalized

    from po_backend.compat.sgl_backend import PrefillOnlyBackend

    backend = PrefillOnlyBackend(engine)
    tok = engine.tokenizer
    text = PROFILE + "Post: a dog\nAnswer:"

    @sgl.function
    def with_method(s: Any, method: Any) -> None:
        s += text
        s += sgl.select("answer", choices=CHOICES, choices_method=method)

    uncond = with_method.run(method=unconditional_likelihood_normalized, backend=backend)
    meta = uncond.get_meta_info("answer")
    # Reference: each choice's conditional rows minus its tokens' log-probs on their own.
    ref = []
    for rows in meta["input_token_logprobs"]:
        ids = [r[1] for r in rows]
        alone = [0.0] + [float(hf_next_logprobs(hf, ids[:i])[ids[i]]) for i in range(1, len(ids))]
        ref.append(sum(r[0] - a for r, a in zip(rows, alone, strict=True)) / len(ids))
    assert meta["normalized_unconditional_prompt_logprobs"] == pytest.approx(ref, abs=1e-4)
    assert uncond["answer"] == CHOICES[max(range(len(CHOICES)), key=lambda i: ref[i])]
    greedy = with_method.run(method=greedy_token_selection, backend=backend)
    assert greedy["answer"] in CHOICES and "greedy_logprob_matrix" in greedy.get_meta_info("answer")

    @sgl.function
    def one_token(s: Any, tokens: int) -> None:
        s += text
        s += sgl.gen("word", max_tokens=tokens, return_logprob=True, top_logprobs_num=3)

    state = one_token.run(tokens=1, backend=backend)
    lp = hf_next_logprobs(hf, tok.encode(text))
    best = int(lp.argmax())
    assert state["word"] == tok.decode([best], skip_special_tokens=True)
    top = state.get_meta_info("word")["output_top_logprobs"][0]
    assert [e[1] for e in top] == lp.topk(3).indices.tolist()
    assert one_token.run(tokens=0, backend=backend)["word"] == ""
    with pytest.raises(InvalidRequestError, match="max_new_tokens must be 0 or 1"):
        backend.generate(type("S", (), {"text_": text, "images_": []})(), sgl_params(max_new_tokens=5))


def sgl_params(**kw: Any) -> Any:
    from sglang.lang.ir import SglSamplingParams

    return SglSamplingParams(**kw)


def test_runtime_needs_a_tokenizer(tiny_model) -> None:
    po = PoEngine.from_pretrained(tiny_model("llama")[0], dtype="fp32", max_input_len=64)
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        LocalRuntime.wrap(po, jct=JCTModel.proxy(1.0))
