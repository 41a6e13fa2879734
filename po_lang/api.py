"""`@po.classify`: a Python function that builds a prompt becomes a classifier over labels.

A call renders the prompt, compiles it (compiler.py), scores it on the backend and returns a
`Classification`. `.map` does many calls as batches, grouped by shared prefix so items that reuse
one cached prefix are scheduled together; an item that fails becomes a `Failed` in its place.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from weakref import WeakKeyDictionary

from po_lang.backends import Backend, LabelRequest
from po_lang.calibration import (
    CalibrationReport,
    accuracy,
    content_free_offsets,
    fit_offsets,
    mean_nll,
    softmax,
)
from po_lang.compiler import ChoicesMethod, ClassifySpec, Compiler, LruMemo, Program, label_scores
from po_lang.context import get_backend
from po_lang.errors import BackendError, PromptError
from po_lang.ir import Prompt, as_prompt
from po_lang.results import Classification, Failed

# What content-free calibration puts in place of each content argument.
CONTENT_FREE = "N/A"

Row = Mapping[str, Any] | tuple[Any, ...]
Calibrate = Literal["content-free"] | None


@dataclass(frozen=True)
class _Call:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class _Scored:
    """A call's scores before the fitted offsets (which `calibrate` fits on exactly these)."""

    raw: tuple[float, ...]
    base_offsets: tuple[float, ...]  # content-free offsets, or zeros
    prompt_tokens: int
    cached_tokens: int

    @property
    def base(self) -> tuple[float, ...]:
        return tuple(r + b for r, b in zip(self.raw, self.base_offsets, strict=True))


@dataclass
class _Unit:
    """One program to score: a call (`index` >= 0) or a content-free probe (`cf_key`)."""

    program: Program
    index: int = -1
    cf_key: str | None = None
    scores: tuple[float, ...] | None = None
    cached: int = 0
    error: Exception | None = None


class _BackendState:
    """Per (classifier, backend): the compiler's memo and the content-free offsets computed so far,
    keyed by the content-free prompt text (one per shared prefix, in practice)."""

    def __init__(self, backend: Backend) -> None:
        self.compiler = Compiler(backend)
        self.content_free = LruMemo(1024)


class Classifier:
    """A `@po.classify` function. Call it like the function to get a `Classification`."""

    def __init__(
        self,
        fn: Callable[..., str | Prompt],
        spec: ClassifySpec,
        *,
        calibrate: Calibrate = None,
        content_free_args: Sequence[str] | None = None,
        backend: Backend | None = None,
        batch_size: int = 64,
        lora: str | None = None,
    ) -> None:
        functools.update_wrapper(self, fn)
        self.lora = lora
        self.spec = spec
        self.signature = inspect.signature(fn)
        if calibrate not in (None, "content-free"):
            raise ValueError(f"calibrate must be None or 'content-free', got {calibrate!r}")
        if content_free_args is not None:
            unknown = set(content_free_args) - set(self.signature.parameters)
            if unknown:
                raise ValueError(f"content_free_args names no parameter of {fn.__name__}: {sorted(unknown)}")
            if calibrate is None:
                raise ValueError("content_free_args needs calibrate='content-free'")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.calibration = calibrate
        self.content_free_args = tuple(content_free_args) if content_free_args is not None else None
        self.backend = backend  # None: the current backend (po.set_backend) at call time
        self.batch_size = batch_size
        self._fn = fn
        self._fitted: tuple[float, ...] | None = None
        self._states: WeakKeyDictionary[Backend, _BackendState] = WeakKeyDictionary()

    def __repr__(self) -> str:
        return f"<po.classify {self._fn.__qualname__} labels={list(self.spec.labels)}>"

    @property
    def labels(self) -> tuple[str, ...]:
        return self.spec.labels

    @property
    def offsets(self) -> dict[str, float] | None:
        """The fitted per-label offsets (from `calibrate`), or None."""
        return None if self._fitted is None else dict(zip(self.labels, self._fitted, strict=True))

    def reset_calibration(self) -> None:
        self._fitted = None

    # ---- single calls -------------------------------------------------------------------------

    def prompt(self, *args: Any, **kwargs: Any) -> Prompt:
        """The prompt the function builds for these arguments (nothing is scored)."""
        return self._render(self._bind(args, kwargs))

    def compile(self, *args: Any, **kwargs: Any) -> Program:
        """The compiled program (ids, label ids, requests) for these arguments (nothing is scored)."""
        return self._state(self._backend()).compiler.compile(self.prompt(*args, **kwargs), self.spec)

    def __call__(self, *args: Any, **kwargs: Any) -> Classification:
        (result,) = self._finish(self._score([_Call(args, kwargs)], progress=False))
        if isinstance(result, Failed):
            raise result.error
        return result

    # ---- many calls ---------------------------------------------------------------------------

    def map(self, rows: Iterable[Row], *, progress: bool = False) -> list[Classification | Failed]:
        """Classify every row, in order. A row is a dict of keyword arguments or a tuple of
        positional ones. An item that cannot be scored (bad arguments, prompt too long, rejected
        by the backend) becomes `Failed(error, index)` in its place; the others are unaffected.
        Errors of the backend as a whole (e.g. the model cannot be loaded) raise."""
        calls = [_as_call(row) for row in rows]
        return self._finish(self._score(calls, progress=progress))

    def calibrate(self, examples: Iterable[tuple[Row, str]], *, progress: bool = False) -> CalibrationReport:
        """Fit per-label log-prob offsets on labeled `(row, label)` pairs and apply them to later
        calls (replacing any earlier fit). Rows that fail are left out and counted."""
        rows: list[_Call | Exception] = []
        gold: list[int] = []
        for row, label in examples:
            if label not in self.labels:
                raise ValueError(f"gold label {label!r} is not one of {list(self.labels)}")
            rows.append(_as_call(row))
            gold.append(self.labels.index(label))
        scored = self._score(rows, progress=progress)
        ok = [(s.base, g) for s, g in zip(scored, gold, strict=True) if isinstance(s, _Scored)]
        failures = [s for s in scored if isinstance(s, Failed)]
        if not ok:
            first = failures[0].error if failures else None
            raise ValueError(
                f"none of the {len(gold)} examples could be scored; first error: {first}"
            ) from first
        scores, golds = [s for s, _ in ok], [g for _, g in ok]
        zero = (0.0,) * len(self.labels)
        fitted = fit_offsets(scores, golds)
        self._fitted = fitted
        return CalibrationReport(
            n=len(ok),
            failed=len(failures),
            accuracy_before=accuracy(scores, golds, zero),
            accuracy_after=accuracy(scores, golds, fitted),
            nll_before=mean_nll(scores, golds, zero),
            nll_after=mean_nll(scores, golds, fitted),
            offsets=dict(zip(self.labels, fitted, strict=True)),
        )

    # ---- rendering ----------------------------------------------------------------------------

    def _bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> inspect.BoundArguments:
        try:
            return self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self._fn.__name__}{self.signature}: {e}") from None

    def _render(self, bound: inspect.BoundArguments, replace: Mapping[str, Any] | None = None) -> Prompt:
        if replace:
            bound = inspect.BoundArguments(self.signature, {**bound.arguments, **replace})
        return as_prompt(self._fn(*bound.args, **bound.kwargs))

    def _content_free_prompt(self, bound: inspect.BoundArguments, prompt: Prompt) -> Prompt:
        """The call with its content arguments replaced by "N/A". Content = `content_free_args`,
        or by default every passed argument that does not feed the shared segment (so the probe
        shares the call's prefix and is computed once per prefix)."""
        if self.content_free_args is not None:
            names = [n for n in self.content_free_args if n in bound.arguments]
        else:
            names = []
            for name in bound.arguments:
                if self.signature.parameters[name].kind in (
                    inspect.Parameter.VAR_POSITIONAL,
                    inspect.Parameter.VAR_KEYWORD,
                ):
                    continue
                try:
                    trial = self._render(bound, {name: CONTENT_FREE})
                except Exception:
                    continue  # the function cannot take "N/A" here: treat it as fixed
                if trial.shared_text == prompt.shared_text:
                    names.append(name)
        if not names:
            raise PromptError(
                "content-free calibration found no argument outside the shared prefix to replace by "
                f"{CONTENT_FREE!r}; name them with content_free_args=(...)"
            )
        return self._render(bound, dict.fromkeys(names, CONTENT_FREE))

    # ---- scoring ------------------------------------------------------------------------------

    def _backend(self) -> Backend:
        return self.backend if self.backend is not None else get_backend()

    def _state(self, backend: Backend) -> _BackendState:
        state = self._states.get(backend)
        if state is None:
            state = self._states[backend] = _BackendState(backend)
        return state

    def _score(self, calls: Sequence[_Call | Exception], *, progress: bool) -> list[_Scored | Failed]:
        backend = self._backend()
        state = self._state(backend)
        out: list[_Scored | Failed | None] = [None] * len(calls)
        units: list[_Unit] = []
        probes: dict[str, _Unit] = {}
        for i, call in enumerate(calls):
            try:
                if isinstance(call, Exception):
                    raise call
                bound = self._bind(call.args, call.kwargs)
                prompt = self._render(bound)
                unit = _Unit(state.compiler.compile(prompt, self.spec), index=i)
                if self.calibration == "content-free":
                    cf_prompt = self._content_free_prompt(bound, prompt)
                    unit.cf_key = cf_prompt.text
                    if state.content_free.get(unit.cf_key) is None and unit.cf_key not in probes:
                        probe = _Unit(state.compiler.compile(cf_prompt, self.spec), cf_key=unit.cf_key)
                        probes[unit.cf_key] = probe
                units.append(unit)
            except Exception as e:
                out[i] = Failed(e, i)
        bar = _progress(len(calls), progress, self._fn.__name__)
        bar.update(sum(o is not None for o in out))
        # Probes first: each lands at the head of its prefix group, ahead of the calls it serves.
        self._run(backend, [*probes.values(), *units], bar)
        bar.close()
        for probe in probes.values():
            if probe.scores is not None:
                state.content_free.put(probe.cf_key, content_free_offsets(probe.scores))
        zero = (0.0,) * len(self.labels)
        for u in units:
            base = zero
            if u.error is None and u.cf_key is not None:
                hit = state.content_free.get(u.cf_key)
                if hit is None:
                    err = probes[u.cf_key].error
                    u.error = BackendError(f"the content-free calibration probe failed: {err}")
                    u.error.__cause__ = err
                else:
                    base = hit  # type: ignore[assignment]
            if u.error is not None or u.scores is None:
                out[u.index] = Failed(u.error or BackendError("not scored"), u.index)
            else:
                out[u.index] = _Scored(u.scores, base, len(u.program.prompt.ids), u.cached)
        assert all(o is not None for o in out), "every call has a result"
        return out  # type: ignore[return-value]

    def _run(self, backend: Backend, units: list[_Unit], bar: Any) -> None:
        """Score units in batches of ~batch_size requests, units sharing a prefix kept together
        (the backend packs and caches them together), each unit's requests in one batch."""
        groups: dict[tuple[int, ...], list[_Unit]] = {}
        for u in units:
            p = u.program.prompt
            groups.setdefault(p.ids[: p.cache_prefix_len or 0], []).append(u)
        batch: list[_Unit] = []
        for group in groups.values():
            for u in group:
                batch.append(u)
                if sum(len(b.program.requests) for b in batch) >= self.batch_size:
                    self._run_batch(backend, batch, bar)
                    batch = []
        if batch:
            self._run_batch(backend, batch, bar)

    def _run_batch(self, backend: Backend, batch: list[_Unit], bar: Any) -> None:
        requests: list[LabelRequest] = [r for u in batch for r in u.program.requests]
        if self.lora is not None:
            requests = [dataclasses.replace(r, lora=self.lora) for r in requests]
        outcomes = backend.score(requests)
        if len(outcomes) != len(requests):
            raise BackendError(f"the backend returned {len(outcomes)} outcomes for {len(requests)} requests")
        at = 0
        for u in batch:
            mine = outcomes[at : at + len(u.program.requests)]
            at += len(u.program.requests)
            errors = [o for o in mine if isinstance(o, Exception)]
            if errors:
                u.error = errors[0]
            else:
                try:
                    u.scores = label_scores(mine, u.program.label_ids, self.spec)  # type: ignore[arg-type]
                    u.cached = max(o.cached_tokens for o in mine)  # type: ignore[union-attr]
                except Exception as e:
                    u.error = e
            if u.index >= 0:
                bar.update(1)

    def _finish(self, scored: list[_Scored | Failed]) -> list[Classification | Failed]:
        fitted = self._fitted or (0.0,) * len(self.labels)
        out: list[Classification | Failed] = []
        for s in scored:
            if isinstance(s, Failed):
                out.append(s)
                continue
            probs = softmax([b + f for b, f in zip(s.base, fitted, strict=True)])
            best = max(range(len(probs)), key=probs.__getitem__)
            out.append(
                Classification(
                    label=self.labels[best],
                    probs=dict(zip(self.labels, probs, strict=True)),
                    logprobs=dict(zip(self.labels, s.raw, strict=True)),
                    prompt_tokens=s.prompt_tokens,
                    cached_tokens=s.cached_tokens,
                )
            )
        return out


@dataclass(frozen=True)
class Parameters:
    """How a classifier's parameters bind to a row's fields (a dataset's columns, a file's keys):
    by name, so `*args` takes none and `**kwargs` takes every other field."""

    names: tuple[str, ...]  # every parameter a field can bind, in signature order
    required: tuple[str, ...]  # of those, the ones without a default
    positional_only: tuple[str, ...]  # of those, the ones a name cannot reach
    var_keyword: bool  # `**kwargs`: every other field goes there too


def parameters(signature: inspect.Signature) -> Parameters:
    kinds = signature.parameters
    named = [n for n, p in kinds.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return Parameters(
        names=tuple(named),
        required=tuple(n for n in named if kinds[n].default is inspect.Parameter.empty),
        positional_only=tuple(n for n in named if kinds[n].kind is inspect.Parameter.POSITIONAL_ONLY),
        var_keyword=any(p.kind is inspect.Parameter.VAR_KEYWORD for p in kinds.values()),
    )


def classify(
    labels: Sequence[str],
    *,
    chat: bool = False,
    system: str | None = None,
    multi_token: bool = False,
    choices_method: ChoicesMethod = "sum",
    leading_space: bool | None = None,
    calibrate: Calibrate = None,
    content_free_args: Sequence[str] | None = None,
    backend: Backend | None = None,
    batch_size: int = 64,
    lora: str | None = None,
) -> Callable[[Callable[..., str | Prompt]], Classifier]:
    """Turn a prompt-building function into a classifier over `labels`.

    - `chat=True`: wrap the prompt in the tokenizer's chat template (as the user message, after an
      optional `system` message); the template head joins the shared prefix.
    - `multi_token=True`: labels may be several tokens (or share a first token); each label's full
      continuation is scored in the same prefill, `choices_method` "sum" or "mean" (per token).
    - `leading_space`: None = a space before each label unless the prompt ends in whitespace.
    - `calibrate="content-free"`: divide by the label probabilities of the call with its content
      arguments replaced by "N/A" (`content_free_args`, default: those outside the shared part).
    - `backend`: pin one backend; default is the current one (`po.set_backend`).
    - `batch_size`: requests per backend call in `.map` / `rank`.
    - `lora`: the LoRA adapter (its name as the backend loaded it) every call runs with; None: the
      backend's default (`po.Local(lora=...)`, `po.Remote(lora=...)`), else the base model.
    """
    spec = ClassifySpec(
        labels=tuple(labels),
        chat=chat,
        system=system,
        multi_token=multi_token,
        choices_method=choices_method,
        leading_space=leading_space,
    )

    def decorate(fn: Callable[..., str | Prompt]) -> Classifier:
        return Classifier(
            fn,
            spec,
            calibrate=calibrate,
            content_free_args=content_free_args,
            backend=backend,
            batch_size=batch_size,
            lora=lora,
        )

    return decorate


def _as_call(row: object) -> _Call | Exception:
    if isinstance(row, Mapping):
        return _Call((), dict(row))
    if isinstance(row, tuple):
        return _Call(row, {})
    return TypeError(
        f"a row must be a dict (keyword arguments) or a tuple (positional arguments), got "
        f"{type(row).__name__}; for one argument use (value,)"
    )


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool, desc: str) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm  # lazy: only when a bar is asked for

    return tqdm(total=total, desc=desc, unit="item")
