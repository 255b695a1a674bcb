"""The training-loop pieces on CUDA with graphs: a LoRA model and its adapter switches, training unaffected
by the patch, sleep/wake handing memory back, and bitsandbytes-quantized models (run with
``pytest -m gpu``)."""

import gc

import pytest
import torch
from models import make_model, random_prompts, reference_generate

import hfpaged

pytestmark = pytest.mark.gpu
peft = pytest.importorskip("peft")

NEW = 12


def lora_model(seed=3):
    model = make_model("llama", seed=seed).cuda()
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    return model


def greedy(model, prompts):
    return [r.token_ids for r in model.generate_many(prompts, max_new_tokens=NEW, do_sample=False)]


def test_cuda_lora_with_graphs_equals_stock_and_follows_adapter_switches():
    model = lora_model()
    prompts = random_prompts([5, 17, 9, 30, 12], seed=1)
    expected = reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False)
    with model.disable_adapter():
        base = reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False)
    assert base != expected
    hfpaged.patch(model, num_blocks=64, block_size=4, max_num_seqs=8)
    assert greedy(model, prompts) == expected
    runner = model._hfpaged.engine.runner
    assert runner.num_graph_steps > 0
    with model.disable_adapter():
        assert greedy(model, prompts) == base  # the graphs captured with the adapter are not replayed
    assert greedy(model, prompts) == expected
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    for _ in range(2):
        ids = torch.tensor([prompts[3]], device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    trained = greedy(model, prompts)  # under model.train(): eval semantics, mode kept
    assert model.training
    model.eval()
    assert trained == reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False) != expected


def test_cuda_training_step_is_unchanged_by_the_patch():
    def loss_and_grads(model):
        torch.manual_seed(0)
        ids = torch.tensor(random_prompts([24, 24], seed=4), device="cuda")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        return loss.detach(), grads

    model = make_model("llama", seed=5, attention_dropout=0.2).cuda().train()
    loss, grads = loss_and_grads(model)
    hfpaged.patch(model, num_blocks=32, block_size=4)
    model.generate_many(random_prompts([5, 9], seed=6), max_new_tokens=6)
    patched_loss, patched_grads = loss_and_grads(model)
    assert torch.equal(loss, patched_loss) and all(torch.equal(grads[n], patched_grads[n]) for n in grads)


def cuda_tensors():
    gc.collect()
    return {id(t): t for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.is_cuda}


def test_cuda_sleep_hands_the_memory_back_and_wake_restores_it():
    model = make_model("qwen3", seed=7).cuda()
    prompts = random_prompts([9, 21, 5], seed=8)
    expected = reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False)
    # the baseline is the model alone: earlier tests' garbage and cuBLAS workspaces (32 MiB per stream that ran
    # a matmul, counted as allocated; sleep releases them) would make "before" too large to compare with
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    old_tensors = cuda_tensors()
    hfpaged.patch(model, num_blocks=65536, block_size=16)  # 256 MiB of K/V, ~1000x the model
    pool = sum(t.untyped_storage().nbytes() for kv in model._hfpaged.kv_caches for t in kv)
    assert pool >= 256 * 2**20
    assert greedy(model, prompts) == expected
    assert greedy(model, prompts[:1] * 4) == expected[:1] * 4  # graph replays too
    awake = torch.cuda.memory_allocated()
    hfpaged.sleep(model)
    asleep = torch.cuda.memory_allocated()
    print(
        f"GPU memory allocated (MiB): before patch {before / 2**20:.1f}, awake {awake / 2**20:.1f}, "
        f"asleep {asleep / 2**20:.1f}"
    )
    left = [(tuple(t.shape), t.dtype) for i, t in cuda_tensors().items() if i not in old_tensors]
    assert awake >= before + pool
    assert asleep <= 1.02 * before, f"tensors made since patch still alive: {left}"
    assert greedy(model, prompts) == expected  # woken by the call, graphs captured again
    assert torch.cuda.memory_allocated() >= before + pool


@pytest.mark.parametrize("bits", [4, 8])
def test_cuda_bitsandbytes_models_patch_and_generate(bits, tmp_path):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    make_model("llama", seed=9, hidden_size=128, intermediate_size=256).save_pretrained(tmp_path)
    quantization = (
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)
        if bits == 4
        else BitsAndBytesConfig(load_in_8bit=True)
    )
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=quantization, device_map="cuda", dtype=torch.bfloat16
    ).eval()
    prompts = random_prompts([5, 17, 9, 30, 12, 21, 3, 8], seed=10)
    expected = reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False)
    hfpaged.patch(model, num_blocks=64, block_size=4, max_num_seqs=8)
    got = greedy(model, prompts)
    first = sum(g[0] == e[0] for g, e in zip(got, expected))
    whole = sum(g == e for g, e in zip(got, expected))
    print(f"bitsandbytes {bits}-bit: first token equal for {first}/8 prompts, all {NEW} tokens for {whole}/8")
    assert first >= 7
