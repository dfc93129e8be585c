"""What one frontend process knows: its lifecycle state, the model, the engines, the metrics. Shared by the
handlers."""

from __future__ import annotations

import enum
import logging
import os
import time

import msgspec
from dpserve_shared.schema import EngineLoad, EngineState, FrontendStats, LoadSnapshot, ModelInfo, Topology

from dpserve_frontend.engine_pool import EnginePool
from dpserve_frontend.errors import BadRequest, ModelNotFound, RetryLater, ServiceUnavailable
from dpserve_frontend.metrics import FrontendMetrics
from dpserve_frontend.router import AdmissionLimits
from dpserve_frontend.settings import FrontendSettings
from dpserve_frontend.structured import GrammarChecker
from dpserve_frontend.tokenizer import ModelTokenizer

log = logging.getLogger(__name__)


class ServerState(enum.Enum):
    """The API server process's lifecycle (`server.ApiServer` moves it forward, never back)."""

    STARTING = "starting"  # registering with the coordinator; the HTTP port is not bound yet
    SERVING = "serving"  # the port is bound
    DRAINING = "draining"  # stop asked: the port stays open, /health and new requests get 503, in-flight ones run
    STOPPED = "stopped"  # drained (or timed out), engines disconnected, unregistered


class FrontendState:
    def __init__(self, settings: FrontendSettings, model_info: ModelInfo | None = None):
        self.settings = settings
        # An app built without a server (tests) stays STARTING and serves: only DRAINING and STOPPED refuse.
        self.server_state = ServerState.STARTING
        self.metrics = FrontendMetrics()
        self.pool = EnginePool(
            settings.frontend_id,
            on_engine_load=self._on_engine_load,
            on_resend=self.metrics.migrations.inc,
            migration_limit=settings.migration_limit,
            admission=AdmissionLimits(settings.max_num_queued_requests, settings.max_num_queued_tokens),
            zmq_security=settings.zmq_security,
            routing=settings.routing,
        )
        self.pool.on_routed = self.metrics.count_routing
        self.metrics.follow_prefix_index(self.pool.prefix_index)
        self.tokenizer: ModelTokenizer | None = None
        self.model_info: ModelInfo | None = None
        self.grammars = GrammarChecker(settings.structured_output_compile_timeout_s,
                                       settings.structured_output_max_bytes, settings.is_json_whitespace_flexible)
        self.snapshot: LoadSnapshot | None = None
        self.engine_loads: dict[int, EngineLoad] = {}  # newest per rank (snapshot or piggybacked on outputs)
        self.num_http_in_flight = 0
        self.started_at = time.time()
        if model_info is not None:
            self.set_model(model_info)

    @property
    def is_draining(self) -> bool:
        return self.server_state in (ServerState.DRAINING, ServerState.STOPPED)

    # -- updates from the coordinator -------------------------------------------------------------------------

    def set_model(self, info: ModelInfo) -> None:
        if self.settings.chat_template is not None:  # --chat-template replaces the model's own
            info = msgspec.structs.replace(info, chat_template=self.settings.chat_template)
        if self.model_info is not None and info.tokenizer_json == self.model_info.tokenizer_json:
            if info != self.model_info:
                self.model_info = info
                self.tokenizer = ModelTokenizer(info)  # template or limits changed; cheap next to a request
            return
        log.info("model %s (max_model_len %d, vocab %d)", info.name, info.max_model_len, info.vocab_size)
        self.tokenizer = ModelTokenizer(info)
        self.model_info = info
        self.grammars.set_model(info)
        self.metrics.set_model_name(info.name)

    def apply_topology(self, topology: Topology) -> None:
        if topology.model is not None:
            self.set_model(topology.model)
        elif self.model_info is not None:
            # the coordinator's periodic republish leaves the model (and its tokenizer, ~MBs) out: keep ours
            topology = msgspec.structs.replace(topology, model=self.model_info)
        self.pool.apply_topology(topology)
        self.metrics.update_topology(topology)

    def apply_snapshot(self, snapshot: LoadSnapshot) -> None:
        if self.snapshot is not None and snapshot.timestamp and snapshot.timestamp < self.snapshot.timestamp:
            return
        self.snapshot = snapshot
        self.pool.apply_snapshot(snapshot)
        self.metrics.update_snapshot(snapshot)
        for load in snapshot.loads:
            self.engine_loads[load.rank] = load

    def _on_engine_load(self, load: EngineLoad) -> None:
        self.engine_loads[load.rank] = load

    def frontend_stats(self) -> FrontendStats:
        """This API server's figures for the coordinator (and every status page)."""
        totals = self.metrics.totals
        settings = self.settings
        return FrontendStats(
            settings.frontend_id, os.getpid(), f"{settings.host}:{settings.port}",
            num_in_flight=self.pool.num_in_flight,
            requests_finished=totals.requests_finished, ttft_sum_s=totals.ttft_sum_s, ttft_count=totals.ttft_count,
            tpot_sum_s=totals.tpot_sum_s, tpot_count=totals.tpot_count,
        )

    def health(self) -> tuple[str, list[int], int]:
        """(status, serving ranks, expected size): "ok" when every expected rank serves, "degraded" when only
        some do, "draining" while this API server shuts down, "unavailable" when no rank serves."""
        serving = self.pool.serving_ranks
        expected = max(self.pool.expected_size, len(serving))
        if self.is_draining:
            return "draining", serving, expected
        if not serving:
            return "unavailable", serving, expected
        return ("ok" if len(serving) >= expected else "degraded"), serving, expected

    def rank_health(self) -> list[dict]:
        """Each rank of the newest topology: rank, state ("failed" for a DEAD rank in a crash loop), whether this
        API server routes to it, its restarts and why it is down."""
        topology = self.pool.topology
        serving = set(self.pool.serving_ranks)
        out = []
        for info in topology.engines if topology is not None else []:
            state = "failed" if info.failed and info.state != EngineState.READY else info.state.value
            entry = {"rank": info.rank, "state": state, "serving": info.rank in serving, "restarts": info.restarts}
            if info.dead_reason:
                entry["reason"] = info.dead_reason
            out.append(entry)
        return out

    # -- checks for handlers ----------------------------------------------------------------------------------

    def require_model(self, requested: str | None) -> tuple[ModelInfo, ModelTokenizer]:
        """The served model (404 for another name, 503 before any engine has told us about it)."""
        if self.model_info is None or self.tokenizer is None:
            raise ServiceUnavailable("no engine has registered yet; the model is not known")
        if requested is not None and requested not in (self.model_info.name, self.model_info.root):
            raise ModelNotFound(f"The model `{requested}` does not exist.", param="model")
        return self.model_info, self.tokenizer

    def check_can_serve(self, pinned_rank: int | None) -> None:
        if self.is_draining:
            self.metrics.admission_rejections.labels("shutting_down").inc()
            raise RetryLater("the server is shutting down; retry on another server or later", "shutting_down")
        serving = self.pool.serving_ranks
        if pinned_rank is not None and pinned_rank not in serving:
            raise BadRequest(
                f"X-data-parallel-rank {pinned_rank} is not a serving rank; serving ranks: {serving}",
                param="X-data-parallel-rank",
            )
        if not serving:
            raise ServiceUnavailable("no engine rank is serving")
