"""Probe B (session 23): the short-prompt tile and the mixed graphs' short-prompt variants, in the engine, settings
alternating in one process (each setting a fresh patch, so the graphs are captured with it).

python notes/results/session23/s23_b.py MODEL[,MODEL...] REPS [--nano] [--settings old,tile,new] [--dry-run]
Settings: "old" = session 22's prompt tiles (128 x 32 / 4 warps for runs of <= 1,536 tokens, no variants), "tile" =
session 23's prompt tiles only (graphs of buckets above 1,536 tokens still bake the long tile for 128-dim heads),
"new" = the tiles and the variants. Per model,
repeat and setting: the chat workload (256 requests, 32-512 prompt tokens, 128 new; median of 3 runs on a reset
prefix cache, as benchmark.py times it); with --nano also the nano-vllm shape's first 64 requests; greedy tokens of
the settings compared with the first.
"""

import os
import sys
import time

import torch

sys.path.insert(0, "examples")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "session20"))  # _probe.py
import benchmark  # noqa: E402

import hfpaged  # noqa: E402
from _probe import probe_model  # noqa: E402
from hfpaged.kernels import attention_config  # noqa: E402
from hfpaged.model import runner as runner_module  # noqa: E402

DRY = "--dry-run" in sys.argv
NEW_TILE, HINT = attention_config.prompt_tile, runner_module.short_prompt_hint


def old_prompt_tile(max_seqlen_q, group, head_dim_pad, elem_size):
    """Session 22's prompt tiles."""
    if elem_size == 4:
        tile = (64, 32, 4, 2) if head_dim_pad <= 128 else (32, 32, 4, 2)
    elif head_dim_pad <= 128:
        tile = (128, 128, 8, 3) if max_seqlen_q > 1536 else (128, 32, 4, 3)
    else:
        tile = (64, 64, 4, 2)
    return (max(tile[0], 1 << (group - 1).bit_length()), *tile[1:])


SETTINGS = {
    "old": (old_prompt_tile, lambda layers: None),
    "tile": (NEW_TILE, lambda layers: None),
    "new": (NEW_TILE, HINT),
}


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    names, reps = args[0].split(","), int(args[1])
    for name in names:
        model = probe_model(name, DRY)
        vocab = model.config.vocab_size
        chat = benchmark.workload("chat", 256 if not DRY else 4, vocab)
        nano = benchmark.workload("nano", 64 if not DRY else 2, vocab)
        if DRY:
            chat = ([p[:40] for p in chat[0]], [3] * 4)
            nano = ([p[:40] for p in nano[0]], [3] * 2)
        tokens = {}
        chosen = sys.argv[sys.argv.index("--settings") + 1].split(",") if "--settings" in sys.argv else list(SETTINGS)
        for rep in range(reps):
            for setting in chosen:
                tile, hint = SETTINGS[setting]
                attention_config.prompt_tile, runner_module.short_prompt_hint = tile, hint
                t = time.perf_counter()
                hfpaged.patch(model, compile=None if not DRY else False)
                benchmark.run_hfpaged(model, *chat)  # warm-up
                _, _, engine, runs = benchmark.timed_runs(model, *chat, repeats=3)
                line = f"[{name}] rep {rep} {setting:4}: chat {sorted(runs)[1]:,.0f} tok/s (runs "
                line += ", ".join(f"{r:,.0f}" for r in runs) + ")"
                outs = []
                if "--nano" in sys.argv:
                    hfpaged.reset_prefix_cache(model)
                    t1 = time.perf_counter()
                    out = model.generate_many(
                        [{"prompt": p, "max_new_tokens": n} for p, n in zip(*nano)], do_sample=False, eos_token_id=None
                    )
                    line += f"; nano x {len(nano[0])} {sum(len(r.token_ids) for r in out) / (time.perf_counter() - t1):,.0f} tok/s"
                    outs = [r.token_ids for r in out]
                hfpaged.reset_prefix_cache(model)
                chat_out = model.generate_many(chat[0], max_new_tokens=chat[1][0], do_sample=False, eos_token_id=None)
                tokens.setdefault(setting, [r.token_ids for r in chat_out] + outs)
                mixed = model._hfpaged.engine.runner.mixed_graphs
                variants = sorted(mixed.short_graphs) if mixed is not None else None
                hfpaged.unpatch(model)
                print(f"{line}; variants {variants} ({time.perf_counter() - t:.0f} s)", flush=True)
        first = tokens[chosen[0]]
        for setting in chosen[1:]:
            same = sum(a == b for a, b in zip(first, tokens[setting]))
            print(f"[{name}] greedy outputs of {setting} equal to {chosen[0]}: {same} of {len(first)}", flush=True)
        del model
        if not DRY:
            torch.cuda.empty_cache()
    attention_config.prompt_tile, runner_module.short_prompt_hint = NEW_TILE, HINT


if __name__ == "__main__":
    main()
