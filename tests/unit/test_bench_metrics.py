"""`dpserve bench serve`: the metric definitions (vLLM's bench serve), SSE parsing, synthetic prompts, and one
end-to-end run against a tiny in-process fake OpenAI server (no dpserve server, no model)."""

from __future__ import annotations

import asyncio
import json
import socket

import orjson
import pytest

from dpserve import bench_serve as bs
from dpserve.bench_serve import RequestResult, StreamState, compute_metrics, percentile, request_tpot, summarize


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    values = [3.0, 1.0, 7.0, 2.0, 10.0, 4.5]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) == 0.0
    assert percentile([5.0], 99) == 5.0


def test_summarize_fields_in_ms():
    s = summarize([0.1, 0.2, 0.3], "ttft")
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["p50_ttft_ms"] == pytest.approx(200.0)
    assert s["p90_ttft_ms"] == pytest.approx(280.0)
    assert s["p99_ttft_ms"] == pytest.approx(298.0)
    assert s["min_ttft_ms"] == pytest.approx(100.0) and s["max_ttft_ms"] == pytest.approx(300.0)
    assert s["num_ttft_samples"] == 3
    empty = summarize([], "itl")
    assert empty["mean_itl_ms"] == 0.0 and empty["p99_itl_ms"] == 0.0 and empty["num_itl_samples"] == 0


def _ok(ttft, latency, out, prompt=10, itl=None):
    return RequestResult(
        success=True, prompt_len=prompt, output_tokens=out, usage_reported=True, ttft=ttft, latency=latency,
        itl=list(itl or []),
    )


def test_tpot_definition():
    # (latency - ttft) / (output tokens - 1)
    assert request_tpot(_ok(0.1, 1.1, 11)) == pytest.approx(0.1)
    assert request_tpot(_ok(0.1, 0.1, 1)) is None  # one token: no TPOT
    assert request_tpot(RequestResult(success=False, output_tokens=5, latency=1.0)) is None


def test_compute_metrics_throughputs_and_latencies():
    results = [
        _ok(0.1, 1.1, 11, prompt=100, itl=[0.1] * 10),
        _ok(0.3, 2.3, 21, prompt=100, itl=[0.05, 0.15] * 10),
        RequestResult(success=False, error="HTTP 500: boom", latency=0.5),
        RequestResult(success=False, error="HTTP 500: boom", latency=0.5),
    ]
    m = compute_metrics(results, duration_s=4.0)
    assert m["num_requests"] == 4 and m["completed"] == 2 and m["failed"] == 2
    assert m["total_input_tokens"] == 200 and m["total_output_tokens"] == 32
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(8.0)
    assert m["total_token_throughput"] == pytest.approx(58.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # both requests: 100 ms per token after the first
    assert m["num_itl_samples"] == 30  # ITL pools every gap of every request
    assert m["mean_itl_ms"] == pytest.approx((10 * 100 + 10 * 50 + 10 * 150) / 30)
    assert m["mean_e2el_ms"] == pytest.approx(1700.0)
    assert m["errors"] == [{"error": "HTTP 500: boom", "count": 2}]
    for name in bs.LATENCY_METRICS:
        for stat in ("mean", "median", "p50", "p90", "p99"):
            assert f"{stat}_{name}_ms" in m


def test_compute_metrics_all_failed():
    m = compute_metrics([RequestResult(success=False, error="x")], 1.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["request_throughput"] == 0.0 and m["output_throughput"] == 0.0 and m["mean_ttft_ms"] == 0.0


def _sse(obj) -> bytes:
    return orjson.dumps(obj)


def test_stream_state_chat_role_chunk_does_not_count_and_usage_wins():
    st = StreamState("chat", start=10.0)
    st.feed(_sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}), 10.05)
    st.feed(_sse({"choices": [{"index": 0, "delta": {"content": "Hel"}}]}), 10.2)
    st.feed(_sse({"choices": [{"index": 0, "delta": {"content": "lo"}}]}), 10.3)
    st.feed(_sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}), 10.35)
    st.feed(_sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}), 10.4)
    st.feed(b"[DONE]", 10.41)
    assert st.done
    r = st.result(end=10.5, prompt_len=5)
    assert r.success and r.usage_reported
    assert r.ttft == pytest.approx(0.2)  # the role-only chunk at 0.05 is not the first token
    assert r.itl == [pytest.approx(0.1)]
    assert r.output_tokens == 3 and r.prompt_len == 7  # from usage, not from the chunk count / synthetic length
    assert r.latency == pytest.approx(0.5)


def test_stream_state_completions_without_usage_falls_back():
    st = StreamState("completions", start=0.0)
    for i, t in enumerate((0.1, 0.2, 0.4)):
        st.feed(_sse({"choices": [{"index": 0, "text": f"t{i}"}]}), t)
    r = st.result(end=0.5, prompt_len=16)
    assert r.success and not r.usage_reported
    assert r.output_tokens == 3 and r.prompt_len == 16
    assert r.itl == [pytest.approx(0.1), pytest.approx(0.2)]
    # llama.cpp's final chunk carries timings.predicted_n
    st = StreamState("completions", start=0.0)
    st.feed(_sse({"choices": [{"text": "ab"}]}), 0.1)
    st.feed(_sse({"choices": [{"text": "", "finish_reason": "length"}], "timings": {"predicted_n": 4}}), 0.2)
    assert st.result(0.3, 1).output_tokens == 4


def test_stream_state_errors():
    st = StreamState("completions", start=0.0)
    st.feed(_sse({"error": {"message": "too long", "code": 400}}), 0.1)
    r = st.result(0.2, 1)
    assert not r.success and r.error == "too long"
    st = StreamState("completions", start=0.0)
    st.feed(b"[DONE]", 0.1)
    r = st.result(0.2, 1)
    assert not r.success and "no content" in r.error


def test_build_payload():
    cfg = bs.ClientConfig(base_url="http://h:1/", endpoint="chat", model="m", output_len=64, api_key="k",
                          extra_body={"n_predict": 64})
    p = bs.build_payload(cfg, "hi")
    assert p["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in p
    assert p["max_tokens"] == 64 and p["ignore_eos"] is True and p["stream"] is True
    assert p["stream_options"] == {"include_usage": True} and p["n_predict"] == 64
    assert cfg.url == "http://h:1/v1/chat/completions"
    assert cfg.headers()["Authorization"] == "Bearer k"
    cfg2 = bs.ClientConfig(base_url="http://h:1", endpoint="completions", model="m", output_len=8, ignore_eos=False)
    p2 = bs.build_payload(cfg2, "hi")
    assert p2["prompt"] == "hi" and "ignore_eos" not in p2 and cfg2.url == "http://h:1/v1/completions"


@pytest.fixture(scope="module")
def tokenizer():
    return bs.load_tokenizer(None)


def test_prompts_have_exact_token_length(tokenizer):
    pool = bs.word_token_pool(tokenizer)
    for n_tokens in (1, 7, 128):
        prompts = bs.make_prompts(tokenizer, 5, n_tokens, seed=3, pool=pool)
        assert len(set(prompts)) == 5
        for p in prompts:
            assert len(tokenizer.encode(p, add_special_tokens=False).ids) == n_tokens
    same = bs.make_prompts(tokenizer, 4, 32, seed=3, identical=True, pool=pool)
    assert len(set(same)) == 1
    shared = bs.make_prompts(tokenizer, 4, 32, seed=3, shared_prefix_len=16, pool=pool, prefix_seed=9)
    heads = {tuple(tokenizer.encode(p, add_special_tokens=False).ids[:16]) for p in shared}
    tails = {tuple(tokenizer.encode(p, add_special_tokens=False).ids[16:]) for p in shared}
    assert len(heads) == 1 and len(tails) == 4
    other = bs.make_prompts(tokenizer, 2, 32, seed=4, shared_prefix_len=16, pool=pool, prefix_seed=9)
    assert tokenizer.encode(other[0]).ids[:16] == tokenizer.encode(shared[0]).ids[:16]
    assert bs.make_prompts(tokenizer, 2, 32, seed=3, pool=pool) == bs.make_prompts(tokenizer, 2, 32, seed=3, pool=pool)


def test_tokenizer_from_json_file(tmp_path, tokenizer):
    path = tmp_path / "tokenizer.json"
    path.write_text(tokenizer.to_str())
    assert bs.load_tokenizer(str(path)).encode("hello world").ids == tokenizer.encode("hello world").ids
    assert bs.load_tokenizer(str(tmp_path)).get_vocab_size() == tokenizer.get_vocab_size()


def test_cli_levels_and_defaults():
    args = bs.build_parser().parse_args(["--concurrency", "1,4,16"])
    assert bs._levels(args) == [(1, None), (4, None), (16, None)]
    assert [bs._num_requests(args, c, r) for c, r in bs._levels(args)] == [10, 20, 80]
    args = bs.build_parser().parse_args(["--request-rate", "2.5", "--max-concurrency", "8", "--num-requests", "7"])
    assert bs._levels(args) == [(8, 2.5)] and bs._num_requests(args, 8, 2.5) == 7
    with pytest.raises(SystemExit):
        bs.build_parser().parse_args(["--concurrency", "0"])


# ---------------------------------------------------------------------------------------------------------------
# End to end against a fake streaming server
# ---------------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    port = _free_port()
    seen: list = []
    loop = asyncio.new_event_loop()
    runner = loop.run_until_complete(_fake_server(port, seen))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
        rc = bs.main([
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

    port = _free_port()
    loop = asyncio.new_event_loop()
    runner = loop.run_until_complete(_fake_server(port, []))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        out_json = tmp_path / "r.json"
        rc = bs.main([
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
    assert bs.main(["--base-url", f"http://127.0.0.1:{_free_port()}", "--no-progress"]) == 1


@pytest.mark.timeout(60)
def test_main_poisson_rate(tmp_path):
    import threading

    port = _free_port()
    seen: list = []
    loop = asyncio.new_event_loop()
    runner = loop.run_until_complete(_fake_server(port, seen))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        out_json = tmp_path / "r.json"
        rc = bs.main([
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


def test_plot_title_says_what_was_measured():
    report = {"label": None, "model": "m", "base_url": "http://h:1", "endpoint": "chat",
              "config": {"input_len": 128, "output_len": 64, "identical_prompts": False, "shared_prefix_len": 0},
              "server": {"data_parallel_size": 2}}  # fmt: skip
    assert bs.plot_title(report) == "m @ http://h:1 | /v1/chat | 128 in / 64 out tokens | DP=2"
    report.update(label="run 7", server={"data_parallel_size": None})
    report["config"]["identical_prompts"] = True
    assert bs.plot_title(report) == "run 7 | /v1/chat | 128 in / 64 out tokens | identical prompts"
