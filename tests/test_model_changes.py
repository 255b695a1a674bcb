"""What users do to a patched model between calls, and what the next call makes of it: forward hooks registered or
removed (seen, as changed weights are), attention weights moved to another dtype (refused until patched again or
moved back), torch's random state (left alone by greedy and beam calls, as by stock ``generate``), and ``Engine``
handles dropped with prompts running (aborted, their blocks freed). Each was found by a probe in session 30."""

import threading
import time

import pytest
import torch
from models import make_model, random_prompts, reference_generate

import hfpaged

NEW = 8


def greedy(model, prompts):
    return [r.token_ids for r in model.generate_many(prompts, max_new_tokens=NEW, do_sample=False)]


def stock(model, prompts):
    return reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False)


def assert_pool_free(model):
    stats = hfpaged.stats(model)
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_running_requests"] == 0, stats


def scaled_output(module, args, output):
    return output * 1.75


def test_forward_hooks_registered_or_removed_between_calls_are_seen():
    """A hook changes what the layers compute: blocks cached before it (the same prompts again hit them all but
    the last token) must not serve the call after it, on a module or as torch's global module hook."""
    model = make_model("llama", seed=3)
    hfpaged.patch(model, num_blocks=64, block_size=4)
    check_hooks(model)


@pytest.mark.gpu
def test_cuda_hooks_and_moved_weights_after_the_graphs_were_captured():
    """The same on CUDA with default options: the graphs and compiled layers baked the hooks in (or not), so a hook
    registered or removed recaptures them; a bf16 model moved to float32 (the probe's case) raises until patched
    again, then equals stock float32."""
    model = make_model("llama", seed=3).cuda()
    hfpaged.patch(model)
    check_hooks(model)
    runner = model._hfpaged.engine.runner
    assert runner.num_graph_steps > 0 and runner.num_eager_steps == 0
    prompts = random_prompts([6, 11], seed=3)
    expected = stock(model, prompts)
    model.to(torch.bfloat16)
    hfpaged.patch(model)
    results = model.generate_many(prompts, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    assert all(len(r.token_ids) == NEW for r in results)  # runs (no eos: another dtype's tokens may hit it)
    model.float()
    with pytest.raises(ValueError, match=r"torch.bfloat16.* -> .*torch.float32"):
        greedy(model, prompts)
    hfpaged.patch(model)
    assert greedy(model, prompts) == expected
    assert model._hfpaged.engine.runner.num_graph_steps > 0


def check_hooks(model):
    """Hooks registered and removed on a patched ``model`` between calls: each call equals stock ``generate``."""
    prompts = random_prompts([13, 21, 9], seed=2)
    plain = stock(model, prompts)
    assert greedy(model, prompts) == plain
    mlp = model.model.layers[0].mlp
    handle = mlp.register_forward_hook(scaled_output)
    hooked = stock(model, prompts)
    assert hooked != plain
    assert greedy(model, prompts) == hooked
    handle.remove()
    assert greedy(model, prompts) == plain
    pre = model.model.layers[1].register_forward_pre_hook(lambda module, args: (args[0] * 0.5, *args[1:]))
    halved = stock(model, prompts)
    assert halved != plain and greedy(model, prompts) == halved
    pre.remove()
    assert greedy(model, prompts) == plain
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: scaled_output(module, args, output) if module is mlp else None
    )
    try:
        assert greedy(model, prompts) == hooked
    finally:
        handle.remove()
    assert greedy(model, prompts) == plain
    assert_pool_free(model)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_weights_moved_to_another_dtype_raise_until_patched_again_or_moved_back(backend):
    """The pool and kernels were set up for float32: a float16 model must not run on them (the torch attention
    rounded the stored K/V silently, the Triton kernels failed naming the cache's dtype)."""
    model = make_model("llama", seed=4)
    prompts = random_prompts([6, 11], seed=3)
    expected = stock(model, prompts)
    options = dict(num_blocks=48, block_size=4, attention_backend=backend)
    hfpaged.patch(model, **options)
    assert greedy(model, prompts) == expected
    model.half()
    for _ in range(2):  # every call until something changes, not only the one that noticed
        with pytest.raises(
            ValueError, match=r"moved after hfpaged.patch \(torch.float32 on cpu -> torch.float16 on cpu, "
        ):
            greedy(model, prompts)
    assert_pool_free(model)
    model.float()  # moved back: served again
    assert greedy(model, prompts) == expected
    model.half()
    state = model._hfpaged
    hfpaged.patch(model, **options)  # the same settings: patches anew for the new dtype, not a no-op
    assert model._hfpaged is not state and hfpaged.stats(model)["kv_cache_dtype"] == "float16"
    results = model.generate_many(prompts, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    assert all(len(r.token_ids) == NEW for r in results)  # runs (no eos: another dtype's tokens may hit it)
    model.float()
    with pytest.raises(ValueError, match=r"torch.float16.* -> .*torch.float32"):
        greedy(model, prompts)
    hfpaged.patch(model, **options)
    assert greedy(model, prompts) == expected
    assert_pool_free(model)


def test_greedy_and_beam_calls_leave_torch_random_state_alone():
    """As stock greedy generate: a seeded training loop around rollouts draws the same dropout masks and batches
    with or without them. Unseeded sampling draws each request's seed from torch's generator."""
    model = make_model("llama", seed=5)
    prompts = random_prompts([7, 12], seed=4)
    hfpaged.patch(model, num_blocks=48, block_size=4)
    state = torch.random.get_rng_state()
    stock(model, prompts)
    assert torch.equal(torch.random.get_rng_state(), state)
    greedy(model, prompts)
    model.generate_many(prompts, max_new_tokens=4, num_beams=2, do_sample=False)
    list(model.stream_many(prompts, max_new_tokens=3, do_sample=False))
    model.generate_many(prompts, max_new_tokens=3, do_sample=True, seed=11)
    assert torch.equal(torch.random.get_rng_state(), state)
    model.generate_many(prompts, max_new_tokens=3, do_sample=True)
    assert not torch.equal(torch.random.get_rng_state(), state)


def test_an_engine_handle_dropped_with_prompts_running_has_them_aborted():
    model = make_model("llama", seed=6)
    prompts = random_prompts([9, 14], seed=5)
    expected = stock(model, prompts[1:])
    hfpaged.patch(model, num_blocks=48, block_size=4)
    dropped = hfpaged.Engine(model)
    dropped.add_request(prompts[0], max_new_tokens=NEW, do_sample=False)
    dropped.step()
    kept = hfpaged.Engine(model)
    kept_id = kept.add_request(prompts[1], max_new_tokens=NEW, do_sample=False)
    del dropped  # nobody can read or abort its prompt now
    stats = hfpaged.stats(model)
    assert stats["num_running_requests"] + stats["num_waiting_requests"] == 1, stats
    tokens = []
    while kept.has_unfinished():
        tokens += [t for o in kept.step() if o.prompt_id == kept_id for t in o.new_token_ids]
    assert [tokens] == expected
    assert_pool_free(model)
    hfpaged.sleep(model)  # nothing runs: the pool can be handed back
    assert hfpaged.stats(model)["asleep"]


def test_a_model_built_under_inference_mode_patches_and_generates_as_stock():
    # parameters that are inference tensors (a model built, or loaded with assign=True, inside
    # torch.inference_mode) have no version counter: reading it crashed patch (a probe); they count as -1, and a
    # new weight in new storage is still seen
    with torch.inference_mode():
        model = make_model("llama")
    assert next(model.parameters()).is_inference()
    prompts = random_prompts([7, 12, 7], seed=6)
    hfpaged.patch(model, num_blocks=32, block_size=4)
    assert greedy(model, prompts) == stock(model, prompts)
    with torch.inference_mode():
        layer = model.model.layers[0].self_attn.v_proj
        layer.weight = torch.nn.Parameter(layer.weight * 2, requires_grad=False)
    assert greedy(model, prompts) == stock(model, prompts)
    assert_pool_free(model)


def deepcopy_layer_appended(model):
    import copy

    layer = copy.deepcopy(model.model.layers[1])  # with a deep copy of the config, too
    layer.self_attn.layer_idx = 2
    model.model.layers.append(layer)
    model.config.num_hidden_layers = 3


def layer_reused(model):
    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList([layers[0], layers[1], layers[0]])
    model.config.num_hidden_layers = 3


def attention_rebuilt(model):
    old = model.model.layers[0].self_attn
    new = type(old)(model.config, 0)
    new.load_state_dict(old.state_dict())
    model.model.layers[0].self_attn = new


@pytest.mark.parametrize(
    "change, message, again",
    [
        (deepcopy_layer_appended, r"model\.layers\.2\.self_attn \(LlamaAttention\) is not a layer patch paged", "ok"),
        (layer_reused, r"model\.layers\.0\.self_attn and model\.layers\.2\.self_attn are one module", "ran twice"),
        (attention_rebuilt, r"model\.layers\.0\.self_attn \(LlamaAttention\) is not a layer patch paged", "ok"),
    ],
    ids=["layer-appended", "layer-reused", "attention-rebuilt"],
)
def test_attention_layers_added_replaced_or_reused_after_patch_are_refused_until_patched_again(change, message, again):
    # a layer patch did not page would attend outside the pool (or find no cache), a reused one would write its cache
    # twice: silently wrong tokens or a bare AttributeError before (session 33's probe)
    model = make_model("llama", seed=3)
    prompts = random_prompts([5, 11], seed=4)
    hfpaged.patch(model, num_blocks=64, block_size=4)
    greedy(model, prompts)
    change(model)
    for _ in range(2):  # at every call, not only the first after the change
        with pytest.raises(ValueError, match=message + r".*call hfpaged\.patch\(model\) again"):
            greedy(model, prompts)
    assert_pool_free(model)
    if again == "ok":  # patch with the same settings patches anew for the model as it is now
        hfpaged.patch(model, num_blocks=64, block_size=4)
        assert greedy(model, prompts) == stock(model, prompts)
    else:  # the probe forward of patch refuses a module that runs twice
        with pytest.raises(TypeError, match="ran twice in one forward"):
            hfpaged.patch(model, num_blocks=64, block_size=4)


def test_a_module_of_the_attention_class_that_never_runs_is_no_change():
    # a spare attention module in the tree at patch (the forward never calls it, so patch pages nothing for it): a
    # later rewiring (a new lm_head) must not count it as a layer added after patch
    model = make_model("llama", seed=3)
    model.model.spare = type(model.model.layers[0].self_attn)(model.config, 0)
    prompts = random_prompts([5, 11], seed=4)
    hfpaged.patch(model, num_blocks=64, block_size=4)
    assert len(model._hfpaged.layers) == 2
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    head.weight.data.copy_(model.lm_head.weight)
    model.lm_head = head
    assert greedy(model, prompts) == stock(model, prompts)


def test_a_restored_attention_layer_is_served_again_without_patching():
    model = make_model("llama", seed=3)
    prompts = random_prompts([5, 11], seed=4)
    hfpaged.patch(model, num_blocks=64, block_size=4)
    expected = greedy(model, prompts)
    original = model.model.layers[0].self_attn
    attention_rebuilt(model)
    with pytest.raises(ValueError, match="is not a layer patch paged"):
        greedy(model, prompts)
    model.model.layers[0].self_attn = original
    assert greedy(model, prompts) == expected


def test_a_sliding_window_edited_in_the_config_is_followed():
    # Gemma2's attention copies config.sliding_window at construction: stock applies an edited window through its
    # mask and cache, the layer's attention call still passes the old one. Sequences within the new window stay
    # exact; longer ones are refused (before: silently wrong tokens past the new window)
    model = make_model("gemma2", seed=3)
    hfpaged.patch(model, num_blocks=64, block_size=4)
    assert model.config.sliding_window == 8
    model.config.sliding_window = 4
    short = random_prompts([2], seed=5)
    assert [r.token_ids for r in model.generate_many(short, max_new_tokens=2, do_sample=False)] == (
        reference_generate(model, short, max_new_tokens=2, do_sample=False)
    )
    with pytest.raises(ValueError, match="past the 4 positions of layer 0's sliding window"):
        greedy(model, random_prompts([6], seed=6))
    model.config.sliding_window = 8
    prompts = random_prompts([6, 9], seed=6)
    assert greedy(model, prompts) == stock(model, prompts)
    assert_pool_free(model)


def test_an_unpatch_after_a_handles_checks_refuses_its_request_and_steps_nothing(monkeypatch):
    # another thread unpatches after Engine.add_request's checks passed and before the request joins: it used to
    # fail here with a bare ReferenceError, or (while the state lived on) join the old engine, whose next step then
    # ran the forward of a detached model (AttributeError); the closed engine now refuses it by name
    import threading

    import hfpaged.engine as engine_module

    m = make_model("llama")
    hfpaged.patch(m, num_blocks=32, block_size=4)
    engine = hfpaged.Engine(m)
    real = engine.core.check_weights

    def checks(model):
        real(model)
        thread = threading.Thread(target=hfpaged.unpatch, args=(model,))
        thread.start()
        thread.join()

    monkeypatch.setattr(engine.core, "check_weights", checks)
    with pytest.raises(engine_module.ModelUnpatched, match="unpatched or patched again: make a new one"):
        engine.add_request([5, 6, 7], max_new_tokens=3)
    monkeypatch.undo()
    assert not hasattr(m, "_hfpaged") and not engine.has_unfinished() and engine.step() == []
    hfpaged.patch(m, num_blocks=32, block_size=4)  # and the model is as usable as ever
    assert (
        m.generate_many([[5, 6, 7]], max_new_tokens=3, do_sample=False)[0].token_ids
        == reference_generate(m, [[5, 6, 7]], max_new_tokens=3, do_sample=False)[0]
    )


@pytest.mark.parametrize("call", ["add_request", "generate_many"])
def test_an_unpatch_during_a_calls_checks_is_named(call, monkeypatch):
    # an unpatch landing inside the weights check (after its first look at the state) ended the call with a bare
    # ReferenceError ("weakly-referenced object no longer exists"), which callers catching ModelUnpatched miss
    import threading

    import hfpaged.engine as engine_module

    m = make_model("llama")
    hfpaged.patch(m, num_blocks=32, block_size=4)
    real = engine_module.warn_if_autocast

    def unpatch_now():
        monkeypatch.setattr(engine_module, "warn_if_autocast", real)
        thread = threading.Thread(target=hfpaged.unpatch, args=(m,))
        thread.start()
        thread.join()

    engine = hfpaged.Engine(m)
    monkeypatch.setattr(engine_module, "warn_if_autocast", unpatch_now)
    with pytest.raises(hfpaged.ModelUnpatched, match="unpatched or patched again"):
        if call == "add_request":
            engine.add_request([5, 6, 7], max_new_tokens=3)
        else:
            m.generate_many([[5, 6, 7]], max_new_tokens=3)
    assert not hasattr(m, "_hfpaged")


def test_a_call_checking_weights_while_another_drops_the_old_prefix_blocks_waits_for_it(monkeypatch):
    # Two calls started after an in-place weight change: the first's check sees it, keeps the new fingerprint and
    # drops the prefix blocks the old weights computed. A second call checking in between saw "unchanged" and stepped
    # on those old blocks before the first dropped them (wrong tokens; found by a CPU probe, 1 in ~1,500 runs without
    # the pause below). The check and the drop are one step under the engine's lock now.
    model = make_model("llama")
    hfpaged.patch(model, num_blocks=64, block_size=4)
    base = random_prompts([24], seed=3)[0]
    settings = dict(max_new_tokens=10, do_sample=False)
    model.generate_many([base + [9]], **settings)  # the old weights' blocks of base, in the prefix cache
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.7)
    first, second = [base + [5, 6]], [base + [7, 8]]
    expected = reference_generate(model, first + second, **settings)
    weights = model._hfpaged.weights
    check, checked = weights.check, threading.Event()

    def slow_check(checked_model):  # the first caller is switched out right after its check
        result = check(checked_model)
        if threading.current_thread().name == "first":
            checked.set()
            time.sleep(0.3)
        return result

    monkeypatch.setattr(weights, "check", slow_check)
    got = {}

    def call(name, prompts):
        if name == "second":
            checked.wait(10)
        got[name] = [r.token_ids for r in model.generate_many(prompts, **settings)]

    threads = [
        threading.Thread(target=call, args=args, name=args[0]) for args in (("first", first), ("second", second))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got["first"] + got["second"] == expected
    assert_pool_free(model)
