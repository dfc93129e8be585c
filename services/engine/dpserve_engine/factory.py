"""Builds the engine core a config asks for: the real EngineCore or the null engine."""

from __future__ import annotations

from dpserve_engine.interface import EngineCoreBase
from dpserve_engine.model_info import load_model_info
from dpserve_engine.settings import EngineConfig


def build_engine_core(config: EngineConfig) -> EngineCoreBase:
    if config.null_engine:
        from dpserve_engine.null_core import NullEngineCore

        return NullEngineCore(
            load_model_info(config), step_time_s=config.null_step_time_s, max_num_seqs=config.max_num_seqs,
            max_queue_time_s=config.max_queue_time_s, block_size=config.block_size,
            grammar_compile_timeout_s=config.grammar_compile_timeout_s,
            num_kv_blocks=config.num_kv_blocks or 4096, enable_prefix_caching=config.enable_prefix_caching,
            prefill_time_per_token_s=config.null_prefill_time_per_token_s,
        )
    from dpserve_engine.core import EngineCore  # imports torch: only when a real model is asked for

    return EngineCore(config)
