"""The model's tokenizer and chat template, exported as data (ModelInfo) for frontends.

Frontends have no model files and no torch: they get `tokenizer_json` (tokenizers' serialization), the chat
template and the special ids from the engines, through the coordinator. This module builds that data from a
GGUF file's metadata (no weights are read) or from a Hugging Face directory (found by model_files.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import msgspec

from dpserve_shared.schema import ModelInfo

from dpserve_engine.gguf_metadata import check_architecture, read_gguf_metadata
from dpserve_engine.gguf_tokenizer import build_gguf_tokenizer
from dpserve_engine.hf_config import check_hf_config
from dpserve_engine.model_files import (
    DEFAULT_MODEL_SERVED_NAME,
    is_default_model,
    parse_upcycled,
    resolve_model_path,
)
from dpserve_engine.settings import EngineConfig

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 4096


def _default_max_len(context_length: int | None, config: EngineConfig) -> int:
    if config.max_model_len is not None:
        if context_length and config.max_model_len > context_length:
            raise ValueError(
                f"--max-model-len {config.max_model_len} exceeds the model's context length {context_length}"
            )
        return config.max_model_len
    return min(context_length or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN)


def model_info_from_gguf(path: str, config: EngineConfig) -> ModelInfo:
    """ModelInfo with max_model_len = the model's full context length (load_model_info applies the cap)."""
    meta = read_gguf_metadata(path)
    arch = check_architecture(meta, path)  # the loader checks too; here it is said before anything else is read
    tokenizer = build_gguf_tokenizer(meta)
    tokens = meta.get("tokenizer.ggml.tokens")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = [int(eos)] if eos is not None else []
    # <|endoftext|> also ends generation for SmolLM2-style vocabularies.
    if tokens and tokens[0] == "<|endoftext|>" and 0 not in eos_ids:
        eos_ids.append(0)
    name = config.served_model_name or _default_served_name(config.model, path)
    return ModelInfo(
        name=name,
        root=path,
        max_model_len=int(meta.get(f"{arch}.context_length") or DEFAULT_MAX_MODEL_LEN),
        vocab_size=len(tokens),
        tokenizer_json=tokenizer.to_str(),
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
        bos_token=tokens[int(bos)] if bos is not None else None,
        eos_token=tokens[int(eos)] if eos is not None else None,
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token") or False),
    )


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def model_info_from_hf_dir(path: str, config: EngineConfig) -> ModelInfo:
    from tokenizers import Tokenizer

    with open(os.path.join(path, "config.json")) as f:
        model_config = json.load(f)
    with open(os.path.join(path, "tokenizer.json"), encoding="utf-8") as f:
        tokenizer_json = f.read()
    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer_config = {}
    tc_path = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(tc_path):
        with open(tc_path) as f:
            tokenizer_config = json.load(f)
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    bos_token = _token_text(tokenizer_config.get("bos_token"))
    eos_token = _token_text(tokenizer_config.get("eos_token"))
    eos_ids = model_config.get("eos_token_id")
    eos_ids = eos_ids if isinstance(eos_ids, list) else ([eos_ids] if eos_ids is not None else [])
    if not eos_ids and eos_token is not None and tokenizer.token_to_id(eos_token) is not None:
        eos_ids = [tokenizer.token_to_id(eos_token)]
    bos_id = model_config.get("bos_token_id")
    return ModelInfo(
        name=config.served_model_name or _default_served_name(config.model, path),
        root=path,
        max_model_len=_default_max_len(check_hf_config(model_config, path).context_length, config),
        vocab_size=int(model_config.get("vocab_size") or tokenizer.get_vocab_size()),
        tokenizer_json=tokenizer_json,
        chat_template=template,
        bos_token_id=bos_id,
        eos_token_ids=[int(i) for i in eos_ids],
        bos_token=bos_token,
        eos_token=eos_token,
        add_bos_token=bool(tokenizer_config.get("add_bos_token", False)),
    )


def _default_served_name(model: str, path: str) -> str:
    upcycled = parse_upcycled(model)
    if upcycled is not None:
        return upcycled.served_name  # e.g. SmolLM2-135M-Instruct-MoE-4x-top2
    return DEFAULT_MODEL_SERVED_NAME if is_default_model(model) else model


def load_model_info(config: EngineConfig) -> ModelInfo:
    """ModelInfo for `config.model` without loading any weights.

    Parsing a GGUF's ~100k-string vocabulary takes seconds, so the result is cached on disk next to the
    weight cache, keyed by the file's path, size and mtime; served name and max_model_len are applied after.
    """
    path = resolve_model_path(config.model)
    if os.path.isdir(path):
        return model_info_from_hf_dir(path, config)
    stat = os.stat(path)
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|v2".encode()).hexdigest()[:24]
    cache_path = os.path.join(config.cache_dir, f"model-info-{key}.json")
    try:
        with open(cache_path, "rb") as f:
            info = msgspec.json.decode(f.read(), type=ModelInfo)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        log.info("reading tokenizer and chat template from %s", path)
        info = model_info_from_gguf(path, config)
        try:
            os.makedirs(config.cache_dir, exist_ok=True)
            tmp = f"{cache_path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(msgspec.json.encode(info))
            os.replace(tmp, cache_path)
        except OSError as e:
            log.warning("could not cache model info in %s: %s", config.cache_dir, e)
    return msgspec.structs.replace(
        info,
        name=config.served_model_name or _default_served_name(config.model, path),
        max_model_len=_default_max_len(info.max_model_len, config),
    )
