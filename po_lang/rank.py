"""`po.rank`: score many items with one classifier and sort them by P(label), best first."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Mapping
from typing import Any

from po_lang.api import Classifier
from po_lang.results import Classification, Failed, Ranked


def rank(
    fn: Classifier,
    items: Iterable[Any],
    *,
    label: str,
    top_k: int | None = None,
    progress: bool = False,
    **fixed: Any,
) -> list[Ranked]:
    """Items sorted by P(`label`) (renormalised over fn's labels, calibrated), best first.

    Each item is a dict of keyword arguments merged with `fixed`, or a single value bound to the
    one parameter `fixed` leaves open. Ties keep the input order. An item that fails scores -inf
    and sorts last with its `Failed` as the result; `top_k` keeps the best k.
    """
    if not isinstance(fn, Classifier):
        raise TypeError(f"rank() needs a @po.classify function, got {type(fn).__name__}")
    if label not in fn.labels:
        raise ValueError(f"label {label!r} is not one of {list(fn.labels)}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    items = list(items)
    rows = [bind_item(fn.signature, item, fixed) for item in items]
    results = fn.map(rows, progress=progress)
    ranked = [Ranked(item, _score(r, label), r) for item, r in zip(items, results, strict=True)]
    ranked.sort(key=lambda r: -r.score)  # stable: ties keep the input order
    return ranked if top_k is None else ranked[:top_k]


def bind_item(signature: inspect.Signature, item: Any, fixed: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of one rank item (see `rank`)."""
    if isinstance(item, Mapping):
        clash = sorted(set(item) & set(fixed))
        if clash:
            raise TypeError(f"rank item and fixed arguments both give {clash}")
        return {**fixed, **item}
    return {**fixed, _open_parameter(signature, fixed): item}


def _open_parameter(signature: inspect.Signature, fixed: Mapping[str, Any]) -> str:
    params = [
        p
        for p in signature.parameters.values()
        if p.name not in fixed
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    # One open parameter takes the item; otherwise the single open one without a default.
    if len(params) != 1:
        params = [p for p in params if p.default is inspect.Parameter.empty]
    if len(params) != 1:
        names = [p.name for p in params]
        raise TypeError(
            f"rank cannot tell which parameter an item binds to (open: {names}); pass the others as "
            "keyword arguments to rank, or give each item as a dict"
        )
    return params[0].name


def _score(result: Classification | Failed, label: str) -> float:
    return -math.inf if isinstance(result, Failed) else result.probs[label]
