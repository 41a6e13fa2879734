"""Embeddings from decoders against transformers' `last_hidden_state` on the same random weights:
last-token, mean and first-token pooling as sentence-transformers' config says (or as the flag
says), normalised or not, cold, over a cached shared instruction and as one multi-item forward."""

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

from po_backend import Engine
from tests.conftest import TINY_BASE, TINY_CONFIGS, randomize_
from tests.server_utils import error_message


def build_embedder(
    kind: str, root: Path, pooling: str | None, normalize: bool, name: str = ""
) -> tuple[Path, torch.nn.Module]:
    """A bare tiny decoder (`Qwen3Model`...) saved as sentence-transformers saves an embedder:
    weights without the `model.` prefix, modules.json, the pooling config (none: no modules.json)."""
    cls, base = TINY_CONFIGS[kind]
    cfg = cls(**{**TINY_BASE, **base})
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(cfg, dtype=torch.float32)
    randomize_(model, 2)
    path = root / (name or f"{kind}-{pooling}-{normalize}")
    model.save_pretrained(path)
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
        if normalize:
            modules.append(
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                }
            )
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        modes = {
            f"pooling_mode_{m}": m == pooling for m in ("cls_token", "mean_tokens", "lasttoken", "max_tokens")
        }
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    return path, model.eval()


def hf_embedding(model: torch.nn.Module, ids: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0].float()
    v = {"lasttoken": h[-1], "mean_tokens": h.mean(0), "cls_token": h[0]}[pooling]
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300) for _ in range(length)] for _ in range(n)]


def _delta(a: list[float], b: torch.Tensor) -> float:
    return float((torch.tensor(a) - b).abs().max())


CASES = [
    ("qwen3", "lasttoken", True),
    ("llama", "mean_tokens", False),
    ("qwen2", "mean_tokens", True),
    ("mistral", "cls_token", True),
]


@pytest.mark.parametrize(("kind", "pooling", "normalize"), CASES)
def test_embeddings_match_transformers(tmp_path: Path, kind: str, pooling: str, normalize: bool) -> None:
    path, hf = build_embedder(kind, tmp_path, pooling, normalize)
    engine = Engine.from_pretrained(path, dtype="fp32", chunk_size=16)
    assert engine.task.kind == "embed" and engine.task.normalize == normalize
    instruction = _prompts(1, 48, seed=1)[0]
    queries = [instruction + q for q in _prompts(4, 10, seed=2)]
    cold = engine.embed(queries[:1])
    forwards = engine.stats().forwards
    batch = engine.embed(queries, cache_prefix_len=len(instruction))  # shared instruction, one call
    again = engine.embed(queries[1:2], cache_prefix_len=len(instruction))  # after it is cached
    for ids, vec in zip([queries[0], *queries, queries[1]], [*cold, *batch, *again], strict=True):
        assert _delta(vec, hf_embedding(hf, ids, pooling, normalize)) <= 1e-4
    assert cold[0] == pytest.approx(batch[0], abs=1e-5) and again[0] == pytest.approx(batch[1], abs=1e-5)
    if pooling == "lasttoken":
        # The instruction is computed once: the multi-item forward reads it, then the cache does.
        assert engine.stats().forwards == forwards + 2
        assert engine.stats().cached_tokens >= 4 * len(instruction)


def test_mean_over_a_cached_prefix_equals_the_cold_answer(tmp_path: Path) -> None:
    path, _ = build_embedder("llama", tmp_path, "mean_tokens", True)
    engine = Engine.from_pretrained(path, dtype="fp32")
    prefix = _prompts(1, 30, seed=3)[0]
    ids = prefix + [1, 2, 3]
    cold = Engine.from_pretrained(path, dtype="fp32", enable_cache=False).embed([ids])[0]
    engine.embed([prefix + [9, 9]], cache_prefix_len=len(prefix))
    assert engine.embed([ids], cache_prefix_len=len(prefix))[0] == pytest.approx(cold, abs=1e-5)


def test_causal_lm_converted_to_an_embedder(tiny_model) -> None:
    """--task embed (vLLM's --convert embed) on a causal LM: last token, normalised."""
    path, hf = tiny_model("qwen2")
    engine = Engine.from_pretrained(path, dtype="fp32", task="embed")
    assert engine.model.lm_head is None  # an untied LM head is not kept for pooling
    (ids,) = _prompts(1, 25, seed=4)
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state[0, -1]
    assert _delta(engine.embed([ids])[0], torch.nn.functional.normalize(h, dim=0)) <= 1e-4
    mean = Engine.from_pretrained(path, dtype="fp32", task="embed", pooling="mean")
    with torch.no_grad():
        m = hf.model(torch.tensor([ids])).last_hidden_state[0].mean(0)
    assert _delta(mean.embed([ids])[0], torch.nn.functional.normalize(m, dim=0)) <= 1e-4


# ---- served: OpenAI's /v1/embeddings (the openai client, directly and through the router) --------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, torch.nn.Module, Any]]:
    from tests.server_utils import ServerProcess
    from tests.tiny_tokenizer import tokenized_copy

    root = tmp_path_factory.mktemp("served-embed")
    path, hf = build_embedder("qwen3", root, "lasttoken", True)
    tok_dir = tokenized_copy(path, root / "tok")
    flags = ["--model-path", str(tok_dir), "--dtype", "fp32", "--max-input-len", "256"]
    with ServerProcess([*flags, "--served-model-name", "tiny"]) as proc:
        yield proc.url, hf, transformers.AutoTokenizer.from_pretrained(tok_dir)


def _check_openai(base: str, hf: torch.nn.Module, tok: Any) -> None:
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    instruct = "Instruct: find posts about pets\nQuery: "
    texts = [instruct + "cats", instruct + "dogs in the park"]
    res = client.embeddings.create(model="tiny", input=texts)  # the client asks for base64
    assert res.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts)
    for text, item in zip(texts, res.data, strict=True):
        assert _delta(item.embedding, hf_embedding(hf, tok.encode(text), "lasttoken", True)) <= 1e-4
    ids = tok.encode(texts[0])
    for form in (texts[0], ids, [ids]):
        (item,) = client.embeddings.create(model="tiny", input=form, encoding_format="float").data
        assert _delta(item.embedding, hf_embedding(hf, ids, "lasttoken", True)) <= 1e-4
    (short,) = client.embeddings.create(model="tiny", input=texts[0], dimensions=16).data
    full = hf_embedding(hf, ids, "lasttoken", True)[:16]
    assert _delta(short.embedding, full / full.norm()) <= 1e-4 and len(short.embedding) == 16


@pytest.mark.slow
def test_openai_client_embeddings(served) -> None:
    url, hf, tok = served
    _check_openai(url, hf, tok)
    card = httpx.get(url + "/v1/models").json()["data"][0]
    assert card["task"] == "embed" and card["pooling"] == "last" and card["normalize"] is True
    for path, body in (
        ("/v1/classify", {"input": "x"}),
        ("/v1/score", {"query": "a", "items": ["b"], "label_token_ids": [1]}),
        ("/v1/rerank", {"query": "a", "documents": ["b"]}),
        ("/generate", {"text": "hello"}),
        ("/v1/embeddings", {"input": "x", "dimensions": 1000}),
    ):
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 400, (path, r.text)
        if path != "/v1/embeddings":
            assert "/v1/embeddings" in error_message(r), path


@pytest.mark.slow
def test_openai_client_embeddings_through_the_sglang_router(served) -> None:
    from tests.deps import require

    require("sglang_router", "pip install sglang-router")
    from tests.server.test_router import RouterProcess

    url, hf, tok = served
    router = RouterProcess([url], "cache_aware")
    try:
        _check_openai(router.wait_ready().url, hf, tok)
    finally:
        router.stop()


def test_sglang_encode_and_vllm_embed_score(tmp_path: Path) -> None:
    from po_backend.compat.sglang import Engine as SGLangEngine
    from po_backend.compat.vllm import LLM
    from tests.tiny_tokenizer import tokenized_copy

    path, hf = build_embedder("qwen3", tmp_path, "lasttoken", True)
    path = tokenized_copy(path, tmp_path / "tok")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    texts = ["Instruct: pets\nQuery: cats", "Instruct: pets\nQuery: dogs"]
    want = [hf_embedding(hf, tok.encode(t), "lasttoken", True) for t in texts]
    with SGLangEngine(model_path=str(path), dtype="fp32") as engine:
        outs = engine.encode(texts)
        assert isinstance(outs, list) and all(
            _delta(o["embedding"], w) <= 1e-4 for o, w in zip(outs, want, strict=True)
        )
    with LLM(str(path), dtype="fp32") as llm:
        assert all(
            _delta(o.outputs.embedding, w) <= 1e-4 for o, w in zip(llm.embed(texts), want, strict=True)
        )
        (s,) = llm.score(texts[0], texts[1])
        assert abs(s.outputs.score - float(want[0] @ want[1])) <= 1e-4
