"""hfpaged.kernels.argmax.row_argmax against torch.argmax (the interpreter on the CPU: fp32/fp16; bf16 on the GPU)."""

import pytest
import torch

from hfpaged.kernels.argmax import CHUNK, row_argmax

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


def _rows(vocab: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(10, vocab, generator=gen)
    x[1, 7] = x[1, vocab - 1] = 40.0  # a tie across chunks: the first wins
    x[2, vocab - 1] = 40.0  # the maximum in the last, partly filled chunk
    x[3] = float("-inf")  # all -inf: index 0
    x[4, 100:200] = 40.0  # a tie inside one chunk
    x[5, vocab // 2] = float("nan")  # a NaN beats everything
    x[5, 3] = float("inf")
    x[6, vocab - 1] = float("nan")  # two NaNs: the first one
    x[6, vocab // 3] = float("nan")
    x[7, :] = 1.0  # all equal: 0
    x[8, vocab - 2] = float("inf")  # +inf beats the numbers
    x[9, : vocab // 2] = float("-inf")  # the maximum after a run of -inf
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [300, CHUNK, CHUNK + 1, 3 * CHUNK - 7, 50257])
def test_row_argmax_equals_torch(vocab, dtype):
    x = _rows(vocab, dtype)
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("vocab", [128256, 151936, 262144])
def test_row_argmax_real_vocabularies_gpu(vocab):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = _rows(vocab, dtype)
        for rows in (1, 4, 10):
            assert torch.equal(row_argmax(x[:rows]), x[:rows].argmax(dim=-1))


def test_row_argmax_short_rows():
    x = torch.tensor([[1.0], [float("nan")], [float("-inf")]], device=DEVICE)
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.0], [float("-inf"), -1.0, float("nan"), 5.0, float("nan")]], device=DEVICE)
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))


def test_row_argmax_strided_rows_and_no_rows():
    wide = _rows(3 * CHUNK, torch.float32)
    view = wide[:, : 2 * CHUNK + 5]  # rows further apart than their length
    assert torch.equal(row_argmax(view), view.argmax(dim=-1))
    empty = torch.zeros(0, 100, device=DEVICE)
    assert row_argmax(empty).shape == (0,)


def test_row_argmax_rejects_bad_input():
    with pytest.raises(ValueError, match="2"):
        row_argmax(torch.zeros(4, device=DEVICE))
    with pytest.raises(TypeError, match="dtype"):
        row_argmax(torch.zeros(2, 4, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="empty row"):
        row_argmax(torch.zeros(2, 0, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous rows"):
        row_argmax(torch.zeros(8, 4, device=DEVICE).t())
