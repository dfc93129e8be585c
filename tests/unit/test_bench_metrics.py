"""`dpserve bench serve`: the metric definitions (vLLM's bench serve), SSE parsing, synthetic prompts (the run
against a fake OpenAI server is tests/integration/test_bench_client.py)."""

from __future__ import annotations

import orjson
import pytest

from dpserve.bench.client import ClientConfig, StreamState, build_payload
from dpserve.bench.metrics import LATENCY_METRICS, RequestResult, compute_metrics, percentile, request_tpot, summarize
from dpserve.bench.prompts import load_tokenizer, make_prompts, word_token_pool
from dpserve.bench.report import plot_title
from dpserve.bench.serve import _levels, _num_requests, build_parser


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
    for name in LATENCY_METRICS:
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
    cfg = ClientConfig(base_url="http://h:1/", endpoint="chat", model="m", output_len=64, api_key="k",
                       extra_body={"n_predict": 64})
    p = build_payload(cfg, "hi")
    assert p["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in p
    assert p["max_tokens"] == 64 and p["ignore_eos"] is True and p["stream"] is True
    assert p["stream_options"] == {"include_usage": True} and p["n_predict"] == 64
    assert cfg.url == "http://h:1/v1/chat/completions"
    assert cfg.headers()["Authorization"] == "Bearer k"
    cfg2 = ClientConfig(base_url="http://h:1", endpoint="completions", model="m", output_len=8, ignore_eos=False)
    p2 = build_payload(cfg2, "hi")
    assert p2["prompt"] == "hi" and "ignore_eos" not in p2 and cfg2.url == "http://h:1/v1/completions"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def test_prompts_have_exact_token_length(tokenizer):
    pool = word_token_pool(tokenizer)
    for n_tokens in (1, 7, 128):
        prompts = make_prompts(tokenizer, 5, n_tokens, seed=3, pool=pool)
        assert len(set(prompts)) == 5
        for p in prompts:
            assert len(tokenizer.encode(p, add_special_tokens=False).ids) == n_tokens
    same = make_prompts(tokenizer, 4, 32, seed=3, identical=True, pool=pool)
    assert len(set(same)) == 1
    shared = make_prompts(tokenizer, 4, 32, seed=3, shared_prefix_len=16, pool=pool, prefix_seed=9)
    heads = {tuple(tokenizer.encode(p, add_special_tokens=False).ids[:16]) for p in shared}
    tails = {tuple(tokenizer.encode(p, add_special_tokens=False).ids[16:]) for p in shared}
    assert len(heads) == 1 and len(tails) == 4
    other = make_prompts(tokenizer, 2, 32, seed=4, shared_prefix_len=16, pool=pool, prefix_seed=9)
    assert tokenizer.encode(other[0]).ids[:16] == tokenizer.encode(shared[0]).ids[:16]
    assert make_prompts(tokenizer, 2, 32, seed=3, pool=pool) == make_prompts(tokenizer, 2, 32, seed=3, pool=pool)


def test_tokenizer_from_json_file(tmp_path, tokenizer):
    path = tmp_path / "tokenizer.json"
    path.write_text(tokenizer.to_str())
    assert load_tokenizer(str(path)).encode("hello world").ids == tokenizer.encode("hello world").ids
    assert load_tokenizer(str(tmp_path)).get_vocab_size() == tokenizer.get_vocab_size()


def test_cli_levels_and_defaults():
    args = build_parser().parse_args(["--concurrency", "1,4,16"])
    assert _levels(args) == [(1, None), (4, None), (16, None)]
    assert [_num_requests(args, c, r) for c, r in _levels(args)] == [10, 20, 80]
    args = build_parser().parse_args(["--request-rate", "2.5", "--max-concurrency", "8", "--num-requests", "7"])
    assert _levels(args) == [(8, 2.5)] and _num_requests(args, 8, 2.5) == 7
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--concurrency", "0"])


def test_plot_title_says_what_was_measured():
    report = {"label": None, "model": "m", "base_url": "http://h:1", "endpoint": "chat",
              "config": {"input_len": 128, "output_len": 64, "identical_prompts": False, "shared_prefix_len": 0},
              "server": {"data_parallel_size": 2}}  # fmt: skip
    assert plot_title(report) == "m @ http://h:1 | /v1/chat | 128 in / 64 out tokens | DP=2"
    report.update(label="run 7", server={"data_parallel_size": None})
    report["config"]["identical_prompts"] = True
    assert plot_title(report) == "run 7 | /v1/chat | 128 in / 64 out tokens | identical prompts"
