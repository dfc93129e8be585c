"""The coordinator's registry: which engines and frontends exist, and what their load is. No sockets.

Engine ranks move STARTING -> READY -> (DRAINING) -> DEAD. A rank is STARTING while the launcher starts its
process, READY once its engine registered, DEAD when its process exited, it unregistered or it missed heartbeats
(an engine that was only late and heartbeats again is READY again). A DEAD rank can be taken over by a new
engine that registers with the same rank (a replacement). Every change bumps the topology epoch; every change of
what a LoadSnapshot lists (a rank's load, the READY set) bumps the load version. Both are bumped here only.

Elastic DP (scale): `data_parallel_size` is the target size. `scale_plan(k)` says which ranks a new target adds
(ranks below k that nobody serves or starts) and removes (every rank at or above k, highest first). Ranks being
removed are *retiring*: READY ones turn DRAINING (frontends send them nothing new), no hand-started engine is
given or may take their number, and `remove_engine` finally drops them from the topology.

Frontends are only a set of ids with a last-seen time: one that is silent for `frontend_timeout_s` or that
unregisters is dropped, and the server broadcasts FrontendGone so that engines abort its requests.
"""

from __future__ import annotations

import dataclasses
import time

from dpserve_shared.codec import ProtocolMismatch, check_protocol
from dpserve_shared.schema import (
    CpuChoice,
    EngineInfo,
    EngineLoad,
    EngineState,
    FrontendStats,
    LoadSnapshot,
    ModelInfo,
    RegisterEngine,
    RegisterFrontend,
    Topology,
)
from dpserve_shared.timing import ENGINE_SILENCE_S, ENGINE_STALL_S, FRONTEND_SILENCE_S


def death_kind(reason: str) -> str:
    """A DEAD reason's kind, for the deaths counter: killed (by a signal), exited (an exit code), actor_died,
    missed_heartbeats, stuck, unregistered, other."""
    if "exited with code -" in reason:
        return "killed"
    if "exited" in reason:  # with its code, or an adopted engine's (not our child: no code)
        return "exited"
    for kind, marker in (("missed_heartbeats", "missed heartbeats"), ("stuck", "stuck"), ("actor_died", "actor"),
                         ("unregistered", "unregister")):  # fmt: skip
        if marker in reason:
            return kind
    return "other"


class RegistrationRefused(Exception):
    """A registration the coordinator will not accept; the message goes back in RegisterAck.error."""


@dataclasses.dataclass
class EngineEntry:
    rank: int
    state: EngineState
    engine_id: str = ""
    input_addr: str = ""
    node_ip: str = ""
    pid: int = 0
    kv_blocks_total: int = 0
    last_seen_s: float = 0.0
    load: EngineLoad | None = None
    dead_reason: str = ""
    restarts: int = 0
    failed: bool = False
    deaths: dict[str, int] = dataclasses.field(default_factory=dict)  # by death_kind()
    step_changed_s: float = 0.0  # when its load's step counter last moved (or it registered)
    block_size: int = 0
    num_experts: int = 0
    cpu: CpuChoice | None = None

    def info(self) -> EngineInfo:
        return EngineInfo(
            rank=self.rank,
            engine_id=self.engine_id,
            input_addr=self.input_addr,
            state=self.state,
            node_ip=self.node_ip,
            pid=self.pid,
            kv_blocks_total=self.kv_blocks_total,
            dead_reason=self.dead_reason if self.state == EngineState.DEAD else "",
            restarts=self.restarts,
            failed=self.failed,
            deaths=dict(self.deaths),
            block_size=self.block_size,
            cpu=self.cpu,
        )


@dataclasses.dataclass
class FrontendEntry:
    frontend_id: str
    pid: int
    http_addr: str
    last_seen_s: float
    stats: FrontendStats | None = None  # from its newest heartbeat


class Registry:
    def __init__(self, data_parallel_size: int, engine_timeout_s: float = ENGINE_SILENCE_S,
                 frontend_timeout_s: float = FRONTEND_SILENCE_S, stall_timeout_s: float = ENGINE_STALL_S):
        self.data_parallel_size = data_parallel_size
        self.engine_timeout_s = engine_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.frontend_timeout_s = frontend_timeout_s
        self.engines: dict[int, EngineEntry] = {}
        self.frontends: dict[str, FrontendEntry] = {}
        self.model: ModelInfo | None = None
        # Epochs grow across coordinator restarts too (frontends ignore a topology older than the newest they
        # applied): a new registry starts from the wall clock in ms, past any epoch of the coordinator before it.
        self.epoch = time.time_ns() // 1_000_000
        self.load_version = 0  # grows whenever any engine's load changes
        self.retiring: set[int] = set()  # ranks a scale-down is removing

    # -- engines ------------------------------------------------------------------------------------------------

    def engine_starting(self, rank: int) -> None:
        """The launcher is starting (or restarting) `rank`."""
        self.engines[rank] = EngineEntry(rank=rank, state=EngineState.STARTING)
        self.epoch += 1

    def register_engine(self, msg: RegisterEngine, now_s: float) -> int:
        """Accept an engine and return its rank, or raise RegistrationRefused."""
        try:
            check_protocol(msg.protocol_version)
        except ProtocolMismatch as e:
            raise RegistrationRefused(str(e)) from None
        if self.model is not None and msg.model.name != self.model.name:
            raise RegistrationRefused(
                f"engine {msg.engine_id} serves model {msg.model.name!r} but this deployment serves "
                f"{self.model.name!r}"
            )
        rank = msg.rank if msg.rank >= 0 else self._free_rank()
        current = self.engines.get(rank)
        if rank in self.retiring and (current is None or current.engine_id != msg.engine_id):
            raise RegistrationRefused(f"rank {rank} is being removed by a scale-down; start the engine with --rank -1")
        if (
            current is not None
            and current.engine_id
            and current.engine_id != msg.engine_id
            and current.state in (EngineState.READY, EngineState.DRAINING)
        ):
            raise RegistrationRefused(f"rank {rank} is already served by engine {current.engine_id}")
        self.engines[rank] = EngineEntry(
            rank=rank,
            state=EngineState.DRAINING if rank in self.retiring else EngineState.READY,
            engine_id=msg.engine_id,
            input_addr=msg.input_addr,
            node_ip=msg.node_ip,
            pid=msg.pid,
            kv_blocks_total=msg.kv_blocks_total,
            block_size=msg.block_size,
            num_experts=msg.num_experts,
            cpu=msg.cpu,
            last_seen_s=now_s,
            step_changed_s=now_s,
            # the rank's history (the supervisor's): a replacement keeps the count and the crash-loop mark
            restarts=current.restarts if current is not None else 0,
            failed=current.failed if current is not None else False,
            deaths=current.deaths if current is not None else {},
        )
        if self.model is None:
            self.model = msg.model
        self.epoch += 1
        self.load_version += 1
        return rank

    def _free_rank(self) -> int:
        """The lowest rank that nobody serves or is starting, and that no scale-down is removing."""
        rank = 0
        while rank in self.retiring or (rank in self.engines and self.engines[rank].state != EngineState.DEAD):
            rank += 1
        return rank

    def engine_by_id(self, engine_id: str) -> EngineEntry | None:
        for entry in self.engines.values():
            if entry.engine_id == engine_id:
                return entry
        return None

    def mark_dead(self, rank: int, reason: str) -> bool:
        """Mark a rank DEAD; False if it already was (its reason is then the newest) or is unknown."""
        entry = self.engines.get(rank)
        if entry is None:
            return False
        if entry.state == EngineState.DEAD:
            if entry.dead_reason != reason:  # e.g. a replacement that died before it registered
                entry.dead_reason = reason
                self.epoch += 1
            return False
        entry.state = EngineState.DEAD
        entry.dead_reason = reason
        kind = death_kind(reason)
        entry.deaths[kind] = entry.deaths.get(kind, 0) + 1
        entry.load = None
        self.epoch += 1
        self.load_version += 1
        return True

    def set_restarts(self, rank: int, restarts: int, failed: bool) -> None:
        """The supervisor's count of the rank's replacements and whether it is in a crash loop (for the topology)."""
        entry = self.engines.get(rank)
        if entry is not None and (entry.restarts, entry.failed) != (restarts, failed):
            entry.restarts, entry.failed = restarts, failed
            self.epoch += 1

    def update_load(self, engine_id: str, load: EngineLoad, now_s: float) -> None:
        entry = self.engine_by_id(engine_id)
        if entry is None:
            return
        self._seen_engine(entry, now_s)
        load.rank = entry.rank
        if entry.load is None or entry.load.step != load.step:
            entry.step_changed_s = now_s
        if entry.load != load:
            entry.load = load
            self.load_version += 1

    def _seen_engine(self, entry: EngineEntry, now_s: float) -> None:
        entry.last_seen_s = now_s
        if entry.state == EngineState.DEAD and entry.dead_reason == "missed heartbeats":
            entry.state = EngineState.DRAINING if entry.rank in self.retiring else EngineState.READY  # only late
            entry.dead_reason = ""
            self.epoch += 1

    def serving_engines(self) -> dict[int, str]:
        """rank -> engine id of the ranks whose engine serves (READY or DRAINING)."""
        return {r: e.engine_id for r, e in self.engines.items()
                if e.state in (EngineState.READY, EngineState.DRAINING)}  # fmt: skip

    def ready_ranks(self) -> list[int]:
        return sorted(r for r, e in self.engines.items() if e.state == EngineState.READY)

    def is_idle(self, rank: int) -> bool:
        """The rank's last reported load has nothing waiting or running."""
        entry = self.engines.get(rank)
        return entry is not None and entry.load is not None and entry.load.num_waiting + entry.load.num_running == 0

    # -- scaling ------------------------------------------------------------------------------------------------

    def scale_plan(self, target: int) -> tuple[list[int], list[int]]:
        """(ranks to start, ranks to remove) to reach ranks 0..target-1. Removal goes highest rank first.

        A rank below `target` that is listed in any state (a hand-started engine, a DEAD rank) is left alone."""
        add = [rank for rank in range(target) if rank not in self.engines]
        remove = sorted((rank for rank in self.engines if rank >= target), reverse=True)
        return add, remove

    def set_target(self, data_parallel_size: int) -> None:
        if data_parallel_size != self.data_parallel_size:
            self.data_parallel_size = data_parallel_size
            self.epoch += 1

    def retire(self, ranks: list[int]) -> None:
        """Start removing `ranks`: READY ones turn DRAINING (published with the next topology)."""
        for rank in ranks:
            self.retiring.add(rank)
            entry = self.engines.get(rank)
            if entry is not None and entry.state == EngineState.READY:
                entry.state = EngineState.DRAINING
        self.epoch += 1
        self.load_version += 1

    def remove_engine(self, rank: int) -> None:
        """Drop a rank from the topology (its process is gone); its number is free again."""
        self.engines.pop(rank, None)
        self.retiring.discard(rank)
        self.epoch += 1
        self.load_version += 1

    # -- frontends ----------------------------------------------------------------------------------------------

    def register_frontend(self, msg: RegisterFrontend, now_s: float) -> None:
        try:
            check_protocol(msg.protocol_version)
        except ProtocolMismatch as e:
            raise RegistrationRefused(str(e)) from None
        self.frontends[msg.frontend_id] = FrontendEntry(msg.frontend_id, msg.pid, msg.http_addr, now_s)

    def drop_frontend(self, frontend_id: str) -> bool:
        return self.frontends.pop(frontend_id, None) is not None

    # -- both ---------------------------------------------------------------------------------------------------

    def heartbeat(self, sender_id: str, now_s: float, stats: FrontendStats | None = None) -> bool:
        """Record a heartbeat (and a frontend's figures); False if the sender is unknown (it should register
        again)."""
        frontend = self.frontends.get(sender_id)
        if frontend is not None:
            frontend.last_seen_s = now_s
            if stats is not None:
                frontend.stats = stats
            return True
        engine = self.engine_by_id(sender_id)
        if engine is not None:
            self._seen_engine(engine, now_s)
            return True
        return False

    def expire(self, now_s: float) -> tuple[list[str], list[int]]:
        """Drop silent frontends; mark DEAD the engines that are silent (no heartbeat for engine_timeout_s) or
        stuck (requests waiting or running, and a step counter that has not moved for stall_timeout_s, while the
        heartbeats still come: a step that never returns); return (gone frontend ids, newly dead ranks)."""
        gone = [f.frontend_id for f in self.frontends.values() if now_s - f.last_seen_s > self.frontend_timeout_s]
        for frontend_id in gone:
            del self.frontends[frontend_id]
        dead = [
            e.rank
            for e in self.engines.values()
            if e.state in (EngineState.READY, EngineState.DRAINING) and now_s - e.last_seen_s > self.engine_timeout_s
        ]
        for rank in dead:
            self.mark_dead(rank, "missed heartbeats")
        for e in self.engines.values():
            load = e.load
            if (e.state in (EngineState.READY, EngineState.DRAINING) and load is not None
                    and load.num_running + load.num_waiting > 0 and now_s - e.step_changed_s > self.stall_timeout_s):
                self.mark_dead(e.rank, f"stuck: no engine step for {now_s - e.step_changed_s:.0f} s with "
                                       f"{load.num_running + load.num_waiting} requests")  # fmt: skip
                dead.append(e.rank)
        return gone, dead

    def forgive(self, seconds: float) -> None:
        """The coordinator did not run for `seconds` (starved of CPU): nobody's silence in that time counts."""
        for entry in self.engines.values():
            entry.last_seen_s += seconds
            entry.step_changed_s += seconds
        for frontend in self.frontends.values():
            frontend.last_seen_s += seconds

    def topology(self) -> Topology:
        return Topology(
            epoch=self.epoch,
            engines=[self.engines[r].info() for r in sorted(self.engines)],
            model=self.model,
            data_parallel_size=self.data_parallel_size,
        )

    def load_snapshot(self, wave: int, engines_running: bool, now_s: float) -> LoadSnapshot:
        loads = [
            self.engines[r].load or EngineLoad(rank=r, kv_blocks_total=self.engines[r].kv_blocks_total)
            for r in self.ready_ranks()
        ]
        return LoadSnapshot(loads=loads, wave=wave, engines_running=engines_running, timestamp=now_s,
                            frontends=self.frontend_stats())

    def frontend_stats(self) -> list[FrontendStats]:
        """Every registered frontend's newest figures (its identity alone until its first heartbeat)."""
        return [f.stats or FrontendStats(f.frontend_id, f.pid, f.http_addr) for f in self.frontends.values()]
