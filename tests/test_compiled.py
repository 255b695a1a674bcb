"""The torch.compile decode path (patch(..., compile=True)): custom ops + metadata as forward kwargs.

On the GPU the runner captures this compiled forward in its decode CUDA graphs (tests/test_gpu_engine.py);
here it runs on the CPU, Triton kernels interpreted, and must decode exactly like stock generate.
"""

import pytest
import torch
from models import make_model, random_prompts, reference_generate

import hfpaged
from hfpaged.core.runner_output import ModelRunnerOutput
from hfpaged.model.input_batch import device_views


@pytest.mark.slow
def test_compiled_decode_forward_matches_stock_generate():
    model = make_model("llama")
    prompts = random_prompts([5, 9, 3], seed=1)
    expected = reference_generate(model, prompts, max_new_tokens=6, do_sample=False)
    # the test drives scheduler and runner itself after the prefill: no step may be left in flight
    hfpaged.patch(
        model,
        num_blocks=64,
        block_size=4,
        attention_backend="triton",
        enable_prefix_caching=False,
        async_scheduling=False,
        compile=True,
    )
    engine = hfpaged.Engine(model)
    for p in prompts:
        engine.add_request(p, max_new_tokens=6, do_sample=False)
    engine.step()  # prefill, eager
    core = engine.core
    requests = list(core.scheduler.running)
    runner = core.runner
    while core.has_unfinished():
        out = core.scheduler.schedule()
        assert all(s.num_tokens == 1 for s in out.scheduled)
        runner.batch.update(out)
        host = runner.batch.pack(out.scheduled, None)
        with torch.inference_mode():
            logits = runner._graph_forward(device_views(torch.from_numpy(host.packed), host))  # the compiled forward
        tokens = logits[: host.num_sampled].argmax(-1).tolist()
        for state, token in zip(host.sample_states, tokens):
            state.append_token(token)  # what reading a StepResult does
        request_ids = [state.request_id for state in host.sample_states]
        core.scheduler.update_from_output(out, ModelRunnerOutput(request_ids, tokens))
    assert runner._compiled is not None
    assert [r.output_token_ids for r in requests] == expected
    st = hfpaged.stats(model)
    assert st["num_free_blocks"] == st["num_blocks"]
