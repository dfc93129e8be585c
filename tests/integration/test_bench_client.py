"""`dpserve bench serve` end to end against a tiny fake OpenAI server (aiohttp, in a thread, over a real socket; no
dpserve server, no model). Moved from tests/unit/test_bench_metrics.py, whose metric, SSE and prompt tests stay
unit tests."""

from __future__ import annotations

import asyncio
import json

import orjson
import pytest

from dpserve_shared.net import free_port

from dpserve.bench.serve import main

# ---------------------------------------------------------------------------------------------------------------
# End to end against a fake streaming server
# ---------------------------------------------------------------------------------------------------------------


async def _fake_server(port: int, seen: list):
    from aiohttp import web

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def completions(request):
        body = await request.json()
        seen.append((request.path, body))
        if body.get("prompt") == "FAIL" or body.get("max_tokens") == 13:
            return web.json_response({"error": {"message": "nope"}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chat = request.path.endswith("chat/completions")
        if chat:
            await resp.write(b"data: " + orjson.dumps({"choices": [{"delta": {"role": "assistant"}}]}) + b"\n\n")
        n = body["max_tokens"]
        for i in range(n):
            await asyncio.sleep(0.002)
            choice = {"delta": {"content": f" w{i}"}} if chat else {"text": f" w{i}"}
            await resp.write(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n")
        if body.get("stream_options", {}).get("include_usage"):
            usage = {"prompt_tokens": 9, "completion_tokens": n, "total_tokens": 9 + n}
            await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


@pytest.mark.timeout(60)
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_main_end_to_end_against_fake_server(tmp_path, endpoint, capsys):
    import threading

    port = free_port()
    seen: list = []
    loop = asyncio.new_event_loop()
    runner = loop.run_until_complete(_fake_server(port, seen))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
        rc = main([
            "--base-url", f"http://127.0.0.1:{port}", "--endpoint", endpoint, "--input-len", "12",
            "--output-len", "5", "--concurrency", "1,3", "--num-requests", "6", "--warmup", "1",
            "--output-json", str(out_json), "--output-png", str(out_png),
        ])
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert rc == 0
    report = json.loads(out_json.read_text())
    assert report["model"] == "fake-model" and report["endpoint"] == endpoint
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 3]
    for lv in report["levels"]:
        assert lv["completed"] == 6 and lv["failed"] == 0 and lv["total_output_tokens"] == 30
        assert lv["usage_missing"] == 0 and lv["total_input_tokens"] == 6 * 9
        assert lv["output_throughput"] > 0 and lv["p99_itl_ms"] > 0 and lv["mean_tpot_ms"] > 0
    assert out_png.stat().st_size > 1000
    assert report["server"] == {"data_parallel_size": None}  # the fake server exports no metrics
    bodies = [b for _, b in seen]
    assert len(bodies) == 2 * (6 + 1)  # warm-up + measured, per level
    assert all(b["ignore_eos"] and b["stream"] and b["stream_options"] == {"include_usage": True} for b in bodies)
    assert all(b["max_tokens"] == 5 and b["model"] == "fake-model" for b in bodies)
    prompts = [b["messages"][0]["content"] if endpoint == "chat" else b["prompt"] for b in bodies]
    assert len(set(prompts)) == len(prompts)  # distinct prompts, warm-up included
    out = capsys.readouterr()
    assert "Output token throughput" in out.out and "TTFT" in out.out
    assert "\r" in out.err  # live progress bar


@pytest.mark.timeout(60)
def test_main_reports_failures(tmp_path):
    import threading

    port = free_port()
    loop = asyncio.new_event_loop()
    runner = loop.run_until_complete(_fake_server(port, []))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        out_json = tmp_path / "r.json"
        rc = main([
            "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--input-len", "4", "--output-len", "13",
            "--concurrency", "2", "--num-requests", "3", "--warmup", "0", "--no-progress",
            "--output-json", str(out_json),
        ])
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert rc == 1
    lv = json.loads(out_json.read_text())["levels"][0]
    assert lv["completed"] == 0 and lv["failed"] == 3
    assert lv["errors"][0]["count"] == 3 and "HTTP 400" in lv["errors"][0]["error"]


def test_main_server_down_is_an_error():
    assert main(["--base-url", f"http://127.0.0.1:{free_port()}", "--no-progress"]) == 1


@pytest.mark.timeout(60)
def test_main_poisson_rate(tmp_path):
    import threading

    port = free_port()
    seen: list = []
    loop = asyncio.new_event_loop()
    runner = loop.run_until_complete(_fake_server(port, seen))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        out_json = tmp_path / "r.json"
        rc = main([
            "--base-url", f"http://127.0.0.1:{port}", "--input-len", "8", "--output-len", "3",
            "--request-rate", "200,inf", "--max-concurrency", "2", "--num-requests", "6", "--warmup", "0",
            "--no-progress", "--shared-prefix-len", "4", "--output-json", str(out_json),
            "--output-png", str(tmp_path / "r.png"),
        ])
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert rc == 0
    report = json.loads(out_json.read_text())
    assert [lv["request_rate"] for lv in report["levels"]] == [200.0, "inf"]
    assert report["config"]["request_rate"] == [200.0, "inf"]
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert all(lv["completed"] == 6 and lv["concurrency"] == 2 for lv in report["levels"])
    prompts = [b["prompt"] for _, b in seen]
    assert len(set(prompts)) == 12 and len({p.split()[0] for p in prompts}) == 1  # shared 4-token prefix
