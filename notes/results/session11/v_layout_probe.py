"""A/B of the decode kernel's V path: token-major V (default), V_3D (V loaded per block, converted in registers),
and a slot-minor (transposed) V cache with and without V_3D. CPU (interpreter): correctness only."""
import os, sys, json, time
SMOKE = not os.path.exists("/dev/nvidia0")
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, "examples")
if SMOKE:
    sys.argv.append("--smoke")
import torch
import sweep_fp8_decode as sw
from hfpaged.kernels.attention_config import AttentionConfig

class K2:
    def __init__(self, kernel):
        self.kernel, self.flags = kernel, {}
    def __getitem__(self, grid):
        launch = self.kernel[grid]
        flags = dict(self.flags)
        return lambda *a, **k: launch(*a, **flags, **k)

KERN = K2(sw.KERNEL.kernel)
sw.pa_module._paged_attention_kernel = KERN
dev = "cpu" if SMOKE else "cuda"
out_dir = os.environ.get("OUT", "/tmp")
results = []

def head_major(x):
    return x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)

def transposed(v):
    return v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)

shapes = [(3, 250)] if SMOKE else [(256, 1024), (128, 2048), (64, 2048), (32, 8192), (256, 512)]
if os.environ.get("BS"):
    sw.BLOCK_SIZE = int(os.environ["BS"])
kvs = [torch.float8_e4m3fn, torch.float16] if SMOKE else [torch.float8_e4m3fn, torch.bfloat16]
qd = torch.float16 if SMOKE else torch.bfloat16
for kv in kvs:
    for batch, ctx in shapes:
        p = sw.DecodeProblem(batch, ctx, kv, qd, dev)
        v_tok = p.v_cache
        v_tr = transposed(v_tok)
        k_tok = p.k_cache
        k_hm = head_major(k_tok)
        v_hm = head_major(v_tok)
        default = p.default_config()
        TT = [(64, 4, 2), (128, 4, 3), (32, 1, 2), (64, 1, 2), (64, 1, 3), (128, 1, 2), (64, 2, 2), (128, 2, 2),
              (128, 2, 3), (256, 2, 2)]
        tiles = [default] if SMOKE else [AttentionConfig(16, n, w, st, default.num_splits) for n, w, st in TT]
        if kv != torch.float8_e4m3fn and not SMOKE:
            tiles = tiles[:1] + tiles[2:]
        if SMOKE:
            tiles.append(AttentionConfig(16, 32, 4, 2, 2))
        ref = None
        for cfg in dict.fromkeys(tiles):
            for name, kc, vc, flags in (("A", k_tok, v_tok, {}), ("F_hm_tr", k_hm, v_tr, {"V_3D": True})):
                p.v_cache, p.k_cache = vc, kc
                KERN.flags = flags
                row = dict(kv=str(kv).split(".")[-1], batch=batch, ctx=ctx, cfg=sw.short(cfg), variant=name)
                try:
                    out = p.call(cfg)()
                    if ref is None:
                        ref = out.clone()
                        row["ref_rel"] = p.reference_rel_diff(out)
                    row["rel_vs_A"] = sw.rel_diff(out, ref)
                    if not SMOKE:
                        calls = [p.call(cfg, i) for i in range(p.sets)]
                        ms = sw.graph_time_ms(calls, dev)
                        row.update(us=round(ms * 1e3, 1), gbs=round(p.kv_bytes / ms / 1e6))
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                KERN.flags = {}
                print(json.dumps(row), flush=True)
                results.append(row)
        p.k_cache = k_tok
        del p, k_tok, v_tok, v_tr, k_hm, v_hm
        if not SMOKE:
            torch.cuda.empty_cache()
json.dump(results, open(os.path.join(out_dir, f"v3d_bs{sw.BLOCK_SIZE}.json"), "w"), indent=1)
