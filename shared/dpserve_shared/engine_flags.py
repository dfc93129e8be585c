"""The engine's command-line flags, declared once.

`dpserve-engine` parses them with the engine's own defaults (`add_engine_flags(parser, defaults)`).
`dpserve serve` and `dpserve-coordinator` accept the same flags with every default None, meaning "not given",
and pass the given ones on to every rank (`engine_argv`), so a rank's defaults live in one place: the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

# The engine's one environment contract with whoever starts it: the process whose exit ends it (the mp launcher
# sets it: `dpserve serve`'s pid, or 0 for none; unset: the engine's parent). Read by the engine's settings.py.
WATCH_PID_ENV = "DPSERVE_WATCH_PID"


@dataclasses.dataclass(frozen=True)
class EngineFlag:
    flag: str
    kind: Any  # int, float, str; "switch" (store_true); "bool" (--x / --no-x); "positive_float" (a float > 0)
    help: str
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag(
        "--model", str,
        "'smollm2' (the bundled SmolLM2-135M GGUF), 'smollm2-moe[:E][:noise=X]' (it upcycled to E experts, top-2), "
        "a .gguf file or a Hugging Face directory (Llama family or Mixtral)",
    ),
    EngineFlag("--served-model-name", str, "the model name in the API; default: the model's"),
    EngineFlag("--max-model-len", int, "context length; default: the model's, at most 4096"),
    EngineFlag("--max-num-seqs", int, "most requests running at once per rank"),
    EngineFlag("--max-num-batched-tokens", int, "token budget of one step (decodes + prefill chunks)"),
    EngineFlag("--block-size", int, "tokens per KV-cache block"),
    EngineFlag("--num-kv-blocks", int, "KV-cache blocks per rank; default: sized from 1 GiB"),
    EngineFlag("--enable-prefix-caching", "bool", "reuse cached KV blocks of shared prompt prefixes"),
    EngineFlag("--device", str, "cpu or cuda; default: cuda when available"),
    EngineFlag(
        "--num-threads", int,
        "torch threads on CPU; default: the node's cores shared by the ranks on it that have requests",
    ),
    EngineFlag(
        "--dtype", str, "auto: float32 on CPU (greedy-exact), bf16 with an fp32 LM head on CUDA",
        ("auto", "float32", "bfloat16"),
    ),
    EngineFlag(
        "--quantization", str,
        "how the GGUF's 4-bit weights run on CPU. auto: q4 on every CPU kind (logged with the kind); q4: the "
        "engine's grouped kernels on fp32 activations, fp32 prefill copies, Q8_0 LM head; int4 (opt-in, not "
        "exact: tokens can depend on the batch and change when a stream migrates): torch's int4 kernel on bf16 "
        "activations, bf16 prefill copies, int8/bf16 LM head rescored in fp32; "
        "q4q8: as q4 but decode rows and the LM head on activations quantized to int8 (llama.cpp's way; never "
        "chosen by auto: greedy tokens differ from fp32's); none: dequantized weights in --dtype",
        ("auto", "q4", "q4q8", "int4", "none"),
    ),
    EngineFlag(
        "--enforce-eager", "switch",
        "eager PyTorch only; default: compile the decode step and build its C++ attention op at start-up on CPU "
        "(one to three minutes the first time, cached under ~/.cache/dpserve after)",
    ),
    EngineFlag(
        "--max-queue-time-s", "positive_float",
        "a request that waited this long in the rank's queue without being scheduled is ended and answered 503 "
        "with Retry-After (a moved request's continuation is exempt); default: no limit",
    ),
    EngineFlag(
        "--grammar-compile-timeout-s", "positive_float",
        "a structured-output request whose grammar has not compiled this long after it arrived is ended with an "
        "error (it waits outside the queue meanwhile, holding up no other request)",
    ),
    EngineFlag(
        "--enable-expert-parallel", "switch",
        "expert parallelism across the data-parallel ranks (vLLM's flag): the ranks form one torch.distributed "
        "group and step in lock-step waves (a rank without requests runs dummy steps while any rank has work); "
        "needs a mixture-of-experts model or --null-engine. `dpserve scale` and a dead rank's replacement re-form "
        "the group",
    ),
    EngineFlag("--null-engine", "switch", "no model: tokens on a fixed step time (benchmarks, simulation)"),
    EngineFlag("--null-step-time-ms", float, "the null engine's step time"),
    EngineFlag("--null-prefill-time-per-token-s", float,
               "the null engine's prefill cost per prompt token its prefix cache does not hold, added to the step "
               "that admits the request (routing quality without a model)"),
)  # fmt: skip


def add_engine_flags(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
    """Declare ENGINE_FLAGS on `parser`: with the engine's `defaults` (by dest), or all None (forwarders)."""
    group = parser.add_argument_group("engine (every rank)")
    for f in ENGINE_FLAGS:
        default = defaults[f.dest] if defaults is not None else None
        shown = f"{f.help} (default: {default})" if defaults is not None and f.kind != "switch" else f.help
        if f.kind == "switch":
            group.add_argument(f.flag, action="store_true", default=default, help=f.help)
        elif f.kind == "bool":
            group.add_argument(f.flag, action=argparse.BooleanOptionalAction, default=default, help=shown)
        elif f.kind == "positive_float":
            group.add_argument(f.flag, type=_positive_float, default=default, metavar="SECONDS", help=shown)
        else:
            group.add_argument(f.flag, type=f.kind, default=default, choices=f.choices, help=shown)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def engine_argv(args: argparse.Namespace) -> tuple[str, ...]:
    """The engine flags given on a forwarder's command line, as a command line for the engine."""
    argv: list[str] = []
    for f in ENGINE_FLAGS:
        value = getattr(args, f.dest)
        if value is None or (f.kind == "switch" and not value):
            continue
        if f.kind == "switch":
            argv.append(f.flag)
        elif f.kind == "bool":
            argv.append(f.flag if value else "--no-" + f.flag[2:])
        else:
            argv += [f.flag, str(value)]
    return tuple(argv)
