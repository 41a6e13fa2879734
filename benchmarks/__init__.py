"""PrefillOnly benchmarks: run each as `python -m benchmarks.NAME` (see README.md, Benchmarks)."""
