"""The coordinator's settings: one frozen dataclass, its command-line flags, and the one builder that checks them.

`dpserve serve` shares the deployment flags (`add_deployment_flags`) and validates its flags with this same
builder (`settings_from_args`), so an impossible combination is refused with the same message either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from dpserve_shared.engine_flags import add_engine_flags, engine_argv
from dpserve_shared.envelope import DEPLOYMENT_ID_ENV, deployment_id_from_env, new_deployment_id
from dpserve_shared.status import API_KEY_ENV
from dpserve_shared.timing import ENGINE_SILENCE_S, ENGINE_STALL_S, FRONTEND_SILENCE_S
from dpserve_shared.zmq_security import ZmqSecurity, add_security_flags, security_from_args


LOCAL_RAY_MAX_RANKS = 8  # ranks a local Ray instance has room for (more if started with more)


def local_ray_num_cpus(data_parallel_size_local: int) -> int:
    """Logical CPUs of a local Ray instance: 2 per rank (an engine bundle and its actor) for up to
    LOCAL_RAY_MAX_RANKS ranks, so that `dpserve scale` can add ranks; Ray prestarts workers by real cores, so the
    headroom costs nothing."""
    return 2 * max(data_parallel_size_local, LOCAL_RAY_MAX_RANKS) + 1


@dataclasses.dataclass(frozen=True)
class CoordinatorSettings:
    data_parallel_size: int = 1
    data_parallel_size_local: int = 1
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 29550
    data_parallel_backend: str = "ray"  # "ray" | "mp"
    ray_address: str | None = None  # None: start a local Ray instance
    ray_temp_dir: str | None = None  # local Ray instance only; None: a fresh directory under /tmp
    ray_wait_for_nodes_s: float = 0.0  # --ray-address: retry an impossible placement this long (nodes joining)
    engine_startup_timeout_s: float = 600.0
    engine_timeout_s: float = ENGINE_SILENCE_S  # an engine silent this long is DEAD
    frontend_timeout_s: float = FRONTEND_SILENCE_S  # a frontend silent this long is gone
    engine_stall_timeout_s: float = ENGINE_STALL_S  # a rank with work and no step this long is stuck
    max_engine_restarts: int = 3  # quick deaths in a row before a rank is shown as FAILED (supervisor.py)
    engine_args: tuple[str, ...] = ()  # passed to every `dpserve-engine` command line
    # --enable-expert-parallel (an engine flag, in engine_args too): the ranks form one process group and step in
    # lock-step waves; the coordinator hands out the group's address and follows rank 0's WaveComplete
    enable_expert_parallel: bool = False
    ready_file: str | None = None  # written (with the topology as JSON) once every rank is READY
    # How long to wait for the engines of a coordinator before this one to register again; None (the command
    # line's default): look for them first (ray: their actors; mp: their heartbeats, 1.5 s), 0: never look.
    reattach_wait_s: float | None = 0.0
    status_port: int | None = None  # the status page's HTTP port (on data_parallel_address); None: none
    api_key: str | None = dataclasses.field(default=None, repr=False)  # the status page's key; never logged
    # On every control and broadcast message (envelope.py); handed to the engines this coordinator starts.
    deployment_id: str = dataclasses.field(default_factory=new_deployment_id)
    # CURVE on the control and broadcast sockets (zmq_security.py); the engines it starts get the key too.
    zmq_security: ZmqSecurity = dataclasses.field(default_factory=ZmqSecurity.from_environment, repr=False)

    @property
    def control_addr(self) -> str:
        return f"tcp://{self.data_parallel_address}:{self.data_parallel_rpc_port}"


def add_deployment_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that say where the ranks run and how they start: `dpserve-coordinator`'s and `dpserve serve`'s."""
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
    parser.add_argument("--ray-temp-dir", default=None, help=argparse.SUPPRESS)  # the local Ray instance's
    parser.add_argument("--ray-wait-for-nodes-s", type=float, default=None,
                        help="with --ray-address: how long to wait for nodes to join while the ranks do not fit "
                             "(default: fail at once)")
    parser.add_argument("--engine-startup-timeout-s", type=float, default=600.0,
                        help="how long ranks may take to load, compile and register (a first start compiles for "
                             "minutes; default: %(default)s)")
    parser.add_argument("--engine-stall-timeout-s", type=float, default=ENGINE_STALL_S,
                        help="a rank with requests whose engine has not finished a step for this long is stuck: "
                             "killed, its requests moved, and replaced (the longest legal step, a prefill chunk, "
                             "takes seconds; default: %(default)s)")


def add_status_port_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--status-port", type=int, default=None,
                        help="serve the status page (/status, /status.json, /status/events) from the coordinator "
                             "on this port of --data-parallel-address; every API server serves it too "
                             "(default: none)")


_DESCRIPTION = """`dpserve-coordinator`: places and starts the engine ranks, keeps the registry, publishes topology and load.

Engine flags (--model, --max-model-len, ...) are checked here and passed to every engine's command line.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser("dpserve-coordinator", description=_DESCRIPTION)
    add_deployment_flags(parser)
    parser.add_argument("--max-engine-restarts", type=int, default=3,
                        help="a rank that dies this many times in a row, each within 30 s of its start, is shown as "
                             "FAILED (a crash loop); it is still restarted, on a back-off of 1, 2, 4 ... up to 30 s "
                             "(default: %(default)s)")
    parser.add_argument("--ready-file", default=None, help="written once every rank is ready (used by dpserve serve)")
    parser.add_argument("--reattach-wait-s", type=float, default=None,
                        help="a coordinator started for a running deployment (the same --deployment-id) re-attaches "
                             "to the engines the one before it left: it waits this long for them to register again "
                             "before starting any rank anew; 0: never look for them (default: find them first, ray: "
                             "the deployment's named actors, mp: engines heartbeating to this port, and wait up to "
                             "10 s for them)")
    add_status_port_flag(parser)
    parser.add_argument("--api-key", default=None,
                        help=f"the key the status page asks for (default: ${API_KEY_ENV} if set, else none)")
    parser.add_argument(
        "--deployment-id", default=deployment_id_from_env(),
        help=f"this deployment's id, on every control and broadcast message; peers of another id are ignored "
             f"(default: ${DEPLOYMENT_ID_ENV}, else a random one)",
    )
    add_security_flags(parser)
    add_engine_flags(parser)
    return parser


def settings_from_args(args: argparse.Namespace, environ=os.environ) -> CoordinatorSettings:
    """Validate flag combinations; raise ValueError with the message a user should see. `environ`: where
    $DPSERVE_API_KEY and $DPSERVE_CLUSTER_KEY are read."""
    size = args.data_parallel_size
    size_local = size if args.data_parallel_size_local is None else args.data_parallel_size_local
    if size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {size}")
    if not 0 <= size_local <= size:
        raise ValueError(
            f"--data-parallel-size-local must be between 0 and --data-parallel-size ({size}), got {size_local}"
        )
    if args.data_parallel_backend == "mp":
        if size_local != size:
            raise ValueError(
                "--data-parallel-backend mp runs every rank on this node, so --data-parallel-size-local must equal "
                "--data-parallel-size; use --data-parallel-backend ray to place ranks on other nodes"
            )
        if args.ray_address:
            raise ValueError("--ray-address needs --data-parallel-backend ray")
    if size_local < size and args.data_parallel_address.startswith(("127.", "localhost")):
        raise ValueError(
            f"ranks on other nodes cannot reach the coordinator at --data-parallel-address "
            f"{args.data_parallel_address}: give this node's address in the cluster"
        )
    if args.ray_address and args.ray_temp_dir:
        raise ValueError("--ray-temp-dir applies to a local Ray instance only, not with --ray-address")
    if args.ray_wait_for_nodes_s is not None and not args.ray_address:
        raise ValueError("--ray-wait-for-nodes-s needs --ray-address (a local Ray instance does not grow)")
    if not 0 < args.data_parallel_rpc_port < 65536:
        raise ValueError(f"--data-parallel-rpc-port must be a TCP port, got {args.data_parallel_rpc_port}")
    if args.status_port is not None and not 0 < args.status_port < 65536:
        raise ValueError(f"--status-port must be a TCP port, got {args.status_port}")
    zmq_security = security_from_args(args, "dpserve-coordinator", environ)
    return CoordinatorSettings(
        data_parallel_size=size,
        data_parallel_size_local=size_local,
        data_parallel_address=args.data_parallel_address,
        data_parallel_rpc_port=args.data_parallel_rpc_port,
        data_parallel_backend=args.data_parallel_backend,
        ray_address=args.ray_address,
        ray_temp_dir=args.ray_temp_dir,
        ray_wait_for_nodes_s=args.ray_wait_for_nodes_s or 0.0,
        engine_startup_timeout_s=args.engine_startup_timeout_s,
        engine_stall_timeout_s=args.engine_stall_timeout_s,
        max_engine_restarts=args.max_engine_restarts,
        engine_args=engine_argv(args),
        enable_expert_parallel=bool(args.enable_expert_parallel),
        ready_file=args.ready_file,
        status_port=args.status_port,
        reattach_wait_s=args.reattach_wait_s,
        api_key=args.api_key if args.api_key is not None else environ.get(API_KEY_ENV) or None,
        zmq_security=zmq_security,
        **({"deployment_id": args.deployment_id} if args.deployment_id else {}),
    )
