"""`dpserve bench serve`: a streaming load generator for any OpenAI-compatible server. The command line: flags,
the levels and their prompts, the run, the JSON report, the plot.

Usage: dpserve bench serve --base-url http://127.0.0.1:8000 --input-len 128 --output-len 64 --concurrency 1,4,16
       (also `python -m dpserve.bench_serve ...`)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import sys
import time
from collections.abc import Sequence

import orjson

from dpserve.bench.client import ClientConfig, fetch_data_parallel_size, fetch_models
from dpserve.bench.metrics import PERCENTILES, compute_metrics
from dpserve.bench.prompts import load_tokenizer, make_prompts, word_token_pool
from dpserve.bench.report import format_level, format_summary, machine, plot_title, write_png
from dpserve.bench.runner import run_level


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("expected positive integers separated by commas, e.g. 1,4,16")
    return values


def _float_list(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("expected positive rates separated by commas, e.g. 2,4 (or inf)")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dpserve bench serve",
        description="Benchmark an OpenAI-compatible server with streaming requests of fixed length "
        "(TTFT, TPOT, ITL, E2EL, throughput; definitions as in vLLM's bench serve).",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", default=None, help="model name (default: the first id from /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token ($OPENAI_API_KEY)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json file or a directory with one, or a model (.gguf path / 'smollm2'); "
        "default: the bundled model's tokenizer",
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (max_tokens, ignore_eos)")
    p.add_argument("--identical-prompts", action="store_true", help="every request sends the same prompt")
    p.add_argument(
        "--shared-prefix-len", type=int, default=0, help="tokens at the start of every prompt that all share"
    )
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (outputs may be shorter)")
    p.add_argument("--temperature", type=float, default=0.0)
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=_int_list, default=None, help="fixed concurrency levels, e.g. 1,4,16")
    load.add_argument("--request-rate", type=_float_list, default=None, help="Poisson arrival rates (req/s), e.g. 2,4")
    p.add_argument("--max-concurrency", type=int, default=None, help="with --request-rate: cap on requests in flight")
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests per level (default: 5 x concurrency, at least 10; with a rate, 10 x rate, at least 20)",
    )
    p.add_argument("--warmup", type=int, default=None, help="warm-up requests per level (default: the concurrency)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument(
        "--no-keepalive",
        action="store_true",
        help="a new connection per request (for servers that drop kept-alive connections, e.g. llama-server)",
    )
    p.add_argument("--output-json", default=None, help="write config and every per-level field here")
    p.add_argument("--output-png", default=None, help="write a plot here")
    p.add_argument("--label", default="", help="free text stored in the JSON and the plot title")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar on stderr")
    p.add_argument("--quiet", action="store_true", help="print only the summary table")
    return p


def _levels(args) -> list[tuple[int | None, float | None]]:
    if args.request_rate:
        return [(args.max_concurrency, rate) for rate in args.request_rate]
    return [(c, None) for c in (args.concurrency or [1])]


def _num_requests(args, concurrency: int | None, rate: float | None) -> int:
    if args.num_requests:
        return args.num_requests
    if rate is not None:
        return max(20, int(10 * rate)) if rate != float("inf") else 100
    return max(10, 5 * (concurrency or 1))


async def _amain(args) -> dict:
    args.base_url = args.base_url.rstrip("/")
    if args.base_url.endswith("/v1"):  # accept the OpenAI-style base URL too
        args.base_url = args.base_url[: -len("/v1")]
    extra = orjson.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise SystemExit("--extra-body must be a JSON object")
    model = args.model
    if model is None:
        models = await fetch_models(args.base_url, args.api_key)
        if not models:
            raise SystemExit(f"{args.base_url}/v1/models lists no model; pass --model")
        model = models[0]
    cfg = ClientConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=model,
        output_len=args.output_len,
        api_key=args.api_key,
        ignore_eos=not args.no_ignore_eos,
        temperature=args.temperature,
        extra_body=extra,
        request_timeout_s=args.request_timeout,
        keepalive=not args.no_keepalive,
    )
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(args.tokenizer)
    pool = word_token_pool(tokenizer)
    levels_spec = _levels(args)
    plan = []
    for i, (conc, rate) in enumerate(levels_spec):
        n = _num_requests(args, conc, rate)
        if rate is None and n < 5 * conc:
            print(
                f"warning: {n} requests at concurrency {conc} is fewer than 5 x concurrency: the level is mostly "
                "ramp-up and ramp-down, and its percentiles rest on few requests",
                file=sys.stderr,
            )
        warmup = args.warmup if args.warmup is not None else (conc or 1)
        # Distinct seeds per level and for warm-up: no distinct prompt is reused (no accidental prefix-cache
        # hits); the shared prefix / identical prompt is the same everywhere.
        common = dict(
            input_len=args.input_len,
            identical=args.identical_prompts,
            shared_prefix_len=args.shared_prefix_len,
            pool=pool,
            prefix_seed=args.seed * 1000 + 999,
        )
        prompts = make_prompts(tokenizer, n, seed=args.seed * 1000 + 2 * i, **common)
        warm = make_prompts(tokenizer, warmup, seed=args.seed * 1000 + 2 * i + 1, **common)
        plan.append((conc, rate, prompts, warm))
    if not args.quiet:
        print(f"prompts ready in {time.perf_counter() - t0:.1f}s; model {model!r} at {cfg.url}", file=sys.stderr)

    levels = []
    for conc, rate, prompts, warm in plan:
        label = f"c={conc}" if rate is None else f"rate={rate:g}"
        results, duration = await run_level(
            cfg, prompts, args.input_len, conc, rate, warm, args.seed, not args.no_progress, label
        )
        json_rate = rate if rate is None or math.isfinite(rate) else "inf"  # JSON has no infinity
        level = {"concurrency": conc, "request_rate": json_rate, "num_warmup": len(warm)}
        level.update(compute_metrics(results, duration))
        levels.append(level)
        if not args.quiet:
            print(format_level(level), flush=True)

    report = {
        "tool": "dpserve bench serve",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "label": args.label,
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": model,
        "machine": machine(),
        "server": {"data_parallel_size": await fetch_data_parallel_size(args.base_url, args.api_key)},
        "config": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "identical_prompts": args.identical_prompts,
            "shared_prefix_len": args.shared_prefix_len,
            "ignore_eos": cfg.ignore_eos,
            "temperature": cfg.temperature,
            "concurrency": args.concurrency,
            "request_rate": [r if math.isfinite(r) else "inf" for r in args.request_rate or []] or None,
            "max_concurrency": args.max_concurrency,
            "num_requests": args.num_requests,
            "warmup": args.warmup,
            "seed": args.seed,
            "tokenizer": args.tokenizer or "bundled model",
            "extra_body": extra,
            "keepalive": cfg.keepalive,
            "percentiles": list(PERCENTILES),
            "argv": sys.argv,
        },
        "levels": levels,
    }
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    if args.input_len < 1 or args.output_len < 1:
        print("--input-len and --output-len must be at least 1", file=sys.stderr)
        return 2
    import aiohttp

    try:
        import uvloop  # a cheaper event loop: the client shares the CPU with the server under test

        run = uvloop.run
    except (ImportError, AttributeError):
        run = asyncio.run
    try:
        report = run(_amain(args))
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (OSError, aiohttp.ClientError) as e:  # e.g. the server is not up
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(format_summary(report["levels"]), flush=True)
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "wb") as f:
            f.write(orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    if args.output_png:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_png)), exist_ok=True)
        write_png(args.output_png, report["levels"], plot_title(report))
    return 0 if all(lv["completed"] > 0 for lv in report["levels"]) else 1
