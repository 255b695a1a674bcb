"""Time to first token inside the engine (no HTTP): an idle engine, then arrivals among 16 decoding requests.

    python examples/first_token_latency.py            # Qwen3-0.6B shape, random weights, bf16, GPU

For each prompt length it prints add_request -> first token (ms) and the host time of each step taken meanwhile
(the first step holds the prefill: a mixed-step CUDA graph since session 5, an eager forward before), then the
decode-only step times, and a cProfile of five mixed steps.
"""

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

import hfpaged
from hfpaged.engine import Engine


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        sys.exit("first_token_latency.py needs a CUDA GPU")
    model = build_model("qwen3-0.6b", torch.bfloat16)
    hfpaged.patch(model, max_num_seqs=256, gpu_memory_utilization=0.9)
    model.generate_many([[0] * 8], max_new_tokens=4, do_sample=False)
    engine = Engine(model)
    generator = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(100, 150000, (n,), generator=generator).tolist()

    def first_token(length, label):
        t0 = time.perf_counter()
        request_id = engine.add_request(ids(length), max_new_tokens=3, do_sample=False)
        steps, got = [], None
        while got is None:
            start = time.perf_counter()
            outputs = engine.step()
            steps.append((time.perf_counter() - start) * 1e3)
            if any(o.prompt_id == request_id and o.new_token_ids for o in outputs):
                got = time.perf_counter() - t0
        while label == "idle" and engine.has_unfinished():
            engine.step()
        print(
            f"{label:6s} len {length:4d}: first token {got * 1e3:7.1f} ms, steps " + " ".join(f"{x:.1f}" for x in steps)
        )

    for length in [37, 100, 255, 300, 511, 64, 129, 400, 37, 300]:
        first_token(length, "idle")
    background = [engine.add_request(ids(200), max_new_tokens=100000, do_sample=False) for _ in range(16)]
    for _ in range(20):
        engine.step()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    print("decode-only steps (16 seqs):", " ".join(f"{x:.1f}" for x in times))
    for length in [37, 100, 255, 300, 511, 64, 129, 400]:
        first_token(length, "mixed")
        for _ in range(5):
            engine.step()
    profile = cProfile.Profile()
    for _ in range(5):
        engine.add_request(ids(300), max_new_tokens=2, do_sample=False)
        profile.enable()
        engine.step()
        torch.cuda.synchronize()
        profile.disable()
        for _ in range(3):
            engine.step()
    for request_id in background:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
    print(text.getvalue())


if __name__ == "__main__":
    main()
