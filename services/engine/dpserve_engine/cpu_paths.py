"""Which kernels a quantized GGUF model runs on, chosen for the CPU at hand, and which CPU kind that is.

CPU kinds, lesser to greater (`KINDS`; `CpuInfo.kind`):

| kind | what it has | seen as |
| --- | --- | --- |
| `avx2` | AVX2 + FMA, no AVX-512 | AMD EPYC Zen 2/3, most cloud baselines |
| `avx512` | AVX-512 F/BW (VNNI), no AVX512-BF16 | Intel Xeon Skylake..Ice Lake |
| `avx512_bf16` | AVX-512 with AVX512-BF16, no AMX | AMD EPYC Zen 4/5 |
| `amx` | AVX512-BF16 and AMX | Intel Xeon Sapphire Rapids and later |

(`baseline` below `avx2`: anything older.) The kind is what the libraries will actually run, not only what the
CPU has: it is capped by torch's vector capability (`ATEN_CPU_CAPABILITY`), by oneDNN's (`ONEDNN_MAX_CPU_ISA`)
and by the mask (`settings.CPU_MASK_ENV`: flags to hide from this detection, comma-separated, `*` globs). `emulation_env(kind)`
gives all of them for a lesser kind, so a machine runs another kind's choices (`dpserve cpu-env KIND`).

Each kind of work has paths; `auto` takes the one whose promises (README, "Precision and threads on CPU") hold on
every kind: greedy and seeded tokens independent of the batch, a migrated stream continuing with the tokens it
would have had (its continuation's prefill gives the logits its decode steps gave, up to the order of fp32 sums),
greedy tokens equal to the fp32 model's on the test prompts. That is "q4" on every kind; the others are opt-in
(`--quantization int4|q4q8`, on any x86-64 CPU) and say at start-up what they give up.

| work | "q4" (auto, every kind) | opt-in: "int4" | opt-in: "q4q8" |
| --- | --- | --- | --- |
| decode rows (linear layers) | the engine's grouped kernel (csrc/grouped_linear.cpp) on the file's Q4_1 groups, fp32 activations | torch's int4 kernel on the same groups, bf16 activations | the engine's int8-activation kernel (csrc/grouped_linear_q8.cpp), activations rounded to int8 per group of 32 (llama.cpp's Q8_1) |
| prefill rows (linear layers) | an fp32 copy (MKL sgemm) | a bf16 hi+lo copy (two bf16 GEMMs' worth, ~fp32 exact) | an fp32 copy (MKL sgemm) |
| LM head | the tied Q8_0 embedding in the grouped kernel, fp32 activations | int8 (<= 8 rows) or bf16 copies, each row's best 8 rescored in fp32 | the Q8_0 embedding in the int8-activation kernel |
| decode attention | the engine's C++ op over the paged cache (all three) | | |

"int4" was `auto`'s choice on CPUs with bf16 in hardware until issue #35: its decode rows round activations to bf16
while its prefill rows do not, so a migrated stream's continuation (a prefill) and a prompt batched with others can
take another token where the top two are within bf16's rounding: measured on AVX-512 without BF16 (5 migrated
streams and 2 batch checks failed) and on AVX512-BF16 without AMX (2 of 5 migrated-stream checks failed); the
tests passed on Sapphire Rapids, where the same rounding is at work. "q4q8" never keeps fp32's tokens.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import os
import platform

from dpserve_engine.settings import CPU_MASK_ENV as MASK_ENV, cpu_mask_from_env

logger = logging.getLogger(__name__)

# The flags that decide a kind, and that benchmarks record
RELEVANT_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16",
                  "amx_int8", "amx_tile", "avx_vnni")  # fmt: skip
# What holds the libraries' vector code below the CPU's (benchmarks record them: `isa_env`), and the project's own
ISA_ENV = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", MASK_ENV)
KINDS = ("baseline", "avx2", "avx512", "avx512_bf16", "amx")  # lesser to greater
PATHS = ("int4", "q4", "q4q8")  # what --quantization may force

# The environment that makes a greater machine run a lesser kind's code and choices (emulation_env)
_EMULATION = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             MASK_ENV: "avx512*,amx*"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
               "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI", MASK_ENV: "avx512_bf16,amx*"},
    "avx512_bf16": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
                    "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", MASK_ENV: "amx*"},
}  # fmt: skip
# ONEDNN_MAX_CPU_ISA's values -> the greatest kind oneDNN then runs (unknown values: no cap, logged)
_ONEDNN_CAPS = {"SSE41": "baseline", "AVX": "baseline", "AVX2": "avx2", "AVX2_VNNI": "avx2", "AVX2_VNNI_2": "avx2",
                "AVX512_CORE": "avx512", "AVX512_CORE_VNNI": "avx512", "AVX512_CORE_BF16": "avx512_bf16",
                "AVX512_CORE_FP16": "avx512_bf16", "AVX10_1_512": "avx512_bf16"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CpuInfo:
    model_name: str
    flags: frozenset[str]  # as the engine sees them: /proc/cpuinfo's, less the mask's (MASK_ENV)
    capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX512", "AVX2", "DEFAULT", ...
    onednn_cap: str = ""  # ONEDNN_MAX_CPU_ISA, when set
    masked: frozenset[str] = frozenset()  # the flags the mask hid

    @property
    def kind(self) -> str:
        """The greatest of KINDS that the flags, torch's capability and oneDNN's cap all allow."""
        f = self.flags
        by_flags = ("amx" if {"amx_bf16", "amx_tile"} <= f and "avx512_bf16" in f else
                    "avx512_bf16" if {"avx512f", "avx512bw", "avx512_bf16"} <= f else
                    "avx512" if {"avx512f", "avx512bw"} <= f else
                    "avx2" if {"avx2", "fma"} <= f else "baseline")  # fmt: skip
        by_torch = "amx" if self.capability.startswith("AVX512") else "avx2" if self.capability == "AVX2" else "baseline"
        by_onednn = _ONEDNN_CAPS.get(self.onednn_cap.upper(), "amx")
        return min((by_flags, by_torch, by_onednn), key=KINDS.index)

    def describe(self) -> dict:
        """For logs, /status and benchmark JSON: the model, the kind, torch's capability and the flags present."""
        return {
            "cpu_model": self.model_name,
            "cpu_kind": self.kind,
            "torch_capability": self.capability,
            "flags": [f for f in RELEVANT_FLAGS if f in self.flags],
            "num_cpus": os.cpu_count(),
            **({"isa_env": env} if (env := {k: os.environ[k] for k in ISA_ENV if os.environ.get(k)}) else {}),
        }


def detect(cpuinfo_path: str = "/proc/cpuinfo") -> CpuInfo:
    """This machine's CPU as the engine will use it: the model name and flags (Linux /proc/cpuinfo) less those
    the mask (MASK_ENV) hides, torch's vector capability and oneDNN's cap (see the module docstring)."""
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
    patterns = cpu_mask_from_env()
    masked = frozenset(f for f in flags if any(fnmatch.fnmatchcase(f, p) for p in patterns))
    onednn_cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip()
    if onednn_cap and onednn_cap.upper() not in _ONEDNN_CAPS and onednn_cap.upper() not in ("ALL", "DEFAULT"):
        logger.warning("ONEDNN_MAX_CPU_ISA=%s is not a cap this detection knows; taken as no cap", onednn_cap)
    return CpuInfo(model_name, flags - masked, torch.backends.cpu.get_cpu_capability(), onednn_cap, masked)


def emulation_env(kind: str) -> dict[str, str]:
    """The environment that makes a machine of a greater kind run `kind`'s code and choices: the libraries' caps
    and the mask. Set it before the process starts (torch, MKL and oneDNN read theirs once)."""
    if kind not in _EMULATION:
        raise ValueError(f"CPU kind to emulate must be one of {sorted(_EMULATION)}, got {kind!r}")
    return dict(_EMULATION[kind])


def emulable_kinds(cpu: CpuInfo) -> list[str]:
    """The lesser kinds this machine can run (greatest first): those below its own kind, from avx2 up."""
    return [k for k in reversed(KINDS[1 : KINDS.index(cpu.kind)]) if k in _EMULATION]


def code_key(kind: str, path: str) -> tuple[str, str]:
    """What decides the code a path runs on a kind: two kinds with one key run the same instructions for it. q4
    and q4q8 run the engine's kernels and MKL, which differ only by vector width; int4 runs torch's kernels and
    oneDNN, which also use AVX512-BF16 and AMX."""
    if path == "int4":
        return path, kind
    return path, "avx512" if kind in ("avx512", "avx512_bf16", "amx") else kind


@dataclasses.dataclass(frozen=True)
class KernelPaths:
    """The chosen path ("int4", "q4" or "q4q8", see the module docstring), why, and whether it keeps the
    README's promises on this CPU kind (`exact`; when not, `caveat` says what is given up)."""

    path: str
    reason: str
    cpu_kind: str = ""
    exact: bool = True
    caveat: str = ""

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
        return {"path": self.path, "cpu_kind": self.cpu_kind, "decode": self.decode, "prefill": self.prefill,
                "head": self.head, "attention": "paged C++ op", "reason": self.reason, "exact": self.exact,
                **({"caveat": self.caveat} if self.caveat else {})}  # fmt: skip


def auto_path(kind: str) -> str:
    """The path `auto` takes on a CPU kind: q4 on every kind (the module docstring says why)."""
    return "q4"


def choose(cpu: CpuInfo, forced: str | None = None) -> KernelPaths:
    """The path for this CPU: forced by --quantization, else auto's (with the CPU kind in the reason)."""
    kind = cpu.kind
    if forced is None:
        return KernelPaths(auto_path(kind), f"CPU kind {kind}: fp32 activations keep fp32's tokens on every kind "
                                            "(int4 and q4q8 are opt-in)", kind)  # fmt: skip
    if forced not in PATHS:
        raise ValueError(f"kernel path must be one of {PATHS}, got {forced!r}")
    caveat = {
        "int4": "bf16 activations in decode rows, not in prefill rows: greedy and seeded tokens can depend on the "
                "batch, change when a stream migrates to another rank, and differ from fp32's at near ties",
        "q4q8": "int8 activations: greedy tokens are not fp32's and can depend on the batch",
    }.get(forced, "")  # fmt: skip
    return KernelPaths(forced, f"--quantization {forced}", kind, exact=not caveat, caveat=caveat)
