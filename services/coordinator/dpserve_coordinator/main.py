"""`dpserve-coordinator`: places and starts the engine ranks, keeps the registry, publishes topology and load.

Engine flags (--model, --max-model-len, ...) are checked here and passed to every engine's command line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from dpserve_shared.engine_flags import add_engine_flags, engine_argv
from dpserve_shared.envelope import DEPLOYMENT_ID_ENV, deployment_id_from_env

from dpserve_coordinator.settings import CoordinatorSettings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser("dpserve-coordinator", description=__doc__)
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    parser.add_argument(
        "--data-parallel-size-local", "-dpl", type=int, default=None, help="ranks on this (head) node; default: all"
    )
    parser.add_argument("--data-parallel-address", default="127.0.0.1", help="address the control socket binds")
    parser.add_argument("--data-parallel-rpc-port", type=int, default=29550, help="the control socket's port")
    parser.add_argument("--data-parallel-backend", choices=["ray", "mp"], default="ray")
    parser.add_argument("--ray-address", default=None, help="an existing Ray cluster; default: start a local one")
    parser.add_argument("--ray-temp-dir", default=None, help="temp dir of the local Ray instance")
    parser.add_argument(
        "--ray-wait-for-nodes-s",
        type=float,
        default=0.0,
        help="with --ray-address: how long to wait for nodes to join while the ranks do not fit (default: 0, fail)",
    )
    parser.add_argument("--engine-startup-timeout-s", type=float, default=600.0,
        help="how long ranks may take to load, compile and register (a first start compiles for minutes)")
    parser.add_argument("--max-engine-restarts", type=int, default=3)
    parser.add_argument("--ready-file", default=None, help="written once every rank is ready (used by dpserve serve)")
    parser.add_argument(
        "--deployment-id", default=deployment_id_from_env(),
        help=f"this deployment's id, on every control and broadcast message; peers of another id are ignored "
             f"(default: ${DEPLOYMENT_ID_ENV}, else a random one)",
    )
    add_engine_flags(parser)
    return parser


def settings_from_args(args: argparse.Namespace) -> CoordinatorSettings:
    """Validate flag combinations; raise ValueError with the message a user should see."""
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
                "--data-parallel-backend mp runs every rank on this node: --data-parallel-size-local must equal "
                "--data-parallel-size (use --data-parallel-backend ray for ranks on other nodes)"
            )
        if args.ray_address:
            raise ValueError("--ray-address needs --data-parallel-backend ray")
    if size_local < size and args.data_parallel_address.startswith(("127.", "localhost")):
        raise ValueError(
            f"ranks on other nodes cannot reach the coordinator at --data-parallel-address "
            f"{args.data_parallel_address}: give this node's address in the cluster"
        )
    if args.ray_wait_for_nodes_s and not args.ray_address:
        raise ValueError("--ray-wait-for-nodes-s needs --ray-address (a local Ray instance does not grow)")
    if args.ray_address and args.ray_temp_dir:
        raise ValueError("--ray-temp-dir applies only to a local Ray instance, not with --ray-address")
    return CoordinatorSettings(
        data_parallel_size=size,
        data_parallel_size_local=size_local,
        data_parallel_address=args.data_parallel_address,
        data_parallel_rpc_port=args.data_parallel_rpc_port,
        data_parallel_backend=args.data_parallel_backend,
        ray_address=args.ray_address,
        ray_temp_dir=args.ray_temp_dir,
        ray_wait_for_nodes_s=args.ray_wait_for_nodes_s,
        engine_startup_timeout_s=args.engine_startup_timeout_s,
        max_engine_restarts=args.max_engine_restarts,
        engine_args=engine_argv(args),
        ready_file=args.ready_file,
        **({"deployment_id": args.deployment_id} if args.deployment_id else {}),
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s", stream=sys.stderr
    )
    from dpserve_coordinator.server import Coordinator

    return asyncio.run(Coordinator(settings).run())


if __name__ == "__main__":
    sys.exit(main())
