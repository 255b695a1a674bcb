"""Tensor parallelism through transformers' own sharding (``from_pretrained(..., tp_plan="auto")`` under torchrun).

transformers shards the projections (DTensor parameters on a 1-D device mesh) and installs the collectives;
each rank's attention then sees only its own heads, so layer discovery sizes each rank's K/V for its local
KV heads without any special case. What hfpaged adds is lockstep: every rank runs the same engine over the
same requests, so every rank must make the same decisions. Three things could make them differ, and are
settled here once, with collectives on the model's tensor-parallel group:
- the pool size (free memory differs between GPUs): the smallest over the ranks, so a block id names the
  same slots on every rank;
- seeds drawn for unseeded sampling: one generator per model, seeded from rank 0;
- what the callers submit: each submission's fingerprint is compared across ranks, and a rank that was
  given other prompts or settings gets an error instead of a silent hang or wrong tokens.
Everything else the engine decides (schedule, preemption, prefix hits, sampling) is a function of those.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from ..core.request import Request


@dataclass
class TensorParallel:
    """The tensor-parallel group a model was sharded over, and the collectives the engine needs on it."""

    group: dist.ProcessGroup  # a gloo group over the model's tensor-parallel ranks (see control_group)
    model_group: dist.ProcessGroup  # the mesh's own group (NCCL on GPUs): the forward's collectives
    world_size: int
    seed_generator: torch.Generator  # seeds for unseeded sampling, identical on every rank
    seeds_at_call: torch.Tensor | None = None  # the generator's state when the call making requests began
    checked: bool = False  # that call reached the ranks' comparison (every rank took part in it)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value``."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    def draw_seed(self) -> int:
        return int(torch.randint(0, 2**62, (1,), generator=self.seed_generator).item())

    def check_same(self, what: str, fingerprint: int, count: int | None = None) -> None:
        """Raise ValueError on every rank unless every rank passed the same ``fingerprint`` (and ``count`` of
        requests; None: options, not requests)."""
        mine = torch.tensor([fingerprint, -1 if count is None else count], dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine, group=self.group)
        values = [tuple(int(v) for v in t.tolist()) for t in gathered]
        if any(v != values[0] for v in values):
            if count is None:
                raise ValueError(
                    f"tensor parallel: the ranks passed different {what} (fingerprints differ): they shape every "
                    "step, which the ranks run together. Patch every rank with the same settings"
                )
            detail = ", ".join(f"rank {r}: {n} requests" for r, (_, n) in enumerate(values))
            raise ValueError(
                f"tensor parallel: the ranks submitted different {what} ({detail}; fingerprints differ). Every rank "
                "must make the same calls with the same prompts and settings, in the same order"
            )


# patch options each rank may set for itself: the pool (and the swap space) takes the smallest rank's size anyway,
# and a cache directory or the garbage collector's freeze are the process's own
RANK_LOCAL_OPTIONS = ("num_blocks", "gpu_memory_utilization", "cpu_kv_cache_gib", "swap_space", "compile_cache_dir",
                      "freeze_gc")  # fmt: skip


def check_same_options(tp: TensorParallel, config: Any) -> None:
    """ValueError on every rank unless every rank patched with the same engine options (``EngineConfig``; those in
    ``RANK_LOCAL_OPTIONS`` aside): block size, batch limits, prefix caching, preemption... decide each step."""
    options = {name: value for name, value in sorted(vars(config).items()) if name not in RANK_LOCAL_OPTIONS}
    digest = hashlib.blake2b(repr(plain_settings(options)).encode(), digest_size=8).digest()
    tp.check_same("patch options", int.from_bytes(digest, "little") >> 1)


def find_tensor_parallel(model: torch.nn.Module) -> TensorParallel | None:
    """The model's tensor-parallel group if transformers sharded it over more than one rank, else None."""
    mesh = device_mesh(model)
    if mesh is None or not dist.is_available() or not dist.is_initialized():
        return None
    if mesh.ndim != 1:
        raise ValueError(
            f"{type(model).__name__} is sharded over a {mesh.ndim}-D device mesh {tuple(mesh.mesh_dim_names or ())}; "
            "hfpaged supports tensor parallelism over a 1-D mesh only (tp_plan without other parallel dimensions)"
        )
    model_group = mesh.get_group()
    world_size = dist.get_world_size(model_group)
    if world_size == 1:
        return None
    check_heads(model, world_size)
    group = control_group(model_group)
    seed = torch.tensor([int(torch.randint(0, 2**62, (1,)).item())], dtype=torch.int64)
    dist.broadcast(seed, src=dist.get_global_rank(group, 0), group=group)
    generator = torch.Generator()
    generator.manual_seed(int(seed.item()))
    return TensorParallel(group, model_group, world_size, generator)


def control_group(model_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A gloo group over ``model_group``'s ranks, for the engine's own collectives (as transformers' continuous
    batching does): small CPU tensors, and no eager NCCL call between the NCCL calls that CUDA graphs replay."""
    if dist.get_backend(model_group) == "gloo":
        return model_group
    ranks = dist.get_process_group_ranks(model_group)
    if len(ranks) == dist.get_world_size():
        return dist.new_group(ranks, backend="gloo")
    every = [None] * dist.get_world_size()  # new_group is collective over the world: create every TP group's
    dist.all_gather_object(every, ranks)
    mine = None
    for group_ranks in sorted({tuple(r) for r in every}):
        created = dist.new_group(list(group_ranks), backend="gloo")
        if dist.get_rank() in group_ranks:
            mine = created
    return mine


def device_mesh(model: torch.nn.Module) -> Any:
    """The device mesh transformers sharded ``model`` over (its DTensor parameters carry it), or None."""
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None:
            return mesh
    return getattr(model, "_device_mesh", None)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether transformers sharded ``model`` over a device mesh; no collective."""
    return device_mesh(model) is not None


def check_heads(model: torch.nn.Module, world_size: int) -> None:
    """ValueError naming the counts unless the attention and KV heads split evenly over ``world_size`` ranks."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    num_heads = getattr(config, "num_attention_heads", None)
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    for name, count in (("attention heads", num_heads), ("KV heads", num_kv_heads)):
        if count is not None and count % world_size:
            raise ValueError(
                f"{type(model).__name__} has {count} {name}, which cannot be split over {world_size} "
                f"tensor-parallel ranks; use a tensor-parallel size that divides {count}"
            )


def plain_settings(value: Any, depth: int = 0) -> Any:
    """``value`` as plain data that prints the same in every process (no addresses): numbers, strings, nested
    containers, tensors by their values; other objects by type and attributes (8 levels deep: a user processor's
    fields sit at level 5 of ``check_lockstep``'s settings), modules and
    callables by type alone. What a request's processors and generation config hold, for the ranks' comparison."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, torch.Tensor):
        flat = value.detach().flatten()
        return ("tensor", tuple(value.shape), str(value.dtype), flat[:4096].tolist(), float(flat.double().sum()))
    if depth >= 8 or isinstance(value, torch.nn.Module) or callable(value) and not hasattr(value, "__dict__"):
        return type(value).__qualname__
    if isinstance(value, (dict, list, tuple, set, frozenset)) and len(value) > 10_000:
        return (type(value).__qualname__, len(value))  # a vocabulary-sized table held by an object: its size
    if isinstance(value, dict):
        items = [(repr(plain_settings(k, depth + 1)), plain_settings(v, depth + 1)) for k, v in value.items()]
        return tuple(sorted(items, key=lambda kv: kv[0]))
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(repr(plain_settings(v, depth + 1)) for v in value))
    if isinstance(value, (list, tuple)):
        return tuple(plain_settings(v, depth + 1) for v in value)
    fields = getattr(value, "__dict__", None)
    if fields is None and hasattr(value, "__slots__"):
        fields = {name: getattr(value, name, None) for name in value.__slots__}
    if fields is None:
        return type(value).__qualname__
    return (type(value).__qualname__, plain_settings(fields, depth + 1))


def requests_fingerprint(prompts: Sequence[Sequence[int]], settings: Sequence[tuple]) -> int:
    """A 63-bit digest of prompts' token ids and their settings (numbers only: equal across processes)."""
    digest = hashlib.blake2b(digest_size=8)
    for token_ids, values in zip(prompts, settings):
        digest.update(struct.pack(f"<q{len(token_ids)}q", len(token_ids), *token_ids))
        digest.update(repr(values).encode())
    return int.from_bytes(digest.digest(), "little") >> 1


@contextmanager
def making_requests(state: Any) -> Iterator[None]:
    """Around the making of a call's requests (``state``: the model's PatchState) on a tensor-parallel model: a
    failure on some ranks (bad input, a refused setting) is told to the others, whose comparison then fails too,
    and every rank's seed generator goes back to where the call found it, so the ranks stay in step."""
    try:
        tp = state.tp
    except ReferenceError:  # a handle of an unpatched model: its call raises before anything is made
        tp = None
    if tp is None:
        yield
        return
    tp.seeds_at_call, tp.checked = tp.seed_generator.get_state(), False
    try:
        yield
    except BaseException:
        tp.seed_generator.set_state(tp.seeds_at_call)
        if not tp.checked:  # failed before the comparison: take part in it with a fingerprint no call has
            tp.checked = True
            with suppress(ValueError):
                tp.check_same("requests", -1, -1)
        raise


def check_lockstep(tp: TensorParallel, requests: list[Request]) -> None:
    """Tensor parallel: ValueError unless every rank submits the same requests now (nothing is queued then)."""
    settings = [  # every setting that shapes a request's tokens: its generation config and its processors' data
        (
            p.max_length,
            p.do_sample,
            p.seed,
            p.num_return_sequences,
            p.num_beams,
            p.top_logprobs,
            sorted(p.eos_token_ids),
        )
        + plain_settings((p.generation_config.to_diff_dict(), [(s.kind.name, s.rank, s.payload) for s in p.stages]))
        for p in (request.params for request in requests)
    ]
    fingerprint = requests_fingerprint([request.prompt_token_ids for request in requests], settings)
    tp.checked = True
    try:
        tp.check_same("requests", fingerprint, len(requests))
        for request in requests:  # after the comparison: every rank refuses it together
            if request.params.stop.max_time is not None:
                raise ValueError(
                    "max_time cannot be used with a tensor-parallel model: each rank's clock would stop its "
                    "requests at a different step"
                )
    except ValueError:
        if tp.seeds_at_call is not None:
            tp.seed_generator.set_state(tp.seeds_at_call)
        raise
