"""An SGLang frontend backend that runs `@sgl.function` programs on our engine in this process.

    import sglang as sgl                                   # or po_backend.compat.frontend's shim
    from po_backend.compat.sgl_backend import PrefillOnlyBackend
    sgl.set_default_backend(PrefillOnlyBackend("embedded"))
    state = my_program.run(...)                            # unmodified sgl.select / sgl.gen(max_tokens=1)

It implements `sglang.lang.backend.base_backend.BaseBackend` and computes what SGLang's
`RuntimeEndpoint` computes against our server's /generate, so programs take the same decisions:

- `select`: the same prompts (`s.text_ + choice`), the same token-healing start
  (`prompt_tokens - 2`) and log-prob rows, then SGLang's own choices method
  (`token_length_normalized` by default, `greedy_token_selection`, `unconditional_likelihood_normalized`).
  RuntimeEndpoint sends the prompt, then the N choices, in two HTTP calls and two forwards; here
  the N choices go to the loop together, declaring the prompt as their shared prefix: on a cached
  prompt that is one multi-item forward; on a cold one the first choice computes and caches the
  prompt and the other N-1 share one forward.
- `generate` with `max_tokens` 0 or 1: the most likely next token (greedy, as the server).
- `cache_prefix` / `commit_lazy_operations`: the text goes into the prefix cache.

The unconditional choices method scores each choice's tokens on their own from the first one
(the first token has no log-prob; SGLang's method reads it as 0).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from po_backend.compat.frontend import import_sglang_frontend
from po_backend.compat.local_runtime import LocalRuntime
from po_backend.compat.sglang import SGLangEngine
from po_backend.core.errors import EmptyPromptError, InvalidRequestError
from po_backend.core.request import ScoreRequest, ScoreResult, common_prefix

_sgl = import_sglang_frontend()
# SGLang's frontend is imported at run time through the shim, so its base class is only known then.
_BaseBackend: Any = _sgl.BaseBackend


class PrefillOnlyBackend(_BaseBackend):
    """`sgl.set_default_backend(PrefillOnlyBackend("embedded"))`.

    model: a model path ("embedded", a HF folder, a .gguf; keyword arguments as for
    `po_backend.compat.sglang.Engine`, mapped by core.settings.resolve), or an SGLangEngine /
    LocalRuntime to share (then shutdown()
    leaves it running). chat_template_name: as RuntimeEndpoint's; default by model path.
    priority: the request priority of everything this backend runs (scheduled by it when the
    runtime has `enable_priority_scheduling`).
    """

    def __init__(
        self, model: str | SGLangEngine | LocalRuntime = "embedded", *, chat_template_name: str | None = None,
        priority: int | None = None, **server_args: Any,
    ) -> None:  # fmt: skip
        super().__init__()
        self.priority = priority  # of every request this backend sends (SGLang's request priority)
        if isinstance(model, str):
            self.runtime = LocalRuntime.launch(model, **server_args)
            self._owned = True
        else:
            if server_args:
                raise TypeError("server arguments apply only when the backend loads the model itself")
            self.runtime = model.runtime if isinstance(model, SGLangEngine) else model
            self._owned = False
        self.chat_template = (
            _sgl.get_chat_template(chat_template_name)
            if chat_template_name
            else _sgl.get_chat_template_by_model_path(self.runtime.model_path)
        )

    # ---- BaseBackend ----------------------------------------------------------------------------

    def get_model_name(self) -> str:
        return self.runtime.model_path

    def get_chat_template(self) -> Any:
        return self.chat_template

    def cache_prefix(self, prefix_str: str) -> None:
        ids = self._prompt(prefix_str)
        self.runtime.run([ScoreRequest(ids, cache_prefix_len=len(ids))], self.priority)

    def commit_lazy_operations(self, s: Any) -> None:
        self._no_images(s)
        self.cache_prefix(s.text_)

    def fill_image(self, s: Any) -> None:
        self._no_images(s)

    def generate(self, s: Any, sampling_params: Any) -> tuple[str, dict[str, Any]]:
        """`sgl.gen` with max_tokens 0 (just prefill) or 1 (the most likely next token)."""
        self._no_images(s)
        sp = sampling_params
        max_new = 1 if sp.max_new_tokens is None else int(sp.max_new_tokens)
        if max_new not in (0, 1):
            raise InvalidRequestError(
                f"max_new_tokens must be 0 or 1 on this prefill-only engine (it scores the next token "
                f"and never decodes), got {max_new}: use sgl.gen(..., max_tokens=1) or sgl.select"
            )
        for name in ("regex", "json_schema", "dtype"):
            if getattr(sp, name, None) is not None:
                raise InvalidRequestError(
                    f"sgl.gen({name}=...): constrained decoding is not supported by the prefill-only engine"
                )
        if sp.n not in (None, 1):
            raise InvalidRequestError(f"n must be 1 on the prefill-only engine, got {sp.n}")
        if (sp.min_new_tokens or 0) > max_new:
            raise InvalidRequestError(f"min_new_tokens={sp.min_new_tokens} exceeds max_new_tokens={max_new}")
        t0 = time.perf_counter()
        ids = self._prompt(s.text_)
        want_logprob = bool(sp.return_logprob)
        start = -1 if sp.logprob_start_len is None else int(sp.logprob_start_len)
        tops = int(sp.top_logprobs_num or 0)
        if tops < 0:
            raise InvalidRequestError(f"top_logprobs_num must be >= 0, got {tops}")
        if want_logprob and not -1 <= start < len(ids):
            raise InvalidRequestError(
                f"logprob_start_len must be in [-1, {len(ids) - 1}] for a {len(ids)}-token prompt, got {start}"
            )
        top_k = tops if want_logprob else 0
        if max_new == 1:
            top_k = max(top_k, 1)
        req = ScoreRequest(
            ids, (), top_k=top_k, logprob_start_len=_engine_start(start) if want_logprob else -1
        )
        (res,) = self.runtime.run([req], self.priority)
        out_ids = [res.top_logprobs[0][0]] if max_new == 1 else []
        skip = _sgl.global_config.skip_special_tokens_in_output
        text = self.runtime.decode(out_ids, skip_special_tokens=skip) if out_ids else ""
        eos = getattr(self.runtime.tokenizer, "eos_token_id", None)
        finish: dict[str, Any] = {"type": "length", "length": max_new}
        if out_ids and out_ids[0] == eos:
            finish = {"type": "stop", "matched": out_ids[0]}
        meta: dict[str, Any] = {
            "id": uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": res.prompt_tokens,
            "completion_tokens": len(out_ids),
            "cached_tokens": res.cached_tokens,
            "e2e_latency": time.perf_counter() - t0,
        }
        if want_logprob:
            top = dict(res.top_logprobs)
            meta["input_token_logprobs"] = self._input_rows(ids, start, res) if start >= 0 else []
            meta["output_token_logprobs"] = [self.runtime.entry(top[t], t) for t in out_ids]
            row = [self.runtime.entry(v, t) for t, v in res.top_logprobs[:tops]]
            meta["output_top_logprobs"] = [row] if tops else []
        return text, meta

    def generate_stream(self, s: Any, sampling_params: Any) -> Iterator[tuple[str, dict[str, Any]]]:
        yield self.generate(s, sampling_params)  # one token at most: one chunk

    def select(self, s: Any, choices: list[str], temperature: float, choices_method: Any = None) -> Any:
        """RuntimeEndpoint.select's computation, with the N choices submitted together."""
        if temperature > 1e-5:
            raise InvalidRequestError(f"sgl.select runs at temperature 0, got {temperature}")
        if choices_method is None:
            from sglang.lang.choices import token_length_normalized

            choices_method = token_length_normalized
        self._no_images(s)
        text = s.text_
        prompt = self._prompt(text)
        start = max(len(prompt) - 2, 0)  # SGLang's start, one token back for token healing
        reqs = []
        for c in choices:
            ids = self.runtime.encode(text + c)
            if start >= len(ids):
                raise InvalidRequestError(f"choice {c!r} shortens the prompt's tokens; cannot score it")
            # The prompt is the shared prefix, declared only as far as these requests can read it
            # from the cache (their log-probs start at `start`): then the choices batch together.
            shared = min(common_prefix(prompt, ids), _engine_start(start))
            reqs.append(
                ScoreRequest(ids, (), logprob_start_len=_engine_start(start), cache_prefix_len=shared)
            )
        results = self.runtime.run(reqs, self.priority)
        input_token_logprobs = [
            self._input_rows(r.input_ids, start, res) for r, res in zip(reqs, results, strict=True)
        ]
        output_token_logprobs: list[list[Any]] = [[] for _ in choices]
        normalized = [_sgl.compute_normalized_prompt_logprobs(rows) for rows in input_token_logprobs]
        # Drop the extra prompt token when no token healing occurred (RuntimeEndpoint's rule).
        for i, rows in enumerate(input_token_logprobs):
            healed_lp, _, healed_text = rows[0]
            if text.endswith(healed_text) and healed_lp is not None and len(rows) > 1:
                normalized[i] = (normalized[i] * len(rows) - healed_lp) / (len(rows) - 1)
                input_token_logprobs[i] = rows[1:]
        unconditional = None
        if choices_method.requires_unconditional_logprobs:
            seqs = [tuple(row[1] for row in rows) for rows in input_token_logprobs]
            alone = self.runtime.run(
                [ScoreRequest(q, (), logprob_start_len=0, cache_prefix_len=0) for q in seqs], self.priority
            )
            unconditional = [self._input_rows(q, 0, res) for q, res in zip(seqs, alone, strict=True)]
        return choices_method(
            choices=choices,
            normalized_prompt_logprobs=normalized,
            input_token_logprobs=input_token_logprobs,
            output_token_logprobs=output_token_logprobs,
            unconditional_token_logprobs=unconditional,
        )

    def flush_cache(self) -> None:
        self.runtime.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return self.runtime.server_info()

    def shutdown(self) -> None:
        if self._owned:
            self.runtime.shutdown()

    # ---- helpers --------------------------------------------------------------------------------

    def _prompt(self, text: str) -> tuple[int, ...]:
        # As the server: empty text is an empty prompt, not BOS alone.
        if not text:
            raise EmptyPromptError("the prompt is empty (empty text)")
        return self.runtime.encode(text)

    def _input_rows(self, ids: Sequence[int], start: int, res: ScoreResult) -> list[list[Any]]:
        """SGLang's input_token_logprobs from `start` on, as the server's /generate writes them:
        the engine gives the positions after its start, and the first prompt token has none."""
        values: list[float | None] = list(res.input_token_logprobs)
        if start == 0:
            values = [None, *values]
        return [self.runtime.entry(v, t) for v, t in zip(values, ids[start:], strict=True)]

    @staticmethod
    def _no_images(s: Any) -> None:
        if getattr(s, "images_", None):
            raise InvalidRequestError("images are not supported by the prefill-only engine")


def _engine_start(start: int) -> int:
    """The engine returns log P(prompt[i]) for i > its start; SGLang's list begins at `start`."""
    return max(start - 1, 0) if start >= 0 else -1
