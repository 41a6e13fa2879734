"""The int8 mode's calibration forward: every projection's per-input-channel activation maxima,
from a few fixed texts run once through the float model at load (`loader.load_model` caches them
beside the int8 weights, keyed by the checkpoint, so a later start never runs this again).

The texts are generic prose, a chat turn, code, and prompts shaped like the engine's jobs
(labels, yes/no recommendations, ratings) about people and things that appear in no benchmark or
test list: the activations' outlier channels are a property of the model, not of the prompt."""

from __future__ import annotations

from typing import Any

import torch

from po_backend.engine.models.int8 import QUANTIZED_PROJECTIONS, recording
from po_backend.engine.models.llama import LlamaForCausalLM
from po_backend.engine.runner import SeqPlan, make_runner

# Bumped when the texts or the way maxima are taken change: cached maxima are then not read.
CALIBRATION_VERSION = 1

CALIBRATION_TEXTS = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. From the lamp room she "
    "could see the fishing boats returning, the gulls following their wakes, and on clear days the "
    "faint outline of the islands forty miles to the west. In winter the storms shook the glass, "
    "and she kept a logbook of every ship that passed, its flag, its heading and the hour.",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHow do I convert "
    "a temperature from Celsius to Fahrenheit?<|im_end|>\n<|im_start|>assistant\nMultiply the "
    "Celsius value by 9/5 and add 32. For example, 20 degrees Celsius is 68 degrees Fahrenheit.",
    "def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n\n"
    "print(merge_sorted([1, 4, 9], [2, 3, 10]))  # [1, 2, 3, 4, 9, 10]",
    "Profile: Henrik is a retired ferry captain who builds model ships, sings in a church choir and "
    "follows ice hockey. He does not like spicy food or reality television.\nItem: A guide to "
    "rigging a scale model of a three-masted schooner.\nWould this person be interested in this "
    "item? Answer Yes or No.\nAnswer: Yes",
    "Profile: Amara studies architecture, sketches city buildings on her phone and cycles to "
    "campus. She has no interest in celebrity news.\nItem: Celebrity couple announces a surprise "
    "wedding in Las Vegas.\nWould this person be interested in this item? Answer Yes or No.\n"
    "Answer: No",
    "Classify the topic of this headline as sports, politics, science or business.\n"
    "Headline: Central bank holds interest rates steady as inflation cools.\nTopic: business\n"
    "Headline: Astronomers detect water vapour on a distant exoplanet.\nTopic: science",
    "Rate this product review from 1 to 5 stars.\nReview: The kettle boils quickly and looks nice, "
    "but the lid started leaking after two weeks and customer service never answered my emails. "
    "I would not buy it again.\nStars: 2",
    "In 1848 a wave of revolutions spread across Europe, from Paris to Vienna and Berlin. Workers, "
    "students and the middle classes demanded constitutions, a free press and the vote. Most "
    "uprisings were put down within a year, yet serfdom was abolished in Austria and several "
    "states kept the parliaments they had won. Historians still argue about why they failed.",
)


def calibration_ids(tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """The calibration texts' token ids; a folder without a tokenizer (tests) gets fixed
    pseudo-random ids of the same number and similar lengths."""
    if tokenizer is not None:
        return [list(tokenizer.encode(t)) for t in CALIBRATION_TEXTS]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (64,), generator=g).tolist() for _ in CALIBRATION_TEXTS]


@torch.inference_mode()
def activation_maxima(
    model: LlamaForCausalLM, device: torch.device, ids: list[list[int]]
) -> list[dict[str, torch.Tensor]]:
    """Per decoder layer, per projection (`QUANTIZED_PROJECTIONS`): max |x| over the calibration
    tokens of each input channel, fp32 [in_features], from the model's own float forward."""
    runner = make_runner(model, device, chunk_size=512)
    names = {
        id(getattr(layer, n)): (i, n)
        for i, layer in enumerate(model.decoder_layers)
        for n in QUANTIZED_PROJECTIONS
    }
    with recording() as rec:
        for seq in ids:  # one at a time: a token's maxima do not depend on what runs beside it
            t = torch.tensor(seq, dtype=torch.long)
            runner.forward([SeqPlan(token_ids=t, logit_offsets=torch.tensor([len(seq) - 1]))])
    out: list[dict[str, torch.Tensor]] = [{} for _ in model.decoder_layers]
    for key, m in rec.absmax.items():
        i, n = names[key]
        out[i][n] = m.cpu()
    missing = [(i, n) for i, layer in enumerate(out) for n in QUANTIZED_PROJECTIONS if n not in layer]
    assert not missing, f"the calibration forward never ran {missing[:3]}"
    return out
