"""The engine's tokenizer (`load_tokenizer`) is the one `AutoTokenizer` loads: the same class and the
same tokens, whether it was loaded through AutoTokenizer or, for a folder naming transformers'
generic fast tokenizer, directly (which spares every engine start AutoTokenizer's config lookup)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from po_backend.engine.models.loader import generic_tokenizer_class, load_tokenizer

TEXTS = [
    "User profile:\nlikes cats and dogs\nPost: a cat video\nWill the user engage? Answer: Yes",
    " Yes",
    "unseen wörds 123 !?",
    "<|im_start|>user\nhello<|im_end|>\n",
    "",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]


def with_model_type(src: Path, dst: Path, model_type: str) -> Path:
    """The tokenizer files of `src` beside a config.json that names `model_type` (AutoTokenizer
    reads the model type to decide the class; the weights do not matter here)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = model_type
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3"])
def test_same_tokenizer_as_auto_tokenizer(tokenized_llama: Path, tmp_path: Path, model_type: str) -> None:
    from transformers import AutoTokenizer

    folder = with_model_type(tokenized_llama, tmp_path / model_type, model_type)
    ours, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert type(ours) is type(auto)
    assert len(ours) == len(auto) and ours.special_tokens_map == auto.special_tokens_map
    assert ours.eos_token_id == auto.eos_token_id and ours.bos_token_id == auto.bos_token_id
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == auto.encode(text, add_special_tokens=special)
            assert ours.decode(ids) == auto.decode(ids)
            assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == (
        auto.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    )
    if model_type == "llama":  # what every test server and the embedded model load: the direct path
        assert generic_tokenizer_class(folder) is type(auto)
    if model_type == "qwen2":  # transformers overrides the declared class for this type: AutoTokenizer's
        assert generic_tokenizer_class(folder) is None and type(auto).__name__ != "TokenizersBackend"


def test_folders_it_leaves_to_auto_tokenizer(tokenized_llama: Path, tmp_path: Path) -> None:
    """Another declared class, remote code or no model type: AutoTokenizer decides."""
    cases = {
        "declared": ("tokenizer_config.json", {"tokenizer_class": "LlamaTokenizer"}),
        "remote": ("tokenizer_config.json", {"auto_map": {"AutoTokenizer": [None, "x.Tok"]}}),
        "config_remote": ("config.json", {"auto_map": {"AutoConfig": "x.Config"}}),
        "no_type": ("config.json", {"model_type": None}),
    }
    for name, (file, change) in cases.items():
        folder = with_model_type(tokenized_llama, tmp_path / name, "llama")
        data = {**json.loads((folder / file).read_text()), **change}
        (folder / file).write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
        assert generic_tokenizer_class(folder) is None, name


def test_the_direct_path_skips_auto_tokenizers_config_lookup(
    tokenized_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cost the direct path removes: AutoTokenizer loads the model's config class (whose import
    pulls in transformers' model-loading stack) before it picks the tokenizer class; the direct path
    never asks for a config or for AutoTokenizer."""
    import transformers

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the direct path looked the model's config up")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    tok = load_tokenizer(tokenized_llama)
    assert tok is not None and tok.encode(TEXTS[0]) == list(tok(TEXTS[0])["input_ids"])
