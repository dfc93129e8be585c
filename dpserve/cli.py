"""`dpserve`: the one-machine composition of the services.

`dpserve serve` starts one coordinator (which starts Ray, or local processes with `--data-parallel-backend mp`,
and the engine ranks) and `--api-server-count` frontends sharing one HTTP port (SO_REUSEPORT); waits until every
rank is ready and /health answers 200; prints the URL; then supervises: if any child exits, everything is shut
down and `dpserve` exits nonzero. SIGTERM/SIGINT: frontends stop first (they drain in-flight requests), then the
coordinator (engines, actors, placement groups, Ray). A second signal kills everything at once.

Each child runs in its own process group (a terminal's Ctrl-C reaches only this process, which then stops the
children in order) and gets SIGTERM if this process dies (PR_SET_PDEATHSIG).

`dpserve scale --data-parallel-size K` adds or removes engine ranks of a running deployment (scale.py).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from dpserve_shared.engine_flags import add_engine_flags, engine_argv
from dpserve_shared.envelope import deployment_id_from_env, new_deployment_id

_PR_SET_PDEATHSIG = 1
_FRONTEND_STOP_S = 35.0  # the frontend drains in-flight requests for up to 30 s
_COORDINATOR_STOP_S = 20.0


class UsageError(Exception):
    pass


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="engine ranks, each a full copy of the model (default: %(default)s)")
    parser.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None,
                        help="ranks on this node; the rest go to other Ray nodes (default: all)")
    parser.add_argument("--data-parallel-address", default="127.0.0.1",
                        help="address the coordinator binds and engines/API servers reach it at; on a cluster, "
                             "this node's address (default: %(default)s)")
    parser.add_argument("--data-parallel-rpc-port", type=int, default=29550,
                        help="the coordinator's control port; change it to run two deployments on one host "
                             "(default: %(default)s)")
    parser.add_argument("--data-parallel-backend", choices=["ray", "mp"], default="ray",
                        help="ray: engine ranks as Ray actors in placement groups (a local Ray instance unless "
                             "--ray-address); mp: local child processes, no Ray (default: %(default)s)")
    parser.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: a local instance)")
    parser.add_argument("--ray-temp-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--ray-wait-for-nodes-s", type=float, default=None, help="with --ray-address: wait this long for nodes to join"
    )
    parser.add_argument("--api-server-count", type=int, default=1,
                        help="OpenAI API server processes sharing --port (default: %(default)s)")
    parser.add_argument("--host", default="0.0.0.0", help="HTTP bind address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $DPSERVE_API_KEY if set, "
                             "else none)")
    parser.add_argument("--strict-request-fields", action="store_true",
                        help="answer unknown request fields with a 400, as OpenAI does (default: ignore them and "
                             "name them once in the log, as vLLM does)")
    parser.add_argument("--engine-startup-timeout-s", type=float, default=600.0,
        help="how long ranks may take to load, compile and register (a first start compiles for minutes; "
             "default: %(default)s)")
    add_engine_flags(parser)


def validate(args: argparse.Namespace) -> None:
    size = args.data_parallel_size
    size_local = size if args.data_parallel_size_local is None else args.data_parallel_size_local
    if size < 1:
        raise UsageError(f"--data-parallel-size must be at least 1, got {size}")
    if not 0 <= size_local <= size:
        raise UsageError(
            f"--data-parallel-size-local must be between 0 and --data-parallel-size ({size}), got {size_local}"
        )
    if args.api_server_count < 1:
        raise UsageError(f"--api-server-count must be at least 1, got {args.api_server_count}")
    if args.data_parallel_backend == "mp":
        if size_local != size:
            raise UsageError(
                "--data-parallel-backend mp runs every rank on this node, so --data-parallel-size-local must equal "
                "--data-parallel-size; use --data-parallel-backend ray to place ranks on other nodes"
            )
        if args.ray_address:
            raise UsageError("--ray-address needs --data-parallel-backend ray")
    if size_local < size and args.data_parallel_address.startswith(("127.", "localhost")):
        raise UsageError(
            f"ranks on other nodes cannot reach the coordinator at --data-parallel-address "
            f"{args.data_parallel_address}: give this node's address in the cluster"
        )
    if args.ray_address and args.ray_temp_dir:
        raise UsageError("--ray-temp-dir applies to a local Ray instance only, not with --ray-address")
    if args.ray_wait_for_nodes_s is not None and not args.ray_address:
        raise UsageError("--ray-wait-for-nodes-s needs --ray-address (a local Ray instance does not grow)")
    if args.null_step_time_ms is not None and not args.null_engine:
        raise UsageError("--null-step-time-ms needs --null-engine")
    for name in ("port", "data_parallel_rpc_port"):
        if not 0 < getattr(args, name) < 65536:
            raise UsageError(f"--{name.replace('_', '-')} must be a TCP port, got {getattr(args, name)}")


def coordinator_command(args: argparse.Namespace, ready_file: str, deployment_id: str = "") -> list[str]:
    cmd = [
        sys.executable, "-c", "import sys; from dpserve_coordinator.main import main; sys.exit(main())",
        "--data-parallel-size", str(args.data_parallel_size),
        "--data-parallel-address", args.data_parallel_address,
        "--data-parallel-rpc-port", str(args.data_parallel_rpc_port),
        "--data-parallel-backend", args.data_parallel_backend,
        "--engine-startup-timeout-s", str(args.engine_startup_timeout_s),
        "--ready-file", ready_file,
        *(["--deployment-id", deployment_id] if deployment_id else []),
    ]  # fmt: skip
    optional = {
        "--data-parallel-size-local": args.data_parallel_size_local,
        "--ray-address": args.ray_address,
        "--ray-temp-dir": args.ray_temp_dir,
        "--ray-wait-for-nodes-s": args.ray_wait_for_nodes_s,
    }
    for flag, value in optional.items():
        if value is not None:
            cmd += [flag, str(value)]
    return cmd + list(engine_argv(args))


def frontend_command(args: argparse.Namespace, ready_file: str | None = None, deployment_id: str = "") -> list[str]:
    cmd = [
        sys.executable, "-c", "import sys; from dpserve_frontend.main import main; sys.exit(main())",
        "--coordinator", f"tcp://{args.data_parallel_address}:{args.data_parallel_rpc_port}",
        "--host", args.host,
        "--port", str(args.port),
    ]  # fmt: skip
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    if args.strict_request_fields:
        cmd += ["--strict-request-fields"]
    if ready_file:
        cmd += ["--ready-file", ready_file]
    if deployment_id:
        cmd += ["--deployment-id", deployment_id]
    return cmd


def _child_setup() -> None:
    """In the child before exec: own process group, and SIGTERM when `dpserve` dies."""
    os.setpgid(0, 0)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} dpserve {message}", file=sys.stderr, flush=True)


class Server:
    """The children of `dpserve serve` and their order of start and stop."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.work_dir = tempfile.mkdtemp(prefix="dpserve-")
        self.ready_file = os.path.join(self.work_dir, "coordinator-ready.json")
        self.metrics_dir = os.path.join(self.work_dir, "prometheus")
        os.makedirs(self.metrics_dir)
        self.coordinator: subprocess.Popen | None = None
        self.frontends: list[subprocess.Popen] = []
        self.frontend_ready_files: list[str] = []
        # On every control and broadcast message of this deployment: its peers ignore any other's (envelope.py).
        self.deployment_id = deployment_id_from_env() or new_deployment_id()
        self.num_signals = 0
        self.stopping = False

    def _spawn(self, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, preexec_fn=_child_setup)

    def start(self) -> None:
        self.coordinator = self._spawn(coordinator_command(self.args, self.ready_file, self.deployment_id))
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=self.metrics_dir)
        self.frontend_ready_files = [
            os.path.join(self.work_dir, f"frontend-{i}-ready") for i in range(self.args.api_server_count)
        ]
        self.frontends = [
            self._spawn(frontend_command(self.args, path, self.deployment_id), env)
            for path in self.frontend_ready_files
        ]

    def children(self) -> list[tuple[str, subprocess.Popen]]:
        named = [(f"frontend {i}", p) for i, p in enumerate(self.frontends)]
        return ([("coordinator", self.coordinator)] if self.coordinator else []) + named

    def dead_child(self) -> tuple[str, int] | None:
        for name, proc in self.children():
            if proc.poll() is not None:
                return name, proc.returncode
        return None

    def health_url(self) -> str:
        host = "127.0.0.1" if self.args.host in ("0.0.0.0", "", "::") else self.args.host
        return f"http://{host}:{self.args.port}"

    def is_healthy(self) -> bool:
        # Every API server must follow the broadcasts and see every rank: they share the port, so /health alone
        # answers for whichever one the kernel picked.
        if not all(os.path.exists(p) for p in [self.ready_file, *self.frontend_ready_files]):
            return False
        headers = {"Authorization": f"Bearer {self.args.api_key}"} if self.args.api_key else {}
        try:
            request = urllib.request.Request(self.health_url() + "/health", headers=headers)
            with urllib.request.urlopen(request, timeout=2) as response:
                body = json.load(response)
        except (urllib.error.URLError, OSError, ValueError):
            return False
        # Every frontend that answers must see every rank (200 also means "degraded": some rank missing).
        return body.get("status", "ok") == "ok" if isinstance(body, dict) else True

    def stop(self) -> None:
        """Frontends first (they drain), then the coordinator; SIGKILL whatever outlives its timeout."""
        if self.stopping:
            return
        self.stopping = True
        _stop_all(self.frontends, _FRONTEND_STOP_S)
        if self.coordinator is not None:
            _stop_all([self.coordinator], _COORDINATOR_STOP_S)
        for _, proc in self.children():
            _kill_leftovers(proc)
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def kill_now(self) -> None:
        """Second signal: the coordinator gets a second SIGTERM (it kills its engines and Ray), the rest SIGKILL."""
        for name, proc in self.children():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM if name == "coordinator" else signal.SIGKILL)
                    if name == "coordinator":
                        os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass


def _kill_leftovers(proc: subprocess.Popen) -> None:
    """Each child leads a process group of its own; whatever is left in it once the child exited (Ray's agents when
    the coordinator died without its teardown) is killed."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_all(procs: list[subprocess.Popen], timeout_s: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _log(f"pid {proc.pid} did not stop within {timeout_s:.0f} s: killing its process group")
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    for proc in procs:
        if proc.returncode not in (0, None):
            _log(f"pid {proc.pid} exited with code {proc.returncode}")


def serve(args: argparse.Namespace) -> int:
    started = time.monotonic()
    server = Server(args)

    def on_signal(signum, frame):
        server.num_signals += 1
        if server.num_signals == 1:
            _log(f"{signal.Signals(signum).name}: shutting down (send it again to stop at once)")
            raise KeyboardInterrupt
        _log("second signal: stopping at once")
        server.kill_now()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    backend = args.data_parallel_backend
    _log(
        f"starting: model {args.model or 'smollm2'}{' (null engine)' if args.null_engine else ''}, "
        f"DP={args.data_parallel_size} on {backend}, {args.api_server_count} API server(s) on {args.host}:{args.port}, "
        f"deployment {server.deployment_id}"
    )
    code = 0
    try:
        server.start()
        is_ready = False
        while True:
            dead = server.dead_child()
            if dead is not None:
                _log(f"{dead[0]} exited with code {dead[1]}; shutting down")
                code = 1
                break
            if not is_ready and server.is_healthy():
                is_ready = True
                _log(f"ready in {time.monotonic() - started:.1f} s: {server.health_url()}/v1")
                print(f"dpserve: serving on {server.health_url()}/v1", flush=True)
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        try:
            server.stop()
        except KeyboardInterrupt:  # a second signal during the orderly stop
            server.kill_now()
            for _, proc in server.children():
                proc.wait()
    _log("stopped")
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser("dpserve", description="Data-parallel LLM serving.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="serve a model: coordinator, engine ranks and API servers")
    add_serve_flags(serve_parser)
    scale_parser = commands.add_parser(
        "scale", help="add or remove engine ranks of a running deployment (waits until the step is done)"
    )
    from dpserve.scale import add_scale_flags

    add_scale_flags(scale_parser)
    bench = commands.add_parser("bench", help="benchmarks: `bench serve` (any OpenAI URL), `bench engine` (EngineCore)")
    bench.add_argument("kind", choices=["serve", "engine"], help="serve: HTTP load test; engine: engine efficiency")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own flags (see its --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            validate(args)
        except UsageError as e:
            parser.error(str(e))
        return serve(args)
    if args.command == "scale":
        if args.data_parallel_size < 1:
            parser.error(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
        from dpserve.scale import scale

        return scale(args)
    if args.command == "bench":
        if args.kind == "serve":
            from dpserve import bench_serve

            return bench_serve.main(args.bench_args) or 0
        from dpserve_engine import bench as engine_bench  # imports torch: only for this command

        return engine_bench.main(args.bench_args) or 0
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
