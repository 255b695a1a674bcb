"""stream_many / astream_many / streamer=: streams add up to the non-streamed results (tokens and text,
across preemptions), text never splits a character, and closing a stream early frees the pool."""

import asyncio
import warnings

import pytest
from bpe_tokenizer import make_tokenizer
from models import make_model, reference_generate
from transformers import TextIteratorStreamer, TextStreamer

import hfpaged
from hfpaged.detokenizer import IncrementalDetokenizer

NEW = 12
TEXTS = ["the stop sign", "question: what is", "stars and", "café naïve", "a quick brown fox", "中文 🙂"]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    m = make_model("llama", vocab_size=len(tokenizer), seed=3)
    # 14 blocks of 4 for six requests of up to ~20 tokens: streams are preempted and recomputed
    hfpaged.patch(m, num_blocks=14, block_size=4, max_num_batched_tokens=24, tokenizer=tokenizer)
    return m


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(t)["input_ids"] for t in TEXTS]


def by_index(events, n):
    grouped = [[] for _ in range(n)]
    for event in events:
        grouped[event.index].append(event)
    return grouped


def assert_adds_up(events, results):
    for stream, result in zip(by_index(events, len(results)), results):
        assert [t for e in stream for t in e.token_ids] == result.token_ids
        assert "".join(e.text for e in stream) == result.text
        assert [e.finished for e in stream] == [False] * (len(stream) - 1) + [True]
        assert stream[-1].finish_reason == result.finish_reason
        assert stream[-1].result.token_ids == result.token_ids and stream[-1].result.text == result.text


def test_stream_adds_up_to_generate_many_across_preemptions(model, prompts):
    settings = dict(max_new_tokens=NEW, do_sample=False, repetition_penalty=1.2)
    results = model.generate_many(prompts, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert [r.token_ids for r in results] == reference_generate(model, prompts, **settings)
    before = hfpaged.stats(model)["num_preemptions"]
    events = list(model.stream_many(prompts, **settings))
    assert hfpaged.stats(model)["num_preemptions"] > before
    assert_adds_up(events, results)
    assert any(e.text == "" for e in events)  # some pieces were held back: characters split across tokens
    sampled = dict(max_new_tokens=NEW, do_sample=True, top_k=20, seed=5)
    assert_adds_up(list(model.stream_many(prompts, **sampled)), model.generate_many(prompts, **sampled))


def test_incremental_text_never_splits_a_character(tokenizer):
    text = "café naïve — 中文 字符 🙂 🚀 the stop sign"
    ids = tokenizer(text)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # some tokens hold part of a character
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(ids[: n + 1]) for n in range(len(ids))]
    pieces.append(detokenizer.finish(ids))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces[:-1]


def test_closing_a_stream_early_aborts_and_frees_its_blocks(model, prompts):
    stream = model.stream_many(prompts, max_new_tokens=NEW, do_sample=False)
    first = [next(stream) for _ in range(4)]
    assert hfpaged.stats(model)["num_free_blocks"] < hfpaged.stats(model)["num_blocks"]
    stream.close()
    assert all(not e.finished for e in first)
    stats = hfpaged.stats(model)
    assert stats["num_free_blocks"] == stats["num_blocks"]
    for _ in model.stream_many(prompts, max_new_tokens=NEW):  # break: the generator is collected
        break
    stats = hfpaged.stats(model)
    assert stats["num_free_blocks"] == stats["num_blocks"]
    # a stream that is never iterated queues nothing
    model.stream_many(prompts, max_new_tokens=NEW)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        model.stream_many([[]], max_new_tokens=NEW)  # bad input raises at the call, not at the first next()


def test_astream_many_yields_the_same_events_and_closes_early(model, prompts):
    settings = dict(max_new_tokens=NEW, do_sample=False)

    async def collect():
        return [e async for e in model.astream_many(prompts, **settings)]

    async def close_early():
        stream = model.astream_many(prompts, **settings)
        taken = [await stream.__anext__() for _ in range(3)]
        await stream.aclose()
        return taken

    assert_adds_up(asyncio.run(collect()), model.generate_many(prompts, **settings))
    assert len(asyncio.run(close_early())) == 3


def test_transformers_streamers_work_for_one_prompt(model, tokenizer, prompts, capsys):
    settings = dict(max_new_tokens=NEW, do_sample=False)
    ours, stock = TextIteratorStreamer(tokenizer, skip_prompt=True), TextIteratorStreamer(tokenizer, skip_prompt=True)
    result = model.generate_many(prompts[:1], streamer=ours, **settings)[0]
    reference_generate(model, prompts[:1], streamer=stock, **settings)
    assert "".join(ours) == "".join(stock) == result.text
    capsys.readouterr()
    model.generate_many(prompts[1:2], streamer=TextStreamer(tokenizer), **settings)
    printed = capsys.readouterr().out
    reference_generate(model, prompts[1:2], streamer=TextStreamer(tokenizer), **settings)
    assert printed == capsys.readouterr().out and printed.strip()
    with pytest.raises(ValueError, match="exactly one prompt"):
        model.generate_many(prompts[:2], streamer=TextStreamer(tokenizer), **settings)


def test_results_carry_per_request_metrics(model, prompts):
    for result in model.generate_many(prompts, max_new_tokens=NEW):
        m = result.metrics
        assert 0 < m["time_to_first_token"] <= m["latency"]
        assert m["tokens_per_second"] == pytest.approx(len(result.token_ids) / m["latency"])
