"""Mixture-of-experts weights without downloads: the upcycled SmolLM2 and a seeded random Mixtral checkpoint.

Both produce Mixtral's tensor names (`model.layers.{i}.block_sparse_moe.gate.weight`,
`model.layers.{i}.block_sparse_moe.experts.{j}.w1/w2/w3.weight`, w1 = gate, w3 = up, w2 = down), which
`Transformer.load_weights` reads (model.py) and `loader.load_hf_dir` loads from a directory.

- `upcycle(args, dense_state, spec)`: each of E experts a copy of the dense MLP (`--model smollm2-moe[:E]`,
  model_files.UpcycleSpec). Renormalized top-k weights sum to 1, so with unperturbed experts the MoE model computes
  the dense model whatever the router picks: an oracle for the expert-parallel path. With `noise` each expert is
  perturbed (seeded by seed, layer, expert and matrix, so a rank holding a subset of the experts builds exactly
  the same ones as a rank holding all), and routing changes the output.
- `write_random_mixtral(dir)`: a small random checkpoint directory in Hugging Face's layout (config.json with
  model_type "mixtral", model.safetensors, and the bundled SmolLM2 tokenizer as tokenizer.json +
  tokenizer_config.json, so it serves through the same tokenizer path as any HF directory). For tests.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

import torch
from torch import Tensor

from dpserve_engine.model import ModelArgs
from dpserve_engine.model_files import DEFAULT_MODEL, UpcycleSpec

StateDict = dict[str, Tensor]
_DENSE_TO_EXPERT = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def _generator(*key: int) -> torch.Generator:
    """A generator seeded by a tuple of small ints (seed, layer, expert, matrix): one stream per tensor."""
    seed = 0
    for k in key:
        seed = (seed * 1_000_003 + k) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)


def upcycle(args: ModelArgs, dense: StateDict, spec: UpcycleSpec,
            expert_ids: Sequence[int] | None = None) -> tuple[ModelArgs, StateDict]:  # fmt: skip
    """A dense fp32 state dict (loader.py's HF names) -> an MoE model's args and Mixtral-named state dict with the
    experts `expert_ids` (default: all). Unperturbed experts share the dense tensors (the model copies them)."""
    moe_args = dataclasses.replace(args, num_experts=spec.num_experts, num_experts_per_tok=spec.top_k)
    held = range(spec.num_experts) if expert_ids is None else expert_ids
    state = {k: v for k, v in dense.items() if ".mlp." not in k}
    for i in range(args.n_layers):
        moe = f"model.layers.{i}.block_sparse_moe."
        if spec.router == "zero":
            state[moe + "gate.weight"] = torch.zeros(spec.num_experts, args.dim)
        else:
            router = torch.randn(spec.num_experts, args.dim, generator=_generator(spec.seed, i))
            state[moe + "gate.weight"] = router * args.dim**-0.5
        for m, (dense_name, expert_name) in enumerate(_DENSE_TO_EXPERT.items()):
            w = dense[f"model.layers.{i}.mlp.{dense_name}.weight"].float()
            rms = w.pow(2).mean().sqrt()
            for j in held:
                if spec.noise:
                    noise = torch.randn(w.shape, generator=_generator(spec.seed, i, j, m))
                    state[f"{moe}experts.{j}.{expert_name}.weight"] = w + noise * (spec.noise * rms)
                else:
                    state[f"{moe}experts.{j}.{expert_name}.weight"] = w
    return moe_args, state


def random_mixtral_state(args: ModelArgs, seed: int = 0) -> StateDict:
    """Seeded random weights of a Mixtral-style model (Mixtral names), scaled 1/sqrt(fan-in); norms 1."""
    if not args.is_moe:
        raise ValueError("random_mixtral_state needs ModelArgs with num_experts > 0")
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * shape[-1] ** -0.5  # noqa: E731
    hd, state = args.head_dim, {}
    state["model.embed_tokens.weight"] = rand(args.vocab_size, args.dim)
    if not args.tie_embeddings:
        state["lm_head.weight"] = rand(args.vocab_size, args.dim)
    state["model.norm.weight"] = torch.ones(args.dim)
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        state[p + "self_attn.q_proj.weight"] = rand(args.n_heads * hd, args.dim)
        state[p + "self_attn.k_proj.weight"] = rand(args.n_kv_heads * hd, args.dim)
        state[p + "self_attn.v_proj.weight"] = rand(args.n_kv_heads * hd, args.dim)
        state[p + "self_attn.o_proj.weight"] = rand(args.dim, args.n_heads * hd)
        state[p + "input_layernorm.weight"] = torch.ones(args.dim)
        state[p + "post_attention_layernorm.weight"] = torch.ones(args.dim)
        moe = p + "block_sparse_moe."
        state[moe + "gate.weight"] = rand(args.num_experts, args.dim) * 4  # logits ~ N(0, 16): decisive routing
        for j in range(args.num_experts):
            state[f"{moe}experts.{j}.w1.weight"] = rand(args.ffn_dim, args.dim)
            state[f"{moe}experts.{j}.w3.weight"] = rand(args.ffn_dim, args.dim)
            state[f"{moe}experts.{j}.w2.weight"] = rand(args.dim, args.ffn_dim)
    return state


def mixtral_config(args: ModelArgs, eos_token_ids: list[int], bos_token_id: int | None) -> dict:
    """config.json of a Mixtral model with these args (the keys loader.load_hf_dir reads, and HF's names)."""
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "num_local_experts": args.num_experts,
        "num_experts_per_tok": args.num_experts_per_tok,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "sliding_window": None,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_ids,
        "torch_dtype": "float32",
    }


def write_random_mixtral(
    out_dir: str, *, dim: int = 64, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2, ffn_dim: int = 96,
    num_experts: int = 4, top_k: int = 2, max_seq_len: int = 1024, seed: int = 0,
    tokenizer_model: str = DEFAULT_MODEL, cache_dir: str | None = None,
) -> ModelArgs:
    """Write a seeded random Mixtral checkpoint directory with `tokenizer_model`'s tokenizer (default: the bundled
    SmolLM2's, vocabulary 49152); returns its ModelArgs. `cache_dir`: where that tokenizer's ModelInfo is cached."""
    from safetensors.torch import save_file

    from dpserve_engine.model_info import load_model_info
    from dpserve_engine.settings import EngineConfig

    config = EngineConfig(model=tokenizer_model, **({"cache_dir": cache_dir} if cache_dir else {}))
    info = load_model_info(config)
    args = ModelArgs(vocab_size=info.vocab_size, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                     ffn_dim=ffn_dim, max_seq_len=max_seq_len, tie_embeddings=False, num_experts=num_experts,
                     num_experts_per_tok=top_k)  # fmt: skip
    os.makedirs(out_dir, exist_ok=True)
    save_file(random_mixtral_state(args, seed), os.path.join(out_dir, "model.safetensors"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_seq_len,
        "add_bos_token": info.add_bos_token,
        "bos_token": info.bos_token,
        "eos_token": info.eos_token,
        "chat_template": info.chat_template,
    }
    files = {
        "config.json": json.dumps(mixtral_config(args, list(info.eos_token_ids), info.bos_token_id), indent=2),
        "tokenizer.json": info.tokenizer_json,
        "tokenizer_config.json": json.dumps({k: v for k, v in tokenizer_config.items() if v is not None}, indent=2),
    }
    for name, text in files.items():
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            f.write(text)
    return args
