"""The wave protocol's state machines live in the shared package (engines and frontends use them too)."""

from dpserve_shared.waves import CoordinatorWaves, EngineWaves, FrontendWaves

__all__ = ["CoordinatorWaves", "EngineWaves", "FrontendWaves"]
