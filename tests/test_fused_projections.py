"""Fused q/k/v and gate/up projections (patch(..., fuse_projections=True)) on the CPU: greedy parity, no second
copy of the weights, training and saving unchanged, unpatch restores, PEFT layers and replaced weights unfused."""

import pytest
import torch
from models import make_model, random_prompts, reference_generate

import hfpaged
from hfpaged.model.attach import get_state
from hfpaged.model.fused_projections import GROUP_NAMES
from hfpaged.model.peft_compat import inner_model

NEW = 12
FUSED_ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma2"]
MEMBER_NAMES = {name for names in GROUP_NAMES for name in names}


def patch(model, **options):
    options = {"num_blocks": 48, "block_size": 4, "max_num_seqs": 3, "max_num_batched_tokens": 24, **options}
    return hfpaged.patch(model, **{"fuse_projections": True, **options})


def greedy(model, prompts):
    return [r.token_ids for r in model.generate_many(prompts, max_new_tokens=NEW, do_sample=False)]


def groups(model):
    return get_state(inner_model(model)).fused_projections.groups


def storage_bytes(model) -> int:
    """Bytes of the distinct storages the parameters live in."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


def owns_storage(param) -> bool:
    return param.untyped_storage().nbytes() == param.numel() * param.element_size()


def member_linear_calls(model, monkeypatch) -> list[str]:
    """Names of the q/k/v/gate/up modules whose own (class) forward runs from now on."""
    names = {module: name for name, module in model.named_modules()}
    calls = []
    original = torch.nn.Linear.forward

    def forward(self, x):
        if names.get(self, "").rsplit(".", 1)[-1] in MEMBER_NAMES:
            calls.append(names[self])
        return original(self, x)

    monkeypatch.setattr(torch.nn.Linear, "forward", forward)
    return calls


@pytest.mark.parametrize("arch", FUSED_ARCHS)
def test_fused_greedy_equals_stock_generate(arch, monkeypatch):
    model = make_model(arch, seed=1)
    prompts = random_prompts([5, 17, 9, 30], seed=1)
    expected = reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False)
    assert sum(len(set(e)) > 3 for e in expected) >= len(expected) // 2
    patch(model, num_blocks=16)
    assert len(groups(model)) == 2 * model.config.num_hidden_layers
    calls = member_linear_calls(model, monkeypatch)
    assert greedy(model, prompts) == expected
    assert calls == []  # every projection of every paged step ran through its group's one GEMM
    model(torch.tensor([prompts[0]]))  # a stock forward while patched: the modules' own forwards
    assert len(calls) == 5 * model.config.num_hidden_layers


def test_fused_through_graph_shaped_steps(monkeypatch):
    from test_graph_padding import replay_eagerly

    model = make_model("qwen3", seed=1)
    prompts = random_prompts([5, 17, 9, 30, 3], seed=2)
    expected = reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False)
    patch(model, num_blocks=24)
    runner = replay_eagerly(model)
    calls = member_linear_calls(model, monkeypatch)
    assert greedy(model, prompts) == expected
    assert calls == [] and runner.num_graph_steps > 0


def test_default_fuses_nothing_on_the_cpu_and_phi3_has_nothing_to_fuse():
    model = make_model("llama")
    patch(model, fuse_projections=None)
    assert groups(model) == []
    phi3 = make_model("phi3")
    patch(phi3)
    assert groups(phi3) == []
    with pytest.raises(ValueError, match="fuse_projections"):
        patch(model, fuse_projections=1)


def test_no_second_copy_of_the_weights_and_unpatch_restores():
    model = make_model("qwen2")  # q/k/v with biases
    params = dict(model.named_parameters())
    values = {name: p.detach().clone() for name, p in params.items()}
    before = storage_bytes(model)
    patch(model)
    assert storage_bytes(model) == before
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.weight.untyped_storage().data_ptr() == attention.v_proj.weight.untyped_storage().data_ptr()
    assert attention.q_proj.bias.untyped_storage().data_ptr() == attention.k_proj.bias.untyped_storage().data_ptr()
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    greedy(model, random_prompts([7, 11], seed=2))
    hfpaged.unpatch(model)
    assert storage_bytes(model) == before
    assert dict(model.named_parameters()) == params
    assert all(owns_storage(p) for p in model.parameters())
    assert all(torch.equal(p, values[name]) for name, p in model.named_parameters())


def test_save_pretrained_while_patched_and_after_unpatch(tmp_path):
    model = make_model("llama", tie_word_embeddings=True)
    state = {name: t.clone() for name, t in model.state_dict().items()}
    patch(model)
    model.save_pretrained(tmp_path / "patched")
    hfpaged.unpatch(model)
    model.save_pretrained(tmp_path / "unpatched")
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items() if "lm_head" not in k}, tmp_path / "raw.st")
    for folder in ("patched", "unpatched"):
        reloaded = type(model).from_pretrained(tmp_path / folder).state_dict()
        assert reloaded.keys() == state.keys()
        assert all(torch.equal(reloaded[name], tensor) for name, tensor in state.items())


def test_training_while_patched_gives_stock_gradients_and_the_next_call_sees_the_step():
    fused, plain = make_model("llama", seed=4), make_model("llama", seed=4)
    patch(fused)
    prompts = random_prompts([6, 13, 20], seed=3)
    before = greedy(fused, prompts)
    batch = torch.tensor([random_prompts([16], seed=5)[0]] * 2)
    for model in (fused, plain):
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        model.eval()
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name
        assert torch.equal(p, q), name
    assert len(groups(fused)) == 4  # the in-place step kept every weight in its buffer
    after = greedy(fused, prompts)
    assert after == reference_generate(plain, prompts, max_new_tokens=NEW, do_sample=False)
    assert after != before


def test_a_new_parameter_unfuses_its_group_only(monkeypatch):
    model = make_model("llama", seed=2)
    patch(model)
    prompts = random_prompts([5, 9, 14], seed=4)
    greedy(model, prompts)
    layer = model.model.layers[1]
    with torch.no_grad():
        layer.self_attn.k_proj.weight = torch.nn.Parameter(layer.self_attn.k_proj.weight * 1.5)
        layer.mlp.up_proj.weight.data = layer.mlp.up_proj.weight.data.clone().mul_(0.5)  # .data swapped
    expected = reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False)
    calls = member_linear_calls(model, monkeypatch)
    assert greedy(model, prompts) == expected
    assert len(groups(model)) == 2
    assert {name.rsplit(".", 1)[0] for name in calls} == {"model.layers.1.self_attn", "model.layers.1.mlp"}
    hfpaged.unpatch(model)
    assert all(owns_storage(p) for p in model.parameters())


def test_peft_layers_stay_unfused():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(make_model("llama", seed=3), config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    prompts = random_prompts([5, 17, 9], seed=1)
    expected = reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False)
    patch(model)
    assert [type(group.parent).__name__ for group in groups(model)] == ["LlamaMLP"] * 2
    assert greedy(model, prompts) == expected


def test_dynamo_traces_one_gemm_per_group():
    model = make_model("qwen2")
    patch(model)
    layer = model.model.layers[0]
    x = torch.randn(1, 5, model.config.hidden_size)
    with torch.no_grad():
        expected = (layer.mlp(x), [layer.self_attn.q_proj(x), layer.self_attn.k_proj(x), layer.self_attn.v_proj(x)])
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm

    def forward(layer, x):
        attention = layer.self_attn
        return layer.mlp(x), [attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)]

    compiled = torch.compile(forward, backend=record, fullgraph=True, dynamic=True)
    with torch.no_grad(), model._hfpaged.fused_projections.step():
        mlp, qkv = compiled(layer, x)
    assert torch.equal(mlp, expected[0]) and all(torch.equal(a, b) for a, b in zip(qkv, expected[1]))
    linears = [node for node in graphs[0].graph.nodes if node.target is torch._C._nn.linear]
    assert len(linears) == 3  # gate/up, down, q/k/v


@pytest.mark.slow
def test_compiled_decode_forward_with_fused_projections_matches_stock_generate(monkeypatch):
    from test_compiled import test_compiled_decode_forward_matches_stock_generate as compiled_parity

    original = hfpaged.patch
    patched = []

    def fused_patch(model, **options):
        patched.append(model)
        return original(model, fuse_projections=True, **options)

    monkeypatch.setattr(hfpaged, "patch", fused_patch)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled_parity()  # the compiled decode steps run inside FusedProjections.step
    assert len(groups(patched[0])) == 4
    assert not torch._dynamo.utils.counters["graph_break"]


def test_a_projection_called_from_another_thread_during_a_paged_step_leaves_the_step_exact(monkeypatch):
    # A submodule called directly from another thread (not through model(...), so not behind the forward lock)
    # while a paged step runs meets the per-step forwards. It must not touch the step's stash: with real GEMMs
    # (which release the GIL) its output could land in the stash and be handed to the step's next member.
    # The interleaving is forced here: the other thread's GEMM is held until the step's v_proj is called.
    import threading
    from types import SimpleNamespace

    import hfpaged.model.fused_projections as fused_module

    model = make_model("llama", seed=1)
    prompts = random_prompts([5, 17, 9], seed=1)
    expected = reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False)
    patch(model)
    attention = model.model.layers[0].self_attn
    group = next(g for g in groups(model) if g.parent is attention)
    y = torch.randn(1, 3, model.config.hidden_size) * 5
    other_in_gemm, release_other = threading.Event(), threading.Event()
    other_output = []
    other = threading.Thread(target=lambda: other_output.append(attention.k_proj(y)))
    real_linear = torch.nn.functional.linear

    def linear(x, weight, bias=None):
        if threading.current_thread() is other:
            other_in_gemm.set()
            release_other.wait(30)
        out = real_linear(x, weight, bias)
        if weight is group.weight and not other.is_alive() and not other_output:  # the step's first q/k/v GEMM
            other.start()
            other_in_gemm.wait(30)
        return out

    def before_v_proj(module, args):
        if threading.current_thread() is not other and other.is_alive():
            release_other.set()
            other.join(30)

    monkeypatch.setattr(fused_module, "F", SimpleNamespace(linear=linear))
    attention.v_proj.register_forward_pre_hook(before_v_proj)
    assert greedy(model, prompts) == expected
    assert other_output and torch.equal(other_output[0], real_linear(y, attention.k_proj.weight))
