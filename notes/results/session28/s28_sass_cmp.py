"""Session 28: compile paged_attention variants (and the split merge) for sm_90 with Triton 3.6 on the CPU, in one repo tree
(its hfpaged/kernels a link to ../kernels); write each variant's registers and SASS to a JSON file (session 25's fake-driver
method). Run: /tmp/t36/bin/python s28_sass_cmp.py REPO OUT.json"""
import os, re, subprocess, sys, tempfile, importlib, json
os.environ.pop("TRITON_INTERPRET", None)
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver as _driver
from triton.backends.nvidia.driver import CudaDriver

class FakeDriver(CudaDriver):
    def __init__(self):
        self.utils = None; self.launcher_cls = None
    @staticmethod
    def is_active(): return True
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_active_torch_device(self): return torch.device("cpu")
    def get_device_interface(self): return torch.cuda
_driver.set_active(FakeDriver())
sys.path.insert(0, sys.argv[1])
pa = importlib.import_module("hfpaged.kernels.paged_attention")
from hfpaged.kernels.attention_config import AttentionConfig
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
compiled = []
class Warm:
    def __init__(self, kernel): self.kernel = kernel
    def __getitem__(self, grid):
        def run(*args, **kwargs):
            compiled.append(self.kernel.warmup(*args, grid=grid, **kwargs))
        return run
pa._paged_attention_kernel = Warm(pa._paged_attention_kernel)
pa._merge_splits_kernel = Warm(pa._merge_splits_kernel)

def sass_stats(kernel):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    res = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
    ins = [l for l in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", l)]
    ops = [re.sub(r"^\s+/\*[0-9a-f]{4}\*/\s+", "", l).split(" ;")[0] for l in ins]
    return dict(regs=regs, instructions=len(ops), body=ops)

def problem(kv_dtype, batch, q_len, context, heads=16, kv_heads=8, hd=128, bs=16):
    blocks = batch * ((context + bs - 1) // bs)
    k = torch.zeros(blocks, bs, kv_heads, hd, dtype=kv_dtype); v = torch.zeros_like(k)
    q = torch.zeros(batch * q_len, heads, hd, dtype=torch.bfloat16)
    tables = torch.arange(blocks, dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    cu = torch.arange(batch + 1, dtype=torch.int32) * q_len
    return q, k, v, tables, seq_lens, cu

VARIANTS = {
    "bf16 decode 64/4/2 one_query": (torch.bfloat16, 4, 1, 256, AttentionConfig(16, 64, 4, 2, 1, one_query=True)),
    "bf16 decode split 64/4/2 x4": (torch.bfloat16, 4, 1, 256, AttentionConfig(16, 64, 4, 2, 4, one_query=True)),
    "bf16 prompt 128x128/8/3": (torch.bfloat16, 2, 256, 256, AttentionConfig(128, 128, 8, 3)),
    "bf16 prompt 64x32/4/3": (torch.bfloat16, 2, 256, 256, AttentionConfig(64, 32, 4, 3)),
    "e4m3 decode 128/4/3": (torch.float8_e4m3fn, 4, 1, 256, AttentionConfig(16, 128, 4, 3, 1, one_query=True)),
}
out = {}
for name, (dt, batch, q_len, ctx, config) in VARIANTS.items():
    q, k, v, tables, seq_lens, cu = problem(dt, batch, q_len, ctx)
    fp8 = dt != torch.bfloat16
    scale = torch.ones(1)
    compiled.clear()
    pa.paged_attention_with_config(q, k, v, tables, seq_lens, cu, scale=0.1, config=config,
                                   k_scale=scale if fp8 else None, v_scale=scale if fp8 else None)
    for i, kern in enumerate(compiled):
        out[f"{name} [{i}]"] = sass_stats(kern)
json.dump(out, open(sys.argv[2], "w"))
for key, value in out.items():
    print(key, value["regs"], value["instructions"], flush=True)
