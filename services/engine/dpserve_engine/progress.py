"""A progress line every 10 s while a long phase of a rank's start-up runs: minutes of silence look like a hang.

    with Ticker(logger, "loading model smollm2"):   # "loading model smollm2: <phase>, 20 s so far"
        ...

The phase is what the callable given says, or else the latest INFO line of the engine's own loggers (each step
of the load logs one as it begins: reading the file, building the kernels, dequantizing, sizing the KV cache).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

INTERVAL_S = 10.0


class _LatestMessage(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.message = "starting"

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "progress", False):
            return  # a Ticker's own line (another phase's, e.g. the decode step's beside the model load)
        try:
            self.message = record.getMessage().split(" (")[0]  # the phase, not its details
        except Exception:  # noqa: BLE001 - a handler must never raise into the code that logs
            pass


class Ticker:
    def __init__(self, logger: logging.Logger, what: str, phase: Callable[[], str] | None = None,
                 suffix: str = "", interval_s: float = INTERVAL_S):  # fmt: skip
        self.logger, self.what, self.phase, self.suffix, self.interval_s = logger, what, phase, suffix, interval_s
        self._done = threading.Event()
        self._latest: _LatestMessage | None = None
        self._watched = logging.getLogger("dpserve_engine")

    def __enter__(self) -> Ticker:
        if self.phase is None:
            self._latest = _LatestMessage()
            self._watched.addHandler(self._latest)
        self.started = time.monotonic()
        threading.Thread(target=self._run, name="progress", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._latest is not None:
            self._watched.removeHandler(self._latest)

    def current_phase(self) -> str:
        if self.phase is not None:
            return self.phase()
        return self._latest.message if self._latest is not None else "starting"

    def _run(self) -> None:
        while not self._done.wait(self.interval_s):
            self.logger.info("%s: %s, %.0f s so far%s", self.what, self.current_phase(),
                             time.monotonic() - self.started, self.suffix, extra={"progress": True})  # fmt: skip
