"""The server's text as tokens arrive: streamed deltas add up to the non-streamed text, a stop string that begins
in the prompt is never streamed, byte-fallback tokens (Llama-2/Mistral style) decode incrementally as they decode
at once, and a stop string with a leading space matches after the prompt as the engine's stop check sees it.
Everything in process (Starlette's test client) over tiny random models and tokenizers built in memory."""

import json

import pytest
from bpe_tokenizer import make_tokenizer
from models import make_model
from starlette.testclient import TestClient
from tokenizers import Tokenizer, models, normalizers, trainers
from transformers import PreTrainedTokenizerFast

import hfpaged
from hfpaged.detokenizer import IncrementalDetokenizer
from hfpaged.serve import create_app
from hfpaged.serve.text_output import IncrementalText

SP_CORPUS = ["the stop sign is red", "a quick brown fox jumps over the lazy dog", "hello world", "be brief"] * 20


def make_sp_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer: Metaspace-like normalizer, 256 byte-fallback tokens, and the decoder whose ``Strip``
    drops the text's first space."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    trained.train_from_iterator(SP_CORPUS, trainer)
    spec = json.loads(trained.to_str())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece, _ in sorted(spec["model"]["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(piece, len(vocab))
    spec["model"].update(vocab=vocab, byte_fallback=True, fuse_unk=True)
    for added in spec["added_tokens"]:
        added["id"] = vocab[added["content"]]
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def serve_texts(tokenizer, bodies):
    """(non-streamed text, finish_reason, streamed text, streamed finish_reason) of each completions request."""
    model = make_model("llama", vocab_size=len(tokenizer), seed=0)
    hfpaged.patch(model, num_blocks=64, block_size=4, max_num_seqs=8, tokenizer=tokenizer)
    results = []
    with TestClient(create_app(model, tokenizer, served_model_name="m")) as http:
        for body in bodies:
            whole = http.post("/v1/completions", json=body).json()["choices"][0]
            text, finish = "", None
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        text, finish = text + choice["text"], choice["finish_reason"] or finish
            results.append((whole["text"], whole["finish_reason"], text, finish))
    hfpaged.unpatch(model)
    return results


def test_a_stop_string_that_begins_in_the_prompt_is_never_streamed():
    # before: the held-back tail was only a completion tail that begins a stop string, so with "hello" + "eee..."
    # the stream sent "ee" of "loeee" while the non-streamed text was "" (the stop string begins in the prompt)
    tokenizer = make_tokenizer()
    force_e = {str(tokenizer.convert_tokens_to_ids("e")): 100}
    cases = [("loeee", ""), ("oe", ""), (["zz", "lloee"], ""), ("eeex", "e" * 8), ("llx", "e" * 8), ("eeee", "")]
    body = {"prompt": "hello", "max_tokens": 8, "temperature": 0, "logit_bias": force_e}
    results = serve_texts(tokenizer, [{**body, "stop": stop} for stop, _ in cases])
    for (whole, finish, streamed, streamed_finish), (_, expected) in zip(results, cases):
        assert (whole, streamed) == (expected, expected)
        assert finish == streamed_finish == ("length" if expected else "stop")
    # the text alone, token by token: nothing of "loeee" goes out before the match is decided
    ids = [tokenizer.convert_tokens_to_ids("e")] * 4
    text = IncrementalText(tokenizer, ["loeee"], tokenizer("hello")["input_ids"])
    assert [text.push(ids[: i + 1], False) for i in range(3)] == ["", "", ""] and text.stopped and text.text == ""


@pytest.mark.parametrize(
    "pieces",
    [
        ["▁hel", "<0x0A>", "<0xE4>", "▁wor"],  # a newline, then a stray byte: "Invalid prefix" in DecodeStream
        ["<0x38>", "<0xC8>", "a▁", "op"],  # "8" becomes U+FFFD once the invalid byte after it arrives
        ["▁x", "<0xC6>", "<0x8D>", "<0xE4>", "▁st"],  # "ƍ" is valid alone, not in its run: U+FFFD x3
        ["▁caf", "<0xC3>", "<0xA9>", "<0x0A>", "▁wor", "<0x4A>", "</s>", "<0xF4>", "ef"],
    ],
)
def test_byte_fallback_tokens_stream_as_they_decode_at_once(pieces):
    # before: tokenizers' DecodeStream raised "Invalid prefix encountered while decoding stream" (a streamed body
    # cut off, a 500 with stop/logprobs, stream_many raised) or sent text that full decoding replaces
    tokenizer = make_sp_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(pieces)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    for window in (False, True):  # True: the detokenizer's own window path, as for a slow tokenizer
        detokenizer = IncrementalDetokenizer(tokenizer)
        if window:
            detokenizer._stream = None
        sent = [detokenizer.push(ids[: i + 1]) for i in range(len(ids))]
        assert "".join(sent) + detokenizer.finish(ids) == expected
        assert all(expected.startswith("".join(sent[: i + 1])) for i in range(len(sent)))  # never taken back
    text = IncrementalText(tokenizer, ["zz"])
    streamed = "".join(text.push(ids[: i + 1], i == len(ids) - 1) for i in range(len(ids)))
    assert streamed == text.text == expected


def test_a_stop_string_with_a_leading_space_matches_after_the_prompt():
    # before: the text was searched in the prompt's tail and the completion decoded apart, where Strip drops the
    # completion's first space: " wor" ended the request (the engine decodes them together) but cut nothing
    tokenizer = make_sp_tokenizer()
    force_wor = {str(tokenizer.convert_tokens_to_ids("▁wor")): 100}
    cases = [(None, "wor wor wor wor"), (" wor", ""), ("o wor", ""), ("r wor", "wo"), (" worwor", "wor wor wor wor")]
    body = {"prompt": "hello", "max_tokens": 4, "temperature": 0, "logit_bias": force_wor}
    results = serve_texts(tokenizer, [{**body, "stop": stop} for stop, _ in cases])
    for (whole, finish, streamed, streamed_finish), (_, expected) in zip(results, cases):
        assert (whole, streamed) == (expected, expected)
        assert finish == streamed_finish == ("length" if expected.endswith("wor") else "stop")
