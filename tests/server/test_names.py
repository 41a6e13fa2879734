"""One meaning per name: the SGLang drop-in keeps its public name, the second `load_model` is the
JCT profile's `load_jct_model`, and a worker that takes no new work (a closed loop, a draining
server) is `UnavailableError`, not `OverloadedError`: the server answers it 503 "unavailable"
with Retry-After, and a full queue 503 "overloaded"."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from po_backend.core.errors import (
    DrainingError,
    LoopClosedError,
    OverloadedError,
    PrefillOnlyError,
    UnavailableError,
)
from po_backend.core.settings import Settings
from po_backend.server import ServerArgs, create_app
from tests.server_utils import FakeService


def test_public_names() -> None:
    from po_backend.compat import sglang
    from po_backend.engine.models import loader
    from po_backend.serving import jct_store

    assert sglang.Engine is sglang.SGLangEngine
    assert callable(jct_store.load_jct_model) and not hasattr(jct_store, "load_model")
    assert callable(loader.load_model)  # the weights loader keeps the name


@pytest.mark.parametrize("error", [LoopClosedError, DrainingError])
def test_unavailable_is_not_overloaded(error: type[PrefillOnlyError]) -> None:
    assert issubclass(error, UnavailableError) and not issubclass(error, OverloadedError)


@pytest.mark.parametrize(
    ("error", "word"),
    [
        (LoopClosedError("the engine loop is shutting down"), "unavailable"),
        (DrainingError("the server is shutting down"), "unavailable"),
        (OverloadedError("queue full (max_queue=3); retry later"), "overloaded"),
    ],
)
def test_503_with_retry_after(error: PrefillOnlyError, word: str) -> None:
    app = create_app(FakeService(refuse=error), ServerArgs(engine=Settings(model_path="m")))
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/generate", json={"input_ids": [1, 2, 3]})
    assert r.status_code == 503 and r.headers.get("retry-after")
    assert word in r.text and str(error) in r.text
