"""Decode steps store their K/V inside the attention kernel (``paged_attention(..., slot_mapping=)``).

In a step of one query token per sequence, the attention program whose keys include the last position writes the
step's K/V row there (then synchronises its threads and reads it back in its tile loop) instead of a ``store_kv``
launch before it. Everything here compares that path bit for bit with ``store_kv`` followed by the attention kernel:
the caches after the step and the attention output, for every tile shape (split and not, one-query programs, GQA),
16-bit and fp8 caches, slots of -1 (padding rows) and last positions that open a new tile or block. Without CUDA the
kernels run in Triton's interpreter; with CUDA the same cases run in bf16 too, plus a CUDA graph replayed with
programmatic dependent launch.
"""

import importlib

import pytest
import torch
from test_kernels import CUDA, DEVICE, assert_close, make_batch

from hfpaged.kernels import paged_attention, paged_attention_reference, store_kv, store_kv_reference
from hfpaged.kernels.attention_config import AttentionConfig
from hfpaged.kernels.paged_attention import paged_attention_with_config
from hfpaged.kernels.reference import quantize

pa_module = importlib.import_module("hfpaged.kernels.paged_attention")  # the package exports the function

CONFIGS = [
    AttentionConfig(16, 16, 4, 1),
    AttentionConfig(16, 16, 4, 1, one_query=True),
    AttentionConfig(16, 16, 4, 1, num_splits=4),
    AttentionConfig(16, 16, 4, 1, num_splits=8, min_split_tiles=2),
    AttentionConfig(16, 32, 4, 2, num_splits=3, split_target_programs=5, one_query=True),
    AttentionConfig(32, 16, 4, 1, num_splits=5),
]
CONFIG_IDS = ["plain", "one_query", "split4", "split8_min2", "split_target", "block_m32_split"]
# (q_lens are all 1) seq_lens: last keys at the start of a tile / of a block, a one-key sequence, long ones
SEQ_LENS = [1, 17, 33, 70, 16, 49]
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def decode_step(dtype, *, fp8=None, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=0):
    """A decode batch (one query per sequence) and the step's K/V with their slots: each sequence's last position,
    found through its block table; the fourth sequence is a padding row (slot -1)."""
    batch = make_batch([1] * len(SEQ_LENS), SEQ_LENS, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, block_size=block_size, dtype=dtype, seed=seed)  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 1)
    num_tokens = len(SEQ_LENS)
    # [T, kv_heads, D] views of [1, kv_heads, T, D], as the engine passes them
    key = torch.randn(1, num_kv_heads, num_tokens, head_dim, generator=gen)[0].transpose(0, 1).to(DEVICE, dtype)
    value = torch.randn(1, num_kv_heads, num_tokens, head_dim, generator=gen)[0].transpose(0, 1).to(DEVICE, dtype)
    tables = batch["block_tables"].cpu()
    slots = [int(tables[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size for b, n in enumerate(SEQ_LENS)]
    slots[3] = -1
    kv_scales = {}
    if fp8 is not None:
        kv_scales = {"k_scale": torch.tensor([0.01], device=DEVICE), "v_scale": torch.tensor([0.02], device=DEVICE)}
        for name, scale in (("k_cache", kv_scales["k_scale"]), ("v_cache", kv_scales["v_scale"])):
            batch[name] = quantize(batch[name].float(), scale, fp8)  # NaN poison stays NaN
    return batch, key, value, torch.tensor(slots, dtype=torch.int32, device=DEVICE), kv_scales


def _both_ways(batch, key, value, slots, kv_scales, call):
    """(out, k_cache, v_cache) after store_kv + ``call`` and after ``call`` storing in the kernel."""
    results = []
    for fused in (False, True):
        run = dict(batch, k_cache=batch["k_cache"].clone(), v_cache=batch["v_cache"].clone())
        if not fused:
            store_kv(key, value, run["k_cache"], run["v_cache"], slots, **kv_scales)
        out = call(run, (key, value, slots) if fused else None)
        results.append((out, run["k_cache"], run["v_cache"]))
    return results


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_stored_in_the_kernel_equals_store_kv_then_attention(config, dtype):
    batch, key, value, slots, _ = decode_step(dtype)

    def call(run, store):
        return paged_attention_with_config(**run, scale=0.125, config=config, store=store)

    (out, k_cache, v_cache), (fused_out, fused_k, fused_v) = _both_ways(batch, key, value, slots, {}, call)
    assert torch.equal(_bits(fused_k), _bits(k_cache)) and torch.equal(_bits(fused_v), _bits(v_cache))
    assert torch.equal(_bits(fused_out), _bits(out))
    assert not out[[b for b in range(len(SEQ_LENS)) if b != 3]].isnan().any()  # the new rows were read
    # and against the torch reference (the padding row, whose slot was -1, reads the cache's old row)
    ref_k, ref_v = batch["k_cache"].clone(), batch["v_cache"].clone()
    store_kv_reference(key, value, ref_k, ref_v, slots)
    ref = paged_attention_reference(**dict(batch, k_cache=ref_k, v_cache=ref_v), scale=0.125)
    assert_close(fused_out, ref, dtype)


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[2], CONFIGS[4]], ids=["plain", "split4", "split_target"])
def test_fp8_caches_quantize_as_store_kv(config, fmt):
    # the kernel quantizes the row as store_kv does (the same Triton conversion: on the CPU the interpreter's
    # fp32 -> fp8 rounding is off when it carries into the exponent, identically for both)
    dtype = torch.bfloat16 if CUDA else torch.float16
    batch, key, value, slots, kv_scales = decode_step(dtype, fp8=fmt)

    def call(run, store):
        return paged_attention_with_config(**run, **kv_scales, scale=0.125, config=config, store=store)

    (out, k_cache, v_cache), (fused_out, fused_k, fused_v) = _both_ways(batch, key, value, slots, kv_scales, call)
    assert torch.equal(_bits(fused_k), _bits(k_cache)) and torch.equal(_bits(fused_v), _bits(v_cache))
    assert torch.equal(_bits(fused_out), _bits(out))


def test_paged_attention_stores_in_the_kernel_only_for_one_query_per_sequence(monkeypatch):
    calls = []
    real = pa_module.store_kv
    monkeypatch.setattr(pa_module, "store_kv", lambda *a, **k: calls.append(1) or real(*a, **k))
    batch, key, value, slots, _ = decode_step(torch.float32)
    ref_k, ref_v = batch["k_cache"].clone(), batch["v_cache"].clone()
    store_kv_reference(key, value, ref_k, ref_v, slots)
    ref = paged_attention_reference(**dict(batch, k_cache=ref_k, v_cache=ref_v), scale=0.125)
    out = paged_attention(**batch, scale=0.125, key=key, value=value, slot_mapping=slots)  # hints read off
    assert calls == [] and torch.equal(_bits(batch["k_cache"]), _bits(ref_k))
    assert torch.equal(_bits(batch["v_cache"]), _bits(ref_v))
    assert_close(out, ref, torch.float32)

    # a prompt chunk among decodes: store_kv first, then the attention
    mixed = make_batch([1, 5, 1], [9, 20, 30], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                       dtype=torch.float32, seed=5)  # fmt: skip
    k_rows = torch.randn(7, 2, 64, device=DEVICE)
    v_rows = torch.randn(7, 2, 64, device=DEVICE)
    tables = mixed["block_tables"].cpu()
    positions = [(0, 8), *[(1, p) for p in range(15, 20)], (2, 29)]
    step_slots = torch.tensor(
        [int(tables[b, p // 16]) * 16 + p % 16 for b, p in positions], dtype=torch.int64, device=DEVICE
    )
    ref_k, ref_v = mixed["k_cache"].clone(), mixed["v_cache"].clone()
    store_kv_reference(k_rows, v_rows, ref_k, ref_v, step_slots)
    ref = paged_attention_reference(**dict(mixed, k_cache=ref_k, v_cache=ref_v), scale=0.125)
    out = paged_attention(**mixed, scale=0.125, key=k_rows, value=v_rows, slot_mapping=step_slots)
    assert calls == [1]
    assert torch.equal(_bits(mixed["k_cache"]), _bits(ref_k)) and torch.equal(_bits(mixed["v_cache"]), _bits(ref_v))
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize(
    "change, error, pattern",
    [
        (dict(key=None, value=None), ValueError, "slot_mapping stores the step's keys and values"),
        (dict(slot_mapping="short"), ValueError, r"slot_mapping.*q.shape\[0\]"),
        (dict(slot_mapping="float"), TypeError, "slot_mapping"),
        (dict(key="narrow"), ValueError, "key must be"),
    ],
)
def test_bad_store_arguments_are_clear_errors_and_write_nothing(change, error, pattern):
    batch, key, value, slots, _ = decode_step(torch.float32)
    args = dict(key=key, value=value, slot_mapping=slots)
    args.update(change)
    replacements = {"short": slots[:-1], "float": slots.float(), "narrow": key[..., :32]}
    args = {name: replacements[a] if isinstance(a, str) else a for name, a in args.items()}
    before = batch["k_cache"].clone(), batch["v_cache"].clone()
    with pytest.raises(error, match=pattern):
        paged_attention(**batch, scale=0.125, max_seqlen_q=1, max_seqlen_k=70, **args)
    assert torch.equal(_bits(batch["k_cache"]), _bits(before[0]))
    assert torch.equal(_bits(batch["v_cache"]), _bits(before[1]))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("launch_pdl", [False, True], ids=["plain", "pdl"])
def test_gpu_graph_of_a_decode_step_stores_as_store_kv(launch_pdl):
    # a decode step captured once (split: 4 sequences at up to 4k keys) and replayed with new slots, lengths and
    # rows: caches and output bit for bit those of store_kv + attention run eagerly
    from hfpaged.kernels.dependent_launch import dependent_launch_supported

    if launch_pdl and not dependent_launch_supported(DEVICE):
        pytest.skip("no programmatic dependent launch on this GPU")
    num_kv_heads, head_dim, block_size, width = 8, 128, 16, 256
    k_cache = torch.randn(4 * width + 8, block_size, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    static = dict(
        q=torch.randn(4, 32, head_dim, device="cuda", dtype=torch.bfloat16),
        block_tables=torch.randperm(k_cache.shape[0], device="cuda")[: 4 * width].view(4, width).int(),
        seq_lens=torch.full((4,), 4000, dtype=torch.int32, device="cuda"),
        cu_seqlens_q=torch.arange(5, dtype=torch.int32, device="cuda"),
    )
    key = torch.randn(4, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.zeros(4, dtype=torch.int64, device="cuda")
    kwargs = dict(scale=head_dim**-0.5, max_seqlen_q=1, max_seqlen_k=width * block_size, launch_pdl=launch_pdl)
    call = dict(static, k_cache=k_cache, v_cache=v_cache, key=key, value=value, slot_mapping=slots)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_attention(**call, **kwargs)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(**call, **kwargs)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for seq_lens in ([4000, 50, 900, 2048], [1, 1, 16, 17], [3999, 10, 4096, 100]):
        static["seq_lens"].copy_(torch.tensor(seq_lens, dtype=torch.int32))
        static["block_tables"].copy_(static["block_tables"][torch.randperm(4, device="cuda", generator=gen)])
        for t in (static["q"], key, value):
            t.normal_(generator=gen)
        tables = static["block_tables"]
        slots.copy_(torch.stack([tables[b, (n - 1) // block_size].long() * block_size + (n - 1) % block_size
                                 for b, n in enumerate(seq_lens)]))  # fmt: skip
        slots[1] = -1  # a padding row
        expected_k, expected_v = k_cache.clone(), v_cache.clone()
        store_kv(key, value, expected_k, expected_v, slots)
        expected = paged_attention(**static, k_cache=expected_k, v_cache=expected_v, **kwargs)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(_bits(k_cache), _bits(expected_k)) and torch.equal(_bits(v_cache), _bits(expected_v))
        assert torch.equal(_bits(out), _bits(expected))
