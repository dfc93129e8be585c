"""The processes of one `dpserve serve`: the local Ray instance (ray backend without --ray-address), the
coordinator and the API servers; their start and stop order, and their restarts.

Start: Ray (ray_head.py; the coordinator connects to it), then the coordinator, then the API servers. A child that
exits while the deployment is STARTING ends it (a bad flag, a model that does not load: the error is in its log).
Once SERVING, a coordinator or an API server that exits is started again, on a back-off (1 s, doubling for each
death in a row that came within STABLE_S of its start, at most 30 s): the engines keep serving meanwhile; a new
coordinator re-attaches to them (it finds them: the Ray backend's actors are named and detached, the mp
backend's engines watch this process, not the coordinator, and register again); an API server that is gone
leaves the shared port to the others, and its requests are freed on the engines when the coordinator notices it
is silent. The Ray instance exiting ends the deployment.

Stop (SIGTERM/SIGINT): API servers first (they drain), then the coordinator (engines, actors, placement groups),
then Ray; whatever is left of a child's process group, or was re-parented here (this process is a child subreaper:
an engine whose coordinator died), is killed. A second signal kills at once.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import enum
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
from collections.abc import Callable

from dpserve.ray_head import RayHead, ray_env
from dpserve_shared.engine_flags import WATCH_PID_ENV
from dpserve_shared.envelope import deployment_id_from_env, new_deployment_id
from dpserve_shared.status import API_KEY_ENV
from dpserve_shared.zmq_security import CLUSTER_KEY_ENV, remove_run_key, run_key_path, write_run_key

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_FRONTEND_STOP_GRACE_S = 10.0  # a frontend drains for up to --shutdown-timeout, then ends what is left, unregisters
_COORDINATOR_STOP_S = 20.0
RESTART_DELAY_S = 1.0
MAX_RESTART_DELAY_S = 30.0
STABLE_S = 30.0
# A restarted coordinator waits this long for the engines to register again (they do within ~5 s of the last
# broadcast); a rank whose engine died meanwhile is started anew after it.


def log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} dpserve {message}", file=sys.stderr, flush=True)


def child_setup() -> None:
    """In the child before exec: own process group, and SIGTERM when `dpserve` dies."""
    os.setpgid(0, 0)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class ServeState(enum.Enum):
    STARTING = "starting"  # children started, not every one ready yet
    SERVING = "serving"  # "serving on ..." printed
    DRAINING = "draining"  # stopping the children in order (frontends first)
    STOPPED = "stopped"  # every child gone


@dataclasses.dataclass
class Child:
    """A coordinator or API server process, and what its restarts need."""

    name: str
    command: Callable[[bool], list[str]]  # is_restart -> the command line
    env: dict[str, str]
    ready_file: str
    proc: subprocess.Popen | None = None
    started_s: float = 0.0
    restarts: int = 0
    quick_deaths: int = 0
    restart_at_s: float | None = None  # scheduled: it exited
    down_since_s: float | None = None  # it exited, and is not ready again yet

    def spawn(self, is_restart: bool) -> None:
        if os.path.exists(self.ready_file):
            os.remove(self.ready_file)  # the new process writes it when it is ready
        self.proc = subprocess.Popen(self.command(is_restart), env=self.env, stdin=subprocess.DEVNULL,
                                     preexec_fn=child_setup)  # fmt: skip
        self.started_s = time.monotonic()
        self.restart_at_s = None


class Server:
    """The children of `dpserve serve`, their order of start and stop, their restarts."""

    def __init__(self, args: argparse.Namespace, coordinator_command, frontend_command):
        self.args = args
        self.state = ServeState.STARTING
        self.work_dir = tempfile.mkdtemp(prefix="dpserve-")
        self.ready_file = os.path.join(self.work_dir, "coordinator-ready.json")
        self.metrics_dir = os.path.join(self.work_dir, "prometheus")
        os.makedirs(self.metrics_dir)
        # On every control and broadcast message of this deployment: its peers ignore any other's (envelope.py).
        self.deployment_id = deployment_id_from_env() or new_deployment_id()
        env = dict(os.environ)
        env.pop(API_KEY_ENV, None)
        env.pop(CLUSTER_KEY_ENV, None)  # the Ray instance has no use for it; the coordinator and API servers get it
        if args.api_key:
            env[API_KEY_ENV] = args.api_key  # not on a command line: `ps` shows those to every user
        self.ray_head: RayHead | None = None
        self.ray_temp_dir: str | None = None
        if args.data_parallel_backend == "ray" and not args.ray_address:
            # Short, under /tmp (Ray's socket paths have a length limit); removed here whatever happens to Ray.
            self.ray_temp_dir = args.ray_temp_dir or tempfile.mkdtemp(prefix="dpray-", dir="/tmp")
            env = ray_env(env)
            self.ray_head = RayHead(self.ray_temp_dir, args.data_parallel_address,
                                    args.data_parallel_size_local or args.data_parallel_size, env,
                                    preexec_fn=child_setup)  # fmt: skip
        coordinator_args = argparse.Namespace(**{
            **vars(args), "ray_temp_dir": None if self.ray_head else args.ray_temp_dir,
            "ray_address": self.ray_head.address if self.ray_head else args.ray_address,
        })  # fmt: skip

        def coordinator_cmd(is_restart: bool) -> list[str]:
            cmd = coordinator_command(coordinator_args, self.ready_file, self.deployment_id)
            # A first start has no engines to look for; a restart finds them (the coordinator's default)
            return cmd if is_restart else cmd + ["--reattach-wait-s", "0"]

        env = args.zmq_security.child_env(env)  # set by serve.validate(); never on a command line
        # A key made for this run: kept for `dpserve scale` on this host, in a file only this user can read
        made_key = args.zmq_security.is_secure and not args.cluster_key_file and not os.environ.get(CLUSTER_KEY_ENV)
        self.run_key_file = run_key_path(f"tcp://{args.data_parallel_address}:{args.data_parallel_rpc_port}") \
            if made_key else None
        self.coordinator = Child("coordinator", coordinator_cmd, dict(env, **{WATCH_PID_ENV: str(os.getpid())}),
                                 self.ready_file)  # fmt: skip
        frontend_env = dict(env, PROMETHEUS_MULTIPROC_DIR=self.metrics_dir)
        frontend_env.pop("RAY_AUTH_TOKEN", None)  # the API servers never talk to Ray
        self.frontends = [
            Child(f"API server {i}", lambda _, i=i, path=path: frontend_command(args, path, self.deployment_id, i),
                  frontend_env, path)
            for i, path in enumerate(os.path.join(self.work_dir, f"frontend-{i}-ready")
                                     for i in range(args.api_server_count))
        ]  # fmt: skip

    # -- start ----------------------------------------------------------------------------------------------------

    def start(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Ray (if it is ours), the coordinator, the API servers. Raises RayHeadError."""
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)  # orphaned engines come here
        except (OSError, AttributeError):
            pass
        if self.run_key_file is not None:
            write_run_key(self.run_key_file, self.args.zmq_security.cluster_key)
        if self.ray_head is not None:
            started = time.monotonic()
            self.ray_head.start()
            self.ray_head.wait_ready(should_stop)
            log(f"local Ray instance at {self.ray_head.address} started in {time.monotonic() - started:.1f} s")
        if should_stop():
            return
        self.coordinator.spawn(is_restart=False)
        for frontend in self.frontends:
            frontend.spawn(is_restart=False)

    def _own_pids(self) -> set[int]:
        """The children this process waits for itself (the rest of its children were re-parented here)."""
        own = {proc.pid for _, proc in self.procs()}
        if self.ray_head is not None and self.ray_head.proc is not None:
            own.add(self.ray_head.proc.pid)
        return own

    def children(self) -> list[Child]:
        return [self.coordinator, *self.frontends]

    def procs(self) -> list[tuple[str, subprocess.Popen]]:
        return [(c.name, c.proc) for c in self.children() if c.proc is not None]

    # -- while it runs ----------------------------------------------------------------------------------------------

    def supervise(self) -> str | None:
        """One look at the children: restart those that exited (once SERVING), log a coordinator that is back;
        returns why the deployment must stop, if it must."""
        _reap_orphans(self._own_pids())
        if self.ray_head is not None and not self.ray_head.is_alive():
            return f"the local Ray instance exited:\n{self.ray_head.log_tail()}"
        now = time.monotonic()
        for child in self.children():
            if child.proc is None:
                continue
            code = child.proc.poll()
            if code is None:
                if child.down_since_s is not None and os.path.exists(child.ready_file):
                    log(f"{child.name} is back (restart {child.restarts}): gone for {now - child.down_since_s:.1f} s, "
                        f"ready {now - child.started_s:.1f} s after its start")
                    child.down_since_s = None
                continue
            if self.state is not ServeState.SERVING:
                return f"{child.name} exited with code {code}"
            if child.restart_at_s is None:
                self._schedule_restart(child, code, now)
            elif now >= child.restart_at_s:
                child.restarts += 1
                child.spawn(is_restart=True)
                log(f"{child.name}: restarted (restart {child.restarts}, pid {child.proc.pid})")
        return None

    @staticmethod
    def _schedule_restart(child: Child, code: int, now: float) -> None:
        child.quick_deaths = child.quick_deaths + 1 if now - child.started_s < STABLE_S else 1
        delay = min(MAX_RESTART_DELAY_S, RESTART_DELAY_S * 2 ** (child.quick_deaths - 1))
        child.restart_at_s = now + delay
        child.down_since_s = child.down_since_s or now
        what = "the engines keep serving; it re-attaches to them" if child.name == "coordinator" else \
            "the other API servers keep the port"
        log(f"{child.name} (pid {child.proc.pid}) exited with code {code}: restarting it in {delay:.0f} s ({what})")

    def health_url(self) -> str:
        host = "127.0.0.1" if self.args.host in ("0.0.0.0", "", "::") else self.args.host
        return f"http://{host}:{self.args.port}"

    def is_healthy(self) -> bool:
        # Every API server must follow the broadcasts and see every rank: they share the port, so /health alone
        # answers for whichever one the kernel picked.
        if not all(os.path.exists(c.ready_file) for c in self.children()):
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

    # -- stop ---------------------------------------------------------------------------------------------------------

    def stop(self, drain: bool = True) -> None:
        """drain: API servers first (they drain), then the coordinator, then Ray, SIGKILL whatever outlives its
        timeout; blocks until every child is gone, and does nothing if a stop is under way or done. Not drain (a
        second signal): kill at once, without waiting; a stop under way then finishes quickly."""
        if not drain:
            self._kill_now()
            return
        if self.state in (ServeState.DRAINING, ServeState.STOPPED):
            return
        self.state = ServeState.DRAINING
        _stop_all([f.proc for f in self.frontends if f.proc is not None],
                  self.args.shutdown_timeout + _FRONTEND_STOP_GRACE_S)
        if self.coordinator.proc is not None:
            _stop_all([self.coordinator.proc], _COORDINATOR_STOP_S)
        for _, proc in self.procs():
            _kill_leftovers(proc)
        _kill_orphans(self._own_pids())  # engines of a coordinator that died (they would exit once this one has)
        if self.ray_head is not None:
            self.ray_head.stop()
        if self.run_key_file is not None:
            remove_run_key(self.run_key_file)
        shutil.rmtree(self.work_dir, ignore_errors=True)
        if self.ray_temp_dir and not self.args.ray_temp_dir:
            shutil.rmtree(self.ray_temp_dir, ignore_errors=True)
        self.state = ServeState.STOPPED

    def _kill_now(self) -> None:
        """The coordinator gets a second SIGTERM (it kills its engines), the rest SIGKILL; then Ray."""
        for name, proc in self.procs():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM if name == "coordinator" else signal.SIGKILL)
                    if name == "coordinator":
                        os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        _kill_orphans(self._own_pids())
        if self.ray_head is not None:
            self.ray_head.stop(kill=True)


def _kill_leftovers(proc: subprocess.Popen) -> None:
    """Each child leads a process group of its own; whatever is left in it once the child exited is killed."""
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
            log(f"pid {proc.pid} did not stop within {timeout_s:.0f} s: killing its process group")
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    for proc in procs:
        # -SIGTERM: our own SIGTERM reached it before it had set its handlers (it was still starting)
        if proc.returncode not in (0, None, -signal.SIGTERM):
            log(f"pid {proc.pid} exited with code {proc.returncode}")


def _children_of_this_process() -> dict[int, str]:
    """pid -> state of the processes whose parent is this one (from /proc)."""
    me, found = os.getpid(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            found[int(entry)] = fields[0]
    return found


def _reap_orphans(own: set[int]) -> None:
    """Reap exited processes re-parented here (not the children we wait for ourselves)."""
    for pid, state in _children_of_this_process().items():
        if state == "Z" and pid not in own:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def _kill_orphans(own: set[int]) -> None:
    """SIGKILL what was re-parented here and still runs (and its process group), then reap it."""
    for pid, state in _children_of_this_process().items():
        if state == "Z" or pid in own:
            continue
        for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
            try:
                kill()
            except (ProcessLookupError, PermissionError):
                pass
    time.sleep(0.05)
    _reap_orphans(own)

