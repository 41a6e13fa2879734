"""A tiny trained BPE tokenizer for the tiny random-weight models, so tests run text end to end."""

from __future__ import annotations

import shutil
import string
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

# GPT-2-like pre-tokenisation (a word keeps its leading space) so " Yes" and "Yes" differ.
PATTERN = r"<\|\w+\|>| ?[^\W\d]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "User profile:\nlikes cats and dogs\n",
    "Post: a cat video\nWill the user engage? Answer: Yes",
    "Will the user engage? Answer: No",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n",
    "<|im_start|>assistant\nYes",
    "<|im_start|>assistant\nNo",
    "Review: the movie was great.\nSentiment: positive negative",
]


def build_tokenizer(
    path: Path, corpus: Sequence[str] = CORPUS, alphabet: Sequence[str] = tuple(string.printable)
) -> PreTrainedTokenizerFast:
    """A BPE tokenizer trained on a few lines (vocab < 300, the tiny model's size): frequent words
    are one token, the rest split into pieces, a BOS is added, ChatML special tokens exist."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PATTERN), behavior="isolated")
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=list(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus) * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", unk_token="<unk>", eos_token="<|im_end|>"
    )
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    return fast


def tokenized_copy(
    src: Path, dest: Path, corpus: Sequence[str] = CORPUS, alphabet: Sequence[str] = tuple(string.printable)
) -> Path:
    """A copy of a tiny model's folder with a tokenizer (the shared fixture folder stays
    tokenizer-free)."""
    path = dest / "llama-tok"
    shutil.copytree(src, path)
    build_tokenizer(path, corpus, alphabet)
    return path
