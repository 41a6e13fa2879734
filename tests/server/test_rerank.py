"""Rerank and classification in the ecosystem's shapes, on a real server on loopback: the Cohere
SDK's `/v2/rerank`, vLLM/Jina's `/rerank`, SGLang's `/v1/rerank`, SGLang/vLLM's `/v1/classify`
`{model, input}` and vLLM's `/generative_scoring`. Expected numbers come from the in-process
engine (fp32) on the same weights and tokenizer; prompts are built here from the documented
formats, not from the server's code."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cohere
import httpx
import pytest

from po_backend import Engine
from po_backend.server import ServerArgs, Settings
from tests.server_utils import ServerProcess
from tests.tiny_tokenizer import tokenized_copy

pytestmark = pytest.mark.slow  # real servers in subprocesses

MAX_INPUT_LEN = 512
SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".'
)
DEFAULT_INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"
CLASSIFY_TEMPLATE = "Classify the post:\n{input}\nAnswer:"
QUERY = "which pets like to play"
DOCS = ["cats like to play with a ball", "tax news for the year", "dogs play in the park", "a cat video"]
# The words the prompts use, so the tiny BPE makes them (and "yes"/"no") single tokens.
CORPUS = [
    SYSTEM,
    "<Instruct>: <Query>: <Document>: " + DEFAULT_INSTRUCT,
    QUERY + " " + " ".join(DOCS),
    "yes no yes no Answer: yes Answer: no",
    "<|im_start|>system\n<|im_end|>\n<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\nyes",
    "<|im_start|>assistant\nno",
]


# The tiny BPE's alphabet here: printable ASCII and the newline.
ALPHABET = tuple(chr(c) for c in range(32, 127)) + ("\n",)


@pytest.fixture(scope="module")
def model_dir(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenized_copy(tiny_model("llama")[0], tmp_path_factory.mktemp("rerank"), CORPUS, ALPHABET)


@pytest.fixture(scope="module")
def url(model_dir: Path) -> Iterator[str]:
    flags = ["--model-path", str(model_dir), "--dtype", "fp32", "--max-input-len", str(MAX_INPUT_LEN)]
    flags += [
        "--served-model-name",
        "tiny",
        "--classify-labels",
        "yes,no",
        "--classify-template",
        CLASSIFY_TEMPLATE,
    ]
    proc = ServerProcess(flags).start()
    try:
        yield proc.wait_ready().url
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return Engine.from_pretrained(model_dir, dtype="fp32", max_input_len=MAX_INPUT_LEN)


def post(url: str, path: str, body: Any) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60.0)


def ok(resp: httpx.Response) -> Any:
    assert resp.status_code == 200, f"HTTP {resp.status_code}: {resp.text}"
    return resp.json()


def one_token(engine: Engine, text: str) -> int:
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, f"{text!r} is {ids}: the test tokenizer should make it one token"
    return int(ids[0])


def reranker_prompt(engine: Engine, query: str, doc: str, instruct: str = DEFAULT_INSTRUCT) -> str:
    """Qwen3-Reranker's turns in the model's chat template."""
    user = f"<Instruct>: {instruct}\n<Query>: {query}\n<Document>: {doc}"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return str(engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def expected_scores(
    engine: Engine, query: str, docs: list[str], instruct: str = DEFAULT_INSTRUCT
) -> list[float]:
    """P(yes) / (P(yes) + P(no)) after each document's prompt, one document at a time."""
    yes, no = one_token(engine, "yes"), one_token(engine, "no")
    out = []
    for d in docs:
        (r,) = engine.score([reranker_prompt(engine, query, d, instruct)], [yes, no])
        p_yes, p_no = math.exp(r.logprobs[0]), math.exp(r.logprobs[1])
        out.append(p_yes / (p_yes + p_no))
    return out


def steps(url: str) -> int:
    return int(ok(httpx.get(url + "/server_info"))["internal_states"][0]["steps"])


# ---- rerank ---------------------------------------------------------------------------------------


def test_cohere_sdk_rerank(url: str, engine: Engine) -> None:
    expected = expected_scores(engine, QUERY, DOCS)
    assert max(expected) - min(expected) > 1e-3, "random weights should tell the documents apart"
    client = cohere.ClientV2(base_url=url, api_key="x")
    resp = client.rerank(model="tiny", query=QUERY, documents=DOCS, top_n=3)
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])[:3]
    assert [r.index for r in resp.results] == order
    for r in resp.results:
        assert r.relevance_score == pytest.approx(expected[r.index], abs=1e-5)
    assert resp.id


def test_cohere_v1_client_rerank_gets_cohere_shape_on_sglang_route(url: str, engine: Engine) -> None:
    """Cohere's v1 client posts to /v1/rerank, SGLang's route: its SDK header gets Cohere's shape
    there, while SGLang's callers keep SGLang's list."""
    expected = expected_scores(engine, QUERY, DOCS)
    resp = cohere.Client(base_url=url, api_key="x").rerank(model="tiny", query=QUERY, documents=DOCS, top_n=2)
    assert [r.index for r in resp.results] == sorted(range(len(DOCS)), key=lambda i: -expected[i])[:2]
    for r in resp.results:
        assert r.relevance_score == pytest.approx(expected[r.index], abs=1e-5)
    assert isinstance(ok(post(url, "/v1/rerank", {"query": QUERY, "documents": DOCS})), list)


def test_jina_rerank_shape(url: str, engine: Engine) -> None:
    expected = expected_scores(engine, QUERY, DOCS)
    body = {"model": "tiny", "query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 0}
    out = ok(post(url, "/rerank", body))
    assert out["model"] == "tiny" and out["id"].startswith("rerank-")
    assert [r["index"] for r in out["results"]] == sorted(range(len(DOCS)), key=lambda i: -expected[i])
    for r in out["results"]:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-5)
        assert r["document"] == {"text": DOCS[r["index"]]}
    ids = [engine.tokenizer.encode(reranker_prompt(engine, QUERY, d)) for d in DOCS]
    assert out["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    out = ok(post(url, "/v2/rerank", {**body, "return_documents": False, "top_n": 1}))
    assert len(out["results"]) == 1 and "document" not in out["results"][0]


def test_sglang_rerank_one_forward_on_the_cached_query(url: str, engine: Engine) -> None:
    """SGLang's list shape; the query part is computed once: a new query takes one multi-item
    forward (the first document computes it, the others read it from it), a known query one
    forward for all its documents."""
    instruct = "Find posts about pets"
    query = "pets that play"
    assert httpx.post(url + "/flush_cache").status_code == 200
    prefix_text = reranker_prompt(engine, query, "\0", instruct).split("\0")[0].rstrip()
    prefix = engine.tokenizer.encode(prefix_text)
    for d in DOCS:
        assert engine.tokenizer.encode(reranker_prompt(engine, query, d, instruct))[: len(prefix)] == prefix

    before = steps(url)
    body = {"query": query, "documents": DOCS, "instruct": instruct}
    out = ok(post(url, "/v1/rerank", body))
    assert steps(url) - before == 1
    expected = expected_scores(engine, query, DOCS, instruct)
    assert [r["index"] for r in out] == sorted(range(len(DOCS)), key=lambda i: -expected[i])
    for r in out:
        assert r["score"] == pytest.approx(expected[r["index"]], abs=1e-5)
        assert r["document"] == DOCS[r["index"]]
    cached = sorted(r["meta_info"]["cached_tokens"] for r in out)
    assert cached == [0] + [len(prefix)] * (len(DOCS) - 1)

    before = steps(url)
    more = ["a dog video", "tax news"]
    out = ok(post(url, "/v1/rerank", {**body, "documents": more, "top_n": 1, "return_documents": False}))
    assert steps(url) - before == 1
    expected = expected_scores(engine, query, more, instruct)
    (r,) = out
    assert r["index"] == max(range(2), key=lambda i: expected[i]) and "document" not in r
    assert r["score"] == pytest.approx(expected[r["index"]], abs=1e-5)
    assert r["meta_info"]["cached_tokens"] == len(prefix)


def test_sglang_rerank_default_instruct_matches_cohere(url: str) -> None:
    a = ok(post(url, "/v1/rerank", {"query": QUERY, "documents": DOCS}))
    b = ok(post(url, "/rerank", {"query": QUERY, "documents": DOCS}))["results"]
    assert [r["index"] for r in a] == [r["index"] for r in b]
    # Equal up to fp32 rounding (one may read the query from the cache, the other compute it).
    assert [r["score"] for r in a] == pytest.approx([r["relevance_score"] for r in b], abs=1e-6)


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": " ", "documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": "q", "documents": ["a", ""]}, "non-empty"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ("/v1/rerank", {"query": "q", "documents": [[{"type": "image_url", "image_url": {}}]]}, "text"),
    ],
)
def test_rerank_bad_input_is_400(url: str, path: str, body: dict[str, Any], message: str) -> None:
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    assert message in r.text


def test_templates_are_checked_at_launch() -> None:
    engine_opts = Settings(model_path="m")
    for bad in ("{doc} {query}", "{query}", "{query} {doc} {doc}"):
        with pytest.raises(ValueError, match="rerank_template"):
            ServerArgs(engine=engine_opts, rerank_template=bad)
    with pytest.raises(ValueError, match="classify_labels"):
        ServerArgs(engine=engine_opts, classify_labels=("yes",))
    with pytest.raises(ValueError, match="classify_template"):
        ServerArgs(engine=engine_opts, classify_labels=("a", "b"), classify_template="no placeholder")


# ---- /v1/classify {model, input} and /generative_scoring ----------------------------------------


def test_classify_in_sglang_shape(url: str, engine: Engine) -> None:
    inputs = ["a cat video", "tax news for the year"]
    out = ok(post(url, "/v1/classify", {"model": "tiny", "input": inputs}))
    assert out["object"] == "list" and out["model"] == "tiny" and out["id"] and out["created"] > 0
    yes, no = one_token(engine, " yes"), one_token(engine, " no")
    tokens = 0
    for i, (d, text) in enumerate(zip(out["data"], inputs, strict=True)):
        ids = engine.tokenizer.encode(CLASSIFY_TEMPLATE.replace("{input}", text))
        tokens += len(ids)
        (r,) = engine.score([ids], [yes, no])
        z = math.exp(r.logprobs[0]) + math.exp(r.logprobs[1])
        probs = [math.exp(r.logprobs[0]) / z, math.exp(r.logprobs[1]) / z]
        assert d["index"] == i and d["num_classes"] == 2
        assert d["probs"] == pytest.approx(probs, abs=1e-5)
        assert d["label"] == ("yes" if probs[0] > probs[1] else "no")
    assert out["usage"]["prompt_tokens"] == tokens == out["usage"]["total_tokens"]
    single = ok(post(url, "/v1/classify", {"model": "tiny", "input": inputs[0]}))
    assert single["data"][0]["probs"] == pytest.approx(out["data"][0]["probs"], abs=1e-6)
    # Our label-program form: same path (told apart by its keys) and its own.
    ours = {"prompt": CLASSIFY_TEMPLATE.replace("{input}", inputs[0]), "labels": ["yes", "no"]}
    for path in ("/v1/classify", "/v1/classify_labels"):
        d = ok(post(url, path, ours))["data"][0]
        assert [d["probs"]["yes"], d["probs"]["no"]] == pytest.approx(out["data"][0]["probs"], abs=1e-6)
    r = post(url, "/v1/classify", {"input": 5})
    assert r.status_code == 400, r.text


def test_generative_scoring_in_vllm_shape(url: str, engine: Engine) -> None:
    tok = engine.tokenizer
    yes, no = one_token(engine, " yes"), one_token(engine, " no")
    query, items = "Classify the post:\n", ["a cat video\nAnswer:", "tax news\nAnswer:"]
    body = {"model": "tiny", "query": query, "items": items, "label_token_ids": [yes, no]}
    out = ok(post(url, "/generative_scoring", body))
    assert out["object"] == "list" and out["model"] == "tiny" and out["id"].startswith("generative-scoring-")
    full = ok(post(url, "/generative_scoring", {**body, "apply_softmax": False}))
    tokens = 0
    for i, item in enumerate(items):
        # vLLM joins token ids: the query with special tokens, the item without.
        ids = tok.encode(query) + tok.encode(item, add_special_tokens=False)
        tokens += len(ids)
        (r,) = engine.score([ids], [yes, no])
        p_yes, p_no = math.exp(r.logprobs[0]), math.exp(r.logprobs[1])
        assert out["data"][i] == {
            "index": i,
            "object": "score",
            "score": pytest.approx(p_yes / (p_yes + p_no), abs=1e-5),
        }
        assert full["data"][i]["score"] == pytest.approx(p_yes, abs=1e-6)
    assert out["usage"]["prompt_tokens"] == tokens
    r = post(url, "/generative_scoring", {**body, "label_token_ids": []})
    assert r.status_code == 400, r.text
