"""Swap space: a pinned CPU copy of the block layout, where swap-preempted requests park their KV.

Blocks move in whole: for every layer, K and V of the listed GPU blocks are copied to the listed CPU
blocks (swap out) or back (swap in). The scheduler decides; the runner performs the copies at the
start of the step, before the forward can overwrite a freed GPU block.
"""

from __future__ import annotations

import torch

from .block_pool import BlockPool


class SwapSpace:
    """CPU blocks (one pool, per-layer K/V tensors) mirroring the GPU cache's shapes."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], swap_space_gib: float):
        block_bytes = sum(k[0].numel() * k.element_size() + v[0].numel() * v.element_size() for k, v in kv_caches)
        self.num_blocks = int(swap_space_gib * (1 << 30)) // block_bytes
        pin = torch.cuda.is_available() and any(k.is_cuda for k, _ in kv_caches)
        self.pool = BlockPool(self.num_blocks) if self.num_blocks > 0 else None
        self.caches = [
            (
                torch.zeros((self.num_blocks, *k.shape[1:]), dtype=k.dtype, pin_memory=pin),
                torch.zeros((self.num_blocks, *v.shape[1:]), dtype=v.dtype, pin_memory=pin),
            )
            for k, v in kv_caches
        ] if self.num_blocks > 0 else []

    def can_hold(self, num_blocks: int) -> bool:
        return self.pool is not None and self.pool.num_free_blocks >= num_blocks

    @staticmethod
    def copy_out(kv_caches, cpu_caches, gpu_ids: list[int], cpu_ids: list[int]) -> None:
        """GPU blocks -> CPU blocks, every layer (synchronous: the GPU blocks may be reused next)."""
        if not gpu_ids:
            return
        for (k, v), (ck, cv) in zip(kv_caches, cpu_caches):
            src = torch.tensor(gpu_ids, device=k.device)
            dst = torch.tensor(cpu_ids)
            ck.index_copy_(0, dst, k.index_select(0, src).cpu())
            cv.index_copy_(0, dst, v.index_select(0, src).cpu())

    @staticmethod
    def copy_in(kv_caches, cpu_caches, cpu_ids: list[int], gpu_ids: list[int]) -> None:
        """CPU blocks -> GPU blocks, every layer."""
        if not cpu_ids:
            return
        for (k, v), (ck, cv) in zip(kv_caches, cpu_caches):
            src = torch.tensor(cpu_ids)
            dst = torch.tensor(gpu_ids, device=k.device)
            k.index_copy_(0, dst, ck.index_select(0, src).to(k.device))
            v.index_copy_(0, dst, cv.index_select(0, src).to(v.device))
