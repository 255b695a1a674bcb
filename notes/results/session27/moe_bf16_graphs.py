"""Session 27 probe: do transformers' MoE experts replay from hfpaged's CUDA graphs in bf16 (grouped_mm), where
float32 falls back to a host-syncing expert loop? Tiny random Mixtral / Qwen3-MoE / OLMoE, default options."""

import sys

import torch

sys.path.insert(0, "tests")
from models import make_more_model, random_prompts, reference_generate  # noqa: E402

import hfpaged  # noqa: E402

for arch in ("mixtral", "qwen3_moe", "olmoe"):
    model = make_more_model(arch).to(device="cuda", dtype=torch.bfloat16)
    impl = getattr(model.config, "_experts_implementation", None)
    prompts = random_prompts([1, 5, 13, 30, 9, 40, 22, 3], seed=3)
    expected = reference_generate(model, prompts, max_new_tokens=32, do_sample=False)
    hfpaged.patch(model, num_blocks=64, block_size=8)
    got = [r.token_ids for r in model.generate_many(prompts, max_new_tokens=32, do_sample=False)]
    runner = model._hfpaged.engine.runner
    same = sum(g == e for g, e in zip(got, expected))
    first = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), None) for g, e in zip(got, expected)]
    print(f"{arch}: experts_implementation={impl} graph_steps={runner.num_graph_steps} "
          f"sequences equal to stock bf16 {same}/{len(prompts)} first differences {first}", flush=True)
