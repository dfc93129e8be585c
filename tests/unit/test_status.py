"""The status document (dpserve_shared.status): rates from cumulative counters, restarts, API servers' TTFT/TPOT,
history, states; the registry's part (frontend figures on snapshots); `dpserve status`'s rendering."""

from __future__ import annotations

import msgspec

from dpserve.status import render, status_url
from dpserve_coordinator.registry import Registry
from dpserve_shared.codec import coordinator_decoder, encode
from dpserve_shared.schema import (
    PROTOCOL_VERSION,
    EngineInfo,
    EngineLoad,
    EngineState,
    FrontendStats,
    Heartbeat,
    RegisterFrontend,
    Topology,
)
from dpserve_shared.status import COORDINATOR_SILENT_S, StatusInputs, StatusTracker


def _info(rank: int, state=EngineState.READY, engine_id: str | None = None, **kw) -> EngineInfo:
    return EngineInfo(rank=rank, engine_id=engine_id or f"e{rank}", input_addr=f"tcp://h:{rank}", state=state,
                      node_ip="10.0.0.1", pid=100 + rank, kv_blocks_total=100, **kw)  # fmt: skip


class Feed:
    """Mutable inputs for a tracker."""

    def __init__(self):
        self.inputs = StatusInputs(Topology(epoch=1, engines=[_info(0), _info(1)], data_parallel_size=2), {})

    def __call__(self) -> StatusInputs:
        return self.inputs


def test_rates_come_from_counter_deltas_and_a_restarted_engine_starts_again():
    feed = Feed()
    tracker = StatusTracker("test", feed)
    feed.inputs.loads = {0: EngineLoad(rank=0, generation_tokens=100, prompt_tokens=1000, kv_blocks_used=25,
                                       kv_blocks_total=100, prefix_queries=10, prefix_hits=4, num_running=3)}
    tracker.sample(now_s=10.0, wall_s=1000.0)
    assert tracker.status()["throughput"]["generation_tokens_per_s"] == 0.0  # one sample: no rate yet
    feed.inputs.loads = {0: EngineLoad(rank=0, generation_tokens=300, prompt_tokens=1500, kv_blocks_used=25,
                                       kv_blocks_total=100, prefix_queries=10, prefix_hits=4, num_running=3)}
    tracker.sample(now_s=12.0, wall_s=1002.0)
    doc = tracker.status(with_history=True)
    rank0 = doc["ranks"][0]
    assert rank0["generation_tokens_per_s"] == 100.0 and rank0["prompt_tokens_per_s"] == 250.0
    assert rank0["kv_usage"] == 0.25 and rank0["prefix_hit_rate"] == 0.4 and rank0["running"] == 3
    assert doc["throughput"]["generation_tokens_per_s"] == 100.0 and doc["throughput"]["t"] == 1002.0
    assert [p["t"] for p in doc["history"]] == [1002.0]
    # rank 0 restarted: a new engine id, counters from 0: no negative or huge rate
    feed.inputs.topology = Topology(epoch=2, engines=[_info(0, engine_id="e0-b"), _info(1)], data_parallel_size=2)
    feed.inputs.loads = {0: EngineLoad(rank=0, generation_tokens=5)}
    tracker.sample(now_s=13.0, wall_s=1003.0)
    assert tracker.status()["ranks"][0]["generation_tokens_per_s"] == 0.0
    feed.inputs.loads = {0: EngineLoad(rank=0, generation_tokens=25)}
    tracker.sample(now_s=14.0, wall_s=1004.0)
    assert tracker.status()["ranks"][0]["generation_tokens_per_s"] == 20.0


def test_api_servers_ttft_and_tpot_are_the_means_of_the_interval():
    feed = Feed()
    tracker = StatusTracker("test", feed)
    feed.inputs.frontends = [FrontendStats("a", requests_finished=10, ttft_sum_s=5.0, ttft_count=10),
                             FrontendStats("b", num_in_flight=2)]  # fmt: skip
    tracker.sample(now_s=0.0)
    feed.inputs.frontends = [
        FrontendStats("a", num_in_flight=1, requests_finished=12, ttft_sum_s=5.3, ttft_count=12, tpot_sum_s=0.02,
                      tpot_count=2),
        FrontendStats("b", num_in_flight=2, requests_finished=2, ttft_sum_s=0.1, ttft_count=2),
    ]  # fmt: skip
    tracker.sample(now_s=1.0)
    doc = tracker.status()
    throughput = doc["throughput"]
    assert throughput["requests_per_s"] == 4.0
    assert abs(throughput["ttft_s"] - 0.1) < 1e-9  # (0.3 + 0.1) / 4
    assert abs(throughput["tpot_s"] - 0.01) < 1e-9
    assert doc["api_servers"]["count"] == 2 and doc["api_servers"]["in_flight"] == 3
    tracker.sample(now_s=2.0)  # nothing finished since
    assert tracker.status()["throughput"]["ttft_s"] is None


def test_states_scaling_failed_and_coordinator_reachability():
    feed = Feed()
    feed.inputs.topology = Topology(epoch=3, data_parallel_size=3, engines=[
        _info(0), _info(1, EngineState.DEAD, failed=True, dead_reason="exited with code 1", restarts=4,
                        deaths={"exited": 4}),
        _info(2, EngineState.STARTING),
    ])  # fmt: skip
    feed.inputs.loads = {1: EngineLoad(rank=1, num_running=7)}  # a dead rank's stale load is not shown
    tracker = StatusTracker("test", feed)
    doc = tracker.status()
    assert [r["state"] for r in doc["ranks"]] == ["ready", "failed", "starting"]
    dead = doc["ranks"][1]
    assert dead["running"] == 0 and dead["restarts"] == 4 and dead["deaths"] == {"exited": 4}
    assert dead["last_death_reason"] == "exited with code 1"
    assert doc["scaling"] == {"in_progress": True, "target": 3, "ready": 1, "starting": [2], "draining": []}
    assert doc["coordinator"]["reachable"]
    feed.inputs.coordinator_last_heard_s = COORDINATOR_SILENT_S + 1
    assert not tracker.status()["coordinator"]["reachable"]
    feed.inputs.coordinator_last_heard_s = None  # never heard
    assert tracker.status()["coordinator"] == {"reachable": False, "last_heard_s": None}
    published = {"messages": 3, "bytes": 120, "by_type": {"LoadSnapshot": {"messages": 3, "bytes": 120}}}
    feed.inputs.coordinator_published = published  # the coordinator's own page says what it published
    assert tracker.status()["coordinator"]["published"] == published


def test_history_keeps_the_last_window_only():
    feed = Feed()
    tracker = StatusTracker("test", feed, history_s=5.0)
    for second in range(20):
        tracker.sample(now_s=float(second), wall_s=float(second))
    assert [p["t"] for p in tracker.status(with_history=True)["history"]] == [15.0, 16.0, 17.0, 18.0, 19.0]


def test_frontend_figures_ride_on_heartbeats_into_every_snapshot():
    heartbeat = Heartbeat("fe-1", 1.0, FrontendStats("fe-1", pid=7, num_in_flight=3, ttft_count=1, ttft_sum_s=0.2))
    decoded = coordinator_decoder().decode(encode(heartbeat))
    assert decoded == heartbeat
    assert coordinator_decoder().decode(encode(Heartbeat("old", 1.0))).stats is None  # an older frontend's
    registry = Registry(1)
    registry.register_frontend(RegisterFrontend(PROTOCOL_VERSION, "fe-1", pid=7, http_addr="h:1"), now_s=0.0)
    registry.register_frontend(RegisterFrontend(PROTOCOL_VERSION, "fe-2", pid=8, http_addr="h:1"), now_s=0.0)
    assert registry.heartbeat("fe-1", 1.0, decoded.stats)
    snapshot = registry.load_snapshot(0, False, 1.0)
    by_id = {s.frontend_id: s for s in snapshot.frontends}
    assert by_id["fe-1"].num_in_flight == 3 and by_id["fe-2"] == FrontendStats("fe-2", 8, "h:1")
    assert msgspec.msgpack.decode(encode(snapshot), type=type(snapshot)) == snapshot


def test_status_url_accepts_what_users_type():
    for given in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "h:8000/status", "http://h:8000/status.json"):
        assert status_url(given) == "http://h:8000/status.json", given


def test_terminal_rendering_has_a_line_per_rank_and_the_banner():
    feed = Feed()
    feed.inputs.topology = Topology(epoch=1, engines=[_info(0), _info(1, EngineState.DEAD, dead_reason="killed")],
                                    data_parallel_size=2)  # fmt: skip
    feed.inputs.coordinator_last_heard_s = 12.0
    text = render(StatusTracker("coordinator", feed).status())
    lines = text.splitlines()
    assert any(line.startswith("0 ") and " ready " in line for line in lines)
    assert any(line.startswith("1 ") and " dead " in line and "(killed)" in line for line in lines)
    assert "coordinator unreachable (last heard 12 s ago)" in text


def test_each_rank_shows_its_cpu_kind_and_kernel_path():
    """RegisterEngine.cpu reaches /status through the registry's EngineInfo (an older engine's is None)."""
    from dpserve_shared.schema import CpuChoice

    choice = CpuChoice("avx512_bf16", "AMD EPYC", "q4", "CPU kind avx512_bf16: fp32 activations keep fp32's tokens")
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(_info(0, cpu=choice)), type=EngineInfo)
    assert decoded.cpu == choice
    feed = Feed()
    feed.inputs.topology = Topology(epoch=1, engines=[_info(0, cpu=choice), _info(1)], data_parallel_size=2)
    tracker = StatusTracker("test", feed)
    tracker.sample(now_s=1.0, wall_s=1.0)
    rank0, rank1 = tracker.status()["ranks"]
    assert (rank0["cpu_kind"], rank0["kernel_path"]) == ("avx512_bf16", "q4") and "fp32" in rank0["kernel_path_reason"]
    assert rank1["cpu_kind"] is None and rank1["kernel_path"] is None
