"""Batched token selection: greedy, and sampling with transformers' warpers reproduced on the device.

Sampling uses the Gumbel-max trick (``argmax(scores + Gumbel noise)`` draws from ``softmax(scores)``)
with noise from a counter-based hash of (request seed, token position, vocab index). So a request's
draws depend only on its own seed and progress - never on which requests share the batch or on how
the scheduler split the work - and no device sync is needed to sample.

Before that, every row's logits processors run (``processors``): batched kinds for the common ones,
the exact transformers call row by row for the rest. A row whose processed scores leave nothing to draw
from (NaN, +inf, or only -inf: stock ``generate`` raises in ``torch.multinomial`` there) is flagged as an
error instead of silently picking token 0.

``Sampler.sample`` takes a step's logits rows and the runner's states of the requests they belong to, and
also handles the rows that are not one plain draw: the first sample of a parallel-sampling parent (its row
repeated for the sequences it forks into) and the rows of beam-search groups (collected until a round is
complete, then selected with transformers' beam steps).
"""

from __future__ import annotations

import functools

import torch

from ..core.block_pool import cdiv
from ..core.runner_output import BeamRound, ForkedSample, ModelRunnerOutput, SampledToken
from ..kernels._checks import FLOAT_DTYPES
from .parallel_sampling import child_params
from .processors import StageContext, run_stages
from .request_state import CachedRequestState

_MASK32 = 0xFFFFFFFF
NO_TOKEN_ERROR = (
    "the probability tensor contains `inf`, `nan` or only -inf scores after the logits processors "
    "(stock generate raises here too): no token can be sampled"
)


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


def _column_key(vocab_size: int, device: torch.device) -> torch.Tensor:
    """The per-vocab-index half of the hash."""
    return _mix32(torch.arange(vocab_size, dtype=torch.int64, device=device) + 0x9E3779B9)


def gumbel_noise(
    seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int, column_key: torch.Tensor | None = None
) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[N, vocab_size]`` determined by (seed, counter, vocab index) alone."""
    seeds = seeds.to(torch.int64)
    if column_key is None:
        column_key = _column_key(vocab_size, seeds.device)
    row_key = _mix32(((seeds >> 32) & _MASK32) ^ _mix32(counters.to(torch.int64) & _MASK32))
    row_key = _mix32(row_key ^ (seeds & _MASK32))
    bits = _mix32(column_key[None, :] ^ row_key[:, None])
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # strictly inside (0, 1)
    return -torch.log(-torch.log(uniform))


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
FEW_ROWS = 32  # row_argmax takes its own path below this many rows (torch's argmax is fine for more)


def row_argmax(scores: torch.Tensor) -> torch.Tensor:
    """``scores.argmax(dim=-1)`` (the first maximum on ties, a NaN first), fast for a few long rows.

    One row of a large vocabulary is slow for torch on the GPU (a single-block reduction, or several small
    kernels: 9-26 us on an H100 by vocabulary size); on CUDA with Triton, few rows go to hfpaged's two-launch
    chunked argmax (``hfpaged.kernels.argmax``). Elsewhere, few rows are reduced in chunks first (the max of each
    chunk, then of the chunk maxima), which keeps the first-maximum rule.
    """
    num_rows, vocab = scores.shape
    if num_rows >= FEW_ROWS or vocab < 4096:
        return scores.argmax(dim=-1)
    if (
        scores.device.type == "cuda"
        and scores.dtype in FLOAT_DTYPES  # the kernel's dtypes (others: torch's chunked path below)
        and scores.stride(1) == 1
        and _triton_argmax() is not None
    ):
        return _triton_argmax()(scores)
    width = cdiv(vocab, _ARGMAX_CHUNKS)
    if width * _ARGMAX_CHUNKS != vocab:
        scores = torch.nn.functional.pad(scores, (0, width * _ARGMAX_CHUNKS - vocab), value=float("-inf"))
    values, index = scores.view(num_rows, _ARGMAX_CHUNKS, width).max(dim=-1)
    chunk = values.argmax(dim=-1, keepdim=True)
    return (chunk * width + index.gather(1, chunk))[:, 0]


@functools.cache
def _triton_argmax():
    """``hfpaged.kernels.argmax.row_argmax``, or None without Triton."""
    try:
        from ..kernels.argmax import row_argmax as kernel
    except ImportError:
        return None
    return kernel


class StepResult:
    """One step's picks: the tokens on the device (the next step reads a request's pending token there) and
    their copy to the host, started when the step was launched; ``result()`` waits for that copy only.

    Reading the result also appends each pick to its request's runner state (unless the runner dropped it).
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        states: list[CachedRequestState],
        flat: torch.Tensor | None = None,
        logprob_rows: list[int] = (),
        top_k: int = 0,
        num_error_flags: int = 0,
        forks: dict[str, list[tuple[int, CachedRequestState]]] | None = None,
        beam_rounds: list[BeamRound] | None = None,
    ):
        self.tokens = tokens  # int64 [num_rows] on the logits' device; rows beyond the plain ones are forks
        self.states = states  # the request state of each row (forked sequences: their own, not kept)
        self.row_of = {state.request_id: row for row, state in enumerate(states)}
        self.logprob_rows = list(logprob_rows)
        self.top_k = top_k
        self.num_error_flags = num_error_flags
        self.forks = forks or {}
        self._forked_ids = {child.request_id for children in self.forks.values() for _, child in children}
        self.beam_rounds = beam_rounds or []
        self.failures: dict[str, BaseException] = {}  # request id -> what its own processor raised
        # everything the host needs, in one copy: the token ids alone, or one float32 row with flags/log-probs
        self._host, self._event = _copy_to_host(tokens if flat is None else flat)
        self._flat = flat is not None
        self._output: ModelRunnerOutput | None = None

    def is_ready(self) -> bool:
        """Whether the tokens are on the host already (reading them would not wait for the device)."""
        return self._output is not None or self._event is None or self._event.query()

    def result(self) -> ModelRunnerOutput:
        """Wait for the copy (once) and unpack it."""
        if self._output is None:
            if self._event is not None:
                self._event.synchronize()
            values = self._host.tolist()
            token_ids = values[: len(self.states)] if self._flat else values
            for state, token_id in zip(self.states, token_ids):
                if not state.is_finished:
                    state.append_token(int(token_id))
            self._output = self._unpack(values)
        return self._output

    def _unpack(self, values: list) -> ModelRunnerOutput:
        states = self.states
        num_rows = len(states)
        token_ids = [int(t) for t in values[:num_rows]] if self._flat else values
        request_ids = [state.request_id for state in states]
        output = ModelRunnerOutput(request_ids, token_ids, beam_rounds=self.beam_rounds)
        if self._flat:
            at = num_rows
            first_flagged = num_rows - self.num_error_flags
            for row, flag in enumerate(values[at : at + self.num_error_flags], start=first_flagged):
                if flag:
                    output.errors[request_ids[row]] = NO_TOKEN_ERROR
            at += self.num_error_flags
            if self.logprob_rows:
                num_lp, k = len(self.logprob_rows), self.top_k
                chosen = values[at : at + num_lp]
                top_values = values[at + num_lp : at + num_lp + num_lp * k]
                top_ids = values[at + num_lp + num_lp * k :]
                output.logprobs = [None] * num_rows
                output.top_logprobs = [None] * num_rows
                for j, row in enumerate(self.logprob_rows):
                    output.logprobs[row] = chosen[j]
                    wanted = states[row].params.top_logprobs
                    if wanted:
                        pairs = zip(top_ids[j * k : j * k + wanted], top_values[j * k : j * k + wanted])
                        output.top_logprobs[row] = {int(t): v for t, v in pairs if v != float("-inf")}
        if self.forks:  # the forked sequences' rows go with their parents
            rows = {request_id: row for row, request_id in enumerate(request_ids)}
            for parent_id, children in self.forks.items():
                output.forks[parent_id] = [
                    ForkedSample(index, child.params, _picked(output, rows[child.request_id]))
                    for index, child in children
                ]
            keep = [row for row, state in enumerate(states) if state.request_id not in self._forked_ids]
            output.request_ids = [request_ids[row] for row in keep]
            output.token_ids = [token_ids[row] for row in keep]
            if output.logprobs is not None:
                output.logprobs = [output.logprobs[row] for row in keep]
                output.top_logprobs = [output.top_logprobs[row] for row in keep]
        if self.failures:  # a forked sequence's failure fails its parent (the fork is not made)
            parent_of = {child.request_id: parent for parent, children in self.forks.items() for _, child in children}
            for request_id, error in self.failures.items():
                output.errors[parent_of.get(request_id, request_id)] = error
        return output


def _picked(output: ModelRunnerOutput, row: int) -> SampledToken:
    return SampledToken(
        output.token_ids[row],
        output.logprobs[row] if output.logprobs is not None else None,
        output.top_logprobs[row] if output.top_logprobs is not None else None,
    )


def all_plain_greedy(states: list[CachedRequestState]) -> bool:
    """Whether every row takes the argmax of its raw logits: no processors, sampling, log-probs, forks or beams."""
    for state in states:
        params = state.params
        if (
            params.stages
            or params.do_sample
            or params.return_logprobs
            or state.num_forks
            or state.beam_search is not None
        ):
            return False
    return True


class Sampler:
    """Processes each row's logits (its own stages), then picks one token per row; one device-to-host copy.

    Greedy rows take the argmax; sampled rows the argmax of scores plus Gumbel noise keyed by
    (seed, position). Log-probabilities are those of the processed distribution, as
    ``compute_transition_scores(..., normalize_logits=True)`` reports them.
    """

    def __init__(self) -> None:
        self.context: StageContext | None = None
        self._column_keys: dict[tuple[int, torch.device], torch.Tensor] = {}

    def sample(
        self,
        logits: torch.Tensor,
        states: list[CachedRequestState],
        positions: list[int],
        greedy: torch.Tensor | None = None,
        plain: bool | None = None,
    ) -> StepResult:
        """Pick the tokens of a step's sampled rows (``positions``: each row's sequence length, the noise
        counter). Beam rows go to their group; a parallel-sampling parent's first row is drawn for each
        sequence it forks into, too. ``greedy``: ``row_argmax(logits)`` already computed (by a CUDA graph), used
        where every row is plain greedy. ``plain``: ``all_plain_greedy(states)``, if the caller has it."""
        if plain is None:
            plain = all_plain_greedy(states)
        if plain and states:
            if greedy is None or greedy.shape[0] != logits.shape[0]:
                greedy = row_argmax(logits)
            return StepResult(greedy, states)
        beam_rounds: list[BeamRound] = []
        if any(state.beam_search is not None for state in states):
            logits, states, positions, beam_rounds = _take_beam_rows(logits, states, positions)
            greedy = None  # the rows changed
        forks: dict[str, list[tuple[int, CachedRequestState]]] = {}
        if any(state.num_forks for state in states):
            logits, states, positions, forks = _add_fork_rows(logits, states, positions)
            greedy = None
        if not states:
            return StepResult(logits.new_zeros(0, dtype=torch.int64), [], beam_rounds=beam_rounds)
        if self.context is not None:
            self.context.failures = {}
        result = self._draw(logits, states, positions, forks, beam_rounds, greedy)
        if self.context is not None and self.context.failures:
            result.failures = self.context.failures
        for children in forks.values():  # not kept: the scheduler sends them whole at their first step
            for _, child in children:
                child.is_finished = True
        return result

    def _draw(self, logits, states, positions, forks, beam_rounds, greedy=None) -> StepResult:
        if not any(s.params.stages or s.params.do_sample or s.params.return_logprobs for s in states):
            # plain greedy: argmax of the raw logits (a bf16 -> fp32 upcast keeps order and ties)
            if greedy is None or greedy.shape[0] != logits.shape[0]:
                greedy = row_argmax(logits)
            return StepResult(greedy, states, forks=forks, beam_rounds=beam_rounds)
        scores = logits.float()
        if any(s.params.stages for s in states):
            if self.context is None:
                self.context = StageContext(scores.shape[-1], scores.device)
            self.context.token_counts.resize(scores.shape[-1])  # a no-op unless the vocabulary was resized
            self.context.begin_step()
            scores = run_stages(scores, states, self.context)

        device = scores.device
        # sampled rows go last, so their error flags are the last rows' (see StepResult._unpack)
        sample_rows = [i for i, s in enumerate(states) if s.params.do_sample]
        if sample_rows and sample_rows != list(range(len(states) - len(sample_rows), len(states))):
            order = [i for i, s in enumerate(states) if not s.params.do_sample] + sample_rows
            index = torch.tensor(order).to(device, non_blocking=True)
            scores = scores.index_select(0, index)
            states = [states[i] for i in order]
            positions = [positions[i] for i in order]
            sample_rows = list(range(len(states) - len(sample_rows), len(states)))
        parts = []
        if not sample_rows:
            tokens = scores.argmax(dim=-1)
        else:
            first = sample_rows[0]
            sub = scores[first:]
            keys = torch.tensor(
                [[s.params.seed, p] for s, p in zip(states[first:], positions[first:])], dtype=torch.int64
            )
            keys = keys.to(device, non_blocking=True)
            noise = gumbel_noise(keys[:, 0], keys[:, 1], sub.shape[-1], self._column_key(sub.shape[-1], device))
            tokens = torch.cat([scores[:first].argmax(dim=-1), (sub + noise).argmax(dim=-1)])
            error = sub.isnan().any(dim=-1) | sub.isposinf().any(dim=-1) | sub.isneginf().all(dim=-1)
            parts.append(error.float())

        logprob_rows = [i for i, s in enumerate(states) if s.params.return_logprobs]
        top_k = 0
        if logprob_rows:
            index = torch.tensor(logprob_rows).to(device, non_blocking=True)
            logprobs = scores.index_select(0, index).log_softmax(dim=-1)
            parts.append(logprobs.gather(1, tokens.index_select(0, index)[:, None])[:, 0])
            top_k = min(max(states[i].params.top_logprobs for i in logprob_rows), logprobs.shape[-1])
            if top_k:
                top = torch.topk(logprobs, top_k, dim=-1)
                parts += [top.values.flatten(), top.indices.float().flatten()]
        if not parts:
            return StepResult(tokens, states, forks=forks, beam_rounds=beam_rounds)
        # one float32 copy for everything: token ids are exact in float32 (vocabularies are far below 2**24)
        flat = torch.cat([tokens.float()] + [p.float() for p in parts])
        return StepResult(tokens, states, flat, logprob_rows, top_k, len(sample_rows), forks, beam_rounds)

    def _column_key(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        key = self._column_keys.get((vocab_size, device))
        if key is None:
            key = self._column_keys[(vocab_size, device)] = _column_key(vocab_size, device)
        return key


def _take_beam_rows(logits, states, positions):
    """Hand beam rows to their groups (copied: a CUDA-graph step returns a view of a buffer the next step
    reuses); a group whose round is complete selects. Returns the other rows and the rounds."""
    beam_rows = [i for i, s in enumerate(states) if s.beam_search is not None]
    device = logits.device
    rows = logits.index_select(0, torch.tensor(beam_rows).to(device, non_blocking=True))
    rounds = []
    for j, i in enumerate(beam_rows):
        search = states[i].beam_search
        if search.take_row(states[i].sequence_index, rows[j]):
            try:
                parents, tokens, unfinished = search.advance()
            except Exception as error:  # its processors or criteria raised: that search ends, not the step
                search.forget_rows()
                rounds.append(BeamRound(search.request_id, [], [], False, error=error))
                continue
            rounds.append(BeamRound(search.request_id, parents, tokens, unfinished))
    keep = [i for i, s in enumerate(states) if s.beam_search is None]
    if not keep:
        return logits[:0], [], [], rounds
    index = torch.tensor(keep).to(device, non_blocking=True)
    return logits.index_select(0, index), [states[i] for i in keep], [positions[i] for i in keep], rounds


def _add_fork_rows(logits, states, positions):
    """Give every parent sampling its first token here the sequences it forks into: its row repeated, each
    with its own settings (``child_params``). Returns the rows with theirs appended, and them by parent."""
    rows, extra, extra_positions = [], [], []
    forks: dict[str, list[tuple[int, CachedRequestState]]] = {}
    for row, (state, position) in enumerate(zip(states, positions)):
        if not state.num_forks:
            continue
        children = []
        for index in range(1, state.num_forks + 1):
            child = CachedRequestState(
                f"{state.request_id}.{index}",
                child_params(state.params, index),
                list(state.token_ids),
                state.num_prompt_tokens,
                sequence_index=index,
            )
            children.append((index, child))
        state.num_forks = 0
        forks[state.request_id] = children
        rows += [row] * len(children)
        extra += [child for _, child in children]
        extra_positions += [position] * len(children)
    index = torch.tensor(rows).to(logits.device, non_blocking=True)
    return torch.cat([logits, logits.index_select(0, index)]), states + extra, positions + extra_positions, forks
