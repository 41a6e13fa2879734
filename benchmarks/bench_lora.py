"""What a LoRA adapter costs a forward: the same prompts scored by the base model and under a
random adapter on every projection (q, k, v, o, gate, up, down) at a few ranks, alternated in
one run, no prefix cache (every token computed). Prints one line per rank with the median
seconds and the ratio to the base model's median measured in the same run.

    python -m benchmarks.bench_lora [--model embedded] [--prompts 4] [--tokens 256] [--ranks 8,64]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from po_backend import Engine
from po_backend.core.request import ScoreRequest
from po_backend.engine.config import ModelConfig

MODULES = {
    "q_proj": ("self_attn", "hidden", "q"),
    "k_proj": ("self_attn", "hidden", "kv"),
    "v_proj": ("self_attn", "hidden", "kv"),
    "o_proj": ("self_attn", "q", "hidden"),
    "gate_proj": ("mlp", "hidden", "inter"),
    "up_proj": ("mlp", "hidden", "inter"),
    "down_proj": ("mlp", "inter", "hidden"),
}


def write_adapter(cfg: ModelConfig, rank: int, folder: Path, seed: int = 0) -> Path:
    """A PEFT-format adapter of `rank` on every projection of every layer, random weights."""
    sizes = {"hidden": cfg.hidden_size, "q": cfg.q_size, "kv": cfg.kv_size, "inter": cfg.intermediate_size}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for name, (block, fan_in, fan_out) in MODULES.items():
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = 0.02 * torch.randn(rank, sizes[fan_in], generator=g)
            tensors[f"{key}.lora_B.weight"] = 0.02 * torch.randn(sizes[fan_out], rank, generator=g)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--ranks", default="8,64")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")]
    engine = Engine.from_pretrained(
        args.model, dtype=args.dtype, enable_cache=False, enable_lora=True, max_input_len=args.max_input_len,
        max_loras=len(ranks), max_lora_rank=max(ranks),
    )  # fmt: skip
    assert engine.loras is not None
    with tempfile.TemporaryDirectory() as tmp:
        for r in ranks:
            engine.loras.load(f"r{r}", write_adapter(engine.model_config, r, Path(tmp) / f"r{r}"))
    rng = random.Random(0)
    prompts = [
        tuple(rng.randrange(engine.vocab_size) for _ in range(args.tokens)) for _ in range(args.prompts)
    ]
    names: list[str | None] = [None, *(f"r{r}" for r in ranks)]
    times: dict[str | None, list[float]] = {n: [] for n in names}
    for n in names:  # warm-up
        engine.run([ScoreRequest(p, (1,), lora=n) for p in prompts])
    for _ in range(args.repeats):  # alternated, so drift from other processes hits all alike
        for n in names:
            t0 = time.perf_counter()
            engine.run([ScoreRequest(p, (1,), lora=n) for p in prompts])
            times[n].append(time.perf_counter() - t0)
    base = statistics.median(times[None])
    rows = []
    for n in names:
        med = statistics.median(times[n])
        rows.append({"adapter": n or "base", "median_s": med, "ratio_to_base": med / base})
        print(f"{n or 'base':>6}: median {med:.3f} s over {args.repeats} runs, {med / base:.3f}x the base")
    if args.json:
        print(json.dumps({"prompts": args.prompts, "tokens": args.tokens, "rows": rows}))


if __name__ == "__main__":
    main()
