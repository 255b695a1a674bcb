"""Session 28 probe: a GPT-OSS-shaped model (GPT-OSS-20B's dimensions, 4 layers, random bf16 weights) through hfpaged
with default options on CUDA: graph steps, tokens/s against stock generate at batch 1 (one prompt), and bf16 greedy
agreement with stock generate (informational: bf16 sums in another order)."""

import json
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM

import hfpaged

out_path = sys.argv[1]
config = transformers.GptOssConfig(
    num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, initializer_range=0.02
)
torch.manual_seed(0)
t0 = time.perf_counter()
with torch.device("cuda"):  # random init on the GPU (the CPU takes minutes for these sizes)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
print(f"built in {time.perf_counter() - t0:.1f} s", flush=True)
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("sinks"):
            p.normal_(0.0, 1.0)
gen = torch.Generator().manual_seed(1)
prompts = [torch.randint(10, 200000, (int(n),), generator=gen).tolist() for n in torch.randint(128, 512, (64,), generator=gen)]
result = {"attn_implementation": model.config._attn_implementation}

with torch.no_grad():
    stock = []
    for p in prompts[:8]:
        seq = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, do_sample=False)
        stock.append(seq[0, len(p):].tolist())
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(torch.tensor([prompts[0]], device="cuda"), max_new_tokens=64, do_sample=False, eos_token_id=None)
    torch.cuda.synchronize()
    result["stock_batch1_tok_s"] = 64 / (time.perf_counter() - start)
print("stock done", result, flush=True)

start = time.perf_counter()
hfpaged.patch(model)
mine = [r.token_ids for r in model.generate_many(prompts[:8], max_new_tokens=32, do_sample=False)]
result["first_call_s"] = time.perf_counter() - start
result["agree_prompts"] = sum(a == b for a, b in zip(mine, stock))
print(f"first call {result['first_call_s']:.1f} s", flush=True)
result["agree_first_tokens"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(mine, stock)]
for run in range(2):
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = model.generate_many(prompts, max_new_tokens=128, do_sample=False, eos_token_id=None)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    result[f"run{run}_tok_s"] = sum(len(o.token_ids) for o in outs) / seconds
runner = model._hfpaged.engine.runner
result["graph_steps"] = runner.num_graph_steps
result["layers"] = [(r.sliding_window, str(r.sinks_dtype)) for r in model._hfpaged.layers]
result["stats"] = {k: v for k, v in hfpaged.stats(model).items() if isinstance(v, (int, float, str))}
print(json.dumps(result, indent=1))
with open(out_path, "w") as f:
    json.dump(result, f, indent=1)
