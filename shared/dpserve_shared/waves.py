"""The wave protocol, as pure state machines (no sockets): coordinator, engine and frontend sides.

A *wave* is one period during which the engines are stepping. The wave number counts how many times the engines
have, all together, gone from running to paused. Every party keeps `(wave, running)`:

- The coordinator's copy is the truth it publishes in every LoadSnapshot.
- An engine starts running when it gets a request or a StartWave; when every rank has run out of work the wave
  completes: the coordinator (dense models: from the ranks' published loads) or rank 0 (lock-step models: after
  the all-reduce of "has unfinished") declares `wave_complete(w)`, and everybody moves to wave w + 1, paused.
- A frontend stamps each request with the wave it believes current. If it believes the engines are paused, it
  also asks the coordinator to start a wave (StartWaveRequest), which broadcasts StartWave to the other ranks.

Races this settles (each pinned by tests/unit/test_waves.py):
(a) a request while all engines are paused: the frontend's StartWaveRequest wakes the other ranks;
(b) a request stamped with a wave that completed while it was in flight: the receiving engine is already in a
    later wave and paused, so it asks the coordinator to start its current wave for everybody;
(c) a StartWave for an older wave is ignored;
(d) a wave_complete for a wave older than the current one is ignored.

For dense models the ranks are independent: running/paused is bookkeeping (published, shown in /metrics) and no
rank ever runs a dummy step (CoordinatorWaves, EngineWaves).

Lock-step models (MoE with expert parallelism, `--enable-expert-parallel`: LockstepCoordinatorWaves,
LockstepEngineWaves): every step of every rank is a set of collectives over all ranks, so while a wave runs every
rank steps, one without requests a dummy step. Every SYNC_INTERVAL_STEPS steps of a wave the ranks all-reduce
"has unfinished requests"; when no rank has, all of them pause after that same step and move to wave w + 1 (a
rank's wave only ever moves by that consensus, never by a message), and rank 0 tells the coordinator
(WaveComplete(w)). What differs from dense:
(e) a paused rank that takes a request always asks the coordinator to start its wave (StartWaveRequest with its
    own wave): the coordinator then knows for sure, whatever the frontend believed;
(f) a StartWaveRequest for a wave newer than the coordinator's means the ranks completed the coordinator's wave
    and rank 0's WaveComplete is still on its way (it comes from another socket, so it may arrive later): the
    coordinator moves to that wave and broadcasts StartWave, even though it believed the engines running (the
    dense rule, "already running: nothing to do", would leave the other ranks paused and the asking rank blocked
    in its first collective forever);
(g) the coordinator ignores the ranks' loads for the wave: only rank 0's WaveComplete ends one;
(h) the coordinator's (wave, running) on every LoadSnapshot restarts a paused rank whose wave it says is running:
    a lost StartWave (PUB drops under pressure), or one that excluded a rank whose request never came (the
    frontend failed to send it, or it was invalid), cannot leave the other ranks blocked.
"""

from __future__ import annotations

import dataclasses

from dpserve_shared.schema import StartWave, StartWaveRequest

# Lock-step: steps between two all-reduces of "has unfinished". vLLM uses 32 on GPUs, where the all-reduce is a
# host sync that stalls the step pipeline. Here steps are CPU-bound and take milliseconds, the all-reduce (one int
# over gloo, 2 local processes) took 0.54 ms on a 2-core machine under load 10, and the interval bounds the dummy
# steps each idle period costs (up to this many after the last request finishes), so it is smaller: every 8 steps
# the all-reduce adds < 0.1 ms per step, and a burst's end is followed by at most 8 dummy steps.
SYNC_INTERVAL_STEPS = 8


@dataclasses.dataclass
class CoordinatorWaves:
    wave: int = 0
    running: bool = False

    def on_wave_complete(self, completed: int) -> bool:
        """Returns True when this changed the state (a stale completion is ignored)."""
        if completed < self.wave:
            return False
        self.wave = completed + 1
        self.running = False
        return True

    def on_start_request(self, request: StartWaveRequest) -> StartWave | None:
        """A frontend or engine saw work while it believed the engines paused. Returns what to broadcast."""
        if request.wave < self.wave:
            # The request crossed a wave_complete: the rank that holds it is in a newer wave and may be paused
            # too, so nobody is excluded.
            if self.running:
                return None
            self.running = True
            return StartWave(self.wave, exclude_rank=None)
        if request.wave > self.wave:
            self.wave = request.wave
        if self.running:
            return None
        self.running = True
        return StartWave(self.wave, exclude_rank=request.rank)

    def on_loads(self, ranks_running: list[bool]) -> int | None:
        """Dense models: the wave completes when every rank reports it has stopped stepping; -> the wave that
        completed, if one did."""
        if self.running and ranks_running and not any(ranks_running):
            completed = self.wave
            self.on_wave_complete(completed)
            return completed
        if not self.running and any(ranks_running):
            # A rank started on its own (a request reached it first); the wave is under way.
            self.running = True
        return None


@dataclasses.dataclass
class EngineWaves:
    rank: int
    wave: int = 0
    running: bool = False

    def on_request(self, request_wave: int) -> StartWaveRequest | None:
        """A request arrived stamped with `request_wave`. Returns a StartWaveRequest to send, if any."""
        reply = None
        if request_wave > self.wave:
            self.wave = request_wave
        elif request_wave < self.wave and not self.running:
            # Race (b): the frontend had not yet heard that its wave completed.
            reply = StartWaveRequest(self.wave, self.rank)
        self.running = True
        return reply

    def on_start_wave(self, message: StartWave) -> bool:
        if message.exclude_rank == self.rank or message.wave < self.wave:
            return False  # race (c): stale
        self.wave = message.wave
        self.running = True
        return True

    def on_idle(self) -> None:
        """This rank ran out of work; it keeps its wave until the coordinator declares it complete."""
        self.running = False

    def on_wave_complete(self, completed: int) -> None:
        if completed >= self.wave:
            self.wave = completed + 1
            self.running = False


@dataclasses.dataclass
class FrontendWaves:
    wave: int = 0
    running: bool = False

    def on_snapshot(self, wave: int, running: bool) -> None:
        self.wave, self.running = wave, running

    def stamp(self, rank: int) -> tuple[int, StartWaveRequest | None]:
        """The wave to put on a request for `rank`, and a StartWaveRequest when the engines look paused."""
        if self.running:
            return self.wave, None
        self.running = True  # until the next snapshot says otherwise: one wake-up per burst
        return self.wave, StartWaveRequest(self.wave, rank)


@dataclasses.dataclass
class LockstepCoordinatorWaves(CoordinatorWaves):
    """The coordinator's side for lock-step models: waves end only by rank 0's WaveComplete (g), and a newer wave
    asked for is started even while the coordinator believed the engines running (f)."""

    def on_start_request(self, request: StartWaveRequest) -> StartWave | None:
        if request.wave > self.wave:  # (f)
            self.wave = request.wave
            self.running = True
            return StartWave(self.wave, exclude_rank=request.rank)
        return super().on_start_request(request)

    def on_loads(self, ranks_running: list[bool]) -> int | None:
        return None  # (g)

    def on_regroup(self) -> int:
        """The expert-parallel group is re-formed (elastic EP, a replaced rank): its members step from their join
        on in a wave newer than any of theirs (a rank is at most one wave ahead of the coordinator: its
        WaveComplete in flight, which is then stale). Returns that wave, now running."""
        self.wave += 1
        self.running = True
        return self.wave


@dataclasses.dataclass
class LockstepEngineWaves:
    """One rank's side for lock-step models. The service calls, per loop iteration: on_request for each request
    taken, on_start_wave / on_snapshot for the coordinator's messages, then while `running` one step (real or
    dummy) followed by on_step; when on_step says so, the all-reduce of "has unfinished" and on_sync with its
    answer."""

    rank: int
    sync_interval_steps: int = SYNC_INTERVAL_STEPS
    wave: int = 0
    running: bool = False
    num_steps: int = 0  # steps taken in the current wave

    def _start(self) -> None:
        if not self.running:
            self.running = True
            self.num_steps = 0

    def on_request(self, request_wave: int) -> StartWaveRequest | None:
        """A request arrived stamped with `request_wave`. A paused rank starts stepping and asks the coordinator to
        start its wave for the others (e); a running one needs nothing. The request's wave never moves this
        rank's (only the ranks' consensus does)."""
        if self.running:
            return None
        self._start()
        return StartWaveRequest(self.wave, self.rank)

    def on_start_wave(self, message: StartWave) -> bool:
        """Returns True when this started the rank (race (c): a StartWave for an older wave is ignored)."""
        if message.wave < self.wave or message.exclude_rank == self.rank or self.running:
            return False
        self.wave = message.wave
        self._start()
        return True

    def on_snapshot(self, wave: int, engines_running: bool) -> bool:
        """The coordinator's published state; returns True when it started this paused rank (h)."""
        if not engines_running or wave < self.wave or self.running:
            return False
        self.wave = wave
        self._start()
        return True

    def on_step(self) -> bool:
        """A step (real or dummy) ran; True when the all-reduce of "has unfinished" is due after it."""
        self.num_steps += 1
        return self.num_steps % self.sync_interval_steps == 0

    def start_to_sync(self) -> None:
        """A newer group is pending: step (dummy steps if need be) to the next all-reduce, where the ranks agree
        to leave the old group together."""
        self._start()

    def on_leave(self) -> None:
        """The rank left its group (agreed, or the group broke): it stops stepping; the wave is not complete."""
        self.running = False
        self.num_steps = 0

    def on_regroup(self, wave: int) -> None:
        """The rank joined a re-formed group: every member steps in `wave` from its first step on."""
        self.wave = wave
        self.running = True
        self.num_steps = 0

    def on_sync(self, any_rank_unfinished: bool) -> int | None:
        """The all-reduce's answer (the same on every rank). Returns the wave that completed, if it did."""
        if any_rank_unfinished:
            return None
        completed = self.wave
        self.wave += 1
        self.running = False
        self.num_steps = 0
        return completed
