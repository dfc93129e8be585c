"""What a Hugging Face config.json asks of the model, checked before anything is loaded.

The model code (model.py) computes Llama's block: RMSNorm, plain RoPE over the whole head in rotate_half order,
SiLU-gated MLP, optional q/k/v bias, full causal attention; Mixtral's experts on top. A config that asks for more
(another model_type, a rope scaling, another activation, MLP biases) is refused here with its name, never served as
a near miss: Qwen3's q/k norms or Gemma 2's softcaps dropped give plausible text and wrong logits. transformers 5
moved `rope_theta` and the scaling into `rope_parameters`; both shapes are read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral")  # what model.py computes exactly, given the checks below
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "MixtralForCausalLM": "mixtral"}  # fmt: skip  # read when an old config.json has no model_type


@dataclasses.dataclass(frozen=True)
class HfAttention:
    rope_theta: float
    context_length: int | None  # max_position_embeddings, capped at the sliding window when one is in use


def hf_model_type(cfg: dict[str, Any]) -> str | None:
    """The config's model_type, or for an old config.json without one, that of its first known architecture."""
    if cfg.get("model_type") is not None:
        return cfg["model_type"]
    known = [ARCHITECTURES[a] for a in cfg.get("architectures") or [] if a in ARCHITECTURES]
    return known[0] if known else None


def check_hf_config(cfg: dict[str, Any], path: str) -> HfAttention:
    """The RoPE base and usable context of a config.json the model computes exactly; ValueError naming the
    model_type or option it does not."""
    model_type = hf_model_type(cfg)
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{path}: model_type {cfg.get('model_type')!r} (architectures {cfg.get('architectures')}) "
                         f"is not supported (supported: {', '.join(MODEL_TYPES)}; GGUF files: 'llama')")  # fmt: skip
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{path}: hidden_act {act!r} is not supported (only 'silu')")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{path}: mlp_bias true is not supported (MLP layers without bias only)")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{path}: partial_rotary_factor {cfg['partial_rotary_factor']} is not supported "
                         "(RoPE over the whole head only)")  # fmt: skip
    theta = cfg.get("rope_theta")
    params = cfg.get("rope_parameters")  # transformers 5: {"rope_type": ..., "rope_theta": ..., scaling fields}
    if params is not None:
        if not isinstance(params, dict) or ("rope_type" not in params and "rope_theta" not in params):
            raise ValueError(f"{path}: rope_parameters {params!r} is not supported (one plain RoPE for every layer)")
        _check_rope_type(params, "rope_parameters", path)
        theta = params.get("rope_theta", theta)
    if cfg.get("rope_scaling") is not None:
        _check_rope_type(cfg["rope_scaling"], "rope_scaling", path)
    context = cfg.get("max_position_embeddings")
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", True) and (context is None or window < context):
        context = int(window)  # within the window, sliding-window attention is full attention: exact
    return HfAttention(rope_theta=float(theta if theta is not None else 10000.0), context_length=context)


def _check_rope_type(scaling: Any, key: str, path: str) -> None:
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
    if kind not in (None, "default"):
        raise ValueError(f"{path}: {key} of type {kind!r} is not supported yet (plain RoPE only): {scaling!r}")
