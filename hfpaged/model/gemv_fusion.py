"""A one-row projection's neighbours inside its GEMV: an Inductor pass over the compiled layers.

At batch 1 a decoder layer is a chain of small kernels, each waiting for the one before it (dependent launch,
``kernels/dependent_launch.py``): the input RMSNorm, the q/k/v GEMV, ..., the o GEMV, the residual add with the
post-attention RMSNorm, the gate/up GEMV, the activation, the down GEMV, the residual add. Each link costs ~1-2 us
of a step whatever its work (notes/engine_perf.md, session 20). This pass rewrites the post-grad graph of a
compiled layer so that

- an RMSNorm whose every user is a GEMV (``hfpaged::gemv``) runs inside those GEMVs (each program normalizes the
  row it reads anyway), and
- a residual add of a GEMV's output (its only user) runs in that GEMV's epilogue,

both through ``hfpaged::gemv_fused`` (``kernels/gemv.py``). The norm is matched as transformers' Llama-family
``RMSNorm`` computes it (Llama, Qwen2/3, Mistral, ...: ``w * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)``); other
norms (Gemma's ``1 + w``, LayerNorm) do not match and stay as they were. Values: the kernel rounds as those modules
and torch's add do; only the norm's sum of squares is summed in another order (the GEMV path is not bitwise equal
to cuBLAS either: ``gemv=False`` with ``fuse_projections=False`` stays the exact option).
"""

from __future__ import annotations

import functools
import hashlib

import torch
from torch import fx

ENABLED = True  # module switch (A/B measurements): False leaves the compiled layers' graphs as Inductor has them

aten, prims = torch.ops.aten, torch.ops.prims


def _val(arg):
    return arg.meta.get("val") if isinstance(arg, fx.Node) else None


def _is(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _other(node, first):
    """The argument of the binary ``node`` that is not ``first`` (None if ``first`` is not one of them)."""
    a, b = node.args[:2]
    return b if a is first else a if b is first else None


def match_rms_norm(node: fx.Node):
    """``(hidden, weight, eps)`` if ``node`` computes ``weight * (h32 * rsqrt(mean(h32^2, -1) + eps)).to(dtype)``
    with ``h32 = hidden.float()`` and ``hidden``, ``weight`` and the result of one 16-bit dtype (eps: a number or a
    0-d CPU tensor node), else None."""
    out = _val(node)
    if not _is(node, aten.mul.Tensor) or node.kwargs or not isinstance(out, torch.Tensor) or out.dim() == 0:
        return None
    dtype, width = out.dtype, out.shape[-1]
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    for weight, normed in (node.args[:2], node.args[1::-1]):
        wval = _val(weight)
        if not (isinstance(wval, torch.Tensor) and wval.shape == (width,) and wval.dtype == dtype):
            continue
        if not (_is(normed, prims.convert_element_type.default) and normed.args[1] == dtype):
            continue
        scaled = normed.args[0]
        if not _is(scaled, aten.mul.Tensor) or scaled.kwargs:
            continue
        for h32, rsqrt in (scaled.args[:2], scaled.args[1::-1]):
            if not (_is(rsqrt, aten.rsqrt.default) and _is(rsqrt.args[0], aten.add.Tensor)):
                continue
            added = rsqrt.args[0]
            mean = next((a for a in added.args[:2] if _is(a, aten.mean.dim)), None)
            if mean is None or added.kwargs or mean.kwargs:
                continue
            dims, keepdim = mean.args[1], mean.args[2] if len(mean.args) > 2 else False
            if not keepdim or list(dims) not in ([-1], [out.dim() - 1]):
                continue
            square = mean.args[0]
            if not (_is(square, aten.pow.Tensor_Scalar) and square.args[0] is h32 and square.args[1] == 2):
                continue
            if not (_is(h32, prims.convert_element_type.default) and h32.args[1] == torch.float32):
                continue
            hidden, eps = h32.args[0], _eps_source(_other(added, mean))
            hval = _val(hidden)
            if eps is None or not (isinstance(hval, torch.Tensor) and hval.dtype == dtype and hval.shape == out.shape):
                continue
            return hidden, weight, eps
    return None


def _eps_source(eps):
    """A number, or the 0-d CPU tensor node behind ``eps`` (a float dynamo lifted into a graph input), else None."""
    if isinstance(eps, (int, float)):
        return float(eps)
    if _is(eps, prims.convert_element_type.default):
        eps = eps.args[0]
    val = _val(eps)
    if isinstance(val, torch.Tensor) and val.dim() == 0 and val.device.type == "cpu" and val.is_floating_point():
        return eps
    return None


def _gemv_args(node: fx.Node) -> list | None:
    """``[x, weight, bias, launch_pdl, norm_weight, norm_eps, norm_eps_value, residual]`` of a GEMV node (None for a
    call with keyword arguments, which this pass leaves alone: post-grad graphs pass them by position)."""
    if node.kwargs:
        return None
    if node.target is torch.ops.hfpaged.gemv.default:
        return list(node.args) + [None, None, 0.0, None]
    return list(node.args)


def _fused(graph: fx.Graph, before: fx.Node, args: list, like: fx.Node) -> fx.Node:
    with graph.inserting_before(before):
        new = graph.call_function(torch.ops.hfpaged.gemv_fused.default, tuple(args))
    new.meta.update({k: v for k, v in like.meta.items() if k in ("val", "tensor_meta", "stack_trace")})
    return new


def _erase_dead(node) -> None:
    """Erase ``node`` and then its inputs while nothing uses them (pure aten/prims ops only)."""
    pending, erased = [node], set()
    while pending:
        n = pending.pop()
        if not isinstance(n, fx.Node) or n in erased or n.users or n.op != "call_function":
            continue
        if not isinstance(n.target, torch._ops.OpOverload) or n.target.namespace not in ("aten", "prims"):
            continue
        if n.target._schema.is_mutable:
            continue
        inputs = list(n.all_input_nodes)
        n.graph.erase_node(n)
        erased.add(n)
        pending.extend(inputs)


def fuse_gemv_neighbours(graph: fx.Graph) -> int:
    """Rewrite ``graph`` in place (norms into the GEMVs that read them, then residual adds into the GEMVs they
    add); returns how many GEMVs took a neighbour."""
    gemv = torch.ops.hfpaged.gemv.default
    gemvs = (gemv, torch.ops.hfpaged.gemv_fused.default)
    fused = 0
    for node in list(graph.nodes):
        users = [(u, _gemv_args(u) if _is(u, *gemvs) else None) for u in node.users]
        if not users or not all(args is not None and args[0] is node and args[4] is None for _, args in users):
            continue
        match = match_rms_norm(node)
        if match is None:
            continue
        hidden, weight, eps = match
        for user, args in users:
            args[0], args[4] = hidden, weight
            args[5], args[6] = (None, eps) if isinstance(eps, float) else (eps, 0.0)
            new = _fused(graph, user, args, user)
            user.replace_all_uses_with(new)
            graph.erase_node(user)
            fused += 1
        _erase_dead(node)
    for node in list(graph.nodes):
        if not _is(node, aten.add.Tensor) or node.kwargs or len(node.args) != 2:
            continue
        out = _val(node)
        for projected, residual in (node.args, node.args[::-1]):
            args = _gemv_args(projected) if _is(projected, *gemvs) and len(projected.users) == 1 else None
            if args is None or args[7] is not None:
                continue
            pval, rval = _val(projected), _val(residual)
            if not all(isinstance(v, torch.Tensor) for v in (out, pval, rval)):
                continue
            if not (pval.shape == rval.shape == out.shape and pval.dtype == rval.dtype == out.dtype):
                continue
            if pval.device != rval.device:
                continue
            args[7] = residual
            new = _fused(graph, node, args, node)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            graph.erase_node(projected)
            fused += 1
            break
    return fused


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # an older torch: no pass, the layers compile as before
    CustomGraphPass = None


if CustomGraphPass is not None:

    class GemvFusionPass(CustomGraphPass):
        """``fuse_gemv_neighbours`` as Inductor's ``post_grad_custom_post_pass``; its uuid (part of Inductor's
        cache keys) is this file's hash, so a changed pass never reuses graphs compiled by another."""

        def __call__(self, graph: fx.Graph) -> None:
            has_gemv = any(_is(n, torch.ops.hfpaged.gemv.default) for n in graph.nodes)
            if has_gemv and fuse_gemv_neighbours(graph):
                graph.lint()

        def uuid(self):
            return _source_hash()


@functools.cache
def _source_hash() -> str:
    with open(__file__, "rb") as source:
        return hashlib.sha256(source.read()).hexdigest()


def inductor_pass() -> dict:
    """Inductor options that install the pass (none where torch lacks custom passes or ``ENABLED`` is off)."""
    if CustomGraphPass is None or not ENABLED or not hasattr(torch._inductor.config, "post_grad_custom_post_pass"):
        return {}
    return {"post_grad_custom_post_pass": GemvFusionPass()}
