"""The tokenizer endpoints: SGLang's `/tokenize`, `/detokenize`, `/apply_chat_template`, and
vLLM's `/v1/tokenize`, `/v1/detokenize` (the same bodies and answers: vLLM's `{count,
max_model_len, tokens}` and `{prompt}`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from po_backend.server.body import BodyRoute
from po_backend.server.context import Runtime, RuntimeDep
from po_backend.server.errors import bad
from po_backend.server.protocol import ChatTemplateRequest, DetokenizeRequest, TokenizeRequest

router = APIRouter(route_class=BodyRoute)


# The tokenizer runs on the parse pool, off the event loop, like every other route's tokenizing.


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(body: TokenizeRequest, rt: RuntimeDep) -> dict[str, Any]:
    return await rt.parse(_tokenize, rt, body)


def _tokenize(rt: Runtime, body: TokenizeRequest) -> dict[str, Any]:
    prompt = body.prompt if body.prompt is not None else body.text
    if body.messages is not None:
        if prompt is not None:
            raise bad("send either prompt or messages, not both")
        # The template's text already holds the special tokens it wants (vLLM's default too).
        prompt = _chat_text(rt, body.messages, body.add_generation_prompt)
        body = body.model_copy(update={"add_special_tokens": False})
    if prompt is None:
        raise bad("send the text to tokenize as 'prompt' (or a chat as 'messages')")
    max_len = rt.service.max_input_len
    if isinstance(prompt, str):
        ids = list(rt.encode(prompt, body.add_special_tokens))
        return {"tokens": ids, "count": len(ids), "max_model_len": max_len}
    rt.check_items(len(prompt), "prompts")
    lists = [list(rt.encode(p, body.add_special_tokens)) for p in prompt]
    return {"tokens": lists, "count": [len(x) for x in lists], "max_model_len": max_len}


@router.post("/v1/detokenize")
async def detokenize_v1(body: DetokenizeRequest, rt: RuntimeDep) -> dict[str, Any]:
    """vLLM's answer shape: `{"prompt": text}`."""
    return {"prompt": (await rt.parse(_detokenize, rt, body))["text"]}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, rt: RuntimeDep) -> dict[str, Any]:
    return await rt.parse(_detokenize, rt, body)


def _detokenize(rt: Runtime, body: DetokenizeRequest) -> dict[str, Any]:
    batch = bool(body.tokens) and isinstance(body.tokens[0], list)
    rows: list[list[int]] = body.tokens if batch else [body.tokens]  # type: ignore[assignment,list-item]
    rt.check_items(len(rows), "token lists")
    vocab = rt.service.vocab_size
    for t in (t for row in rows for t in row):
        if not 0 <= t < vocab:
            raise bad(f"token id {t} is outside the vocabulary [0, {vocab})")
    texts = [rt.decode(r, skip_special_tokens=body.skip_special_tokens) for r in rows]
    return {"text": texts if batch else texts[0]}


@router.post("/apply_chat_template")
async def apply_chat_template(body: ChatTemplateRequest, rt: RuntimeDep) -> dict[str, Any]:
    return {"text": await rt.parse(_chat_text, rt, body.messages, body.add_generation_prompt)}


def _chat_text(rt: Runtime, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    tok = rt.tokenizer
    if not getattr(tok, "chat_template", None):
        raise bad("this model's tokenizer has no chat template")
    try:
        return str(
            tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        )
    except Exception as e:  # template errors (missing keys, raise_exception in jinja)
        raise bad(f"chat template failed: {e}") from e
