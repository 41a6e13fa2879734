"""Pure conversions between request fields and engine results: per-item batch fields,
`logit_bias` parsing, the exact top-k under a bias, log-probs as JSON carries them, softmax.
No tokenizer and no I/O; bad input raises a 400 `HTTPError`."""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

from po_backend.core.request import ScoreResult
from po_backend.server.errors import bad

_TOKEN_KEY = re.compile(r"0|[1-9][0-9]{0,18}")
LOGPROB_FLOOR = -9999.0  # JSON has no -inf; SGLang and vLLM clamp to this value too


def json_logprob(x: float | None) -> float | None:
    """A log-prob as JSON can carry it: NaN -> null, -inf -> the floor."""
    if x is None or math.isnan(x):
        return None
    return max(float(x), LOGPROB_FLOOR)


def per_item(value: Any, n: int, name: str, default: Any) -> list[Any]:
    """SGLang batch fields: one value for all items or a list with one per item."""
    if value is None:
        return [default] * n
    if isinstance(value, list):
        if len(value) != n:
            raise bad(f"{name} has {len(value)} values for a batch of {n} prompts")
        return [default if v is None else v for v in value]
    return [value] * n


def unique(ids: Sequence[int]) -> tuple[int, ...]:
    """`ids` without repeats, in first-seen order."""
    return tuple(dict.fromkeys(ids))


def parse_bias(bias: dict[str, float] | None, vocab_size: int, where: str, limit: int) -> dict[int, float]:
    """OpenAI/SGLang `logit_bias` ({"token id": bias in [-100, 100]}) as {token id: bias}, at most
    `limit` entries (each biased token is scored and ranked for every prompt it applies to)."""
    if bias and len(bias) > limit:
        raise bad(f"{where} has {len(bias)} entries, more than the limit of {limit} (--max-logit-bias)")
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        # A token id written the one way OpenAI writes it: int() would also take " 5", "5_0" and
        # other scripts' digits, and "5" with "05" would fold into one entry.
        if not _TOKEN_KEY.fullmatch(key):
            raise bad(f"{where} keys must be token ids in decimal digits without leading zeros, got {key!r}")
        token_id = int(key)
        if not 0 <= token_id < vocab_size:
            raise bad(f"{where} token id {token_id} is outside the vocabulary [0, {vocab_size})")
        if not math.isfinite(value) or not -100 <= value <= 100:
            raise bad(f"{where} values must be in [-100, 100], got {value} for token {token_id}")
        out[token_id] = float(value)
    return out


def biased_top(
    result: ScoreResult, labels: Sequence[int], bias: dict[int, float], k: int
) -> list[tuple[int, float]]:
    """The exact top-k of softmax(logits + bias), from the raw top list and the biased tokens'
    own log-probs (both in `result`): with Z = sum_v p_v e^{b_v} = 1 - sum_b p_b + sum_b p_b e^{b},
    every log-prob shifts by -log Z and the biased ones also by +b. Needs `result.top_logprobs` to
    hold at least k tokens beyond the biased ones."""
    if not bias:
        return list(result.top_logprobs[:k])
    lp = dict(zip(labels, result.logprobs, strict=True))
    p_biased = math.fsum(math.exp(lp[t]) for t in bias)
    terms = [lp[t] + b for t, b in bias.items()]
    rest = 1.0 - p_biased
    if rest > 1e-12:
        terms.append(math.log(rest))
    m = max(terms)
    log_z = m + math.log(math.fsum(math.exp(t - m) for t in terms))
    cand = {t: lp[t] + b - log_z for t, b in bias.items()}
    for t, v in result.top_logprobs:
        if t not in bias:
            cand[t] = v - log_z
    return sorted(cand.items(), key=lambda kv: -kv[1])[:k]


def softmax(xs: Sequence[float], temperature: float = 1.0) -> list[float]:
    m = max(xs)
    w = [math.exp((x - m) / temperature) for x in xs]
    s = math.fsum(w)
    return [x / s for x in w]


def envelope(
    id_prefix: str, kind: str, model: str, key: str, data: Any, prompt_tokens: int, completion_tokens: int = 0
) -> dict[str, Any]:
    """OpenAI's response envelope (`id`, `object`, `created`, `model`, the payload under `key`,
    `usage`), shared by completions and the vLLM-style list answers."""
    return {
        "id": f"{id_prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        key: data,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
