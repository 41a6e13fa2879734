"""The command-line flags generated from the settings' declarations: one `--name` per dataclass
field declared with `settings.flag(...)` metadata and one per SGLang/vLLM alias, each defaulting to
"not given" so a default exists once, on its field. launch_server builds its parser here."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from typing import Any

from po_backend.core.settings import ALIASES, FIELDS, Settings


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_fields(parser: argparse._ActionsContainer, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One `--name-with-dashes` flag per field of the dataclass `cls` declared with `flag(...)`
    metadata (the fields in `skip` and those without metadata get none). Every flag defaults to
    "not given" (argparse.SUPPRESS): what the user did not type is left to the dataclass' own
    default, so a default exists once, on its field."""
    for f in fields(cls):
        meta = f.metadata
        if f.name in skip or "help" not in meta:
            continue
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": meta["help"]}
        if f.default not in (MISSING, None, "", ()):
            kw["help"] += f" (default: {f.default})"
        if f.type in ("bool", bool):
            kw["action"] = argparse.BooleanOptionalAction
        else:
            if meta["type"] is not None:
                kw["type"] = meta["type"]
            if meta["choices"]:
                kw["choices"] = meta["choices"]
            if meta.get("nargs"):
                kw["nargs"] = meta["nargs"]
        if f.default is MISSING and f.default_factory is MISSING:
            kw["required"] = True
        parser.add_argument(_flag(f.name), **kw)


def given(ns: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The flags of `cls`' fields that the user typed (`add_fields`), by field name."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in vars(ns).items() if k in names}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags: one per `Settings` field and one per SGLang/vLLM alias, generated from
    the declarations; `settings_kwargs` hands `resolve` only what the user typed."""
    group = parser.add_argument_group("engine and scheduler (also as keyword arguments in process)")
    add_fields(group, Settings)
    names = parser.add_argument_group("SGLang / vLLM names (mapped onto the settings above)")
    for name, alias in ALIASES.items():
        kw: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": alias.help}
        if alias.type is None:
            kw["action"] = "store_true"
        else:
            kw["type"] = alias.type
        if alias.nargs:
            kw["nargs"] = alias.nargs
        names.add_argument(_flag(name), **kw)


def settings_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """What `add_arguments`' flags collected: the keyword arguments of `resolve`."""
    names = set(FIELDS) | set(ALIASES)  # in the order typed: "a and b both set x" names them so
    return {k: v for k, v in vars(ns).items() if k in names}
