"""What a classify call returns: a Classification, or a Failed in its place (from .map/rank)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Classification:
    label: str  # the most probable label (after calibration, if any)
    probs: dict[str, float]  # renormalised over the labels (after calibration); sums to 1
    # Raw log-score per label: full-vocabulary next-token log-prob, or with multi_token the
    # continuation's summed / mean log-prob. Not calibrated.
    logprobs: dict[str, float]
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache (multi_token: most of any label)

    def __getitem__(self, label: str) -> float:
        return self.probs[label]


@dataclass(frozen=True)
class Failed:
    """Stands in a `.map` / `rank` result list for an item that could not be scored."""

    error: Exception
    index: int  # position of the item in the input


@dataclass(frozen=True)
class Ranked:
    item: Any  # the item as given to rank()
    score: float  # P(label) renormalised over the labels; -inf when the item failed
    result: Classification | Failed
