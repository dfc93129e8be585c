"""The engine process's lifecycle: STARTING -> SERVING -> DRAINING -> STOPPED, and the one way to stop.

STARTING: bound and registering. SERVING: registered, taking requests. DRAINING: taking no new requests, running
ones finish until the drain deadline, then the loop ends. STOPPED: the loop ends now (what still runs is aborted).
`stop(drain)` is the one way to ask for the end, and it is idempotent: stopping twice, or draining while already
draining, changes nothing. A drain asked for while still STARTING is kept: registration
goes on, then the loop finds nothing to drain and stops (a stop now ends the registration instead).

This is the process's own state. The wire's `EngineState` is the coordinator's view of a rank (READY for
SERVING; DEAD is the coordinator's verdict on a silent rank, not a state the process sets), so it is not reused.
Pure: no sockets, no signals installed here; service.py calls it.
"""

from __future__ import annotations

import enum
import logging
import signal
import time

log = logging.getLogger("dpserve.engine")


class ProcessState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


class Lifecycle:
    def __init__(self, drain_timeout_s: float):
        self.state = ProcessState.STARTING
        self.exit_code = 0
        self._default_drain_timeout_s = drain_timeout_s
        self._drain_deadline = 0.0  # monotonic; meaningful while DRAINING
        self._num_signals = 0  # which transition a SIGTERM/SIGINT asks for: the first drains, a second stops

    @property
    def is_stopped(self) -> bool:
        return self.state is ProcessState.STOPPED

    @property
    def takes_requests(self) -> bool:
        """False once draining or stopped: a request that arrives then is left for its frontend to re-send."""
        return self.state in (ProcessState.STARTING, ProcessState.SERVING)

    def serving(self) -> None:
        """Registered: STARTING -> SERVING (a drain or stop asked for meanwhile stands)."""
        if self.state is ProcessState.STARTING:
            self.state = ProcessState.SERVING

    def stop(
        self,
        drain: bool,
        reason: str,
        drain_timeout_s: float | None = None,
        exit_code: int = 0,
        is_error: bool = False,
    ) -> None:
        """Start draining (for `drain_timeout_s`, default --drain-timeout-s), or stop now (drain=False) with
        `exit_code`. `reason` is logged: "<reason>: stopping now", or as it is when `is_error`."""
        if self.state is ProcessState.STOPPED:
            return
        if not drain:
            if is_error:
                log.error("%s", reason)
            else:
                log.info("%s: stopping now", reason)
            self.state = ProcessState.STOPPED
            self.exit_code = exit_code
        elif self.state is not ProcessState.DRAINING:
            timeout_s = drain_timeout_s or self._default_drain_timeout_s
            log.info("%s: draining for up to %.1f s", reason, timeout_s)
            self.state = ProcessState.DRAINING
            self._drain_deadline = time.monotonic() + timeout_s

    def end_drain_if_done(self, has_work: bool) -> None:
        """DRAINING -> STOPPED once nothing runs or the drain deadline has passed."""
        if self.state is ProcessState.DRAINING and (not has_work or time.monotonic() > self._drain_deadline):
            self.state = ProcessState.STOPPED

    def on_signal(self, signum: int, frame) -> None:
        """First SIGTERM/SIGINT drains, a second one stops at once."""
        self._num_signals += 1
        self.stop(drain=self._num_signals == 1, reason=signal.Signals(signum).name)
