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
