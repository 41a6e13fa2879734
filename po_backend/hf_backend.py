"""The baseline behind `launch_server --backend hf`: plain transformers, one request per forward,
first come first served, no prefix cache. Same request/result types as the engine so the server
(and a side-by-side benchmark) cannot tell the two apart except by speed."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from po_backend.config import default_device, parse_dtype
from po_backend.engine import ScoreRequest, ScoreResult, validate_request
from po_backend.errors import (
    OverloadedError,
)
from po_backend.models.loader import resolve_model_dir

log = logging.getLogger(__name__)


class HFScorer:
    """Scores `ScoreRequest`s with `AutoModelForCausalLM`: `logits_to_keep` limits the LM head to
    the rows that are read (the last one, or the prompt-logprob span), nothing else is special."""

    def __init__(self, model: Any, tokenizer: Any, max_input_len: int, model_path: str = "") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_input_len = max_input_len
        self.model_path = model_path
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._counts = {"requests": 0, "forwards": 0, "prompt": 0}

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str] = "embedded",
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        max_input_len: int | None = None,
    ) -> HFScorer:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model_dir = resolve_model_dir(path)
        dev = torch.device(device) if device is not None else default_device()
        dt = parse_dtype(dtype, dev)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).to(dev).eval()
        has_tok = any(
            (model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        )
        tokenizer = AutoTokenizer.from_pretrained(model_dir) if has_tok else None
        context = int(getattr(model.config, "max_position_embeddings", 0) or 0) or 8192
        return cls(model, tokenizer, max_input_len or context, model_path=str(path))

    def validate(self, req: ScoreRequest) -> None:
        """The engine's checks, so both backends reject the same requests with the same errors."""
        validate_request(req, self.vocab_size, self.max_input_len)

    def run(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        for r in requests:
            self.validate(r)
        return [self.score(r) for r in requests]

    @torch.inference_mode()
    def score(self, req: ScoreRequest) -> ScoreResult:
        ids = req.input_ids
        n = len(ids)
        first = req.logprob_start_len if req.logprob_start_len >= 0 else n - 1
        x = torch.tensor([ids], dtype=torch.int64, device=self.device)
        logits = self.model(x, logits_to_keep=n - first, use_cache=False).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)  # rows: positions first..n-1
        last = logp[-1]
        span: list[float] = []
        if req.logprob_start_len >= 0:
            targets = torch.tensor(ids[first + 1 :], dtype=torch.int64, device=logp.device)
            span = logp[:-1].gather(1, targets[:, None]).squeeze(1).tolist()
        top: list[tuple[int, float]] = []
        if req.top_k:
            vals, idx = last.topk(req.top_k)
            top = list(zip(idx.tolist(), vals.tolist(), strict=True))
        labels = torch.tensor(req.label_token_ids, dtype=torch.int64, device=last.device)
        c = self._counts
        c["requests"] += 1
        c["forwards"] += 1
        c["prompt"] += n
        return ScoreResult(
            logprobs=last[labels].tolist(),
            top_logprobs=top,
            input_token_logprobs=span,
            prompt_tokens=n,
            cached_tokens=0,
        )

    def stats(self) -> dict[str, Any]:
        c = self._counts
        return {
            "requests": c["requests"],
            "forwards": c["forwards"],
            "prompt_tokens": c["prompt"],
            "computed_tokens": c["prompt"],
            "cached_tokens": 0,
        }

    def flush_cache(self) -> None:
        """Nothing is cached: kept so both backends answer /flush_cache alike."""


class FCFSLoop:
    """One worker thread running queued requests one at a time, in arrival order.

    The same surface as the engine's scheduling loop (`submit`, `submit_many`, `cancel`,
    `shutdown`, `stats`), so the server drives either. `scorer` is anything with
    `validate(req)` and `run([req])`.
    """

    def __init__(self, scorer: Any, max_queue: int = 4096) -> None:
        self.scorer = scorer
        self.max_queue = max_queue
        self._q: queue.Queue[tuple[ScoreRequest, Future[ScoreResult]] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0  # queued, not yet started (the queue's own size counts cancelled ones too)
        self._running = 0
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="fcfs-loop", daemon=True)
        self._thread.start()

    def submit(self, req: ScoreRequest) -> Future[ScoreResult]:
        return self.submit_many([req])[0]

    def submit_many(self, reqs: Sequence[ScoreRequest]) -> list[Future[ScoreResult]]:
        """All or nothing: every request is validated and the queue must hold all of them."""
        for r in reqs:
            self.scorer.validate(r)
        with self._lock:
            if self._closed:
                raise OverloadedError("the server is shutting down")
            if self._pending + len(reqs) > self.max_queue:
                raise OverloadedError(
                    f"overloaded: {self._pending} requests queued (max_queue={self.max_queue})"
                )
            self._pending += len(reqs)
        futs: list[Future[ScoreResult]] = []
        for r in reqs:
            f: Future[ScoreResult] = Future()
            futs.append(f)
            self._q.put((r, f))
        return futs

    def cancel(self, fut: Future[ScoreResult]) -> bool:
        return fut.cancel()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out = {"queued": self._pending, "running": self._running}
        inner = getattr(self.scorer, "stats", None)
        if inner is not None:
            s = inner()
            out.update(s if isinstance(s, dict) else vars(s))
        return out

    def flush_cache(self) -> None:
        self.scorer.flush_cache()

    def shutdown(self, drain: bool = True, timeout: float | None = 30.0) -> None:
        with self._lock:
            self._closed = True
        if not drain:
            while True:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[1].cancel()
                    with self._lock:
                        self._pending -= 1
        self._q.put(None)
        self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            req, fut = item
            with self._lock:
                self._pending -= 1
            if not fut.set_running_or_notify_cancel():
                continue  # cancelled while queued (the client went away)
            with self._lock:
                self._running += 1
            t0 = time.perf_counter()
            try:
                (res,) = self.scorer.run([req])
                fut.set_result(res)
            except BaseException as e:  # the future carries it to the waiting handler
                log.debug("request failed after %.3fs: %s", time.perf_counter() - t0, e)
                fut.set_exception(e)
            finally:
                with self._lock:
                    self._running -= 1
