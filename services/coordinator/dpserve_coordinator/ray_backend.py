"""The ray backend: one placement group and one EngineHost actor per rank. The only module that imports Ray.

The coordinator never imports the engine package. `EngineHost` is a small actor placed on the CPU bundle of the
rank's STRICT_PACK placement group; it runs `python -m dpserve_engine.service ...` on its node (with
CUDA_VISIBLE_DEVICES set from the GPU Ray assigned to the rank's device bundle), supervises it, and its
`wait()` resolves when the process exits. The engine then registers over ZMQ exactly as under the mp backend.

Engine processes notice a dead actor through their parent pid, so killing the actors is enough to stop them.

Actors and placement groups are detached and named (`dpserve-engine-<rank>`, `dpserve-rank-<rank>`) in the
deployment's namespace (`dpserve-<deployment id>`): they outlive a coordinator that dies, and the next coordinator
of the deployment (same --deployment-id, the same Ray cluster) finds them with `adopt()` and supervises them
again, their engines untouched. That needs a Ray that outlives the coordinator: `dpserve serve` starts the local
instance itself (`ray start --head --block`) and passes its address; a coordinator that starts Ray in-process
(no --ray-address) takes it down with it.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

# Ray folds log lines that differ only in their numbers into one, so "engine[1] ..." vanished behind "engine[0]
# ..." (without even a "repeated" note when no later line came): every rank's lines are wanted. Read on import.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import ray  # noqa: E402 - after the setting above
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

from dpserve_coordinator.launcher import EngineLauncher, LaunchError, engine_command
from dpserve_coordinator.placement import (
    ACTOR_BUNDLE,
    DEVICE_BUNDLE,
    PlacementError,
    RankPlacement,
    nodes_from_ray,
    plan_added_rank,
    plan_placement,
)
from dpserve_coordinator.settings import CoordinatorSettings, local_ray_num_cpus

log = logging.getLogger(__name__)

RAY_NAMESPACE_PREFIX = "dpserve-"
_PLACEMENT_TIMEOUT_S = 30.0


class _QuietRay(logging.Filter):
    """Drops Ray's start-up warnings that a dpserve user cannot act on: the SIGTERM handler (the coordinator
    handles its own signals) and the note that token auth is on (dpserve keeps it on, by design)."""

    NOT_ACTIONABLE = ("SIGTERM handler is not set", "Token authentication is enabled for this Ray cluster")

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.NOT_ACTIONABLE)


def _quiet_ray_logs() -> None:
    """No ANSI colour in Ray's forwarded worker lines unless they go to a terminal; no unactionable warnings."""
    if not sys.stderr.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # Ray reads it when it prints a worker's line
    for name in ("ray._private.worker", "ray._private.authentication.authentication_token_setup"):
        logging.getLogger(name).addFilter(_QuietRay())


def _die_with_parent() -> None:
    """In the engine process before exec: SIGKILL when its actor dies (ray.kill, a crashed worker), so that a
    killed actor's rank is as dead as a killed process (its replacement can then take the rank)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def actor_name(rank: int) -> str:
    return f"dpserve-engine-{rank}"


def group_name(rank: int) -> str:
    return f"dpserve-rank-{rank}"


def namespace(deployment_id: str) -> str:
    return RAY_NAMESPACE_PREFIX + deployment_id


_ACTOR_NAME = re.compile(r"dpserve-engine-(\d+)")


@ray.remote(num_cpus=1, max_restarts=0)
class EngineHost:
    """Runs one engine process on this node and reports when it exits."""

    def __init__(self, rank: int):
        self.rank = rank
        self.proc: subprocess.Popen | None = None

    async def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    async def describe(self) -> tuple[int, bool, str]:
        """(the engine's pid, whether it is alive, this node's IP): what a new coordinator adopts."""
        alive = self.proc is not None and self.proc.poll() is None
        return (self.proc.pid if self.proc is not None else 0), alive, ray.util.get_node_ip_address()

    async def start(self, cmd: list[str], env_overrides: dict[str, str], bind_node_ip: bool) -> int:
        if bind_node_ip:  # ranks off the head node listen on their node's address
            cmd = [ray.util.get_node_ip_address() if a == "{node_ip}" else a for a in cmd]
        env = dict(os.environ)
        env.update(env_overrides)
        if "CUDA_VISIBLE_DEVICES" not in env_overrides:
            env.pop("CUDA_VISIBLE_DEVICES", None)  # Ray sets "" for an actor without GPUs
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        return self.proc.pid

    async def wait(self) -> int:
        """The engine process's exit code, once it exits: a blocking wait in a thread (polling every 0.2 s cost
        ~1 % of a core per rank, wake-ups that land between the engine's threads)."""
        if self.proc is None:
            return -1
        return await asyncio.to_thread(self.proc.wait)

    async def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # SIGKILL: also ends a stopped (SIGSTOP) process

    async def stop(self, timeout_s: float) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.proc.poll() is None:
            self.proc.kill()
            await asyncio.sleep(0.05)
        return self.proc.poll()


@ray.remote(num_cpus=0)
def _assigned_gpu_ids() -> str:
    return ",".join(str(i) for i in ray.get_gpu_ids())


async def _wait_name_free(name: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name)
        except ValueError:
            return
        await asyncio.sleep(0.1)
    raise LaunchError(f"actor {name} still exists {timeout_s:.0f} s after it was killed")


def _ensure_local_token() -> None:
    """Keep Ray's token auth on without writing ~/.ray/auth_token: a per-instance token in the environment."""
    if any(os.environ.get(v) for v in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        return
    if os.path.exists(os.path.join(os.path.expanduser("~"), ".ray", "auth_token")):
        return
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


_cluster_lost = False  # set when the cluster's GCS stopped answering (RayLauncher._ray_is_gone)


def cluster_lost() -> bool:
    """Whether this process found its Ray cluster gone: Ray's own exit hooks would then wait on it (main.py)."""
    return _cluster_lost


class RayLauncher(EngineLauncher):
    def __init__(self, settings: CoordinatorSettings):
        self._settings = settings
        self._started_ray = False
        self._temp_dir: str | None = None
        self._gcs_address = ""  # host:port of the cluster's GCS, once connected
        self._groups: dict[int, object] = {}
        self._actors: dict[int, object] = {}
        self._placements = {}
        self._closed = False
        self._namespace = namespace(settings.deployment_id)
        self.adopted: dict[int, int] = {}  # rank -> engine pid of the hosts found by connect()

    # -- set-up -------------------------------------------------------------------------------------------------

    def connect(self) -> None:
        """ray.init (a local instance unless --ray-address), then plan and reserve every rank's group."""
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Ray's C++ SIGTERM handler prints a stack trace on every clean shutdown; SIGTERM is how we are stopped.
        os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
        # Ray runs its workers at nice 15, and an engine process inherits its EngineHost actor's: beside the
        # frontends on the same cores (nice 0) it would yield to them, which the mp backend's engines do not. A
        # local instance runs them at 0, like mp; a cluster's nodes are started so by deploy/ray-*.sh.
        os.environ.setdefault("RAY_worker_niceness", "0")
        started = time.monotonic()
        _quiet_ray_logs()
        if self._settings.ray_address:
            try:
                ray.init(address=self._settings.ray_address, namespace=self._namespace, log_to_driver=True)
            except ConnectionError as e:
                raise LaunchError(
                    f"cannot connect to the Ray cluster at --ray-address {self._settings.ray_address}: {e} "
                    "(is it running? with token auth, set RAY_AUTH_TOKEN to the cluster's token)"
                ) from None
        else:
            _ensure_local_token()
            self._temp_dir = self._settings.ray_temp_dir or tempfile.mkdtemp(prefix="dpray-", dir="/tmp")
            os.makedirs(self._temp_dir, exist_ok=True)
            ray.init(
                num_cpus=local_ray_num_cpus(self._settings.data_parallel_size_local),
                include_dashboard=False,
                _temp_dir=self._temp_dir,
                object_store_memory=100 * 1024 * 1024,
                namespace=self._namespace,
                log_to_driver=True,
            )
            self._started_ray = True
        self._gcs_address = ray.get_runtime_context().gcs_address
        log.info(
            "Ray %s in %.1f s (%s)",
            "connected" if self._settings.ray_address else "started",
            time.monotonic() - started,
            self._settings.ray_address or f"local instance, temp dir {self._temp_dir}",
        )
        self.adopted = self._adopt()
        self._plan_when_nodes_fit()

    def _plan_when_nodes_fit(self) -> None:
        """Plan at once; with --ray-wait-for-nodes-s, keep trying while the cluster may still be growing."""
        deadline = time.monotonic() + self._settings.ray_wait_for_nodes_s
        next_log = 0.0
        while True:
            try:
                self._plan()
                return
            except LaunchError as e:
                if time.monotonic() >= deadline:
                    raise
                if time.monotonic() >= next_log:
                    log.info("waiting for Ray nodes (%.0f s left): %s", deadline - time.monotonic(), e)
                    next_log = time.monotonic() + 10.0
                time.sleep(1.0)

    @staticmethod
    def _free_nodes():
        """(alive nodes with their free resources, the head node's IP)."""
        head_node_id = ray.get_runtime_context().get_node_id()
        ray_nodes = ray.nodes()
        head_ip = next(n["NodeManagerAddress"] for n in ray_nodes if n["NodeID"] == head_node_id)
        try:
            from ray._private.state import available_resources_per_node  # private; totals are the fallback

            available = available_resources_per_node()
        except Exception:  # noqa: BLE001
            available = None
        return nodes_from_ray(ray_nodes, available), head_ip

    def _plan_added_rank(self, rank: int) -> None:
        """A rank added by a scale-up: planned alone, from what is free in the cluster now."""
        nodes, head_ip = self._free_nodes()
        try:
            p = plan_added_rank(nodes, head_ip, rank, may_use_head=self._settings.data_parallel_size_local > 0)
        except PlacementError as e:
            raise LaunchError(str(e)) from None
        self._placements[rank] = p
        log.info("rank %d: placement on %s%s, bundles %s", rank, p.node_ip, " (head)" if p.is_on_head else "",
                 p.bundles)

    def _plan(self) -> None:
        if self.adopted:
            return  # a restarted coordinator: the adopted ranks keep their groups; any other is planned when started
        nodes, head_ip = self._free_nodes()
        try:
            plan = plan_placement(
                nodes, head_ip, self._settings.data_parallel_size, self._settings.data_parallel_size_local
            )
        except PlacementError as e:
            raise LaunchError(str(e)) from None
        self._placements = {p.rank: p for p in plan}
        for p in plan:
            head = " (head)" if p.is_on_head else ""
            log.info("rank %d: placement on %s%s, bundles %s", p.rank, p.node_ip, head, p.bundles)

    def _adopt(self) -> dict[int, int]:
        """The engine hosts this deployment's namespace still has (a coordinator before this one started them):
        rank -> engine pid. A host whose engine is gone, or that does not answer, is removed with its group."""
        adopted: dict[int, int] = {}
        head_ip = self._free_nodes()[1]
        for name in ray.util.list_named_actors():
            match = _ACTOR_NAME.fullmatch(name)
            if match is None:
                continue
            rank = int(match.group(1))
            actor = ray.get_actor(name)
            try:
                group = ray.util.get_placement_group(group_name(rank))
                pid, alive, node_ip = ray.get(actor.describe.remote(), timeout=10)
            except Exception as e:  # noqa: BLE001 - a missing group, a dead or silent host: start the rank anew
                log.warning("rank %d: found actor %s but cannot adopt it (%s): removing it", rank, name, e)
                pid, alive, group = 0, False, None
            if not alive:
                ray.kill(actor)
                if group is not None:
                    remove_placement_group(group)
                continue
            bundles = tuple(dict(b) for b in group.bundle_specs)
            self._actors[rank], self._groups[rank] = actor, group
            self._placements[rank] = RankPlacement(rank, node_ip, node_ip == head_ip, bundles)
            adopted[rank] = pid
            log.info("rank %d: adopted actor %s (engine pid %d on %s)", rank, name, pid, node_ip)
        return adopted

    async def _reserve(self, rank: int):
        p = self._placements[rank]
        group = placement_group(list(p.bundles), strategy="STRICT_PACK", name=group_name(rank), lifetime="detached")
        try:
            await asyncio.wait_for(asyncio.wrap_future(group.ready().future()), _PLACEMENT_TIMEOUT_S)
        except asyncio.TimeoutError:
            remove_placement_group(group)
            raise LaunchError(
                f"rank {rank}: placement group {p.bundles} on {p.node_ip} not ready after {_PLACEMENT_TIMEOUT_S:.0f} s "
                "(resources taken by something else?)"
            ) from None
        self._groups[rank] = group
        return group

    # -- EngineLauncher -----------------------------------------------------------------------------------------

    async def start(self, rank: int) -> None:
        if rank not in self._placements:  # added by a scale-up
            await asyncio.to_thread(self._plan_added_rank, rank)
        p = self._placements[rank]
        old = self._actors.pop(rank, None)
        if old is not None:  # a restart: the old host's name must be free before the new one takes it
            ray.kill(old)
            await _wait_name_free(actor_name(rank))
        group = self._groups.get(rank) or await self._reserve(rank)
        env: dict[str, str] = {}
        if "GPU" in p.bundles[DEVICE_BUNDLE]:
            gpu_task = _assigned_gpu_ids.options(
                num_gpus=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=DEVICE_BUNDLE),
            ).remote()
            env["CUDA_VISIBLE_DEVICES"] = await asyncio.wrap_future(gpu_task.future())
        actor = EngineHost.options(
            name=actor_name(rank),
            lifetime="detached",  # outlives this coordinator: the next one adopts it (_adopt)
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=ACTOR_BUNDLE),
        ).remote(rank)
        self._actors[rank] = actor
        host = self._settings.data_parallel_address if p.is_on_head else "{node_ip}"
        cmd = engine_command(self._settings, rank, host)
        # The key as a method argument: not in a runtime_env, which Ray shows (dashboard, `ray list actors`).
        overrides = {**env, **self._settings.zmq_security.child_env({})}
        pid = await asyncio.wrap_future(actor.start.remote(cmd, overrides, not p.is_on_head).future())
        log.info(
            "rank %d: actor %s started engine process pid %d on %s%s",
            rank,
            actor_name(rank),
            pid,
            p.node_ip,
            f" (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']})" if env else "",
        )

    async def wait_exit(self, rank: int) -> str:
        actor = self._actors[rank]
        try:
            code = await asyncio.wrap_future(actor.wait.remote().future())
            return f"engine process exited with code {code}"
        except ray.exceptions.RayActorError as e:
            return f"actor {actor_name(rank)} died: {str(e).splitlines()[0]}"

    def describe(self, rank: int) -> str:
        p = self._placements.get(rank)
        return f"actor {actor_name(rank)} on {p.node_ip}" if p else ""

    async def stop(self, rank: int, timeout_s: float) -> None:
        """Stop the rank's engine through its actor, kill the actor, remove its placement group."""
        actor = self._actors.pop(rank, None)
        group = self._groups.pop(rank, None)
        self._placements.pop(rank, None)
        if actor is not None:
            try:
                await asyncio.wait_for(asyncio.wrap_future(actor.stop.remote(timeout_s).future()), timeout_s + 2)
            except (asyncio.TimeoutError, ray.exceptions.RayActorError) as e:
                log.warning("rank %d: actor %s did not stop its engine cleanly: %s", rank, actor_name(rank), e)
            ray.kill(actor)
            try:
                await _wait_name_free(actor_name(rank))  # a later scale-up may take the name again
            except LaunchError as e:
                log.warning("rank %d: %s", rank, e)
        if group is not None:
            remove_placement_group(group)
        if actor is not None or group is not None:
            log.info("rank %d: actor %s killed, placement group %s removed", rank, actor_name(rank), group_name(rank))

    async def close(self, timeout_s: float) -> None:
        if self._closed:
            return
        self._closed = True
        gone = ray.is_initialized() and self._ray_is_gone()
        if gone:
            self._actors.clear()  # they went with it: no stop to wait for
        if self._actors:
            refs = [a.stop.remote(timeout_s) for a in self._actors.values()]
            try:
                await asyncio.wait_for(
                    asyncio.gather(*(asyncio.wrap_future(r.future()) for r in refs), return_exceptions=True),
                    timeout_s + 2,
                )
            except asyncio.TimeoutError:
                log.warning("engine hosts did not stop within %.0f s; killing them", timeout_s + 2)
        self._release(gone)

    def _ray_is_gone(self) -> bool:
        """Whether the cluster's GCS no longer takes connections (e.g. the local instance was killed): Ray's calls
        would then retry until its reconnect timeout (60 s) before failing, and the actors and placement groups
        they would release are gone with it."""
        host, _, port = self._gcs_address.rpartition(":")
        if not host:
            return False
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return False
        except (OSError, ValueError):
            global _cluster_lost
            _cluster_lost = True
            log.warning("Ray's GCS at %s does not answer: its actors and placement groups went with it; "
                        "nothing to release", self._gcs_address)  # fmt: skip
            return True

    def _release(self, gone: bool) -> None:
        """Kill the actors, remove the groups, shut Ray down; with the cluster `gone`, forget them instead."""
        if gone:
            self._actors.clear()
            self._groups.clear()
        for actor in self._actors.values():
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001
                pass
        self._actors.clear()
        for group in self._groups.values():
            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001
                pass
        self._groups.clear()
        # Not with the cluster gone: ray.shutdown would wait ~25 s on its dead GCS and metrics agent (main.py
        # then exits without Ray's exit hook).
        if ray.is_initialized() and not gone:
            ray.shutdown()
        if self._started_ray:
            self._started_ray = False
            if self._temp_dir and not self._settings.ray_temp_dir:
                shutil.rmtree(self._temp_dir, ignore_errors=True)
        if not gone:
            log.info("Ray actors and placement groups released")

    async def kill(self, rank: int) -> None:
        actor = self._actors.get(rank)
        if actor is None:
            return
        log.warning("rank %d: SIGKILL to its engine process (through actor %s)", rank, actor_name(rank))
        try:
            await asyncio.wait_for(actor.kill.remote(), 5.0)
        except Exception as e:  # noqa: BLE001 - the actor itself does not answer: kill it (its engine with it)
            log.warning("rank %d: actor %s did not answer (%s): killing the actor", rank, actor_name(rank), e)
            ray.kill(actor)

    def kill_now(self) -> None:
        self._closed = True
        try:
            self._release(ray.is_initialized() and self._ray_is_gone())
        except Exception as e:  # noqa: BLE001
            log.error("Ray teardown failed: %s", e)
