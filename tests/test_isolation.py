"""What one caller does reaches only that caller: a user callback that raises fails its own request (the other
callers of the shared engine go on, token-exact), and ``unpatch`` (or a re-patch) ends every caller's wait."""

import threading
import time

import pytest
from models import make_model, random_prompts, reference_generate
from transformers import LogitsProcessor, StoppingCriteria

import hfpaged


@pytest.fixture
def model():
    m = make_model("llama", seed=21)
    hfpaged.patch(m, num_blocks=48, block_size=4, max_num_seqs=6, max_num_batched_tokens=32)
    return m


def clean(m):
    st = hfpaged.stats(m)
    idle = st["num_running_requests"] == st["num_waiting_requests"] == 0
    return idle and st["num_free_blocks"] == st["num_blocks"]


def exact(m, prompts):
    got = [r.token_ids for r in m.generate_many(prompts, max_new_tokens=8, do_sample=False)]
    return got == reference_generate(m, prompts, max_new_tokens=8, do_sample=False)


class RaiseAt(LogitsProcessor):
    """Raises ``error`` once the sequence has ``length`` tokens."""

    def __init__(self, length, error):
        self.length, self.error = length, error

    def __call__(self, input_ids, scores):
        if input_ids.shape[-1] >= self.length:
            raise self.error
        return scores


class StopRaises(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        raise KeyError("criterion bug")


PROMPTS = random_prompts([5, 11, 3], seed=4)


def test_a_handles_raising_processor_fails_its_request_only(model):
    engine = hfpaged.Engine(model)
    bad = engine.add_request(PROMPTS[0], max_new_tokens=6, logits_processor=[RaiseAt(0, ZeroDivisionError("bug"))])
    good = engine.add_request(PROMPTS[1], max_new_tokens=6, do_sample=False)
    # another caller steps the shared engine (it runs the handle's requests too): its results are exact, not the error
    assert exact(model, PROMPTS[1:])
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    finished = {o.request_id: o for o in outputs if o.finished}
    assert finished[bad].finish_reason == "error" and finished[bad].error == "ZeroDivisionError: bug"
    expected = reference_generate(model, [PROMPTS[1]], max_new_tokens=6, do_sample=False)[0]
    assert finished[good].finish_reason == "length" and finished[good].token_ids == expected
    assert clean(model)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(logits_processor=[RaiseAt(8, ZeroDivisionError("bug"))]),
        dict(stopping_criteria=[StopRaises()]),
        dict(prefix_allowed_tokens_fn=lambda batch_id, ids: 1 / 0),
        dict(logits_processor=[RaiseAt(8, ZeroDivisionError("bug"))], num_beams=2),
        dict(logits_processor=[RaiseAt(8, ZeroDivisionError("bug"))], do_sample=True, num_return_sequences=2, seed=1),
    ],
    ids=["processor", "criterion", "prefix_fn", "beams", "samples"],
)
def test_a_raising_callback_reaches_its_own_caller_as_raised(model, kwargs):
    # stock generate raises the callback's own exception: so does generate_many, in the thread that asked for it,
    # while a caller in another thread gets its exact results
    expected_error = KeyError if "stopping_criteria" in kwargs else ZeroDivisionError
    results = {}

    def other():
        results["other"] = exact(model, PROMPTS)

    thread = threading.Thread(target=other)
    thread.start()
    with pytest.raises(expected_error):
        model.generate_many(random_prompts([4, 6], seed=8), max_new_tokens=6, **kwargs)
    thread.join(60)
    assert results == {"other": True}
    assert clean(model) and exact(model, PROMPTS)


def test_generated_ids_skip_the_ids_callers_chose(model):
    engine = hfpaged.Engine(model)
    chosen = [engine.add_request(PROMPTS[0], request_id=f"req-{i}", max_new_tokens=3) for i in range(6)]
    assert chosen == [f"req-{i}" for i in range(6)]
    assert exact(model, PROMPTS)  # its requests are named by the engine: never one of the handle's ids
    ids = engine.add_requests([PROMPTS[1], PROMPTS[2]], [{}, {}], [None, "req-7"])
    assert ids[1] == "req-7" and ids[0] not in chosen + ["req-7"]
    while engine.has_unfinished():
        engine.step()
    assert clean(model)


def test_unpatch_ends_every_callers_wait(model):
    slow = [RaiseAt(10_000, RuntimeError)]  # never raises (a processor on the exact path, as the thread's)
    errors = []
    # the thread's prompt must still run when unpatch gets the engine's lock, which the stepping thread can win
    # back for a while (session 40: with 40 tokens, ~2 s, it once finished first under a loaded 2-core run)
    hfpaged.patch(model, num_blocks=160, block_size=4, max_num_seqs=6, max_num_batched_tokens=32)

    def run():
        try:
            model.generate_many(
                [PROMPTS[0]], max_new_tokens=400, logits_processor=[lambda i, s: (time.sleep(0.05), s)[1]]
            )
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    stream = model.stream_many([PROMPTS[1]], max_new_tokens=40, logits_processor=slow)
    next(stream)
    engine = hfpaged.Engine(model)
    prompt_id = engine.add_request(PROMPTS[2], max_new_tokens=40, logits_processor=slow)
    engine.step()
    time.sleep(0.2)
    hfpaged.unpatch(model)
    thread.join(30)
    assert not thread.is_alive() and len(errors) == 1 and "unpatched" in errors[0]
    assert [(e.finished, e.finish_reason) for e in stream][-1] == (True, "abort")
    outputs = engine.step()  # the tokens other callers' steps made for it, then its abort
    assert [(o.prompt_id, o.finished, o.finish_reason) for o in outputs][-1] == (prompt_id, True, "abort")
    assert sum(o.finished for o in outputs) == 1 and not engine.has_unfinished()
    hfpaged.patch(model, num_blocks=32, block_size=4, max_num_seqs=4)
    assert exact(model, PROMPTS)


def test_a_repatch_with_other_settings_ends_a_handles_requests(model):
    engine = hfpaged.Engine(model)
    engine.add_request(PROMPTS[0], max_new_tokens=20)
    engine.step()
    hfpaged.patch(model, num_blocks=32, block_size=8, max_num_seqs=4)
    assert [(o.finished, o.finish_reason) for o in engine.step()] == [(True, "abort")]
    assert not engine.has_unfinished() and clean(model) and exact(model, PROMPTS)


def test_a_tokenizer_without_decode_and_malformed_add_requests_are_refused(model):
    with pytest.raises(TypeError, match="tokenizer must be a transformers tokenizer .* got int"):
        model.generate_many([PROMPTS[0]], tokenizer=5)
    with pytest.raises(TypeError, match="tokenizer must be"):
        hfpaged.patch(model, num_blocks=48, block_size=4, max_num_seqs=6, max_num_batched_tokens=32, tokenizer=5)
    with pytest.raises(TypeError, match="tokenizer must be"):
        hfpaged.Engine(model, tokenizer=5)
    engine = hfpaged.Engine(model)
    with pytest.raises(TypeError, match=r"settings\[0\] must be a dict of settings, got NoneType"):
        engine.add_requests([PROMPTS[0]], [None])
    with pytest.raises(TypeError, match="settings must be a list, got dict"):
        engine.add_requests([PROMPTS[0]], {"max_new_tokens": 3})
    with pytest.raises(TypeError, match="prompts must be a list, got NoneType"):
        engine.add_requests(None, [])
    assert not engine.has_unfinished() and clean(model) and exact(model, PROMPTS)
