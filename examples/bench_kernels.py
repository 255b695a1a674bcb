"""Benchmark hfpaged's Triton kernels on one CUDA GPU: decode GB/s vs copy bandwidth, prefill vs SDPA, store_kv.

Every timing replays a CUDA graph of many calls (the engine captures decode steps the same way;
it also keeps the slow host out of the numbers), rotating input sets so that small problems are
not served from L2, and takes the median over replays. Prints tables and writes JSON to --out.

    python examples/bench_kernels.py --out bench.json            # measure the defaults
    python examples/bench_kernels.py --sweep --out bench.json    # also tune tile configs first
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

if "--dry-run" in sys.argv:  # CPU smoke run of this script: kernels in Triton's interpreter (set before import)
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

from hfpaged.kernels import paged_attention, store_kv
from hfpaged.kernels.attention_config import AttentionConfig, choose_config
from hfpaged.kernels.paged_attention import paged_attention_with_config

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
L2_ROTATE_BYTES = 256 << 20  # rotate input sets until one pass touches this much memory
DEVICE = "cuda"


def graph_time_ms(calls, target_ms: float = 3.0, replays: int = 15) -> float:
    """Median milliseconds per call, replaying a CUDA graph that runs ``calls`` round-robin."""
    if DEVICE != "cuda":  # --dry-run: one timed pass on the host clock
        for call in calls:
            call()
        t = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - t) * 1e3 / len(calls)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # compile and warm up outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for call in calls:
        call()
    end.record()
    torch.cuda.synchronize()
    per_call = max(start.elapsed_time(end) / len(calls), 1e-3)
    rounds = max(1, min(400 // len(calls), math.ceil(target_ms / per_call / len(calls))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for call in calls:
                call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / (rounds * len(calls)))
    del graph
    return statistics.median(times)


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


def copy_bandwidth_gbs() -> dict:
    """Device-to-device copy of 1 GiB (torch copy_ and a plain Triton kernel), bytes read + written."""
    src = torch.randn(1 << 29 if DEVICE == "cuda" else 1 << 16, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    nbytes = 2 * src.numel() * src.element_size()
    block = 8192
    grid = (triton.cdiv(src.numel(), block),)
    result = {}
    for name, call in (
        ("torch_copy", lambda: dst.copy_(src)),
        ("triton_copy", lambda: _copy_kernel[grid](src, dst, src.numel(), BLOCK=block, num_warps=8)),
    ):
        result[name] = nbytes / graph_time_ms([call], target_ms=20, replays=10) / 1e6
    del src, dst
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    result["best"] = max(result.values())
    return result


def sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 4


def free_bytes() -> int:
    if DEVICE != "cuda":
        return 1 << 34
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


# ---- decode ----------------------------------------------------------------------------------


class DecodeProblem:
    """B sequences of `context` tokens over a shuffled block pool, in `sets` disjoint copies."""

    def __init__(self, batch: int, context: int, sets: int | None = None):
        self.batch, self.context = batch, context
        self.kv_bytes = batch * context * NUM_KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize
        self.sets = sets or max(1, min(128, math.ceil(L2_ROTATE_BYTES / self.kv_bytes)))
        blocks_per_seq = math.ceil(context / BLOCK_SIZE)
        num_blocks = batch * blocks_per_seq * self.sets
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.k_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE)
        self.v_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE)
        perm = torch.randperm(num_blocks, device=DEVICE, dtype=torch.int64).to(torch.int32)
        self.tables = list(perm.view(self.sets, batch, blocks_per_seq).unbind(0))
        self.qs = [torch.randn(batch, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE) for _ in range(self.sets)]
        self.seq_lens = torch.full((batch,), context, device=DEVICE, dtype=torch.int32)
        self.cu = torch.arange(batch + 1, device=DEVICE, dtype=torch.int32)

    @staticmethod
    def fits(batch: int, context: int) -> bool:
        need = batch * context * NUM_KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize
        return need < 0.8 * free_bytes()

    def calls(self, config: AttentionConfig | None):
        def make(i):
            args = (self.qs[i], self.k_cache, self.v_cache, self.tables[i], self.seq_lens, self.cu)
            if config is None:
                return lambda: paged_attention(*args, scale=HEAD_DIM**-0.5, max_seqlen_q=1, max_seqlen_k=self.context)
            return lambda: paged_attention_with_config(*args, scale=HEAD_DIM**-0.5, config=config)

        return [make(i) for i in range(self.sets)]

    def gbs(self, config: AttentionConfig | None = None) -> tuple[float, float]:
        ms = graph_time_ms(self.calls(config))
        return ms, self.kv_bytes / ms / 1e6

    def default_config(self) -> AttentionConfig:
        return choose_config(
            num_tokens=self.batch, num_seqs=self.batch, num_kv_heads=NUM_KV_HEADS, group=NUM_HEADS // NUM_KV_HEADS,
            head_dim_pad=HEAD_DIM, elem_size=DTYPE.itemsize, max_seqlen_q=1, max_seqlen_k=self.context,
            device=torch.device(DEVICE),
        )  # fmt: skip


def bench_decode(batches, contexts, copy_gbs):
    rows = []
    for context in contexts:
        for batch in batches:
            if not DecodeProblem.fits(batch, context):
                rows.append(dict(batch=batch, context=context, skipped="does not fit in GPU memory"))
                print(f"decode B={batch:4d} ctx={context:6d}: skipped (memory)", flush=True)
                continue
            problem = DecodeProblem(batch, context)
            ms, gbs = problem.gbs()
            row = dict(batch=batch, context=context, ms=ms, gbs=gbs, pct_copy=100 * gbs / copy_gbs,
                       config=vars(problem.default_config()))  # fmt: skip
            rows.append(row)
            print(f"decode B={batch:4d} ctx={context:6d}: {ms * 1e3:9.1f} us {gbs:7.0f} GB/s "
                  f"{row['pct_copy']:5.1f}% splits={row['config']['num_splits']}", flush=True)  # fmt: skip
            del problem
    return rows


def sweep_decode(combos):
    """Tile configs x context splits on a few decode shapes; prints and returns the winners."""
    results = []
    tiles = [(64, 4, 2), (32, 4, 2), (128, 4, 2), (64, 4, 3), (128, 8, 2), (64, 2, 2)]
    for batch, context in combos:
        if not DecodeProblem.fits(batch, context):
            continue
        problem = DecodeProblem(batch, context)
        default = problem.default_config()
        split_options = sorted({s for s in (1, 2, 4, 8, 16, 32, 64) if s * 128 <= context} | {default.num_splits})
        if batch * NUM_KV_HEADS >= 2 * sm_count():
            split_options = [s for s in split_options if s <= 2]
        candidates = [
            AttentionConfig(16, tile_n, warps, stages, splits)
            for tile_n, warps, stages in tiles
            for splits in split_options
        ]
        seen, timings = set(), []
        for config in candidates:
            if config in seen:
                continue
            seen.add(config)
            try:
                ms, gbs = problem.gbs(config)
            except Exception as exc:  # e.g. out of shared memory for this tile
                print(f"  sweep decode {config}: failed {type(exc).__name__}: {str(exc)[:80]}", flush=True)
                continue
            timings.append((ms, gbs, config))
        timings.sort(key=lambda t: t[0])
        default_ms = next((t[0] for t in timings if t[2] == default), None)
        best = timings[0]
        print(f"sweep decode B={batch} ctx={context}: best {best[2]} {best[1]:.0f} GB/s; default {default} "
              f"{'%.1f us' % (default_ms * 1e3) if default_ms else 'n/a'}; top8: "
              + ", ".join(f"{c.tile_n}/{c.num_warps}w/{c.num_stages}s/x{c.num_splits}={g:.0f}" for _, g, c in timings[:8]),
              flush=True)  # fmt: skip
        results.append(dict(batch=batch, context=context,
                            timings=[dict(vars(c), ms=ms, gbs=g) for ms, g, c in timings]))  # fmt: skip
        del problem
    return results


# ---- prefill ---------------------------------------------------------------------------------


class PrefillProblem:
    """`num_seqs` prompts of `seq_len` tokens: paged (shuffled blocks) for us, contiguous for SDPA."""

    def __init__(self, num_seqs: int, seq_len: int, sets: int = 2):
        self.num_seqs, self.seq_len, self.sets = num_seqs, seq_len, sets
        tokens = num_seqs * seq_len
        blocks_per_seq = math.ceil(seq_len / BLOCK_SIZE)
        num_blocks = num_seqs * blocks_per_seq * sets
        self.k_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        self.v_cache = torch.randn_like(self.k_cache)
        perm = torch.randperm(num_blocks, device=DEVICE).to(torch.int32)
        self.tables = list(perm.view(sets, num_seqs, blocks_per_seq).unbind(0))
        self.qs = [torch.randn(tokens, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE) for _ in range(sets)]
        self.seq_lens = torch.full((num_seqs,), seq_len, device=DEVICE, dtype=torch.int32)
        self.cu = torch.arange(0, tokens + 1, seq_len, device=DEVICE, dtype=torch.int32)
        # The same data laid out contiguously for SDPA: [B, heads, S, D].
        self.sdpa = []
        for i in range(sets):
            slots = (self.tables[i].long()[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=DEVICE)).flatten(
                1
            )
            slots = slots[:, :seq_len]
            k = self.k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots].transpose(1, 2).contiguous()
            v = self.v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots].transpose(1, 2).contiguous()
            q = self.qs[i].view(num_seqs, seq_len, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
            self.sdpa.append((q, k, v))
        self.flops = 4 * NUM_HEADS * HEAD_DIM * num_seqs * seq_len * (seq_len + 1) / 2

    def ours(self, config: AttentionConfig | None = None):
        def make(i):
            args = (self.qs[i], self.k_cache, self.v_cache, self.tables[i], self.seq_lens, self.cu)
            if config is None:
                return lambda: paged_attention(*args, scale=HEAD_DIM**-0.5, max_seqlen_q=self.seq_len,
                                               max_seqlen_k=self.seq_len)  # fmt: skip
            return lambda: paged_attention_with_config(*args, scale=HEAD_DIM**-0.5, config=config)

        return [make(i) for i in range(self.sets)]

    def sdpa_calls(self, backend, expand: bool):
        from torch.nn.attention import sdpa_kernel

        group = NUM_HEADS // NUM_KV_HEADS
        fn = torch.nn.functional.scaled_dot_product_attention

        def make(q, k, v):
            if expand:
                k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

            def call():
                if backend is None:
                    return fn(q, k, v, is_causal=True, enable_gqa=not expand)
                with sdpa_kernel([backend]):
                    return fn(q, k, v, is_causal=True, enable_gqa=not expand)

            return call

        return [make(*t) for t in self.sdpa]

    def tflops(self, calls) -> tuple[float, float]:
        ms = graph_time_ms(calls)
        return ms, self.flops / ms / 1e9

    def check(self) -> float:
        """Max abs difference between ours and SDPA on set 0 (sanity: same data, same math)."""
        ours = self.ours()[0]().view(self.num_seqs, self.seq_len, NUM_HEADS, HEAD_DIM).transpose(1, 2)
        ref = self.sdpa_calls(None, expand=True)[0]()
        return float((ours.float() - ref.float()).abs().max())


def bench_prefill(shapes):
    from torch.nn.attention import SDPBackend

    backends = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}  # fmt: skip
    rows = []
    for num_seqs, seq_len in shapes:
        problem = PrefillProblem(num_seqs, seq_len)
        ms, tflops = problem.tflops(problem.ours())
        row = dict(num_seqs=num_seqs, seq_len=seq_len, ms=ms, tflops=tflops, max_abs_diff_vs_sdpa=problem.check(),
                   sdpa={})  # fmt: skip
        for name, backend in backends.items():
            for expand in (False, True):
                key = f"{name}{'_expanded' if expand else '_gqa'}"
                try:
                    sdpa_ms, sdpa_tflops = problem.tflops(problem.sdpa_calls(backend, expand))
                    row["sdpa"][key] = dict(ms=sdpa_ms, tflops=sdpa_tflops)
                except Exception as exc:
                    row["sdpa"][key] = dict(error=f"{type(exc).__name__}: {str(exc)[:100]}")
        ok = {k: v for k, v in row["sdpa"].items() if "tflops" in v}
        default = max((v["tflops"] for k, v in ok.items() if k.startswith("default")), default=float("nan"))
        best_key = max(ok, key=lambda k: ok[k]["tflops"]) if ok else None
        row["sdpa_default_tflops"] = default
        row["sdpa_best"] = best_key
        row["pct_sdpa_default"] = 100 * tflops / default
        row["pct_sdpa_best"] = 100 * tflops / ok[best_key]["tflops"] if best_key else float("nan")
        rows.append(row)
        print(f"prefill {num_seqs}x{seq_len}: ours {ms * 1e3:8.1f} us {tflops:6.1f} TFLOP/s | SDPA default "
              f"{default:6.1f} ({row['pct_sdpa_default']:.0f}%) best {best_key} "
              f"{ok[best_key]['tflops'] if best_key else float('nan'):6.1f} ({row['pct_sdpa_best']:.0f}%) "
              f"| diff {row['max_abs_diff_vs_sdpa']:.3g}", flush=True)  # fmt: skip
        del problem
    return rows


def sweep_prefill(shapes):
    configs = [
        AttentionConfig(128, 128, 8, 3), AttentionConfig(128, 128, 8, 2), AttentionConfig(128, 64, 8, 3),
        AttentionConfig(128, 64, 8, 2), AttentionConfig(128, 32, 4, 3), AttentionConfig(128, 32, 4, 4),
        AttentionConfig(128, 64, 4, 3), AttentionConfig(64, 64, 4, 3), AttentionConfig(64, 128, 4, 3),
        AttentionConfig(128, 128, 8, 4),
    ]  # fmt: skip
    results = []
    for num_seqs, seq_len in shapes:
        problem = PrefillProblem(num_seqs, seq_len)
        timings = []
        for config in configs:
            try:
                ms, tflops = problem.tflops(problem.ours(config))
            except Exception as exc:
                print(f"  sweep prefill {config}: failed {type(exc).__name__}: {str(exc)[:80]}", flush=True)
                continue
            timings.append((ms, tflops, config))
        timings.sort(key=lambda t: t[0])
        print(f"sweep prefill {num_seqs}x{seq_len}: "
              + ", ".join(f"{c.block_m}/{c.tile_n}/{c.num_warps}w/{c.num_stages}s={t:.0f}" for _, t, c in timings),
              flush=True)  # fmt: skip
        results.append(dict(num_seqs=num_seqs, seq_len=seq_len,
                            timings=[dict(vars(c), ms=ms, tflops=t) for ms, t, c in timings]))  # fmt: skip
        del problem
    return results


# ---- store_kv --------------------------------------------------------------------------------


def bench_store_kv(token_counts, copy_gbs, warps_sweep=False):
    rows = []
    for num_tokens in token_counts:
        row_bytes = NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
        moved = 4 * num_tokens * row_bytes  # K and V, each read once and written once
        sets = max(1, min(128, math.ceil(L2_ROTATE_BYTES / moved)))
        blocks = math.ceil(num_tokens / BLOCK_SIZE) * sets
        k_cache = torch.empty(blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        v_cache = torch.empty_like(k_cache)
        perm = torch.randperm(blocks, device=DEVICE).view(sets, -1)
        inputs = []
        for i in range(sets):
            # What the engine passes: a [T, heads, D] view of a [1, heads, T, D] projection output.
            key = torch.randn(1, NUM_KV_HEADS, num_tokens, HEAD_DIM, device=DEVICE, dtype=DTYPE)[0].transpose(0, 1)
            value = torch.randn(1, NUM_KV_HEADS, num_tokens, HEAD_DIM, device=DEVICE, dtype=DTYPE)[0].transpose(0, 1)
            slots = (perm[i][:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=DEVICE)).flatten()[:num_tokens]
            inputs.append((key, value, slots))
        variants = [None] + ([1, 2, 4, 8] if warps_sweep else [])
        for warps in variants:
            calls = [(lambda k=k, v=v, s=s: store_kv(k, v, k_cache, v_cache, s, num_warps=warps)) for k, v, s in inputs]
            ms = graph_time_ms(calls)
            gbs = moved / ms / 1e6
            row = dict(
                num_tokens=num_tokens, num_warps=warps or "default", ms=ms, gbs=gbs, pct_copy=100 * gbs / copy_gbs
            )
            rows.append(row)
            print(f"store_kv T={num_tokens:6d} warps={row['num_warps']}: {ms * 1e3:8.1f} us {gbs:7.0f} GB/s "
                  f"{row['pct_copy']:5.1f}%", flush=True)  # fmt: skip
        del k_cache, v_cache, inputs
    return rows


def compiled_kernel_report() -> list[dict]:
    """Registers, spills and shared memory of every compiled attention variant (best effort)."""
    from hfpaged.kernels.attention_kernel import _paged_attention_kernel

    rows = []
    try:
        for caches in _paged_attention_kernel.device_caches.values():
            for kernel in caches[0].values():
                meta = kernel.metadata
                consts = {k: v for k, v in getattr(meta, "constants", {}).items()} if hasattr(meta, "constants") else {}
                rows.append(dict(n_regs=kernel.n_regs, n_spills=kernel.n_spills, shared=meta.shared,
                                 num_warps=meta.num_warps, num_stages=meta.num_stages, constants=str(consts)[:300]))  # fmt: skip
    except Exception as exc:  # internal API: report, do not fail the benchmark
        rows.append(dict(error=f"{type(exc).__name__}: {exc}"))
    for r in rows:
        print("kernel", {k: v for k, v in r.items() if k != "constants"}, r.get("constants", "")[:160])
    return rows


def eager_overhead_us() -> dict:
    """Wall time per call without CUDA graphs (host-bound for small problems): wrapper + launch cost."""
    problem = DecodeProblem(8, 512, sets=1)
    attention = problem.calls(None)[0]
    key = torch.randn(256, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    slots = torch.arange(256, device=DEVICE)
    result = {}
    warm, reps = (20, 200) if DEVICE == "cuda" else (1, 2)
    for name, call in (
        ("paged_attention_decode_b8", attention),
        ("store_kv_t256", lambda: store_kv(key, key, problem.k_cache, problem.v_cache, slots)),
    ):
        for _ in range(warm):
            call()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            call()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        result[name] = (time.perf_counter() - t) / reps * 1e6
    print("eager wall time per call (us):", {k: round(v, 1) for k, v in result.items()}, flush=True)
    return result


def print_summary(result):
    copy = result["copy_gbs"]
    print(f"\n=== {result['device']} | copy bandwidth {copy:.0f} GB/s (read + write) ===")
    decode = [r for r in result.get("decode", []) if "gbs" in r]
    if decode:
        batches = sorted({r["batch"] for r in result["decode"]})
        print("decode GB/s (% of copy)  " + "".join(f"{'B=' + str(b):>16}" for b in batches))
        for context in sorted({r["context"] for r in result["decode"]}):
            cells = []
            for b in batches:
                r = next((r for r in result["decode"] if r["batch"] == b and r["context"] == context), None)
                cell = "skip" if r is None or "gbs" not in r else f"{r['gbs']:.0f} ({r['pct_copy']:.0f}%)"
                cells.append(f"{cell:>16}")
            print(f"  ctx {context:6d}            " + "".join(cells))
    for r in result.get("prefill", []):
        print(f"prefill {r['num_seqs']}x{r['seq_len']:5d}: {r['tflops']:6.1f} TFLOP/s vs SDPA default "
              f"{r['sdpa_default_tflops']:6.1f} ({r['pct_sdpa_default']:.0f}%), best {r['sdpa_best']} "
              f"({r['pct_sdpa_best']:.0f}%)")  # fmt: skip
    for r in result.get("store_kv", []):
        if r["num_warps"] == "default":
            print(f"store_kv T={r['num_tokens']:6d}: {r['gbs']:6.0f} GB/s ({r['pct_copy']:.0f}% of copy)")
    if "eager_us" in result:
        print("eager wall time per call (us): " + ", ".join(f"{k} {v:.1f}" for k, v in result["eager_us"].items()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_kernels.json", help="JSON output path")
    parser.add_argument("--batches", default="1,8,64,256", help="decode batch sizes")
    parser.add_argument("--contexts", default="512,2048,8192,32768", help="decode context lengths")
    parser.add_argument("--prefill", default="1x1024,1x4096,4x256,4x1024", help="prefill shapes SEQSxLEN")
    parser.add_argument(
        "--heads", default="32/8", help="query heads / KV heads (head_dim 128), e.g. 16/8 for Qwen3-0.6B"
    )
    parser.add_argument("--store-tokens", default="256,4096,32768", help="store_kv token counts")
    parser.add_argument(
        "--sweep", action="store_true", help="also run a small tile-config sweep (after the measurements)"
    )
    parser.add_argument(
        "--sweep-decode-shapes", default="1x2048,1x32768,8x2048,8x8192", help="decode shapes BxCTX the sweep tries"
    )
    parser.add_argument("--skip", default="", help="comma list of sections to skip: decode,prefill,store")
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny sizes on CPU (Triton interpreter): checks the script"
    )
    args = parser.parse_args(argv)
    global DEVICE, DTYPE, L2_ROTATE_BYTES, NUM_HEADS, NUM_KV_HEADS
    NUM_HEADS, NUM_KV_HEADS = (int(x) for x in args.heads.split("/"))
    if args.dry_run:
        DEVICE, DTYPE, L2_ROTATE_BYTES = "cpu", torch.float32, 0
        args.batches, args.contexts, args.prefill, args.store_tokens = "1,2", "64,256", "1x64,2x32", "32"
    elif not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU (or --dry-run)")
    ints = lambda s: [int(x) for x in s.split(",") if x]
    skip = set(args.skip.split(","))
    prefill_shapes = [tuple(int(v) for v in s.split("x")) for s in args.prefill.split(",") if s]
    torch.manual_seed(0)
    t0 = time.time()
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
    copy = copy_bandwidth_gbs()
    result = dict(device=name, torch=torch.__version__, triton=triton.__version__, copy_gbs=copy["best"],
                  copy_detail=copy, heads=NUM_HEADS, kv_heads=NUM_KV_HEADS)  # fmt: skip
    print(f"{result['device']}: copy bandwidth {copy['best']:.0f} GB/s (torch copy_ {copy['torch_copy']:.0f}, "
          f"Triton copy {copy['triton_copy']:.0f}; read + write)", flush=True)  # fmt: skip
    sections = []
    if "decode" not in skip:
        sections.append(("decode", lambda: bench_decode(ints(args.batches), ints(args.contexts), result["copy_gbs"])))
    if "prefill" not in skip:
        sections.append(("prefill", lambda: bench_prefill(prefill_shapes)))
    if "store" not in skip:
        sections.append(("store_kv", lambda: bench_store_kv(ints(args.store_tokens), result["copy_gbs"], args.sweep)))
    if args.sweep:  # after the measurements of the defaults, so a cut-off run still has those
        if "decode" not in skip:
            sweep_shapes = [tuple(int(v) for v in s.split("x")) for s in args.sweep_decode_shapes.split(",") if s]
            sweep_shapes = sweep_shapes if not args.dry_run else [(1, 512)]
            sections.append(("sweep_decode", lambda: sweep_decode(sweep_shapes)))
        if "prefill" not in skip:
            shapes = [(1, 4096), (4, 1024), (1, 1024)] if not args.dry_run else [(1, 64)]
            sections.append(("sweep_prefill", lambda: sweep_prefill(shapes)))
    sections.append(("eager_us", eager_overhead_us))
    for name, run in sections:
        result[name] = run()
        result["elapsed_s"] = time.time() - t0
        print(f"[{name} done at {result['elapsed_s']:.0f}s]", flush=True)
        with open(args.out, "w") as f:  # after every section, so a cut-off run still leaves numbers
            json.dump(result, f, indent=1, default=str)
    if DEVICE == "cuda":
        result["compiled"] = compiled_kernel_report()
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    print_summary(result)
    print(f"wrote {args.out} ({result['elapsed_s']:.0f}s)")


if __name__ == "__main__":
    main()
