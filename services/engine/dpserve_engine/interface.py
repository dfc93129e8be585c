"""What every engine core offers the service wrapper: pure, in-process, steppable, no sockets."""

from __future__ import annotations

import abc
from collections.abc import Iterable

from dpserve_shared.schema import CpuChoice, EngineLoad, EngineRequest, FinishReason, ModelInfo, RequestOutput


class InvalidRequest(ValueError):
    """A request the engine cannot take (too long, bad token ids...). The message is shown to the user."""


class EngineCoreBase(abc.ABC):
    model_info: ModelInfo
    kv_blocks_total: int
    block_size: int = 0  # tokens per KV block (0: no prefix cache to report)
    num_experts: int = 0  # an MoE model's experts (0: dense, or the null engine); expert parallelism splits them

    @abc.abstractmethod
    def add_request(self, request: EngineRequest) -> None:
        """Queue a request. Raises InvalidRequest for a request that can never be served."""

    @abc.abstractmethod
    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Drop requests (unknown ids are ignored), free their blocks, return one ABORT output per dropped one."""

    @abc.abstractmethod
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; return the new tokens and finishes of this step."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""

    @abc.abstractmethod
    def load(self) -> EngineLoad:
        """Current load and cumulative counters (rank left 0; the service stamps it)."""

    # KV events (the prefix cache's stored/evicted block hashes, for the coordinator's index); none by default.

    def start_kv_events(self) -> None:
        """Start recording KV events (the service does, once registered)."""

    def take_kv_events(self) -> tuple[list[int], list[int]]:
        """(stored, removed) block hashes since the last take, net."""
        return [], []

    def kv_snapshot(self) -> list[int]:
        """Every block hash the prefix cache holds now."""
        return []

    def cpu_choice(self) -> CpuChoice | None:
        """The CPU kind and kernel path this core runs on (RegisterEngine.cpu, /status); None: nothing to say."""
        return None

    # Expert parallelism (--enable-expert-parallel; the lock-step contract, service lockstep.py): once the rank
    # joined the group, every step() and every dummy_step() runs each MoE layer's collectives exactly once (a step
    # that schedules nothing runs the dummy forward), so that the ranks' collectives match one for one.

    @property
    def supports_expert_parallel(self) -> bool:
        return type(self).set_expert_comm is not EngineCoreBase.set_expert_comm

    def set_expert_comm(self, comm) -> None:
        """Use `comm` (an ExpertComm: expert_parallel.ExpertParallelComm) for the MoE layers from now on."""
        raise NotImplementedError(
            f"{type(self).__name__} has no expert-parallel mode: --enable-expert-parallel needs a mixture-of-experts "
            "model (or --null-engine)"
        )

    def dummy_step(self) -> None:
        """One forward with no tokens of this rank's own (0 rows into every MoE layer's collectives)."""
        raise NotImplementedError(f"{type(self).__name__} has no expert-parallel mode")


def queue_timeout_output(request_id: str, waited_s: float, limit_s: float) -> RequestOutput:
    """The answer to a request that waited longer than --max-queue-time-s (EngineCore and the null engine)."""
    return RequestOutput(
        request_id, finish_reason=FinishReason.ERROR, retry_reason="queue_time", queue_time_s=waited_s,
        error=f"the request waited {waited_s:.1f} s in the engine's queue, longer than --max-queue-time-s "
              f"{limit_s:g}; retry later",
    )  # fmt: skip
