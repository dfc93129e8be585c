"""`dpserve-engine`: one data-parallel rank. A thin ZMQ shell around an EngineCore; never imports Ray.

Start-up: load the model (build_engine_core), bind the ROUTER that frontends connect to, register with the
coordinator (RegisterEngine -> RegisterAck with the rank and the broadcast address), subscribe to the broadcast.

The busy loop, one iteration:
  1. poll the sockets: timeout 0 while requests run (never wait on I/O then), else block until the next timer;
  2. take in every queued message: requests (an invalid one is answered with an ERROR output), aborts,
     FrontendGone (abort that frontend's requests), StartWave, Shutdown;
  3. step the core once if it has work;
  4. send one EngineOutputs per frontend that has outputs, each carrying the current load;
  5. timers: EngineStats when the load changed (at most every 50 ms, and every 1 s), parent-pid watch,
     registering again when the coordinator's broadcast has been silent for 5 s (a restarted coordinator), exiting
     when an engine started for a deployment (--deployment-id) has heard nothing from it for --register-timeout-s.
Control and broadcast messages travel in the deployment's envelope (dpserve_shared/envelope.py): another
deployment's (a stray Shutdown from a stopping coordinator that reached this engine) are dropped, logged once.
Heartbeats (every 1 s) come from a thread with a socket of its own, so that a long step (a big prefill on a
starved CPU can take longer than the coordinator's 10 s engine timeout) never makes a live rank look dead.

Exit: the parent died (exit at once), SIGTERM or Shutdown(drain=True) (stop taking requests, let running ones
finish for up to --drain-timeout-s, or the Shutdown's own drain_timeout_s, abort the rest), Shutdown(drain=False)
(abort everything now). A request that arrives once the engine stops taking requests gets no answer: the
frontend re-sends it to another rank when this rank leaves the topology (it has no token yet), which is what
keeps a scale-down that races with a frontend's last send free of failed requests. The ROUTER lingers briefly
on close so that the last outputs leave.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections import defaultdict

import msgspec
import zmq

from dpserve_shared.codec import encode, engine_decoder, from_coordinator_decoder
from dpserve_shared.engine_flags import add_engine_flags
from dpserve_shared.envelope import DEPLOYMENT_ID_ENV, DeploymentGuard, deployment_id_from_env, frames
from dpserve_shared.schema import (
    PROTOCOL_VERSION,
    AbortRequests,
    EngineHello,
    EngineLoad,
    EngineOutputs,
    EngineRequest,
    EngineStats,
    FinishReason,
    FrontendGone,
    Heartbeat,
    LoadSnapshot,
    RegisterAck,
    RegisterEngine,
    RequestOutput,
    Shutdown,
    StartWave,
    Topology,
    Unregister,
)

from dpserve_engine.config import EngineConfig
from dpserve_engine.interface import EngineCoreBase, InvalidRequest
from dpserve_engine.threads import ThreadBudget
from dpserve_shared.waves import EngineWaves

log = logging.getLogger("dpserve.engine")

HEARTBEAT_INTERVAL_S = 1.0
COUNTERS_INTERVAL_S = 1.0  # EngineStats with the cumulative counters at least this often
STATS_MIN_INTERVAL_S = 0.05
PARENT_CHECK_INTERVAL_S = 0.5
IDLE_POLL_MS = 100
MAX_FAILED_STEPS = 3
COORDINATOR_SILENCE_S = 5.0  # the coordinator broadcasts at least every second


@dataclasses.dataclass(frozen=True)
class ServiceSettings:
    coordinator_addr: str
    rank: int = -1  # -1: assigned by the coordinator
    host: str = "127.0.0.1"
    port: int = 0  # 0: a random free port
    register_timeout_s: float = 120.0
    drain_timeout_s: float = 5.0
    adaptive_threads: bool = False  # threads.py: share the node's cores among the ranks that have work
    deployment_id: str = ""  # "": adopt the id of the coordinator that accepts this engine (envelope.py)


# -- CLI ------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser("dpserve-engine", description="One dpserve data-parallel engine rank.")
    parser.add_argument("--coordinator", required=True, help="the coordinator's control address, tcp://HOST:PORT")
    parser.add_argument("--rank", type=int, default=-1, help="data-parallel rank; -1 = assigned by the coordinator")
    parser.add_argument("--host", default="127.0.0.1", help="address the engine socket binds (and advertises)")
    parser.add_argument("--port", type=int, default=0, help="port of the engine socket; 0 = random")
    parser.add_argument("--register-timeout-s", type=float, default=120.0)
    parser.add_argument("--drain-timeout-s", type=float, default=5.0)
    parser.add_argument(
        "--deployment-id", default=deployment_id_from_env(),
        help=f"the deployment this engine belongs to; control and broadcast messages of any other are ignored "
             f"(default: ${DEPLOYMENT_ID_ENV}, else that of the coordinator that accepts it)",
    )
    config = EngineConfig()
    defaults = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    defaults["null_step_time_ms"] = config.null_step_time_s * 1000.0
    add_engine_flags(parser, defaults)
    return parser


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        device=args.device,
        num_threads=args.num_threads,
        dtype=args.dtype,
        quantization=args.quantization,
        enforce_eager=args.enforce_eager,
        null_engine=args.null_engine,
        null_step_time_s=args.null_step_time_ms / 1000.0,
    )


def settings_from_args(args: argparse.Namespace) -> ServiceSettings:
    return ServiceSettings(
        coordinator_addr=args.coordinator,
        rank=args.rank,
        host=args.host,
        port=args.port,
        register_timeout_s=args.register_timeout_s,
        drain_timeout_s=args.drain_timeout_s,
        deployment_id=args.deployment_id,
        adaptive_threads=args.num_threads is None and not args.null_engine and args.device in (None, "cpu"),
    )


def _advertised_host(host: str, coordinator_addr: str) -> str:
    """The address frontends can reach when binding a wildcard: the interface that routes to the coordinator."""
    if host not in ("0.0.0.0", "*", ""):
        return host
    coordinator_host = coordinator_addr.split("://", 1)[-1].rsplit(":", 1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((coordinator_host, 9))
        return s.getsockname()[0]


def _load_key(load: EngineLoad) -> tuple:
    """The parts of the load that routing uses (the counters change every step)."""
    return (load.num_waiting, load.num_running, load.kv_blocks_used, load.num_waiting_tokens, load.is_running)


# -- the service ----------------------------------------------------------------------------------------------------


class RegistrationFailed(Exception):
    pass


class EngineService:
    def __init__(self, settings: ServiceSettings, core: EngineCoreBase):
        self.settings = settings
        self.core = core
        self.rank = settings.rank
        self.engine_id = f"engine-{uuid.uuid4().hex[:12]}"
        self.waves = EngineWaves(rank=settings.rank)
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.control = self.ctx.socket(zmq.DEALER)
        self.sub = self.ctx.socket(zmq.SUB)
        self.input_addr = ""
        self._request_frontend: dict[str, bytes] = {}  # request id -> frontend identity on the ROUTER
        self._known_frontends: set[bytes] = set()
        self._pending: dict[bytes, list[RequestOutput]] = defaultdict(list)
        self._drain_deadline: float | None = None  # set once draining
        self._exit_now = False
        self._num_signals = 0
        self._num_failed_steps = 0
        self._exit_code = 0
        self._pub_addr = ""
        self._last_broadcast_s = 0.0
        self._last_register_s = 0.0
        self._parent_pid = os.getppid()
        self._last_stats_key: tuple | None = None
        self._last_stats_s = 0.0
        self._last_counters: EngineLoad | None = None
        self._to_engine = engine_decoder()
        self._from_coordinator = from_coordinator_decoder()
        self.guard = DeploymentGuard(settings.deployment_id, log, "coordinator link")
        self._heartbeats_stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self.threads = ThreadBudget(settings.adaptive_threads)  # its node_ip is set in bind()

    # -- start-up -----------------------------------------------------------------------------------------------

    def bind(self) -> None:
        for sock in (self.router, self.control, self.sub):
            sock.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.SNDHWM, 0)  # never drop outputs for a slow frontend
        self.router.setsockopt(zmq.RCVHWM, 0)
        host = self.settings.host
        bind_host = "*" if host in ("0.0.0.0", "*") else host
        if self.settings.port:
            self.router.bind(f"tcp://{bind_host}:{self.settings.port}")
            port = self.settings.port
        else:
            port = self.router.bind_to_random_port(f"tcp://{bind_host}")
        self.input_addr = f"tcp://{_advertised_host(host, self.settings.coordinator_addr)}:{port}"
        self.threads.node_ip = self.node_ip
        log.info("engine socket bound at %s", self.input_addr)

    def register(self) -> None:
        """RegisterEngine -> RegisterAck; then subscribe to the coordinator's broadcast."""
        self.control.setsockopt(zmq.IDENTITY, self.engine_id.encode())
        self.control.connect(self.settings.coordinator_addr)
        self._send_register()
        log.info("registering with the coordinator at %s as rank %s", self.settings.coordinator_addr, self.rank)
        started = time.monotonic()
        while True:
            waited = time.monotonic() - started
            if self._exit_now or self._parent_died():
                raise RegistrationFailed("stopped while waiting for the coordinator")
            if waited > self.settings.register_timeout_s:
                raise RegistrationFailed(
                    f"no answer from the coordinator at {self.settings.coordinator_addr} after {waited:.0f} s"
                )
            if not self.control.poll(5000):
                log.info("still waiting for the coordinator at %s (%.0f s)", self.settings.coordinator_addr, waited)
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

    def _send_register(self) -> None:
        self.control.send_multipart(frames(self.guard.registration_id, self._register_message()))

    def _send(self, msg) -> None:
        """One message to the coordinator on the control socket, in this deployment's envelope."""
        self.control.send_multipart(frames(self.guard.deployment_id, msg))

    def _recv_control(self):
        """The next control message if it is this deployment's (an unbound engine adopts the id of the coordinator
        that accepts it); None for another deployment's or an undecodable one."""
        return self.guard.open(self.control.recv_multipart(), self._from_coordinator, "control message")

    def _register_message(self) -> RegisterEngine:
        return RegisterEngine(
            protocol_version=PROTOCOL_VERSION,
            rank=self.rank,
            engine_id=self.engine_id,
            input_addr=self.input_addr,
            model=self.core.model_info,
            kv_blocks_total=self.core.kv_blocks_total,
            node_ip=self.node_ip,
            pid=os.getpid(),
        )

    @property
    def node_ip(self) -> str:
        return self.input_addr.split("://", 1)[1].rsplit(":", 1)[0]

    def _accept(self, ack: RegisterAck) -> None:
        self.rank = ack.rank
        if ack.topology is not None:
            self.threads.on_topology(ack.topology, ack.rank)
        self.waves.rank = ack.rank
        if ack.pub_addr != self._pub_addr:
            if self._pub_addr:
                self.sub.disconnect(self._pub_addr)
            self.sub.setsockopt(zmq.SUBSCRIBE, b"")
            self.sub.connect(ack.pub_addr)
            self._pub_addr = ack.pub_addr
        self._last_broadcast_s = time.monotonic()

    def _check_coordinator(self, now: float) -> None:
        """A coordinator silent on its broadcast may have restarted: register again (same id and rank)."""
        self._drain_sub()  # what arrived during a long step counts: silence is judged on a drained socket
        silent_s = now - self._last_broadcast_s
        if self.guard.pinned and silent_s > self.settings.register_timeout_s and not self._exit_now:
            # Its deployment is gone (a coordinator that died without its teardown): nobody routes to this
            # engine, and whoever holds the port now is another deployment, which ignores it. Do not linger.
            log.error("no broadcast from deployment %s for %.0f s: its coordinator is gone; exiting",
                      self.guard.deployment_id, silent_s)
            self._exit_now = True
            self._exit_code = 1
            return
        if now - self._last_broadcast_s < COORDINATOR_SILENCE_S or now - self._last_register_s < COORDINATOR_SILENCE_S:
            return
        log.warning(
            "no broadcast from the coordinator for %.0f s; registering again at %s",
            now - self._last_broadcast_s,
            self.settings.coordinator_addr,
        )
        self._last_register_s = now
        self._send_register()

    # -- the loop -----------------------------------------------------------------------------------------------

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in (self.router, self.sub, self.control):
            poller.register(sock, zmq.POLLIN)
        now = time.monotonic()
        next_counters = now
        self._start_heartbeats()
        next_parent_check = now + PARENT_CHECK_INTERVAL_S
        while True:
            has_work = self.core.has_unfinished()
            if self._exit_now:
                break
            if self._drain_deadline is not None and (not has_work or time.monotonic() > self._drain_deadline):
                break
            timeout_ms = 0 if has_work else max(0, min(IDLE_POLL_MS, int((next_counters - time.monotonic()) * 1000)))
            for sock, _ in poller.poll(timeout_ms):
                if sock is self.router:
                    self._drain_router()
                elif sock is self.sub:
                    self._drain_sub()
                else:
                    self._drain_control()
            if self.core.has_unfinished() and not self._exit_now:
                self._step()
            load = self._load()
            self._flush(load)
            now = time.monotonic()
            self._maybe_send_stats(load, now)
            if now >= next_counters:
                self._maybe_send_stats(load, now, force_counters=True)
                next_counters = now + COUNTERS_INTERVAL_S
            if now >= next_parent_check:
                next_parent_check = now + PARENT_CHECK_INTERVAL_S
                self._check_coordinator(now)
                if self._parent_died():
                    log.error("parent process %d is gone; exiting", self._parent_pid)
                    self._exit_now = True
        self._abort_all("engine shutting down")
        self._flush(self._load())

    def _start_heartbeats(self) -> None:
        thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        thread.start()
        self._heartbeat_thread = thread

    def _heartbeat_loop(self) -> None:
        """Heartbeat(engine id) every HEARTBEAT_INTERVAL_S on a DEALER of this thread's own."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, f"{self.engine_id}-heartbeat".encode())
        sock.connect(self.settings.coordinator_addr)
        try:
            while not self._heartbeats_stop.wait(HEARTBEAT_INTERVAL_S):
                sock.send_multipart(frames(self.guard.deployment_id, Heartbeat(self.engine_id, time.time())),
                                    zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the context is closing
        finally:
            sock.close(0)

    def _step(self) -> None:
        """One core step. A failing step fails the requests it had; repeated failures end the process, so that
        the coordinator replaces the rank instead of it answering every request with an error."""
        try:
            self._collect(self.core.step())
            self._num_failed_steps = 0
        except Exception as e:  # noqa: BLE001
            self._num_failed_steps += 1
            log.exception("step failed (%d in a row)", self._num_failed_steps)
            failed = list(self._request_frontend)
            for output in self.core.abort(failed):
                output.finish_reason = FinishReason.ERROR
                output.error = f"engine rank {self.rank} failed: {type(e).__name__}: {e}"
                self._collect([output])
            if self._num_failed_steps >= MAX_FAILED_STEPS:
                log.error("%d failed steps in a row: exiting so that the rank is replaced", self._num_failed_steps)
                self._exit_now = True
                self._exit_code = 1
        if not self.core.has_unfinished():
            self.waves.on_idle()

    def _drain_router(self) -> None:
        while True:
            try:
                identity, data = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if identity not in self._known_frontends:
                self._known_frontends.add(identity)
                self.router.send_multipart([identity, encode(EngineHello(self.rank))])
            try:
                msg = self._to_engine.decode(data)
            except msgspec.DecodeError as e:
                log.warning("undecodable message from frontend %r: %s", identity, e)
                continue
            if isinstance(msg, EngineRequest):
                self._add(identity, msg)
            elif isinstance(msg, AbortRequests):
                self._collect(self.core.abort(msg.request_ids))
            else:
                log.warning("unexpected %s from frontend %r", type(msg).__name__, identity)

    def _add(self, identity: bytes, request: EngineRequest) -> None:
        request_id = request.request_id
        if not request.frontend_id:
            request.frontend_id = identity.decode(errors="replace")
        if self._drain_deadline is not None or self._exit_now:
            # Not an error: the frontend re-sends an unanswered request when this rank leaves the topology.
            log.info("request %s arrived while shutting down: left for the frontend to re-send", request_id)
            return
        try:
            self.core.add_request(request)
        except InvalidRequest as e:
            self._pending[identity].append(_error(request_id, str(e)))
            return
        except Exception as e:  # noqa: BLE001 - one bad request must not take the rank down
            log.exception("request %s failed to queue", request_id)
            self._pending[identity].append(_error(request_id, f"engine error: {e}"))
            return
        self._request_frontend[request_id] = identity
        start = self.waves.on_request(request.wave)
        if start is not None:
            self._send(start)

    def _drain_sub(self) -> None:
        while True:
            try:
                parts = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self.guard.open(parts, self._from_coordinator, "broadcast")
            if msg is None:
                continue  # not this deployment's coordinator: it does not count as a sign of life either
            self._last_broadcast_s = time.monotonic()
            if isinstance(msg, FrontendGone):
                mine = [r for r, f in self._request_frontend.items() if f == msg.frontend_id.encode()]
                if mine:
                    log.info("frontend %s is gone: aborting its %d requests", msg.frontend_id, len(mine))
                    self.core.abort(mine)
                    for request_id in mine:
                        self._request_frontend.pop(request_id, None)
                self._known_frontends.discard(msg.frontend_id.encode())
                self._pending.pop(msg.frontend_id.encode(), None)
            elif isinstance(msg, StartWave):
                self.waves.on_start_wave(msg)
            elif isinstance(msg, Topology):
                self.threads.on_topology(msg, self.rank)
            elif isinstance(msg, LoadSnapshot):
                self.threads.on_loads(msg.loads)
                if msg.wave > self.waves.wave:  # the coordinator declared our wave complete
                    self.waves.on_wave_complete(msg.wave - 1)
                    if self.core.has_unfinished():
                        self.waves.running = True
            elif isinstance(msg, Shutdown):
                self._on_shutdown(msg)

    def _drain_control(self) -> None:
        while self.control.poll(0):
            msg = self._recv_control()
            if isinstance(msg, Shutdown):
                self._on_shutdown(msg)
            elif isinstance(msg, RegisterAck):
                if msg.accepted:
                    self._accept(msg)
                    log.info("registered again as rank %d", self.rank)
                else:
                    log.error("the coordinator refused this engine: %s", msg.error)

    def _on_shutdown(self, msg: Shutdown) -> None:
        self.stop(drain=msg.drain, reason=msg.reason or "Shutdown from the coordinator",
                  drain_timeout_s=msg.drain_timeout_s or None)

    def stop(self, drain: bool, reason: str, drain_timeout_s: float | None = None) -> None:
        """Start draining (for `drain_timeout_s`, default --drain-timeout-s), or stop at once (drain=False)."""
        if self._exit_now:
            return
        if not drain:
            log.info("%s: stopping now", reason)
            self._exit_now = True
        elif self._drain_deadline is None:
            timeout_s = drain_timeout_s or self.settings.drain_timeout_s
            log.info("%s: draining for up to %.1f s", reason, timeout_s)
            self._drain_deadline = time.monotonic() + timeout_s

    def on_signal(self, signum: int, frame) -> None:
        """First SIGTERM/SIGINT drains, a second one stops at once."""
        self._num_signals += 1
        self.stop(drain=self._num_signals == 1, reason=signal.Signals(signum).name)

    # -- outputs and stats --------------------------------------------------------------------------------------

    def _collect(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            identity = self._request_frontend.get(output.request_id)
            if identity is None:
                continue
            if output.finish_reason is not None:
                del self._request_frontend[output.request_id]
            self._pending[identity].append(output)

    def _flush(self, load: EngineLoad) -> None:
        if not self._pending:
            return
        now = time.time()
        for identity, outputs in self._pending.items():
            if outputs:
                self.router.send_multipart([identity, encode(EngineOutputs(self.rank, outputs, load, now))])
        self._pending.clear()

    def _abort_all(self, reason: str) -> None:
        if self._request_frontend:
            log.info("%s: aborting %d requests", reason, len(self._request_frontend))
            self._collect(self.core.abort(list(self._request_frontend)))

    def _load(self) -> EngineLoad:
        load = self.core.load()
        load.rank = self.rank
        load.wave = self.waves.wave
        load.is_running = self.waves.running
        return load

    def _maybe_send_stats(self, load: EngineLoad, now: float, force_counters: bool = False) -> None:
        key = _load_key(load)
        changed = key != self._last_stats_key
        if force_counters and not changed:
            changed = self._last_counters is None or load != self._last_counters
        if changed and (force_counters or now - self._last_stats_s >= STATS_MIN_INTERVAL_S):
            self._send(EngineStats(load))
            self._last_stats_key = key
            self._last_stats_s = now
            self._last_counters = load

    @property
    def exit_code(self) -> int:
        return self._exit_code

    def _parent_died(self) -> bool:
        return os.getppid() != self._parent_pid

    def close(self) -> None:
        self._heartbeats_stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=2 * HEARTBEAT_INTERVAL_S)
        try:
            self.control.send_multipart(frames(self.guard.deployment_id, Unregister(self.engine_id, "exiting")),
                                        zmq.NOBLOCK)
            time.sleep(0.05)  # let the unregister leave before the socket closes
        except zmq.ZMQError:
            pass
        self.router.close(linger=1000)  # the last outputs (finished requests) must reach their frontends
        for sock in (self.control, self.sub):
            sock.close(0)
        self.ctx.term()


def _error(request_id: str, message: str) -> RequestOutput:
    return RequestOutput(request_id, finish_reason=FinishReason.ERROR, error=message)


def _exit_during_startup(signum, frame) -> None:
    raise SystemExit(128 + signum)


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s engine[{args.rank if args.rank >= 0 else '?'}] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    settings = settings_from_args(args)
    config = config_from_args(args)
    # Signals first: a SIGTERM during the model load must still end the process.
    signal.signal(signal.SIGTERM, _exit_during_startup)
    started = time.monotonic()
    log.info("loading model %s%s", config.model, " (null engine)" if config.null_engine else "")
    from dpserve_engine.factory import build_engine_core

    try:
        # a served rank registers before its decode step is compiled, and switches to it when it is ready
        core = build_engine_core(dataclasses.replace(config, compile_in_background=True))
    except Exception as e:  # noqa: BLE001 - the message is what the user needs; the traceback goes to debug
        log.debug("model load failed", exc_info=True)
        log.error("cannot load model %s: %s: %s", config.model, type(e).__name__, e)
        return 1
    log.info(
        "model %s loaded in %.1f s (max_model_len %d, %d KV blocks)",
        core.model_info.name,
        time.monotonic() - started,
        core.model_info.max_model_len,
        core.kv_blocks_total,
    )
    service = EngineService(settings, core)
    signal.signal(signal.SIGTERM, service.on_signal)
    signal.signal(signal.SIGINT, service.on_signal)
    try:
        service.bind()
        service.register()
        service.run()
    except RegistrationFailed as e:
        log.error("%s", e)
        return 1
    finally:
        service.close()
    log.info("rank %d stopped", service.rank)
    return service.exit_code


def main(argv: list[str] | None = None) -> int:
    """`dpserve-engine`. Exits the process without the interpreter's teardown of torch (seconds for nothing)."""
    code = run(argv)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
