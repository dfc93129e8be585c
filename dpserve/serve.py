"""`dpserve serve`: the one-machine composition of the services: its flags, their checks, the children's
command lines and the signal-driven lifecycle. The children themselves (a local Ray instance for the ray backend,
one coordinator, `--api-server-count` API servers sharing one HTTP port with SO_REUSEPORT), their start and stop
order and their restarts are deployment.py's.

It waits until every rank is ready and /health answers 200 and prints the URL; a child that exits during
start-up ends it (exit code 1); once serving, a coordinator or API server that exits is restarted while the
engines keep serving. SIGTERM/SIGINT: API servers stop first (/health answers 503 while in-flight requests may
finish for up to --shutdown-timeout), then the coordinator (engines, actors, placement groups), then Ray. A second
signal kills everything at once.

Each child runs in its own process group (a terminal's Ctrl-C reaches only this process, which then stops the
children in order) and gets SIGTERM if this process dies (PR_SET_PDEATHSIG).

Every ZMQ socket of the deployment speaks CURVE with one cluster key (dpserve_shared.zmq_security): the one given
(--cluster-key-file, $DPSERVE_CLUSTER_KEY) or a new one per run. The children get it in their environment, never
on a command line, and no log line shows it; `--insecure-zmq` turns CURVE off.

The coordinator's flags and their checks are the coordinator's own (dpserve_coordinator.settings): `validate`
builds the settings the coordinator will build from the command line it is given.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import signal
import socket
import sys
import time

from dpserve.deployment import Server, ServeState
from dpserve.deployment import log as _log
from dpserve.ray_head import RayHeadError
from dpserve_coordinator import settings as coordinator_settings
from dpserve_frontend.settings import (
    FrontendSettings,
    add_admission_flags,
    add_migration_flag,
    add_routing_flag,
    add_shutdown_timeout_flag,
    add_http_limit_flags,
    add_structured_output_flags,
    http_limit_argv,
    read_chat_template,
    structured_output_argv,
)
from dpserve_shared.engine_flags import add_engine_flags, engine_argv
from dpserve_shared.status import API_KEY_ENV
from dpserve_shared.zmq_security import ClusterKeyError, add_security_flags, security_from_args

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
    add_structured_output_flags(parser)
    parser.add_argument("--strict-request-fields", action="store_true",
                        help="answer unknown request fields with a 400, as OpenAI does (default: ignore them and "
                             "name them once in the log, as vLLM does)")
    add_migration_flag(parser)
    add_security_flags(parser)
    add_admission_flags(parser)
    add_routing_flag(parser)
    add_shutdown_timeout_flag(parser)
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
    try:
        # --cluster-key-file, $DPSERVE_CLUSTER_KEY, or a new key for this run; passed on in the environment
        args.zmq_security = security_from_args(args, "dpserve serve", make_one=True)
    except ClusterKeyError as e:
        raise UsageError(str(e)) from None
    coordinator_args = coordinator_settings.build_parser().parse_args(coordinator_argv(args))
    try:
        coordinator_settings.settings_from_args(coordinator_args, args.zmq_security.child_env(os.environ))
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
        *(["--insecure-zmq"] if args.insecure_zmq else []),  # the key goes in the environment, never here
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
    cmd += structured_output_argv(args)
    if args.max_num_queued_requests is not None:
        cmd += ["--max-num-queued-requests", str(args.max_num_queued_requests)]
    if args.max_num_queued_tokens is not None:
        cmd += ["--max-num-queued-tokens", str(args.max_num_queued_tokens)]
    if args.shutdown_timeout != FrontendSettings.shutdown_timeout_s:
        cmd += ["--shutdown-timeout", str(args.shutdown_timeout)]
    if args.routing != FrontendSettings.routing.value:
        cmd += ["--routing", args.routing]
    if ready_file:
        cmd += ["--ready-file", ready_file]
    if deployment_id:
        cmd += ["--deployment-id", deployment_id]
    if args.insecure_zmq:
        cmd += ["--insecure-zmq"]  # the key goes in the environment, never here
    if index > 0:
        cmd += ["--stats-interval", "0"]
    return cmd


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
            try:
                await asyncio.to_thread(server.start, self.stop_requested.is_set)
            except RayHeadError as e:
                _log(str(e))
                return 1
            while not self.stop_requested.is_set():
                fatal = server.supervise()
                if fatal is not None:
                    _log(f"{fatal}; shutting down")
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
    server = Server(args, coordinator_command, frontend_command)
    _log(
        f"starting: model {args.model or 'smollm2'}{' (null engine)' if args.null_engine else ''}, "
        f"DP={args.data_parallel_size} on {args.data_parallel_backend}, {args.api_server_count} API server(s) on "
        f"{args.host}:{args.port}, deployment {server.deployment_id}"
    )
    if args.zmq_security.is_secure:
        _log(args.zmq_security.describe())
    else:
        _log(f"warning: {args.zmq_security.describe()}: anyone who reaches the ports can register, scale or "
             "stop ranks")
    code = asyncio.run(_Lifecycle(server).run(started))
    _log("stopped")
    return code
