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
rank ever runs a dummy step. Lock-step models (MoE with expert parallelism) would add the all-reduce and dummy
forwards on the engine side; no such model is supported yet.
"""

from __future__ import annotations

import dataclasses

from dpserve_shared.schema import StartWave, StartWaveRequest


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
