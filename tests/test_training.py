"""hfpaged in a training loop: PEFT/LoRA models (adapters switched, disabled, merged), weights trained
between calls, training itself unaffected by the patch, and the pool handed back between rollouts."""

import gc
import weakref

import pytest
import torch
from models import make_model, random_prompts, reference_generate

import hfpaged

peft = pytest.importorskip("peft")  # a dev dependency; the import makes PEFT models known to hfpaged

NEW = 10


def lora(model, name="default", seed=0, rank=4, config=None):
    """A LoRA adapter (or ``config``'s) with random (non-zero) B matrices, so the adapted model differs from the base."""
    if config is None:
        config = peft.LoraConfig(
            r=rank, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0
        )
    if isinstance(model, peft.PeftModel):
        model.add_adapter(name, config)
    else:
        model = peft.get_peft_model(model, config, adapter_name=name)
    torch.manual_seed(seed)
    with torch.no_grad():
        for module_name, param in model.named_parameters():
            if "lora_B" in module_name and f".{name}." in module_name:
                param.normal_(0, 0.5)
    return model


def greedy(model, prompts):
    return [r.token_ids for r in model.generate_many(prompts, max_new_tokens=NEW, do_sample=False)]


def stock(model, prompts):
    return reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False)


@pytest.fixture
def peft_model():
    model = lora(make_model("llama", seed=3))
    hfpaged.patch(model, num_blocks=48, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    return model


def test_a_lora_model_generates_what_its_stock_generate_does(peft_model):
    prompts = random_prompts([5, 17, 9, 30], seed=1)
    expected = stock(peft_model, prompts)
    with peft_model.disable_adapter():
        base = stock(peft_model, prompts)
    assert expected != base  # the adapter matters, so parity proves something
    assert greedy(peft_model, prompts) == expected
    assert hfpaged.stats(peft_model)["num_free_blocks"] == hfpaged.stats(peft_model)["num_blocks"]


def test_disabling_switching_and_merging_adapters_between_calls_takes_effect(peft_model):
    prompts = random_prompts([13, 13, 21], seed=2)  # shared lengths: the prefix cache holds their blocks
    first = stock(peft_model, prompts)
    assert greedy(peft_model, prompts) == first
    with peft_model.disable_adapter():
        assert greedy(peft_model, prompts) == stock(peft_model, prompts) != first
    assert greedy(peft_model, prompts) == first
    lora(peft_model, "other", seed=9)
    peft_model.set_adapter("other")
    other = stock(peft_model, prompts)
    assert other != first and greedy(peft_model, prompts) == other
    peft_model.set_adapter("default")
    peft_model.merge_adapter()
    assert greedy(peft_model, prompts) == stock(peft_model, prompts)
    peft_model.unmerge_adapter()
    assert greedy(peft_model, prompts) == first


def test_an_adapter_rescaled_between_calls_is_not_served_from_the_old_prefix_blocks(peft_model):
    # set_scale / rescale_adapter_scale change what the same weights compute: the prefix cache must not answer
    from peft.helpers import rescale_adapter_scale

    prompts = random_prompts([13, 13, 21], seed=4)
    first = stock(peft_model, prompts)
    assert greedy(peft_model, prompts) == first
    with rescale_adapter_scale(peft_model, 3.0):
        scaled = stock(peft_model, prompts)
        assert scaled != first and greedy(peft_model, prompts) == scaled
    assert greedy(peft_model, prompts) == first
    assert hfpaged.stats(peft_model)["num_free_blocks"] == hfpaged.stats(peft_model)["num_blocks"]


def test_a_modules_to_save_copy_toggled_on_its_own_between_calls_is_not_served_from_old_prefix_blocks():
    # modules_to_save: the wrapper (not a tuner layer) switches between the module and the adapter's own copy;
    # toggling it alone (enable_adapters) changes what the model computes, so the prefix cache must not answer
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["embed_tokens"])
    model = lora(make_model("llama", seed=7), config=config)
    wrapper = model.base_model.model.model.embed_tokens
    with torch.no_grad():
        wrapper.modules_to_save["default"].weight.mul_(-2.0)  # the adapter's copy differs from the original
    hfpaged.patch(model, num_blocks=64, block_size=4)
    prompts = random_prompts([9, 13], seed=40)
    adapted = stock(model, prompts)
    assert greedy(model, prompts) == adapted  # fills the prefix cache
    for enabled in (False, True, False):
        wrapper.enable_adapters(enabled)
        expected = stock(model, prompts)
        assert (expected == adapted) == enabled
        assert greedy(model, prompts) == expected, enabled
    assert hfpaged.stats(model)["num_free_blocks"] == hfpaged.stats(model)["num_blocks"]


def test_training_steps_on_the_adapter_are_used_by_the_next_call(peft_model):
    prompts = random_prompts([6, 12, 20], seed=3)
    before = greedy(peft_model, prompts)
    peft_model.train()
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=0.05)
    for _ in range(3):
        ids = torch.tensor([prompts[2]])
        peft_model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = greedy(peft_model, prompts)  # still in train mode: generation runs in eval semantics
    assert peft_model.training  # and the mode is restored
    peft_model.eval()
    assert after == stock(peft_model, prompts) != before


@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_forward_and_backward_are_unchanged_by_the_patch(checkpointing):
    def loss_and_grads(model):
        torch.manual_seed(0)  # the same dropout masks for both runs
        ids = torch.tensor(random_prompts([24, 24], seed=4))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        return loss.detach(), grads

    model = make_model("llama", seed=5, attention_dropout=0.2)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    loss, grads = loss_and_grads(model)
    hfpaged.patch(model, num_blocks=32, block_size=4)
    model.generate_many(random_prompts([5], seed=6), max_new_tokens=3)  # a paged step in between
    patched_loss, patched_grads = loss_and_grads(model)
    assert torch.equal(loss, patched_loss)
    assert grads.keys() == patched_grads.keys() and all(torch.equal(grads[n], patched_grads[n]) for n in grads)


def test_generation_under_train_mode_has_no_dropout_and_keeps_the_mode():
    model = make_model("llama", seed=7, attention_dropout=0.5)
    prompts = random_prompts([8, 19], seed=8)
    expected = stock(model, prompts)  # eval mode
    hfpaged.patch(model, num_blocks=32, block_size=4)
    model.train()
    assert greedy(model, prompts) == expected
    assert model.training and all(m.training for m in model.modules())


def test_an_adapters_dropout_left_in_train_mode_under_an_eval_model_is_not_applied():
    # PEFT builds a new adapter's lora_dropout modules in training mode, also under a model in eval mode: the steps
    # looked at the model's own flag only, so they applied that dropout (random tokens) and published its prefix
    # blocks, which later calls in eval mode were served (session 36's training-loop probe)
    dropout = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.5)
    model = lora(make_model("llama", seed=3))
    model.eval()
    hfpaged.patch(model, num_blocks=96, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    prompts = random_prompts([13, 21], seed=2)  # whole blocks of 4: cached prefixes
    model = lora(model, "other", seed=9, config=dropout)
    model.set_adapter("other")
    inner = model.get_base_model()
    assert not inner.training and any(m.training for n, m in inner.named_modules() if n.endswith("lora_dropout.other"))
    modes = {name: m.training for name, m in model.named_modules()}
    first, second = greedy(model, prompts), greedy(model, prompts)
    assert {name: m.training for name, m in model.named_modules()} == modes  # put back after the steps
    model.eval()
    expected = stock(model, prompts)
    assert first == second == expected and greedy(model, prompts) == expected


def test_sleep_releases_the_pool_and_the_next_call_brings_it_back():
    model = make_model("llama", seed=9)
    prompts = random_prompts([7, 15], seed=10)
    expected = stock(model, prompts)
    hfpaged.patch(model, num_blocks=32, block_size=4)
    assert greedy(model, prompts) == expected
    cache = weakref.ref(model._hfpaged.kv_caches[0][0])
    hfpaged.sleep(model)
    gc.collect()
    assert cache() is None and hfpaged.stats(model)["asleep"]
    assert not any("_hfpaged_kv" in m.__dict__ for m in model.modules())
    assert greedy(model, prompts) == expected  # woken by the call
    assert not hfpaged.stats(model)["asleep"]
    hfpaged.sleep(model)
    hfpaged.wake(model)
    assert len(model._hfpaged.kv_caches) == 2 and greedy(model, prompts) == expected
    engine = hfpaged.Engine(model)
    engine.add_request(prompts[0], max_new_tokens=5)
    with pytest.raises(RuntimeError, match="cannot sleep while 1 requests run"):
        hfpaged.sleep(model)
    engine.abort_all()


def test_sleep_when_idle_frees_the_pool_after_every_call():
    model = make_model("llama", seed=11)
    prompts = random_prompts([9, 4], seed=12)
    expected = stock(model, prompts)
    hfpaged.patch(model, num_blocks=32, block_size=4, sleep_when_idle=True)
    for _ in range(2):
        assert greedy(model, prompts) == expected
        assert hfpaged.stats(model)["asleep"] and model._hfpaged.kv_caches == []
    events = list(model.stream_many(prompts, max_new_tokens=NEW, do_sample=False))
    assert [t for e in events if e.index == 0 for t in e.token_ids] == expected[0]
    assert hfpaged.stats(model)["asleep"]


def test_an_engine_on_the_peft_wrapper_sees_the_same_weights_as_generate_many(peft_model):
    """Engine(peft_model) checks the weights through the wrapper, generate_many through the inner model: the
    same tree, so alternating them rewires nothing (graphs, prefix cache kept) and remembers no cycle."""
    prompts = random_prompts([13], seed=3)
    expected = greedy(peft_model, prompts)
    runner = hfpaged.Engine(peft_model).runner
    dropped = []
    runner.drop_graphs = lambda: dropped.append(1)
    for _ in range(2):
        engine = hfpaged.Engine(peft_model)
        engine.add_request(prompts[0], max_new_tokens=NEW, do_sample=False)
        while engine.has_unfinished():
            engine.step()
        assert greedy(peft_model, prompts) == expected
    assert dropped == []
    state = peft_model.get_base_model()._hfpaged
    assert all(module is not peft_model.get_base_model() for module in state.weights.modules)


def perturbed(model, marker, seed=1):
    """``model`` with its adapter parameters (names holding ``marker``) moved off their neutral start."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if marker in name:
                param.add_(torch.randn_like(param) * 0.8)
    return model


TUNERS = {  # PEFT tuners that adapt the layers themselves: (config, the marker of their parameters)
    "ia3": (
        lambda: peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
        "ia3_l",
    ),
    "loha": (lambda: peft.LoHaConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]), "hada_w"),
    "lokr": (lambda: peft.LoKrConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]), "lokr_w"),
    "vera": (lambda: peft.VeraConfig(r=8, target_modules=["q_proj", "v_proj"]), "vera_lambda"),
    "adalora": (lambda: peft.AdaLoraConfig(r=4, target_modules=["q_proj", "v_proj"], total_step=10), "lora_"),
}


@pytest.mark.parametrize("tuner", list(TUNERS))
def test_other_layer_tuners_generate_what_their_stock_generate_does(tuner):
    make_config, marker = TUNERS[tuner]
    model = perturbed(peft.get_peft_model(make_model("llama", seed=3), make_config()), marker)
    prompts = random_prompts([5, 13, 21], seed=2)
    expected = stock(model, prompts)
    with model.disable_adapter():
        assert stock(model, prompts) != expected  # the adapter matters
    hfpaged.patch(model, num_blocks=48, block_size=4)
    assert greedy(model, prompts) == expected
    with model.disable_adapter():  # switched off between calls: the next call sees it
        assert greedy(model, prompts) == stock(model, prompts)


@pytest.mark.parametrize("kind", ["prompt_tuning", "p_tuning", "prefix_tuning"])
def test_prompt_learning_adapters_are_refused_at_patch(kind):
    """Their virtual tokens come from the PeftModel wrapper, which the paged steps do not run: served, they would
    give the base model's tokens (found by a probe, session 30), so patch refuses them and attaches nothing."""
    config = {
        "prompt_tuning": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        "p_tuning": lambda: peft.PromptEncoderConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=32
        ),
        "prefix_tuning": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    }[kind]()
    model = peft.get_peft_model(make_model("llama", seed=3), config)
    with pytest.raises(ValueError, match=f"prompt-learning adapters \\({config.peft_type.value}\\)"):
        hfpaged.patch(model, num_blocks=48, block_size=4)
    assert not hasattr(model.get_base_model(), "_hfpaged") and not hasattr(model.get_base_model(), "generate_many")


alora_supported = pytest.mark.skipif(
    "alora_invocation_tokens" not in getattr(peft.LoraConfig, "__dataclass_fields__", {}),
    reason="this peft has no aLoRA (LoraConfig(alora_invocation_tokens=...))",
)


def alora(model, name, invocation, seed=0):
    """An aLoRA adapter (active after ``invocation`` in the ids; None: a plain LoRA) with random B matrices, for a
    causal LM (PeftModelForCausalLM: a plain PeftModel computes no aLoRA offsets, so serves the base model too)."""
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj"],
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        alora_invocation_tokens=invocation,
    )
    return lora(model, name, seed, config=config)


@alora_supported
def test_an_alora_adapter_is_refused_at_patch():
    """aLoRA's offsets (where the adapter applies, after the invocation tokens) come from the PeftModel wrapper's
    forward/generate, which the paged steps do not run: served, it gave the base model's tokens (a probe, session
    32), so patch refuses it, naming the adapter, and attaches nothing."""
    prompt = random_prompts([16], seed=11)[0]
    model = alora(make_model("llama", seed=3), "act", prompt[5:8])
    expected = stock(model, [prompt])
    with model.disable_adapter():
        assert stock(model, [prompt]) != expected  # the adapter matters for this prompt
    with pytest.raises(ValueError, match="active adapter is an aLoRA \\('act'"):
        hfpaged.patch(model, num_blocks=48, block_size=4)
    assert not hasattr(model.get_base_model(), "_hfpaged") and not hasattr(model.get_base_model(), "generate_many")


@alora_supported
def test_an_alora_adapter_activated_after_patch_is_refused_at_the_call():
    """An aLoRA added and activated between calls fails the call (not the base model's tokens); switched off or
    away from, the next call serves the model again, as its stock generate."""
    prompts = random_prompts([16], seed=11)
    model = alora(make_model("llama", seed=3), "default", None, seed=1)  # a plain LoRA (a causal-LM PeftModel)
    hfpaged.patch(model, num_blocks=48, block_size=4)
    first = greedy(model, prompts)
    assert first == stock(model, prompts)
    alora(model, "act", prompts[0][5:8], seed=4)
    model.set_adapter("act")
    with model.disable_adapter():
        base = stock(model, prompts)
    assert stock(model, prompts) != base  # the aLoRA matters for this prompt
    with pytest.raises(ValueError, match="active adapter is an aLoRA \\('act'"):
        greedy(model, prompts)
    with pytest.raises(ValueError, match="aLoRA"):  # every call, not only the first
        greedy(model, prompts)
    with model.disable_adapter():  # the base model: nothing of the wrapper's is needed
        assert greedy(model, prompts) == base != first
    model.set_adapter("default")
    assert greedy(model, prompts) == first


def test_a_call_whose_requests_end_at_eos_leaves_the_engine_idle():
    """With overlapped steps the step after a request's eos is already launched when the eos is read; a probe found
    it kept in flight, so ``sleep`` refused ("0 requests run") and ``sleep_when_idle`` left the pool allocated."""
    model = make_model("llama")
    prompt = random_prompts([1], seed=1)[0]
    expected = reference_generate(model, [prompt], max_new_tokens=12, do_sample=False)
    assert expected[0][-1] == model.generation_config.eos_token_id and len(expected[0]) < 12  # ends at eos
    hfpaged.patch(model, num_blocks=32, block_size=4)
    got = model.generate_many([prompt], max_new_tokens=12, do_sample=False)
    assert [r.token_ids for r in got] == expected
    assert model._hfpaged.engine.num_overlapped_steps > 0
    hfpaged.sleep(model)
    assert hfpaged.stats(model)["asleep"]
    hfpaged.patch(model, num_blocks=32, block_size=4, sleep_when_idle=True)
    assert [r.token_ids for r in model.generate_many([prompt], max_new_tokens=12, do_sample=False)] == expected
    assert hfpaged.stats(model)["asleep"]


def test_steps_run_under_another_adapter_state_between_calls_publish_nothing_stale(peft_model):
    # requests accepted under the adapter but stepped under another adapter state that is undone before the next
    # call: an Engine handle stepped inside disable_adapter(), a stream first iterated after set_adapter. Their own
    # tokens are those of the state they ran under, and the next call (back under the first state) is not served
    # prefix blocks they computed (the call's weights check alone saw "no change since the last call").
    prompts = random_prompts([16, 12], seed=21)
    peft_model.generate_many(random_prompts([5], seed=1), max_new_tokens=2)  # weights checked under the adapter
    engine = hfpaged.Engine(peft_model)
    for prompt in prompts:
        engine.add_request(prompt, max_new_tokens=NEW, do_sample=False)
    with peft_model.disable_adapter():
        base = stock(peft_model, prompts)
        outputs = {}
        while engine.has_unfinished():
            for output in engine.step():
                outputs[output.prompt_id] = output.token_ids
    assert list(outputs.values()) == base
    adapted = stock(peft_model, prompts)
    assert adapted != base and greedy(peft_model, prompts) == adapted

    lora(peft_model, "other", seed=9)
    others = random_prompts([14, 10], seed=22)
    stream = peft_model.stream_many(others, max_new_tokens=NEW, do_sample=False)  # created under "default"
    peft_model.set_adapter("other")
    other_tokens = stock(peft_model, others)
    streamed = {}
    for piece in stream:
        streamed.setdefault(piece.index, []).extend(piece.token_ids)
    assert [streamed[i] for i in sorted(streamed)] == other_tokens
    peft_model.set_adapter("default")
    assert greedy(peft_model, others) == stock(peft_model, others) != other_tokens
    assert hfpaged.stats(peft_model)["num_free_blocks"] == hfpaged.stats(peft_model)["num_blocks"]


def test_a_later_adapter_layer_toggled_between_calls_while_steps_run_publishes_nothing_stale(peft_model):
    # per-layer toggles (enable_adapters on one layer, scale_layer) of a layer other than the first, undone before
    # the next call: the per-step check read only the first adapter layer (a probe); it reads them all
    prompt = random_prompts([13], seed=5)[0]
    later = [m for n, m in peft_model.named_modules() if "layers.1." in n and hasattr(m, "lora_A")]
    assert later
    adapted = stock(peft_model, [prompt])
    peft_model.generate_many(random_prompts([5], seed=1), max_new_tokens=2)  # weights checked, adapters on
    engine = hfpaged.Engine(peft_model)
    engine.add_request(prompt, max_new_tokens=NEW, do_sample=False)
    for module in later:
        module.enable_adapters(False)
    while engine.has_unfinished():
        engine.step()
    for module in later:
        module.enable_adapters(True)
    assert greedy(peft_model, [prompt]) == adapted
