"""CPU kinds and the kernel-path choice (cpu_paths.py): every branch, with the detection faked, and the override
that makes a machine detect a lesser kind."""

import pytest

from dpserve_engine import cpu_paths
from dpserve_engine.cpu_paths import CpuInfo

pytestmark = pytest.mark.timeout(60)

AVX2 = CpuInfo("AMD EPYC (AVX2)", frozenset({"avx", "avx2", "fma", "f16c"}), "AVX2")
AVX512_BF16 = CpuInfo("AMD EPYC (Zen 4)", frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni",
                                                     "avx512_bf16"}), "AVX512")  # fmt: skip
AMX = CpuInfo("Intel Xeon (SPR)", frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16",
                                            "amx_int8", "amx_tile"}), "AVX512")  # fmt: skip
AVX512_ONLY = CpuInfo("Intel Xeon (Skylake)", frozenset({"avx2", "fma", "avx512f", "avx512bw"}), "AVX512")
PLAIN = CpuInfo("old x86", frozenset({"sse4_2"}), "DEFAULT")
CPUINFO = ("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx avx2 fma avx512f avx512bw avx512_bf16 "
           "amx_bf16 amx_tile amx_int8\n\nprocessor\t: 1\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx avx2\n")


@pytest.mark.parametrize("cpu, kind", [(AVX2, "avx2"), (PLAIN, "baseline"), (AVX512_ONLY, "avx512"),
                                       (AVX512_BF16, "avx512_bf16"), (AMX, "amx")])  # fmt: skip
def test_kind_by_flags(cpu, kind):
    assert cpu.kind == kind


@pytest.mark.parametrize("cpu", [AVX2, PLAIN, AVX512_ONLY, AVX512_BF16, AMX])
def test_auto_takes_the_exact_path_on_every_kind(cpu):
    """int4's decode rows round activations to bf16 and its prefill rows do not (issue #35): auto keeps to q4."""
    chosen = cpu_paths.choose(cpu)
    assert chosen.path == "q4" and chosen.exact and not chosen.caveat
    assert chosen.cpu_kind == cpu.kind and cpu.kind in chosen.reason


@pytest.mark.parametrize("forced", ["int4", "q4", "q4q8"])
def test_quantization_flag_forces_a_path(forced):
    for cpu in (AVX2, AVX512_BF16, AVX512_ONLY, AMX):
        chosen = cpu_paths.choose(cpu, forced=forced)
        assert chosen.path == forced and "--quantization" in chosen.reason


def test_a_forced_path_that_gives_up_exactness_says_so():
    for cpu in (AVX2, AVX512_ONLY, AVX512_BF16, AMX):
        int4, q4q8 = cpu_paths.choose(cpu, forced="int4"), cpu_paths.choose(cpu, forced="q4q8")
        assert not int4.exact and "batch" in int4.caveat and "migrates" in int4.caveat
        assert not q4q8.exact and "not fp32's" in q4q8.caveat
        assert cpu_paths.choose(cpu, forced="q4").exact
    assert cpu_paths.choose(AVX2, forced="int4").describe()["caveat"]


def test_unknown_forced_path_is_refused():
    with pytest.raises(ValueError, match="int4.*q4q8"):
        cpu_paths.choose(AVX2, forced="int8")


def test_q4q8_is_never_chosen_automatically():
    for cpu in (AVX2, PLAIN, AVX512_ONLY, AVX512_BF16, AMX):
        assert cpu_paths.choose(cpu).path != "q4q8"


def test_q4q8_describes_its_kernels():
    described = cpu_paths.KernelPaths("q4q8", "--quantization q4q8").describe()
    assert described["decode"] == "grouped q4 (int8 activations)" and described["prefill"] == "fp32"
    assert described["head"] == "grouped q8 (int8 activations)"


def test_detect_reads_model_and_flags(tmp_path, monkeypatch):
    for name in cpu_paths.ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    fake = tmp_path / "cpuinfo"
    fake.write_text(CPUINFO)
    cpu = cpu_paths.detect(str(fake))
    assert cpu.model_name == "Test CPU 9000" and "avx512_bf16" in cpu.flags and not cpu.masked
    described = cpu.describe()
    assert described["cpu_model"] == "Test CPU 9000" and "avx512_bf16" in described["flags"]
    assert described["torch_capability"] and described["cpu_kind"] == cpu.kind  # torch's own view caps the kind


def test_detect_survives_a_missing_cpuinfo(tmp_path):
    cpu = cpu_paths.detect(str(tmp_path / "missing"))
    assert cpu.flags == frozenset() and cpu.model_name and cpu.kind == "baseline"


@pytest.mark.parametrize("kind", ["avx512_bf16", "avx512", "avx2"])
def test_the_mask_and_the_caps_make_a_machine_detect_a_lesser_kind(tmp_path, monkeypatch, kind):
    """DPSERVE_CPU_MASK hides flags from the project's own detection; emulation_env adds the libraries' caps.
    (torch's capability is this process's: the fake CPU's kind is capped by it, as a real one would be.)"""
    fake = tmp_path / "cpuinfo"
    fake.write_text(CPUINFO)
    for name, value in cpu_paths.emulation_env(kind).items():
        monkeypatch.setenv(name, value)
    cpu = cpu_paths.detect(str(fake))
    native = CpuInfo(cpu.model_name, cpu.flags | cpu.masked, "AVX512")
    assert native.kind == "amx" and CpuInfo(cpu.model_name, cpu.flags, "AVX512", cpu.onednn_cap).kind == kind
    assert cpu.masked and not cpu.masked & cpu.flags
    assert cpu.describe()["isa_env"][cpu_paths.MASK_ENV] == cpu_paths.emulation_env(kind)[cpu_paths.MASK_ENV]
    assert cpu_paths.choose(CpuInfo(cpu.model_name, cpu.flags, "AVX512", cpu.onednn_cap)).path == "q4"


def test_onednn_held_below_amx_is_a_lesser_kind():
    """ONEDNN_MAX_CPU_ISA below AMX on an AMX machine: oneDNN (and the int4 kernel's brgemm) run without AMX."""
    for cap, kind in (("AVX512_CORE_BF16", "avx512_bf16"), ("AVX512_CORE_VNNI", "avx512"), ("AVX2", "avx2"),
                      ("AVX512_CORE_AMX", "amx"), ("ALL", "amx")):  # fmt: skip
        held = CpuInfo(AMX.model_name, AMX.flags, "AVX512", cap)
        assert held.kind == kind and cpu_paths.choose(held).path == cpu_paths.auto_path(kind)


def test_torch_held_to_avx2_on_a_bf16_cpu_takes_the_avx2_path():
    """ATEN_CPU_CAPABILITY=avx2 on an AMX machine: torch's int4 kernel runs its 256-bit code, emulating bf16."""
    held = CpuInfo(AMX.model_name, AMX.flags, "AVX2")
    assert held.kind == "avx2" and cpu_paths.choose(held).path == "q4"


def test_emulable_kinds_are_the_lesser_ones():
    assert cpu_paths.emulable_kinds(AMX) == ["avx512_bf16", "avx512", "avx2"]
    assert cpu_paths.emulable_kinds(AVX512_BF16) == ["avx512", "avx2"]
    assert cpu_paths.emulable_kinds(AVX512_ONLY) == ["avx2"]
    assert cpu_paths.emulable_kinds(AVX2) == [] and cpu_paths.emulable_kinds(PLAIN) == []
    with pytest.raises(ValueError, match="avx2"):
        cpu_paths.emulation_env("amx")


def test_describe_records_what_holds_the_vector_code_down(monkeypatch):
    for name in cpu_paths.ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    assert "isa_env" not in AVX2.describe()
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert AVX2.describe()["isa_env"] == {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def test_the_engine_logs_the_kind_and_warns_of_an_opt_in_path(engine_cache_dir, caplog):
    """choose_kernel_paths (what load_model calls): the kind and the reason at INFO; a path that is not exact on
    this CPU also as a WARNING at start-up, naming what it gives up."""
    import logging

    from dpserve_engine.core import choose_kernel_paths
    from dpserve_engine.settings import EngineConfig

    config = EngineConfig(cache_dir=engine_cache_dir)
    with caplog.at_level(logging.INFO, logger="dpserve_engine.core"):
        auto = choose_kernel_paths(config, "auto")
    assert auto.path == "q4" and auto.exact
    assert any(f"kind {auto.cpu_kind}" in r.getMessage() and "kernel path q4" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dpserve_engine.core"):
        int4 = choose_kernel_paths(config, "int4")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert int4.path == "int4" and not int4.exact and len(warnings) == 1 and "trades exactness" in warnings[0]
