"""The engine loop (add_request / step / abort) and ``generate_many``, a thin loop over it."""

from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

import torch
from transformers import GenerationConfig, PreTrainedModel

from .outputs import GenerationResult, RequestOutput
from .params import ResolvedConfig, make_request_params, resolve_generation_config
from .patch import PatchState, get_state, patch
from .request import Request, RequestStatus
from .runner import ModelRunner
from .sampling import Sampler
from .scheduler import Scheduler

# generate_many arguments that are not GenerationConfig fields
_CALL_ONLY = ("seed", "logits_processor", "stopping_criteria")

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
        self.scheduler = Scheduler(self.state.config, self.state.pool)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}

    # --- requests -------------------------------------------------------------------------------

    def validate_prompt(self, token_ids: list[int], index: int, max_length: int) -> None:
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

    def make_request(
        self,
        prompt: Any,
        resolved: ResolvedConfig,
        *,
        index: int,
        request_id: str | None = None,
        seed: int | None = None,
        logits_processor: Any = None,
        stopping_criteria: Any = None,
    ) -> Request:
        """Tokenize, resolve and validate one prompt (nothing is queued)."""
        token_ids = _to_token_ids(prompt, index, self.tokenizer)
        if not token_ids:
            raise ValueError(f"prompt {index} is empty")
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        params = make_request_params(
            self.model,
            resolved,
            token_ids,
            seed=seed,
            logits_processor=logits_processor,
            stopping_criteria=stopping_criteria,
            tokenizer=self.tokenizer,
        )
        self.validate_prompt(token_ids, index, params.max_length)
        if request_id is None:
            request_id = f"req-{next(_request_counter)}"
        elif request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return Request(request_id, token_ids, params, index=index)

    def enqueue(self, request: Request) -> str:
        self.requests[request.request_id] = request
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
        call = {k: kwargs.pop(k) for k in _CALL_ONLY if k in kwargs}
        resolved = resolve_generation_config(self.model, generation_config, kwargs)
        request = self.make_request(prompt, resolved, index=None, request_id=request_id, **call)
        return self.enqueue(request)

    def abort(self, request_id: str) -> None:
        """Stop a request now and return its blocks to the pool (no-op if it already finished)."""
        request = self.requests.pop(request_id, None)
        if request is not None and not request.is_finished:
            self.scheduler.finish(request, "abort")

    def abort_all(self) -> None:
        for request_id in list(self.requests):
            self.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the loop -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one packed forward, sample, update. Returns what each advanced request gained."""
        out = self.scheduler.schedule()
        self.state.counters["num_preemptions"] += len(out.preempted)
        if out.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress: no running request and the next one does not fit")
            return []
        logits, sample_requests = self.runner.execute(out)
        tokens = self.sampler(logits, sample_requests) if sample_requests else []
        sampled = {request.request_id: token for request, token in zip(sample_requests, tokens)}
        advanced = self.scheduler.update(out, sampled)
        outputs = []
        for request in advanced:
            finished = request.is_finished
            if finished:
                request.finish_time = time.perf_counter()
                self.requests.pop(request.request_id, None)
            outputs.append(
                RequestOutput(
                    request_id=request.request_id,
                    index=request.index,
                    new_token_ids=[request.all_token_ids[-1]],
                    token_ids=request.output_token_ids,
                    finished=finished,
                    finish_reason=request.finish_reason,
                )
            )
        return outputs


def _result(request: Request, tokenizer: Any) -> GenerationResult:
    token_ids = request.output_token_ids
    text = tokenizer.decode(token_ids, skip_special_tokens=True) if tokenizer is not None else None
    metrics = {}
    if request.first_token_time is not None and request.finish_time is not None:
        latency = request.finish_time - request.arrival_time
        metrics = {
            "time_to_first_token": request.first_token_time - request.arrival_time,
            "latency": latency,
            "tokens_per_second": len(token_ids) / latency if latency > 0 else 0.0,
        }
    return GenerationResult(
        prompt_token_ids=request.prompt_token_ids,
        token_ids=token_ids,
        text=text,
        finish_reason=request.finish_reason or "length",
        metrics=metrics,
    )


def generate_many(
    model: PreTrainedModel,
    prompts: Sequence[Any],
    generation_config: GenerationConfig | None = None,
    *,
    tokenizer: Any = None,
    progress: bool = False,
    **kwargs: Any,
) -> list[GenerationResult]:
    """Generate for every prompt with continuous batching over the paged KV pool; results in input order.

    ``generation_config``/``kwargs`` mean what they mean for ``model.generate``.
    """
    if isinstance(prompts, (str, torch.Tensor)) or (prompts and isinstance(prompts[0], int)):
        raise ValueError("prompts must be a list of prompts (strings or token-id lists), not a single prompt")
    engine = Engine(model, tokenizer=tokenizer)
    prompts = list(prompts)
    if not prompts:
        return []
    call = {k: kwargs.pop(k) for k in _CALL_ONLY if k in kwargs}
    base_seed = call.pop("seed", None)
    resolved = resolve_generation_config(model, generation_config, kwargs)
    requests = [
        engine.make_request(
            prompt,
            resolved,
            index=i,
            seed=None if base_seed is None else (base_seed + i) % 2**62,
            **call,
        )
        for i, prompt in enumerate(prompts)
    ]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc="generate_many", unit="req")
    start = time.perf_counter()
    num_generated = 0
    try:
        for request in requests:
            engine.enqueue(request)
        while engine.has_unfinished():
            outputs = engine.step()
            num_generated += len(outputs)
            if bar is not None:
                done = sum(1 for o in outputs if o.finished)
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
    for request in requests:
        if request.status is not RequestStatus.FINISHED:  # pragma: no cover - loop exits only when all finish
            raise RuntimeError(f"request {request.request_id} did not finish")
    return [_result(request, engine.tokenizer) for request in requests]
