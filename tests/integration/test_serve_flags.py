"""`dpserve serve` on a port that is taken: a one-line error naming the flag, before anything is started."""

import os
import shutil
import socket
import subprocess
import sys

import pytest

from dpserve_shared.net import free_port

DPSERVE = os.path.join(os.path.dirname(sys.executable), "dpserve")


@pytest.mark.timeout(60)
def test_serve_on_a_busy_port_fails_at_once_and_starts_nothing():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([DPSERVE, "serve", "--host", "127.0.0.1", "--port", str(port), "--null-engine"],
                              capture_output=True, text=True, timeout=50)  # fmt: skip
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last == f"dpserve serve: error: --port {port}: 127.0.0.1:{port} is already in use by another process"
    assert "starting" not in done.stderr and "Ray" not in done.stderr  # nothing was started


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _ray_temp_dir_of(serve_pid: int) -> str | None:
    """The temp dir of the local Ray instance `dpserve serve` started (`ray start --head --temp-dir ...`)."""
    from tests.conftest import descendants

    for pid in descendants(serve_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
        except OSError:
            continue
        if "--head" in argv and "--temp-dir" in argv:
            return argv[argv.index("--temp-dir") + 1]
    return None


# While Ray itself starts (`ray start --head` runs), and once the coordinator starts the ranks.
_MOMENTS = {"while Ray starts": None, "while ranks start": r"Ray connected in"}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("moment", list(_MOMENTS))
def test_sigint_during_start_up_stops_everything_and_removes_rays_temp_dir(tmp_path, moment):
    """Ctrl-C while Ray and the ranks start: dpserve exits promptly, no process of the deployment is left, and the
    local Ray instance's temp dir (which dpserve serve makes) is gone."""
    import re
    import signal
    import time

    port, rpc_port = free_port(), free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([DPSERVE, "serve", "--host", "127.0.0.1", "--port", str(port), "-dp", "1",
                                 "--data-parallel-rpc-port", str(rpc_port), "--null-engine"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        pattern = _MOMENTS[moment]
        while not (re.search(pattern, log_path.read_text()) if pattern else _ray_temp_dir_of(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.05)
        temp_dir = _ray_temp_dir_of(proc.pid)
        assert temp_dir is not None and temp_dir.startswith("/tmp/dpray-")
        proc.send_signal(signal.SIGINT)
        # A bound on liveness, not a timing: a stop that waits for a rank's start-up or a drain would take 20-35 s
        assert proc.wait(timeout=15) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:  # the test failed: leave nothing behind either
            leftover = _ray_temp_dir_of(proc.pid)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if leftover:
                shutil.rmtree(leftover, ignore_errors=True)
    deadline = time.monotonic() + 10  # the last Ray processes may take a moment to be reaped
    left = lambda: _processes_mentioning(f":{rpc_port}") + _processes_mentioning(temp_dir)  # noqa: E731 - Ray's too
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left() == []
    assert not os.path.exists(temp_dir)
    assert "actor dpserve-engine" not in log_path.read_text() or moment != "while Ray starts"  # nothing started
