"""What expert parallelism costs and saves: the upcycled MoE model (`smollm2-moe:4:noise=0.02`: 4 perturbed copies
of SmolLM2's MLP per layer, top-2, so routing matters) served three ways under the same load, with the same client
(`dpserve bench serve`):

- dp2-ep: DP=2 with --enable-expert-parallel: each rank holds 2 of the 4 experts, every step is a set of
  collectives over both ranks (gather + reduce per MoE layer, expert_parallel.py), the ranks step in lock-step
  waves (a rank without requests runs dummy steps);
- dp2-all: DP=2, every rank holds all 4 experts and steps on its own (no group);
- dp1: one rank holding all experts.

    .venv/bin/python benchmarks/moe_ep.py                       # results appended to docs/benchmarks.md
    .venv/bin/python benchmarks/moe_ep.py --rounds 1 --no-append --num-requests 16

Per setup: output tok/s, median TPOT and TTFT; per rank, from /metrics over the whole run (warm-up included):
model steps (`dpserve:engine_steps`), dummy steps (`dpserve:engine_dummy_steps`), seconds in collectives
(`dpserve:engine_collective_seconds`, waiting for the other rank included) and that time per step (model and
dummy steps together), KV blocks (`dpserve:engine_kv_blocks`), and the expert weights the rank holds (its log).
mp backend; the decode step of an MoE model runs eager (--enforce-eager). Rounds go through the setups in turn
(A B C A B C ...). Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare import Server, append_doc, bench, log, machine, med  # noqa: E402

from dpserve.bench.metrics import engine_metrics  # noqa: E402

SETUPS = {
    "dp2-ep": (2, ["--enable-expert-parallel"]),
    "dp2-all": (2, []),
    "dp1": (1, []),
}
_COUNTERS = {
    "dpserve:engine_steps_total": "steps",
    "dpserve:engine_dummy_steps_total": "dummy_steps",
    "dpserve:engine_collective_seconds_total": "collective_s",
    "dpserve:engine_kv_blocks": "kv_blocks",
}
_EXPERTS = re.compile(r"engine\[(\d+)\].*holding experts (\S+(?:, \S+)*) of \d+ \(([\d.]+) MiB of expert weights\)")


def engine_samples(url: str) -> dict[int, dict[str, float]]:
    """rank -> {steps, dummy_steps, collective_s, kv_blocks} from /metrics."""
    found: dict[int, dict[str, float]] = {}
    for name, per_rank in engine_metrics(url).items():
        for rank, value in per_rank.items():
            if name in _COUNTERS:
                found.setdefault(rank, {})[_COUNTERS[name]] = value
    return found


def experts_held(log_path: str) -> dict[int, str]:
    """rank -> 'experts 0..1 (X MiB)' from the last such line of each engine's log."""
    held: dict[int, str] = {}
    with open(log_path, errors="replace") as f:
        for line in f:
            m = _EXPERTS.search(line)
            if m:
                held[int(m.group(1))] = f"experts {m.group(2)} ({float(m.group(3)):.1f} MiB)"
    return held


def run_setup(name: str, opts) -> dict:
    dp, extra = SETUPS[name]
    server = Server(f"moe-{name}", dp=dp, threads_per_rank=None, backend="mp",
                    extra=["--model", opts.model, "--enforce-eager", "--max-num-seqs", str(opts.concurrency),
                           *extra])  # fmt: skip
    args = ["--concurrency", str(opts.concurrency), "--num-requests", str(opts.num_requests),
            "--warmup", str(opts.concurrency), "--input-len", str(opts.input_len),
            "--output-len", str(opts.output_len)]  # fmt: skip
    try:
        server.start()
        before = engine_samples(server.url)
        level = bench(server.url, args)["levels"][0]
        time.sleep(1.5)  # the engines' counters reach /metrics every second
        after = engine_samples(server.url)
        held = experts_held(server.log_path)
    finally:
        server.stop()
    ranks = {}
    for rank, now in sorted(after.items()):
        was = before.get(rank, {})
        delta = {k: now.get(k, 0.0) - was.get(k, 0.0) for k in ("steps", "dummy_steps", "collective_s")}
        all_steps = delta["steps"] + delta["dummy_steps"]
        ranks[rank] = {**delta, "kv_blocks": now.get("kv_blocks", 0.0), "held": held.get(rank, "?"),
                       "collective_ms_per_step": 1000 * delta["collective_s"] / all_steps if all_steps else 0.0}
    result = {"output_throughput": level["output_throughput"], "median_tpot_ms": level["median_tpot_ms"],
              "median_ttft_ms": level["median_ttft_ms"], "failed": level["failed"],
              "completed": level["completed"], "ranks": ranks}  # fmt: skip
    log(f"{name}: {json.dumps(result)}")
    return result


def markdown(runs: dict[str, list[dict]], opts, command: str) -> str:
    lines = [f"### {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: MoE expert parallel (`{command}`)", "",
             f"Machine: {machine()}. Model `{opts.model}`, mp backend, eager; {opts.concurrency} concurrent streams, "
             f"{opts.num_requests} requests (+{opts.concurrency} warm-up) of {opts.input_len} prompt / "
             f"{opts.output_len} output tokens, {opts.rounds} round(s).", "",
             "| setup | out tok/s | TPOT p50 ms | TTFT p50 ms | per rank: experts held, KV blocks, model steps, dummy "
             "steps, collectives s (ms per step) |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, results in runs.items():
        per_rank = []
        last = results[-1]["ranks"]
        for rank, r in last.items():
            per_rank.append(f"r{rank}: {r['held']}, {r['kv_blocks']:.0f} blocks, {r['steps']:.0f} steps, "
                            f"{r['dummy_steps']:.0f} dummy, {r['collective_s']:.2f} s "
                            f"({r['collective_ms_per_step']:.2f} ms/step)")  # fmt: skip
        fmt = lambda key: " / ".join(f"{x[key]:.1f}" for x in results)  # noqa: E731
        lines.append(f"| {name} | {fmt('output_throughput')} | {fmt('median_tpot_ms')} | {fmt('median_ttft_ms')} | "
                     f"{'; '.join(per_rank)} |")  # fmt: skip
    failed = sum(x["failed"] for results in runs.values() for x in results)
    ep, dp1 = runs.get("dp2-ep"), runs.get("dp1")
    if ep and dp1:
        ratio = med([a["output_throughput"] / b["output_throughput"] for a, b in zip(ep, dp1)])
        lines += ["", f"- dp2-ep / dp1 output tok/s: {ratio:.3f}"]
    if ep and runs.get("dp2-all"):
        ratio = med([a["output_throughput"] / b["output_throughput"] for a, b in zip(ep, runs["dp2-all"])])
        lines.append(f"- dp2-ep / dp2-all output tok/s: {ratio:.3f}")
    lines.append(f"- failed requests: {failed}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser("benchmarks/moe_ep.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-moe:4:noise=0.02")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--only", action="append", choices=list(SETUPS), help="run only these setups (repeatable)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--no-append", action="store_true")
    opts = p.parse_args(argv)
    names = [n for n in SETUPS if not opts.only or n in opts.only]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for _ in range(opts.rounds):
        for name in names:
            runs[name].append(run_setup(name, opts))
    text = markdown(runs, opts, " ".join(["benchmarks/moe_ep.py", *(argv if argv is not None else sys.argv[1:])]))
    print(text)
    if not opts.no_append:
        append_doc(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
