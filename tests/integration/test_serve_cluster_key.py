"""`dpserve serve` with CURVE: a key made for the run reaches every child through the environment only (no command
line, no log line shows it), a raw ZMQ peer without it gets nothing from the served coordinator, `dpserve scale`
works with it (from the environment) and refuses to start without it; `--insecure-zmq` serves as before."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest
import zmq

from dpserve_shared.envelope import frames
from dpserve_shared.schema import ScaleRequest
from dpserve_shared.zmq_security import CLUSTER_KEY_ENV, ZmqSecurity, run_key_path
from tests.conftest import DPSERVE, descendants, start_serve, stop_serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _scale(rpc_port: int, size: int, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([DPSERVE, "scale", "-dp", str(size), "--data-parallel-rpc-port", str(rpc_port),
                           "--timeout-s", "120"], capture_output=True, text=True, timeout=180, env=env)  # fmt: skip


def test_serve_makes_a_key_that_no_command_line_or_log_line_shows(tmp_path, monkeypatch):
    monkeypatch.delenv(CLUSTER_KEY_ENV)  # start_serve's child inherits the environment: no key given
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))  # where it keeps its key for `dpserve scale`
    server = start_serve(backend="mp", data_parallel_size=1, api_server_count=1, null_engine=True,
                         log_dir=str(tmp_path))  # fmt: skip
    key_file = run_key_path(f"tcp://127.0.0.1:{server.rpc_port}")
    try:
        children = server.record_descendants()
        coordinator = next(pid for pid, cmd in children.items() if "dpserve_coordinator.main" in cmd)
        key = _environ(coordinator)[CLUSTER_KEY_ENV]
        security = ZmqSecurity.from_cluster_key(key)
        engines = [pid for pid, cmd in children.items() if "dpserve_engine.service" in cmd]
        assert engines and all(_environ(pid)[CLUSTER_KEY_ENV] == key for pid in engines)

        # A raw DEALER without the key: its ScaleRequest gets no answer.
        ctx = zmq.Context()
        try:
            raw = ctx.socket(zmq.DEALER)
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(f"tcp://127.0.0.1:{server.rpc_port}")
            raw.send_multipart(frames("", ScaleRequest(2)))
            assert not raw.poll(1500)
        finally:
            ctx.destroy(0)

        # `dpserve scale` on this host, as this user, finds the key in the file serve keeps (mode 600, dir 700);
        # with another key it gets no answer; without the file and the key it refuses to start, naming the ways.
        assert key_file.startswith(str(tmp_path / "run"))
        assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(key_file)).st_mode) == 0o700
        no_env = {k: v for k, v in os.environ.items() if k != CLUSTER_KEY_ENV}
        wrong = _scale(server.rpc_port, 2, dict(no_env, **{CLUSTER_KEY_ENV: "0" * 64}))
        assert wrong.returncode == 1 and "no answer" in wrong.stdout, wrong.stdout + wrong.stderr
        no_key = _scale(server.rpc_port, 2, dict(no_env, XDG_RUNTIME_DIR=str(tmp_path / "elsewhere")))
        assert no_key.returncode == 2 and CLUSTER_KEY_ENV in no_key.stdout, no_key.stdout + no_key.stderr
        scaled = _scale(server.rpc_port, 2, no_env)
        assert scaled.returncode == 0, scaled.stdout + scaled.stderr

        everything = dict(server.seen)
        everything.update(descendants(server.proc.pid))
        secrets = (key, security.secret_key.decode(), security.public_key.decode())
        for pid, cmdline in everything.items():
            assert not any(s in cmdline for s in secrets), f"pid {pid} shows the key on its command line"
        log = server.log() + scaled.stdout + scaled.stderr
        assert not any(s in log for s in secrets), "the key is in the log"
        assert f"fingerprint {security.fingerprint}" in log
        assert "refused a ZMQ connection to the control socket" in log
    finally:
        problems = stop_serve(server)
    assert not problems, problems
    assert not os.path.exists(key_file)  # gone with the deployment


def test_insecure_zmq_serves_with_a_warning_and_takes_a_plain_scale(tmp_path, monkeypatch):
    monkeypatch.delenv(CLUSTER_KEY_ENV)
    server = start_serve(backend="mp", data_parallel_size=1, api_server_count=1, null_engine=True,
                         extra_args=("--insecure-zmq",), log_dir=str(tmp_path))  # fmt: skip
    try:
        assert "NOT authenticated (--insecure-zmq)" in server.log()
        scaled = _scale(server.rpc_port, 2, dict(os.environ))
        assert scaled.returncode == 2  # `dpserve scale` wants a key unless told the deployment has none
        scaled = subprocess.run([DPSERVE, "scale", "-dp", "2", "--data-parallel-rpc-port", str(server.rpc_port),
                                 "--insecure-zmq", "--timeout-s", "120"], capture_output=True, text=True, timeout=180)
        assert scaled.returncode == 0, scaled.stdout + scaled.stderr
    finally:
        problems = stop_serve(server)
    assert not problems, problems
