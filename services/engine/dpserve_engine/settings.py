"""The engine's settings: `EngineConfig` (the model and how it runs), `ServiceSettings` (the rank's process and
its links) and the command line that builds both.

One source for every default: the dataclasses below. The parser takes its defaults from them, and the engine
flags are the ones `dpserve_shared.engine_flags` declares, so `dpserve serve` forwards exactly what this parser
reads. This module is the only reader of `DPSERVE_*` environment variables in the engine:

- `DPSERVE_CACHE_DIR`: where kernels, the inductor cache, dequantized weights and model info are kept
  (default ~/.cache/dpserve);
- `DPSERVE_ENFORCE_EAGER`: any value but "" or "0" makes eager PyTorch the default (the test suite sets it);
- `DPSERVE_DEPLOYMENT_ID`: the default of --deployment-id (read through `dpserve_shared.envelope`);
- `DPSERVE_CLUSTER_KEY`: the deployment's cluster key, unless --cluster-key-file or --insecure-zmq (read through
  `dpserve_shared.zmq_security`; the coordinator puts it in the environment of the engines it starts);
- `DPSERVE_TEST_HOLD_PAUSE_S`: a test hook for the lock-step race "a request arrives exactly as a wave completes"
  (ServiceSettings.hold_first_pause_s; lockstep.py): never set in production.

It is also the one place that writes the process environment: `export_inductor_cache_dir`, called by
EngineCore before anything touches inductor, so the service, `dpserve bench engine` and in-process users of
EngineCore all get it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from dpserve_shared.engine_flags import ENGINE_FLAGS, WATCH_PID_ENV, add_engine_flags
from dpserve_shared.envelope import DEPLOYMENT_ID_ENV, deployment_id_from_env
from dpserve_shared.timing import ENGINE_DRAIN_S
from dpserve_shared.zmq_security import ZmqSecurity, add_security_flags, security_from_args

from dpserve_engine.model_files import DEFAULT_MODEL, is_gguf, parse_upcycled

CACHE_DIR_ENV = "DPSERVE_CACHE_DIR"
ENFORCE_EAGER_ENV = "DPSERVE_ENFORCE_EAGER"
# Flags hidden from the engine's own CPU detection (cpu_paths.py): comma-separated, `*` globs
CPU_MASK_ENV = "DPSERVE_CPU_MASK"
HOLD_PAUSE_ENV = "DPSERVE_TEST_HOLD_PAUSE_S"


def _hold_pause_from_env() -> float:
    value = os.environ.get(HOLD_PAUSE_ENV, "")
    try:
        return float(value) if value else 0.0
    except ValueError:
        raise ValueError(f"${HOLD_PAUSE_ENV} must be a number of seconds, got {value!r}") from None


def _watch_pid_from_env() -> int | None:
    value = os.environ.get(WATCH_PID_ENV, "")
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${WATCH_PID_ENV} must be a process id, got {value!r}") from None


def _cache_dir_from_env() -> str:
    return os.environ.get(CACHE_DIR_ENV, os.path.join(os.path.expanduser("~"), ".cache", "dpserve"))


def _enforce_eager_from_env() -> bool:
    return os.environ.get(ENFORCE_EAGER_ENV, "") not in ("", "0")


def cpu_mask_from_env() -> list[str]:
    """The patterns of CPU flags that cpu_paths.detect hides (CPU_MASK_ENV), e.g. ["avx512*", "amx*"]."""
    return [p.strip() for p in os.environ.get(CPU_MASK_ENV, "").replace(" ", ",").split(",") if p.strip()]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL  # "smollm2", "smollm2-moe[:E]" (upcycled), a .gguf file, or a HF directory
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
    # LM head (faster decode at large batches, but measured to change 1-2 of 5 greedy answers and to make greedy
    # output depend on the batch; docs/benchmarks.md); "float32" everywhere.
    dtype: str = "auto"
    # How a GGUF's Q4_1 linear weights run on CPU (cpu_paths.py): "int4" torch's int4 kernel (bf16 activations),
    # bf16 hi+lo prefill copies and an int8/bf16 LM head rescored in fp32 (opt-in: not exact, cpu_paths.py); "q4"
    # the engine's grouped kernels with fp32 activations, fp32 prefill copies and the Q8_0 head in the grouped
    # kernel; "q4q8" as "q4" with decode rows and the head on int8 activations (only when asked for: not fp32's
    # greedy tokens); "auto" (default): q4 on every CPU kind, GGUF on CPU only, else none.
    # None / "none": dequantized weights in `dtype`.
    quantization: str | None = "auto"
    # False: compile the decode step at start-up on CPU (compiled.py); True: eager PyTorch only (vLLM's
    # --enforce-eager). Default: $DPSERVE_ENFORCE_EAGER.
    enforce_eager: bool = dataclasses.field(default_factory=_enforce_eager_from_env)
    # True: the decode step compiles (or loads from the inductor cache) in a background thread while the rank
    # already serves through eager PyTorch, switching over once done (the engine service); False: EngineCore's
    # constructor returns with it compiled (tests, benchmarks).
    compile_in_background: bool = False
    # Fault the KV cache's pages in from a lowest-priority thread once the decode step is ready (model_runner.py
    # `populate_in_background`): served ranks (dpserve-engine), not in-process cores (tests, `bench engine`).
    populate_kv_cache: bool = False
    # A request that waited this long in the queue without being scheduled is ended (ERROR, retry_reason
    # "queue_time": the frontend answers 503 + Retry-After); None: no limit. Continuations are exempt.
    max_queue_time_s: float | None = None
    # A structured-output request whose grammar (llguidance, grammar.py) is still compiling this long after it
    # arrived is ended (ERROR); it waits outside the scheduler's queue meanwhile.
    grammar_compile_timeout_s: float = 10.0
    # MoE experts sharded over the DP ranks, which then step in lock-step waves (lockstep.py, expert_parallel.py)
    enable_expert_parallel: bool = False
    null_engine: bool = False  # no model: emit tokens on a fixed step time (benchmarks, simulation)
    null_step_time_s: float = 0.0
    null_prefill_time_per_token_s: float = 0.0  # the null engine's cost of one uncached prompt token
    cache_dir: str = dataclasses.field(default_factory=_cache_dir_from_env)  # default: $DPSERVE_CACHE_DIR

    def resolved_quantization(self, device_type: str) -> str | None:
        """None: dequantized weights. "int4" / "q4" / "q4q8": the GGUF's groups on that kernel path, as given.
        "auto": a GGUF model on CPU, on the path cpu_paths.py chooses for the CPU (None for anything else, the
        upcycled MoE model included: its experts are dequantized copies)."""
        if self.quantization in (None, "none"):
            return None
        if self.quantization != "auto":
            return self.quantization
        if device_type != "cpu" or self.null_engine or parse_upcycled(self.model) is not None:
            return None
        return "auto" if is_gguf(self.model) else None


@dataclasses.dataclass(frozen=True)
class ServiceSettings:
    coordinator_addr: str
    rank: int = -1  # -1: assigned by the coordinator
    host: str = "127.0.0.1"
    port: int = 0  # 0: a random free port
    register_timeout_s: float = 120.0
    drain_timeout_s: float = ENGINE_DRAIN_S
    adaptive_threads: bool = False  # threads.py: share the node's cores among the ranks that have work
    deployment_id: str = ""  # "": adopt the id of the coordinator that accepts this engine (envelope.py)
    # The process whose exit ends this engine ($DPSERVE_WATCH_PID, set by the mp launcher): `dpserve serve` (so that
    # the engine outlives a coordinator that restarts); 0: none (a coordinator run by hand: the deployment's
    # silence for register_timeout_s ends it); None: the parent process (an EngineHost actor, a shell).
    watch_pid: int | None = None
    enable_expert_parallel: bool = False  # lock-step waves in an expert-parallel group (lockstep.py)
    # Test hook ($DPSERVE_TEST_HOLD_PAUSE_S): the first time the ranks pause, hold this long (or until a request is
    # pending) after publishing the new wave and before telling the coordinator or reading any socket, so that a
    # test can send a request exactly as the wave completes. 0: off.
    hold_first_pause_s: float = 0.0
    # CURVE on every socket: its ROUTER a server, its links to the coordinator clients (zmq_security.py)
    zmq_security: ZmqSecurity = dataclasses.field(default_factory=ZmqSecurity.from_environment, repr=False)


def export_inductor_cache_dir(config: EngineConfig) -> None:
    """Point inductor's cache at `<cache_dir>/inductor` unless TORCHINDUCTOR_CACHE_DIR is set already. Inductor
    fixes its cache dir on first use, so this runs before anything touches it (loading the int4 weights does);
    EngineCore calls it first thing when the decode step is to be compiled."""
    if not config.enforce_eager:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(config.cache_dir, "inductor"))


# -- the command line -----------------------------------------------------------------------------------------------

_SERVICE = {f.name: f.default for f in dataclasses.fields(ServiceSettings)}
_NULL_STEP_TIME_FLAG = "null_step_time_ms"  # the one engine flag not named as its EngineConfig field (ms vs s)


def engine_flag_defaults(config: EngineConfig | None = None) -> dict:
    """The engine flags' defaults (by dest) from an EngineConfig, the default one unless given."""
    config = config or EngineConfig()
    defaults = {f.dest: getattr(config, f.dest) for f in ENGINE_FLAGS if f.dest != _NULL_STEP_TIME_FLAG}
    defaults[_NULL_STEP_TIME_FLAG] = config.null_step_time_s * 1000.0
    return defaults


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser("dpserve-engine", description="One dpserve data-parallel engine rank.")
    parser.add_argument("--coordinator", required=True, help="the coordinator's control address, tcp://HOST:PORT")
    parser.add_argument("--rank", type=int, default=_SERVICE["rank"],
                        help="data-parallel rank; -1 = assigned by the coordinator")
    parser.add_argument("--host", default=_SERVICE["host"], help="address the engine socket binds (and advertises)")
    parser.add_argument("--port", type=int, default=_SERVICE["port"], help="port of the engine socket; 0 = random")
    parser.add_argument("--register-timeout-s", type=float, default=_SERVICE["register_timeout_s"])
    parser.add_argument("--drain-timeout-s", type=float, default=_SERVICE["drain_timeout_s"])
    parser.add_argument(
        "--deployment-id", default=deployment_id_from_env() or _SERVICE["deployment_id"],
        help=f"the deployment this engine belongs to; control and broadcast messages of any other are ignored "
             f"(default: ${DEPLOYMENT_ID_ENV}, else that of the coordinator that accepts it)",
    )  # fmt: skip
    add_security_flags(parser)
    add_engine_flags(parser, engine_flag_defaults())
    return parser


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the engine flags in `args` (the fields no flag sets keep their defaults)."""
    given = {f.dest: getattr(args, f.dest) for f in ENGINE_FLAGS if f.dest != _NULL_STEP_TIME_FLAG}
    return EngineConfig(**given, null_step_time_s=getattr(args, _NULL_STEP_TIME_FLAG) / 1000.0)


def settings_from_args(args: argparse.Namespace) -> ServiceSettings:
    """ClusterKeyError (a ValueError naming the flags) without a cluster key or --insecure-zmq."""
    return ServiceSettings(
        coordinator_addr=args.coordinator,
        rank=args.rank,
        host=args.host,
        port=args.port,
        register_timeout_s=args.register_timeout_s,
        drain_timeout_s=args.drain_timeout_s,
        deployment_id=args.deployment_id,
        watch_pid=_watch_pid_from_env(),
        enable_expert_parallel=args.enable_expert_parallel,
        hold_first_pause_s=_hold_pause_from_env(),
        zmq_security=security_from_args(args, "dpserve-engine"),
        adaptive_threads=args.num_threads is None and not args.null_engine and args.device in (None, "cpu"),
    )
