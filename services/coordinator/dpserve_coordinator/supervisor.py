"""Rank supervision: start each rank through the backend's launcher, watch its process, restart it, forget it.

One watcher task per rank waits for the launcher to report that the rank's process exited, then:
  - the deployment is stopping, or a scale-down is removing the rank: expected, nothing to do;
  - otherwise the rank is marked DEAD in the registry (the next topology broadcast tells the frontends, which
    move its requests to live ranks) and a replacement is started; it registers under the same rank like any
    engine. There is no lifetime cap: the delay before a replacement doubles with each death in a row that came
    within STABLE_S of the rank's start (1, 2, 4 ... MAX_RESTART_DELAY_S), and after --max-engine-restarts such
    deaths the rank is shown as FAILED (a crash loop, in the topology: /health, /metrics, the log) while it is
    still retried; a rank that lives STABLE_S is healthy again. A replacement that cannot be launched is retried
    the same way. Only a rank that dies before it ever registered is not restarted: `wait_ready` reports it to
    whoever is waiting for it (start-up or a scale-up). A rank of an expert-parallel deployment is replaced the
    same way (a first death with no back-off: the whole group waits for it); the coordinator's ExpertGroups re-forms
    the group once the replacement registered.

`wait_ready` is the one "wait until these ranks are READY by a deadline, name the missing ones", used by the
coordinator's start-up and by a scale-up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time

from dpserve_shared.schema import EngineState

from dpserve_coordinator.launcher import EngineLauncher, MpLauncher
from dpserve_coordinator.registry import Registry
from dpserve_coordinator.settings import CoordinatorSettings

log = logging.getLogger("dpserve.coordinator")

RESTART_DELAY_S = 1.0  # before the first replacement; doubled for each quick death in a row
MAX_RESTART_DELAY_S = 30.0
STABLE_S = 30.0  # a rank that lives this long after its start was not in a crash loop
_POLL_S = 0.1


def make_launcher(settings: CoordinatorSettings) -> EngineLauncher:
    if settings.data_parallel_backend == "mp":
        return MpLauncher(settings)
    if settings.ray_address and (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        # Ray 2.60 sends a token to an existing cluster only in token mode, read when ray is imported.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    from dpserve_coordinator.ray_backend import RayLauncher  # the only import of Ray, and only here

    return RayLauncher(settings)


@dataclasses.dataclass
class NotReady:
    """The ranks `wait_ready` did not see READY: those that died (or were removed), with the reason, and those
    still starting at the deadline."""

    dead: dict[int, str] = dataclasses.field(default_factory=dict)
    late: list[int] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.dead or self.late)


class RankSupervisor:
    """Starts, watches, restarts and stops the engine ranks of one coordinator; the launcher does the processes."""

    def __init__(self, registry: Registry, settings: CoordinatorSettings, launcher: EngineLauncher | None = None):
        self._registry = registry
        self._settings = settings
        self._launcher = launcher
        self._watchers: dict[int, asyncio.Task] = {}
        self._wake: dict[int, asyncio.Event] = {}  # set: a DEAD rank's back-off ends now (retry_now)
        self._is_stopping = False

    async def connect(self) -> None:
        """Make the backend's launcher; Ray: ray.init and the placement plan, in a thread (a few seconds, and
        ray.init must not replace the coordinator's SIGTERM handler with its own sys.exit)."""
        if self._launcher is None:
            self._launcher = make_launcher(self._settings)
        connect = getattr(self._launcher, "connect", None)
        if connect is not None:
            await asyncio.to_thread(connect)

    # -- ranks a coordinator before this one started -------------------------------------------------------------

    def adopt_found(self) -> list[int]:
        """The ranks whose engines the launcher found running (Ray: the deployment's named actors): listed as
        STARTING until their engines register again, and watched like the ranks this coordinator starts."""
        found = sorted(getattr(self._launcher, "adopted", {}))
        for rank in found:
            entry = self._registry.engines.get(rank)
            if entry is None or entry.state != EngineState.READY:  # not registered again yet
                self._registry.engine_starting(rank)
            self._watch_rank(rank)
        return found

    def adopt_registered(self, rank: int) -> bool:
        """A READY rank that registered by itself (its engine outlived the coordinator before this one): watch its
        process if the launcher can (mp: by pid); False if it cannot (then it is watched by its heartbeats only)."""
        entry = self._registry.engines.get(rank)
        if rank in self._watchers or entry is None or not self._launcher.adopt(rank, entry.pid):
            return rank in self._watchers
        self._watch_rank(rank)
        return True

    # -- one rank -----------------------------------------------------------------------------------------------

    async def start(self, rank: int) -> None:
        """Launch the rank's engine (it registers by itself) and watch its process. Raises what the launcher
        raises (LaunchError, or Ray's own errors)."""
        await self._launcher.start(rank)
        self._watch_rank(rank)

    def _watch_rank(self, rank: int) -> None:
        self._watchers[rank] = asyncio.create_task(self._watch(rank), name=f"supervise-{rank}")

    async def stop(self, rank: int, timeout_s: float) -> None:
        """Stop the rank for good (the registry already lists it as retiring, so it is not restarted): the
        launcher stops what is left of it and releases what it reserved, then the rank is forgotten."""
        await self._launcher.stop(rank, timeout_s)
        await self.forget(rank)

    async def forget(self, rank: int) -> None:
        """Stop watching the rank (a later rank with its number is a new registry entry: a fresh restart count)."""
        task = self._watchers.pop(rank, None)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def kill(self, rank: int) -> None:
        """SIGKILL the rank's engine process (silent or stuck: it cannot be asked); its watcher then sees it exit
        and replaces it."""
        try:
            await self._launcher.kill(rank)
        except Exception as e:  # noqa: BLE001 - the watcher still sees whatever happens to the process
            log.error("rank %d: could not kill its engine process: %s", rank, e)

    def retry_now(self, rank: int) -> bool:
        """End a DEAD rank's back-off now (`dpserve scale` to a size that includes it); False if it is not
        waiting for a replacement."""
        wake = self._wake.get(rank)
        entry = self._registry.engines.get(rank)
        if wake is None or wake.is_set() or entry is None or entry.state != EngineState.DEAD:
            return False
        wake.set()
        return True

    def is_watching(self, rank: int) -> bool:
        return rank in self._watchers

    def describe(self, ranks: list[int]) -> str:
        """What the launcher knows of the ranks (pid, actor and node), for error messages."""
        return "; ".join(self._launcher.describe(rank) for rank in ranks)

    async def wait_exit(self, rank: int, timeout_s: float) -> bool:
        """Wait until the rank's engine process exited (its watcher returns) or, for an engine this coordinator
        did not start, until it unregistered; False on timeout."""
        task = self._watchers.get(rank)
        try:
            if task is not None:
                await asyncio.wait_for(asyncio.shield(task), timeout_s)
                return True
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                entry = self._registry.engines.get(rank)
                if entry is None or entry.state == EngineState.DEAD:
                    return True
                await asyncio.sleep(_POLL_S)
            return False
        except asyncio.TimeoutError:
            return False

    # -- many ranks ---------------------------------------------------------------------------------------------

    async def wait_ready(self, ranks: list[int], deadline: float, *, fail_fast: bool = False,
                         log_prefix: str = "") -> NotReady:
        """Wait until every rank of `ranks` is READY (logging each as it turns READY), by `deadline`
        (time.monotonic()). Returns the ranks that did not: DEAD or gone ones with the reason, and the ones still
        starting at the deadline. `fail_fast`: return at the first rank that died."""
        started = time.monotonic()
        pending = list(ranks)
        missing = NotReady()
        while pending:
            for rank in list(pending):
                entry = self._registry.engines.get(rank)
                if entry is not None and entry.state == EngineState.READY:
                    pending.remove(rank)
                    log.info("%srank %d ready (%d/%d) after %.1f s: %s", log_prefix, rank,
                             len(ranks) - len(pending), len(ranks), time.monotonic() - started, entry.input_addr)
                elif entry is None or entry.state == EngineState.DEAD:
                    pending.remove(rank)
                    missing.dead[rank] = entry.dead_reason if entry is not None else "gone"
            if missing.dead and fail_fast:
                return missing
            if pending and time.monotonic() > deadline:
                missing.late = pending
                return missing
            if pending:
                await asyncio.sleep(_POLL_S)
        return missing

    async def close(self, timeout_s: float) -> None:
        """Stop every rank (the launcher: SIGTERM, SIGKILL after `timeout_s`, release what was reserved)."""
        self.stop_restarts()
        if self._launcher is not None:
            await self._launcher.close(timeout_s)
        tasks = list(self._watchers.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def stop_restarts(self) -> None:
        """The deployment is stopping: from now on a rank that exits stays down."""
        self._is_stopping = True

    def kill_now(self) -> None:
        """Second signal: kill every rank at once, synchronously."""
        self._is_stopping = True
        if self._launcher is not None:
            self._launcher.kill_now()

    # -- the watcher --------------------------------------------------------------------------------------------

    async def _watch(self, rank: int) -> None:
        """Mark the rank DEAD when its process exits and start a replacement (on the back-off), for as long as the
        rank belongs to the deployment."""
        quick_deaths = 0  # in a row, each within STABLE_S of the rank's start
        while True:
            started = time.monotonic()
            reason = await self._wait_exit(rank)
            if self._is_stopping:
                return
            if rank in self._registry.retiring:  # removed by a scale-down: expected, and not to be restarted
                log.info("rank %d: %s (removed by scale-down)", rank, reason)
                return
            log.error("rank %d: %s", rank, reason)
            self._registry.mark_dead(rank, reason)
            if not self._has_registered(rank):
                return  # failed before it ever came up: wait_ready reports it
            quick_deaths = quick_deaths + 1 if time.monotonic() - started < STABLE_S else 1
            while True:
                delay = self._note_death(rank, quick_deaths, reason)
                wake = self._wake.setdefault(rank, asyncio.Event())
                wake.clear()
                try:
                    await asyncio.wait_for(wake.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                if self._is_stopping or rank in self._registry.retiring:
                    return
                try:
                    await self._launcher.start(rank)
                    break
                except Exception as e:  # noqa: BLE001 - LaunchError, or Ray's own errors
                    reason = f"replacement failed: {e}"
                    log.error("rank %d: %s", rank, reason)
                    quick_deaths += 1

    async def _wait_exit(self, rank: int) -> str:
        """The launcher's exit reason for the rank; once it has lived STABLE_S, its crash-loop mark goes."""
        exited = asyncio.ensure_future(self._launcher.wait_exit(rank))
        try:
            try:
                return await asyncio.wait_for(asyncio.shield(exited), STABLE_S)
            except asyncio.TimeoutError:
                pass
            entry = self._registry.engines.get(rank)
            if entry is not None and entry.failed:
                log.info("rank %d: serving for %.0f s: no longer failed", rank, STABLE_S)
                self._registry.set_restarts(rank, entry.restarts, failed=False)
            return await exited
        finally:
            exited.cancel()

    def _note_death(self, rank: int, quick_deaths: int, reason: str) -> float:
        """Count the restart, mark a crash loop FAILED, log; returns the delay before the replacement."""
        entry = self._registry.engines.get(rank)
        restarts = (entry.restarts if entry is not None else 0) + 1  # the registry keeps the rank's count
        failed = quick_deaths > self._settings.max_engine_restarts
        self._registry.set_restarts(rank, restarts, failed)
        delay = min(MAX_RESTART_DELAY_S, RESTART_DELAY_S * 2 ** (quick_deaths - 1))
        if self._settings.enable_expert_parallel and quick_deaths == 1:
            delay = 0.0  # every rank of the group waits for this one: a first death is replaced at once
        if failed:
            log.error("rank %d: FAILED (a crash loop: %d deaths in a row within %.0f s of a start; last: %s); "
                      "retrying in %.0f s (restart %d)", rank, quick_deaths, STABLE_S, reason, delay, restarts)  # fmt: skip
        else:
            log.info("rank %d: starting a replacement in %.0f s (restart %d)", rank, delay, restarts)
        return delay

    def _has_registered(self, rank: int) -> bool:
        entry = self._registry.engines.get(rank)
        return entry is not None and bool(entry.engine_id)
