"""Attention of fresh prompts (no cached context) on Hopper: a warp-specialized Gluon kernel, FA3's scheme.

Why (notes/kernels.md, session 39): Triton's compiler waits for every ``tl.dot`` before the next instruction and
puts a CTA-wide barrier before every TMA load of a pipelined loop, so the softmax of a tile never overlaps a GEMM
and the two warp groups of a 128-row tile run in lockstep. Here, written in Gluon (Triton's lower-level language:
explicit layouts, async wgmma, mbarriers, warp specialization):
- a producer warp group issues the TMA loads of Q and of the K/V tiles into a two-stage ring (ready/empty
  mbarriers); it never waits on the consumers' arithmetic;
- two consumer warp groups own 64 query rows each; per key tile j they issue S_j = Q K_j^T and O += P_{j-1} V_{j-1}
  as async wgmma, wait for S_j only, compute the softmax of tile j while P_{j-1} V_{j-1} runs, then rescale O.
H200, one prompt of Qwen3's heads (16 query / 8 KV x 128), against cuDNN SDPA: 126% at 4k tokens, 108% at 8k (our
Triton kernel: 98%, 91%).

Scope: the launch of ``paged_attention`` over a prompt step with the step's own keys/values (``key=``/``value=``)
hands this kernel the sequences whose keys are all in the step (context length 0), and the Triton kernel skips
them (``SKIP_FRESH``); continuation chunks and decode rows stay with the Triton kernel. One program is 128 query
positions of one query head (GQA: its KV head's tiles, shared through L2 by the programs of the group's heads,
which run side by side: heads innermost, every head's heaviest causal block first). Keys past the sequence's end in
its last (diagonal) tile are masked, and their value rows are zeroed before that tile's P.V (they are rows of the
next sequence of the step: an inf there would otherwise turn 0 * inf into NaN here).
Only where ``fresh_prompts_usable`` says so (sm_90, 16-bit q and caches, 128-dim heads, no window/softcap/sinks,
rows TMA can address); ``HFPAGED_GLUON_PROMPTS=0`` turns it off (the Triton kernel then does every sequence).
"""

from __future__ import annotations

import inspect
import os
import warnings

import torch

try:  # Gluon's Hopper API (Triton 3.5 on): elsewhere the Triton kernel does every sequence
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    # the TMA load's name: async_copy_global_to_shared in Triton 3.5-3.6, async_load later
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # warp_specialize([(function, args), ...], warps, registers) from Triton 3.6 on (3.5 took other arguments)
    HAVE_GLUON = "functions_and_args" in inspect.signature(gl.warp_specialize).parameters
except (ImportError, AttributeError, TypeError, ValueError):  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

ENABLED = os.environ.get("HFPAGED_GLUON_PROMPTS", "1") != "0"
BLOCK = 128  # query positions per program = keys per tile
STAGES = 2  # K/V ring depth (3 fits too; no faster on the H200, session 39)
HEAD_DIM = 128
LOG2E = 1.4426950408889634


def fresh_prompts_usable(q, k_cache, v_cache, key, value, out, *, sliding_window, softcap, sinks, block_m, tile_n,
                         one_query, num_splits) -> bool:  # fmt: skip
    """Whether a prompt launch (tile ``block_m`` x ``tile_n``, ``num_splits``, ``one_query``) can hand its fresh
    sequences to the Gluon kernel: the long prompt tile without splits, an sm_90 GPU, 16-bit q with caches of its
    dtype, 128-dim query/key/value heads, no sliding window, softcap or sinks, and q, the step's rows and out in
    layouts TMA and the kernel address (rows of heads x 128 contiguous elements, 16-byte aligned)."""
    if not (HAVE_GLUON and ENABLED) or key is None or value is None:
        return False
    if one_query or num_splits != 1 or block_m != BLOCK or tile_n != BLOCK:
        return False
    if (sliding_window is not None and sliding_window > 0) or (softcap is not None and softcap > 0):
        return False
    if sinks is not None or q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if torch.version.hip is not None:  # (an MI200 reports capability 9.0 too)
        return False
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype or q.shape[2] != HEAD_DIM:
        return False
    if k_cache.shape[3] != HEAD_DIM or v_cache.shape[3] != HEAD_DIM:
        return False
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    for t in (q, key, value):
        if not _rows_addressable(t):
            return False
    return out.stride(2) == 1 and out.dtype == q.dtype


def _rows_addressable(t: torch.Tensor) -> bool:
    # [T, heads, 128] with unit stride along a head and 16-byte aligned base and strides (what TMA addresses): the
    # engine's views of [1, heads, T, 128] and packed [T, heads, 128] rows alike
    size = t.element_size()
    return (
        t.stride(2) == 1
        and t.data_ptr() % 16 == 0
        and (t.stride(0) * size) % 16 == 0
        and (t.stride(1) * size) % 16 == 0
        and t.shape[0] > 0
    )


def _descriptor(t: torch.Tensor, rows: int) -> GluonDescriptor:
    # boxes of rows tokens x 1 head x 128
    dtype = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([rows, 1, HEAD_DIM], dtype)
    return GluonDescriptor(t, list(t.shape), list(t.stride()), [rows, 1, HEAD_DIM], layout)


def attend_fresh_prompts(q, key, value, seq_lens, cu_seqlens_q, out, *, scale: float) -> bool:
    """Write ``out``'s rows of every sequence whose keys are all in this step (``seq_lens[b]`` equal to its query
    run); other rows are left alone. ``fresh_prompts_usable`` must have said yes. False (nothing written) if the
    kernel could not be compiled or launched here: a warning, and the Triton kernel does every sequence from then on."""
    global ENABLED
    num_tokens, num_heads = q.shape[0], q.shape[1]
    num_seqs = seq_lens.shape[0]
    grid = ((num_tokens // BLOCK + num_seqs) * num_heads,)
    try:
        _fresh_prompt_kernel[grid](
            _descriptor(q, BLOCK // 2), _descriptor(key, BLOCK), _descriptor(value, BLOCK), out, cu_seqlens_q,
            seq_lens, num_seqs, float(scale) * LOG2E, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, GROUP=num_heads // key.shape[1], STAGES=STAGES, num_warps=4,
        )  # fmt: skip
    except Exception as exc:  # (a compile error of another Triton): the Triton kernel serves, as without Gluon
        ENABLED = False
        warnings.warn(f"hfpaged: the Gluon prompt kernel is off, it failed to launch: {exc!r}", stacklevel=2)
        return False
    return True


if HAVE_GLUON:

    @gluon.jit
    def _softmax_step(s, m_i, l_i, q_pos, k_pos, qk_scale, MASKED: gl.constexpr):
        # one tile of the online softmax (log2 domain): -> P (unnormalised), new max, new sum, the old sums' factor
        if MASKED:
            s = gl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        return p, m_new, l_i * alpha + gl.sum(p, 1), alpha

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty,
                  q_row, kv_row, head, kv_head, n_tiles):  # fmt: skip
        # (shapes from the buffers: values passed into a partition lose their constexpr-ness)
        stages: gl.constexpr = k_smem.shape[0]
        block: gl.constexpr = k_smem.shape[1]
        dim: gl.constexpr = k_smem.shape[3]
        half: gl.constexpr = block // 2
        if n_tiles > 0:
            for h in gl.static_range(2):
                mbarrier.expect(q_bars.index(h), half * dim * 2)
                _tma_load(q_desc, [q_row + h * half, head, 0], q_bars.index(h),
                                                q_smem.index(h))  # fmt: skip
            for j in range(n_tiles):
                stage = j % stages
                phase = ((j // stages) & 1) ^ 1  # the previous round of this stage: released by both consumers
                mbarrier.wait(k_empty.index(stage), phase, pred=j >= stages)
                mbarrier.expect(k_ready.index(stage), block * dim * 2)
                _tma_load(k_desc, [kv_row + j * block, kv_head, 0], k_ready.index(stage),
                                                k_smem.index(stage))  # fmt: skip
                mbarrier.wait(v_empty.index(stage), phase, pred=j >= stages)
                mbarrier.expect(v_ready.index(stage), block * dim * 2)
                _tma_load(v_desc, [kv_row + j * block, kv_head, 0], v_ready.index(stage),
                                                v_smem.index(stage))  # fmt: skip

    @gluon.jit
    def _consumer(out_ptr, q_smem, k_smem, v_smem, v_fix, q_bars, k_ready, v_ready, k_empty, v_empty, q_row, q_len,
                  q_block, head, n_tiles, qk_scale, stride_out_t, stride_out_h, HALF_INDEX: gl.constexpr):  # fmt: skip
        stages: gl.constexpr = k_smem.shape[0]
        block: gl.constexpr = k_smem.shape[1]
        dim: gl.constexpr = k_smem.shape[3]
        half: gl.constexpr = block // 2
        row0: gl.constexpr = HALF_INDEX * half
        dtype: gl.constexpr = q_smem.dtype
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, dim, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        rows: gl.constexpr = gl.SliceLayout(1, mma)
        cols: gl.constexpr = gl.SliceLayout(0, mma)
        if n_tiles > 0:
            q = q_smem.index(HALF_INDEX).reshape([half, dim])
            q_pos = q_block * block + row0 + gl.arange(0, half, layout=rows)  # positions in the sequence
            offs_n = gl.arange(0, block, layout=cols)
            zero = gl.zeros([half, block], gl.float32, layout=mma)
            o = gl.zeros([half, dim], gl.float32, layout=mma)
            m_i = gl.full([half], float("-inf"), gl.float32, layout=rows)
            l_i = gl.zeros([half], gl.float32, layout=rows)
            mbarrier.wait(q_bars.index(HALF_INDEX), 0)
            mbarrier.wait(k_ready.index(0), 0)
            s = warpgroup_mma(
                q, k_smem.index(0).reshape([block, dim]).permute((1, 0)), zero, use_acc=False, is_async=True
            )
            s = warpgroup_mma_wait(0, deps=[s])
            mbarrier.arrive(k_empty.index(0))
            if n_tiles == 1:
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, q_pos, offs_n, qk_scale, True)
            else:
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, q_pos, offs_n, qk_scale, False)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            for j in range(1, n_tiles):
                ks = j % stages
                vs = (j - 1) % stages
                mbarrier.wait(k_ready.index(ks), (j // stages) & 1)
                mbarrier.wait(v_ready.index(vs), ((j - 1) // stages) & 1)
                s = warpgroup_mma(
                    q, k_smem.index(ks).reshape([block, dim]).permute((1, 0)), zero, use_acc=False, is_async=True
                )
                o = warpgroup_mma(p_op, v_smem.index(vs).reshape([block, dim]), o, is_async=True)
                s = warpgroup_mma_wait(1, deps=[s])  # S_j done; P_{j-1} V_{j-1} may still run
                mbarrier.arrive(k_empty.index(ks))
                if j == n_tiles - 1:
                    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, q_pos, j * block + offs_n, qk_scale, True)
                else:
                    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, q_pos, j * block + offs_n, qk_scale, False)
                o = warpgroup_mma_wait(0, deps=[o])
                mbarrier.arrive(v_empty.index(vs))
                o = o * alpha[:, None]
                p_op = gl.convert_layout(p.to(dtype), p_layout)
            last = n_tiles - 1
            vs = last % stages
            mbarrier.wait(v_ready.index(vs), (last // stages) & 1)
            if (last + 1) * block > q_len:
                # the diagonal tile runs past the sequence: its value rows there (the next sequence's) are zeroed in a
                # copy of this group's own before P.V (their P is 0, but 0 * inf would be NaN)
                fix_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
                v_tile = v_smem.index(vs).reshape([block, dim]).load(fix_layout)
                key_pos = last * block + gl.arange(0, block, layout=gl.SliceLayout(1, fix_layout))
                v_tile = gl.where((key_pos < q_len)[:, None], v_tile, gl.zeros_like(v_tile))
                fixed = v_fix.index(HALF_INDEX).reshape([block, dim])
                fixed.store(v_tile)
                fence_async_shared()
                o = warpgroup_mma_wait(0, deps=[warpgroup_mma(p_op, fixed, o, is_async=True)])
            else:
                o = warpgroup_mma_wait(
                    0, deps=[warpgroup_mma(p_op, v_smem.index(vs).reshape([block, dim]), o, is_async=True)]
                )
            o = o / l_i[:, None]
            offs_d = gl.arange(0, dim, layout=cols)
            token = (q_row + row0 + gl.arange(0, half, layout=rows)).to(gl.int64)
            ptrs = out_ptr + (token * stride_out_t + head * stride_out_h)[:, None] + offs_d[None, :]
            gl.store(ptrs, o.to(dtype), mask=(q_pos < q_len)[:, None])

    @gluon.jit
    def _consumer_first(out_ptr, q_smem, k_smem, v_smem, v_fix, q_bars, k_ready, v_ready, k_empty, v_empty, q_row,
                        q_len, q_block, head, n_tiles, qk_scale, stride_out_t, stride_out_h):  # fmt: skip
        _consumer(out_ptr, q_smem, k_smem, v_smem, v_fix, q_bars, k_ready, v_ready, k_empty, v_empty, q_row, q_len,
                  q_block, head, n_tiles, qk_scale, stride_out_t, stride_out_h, 0)  # fmt: skip

    @gluon.jit
    def _consumer_second(out_ptr, q_smem, k_smem, v_smem, v_fix, q_bars, k_ready, v_ready, k_empty, v_empty, q_row,
                         q_len, q_block, head, n_tiles, qk_scale, stride_out_t, stride_out_h):  # fmt: skip
        _consumer(out_ptr, q_smem, k_smem, v_smem, v_fix, q_bars, k_ready, v_ready, k_empty, v_empty, q_row, q_len,
                  q_block, head, n_tiles, qk_scale, stride_out_t, stride_out_h, 1)  # fmt: skip

    @gluon.jit
    def _fresh_prompt_kernel(q_desc, k_desc, v_desc, out_ptr, cu_seqlens_q_ptr, seq_lens_ptr, num_seqs, qk_scale,
                             stride_out_t, stride_out_h, NUM_HEADS: gl.constexpr, GROUP: gl.constexpr,
                             STAGES: gl.constexpr):  # fmt: skip
        # program = (query block, head), heads innermost; sequence b owns query blocks [cu[b] // 128 + b, ...), the
        # last (heaviest causal) block first, as in the Triton kernel
        dtype: gl.constexpr = q_desc.dtype
        block: gl.constexpr = k_desc.block_type.shape[0]
        dim: gl.constexpr = k_desc.block_type.shape[2]
        pid = gl.program_id(0)
        program = pid // NUM_HEADS
        head = pid % NUM_HEADS
        search: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        count = 0
        for chunk in range(0, gl.cdiv(num_seqs, 128)):
            b = chunk * 128 + gl.arange(0, 128, layout=search)
            first = gl.load(cu_seqlens_q_ptr + b, mask=b < num_seqs, other=1 << 30) // block + b
            count += gl.sum((first <= program).to(gl.int32), axis=0)
        seq = count - 1
        q_start = gl.load(cu_seqlens_q_ptr + seq)
        q_len = gl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        q_block = gl.cdiv(q_len, block) - 1 - (program - (q_start // block + seq))
        fresh = gl.load(seq_lens_ptr + seq) == q_len  # no cached context: every key is a row of this step
        n_tiles = (q_block + 1) * (fresh & (q_block >= 0)).to(gl.int32)

        q_smem = gl.allocate_shared_memory(dtype, [2, block // 2, 1, dim], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, block, 1, dim], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, block, 1, dim], v_desc.layout)
        v_fix = gl.allocate_shared_memory(dtype, [2, block, 1, dim], v_desc.layout)
        q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(q_bars.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # both consumer groups release each stage
            mbarrier.init(v_empty.index(i), count=2)
        q_row = q_start + q_block * block
        consumer_args = (out_ptr, q_smem, k_smem, v_smem, v_fix, q_bars, k_ready, v_ready, k_empty, v_empty, q_row,
                         q_len, q_block, head, n_tiles, qk_scale, stride_out_t, stride_out_h)  # fmt: skip
        gl.warp_specialize(
            [
                (_consumer_first, consumer_args),
                (_consumer_second, consumer_args),
                (
                    _producer,
                    (
                        q_desc,
                        k_desc,
                        v_desc,
                        q_smem,
                        k_smem,
                        v_smem,
                        q_bars,
                        k_ready,
                        v_ready,
                        k_empty,
                        v_empty,
                        q_row,
                        q_start,
                        head,
                        head // GROUP,
                        n_tiles,
                    ),
                ),  # fmt: skip
            ],
            [4, 4],
            [232, 40],
        )
