"""Classifier, reranker and reward heads (`*ForSequenceClassification`) against transformers'
own classes on the same random weights: cold, over a cached prefix, and as one multi-item
forward; the task read from config.json and the errors for what a head model cannot answer."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import transformers

from po_backend import Engine, ScoreRequest
from po_backend.core.errors import InvalidRequestError, TaskMismatchError, UnsupportedModelError
from po_backend.core.task import detect_task, probabilities
from tests.conftest import TINY_BASE, TINY_CONFIGS, randomize_
from tests.server_utils import error_message

SEQ_CLS = ["llama", "qwen2", "qwen3", "mistral"]
PAD = 5


def build_classifier(
    kind: str, root: Path, num_labels: int = 3, **extra: object
) -> tuple[Path, torch.nn.Module]:
    """A tiny random `<Kind>ForSequenceClassification` saved with transformers."""
    cls, base = TINY_CONFIGS[kind]
    id2label = {i: f"class_{i}" for i in range(num_labels)}
    cfg = cls(
        **{**TINY_BASE, **base, "num_labels": num_labels, "id2label": id2label, "pad_token_id": PAD, **extra}
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
    randomize_(model, 1)
    path = root / f"{kind}-cls{num_labels}"
    model.save_pretrained(path)
    return path, model.eval()


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("cls")
    return {kind: build_classifier(kind, root) for kind in SEQ_CLS}


def hf_logits(model: torch.nn.Module, ids: list[int]) -> list[float]:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().tolist()


def _close(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _prompts(n: int, length: int, seed: int, vocab: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, vocab) for _ in range(length)] for _ in range(n)]


@pytest.mark.parametrize("kind", SEQ_CLS)
def test_head_matches_transformers_cold_cached_and_multi_item(classifiers, kind: str) -> None:
    path, hf = classifiers[kind]
    engine = Engine.from_pretrained(path, dtype="fp32", chunk_size=16)
    assert engine.task.kind == "classify" and engine.task.labels == ("class_0", "class_1", "class_2")
    cold = _prompts(3, 40, seed=1)
    for ids, res in zip(cold, engine.run([ScoreRequest(tuple(p), pool=True) for p in cold]), strict=True):
        assert _close(res.outputs, hf_logits(hf, ids)) <= 1e-4
        assert res.cached_tokens == 0 and res.logprobs == []

    # A shared instruction, then items: the first computes and caches it, the rest read it in one
    # multi-item forward; a later call reads it from the cache.
    prefix = _prompts(1, 50, seed=2)[0]
    items = [prefix + tail for tail in _prompts(4, 12, seed=3)]
    forwards = engine.stats().forwards
    first = engine.run([ScoreRequest(tuple(p), pool=True, cache_prefix_len=len(prefix)) for p in items])
    assert engine.stats().forwards == forwards + 1  # one multi-item forward
    again = engine.run([ScoreRequest(tuple(items[2]), pool=True, cache_prefix_len=len(prefix))])
    assert again[0].cached_tokens == len(prefix)
    for ids, res in zip([*items, items[2]], [*first, *again], strict=True):
        assert _close(res.outputs, hf_logits(hf, ids)) <= 1e-4


def test_long_batch_request_on_a_head_runs_in_prefix_steps(classifiers) -> None:
    """With batch steps sized to an online target, a long batch classify request computes its
    prompt over several pooled prefix steps (a head model has no LM head to run them as plain
    requests), none failing, and its answer is transformers' on the whole prompt."""
    from po_backend.sched.config import SchedulerConfig
    from po_backend.sched.jct import JCTModel
    from po_backend.serving.loop import EngineLoop

    path, hf = classifiers["llama"]
    engine = Engine.from_pretrained(path, dtype="fp32")
    ids = _prompts(1, 300, seed=4)[0]
    cfg = SchedulerConfig("po", enable_priority=True, online_slo_s=0.2)  # 100 tokens per step
    with EngineLoop(engine, scheduler=cfg, jct=JCTModel.proxy(seconds_per_ktok=1.0)) as loop:
        res = loop.submit(ScoreRequest(tuple(ids), pool=True, priority=-1)).result(60)
        steps = loop.step_log()
    assert not [s for s in steps if s.error], "a prefix step failed"
    assert len(steps) >= 3 and res.cached_tokens >= 200
    assert _close(res.outputs, hf_logits(hf, ids)) <= 1e-4


def test_trailing_pad_tokens_follow_transformers(classifiers) -> None:
    """transformers scores the last token that is not pad_token_id (the first when all are)."""
    path, hf = classifiers["qwen2"]
    engine = Engine.from_pretrained(path, dtype="fp32")
    (ids,) = _prompts(1, 20, seed=4)
    for prompt in (ids + [PAD, PAD], [PAD] * 4, ids[:5] + [PAD] + ids[5:9]):
        (res,) = engine.run([ScoreRequest(tuple(prompt), pool=True)])
        assert _close(res.outputs, hf_logits(hf, prompt)) <= 1e-4
        assert res.prompt_tokens == len(prompt)


def test_classify_probabilities_and_one_logit_reranker(tmp_path: Path) -> None:
    path, hf = build_classifier("qwen3", tmp_path, num_labels=1)
    engine = Engine.from_pretrained(path, dtype="fp32")
    assert engine.task.activation == "sigmoid"
    prompts = _prompts(2, 30, seed=5)
    for ids, probs in zip(prompts, engine.classify(prompts), strict=True):
        want = torch.sigmoid(torch.tensor(hf_logits(hf, ids))).tolist()
        assert _close(probs, want) <= 1e-5
    multi, _ = build_classifier("llama", tmp_path, num_labels=4)
    e4 = Engine.from_pretrained(multi, dtype="fp32")
    (p,) = e4.classify(prompts[:1])
    assert e4.task.activation == "softmax" and abs(sum(p) - 1) < 1e-6
    assert probabilities(e4.task, [0.0, 0.0, 0.0, 0.0]) == [0.25] * 4


def test_head_model_refuses_label_scoring_and_lm_refuses_pooling(classifiers, tiny_model) -> None:
    engine = Engine.from_pretrained(classifiers["llama"][0], dtype="fp32")
    with pytest.raises(TaskMismatchError, match="/v1/classify"):
        engine.score([[7, 8, 9]], [1, 2])
    with pytest.raises(TaskMismatchError, match="pooled request"):
        engine.run([ScoreRequest((7, 8, 9), (1,), pool=True)])
    lm = Engine.from_pretrained(tiny_model("llama")[0], dtype="fp32")
    with pytest.raises(TaskMismatchError, match="/v1/completions"):
        lm.embed([[7, 8, 9]])


def test_task_detection_and_override(classifiers, tiny_model, tmp_path: Path) -> None:
    cls_path = classifiers["mistral"][0]
    cfg = json.loads((cls_path / "config.json").read_text())
    assert detect_task(cfg, cls_path).kind == "classify"
    assert detect_task(cfg, cls_path, "pooling").kind == "classify"
    assert detect_task(cfg, cls_path, "embed").kind == "embed"
    with pytest.raises(UnsupportedModelError, match="--task"):
        detect_task(cfg, cls_path, "generate")
    lm_cfg = json.loads((tiny_model("llama")[0] / "config.json").read_text())
    assert detect_task(lm_cfg, None).kind == "generate"
    with pytest.raises(UnsupportedModelError, match="ForSequenceClassification"):
        detect_task(lm_cfg, None, "classify")
    with pytest.raises(UnsupportedModelError, match="supported: .*--task"):
        detect_task({**lm_cfg, "architectures": ["LlamaForTokenClassification"]}, None)
    from po_backend.engine.hf_scorer import HFScorer

    with pytest.raises(UnsupportedModelError, match="backend prefillonly"):
        HFScorer.from_pretrained(cls_path)
    # The setting, and vLLM's / SGLang's names for it, reach the engine.
    engine = Engine.from_pretrained(cls_path, dtype="fp32", task="embed")
    assert engine.task.kind == "embed" and not hasattr(engine.model, "score")


def test_profile_budget_counts_the_head(classifiers) -> None:
    from po_backend.engine.outputs import pool_bytes

    engine = Engine.from_pretrained(classifiers["llama"][0], dtype="fp32", max_input_len=256)
    cfg = engine.model_config
    assert pool_bytes(cfg, engine.task, torch.float32, 256) >= 4 * 3 * cfg.hidden_size
    assert engine.activation_budget >= engine.runner.activation_bound(256, 256)


# ---- served: /v1/classify, /v1/score, /pooling, every rerank route, the 400s -------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A 3-class Qwen2 classifier and a one-logit Qwen3 reranker, each with the tiny tokenizer,
    served by real servers."""
    from tests.server_utils import ServerProcess
    from tests.tiny_tokenizer import tokenized_copy

    root = tmp_path_factory.mktemp("served-heads")
    out: dict[str, Any] = {}
    procs = []
    try:
        for name, kind, n in (("classifier", "qwen2", 3), ("reranker", "qwen3", 1)):
            path, hf = build_classifier(kind, root / name, num_labels=n)
            tok_dir = tokenized_copy(path, root / f"{name}-tok")
            flags = ["--model-path", str(tok_dir), "--dtype", "fp32", "--max-input-len", "256"]
            proc = ServerProcess([*flags, "--served-model-name", "tiny"]).start()
            procs.append(proc)
            out[name] = (proc, hf, transformers.AutoTokenizer.from_pretrained(tok_dir))
        for proc in procs:
            proc.wait_ready()
        yield {k: (p.url, hf, tok) for k, (p, hf, tok) in out.items()}
    finally:
        for proc in procs:
            proc.stop()


@pytest.mark.slow
def test_served_classifier(served) -> None:
    url, hf, tok = served["classifier"]
    texts = ["a cat video", "tax news for the year"]
    r = httpx.post(url + "/v1/classify", json={"model": "tiny", "input": texts}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
    for text, row in zip(texts, body["data"], strict=True):
        want = torch.softmax(torch.tensor(hf_logits(hf, tok.encode(text))), -1).tolist()
        assert _close(row["probs"], want) <= 1e-4 and row["num_classes"] == 3
        assert row["label"] == f"class_{max(range(3), key=lambda j: want[j])}"
    # Ours, with the model's labels in another order; other labels are a 400 naming id2label.
    labels = ["class_2", "class_0", "class_1"]
    r = httpx.post(url + "/v1/classify", json={"prompt": texts[0], "labels": labels}, timeout=60)
    want = torch.softmax(torch.tensor(hf_logits(hf, tok.encode(texts[0]))), -1).tolist()
    assert _close([r.json()["data"][0]["probs"][lb] for lb in labels], [want[2], want[0], want[1]]) <= 1e-4
    r = httpx.post(url + "/v1/classify", json={"prompt": texts[0], "labels": ["yes", "no"]}, timeout=60)
    assert r.status_code == 400 and "class_0" in error_message(r)
    # SGLang's /v1/score on a classifier: query + item through the head.
    r = httpx.post(url + "/v1/score", json={"query": "Post: ", "items": texts}, timeout=60)
    for text, scores in zip(texts, r.json()["scores"], strict=True):
        ids = tok.encode("Post: ") + tok.encode(text, add_special_tokens=False)
        assert _close(scores, torch.softmax(torch.tensor(hf_logits(hf, ids)), -1).tolist()) <= 1e-4
    # vLLM's /pooling: the raw logits, also base64.
    r = httpx.post(url + "/pooling", json={"input": [tok.encode(texts[1])]}, timeout=60)
    assert _close(r.json()["data"][0]["data"], hf_logits(hf, tok.encode(texts[1]))) <= 1e-4
    card = httpx.get(url + "/v1/models").json()["data"][0]
    assert card["task"] == "classify" and card["labels"] == ["class_0", "class_1", "class_2"]
    info = httpx.get(url + "/server_info").json()
    assert info["task"] == "classify" and httpx.get(url + "/model_info").json()["is_generation"] is False


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"input": "hello"}),
        ("/generate", {"text": "hello", "return_logprob": True, "top_logprobs_num": 2}),
        ("/v1/completions", {"prompt": "hello", "max_tokens": 1}),
        ("/generative_scoring", {"query": "q", "items": ["a"], "label_token_ids": [1, 2]}),
    ],
)
def test_served_classifier_refuses_what_it_cannot_answer(served, path: str, body: dict[str, Any]) -> None:
    url = served["classifier"][0]
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "'classify'" in error_message(r) and "/v1/classify" in error_message(r)


@pytest.mark.slow
def test_served_one_logit_reranker(served) -> None:
    import cohere

    url, hf, tok = served["reranker"]
    query, docs = "which pets like to play", ["cats like to play", "tax news", "dogs play in the park"]
    want = [
        torch.sigmoid(
            torch.tensor(hf_logits(hf, tok.encode(query) + tok.encode(d, add_special_tokens=False)))
        ).item()
        for d in docs
    ]
    client = cohere.ClientV2(base_url=url, api_key="x")
    res = client.rerank(model="tiny", query=query, documents=docs)
    assert sorted(r.index for r in res.results) == [0, 1, 2]
    for r in res.results:
        assert abs(r.relevance_score - want[r.index]) <= 1e-4
    assert [r.index for r in res.results] == sorted(range(3), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank"):
        r = httpx.post(url + path, json={"query": query, "documents": docs}, timeout=60)
        rows = r.json() if path == "/v1/rerank" else r.json()["results"]
        for row in rows:
            assert abs(row.get("relevance_score", row.get("score")) - want[row["index"]]) <= 1e-4


# ---- in process: SGLang's Engine, vLLM's LLM, the DSL -------------------------------------------


@pytest.fixture(scope="module")
def tokenized_classifier(
    classifiers, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, torch.nn.Module]:
    from tests.tiny_tokenizer import tokenized_copy

    path, hf = classifiers["llama"]
    return tokenized_copy(path, tmp_path_factory.mktemp("tok-cls")), hf


def test_sglang_and_vllm_compat_on_a_classifier(tokenized_classifier) -> None:
    from po_backend.compat.sglang import Engine as SGLangEngine
    from po_backend.compat.vllm import LLM

    path, hf = tokenized_classifier
    tok = transformers.AutoTokenizer.from_pretrained(path)
    texts = ["a cat video", "tax news for the year"]
    with SGLangEngine(model_path=str(path), dtype="fp32", is_embedding=True) as engine:
        out = engine.encode(texts[0])
        assert isinstance(out, dict) and _close(out["embedding"], hf_logits(hf, tok.encode(texts[0]))) <= 1e-4
        rows = engine.score(query="Post: ", items=texts)
        for text, row in zip(texts, rows, strict=True):
            ids = tok.encode("Post: " + text)  # SGLang joins the strings, then tokenizes
            assert _close(row, torch.softmax(torch.tensor(hf_logits(hf, ids)), -1).tolist()) <= 1e-4
    with LLM(str(path), dtype="fp32", runner="pooling") as llm:
        for text, o in zip(texts, llm.classify(texts), strict=True):
            want = torch.softmax(torch.tensor(hf_logits(hf, tok.encode(text))), -1).tolist()
            assert _close(o.outputs.probs, want) <= 1e-4 and o.prompt_token_ids == tok.encode(text)
        (raw,) = llm.encode(texts[:1])
        assert _close(raw.outputs.data, hf_logits(hf, tok.encode(texts[0]))) <= 1e-4
        (s,) = llm.score("Post: ", texts[1])
        ids = tok.encode("Post: ") + tok.encode(texts[1], add_special_tokens=False)
        assert abs(s.outputs.score - torch.softmax(torch.tensor(hf_logits(hf, ids)), -1)[-1].item()) <= 1e-5
        with pytest.raises(InvalidRequestError, match="classify"):
            llm.embed(texts)


def test_dsl_classify_on_a_classifier_head(tokenized_classifier) -> None:
    import po_lang as po
    from po_lang.errors import LabelError

    path, hf = tokenized_classifier
    backend = po.Local(str(path), dtype="fp32")
    try:
        labels = ["class_2", "class_0", "class_1"]

        @po.classify(labels=labels, backend=backend)
        def topic(post: str) -> po.Prompt:
            return po.shared("Classify the post:\n") + post

        r = topic("a cat video")
        ids = list(topic.compile("a cat video").prompt.ids)
        want = torch.softmax(torch.tensor(hf_logits(hf, ids)), -1).tolist()
        assert _close([r.probs[lb] for lb in labels], [want[2], want[0], want[1]]) <= 1e-4
        assert r.label == f"class_{max(range(3), key=lambda j: want[j])}"

        @po.classify(labels=["Yes", "No"], backend=backend)
        def wrong(post: str) -> po.Prompt:
            return post

        with pytest.raises(LabelError, match="id2label"):
            wrong("a cat video")
    finally:
        backend.close()


@pytest.mark.slow
def test_dsl_remote_on_a_served_classifier(served) -> None:
    import po_lang as po

    url, hf, tok = served["classifier"]
    backend = po.Remote(url)
    try:

        @po.classify(labels=["class_1", "class_0", "class_2"], backend=backend)
        def topic(post: str) -> po.Prompt:
            return po.shared("Classify the post:\n") + post

        r = topic("a cat video")
        want = torch.softmax(torch.tensor(hf_logits(hf, list(topic.compile("a cat video").prompt.ids))), -1)
        assert (
            _close([r.probs["class_1"], r.probs["class_0"], r.probs["class_2"]], want[[1, 0, 2]].tolist())
            <= 1e-4
        )
    finally:
        backend.close()
