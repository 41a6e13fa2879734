"""The HTTP server with real clients (httpx, the openai package, SGLang's frontend, po_lang's
Remote) against real servers on loopback, each in a subprocess, on a tiny random-weight Llama with
a tiny BPE tokenizer. Expected answers come from the in-process engine on the same weights."""

from __future__ import annotations

import asyncio
import json
import math
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import po_lang as po
from po_backend import Engine, ScoreRequest
from po_backend.entrypoints.launch_server import build_parser, server_args, uvicorn_config
from tests.deps import require
from tests.server_utils import ServerProcess, error_message, metric, poll_until, sglang_frontend

pytestmark = pytest.mark.slow  # real servers in subprocesses


KEY = "sk-test-key"
MAX_INPUT_LEN = 256
PROFILE = "User profile:\nlikes cats and dogs\n"
POSTS = [
    "Post: a cat video\nWill the user engage? Answer:",
    "Post: a dog\nAnswer:",
    "Post: tax news\nAnswer:",
]


@pytest.fixture(scope="module")
def model_dir(tokenized_llama: Path) -> Path:
    return tokenized_llama


@pytest.fixture(scope="module")
def servers(model_dir: Path) -> Iterator[dict[str, ServerProcess]]:
    common = ["--model-path", str(model_dir), "--dtype", "fp32", "--max-input-len", str(MAX_INPUT_LEN)]
    procs = {
        "main": ServerProcess([*common, "--memory-budget", "64MiB", "--served-model-name", "tiny"]),
        "guarded": ServerProcess(
            [
                *common,
                "--api-key",
                KEY,
                "--max-queue",
                "2",
                "--max-body-bytes",
                "4096",
                "--log-level",
                "warning",
            ]
        ),
        "hf": ServerProcess([*common, "--backend", "hf", "--log-level", "warning"]),
    }
    for p in procs.values():
        p.start()  # boot in parallel
    try:
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def url(servers: dict[str, ServerProcess]) -> str:
    return servers["main"].url


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return Engine.from_pretrained(model_dir, dtype="fp32", max_input_len=MAX_INPUT_LEN)


def post(url: str, path: str, body: Any, headers: dict[str, str] | None = None, **kw: Any) -> httpx.Response:
    # ASCII-escaped JSON, as most clients send it: lone surrogates travel as "\ud800" escapes.
    headers = {"content-type": "application/json", **(headers or {})}
    return httpx.post(url + path, content=json.dumps(body).encode(), headers=headers, timeout=60.0, **kw)


def ok(resp: httpx.Response) -> Any:
    assert resp.status_code == 200, f"HTTP {resp.status_code}: {resp.text}"
    return resp.json()


def tok_id(engine: Engine, text: str) -> int:
    (t,) = engine.tokenizer.encode(text, add_special_tokens=False)
    return t


# ---- SGLang native /generate --------------------------------------------------------------------


def test_generate_single_with_logprobs(url: str, engine: Engine) -> None:
    text = PROFILE + POSTS[0]
    ids = engine.tokenizer.encode(text)
    yes, no = tok_id(engine, " Yes"), tok_id(engine, " No")
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
        "token_ids_logprob": [yes, no],
        "return_text_in_logprobs": True,
    }
    out = ok(post(url, "/generate", body))
    (ref,) = engine.run([ScoreRequest(tuple(ids), (yes, no), top_k=3, logprob_start_len=0)])
    meta = out["meta_info"]
    best = ref.top_logprobs[0][0]
    assert out["output_ids"] == [best] and out["text"] == engine.tokenizer.decode(
        [best], skip_special_tokens=True
    )
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 1
    assert meta["finish_reason"]["type"] in ("length", "stop") and "cached_tokens" in meta
    entries = meta["input_token_logprobs"]
    assert len(entries) == len(ids) and entries[0][:2] == [None, ids[0]]
    assert [e[1] for e in entries] == ids and all(isinstance(e[2], str) for e in entries)
    assert [e[0] for e in entries[1:]] == pytest.approx(ref.input_token_logprobs, abs=1e-4)
    (row,) = meta["output_token_ids_logprobs"]
    assert [e[1] for e in row] == [yes, no]
    assert [e[0] for e in row] == pytest.approx(ref.logprobs, abs=1e-4)
    (top,) = meta["output_top_logprobs"]
    assert [e[1] for e in top] == [t for t, _ in ref.top_logprobs]
    assert meta["output_token_logprobs"][0][:2] == [pytest.approx(ref.top_logprobs[0][1], abs=1e-4), best]


def test_generate_batch_with_prefix_extension(url: str, engine: Engine) -> None:
    """po_lang's Remote shape: input_ids batch, per-item lists, our cache_prefix_len."""
    prefix = engine.tokenizer.encode(PROFILE)
    rows = [prefix + engine.tokenizer.encode(p, add_special_tokens=False) for p in POSTS]
    yes, no = tok_id(engine, " Yes"), tok_id(engine, " No")
    body = {
        "input_ids": rows,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": [-1, -1, 5],
        "token_ids_logprob": [[yes, no]] * 3,
        "cache_prefix_len": [len(prefix)] * 3,
    }
    out = ok(post(url, "/generate", body))
    assert isinstance(out, list) and len(out) == 3
    refs = engine.run([ScoreRequest(tuple(r), (yes, no)) for r in rows])
    for o, ref in zip(out, refs, strict=True):
        assert o["text"] == "" and o["output_ids"] == [] and o["meta_info"]["completion_tokens"] == 0
        (row,) = o["meta_info"]["output_token_ids_logprobs"]
        assert [e[0] for e in row] == pytest.approx(ref.logprobs, abs=1e-4)
    # logprob_start_len=5: SGLang returns positions 5..n-1, the first being log P(ids[5] | ids[:5]).
    span = out[2]["meta_info"]["input_token_logprobs"]
    (ref,) = engine.run([ScoreRequest(tuple(rows[2]), (), logprob_start_len=4)])
    assert len(span) == len(rows[2]) - 5 and [e[1] for e in span] == rows[2][5:]
    assert [e[0] for e in span] == pytest.approx(ref.input_token_logprobs, abs=1e-4)
    # Sent again, the shared profile comes from the prefix cache.
    again = ok(post(url, "/generate", body))
    assert all(o["meta_info"]["cached_tokens"] >= len(prefix) - 1 for o in again[:2])


def test_po_lang_remote_equals_local(url: str, engine: Engine) -> None:
    remote, local = po.Remote(url), po.Local.from_engine(engine)

    def engage(backend: po.Backend) -> po.Classifier:
        @po.classify(labels=["Yes", "No"], backend=backend)
        def will_engage(profile: str, post: str) -> po.Prompt:
            return po.shared(f"User profile:\n{profile}\n") + f"Post: {post}\nWill the user engage? Answer:"

        return will_engage

    rows = [("likes cats", "a cat video"), ("likes cats", "a dog"), ("hates dogs", "a dog")]
    got, want = engage(remote).map(rows), engage(local).map(rows)
    for g, w in zip(got, want, strict=True):
        assert isinstance(g, po.Classification), g
        assert g.label == w.label and list(g.logprobs.values()) == pytest.approx(
            list(w.logprobs.values()), abs=1e-4
        )

    @po.classify(labels=["very good", "bad", "so so"], multi_token=True, backend=remote, chat=True)
    def rate(review: str) -> po.Prompt:
        return f"Review: {review}\nSentiment:"

    @po.classify(labels=["very good", "bad", "so so"], multi_token=True, backend=local, chat=True)
    def rate_local(review: str) -> po.Prompt:
        return f"Review: {review}\nSentiment:"

    g, w = rate("the movie was great."), rate_local("the movie was great.")
    assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
    remote.close()


def test_sglang_frontend_select_and_gen(url: str, engine: Engine) -> None:
    sgl = sglang_frontend()
    backend = sgl.RuntimeEndpoint(url)
    choices = [" Yes", " No", " maybe so"]

    @sgl.function
    def engage(s: Any, post: str) -> None:
        s += PROFILE + f"Post: {post}\nWill the user engage? Answer:"
        s += sgl.select("answer", choices=choices)
        s += "\nOne word:"
        s += sgl.gen("word", max_tokens=1)

    state = engage.run(post="a cat video", backend=backend)
    tok = engine.tokenizer

    # sgl.select's algorithm (RuntimeEndpoint.select + token_length_normalized) on the engine.
    text = PROFILE + "Post: a cat video\nWill the user engage? Answer:"
    start = max(len(tok.encode(text)) - 2, 0)
    norms = []
    for c in choices:
        ids = tok.encode(text + c)
        (ref,) = engine.run([ScoreRequest(tuple(ids), (), logprob_start_len=start - 1)])
        lps = list(ref.input_token_logprobs)
        if text.endswith(tok.decode([ids[start]])):
            lps = lps[1:]  # no token healing happened: drop the prompt's own last token
        norms.append(sum(lps) / len(lps))
    meta = state.get_meta_info("answer")
    assert meta["normalized_prompt_logprobs"] == pytest.approx(norms, abs=1e-4)
    assert state["answer"] == choices[max(range(len(choices)), key=lambda i: norms[i])]

    # sgl.gen(max_tokens=1): the most likely next token after everything so far.
    ids = tok.encode(text + state["answer"] + "\nOne word:")
    (ref,) = engine.run([ScoreRequest(tuple(ids), (), top_k=1)])
    assert state["word"] == tok.decode([ref.top_logprobs[0][0]], skip_special_tokens=True)


# ---- /v1/score ----------------------------------------------------------------------------------


def test_score_text_softmax_and_item_first(url: str, engine: Engine) -> None:
    yes, no = tok_id(engine, " Yes"), tok_id(engine, " No")
    tok = engine.tokenizer
    hits_before = metric(url, "po_cache_hit_tokens_total")
    out = ok(
        post(
            url,
            "/v1/score",
            {"query": PROFILE, "items": POSTS, "label_token_ids": [yes, no], "apply_softmax": True},
        )
    )
    assert out["object"] == "scoring" and len(out["scores"]) == len(POSTS)
    refs = engine.score([tok.encode(PROFILE + p) for p in POSTS], [yes, no])
    for s, ref in zip(out["scores"], refs, strict=True):
        z = [math.exp(x) for x in ref.logprobs]
        assert s == pytest.approx([x / sum(z) for x in z], abs=1e-4)
    assert out["usage"]["prompt_tokens"] == sum(r.prompt_tokens for r in refs)
    # The query is the shared prefix: items after the first read it from the cache.
    assert metric(url, "po_cache_hit_tokens_total") > hits_before

    raw = ok(
        post(
            url,
            "/v1/score",
            {
                "query": "Answer:",
                "items": ["Yes or no?\n", "Cats?\n"],
                "label_token_ids": [yes, no],
                "item_first": True,
            },
        )
    )
    refs = engine.score([tok.encode(x + "Answer:") for x in ["Yes or no?\n", "Cats?\n"]], [yes, no])
    for s, ref in zip(raw["scores"], refs, strict=True):
        assert s == pytest.approx([math.exp(x) for x in ref.logprobs], abs=1e-5)  # full-vocab probabilities


def test_score_token_ids(url: str, engine: Engine) -> None:
    q = engine.tokenizer.encode(PROFILE)
    items = [engine.tokenizer.encode(p, add_special_tokens=False) for p in POSTS]
    labels = [tok_id(engine, " Yes"), tok_id(engine, " No"), 7]
    out = ok(
        post(
            url, "/v1/score", {"query": q, "items": items, "label_token_ids": labels, "apply_softmax": False}
        )
    )
    refs = engine.score([q + it for it in items], labels)
    for s, ref in zip(out["scores"], refs, strict=True):
        assert s == pytest.approx([math.exp(x) for x in ref.logprobs], abs=1e-5)
    assert ok(post(url, "/v1/score", {"query": q, "items": [], "label_token_ids": labels}))["scores"] == []


# ---- OpenAI -------------------------------------------------------------------------------------


def test_openai_client_completions(url: str, engine: Engine) -> None:
    openai = require("openai")

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    prompt = PROFILE + POSTS[0]
    ids = engine.tokenizer.encode(prompt)
    (ref,) = engine.run([ScoreRequest(tuple(ids), (), top_k=5)])
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, logprobs=5)
    ch = r.choices[0]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1
    best = ref.top_logprobs[0][0]
    assert ch.text == engine.tokenizer.decode([best], skip_special_tokens=True)
    assert ch.logprobs.token_logprobs[0] == pytest.approx(ref.top_logprobs[0][1], abs=1e-4)
    want: dict[str, float] = {}
    for t, v in ref.top_logprobs:  # tokens that decode alike share a key: the likelier one's value
        want.setdefault(engine.tokenizer.decode([t]), v)
    assert ch.logprobs.top_logprobs[0] == pytest.approx(want, abs=1e-4)

    # logit_bias restricts the answer to the labels; log-probs renormalise over them.
    yes, no = tok_id(engine, " Yes"), tok_id(engine, " No")
    (lab,) = engine.run([ScoreRequest(tuple(ids), (yes, no))])
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=1, logprobs=2, logit_bias={str(yes): 100, str(no): 100}
    )
    top = r.choices[0].logprobs.top_logprobs[0]
    z = math.log(sum(math.exp(x) for x in lab.logprobs))
    assert top == pytest.approx({" Yes": lab.logprobs[0] - z, " No": lab.logprobs[1] - z}, abs=1e-4)
    assert r.choices[0].text == (" Yes" if lab.logprobs[0] > lab.logprobs[1] else " No")

    # echo + max_tokens=0: the prompt's own log-probs (the lm-eval loglikelihood pattern).
    (full,) = engine.run([ScoreRequest(tuple(ids), (), logprob_start_len=0)])
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, logprobs=0, echo=True)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == prompt and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(full.input_token_logprobs, abs=1e-4)

    with pytest.raises(openai.BadRequestError, match="prefill-only"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=5)


# ---- ours: /v1/classify, tokenizer endpoints, info, metrics ---------------------------------------


def test_classify_endpoint(url: str, engine: Engine) -> None:
    tok = engine.tokenizer
    out = ok(
        post(
            url,
            "/v1/classify",
            {
                "prompt": [PROFILE + p for p in POSTS],
                "labels": ["Yes", "No"],
                "shared_prefix_len": len(PROFILE),
            },
        )
    )
    yes, no = tok_id(engine, " Yes"), tok_id(engine, " No")
    for d, p in zip(out["data"], POSTS, strict=True):
        ids = tok.encode(PROFILE) + tok.encode(p, add_special_tokens=False)
        (ref,) = engine.score([ids], [yes, no])
        assert d["logprobs"] == pytest.approx(dict(zip(["Yes", "No"], ref.logprobs, strict=True)), abs=1e-4)
        assert sum(d["probs"].values()) == pytest.approx(1.0) and d["label_token_ids"] == [[yes], [no]]
    # Multi-token labels: each continuation's summed log-prob, as chained next-token scores.
    prompt = "Review: the movie was great.\nSentiment:"
    out = ok(post(url, "/v1/classify", {"prompt": prompt, "labels": ["very good", "bad"]}))
    (d,) = out["data"]
    ids = tok.encode(prompt)
    for label, cont in zip(["very good", "bad"], d["label_token_ids"], strict=True):
        steps = [engine.score([ids + cont[:k]], [cont[k]])[0].logprobs[0] for k in range(len(cont))]
        assert d["logprobs"][label] == pytest.approx(sum(steps), abs=1e-4)


def test_tokenizer_endpoints(url: str, engine: Engine) -> None:
    tok = engine.tokenizer
    out = ok(post(url, "/tokenize", {"prompt": "User profile:", "add_special_tokens": False}))
    assert out["tokens"] == tok.encode("User profile:", add_special_tokens=False) and out["count"] == len(
        out["tokens"]
    )
    assert out["max_model_len"] == MAX_INPUT_LEN
    assert ok(post(url, "/tokenize", {"text": "a"}))["tokens"] == tok.encode("a")
    assert ok(post(url, "/detokenize", {"tokens": out["tokens"]}))["text"] == "User profile:"
    msgs = [{"role": "user", "content": "hello"}]
    out = ok(post(url, "/apply_chat_template", {"messages": msgs, "add_generation_prompt": True}))
    assert out["text"] == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_info_health_flush_metrics(url: str, model_dir: Path) -> None:
    for path in ("/model_info", "/get_model_info"):
        info = ok(httpx.get(url + path))
        assert info["model_path"] == str(model_dir) and info["is_generation"] is True
    for path in ("/server_info", "/get_server_info"):
        info = ok(httpx.get(url + path))
        assert (
            info["backend"] == "prefillonly" and info["schedule_policy"] == "po" and "internal_states" in info
        )
        assert "api_key" not in info
    assert httpx.get(url + "/health").status_code == 200
    # POST only: a GET (what a cross-site page can make a browser send) must not flush.
    assert httpx.post(url + "/flush_cache").status_code == 200
    assert httpx.get(url + "/flush_cache").status_code == 405
    text = httpx.get(url + "/metrics").text
    for name in (
        "po_queue_length",
        "po_cache_hit_tokens_total",
        "po_prompt_tokens_per_second",
        "po_request_latency_seconds_bucket",
    ):
        assert name in text, name


def test_metrics_count_requests_per_endpoint(url: str) -> None:
    series = 'po_http_requests_total{endpoint="/generate",status="200"}'
    text = httpx.get(url + "/metrics", timeout=10.0).text
    before = metric(url, series) if series in text else 0.0
    ok(post(url, "/generate", {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 0}}))
    assert metric(url, series) == before + 1


def test_flags_map_onto_server_args() -> None:
    flags = ["--model-path", "m", "--dtype", "fp32", "--max-input-len", "300", "--disable-radix-cache"]
    flags += ["--schedule-policy", "lpm", "--fairness-lambda", "0.5", "--max-queue", "9"]
    flags += ["--min-shared-prefix", "64"]
    args = server_args(build_parser().parse_args([*flags, "--timeout-keep-alive", "7", "--api-key", "k"]))
    assert (args.engine.model_path, args.engine.dtype, args.engine.max_input_len) == ("m", "fp32", 300)
    assert args.engine.overrides() == {
        "dtype": "fp32",
        "max_input_len": 300,  # no chunk_size: unset, the engine takes its device's default
        "prefill_mode": "hybrid",
        "residual_dtype": "fp32",
        "enable_cache": False,
    }
    assert (args.scheduler.policy, args.scheduler.fairness_lambda, args.max_queue) == ("lpm", 0.5, 9)
    assert args.scheduler.min_shared_prefix == 64
    assert "api_key" not in args.public() and args.public()["schedule_policy"] == "lpm"
    # --timeout-keep-alive reaches uvicorn.
    assert uvicorn_config(object(), args).timeout_keep_alive == 7
    default = server_args(build_parser().parse_args(["--model-path", "m"]))
    assert default.scheduler.policy == "po" and default.engine.overrides().get("dtype") is None
    hf = server_args(build_parser().parse_args(["--model-path", "m", "--backend", "hf"]))
    assert hf.scheduler.policy == "fcfs"
    with pytest.raises(ValueError, match="FCFS only"):
        server_args(
            build_parser().parse_args(["--model-path", "m", "--backend", "hf", "--schedule-policy", "po"])
        )
    with pytest.raises(ValueError, match="max_queue"):
        server_args(build_parser().parse_args(["--model-path", "m", "--max-queue", "0"]))
    with pytest.raises(ValueError, match="min_shared_prefix"):
        server_args(build_parser().parse_args(["--model-path", "m", "--min-shared-prefix", "0"]))
    with pytest.raises(ValueError, match="timeout_keep_alive"):
        server_args(build_parser().parse_args(["--model-path", "m", "--timeout-keep-alive", "0"]))


# ---- bad input and load -------------------------------------------------------------------------

BAD = [
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}, "prefill-only"),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 1, "bogus_key": 1}},
        "unknown field 'sampling_params.bogus_key'",
    ),
    ("/generate", {"text": "hi", "background": True}, "background=true is not supported"),
    ("/generate", {"text": "a\ud800"}, "lone UTF-16 surrogate"),
    ("/generate", {"text": "hi", "rid": "\udfff"}, "lone UTF-16 surrogate"),
    ("/v1/completions", {"prompt": ["ok", "b\ud800"]}, "lone UTF-16 surrogate"),
    ("/tokenize", {"prompt": "\ud800"}, "lone UTF-16 surrogate"),
    ("/v1/score", {"query": "a", "items": ["\ud800"], "label_token_ids": [1]}, "lone UTF-16 surrogate"),
    ("/generate", {"input_ids": ["1", "2"]}, "input_ids"),
    ("/v1/classify", {"prompt": [[-1, 5]], "labels": ["a", "b"]}, "outside the vocabulary"),
    ("/v1/classify", {"prompt": [[2**40]], "labels": ["a", "b"]}, "outside the vocabulary"),
    ("/generate", {"input_ids": [True, 5]}, "input_ids"),
    ("/v1/score", {"query": [1, 2], "items": [[3]], "label_token_ids": [True]}, "label_token_ids"),
    ("/v1/completions", {"prompt": "hi", "return_hidden_states": True}, "return_hidden_states"),
    ("/generate", {"input_ids": [5] * (MAX_INPUT_LEN + 1)}, f"more than max_input_len={MAX_INPUT_LEN}"),
    ("/generate", {"input_ids": []}, "empty"),
    (
        "/generate",
        {"input_ids": [1, 2], "return_logprob": True, "token_ids_logprob": [10**6]},
        "outside the vocabulary",
    ),
    ("/generate", {"input_ids": [1, 10**6]}, "outside the vocabulary"),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "a|b"}}, "constrained decoding"),
    ("/v1/score", {"query": "a", "items": ["b"], "label_token_ids": [10**6]}, "outside the vocabulary"),
    ("/v1/score", {"query": "a", "items": ["b"], "label_token_ids": [1, 1]}, "duplicate"),
    (
        "/v1/score",
        {"query": "a", "items": ["b"], "label_token_ids": [1], "temperature": 2.0},
        "requires apply_softmax",
    ),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 16}, "prefill-only"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 100}}, "outside the vocabulary"),
    ("/v1/completions", {"prompt": ""}, "empty"),
    ("/generate", {"text": ["fine", ""]}, "empty"),
    ("/v1/classify", {"prompt": "x" * 2000, "labels": ["a", "b"]}, "max_input_len"),
]


@pytest.mark.parametrize(("path", "body", "message"), BAD, ids=[f"{p}:{m}" for p, _, m in BAD])
def test_bad_input_is_400(url: str, path: str, body: dict[str, Any], message: str) -> None:
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    assert message in error_message(r)
    # SGLang's shapes: flat on OpenAI-style routes, {"error": {"message"}} on native ones.
    if path.startswith("/v1/"):
        assert r.json()["object"] == "error" and r.json()["code"] == 400
    else:
        assert set(r.json()) == {"error"}


def test_unknown_top_level_keys_are_ignored(url: str) -> None:
    # What the SGLang router and client libraries add; SGLang and vLLM ignore unknown keys too.
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}, "bogus": 1, "cache_salt": "x"}
    assert ok(post(url, "/generate", body))["meta_info"]["prompt_tokens"] > 0
    assert ok(post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "top_k": 5, "bogus": 1}))[
        "choices"
    ]


def test_malformed_json_is_400(url: str) -> None:
    r = httpx.post(url + "/generate", content=b'{"text": "hi",', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in error_message(r)


def test_api_key_body_limit_and_overload(servers: dict[str, ServerProcess]) -> None:
    url = servers["guarded"].url
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 0}}
    assert post(url, "/generate", body).status_code == 401
    assert post(url, "/generate", body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url + "/health").status_code == 200  # open, for load balancers
    ok(post(url, "/generate", body, headers=auth))
    big = {"input_ids": [1] * 3000}
    r = post(url, "/generate", big, headers=auth)
    assert r.status_code == 413 and "larger than 4096" in error_message(r)
    # --max-queue 2: a batch of 5 prompts can never be queued: a 413 naming the flag, not a 503 that
    # clients and the router would retry forever.
    r = post(
        url,
        "/generate",
        {"input_ids": [[1, 5, 6]] * 5, "sampling_params": {"max_new_tokens": 0}},
        headers=auth,
    )
    assert r.status_code == 413 and "--max-queue 2" in error_message(r)


def test_thousand_concurrent_requests_all_answered(servers: dict[str, ServerProcess]) -> None:
    """1,000 requests in flight at once, each on its own connection. Sent as plain HTTP/1.1 over
    asyncio streams: an HTTP client library's per-request work cost more CPU than the server's
    answers, on the cores the server shares (the server is not the bottleneck here)."""
    port, n = servers["main"].port, 1000

    async def one(i: int) -> int:
        body = {"input_ids": [1, 5 + i % 50, 6, 7 + i % 13], "sampling_params": {"max_new_tokens": 1}}
        data = json.dumps(body).encode()
        head = f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(head.encode() + data)
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 120)  # to the end: the server closes
        finally:
            writer.close()
        status = answer.split(b"\r\n", 1)[0].split()  # b"HTTP/1.1 200 OK"
        return int(status[1]) if len(status) > 1 else 0

    async def main() -> list[int]:
        return await asyncio.gather(*(one(i) for i in range(n)))

    codes = asyncio.run(main())
    assert codes.count(200) == n, {c: codes.count(c) for c in set(codes)}


def test_client_disconnect_cancels_work(servers: dict[str, ServerProcess], engine: Engine) -> None:
    """The FCFS baseline runs one prompt at a time: 400 queued prompts take seconds. A client that
    leaves once they are queued must have most of them dropped, not run."""
    url = servers["hf"].url
    tok = engine.tokenizer
    items = [
        tok.encode(f"Post number {i}: " + "cats and dogs " * 40, add_special_tokens=False) for i in range(400)
    ]

    def prompts_run() -> int:
        return int(ok(httpx.get(url + "/server_info"))["internal_states"][0]["requests"])

    ran_before = prompts_run()
    body = json.dumps({"query": [1], "items": items, "label_token_ids": [5]}).encode()
    head = "POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", servers["hf"].port), timeout=30) as s:
        s.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        # The call is queued as a whole; leave once the server has it.
        poll_until(
            lambda: metric(url, "po_queue_length") > 0 or prompts_run() > ran_before, "the call is queued"
        )
    # The connection is closed: the server sees the disconnect and cancels what still waits.
    poll_until(lambda: metric(url, "po_queue_length") == 0, "the queue is empty again")
    assert metric(url, "po_cancelled_requests_total") > 100
    ran = prompts_run() - ran_before
    assert ran < 300, f"{ran} of 400 prompts ran after the client left"
    ok(post(url, "/generate", {"input_ids": [1, 5, 6]}))


def test_hf_backend_serves_the_same_answers(servers: dict[str, ServerProcess], engine: Engine) -> None:
    yes, no = tok_id(engine, " Yes"), tok_id(engine, " No")
    body = {
        "text": [PROFILE + p for p in POSTS],
        "sampling_params": {"max_new_tokens": 1},
        "return_logprob": True,
        "logprob_start_len": 3,
        "top_logprobs_num": 2,
        "token_ids_logprob": [yes, no],
    }
    a = ok(post(servers["main"].url, "/generate", body))
    b = ok(post(servers["hf"].url, "/generate", body))
    for x, y in zip(a, b, strict=True):
        assert x["output_ids"] == y["output_ids"]
        mx, my = x["meta_info"], y["meta_info"]
        for key in ("input_token_logprobs", "output_token_ids_logprobs", "output_top_logprobs"):
            assert _close(mx[key], my[key]), (key, mx[key], my[key])
    info = ok(httpx.get(servers["hf"].url + "/server_info"))
    assert info["backend"] == "hf" and info["schedule_policy"] == "fcfs"


def _close(a: Any, b: Any, tol: float = 1e-4) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tol
    return a == b


def test_vllm_tokenize_detokenize_and_model_card(url: str, engine: Engine) -> None:
    ids = list(engine.tokenizer.encode("a cat video"))
    for path in ("/tokenize", "/v1/tokenize"):
        out = ok(post(url, path, {"model": "tiny", "prompt": "a cat video"}))
        assert out["tokens"] == ids and out["count"] == len(ids) and out["max_model_len"] == MAX_INPUT_LEN
    assert ok(post(url, "/v1/detokenize", {"model": "tiny", "tokens": ids}))[
        "prompt"
    ] == engine.tokenizer.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "hi"}]
    r = post(url, "/v1/tokenize", {"messages": messages})
    if getattr(engine.tokenizer, "chat_template", None):
        text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ok(r)["tokens"] == engine.tokenizer.encode(text, add_special_tokens=False)
    else:
        assert r.status_code == 400 and "no chat template" in error_message(r)
    assert post(url, "/v1/tokenize", {"messages": messages, "prompt": "x"}).status_code == 400
    card = ok(httpx.get(url + "/v1/models/tiny"))
    assert card["id"] == "tiny" and card["object"] == "model"
    r = httpx.get(url + "/v1/models/other-model")
    assert r.status_code == 404 and r.json()["object"] == "error" and "other-model" in r.json()["message"]


def _families(url: str) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10.0).text)}


def test_sglang_metric_names_and_labels(url: str) -> None:
    """SGLang's Grafana dashboards query these series by name and `model_name`."""
    before = _families(url)
    ok(post(url, "/generate", {"text": PROFILE + POSTS[0], "sampling_params": {"max_new_tokens": 1}}))
    after = _families(url)
    kinds = {
        "sglang:prompt_tokens": "counter",
        "sglang:generation_tokens": "counter",
        "sglang:cached_tokens": "counter",
        "sglang:num_requests": "counter",
        "sglang:e2e_request_latency_seconds": "histogram",
        "sglang:time_to_first_token_seconds": "histogram",
        "sglang:num_queue_reqs": "gauge",
        "sglang:num_running_reqs": "gauge",
        "sglang:cache_hit_rate": "gauge",
        "sglang:token_usage": "gauge",
        "sglang:gen_throughput": "gauge",
    }
    for name, kind in kinds.items():
        fam = after[name]
        assert fam.type == kind, name
        assert all(s.labels.get("model_name") == "tiny" for s in fam.samples), name

    def total(fams: dict[str, Any], name: str, suffix: str = "_total") -> float:
        return sum(s.value for s in fams[name].samples if s.name == name + suffix)

    assert total(after, "sglang:num_requests") == total(before, "sglang:num_requests") + 1
    assert total(after, "sglang:generation_tokens") == total(before, "sglang:generation_tokens") + 1
    assert total(after, "sglang:prompt_tokens") > total(before, "sglang:prompt_tokens")
    e2e = "sglang:e2e_request_latency_seconds"
    assert total(after, e2e, "_count") == total(before, e2e, "_count") + 1


def test_api_key_edges_and_auth_failures_counted(servers: dict[str, ServerProcess]) -> None:
    url = servers["guarded"].url
    body = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 0}}
    assert httpx.get(url + "/health_generate").status_code == 401  # runs the model: needs the key
    assert httpx.get(url + "/health_generate", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    ok(post(url, "/generate", body, headers={"Authorization": f"bearer {KEY}"}))  # scheme: any case
    assert post(url, "/generate", body, headers={"Authorization": f"Basic {KEY}"}).status_code == 401
    before = metric(url, 'po_http_requests_total{endpoint="/generate",status="401"}', default=0.0)
    assert post(url, "/generate", body).status_code == 401
    assert metric(url, 'po_http_requests_total{endpoint="/generate",status="401"}') == before + 1
    assert (
        post(
            url, "/generate", {"input_ids": [1] * 3000}, headers={"Authorization": f"Bearer {KEY}"}
        ).status_code
        == 413
    )
    assert metric(url, 'po_http_requests_total{endpoint="/generate",status="413"}') >= 1
