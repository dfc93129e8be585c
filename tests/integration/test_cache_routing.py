"""Cache-aware routing on a real `dpserve serve --null-engine --routing cache-aware` (issue #17's "done when"): the
null engines' prefix caches report KV events, the coordinator publishes the index, and

- both API servers (one port, either may answer) send requests that share a prefix to the rank that holds it;
- a burst of distinct prompts through both API servers is spread over the ranks (max/mean <= 1.2);
- a burst of prefix hits larger than the holder's batch (--max-num-seqs) spills to the other rank once the wait
  for a batch slot outweighs the prefill saved;
- a restarted coordinator rebuilds the index from the engines' snapshots: a prefix stored while it was down
  (no coordinator heard the KV events) is routed to its holder afterwards.

The slot-wait and the least-loaded tie-break are pinned in tests/unit/test_routing_cost.py."""

from __future__ import annotations

import json
import os
import random
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import engine_metrics, wait_for
from tests.integration.test_coordinator_restart import _child_pid

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PREFIX = [1000 + i for i in range(512)]  # 32 blocks of 16 tokens


def _complete(url: str, prompt: list[int], max_tokens: int = 2) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _queries(url: str) -> dict[int, float]:
    metrics = engine_metrics(url)
    return next((v for k, v in metrics.items() if k.startswith("vllm:prefix_cache_queries")), {})


def _grown(url: str, before: dict[int, float], total: int) -> dict[int, float] | None:
    """Per rank, the prompt tokens looked up since `before`, once they add up to `total` (the engines' counters
    reach the API servers with the load, every second at most)."""
    now = _queries(url)
    grown = {rank: now.get(rank, 0) - before.get(rank, 0) for rank in set(now) | set(before)}
    return grown if sum(grown.values()) >= total else None


CACHE_AWARE = ("--routing", "cache-aware", "--null-step-time-ms", "5", "--null-prefill-time-per-token-s", "0.0001")


def _deployment(serve_factory, *extra: str):
    return serve_factory(backend="mp", data_parallel_size=2, api_server_count=2, null_engine=True,
                         extra_args=(*CACHE_AWARE, *extra))  # fmt: skip


def _per_rank_requests(url: str, before: dict[int, float], prompt_len: int, num: int) -> dict[int, float]:
    grown = wait_for(lambda: _grown(url, before, num * prompt_len), 10, "the burst's prefix counters")
    return {rank: tokens / prompt_len for rank, tokens in grown.items()}


def test_requests_sharing_a_prefix_go_to_the_rank_that_holds_it_from_either_api_server(serve_factory):
    url = _deployment(serve_factory).url
    blocks_before = _index_blocks(url)
    first = _complete(url, PREFIX + [7])
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _wait_until_both_api_servers_hold(url, blocks_before, PREFIX)  # KvEvents -> coordinator -> KvDelta
    before = _queries(url)
    cached = [_complete(url, PREFIX + [100 + i])["usage"]["prompt_tokens_details"]["cached_tokens"]
              for i in range(10)]  # fmt: skip
    assert cached == [len(PREFIX)] * 10, cached
    grown = wait_for(lambda: _grown(url, before, 10 * (len(PREFIX) + 1)), 10, "the ten requests' prefix counters")
    assert sorted(grown.values()) == [0, 10 * (len(PREFIX) + 1)], grown  # all ten on the rank holding the prefix



def test_a_burst_of_distinct_prompts_through_two_api_servers_is_spread(serve_factory):
    url = _deployment(serve_factory).url
    rng = random.Random(17)
    prompts = [[rng.randrange(2000, 30000) for _ in range(256)] for _ in range(40)]
    before = _queries(url)
    with ThreadPoolExecutor(len(prompts)) as pool:  # 40 connections at once: the kernel spreads them over both
        results = list(pool.map(lambda p: _complete(url, p, max_tokens=16), prompts))
    assert all(r["usage"]["completion_tokens"] == 16 for r in results)
    per_rank = _per_rank_requests(url, before, 256, len(prompts))
    mean = len(prompts) / 2
    assert max(per_rank.values()) / mean <= 1.2, per_rank


def test_a_burst_of_prefix_hits_larger_than_the_batch_spills_to_the_other_rank(serve_factory):
    url = _deployment(serve_factory, "--max-num-seqs", "4").url
    prefix = [3000 + i for i in range(512)]
    blocks_before = _index_blocks(url)
    _complete(url, prefix + [1])  # the prefix on one rank
    _wait_until_both_api_servers_hold(url, blocks_before, prefix)
    before = _queries(url)
    with ThreadPoolExecutor(24) as pool:  # 24 hits at once; each rank runs 4 at a time for 64 steps (~0.35 s)
        list(pool.map(lambda i: _complete(url, prefix + [100 + i], max_tokens=64), range(24)))
    per_rank = _per_rank_requests(url, before, len(prefix) + 1, 24)
    assert min(per_rank.values()) >= 4, per_rank  # spilled over (without the slot wait: all 24 on the holder)


def test_a_restarted_coordinator_rebuilds_the_index_from_the_engines(serve_factory):
    server = _deployment(serve_factory)
    try:
        url = server.url
        coordinator = _child_pid(server, "dpserve_coordinator.main")
        resyncs_before, blocks_before = _resyncs(url), _index_blocks(url)
        os.kill(coordinator, signal.SIGKILL)
        # While no coordinator hears the engines' KV events, a new prefix lands on one rank.
        prefix = [5000 + i for i in range(512)]
        assert _complete(url, prefix + [1])["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        wait_for(lambda: "coordinator is back" in server.log(), 90, "the coordinator to come back")
        # Each API server takes the new coordinator's index (another index id) once the engines sent theirs.
        wait_for(lambda: _resyncs(url) > resyncs_before, 30, "an API server to take the new coordinator's index")
        _wait_until_both_api_servers_hold(url, blocks_before, prefix)
        before = _queries(url)
        cached = [_complete(url, prefix + [100 + i])["usage"]["prompt_tokens_details"]["cached_tokens"]
                  for i in range(10)]  # fmt: skip
        assert cached == [len(prefix)] * 10, cached
        grown = _per_rank_requests(url, before, len(prefix) + 1, 10)
        assert sorted(grown.values()) == [0, 10], grown
    finally:
        serve_factory.close()  # its coordinator was killed: no other test may reuse it


def _resyncs(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("dpserve:prefix_index_resyncs_total"))  # fmt: skip


def _index_blocks(url: str) -> dict[int, float]:
    return engine_metrics(url).get("dpserve:prefix_index_blocks", {})


def _wait_until_both_api_servers_hold(url: str, before: dict[int, float], prefix: list[int]) -> None:
    """Until the API servers' copies of the index have grown by the prefix's blocks on some rank since `before`,
    on 10 scrapes in a row (each a new connection: the kernel spreads them over both API servers)."""
    num_blocks = len(prefix) // 16
    in_a_row = [0]

    def grown() -> bool:
        now = _index_blocks(url)
        ok = any(now.get(rank, 0) - before.get(rank, 0) >= num_blocks for rank in now)
        in_a_row[0] = in_a_row[0] + 1 if ok else 0
        return in_a_row[0] >= 10

    wait_for(grown, 30, "both API servers' prefix indexes to hold the prefix")
