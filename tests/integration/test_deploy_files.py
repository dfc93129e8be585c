"""docker-compose.yml validates, and every dpserve command it (or an image it builds) runs is a real console script."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _console_scripts() -> set[str]:
    scripts = set()
    for pyproject in ["pyproject.toml", *(f"services/{s}/pyproject.toml" for s in ("engine", "coordinator", "frontend"))]:
        with open(os.path.join(ROOT, pyproject), "rb") as f:
            scripts |= set(tomllib.load(f)["project"].get("scripts", {}))
    return scripts


def _compose_config() -> dict:
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose is not installed (Debian package docker-compose; `make system-deps` installs it)")
    env = dict(os.environ, RAY_AUTH_TOKEN="test-token", DPSERVE_CLUSTER_KEY="test-cluster-key")
    result = subprocess.run(
        ["docker-compose", "-f", os.path.join(ROOT, "docker-compose.yml"), "config"],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.mark.timeout(90)
def test_compose_config_is_valid_and_has_the_three_services():
    config = _compose_config()
    assert {"ray-head", "ray-worker", "frontend"} <= set(config["services"])
    for name, service in config["services"].items():
        assert "healthcheck" in service, f"{name} has no health check"
        dockerfile = os.path.join(ROOT, service["build"]["dockerfile"])
        assert os.path.isfile(dockerfile), dockerfile


@pytest.mark.timeout(90)
def test_every_dpserve_command_in_deploy_files_is_a_console_script():
    scripts = _console_scripts()
    config = _compose_config()
    texts = [" ".join(map(str, s.get("command") or [])) for s in config["services"].values()]
    for service in config["services"].values():
        with open(os.path.join(ROOT, service["build"]["dockerfile"])) as f:
            texts.append(f.read())
    for script in os.listdir(os.path.join(ROOT, "deploy")):
        with open(os.path.join(ROOT, "deploy", script)) as f:
            texts.append(f.read())
    used = set()
    for text in texts:
        used |= set(re.findall(r"\bdpserve(?:-[a-z]+)?\b", text))
    used -= {"dpserve"} if "dpserve" not in scripts else set()
    assert used, "no dpserve command found in the deploy files"
    missing = sorted(u for u in used if u.startswith("dpserve-") and u not in scripts)
    assert not missing, f"deploy files run commands that are not console scripts: {missing}"


@pytest.mark.timeout(90)
def test_the_engine_image_installs_cpu_torch_by_default():
    """PyPI's default torch is the multi-gigabyte CUDA build: compose passes the CPU index unless told otherwise."""
    config = _compose_config()
    assert config["services"]["ray-worker"]["build"]["args"]["TORCH_INDEX_URL"].endswith("/whl/cpu")
    with open(os.path.join(ROOT, "services", "engine", "Dockerfile")) as f:
        assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in f.read()


@pytest.mark.timeout(30)
def test_compose_up_without_a_token_says_so_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    (tmp_path / "docker-compose").write_text("#!/bin/sh\necho ran > \"$(dirname \"$0\")/ran\"\n")
    (tmp_path / "docker-compose").chmod(0o755)
    result = subprocess.run([os.path.join(ROOT, "deploy", "compose-up.sh")], capture_output=True, text=True, env=env)
    assert result.returncode == 2 and not (tmp_path / "ran").exists()
    assert len(result.stderr.strip().splitlines()) == 1 and "RAY_AUTH_TOKEN" in result.stderr


@pytest.mark.timeout(30)
def test_compose_up_without_a_cluster_key_says_so_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DPSERVE_CLUSTER_KEY"}
    env.update(RAY_AUTH_TOKEN="test-token", PATH=f"{tmp_path}:{os.environ['PATH']}")
    (tmp_path / "docker-compose").write_text("#!/bin/sh\necho ran > \"$(dirname \"$0\")/ran\"\n")
    (tmp_path / "docker-compose").chmod(0o755)
    result = subprocess.run([os.path.join(ROOT, "deploy", "compose-up.sh")], capture_output=True, text=True, env=env)
    assert result.returncode == 2 and not (tmp_path / "ran").exists()
    assert len(result.stderr.strip().splitlines()) == 1 and "DPSERVE_CLUSTER_KEY" in result.stderr


@pytest.mark.timeout(30)
def test_compose_gives_the_coordinator_and_the_frontends_the_cluster_key():
    config = _compose_config()
    for name in ("ray-head", "frontend"):
        assert config["services"][name]["environment"]["DPSERVE_CLUSTER_KEY"] == "test-cluster-key", name


@pytest.mark.timeout(60)
def test_ray_head_script_stops_ray_after_the_coordinator(tmp_path):
    """deploy/ray-head.sh: a stop signal reaches the coordinator, which drains and exits; then `ray stop` runs.
    `ray`, `hostname` and the coordinator are stand-ins on PATH that record what they were asked to do."""
    import signal
    import sys
    import time

    log = tmp_path / "log"
    fakes = {
        "hostname": "#!/bin/sh\necho 127.0.0.1\n",
        "ray": f"#!/bin/sh\necho \"ray $*\" >> {log}\n",
        "dpserve-coordinator": (
            f"#!{sys.executable}\nimport signal, sys, time\n"
            f"def stop(*_):\n    open({str(log)!r}, 'a').write('coordinator drained\\n'); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, stop)\n"
            f"open({str(log)!r}, 'a').write('coordinator started\\n')\n"
            "while True: time.sleep(0.1)\n"
        ),
    }
    for name, text in fakes.items():
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
    proc = subprocess.Popen(["sh", os.path.join(ROOT, "deploy", "ray-head.sh")], env=env)
    try:
        deadline = time.monotonic() + 30
        while "coordinator started" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline and proc.poll() is None, "the coordinator did not start"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = log.read_text().splitlines()
    assert lines[0].startswith("ray start --head")
    assert lines[1:] == ["coordinator started", "coordinator drained", "ray stop"]
