"""The real scheduler on a virtual clock: one engine (`simulator`) or N behind the SGLang
router's policies (`cluster`). Torch-free."""
