"""The compiled decode step saved beside inductor's cache, so that a warm start skips dynamo's tracing.

Why: even when inductor's cache has both graphs, torch.compile traces the model's Python again before it looks
them up: ~20 s a graph on 2 cores idle, over a minute each while the rank serves (the tracing thread and the
serving thread share the GIL and the cores), and ranks of a node take turns (the compile lock). Meanwhile steps
run eagerly, ~4 x slower at batch 1. What the steps actually call is small: the graph's generated module
(inductor's output code: Python source that loads the C++ entry point it built) and the flat input list that
`DirectCall` recorded. Both are saved once, after a traced warm-up, and a later start loads them in a second or two.

What is saved, under `<cache_dir>/decode/<key>/`: each graph's output code (`<graph>.py`) and `manifest.json`
with each graph's constants (small tensors the code reads as module attributes, e.g. lifted scalars), its flat
input list as names (`stack.3`, `kv.12.v`, `model.norm.weight`, an int, a field of the
step's inputs, the row or block count) and a probe: a digest of the graph's output for a fixed scratch-only input.

When it is used: the key covers everything the generated code depends on (torch and Python versions, the
engine's model and kernel sources, the C++ kernels' build, the compile options, and every tensor the graph may
take: name, shape, stride, dtype, and a sample of the weights' bytes). Loading checks the manifest, loads the
output code (inductor finds its C++ library in its own cache, or rebuilds it from the source it carries),
rebuilds the input list from the engine's own tensors, and runs the probe: the same digest or nothing is used.
Anything unexpected (a file missing, another torch, an input it cannot name, a different digest) means
"trace as before", with one log line saying why.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

FORMAT = 2  # 2: the output code's constants in the manifest
_SOURCES = ("model.py", "quantized.py", "compiled.py", "precompiled.py")  # what the traced step runs
PROBE_SHAPE = (4, 7)  # rows, blocks of the probe's scratch-only input (what DirectCall.capture checks with)


class Unusable(Exception):
    """The saved step cannot be used (or saved) here; the message says why."""


def _sample(t: Tensor) -> bytes:
    """A few KiB of a tensor's bytes (start, middle, end): enough to tell one model's weights from another's."""
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return b""
    k = min(n, 1024)
    parts = [flat[:k], flat[max(0, n // 2 - k // 2) : n // 2 + k // 2], flat[n - k :]]
    return b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in parts)


def step_key(tensors: dict[str, Tensor], options: dict[str, dict], kernels_lib: str, contents: set[str]) -> str:
    """The saved step's key. `tensors`: every tensor a graph may take, by name; `contents`: the names whose bytes
    are part of the key (the weights; not the KV caches, whose contents change)."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    parts = [f"format {FORMAT}", torch.__version__, sys.version.split()[0], os.path.basename(kernels_lib),
             json.dumps(options, sort_keys=True, default=str)]  # fmt: skip
    parts += [(here / name).read_text() for name in _SOURCES]
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name} {tuple(t.shape)} {t.stride()} {t.dtype} {t.storage_offset()} {t.device}\0".encode())
        if name in contents:
            h.update(_sample(t))
    return h.hexdigest()[:24]


def describe(template: list, tensor_slots, row_slots, block_slots, names: dict[int, str]) -> list:
    """DirectCall's flat input list as JSON: {"tensor": name} | {"int": v} | {"field": i} | {"rows": 1} | ..."""
    out: list = []
    fields = dict(tensor_slots)
    for i, x in enumerate(template):
        if i in fields:
            out.append({"field": fields[i]})
        elif i in row_slots:
            out.append({"rows": 1})
        elif i in block_slots:
            out.append({"blocks": 1})
        elif isinstance(x, Tensor):
            if id(x) not in names:
                raise Unusable(f"graph input {i} is a tensor the engine does not name")
            out.append({"tensor": names[id(x)]})
        elif type(x) is int:
            out.append({"int": x})
        else:
            raise Unusable(f"graph input {i} is a {type(x).__name__}")
    return out


def rebuild(entries: list, tensors: dict[str, Tensor]):
    """The inverse of describe(): (template, tensor_slots, row_slots, block_slots) over this engine's tensors."""
    template, tensor_slots, row_slots, block_slots = [], [], [], []
    for i, e in enumerate(entries):
        if "tensor" in e:
            if e["tensor"] not in tensors:
                raise Unusable(f"no tensor {e['tensor']!r} in this engine")
            template.append(tensors[e["tensor"]])
            continue
        template.append(e.get("int"))
        if "field" in e:
            tensor_slots.append((i, int(e["field"])))
        elif "rows" in e:
            row_slots.append(i)
        elif "blocks" in e:
            block_slots.append(i)
        elif type(e.get("int")) is not int:
            raise Unusable(f"graph input {i}: unknown entry {e!r}")
    return template, tensor_slots, row_slots, block_slots


_MAX_CONSTANT_ELEMENTS = 1 << 16  # inductor's constants here are scalars (120 int64 on the AVX-512 path)


def constants_to_json(constants: dict[str, Tensor]) -> dict[str, dict]:
    """The output code's own constants (module attributes it reads, e.g. scalar tensors it lifted), as JSON."""
    if sum(t.numel() for t in constants.values()) > _MAX_CONSTANT_ELEMENTS:
        raise Unusable(f"the graph's constants hold over {_MAX_CONSTANT_ELEMENTS} elements")
    out = {}
    for name, t in constants.items():
        if not isinstance(t, Tensor) or t.device.type != "cpu" or t.is_quantized:
            raise Unusable(f"constant {name} is not a plain CPU tensor")
        out[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "values": t.tolist()}
    return out


def constants_from_json(constants: dict[str, dict]) -> dict[str, Tensor]:
    out = {}
    for name, c in constants.items():
        dtype = getattr(torch, c["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise Unusable(f"constant {name}: unknown dtype {c['dtype']!r}")
        out[name] = torch.tensor(c["values"], dtype=dtype).reshape(c["shape"])
    return out


def digest(out: Tensor) -> str:
    return hashlib.sha256(out.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class SavedStep:
    """`<root>/<key>/`: save() after a traced warm-up, load() instead of one."""

    def __init__(self, root: str | os.PathLike, key: str):
        self.dir = Path(root) / key

    def exists(self) -> bool:
        return (self.dir / "manifest.json").is_file()

    def save(self, graphs: dict[str, tuple[str, list, dict]], probes: dict[str, str]) -> None:
        """graphs: name -> (output code source, described inputs, its constants as JSON); probes: name -> digest.
        Written to a temporary directory and renamed, so a reader sees all of it or none."""
        self.dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".saving-", dir=self.dir.parent))
        try:
            manifest = {"format": FORMAT, "torch": torch.__version__, "graphs": {}}
            for name, (source, entries, constants) in graphs.items():
                (tmp / f"{name}.py").write_text(source)
                manifest["graphs"][name] = {"source": f"{name}.py", "inputs": entries, "probe": probes[name],
                                            "constants": constants}  # fmt: skip
            (tmp / "manifest.json").write_text(json.dumps(manifest))
            try:
                os.rename(tmp, self.dir)
            except OSError:  # another rank saved it first: theirs is as good
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def load(self, tensors: dict[str, Tensor]) -> dict[str, tuple[Callable, tuple, str]]:
        """name -> (the output code's entry, the rebuilt input list (template and slots), the probe's digest)."""
        try:
            manifest = json.loads((self.dir / "manifest.json").read_text())
        except (OSError, ValueError) as e:
            raise Unusable(f"manifest: {e}") from e
        if manifest.get("format") != FORMAT or manifest.get("torch") != torch.__version__:
            raise Unusable(f"saved for format {manifest.get('format')} / torch {manifest.get('torch')}")
        from torch._inductor.codecache import PyCodeCache

        loaded = {}
        for name, g in manifest["graphs"].items():
            source = (self.dir / g["source"]).read_text()
            module = PyCodeCache.load(source)
            for attr, value in constants_from_json(g.get("constants", {})).items():
                setattr(module, attr, value)  # as inductor attaches them when it loads the code itself
            loaded[name] = (module.call, rebuild(g["inputs"], tensors), g["probe"])
        return loaded
