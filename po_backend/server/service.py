"""What the server needs from a model: the `ScoringService` protocol and `LoopService` (a
`serving.engine_runtime.EngineRuntime`: a scorer, the scheduling loop that owns it, its locked tokenizer)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from po_backend.core.request import ScoreRequest, ScoreResult
from po_backend.core.settings import jsonable
from po_backend.core.task import ModelTask, model_identity


class ScoringService(Protocol):
    """A tokenizer plus a scheduling loop that scores `ScoreRequest`s off the event loop."""

    tokenizer: Any
    vocab_size: int
    max_input_len: int
    model_type: str
    architectures: tuple[str, ...]
    task: ModelTask  # generate (label scoring), classify (a score head) or embed
    # The effective engine and loop settings (resolved dtype, device, policy...) for /server_info.
    settings: Mapping[str, Any]

    def submit_many(self, reqs: Sequence[ScoreRequest]) -> list[Future[ScoreResult]]:
        """Validate all (typed errors, nothing queued on error) and queue them together; raises
        OverloadedError when the queue cannot take them."""
        ...

    def cancel(self, fut: Future[ScoreResult]) -> None: ...

    def stats(self) -> dict[str, Any]:
        """Counters and gauges (`queued`, `running`, ...) as plain JSON values."""
        ...

    def flush_cache(self) -> None: ...

    def alive(self) -> bool:
        """The scoring loop runs and its recent steps did not all fail (what /health reports)."""
        ...

    def abandon_waiting(self, error: BaseException) -> int:
        """Fail every queued request with `error` (a shutdown deadline); how many."""
        ...

    def shutdown(self) -> None: ...


class LoopService:
    """A `ScoringService` from a scorer (the Engine or the transformers baseline: tokenizer,
    vocabulary) and the scheduling loop that owns it (queue, futures, cancellation, stats)."""

    def __init__(
        self,
        scorer: Any,
        loop: Any,
        max_input_len: int,
        settings: Mapping[str, Any] | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.scorer = scorer
        self.loop = loop
        # The runtime's locked tokenizer when there is one (serving.engine_runtime: every call holds its lock).
        self.tokenizer = tokenizer if tokenizer is not None else scorer.tokenizer
        self.vocab_size = int(scorer.vocab_size)
        self.max_input_len = int(max_input_len)
        self.settings: Mapping[str, Any] = dict(settings or {})

        identity = model_identity(scorer)
        self.model_type: str = identity["model_type"]
        self.architectures = tuple(identity["architectures"])
        self.task: ModelTask = getattr(scorer, "task", None) or ModelTask()
        self.hidden_size = int(
            getattr(getattr(scorer, "model_config", None), "hidden_size", 0) or 0
        )  # an embedding's width
        # The engine's LoRA adapters (server/adapters.py), None when it serves none.
        self.loras: Any = getattr(scorer, "loras", None)

    @classmethod
    def from_runtime(cls, rt: Any) -> LoopService:
        """Serve a `serving.engine_runtime.EngineRuntime`; /server_info reports its resolved settings."""
        return cls(rt.scorer, rt.loop, rt.max_input_len, rt.resolved(), rt.tokenizer)

    def submit_many(self, reqs: Sequence[ScoreRequest]) -> list[Future[ScoreResult]]:
        return self.loop.submit_many(reqs)

    def cancel(self, fut: Future[ScoreResult]) -> None:
        self.loop.cancel(fut)

    def stats(self) -> dict[str, Any]:
        # The scorer's lifetime counters (requests, tokens, cache) beside the loop's queue figures;
        # plain counters, so reading them off the loop's thread is safe enough for a report.
        return {**jsonable(self.scorer.stats()), **jsonable(self.loop.stats())}

    def flush_cache(self) -> None:
        # The loop owns the engine: the flush must happen between its steps, on its thread.
        self.loop.flush_cache()

    def alive(self) -> bool:
        # A worker whose every recent step failed (a device error) is as good as dead to clients.
        return bool(self.loop.alive) and not self.loop.failing

    def abandon_waiting(self, error: BaseException) -> int:
        return int(self.loop.abandon_waiting(error))

    def shutdown(self) -> None:
        self.loop.shutdown(drain=True)
