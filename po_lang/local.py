"""The in-process backend: `po_backend.Engine` behind the same `EngineLoop` scheduler as the server.

po_backend is imported only when the first request is scored (it needs torch), so importing
po_lang stays torch-free and `Local("embedded")` is free to construct (it is the default backend).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from po_backend.core.settings import Settings, resolve  # torch-free
from po_lang.backends import LabelRequest, ScoreOutcome
from po_lang.errors import BackendError

if TYPE_CHECKING:  # annotations only: these import torch, which po_lang must not at import time
    from po_backend.engine.engine import Engine
    from po_backend.sched.jct import CalibratedJCT, JCTModel
    from po_backend.serving.engine_runtime import EngineRuntime, LockedTokenizer
    from po_backend.serving.loop import EngineLoop


class Local:
    """Scores in this process with the runtime `po_backend.serving.engine_runtime.build_runtime` builds
    (the server's factory) from `resolve(model, **options)`: the options are the server's
    settings under the same names (ours, SGLang's or vLLM's: `max_input_len`, `dtype`,
    `chunked_prefill_size`, `schedule_policy`, ...), with the same defaults and the same errors,
    checked when the Local is made.

    Requests go through an in-process `po_backend.serving.loop.EngineLoop`, one worker thread that
    owns the engine, so a `.map` or `po.rank` batch runs in the order the scheduler picks
    (`policy`, short for `schedule_policy`: "po", the prefix-aware SRJF of the design, by
    default; "fcfs", "srjf" or "lpm"), with requests that share a prefix batched behind the one
    that caches it, exactly as on the server.

    jct: the step-time predictor the scheduler ranks requests by. None: the server's start-up
    rule (`serving.jct_profile.startup_jct`: the profile persisted for this engine and machine,
    else a quick estimate refined online). Pass `JCTModel.proxy()` for the new-token proxy.

    The worker thread stops on `close()`, on leaving a `with` block, when the Local is garbage
    collected, or at interpreter exit, whichever comes first; a closed Local starts a new loop if
    it is used again.

    priority: the request priority of everything this Local scores (SGLang's; ordered by it with
    `enable_priority_scheduling=True`, as on the server).

    lora: the LoRA adapter everything this Local scores runs with (a name from the `lora_paths`
    option, loaded at start), unless a classifier names its own (`@po.classify(lora=...)`).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] = "embedded",
        *,
        policy: str | None = None,
        jct: JCTModel | CalibratedJCT | None = None,
        priority: int | None = None,
        lora: str | None = None,
        **options: Any,
    ) -> None:
        self.priority = priority
        self.lora = lora
        if policy is not None:
            options["schedule_policy"] = policy
        self.settings: Settings = resolve(model, **options)
        self.model = model
        self.policy = self.settings.schedule_policy
        self.jct = jct
        self._engine: Engine | None = None
        self._runtime: EngineRuntime | None = None
        self._tokenizer: LockedTokenizer | None = None
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()  # one engine and one loop even if threads race to build them

    @classmethod
    def from_engine(
        cls, engine: Engine, *, policy: str | None = None, jct: JCTModel | CalibratedJCT | None = None
    ) -> Local:
        """Wrap an engine that is already loaded (tests, or sharing one engine). The engine is
        not thread-safe: use it directly only while this Local is not scoring."""
        from po_backend.serving.engine_runtime import settings_of

        backend = cls(getattr(engine, "model_path", "") or "<engine>", policy=policy, jct=jct)
        backend.settings = settings_of(engine, schedule_policy=backend.policy)
        backend._engine = engine
        return backend

    def __repr__(self) -> str:
        return f"Local({str(self.model)!r}, policy={self.policy!r})"

    @property
    def engine(self) -> Engine:
        with self._lock:
            if self._engine is None:
                # lazy: torch is imported here, not by po_lang
                from po_backend.serving.engine_runtime import load_scorer

                self._engine = load_scorer(self.settings)
            return self._engine

    @property
    def loop(self) -> EngineLoop:
        """The running `EngineLoop` (started on first use; its `step_log()` shows the order)."""
        return self.runtime.loop

    @property
    def runtime(self) -> EngineRuntime:
        """The engine and its running loop, built by the server's factory."""
        engine = self.engine
        with self._lock:
            if self._runtime is None:
                from po_backend.serving.engine_runtime import build_runtime

                self._runtime = build_runtime(self.settings, scorer=engine, jct=self.jct)
                # Bound to the loop, not to self: the finalizer must not keep this Local alive.
                self._finalizer = weakref.finalize(self, _stop, self._runtime.loop)
            return self._runtime

    def close(self) -> None:
        """Stop the loop's worker thread (idempotent). Requests still queued by other threads are
        cancelled; the step running now completes."""
        with self._lock:
            finalizer, self._finalizer, self._runtime = self._finalizer, None, None
        if finalizer is not None:
            finalizer()

    def __enter__(self) -> Local:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer behind its one lock (serving.engine_runtime's rule: `.map` threads and
        the loop's callers never call it concurrently)."""
        if self._tokenizer is None:
            tok = self.engine.tokenizer
            if tok is None:
                raise BackendError(
                    f"the model {str(self.model)!r} has no tokenizer; po_lang needs one for text"
                )
            from po_backend.serving.engine_runtime import LockedTokenizer

            self._tokenizer = LockedTokenizer(tok)
        return self._tokenizer

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

    def head_labels(self) -> tuple[str, ...] | None:
        """The engine's classifier labels (id2label) when it serves a classifier head."""
        task = self.engine.task
        return task.labels if task.kind == "classify" else None

    def _head(self, r: LabelRequest) -> Callable[[list[float]], list[float]] | None:
        if not r.head_labels:
            return None
        from po_backend.core.task import log_probabilities

        task, order = self.engine.task, r.head_labels
        return lambda logits: [log_probabilities(task, logits)[j] for j in order]

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
                priority=self.priority,
                pool=bool(r.head_labels),
                lora=r.lora if r.lora is not None else self.lora,
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
                res = _result(fut, self._head(requests[i]))
                if isinstance(res, Exception) and len(valid) > 1:
                    failed.append((i, req))  # a step fails as a whole: find the culprit below
                else:
                    out[i] = res
            # Unexpected (validation passed): isolate it by running the failed requests one by one.
            for i, req in failed:
                out[i] = _result(loop.submit(req), self._head(requests[i]))
        assert all(o is not None for o in out), "every request gets an outcome"
        return out  # type: ignore[return-value]


def _result(
    fut: Future[Any], head: Callable[[list[float]], list[float]] | None = None
) -> ScoreOutcome | BackendError:
    """The outcome; `head` turns a classifier head's logits into the requested label scores."""
    try:
        res = fut.result()
    except Exception as e:  # the step failed, or the loop shut down before the request ran
        return _wrap(e)
    return ScoreOutcome(
        label_logprobs=tuple(head(res.outputs) if head is not None else res.logprobs),
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
