"""q/k/v and gate/up as one GEMM each in the paged forward, without a second copy of the weights.

At ``patch`` time each group of plain ``torch.nn.Linear`` projections that read the same input (an attention's
``q_proj``/``k_proj``/``v_proj``, an MLP's ``gate_proj``/``up_proj``) moves into one contiguous
``[sum_out, in]`` buffer, one group at a time: each member's ``weight`` (and ``bias``) stays the same
``Parameter`` object (optimizers keep working) but its ``.data`` becomes a row slice of the buffer, and the
old storage is freed. Stock calls compute exactly as before: the same values, one GEMM per module.

Only inside a paged step (``FusedProjections.step``) does each member get an instance ``forward``: the first
member called computes ``F.linear(x, buffer)`` once and stashes the split output with ``x``; the others return
their slice when called with that same tensor object (``is``), else compute alone. The forwards are removed
when the step ends, so outside it nothing differs from stock, and dynamo traces the stash as plain Python
state (one ``linear`` + ``split`` per group under ``compile=True``). Each forward is a bound method of one
shared function that finds its group through a member attribute set for the step: dynamo guards a patched
``forward`` by its function (a per-member object would be guarded by its id, one graph per layer). Before
each step every group checks it is still intact (same modules, each weight still its slice of the buffer);
one that is not (a new ``Parameter``, ``.data`` swapped, a module replaced, a PEFT layer wrapped around it,
``model.to``) is dropped for good and its modules run alone. ``unfuse`` (at ``unpatch``) gives every member its
own storage again.

One-row steps (``EngineConfig.gemv``, ``enable_gemv``): the groups' GEMMs and every other plain ``Linear`` of the
model, its output embedding too ("single" projections, which get a step forward the same way, weights left where
they are) run ``kernels/gemv.py``'s GEMV when their input is one row, through the ``hfpaged::gemv`` custom op.
"""

from __future__ import annotations

import logging
import threading
import types
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .tp_local import COL, LocalProjections, local
from .weights_version import has_forward_hooks

logger = logging.getLogger("hfpaged")

GROUP_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _plain_linear(module: torch.nn.Module | None) -> bool:
    """A stock Linear with stock parameters (not a PEFT layer, bitsandbytes, DTensor, quantized) and no instance
    ``forward`` (accelerate's hooks set one)."""
    if type(module) is not torch.nn.Linear or "forward" in module.__dict__:
        return False
    params = [module.weight] if module.bias is None else [module.weight, module.bias]
    return all(type(p) is torch.nn.Parameter and p.is_floating_point() and p.device.type != "meta" for p in params)


def _sharded_linear(module: torch.nn.Module | None, tp: LocalProjections | None) -> bool:
    """A colwise-sharded Linear whose step forward runs on its local shards (``tp_local``), plain local tensors."""
    if tp is None or tp.kind(module) != COL:
        return False
    params = [local(module.weight)] + ([] if module.bias is None else [local(module.bias)])
    return all(type(p) is torch.Tensor and p.is_floating_point() and p.device.type != "meta" for p in params)


def _params(members: list[torch.nn.Linear]) -> list[torch.Tensor]:
    """The tensors a group re-points: the members' weights and biases (a sharded member's local shards)."""
    return [local(p) for m in members for p in (m.weight, m.bias) if p is not None]


def _can_fuse(members: list[torch.nn.Linear], tp: LocalProjections | None = None) -> bool:
    sharded = [_sharded_linear(m, tp) for m in members]
    if any(sharded) and not all(sharded):
        return False
    if not all(sharded) and not all(_plain_linear(m) for m in members):
        return False
    if len({id(p) for p in _params(members)}) != len(_params(members)):
        return False
    if any(has_forward_hooks(m) for m in members):  # e.g. offload hooks
        return False
    first = _params(members)[0]
    if any((m.bias is None) != (members[0].bias is None) for m in members):
        return False
    if any(
        p.dtype != first.dtype or p.device != first.device or not p.is_contiguous() for p in _params(members)
    ) or any(m.in_features != members[0].in_features for m in members):
        return False
    # the members' storages must hold nothing else, or re-pointing them would not free memory (and would
    # part them from whatever else shares that storage). A sharded member's local shard may be a slice of a
    # larger loaded tensor that nothing else reads: distinct storages suffice there (re-pointing frees them).
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in _params(members)}
    if all(sharded):
        return len(storages) == len(_params(members))
    return sum(storages.values()) == sum(p.numel() * p.element_size() for p in _params(members))


class FusedGroup:
    """Projections of one module that read the same input, their weights slices of one buffer."""

    def __init__(self, parent: torch.nn.Module, names: tuple[str, ...], tp: LocalProjections | None = None):
        self.parent = parent
        self.names = names
        self.members = [parent._modules[name] for name in names]
        self.tp = tp if _sharded_linear(self.members[0], tp) else None  # colwise shards: local tensors re-pointed
        self.sizes = [local(m.weight).shape[0] for m in self.members]
        with torch.inference_mode(False), torch.no_grad():  # never an inference tensor: training reads it
            self.weight = torch.cat([local(m.weight) for m in self.members])
            self.bias = None if self.members[0].bias is None else torch.cat([local(m.bias) for m in self.members])
            for member, weight, bias in zip(self.members, *self._slices()):
                local(member.weight).data = weight  # same Parameter (and local shard) object; old storage freed
                if bias is not None:
                    local(member.bias).data = bias
        # bound methods of one function: dynamo guards a patched forward by that function, so every layer's members
        # trace to one graph (a functools.partial per member was guarded by its id: a graph per layer, until
        # dynamo's recompile limit left the remaining layers uncompiled)
        self.forwards = [types.MethodType(_fused_forward, member) for member in self.members]
        self.gemv: bool | None = None  # one-row inputs by the GEMV (its launch_pdl); None: F.linear always
        self.thread: int | None = None  # the thread running the paged step (other threads never use the stash)
        self.input: torch.Tensor | None = None  # per step: the input of the stashed output
        self.parts: tuple[torch.Tensor, ...] = ()
        self.num_left = 0

    def _slices(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        weights = list(self.weight.split(self.sizes))
        biases = list(self.bias.split(self.sizes)) if self.bias is not None else [None] * len(self.sizes)
        return weights, biases

    def intact(self) -> bool:
        """Every member is still the parent's stock Linear reading its slice of the buffer."""
        for name, member, weight, bias in zip(self.names, self.members, *self._slices()):
            if self.parent._modules.get(name) is not member:
                return False
            if not (_sharded_linear(member, self.tp) if self.tp is not None else _plain_linear(member)):
                return False
            for param, part in ((local(member.weight), weight), (local(member.bias), bias)):
                if (param is None) != (part is None):
                    return False
                if param is not None and (param.data_ptr() != part.data_ptr() or param.shape != part.shape):
                    return False
        return True

    def clear(self) -> None:
        self.input, self.parts, self.num_left = None, (), 0

    def views(self) -> list[torch.Tensor]:
        """The members' parameters that are still slices of the buffer."""
        if self.weight is None:
            return []
        ranges = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in (self.weight, self.bias) if t is not None]
        params = [p for p in _params(self.members) if p.device == self.weight.device]
        return [p for p in params if any(start <= p.data_ptr() < end for start, end in ranges)]

    def unfuse(self) -> None:
        """Each member's parameters in their own storage again (those still slices of the buffer)."""
        with torch.inference_mode(False), torch.no_grad():
            for param in self.views():
                param.data = param.data.clone()
        self.weight = self.bias = None


def _fused_forward(member: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A member's forward inside a paged step: one GEMM for the whole group, each member takes its slice."""
    fused = getattr(member, "_hfpaged_fused", None)  # (group, index) while the step runs
    if fused is None or (not torch.compiler.is_compiling() and threading.get_ident() != fused[0].thread):
        # a direct call from another thread during the step (not behind the forward lock), or one that met the
        # forward as the step ended: compute alone (the member's weight is its slice of the buffer; a colwise
        # shard's output is this rank's features, as transformers' forward gives them)
        return F.linear(x, local(member.weight), local(member.bias))
    group, index = fused
    if group.input is not x:
        group.input = x
        group.parts = project(x, group.weight, group.bias, group.gemv).split(group.sizes, dim=-1)
        group.num_left = len(group.sizes)
    part = group.parts[index]
    group.num_left -= 1
    if group.num_left == 0:  # every member took its slice: the stash need not keep them alive
        group.clear()
    return part


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemv: bool | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; a one-row ``x`` by the GEMV custom op where ``gemv`` is not None (its value:
    launch_pdl)."""
    if gemv is None or x.numel() != x.shape[-1]:
        return F.linear(x, weight, bias)
    return torch.ops.hfpaged.gemv(x, weight, bias, gemv)


def _single_forward(member: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A single projection's forward inside a paged step: ``project`` with the engine's GEMV setting."""
    single = getattr(member, "_hfpaged_single", None)  # (thread, launch_pdl) while the step runs
    if single is None or (not torch.compiler.is_compiling() and threading.get_ident() != single[0]):
        return F.linear(x, member.weight, member.bias)  # another thread's direct call: stock
    return project(x, member.weight, member.bias, single[1])


class FusedProjections:
    """The fused groups of one model, and (with the GEMV on) its single projections."""

    def __init__(self, groups: list[FusedGroup]):
        self.groups = groups
        self.broken: list[FusedGroup] = []  # no longer intact: never fused again
        # (weakref to the parent, name, module), GEMV only: the output embedding's parent is the model, which holds
        # these (a strong reference would make a cycle, and a model deleted unpatched would not be freed)
        self.singles: list[tuple[weakref.ref, str, torch.nn.Linear]] = []
        self.gemv: bool | None = None  # one-row projections by the GEMV (its launch_pdl); None: off

    def enable_gemv(self, model: torch.nn.Module, launch_pdl: bool) -> int:
        """One-row inputs of the groups and of every other plain ``Linear`` (the output embedding too) by the GEMV
        (``kernels/gemv.py``) in paged steps; returns how many projections take it."""
        from ..kernels.gemv import gemv_supports
        from .custom_ops import register_custom_ops

        register_custom_ops()
        for group in self.groups:
            group.gemv = launch_pdl if gemv_supports(group.weight, group.bias) else None
        grouped = {id(m) for group in self.groups for m in group.members}
        self.singles = [
            (weakref.ref(parent), name, module)
            for parent in model.modules()
            for name, module in parent._modules.items()
            if id(module) not in grouped and _single_ok(module)
        ]
        self.gemv = launch_pdl if self.num_gemv else None  # e.g. float32 weights: nothing takes it
        return self.num_gemv

    def warm_up_gemv(self) -> None:
        """Compile the GEMV's variants (one per distinct weight shape) before any CUDA graph capture."""
        from ..kernels.gemv import linear_few_rows

        if self.gemv is None:
            return
        seen = set()
        params = [(m.weight, m.bias) for _, _, m in self.singles]
        params += [(g.weight, g.bias) for g in self.groups if g.gemv is not None]
        for weight, bias in params:
            key = (tuple(weight.shape), weight.stride(0), weight.dtype, weight.device, bias is None)
            if key not in seen:
                seen.add(key)
                linear_few_rows(weight.new_zeros(1, weight.shape[1]), weight, bias, launch_pdl=self.gemv)

    @property
    def num_gemv(self) -> int:
        """Projections whose one-row inputs take the GEMV."""
        return len(self.singles) + sum(group.gemv is not None for group in self.groups)

    @contextmanager
    def step(self) -> Iterator[None]:
        """Give the members of every intact group their fused forward for one paged forward."""
        broken = [group for group in self.groups if not group.intact()]
        if broken:
            logger.info("hfpaged: %d fused projection groups changed; their modules run unfused", len(broken))
            self.groups = [group for group in self.groups if group not in broken]
            # members still viewing a buffer get their own storage at unfuse; the others' buffers are freed now
            self.broken += [group for group in broken if group.views()]
        saved = {}  # a sharded member's forward before the step (tp_local's step forward): put back after
        singles = [s for s in self.singles if _parent_holds(*s) and _single_ok(s[2])]
        if len(singles) != len(self.singles):
            logger.info("hfpaged: %d single projections changed; they run stock", len(self.singles) - len(singles))
            self.singles = singles
        thread = threading.get_ident()
        for _, _, module in singles:
            module.__dict__["_hfpaged_single"] = (thread, self.gemv)
            module.__dict__["forward"] = types.MethodType(_single_forward, module)
        for group in self.groups:
            group.thread = thread
            for index, (member, forward) in enumerate(zip(group.members, group.forwards)):
                if "forward" in member.__dict__:
                    saved[member] = member.__dict__["forward"]
                member.__dict__["_hfpaged_fused"] = (group, index)
                member.__dict__["forward"] = forward
        try:
            yield
        finally:
            for _, _, module in singles:
                module.__dict__.pop("forward", None)
                module.__dict__.pop("_hfpaged_single", None)
            for group in self.groups:
                group.clear()
                group.thread = None
                for member in group.members:
                    member.__dict__.pop("forward", None)
                    member.__dict__.pop("_hfpaged_fused", None)
                    if member in saved:
                        member.__dict__["forward"] = saved[member]

    def unfuse(self) -> None:
        """Every member's parameters in their own storage again, one group at a time."""
        for group in self.groups + self.broken:
            group.unfuse()
        self.groups, self.broken, self.singles, self.gemv = [], [], [], None


def _parent_holds(parent: weakref.ref, name: str, module: torch.nn.Module) -> bool:
    """Whether the (still living) parent's child ``name`` is still ``module``."""
    owner = parent()
    return owner is not None and owner._modules.get(name) is module


def _single_ok(module: torch.nn.Module) -> bool:
    """A plain Linear without hooks whose weight (and bias) the GEMV takes."""
    from ..kernels.gemv import gemv_supports

    if not _plain_linear(module) or has_forward_hooks(module):
        return False
    return gemv_supports(module.weight, module.bias)


def fuse_projections(
    model: torch.nn.Module, setting: bool | None, tp: LocalProjections | None = None
) -> FusedProjections:
    """Fuse every eligible group of ``model``: all (``True``), none (``False``), those on CUDA (``None``).
    ``tp``: a sharded model's local projections (its colwise groups fuse over their local shards)."""
    groups = []
    for module in model.modules() if setting is not False else ():
        for names in GROUP_NAMES:
            members = [module._modules.get(name) for name in names]
            if not all(isinstance(m, torch.nn.Module) for m in members) or not _can_fuse(members, tp):
                continue
            if setting is None and local(members[0].weight).device.type != "cuda":
                continue
            groups.append(FusedGroup(module, names, tp))
    if groups:
        logger.info("hfpaged: %d projection groups fused", len(groups))
    return FusedProjections(groups)


@contextmanager
def fused_step(fused: FusedProjections | None) -> Iterator[None]:
    """``fused.step()``, or nothing when the model has no fused projections."""
    if fused is None or not (fused.groups or fused.singles):
        yield
        return
    with fused.step():
        yield
