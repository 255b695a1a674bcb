"""Probe A (session 17): host time of one CUDA-graph replay of a decode step, and the chat workload, per option.

python notes/results/session17/s17_a.py MODEL [VARIANT ...]   (variants: default nopdl eager_layers)
Prints, per variant: the host seconds graph.replay() takes with the device idle (synchronized before each call)
and with replays queued back to back, the device time of a replay, then Llama-style chat (256 requests,
U[32, 512] prompt tokens, 128 new) tok/s with the engine's host phases.
"""

import sys
import time

import torch

sys.path.insert(0, "examples")
from benchmark import build_model, run_hfpaged, workload  # noqa: E402

import hfpaged  # noqa: E402

VARIANTS = {"default": {}, "nopdl": {"dependent_launch": False}, "eager_layers": {"compile": False}}


def replay_host_times(engine, batch=256, context=320):
    gen = torch.Generator().manual_seed(0)
    for _ in range(batch):
        engine.add_request(torch.randint(10, 1000, (context,), generator=gen).tolist(), max_new_tokens=64,
                           do_sample=False, eos_token_id=None)
    for _ in range(12):
        engine.step()
    torch.cuda.synchronize()
    runner = engine.runner
    bucket = runner.graphs.bucket_for(batch, batch)
    graph = runner.graphs.graphs[bucket]
    idle = []
    for _ in range(10):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        idle.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    t = time.perf_counter()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    queued_host = (time.perf_counter() - t) / 10
    end.record()
    torch.cuda.synchronize()
    engine.abort_all()
    while engine.has_unfinished():
        engine.step()
    return sorted(idle)[len(idle) // 2], queued_host, start.elapsed_time(end) / 10 / 1e3


def main():
    name = sys.argv[1]
    variants = sys.argv[2:] or list(VARIANTS)
    model = build_model(name, torch.bfloat16)
    prompts, outs = workload("chat", 256, model.config.vocab_size)
    for variant in variants:
        hfpaged.patch(model, **VARIANTS[variant])
        run_hfpaged(model, prompts[:16], [16] * 16)
        engine = hfpaged.Engine(model)
        idle, queued, device = replay_host_times(engine)
        print(f"[{name} {variant}] decode graph b256: replay host {idle * 1e3:.3f} ms (device idle), "
              f"{queued * 1e3:.3f} ms (queued), device {device * 1e3:.3f} ms", flush=True)
        for rep in range(2):
            hfpaged.reset_prefix_cache(model)
            tokens, dt, _, eng = run_hfpaged(model, prompts, outs)
            steps = eng.core.timings["steps"]
            phases = ", ".join(f"{k} {v / steps * 1e3:.2f}" for k, v in eng.core.timings.items() if k != "steps")
            print(f"[{name} {variant}] chat run {rep}: {tokens / dt:,.0f} tok/s, {steps:.0f} steps; per step ms: {phases}",
                  flush=True)
        hfpaged.unpatch(model)


if __name__ == "__main__":
    main()
