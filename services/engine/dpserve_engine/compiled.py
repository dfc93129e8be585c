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

Cost: the first compile of the two graphs takes one to three minutes on 2 cores (97 s measured); inductor caches
what it builds under `<cache_dir>/inductor` (core.py sets TORCHINDUCTOR_CACHE_DIR unless it is set) and later
starts take seconds. `--enforce-eager` skips all of this. Only on CPU: the CUDA path has not been run here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from dpserve_engine import kernels
from dpserve_engine.model import DecodeInputs, Transformer

logger = logging.getLogger(__name__)


# Identities of Python objects that never change in an engine (modules, functions, classes, closures, the
# globals the step reads): guards on them cannot be saved with a precompiled step, and need not be checked
_IDENTITY_GUARDS = ("DICT_VERSION", "NN_MODULE", "ID_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "MODULE_MATCH",
                    "CLOSURE_MATCH", "WEAKREF_ALIVE")  # fmt: skip
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
        self._fn = torch.compile(layers.decode, fullgraph=True, dynamic=False, options=options)
        self.direct: DirectCall | None = None

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
        kernels.load(cache_dir)  # torch.ops.dpserve.paged_decode_attention, which Transformer.decode calls

        # The number of real rows is read with .item() inside the graph (see the module docstring).
        torch._dynamo.config.capture_scalar_outputs = True
        options = {"guard_filter_fn": _guard_filter, "cpp_wrapper": True, "cpp_wrapper_build_separate": True}
        # Small steps: fused kernels without OpenMP regions (cpp.threads=1). Large steps: parallel kernels that
        # read the thread count at run time, since the engine changes it with load (threads.py).
        layers = LayerStacks(model)
        self.serial = _Graph("serial", layers, kv_caches, {**options, "cpp.threads": 1, "cpp.dynamic_threads": False})
        self.parallel = _Graph("parallel", layers, kv_caches, {**options, "cpp.dynamic_threads": True})
        self.num_calls = 0
        self.num_fallbacks = 0

    @property
    def graphs(self) -> tuple[_Graph, _Graph]:
        return self.serial, self.parallel

    def graph_for(self, rows: int) -> _Graph:
        return self.serial if rows <= self.serial_max_rows else self.parallel

    def warm_up(self, prepare: Callable[[int, int], DecodeInputs]) -> None:
        """Compile both graphs, on padding rows only (they touch only the scratch block); then set up their
        direct calls. `prepare(rows, blocks)` gives such inputs of that many rows and blocks."""
        from torch._dynamo.utils import counters

        started = time.monotonic()
        logger.info("preparing the compiled decode step: tracing two graphs, their code from inductor's cache when "
                    "it has them (else compiled: one to three minutes on 2 cores)")
        before = {k: counters[k[0]][k[1]] for k in _CACHE_COUNTERS}
        for graph in self.graphs:
            graph(prepare(self.min_rows, self.min_blocks))
        seen = [counters[k[0]][k[1]] - before[k] for k in _CACHE_COUNTERS]
        how = "compiled" if seen[1] or seen[3] else "loaded from the cache (nothing compiled)"
        logger.info("decode step %s in %.1f s (inductor cache: %d hits, %d misses; AOT autograd cache: %d hits, %d "
                    "misses, %d bypasses)", how, time.monotonic() - started, *seen)  # fmt: skip
        for graph in self.graphs:
            try:
                graph.direct = DirectCall.capture(lambda inputs: self._guarded_call(inputs, graph), prepare)
            except DirectCallUnavailable as e:
                logger.warning("decode step (%s graph): no direct call (%s); its steps go through torch.compile's "
                               "guards", graph.name, e)

    def __call__(self, inputs: DecodeInputs) -> Tensor | None:
        """Final hidden states [rows, dim], or None when these inputs have no compiled graph (run eagerly)."""
        self.num_calls += 1
        rows, blocks = inputs.block_table.shape
        graph = self.graph_for(rows)
        if graph.direct is not None and rows >= self.min_rows and blocks >= self.min_blocks:
            return graph.direct(inputs, rows, blocks)
        return self._guarded_call(inputs, graph)

    def _guarded_call(self, inputs: DecodeInputs, graph: _Graph) -> Tensor | None:
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


class DirectCallUnavailable(Exception):
    pass


class DirectCall:
    """The compiled graph's C++ entry point, called without torch.compile's Python layers around it.

    A call through `torch.compile` first runs dynamo's frame hook and guards, then AOTAutograd's runtime wrapper
    and inductor's output-code wrapper, each walking the graph's flat inputs (weights and KV caches are inputs
    too); ~0.9 ms a step at batch 1 here with ~370 of them, about a seventh of the step. The graph itself takes a flat list:
    the same weight and cache tensors every step, the step's five input tensors, and the dynamic sizes as ints.
    `capture` records that list from two guarded calls of different shapes, works out which entries are which,
    and checks that a direct call gives the guarded call's exact result; `__call__` then fills in a step's
    tensors and sizes and calls the entry point.

    What the guards checked is held by construction: the runner builds every step's inputs the same way
    (int64 tensors, at least min_rows x min_blocks, checked per call), the weights and caches never change
    (the guard filter skips them anyway), and inductor's size and stride asserts still run inside the entry.
    """

    def __init__(self, fn, template: list, tensor_slots: list[tuple[int, int]], row_slots: list[int],
                 block_slots: list[int]):
        self._fn = fn
        self._template = template
        self._tensor_slots = tensor_slots  # (flat index, DecodeInputs field index)
        self._row_slots = row_slots
        self._block_slots = block_slots
        self.num_calls = 0

    def __call__(self, inputs: DecodeInputs, rows: int, blocks: int) -> Tensor:
        self.num_calls += 1
        args = list(self._template)
        for i, field in self._tensor_slots:
            args[i] = inputs[field]
        for i in self._row_slots:
            args[i] = rows
        for i in self._block_slots:
            args[i] = blocks
        return self._fn(args)[0]

    @classmethod
    def capture(cls, guarded: Callable[[DecodeInputs], Tensor | None],
                prepare: Callable[[int, int], DecodeInputs]) -> DirectCall:
        """`guarded(inputs)`: the graph's call through torch.compile, which must not compile anything new."""
        (a, fn_a, flat_a, out_a), (b, fn_b, flat_b, out_b) = (
            cls._record(guarded, prepare(rows, blocks)) for rows, blocks in ((3, 5), (4, 7))
        )
        if fn_a is not fn_b or len(flat_a) != len(flat_b):
            raise DirectCallUnavailable("the two calls ran different graphs")
        template, tensor_slots, row_slots, block_slots = [], [], [], []
        for i, (x, y) in enumerate(zip(flat_a, flat_b)):
            template.append(x)
            if (isinstance(x, Tensor) and x is y) or (type(x) is int and x == y):
                continue  # a weight or a KV cache (the same tensor every step), or a constant
            if type(x) is int and type(y) is int and (x, y) in ((3, 4), (5, 7)):
                (row_slots if (x, y) == (3, 4) else block_slots).append(i)
                continue
            match = [f for f in range(len(a)) if a[f] is x and b[f] is y]  # one of the step's DecodeInputs
            if not match:
                raise DirectCallUnavailable(f"graph input {i} ({type(x).__name__}) is not one of the step's")
            tensor_slots.append((i, match[0]))
            template[i] = None
        direct = cls(fn_a, template, tensor_slots, row_slots, block_slots)
        out = direct(b, 4, 7)
        if not torch.equal(out, out_b):
            raise DirectCallUnavailable("a direct call differs from the guarded call")
        return direct

    @staticmethod
    def _record(guarded: Callable[[DecodeInputs], Tensor | None], inputs: DecodeInputs):
        """One guarded call of `inputs`, with the graph's entry point and the flat inputs it was given."""
        from torch._inductor.output_code import CompiledFxGraph

        seen = []
        original = CompiledFxGraph.__call__

        def record(graph, flat):
            seen.append((graph.current_callable, list(flat)))
            return original(graph, flat)

        CompiledFxGraph.__call__ = record
        try:
            out = guarded(inputs)
        finally:
            CompiledFxGraph.__call__ = original
        if out is None or len(seen) != 1:
            raise DirectCallUnavailable(f"{len(seen)} graph calls recorded, output {type(out).__name__}")
        return inputs, seen[0][0], seen[0][1], out
