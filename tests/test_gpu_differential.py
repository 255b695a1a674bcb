"""test_differential.py's seeded random mixes on the GPU's default fast path (run with `pytest -m gpu`).

Each case runs its requests through the options a user gets on CUDA (CUDA graphs for every step, compiled
layers, fused projections, overlapped steps as drawn) in a random engine configuration (preemption by
recompute or swap, chunked prefill, prefix caching on or off), split between one to three callers at once;
then a weight is changed in place after the graphs were captured and the greedy and beam requests run again.
Greedy and beam outputs must equal stock ``generate`` (float32), seeded samples the same request alone.
"""

import random

import pytest
import torch
from models import MORE_ARCHS, make_model, make_more_model
from test_architectures import EAGER_IN_FLOAT32
from test_concurrency import run_threads
from test_differential import assert_pool_free, case_entries, draw_case, stock_entry

import hfpaged

pytestmark = pytest.mark.gpu

CASES = list(range(300, 312))
_models: dict = {}


def cuda_model_for(arch):
    if arch not in _models:
        _models[arch] = (make_more_model if arch in MORE_ARCHS else make_model)(arch, seed=5).cuda()
    model = _models[arch]
    hfpaged.unpatch(model)
    return model


def first_layer_weight(model):
    """A 2-D weight of the first decoder layer (with fused projections, a view into the layer's shared buffer)."""
    return next(p for n, p in model.named_parameters() if p.dim() == 2 and (".layers.0." in n or ".h.0." in n))


def in_callers(model, entries, groups):
    """``generate_many`` from one thread per group of entry indices, all at once: each entry's sequences."""
    got: list = [None] * len(entries)

    def caller(indices):
        def run():
            for i, r in zip(indices, model.generate_many([entries[i] for i in indices])):
                got[i] = [s.token_ids for s in r.sequences]

        return run

    run_threads(*(caller(g) for g in groups if g))
    return got


def run_case(case, archs=None):
    c = draw_case(case) if archs is None else draw_case(case, archs)
    model = cuda_model_for(c["arch"])
    entries, expected = case_entries(model, c)
    hfpaged.patch(model, **c["engine"])
    rng = random.Random(case)
    callers = rng.randint(1, 3)
    owner = [rng.randrange(callers) for _ in entries]
    groups = [[i for i, o in enumerate(owner) if o == k] for k in range(callers)]
    assert in_callers(model, entries, groups) == expected, c
    runner = model._hfpaged.engine.runner
    assert (runner.num_graph_steps > 0) == (c["arch"] not in EAGER_IN_FLOAT32), c  # float32 MoE: eager
    assert_pool_free(model)
    # a weight changed in place after capture: the next call's greedy and beam requests get stock's new tokens
    weight = first_layer_weight(model)
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(-1.5)
        kept = [e for e, kind in zip(entries, c["kinds"]) if kind != "sampled"]
        changed = [stock_entry(model, e) for e in kept]
        before = [x for x, kind in zip(expected, c["kinds"]) if kind != "sampled"]
        if sum(len(s) for x in before for s in x) >= 12:  # enough tokens for the change to show
            assert changed != before, c
        assert [[s.token_ids for s in r.sequences] for r in model.generate_many(kept)] == changed, c
        assert_pool_free(model)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    hfpaged.unpatch(model)
    return c


@pytest.mark.parametrize("case", CASES)
def test_random_mixes_on_the_default_fast_path_equal_stock_generate(case):
    run_case(case)
