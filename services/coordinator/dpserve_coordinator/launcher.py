"""How engine processes get started: the launcher interface and the mp backend (local child processes).

Both backends start the same command, `python -m dpserve_engine.service --coordinator ... --rank R ...`; the
engine then registers over ZMQ by itself, so a launcher only starts processes, reports when one exits and stops
them; what happens when one exits (DEAD, restart) is the supervisor's (supervisor.py). The ray backend
(ray_backend.py) runs the command from an actor placed in the rank's placement group.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import signal
import subprocess
import sys
import time

from dpserve_shared.engine_flags import WATCH_PID_ENV

from dpserve_coordinator.settings import CoordinatorSettings

log = logging.getLogger(__name__)



class LaunchError(Exception):
    """The engines cannot be started (placement impossible, Ray unreachable...)."""


def engine_command(settings: CoordinatorSettings, rank: int, host: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dpserve_engine.service",
        "--coordinator",
        settings.control_addr,
        "--rank",
        str(rank),
        "--host",
        host,
        "--deployment-id",
        settings.deployment_id,
        *settings.zmq_security.child_argv(),  # the key itself goes in the environment: `ps` shows command lines
        *settings.engine_args,
    ]


class EngineLauncher(abc.ABC):
    """Starts, watches and stops the engine process of each rank."""

    @abc.abstractmethod
    async def start(self, rank: int) -> None:
        """Start (or restart) the rank's engine process; returns once it is launched, not registered."""

    @abc.abstractmethod
    async def wait_exit(self, rank: int) -> str:
        """Resolve when the rank's engine process is gone, with a reason for the logs."""

    async def stop(self, rank: int, timeout_s: float) -> None:
        """Stop one rank for good (a scale-down): SIGTERM its process, SIGKILL after `timeout_s`, and release what
        was reserved for it. A rank this launcher did not start (a hand-started engine) is a no-op."""
        raise NotImplementedError(f"{type(self).__name__} cannot stop single ranks")

    @abc.abstractmethod
    async def close(self, timeout_s: float) -> None:
        """Stop every engine (SIGTERM, then SIGKILL after `timeout_s`) and release what was reserved."""

    @abc.abstractmethod
    def kill_now(self) -> None:
        """Second signal: kill everything at once, synchronously."""

    async def kill(self, rank: int) -> None:
        """SIGKILL the rank's engine process (a silent or stuck rank); `wait_exit` then reports it."""
        raise NotImplementedError(f"{type(self).__name__} cannot kill single ranks")

    def describe(self, rank: int) -> str:
        return ""

    def adopt(self, rank: int, pid: int) -> bool:
        """Supervise an engine that a coordinator before this one started (it registered again): True if this
        launcher can; a launcher that found its engines itself (Ray: `adopted`) ignores it."""
        return False


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class _AdoptedProcess:
    """An engine process this coordinator did not start (not its child): watched and signalled by pid."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not pid_alive(self.pid):
            self.returncode = -1  # not our child: its exit code is its parent's to read
        return self.returncode

    def send_signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


class MpLauncher(EngineLauncher):
    """Engines as local child processes (single node, no Ray).

    Each engine runs in a session of its own and does not watch this coordinator: it outlives a coordinator that
    dies, registers again with the next one of its deployment, which adopts it (`adopt`). Under `dpserve serve` it
    watches `dpserve serve` ($DPSERVE_WATCH_PID, set there to its pid); started by a coordinator run by hand it
    exits when its deployment has been silent for its --register-timeout-s (120 s: no coordinator came back)."""

    def __init__(self, settings: CoordinatorSettings):
        self._settings = settings
        self._procs: dict[int, subprocess.Popen | _AdoptedProcess] = {}
        # Like Ray's 1-CPU bundles: split the cores between the local engines unless told otherwise.
        num_threads = max(1, (os.cpu_count() or 1) // max(1, settings.data_parallel_size))
        self._env = settings.zmq_security.child_env(os.environ)
        self._env.setdefault("OMP_NUM_THREADS", str(num_threads))
        self._env.setdefault(WATCH_PID_ENV, "0")  # 0: watch no process (see the class docstring)

    async def start(self, rank: int) -> None:
        cmd = engine_command(self._settings, rank, self._settings.data_parallel_address)
        # A session of its own: not in this coordinator's process group, which is killed with it
        self._procs[rank] = subprocess.Popen(cmd, env=self._env, stdin=subprocess.DEVNULL, start_new_session=True)
        log.info("rank %d: started engine process pid %d", rank, self._procs[rank].pid)

    def adopt(self, rank: int, pid: int) -> bool:
        if not pid_alive(pid):
            return False
        self._procs[rank] = _AdoptedProcess(pid)
        log.info("rank %d: adopted engine process pid %d", rank, pid)
        return True

    async def wait_exit(self, rank: int) -> str:
        proc = self._procs[rank]
        while proc.poll() is None:
            await asyncio.sleep(0.2)
        if isinstance(proc, _AdoptedProcess):
            return f"engine process {proc.pid} exited"
        return f"engine process {proc.pid} exited with code {proc.returncode}"

    def describe(self, rank: int) -> str:
        proc = self._procs.get(rank)
        return f"pid {proc.pid}" if proc else ""

    async def stop(self, rank: int, timeout_s: float) -> None:
        proc = self._procs.get(rank)  # kept listed until gone: kill_now (a second signal) must still see it
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            deadline = asyncio.get_running_loop().time() + timeout_s
            while proc.poll() is None and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            if proc.poll() is None:
                log.warning("rank %d: engine process %d still alive %.0f s after SIGTERM: SIGKILL", rank, proc.pid,
                            timeout_s)
                proc.kill()
        await asyncio.to_thread(proc.wait)
        self._procs.pop(rank, None)
        log.info("rank %d: engine process %d stopped (exit code %s)", rank, proc.pid, proc.returncode)

    async def close(self, timeout_s: float) -> None:
        await asyncio.gather(*(self.stop(rank, timeout_s) for rank in list(self._procs)))

    async def kill(self, rank: int) -> None:
        proc = self._procs.get(rank)
        if proc is not None and proc.poll() is None:
            log.warning("rank %d: SIGKILL to engine process %d", rank, proc.pid)
            proc.kill()

    def kill_now(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.error("engine process %d did not die after SIGKILL", proc.pid)
