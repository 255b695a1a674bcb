"""Probe A (session 20): where a batch-1 decode step's time goes, as each kernel's share of the critical path.

python notes/results/session20/s20_a.py MODEL[,MODEL...] OUTDIR [--dry-run]
Per model (default options): one request of 128 prompt tokens decodes to ~200 tokens of context; ms/token of
the engine and of the 1-row graph replayed alone; then the torch profiler's trace of 10 replays of that graph.
With dependent launch, kernels overlap and a kernel's duration includes time spent waiting on the one before,
so each kernel is charged its *marginal* time: how far its end lies past the latest end of the kernels before it
(in start order). Summed per kernel name over the steps, divided by the steps: us per step, and per call.
"""

import collections
import json
import os
import re
import sys

import torch

sys.path.insert(0, "examples")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchmark  # noqa: E402

from _probe import probe_model  # noqa: E402

DRY = "--dry-run" in sys.argv


def short(name):
    name = re.sub(r"<.*", "", name)
    if name.startswith("triton_"):
        name = re.sub(r"_\d+$", "", name)
        return name[:90]
    return name[:90]


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    names, out = args[0].split(","), args[1]
    os.makedirs(out, exist_ok=True)
    import hfpaged.kernels

    print(f"hfpaged from {hfpaged.__file__}, kernels from {hfpaged.kernels.__file__}", flush=True)
    for name in names:
        model = probe_model(name, DRY)
        hfpaged.patch(model)
        ms = benchmark.batch1_latency(model, new_tokens=256 if not DRY else 4)
        print(f"[{name}] engine batch-1: {ms:.3f} ms/token", flush=True)
        if DRY:
            continue
        engine = hfpaged.Engine(model)
        engine.add_request(list(range(100, 228)), max_new_tokens=400, do_sample=False, eos_token_id=None)
        for _ in range(70):
            engine.step()
        runner = engine.runner
        bucket = runner.graphs.bucket_for(1, 1)
        graph = runner.graphs.graphs[bucket]
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        replay_ms = start.elapsed_time(end) / 50
        print(f"[{name}] graph replay alone (bucket {bucket}): {replay_ms:.3f} ms", flush=True)
        from torch.profiler import ProfilerActivity, profile

        steps = 10
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                graph.replay()
                torch.cuda.synchronize()
        path = os.path.join(out, f"trace_{name}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
        events.sort(key=lambda e: e["ts"])
        marginal = collections.defaultdict(float)
        durs = collections.defaultdict(float)
        count = collections.Counter()
        latest = None
        total = 0.0
        order = []
        for e in events:
            t0, t1 = e["ts"], e["ts"] + e["dur"]
            if latest is None or t0 > latest + 50:  # a new replay (synchronized between replays)
                latest = t0
            m = max(0.0, t1 - latest)
            latest = max(latest, t1)
            k = short(e["name"])
            marginal[k] += m
            durs[k] += e["dur"]
            count[k] += 1
            total += m
            if len(order) < 40:
                order.append(k)
        lines = [f"[{name}] critical path {total / steps:.1f} us per replay (replay alone {replay_ms * 1e3:.1f} us)"]
        lines.append(f"{'kernel':90s} {'calls':>6s} {'us/step':>9s} {'us/call':>8s} {'dur/call':>9s}")
        for k, v in sorted(marginal.items(), key=lambda kv: -kv[1]):
            lines.append(f"{k:90s} {count[k] / steps:6.0f} {v / steps:9.1f} {v / count[k]:8.2f} {durs[k] / count[k]:9.2f}")
        lines.append("first kernels of a replay: " + " | ".join(order))
        text = "\n".join(lines)
        print(text, flush=True)
        with open(os.path.join(out, f"critical_{name}.txt"), "w") as f:
            f.write(text + "\n")
        os.remove(path)
        engine.abort_all()
        hfpaged.unpatch(model)
        del model, engine, graph
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
