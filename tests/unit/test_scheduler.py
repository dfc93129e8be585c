"""Scheduler: budgets, decodes first, chunked prefill, preemption by recompute without loss or deadlock."""

import random

import pytest
from dpserve_shared.schema import SamplingParams

from dpserve_engine.block_manager import BlockManager
from dpserve_engine.scheduler import Scheduler
from dpserve_engine.sequence import Sequence, SequenceStatus

pytestmark = pytest.mark.timeout(30)


def make_sched(num_blocks=64, block_size=4, max_num_seqs=4, budget=16):
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget)


def add(sched, rid, prompt_len, max_tokens=4, arrival=0):
    seq = Sequence(rid, [(7 * i + ord(rid[-1])) % 97 for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens), arrival)
    sched.add(seq)
    return seq


def fake_step(sched, batch):
    """What the engine does after the model ran: advance, sample a token at the end, finish at max_tokens."""
    finished = []
    for seq, n in zip(batch.seqs, batch.num_tokens):
        seq.num_computed_tokens += n
        sched.block_manager.cache_blocks(seq)
        if seq.num_computed_tokens == len(seq):
            seq.token_ids.append(1)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq)
                finished.append(seq)
    return finished


def run_to_end(sched, max_steps=1000):
    done, batches = [], []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return done, batches
        batch = sched.schedule()
        assert len(batch) > 0, "no progress: deadlock"
        batches.append([(s.request_id, n) for s, n in zip(batch.seqs, batch.num_tokens)])
        done += fake_step(sched, batch)
    raise AssertionError("did not finish")


def test_budgets_respected_and_everything_finishes():
    sched = make_sched(max_num_seqs=3, budget=10)
    seqs = [add(sched, f"r{i}", 5 + 3 * i, max_tokens=3, arrival=i) for i in range(6)]
    done, batches = run_to_end(sched)
    assert {s.request_id for s in done} == {s.request_id for s in seqs}
    for batch in batches:
        assert sum(n for _, n in batch) <= 10
        assert len(batch) <= 3
    assert sched.block_manager.num_free_blocks == 64


def test_chunked_prefill_completes_a_long_prompt():
    sched = make_sched(budget=8)
    seq = add(sched, "long", 30, max_tokens=2)
    done, batches = run_to_end(sched)
    assert done == [seq] and [b[0][1] for b in batches[:4]] == [8, 8, 8, 6]
    assert seq.num_output_tokens == 2


def test_decodes_are_scheduled_before_prefill_chunks():
    sched = make_sched(budget=8)
    a = add(sched, "a", 4, max_tokens=10)
    sched.schedule()
    fake_step(sched, sched.running and type("B", (), {"seqs": [a], "num_tokens": [4]})())
    add(sched, "b", 20, max_tokens=2, arrival=1)
    batch = sched.schedule()
    assert batch.seqs[0] is a and batch.num_tokens == [1, 7] and batch.num_decodes == 1


def test_preemption_recomputes_and_loses_nothing():
    # 5 blocks of 4 tokens: two sequences growing to 12 tokens (3 blocks) each cannot both fit.
    sched = make_sched(num_blocks=5, block_size=4, max_num_seqs=4, budget=32)
    a = add(sched, "a", 6, max_tokens=6, arrival=0)
    b = add(sched, "b", 6, max_tokens=6, arrival=1)
    done, _ = run_to_end(sched)
    assert {s.request_id for s in done} == {"a", "b"}
    assert sched.num_preemptions > 0
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    assert sched.block_manager.num_free_blocks == 5


def test_random_workload_never_deadlocks():
    rng = random.Random(0)
    sched = make_sched(num_blocks=12, block_size=4, max_num_seqs=5, budget=12)
    seqs = [add(sched, f"r{i}", rng.randint(1, 20), max_tokens=rng.randint(1, 20), arrival=i) for i in range(30)]
    done, _ = run_to_end(sched, max_steps=5000)
    assert len(done) == 30 and all(s.status == SequenceStatus.FINISHED for s in seqs)
    assert sched.block_manager.num_free_blocks == 12


def _same_prompt(sched, rid, prompt, max_tokens=2, arrival=0):
    seq = Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens), arrival)
    sched.add(seq)
    return seq


def test_identical_prompts_arriving_together_are_prefilled_once():
    """Four copies of a 17-token prompt (4 full blocks + 1): the first computes it; the others wait one step and
    take its blocks from the prefix cache, computing only the last token. Distinct prompts are not held back."""
    sched = make_sched(num_blocks=64, block_size=4, max_num_seqs=8, budget=64)
    prompt = [(5 * i + 3) % 97 for i in range(17)]
    copies = [_same_prompt(sched, f"same{i}", prompt, arrival=i) for i in range(4)]
    first = sched.schedule()
    assert [(s.request_id, n) for s, n in zip(first.seqs, first.num_tokens)] == [("same0", 17)]
    fake_step(sched, first)
    second = sched.schedule()
    assert sorted((s.request_id, n) for s, n in zip(second.seqs, second.num_tokens)) == [
        ("same0", 1), ("same1", 1), ("same2", 1), ("same3", 1)
    ]
    assert all(c.num_cached_tokens == 16 for c in copies[1:])
    done, _ = run_to_end(sched)
    assert {s.request_id for s in done} == {c.request_id for c in copies}
    assert sched.block_manager.num_free_blocks == 64

    other = make_sched(num_blocks=64, block_size=4, max_num_seqs=8, budget=64)
    distinct = [add(other, f"d{i}", 17, arrival=i) for i in range(4)]
    batch = other.schedule()
    assert batch.num_tokens == [17, 17, 17, 13] and batch.seqs == distinct  # the budget, not a prefix, stops d3


def test_take_expired_removes_only_never_scheduled_requests_that_waited_too_long():
    sched = make_sched(max_num_seqs=1)
    running = add(sched, "r0", 4, max_tokens=50)
    sched.schedule()  # r0 runs; the others wait behind max_num_seqs
    old, preempted, moved, young = (add(sched, f"r{i}", 4) for i in (1, 2, 3, 4))
    old.arrival_s, preempted.arrival_s, moved.arrival_s, young.arrival_s = 1.0, 1.0, 2.0, 9.0
    running.arrival_s = 0.0
    preempted.first_scheduled_s = 1.5  # it ran before and was preempted
    moved.is_continuation = True  # a moved request's rest
    expired = sched.take_expired(arrived_before=5.0)
    assert expired == [old] and old.status == SequenceStatus.FINISHED
    assert list(sched.waiting) == [preempted, moved, young]
    assert sched.running == [running]
    assert sched.take_expired(arrived_before=5.0) == []
