"""Session 12: longest-first decode packing, A/B/A/B in one process: nano (bf16, pool as default) and nano with an
8 GiB fp8 pool (bench_fp8_kv's setting)."""
import json, os, sys, time, traceback
sys.path.insert(0, "examples")
import torch
import benchmark as bm
import bench_fp8_kv as f8
import hfpaged

OUT = os.environ.get("OUT", ".")
res = {}
model = bm.build_model("qwen3-0.6b", torch.bfloat16)
prompts, outs = bm.workload("nano", 256, model.config.vocab_size)
for kv in ("auto", "fp8"):
    try:
        if kv == "auto":
            hfpaged.patch(model, max_num_seqs=256)
        else:
            block_bytes = 16 * f8.kv_bytes_per_token(model, kv)
            hfpaged.patch(model, num_blocks=int(8 * 2**30) // block_bytes, kv_cache_dtype=kv)
        short = [p[:256] for p in prompts[:8]]
        model.generate_many(short, max_new_tokens=32, do_sample=False)
        model.generate_many(short * 8, max_new_tokens=16, do_sample=False)
        batch = model._hfpaged.engine.runner.batch
        for label in ("sorted", "scheduler", "sorted2", "scheduler2"):
            batch.longest_first = label.startswith("sorted")
            tokens, dt, usage, engine = bm.run_hfpaged(model, prompts, outs)
            r = {"tok_s": tokens / dt, "s": dt, "steps": bm.summarize_steps(engine.step_log)["graph_steps"],
                 "host_ms_per_step": {k: round(v / max(engine.core.timings.get("steps", 1), 1) * 1e3, 3)
                                      for k, v in engine.core.timings.items() if k != "steps"}}
            res[f"{kv}_{label}"] = r
            print(kv, label, json.dumps(r), flush=True)
        hfpaged.unpatch(model)
        torch.cuda.empty_cache()
    except Exception:
        print(traceback.format_exc(), flush=True)
json.dump(res, open(os.path.join(OUT, "s12_f.json"), "w"), indent=1)
