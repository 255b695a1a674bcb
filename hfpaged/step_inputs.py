"""Per-step inputs packed into ONE int32 array on the host, copied to the device in one transfer.

Layout of the packed array for a step of T tokens, R requests and block-table width W:

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


def packed_size(num_tokens: int, num_reqs: int, width: int) -> int:
    return 3 * num_tokens + 3 * num_reqs + 1 + num_reqs * width


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
    if width is None:
        width = max_blocks
    elif max_blocks > width:
        raise ValueError(f"block table width {width} < {max_blocks} blocks of a scheduled request")

    packed = np.zeros(packed_size(num_tokens, num_reqs, width), dtype=np.int32)
    o = 0
    input_ids = packed[o : o + num_tokens]; o += num_tokens  # noqa: E702
    positions = packed[o : o + num_tokens]; o += num_tokens  # noqa: E702
    slot_mapping = packed[o : o + num_tokens]; o += num_tokens  # noqa: E702
    logits_indices = packed[o : o + num_reqs]; o += num_reqs  # noqa: E702
    seq_lens = packed[o : o + num_reqs]; o += num_reqs  # noqa: E702
    cu_seqlens_q = packed[o : o + num_reqs + 1]; o += num_reqs + 1  # noqa: E702
    block_tables = packed[o:].reshape(num_reqs, width)

    cu_real = np.zeros(num_real + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu_real[1:])
    for i, s in enumerate(items):
        request = s.request
        block_tables[i, : len(request.block_ids)] = request.block_ids
        input_ids[cu_real[i] : cu_real[i + 1]] = request.all_token_ids[s.start : s.start + s.num_tokens]
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
    o = 0

    def take(n: int) -> torch.Tensor:
        nonlocal o
        view = buffer[o : o + n]
        o += n
        return view

    input_ids = take(num_tokens)
    positions = take(num_tokens)
    slot_mapping = take(num_tokens)
    logits_indices = take(num_reqs)
    seq_lens = take(num_reqs)
    cu_seqlens_q = take(num_reqs + 1)
    block_tables = take(num_reqs * width).view(num_reqs, width)
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
