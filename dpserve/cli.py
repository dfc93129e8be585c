"""`dpserve`: the command line. Subcommands:

- `dpserve serve`: the coordinator, the engine ranks and the API servers of one deployment (serve.py);
- `dpserve scale --data-parallel-size K`: add or remove engine ranks of a running deployment (scale.py);
- `dpserve status`: the status page in the terminal (status.py);
- `dpserve cpu [--emulate KIND]`: the CPU kind the engines detect here and the kernel path they choose, or the
  environment that makes this machine run a lesser kind's code and choices (dpserve_engine.cpu_paths);
- `dpserve bench serve|engine|chaos|routing`: benchmarks (the `bench` package: bench/serve.py, bench/chaos.py,
  bench/routing.py; the engine's own `dpserve_engine.bench`).
"""

from __future__ import annotations

import argparse
import sys

from dpserve.scale import add_scale_flags, scale
from dpserve.serve import UsageError, add_serve_flags, serve, validate
from dpserve.status import add_status_flags, status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser("dpserve", description="Data-parallel LLM serving.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="serve a model: coordinator, engine ranks and API servers")
    add_serve_flags(serve_parser)
    serve_parser.set_defaults(subparser=serve_parser)  # its errors print its own usage
    scale_parser = commands.add_parser(
        "scale", help="add or remove engine ranks of a running deployment (waits until the step is done)"
    )
    add_scale_flags(scale_parser)
    status_parser = commands.add_parser(
        "status", help="ranks, load, waves and failures of a running deployment, refreshed in the terminal"
    )
    add_status_flags(status_parser)
    cpu = commands.add_parser("cpu", help="the CPU kind the engines detect here and the kernel path they choose; "
                              "--emulate KIND prints the environment that makes this machine run a lesser kind")
    cpu.add_argument("--emulate", metavar="KIND", choices=["avx2", "avx512", "avx512_bf16"],
                     help="print KEY=VALUE lines (for `env $(dpserve cpu --emulate avx2) make test`): torch's, MKL's "
                     "and oneDNN's caps and DPSERVE_CPU_MASK for that kind")
    bench = commands.add_parser("bench", help="benchmarks: `bench serve` (any OpenAI URL), `bench engine` "
                                "(EngineCore), `bench chaos` (rank faults under load), `bench routing` (routing "
                                "policies on many null-engine ranks)")
    bench.add_argument("kind", choices=["serve", "engine", "chaos", "routing"],
                       help="serve: HTTP load test; engine: engine efficiency; chaos: ranks killed under load; "
                       "routing: imbalance, prefix hit rate vs an oracle, snapshot age, coordinator cost")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own flags (see its --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command == "serve":
        if unknown:
            args.subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
        try:
            validate(args)
        except UsageError as e:
            args.subparser.error(str(e))
        return serve(args)
    if unknown and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "scale":
        if args.data_parallel_size < 1:
            parser.error(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
        return scale(args)
    if args.command == "status":
        try:
            return status(args)
        except KeyboardInterrupt:
            return 0
    if args.command == "cpu":
        return cpu_command(args.emulate)
    if args.command == "bench":
        if args.kind == "serve":
            from dpserve.bench.serve import main as bench_serve_main

            return bench_serve_main(args.bench_args) or 0
        if args.kind == "chaos":
            from dpserve.bench.chaos import main as bench_chaos_main

            return bench_chaos_main(args.bench_args)
        if args.kind == "routing":
            from dpserve.bench.routing import main as bench_routing_main

            return bench_routing_main(args.bench_args)
        from dpserve_engine import bench as engine_bench  # imports torch: only for this command

        return engine_bench.main(args.bench_args) or 0
    parser.error(f"unknown command {args.command}")
    return 2


def cpu_command(emulate: str | None) -> int:
    from dpserve_engine import cpu_paths  # imports torch (its capability) only when asked

    if emulate:
        print("\n".join(f"{k}={v}" for k, v in cpu_paths.emulation_env(emulate).items()))
        return 0
    cpu = cpu_paths.detect()
    chosen = cpu_paths.choose(cpu)
    print(f"CPU {cpu.model_name}: kind {cpu.kind} (torch {cpu.capability}; {' '.join(cpu.describe()['flags'])})")
    if cpu.masked:
        print(f"hidden by {cpu_paths.MASK_ENV}: {' '.join(sorted(cpu.masked))}")
    print(f"kernel path {chosen.path}, because {chosen.reason}")
    print(f"emulable kinds here: {', '.join(cpu_paths.emulable_kinds(cpu)) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
