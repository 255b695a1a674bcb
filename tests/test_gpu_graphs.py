"""CUDA graphs for every step (run with `pytest -m gpu` on a GPU): mixed prefill + decode steps and prefill
chunks replay from token-bucket graphs, decode-only steps from batch-bucket graphs.

The CPU side of the padding is checked in test_graph_padding.py (the same padded forward, run eagerly).
"""

import pytest
import torch
from models import make_model, random_prompts, reference_generate

import hfpaged
from hfpaged.engine import Engine

pytestmark = pytest.mark.gpu


def staggered(model, prompts, max_new_tokens, every=3):
    """Greedy outputs of ``prompts`` added one every ``every`` steps: most steps mix a prefill with decodes."""
    engine = Engine(model)
    ids = []
    outputs: dict[str, list[int]] = {}
    pending = list(prompts)
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % every == 0:
            ids.append(engine.add_request(pending.pop(0), max_new_tokens=max_new_tokens, do_sample=False))
        for output in engine.step():
            outputs.setdefault(output.prompt_id, []).extend(output.new_token_ids)
        step += 1
    return [outputs[i] for i in ids]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_mixed_steps_replay_from_graphs_token_for_token(arch):
    model = make_model(arch).cuda()
    prompts = random_prompts([3, 40, 9, 17, 70, 5, 33, 12], seed=11)
    expected = reference_generate(model, prompts, max_new_tokens=16, do_sample=False)
    hfpaged.patch(model, num_blocks=64, block_size=4, max_num_seqs=6, max_num_batched_tokens=64)
    assert staggered(model, prompts, 16) == expected
    runner = model._hfpaged.engine.runner
    assert runner.mixed_graphs is not None and runner.graphs is not None
    assert runner.num_eager_steps == 0 and runner.num_graph_steps > 0
    # every bucket after the largest captured without a warm-up, none needing the retry
    assert runner.graphs.capture_retries == 0 and runner.mixed_graphs.capture_retries == 0
    # the same against the eager engine: graphs change no token
    hfpaged.patch(model, num_blocks=64, block_size=4, max_num_seqs=6, max_num_batched_tokens=64, enforce_eager=True)
    assert staggered(model, prompts, 16) == expected
    assert model._hfpaged.engine.runner.num_graph_steps == 0


def written_slots(model, prompts, **options):
    """Which K and V cache slots hold a value after a staggered run (the pool starts filled with a sentinel)."""
    hfpaged.patch(model, num_blocks=128, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, **options)
    sentinel = 1234.0
    for k_cache, v_cache in model._hfpaged.kv_caches:
        k_cache.fill_(sentinel)
        v_cache.fill_(sentinel)
    outputs = staggered(model, prompts, 9, every=2)
    masks = [(cache != sentinel).any(dim=-1).any(dim=-1) for kv in model._hfpaged.kv_caches for cache in kv]
    return outputs, torch.stack(masks), model._hfpaged.engine.runner


def test_padding_writes_no_kv():
    """Padded graph steps write exactly the slots the eager steps write (padding stores nothing)."""
    model = make_model("qwen3").cuda()
    prompts = random_prompts([7, 21, 2, 13], seed=12)
    graph_outputs, graph_written, runner = written_slots(model, prompts)
    assert runner.mixed_graphs is not None and runner.num_eager_steps == 0
    eager_outputs, eager_written, runner = written_slots(model, prompts, enforce_eager=True)
    assert runner.num_graph_steps == 0
    assert graph_outputs == eager_outputs
    assert torch.equal(graph_written, eager_written) and graph_written.sum() > 0


def test_weights_updated_in_place_after_capture_are_used():
    model = make_model("llama").cuda()
    prompts = random_prompts([5, 30, 11], seed=13)
    hfpaged.patch(model, num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    assert staggered(model, prompts, 8) == reference_generate(model, prompts, max_new_tokens=8, do_sample=False)
    runner = model._hfpaged.engine.runner
    graphs, mixed = runner.graphs, runner.mixed_graphs
    assert graphs is not None and mixed is not None
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-3.0)
        model.lm_head.weight.add_(0.05 * torch.randn_like(model.lm_head.weight))
    expected = reference_generate(model, prompts, max_new_tokens=8, do_sample=False)
    steps = runner.num_graph_steps
    assert staggered(model, prompts, 8) == expected
    assert runner.graphs is graphs and runner.mixed_graphs is mixed  # the same graphs, the new values
    assert runner.num_graph_steps > steps and runner.num_eager_steps == 0


def test_a_long_prompt_is_chunked_into_graph_steps():
    """A prompt longer than max_num_batched_tokens arrives in chunks, each a graph step (none runs eagerly)."""
    model = make_model("qwen3").cuda()
    prompts = random_prompts([150, 4], seed=14)
    expected = reference_generate(model, prompts, max_new_tokens=6, do_sample=False)
    hfpaged.patch(model, num_blocks=96, block_size=4, max_num_seqs=4, max_num_batched_tokens=48)
    results = model.generate_many(prompts, max_new_tokens=6, do_sample=False)
    assert [r.token_ids for r in results] == expected
    assert model._hfpaged.engine.runner.num_eager_steps == 0


def test_beams_and_parallel_samples_that_outnumber_max_num_seqs():
    """A beam group (or a prompt's parallel samples) runs together even past max_num_seqs: such steps take a
    larger graph or run eagerly, and the beams still equal stock beam search."""
    from test_beam_search import assert_same, stock_beams

    model = make_model("llama").cuda()
    prompts = random_prompts([6, 19, 11], seed=15)
    expected = stock_beams(model, prompts, max_new_tokens=10, num_beams=3, num_return_sequences=2, do_sample=False)
    hfpaged.patch(model, num_blocks=96, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    results = model.generate_many(prompts, max_new_tokens=10, num_beams=3, num_return_sequences=2, do_sample=False)
    assert_same(results, expected)
    samples = dict(max_new_tokens=10, do_sample=True, num_return_sequences=4, seed=3)
    first = model.generate_many(prompts, **samples)
    assert [[s.token_ids for s in r.sequences] for r in first] == [
        [s.token_ids for s in r.sequences] for r in model.generate_many(prompts, **samples)
    ]
    assert model._hfpaged.engine.runner.num_graph_steps > 0
    stats = hfpaged.stats(model)
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_capture_without_warm_up_retries_with_one(monkeypatch):
    """Only the first (largest) bucket warms up before its capture; a later bucket whose capture fails warms up
    once and is captured again, and the tokens stay those of stock generate."""
    from hfpaged.model.cuda_graphs import StepGraphs

    model = make_model("llama").cuda()
    prompts = random_prompts([5, 30, 11, 2], seed=15)
    expected = reference_generate(model, prompts, max_new_tokens=8, do_sample=False)
    capture_one, warm_up = StepGraphs._capture_one, StepGraphs._warm_up
    events = []

    def failing_once(self, forward, bucket, *args):
        if bucket == self.buckets[0] and ("fail", self.mixed) not in events:  # the smallest: captured last
            events.append(("fail", self.mixed))
            raise RuntimeError("simulated capture failure")
        return capture_one(self, forward, bucket, *args)

    def recording(self, forward, bucket, stream, calls, **kwargs):
        events.append(("warm", self.mixed, bucket, calls))
        return warm_up(self, forward, bucket, stream, calls, **kwargs)

    monkeypatch.setattr(StepGraphs, "_capture_one", failing_once)
    monkeypatch.setattr(StepGraphs, "_warm_up", recording)
    hfpaged.patch(model, num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    assert staggered(model, prompts, 8) == expected
    runner = model._hfpaged.engine.runner
    for graphs in (runner.graphs, runner.mixed_graphs):
        assert graphs is not None and sorted(graphs.graphs) == graphs.buckets  # every bucket captured
        kind = graphs.mixed
        warmups = [e for e in events if e[0] == "warm" and e[1] == kind]
        # the largest bucket twice, then only the bucket whose capture failed, once
        assert warmups == [("warm", kind, graphs.buckets[-1], 2), ("warm", kind, graphs.buckets[0], 1)]
        assert graphs.capture_retries == 1
    assert runner.num_eager_steps == 0
    assert hfpaged.stats(model)["num_free_blocks"] == hfpaged.stats(model)["num_blocks"]


def test_greedy_picks_computed_inside_the_graphs(monkeypatch):
    """Buckets of few rows take their argmax inside the graph (the Triton row argmax: vocabulary >= 4096); the
    engine uses it only when every row is plain greedy, and the tokens equal stock generate's."""
    import hfpaged.sampling.sampler as sampler

    model = make_model("llama", vocab_size=5000).cuda()
    prompts = random_prompts([5, 30, 11, 19], seed=14)
    expected = reference_generate(model, prompts, max_new_tokens=12, do_sample=False)
    # mixed buckets hold min(tokens, max_num_seqs + 1) rows: with 16 tokens at most, every bucket the run uses has
    # fewer than FEW_ROWS rows (the decode bucket of 40 rows, unused here, keeps the eager argmax)
    hfpaged.patch(model, num_blocks=128, block_size=4, max_num_seqs=40, max_num_batched_tokens=16)
    eager_argmax = []
    original = sampler.row_argmax
    monkeypatch.setattr(sampler, "row_argmax", lambda scores: eager_argmax.append(scores.shape) or original(scores))
    assert staggered(model, prompts, 12) == expected
    runner = model._hfpaged.engine.runner
    assert runner.num_eager_steps == 0 and runner.num_graph_steps > 0
    assert eager_argmax == []  # every step's picks came from its graph
    for graphs in (runner.graphs, runner.mixed_graphs):
        for bucket, greedy in graphs.greedy.items():
            rows = graphs.outputs[bucket].shape[0]
            if rows >= sampler.FEW_ROWS:
                assert greedy is None
            else:
                assert greedy is not None and greedy.shape == (rows,)
    assert runner.graphs.greedy[40] is None and runner.graphs.greedy[8] is not None
    # the last replayed decode bucket's picks are the argmax of its logits
    bucket = runner.graphs.buckets[0]
    runner.graphs.replay(bucket, 1)
    assert torch.equal(runner.graphs.greedy[bucket], runner.graphs.outputs[bucket].argmax(dim=-1))
    # a sampled request beside greedy ones: the step draws from the logits (the graph's picks unused), and the
    # greedy requests still match stock generate
    eager_argmax.clear()
    sampled = {"prompt": prompts[2], "do_sample": True, "seed": 3}
    outputs = model.generate_many(prompts[:2] + [sampled], max_new_tokens=12, do_sample=False)
    assert [o.token_ids for o in outputs[:2]] == expected[:2]
    assert len(outputs[2].token_ids) == 12


@pytest.mark.parametrize("dependent_launch", [True, False])
def test_dependent_launch_tokens_equal_stock_generate(dependent_launch):
    """Programmatic dependent launch (the default on Hopper) inside decode and mixed graphs with compiled layers,
    a pool small enough to preempt: tokens equal stock generate's, as with plain launches."""
    from hfpaged.kernels.dependent_launch import dependent_launch_supported

    if dependent_launch and not dependent_launch_supported(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    model = make_model("qwen3").cuda()
    prompts = random_prompts([3, 40, 9, 17, 70, 5, 33, 12, 26, 8], seed=21)
    expected = reference_generate(model, prompts, max_new_tokens=24, do_sample=False)
    hfpaged.patch(
        model, num_blocks=40, block_size=4, max_num_seqs=6, max_num_batched_tokens=64,
        dependent_launch=dependent_launch,
    )  # fmt: skip
    assert model._hfpaged.dependent_launch is dependent_launch
    assert staggered(model, prompts, 24, every=2) == expected
    runner = model._hfpaged.engine.runner
    assert runner.num_eager_steps == 0 and runner.mixed_graphs is not None and runner.graphs is not None
    assert hfpaged.stats(model)["num_preemptions"] > 0
    assert hfpaged.stats(model)["num_free_blocks"] == 40


def test_capture_invalidated_inside_retries_into_a_fresh_pool(monkeypatch):
    """A capture that fails inside the graph (here a synchronize, which invalidates it, as a compile inside a capture
    does) leaves its pool recording; the retry captures into a fresh pool: every bucket graphed, tokens exact."""
    from hfpaged.model.cuda_graphs import StepGraphs

    model = make_model("llama").cuda()
    prompts = random_prompts([5, 30, 11, 2], seed=16)
    expected = reference_generate(model, prompts, max_new_tokens=8, do_sample=False)
    capture_one = StepGraphs._capture_one
    failed = []

    def invalidated_once(self, forward, bucket, *args):
        if bucket == self.buckets[0] and not self.mixed and not failed:
            failed.append(bucket)

            def synchronizing(step):
                out = forward(step)
                torch.cuda.synchronize()  # not permitted while the stream captures
                return out

            return capture_one(self, synchronizing, bucket, *args)
        return capture_one(self, forward, bucket, *args)

    monkeypatch.setattr(StepGraphs, "_capture_one", invalidated_once)
    hfpaged.patch(model, num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    assert staggered(model, prompts, 8) == expected
    runner = model._hfpaged.engine.runner
    assert failed and runner.graphs is not None and sorted(runner.graphs.graphs) == runner.graphs.buckets
    assert runner.graphs.capture_retries == 1 and runner.num_eager_steps == 0
    assert hfpaged.stats(model)["num_free_blocks"] == hfpaged.stats(model)["num_blocks"]
    # the allocator does not believe a capture still runs: cached memory is released again (with a capture left
    # "underway" empty_cache frees nothing and every later engine's pool piles up until the GPU is full)
    hfpaged.unpatch(model)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    scratch = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    del scratch
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= before


def test_short_prompt_variants_token_for_token(monkeypatch):
    """Mixed buckets above the short-prompt hint (forced to 8 here: float32 has one prompt tile) capture a second
    graph, with compiled layers and no warm-up: steps whose longest run fits it replay that one; tokens stay stock's."""
    from test_graph_padding import record_variant_hints

    from hfpaged.model import runner as runner_module

    monkeypatch.setattr(runner_module, "short_prompt_hint", lambda layers: 8)
    model = make_model("qwen3").cuda()
    prompts = random_prompts([3, 40, 9, 17, 70, 5, 33, 2, 6], seed=18)
    expected = reference_generate(model, prompts, max_new_tokens=12, do_sample=False)
    chosen = record_variant_hints(monkeypatch)
    hfpaged.patch(model, num_blocks=64, block_size=4, max_num_seqs=6, max_num_batched_tokens=64)
    assert staggered(model, prompts, 12) == expected
    runner = model._hfpaged.engine.runner
    mixed = runner.mixed_graphs
    assert mixed.short_buckets == [16, 32, 64] and sorted(mixed.short_graphs) == mixed.short_buckets
    assert mixed.capture_retries == 0 and runner.num_eager_steps == 0
    assert {8, None} <= {hint for *_, hint in chosen}  # both kinds of mixed graph replayed


def test_short_prompt_variant_replays_equal_their_forward(monkeypatch):
    """bf16, the real hint (1,536): a 2,048-token mixed step of short prompts replays the variant, one with a longer
    run the bucket's own graph; each replay's logits (and in-graph argmax) equal the compiled forward run eagerly
    on the same inputs with the hint that graph was captured with."""
    from hfpaged.model.cuda_graphs import StepGraphs

    model = make_model(
        "qwen3", dtype=torch.bfloat16, head_dim=128, max_position_embeddings=4096
    ).cuda()  # 128-dim heads: two prompt tiles
    hfpaged.patch(model, num_blocks=1024, block_size=16, max_num_seqs=16, max_num_batched_tokens=2048)
    runner = model._hfpaged.engine.runner
    replay, checked = StepGraphs.replay, []

    def checking(self, bucket, num_sampled, max_seqlen_q=None):
        out = replay(self, bucket, num_sampled, max_seqlen_q)
        if self.mixed and bucket == 2048:
            hint = self.variant_hint(bucket, max_seqlen_q)
            greedy = self.greedy_tokens(bucket, num_sampled, max_seqlen_q)
            with torch.inference_mode():
                eager = runner._graph_forward(self._views(bucket, hint), mixed=True)[:num_sampled]
            assert torch.equal(out, eager), (max_seqlen_q, hint, (out.float() - eager.float()).abs().max())
            # the graph's argmax picks a largest logit of each row (bf16 logits can tie)
            assert greedy is not None and greedy.shape == (num_sampled,)
            assert torch.equal(out.gather(1, greedy.long()[:, None])[:, 0], out.max(dim=-1).values)
            checked.append((max_seqlen_q, hint))
        return out

    monkeypatch.setattr(StepGraphs, "replay", checking)
    short = random_prompts([150, 120, 140, 100, 130, 110, 150, 125, 135, 145, 105, 115, 140, 150], seed=19)
    model.generate_many(short, max_new_tokens=4, do_sample=False)  # 1,815 prompt tokens in one step
    model.generate_many(random_prompts([1700, 60], seed=20), max_new_tokens=4, do_sample=False)
    mixed = runner.mixed_graphs
    assert mixed.short_hint == 1536 and 2048 in mixed.short_buckets and mixed.capture_retries == 0
    assert (150, 1536) in checked and (1700, None) in checked, checked
    stats = hfpaged.stats(model)
    assert stats["num_free_blocks"] == stats["num_blocks"]
