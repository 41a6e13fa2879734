"""Import SGLang's frontend language (`sgl.function`, `select`, `gen`, `RuntimeEndpoint`, the
backend interface) without SGLang's server runtime, so unmodified SGLang programs run on our
server or in process.

SGLang pins a CUDA torch, so it is installed here with `pip install --no-deps sglang==0.5.23`.
`import sglang` would then fail: sglang/__init__.py imports the SRT server runtime (orjson,
torch-only helpers, transformers patches) that a frontend never uses. `import_sglang_frontend`
skips that __init__ and stubs the few third-party modules the frontend imports at module level
but never uses on the select/gen path. Only the standard library is imported here (never torch,
so po_lang can use it); SGLang's own frontend modules are imported when the function is called.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

# Imported by `sglang.lang` / `sglang.utils` at module level but used only for images (pybase64),
# notebooks (IPython.display), the async client (aiohttp) and launching SGLang's own server
# (msgspec): none is on the path of select/gen. A stub is installed only when the real module
# is missing.
_FRONTEND_ONLY_STUBS: dict[str, dict[str, object]] = {
    "IPython": {},
    "IPython.display": {"HTML": None, "display": None},
    "pybase64": {},
    "msgspec": {},
    "msgspec.structs": {},
    "aiohttp": {},
}


def import_sglang_frontend() -> types.SimpleNamespace:
    """SGLang's frontend API as a namespace: `function, select, gen, set_default_backend,
    RuntimeEndpoint`, and for backends `BaseBackend, ChoicesDecision, get_chat_template,
    get_chat_template_by_model_path, global_config, compute_normalized_prompt_logprobs`. Raises ImportError when sglang is not
    installed.

    A bare package module whose __path__ is the installed sglang folder stands in for `sglang`
    (so its __init__ is skipped); `sglang.lang.*` then import normally from that folder.
    """
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed (pip install --no-deps sglang==0.5.23)")
    if "sglang" not in sys.modules:
        pkg = types.ModuleType("sglang")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__spec__ = spec
        sys.modules["sglang"] = pkg
    for name, attrs in _FRONTEND_ONLY_STUBS.items():
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except ImportError:
            mod = types.ModuleType(name)
            mod.__dict__.update(attrs)
            sys.modules[name] = mod
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, mod)
    api = importlib.import_module("sglang.lang.api")
    endpoint = importlib.import_module("sglang.lang.backend.runtime_endpoint")
    base = importlib.import_module("sglang.lang.backend.base_backend")
    choices = importlib.import_module("sglang.lang.choices")
    templates = importlib.import_module("sglang.lang.chat_template")
    config = importlib.import_module("sglang.lang.global_config")
    return types.SimpleNamespace(
        function=api.function,
        select=api.select,
        gen=api.gen,
        set_default_backend=api.set_default_backend,
        RuntimeEndpoint=endpoint.RuntimeEndpoint,
        compute_normalized_prompt_logprobs=endpoint.compute_normalized_prompt_logprobs,
        BaseBackend=base.BaseBackend,
        ChoicesDecision=choices.ChoicesDecision,
        get_chat_template=templates.get_chat_template,
        get_chat_template_by_model_path=templates.get_chat_template_by_model_path,
        global_config=config.global_config,
    )
