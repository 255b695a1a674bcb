"""Session 12: Inductor combo kernels off/on A/B in one process: nano/chat/churn throughput + batch-1 latency."""
import json, os, sys, time, traceback
sys.path.insert(0, "examples")
import torch
import benchmark as bm
import hfpaged
import hfpaged.model.custom_ops as co

OUT = os.environ.get("OUT", ".")
res = {}
plan = {"qwen3-0.6b": (("off", False), ("on", True), ("off2", False), ("on2", True))}
for name in sys.argv[1:]:
    model = bm.build_model(name, torch.bfloat16)
    vocab = model.config.vocab_size
    loads = {k: bm.workload(k, bm.WORKLOAD_REQUESTS[k], vocab) for k in ("nano", "chat", "churn")}
    variants = plan.get(name, (("off", False), ("on", True)))
    for label, combo in variants:
        r = res.setdefault(f"{name}_{label}", {})
        try:
            torch._dynamo.reset()
            co.INDUCTOR_OPTIONS = {"combo_kernels": combo}
            hfpaged.patch(model, max_num_seqs=256, compile_cache_dir="")
            t = time.perf_counter()
            bm.run_hfpaged(model, loads["chat"][0][:32], [8] * 32)
            r["warm_s"] = time.perf_counter() - t
            r["batch1_ms"] = [bm.batch1_latency(model) for _ in range(2)]
            if name == "qwen3-0.6b":
                for kind, (prompts, outs) in loads.items():
                    tokens, dt, usage, engine = bm.run_hfpaged(model, prompts, outs)
                    r[kind] = {"tok_s": tokens / dt, "steps": bm.summarize_steps(engine.step_log),
                               "host_ms_per_step": {k: v / max(engine.core.timings.get("steps", 1), 1) * 1e3
                                                    for k, v in engine.core.timings.items() if k != "steps"}}
            print(name, label, json.dumps({k: (v if not isinstance(v, dict) else v.get("tok_s")) for k, v in r.items()}), flush=True)
        except Exception:
            r["error"] = traceback.format_exc()
            print(r["error"], flush=True)
        finally:
            try:
                hfpaged.unpatch(model)
            except Exception:
                traceback.print_exc()
    del model
    torch.cuda.empty_cache()
json.dump(res, open(os.path.join(OUT, "s12_b.json"), "w"), indent=1)
