"""When an engine reports its load (EngineStats) to the coordinator: receipts at once, other changes at most every
STATS_MIN_INTERVAL_S with the held-back one due at `next_report_s`, the counters every COUNTERS_INTERVAL_S."""

from __future__ import annotations

import zmq

from dpserve_engine.coordinator_link import CoordinatorLink
from dpserve_engine.settings import ServiceSettings
from dpserve_shared.schema import EngineLoad, EngineStats
from dpserve_shared.timing import COUNTERS_INTERVAL_S, STATS_MIN_INTERVAL_S


class _Recorded(CoordinatorLink):
    def __init__(self, ctx):
        super().__init__(ctx, ServiceSettings(coordinator_addr="tcp://127.0.0.1:1"))
        self.sent: list[EngineStats] = []

    def send(self, msg, flags: int = 0) -> None:
        self.sent.append(msg)


def _link():
    ctx = zmq.Context()
    link = _Recorded(ctx)
    return link, ctx


def _close(link, ctx):
    for sock in (link.control, link.broadcast):
        sock.close(0)
    ctx.term()


def test_a_receipt_goes_at_once_and_a_held_back_change_is_due_after_the_interval():
    link, ctx = _link()
    try:
        link.report(EngineLoad(rank=0), 100.0)  # the first report: counters due
        assert len(link.sent) == 1
        link.report(EngineLoad(rank=0, num_running=1), 100.01, num_received=1)  # a request arrived: at once
        assert len(link.sent) == 2 and link.next_stats_s is None
        link.report(EngineLoad(rank=0), 100.02, num_received=1)  # it finished: held back
        assert len(link.sent) == 2
        assert link.next_report_s == 100.01 + STATS_MIN_INTERVAL_S  # the idle engine wakes for it
        link.report(EngineLoad(rank=0), link.next_report_s, num_received=1)
        assert len(link.sent) == 3 and link.sent[-1].load.num_running == 0
        assert link.next_report_s == 100.0 + COUNTERS_INTERVAL_S  # nothing held back: the counters' time
    finally:
        _close(link, ctx)


def test_a_held_back_change_that_went_back_is_not_waited_for():
    link, ctx = _link()
    try:
        link.report(EngineLoad(rank=0), 100.0)
        link.report(EngineLoad(rank=0, num_waiting=1), 100.01)
        assert link.next_stats_s is not None
        link.report(EngineLoad(rank=0), 100.02)  # back to what was sent
        assert link.next_stats_s is None and len(link.sent) == 1
    finally:
        _close(link, ctx)
