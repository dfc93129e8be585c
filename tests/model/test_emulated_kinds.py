"""The output promises (README, "Precision and threads on CPU") on every lesser CPU kind this machine can run:
tests/model/test_engine_real.py's promise tests again, in a process whose libraries are capped and whose CPU
detection is masked to that kind (cpu_paths.emulation_env, `dpserve cpu --emulate KIND`).

A kind whose `auto` path runs the same instructions here as a greater one already tested (cpu_paths.code_key:
AVX-512 without BF16 and with it both run q4's AVX-512 code) is skipped, saying so; a kind this CPU cannot run
is skipped too. On an AVX2-only machine nothing is emulated: the native run is that kind's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dpserve_engine import cpu_paths

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMISE_TESTS = [
    "test_answers_the_capital_of_france",
    "test_16_concurrent_requests_equal_each_alone",
    "test_a_fully_cached_prompt_gives_the_tokens_it_gave_uncached",
    "test_production_precision_matches_fp32_greedy",
    "test_a_continuation_goes_on_with_the_tokens_the_stream_would_have_had",
]


def _already_tested(kind: str, native: cpu_paths.CpuInfo) -> str | None:
    """The greater kind (the native one, or one emulated earlier) whose run covers `kind`'s code, if any."""
    key = cpu_paths.code_key(kind, cpu_paths.auto_path(kind))
    greater = [native.kind] + [k for k in cpu_paths.emulable_kinds(native) if cpu_paths.KINDS.index(k) >
                               cpu_paths.KINDS.index(kind)]  # fmt: skip
    return next((k for k in greater if cpu_paths.code_key(k, cpu_paths.auto_path(k)) == key), None)


@pytest.mark.parametrize("kind", ["avx512_bf16", "avx512", "avx2"])
def test_the_promises_hold_on_a_lesser_cpu_kind(kind):
    if os.environ.get("DPSERVE_TEST_EMULATED_KIND"):
        pytest.skip("already inside an emulated run")
    native = cpu_paths.detect()
    if kind not in cpu_paths.emulable_kinds(native):
        pytest.skip(f"this CPU is of kind {native.kind}: it cannot run {kind}'s code, or that is its own kind")
    if covered := _already_tested(kind, native):
        pytest.skip(f"{kind}'s path ({cpu_paths.auto_path(kind)}) runs the same code here as {covered}'s, tested "
                    "in this run")
    env = {**os.environ, **cpu_paths.emulation_env(kind), "DPSERVE_TEST_EMULATED_KIND": kind}
    tests = [f"tests/model/test_engine_real.py::{name}" for name in PROMISE_TESTS]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                          cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=840)  # fmt: skip
    report = (done.stdout + done.stderr)[-8000:]
    assert done.returncode == 0, f"the promise tests failed on emulated kind {kind}:\n{report}"
    assert f"{len(PROMISE_TESTS)} passed" in done.stdout, report
