"""The frontend's router: lowest 4*waiting + running from the snapshot plus local sends, ties rotated."""

import pytest

from dpserve_frontend.router import AdmissionLimits, NoEngineAvailable, QueuesFull, RankNotServing, Router
from dpserve_shared.schema import EngineLoad

pytestmark = pytest.mark.timeout(10)


def make_router(ranks, loads=None):
    router = Router()
    router.set_serving(ranks)
    if loads:
        router.update_snapshot([EngineLoad(rank=r, num_waiting=w, num_running=run) for r, (w, run) in loads.items()])
    return router


def test_picks_lowest_cost_waiting_weighs_four():
    # rank 0: 4*1 + 0 = 4, rank 1: 4*0 + 3 = 3 -> rank 1
    router = make_router([0, 1], {0: (1, 0), 1: (0, 3)})
    assert router.pick() == 1
    # rank 0: 4, rank 1: 3 + 4 (one local send) = 7 -> rank 0
    assert router.pick() == 0


def test_local_sends_spread_a_burst_between_snapshots():
    router = make_router([0, 1, 2], {0: (0, 0), 1: (0, 0), 2: (0, 0)})
    picks = [router.pick() for _ in range(9)]
    assert sorted(picks.count(r) for r in range(3)) == [3, 3, 3]


def test_snapshot_replaces_local_sends():
    router = make_router([0, 1], {0: (0, 0), 1: (0, 0)})
    for _ in range(4):
        router.pick()
    assert router.cost(0) == 8 and router.cost(1) == 8
    router.update_snapshot([EngineLoad(rank=0, num_waiting=0, num_running=1), EngineLoad(rank=1, num_running=2)])
    assert router.cost(0) == 1 and router.cost(1) == 2
    assert router.pick() == 0


def test_ties_rotate():
    router = make_router([0, 1, 2])
    picks = []
    for _ in range(6):
        picks.append(router.pick())
        router.update_snapshot([])  # every pick sees equal loads again
    assert picks == [0, 1, 2, 0, 1, 2]


def test_num_seqs_counts_all_children():
    router = make_router([0, 1])
    assert router.pick(num_seqs=3) == 0
    assert router.cost(0) == 12
    assert router.pick() == 1
    assert router.pick() == 1  # rank 1 at 4 < 12


def test_pinned_rank():
    router = make_router([0, 1], {0: (0, 0), 1: (10, 10)})
    assert router.pick(pinned_rank=1) == 1
    assert router.cost(1) == 4 * 11 + 10
    with pytest.raises(RankNotServing, match="rank 5 is not serving"):
        router.pick(pinned_rank=5)


def test_only_serving_ranks_and_none():
    router = make_router([0, 1, 2], {0: (0, 0), 1: (5, 5), 2: (5, 5)})
    router.set_serving([1, 2])
    assert router.pick() in (1, 2)
    with pytest.raises(RankNotServing):
        router.pick(pinned_rank=0)
    router.set_serving([])
    with pytest.raises(NoEngineAvailable):
        router.pick()


def test_snapshot_for_unknown_rank_ignored():
    router = make_router([0])
    router.update_snapshot([EngineLoad(rank=7, num_waiting=3)])
    assert router.pick() == 0


# -- admission control (--max-num-queued-requests / --max-num-queued-tokens) ---------------------------------------


def test_no_limits_means_no_admission_control():
    router = make_router([0], {0: (1000, 0)})
    assert router.pick(num_tokens=10**6, limits=AdmissionLimits()) == 0
    assert router.pick(num_tokens=10**6, limits=None) == 0


def test_full_ranks_are_skipped_then_everything_is_refused_by_the_request_cap():
    limits = AdmissionLimits(max_num_queued_requests=2)
    # rank 0 has 2 waiting (full), rank 1 has 1 waiting and many running (the higher cost, but room for one)
    router = make_router([0, 1], {0: (2, 0), 1: (1, 40)})
    assert router.pick(limits=limits) == 1
    with pytest.raises(QueuesFull, match="--max-num-queued-requests 2") as refused:
        router.pick(limits=limits)  # rank 1: 1 waiting + 1 sent since the snapshot
    assert refused.value.reason == "queued_requests"
    # a new snapshot: the engines took their waiting requests
    router.update_snapshot([EngineLoad(rank=0, num_waiting=0), EngineLoad(rank=1, num_waiting=0)])
    assert router.pick(limits=limits) in (0, 1)


def test_local_sends_count_until_the_next_snapshot():
    limits = AdmissionLimits(max_num_queued_requests=3)
    router = make_router([0, 1])
    picks = [router.pick(limits=limits) for _ in range(6)]
    assert sorted(picks) == [0, 0, 0, 1, 1, 1]
    with pytest.raises(QueuesFull):
        router.pick(limits=limits)
    with pytest.raises(QueuesFull):
        router.pick(num_seqs=2, limits=limits)


def test_token_cap_and_the_reason_it_names():
    limits = AdmissionLimits(max_num_queued_requests=10, max_num_queued_tokens=100)
    router = make_router([0])
    router.update_snapshot([EngineLoad(rank=0, num_waiting=1, num_waiting_tokens=60)])
    assert router.pick(num_tokens=40, limits=limits) == 0  # 60 + 40 = 100 fits
    with pytest.raises(QueuesFull, match="--max-num-queued-tokens 100") as refused:
        router.pick(num_tokens=1, limits=limits)
    assert refused.value.reason == "queued_tokens"


def test_an_empty_queue_takes_a_request_larger_than_the_caps():
    limits = AdmissionLimits(max_num_queued_requests=1, max_num_queued_tokens=10)
    router = make_router([0], {0: (0, 5)})
    assert router.pick(num_seqs=4, num_tokens=500, limits=limits) == 0
    with pytest.raises(QueuesFull):
        router.pick(num_tokens=1, limits=limits)


def test_a_pinned_request_is_judged_on_its_rank_alone():
    limits = AdmissionLimits(max_num_queued_requests=1)
    router = make_router([0, 1], {0: (1, 0), 1: (0, 0)})
    with pytest.raises(QueuesFull, match="rank 0's queue is full"):
        router.pick(pinned_rank=0, limits=limits)
    assert router.pick(pinned_rank=1, limits=limits) == 1


def test_a_refusal_counts_no_send_and_resends_are_never_refused():
    limits = AdmissionLimits(max_num_queued_requests=1)
    router = make_router([0, 1], {0: (1, 0), 1: (1, 0)})
    cost_before = (router.cost(0), router.cost(1))
    with pytest.raises(QueuesFull):
        router.pick(limits=limits)
    assert (router.cost(0), router.cost(1)) == cost_before
    assert router.pick(exclude=0) == 1  # a re-send (no limits): its request was accepted already
