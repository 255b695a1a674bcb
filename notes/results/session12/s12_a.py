"""Session 12 probe: (1) argmax variants for few long rows; (2) Inductor combo kernels A/B (batch-1 and batch-256)."""
import json, os, sys, time, traceback
sys.path.insert(0, "examples")
import torch
import benchmark as bm
import hfpaged
from hfpaged.sampling.sampler import row_argmax

OUT = os.environ.get("OUT", ".")
res = {"argmax": {}, "combo": {}}


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


try:
    for vocab in (151936, 128256):
        for dtype in (torch.bfloat16, torch.float32):
            for rows in (1, 4, 16):
                x = torch.randn(rows, vocab, device="cuda").to(dtype)
                x[:, 1000] = x.max() + 1  # a tie pair: the first must win
                x[:, 90000] = x[:, 1000]
                ref = x.argmax(dim=-1)
                key = f"{vocab}_{str(dtype)[6:]}_{rows}"
                entry = {"plain": (graph_us(lambda: x.argmax(dim=-1)), eager_us(lambda: x.argmax(dim=-1)))}
                for C in (64, 128, 256, 512, 1024, 2048):
                    got = chunked(x, C)
                    assert torch.equal(got, ref), (key, C)
                    entry[f"c{C}"] = (graph_us(lambda: chunked(x, C)), eager_us(lambda: chunked(x, C)))
                assert torch.equal(row_argmax(x), ref)
                res["argmax"][key] = entry
                print("argmax", key, {k: (round(v[0], 1), round(v[1], 1)) for k, v in entry.items()}, flush=True)
except Exception:
    traceback.print_exc()


def b256(model, n=256, prompt=128, new=128):
    prompts = [list(range(100 + i % 7, 100 + i % 7 + prompt)) for i in range(n)]
    model.generate_many(prompts[:8], max_new_tokens=4, do_sample=False)
    torch.cuda.synchronize()
    t = time.perf_counter()
    model.generate_many(prompts, max_new_tokens=new, do_sample=False, eos_token_id=None)
    torch.cuda.synchronize()
    return n * new / (time.perf_counter() - t)


for name in sys.argv[1:]:
    model = bm.build_model(name, torch.bfloat16)
    for label, combo in (("default", False), ("combo", True), ("default_again", False), ("combo_again", True)):
        try:
            torch._dynamo.reset()
            torch._inductor.config.combo_kernels = combo
            hfpaged.patch(model, max_num_seqs=256, compile_cache_dir="")
            t = time.perf_counter()
            bm.batch1_latency(model, new_tokens=16)
            warm = time.perf_counter() - t
            ms = [bm.batch1_latency(model) for _ in range(3)]
            tps = b256(model)
            res["combo"][f"{name}_{label}"] = {"ms": ms, "b256_tok_s": tps, "first_s": warm}
            print(name, label, res["combo"][f"{name}_{label}"], flush=True)
        except Exception:
            traceback.print_exc()
        finally:
            try:
                hfpaged.unpatch(model)
            except Exception:
                traceback.print_exc()
    del model
    torch.cuda.empty_cache()
torch._inductor.config.combo_kernels = False
json.dump(res, open(os.path.join(OUT, "s12_a.json"), "w"), indent=1)
