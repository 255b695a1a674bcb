"""hfpaged serve: a real uvicorn server on 127.0.0.1 over a tiny random Llama, driven with the official
``openai`` client (sync and async) and raw ``httpx``: both endpoints streamed and not, n, stop, seeds,
logprobs, greedy output equal to ``generate_many``, 64 concurrent streams, disconnects, a full queue,
every kind of bad input (each followed by a request that succeeds), and a graceful shutdown. Each runs with
HTTP in a front-end process of its own (the default) and with HTTP beside the engine in one process; then
the engine side's messages alone, ``generate_many`` sharing the engine with the server, a front-end process
that dies, and ``create_app`` under Starlette's test client."""

import asyncio
import contextlib
import functools
import gc
import json
import os
import pickle
import re
import signal
import socket
import sys
import threading
import time
import weakref

import httpx
import openai
import pytest
from bpe_tokenizer import make_tokenizer
from models import make_model
from openai import AsyncOpenAI, OpenAI

import hfpaged
from hfpaged.serve import Server
from hfpaged.serve.cli import build_parser
from hfpaged.serve.logprobs import TextOffsets, TokenStrings

MODEL_NAME = "tiny-llama"
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
NO_EOS = {"2": -100}  # the random model could emit eos (id 2) at any point: this keeps lengths exact
TEXTS = ["the stop sign", "question: what is", "stars and", "a quick brown fox", "café naïve", "stop here"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is the answer?"}]


@pytest.fixture(scope="module")
def tokenizer():
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def model(tokenizer):
    m = make_model("llama", vocab_size=len(tokenizer), seed=3)
    # 160 blocks of 4 slots; 32 sequences at once need more than that at 64 concurrent streams: preemption
    hfpaged.patch(m, num_blocks=160, block_size=4, max_num_seqs=32, tokenizer=tokenizer)
    return m


MODES = [True, False]  # frontend_process: HTTP in a process of its own, or in a thread beside the engine
MODE_IDS = ["frontend-process", "single-process"]


@pytest.fixture(scope="module", params=MODES, ids=MODE_IDS)
def server(request, model, tokenizer):
    srv = Server(
        model, tokenizer, port=0, served_model_name=MODEL_NAME, max_waiting=256, frontend_process=request.param
    ).start()
    yield srv
    srv.stop()
    stats = hfpaged.stats(model)
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def wait_until_idle(server, timeout=20.0):
    """Until the front end routes no request (its running + waiting gauges: it may be another process), the
    engine thread holds none and its last snapshot shows every block free."""
    loop = server.serving.engine_loop
    deadline = time.monotonic() + timeout
    while front_end_in_flight(server) or loop.unfinished or loop.stats["num_free_blocks"] != loop.stats["num_blocks"]:
        assert time.monotonic() < deadline, (front_end_in_flight(server), loop.unfinished, loop.stats)
        time.sleep(0.01)


def front_end_in_flight(server):
    """Requests the front end still routes: running + waiting (every route is one of the two)."""
    return metric(server, "hfpaged_num_requests_running") + metric(server, "hfpaged_num_requests_waiting")


def metric(server, name, labels=""):
    text = httpx.get(server.url + "/metrics").text
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def sse_events(response):
    """The JSON payloads of an SSE response, until [DONE] (which must come)."""
    events = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return events
        events.append(json.loads(line[6:]))
    raise AssertionError("the stream ended without data: [DONE]")


def good_request(client):
    out = client.completions.create(model=MODEL_NAME, prompt="the stop", max_tokens=3, temperature=0, logit_bias=NO_EOS)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3


# --- endpoints --------------------------------------------------------------------------------------


def test_models_health_metrics_and_an_idle_loop_that_sleeps(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    good_request(client)
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "hfpaged_num_requests_running",
        "hfpaged_num_requests_waiting",
        "hfpaged_kv_cache_usage_ratio",
        "hfpaged_prefix_cache_hit_rate",
        "hfpaged_generation_tokens_total",
        "hfpaged_time_to_first_token_seconds_bucket",
        "hfpaged_inter_token_latency_seconds_bucket",
    ):
        assert name in text, name
    assert metric(server, "hfpaged_generation_tokens_total") >= 3
    assert metric(server, "hfpaged_time_to_first_token_seconds_count") >= 1
    assert metric(server, "hfpaged_inter_token_latency_seconds_count") >= 2
    wait_until_idle(server)
    loop = server.serving.engine_loop
    steps = loop.num_steps
    time.sleep(0.2)
    assert loop.num_steps == steps and loop.thread.is_alive()  # idle: asleep on its command queue


def test_greedy_completions_equal_generate_many(server, client, model, tokenizer):
    settings = dict(max_tokens=12, temperature=0, logit_bias=NO_EOS)
    batch = client.completions.create(model=MODEL_NAME, prompt=TEXTS, **settings)
    single = [client.completions.create(model=MODEL_NAME, prompt=t, **settings).choices[0] for t in TEXTS]
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, **settings)
    streamed = ["" for _ in TEXTS]
    for i, text in enumerate(TEXTS):
        for chunk in client.completions.create(model=MODEL_NAME, prompt=text, stream=True, **settings):
            streamed[i] += chunk.choices[0].text
    wait_until_idle(server)  # the engine is the server's while it runs: compare once it is idle
    results = model.generate_many(
        TEXTS, tokenizer=tokenizer, max_new_tokens=12, do_sample=False, logit_bias={2: -100.0}
    )
    assert len({r.text for r in results}) > 1  # the prompts continue differently: the comparison means something
    assert [c.index for c in batch.choices] == list(range(len(TEXTS)))
    assert [c.text for c in batch.choices] == [r.text for r in results]
    assert [c.text for c in single] == [r.text for r in results]
    assert [c.text for c in by_ids.choices] == [r.text for r in results]
    assert streamed == [r.text for r in results]
    assert batch.usage.prompt_tokens == sum(len(i) for i in ids)
    assert batch.usage.completion_tokens == 12 * len(TEXTS) == sum(len(r.token_ids) for r in results)


def test_chat_greedy_streamed_and_not_agree_with_generate_many(server, client, model, tokenizer):
    settings = dict(max_tokens=10, temperature=0, logit_bias=NO_EOS)
    full = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, **settings)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=CHAT, stream=True, stream_options={"include_usage": True}, **settings
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 10
    assert full.object == "chat.completion" and full.model == MODEL_NAME and full.id.startswith("chatcmpl-")
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert full.usage.prompt_tokens == len(prompt)
    wait_until_idle(server)
    result = model.generate_many([list(prompt)], max_new_tokens=10, do_sample=False, logit_bias={2: -100.0})[0]
    assert full.choices[0].message.content == result.text


def test_n2_sampling_and_seed_reproducibility(client):
    settings = dict(model=MODEL_NAME, prompt="stars and", max_tokens=8, temperature=1.0, logit_bias=NO_EOS)
    first = client.completions.create(n=2, seed=7, **settings)
    again = client.completions.create(n=2, seed=7, **settings)
    other = client.completions.create(n=2, seed=8, **settings)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts == [c.text for c in again.choices]
    assert texts != [c.text for c in other.choices]
    assert texts[0] != texts[1]  # two samples, not one copied
    assert first.usage.completion_tokens == 16
    streamed = ["", ""]
    finishes = {}
    for chunk in client.completions.create(n=2, seed=7, stream=True, **settings):
        choice = chunk.choices[0]
        streamed[choice.index] += choice.text
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert streamed == texts and finishes == {0: "length", 1: "length"}
    one = client.completions.create(seed=11, **settings).choices[0].text
    assert one == client.completions.create(seed=11, **settings).choices[0].text
    # two prompts with n=2: choice 2p+j is sample j of prompt p
    two = client.completions.create(n=2, seed=7, **{**settings, "prompt": ["stars and", "the stop sign"]})
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert [c.text for c in two.choices[:2]] == texts


def test_n2_greedy_chat_stream(client):
    seen = {0: "", 1: ""}
    finishes = {}
    for chunk in client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, n=2, temperature=0, max_tokens=6, logit_bias=NO_EOS, stream=True
    ):
        choice = chunk.choices[0]
        seen[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert seen[0] == seen[1] != "" and finishes == {0: "length", 1: "length"}


def test_stop_strings_are_cut_from_the_text(server, client):
    settings = dict(model=MODEL_NAME, prompt="question: what is", max_tokens=16, temperature=0, logit_bias=NO_EOS)
    text = client.completions.create(**settings).choices[0].text
    # a stop string that first occurs inside the text, away from its start
    start = next(
        k
        for k in range(1, len(text) - 1)
        if text[k : k + 2].isascii() and text[k : k + 2].isprintable() and text.find(text[k : k + 2]) == k
    )
    stop = text[start : start + 2]
    cut = client.completions.create(stop=stop, **settings).choices[0]
    assert cut.text == text[:start] and cut.finish_reason == "stop"
    listed = client.completions.create(stop=["zzzz", stop], **settings).choices[0]
    assert listed.text == text[:start] and listed.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=[stop], stream=True, **settings))
    assert streamed == text[:start]
    # log-probs keep a stop string's tokens (as usage counts them); their offsets stay inside the cut text
    start = next(k for k in range(1, len(text) - 8) if text.find(text[k : k + 8]) == k and text[k - 1] != text[k])
    cut = client.completions.create(stop=text[start : start + 8], logprobs=0, **settings).choices[0]
    assert cut.text == text[:start] and len(cut.logprobs.tokens) > 2 and cut.logprobs.text_offset[-1] == start
    assert cut.logprobs.text_offset == sorted(cut.logprobs.text_offset)
    chunks = client.completions.create(stop=text[start : start + 8], logprobs=0, stream=True, **settings)
    assert [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset] == (
        cut.logprobs.text_offset
    )
    wait_until_idle(server)  # the stream's request is aborted once its text met the stop string


def test_a_stop_string_that_begins_in_the_prompt_cuts_the_completion_at_its_start(server, client):
    # the engine stops as stock generate does (prompt and completion together); the text drops the stop string's
    # completion part (a probe with a real model found " Paris." kept for stop="is Paris" after "... is")
    settings = dict(model=MODEL_NAME, prompt="the stop", max_tokens=8, temperature=0, logit_bias=NO_EOS)
    text = client.completions.create(**settings).choices[0].text
    assert len(text) >= 3
    stop = "stop" + text[:2]
    whole = client.completions.create(stop=stop, **settings).choices[0]
    assert whole.text == "" and whole.finish_reason == "stop"
    streamed = list(client.completions.create(stop=[stop], stream=True, **settings))
    assert "".join(c.choices[0].text for c in streamed) == "" and streamed[-1].choices[0].finish_reason == "stop"
    inside = client.completions.create(stop="the", **settings).choices[0]  # wholly in the prompt: no stop there
    cut = text.find("the")
    assert inside.text == (text if cut < 0 else text[:cut])
    wait_until_idle(server)  # requests whose text met a stop string are aborted after their answer


def test_a_stop_string_across_a_skipped_special_token_ends_streamed_and_whole_responses_alike(
    server, client, tokenizer
):
    # text skips special tokens, so "a" <s> "b" reads "ab"; transformers' stop criteria see the token "<s>" between
    a, b, bos = (tokenizer.convert_tokens_to_ids(t) for t in ("a", "b", "<s>"))
    names = {a: "a", b: "b", bos: "_"}
    settings = dict(model=MODEL_NAME, prompt="x", max_tokens=30, temperature=1.0, logit_bias={a: 100, b: 100, bos: 100})
    spanned = 0
    for seed in range(3):
        free = client.completions.create(seed=seed, logprobs=0, **settings).choices[0]
        drawn = "".join(names[tokenizer.convert_tokens_to_ids(t)] for t in free.logprobs.tokens)
        whole = client.completions.create(seed=seed, stop="ab", **settings)
        chunks = list(
            client.completions.create(
                seed=seed, stop="ab", stream=True, stream_options={"include_usage": True}, **settings
            )
        )
        used = whole.usage.completion_tokens
        assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks if c.choices)
        assert whole.choices[0].finish_reason == [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        assert used == chunks[-1].usage.completion_tokens
        assert (whole.choices[0].finish_reason == "stop") == ("ab" in drawn.replace("_", ""))
        spanned += "ab" not in drawn[:used] and "ab" in drawn[:used].replace("_", "")
    assert spanned  # at least one seed met "ab" only across <s>
    wait_until_idle(server)  # requests whose text met a stop string are aborted after their answer


def test_logprobs(client):
    out = client.completions.create(
        model=MODEL_NAME, prompt="the stop sign", max_tokens=6, temperature=0, logprobs=2, logit_bias=NO_EOS
    )
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert chosen <= 0 and len(top) <= 2 and max(top.values()) == pytest.approx(chosen)  # greedy: the best
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=5,
        temperature=0.8,
        seed=1,
        logprobs=True,
        top_logprobs=3,
        logit_bias=NO_EOS,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(entry.top_logprobs) == 3 for entry in content)
    assert all(entry.logprob <= 0 and entry.bytes == list(token_bytes(entry.token)) for entry in content)
    streamed = []
    for chunk in client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=5,
        temperature=0.8,
        seed=1,
        logprobs=True,
        top_logprobs=3,
        logit_bias=NO_EOS,
        stream=True,
    ):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content])


def token_bytes(name):
    """A log-prob entry's token name as bytes: ``bytes:\\xe4`` names a token that is part of a character."""
    return bytes.fromhex(name[6:].replace("\\x", "")) if name.startswith("bytes:") else name.encode()


def test_logprob_names_bytes_and_offsets_of_a_character_split_over_tokens(tokenizer):
    strings, text = TokenStrings(tokenizer), "café 中文 🙂!"
    ids = tokenizer(text)["input_ids"]
    names = [strings(t) for t in ids]
    assert sum(name.startswith("bytes:") for name in names) >= 6  # 中 and 文: three byte tokens each
    assert b"".join(strings.token_bytes(t) for t in ids) == text.encode()
    assert all(strings.token_bytes(t) == token_bytes(name) for t, name in zip(ids, names))
    offsets = TextOffsets(tokenizer, start=4)(ids)
    assert offsets == sorted(offsets) and offsets[0] == 4 and offsets[-1] == 4 + text.index("!")
    for char in "é中文":  # the first token of each character sits where the character starts
        first = next(i for i, t in enumerate(ids) if char.encode().startswith(strings.token_bytes(t)[:1]))
        assert offsets[first] == 4 + text.index(char)


def test_logprobs_of_byte_tokens_keep_each_token_apart(client, tokenizer):
    byte_ids = tokenizer("中")["input_ids"]  # each decodes alone to U+FFFD
    assert len(byte_ids) == 3
    names = {f"bytes:\\x{b:02x}" for b in "中".encode()}
    bias = {**{str(t): 100 for t in byte_ids}, **NO_EOS}
    out = client.completions.create(
        model=MODEL_NAME, prompt="the stop sign", max_tokens=4, temperature=0, logprobs=3, logit_bias=bias
    )
    logprobs = out.choices[0].logprobs
    assert all(set(top) == names for top in logprobs.top_logprobs)  # three entries, not one "\ufffd"
    assert set(logprobs.tokens) <= names
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert all(0 <= offset <= len(out.choices[0].text) for offset in logprobs.text_offset)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3, logit_bias=bias
    )
    for entry in chat.choices[0].logprobs.content:
        assert entry.token in names and entry.bytes == list(token_bytes(entry.token))
        assert {e.token for e in entry.top_logprobs} == names


def test_echo_and_default_max_tokens(client):
    out = client.completions.create(model=MODEL_NAME, prompt="stars and", echo=True, temperature=0, logit_bias=NO_EOS)
    assert out.choices[0].text.startswith("stars and") and out.usage.completion_tokens == 16  # OpenAI's default
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt="stars and", echo=True, temperature=0, logit_bias=NO_EOS, stream=True
        )
    )
    assert chunks[0].choices[0].text == "stars and"
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text


# --- load, disconnects, a full queue ------------------------------------------------------------------


def test_64_concurrent_streaming_clients(server, model):
    before = metric(server, "hfpaged_generation_tokens_total")

    async def one(client, i):
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": f"{TEXTS[i % len(TEXTS)]} {i}"}],
            max_tokens=8,
            temperature=0.7,
            seed=i,
            logit_bias=NO_EOS,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        return text, finish, usage

    async def main():
        async with AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert len(results) == 64
    assert all(finish == "length" and usage.completion_tokens == 8 for _, finish, usage in results)
    assert metric(server, "hfpaged_generation_tokens_total") - before == 64 * 8
    wait_until_idle(server)
    stats = hfpaged.stats(model)
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_client_disconnect_aborts_and_frees_blocks(server, model):
    aborted = metric(server, "hfpaged_requests_finished_total", '{finish_reason="abort"}')
    generated = metric(server, "hfpaged_generation_tokens_total")
    body = {
        "model": MODEL_NAME,
        "prompt": "the stop sign",
        "max_tokens": 400,
        "temperature": 0,
        "logit_bias": NO_EOS,
        "stream": True,
    }
    with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert sum(1 for line, _ in zip((x for x in lines if x.startswith("data: ")), range(3))) == 3
    # leaving the block closes the connection mid-stream
    wait_until_idle(server)
    assert metric(server, "hfpaged_requests_finished_total", '{finish_reason="abort"}') == aborted + 1
    assert metric(server, "hfpaged_generation_tokens_total") - generated < 400  # stopped early
    # a non-streaming client that gives up (read timeout) is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=0.3)
    wait_until_idle(server)
    assert metric(server, "hfpaged_requests_finished_total", '{finish_reason="abort"}') == aborted + 2
    stats = hfpaged.stats(model)
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.fixture(scope="module")
def one_seq_model(tokenizer):
    """A second model that decodes one sequence at a time (its own pool): others must wait."""
    m = make_model("llama", vocab_size=len(tokenizer), seed=3)
    hfpaged.patch(m, num_blocks=160, block_size=4, max_num_seqs=1, tokenizer=tokenizer)
    return m


@pytest.mark.parametrize("frontend_process", MODES, ids=MODE_IDS)
def test_queue_full_gives_429(one_seq_model, tokenizer, frontend_process):
    with Server(
        one_seq_model, tokenizer, port=0, served_model_name=MODEL_NAME, max_waiting=1, frontend_process=frontend_process
    ) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        loop = srv.serving.engine_loop
        body = {
            "model": MODEL_NAME,
            "prompt": "the stop sign",
            "max_tokens": 300,
            "temperature": 0,
            "logit_bias": NO_EOS,
            "stream": True,
        }
        with httpx.Client(timeout=60) as http, http.stream("POST", srv.url + "/v1/completions", json=body) as running:
            # keep the line iterator: once collected, httpcore closes the connection (a disconnect: an abort)
            lines = running.iter_lines()
            assert next(x for x in lines if x.startswith("data: "))  # it runs: the one slot is taken
            waiting = {}
            thread = threading.Thread(
                target=lambda: waiting.setdefault(
                    "out",
                    client.completions.create(
                        model=MODEL_NAME, prompt="stars and", max_tokens=4, temperature=0, logit_bias=NO_EOS
                    ),
                )
            )
            thread.start()
            deadline = time.monotonic() + 10
            while len(loop.waiting) < 1:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            with pytest.raises(openai.RateLimitError) as refused:
                client.completions.create(model=MODEL_NAME, prompt="a quick", max_tokens=4, temperature=0)
            assert refused.value.status_code == 429 and refused.value.body["code"] == "queue_full"
        # the running stream was closed (aborted): the waiting request gets the slot and finishes
        thread.join(30)
        assert waiting["out"].usage.completion_tokens == 4
        good_request(client)
        assert metric(srv, "hfpaged_requests_rejected_total", '{status="429"}') == 1
        # more generations than may ever wait at once: a 400 saying so, not a 429 that no retry would fix
        with pytest.raises(openai.BadRequestError, match="at most 1 may wait at once"):
            client.completions.create(model=MODEL_NAME, prompt=["a", "b"], max_tokens=2, temperature=0)
        good_request(client)
        wait_until_idle(srv)
    stats = hfpaged.stats(one_seq_model)
    assert stats["num_free_blocks"] == stats["num_blocks"]


# --- bad input ----------------------------------------------------------------------------------------

LONG_PROMPT = list(range(3, 303)) * 2  # 600 token ids: longer than the model's 512 positions

BAD_INPUTS = [
    # (path, body, status, param, words in the message)
    ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", {"model": MODEL_NAME}, 400, "prompt", "Missing required parameter"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "greater"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": 5}, 400, "prompt", "expected a string"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "temperature": 3}, 400, "temperature", "less than"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "frobnicate": 1}, 400, "frobnicate", "Unrecognized"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "suffix": "x"}, 400, "suffix", "not supported"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": LONG_PROMPT}, 400, "prompt", "maximum context length"),
    (
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 600},
        400,
        "max_tokens",
        "maximum context length",
    ),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "n": 40, "temperature": 1}, 400, None, "max_num_seqs"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "n": 129}, 400, "n", "less than or equal to 128"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [[5, 999999]]}, 400, None, "outside the vocabulary"),
    (  # greedy n > 1: one engine request per choice, whose place among them is not the client's prompt's
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": [[5, 6], [5, 999999]], "n": 2, "temperature": 0},
        400,
        None,
        "the prompt has token id 999999",
    ),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias", "token ids"),
    (
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": "hi", "logit_bias": {"1_0": 1}},
        400,
        "logit_bias",
        "token ids",
    ),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "logit_bias": {" 5": 1}}, 400, "logit_bias", "token ids"),
    (
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": "hi", "logit_bias": {"9999": 1}},
        400,
        "logit_bias",
        "outside the vocabulary",
    ),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "stop": [""]}, 400, "stop", "empty"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "best_of": True}, 400, "best_of", "not supported"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "store": 0}, 400, "store", "not supported"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo", "prompt log"),
    ("/v1/completions", {"model": "gpt-4o", "prompt": "hi"}, 404, "model", "does not exist"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": []}, 400, "messages", "at least one message"),
    (
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "user"}], "tools": [{"type": "function"}]},
        400,
        "tools",
        "tool calling",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "messages[0].role",
        "Invalid value",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": 7}]},
        400,
        "messages[0].content",
        "expected a string",
    ),
    (
        "/v1/chat/completions",
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
        },
        400,
        "messages[0].content[0]",
        "text parts only",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": CHAT, "top_logprobs": 2},
        400,
        "top_logprobs",
        "logprobs",
    ),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "stream": "yes"}, 400, "stream", "boolean"),
    # JSON may escape a lone surrogate (json.dumps does; UTF-8 cannot hold one)
    (
        "/v1/completions",
        json.dumps({"model": MODEL_NAME, "prompt": "\ud800 lone"}).encode(),
        400,
        "prompt",
        "surrogate",
    ),
    (
        "/v1/chat/completions",
        json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": "a \udfff"}]}).encode(),
        400,
        "messages[0].content",
        "not valid Unicode",
    ),
    (
        "/v1/completions",
        json.dumps({"model": MODEL_NAME, "prompt": "hi", "stop": ["\ud83d"]}).encode(),
        400,
        "stop[0]",
        "lone surrogate",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
        400,
        "messages[0].content[0].text",
        "a text part without `text`",
    ),
    ("/v1/chat/completions", {"model": "nope", "messages": CHAT}, 404, "model", "does not exist"),
    ("/v1/nothing-here", {}, 404, None, "Not Found"),
    # what json.loads itself refuses: too deep for its recursion limit, an integer of more than 4,300 digits
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None, "not valid JSON"),
    ("/v1/completions", b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", 400, None, "not valid JSON"),
    (
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "only allowed when `stream` is true",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "user"}]},
        400,
        "messages[0].content",
        "Missing required parameter",
    ),
]


@pytest.mark.parametrize(
    "path, body, status, param, words",
    BAD_INPUTS,
    ids=[f"{i}-{case[3] or case[4]}" for i, case in enumerate(BAD_INPUTS)],
)
def test_bad_input_is_refused_clearly_and_the_server_keeps_serving(server, client, path, body, status, param, words):
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    response = httpx.post(server.url + path, timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"], error
    assert error["param"] == param and error["type"]
    good_request(client)


def test_null_fields_mean_their_defaults_and_a_tiny_temperature_is_greedy(server):
    def post(path, body):
        response = httpx.post(server.url + path, json={"model": MODEL_NAME, "max_tokens": 5, **body}, timeout=30)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice.get("text", choice.get("message", {}).get("content"))

    nulls = {"n": None, "presence_penalty": None, "frequency_penalty": None, "stream": None, "logit_bias": NO_EOS}
    greedy = post("/v1/completions", {"prompt": "the stop sign", "temperature": 0, "logit_bias": NO_EOS})
    assert post("/v1/completions", {"prompt": "the stop sign", "temperature": 0, "echo": None, **nulls}) == greedy
    assert post("/v1/completions", {"prompt": "the stop sign", "temperature": 1e-30, "logit_bias": NO_EOS}) == greedy
    chat = post("/v1/chat/completions", {"messages": CHAT, "temperature": 0, "logit_bias": NO_EOS})
    extra = {"logprobs": None, "parallel_tool_calls": True}  # OpenAI's default for the latter, meaningless here
    assert post("/v1/chat/completions", {"messages": CHAT, "temperature": 0, **extra, **nulls}) == chat


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_num_seqs"):
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, n=33, temperature=1)
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: foo"):
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, extra_body={"foo": 1})
    good_request(client)


# --- shutdown, the CLI --------------------------------------------------------------------------------


@pytest.mark.parametrize("frontend_process", MODES, ids=MODE_IDS)
def test_graceful_shutdown_finishes_or_aborts_in_flight_requests(one_seq_model, tokenizer, frontend_process):
    def stream_in_thread(srv, max_tokens, out):
        body = {
            "model": MODEL_NAME,
            "prompt": "the stop sign",
            "max_tokens": max_tokens,
            "temperature": 0,
            "logit_bias": NO_EOS,
            "stream": True,
        }
        started = threading.Event()

        def run():
            try:
                with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            out.append(line)
                            started.set()
            except httpx.HTTPError as exc:  # the server may cut the connection when it aborts
                out.append(exc)
            started.set()

        thread = threading.Thread(target=run)
        thread.start()
        assert started.wait(30)
        return thread

    # time to finish: the in-flight request completes normally
    finished = []
    srv = Server(
        one_seq_model,
        tokenizer,
        port=0,
        served_model_name=MODEL_NAME,
        shutdown_timeout=30,
        frontend_process=frontend_process,
    ).start()
    thread = stream_in_thread(srv, 24, finished)
    srv.stop()
    thread.join(30)
    assert finished[-1] == "data: [DONE]" and '"finish_reason":"length"' in finished[-2]
    # no time: the request is aborted (an error event ends its stream), the thread ends, the pool is all free
    aborted = []
    srv = Server(
        one_seq_model,
        tokenizer,
        port=0,
        served_model_name=MODEL_NAME,
        shutdown_timeout=0.1,
        frontend_process=frontend_process,
    ).start()
    thread = stream_in_thread(srv, 400, aborted)
    srv.stop()
    thread.join(30)
    assert not thread.is_alive() and not srv.thread.is_alive()
    # cut off mid-stream, with an error event (before session 37 uvicorn cancelled the stream: a broken connection)
    assert isinstance(aborted[-1], str) and "shutdown timeout (0.1 s) ran out" in aborted[-1] and len(aborted) < 400
    stats = hfpaged.stats(one_seq_model)
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_cli_arguments():
    args = build_parser().parse_args(
        [
            "serve",
            "/models/x",
            "--port",
            "9000",
            "--max-num-seqs",
            "8",
            "--gpu-memory-utilization",
            "0.5",
            "--max-waiting",
            "3",
            "--dtype",
            "float32",
        ]
    )
    assert (args.model, args.port, args.max_num_seqs, args.gpu_memory_utilization, args.max_waiting, args.dtype) == (
        "/models/x",
        9000,
        8,
        0.5,
        3,
        "float32",
    )
    assert build_parser().parse_args(["serve", "--demo"]).demo
    # compile: the engine's default (None: compiled layers on CUDA) unless --compile / --no-compile says otherwise
    assert [
        build_parser().parse_args(["serve", "--demo", *flag]).compile for flag in ([], ["--compile"], ["--no-compile"])
    ] == [
        None,
        True,
        False,
    ]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dtype", "int3"])


@pytest.mark.parametrize("no_freeze", [False, True], ids=["default", "no-freeze-gc"])
def test_serve_command_freezes_the_heap_unless_told_not_to(tokenizer, monkeypatch, no_freeze):
    # `hfpaged serve` patches with freeze_gc and freezes the heap once after its warm-up; --no-freeze-gc does neither
    import gc
    import importlib

    cli = importlib.import_module("hfpaged.serve.cli")
    patch_module = importlib.import_module("hfpaged.patch")
    small = make_model("llama", vocab_size=len(tokenizer), seed=3)
    patched, events = [], []
    real_patch = patch_module.patch

    def recording_patch(model, **kwargs):
        patched.append(kwargs)
        return real_patch(model, **kwargs)

    class InterruptedServer:
        def __init__(self, *args, **kwargs):
            self.serving, self.url = type("S", (), {"model_name": "m"}), "http://x"

        def run(self):
            events.append("run")
            raise KeyboardInterrupt

    monkeypatch.setattr(cli, "load_model", lambda path, device, dtype: (small, tokenizer))
    monkeypatch.setattr(patch_module, "patch", recording_patch)
    monkeypatch.setattr(cli, "Server", InterruptedServer)
    monkeypatch.setattr(gc, "freeze", lambda: events.append("freeze"))
    monkeypatch.setattr(gc, "unfreeze", lambda: events.append("unfreeze"))
    flags = ["--no-freeze-gc"] if no_freeze else []
    cli.serve_command(build_parser().parse_args(["serve", "/models/x", "--num-blocks", "32", *flags]))
    assert patched[0]["freeze_gc"] is (not no_freeze) and patched[0]["num_blocks"] == 32
    assert events == (["run", "unfreeze"] if no_freeze else ["freeze", "run", "unfreeze"])
    assert small.generate_many([[1, 2, 3]], max_new_tokens=2, do_sample=False)[0].finish_reason == "length"
    hfpaged.unpatch(small)


# --- text as tokens arrive ----------------------------------------------------------------------------


class _DecodeOnly:
    """The tokenizer seen through ``decode`` alone (no fast backend): the windowed decoder is used."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


@pytest.mark.parametrize("fast", [True, False], ids=["decode-stream", "window"])
def test_incremental_text_adds_up_and_never_sends_a_stop_string(tokenizer, fast):
    from hfpaged.serve.text_output import IncrementalText

    text = "café naïve — 中文 🙂 the stop sign stopped the story"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text

    def pieces(stop):
        incremental = IncrementalText(tokenizer if fast else _DecodeOnly(tokenizer), stop)
        return [incremental.push(ids[: i + 1], i == len(ids) - 1) for i in range(len(ids))], incremental

    plain, incremental = pieces([])
    assert "".join(plain) == text == incremental.text and not incremental.stopped
    assert not any("\ufffd" in piece for piece in plain)  # characters split over tokens are never half sent
    for stop, expected in [
        (["stop"], "café naïve — 中文 🙂 the "),
        (["🙂", "zz"], "café naïve — 中文 "),
        (["the story"], "café naïve — 中文 🙂 the stop sign stopped "),
    ]:
        cut, incremental = pieces(stop)
        assert "".join(cut) == expected == incremental.text and incremental.stopped


def test_hfpaged_serve_is_callable_for_a_model_in_memory(monkeypatch):
    """``hfpaged.serve(model, tokenizer, ...)`` is ``hfpaged.serve.serve`` (the package stays importable)."""
    calls = []
    monkeypatch.setattr(hfpaged.serve, "serve", lambda *args, **kwargs: calls.append((args, kwargs)))
    hfpaged.serve("model", "tokenizer", port=8123)
    assert calls == [(("model", "tokenizer"), {"port": 8123})]
    assert hfpaged.serve.Server is hfpaged.Server


# --- the engine side and the two processes ------------------------------------------------------------


def test_engine_loop_ships_compact_picklable_messages(model, tokenizer):
    """The engine side alone: token ids in plain columns, one message per step, aborts free blocks, and a stop
    drains it; no text anywhere (detokenizing is the front end's)."""
    from hfpaged.serve.engine_loop import EngineLoop
    from hfpaged.serve.messages import (
        AbortRequests,
        Added,
        AddRequests,
        EngineStats,
        EngineStopped,
        StepOutputs,
        StopEngine,
        Submission,
    )

    messages = []
    loop = EngineLoop(model, tokenizer)
    loop.start([lambda message: messages.append(pickle.loads(pickle.dumps(message)))])  # as over the socket
    prompt = tokenizer("the stop sign")["input_ids"]
    greedy = dict(do_sample=False, logit_bias={2: -100.0})
    loop.put(
        AddRequests(
            0,
            [
                Submission("a", prompt, {**greedy, "max_new_tokens": 5, "return_logprobs": True, "top_logprobs": 2}),
                Submission("b", prompt, {**greedy, "max_new_tokens": 400}),
            ],
        )
    )
    loop.put(AddRequests(1, [Submission("c", prompt, {"max_new_tokens": 0})]))  # refused by the engine: a 400
    deadline = time.monotonic() + 30
    while not any(isinstance(m, StepOutputs) and "a" in [m.prompt_ids[k] for k in m.finished] for m in messages):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    loop.put(AbortRequests(["b"]))
    while loop.unfinished:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    loop.put(StopEngine())
    loop.thread.join(30)
    assert not loop.thread.is_alive()
    added = [m for m in messages if isinstance(m, Added)]
    assert added[0] == Added(0, None) and added[1].tag == 1 and added[1].error[0] == "invalid"
    steps = [m for m in messages if isinstance(m, StepOutputs)]
    deltas = [d for m in steps for d in m.deltas()]
    a = [d for d in deltas if d.prompt_id == "a"]
    assert sum(len(d.new_token_ids) for d in a) == 5 and a[-1].finish_reason == "length"
    assert all(len(d.new_logprobs) == len(d.new_token_ids) and len(d.new_top_logprobs[0]) == 2 for d in a)
    assert all(type(t) is int for d in deltas for t in d.new_token_ids)
    assert all(d.finish_reason is None for d in deltas if d.prompt_id == "b")  # aborted, not finished
    assert 5 < sum(len(d.new_token_ids) for d in deltas if d.prompt_id == "b") < 400
    assert {prompt_id for m in steps for prompt_id in m.prompt_ids} == {"a", "b"}
    assert isinstance(messages[-1], EngineStopped) and any(isinstance(m, EngineStats) for m in messages)
    stats = hfpaged.stats(model)
    assert stats["num_free_blocks"] == stats["num_blocks"] == messages[-1].stats["num_free_blocks"]


def test_generate_many_shares_the_engine_with_a_running_server(server, client, model, tokenizer):
    """Another thread's ``generate_many`` runs while the server streams: both get exactly their own results."""
    settings = dict(max_new_tokens=10, do_sample=False, logit_bias={2: -100.0})
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    wait_until_idle(server)
    expected = model.generate_many(prompts, **settings)
    streamed, times = {}, {}

    def stream(i):
        text = ""
        for chunk in client.completions.create(
            model=MODEL_NAME, prompt=TEXTS[i], max_tokens=60, temperature=0, logit_bias=NO_EOS, stream=True
        ):
            text += chunk.choices[0].text
            times.setdefault(i, time.monotonic())
        streamed[i] = (text, time.monotonic())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(TEXTS))]
    for thread in threads:
        thread.start()
    while len(times) < len(TEXTS):  # every stream has its first token
        time.sleep(0.005)
    started = time.monotonic()
    results = model.generate_many(prompts, **settings)
    for thread in threads:
        thread.join(60)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert any(end > started for _, end in streamed.values())  # they did run at the same time
    served = client.completions.create(model=MODEL_NAME, prompt=TEXTS, max_tokens=60, temperature=0, logit_bias=NO_EOS)
    assert [streamed[i][0] for i in range(len(TEXTS))] == [c.text for c in served.choices]
    assert len({text for text, _ in streamed.values()}) > 1


@pytest.mark.parametrize("why", ["lambda", "__main__"])
def test_a_tokenizer_that_cannot_be_pickled_is_served_from_this_process(model, caplog, monkeypatch, why):
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    if why == "lambda":
        tok.callback = lambda: None  # pickle refuses lambdas: the front-end process could not get this tokenizer
    else:  # a class of the user's script pickles here, but the child process has another __main__
        main_class = type("ScriptTokenizer", (type(tok),), {"__module__": "__main__"})
        monkeypatch.setattr(sys.modules["__main__"], "ScriptTokenizer", main_class, raising=False)
        tok.__class__ = main_class
        assert b"__main__" in pickle.dumps(tok)
    with (
        caplog.at_level("WARNING", logger="hfpaged.serve"),
        Server(model, tok, port=0, served_model_name=MODEL_NAME) as srv,
    ):
        assert srv.frontend is None and "cannot be pickled" in caplog.text
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        done = client.completions.create(model=MODEL_NAME, prompt=TEXTS[0], max_tokens=5, temperature=0)
        assert done.usage.completion_tokens == 5
    stats = hfpaged.stats(model)
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_a_front_end_process_that_dies_frees_what_it_left(one_seq_model, tokenizer):
    srv = Server(one_seq_model, tokenizer, port=0, served_model_name=MODEL_NAME).start()
    assert srv.frontend.pid != os.getpid() and srv.frontend.process.poll() is None
    body = {"model": MODEL_NAME, "prompt": "the stop sign", "max_tokens": 400, "temperature": 0, "stream": True}
    body["logit_bias"] = NO_EOS
    with pytest.raises(httpx.HTTPError), httpx.stream("POST", srv.url + "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                os.kill(srv.frontend.pid, signal.SIGKILL)
    srv.thread.join(30)  # the engine loop saw the channel close: it aborted the stream and ended
    assert not srv.thread.is_alive() and srv.serving.engine_loop.num_steps < 400
    stats = hfpaged.stats(one_seq_model)
    assert stats["num_free_blocks"] == stats["num_blocks"]
    srv.stop()
    with pytest.raises(httpx.ConnectError):  # nobody listens any more
        httpx.get(srv.url + "/health", timeout=5)


def test_create_app_serves_in_one_process(model, tokenizer):
    from starlette.testclient import TestClient

    from hfpaged.serve import create_app

    app = create_app(model, tokenizer, served_model_name=MODEL_NAME)
    expected = model.generate_many(
        [TEXTS[0]], tokenizer=tokenizer, max_new_tokens=6, do_sample=False, logit_bias={2: -100.0}
    )
    for _ in range(2):  # a second lifespan of the same app (before: "threads can only be started once")
        with TestClient(app) as http:
            out = http.post(
                "/v1/completions",
                json={"prompt": TEXTS[0], "max_tokens": 6, "temperature": 0, "logit_bias": NO_EOS},
            ).json()
            assert http.get("/health").json() == {"status": "ok"}
        assert out["choices"][0]["text"] == expected[0].text and out["usage"]["completion_tokens"] == 6


def test_an_app_whose_lifespan_did_not_run_says_so(model, tokenizer):
    # httpx's ASGITransport runs no lifespan: before, a 503 said "the server is shutting down"
    from hfpaged.serve import create_app

    app = create_app(model, tokenizer, served_model_name=MODEL_NAME)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
            body = {"prompt": TEXTS[0], "max_tokens": 2}
            return (await http.get("/health")), (await http.post("/v1/completions", json=body))

    health, response = asyncio.run(main())
    assert health.status_code == 503 and health.json() == {"status": "not started"}
    assert response.status_code == 503 and response.json()["error"]["code"] == "not_started"
    assert "lifespan" in response.json()["error"]["message"]


@pytest.mark.parametrize("frontend_process", MODES, ids=MODE_IDS)
def test_a_model_patched_again_while_serving_keeps_serving(tokenizer, frontend_process):
    # before: the loop kept its engine handle of the first patch: every later request failed with 500 ("make a new
    # one"), and a re-patch with a stream in flight killed the loop (its pool figures read between the unpatch and
    # the patch), leaving 503s for good while /health said ok
    m = make_model("llama", vocab_size=len(tokenizer), seed=3)
    hfpaged.patch(m, num_blocks=160, block_size=4, max_num_seqs=8, tokenizer=tokenizer)
    body = {"model": MODEL_NAME, "prompt": "the stop sign", "temperature": 0, "logit_bias": NO_EOS}
    with Server(m, tokenizer, port=0, served_model_name=MODEL_NAME, frontend_process=frontend_process) as srv:
        url = srv.url + "/v1/completions"
        assert httpx.post(url, json=dict(body, max_tokens=4), timeout=60).status_code == 200
        hfpaged.patch(m, num_blocks=96, block_size=8, max_num_seqs=4, tokenizer=tokenizer)  # idle
        finish = []

        def stream():
            with httpx.stream("POST", url, json=dict(body, max_tokens=500, stream=True), timeout=60) as response:
                finish.extend(e["choices"][0]["finish_reason"] for e in sse_events(response) if e.get("choices"))

        thread = threading.Thread(target=stream)
        thread.start()
        deadline = time.monotonic() + 20
        while not srv.serving.engine_loop.unfinished:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        hfpaged.patch(m, num_blocks=128, block_size=4, max_num_seqs=8, tokenizer=tokenizer)  # with a stream running
        thread.join(30)
        assert finish[-1] == "abort"
        response = httpx.post(url, json=dict(body, max_tokens=6), timeout=60)
        assert response.status_code == 200 and httpx.get(srv.url + "/health").status_code == 200
        expected = m.generate_many(["the stop sign"], tokenizer=tokenizer, max_new_tokens=6, do_sample=False,
                                   suppress_tokens=[2])[0].text  # fmt: skip
        assert response.json()["choices"][0]["text"] == expected
    stats = hfpaged.stats(m)
    assert stats["num_blocks"] == 128 and stats["num_free_blocks"] == stats["num_blocks"]


def test_a_re_patch_ends_every_request_of_the_old_engine_and_the_limits_follow_the_new_pool(tokenizer):
    # an n = 2 prompt still waiting at the re-patch had only its first sequence reported ("abort"): its HTTP request
    # waited for the second for ever. Chat requests without max_tokens were then refused (400) against the old pool.
    import queue

    from hfpaged.serve.engine_loop import EngineLoop
    from hfpaged.serve.messages import Added, AddRequests, RequestsFailed, StepOutputs, StopEngine, Submission

    m = make_model("llama", vocab_size=len(tokenizer), seed=3)
    hfpaged.patch(m, num_blocks=160, block_size=4, max_num_seqs=2, tokenizer=tokenizer)
    loop, inbox = EngineLoop(m, tokenizer), queue.SimpleQueue()
    loop.start([inbox.put])
    try:
        long = dict(max_new_tokens=400, min_new_tokens=400)
        loop.put(AddRequests(1, [Submission("A", [5, 6, 7, 8, 9], long, 1)]))
        while not (isinstance(message := inbox.get(timeout=30), StepOutputs) and "A" in message.prompt_ids):
            pass
        sampled = dict(max_new_tokens=5, do_sample=True, num_return_sequences=2)
        loop.put(
            AddRequests(2, [Submission("B", [5, 6, 7], sampled, 2)])
        )  # waits: its two sequences do not fit beside A
        while not (isinstance(message := inbox.get(timeout=30), Added) and message.tag == 2):
            pass
        hfpaged.patch(m, num_blocks=40, block_size=4, max_num_seqs=2, tokenizer=tokenizer)
        ended: dict[str, int] = {}
        deadline = time.monotonic() + 20
        while ended.get("A", 0) < 1 or ended.get("B", 0) < 2:
            assert time.monotonic() < deadline, ended
            with contextlib.suppress(queue.Empty):
                message = inbox.get(timeout=0.2)
                if isinstance(message, StepOutputs):
                    for k in message.finished:
                        ended[message.prompt_ids[k]] = ended.get(message.prompt_ids[k], 0) + 1
                elif isinstance(message, RequestsFailed):
                    for request_id in message.request_ids:
                        ended[request_id] = 2
        loop.put(AddRequests(3, [Submission("C", [5, 6], dict(max_new_tokens=2), 1)]))  # on the new engine
        while not (isinstance(message := inbox.get(timeout=30), StepOutputs) and 0 in message.finished):
            pass
        assert message.prompt_ids == ["C"] and message.finished[0][0] == "length"
        assert not loop.unfinished and loop.stats["num_blocks"] == 40
    finally:
        loop.put(StopEngine(), None)
        loop.thread.join(10)
    with Server(m, tokenizer, port=0, served_model_name=MODEL_NAME, frontend_process=False) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        hfpaged.patch(m, num_blocks=24, block_size=4, max_num_seqs=2, tokenizer=tokenizer)  # a smaller pool still
        good_request(client)  # the engine thread sees the re-patch
        out = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=0, logit_bias=NO_EOS)
        assert out.choices[0].finish_reason == "length" and out.usage.total_tokens == 24 * 4


def test_an_unpatch_while_serving_leaves_the_engine_loop_idle_and_alive(tokenizer):
    # the loop ends the old engine's requests, empties its handle and waits (it does not step a detached engine),
    # then serves again once the model is patched (the narrower race of a request joining between the unpatch's
    # aborts and its detach, which did spin, needs hooks inside patch to reproduce: notes/reliability.md)
    import queue

    from hfpaged.serve.engine_loop import EngineLoop
    from hfpaged.serve.messages import Added, AddRequests, StepOutputs, StopEngine, Submission

    m = make_model("llama", vocab_size=len(tokenizer), seed=3)
    hfpaged.patch(m, num_blocks=64, block_size=4, tokenizer=tokenizer)
    loop, inbox = EngineLoop(m, tokenizer), queue.SimpleQueue()
    loop.start([inbox.put])
    try:
        loop.put(AddRequests(1, [Submission("A", [5, 6, 7], dict(max_new_tokens=200, min_new_tokens=200), 1)]))
        while not (isinstance(message := inbox.get(timeout=30), StepOutputs) and "A" in message.prompt_ids):
            pass
        hfpaged.unpatch(m)
        deadline = time.monotonic() + 10
        while loop.unfinished or loop.engine.has_unfinished():
            assert time.monotonic() < deadline, (loop.unfinished, loop.engine.prompts)
            time.sleep(0.01)
        steps = loop.num_steps
        time.sleep(0.3)
        assert loop.num_steps == steps and loop.alive  # idle, not stepping a detached engine
        hfpaged.patch(m, num_blocks=64, block_size=4, tokenizer=tokenizer)
        loop.put(AddRequests(2, [Submission("B", [5, 6], dict(max_new_tokens=2), 1)]))
        while not (isinstance(message := inbox.get(timeout=30), Added) and message.tag == 2):
            pass
        assert message.error is None
    finally:
        loop.put(StopEngine(), None)
        loop.thread.join(10)


def test_a_request_meeting_a_re_patch_inside_its_checks_runs_on_the_new_engine(tokenizer, monkeypatch):
    # a re-patch (another thread) landing while add_requests checks the request (inside check_weights) left the
    # handle's state gone: a ReferenceError, which the loop's retry (RuntimeError only) let through as a 500
    import queue
    import threading

    import torch

    import hfpaged.engine as engine_module
    from hfpaged.serve.engine_loop import EngineLoop
    from hfpaged.serve.messages import Added, AddRequests, StepOutputs, Submission

    m = make_model("llama", vocab_size=len(tokenizer), seed=3)
    prompt, settings = [5, 6, 7, 8], dict(max_new_tokens=4, do_sample=False, suppress_tokens=[2])
    expected = m.generate(torch.tensor([prompt]), **settings)[0, 4:].tolist()
    hfpaged.patch(m, num_blocks=64, block_size=4, tokenizer=tokenizer)
    loop, inbox = EngineLoop(m, tokenizer), queue.SimpleQueue()
    loop.sends, loop.open_sources = [inbox.put], {0}  # stepped from this thread (no engine thread)
    real, fired = engine_module.refresh_length_limit, []

    def refresh(model, state):
        if not fired:
            fired.append(1)
            thread = threading.Thread(target=hfpaged.patch, args=(m,), kwargs=dict(num_blocks=48, block_size=8))
            thread.start()
            thread.join()
        return real(model, state)

    monkeypatch.setattr(engine_module, "refresh_length_limit", refresh)
    loop._add([(0, AddRequests(1, [Submission("A", prompt, settings, 1)]))])
    monkeypatch.undo()
    messages = []
    for _ in range(20):
        if not loop.engine.has_unfinished():
            break
        loop._step()
    while not inbox.empty():
        messages.append(inbox.get())
    added = [x for x in messages if isinstance(x, Added)]
    assert fired and len(added) == 1 and added[0].error is None
    tokens = [t for x in messages if isinstance(x, StepOutputs) and "A" in x.prompt_ids
              for t in x.new_token_ids[x.prompt_ids.index("A")]]  # fmt: skip
    assert tokens == expected


def test_a_request_holding_the_pad_token_id_is_served_with_every_token_attended(tokenizer):
    # generate_many refuses such a prompt unless told (generate would mask those positions without a mask); an HTTP
    # client cannot give a mask: the server attends every token, as an all-ones attention_mask does
    import torch

    m = make_model("llama", vocab_size=len(tokenizer), seed=3)
    m.generation_config.pad_token_id = tokenizer.pad_token_id
    hfpaged.patch(m, num_blocks=64, block_size=4, tokenizer=tokenizer)
    prompt = [5, tokenizer.pad_token_id, 6]
    with pytest.raises(ValueError, match="holds the pad token id"):
        m.generate_many([prompt], max_new_tokens=3)
    with Server(m, tokenizer, port=0, served_model_name=MODEL_NAME, frontend_process=False) as srv:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, "logit_bias": NO_EOS}
        response = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200
    batch = torch.tensor([prompt])
    expected = m.generate_many(batch, attention_mask=torch.ones_like(batch), tokenizer=tokenizer, max_new_tokens=4,
                               do_sample=False, suppress_tokens=[2])[0].text  # fmt: skip
    assert response.json()["choices"][0]["text"] == expected


def test_the_servers_context_length_is_a_models_length_limit():
    # a dynamic-RoPE model is exact only up to max_position_embeddings (tests/test_model_support.py); a longrope
    # one past its original length too (tests/test_long_rope.py)
    from models import LONGROPE

    from hfpaged.serve.engine_loop import model_limits

    dynamic = dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)
    model = make_model("llama", rope_parameters=dynamic, max_position_embeddings=16)
    hfpaged.patch(model, num_blocks=32)
    assert model_limits(model).max_model_len == 16
    model = make_model("llama", rope_parameters=LONGROPE, max_position_embeddings=64)
    hfpaged.patch(model, num_blocks=32)
    assert model_limits(model).max_model_len == 64
    plain = make_model("llama")
    hfpaged.patch(plain, num_blocks=32)
    assert model_limits(plain).max_model_len == plain.config.max_position_embeddings


def test_short_prompts_of_a_longrope_model_that_computes_past_l_without_context_get_that_bound(monkeypatch):
    # Phi-3 on transformers < 5.20 (hfpaged/model/long_rope.py: such requests are refused past L + 1 tokens): the
    # server's default completion stops there, and a longer one is a context-length error, not an engine failure
    from models import LONGROPE

    from hfpaged.model import hf_compat
    from hfpaged.serve.engine_loop import model_limits
    from hfpaged.serve.errors import APIError
    from hfpaged.serve.request_params import completion_budget

    monkeypatch.setattr(hf_compat, "longrope_crossing", lambda model, original: "drop")
    model = make_model(
        "phi3", rope_parameters=LONGROPE, max_position_embeddings=64, original_max_position_embeddings=16
    )
    hfpaged.patch(model, num_blocks=32)
    limits = model_limits(model)
    assert limits.max_total_tokens == 64 and limits.short_prompts == (16, 17)
    budget = functools.partial(completion_budget, limits=limits, default=None, prompt_param="prompt")
    assert budget(None, 5) == 12 and budget(None, 16) == 1 and budget(None, 17) == 47
    assert budget(12, 5) == 12 and budget(40, 20) == 40
    with pytest.raises(APIError, match="maximum length for prompts of at most 16 tokens is 17 tokens"):
        budget(13, 5)
    prompt = list(range(3, 8))
    assert len(model.generate_many([prompt], max_new_tokens=budget(None, 5), do_sample=False)[0].token_ids) == 12


def test_prompts_are_tokenized_off_the_event_loop(model, tokenizer, monkeypatch):
    """Tokenization and chat templates run on the front end's tokenizer thread: a huge prompt (a probe sent 8 MB)
    no longer stalls every stream of the front end while it is tokenized and found too long."""
    from hfpaged.serve import chat, completions

    seen = []
    for module, name in ((completions, "prompt_token_ids"), (chat, "chat_prompt_token_ids")):
        original = getattr(module, name)

        def recorded(*args, original=original):
            seen.append(threading.current_thread().name)
            return original(*args)

        monkeypatch.setattr(module, name, recorded)
    with Server(model, tokenizer, port=0, served_model_name=MODEL_NAME, frontend_process=False) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        good_request(client)
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            client.completions.create(model=MODEL_NAME, prompt="the stop sign " * 4000, max_tokens=2)
    assert len(seen) == 3 and all(name.startswith("hfpaged-tokenizer") for name in seen), seen


def test_a_client_that_leaves_while_sending_its_body_is_no_server_error(model, tokenizer, caplog):
    with Server(model, tokenizer, port=0, served_model_name=MODEL_NAME, frontend_process=False) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        for path in ("/v1/completions", "/v1/chat/completions"):
            with socket.create_connection((host, int(port))) as sock:
                head = (
                    f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                )
                sock.sendall(head.encode() + b'{"model":')
        deadline = time.monotonic() + 20
        while 'hfpaged_requests_rejected_total{status="499"} 2.0' not in httpx.get(srv.url + "/metrics").text:
            assert time.monotonic() < deadline, "the two disconnects were never answered"
            time.sleep(0.05)
        good_request(OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60))
    assert not [r for r in caplog.records if "Exception in ASGI application" in r.getMessage()]


def test_a_request_meeting_an_unpatch_inside_its_checks_gets_a_503(tokenizer, monkeypatch):
    # an unpatch (another thread) landing after add_requests' checks passed: the request used to fail with a bare
    # ReferenceError (a 500), or join the old, detached engine whose next step failed inside the forward (500 "the
    # engine step failed"; under load, session 36's server probe); the closed engine now refuses it:
    # "unavailable", the front end's 503
    import queue
    import threading

    import hfpaged.engine as engine_module
    from hfpaged.serve.engine_loop import EngineLoop
    from hfpaged.serve.errors import model_unpatched
    from hfpaged.serve.messages import Added, AddRequests, Submission

    m = make_model("llama", vocab_size=len(tokenizer), seed=3)
    hfpaged.patch(m, num_blocks=64, block_size=4, tokenizer=tokenizer)
    loop, inbox = EngineLoop(m, tokenizer), queue.SimpleQueue()
    loop.sends, loop.open_sources = [inbox.put], {0}  # stepped from this thread (no engine thread)
    real, fired = engine_module.EngineCore.check_weights, []

    def checks(core, model):
        real(core, model)
        if not fired:  # the checks have passed: the model is unpatched before the request joins
            fired.append(1)
            thread = threading.Thread(target=hfpaged.unpatch, args=(m,))
            thread.start()
            thread.join()

    monkeypatch.setattr(engine_module.EngineCore, "check_weights", checks)
    loop._add([(0, AddRequests(1, [Submission("A", [5, 6, 7], dict(max_new_tokens=4), 1)]))])
    monkeypatch.undo()
    messages = []
    while not inbox.empty():
        messages.append(inbox.get())
    added = [x for x in messages if isinstance(x, Added)]
    assert fired and len(added) == 1 and added[0].error[0] == "unavailable", added
    assert not loop.engine.has_unfinished() and loop.engine.core.closed
    error = model_unpatched()
    assert error.status_code == 503 and "not patched now" in str(error)


def test_a_stopped_in_process_server_lets_the_model_go(tokenizer):
    # FastAPI keeps endpoint functions in a module-level cache: the routes closed over the serving context, so a
    # stopped in-process server kept its engine loop, the model and its KV pool (and a tokenizer thread) alive
    m = make_model("llama", vocab_size=len(tokenizer), seed=3)
    hfpaged.patch(m, num_blocks=64, block_size=4, tokenizer=tokenizer)
    with Server(m, tokenizer, port=0, served_model_name=MODEL_NAME, frontend_process=False) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        good_request(client)
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2)
        assert httpx.get(srv.url + "/v1/models").status_code == httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/metrics").status_code == 200
    model, pool = weakref.ref(m), weakref.ref(m._hfpaged.kv_caches[0][0])
    del m, srv, client
    gc.collect()
    assert model() is None and pool() is None


@pytest.mark.parametrize(
    "option,value",
    [("shutdown_timeout", float("nan")), ("switch_interval", 0), ("log_level", "bogus"), ("max_waiting", "5"),
     ("served_model_name", 5), ("api_server_count", 0)],
)  # fmt: skip
def test_server_options_are_checked_before_anything_starts(model, tokenizer, option, value):
    # (session 39: a nan shutdown_timeout served, then crashed the front end on stop; the others gave bare errors)
    with pytest.raises(ValueError, match=f"^{option} must be"):
        Server(model, tokenizer, port=0, **{option: value})


@pytest.mark.parametrize("frontend_process", MODES, ids=MODE_IDS)
def test_a_server_started_again_is_refused_and_keeps_serving(model, tokenizer, frontend_process):
    # before: a second start killed the running front end (a process of its own), or (single process) returned as if
    # it served while its uvicorn thread failed, and stop() then left the first one running
    with Server(model, tokenizer, port=0, served_model_name=MODEL_NAME, frontend_process=frontend_process) as srv:
        with pytest.raises(RuntimeError, match="started already; a Server serves once"):
            srv.start()
        good_request(OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60))
    with pytest.raises(RuntimeError, match="started already"):
        srv.start()
    with pytest.raises(RuntimeError, match="started already"):
        srv.run()
    threads = [srv.thread, srv.serving.engine_loop.thread]  # uvicorn's or the engine's; the engine loop's
    assert not [t for t in threads if t is not None and t.is_alive()]


@pytest.mark.parametrize("frontend_process", MODES, ids=MODE_IDS)
def test_requests_running_at_the_shutdown_timeout_get_an_openai_error(tokenizer, frontend_process, caplog):
    # before: uvicorn cancelled them itself at its graceful-shutdown deadline: a traceback each in the log, and a
    # plain-text 500 for a client waiting for the whole answer
    m = make_model("llama", vocab_size=len(tokenizer), seed=3)
    hfpaged.patch(m, num_blocks=160, block_size=4, tokenizer=tokenizer)
    slow = m.model.layers[0].register_forward_pre_hook(lambda module, args: time.sleep(0.02))  # 500 tokens: ~10 s
    body = {"model": MODEL_NAME, "prompt": "the stop sign", "max_tokens": 500, "temperature": 0, "logit_bias": NO_EOS}
    results = {}
    try:
        srv = Server(m, tokenizer, port=0, served_model_name=MODEL_NAME, frontend_process=frontend_process,
                     shutdown_timeout=1).start()  # fmt: skip
        url = srv.url + "/v1/completions"

        def whole():
            results["whole"] = httpx.post(url, json=body, timeout=60)

        def stream():
            with httpx.stream("POST", url, json=dict(body, stream=True), timeout=60) as response:
                results["stream"] = [line for line in response.iter_lines() if line.startswith("data: ")]

        threads = [threading.Thread(target=whole), threading.Thread(target=stream)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 20
        while len(srv.serving.engine_loop.unfinished) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        srv.stop()
        for thread in threads:
            thread.join(30)
    finally:
        slow.remove()
    whole = results["whole"]
    assert whole.status_code == 500, whole.text
    assert whole.json()["error"]["type"] == "server_error" and "shutdown timeout" in whole.json()["error"]["message"]
    last = json.loads(results["stream"][-1].removeprefix("data: "))
    assert "shutdown timeout" in last["error"]["message"], results["stream"][-3:]
    assert not [r for r in caplog.records if "Exception in ASGI application" in r.getMessage()]
    stats = hfpaged.stats(m)
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_past_the_shutdown_timeout_new_requests_get_a_503():
    # the requests in flight were failed at the shutdown timeout, but one still reading its body then reached add()
    # and ran until uvicorn cancelled it at its own deadline (a traceback, a plain-text 500)
    from hfpaged.serve.engine_client import EngineClient
    from hfpaged.serve.errors import APIError
    from hfpaged.serve.messages import AbortRequests, Submission

    async def scenario():
        client = EngineClient(max_waiting=8)
        sent = []
        client.connect(sent.append)
        client.fail_in_flight("the server stopped")
        with pytest.raises(APIError) as refused:
            await asyncio.wait_for(client.add([Submission("late", [5, 6], {})], time.monotonic()), 5)
        return refused.value, sent

    refused, sent = asyncio.run(scenario())
    assert refused.status_code == 503 and not [m for m in sent if not isinstance(m, AbortRequests)]
