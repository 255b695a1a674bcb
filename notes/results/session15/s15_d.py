"""Session 15 probe D: prompt chunks read their own step's keys by TMA (paged_attention(key=, value=)).

1. Kernel level (CUDA-graph timing), Qwen3 heads 16/8 x 128, bf16: the paged kernel with and without the step rows,
   fresh prompts, a chunk after a cached context, a prompt beside decode rows; SDPA (cuDNN) for scale.
2. Engine A/B/A/B in one process, Qwen3-0.6B shape, default options: step rows on vs off (off: the wrapper's
   step_kv_usable patched to False, before the patch that captures the graphs), prefill of 32 long prompts with one
   new token each, and the long workload (32 x 4-8k in, 128 out) from an empty prefix cache.
"""

import importlib
import json
import os
import sys
import time

sys.path.insert(0, "examples")
sys.path.insert(0, os.path.dirname(__file__))
import torch
from s15_c import graph_ms

import hfpaged
from hfpaged.kernels import paged_attention

pa = importlib.import_module("hfpaged.kernels.paged_attention")
ORIGINAL = pa.step_kv_usable
H, KVH, D, BS = 16, 8, 128, 16
OUT = os.environ.get("OUT", ".")
res = {"device": torch.cuda.get_device_name(), "kernel": [], "engine": []}


def save():
    with open(os.path.join(OUT, "s15_d.json"), "w") as f:
        json.dump(res, f, indent=1)


def kernel_section():
    dev = "cuda"
    for q_lens, seq_lens in [([4096], [4096]), ([8192], [8192]), ([4096, 4096], [4096, 4096]),
                             ([4096], [6144]), ([4096] + [1] * 32, [4096] + [2048] * 32), ([2048], [2048])]:
        T = sum(q_lens)
        nblk = [-(-s // BS) for s in seq_lens]
        perm = torch.randperm(sum(nblk) + 4).tolist()
        tables = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32)
        for b, n in enumerate(nblk):
            tables[b, :n] = torch.tensor([perm.pop() for _ in range(n)])
        k_cache = torch.randn(sum(nblk) + 4, BS, KVH, D, device=dev, dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        tables = tables.to(dev)
        # the step's rows as the engine passes them: [T, KVH, D] views of [1, KVH, T, D], copied from the cache
        key = torch.empty(1, KVH, T, D, device=dev, dtype=torch.bfloat16)[0].transpose(0, 1)
        value = torch.empty_like(key)
        at = 0
        for b, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
            pos = torch.arange(sl - ql, sl, device=dev)
            blocks = tables[b, pos // BS].long()
            key[at:at + ql] = k_cache[blocks, pos % BS]
            value[at:at + ql] = v_cache[blocks, pos % BS]
            at += ql
        q = torch.randn(1, H, T, D, device=dev, dtype=torch.bfloat16)[0].transpose(0, 1)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        hints = dict(scale=D**-0.5, max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens))
        args = (q, k_cache, v_cache, tables, lens, cu)
        flops = sum(4 * H * D * ql * (sl - ql) + 4 * H * D * ql * (ql + 1) / 2 for ql, sl in zip(q_lens, seq_lens))
        gather = graph_ms(lambda: paged_attention(*args, **hints))
        rows = graph_ms(lambda: paged_attention(*args, key=key, value=value, **hints))
        a, b = paged_attention(*args, **hints), paged_attention(*args, key=key, value=value, **hints)
        row = dict(q_lens=q_lens[:2], n=len(q_lens), seq_lens=seq_lens[:2], gather_ms=gather, rows_ms=rows,
                   gather_tflops=flops / gather / 1e9, rows_tflops=flops / rows / 1e9, bitwise_equal=bool(torch.equal(a, b)),
                   max_diff=float((a.float() - b.float()).abs().max()))
        if len(q_lens) == 1 and q_lens == seq_lens:
            t = [torch.randn(1, h, q_lens[0], D, device=dev, dtype=torch.bfloat16) for h in (H, KVH, KVH)]
            row["sdpa_tflops"] = flops / graph_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                *t, is_causal=True, enable_gqa=True)) / 1e9
        print(json.dumps(row), flush=True)
        res["kernel"].append(row)
        save()


def engine_section():
    from benchmark import build_model, prefill_flops, run_hfpaged, workload

    model = build_model("qwen3-0.6b", torch.bfloat16)
    prompts, out_lens = workload("long", 32, model.config.vocab_size)
    flops = prefill_flops(model, [len(p) for p in prompts])
    for rep in range(2):
        for rows_on in (False, True):
            pa.step_kv_usable = ORIGINAL if rows_on else (lambda *a: False)
            hfpaged.patch(model)
            try:
                model.generate_many([p[:3000] for p in prompts[:2]], max_new_tokens=2, do_sample=False)
                hfpaged.reset_prefix_cache(model)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model.generate_many(prompts, max_new_tokens=1, do_sample=False, eos_token_id=None)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                hfpaged.reset_prefix_cache(model)
                n, dt_long, _, _ = run_hfpaged(model, prompts, out_lens)
                outs = None
                if rep == 0:
                    hfpaged.reset_prefix_cache(model)
                    outs = [o.token_ids for o in model.generate_many(prompts[:8], max_new_tokens=32, do_sample=False,
                                                                      eos_token_id=None)]
                row = dict(rows=rows_on, rep=rep, prefill_s=dt, prefill_tok_s=flops["tokens"] / dt,
                           prefill_tflops=(flops["linear"] + flops["attention"]) / dt / 1e12, long_tok_s=n / dt_long,
                           outputs=outs)
                print(json.dumps({k: v for k, v in row.items() if k != "outputs"}), flush=True)
                res["engine"].append(row)
                save()
            finally:
                hfpaged.unpatch(model)
                pa.step_kv_usable = ORIGINAL
            torch.cuda.empty_cache()
    outs = {r["rows"]: r["outputs"] for r in res["engine"] if r["outputs"] is not None}
    if len(outs) == 2:
        res["identical_outputs_rows_vs_gather"] = outs[True] == outs[False]
        print("greedy outputs identical with and without step rows:", outs[True] == outs[False], flush=True)
    save()


if __name__ == "__main__":
    if "kernel" in sys.argv:
        kernel_section()
    if "engine" in sys.argv:
        engine_section()
