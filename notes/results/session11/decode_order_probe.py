"""Decode attention over sequences of mixed lengths: does the order of the sequences (program order) matter?"""
import os, sys, json, math
import torch
sys.path.insert(0, "examples")
import sweep_fp8_decode as sw
from hfpaged.kernels.attention_config import choose_config

dev = "cuda"
torch.manual_seed(0)
H, KVH, D, BS = 16, 8, 128, 16
rows = []
for kv in (torch.bfloat16, torch.float8_e4m3fn):
    for batch, lo, hi in ((256, 100, 2048), (256, 200, 1200), (128, 100, 4096), (64, 100, 2048)):
        lens = torch.randint(lo, hi + 1, (batch,))
        blocks = [math.ceil(int(l) / BS) for l in lens]
        total_blocks = sum(blocks)
        sets = max(1, min(16, math.ceil((256 << 20) / (total_blocks * BS * KVH * D * 2 * kv.itemsize))))
        nb = total_blocks * sets
        shape = (nb, BS, KVH, D)
        if kv.itemsize == 1:
            kc = (torch.randn(shape, device=dev) * 8).to(kv); vc = (torch.randn(shape, device=dev) * 8).to(kv)
            ks = torch.full((1,), 1 / 8, device=dev); vs = ks
        else:
            kc = torch.randn(shape, device=dev, dtype=kv); vc = torch.randn(shape, device=dev, dtype=kv); ks = vs = None
        perm = torch.randperm(nb, device=dev).to(torch.int32)
        maxb = max(blocks)
        def tables_for(order, s):
            t = torch.zeros(batch, maxb, dtype=torch.int32, device=dev)
            off = s * total_blocks
            starts = torch.tensor([0] + list(torch.tensor(blocks).cumsum(0)[:-1]))
            for r, i in enumerate(order):
                t[r, : blocks[i]] = perm[off + starts[i] : off + starts[i] + blocks[i]]
            return t
        qs = [torch.randn(batch, H, D, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
        cu = torch.arange(batch + 1, device=dev, dtype=torch.int32)
        cfg = choose_config(num_tokens=batch, num_seqs=batch, num_kv_heads=KVH, group=2, head_dim_pad=128,
                            elem_size=2, kv_elem_size=kv.itemsize, max_seqlen_q=1, max_seqlen_k=int(lens.max()),
                            device=torch.device(dev))
        orders = {"random": list(range(batch)), "desc": sorted(range(batch), key=lambda i: -int(lens[i])),
                  "asc": sorted(range(batch), key=lambda i: int(lens[i]))}
        outs = {}
        for name, order in orders.items():
            sl = torch.tensor([int(lens[i]) for i in order], dtype=torch.int32, device=dev)
            tabs = [tables_for(order, s) for s in range(sets)]
            qo = [q[torch.tensor(order, device=dev)] for q in qs]
            calls = [(lambda s=s: sw.paged_attention_with_config(qo[s], kc, vc, tabs[s], sl, cu, scale=D ** -0.5,
                                                                  config=cfg, k_scale=ks, v_scale=vs)) for s in range(sets)]
            out = calls[0]()
            inv = torch.empty(batch, dtype=torch.long); inv[torch.tensor(order)] = torch.arange(batch)
            outs[name] = out[inv.to(dev)].float()
            ms = sw.graph_time_ms(calls, dev)
            kvbytes = int(lens.sum()) * KVH * D * 2 * kv.itemsize
            row = dict(kv=str(kv).split(".")[-1], batch=batch, lens=f"{lo}-{hi}", order=name, cfg=sw.short(cfg),
                       us=round(ms * 1e3, 1), gbs=round(kvbytes / ms / 1e6),
                       same_as_random=bool(torch.equal(outs[name], outs["random"])))
            print(json.dumps(row), flush=True); rows.append(row)
        del kc, vc
        torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "lpt.json"), "w"), indent=1)
