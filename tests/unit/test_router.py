"""The frontend's router: lowest 4*waiting + running from the snapshot plus local sends, ties rotated."""

import pytest

from dpserve_frontend.router import NoEngineAvailable, RankNotServing, Router
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
