"""torch.compile support: the Triton kernels as opaque custom ops, and a compiled decode forward.

With ``patch(..., compile=True)`` the decode CUDA graphs capture a ``torch.compile``-d call of the
unmodified model (inductor fuses its norms, RoPE, activations and residual adds) around our two
custom ops. Step metadata then reaches the attention function as forward kwargs (transformers passes
extra kwargs down to the attention interface), so one dynamic-shape compile serves every bucket. The
compiled function takes the model as an argument (it keeps no reference to it) and calls the model
class's own ``forward``: the forward-lock wrapper ``patch`` installs is not traced (the caller holds the
lock), and graphs are single-device only, so no top-level module hooks are skipped that matter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_registered = False


def register_custom_ops() -> None:
    """Register ``hfpaged::store_kv`` and ``hfpaged::paged_attention`` (once per process)."""
    global _registered
    if _registered:
        return
    from ..kernels import paged_attention, store_kv

    @torch.library.custom_op("hfpaged::store_kv", mutates_args=("k_cache", "v_cache"))
    def store_kv_op(
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
    ) -> None:
        store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)

    @store_kv_op.register_fake
    def _store_kv_fake(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
        return None

    @torch.library.custom_op("hfpaged::paged_attention", mutates_args=())
    def paged_attention_op(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        scale: float,
        sliding_window: int,
        softcap: float,
        max_seqlen_q: int,
        max_seqlen_k: int,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        return paged_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            cu_seqlens_q,
            scale=scale,
            sliding_window=sliding_window if sliding_window > 0 else None,
            softcap=softcap if softcap > 0 else None,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    @paged_attention_op.register_fake
    def _paged_attention_fake(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scale,
        sliding_window,
        softcap,
        max_seqlen_q,
        max_seqlen_k,
        k_scale,
        v_scale,
    ) -> torch.Tensor:
        return q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])

    _registered = True


def compiled_attention(module, query, key, value, scaling, sliding_window, softcap, kwargs) -> torch.Tensor:
    """The attention step of one layer when the metadata arrives as kwargs (compiled decode path)."""
    k_cache, v_cache = module._hfpaged_kv
    scales = module.__dict__.get("_hfpaged_kv_scale")  # fp8 caches: (whole, k_scale, v_scale); never calibrates
    k_scale, v_scale = (None, None) if scales is None else scales[1:]
    q = query[0].transpose(0, 1)
    torch.ops.hfpaged.store_kv(
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        k_cache,
        v_cache,
        kwargs["hfpaged_slot_mapping"],
        k_scale,
        v_scale,
    )
    out = torch.ops.hfpaged.paged_attention(
        q,
        k_cache,
        v_cache,
        kwargs["hfpaged_block_tables"],
        kwargs["hfpaged_seq_lens"],
        kwargs["hfpaged_cu_seqlens_q"],
        float(scaling),
        int(sliding_window or 0),
        float(softcap or 0.0),
        int(kwargs["hfpaged_max_seqlen_q"]),
        int(kwargs["hfpaged_max_seqlen_k"]),
        k_scale,
        v_scale,
    )
    return out.unsqueeze(0)


def compile_decode_forward(max_seqlen_k: int) -> Callable:
    """A compiled ``(model, input_ids, position_ids, slots, block_tables, seq_lens, cu_seqlens_q) -> logits``."""
    register_custom_ops()

    @torch.no_grad()
    def forward(model, input_ids, position_ids, slot_mapping, block_tables, seq_lens, cu_seqlens_q):
        output = type(model).forward(
            model,
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=0,
            hfpaged_slot_mapping=slot_mapping,
            hfpaged_block_tables=block_tables,
            hfpaged_seq_lens=seq_lens,
            hfpaged_cu_seqlens_q=cu_seqlens_q,
            hfpaged_max_seqlen_q=1,
            hfpaged_max_seqlen_k=max_seqlen_k,
        )
        return output.logits[0]

    return torch.compile(forward, dynamic=True)
