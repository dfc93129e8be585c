"""`DirectCall`: the compiled decode graph's C++ entry point, called without torch.compile's Python layers.

Depends on torch internals (`CompiledFxGraph`, the C++ wrapper's calling convention); compiled.py sets it up and
falls back to the guarded torch.compile call when that fails, at set-up or at run time."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dpserve_engine.model import DecodeInputs


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
        self.output_code = None  # the CompiledFxGraph it calls into, when captured (precompiled.py saves its source)

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
        (a, fn_a, flat_a, out_a, code_a), (b, fn_b, flat_b, out_b, _) = (
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
        direct.output_code = code_a
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
            seen.append((graph.current_callable, list(flat), graph))
            return original(graph, flat)

        CompiledFxGraph.__call__ = record
        try:
            out = guarded(inputs)
        finally:
            CompiledFxGraph.__call__ = original
        if out is None or len(seen) != 1:
            raise DirectCallUnavailable(f"{len(seen)} graph calls recorded, output {type(out).__name__}")
        return inputs, seen[0][0], seen[0][1], out, seen[0][2]
