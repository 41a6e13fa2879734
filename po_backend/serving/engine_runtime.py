"""The one factory of a running engine: `build_runtime(settings)` loads the scorer `settings`
names (our Engine, or the transformers baseline), puts the scheduling loop in front of it, and
wraps its tokenizer. The HTTP server, the SGLang compat layer (`sglang.Engine`, the frontend
backend), `po.Local`, the Ray actors and the labeling tool all build through it, so one set of
`Settings` runs the same way whichever entry point it came in by.

Two rules live here, once:

- JCT model: the loop's scheduler ranks by `serving.jct_profile.startup_jct(engine, policy)`
  unless the caller passes `jct=`: fcfs and lpm need none; po and srjf load the profile persisted
  for this engine and machine, or time a few short steps now and refine from real steps.
- Tokenizer thread-safety: a fast tokenizer is not safe to call from several threads at once
  (the Rust side raises "Already borrowed"). Every call into a tokenizer goes through a
  `LockedTokenizer` (`EngineRuntime.tokenizer`, `encode`/`decode`), which holds the one lock of
  that tokenizer object in this process (`tokenizer_lock`); nobody calls the scorer's own
  tokenizer directly.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any, TypeVar, cast

from po_backend.core.errors import InvalidRequestError
from po_backend.core.request import ScoreRequest, ScoreResult
from po_backend.core.settings import FIELDS, SCHEDULER_FIELDS, Settings, jsonable, resolve, sglang_names
from po_backend.core.task import ModelTask, model_identity
from po_backend.engine.engine import Engine
from po_backend.sched.config import SchedulerConfig
from po_backend.sched.jct import CalibratedJCT, JCTModel
from po_backend.serving.jct_profile import startup_jct
from po_backend.serving.loop import EngineLoop

R = TypeVar("R", bound="EngineRuntime")

LOGPROB_FLOOR = -9999.0  # what the server puts in JSON for -inf (as SGLang does)
# The settings' scheduler fields by their SchedulerConfig names (online_slo_ms is in seconds there).


_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def tokenizer_lock(tokenizer: Any) -> threading.RLock:
    """The one lock of `tokenizer` in this process: two runtimes (a po.Local and an SGLang Engine
    wrapping the same engine) serialise on the same lock."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(tokenizer)
        if lock is None:
            lock = _LOCKS[tokenizer] = threading.RLock()
        return lock


class LockedTokenizer:
    """A tokenizer whose every method call holds its one lock (see the module docstring); plain
    attributes (`eos_token_id`, `vocab_size`, `chat_template`) are read through."""

    def __init__(self, tokenizer: Any) -> None:
        if isinstance(tokenizer, LockedTokenizer):
            tokenizer = tokenizer.unwrapped
        self._tokenizer = tokenizer
        self._lock = tokenizer_lock(tokenizer)

    @property
    def unwrapped(self) -> Any:
        return self._tokenizer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._tokenizer, name)
        if not callable(value):
            return value
        lock = self._lock

        def locked(*args: Any, **kwargs: Any) -> Any:
            with lock:
                return value(*args, **kwargs)

        return locked


class EngineRuntime:
    """A scorer, the `EngineLoop` that owns it, and its locked tokenizer."""

    def __init__(self, scorer: Any, loop: EngineLoop, settings: Settings) -> None:
        self.scorer = scorer
        self.loop = loop
        self.settings = settings
        self.model_path = settings.model_path
        raw = getattr(scorer, "tokenizer", None)
        self.tokenizer: LockedTokenizer | None = None if raw is None else LockedTokenizer(raw)
        self._token_text: dict[int, str] = {}

    @property
    def engine(self) -> Any:
        return self.scorer

    @property
    def vocab_size(self) -> int:
        return int(self.scorer.vocab_size)

    @property
    def max_input_len(self) -> int:
        return int(self.scorer.max_input_len)

    def resolved(self) -> dict[str, Any]:
        """The settings as they run, as JSON: what was asked for, with "auto" and None replaced by
        what the scorer chose (dtype, device, lengths, memory, the pool as sized) and the loop
        runs, also under SGLang's names. /server_info and `get_server_info()` report this."""
        sched = self.loop.config
        out = {
            **self.settings.public(),
            **self.scorer.resolved_settings(),
            **{name: getattr(sched, field) for name, field in SCHEDULER_FIELDS.items()},
            "online_slo_ms": None if sched.online_slo_s is None else sched.online_slo_s * 1e3,
            "max_queue": self.loop.max_queue,
            **model_identity(self.scorer),
        }
        return jsonable(sglang_names(out))

    def state(self) -> dict[str, Any]:
        """The scorer's and the loop's counters, as JSON (SGLang's `internal_states`)."""
        return {**jsonable(self.scorer.stats()), **jsonable(self.loop.stats())}

    def server_info(self) -> dict[str, Any]:
        """SGLang's `get_server_info()`: the resolved settings and the counters; over HTTP,
        /server_info adds the HTTP edge's own settings."""
        return {**self.resolved(), "internal_states": [self.state()]}

    # ---- tokens -------------------------------------------------------------------------------

    def _tok(self) -> LockedTokenizer:
        if self.tokenizer is None:
            raise InvalidRequestError(f"{self.model_path}: the model folder has no tokenizer")
        return self.tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        return tuple(self._tok().encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self._tok().decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own (SGLang's `return_text_in_logprobs`), memoised."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.decode([token_id])
        return text

    def entry(self, logprob: float | None, token_id: int) -> list[Any]:
        """SGLang's (logprob, token id, text) triple, as the server's /generate writes it."""
        if logprob is not None and not math.isnan(logprob):
            logprob = max(float(logprob), LOGPROB_FLOOR)
        else:
            logprob = None
        return [logprob, token_id, self.token_text(token_id)]

    # ---- running ------------------------------------------------------------------------------

    def run(self, reqs: Sequence[ScoreRequest], priority: int | None = None) -> list[ScoreResult]:
        """Submit together (the scheduler sees them as one burst, so items sharing a cached
        prefix run as one multi-item forward) and wait for all. `priority`: given to each."""
        if not reqs:
            return []
        if priority is not None:
            reqs = [dataclasses.replace(r, priority=priority) for r in reqs]
        return [f.result() for f in self.loop.submit_many(reqs)]

    def flush_cache(self) -> None:
        self.loop.flush_cache()

    def shutdown(self) -> None:
        if not self.loop.closed:
            self.loop.shutdown(drain=True)


def task_of(scorer: Any) -> ModelTask:
    """What the scorer serves: the engine's task; the transformers baseline scores label tokens."""
    return getattr(scorer, "task", None) or ModelTask()


def _load_engine(settings: Settings) -> Engine:
    engine = Engine.from_pretrained(settings.model_path, **settings.overrides())
    for name, path in settings.loras():  # a bad adapter stops the start with its reason
        assert engine.loras is not None, "lora_paths turn LoRA on"
        engine.loras.load(name, path)
    return engine


def _load_hf(settings: Settings) -> Any:
    from po_backend.engine.hf_scorer import HFScorer

    o = settings.overrides()
    return HFScorer.from_pretrained(
        settings.model_path,
        dtype=o.get("dtype"),
        device=o.get("device"),
        max_input_len=o.get("max_input_len"),
    )


# The scorer each `backend` names (core.choices.BACKENDS).
LOADERS: dict[str, Callable[[Settings], Any]] = {"prefillonly": _load_engine, "hf": _load_hf}


def load_scorer(settings: Settings) -> Any:
    """The scorer `settings.backend` names, loaded with `settings`."""
    return LOADERS[settings.backend](settings)


def build_runtime(
    settings: Settings,
    *,
    scorer: Any = None,
    jct: JCTModel | CalibratedJCT | None = None,
    start: bool = True,
    runtime_class: type[R] | None = None,
) -> R:
    """The scorer (`scorer`, or loaded from `settings`), its JCT model and its loop. jct: None
    follows the start-up rule of the module docstring; a model given is used as is."""
    if scorer is None:
        scorer = load_scorer(settings)
    sched = SchedulerConfig.from_settings(settings)
    if jct is None and sched.needs_jct:
        if not scorer.can_profile_jct:
            raise ValueError(f"policy {sched.policy!r} needs a JCT model: pass jct= for this scorer")
        jct = startup_jct(scorer, sched.policy)
    loop = EngineLoop(scorer, scheduler=sched, max_queue=settings.max_queue, jct=jct, start=start)
    cls: Any = runtime_class or EngineRuntime
    return cast(R, cls(scorer, loop, settings))


def settings_of(engine: Engine, **kwargs: Any) -> Settings:
    """The settings of an Engine loaded elsewhere (its config, by field name), plus `kwargs` for
    the loop, through `resolve` like every other entry point's."""
    cfg = engine.config
    given = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name in FIELDS}
    given.update(task=task_of(engine).kind, dtype=None, device=None)  # torch objects; the engine reports them
    return resolve(str(engine.model_path or "<engine>"), **{**given, **kwargs})
