"""How fast this rank prefills and decodes, measured on its own steps (EngineLoad.prefill_tokens_per_s /
decode_tokens_per_s, for the frontends' cache-aware routing cost).

Each is an exponential moving average of tokens per second of step time: a step with at least
MIN_PREFILL_SAMPLE_TOKENS prompt tokens gives a prefill sample (its prompt tokens over the whole step's time:
decodes in the same step slow a prefill down, so they count against it; a smaller prefill would mostly measure
the step's fixed cost, and the router multiplies the rate by thousands of tokens), a step with only decodes gives
a decode sample. 0 until the first sample. `busy_s` adds up every step's time (EngineLoad.busy_s: how busy each
rank was, for benchmarks and /metrics).
"""

from __future__ import annotations

ALPHA = 0.2  # weight of the newest sample
MIN_PREFILL_SAMPLE_TOKENS = 128


class StepRates:
    def __init__(self) -> None:
        self.prefill_tokens_per_s = 0.0
        self.decode_tokens_per_s = 0.0
        self.busy_s = 0.0

    def record(self, num_prefill_tokens: int, num_decode_tokens: int, step_s: float) -> None:
        if step_s <= 0:
            return
        self.busy_s += step_s
        if num_prefill_tokens >= MIN_PREFILL_SAMPLE_TOKENS:
            self.prefill_tokens_per_s = _average(self.prefill_tokens_per_s, num_prefill_tokens / step_s)
        elif num_prefill_tokens == 0 and num_decode_tokens:
            self.decode_tokens_per_s = _average(self.decode_tokens_per_s, num_decode_tokens / step_s)


def _average(current: float, sample: float) -> float:
    return sample if current == 0.0 else current + ALPHA * (sample - current)
