"""One engine served in process: the Engine plus the scheduling loop that owns it, and the
thread-safe tokenizer calls the SGLang-shaped front ends (`sglang.Engine`, the frontend backend)
share. Both submit through the loop, so concurrent programs (`run_batch(num_threads=...)`) and
score calls are batched by the prefix-aware scheduler exactly as behind the server."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from po_backend.core.errors import InvalidRequestError
from po_backend.core.request import ScoreRequest, ScoreResult
from po_backend.engine.engine import Engine
from po_backend.sched.jct import CalibratedJCT, JCTModel
from po_backend.sched.scheduler import DEFAULT_FAIRNESS_LAMBDA
from po_backend.serving.loop import EngineLoop

log = logging.getLogger(__name__)

LOGPROB_FLOOR = -9999.0  # what the server puts in JSON for -inf (as SGLang does); kept identical

# SGLang ServerArgs that change nothing about the answers of a one-device, prefill-only engine
# (logging, seeds, GPU memory and kernel knobs): accepted so SGLang code runs, then ignored.
_IGNORED_SERVER_ARGS = frozenset(
    {
        "log_level", "log_level_http", "random_seed", "trust_remote_code", "mem_fraction_static",
        "enable_metrics", "disable_cuda_graph", "cuda_graph_max_bs", "attention_backend",
        "sampling_backend", "grammar_backend", "served_model_name", "skip_server_warmup",
        "show_time_cost", "watchdog_timeout", "max_running_requests", "stream_output",
        "enable_cache_report", "kv_cache_dtype", "revision", "download_dir", "load_format",
        "enable_mixed_chunk", "disable_overlap_schedule", "enable_torch_compile",
    }
)  # fmt: skip
# ServerArgs whose only value we can honour is the one given here.
_FIXED_SERVER_ARGS: dict[str, Any] = {
    "tp_size": 1,
    "dp_size": 1,
    "pp_size": 1,
    "skip_tokenizer_init": False,
    "is_embedding": False,
}
# SGLang's --schedule-policy names we run; ours (po, srjf) are accepted as well.
_POLICIES = {"fcfs": "fcfs", "lpm": "lpm", "po": "po", "srjf": "srjf"}


@dataclass(frozen=True)
class RuntimeArgs:
    """What SGLang's keyword arguments (ServerArgs names) become for our engine and loop."""

    model_path: str
    engine: dict[str, Any]
    loop: dict[str, Any]


def parse_server_args(model_path: str | None = None, **kwargs: Any) -> RuntimeArgs:
    """Map `sglang.Engine(**ServerArgs)` keywords onto Engine.from_pretrained / EngineLoop.
    Unknown names raise TypeError, as ServerArgs(**kwargs) does; values we cannot honour raise
    ValueError."""
    if not model_path:
        raise ValueError("model_path is required (a HF folder, a .gguf file, or 'embedded')")
    eng: dict[str, Any] = {}
    loop: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in _IGNORED_SERVER_ARGS:
            log.debug("ignoring SGLang server arg %s=%r (no effect on a prefill-only engine)", key, value)
        elif key in _FIXED_SERVER_ARGS:
            if value not in (None, _FIXED_SERVER_ARGS[key]):
                raise ValueError(f"{key}={value!r} is not supported (only {_FIXED_SERVER_ARGS[key]!r})")
        elif key == "tokenizer_path":
            if value not in (None, model_path):
                raise ValueError("tokenizer_path must be the model's own folder (it is read from model_path)")
        elif key == "dtype":
            eng["dtype"] = None if value in (None, "auto") else value
        elif key == "device":
            eng["device"] = value
        elif key == "context_length":
            eng["max_input_len"] = value
        elif key in ("chunked_prefill_size", "chunk_size"):
            if value is not None and value > 0:  # SGLang's -1 means "no chunking": keep our default
                eng["chunk_size"] = int(value)
        elif key in ("max_prefill_tokens", "max_batch_tokens"):
            eng["max_batch_tokens"] = value
        elif key == "disable_radix_cache":
            eng["enable_cache"] = not value
        elif key in ("memory_budget", "prefill_mode", "cache_policy", "max_input_len"):
            eng[key] = value
        elif key == "schedule_policy":
            if value not in _POLICIES:
                raise ValueError(
                    f"schedule_policy={value!r} is not supported; use one of {sorted(_POLICIES)}"
                )
            loop["policy"] = _POLICIES[value]
        elif key == "max_queued_requests":
            if value is not None:
                loop["max_queue"] = int(value)
        elif key == "fairness_lambda":
            loop["fairness_lambda"] = DEFAULT_FAIRNESS_LAMBDA if value is None else float(value)
        else:
            raise TypeError(f"Engine got an unexpected keyword argument {key!r}")
    return RuntimeArgs(str(model_path), eng, loop)


class LocalRuntime:
    """An Engine and its EngineLoop in this process, plus the tokenizer calls both SGLang front
    ends need (serialised: a fast tokenizer is not safe to call from several threads at once)."""

    def __init__(self, engine: Engine, loop: EngineLoop, model_path: str) -> None:
        _need_tokenizer(engine)
        self.engine = engine
        self.loop = loop
        self.model_path = model_path
        self.tokenizer = engine.tokenizer
        self._tok_lock = threading.Lock()
        self._token_text: dict[int, str] = {}

    @classmethod
    def launch(cls, model_path: str | None = None, **kwargs: Any) -> LocalRuntime:
        args = parse_server_args(model_path, **kwargs)
        engine = Engine.from_pretrained(args.model_path, **args.engine)
        _need_tokenizer(engine)
        return cls(engine, EngineLoop(engine, **args.loop), args.model_path)

    @classmethod
    def wrap(
        cls, engine: Engine, *, jct: JCTModel | CalibratedJCT | None = None, **loop_kwargs: Any
    ) -> LocalRuntime:
        """Serve an Engine already loaded (jct: see EngineLoop; None profiles or loads it)."""
        _need_tokenizer(engine)
        return cls(engine, EngineLoop(engine, jct=jct, **loop_kwargs), engine.model_path)

    # ---- tokens -------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        with self._tok_lock:
            return tuple(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        with self._tok_lock:
            return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

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

    def run(self, reqs: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Submit together (the scheduler sees them as one burst, so items sharing a cached
        prefix run as one multi-item forward) and wait for all."""
        if not reqs:
            return []
        return [f.result() for f in self.loop.submit_many(reqs)]

    def flush_cache(self) -> None:
        self.loop.flush_cache()

    def shutdown(self) -> None:
        if not self.loop.closed:
            self.loop.shutdown(drain=True)


def _need_tokenizer(engine: Engine) -> None:
    # Checked before a loop (and its worker thread) exists: text in, text out needs one.
    if engine.tokenizer is None:
        raise InvalidRequestError(f"{engine.model_path}: the model folder has no tokenizer")
