"""Prometheus metrics with vLLM's names, labelled per engine rank, correct across many API-server processes.

Two sources, so nothing is counted twice when M frontends serve one port:

- Per-request series (token counters, finished requests, TTFT / TPOT / ITL / e2e / queue-time histograms,
  frontend counters) are recorded by the frontend that served the request. With several processes the launcher
  sets `PROMETHEUS_MULTIPROC_DIR` and prometheus_client's multiprocess mode sums them over processes, so
  after N requests the token counters moved by exactly what the N responses' `usage` said.
- Engine-side state (running / waiting requests, KV-cache use, prefix-cache counters, preemptions, the wave)
  comes from the coordinator's `LoadSnapshot`, which every frontend receives identically. Each scrape exports
  the latest snapshot this process holds (a custom collector), so it is never summed over processes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from dpserve_shared.schema import EngineState, LoadSnapshot, Topology

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0]
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0]


def is_multiprocess() -> bool:
    return bool(os.environ.get(MULTIPROC_ENV))


class _SnapshotCollector:
    """Engine-side gauges and counters from the latest LoadSnapshot (see the module docstring)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.snapshot: LoadSnapshot | None = None
        self.topology: Topology | None = None
        self.prefix_index = None  # this API server's mirror of the coordinator's prefix-cache index

    def collect(self):
        labels = ["model_name", "engine"]
        running = GaugeMetricFamily("vllm:num_requests_running", "Requests in model execution batches.",
                                    labels=labels)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting to be processed.", labels=labels)
        kv = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = 100%.", labels=labels)
        queries = CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      labels=labels)
        hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   labels=labels)
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Cumulative preemptions.", labels=labels)
        busy = CounterMetricFamily("dpserve:engine_busy_seconds", "Seconds the rank spent in steps (prefill and "
                                   "decode) since its engine started.", labels=labels)
        steps = CounterMetricFamily("dpserve:engine_steps", "Steps the rank ran the model on requests of its own "
                                    "(dummy steps not included).", labels=labels)
        kv_blocks = GaugeMetricFamily("dpserve:engine_kv_blocks", "KV-cache blocks the rank holds (used or not).",
                                      labels=labels)
        compiled = GaugeMetricFamily("dpserve:engine_decode_compiled", "1 once the rank's decode steps run its "
                                     "compiled graph (prepared in the background after start-up).", labels=labels)
        rank_wave = GaugeMetricFamily("dpserve:engine_wave", "The rank's current wave (lock-step: it moves only when "
                                      "every rank pauses together).", labels=labels)
        dummy_steps = CounterMetricFamily("dpserve:engine_dummy_steps", "Steps the rank ran without requests of its "
                                          "own so that the collectives of the busy ranks match (expert parallel "
                                          "only; stops while the ranks are paused).", labels=labels)
        collective_s = CounterMetricFamily("dpserve:engine_collective_seconds", "Seconds the rank spent in the "
                                           "expert-parallel group's collectives (waiting for the other ranks "
                                           "included).", labels=labels)
        wave = GaugeMetricFamily("dpserve:coordinator_wave", "The coordinator's current wave.")
        is_running = GaugeMetricFamily("dpserve:engines_running", "1 while the engines are in a wave.")
        # One series per rank and state, 1 for the rank's current state: a rank that is gone (DEAD, STARTING
        # again as its replacement) shows here while it is missing from the routing.
        states = GaugeMetricFamily("dpserve:engine_state", "1 for each rank's current state in the coordinator's "
                                   "topology (starting, ready, draining, dead).", labels=[*labels, "state"])
        target = GaugeMetricFamily("dpserve:data_parallel_size", "The deployment's target number of ranks.")
        healthy = GaugeMetricFamily("dpserve:engine_healthy", "1 while the rank is READY in the topology, else 0.",
                                    labels=labels)
        failed = GaugeMetricFamily("dpserve:engine_failed", "1 while the rank is in a crash loop (it died soon "
                                   "after each of its last starts; still retried on a back-off).", labels=labels)
        restarts = CounterMetricFamily("dpserve:engine_restarts", "Replacements the coordinator started for the "
                                       "rank.", labels=labels)
        deaths = CounterMetricFamily("dpserve:engine_deaths", "Times the rank went DEAD, by kind (killed, exited, "
                                     "actor_died, missed_heartbeats, stuck, unregistered).",
                                     labels=[*labels, "reason"])  # fmt: skip
        index_blocks = GaugeMetricFamily("dpserve:prefix_index_blocks", "KV blocks this API server's copy of the "
                                         "prefix-cache index says the rank holds (cache-aware routing).",
                                         labels=labels)  # fmt: skip
        index_resyncs = CounterMetricFamily("dpserve:prefix_index_resyncs", "Whole prefix-cache indexes this API "
                                            "server took from the coordinator (at start, after a gap in its "
                                            "deltas, after a coordinator restart).")  # fmt: skip
        index = self.prefix_index
        if index is not None:
            for rank in index.blocks.ranks():
                index_blocks.add_metric([self.model_name, str(rank)], index.blocks.num_blocks(rank))
            index_resyncs.add_metric([], index.num_resyncs)
        topology = self.topology
        if topology is not None:
            for engine in topology.engines:
                values = [self.model_name, str(engine.rank)]
                for state in EngineState:
                    states.add_metric([*values, state.value], 1.0 if engine.state == state else 0.0)
                healthy.add_metric(values, 1.0 if engine.state == EngineState.READY else 0.0)
                failed.add_metric(values, 1.0 if engine.failed else 0.0)
                restarts.add_metric(values, engine.restarts)
                for kind, count in engine.deaths.items():
                    deaths.add_metric([*values, kind], count)
            target.add_metric([], topology.data_parallel_size)
        snapshot = self.snapshot
        if snapshot is not None:
            for load in snapshot.loads:
                values = [self.model_name, str(load.rank)]
                running.add_metric(values, load.num_running)
                waiting.add_metric(values, load.num_waiting)
                kv.add_metric(values, load.kv_blocks_used / load.kv_blocks_total if load.kv_blocks_total else 0.0)
                queries.add_metric(values, load.prefix_queries)
                hits.add_metric(values, load.prefix_hits)
                preemptions.add_metric(values, load.num_preemptions)
                compiled.add_metric(values, 1.0 if load.decode_compiled else 0.0)
                busy.add_metric(values, load.busy_s)
                steps.add_metric(values, load.step)
                kv_blocks.add_metric(values, load.kv_blocks_total)
                rank_wave.add_metric(values, load.wave)
                dummy_steps.add_metric(values, load.num_dummy_steps)
                collective_s.add_metric(values, load.collective_time_s)
            wave.add_metric([], snapshot.wave)
            is_running.add_metric([], 1.0 if snapshot.engines_running else 0.0)
        return [running, waiting, kv, queries, hits, preemptions, busy, steps, kv_blocks, index_blocks, index_resyncs,
                compiled,
                rank_wave, dummy_steps, collective_s, wave, is_running, states, target, healthy, failed, restarts,
                deaths]


def observe_many(histogram, values: list[float]) -> None:
    """`histogram.observe(v)` for every v, with one increment per touched bucket and one of the sum.

    In multiprocess mode every increment takes a lock and writes the mmap file, so a request's inter-token
    gaps (one per engine step) are observed together. Buckets are stored non-cumulatively (prometheus_client
    sums them at export), and a value goes to the first bucket whose upper bound is >= it, as `observe` does.
    """
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None:  # another prometheus_client layout
        for value in values:
            histogram.observe(value)
        return
    counts: dict[int, int] = {}
    for value in values:
        i = bisect_left(bounds, value)
        counts[i] = counts.get(i, 0) + 1
    total.inc(sum(values))
    for i, count in counts.items():
        buckets[i].inc(count)


_SNAPSHOT_AGE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


@dataclasses.dataclass(slots=True)
class Totals:
    """Cumulative sums over every finished sequence of this process (FrontendStats' counters)."""

    requests_finished: int = 0
    ttft_sum_s: float = 0.0
    ttft_count: int = 0
    tpot_sum_s: float = 0.0
    tpot_count: int = 0


@dataclasses.dataclass(slots=True)
class _RankSeries:
    """One rank's labelled children, looked up once (`labels()` takes a lock and builds a key every call)."""

    prompt_tokens: object
    generation_tokens: object
    ttft: object
    tpot: object
    itl: object
    e2e: object
    queue_time: object
    success: dict  # finished_reason -> child


class FrontendMetrics:
    """Every series this frontend records; `render()` gives the Prometheus text for /metrics."""

    def __init__(self, model_name: str = ""):
        self._multiprocess = is_multiprocess()
        # Multiprocess values live in the mmap files, not in a registry; one process-wide registry otherwise.
        self._registry = CollectorRegistry()
        own = None if self._multiprocess else self._registry
        self._snapshot = _SnapshotCollector(model_name)
        labels = ["model_name", "engine"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=own)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", labels, registry=own)
        self.request_success = Counter("vllm:request_success", "Finished requests.",
                                       [*labels, "finished_reason"], registry=own)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_TTFT_BUCKETS, registry=own)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Mean time per output token of a request.",
                              labels, buckets=_TPOT_BUCKETS, registry=own)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             labels, buckets=_TPOT_BUCKETS, registry=own)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", labels,
                             buckets=_LATENCY_BUCKETS, registry=own)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time a request waited in the engine.",
                                    labels, buckets=_LATENCY_BUCKETS, registry=own)
        self.http_requests = Counter("dpserve:frontend_http_requests", "HTTP requests by endpoint and status.",
                                     ["endpoint", "status"], registry=own)
        self.aborted = Counter("dpserve:frontend_aborted_requests", "Sequences aborted by the frontend "
                               "(client gone, stop string, shutdown).", registry=own)
        self.migrations = Counter("dpserve:request_migrations", "Sequences moved to another rank after theirs went "
                                  "away (re-sent before their first token, or continued after it).", registry=own)
        self.requests_failed = Counter("dpserve:requests_failed", "Requests that failed after they were accepted: "
                                       "reason no_rank (none serving: 503), engine (an engine error, or a rank gone "
                                       "with no move left), shutdown (still running when --shutdown-timeout ran "
                                       "out).", ["reason"], registry=own)
        self.admission_rejections = Counter("dpserve:admission_rejections", "Requests answered 503 with Retry-After: "
                                            "reason queued_requests / queued_tokens (every rank they could go to "
                                            "was past --max-num-queued-requests / --max-num-queued-tokens), "
                                            "queue_time (waited longer than --max-queue-time-s in an engine's "
                                            "queue), shutting_down (arrived during a drain).", ["reason"],
                                            registry=own)  # fmt: skip
        self.engine_errors = Counter("dpserve:frontend_engine_errors", "Sequences that ended with an engine error.",
                                     ["engine"], registry=own)
        self.routing_decisions = Counter("dpserve:routing_decisions", "Requests routed, by why their rank was "
                                         "chosen: pinned, session, prefix (it holds part of the prompt), load.",
                                         ["reason"], registry=own)  # fmt: skip
        self.snapshot_age = Histogram("dpserve:routing_snapshot_age_seconds", "Age of the coordinator's load "
                                      "snapshot when a request was routed.", buckets=_SNAPSHOT_AGE_BUCKETS,
                                      registry=own)  # fmt: skip
        self._routing_by_reason: dict[str, object] = {}
        self.model_name = model_name
        self.totals = Totals()  # this process's own sums, for the status page (FrontendStats)
        self._by_rank: dict[int, _RankSeries] = {}
        self._http: dict[tuple[str, str], object] = {}

    def set_model_name(self, name: str) -> None:
        self.model_name = name
        self._snapshot.model_name = name
        self._by_rank.clear()

    def _rank(self, rank: int) -> _RankSeries:
        series = self._by_rank.get(rank)
        if series is None:
            labels = (self.model_name, str(rank))
            series = _RankSeries(
                self.prompt_tokens.labels(*labels), self.generation_tokens.labels(*labels),
                self.ttft.labels(*labels), self.tpot.labels(*labels), self.itl.labels(*labels),
                self.e2e.labels(*labels), self.queue_time.labels(*labels), {},
            )
            self._by_rank[rank] = series
        return series

    def count_routing(self, reason: str, snapshot_age_s: float | None) -> None:
        child = self._routing_by_reason.get(reason)
        if child is None:
            child = self._routing_by_reason[reason] = self.routing_decisions.labels(reason)
        child.inc()
        if snapshot_age_s is not None:
            self.snapshot_age.observe(max(0.0, snapshot_age_s))

    def count_http(self, endpoint: str, status: int) -> None:
        key = (endpoint, str(status))
        child = self._http.get(key)
        if child is None:
            child = self._http[key] = self.http_requests.labels(*key)
        child.inc()

    def update_snapshot(self, snapshot: LoadSnapshot) -> None:
        self._snapshot.snapshot = snapshot

    def follow_prefix_index(self, index) -> None:
        """Report the size of `index` (a prefix_index.PrefixIndex) per rank and its resyncs."""
        self._snapshot.prefix_index = index

    def update_topology(self, topology: Topology) -> None:
        self._snapshot.topology = topology

    def observe_finished(
        self,
        rank: int,
        finished_reason: str,
        num_generation_tokens: int,
        arrival_s: float,
        first_token_s: float | None,
        last_token_s: float | None,
        queue_time_s: float | None = None,
    ) -> None:
        """One finished sequence (tokens counted here; prompt tokens once per prompt, see `count_prompt`)."""
        series = self._rank(rank)
        series.generation_tokens.inc(num_generation_tokens)
        success = series.success.get(finished_reason)
        if success is None:
            success = series.success[finished_reason] = self.request_success.labels(
                self.model_name, str(rank), finished_reason
            )
        success.inc()
        end_s = last_token_s or time.perf_counter()
        series.e2e.observe(max(0.0, end_s - arrival_s))
        totals = self.totals
        totals.requests_finished += 1
        if first_token_s is not None:
            ttft_s = max(0.0, first_token_s - arrival_s)
            series.ttft.observe(ttft_s)
            totals.ttft_sum_s += ttft_s
            totals.ttft_count += 1
            if num_generation_tokens > 1 and last_token_s is not None:
                tpot_s = (last_token_s - first_token_s) / (num_generation_tokens - 1)
                series.tpot.observe(tpot_s)
                totals.tpot_sum_s += tpot_s
                totals.tpot_count += 1
        if queue_time_s is not None:
            series.queue_time.observe(queue_time_s)

    def count_prompt(self, rank: int, num_prompt_tokens: int) -> None:
        self._rank(rank).prompt_tokens.inc(num_prompt_tokens)

    def observe_itls(self, rank: int, seconds: list[float]) -> None:
        """Several inter-token gaps of one request at once (see `observe_many`)."""
        observe_many(self._rank(rank).itl, seconds)

    def render(self) -> bytes:
        registry = self._registry
        if self._multiprocess:
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
        registry.register(self._snapshot)
        try:
            return generate_latest(registry)
        finally:
            registry.unregister(self._snapshot)
