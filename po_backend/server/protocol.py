"""Request bodies of the HTTP API (pydantic, used at the edge only).

Field names follow SGLang 0.5.23 (`/generate`, `/v1/score`, `/tokenize`) and OpenAI
(`/v1/completions`), so their clients work unchanged. Models forbid unknown keys: a misspelt
parameter is a 400, never silently ignored. Fields that SGLang or OpenAI clients send but a
prefill-only server cannot honour are declared so their defaults pass; the server rejects them
when set (see `app.py`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

IntList = list[int]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParams(_Strict):
    """SGLang's sampling parameters. Only `max_new_tokens` (0 or 1) and `logit_bias` change the
    answer; the one output token is always the most likely one (greedy), since sampling a
    classification answer would make it random. The rest are accepted so SGLang programs run."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    beam_width: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    custom_params: dict[str, Any] | None = None


class GenerateRequest(_Strict):
    """SGLang's `GenerateReqInput`, the subset that means something without decoding.

    Per-item fields take one value for the whole batch or a list with one value per prompt.
    """

    text: str | list[str] | None = None
    input_ids: IntList | list[IntList] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: IntList | list[IntList] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    # Our extension: leading tokens worth keeping in the prefix cache (the shared part).
    cache_prefix_len: int | list[int | None] | None = None
    # SGLang fields accepted at their defaults only (the server rejects other values).
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    lora_path: Any = None
    lora_id: Any = None
    return_hidden_states: bool | list[bool] = False
    custom_logit_processor: Any = None
    session_params: Any = None
    log_metrics: bool = True
    modalities: Any = None
    priority: int | None = None
    data_parallel_rank: int | None = None
    extra_key: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None


class ScoreRequestBody(_Strict):
    """SGLang's `/v1/score`: prompt = query + item (item + query with `item_first`)."""

    query: str | IntList | None = None
    items: str | list[str] | list[IntList] | None = None
    label_token_ids: IntList | list[IntList] | None = None
    apply_softmax: bool = False
    item_first: bool = False
    temperature: float = 1.0
    return_token_logprobs: bool = False
    model: str | None = None
    # SGLang features we do not implement (rejected when set).
    embed_override_token_id: int | None = None
    query_embed_overrides: Any = None
    item_embed_overrides: Any = None
    return_pooled_hidden_states: bool = False
    score_extraction_token: str | None = None


class CompletionRequest(_Strict):
    """OpenAI's legacy completions: `max_tokens` 0 or 1 here; `logprobs` up to 20."""

    model: str | None = None
    prompt: str | list[str] | IntList | list[IntList]
    max_tokens: int | None = None
    logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    echo: bool = False
    n: int | None = None
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    suffix: str | None = None
    user: str | None = None


class ClassifyRequest(_Strict):
    """Ours: label probabilities for prompt(s).

    `shared_prefix_len`: leading characters (text prompts) or tokens (token-id prompts) that the
    prompts share; that part is tokenised on its own and kept in the prefix cache.
    `leading_space`: put a space before each label (default: when the prompt does not end in
    whitespace, so "Answer:" is followed by " Yes" but "assistant\\n" by "Yes").
    Labels of more than one token are scored as continuations (sum, or `mean` per token).
    """

    prompt: str | list[str] | IntList | list[IntList]
    labels: list[str] = Field(min_length=2)
    shared_prefix_len: int | None = Field(default=None, ge=0)
    leading_space: bool | None = None
    choices_method: Literal["sum", "mean"] = "sum"
    model: str | None = None


class TokenizeRequest(_Strict):
    # SGLang names the field `prompt`; po_lang's client sends `prompt` and `text` (same value).
    model: str | None = None
    prompt: str | list[str] | None = None
    text: str | list[str] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: IntList | list[IntList]
    skip_special_tokens: bool = True


class ChatTemplateRequest(_Strict):
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
