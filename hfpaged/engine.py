"""The engine loop (add_request / step / abort) and ``generate_many``, a thin loop over it."""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from typing import Any, Sequence

import torch
from transformers import GenerationConfig, PreTrainedModel

from .beam_search import BeamGroup, take_beam_rows
from .outputs import GenerationResult, RequestOutput, SequenceOutput
from .parallel_sampling import SampleGroup, add_sample_rows
from .params import ResolvedConfig, make_request_params, resolve_generation_config
from .patch import PatchState, get_state, patch
from .prompt_settings import CallOptions, PromptSpec, expand_prompts, split_call_options
from .request import Request, RequestStatus
from .runner import ModelRunner
from .sampling import SampledTokens, Sampler, SamplerOutput
from .scheduler import Scheduler

_request_counter = itertools.count()


def _to_token_ids(prompt: Any, index: int, tokenizer: Any) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                f"prompt {index} is a string but no tokenizer is known; pass tokenizer= to generate_many or patch, "
                "or give token-id lists"
            )
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1:
            raise ValueError(f"prompt {index} is a tensor of shape {tuple(prompt.shape)}; expected 1-D token ids")
        return [int(t) for t in prompt.tolist()]
    if isinstance(prompt, (list, tuple)):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError(f"prompt {index} must be a string or a list of int token ids")
        return list(prompt)
    raise ValueError(f"prompt {index} has unsupported type {type(prompt).__name__}; give a string or token ids")


class Engine:
    """Continuous batching over a patched model: ``add_request``, ``step``, ``abort``, ``has_unfinished``."""

    def __init__(self, model: PreTrainedModel, tokenizer: Any = None, **patch_options: Any):
        if getattr(model, "_hfpaged", None) is None or patch_options:
            patch(model, tokenizer=tokenizer, **patch_options)
        self.model = model
        self.state: PatchState = get_state(model)
        self.tokenizer = tokenizer if tokenizer is not None else self.state.tokenizer
        if self.state.runner is None:
            self.state.runner = ModelRunner(model, self.state)
        self.runner: ModelRunner = self.state.runner
        cpu_pool = self.state.swap.pool if self.state.swap is not None else None
        self.scheduler = Scheduler(self.state.config, self.state.pool, self.state.counters, cpu_pool)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self.timings: dict[str, float] = defaultdict(float)  # host seconds per step phase, and "steps"
        self.stop_string_cache: dict = {}  # StopStringCriteria shared by requests with the same stop strings
        # several sequences per prompt: parents that have not sampled yet, and beam searches in progress
        self.unforked: set[Request] = set()
        self.beam_groups: set[BeamGroup] = set()
        self.in_flight: SampledTokens | None = None  # the launched step whose tokens the host has not read
        self.num_overlapped_steps = 0  # steps whose tokens were read back during the next step

    # --- requests -------------------------------------------------------------------------------

    def validate_prompt(self, token_ids: list[int], index: int, max_length: int, num_beams: int = 1) -> None:
        """Raise ValueError (naming the prompt and the numbers) for a prompt that can never run."""
        state = self.state
        if not token_ids:
            raise ValueError(f"prompt {index} is empty")
        bad = next((t for t in token_ids if t < 0 or t >= state.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt {index} has token id {bad} outside the vocabulary [0, {state.vocab_size})")
        if state.max_model_len is not None and len(token_ids) > state.max_model_len:
            raise ValueError(
                f"prompt {index} has {len(token_ids)} tokens, more than the model's maximum of "
                f"{state.max_model_len} positions"
            )
        # The last generated token never enters the cache: a request holds at most max_length - 1 slots.
        max_slots = max(len(token_ids), max_length - 1)
        blocks = -(-max_slots // state.config.block_size)
        if blocks > state.pool.num_blocks:
            raise ValueError(
                f"prompt {index} needs up to {max_slots} KV slots ({blocks} blocks of {state.config.block_size}) "
                f"but the pool holds only {state.pool.num_blocks} blocks; raise num_blocks or lower max_new_tokens"
            )
        # the beams of a group run (and, after a preemption, are recomputed) together: all must fit at once
        if num_beams > 1 and num_beams * blocks > state.pool.num_blocks:
            raise ValueError(
                f"prompt {index} with num_beams={num_beams} needs up to {num_beams} x {blocks} blocks of "
                f"{state.config.block_size} slots but the pool holds only {state.pool.num_blocks} blocks; "
                "raise num_blocks or lower max_new_tokens"
            )

    def make_request(
        self,
        prompt: Any,
        resolved: ResolvedConfig,
        options: CallOptions,
        *,
        index: int | None,
        request_id: str | None = None,
    ) -> Request:
        """Tokenize, resolve and validate one prompt (nothing is queued)."""
        token_ids = _to_token_ids(prompt, index, self.tokenizer)
        if not token_ids:
            raise ValueError(f"prompt {index} is empty")
        seed = options.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        params = make_request_params(
            self.model,
            resolved,
            token_ids,
            options,
            seed=seed,
            index=index,
            vocab_size=self.state.vocab_size,
            tokenizer=self.tokenizer,
            stop_string_cache=self.stop_string_cache,
            device=self.state.input_device,
        )
        self.validate_prompt(token_ids, index, params.max_length, params.num_beams)
        num_sequences = max(params.num_beams, params.num_return_sequences)
        if num_sequences > self.state.config.max_num_seqs:
            raise ValueError(
                f"prompt {index} runs {num_sequences} sequences at once (num_beams / num_return_sequences) but "
                f"max_num_seqs is {self.state.config.max_num_seqs}"
            )
        if request_id is None:
            request_id = f"req-{next(_request_counter)}"
        elif request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request = Request(request_id, token_ids, params, index=index)
        if params.num_beams > 1:
            BeamGroup(self.model, request, self.state.input_device)
        elif params.num_return_sequences > 1:
            SampleGroup(request, params.num_return_sequences)
        return request

    def make_requests(
        self,
        prompts: Sequence[Any],
        generation_config: GenerationConfig | list[GenerationConfig | None] | None,
        kwargs: dict[str, Any],
    ) -> list[Request]:
        """One request per prompt with its own settings (see ``prompt_settings``); nothing is queued."""
        specs = expand_prompts(list(prompts), generation_config, kwargs)
        resolved_by_config: dict[int, ResolvedConfig] = {}
        requests = []
        for index, spec in enumerate(specs):
            requests.append(self.make_request(spec.prompt, self._resolve(spec, resolved_by_config), spec.options, index=index))
        return requests

    def _resolve(self, spec: PromptSpec, cache: dict[int, ResolvedConfig]) -> ResolvedConfig:
        """Resolve once per distinct config among prompts that only use the call's keyword arguments."""
        if spec.has_own_settings:
            return resolve_generation_config(self.model, spec.generation_config, dict(spec.generate_kwargs))
        key = id(spec.generation_config)
        if key not in cache:
            cache[key] = resolve_generation_config(self.model, spec.generation_config, dict(spec.generate_kwargs))
        return cache[key]

    def enqueue(self, request: Request) -> str:
        self.requests[request.request_id] = request
        if request.sample_group is not None:
            self.unforked.add(request)
        if request.beam_group is not None:
            self.beam_groups.add(request.beam_group)
        self.scheduler.add(request)
        return request.request_id

    def add_request(
        self,
        prompt: Any,
        generation_config: GenerationConfig | None = None,
        request_id: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Queue one prompt (string or token ids); ``kwargs`` are generate-style settings. Returns its id."""
        if kwargs.get("streamer") is not None:
            raise ValueError("streamer= is for generate_many with one prompt; read Engine.step() outputs instead")
        generate_kwargs, options = split_call_options({k: v for k, v in kwargs.items() if k != "streamer"})
        resolved = resolve_generation_config(self.model, generation_config, generate_kwargs)
        request = self.make_request(prompt, resolved, CallOptions(**options), index=None, request_id=request_id)
        return self.enqueue(request)

    def abort(self, request_id: str) -> None:
        """Stop a request - all sequences of its prompt - now and return its blocks (no-op once finished)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        members = _members(request)
        if request.sample_group is not None:
            self.unforked.discard(members[0])
        elif request.beam_group is not None:
            request.beam_group.aborted = True
            self.beam_groups.discard(request.beam_group)
        for member in members:
            self.requests.pop(member.request_id, None)
            if not member.is_finished:
                self.scheduler.finish(member, "abort")

    def abort_all(self) -> None:
        for request_id in list(self.requests):
            self.abort(request_id)
        if not self.scheduler.has_unfinished():
            self.in_flight = None  # its tokens belong to finished requests only

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    # --- the loop -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one packed forward, sample, and report what requests gained.

        With ``async_scheduling`` (the default) a step's picks are read back one step later: the step is
        launched, then the host reads the previous step's tokens (appends them, checks stops) while the
        device computes, and the next step reads this one's tokens on the device. The outputs returned are
        then those of the previous step. Steps whose sampling needs the host's full token history (logits
        processors other than the sampling warpers, beam search, forking parallel samples) wait for their own
        tokens.
        """
        clock = time.perf_counter
        t0 = clock()
        out = self.scheduler.schedule()
        if out.is_empty:
            if self.in_flight is not None:
                return self._finish_in_flight()
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress: no running request and the next one does not fit")
            return []
        t1 = clock()
        previous = self.in_flight.tokens if self.in_flight is not None else None
        logits, sample_requests = self.runner.execute(out, previous)
        t2 = clock()
        forks = beam_rows = None
        if self.unforked:
            logits, sample_requests, forks = add_sample_rows(logits, sample_requests, self.unforked)
        if self.beam_groups:
            logits, sample_requests, beam_rows = take_beam_rows(logits, sample_requests)
        overlap = (
            self.state.config.async_scheduling
            and not forks
            and not beam_rows
            and not any(r.params.stages_read_history for r in sample_requests)
        )
        timings = self.timings
        if overlap:
            launched = self.sampler.launch(logits, sample_requests) if sample_requests else None
            t3 = clock()
            outputs = self._finish_in_flight()  # the previous step's tokens, read while this step runs
            self.scheduler.advance(out)
            for row, request in enumerate(sample_requests):
                if not request.is_finished:
                    request.num_pending_tokens = 1
                    request.pending_row = row
            self.in_flight = launched
            self.num_overlapped_steps += launched is not None
        else:
            outputs = self._finish_in_flight()  # this step's processors see every earlier token
            t3 = clock()
            self.scheduler.advance(out)
            if forks:
                for children in forks.values():
                    self.requests.update((child.request_id, child) for child in children)
            if sample_requests:
                picked = self.sampler(logits, sample_requests)
                outputs += self._take(sample_requests, picked, forks)
            if beam_rows:
                outputs += self._advance_beams(beam_rows)
        timings["schedule"] += t1 - t0
        timings["execute"] += t2 - t1  # host: inputs + launches (the device runs on asynchronously)
        timings["sample"] += t3 - t2  # sampling launches (a step that waits for its tokens: the previous step's too)
        timings["update"] += clock() - t3  # reading tokens back (waits included), appending, stop checks
        timings["steps"] += 1
        return outputs

    def _finish_in_flight(self) -> list[RequestOutput]:
        """Wait for the tokens of the step in flight (if any) and hand them to their requests."""
        launched, self.in_flight = self.in_flight, None
        if launched is None:
            return []
        t0 = time.perf_counter()
        picked = launched.result()
        self.timings["wait"] += time.perf_counter() - t0  # the host idle, waiting for the device
        return self._take(launched.requests, picked)

    def _take(
        self, requests: list[Request], picked: SamplerOutput, forks: dict[str, list[Request]] | None = None
    ) -> list[RequestOutput]:
        """Append sampled tokens (and log-probs), finish requests that stop; one output per request that grew."""
        for request, logprob, top in zip(requests, picked.logprobs, picked.top_logprobs):
            if logprob is not None and not request.is_finished:
                request.record_logprob(logprob, top)
        advanced = self.scheduler.append_tokens(requests, picked.token_ids, forks)
        outputs = []
        for request in advanced:
            finished = request.is_finished
            if finished:
                request.finish_time = time.perf_counter()
                self.requests.pop(request.request_id, None)
            num_tokens = len(request.all_token_ids)
            outputs.append(
                RequestOutput(
                    request_id=request.request_id,
                    index=request.index,
                    new_token_ids=[request.all_token_ids[-1]],
                    finished=finished,
                    finish_reason=request.finish_reason,
                    new_logprobs=None if request.logprobs is None else request.logprobs[-1:],
                    new_top_logprobs=None if request.top_logprobs is None else request.top_logprobs[-1:],
                    all_token_ids=request.all_token_ids,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_tokens=num_tokens,
                    sequence_index=request.sequence_index,
                )
            )
        return outputs

    def _advance_beams(self, beam_rows: list[tuple[Request, torch.Tensor]]) -> list[RequestOutput]:
        """Hand the beams their rows; groups whose round is complete select. Finished searches report."""
        ready = [request.beam_group for request, row in beam_rows if request.beam_group.take_row(request, row)]
        outputs = []
        for group in ready:
            if not group.advance(self.scheduler):
                continue
            self.beam_groups.discard(group)
            now = time.perf_counter()
            root = group.members[0]
            for member in group.members:
                member.finish_time = now
                self.requests.pop(member.request_id, None)
            for i, sequence in enumerate(group.returned_sequences()):
                all_token_ids = root.prompt_token_ids + sequence.token_ids
                outputs.append(
                    RequestOutput(
                        request_id=root.request_id,
                        index=root.index,
                        new_token_ids=sequence.token_ids,
                        finished=True,
                        finish_reason=sequence.finish_reason,
                        all_token_ids=all_token_ids,
                        num_prompt_tokens=root.num_prompt_tokens,
                        num_tokens=len(all_token_ids),
                        sequence_index=i,
                    )
                )
        return outputs


def _members(request: Request) -> list[Request]:
    """Every request decoding a sequence of ``request``'s prompt (itself alone, unless there are several)."""
    if request.sample_group is not None:
        return request.sample_group.members
    if request.beam_group is not None:
        return request.beam_group.members
    return [request]


def is_prompt_finished(request: Request) -> bool:
    """Whether every sequence of ``request``'s prompt has finished (``request``: the prompt's first request)."""
    return request.num_forks_pending == 0 and all(m.is_finished for m in _members(request))


def _sequences(request: Request, tokenizer: Any) -> list[SequenceOutput]:
    """Every sequence returned for the prompt of ``request`` (a group's first request)."""

    def decode(token_ids: list[int]) -> str | None:
        return tokenizer.decode(token_ids, skip_special_tokens=True) if tokenizer is not None else None

    if request.beam_group is not None:
        return [
            SequenceOutput(s.token_ids, decode(s.token_ids), s.finish_reason, score=s.score)
            for s in request.beam_group.returned_sequences()
        ]
    return [
        SequenceOutput(
            token_ids=m.output_token_ids,
            text=decode(m.output_token_ids),
            finish_reason=m.finish_reason or "length",
            logprobs=None if m.logprobs is None else list(m.logprobs),
            top_logprobs=None if m.top_logprobs is None else list(m.top_logprobs),
        )
        for m in _members(request)
    ]


def build_result(request: Request, tokenizer: Any) -> GenerationResult:
    """The GenerationResult of a finished (or aborted) request, with every sequence of its prompt."""
    sequences = _sequences(request, tokenizer)
    first = sequences[0]
    metrics = {}
    finish_times = [m.finish_time for m in _members(request)]
    if request.first_token_time is not None and None not in finish_times:
        latency = max(finish_times) - request.arrival_time
        num_tokens = sum(len(s.token_ids) for s in sequences)
        metrics = {
            "time_to_first_token": request.first_token_time - request.arrival_time,
            "latency": latency,
            "tokens_per_second": num_tokens / latency if latency > 0 else 0.0,
        }
    return GenerationResult(
        prompt_token_ids=request.prompt_token_ids,
        token_ids=first.token_ids,
        text=first.text,
        finish_reason=first.finish_reason,
        metrics=metrics,
        logprobs=first.logprobs,
        top_logprobs=first.top_logprobs,
        sequences=sequences,
    )


def check_prompt_list(prompts: Any) -> list[Any]:
    """``prompts`` as a list, refusing a single prompt passed where a list is expected."""
    if isinstance(prompts, (str, torch.Tensor, dict)) or (prompts and isinstance(prompts[0], int)):
        raise ValueError("prompts must be a list of prompts (strings, token-id lists or dicts), not a single prompt")
    return list(prompts)


def generate_many(
    model: PreTrainedModel,
    prompts: Sequence[Any],
    generation_config: GenerationConfig | Sequence[GenerationConfig | None] | None = None,
    *,
    tokenizer: Any = None,
    progress: bool = False,
    streamer: Any = None,
    **kwargs: Any,
) -> list[GenerationResult]:
    """Generate for every prompt with continuous batching over the paged KV pool; results in input order.

    ``generation_config``/``kwargs`` mean what they mean for ``model.generate`` (every GenerationConfig
    field, ``logits_processor=``, ``stopping_criteria=``, ``prefix_allowed_tokens_fn=``; ``stop_strings``
    need a tokenizer). Extras: ``seed`` (prompt i gets seed + i), ``presence_penalty``,
    ``frequency_penalty``, ``logit_bias`` ({token id: value}, vLLM semantics, applied after the
    logits processors and before the sampling warpers), ``return_logprobs`` and ``top_logprobs``.

    Several sequences per prompt: ``num_return_sequences=n`` with ``do_sample=True`` draws n samples that share
    the prompt's KV blocks; ``num_beams=k`` runs transformers' beam search (``length_penalty``,
    ``early_stopping``, ``num_return_sequences <= k``). Each result's ``sequences`` holds them all.

    Per prompt: ``generation_config`` may be a list (one config or None per prompt), and a prompt may be a
    dict ``{"prompt": ..., "generation_config": ..., **settings}`` whose config replaces the call's and
    whose settings (any of the above, ``seed`` included) override the call's keyword arguments.
    ``streamer=`` (a transformers ``TextStreamer``/``TextIteratorStreamer``) needs exactly one prompt.
    """
    prompts = check_prompt_list(prompts)
    if streamer is not None and len(prompts) != 1:
        raise ValueError(
            f"streamer= works with exactly one prompt, got {len(prompts)}; use model.stream_many() to stream many"
        )
    engine = Engine(model, tokenizer=tokenizer)
    if not prompts:
        return []
    requests = engine.make_requests(prompts, generation_config, kwargs)
    if streamer is not None and len(_members(requests[0])) + requests[0].num_forks_pending > 1:
        raise ValueError(
            "streamer= streams one sequence: not with num_beams > 1 or num_return_sequences > 1 "
            "(model.stream_many() streams parallel samples)"
        )
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc="generate_many", unit="req")
    start = time.perf_counter()
    num_generated = 0
    try:
        for request in requests:
            engine.enqueue(request)
        if streamer is not None:
            streamer.put(torch.tensor([requests[0].prompt_token_ids]))
        while engine.has_unfinished():
            outputs = engine.step()
            num_generated += len(outputs)
            if streamer is not None:
                for output in outputs:
                    streamer.put(torch.tensor(output.new_token_ids))
            if bar is not None:
                done = sum(1 for o in outputs if o.finished and o.sequence_index == 0)
                if done:
                    bar.update(done)
                elapsed = time.perf_counter() - start
                bar.set_postfix(tok_s=f"{num_generated / max(elapsed, 1e-9):.1f}", refresh=False)
    except BaseException:
        engine.abort_all()
        raise
    finally:
        if bar is not None:
            bar.close()
        if streamer is not None:
            streamer.end()
    for request in requests:
        if request.status is not RequestStatus.FINISHED:  # pragma: no cover - loop exits only when all finish
            raise RuntimeError(f"request {request.request_id} did not finish")
    return [build_result(request, engine.tokenizer) for request in requests]
