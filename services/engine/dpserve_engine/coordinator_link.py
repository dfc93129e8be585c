"""The engine's link to the coordinator (the twin of the frontend's coordinator_client.py).

- control: a DEALER (identity = engine id) to the coordinator's ROUTER. `RegisterEngine` -> `RegisterAck` (the
  rank, the broadcast address, the topology); then `EngineStats` when the load changed (at most every 50 ms, and
  with the cumulative counters every 1 s), `StartWaveRequest` when a request finds the engines paused, and
  `Unregister` on exit; `WaveComplete` (rank 0 of an expert-parallel deployment); `KvEvents` (what the prefix cache stored and evicted, numbered) after a step that changed
  it, and a snapshot of it when the coordinator asks (`KvResync`). The coordinator sends `Shutdown` here
  (scale-down) and, to an expert-parallel deployment once every rank registered, `ExpertGroup`.
- broadcast: a SUB to the coordinator's PUB (`Topology`, `LoadSnapshot`, `StartWave`, `FrontendGone`, `Shutdown`).
- heartbeats: `Heartbeat` every 1 s from a thread with a DEALER of its own, so that a long step (a big prefill
  on a starved CPU can take longer than the coordinator's 5 s engine timeout) never makes a live rank look dead.

Re-registration: when the broadcast has been silent for 5 s the coordinator may have restarted, so
`RegisterEngine` is sent again (same id and rank) and the broadcast of the new ack's `pub_addr` followed. An
engine started for a deployment (--deployment-id) whose broadcast has been silent for --register-timeout-s is
told to exit. Control and broadcast messages travel in the deployment's envelope (dpserve_shared/envelope.py):
another deployment's are dropped, logged once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import msgspec
import zmq

from dpserve_shared.codec import from_coordinator_decoder
from dpserve_shared.envelope import DeploymentGuard, frames
from dpserve_shared.schema import (
    EngineLoad,
    EngineStats,
    ExpertGroup,
    FrontendCount,
    Heartbeat,
    KvEvents,
    KvResync,
    RegisterAck,
    RegisterEngine,
    Shutdown,
    Unregister,
)

from dpserve_shared.timing import (  # noqa: F401 - the protocol's intervals (tests patch them here)
    COORDINATOR_SILENCE_S,
    COUNTERS_INTERVAL_S,
    HEARTBEAT_INTERVAL_S,
    STATS_MIN_INTERVAL_S,
)

from dpserve_engine.settings import ServiceSettings

log = logging.getLogger("dpserve.engine")

REGISTER_POLL_MS = 5000  # "still waiting for the coordinator" this often


class RegistrationFailed(Exception):
    pass


def _load_key(load: EngineLoad) -> tuple:
    """The parts of the load that routing uses (the counters change every step)."""
    return (load.num_waiting, load.num_running, load.kv_blocks_used, load.num_waiting_tokens, load.is_running)


class CoordinatorLink:
    def __init__(self, ctx: zmq.Context, settings: ServiceSettings):
        self._ctx = ctx
        self._settings = settings
        self.rank = settings.rank  # the coordinator's once registered
        self.engine_id = f"engine-{uuid.uuid4().hex[:12]}"
        self.control = ctx.socket(zmq.DEALER)
        self.broadcast = ctx.socket(zmq.SUB)
        for sock in (self.control, self.broadcast):
            settings.zmq_security.client(sock)
            sock.setsockopt(zmq.LINGER, 0)
        self.guard = DeploymentGuard(settings.deployment_id, log, "coordinator link")
        self._decoder = from_coordinator_decoder()
        self._registration: RegisterEngine | None = None  # what register() sent; sent again on silence
        self._pub_addr = ""
        self._last_broadcast_s = 0.0
        self._last_register_s = 0.0
        self._last_stats_key: tuple | None = None
        self._last_stats_s = 0.0
        self._last_counters: EngineLoad | None = None
        self.next_counters_s = 0.0  # monotonic: when report() next sends the counters
        self.next_stats_s: float | None = None  # monotonic: when a change held back by the interval is due
        self._kv_seq = 0  # KvEvents sent by this process
        self._heartbeats_stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None

    # -- registration ---------------------------------------------------------------------------------------------

    def register(self, registration: RegisterEngine, should_give_up: Callable[[], bool]) -> RegisterAck:
        """Send `registration` and wait for the accepting RegisterAck (then follow its broadcast). Raises
        RegistrationFailed on a refusal, after --register-timeout-s, or when `should_give_up()`."""
        self._registration = registration
        self.control.setsockopt(zmq.IDENTITY, self.engine_id.encode())
        self.control.connect(self._settings.coordinator_addr)
        self._send_register()
        log.info("registering with the coordinator at %s as rank %s", self._settings.coordinator_addr, self.rank)
        started = time.monotonic()
        while True:
            waited = time.monotonic() - started
            if should_give_up():
                raise RegistrationFailed("stopped while waiting for the coordinator")
            if waited > self._settings.register_timeout_s:
                raise RegistrationFailed(
                    f"no answer from the coordinator at {self._settings.coordinator_addr} after {waited:.0f} s"
                )
            if not self.control.poll(REGISTER_POLL_MS):
                log.info("still waiting for the coordinator at %s (%.0f s; is it running, with this cluster key?)",
                         self._settings.coordinator_addr, waited)
                continue
            ack = self._recv_control()
            if ack is None:
                continue  # another deployment's, or undecodable
            if not isinstance(ack, RegisterAck):
                raise RegistrationFailed(f"expected RegisterAck, got {type(ack).__name__}")
            break
        if not ack.accepted:
            raise RegistrationFailed(f"the coordinator refused this engine: {ack.error}")
        self._accept(ack)
        log.info("registered as rank %d (engine id %s, pid %d)", self.rank, self.engine_id, os.getpid())
        return ack

    def _send_register(self) -> None:
        assert self._registration is not None
        message = msgspec.structs.replace(self._registration, rank=self.rank)
        self.control.send_multipart(frames(self.guard.registration_id, message))

    def _accept(self, ack: RegisterAck) -> None:
        self.rank = ack.rank
        if ack.pub_addr != self._pub_addr:
            if self._pub_addr:
                self.broadcast.disconnect(self._pub_addr)
            self.broadcast.setsockopt(zmq.SUBSCRIBE, b"")
            self.broadcast.connect(ack.pub_addr)
            self._pub_addr = ack.pub_addr
        self._last_broadcast_s = time.monotonic()
        # (registered again:) what was sent to an earlier coordinator may never have reached this one
        self._last_stats_key = None
        self._last_counters = None
        self.next_counters_s = 0.0
        self.next_stats_s = None

    def watch(self, now: float) -> str | None:
        """Register again when the broadcast has been silent for COORDINATOR_SILENCE_S (a restarted coordinator).
        Returns why the engine should exit when its pinned deployment has been silent for --register-timeout-s.
        Call it on a drained broadcast socket: what arrived during a long step counts."""
        silent_s = now - self._last_broadcast_s
        if self.guard.pinned and silent_s > self._settings.register_timeout_s:
            # Its deployment is gone (a coordinator that died without its teardown): nobody routes to this
            # engine, and whoever holds the port now is another deployment, which ignores it. Do not linger.
            return (f"no broadcast from deployment {self.guard.deployment_id} for {silent_s:.0f} s: "
                    "its coordinator is gone; exiting")
        if silent_s < COORDINATOR_SILENCE_S or now - self._last_register_s < COORDINATOR_SILENCE_S:
            return None
        log.warning(
            "no broadcast from the coordinator for %.0f s; registering again at %s",
            silent_s,
            self._settings.coordinator_addr,
        )
        self._last_register_s = now
        self._send_register()
        return None

    # -- messages -------------------------------------------------------------------------------------------------

    def receive(self) -> Iterator:
        """Every queued message, without blocking: from the control socket a `Shutdown` or an accepted
        re-registration's `RegisterAck` (already followed here), then every broadcast. Another deployment's
        messages are dropped; a broadcast of this one's is a sign of life."""
        while self.control.poll(0):
            msg = self._recv_control()
            if isinstance(msg, (Shutdown, KvResync, ExpertGroup)):
                yield msg
            elif isinstance(msg, RegisterAck):
                if msg.accepted:
                    self._accept(msg)
                    log.info("registered again as rank %d", self.rank)
                    yield msg
                else:
                    log.error("the coordinator refused this engine: %s", msg.error)
        while True:
            try:
                parts = self.broadcast.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self.guard.open(parts, self._decoder, "broadcast")
            if msg is None:
                continue  # not this deployment's coordinator: it does not count as a sign of life either
            self._last_broadcast_s = time.monotonic()
            yield msg

    def _recv_control(self):
        """The next control message if it is this deployment's (an unbound engine adopts the id of the coordinator
        that accepts it); None for another deployment's or an undecodable one."""
        return self.guard.open(self.control.recv_multipart(), self._decoder, "control message")

    def send(self, msg, flags: int = 0) -> None:
        """One message to the coordinator on the control socket, in this deployment's envelope."""
        self.control.send_multipart(frames(self.guard.deployment_id, msg), flags)

    @property
    def next_report_s(self) -> float:
        """When `report` next has something to send without a new change (monotonic)."""
        return self.next_counters_s if self.next_stats_s is None else min(self.next_counters_s, self.next_stats_s)

    def report(self, load: EngineLoad, now: float, num_received: int = 0,
               received: Callable[[], list[FrontendCount]] | None = None) -> None:  # fmt: skip
        """EngineStats when requests arrived (at once: the coordinator's reservations of them end with it), when
        the routing-relevant load changed (at most every STATS_MIN_INTERVAL_S; a change held back is due at
        `next_stats_s`, which the service's idle wait honours), and when anything changed, counters included,
        every COUNTERS_INTERVAL_S. `received()`: the requests received per frontend (EngineStats.received),
        `num_received` their total.

        Receipts go at once because every API server counts a rank's reserved requests (routed to it, not yet
        reported received) as its load: a receipt held back 50-150 ms left requests that had already finished
        reserved, and a quick succession of short prefix hits was steered off the rank holding the prefix."""
        self._maybe_send_stats(load, now, num_received, received)
        if now >= self.next_counters_s:
            self._maybe_send_stats(load, now, num_received, received, force_counters=True)
            self.next_counters_s = now + COUNTERS_INTERVAL_S

    def _maybe_send_stats(self, load: EngineLoad, now: float, num_received: int = 0,
                          received: Callable[[], list[FrontendCount]] | None = None,
                          force_counters: bool = False) -> None:  # fmt: skip
        key = (*_load_key(load), num_received)
        changed = key != self._last_stats_key
        if force_counters and not changed:
            changed = self._last_counters is None or load != self._last_counters
        if not changed:
            self.next_stats_s = None  # (a held-back change that went back to what was sent)
            return
        is_receipt = self._last_stats_key is None or num_received != self._last_stats_key[-1]  # requests arrived
        is_due = force_counters or is_receipt
        due_s = self._last_stats_s + STATS_MIN_INTERVAL_S
        if not is_due and now < due_s:
            self.next_stats_s = due_s
            return
        self.send(EngineStats(load, received() if received is not None else []))
        self._last_stats_key = key
        self._last_stats_s = now
        self._last_counters = load
        self.next_stats_s = None

    def send_kv_events(self, stored: list[int], removed: list[int], is_snapshot: bool = False) -> None:
        """The prefix cache's changes (or, `is_snapshot`, every hash it holds), numbered for gap detection."""
        self._kv_seq += 1
        self.send(KvEvents(self._kv_seq, stored, removed, is_snapshot))

    # -- heartbeats -----------------------------------------------------------------------------------------------

    def start_heartbeats(self) -> None:
        """Idempotent (an expert-parallel rank starts them before joining its group)."""
        if self._heartbeat_thread is not None:
            return
        thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        thread.start()
        self._heartbeat_thread = thread

    def _heartbeat_loop(self) -> None:
        """Heartbeat(engine id) every HEARTBEAT_INTERVAL_S on a DEALER of this thread's own."""
        sock = self._ctx.socket(zmq.DEALER)
        self._settings.zmq_security.client(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, f"{self.engine_id}-heartbeat".encode())
        sock.connect(self._settings.coordinator_addr)
        try:
            while not self._heartbeats_stop.wait(HEARTBEAT_INTERVAL_S):
                sock.send_multipart(frames(self.guard.deployment_id, Heartbeat(self.engine_id, time.time())),
                                    zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the context is closing
        finally:
            sock.close(0)

    def close(self) -> None:
        """Stop the heartbeats, say Unregister, close the sockets (the context is the caller's)."""
        self._heartbeats_stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=2 * HEARTBEAT_INTERVAL_S)
        try:
            self.send(Unregister(self.engine_id, "exiting"), zmq.NOBLOCK)  # never wait for an absent coordinator
            time.sleep(0.05)  # let the unregister leave before the socket closes
        except zmq.ZMQError:
            pass
        for sock in (self.control, self.broadcast):
            sock.close(0)
