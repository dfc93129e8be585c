"""The frontend's link to the coordinator (see docs/architecture.md, "Registration and discovery").

- control: a DEALER (identity = frontend id) to the coordinator's ROUTER. `RegisterFrontend` is sent until a
  `RegisterAck` comes back (backoff 0.5 s -> 5 s, progress logged); the ack carries the broadcast address and the
  current `Topology`. Then a `Heartbeat` every second, `StartWaveRequest` when the engines are paused, and
  `Unregister` on exit.
- broadcast: a SUB to the coordinator's PUB, following `Topology`, `LoadSnapshot` and `KvDelta` (the prefix-cache
  index, mirrored in prefix_index.py; out of sync it sends `KvIndexRequest` and the `KvIndexSnapshot` comes back
  on the control socket).
- routing: `RoutedRequests` (what this API server routed to each rank, cumulative) when it changed, at most every
  ROUTED_INTERVAL_S, so the coordinator reserves it on the next LoadSnapshot for every API server to see.

If the coordinator goes silent (no broadcast for `coordinator_silence_s`), the frontend keeps serving with the
last topology and registers again, so a restarted coordinator (new PUB port) is picked up without a restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from dpserve_shared.codec import from_coordinator_decoder
from dpserve_shared.envelope import DeploymentGuard, frames
from dpserve_shared.schema import (
    PROTOCOL_VERSION,
    FrontendStats,
    Heartbeat,
    KvDelta,
    KvIndexRequest,
    KvIndexSnapshot,
    LoadSnapshot,
    RegisterAck,
    RegisterFrontend,
    RoutedRequests,
    StartWaveRequest,
    Topology,
    Unregister,
)

from dpserve_frontend.prefix_index import PrefixIndex
from dpserve_frontend.settings import FrontendSettings

log = logging.getLogger(__name__)

_BACKOFF_START_S = 0.5
_BACKOFF_MAX_S = 5.0
ROUTED_INTERVAL_S = 0.02


class RegistrationRefused(Exception):
    pass


class CoordinatorClient:
    def __init__(
        self,
        settings: FrontendSettings,
        on_topology: Callable[[Topology], None],
        on_snapshot: Callable[[LoadSnapshot], None],
        context: zmq.asyncio.Context | None = None,
        stats: Callable[[], FrontendStats] | None = None,
        prefix_index: PrefixIndex | None = None,
        routed=None,
    ):
        assert settings.coordinator_addr is not None
        self._settings = settings
        self._on_topology = on_topology
        self._on_snapshot = on_snapshot
        self._stats = stats  # this frontend's figures, sent on every heartbeat
        self.prefix_index = prefix_index  # follows KvDelta / KvIndexSnapshot when given
        self._routed = routed  # the EnginePool: routed_version, routed_counts() (RoutedRequests)
        self._context = context or zmq.asyncio.Context.instance()
        self._decoder = from_coordinator_decoder()
        self.guard = DeploymentGuard(settings.deployment_id, log, "coordinator link")
        self._control = self._context.socket(zmq.DEALER)
        settings.zmq_security.client(self._control)
        self._control.setsockopt(zmq.IDENTITY, settings.frontend_id.encode())
        self._control.setsockopt(zmq.LINGER, 1000)
        self._control.connect(settings.coordinator_addr)
        self._sub: zmq.asyncio.Socket | None = None
        self._pub_addr = ""
        self._tasks: list[asyncio.Task] = []
        self._last_broadcast_s = time.monotonic()  # also reset by a registration attempt (the silence check)
        self.last_heard_s: float | None = None  # monotonic time of the last broadcast or ack; None: never
        self._acked = asyncio.Event()
        self.is_registered = False
        # Set by the first broadcast received: from then on no topology change can be missed (a change made
        # between the ack and the SUB's connect is only seen with the next broadcast).
        self.follows_broadcasts = asyncio.Event()

    async def register(self) -> RegisterAck:
        """Send RegisterFrontend until the coordinator acks; apply the topology it sends."""
        addr = self._settings.coordinator_addr
        backoff_s, attempt, started = _BACKOFF_START_S, 0, time.monotonic()
        while True:
            attempt += 1
            await self._send_register()
            ack = await self._wait_for_ack(backoff_s)
            if ack is not None:
                break
            waited = time.monotonic() - started
            if self._settings.register_timeout_s and waited > self._settings.register_timeout_s:
                raise TimeoutError(f"the coordinator at {addr} did not answer within {waited:.0f} s")
            if attempt == 1 or attempt % 5 == 0:
                log.info("waiting for the coordinator at %s (attempt %d, %.0f s)", addr, attempt, waited)
            backoff_s = min(backoff_s * 2, _BACKOFF_MAX_S)
        if not ack.accepted:
            raise RegistrationRefused(f"the coordinator at {addr} refused this frontend: {ack.error}")
        self._handle_ack(ack)
        log.info("registered with the coordinator at %s as %s", addr, self._settings.frontend_id)
        return ack

    async def _wait_for_ack(self, timeout_s: float) -> RegisterAck | None:
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            if not await self._control.poll(int(remaining * 1000) + 1):
                return None
            message = await self._recv_control()
            if isinstance(message, RegisterAck):
                return message
            self._handle(message)
        return None

    def _handle_ack(self, ack: RegisterAck) -> None:
        self.is_registered = True
        self.last_heard_s = time.monotonic()
        if ack.pub_addr:
            self._pub_addr = ack.pub_addr  # the broadcast loop (re)connects its SUB
        self._last_broadcast_s = time.monotonic()
        if ack.topology is not None:
            self._on_topology(ack.topology)

    def start(self) -> None:
        """Background tasks: control replies, broadcasts, heartbeats. Call after `register()`."""
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._supervised(self._control_loop), name="coordinator-control"),
            loop.create_task(self._supervised(self._broadcast_loop), name="coordinator-broadcast"),
            loop.create_task(self._supervised(self._heartbeat_loop), name="coordinator-heartbeat"),
        ]
        if self._routed is not None:
            self._tasks.append(loop.create_task(self._supervised(self._routed_loop), name="coordinator-routed"))
        self._resync_prefix_index()

    @staticmethod
    async def _supervised(loop_fn) -> None:
        """Runs a loop forever: an unexpected error is logged and the loop restarted, never silently lost."""
        while True:
            try:
                await loop_fn()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s failed; restarting it", loop_fn.__name__)
                await asyncio.sleep(1.0)

    def is_away(self) -> bool:
        """No broadcast (or ack) for COORDINATOR_SILENCE_S: it is gone or restarting."""
        heard = self.last_heard_s
        return heard is None or time.monotonic() - heard > self._settings.coordinator_silence_s

    def request_start_wave(self, request: StartWaveRequest) -> None:
        self._control.send_multipart(frames(self.guard.deployment_id, request))

    async def _send_register(self) -> None:
        message = RegisterFrontend(
            PROTOCOL_VERSION, self._settings.frontend_id, pid=os.getpid(),
            http_addr=f"{self._settings.host}:{self._settings.port}",
        )
        await self._control.send_multipart(frames(self.guard.registration_id, message))

    def _open(self, parts: list[bytes]):
        """The message if it is this deployment's (an unbound frontend adopts the id of the coordinator that
        accepts it); None for another deployment's or an undecodable one."""
        return self.guard.open(parts, self._decoder)

    async def _recv_control(self):
        return self._open(await self._control.recv_multipart())

    def _handle(self, message) -> None:
        if isinstance(message, LoadSnapshot):
            self._on_snapshot(message)
        elif isinstance(message, Topology):
            self._on_topology(message)
        elif isinstance(message, KvDelta):
            if self.prefix_index is not None:
                self.prefix_index.on_delta(message)
                self._resync_prefix_index()
        elif isinstance(message, KvIndexSnapshot):
            if self.prefix_index is not None:
                self.prefix_index.on_snapshot(message)
                self._resync_prefix_index()  # deltas kept meanwhile may have had a gap
        elif isinstance(message, RegisterAck):
            if message.accepted:
                self._handle_ack(message)
                if self.prefix_index is not None:
                    # (registered again:) a restarted coordinator's deltas may have gone out before this API
                    # server followed its broadcasts, and they come only when a cache changes: take its index now
                    self.prefix_index.lose_sync()
                    self._resync_prefix_index()
            else:
                log.error("the coordinator refused this frontend: %s", message.error)
        # StartWave, Shutdown and FrontendGone are meant for engines.

    def _resync_prefix_index(self) -> None:
        """Ask for the index's snapshot when the mirror is out of sync (at most every second)."""
        if self.prefix_index is not None and self.prefix_index.wants_snapshot(time.monotonic()):
            self._control.send_multipart(frames(self.guard.deployment_id, KvIndexRequest(self._settings.frontend_id)))

    async def _control_loop(self) -> None:
        while True:
            message = await self._recv_control()
            if message is not None:
                self._handle(message)

    async def _broadcast_loop(self) -> None:
        sub_addr = ""
        while True:
            if self._pub_addr != sub_addr:  # first registration, or a restarted coordinator's new PUB
                if self._sub is not None:
                    self._sub.close(linger=0)
                self._sub = self._context.socket(zmq.SUB)
                self._settings.zmq_security.client(self._sub)
                self._sub.setsockopt(zmq.SUBSCRIBE, b"")
                self._sub.setsockopt(zmq.LINGER, 0)
                self._sub.connect(self._pub_addr)
                sub_addr = self._pub_addr
                log.info("following the coordinator's broadcasts at %s", sub_addr)
            sub = self._sub
            if not await sub.poll(200):
                continue
            messages = [self._open(await sub.recv_multipart())]
            while await sub.poll(0):
                messages.append(self._open(await sub.recv_multipart()))
            if all(m is None for m in messages):
                continue  # another deployment's broadcast: not a sign of life of ours
            self._last_broadcast_s = self.last_heard_s = time.monotonic()
            self.follows_broadcasts.set()
            # A burst of snapshots: only the newest matters.
            snapshots = [m for m in messages if isinstance(m, LoadSnapshot)]
            for message in messages:
                if message is not None and not isinstance(message, LoadSnapshot):
                    self._handle(message)
            if snapshots:
                self._on_snapshot(snapshots[-1])

    async def _routed_loop(self) -> None:
        sent_version = 0
        while True:
            await asyncio.sleep(ROUTED_INTERVAL_S)
            version = self._routed.routed_version
            if version != sent_version:
                sent_version = version
                message = RoutedRequests(self._settings.frontend_id, self._routed.routed_counts())
                await self._control.send_multipart(frames(self.guard.deployment_id, message))

    async def _heartbeat_loop(self) -> None:
        interval_s = self._settings.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval_s)
            stats = self._stats() if self._stats is not None else None
            await self._control.send_multipart(
                frames(self.guard.deployment_id, Heartbeat(self._settings.frontend_id, time.time(), stats))
            )
            self._resync_prefix_index()  # just started, or an answer lost
            silent_s = time.monotonic() - self._last_broadcast_s
            if silent_s > self._settings.coordinator_silence_s:
                log.warning("no broadcast from the coordinator for %.0f s; registering again", silent_s)
                self._last_broadcast_s = time.monotonic()
                await self._send_register()

    async def close(self, reason: str = "shutdown") -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            if self.is_registered:
                await asyncio.wait_for(
                    self._control.send_multipart(
                        frames(self.guard.deployment_id, Unregister(self._settings.frontend_id, reason))
                    ),
                    timeout=1.0,
                )
        except (TimeoutError, zmq.ZMQError) as e:
            log.warning("could not unregister from the coordinator: %s", e)
        self._control.close(linger=1000)
        if self._sub is not None:
            self._sub.close(linger=0)
