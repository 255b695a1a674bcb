"""Probe D (session 20): batch-1 decode with and without the LM head on the GEMV and with the merge kernel before and
after its one-round-trip change, in one process (alternating, a fresh patch each).

python notes/results/session20/s20_d.py MODEL[,MODEL...] REPS [--dry-run]
Variants: "new" (default code), "lm_head_cublas" (the output embedding taken out of the GEMV's projections before the
first step), "merge_before" (the merge kernel as it was: the accumulators loaded masked by the maxima).
"""

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "examples")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchmark  # noqa: E402

import hfpaged  # noqa: E402
from _probe import probe_model  # noqa: E402
from hfpaged.kernels import paged_attention as _pa_pkg  # noqa: E402,F401

pa = sys.modules["hfpaged.kernels.paged_attention"]
from hfpaged.kernels.dependent_launch import wait_for_previous_kernel  # noqa: E402

DRY = "--dry-run" in sys.argv
NEW_MERGE = pa._merge_splits_kernel


@triton.jit(do_not_specialize=["num_splits"])
def merge_before(out_ptr, split_acc_ptr, split_max_ptr, split_sum_ptr, num_splits, stride_out_t, stride_out_h,
                 NUM_HEADS: tl.constexpr, HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
                 SPLITS_PAD: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    split_ok = offs_s < num_splits
    row = (token * NUM_HEADS + head) * num_splits + offs_s
    m = tl.load(split_max_ptr + row, mask=split_ok, other=float("-inf"))
    sums = tl.load(split_sum_ptr + row, mask=split_ok, other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    denom = tl.sum(sums * weight, 0)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    acc_ok = split_ok & (m > float("-inf"))
    acc = tl.load(split_acc_ptr + row[:, None] * HEAD_DIM_V_PAD + offs_dv[None, :], mask=acc_ok[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + token * stride_out_t + head * stride_out_h + offs_dv, out.to(out_ptr.dtype.element_ty),
             mask=offs_dv < HEAD_DIM_V)  # fmt: skip


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    names, reps = args[0].split(","), int(args[1])
    for name in names:
        model = probe_model(name, DRY)
        tokens = {}
        for rep in range(reps):
            for variant in ("new", "lm_head_cublas", "merge_before"):
                pa._merge_splits_kernel = merge_before if variant == "merge_before" else NEW_MERGE
                hfpaged.patch(model, gemv=None if not DRY else True)
                fused = model._hfpaged.fused_projections
                if variant == "lm_head_cublas":
                    out = model.get_output_embeddings()
                    fused.singles = [s for s in fused.singles if s[2] is not out]
                num_gemv = fused.num_gemv
                ms = benchmark.batch1_latency(model, new_tokens=256 if not DRY else 4)
                long = benchmark.batch1_latency(model, prompt_len=2000 if not DRY else 40, new_tokens=128 if not DRY else 4)
                res = model.generate_many([list(range(100, 164))], max_new_tokens=64 if not DRY else 4, do_sample=False,
                                          eos_token_id=None)  # fmt: skip
                tokens[variant] = res[0].token_ids
                hfpaged.unpatch(model)
                print(f"[{name}] rep {rep} {variant}: batch-1 {ms:.3f} ms/token at 128-384 keys, {long:.3f} at "
                      f"2000-2128 keys; {num_gemv} GEMV projections", flush=True)  # fmt: skip
        base = tokens["new"]
        for k, v in tokens.items():
            same = next((i for i, (a, b) in enumerate(zip(base, v)) if a != b), len(base))
            print(f"[{name}] {k}: greedy tokens agree with 'new' on the first {same} of {len(base)}", flush=True)
        del model
        if not DRY:
            torch.cuda.empty_cache()
    pa._merge_splits_kernel = NEW_MERGE


if __name__ == "__main__":
    main()
