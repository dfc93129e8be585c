"""The null engine's --max-queue-time-s: a request that waited too long unscheduled ends as EngineCore's would."""

import pytest

from dpserve_engine.null_core import NullEngineCore
from dpserve_shared.schema import EngineRequest, FinishReason, SamplingParams

pytestmark = pytest.mark.timeout(10)


def test_null_core_ends_requests_that_waited_longer_than_max_queue_time(model_info):
    core = NullEngineCore(model_info, max_num_seqs=1, max_queue_time_s=5.0)
    core.add_request(EngineRequest("running", [1, 2, 3], SamplingParams(max_tokens=10)))
    core.step()
    core.add_request(EngineRequest("stale", [1, 2, 3], SamplingParams(max_tokens=2)))
    core.add_request(EngineRequest("moved", [1, 2, 3], SamplingParams(max_tokens=2), num_generated=4))
    core.add_request(EngineRequest("fresh", [1, 2, 3], SamplingParams(max_tokens=2)))
    for request_id in ("stale", "moved"):
        core._waiting[request_id].arrival_s -= 60.0  # as if they had waited a minute (no clock in unit tests)
    outputs = {o.request_id: o for o in core.step()}
    assert outputs["stale"].finish_reason == FinishReason.ERROR and outputs["stale"].retry_reason == "queue_time"
    assert "moved" not in outputs and "fresh" not in outputs  # a continuation is exempt; "fresh" is young
    assert core.load().num_waiting == 2


def test_null_core_prefix_cache_hits_shared_prefixes_and_reports_kv_events(model_info):
    from dpserve_shared.block_hash import block_hashes

    core = NullEngineCore(model_info, block_size=4, num_kv_blocks=3)
    core.start_kv_events()
    prompt = list(range(1, 11))  # two full blocks + 2 tokens
    core.add_request(EngineRequest("a", prompt, SamplingParams(max_tokens=1)))
    (first,) = core.step()
    assert first.num_cached_tokens == 0
    stored, removed = core.take_kv_events()
    assert stored == block_hashes(prompt, 4) and removed == []
    core.add_request(EngineRequest("b", prompt[:8] + [99, 98, 97], SamplingParams(max_tokens=1)))
    (second,) = core.step()
    assert second.num_cached_tokens == 8
    load = core.load()
    assert (load.prefix_queries, load.prefix_hits) == (21, 8)
    core.add_request(EngineRequest("c", list(range(50, 62)), SamplingParams(max_tokens=1)))  # 3 new blocks
    core.step()
    stored, removed = core.take_kv_events()
    assert len(stored) == 3 and sorted(removed) == sorted(block_hashes(prompt, 4))  # capacity 3: LRU evicted
    assert sorted(core.kv_snapshot()) == sorted(stored)


def test_null_core_prefill_cost_counts_only_uncached_tokens(model_info):
    core = NullEngineCore(model_info, block_size=4, prefill_time_per_token_s=1e-9)  # tiny: no timing asserted
    core.add_request(EngineRequest("a", list(range(1, 9)) + [5], SamplingParams(max_tokens=1)))
    core.step()
    core.add_request(EngineRequest("b", list(range(1, 9)) + [6], SamplingParams(max_tokens=1)))
    before = core.load().prompt_tokens
    core.step()
    assert core.load().prompt_tokens - before == 1  # 8 of its 9 tokens came from the cache
