"""Admission control on a real `dpserve serve --null-engine` (issue #16's "done when"): 256 concurrent requests
against a small per-rank queue cap get only 200s and 503s with Retry-After (no 500), all answered within the
test's timeout, and /metrics counts every 503 by reason."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_REQUESTS = 256
MAX_TOKENS = 10
REASONS = {"queued_requests", "queued_tokens", "queue_time"}


async def _one(session: aiohttp.ClientSession, url: str) -> tuple[int, str | None, dict]:
    body = {"prompt": "Tell me a story", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as response:
        return response.status, response.headers.get("Retry-After"), await response.json(content_type=None)


async def _burst(url: str) -> list[tuple[int, str | None, dict]]:
    connector = aiohttp.TCPConnector(limit=0)  # all 256 at once
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        return await asyncio.wait_for(asyncio.gather(*(_one(session, url) for _ in range(NUM_REQUESTS))), 150)


def _rejections(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "dpserve:admission_rejections_total":
                found[sample.labels["reason"]] = sample.value
    return found


def test_256_concurrent_requests_against_a_small_cap_get_only_200s_and_503s_with_retry_after(serve_factory):
    # 2 ranks, 4 running and at most 4 waiting each: most of a burst of 256 is refused at once
    server = serve_factory(
        backend="mp", data_parallel_size=2, api_server_count=2, null_engine=True,
        extra_args=("--null-step-time-ms", "20", "--max-num-seqs", "4", "--max-num-queued-requests", "4",
                    "--max-queue-time-s", "10"),
    )  # fmt: skip
    before = _rejections(server.url)
    results = asyncio.run(_burst(server.url))
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 503}, sorted(set(statuses))
    ok = [body for status, _, body in results if status == 200]
    refused = [(retry_after, body) for status, retry_after, body in results if status == 503]
    assert ok and refused, (len(ok), len(refused))
    assert all(body["usage"]["completion_tokens"] == MAX_TOKENS for body in ok)
    for retry_after, body in refused:
        assert retry_after is not None and retry_after.isdigit() and int(retry_after) >= 1, retry_after
        error = body["error"]
        assert error["type"] == "server_overloaded" and error["code"] in REASONS, error
        assert "--max-num-queued-requests 4" in error["message"] or "--max-queue-time-s" in error["message"]
    after = _rejections(server.url)  # summed over both API servers
    counted = sum(after.get(r, 0.0) - before.get(r, 0.0) for r in REASONS)
    assert counted == len(refused), (before, after, len(refused))
    # once the burst is over (and the coordinator's next load snapshot shows the queues empty) it serves again
    wait_for(lambda: asyncio.run(_single(server.url))[0] == 200, 30, "a request to be served after the burst")


async def _single(url: str):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        return await _one(session, url)
