"""`dpserve bench routing`'s pure parts: the workload (deterministic, sessions that extend their prompts, the
no-reuse share), the oracle's hit count (the null engine's prefix cache counts the same way), the snapshot-age
quantile from histogram buckets, and the imbalance."""

from __future__ import annotations

import dataclasses

import pytest

from dpserve.bench.routing import histogram_quantile, imbalance, summary_line, targets_met
from dpserve.bench.routing_workload import (
    WorkloadConfig,
    answer_tokens,
    build_workload,
    num_requests,
    oracle_cached_tokens,
)

SMALL = WorkloadConfig(num_conversations=200, num_system_prompts=20, system_prompt_tokens=(40, 80),
                       user_tokens=(5, 20), no_reuse_tokens=(30, 60), max_tokens=4, seed=3)  # fmt: skip


def test_the_workload_is_a_function_of_its_config():
    assert build_workload(SMALL) == build_workload(SMALL)
    assert build_workload(SMALL) != build_workload(dataclasses.replace(SMALL, seed=4))


def test_each_turn_extends_the_previous_prompt_with_the_answer_and_new_text():
    conversations = build_workload(SMALL)
    sessions = [c for c in conversations if c.session]
    answer = answer_tokens(SMALL.max_tokens)
    multi = [c for c in sessions if len(c.prompts) > 1]
    assert multi and all(1 <= len(c.prompts) <= SMALL.max_turns for c in sessions)
    for c in multi:
        for before, after in zip(c.prompts, c.prompts[1:]):
            assert after[: len(before) + len(answer)] == before + list(answer)
            assert 5 <= len(after) - len(before) - len(answer) <= 20
    by_system: dict[int, set] = {}
    for c in sessions:
        by_system.setdefault(c.system_prompt, set()).add(tuple(c.prompt(0)[:40]))  # the system prompt's first 40 tokens
    assert all(len(starts) == 1 for starts in by_system.values())  # one system prompt per index


def test_no_reuse_share_and_zipf_popularity():
    conversations = build_workload(dataclasses.replace(SMALL, num_conversations=2000))
    no_reuse = [c for c in conversations if not c.session]
    assert all(c.system_prompt is None and c.num_turns == 1 and len(c.prompts) == 1 for c in no_reuse)
    assert 0.15 < len(no_reuse) / len(conversations) < 0.25
    counts: dict[int, int] = {}
    for c in conversations:
        if c.session:
            counts[c.system_prompt] = counts.get(c.system_prompt, 0) + 1
    ranked = sorted(counts.values(), reverse=True)
    assert ranked[0] > 5 * ranked[-1]  # Zipf (s=1.1 over 20): the first ~27 x the last
    assert num_requests(conversations) == sum(len(c.prompts) for c in conversations)


def test_oracle_counts_leading_blocks_seen_before_capped_at_all_but_the_last_token():
    block = 4
    a = list(range(100, 110))  # 2 full blocks + 2 tokens
    assert oracle_cached_tokens([a], block) == [0]  # nothing seen yet
    assert oracle_cached_tokens([a, a], block) == [0, 8]
    assert oracle_cached_tokens([a[:8], a[:8]], block) == [0, 7]  # all but the last token, as the engine counts
    b = a[:4] + [1, 2, 3, 4, 5]  # shares the first block only
    assert oracle_cached_tokens([a, b], block) == [0, 4]
    c = [9, 9, 9, 9] + a[4:8]  # the same second block after another first one: a different chained hash
    assert oracle_cached_tokens([a, c], block) == [0, 0]


def test_histogram_quantile_interpolates_within_the_bucket():
    cumulative = {0.01: 0.0, 0.05: 50.0, 0.1: 90.0, 0.2: 100.0, float("inf"): 100.0}
    assert histogram_quantile(cumulative, 0.5) == pytest.approx(0.05)
    assert histogram_quantile(cumulative, 0.25) == pytest.approx(0.03)  # halfway through (0.01, 0.05]
    assert histogram_quantile(cumulative, 0.99) == pytest.approx(0.19)
    assert histogram_quantile({0.1: 0.0, float("inf"): 4.0}, 0.5) == 0.1  # in +Inf: its lower bound
    assert histogram_quantile({0.1: 0.0, float("inf"): 0.0}, 0.5) is None


def test_imbalance_and_targets():
    assert imbalance([10, 10, 10, 10]) == 1.0
    assert imbalance([20, 10, 10, 0]) == 2.0
    assert imbalance([0, 0]) == 0.0
    result = {"policy": "cache-aware", "imbalance": 1.05, "hit_vs_oracle": 0.95, "snapshot_age_p99_ms": 150.0,
              "coordinator_cpu_pct": 12.0, "publish_bytes_per_s": 2500.0}  # fmt: skip
    assert targets_met(result) == {"imbalance": True, "hit_vs_oracle": True, "snapshot_age_p99": True,
                                   "coordinator_cpu": False}  # fmt: skip
    assert summary_line([result]) == ("routing: cache-aware imbalance=1.05 hit/oracle=0.95 age_p99_ms=150 "
                                      "coordinator_cpu_pct=12.0 publish_kB_s=2.5")  # fmt: skip
