"""Steps padded to CUDA-graph shapes (decode batch buckets, mixed-step token buckets) give the tokens of
unpadded steps.

Graphs need a GPU; what they replay does not. The runner packs a step padded to its graph's shape, loads it
into the static buffers and runs the forward on views of them; here the capture is replaced by running that
same forward eagerly on the CPU, with the torch reference attention and with the Triton kernel under the
interpreter. So the padding (padding sequences that own the padding tokens, sequences with no query token,
the prefill-tile hint of mixed graphs, stale block-table columns) is checked token for token against stock
``generate``, with preemption and prefix caching in play.
"""

import numpy as np
import pytest
import torch
from models import generate_in_threads, make_model, random_prompts, reference_generate

import hfpaged
from hfpaged.engine import Engine
from hfpaged.model.cuda_graphs import StepGraphs, batch_buckets, token_buckets
from hfpaged.model.input_batch import region_slices


def replay_eagerly(model, attention=None):
    """Make the model's runner use "graphs" that run the padded forward eagerly; returns the runner."""
    runner = model._hfpaged.engine.runner
    if attention is not None:
        runner.attention_fn = attention

    def capture(graphs, forward):
        replay_forward_eagerly(graphs, forward)
        return True

    runner._capture = capture
    runner.use_graphs = True
    return runner


def replay_forward_eagerly(graphs, forward):
    """``graphs.replay`` runs ``forward`` on the views of the graph the step would replay (its hint too)."""

    def replay(bucket, num_sampled, max_seqlen_q=None):
        return forward(graphs._views(bucket, graphs.variant_hint(bucket, max_seqlen_q)))[:num_sampled]

    graphs.replay = replay


def record_variant_hints(monkeypatch) -> list[tuple[int, int | None, int | None]]:
    """(bucket, longest query run, hint of the graph chosen) of every mixed-graph choice from now on
    (``StepGraphs.variant_hint``; a step asks once for its replay and once for its in-graph argmax)."""
    variant_hint, chosen = StepGraphs.variant_hint, []

    def recording(self, bucket, max_seqlen_q):
        hint = variant_hint(self, bucket, max_seqlen_q)
        if self.mixed:
            chosen.append((bucket, max_seqlen_q, hint))
        return hint

    monkeypatch.setattr(StepGraphs, "variant_hint", recording)
    return chosen


def test_token_and_batch_buckets():
    assert token_buckets(8192) == [16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(8) == [8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(20, min_batch=2) == [2, 4, 8, 16, 20]  # compiled layers: batch 1 pads into 2
    assert batch_buckets(1, min_batch=2) == [1] and batch_buckets(2, min_batch=2) == [2]
    graphs = StepGraphs(torch.device("cpu"), 8, 16, 16, mixed=True, max_num_tokens=64)
    assert [graphs.shape(b) for b in graphs.buckets] == [(16, 9), (32, 9), (64, 9)]
    assert graphs.bucket_for(17, 3) == 32 and graphs.bucket_for(65, 3) is None
    # a padding sequence may own almost a whole bucket: its block-table row is wide enough for it
    wide = StepGraphs(torch.device("cpu"), 8, 16, 4, mixed=True, max_num_tokens=512)
    assert wide.static_block_tables.shape == (9, 128) and wide.width == 16
    decode = StepGraphs(torch.device("cpu"), 8, 16, 16)
    assert decode.shape(4) == (4, 4) and decode.bucket_for(3, 3) == 4
    assert StepGraphs(torch.device("cpu"), 8, 16, 16, min_batch=2).bucket_for(1, 1) == 2


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_padded_steps_equal_stock_generate(kernel):
    model = make_model("qwen3", seed=3)
    prompts = random_prompts([5, 23, 9, 40, 3, 17], seed=4)
    expected = reference_generate(model, prompts, max_new_tokens=8, do_sample=False)
    # a pool of 16 blocks of 4 for six requests of up to 48 tokens: preemption; 6 sequences at most
    hfpaged.patch(model, num_blocks=16, block_size=4, max_num_seqs=6, max_num_batched_tokens=48)
    attention = None
    if kernel == "triton":
        pytest.importorskip("triton")
        from hfpaged.kernels import paged_attention

        attention = paged_attention  # decode steps: the kernel stores the step's K/V itself
    runner = replay_eagerly(model, attention)
    results = model.generate_many(prompts, max_new_tokens=8, do_sample=False)
    assert [r.token_ids for r in results] == expected
    assert runner.mixed_graphs is not None and runner.graphs is not None  # both kinds replayed
    assert runner.num_graph_steps > 0 and runner.num_eager_steps == 0
    stats = hfpaged.stats(model)
    assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_short_prompt_variants_replay_for_short_runs(kernel, monkeypatch):
    """Mixed buckets above the short-prompt hint have a second graph captured with that hint: a step whose longest
    query run fits it replays that one (its attention sees the hint), others the bucket's own; tokens stay stock's."""
    from hfpaged.model import runner as runner_module

    monkeypatch.setattr(runner_module, "short_prompt_hint", lambda layers: 8)
    model = make_model("qwen3", seed=5)
    prompts = random_prompts([5, 23, 9, 40, 3, 17, 6, 2], seed=6)
    expected = reference_generate(model, prompts, max_new_tokens=6, do_sample=False)
    hfpaged.patch(model, num_blocks=64, block_size=4, max_num_seqs=6, max_num_batched_tokens=48)
    attend, hints_seen = None, []
    if kernel == "triton":
        pytest.importorskip("triton")
        from hfpaged.kernels import paged_attention

        def attend(*args, **kwargs):
            hints_seen.append(kwargs["max_seqlen_q"])
            return paged_attention(*args, **kwargs)

    runner = replay_eagerly(model, attend)
    replay_hints = record_variant_hints(monkeypatch)
    results = model.generate_many(prompts, max_new_tokens=6, do_sample=False)
    assert [r.token_ids for r in results] == expected
    assert runner.mixed_graphs.short_hint == 8 and runner.mixed_graphs.short_buckets == [16, 32, 48]
    assert runner.graphs.short_buckets == []  # decode graphs have none
    short = [(b, q) for b, q, hint in replay_hints if hint == 8]
    own = [(b, q) for b, q, hint in replay_hints if hint is None]
    assert short and own and all(q <= 8 for _, q in short) and all(q > 8 for _, q in own)
    if kernel == "triton":  # the variant's attention ran with the hint, the others with their bucket's size
        assert 8 in hints_seen and {b for b, _ in own} <= set(hints_seen)
    assert runner.num_eager_steps == 0
    stats = hfpaged.stats(model)
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_padding_layout_of_a_mixed_step():
    """A mixed step of 2 requests (a 5-token prompt chunk and a decode) padded to 16 tokens, 9 sequences."""
    model = make_model("llama")
    hfpaged.patch(model, num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    engine = model._hfpaged.engine
    seen = []
    original = engine.runner.batch.pack

    def pack(scheduled, previous, **kwargs):
        host = original(scheduled, previous, **kwargs)
        seen.append((kwargs.get("pad_to"), host, [s.num_tokens for s in scheduled]))
        return host

    engine.runner.batch.pack = pack
    replay_eagerly(model)
    caller = Engine(model)
    first = caller.add_request([5, 6, 7], max_new_tokens=4, do_sample=False)
    while not any(o.prompt_id == first and o.new_token_ids for o in caller.step()):
        pass  # the first request decodes from now on
    caller.add_request([9, 10, 11, 12, 13], max_new_tokens=2, do_sample=False)
    while caller.has_unfinished():
        caller.step()
    mixed = [(pad, host) for pad, host, lens in seen if pad is not None and sorted(lens) == [1, 5]]
    assert mixed, [(pad, lens) for pad, _, lens in seen]
    pad, host = mixed[0]
    assert pad == (16, 9)
    at = region_slices(16, 9)
    packed = host.packed
    cu = packed[at["cu_seqlens_q"]]
    assert cu[0] == 0 and cu[2] == 6 and cu[-1] == 16 and np.all(np.diff(cu) >= 0)
    pad_lens = np.diff(cu)[2:]  # padding sequences: one token each, the last the rest; none past the tokens
    assert pad_lens.tolist() == [1, 1, 1, 1, 1, 1, 4]
    assert packed[at["seq_lens"]][2:].tolist() == pad_lens.tolist()
    assert (packed[at["slot_mapping"]][6:] == -1).all() and (packed[at["slot_mapping"]][:6] >= 0).all()
    assert packed[at["positions"]][6:].tolist() == [0] * 10  # padding: position 0 (see the next test)
    assert host.num_sampled == 2


def test_padding_stays_inside_a_learned_position_table():
    """GPT-2 embeds positions from a table of n_positions rows (a CUDA index past it is a device-side assert, which
    poisons the process). Buckets of more tokens than the table holds: the mixed graphs' capture inputs and a
    step padded by more tokens than that still give stock's tokens (found on the H100: the default
    max_num_batched_tokens of 8,192 against GPT-2's 1,024 positions)."""
    model = make_model("gpt2", seed=5, n_positions=24)
    prompts = random_prompts([20, 19, 18, 17], seed=31)
    expected = reference_generate(model, prompts, max_new_tokens=4, do_sample=False)
    hfpaged.patch(model, num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=128)
    runner = replay_eagerly(model)
    seen = []
    pack = runner.batch.pack

    def recording(*args, **kwargs):
        host = pack(*args, **kwargs)
        if kwargs.get("pad_to"):  # the padding tokens: they store nothing
            seen.append(int((host.packed[region_slices(*kwargs["pad_to"])["slot_mapping"]] == -1).sum()))
        return host

    runner.batch.pack = recording
    assert [r.token_ids for r in model.generate_many(prompts, max_new_tokens=4, do_sample=False)] == expected
    assert max(seen) > 24, seen  # a step padded past the table's rows
    graphs = runner.mixed_graphs
    at = region_slices(*graphs.shape(128))
    assert (graphs._dummy_inputs(128)[at["positions"]] == 0).all()


def run_both(arch, prompts, patch_options, eager_ok=False, **kwargs):
    """(unpadded results, padded results) of one generate_many call. ``eager_ok``: beam rows and parallel
    samples may outnumber max_num_seqs (a group runs together), and a step of more rows than any graph holds
    runs eagerly."""
    model = make_model(arch, seed=5)
    hfpaged.patch(model, **patch_options)
    plain = model.generate_many(prompts, **kwargs)
    hfpaged.patch(model, **patch_options, watermark=0.02)  # a re-patch: a fresh engine and pool
    runner = replay_eagerly(model)
    padded = model.generate_many(prompts, **kwargs)
    assert runner.num_graph_steps > 0 and (eager_ok or runner.num_eager_steps == 0)
    stats = hfpaged.stats(model)
    assert stats["num_free_blocks"] == stats["num_blocks"]
    return plain, padded


def test_padded_steps_keep_beams_forks_swaps_and_logprobs():
    """Beam rows, forked samples (seeded), swap preemption and log-probs come out of padded steps as out of
    unpadded ones."""
    prompts = random_prompts([6, 19, 11, 27], seed=21)
    options = dict(num_blocks=30, block_size=4, max_num_seqs=6, max_num_batched_tokens=32, preemption_mode="swap")
    plain, padded = run_both("llama", prompts, options, True, max_new_tokens=8, num_beams=3, num_return_sequences=2)
    assert [[s.token_ids for s in r.sequences] for r in plain] == [[s.token_ids for s in r.sequences] for r in padded]
    assert [s.score for r in plain for s in r.sequences] == pytest.approx(
        [s.score for r in padded for s in r.sequences], abs=1e-5
    )
    sampled = dict(max_new_tokens=8, do_sample=True, num_return_sequences=3, seed=9, top_k=20)
    plain, padded = run_both("qwen3", prompts, options, True, **sampled, return_logprobs=True, top_logprobs=2)
    assert [[s.token_ids for s in r.sequences] for r in plain] == [[s.token_ids for s in r.sequences] for r in padded]
    assert len({tuple(s.token_ids) for r in plain for s in r.sequences}) > len(prompts)  # samples differ
    greedy = dict(max_new_tokens=10, do_sample=False, return_logprobs=True)
    plain, padded = run_both("gemma2", prompts, options, **greedy)
    assert [r.token_ids for r in plain] == [r.token_ids for r in padded]
    for a, b in zip(plain, padded):
        assert a.sequences[0].logprobs == pytest.approx(b.sequences[0].logprobs, abs=1e-5)


def test_mixed_graphs_out_of_memory_keeps_the_decode_graphs(monkeypatch):
    """Capturing the mixed-step graphs runs out of memory: those steps run eagerly, decode steps still replay."""
    model = make_model("llama", seed=6)
    prompts = random_prompts([5, 14, 9], seed=22)
    expected = reference_generate(model, prompts, max_new_tokens=6, do_sample=False)
    hfpaged.patch(model, num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    runner = model._hfpaged.engine.runner
    runner.use_graphs = True

    def capture(graphs, forward):
        if graphs.mixed:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        replay_forward_eagerly(graphs, forward)

    monkeypatch.setattr(StepGraphs, "capture", capture)
    results = model.generate_many(prompts, max_new_tokens=6, do_sample=False)
    assert [r.token_ids for r in results] == expected
    assert runner.mixed_graphs is None and not runner.use_mixed_graphs and runner.use_graphs
    assert runner.graphs is not None and runner.num_graph_steps > 0 and runner.num_eager_steps > 0


@pytest.mark.slow
def test_short_prompt_variants_under_preemption_threads_and_changed_weights(monkeypatch):
    """The short-prompt variants (hint forced to 16, Triton attention interpreted) with a pool too small for the batch
    (recompute, then swap preemption), callers in threads, and weights changed in place: greedy equals stock
    generate throughout, and both kinds of mixed graph serve steps."""
    pytest.importorskip("triton")
    from hfpaged.model import runner as runner_module

    monkeypatch.setattr(runner_module, "short_prompt_hint", lambda layers: 16)
    chosen = record_variant_hints(monkeypatch)
    model = make_model("qwen3", seed=7)
    prompts = random_prompts([3, 17, 9, 33, 5, 24, 12, 40, 7], seed=13)
    expected = reference_generate(model, prompts, max_new_tokens=10, do_sample=False)
    options = dict(num_blocks=20, block_size=4, max_num_seqs=6, max_num_batched_tokens=32, attention_backend="triton")
    for mode in ("recompute", "swap"):
        hfpaged.patch(model, **options, preemption_mode=mode)
        replay_eagerly(model)
        chosen.clear()
        assert [r.token_ids for r in model.generate_many(prompts, max_new_tokens=10, do_sample=False)] == expected
        stats = hfpaged.stats(model)
        assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_blocks"], mode
        assert {16, None} <= {hint for *_, hint in chosen}, mode
    assert generate_in_threads(model, prompts, max_new_tokens=10, do_sample=False) == [expected[i::3] for i in range(3)]
    with torch.no_grad():  # changed in place while patched: the next steps (both kinds of mixed graph) use it
        model.model.layers[0].mlp.down_proj.weight.mul_(-2.0)
        model.model.layers[1].self_attn.k_proj.weight.add_(0.05)
    chosen.clear()
    short = [0, 2, 4, 6, 8]  # prompts of 3-12 tokens: the first step (32 tokens, runs <= 12) replays the variant
    got = [r.token_ids for r in model.generate_many([prompts[i] for i in short], max_new_tokens=10, do_sample=False)]
    assert {16, None} <= {hint for *_, hint in chosen}
    hfpaged.unpatch(model)
    changed = reference_generate(model, [prompts[i] for i in short], max_new_tokens=10, do_sample=False)
    assert changed != [expected[i] for i in short] and got == changed
