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
_TOKEN_TYPE_CONTROL = 3


def _gguf_field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents()


# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp, llm_tokenizer_bpe), by `tokenizer.ggml.pre`; each splits
# the pieces the ones before it left, matches and the text between them alike
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")  # no `pre` (llama.cpp warns)
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"), (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen"), (_QWEN2,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
                    (r"\p{N}", _GPT2)),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "roberta-bpe"), (_GPT2,)),
    "default": _DEFAULT,
}


def gguf_pre_tokenizer(pre: str | None):
    """The `tokenizers` pre-tokenizer llama.cpp applies for `tokenizer.ggml.pre` (None: its default); ValueError
    naming a `pre` that is not in PRE_TOKENIZERS (a wrong split gives other token ids, silently)."""
    from tokenizers import Regex, pre_tokenizers

    regexes = PRE_TOKENIZERS.get("default" if pre is None else pre)
    if regexes is None:
        raise ValueError(f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r} (supported: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))})")  # fmt: skip
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def build_gguf_tokenizer(reader):
    """A `tokenizers.Tokenizer` equal to llama.cpp's for a byte-level BPE GGUF vocabulary (`tokenizer.ggml.model`
    gpt2: SmolLM2's, Llama 3's, Qwen2's), with the pre-tokenizer of its `tokenizer.ggml.pre`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    tokens = _gguf_field(reader, "tokenizer.ggml.tokens")
    merges = _gguf_field(reader, "tokenizer.ggml.merges")
    token_types = _gguf_field(reader, "tokenizer.ggml.token_type") or []
    kind = _gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2" or tokens is None or merges is None:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (only BPE 'gpt2' vocabularies are supported)")
    vocab = {token: i for i, token in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = gguf_pre_tokenizer(_gguf_field(reader, "tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, t in enumerate(token_types) if t == _TOKEN_TYPE_CONTROL]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tokenizer


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
    from gguf import GGUFReader

    reader = GGUFReader(path)
    tokenizer = build_gguf_tokenizer(reader)
    arch = _gguf_field(reader, "general.architecture") or "llama"
    tokens = _gguf_field(reader, "tokenizer.ggml.tokens")
    bos = _gguf_field(reader, "tokenizer.ggml.bos_token_id")
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    eos_ids = [int(eos)] if eos is not None else []
    # <|endoftext|> also ends generation for SmolLM2-style vocabularies.
    if tokens and tokens[0] == "<|endoftext|>" and 0 not in eos_ids:
        eos_ids.append(0)
    name = config.served_model_name or _default_served_name(config.model, path)
    return ModelInfo(
        name=name,
        root=path,
        max_model_len=int(_gguf_field(reader, f"{arch}.context_length") or DEFAULT_MAX_MODEL_LEN),
        vocab_size=len(tokens),
        tokenizer_json=tokenizer.to_str(),
        chat_template=_gguf_field(reader, "tokenizer.chat_template"),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
        bos_token=tokens[int(bos)] if bos is not None else None,
        eos_token=tokens[int(eos)] if eos is not None else None,
        add_bos_token=bool(_gguf_field(reader, "tokenizer.ggml.add_bos_token") or False),
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
