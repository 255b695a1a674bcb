"""Session 28 probe: bf16 greedy agreement of a GPT-OSS-shaped model (GPT-OSS-20B's dimensions, 4 layers, random
weights, sinks ~N(0, 1)) with the float32 truth, for stock eager bf16, stock flex-attention bf16 and hfpaged bf16
(default options), prompts of 128-512 tokens, 32 new tokens each."""

import json
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM

import hfpaged


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def run(model, prompts):
    with torch.no_grad():
        return [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, do_sample=False,
                               eos_token_id=None)[0, len(p):].tolist() for p in prompts]


config = transformers.GptOssConfig(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2)
torch.manual_seed(0)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("sinks"):
            p.normal_(0.0, 1.0)
gen = torch.Generator().manual_seed(1)
lengths = torch.randint(128, 512, (12,), generator=gen).tolist()
prompts = [torch.randint(10, 200000, (n,), generator=gen).tolist() for n in lengths]
t0 = time.perf_counter()
truth = run(model, prompts)
print(f"fp32 truth {time.perf_counter() - t0:.1f} s", flush=True)
model.to(torch.bfloat16)
results = {"eager_bf16": run(model, prompts)}
model.set_attn_implementation("flex_attention")
try:
    results["flex_bf16"] = run(model, prompts)
except Exception as e:  # a probe: record why
    results["flex_bf16_error"] = f"{type(e).__name__}: {str(e)[:300]}"
model.set_attn_implementation("eager")
print("stock bf16 done", flush=True)
hfpaged.patch(model)
results["hfpaged_bf16"] = [r.token_ids for r in model.generate_many(prompts, max_new_tokens=32, do_sample=False,
                                                                    eos_token_id=None)]
results["hfpaged_graph_steps"] = model._hfpaged.engine.runner.num_graph_steps
summary = {}
for name, outs in results.items():
    if isinstance(outs, list):
        summary[name] = dict(equal_to_fp32=sum(a == b for a, b in zip(outs, truth)),
                             first_diff_vs_fp32=[first_diff(a, b) for a, b in zip(outs, truth)],
                             first_diff_vs_eager_bf16=[first_diff(a, b) for a, b in zip(outs, results["eager_bf16"])])
summary["other"] = {k: v for k, v in results.items() if not isinstance(v, list)}
print(json.dumps(summary, indent=1))
with open(sys.argv[1], "w") as f:
    json.dump(summary, f, indent=1)
