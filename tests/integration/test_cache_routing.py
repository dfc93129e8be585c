"""Cache-aware routing on a real `dpserve serve --null-engine --routing cache-aware` (issue #17's "done when"): the
null engines' prefix caches report KV events, the coordinator publishes the index, and both API servers (one
port, either may answer) send requests that share a prefix to the rank that holds it.

Not covered yet: a burst of such requests larger than the holder's batch (--max-num-seqs) stays on the holder,
because the cost has no term for a full batch (the frontends do not know --max-num-seqs); see the issue."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from tests.conftest import engine_metrics, wait_for

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


def test_requests_sharing_a_prefix_go_to_the_rank_that_holds_it_from_either_api_server(serve_factory):
    server = serve_factory(
        backend="mp", data_parallel_size=2, api_server_count=2, null_engine=True,
        extra_args=("--routing", "cache-aware", "--null-step-time-ms", "5", "--null-prefill-time-per-token-s",
                    "0.0001"),
    )  # fmt: skip
    url = server.url
    first = _complete(url, PREFIX + [7])
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    time.sleep(1.0)  # KvEvents -> the coordinator's index -> KvDelta on every API server (20 ms ticks)
    before = _queries(url)
    cached = [_complete(url, PREFIX + [100 + i])["usage"]["prompt_tokens_details"]["cached_tokens"]
              for i in range(10)]  # fmt: skip
    assert cached == [len(PREFIX)] * 10, cached
    grown = wait_for(lambda: _grown(url, before, 10 * (len(PREFIX) + 1)), 10, "the ten requests' prefix counters")
    assert sorted(grown.values()) == [0, 10 * (len(PREFIX) + 1)], grown  # all ten on the rank holding the prefix

