"""Serving benchmark: ``hfpaged serve`` vs ``transformers serve --continuous-batching`` under a Poisson stream.

Each server is started as a subprocess on a free port of 127.0.0.1 with the same model, warmed up, then sent
chat requests (streamed, greedy, ``max_tokens`` new tokens each) at several request rates - other requests for
each rate and for the warm-up (drawn alike, seeds apart), so no prompt is a prefix-cache hit of an earlier one
beyond the system prompt they all share; the servers see the same requests at each rate; requests
arrive as a Poisson process (exponential gaps, fixed seed), ``inf`` sends them all at once. Per server and
rate it reports output-token throughput, time to first token and inter-token latency (gaps between content
chunks) at p50/p99, and finally the last rate's requests run offline through ``generate_many`` in this process, so
"peak sustained serving throughput vs offline" can be read off. Writes ``bench_serve.json`` and
``bench_serve.png`` (matplotlib) under ``--out``.

    python examples/bench_serve.py --random-shape qwen3-0.6b --rates 4 8 16 32 64 inf   # GPU, random weights
    python examples/bench_serve.py --random-shape qwen3-0.6b --servers hfpaged --api-server-counts 1 2 4 \
        --rates 32 inf --num-requests 512 --client-processes 4              # several front-end processes
    python examples/bench_serve.py --model PATH --rates 2 8 inf                         # a local model directory
    python examples/bench_serve.py --random-shape tiny --device cpu --rates 2 --num-requests 8 --max-tokens 16
    # host overhead on the CPU: a 2-layer model with a large vocabulary, HTTP in its own process or not
    python examples/bench_serve.py --random-shape tiny --vocab-size 32000 --device cpu --servers hfpaged-single \
        hfpaged --rates inf --num-requests 128 --max-tokens 64 --input-len 16 64

Servers: ``hfpaged`` (``hfpaged serve``: the engine beside the model, HTTP in a front-end process),
``hfpaged-single`` (``hfpaged serve --single-process``: HTTP in a thread beside the engine, one GIL), and
``transformers``. ``--api-server-counts 1 2 4`` runs ``hfpaged`` once per count of front-end processes
(``--api-server-count N``), each its own row ``hfpaged-N``. After each hfpaged rate it prints where the engine
thread's time went (``/metrics`` scraped before and after: ``Engine.step``, commands, sending outputs, the
rest idle, as shares of the rate's wall time; steps, ms and tokens per step) and the CPU seconds per wall
second of the engine process and of each front-end process (Linux ``/proc``; ~1.0 = that process is saturated). ``--client-processes N`` spreads the requests over N client processes (round robin, one
shared schedule), so that on a fast GPU the client's own parsing does not cap what is measured; each rate
reports the client's CPU seconds per wall second (``client_cpu_per_s``, ~1.0 per process = saturated).

Models: ``--model PATH`` (a transformers directory with a tokenizer that has a chat template), or
``--random-shape NAME`` (random weights in a real shape, from ``benchmark.py``'s MODELS, or ``tiny``, the
shape of ``tests/models.py``'s Llama; ``--vocab-size`` overrides the shape's vocabulary), saved
once under ``~/.cache/hfpaged/bench_serve/`` with a word-level tokenizer over the model's whole vocabulary
("w123" is token 123, so prompt lengths are exact) and no eos, so every request makes exactly
``--max-tokens`` tokens. With a real model, eos ends requests as usual; counts come from ``usage``.

transformers serve (5.17 and 5.23 take the same flags): ``transformers serve PATH --continuous-batching``;
it answers only for ``model`` equal to PATH, applies the first request's sampling settings to every request
(we only send greedy ones), reads ``max_tokens`` (5.17 ignores ``max_completion_tokens``) and always puts
``usage`` in its last chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "hfpaged", "bench_serve")
SERVED_NAME = "bench-model"
TINY_SHAPE = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=2048,
    initializer_range=0.3,
)
ROLE_WORDS = ["<unk>", "<s>", "</s>", "system:", "user:", "assistant:"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly and precisely."
WORDS = [
    "time",
    "person",
    "year",
    "way",
    "day",
    "thing",
    "man",
    "world",
    "life",
    "hand",
    "part",
    "child",
    "eye",
    "woman",
    "place",
    "work",
    "week",
    "case",
    "point",
    "government",
    "company",
    "number",
    "group",
    "problem",
    "fact",
    "water",
    "story",
    "answer",
    "question",
    "city",
    "river",
    "music",
    "model",
    "engine",
    "paper",
    "system",
    "light",
    "sound",
    "energy",
    "market",
    "school",
    "family",
    "garden",
    "window",
    "kitchen",
    "mountain",
    "ocean",
    "planet",
    "forest",
    "island",
    "bridge",
    "road",
]


def log(*args) -> None:
    print(*args, flush=True)


# --- the model ---------------------------------------------------------------------------------------


def random_shape_spec(name: str) -> dict:
    if name == "tiny":
        return dict(TINY_SHAPE)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchmark import MODELS

    return dict(MODELS[name])


def word_level_tokenizer(vocab_size: int):
    """Token i is the word ``w{i}`` (the first few are specials and role words); a chat template on top."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(ROLE_WORDS)}
    vocab.update((f"w{i}", i) for i in range(len(ROLE_WORDS), vocab_size))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_random_model(name: str, dtype_name: str, vocab_size: int | None = None) -> str:
    """Random weights in the shape ``name`` + a word-level tokenizer, saved once; no eos (fixed lengths)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = os.path.join(CACHE, f"{name}-{dtype_name}" + (f"-vocab{vocab_size}" if vocab_size else ""))
    if os.path.exists(os.path.join(path, "config.json")):
        if GenerationConfig.from_pretrained(path).pad_token_id is None:
            return path
        shutil.rmtree(path)  # saved before pad_token_id went: id 0 is also the tokenizer's <unk>, in the prompts
    log(f"saving random weights in the {name} shape to {path} ...")
    spec = random_shape_spec(name)
    if vocab_size:
        spec["vocab_size"] = vocab_size
    spec.pop("eos_token_id", None)
    config = AutoConfig.for_model(spec.pop("model_type"), eos_token_id=None, **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype_name))
    # no pad id: the word-level tokenizer's <unk> is id 0, and a pad id in a prompt is refused (stock masks it out)
    model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=None, do_sample=False)
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    word_level_tokenizer(config.vocab_size).save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def conversation_sets(args: argparse.Namespace) -> dict:
    """{"warmup": the warm-up's requests, "rates": one list per rate}: every set drawn with its own seed, so a rate
    never re-sends prompts an earlier rate (or the warm-up) left in a server's prefix cache."""
    input_range, word_level = tuple(args.input_len), args.model is None
    return {
        "warmup": make_conversations(args.warmup_requests, input_range, args.seed + 10_000, word_level),
        "rates": [
            make_conversations(args.num_requests, input_range, args.seed + i, word_level)
            for i in range(len(args.rates))
        ],
    }


def make_conversations(num_requests: int, input_range: tuple[int, int], seed: int, word_level: bool) -> list[list]:
    """Chat-shaped requests: a shared system prompt and a user turn of ~U[input_range] tokens."""
    rng = random.Random(seed)
    conversations = []
    for _ in range(num_requests):
        length = rng.randint(*input_range)
        if word_level:
            words = [f"w{rng.randrange(len(ROLE_WORDS), 1000)}" for _ in range(length)]
        else:
            words = [rng.choice(WORDS) for _ in range(length)]
        conversations.append(
            [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": " ".join(words)}]
        )
    return conversations


# --- servers -----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(
    kind: str, path: str, port: int, args: argparse.Namespace, extra: tuple[str, ...] = ()
) -> tuple[list[str], str]:
    """(command line, the name clients must pass as ``model``); ``extra``: more flags for hfpaged serve."""
    if kind in ("hfpaged", "hfpaged-single"):
        command = [
            sys.executable,
            "-m",
            "hfpaged.serve.cli",
            "serve",
            path,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            SERVED_NAME,
            "--device",
            args.device,
            "--dtype",
            args.dtype,
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--max-waiting",
            str(max(1024, args.num_requests)),
            "--gpu-memory-utilization",
            str(args.gpu_memory_utilization),
            "--log-level",
            "warning",
            *(["--single-process"] if kind == "hfpaged-single" else []),
            *extra,
            *args.hfpaged_args.split(),
        ]
        return command, SERVED_NAME
    beside = os.path.join(os.path.dirname(sys.executable), "transformers")  # this environment's transformers
    executable = beside if os.access(beside, os.X_OK) else shutil.which("transformers")
    prefix = (
        [executable] if executable else [sys.executable, "-c", "from transformers.cli.transformers import main; main()"]
    )
    command = [
        *prefix,
        "serve",
        path,
        "--continuous-batching",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--log-level",
        "warning",
        *args.transformers_args.split(),
    ]
    return command, path  # transformers serve only answers for model == the path it was started with


def start_server(
    command: list[str], url: str, log_path: str, timeout: float, device: str, torch_threads: int | None = None
) -> subprocess.Popen:
    import httpx

    log("  $ " + " ".join(command))
    env = dict(os.environ)
    if torch_threads:
        env["OMP_NUM_THREADS"] = str(torch_threads)
    if device == "cpu":
        # Both servers run torch in a thread beside the one that loaded the model; OpenMP's default spin-waiting
        # of the loading thread's team then slows CPU steps ~3x (measured). GPU runs are unaffected.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    log_file = open(log_path, "w")  # noqa: SIM115 - the server process writes to it until it is stopped
    process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(process)
    raise TimeoutError(f"the server did not answer /health within {timeout} s; see {log_path}")


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


# --- the client --------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    ok: bool = False
    error: str | None = None
    send_time: float = 0.0
    ttft: float | None = None
    latency: float | None = None
    output_tokens: int = 0
    chunk_gaps: list[float] = field(default_factory=list)


async def one_request(client, url: str, body: dict, start: float) -> RequestRecord:
    record = RequestRecord()
    sent = time.perf_counter()
    record.send_time = sent - start
    last = None
    num_chunks = 0
    usage = None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = str(chunk["error"])[:200]
                    return record
                usage = chunk.get("usage") or usage
                choices = chunk.get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    if last is None:
                        record.ttft = now - sent
                    else:
                        record.chunk_gaps.append(now - last)
                    last = now
                    num_chunks += 1
    except Exception as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.latency = time.perf_counter() - sent
    record.output_tokens = usage["completion_tokens"] if usage else num_chunks
    record.ok = record.ttft is not None
    if not record.ok:
        record.error = "no content"
    return record


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of a Poisson process of ``rate`` requests/s; all 0 for inf."""
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(num_requests):
        offsets.append(t)
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    return offsets


async def run_part(url: str, bodies: list[dict], offsets: list[float], start_at: float) -> list[RequestRecord]:
    """Send ``bodies`` at ``start_at`` (``time.time()``) + their offsets; one record each."""
    import httpx

    limits = httpx.Limits(max_connections=len(bodies) + 8, max_keepalive_connections=len(bodies) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        start = time.perf_counter() + (start_at - time.time())

        async def delayed(body, offset):
            await asyncio.sleep(max(0.0, offset - (time.perf_counter() - start)))
            return await one_request(client, url, body, start)

        return list(await asyncio.gather(*(delayed(b, o) for b, o in zip(bodies, offsets))))


def run_part_here(url: str, bodies: list[dict], offsets: list[float], start_at: float) -> tuple[list, float, float]:
    """``run_part`` in this process: (records, time.time() at the end, CPU seconds this process spent)."""
    cpu = time.process_time()
    records = asyncio.run(run_part(url, bodies, offsets, start_at))
    return records, time.time(), time.process_time() - cpu


def run_stream(
    url: str, bodies: list[dict], rate: float, seed: int, pool=None, num_parts: int = 1
) -> tuple[list[RequestRecord], float, float]:
    """Send ``bodies`` as a Poisson process of ``rate`` requests/s (inf: all at once), from this process or
    spread round robin over ``pool``'s ``num_parts`` processes; (records, wall seconds, client CPU seconds)."""
    offsets = arrival_offsets(len(bodies), rate, seed)
    if pool is None or num_parts == 1:
        start_at = time.time()
        records, end, cpu = run_part_here(url, bodies, offsets, start_at)
        return records, end - start_at, cpu
    start_at = time.time() + 1.0  # every process is ready to send by then
    futures = [
        pool.submit(run_part_here, url, bodies[k::num_parts], offsets[k::num_parts], start_at) for k in range(num_parts)
    ]
    parts = [future.result() for future in futures]
    records: list[RequestRecord] = [None] * len(bodies)
    for k, (part, _, _) in enumerate(parts):
        records[k::num_parts] = part
    return records, max(end for _, end, _ in parts) - start_at, sum(cpu for _, _, cpu in parts)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(records: list[RequestRecord], wall: float, client_cpu: float) -> dict:
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft * 1e3 for r in ok]
    gaps = [g * 1e3 for r in ok for g in r.chunk_gaps]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) * 1e3 for r in ok if r.output_tokens > 1]
    return {
        "num_ok": len(ok),
        "num_failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
        "ttft_ms_p50": percentile(ttfts, 50),
        "ttft_ms_p99": percentile(ttfts, 99),
        "itl_ms_p50": percentile(gaps, 50),
        "itl_ms_p99": percentile(gaps, 99),
        "tpot_ms_p50": percentile(tpots, 50),
        "latency_s_p50": percentile([r.latency for r in ok], 50),
        "client_cpu_per_s": client_cpu / wall if wall > 0 else 0.0,
    }


def bench_server(
    kind: str, path: str, conversations: dict, args: argparse.Namespace, label: str | None = None, extra=()
) -> dict:
    """One server's run over every rate (``conversations``: ``conversation_sets``); ``label`` names its row (default
    ``kind``), ``extra`` adds hfpaged flags."""
    label = label or kind
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command, model_name = server_command(kind, path, port, args, tuple(extra))
    log(f"\n== {label} ==")
    result = {"command": command, "rates": {}}
    hfpaged = kind.startswith("hfpaged")
    try:
        process = start_server(
            command,
            url,
            os.path.join(args.out, f"{label}_server.log"),
            args.startup_timeout,
            args.device,
            args.torch_threads,
        )
    except (RuntimeError, TimeoutError) as exc:
        log(f"  {label} did not start: {exc}")
        result["error"] = str(exc)
        return result

    def bodies(convs):
        return [
            {
                "model": model_name,
                "messages": c,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            for c in convs
        ]

    pool = None
    if args.client_processes > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(args.client_processes, mp_context=multiprocessing.get_context("spawn"))
    parts = args.client_processes
    try:
        warm = run_stream(url, bodies(conversations["warmup"]), math.inf, args.seed, pool, parts)[0]
        log(
            f"  warm-up: {sum(r.ok for r in warm)}/{len(warm)} ok"
            + (f" ({warm[0].error})" if warm and not warm[0].ok else "")
        )
        for rate, rate_conversations in zip(args.rates, conversations["rates"]):
            if hfpaged:
                before, cpu_before = scrape(url), server_cpu_seconds(process.pid)
            records, wall, client_cpu = run_stream(url, bodies(rate_conversations), rate, args.seed, pool, parts)
            summary = summarize(records, wall, client_cpu)
            result["rates"][str(rate)] = summary
            log(
                f"  rate {rate:>6}: {summary['num_ok']}/{len(records)} ok, {summary['output_tokens_per_s']:9.1f} tok/s, "
                f"TTFT p50/p99 {_ms(summary['ttft_ms_p50'])}/{_ms(summary['ttft_ms_p99'])} ms, "
                f"ITL p50/p99 {_ms(summary['itl_ms_p50'])}/{_ms(summary['itl_ms_p99'])} ms, "
                f"client CPU {summary['client_cpu_per_s']:.2f}/s"
                + (f"  errors: {summary['errors']}" if summary["errors"] else "")
            )
            if hfpaged:
                cpu_after = server_cpu_seconds(process.pid)
                time.sleep(0.3)  # the engine's last snapshot (sent when it goes idle) reaches the front ends
                summary["engine_loop"] = engine_loop_breakdown(before, scrape(url), wall)
                summary["server_cpu_per_s"] = cpu_per_second(cpu_before, cpu_after, wall)
                log(describe_server_side(summary["engine_loop"], summary["server_cpu_per_s"]))
        if hfpaged:
            result["server_metrics"] = server_metrics(url)
    finally:
        stop_server(process)
        if pool is not None:
            pool.shutdown()
    return result


def scrape(url: str) -> dict[str, float]:
    """Every hfpaged sample of /metrics but histogram buckets: {name{labels}: value}."""
    import httpx

    values = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("hfpaged_") and "_bucket{" not in name and not name.endswith("_created"):
            values[name] = float(value)
    return values


def server_metrics(url: str) -> dict[str, float]:
    """hfpaged's own counters after the run (preemptions, prefix-cache hits, ...), from /metrics."""
    return {name: value for name, value in scrape(url).items() if "{" not in name}


LOOP_PARTS = ("step", "commands", "outputs", "idle")


def engine_loop_breakdown(before: dict[str, float], after: dict[str, float], wall: float) -> dict:
    """Where the engine thread's time went during one rate (deltas of ``hfpaged_engine_loop_seconds_total``):
    seconds per part, each part's share of the rate's wall time, steps, ms and generated tokens per step."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    seconds = {part: delta(f'hfpaged_engine_loop_seconds_total{{part="{part}"}}') for part in LOOP_PARTS}
    steps = delta("hfpaged_engine_loop_steps_total")
    tokens = delta("hfpaged_generation_tokens_total")
    busy = seconds["step"] + seconds["commands"] + seconds["outputs"]
    return {
        "seconds": seconds,
        "share_of_wall": {part: seconds[part] / wall if wall > 0 else 0.0 for part in ("step", "commands", "outputs")},
        "rest_of_wall": 1 - busy / wall if wall > 0 else 0.0,  # idle, mostly (before the first arrival, ...)
        "steps": steps,
        "ms_per_step": seconds["step"] / steps * 1e3 if steps else None,
        "tokens_per_step": tokens / steps if steps else None,
        "generated_tokens": tokens,
    }


def server_cpu_seconds(pid: int) -> dict[int, float] | None:
    """CPU seconds (user + system) of the server process and of its children (the front ends), from /proc."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        children = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(child) for child in f.read().split()]
        cpu = {}
        for process_id in [pid, *sorted(children)]:
            with open(f"/proc/{process_id}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            cpu[process_id] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        return cpu
    except (OSError, ValueError, IndexError):  # not Linux, or a process ended meanwhile
        return None


def cpu_per_second(before: dict | None, after: dict | None, wall: float) -> dict | None:
    """{"engine": CPU s per wall s of the server process, "front_ends": [... of each child]}."""
    if not before or not after or wall <= 0:
        return None
    pids = [pid for pid in after if pid in before]
    if not pids:
        return None
    rates = [(after[pid] - before[pid]) / wall for pid in pids]
    return {"engine": rates[0], "front_ends": rates[1:]}


def describe_server_side(loop: dict, cpu: dict | None) -> str:
    shares = loop["share_of_wall"]
    text = (
        f"    engine loop: step {shares['step']:.0%}, commands {shares['commands']:.0%}, "
        f"outputs {shares['outputs']:.0%}, rest {loop['rest_of_wall']:.0%} of the wall time; "
        f"{loop['steps']:.0f} steps, {_ms(loop['ms_per_step'])} ms and "
        f"{'-' if loop['tokens_per_step'] is None else format(loop['tokens_per_step'], '.1f')} tokens per step"
    )
    if cpu is not None:
        text += f"\n    CPU s per s: engine process {cpu['engine']:.2f}, front ends " + " ".join(
            f"{rate:.2f}" for rate in cpu["front_ends"]
        )
    return text


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


# --- offline -----------------------------------------------------------------------------------------


def bench_offline(path: str, conversations: dict, args: argparse.Namespace) -> dict:
    """The last rate's requests through ``generate_many`` in this process (greedy, same lengths): tokens/s."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hfpaged

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype != "auto"
        else (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    hfpaged.patch(
        model, tokenizer=tokenizer, max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization
    )

    def encode(convs):
        return [
            list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
            for c in convs
        ]

    prompts = encode(conversations["rates"][-1])  # the last rate's requests (``inf`` in the usual order)
    model.generate_many(encode(conversations["warmup"]), max_new_tokens=args.max_tokens, do_sample=False)
    walls = []
    for _ in range(args.offline_repeats):
        hfpaged.reset_prefix_cache(model)  # each repeat prefills every prompt (no hits from the last one)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        results = model.generate_many(prompts, max_new_tokens=args.max_tokens, do_sample=False)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    wall = statistics.median(walls)
    tokens = sum(len(r.token_ids) for r in results)
    hfpaged.unpatch(model)
    del model
    return {
        "wall_s": wall,
        "wall_s_runs": walls,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "prompt_tokens": sum(len(p) for p in prompts),
    }


# --- report ------------------------------------------------------------------------------------------


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for kind, result in report["servers"].items():
        rates = list(result.get("rates", {}))
        if not rates:
            continue
        xs = [float(r) if math.isfinite(float(r)) else None for r in rates]
        finite = [x for x in xs if x is not None]
        inf_x = max(finite) * 2 if finite else 1.0
        xs = [x if x is not None else inf_x for x in xs]
        rows = [result["rates"][r] for r in rates]
        axes[0].plot(xs, [row["output_tokens_per_s"] for row in rows], "o-", label=kind)
        for ax in axes:
            ax.set_xticks(xs, [f"{float(r):g}" if math.isfinite(float(r)) else "all" for r in rates])
        for ax, key in ((axes[1], "ttft_ms"), (axes[2], "itl_ms")):
            for q, style in (("p50", "o-"), ("p99", "s--")):
                ys = [row[f"{key}_{q}"] if row[f"{key}_{q}"] is not None else float("nan") for row in rows]
                ax.plot(xs, ys, style, label=f"{kind} {q}")
    offline = report.get("offline")
    if offline:
        axes[0].axhline(offline["output_tokens_per_s"], color="gray", linestyle=":", label="offline generate_many")
    for ax, title, unit in (
        (axes[0], "output throughput", "tokens/s"),
        (axes[1], "time to first token", "ms"),
        (axes[2], "inter-token latency", "ms"),
    ):
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s; rightmost point: all at once)")
        ax.set_ylabel(unit)
        ax.set_xscale("log")
        ax.minorticks_off()
        if unit == "ms":
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['model']} - {report['num_requests']} chat requests, {report['max_tokens']} new tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="local transformers model directory (tokenizer with a chat template)")
    source.add_argument("--random-shape", help="random weights in a real shape: tiny, qwen3-0.6b, llama-3.2-1b, ...")
    parser.add_argument(
        "--servers",
        nargs="+",
        default=["hfpaged", "transformers"],
        choices=["hfpaged", "hfpaged-single", "transformers"],
        help="hfpaged: HTTP in a front-end process; hfpaged-single: HTTP beside the engine (--single-process)",
    )
    parser.add_argument(
        "--rates",
        nargs="+",
        type=float,
        default=[4, 8, 16, 32, 64, math.inf],
        help="request rates in requests/s; inf sends every request at once",
    )
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument(
        "--input-len",
        nargs=2,
        type=int,
        default=[32, 512],
        metavar=("MIN", "MAX"),
        help="user-turn length range in tokens (words)",
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    parser.add_argument("--vocab-size", type=int, help="with --random-shape: this vocabulary size instead")
    parser.add_argument(
        "--torch-threads",
        type=int,
        help="torch CPU threads in the servers (OMP_NUM_THREADS) and the offline run; one is steadiest on a "
        "small shared CPU, where a busy core stalls every parallel op",
    )
    parser.add_argument(
        "--client-processes", type=int, default=1, help="client processes sending the requests (round robin)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--warmup-requests", type=int, default=8)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument(
        "--api-server-counts",
        nargs="+",
        type=int,
        help="run hfpaged once per count of front-end processes (--api-server-count N), rows hfpaged-N",
    )
    parser.add_argument("--hfpaged-args", default="", help="extra flags for hfpaged serve, e.g. '--compile'")
    parser.add_argument("--transformers-args", default="", help="extra flags for transformers serve")
    parser.add_argument("--no-offline", action="store_true", help="skip the offline generate_many run")
    parser.add_argument("--offline-repeats", type=int, default=3, help="offline runs; the median is reported")
    parser.add_argument("--out", default="bench_serve_out")
    args = parser.parse_args(argv)

    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    os.makedirs(args.out, exist_ok=True)
    path = args.model or save_random_model(args.random_shape, args.dtype, args.vocab_size)
    conversations = conversation_sets(args)
    import transformers

    report = {
        "model": args.model or f"random {args.random_shape}",
        "path": path,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "dtype": args.dtype,
        "num_requests": args.num_requests,
        "input_len": args.input_len,
        "max_tokens": args.max_tokens,
        "rates": [str(r) for r in args.rates],
        "max_num_seqs": args.max_num_seqs,
        "vocab_size": args.vocab_size,
        "client_processes": args.client_processes,
        "api_server_counts": args.api_server_counts,
        "torch_threads": args.torch_threads,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "servers": {},
    }
    for kind in args.servers:
        if kind == "hfpaged" and args.api_server_counts:
            for count in args.api_server_counts:
                label = f"hfpaged-{count}"
                extra = ("--api-server-count", str(count))
                report["servers"][label] = bench_server(kind, path, conversations, args, label, extra)
        else:
            report["servers"][kind] = bench_server(kind, path, conversations, args)
    if not args.no_offline:
        log("\n== offline generate_many ==")
        report["offline"] = bench_offline(path, conversations, args)
        log(
            f"  {report['offline']['output_tokens']} tokens in {report['offline']['wall_s']:.2f} s: "
            f"{report['offline']['output_tokens_per_s']:.1f} tok/s"
        )
        report["peak_vs_offline"] = {}
        for label, result in report["servers"].items():
            hf_rates = result.get("rates", {})
            if label.startswith("hfpaged") and hf_rates:
                peak = max(row["output_tokens_per_s"] for row in hf_rates.values())
                ratio = peak / report["offline"]["output_tokens_per_s"]
                report["peak_vs_offline"][label] = report[f"{label.replace('-', '_')}_peak_vs_offline"] = ratio
                log(f"  {label} serve peak {peak:.1f} tok/s = {ratio:.0%} of offline")
    with open(os.path.join(args.out, "bench_serve.json"), "w") as f:
        json.dump(report, f, indent=2, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))
    plot(report, os.path.join(args.out, "bench_serve.png"))
    log(f"\nwrote {args.out}/bench_serve.json and {args.out}/bench_serve.png")


if __name__ == "__main__":
    main()
