"""Probe (session 25): compile hfpaged's paged-attention kernel for sm_90 on a CPU-only machine (nothing is launched)
and print each variant's registers, stack and local memory, read from the cubin with Triton's bundled cuobjdump.

    python -m venv --system-site-packages /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0   # the GPU's Triton
    /tmp/t36/bin/python notes/results/session25/s25_regs.py [REPO]

A fake CUDA driver hands Triton the target (sm_90) and a device/stream of 0; ``JITFunction.warmup`` compiles without
launching. With Triton 3.6 the counts equal those the H100 reported (e4m3 decode 128/4/3: 253, as session 24's
probe A read on the GPU), so register work needs no GPU time. Output of this session: s25_regs.txt."""
import os, subprocess, sys, tempfile, importlib, re
os.environ.pop("TRITON_INTERPRET", None)
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver as _driver
from triton.backends.nvidia.driver import CudaDriver

class FakeDriver(CudaDriver):
    def __init__(self):
        self.utils = None
        self.launcher_cls = None
    @staticmethod
    def is_active():
        return True
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)
    def get_current_device(self):
        return 0
    def get_current_stream(self, device=None):
        return 0
    def get_active_torch_device(self):
        return torch.device("cpu")
    def get_device_interface(self):
        return torch.cuda
    def map_python_to_cpp_type(self, ty):
        return super().map_python_to_cpp_type(ty)

_driver.set_active(FakeDriver())
sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else "/work/main")
pa = importlib.import_module("hfpaged.kernels.paged_attention")
from hfpaged.kernels.attention_config import AttentionConfig
KERNEL = pa._paged_attention_kernel
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
compiled = []

class Warm:
    def __getitem__(self, grid):
        def run(*args, **kwargs):
            k = KERNEL.warmup(*args, grid=grid, **kwargs)
            compiled.append(k)
            return k
        return run
pa._paged_attention_kernel = Warm()

def res_usage(kernel):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    out = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+).*?LOCAL:(\d+)", out, re.S)
    return dict(regs=int(m.group(1)), stack=int(m.group(2)), shared=int(m.group(3)), local=int(m.group(4)))

def decode_problem(kv_dtype, batch=4, context=256, heads=16, kv_heads=8, hd=128, bs=16, q_dtype=torch.bfloat16):
    blocks = batch * context // bs
    k = torch.zeros(blocks, bs, kv_heads, hd, dtype=kv_dtype)
    v = torch.zeros(blocks, bs, kv_heads, hd, dtype=kv_dtype)
    q = torch.zeros(batch, heads, hd, dtype=q_dtype)
    tables = torch.arange(blocks, dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    cu = torch.arange(batch + 1, dtype=torch.int32)
    scale = torch.ones(1, dtype=torch.float32)
    return q, k, v, tables, seq_lens, cu, scale

def compile_variant(kv_dtype, tile_n, warps, stages, one_query=True, **kw):
    q, k, v, tables, seq_lens, cu, scale = decode_problem(kv_dtype)
    fp8 = kv_dtype != torch.bfloat16
    config = AttentionConfig(16, tile_n, warps, stages, 1, one_query=one_query)
    compiled.clear()
    pa.paged_attention_with_config(q, k, v, tables, seq_lens, cu, scale=0.1, config=config,
                                   k_scale=scale if fp8 else None, v_scale=scale if fp8 else None, **kw)
    return res_usage(compiled[-1]), compiled[-1]

if __name__ == "__main__":
    print("triton", triton.__version__)
    for dt in (torch.float8_e4m3fn, torch.bfloat16):
        for tile in ((128, 4, 3), (64, 4, 2), (64, 4, 3), (32, 4, 2)):
            try:
                r, _ = compile_variant(dt, *tile)
                print(str(dt).split(".")[-1], tile, r, flush=True)
            except Exception as e:
                print(str(dt).split(".")[-1], tile, "FAILED", type(e).__name__, str(e)[:300], flush=True)
