"""The in-process backend: `po_backend.Engine`, imported only when first used (it needs torch)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from po_lang.backends import LabelRequest, ScoreOutcome
from po_lang.errors import BackendError


class Local:
    """Runs `po_backend.Engine.from_pretrained(model, **engine_kwargs)` in this process.

    The engine is built on first use so `Local("embedded")` is free to construct (it is the
    default backend) and importing po_lang never imports torch.
    """

    def __init__(self, model: str | os.PathLike[str] = "embedded", **engine_kwargs: Any) -> None:
        self.model = model
        self.engine_kwargs = engine_kwargs
        self._engine: Any = None

    @classmethod
    def from_engine(cls, engine: Any) -> Local:
        """Wrap an engine that is already loaded (tests, or sharing one engine)."""
        backend = cls(getattr(engine, "model_path", "") or "<engine>")
        backend._engine = engine
        return backend

    def __repr__(self) -> str:
        return f"Local({str(self.model)!r})"

    @property
    def engine(self) -> Any:
        if self._engine is None:
            from po_backend import Engine  # lazy: torch is imported here, not by po_lang

            self._engine = Engine.from_pretrained(self.model, **self.engine_kwargs)
        return self._engine

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
        from po_backend import ScoreRequest

        engine = self.engine
        out: list[ScoreOutcome | Exception | None] = [None] * len(requests)
        valid: list[tuple[int, Any]] = []
        # engine.run validates the whole call and raises on the first bad request; validating
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
            try:
                results = engine.run([req for _, req in valid])
            except Exception:
                # Unexpected (validation passed): isolate it by running the requests one by one.
                results = []
                for _, req in valid:
                    try:
                        results.append(engine.run([req])[0])
                    except Exception as e:
                        results.append(_wrap(e))
            for (i, _), res in zip(valid, results, strict=True):
                out[i] = res if isinstance(res, Exception) else _outcome(res)
        assert all(o is not None for o in out), "every request gets an outcome"
        return out  # type: ignore[return-value]


def _outcome(res: Any) -> ScoreOutcome:
    return ScoreOutcome(
        label_logprobs=tuple(res.logprobs),
        input_token_logprobs=tuple(res.input_token_logprobs),
        prompt_tokens=res.prompt_tokens,
        cached_tokens=res.cached_tokens,
    )


def _wrap(e: Exception) -> BackendError:
    err = BackendError(f"{type(e).__name__}: {e}")
    err.__cause__ = e
    return err
