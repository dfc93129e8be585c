"""Write the served model's tokenizer as a Hugging Face tokenizer directory, for clients that want one (guidellm).

    python benchmarks/export_tokenizer.py OUT_DIR [--model smollm2]

`--model` takes what `dpserve serve --model` takes: 'smollm2' (the bundled GGUF, whose tokenizer lives in the GGUF
metadata), a .gguf file, or a Hugging Face directory. The tokenizer is the one dpserve's frontends use
(`dpserve_engine.model_info.load_model_info`): OUT_DIR gets tokenizer.json, tokenizer_config.json (chat template,
bos / eos tokens, model_max_length) and special_tokens_map.json, so that
`transformers.AutoTokenizer.from_pretrained(OUT_DIR)` encodes like dpserve (no model weights are read).
Run it with the project venv (`.venv/bin/python`); it needs only the standard library and dpserve_engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dpserve_engine.model_files import DEFAULT_MODEL
from dpserve_engine.model_info import load_model_info
from dpserve_engine.settings import EngineConfig


def _with_bos_post_processor(tokenizer: dict, bos_token: str, bos_id: int) -> dict:
    """dpserve prepends BOS itself when add_bos_token is set; a HF tokenizer needs a post-processor for that."""
    if tokenizer.get("post_processor") is not None:
        return tokenizer
    bos = {"SpecialToken": {"id": bos_token, "type_id": 0}}
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos_token: {"id": bos_token, "ids": [bos_id], "tokens": [bos_token]}},
    }
    return tokenizer


def export(out_dir: str, model: str = DEFAULT_MODEL) -> dict:
    """Write the three files into out_dir (created if needed); return the tokenizer_config written."""
    info = load_model_info(EngineConfig(model=model))
    tokenizer = json.loads(info.tokenizer_json)
    if info.add_bos_token and info.bos_token is not None and info.bos_token_id is not None:
        tokenizer = _with_bos_post_processor(tokenizer, info.bos_token, info.bos_token_id)

    specials = {}
    if info.bos_token is not None:
        specials["bos_token"] = info.bos_token
    if info.eos_token is not None:
        specials["eos_token"] = info.eos_token
    # No dedicated unk / pad token in SmolLM2-style vocabularies; clients that pad (guidellm does not) use eos.
    if info.eos_token is not None:
        specials["pad_token"] = info.eos_token
    added = [t["content"] for t in tokenizer.get("added_tokens", []) if t.get("special")]
    extra = [t for t in added if t not in specials.values()]

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": info.max_model_len,
        "add_bos_token": info.add_bos_token,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        **specials,
        "additional_special_tokens": extra,
        "chat_template": info.chat_template,
        "name_or_path": info.name,
    }
    if info.chat_template is None:
        del config["chat_template"]

    os.makedirs(out_dir, exist_ok=True)
    files = {
        "tokenizer.json": tokenizer,
        "tokenizer_config.json": config,
        "special_tokens_map.json": {**specials, "additional_special_tokens": extra},
    }
    for name, data in files.items():
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False, indent=2 if name != "tokenizer.json" else None)
            f.write("\n")
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="directory to write tokenizer.json, tokenizer_config.json, ...")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="'smollm2', a .gguf file or a HF directory")
    args = parser.parse_args(argv)
    config = export(args.out_dir, args.model)
    print(
        f"wrote {args.out_dir}: tokenizer of {config['name_or_path']} "
        f"(bos={config.get('bos_token')!r}, eos={config.get('eos_token')!r}, "
        f"model_max_length={config['model_max_length']})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
