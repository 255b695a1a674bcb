"""Compile the decode attention kernel for sm_90 on the CPU and count instruction kinds in its PTX."""
import re, sys, collections
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from hfpaged.kernels.attention_kernel import _paged_attention_kernel as K

def build(v_transposed: bool, kv="fp8e4nv", q="bf16", tile_n=128, warps=4, stages=3, block_size=16, extra=None):
    names = list(K.arg_names)
    sig, consts, attrs = {}, {}, {}
    ptr = {"out_ptr": q, "split_acc_ptr": "fp32", "split_max_ptr": "fp32", "split_sum_ptr": "fp32", "q_ptr": q,
           "k_cache_ptr": kv, "v_cache_ptr": kv, "block_tables_ptr": "i32", "seq_lens_ptr": "i32",
           "cu_seqlens_q_ptr": "i32", "k_scale_ptr": "fp32", "v_scale_ptr": "fp32"}
    H, D = 8, 128
    strides = {"stride_q_t": 16 * 128, "stride_q_h": 128, "stride_q_d": 1,
               "stride_k_b": block_size * H * D, "stride_k_s": H * D, "stride_k_h": D, "stride_k_d": 1,
               "stride_bt_b": 512, "stride_out_t": 16 * 128, "stride_out_h": 128}
    if v_transposed:  # physical [nb, H, D, BS]
        strides.update(stride_v_b=block_size * H * D, stride_v_s=1, stride_v_h=D * block_size, stride_v_d=block_size)
    else:
        strides.update(stride_v_b=block_size * H * D, stride_v_s=H * D, stride_v_h=D, stride_v_d=1)
    cx = dict(NUM_HEADS=16, GROUP=2, HEAD_DIM=128, HEAD_DIM_PAD=128, HEAD_DIM_V=128, HEAD_DIM_V_PAD=128,
              BLOCK_SIZE=block_size, BLOCK_M=16, BLOCK_Q=8, TILE_N=tile_n, USE_SOFTCAP=False, USE_WINDOW=False,
              SPLIT=False, DOT_PRECISION="tf32", SEARCH_BLOCK=256, KV_FP8=kv.startswith("fp8"), FP8_DOT_F16=True)
    if "V_3D" in names:
        cx.setdefault("V_3D", False)
    cx.update(extra or {})
    for i, n in enumerate(names):
        if n in ptr:
            sig[n] = "*" + ptr[n]; attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in strides:
            if strides[n] == 1:
                sig[n] = "constexpr"; consts[(i,)] = 1
            else:
                sig[n] = "i32"
                if strides[n] % 16 == 0: attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in cx:
            sig[n] = "constexpr"; consts[(i,)] = cx[n]
        elif n in ("qk_scale", "softcap"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    src = ASTSource(K, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))

def summarize(ptx):
    c = collections.Counter()
    for line in ptx.splitlines():
        m = re.match(r"\s*(@%p\d+\s+)?([a-z][\w.:]*)", line)
        if not m: continue
        op = m.group(2)
        for key in ("ld.shared", "ldmatrix", "cp.async", "ld.global", "st.shared", "cvt", "mma", "prmt", "ex2", "wgmma", "bar.sync", "shfl"):
            if op.startswith(key) or (key == "ldmatrix" and "ldmatrix" in op):
                c[op] += 1
    return c

if __name__ == "__main__" and len(sys.argv) == 1:
    for vt in (False, True):
        k = build(vt)
        ptx = k.asm["ptx"]
        open(f"/tmp/decode_vt{int(vt)}.ptx", "w").write(ptx)
        print("V transposed" if vt else "V token-major", "shared", k.metadata.shared, "regs?")
        for op, n in sorted(summarize(ptx).items()):
            print(f"   {n:5d} {op}")

if len(sys.argv) > 1:
    for vt in (False, True):
        k = build(vt, extra={"V_3D": True})
        ptx = k.asm["ptx"]
        open(f"/tmp/decode3d_vt{int(vt)}.ptx", "w").write(ptx)
        print("3D", "V transposed" if vt else "V token-major", "shared", k.metadata.shared)
        for op, n in sorted(summarize(ptx).items()):
            print(f"   {n:5d} {op}")
