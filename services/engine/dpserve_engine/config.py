"""An alias kept for importers outside the engine package (tests/conftest.py, tests/unit/test_cli_serve.py): the
settings live in settings.py."""

from dpserve_engine.model_files import DEFAULT_MODEL
from dpserve_engine.settings import EngineConfig

__all__ = ["DEFAULT_MODEL", "EngineConfig"]
