"""`dpserve bench engine`: how much of the bare model's decode speed the EngineCore loop keeps.

In one process, interleaved A B A B ...: (A) EngineCore.step() with `--batch` running requests (decode only,
ignore_eos, sampling at temperature 1); (B) the bare batched forward of the same model on the same batch (the
same paged-attention inputs, prepared outside the timer; the compiled decode step unless --enforce-eager, as in
the engine) plus the LM head and an argmax. The ratio of median
step times B / A, per round and then the median over rounds, is `engine_efficiency` (1.0 = the engine adds
nothing on top of the forward); printed last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from dpserve_shared.schema import EngineRequest, SamplingParams

from dpserve_engine import cpu_paths
from dpserve_engine.settings import EngineConfig
from dpserve_engine.core import EngineCore
from dpserve_engine.scheduler import ScheduledBatch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dpserve bench engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--quantization", default="auto", choices=["auto", "q4", "q4q8", "int4", "none"])
    p.add_argument("--device", default=None)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--steps", type=int, default=3, help="steps per A or B round")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true", help="eager PyTorch: no compiled decode step")
    p.add_argument("--output-json", default=None, help="write the machine, the kernel paths and the result here")
    return p.parse_args(argv)


def start_requests(core: EngineCore, batch: int, prompt_len: int, max_tokens: int) -> None:
    vocab = core.runner.model.args.vocab_size
    for i in range(batch):
        prompt = [(1000 + 37 * i + 11 * j) % (vocab - 100) + 100 for j in range(prompt_len)]
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
        core.add_request(EngineRequest(f"bench-{i}", prompt, params))
    while core.scheduler.waiting or any(s.is_prefilling for s in core.scheduler.running):
        core.step()  # prefill everything; from here on every step is a pure decode step


def time_engine(core: EngineCore, steps: int) -> list[float]:
    """Seconds of each of `steps` engine steps."""
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - started)
    return times


@torch.inference_mode()
def time_forward(core: EngineCore, steps: int) -> list[float]:
    """The same decode batch through the bare model. Writes K/V to the slots the next engine step overwrites."""
    runner = core.runner
    seqs = list(core.scheduler.running)
    for seq in seqs:
        core.block_manager.may_append(seq, 1)  # the block the next engine step would allocate anyway
    batch = ScheduledBatch(seqs, [1] * len(seqs), len(seqs))
    if runner.compiled is not None:  # the engine's own forward: the compiled decode step
        inputs = runner.prepare_decode_only(seqs, runner.compiled.min_rows, runner.compiled.min_blocks)
        forward = lambda: runner.compiled(inputs)  # noqa: E731
    else:
        tokens, positions, meta = runner.prepare(batch)
        forward = lambda: runner.model(tokens, positions, meta, runner.kv_caches)  # noqa: E731
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        hidden = forward()[: len(seqs)]
        runner.model.compute_logits(hidden).argmax(dim=-1).tolist()
        times.append(time.perf_counter() - started)
    return times


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    config = EngineConfig(
        model=args.model, dtype=args.dtype, quantization=args.quantization, device=args.device, num_threads=args.threads,
        max_num_seqs=args.batch, enable_prefix_caching=False, enforce_eager=args.enforce_eager,
    )
    core = EngineCore(config)
    max_tokens = (args.rounds + 1) * args.steps + 8
    machine = cpu_paths.detect().describe()
    paths = core.runner.model.kernel_paths
    print(f"cpu={machine['cpu_model']!r} torch_capability={machine['torch_capability']} "
          f"flags={','.join(machine['flags']) or '-'} kernel_path={paths.path if paths else None}"
          + "".join(f" {k}={v}" for k, v in machine.get("isa_env", {}).items()))
    print(f"model={config.model} device={core.runner.device} precision={core.runner.model.prec} "
          f"threads={torch.get_num_threads()} batch={args.batch} compiled={core.runner.compiled is not None}")
    start_requests(core, args.batch, args.prompt_len, max_tokens)
    assert len(core.scheduler.running) == args.batch, "the batch does not fit: raise kv_cache_memory_gib"
    time_engine(core, 2), time_forward(core, 2)  # warm up both paths
    engine_s, forward_s = [], []  # every step's time; medians resist the other processes on a shared machine
    for i in range(args.rounds):
        engine_s += time_engine(core, args.steps)
        forward_s += time_forward(core, args.steps)
        a, b = statistics.median(engine_s[-args.steps:]), statistics.median(forward_s[-args.steps:])
        print(f"round {i}: engine {a * 1e3:.1f} ms/step ({args.batch / a:.0f} tok/s), "
              f"forward {b * 1e3:.1f} ms/step ({args.batch / b:.0f} tok/s)")
    a, b = statistics.median(engine_s), statistics.median(forward_s)
    print(f"median over {len(engine_s)} steps each: engine {a * 1e3:.1f} ms ({args.batch / a:.0f} tok/s), "
          f"forward {b * 1e3:.1f} ms ({args.batch / b:.0f} tok/s); best step ratio {min(forward_s) / min(engine_s):.3f}")
    # Paired: each round's B over the same round's A, so slow drifts in machine load cancel; median over rounds.
    efficiency = statistics.median(
        statistics.median(forward_s[i : i + args.steps]) / statistics.median(engine_s[i : i + args.steps])
        for i in range(0, len(engine_s), args.steps)
    )
    print(f"engine_efficiency={efficiency:.3f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"machine": machine, "kernel_paths": paths.describe() if paths else None, "batch": args.batch,
                       "threads": torch.get_num_threads(), "compiled": core.runner.compiled is not None,
                       "engine_ms": a * 1e3, "forward_ms": b * 1e3, "engine_efficiency": efficiency}, f, indent=1)
    return efficiency


if __name__ == "__main__":
    main()
