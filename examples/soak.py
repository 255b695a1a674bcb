"""Soak: many short requests through one patched model; host RSS, GPU memory, free blocks and the engine's
per-request bookkeeping after every wave, to show none of them grows (random weights in a real shape).

    python examples/soak.py --model qwen3-0.6b --requests 100000 --wave 5000 --out soak_out
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import time

import torch
from benchmark import MODELS, build_model

import hfpaged
from hfpaged.testing import soak


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODELS))
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--wave", type=int, default=5_000)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(8, 32))
    parser.add_argument("--new-tokens", type=int, nargs=2, default=(1, 8))
    parser.add_argument("--out", default="soak_out")
    args = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid>: where is it now?
    os.makedirs(args.out, exist_ok=True)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    model = build_model(args.model, dtype)
    hfpaged.patch(model)
    t0 = time.perf_counter()
    model.generate_many([[10] * 16] * 64, max_new_tokens=4)  # warm-up: kernels and graphs
    print(f"warm-up {time.perf_counter() - t0:.1f} s", flush=True)

    def show(s: dict) -> None:
        gpu = (
            f", GPU allocated {s['gpu_allocated_mib']:.0f} MiB reserved {s['gpu_reserved_mib']:.0f} MiB"
            if "gpu_allocated_mib" in s
            else ""
        )
        print(
            f"{s['requests']:>7} requests {s['seconds']:7.1f} s: RSS {s['rss_mib']:.0f} MiB{gpu}, "
            f"free blocks {s['free_blocks']}/{s['num_blocks']}, unfinished {s['unfinished_requests']}, "
            f"runner states {s['runner_states']}",
            flush=True,
        )

    report = soak(
        model,
        num_requests=args.requests,
        wave=args.wave,
        prompt_len=tuple(args.prompt_len),
        new_tokens=tuple(args.new_tokens),
        on_wave=show,
    )
    report.update(
        model=args.model, dtype=str(dtype), stats=hfpaged.stats(model), timings=dict(model._hfpaged.engine.timings)
    )
    first, last = report["samples"][min(1, len(report["samples"]) - 1)], report["samples"][-1]
    print(
        f"{report['num_requests']} requests, {report['tokens']} tokens in {report['seconds']:.1f} s "
        f"({report['tokens_per_s']:,.0f} tok/s); RSS from wave 2 to the end: {first['rss_mib']:.0f} -> "
        f"{last['rss_mib']:.0f} MiB"
    )
    with open(os.path.join(args.out, f"soak_{args.model}.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
