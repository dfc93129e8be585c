"""The coordinator process: control ROUTER + broadcast PUB around the registry, and the engines' launcher.

Lifecycle: bind sockets -> start every rank (launcher) -> wait for every rank to register (progress per rank,
a timeout that names the missing ranks) -> serve -> on SIGTERM/SIGINT: broadcast Shutdown, stop the engines,
release the actors and placement groups, stop Ray if it was started here. A second signal kills at once.

Publishing (PUB): Topology on every change and every 2 s; LoadSnapshot at most every 100 ms when some engine's
load changed and every 1 s otherwise (a heartbeat for frontends); FrontendGone when a frontend unregisters or is
silent for 5 s; StartWave when a frontend or engine asks for one (waves.py: for dense models the wave is
bookkeeping, it completes when every rank's load says it stopped stepping).

Scaling (ScaleRequest on the control socket, from `dpserve scale`): scaling.py adds or removes ranks at runtime,
one step at a time, once every rank of the start-up is ready.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time

import zmq
import zmq.asyncio

from dpserve_shared.codec import coordinator_decoder
from dpserve_shared.envelope import DeploymentGuard, frames
from dpserve_shared.schema import (
    EngineState,
    EngineStats,
    FrontendGone,
    Heartbeat,
    RegisterAck,
    RegisterEngine,
    RegisterFrontend,
    ReleaseRequests,
    ScaleRequest,
    Shutdown,
    StartWave,
    StartWaveRequest,
    Unregister,
    WaveComplete,
)

from dpserve_coordinator.launcher import EngineLauncher, LaunchError, MpLauncher
from dpserve_coordinator.registry import Registry, RegistrationRefused
from dpserve_coordinator.scaling import Scaler
from dpserve_coordinator.settings import CoordinatorSettings
from dpserve_coordinator.waves import CoordinatorWaves

log = logging.getLogger("dpserve.coordinator")

TOPOLOGY_INTERVAL_S = 2.0
LOAD_MIN_INTERVAL_S = 0.1
LOAD_HEARTBEAT_S = 1.0
_SHUTDOWN_DRAIN_S = 5.0  # engines drain for 5 s (dpserve-engine --drain-timeout-s); SIGKILL after 7 s


_UNBOUND_MESSAGES = (RegisterEngine, RegisterFrontend, ScaleRequest)


class StartupFailed(Exception):
    pass


def make_launcher(settings: CoordinatorSettings) -> EngineLauncher:
    if settings.data_parallel_backend == "mp":
        return MpLauncher(settings)
    if settings.ray_address and (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        # Ray 2.60 sends a token to an existing cluster only in token mode, read when ray is imported.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    from dpserve_coordinator.ray_backend import RayLauncher  # the only import of Ray, and only here

    return RayLauncher(settings)


class Coordinator:
    def __init__(self, settings: CoordinatorSettings, launcher: EngineLauncher | None = None):
        self.settings = settings
        self.registry = Registry(
            settings.data_parallel_size,
            engine_timeout_s=settings.engine_timeout_s,
            frontend_timeout_s=settings.frontend_timeout_s,
        )
        self.launcher = launcher
        self.ctx = zmq.asyncio.Context()
        self.control = self.ctx.socket(zmq.ROUTER)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub_addr = ""
        self.waves = CoordinatorWaves()
        self._decoder = coordinator_decoder()
        self.guard = DeploymentGuard(settings.deployment_id, log, "control socket")
        self._stopping = asyncio.Event()
        self._num_signals = 0
        self._published_epoch = -1
        self._published_load_version = -1
        self._restarts: dict[int, int] = {}
        self._tasks: list[asyncio.Task] = []
        self._supervisors: dict[int, asyncio.Task] = {}
        self._rank_changed = asyncio.Event()
        self._is_serving = False
        self.scaler = Scaler(self)

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def bind(self) -> None:
        self.control.setsockopt(zmq.LINGER, 0)
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

    async def run(self) -> int:
        self._install_signal_handlers()
        try:
            self.bind()
        except StartupFailed as e:
            log.error("%s", e)
            return 1
        self._tasks = [
            asyncio.create_task(self._control_loop(), name="control"),
            asyncio.create_task(self._publish_loop(), name="publish"),
        ]
        code = 0
        try:
            await self._start_engines()
            await self._stopping.wait()
        except (StartupFailed, LaunchError) as e:
            log.error("%s", e)
            code = 1
        finally:
            await self.shutdown()
        return code

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        self._num_signals += 1
        if self._num_signals == 1:
            log.info("%s: shutting down (send it again to stop at once)", signal.Signals(sig).name)
            self._stopping.set()
        else:
            log.warning("second signal: killing engines now")
            if self.launcher is not None:
                self.launcher.kill_now()
            os._exit(1)

    async def _start_engines(self) -> None:
        settings = self.settings
        started = time.monotonic()
        if self.launcher is None:
            self.launcher = make_launcher(settings)
        connect = getattr(self.launcher, "connect", None)
        if connect is not None:
            # Ray: init + placement plan, a few seconds. In a thread, so that the control socket keeps answering
            # and ray.init does not replace our SIGTERM handler with its own sys.exit.
            await asyncio.to_thread(connect)
            self._install_signal_handlers()
        ranks = range(settings.data_parallel_size)
        for rank in ranks:
            self.registry.engine_starting(rank)
        for rank in ranks:
            await self.launcher.start(rank)
            self.supervise(rank)
        await self._wait_registered(list(ranks), started)
        self._is_serving = True

    @property
    def is_serving(self) -> bool:
        """Every rank of the start-up registered (scaling is possible from then on)."""
        return self._is_serving

    @property
    def is_stopping(self) -> bool:
        return self._stopping.is_set()

    async def reply(self, identity: str, msg) -> None:
        """Send one message to one DEALER on the control socket (dropped by ZMQ if it is gone)."""
        await self.control.send_multipart([identity.encode(), *frames(self.settings.deployment_id, msg)])

    def supervise(self, rank: int) -> None:
        self._supervisors[rank] = asyncio.create_task(self._supervise(rank), name=f"supervise-{rank}")

    async def forget_supervisor(self, rank: int) -> None:
        """The rank is gone for good (scale-down): stop watching it, and a later rank with its number starts afresh."""
        task = self._supervisors.pop(rank, None)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._restarts.pop(rank, None)

    async def wait_rank_exit(self, rank: int, timeout_s: float) -> bool:
        """Wait until the rank's engine process exited (its supervisor returns) or, for an engine this coordinator
        did not start, until it unregistered; False on timeout."""
        task = self._supervisors.get(rank)
        try:
            if task is not None:
                await asyncio.wait_for(asyncio.shield(task), timeout_s)
                return True
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                entry = self.registry.engines.get(rank)
                if entry is None or entry.state == EngineState.DEAD:
                    return True
                await asyncio.sleep(0.1)
            return False
        except asyncio.TimeoutError:
            return False

    async def _wait_registered(self, ranks: list[int], started: float) -> None:
        deadline = started + self.settings.engine_startup_timeout_s
        reported: set[int] = set()
        while True:
            for rank in ranks:
                entry = self.registry.engines.get(rank)
                if rank not in reported and entry is not None and entry.state == EngineState.READY:
                    reported.add(rank)
                    log.info(
                        "rank %d ready (%d/%d) after %.1f s: %s",
                        rank,
                        len(reported),
                        len(ranks),
                        time.monotonic() - started,
                        entry.input_addr,
                    )
                elif entry is not None and entry.state == EngineState.DEAD:
                    raise StartupFailed(f"rank {rank} failed to start: {entry.dead_reason}")
            if len(reported) == len(ranks):
                break
            if time.monotonic() > deadline:
                missing = [r for r in ranks if r not in reported]
                raise StartupFailed(
                    f"ranks {missing} did not register within --engine-startup-timeout-s "
                    f"{self.settings.engine_startup_timeout_s:.0f} s "
                    f"({'; '.join(self.launcher.describe(r) for r in missing)})"
                )
            self._rank_changed.clear()
            try:
                await asyncio.wait_for(self._rank_changed.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
        log.info("all %d ranks ready in %.1f s", len(ranks), time.monotonic() - started)
        if self.settings.ready_file:
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

    async def _supervise(self, rank: int) -> None:
        """Mark the rank DEAD when its process exits; start a replacement unless shutting down."""
        while True:
            reason = await self.launcher.wait_exit(rank)
            if self._stopping.is_set():
                return
            if rank in self.registry.retiring:  # removed by a scale-down: expected, and not to be restarted
                log.info("rank %d: %s (removed by scale-down)", rank, reason)
                return
            log.error("rank %d: %s", rank, reason)
            self.registry.mark_dead(rank, reason)
            self._rank_changed.set()
            self._restarts[rank] = self._restarts.get(rank, 0) + 1
            if self._restarts[rank] > self.settings.max_engine_restarts:
                log.error("rank %d: not restarting (restarted %d times already)", rank, self._restarts[rank] - 1)
                return
            if not self._ever_ready(rank):
                return  # failed during start-up: _wait_registered reports it
            log.info("rank %d: starting a replacement (restart %d)", rank, self._restarts[rank])
            await asyncio.sleep(1.0)
            if self._stopping.is_set() or rank in self.registry.retiring:
                return
            try:
                await self.launcher.start(rank)
            except Exception as e:  # noqa: BLE001
                log.error("rank %d: replacement failed: %s", rank, e)
                return

    def _ever_ready(self, rank: int) -> bool:
        return bool(self.registry.engines.get(rank) and self.registry.engines[rank].engine_id)

    async def shutdown(self) -> None:
        """Idempotent teardown: Shutdown broadcast, engines stopped, actors/groups/Ray released."""
        if getattr(self, "_shut_down", False):
            return
        self._shut_down = True
        self._stopping.set()
        await self.scaler.cancel()
        log.info("broadcasting Shutdown")
        try:
            await self.pub.send_multipart(
                frames(self.settings.deployment_id, Shutdown(drain=True, reason="coordinator shutting down"))
            )
        except zmq.ZMQError:
            pass
        if self.launcher is not None:
            await self.launcher.close(_SHUTDOWN_DRAIN_S + 2.0)
        tasks = self._tasks + list(self._supervisors.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.control.close(0)
        self.pub.close(0)
        self.ctx.term()
        log.info("coordinator stopped")

    # -- control socket -----------------------------------------------------------------------------------------

    async def _control_loop(self) -> None:
        while True:
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
            registry.heartbeat(msg.sender_id or sender, now_s)
        elif isinstance(msg, EngineStats):
            registry.update_load(sender, msg.load, now_s)
            self._follow_waves()
        elif isinstance(msg, RegisterEngine):
            try:
                rank = registry.register_engine(msg, now_s)
            except RegistrationRefused as e:
                log.error("refused engine %s (pid %d): %s", msg.engine_id, msg.pid, e)
                return RegisterAck(accepted=False, error=str(e))
            log.info("engine %s registered as rank %d at %s (pid %d)", msg.engine_id, rank, msg.input_addr, msg.pid)
            self._rank_changed.set()
            return RegisterAck(accepted=True, rank=rank, pub_addr=self.pub_addr, topology=registry.topology())
        elif isinstance(msg, RegisterFrontend):
            is_new = msg.frontend_id not in registry.frontends
            try:
                registry.register_frontend(msg, now_s)
            except RegistrationRefused as e:
                log.error("refused frontend %s: %s", msg.frontend_id, e)
                return RegisterAck(accepted=False, error=str(e))
            if is_new:
                log.info("frontend %s registered (pid %d, %s)", msg.frontend_id, msg.pid, msg.http_addr)
            return RegisterAck(accepted=True, pub_addr=self.pub_addr, topology=registry.topology())
        elif isinstance(msg, (Unregister, ReleaseRequests)):
            sender_id = msg.sender_id if isinstance(msg, Unregister) else msg.frontend_id
            if registry.drop_frontend(sender_id):
                log.info("frontend %s unregistered", sender_id)
                self._publish(FrontendGone(sender_id))
            else:
                engine = registry.engine_by_id(sender_id)
                reason = msg.reason if isinstance(msg, Unregister) else ""
                if engine is not None and registry.mark_dead(engine.rank, f"unregistered: {reason}"):
                    log.info("rank %d unregistered", engine.rank)
        elif isinstance(msg, StartWaveRequest):
            start = self.waves.on_start_request(msg)
            if start is not None:
                self._publish(start)
                registry.load_version += 1  # the snapshot carries the running state
        elif isinstance(msg, WaveComplete):
            if self.waves.on_wave_complete(msg.wave):
                registry.load_version += 1
        elif isinstance(msg, ScaleRequest):
            return self.scaler.request(sender, msg)
        return None

    def _follow_waves(self) -> None:
        """Dense models: a wave completes when every serving rank has stopped stepping."""
        loads = [self.registry.engines[r].load for r in self.registry.ready_ranks()]
        was = (self.waves.wave, self.waves.running)
        self.waves.on_loads([load.is_running for load in loads if load is not None])
        if (self.waves.wave, self.waves.running) != was:
            self.registry.load_version += 1

    # -- broadcast ----------------------------------------------------------------------------------------------

    def _publish(self, msg) -> None:
        try:
            self.pub.send_multipart(frames(self.settings.deployment_id, msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("broadcast queue full; dropped %s", type(msg).__name__)

    async def _publish_loop(self) -> None:
        last_topology = last_load = 0.0
        while True:
            now = time.monotonic()
            gone, dead = self.registry.expire(now)
            for frontend_id in gone:
                log.warning("frontend %s silent for %.0f s: dropped", frontend_id, self.settings.frontend_timeout_s)
                self._publish(FrontendGone(frontend_id))
            for rank in dead:
                log.error("rank %d missed heartbeats for %.0f s: DEAD", rank, self.settings.engine_timeout_s)
            if self.registry.epoch != self._published_epoch or now - last_topology >= TOPOLOGY_INTERVAL_S:
                self._publish(self.registry.topology())
                self._published_epoch = self.registry.epoch
                last_topology = now
            changed = self.registry.load_version != self._published_load_version
            if (changed and now - last_load >= LOAD_MIN_INTERVAL_S) or now - last_load >= LOAD_HEARTBEAT_S:
                self._publish(self.registry.load_snapshot(self.waves.wave, self.waves.running, time.time()))
                self._published_load_version = self.registry.load_version
                last_load = now
            await asyncio.sleep(0.02)
