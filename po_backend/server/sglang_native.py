"""SGLang's native API: `/generate` (the next token and log-probs; never decodes further), the
model and server info endpoints, `/flush_cache`. Shapes follow SGLang 0.5.23's `GenerateReqInput`
and `meta_info`, so `sgl.RuntimeEndpoint` and SGLang's router speak to us unchanged."""

from __future__ import annotations

import asyncio
import hmac
import os
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from po_backend.core.errors import PrefillOnlyError
from po_backend.core.request import ScoreRequest, ScoreResult
from po_backend.server.body import BodyRoute
from po_backend.server.context import VERSION, Runtime, RuntimeDep, sse
from po_backend.server.errors import HTTPError, bad
from po_backend.server.protocol import GenerateRequest, SamplingParams
from po_backend.server.translate import biased_top, parse_bias, per_item, unique

router = APIRouter(route_class=BodyRoute)

MAX_INPUT_ID_CELLS = 1 << 20
# SGLang's extra_key and vLLM's cache_salt promise that one caller's prefix-cache entries never
# serve (or reveal, through cached_tokens) another's; one shared cache cannot keep that promise.
CACHE_NAMESPACE = (
    "{field} is not supported: this server keeps one prefix cache for all its callers and cannot "
    "keep a caller's cached prefixes apart (run a server per tenant instead)"
)  # token_ids_logprob values at prompt positions, per prompt

# Fields of SGLang's GenerateReqInput a prefill-only text server cannot honour: 400 when set
# (`lora_path` is honoured: `Runtime.run` reads it, see server/adapters.py).
_UNSUPPORTED = ("image_data", "video_data", "audio_data", "input_embeds", "lora_id",
                "custom_logit_processor", "session_params")  # fmt: skip


@dataclass(frozen=True)
class GenItem:
    """One prompt of a /generate call, parsed."""

    ids: tuple[int, ...]
    max_new_tokens: int
    return_logprob: bool
    logprob_start_len: int  # SGLang's: the first position whose log-prob is returned
    top_logprobs_num: int
    token_ids_logprob: tuple[int, ...] | None
    bias: dict[int, float]
    skip_special_tokens: bool
    with_text: bool  # return_text_in_logprobs
    rid: str
    request: ScoreRequest


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request, rt: RuntimeDep) -> Response:
    t0 = time.perf_counter()
    items, single = await rt.parse(parse_generate, rt, body)
    results = await rt.run(
        request, [it.request for it in items], sum(it.max_new_tokens for it in items), body.priority
    )
    latency = time.perf_counter() - t0
    out = [format_generate(rt, it, r, latency) for it, r in zip(items, results, strict=True)]
    if body.stream:
        return sse([{**o, "index": i} for i, o in enumerate(out)])
    return JSONResponse(out[0] if single else out)


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(rt: RuntimeDep) -> dict[str, Any]:
    args, service = rt.args, rt.service
    model_path, tok_dir = await asyncio.to_thread(router_paths, rt)
    return {
        "model_path": model_path,
        "tokenizer_path": tok_dir,
        "is_generation": rt.task.kind == "generate",  # SGLang's flag: false for pooling models
        **rt.task.describe(),
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": service.model_type,
        "architectures": list(service.architectures),
        "served_model_name": args.model_name,
        "max_input_len": service.max_input_len,
        "vocab_size": service.vocab_size,
        "backend": args.backend,
    }


def router_paths(rt: Runtime) -> tuple[str, str | None]:
    """(model_path, tokenizer_path) as /model_info and /server_info report them. Local folders
    only: the SGLang router loads a tokenizer from the `model_path` of /server_info and goes to
    the hub for anything that is not a local folder ("embedded", a .gguf file)."""
    model_path = rt.args.model_path
    tok_dir = tokenizer_dir(rt.service.tokenizer)
    if os.path.isfile(os.path.join(model_path, "tokenizer.json")):
        return model_path, tok_dir
    return tok_dir or model_path, tok_dir


def tokenizer_dir(tokenizer: Any) -> str | None:
    """A local folder holding the tokenizer as tokenizer.json: the one it was loaded from (a GGUF
    or the embedded model's conversion folder included), else a copy saved there once (a
    sentencepiece-only folder); None without a tokenizer."""
    if tokenizer is None:
        return None
    src = Path(str(getattr(tokenizer, "name_or_path", "") or "")).resolve()
    if (src / "tokenizer.json").is_file():
        return str(src)
    if not getattr(tokenizer, "is_fast", False) or not src.is_dir():
        return None
    target = src / "po-tokenizer"  # next to the weights: the folder the tokenizer came from
    if not (target / "tokenizer.json").is_file():
        try:
            tokenizer.save_pretrained(target)
        except OSError:  # a read-only model folder: nothing the router could load
            return None
    return str(target)


@router.get("/server_info")
@router.get("/get_server_info")
def server_info(rt: RuntimeDep) -> dict[str, Any]:
    # Sync, so FastAPI runs it in its thread pool: stats() takes the engine loop's lock.
    service = rt.service
    # The effective settings (resolved dtype, device, policy) override what was asked for.
    model_path, tok_dir = router_paths(rt)
    info = {
        **rt.args.public(),
        "model_type": service.model_type,
        "architectures": list(service.architectures),
    }
    info.update(service.settings)
    # Not the flag as given: the router loads its tokenizer from here (see router_paths). The
    # name clients send stays served_model_name, which defaults to the flag, as SGLang's does.
    info.update(model_path=model_path, tokenizer_path=tok_dir, served_model_name=rt.args.model_name)
    return {**info, "internal_states": [service.stats()], "version": VERSION}


# POST only (SGLang also answers GET): a cross-site page can make a browser send a GET to a
# keyless loopback server, and a flush is not a read.
@router.post("/flush_cache")
async def flush_cache(request: Request, rt: RuntimeDep) -> Response:
    check_admin(request, rt)
    try:
        await asyncio.to_thread(rt.service.flush_cache)
    except PrefillOnlyError as e:
        return PlainTextResponse(f"Cache not flushed: {e}\n", status_code=400)
    return PlainTextResponse("Cache flushed.\n")


def check_admin(request: Request, rt: Runtime) -> None:
    """A control-plane call (a flush drops every tenant's cache): with --admin-api-key only with
    that key; and never from another site's page (a browser sends `Origin` on a cross-site POST,
    which a form on a keyless loopback server could otherwise send)."""
    origin = request.headers.get("origin")
    if origin is not None:
        try:
            same = urllib.parse.urlsplit(origin).netloc == request.headers.get("host", "")
        except ValueError:
            same = False
        if not same:
            raise HTTPError(403, f"{request.url.path} is not answered to another site's page (Origin {origin})",
                            "PermissionDeniedError")  # fmt: skip
    admin = rt.args.admin_api_key
    if admin:
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), admin.encode()):
            raise HTTPError(
                403, f"{request.url.path} needs the admin key (--admin-api-key)", "PermissionDeniedError"
            )


# ---- /generate: parse ---------------------------------------------------------------------------


def parse_generate(rt: Runtime, body: GenerateRequest) -> tuple[list[GenItem], bool]:
    """The call's prompts as `GenItem`s, and whether it was a single prompt (not a batch)."""
    for name in _UNSUPPORTED:
        if getattr(body, name) is not None:
            raise bad(f"{name} is not supported by the prefill-only server")
    if body.extra_key is not None:
        raise bad(CACHE_NAMESPACE.format(field="extra_key"))
    if (body.text is None) == (body.input_ids is None):
        raise bad("send exactly one of text and input_ids")
    if body.text is not None:
        single = isinstance(body.text, str)
        texts = [body.text] if single else list(body.text)
        rt.check_items(len(texts), "prompts")
        prompts = [rt.encode_prompt(t) for t in texts]  # type: ignore[arg-type]
    else:
        ids = body.input_ids or []
        single = not ids or not isinstance(ids[0], list)
        prompts = [tuple(ids)] if single else [tuple(x) for x in ids]  # type: ignore[arg-type]
        rt.check_items(len(prompts), "prompts")
    n = len(prompts)
    if n == 0:
        raise bad("the batch is empty")
    hidden = body.return_hidden_states
    if any(hidden if isinstance(hidden, list) else [hidden]):
        raise bad("return_hidden_states is not supported by the prefill-only server")
    for flag in ("background", "return_bytes", "return_entropy"):
        if getattr(body, flag):
            raise bad(f"{flag}=true is not supported by the prefill-only server")
    sampling = per_item(body.sampling_params, n, "sampling_params", SamplingParams())
    want_logprob = per_item(body.return_logprob, n, "return_logprob", False)
    starts = per_item(body.logprob_start_len, n, "logprob_start_len", -1)
    tops = per_item(body.top_logprobs_num, n, "top_logprobs_num", 0)
    token_ids = body.token_ids_logprob
    if token_ids and isinstance(token_ids[0], list):
        id_lists = per_item(token_ids, n, "token_ids_logprob", None)
    else:
        id_lists = [token_ids] * n
    prefix = per_item(body.cache_prefix_len, n, "cache_prefix_len", None)
    rids = per_item(body.rid, n, "rid", None)
    items = [
        _parse_item(
            rt,
            body,
            prompts[i],
            sampling[i],
            bool(want_logprob[i]),
            starts[i],
            int(tops[i]),
            id_lists[i],
            prefix[i],
            rids[i],
        )  # fmt: skip
        for i in range(n)
    ]
    rt.check_logprobs(sum(_returned(it) for it in items))
    return items, single


def _returned(it: GenItem) -> int:
    """Log-prob values one prompt's answer carries: the next token's (asked ids, top list) and,
    from logprob_start_len on, each prompt position's (its token, top list, asked ids)."""
    asked = len(it.token_ids_logprob or ())
    out = 1 + asked + it.top_logprobs_num
    if it.return_logprob and it.logprob_start_len >= 0:
        out += (len(it.ids) - it.logprob_start_len) * (1 + it.top_logprobs_num + asked)
    return out


def _parse_item(
    rt: Runtime, body: GenerateRequest, ids: tuple[int, ...], sp: SamplingParams, want_logprob: bool,
    start: int, top_n: int, token_ids: list[int] | None, cache_prefix_len: int | None, rid: str | None,
) -> GenItem:  # fmt: skip
    max_new = 1 if sp.max_new_tokens is None else sp.max_new_tokens
    if max_new not in (0, 1):
        raise bad(
            f"max_new_tokens must be 0 or 1 on this prefill-only server (it scores the next "
            f"token and never decodes), got {max_new}"
        )
    _check_sampling(sp, max_new)
    if not 0 <= top_n <= rt.args.max_top_logprobs:
        raise bad(
            f"top_logprobs_num must be in [0, {rt.args.max_top_logprobs}] (--max-top-logprobs), got {top_n}"
        )
    if want_logprob and not -1 <= start < max(len(ids), 1):
        raise bad(
            f"logprob_start_len must be in [-1, {len(ids) - 1}] for a {len(ids)}-token prompt, got {start}"
        )
    ids_lp = tuple(token_ids) if token_ids is not None else None
    if want_logprob and start >= 0 and ids_lp and len(ids_lp) * (len(ids) - start) > MAX_INPUT_ID_CELLS:
        # One value per (prompt position, asked id): bounded like the top log-probs are.
        raise bad(
            f"token_ids_logprob asks {len(ids_lp)} ids at {len(ids) - start} prompt positions, more than "
            f"{MAX_INPUT_ID_CELLS} values: ask fewer ids or a later logprob_start_len"
        )
    bias = parse_bias(sp.logit_bias, rt.service.vocab_size, "logit_bias", rt.args.max_logit_bias)
    top_k = top_n if want_logprob else 0
    if max_new == 1:
        top_k = max(top_k, 1 + len(bias))  # enough unbiased candidates for the argmax
    # The engine returns log-probs of the positions after its start; SGLang's list begins at the
    # start position itself.
    engine_start = max(start - 1, 0) if want_logprob and start >= 0 else -1
    request = ScoreRequest(
        ids,
        unique((ids_lp or ()) + tuple(bias)),
        top_k=top_k,
        logprob_start_len=engine_start,
        cache_prefix_len=cache_prefix_len,
        # The same figures at the prompt positions (SGLang's input_top_logprobs and
        # input_token_ids_logprobs).
        input_top_k=top_n if engine_start >= 0 else 0,
        input_token_ids=(ids_lp or ()) if engine_start >= 0 else (),
    )
    return GenItem(
        ids=ids,
        max_new_tokens=max_new,
        return_logprob=want_logprob,
        logprob_start_len=start,
        top_logprobs_num=top_n,
        token_ids_logprob=ids_lp,
        bias=bias,
        skip_special_tokens=sp.skip_special_tokens is not False,
        with_text=body.return_text_in_logprobs,
        rid=rid or uuid.uuid4().hex,
        request=request,
    )


def _check_sampling(sp: SamplingParams, max_new_tokens: int) -> None:
    for name in ("regex", "json_schema", "ebnf", "structural_tag"):
        if getattr(sp, name) is not None:
            raise bad(
                f"sampling_params.{name}: constrained decoding is not supported by the prefill-only server"
            )
    if sp.n not in (None, 1):
        raise bad(f"sampling_params.n must be 1 on the prefill-only server, got {sp.n}")
    if sp.beam_width not in (None, 0, 1):
        raise bad("sampling_params.beam_width: beam search is not supported by the prefill-only server")
    if (sp.min_new_tokens or 0) > max_new_tokens:
        raise bad(f"min_new_tokens={sp.min_new_tokens} exceeds max_new_tokens={max_new_tokens}")


# The fields that take one value per prompt of a batch (a list) or one for all (`per_item`).
PER_PROMPT_FIELDS = ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
                     "cache_prefix_len", "rid")  # fmt: skip


def split_batch(body: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """A batched /generate body with its `n` prompts under `text` as `n` single-prompt bodies,
    each with its own values of the per-prompt fields and the shared ones unchanged (what a
    front end that cannot send batches forwards). A per-prompt list of another length is the
    400 `parse_generate` gives."""
    own = {name: per_item(body[name], n, name, None) for name in PER_PROMPT_FIELDS if name in body}
    token_ids = body.get("token_ids_logprob")
    if isinstance(token_ids, list) and token_ids and isinstance(token_ids[0], list):
        own["token_ids_logprob"] = per_item(token_ids, n, "token_ids_logprob", None)
    out = []
    for i, text in enumerate(body["text"]):
        one = {**body, "text": text}
        for name, values in own.items():
            if values[i] is None:
                one.pop(name, None)
            else:
                one[name] = values[i]
        out.append(one)
    return out


# ---- /generate: format --------------------------------------------------------------------------


def format_generate(rt: Runtime, it: GenItem, res: ScoreResult, latency: float) -> dict[str, Any]:
    """SGLang's response for one prompt: text, output_ids and meta_info."""
    out_ids: list[int] = []
    text = ""
    finish: dict[str, Any] = {"type": "length", "length": it.max_new_tokens}
    req = it.request
    if it.max_new_tokens == 1:
        (token, _), *_ = biased_top(res, req.label_token_ids, it.bias, 1)
        out_ids = [token]
        if rt.service.tokenizer is not None:
            text = rt.decode([token], skip_special_tokens=it.skip_special_tokens)
        if token == rt.eos_token_id:
            finish = {"type": "stop", "matched": token}
    meta: dict[str, Any] = {
        "id": it.rid,
        "finish_reason": finish,
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": len(out_ids),
        "cached_tokens": res.cached_tokens,
        "e2e_latency": latency,
    }
    if it.return_logprob:
        meta.update(_logprob_meta(rt, it, res, out_ids))
    return {"text": text, "output_ids": out_ids, "meta_info": meta}


def _logprob_meta(rt: Runtime, it: GenItem, res: ScoreResult, out_ids: list[int]) -> dict[str, Any]:
    with_text = it.with_text
    lp = dict(zip(it.request.label_token_ids, res.logprobs, strict=True))
    lp.update(res.top_logprobs)
    inputs: list[list[Any]] = []
    input_top: list[list[list[Any]] | None] = []
    input_ids_rows: list[list[list[Any]] | None] = []
    if it.logprob_start_len >= 0:
        start = it.logprob_start_len
        values: list[float | None] = list(res.input_token_logprobs)
        input_top = [[rt.entry(v, t, with_text) for t, v in row] for row in res.input_top_logprobs]
        ids = it.token_ids_logprob or ()
        input_ids_rows = [
            [rt.entry(v, t, with_text) for t, v in zip(ids, row, strict=True)]
            for row in res.input_token_ids_logprobs
        ]
        if start == 0:
            # The first prompt token has no context, so no distribution (SGLang: None there too).
            values = [None, *values]
            input_top = [None, *input_top]
            input_ids_rows = [None, *input_ids_rows]
        inputs = [rt.entry(v, t, with_text) for v, t in zip(values, it.ids[start:], strict=True)]
    top_row = [rt.entry(v, t, with_text) for t, v in res.top_logprobs[: it.top_logprobs_num]]
    ids_row = [rt.entry(lp[t], t, with_text) for t in it.token_ids_logprob or ()]
    return {
        "input_token_logprobs": inputs,
        "input_top_logprobs": input_top if it.top_logprobs_num else [],
        "input_token_ids_logprobs": input_ids_rows if it.token_ids_logprob else [],
        "output_token_logprobs": [rt.entry(lp.get(t), t, with_text) for t in out_ids],
        "output_top_logprobs": [top_row] if it.top_logprobs_num else [],
        # One row, the next-token distribution, also with max_new_tokens=0 (SGLang's /v1/score
        # reads it that way).
        "output_token_ids_logprobs": [ids_row] if it.token_ids_logprob is not None else [],
    }
