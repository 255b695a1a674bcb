"""Probe C (session 17): host work per step of the engine without its forward, on the CPU (tiny Llama, 1 layer, so
the forward is cheap and subtracted): chat (256 requests, U[32, 512] prompts, 128 new) and churn (1,000 requests of
U[16, 64] in and out). Prints the host ms per step of repeats 1.. and a checksum of the tokens (equal across trees).

PYTHONPATH=<tree> python notes/results/session17/s17_c.py
"""

import zlib, sys, time, torch, functools, gc
from transformers import LlamaConfig, AutoModelForCausalLM
import hfpaged
from hfpaged.model import runner as R
acc = [0.0]
f = R.ModelRunner.forward
def g(*a, **k):
    t = time.perf_counter()
    try: return f(*a, **k)
    finally: acc[0] += time.perf_counter() - t
R.ModelRunner.forward = g
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
model = AutoModelForCausalLM.from_config(cfg).eval()
hfpaged.patch(model, num_blocks=40000, block_size=16, max_num_seqs=256, max_num_batched_tokens=8192)
res = {}
for kind, n in (("chat", 256), ("churn", 1000)):
    gen = torch.Generator().manual_seed(0)
    if kind == "chat":
        in_lens = torch.randint(32, 513, (n,), generator=gen).tolist(); out_lens = [128] * n
    else:
        in_lens = torch.randint(16, 65, (n,), generator=gen).tolist(); out_lens = torch.randint(16, 65, (n,), generator=gen).tolist()
    prompts = [torch.randint(10, 990, (k,), generator=gen).tolist() for k in in_lens]
    outs = []
    for rep in range(6):
        engine = hfpaged.Engine(model)
        for p, m in zip(prompts, out_lens):
            engine.add_request(p, max_new_tokens=m, do_sample=False, eos_token_id=None)
        acc[0] = 0.0; t = time.perf_counter(); steps = 0; toks = []
        while engine.has_unfinished():
            for o in engine.step(): toks.append((o.request_id, tuple(o.new_token_ids)))
            steps += 1
        dt = time.perf_counter() - t
        if rep: outs.append((dt - acc[0]) / steps * 1e3)
    res[kind] = (min(outs), hash(tuple(toks)))
    print(f"{kind}: host excl. forward per step ms: {' '.join(f'{x:.3f}' for x in outs)}  tokens-crc {zlib.crc32(repr(sorted(toks)).encode())}")
