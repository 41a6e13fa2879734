"""The engine: model code, the prefix cache, attention kernels and the prefill-only forward
(`engine.Engine`), plus the transformers baseline (`hf_scorer.HFScorer`). Needs torch."""
