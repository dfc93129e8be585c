"""Weights from a GGUF file or a Hugging Face Llama-family directory -> (ModelArgs, HF-named fp32 state dict).

GGUF weights are dequantized to fp32 once and cached under `config.cache_dir` (torch.save); later starts
memory-map the cache (tens of ms instead of seconds). GGUF stores attn_q/attn_k rows permuted for llama.cpp's
interleaved RoPE; they are un-permuted here to the HF rotate_half order, so the model has one RoPE.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import time

import numpy as np
import torch

from dpserve_engine.model import ModelArgs
from dpserve_engine.model_files import ModelFilesNotFound, resolve_model_path

logger = logging.getLogger(__name__)

_CACHE_VERSION = 1
_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


StateDict = dict[str, torch.Tensor]


def load_weights(model: str, cache_dir: str, quantization: str | None = None) -> tuple[ModelArgs, StateDict]:
    """quantization="int4": Q4_1 linear weights stay as their GGUF groups (`.qweight`, `.scales`, `.mins`)."""
    if quantization not in (None, "int4"):
        raise ValueError(f"quantization must be None or 'int4', got {quantization!r}")
    path = resolve_model_path(model)
    if os.path.isdir(path):
        if quantization:
            raise ValueError(f"quantization={quantization!r} needs a GGUF file with Q4_1 weights; {path} is a directory")
        return load_hf_dir(path)
    return load_gguf_cached(path, cache_dir, quantization)


def load_gguf_cached(path: str, cache_dir: str, quantization: str | None = None) -> tuple[ModelArgs, StateDict]:
    stat = os.stat(path)
    tag = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{_CACHE_VERSION}|{quantization}"
    key = hashlib.sha256(tag.encode()).hexdigest()[:24]
    cache_path = os.path.join(cache_dir, f"weights-{os.path.basename(path)}-{quantization or 'fp32'}-{key}.pt")
    if os.path.isfile(cache_path):
        started = time.perf_counter()
        cached = torch.load(cache_path, mmap=True, weights_only=True)
        logger.info("loaded cached weights %s in %.2f s", cache_path, time.perf_counter() - started)
        return ModelArgs(**cached["args"]), cached["state"]
    args, state = load_gguf(path, quantization)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{cache_path}.{os.getpid()}.tmp"
        torch.save({"args": dataclasses.asdict(args), "state": state}, tmp)
        os.replace(tmp, cache_path)
        logger.info("cached dequantized weights in %s", cache_path)
    except OSError as e:
        logger.warning("could not cache weights in %s: %s", cache_dir, e)
    return args, state


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's interleaved-RoPE row order -> HF rotate_half order. w: [n_heads * hd, in]."""
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).transpose(1, 2).reshape(out, inp)


def q4_1_groups(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1 tensor's bytes [N, K/32 * 20] -> q [N, K] uint8 (0..15), d and m [N, K/32] fp32; w = d * q + m.

    Each 20-byte group: d (fp16), m (fp16), 16 bytes of nibbles: low nibbles are weights 0..15, high 16..31.
    """
    groups = np.asarray(raw).reshape(raw.shape[0], -1, 20)
    d = groups[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = groups[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = groups[..., 4:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(raw.shape[0], -1)
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m)


def load_gguf(path: str, quantization: str | None = None) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    import gguf

    started = time.perf_counter()
    logger.info("reading %s", path)
    reader = gguf.GGUFReader(path)

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture", "llama")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    n_heads = int(field(f"{arch}.attention.head_count"))
    n_kv_heads = int(field(f"{arch}.attention.head_count_kv", n_heads))
    tensors = {t.name: t for t in reader.tensors}
    args = ModelArgs(
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),
        dim=int(field(f"{arch}.embedding_length")),
        n_layers=int(field(f"{arch}.block_count")),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=int(field(f"{arch}.feed_forward_length")),
        norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        max_seq_len=int(field(f"{arch}.context_length", 4096)),
        tie_embeddings="output.weight" not in tensors,
    )
    state = {}
    for name, t in tensors.items():
        hf_name = _hf_name(name)
        if quantization == "int4" and t.tensor_type == gguf.GGMLQuantizationType.Q4_1 and name.startswith("blk."):
            base = hf_name.removesuffix(".weight")
            state[base + ".qweight"], state[base + ".scales"], state[base + ".mins"] = q4_1_groups(t.data)
            continue
        # dequantize returns (out, in) = nn.Linear layout; copy: F32 tensors come back as read-only memmaps
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32, copy=True))
        state[hf_name] = w
    for i in range(args.n_layers):
        for proj, heads in (("q_proj", n_heads), ("k_proj", n_kv_heads)):
            base = f"model.layers.{i}.self_attn.{proj}"
            for suffix in (".weight", ".qweight", ".scales", ".mins"):
                if base + suffix in state:  # rows are output features: permute each per-row tensor alike
                    state[base + suffix] = _unpermute(state[base + suffix], heads)
    logger.info("dequantized %d tensors in %.1f s", len(state), time.perf_counter() - started)
    return args, state


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    _, layer, kind, suffix = gguf_name.split(".", 3)  # blk.N.attn_q.weight
    return f"model.layers.{layer}.{_GGUF_NAMES[kind]}.{suffix}"


def load_hf_dir(path: str) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """config.json + *.safetensors of a Llama-family model (Llama, Qwen2, SmolLM, Mistral without sliding window)."""
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelFilesNotFound(f"model directory {path} has no *.safetensors files")
    if cfg.get("rope_scaling"):
        logger.warning("%s: rope_scaling %s is ignored (plain RoPE is used)", path, cfg["rope_scaling"])
    n_heads = cfg["num_attention_heads"]
    args = ModelArgs(
        vocab_size=cfg["vocab_size"],
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads", n_heads),
        ffn_dim=cfg["intermediate_size"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=cfg.get("rope_theta", 10000.0),
        max_seq_len=cfg.get("max_position_embeddings", 4096),
        tie_embeddings=cfg.get("tie_word_embeddings", False),
        qkv_bias=cfg.get("attention_bias", cfg.get("model_type") == "qwen2"),
    )
    started = time.perf_counter()
    state = {}
    for f in files:
        logger.info("reading %s", f)
        state.update(load_file(f))
    required = ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight")
    missing = [k for k in required if k not in state]
    if not args.tie_embeddings and "lm_head.weight" not in state:
        args.tie_embeddings = True  # some checkpoints omit the flag but share the embedding
    if missing:
        raise ModelFilesNotFound(f"{path}: safetensors lack {', '.join(missing)} (not a Llama-family checkpoint?)")
    logger.info("loaded %d tensors in %.1f s", len(state), time.perf_counter() - started)
    return args, state  # bf16 or fp32 as stored; the model copies into its own dtypes
