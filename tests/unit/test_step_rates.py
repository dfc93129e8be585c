"""The engine's measured prefill and decode rates (EngineLoad.prefill_tokens_per_s / decode_tokens_per_s)."""

import pytest

from dpserve_engine.step_rates import ALPHA, StepRates

pytestmark = pytest.mark.timeout(10)


def test_first_sample_then_moving_average():
    rates = StepRates()
    assert (rates.prefill_tokens_per_s, rates.decode_tokens_per_s) == (0.0, 0.0)
    rates.record(1000, 4, 0.5)  # a step with prompt tokens: a prefill sample only
    assert rates.prefill_tokens_per_s == 2000.0 and rates.decode_tokens_per_s == 0.0
    rates.record(0, 8, 0.1)
    assert rates.decode_tokens_per_s == 80.0
    rates.record(500, 0, 0.5)
    assert rates.prefill_tokens_per_s == pytest.approx(2000.0 + ALPHA * (1000.0 - 2000.0))
    rates.record(3, 4, 0.01)  # a small prefill (mostly the step's fixed cost) is no sample of either
    assert rates.prefill_tokens_per_s == pytest.approx(1800.0) and rates.decode_tokens_per_s == 80.0
    rates.record(0, 0, 0.0)  # nothing measured
    assert rates.decode_tokens_per_s == 80.0
