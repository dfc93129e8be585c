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


def test_admission_and_shutdown_flags():
    base = ["--coordinator", "tcp://h:1"]
    settings = settings_from_args(base)
    assert (settings.max_num_queued_requests, settings.max_num_queued_tokens) == (None, None)
    assert settings.shutdown_timeout_s == 30.0
    settings = settings_from_args([*base, "--max-num-queued-requests", "4", "--max-num-queued-tokens", "2048",
                                   "--shutdown-timeout", "0"])
    assert (settings.max_num_queued_requests, settings.max_num_queued_tokens) == (4, 2048)
    assert settings.shutdown_timeout_s == 0.0
    # vLLM's spelling of the request cap, and the frontend's old name of the shutdown timeout
    settings = settings_from_args([*base, "--max-num-queued-reqs", "3", "--drain-timeout", "12"])
    assert (settings.max_num_queued_requests, settings.shutdown_timeout_s) == (3, 12.0)
    for bad in (["--max-num-queued-requests", "0"], ["--max-num-queued-tokens", "-1"], ["--shutdown-timeout", "-1"]):
        with pytest.raises(SystemExit):
            settings_from_args([*base, *bad])
