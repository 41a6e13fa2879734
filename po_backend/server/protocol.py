"""Request bodies of the HTTP API (pydantic, used at the edge only).

Field names follow SGLang 0.5.23 (`/generate`, `/v1/score`, `/tokenize`) and OpenAI
(`/v1/completions`), so their clients work unchanged. Like SGLang (pydantic models) and vLLM,
request bodies accept unknown top-level keys and ignore them (logged at debug): the SGLang router
and client libraries add fields of their own. Nested `sampling_params` stay strict, since a
misspelt sampling parameter there would silently change nothing. Fields that SGLang or OpenAI
clients send but a prefill-only server cannot honour are declared so their defaults pass; the
handlers reject them with a 400 when set.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, model_validator

log = logging.getLogger(__name__)

# Token ids are strict integers: "5" or true is a client bug, never token 5 or 1.
IntList = list[StrictInt]


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    return value


# A count or a bias: what pydantic takes for one (1.0 for 1, as SGLang's and vLLM's models do),
# but not true or false, which no client means as 1 or 0.
Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TolerantBody(BaseModel):
    """A top-level request body: unknown keys are ignored, as SGLang and vLLM do."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, data: Any) -> Any:
        # Lone surrogates were refused as the body was read (server/body.py).
        if isinstance(data, dict) and log.isEnabledFor(logging.DEBUG):
            unknown = sorted(str(k) for k in data if k not in cls.model_fields)
            if unknown:
                log.debug("%s: ignoring unknown fields %s", cls.__name__, unknown)
        return data


class SamplingParams(_Strict):
    """SGLang's sampling parameters. Only `max_new_tokens` (0 or 1) and `logit_bias` change the
    answer; the one output token is always the most likely one (greedy), since sampling a
    classification answer would make it random. The rest are accepted so SGLang programs run."""

    max_new_tokens: Int | None = None
    min_new_tokens: Int | None = None
    n: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    frequency_penalty: Float | None = None
    presence_penalty: Float | None = None
    repetition_penalty: Float | None = None
    beam_width: Int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    stream_interval: Int | None = None
    logit_bias: dict[str, Float] | None = None
    sampling_seed: Int | None = None
    custom_params: dict[str, Any] | None = None


class GenerateRequest(TolerantBody):
    """SGLang's `GenerateReqInput`, the subset that means something without decoding.

    Per-item fields take one value for the whole batch or a list with one value per prompt.
    """

    text: str | list[str] | None = None
    input_ids: IntList | list[IntList] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: Int | list[Int] | None = None
    top_logprobs_num: Int | list[Int] | None = None
    token_ids_logprob: IntList | list[IntList] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    # Our extension: leading tokens worth keeping in the prefix cache (the shared part).
    cache_prefix_len: Int | list[Int | None] | None = None
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
    priority: StrictInt | None = None  # scheduled by it with --enable-priority-scheduling
    data_parallel_rank: Int | None = None
    extra_key: Any = None  # SGLang's cache namespace: refused when set (see sglang_native)
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    # What the SGLang router adds to every forwarded /generate (its defaults pass; `background`,
    # `return_bytes` and `return_entropy` set to true ask for what we cannot do: 400).
    model: str | None = None
    background: bool = False
    no_logs: bool = False
    return_bytes: bool = False
    return_entropy: bool = False


class ScoreRequestBody(TolerantBody):
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
    # SGLang's / vLLM's request priority (scheduled by it with --enable-priority-scheduling).
    priority: StrictInt | None = None


class CompletionRequest(TolerantBody):
    """OpenAI's legacy completions: `max_tokens` 0 or 1 here; `logprobs` up to 20."""

    model: str | None = None
    prompt: str | list[str] | IntList | list[IntList]
    max_tokens: Int | None = None
    logprobs: Int | None = None
    logit_bias: dict[str, Float] | None = None
    echo: bool = False
    n: Int | None = None
    best_of: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    frequency_penalty: Float | None = None
    presence_penalty: Float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    suffix: str | None = None
    user: str | None = None
    cache_salt: Any = None  # vLLM's cache namespace: refused when set (see openai)
    # SGLang's completion extensions (the router sends them with these defaults).
    no_stop_trim: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_hidden_states: bool = False
    # SGLang's / vLLM's request priority (scheduled by it with --enable-priority-scheduling).
    priority: StrictInt | None = None


class ClassifyRequest(TolerantBody):
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
    # SGLang's / vLLM's request priority (scheduled by it with --enable-priority-scheduling).
    priority: StrictInt | None = None


class TokenizeRequest(TolerantBody):
    # SGLang names the field `prompt`; po_lang's client sends `prompt` and `text` (same value).
    # vLLM's chat form sends `messages` (the chat template is applied, then tokenized).
    model: str | None = None
    prompt: str | list[str] | None = None
    text: str | list[str] | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class DetokenizeRequest(TolerantBody):
    model: str | None = None
    tokens: IntList | list[IntList]
    skip_special_tokens: bool = True


class ChatTemplateRequest(TolerantBody):
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True


class LoadLoRARequest(TolerantBody):
    """SGLang's `/load_lora_adapter` and vLLM's `/v1/load_lora_adapter`: a PEFT folder, by name."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRARequest(TolerantBody):
    lora_name: str = Field(min_length=1)
