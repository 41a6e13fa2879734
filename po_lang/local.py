"""The in-process backend: `po_backend.Engine` behind the same `EngineLoop` scheduler as the server.

po_backend is imported only when the first request is scored (it needs torch), so importing
po_lang stays torch-free and `Local("embedded")` is free to construct (it is the default backend).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from po_backend.sched.scheduler import POLICIES  # torch-free
from po_lang.backends import LabelRequest, ScoreOutcome
from po_lang.errors import BackendError

if TYPE_CHECKING:  # annotations only: these import torch, which po_lang must not at import time
    from po_backend.engine.engine import Engine
    from po_backend.sched.jct import CalibratedJCT, JCTModel
    from po_backend.serving.loop import EngineLoop


class Local:
    """Scores with `po_backend.Engine.from_pretrained(model, **engine_kwargs)` in this process.

    Requests go through an in-process `po_backend.serving.loop.EngineLoop`, one worker thread that owns
    the engine, so a `.map` or `po.rank` batch runs in the order the scheduler picks (`policy`:
    "po", the prefix-aware SRJF of the design, by default; "fcfs", "srjf" or "lpm"), with requests
    that share a prefix batched behind the one that caches it, exactly as on the server.

    jct: the step-time predictor the scheduler ranks requests by. None: the new-token proxy
    (`JCTModel.proxy()`, the paper's r=0.987 proxy); a local caller submits its batch at once, so
    only the relative cost of requests matters, and the server's start-up profile would cost
    seconds. Pass `po_backend.sched.jct.load_or_profile(engine)` to rank by the measured model.

    The worker thread stops on `close()`, on leaving a `with` block, when the Local is garbage
    collected, or at interpreter exit, whichever comes first; a closed Local starts a new loop if
    it is used again.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] = "embedded",
        *,
        policy: str = "po",
        jct: JCTModel | CalibratedJCT | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.model = model
        self.policy = policy
        self.jct = jct
        self.engine_kwargs = engine_kwargs
        self._engine: Engine | None = None
        self._loop: EngineLoop | None = None
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()  # one engine and one loop even if threads race to build them

    @classmethod
    def from_engine(
        cls, engine: Engine, *, policy: str = "po", jct: JCTModel | CalibratedJCT | None = None
    ) -> Local:
        """Wrap an engine that is already loaded (tests, or sharing one engine). The engine is
        not thread-safe: use it directly only while this Local is not scoring."""
        backend = cls(getattr(engine, "model_path", "") or "<engine>", policy=policy, jct=jct)
        backend._engine = engine
        return backend

    def __repr__(self) -> str:
        return f"Local({str(self.model)!r}, policy={self.policy!r})"

    @property
    def engine(self) -> Engine:
        with self._lock:
            if self._engine is None:
                from po_backend.engine.engine import Engine  # lazy: torch is imported here, not by po_lang

                self._engine = Engine.from_pretrained(self.model, **self.engine_kwargs)
            return self._engine

    @property
    def loop(self) -> EngineLoop:
        """The running `EngineLoop` (started on first use; its `step_log()` shows the order)."""
        engine = self.engine
        with self._lock:
            if self._loop is None:
                from po_backend.sched.jct import JCTModel
                from po_backend.serving.loop import EngineLoop

                jct = JCTModel.proxy() if self.jct is None else self.jct
                self._loop = EngineLoop(engine, policy=self.policy, jct=jct)
                # Bound to the loop, not to self: the finalizer must not keep this Local alive.
                self._finalizer = weakref.finalize(self, _stop, self._loop)
            return self._loop

    def close(self) -> None:
        """Stop the loop's worker thread (idempotent). Requests still queued by other threads are
        cancelled; the step running now completes."""
        with self._lock:
            finalizer, self._finalizer, self._loop = self._finalizer, None, None
        if finalizer is not None:
            finalizer()

    def __enter__(self) -> Local:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        tok = self.engine.tokenizer
        if tok is None:
            raise BackendError(f"the model {str(self.model)!r} has no tokenizer; po_lang needs one for text")
        return tok

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=False
        )
        if not isinstance(text, str):
            raise BackendError(f"apply_chat_template returned {type(text).__name__}, expected text")
        return text

    def score(self, requests: Sequence[LabelRequest]) -> list[ScoreOutcome | Exception]:
        from po_backend.core.request import ScoreRequest

        engine, loop = self.engine, self.loop
        out: list[ScoreOutcome | Exception | None] = [None] * len(requests)
        valid: list[tuple[int, Any]] = []
        # submit_many validates the whole call and raises on the first bad request; validating
        # each one here keeps one bad item from failing the rest.
        for i, r in enumerate(requests):
            req = ScoreRequest(
                input_ids=tuple(r.input_ids),
                label_token_ids=tuple(r.label_token_ids),
                logprob_start_len=r.logprob_start_len,
                cache_prefix_len=r.cache_prefix_len,
            )
            try:
                engine.validate(req)
            except Exception as e:
                out[i] = _wrap(e)
            else:
                valid.append((i, req))
        if valid:
            # All at once: the scheduler sees the whole batch and picks the order and the steps.
            futures = loop.submit_many([req for _, req in valid])
            failed: list[tuple[int, Any]] = []
            for (i, req), fut in zip(valid, futures, strict=True):
                res = _result(fut)
                if isinstance(res, Exception) and len(valid) > 1:
                    failed.append((i, req))  # a step fails as a whole: find the culprit below
                else:
                    out[i] = res
            # Unexpected (validation passed): isolate it by running the failed requests one by one.
            for i, req in failed:
                out[i] = _result(loop.submit(req))
        assert all(o is not None for o in out), "every request gets an outcome"
        return out  # type: ignore[return-value]


def _result(fut: Future[Any]) -> ScoreOutcome | BackendError:
    try:
        res = fut.result()
    except Exception as e:  # the step failed, or the loop shut down before the request ran
        return _wrap(e)
    return ScoreOutcome(
        label_logprobs=tuple(res.logprobs),
        input_token_logprobs=tuple(res.input_token_logprobs),
        prompt_tokens=res.prompt_tokens,
        cached_tokens=res.cached_tokens,
    )


def _stop(loop: EngineLoop) -> None:
    # drain=False: at interpreter exit nobody waits for queued work, and a Local's own calls
    # never leave any (score returns only when all its futures are done).
    loop.shutdown(drain=False)


def _wrap(e: Exception) -> BackendError:
    err = BackendError(f"{type(e).__name__}: {e}")
    err.__cause__ = e
    return err
