"""`dpserve bench serve`'s metrics: what one request measured and the fields of one level, computed from them.

The definitions are vLLM's `bench serve` and guidellm's:

- request throughput = completed / duration; output throughput = sum of output tokens / duration;
  total token throughput = (sum of prompt tokens + sum of output tokens) / duration.
- TTFT = time to the first SSE chunk that carries content (a role-only chunk does not count).
- ITL = gaps between consecutive content chunks (all requests' gaps pooled).
- TPOT = (latency - TTFT) / (output tokens - 1), per request, for requests with more than one output token.
- E2EL = latency of the whole request.
- Output token counts come from the `usage` chunk (`stream_options.include_usage`).
"""

from __future__ import annotations

import dataclasses
import math
import urllib.request
from collections.abc import Sequence

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
MAX_ERRORS_KEPT = 10


@dataclasses.dataclass
class RequestResult:
    """What one request measured. Times are seconds, relative to the request's own start."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0  # prompt tokens: from the usage chunk when there is one, else the synthetic length
    output_tokens: int = 0  # from the usage chunk when there is one, else the number of content chunks
    cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache (usage's prompt_tokens_details)
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


def engine_metrics(base_url: str, timeout_s: float = 10.0) -> dict[str, dict[int, float]]:
    """Per-engine samples from a dpserve server's /metrics: metric name -> rank -> value (summed over the other
    labels; counters under their `_total` sample names)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base_url + "/metrics", timeout=timeout_s) as response:
        text = response.read().decode()
    found: dict[str, dict[int, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "engine" in sample.labels:
                per_rank = found.setdefault(sample.name, {})
                rank = int(sample.labels["engine"])
                per_rank[rank] = per_rank.get(rank, 0.0) + sample.value
    return found
