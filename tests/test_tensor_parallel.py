"""Tensor parallelism through transformers' ``tp_plan="auto"``: two ranks under torchrun (gloo on the CPU, NCCL on
two GPUs) run one engine each in lockstep and must equal stock ``generate`` on the unsharded model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from models import make_model

import hfpaged
from hfpaged.model.tensor_parallel import check_heads, plain_settings, requests_fingerprint
from hfpaged.model.tp_local import allreduce_mode, local_kind

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_worker.py")
FUSE = {"llama": "off", "qwen2": "on"}  # the local-shard forwards alone, and fused over local shards (q/k/v bias)


def run_ranks(tmp_path, arch: str, device: str, nproc: int = 2) -> list[dict]:
    model_dir = tmp_path / arch
    make_model(arch, seed=3).save_pretrained(model_dir)
    out = tmp_path / f"out-{arch}"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command += [WORKER, "--model", str(model_dir), "--out", str(out), "--device", device, "--fuse", FUSE[arch]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def check_ranks(results: list[dict], num_kv_heads: int, arch: str, device: str) -> None:
    first = results[0]
    layers = make_model(arch).config.num_hidden_layers
    for result in results:
        assert result["local_projections"] == 7 * layers  # q/k/v/o and gate/up/down of every layer: local shards
        assert result["fused_groups"] == (2 * layers if FUSE[arch] == "on" else 0)
        assert ("one-shot" in result["all_reduce"]) == (device == "cuda")  # symmetric memory on NVLink GPUs
        if device == "cuda":  # each path (8 KiB, 1 MiB, 16 MiB; float32, bf16) equals NCCL's sum of two ranks
            paths = result["all_reduce_paths"]
            assert {path for path, _ in paths.values()} == {"one_shot", "two_shot", "process_group"}, paths
            assert all(equal for _, equal in paths.values()), paths
            # both kinds of graphs captured, collectives inside, every bucket but the first without a warm-up
            assert result["graph_kinds"] == 2 and result["capture_retries"] == 0
        assert result["kept_stock"] == [None, None]
    assert first["expected"] and any(len(set(seq)) > 3 for seq in first["expected"])  # the model's output varies
    for result in results:
        assert result["kv_heads_local"] == num_kv_heads // len(results)  # each rank pages its own KV heads
        assert result["num_blocks"] == first["num_blocks"]  # the smallest pool of the ranks
        assert result["greedy"] == result["expected"]  # TP=2 equals stock generate on the unsharded model
        assert result["greedy_after_errors"] == result["expected"]
        assert result["engine"] == result["expected"][:3]
        assert result["sampled"] == first["sampled"]  # unseeded sampling draws the same on every rank
        assert result["mismatch_error"] and "different requests" in result["mismatch_error"]
        assert all(error and "different requests" in error for error in result["settings_errors"])
        assert result["max_time_error"] and "max_time" in result["max_time_error"]
        assert all(error is not None for error in result["one_rank_errors"]), result["one_rank_errors"]
        assert all("different requests" in error for error in result["one_rank_errors"][1:])
        assert result["options_error"] and "different patch options" in result["options_error"]
        assert result["sampled_after_refusals"] == first["sampled_after_refusals"]
        assert result["free_after"][0] == result["free_after"][1]
        assert result["expected_changed"] != result["expected"]  # the change matters...
        assert result["greedy_changed"] == result["expected_changed"]  # ...and no stale prefix block is reused
        assert result["greedy_swap"] == result["expected_changed"]
        assert result["swapped_out"] > 0 and result["free_after_swap"][0] == result["free_after_swap"][1]
    assert first["preemptions"] > 0  # the small pool forced preemption, and the ranks stayed in step
    assert first["sampled"] != first["expected"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_two_cpu_ranks_equal_stock_generate(tmp_path, arch):
    check_ranks(run_ranks(tmp_path, arch, "cpu"), num_kv_heads=2, arch=arch, device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_two_gpu_ranks_with_graphs_equal_stock_generate(tmp_path, arch):
    check_ranks(run_ranks(tmp_path, arch, "cuda"), num_kv_heads=2, arch=arch, device="cuda")


def test_heads_that_do_not_split_evenly_are_refused():
    model = make_model("llama")  # 4 attention heads, 2 KV heads
    check_heads(model, 2)
    with pytest.raises(ValueError, match="2 KV heads, which cannot be split over 4"):
        check_heads(model, 4)
    with pytest.raises(ValueError, match="4 attention heads, which cannot be split over 3"):
        check_heads(model, 3)


def test_fingerprint_depends_on_prompts_and_settings_only():
    a = requests_fingerprint([[1, 2, 3], [4]], [(10, False, 7), (9, True, 1)])
    assert a == requests_fingerprint([[1, 2, 3], [4]], [(10, False, 7), (9, True, 1)])
    assert a != requests_fingerprint([[1, 2, 3], [5]], [(10, False, 7), (9, True, 1)])
    assert a != requests_fingerprint([[1, 2], [3, 4]], [(10, False, 7), (9, True, 1)])
    assert a != requests_fingerprint([[1, 2, 3], [4]], [(10, False, 8), (9, True, 1)])
    assert 0 <= a < 2**63


def test_plain_settings_print_the_same_in_every_process():
    # what ranks compare: values, never addresses; equal settings built apart are equal, other values differ
    from transformers import GenerationConfig, SuppressTokensLogitsProcessor

    def settings(tokens, temperature):
        config = GenerationConfig(do_sample=True, temperature=temperature, suppress_tokens=tokens)
        processor = SuppressTokensLogitsProcessor(tokens, device="cpu")
        return plain_settings((config.to_diff_dict(), [processor, lambda x: x, torch.nn.Linear(2, 2)]))

    assert settings([3, 4], 0.5) == settings([3, 4], 0.5)
    assert "0x" not in repr(settings([3, 4], 0.5))
    assert settings([3, 4], 0.5) != settings([3, 5], 0.5) and settings([3, 4], 0.5) != settings([3, 4], 0.7)
    assert plain_settings(list(range(20_000))) == ("list", 20_000)


def test_plain_settings_reach_a_user_processors_fields_where_check_lockstep_nests_them():
    """``check_lockstep`` compares (generation config, [(stage kind, rank, processor)]): a probe found a user
    processor's fields below the depth cut, so ranks banning different tokens were not refused (wrong tokens)."""

    class Ban:
        def __init__(self, token):
            self.token = token

        def __call__(self, input_ids, scores):
            return scores

    def settings(token):
        return plain_settings(({"do_sample": False}, [("LOGITS", 0, Ban(token))]))

    assert settings(5) == settings(5) and settings(5) != settings(6)


def test_an_unsharded_model_has_no_tensor_parallel_group():
    model = make_model("llama")
    hfpaged.patch(model, num_blocks=8)
    assert hfpaged.stats(model)["tensor_parallel_size"] == 1
    hfpaged.unpatch(model)


@pytest.mark.slow
def test_data_parallel_example_returns_every_result_in_input_order(tmp_path):
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += [os.path.join(examples, "data_parallel.py"), "--random-shape", "tiny", "--device", "cpu"]
    command += ["--workload", "churn", "--requests", "13", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    report = json.loads((tmp_path / "dp2.json").read_text())

    sys.path.insert(0, examples)
    try:
        import data_parallel
        from benchmark import workload
    finally:
        sys.path.remove(examples)
    args = type("Args", (), {"model": None, "random_shape": "tiny", "dtype": torch.float32})()
    model = data_parallel.load(args, torch.device("cpu"))
    prompts, out_lens = workload("churn", 13, model.config.vocab_size)
    hfpaged.patch(model)
    requests = [{"prompt": p, "max_new_tokens": n} for p, n in zip(prompts, out_lens)]
    expected = [list(r.token_ids) for r in model.generate_many(requests, do_sample=False, eos_token_id=None)]
    assert report["world_size"] == 2 and report["requests"] == 13
    assert report["token_ids"] == expected  # both replicas' results, merged back into input order
    assert [len(t) for t in expected] == out_lens
    assert data_parallel.merge([data_parallel.split(list(range(7)), r, 3) for r in range(3)], 7) == list(range(7))


def test_a_tensor_parallel_model_is_refused_by_the_server():
    from hfpaged.serve.server import Server

    model = make_model("llama")
    model.model.layers[0].mlp.up_proj.weight.device_mesh = object()  # what a DTensor parameter carries
    with pytest.raises(ValueError, match="tensor-parallel"):
        Server(model, object(), port=0)


def test_all_reduce_mode_setting_is_checked(monkeypatch):
    monkeypatch.delenv("HFPAGED_TP_ALLREDUCE", raising=False)
    assert allreduce_mode() == "auto"
    monkeypatch.setenv("HFPAGED_TP_ALLREDUCE", "nccl")
    assert allreduce_mode() == "nccl"
    monkeypatch.setenv("HFPAGED_TP_ALLREDUCE", "gloo")
    with pytest.raises(ValueError, match="HFPAGED_TP_ALLREDUCE must be 'auto' or 'nccl', got 'gloo'"):
        allreduce_mode()


def test_unsharded_linears_keep_their_forward():
    model = make_model("llama")
    assert all(local_kind(module) is None for module in model.modules())  # no transformers TP forward, no DTensor
