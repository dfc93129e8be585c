"""Weights from a GGUF file or a Hugging Face Llama-family directory -> (ModelArgs, HF-named fp32 state dict).

GGUF weights are dequantized to fp32 once and cached under `config.cache_dir` (torch.save); later starts
memory-map the cache (tens of ms instead of seconds). GGUF stores attn_q/attn_k rows permuted for llama.cpp's
interleaved RoPE; they are un-permuted here to the HF rotate_half order, so the model has one RoPE.

Mixture of experts: a Mixtral directory (config.json model_type "mixtral" / MixtralForCausalLM) or
'smollm2-moe[:E]' (the bundled GGUF, upcycled by moe_weights.py) gives Mixtral-named experts; with `expert_ids`
only those experts' tensors are read (safetensors are opened lazily, tensor by tensor) or built.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Sequence

import numpy as np
import torch

from dpserve_engine.gguf_metadata import check_architecture, read_gguf
from dpserve_engine.hf_config import check_hf_config, hf_model_type
from dpserve_engine.model import ModelArgs
from dpserve_engine.model_files import ModelFilesNotFound, parse_upcycled, resolve_model_path
from dpserve_engine.moe import checked_expert_ids
from dpserve_engine.moe_weights import upcycle

logger = logging.getLogger(__name__)

_CACHE_VERSION = 2
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


def load_weights(model: str, cache_dir: str, quantization: str | None = None,
                 expert_ids: Sequence[int] | None = None) -> tuple[ModelArgs, StateDict]:  # fmt: skip
    """quantization="int4": 4-bit linear weights (Q4_0, Q4_1, Q4_K) stay as groups (`.qweight`, `.scales`, `.mins`).
    expert_ids: of an MoE model, the experts to load (default: all); an error for a dense model."""
    if quantization not in (None, "int4"):
        raise ValueError(f"quantization must be None or 'int4', got {quantization!r}")
    path = resolve_model_path(model)
    spec = parse_upcycled(model)
    if spec is not None:
        if quantization:
            raise ValueError(f"{model}: the MoE model runs dequantized weights; use --quantization none (or auto)")
        args, dense = load_gguf_cached(path, cache_dir, None)
        logger.info("upcycling %s: %d experts (copies of the dense MLP%s), top-%d, router %s", path,
                    spec.num_experts, f", noise {spec.noise:g}, seed {spec.seed}" if spec.noise else "", spec.top_k,
                    spec.router)  # fmt: skip
        return upcycle(args, dense, spec, _checked_experts(expert_ids, spec.num_experts, model))
    if os.path.isdir(path):
        if quantization:
            raise ValueError(f"quantization={quantization!r} needs a GGUF file with 4-bit (Q4_0, Q4_1, Q4_K) weights; "
                             f"{path} is a directory")
        return load_hf_dir(path, expert_ids)
    if expert_ids is not None:
        raise ValueError(f"expert_ids given for {path}, a dense model")
    return load_gguf_cached(path, cache_dir, quantization)


def is_moe_model(model: str) -> bool:
    """Whether `model` is a mixture-of-experts model (the upcycled SmolLM2, a Mixtral directory); reads no weights."""
    if parse_upcycled(model) is not None:
        return True
    path = resolve_model_path(model)
    if not os.path.isdir(path):
        return False  # GGUF: llama only
    with open(os.path.join(path, "config.json")) as f:
        return bool(_moe_args(json.load(f), path))


def _checked_experts(expert_ids: Sequence[int] | None, num_experts: int, model: str) -> list[int] | None:
    if expert_ids is None:
        return None
    try:
        return checked_expert_ids(expert_ids, num_experts)  # [] is fine: no expert's tensors at all
    except ValueError as e:
        raise ValueError(f"{model}: {e}") from None


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
    d, m = _fp16(groups, 0), _fp16(groups, 2)
    return torch.from_numpy(_nibbles(groups[..., 4:], raw.shape[0])), torch.from_numpy(d), torch.from_numpy(m)


def q4_0_groups(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0 tensor's bytes [N, K/32 * 18] -> q, d, m as q4_1_groups gives them: w = d * (q - 8) = d * q + (-8 d).

    Each 18-byte group: d (fp16), 16 bytes of nibbles in Q4_1's order. d * q and 8 d are exact in fp32 (an fp16
    times a 4-bit integer), so the repacked weights are gguf's dequantized ones bit for bit."""
    groups = np.asarray(raw).reshape(raw.shape[0], -1, 18)
    d = _fp16(groups, 0)
    return torch.from_numpy(_nibbles(groups[..., 2:], raw.shape[0])), torch.from_numpy(d), torch.from_numpy(-8.0 * d)


def q4_k_groups(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_K tensor's bytes [N, K/256 * 144] -> q, d, m per 32-group: w = (d sc) q - dmin m = d' q + m'.

    Each 144-byte super-block: d, dmin (fp16), 12 bytes of eight 6-bit (sc, m) pairs (gguf's get_scale_min), 128
    bytes of nibbles: 64 weights per 32 bytes, the low nibbles first. d sc and dmin m are exact in fp32, so
    d' = d sc and m' = -(dmin m) give gguf's dequantized weights bit for bit."""
    import gguf

    blocks = np.asarray(raw).reshape(-1, 144)
    d, dmin = _fp16(blocks, 0)[:, None], _fp16(blocks, 2)[:, None]  # [B, 1]
    sc, mins = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [B, 8] each
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(raw.shape[0], -1)
    scale = (d * sc.astype(np.float32)).reshape(raw.shape[0], -1)
    offset = -(dmin * mins.astype(np.float32)).reshape(raw.shape[0], -1)
    return torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(scale), torch.from_numpy(offset)


def q8_0_groups(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's bytes [N, K/32 * 34] -> q [N, K] int8 and d [N, K/32] fp32; w = d * q (exact in fp32)."""
    groups = np.asarray(raw).reshape(raw.shape[0], -1, 34)
    d = _fp16(groups, 0)
    q = groups[..., 2:].copy().view(np.int8).reshape(raw.shape[0], -1)
    return torch.from_numpy(q), torch.from_numpy(d)


def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of each block (the last axis), as fp32: [..., block bytes] -> [...]."""
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray, rows: int) -> np.ndarray:
    """[N, G, 16] bytes -> [N, G * 32] weights 0..15: a group's low nibbles are its weights 0..15, high 16..31."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)


def four_bit_groups(t) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A GGUF tensor of a 4-bit type the grouped kernels run (Q4_0, Q4_1, Q4_K) as (q, d, m); None for the others."""
    import gguf

    reader = {gguf.GGMLQuantizationType.Q4_0: q4_0_groups, gguf.GGMLQuantizationType.Q4_1: q4_1_groups,
              gguf.GGMLQuantizationType.Q4_K: q4_k_groups}.get(t.tensor_type)  # fmt: skip
    return None if reader is None else reader(t.data)


def load_gguf(path: str, quantization: str | None = None) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    import gguf

    started = time.perf_counter()
    logger.info("reading %s", path)
    meta, tensor_list = read_gguf(path)

    def field(key, default=None):
        return meta.get(key, default)

    arch = check_architecture(meta, path)
    n_heads = int(field(f"{arch}.attention.head_count"))
    n_kv_heads = int(field(f"{arch}.attention.head_count_kv", n_heads))
    tensors = {t.name: t for t in tensor_list}
    if "rope_freqs.weight" in tensors:  # Llama 3.1+: per-frequency factors, the llama3 rope scaling
        raise ValueError(f"{path}: rope_freqs.weight (llama3 rope scaling) is not supported yet (plain RoPE only)")
    scaling = field(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none") and float(field(f"{arch}.rope.scaling.factor", 1.0)) != 1.0:
        raise ValueError(f"{path}: {arch}.rope.scaling.type {scaling!r} is not supported yet (plain RoPE only)")
    head_dim = int(field(f"{arch}.embedding_length")) // n_heads
    for key in ("key_length", "value_length"):
        if int(field(f"{arch}.attention.{key}", head_dim)) != head_dim:
            raise ValueError(f"{path}: {arch}.attention.{key} {field(f'{arch}.attention.{key}')} is not "
                             f"embedding_length / head_count = {head_dim} (not supported)")  # fmt: skip
    rotary = int(field(f"{arch}.rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise ValueError(f"{path}: {arch}.rope.dimension_count {rotary} is not the head size {head_dim} "
                         "(partial rotary is not supported)")  # fmt: skip
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
    kinds: dict[tuple[str, str], int] = {}  # (GGUF type, what it became) -> tensors
    for name, t in tensors.items():
        hf_name = _hf_name(name)
        grouped = quantization == "int4" and name.startswith("blk.")
        groups = four_bit_groups(t) if grouped else None
        base = hf_name.removesuffix(".weight")
        if groups is not None:
            state[base + ".qweight"], state[base + ".scales"], state[base + ".mins"] = groups
            became = "4-bit groups for the grouped kernels"
        elif grouped and t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            state[base + ".q8weight"], state[base + ".q8scales"] = q8_0_groups(t.data)
            became = "int8 groups for the grouped kernel"
        else:
            # dequantize returns (out, in) = nn.Linear layout; copy: F32 tensors come back as read-only memmaps
            data = gguf.quants.dequantize(t.data, t.tensor_type)
            state[hf_name] = torch.from_numpy(np.array(data, dtype=np.float32, copy=True))
            became = "fp32" if t.tensor_type == gguf.GGMLQuantizationType.F32 else "dequantized to fp32"
        kinds[t.tensor_type.name, became] = kinds.get((t.tensor_type.name, became), 0) + 1
    logger.info("%s: GGUF tensor types: %s", os.path.basename(path),
                "; ".join(f"{kind} x{n} -> {became}" for (kind, became), n in sorted(kinds.items())))
    for i in range(args.n_layers):
        for proj, heads in (("q_proj", n_heads), ("k_proj", n_kv_heads)):
            base = f"model.layers.{i}.self_attn.{proj}"
            for suffix in (".weight", ".qweight", ".scales", ".mins", ".q8weight", ".q8scales"):
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
    parts = gguf_name.split(".", 3)  # blk.N.attn_q.weight
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _GGUF_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} is not one the llama model reads (known: token_embd, output_norm, "
                         f"output, blk.N.{{{','.join(_GGUF_NAMES)}}})")  # fmt: skip
    _, layer, kind, suffix = parts
    return f"model.layers.{layer}.{_GGUF_NAMES[kind]}.{suffix}"


_EXPERT_TENSOR = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.")


def is_mixtral(cfg: dict) -> bool:
    return hf_model_type(cfg) == "mixtral"


def _moe_args(cfg: dict, path: str) -> dict:
    """ModelArgs' MoE fields from a config.json: Mixtral's keys; other MoE families are refused by name."""
    if is_mixtral(cfg):
        return {"num_experts": int(cfg["num_local_experts"]), "num_experts_per_tok": int(cfg["num_experts_per_tok"])}
    if cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"):
        raise ValueError(f"{path}: MoE model_type {cfg.get('model_type')!r} is not supported (only 'mixtral')")
    return {}


def load_hf_dir(path: str, expert_ids: Sequence[int] | None = None) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """config.json + *.safetensors of a Llama-family model (Llama, Qwen2, SmolLM, Mistral without sliding window)
    or of Mixtral. expert_ids: of a Mixtral model, the experts to read (the others' tensors are never read)."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelFilesNotFound(f"model directory {path} has no *.safetensors files")
    attention = check_hf_config(cfg, path)
    moe = _moe_args(cfg, path)
    if expert_ids is not None and not moe:
        raise ValueError(f"expert_ids given for {path}, a dense model")
    held = _checked_experts(expert_ids, moe.get("num_experts", 0), path)
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
        rope_theta=attention.rope_theta,
        max_seq_len=attention.context_length or 4096,
        tie_embeddings=cfg.get("tie_word_embeddings", False),
        qkv_bias=cfg.get("attention_bias", hf_model_type(cfg) == "qwen2"),
        **moe,
    )
    started = time.perf_counter()
    wanted = None if held is None else set(held)
    state = _read_safetensors(files, lambda name: wanted is None or _expert_of(name) in (None, *wanted))
    required = ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight"]
    if args.is_moe:
        required += ["model.layers.0.block_sparse_moe.gate.weight"]
        required += [f"model.layers.0.block_sparse_moe.experts.{j}.w{n}.weight"
                     for j in (range(args.num_experts) if held is None else held) for n in (1, 2, 3)]  # fmt: skip
    missing = [k for k in required if k not in state]
    if not args.tie_embeddings and "lm_head.weight" not in state:
        args.tie_embeddings = True  # some checkpoints omit the flag but share the embedding
    if missing:
        raise ModelFilesNotFound(f"{path}: safetensors lack {', '.join(missing)} (not a Llama-family checkpoint?)")
    logger.info("loaded %d tensors in %.1f s%s", len(state), time.perf_counter() - started,
                f" ({args.num_experts} experts, top-{args.num_experts_per_tok}; held here: "
                f"{'all' if held is None else held})" if args.is_moe else "")  # fmt: skip
    return args, state  # bf16 or fp32 as stored; the model copies into its own dtypes


def _expert_of(name: str) -> int | None:
    """The expert a Mixtral tensor belongs to (None: not an expert's)."""
    m = _EXPERT_TENSOR.search(name)
    return int(m.group(1)) if m else None


def _read_safetensors(files: list[str], wanted) -> StateDict:
    """The tensors named `wanted(name)` of the files; the others are not read (safetensors maps each lazily)."""
    from safetensors import safe_open

    state = {}
    for f in files:
        logger.info("reading %s", f)
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                if wanted(name):
                    state[name] = st.get_tensor(name)
    return state
