"""Preallocated all-layer K/V storage for cached prefix tokens: one slot per token."""

from __future__ import annotations

import torch


class KVPool:
    """`k`/`v` of shape `[num_layers, num_slots, num_kv_heads, head_dim]`, allocated once.

    Slot ids are int64 CPU tensors (the free list lives on the CPU so alloc/free never sync a
    GPU); `read`/`write` move them to the pool's device.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        assert num_layers > 0 and num_kv_heads > 0 and head_dim > 0, "pool dimensions must be positive"
        assert num_slots >= 0, f"num_slots must be >= 0, got {num_slots}"
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=self.device)
        self.v = torch.empty(shape, dtype=dtype, device=self.device)
        # Free ids as a stack: _free[:_top] are free, the top of the stack is at the end. Stored
        # descending so that a fresh pool hands out 0, 1, 2, ... (contiguous gathers).
        self._free = torch.arange(num_slots - 1, -1, -1, dtype=torch.int64)
        self._top = num_slots

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one cached token costs (K and V, all layers): size a pool from a memory budget."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize

    @property
    def num_total(self) -> int:
        return self._free.numel()

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` free slot ids (int64, CPU), or None when fewer than `n` are free."""
        assert n >= 0, f"cannot allocate {n} slots"
        if n > self._top:
            return None
        self._top -= n
        return self._free[self._top : self._top + n].flip(0)  # flip copies: the caller owns it

    def free(self, slots: torch.Tensor) -> None:
        """Return slots to the pool. Cheap range/overflow checks here; duplicates via `check()`."""
        slots = slots.reshape(-1).to("cpu", torch.int64)
        m = slots.numel()
        if m == 0:
            return
        assert 0 <= int(slots.min()) and int(slots.max()) < self.num_total, "freeing an out-of-range slot"
        assert self._top + m <= self.num_total, "free list overflow: a slot was freed twice"
        # Pushed reversed so the next alloc hands them back in their original order.
        self._free[self._top : self._top + m] = slots.flip(0)
        self._top += m

    def free_slots(self) -> torch.Tensor:
        """A copy of the free ids (for integrity checks)."""
        return self._free[: self._top].clone()

    def check(self) -> None:
        """Assert the free list holds distinct, in-range ids (catches double frees)."""
        free = self._free[: self._top]
        if free.numel():
            assert 0 <= int(free.min()) and int(free.max()) < self.num_total, "free list has out-of-range ids"
            assert free.unique().numel() == free.numel(), "free list has duplicates: a slot was freed twice"

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store `k`, `v` (`[len(slots), num_kv_heads, head_dim]`) of one layer into `slots`."""
        shape = (slots.numel(), self.num_kv_heads, self.head_dim)
        assert k.shape == shape and v.shape == shape, (
            f"expected k/v of shape {shape}, got {k.shape}, {v.shape}"
        )
        idx = slots.to(self.device, torch.int64)
        self.k[layer].index_copy_(0, idx, k.to(self.dtype))
        self.v[layer].index_copy_(0, idx, v.to(self.dtype))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather one layer's `(k, v)` for `slots`, each `[len(slots), num_kv_heads, head_dim]`."""
        idx = slots.to(self.device, torch.int64)
        return self.k[layer].index_select(0, idx), self.v[layer].index_select(0, idx)
