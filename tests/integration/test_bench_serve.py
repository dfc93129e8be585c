"""`dpserve bench serve` against a live `dpserve serve` (null engines, mp backend): small N, two concurrency levels;
the JSON report has every field the benchmarks record (docs/benchmarks.md). No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest

DPSERVE = os.path.join(os.path.dirname(sys.executable), "dpserve")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LEVEL_FIELDS = [
    "concurrency", "request_rate", "num_warmup", "duration_s", "num_requests", "completed", "failed", "errors",
    "total_input_tokens", "total_output_tokens", "usage_missing", "connection_retries",
    "request_throughput", "output_throughput", "total_token_throughput",
]  # fmt: skip
for _name in ("ttft", "tpot", "itl", "e2el"):
    LEVEL_FIELDS += [f"{s}_{_name}_ms" for s in ("mean", "median", "std", "min", "max", "p50", "p90", "p99")]


def _bench_command() -> list[str]:
    """`dpserve bench serve` once the CLI has it, else the module it runs."""
    probe = subprocess.run([DPSERVE, "bench", "serve", "--help"], capture_output=True, text=True, timeout=60)
    if probe.returncode == 0 and "--concurrency" in probe.stdout:
        return [DPSERVE, "bench", "serve"]
    return [sys.executable, "-m", "dpserve.bench_serve"]


@pytest.fixture(scope="module")
def server(serve_factory):
    # the same configuration as test_dp_serving's mp-null server: reused when both run in one session
    return serve_factory(backend="mp", data_parallel_size=2, api_server_count=2, null_engine=True)


@pytest.fixture(autouse=True)
def _print_log_on_failure(request, server, server_log_on_failure):
    request.node.serve = server


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve_json_has_every_field(server, tmp_path, endpoint):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    cmd = _bench_command() + [
        "--base-url", server.url, "--endpoint", endpoint, "--input-len", "32", "--output-len", "8",
        "--concurrency", "1,4", "--num-requests", "8", "--warmup", "2",
        "--output-json", str(out_json), "--output-png", str(out_png),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ, MPLBACKEND="Agg"))
    assert proc.returncode == 0, f"{cmd}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    report = json.loads(out_json.read_text())
    for key in ("tool", "date", "base_url", "endpoint", "model", "config", "levels"):
        assert key in report, key
    with urllib.request.urlopen(server.url + "/v1/models", timeout=10) as response:
        assert report["model"] == json.load(response)["data"][0]["id"]  # the default: the first listed model
    assert report["config"]["input_len"] == 32 and report["config"]["output_len"] == 8
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 4]
    for level in report["levels"]:
        missing = [f for f in LEVEL_FIELDS if f not in level]
        assert not missing, f"missing fields {missing}"
        assert level["completed"] == 8 and level["failed"] == 0, level["errors"]
        # ignore_eos + max_tokens: exactly the asked output length, counted from the usage chunk
        assert level["total_output_tokens"] == 8 * 8 and level["usage_missing"] == 0
        if endpoint == "completions":
            assert level["total_input_tokens"] == 8 * 32  # synthetic prompts are exactly --input-len tokens
        else:
            assert level["total_input_tokens"] > 8 * 32  # the chat template adds its tokens
        assert level["request_throughput"] > 0 and level["output_throughput"] > 0
        assert level["num_tpot_samples"] == 8 and level["num_itl_samples"] > 0
        assert 0 < level["p50_ttft_ms"] <= level["p99_ttft_ms"] <= level["max_ttft_ms"]
        assert level["p50_e2el_ms"] >= level["p50_ttft_ms"]
    assert out_png.stat().st_size > 1000
    assert "Output token throughput" in proc.stdout
