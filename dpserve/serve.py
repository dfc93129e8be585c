"""`dpserve serve`: the one-machine composition of the services.

It starts one coordinator (which starts Ray, or local processes with `--data-parallel-backend mp`, and the engine
ranks) and `--api-server-count` frontends sharing one HTTP port (SO_REUSEPORT); waits until every rank is ready
and /health answers 200; prints the URL; then supervises: if any child exits, everything is shut down and
`dpserve` exits nonzero. SIGTERM/SIGINT: frontends stop first (they drain in-flight requests), then the
coordinator (engines, actors, placement groups, Ray). A second signal kills everything at once.

Each child runs in its own process group (a terminal's Ctrl-C reaches only this process, which then stops the
children in order) and gets SIGTERM if this process dies (PR_SET_PDEATHSIG).

The coordinator's flags and their checks are the coordinator's own (dpserve_coordinator.settings): `validate`
builds the settings the coordinator will build from the command line it is given.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import enum
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from dpserve_coordinator import settings as coordinator_settings
from dpserve_frontend.settings import (
    FrontendSettings,
    add_http_limit_flags,
    add_migration_flag,
    http_limit_argv,
    read_chat_template,
)
from dpserve_shared.engine_flags import add_engine_flags, engine_argv
from dpserve_shared.envelope import deployment_id_from_env, new_deployment_id
from dpserve_shared.status import API_KEY_ENV

_PR_SET_PDEATHSIG = 1
_FRONTEND_STOP_S = 35.0  # the frontend drains in-flight requests for up to 30 s
_COORDINATOR_STOP_S = 20.0
_POLL_S = 0.2


class UsageError(Exception):
    pass


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model to serve, as in `vllm serve MODEL` (the same as --model; default: the "
                             "bundled smollm2)")
    coordinator_settings.add_deployment_flags(parser)
    parser.add_argument("--api-server-count", type=int, default=1,
                        help="OpenAI API server processes sharing --port (default: %(default)s)")
    parser.add_argument("--host", default="0.0.0.0", help="HTTP bind address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                        help="require 'Authorization: Bearer KEY' on /v1/*, the admin endpoints and the status "
                             "page (default: $DPSERVE_API_KEY if set, else none); handed to the children in their "
                             "environment, not on their command lines")
    coordinator_settings.add_status_port_flag(parser)
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template file (or the template itself) replacing the model's own "
                             "(default: the model's)")
    parser.add_argument("--strict-request-fields", action="store_true",
                        help="answer unknown request fields with a 400, as OpenAI does (default: ignore them and "
                             "name them once in the log, as vLLM does)")
    add_migration_flag(parser)
    add_http_limit_flags(parser)
    add_engine_flags(parser)


def validate(args: argparse.Namespace) -> None:
    """Refuse an impossible combination of flags before anything starts (UsageError naming the flags)."""
    if args.api_server_count < 1:
        raise UsageError(f"--api-server-count must be at least 1, got {args.api_server_count}")
    if args.null_step_time_ms is not None and not args.null_engine:
        raise UsageError("--null-step-time-ms needs --null-engine")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be a TCP port, got {args.port}")
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise UsageError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.chat_template is not None:
        try:
            read_chat_template(args.chat_template)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if os.path.isfile(args.chat_template):
            args.chat_template = os.path.abspath(args.chat_template)
    _check_free(args.host, args.port, "--port")
    _check_free(args.data_parallel_address, args.data_parallel_rpc_port, "--data-parallel-rpc-port")  # coordinator's
    if args.status_port is not None:
        _check_free(args.data_parallel_address, args.status_port, "--status-port")
    coordinator_args = coordinator_settings.build_parser().parse_args(coordinator_argv(args))
    try:
        coordinator_settings.settings_from_args(coordinator_args)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _check_free(host: str, port: int, flag: str) -> None:
    """A port another process listens on is a usage error now, before Ray and the engines start (the bind would
    fail only once the API servers or the coordinator get there)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed socket's TIME_WAIT is not "in use"
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UsageError(f"{flag} {port}: {host}:{port} is already in use by another process") from None
            # other errors (an address not on this host, say) are reported by whoever binds it, with context


def coordinator_argv(args: argparse.Namespace, ready_file: str | None = None, deployment_id: str = "") -> list[str]:
    """The coordinator's flags for this `dpserve serve` command line."""
    argv = [
        "--data-parallel-size", str(args.data_parallel_size),
        "--data-parallel-address", args.data_parallel_address,
        "--data-parallel-rpc-port", str(args.data_parallel_rpc_port),
        "--data-parallel-backend", args.data_parallel_backend,
        "--engine-startup-timeout-s", str(args.engine_startup_timeout_s),
        "--engine-stall-timeout-s", str(args.engine_stall_timeout_s),
        *(["--ready-file", ready_file] if ready_file else []),
        *(["--deployment-id", deployment_id] if deployment_id else []),
    ]  # fmt: skip
    optional = {
        "--status-port": args.status_port,
        "--data-parallel-size-local": args.data_parallel_size_local,
        "--ray-address": args.ray_address,
        "--ray-temp-dir": args.ray_temp_dir,
        "--ray-wait-for-nodes-s": args.ray_wait_for_nodes_s,
    }
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, str(value)]
    return argv + list(engine_argv(args))


def coordinator_command(args: argparse.Namespace, ready_file: str, deployment_id: str = "") -> list[str]:
    return [sys.executable, "-c", "import sys; from dpserve_coordinator.main import main; sys.exit(main())",
            *coordinator_argv(args, ready_file, deployment_id)]


def frontend_command(args: argparse.Namespace, ready_file: str | None = None, deployment_id: str = "",
                     index: int = 0) -> list[str]:
    """API server `index`'s command line; only the first logs the per-rank stats line (every API server sees the
    same engines, so with several each line would appear once per server)."""
    cmd = [
        sys.executable, "-c", "import sys; from dpserve_frontend.main import main; sys.exit(main())",
        "--coordinator", f"tcp://{args.data_parallel_address}:{args.data_parallel_rpc_port}",
        "--host", args.host,
        "--port", str(args.port),
    ]  # fmt: skip
    if args.strict_request_fields:
        cmd += ["--strict-request-fields"]
    if args.migration_limit != FrontendSettings.migration_limit:
        cmd += ["--migration-limit", str(args.migration_limit)]
    cmd += http_limit_argv(args)
    if args.chat_template:
        cmd += ["--chat-template", args.chat_template]
    if ready_file:
        cmd += ["--ready-file", ready_file]
    if deployment_id:
        cmd += ["--deployment-id", deployment_id]
    if index > 0:
        cmd += ["--stats-interval", "0"]
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


class ServeState(enum.Enum):
    STARTING = "starting"  # children started, not every one ready yet
    SERVING = "serving"  # "serving on ..." printed
    DRAINING = "draining"  # stopping the children in order (frontends first)
    STOPPED = "stopped"  # every child gone


class Server:
    """The children of `dpserve serve`, their order of start and stop, and the lifecycle around them."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.state = ServeState.STARTING
        self.work_dir = tempfile.mkdtemp(prefix="dpserve-")
        self.ready_file = os.path.join(self.work_dir, "coordinator-ready.json")
        self.metrics_dir = os.path.join(self.work_dir, "prometheus")
        os.makedirs(self.metrics_dir)
        self.coordinator: subprocess.Popen | None = None
        self.frontends: list[subprocess.Popen] = []
        self.frontend_ready_files: list[str] = []
        # On every control and broadcast message of this deployment: its peers ignore any other's (envelope.py).
        self.deployment_id = deployment_id_from_env() or new_deployment_id()
        # A local Ray instance's temp dir, made here so that it is removed even if the coordinator dies before it
        # can remove it (a stop during ray.init, a crash); short, under /tmp: Ray's socket paths have a length limit
        self.ray_temp_dir: str | None = None
        if args.data_parallel_backend == "ray" and not args.ray_address and not args.ray_temp_dir:
            self.ray_temp_dir = tempfile.mkdtemp(prefix="dpray-", dir="/tmp")

    def _spawn(self, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, preexec_fn=_child_setup)

    def start(self) -> None:
        args = argparse.Namespace(**{**vars(self.args), "ray_temp_dir": self.ray_temp_dir or self.args.ray_temp_dir})
        env = dict(os.environ)
        env.pop(API_KEY_ENV, None)
        if self.args.api_key:
            env[API_KEY_ENV] = self.args.api_key  # not on a command line: `ps` shows those to every user
        self.coordinator = self._spawn(coordinator_command(args, self.ready_file, self.deployment_id), env)
        env = dict(env, PROMETHEUS_MULTIPROC_DIR=self.metrics_dir)
        self.frontend_ready_files = [
            os.path.join(self.work_dir, f"frontend-{i}-ready") for i in range(self.args.api_server_count)
        ]
        self.frontends = [
            self._spawn(frontend_command(self.args, path, self.deployment_id, index), env)
            for index, path in enumerate(self.frontend_ready_files)
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

    def stop(self, drain: bool = True) -> None:
        """drain: frontends first (they drain), then the coordinator, SIGKILL whatever outlives its timeout;
        blocks until every child is gone, and does nothing if a stop is under way or done. Not drain (a second
        signal): kill at once, without waiting; a stop under way then finishes quickly."""
        if not drain:
            self._kill_now()
            return
        if self.state in (ServeState.DRAINING, ServeState.STOPPED):
            return
        self.state = ServeState.DRAINING
        _stop_all(self.frontends, _FRONTEND_STOP_S)
        if self.coordinator is not None:
            _stop_all([self.coordinator], _COORDINATOR_STOP_S)
        for _, proc in self.children():
            _kill_leftovers(proc)
        shutil.rmtree(self.work_dir, ignore_errors=True)
        if self.ray_temp_dir:
            shutil.rmtree(self.ray_temp_dir, ignore_errors=True)
        self.state = ServeState.STOPPED

    def _kill_now(self) -> None:
        """The coordinator gets a second SIGTERM (it kills its engines and Ray), the rest SIGKILL."""
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
        # -SIGTERM: our own SIGTERM reached it before it had set its handlers (it was still starting)
        if proc.returncode not in (0, None, -signal.SIGTERM):
            _log(f"pid {proc.pid} exited with code {proc.returncode}")


class _Lifecycle:
    """Runs a Server: its signal handlers only set an asyncio Event (or, the second time, kill at once); the loop
    runs until the Event is set or a child exits, then stops the children in a thread, so that a second signal is
    still heard while they drain."""

    def __init__(self, server: Server):
        self.server = server
        self.stop_requested = asyncio.Event()

    def on_signal(self, signum: int) -> None:
        server, name = self.server, signal.Signals(signum).name
        if server.state in (ServeState.STARTING, ServeState.SERVING) and not self.stop_requested.is_set():
            _log(f"{name}: shutting down (send it again to stop at once)")
            self.stop_requested.set()
            return
        _log("second signal: stopping at once" if self.stop_requested.is_set() else f"{name}: stopping at once")
        self.stop_requested.set()
        server.stop(drain=False)

    async def run(self, started: float) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal, sig)
        server = self.server
        code = 0
        try:
            server.start()
            while not self.stop_requested.is_set():
                dead = server.dead_child()
                if dead is not None:
                    _log(f"{dead[0]} exited with code {dead[1]}; shutting down")
                    code = 1
                    break
                if server.state is ServeState.STARTING and await asyncio.to_thread(server.is_healthy):
                    server.state = ServeState.SERVING
                    _log(f"ready in {time.monotonic() - started:.1f} s: {server.health_url()}/v1")
                    print(f"dpserve: serving on {server.health_url()}/v1", flush=True)
                try:
                    await asyncio.wait_for(self.stop_requested.wait(), _POLL_S)
                except asyncio.TimeoutError:
                    pass
        finally:
            await asyncio.to_thread(server.stop, True)
        return code


def serve(args: argparse.Namespace) -> int:
    started = time.monotonic()
    server = Server(args)
    _log(
        f"starting: model {args.model or 'smollm2'}{' (null engine)' if args.null_engine else ''}, "
        f"DP={args.data_parallel_size} on {args.data_parallel_backend}, {args.api_server_count} API server(s) on "
        f"{args.host}:{args.port}, deployment {server.deployment_id}"
    )
    code = asyncio.run(_Lifecycle(server).run(started))
    _log("stopped")
    return code
