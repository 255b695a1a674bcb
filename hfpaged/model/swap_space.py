"""Swap space: a CPU copy of the block layout, where swap-preempted requests park their KV.

Blocks move whole: for every layer, K and V of the listed GPU blocks are copied to the listed CPU blocks
(swap out) or back (swap in). The scheduler decides (its KV manager hands out the CPU block ids); the
runner performs the copies at the start of the step, before the forward can overwrite a freed GPU block.
The CPU tensors (pinned on CUDA) are allocated at the first swap-out, not at ``patch``.
"""

from __future__ import annotations

import torch

from .kv_quant import as_bytes

MAX_DEFAULT_SWAP_BYTES = 4 << 30


def swap_blocks(swap_space_gib: float | None, num_gpu_blocks: int, block_bytes: int) -> int:
    """CPU blocks for ``swap_space_gib`` GiB; None: as many as the GPU pool holds, at most 4 GiB of them."""
    if swap_space_gib is None:
        return min(num_gpu_blocks, MAX_DEFAULT_SWAP_BYTES // block_bytes)
    return int(swap_space_gib * (1 << 30)) // block_bytes


class SwapSpace:
    """CPU blocks (per-layer K/V tensors) mirroring the GPU cache's shapes."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _allocate(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        pin = torch.cuda.is_available() and any(k.is_cuda for k, _ in kv_caches)
        self.caches = [
            (
                torch.empty((self.num_blocks, *k.shape[1:]), dtype=k.dtype, pin_memory=pin),
                torch.empty((self.num_blocks, *v.shape[1:]), dtype=v.dtype, pin_memory=pin),
            )
            for k, v in kv_caches
        ]

    def _pairs(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        """(GPU K/V, CPU K/V) per layer, fp8 viewed as bytes (index_copy_ has no fp8 kernel on the CPU)."""
        for (k, v), (ck, cv) in zip(kv_caches, self.caches):
            yield (as_bytes(k), as_bytes(v)), (as_bytes(ck), as_bytes(cv))

    def copy_out(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], gpu_ids: list[int], cpu_ids: list[int]
    ) -> None:
        """GPU blocks -> CPU blocks, every layer (synchronous: the GPU blocks may be reused next)."""
        if not gpu_ids:
            return
        if not self.caches:
            self._allocate(kv_caches)
        dst = torch.tensor(cpu_ids)
        for (k, v), (ck, cv) in self._pairs(kv_caches):
            src = torch.tensor(gpu_ids, device=k.device)
            ck.index_copy_(0, dst, k.index_select(0, src).cpu())
            cv.index_copy_(0, dst, v.index_select(0, src).cpu())

    def copy_in(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], cpu_ids: list[int], gpu_ids: list[int]
    ) -> None:
        """CPU blocks -> GPU blocks, every layer."""
        if not cpu_ids:
            return
        src = torch.tensor(cpu_ids)
        for (k, v), (ck, cv) in self._pairs(kv_caches):
            dst = torch.tensor(gpu_ids, device=k.device)
            k.index_copy_(0, dst, ck.index_select(0, src).to(k.device))
            v.index_copy_(0, dst, cv.index_select(0, src).to(v.device))
