"""Batched token selection: greedy, and sampling with transformers' warpers reproduced on the device.

Sampling uses the Gumbel-max trick (``argmax(scores + Gumbel noise)`` draws from ``softmax(scores)``)
with noise from a counter-based hash of (request seed, token position, vocab index). So a request's
draws depend only on its own seed and progress - never on which requests share the batch or on how
the scheduler split the work - and no device sync is needed to sample.

Before that, every row's logits processors run (``logits_pipeline``): batched kinds for the common ones,
the exact transformers call row by row for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .logits_pipeline import StageContext, run_stages
from .request import Request

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors holding values < 2^32.

    The multipliers are below 2^31, so every product stays below 2^63: no signed overflow.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _MASK32
    x = x ^ (x >> 16)
    return x


_column_keys: dict[tuple[int, torch.device], torch.Tensor] = {}


def _column_key(vocab_size: int, device: torch.device) -> torch.Tensor:
    """The per-vocab-index half of the hash (the same every step: computed once per vocab size and device)."""
    key = _column_keys.get((vocab_size, device))
    if key is None:
        key = _column_keys[(vocab_size, device)] = _mix32(torch.arange(vocab_size, dtype=torch.int64, device=device) + 0x9E3779B9)
    return key


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[N, vocab_size]`` determined by (seed, counter, vocab index) alone."""
    seeds = seeds.to(torch.int64)
    row_key = _mix32(((seeds >> 32) & _MASK32) ^ _mix32(counters.to(torch.int64) & _MASK32))
    row_key = _mix32(row_key ^ (seeds & _MASK32))
    bits = _mix32(_column_key(vocab_size, seeds.device)[None, :] ^ row_key[:, None])
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # strictly inside (0, 1)
    return -torch.log(-torch.log(uniform))


@dataclass
class SamplerOutput:
    """One token per row, and (for rows that asked) its log-probability and the top alternatives."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]


def _copy_to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying ``tensor`` to (pinned) host memory without waiting; the event marks its completion."""
    if tensor.device.type != "cuda":
        return tensor, None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return host, event


_ARGMAX_CHUNKS = 64


def row_argmax(scores: torch.Tensor) -> torch.Tensor:
    """``scores.argmax(dim=-1)`` (the first maximum on ties), fast for a few long rows.

    One row of a large vocabulary is a single-block reduction on the GPU (~37 us for 128k logits on an
    H100); with few rows the vocabulary is reduced in chunks first (the max of each chunk, then of
    the chunk maxima), which spreads the work over many blocks and keeps the first-maximum rule.
    """
    num_rows, vocab = scores.shape
    if num_rows >= 32 or vocab < 4096:
        return scores.argmax(dim=-1)
    width = -(-vocab // _ARGMAX_CHUNKS)
    if width * _ARGMAX_CHUNKS != vocab:
        scores = torch.nn.functional.pad(scores, (0, width * _ARGMAX_CHUNKS - vocab), value=float("-inf"))
    values, index = scores.view(num_rows, _ARGMAX_CHUNKS, width).max(dim=-1)
    chunk = values.argmax(dim=-1, keepdim=True)
    return (chunk * width + index.gather(1, chunk))[:, 0]


class SampledTokens:
    """One step's picks: the tokens on the device (the next step can read them there) and their copy to
    the host, started when sampling was launched; ``result()`` waits for that copy only."""

    def __init__(self, tokens: torch.Tensor, requests: list[Request], logprob_rows: list[int], top_k: int,
                 flat: torch.Tensor | None = None):
        self.tokens = tokens  # int64 [num_rows], on the logits' device
        self.requests = requests
        self.logprob_rows = logprob_rows
        self.top_k = top_k
        # everything the host needs, in one copy: the token ids alone, or (with log-probs) one float32 row
        self._host, self._event = _copy_to_host(tokens if flat is None else flat)
        self._flat = flat is not None

    def result(self) -> SamplerOutput:
        """Wait for the copy and unpack it."""
        if self._event is not None:
            self._event.synchronize()
        values = self._host.tolist()
        num_rows = len(self.requests)
        if not self._flat:
            return SamplerOutput(values, [None] * num_rows, [None] * num_rows)
        return _unpack_logprobs(values, self.requests, self.logprob_rows, self.top_k)


class Sampler:
    """Processes each row's logits (its own stages), then picks one token per row; one device-to-host copy.

    Greedy rows take the argmax; sampled rows the argmax of scores plus Gumbel noise keyed by
    (seed, position). Log-probabilities are those of the processed distribution, as
    ``compute_transition_scores(..., normalize_logits=True)`` reports them.
    """

    def __init__(self) -> None:
        self.context: StageContext | None = None

    def _stage_context(self, scores: torch.Tensor) -> StageContext:
        if self.context is None:
            self.context = StageContext(scores.shape[-1], scores.device)
        return self.context

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """Pick and wait for the picks."""
        return self.launch(logits, requests).result()

    def launch(self, logits: torch.Tensor, requests: list[Request]) -> SampledTokens:
        """Pick one token per row on the device and start copying the picks to the host; no sync."""
        if not any(r.params.stages or r.params.do_sample or r.params.return_logprobs for r in requests):
            # plain greedy: argmax of the raw logits (a bf16 -> fp32 upcast keeps order and ties)
            return SampledTokens(row_argmax(logits), requests, [], 0)
        scores = logits.float()
        if any(r.params.stages for r in requests):
            context = self._stage_context(scores)
            context.begin_step()
            scores = run_stages(scores, requests, context)

        device = scores.device
        sample_rows = [i for i, r in enumerate(requests) if r.params.do_sample]
        if len(sample_rows) == len(requests):
            tokens = (scores + _noise(requests, scores)).argmax(dim=-1)
        else:
            tokens = scores.argmax(dim=-1)
            if sample_rows:
                rows = torch.tensor(sample_rows).to(device, non_blocking=True)
                sub = scores.index_select(0, rows)
                sampled = (sub + _noise([requests[i] for i in sample_rows], sub)).argmax(dim=-1)
                tokens = tokens.index_copy(0, rows, sampled)

        logprob_rows = [i for i, r in enumerate(requests) if r.params.return_logprobs]
        if not logprob_rows:
            return SampledTokens(tokens, requests, [], 0)
        return _with_logprobs(scores, tokens, requests, logprob_rows)


def _noise(requests: list[Request], scores: torch.Tensor) -> torch.Tensor:
    keys = torch.tensor([[r.params.seed, r.num_tokens] for r in requests], dtype=torch.int64)
    keys = keys.to(scores.device, non_blocking=True)
    return gumbel_noise(keys[:, 0], keys[:, 1], scores.shape[-1])


def _with_logprobs(scores: torch.Tensor, tokens: torch.Tensor, requests: list[Request], rows: list[int]) -> SampledTokens:
    """Tokens plus log-softmax of the processed scores at the chosen token (and the top-k), in one copy."""
    index = torch.tensor(rows).to(scores.device, non_blocking=True)
    logprobs = scores.index_select(0, index).log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.index_select(0, index)[:, None])[:, 0]
    top_k = min(max(requests[i].params.top_logprobs for i in rows), logprobs.shape[-1])
    # one float32 copy for everything: token ids are exact in float32 (vocabularies are far below 2**24)
    parts = [tokens.float(), chosen.float()]
    if top_k:
        top = torch.topk(logprobs, top_k, dim=-1)
        parts += [top.values.float().flatten(), top.indices.float().flatten()]
    return SampledTokens(tokens, requests, rows, top_k, flat=torch.cat(parts))


def _unpack_logprobs(flat: list[float], requests: list[Request], rows: list[int], k: int) -> SamplerOutput:
    num_rows = len(requests)
    token_ids = [int(t) for t in flat[:num_rows]]
    row_logprobs: list[float | None] = [None] * num_rows
    row_top: list[dict[int, float] | None] = [None] * num_rows
    num_lp = len(rows)
    values = flat[num_rows + num_lp : num_rows + num_lp + num_lp * k]
    ids = flat[num_rows + num_lp + num_lp * k :]
    for j, i in enumerate(rows):
        row_logprobs[i] = flat[num_rows + j]
        wanted = requests[i].params.top_logprobs
        if wanted:
            pairs = zip(ids[j * k : j * k + wanted], values[j * k : j * k + wanted])
            row_top[i] = {int(t): v for t, v in pairs if v != float("-inf")}
    return SamplerOutput(token_ids, row_logprobs, row_top)
