"""stop_strings with a real byte-level BPE tokenizer: token-exact with stock ``generate``, including
stop strings that span several tokens and end inside a token."""

import threading
import time
import warnings

import pytest
import torch
from bpe_tokenizer import make_tokenizer
from models import make_model, reference_generate

import hfpaged

NEW = 16
TEXTS = ["the stop sign", "question: what", "stars and", "café", "a quick brown"]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    m = make_model("llama", vocab_size=len(tokenizer), seed=3)
    hfpaged.patch(m, num_blocks=20, block_size=4, max_num_batched_tokens=24, tokenizer=tokenizer)
    return m


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(t)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module")
def base(tokenizer):
    """Greedy settings that keep a random model to printable ASCII tokens (so stop strings can be read)."""
    unreadable = [
        i
        for i in range(len(tokenizer))
        if i != tokenizer.eos_token_id and not (tokenizer.decode([i]).isascii() and tokenizer.decode([i]).isprintable())
    ]
    return dict(max_new_tokens=NEW, do_sample=False, suppress_tokens=unreadable)


@pytest.fixture(scope="module")
def plain(model, prompts, base):
    out = [r.token_ids for r in model.generate_many(prompts, **base)]
    assert all(len(set(o)) > 3 for o in out)
    return out


def spanning_stop_string(tokenizer, output):
    """A string from the greedy output that starts in one token and ends inside a later one (overhang)."""
    pieces = [tokenizer.decode([t]) for t in output]

    def clean(piece):
        return piece.isascii() and piece.isprintable() and piece not in tokenizer.all_special_tokens

    for k in range(1, len(pieces) - 2):
        a, b, c = pieces[k], pieces[k + 1], pieces[k + 2]
        if clean(a) and clean(b) and clean(c) and len(c) >= 2:
            return a[-1] + b + c[:-1]  # spans three tokens, ends one character before the third one does
    raise AssertionError("no printable token run in the greedy output")


def test_stop_strings_match_stock_generate(model, tokenizer, prompts, plain, base):
    stops = [spanning_stop_string(tokenizer, out) for out in plain[:3]]
    kwargs = dict(base, stop_strings=stops)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = reference_generate(model, prompts, tokenizer=tokenizer, **kwargs)
    results = model.generate_many(prompts, **kwargs)
    assert [r.token_ids for r in results] == expected
    stopped = [r for r in results if r.finish_reason == "stop"]
    assert stopped and any(len(r.token_ids) < NEW for r in stopped)
    for r in stopped:
        text = tokenizer.decode(r.prompt_token_ids + r.token_ids)
        last = tokenizer.decode(r.token_ids[-1:])
        hit = [s for s in stops if s in text]
        assert hit and not any(s in last for s in hit)  # the match spans tokens


def test_each_prompt_can_have_its_own_stop_strings(model, tokenizer, prompts, plain, base):
    batch, expected = [], []
    for i, (prompt, out) in enumerate(zip(prompts, plain)):
        stop = spanning_stop_string(tokenizer, out) if i % 2 == 0 else None
        batch.append({"prompt": prompt, "stop_strings": stop} if stop else prompt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected.append(reference_generate(model, [prompt], stop_strings=stop, tokenizer=tokenizer, **base)[0])
    results = model.generate_many(batch, **base)
    assert [r.token_ids for r in results] == expected
    assert [r.finish_reason == "stop" and len(r.token_ids) < NEW for r in results] == [True, False, True, False, True]


def test_a_stop_string_can_start_in_the_prompt(model, tokenizer, prompts, plain, base):
    first = tokenizer.decode(plain[0][:1])
    stop = tokenizer.decode(prompts[0][-1:])[-2:] + first
    kwargs = dict(base, stop_strings=[stop])
    results = model.generate_many(prompts[:1], **kwargs)
    assert [r.token_ids for r in results] == reference_generate(model, prompts[:1], tokenizer=tokenizer, **kwargs)
    assert results[0].token_ids == plain[0][:1] and results[0].finish_reason == "stop"


def test_a_user_criterion_that_raises_as_a_stop_string_completes_fails_the_request(
    model, tokenizer, prompts, plain, base
):
    # stock generate runs the user's criterion at the step a stop string completes, and raises its error (before:
    # the stop string's "stop" replaced the error, and generate_many returned normally)
    from transformers import StoppingCriteria, StoppingCriteriaList

    class RaiseAt(StoppingCriteria):
        def __init__(self, length):
            self.length, self.calls = length, 0

        def __call__(self, input_ids, scores, **kwargs):
            self.calls += 1
            if input_ids.shape[-1] >= self.length:
                raise RuntimeError("criterion raised as the stop string completed")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    kwargs = dict(base, stop_strings=[spanning_stop_string(tokenizer, plain[0])], tokenizer=tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stopped = reference_generate(model, prompts[:1], **kwargs)[0]
    assert len(stopped) < NEW  # the stop string ends generation
    stock, ours = RaiseAt(10**6), RaiseAt(10**6)  # never raise: calls counted
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference_generate(model, prompts[:1], stopping_criteria=StoppingCriteriaList([stock]), **kwargs)
    results = model.generate_many(prompts[:1], stopping_criteria=StoppingCriteriaList([ours]), **kwargs)
    assert results[0].token_ids == stopped and results[0].finish_reason == "stop"
    assert ours.calls == stock.calls == len(stopped)
    at_stop = len(prompts[0]) + len(stopped)  # the ids as the token completing the stop string arrives
    with pytest.raises(RuntimeError, match="stop string completed"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference_generate(model, prompts[:1], stopping_criteria=StoppingCriteriaList([RaiseAt(at_stop)]), **kwargs)
    with pytest.raises(RuntimeError, match="stop string completed"):
        model.generate_many(prompts[:1], stopping_criteria=StoppingCriteriaList([RaiseAt(at_stop)]), **kwargs)


def other_tokenizer(size):
    """A byte-level BPE of another corpus with ``size`` entries: the same ids read as other strings."""
    words = "zebra xylophone quartz jukebox vexing wizard mmm nnn ooo ppp qqq rrr glyph fjord nymph crwth waltz"
    out = make_tokenizer(size, corpus=[words, words.upper(), " ".join(w[::-1] for w in words.split())] * 20)
    assert len(out) == size
    return out


def test_a_tokenizer_at_a_freed_tokenizers_address_gets_its_own_stop_tables(
    model, tokenizer, prompts, base, monkeypatch
):
    """The stop-string tables are cached per tokenizer; CPython hands a freed object's address to the next one, so
    the cache must not go by ``id`` alone (a probe found a new tokenizer served the freed one's tables). Every id
    is made equal here, which is what an address reused looks like to the cache."""
    from hfpaged.sampling import stopping

    other = other_tokenizer(len(tokenizer))
    free = reference_generate(model, prompts[:1], **base)[0]
    stop = spanning_stop_string(other, free)
    want = reference_generate(model, prompts[:1], tokenizer=other, stop_strings=[stop], **base)
    assert want != reference_generate(model, prompts[:1], tokenizer=tokenizer, stop_strings=[stop], **base)
    monkeypatch.setattr(stopping, "id", lambda obj: 0, raising=False)
    for tok in (tokenizer, other):  # the first fills the cache under "address" 0
        got = model.generate_many(prompts[:1], tokenizer=tok, stop_strings=[stop], **base)
    assert [r.token_ids for r in got] == want


def test_the_stop_table_cache_is_bounded(tokenizer):
    from hfpaged.sampling.stopping import StopStringCache

    cache = StopStringCache(max_entries=2)
    first = cache.get(tokenizer, ["ab"])
    assert cache.get(tokenizer, "ab") is first  # a string and a one-string list are the same stop strings
    for stops in (["cd"], ["ef"]):
        cache.get(tokenizer, stops)
    assert len(cache._entries) == 2 and cache.get(tokenizer, ["ab"]) is not first  # the oldest was dropped


def test_stop_string_tables_are_built_outside_the_engine_lock(model, tokenizer, prompts, monkeypatch):
    # (session 39) over a large vocabulary a long stop string's tables take seconds: built under the engine's lock
    # (Engine.add_requests) or on the server's engine thread, every other request waited for them
    import hfpaged.sampling.stopping as stopping

    engine = hfpaged.Engine(model, tokenizer=tokenizer)
    lock = engine.core.lock
    built = []
    real = stopping.StopStringCriteria

    def criterion(*args, **kwargs):
        built.append(lock._is_owned())
        return real(*args, **kwargs)

    monkeypatch.setattr(stopping, "StopStringCriteria", criterion)
    stop = {"stop_strings": ["never seen 39"], "max_new_tokens": 3, "do_sample": False}
    ids = engine.add_requests(prompts[:2], [stop, {**stop, "stop_strings": "never seen 39 either"}])
    assert built == [False, False], built  # each built once, neither under the lock
    while engine.has_unfinished():
        engine.step()
    assert len(ids) == 2


def test_the_server_builds_stop_string_tables_off_its_engine_thread(model, tokenizer, monkeypatch):
    # neither the engine thread nor the caller (the single-process server's event loop, a front end's command reader)
    # builds them: a preparing thread does, then hands the commands over in the order they came
    import hfpaged.sampling.stopping as stopping
    from hfpaged.serve.engine_loop import EngineLoop
    from hfpaged.serve.messages import AbortRequests, AddRequests, Submission

    loop = EngineLoop(model, tokenizer)
    threads = []
    real = stopping.StopStringCriteria
    release = threading.Event()

    def criterion(*args, **kwargs):
        threads.append(threading.current_thread().name)
        release.wait(30)  # a slow build
        return real(*args, **kwargs)

    monkeypatch.setattr(stopping, "StopStringCriteria", criterion)
    settings = {"stop_strings": ["off the loop 39"], "max_new_tokens": 2}
    add = AddRequests(tag=1, submissions=[Submission("r1", [5, 6], settings)])
    abort = AbortRequests(["r1"])
    loop.put(add)
    loop.put(abort, 0)  # returns at once, though the build has not finished
    assert loop.commands.empty()
    release.set()
    assert [loop.commands.get(timeout=30), loop.commands.get(timeout=30)] == [(0, add), (0, abort)]
    assert threads == ["hfpaged-prepare"]


def test_the_preparer_hands_on_at_once_what_has_nothing_to_build_and_works_without_new_threads(model, monkeypatch):
    from hfpaged.serve.messages import AbortRequests, AddRequests, StopEngine, Submission
    from hfpaged.serve.preparer import CommandPreparer

    delivered = []
    preparer = CommandPreparer(delivered.append, model, None)
    preparer.put((0, AbortRequests(["x"])))  # nothing ahead of it: no thread
    assert delivered == [(0, AbortRequests(["x"]))]

    def no_threads(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", no_threads)
    add = AddRequests(2, [Submission("y", [5, 6], {"max_new_tokens": 2})])
    preparer.put((1, add))  # drained in the caller's thread
    preparer.put((None, StopEngine()))
    assert delivered[1:] == [(1, add), (None, StopEngine())]


def test_an_abort_waits_only_for_its_own_requests_add(model, monkeypatch):
    # (session 39's final review) an abort of a running request went on generating behind another request's build
    from hfpaged.serve.messages import AbortRequests, AddRequests, Submission
    from hfpaged.serve.preparer import CommandPreparer

    delivered, release = [], threading.Event()
    preparer = CommandPreparer(delivered.append, model, None)
    monkeypatch.setattr(preparer, "warm", lambda command: release.wait(30))  # a slow build
    slow = AddRequests(1, [Submission("slow", [5, 6], {"max_new_tokens": 2})])
    preparer.put((0, slow))
    preparer.put((0, AbortRequests(["running"])))  # not in a waiting add: straight on
    preparer.put((0, AbortRequests(["slow"])))  # its add is being prepared: after it
    assert delivered == [(0, AbortRequests(["running"]))]
    release.set()
    deadline = time.monotonic() + 30
    while len(delivered) < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert delivered == [(0, AbortRequests(["running"])), (0, slow), (0, AbortRequests(["slow"]))]


def test_a_failing_drain_leaves_the_preparer_usable(model):
    from hfpaged.serve.messages import AddRequests, StopEngine, Submission
    from hfpaged.serve.preparer import CommandPreparer

    delivered, calls = [], []

    def deliver(item):
        calls.append(item)
        if len(calls) == 1:
            raise RuntimeError("a deliver that fails once")
        delivered.append(item)

    preparer = CommandPreparer(deliver, model, None)
    add = AddRequests(1, [Submission("a", [5, 6], {"max_new_tokens": 2})])
    preparer.put((0, add))
    deadline = time.monotonic() + 30
    while preparer._draining and time.monotonic() < deadline:
        time.sleep(0.001)
    preparer.put((0, StopEngine()))  # nothing stuck behind the failed drain
    assert delivered == [(0, StopEngine())]
