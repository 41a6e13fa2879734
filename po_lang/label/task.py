"""What labels a row: a template with `{field}` placeholders, or a `@po.classify` function.

A template becomes a chat classifier whose text up to the first `{field}` is `po.shared` (the
instruction, computed once and served from the prefix cache for every row); `{labels}` is
filled with the labels ("positive or negative"). A function (`--function module:name` or
`file.py:name`) is rebuilt on the chosen backend with its own settings; its parameters bind to the
row's fields by name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import json
import re
import string
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from po_lang.api import Calibrate, Classifier, classify, parameters
from po_lang.backends import Backend
from po_lang.ir import Prompt, shared
from po_lang.label.source import UsageError

# Bump when the prompt a template builds changes, so old records are not reused for a new prompt.
PROMPT_VERSION = 2
LABELS_FIELD = "labels"  # the template placeholder filled with the labels, not read from rows

Piece = tuple[str, str | None, str | None, str | None]  # string.Formatter().parse's tuples
_FORMATTER = string.Formatter()


@dataclass(frozen=True)
class Task:
    """A classifier bound to the backend, and how a row's fields become its arguments."""

    classifier: Classifier
    required: tuple[str, ...]  # fields every row must have
    params: tuple[str, ...] | None  # the fields passed (when present); None: every field
    text_fields: bool  # the fields must hold text (a template's) or may hold anything (a function's)
    identity: str  # what built the prompt, for the setup's fingerprint
    fitted_on: str = ""  # content hash of the --calibrate file offsets are (to be) fitted on

    @property
    def labels(self) -> tuple[str, ...]:
        return self.classifier.labels

    def kwargs(self, data: Mapping[str, Any]) -> dict[str, Any]:
        if self.params is None:
            return dict(data)
        return {k: data[k] for k in self.params if k in data}

    @property
    def fingerprint(self) -> str:
        fn = self.classifier
        blob = json.dumps(
            {
                "labels": list(fn.labels),
                "prompt": self.identity,
                "spec": repr(fn.spec),
                "calibrate": fn.calibration,
                "content_free_args": fn.content_free_args,
                "offsets": self.fitted_on or fn.offsets,
                "version": PROMPT_VERSION,
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def fit_calibration(self, examples: Sequence[tuple[Mapping[str, Any], str]], source: Path) -> Task:
        """Fit per-label offsets on (row, gold label) pairs from `source` (whose hash is already
        in `fitted_on`: the fingerprint is known before the fit); prints the report."""
        report = self.classifier.calibrate([(self.kwargs(d), g) for d, g in examples])
        print(
            f"calibrated on {report.n} labeled rows of {source.name}: accuracy {report.accuracy_before:.1%} "
            f"-> {report.accuracy_after:.1%} on them; offsets "
            + ", ".join(f"{k} {v:+.2f}" for k, v in report.offsets.items())
        )
        return self


# ---- templates ----------------------------------------------------------------------------------


def parse_template(template: str) -> tuple[list[Piece], tuple[str, ...]]:
    """The template's pieces and the row fields it reads; a clear UsageError when malformed."""
    try:
        pieces: list[Piece] = list(_FORMATTER.parse(template))
    except ValueError as e:
        raise UsageError(f"--template: {e} (write a literal brace as {{{{ or }}}})") from None
    fields: list[str] = []
    for _, name, _, _ in pieces:
        if name is None:
            continue
        root = re.split(r"[.\[]", name, maxsplit=1)[0]
        if not root or root.isdigit():
            raise UsageError(f"--template: the placeholder {{{name}}} names no field; write {{field_name}}")
        if root != LABELS_FIELD and root not in fields:
            fields.append(root)
    if not fields:
        raise UsageError("--template has no {field} placeholder: it would give every row the same prompt")
    return pieces, tuple(fields)


def _render(pieces: Sequence[Piece], values: Mapping[str, Any]) -> str:
    out: list[str] = []
    for literal, name, spec, conv in pieces:
        out.append(literal)
        if name is not None:
            obj, _ = _FORMATTER.get_field(name, (), values)
            out.append(_FORMATTER.format_field(_FORMATTER.convert_field(obj, conv), spec or ""))
    return "".join(out)


def template_function(
    template: str, labels: Sequence[str]
) -> tuple[Callable[..., Prompt | str], tuple[str, ...]]:
    """A prompt function `fn(**row)` for the template, and the fields it reads. The text before
    the first row field is the shared prefix."""
    pieces, fields = parse_template(template)
    filled = {LABELS_FIELD: " or ".join(labels)}
    first = next(i for i, p in enumerate(pieces) if p[1] is not None and p[1].split(".")[0] != LABELS_FIELD)
    head = _render([*pieces[:first], (pieces[first][0], None, None, None)], filled)
    tail: list[Piece] = [("", *pieces[first][1:]), *pieces[first + 1 :]]

    def label_row(**row: Any) -> Prompt | str:
        text = _render(tail, {**row, **filled})
        return shared(head) + text if head else text

    # One keyword parameter per field: rows bind by name, and content-free calibration finds the
    # arguments outside the shared prefix to replace.
    label_row.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(f, inspect.Parameter.KEYWORD_ONLY) for f in fields]
    )
    return label_row, fields


def from_template(
    template: str,
    labels: Sequence[str],
    *,
    chat: bool,
    calibrate: Calibrate,
    backend: Backend,
    batch_size: int,
) -> Task:
    """A chat classifier by default (the template is the user message); the label tokens then
    follow the template's `assistant\\n`, so they carry no leading space."""
    fn, fields = template_function(template, labels)
    clf = classify(list(labels), chat=chat, calibrate=calibrate, backend=backend, batch_size=batch_size)(fn)
    return Task(clf, fields, fields, True, f"template:{template}")


# ---- functions ----------------------------------------------------------------------------------


def load_function(spec: str) -> Classifier:
    """`module:name` (importable from the current folder) or `path/to/file.py:name`."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise UsageError(f"--function {spec!r}: write MODULE:NAME or FILE.py:NAME")
    if where.endswith(".py") or "/" in where:
        path = Path(where)
        if not path.is_file():
            raise UsageError(f"--function {spec!r}: no such file {path}")
        mod_name = f"po_label_{path.stem}_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]}"
        mod_spec = importlib.util.spec_from_file_location(mod_name, path)
        assert mod_spec is not None and mod_spec.loader is not None
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[mod_name] = module  # dataclasses and pickling look their module up by name
        mod_spec.loader.exec_module(module)
    else:
        if "" not in sys.path:
            sys.path.insert(0, "")  # as `python -m` does: modules of the current folder
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise UsageError(f"--function {spec!r}: cannot import {where!r} ({e})") from None
    obj = getattr(module, name, None)
    if obj is None:
        raise UsageError(f"--function {spec!r}: {where} has no {name!r}")
    if not isinstance(obj, Classifier):
        raise UsageError(f"--function {spec!r} is a {type(obj).__name__}, not a @po.classify function")
    return obj


def from_function(
    fn: Classifier, *, calibrate: Calibrate | str | None, backend: Backend, batch_size: int
) -> Task:
    """`fn` rebuilt on `backend`; `calibrate` ("none" / "content-free") replaces its own setting."""
    from po_lang.ray import _Recipe  # the one way a classifier is rebuilt on another backend

    recipe = _Recipe.of(fn)
    if calibrate == "none":
        recipe = dataclasses.replace(recipe, calibrate=None, content_free_args=None)
    elif calibrate == "content-free":
        recipe = dataclasses.replace(recipe, calibrate="content-free")
    ps = parameters(fn.signature)
    if ps.positional_only:
        raise UsageError(
            f"{fn!r}: parameter {ps.positional_only[0]!r} is positional-only; fields bind by name"
        )
    try:
        source = inspect.getsource(fn.__wrapped__)  # type: ignore[attr-defined]
    except (OSError, TypeError):
        source = ""
    name = getattr(fn, "__qualname__", repr(fn))
    identity = f"function:{fn.__module__}:{name}:{hashlib.sha256(source.encode()).hexdigest()[:16]}"
    clf = recipe.build(backend, batch_size)
    return Task(clf, ps.required, None if ps.var_keyword else ps.names, False, identity)


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
