"""Probe D (session 19): batch-1 decode ms/token with the GEMV (gemv=None: on with dependent launch) and without.

python notes/results/session19/s19_d.py MODEL[,MODEL...] REPS [--dry-run]
One process per call; per model: off / on alternating REPS times (a fresh patch each), benchmark.batch1_latency
(prompt 128 tokens, 256 new), plus the decode capture time and how far the greedy tokens of gemv on and off agree.
"""

import sys
import time

import torch

sys.path.insert(0, "examples")
import benchmark  # noqa: E402

import hfpaged  # noqa: E402

DRY = "--dry-run" in sys.argv


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    names, reps = args[0].split(","), int(args[1])
    if DRY:
        torch.cuda.synchronize = lambda *a, **k: None
    for name in names:
        if DRY:
            from transformers import AutoModelForCausalLM, LlamaConfig

            torch.manual_seed(0)
            cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
            model = AutoModelForCausalLM.from_config(cfg).half().eval()
        else:
            model = benchmark.build_model(name, torch.bfloat16)
        tokens = {}
        for rep in range(reps):
            for gemv in (False, None) if not DRY else (False, True):
                t = time.perf_counter()
                hfpaged.patch(model, gemv=gemv)
                patch_s = time.perf_counter() - t
                fused = model._hfpaged.fused_projections
                ms = benchmark.batch1_latency(model, new_tokens=256 if not DRY else 4)
                runner = model._hfpaged.engine.runner
                buckets = runner.graphs.buckets[:3] if runner.graphs is not None else None
                out = model.generate_many([list(range(200, 264))], max_new_tokens=64 if not DRY else 4,
                                          do_sample=False, eos_token_id=None)[0].token_ids  # fmt: skip
                tokens[gemv] = out
                print(f"[{name}] rep {rep} gemv={gemv}: {ms:.3f} ms/token; {fused.num_gemv} projections by the GEMV; "
                      f"decode buckets {buckets}; patch {patch_s:.1f} s, decode capture "
                      f"{runner.capture_seconds['decode']:.1f} s", flush=True)  # fmt: skip
                hfpaged.unpatch(model)
        a, b = list(tokens.values())
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"[{name}] greedy tokens of gemv on and off agree on the first {same} of {len(a)}", flush=True)
        del model
        if not DRY:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
