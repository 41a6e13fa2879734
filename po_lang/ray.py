"""Offline labeling at scale: a `@po.classify` function over a Ray Dataset, one engine per actor.

    import ray
    from po_lang.ray import classify_dataset, hit_rate

    ds = ray.data.read_json("posts.jsonl")               # columns: profile, post, ...
    out = classify_dataset(will_engage, ds, concurrency=4, batch_size=64).materialize()
    out.write_json("labeled/")                           # + label, probs, error, *_tokens
    print(hit_rate(out))                                 # share of prompt tokens from the cache

How it runs:
- Columns map to the function's parameters by name (a parameter with a default may be missing;
  extra columns pass through untouched). A parameter without a column is a ValueError up front.
- Rows are first sorted by a key of their `po.shared` text (rendered by the function itself, no
  model or torch needed), so the rows sharing a prefix sit next to each other in the same block:
  the actor that gets the block computes the prefix once and serves the rest from its cache.
  This is an all-to-all sort (a shuffle) and the output comes back in prefix order, not input
  order: carry an id column to join back. `group_by_prefix=False` skips it.
- `map_batches` with a callable class and `concurrency=N`: an actor pool of N, each actor loads its
  engine (`po.Local(model, **engine_options)`, or `model()` when `model` is a backend factory) once
  and labels batch after batch with `fn.map`.
- Every input row comes out: rows that cannot be scored (a prompt longer than max_input_len, a
  function that raises on the row's values) get `error` (the message) and null `label`/`probs`.
  A backend that fails as a whole (the model cannot be loaded, a server that cannot be reached:
  `BackendUnavailable`) fails the job, as in `fn.map`.

Only `import po_lang.ray` imports ray (lazily, when called); `import po_lang` never does.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from po_backend.core.settings import resolve
from po_lang.api import Calibrate, Classifier, classify, parameters
from po_lang.backends import Backend
from po_lang.compiler import ClassifySpec
from po_lang.errors import BackendUnavailable
from po_lang.ir import Prompt
from po_lang.local import Local
from po_lang.results import Failed

if TYPE_CHECKING:  # ray is an optional dependency (the [ray] extra)
    import pandas as pd
    import ray.data

# Columns classify_dataset adds. A dataset that already has one of them is refused (it would be
# silently overwritten).
OUTPUT_COLUMNS = ("label", "probs", "error", "prompt_tokens", "cached_tokens")
PREFIX_COLUMN = "__po_prefix"  # the grouping key; dropped before the result is returned

ModelSpec = str | os.PathLike[str] | Callable[[], Backend]


@dataclass(frozen=True)
class _Recipe:
    """What an actor needs to rebuild the classifier: the plain function and its settings.

    A `Classifier` itself is not shipped: it holds per-backend state (weak references, a loaded
    engine when it pins a `Local`) that neither pickles nor belongs on another machine."""

    fn: Callable[..., str | Prompt]
    spec: ClassifySpec
    calibrate: Calibrate
    content_free_args: tuple[str, ...] | None
    offsets: tuple[float, ...] | None  # fitted by `fn.calibrate` on the driver, carried over

    @classmethod
    def of(cls, fn: Classifier) -> _Recipe:
        offsets = None if fn.offsets is None else tuple(fn.offsets[label] for label in fn.labels)
        return cls(fn.__wrapped__, fn.spec, fn.calibration, fn.content_free_args, offsets)  # type: ignore[attr-defined]

    def build(self, backend: Backend | None, batch_size: int) -> Classifier:
        s = self.spec
        clf = classify(
            list(s.labels),
            chat=s.chat,
            system=s.system,
            multi_token=s.multi_token,
            choices_method=s.choices_method,
            leading_space=s.leading_space,
            calibrate=self.calibrate,
            content_free_args=self.content_free_args,
            backend=backend,
            batch_size=batch_size,
        )(self.fn)
        # The fitted offsets have no public setter: calibrating again would need the gold data.
        clf._fitted = self.offsets
        return clf


@dataclass(frozen=True)
class _Columns:
    """Which columns feed which parameters."""

    params: tuple[str, ...]  # named parameters that have a column
    var_keyword: bool  # the function takes **kwargs: every other column goes there too

    def kwargs(self, row: Mapping[str, Any]) -> dict[str, Any]:
        if self.var_keyword:
            return {k: v for k, v in row.items() if k not in OUTPUT_COLUMNS and k != PREFIX_COLUMN}
        return {k: row[k] for k in self.params}


def match_columns(fn: Classifier, columns: Sequence[str]) -> _Columns:
    """Map dataset columns to `fn`'s parameters by name; a required parameter without a column, or
    one only passable by position, is a ValueError that names the columns there are."""
    ps = parameters(fn.signature)
    unreachable = [n for n in ps.positional_only if n in columns]
    if unreachable:
        raise ValueError(
            f"{_name(fn)}: parameter {unreachable[0]!r} is positional-only; columns bind by name"
        )
    params = [n for n in ps.names if n in columns]
    missing = [n for n in ps.required if n not in columns]
    if missing:
        raise ValueError(
            f"{_name(fn)}{fn.signature}: no column for parameter(s) {missing}; the dataset has columns "
            f"{list(columns)} (rename them, e.g. ds.rename_columns({{...}}), to the parameter names)"
        )
    clash = [c for c in (*OUTPUT_COLUMNS, PREFIX_COLUMN) if c in columns]
    if clash:
        raise ValueError(f"the dataset already has column(s) {clash} that classify_dataset adds; rename them")
    return _Columns(tuple(params), ps.var_keyword)


def prefix_key(fn: Classifier, kwargs: Mapping[str, Any]) -> str:
    """A short hash of the row's shared (cached) text, "" when it shares nothing or its prompt
    cannot be rendered (it fails again, with its message, when labeled). The function's own
    rendering: no tokenizer, model or torch. With chat=True the template head joins every shared
    prefix alike, so the shared text alone decides the grouping."""
    try:
        shared = fn.prompt(**kwargs).shared_text
    except Exception:
        return ""
    if not shared:
        return ""
    return hashlib.blake2b(shared.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


def _add_prefix_keys(batch: pd.DataFrame, recipe: _Recipe, columns: _Columns) -> pd.DataFrame:
    """The grouping key column (a stateless task: rendering a prompt needs no backend)."""
    fn = recipe.build(None, 1)
    batch[PREFIX_COLUMN] = [prefix_key(fn, columns.kwargs(r)) for r in batch.to_dict("records")]
    return batch


class _Labeler:
    """One actor: one backend (loaded on the first batch, kept for the actor's life), one
    classifier bound to it; each batch is one `fn.map`."""

    def __init__(
        self,
        recipe: _Recipe,
        columns: _Columns,
        model: ModelSpec,
        engine_options: dict[str, Any],
        batch_size: int,
    ) -> None:
        backend = model() if callable(model) else Local(model, **engine_options)
        self.fn = recipe.build(backend, batch_size)
        self.columns = columns

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        rows = batch.to_dict("records")
        results = self.fn.map([self.columns.kwargs(r) for r in rows])
        labels: list[str | None] = []
        probs: list[dict[str, float] | None] = []
        errors: list[str | None] = []
        prompt_tokens: list[int] = []
        cached_tokens: list[int] = []
        for res in results:
            if isinstance(res, Failed) and isinstance(res.error, BackendUnavailable):
                # The backend is down (a server that cannot be reached): fail the job, as a backend
                # that cannot be loaded does, rather than turn every row into an error row.
                raise res.error
            if isinstance(res, Failed):
                labels.append(None)
                probs.append(None)
                errors.append(f"{type(res.error).__name__}: {res.error}")
                prompt_tokens.append(0)
                cached_tokens.append(0)
            else:
                labels.append(res.label)
                probs.append(dict(res.probs))
                errors.append(None)
                prompt_tokens.append(res.prompt_tokens)
                cached_tokens.append(res.cached_tokens)
        out = batch.drop(columns=[PREFIX_COLUMN], errors="ignore")
        out["label"] = labels
        out["probs"] = probs
        out["error"] = errors
        out["prompt_tokens"] = prompt_tokens
        out["cached_tokens"] = cached_tokens
        return out


def classify_dataset(
    fn: Classifier,
    ds: ray.data.Dataset,
    *,
    model: ModelSpec = "embedded",
    concurrency: int | tuple[int, int] = 1,
    batch_size: int = 64,
    group_by_prefix: bool = True,
    num_cpus: float | None = None,
    num_gpus: float | None = None,
    **engine_options: Any,
) -> ray.data.Dataset:
    """Label every row of `ds` with `fn` on a pool of actors; returns the (lazy) dataset with the
    columns `label`, `probs` ({label: p}), `error` (None, or why the row could not be scored),
    `prompt_tokens` and `cached_tokens` added.

    - `model`: what each actor loads, `po.Local(model, **engine_options)` (a path, a GGUF file,
      "embedded"); or a zero-argument callable that returns a backend (e.g. `lambda: po.Remote(url)`
      to fan out to servers). The backend `fn` pins with `backend=` is not used on the actors.
    - `concurrency`: actors (engines); an int, or (min, max) for an autoscaling pool.
    - `batch_size`: rows per `fn.map` call on an actor.
    - `group_by_prefix`: sort rows by their shared prefix first (see the module docstring).
    - `num_cpus` / `num_gpus`: each actor's reservation (Ray's defaults when None). Ray sets the
      actor's OMP threads to its CPUs, so give an engine several: `num_cpus=4`.
    """
    if not isinstance(fn, Classifier):
        raise TypeError(f"classify_dataset needs a @po.classify function, got {type(fn).__name__}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if isinstance(concurrency, int) and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if callable(model) and engine_options:
        raise ValueError(
            f"engine options {sorted(engine_options)} go to po.Local; a backend factory takes none"
        )
    if not callable(model):
        resolve(model, **engine_options)  # the settings' checks, once, before any actor starts
    columns = match_columns(fn, ds.schema().names)
    recipe = _Recipe.of(fn)
    if group_by_prefix:
        keyed = ds.map_batches(
            _add_prefix_keys,  # type: ignore[arg-type]  # ray types the UDF without its fn_kwargs
            batch_format="pandas",
            fn_kwargs={"recipe": recipe, "columns": columns},
        )
        ds = keyed.sort(PREFIX_COLUMN)
    remote_args: dict[str, Any] = {}
    if num_cpus is not None:
        remote_args["num_cpus"] = num_cpus
    if num_gpus is not None:
        remote_args["num_gpus"] = num_gpus
    import ray.data  # lazy: the [ray] extra; `import po_lang` stays ray-free

    lo, hi = (concurrency, concurrency) if isinstance(concurrency, int) else concurrency
    return ds.map_batches(
        _Labeler,
        batch_format="pandas",
        batch_size=batch_size,
        fn_constructor_args=(recipe, columns, model, dict(engine_options), batch_size),
        compute=ray.data.ActorPoolStrategy(min_size=lo, max_size=hi),
        **remote_args,
    )


def hit_rate(ds: ray.data.Dataset) -> float:
    """Prompt tokens served from the actors' prefix caches over all prompt tokens (of a
    `classify_dataset` result; materialize it first, or this runs the job again)."""
    # Dataset.sum of one column is a number (a dict only when given several columns).
    prompt = float(cast(float, ds.sum("prompt_tokens")) or 0)
    cached = float(cast(float, ds.sum("cached_tokens")) or 0)
    return cached / prompt if prompt else 0.0


def _name(fn: Classifier) -> str:
    # update_wrapper copies the function's name onto the Classifier at run time.
    return str(getattr(fn, "__name__", fn))
