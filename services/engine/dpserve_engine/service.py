"""`dpserve-engine`: one data-parallel rank. A thin ZMQ shell around an EngineCore; never imports Ray.

Start-up (`run`): load the model (build_engine_core), bind the socket frontends connect to (frontend_link.py),
register with the coordinator (coordinator_link.py: RegisterEngine -> RegisterAck with the rank and the broadcast
address), subscribe to the broadcast, serve.

The busy loop (`EngineService.run`), one iteration:
  1. poll the sockets: timeout 0 while requests run (never wait on I/O then), else block until the next timer;
  2. take in every queued message: from frontends requests (an invalid one is answered with an ERROR output) and
     aborts; from the coordinator FrontendGone (abort that frontend's requests), StartWave, Topology,
     LoadSnapshot, Shutdown;
  3. step the core once if it has work;
  4. send one EngineOutputs per frontend that has outputs, each carrying the current load;
  5. KvEvents to the coordinator if the step changed the prefix cache;
  6. timers: EngineStats to the coordinator, parent-pid watch, registering again when the coordinator's broadcast
     has been silent (a restarted coordinator), exiting when the deployment is gone.

Expert parallelism (--enable-expert-parallel; lockstep.py): after registering, the rank waits for the
coordinator's ExpertGroup (sent once every rank has registered), joins the torch.distributed group, and from then
on steps in lock-step waves: while a wave runs it steps every iteration (a dummy step without requests of its
own), every few steps the ranks all-reduce "has unfinished", and they pause together; rank 0 reports
WaveComplete. A later ExpertGroup (a scale step, a dead rank's replacement) re-forms the group: the rank leaves
the old one at the step its peers agree on (or at once when it is broken), joins the new one, tells the
coordinator (ExpertGroupJoined) and steps on with its requests; a step whose collective failed makes it leave
the group and say so (ExpertGroupBroken), keeping its requests, until the coordinator's next group. Without the
flag nothing of this runs and the waves stay bookkeeping.

Lifecycle (lifecycle.py): STARTING -> SERVING -> DRAINING -> STOPPED; the loop runs until STOPPED. The parent
died: stop now. SIGTERM/SIGINT or Shutdown(drain=True): drain (take no requests, let running ones finish for up
to --drain-timeout-s, or the Shutdown's own drain_timeout_s, abort the rest); a second signal or
Shutdown(drain=False): stop now. A request that arrives once the engine stops taking requests gets no answer: the
frontend re-sends it to another rank when this rank leaves the topology (it has no token yet), which is what keeps
a scale-down that races with a frontend's last send free of failed requests. The engine socket lingers briefly on
close so that the last outputs leave. Three failed steps in a row end the process with exit code 1, so that the
coordinator replaces the rank.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import sys
import time

import zmq

from dpserve_shared.schema import (
    PROTOCOL_VERSION,
    AbortRequests,
    CoreUse,
    EngineLoad,
    EngineRequest,
    EngineStats,
    ExpertGroup,
    ExpertGroupBroken,
    ExpertGroupJoined,
    FinishReason,
    FrontendGone,
    KvResync,
    LoadSnapshot,
    RegisterAck,
    RegisterEngine,
    RequestOutput,
    Shutdown,
    StartWave,
    Topology,
    WaveComplete,
)
from dpserve_shared.waves import EngineWaves
from dpserve_shared.zmq_security import ClusterKeyError, log_security

from dpserve_engine.coordinator_link import CoordinatorLink, RegistrationFailed
from dpserve_engine.frontend_link import FrontendLink
from dpserve_engine.interface import EngineCoreBase, InvalidRequest
from dpserve_engine.lifecycle import Lifecycle, ProcessState
from dpserve_engine.lockstep import Lockstep, SyncFailed, hold
from dpserve_engine.progress import Ticker
from dpserve_engine.settings import ServiceSettings, build_parser, config_from_args, settings_from_args
from dpserve_engine.threads import NodePeers, ThreadBudget

log = logging.getLogger("dpserve.engine")

PARENT_CHECK_INTERVAL_S = 0.5
IDLE_POLL_MS = 100
MAX_FAILED_STEPS = 3

class EngineService:
    def __init__(self, settings: ServiceSettings, core: EngineCoreBase):
        self.settings = settings
        self.core = core
        self.lifecycle = Lifecycle(settings.drain_timeout_s)
        self.waves = EngineWaves(rank=settings.rank)
        self.threads = ThreadBudget(settings.adaptive_threads)  # its node_ip is set in bind()
        self.ctx = zmq.Context()
        self.frontends = FrontendLink(self.ctx, settings)
        self.coordinator = CoordinatorLink(self.ctx, settings)
        self.peers = NodePeers(self.ctx, settings.zmq_security)  # CoreUse to the ranks on this node
        self._parent_pid = settings.watch_pid or os.getppid()
        self._num_failed_steps = 0
        self.lockstep: Lockstep | None = None  # --enable-expert-parallel, once the group is joined
        self._has_held_pause = False

    @property
    def rank(self) -> int:
        return self.coordinator.rank

    @property
    def input_addr(self) -> str:
        return self.frontends.input_addr

    @property
    def exit_code(self) -> int:
        return self.lifecycle.exit_code

    # -- start-up -------------------------------------------------------------------------------------------------

    def bind(self) -> None:
        self.frontends.bind()
        self.threads.node_ip = self.frontends.node_ip

    def register(self) -> None:
        """RegisterEngine -> RegisterAck; then SERVING."""
        registration = RegisterEngine(
            protocol_version=PROTOCOL_VERSION,
            rank=self.rank,
            engine_id=self.coordinator.engine_id,
            input_addr=self.input_addr,
            model=self.core.model_info,
            kv_blocks_total=self.core.kv_blocks_total,
            node_ip=self.frontends.node_ip,
            pid=os.getpid(),
            block_size=self.core.block_size,
            num_experts=self.core.num_experts,
            cpu=self.core.cpu_choice(),
        )
        ack = self.coordinator.register(registration, lambda: self.lifecycle.is_stopped or self._parent_died())
        self._on_registered(ack)
        if self.settings.enable_expert_parallel:
            self._join_expert_group()
        self.core.start_kv_events()
        self.lifecycle.serving()

    def _on_registered(self, ack: RegisterAck) -> None:
        if ack.topology is not None:
            self._on_topology(ack.topology, ack.rank)
        self.waves.rank = ack.rank

    def _join_expert_group(self) -> None:
        """Wait for the coordinator's ExpertGroup (every rank registered), join the group, step in lock-step from
        now on. Raises RegistrationFailed (stopped or no ExpertGroup in time) or ExpertGroupJoinFailed."""
        self.coordinator.start_heartbeats()  # the wait and the join may outlast the coordinator's engine timeout
        started = time.monotonic()
        log.info("waiting for the coordinator's expert-parallel group (every rank registered)")
        message = None
        while message is None:
            if self.lifecycle.is_stopped or self._parent_died():
                raise RegistrationFailed("stopped while waiting for the expert-parallel group")
            if time.monotonic() - started > self.settings.register_timeout_s:
                raise RegistrationFailed(
                    f"no expert-parallel group from the coordinator at {self.settings.coordinator_addr} after "
                    f"{self.settings.register_timeout_s:.0f} s (--register-timeout-s): did every rank register?"
                )
            for msg in list(self.coordinator.receive()):
                if isinstance(msg, ExpertGroup):
                    message = msg
                elif isinstance(msg, Shutdown):
                    raise RegistrationFailed(f"shut down while waiting for the expert-parallel group: {msg.reason}")
            self.coordinator.control.poll(100)
        self._join(message)

    def _join(self, message: ExpertGroup) -> None:
        """Join the group `message` names, leaving the rank's current one first (rank -1: join none). The first
        group starts paused in wave 0; a re-formed one (generation > 1) steps in the message's wave at once, on
        every member alike. Raises RegistrationFailed when the group does not form."""
        from dpserve_engine.expert_parallel import ExpertGroup as Group  # torch: imported by run() already
        from dpserve_engine.expert_parallel import ExpertGroupJoinFailed, ExpertParallelComm, GroupAddress

        if self.lockstep is not None:
            self.lockstep.leave()
        group = None
        if message.rank >= 0:
            if message.rank != self.rank:
                raise RegistrationFailed(f"the coordinator placed rank {self.rank} as rank {message.rank} of the group")
            address = GroupAddress(message.host, message.port, message.world_size, message.rank, message.timeout_s)
            try:
                group = Group.join(address, getattr(self.core, "device", "cpu"))  # EngineCore.device; null: cpu
            except ExpertGroupJoinFailed as e:
                raise RegistrationFailed(str(e)) from None
            self.core.set_expert_comm(ExpertParallelComm(group))  # EngineCore re-shards its experts here
        if self.lockstep is None:
            self.lockstep = Lockstep(self.rank, group, self.core)
            self.waves = self.lockstep.waves
            if message.generation > 1:
                self.waves.on_regroup(message.wave)
        else:
            self.lockstep.regroup(group, message.wave)
        self.lockstep.membership.on_joined(message)
        self.coordinator.send(ExpertGroupJoined(message.generation, is_member=group is not None))

    def _on_expert_group(self, message: ExpertGroup) -> None:
        """A later group from the coordinator: step to the sync where the ranks agree to leave, or (broken, or
        told to leave now) re-form at once."""
        if self.lockstep.membership.on_group(message):
            self.waves.start_to_sync()
        self._rejoin_if_due()

    def _rejoin_if_due(self) -> None:
        message = self.lockstep.membership.to_join()
        if message is None:
            return
        started = time.monotonic()
        log.info("re-forming the expert-parallel group: generation %d, %s", message.generation,
                 f"rank {message.rank} of {message.world_size}" if message.rank >= 0 else "leaving it")  # fmt: skip
        try:
            self._join(message)
        except RegistrationFailed as e:
            self.lifecycle.stop(drain=False, exit_code=1, is_error=True,
                                reason=f"cannot re-form the expert-parallel group: {e}")  # fmt: skip
            return
        log.info("expert-parallel group of generation %d %s in %.2f s", message.generation,
                 "joined" if message.rank >= 0 else "left", time.monotonic() - started)  # fmt: skip

    # -- the loop -------------------------------------------------------------------------------------------------

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in (self.frontends.frontend_socket, self.coordinator.broadcast, self.coordinator.control):
            poller.register(sock, zmq.POLLIN)
        self.coordinator.start_heartbeats()
        next_parent_check = time.monotonic() + PARENT_CHECK_INTERVAL_S
        self.lifecycle.end_drain_if_done(self.core.has_unfinished())
        while self.lifecycle.state is not ProcessState.STOPPED:
            has_work = self._has_work()
            until_timer_ms = math.ceil((self.coordinator.next_report_s - time.monotonic()) * 1000)
            is_busy = has_work and (self.lockstep is None or self.lockstep.membership.can_step)
            timeout_ms = 0 if is_busy else max(0, min(IDLE_POLL_MS, until_timer_ms))
            for sock, _ in poller.poll(timeout_ms):
                if sock is self.frontends.frontend_socket:
                    self._take_frontend_messages()
                else:
                    self._take_coordinator_messages()
            if self.lockstep is not None:
                if self.lockstep.can_step and not self.lifecycle.is_stopped:
                    self._lockstep_step()
                    self._report_kv_events()
                self._rejoin_if_due()  # left at the agreed step, its ExpertGroup here
            elif self.core.has_unfinished() and not self.lifecycle.is_stopped:
                self._tell_neighbours()  # got work: before its first step
                self._step()
                self._report_kv_events()
            self._tell_neighbours()  # ran out of work: before the last outputs go out
            load = self._load()
            self.frontends.flush(load)
            now = time.monotonic()
            self.coordinator.report(load, now, self.frontends.num_received, self.frontends.received)
            if now >= next_parent_check:
                next_parent_check = now + PARENT_CHECK_INTERVAL_S
                self._watch(now)
            self.lifecycle.end_drain_if_done(self._has_work())
        self._abort_all("engine shutting down")
        self.frontends.flush(self._load())

    def _has_work(self) -> bool:
        """Requests to step, or (lock-step) a wave to step in: the other ranks' collectives wait for this one (not
        once the rank left the group: a scale-down's removed rank drains without it)."""
        return self.core.has_unfinished() or (self.lockstep is not None and self.lockstep.can_step)

    def _lockstep_step(self) -> None:
        """One lock-step step (lockstep.py). A failure leaves the ranks' collectives out of step: the rank leaves
        the group, keeps its requests (the failed step committed no token) and tells the coordinator, which
        re-forms the group (with a dead peer's replacement); MAX_FAILED_STEPS failures in a row (the model, not the
        group) fail its requests and end the process, so that the rank is replaced."""
        assert self.lockstep is not None
        try:
            outputs, completed = self.lockstep.step()
        except Exception as e:  # noqa: BLE001
            if isinstance(e, SyncFailed):
                self.frontends.collect(e.outputs)  # the step itself went through: its tokens are committed
            self._num_failed_steps += 1
            log.exception("lock-step step failed (%d in a row)", self._num_failed_steps)
            if self._num_failed_steps >= MAX_FAILED_STEPS:
                reason = (f"engine rank {self.rank}: {self._num_failed_steps} lock-step steps failed in a row "
                          f"({type(e).__name__}: {e}): exiting so that the rank is replaced")
                self._fail_requests(reason)
                self.lifecycle.stop(drain=False, exit_code=1, is_error=True, reason=reason)
                return
            generation = self.lockstep.membership.generation
            self.lockstep.membership.on_failure()
            self.lockstep.leave()
            log.warning("left the expert-parallel group of generation %d (%s: %s); keeping %d requests until the "
                        "coordinator re-forms it", generation, type(e).__name__, e,
                        len(self.frontends.request_ids()))  # fmt: skip
            self.coordinator.send(ExpertGroupBroken(generation, f"{type(e).__name__}: {e}"[:500]))
            self._rejoin_if_due()
            return
        self._num_failed_steps = 0
        self.frontends.collect(outputs)
        if completed is not None:
            self._on_wave_complete(completed)

    def _on_wave_complete(self, completed: int) -> None:
        """Every rank paused after this step; rank 0 tells the coordinator."""
        if self.settings.hold_first_pause_s > 0 and not self._has_held_pause:
            self._has_held_pause = True
            self.frontends.flush(self._load())
            self.coordinator.send(EngineStats(self._load()))  # the new wave shows in /metrics before the hold
            held_s = hold(self.frontends.frontend_socket.poll, self.settings.hold_first_pause_s)
            log.info("test hook: held the pause after wave %d for %.2f s", completed, held_s)
        if self.rank == 0:
            self.coordinator.send(WaveComplete(completed))

    def _report_kv_events(self) -> None:
        stored, removed = self.core.take_kv_events()
        if stored or removed:
            self.coordinator.send_kv_events(stored, removed)

    def _send_kv_snapshot(self) -> None:
        self.core.take_kv_events()  # the snapshot holds them
        self.coordinator.send_kv_events(self.core.kv_snapshot(), [], is_snapshot=True)

    def _watch(self, now: float) -> None:
        """The coordinator (silent: register again; its deployment gone: exit) and the parent process."""
        self._take_coordinator_messages()  # silence is judged on a drained socket
        gone = self.coordinator.watch(now)
        if gone is not None:
            self.lifecycle.stop(drain=False, reason=gone, exit_code=1, is_error=True)
        if self._parent_died():
            self.lifecycle.stop(drain=False, reason=f"parent process {self._parent_pid} is gone; exiting",
                                is_error=True)

    def _step(self) -> None:
        """One core step. A failing step fails the requests it had; repeated failures end the process, so that
        the coordinator replaces the rank instead of it answering every request with an error."""
        try:
            self.frontends.collect(self.core.step())
            self._num_failed_steps = 0
        except Exception as e:  # noqa: BLE001
            self._num_failed_steps += 1
            log.exception("step failed (%d in a row)", self._num_failed_steps)
            self._fail_requests(f"engine rank {self.rank} failed: {type(e).__name__}: {e}")
            if self._num_failed_steps >= MAX_FAILED_STEPS:
                self.lifecycle.stop(
                    drain=False, exit_code=1, is_error=True,
                    reason=f"{self._num_failed_steps} failed steps in a row: exiting so that the rank is replaced",
                )  # fmt: skip
        if not self.core.has_unfinished():
            self.waves.on_idle()

    # -- messages -------------------------------------------------------------------------------------------------

    def _take_frontend_messages(self) -> None:
        for identity, msg in self.frontends.receive(self.rank):
            if isinstance(msg, EngineRequest):
                self._add(identity, msg)
            elif isinstance(msg, AbortRequests):
                self.frontends.collect(self.core.abort(msg.request_ids))
            elif isinstance(msg, CoreUse):
                self.threads.on_notice(msg)

    def _tell_neighbours(self) -> None:
        """The ranks on this node learn at once when this one gets work or runs out of it (threads.py)."""
        if self.threads.enabled and self.threads.addresses:
            self.peers.tell(self.rank, self.core.has_unfinished())

    def _on_topology(self, topology: Topology, rank: int) -> None:
        self.threads.on_topology(topology, rank)
        if self.threads.enabled:
            self.peers.follow(rank, self.threads.addresses)

    def _add(self, identity: bytes, request: EngineRequest) -> None:
        request_id = request.request_id
        if not request.frontend_id:
            request.frontend_id = identity.decode(errors="replace")
        if not self.lifecycle.takes_requests:
            # Not an error: the frontend re-sends an unanswered request when this rank leaves the topology.
            log.info("request %s arrived while shutting down: left for the frontend to re-send", request_id)
            return
        try:
            self.core.add_request(request)
        except InvalidRequest as e:
            self.frontends.answer(identity, _error(request_id, str(e)))
            return
        except Exception as e:  # noqa: BLE001 - one bad request must not take the rank down
            log.exception("request %s failed to queue", request_id)
            self.frontends.answer(identity, _error(request_id, f"engine error: {e}"))
            return
        self.frontends.track(request_id, identity)
        start = self.waves.on_request(request.wave)
        if start is not None:
            self.coordinator.send(start)

    def _take_coordinator_messages(self) -> None:
        for msg in self.coordinator.receive():
            if isinstance(msg, FrontendGone):
                mine = self.frontends.forget_frontend(msg.frontend_id)
                if mine:
                    log.info("frontend %s is gone: aborting its %d requests", msg.frontend_id, len(mine))
                    self.core.abort(mine)
            elif isinstance(msg, StartWave):
                self.waves.on_start_wave(msg)  # lock-step: a stale or excluding one is ignored
            elif isinstance(msg, Topology):
                self._on_topology(msg, self.rank)
            elif isinstance(msg, LoadSnapshot):
                self.threads.on_loads(msg.loads)
                if self.lockstep is not None:
                    self.waves.on_snapshot(msg.wave, msg.engines_running)  # a lost StartWave (waves.py (h))
                elif msg.wave > self.waves.wave:  # the coordinator declared our wave complete
                    self.waves.on_wave_complete(msg.wave - 1)
                    if self.core.has_unfinished():
                        self.waves.running = True
            elif isinstance(msg, Shutdown):
                self.stop(drain=msg.drain, reason=msg.reason or "Shutdown from the coordinator",
                          drain_timeout_s=msg.drain_timeout_s or None)
            elif isinstance(msg, RegisterAck):  # registered again
                self._on_registered(msg)
                # A new coordinator (restarted) knows nothing of this rank's prefix cache, and nothing tells it
                # until the cache changes: its index starts from this snapshot.
                self._send_kv_snapshot()
            elif isinstance(msg, KvResync):
                self._send_kv_snapshot()
            elif isinstance(msg, ExpertGroup) and self.lockstep is not None:
                self._on_expert_group(msg)

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def stop(self, drain: bool, reason: str, drain_timeout_s: float | None = None) -> None:
        """Start draining (for `drain_timeout_s`, default --drain-timeout-s), or stop at once (drain=False)."""
        self.lifecycle.stop(drain=drain, reason=reason, drain_timeout_s=drain_timeout_s)

    def on_signal(self, signum: int, frame) -> None:
        """First SIGTERM/SIGINT drains, a second one stops at once."""
        self.lifecycle.on_signal(signum, frame)

    def _fail_requests(self, error: str) -> None:
        """End every request of this rank with an error (the frontends move or fail them)."""
        for output in self.core.abort(self.frontends.request_ids()):
            output.finish_reason = FinishReason.ERROR
            output.error = error
            self.frontends.collect([output])

    def _abort_all(self, reason: str) -> None:
        request_ids = self.frontends.request_ids()
        if request_ids:
            log.info("%s: aborting %d requests", reason, len(request_ids))
            self.frontends.collect(self.core.abort(request_ids))

    def _load(self) -> EngineLoad:
        load = self.core.load()
        load.rank = self.rank
        load.wave = self.waves.wave
        load.is_running = self.waves.running
        if self.lockstep is not None:
            load.num_dummy_steps = self.lockstep.num_dummy_steps
            load.collective_time_s = self.lockstep.collective_time_s
        return load

    def _parent_died(self) -> bool:
        if self.settings.watch_pid == 0:
            return False  # nothing to watch: the coordinator link's silence check ends it (CoordinatorLink.watch)
        if self.settings.watch_pid is None:
            return os.getppid() != self._parent_pid  # re-parented: the parent is gone
        try:
            os.kill(self._parent_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # alive, another user's
        return False

    def close(self) -> None:
        self.peers.close()
        self.coordinator.close()
        self.frontends.close()  # lingers: the last outputs (finished requests) must reach their frontends
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
    try:
        settings = settings_from_args(args)
    except ClusterKeyError as e:
        log.error("%s", e)
        return 2
    log_security(log, settings.zmq_security)
    config = config_from_args(args)
    # Signals first: a SIGTERM during the model load must still end the process.
    signal.signal(signal.SIGTERM, _exit_during_startup)
    started = time.monotonic()
    log.info("loading model %s%s", config.model, " (null engine)" if config.null_engine else "")
    from dpserve_engine.factory import build_engine_core

    try:
        # a served rank registers before its decode step is compiled, and switches to it when it is ready
        with Ticker(log, f"loading model {config.model}"):
            core = build_engine_core(dataclasses.replace(config, compile_in_background=True, populate_kv_cache=True))
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
    if settings.enable_expert_parallel and not core.supports_expert_parallel:
        log.error("--enable-expert-parallel needs a mixture-of-experts model (or --null-engine); %s is dense",
                  core.model_info.name)  # fmt: skip
        return 2
    if settings.enable_expert_parallel:
        import dpserve_engine.expert_parallel  # noqa: F401 - torch takes seconds to import: not after registering
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
