"""`dpserve bench serve`: a streaming load generator for any OpenAI-compatible server.

Metrics have the same definitions as vLLM's `bench serve` and guidellm:

- request throughput = completed / duration; output throughput = sum of output tokens / duration;
  total token throughput = (sum of prompt tokens + sum of output tokens) / duration.
- TTFT = time to the first SSE chunk that carries content (a role-only chunk does not count).
- ITL = gaps between consecutive content chunks (all requests' gaps pooled).
- TPOT = (latency - TTFT) / (output tokens - 1), per request, for requests with more than one output token.
- E2EL = latency of the whole request.
- Output token counts come from the `usage` chunk (`stream_options.include_usage`).

Prompts are synthetic: exactly `--input-len` tokens of the model's tokenizer, built from whole-word tokens that
re-tokenize to themselves, so the server sees exactly that many prompt tokens (completions endpoint; the chat
endpoint adds the chat template's tokens around them). No downloads: the default tokenizer is the bundled model's.

Usage: dpserve bench serve --base-url http://127.0.0.1:8000 --input-len 128 --output-len 64 --concurrency 1,4,16
       (also `python -m dpserve.bench_serve ...`)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import math
import os
import random
import sys
import time
from collections.abc import Sequence

import orjson

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
MAX_ERRORS_KEPT = 10

# ----------------------------------------------------------------------------------------------------------------
# Per-request results and the pure metric computation
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RequestResult:
    """What one request measured. Times are seconds, relative to the request's own start."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0  # prompt tokens: from the usage chunk when there is one, else the synthetic length
    output_tokens: int = 0  # from the usage chunk when there is one, else the number of content chunks
    usage_reported: bool = False
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # perf_counter() at send, for timelines
    num_content_chunks: int = 0
    retries: int = 0  # reconnections before the request reached the server (see send_request)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default, as vLLM's bench uses); 0.0 for no values."""
    if not values:
        return 0.0
    data = sorted(values)
    if len(data) == 1:
        return float(data[0])
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return float(data[lo] + (data[hi] - data[lo]) * (pos - lo))


def summarize(values_s: Sequence[float], name: str, percentiles: Sequence[int] = PERCENTILES) -> dict:
    """mean/median/std/min/max and the percentiles of a list of seconds, as `<stat>_<name>_ms` fields."""
    values = [v * 1000.0 for v in values_s]
    n = len(values)
    mean = sum(values) / n if n else 0.0
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / n) if n else 0.0
    out = {
        f"mean_{name}_ms": mean,
        f"median_{name}_ms": percentile(values, 50),
        f"std_{name}_ms": std,
        f"min_{name}_ms": min(values) if n else 0.0,
        f"max_{name}_ms": max(values) if n else 0.0,
    }
    for p in percentiles:
        out[f"p{p}_{name}_ms"] = percentile(values, p)
    out[f"num_{name}_samples"] = n
    return out


def request_tpot(result: RequestResult) -> float | None:
    """TPOT of one request: (latency - TTFT) / (output tokens - 1); None with fewer than 2 output tokens."""
    if not result.success or result.output_tokens < 2:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def compute_metrics(results: Sequence[RequestResult], duration_s: float) -> dict:
    """Every reported field of one benchmark level from its per-request results and wall duration."""
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    duration = duration_s if duration_s > 0 else float("nan")
    metrics = {
        "duration_s": duration_s,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration if ok else 0.0,
        "output_throughput": total_output / duration if ok else 0.0,
        "total_token_throughput": (total_input + total_output) / duration if ok else 0.0,
        "usage_missing": sum(1 for r in ok if not r.usage_reported),
        "connection_retries": sum(r.retries for r in results),
    }
    metrics.update(summarize([r.ttft for r in ok], "ttft"))
    metrics.update(summarize([t for t in (request_tpot(r) for r in ok) if t is not None], "tpot"))
    metrics.update(summarize([gap for r in ok for gap in r.itl], "itl"))
    metrics.update(summarize([r.latency for r in ok], "e2el"))
    errors: dict[str, int] = {}
    for r in failed:
        key = r.error[:300] or "unknown error"
        errors[key] = errors.get(key, 0) + 1
    metrics["errors"] = [{"error": e, "count": c} for e, c in list(errors.items())[:MAX_ERRORS_KEPT]]
    return metrics


# ----------------------------------------------------------------------------------------------------------------
# SSE parsing: one pure state machine per request
# ----------------------------------------------------------------------------------------------------------------


class StreamState:
    """Consumes decoded SSE `data:` payloads of one streamed request; times come from the caller."""

    def __init__(self, endpoint: str, start: float):
        self.endpoint = endpoint
        self.start = start
        self.first_content: float | None = None
        self.last_content: float | None = None
        self.itl: list[float] = []
        self.num_content_chunks = 0
        self.usage: dict | None = None
        self.fallback_tokens: int | None = None  # llama.cpp's `timings.predicted_n` / `tokens_predicted`
        self.error: str | None = None
        self.done = False
        self.text_len = 0

    def _content(self, chunk: dict) -> str:
        choices = chunk.get("choices") or []
        text = ""
        for choice in choices:
            if self.endpoint == "chat":
                delta = choice.get("delta") or {}
                piece = delta.get("content") or delta.get("reasoning_content") or ""
            else:
                piece = choice.get("text") or ""
            text += piece
        if not choices and self.endpoint != "chat" and isinstance(chunk.get("content"), str):
            text = chunk["content"]  # llama.cpp's native /completion stream
        return text

    def feed(self, data: bytes | str, now: float) -> None:
        data = data.strip() if isinstance(data, bytes) else data.strip().encode()
        if not data:
            return
        if data == b"[DONE]":
            self.done = True
            return
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.error = f"undecodable SSE data: {data[:200]!r}"
            return
        if not isinstance(chunk, dict):
            return
        if chunk.get("error"):
            err = chunk["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        timings = chunk.get("timings")
        if isinstance(timings, dict) and "predicted_n" in timings:
            self.fallback_tokens = int(timings["predicted_n"])
        elif "tokens_predicted" in chunk:
            self.fallback_tokens = int(chunk["tokens_predicted"])
        text = self._content(chunk)
        if text:
            self.num_content_chunks += 1
            self.text_len += len(text)
            if self.first_content is None:
                self.first_content = now
            else:
                self.itl.append(now - self.last_content)
            self.last_content = now

    def result(self, end: float, prompt_len: int) -> RequestResult:
        r = RequestResult(start_time=self.start, latency=end - self.start, itl=self.itl)
        r.num_content_chunks = self.num_content_chunks
        if self.error is not None:
            r.error = self.error
            return r
        if self.first_content is None:
            r.error = "no content chunk in the stream"
            return r
        r.ttft = self.first_content - self.start
        if self.usage and self.usage.get("completion_tokens") is not None:
            r.output_tokens = int(self.usage["completion_tokens"])
            r.prompt_len = int(self.usage.get("prompt_tokens") or prompt_len)
            r.usage_reported = True
        else:
            r.output_tokens = self.fallback_tokens if self.fallback_tokens is not None else self.num_content_chunks
            r.prompt_len = prompt_len
        r.success = True
        return r


# ----------------------------------------------------------------------------------------------------------------
# Synthetic prompts
# ----------------------------------------------------------------------------------------------------------------


def load_tokenizer(spec: str | None):
    """A `tokenizers.Tokenizer`: a tokenizer.json file, a directory holding one, a .gguf / model name
    (through dpserve_engine), or by default the bundled model's."""
    from tokenizers import Tokenizer

    if spec and os.path.isfile(spec) and spec.endswith(".json"):
        return Tokenizer.from_file(spec)
    if spec and os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "tokenizer.json")):
        return Tokenizer.from_file(os.path.join(spec, "tokenizer.json"))
    from dpserve_engine.model_info import load_model_info
    from dpserve_engine.settings import EngineConfig

    config = EngineConfig(model=spec) if spec else EngineConfig()
    return Tokenizer.from_str(load_model_info(config).tokenizer_json)


def word_token_pool(tokenizer, limit: int = 50000) -> list[int]:
    """Ids of tokens that are ' ' + lowercase ASCII letters and encode back to exactly themselves.

    A prompt made of such words re-tokenizes to exactly the chosen ids: every word is its own pre-token
    (byte-level pre-tokenizers split before spaces) and the whole word is one token.
    """
    pool = []
    vocab = tokenizer.get_vocab()
    for token, idx in sorted(vocab.items(), key=lambda kv: kv[1])[:limit]:
        text = tokenizer.decode([idx])
        word = text[1:]
        if len(text) < 3 or text[0] != " " or not (word.isascii() and word.isalpha() and word.islower()):
            continue
        if tokenizer.encode(text, add_special_tokens=False).ids == [idx]:
            pool.append(idx)
    if len(pool) < 100:
        raise ValueError(f"the tokenizer has only {len(pool)} plain word tokens; cannot build synthetic prompts")
    return pool


def make_prompts(
    tokenizer,
    num: int,
    input_len: int,
    seed: int = 0,
    identical: bool = False,
    shared_prefix_len: int = 0,
    pool: list[int] | None = None,
    prefix_seed: int | None = None,
) -> list[str]:
    """`num` prompts of exactly `input_len` tokens each: distinct random word sequences by default; all equal
    with `identical`; or sharing their first `shared_prefix_len` tokens. The shared part is drawn from
    `prefix_seed` (default `seed`), so warm-up and measured prompts can share it."""
    if input_len < 1:
        raise ValueError("--input-len must be at least 1")
    pool = pool or word_token_pool(tokenizer)
    shared_prefix_len = min(max(shared_prefix_len, 0), input_len)
    prefix_rng = random.Random(seed if prefix_seed is None else prefix_seed)
    prefix = [prefix_rng.choice(pool) for _ in range(input_len if identical else shared_prefix_len)]
    rng = random.Random(seed + 7919 if prefix_seed is None else seed)
    prompts = []
    for _ in range(num):
        ids = prefix + [rng.choice(pool) for _ in range(input_len - len(prefix))]
        text = tokenizer.decode(ids)
        got = tokenizer.encode(text, add_special_tokens=False).ids
        if len(got) != input_len:  # cannot happen with word_token_pool; kept as a guard
            raise AssertionError(f"synthetic prompt re-tokenized to {len(got)} tokens, not {input_len}")
        prompts.append(text)
    return prompts


# ----------------------------------------------------------------------------------------------------------------
# The HTTP client
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ClientConfig:
    base_url: str
    endpoint: str  # "completions" or "chat"
    model: str
    output_len: int
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict = dataclasses.field(default_factory=dict)
    request_timeout_s: float = 600.0
    keepalive: bool = True

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.base_url.rstrip("/") + path

    def headers(self) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


def build_payload(cfg: ClientConfig, prompt: str) -> dict:
    payload: dict = {
        "model": cfg.model,
        "max_tokens": cfg.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        payload["ignore_eos"] = True
    if cfg.endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    payload.update(cfg.extra_body)
    return payload


async def send_request(session, cfg: ClientConfig, prompt: str, prompt_len: int) -> RequestResult:
    """One streamed request. A connection that fails before any response (a kept-alive socket the server had
    closed, e.g. llama-server's 5 s keep-alive) is retried once on a fresh one, with the clock restarted; the
    retry is counted in `connection_retries`. `--no-keepalive` avoids them: one connection per request."""
    import aiohttp

    payload = orjson.dumps(build_payload(cfg, prompt))
    retries = 0
    while True:
        start = time.perf_counter()
        state = StreamState(cfg.endpoint, start)
        got_response = False
        try:
            async with session.post(
                cfg.url,
                data=payload,
                headers=cfg.headers(),
                timeout=aiohttp.ClientTimeout(total=cfg.request_timeout_s),
            ) as resp:
                got_response = True
                if resp.status != 200:
                    body = (await resp.text())[:300]
                    r = RequestResult(start_time=start, latency=time.perf_counter() - start, retries=retries)
                    r.error = f"HTTP {resp.status}: {body}"
                    return r
                buffer = b""
                async for data in resp.content.iter_any():
                    if state.done or state.error is not None:
                        continue  # read to the end: a connection left mid-body cannot be reused cleanly
                    now = time.perf_counter()
                    buffer += data
                    while True:
                        # SSE events end with a blank line; tolerate bare '\n' separated `data:` lines too.
                        idx = buffer.find(b"\n")
                        if idx < 0:
                            break
                        line, buffer = buffer[:idx].rstrip(b"\r"), buffer[idx + 1 :]
                        if line.startswith(b"data:"):
                            state.feed(line[5:], now)
                if not state.done and state.error is None and buffer.strip().startswith(b"data:"):
                    state.feed(buffer.strip()[5:], time.perf_counter())
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as e:
            if not got_response and retries < 3:
                retries += 1
                continue
            r = RequestResult(start_time=start, latency=time.perf_counter() - start, retries=retries)
            r.error = f"{type(e).__name__}: {e}"
            return r
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            r = RequestResult(start_time=start, latency=time.perf_counter() - start, retries=retries)
            r.error = f"{type(e).__name__}: {e}"
            return r
        r = state.result(time.perf_counter(), prompt_len)
        r.retries = retries
        return r


async def fetch_models(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> list[str]:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.get(base_url.rstrip("/") + "/v1/models", headers=headers) as resp:
            resp.raise_for_status()
            body = orjson.loads(await resp.read())
    return [m["id"] for m in body.get("data", [])]


async def fetch_data_parallel_size(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> int | None:
    """The server's DP size from its Prometheus metrics (`dpserve:data_parallel_size`); None for a server that
    does not export it (llama-server, vLLM without DP)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(base_url.rstrip("/") + "/metrics", headers=headers) as resp:
                if resp.status != 200:
                    return None
                text = await resp.text()
    except (OSError, aiohttp.ClientError, asyncio.TimeoutError):
        return None
    for line in text.splitlines():
        if line.startswith("dpserve:data_parallel_size"):
            try:
                return int(float(line.split()[-1]))
            except ValueError:
                return None
    return None


def plot_title(report: dict) -> str:
    """What was measured, in one line: the label (or model and URL), endpoint, lengths, DP size when known."""
    cfg = report["config"]
    parts = [report.get("label") or f"{report['model']} @ {report['base_url']}", f"/v1/{report['endpoint']}",
             f"{cfg['input_len']} in / {cfg['output_len']} out tokens"]  # fmt: skip
    if cfg.get("identical_prompts"):
        parts.append("identical prompts")
    elif cfg.get("shared_prefix_len"):
        parts.append(f"{cfg['shared_prefix_len']}-token shared prefix")
    dp = (report.get("server") or {}).get("data_parallel_size")
    if dp:
        parts.append(f"DP={dp}")
    return " | ".join(parts)


class Progress:
    """A one-line live progress bar on stderr (`\\r`), at most 10 updates a second."""

    def __init__(self, label: str, total: int, enabled: bool = True, stream=None):
        self.label, self.total, self.enabled = label, total, enabled
        self.stream = stream or sys.stderr
        self.done = self.failed = 0
        self.start = time.perf_counter()
        self._last = 0.0

    def update(self, result: RequestResult, force: bool = False) -> None:
        self.done += 1
        self.failed += 0 if result.success else 1
        self.draw(force or self.done == self.total)

    def draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        elapsed = now - self.start
        width = 30
        filled = int(width * self.done / self.total) if self.total else width
        rate = self.done / elapsed if elapsed > 0 else 0.0
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
            f" failed {self.failed}  {rate:.2f} req/s  {elapsed:.1f}s "
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            if self.done != self.total:
                self.draw(force=True)
            self.stream.write("\n")
            self.stream.flush()


async def run_level(
    cfg: ClientConfig,
    prompts: list[str],
    prompt_len: int,
    concurrency: int | None,
    request_rate: float | None,
    warmup_prompts: list[str],
    seed: int = 0,
    progress: bool = True,
    label: str = "",
) -> tuple[list[RequestResult], float]:
    """Warm up, then send every prompt with at most `concurrency` in flight (or Poisson arrivals at
    `request_rate`, optionally also capped by `concurrency`). Returns the results and the wall duration."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, force_close=not cfg.keepalive)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        if warmup_prompts:
            warm = Progress(f"{label} warm-up", len(warmup_prompts), progress)
            sem = asyncio.Semaphore(concurrency or len(warmup_prompts))

            async def warm_one(p: str) -> None:
                async with sem:
                    warm.update(await send_request(session, cfg, p, prompt_len))

            await asyncio.gather(*(warm_one(p) for p in warmup_prompts))
            warm.close()

        bar = Progress(label, len(prompts), progress)
        results: list[RequestResult | None] = [None] * len(prompts)
        start = time.perf_counter()
        bar.start = start
        if request_rate is None:
            queue = list(range(len(prompts)))
            queue.reverse()

            async def worker() -> None:
                while queue:
                    i = queue.pop()
                    results[i] = await send_request(session, cfg, prompts[i], prompt_len)
                    bar.update(results[i])

            await asyncio.gather(*(worker() for _ in range(min(concurrency or 1, len(prompts)))))
        else:
            rng = random.Random(seed + 1)
            sem = asyncio.Semaphore(concurrency) if concurrency else None

            async def one(i: int) -> None:
                if sem is not None:
                    async with sem:
                        results[i] = await send_request(session, cfg, prompts[i], prompt_len)
                else:
                    results[i] = await send_request(session, cfg, prompts[i], prompt_len)
                bar.update(results[i])

            tasks = []
            next_at = start
            for i in range(len(prompts)):
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
                next_at += rng.expovariate(request_rate) if request_rate != float("inf") else 0.0
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return [r for r in results if r is not None], duration


# ----------------------------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------------------------


def format_level(level: dict) -> str:
    lines = []
    title = (
        f" concurrency {level['concurrency']} "
        if level.get("request_rate") is None
        else f" rate {level['request_rate']} req/s (max concurrency {level.get('concurrency') or '-'}) "
    )
    lines.append(f"{title:=^60}")

    def row(name: str, value) -> None:
        if isinstance(value, float):
            value = f"{value:.2f}"
        lines.append(f"{name:<44}{value:>16}")

    row("Duration (s):", level["duration_s"])
    row("Completed requests:", level["completed"])
    row("Failed requests:", level["failed"])
    row("Total input tokens:", level["total_input_tokens"])
    row("Total generated tokens:", level["total_output_tokens"])
    row("Request throughput (req/s):", level["request_throughput"])
    row("Output token throughput (tok/s):", level["output_throughput"])
    row("Total token throughput (tok/s):", level["total_token_throughput"])
    labels = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for name in LATENCY_METRICS:
        lines.append(f"{labels[name]:-^60}")
        row(f"Mean {name.upper()} (ms):", level[f"mean_{name}_ms"])
        for p in PERCENTILES:
            row(f"P{p} {name.upper()} (ms):", level[f"p{p}_{name}_ms"])
    for err in level["errors"]:
        lines.append(f"error x{err['count']}: {err['error']}")
    if level.get("usage_missing"):
        lines.append(f"note: {level['usage_missing']} responses had no usage chunk; output tokens counted otherwise")
    lines.append("=" * 60)
    return "\n".join(lines)


def format_summary(levels: list[dict]) -> str:
    head = (
        f"{'conc':>5} {'rate':>7} {'done':>5} {'fail':>4} {'req/s':>8} {'out tok/s':>10} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'ITL p50':>8} {'E2EL p50':>9}"
    )
    lines = [head]
    for lv in levels:
        rate = "-" if lv.get("request_rate") is None else str(lv["request_rate"])
        lines.append(
            f"{lv.get('concurrency') or '-':>5} {rate:>7} {lv['completed']:>5} {lv['failed']:>4} "
            f"{lv['request_throughput']:>8.2f} {lv['output_throughput']:>10.1f} {lv['p50_ttft_ms']:>9.1f} "
            f"{lv['p99_ttft_ms']:>9.1f} {lv['p50_tpot_ms']:>9.2f} {lv['p50_itl_ms']:>8.2f} {lv['p50_e2el_ms']:>9.1f}"
        )
    return "\n".join(lines)


def write_png(path: str, levels: list[dict], title: str = "") -> None:
    """Latency percentiles and throughput versus the load level (or, for one level, the percentiles as bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rate_mode = levels[0].get("request_rate") is not None
    xs = [lv["request_rate"] if rate_mode else lv["concurrency"] for lv in levels]
    categorical = any(isinstance(x, str) for x in xs)  # an "inf" rate: plot the levels evenly spaced
    labels = [str(x) for x in xs]
    if categorical:
        xs = list(range(len(xs)))
    xlabel = "request rate (req/s)" if rate_mode else "concurrency"
    if len(levels) > 1:
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
        ax_ttft, ax_tok, ax_thr = axes
        for p, style in zip(PERCENTILES, ("-", "--", ":")):
            ax_ttft.plot(xs, [lv[f"p{p}_ttft_ms"] for lv in levels], "o" + style, color="C0", label=f"TTFT p{p}")
            ax_ttft.plot(xs, [lv[f"p{p}_e2el_ms"] for lv in levels], "s" + style, color="C3", label=f"E2EL p{p}")
            ax_tok.plot(xs, [lv[f"p{p}_tpot_ms"] for lv in levels], "o" + style, color="C1", label=f"TPOT p{p}")
            ax_tok.plot(xs, [lv[f"p{p}_itl_ms"] for lv in levels], "s" + style, color="C2", label=f"ITL p{p}")
        ax_ttft.set_ylabel("ms")
        ax_ttft.set_title("TTFT and end-to-end latency")
        ax_tok.set_ylabel("ms")
        ax_tok.set_title("TPOT and inter-token latency")
        ax_thr.plot(xs, [lv["output_throughput"] for lv in levels], "o-", color="C0", label="output tok/s")
        ax_thr.plot(xs, [lv["total_token_throughput"] for lv in levels], "s--", color="C4", label="total tok/s")
        ax_thr.set_ylabel("tokens/s")
        ax_req = ax_thr.twinx()
        ax_req.plot(xs, [lv["request_throughput"] for lv in levels], "^:", color="C3", label="req/s")
        ax_req.set_ylabel("requests/s")
        ax_thr.set_title("throughput")
        handles = ax_thr.get_legend_handles_labels()
        handles2 = ax_req.get_legend_handles_labels()
        for ax in axes:
            ax.set_xlabel(xlabel)
            if not categorical and not rate_mode and min(xs) > 0:  # concurrency levels: 1, 2, 4, ... evenly apart
                ax.set_xscale("log", base=2)
            ax.set_xticks(xs, labels)  # ticks at the levels measured, nowhere else
            ax.minorticks_off()
            ax.grid(True, alpha=0.3)
        # legends under their plots, not over the data
        below = dict(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
        ax_ttft.legend(**below)
        ax_tok.legend(**below)
        ax_thr.legend(handles[0] + handles2[0], handles[1] + handles2[1], **{**below, "ncol": 3})
    else:
        lv = levels[0]
        fig, axes = plt.subplots(1, len(LATENCY_METRICS), figsize=(16, 4))
        for ax, name in zip(axes, LATENCY_METRICS):
            keys = ["mean"] + [f"p{p}" for p in PERCENTILES]
            ax.bar(keys, [lv[f"{k}_{name}_ms"] for k in keys], color="C0")
            ax.set_title(f"{name.upper()} (ms)")
            ax.grid(True, axis="y", alpha=0.3)
        x_label = f"{xlabel} {labels[0]}: {lv['output_throughput']:.1f} out tok/s, {lv['request_throughput']:.2f} req/s"
        fig.text(0.5, 0.01, x_label, ha="center")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("expected positive integers separated by commas, e.g. 1,4,16")
    return values


def _float_list(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("expected positive rates separated by commas, e.g. 2,4 (or inf)")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dpserve bench serve",
        description="Benchmark an OpenAI-compatible server with streaming requests of fixed length "
        "(TTFT, TPOT, ITL, E2EL, throughput; definitions as in vLLM's bench serve).",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", default=None, help="model name (default: the first id from /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token ($OPENAI_API_KEY)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json file or a directory with one, or a model (.gguf path / 'smollm2'); "
        "default: the bundled model's tokenizer",
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (max_tokens, ignore_eos)")
    p.add_argument("--identical-prompts", action="store_true", help="every request sends the same prompt")
    p.add_argument(
        "--shared-prefix-len", type=int, default=0, help="tokens at the start of every prompt that all share"
    )
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (outputs may be shorter)")
    p.add_argument("--temperature", type=float, default=0.0)
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=_int_list, default=None, help="fixed concurrency levels, e.g. 1,4,16")
    load.add_argument("--request-rate", type=_float_list, default=None, help="Poisson arrival rates (req/s), e.g. 2,4")
    p.add_argument("--max-concurrency", type=int, default=None, help="with --request-rate: cap on requests in flight")
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests per level (default: 5 x concurrency, at least 10; with a rate, 10 x rate, at least 20)",
    )
    p.add_argument("--warmup", type=int, default=None, help="warm-up requests per level (default: the concurrency)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument(
        "--no-keepalive",
        action="store_true",
        help="a new connection per request (for servers that drop kept-alive connections, e.g. llama-server)",
    )
    p.add_argument("--output-json", default=None, help="write config and every per-level field here")
    p.add_argument("--output-png", default=None, help="write a plot here")
    p.add_argument("--label", default="", help="free text stored in the JSON and the plot title")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar on stderr")
    p.add_argument("--quiet", action="store_true", help="print only the summary table")
    return p


def _levels(args) -> list[tuple[int | None, float | None]]:
    if args.request_rate:
        return [(args.max_concurrency, rate) for rate in args.request_rate]
    return [(c, None) for c in (args.concurrency or [1])]


def _num_requests(args, concurrency: int | None, rate: float | None) -> int:
    if args.num_requests:
        return args.num_requests
    if rate is not None:
        return max(20, int(10 * rate)) if rate != float("inf") else 100
    return max(10, 5 * (concurrency or 1))


async def _amain(args) -> dict:
    args.base_url = args.base_url.rstrip("/")
    if args.base_url.endswith("/v1"):  # accept the OpenAI-style base URL too
        args.base_url = args.base_url[: -len("/v1")]
    extra = orjson.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise SystemExit("--extra-body must be a JSON object")
    model = args.model
    if model is None:
        models = await fetch_models(args.base_url, args.api_key)
        if not models:
            raise SystemExit(f"{args.base_url}/v1/models lists no model; pass --model")
        model = models[0]
    cfg = ClientConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=model,
        output_len=args.output_len,
        api_key=args.api_key,
        ignore_eos=not args.no_ignore_eos,
        temperature=args.temperature,
        extra_body=extra,
        request_timeout_s=args.request_timeout,
        keepalive=not args.no_keepalive,
    )
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(args.tokenizer)
    pool = word_token_pool(tokenizer)
    levels_spec = _levels(args)
    plan = []
    for i, (conc, rate) in enumerate(levels_spec):
        n = _num_requests(args, conc, rate)
        if rate is None and n < 5 * conc:
            print(
                f"warning: {n} requests at concurrency {conc} is fewer than 5 x concurrency: the level is mostly "
                "ramp-up and ramp-down, and its percentiles rest on few requests",
                file=sys.stderr,
            )
        warmup = args.warmup if args.warmup is not None else (conc or 1)
        # Distinct seeds per level and for warm-up: no distinct prompt is reused (no accidental prefix-cache
        # hits); the shared prefix / identical prompt is the same everywhere.
        common = dict(
            input_len=args.input_len,
            identical=args.identical_prompts,
            shared_prefix_len=args.shared_prefix_len,
            pool=pool,
            prefix_seed=args.seed * 1000 + 999,
        )
        prompts = make_prompts(tokenizer, n, seed=args.seed * 1000 + 2 * i, **common)
        warm = make_prompts(tokenizer, warmup, seed=args.seed * 1000 + 2 * i + 1, **common)
        plan.append((conc, rate, prompts, warm))
    if not args.quiet:
        print(f"prompts ready in {time.perf_counter() - t0:.1f}s; model {model!r} at {cfg.url}", file=sys.stderr)

    levels = []
    for conc, rate, prompts, warm in plan:
        label = f"c={conc}" if rate is None else f"rate={rate:g}"
        results, duration = await run_level(
            cfg, prompts, args.input_len, conc, rate, warm, args.seed, not args.no_progress, label
        )
        json_rate = rate if rate is None or math.isfinite(rate) else "inf"  # JSON has no infinity
        level = {"concurrency": conc, "request_rate": json_rate, "num_warmup": len(warm)}
        level.update(compute_metrics(results, duration))
        levels.append(level)
        if not args.quiet:
            print(format_level(level), flush=True)

    report = {
        "tool": "dpserve bench serve",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "label": args.label,
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": model,
        "machine": machine(),
        "server": {"data_parallel_size": await fetch_data_parallel_size(args.base_url, args.api_key)},
        "config": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "identical_prompts": args.identical_prompts,
            "shared_prefix_len": args.shared_prefix_len,
            "ignore_eos": cfg.ignore_eos,
            "temperature": cfg.temperature,
            "concurrency": args.concurrency,
            "request_rate": [r if math.isfinite(r) else "inf" for r in args.request_rate or []] or None,
            "max_concurrency": args.max_concurrency,
            "num_requests": args.num_requests,
            "warmup": args.warmup,
            "seed": args.seed,
            "tokenizer": args.tokenizer or "bundled model",
            "extra_body": extra,
            "keepalive": cfg.keepalive,
            "percentiles": list(PERCENTILES),
            "argv": sys.argv,
        },
        "levels": levels,
    }
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    if args.input_len < 1 or args.output_len < 1:
        print("--input-len and --output-len must be at least 1", file=sys.stderr)
        return 2
    import aiohttp

    try:
        import uvloop  # a cheaper event loop: the client shares the CPU with the server under test

        run = uvloop.run
    except (ImportError, AttributeError):
        run = asyncio.run
    try:
        report = run(_amain(args))
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (OSError, aiohttp.ClientError) as e:  # e.g. the server is not up
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(format_summary(report["levels"]), flush=True)
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "wb") as f:
            f.write(orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    if args.output_png:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_png)), exist_ok=True)
        write_png(args.output_png, report["levels"], plot_title(report))
    return 0 if all(lv["completed"] > 0 for lv in report["levels"]) else 1


def machine() -> dict:
    """The CPU this client ran on (for a local server, the server's too), its relevant flags and the kernel path
    an engine picks on it by default (dpserve_engine.cpu_paths)."""
    from dpserve_engine import cpu_paths

    cpu = cpu_paths.detect()
    return {**cpu.describe(), "default_kernel_path": cpu_paths.choose(cpu).describe()}


if __name__ == "__main__":
    sys.exit(main())
