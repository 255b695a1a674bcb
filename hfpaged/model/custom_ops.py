"""torch.compile support: the Triton kernels as opaque custom ops, and the compiled forward of graph steps.

The CUDA graphs (decode steps by batch bucket, mixed prefill/decode steps by token bucket) capture a forward of
the unmodified model whose repeated blocks (the decoder layers) run ``torch.compile``-d code: inductor fuses their
norms, RoPE, activations and residual adds around our two custom ops. Step metadata reaches the attention
function as forward kwargs (transformers passes extra kwargs down to the attention interface), so one
dynamic-shape compile serves every bucket of both kinds.

Regional compilation (PyTorch's recipe for repeated blocks): the model's own forward runs eagerly, and only
while it runs does each decoder layer (and each other module beside the layer list, e.g. the final norm and
the rotary embedding) get an instance ``forward`` that calls one shared compiled function with the module as
an argument. Parameters are graph inputs (dynamo inlines nn modules), so the guards check the layer's class,
shapes and the constants it reads, not its identity: identical layers share ONE graph (Gemma2's sliding and
full layers compile one each), which cuts compile time by about the number of layers. Each region compiles
once per process for every bucket: sizes are dynamic with duck sizing off (``_distinct_size_symbols``), the
max_seqlen_q hint travels offset by ``MAX_SEQLEN_Q_OFFSET`` so that decode (1) and mixed (16+) steps share one
symbol, and the runner leaves out a batch-1 decode graph (a lone sequence pads into the 2-row graph), since
dynamo specialises sizes 0 and 1 and would trace the layers again for it (unless batch-1 projections run as GEMVs:
then that graph is traced for them). Float attributes are constants unless they differ between layers
(``_constant_floats``). The compiled functions keep no reference to the model; the instance forwards are removed
when the forward returns, so stock calls run exactly as unpatched. A model whose attention modules sit in no
``ModuleList`` falls back to compiling the whole forward.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.fx.experimental import _config as fx_config

from .weights_version import has_forward_hooks

_registered = False
_sizes_lock = threading.RLock()  # one compiled forward at a time sets and restores dynamo's duck sizing


def register_custom_ops() -> None:
    """Register ``hfpaged::paged_attention`` (it stores the step's K/V too), ``hfpaged::gemv`` and
    ``hfpaged::gemv_fused`` (once per process)."""
    global _registered
    if _registered:
        return
    from ..kernels import paged_attention

    @torch.library.custom_op("hfpaged::paged_attention", mutates_args=("k_cache", "v_cache"))
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
        launch_pdl: bool,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: torch.Tensor,
        sinks: torch.Tensor | None,
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
            launch_pdl=launch_pdl,
            key=key,
            value=value,
            slot_mapping=slot_mapping,
            sinks=sinks,
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
        launch_pdl,
        key,
        value,
        slot_mapping,
        sinks,
    ) -> torch.Tensor:
        return q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])

    from ..kernels import gemv

    @torch.library.custom_op("hfpaged::gemv", mutates_args=())
    def gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, launch_pdl: bool) -> torch.Tensor:
        return gemv.linear_few_rows(x, weight, bias, launch_pdl=launch_pdl)

    @gemv_op.register_fake
    def _gemv_fake(x, weight, bias, launch_pdl) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    # the GEMV with an RMSNorm of its input and/or a residual add of its output (gemv_fusion.py puts it in the
    # compiled layers); norm_eps: the 0-d CPU tensor dynamo made of a float, else norm_eps_value
    @torch.library.custom_op("hfpaged::gemv_fused", mutates_args=())
    def gemv_fused_op(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        launch_pdl: bool,
        norm_weight: torch.Tensor | None,
        norm_eps: torch.Tensor | None,
        norm_eps_value: float,
        residual: torch.Tensor | None,
    ) -> torch.Tensor:
        eps = norm_eps_value if norm_eps is None else float(norm_eps)
        return gemv.linear_few_rows(
            x, weight, bias, launch_pdl=launch_pdl, norm_weight=norm_weight, norm_eps=eps, residual=residual
        )

    @gemv_fused_op.register_fake
    def _gemv_fused_fake(x, weight, bias, launch_pdl, norm_weight, norm_eps, norm_eps_value, residual):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    _registered = True


def compiled_attention(module, query, key, value, scaling, sliding_window, softcap, sinks, kwargs) -> torch.Tensor:
    """The attention step of one layer when the metadata arrives as kwargs (compiled decode path)."""
    k_cache, v_cache = module._hfpaged_kv
    scales = module.__dict__.get("_hfpaged_kv_scale")  # fp8 caches: (whole, k_scale, v_scale); never calibrates
    k_scale, v_scale = (None, None) if scales is None else scales[1:]
    q, key, value = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    launch_pdl = kwargs["hfpaged_launch_pdl"]  # a Python bool: a constant of the compiled graph
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
        kwargs["hfpaged_max_seqlen_q"] - MAX_SEQLEN_Q_OFFSET,  # a size symbol under compile: no int() (a guard)
        int(kwargs["hfpaged_max_seqlen_k"]),
        k_scale,
        v_scale,
        launch_pdl,
        key,  # stored at the slots first (decode steps: by the attention kernel); prompt chunks then read them
        value,
        kwargs["hfpaged_slot_mapping"],
        sinks,  # the module's parameter (attention sinks) or None
    )
    return out.unsqueeze(0)


# Added to the max_seqlen_q hint on its way through the compiled layers and taken off in the attention: dynamo
# specialises the values 0 and 1, so a decode step's hint (1) would trace the layers apart from a mixed step's
# (16+); 1 + 16 and T + 16 are one dynamic symbol, and decode and mixed steps share each region's graph.
MAX_SEQLEN_Q_OFFSET = 16

# modules beside the layer list that gain nothing from compiling: one kernel each (or none)
_NOT_COMPILED = (torch.nn.Embedding, torch.nn.Linear, torch.nn.Dropout, torch.nn.Identity, torch.nn.ModuleList)


def _call_block(module: torch.nn.Module, *args, **kwargs):
    """A decoder layer's own forward (compiled once, shared by every layer of the model)."""
    return type(module).forward(module, *args, **kwargs)


def _call_other(module: torch.nn.Module, *args, **kwargs):
    """Another module's own forward (a code object of its own: its recompiles do not count against the layers')."""
    return type(module).forward(module, *args, **kwargs)


def compile_regions(model: torch.nn.Module) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """(decoder layers, other modules) to compile: the elements of the innermost ``ModuleList`` that holds each
    attention module, and the modules beside that list (norms, rotary embeddings; not embeddings or linears)."""
    lists: dict[str, torch.nn.ModuleList] = {}
    blocks: dict[int, torch.nn.Module] = {}
    parents: dict[int, torch.nn.Module] = {}
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if "_hfpaged_kv" not in module.__dict__:
            continue
        parts = name.split(".")
        for end in range(len(parts) - 1, 0, -1):  # the innermost ModuleList above the attention module
            parent = modules.get(".".join(parts[: end - 1]) if end > 1 else "")
            owner = modules.get(".".join(parts[:end]))
            if isinstance(owner, torch.nn.ModuleList) and end < len(parts):
                block = owner[int(parts[end])] if parts[end].isdigit() else None
                if block is not None:
                    blocks[id(block)] = block
                    lists[".".join(parts[:end])] = owner
                    if parent is not None:
                        parents[id(parent)] = parent
                break
    listed = {id(m) for m in lists.values()}
    others = [
        child
        for parent in parents.values()
        for child in parent.children()
        if id(child) not in listed and not isinstance(child, _NOT_COMPILED) and id(child) not in blocks
    ]
    # a region with forward hooks on a module inside runs eagerly: identical layers share one compiled graph, and
    # dynamo neither guards on submodule hooks nor tells layers apart by them (a hook on one layer's MLP was
    # dropped from the compiled graph, or would be applied to every layer); hooks on the region itself run
    # outside its compiled forward (Module.__call__)
    return [b for b in blocks.values() if not _inner_hooks(b)], [m for m in others if not _inner_hooks(m)]


def _inner_hooks(region: torch.nn.Module) -> bool:
    return any(has_forward_hooks(m) for m in region.modules() if m is not region)


def _mark_caches_static(model: torch.nn.Module) -> None:
    """The KV caches' shapes are fixed: static dims keep dynamo from tying a batch size to one of them by chance
    (duck sizing: 3 requests + 1 = block size 4 made a guard that the next batch size failed)."""
    for module in model.modules():
        for tensor in module.__dict__.get("_hfpaged_kv", ()):
            torch._dynamo.mark_static(tensor)
        scales = module.__dict__.get("_hfpaged_kv_scale")
        for tensor in scales or ():
            torch._dynamo.mark_static(tensor)


@contextmanager
def _distinct_size_symbols() -> Iterator[None]:
    """Dynamo gives each dynamic size its own symbol while the compiled forward runs (no duck sizing). Duck sizing
    gives sizes that happen to be equal one symbol and guards the equality: at the largest decode bucket (the first
    the CUDA graphs capture) the batch equals the rows of the static block-table buffer the step's tables view, so
    each region's first graph fit that bucket alone and recompiled at the next. Without it only the equalities the
    code needs are guarded (each layer's tokens equal the rotary tables' rows), and one graph serves every batch
    size from 2 up. Batch 1 keeps its own: dynamo specialises sizes 0 and 1, and even traced size-obliviously
    (torch's experimental ``backed_size_oblivious``) the layer's graph guards ``tokens != 1`` (notes/engine_perf.md,
    session 7)."""
    if getattr(fx_config, "use_duck_shape", None) is None:  # an older torch without the switch
        with _sizes_lock:
            yield
        return
    with _sizes_lock, fx_config.patch(use_duck_shape=False):
        yield


def _constant_floats(blocks: list[torch.nn.Module]):
    """Dynamo takes the float attributes a layer reads (the attention's scaling, the norms' eps, LoRA's scaling) as
    constants, guarded by value, unless they differ between layers of one class. Left symbolic (torch's default),
    the attention's scaling reaches the custom op as a float that dynamo cannot turn into a tensor, and the layer's
    whole trace restarts with it specialised: ~2 s of every start spent on a trace thrown away (H200, session 38:
    2.0 of a 12.4 s warm start). As constants, layers whose floats differ (an RMSNorm eps per layer, PEFT's
    ``alpha_pattern``) would each compile a graph of their own, and past dynamo's recompile limit (8) run uncompiled:
    those models keep symbolic floats, one shared graph and the restart. (Floats that dynamo makes constants anyway,
    e.g. ``nn.LayerNorm``'s eps, compile a graph per distinct value either way; floats held in other objects than
    modules and dicts are not compared.)"""
    if not hasattr(torch._dynamo.config, "specialize_float") or _floats_differ(blocks):
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(specialize_float=True)


def _floats_differ(blocks: list[torch.nn.Module]) -> bool:
    """Whether two layers of one class hold different float attributes (on any of their modules, or as values of a
    dict attribute, as PEFT keeps its scaling per adapter)."""
    seen: dict[type, tuple] = {}
    for block in blocks:
        floats = []
        for name, module in block.named_modules():
            for key, value in vars(module).items():
                if type(value) is float:
                    floats.append((name, key, repr(value)))
                elif type(value) is dict:
                    floats += [(name, key, k, repr(v)) for k, v in value.items() if type(v) is float]
        if seen.setdefault(type(block), tuple(floats)) != tuple(floats):
            return True
    return False


@contextmanager
def _compiled_forwards(regions: list[tuple[torch.nn.Module, Callable]]) -> Iterator[None]:
    """Give each module an instance ``forward`` calling its compiled function, for one forward; a module that
    already has an instance ``forward`` (accelerate's hooks set one) keeps it and runs eagerly."""
    installed = []
    for module, compiled in regions:
        if "forward" in module.__dict__:
            continue
        module.__dict__["forward"] = functools.partial(compiled, module)
        installed.append(module)
    try:
        yield
    finally:
        for module in installed:
            module.__dict__.pop("forward", None)


def _own_code(function: Callable) -> Callable:
    """A copy of ``function`` whose code object is its own (equal to the original, not the same object)."""
    copy = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    copy.__qualname__, copy.__doc__ = function.__qualname__, function.__doc__
    return copy


def inductor_options(launch_pdl: bool) -> dict:
    """Inductor settings of the compiled layers, where torch has them: combo kernels (kernels of a layer that do not
    depend on each other launch as one, e.g. the RoPE of q and of k: H100, session 20, Qwen3-0.6B batch-1 decode
    1.022 -> 0.987 ms/token, batch 256 +3-6%, Llama-3.2-1B -1.4% / flat, the same greedy tokens); with ``launch_pdl``
    its kernels use programmatic dependent launch too (each waits for the kernel before it only where it reads what
    that kernel wrote)."""
    from .gemv_fusion import inductor_pass

    options = {"combo_kernels": True} if hasattr(torch._inductor.config, "combo_kernels") else {}
    options.update(inductor_pass())  # one-row projections take their norms and residual adds
    if launch_pdl and hasattr(torch._inductor.config.triton, "enable_pdl"):
        options["triton.enable_pdl"] = True
    return options


class CompiledStepForward:
    """``(model, input_ids, position_ids, slots, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q=,
    logits_indices=) -> logits`` of a step in a CUDA graph (decode: ``max_seqlen_q`` 1, every row sampled; mixed:
    ``max_seqlen_q`` the token bucket, the ``logits_indices`` rows sampled), its repeated blocks compiled
    (``regional``, the default) or the whole forward compiled."""

    def __init__(self, max_seqlen_k: int, regional: bool = True, launch_pdl: bool = False):
        register_custom_ops()
        self.max_seqlen_k = max_seqlen_k
        self.launch_pdl = launch_pdl  # the Triton kernels' programmatic dependent launch (dependent_launch.py)
        self.regional = regional
        options = inductor_options(launch_pdl)
        # dynamo keeps compiled graphs, and counts recompiles against its limit (8), per code object: each
        # compiled forward compiles copies with code of their own, so models and re-patches in one process never
        # exhaust each other's count (past it dynamo runs the layers uncompiled, without an error)
        self.block_function = _own_code(_call_block)
        self.other_function = _own_code(_call_other)
        self.block_forward = torch.compile(self.block_function, dynamic=True, options=options)
        self.other_forward = torch.compile(self.other_function, dynamic=True, options=options)
        self.whole_forward = torch.compile(
            types.MethodType(_own_code(CompiledStepForward._forward), self), dynamic=True, options=options
        )

    @torch.no_grad()
    def _forward(
        self, model, input_ids, position_ids, slot_mapping, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, keep
    ):
        output = type(model).forward(
            model,
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=keep,
            hfpaged_slot_mapping=slot_mapping,
            hfpaged_block_tables=block_tables,
            hfpaged_seq_lens=seq_lens,
            hfpaged_cu_seqlens_q=cu_seqlens_q,
            hfpaged_max_seqlen_q=max_seqlen_q + MAX_SEQLEN_Q_OFFSET,
            hfpaged_max_seqlen_k=self.max_seqlen_k,
            hfpaged_launch_pdl=self.launch_pdl,
        )
        return output.logits[0]

    def __call__(
        self, model, *step_tensors, max_seqlen_q: int = 1, logits_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        _mark_caches_static(model)
        keep = 0 if logits_indices is None else logits_indices  # 0: every row
        blocks, others = compile_regions(model) if self.regional else ([], [])
        if not blocks:
            with _distinct_size_symbols(), _constant_floats([]):
                return self.whole_forward(model, *step_tensors, max_seqlen_q, keep)
        regions = [(m, self.block_forward) for m in blocks] + [(m, self.other_forward) for m in others]
        with _distinct_size_symbols(), _constant_floats(blocks), _compiled_forwards(regions):
            return self._forward(model, *step_tensors, max_seqlen_q, keep)


def compile_step_forward(max_seqlen_k: int, regional: bool = True, launch_pdl: bool = False) -> CompiledStepForward:
    """The compiled step forward of the CUDA graphs (compiles lazily, at its first call)."""
    return CompiledStepForward(max_seqlen_k, regional, launch_pdl)
