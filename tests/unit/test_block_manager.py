"""BlockManager: allocation, ref counts, prefix hits, LRU eviction of freed cached blocks."""

import pytest
from dpserve_shared.schema import SamplingParams

from dpserve_engine.block_manager import BlockManager
from dpserve_engine.sequence import Sequence

pytestmark = pytest.mark.timeout(30)


def make_seq(tokens, rid="r", **params):
    return Sequence(rid, list(tokens), SamplingParams(**params), 0)


def compute_all(bm, seq):
    """Pretend the model computed every token of seq."""
    seq.num_computed_tokens = len(seq)
    bm.cache_blocks(seq)


def test_allocate_and_free_return_every_block():
    bm = BlockManager(8, 4)
    seq = make_seq(range(10))
    assert bm.can_allocate(seq, 10)
    bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_cannot_allocate_beyond_capacity():
    bm = BlockManager(2, 4)
    seq = make_seq(range(9))
    assert not bm.can_allocate(seq, 9)
    assert bm.can_allocate(seq, 8)


def test_append_grows_one_block_at_a_boundary():
    bm = BlockManager(3, 4)
    seq = make_seq(range(4))
    bm.allocate(seq, 4)
    compute_all(bm, seq)
    seq.token_ids.append(99)
    assert bm.can_append(seq, 1)
    bm.may_append(seq, 1)
    assert len(seq.block_table) == 2


def test_prefix_hit_shares_blocks_and_keeps_one_token_to_compute():
    bm = BlockManager(16, 4)
    a = make_seq(range(12), "a")
    bm.allocate(a, 12)
    compute_all(bm, a)
    b = make_seq(list(range(10)) + [70], "b")  # 2 full blocks shared; 3 tokens left to compute in a new block
    assert bm.num_cached_tokens(b) == 8
    bm.allocate(b, 3)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8 and b.num_reused_tokens == 8
    assert bm.ref_counts[a.block_table[0]] == 2
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (23, 8)


def test_fully_cached_prompt_shares_every_block_and_recomputes_only_its_last_token():
    bm = BlockManager(16, 4)
    a = make_seq(range(12), "a")
    bm.allocate(a, 12)
    compute_all(bm, a)
    free_before = bm.num_free_blocks
    b = make_seq(range(12), "b")  # identical prompt that fills its last block: every block is a hit
    assert bm.num_cached_tokens(b) == 11
    assert bm.can_allocate(b, 1)
    bm.allocate(b, 1)
    assert b.block_table == a.block_table and bm.num_free_blocks == free_before  # no block of its own yet
    # the last token is computed again (for its logits) but its K/V, in a's block, is not written again
    assert b.num_computed_tokens == 11 and b.num_uncomputed_tokens == 1 and b.num_reused_tokens == 12
    assert all(bm.ref_counts[x] == 2 for x in a.block_table)
    b.num_computed_tokens = 12
    b.token_ids.append(5)
    bm.may_append(b, 1)  # its first generated token goes to a block of its own
    assert len(b.block_table) == 4 and b.block_table[3] not in a.block_table
    bm.free(b)
    assert b.num_reused_tokens == 0 and all(bm.ref_counts[x] == 1 for x in a.block_table)


def test_freed_cached_blocks_are_hit_then_evicted_lru():
    bm = BlockManager(4, 4)
    a = make_seq(range(9), "a")
    bm.allocate(a, 9)
    compute_all(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.cached_free) == 2
    b = make_seq(list(range(8)) + [50, 51], "b")
    assert bm.num_cached_tokens(b) == 8
    bm.allocate(b, 2)
    assert bm.num_free_blocks == 1
    bm.free(b)
    c = make_seq(range(100, 116), "c")  # needs all 4 blocks: evicts the cached ones
    assert bm.can_allocate(c, 16)
    bm.allocate(c, 16)
    assert bm.num_free_blocks == 0 and not bm.hash_to_block


def test_prefix_hit_counts_lru_blocks_as_not_free():
    bm = BlockManager(3, 4)
    a = make_seq(range(8), "a")
    bm.allocate(a, 8)
    compute_all(bm, a)
    bm.free(a)
    b = make_seq(list(range(8)) + list(range(50, 58)), "b")  # 2 hits (in the LRU) + 2 new blocks > 3
    assert not bm.can_allocate(b, 8)
    assert bm.can_allocate(b, 4)


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    bm = BlockManager(8, 4)
    a = make_seq(range(9), "a")
    bm.allocate(a, 9)
    compute_all(bm, a)
    b = make_seq(range(9), "b", prompt_logprobs=1)
    assert bm.num_cached_tokens(b) == 0
