"""What the server needs from a model: the `Backend` protocol, `LoopBackend` (a scorer plus the
scheduling loop that owns it) and `ServerArgs` (what the info endpoints report, and the HTTP
edge's own limits)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from po_backend.engine import ScoreRequest, ScoreResult


class Backend(Protocol):
    """A tokenizer plus a scheduling loop that scores `ScoreRequest`s off the event loop."""

    tokenizer: Any
    vocab_size: int
    max_input_len: int

    def submit_many(self, reqs: Sequence[ScoreRequest]) -> list[Future[ScoreResult]]:
        """Validate all (typed errors, nothing queued on error) and queue them together; raises
        OverloadedError when the queue cannot take them."""
        ...

    def cancel(self, fut: Future[ScoreResult]) -> None: ...

    def stats(self) -> dict[str, Any]:
        """Counters and gauges (`queued`, `running`, ...) as plain JSON values."""
        ...

    def flush_cache(self) -> None: ...

    def shutdown(self) -> None: ...


class LoopBackend:
    """A `Backend` from a scorer (the Engine or the transformers baseline: tokenizer, vocabulary)
    and the scheduling loop that owns it (queue, futures, cancellation, stats)."""

    def __init__(self, scorer: Any, loop: Any, max_input_len: int) -> None:
        self.scorer = scorer
        self.loop = loop
        self.tokenizer = scorer.tokenizer
        self.vocab_size = int(scorer.vocab_size)
        self.max_input_len = int(max_input_len)

    def submit_many(self, reqs: Sequence[ScoreRequest]) -> list[Future[ScoreResult]]:
        return self.loop.submit_many(reqs)

    def cancel(self, fut: Future[ScoreResult]) -> None:
        self.loop.cancel(fut)

    def stats(self) -> dict[str, Any]:
        return _jsonable(self.loop.stats())

    def flush_cache(self) -> None:
        # The loop owns the engine: the flush must happen between its steps, on its thread.
        self.loop.flush_cache()

    def shutdown(self) -> None:
        self.loop.shutdown(drain=True)


@dataclass(frozen=True)
class ServerArgs:
    """What /model_info and /server_info report, plus the HTTP edge's own limits."""

    model_path: str
    served_model_name: str = ""
    backend: str = "prefillonly"
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    max_body_bytes: int = 64 << 20
    model_type: str = ""
    architectures: tuple[str, ...] = ()
    engine_args: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path


def _jsonable(stats: Any) -> Any:
    """Backend stats (dicts, dataclasses) as plain JSON values."""
    if hasattr(stats, "__dataclass_fields__"):
        stats = asdict(stats)
    if isinstance(stats, dict):
        return {str(k): _jsonable(v) for k, v in stats.items()}
    if isinstance(stats, list | tuple):
        return [_jsonable(v) for v in stats]
    if isinstance(stats, float) and not math.isfinite(stats):
        return None
    if isinstance(stats, int | float | str | bool) or stats is None:
        return stats
    return str(stats)
