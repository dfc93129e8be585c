"""`dpserve bench routing` end to end, small: DP=4 null engines, 2 API servers, two policies for a few seconds
each. The JSON report has every figure, and they are sane (counts add up, rates in [0, 1], the oracle at least
what a real router got); no timing or quality target is asserted. Nothing it started is left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from tests.conftest import DPSERVE, _proc_table, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

POLICY_FIELDS = [
    "policy", "requests_sent", "completed", "failed", "errors", "duration_s", "request_throughput", "mean_ttft_ms",
    "p50_ttft_ms", "p99_ttft_ms", "prompt_tokens", "cached_tokens", "hit_rate", "oracle_hit_rate", "hit_vs_oracle",
    "imbalance", "imbalance_requests", "per_rank", "counters_settled", "rank_deaths", "snapshot_age_p50_ms",
    "snapshot_age_p99_ms", "snapshot_age_samples", "routing_decisions", "coordinator_pid", "coordinator_cpu_pct",
    "publish_bytes_per_s", "publish_messages_per_s", "publish_by_type", "machine_cores_busy", "targets_met",
]  # fmt: skip


def _stray(rpc_port: int) -> dict[int, str]:
    """Processes of the deployments the bench started: they all carry the coordinator's control address."""
    marker = f"tcp://127.0.0.1:{rpc_port}"
    return {pid: cmd for pid, (_, cmd) in _proc_table().items() if marker in cmd and pid != os.getpid()}


def test_bench_routing_reports_every_figure_and_stops_its_deployments(tmp_path):
    out_json, rpc_port = tmp_path / "routing.json", free_port()
    cmd = [DPSERVE, "bench", "routing", "--data-parallel-size", "4", "--api-server-count", "2",
           "--policies", "cache-aware,round-robin", "--duration-s", "4", "--concurrency", "8",
           "--num-conversations", "300", "--num-system-prompts", "20", "--null-step-time-ms", "5",
           "--data-parallel-rpc-port", str(rpc_port), "--log-dir", str(tmp_path), "--no-progress",
           "--output-json", str(out_json)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    finally:
        for pid in _stray(rpc_port):  # a bench that timed out: its deployment is in a session of its own
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert not _stray(rpc_port)
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("routing: cache-aware imbalance=") and "| round-robin imbalance=" in last, last

    report = json.loads(out_json.read_text())
    assert report["tool"] == "dpserve bench routing" and report["machine"]["num_cpus"] >= 1
    assert [p["policy"] for p in report["policies"]] == ["cache-aware", "round-robin"]
    for p in report["policies"]:
        missing = [f for f in POLICY_FIELDS if f not in p]
        assert not missing, f"missing fields {missing}"
        assert p["failed"] == 0 and p["completed"] == p["requests_sent"] > 0, p["errors"]
        assert p["counters_settled"] and p["rank_deaths"] == 0
        assert 0 < p["cached_tokens"] < p["prompt_tokens"]  # the workload shares prefixes
        # the oracle never does worse than a router (but for the order of two requests sent at once)
        assert 0 < p["hit_rate"] <= p["oracle_hit_rate"] + 0.01 < 1.01
        assert len(p["per_rank"]) == 4
        # the engines' counters account for every prompt token the responses reported
        assert sum(r["prefix_queries"] for r in p["per_rank"]) == p["prompt_tokens"]
        assert sum(r["prefix_hits"] for r in p["per_rank"]) == p["cached_tokens"]
        assert sum(r["requests"] for r in p["per_rank"]) == p["completed"]
        assert 1.0 <= p["imbalance"] <= 4.0 and 1.0 <= p["imbalance_requests"] <= 4.0  # at most all on one rank
        assert sum(p["routing_decisions"].values()) == p["requests_sent"]
        assert p["snapshot_age_samples"] == p["requests_sent"]
        assert 0 <= p["snapshot_age_p50_ms"] <= p["snapshot_age_p99_ms"]
        assert p["coordinator_cpu_pct"] is not None and p["coordinator_cpu_pct"] >= 0
        assert p["publish_bytes_per_s"] > 0 and "LoadSnapshot" in p["publish_by_type"]
        assert set(p["targets_met"]) == {"imbalance", "hit_vs_oracle", "snapshot_age_p99", "coordinator_cpu"}
