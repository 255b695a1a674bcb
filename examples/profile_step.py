"""Where does a decode step's time go? Host phases (cProfile) and device kernels (torch profiler).

    python examples/profile_step.py --model qwen3-0.6b --batch 256 --context 1024 --compile --out prof_out

Builds a random-weight model in a real shape (see benchmark.py), fills the engine with ``--batch``
requests of ``--context`` prompt tokens, then profiles ``--steps`` decode steps: a cProfile of the
host side, a torch-profiler table of device kernels, and a graph-replay-only timing.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from benchmark import build_model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="prof_out")
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="patch(compile=...): default None (compiled layers on CUDA); --no-compile: eager layers",
    )
    parser.add_argument("--no-async", action="store_true", help="async_scheduling=False (read tokens every step)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_step.py needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    import hfpaged

    model = build_model(args.model, torch.bfloat16)
    hfpaged.patch(model, max_num_seqs=max(args.batch), compile=args.compile, async_scheduling=not args.no_async)
    for batch in args.batch:
        engine = hfpaged.Engine(model)
        gen = torch.Generator().manual_seed(0)
        for _ in range(batch):
            prompt = torch.randint(10, 1000, (args.context,), generator=gen).tolist()
            engine.add_request(prompt, max_new_tokens=10_000, do_sample=False, eos_token_id=None)
        while (
            any(r.num_tokens - r.num_computed_tokens > 1 for r in engine.core.scheduler.running)
            or engine.core.scheduler.waiting
        ):
            engine.step()
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        engine.core.timings.clear()
        t0 = time.perf_counter()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            engine.step()
        profiler.disable()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("cumulative").print_stats(35)
        steps = engine.core.timings["steps"]
        print(f"\n=== batch {batch}, context ~{args.context}: {wall * 1e3:.2f} ms/step wall (under cProfile) ===")
        print(
            "phases (ms/step): "
            + ", ".join(f"{k} {v / steps * 1e3:.2f}" for k, v in engine.core.timings.items() if k != "steps")
        )
        with open(os.path.join(args.out, f"cprofile_b{batch}.txt"), "w") as f:
            f.write(stream.getvalue())
        print("\n".join(stream.getvalue().splitlines()[:60]))

        # wall time without cProfile, then the same steps with the other async_scheduling setting
        config = engine.core.state.config
        for overlap in (config.async_scheduling, not config.async_scheduling):
            saved, config.async_scheduling = config.async_scheduling, overlap
            engine.core.timings.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / args.steps
            config.async_scheduling = saved
            print(
                f"batch {batch}: {wall * 1e3:.2f} ms/step wall with async_scheduling={overlap}; phases (ms/step): "
                + ", ".join(
                    f"{k} {v / engine.core.timings['steps'] * 1e3:.2f}"
                    for k, v in engine.core.timings.items()
                    if k != "steps"
                )
            )

        # device kernels
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                engine.step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        with open(os.path.join(args.out, f"kernels_b{batch}.txt"), "w") as f:
            f.write(table)
        print(table)

        # graph replay alone
        runner = engine.runner
        if runner.graphs is not None:
            bucket = runner.graphs.bucket_for(batch, batch)  # a decode step: batch tokens, batch requests
            graph = runner.graphs.graphs[bucket]
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            print(f"batch {batch}: graph replay alone {start.elapsed_time(end) / 20:.3f} ms (bucket {bucket})")
        engine.abort_all()


if __name__ == "__main__":
    main()
