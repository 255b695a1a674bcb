"""The torch.compile decode path (patch(..., compile=True)): custom ops + metadata as forward kwargs.

On the GPU the runner captures this compiled forward in its decode CUDA graphs (tests/test_gpu_engine.py);
here it runs on the CPU, Triton kernels interpreted, and must decode exactly like stock generate.
"""

import torch

import hfpaged
from hfpaged.attention import ForwardContext
from hfpaged.compiled import compile_decode_forward
from hfpaged.runner import paged_mode
from hfpaged.step_inputs import build_host_step, device_views
from models import make_model, random_prompts, reference_generate


def test_compiled_decode_forward_matches_stock_generate():
    model = make_model("llama")
    prompts = random_prompts([5, 9, 3], seed=1)
    expected = reference_generate(model, prompts, max_new_tokens=6, do_sample=False)
    # the test drives the scheduler itself after the prefill: no step may be left in flight
    hfpaged.patch(model, num_blocks=64, block_size=4, attention_backend="triton", enable_prefix_caching=False,
                  async_scheduling=False)
    engine = hfpaged.Engine(model)
    for p in prompts:
        engine.add_request(p, max_new_tokens=6, do_sample=False)
    engine.step()  # prefill, eager
    requests = list(engine.scheduler.running)
    forward = compile_decode_forward(model, max_seqlen_k=64 * 4)
    while engine.has_unfinished():
        out = engine.scheduler.schedule()
        assert all(s.num_tokens == 1 for s in out.scheduled)
        host = build_host_step(out, 4)
        step = device_views(torch.from_numpy(host.packed), host.num_tokens, host.num_reqs, host.width, 1, 256,
                            host.num_sampled)
        meta = step.metadata
        with paged_mode(engine.state, ForwardContext("paged")), torch.inference_mode():
            logits = forward(step.input_ids, step.position_ids, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                             meta.cu_seqlens_q)
        tokens = logits.argmax(-1).tolist()
        engine.scheduler.update(out, {r.request_id: t for r, t in zip(host.sample_requests, tokens)})
    assert [r.output_token_ids for r in requests] == expected
    st = hfpaged.stats(model)
    assert st["num_free_blocks"] == st["num_blocks"]
