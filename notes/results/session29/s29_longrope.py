"""Session 29: a Phi-3.5-mini-shaped model with LongRoPE past its 4,096-token original length (random weights).

1. float32, 4 layers, default options (graphs, compiled layers): greedy tokens vs stock generate for prompts below,
   across and past L (the Phi-3 restart path and the long-prompt path), and the same with Llama's class (per-token).
2. bf16, 32 layers: throughput of hfpaged with longrope vs the same model with plain RoPE (expected: within ~2%;
   the rotary module runs both sets eagerly inside the graphs), on 16 prompts of 5-7k tokens x 128 new (long at
   every position) and on 64 prompts of 200-500 tokens x 128 new (short: decode-heavy steps).
"""
import json, os, sys, time
import torch
import transformers
from transformers import AutoModelForCausalLM
import hfpaged

OUT = os.environ.get("OUT", "/tmp")
SMOKE = not torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(0)
short = [1.0 + 0.002 * i for i in range(48)]
long = [1.0 + 1.2 * i for i in range(48)]
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, short_factor=short, long_factor=long,
                original_max_position_embeddings=4096)


def phi3(layers, dtype, rope=True, cls="Phi3Config"):
    size = dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=32)
    if SMOKE:  # a CPU check of the script itself: head_dim 96 kept
        size = dict(hidden_size=192, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2)
    kw = dict(vocab_size=32064, num_hidden_layers=layers, max_position_embeddings=131072, **size,
              initializer_range=0.02, pad_token_id=32000, eos_token_id=None, bos_token_id=1)
    if cls == "Phi3Config":
        kw.update(original_max_position_embeddings=4096, sliding_window=262144)
    if rope:
        kw["rope_parameters"] = dict(LONGROPE)
    config = getattr(transformers, cls)(**kw)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def prompts_of(lengths):
    return [torch.randint(100, 32000, (n,), generator=gen).tolist() for n in lengths]


def exactness():
    res = {}
    for cls in ("Phi3Config", "LlamaConfig"):
        model = phi3(4, torch.float32, cls=cls)
        prompts = prompts_of([1000, 4085, 4096, 4100, 5000])
        hfpaged.patch(model, max_num_batched_tokens=2048)
        if model._hfpaged.long_rope.crossing == "drop":  # transformers < 5.20: requests crossing L are refused
            try:
                model.generate_many(prompts, max_new_tokens=24, do_sample=False)
                refused = None
            except ValueError as error:
                refused = str(error)
            print("refused:", refused, flush=True)
            prompts = [p for p in prompts if len(p) > 4096 or len(p) + 24 <= 4097]
        hfpaged.unpatch(model)
        want = []
        for p in prompts:
            with torch.no_grad():
                out = model.generate(torch.tensor([p], device=DEVICE), max_new_tokens=24, do_sample=False)
            want.append(out[0, len(p):].tolist())
        hfpaged.patch(model, max_num_batched_tokens=2048)
        st = model._hfpaged
        got = [r.token_ids for r in model.generate_many(prompts, max_new_tokens=24, do_sample=False)]
        runner = st.engine.runner
        res[cls] = dict(lengths=[len(p) for p in prompts], equal=[g == w for g, w in zip(got, want)],
                        crossing=st.long_rope.crossing,
                        graph_steps=runner.num_graph_steps, eager_steps=runner.num_eager_steps,
                        distinct=[len(set(w)) for w in want])
        print(cls, res[cls], flush=True)
        hfpaged.unpatch(model)
        del model
        if not SMOKE:
            torch.cuda.empty_cache()
    return res


def throughput():
    res = {}
    workloads = {"long_prompts": ([int(x) for x in torch.randint(5000, 7001, (16,), generator=gen)], 128),
                 "short_prompts": ([int(x) for x in torch.randint(200, 501, (64,), generator=gen)], 128)}
    for rope in (True, False):
        model = phi3(32, torch.bfloat16, rope=rope)
        hfpaged.patch(model, **({"num_blocks": 4096} if SMOKE else {}))
        model.generate_many(prompts_of([300] * 8), max_new_tokens=16, do_sample=False)  # warm-up
        for name, (lengths, new) in workloads.items():
            prompts = prompts_of(lengths)
            model.generate_many(prompts[:4], max_new_tokens=8, do_sample=False)
            hfpaged.reset_prefix_cache(model)
            t0 = time.perf_counter()
            out = model.generate_many(prompts, max_new_tokens=new, do_sample=False)
            if not SMOKE:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            n = sum(len(r.token_ids) for r in out)
            runner = model._hfpaged.engine.runner
            key = f"{name}:{'longrope' if rope else 'plain'}"
            res[key] = dict(seconds=dt, out_tok_s=n / dt, all_tok_s=(n + sum(lengths)) / dt,
                            graph_steps=runner.num_graph_steps, eager_steps=runner.num_eager_steps,
                            preemptions=hfpaged.stats(model)["num_preemptions"])
            print(key, json.dumps(res[key]), flush=True)
        hfpaged.unpatch(model)
        del model
        if not SMOKE:
            torch.cuda.empty_cache()
    return res


if __name__ == "__main__":
    results = {"device": torch.cuda.get_device_name() if not SMOKE else "cpu", "transformers": transformers.__version__}
    if "exact" in sys.argv[1:]:
        results["exactness"] = exactness()
    if "speed" in sys.argv[1:]:
        results["throughput"] = throughput()
    with open(os.path.join(OUT, "s29_longrope.json"), "w") as f:
        json.dump(results, f, indent=2)
