"""Which kernels a quantized GGUF model runs on, chosen for the CPU at hand.

A CPU with bf16 in hardware (AVX512-BF16 or AMX) multiplies bf16 at several times the fp32 rate; one without it
(AVX2, or AVX-512 without BF16) emulates bf16, and there a bf16 GEMM is ~7x slower than fp32 and torch's int4 and
int8 weight-only kernels (which take bf16 activations) lose their edge. So each kind of work has two paths, and
a third one only on request:

| work | bf16 hardware: "int4" | no bf16 hardware: "q4" | opt-in: "q4q8" |
| --- | --- | --- | --- |
| decode rows (linear layers) | torch's int4 kernel on the file's Q4_1 groups, bf16 activations | the engine's grouped kernel (csrc/grouped_linear.cpp) on the same groups, fp32 activations | the engine's int8-activation kernel (csrc/grouped_linear_q8.cpp) on the same groups, activations quantized per group of 32 to int8 (llama.cpp's Q8_1) |
| prefill rows (linear layers) | a bf16 hi+lo copy of the weights (two bf16 GEMMs' worth, ~fp32 exact) | an fp32 copy (MKL sgemm) | an fp32 copy (MKL sgemm) |
| LM head | int8 (<= 8 rows) or bf16 copies, each row's best 8 rescored in fp32 | the tied Q8_0 embedding in the grouped kernel, fp32 activations (the fp32 head itself, no rescore) | the tied Q8_0 embedding in the int8-activation kernel (not the fp32 head's logits; no rescore) |
| decode attention | the engine's C++ op over the paged cache (all three) | | |
| greedy tokens | fp32's on the test prompts (bf16 rounding may swap a near tie) | fp32's | not fp32's: 8-bit activations change some, and can make a prompt's tokens depend on its batch (README) |

Where the answer is not obvious (AVX-512 without BF16: torch's int4 kernel has AVX-512 code there, ours runs
256-bit), a micro-benchmark of both decode kernels at start-up (~0.2 s) decides, and its verdict is cached per CPU
model and torch version under `<cache_dir>/cpu-paths.json`. `--quantization int4|q4|q4q8` forces a path.
"q4q8" (issue #13: llama.cpp's int8 dot products, faster than "q4" at small batches) is never chosen
automatically, neither by capability nor by the micro-benchmark (`AUTO_PATHS`): it does not keep fp32's greedy
tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

# The flags that decide a path, and that benchmarks record
RELEVANT_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16",
                  "amx_int8", "avx_vnni")  # fmt: skip
# What holds the libraries' vector code below the CPU's (benchmarks record them: `isa_env`); all three set to AVX2
# make an AVX-512 machine run the code an AVX2-only one runs (README, "Kernel paths")
ISA_ENV = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
PATHS = ("int4", "q4", "q4q8")  # what --quantization may force
AUTO_PATHS = ("int4", "q4")  # what the automatic choice picks from (q4q8 only when forced)


@dataclasses.dataclass(frozen=True)
class CpuInfo:
    model_name: str
    flags: frozenset[str]
    capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX512", "AVX2", "DEFAULT", ...

    @property
    def bf16_in_hardware(self) -> bool:
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    @property
    def has_bf16(self) -> bool:
        """bf16 multiplies in hardware, and torch's kernels may use them: with its vector code held to AVX2
        (ATEN_CPU_CAPABILITY=avx2, e.g. to measure the AVX2 path on an AVX-512 machine) its int4 kernel runs
        256-bit code that emulates bf16."""
        return self.bf16_in_hardware and self.capability.startswith("AVX512")

    @property
    def has_avx512(self) -> bool:
        return "avx512f" in self.flags and self.capability.startswith("AVX512")

    def describe(self) -> dict:
        """For logs and benchmark JSON: the model, torch's capability and the relevant flags present."""
        return {
            "cpu_model": self.model_name,
            "torch_capability": self.capability,
            "flags": [f for f in RELEVANT_FLAGS if f in self.flags],
            "num_cpus": os.cpu_count(),
            **({"isa_env": env} if (env := {k: os.environ[k] for k in ISA_ENV if os.environ.get(k)}) else {}),
        }


def detect(cpuinfo_path: str = "/proc/cpuinfo") -> CpuInfo:
    """This machine's CPU: its model name and flags (Linux /proc/cpuinfo) and torch's vector capability."""
    import torch

    model_name, flags = platform.processor() or platform.machine(), frozenset()
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model_name in ("", platform.machine(), platform.processor()):
                    model_name = value.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
                if flags and key == "model name":
                    break
    except OSError:
        pass
    return CpuInfo(model_name, flags, torch.backends.cpu.get_cpu_capability())


@dataclasses.dataclass(frozen=True)
class KernelPaths:
    """The chosen path ("int4", "q4" or "q4q8", see the module docstring) and why."""

    path: str
    reason: str

    @property
    def decode(self) -> str:
        return {"int4": "torch int4 (bf16 activations)", "q4": "grouped q4 (fp32 activations)",
                "q4q8": "grouped q4 (int8 activations)"}[self.path]  # fmt: skip

    @property
    def prefill(self) -> str:
        return "bf16 hi+lo" if self.path == "int4" else "fp32"

    @property
    def head(self) -> str:
        return {"int4": "int8/bf16 + fp32 rescore", "q4": "grouped q8 (fp32 activations)",
                "q4q8": "grouped q8 (int8 activations)"}[self.path]  # fmt: skip

    def describe(self) -> dict:
        return {"path": self.path, "decode": self.decode, "prefill": self.prefill, "head": self.head,
                "attention": "paged C++ op", "reason": self.reason}  # fmt: skip


Benchmark = Callable[[str], float]  # path -> seconds for a representative decode step's matmuls


def choose(cpu: CpuInfo, forced: str | None = None, benchmark: Benchmark | None = None,
           cache_file: str | None = None) -> KernelPaths:
    """The path for this CPU: forced by --quantization, else by capability, else measured (cached)."""
    if forced is not None:
        if forced not in PATHS:
            raise ValueError(f"kernel path must be one of {PATHS}, got {forced!r}")
        return KernelPaths(forced, f"--quantization {forced}")
    if cpu.has_bf16:
        return KernelPaths("int4", "bf16 in hardware (avx512_bf16/amx_bf16): torch's int4 and bf16 kernels")
    if cpu.bf16_in_hardware:  # torch held below AVX-512
        return KernelPaths("q4", f"torch's vector code held to {cpu.capability} (ATEN_CPU_CAPABILITY): bf16 is "
                                 "emulated there, fp32 activations are faster")  # fmt: skip
    if not cpu.has_avx512:
        what = "AVX2" if "avx2" in cpu.flags else "no AVX2"
        return KernelPaths("q4", f"{what}, no bf16 in hardware: bf16 is emulated, fp32 activations are faster")
    return _measured(cpu, benchmark, cache_file)


def _measured(cpu: CpuInfo, benchmark: Benchmark | None, cache_file: str | None) -> KernelPaths:
    """AVX-512 without BF16: time both decode kernels (int4, q4) once, keep the faster (cached per CPU model)."""
    key = _cache_key(cpu)
    cached = _read_cache(cache_file).get(key)
    if cached in AUTO_PATHS:
        return KernelPaths(cached, f"AVX-512 without BF16: {cached} measured faster here earlier ({cache_file})")
    if benchmark is None:
        return KernelPaths("q4", "AVX-512 without BF16, not measured: fp32 activations")
    started = time.perf_counter()
    timings = {path: benchmark(path) for path in AUTO_PATHS}
    best = min(timings, key=timings.get)
    logger.info("kernel micro-benchmark (%.2f s): %s", time.perf_counter() - started,
                ", ".join(f"{p} {t * 1e3:.2f} ms" for p, t in timings.items()))
    if cache_file:
        _write_cache(cache_file, key, best)
    shown = ", ".join(f"{p} {t * 1e3:.2f} ms" for p, t in timings.items())
    return KernelPaths(best, f"AVX-512 without BF16: measured {shown}")


def _cache_key(cpu: CpuInfo) -> str:
    import torch

    text = "|".join([cpu.model_name, cpu.capability, *sorted(f for f in RELEVANT_FLAGS if f in cpu.flags),
                     torch.__version__])  # fmt: skip
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _read_cache(cache_file: str | None) -> dict:
    if not cache_file or not os.path.isfile(cache_file):
        return {}
    try:
        with open(cache_file) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(cache_file: str, key: str, path: str) -> None:
    data = _read_cache(cache_file)
    data[key] = path
    try:
        os.makedirs(os.path.dirname(cache_file) or ".", exist_ok=True)
        tmp = f"{cache_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, cache_file)
    except OSError as e:
        logger.warning("could not cache the kernel choice in %s: %s", cache_file, e)


def decode_benchmark(dim: int = 576, ffn_dim: int = 1536, rows: tuple[int, ...] = (1, 16)) -> Benchmark:
    """Times one layer-sized set of matmuls (qkv-sized, o, gate+up, down) per decode kernel at a few row counts,
    on random groups: what a decode step spends most of its time on. A few hundred ms in all."""
    import torch

    from dpserve_engine import model as m

    def run(path: str) -> float:
        gen = torch.Generator().manual_seed(0)
        layers = []
        for n, k in ((dim * 2, dim), (dim, dim), (2 * ffn_dim, dim), (dim, ffn_dim)):
            q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
            d = torch.rand(n, k // 32, generator=gen) * 0.01
            layers.append(m.GroupedLinear(q, d, -8 * d, m.RowSplit(), path, prefill_copy=False))
        total = 0.0
        for r in rows:
            xs = [torch.randn(r, layer.in_features, generator=gen) for layer in layers]
            for layer, x in zip(layers, xs):
                layer.decode(x, r)  # warm
            samples = []
            for _ in range(5):
                t = time.perf_counter()
                for layer, x in zip(layers, xs):
                    layer.decode(x, r)
                samples.append(time.perf_counter() - t)
            total += sorted(samples)[len(samples) // 2]
        return total

    return run
