"""Session 35 probe: where the host time of an engine step goes on the GPU machine's CPU (helper probe35a's wrappers,
adapted). Llama-3.2-1B shape (random weights, bf16, default options), the benchmark's chat workload through
`hfpaged.Engine` (as examples/benchmark.py runs it); per-phase medians over decode-only steps, inclusive and self
times in us. python notes/results/session35/s35_phases.py [model] [reps]"""
import gc, statistics, sys, time
from collections import defaultdict

import torch

sys.path.insert(0, "examples")
import benchmark as B  # noqa: E402
import hfpaged  # noqa: E402
from hfpaged import engine as E  # noqa: E402
from hfpaged.core import kv_manager as KV, scheduler as SC  # noqa: E402
from hfpaged.model import input_batch as IB, runner as R  # noqa: E402
from hfpaged.sampling import sampler as SA  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1b"
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
cur, stack = defaultdict(float), []


def timed(f, label):
    def g(*a, **k):
        t = time.perf_counter()
        stack.append(0.0)
        try:
            return f(*a, **k)
        finally:
            dt = time.perf_counter() - t
            child = stack.pop()
            cur[label] += dt
            cur[label + "#self"] += dt - child
            if stack:
                stack[-1] += dt
    return g


W = [(R.ModelRunner, "execute", "runner.execute"), (IB.InputBatch, "update", "batch.update"),
     (IB.InputBatch, "pack", "batch.pack"), (R.ModelRunner, "_fill_pending", "runner._fill_pending"),
     (SA.Sampler, "sample", "sampler.sample"), (SA.StepResult, "result", "stepresult.result"),
     (SC.Scheduler, "schedule", "sched.schedule"), (SC.Scheduler, "_commit", "sched._commit"),
     (SC.Scheduler, "update_from_output", "sched.update_from_output"),
     (KV.KVManager, "register_computed", "kv.register_computed"), (KV.KVManager, "allocate", "kv.allocate"),
     (SC.Scheduler, "finish", "sched.finish"), (E.EngineCore, "step", "core.step"),
     (E.EngineCore, "step_for_clients", "core.step_for_clients"), (E.EngineCore, "_deliver", "core._deliver"),
     (E.Client, "step", "client.step"), (torch.cuda.CUDAGraph, "replay", "graph.replay")]
for owner, attr, label in W:
    if hasattr(owner, attr):
        setattr(owner, attr, timed(getattr(owner, attr), label))
for attr in ("check_stops", "step_outputs"):
    if hasattr(SC, attr):
        setattr(SC, attr, timed(getattr(SC, attr), "sched." + attr))
for attr in [a for a in dir(R.ModelRunner) if a.startswith("_") and not a.startswith("__")]:
    pass
last = {}
fsched = SC.Scheduler.schedule


def sched(self):
    out = fsched(self)
    last["tok"], last["n"] = sum(s.num_tokens for s in out.scheduled), len(out.scheduled)
    return out


SC.Scheduler.schedule = sched
model = B.build_model(name, torch.bfloat16)
hfpaged.patch(model)
prompts, out_lens = B.workload("chat", 256, model.config.vocab_size)
print("device", torch.cuda.get_device_name(), "model", name, flush=True)
for rep in range(reps):
    hfpaged.reset_prefix_cache(model)
    gc.collect()
    recs = []
    engine = hfpaged.Engine(model)
    for p, n in zip(prompts, out_lens):
        engine.add_request(p, max_new_tokens=n, do_sample=False, eos_token_id=None)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        cur.clear()
        t = time.perf_counter()
        engine.step()
        d = dict(cur)
        d["loop"] = time.perf_counter() - t
        d.update(last)
        recs.append(d)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    t = engine.core.timings
    print(f"rep {rep}: {sum(out_lens) / wall:,.0f} tok/s, steps {len(recs)}, waits {t['wait'] * 1e3 / t['steps']:.2f} ms/step")
    if rep == 0:
        continue
    dec = [r for r in recs if r.get("tok") == r.get("n") and r.get("n", 0) > 200]
    keys = sorted({k for r in recs for k in r if k not in ("tok", "n")})
    row = {k: statistics.median([r.get(k, 0.0) for r in dec]) * 1e6 for k in keys}
    row["host=loop-wait"] = row["loop"] - statistics.median(
        [r.get("stepresult.result", 0.0) for r in dec]) * 1e6
    print(f"  DECODE(median over {len(dec)} steps of > 200 rows): "
          + "  ".join(f"{k}={v:.0f}" for k, v in sorted(row.items()) if v >= 1), flush=True)
