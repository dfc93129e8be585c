"""Cache-aware vs least-loaded routing with the real model (issue #17's benchmark), policies interleaved in one run.

Each round starts `dpserve serve` (the bundled SmolLM2, DP=2, 2 API servers, ray unless --backend) once per policy,
in alternating order, and runs two workloads on it, closed-loop with --concurrency clients, greedy, streamed:

  (a) shared prefix: --groups groups x --group-size requests that share a --system-tokens system prompt (each
      with its own --user-tokens question), plus --conversations conversations x --turns turns (each turn resends
      the conversation so far: its prompt, an answer of --max-tokens words and a new question; X-Session-Id);
      the requests are shuffled (a conversation's turns stay in order, one client at a time);
  (b) no reuse: as many distinct prompts, of mixed lengths (--min-tokens..--max-prompt-tokens).

Prompts are token ids (the completions API), so the engines see exactly the tokens the workload built, the same
for both policies. Reported per policy and workload: throughput (requests/s, prompt and output tokens/s), TTFT
mean / p99, prefix hit rate (the engines' vllm:prefix_cache_hits / queries over the workload) and per-rank busy
time max / min (dpserve:engine_busy_seconds). The ratios cache-aware / least-loaded are the medians over rounds.

--num-kv-blocks sets each rank's KV cache: the default (640 blocks of 16 tokens, ~10k tokens) holds about half
of (a)'s prefixes, the regime where routing decides the hit rate; with a cache that holds everything on every
rank both policies hit alike once warm (pass 0 for the engines' default, 1 GiB).

    .venv/bin/python benchmarks/cache_routing.py [--rounds 2] [--output-json out.json] [--append-doc]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare import Server, append_doc, log, machine, machine_record  # noqa: E402

from dpserve.bench.client import ClientConfig, send_request  # noqa: E402
from dpserve.bench.metrics import engine_metrics, percentile  # noqa: E402
from dpserve.bench.prompts import load_tokenizer, word_token_pool  # noqa: E402

POLICIES = ("cache-aware", "least-loaded")


# -- the workloads ---------------------------------------------------------------------------------------------------


def shared_prefix_workload(opts, pool: list[int]) -> list[list[tuple[list[int], str | None]]]:
    """Tasks for the clients: each a list of (prompt ids, session id) sent in order by one client."""
    rng = random.Random(opts.seed)
    words = lambda n: [rng.choice(pool) for _ in range(n)]  # noqa: E731
    tasks = []
    for _ in range(opts.groups):
        system = words(opts.system_tokens)
        tasks += [[(system + words(opts.user_tokens), None)] for _ in range(opts.group_size)]
    for c in range(opts.conversations):
        session, prompt, turns = f"conversation-{opts.seed}-{c}", words(opts.system_tokens), []
        for _ in range(opts.turns):
            prompt = prompt + words(opts.user_tokens)
            turns.append((prompt, session))
            prompt = prompt + words(opts.max_tokens)  # the answer, as the client resends it
        tasks.append(turns)
    rng.shuffle(tasks)
    return tasks


def no_reuse_workload(opts, pool: list[int], num: int) -> list[list[tuple[list[int], str | None]]]:
    rng = random.Random(opts.seed + 1)
    return [[([rng.choice(pool) for _ in range(rng.randint(opts.min_tokens, opts.max_prompt_tokens))], None)]
            for _ in range(num)]  # fmt: skip


# -- one run ---------------------------------------------------------------------------------------------------------


_WANTED = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "dpserve:engine_busy_seconds_total")


def scrape(url: str) -> dict[str, dict[int, float]]:
    """Per-engine samples of the series the report needs: name -> rank -> value."""
    found = engine_metrics(url)
    return {name: found.get(name, {}) for name in _WANTED}


def settled_scrape(url: str, previous: dict | None = None) -> dict:
    """The engines' counters reach the API servers with their load (every second at most): scrape until two
    scrapes a second apart agree."""
    last = scrape(url)
    for _ in range(10):
        time.sleep(1.2)
        now = scrape(url)
        if now == last:
            return now
        last = now
    return last


async def run_workload(url: str, model: str, tasks, concurrency: int, max_tokens: int) -> dict:
    import aiohttp

    cfg = ClientConfig(base_url=url, endpoint="completions", model=model, output_len=max_tokens)
    queue = list(reversed(tasks))
    results = []

    async def client(session) -> None:
        while queue:
            for prompt, session_id in queue.pop():
                headers = {"X-Session-Id": session_id} if session_id else None
                results.append(await send_request(session, cfg, prompt, len(prompt), headers=headers))

    started = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    duration = time.perf_counter() - started
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    return {
        "requests": len(results), "failed": len(results) - len(ok), "duration_s": duration,
        "requests_per_s": len(ok) / duration,
        "prompt_tokens_per_s": sum(r.prompt_len for r in ok) / duration,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / duration,
        "ttft_mean_ms": 1000 * statistics.fmean(ttfts) if ttfts else 0.0,
        "ttft_p99_ms": 1000 * percentile(ttfts, 99),
        "cached_tokens": sum(r.cached_tokens for r in ok), "prompt_tokens": sum(r.prompt_len for r in ok),
    }  # fmt: skip


def measure(server: Server, model: str, name: str, tasks, opts) -> dict:
    before = settled_scrape(server.url)
    result = asyncio.run(run_workload(server.url, model, tasks, opts.concurrency, opts.max_tokens))
    after = settled_scrape(server.url)
    delta = {key: {rank: after[key].get(rank, 0.0) - before[key].get(rank, 0.0) for rank in after[key]}
             for key in after}  # fmt: skip
    queries = sum(delta["vllm:prefix_cache_queries_total"].values())
    busy = delta["dpserve:engine_busy_seconds_total"]
    result.update(
        hit_rate=sum(delta["vllm:prefix_cache_hits_total"].values()) / queries if queries else 0.0,
        busy_s={rank: round(v, 2) for rank, v in sorted(busy.items())},
        busy_max_over_min=max(busy.values()) / min(busy.values()) if busy and min(busy.values()) > 0 else 0.0,
    )  # fmt: skip
    log(f"{name}: {result['requests_per_s']:.2f} req/s, {result['output_tokens_per_s']:.0f} out tok/s, TTFT "
        f"{result['ttft_mean_ms']:.0f} / p99 {result['ttft_p99_ms']:.0f} ms, hit rate {result['hit_rate']:.2f}, "
        f"busy {result['busy_s']}, failed {result['failed']}")  # fmt: skip
    return result


def model_id(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
        return json.loads(response.read())["data"][0]["id"]


# -- report ----------------------------------------------------------------------------------------------------------


def ratios(runs: list[dict]) -> dict:
    """Per workload: the medians over rounds of cache-aware / least-loaded."""
    out = {}
    for workload in ("shared_prefix", "no_reuse"):
        pairs = [(r["cache-aware"][workload], r["least-loaded"][workload]) for r in runs]
        med = lambda f: statistics.median(f(a, b) for a, b in pairs)  # noqa: E731
        out[workload] = {
            "throughput": med(lambda a, b: a["requests_per_s"] / b["requests_per_s"]),
            "hit_rate": med(lambda a, b: a["hit_rate"] / b["hit_rate"] if b["hit_rate"] else float("inf")),
            "ttft_mean": med(lambda a, b: a["ttft_mean_ms"] / b["ttft_mean_ms"]),
        }
    return out


def markdown(results: dict, command: str) -> str:
    lines = [f"### {results['date']}: cache-aware vs least-loaded routing, real model (benchmarks/cache_routing.py)",
             "", f"- machine: {machine(results['machine'])}", f"- command: `{command}`", "",
             "| round | policy | workload | req/s | prompt tok/s | out tok/s | TTFT mean / p99 ms | hit rate | "
             "busy s per rank (max/min) | failed |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for i, run in enumerate(results["runs"], 1):
        for policy in POLICIES:
            for workload in ("shared_prefix", "no_reuse"):
                r = run[policy][workload]
                lines.append(
                    f"| {i} | {policy} | {workload} | {r['requests_per_s']:.2f} | {r['prompt_tokens_per_s']:.0f} | "
                    f"{r['output_tokens_per_s']:.0f} | {r['ttft_mean_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
                    f"{r['hit_rate']:.2f} | {r['busy_s']} ({r['busy_max_over_min']:.2f}) | {r['failed']} |"
                )  # fmt: skip
    lines += ["", "| cache-aware / least-loaded (median over rounds) | throughput | hit rate | TTFT mean | target |",
              "| --- | --- | --- | --- | --- |"]  # fmt: skip
    r = results["ratios"]
    lines.append(f"| (a) shared prefix | {r['shared_prefix']['throughput']:.2f} | {r['shared_prefix']['hit_rate']:.2f} "
                 f"| {r['shared_prefix']['ttft_mean']:.2f} | throughput >= 1.3, hit rate >= 2 |")  # fmt: skip
    lines.append(f"| (b) no reuse | {r['no_reuse']['throughput']:.2f} | - | {r['no_reuse']['ttft_mean']:.2f} | "
                 f"throughput >= 0.97 |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backend", default="ray", choices=["ray", "mp"])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--min-tokens", type=int, default=64, help="(b): the shortest prompt")
    parser.add_argument("--max-prompt-tokens", type=int, default=1024, help="(b): the longest prompt")
    parser.add_argument("--num-kv-blocks", type=int, default=640, help="per rank; 0: the engines' default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--append-doc", action="store_true", help="append the tables to docs/benchmarks.md")
    opts = parser.parse_args(argv)

    pool = word_token_pool(load_tokenizer(None))
    shared = shared_prefix_workload(opts, pool)
    no_reuse = no_reuse_workload(opts, pool, sum(len(t) for t in shared))
    log(f"workloads: (a) {sum(len(t) for t in shared)} requests in {len(shared)} client tasks, (b) {len(no_reuse)} "
        f"distinct prompts; {opts.rounds} round(s), policies interleaved")  # fmt: skip
    extra = ["--num-kv-blocks", str(opts.num_kv_blocks)] if opts.num_kv_blocks else []
    runs = []
    for round_index in range(opts.rounds):
        order = POLICIES if round_index % 2 == 0 else tuple(reversed(POLICIES))
        run = {}
        for policy in order:
            server = Server(policy, dp=2, threads_per_rank=None, api_servers=2, backend=opts.backend,
                            extra=["--routing", policy, *extra], log_dir=opts.log_dir)  # fmt: skip
            try:
                server.start()
                model = model_id(server.url)
                run[policy] = {"shared_prefix": measure(server, model, f"round {round_index + 1} {policy} (a)",
                                                        shared, opts),
                               "no_reuse": measure(server, model, f"round {round_index + 1} {policy} (b)",
                                                   no_reuse, opts)}  # fmt: skip
            finally:
                server.stop()
        runs.append(run)
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine_record(),
               "args": vars(opts), "runs": runs, "ratios": ratios(runs)}  # fmt: skip
    for workload, r in results["ratios"].items():
        log(f"{workload}: cache-aware / least-loaded throughput {r['throughput']:.2f}, hit rate {r['hit_rate']:.2f}, "
            f"TTFT mean {r['ttft_mean']:.2f}")  # fmt: skip
    if opts.output_json:
        with open(opts.output_json, "w") as f:
            json.dump(results, f, indent=1)
    if opts.append_doc:
        append_doc(markdown(results, "python benchmarks/cache_routing.py " + " ".join(argv or sys.argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
