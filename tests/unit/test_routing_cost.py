"""Cache-aware routing: the estimated time to first token (routing_cost.py) and the router's use of it, the
round-robin policy, and the same choice by two routers given the same view."""

import pytest
from dpserve_shared.block_hash import block_hashes
from dpserve_shared.schema import EngineLoad

from dpserve_frontend.prefix_index import PrefixIndex
from dpserve_frontend.router import BALANCE_ABS, BALANCE_REL, AdmissionLimits, QueuesFull, Router, RoutingPolicy
from dpserve_frontend.routing_cost import (
    DEFAULT_PREFILL_TOKENS_PER_S,
    KV_PRESSURE_S,
    PromptMatch,
    RankState,
    estimated_ttft_s,
    slot_wait_s,
)

pytestmark = pytest.mark.timeout(10)

BS = 16


def test_uncached_and_queued_tokens_over_the_prefill_rate():
    state = RankState(num_queued_tokens=500, prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0)
    assert estimated_ttft_s(state, 1000, num_cached_tokens=500) == pytest.approx((500 + 500) / 1000)
    busy = RankState(num_queued_tokens=0, num_running=50, prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0)
    assert estimated_ttft_s(busy, 1000) == pytest.approx(1.0 + 0.5)  # decode pressure: one step of 50 rows


def test_unmeasured_rates_use_the_defaults():
    assert estimated_ttft_s(RankState(), 2000) == pytest.approx(2000 / DEFAULT_PREFILL_TOKENS_PER_S)


def test_kv_pressure_grows_past_the_soft_limit():
    calm = RankState(kv_blocks_used=10, kv_blocks_total=100)
    full = RankState(kv_blocks_used=100, kv_blocks_total=100)
    assert estimated_ttft_s(calm, 16, block_size=BS) == pytest.approx(16 / DEFAULT_PREFILL_TOKENS_PER_S)
    assert estimated_ttft_s(full, 16, block_size=BS) == pytest.approx(16 / DEFAULT_PREFILL_TOKENS_PER_S + KV_PRESSURE_S)


def test_cached_tokens_leave_one_token_to_compute():
    match = PromptMatch(num_tokens=32, cached_blocks={0: 2}, block_size=BS)
    assert match.num_cached_tokens(0) == 31 and match.num_cached_tokens(1) == 0


# -- the router ----------------------------------------------------------------------------------------------------


def router_with(policy, loads, ranks=(0, 1, 2)):
    router = Router(policy)
    router.set_serving(ranks)
    router.update_snapshot(loads)
    return router


def loads(**per_rank):
    """rank_N=(waiting_tokens, running) with measured rates 1000 prefill / 100 decode tokens per second."""
    return [EngineLoad(rank=int(name.split("_")[1]), num_waiting=1 if wt else 0, num_waiting_tokens=wt,
                       num_running=run, prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0)
            for name, (wt, run) in per_rank.items()]  # fmt: skip


def match_on(index: PrefixIndex, prompt: list[int]) -> PromptMatch:
    hashes = block_hashes(prompt, BS, max_blocks=(len(prompt) - 1) // BS)
    return PromptMatch(len(prompt), index.match(hashes), BS, tie_key=hashes[0])


def test_the_rank_holding_the_prefix_wins_while_its_queue_is_short():
    prompt = list(range(1000))
    index = PrefixIndex()
    index.blocks.store(1, block_hashes(prompt, BS))
    router = router_with(RoutingPolicy.CACHE_AWARE, loads(rank_0=(0, 0), rank_1=(200, 0), rank_2=(0, 0)))
    assert router.pick(num_tokens=1000, prompt=match_on(index, prompt)) == 1  # 0.2 s queue vs 1 s of prefill


def test_a_long_queue_outweighs_the_cache_hit():
    prompt = list(range(1000))
    index = PrefixIndex()
    index.blocks.store(1, block_hashes(prompt, BS))
    router = router_with(RoutingPolicy.CACHE_AWARE, loads(rank_0=(0, 0), rank_1=(5000, 0), rank_2=(0, 0)))
    assert router.pick(num_tokens=1000, prompt=match_on(index, prompt)) in (0, 2)


def test_own_sends_count_their_uncached_tokens_as_queued():
    prompt = list(range(1000))
    index = PrefixIndex()
    router = router_with(RoutingPolicy.CACHE_AWARE, loads(rank_0=(0, 0), rank_1=(0, 0), rank_2=(0, 0)))
    picks = [router.pick(num_tokens=1000, prompt=match_on(index, prompt)) for _ in range(3)]
    assert sorted(picks) == [0, 1, 2]  # nothing cached: each send queues 1000 tokens on its rank
    index.blocks.store(1, block_hashes(prompt, BS))
    hits = [router.pick(num_tokens=1000, prompt=match_on(index, prompt)) for _ in range(3)]
    assert hits == [1, 1, 1]  # a hit queues one token: the holder stays the cheapest


def test_two_routers_given_the_same_view_make_the_same_choice():
    index = PrefixIndex()
    view = loads(rank_0=(0, 2), rank_1=(0, 2), rank_2=(0, 2))  # all equal: ties
    for seed in range(20):
        prompt = [seed] * 64
        a = router_with(RoutingPolicy.CACHE_AWARE, view)
        b = router_with(RoutingPolicy.CACHE_AWARE, view)
        b.pick()  # b's own rotation moved on: it must not matter
        b.update_snapshot(view)  # (the same view again: the snapshot replaces b's own count of that send)
        assert a.pick(num_tokens=64, prompt=match_on(index, prompt)) == b.pick(num_tokens=64,
                                                                                prompt=match_on(index, prompt))


def test_ties_spread_different_prompts():
    index = PrefixIndex()
    view = loads(rank_0=(0, 0), rank_1=(0, 0), rank_2=(0, 0))
    picks = {router_with(RoutingPolicy.CACHE_AWARE, view).pick(num_tokens=64, prompt=match_on(index, [s] * 64))
             for s in range(30)}  # fmt: skip
    assert picks == {0, 1, 2}


def test_cache_aware_respects_admission_limits():
    prompt = list(range(100))
    index = PrefixIndex()
    index.blocks.store(1, block_hashes(prompt, BS))
    router = router_with(RoutingPolicy.CACHE_AWARE, loads(rank_0=(0, 0), rank_1=(50, 0), rank_2=(0, 0)))
    limits = AdmissionLimits(max_num_queued_requests=1)
    assert router.pick(num_tokens=100, prompt=match_on(index, prompt), limits=limits) in (0, 2)
    with pytest.raises(QueuesFull):
        router.pick(pinned_rank=1, num_tokens=100, limits=limits)


def test_round_robin_takes_turns_and_skips_full_queues():
    router = router_with(RoutingPolicy.ROUND_ROBIN, loads(rank_0=(0, 9), rank_1=(10, 0), rank_2=(0, 0)))
    assert [router.pick() for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    limits = AdmissionLimits(max_num_queued_requests=3)
    assert router.pick(limits=limits) == 0
    # rank 1's queue (1 waiting + 2 sent) is full: its turn goes to the next
    assert router.pick(limits=limits) == 2


# -- sessions (X-Session-Id) ---------------------------------------------------------------------------------------


def test_a_session_stays_on_its_rank_until_it_saturates():
    from dpserve_frontend.router import SESSION_SLACK

    router = router_with(RoutingPolicy.LEAST_LOADED, loads(rank_0=(0, 0), rank_1=(0, 0), rank_2=(0, 0)))
    first = router.pick(session_id="conv")
    assert all(router.pick(session_id="conv") == first for _ in range(SESSION_SLACK))
    assert router.pick(session_id="conv") != first  # its queue is SESSION_SLACK + 1 longer than the others'
    assert router.pick(session_id="other") not in ()  # other sessions route by the policy


def test_a_session_leaves_a_rank_that_stops_serving_or_is_full():
    router = router_with(RoutingPolicy.ROUND_ROBIN, loads(rank_0=(0, 0), rank_1=(0, 0)), ranks=(0, 1))
    first = router.pick(session_id="conv")
    router.set_serving([r for r in (0, 1) if r != first])
    assert router.pick(session_id="conv") != first
    second = 1 - first
    router.set_serving([0, 1])
    router.update_snapshot([EngineLoad(rank=second, num_waiting=3), EngineLoad(rank=first)])
    limits = AdmissionLimits(max_num_queued_requests=3)
    assert router.pick(session_id="conv", limits=limits) == first  # its rank has no room now


def test_each_pick_says_why_its_rank_was_chosen():
    prompt = list(range(1000))
    index = PrefixIndex()
    index.blocks.store(1, block_hashes(prompt, BS))
    router = router_with(RoutingPolicy.CACHE_AWARE, loads(rank_0=(0, 0), rank_1=(0, 0), rank_2=(0, 0)))
    assert router.pick(num_tokens=1000, prompt=match_on(index, prompt)) == 1 and router.last_reason == "prefix"
    other = list(range(5000, 6000))  # cached nowhere: the lowest cost
    router.pick(num_tokens=1000, prompt=match_on(index, other))
    assert router.last_reason == "load"
    assert router.pick(pinned_rank=2) == 2 and router.last_reason == "pinned"
    first = router.pick(session_id="conv")
    assert router.pick(session_id="conv") == first and router.last_reason == "session"


def test_no_slot_wait_while_the_batch_has_room():
    roomy = RankState(num_running=2, num_queued=1, max_num_seqs=4, decode_tokens_per_s=100.0)
    assert slot_wait_s(roomy, num_output_tokens=64) == 0.0
    assert slot_wait_s(RankState(num_running=100, num_queued=100), 64) == 0.0  # capacity unknown: no term


def test_the_slot_wait_grows_with_the_sequences_beyond_the_batch():
    # full batch of 4 at 100 tok/s: a step is 0.04 s; one finishes every 0.04 * (64 / 2) / 4 = 0.32 s
    full = RankState(num_running=4, num_queued=0, max_num_seqs=4, decode_tokens_per_s=100.0)
    assert slot_wait_s(full, 64) == pytest.approx(0.32)
    longer = RankState(num_running=4, num_queued=3, max_num_seqs=4, decode_tokens_per_s=100.0)
    assert slot_wait_s(longer, 64) == pytest.approx(4 * 0.32)


def test_a_burst_of_prefix_hits_stays_on_the_holder_until_its_batch_is_full_then_spills():
    """Sticky until saturated: the holder takes the hits while it has batch slots (a hit saves a 1 s prefill);
    once its batch (max_num_seqs 4) is full and the queue beyond it costs more than the prefill, others get them."""
    prompt = list(range(1000))
    index = PrefixIndex()
    index.blocks.store(1, block_hashes(prompt, BS))
    view = [EngineLoad(rank=r, max_num_seqs=4, prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0)
            for r in (0, 1, 2)]  # fmt: skip
    router = router_with(RoutingPolicy.CACHE_AWARE, view)
    hashes = block_hashes(prompt, BS, max_blocks=(len(prompt) - 1) // BS)
    match = PromptMatch(len(prompt), index.match(hashes), BS, tie_key=hashes[0], num_output_tokens=64)
    picks = [router.pick(num_tokens=1000, prompt=match) for _ in range(12)]
    assert picks[:4] == [1, 1, 1, 1], picks  # room in the holder's batch
    assert set(picks[4:]) & {0, 2}, picks  # spilled once the wait for a slot passed the prefill saved
    assert picks.count(1) < len(picks)


def test_equal_estimates_go_to_the_rank_with_fewest_sequences():
    """Ranks whose decode steps take the same time (a null engine, or a CPU at small batches) tie on the
    estimate whatever their batch; the least-loaded cost settles it, so a burst spreads."""
    view = [EngineLoad(rank=r, num_running=run, prefill_tokens_per_s=1000.0, decode_tokens_per_s=run / 0.01)
            for r, run in ((0, 4), (1, 2), (2, 8))]  # fmt: skip
    index = PrefixIndex()
    for seed in range(10):
        router = router_with(RoutingPolicy.CACHE_AWARE, view)
        assert router.pick(num_tokens=64, prompt=match_on(index, [seed] * 64)) == 1


def test_a_rank_that_has_not_measured_its_rates_is_assumed_as_fast_as_its_peers():
    """A rank that never prefilled (new, or only prefix hits so far) must not look slower than the one that did
    (the defaults are a guess): equal ranks, one measured, split distinct prompts evenly."""
    view = [EngineLoad(rank=0, prefill_tokens_per_s=8000.0, decode_tokens_per_s=800.0), EngineLoad(rank=1)]
    router = router_with(RoutingPolicy.CACHE_AWARE, view, ranks=(0, 1))
    index = PrefixIndex()
    picks = [router.pick(num_tokens=256, prompt=match_on(index, [seed] * 256)) for seed in range(10)]
    assert picks.count(0) == picks.count(1) == 5, picks


def test_a_popular_prefix_does_not_pile_up_on_its_holder():
    """Load guard: the holder takes hits while it has at most BALANCE_ABS / BALANCE_REL more sequences than the
    mean (in the snapshot), then the others take them (and compute the prefix, so they hold it too)."""
    prompt = list(range(1000))
    index = PrefixIndex()
    index.blocks.store(1, block_hashes(prompt, BS))
    hashes = block_hashes(prompt, BS, max_blocks=(len(prompt) - 1) // BS)
    match = PromptMatch(len(prompt), index.match(hashes), BS, tie_key=hashes[0], num_output_tokens=16)

    def pick_with_holder_running(holder_running: int) -> int:
        view = [EngineLoad(rank=r, num_running=run, prefill_tokens_per_s=1000.0, decode_tokens_per_s=run / 0.01)
                for r, run in ((0, 4), (1, holder_running), (2, 4), (3, 4))]  # fmt: skip
        return router_with(RoutingPolicy.CACHE_AWARE, view, ranks=(0, 1, 2, 3)).pick(num_tokens=1000, prompt=match)

    assert pick_with_holder_running(6) == 1  # mean 4.5, limit 6.5: the holder saves a 1 s prefill
    assert pick_with_holder_running(7) != 1  # mean 4.75, limit 6.75: skipped


def test_a_burst_between_snapshots_spreads_under_the_load_guard():
    """The guard counts the picks since the snapshot: a burst of 32 new prompts, rank 1 reporting 8 running and
    rank 0 none, must not go whole to rank 0 (it did when only the engines' own reports counted: rank 1 stayed
    over the limit until the next snapshot, then the 32 finished together and the next burst went whole to rank 1)."""
    view = [EngineLoad(rank=0, prefill_tokens_per_s=400.0, decode_tokens_per_s=140.0),
            EngineLoad(rank=1, num_running=8, prefill_tokens_per_s=400.0, decode_tokens_per_s=140.0)]  # fmt: skip
    router = router_with(RoutingPolicy.CACHE_AWARE, view, ranks=(0, 1))
    index = PrefixIndex()
    picks = [router.pick(num_tokens=128, prompt=match_on(index, [1000 + i] * 128)) for i in range(32)]
    on_0, on_1 = picks.count(0), 8 + picks.count(1)
    mean = (on_0 + on_1) / 2
    assert max(on_0, on_1) <= mean + max(BALANCE_ABS, BALANCE_REL * mean), picks  # within the guard's slack


def test_requests_that_ended_before_the_next_snapshot_do_not_count_against_their_rank():
    """One after the other, ten prefix hits within one snapshot interval all go to the holder: each ended (the API
    server saw its last output) before the next was routed, so the load guard does not count it."""
    prompt = list(range(512))
    index = PrefixIndex()
    index.blocks.store(1, block_hashes(prompt, BS))
    router = router_with(RoutingPolicy.CACHE_AWARE, loads(rank_0=(0, 0), rank_1=(0, 0)), ranks=(0, 1))
    picks = []
    for i in range(10):
        picks.append(router.pick(num_tokens=len(prompt) + 1, prompt=match_on(index, prompt + [i])))
        router.finished(picks[-1], router.epoch, 1)
    assert picks == [1] * 10, picks
    # without `finished` the guard counts them until the next snapshot and spills
    spilled = router_with(RoutingPolicy.CACHE_AWARE, loads(rank_0=(0, 0), rank_1=(0, 0)), ranks=(0, 1))
    assert 0 in [spilled.pick(num_tokens=len(prompt) + 1, prompt=match_on(index, prompt + [i])) for i in range(10)]
    # one sent before the current snapshot is the snapshot's: `finished` leaves the counts alone
    router.pick(num_tokens=len(prompt) + 1, prompt=match_on(index, prompt + [99]))
    epoch = router.epoch
    router.update_snapshot(loads(rank_0=(0, 0), rank_1=(0, 1)))
    router.pick(num_tokens=len(prompt) + 1, prompt=match_on(index, prompt + [98]))
    router.finished(1, epoch, 1)
    assert router._loads[1].num_sent == 1
