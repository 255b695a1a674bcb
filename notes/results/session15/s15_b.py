"""Session 15 probe B: dense prefill (SDPA) where steps run without CUDA graphs anyway.

1. Kernel level (CUDA-graph timing: GPU time only), Qwen3 heads 16/8 x 128, bf16 and fp8 caches: our paged kernel,
   SDPA on contiguous tensors, and dense_prefill.attend with both buffer layouts (bhsd: contiguous [1, H, N, D],
   transposing copies; bshd: [1, N, H, D] row copies, SDPA on transposed views).
2. Engine A/B/A/B with enforce_eager=True (every step eager): dense_prefill_tokens 0 vs None (default 2,048), long
   prompts prefilled with one new token, Qwen3-0.6B and Llama-3.1-8B shapes; the long workload once each (Qwen3).
"""

import json
import os
import sys
import time

sys.path.insert(0, "examples")
sys.path.insert(0, os.path.dirname(__file__))
import torch
from s15_a import D, H, graph_ms, step

import hfpaged
from hfpaged.core.scheduler_output import ScheduledRequest
from hfpaged.kernels import paged_attention
from hfpaged.model import dense_prefill

OUT = os.environ.get("OUT", ".")
res = {"device": torch.cuda.get_device_name(), "kernel": [], "engine": {}}


def save():
    with open(os.path.join(OUT, "s15_b.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


def kernel_section():
    cases = [((4096,), 0, 0), ((8192,), 0, 0), ((3000,), 0, 0), ((4096, 4096), 0, 0), ((4096,), 2048, 0), ((4096,), 0, 32)]
    for prefills, context, decodes in cases:
        for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            s = step(prefills, decodes, 2048, cache_dtype)
            if context:  # the chunk's sequence holds `context` earlier keys: rebuild its lengths and slots
                s["lens"][0] += context
                s["seq_lens"][0] += context
                s["tables"] = torch.cat([s["tables"], s["tables"][:, :1].repeat(1, -(-context // 16))], 1)
            flops = sum(4 * H * D * n * (n + 1) / 2 for n in prefills) + (4 * H * D * prefills[0] * context if context else 0)
            scale = D**-0.5
            mq, mk = max(s["q_lens"]), max(s["seq_lens"])
            args = (s["q"], s["k_cache"], s["v_cache"], s["tables"], s["lens"], s["cu"])
            row = dict(prefills=prefills, context=context, decodes=decodes, cache=str(cache_dtype)[6:])
            row["ours"] = graph_ms(lambda: paged_attention(*args, scale=scale, max_seqlen_q=mq, max_seqlen_k=mk, **s["scales"]))
            sched = [ScheduledRequest(str(i), sl - ql, ql, True) for i, (ql, sl) in enumerate(zip(s["q_lens"], s["seq_lens"]))]
            entries = dense_prefill.plan(sched, 2048)
            row["planned"] = len(entries)
            outs = {}
            for layout in ("bhsd", "bshd"):
                dense_prefill._LAYOUT = layout
                fn = lambda: dense_prefill.attend(entries, paged_attention, s["q"], s["key"], s["value"], *args[1:],
                                                  scale=scale, max_seqlen_q=mq, max_seqlen_k=mk, **s["scales"])
                row[layout] = graph_ms(fn)
                outs[layout] = fn().float()
            ref = paged_attention(*args, scale=scale, max_seqlen_q=mq, max_seqlen_k=mk, **s["scales"]).float()
            row["max_diff_vs_ours"] = max(float((o - ref).abs().max()) for o in outs.values())
            if cache_dtype == torch.bfloat16 and not context:
                ts = [(torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16),
                       torch.randn(1, 8, n, D, device="cuda", dtype=torch.bfloat16),
                       torch.randn(1, 8, n, D, device="cuda", dtype=torch.bfloat16)) for n in prefills]
                row["sdpa"] = graph_ms(lambda: [torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True) for a, b, c in ts])
            for k in ("ours", "bhsd", "bshd", "sdpa"):
                if row.get(k):
                    row[k + "_tflops"] = round(flops / row[k] / 1e9, 1)
            print(json.dumps(row), flush=True)
            res["kernel"].append(row)
            save()
            del s
            torch.cuda.empty_cache()
    dense_prefill._LAYOUT = "bhsd"


def engine_ab(name, num_prompts, long_run):
    from benchmark import build_model, prefill_flops, run_hfpaged, workload

    model = build_model(name, torch.bfloat16)
    prompts, out_lens = workload("long", num_prompts, model.config.vocab_size)
    flops = prefill_flops(model, [len(p) for p in prompts])
    rows = []
    for rep in range(2):
        for setting in (0, None):
            hfpaged.patch(model, dense_prefill_tokens=setting, enforce_eager=True)
            try:
                model.generate_many([p[:3000] for p in prompts[:2]], max_new_tokens=2, do_sample=False)  # warm-up
                runner = model._hfpaged.engine.runner
                hfpaged.reset_prefix_cache(model)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model.generate_many(prompts, max_new_tokens=1, do_sample=False, eos_token_id=None)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                row = dict(setting=setting, rep=rep, prefill_s=dt, prefill_tok_s=flops["tokens"] / dt,
                           prefill_tflops=(flops["linear"] + flops["attention"]) / dt / 1e12,
                           dense_steps=runner.num_dense_steps, eager_steps=runner.num_eager_steps)
                if long_run and rep == 0:
                    hfpaged.reset_prefix_cache(model)
                    n, dt_long, _, _ = run_hfpaged(model, prompts, out_lens)
                    row["long_tok_s"] = n / dt_long
                print(name, json.dumps(row), flush=True)
                rows.append(row)
            finally:
                hfpaged.unpatch(model)
            torch.cuda.empty_cache()
    res["engine"][name] = rows
    save()
    del model
    torch.cuda.empty_cache()


if __name__ == "__main__":
    which = sys.argv[1:]
    if "kernel" in which:
        kernel_section()
    if "qwen" in which:
        engine_ab("qwen3-0.6b", 32, True)
    if "llama8b" in which:
        engine_ab("llama-3.1-8b", 16, False)
    save()
