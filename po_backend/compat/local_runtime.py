"""One engine served in process for the SGLang-shaped front ends (`sglang.Engine`, the frontend
backend): `serving.engine_runtime.EngineRuntime` (the engine, the scheduling loop that owns it, the
locked tokenizer) built by the one factory from SGLang's keyword arguments, mapped by
`core.settings.resolve` exactly as the server's flags are. Both front ends submit through the
loop, so concurrent programs (`run_batch(num_threads=...)`) and score calls are batched by the
prefix-aware scheduler exactly as behind the server."""

from __future__ import annotations

import os
from typing import Any

from po_backend.core.errors import InvalidRequestError
from po_backend.core.settings import resolve
from po_backend.engine.engine import Engine
from po_backend.sched.jct import CalibratedJCT, JCTModel
from po_backend.serving.engine_runtime import LOGPROB_FLOOR, EngineRuntime, build_runtime, settings_of

__all__ = ["LOGPROB_FLOOR", "LocalRuntime"]


class LocalRuntime(EngineRuntime):
    """An `EngineRuntime` that needs a tokenizer (text in, text out)."""

    @classmethod
    def launch(cls, model_path: str | os.PathLike[str] | None = None, **kwargs: Any) -> LocalRuntime:
        """SGLang's `Engine(**ServerArgs)` keywords (or ours): unknown names raise TypeError, as
        ServerArgs(**kwargs) does; values we cannot honour raise ValueError (core.settings)."""
        settings = resolve(model_path, **kwargs)
        rt = build_runtime(settings, runtime_class=cls)
        if rt.tokenizer is None:
            rt.shutdown()
        _need_tokenizer(rt)
        return rt

    @classmethod
    def wrap(
        cls, engine: Engine, *, jct: JCTModel | CalibratedJCT | None = None, **settings: Any
    ) -> LocalRuntime:
        """Serve an Engine already loaded (jct: see serving.engine_runtime; settings: the loop's, by
        the names `resolve` takes, e.g. schedule_policy or max_queued_requests)."""
        if engine.tokenizer is None:  # checked before a loop (and its thread) exists
            raise InvalidRequestError(f"{engine.model_path}: the model folder has no tokenizer")
        return build_runtime(settings_of(engine, **settings), scorer=engine, jct=jct, runtime_class=cls)


def _need_tokenizer(rt: EngineRuntime) -> None:
    if rt.tokenizer is None:
        raise InvalidRequestError(f"{rt.model_path}: the model folder has no tokenizer")
