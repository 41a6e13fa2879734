"""llama.cpp through llama-cpp-python (the optional `llamacpp` extra) as a baseline on the same
weights: a GGUF written by `po_backend.engine.models.gguf_export`, prompts given as token ids."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def load(path: Path, n_ctx: int, n_batch: int = 2048, threads: int | None = None) -> Any:
    """A llama.cpp context for prompts of up to `n_ctx` tokens, processed `n_batch` at a time
    (n_ubatch too: the prompt-processing GEMMs' row count), on `threads` (default: every core)."""
    from llama_cpp import Llama

    threads = threads or os.cpu_count() or 1
    return Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_batch=n_batch,
        n_ubatch=n_batch,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=False,
        verbose=False,
    )


def last_logprobs(llm: Any, ids: list[int], keep: int = 0) -> np.ndarray:
    """Log-probs of the token after `ids`. The first `keep` tokens' KV cache, evaluated by an
    earlier call, is kept (a shared prefix is not recomputed); the rest is evaluated."""
    llm.n_tokens = keep  # eval() drops the cache past n_tokens before it decodes
    llm.eval(ids[keep:])
    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).astype(np.float64)
    logits -= logits.max()
    return logits - np.log(np.exp(logits).sum())


def shared_prefix(llm: Any, ids: list[int]) -> int:
    """How many leading tokens of `ids` the context already holds (its last evaluated prompt's),
    at most all but the last, whose logits must be computed: the `keep` of `last_logprobs`."""
    past, k = list(llm.input_ids[: llm.n_tokens]), 0
    while k < min(len(past), len(ids) - 1) and past[k] == ids[k]:
        k += 1
    return k
