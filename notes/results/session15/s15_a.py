"""Session 15 probe A: long prefill chunks through SDPA (cuDNN) instead of the paged kernel (dense_prefill.py).

1. Kernel level, Qwen3-0.6B heads (16 / 8 x 128), bf16, CUDA-event timing of eager calls (the engine runs planned
   steps eagerly): our paged kernel over the step, SDPA on contiguous [B, H, L, D] (what the issue compares with),
   SDPA on the packed layout's strided views, and dense_prefill.attend (the engine's path: store already done,
   paged kernel for the rest, SDPA, copy into the output rows), with bf16 and fp8 caches.
2. Engine A/B in one process, Qwen3-0.6B shape, random weights, default options: dense_prefill_tokens=0 (paged
   kernel only) vs None (default: 1,024), A/B/A/B: long prompts prefilled with one new token (TFLOP/s counted as
   benchmark.py --sections prefill does), and the long workload (32 x 4-8k in, 128 out); greedy agreement A vs B.
"""

import json
import os
import statistics
import sys
import time

sys.path.insert(0, "examples")
import torch

import hfpaged
from hfpaged.kernels import paged_attention, store_kv
from hfpaged.model import dense_prefill

OUT = os.environ.get("OUT", ".")
BS, H, KVH, D = 16, 16, 8, 128
dev = torch.device("cuda")
res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "kernel": [], "engine": {}}


def save():
    with open(os.path.join(OUT, "s15_a.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


def event_ms(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_ms(fn, iters=20):
    """GPU time per call from a CUDA graph of `iters` calls (no host overhead); None if it cannot be captured."""
    try:
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        g.replay()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / iters
    except Exception as e:
        print("graph capture failed:", repr(e)[:200], flush=True)
        return None


def step(prefills, decodes, decode_ctx, cache_dtype):
    """A packed step: fresh prefills (lengths) then decode rows; K/V stored into a shuffled pool."""
    q_lens = list(prefills) + [1] * decodes
    seq_lens = list(prefills) + [decode_ctx] * decodes
    nblk = [-(-s // BS) for s in seq_lens]
    num_blocks = sum(nblk) + 8
    perm = torch.randperm(num_blocks).tolist()
    width = max(nblk)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for b, n in enumerate(nblk):
        tables[b, :n] = torch.tensor([perm.pop() for _ in range(n)])
    k_cache = torch.randn(num_blocks, BS, KVH, D, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    T = sum(q_lens)
    # the packed layout the model hands over: [T, heads, D] rows (transposed views of [1, heads, T, D])
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    key = torch.randn(T, KVH, D, device=dev, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    tables = tables.to(dev)
    slots = []
    for b, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        pos = torch.arange(sl - ql, sl)
        slots.append(tables[b, pos // BS].cpu().long() * BS + pos % BS)
    slot_mapping = torch.cat(slots).to(dev).int()
    scales = {}
    if cache_dtype != torch.bfloat16:
        k_cache, v_cache = (k_cache * 10).to(cache_dtype), (v_cache * 10).to(cache_dtype)
        scales = {"k_scale": torch.tensor([0.1], device=dev), "v_scale": torch.tensor([0.1], device=dev)}
    store_kv(key, value, k_cache, v_cache, slot_mapping, **scales)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    return dict(q=q, key=key, value=value, k_cache=k_cache, v_cache=v_cache, tables=tables, lens=lens, cu=cu,
                scales=scales, q_lens=q_lens, seq_lens=seq_lens)


def kernel_section():
    shapes = [((2048,), 0), ((3000,), 0), ((4096,), 0), ((8192,), 0), ((4096, 4096), 0), ((4096,), 32), ((5000, 2500), 64)]
    for prefills, decodes in shapes:
        for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            s = step(prefills, decodes, 2048, cache_dtype)
            flops = sum(4 * H * D * n * (n + 1) / 2 for n in prefills)
            scale = D**-0.5
            mq, mk = max(s["q_lens"]), max(s["seq_lens"])
            args = (s["q"], s["k_cache"], s["v_cache"], s["tables"], s["lens"], s["cu"])
            ours = lambda: paged_attention(*args, scale=scale, max_seqlen_q=mq, max_seqlen_k=mk, **s["scales"])
            from hfpaged.core.scheduler_output import ScheduledRequest

            sched = [ScheduledRequest(str(i), sl - ql, ql, True) for i, (ql, sl) in enumerate(zip(s["q_lens"], s["seq_lens"]))]
            entries = dense_prefill.plan(sched, 2048)
            dense = lambda: dense_prefill.attend(entries, paged_attention, s["q"], s["key"], s["value"], *args[1:],
                                                 scale=scale, max_seqlen_q=mq, max_seqlen_k=mk, **s["scales"])
            row = dict(prefills=prefills, decodes=decodes, cache=str(cache_dtype), planned=len(entries))
            row["ours_ms"] = event_ms(ours)
            row["dense_ms"] = event_ms(dense)
            row["ours_graph_ms"] = graph_ms(ours)
            row["dense_graph_ms"] = graph_ms(dense)
            ref = ours().float()
            got = dense().float()
            rows = slice(0, sum(prefills))
            row["max_abs_diff_dense_vs_ours"] = float((ref[rows] - got[rows]).abs().max())
            row["decode_rows_equal"] = bool(torch.equal(ref[sum(prefills):], got[sum(prefills):])) if decodes else None
            if cache_dtype == torch.bfloat16:
                contiguous = [(torch.randn(1, H, n, D, device=dev, dtype=torch.bfloat16),
                               torch.randn(1, KVH, n, D, device=dev, dtype=torch.bfloat16),
                               torch.randn(1, KVH, n, D, device=dev, dtype=torch.bfloat16)) for n in prefills]
                sdpa = lambda: [torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)
                                for a, b, c in contiguous]
                row["sdpa_contiguous_ms"] = event_ms(sdpa)
                row["sdpa_contiguous_graph_ms"] = graph_ms(sdpa)
                starts = [0] + torch.tensor(prefills).cumsum(0).tolist()
                strided = lambda: [torch.nn.functional.scaled_dot_product_attention(
                    s["q"][a:a + n].transpose(0, 1)[None], s["key"][a:a + n].transpose(0, 1)[None],
                    s["value"][a:a + n].transpose(0, 1)[None], is_causal=True, enable_gqa=True)
                    for a, n in zip(starts, prefills)]
                row["sdpa_strided_ms"] = event_ms(strided)
                row["sdpa_tflops"] = flops / row["sdpa_contiguous_ms"] / 1e9
            row["ours_tflops"] = flops / row["ours_ms"] / 1e9
            row["dense_tflops"] = flops / row["dense_ms"] / 1e9
            for k in ("ours", "dense", "sdpa_contiguous"):
                if row.get(k + "_graph_ms"):
                    row[k + "_graph_tflops"] = flops / row[k + "_graph_ms"] / 1e9
            print(json.dumps(row), flush=True)
            res["kernel"].append(row)
            save()
            del s
            torch.cuda.empty_cache()


def engine_section(model, name):
    from benchmark import prefill_flops, run_hfpaged, workload

    vocab = model.config.vocab_size
    prompts, out_lens = workload("long", 32, vocab)
    flops = prefill_flops(model, [len(p) for p in prompts])
    rows = []
    tokens_by = {}
    for rep in range(2):
        for setting in (0, None):
            hfpaged.patch(model, dense_prefill_tokens=setting)
            try:
                model.generate_many(prompts[:4], max_new_tokens=2, do_sample=False)  # warm-up: graphs, compile
                runner = model._hfpaged.engine.runner
                dense0 = runner.num_dense_steps
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model.generate_many(prompts, max_new_tokens=1, do_sample=False, eos_token_id=None)
                torch.cuda.synchronize()
                dt_prefill = time.perf_counter() - t0
                dense_prefill_steps = runner.num_dense_steps - dense0
                hfpaged.reset_prefix_cache(model)  # the long run prefills its prompts again
                n, dt, _, engine = run_hfpaged(model, prompts, out_lens)
                hfpaged.reset_prefix_cache(model)
                outs = model.generate_many(prompts[:8], max_new_tokens=64, do_sample=False, eos_token_id=None) if rep == 0 else None
                if outs is not None:
                    tokens_by[setting] = [o.token_ids for o in outs]
                row = dict(setting=setting, rep=rep, prefill_s=dt_prefill,
                           prefill_tflops=(flops["linear"] + flops["attention"]) / dt_prefill / 1e12,
                           prefill_tok_s=flops["tokens"] / dt_prefill, dense_steps_prefill=dense_prefill_steps,
                           long_tok_s=n / dt, long_s=dt, graph_steps=runner.num_graph_steps,
                           eager_steps=runner.num_eager_steps, dense_steps=runner.num_dense_steps)
                print(name, json.dumps(row), flush=True)
                rows.append(row)
            finally:
                hfpaged.unpatch(model)
            torch.cuda.empty_cache()
    if len(tokens_by) == 2:
        a, b = tokens_by[0], tokens_by[None]
        res["engine"][name + "_agreement"] = dict(identical=sum(x == y for x, y in zip(a, b)) / len(a),
                                                  first_token=sum(x[0] == y[0] for x, y in zip(a, b)) / len(a),
                                                  common_prefix=[next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) for x, y in zip(a, b)])
    res["engine"][name] = rows
    save()


def profile_section(model):
    """One 8,000-token prompt prefilled (one planned step), profiled: host time vs GPU time, top ops."""
    from torch.profiler import ProfilerActivity, profile

    prompt = torch.randint(10, 1000, (8000,)).tolist()
    hfpaged.patch(model)
    try:
        model.generate_many([prompt[:3000]], max_new_tokens=1, do_sample=False)  # warm-up (graphs, compile)
        for label in ("first", "again"):
            hfpaged.reset_prefix_cache(model)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                model.generate_many([prompt], max_new_tokens=1, do_sample=False)
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            events = prof.key_averages()
            gpu = sum(e.self_device_time_total for e in events) / 1e3
            print(f"profile {label}: wall {wall * 1e3:.1f} ms (profiled), GPU kernels {gpu:.1f} ms", flush=True)
            print(events.table(sort_by="self_cpu_time_total", row_limit=18), flush=True)
            print(events.table(sort_by="self_device_time_total", row_limit=12), flush=True)
            res["engine"]["profile_" + label] = dict(wall_ms=wall * 1e3, gpu_ms=gpu)
    finally:
        hfpaged.unpatch(model)


if __name__ == "__main__":
    which = sys.argv[1:] or ["kernel", "engine"]
    if "kernel" in which:
        try:
            kernel_section()
        except Exception as e:  # keep the engine section
            import traceback

            traceback.print_exc()
            res["kernel_error"] = repr(e)
    if "engine" in which:
        from benchmark import build_model

        model = build_model("qwen3-0.6b", torch.bfloat16)
        if "profile" in which:
            profile_section(model)
        engine_section(model, "qwen3-0.6b")
    save()
