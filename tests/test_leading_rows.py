"""A mixed step's leading one-token rows (decode rows ahead of its prompt chunks) as a decode launch of their own
(``kernels/attention_launch.attend_leading_rows``, ``paged_attention.DECODE_ROWS_APART``): the other rows come out
bitwise as from the one launch, the leading rows match the reference, and each launch writes only its own rows.
On the CPU the Triton kernels run in the interpreter (fp16 queries over fp16 and e4m3 caches); on CUDA also the
CUDA fp8 decode kernel."""

import sys

import pytest
import torch
from test_fp8_kernels import fp8_batch, reference64
from test_kernels import CUDA, assert_close, make_batch, poisoned_out

from hfpaged.kernels import paged_attention, paged_attention_reference
from hfpaged.kernels.attention_config import AttentionConfig
from hfpaged.kernels.attention_launch import attend_leading_rows

pa = sys.modules["hfpaged.kernels.paged_attention"]
launch = sys.modules["hfpaged.kernels.attention_launch"]

# three leading decode rows, a prompt chunk after cached context, a decode row behind it, a fresh prompt
Q_LENS = [1, 1, 1, 40, 1, 20]
SEQ_LENS = [50, 9, 120, 60, 33, 20]
LEADING = 3  # rows 0-2
DTYPE = torch.bfloat16 if CUDA else torch.float16


def mixed_batch(kv: str, q_lens=Q_LENS, seq_lens=SEQ_LENS, seed=0):
    shape = dict(num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=seed)
    if kv == "fp8":
        batch, _ = fp8_batch(q_lens, seq_lens, torch.float8_e4m3fn, DTYPE, **shape)
        ref = reference64(batch, scale=0.125)
    else:
        batch = make_batch(q_lens, seq_lens, dtype=DTYPE, table_tail="minus1", **shape)
        args = {k: v for k, v in batch.items() if k not in ("q", "k_cache", "v_cache")}
        ref = paged_attention_reference(batch["q"].double(), batch["k_cache"].double(), batch["v_cache"].double(),
                                           **args, scale=0.125)  # fmt: skip
    return batch, ref


def run(batch, mode, monkeypatch, q_lens=Q_LENS, seq_lens=SEQ_LENS):
    monkeypatch.setattr(pa, "DECODE_ROWS_APART", mode)
    return paged_attention(**batch, scale=0.125, max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens))


@pytest.mark.parametrize("kv", ["16bit", "fp8"])
def test_leading_rows_apart_equal_one_launch_elsewhere_and_match_the_reference(kv, monkeypatch):
    batch, ref = mixed_batch(kv)
    calls = []
    real = launch.attend_leading_rows
    monkeypatch.setattr(pa, "attend_leading_rows", lambda *a, **k: calls.append(k["config"]) or real(*a, **k))
    one_launch = run(batch, "never", monkeypatch)
    assert calls == []
    apart = run(batch, "always", monkeypatch)
    assert len(calls) == 1 and calls[0].one_query
    assert torch.equal(apart[LEADING:], one_launch[LEADING:])  # the other rows: the same program, bit for bit
    ref = ref.to(DTYPE)
    assert_close(apart, ref, DTYPE)
    assert_close(apart[:LEADING], ref[:LEADING], DTYPE)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("kv", ["16bit", "fp8"])
def test_the_leading_rows_launch_writes_those_rows_only(kv, num_splits):
    # split partials merged only for the leading rows; the other rows of out keep their NaN
    batch, ref = mixed_batch(kv, seed=1)
    out = poisoned_out(batch)
    config = AttentionConfig(16, 32, 4, 2, num_splits, 1, 0, one_query=True)
    scales = {name: batch.pop(name, None) for name in ("k_scale", "v_scale")}
    attend_leading_rows(**batch, out=out, config=config, scale=0.125, softcap=None, sliding_window=None, sinks=None,
                        launch_pdl=False, **scales)  # fmt: skip
    assert out[LEADING:].isnan().all()
    assert_close(out[:LEADING], ref[:LEADING].to(DTYPE), DTYPE)


@pytest.mark.parametrize("kv", ["16bit", "fp8"])
def test_the_prompt_launch_leaves_the_leading_rows_alone(kv, monkeypatch):
    # with the leading rows' launch a no-op, their rows of out keep their NaN and every other row is computed
    batch, ref = mixed_batch(kv, seed=4)
    monkeypatch.setattr(pa, "attend_leading_rows", lambda *args, **kwargs: None)
    out = poisoned_out(batch)
    config = pa.config_for_batch(len(Q_LENS) + 60, len(Q_LENS), 4, DTYPE, batch["k_cache"], batch["v_cache"], 40, 120)
    pa.paged_attention_with_config(**batch, out=out, config=config, scale=0.125,
                                   decode_rows=AttentionConfig(16, 32, 4, 2, one_query=True))  # fmt: skip
    assert not config.one_query and config.num_splits == 1
    assert out[:LEADING].isnan().all()
    assert_close(out[LEADING:], ref[LEADING:].to(DTYPE), DTYPE)


def test_no_leading_rows_and_rows_behind_a_prompt_stay_in_the_one_launch(monkeypatch):
    # a prompt first: no sequence b has cu[b] = b, cu[b + 1] = b + 1 past it, so the decode launch computes nothing
    q_lens, seq_lens = [40, 1, 1, 20], [60, 33, 7, 20]
    batch, _ = mixed_batch("16bit", q_lens, seq_lens, seed=2)
    one_launch = run(batch, "never", monkeypatch, q_lens, seq_lens)
    apart = run(batch, "always", monkeypatch, q_lens, seq_lens)
    assert torch.equal(apart, one_launch)


def test_which_steps_put_leading_rows_apart(monkeypatch):
    calls = []
    monkeypatch.setattr(pa, "attend_leading_rows", lambda *a, **k: calls.append(k["config"]))
    batch, _ = mixed_batch("16bit", seed=3)
    for mode, expected in (("never", 0), ("always", 1)):
        calls.clear()
        run(batch, mode, monkeypatch)
        assert len(calls) == expected, mode
    if not CUDA:  # "cuda_fp8" (the default): only where the CUDA fp8 kernel runs them; the CPU has none
        calls.clear()
        fp8, _ = mixed_batch("fp8", seed=3)
        run(fp8, "cuda_fp8", monkeypatch)
        assert calls == []
    # decode steps (one query each) and steps of short runs (decode tiles: query run x group <= 64) stay one launch
    for q_lens in ([1] * 6, [1, 1, 1, 2, 1, 2]):
        calls.clear()
        b, _ = mixed_batch("16bit", q_lens=q_lens, seq_lens=SEQ_LENS, seed=3)
        run(b, "always", monkeypatch, q_lens, SEQ_LENS)
        assert calls == [], q_lens


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_cuda_fp8_kernel_takes_the_leading_rows_by_default(monkeypatch):
    from hfpaged.kernels import fp8_decode as fd

    monkeypatch.setattr(fd, "USE_CUDA_FP8_DECODE", True)
    q_lens = [1] * 24 + [300, 1, 700]
    seq_lens = [int(x) for x in torch.randint(1, 3000, (24,), generator=torch.Generator().manual_seed(4))]
    seq_lens += [900, 400, 700]
    batch, _ = fp8_batch(q_lens, seq_lens, torch.float8_e4m3fn, torch.bfloat16, num_heads=16, num_kv_heads=8,
                         head_dim=128, block_size=16, table_tail="minus1")  # fmt: skip
    ref = reference64(batch, scale=0.125).to(torch.bfloat16)
    splits = []
    real = launch.fp8_decode
    monkeypatch.setattr(launch, "fp8_decode", lambda *a, **k: splits.append(k["split"]) or real(*a, **k))
    default = run(batch, pa.DECODE_ROWS_APART, monkeypatch, q_lens, seq_lens)
    assert pa.DECODE_ROWS_APART == "cuda_fp8" and len(splits) == 1
    one_launch = run(batch, "never", monkeypatch, q_lens, seq_lens)
    assert len(splits) == 1
    assert torch.equal(default[24:], one_launch[24:])
    assert_close(default, ref, torch.bfloat16)
    assert_close(default[:24], ref[:24], torch.bfloat16)
    # replayed from a CUDA graph: the same rows
    graph = torch.cuda.CUDAGraph()
    monkeypatch.setattr(pa, "DECODE_ROWS_APART", "cuda_fp8")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_attention(**batch, scale=0.125, max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens))
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        replayed = paged_attention(**batch, scale=0.125, max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, default)


def test_an_unknown_decode_rows_setting_is_refused(monkeypatch):
    batch, _ = mixed_batch("16bit", seed=5)
    with pytest.raises(ValueError, match="DECODE_ROWS_APART must be 'cuda_fp8', 'always' or 'never', got 'Always'"):
        run(batch, "Always", monkeypatch)
