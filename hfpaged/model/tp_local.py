"""Tensor-parallel projections on local shards inside the paged step, and a one-shot all-reduce for small messages.

transformers' tensor parallelism (``tp_plan="auto"``) gives each sharded ``Linear`` an instance ``forward`` that
wraps the stock one: colwise layers (q/k/v, gate/up) turn DTensor parameters into local ones for the call and
return this rank's output features; rowwise layers (o_proj, down_proj) compute a partial sum and run
``dist.all_reduce`` on it (NCCL). Under CUDA graphs that host work costs nothing, but two things remain:

- NCCL's all-reduce of a few KB (a decode step's hidden states) takes 18-20 us in a CUDA graph on two
  NVLink-connected H200s (7.5 us inside a decode step), and a Llama layer has two of them.
  ``torch.distributed._symmetric_memory``'s one-shot all-reduce (every rank copies its part into a buffer its peers
  can read, then each rank sums all parts; no multicast) is one small kernel: 6.7 us (7.0 us inside a step). It is
  used for messages up to ``SYMM_BYTES``, from ``TWO_SHOT_BYTES`` (batches of 64+ rows at hidden 4,096) as the two-shot
  variant (each rank sums 1/N of the message, then gathers the other sums); larger ones (prefill chunks) go to NCCL.
  All run inside CUDA graphs.
  (Measured in session 8: ``notes/tensor_parallel.md``.)
- The sharded projections are DTensor parameters, so ``fuse_projections`` could not fuse them. Here every
  colwise/rowwise ``Linear`` that transformers sharded the standard way gets, for the paged step only, a forward
  over its local tensors (the DTensor's own ``_local_tensor``, no copy); fusion then treats the colwise groups
  like plain ones (see ``fused_projections``), which re-points the local tensors into one buffer per group.

Outside the paged step the transformers forwards are back in place: stock ``generate`` and training run exactly
as they did. A module whose style or placements differ from the standard ones (a custom plan, a quantized
layer, an embedding, the lm head's gathered output) keeps the transformers forward inside the step too.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

logger = logging.getLogger("hfpaged")

COL, ROW = "colwise", "rowwise"
SYMM_BYTES = 8 << 20  # the largest message the symmetric-memory all-reduce takes (a 1,024-token step at hidden 4,096)
TWO_SHOT_BYTES = 512 << 10  # from this size the two-shot all-reduce (measured on two H200s: 1 MiB 11.6 vs 14.8 us)
_reducers: dict[int, AllReduce] = {}
_keys = itertools.count()
_op_lock = threading.Lock()
_op_registered = False


def local(param: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local shard (the tensor itself, not a copy); a plain tensor as is."""
    return getattr(param, "_local_tensor", param) if param is not None else None


def _style(module: torch.nn.Module):
    """The transformers tensor-parallel style object behind ``module``'s instance forward, or None."""
    forward = module.__dict__.get("forward")
    for cell in getattr(forward, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if type(value).__name__ in ("ColwiseParallel", "RowwiseParallel") and "transformers" in type(value).__module__:
            return value
    return None


def _placement(param: torch.Tensor | None):
    placements = getattr(param, "placements", None)
    return placements[0] if placements is not None and len(placements) == 1 else None


def local_kind(module: torch.nn.Module) -> str | None:
    """``COL`` or ``ROW`` for a ``Linear`` sharded the standard way by transformers, else None."""
    if type(module) is not torch.nn.Linear:
        return None
    style = _style(module)
    if style is None or not getattr(style, "use_local_output", False):
        return None
    from torch.distributed.tensor import Replicate, Shard

    weight, bias = _placement(module.weight), _placement(module.bias) if module.bias is not None else None
    if type(local(module.weight)) is not torch.Tensor:  # e.g. a quantized local tensor
        return None
    inputs, outputs = getattr(style, "input_layouts", None), getattr(style, "output_layouts", None)
    if type(style).__name__ == "ColwiseParallel":
        standard = inputs == Replicate() and outputs == Shard(-1) and weight == Shard(0)
        return COL if standard and (module.bias is None or bias == Shard(0)) else None
    standard = inputs == Shard(-1) and outputs == Replicate() and weight == Shard(1)
    return ROW if standard and (module.bias is None or bias == Replicate()) else None


def allreduce_mode() -> str:
    """``HFPAGED_TP_ALLREDUCE``: "auto" (one-shot for small CUDA messages; the default) or "nccl" (the process group's
    all-reduce for every size, a diagnostic switch)."""
    mode = os.environ.get("HFPAGED_TP_ALLREDUCE", "auto")
    if mode not in ("auto", "nccl"):
        raise ValueError(f"HFPAGED_TP_ALLREDUCE must be 'auto' or 'nccl', got {mode!r}")
    return mode


class AllReduce:
    """Sum over the tensor-parallel group: symmetric-memory one-shot for small CUDA messages, else the process
    group's own all-reduce (NCCL; gloo on the CPU)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.group = group
        self.key = next(_keys)
        # two uint8 [SYMM_BYTES] buffers, symmetric over the group, used in turn: a rank that is one all-reduce
        # ahead never writes the buffer its peer may still be reading (a sync between all-reduces two apart is
        # implied: starting one needs every peer to have started the one before)
        self.buffers: list[torch.Tensor] = []
        self.turn = 0
        self.group_name = group.group_name
        self.world_size = dist.get_world_size(group)
        # messages of TWO_SHOT_BYTES+: reduce-scatter then all-gather through the symmetric buffer (each rank reads
        # 1/N of every peer's part instead of all of it); torch builds without it keep the one-shot
        self.two_shot = hasattr(torch.ops.symm_mem, "two_shot_all_reduce_out")
        if device.type == "cuda" and allreduce_mode() == "auto" and dist.get_backend(group) == "nccl":
            self.buffers = self._symmetric_buffers(device)
        _reducers[self.key] = self

    def _symmetric_buffers(self, device: torch.device) -> list[torch.Tensor]:
        # collective over the group (every rank patches in lockstep); any failure leaves NCCL for everything
        try:
            import torch.distributed._symmetric_memory as symm_mem

            if hasattr(symm_mem, "enable_symm_mem_for_group") and not symm_mem.is_symm_mem_enabled_for_group(
                self.group_name
            ):
                symm_mem.enable_symm_mem_for_group(self.group_name)
            buffers = [symm_mem.empty(SYMM_BYTES, dtype=torch.uint8, device=device) for _ in range(2)]
            for buffer in buffers:
                symm_mem.rendezvous(buffer, self.group_name)
            return buffers
        except Exception as error:  # no P2P between the GPUs, a torch without symmetric memory
            logger.info("hfpaged: symmetric-memory all-reduce unavailable (%s); NCCL for every size", error)
            return []

    @property
    def kind(self) -> str:
        if not self.buffers:
            return "process group"
        two_shot = f", two-shot from {TWO_SHOT_BYTES >> 10} KiB" if self.two_shot else ""
        return f"one-shot (symmetric memory){two_shot} up to {SYMM_BYTES >> 20} MiB, then NCCL"

    def path(self, x: torch.Tensor) -> str:
        """Which all-reduce ``x`` takes: "one_shot", "two_shot" or "process_group"."""
        nbytes = x.numel() * x.element_size()
        if not (self.buffers and x.is_cuda and nbytes <= SYMM_BYTES and SYMM_BYTES % x.element_size() == 0):
            return "process_group"
        # two-shot splits the message into one 16-byte aligned part per rank
        return (
            "two_shot"
            if self.two_shot and nbytes >= TWO_SHOT_BYTES and nbytes % (16 * self.world_size) == 0
            else "one_shot"
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        path = self.path(x)
        if path != "process_group":
            out = torch.empty_like(x)
            self.turn ^= 1
            staging = self.buffers[self.turn].view(x.dtype)[: x.numel()]
            if path == "two_shot":
                staging.copy_(x.view(-1))
                torch.ops.symm_mem.two_shot_all_reduce_out(staging, "sum", self.group_name, out.view(-1))
            else:
                torch.ops.symm_mem.one_shot_all_reduce_copy_out(
                    staging, x.view(-1), "sum", self.group_name, out.view(-1)
                )
            return out
        out = x.clone()
        dist.all_reduce(out, group=self.group)
        return out

    def close(self) -> None:
        _reducers.pop(self.key, None)
        self.buffers = []


def _register_op() -> None:
    """``hfpaged::tp_all_reduce`` (once per process): opaque to torch.compile, a new tensor out."""
    global _op_registered
    with _op_lock:
        if _op_registered:
            return

        @torch.library.custom_op("hfpaged::tp_all_reduce", mutates_args=())
        def tp_all_reduce(x: torch.Tensor, key: int) -> torch.Tensor:
            return _reducers[key](x)

        @tp_all_reduce.register_fake
        def _fake(x, key):
            return torch.empty_like(x)

        _op_registered = True


@dataclass
class _Shard:
    """What a member's step forward reads: its local tensors (fresh each step) and the all-reduce."""

    layer: LocalProjections
    kind: str
    weight: torch.Tensor
    bias: torch.Tensor | None


def _local_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    shard = module.__dict__.get("_hfpaged_tp")
    if shard is None or (not torch.compiler.is_compiling() and threading.get_ident() != shard.layer.thread):
        # a call from another thread during the step, or one that met the forward as the step ended
        return module._hfpaged_tp_stock(x)  # transformers' own tensor-parallel forward
    if shard.kind == COL:
        return F.linear(x, shard.weight, shard.bias)
    y = torch.ops.hfpaged.tp_all_reduce(F.linear(x, shard.weight), shard.layer.reduce.key)
    return y if shard.bias is None else y + shard.bias


class LocalProjections:
    """The standard-sharded ``Linear`` modules of one model and their step forwards."""

    def __init__(self, members: dict[torch.nn.Linear, str], reduce: AllReduce):
        self.members = members  # module -> COL / ROW
        self.reduce = reduce
        self.thread: int | None = None
        for module in members:
            module.__dict__["_hfpaged_tp_stock"] = module.__dict__["forward"]
            module.__dict__["_hfpaged_tp_local"] = types.MethodType(_local_forward, module)

    def kind(self, module: torch.nn.Module) -> str | None:
        return self.members.get(module)

    @contextmanager
    def step(self) -> Iterator[None]:
        """Give every member its local forward for one paged forward; transformers' forwards come back after."""
        self.thread = threading.get_ident()
        for module, kind in self.members.items():
            module.__dict__["_hfpaged_tp"] = _Shard(self, kind, local(module.weight), local(module.bias))
            module.__dict__["forward"] = module.__dict__["_hfpaged_tp_local"]
        try:
            yield
        finally:
            self.thread = None
            for module in self.members:
                module.__dict__["forward"] = module.__dict__["_hfpaged_tp_stock"]
                module.__dict__.pop("_hfpaged_tp", None)

    def close(self) -> None:
        """Back to transformers' forwards for good (unpatch)."""
        for module in self.members:
            module.__dict__["forward"] = module.__dict__.pop("_hfpaged_tp_stock")
            module.__dict__.pop("_hfpaged_tp_local", None)
            module.__dict__.pop("_hfpaged_tp", None)
        self.members = {}
        self.reduce.close()


def local_projections(model: torch.nn.Module, group: dist.ProcessGroup, device: torch.device) -> LocalProjections:
    """The model's standard-sharded projections (collective: the one-shot all-reduce's buffer is symmetric)."""
    _register_op()
    members = {m: kind for m in model.modules() if (kind := local_kind(m)) is not None}
    reduce = AllReduce(group, device)
    logger.info(
        "hfpaged: %d tensor-parallel projections run on local shards in the paged step; all-reduce: %s",
        len(members),
        reduce.kind,
    )
    return LocalProjections(members, reduce)


@contextmanager
def local_step(projections: LocalProjections | None) -> Iterator[None]:
    """``projections.step()``, or nothing for a model that is not sharded."""
    if projections is None or not projections.members:
        yield
        return
    with projections.step():
        yield
