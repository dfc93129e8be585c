"""`dpserve serve` on a port that is taken: a one-line error naming the flag, before anything is started."""

import os
import socket
import subprocess
import sys

import pytest

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
