"""A soak: thousands of short requests leave host memory, the pool and the engine's bookkeeping flat."""

import pytest
from models import make_model

import hfpaged
from hfpaged.testing import soak


@pytest.mark.slow
def test_many_short_requests_leave_memory_and_bookkeeping_flat():
    model = make_model("llama", seed=4)
    hfpaged.patch(model, num_blocks=256, block_size=4, max_num_seqs=64, max_num_batched_tokens=256)
    report = soak(model, num_requests=4_000, wave=500, prompt_len=(2, 12), new_tokens=(1, 6))
    samples = report["samples"]
    assert report["num_requests"] == 4_000 and report["tokens"] > 4_000
    for sample in samples:  # after every wave: every block free, no request left anywhere in the engine
        assert sample["free_blocks"] == sample["num_blocks"], sample
        assert sample["unfinished_requests"] == sample["owners"] == sample["kv_tables"] == 0, sample
        assert sample["runner_states"] <= 64 and sample["token_count_slots"] == 0, sample
    # resident memory: flat after the warm-up waves (allocator noise well under what a leak of 4,000 requests'
    # state would add)
    settled = [s["rss_mib"] for s in samples[2:]]
    assert max(settled) - min(settled) < 24, [round(s["rss_mib"], 1) for s in samples]
