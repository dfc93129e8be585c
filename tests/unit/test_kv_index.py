"""The prefix-cache index: the shared BlockIndex, the coordinator's KvIndex (events in, deltas and snapshots out),
the frontend's PrefixIndex mirror (deltas in order, gaps, a new coordinator, resync), and the engine's KV events
(BlockManager)."""

import pytest
from dpserve_shared.block_hash import block_hashes
from dpserve_shared.block_index import BlockIndex
from dpserve_shared.codec import encode, from_coordinator_decoder
from dpserve_shared.schema import KvDelta, KvEvents, RankBlocks, SamplingParams

from dpserve_coordinator.kv_index import RESYNC_INTERVAL_S, KvIndex
from dpserve_engine.block_manager import BlockManager
from dpserve_engine.sequence import Sequence
from dpserve_frontend.prefix_index import PrefixIndex

pytestmark = pytest.mark.timeout(30)


# -- BlockIndex -----------------------------------------------------------------------------------------------------


def test_match_counts_leading_blocks_per_rank():
    index = BlockIndex()
    index.store(0, [1, 2, 3])
    index.store(1, [1, 2])
    index.store(2, [2, 3])  # not the first block: no match
    index.store(63, [1])
    assert index.match([1, 2, 3, 4]) == {0: 3, 1: 2, 63: 1}
    assert index.match([9, 1]) == {}
    assert index.match([]) == {}


def test_remove_and_clear_rank():
    index = BlockIndex()
    index.store(0, [1, 2])
    index.store(1, [1, 2])
    index.remove(0, [2, 7])  # 7: not held, ignored
    assert index.match([1, 2]) == {0: 1, 1: 2}
    index.clear_rank(1)
    assert index.match([1, 2]) == {0: 1}
    assert index.ranks() == [0] and index.num_blocks(1) == 0
    index.apply(RankBlocks(0, stored=[5], reset=True))
    assert index.blocks_of(0) == [5]


# -- KvIndex (coordinator) ------------------------------------------------------------------------------------------


def events(seq, stored=(), removed=(), snapshot=False):
    return KvEvents(seq, list(stored), list(removed), snapshot)


def test_events_in_order_become_one_net_delta():
    index = KvIndex(index_id=7)
    assert not index.on_events(0, "e0", events(1, [1, 2]), 0.0)
    assert not index.on_events(0, "e0", events(2, [3], [1]), 0.0)
    assert not index.on_events(1, "e1", events(1, [1]), 0.0)
    delta = index.take_delta()
    assert (delta.index_id, delta.seq) == (7, 1)
    by_rank = {r.rank: r for r in delta.ranks}
    assert sorted(by_rank[0].stored) == [2, 3] and by_rank[0].removed == [1]
    assert by_rank[1].stored == [1]
    assert index.take_delta() is None  # nothing new
    assert index.blocks.match([1]) == {1: 1}


def test_gap_asks_for_a_snapshot_once_per_interval_and_the_snapshot_replaces():
    index = KvIndex(index_id=1)
    index.on_events(0, "e0", events(1, [1, 2]), 0.0)
    assert index.on_events(0, "e0", events(3, [9]), 0.0)  # seq 2 missing
    assert not index.on_events(0, "e0", events(4, [10]), 0.1)  # asked already; not applied
    assert index.on_events(0, "e0", events(5, [11]), RESYNC_INTERVAL_S + 0.1)  # ask again
    assert not index.blocks.holds(0, 9)
    index.take_delta()
    index.on_events(0, "e0", events(6, [2, 12], snapshot=True), 2.0)
    assert sorted(index.blocks.blocks_of(0)) == [2, 12]
    delta = index.take_delta()
    assert delta.ranks[0].reset and sorted(delta.ranks[0].stored) == [2, 12]
    assert not index.on_events(0, "e0", events(7, [13]), 2.0)  # in order again
    assert index.blocks.holds(0, 13)


def test_a_re_registered_engine_after_a_coordinator_restart_resyncs():
    index = KvIndex(index_id=2)  # a new coordinator: the engine's numbers started long ago
    assert index.on_events(0, "e0", events(57, [1]), 0.0)
    assert not index.blocks.holds(0, 1)


def test_a_replaced_or_dead_rank_loses_its_blocks():
    index = KvIndex(index_id=1)
    index.on_events(0, "e0", events(1, [1, 2]), 0.0)
    index.on_events(1, "e1", events(1, [1]), 0.0)
    index.take_delta()
    assert not index.on_events(0, "e0-new", events(1, [5]), 0.0)  # a new engine on rank 0 starts from 1
    assert index.blocks.blocks_of(0) == [5]
    index.follow({0: "e0-new"})  # rank 1 is gone
    assert index.blocks.match([1]) == {}
    delta = index.take_delta()
    by_rank = {r.rank: r for r in delta.ranks}
    assert by_rank[0].reset and by_rank[0].stored == [5]
    assert by_rank[1].reset and by_rank[1].stored == []


# -- PrefixIndex (frontend) -----------------------------------------------------------------------------------------


def make_pair():
    coordinator = KvIndex(index_id=3)
    return coordinator, PrefixIndex()


def publish(coordinator, rank, seq, stored=(), removed=(), engine="e"):
    coordinator.on_events(rank, f"{engine}{rank}", events(seq, stored, removed), 0.0)
    delta = coordinator.take_delta()
    return frontend_decoder_roundtrip(delta)


def frontend_decoder_roundtrip(message):
    return from_coordinator_decoder().decode(encode(message))


def test_mirror_needs_a_snapshot_then_follows_deltas():
    coordinator, mirror = make_pair()
    first = publish(coordinator, 0, 1, [1, 2])
    mirror.on_delta(first)
    assert not mirror.is_synced and mirror.wants_snapshot(0.0) and not mirror.wants_snapshot(0.5)
    second = publish(coordinator, 0, 2, [3])  # published before the snapshot is taken, arrives before it
    mirror.on_delta(second)
    mirror.on_snapshot(frontend_decoder_roundtrip(coordinator.snapshot()))
    assert mirror.is_synced and mirror.seq == 2
    mirror.on_delta(publish(coordinator, 0, 3, [4], [1]))
    assert mirror.match([1]) == {} and sorted(mirror.blocks.blocks_of(0)) == sorted(coordinator.blocks.blocks_of(0))


def test_mirror_applies_kept_deltas_after_an_older_snapshot():
    coordinator, mirror = make_pair()
    publish(coordinator, 0, 1, [1])
    snapshot = frontend_decoder_roundtrip(coordinator.snapshot())  # as of seq 1
    later = publish(coordinator, 0, 2, [2])  # arrives on PUB before the snapshot does (another socket)
    mirror.on_delta(later)
    mirror.on_snapshot(snapshot)
    assert mirror.is_synced and mirror.seq == 2 and mirror.match([1, 2]) == {0: 2}


def test_gap_and_new_coordinator_resync():
    coordinator, mirror = make_pair()
    mirror.on_snapshot(coordinator.snapshot())
    mirror.on_delta(publish(coordinator, 0, 1, [1]))
    assert mirror.is_synced
    publish(coordinator, 0, 2, [2])  # lost
    mirror.on_delta(publish(coordinator, 0, 3, [3]))
    assert not mirror.is_synced and mirror.wants_snapshot(10.0)
    mirror.on_snapshot(coordinator.snapshot())
    assert mirror.is_synced and mirror.match([1, 2]) == {0: 2}
    restarted = KvIndex(index_id=4)
    restarted.on_events(0, "e0", events(1, [1], snapshot=True), 0.0)
    mirror.on_delta(restarted.take_delta())  # same seq 1, another index: out of sync
    assert not mirror.is_synced
    mirror.on_snapshot(restarted.snapshot())
    assert mirror.index_id == 4 and mirror.match([1, 2]) == {0: 1}


def test_two_mirrors_of_the_same_stream_agree():
    coordinator = KvIndex(index_id=5)
    a, b = PrefixIndex(), PrefixIndex()
    a.on_snapshot(coordinator.snapshot())
    engine_seq = {0: 0, 1: 0}
    for step in range(1, 7):
        rank = step % 2
        engine_seq[rank] += 1
        delta = publish(coordinator, rank, engine_seq[rank], [step, step + 10], [step - 2])
        a.on_delta(delta)
        if step == 3:
            b.on_snapshot(coordinator.snapshot())  # b joins late
        elif step > 3:
            b.on_delta(delta)
    for rank in (0, 1):
        assert sorted(a.blocks.blocks_of(rank)) == sorted(b.blocks.blocks_of(rank)) == sorted(
            coordinator.blocks.blocks_of(rank))


def test_wire_round_trip_keeps_the_delta():
    delta = KvDelta(1, 2, [RankBlocks(3, [2**63 - 1], [0], True)])
    assert frontend_decoder_roundtrip(delta) == delta


# -- the engine's KV events -----------------------------------------------------------------------------------------


def compute_all(bm, seq):
    seq.num_computed_tokens = len(seq)
    bm.cache_blocks(seq)


def test_block_manager_reports_stored_and_evicted_hashes_net():
    bm = BlockManager(4, 4)
    bm.start_kv_events()
    a = Sequence("a", list(range(9)), SamplingParams(), 0)
    bm.allocate(a, 9)
    compute_all(bm, a)
    stored, removed = bm.take_kv_events()
    assert stored == block_hashes(list(range(9)), 4) and removed == []
    assert bm.take_kv_events() == ([], [])
    bm.free(a)
    b = Sequence("b", list(range(100, 116)), SamplingParams(), 1)  # needs all 4 blocks: evicts a's two
    bm.allocate(b, 16)
    stored, removed = bm.take_kv_events()
    assert stored == [] and sorted(removed) == sorted(block_hashes(list(range(9)), 4))
    assert bm.cached_hashes() == []


def test_block_manager_records_nothing_unless_started():
    bm = BlockManager(4, 4)
    a = Sequence("a", list(range(8)), SamplingParams(), 0)
    bm.allocate(a, 8)
    compute_all(bm, a)
    assert bm.take_kv_events() == ([], [])
    assert len(bm.cached_hashes()) == 2
