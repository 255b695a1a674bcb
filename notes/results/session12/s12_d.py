"""Session 12: Triton row_argmax vs torch (graph and eager timing), and batch-1 latency new vs old in one process."""
import json, os, sys, time, traceback
sys.path.insert(0, "examples")
import torch
import benchmark as bm
import hfpaged
import hfpaged.sampling.sampler as smp
from hfpaged.kernels.argmax import row_argmax as tri

OUT = os.environ.get("OUT", ".")
res = {"argmax": {}, "batch1": {}}


def cdiv(a, b):
    return -(-a // b)


def chunked(scores, C):
    rows, vocab = scores.shape
    width = cdiv(vocab, C)
    if width * C != vocab:
        scores = torch.nn.functional.pad(scores, (0, width * C - vocab), value=float("-inf"))
    values, index = scores.view(rows, C, width).max(dim=-1)
    chunk = values.argmax(dim=-1, keepdim=True)
    return (chunk * width + index.gather(1, chunk))[:, 0]


def graph_us(fn, inner=20, outer=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(outer):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (inner * outer)


def eager_us(fn, n=300):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e6 / n




import hfpaged.model.cuda_graphs as cg


def old_fn(scores):
    rows, vocab = scores.shape
    if rows >= 32 or vocab < 4096:
        return scores.argmax(dim=-1)
    return chunked(scores, 64)


new_fn = smp.row_argmax
for name in sys.argv[1:]:
    model = bm.build_model(name, torch.bfloat16)
    for label in ("in_graph", "eager_old", "in_graph2", "eager_old2"):
        old = label.startswith("eager_old")
        cg.FEW_ROWS = 0 if old else smp.FEW_ROWS
        smp.row_argmax = old_fn if old else new_fn
        hfpaged.patch(model, max_num_seqs=256)
        bm.batch1_latency(model, new_tokens=16)
        ms = [bm.batch1_latency(model) for _ in range(3)]
        g = model._hfpaged.engine.runner.graphs
        res["batch1"][f"{name}_{label}"] = ms
        print(name, label, [round(m, 4) for m in ms], "greedy buckets", sum(v is not None for v in g.greedy.values()), flush=True)
        hfpaged.unpatch(model)
    cg.FEW_ROWS = smp.FEW_ROWS
    smp.row_argmax = new_fn
    del model
    torch.cuda.empty_cache()
json.dump(res, open(os.path.join(OUT, "s12_d.json"), "w"), indent=1)
