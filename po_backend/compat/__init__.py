"""Drop-in compatibility with SGLang's Python APIs, run on our engine in this process.

- `po_backend.compat.sglang.Engine`: SGLang's offline `sglang.Engine` (`score`,
  `get_server_info`, `shutdown`); the class is `SGLangEngine`.
- `po_backend.compat.vllm.LLM`: vLLM's offline pooling API (`embed`, `classify`, `score`,
  `encode`) for embedders and classifier heads.
- `po_backend.compat.sgl_backend.PrefillOnlyBackend`: a frontend backend for `@sgl.function`
  programs (`sgl.set_default_backend(PrefillOnlyBackend("embedded"))`).
- `po_backend.compat.frontend.import_sglang_frontend`: SGLang's frontend without its server
  runtime (torch-free; po_lang uses it too).

Exports resolve lazily so importing `po_backend.compat.frontend` never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "po_backend.compat.sglang",
    "LLM": "po_backend.compat.vllm",
    "SGLangEngine": "po_backend.compat.sglang",
    "PrefillOnlyBackend": "po_backend.compat.sgl_backend",
    "import_sglang_frontend": "po_backend.compat.frontend",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'po_backend.compat' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
