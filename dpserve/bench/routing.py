"""`dpserve bench routing`: how well each routing policy places a multi-tenant workload on many ranks (issue #17's
"simulation at scale"), with null engines, so that it runs on one machine.

For each policy of --policies (cache-aware, least-loaded, round-robin by default), one after the other, it starts
`dpserve serve --null-engine --data-parallel-size 64 --api-server-count 4 --routing <policy>` (mp backend; the
null engines have a prefix cache and a prefill cost per uncached prompt token), sends the same workload
(routing_workload.py: system prompts with Zipf popularity, multi-turn sessions with X-Session-Id, a no-reuse
share; the same seed for every policy) from --concurrency closed-loop clients for at most --duration-s, and
stops the deployment. Requests are streamed completions with token-id prompts. Measured per policy:

  imbalance          max / mean over ranks of the tokens each rank processed: prefill (prompt tokens its prefix
                     cache did not hold: vllm:prefix_cache_queries - hits) + decode (vllm:generation_tokens)
  hit rate           cached prompt tokens / prompt tokens, from the responses' usage
  oracle             the hit rate of a router that always finds a request's longest prefix, with no eviction
                     (routing_workload.oracle_cached_tokens, over the requests in the order they were sent)
  snapshot age       p50 / p99 of dpserve:routing_snapshot_age_seconds over the run (the API servers' histogram:
                     interpolated within its buckets, 10/25/50/100/200/500 ms ...)
  coordinator CPU    utime + stime of the coordinator process during the load, % of one core (/proc/<pid>/stat)
  publish bytes/s    what the coordinator published on its broadcast socket during the load (its /status.json on
                     --status-port: one copy, before ZMQ's fan-out to each subscriber), also by message type
  machine CPU        cores busy on the whole machine during the load (/proc/stat): the context of the figures
                     above when 64 engines share a few cores

Targets (the issue's): imbalance <= 1.1, hit rate >= 0.9 x oracle, snapshot age p99 <= 200 ms, coordinator
<= 10 % of one core. A table, then one last line:

  routing: <policy> imbalance=X hit/oracle=Y age_p99_ms=Z coordinator_cpu_pct=W publish_kB_s=V | <policy> ...

--output-json keeps every figure, per rank too. --warm-ranks sends one request pinned to each rank first, so that
every rank has measured its prefill and decode rates before the load (the cost function prices a rank that has
not at its defaults).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import time
import urllib.request

from dpserve.bench.chaos import Deployment, _get_json, coordinator_pid
from dpserve.bench.chaos import _log as log
from dpserve.bench.client import ClientConfig, send_request
from dpserve.bench.metrics import RequestResult, compute_metrics
from dpserve.bench.routing_workload import (
    TOKEN_ID_RANGE,
    Conversation,
    WorkloadConfig,
    build_workload,
    num_requests,
    oracle_cached_tokens,
)
from dpserve.bench.runner import Progress
from dpserve_shared.net import free_port

POLICIES = ("cache-aware", "least-loaded", "round-robin")
TARGETS = {"imbalance_max": 1.1, "hit_vs_oracle_min": 0.9, "snapshot_age_p99_ms_max": 200.0,
           "coordinator_cpu_pct_max": 10.0}  # fmt: skip
SESSION_HEADER = "X-Session-Id"
PINNED_HEADER = "X-data-parallel-rank"
STABLE_S = 3.0  # every rank and API server up this long before the load (64 starting processes load the CPU)
SETTLE_TIMEOUT_S = 15.0  # the engines' counters reach the API servers with the load snapshots (every 0.1-1 s)


# -- what the server says: /metrics, the coordinator's /status.json, /proc ------------------------------------------


@dataclasses.dataclass
class ServerCounters:
    """Cumulative counters read at one moment; a policy's figures are differences of two of these."""

    prefix_queries: dict[int, float]  # rank -> prompt tokens looked up (the engine's counter, via the snapshot)
    prefix_hits: dict[int, float]  # rank -> of those, found
    generation_tokens: dict[int, float]  # rank -> tokens generated (the API servers' counter)
    requests: dict[int, float]  # rank -> requests finished there
    snapshot_age_buckets: dict[float, float]  # upper bound (s) -> cumulative count
    routing_decisions: dict[str, float]  # reason -> requests


def read_counters(url: str) -> ServerCounters:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    counters = ServerCounters({}, {}, {}, {}, {}, {})
    per_rank = {"vllm:prefix_cache_queries_total": counters.prefix_queries,
                "vllm:prefix_cache_hits_total": counters.prefix_hits,
                "vllm:generation_tokens_total": counters.generation_tokens,
                "vllm:request_success_total": counters.requests}  # fmt: skip
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in per_rank and "engine" in sample.labels:
                into = per_rank[sample.name]
                rank = int(sample.labels["engine"])
                into[rank] = into.get(rank, 0.0) + sample.value
            elif sample.name == "dpserve:routing_snapshot_age_seconds_bucket":
                bound = float(sample.labels["le"])
                counters.snapshot_age_buckets[bound] = counters.snapshot_age_buckets.get(bound, 0.0) + sample.value
            elif sample.name == "dpserve:routing_decisions_total":
                reason = sample.labels["reason"]
                counters.routing_decisions[reason] = counters.routing_decisions.get(reason, 0.0) + sample.value
    return counters


def _minus(after: dict, before: dict) -> dict:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}


def histogram_quantile(cumulative: dict[float, float], q: float) -> float | None:
    """Prometheus' histogram_quantile: the q-quantile of a histogram given as upper bound -> cumulative count,
    linear within the bucket it falls in (the +Inf bucket: its lower bound). None for an empty histogram."""
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] <= 0:
        return None
    target = q * cumulative[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= target:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * ((target - below) / (count - below) if count > below else 1.0)
        lower, below = bound, count
    return lower


def imbalance(values: list[float]) -> float:
    """max / mean; 0 for no work at all."""
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 0.0


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    idle = fields[3] + fields[4]  # idle + iowait
    ticks = os.sysconf("SC_CLK_TCK")
    return (sum(fields) - idle) / ticks, sum(fields) / ticks


def coordinator_status(status_url: str) -> tuple[dict, int]:
    """What the coordinator published since it started ({} if its /status.json does not say), and how many times
    its ranks went DEAD (a run with deaths measured restarts, not routing)."""
    status = _get_json(status_url + "/status.json")[1]
    deaths = sum(sum(rank.get("deaths", {}).values()) for rank in status.get("ranks", []))
    return status.get("coordinator", {}).get("published", {}), deaths


# -- the deployment -------------------------------------------------------------------------------------------------


class RoutingDeployment(Deployment):
    """`dpserve serve --null-engine` with one policy and the coordinator's status page; ready when every rank
    has served and every API server has been registered for STABLE_S."""

    log_prefix = "routing"

    def __init__(self, args: argparse.Namespace, policy: str):
        self.status_port = free_port()
        serve_args = ["--null-engine", "--routing", policy, "--api-server-count", str(args.api_server_count),
                      "--null-step-time-ms", str(args.null_step_time_ms),
                      "--null-prefill-time-per-token-s", str(args.null_prefill_time_per_token_s),
                      "--block-size", str(args.block_size), "--max-model-len", str(args.max_model_len),
                      "--status-port", str(self.status_port), *args.serve_args]  # fmt: skip
        super().__init__(argparse.Namespace(
            data_parallel_rpc_port=args.data_parallel_rpc_port, base_url=None, log_dir=args.log_dir,
            data_parallel_size=args.data_parallel_size, backend=args.backend, serve_args=serve_args,
            startup_timeout_s=args.startup_timeout_s,
        ))  # fmt: skip
        self.api_server_count = args.api_server_count
        self.status_url = f"http://127.0.0.1:{self.status_port}"

    def start(self) -> None:
        super().start()
        deadline = time.monotonic() + self.args.startup_timeout_s
        stable_since = None
        while True:
            health = _get_json(self.url + "/health")[1]
            status = _get_json(self.status_url + "/status.json")[1]
            if health.get("status") == "ok" and status.get("api_servers", {}).get("count") == self.api_server_count:
                if stable_since is None:
                    stable_since = time.monotonic()
                if time.monotonic() - stable_since >= STABLE_S:
                    return
            else:
                stable_since = None
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"not every rank and API server came up; see {self.log_path}")
            time.sleep(0.5)


# -- the load -------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Sent:
    order: int  # when it was sent, among this run's requests
    conversation: int
    turn: int
    result: RequestResult


async def drive(cfg: ClientConfig, conversations: list[Conversation], concurrency: int, duration_s: float,
                progress: bool, label: str) -> tuple[list[Sent], float]:  # fmt: skip
    """`concurrency` clients, each taking the next conversation and sending its turns one after the other (a turn
    when the previous one has ended), until the conversations run out or `duration_s` has passed (no request is
    sent after it; those under way end)."""
    import aiohttp

    sent: list[Sent] = []
    pending = iter(enumerate(conversations))
    bar = Progress(label, num_requests(conversations), progress)
    start = time.perf_counter()
    end = start + duration_s

    async def client(session) -> None:
        for index, conversation in pending:
            headers = {SESSION_HEADER: conversation.conversation_id} if conversation.session else None
            for turn in range(conversation.num_turns):
                if time.perf_counter() >= end:
                    return
                entry = Sent(len(sent), index, turn, RequestResult())
                sent.append(entry)
                prompt = conversation.prompt(turn)
                entry.result = await send_request(session, cfg, prompt, len(prompt), headers)
                bar.update(entry.result)
                if not entry.result.success:
                    break  # the conversation cannot go on without its answer

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    duration = time.perf_counter() - start
    bar.close()
    return sent, duration


async def warm_ranks(cfg: ClientConfig, num_ranks: int, seed: int) -> list[RequestResult]:
    """One request pinned to each rank (X-data-parallel-rank), with a prompt of its own: every rank has measured
    its prefill and decode rates before the load (a rank that has not is priced at the cost function's defaults)."""
    import random

    import aiohttp

    rng = random.Random(seed ^ 0x5EED)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        return await asyncio.gather(*(
            send_request(session, cfg, [rng.randrange(*TOKEN_ID_RANGE) for _ in range(512)], 512,
                         {PINNED_HEADER: str(rank)})
            for rank in range(num_ranks)
        ))  # fmt: skip


# -- one policy -----------------------------------------------------------------------------------------------------


def _settled_counters(url: str, before: ServerCounters, num_prompt_tokens: int) -> tuple[ServerCounters, bool]:
    """The counters once the engines' prefix-cache counters account for every prompt token sent (they travel with
    the load snapshots), or as they are after SETTLE_TIMEOUT_S."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        after = read_counters(url)
        looked_up = sum(_minus(after.prefix_queries, before.prefix_queries).values())
        if looked_up >= num_prompt_tokens:
            return after, True
        if time.monotonic() > deadline:
            return after, False
        time.sleep(0.5)


def measure(args, deployment: RoutingDeployment, conversations: list[Conversation], policy: str) -> dict:
    """Run the load on a started deployment; every figure of one policy."""
    model = deployment.model()
    cfg = ClientConfig(base_url=deployment.url, endpoint="completions", model=model, output_len=args.max_tokens,
                       request_timeout_s=args.request_timeout_s)  # fmt: skip
    pid = coordinator_pid(deployment.rpc_port)
    if args.warm_ranks:
        failed = [r.error for r in asyncio.run(warm_ranks(cfg, args.data_parallel_size, args.seed)) if not r.success]
        if failed:
            raise RuntimeError(f"{len(failed)} warm-up requests failed: {failed[0]}")
        time.sleep(STABLE_S)  # their measured rates reach every API server with the next snapshots
    before = read_counters(deployment.url)
    published_before, deaths_before = coordinator_status(deployment.status_url)
    cpu_before = process_cpu_s(pid) if pid else None
    machine_before = machine_cpu_s()
    wall_before = time.monotonic()
    sent, duration_s = asyncio.run(drive(cfg, conversations, args.concurrency, args.duration_s, args.progress,
                                         policy))  # fmt: skip
    wall_s = time.monotonic() - wall_before
    cpu_after = process_cpu_s(pid) if pid else None
    machine_after = machine_cpu_s()
    published_after, deaths_after = coordinator_status(deployment.status_url)
    ok = [s for s in sent if s.result.success]
    prompt_tokens = sum(s.result.prompt_len for s in ok)
    after, settled = _settled_counters(deployment.url, before, prompt_tokens)

    ranks = list(range(args.data_parallel_size))
    queries, hits = _minus(after.prefix_queries, before.prefix_queries), _minus(after.prefix_hits, before.prefix_hits)
    decode = _minus(after.generation_tokens, before.generation_tokens)
    per_rank_requests = _minus(after.requests, before.requests)
    prefill = {r: queries.get(r, 0.0) - hits.get(r, 0.0) for r in ranks}
    tokens = [prefill[r] + decode.get(r, 0.0) for r in ranks]
    ordered = sorted(sent, key=lambda s: s.order)
    oracle = oracle_cached_tokens((conversations[s.conversation].prompt(s.turn) for s in ordered), args.block_size)
    oracle_prompt = sum(len(conversations[s.conversation].prompt(s.turn)) for s in ordered)
    cached = sum(s.result.cached_tokens for s in ok)
    hit_rate = cached / prompt_tokens if prompt_tokens else 0.0
    oracle_rate = sum(oracle) / oracle_prompt if oracle_prompt else 0.0
    ages = _minus(after.snapshot_age_buckets, before.snapshot_age_buckets)
    p50, p99 = histogram_quantile(ages, 0.5), histogram_quantile(ages, 0.99)
    published = {k: published_after.get(k, 0) - published_before.get(k, 0) for k in ("messages", "bytes")}
    by_type = {name: {key: counts[key] - published_before.get("by_type", {}).get(name, {}).get(key, 0)
                      for key in ("messages", "bytes")}
               for name, counts in published_after.get("by_type", {}).items()}  # fmt: skip
    latency = compute_metrics([s.result for s in sent], duration_s)
    busy = (machine_after[0] - machine_before[0]) / (machine_after[1] - machine_before[1] or 1.0)
    return {
        "policy": policy,
        "requests_sent": len(sent),
        "completed": latency["completed"],
        "failed": latency["failed"],
        "errors": latency["errors"],
        "duration_s": duration_s,
        "request_throughput": latency["request_throughput"],
        "mean_ttft_ms": latency["mean_ttft_ms"],
        "p50_ttft_ms": latency["p50_ttft_ms"],
        "p99_ttft_ms": latency["p99_ttft_ms"],
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "hit_rate": hit_rate,
        "oracle_hit_rate": oracle_rate,
        "hit_vs_oracle": hit_rate / oracle_rate if oracle_rate else 0.0,
        "imbalance": imbalance(tokens),
        "imbalance_requests": imbalance([per_rank_requests.get(r, 0.0) for r in ranks]),
        "per_rank": [{"rank": r, "prefill_tokens": prefill[r], "decode_tokens": decode.get(r, 0.0),
                      "prefix_queries": queries.get(r, 0.0), "prefix_hits": hits.get(r, 0.0),
                      "requests": per_rank_requests.get(r, 0.0)} for r in ranks],  # fmt: skip
        "counters_settled": settled,
        "rank_deaths": deaths_after - deaths_before,
        "snapshot_age_p50_ms": None if p50 is None else p50 * 1000.0,
        "snapshot_age_p99_ms": None if p99 is None else p99 * 1000.0,
        "snapshot_age_samples": ages.get(float("inf"), 0.0),
        "routing_decisions": _minus(after.routing_decisions, before.routing_decisions),
        "coordinator_pid": pid,
        "coordinator_cpu_pct": None if pid is None else 100.0 * (cpu_after - cpu_before) / wall_s,
        "publish_bytes_per_s": published["bytes"] / wall_s,
        "publish_messages_per_s": published["messages"] / wall_s,
        "publish_by_type": {name: {"bytes_per_s": c["bytes"] / wall_s, "messages_per_s": c["messages"] / wall_s}
                            for name, c in sorted(by_type.items())},  # fmt: skip
        "machine_cores_busy": busy * (os.cpu_count() or 1),
        "load_wall_s": wall_s,
        "serve_log": deployment.log_path,
    }


def targets_met(result: dict) -> dict[str, bool]:
    age = result["snapshot_age_p99_ms"]
    cpu = result["coordinator_cpu_pct"]
    return {
        "imbalance": result["imbalance"] <= TARGETS["imbalance_max"],
        "hit_vs_oracle": result["hit_vs_oracle"] >= TARGETS["hit_vs_oracle_min"],
        "snapshot_age_p99": age is not None and age <= TARGETS["snapshot_age_p99_ms_max"],
        "coordinator_cpu": cpu is not None and cpu <= TARGETS["coordinator_cpu_pct_max"],
    }


# -- the report -----------------------------------------------------------------------------------------------------


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(results: list[dict]) -> str:
    head = (f"{'policy':<13} {'sent':>5} {'fail':>4} {'req/s':>6} {'imbal':>6} {'imb req':>7} {'hit':>5} "
            f"{'oracle':>6} {'hit/or':>6} {'age p50':>7} {'age p99':>7} {'coord %':>7} {'pub kB/s':>8} "
            f"{'TTFT p50':>8} {'TTFT p99':>8} {'cores':>5}")  # fmt: skip
    lines = [head]
    for r in results:
        lines.append(
            f"{r['policy']:<13} {r['requests_sent']:>5} {r['failed']:>4} {r['request_throughput']:>6.1f} "
            f"{r['imbalance']:>6.2f} {r['imbalance_requests']:>7.2f} {r['hit_rate']:>5.3f} "
            f"{r['oracle_hit_rate']:>6.3f} {r['hit_vs_oracle']:>6.3f} {_num(r['snapshot_age_p50_ms'], '7.1f')} "
            f"{_num(r['snapshot_age_p99_ms'], '7.1f')} {_num(r['coordinator_cpu_pct'], '7.1f')} "
            f"{r['publish_bytes_per_s'] / 1000:>8.1f} {r['p50_ttft_ms']:>8.1f} {r['p99_ttft_ms']:>8.1f} "
            f"{r['machine_cores_busy']:>5.2f}"
        )
        if r["rank_deaths"]:
            lines.append(f"  {r['policy']}: {r['rank_deaths']} rank deaths during the load (see the log): its "
                         "figures include restarts")  # fmt: skip
    lines.append(f"targets: imbalance <= {TARGETS['imbalance_max']}, hit/oracle >= {TARGETS['hit_vs_oracle_min']}, "
                 f"snapshot age p99 <= {TARGETS['snapshot_age_p99_ms_max']:.0f} ms, coordinator <= "
                 f"{TARGETS['coordinator_cpu_pct_max']:.0f} % of one core (imbal: prefill+decode tokens, max/mean "
                 f"over ranks; imb req: requests; cores: the machine's busy cores during the load)")  # fmt: skip
    return "\n".join(lines)


def summary_line(results: list[dict]) -> str:
    parts = [f"{r['policy']} imbalance={r['imbalance']:.2f} hit/oracle={r['hit_vs_oracle']:.2f} "
             f"age_p99_ms={_num(r['snapshot_age_p99_ms'], '.0f')} "
             f"coordinator_cpu_pct={_num(r['coordinator_cpu_pct'], '.1f')} "
             f"publish_kB_s={r['publish_bytes_per_s'] / 1000:.1f}" for r in results]  # fmt: skip
    return "routing: " + " | ".join(parts)


# -- the command ----------------------------------------------------------------------------------------------------


def _log(message: str) -> None:
    log(message, "routing")


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    bounds = (int(lo), int(hi or lo))
    if not 0 < bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 0 < LO <= HI, got {text!r}")
    return bounds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser("dpserve bench routing", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    deployment = parser.add_argument_group("the deployment (started once per policy)")
    deployment.add_argument("--policies", default=",".join(POLICIES), help="--routing policies, in this order")
    deployment.add_argument("--data-parallel-size", "-dp", type=int, default=64)
    deployment.add_argument("--api-server-count", type=int, default=4)
    deployment.add_argument("--backend", choices=["mp", "ray"], default="mp")
    deployment.add_argument("--data-parallel-rpc-port", type=int, default=None, help="the coordinator's control "
                            "port (default: a free one per policy)")
    deployment.add_argument("--null-step-time-ms", type=float, default=50.0, help="the null engines' step time")
    deployment.add_argument("--null-prefill-time-per-token-s", type=float, default=0.0001,
                            help="the null engines' cost of one uncached prompt token")
    deployment.add_argument("--block-size", type=int, default=16, help="tokens per KV block (the oracle's too)")
    deployment.add_argument("--max-model-len", type=int, default=4096)
    deployment.add_argument("--serve-args", default="", help="more flags for `dpserve serve`, one string")
    deployment.add_argument("--startup-timeout-s", type=float, default=600.0)
    deployment.add_argument("--log-dir", default="/tmp", help="each deployment's log goes here")
    load = parser.add_argument_group("the load (the same for every policy)")
    load.add_argument("--concurrency", type=int, default=96, help="closed-loop clients")
    load.add_argument("--duration-s", type=float, default=45.0, help="no request is sent after this, per policy")
    load.add_argument("--num-conversations", type=int, default=6000, help="at most this many conversations")
    load.add_argument("--num-system-prompts", type=int, default=300)
    load.add_argument("--zipf-s", type=float, default=1.1, help="system prompt of popularity rank r: weight 1/r**s")
    load.add_argument("--system-prompt-tokens", type=_range, default=(256, 1024), help="LO,HI")
    load.add_argument("--max-turns", type=int, default=6, help="a session has 1..this many turns")
    load.add_argument("--user-tokens", type=_range, default=(16, 128), help="each turn's new text: LO,HI")
    load.add_argument("--no-reuse-share", type=float, default=0.2, help="share of conversations that are one "
                      "request with a prompt of its own")
    load.add_argument("--no-reuse-tokens", type=_range, default=(256, 1024), help="LO,HI")
    load.add_argument("--max-tokens", type=int, default=16, help="each answer's tokens (ignore_eos)")
    load.add_argument("--request-timeout-s", type=float, default=300.0)
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--warm-ranks", action="store_true", help="before the load, one request pinned to each rank "
                      "(its own prompt), so that every rank has measured its rates (not counted in the figures)")
    load.add_argument("--no-progress", dest="progress", action="store_false")
    parser.add_argument("--output-json", default=None, help="every figure, per policy and per rank")
    return parser


def _workload_config(args) -> WorkloadConfig:
    return WorkloadConfig(
        num_conversations=args.num_conversations, num_system_prompts=args.num_system_prompts, zipf_s=args.zipf_s,
        system_prompt_tokens=args.system_prompt_tokens, max_turns=args.max_turns, user_tokens=args.user_tokens,
        no_reuse_share=args.no_reuse_share, no_reuse_tokens=args.no_reuse_tokens, max_tokens=args.max_tokens,
        seed=args.seed,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.serve_args = args.serve_args.split()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise SystemExit(f"--policies: expected some of {', '.join(POLICIES)}, got {args.policies!r}")
    config = _workload_config(args)
    conversations = build_workload(config)
    longest = max(len(c.prompt(c.num_turns - 1)) for c in conversations) + args.max_tokens
    if longest > args.max_model_len:
        raise SystemExit(f"the longest prompt + answer is {longest} tokens, over --max-model-len {args.max_model_len}: "
                         "raise it or shorten the workload (--max-turns, --system-prompt-tokens, --user-tokens)")
    _log(f"workload: {len(conversations)} conversations, {num_requests(conversations)} requests at most, "
         f"{args.concurrency} clients for at most {args.duration_s:.0f} s per policy")  # fmt: skip
    results = []
    for policy in policies:
        deployment = RoutingDeployment(args, policy)
        try:
            deployment.start()
            _log(f"{policy}: {args.data_parallel_size} ranks, {args.api_server_count} API servers at {deployment.url}")
            results.append(measure(args, deployment, conversations, policy))
        finally:
            deployment.stop()
        _log(f"{policy}: stopped")
    print(format_table(results), flush=True)
    if args.output_json:
        from dpserve.bench.report import machine

        with open(args.output_json, "w") as f:
            json.dump({"tool": "dpserve bench routing", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "args": vars(args), "workload": dataclasses.asdict(config), "machine": machine(),
                       "targets": TARGETS, "policies": [{**r, "targets_met": targets_met(r)} for r in results]},
                      f, indent=1)  # fmt: skip
    print(summary_line(results), flush=True)
    return 0 if all(r["failed"] == 0 for r in results) else 1
