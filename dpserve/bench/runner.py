"""`dpserve bench serve`'s load: one level's warm-up, then its requests at a fixed concurrency or Poisson rate, with a
progress bar."""

from __future__ import annotations

import asyncio
import random
import sys
import time

from dpserve.bench.client import ClientConfig, send_request
from dpserve.bench.metrics import RequestResult


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
