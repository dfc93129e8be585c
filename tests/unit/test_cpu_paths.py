"""Kernel-path choice by CPU capability (cpu_paths.py): every branch, with the detection faked."""

import json

import pytest

from dpserve_engine import cpu_paths
from dpserve_engine.cpu_paths import CpuInfo

pytestmark = pytest.mark.timeout(60)

AVX2 = CpuInfo("AMD EPYC (AVX2)", frozenset({"avx", "avx2", "fma", "f16c"}), "AVX2")
AVX512_BF16 = CpuInfo("AMD EPYC (Zen 4)", frozenset({"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"}), "AVX512")
AMX = CpuInfo("Intel Xeon (SPR)", frozenset({"avx2", "avx512f", "amx_bf16", "amx_int8"}), "AVX512")
AVX512_ONLY = CpuInfo("Intel Xeon (Skylake)", frozenset({"avx2", "fma", "avx512f", "avx512bw"}), "AVX512")
PLAIN = CpuInfo("old x86", frozenset({"sse4_2"}), "DEFAULT")


def never(path: str) -> float:
    raise AssertionError("no micro-benchmark expected here")


@pytest.mark.parametrize("cpu, path", [(AVX2, "q4"), (PLAIN, "q4"), (AVX512_BF16, "int4"), (AMX, "int4")])
def test_capability_decides_without_measuring(cpu, path):
    chosen = cpu_paths.choose(cpu, benchmark=never)
    assert chosen.path == path and chosen.reason


@pytest.mark.parametrize("forced", ["int4", "q4", "q4q8"])
def test_quantization_flag_forces_a_path(forced):
    for cpu in (AVX2, AVX512_BF16, AVX512_ONLY):
        chosen = cpu_paths.choose(cpu, forced=forced, benchmark=never)
        assert chosen.path == forced and "--quantization" in chosen.reason


def test_unknown_forced_path_is_refused():
    with pytest.raises(ValueError, match="int4.*q4q8"):
        cpu_paths.choose(AVX2, forced="int8")


def test_q4q8_is_only_chosen_when_forced(tmp_path):
    """Not by capability, not measured by the micro-benchmark, not taken from a cache that names it."""
    for cpu in (AVX2, PLAIN, AVX512_BF16, AMX):
        assert cpu_paths.choose(cpu, benchmark=never).path != "q4q8"
    cache = str(tmp_path / "cpu-paths.json")
    json.dump({cpu_paths._cache_key(AVX512_ONLY): "q4q8"}, open(cache, "w"))
    calls = []
    chosen = cpu_paths.choose(AVX512_ONLY, benchmark=lambda p: calls.append(p) or {"int4": 0.003, "q4": 0.002}[p],
                              cache_file=cache)  # fmt: skip
    assert chosen.path == "q4" and sorted(calls) == ["int4", "q4"]


def test_q4q8_describes_its_kernels():
    described = cpu_paths.KernelPaths("q4q8", "--quantization q4q8").describe()
    assert described["decode"] == "grouped q4 (int8 activations)" and described["prefill"] == "fp32"
    assert described["head"] == "grouped q8 (int8 activations)"


def test_avx512_without_bf16_is_measured_once_and_cached(tmp_path):
    cache = str(tmp_path / "cpu-paths.json")
    calls = []

    def bench(path: str) -> float:
        calls.append(path)
        return {"int4": 0.002, "q4": 0.005}[path]

    first = cpu_paths.choose(AVX512_ONLY, benchmark=bench, cache_file=cache)
    assert first.path == "int4" and sorted(calls) == ["int4", "q4"] and "measured" in first.reason
    second = cpu_paths.choose(AVX512_ONLY, benchmark=never, cache_file=cache)  # from the cache: not measured again
    assert second.path == "int4" and cache in second.reason
    assert list(json.load(open(cache)).values()) == ["int4"]
    other = CpuInfo("another model", AVX512_ONLY.flags, "AVX512")  # cached per CPU model
    assert cpu_paths.choose(other, benchmark=lambda p: {"int4": 0.009, "q4": 0.001}[p], cache_file=cache).path == "q4"


def test_avx512_without_bf16_and_no_benchmark_takes_fp32_activations():
    assert cpu_paths.choose(AVX512_ONLY).path == "q4"


def test_detect_reads_model_and_flags(tmp_path):
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx avx2 fma avx512f avx512_bf16\n\n"
                    "processor\t: 1\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx avx2 fma avx512f avx512_bf16\n")
    cpu = cpu_paths.detect(str(fake))
    assert cpu.model_name == "Test CPU 9000" and cpu.bf16_in_hardware and "avx512f" in cpu.flags
    described = cpu.describe()
    assert described["cpu_model"] == "Test CPU 9000" and "avx512_bf16" in described["flags"]
    assert described["torch_capability"]  # torch's own view of this machine


def test_detect_survives_a_missing_cpuinfo(tmp_path):
    cpu = cpu_paths.detect(str(tmp_path / "missing"))
    assert cpu.flags == frozenset() and cpu.model_name


def test_decode_benchmark_times_every_path(engine_cache_dir):
    from dpserve_engine import kernels

    kernels.load(engine_cache_dir)
    run = cpu_paths.decode_benchmark(dim=64, ffn_dim=128, rows=(1, 2))
    assert all(run(path) > 0 for path in cpu_paths.PATHS)


def test_torch_held_to_avx2_on_a_bf16_cpu_takes_the_avx2_path():
    """ATEN_CPU_CAPABILITY=avx2 on an AMX machine: torch's int4 kernel runs its 256-bit code, emulating bf16."""
    held = CpuInfo(AMX.model_name, AMX.flags, "AVX2")
    assert held.bf16_in_hardware and not held.has_bf16
    chosen = cpu_paths.choose(held, benchmark=never)
    assert chosen.path == "q4" and "ATEN_CPU_CAPABILITY" in chosen.reason


def test_describe_records_what_holds_the_vector_code_down(monkeypatch):
    for name in cpu_paths.ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    assert "isa_env" not in AVX2.describe()
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert AVX2.describe()["isa_env"] == {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}
