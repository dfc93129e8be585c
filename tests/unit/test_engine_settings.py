"""The engine's settings: parser defaults come from the dataclasses; settings.py alone reads DPSERVE_*."""

import pathlib

import dpserve_engine
from dpserve_engine.settings import EngineConfig, ServiceSettings, build_parser, config_from_args, settings_from_args


def test_parser_defaults_are_the_dataclasses_defaults(monkeypatch):
    monkeypatch.delenv("DPSERVE_DEPLOYMENT_ID", raising=False)
    args = build_parser().parse_args(["--coordinator", "tcp://h:1"])
    assert config_from_args(args) == EngineConfig()
    assert settings_from_args(args) == ServiceSettings(coordinator_addr="tcp://h:1", adaptive_threads=True)


def test_environment_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("DPSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DPSERVE_ENFORCE_EAGER", "0")
    monkeypatch.setenv("DPSERVE_DEPLOYMENT_ID", "dep-x")
    assert EngineConfig().cache_dir == str(tmp_path) and not EngineConfig().enforce_eager
    args = build_parser().parse_args(["--coordinator", "tcp://h:1"])
    assert args.deployment_id == "dep-x" and config_from_args(args).cache_dir == str(tmp_path)
    monkeypatch.setenv("DPSERVE_ENFORCE_EAGER", "1")
    assert EngineConfig().enforce_eager and build_parser().parse_args(["--coordinator", "tcp://h:1"]).enforce_eager


def test_only_settings_reads_dpserve_variables():
    package = pathlib.Path(dpserve_engine.__file__).parent
    readers = sorted(p.name for p in package.glob("*.py") if "DPSERVE_" in p.read_text())
    assert readers == ["settings.py"]
