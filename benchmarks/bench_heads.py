"""Classifier heads and embeddings: ours vs transformers, and a shared instruction reused (prefix
cache + multi-item forward) vs recomputed, all in one run.

Models: random weights on SmolLM2-135M's shape (`LlamaForSequenceClassification` with 2 labels,
and a bare `LlamaModel` saved as a sentence-transformers last-token embedder); speed does not
depend on the weights and nothing is downloaded. Workload: `--items` prompts of one shared
instruction (`--prefix` tokens) and a unique tail (`--suffix` tokens).

  transformers   one forward per prompt (batch 1), as a plain HF pipeline runs them
  ours-noreuse   our engine without the prefix cache (prompts packed into forwards)
  ours           the instruction declared as the cache prefix: computed once, items over it

    python -m benchmarks.bench_heads --out benchmarks/results/heads.json   # ~2 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from benchmarks.harness import machine_info, save
from po_backend import Engine, ScoreRequest

SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
)  # fmt: skip
ST_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]


def build(root: Path, layers: int) -> dict[str, tuple[Path, torch.nn.Module]]:
    shape = {**SMOLLM2_135M, "num_hidden_layers": layers}
    cfg = transformers.LlamaConfig(**shape, num_labels=2, pad_token_id=0)
    torch.manual_seed(0)
    cls = transformers.LlamaForSequenceClassification(cfg).eval()
    cls.save_pretrained(root / "classifier")
    emb = transformers.LlamaModel(cfg).eval()
    emb.save_pretrained(root / "embedder")
    (root / "embedder" / "modules.json").write_text(json.dumps(ST_MODULES))
    (root / "embedder" / "1_Pooling").mkdir()
    (root / "embedder" / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    return {"classifier": (root / "classifier", cls), "embedder": (root / "embedder", emb)}


def hf_outputs(model: torch.nn.Module, prompts: list[list[int]]) -> tuple[float, list[torch.Tensor]]:
    out = []
    t = time.perf_counter()
    with torch.inference_mode():
        for ids in prompts:
            res = model(torch.tensor([ids]))
            if hasattr(res, "logits"):
                out.append(res.logits[0])
            else:
                out.append(torch.nn.functional.normalize(res.last_hidden_state[0, -1], dim=0))
    return time.perf_counter() - t, out


def ours(
    path: Path, prompts: list[list[int]], prefix: int, reuse: bool
) -> tuple[float, list[torch.Tensor], int]:
    engine = Engine.from_pretrained(path, dtype="fp32", enable_cache=reuse, max_input_len=1024)
    warm = [ScoreRequest(tuple(prompts[0][prefix:]), pool=True)]  # first-call allocations, no shared ids
    engine.run(warm)
    reqs = [ScoreRequest(tuple(p), pool=True, cache_prefix_len=prefix if reuse else None) for p in prompts]
    t = time.perf_counter()
    results = engine.run(reqs)
    seconds = time.perf_counter() - t
    return seconds, [torch.tensor(r.outputs) for r in results], sum(r.cached_tokens for r in results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M has 30)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    shared = [rng.randrange(1, 49152) for _ in range(args.prefix)]
    prompts = [shared + [rng.randrange(1, 49152) for _ in range(args.suffix)] for _ in range(args.items)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-heads-") as tmp:
        for kind, (path, model) in build(Path(tmp), args.layers).items():
            t_hf, ref = hf_outputs(model, prompts)
            t_no, out_no, _ = ours(path, prompts, args.prefix, reuse=False)
            t_re, out_re, cached = ours(path, prompts, args.prefix, reuse=True)
            delta = max(
                float((a - b).abs().max()) for a, b in zip([*out_no, *out_re], ref + ref, strict=True)
            )
            rows.append(
                {
                    "model": kind,
                    "items_per_s": {
                        "transformers": args.items / t_hf,
                        "ours-noreuse": args.items / t_no,
                        "ours": args.items / t_re,
                    },
                    "ours_vs_transformers": t_hf / t_re,
                    "noreuse_vs_transformers": t_hf / t_no,
                    "reuse_vs_noreuse": t_no / t_re,
                    "cached_tokens": cached,
                    "max_abs_delta_vs_transformers": delta,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    doc = {
        "machine": machine_info(),
        "args": vars(args) | {"out": str(args.out)},
        "dtype": "fp32",
        "rows": rows,
    }
    if args.out:
        save(args.out, doc)


if __name__ == "__main__":
    main()
