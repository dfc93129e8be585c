"""The status page (/status, /status.json, /status/events, the coordinator's --status-port, `dpserve status`)
against a live `dpserve serve` (mp backend, DP=2, 2 API servers, an API key; null engines: the page shows what
the coordinator knows, whatever the engines compute), and in a real browser: headless Chromium over the
DevTools protocol (tests/browser.py), skipped with a message only where no Chromium is installed. Screenshots
go to $DPSERVE_TEST_ARTIFACTS/status-page (default: test-artifacts/ in the repository)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.browser import Browser, find_chromium
from tests.conftest import DPSERVE, free_port, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARTIFACTS = os.path.join(os.environ.get("DPSERVE_TEST_ARTIFACTS", os.path.join(ROOT, "test-artifacts")),
                         "status-page")  # fmt: skip
KEY = "status-test-key"
STATUS_PORT = free_port()

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def server(serve_factory):
    server = serve_factory(
        backend="mp", data_parallel_size=2, api_server_count=2, null_engine=True,
        extra_args=("--api-key", KEY, "--status-port", str(STATUS_PORT)),
    )  # fmt: skip
    yield server
    serve_factory.close()  # a rank killed and a scale step: no other module may reuse it


@pytest.fixture(autouse=True)
def _print_log_on_failure(request, server_log_on_failure):
    request.node.serve = request.getfixturevalue("server")


def _get(url: str, headers: dict | None = None) -> tuple[int, bytes, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def _status(base: str) -> dict:
    status, body, _ = _get(f"{base}/status.json", {"Authorization": f"Bearer {KEY}"})
    assert status == 200, body
    return json.loads(body)


class _Load:
    """Streams of completions from a few threads until stopped; counts the answers by status."""

    def __init__(self, base_url: str, threads: int = 6):
        self.base_url, self.stop, self.codes = base_url, threading.Event(), {}
        self.model = _status(base_url)["model"]
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        body = json.dumps({"model": self.model, "prompt": "hello " * 40, "max_tokens": 200,
                           "ignore_eos": True}).encode()  # fmt: skip
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        while not self.stop.is_set():
            status, _, _ = _get_post(self.base_url + "/v1/completions", body, headers)
            self.codes[status] = self.codes.get(status, 0) + 1

    def __enter__(self) -> _Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)


def _get_post(url: str, body: bytes, headers: dict) -> tuple[int, bytes, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=60) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


# -- without a browser ------------------------------------------------------------------------------------------


def test_status_json_on_api_servers_and_coordinator_is_the_same_view(server):
    coordinator = f"http://127.0.0.1:{STATUS_PORT}"
    for base, source in ((server.url, "api-server"), (coordinator, "coordinator")):
        doc = wait_for(lambda b=base: (d := _status(b))["api_servers"]["count"] == 2 and d, 15, "both API servers")
        assert doc["source"].startswith(source)
        assert doc["coordinator"]["reachable"]
        assert [(r["rank"], r["state"]) for r in doc["ranks"]] == [(0, "ready"), (1, "ready")]
        assert all(r["pid"] > 0 and r["node"] == "127.0.0.1" for r in doc["ranks"])
        assert doc["data_parallel_size"] == 2 and not doc["scaling"]["in_progress"]
    with _Load(server.url):
        moved = wait_for(lambda: (d := _status(server.url))["throughput"]["generation_tokens_per_s"] > 0 and d, 30,
                         "throughput on the page")  # fmt: skip
        assert sum(r["generation_tokens_per_s"] for r in moved["ranks"]) > 0
        wait_for(lambda: _status(server.url)["throughput"]["ttft_s"] is not None, 30, "a TTFT figure")
        wait_for(lambda: _status(coordinator)["throughput"]["generation_tokens_per_s"] > 0, 30, "the coordinator's")
    history = json.loads(_get(f"{server.url}/status.json?history=1&key={KEY}")[1])["history"]
    assert len(history) >= 2 and all("generation_tokens_per_s" in p for p in history)


def test_the_page_and_its_data_need_the_key(server):
    for base in (server.url, f"http://127.0.0.1:{STATUS_PORT}"):
        status, body, _ = _get(f"{base}/status.json")
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        assert _get(f"{base}/status.json?key=wrong")[0] == 401
        assert _get(f"{base}/status/events")[0] == 401
        status, body, _ = _get(f"{base}/status")
        assert status == 401 and b'name="key"' in body  # a form asking for it
        status, body, headers = _get(f"{base}/status?key={KEY}")
        assert status == 200 and b"<script>" in body and "text/html" in headers["Content-Type"]
        assert b"http://" not in body.replace(b"http://www.w3.org", b"") and b"https://" not in body  # no CDN


def test_events_stream_documents_a_few_times_a_second(server):
    request = urllib.request.Request(f"{server.url}/status/events?key={KEY}")
    started = time.monotonic()
    docs = []
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        for line in response:
            if line.startswith(b"data: "):
                docs.append(json.loads(line[len(b"data: "):]))
                if len(docs) == 4:
                    break
    assert [len(d["ranks"]) for d in docs] == [2, 2, 2, 2]
    assert time.monotonic() - started >= 1.0  # paced (every 0.5 s), not a flood


def test_dpserve_status_once_prints_a_line_per_rank(server):
    env = dict(os.environ, DPSERVE_API_KEY=KEY)
    result = subprocess.run([DPSERVE, "status", "--url", server.url + "/v1", "--once"], capture_output=True,
                            text=True, timeout=30, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = [row for row in map(str.split, result.stdout.splitlines()) if row and row[0].isdigit()]
    assert [(row[0], row[1]) for row in rows] == [("0", "ready"), ("1", "ready")], result.stdout
    unauthorized = subprocess.run([DPSERVE, "status", "--url", server.url, "--once"], capture_output=True,
                                  text=True, timeout=30, env={**env, "DPSERVE_API_KEY": ""})  # fmt: skip
    assert unauthorized.returncode == 1 and "401" in unauthorized.stderr


# -- in a browser -----------------------------------------------------------------------------------------------

_STATES_SEEN = """
window.__seen = {};
const record = () => document.querySelectorAll('#ranks .card').forEach((c) => {
  (window.__seen[c.dataset.rank] = window.__seen[c.dataset.rank] || []).push(c.dataset.state);
});
new MutationObserver(record).observe(document.getElementById('ranks'), {childList: true, subtree: true});
record();
true
"""
_CARDS = "[...document.querySelectorAll('#ranks .card')].map((c) => [Number(c.dataset.rank), c.dataset.state])"


def _field(rank: int, name: str) -> str:
    return f"(document.querySelector('#ranks .card[data-rank=\"{rank}\"] [data-field=\"{name}\"]') || {{}}).textContent"


def test_the_page_in_a_browser_follows_load_a_rank_death_and_a_scale_step(server):
    if find_chromium() is None:
        pytest.skip("no Chromium here (Debian: apt-get install chromium; or set DPSERVE_CHROMIUM): the browser "
                    "test needs one")  # fmt: skip
    asyncio.run(_browse(server))


async def _browse(server) -> None:
    async with Browser() as page:
        try:
            await _browse_steps(page, server)
        except BaseException:
            await page.screenshot(os.path.join(ARTIFACTS, "failure.png"))
            print("page console:", page.console)
            raise
        assert not [m for m in page.console if m.startswith("uncaught")], page.console


async def _browse_steps(page: Browser, server) -> None:
    await page.goto(f"{server.url}/status?key={KEY}")
    cards = await page.wait_for(f"(c => c.length === 2 && c.every(([, s]) => s === 'ready') && c)({_CARDS})", 20,
                                "two ready rank cards")  # fmt: skip
    assert cards == [[0, "ready"], [1, "ready"]]
    await page.evaluate(_STATES_SEEN)
    await page.screenshot(os.path.join(ARTIFACTS, "1-ready.png"))

    with _Load(server.url) as load:
        await page.wait_for("Number(document.getElementById('gen-tps').textContent) > 0", 30, "output tokens/s > 0")
        await page.wait_for(f"Number({_field(0, 'tps')}) > 0 || Number({_field(1, 'tps')}) > 0", 30,
                            "a rank card's tokens/s")  # fmt: skip
        await page.wait_for("document.getElementById('ttft').textContent.endsWith('ms')", 30, "a TTFT figure")
        await asyncio.sleep(3)  # a few points on the charts
        await page.screenshot(os.path.join(ARTIFACTS, "2-under-load.png"))

        doc = _status(server.url)
        victim = doc["ranks"][1]
        os.kill(victim["pid"], signal.SIGKILL)
        await page.wait_for("(window.__seen['1'] || []).some((s) => s === 'dead' || s === 'starting')", 30,
                            "rank 1's card dead")  # fmt: skip
        await page.screenshot(os.path.join(ARTIFACTS, "3-rank-dead.png"))
        await page.wait_for(f"(c => c.length === 2 && c.every(([, s]) => s === 'ready'))({_CARDS}) && "
                            f"Number({_field(1, 'restarts')}) >= 1", 60, "rank 1 ready again after a restart")
    assert load.codes.get(200, 0) > 0 and set(load.codes) == {200}, load.codes  # the death failed no request
    seen = await page.evaluate("window.__seen['1']")
    assert "dead" in seen, seen  # a DEAD rank waits out a back-off of 1 s before its replacement starts

    scale = await asyncio.to_thread(
        subprocess.run,
        [DPSERVE, "scale", "--data-parallel-size", "3", "--data-parallel-rpc-port", str(server.rpc_port),
         "--timeout-s", "110"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert scale.returncode == 0, scale.stdout + scale.stderr
    cards = await page.wait_for(f"(c => c.length === 3 && c.every(([, s]) => s === 'ready') && c)({_CARDS})", 20,
                                "a third ready card")  # fmt: skip
    assert cards == [[0, "ready"], [1, "ready"], [2, "ready"]]
    assert "3 ready / 3" in await page.evaluate("document.getElementById('size').textContent")
    await page.screenshot(os.path.join(ARTIFACTS, "4-scaled-to-3.png"))

    # the coordinator stops answering for 4 s (SIGSTOP; under the 5 s after which ranks and API servers count as
    # gone): the banner says so, and goes once it answers again
    coordinator = next(pid for pid, cmd in server.record_descendants().items() if "dpserve_coordinator.main" in cmd)
    banner = "getComputedStyle(document.getElementById('banner')).display !== 'none' && " \
             "document.getElementById('banner').textContent"
    os.kill(coordinator, signal.SIGSTOP)
    try:
        text = await page.wait_for(banner, 4, "the 'coordinator unreachable' banner")
        await page.screenshot(os.path.join(ARTIFACTS, "5-coordinator-unreachable.png"))
    finally:
        os.kill(coordinator, signal.SIGCONT)
    assert text.startswith("Coordinator unreachable"), text
    await page.wait_for(f"!({banner})", 10, "the banner to go")
    assert (await page.evaluate(_CARDS)) == [[0, "ready"], [1, "ready"], [2, "ready"]]

    # the coordinator's own page shows the same ranks
    await page.goto(f"http://127.0.0.1:{STATUS_PORT}/status?key={KEY}")
    await page.wait_for(f"{_CARDS}.length === 3", 20, "the coordinator's page")
    assert (await page.evaluate("document.getElementById('source').textContent")) == "coordinator"
