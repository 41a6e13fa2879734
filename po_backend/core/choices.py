"""Every enumeration a setting draws from, in one place: the values a flag accepts, the engine
checks and the docs list. Torch-free."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Literal

# What scores: our engine, or the transformers baseline.
BACKENDS = ("prefillonly", "hf")
# The scheduler's policies (SGLang's names onto these: core.settings).
SCHEDULE_POLICIES = ("po", "fcfs", "srjf", "lpm")
# The SGLang router's policies (launch_cluster, the cluster simulator).
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two")

PrefillMode = Literal["hybrid", "chunked"]
PREFILL_MODES: tuple[PrefillMode, ...] = ("hybrid", "chunked")
CachePolicy = Literal["all-but-last-k", "declared", "none"]
CACHE_POLICIES: tuple[CachePolicy, ...] = ("all-but-last-k", "declared", "none")
ResidualDtype = Literal["fp32", "model"]
RESIDUAL_DTYPES: tuple[ResidualDtype, ...] = ("fp32", "model")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# Weight (and activation) quantization, SGLang's names; None: the model dtype throughout.
QUANTIZATIONS = ("w8a8_int8", "w8a8x2_int8")


def check_choice(name: str, value: Any, choices: Collection[Any]) -> None:
    """The one error text for a value outside its enumeration."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
