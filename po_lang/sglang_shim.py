"""Import SGLang's frontend language (`sgl.function`, `select`, `gen`, `RuntimeEndpoint`) without
SGLang's server runtime. The shim lives in `po_backend.compat.frontend` (torch-free, standard
library only) so the in-process frontend backend uses the same one; re-exported here."""

from __future__ import annotations

from po_backend.compat.frontend import import_sglang_frontend

__all__ = ["import_sglang_frontend"]
