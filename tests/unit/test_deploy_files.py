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
    env = dict(os.environ, RAY_AUTH_TOKEN="test-token")
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
