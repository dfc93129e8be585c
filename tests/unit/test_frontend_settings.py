"""The frontend's command line: one frozen settings object; the API key from the flag or DPSERVE_API_KEY."""

import dataclasses

import pytest

from dpserve_frontend.settings import settings_from_args

pytestmark = pytest.mark.timeout(10)


def test_flags_and_api_key_from_env(monkeypatch):
    monkeypatch.setenv("DPSERVE_API_KEY", "from-env")
    settings = settings_from_args(["--coordinator", "tcp://10.0.0.1:5555", "--port", "9000", "--frontend-id", "fe-x"])
    assert settings.coordinator_addr == "tcp://10.0.0.1:5555" and settings.port == 9000
    assert settings.frontend_id == "fe-x" and settings.api_key == "from-env"
    assert "from-env" not in repr(settings)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.port = 1
    assert settings_from_args(["--coordinator", "tcp://h:1", "--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("DPSERVE_API_KEY")
    assert settings_from_args(["--coordinator", "tcp://h:1"]).api_key is None


def test_bad_flags_exit_with_a_message():
    with pytest.raises(SystemExit, match="tcp://HOST:PORT"):
        settings_from_args(["--coordinator", "localhost:5555"])
    with pytest.raises(SystemExit):
        settings_from_args([])
