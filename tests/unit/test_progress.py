"""The start-up progress line: a phase and the seconds so far, while a long step runs."""

import contextlib
import logging
import threading

import pytest

from dpserve_engine.progress import Ticker


class _Lines(logging.Handler):
    def __init__(self, wanted: str):
        super().__init__(logging.INFO)
        self.wanted, self.lines, self.seen = wanted, [], threading.Event()

    def emit(self, record):
        self.lines.append(record.getMessage())
        if self.wanted in record.getMessage():
            self.seen.set()


@contextlib.contextmanager
def _capturing(wanted: str):
    log = logging.getLogger("dpserve_engine.test_progress")
    log.setLevel(logging.INFO)
    lines = _Lines(wanted)
    log.addHandler(lines)
    try:
        yield log, lines
    finally:
        log.removeHandler(lines)


@pytest.mark.timeout(10)
def test_the_phase_is_the_engines_latest_line_without_its_details():
    with _capturing("s so far") as (log, lines):
        with Ticker(log, "loading model m", interval_s=0.01):
            log.info("building the engine's C++ kernels (once; cached in /somewhere)")
            assert lines.seen.wait(5)
    progress = [line for line in lines.lines if "so far" in line]
    assert progress[0].startswith("loading model m: building the engine's C++ kernels, ")
    assert progress[0].endswith(" s so far")


@pytest.mark.timeout(10)
def test_a_given_phase_and_suffix():
    with _capturing("so far (meanwhile)") as (log, lines):
        with Ticker(log, "decode step", lambda: "tracing", " (meanwhile)", interval_s=0.01):
            assert lines.seen.wait(5)
    assert any(line.startswith("decode step: tracing, ") for line in lines.lines)


@pytest.mark.timeout(10)
def test_nothing_is_logged_after_the_block():
    with _capturing("so far") as (log, lines):
        with Ticker(log, "quick", interval_s=60):
            pass
        assert not lines.seen.wait(0.05)
    assert lines.lines == []
    assert not any(type(h).__name__ == "_LatestMessage" for h in logging.getLogger("dpserve_engine").handlers)


@pytest.mark.timeout(10)
def test_another_tickers_lines_are_not_a_phase():
    """The decode step's progress lines (its compile starts during the model load) do not become the load's phase."""
    with _capturing("loading model m: reading the file, ") as (log, lines):
        with Ticker(log, "loading model m", interval_s=0.02):
            log.info("reading the file (model.gguf)")
            with Ticker(log, "decode step", lambda: "tracing", interval_s=0.005):
                assert lines.seen.wait(5)
    assert not any(line.startswith("loading model m: decode step") for line in lines.lines)
