"""The coordinator's settings: one frozen dataclass, built from the CLI (see main.py)."""

from __future__ import annotations

import dataclasses

from dpserve_shared.envelope import new_deployment_id


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
    engine_timeout_s: float = 10.0  # an engine silent this long is DEAD
    frontend_timeout_s: float = 5.0  # a frontend silent this long is gone
    max_engine_restarts: int = 3  # per rank
    engine_args: tuple[str, ...] = ()  # passed to every `dpserve-engine` command line
    ready_file: str | None = None  # written (with the topology as JSON) once every rank is READY
    # On every control and broadcast message (envelope.py); handed to the engines this coordinator starts.
    deployment_id: str = dataclasses.field(default_factory=new_deployment_id)

    @property
    def control_addr(self) -> str:
        return f"tcp://{self.data_parallel_address}:{self.data_parallel_rpc_port}"
