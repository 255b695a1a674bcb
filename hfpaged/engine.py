"""One engine per model, and the handles every caller submits through. ``EngineCore`` (one per patched model, made
by ``patch``) joins the scheduler and the runner: ``step`` = schedule -> execute -> update, where an overlapped step's
result is read during the next step. Callers never drive it directly: each ``generate_many``/``stream_many`` call,
``Engine`` handle and server request goes through a ``Client``, which submits requests under the core's lock and
receives their outputs, whichever caller ran the step that produced them: requests of different callers share
batches, from any number of threads or asyncio tasks, and each caller gets exactly its own results."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import defaultdict, deque
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from .core.config import out_of_memory_message
from .core.interrupts import escapable, interrupts_deferred, raise_after_step, signals_held
from .core.kv_manager import KVManager
from .core.request import Request, is_prompt_finished
from .core.scheduler import Scheduler
from .core.scheduler_output import SchedulerOutput
from .model.attach import PatchState, get_state, reallocate_caches, release_caches
from .model.attention import check_attention_implementation, warn_if_autocast
from .model.kv_cache import refresh_length_limit, release_cuda_memory
from .model.runner import ModelRunner
from .model.tensor_parallel import check_lockstep, making_requests
from .model.weights_version import rewired_message
from .outputs import RequestOutput, progress_output
from .prompts import PromptMaker, check_batch, check_request_id, check_tokenizer
from .sampling.sampler import StepResult


class ModelUnpatched(RuntimeError):
    """This engine handle's model was unpatched, or patched again, since the handle was made."""


UNPATCHED = "this engine handle's model was unpatched or patched again: make a new one"


class EngineCore:
    """A model's scheduler and runner, and the step that joins them. Not thread-safe itself: ``lock`` it."""

    def __init__(self, model: PreTrainedModel, state: PatchState):
        config = state.config
        self.state = weakref.proxy(state)  # the state owns this engine: no reference cycle
        self.closed = False  # unpatch: no request is added any more
        self.kv = KVManager(
            state.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            num_cpu_blocks=state.num_cpu_blocks,
            counters=state.counters,
        )
        self.scheduler = Scheduler(config, self.kv, state.max_model_len, state.position_table)
        self.runner = ModelRunner(model, state)
        self.prompts = PromptMaker(model, state)
        self.lock = threading.RLock()
        self.in_flight: tuple[SchedulerOutput, StepResult] | None = None  # launched, result not read yet
        # prompt id -> (its client, held weakly, and its first request); a client dropped with prompts unfinished
        # (an Engine handle let go) leaves their ids in ``orphans``: the next step (or sleep, stats) aborts them
        self.owners: dict[str, tuple[weakref.ref[Client], Request]] = {}
        self.prompts.in_use = self.owners.__contains__  # generated ids skip the prompts not finished yet
        self.orphans: deque[str] = deque()
        self.timings: dict[str, float] = defaultdict(float)  # host seconds per step phase, and "steps"
        self.num_overlapped_steps = 0  # steps whose result was read during the next step
        # overlapped steps whose tokens had landed before the host came to read them: the device finished the
        # step before the host launched the next one, i.e. it waited on the host (on the CPU: every step)
        self.num_ready_reads = 0
        self.undelivered: list[RequestOutput] = []  # outputs a failed step made before failing (step_for_clients)
        self.guard: interrupts_deferred | None = None  # a step's Ctrl-C deferral (main thread)

    def step(self) -> list[RequestOutput]:
        """Schedule, launch, and read back what is due: the step before (if it overlapped this one) or this one.

        A step that fails leaves nothing half done: every running request goes back to waiting, to be recomputed
        (one an internal error caught with an unchecked token fails), the runner forgets its state; the error propagates."""
        clock = time.perf_counter
        t0 = clock()
        with contextlib.suppress(ReferenceError):  # (an unpatched model's stale handle: nothing to step)
            if self.state.weights.adapters_toggled():  # steps between calls under another adapter state (PEFT)
                self.check_weights(self.runner.model)
        scheduler_output, outputs, nesting = None, [], self.scheduler.nesting
        try:
            scheduler_output = self.scheduler.schedule()
            t1 = clock()
            outputs = list(scheduler_output.failed)
            self.scheduler.enter_step(scheduler_output, self.in_flight[0] if self.in_flight else None)  # (nested steps)
            with escapable(self.guard):  # (a second Ctrl-C may stop the forward)
                result = self.runner.execute(scheduler_output)
            t2 = clock()
            previous, self.in_flight = self.in_flight, None
            if previous is not None:
                self.num_ready_reads += previous[1].is_ready()
                outputs = outputs + self._update(previous)
            if result is not None and scheduler_output.overlapped:
                self.in_flight = (scheduler_output, result)
                self.num_overlapped_steps += 1
            elif result is not None:
                outputs += self._update((scheduler_output, result))
            elif previous is None and self.scheduler.has_unfinished():
                outputs = outputs or self.scheduler.no_progress(scheduler_output, nesting[1])  # or raises
            if self.in_flight is not None and not self.scheduler.has_unfinished():
                self.in_flight = None  # launched for requests that have finished since (eos): its tokens are nobody's
        except BaseException as error:
            # what the step made before failing (tokens kept; an update's half too): step_for_clients hands it out
            self.undelivered, self.scheduler.failed_outputs = outputs + self.scheduler.failed_outputs, []
            self.recover(error if nesting[1] else None)
            if isinstance(error, torch.OutOfMemoryError):
                message = out_of_memory_message(self.state.config, scheduler_output, error)
                raise torch.OutOfMemoryError(message) from error
            raise
        finally:
            self.scheduler.nesting = nesting
        if result is not None:  # a step nested in an update replaced it: the next step reads this one's tokens
            self.runner.previous = result
        if self.scheduler.nested_failure is not None:  # in this step's last update: its reset requeued every request
            self.scheduler.nested_failure = self.in_flight = None  # (the tokens in flight are sampled again)
        timings = self.timings
        timings["schedule"], timings["steps"] = timings["schedule"] + t1 - t0, timings["steps"] + 1
        timings["execute"] += t2 - t1  # host: inputs + launches (the device runs on asynchronously)
        timings["update"] += clock() - t2  # reading tokens back (waits included), appending, stop checks
        return outputs

    def _update(self, step: tuple[SchedulerOutput, StepResult]) -> list[RequestOutput]:
        scheduler_output, result = step
        t0 = time.perf_counter()
        with escapable(self.guard):
            runner_output = result.result()
        self.timings["wait"] += time.perf_counter() - t0  # the host idle, waiting for the device
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def recover(self, nested_error: BaseException | None = None) -> None:
        """After a failed step: nothing in flight, every unfinished request waiting to be recomputed."""
        self.in_flight = None
        self.scheduler.reset()
        self.runner.reset()
        self.scheduler.nested_failure = nested_error  # a nested step's: the enclosing step fails too (its reset)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    # --- callers ------------------------------------------------------------------------------------

    def add(self, request: Request, client: Client) -> None:
        """Queue a prompt's first request for ``client`` (call with the lock held)."""
        self.scheduler.add(request)
        self.owners[request.request_id] = (weakref.ref(client), request)

    def reap_orphans(self) -> None:
        """Abort the unfinished prompts of clients dropped since (call with the lock held)."""
        while self.orphans:
            prompt_id = self.orphans.popleft()
            if prompt_id in self.owners:
                self.abort(prompt_id)

    def step_for_clients(self) -> None:
        """Run one step and hand every output to the client that owns its prompt (call with the lock held); a failed
        step's outputs made before the failure too. A Ctrl-C, and a user's criterion's non-``Exception``, raise once
        they are out (``core/interrupts.py``; a step's own error wins, except a held Ctrl-C over an ``Exception``)."""
        self.reap_orphans()
        interrupts, failed, outer_guard = self.scheduler.interrupts, [], self.guard  # (outer: a re-entrant call)
        with interrupts_deferred() as deferral:
            self.guard = deferral if deferral.installed else None
            try:
                outputs = self.step()
            except BaseException as error:
                failed, outputs, self.undelivered = [error], self.undelivered, []
            self.guard = outer_guard
            self._deliver(outputs)
            pending = [] if failed else list(interrupts)
            interrupts.clear()
        raise_after_step(deferral, failed, pending)  # (it empties both lists: no cycle through this frame)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        finished = []
        owners = self.owners
        for output in outputs:
            owner = owners.get(output.prompt_id)
            if owner is None:
                continue
            client, root = owner[0](), owner[1]
            if client is None:  # dropped during the step: reaped by the next one
                continue
            client.outbox.append(output)
            if output.finished and is_prompt_finished(root):
                finished.append(output.prompt_id)  # after the loop: a beam search ends with several outputs
        for prompt_id in finished:
            self.owners.pop(prompt_id, None)

    def abort(self, prompt_id: str) -> None:
        """Stop every sequence of a prompt now and free its blocks (call with the lock held; a Ctrl-C waits for it)."""
        with signals_held():
            self.scheduler.abort(prompt_id)
            self.owners.pop(prompt_id, None)
            if not self.scheduler.has_unfinished():
                self.in_flight = None  # its tokens belong to finished requests only

    def abort_everything(self) -> None:
        """Finish every prompt with reason "abort" and tell its caller (call with the lock held; ``unpatch``): a
        caller waiting on them (another thread, a suspended stream, an ``Engine`` handle) sees them end."""
        for prompt_id, (client_ref, root) in list(self.owners.items()):
            self.abort(prompt_id)
            client = client_ref()
            if client is not None:
                client.outbox.extend(progress_output(member, 0) for member in root.members)
        for request_id in list(self.scheduler.requests):
            self.abort(request_id)

    def sleep(self) -> None:
        """Release the KV pool, CUDA graphs, compiled code and sampling tables; nothing may be running."""
        with self.lock:
            self.reap_orphans()
            if self.has_unfinished():
                n = len(self.scheduler.requests)
                raise RuntimeError(f"cannot sleep while {n} requests run on this model: let them finish or abort them")
            if self.state.asleep:
                return
            self.kv.reset_prefix_cache()  # the blocks' contents go with the memory
            self.runner.drop_graphs()
            self.runner.reset()
            self.runner.sampler.context = None
            release_caches(self.state)
            self.state.asleep = True
        release_cuda_memory()

    def sleep_if_idle(self) -> None:
        """``sleep`` when nothing runs (``EngineConfig.sleep_when_idle``: at the end of every call)."""
        with self.lock:
            self.reap_orphans()
            if not self.has_unfinished():
                self.sleep()

    def sleep_if_asked(self) -> None:
        """At the end of a call: ``sleep_if_idle`` if the config asks for it (nothing if the model was unpatched)."""
        with contextlib.suppress(ReferenceError):  # unpatched while the call ran: no state, no pool
            if self.state.config.sleep_when_idle:
                self.sleep_if_idle()

    def wake(self) -> None:
        """Allocate the pool again after ``sleep`` (as many blocks as before); a no-op when awake."""
        with self.lock:
            if self.state.asleep:
                reallocate_caches(self.state)
                self.state.asleep = False

    def check_weights(self, model: PreTrainedModel) -> None:
        """Drop what the old weights computed if they changed since the last call: cached prefix blocks, and
        (parameters in new storage, other PEFT adapters, forward hooks added or removed) the CUDA graphs and compiled
        code that baked them in. Attention weights moved off the pool's dtype or device, or attention layers added,
        replaced or reused, raise a ``ValueError`` at every call until the model is patched again or restored.
        Calibrated fp8 scales: again at the first idle step. Edited sliding windows: ``refresh_length_limit``."""
        state = self.state
        try:
            check_attention_implementation(state.attn_configs)
            warn_if_autocast()
            # the check and what it drops at once: a caller whose check ran between another's (which saw the change
            # and kept the new fingerprint) and its reset would find the change seen and step on old prefix blocks
            with self.lock:
                changed, rewired = state.weights.check(model)
                if changed:
                    # resize_token_embeddings: prompts and token lists are checked against the vocabulary as it is now
                    state.vocab_size = model.get_input_embeddings().weight.shape[0]
                    self.kv.reset_prefix_cache()
                    if state.kv_scale_source == "calibration":
                        state.recalibrate_when_idle = True
                    if rewired:  # model.to(dtype), a layer added / replaced / reused
                        self.runner.drop_graphs()
                        state.moved = rewired_message(model, state)
            refresh_length_limit(model, state)
            if state.moved:
                raise ValueError(state.moved)
            if state.recalibrate_when_idle:
                with self.lock:
                    if not self.has_unfinished():  # fp8: new weights, new K/V ranges; no block holds old KV
                        state.calibration_pending, state.recalibrate_when_idle = True, False
                        self.kv.reset_prefix_cache()  # blocks stored since the change hold the old scales' values
        except ReferenceError:  # the model was unpatched, or patched again, since this handle was made (or meanwhile)
            raise ModelUnpatched(UNPATCHED) from None


def _orphaned(orphans: deque[str], prompts: dict[str, Request]) -> None:
    orphans.extend(prompts)  # no lock here (a finalizer may run anywhere): the engine reaps them under its lock


def engine_of(model: PreTrainedModel) -> EngineCore:
    """The model's engine (``patch`` creates it); the model must be patched."""
    return get_state(model).engine


class Client:
    """One caller's handle on a model's engine: its requests, and an outbox for their outputs."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.outbox: deque[RequestOutput] = deque()
        self.prompts: dict[str, Request] = {}  # unfinished prompts submitted here, by id (first request)
        weakref.finalize(self, _orphaned, core.orphans, self.prompts).atexit = False  # dropped: unfinished aborted

    def submit(self, requests: list[Request]) -> None:
        with self.core.lock:
            if self.core.closed:  # unpatched since these requests were made
                raise ModelUnpatched(UNPATCHED)
            if self.core.state.tp is not None:
                check_lockstep(self.core.state.tp, requests)
            self.core.wake()  # a pool released by hfpaged.sleep comes back with the first request
            for request in requests:
                self.core.add(request, self)
                self.prompts[request.request_id] = request

    def step(self) -> list[RequestOutput]:
        """Outputs of this client's requests: those already delivered, else the next step's."""
        core = self.core
        with core.lock:
            if not self.outbox:
                core.step_for_clients()
            outputs = list(self.outbox)
            self.outbox.clear()
        for output in outputs:
            if output.finished:
                root = self.prompts.get(output.prompt_id)
                if root is not None and is_prompt_finished(root):
                    del self.prompts[output.prompt_id]
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.prompts) or bool(self.outbox)

    def abort(self, prompt_id: str) -> None:
        """Stop a prompt of this client (all its sequences), free its blocks, drop its undelivered outputs."""
        if prompt_id not in self.prompts:
            return
        with self.core.lock, signals_held():  # (a Ctrl-C waits for the abort)
            if self.prompts.pop(prompt_id, None) is not None:
                self.core.abort(prompt_id)
                self.outbox = deque(output for output in self.outbox if output.prompt_id != prompt_id)

    def abort_all(self) -> None:
        with self.core.lock, signals_held():  # a second Ctrl-C waits for every abort, not only the one it met
            for prompt_id in list(self.prompts):
                self.abort(prompt_id)
            self.outbox.clear()


class Engine(Client):
    """Continuous batching over a patched model: ``add_request``, ``step``, ``abort``, ``has_unfinished``. Handles
    of one model share its engine: requests added through any of them run in the same batches, and ``step`` returns
    the outputs of this handle's requests (with overlapped steps, a step's tokens arrive with the next call)."""

    def __init__(self, model: PreTrainedModel, tokenizer: Any = None):
        super().__init__(engine_of(model))
        check_tokenizer(tokenizer)
        self.model = model
        self.tokenizer = tokenizer

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    def add_request(
        self,
        prompt: Any,
        generation_config: GenerationConfig | None = None,
        request_id: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Queue one prompt (string or token ids); ``kwargs`` are generate-style settings. Returns its id."""
        return self.add_requests([prompt], [kwargs], [request_id], generation_config=generation_config)[0]

    def add_requests(
        self,
        prompts: list[Any],
        settings: list[dict[str, Any]],
        request_ids: list[str | None] | None = None,
        *,
        generation_config: GenerationConfig | None = None,
        name_prompts: bool = True,
    ) -> list[str]:
        """Queue several prompts at once, each with its own generate-style settings (``settings[i]``), and return
        their ids: all or none (a bad prompt or setting raises and queues nothing); the weights are checked once.
        Errors name the prompt by its place in ``prompts`` unless ``name_prompts`` is False (the server's
        requests: not the client's list)."""
        with making_requests(self.core.state):  # tensor parallel: a rank's refusal is every rank's
            check_batch(prompts, settings, request_ids)
            self.core.prompts.warm_stop_strings(settings, generation_config, self.tokenizer)  # (slow: not under lock)
            self.core.check_weights(self.model)
            with self.core.lock:
                if self.core.closed:  # unpatched since the checks (unpatch closes the engine under this lock)
                    raise ModelUnpatched(UNPATCHED)
                requests, taken, make = [], set(), self.core.prompts.make_one
                ids = request_ids or [None] * len(prompts)
                chosen = {request_id for request_id in ids if isinstance(request_id, str)}
                for index, (prompt, kwargs, request_id) in enumerate(zip(prompts, settings, ids)):
                    check_request_id(request_id, lambda i: i in self.core.owners or i in taken)
                    if request_id is None:
                        request_id = self.core.prompts.new_id(chosen | taken)
                    taken.add(request_id)
                    kwargs = {key: value for key, value in kwargs.items() if key != "streamer"}
                    named = index if len(prompts) > 1 and name_prompts else None  # (add_request's: not named)
                    requests.append(make(prompt, generation_config, kwargs, self.tokenizer, request_id, named))
                self.submit(requests)
        return [request.request_id for request in requests]
