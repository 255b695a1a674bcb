"""Per-step inputs packed into ONE int32 array on the host, copied to the device in one transfer.

Layout of the packed array for a step of T tokens, R requests and block-table width W (each
region padded to a multiple of ALIGN elements):

    input_ids[T] | positions[T] | slot_mapping[T] | logits_indices[R] | seq_lens[R] |
    cu_seqlens_q[R + 1] | block_tables[R * W]

Device views into the copied buffer give every tensor the forward and the attention need. CUDA-graph
decode steps use the same layout with T = R = the graph's batch bucket and a fixed W, written into
the graph's static buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .attention import AttentionMetadata
from .request import Request
from .scheduler import SchedulerOutput


ALIGN = 16  # elements: every region starts 64-byte aligned, so Triton's pointer-alignment
# specialization sees the same alignment every step (no recompiles as the layout shifts)

REGIONS = ("input_ids", "positions", "slot_mapping", "logits_indices", "seq_lens", "cu_seqlens_q")


def region_slices(num_tokens: int, num_reqs: int) -> dict[str, slice]:
    """Where each per-step array sits in the packed buffer; block tables follow at ``tables_offset``."""
    lengths = (num_tokens, num_tokens, num_tokens, num_reqs, num_reqs, num_reqs + 1)
    slices, o = {}, 0
    for name, n in zip(REGIONS, lengths):
        slices[name] = slice(o, o + n)
        o += -(-n // ALIGN) * ALIGN
    slices["block_tables"] = slice(o, None)
    return slices


def tables_offset(num_tokens: int, num_reqs: int) -> int:
    return region_slices(num_tokens, num_reqs)["block_tables"].start


def packed_size(num_tokens: int, num_reqs: int, width: int) -> int:
    return tables_offset(num_tokens, num_reqs) + num_reqs * width


@dataclass
class HostStep:
    """One step's inputs on the host, packed."""

    packed: np.ndarray  # int32
    num_tokens: int
    num_reqs: int
    width: int
    max_seqlen_q: int
    max_seqlen_k: int
    sample_requests: list[Request]
    num_sampled: int
    # input positions whose token the previous step sampled and the host has not read: [2, P] int64
    # (step token index, row of the previous step's tokens), or None
    pending: np.ndarray | None = None


def build_host_step(
    out: SchedulerOutput,
    block_size: int,
    *,
    pad_tokens: int | None = None,
    width: int | None = None,
) -> HostStep:
    """Pack a SchedulerOutput. With ``pad_tokens`` (decode graphs) the batch is padded to that size:
    padded rows get slot -1 (nothing stored), a one-token context in block 0, and are not sampled.
    """
    items = out.scheduled
    num_real = len(items)
    q_lens = np.fromiter((s.num_tokens for s in items), dtype=np.int64, count=num_real)
    starts = np.fromiter((s.start for s in items), dtype=np.int64, count=num_real)
    num_tokens = int(q_lens.sum())
    num_reqs = num_real
    if pad_tokens is not None:  # every real item is a one-token decode here
        num_tokens = num_reqs = pad_tokens
    seq_lens_real = starts + q_lens
    max_blocks = max(len(s.request.block_ids) for s in items)
    if width is None:  # a multiple of ALIGN: the kernels' row stride keeps one specialization
        width = -(-max_blocks // ALIGN) * ALIGN
    elif max_blocks > width:
        raise ValueError(f"block table width {width} < {max_blocks} blocks of a scheduled request")

    packed = np.zeros(packed_size(num_tokens, num_reqs, width), dtype=np.int32)
    at = region_slices(num_tokens, num_reqs)
    input_ids, positions, slot_mapping = packed[at["input_ids"]], packed[at["positions"]], packed[at["slot_mapping"]]
    logits_indices, seq_lens, cu_seqlens_q = packed[at["logits_indices"]], packed[at["seq_lens"]], packed[at["cu_seqlens_q"]]
    block_tables = packed[at["block_tables"]].reshape(num_reqs, width)

    cu_real = np.zeros(num_real + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu_real[1:])
    pending_dst: list[int] = []  # step token index <- row of the previous step's sampled tokens
    pending_src: list[int] = []
    for i, s in enumerate(items):
        request = s.request
        block_tables[i, : len(request.block_ids)] = request.block_ids
        first, end = int(cu_real[i]), int(cu_real[i + 1])
        if request.num_pending_tokens and end - first + s.start > len(request.all_token_ids):
            # its last token is still on the device (sampled by the step in flight): the runner fills it in
            known = len(request.all_token_ids) - s.start
            input_ids[first : first + known] = request.all_token_ids[s.start :]
            pending_dst.append(first + known)
            pending_src.append(request.pending_row)
        else:
            input_ids[first:end] = request.all_token_ids[s.start : s.start + s.num_tokens]
    seq_of_token = np.repeat(np.arange(num_real), q_lens)
    pos = np.arange(int(cu_real[-1])) - cu_real[seq_of_token] + starts[seq_of_token]
    positions[: len(pos)] = pos
    slot_mapping[: len(pos)] = block_tables[seq_of_token, pos // block_size] * block_size + pos % block_size
    seq_lens[:num_real] = seq_lens_real
    cu_seqlens_q[: num_real + 1] = cu_real
    if num_reqs > num_real:  # padding rows: one query, one key, nothing stored
        slot_mapping[num_real:] = -1
        seq_lens[num_real:] = 1
        cu_seqlens_q[num_real + 1 :] = np.arange(num_real + 1, num_reqs + 1)

    sample_rows = [i for i, s in enumerate(items) if s.samples]
    logits_indices[: len(sample_rows)] = cu_real[1:][sample_rows] - 1
    return HostStep(
        packed=packed,
        num_tokens=num_tokens,
        num_reqs=num_reqs,
        width=width,
        max_seqlen_q=int(q_lens.max()),
        max_seqlen_k=int(seq_lens_real.max()),
        sample_requests=[items[i].request for i in sample_rows],
        num_sampled=len(sample_rows),
        pending=np.array([pending_dst, pending_src], dtype=np.int64) if pending_dst else None,
    )


@dataclass
class DeviceStep:
    """Device views of one step's packed inputs."""

    input_ids: torch.Tensor  # int64 [1, T]
    position_ids: torch.Tensor  # int64 [1, T]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [num_sampled]


def device_views(
    buffer: torch.Tensor,
    num_tokens: int,
    num_reqs: int,
    width: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    num_sampled: int,
) -> DeviceStep:
    """Slice a device int32 buffer holding a packed step into the tensors the forward reads."""
    at = region_slices(num_tokens, num_reqs)
    input_ids, positions, slot_mapping = buffer[at["input_ids"]], buffer[at["positions"]], buffer[at["slot_mapping"]]
    logits_indices, seq_lens, cu_seqlens_q = buffer[at["logits_indices"]], buffer[at["seq_lens"]], buffer[at["cu_seqlens_q"]]
    start = at["block_tables"].start
    block_tables = buffer[start : start + num_reqs * width].view(num_reqs, width)
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        seq_lens=seq_lens,
        cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
    )
    return DeviceStep(
        input_ids=input_ids.long()[None],
        position_ids=positions.long()[None],
        metadata=metadata,
        logits_indices=logits_indices[:num_sampled].long(),
    )
