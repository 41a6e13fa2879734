"""Reranker presets against their model cards' reference code: Qwen3-Reranker, bge-reranker-v2-gemma
and mxbai-rerank-v2. Each card's code is written out below as the card writes it (tokenising the
pieces apart and concatenating them); our server builds the prompts from its presets, so the token
ids must be equal, and the server's score (in process, fp32) must equal the reference's score on a
tiny random checkpoint of the same architecture. The references run one pair per forward: the
cards pad batches on the left, which moves a short pair's positions."""

from __future__ import annotations

import contextlib
import json
import string
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from fastapi.testclient import TestClient
from tokenizers import processors

from po_backend.entrypoints.launch_server import build_service
from po_backend.server import ServerArgs, Settings, create_app
from po_backend.server import rerank_presets as rp
from tests.conftest import TINY_BASE, randomize_
from tests.tiny_tokenizer import build_tokenizer

pytestmark = pytest.mark.slow  # loads engines

QUERY = "which pets like to play"
DOCS = ["cats like to play with a ball", "tax news for the year", "dogs play in the park {odd} braces"]
ALPHABET = tuple(string.printable)


# ---- the model cards' reference code ------------------------------------------------------------


def prepare_for_model(ids: list[int], pair_ids: list[int], max_length: int, **_: Any) -> dict[str, list[int]]:
    """`tokenizer.prepare_for_model(..., add_special_tokens=False)` of transformers 4 (gone from
    5's fast tokenizers): the pair concatenated; these prompts are far below its truncation."""
    assert len(ids) + len(pair_ids) <= max_length
    return {"input_ids": ids + pair_ids}


def qwen3_reference(tokenizer: Any, model: Any, query: str, docs: list[str], instruction: str | None):
    """Qwen/Qwen3-Reranker-0.6B's card (transformers usage)."""

    def format_instruction(instruction: str | None, query: str, doc: str) -> str:
        if instruction is None:
            instruction = "Given a web search query, retrieve relevant passages that answer the query"
        output = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}".format(  # noqa: UP032 (the card's code)
            instruction=instruction, query=query, doc=doc
        )
        return output

    token_false_id = tokenizer.convert_tokens_to_ids("no")
    token_true_id = tokenizer.convert_tokens_to_ids("yes")
    max_length = 8192
    prefix = '<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'  # noqa: E501
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    prefix_tokens = tokenizer.encode(prefix, add_special_tokens=False)
    suffix_tokens = tokenizer.encode(suffix, add_special_tokens=False)
    ids, scores = [], []
    for doc in docs:
        pairs = [format_instruction(instruction, query, doc)]
        inputs = tokenizer(
            pairs,
            padding=False,
            truncation="longest_first",
            return_attention_mask=False,
            max_length=max_length - len(prefix_tokens) - len(suffix_tokens),
        )
        for i, ele in enumerate(inputs["input_ids"]):
            inputs["input_ids"][i] = prefix_tokens + ele + suffix_tokens
        with torch.no_grad():
            batch_scores = model(torch.tensor(inputs["input_ids"])).logits[:, -1, :]
        true_vector = batch_scores[:, token_true_id]
        false_vector = batch_scores[:, token_false_id]
        batch_scores = torch.stack([false_vector, true_vector], dim=1)
        batch_scores = torch.nn.functional.log_softmax(batch_scores, dim=1)
        scores += batch_scores[:, 1].exp().tolist()
        ids.append(inputs["input_ids"][0])
    return ids, (token_true_id, token_false_id), scores


def bge_gemma_reference(tokenizer: Any, model: Any, query: str, docs: list[str], prompt: str | None):
    """BAAI/bge-reranker-v2-gemma's card (`get_inputs`, the "Yes" logit); FlagEmbedding's
    `normalize=True` maps it through a sigmoid."""

    def get_inputs(pairs, tokenizer, prompt=None, max_length=1024):
        if prompt is None:
            prompt = "Given a query A and a passage B, determine whether the passage contains an answer to the query by providing a prediction of either 'Yes' or 'No'."  # noqa: E501
        sep = "\n"
        prompt_inputs = tokenizer(prompt, return_tensors=None, add_special_tokens=False)["input_ids"]
        sep_inputs = tokenizer(sep, return_tensors=None, add_special_tokens=False)["input_ids"]
        inputs = []
        for query, passage in pairs:
            query_inputs = tokenizer(
                f"A: {query}",
                return_tensors=None,
                add_special_tokens=False,
                max_length=max_length * 3 // 4,
                truncation=True,
            )
            passage_inputs = tokenizer(
                f"B: {passage}",
                return_tensors=None,
                add_special_tokens=False,
                max_length=max_length,
                truncation=True,
            )
            item = prepare_for_model(
                [tokenizer.bos_token_id] + query_inputs["input_ids"],
                sep_inputs + passage_inputs["input_ids"],
                truncation="only_second",
                max_length=max_length,
                padding=False,
                return_attention_mask=False,
                return_token_type_ids=False,
                add_special_tokens=False,
            )
            item["input_ids"] = item["input_ids"] + sep_inputs + prompt_inputs
            item["attention_mask"] = [1] * len(item["input_ids"])
            inputs.append(item)
        return tokenizer.pad(
            inputs, padding=True, max_length=max_length + len(sep_inputs) + len(prompt_inputs), pad_to_multiple_of=8, return_tensors="pt"
        )  # fmt: skip

    yes_loc = tokenizer("Yes", add_special_tokens=False)["input_ids"][0]
    ids, scores = [], []
    for doc in docs:
        with torch.no_grad():
            inputs = get_inputs([[query, doc]], tokenizer, prompt)
            pair = inputs["input_ids"][inputs["attention_mask"].bool()][None]  # one pair, unpadded
            logits = model(input_ids=pair, return_dict=True).logits
            score = logits[:, -1, yes_loc].view(-1).float()
        scores.append(torch.sigmoid(score).item())
        ids.append(pair[0].tolist())
    return ids, (yes_loc,), scores


def mxbai_v2_reference(tokenizer: Any, model: Any, query: str, docs: list[str], instruction: str | None):
    """mixedbread-ai/mxbai-rerank (MxbaiRerankV2.prepare_inputs / forward): logit("1") - logit("0");
    the relevance probability is its sigmoid."""
    sep = "\n"
    instruction_prompt = "instruction: {instruction}"
    query_prompt = "query: {query}"
    doc_prompt = "document: {document}"
    task_prompt = "You are a search relevance expert who evaluates how well documents match search queries. For each query-document pair, carefully analyze the semantic relationship between them, then provide your binary relevance judgment (0 for not relevant, 1 for relevant).\nRelevance:"  # noqa: E501
    chat_template = {
        "prefix": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\n",  # noqa: E501
        "suffix": "<|im_end|>\n<|im_start|>assistant\n",
    }

    def get_input_ids(x):
        return tokenizer(x, return_tensors=None, add_special_tokens=False)["input_ids"]

    yes_loc = get_input_ids("1")[0]
    no_loc = get_input_ids("0")[0]
    task_prompt_inputs = get_input_ids(task_prompt)
    sep_inputs = get_input_ids(sep)
    prefix_inputs = get_input_ids(chat_template["prefix"])
    suffix_inputs = get_input_ids(chat_template["suffix"])
    max_length = 8192
    ids, scores = [], []
    for document in docs:
        instr = instruction_prompt.format(instruction=instruction) if instruction else None
        q = query_prompt.format(query=query)
        if instr:
            q = "".join([instr, sep, q])
        query_inputs = tokenizer(
            q, return_tensors=None, add_special_tokens=False, max_length=max_length * 3 // 4, truncation=True
        )
        document_inputs = tokenizer(doc_prompt.format(document=document), return_tensors=None, add_special_tokens=False, max_length=max_length, truncation=True)  # fmt: skip
        item = prepare_for_model(
            query_inputs["input_ids"],
            sep_inputs + document_inputs["input_ids"],
            truncation="only_second",
            max_length=max_length,
            padding=False,
            return_attention_mask=False,
            return_token_type_ids=False,
            add_special_tokens=False,
        )
        input_ids = prefix_inputs + item["input_ids"] + sep_inputs + task_prompt_inputs + suffix_inputs
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([input_ids])).logits
        score = logits[:, -1, yes_loc] - logits[:, -1, no_loc]
        scores.append(torch.sigmoid(score).item())
        ids.append(input_ids)
    return ids, (yes_loc, no_loc), scores


# ---- tiny checkpoints ----------------------------------------------------------------------------

GEMMA = (transformers.GemmaConfig, {"head_dim": 16, "tie_word_embeddings": True})
QWEN3 = (transformers.Qwen3Config, {"head_dim": 24})
QWEN2 = (transformers.Qwen2Config, {})


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any, Any]]:
    """One tiny checkpoint per preset, its folder named as the preset expects to be detected:
    Qwen3 by its folder's name, mxbai by `_name_or_path` in config.json, bge by neither."""
    root = tmp_path_factory.mktemp("presets")
    cache: dict[str, tuple[Path, Any, Any]] = {}

    def get(name: str) -> tuple[Path, Any, Any]:
        if name in cache:
            return cache[name]
        preset = rp.PRESETS[name]
        (cls, extra), folder, bos = {
            "qwen3-reranker": (QWEN3, "Qwen3-Reranker-tiny", False),
            "bge-reranker-v2-gemma": (GEMMA, "plain-gemma", True),
            "mxbai-rerank-v2": (QWEN2, "plain-qwen2", False),
        }[name]
        cfg = cls(**{**TINY_BASE, **extra})
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        randomize_(model, 0)
        if cls is transformers.GemmaConfig:  # (1 + w) norms: centre w on 0
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    if "norm" in pname:
                        p.sub_(1.0)
        path = root / folder
        model.save_pretrained(path)
        # Train the tiny BPE on the preset's own texts, so its words are tokens.
        corpus = [t for _, t in preset.pieces("say yes or no")] + [QUERY, *DOCS, "yes\nno\nYes\nNo\n1 0"] * 3
        tok = build_tokenizer(path, corpus, ALPHABET)
        if not bos:  # Qwen's tokenizers add no BOS
            tok._tokenizer.post_processor = processors.TemplateProcessing(single="$A", special_tokens=[])
            tok.bos_token = None
            tok.save_pretrained(path)
        else:  # bge's card pads (its batch of one is unpadded again before the forward)
            tok.pad_token = "<unk>"
            tok.save_pretrained(path)
        if name == "mxbai-rerank-v2":
            config = json.loads((path / "config.json").read_text())
            config["_name_or_path"] = "mixedbread-ai/mxbai-rerank-base-v2"
            (path / "config.json").write_text(json.dumps(config))
        tok = transformers.AutoTokenizer.from_pretrained(path)
        cache[name] = (path, model.eval(), tok)
        return cache[name]

    return get


REFERENCES = {
    "qwen3-reranker": qwen3_reference,
    "bge-reranker-v2-gemma": bge_gemma_reference,
    "mxbai-rerank-v2": mxbai_v2_reference,
}


def encoder(tok: Any) -> Callable[[str], list[int]]:
    return lambda s: tok.encode(s, add_special_tokens=False)


@pytest.mark.parametrize("instruct", [None, "Find posts about pets"])
@pytest.mark.parametrize("name", list(rp.PRESETS))
def test_preset_tokens_equal_the_model_cards(built: Any, name: str, instruct: str | None) -> None:
    _, model, tok = built(name)
    preset = rp.PRESETS[name]
    ref_ids, ref_answers, _ = REFERENCES[name](tok, model, QUERY, DOCS, instruct)
    assert rp.answer_ids(preset, tok) == ref_answers
    for doc, want in zip(DOCS, ref_ids, strict=True):
        got = rp.prompt_ids(preset, encoder(tok), tok.bos_token_id, instruct, QUERY, doc)
        assert list(got) == want
        head = rp.head_ids(preset, encoder(tok), tok.bos_token_id, instruct, QUERY)
        assert 0 < len(head) < len(got)  # a shared head to cache, short of the document


@contextlib.contextmanager
def serving(path: Path, **http: Any) -> Iterator[TestClient]:
    """The server's app in process, over the engine on `path` (fp32)."""
    args = ServerArgs(engine=Settings(model_path=str(path), dtype="fp32", max_input_len=512), **http)
    with TestClient(create_app(build_service(args), args)) as client:
        yield client


@pytest.mark.parametrize(
    ("name", "flag"),
    [
        ("qwen3-reranker", "auto"),
        ("bge-reranker-v2-gemma", "bge-reranker-v2-gemma"),
        ("mxbai-rerank-v2", "auto"),
    ],
)
def test_preset_scores_equal_the_model_cards(built: Any, name: str, flag: str) -> None:
    """Qwen3 is found by its folder's name, mxbai by its config's recorded name, bge by the flag."""
    path, model, tok = built(name)
    instruct = "Find posts about pets"
    with serving(path, rerank_preset=flag) as client:
        for body, want_instruct in (({}, None), ({"instruct": instruct}, instruct)):
            resp = client.post("/rerank", json={"query": QUERY, "documents": DOCS, **body})
            assert resp.status_code == 200, resp.text
            ref_ids, _, ref_scores = REFERENCES[name](tok, model, QUERY, DOCS, want_instruct)
            got = {r["index"]: r["relevance_score"] for r in resp.json()["results"]}
            for i, want in enumerate(ref_scores):
                assert got[i] == pytest.approx(want, abs=1e-5), (i, got[i], want)
            assert resp.json()["usage"]["prompt_tokens"] == sum(map(len, ref_ids))
        # SGLang's shape ranks by the same scores.
        resp = client.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})
        assert resp.status_code == 200, resp.text
        _, _, ref_scores = REFERENCES[name](tok, model, QUERY, DOCS, None)
        for item in resp.json():
            assert item["score"] == pytest.approx(ref_scores[item["index"]], abs=1e-5)


def test_detection_from_names(tmp_path: Path) -> None:
    assert rp.detect("/models/Qwen/Qwen3-Reranker-4B").name == "qwen3-reranker"
    assert rp.detect("/hub/models--BAAI--bge-reranker-v2-gemma/snapshots/abc").name == "bge-reranker-v2-gemma"
    assert rp.detect("mixedbread-ai/mxbai-rerank-large-v2").name == "mxbai-rerank-v2"
    assert rp.detect("/models/Qwen3-0.6B") is None
    assert rp.detect("mixedbread-ai/mxbai-rerank-large-v1") is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"name_or_path": "Qwen/Qwen3-Reranker-8B"}))
    assert rp.detect(str(tmp_path)).name == "qwen3-reranker"
    assert rp.choose("none", str(tmp_path)) is None
    with pytest.raises(ValueError, match="rerank_preset"):
        rp.choose("qwen4", str(tmp_path))


def test_preset_flag_is_checked() -> None:
    with pytest.raises(ValueError, match="rerank_preset must be one of"):
        ServerArgs(engine=Settings(model_path="m"), rerank_preset="qwen4")
    with pytest.raises(ValueError, match="not both"):
        ServerArgs(
            engine=Settings(model_path="m"), rerank_preset="mxbai-rerank-v2", rerank_template="{query} {doc}"
        )


def test_none_keeps_the_generic_template(built: Any) -> None:
    """--rerank-preset none on a folder named Qwen3-Reranker: the chat-template prompt, whose
    token count differs from the preset's."""
    path, model, tok = built("qwen3-reranker")
    ref_ids, _, _ = qwen3_reference(tok, model, QUERY, DOCS, None)
    with serving(path, rerank_preset="none") as client:
        resp = client.post("/rerank", json={"query": QUERY, "documents": DOCS})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] != sum(map(len, ref_ids))


def test_a_preset_that_cannot_serve_the_model_fails_at_start() -> None:
    """Found when the app is built, never as a 400 on every rerank call: a preset named for a
    model that reranks with its head, and a preset whose answer tokens the vocabulary lacks."""
    from po_backend.core.task import ModelTask
    from tests.server_utils import FakeService

    head = FakeService()
    head.task = ModelTask(kind="classify", labels=("LABEL_0",))  # type: ignore[attr-defined]
    args = ServerArgs(engine=Settings(model_path="m"), rerank_preset="qwen3-reranker")
    with pytest.raises(ValueError, match="reranks with its head"):
        create_app(head, args)  # type: ignore[arg-type]
    create_app(head, ServerArgs(engine=Settings(model_path="m")))  # auto: the head serves, no preset

    class NoYes:  # a vocabulary without Qwen3-Reranker's answer tokens
        unk_token_id = 0

        def convert_tokens_to_ids(self, token: str) -> int:
            return self.unk_token_id

    args = ServerArgs(engine=Settings(model_path="m"), rerank_preset="qwen3-reranker")
    with pytest.raises(ValueError, match="vocabulary lacks"):
        create_app(FakeService(tokenizer=NoYes()), args)  # type: ignore[arg-type]
