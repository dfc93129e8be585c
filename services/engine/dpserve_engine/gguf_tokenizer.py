"""A GGUF file's tokenizer as a `tokenizers.Tokenizer` whose token ids equal llama.cpp's (src/llama-vocab.cpp):

- `tokenizer.ggml.model` "gpt2": byte-level BPE with the file's merges, split first by the regexes llama.cpp uses
  for the file's `tokenizer.ggml.pre` (PRE_TOKENIZERS; an unknown one is an error naming it).
- "llama": SentencePiece's BPE as llama.cpp runs it (llm_tokenizer_spm): the text's spaces as U+2581 (one in
  front when `add_space_prefix`), then, from single characters, the adjacent pair whose joined text is a token
  with the highest score merges first; a character no token holds becomes its UTF-8 bytes' <0xXX> tokens. That is
  BPE with one merge (a, b) per way of splitting each token into two tokens, ranked by the token's score, and
  byte fallback.

Control tokens are special (matched in the text, skipped on decode), user-defined ones are matched in the text too.
"""

from __future__ import annotations

_TOKEN_TYPE_NORMAL, _TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED = 1, 3, 4


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


def build_gguf_tokenizer(meta: dict):
    """The tokenizer of a GGUF file's metadata (gguf_metadata.read_gguf_metadata; module docstring); ValueError
    naming a `tokenizer.ggml.model` it is not built for."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("the GGUF file has no tokenizer.ggml.tokens")
    token_types = meta.get("tokenizer.ggml.token_type") or []
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(meta, tokens)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(meta, tokens, token_types)
    else:
        raise ValueError(f"unsupported GGUF tokenizer model tokenizer.ggml.model={kind!r} (supported: 'gpt2', a "
                         "byte-level BPE; 'llama', SentencePiece)")  # fmt: skip
    _add_special_tokens(tokenizer, tokens, token_types)
    return tokenizer


def _byte_level_bpe(meta: dict, tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models

    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise ValueError("GGUF tokenizer.ggml.model 'gpt2' without tokenizer.ggml.merges")
    vocab = {token: i for i, token in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(meta: dict, tokens: list[str], token_types: list[int]):
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise ValueError("GGUF tokenizer.ggml.model 'llama' without tokenizer.ggml.scores")
    vocab = {token: i for i, token in enumerate(tokens)}
    normal = [i for i, t in enumerate(token_types or [_TOKEN_TYPE_NORMAL] * len(tokens)) if t == _TOKEN_TYPE_NORMAL]
    merges = []  # (score, left id, right id): llama.cpp takes the best score first
    for i in normal:
        token = tokens[i]
        for cut in range(1, len(token)):
            left, right = vocab.get(token[:cut]), vocab.get(token[cut:])
            if left is not None and right is not None:
                merges.append((-scores[i], left, right))
    merges.sort()
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(vocab=vocab, merges=[(tokens[a], tokens[b]) for _, a, b in merges], byte_fallback=True,
                     unk_token=tokens[int(unk_id)] if unk_id is not None else None, fuse_unk=False)  # fmt: skip
    tokenizer = Tokenizer(bpe)
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix"))
    steps = [normalizers.Prepend("\u2581")] if space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence([*decode, decoders.Strip(" ", 1, 0)] if space_prefix else decode)
    return tokenizer


def _add_special_tokens(tokenizer, tokens: list[str], token_types: list[int]) -> None:
    from tokenizers import AddedToken

    specials = [tokens[i] for i, t in enumerate(token_types) if t == _TOKEN_TYPE_CONTROL]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    user = [tokens[i] for i, t in enumerate(token_types) if t == _TOKEN_TYPE_USER_DEFINED]
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
