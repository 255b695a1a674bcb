"""Session 28 probe: an MLA model (DeepSeek-V2-Lite's attention and MoE dimensions in DeepseekV3's modeling code,
4 layers, random bf16 weights) through hfpaged on CUDA with the Triton kernels (the default now) and with the torch
attention (the default before: value heads of 128 beside query/key heads of 192); tokens/s, graph steps, bf16
greedy agreement next to the yardstick (stock eager vs stock sdpa)."""

import json
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM

import hfpaged


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


config = transformers.DeepseekV3Config(
    hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=4,
    num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
    n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
    qk_nope_head_dim=128, v_head_dim=128, vocab_size=102400, max_position_embeddings=4096,
)
torch.manual_seed(0)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
gen = torch.Generator().manual_seed(1)
prompts = [torch.randint(10, 100000, (n,), generator=gen).tolist() for n in torch.randint(64, 400, (64,), generator=gen)]
result = {}
stock = {}
with torch.no_grad():
    for impl in ("eager", "sdpa"):
        model.set_attn_implementation(impl)
        stock[impl] = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False,
                                      eos_token_id=None)[0, len(p):].tolist() for p in prompts[:8]]
model.set_attn_implementation("eager")
result["yardstick_first_diff"] = [first_diff(a, b) for a, b in zip(stock["sdpa"], stock["eager"])]
print("stock done", flush=True)
for backend in ("auto", "torch"):
    hfpaged.patch(model, attention_backend=backend)
    mine = [r.token_ids for r in model.generate_many(prompts[:8], max_new_tokens=24, do_sample=False, eos_token_id=None)]
    result[f"{backend}_first_diff_vs_eager"] = [first_diff(a, b) for a, b in zip(mine, stock["eager"])]
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = model.generate_many(prompts, max_new_tokens=64, do_sample=False, eos_token_id=None)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    result[f"{backend}_tok_s"] = sum(len(o.token_ids) for o in outs) / min(times)
    result[f"{backend}_triton"] = model._hfpaged.use_triton
    result[f"{backend}_graph_steps"] = model._hfpaged.engine.runner.num_graph_steps
    print(backend, {k: v for k, v in result.items() if k.startswith(backend)}, flush=True)
    hfpaged.unpatch(model)
print(json.dumps(result))
with open(sys.argv[1], "w") as f:
    json.dump(result, f, indent=1)
