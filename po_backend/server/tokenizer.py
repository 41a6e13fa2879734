"""The tokenizer endpoints SGLang serves: `/tokenize`, `/detokenize`, `/apply_chat_template`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from po_backend.server.errors import bad
from po_backend.server.protocol import ChatTemplateRequest, DetokenizeRequest, TokenizeRequest
from po_backend.server.runtime import RuntimeDep

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, rt: RuntimeDep) -> dict[str, Any]:
    prompt = body.prompt if body.prompt is not None else body.text
    if prompt is None:
        raise bad("send the text to tokenize as 'prompt'")
    max_len = rt.backend.max_input_len
    if isinstance(prompt, str):
        ids = list(rt.encode(prompt, body.add_special_tokens))
        return {"tokens": ids, "count": len(ids), "max_model_len": max_len}
    lists = [list(rt.encode(p, body.add_special_tokens)) for p in prompt]
    return {"tokens": lists, "count": [len(x) for x in lists], "max_model_len": max_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, rt: RuntimeDep) -> dict[str, Any]:
    batch = bool(body.tokens) and isinstance(body.tokens[0], list)
    rows: list[list[int]] = body.tokens if batch else [body.tokens]  # type: ignore[assignment,list-item]
    vocab = rt.backend.vocab_size
    for t in (t for row in rows for t in row):
        if not 0 <= t < vocab:
            raise bad(f"token id {t} is outside the vocabulary [0, {vocab})")
    texts = [rt.decode(r, skip_special_tokens=body.skip_special_tokens) for r in rows]
    return {"text": texts if batch else texts[0]}


@router.post("/apply_chat_template")
async def apply_chat_template(body: ChatTemplateRequest, rt: RuntimeDep) -> dict[str, Any]:
    tok = rt.tokenizer
    if not getattr(tok, "chat_template", None):
        raise bad("this model's tokenizer has no chat template")
    try:
        text = tok.apply_chat_template(
            body.messages, tokenize=False, add_generation_prompt=body.add_generation_prompt
        )
    except Exception as e:  # template errors (missing keys, raise_exception in jinja)
        raise bad(f"chat template failed: {e}") from e
    return {"text": text}
