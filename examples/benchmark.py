"""Side-by-side throughput: stock generate vs transformers' generate_batch vs hfpaged generate_many.

Everything runs in ONE process on the same model (random weights in a real shape, built from config:
no downloads) and the same prompts. Prints a table, writes JSON and a PNG bar chart.

    python examples/benchmark.py --models qwen3-0.6b llama-3.2-1b --out bench_out

Workloads:
  nano   256 requests, prompt length ~ U[100, 1024], output length ~ U[100, 1024], eos ignored
         (the nano-vllm bench shape). hfpaged and stock generate honour each request's own output
         length; generate_batch takes one max_new_tokens, so it runs with the mean output length.
  chat   256 requests, prompt length ~ U[32, 512], 128 new tokens each, eos ignored.
  churn  1,000 requests, prompt and output lengths ~ U[16, 64]: requests finish and join at almost every
         step, so nearly every step holds prefill tokens (the workload eager prefill steps were slow on).
  long   32 requests, prompt length ~ U[4096, 8192], 128 new tokens each: prefill-bound.
(--requests N gives every workload N requests instead.) --sections cold measures the cold start: a fresh
process loads the model, patches it and times the first generate_many (8 chat prompts, 16 new tokens),
with empty Triton/Inductor/hfpaged-compile caches and then again with the caches that run filled (unless
--no-compile, also with the hfpaged compile cache alone filled).
Stock generate runs padded batches of 64 on a subset (--stock-requests), counting only each
request's own tokens. hfpaged runs each workload --repeats times (default 3; each on a reset prefix cache) and
reports the median run. Also: batch-1 decode latency against the weight-bandwidth roofline, the share
of allocated KV slots holding real tokens during a separate, untimed hfpaged run, and (--prefix) prefix caching
on vs off over 256 requests sharing a 1,024-token system prompt, and (--sections parallel) the peak
KV blocks of n=4 parallel sampling (8 prompts of 1,024 tokens, 128 new) vs 4 independent requests
per prompt, prefix caching off for both, and (--sections parity) the share of 32 prompts whose first 32
greedy tokens in bf16 equal stock generate's (each prompt alone), next to the same share between stock
generate with eager attention and with sdpa as a yardstick, and (--sections prefill) the long workload's prompts
prefilled alone (one new token each): TFLOP/s with attention FLOPs counted, as a share of the dense bf16 matmul
peak measured in the same process. --kv-cache-dtype fp8 runs hfpaged's batch-1 and workload runs over an fp8 KV
cache (the peers are unchanged; not token-exact, so the parity section keeps the model's dtype).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch

MODELS = {
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "llama-3.2-1b": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        bos_token_id=128000,
        eos_token_id=128001,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    "llama-3.1-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        bos_token_id=128000,
        eos_token_id=128001,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
}


def log(*args):
    print(*args, flush=True)


def build_model(name: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(MODELS[name])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # the CPU only for smoke tests
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def workload(kind: str, num_requests: int, vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    if kind == "nano":
        in_lens = torch.randint(100, 1025, (num_requests,), generator=gen).tolist()
        out_lens = torch.randint(100, 1025, (num_requests,), generator=gen).tolist()
    elif kind == "chat":
        in_lens = torch.randint(32, 513, (num_requests,), generator=gen).tolist()
        out_lens = [128] * num_requests
    elif kind == "churn":
        in_lens = torch.randint(16, 65, (num_requests,), generator=gen).tolist()
        out_lens = torch.randint(16, 65, (num_requests,), generator=gen).tolist()
    elif kind == "long":
        in_lens = torch.randint(4096, 8193, (num_requests,), generator=gen).tolist()
        out_lens = [128] * num_requests
    else:
        raise ValueError(kind)
    prompts = [torch.randint(10, vocab - 10, (n,), generator=gen).tolist() for n in in_lens]
    return prompts, out_lens


WORKLOADS = ("nano", "chat", "churn", "long")
WORKLOAD_REQUESTS = {"nano": 256, "chat": 256, "churn": 1000, "long": 32}


def cold_start(name: str, compile: bool | None, pyc_off: bool = False) -> dict:
    """Patch -> first result in a fresh process: with empty kernel caches ("cold": empty Triton, Inductor and
    hfpaged compile caches), then with the caches that first process filled ("warm"); unless ``compile`` is False
    (compiled layers: the default) also with only the hfpaged compile cache filled ("hfpaged_cache_only": fresh
    Triton and Inductor directories, as on a new machine that keeps ~/.cache). Python's bytecode cache is on
    (unless ``pyc_off``): empty for the first run, filled by it for the others."""
    import subprocess
    import tempfile

    results = {}
    with tempfile.TemporaryDirectory() as cache:
        command = [sys.executable, os.path.abspath(__file__), "--cold-start-child", name]
        command += {None: [], True: ["--compile"], False: ["--no-compile"]}[compile]
        command += ["--compile-cache-dir", os.path.join(cache, "hfpaged")]
        runs = [("cold", "1"), ("warm", "1")] + ([("hfpaged_cache_only", "2")] if compile is not False else [])
        for label, generation in runs:
            env = dict(os.environ)
            env["TRITON_CACHE_DIR"] = os.path.join(cache, "triton" + generation)
            env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor" + generation)
            # Python's bytecode cache, as every pip install has it (pip compiles .pyc files at install time); an
            # environment that turns it off (PYTHONDONTWRITEBYTECODE, as on our GPU hosts) would compile every
            # module torch.compile imports from source in each process. The first run writes it.
            if not pyc_off:
                env.pop("PYTHONDONTWRITEBYTECODE", None)
                env["PYTHONPYCACHEPREFIX"] = os.path.join(cache, "pyc")
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
            lines = [line for line in done.stdout.splitlines() if line.startswith("COLD_START ")]
            if done.returncode != 0 or not lines:
                raise RuntimeError(
                    f"cold-start child failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
                )
            results[label] = json.loads(lines[-1][len("COLD_START ") :])
    return results


def cold_start_child(name: str, compile: bool | None, compile_cache_dir: str | None = None) -> None:
    import hfpaged

    start = time.perf_counter()
    model = build_model(name, torch.bfloat16)
    torch.cuda.synchronize()
    loaded = time.perf_counter()
    hfpaged.patch(model, compile=compile, compile_cache_dir=compile_cache_dir)
    patched = time.perf_counter()
    prompts, _ = workload("chat", 8, model.config.vocab_size)
    model.generate_many(prompts, max_new_tokens=16, do_sample=False)
    torch.cuda.synchronize()
    done = time.perf_counter()
    runner = model._hfpaged.engine.runner
    times = {"load_s": loaded - start, "patch_s": patched - loaded, "patch_to_first_result_s": done - loaded}
    times["kernel_warmup_s"] = runner.kernel_warmup.seconds  # our Triton kernels' compile
    times["kernel_warmup_processes"] = runner.kernel_warmup.stats  # of it, compiles in worker processes (counts)
    times["capture_decode_s"] = runner.capture_seconds["decode"]  # torch.compile of the layers included
    times["capture_mixed_s"] = runner.capture_seconds["mixed"]
    times["compiled_layers"] = runner.compile
    if runner.compile:
        from torch._dynamo.utils import compilation_time_metrics, counters

        times["dynamo_graphs"] = counters["stats"]["unique_graphs"]
        times["fxgraph_cache_hit"] = counters["inductor"]["fxgraph_cache_hit"]
        times["fxgraph_cache_miss"] = counters["inductor"]["fxgraph_cache_miss"]
        times["dynamo_compile_s"] = sum(compilation_time_metrics.get("_compile.compile_inner", []))
    print("COLD_START " + json.dumps(times), flush=True)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * n / statistics.median(times)


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step must read: every parameter once, except an untied input
    embedding (a lookup reads one row)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings().weight
    if emb.data_ptr() != out.data_ptr():
        total -= emb.numel() * emb.element_size()
    return total


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, time.perf_counter() - t0


# --- the three contenders ------------------------------------------------------------------------


def run_stock(model, prompts, out_lens, batch_size=64):
    """Stock generate in left-padded batches; counts only each request's own output length."""
    from transformers import GenerationConfig

    total_tokens, total_time = 0, 0.0
    for i in range(0, len(prompts), batch_size):
        chunk, lens = prompts[i : i + batch_size], out_lens[i : i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long, device="cuda")
        mask = torch.zeros_like(ids)
        for j, p in enumerate(chunk):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        cfg = GenerationConfig(max_new_tokens=max(lens), do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.inference_mode():
            _, dt = timed(lambda: model.generate(ids, attention_mask=mask, generation_config=cfg))
        total_time += dt
        total_tokens += sum(lens)
    return total_tokens, total_time


def run_generate_batch(model, prompts, max_new_tokens):
    """transformers' continuous batching (paged|sdpa); called outside inference_mode as it requires."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    outputs, dt = timed(lambda: model.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False))
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    return tokens, dt


def run_hfpaged(model, prompts, out_lens, track_usage=False):
    """hfpaged's engine: each request with its own max_new_tokens; optionally samples KV slot usage."""
    import hfpaged

    engine = hfpaged.Engine(model)
    engine.core.timings.clear()  # host seconds of this run's steps only
    overlapped0, ready0 = engine.core.num_overlapped_steps, engine.core.num_ready_reads
    for p, n in zip(prompts, out_lens):
        engine.add_request(p, max_new_tokens=n, do_sample=False, eos_token_id=None)
    used_slots = real_tokens = 0
    block_size = engine.core.state.config.block_size
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    num_tokens = 0
    step_log = []  # (seconds, graph step?, batch size)
    runner = engine.runner
    compiles = watch_triton_compiles()
    collections = watch_gc()
    while engine.has_unfinished():
        graph_steps = runner.num_graph_steps
        ts = time.perf_counter()
        outputs = engine.step()
        step_log.append((time.perf_counter() - ts, runner.num_graph_steps > graph_steps, len(outputs)))
        num_tokens += len(outputs)
        if track_usage:
            running = engine.core.scheduler.running
            real_tokens += sum(r.num_computed_tokens for r in running)
            used_slots += sum(len(engine.core.kv.block_ids(r)) for r in running) * block_size
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    usage = real_tokens / used_slots if used_slots else None
    engine.step_log = step_log
    # steps whose tokens were ready before the host read them: the device had finished and waited on the host
    engine.host_bound = {
        "overlapped_steps": engine.core.num_overlapped_steps - overlapped0,
        "ready_before_read": engine.core.num_ready_reads - ready0,
    }
    engine.triton_compiles = compiles.stop()
    engine.gc_pauses = collections.stop()
    return num_tokens, dt, usage, engine


def timed_runs(model, prompts, out_lens, repeats: int):
    """``repeats`` timed runs, each on a reset prefix cache: (tokens, seconds, engine) of the median run by
    throughput, and every run's tok/s in the order they ran."""
    import hfpaged

    runs = []
    for _ in range(max(repeats, 1)):
        hfpaged.reset_prefix_cache(model)
        tokens, dt, _, engine = run_hfpaged(model, prompts, out_lens)
        runs.append((tokens / dt, tokens, dt, engine))
    median = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    return median[1], median[2], median[3], [r[0] for r in runs]


def hfpaged_record(model, tokens, seconds, usage, engine) -> dict:
    """The JSON record of one ``run_hfpaged`` run."""
    import hfpaged

    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "kv_slot_usage": usage,
        "graph_steps": engine.runner.num_graph_steps,
        "eager_steps": engine.runner.num_eager_steps,
        "host_seconds": dict(engine.core.timings),
        "host_bound_steps": engine.host_bound,
        "gc_pauses": engine.gc_pauses,
        "stats": hfpaged.stats(model),
    }


class watch_gc:
    """Python garbage-collector passes while active: count, total and longest seconds per generation (a full
    pass over the ~10^6 objects torch.compile leaves behind can stall a step by a second)."""

    def __init__(self):
        import gc

        self.passes: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self.started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.passes[info["generation"]].append(time.perf_counter() - self.started)

    def stop(self) -> dict:
        import gc

        gc.callbacks.remove(self._callback)
        return {
            f"gen{g}": {"count": len(p), "total_s": sum(p), "max_s": max(p, default=0.0)}
            for g, p in self.passes.items()
        }


class watch_triton_compiles:
    """Records the Triton kernels compiled (in-memory cache misses) while it is active: a compile inside
    a timed run is a warm-up gap."""

    def __init__(self):
        self.events = []
        self.knobs = None
        try:
            from triton import knobs

            self.knobs = knobs
            self.previous = knobs.runtime.jit_cache_hook
            knobs.runtime.jit_cache_hook = self._hook
        except (ImportError, AttributeError):
            pass

    def _hook(self, *, repr, **_):
        self.events.append(repr[:400])
        return None

    def stop(self):
        if self.knobs is not None:
            self.knobs.runtime.jit_cache_hook = self.previous
        return self.events


def summarize_steps(step_log):
    graph = [t for t, g, _ in step_log if g]
    eager = [t for t, g, _ in step_log if not g]
    slow = sorted(step_log, reverse=True)[:5]
    return {
        "graph_steps": len(graph),
        "graph_seconds": sum(graph),
        "eager_steps": len(eager),
        "eager_seconds": sum(eager),
        "slowest": [(round(t * 1e3, 2), g, b) for t, g, b in slow],
    }


def batch1_latency(model, prompt_len=128, new_tokens=256):
    """ms per decoded token for one request (prefill excluded)."""
    import hfpaged

    engine = hfpaged.Engine(model)
    engine.add_request(
        list(range(100, 100 + prompt_len)), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None
    )
    engine.step()  # prefill
    engine.step()  # first decode (may capture graphs)
    runner = engine.runner
    forwards = runner.num_graph_steps + runner.num_eager_steps
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    n = runner.num_graph_steps + runner.num_eager_steps - forwards  # decode forwards timed (one token each)
    return (time.perf_counter() - t0) / n * 1e3


def matmul_peak_tflops(n: int = 8192, reps: int = 20) -> float:
    """Dense bf16 matmul TFLOP/s on this GPU (n x n x n, cuBLAS), the yardstick of the prefill share."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * reps / start.elapsed_time(end) / 1e9


def prefill_flops(model, prompt_lens) -> dict:
    """FLOPs of prefilling ``prompt_lens`` (one sampled token each): 2 x linear weights x tokens in the decoder
    layers, the LM head on one row per prompt, and causal attention, 4 x heads x head_dim x n(n+1)/2 per layer."""
    config = model.config
    head = model.get_output_embeddings()
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    tokens = sum(prompt_lens)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    attention = 4 * config.num_hidden_layers * heads * head_dim * sum(n * (n + 1) // 2 for n in prompt_lens)
    return {
        "linear": 2 * linear * tokens + 2 * head.weight.numel() * len(prompt_lens),
        "attention": attention,
        "tokens": tokens,
    }


def prefill_throughput(model, prompts, max_num_seqs: int, compile) -> dict:
    """Long prompts prefilled (one new token each) with default options: TFLOP/s, attention FLOPs counted, as a
    share of this GPU's dense bf16 matmul peak."""
    import hfpaged

    flops = prefill_flops(model, [len(p) for p in prompts])
    peak = matmul_peak_tflops()
    torch.cuda.empty_cache()  # its operands are not the pool's to lose
    hfpaged.patch(model, max_num_seqs=max_num_seqs, compile=compile)
    try:
        model.generate_many(prompts[:4], max_new_tokens=1, do_sample=False)  # warm-up: graphs, compile
        hfpaged.reset_prefix_cache(model)  # the timed prompts prefill in full (none is a prefix hit of the warm-up)
        engine = model._hfpaged.engine
        _, dt = timed(lambda: model.generate_many(prompts, max_new_tokens=1, do_sample=False, eos_token_id=None))
        total = flops["linear"] + flops["attention"]
        return {
            "requests": len(prompts),
            "prompt_tokens": flops["tokens"],
            "seconds": dt,
            "prompt_tokens_per_s": flops["tokens"] / dt,
            "flops": flops,
            "tflops": total / dt / 1e12,
            "attention_share_of_flops": flops["attention"] / total,
            "matmul_peak_tflops": peak,
            "share_of_matmul_peak": total / dt / 1e12 / peak,
            "graph_steps": engine.runner.num_graph_steps,
            "eager_steps": engine.runner.num_eager_steps,
        }
    finally:
        hfpaged.unpatch(model)


def prefix_caching(model, num_requests=256, system_len=1024, question_len=(16, 64), new_tokens=64):
    """Throughput with prefix caching on vs off over requests sharing a long system prompt."""
    import hfpaged

    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    system = torch.randint(10, vocab - 10, (system_len,), generator=gen).tolist()
    prompts = [
        system
        + torch.randint(
            10, vocab - 10, (int(torch.randint(*question_len, (1,), generator=gen)),), generator=gen
        ).tolist()
        for _ in range(num_requests)
    ]
    out = {}
    for enabled in (False, True):
        hfpaged.patch(model, enable_prefix_caching=enabled)
        model.generate_many(prompts[:8], max_new_tokens=4, do_sample=False)  # warm-up (graphs)
        if enabled:
            hfpaged.reset_prefix_cache(model)
        results, dt = timed(
            lambda: model.generate_many(prompts, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
        )
        tokens = sum(len(r.token_ids) for r in results)
        out["on" if enabled else "off"] = {"tokens_per_s": tokens / dt, "seconds": dt, "stats": hfpaged.stats(model)}
    out["speedup"] = out["on"]["tokens_per_s"] / out["off"]["tokens_per_s"]
    return out


def run_section(res: dict, key: str, compute, describe) -> None:
    """``res[key] = compute()`` and log ``describe`` of it; an error is logged and kept as ``res[key + "_error"]``
    (the other sections still run). The GPU's cached memory is released after it."""
    try:
        res[key] = out = compute()
        log(describe(out))
    except Exception:
        res[f"{key}_error"] = traceback.format_exc()
        log(res[f"{key}_error"])
    gc.collect()
    torch.cuda.empty_cache()


def bench_model(name, args, bandwidth):
    import hfpaged
    from hfpaged.testing import greedy_parity, parallel_sampling_kv

    log(f"\n=== {name} ===")
    cold = None
    if "cold" in args.sections:  # first: the child processes need the GPU to themselves
        try:
            cold = cold_start(name, args.compile, pyc_off=args.cold_start_no_pyc)
            log(
                "cold start, patch -> first result: "
                + ", ".join(
                    f"{k} {v['patch_to_first_result_s']:.1f} s (patch {v['patch_s']:.1f} s)" for k, v in cold.items()
                )
            )
        except Exception:
            cold = {"error": traceback.format_exc()}
            log(cold["error"])
    model = build_model(name, torch.bfloat16)
    vocab = model.config.vocab_size
    res = {"model": name, "weight_bytes": weight_bytes_per_token(model)}
    if cold is not None:
        res["cold_start"] = cold

    options = dict(max_num_seqs=args.max_num_seqs, compile=args.compile, kv_cache_dtype=args.kv_cache_dtype)
    if "latency" in args.sections:
        hfpaged.patch(model, **options)
        try:
            # the median of --repeats runs (a run right after the captures sometimes lands 8-23% slower)
            runs = [batch1_latency(model) for _ in range(args.repeats)]
            ms = sorted(runs)[len(runs) // 2]
            roof = res["weight_bytes"] / bandwidth * 1e3
            res["batch1"] = {"ms_per_token": ms, "runs_ms": runs, "roofline_ms": roof, "share_of_roofline": roof / ms}
            log(
                f"batch-1 decode: {ms:.3f} ms/token (median of {', '.join(f'{r:.3f}' for r in runs)}), "
                f"roofline {roof:.3f} ms ({roof / ms:.0%})"
            )
        except Exception:
            res["batch1_error"] = traceback.format_exc()
            log(res["batch1_error"])

    for kind in args.workloads:
        prompts, out_lens = workload(kind, args.requests or WORKLOAD_REQUESTS[kind], vocab)
        w = res.setdefault(
            kind, {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(out_lens)}
        )
        # hfpaged (warm-up first: graph capture, Triton compile)
        hfpaged.patch(model, **options)
        try:
            run_hfpaged(model, prompts[:32], [8] * 32)
            # KV slot usage from a run of its own: its per-step sums over the running requests are host work
            hfpaged.reset_prefix_cache(model)  # every run prefills every prompt (as the peers do)
            usage = run_hfpaged(model, prompts, out_lens, track_usage=True)[2]
            tokens, dt, engine, all_runs = timed_runs(model, prompts, out_lens, args.repeats)
            timings = dict(engine.core.timings)
            w["hfpaged"] = hfpaged_record(model, tokens, dt, usage, engine)
            w["hfpaged"]["runs_tokens_per_s"] = all_runs
            log(
                f"[{kind}] hfpaged: {tokens} tokens in {dt:.2f}s = {tokens / dt:,.0f} tok/s (median of "
                f"{len(all_runs)} runs: {', '.join(f'{r:,.0f}' for r in all_runs)}), KV slot usage {usage:.1%}, "
                f"graph/eager steps {engine.runner.num_graph_steps}/{engine.runner.num_eager_steps}"
            )
            w["hfpaged"]["steps"] = summarize_steps(engine.step_log)
            w["hfpaged"]["triton_compiles_in_run"] = engine.triton_compiles
            log(f"    steps: {w['hfpaged']['steps']}")
            for event in engine.triton_compiles:
                log(f"    Triton compile inside the timed run: {event}")
            full = engine.gc_pauses["gen2"]
            log(f"    full GC passes in the run: {full['count']}, longest {full['max_s'] * 1e3:.0f} ms")
            steps = max(timings.get("steps", 1), 1)
            log(
                "    per step (ms): "
                + ", ".join(f"{k} {v / steps * 1e3:.2f}" for k, v in timings.items() if k != "steps")
            )
            hb = engine.host_bound
            log(
                f"    device waited on the host (tokens ready before the host read them) in "
                f"{hb['ready_before_read']} of {hb['overlapped_steps']} overlapped steps"
            )
        except Exception:
            w["hfpaged_error"] = traceback.format_exc()
            log(w["hfpaged_error"])
        hfpaged.unpatch(model)
        gc.collect()
        torch.cuda.empty_cache()

        if "generate_batch" in args.sections and args.gb_requests:
            n = min(args.gb_requests, len(prompts))
            mean_out = round(sum(out_lens[:n]) / n)
            try:
                run_generate_batch(model, prompts[:4], 4)  # warm-up
                tokens, dt = run_generate_batch(model, prompts[:n], mean_out)
                w["generate_batch"] = {
                    "requests": n,
                    "max_new_tokens": mean_out,
                    "tokens": tokens,
                    "seconds": dt,
                    "tokens_per_s": tokens / dt,
                }
                log(f"[{kind}] generate_batch ({n} req, {mean_out} new each): {tokens / dt:,.0f} tok/s")
            except Exception:
                w["generate_batch_error"] = traceback.format_exc()
                log(w["generate_batch_error"])
            gc.collect()
            torch.cuda.empty_cache()

        if "stock" in args.sections and args.stock_requests:
            n = min(args.stock_requests, len(prompts))
            try:
                run_stock(model, prompts[:2], [4, 4])  # warm-up
                tokens, dt = run_stock(model, prompts[:n], out_lens[:n])
                w["stock"] = {"requests": n, "tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt}
                log(f"[{kind}] stock generate ({n} req, batches of 64): {tokens / dt:,.0f} tok/s")
            except Exception:
                w["stock_error"] = traceback.format_exc()
                log(w["stock_error"])
            gc.collect()
            torch.cuda.empty_cache()
        hp = w.get("hfpaged", {}).get("tokens_per_s")
        for other in ("stock", "generate_batch"):
            if hp and other in w:
                w[f"speedup_vs_{other}"] = hp / w[other]["tokens_per_s"]

    if "prefill" in args.sections:
        prompts, _ = workload("long", args.requests or WORKLOAD_REQUESTS["long"], vocab)
        run_section(
            res,
            "prefill",
            lambda: prefill_throughput(model, prompts, args.max_num_seqs, args.compile),
            lambda pf: (
                f"prefill of {pf['requests']} prompts of 4-8k tokens: {pf['prompt_tokens_per_s']:,.0f} tok/s, "
                f"{pf['tflops']:.0f} TFLOP/s ({pf['attention_share_of_flops']:.0%} of the FLOPs in attention) = "
                f"{pf['share_of_matmul_peak']:.0%} of the dense bf16 matmul peak ({pf['matmul_peak_tflops']:.0f} TFLOP/s)"
            ),
        )
    if "parity" in args.sections:
        run_section(
            res,
            "parity",
            lambda: greedy_parity(model, compile=args.compile),
            lambda pr: (
                f"greedy parity ({pr['dtype']}, {pr['prompts']} prompts x {pr['new_tokens']} tokens vs stock generate): "
                f"{pr['share_all_match']:.0%} match on all tokens, {pr['share_first_match']:.0%} on the first, "
                f"mean matching prefix {pr['mean_matching_prefix']:.1f} tokens; yardstick, stock eager vs stock sdpa: "
                f"{pr['stock_eager_vs_sdpa']['share_all_match']:.0%} on all tokens, mean matching prefix "
                f"{pr['stock_eager_vs_sdpa']['mean_matching_prefix']:.1f}"
            ),
        )
    if "prefix" in args.sections:
        try:
            res["prefix_caching"] = prefix_caching(model)
            pc = res["prefix_caching"]
            log(
                f"prefix caching: off {pc['off']['tokens_per_s']:,.0f} tok/s, on {pc['on']['tokens_per_s']:,.0f} tok/s "
                f"({pc['speedup']:.2f}x)"
            )
        except Exception:
            res["prefix_error"] = traceback.format_exc()
            log(res["prefix_error"])
        hfpaged.unpatch(model)
    if "parallel" in args.sections:
        try:
            gen = torch.Generator().manual_seed(2)
            prompts = [torch.randint(10, vocab - 10, (1024,), generator=gen).tolist() for _ in range(8)]
            res["parallel_sampling"] = ps = parallel_sampling_kv(
                model, prompts, n=4, new_tokens=128, max_num_seqs=args.max_num_seqs
            )
            mib = ps["block_bytes"] / 2**20
            log(
                f"parallel sampling (8 prompts of 1024, n=4, 128 new): peak KV {ps['parallel']['peak_blocks']} blocks "
                f"({ps['parallel']['peak_blocks'] * mib:,.0f} MiB) vs {ps['independent']['peak_blocks']} blocks "
                f"({ps['independent']['peak_blocks'] * mib:,.0f} MiB) as 32 independent requests = {ps['block_ratio']:.2f}x"
            )
        except Exception:
            res["parallel_error"] = traceback.format_exc()
            log(res["parallel_error"])
        hfpaged.unpatch(model)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return res


def table(results, bandwidth):
    lines = [f"copy bandwidth: {bandwidth / 1e12:.2f} TB/s (read + write)", ""]
    header = f"{'model':14} {'load':5} {'stock tok/s':>12} {'gen_batch tok/s':>16} {'hfpaged tok/s':>14} {'x stock':>8} {'x gen_b':>8} {'KV use':>7}"
    lines.append(header)
    for r in results:
        for kind in WORKLOADS:
            w = r.get(kind)
            if not w:
                continue

            def f(key):
                v = w.get(key, {}).get("tokens_per_s")
                return f"{v:,.0f}" if v else "-"

            def x(key):
                v = w.get(key)
                return f"{v:.1f}x" if v else "-"

            usage = w.get("hfpaged", {}).get("kv_slot_usage")
            lines.append(
                f"{r['model']:14} {kind:5} {f('stock'):>12} {f('generate_batch'):>16} {f('hfpaged'):>14} "
                f"{x('speedup_vs_stock'):>8} {x('speedup_vs_generate_batch'):>8} "
                f"{(f'{usage:.1%}' if usage else '-'):>7}"
            )
        cold = r.get("cold_start", {})
        if "cold" in cold:
            lines.append(
                f"{r['model']:14} cold start, patch -> first result: {cold['cold']['patch_to_first_result_s']:.1f} s "
                f"with empty caches, {cold['warm']['patch_to_first_result_s']:.1f} s with warm caches"
                + (
                    f", {cold['hfpaged_cache_only']['patch_to_first_result_s']:.1f} s with only the hfpaged compile cache"
                    if "hfpaged_cache_only" in cold
                    else ""
                )
            )
        if "batch1" in r:
            b = r["batch1"]
            lines.append(
                f"{r['model']:14} batch-1 decode {b['ms_per_token']:.3f} ms/token; roofline {b['roofline_ms']:.3f} ms "
                f"-> {b['share_of_roofline']:.0%} of roofline"
            )
        if "parity" in r:
            p = r["parity"]
            lines.append(
                f"{r['model']:14} greedy parity ({p['dtype']}): {p['share_all_match']:.0%} of {p['prompts']} prompts match "
                f"stock generate on all {p['new_tokens']} tokens; mean matching prefix {p['mean_matching_prefix']:.1f} "
                f"(stock eager vs sdpa: {p['stock_eager_vs_sdpa']['share_all_match']:.0%}, "
                f"{p['stock_eager_vs_sdpa']['mean_matching_prefix']:.1f})"
            )
        if "prefix_caching" in r:
            p = r["prefix_caching"]
            lines.append(
                f"{r['model']:14} prefix caching on/off: {p['on']['tokens_per_s']:,.0f} / {p['off']['tokens_per_s']:,.0f} tok/s = {p['speedup']:.2f}x"
            )
        if "parallel_sampling" in r:
            p = r["parallel_sampling"]
            lines.append(
                f"{r['model']:14} n={p['n']} sampling peak KV blocks: {p['parallel']['peak_blocks']} shared vs "
                f"{p['independent']['peak_blocks']} independent = {p['block_ratio']:.2f}x"
            )
    return "\n".join(lines)


def plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels, series = [], {"stock": [], "generate_batch": [], "hfpaged": []}
    for r in results:
        for kind in WORKLOADS:
            if kind in r:
                labels.append(f"{r['model']}\n{kind}")
                for key in series:
                    series[key].append(r[kind].get(key, {}).get("tokens_per_s", 0) or 0)
    if not labels:
        return
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(labels)), 4.5))
    width = 0.27
    for i, (key, values) in enumerate(series.items()):
        xs = [j + (i - 1) * width for j in range(len(labels))]
        ax.bar(xs, values, width, label=key)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("output tokens / s")
    ax.set_yscale("log")
    ax.set_title("H100, bf16: stock generate vs generate_batch vs hfpaged")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    from hfpaged.core.config import KV_CACHE_DTYPES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.2-1b"], choices=list(MODELS))
    parser.add_argument("--workloads", nargs="*", default=["nano", "chat"], choices=list(WORKLOADS))
    parser.add_argument(
        "--sections",
        nargs="+",
        default=["latency", "generate_batch", "stock"],
        choices=["latency", "generate_batch", "stock", "prefix", "parallel", "parity", "cold", "prefill"],
    )
    parser.add_argument("--requests", type=int, help="requests per workload (default: 256, churn 1000, long 32)")
    parser.add_argument("--cold-start-child", metavar="MODEL", help=argparse.SUPPRESS)
    parser.add_argument("--compile-cache-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--cold-start-no-pyc",
        action="store_true",
        help="cold start: leave the environment's PYTHONDONTWRITEBYTECODE (no bytecode cache between the runs)",
    )
    parser.add_argument("--gb-requests", type=int, default=256, help="requests given to generate_batch (0: skip)")
    parser.add_argument("--stock-requests", type=int, default=64, help="requests given to stock generate (0: skip)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed hfpaged runs per workload; the median is reported (default 3)"
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="patch(compile=...): default None (compiled layers on CUDA); --no-compile: eager layers",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="patch(kv_cache_dtype=...) of hfpaged's latency and workload runs (default auto: the model's dtype)",
    )
    parser.add_argument(
        "--decode-rows-apart",
        default=None,
        choices=["cuda_fp8", "always", "never"],
        help="hfpaged.kernels.paged_attention.DECODE_ROWS_APART: where the decode rows of steps holding prompt tokens "
        "run as a decode launch of their own (default: the library's, cuda_fp8)",
    )
    parser.add_argument("--out", default="bench_out", help="folder for benchmark.json and benchmark.png")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmark.py needs a CUDA GPU")
    if args.decode_rows_apart is not None:
        import importlib

        importlib.import_module("hfpaged.kernels.paged_attention").DECODE_ROWS_APART = args.decode_rows_apart
    if args.cold_start_child:
        cold_start_child(args.cold_start_child, args.compile, args.compile_cache_dir)
        return
    os.makedirs(args.out, exist_ok=True)
    import transformers

    bandwidth = copy_bandwidth()
    log(
        f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s"
    )
    results = []
    for name in args.models:
        results.append(bench_model(name, args, bandwidth))
        with open(os.path.join(args.out, "benchmark.json"), "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "copy_bandwidth": bandwidth,
                    "args": vars(args),
                    "results": results,
                },
                f,
                indent=1,
                default=str,
            )
    text = table(results, bandwidth)
    plot(results, os.path.join(args.out, "benchmark.png"))
    log("\n" + text)


if __name__ == "__main__":
    main()
