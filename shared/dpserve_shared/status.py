"""The deployment's status as one JSON document: what `/status.json`, the `/status` page and `dpserve status` show.

The same builder runs in every API server (fed by the coordinator's broadcasts: Topology, LoadSnapshot with
every API server's FrontendStats) and in the coordinator (`--status-port`, fed by its registry), so every place
shows the same document. Engines and frontends report cumulative counters; `StatusTracker.sample` (once a
second) turns them into rates (tokens/s per rank, TTFT and TPOT means of the requests that finished in the
interval) and keeps a rolling history for the page's charts.

Document (version 1):

    {"version": 1, "time": <epoch s>, "source": "api-server <id>" | "coordinator",
     "coordinator": {"reachable": bool, "last_heard_s": <s since its last broadcast> | null,
                     "published": {"messages", "bytes", "by_type": {name: {"messages", "bytes"}}}},  # the
                                                                  # coordinator's own page only: since its start
     "model": <served name> | null, "data_parallel_size": <target>,
     "wave": {"number": int, "engines_running": bool},
     "scaling": {"in_progress": bool, "target": int, "ready": int, "starting": [rank], "draining": [rank]},
     "ranks": [{"rank", "state" (starting|ready|draining|dead|failed), "node", "address", "pid", "engine_id",
                "running", "waiting", "waiting_tokens", "kv_blocks_used", "kv_blocks_total", "kv_usage",
                "prefix_queries", "prefix_hits", "prefix_hit_rate", "generation_tokens_per_s",
                "prompt_tokens_per_s", "decode_compiled", "cpu_kind", "kernel_path", "kernel_path_reason",
                "restarts", "deaths": {kind: n}, "last_death_reason"}],
     "api_servers": {"count": int, "in_flight": int, "servers": [{"id", "pid", "address", "in_flight",
                     "requests_finished"}]},
     "throughput": {"t": <the sample's epoch s>, "generation_tokens_per_s", "prompt_tokens_per_s",
                    "requests_per_s", "ttft_s", "tpot_s"},
     "history": [<throughput>, ...]}   # oldest first; only when asked for (the page's first load)

Rates and TTFT/TPOT are those of the last sampled interval; ttft_s/tpot_s are null when no request finished in it.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

from dpserve_shared.schema import EngineLoad, EngineState, FrontendStats, Topology
from dpserve_shared.timing import LOAD_HEARTBEAT_S

API_KEY_ENV = "DPSERVE_API_KEY"  # the API key's variable: the API servers' and the coordinator's status page
STATUS_VERSION = 1
SAMPLE_INTERVAL_S = 1.0
HISTORY_S = 600.0  # the charts' span
COORDINATOR_SILENT_S = 2.5 * LOAD_HEARTBEAT_S  # no broadcast this long (one comes every second): "unreachable"


@dataclasses.dataclass
class StatusInputs:
    """What a status document is built from, read fresh each time."""

    topology: Topology | None
    loads: dict[int, EngineLoad]
    wave: int = 0
    engines_running: bool = False
    frontends: list[FrontendStats] = dataclasses.field(default_factory=list)
    coordinator_last_heard_s: float | None = 0.0  # seconds since its last broadcast (0 in the coordinator)
    coordinator_published: dict | None = None  # what it published (the coordinator's own page only)


@dataclasses.dataclass
class _RankSample:
    engine_id: str
    at_s: float
    generation_tokens: int
    prompt_tokens: int


@dataclasses.dataclass
class _Rates:
    generation_tokens_per_s: float = 0.0
    prompt_tokens_per_s: float = 0.0


def counter_delta(new: float, old: float) -> float:
    """A cumulative counter's increase, never negative: a restarted engine or frontend starts its counters again."""
    return max(0.0, new - old)


class StatusTracker:
    """Builds status documents from `read()`; `sample()` once a second keeps the rates and the history."""

    def __init__(self, source: str, read: Callable[[], StatusInputs], history_s: float = HISTORY_S):
        self.source = source
        self._read = read
        self._ranks: dict[int, _RankSample] = {}
        self._rank_rates: dict[int, _Rates] = {}
        self._frontends: dict[str, FrontendStats] = {}
        self._last_sample_s: float | None = None
        self._throughput: dict = _empty_throughput()
        self.history: collections.deque[dict] = collections.deque(maxlen=max(1, int(history_s / SAMPLE_INTERVAL_S)))

    # -- sampling ------------------------------------------------------------------------------------------------

    def sample(self, now_s: float | None = None, wall_s: float | None = None) -> None:
        """Take the counters' deltas since the previous sample: per-rank and total rates, one history point."""
        now_s = time.monotonic() if now_s is None else now_s
        inputs = self._read()
        dt = None if self._last_sample_s is None else max(now_s - self._last_sample_s, 1e-6)
        self._last_sample_s = now_s
        engine_ids = {e.rank: e.engine_id for e in (inputs.topology.engines if inputs.topology else [])}
        rates: dict[int, _Rates] = {}
        for rank, load in inputs.loads.items():
            engine_id = engine_ids.get(rank, "")
            before = self._ranks.get(rank)
            self._ranks[rank] = _RankSample(engine_id, now_s, load.generation_tokens, load.prompt_tokens)
            if before is None or before.engine_id != engine_id or dt is None:
                continue
            span = max(now_s - before.at_s, 1e-6)
            rates[rank] = _Rates(counter_delta(load.generation_tokens, before.generation_tokens) / span,
                                 counter_delta(load.prompt_tokens, before.prompt_tokens) / span)  # fmt: skip
        self._rank_rates = rates
        finished = ttft_sum = tpot_sum = 0.0
        ttft_count = tpot_count = 0
        for stats in inputs.frontends:
            before = self._frontends.get(stats.frontend_id)
            if before is not None and dt is not None:
                finished += counter_delta(stats.requests_finished, before.requests_finished)
                ttft_sum += counter_delta(stats.ttft_sum_s, before.ttft_sum_s)
                ttft_count += int(counter_delta(stats.ttft_count, before.ttft_count))
                tpot_sum += counter_delta(stats.tpot_sum_s, before.tpot_sum_s)
                tpot_count += int(counter_delta(stats.tpot_count, before.tpot_count))
        self._frontends = {s.frontend_id: s for s in inputs.frontends}
        if dt is None:
            return
        self._throughput = {
            "t": round(time.time() if wall_s is None else wall_s, 3),
            "generation_tokens_per_s": round(sum(r.generation_tokens_per_s for r in rates.values()), 2),
            "prompt_tokens_per_s": round(sum(r.prompt_tokens_per_s for r in rates.values()), 2),
            "requests_per_s": round(finished / dt, 3),
            "ttft_s": round(ttft_sum / ttft_count, 5) if ttft_count else None,
            "tpot_s": round(tpot_sum / tpot_count, 6) if tpot_count else None,
        }
        self.history.append(dict(self._throughput))

    # -- the document --------------------------------------------------------------------------------------------

    def status(self, with_history: bool = False) -> dict:
        inputs = self._read()
        topology = inputs.topology
        engines = topology.engines if topology is not None else []
        heard = inputs.coordinator_last_heard_s
        states = [e.state for e in engines]
        target = (topology.data_parallel_size if topology is not None else 0) or len(engines)
        ready = states.count(EngineState.READY)
        starting = [e.rank for e in engines if e.state == EngineState.STARTING]
        draining = [e.rank for e in engines if e.state == EngineState.DRAINING]
        servers = [
            {"id": s.frontend_id, "pid": s.pid, "address": s.http_addr, "in_flight": s.num_in_flight,
             "requests_finished": s.requests_finished}
            for s in sorted(inputs.frontends, key=lambda s: s.frontend_id)
        ]  # fmt: skip
        doc = {
            "version": STATUS_VERSION,
            "time": round(time.time(), 3),
            "source": self.source,
            "coordinator": {
                "reachable": heard is not None and heard <= COORDINATOR_SILENT_S,
                "last_heard_s": None if heard is None else round(heard, 2),
                **({"published": inputs.coordinator_published} if inputs.coordinator_published is not None else {}),
            },
            "model": topology.model.name if topology is not None and topology.model is not None else None,
            "data_parallel_size": target,
            "wave": {"number": inputs.wave, "engines_running": inputs.engines_running},
            "scaling": {
                "in_progress": bool(starting or draining) or ready != target,
                "target": target, "ready": ready, "starting": starting, "draining": draining,
            },
            "ranks": [self._rank(info, inputs.loads.get(info.rank)) for info in engines],
            "api_servers": {"count": len(servers), "in_flight": sum(s["in_flight"] for s in servers),
                            "servers": servers},
            "throughput": dict(self._throughput),
        }  # fmt: skip
        if with_history:
            doc["history"] = list(self.history)
        return doc

    def _rank(self, info, load: EngineLoad | None) -> dict:
        state = info.state.value
        if info.failed and info.state != EngineState.READY:
            state = "failed"
        live = info.state in (EngineState.READY, EngineState.DRAINING) and load is not None
        load = load if live else EngineLoad(rank=info.rank)
        rates = self._rank_rates.get(info.rank, _Rates()) if live else _Rates()
        kv_total = load.kv_blocks_total or info.kv_blocks_total
        return {
            "rank": info.rank,
            "state": state,
            "node": info.node_ip,
            "address": info.input_addr,
            "pid": info.pid,
            "engine_id": info.engine_id,
            "running": load.num_running,
            "waiting": load.num_waiting,
            "waiting_tokens": load.num_waiting_tokens,
            "kv_blocks_used": load.kv_blocks_used,
            "kv_blocks_total": kv_total,
            "kv_usage": round(load.kv_blocks_used / kv_total, 4) if kv_total else 0.0,
            "prefix_queries": load.prefix_queries,
            "prefix_hits": load.prefix_hits,
            "prefix_hit_rate": round(load.prefix_hits / load.prefix_queries, 4) if load.prefix_queries else None,
            "generation_tokens_per_s": round(rates.generation_tokens_per_s, 2),
            "prompt_tokens_per_s": round(rates.prompt_tokens_per_s, 2),
            "decode_compiled": load.decode_compiled,
            "cpu_kind": info.cpu.kind if info.cpu else None,
            "kernel_path": info.cpu.kernel_path if info.cpu else None,
            "kernel_path_reason": info.cpu.reason if info.cpu else None,
            "restarts": info.restarts,
            "deaths": dict(info.deaths),
            "last_death_reason": info.dead_reason or None,
        }


def _empty_throughput() -> dict:
    return {"t": None, "generation_tokens_per_s": 0.0, "prompt_tokens_per_s": 0.0, "requests_per_s": 0.0, "ttft_s": None,
            "tpot_s": None}  # fmt: skip
