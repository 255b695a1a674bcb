"""FP8 KV cache kernels: paged_attention over float8_e4m3fn / float8_e5m2 caches against a float64 reference,
store_kv quantizing on write, and the argument errors.

Triton's CPU interpreter (3.9 here) loads fp8 correctly, so the attention kernel runs under
``TRITON_INTERPRET=1`` like the other kernel tests; its fp32 -> fp8 conversion is wrong when rounding carries
into the exponent (127.4 -> 64 instead of 128), so the Triton ``store_kv`` fp8 cases are GPU-marked and the
CPU checks the torch reference's quantization instead.
"""

import pytest
import torch
from test_kernels import DEVICE, assert_close, make_batch, poisoned_out

from hfpaged.kernels import paged_attention, paged_attention_reference, store_kv, store_kv_reference
from hfpaged.kernels.attention_config import AttentionConfig
from hfpaged.kernels.paged_attention import paged_attention_with_config
from hfpaged.kernels.reference import dequantize, quantize

CUDA = torch.cuda.is_available()
FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
FMT_IDS = ["e4m3", "e5m2"]
# Largest relative error of one rounding to the format (half an ulp: 3 and 2 mantissa bits).
HALF_ULP = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}
# Output error against attention over the unquantized K/V, relative to the output's norm. Measured on these
# random batches (torch reference): e4m3 0.030-0.037, e5m2 0.054-0.074 (quantization noise averaged over keys).
QUANT_TOLERANCE = {torch.float8_e4m3fn: 0.06, torch.float8_e5m2: 0.12}


def fp8_batch(q_lens, seq_lens, fmt, dtype, **shape):
    """``make_batch`` with its K/V quantized to ``fmt`` (per-cache scales from the amax, as calibration does),
    plus the float64 K/V before quantization."""
    batch = make_batch(q_lens, seq_lens, dtype=torch.float32, **shape)
    original = {name: batch[name].double() for name in ("k_cache", "v_cache")}
    fp8_max = torch.finfo(fmt).max
    for name, scale_name in (("k_cache", "k_scale"), ("v_cache", "v_scale")):
        cache = batch[name]
        scale = (cache.nan_to_num(0.0).abs().amax() / fp8_max).reshape(1).float()
        batch[name], batch[scale_name] = quantize(cache, scale, fmt), scale
    batch["q"] = batch["q"].to(dtype)
    return batch, original


def reference64(batch, cache=None, **kwargs):
    """Float64 attention over the dequantized cache (or over ``cache``, e.g. the unquantized K/V)."""
    if cache is None:
        cache = {
            "k_cache": dequantize(batch["k_cache"], batch["k_scale"], torch.float64),
            "v_cache": dequantize(batch["v_cache"], batch["v_scale"], torch.float64),
        }
    args = {k: v for k, v in batch.items() if k not in ("q", "k_cache", "v_cache", "k_scale", "v_scale")}
    return paged_attention_reference(batch["q"].double(), cache["k_cache"], cache["v_cache"], **args, **kwargs)


def relative_error(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


# (id, q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, window, softcap)
CASES = [
    ("decode_gqa2", [1, 1, 1, 1], [1, 9, 33, 70], 4, 2, 64, 16, None, None),
    ("prefill_bs32", [1, 20, 45], [1, 20, 45], 4, 4, 64, 32, None, None),
    ("chunk_hd128_gqa4", [8, 17], [40, 60], 8, 2, 128, 16, None, None),
    ("mixed_window", [1, 0, 30, 5, 1], [25, 10, 30, 50, 3], 6, 2, 64, 8, 16, None),
    ("window_softcap_hd256", [1, 24], [50, 24], 2, 1, 256, 64, 9, 4.0),
]
if CUDA:  # every case x format x query dtype
    COMBOS = [(c, f, d) for c in CASES for f in FORMATS for d in (torch.float32, torch.float16, torch.bfloat16)]
else:  # the interpreter is slow: every case in both formats, query dtypes alternating (bf16 is broken there)
    COMBOS = [(c, f, (torch.float32, torch.float16)[(i + j) % 2]) for i, c in enumerate(CASES) for j, f in
              enumerate(FORMATS)]  # fmt: skip


def _combo_id(combo):
    case, fmt, dtype = combo
    return f"{case[0]}-{FMT_IDS[FORMATS.index(fmt)]}-{str(dtype).replace('torch.', '')}"


@pytest.mark.parametrize("case,fmt,dtype", COMBOS, ids=[_combo_id(c) for c in COMBOS])
def test_fp8_attention_matches_float64_reference(case, fmt, dtype):
    _, q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, window, softcap = case
    shape = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    batch, original = fp8_batch(q_lens, seq_lens, fmt, dtype, **shape)
    kwargs = dict(scale=head_dim**-0.5, sliding_window=window, softcap=softcap)
    ref = reference64(batch, **kwargs)
    assert not ref.isnan().any()
    # the kernel reads exactly the dequantized values: only its compute precision separates it from float64
    assert_close(paged_attention(**batch, **kwargs), ref.to(dtype), dtype)
    assert_close(paged_attention_reference(**batch, **kwargs), ref.to(dtype), dtype)
    # split-KV (flash-decoding partials; and a wide tile on the GPU), into NaN-poisoned outputs
    configs = [AttentionConfig(16, 16, 4, 1, num_splits=3)] + ([AttentionConfig(64, 32, 4, 1)] if CUDA else [])
    for config in configs:
        out = paged_attention_with_config(**batch, **kwargs, config=config, out=poisoned_out(batch))
        assert_close(out, ref.to(dtype), dtype)
    # and the quantization itself costs a few percent of the output against the unquantized K/V
    assert (
        relative_error(paged_attention(**batch, **kwargs), reference64(batch, original, **kwargs))
        < (QUANT_TOLERANCE[fmt])
    )


@pytest.mark.parametrize("q_mult", [1.0, 1e5, 1e-6], ids=["q1", "q1e5", "q1e-6"])
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]], ids=[CASES[0][0], CASES[2][0], CASES[4][0]])
def test_fp8_bf16_queries_dot_in_fp16(case, fmt, q_mult):
    # bf16 queries over an fp8 cache run both dots in fp16 (fp8 -> fp16 is the cheap exact conversion) with q
    # rescaled into fp16's range: queries far outside it (1e5 x) or deep in its subnormals (1e-6 x) stay exact
    # to bf16 tolerance. (This path also runs in the CPU interpreter: it never dots in bf16.)
    _, q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, window, softcap = case
    shape = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    batch, _ = fp8_batch(q_lens, seq_lens, fmt, torch.bfloat16, **shape)
    batch["q"] = (batch["q"].float() * q_mult).to(torch.bfloat16)
    kwargs = dict(scale=head_dim**-0.5, sliding_window=window, softcap=softcap)
    ref = reference64(batch, **kwargs)
    assert not ref.isnan().any()
    assert_close(paged_attention(**batch, **kwargs), ref.to(torch.bfloat16), torch.bfloat16)
    out = paged_attention_with_config(**batch, **kwargs, config=AttentionConfig(16, 16, 4, 1, num_splits=3),
                                      out=poisoned_out(batch))  # fmt: skip
    assert_close(out, ref.to(torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_fp8_bf16_queries_peaked_softmax(fmt):
    # Scores with a spread of ~50 (large keys: k_scale 0.5 over raw fp8 values near 448), so a few keys share
    # the weight: a rounding of q into fp16 moves each weight by ~score * 2^-12, far past bf16 tolerance (it did,
    # 70x, when q was scaled by 8192 / max|q|; a power-of-two factor keeps every bf16 query element exact).
    torch.manual_seed(0)
    batch, _ = fp8_batch([1] * 2, [1500] * 2, fmt, torch.bfloat16, num_heads=8, num_kv_heads=2, head_dim=128,
                         block_size=16, table_tail="minus1")  # fmt: skip
    batch["k_scale"].fill_(0.5)
    batch["v_scale"].fill_(2.0)
    kwargs = dict(scale=128**-0.5)
    ref = reference64(batch, **kwargs)
    assert_close(paged_attention(**batch, **kwargs), ref.to(torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_fp8_reference_store_round_trip_and_saturation(fmt):
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(40, 2, 16, generator=gen) * 5
    value = torch.randn(40, 2, 16, generator=gen)
    key[0, 0, 0], value[1, 1, 1] = 1e6, -1e6  # far outside the range: saturate, never inf/NaN
    k_scale, v_scale = torch.tensor([0.05]), torch.tensor([0.01])
    k_cache = torch.zeros(6, 8, 2, 16, dtype=fmt)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(48, generator=gen)[:40].int()
    slots[3] = -1
    store_kv_reference(key, value, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    fp8_max = torch.finfo(fmt).max
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        stored = dequantize(cache.view(-1, 2, 16)[slots.long()], scale)
        expected = x.clamp(-fp8_max * scale, fp8_max * scale)
        ok = slots >= 0
        assert torch.isfinite(stored).all()
        err = (stored[ok] - expected[ok]).abs()
        assert (err <= HALF_ULP[fmt] * expected[ok].abs() + scale * 2.0**-9).all()
    assert float(k_cache.view(-1, 2, 16)[slots[0].long(), 0, 0]) == fp8_max  # saturated, not inf/NaN
    unused = torch.ones(48, dtype=torch.bool)
    unused[slots[slots >= 0].long()] = False
    assert k_cache.view(-1, 2, 16)[unused].float().abs().sum() == 0  # slot -1 wrote nothing


@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_fp8_store_kv_rounds_like_the_reference_across_powers_of_two(fmt):
    # x / scale just below a power of two rounds up into the next binade (7.9 -> 8 in e4m3): the Triton kernel
    # (compiled, or the CPU interpreter with tests/interpreter_fp8.py) must store the same bytes as torch's cast
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    fp8_max = torch.finfo(fmt).max
    edges = torch.tensor([2.0**e for e in range(-6, 9) if 2.0**e <= fp8_max])
    ratios = torch.tensor([0.97, 0.985, 0.999, 1.0, 1.01])
    base = (edges[:, None] * ratios[None, :]).flatten()
    base = torch.cat([base, -base, torch.tensor([fp8_max * 1.5, -1e6])])  # saturating too
    n = base.numel()
    key = base.repeat(2 * 16).view(2, 16, n).permute(2, 0, 1).contiguous()  # [n, 2 heads, 16]
    value = (-key).contiguous()
    k_scale = torch.tensor([0.5], device=DEVICE)
    v_scale = torch.tensor([2.0], device=DEVICE)
    key, value = (key * 0.5).to(DEVICE, dtype), (value * 2.0).to(DEVICE, dtype)  # x / scale = base
    slots = torch.arange(n, dtype=torch.int32, device=DEVICE)
    caches = [torch.zeros(-(-n // 8), 8, 2, 16, dtype=fmt, device=DEVICE) for _ in range(4)]
    store_kv(key, value, caches[0], caches[1], slots, k_scale=k_scale, v_scale=v_scale)
    store_kv_reference(key, value, caches[2], caches[3], slots, k_scale=k_scale, v_scale=v_scale)
    for ours, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))
    assert float(caches[0].view(-1, 2, 16)[n - 1, 0, 0]) == -fp8_max  # saturated, not inf/NaN


def test_fp8_argument_errors():
    batch, _ = fp8_batch([1], [10], torch.float8_e4m3fn, torch.float32, num_heads=2, num_kv_heads=1,
                         head_dim=16, block_size=8)  # fmt: skip
    no_scales = {k: v for k, v in batch.items() if k not in ("k_scale", "v_scale")}
    with pytest.raises(TypeError, match="k_scale must be a one-element float32 tensor"):
        paged_attention(**no_scales, scale=0.25)
    with pytest.raises(TypeError, match="v_scale must be a one-element float32 tensor"):
        paged_attention(**{**batch, "v_scale": torch.tensor([1.0, 2.0])}, scale=0.25)
    with pytest.raises(TypeError, match="differs from v_cache dtype"):
        paged_attention(**{**batch, "v_cache": batch["v_cache"].view(torch.float8_e5m2)}, scale=0.25)
    plain = make_batch([1], [10], num_heads=2, num_kv_heads=1, head_dim=16, block_size=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="apply to fp8 caches only"):
        paged_attention(**plain, scale=0.25, k_scale=batch["k_scale"], v_scale=batch["v_scale"])
    key = torch.zeros(2, 1, 16)
    with pytest.raises(TypeError, match="k_scale must be"):
        store_kv(key, key, batch["k_cache"], batch["v_cache"], torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError, match="k_scale must be"):
        store_kv_reference(key, key, batch["k_cache"], batch["v_cache"], torch.zeros(2, dtype=torch.int32))


# ---- GPU: store_kv's rounding (the interpreter's is wrong, see above), large sizes, CUDA graphs ----------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_gpu_fp8_store_kv_matches_reference(fmt, dtype):
    num_tokens, num_kv_heads, head_dim, block_size, num_blocks = 3000, 8, 128, 16, 400
    key = (torch.randn(1, num_kv_heads, num_tokens, head_dim, device="cuda") * 4)[0].transpose(0, 1).to(dtype)
    value = torch.randn_like(key)
    key[5, 0, 0] = 1e4  # saturates
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens].int()
    slots[::9] = -1
    k_scale, v_scale = torch.tensor([0.02], device="cuda"), torch.tensor([0.005], device="cuda")
    caches = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=fmt, device="cuda") for _ in range(4)]
    store_kv(key, value, caches[0], caches[1], slots, k_scale=k_scale, v_scale=v_scale)
    store_kv_reference(key, value, caches[2], caches[3], slots, k_scale=k_scale, v_scale=v_scale)
    for ours, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        same = ours.view(torch.uint8) == ref.view(torch.uint8)
        # equal bytes, except where x / scale sits within float32 rounding of a tie (at most one fp8 ulp)
        assert same.float().mean() > 0.9999, f"{int((~same).sum())} of {same.numel()} bytes differ"
        diff = (ours.float() - ref.float()).abs()
        assert (diff <= 2 * HALF_ULP[fmt] * ref.float().abs()).all()


def _gpu_fp8_batch(q_lens, seq_lens, fmt, dtype, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16):
    batch, _ = fp8_batch(q_lens, seq_lens, fmt, dtype, num_heads=num_heads, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, block_size=block_size, table_tail="minus1")  # fmt: skip
    return batch


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize(
    "q_lens,seq_lens,window,softcap",
    [
        ([4096], [4096], None, None),  # prefill
        ([1, 1], [32768, 20000], None, None),  # decode, split-KV
        ([1, 1, 700, 300, 1], [3000, 90, 700, 1500, 513], 512, 50.0),  # window + softcap, mixed
    ],
    ids=["prefill_4k", "decode_32k_split", "mixed_window_softcap"],
)
def test_gpu_fp8_attention(q_lens, seq_lens, window, softcap, fmt, dtype):
    batch = _gpu_fp8_batch(q_lens, seq_lens, fmt, dtype)
    kwargs = dict(scale=128**-0.5, sliding_window=window, softcap=softcap)
    ref = reference64(batch, **kwargs)
    out = paged_attention(**batch, **kwargs, max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens))
    assert_close(out, ref.to(dtype), dtype)


def captured_attention(static, kwargs):
    """``paged_attention(**static, **kwargs)`` run once on a side stream, then captured in a CUDA graph: (graph, the
    output tensor its replays write)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_attention(**static, **kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(**static, **kwargs)
    return graph, out


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_gpu_fp8_cuda_graph_decode_reads_scales_at_replay(fmt):
    static = _gpu_fp8_batch([1] * 4, [4000] * 4, fmt, torch.bfloat16)
    kwargs = dict(scale=128**-0.5, max_seqlen_q=1, max_seqlen_k=8192)
    graph, out = captured_attention(static, kwargs)
    abs_v = dict(static, v_cache=static["v_cache"].float().abs().to(fmt))  # |v|, exact in fp8
    for k_scale, v_scale in ((0.5, 2.0), (0.01, 0.3)):  # scales written after capture, as calibration does
        static["k_scale"].fill_(k_scale)
        static["v_scale"].fill_(v_scale)
        static["q"].normal_()
        graph.replay()
        ref = reference64(static, scale=kwargs["scale"])
        # bf16 tolerance per element, plus the rounding of P to 16 bits before the PV dot (as in any flash
        # kernel): up to 2^-9 of sum(p |v|), which matters where large values of both signs cancel (e5m2's raw
        # values reach 57344: outputs of ~5 from terms of ~10^4 were off by ~0.3 in float64 emulation too)
        bound = 0.02 + 0.02 * ref.abs() + 2.0**-8 * reference64(abs_v, scale=kwargs["scale"])
        error = (out.double() - ref).abs()
        assert not out.isnan().any() and (error <= bound).all(), f"worst error / bound {float((error / bound).max())}"


assert DEVICE.type in ("cpu", "cuda")


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=[CASES[1][0], CASES[2][0]])
def test_fp8_bf16_queries_a_non_finite_query_stays_in_its_row(case, bad):
    # q's rescale into fp16 is taken per program (several query tokens x the heads of one KV head): one inf or
    # NaN element (e.g. an overflowed activation) must poison only its own row, as over a bf16 cache, not the
    # other tokens of its sequence (earlier ones included, whose K/V the prefix cache may hand to other requests)
    _, q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, window, softcap = case
    shape = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    batch, _ = fp8_batch(q_lens, seq_lens, torch.float8_e4m3fn, torch.bfloat16, **shape)
    q = batch["q"].float() * 1e5  # past fp16's range: the rescale is needed for every row
    bad_token = q_lens[0] + 6  # the second sequence's seventh token
    q[bad_token, 0, 3] = bad
    batch["q"] = q.to(torch.bfloat16)
    kwargs = dict(scale=head_dim**-0.5, sliding_window=window, softcap=softcap)
    ref = reference64(batch, **kwargs)
    finite = torch.ones(ref.shape[:2], dtype=torch.bool)
    finite[bad_token, 0] = False
    assert not ref[finite].isnan().any()
    split = AttentionConfig(16, 16, 4, 1, num_splits=3)
    for out in (
        paged_attention(**batch, **kwargs),
        paged_attention_with_config(**batch, **kwargs, config=split, out=poisoned_out(batch)),
    ):
        assert not out[bad_token, 0].isfinite().all()
        assert_close(out[finite], ref[finite].to(torch.bfloat16), torch.bfloat16)
