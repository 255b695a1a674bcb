"""The runner's persistent batch, and one step's inputs packed into ONE int32 host array (one transfer).

The runner keeps a state per request between steps (``CachedRequestState``: settings and known tokens)
and one block-table row per request in a numpy table, both updated from each ``SchedulerOutput`` by
diffs: a request arrives whole once, then only its new blocks. Packing a step gathers the scheduled rows.

Layout of the packed array for a step of T tokens, R requests and block-table width W (each region
padded to a multiple of ALIGN elements):

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

from ..core.block_pool import cdiv
from ..core.scheduler_output import ScheduledRequest, SchedulerOutput
from ..sampling.request_state import CachedRequestState
from ..sampling.sampler import StepResult
from .attention import AttentionMetadata
from .long_rope import long_positions

ALIGN = 16  # elements: every region starts 64-byte aligned, so Triton's pointer-alignment
# specialization sees the same alignment every step (no recompiles as the layout shifts)

# input_ids .. logits_indices lead: the forward reads them as int64, converted in one kernel (widen_leading_regions)
REGIONS = ("input_ids", "positions", "slot_mapping", "logits_indices", "seq_lens", "cu_seqlens_q")


def padded_width(num_blocks: int) -> int:
    """Block-table columns for ``num_blocks`` blocks: a multiple of ALIGN, so the kernels' row stride keeps
    one Triton specialization."""
    return cdiv(max(num_blocks, 1), ALIGN) * ALIGN


def region_slices(num_tokens: int, num_reqs: int) -> dict[str, slice]:
    """Where each per-step array sits in the packed buffer; block tables follow at ``tables_offset``."""
    lengths = (num_tokens, num_tokens, num_tokens, num_reqs, num_reqs, num_reqs + 1)
    slices, o = {}, 0
    for name, n in zip(REGIONS, lengths):
        slices[name] = slice(o, o + n)
        o += cdiv(n, ALIGN) * ALIGN
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
    sample_states: list[CachedRequestState]  # the requests sampled this step, in logits-row order
    sample_positions: list[int]  # their sequence lengths (the sampling noise counter)
    # input positions whose token the previous step sampled and the host has not read: [2, P] int64
    # (step token index, row of the previous step's tokens), or None
    pending: np.ndarray | None = None

    @property
    def num_sampled(self) -> int:
        return len(self.sample_states)


class InputBatch:
    """Request states and block-table rows the runner keeps between steps."""

    def __init__(self, block_size: int, width: int = ALIGN, long_from: int | None = None):
        self.block_size = block_size
        self.long_from = long_from  # longrope: positions of tokens rotated long carry LONG_POSITION (long_rope.py)
        self.width = width  # block-table columns (grown when a request needs more)
        self.states: dict[str, CachedRequestState] = {}
        self.block_table = np.zeros((0, width), dtype=np.int32)
        self.num_blocks = np.zeros(0, dtype=np.int32)
        self.free_rows: list[int] = []

    def _take_row(self) -> int:
        if not self.free_rows:
            old = self.block_table.shape[0]
            new = max(16, 2 * old)
            self.block_table = np.concatenate([self.block_table, np.zeros((new - old, self.width), np.int32)])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros(new - old, np.int32)])
            self.free_rows = list(range(new - 1, old - 1, -1))
        return self.free_rows.pop()

    def _drop(self, request_id: str) -> CachedRequestState | None:
        state = self.states.pop(request_id, None)
        if state is not None:
            state.is_finished = True
            self.free_rows.append(state.row)
        return state

    def _set_blocks(self, row: int, start: int, block_ids: list[int]) -> None:
        end = start + len(block_ids)
        if end > self.width:
            grown = padded_width(max(end, 2 * self.width))
            self.block_table = np.pad(self.block_table, ((0, 0), (0, grown - self.width)))
            self.width = grown
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def update(self, out: SchedulerOutput) -> None:
        """Apply a step's diffs: forget dropped requests, add new ones, extend changed block tables."""
        preempted = set(out.preempted_ids)
        searches = {}
        for request_id in out.dropped_ids:
            state = self._drop(request_id)
            if state is not None and state.beam_search is not None and request_id in preempted:
                searches[id(state.beam_search)] = state.beam_search
        for search in searches.values():
            search.forget_rows()  # its group was preempted: the round's rows are computed again
        for new in out.new_requests:
            self._drop(new.request_id)
            state = CachedRequestState(
                new.request_id,
                new.params,
                list(new.token_ids),
                new.num_prompt_tokens,
                sequence_index=new.sequence_index,
                num_forks=new.num_forks,
                beam_search=new.beam_search,
            )
            state.cache_salt = new.cache_salt
            state.row = self._take_row()
            self._set_blocks(state.row, 0, new.block_ids)
            self.states[new.request_id] = state
        for diff in out.cached_requests:
            self._set_blocks(self.states[diff.request_id].row, diff.start, diff.block_ids)

    def reset(self) -> None:
        for request_id in list(self.states):
            self._drop(request_id)

    def max_blocks(self, scheduled: list[ScheduledRequest]) -> int:
        """The most blocks any of the scheduled requests holds."""
        by_id = self.states
        rows = np.array([by_id[s.request_id].row for s in scheduled], dtype=np.int64)
        return int(self.num_blocks[rows].max())

    def pack(
        self,
        scheduled: list[ScheduledRequest],
        previous: StepResult | None,
        *,
        pad_to: tuple[int, int] | None = None,
        width: int | None = None,
    ) -> HostStep:
        """Pack a step. With ``pad_to = (tokens, requests)`` (a CUDA graph's shape) the step is padded to it:
        padding sequences take one padding token each, the last of them the rest, and those past the padding
        tokens none; padding stores nothing (slot -1), attends only to itself (its block-table row is block 0)
        and is not sampled. A request whose last input token the previous step sampled (not yet read on the
        host) takes it from that step's device tokens (``HostStep.pending``)."""
        by_id = self.states
        states = [by_id[s.request_id] for s in scheduled]
        num_real = len(scheduled)
        rows = np.array([state.row for state in states], dtype=np.int64)
        q_lens = np.array([s.num_tokens for s in scheduled], dtype=np.int64)
        starts_list = [s.start for s in scheduled]
        starts = np.array(starts_list, dtype=np.int64)
        num_tokens, num_reqs = (int(q_lens.sum()), num_real) if pad_to is None else pad_to
        seq_lens_real = starts + q_lens
        max_blocks = int(self.num_blocks[rows].max())
        if width is None:
            width = padded_width(max_blocks)
        elif max_blocks > width:
            raise ValueError(f"block table width {width} < {max_blocks} blocks of a scheduled request")

        packed = np.zeros(packed_size(num_tokens, num_reqs, width), dtype=np.int32)
        at = region_slices(num_tokens, num_reqs)
        input_ids, positions, slot_mapping = (
            packed[at["input_ids"]],
            packed[at["positions"]],
            packed[at["slot_mapping"]],
        )
        logits_indices, seq_lens, cu_seqlens_q = (
            packed[at["logits_indices"]],
            packed[at["seq_lens"]],
            packed[at["cu_seqlens_q"]],
        )
        block_tables = packed[at["block_tables"]].reshape(num_reqs, width)
        block_tables[:num_real] = self.block_table[rows, :width]

        cu_real = np.zeros(num_real + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu_real[1:])
        # the known input tokens, in step order (one numpy write); a decode token is usually still on the device
        row_of = previous.row_of if previous is not None else {}
        known_ids: list[int] = []
        known_dst: list[int] = []  # step token index of each single known token (decode rows)
        pending_dst: list[int] = []  # step token index <- row of the previous step's sampled tokens
        pending_src: list[int] = []
        for first, item, state, start in zip(cu_real.tolist(), scheduled, states, starts_list):
            tokens = state.token_ids
            end, known = start + item.num_tokens, len(tokens)
            if end > known:  # its last token is still on the device (sampled by the step in flight)
                src = row_of.get(state.request_id)
                if src is None or end != known + 1:
                    raise RuntimeError(f"request {state.request_id} waits for a token no step in flight sampled")
                if known > start:
                    input_ids[first : first + known - start] = tokens[start:known]
                pending_dst.append(first + known - start)
                pending_src.append(src)
            elif end == start + 1:
                known_dst.append(first)
                known_ids.append(tokens[start])
            else:
                input_ids[first : first + end - start] = tokens[start:end]
        if known_dst:
            input_ids[known_dst] = known_ids
        seq_of_token = np.repeat(np.arange(num_real), q_lens)
        pos = np.arange(int(cu_real[-1])) - cu_real[seq_of_token] + starts[seq_of_token]
        bs = self.block_size
        if self.long_from is None:
            positions[: len(pos)] = pos
        else:
            salted = np.array([state.cache_salt is not None for state in states])
            positions[: len(pos)] = long_positions(pos, salted[seq_of_token], self.long_from)
        slot_mapping[: len(pos)] = block_tables[seq_of_token, pos // bs] * bs + pos % bs
        seq_lens[:num_real] = seq_lens_real
        cu_seqlens_q[: num_real + 1] = cu_real
        num_pad_tokens = num_tokens - int(cu_real[-1])
        if num_pad_tokens or num_reqs > num_real:
            _pad(positions, slot_mapping, seq_lens, cu_seqlens_q, num_real, num_reqs, num_pad_tokens)

        sample_rows = [i for i, s in enumerate(scheduled) if s.samples]
        if len(sample_rows) == num_real:  # every request samples (decode steps): no fancy indexing
            logits_indices[:num_real] = cu_real[1:] - 1
            sample_states, sample_positions = states, seq_lens_real.tolist()
        else:
            logits_indices[: len(sample_rows)] = cu_real[1:][sample_rows] - 1
            sample_states = [states[i] for i in sample_rows]
            sample_positions = seq_lens_real[sample_rows].tolist()
        return HostStep(
            packed=packed,
            num_tokens=num_tokens,
            num_reqs=num_reqs,
            width=width,
            max_seqlen_q=int(q_lens.max()),
            max_seqlen_k=int(seq_lens_real.max()),
            sample_states=sample_states,
            sample_positions=sample_positions,
            pending=np.array([pending_dst, pending_src], dtype=np.int64) if pending_dst else None,
        )


def _pad(positions, slot_mapping, seq_lens, cu_seqlens_q, num_real: int, num_reqs: int, num_pad_tokens: int) -> None:
    """Padding sequences num_real.. own the last ``num_pad_tokens`` tokens: one each, the last of them the rest.
    Every padding token sits at position 0: the kernels take a sequence's query positions from its lengths, and
    a learned position table (GPT-2's) may hold fewer rows than a bucket's padding (an index past it is a
    device-side assert on CUDA)."""
    num_pad_reqs = num_reqs - num_real
    if num_pad_tokens and num_pad_reqs < 1:
        raise ValueError(f"{num_pad_tokens} padding tokens need a padding sequence: {num_reqs} requests are all real")
    counts = np.zeros(num_pad_reqs, dtype=np.int64)
    if num_pad_tokens:
        counts[: min(num_pad_reqs, num_pad_tokens)] = 1
        counts[min(num_pad_reqs, num_pad_tokens) - 1] += max(0, num_pad_tokens - num_pad_reqs)
    first = int(cu_seqlens_q[num_real])
    cu_seqlens_q[num_real + 1 :] = first + np.cumsum(counts)
    seq_lens[num_real:] = counts
    slot_mapping[first:] = -1
    positions[first:] = 0


@dataclass
class DeviceStep:
    """Device views of one step's packed inputs."""

    input_ids: torch.Tensor  # int64 [1, T]
    position_ids: torch.Tensor  # int64 [1, T]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [num_sampled]


def device_views(buffer: torch.Tensor, host: HostStep) -> DeviceStep:
    """Slice a device int32 buffer holding a packed step into the tensors the forward reads."""
    at = region_slices(host.num_tokens, host.num_reqs)
    start = at["block_tables"].start
    metadata = AttentionMetadata(
        slot_mapping=buffer[at["slot_mapping"]],
        block_tables=buffer[start : start + host.num_reqs * host.width].view(host.num_reqs, host.width),
        seq_lens=buffer[at["seq_lens"]],
        cu_seqlens_q=buffer[at["cu_seqlens_q"]],
        max_seqlen_q=host.max_seqlen_q,
        max_seqlen_k=host.max_seqlen_k,
    )
    wide = widen_leading_regions(buffer, at)
    return DeviceStep(
        input_ids=wide[at["input_ids"]][None],
        position_ids=wide[at["positions"]][None],
        metadata=metadata,
        logits_indices=wide[at["logits_indices"]][: host.num_sampled],
    )


def widen_leading_regions(buffer: torch.Tensor, at: dict[str, slice]) -> torch.Tensor:
    """The int64 copy of the regions from ``input_ids`` to ``logits_indices`` (they lead the packed buffer): one
    conversion kernel for the three the forward needs as int64, instead of one each."""
    return buffer[: at["logits_indices"].stop].long()
