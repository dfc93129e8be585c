"""The engine process's lifecycle (pure): the states, one idempotent stop, what signals ask for."""

import signal
import types

from dpserve_engine import lifecycle as lifecycle_module
from dpserve_engine.lifecycle import Lifecycle, ProcessState


def test_serving_then_drain_then_stopped_once_idle():
    lifecycle = Lifecycle(drain_timeout_s=5.0)
    assert lifecycle.state is ProcessState.STARTING and lifecycle.takes_requests
    lifecycle.serving()
    assert lifecycle.state is ProcessState.SERVING
    lifecycle.stop(drain=True, reason="test")
    lifecycle.stop(drain=True, reason="again")  # idempotent: the first deadline stands
    assert lifecycle.state is ProcessState.DRAINING and not lifecycle.takes_requests
    lifecycle.end_drain_if_done(has_work=True)
    assert lifecycle.state is ProcessState.DRAINING
    lifecycle.end_drain_if_done(has_work=False)
    assert lifecycle.is_stopped and lifecycle.exit_code == 0


def test_a_drain_ends_at_its_deadline_even_with_work(monkeypatch):
    now_s = [1000.0]  # the lifecycle's clock, advanced by the test instead of sleeping
    monkeypatch.setattr(lifecycle_module, "time", types.SimpleNamespace(monotonic=lambda: now_s[0]))
    lifecycle = Lifecycle(drain_timeout_s=5.0)
    lifecycle.stop(drain=True, reason="test", drain_timeout_s=1e-9)
    now_s[0] += 0.001
    lifecycle.end_drain_if_done(has_work=True)
    assert lifecycle.is_stopped


def test_stop_now_is_final_and_keeps_the_first_exit_code():
    lifecycle = Lifecycle(drain_timeout_s=5.0)
    lifecycle.serving()
    lifecycle.stop(drain=False, reason="failed", exit_code=1, is_error=True)
    lifecycle.stop(drain=False, reason="later")
    lifecycle.stop(drain=True, reason="later")
    lifecycle.serving()
    assert lifecycle.is_stopped and lifecycle.exit_code == 1


def test_a_drain_asked_for_while_starting_stands_after_registration():
    lifecycle = Lifecycle(drain_timeout_s=5.0)
    lifecycle.stop(drain=True, reason="SIGTERM")
    lifecycle.serving()
    assert lifecycle.state is ProcessState.DRAINING


def test_first_signal_drains_a_second_stops_now():
    lifecycle = Lifecycle(drain_timeout_s=5.0)
    lifecycle.serving()
    lifecycle.on_signal(signal.SIGTERM, None)
    assert lifecycle.state is ProcessState.DRAINING
    lifecycle.on_signal(signal.SIGINT, None)
    assert lifecycle.is_stopped and lifecycle.exit_code == 0


def test_one_signal_during_a_drain_from_the_coordinator_still_only_drains():
    """The count is of signals: a Shutdown(drain=True) then one SIGTERM keeps draining (as before the rework)."""
    lifecycle = Lifecycle(drain_timeout_s=5.0)
    lifecycle.serving()
    lifecycle.stop(drain=True, reason="scale-down")
    lifecycle.on_signal(signal.SIGTERM, None)
    assert lifecycle.state is ProcessState.DRAINING
