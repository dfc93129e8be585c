"""Elastic DP: the coordinator's scale step (ScaleRequest from `dpserve scale`), one at a time.

Scale up to K (new ranks N..K-1; any rank below K that nobody serves):
  1. the target size becomes K and each new rank is listed STARTING (topology broadcast);
  2. the supervisor starts it through the launcher (mp: a child process; ray: a placement group planned now from
     the cluster's free resources, and an EngineHost actor) and watches it like the ranks started at start-up;
  3. the engine registers, turns READY, and frontends connect to it from the topology and route to it;
  4. the step completes when every new rank is READY (RankSupervisor.wait_ready; a rank that dies or does not
     register within --engine-startup-timeout-s is stopped, removed and named in the error; the ranks that came
     up stay).

Scale down to K (every rank >= K, highest first, all drained together):
  1. the target size becomes K and the ranks turn DRAINING (one topology broadcast): frontends keep their
     connections, so in-flight requests finish, but send them nothing new;
  2. the coordinator waits until each rank's load has shown nothing waiting or running for DRAIN_SETTLE_S (a
     request a frontend sent just before it saw DRAINING is counted, or arrives and is run), for up to the
     request's drain timeout (default SCALE_DRAIN_TIMEOUT_S);
  3. it sends the engine Shutdown(drain=True) on the control socket; the engine finishes anything that still
     runs (for the rest of the drain timeout, at least MIN_FINAL_DRAIN_S), leaves requests that arrive now
     unanswered and exits;
  4. the supervisor does not restart it, and has the launcher stop what is left (mp: SIGTERM then SIGKILL; ray:
     the actor stops the engine, the actor is killed, the placement group removed); the rank is removed from the
     topology. Frontends then drop the rank; a request it never answered (no token yet) is re-sent elsewhere.

Expert parallelism (--enable-expert-parallel; expert_groups.py): the ranks' group has a fixed world size, so a
step re-forms it (pause, not drain: the ranks keep their requests and stop stepping only for the re-formation).
Up: once every new rank is READY (registered, waiting for its group), every rank 0..K-1 gets the new group; the
old ones leave theirs at the step their all-reduce agrees on, all join the new one (the experts re-shard:
EngineCore.set_expert_comm) and step on; the step completes when every rank has joined. Down: after step 2's
drain, ranks 0..K-1 get the new group and each removed rank an ExpertGroup with rank -1 (leave at the agreed
step, join none); once all answered, steps 3 and 4 stop the removed ranks as for dense models.

The coordinator opens the scaler once every rank of the start-up is READY and closes it when it stops; the
scaler answers the requester's second ScaleAck through the `reply` it was given.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from dpserve_shared.schema import MAX_DATA_PARALLEL_SIZE, EngineState, ScaleAck, ScaleRequest, Shutdown

from dpserve_coordinator.expert_groups import ExpertGroups, FormationFailed
from dpserve_coordinator.launcher import LaunchError
from dpserve_coordinator.registry import Registry
from dpserve_coordinator.supervisor import RankSupervisor

log = logging.getLogger("dpserve.coordinator")

SCALE_DRAIN_TIMEOUT_S = 120.0  # vLLM's scale_elastic_ep drain_timeout default
DRAIN_SETTLE_S = 0.5  # a draining rank must look idle this long (its stats lag by up to ~0.15 s)
MIN_FINAL_DRAIN_S = 5.0
_POLL_S = 0.1
_STOP_TIMEOUT_S = 5.0  # SIGTERM -> SIGKILL once the engine was asked to exit

_NOT_OPEN = "the coordinator is still starting its ranks; try again once they are ready"
_CLOSED = "the coordinator is shutting down"

Reply = Callable[[str, object], Awaitable[None]]  # send one message to one DEALER on the control socket


class ScaleFailed(Exception):
    pass


class Scaler:
    """Runs one scale step at a time; the step's outcome goes back to its requester."""

    def __init__(self, registry: Registry, supervisor: RankSupervisor, reply: Reply,
                 engine_startup_timeout_s: float, expert_groups: ExpertGroups | None = None):
        self._registry = registry
        self._expert_groups = expert_groups  # --enable-expert-parallel: each step re-forms the group
        self._supervisor = supervisor
        self._reply = reply
        self._engine_startup_timeout_s = engine_startup_timeout_s
        self._refusal: str | None = _NOT_OPEN  # why a request is refused now, whatever it asks
        self._task: asyncio.Task | None = None
        self._target = 0
        self._started_s = 0.0

    @property
    def is_scaling(self) -> bool:
        return self._task is not None and not self._task.done()

    def open(self) -> None:
        """Every rank of the start-up is READY: requests are taken from now on."""
        if self._refusal == _NOT_OPEN:
            self._refusal = None

    def close(self) -> None:
        """The coordinator is stopping: refuse requests from now on and cancel a step in progress (its requester
        gets no second answer); `wait_closed` waits until that step has unwound."""
        self._refusal = _CLOSED
        if self._task is not None:
            self._task.cancel()

    async def wait_closed(self) -> None:
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    def request(self, sender: str, msg: ScaleRequest, pub_addr: str) -> ScaleAck:
        """Validate and start a step; the returned ack is the first answer (the second comes when it is done)."""
        registry = self._registry
        current = registry.data_parallel_size
        target = msg.data_parallel_size

        def refuse(error: str) -> ScaleAck:
            log.warning("scale to %d refused: %s", target, error)
            return ScaleAck(accepted=False, error=error, data_parallel_size=current, is_complete=True,
                            topology=registry.topology())

        if not 1 <= target <= MAX_DATA_PARALLEL_SIZE:
            return refuse(f"--data-parallel-size must be between 1 and {MAX_DATA_PARALLEL_SIZE}, got {target}")
        if msg.drain_timeout_s < 0:
            return refuse(f"--drain-timeout must not be negative, got {msg.drain_timeout_s:g}")
        if self._refusal is not None:
            return refuse(self._refusal)
        num_experts = max((e.num_experts for e in registry.engines.values()), default=0)
        if self._expert_groups is not None and num_experts and num_experts % target:
            return refuse(f"--data-parallel-size must divide the model's {num_experts} experts (expert parallelism "
                          f"gives each rank the same number), got {target}")
        if self.is_scaling:
            return refuse(
                f"a scale to {self._target} is in progress (for {time.monotonic() - self._started_s:.0f} s); "
                "wait for it to finish"
            )
        for rank in range(target):  # a DEAD or FAILED rank the target includes: its replacement starts now
            if self._supervisor.retry_now(rank):
                log.info("scale to %d: rank %d is DEAD; its replacement starts now", target, rank)
        add, remove = registry.scale_plan(target)
        if not add and not remove and target == current:
            log.info("scale to %d: nothing to do", target)
            return ScaleAck(accepted=True, data_parallel_size=target, is_complete=True, topology=registry.topology())
        self._target = target
        self._started_s = time.monotonic()
        # The bookkeeping happens now, so that the ack (and the next broadcast) already shows the step.
        registry.set_target(target)
        for rank in add:
            registry.engine_starting(rank)
        if remove:
            registry.retire(remove)
        drain_timeout_s = msg.drain_timeout_s or SCALE_DRAIN_TIMEOUT_S
        self._task = asyncio.create_task(self._run(sender, current, target, add, remove, drain_timeout_s),
                                         name=f"scale-{target}")
        return ScaleAck(accepted=True, data_parallel_size=target, pub_addr=pub_addr, topology=registry.topology())

    async def _run(self, sender: str, current: int, target: int, add: list[int], remove: list[int],
                   drain_timeout_s: float) -> None:
        registry = self._registry
        log.info("scale %d -> %d: starting ranks %s, removing ranks %s", current, target, add, remove)
        try:
            if add:
                await self._scale_up(add)
            if remove:
                await self._scale_down(remove, drain_timeout_s)
            elif add:
                await self._regroup([])
        except ScaleFailed as e:
            log.error("scale to %d failed after %.1f s: %s", target, time.monotonic() - self._started_s, e)
            ack = ScaleAck(accepted=False, error=str(e), data_parallel_size=registry.data_parallel_size,
                           is_complete=True, topology=registry.topology())
        except Exception as e:  # noqa: BLE001 - the requester must hear about it
            log.exception("scale to %d failed", target)
            ack = ScaleAck(accepted=False, error=f"{type(e).__name__}: {e}",
                           data_parallel_size=registry.data_parallel_size, is_complete=True,
                           topology=registry.topology())
        else:
            log.info("scale %d -> %d done in %.1f s: ranks %s", current, target,
                     time.monotonic() - self._started_s, sorted(registry.engines))
            ack = ScaleAck(accepted=True, data_parallel_size=target, is_complete=True, topology=registry.topology())
        await self._reply(sender, ack)

    # -- up -----------------------------------------------------------------------------------------------------

    async def _scale_up(self, ranks: list[int]) -> None:
        registry = self._registry
        deadline = time.monotonic() + self._engine_startup_timeout_s
        failed: dict[int, str] = {}
        for rank in ranks:
            try:
                await self._supervisor.start(rank)
            except Exception as e:  # noqa: BLE001 - LaunchError, or Ray's own errors: the rank must not hang STARTING
                failed[rank] = str(e) if isinstance(e, LaunchError) else f"{type(e).__name__}: {e}"
        missing = await self._supervisor.wait_ready([r for r in ranks if r not in failed], deadline,
                                                    log_prefix="scale: ")
        failed.update(missing.dead)
        for rank in missing.late:
            failed[rank] = (f"did not register within --engine-startup-timeout-s "
                            f"{self._engine_startup_timeout_s:.0f} s ({self._supervisor.describe([rank])})")
        if failed:
            for rank in failed:
                await self._release(rank)
            registry.set_target(len(registry.engines))
            raise ScaleFailed(
                "; ".join(f"rank {rank}: {reason}" for rank, reason in sorted(failed.items()))
                + f" (those ranks were removed; ranks now {sorted(registry.engines)})"
            )

    # -- down ---------------------------------------------------------------------------------------------------

    async def _scale_down(self, ranks: list[int], drain_timeout_s: float) -> None:
        log.info("scale: ranks %s DRAINING: frontends send them nothing new; waiting for their requests", ranks)
        deadline = time.monotonic() + drain_timeout_s
        await self._wait_idle(ranks, deadline)
        await self._regroup(ranks)
        final_drain_s = max(MIN_FINAL_DRAIN_S, deadline - time.monotonic())
        await asyncio.gather(*(self._remove(rank, final_drain_s) for rank in ranks))

    async def _regroup(self, leavers: list[int]) -> None:
        """Expert parallelism: re-form the group with every rank that stays (the removed `leavers` leave it)."""
        if self._expert_groups is None:
            return
        registry = self._registry
        leavers = [rank for rank in leavers if rank in registry.engines and registry.engines[rank].engine_id
                   and registry.engines[rank].state != EngineState.DEAD]  # fmt: skip
        members = sorted(rank for rank in registry.serving_engines() if rank not in leavers)
        try:
            await self._expert_groups.form(members, leavers)
        except FormationFailed as e:
            raise ScaleFailed(str(e)) from None

    async def _wait_idle(self, ranks: list[int], deadline: float) -> None:
        registry = self._registry
        idle_since: dict[int, float] = {}
        pending = set(ranks)
        while pending:
            now = time.monotonic()
            for rank in sorted(pending):
                entry = registry.engines.get(rank)
                if entry is None or entry.state != EngineState.DRAINING:
                    pending.discard(rank)  # never came up, or died: nothing to drain
                elif registry.is_idle(rank):
                    if now - idle_since.setdefault(rank, now) >= DRAIN_SETTLE_S:
                        pending.discard(rank)
                        log.info("scale: rank %d has no requests left", rank)
                else:
                    idle_since.pop(rank, None)
            if pending and now > deadline:
                log.warning("scale: ranks %s still have requests after the drain timeout; stopping them anyway",
                            sorted(pending))
                return
            await asyncio.sleep(_POLL_S)

    async def _remove(self, rank: int, final_drain_s: float) -> None:
        entry = self._registry.engines.get(rank)
        if entry is not None and entry.engine_id and entry.state != EngineState.DEAD:
            await self._reply(entry.engine_id, Shutdown(drain=True, reason="scale-down", drain_timeout_s=final_drain_s))
            exited = await self._supervisor.wait_exit(rank, final_drain_s + _STOP_TIMEOUT_S)
            if not exited:
                log.warning("scale: rank %d did not exit within %.0f s of Shutdown", rank,
                            final_drain_s + _STOP_TIMEOUT_S)
        await self._release(rank)

    async def _release(self, rank: int) -> None:
        """Stop whatever the launcher still runs for the rank, then drop it from the topology."""
        self._registry.retire([rank])  # the supervisor must not restart it
        await self._supervisor.stop(rank, _STOP_TIMEOUT_S)
        self._registry.remove_engine(rank)
        log.info("scale: rank %d removed", rank)
