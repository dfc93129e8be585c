"""What CurveZMQ costs: the same `dpserve serve` with its cluster key (CURVE on every ZMQ socket, the default) and
with `--insecure-zmq`, rounds interleaved (A B A B ...), the same client (`dpserve bench serve`).

    .venv/bin/python benchmarks/curve_cost.py                  # results appended to docs/benchmarks.md
    .venv/bin/python benchmarks/curve_cost.py --rounds 1 --no-append

- model: the default `make serve` deployment (ray, DP=2, the bundled model), concurrency 32, 128 prompt / 64 output
  tokens: output tok/s and median TPOT. The engines' compute hides most of the transport.
- null: null engines (instant tokens; DP=2, 2 API servers, mp), concurrency 64: every token crosses the engine
  sockets with nothing else to do, so this is the transport's worst case.

Each ratio is CURVE / plain, the median over rounds of the per-round ratio; 1.00 = no cost.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare import Server, append_doc, bench, log, machine, med  # noqa: E402


def _round(name: str, secure: bool, opts) -> dict:
    extra = [] if secure else ["--insecure-zmq"]
    if name == "model":
        server = Server(f"curve-{'on' if secure else 'off'}", dp=2, threads_per_rank=None, extra=extra,
                        backend="ray")  # fmt: skip
        args = ["--concurrency", "32", "--num-requests", str(opts.model_requests), "--warmup", "32",
                "--input-len", "128", "--output-len", "64"]  # fmt: skip
    else:
        server = Server(f"curve-null-{'on' if secure else 'off'}", dp=2, threads_per_rank=None, null_engine=True,
                        api_servers=2, extra=extra, backend="mp")  # fmt: skip
        args = ["--concurrency", "64", "--num-requests", str(opts.null_requests), "--warmup", "64",
                "--input-len", "128", "--output-len", "64"]  # fmt: skip
    env_key = os.environ.pop("DPSERVE_CLUSTER_KEY", None)  # serve makes its own, as `make serve` does
    try:
        server.start()
        level = bench(server.url, args)["levels"][0]
    finally:
        server.stop()
        if env_key is not None:
            os.environ["DPSERVE_CLUSTER_KEY"] = env_key
    result = {"output_throughput": level["output_throughput"], "median_tpot_ms": level["median_tpot_ms"],
              "median_ttft_ms": level["median_ttft_ms"], "failed": level["failed"]}  # fmt: skip
    log(f"{name} {'CURVE' if secure else 'plain'}: {json.dumps(result)}")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser("benchmarks/curve_cost.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--only", choices=["model", "null"], default=None)
    p.add_argument("--model-requests", type=int, default=128)
    p.add_argument("--null-requests", type=int, default=1920)
    p.add_argument("--no-append", action="store_true")
    opts = p.parse_args(argv)
    lines = [f"## {time.strftime('%Y-%m-%d')}: CurveZMQ's cost (`{' '.join(['benchmarks/curve_cost.py', *(argv or sys.argv[1:])])}`)",
             "", f"Machine: {machine()}.", "",
             "| setup | CURVE | plain (`--insecure-zmq`) | ratio CURVE / plain (median of rounds) |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    for name in ("model", "null"):
        if opts.only not in (None, name):
            continue
        rounds = []
        for r in range(opts.rounds):
            rounds.append((_round(name, True, opts), _round(name, False, opts)))
        for key, unit in (("output_throughput", "out tok/s"), ("median_tpot_ms", "ms TPOT")):
            on = [a[key] for a, _ in rounds]
            off = [b[key] for _, b in rounds]
            ratio = med([a / b for a, b in zip(on, off) if b])
            setup = ("ray DP=2, bundled model, c=32, 128/64" if name == "model" else
                     "null engines DP=2, 2 API servers, mp, c=64, 128/64")  # fmt: skip
            lines.append(f"| {setup}: {unit} | {' / '.join(f'{v:.4g}' for v in on)} | "
                         f"{' / '.join(f'{v:.4g}' for v in off)} | {ratio:.3f} |")  # fmt: skip
        failed = sum(a["failed"] + b["failed"] for a, b in rounds)
        if failed:
            lines.append(f"| {name}: failed requests | {failed} | | |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not opts.no_append:
        append_doc(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
