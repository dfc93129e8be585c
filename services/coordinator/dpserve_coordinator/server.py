"""The coordinator process: control ROUTER + broadcast PUB around the registry; dispatch and publishing.

Lifecycle (CoordinatorState): STARTING (sockets bound; the supervisor starts every rank and waits until each has
registered, logging each as it does, failing with the missing ranks named after --engine-startup-timeout-s) ->
SERVING (ready file written; scale requests taken) -> DRAINING (on SIGTERM/SIGINT or a failed start-up:
Shutdown broadcast, ranks stopped, actors and placement groups released, Ray stopped if it was started here) ->
STOPPED. A second signal kills the ranks and exits at once.

Publishing (PUB): KvDelta (the prefix-cache index's changes, kv_index.py) every tick that has some; Topology on
every change and every 2 s; LoadSnapshot at most every 100 ms when some engine's
load or the wave state changed and every 1 s otherwise (a heartbeat for frontends); FrontendGone when a frontend
unregisters or is silent for 5 s; StartWave when a frontend or engine asks for one (dpserve_shared.waves: for
dense models the wave is bookkeeping, it completes when every rank's load says it stopped stepping). What is
published is counted (`PublishCounts`: messages and bytes, by message type; one copy, before ZMQ's fan-out to
every subscriber) and shown in the coordinator's own /status.json (`--status-port`), for `dpserve bench routing`.

Expert parallelism (--enable-expert-parallel): once every rank of the start-up has registered, each engine gets
ExpertGroup on the control socket (rank 0's node address, a port picked here, the world size, its rank) and the
ranks form their torch.distributed group; waves are lock-step (LockstepCoordinatorWaves): one ends only when
rank 0 sends WaveComplete. A scale step re-forms the group with the new world size, and a dead rank's replacement
re-forms it with the same ranks (expert_groups.py: ExpertGroup of a later generation, ExpertGroupJoined back).

Rank supervision (start, watch, restart) is supervisor.py's; scaling (ScaleRequest from `dpserve scale`) is
scaling.py's, one step at a time, once the coordinator is SERVING.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import os
import signal
import threading
import time

import msgspec
import zmq
import zmq.asyncio

from dpserve_shared.codec import coordinator_decoder
from dpserve_shared.envelope import DeploymentGuard, frames
from dpserve_shared.net import has_input
from dpserve_shared.schema import (
    EngineState,
    EngineStats,
    ExpertGroupBroken,
    ExpertGroupJoined,
    FrontendGone,
    Heartbeat,
    KvEvents,
    KvIndexRequest,
    KvResync,
    LoadSnapshot,
    RegisterAck,
    RegisterEngine,
    RegisterFrontend,
    RoutedRequests,
    ScaleRequest,
    Shutdown,
    StartWaveRequest,
    Unregister,
    WaveComplete,
)
from dpserve_shared.waves import CoordinatorWaves, LockstepCoordinatorWaves

from dpserve_coordinator.expert_groups import ExpertGroups, FormationFailed
from dpserve_coordinator.kv_index import KvIndex
from dpserve_coordinator.launcher import EngineLauncher, LaunchError
from dpserve_coordinator.registry import Registry, RegistrationRefused
from dpserve_coordinator.reservations import Reservations
from dpserve_coordinator.scaling import Scaler
from dpserve_shared.timing import (
    ENGINE_DRAIN_S,
    LOAD_HEARTBEAT_S,
    LOAD_MIN_INTERVAL_S,
    MODEL_REPUBLISH_S,
    TOPOLOGY_REPUBLISH_S,
)

from dpserve_coordinator.settings import CoordinatorSettings
from dpserve_coordinator.supervisor import RankSupervisor

log = logging.getLogger("dpserve.coordinator")

_SHUTDOWN_DRAIN_S = ENGINE_DRAIN_S  # engines drain this long (dpserve-engine --drain-timeout-s); SIGKILL 2 s later
_KILL_NOW_S = 3.0  # a second signal: this long to kill the engines, then the process exits regardless


_UNBOUND_MESSAGES = (RegisterEngine, RegisterFrontend, ScaleRequest)
# Engines of an earlier coordinator register again within COORDINATOR_SILENCE_S (5 s) of its last broadcast.
_REATTACH_WAIT_S = 10.0  # twice that: a rank whose engine died meanwhile is started anew after it
_LOOK_FOR_ENGINES_S = 1.5  # an engine left running heartbeats every second, to whoever holds the control port
_STALL_S = 0.5  # the publish loop ticks every 20 ms: a longer gap means this process was not running


class StartupFailed(Exception):
    pass


class PublishCounts:
    """Messages and bytes this coordinator published since it started, in total and by message type."""

    def __init__(self):
        self.num_messages = 0
        self.num_bytes = 0
        self.by_type: dict[str, list[int]] = {}  # type name -> [messages, bytes]

    def add(self, msg, parts: list[bytes]) -> None:
        size = sum(len(p) for p in parts)
        self.num_messages += 1
        self.num_bytes += size
        counts = self.by_type.setdefault(type(msg).__name__, [0, 0])
        counts[0] += 1
        counts[1] += size

    def as_dict(self) -> dict:
        return {"messages": self.num_messages, "bytes": self.num_bytes,
                "by_type": {name: {"messages": m, "bytes": b} for name, (m, b) in sorted(self.by_type.items())}}


class CoordinatorState(enum.Enum):
    STARTING = "starting"  # sockets bound, ranks being started; scale requests refused
    SERVING = "serving"  # every rank of the start-up registered; scale requests taken
    DRAINING = "draining"  # stopping: Shutdown broadcast, ranks stopped, Ray released
    STOPPED = "stopped"  # sockets closed


class Coordinator:
    def __init__(self, settings: CoordinatorSettings, launcher: EngineLauncher | None = None):
        self.settings = settings
        self.state = CoordinatorState.STARTING
        self.registry = Registry(
            settings.data_parallel_size,
            engine_timeout_s=settings.engine_timeout_s,
            frontend_timeout_s=settings.frontend_timeout_s,
            stall_timeout_s=settings.engine_stall_timeout_s,
        )
        self.supervisor = RankSupervisor(self.registry, settings, launcher)  # the backend's launcher when None
        self.waves = LockstepCoordinatorWaves() if settings.enable_expert_parallel else CoordinatorWaves()
        # --enable-expert-parallel: the group's formations (the first, scale steps', repairs)
        self.expert_groups = (ExpertGroups(self.registry, self.waves, self.reply, self._publish,
                                           settings.data_parallel_address)
                              if settings.enable_expert_parallel else None)  # fmt: skip
        self.scaler = Scaler(self.registry, self.supervisor, self.reply, settings.engine_startup_timeout_s,
                             self.expert_groups)  # fmt: skip
        self.kv_index = KvIndex(index_id=time.time_ns() // 1_000_000)  # a restarted coordinator's is another
        self.reservations = Reservations()  # routed work not yet reported by the engines, on every LoadSnapshot
        self.ctx = zmq.asyncio.Context()
        self.control = self.ctx.socket(zmq.ROUTER)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub_addr = ""
        self.published = PublishCounts()
        self.guard = DeploymentGuard(settings.deployment_id, log, "control socket")
        self._decoder = coordinator_decoder()
        self._stop_requested = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._status_server = None  # --status-port's (status_server.py)
        # Re-attaching to the engines of a coordinator before this one: nothing is published and no frontend is
        # answered until they registered again (a topology with their ranks STARTING would make the frontends drop
        # ranks that serve); frontends meanwhile route on the topology they have.
        self._is_reattaching = False
        self._unknown_engines: set[str] = set()  # engines that heartbeat to this port but never registered here

    # -- lifecycle ----------------------------------------------------------------------------------------------

    async def run(self) -> int:
        """The process: bind, start the ranks, serve until stopped, tear down. Returns the exit code."""
        self._install_signal_handlers()
        try:
            self._bind()
        except StartupFailed as e:
            log.error("%s", e)
            self._close_sockets()
            return 1
        self._tasks = [
            asyncio.create_task(self._control_loop(), name="control"),
            asyncio.create_task(self._publish_loop(), name="publish"),
        ]
        code = 0
        try:
            await self._start_status_server()
            await self._start_ranks()
            await self._stop_requested.wait()
        except (StartupFailed, LaunchError) as e:
            log.error("%s", e)
            code = 1
        finally:
            await self._shut_down()
        return code

    def stop(self, drain: bool = True) -> None:
        """Ask the coordinator to stop; idempotent, and callable from a signal handler. run() then does the
        teardown (_shut_down). drain=False (a second signal) also kills every rank at once."""
        if not drain:
            self.supervisor.kill_now()
        if self.state in (CoordinatorState.STARTING, CoordinatorState.SERVING):
            self.state = CoordinatorState.DRAINING
            self.scaler.close()
            if self.expert_groups is not None:
                self.expert_groups.close()
            self.supervisor.stop_restarts()
            self._stop_requested.set()

    def _bind(self) -> None:
        self.settings.zmq_security.server(self.control, "control socket")
        self.settings.zmq_security.server(self.pub, "broadcast socket")
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a peer reconnecting under its id takes it over (not refused)
        try:
            self.control.bind(self.settings.control_addr)
        except zmq.ZMQError as e:
            raise StartupFailed(
                f"cannot bind the control socket {self.settings.control_addr}: {e} "
                "(another coordinator running? choose another --data-parallel-rpc-port)"
            ) from None
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port(f"tcp://{self.settings.data_parallel_address}")
        self.pub_addr = f"tcp://{self.settings.data_parallel_address}:{port}"
        log.info("deployment %s: control socket %s, broadcast %s", self.settings.deployment_id,
                 self.settings.control_addr, self.pub_addr)

    async def _start_status_server(self) -> None:
        if self.settings.status_port is None:
            return
        from dpserve_coordinator.status_server import StatusServer  # aiohttp: only with --status-port

        server = StatusServer(self, self.settings.data_parallel_address, self.settings.status_port,
                              self.settings.api_key)  # fmt: skip
        try:
            await server.start()
        except OSError as e:
            raise StartupFailed(f"cannot serve the status page on --status-port {self.settings.status_port}: {e}")
        self._status_server = server

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        if self.state in (CoordinatorState.STARTING, CoordinatorState.SERVING):
            log.info("%s: shutting down (send it again to stop at once)", signal.Signals(sig).name)
            self.stop(drain=True)
        else:
            log.warning("second signal: killing engines now")
            # Ray's calls may block (a drain's own calls are under way): bounded, then exit whatever is left
            killer = threading.Thread(target=self.supervisor.kill_now, name="kill-now", daemon=True)
            killer.start()
            killer.join(_KILL_NOW_S)
            if killer.is_alive():
                log.warning("the engines' teardown took over %.0f s: exiting without it", _KILL_NOW_S)
            logging.shutdown()
            os._exit(1)

    async def _start_ranks(self) -> None:
        """STARTING -> SERVING: start every rank, wait until each registered, write the ready file."""
        settings = self.settings
        started = time.monotonic()
        await self.supervisor.connect()
        self._install_signal_handlers()  # again: ray.init installs its own SIGTERM handler
        ranks = list(range(settings.data_parallel_size))
        adopted = await self._reattach(ranks)
        for rank in ranks:
            if rank not in adopted:
                self.registry.engine_starting(rank)
        for rank in ranks:
            if self.state is not CoordinatorState.STARTING:
                return  # a stop came during ray.init or an earlier rank's launch: start nothing more
            if rank not in adopted:
                await self.supervisor.start(rank)
        deadline = started + settings.engine_startup_timeout_s
        missing = await self._unless_stopped(self.supervisor.wait_ready(ranks, deadline, fail_fast=True))
        if missing is None or self.state is not CoordinatorState.STARTING:
            return  # stopped while starting
        if missing.dead:
            rank, reason = next(iter(missing.dead.items()))
            raise StartupFailed(f"rank {rank} failed to start: {reason}")
        if missing.late:
            raise StartupFailed(
                f"ranks {missing.late} did not register within --engine-startup-timeout-s "
                f"{settings.engine_startup_timeout_s:.0f} s ({self.supervisor.describe(missing.late)})"
            )
        log.info("all %d ranks ready in %.1f s", len(ranks), time.monotonic() - started)
        if settings.enable_expert_parallel:
            await self._form_expert_group(ranks, adopted)
        self._write_ready_file()
        self.state = CoordinatorState.SERVING
        self.scaler.open()
        if self.expert_groups is not None:
            self._tasks.append(asyncio.create_task(self.expert_groups.watch(), name="expert-group-repair"))

    async def _form_expert_group(self, ranks: list[int], adopted: set[int]) -> None:
        """The first formation (expert_groups.py): ExpertGroup to every rank (rank 0's node, a port free there:
        picked here; rank 0's node is this one unless Ray placed it elsewhere, where the port is only likely free),
        done when each joined. Engines re-attached from a coordinator before this one are in their group already:
        nothing is sent, and a later formation counts on from a generation surely newer than theirs (a rank
        started anew beside them waits for one: the repair re-forms the group when every rank serves)."""
        if adopted:
            log.info("expert-parallel group: re-attached ranks %s are in theirs already", sorted(adopted))
            self.expert_groups.adopt(sorted(adopted))
            return
        try:
            await self.expert_groups.form(ranks)
        except FormationFailed as e:
            raise StartupFailed(str(e)) from None

    async def _reattach(self, ranks: list[int]) -> set[int]:
        """The ranks whose engines outlived a coordinator before this one, watched again: the ray backend's named
        actors (found by the launcher), and the mp engines that heartbeat to this port and register again by
        themselves. --reattach-wait-s 0 does not look (a first start). Nothing is published meanwhile."""
        found = self.supervisor.adopt_found()
        wait_s = self.settings.reattach_wait_s
        if wait_s is None:  # find out: ray's actors are found; mp engines left running heartbeat to this port
            left_running = found or await self._engines_heartbeating()
            wait_s = _REATTACH_WAIT_S if left_running else 0.0
        if wait_s <= 0:
            return set()
        started = time.monotonic()
        expected = set(found) or set(ranks)
        log.info("re-attaching: %s; waiting up to %.0f s for their engines to register again",
                 f"engine actors of ranks {sorted(found)} found" if found else "engines left running",
                 wait_s)  # fmt: skip
        self._is_reattaching = True
        try:
            while time.monotonic() - started < wait_s and self.state is CoordinatorState.STARTING:
                if expected <= set(self.registry.ready_ranks()):
                    break
                await asyncio.sleep(0.1)
        finally:
            self._is_reattaching = False
        registered = self.registry.ready_ranks()
        for rank in registered:
            self.supervisor.adopt_registered(rank)
        if registered and max(registered) + 1 > self.registry.data_parallel_size:  # it had been scaled up
            self.registry.set_target(max(registered) + 1)
        adopted = set(found) | set(registered)
        log.info("re-attached %d rank(s) %s in %.1f s%s", len(registered), registered, time.monotonic() - started,
                 f"; still waiting for {sorted(set(found) - set(registered))}" if set(found) - set(registered)
                 else "")  # fmt: skip
        return adopted

    async def _engines_heartbeating(self) -> bool:
        """mp: whether engines of this deployment that are not registered here heartbeat to the control port (a
        coordinator before this one left them running); they do every second."""
        if self.settings.data_parallel_backend != "mp":
            return False
        deadline = time.monotonic() + _LOOK_FOR_ENGINES_S
        while not self._unknown_engines and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return bool(self._unknown_engines)

    async def _unless_stopped(self, coro):
        """Await `coro` unless a stop is requested first (then it is cancelled and None returned)."""
        task = asyncio.ensure_future(coro)
        stop = asyncio.ensure_future(self._stop_requested.wait())
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        for pending in (task, stop):
            pending.cancel()
        await asyncio.gather(task, stop, return_exceptions=True)
        return None if task.cancelled() else task.result()

    def _write_ready_file(self) -> None:
        if not self.settings.ready_file:
            return
        tmp = self.settings.ready_file + ".tmp"
        ready = {
            "control_addr": self.settings.control_addr,
            "pub_addr": self.pub_addr,
            "engines": [
                {"rank": e.rank, "input_addr": e.input_addr, "state": e.state.value, "pid": e.pid,
                 "node_ip": e.node_ip}
                for e in self.registry.topology().engines
            ],
        }
        with open(tmp, "w") as f:
            json.dump(ready, f)
        os.replace(tmp, self.settings.ready_file)

    async def _shut_down(self) -> None:
        """DRAINING -> STOPPED, once (run's last step): Shutdown broadcast, ranks stopped, actors/groups/Ray
        released, sockets closed."""
        self.stop(drain=True)  # a failed start-up gets here without a stop request
        await self.scaler.wait_closed()
        log.info("broadcasting Shutdown")
        try:
            await self.pub.send_multipart(
                frames(self.settings.deployment_id, Shutdown(drain=True, reason="coordinator shutting down"))
            )
        except zmq.ZMQError:
            pass
        await self.supervisor.close(_SHUTDOWN_DRAIN_S + 2.0)
        if self._status_server is not None:
            await self._status_server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._close_sockets()
        log.info("coordinator stopped")

    def _close_sockets(self) -> None:
        self.state = CoordinatorState.STOPPED
        self.control.close(0)
        self.pub.close(0)
        self.ctx.term()

    async def reply(self, identity: str, msg) -> None:
        """Send one message to one DEALER on the control socket (dropped by ZMQ if it is gone)."""
        await self.control.send_multipart([identity.encode(), *frames(self.settings.deployment_id, msg)])

    # -- control socket -----------------------------------------------------------------------------------------

    async def _control_loop(self) -> None:
        while self.state is not CoordinatorState.STOPPED:
            identity, *parts = await self.control.recv_multipart()
            # A peer started by hand registers before it knows the id; every other message must carry ours.
            msg = self.guard.open(parts, self._decoder, f"message from {identity!r}", unbound_ok=_UNBOUND_MESSAGES)
            if msg is None:
                continue
            reply = self._handle(identity.decode(errors="replace"), msg, time.monotonic())
            if reply is not None:
                await self.control.send_multipart([identity, *frames(self.settings.deployment_id, reply)])

    def _handle(self, sender: str, msg, now_s: float):
        registry = self.registry
        if isinstance(msg, Heartbeat):
            known = registry.heartbeat(msg.sender_id or sender, now_s, msg.stats)
            if not known and msg.sender_id.startswith("engine-"):
                self._unknown_engines.add(msg.sender_id)
        elif isinstance(msg, EngineStats):
            registry.update_load(sender, msg.load, now_s)
            engine = registry.engine_by_id(sender)
            if engine is not None and msg.received:
                self.reservations.on_received(engine.rank, sender, msg.received)
            self._follow_waves()
        elif isinstance(msg, RoutedRequests):
            self.reservations.on_sent(msg.frontend_id or sender, msg.sent)
        elif isinstance(msg, RegisterEngine):
            try:
                rank = registry.register_engine(msg, now_s)
            except RegistrationRefused as e:
                log.error("refused engine %s (pid %d): %s", msg.engine_id, msg.pid, e)
                return RegisterAck(accepted=False, error=str(e))
            log.info("engine %s registered as rank %d at %s (pid %d)", msg.engine_id, rank, msg.input_addr, msg.pid)
            return RegisterAck(accepted=True, rank=rank, pub_addr=self.pub_addr, topology=registry.topology())
        elif isinstance(msg, RegisterFrontend):
            if self._is_reattaching:
                return None  # it asks again; until then it routes on the topology it has
            is_new = msg.frontend_id not in registry.frontends
            try:
                registry.register_frontend(msg, now_s)
            except RegistrationRefused as e:
                log.error("refused frontend %s: %s", msg.frontend_id, e)
                return RegisterAck(accepted=False, error=str(e))
            if is_new:
                log.info("frontend %s registered (pid %d, %s)", msg.frontend_id, msg.pid, msg.http_addr)
            return RegisterAck(accepted=True, pub_addr=self.pub_addr, topology=registry.topology())
        elif isinstance(msg, Unregister):
            sender_id = msg.sender_id
            if registry.drop_frontend(sender_id):
                log.info("frontend %s unregistered", sender_id)
                self.reservations.drop_frontend(sender_id)
                self._publish(FrontendGone(sender_id))
            else:
                engine = registry.engine_by_id(sender_id)
                if engine is not None and registry.mark_dead(engine.rank, f"unregistered: {msg.reason}"):
                    log.info("rank %d unregistered", engine.rank)
        elif isinstance(msg, WaveComplete):
            engine = registry.engine_by_id(sender)
            if engine is not None and engine.rank == 0 and self.waves.on_wave_complete(msg.wave):
                log.debug("wave %d complete: the engines paused", msg.wave)
        elif isinstance(msg, StartWaveRequest):
            start = self.waves.on_start_request(msg)
            if start is not None:
                self._publish(start)
        elif isinstance(msg, ExpertGroupJoined):
            if self.expert_groups is not None:
                self.expert_groups.on_joined(sender, msg)
        elif isinstance(msg, ExpertGroupBroken):
            if self.expert_groups is not None:
                self.expert_groups.on_broken(sender, msg)
        elif isinstance(msg, ScaleRequest):
            return self.scaler.request(sender, msg, self.pub_addr)
        elif isinstance(msg, KvEvents):
            engine = registry.engine_by_id(sender)
            if (engine is not None and engine.state in (EngineState.READY, EngineState.DRAINING)
                    and self.kv_index.on_events(engine.rank, sender, msg, now_s)):
                return KvResync()
        elif isinstance(msg, KvIndexRequest):
            self._publish_kv_delta()  # the snapshot is as of the last delta: nothing may be in neither
            return self.kv_index.snapshot()
        return None

    def _follow_waves(self) -> None:
        """Dense models: a wave completes when every serving rank has stopped stepping."""
        loads = [self.registry.engines[r].load for r in self.registry.ready_ranks()]
        self.waves.on_loads([load.is_running for load in loads if load is not None])

    # -- broadcast ----------------------------------------------------------------------------------------------

    def _publish(self, msg) -> None:
        parts = frames(self.settings.deployment_id, msg)
        try:
            self.pub.send_multipart(parts, flags=zmq.NOBLOCK)
            self.published.add(msg, parts)
        except zmq.Again:
            log.warning("broadcast queue full; dropped %s", type(msg).__name__)

    def _publish_kv_delta(self) -> None:
        delta = self.kv_index.take_delta()
        if delta is not None:
            self._publish(delta)

    def _load_state(self) -> tuple[int, int, bool]:
        """What a LoadSnapshot carries, as a version: the registry's loads, the reservations and the wave state."""
        return self.registry.load_version, self.reservations.version, self.waves.wave, self.waves.running

    def _load_snapshot(self) -> LoadSnapshot:
        snapshot = self.registry.load_snapshot(self.waves.wave, self.waves.running, time.time())
        reservations = self.reservations
        snapshot.loads = [
            msgspec.structs.replace(load, num_reserved=requests, num_reserved_tokens=tokens)
            if (requests, tokens) != (0, 0) else load
            for load in snapshot.loads
            for requests, tokens in [reservations.reserved(load.rank)]
        ]  # fmt: skip
        return snapshot

    async def _publish_loop(self) -> None:
        last_topology = last_load = last_model = 0.0
        published_epoch = -1
        published_load = (-1, -1, -1, False)
        last_tick = time.monotonic()
        while self.state is not CoordinatorState.STOPPED:
            now = time.monotonic()
            if now - last_tick > _STALL_S:
                # This process did not run (an overloaded machine): its peers' silence meanwhile is its own
                self.registry.forgive(now - last_tick)
            last_tick = now
            if has_input(self.control):
                gone, dead = [], []  # messages wait to be read (heartbeats among them): judge silence after
            else:
                gone, dead = self.registry.expire(now)
            for frontend_id in gone:
                log.warning("frontend %s silent for %.0f s: dropped", frontend_id, self.settings.frontend_timeout_s)
                self._publish(FrontendGone(frontend_id))
                self.reservations.drop_frontend(frontend_id)
            for rank in dead:
                log.error("rank %d: DEAD (%s)", rank, self.registry.engines[rank].dead_reason)
                if self.supervisor.is_watching(rank):  # silent or stuck, its process still there: kill, replace
                    self._tasks.append(asyncio.create_task(self.supervisor.kill(rank), name=f"kill-{rank}"))
            if self._is_reattaching:
                await asyncio.sleep(0.02)
                continue
            if self.registry.epoch != published_epoch:
                serving = self.registry.serving_engines()
                self.kv_index.follow(serving)  # dead, replaced, removed: blocks gone
                self.reservations.follow(serving)
            self._publish_kv_delta()
            if self.registry.epoch != published_epoch or now - last_topology >= TOPOLOGY_REPUBLISH_S:
                topology = self.registry.topology()
                # The model (its tokenizer is MBs, once per subscriber) goes with a change and every
                # MODEL_REPUBLISH_S; a plain republish (lost messages, late subscribers) leaves it out.
                if self.registry.epoch != published_epoch or now - last_model >= MODEL_REPUBLISH_S:
                    last_model = now
                else:
                    topology.model = None
                self._publish(topology)
                published_epoch = self.registry.epoch
                last_topology = now
            changed = self._load_state() != published_load
            if (changed and now - last_load >= LOAD_MIN_INTERVAL_S) or now - last_load >= LOAD_HEARTBEAT_S:
                self._publish(self._load_snapshot())
                published_load = self._load_state()
                last_load = now
            await asyncio.sleep(0.02)
