"""Beam search equals stock ``generate(num_beams=k)`` token for token (float32), in the order of the returned
sequences and with their scores, across architectures, settings, eos mid-way and a pool small enough to
preempt; the pool is all free after every run."""

import pytest
import torch
from models import make_model, random_prompts

import hfpaged

LENGTHS = [3, 9, 17]
NEW = 12


def stock_beams(model, prompts, **kwargs):
    """Stock generate on each prompt alone: [(generated ids, score)] per returned sequence, best first."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            g = model.generate(ids, return_dict_in_generate=True, output_scores=True, **kwargs)
            lengths = (g.beam_indices != -1).sum(dim=-1).tolist()
            out.append(
                [
                    (g.sequences[i, len(p) : len(p) + n].tolist(), float(g.sequences_scores[i]))
                    for i, n in enumerate(lengths)
                ]
            )
    return out


def assert_same(results, expected):
    for result, want in zip(results, expected):
        assert [s.token_ids for s in result.sequences] == [ids for ids, _ in want]
        for sequence, (_, score) in zip(result.sequences, want):
            assert sequence.score == pytest.approx(score, abs=1e-4)
        assert result.token_ids == want[0][0] and result.finish_reason == result.sequences[0].finish_reason


def all_free(model):
    stats = hfpaged.stats(model)
    return stats["num_free_blocks"] == stats["num_blocks"]


def beam_eos(model, prompts, num_beams):
    """A token the best beam of some prompt emits mid-way, so that eos ends hypotheses early."""
    free = stock_beams(model, prompts, max_new_tokens=NEW, num_beams=num_beams, do_sample=False, eos_token_id=None)
    for want in free:
        ids = want[0][0]
        if len(set(ids)) > 4:
            return ids[5]
    return free[0][0][0][5]


# (num_beams, num_return_sequences, length_penalty, early_stopping)
SETTINGS = [
    (2, 1, 1.0, False),
    (2, 2, 0.0, True),
    (3, 2, 2.0, "never"),
    (3, 3, -0.5, False),
    (4, 1, 1.0, True),
    (4, 4, 0.7, "never"),
]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2", "qwen3"])
def test_beam_search_equals_stock_generate(arch):
    model = make_model(arch)
    prompts = random_prompts(LENGTHS, seed=2)
    hfpaged.patch(model, num_blocks=96, block_size=4)
    varied = []
    for num_beams, num_return, length_penalty, early_stopping in SETTINGS:
        settings = dict(
            num_beams=num_beams,
            num_return_sequences=num_return,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            do_sample=False,
            max_new_tokens=NEW,
        )
        eos = beam_eos(model, prompts, num_beams)
        expected = stock_beams(model, prompts, eos_token_id=eos, **settings)
        results = model.generate_many(prompts, eos_token_id=eos, **settings)
        assert_same(results, expected)
        assert all(len(r.sequences) == num_return for r in results)
        varied += [len(set(s.token_ids)) > 2 for r in results for s in r.sequences if len(s.token_ids) == NEW]
        assert all_free(model)
    assert sum(varied) >= len(varied) / 2  # continuations vary, or parity proves little


def test_eos_mid_way_and_finish_reasons():
    model = make_model("llama")
    prompts = random_prompts(LENGTHS, seed=22)
    hfpaged.patch(model, num_blocks=96, block_size=4)
    eos = beam_eos(model, prompts, 3)
    settings = dict(num_beams=3, num_return_sequences=3, do_sample=False, max_new_tokens=NEW, eos_token_id=eos)
    expected = stock_beams(model, prompts, **settings)
    results = model.generate_many(prompts, **settings)
    assert_same(results, expected)
    reasons = [(s.finish_reason, len(s.token_ids), s.token_ids[-1]) for r in results for s in r.sequences]
    assert any(reason == "stop" and n < NEW and last == eos for reason, n, last in reasons), reasons
    assert all(reason == "length" and n == NEW for reason, n, last in reasons if last != eos)
    assert all(len(set(s.token_ids)) > 3 for r in results for s in r.sequences if len(s.token_ids) == NEW)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_beam_search_through_a_tiny_pool_preempts_and_stays_exact(arch):
    """Five prompts, k = 4 beams of up to 7 blocks each in a pool of 28 blocks: groups are preempted and
    recomputed. Then a token budget of 3 < k: every round's rows arrive over two steps, and the beams that
    have theirs wait, unscheduled, for their group's selection."""
    model = make_model(arch)
    prompts = random_prompts([3, 9, 17, 5, 11], seed=23)
    eos = beam_eos(model, prompts[:3], 4)
    settings = dict(
        num_beams=4, num_return_sequences=2, do_sample=False, max_new_tokens=NEW, eos_token_id=eos, length_penalty=1.5
    )
    expected = stock_beams(model, prompts, **settings)
    hfpaged.patch(model, num_blocks=28, block_size=4, max_num_seqs=16, max_num_batched_tokens=16)
    assert_same(model.generate_many(prompts, **settings), expected)
    stats = hfpaged.stats(model)
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
    hfpaged.patch(model, num_blocks=64, block_size=4, max_num_batched_tokens=3)
    assert_same(model.generate_many(prompts[:2], **settings), expected[:2])
    assert all_free(model)


def test_beams_mixed_with_other_requests_in_one_batch_and_swap_mode():
    model = make_model("llama")
    prompts = random_prompts([4, 13, 8], seed=24)
    beams = dict(num_beams=3, num_return_sequences=2, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    expected = stock_beams(model, prompts, **beams)
    with torch.no_grad():
        greedy = [
            model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    # swap preemption: beams are always recomputed, plain requests may be swapped out
    hfpaged.patch(model, num_blocks=34, block_size=4, max_num_seqs=8, preemption_mode="swap", swap_space=0.001)
    mixed = [{"prompt": p, **beams} for p in prompts] + [{"prompt": p, "max_new_tokens": NEW} for p in prompts]
    results = model.generate_many(mixed, do_sample=False, eos_token_id=None)
    assert_same(results[:3], expected)
    assert [r.token_ids for r in results[3:]] == greedy
    assert [len(r.sequences) for r in results] == [2, 2, 2, 1, 1, 1]
    stats = hfpaged.stats(model)
    assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_prefix_caching_off_gives_the_same_beams():
    model = make_model("gpt2")
    prompts = random_prompts(LENGTHS, seed=25)
    settings = dict(num_beams=3, num_return_sequences=3, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    expected = stock_beams(model, prompts, **settings)
    hfpaged.patch(model, num_blocks=64, block_size=4, enable_prefix_caching=False)
    assert_same(model.generate_many(prompts, **settings), expected)
    assert all_free(model)


def test_beam_sampling_runs_is_seeded_and_keeps_its_settings():
    model = make_model("llama")
    prompts = random_prompts([4, 10], seed=26)
    hfpaged.patch(model, num_blocks=64, block_size=4)
    settings = dict(
        num_beams=3,
        num_return_sequences=3,
        do_sample=True,
        top_k=4,
        temperature=0.7,
        max_new_tokens=8,
        eos_token_id=None,
    )
    state = torch.random.get_rng_state()
    a = model.generate_many(prompts, seed=5, **settings)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global generator is left as it was
    b = model.generate_many(prompts, seed=5, **settings)
    c = model.generate_many(prompts, seed=6, **settings)
    ids = lambda results: [[s.token_ids for s in r.sequences] for r in results]
    assert ids(a) == ids(b) and ids(a) != ids(c)
    for result in a:
        assert len(result.sequences) == 3 and all(len(s.token_ids) == 8 for s in result.sequences)
        assert len({tuple(s.token_ids) for s in result.sequences}) == 3
        assert [s.score for s in result.sequences] == sorted((s.score for s in result.sequences), reverse=True)
    # the same prompt alone with the same seed (prompt i gets seed + i) gives the same beams
    alone = model.generate_many([{"prompt": prompts[1], "seed": 7}], **settings)
    assert ids(alone) == ids(c)[1:]
    assert all_free(model)


def test_engine_reports_each_returned_sequence_and_abort_frees_the_group():
    model = make_model("llama")
    prompts = random_prompts([6, 9], seed=27)
    hfpaged.patch(model, num_blocks=64, block_size=4)
    settings = dict(num_beams=3, num_return_sequences=2, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    expected = stock_beams(model, prompts[:1], **settings)[0]
    engine = hfpaged.Engine(model)
    kept = engine.add_request(prompts[0], **settings)
    dropped = engine.add_request(prompts[1], **settings)
    outputs = []
    scheduler = engine.core.scheduler
    groups = [scheduler.requests[kept].group, scheduler.requests[dropped].group]
    for _ in range(4):
        outputs += engine.step()
        for group in groups:  # every beam's request holds exactly transformers' running sequence
            search = group.beam_search
            if len(group.members) == 3:
                for slot, member in enumerate(group.members):
                    assert member.all_token_ids == search.running_sequences[0, slot, : search.cur_len].tolist()
    # the beams share their common blocks (prompt included)
    members = groups[0].members
    tables = [engine.core.kv.block_ids(m) for m in members]
    assert len({b for t in tables for b in t}) < sum(len(t) for t in tables)
    engine.abort(dropped)
    while engine.has_unfinished():
        outputs += engine.step()
    assert [(o.request_id, o.sequence_index, o.finished) for o in outputs] == [(kept, 0, True), (kept, 1, True)]
    assert [o.token_ids for o in outputs] == [ids for ids, _ in expected]
    assert all_free(model) and not engine.prompts and not scheduler.requests


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_cuda_beam_search_with_triton_and_graphs(enforce_eager):
    model = make_model("llama").cuda()
    prompts = random_prompts([3, 9, 17, 5, 11], seed=23)
    settings = dict(
        num_beams=4, num_return_sequences=2, do_sample=False, max_new_tokens=NEW, eos_token_id=None, length_penalty=1.5
    )
    expected = stock_beams(model, prompts, **settings)
    hfpaged.patch(
        model, num_blocks=28, block_size=4, max_num_seqs=16, max_num_batched_tokens=16, enforce_eager=enforce_eager
    )
    assert_same(model.generate_many(prompts, **settings), expected)
    assert (model._hfpaged.engine.runner.num_graph_steps > 0) != enforce_eager
    state = torch.cuda.get_rng_state()
    sampled = dict(settings, do_sample=True, top_k=4)
    a = model.generate_many(prompts, seed=3, **sampled)
    assert [[s.token_ids for s in r.sequences] for r in a] == [
        [s.token_ids for s in r.sequences] for r in model.generate_many(prompts, seed=3, **sampled)
    ]
    assert torch.equal(torch.cuda.get_rng_state(), state)
    stats = hfpaged.stats(model)
    assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_beams=2, num_return_sequences=3), r"num_return_sequences. \(3\) has to be smaller or equal"),
        (dict(num_beams=2, presence_penalty=0.5), "presence_penalty with num_beams"),
        (dict(num_beams=2, logit_bias={3: 1.0}), "logit_bias with num_beams"),
        (dict(num_beams=2, top_logprobs=2), "return_logprobs with num_beams"),
        (dict(num_beams=9), "max_num_seqs is 8"),
        (dict(num_beams=8, max_new_tokens=40), r"num_beams=8 needs up to 8 x 11 blocks"),
        (dict(num_beams=2, low_memory=True), "low_memory"),
    ],
)
def test_beam_settings_that_cannot_run_raise_clearly(kwargs, message):
    model = make_model("llama")
    hfpaged.patch(model, num_blocks=64, block_size=4, max_num_seqs=8)
    with pytest.raises(ValueError, match=message):
        model.generate_many([[5, 6, 7]], **{"max_new_tokens": 4, **kwargs})
    with pytest.raises(ValueError, match="num_beams > 1"):
        next(model.stream_many([[5, 6, 7]], num_beams=2, max_new_tokens=4))
    assert all_free(model)


def test_a_beam_search_cut_by_max_time_reports_time():
    # greedy and sampled requests cut by max_time report "time"; a beam search reported "stop"
    m = make_model("llama", max_position_embeddings=4096)
    hfpaged.patch(m, num_blocks=400, block_size=16)
    prompts = random_prompts([5], seed=3)
    result = m.generate_many(prompts, max_new_tokens=2000, max_time=0.2, num_beams=2, eos_token_id=None)[0]
    assert len(result.token_ids) < 2000
    assert result.finish_reason == "time" and {s.finish_reason for s in result.sequences} == {"time"}
    stats = hfpaged.stats(m)
    assert stats["num_free_blocks"] == stats["num_blocks"]
