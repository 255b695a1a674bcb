"""What a patched model computes, fingerprinted cheaply at every call (``WeightsVersion``: parameters' storage and
in-place writes, buffers, PEFT adapter settings, forward hooks), and where its attention layers' weights live
(``placement``: the KV pool and kernels were set up for their dtype and device)."""

from __future__ import annotations

import itertools
import weakref

import torch
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as torch_optimizer
from torch.utils.weak import WeakTensorKeyDictionary

from .peft_compat import adapter_layers, adapter_state, inner_model


def _version(tensor: torch.Tensor) -> int:
    """A tensor's version counter; -1 for an inference tensor, which has none (a RoPE buffer re-registered by a
    forward under ``torch.inference_mode``, parameters of a model built or loaded under it, weights accelerate's
    offload hooks load per forward: storage still tells a new one apart; in-place writes to them are not seen)."""
    return -1 if tensor.is_inference() else tensor._version


# Fused optimizers (AdamW(fused=True), the Trainer's default on recent torch) write parameters without bumping their
# version counters: torch's global post-step hook marks each parameter an optimizer stepped with the step's number.
_STEPPED = WeakTensorKeyDictionary()
_STEP_NUMBERS = itertools.count(1)
_last_step = 0
_hook = None


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    global _last_step
    _last_step = step = next(_STEP_NUMBERS)
    for group in optimizer.param_groups:
        for param in group["params"]:
            _STEPPED[param] = step


def watch_optimizer_steps() -> None:
    """Register (once) the hook that marks parameters stepped by any ``torch.optim.Optimizer``."""
    global _hook
    if _hook is None:
        _hook = torch_optimizer.register_optimizer_step_post_hook(_after_optimizer_step)


class WeightsVersion:
    """A cheap fingerprint of what a model computes: where each parameter lives, how often it (and each buffer) was
    written in place, (PEFT models) which adapters its layers apply, and which forward hooks its modules (or all
    modules, torch's global hooks) run: a hook added or removed counts as new storage, as it changes what the
    graphs captured and the cached prefix blocks hold. A parameter an optimizer stepped counts as written in place
    (fused optimizers leave the version counter alone). Storage is told apart by address and by identity (a weak
    reference to each parameter's storage object): a tensor rebound through ``param.data = new`` counts as new
    storage even where the allocator hands it the old address. Writes *through* ``param.data`` bypass the
    version counter: after them call ``hfpaged.reset_prefix_cache`` (README, "Changed weights").

    The module tree is walked once; each check reads the parameters of the remembered modules directly and
    the identity of every module's children, so a replaced or added submodule still counts as new storage
    (and the tree is walked again). Parameters shared by several modules appear once per owner. The model
    itself is not remembered (it owns this object: no reference cycle), only its submodules.
    """

    def __init__(self, model: torch.nn.Module):
        watch_optimizer_steps()
        self.steps_seen = _last_step
        self.adapter_layers = adapter_layers(model)
        self.modules = list(model.modules())[1:]
        self.children = self._children(model)
        self.storage, self.versions, self.adapters = self.read(model)

    def _children(self, model: torch.nn.Module) -> tuple[int, ...]:
        return tuple(id(child) for module in (model, *self.modules) for child in module._modules.values())

    def _stepped(self, model: torch.nn.Module) -> bool:
        """Whether an optimizer stepped one of the model's parameters since the last check (read only after steps)."""
        seen, self.steps_seen = self.steps_seen, _last_step
        if seen == _last_step:
            return False
        modules = (model, *self.modules)
        return any(_STEPPED.get(p, 0) > seen for m in modules for p in m._parameters.values() if p is not None)

    def read(self, model: torch.nn.Module) -> tuple[tuple, tuple, tuple]:
        modules = (model, *self.modules)
        params = [p for module in modules for p in module._parameters.values() if p is not None]
        # buffers (RoPE's inv_freq, ...): a change counts as new values (cached prefix blocks dropped), not as new
        # storage - some RoPE variants re-register theirs in forward, and graphs must not be recaptured for that
        buffers = [b for module in modules for b in module._buffers.values() if b is not None]
        return (
            (tuple(p.data_ptr() for p in params), tuple(_storage_ref(p) for p in params), _hooks(modules)),
            tuple(_version(p) for p in params) + tuple((b.data_ptr(), _version(b)) for b in buffers),
            adapter_state(self.adapter_layers),
        )

    def check(self, model: torch.nn.Module) -> tuple[bool, bool]:
        """(changed at all, changed beyond values: new storage or other adapters) since the last check;
        remembers the new fingerprint. A PEFT wrapper is read through the inner model it was built from."""
        model = inner_model(model)
        children = self._children(model)
        tree_changed = children != self.children
        if tree_changed:  # a submodule was replaced or added: walk the tree again
            self.modules = list(model.modules())[1:]
            self.adapter_layers = adapter_layers(model)
            self.children = self._children(model)
        stepped = self._stepped(model)
        storage, versions, adapters = self.read(model)
        rewired = tree_changed or storage != self.storage or adapters != self.adapters
        changed = rewired or stepped or versions != self.versions
        self.storage, self.versions, self.adapters = storage, versions, adapters
        return changed, rewired

    def adapters_toggled(self) -> bool:
        """For every step (PEFT models): whether the adapter layers apply something other than at the last check.
        Adapter switches, ``disable_adapter()``, merges, scale contexts and per-layer toggles may be undone before the
        next call's check; steps run in between (an ``Engine`` handle stepped, a stream iterated under another
        adapter state) would publish prefix blocks of the other state. ~1 us per adapter layer on the CPUs here (the
        first layer alone missed toggles of later ones)."""
        return bool(self.adapter_layers) and adapter_state(self.adapter_layers) != self.adapters


def _storage_ref(param: torch.Tensor):
    """A weak reference to ``param``'s storage object (one per storage: torch keeps it while the storage lives), so
    a rebound storage at the old address compares unequal; None where a tensor subclass has no storage to read."""
    try:
        return weakref.ref(param.untyped_storage())
    except (RuntimeError, TypeError, NotImplementedError):
        return None


def has_forward_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has forward hooks or forward pre-hooks of its own."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _hooks(modules: tuple[torch.nn.Module, ...]) -> tuple:
    """The forward (pre-)hooks of ``modules`` and torch's global ones, by handle id (a new registration, a new id)."""
    local = tuple(
        (i, tuple(m._forward_pre_hooks), tuple(m._forward_hooks)) for i, m in enumerate(modules) if has_forward_hooks(m)
    )
    return local, tuple(nn_module._global_forward_pre_hooks), tuple(nn_module._global_forward_hooks)


def global_module_hooks() -> bool:
    """Whether torch's global module forward hooks are set (they run in every module: graphs then use eager layers)."""
    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def placement(layers) -> tuple:
    """(dtype, device) of each attention layer's first floating-point parameter (``LayerRecord.module``; None
    without one): what the KV pool and the attention kernels were set up for at ``patch``."""
    out = []
    for layer in layers:
        param = next((p for p in layer.module.parameters() if p.is_floating_point()), None)
        out.append(None if param is None else (param.dtype, param.device))
    return tuple(out)


def moved_message(was: tuple, now: tuple) -> str | None:
    """Why a model whose attention weights were at ``was`` (``placement``) at patch cannot run now at ``now``."""
    changed = sorted({(_where(a), _where(b)) for a, b in zip(was, now) if a != b})
    if not changed:
        return None
    old, new = changed[0]
    return (
        f"the model's attention weights moved after hfpaged.patch ({old} -> {new}, e.g. model.to(...)), "
        "but its KV pool and attention kernels were set up for the old placement: call hfpaged.patch(model) again "
        "(it patches anew for the new placement), or move the model back"
    )


def _where(place: tuple | None) -> str:
    return "no floating-point weights" if place is None else f"{place[0]} on {place[1]}"


def rewired_message(model: torch.nn.Module, state) -> str | None:
    """Why the model cannot run now that its tree or storage changed (``PatchState``), if it cannot."""
    moved = moved_message(state.placement, placement(state.layers))
    return moved or attention_tree_message(model, state.layers, state.attention_paths)


def _attention_modules(model: torch.nn.Module, layers) -> dict[int, tuple[torch.nn.Module, list[str]]]:
    """Each module of a paged layer's class in the tree (paged or not), by id: it and the tree paths reaching it."""
    kinds = tuple({type(layer.module) for layer in layers})
    found: dict[int, tuple[torch.nn.Module, list[str]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, kinds):
            found.setdefault(id(module), (module, []))[1].append(name)
    return found


def attention_paths(model: torch.nn.Module, layers) -> dict[int, tuple[weakref.ref, int]]:
    """``_attention_modules`` at ``patch``, kept as a weak reference (an id can be reused once its module is gone,
    e.g. a layer the forward never runs, deleted) and a count of tree paths."""
    return {
        key: (weakref.ref(module), len(names)) for key, (module, names) in _attention_modules(model, layers).items()
    }


def attention_tree_message(model: torch.nn.Module, layers, at_patch: dict[int, tuple[weakref.ref, int]]) -> str | None:
    """Why a model whose module tree changed after ``patch`` cannot run on its paged layers, if it cannot: a module of
    a paged layer's class that was not in the tree at ``patch`` (a layer added or replaced: it would attend outside
    the pool, or find no cache), or one reached by more tree paths than then (a layer reused: both calls would write
    one cache). ``at_patch``: ``attention_paths`` at ``patch``."""
    seen = _attention_modules(model, layers)
    then = {
        key: at_patch[key][1] for key, (module, _) in seen.items() if key in at_patch and at_patch[key][0]() is module
    }
    new = [f"{names[0]} ({type(module).__name__}) is not a layer patch paged" for key, (module, names) in seen.items()
           if key not in then]  # fmt: skip
    reused = [f"{' and '.join(names)} are one module" for key, (_, names) in seen.items()
              if key in then and len(names) > then[key]]  # fmt: skip
    if not new and not reused:
        return None
    return (
        f"the model's attention layers changed after hfpaged.patch ({(new + reused)[0]}: a layer added, replaced or "
        "reused), but its KV cache and attention were set up for the layers patch found: call hfpaged.patch(model) "
        "again (it patches anew for the model as it is now), or restore the model"
    )
