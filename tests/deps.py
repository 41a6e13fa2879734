"""Optional dependencies of the tests. A missing import skips the test that needs it (and nothing
else may skip); with `PO_REQUIRE_DEPS=1` (what `scripts/dev.sh test`, and so CI, sets) the same
test fails instead, so a dependency CI installs cannot vanish behind a quiet skip."""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest

REQUIRE_ENV = "PO_REQUIRE_DEPS"


def deps_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip() not in ("", "0")


def missing(reason: str) -> NoReturn:
    """Skip (at test or module level) for a dependency that is not installed; fail under
    PO_REQUIRE_DEPS=1."""
    if deps_required():
        pytest.fail(f"{reason} [{REQUIRE_ENV}=1: expected to be installed]", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require(module: str, hint: str = "") -> ModuleType:
    """`import module`, or `missing(...)` when it cannot be imported. Any other error while
    importing it propagates: a broken install is a failure, not a skip."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing(f"{module} cannot be imported ({e})" + (f"; {hint}" if hint else ""))
