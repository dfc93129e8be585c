"""The decode step as a torch.compile (inductor) graph: `Transformer.decode` over the paged KV cache.

Why: at batch 1 a decode step is ~1000 small ops, and eager PyTorch spends ~40% of the step dispatching them
(docs/benchmarks.md). Compiled, the norms, RoPE, cache writes and activations become a few fused C++ loops
between the int4 matmul calls and the attention op: ~30-40% less time per step at batch 1 and 16 here.

One graph for every step size, compiled twice. Two sizes change from step to step: the number of decodes D and
the block-table width nb. Both are dynamic dimensions of the graph; inputs are padded to at least 2 rows and 2
blocks (padding rows write to and read from a scratch block of the KV cache), so neither is ever the 0 or 1 that
torch specializes on. The two compiles differ only in how their fused kernels (norms, RoPE, cache writes,
activations) use threads: steps of up to `serial_max_rows` rows run a graph whose fused kernels are plain loops,
larger steps one whose kernels are OpenMP regions. A step of a few rows has ~150 such kernels of a few hundred
elements each, and entering and leaving a parallel region with its barriers costs more than the work (~0.3-0.6
ms a step at batch 1 here, paired); at batch 64 the parallel kernels are ~3 % faster on two threads, and more
with more cores. Both give a row the same bits (each row's reductions run on one thread either way), and every
decode row of every step goes through one of them, which keeps a request's tokens independent of its batch
(model_runner.py runs prefill rows through the eager forward beside them). They are compiled by `warm_up()` at
start-up, so no request waits; a call that would need another graph is refused (`fail_on_recompile`) and that
step runs eagerly (`num_fallbacks`; none is expected).

Padding rows cost nothing in the matmuls: the int4 matmuls, most of a small step's time, run on the first
`num_rows` rows only (the real decodes) and give zeros for the rest. The row count is read inside the graph from
a computed tensor (`capture_scalar_outputs`), which makes it an unbacked size: torch cannot specialize the graph
on its value, so batch 1 (two rows, one computed) runs the same graph as batch 64. torch's int4 kernel gives a
row the same bits whatever the number of rows, so this keeps the tokens batch-invariant (asserted in the tests).

Attention is one op of the engine's own (kernels.py, built before the compile): it reads each sequence's K/V in
place in the paged cache, where a gather would copy them padded to the longest sequence (~1.1x faster at batch
16, ~1.6x at 64).

The graph runs behind inductor's C++ wrapper (`cpp_wrapper`): one Python call per step instead of ~11 Python
kernel calls per layer, ~0.7-0.9 ms less per step at batch 1 and ~1.4 ms at batch 16 here. Its kernels and entry
point are built separately (`cpp_wrapper_build_separate`), which keeps a cold compile as fast as without it.

Guards: dynamo's guards on the model's ~400 parameters and submodules cost ~1.4 ms a call; they are skipped
(`skip_guard_on_all_nn_modules_unsafe`): the weights and modules never change once loaded. So are the guards on
58 of the 60 KV cache tensors and their pairwise identity checks (~0.2 ms; the runner always passes the same
list; the first layer's two keep the graph tied to the cache's shape and dtype),
and the global-state guard, which holds the thread count: the engine changes that with load, and a guard on it
turned every step after a change into an eager fallback. The inputs' guards (shapes, dtypes) stay, for the
guarded call.

Steps skip even those: once compiled, `DirectCall` calls the graph's C++ entry point with the flat input list
it recorded at warm-up (~0.9 ms less per step at batch 1, paired). The guarded call stays for what the direct
call cannot take (fewer rows or blocks than the minimum), and for all steps if the recording fails. The flat
list is short because the weights come in stacked (`LayerStacks`: one tensor per name for all 30 layers).

Numerics: fused kernels sum in another order than eager PyTorch, so logits differ in the last bits and a
near-tied greedy choice can differ from the eager path's (measured: as close to the fp32 reference as eager
int4 is; docs/benchmarks.md).

Cost: the first compile of the two graphs takes minutes on a small machine; inductor caches what it builds
under `<cache_dir>/inductor` (settings.export_inductor_cache_dir sets TORCHINDUCTOR_CACHE_DIR unless it is set),
but a cache hit still costs dynamo's tracing of the model, tens of seconds a graph. So once traced, the step is
saved (precompiled.py) and later starts load it without tracing, in about a second. `--enforce-eager` skips all of
this. Only on CPU: the CUDA path has not been run here.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from dpserve_engine import kernels, precompiled
from dpserve_engine.direct_call import DirectCall, DirectCallUnavailable
from dpserve_engine.model import DecodeInputs, Transformer
from dpserve_engine.quantized import GroupedHead, GroupedLinear

logger = logging.getLogger(__name__)


# Identities of Python objects that never change in an engine (modules, functions, classes, closures, the
# globals the step reads): guards on them cannot be saved with a precompiled step, and need not be checked
_IDENTITY_GUARDS = ("DICT_VERSION", "NN_MODULE", "ID_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "MODULE_MATCH",
                    "CLOSURE_MATCH", "WEAKREF_ALIVE")  # fmt: skip
# DirectCall reads torch internals (CompiledFxGraph, the C++ wrapper's calling convention): tried only on the torch
# versions it was checked on; on others the steps take torch.compile's guarded call
DIRECT_CALL_TORCH = ("2.13.",)
_UNCHECKED_GUARDS = ("GLOBAL_STATE", "DUPLICATE_INPUT", *_IDENTITY_GUARDS)


def _guard_filter(entries: list) -> list[bool]:
    """Keep the inputs' guards; drop the modules' (fixed once loaded), all but the first layer's of the KV caches
    (one layer's shape and dtype tie the graph to the cache geometry; the other 58 tensors and their pairwise
    checks cost ~0.2 ms a call) and GLOBAL_STATE, whose thread count the engine changes with load (threads.py;
    the kernels read it at run time) and whose grad/autocast modes never change here (always inference mode)."""
    keep = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    return [
        k and e.guard_type not in _UNCHECKED_GUARDS
        and (not e.name.startswith("kv_caches[") or e.name.startswith("kv_caches[0]"))
        for k, e in zip(keep, entries)
    ]


class LayerStacks:
    """The decode step's per-layer tensors as one [n_layers, ...] tensor per name, and the step as a function of
    them (`decode`), which takes each layer's tensor as a view of its stack inside the graph.

    Why: every tensor the graph reads is one of its flat inputs, and each input costs on every call (a tensor
    handle made and freed, a size check). Read from the modules, the weights alone are ~300 inputs; stacked, ~10
    (of ~80 in all with the KV caches): ~0.6 ms less per step at batch 1 here (paired). The modules' own tensors
    are made views of the stacks, so the eager path reads the same memory and nothing is held twice. Tensors that
    only the prefill path reads (a module's `prefill_only` names) are left alone.
    """

    def __init__(self, model: Transformer):
        self._module = _DecodeModule(model)
        self.stacks: list[Tensor] = []
        self.where: dict[str, tuple[int, int]] = {}  # name in the model -> (stack, layer)
        groups: dict[str, list[tuple[nn.Module, str, str]]] = {}
        for name, module in model.named_modules():
            parts = name.split(".")
            if len(parts) < 2 or parts[0] != "layers":
                continue
            skip = getattr(module, "prefill_only", ())
            for attr, tensor in [*module._parameters.items(), *module._buffers.items()]:
                if tensor is not None and attr not in skip:
                    key = ".".join(parts[2:] + [attr])  # the name without the layer index
                    groups.setdefault(key, []).append((module, attr, f"{name}.{attr}"))
        with torch.inference_mode(False), torch.no_grad():
            for members in groups.values():
                tensors = [getattr(module, attr) for module, attr, _ in members]
                if len(members) < 2 or any(t.shape != tensors[0].shape or t.dtype != tensors[0].dtype for t in tensors):
                    continue
                stack = torch.stack([t.detach() for t in tensors])
                for i, (module, attr, full_name) in enumerate(members):
                    if attr in module._parameters:
                        module._parameters[attr] = nn.Parameter(stack[i], requires_grad=False)
                    else:
                        module._buffers[attr] = stack[i]
                    self.where[f"model.{full_name}"] = (len(self.stacks), i)  # as _DecodeModule names it
                self.stacks.append(stack)

    def decode(self, inputs: DecodeInputs, kv_caches: list[tuple[Tensor, Tensor]], stacks: list[Tensor]) -> Tensor:
        tensors = {name: stacks[s][i] for name, (s, i) in self.where.items()}
        return torch.func.functional_call(self._module, tensors, (inputs, kv_caches), strict=False)


class _DecodeModule(nn.Module):
    """`Transformer.decode` as a module's forward, which is what functional_call runs."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, inputs: DecodeInputs, kv_caches: list[tuple[Tensor, Tensor]]) -> Tensor:
        return self.model.decode(inputs, kv_caches)


class _Graph:
    """One torch.compile of the decode step, and its direct call once warm_up() has recorded one."""

    def __init__(self, name: str, layers: LayerStacks, kv_caches: list[tuple[Tensor, Tensor]], options: dict):
        self.name = name
        self.kv_caches = kv_caches
        self.stacks = layers.stacks
        self.options = options
        self._fn = torch.compile(layers.decode, fullgraph=True, dynamic=False, options=options)
        self.direct: DirectCall | None = None
        self.traced = False  # False when loaded from a saved step (precompiled.py): no guarded call to fall back on
        self.failed = False  # its guarded call raised once: its steps run eagerly from then on

    def __call__(self, inputs: DecodeInputs) -> Tensor:
        for t in (inputs.tokens, inputs.positions, inputs.slot_mapping, inputs.block_table):
            torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(inputs.block_table, 1)
        return self._fn(inputs, self.kv_caches, self.stacks)


# (counter group, name): inductor's FX graph cache, then AOTAutograd's cache, whose hit skips inductor entirely
_CACHE_COUNTERS = (("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
                   ("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss"),
                   ("aot_autograd", "autograd_cache_bypass"))  # fmt: skip


class CompiledDecode:
    # Inputs are padded to at least this many rows and blocks (see the module docstring)
    min_rows = 2
    min_blocks = 2
    # Steps of at most this many rows run the graph whose fused kernels are serial (see the module docstring)
    serial_max_rows = 8

    def __init__(self, model: Transformer, kv_caches: list[tuple[Tensor, Tensor]], cache_dir: str):
        # torch.ops.dpserve.paged_decode_attention, which Transformer.decode calls
        self.kernels_lib = kernels.load(cache_dir)
        self.cache_dir = cache_dir
        self.model, self.kv_caches = model, kv_caches

        # The number of real rows is read with .item() inside the graph (see the module docstring).
        torch._dynamo.config.capture_scalar_outputs = True
        options = {"guard_filter_fn": _guard_filter, "cpp_wrapper": True, "cpp_wrapper_build_separate": True}
        # Small steps: fused kernels without OpenMP regions (cpp.threads=1). Large steps: parallel kernels that
        # read the thread count at run time, since the engine changes it with load (threads.py).
        layers = LayerStacks(model)
        self.stacks = layers.stacks
        self.serial = _Graph("serial", layers, kv_caches, {**options, "cpp.threads": 1, "cpp.dynamic_threads": False})
        self.parallel = _Graph("parallel", layers, kv_caches, {**options, "cpp.dynamic_threads": True})
        self.num_calls = 0
        self.num_fallbacks = 0
        self.phase = "not started"  # what warm_up() is doing, for progress lines

    @property
    def graphs(self) -> tuple[_Graph, _Graph]:
        return self.serial, self.parallel

    def graph_for(self, rows: int) -> _Graph:
        return self.serial if rows <= self.serial_max_rows else self.parallel

    def named_tensors(self) -> tuple[dict[str, Tensor], set[str]]:
        """Every tensor a graph may take as an input, by a name that holds across processes; and which of them
        are weights (their bytes go into the saved step's key)."""
        named: dict[str, Tensor] = {f"stack.{i}": t for i, t in enumerate(self.stacks)}
        weights = set(named)
        for prefix, items in (("model.", self.model.named_parameters(remove_duplicate=False)),
                              ("model.", self.model.named_buffers(remove_duplicate=False))):  # fmt: skip
            for name, t in items:
                if t is not None and not name.startswith("layers."):  # layers' tensors: views of the stacks
                    named[prefix + name] = t
                    weights.add(prefix + name)
        for i, (k, v) in enumerate(self.kv_caches):
            named[f"kv.{i}.k"], named[f"kv.{i}.v"] = k, v
        return named, weights

    @staticmethod
    def _probe(direct: DirectCall, prepare: Callable) -> str:
        """The digest of a direct call's output for the probe's scratch-only input."""
        rows, blocks = precompiled.PROBE_SHAPE
        return precompiled.digest(direct(prepare(rows, blocks), rows, blocks))

    def _saved_step(self) -> precompiled.SavedStep:
        named, weights = self.named_tensors()
        options = {g.name: {k: v for k, v in g.options.items() if k != "guard_filter_fn"} for g in self.graphs}
        options["shape"] = {"min_rows": self.min_rows, "min_blocks": self.min_blocks}
        # the kernel paths the step calls: "q4" and "q4q8" layers hold the same tensors, so the tensors alone
        # would let one path's saved step (its probe included) pass for the other's
        grouped = (m for m in self.model.modules() if isinstance(m, (GroupedLinear, GroupedHead)))
        options["kernel_paths"] = sorted({m.path for m in grouped})
        key = precompiled.step_key(named, options, self.kernels_lib, weights)
        return precompiled.SavedStep(os.path.join(self.cache_dir, "decode"), key)

    def _load_saved(self, prepare: Callable) -> bool:
        """Set up the graphs' direct calls from a saved step without tracing; False (nothing changed) when there is
        none, caches are disabled, or it does not check out here (logged)."""
        if torch.compiler.config.force_disable_caches:
            return False
        started = time.monotonic()
        try:
            saved = self._saved_step()
            if not saved.exists():
                return False
            loaded = saved.load(self.named_tensors()[0])
            directs = {}
            for graph in self.graphs:
                fn, (template, tensor_slots, row_slots, block_slots), want = loaded[graph.name]
                directs[graph.name] = DirectCall(fn, template, tensor_slots, row_slots, block_slots)
                if self._probe(directs[graph.name], prepare) != want:
                    raise precompiled.Unusable(f"the {graph.name} graph's probe differs from the saved one")
        except Exception as e:  # noqa: BLE001 - whatever it is, tracing still works
            logger.warning("the saved decode step in %s is not usable (%s: %s); tracing instead",
                           os.path.join(self.cache_dir, "decode"), type(e).__name__, e)  # fmt: skip
            return False
        for graph in self.graphs:
            graph.direct = directs[graph.name]
        logger.info("decode step loaded in %.1f s from %s (no tracing)", time.monotonic() - started, saved.dir)
        return True

    def _save(self, prepare: Callable) -> None:
        """After a traced warm-up that set up every graph's direct call: save what they call, for later starts."""
        if torch.compiler.config.force_disable_caches:
            return
        try:
            saved = self._saved_step()
            if saved.exists():
                return
            names = {id(t): name for name, t in self.named_tensors()[0].items()}
            graphs, probes = {}, {}
            for graph in self.graphs:
                direct = graph.direct
                if direct is None or direct.output_code is None:
                    raise precompiled.Unusable(f"the {graph.name} graph has no direct call")
                code = direct.output_code
                if getattr(code, "frozen_param_names", None) or getattr(code, "torchbind_constants", None):
                    raise precompiled.Unusable(f"the {graph.name} graph carries frozen parameters or torchbind objects")
                constants = precompiled.constants_to_json(getattr(code, "constants", None) or {})
                entries = precompiled.describe(direct._template, direct._tensor_slots, direct._row_slots,
                                               direct._block_slots, names)  # fmt: skip
                graphs[graph.name] = (code.source_code, entries, constants)
                probes[graph.name] = self._probe(direct, prepare)
            saved.save(graphs, probes)
            logger.info("decode step saved in %s: later starts load it without tracing", saved.dir)
        except Exception as e:  # noqa: BLE001 - the step works; only the next start's shortcut is lost
            logger.warning("could not save the decode step for later starts (%s: %s)", type(e).__name__, e)

    def warm_up(self, prepare: Callable[[int, int], DecodeInputs]) -> None:
        """Set up both graphs: from a saved step (precompiled.py) when there is one; else compile them (or load
        their code from inductor's cache), on padding rows only (they touch only the scratch block), set up
        their direct calls and save the step. `prepare(rows, blocks)` gives such inputs."""
        self.phase = "loading the saved step"
        if self._load_saved(prepare):
            return
        from torch._dynamo.utils import counters

        started = time.monotonic()
        logger.info("preparing the compiled decode step: tracing two graphs, their code from inductor's cache when "
                    "it has them (else compiled: one to three minutes on 2 cores)")
        before = {k: counters[k[0]][k[1]] for k in _CACHE_COUNTERS}
        for graph in self.graphs:
            self.phase = f"tracing and compiling the {graph.name} graph (or loading it from inductor's cache)"
            graph(prepare(self.min_rows, self.min_blocks))
        self.phase = "checking the direct calls"
        seen = [counters[k[0]][k[1]] - before[k] for k in _CACHE_COUNTERS]
        how = "compiled" if seen[1] or seen[3] else "loaded from the cache (nothing compiled)"
        logger.info("decode step %s in %.1f s (inductor cache: %d hits, %d misses; AOT autograd cache: %d hits, %d "
                    "misses, %d bypasses)", how, time.monotonic() - started, *seen)  # fmt: skip
        for graph in self.graphs:
            graph.traced = True
        if not torch.__version__.startswith(DIRECT_CALL_TORCH):
            logger.warning("decode step: no direct call on torch %s (it reads torch internals, checked on %s); steps "
                           "go through torch.compile's guards", torch.__version__, " ".join(DIRECT_CALL_TORCH))
            return
        for graph in self.graphs:
            try:
                graph.direct = DirectCall.capture(lambda inputs: self._guarded_call(inputs, graph), prepare)
            except Exception as e:  # noqa: BLE001 - DirectCallUnavailable, or torch internals not as expected
                why = str(e) if isinstance(e, DirectCallUnavailable) else f"{type(e).__name__}: {e}"
                logger.warning("decode step (%s graph): no direct call (%s); its steps go through torch.compile's "
                               "guards", graph.name, why)
        self._save(prepare)

    def __call__(self, inputs: DecodeInputs) -> Tensor | None:
        """Final hidden states [rows, dim], or None when these inputs have no compiled graph (run eagerly)."""
        self.num_calls += 1
        rows, blocks = inputs.block_table.shape
        graph = self.graph_for(rows)
        if graph.direct is not None and rows >= self.min_rows and blocks >= self.min_blocks:
            try:
                return graph.direct(inputs, rows, blocks)
            except Exception as e:  # noqa: BLE001 - serve on: this graph's steps take the guarded call from now on
                graph.direct = None
                logger.warning("decode step (%s graph): the direct call failed (%s: %s); its steps go through "
                               "torch.compile's guards from now on", graph.name, type(e).__name__, e)  # fmt: skip
                return None  # this step runs eagerly (it may have written K/V: the eager step writes the same)
        return self._guarded_call(inputs, graph)

    def _guarded_call(self, inputs: DecodeInputs, graph: _Graph) -> Tensor | None:
        """torch.compile's own call (dynamo's guards, then the graph), for a graph without a direct call; None
        (this step runs eagerly) for inputs outside what the graphs were compiled for, which would need another
        graph (compiling one would stall the step for seconds: `fail_on_recompile` refuses it), and for a graph
        that was loaded, not traced, or whose call has failed before."""
        rows, blocks = inputs.block_table.shape
        if not graph.traced or graph.failed or rows < self.min_rows or blocks < self.min_blocks:
            self.num_fallbacks += 1
            if self.num_fallbacks == 1:
                logger.warning("a decode step of shape %s has no compiled graph to run: running it eagerly",
                               (rows, blocks))  # fmt: skip
            return None
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return graph(inputs)
        except Exception as e:  # noqa: BLE001 - a refused recompile or a failing graph: serve on, eagerly
            graph.failed = True
            self.num_fallbacks += 1
            logger.warning("decode step (%s graph): the compiled call failed (%s: %s); its steps run eagerly from "
                           "now on", graph.name, type(e).__name__, str(e).splitlines()[0] if str(e) else "")  # fmt: skip
            return None
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return graph(inputs)
        except RuntimeError as e:  # the stance's refusal is a plain RuntimeError
            if "recompile" not in str(e):
                raise
            self.num_fallbacks += 1
            if self.num_fallbacks == 1:
                logger.warning("a decode step of shape %s has no compiled graph: running it eagerly",
                               tuple(inputs.block_table.shape))
            return None
