"""The coordinator's reservations: what API servers routed to a rank that its engine has not reported yet."""

import pytest
from dpserve_shared.schema import FrontendCount, RankCount

from dpserve_coordinator.reservations import Reservations

pytestmark = pytest.mark.timeout(10)


def test_sent_minus_received_summed_over_api_servers():
    res = Reservations()
    res.on_sent("fe-a", [RankCount(0, "e0", 3, 300), RankCount(1, "e1", 1, 10)])
    res.on_sent("fe-b", [RankCount(0, "e0", 2, 20)])
    assert res.reserved(0) == (5, 320) and res.reserved(1) == (1, 10)
    res.on_received(0, "e0", [FrontendCount("fe-a", 2, 200), FrontendCount("fe-b", 2, 20)])
    assert res.reserved(0) == (1, 100)
    res.on_received(0, "e0", [FrontendCount("fe-a", 3, 300)])
    assert res.reserved(0) == (0, 0)


def test_cumulative_reports_make_repeats_and_order_harmless():
    res = Reservations()
    res.on_received(0, "e0", [FrontendCount("fe-a", 4, 40)])  # the engine's report came first
    res.on_sent("fe-a", [RankCount(0, "e0", 4, 40)])
    assert res.reserved(0) == (0, 0)
    res.on_sent("fe-a", [RankCount(0, "e0", 6, 60)])
    res.on_sent("fe-a", [RankCount(0, "e0", 6, 60)])  # the same report again
    assert res.reserved(0) == (2, 20)


def test_version_grows_only_when_a_total_changes():
    res = Reservations()
    v0 = res.version
    res.on_sent("fe-a", [RankCount(0, "e0", 1, 5)])
    v1 = res.version
    res.on_sent("fe-a", [RankCount(0, "e0", 1, 5)])
    assert v1 > v0 and res.version == v1


def test_a_replaced_engine_and_a_gone_api_server_release_their_reservations():
    res = Reservations()
    res.on_sent("fe-a", [RankCount(0, "e0", 5, 50)])
    res.on_sent("fe-b", [RankCount(1, "e1", 2, 20)])
    res.follow({0: "e0-new", 1: "e1"})  # rank 0's engine died and was replaced
    assert res.reserved(0) == (0, 0) and res.reserved(1) == (2, 20)
    res.on_sent("fe-a", [RankCount(0, "e0-new", 1, 10)])  # counted from 0 for the new engine
    assert res.reserved(0) == (1, 10)
    res.drop_frontend("fe-b")
    assert res.reserved(1) == (0, 0)


def test_many_api_servers_see_a_burst_through_the_snapshot():
    """N API servers each routed one request to rank 0 before any snapshot: the next snapshot reserves N."""
    res = Reservations()
    for i in range(8):
        res.on_sent(f"fe-{i}", [RankCount(0, "e0", 1, 100)])
    assert res.reserved(0) == (8, 800)


def test_the_router_counts_reserved_work_as_queued():
    from dpserve_frontend.router import AdmissionLimits, Router
    from dpserve_shared.schema import EngineLoad

    router = Router()
    router.set_serving([0, 1])
    router.update_snapshot([EngineLoad(rank=0, num_reserved=2, num_reserved_tokens=20), EngineLoad(rank=1)])
    assert router.cost(0) == 8 and router.pick() == 1
    limits = AdmissionLimits(max_num_queued_requests=2)
    assert router.pick(limits=limits) == 1  # rank 0's queue (2 reserved) has no room; rank 1 has 1 sent
