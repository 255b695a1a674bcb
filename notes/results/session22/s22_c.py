"""Probe C (session 22): decode rows of large mixed steps in a launch of their own, off / on alternating in one
process (``kernels.attention_config.MIXED_DECODE_MIN_TOKENS``: off = larger than any step; each setting a fresh
patch, so the graphs are captured with it).

python notes/results/session22/s22_c.py MODEL[,MODEL...] REPS [--dry-run]
Per model, repeat and setting: the chat workload (256 requests, 32-512 prompt tokens, 128 new; median of 3 runs on a
reset prefix cache, as benchmark.py times it) and the nano-vllm shape's first 64 requests; greedy tokens of the two
settings compared.
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

DRY = "--dry-run" in sys.argv
ON = attention_config.MIXED_DECODE_MIN_TOKENS


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    names, reps = args[0].split(","), int(args[1])
    for name in names:
        model = probe_model(name, DRY)
        vocab = model.config.vocab_size
        chat = benchmark.workload("chat", 256 if not DRY else 4, vocab)
        nano = benchmark.workload("nano", 64 if not DRY else 2, vocab)
        if DRY:
            attention_config.MIXED_DECODE_MIN_TOKENS = 8
            chat = ([p[:40] for p in chat[0]], [3] * 4)
            nano = ([p[:40] for p in nano[0]], [3] * 2)
        on_value = attention_config.MIXED_DECODE_MIN_TOKENS
        tokens = {}
        for rep in range(reps):
            for on in (False, True):
                attention_config.MIXED_DECODE_MIN_TOKENS = on_value if on else 1 << 30
                t = time.perf_counter()
                hfpaged.patch(model, compile=None if not DRY else False)
                benchmark.run_hfpaged(model, *chat)  # warm-up
                _, _, engine, runs = benchmark.timed_runs(model, *chat, repeats=3)
                hfpaged.reset_prefix_cache(model)
                t1 = time.perf_counter()
                out = model.generate_many(
                    [{"prompt": p, "max_new_tokens": n} for p, n in zip(*nano)], do_sample=False, eos_token_id=None
                )
                nano_tps = sum(len(r.token_ids) for r in out) / (time.perf_counter() - t1)
                hfpaged.reset_prefix_cache(model)
                chat_out = model.generate_many(chat[0], max_new_tokens=chat[1][0], do_sample=False, eos_token_id=None)
                tokens.setdefault(on, [r.token_ids for r in chat_out] + [r.token_ids for r in out])
                hfpaged.unpatch(model)
                print(f"[{name}] rep {rep} two launches={on}: chat {sorted(runs)[1]:,.0f} tok/s (runs "
                      f"{', '.join(f'{r:,.0f}' for r in runs)}); nano x {len(nano[0])} {nano_tps:,.0f} tok/s "
                      f"({time.perf_counter() - t:.0f} s)", flush=True)  # fmt: skip
        same = sum(a == b for a, b in zip(tokens[False], tokens[True]))
        print(f"[{name}] greedy outputs equal with one and two launches: {same} of {len(tokens[True])}", flush=True)
        del model
        if not DRY:
            torch.cuda.empty_cache()
    attention_config.MIXED_DECODE_MIN_TOKENS = ON


if __name__ == "__main__":
    main()
