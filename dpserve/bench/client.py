"""`dpserve bench serve`'s HTTP client: the streamed request (SSE parsed by `StreamState`), its body, and the
server's model list and DP size."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import orjson

from dpserve.bench.metrics import RequestResult


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
            r.cached_tokens = int((self.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            r.usage_reported = True
        else:
            r.output_tokens = self.fallback_tokens if self.fallback_tokens is not None else self.num_content_chunks
            r.prompt_len = prompt_len
        r.success = True
        return r


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


def build_payload(cfg: ClientConfig, prompt: str | list[int]) -> dict:
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


async def send_request(session, cfg: ClientConfig, prompt: str | list[int], prompt_len: int,
                       headers: dict | None = None) -> RequestResult:  # fmt: skip
    """One streamed request (`prompt`: text, or token ids on the completions endpoint; `headers`: more HTTP
    headers, e.g. X-Session-Id). A connection that fails before any response (a kept-alive socket the server had
    closed, e.g. llama-server's 5 s keep-alive) is retried once on a fresh one, with the clock restarted; the
    retry is counted in `connection_retries`. `--no-keepalive` avoids them: one connection per request."""
    import aiohttp

    payload = orjson.dumps(build_payload(cfg, prompt))
    all_headers = {**cfg.headers(), **(headers or {})}
    retries = 0
    while True:
        start = time.perf_counter()
        state = StreamState(cfg.endpoint, start)
        got_response = False
        try:
            async with session.post(
                cfg.url,
                data=payload,
                headers=all_headers,
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
