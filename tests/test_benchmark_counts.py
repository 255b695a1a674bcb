"""The benchmark's FLOP count for prefill (examples/benchmark.py), checked against a hand count on a tiny model."""

import os
import sys

from models import make_model

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def test_prefill_flops_counts_linear_lm_head_and_causal_attention():
    sys.path.insert(0, EXAMPLES)
    try:
        from benchmark import prefill_flops
    finally:
        sys.path.remove(EXAMPLES)
    model = make_model("llama")
    c = model.config
    hidden, inter, heads, kv, layers = (
        c.hidden_size,
        c.intermediate_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.num_hidden_layers,
    )
    head_dim = hidden // heads
    per_layer = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2 + 3 * hidden * inter  # q, o, k, v, mlp
    lens = [5, 12]
    flops = prefill_flops(model, lens)
    assert flops["tokens"] == 17
    assert flops["linear"] == 2 * layers * per_layer * 17 + 2 * c.vocab_size * hidden * 2  # LM head: one row each
    causal_pairs = 5 * 6 // 2 + 12 * 13 // 2  # each token attends to itself and every earlier one
    assert flops["attention"] == 4 * layers * heads * head_dim * causal_pairs


def test_a_failing_benchmark_section_is_recorded_and_the_others_run():
    sys.path.insert(0, EXAMPLES)
    try:
        from benchmark import run_section
    finally:
        sys.path.remove(EXAMPLES)
    res = {}
    run_section(res, "good", lambda: {"x": 1}, lambda out: f"x={out['x']}")

    def broken():
        raise ValueError("no GPU here")

    run_section(res, "bad", broken, lambda out: "unreachable")
    assert res["good"] == {"x": 1} and "bad" not in res
    assert "ValueError: no GPU here" in res["bad_error"]
