"""The quantized layers of the model: GGUF 4-bit linear layers on the kernel path chosen for the CPU
(`GroupedLinear`), Q8_0 ones on the grouped int8-weight kernel (`Q8Linear`), and the LM head on reduced-precision
or Q8_0 copies of its weight (`FastHead`, `GroupedHead`).

model.py builds them from the weights (`fused_linear`, `Transformer.quantize_head`); cpu_paths.py chooses the
path; csrc/grouped_linear.cpp is the grouped kernel on fp32 activations, csrc/grouped_linear_q8.cpp the one on
int8 activations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


# oneDNN's bf16 GEMM (AMX on CPUs that have it, torch 2.13) gives a row the same result in any call of at most 32
# rows, and blocks larger calls differently: some rows of a 33- or 512-row prefill differed in their last bits from
# the same rows alone, and the int4 path's bf16 activations turn such bits into different tokens at near ties. So
# prefill rows go through it 32 at a time (measured: 1.3-1.8 x the time of one large call, still under fp32's).
BATCH_INVARIANT_ROWS = 32


class RowSplit:
    """Shared by a model's GroupedLinear layers: how many leading rows of this step's token batch are decodes."""

    decode_rows: int = 0


# The kernel paths that run the engine's grouped kernels on the file's nibbles (GroupedLinear) and the Q8_0 head
# (GroupedHead): "q4" on fp32 activations (q4_linear, q8_linear), "q4q8" on activations quantized to int8 inside
# the op (q4q8_linear, q8q8_linear)
GROUPED_PATHS = ("q4", "q4q8")


class _SplitRows(nn.Module):
    """A layer whose decode rows (`split.decode_rows`, the leading rows) take its grouped kernel (`_grouped`) and
    whose prefill rows take its dense copy (`_dense`): each kind of row always the same path."""

    split: RowSplit

    def forward(self, x: Tensor) -> Tensor:
        n = self.split.decode_rows
        if n >= x.shape[0]:
            y = self._grouped(x)
        elif n == 0:
            y = self._dense(x)
        else:
            y = torch.cat([self._grouped(x[:n]), self._dense(x[n:])])
        return y.to(x.dtype)

    def decode(self, x: Tensor, rows: int) -> Tensor:
        """Every row a decode (the compiled decode step): the grouped kernel on the first `rows` rows, zeros for
        the padding rows after them; no branch on RowSplit."""
        y = self._grouped(x.narrow(0, 0, rows))
        return torch.cat([y, y.new_zeros(x.shape[0] - rows, y.shape[1])]).to(x.dtype)

    def _grouped(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def _dense(self, x: Tensor) -> Tensor:
        raise NotImplementedError


class GroupedLinear(_SplitRows):
    """Weight-only 4-bit from GGUF Q4_1 groups (w = d * q + m, 32 weights a group), repacked, not requantized,
    on one of three kernel paths (cpu_paths.py chooses for the CPU):

    - "int4": torch's CPU int4 kernel, which computes (q - 8) * scale + zero per group with bf16 scale = d and
      zero = m + 8 d, on bf16 activations. Prefill rows go through a bf16 hi+lo copy of the same effective
      weights (a bf16 GEMM is ~3x faster than the int4 kernel at 128 rows where bf16 is in hardware).
    - "q4": the engine's grouped kernel (csrc/grouped_linear.cpp) on the file's nibbles with fp32 d and m (m kept
      transposed, `mt`) and fp32 activations; prefill rows through an fp32 copy (MKL's sgemm). For CPUs that
      emulate bf16.
    - "q4q8": as "q4", but decode rows go through csrc/grouped_linear_q8.cpp, which quantizes each row's
      activations to int8 per group of 32 and takes integer dot products (llama.cpp's way; not fp32's results).

    Decode rows (`split.decode_rows`, the leading rows) take the 4-bit kernel and prefill rows the dense copy.
    Each kind of row always takes the same path. Decode rows give the same bits in any batch; the dense copy's
    prefill rows do on "int4" (bf16 GEMM calls of 32 rows), while MKL's sgemm on "q4"/"q4q8" sums a row in an
    order that depends on the call's row count (README, precision).
    """

    group_size = 32
    prefill_only = ("dense",)  # not read by decode(): compiled.LayerStacks leaves it out

    def __init__(self, q: Tensor, d: Tensor, m: Tensor, split: RowSplit, path: str = "int4", prefill_copy: bool = True):
        super().__init__()
        # q: [N, K] in 0..15; d, m: [N, K / 32]
        if path != "int4" and path not in GROUPED_PATHS:
            raise ValueError(f"GroupedLinear path must be one of int4, {', '.join(GROUPED_PATHS)}; got {path!r}")
        self.path, self.split = path, split
        self.in_features = q.shape[1]
        groups = q.view(q.shape[0], -1, self.group_size)
        if path == "int4":
            q32 = q.to(torch.int32)
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q32, 1))
            scales, zeros = d.bfloat16(), (m + 8 * d).bfloat16()
            self.register_buffer("scales_zeros", torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous())
            dense = ((groups.float() - 8) * scales.float().unsqueeze(-1) + zeros.float().unsqueeze(-1)).view(q.shape)
            hi = dense.bfloat16()
            dense = torch.cat([hi, (dense - hi.float()).bfloat16()], dim=1)  # [N, 2K]
        else:
            nibbles = groups.to(torch.uint8)
            self.register_buffer("qs", (nibbles[..., :16] | (nibbles[..., 16:] << 4)).view(q.shape[0], -1))
            self.register_buffer("d", d.float().contiguous())
            if path == "q4":  # the fp32-activation kernel reads the minima transposed, [K / 32, N]
                self.register_buffer("mt", m.float().t().contiguous())
            else:
                self.register_buffer("m", m.float().contiguous())
            dense = (groups.float() * self.d.unsqueeze(-1) + m.float().unsqueeze(-1)).view(q.shape)  # the file's w
        self.register_buffer("dense", dense if prefill_copy else None)

    def _dense(self, x: Tensor) -> Tensor:
        if self.dense is None:  # built without a prefill copy
            return self._grouped(x)
        if self.path == "int4":
            xb = x.to(torch.bfloat16)
            xx = torch.cat([xb, xb], dim=1)
            if xx.shape[0] <= BATCH_INVARIANT_ROWS:
                return F.linear(xx, self.dense)
            return torch.cat([F.linear(rows, self.dense) for rows in xx.split(BATCH_INVARIANT_ROWS)])
        return F.linear(x.float(), self.dense)

    def _grouped(self, x: Tensor) -> Tensor:
        if self.path == "int4":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, self.group_size,
                                                             self.scales_zeros)  # fmt: skip
        if self.path == "q4q8":
            return torch.ops.dpserve.q4q8_linear(x.float(), self.qs, self.d, self.m)
        return torch.ops.dpserve.q4_linear(x.float(), self.qs, self.d, self.mt)


class Q8Linear(_SplitRows):
    """A GGUF Q8_0 linear layer (w = d * q, 32 weights a group, q int8) as the file has it: decode rows in the grouped
    kernel the Q8_0 LM head runs (`q8_linear` on fp32 activations, path "q4"; `q8q8_linear`, path "q4q8"), prefill
    rows through an fp32 copy of the same weights, as GroupedLinear does."""

    prefill_only = ("dense",)

    def __init__(self, q: Tensor, d: Tensor, split: RowSplit, path: str = "q4"):
        super().__init__()
        if path not in GROUPED_PATHS:
            raise ValueError(f"Q8Linear path must be one of {', '.join(GROUPED_PATHS)}; got {path!r}")
        self.path, self.split = path, split
        self.in_features = q.shape[1]
        self.register_buffer("qs", q.to(torch.int8).contiguous())
        self.register_buffer("d", d.float().contiguous())
        groups = q.view(q.shape[0], -1, GroupedLinear.group_size).float()
        self.register_buffer("dense", (groups * self.d.unsqueeze(-1)).view(q.shape))

    def _dense(self, x: Tensor) -> Tensor:
        return F.linear(x.float(), self.dense)

    def _grouped(self, x: Tensor) -> Tensor:
        if self.path == "q4q8":
            return torch.ops.dpserve.q8q8_linear(x.float(), self.qs, self.d)
        return torch.ops.dpserve.q8_linear(x.float(), self.qs, self.d)


class FastHead(nn.Module):
    """The LM head on reduced-precision copies of its weight, each row's best candidates rescored in fp32.

    A decode step at batch 1 spends ~7.5 ms here streaming the fp32 [V, dim] head. Small batches (<= 8 rows)
    use torch's int8 weight-only kernel (one scale per vocabulary row: 4x fewer bytes, ~1 ms); larger ones a
    bf16 copy (that kernel is ~4x faster than int8's at 64 rows) where bf16 is in hardware, else the fp32 head
    itself. Both reduced copies move logits by ~1e-3 to 1e-2, enough to swap near-tied greedy choices, so the
    `rescore` best entries of every row are recomputed from the fp32 weight and written back: greedy choices and
    the top logprobs are the fp32 head's; the tail is approximate.
    """

    int8_max_rows = 8

    def __init__(self, weight: Tensor, rescore: int = 8, large_bf16: bool = True):
        super().__init__()
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("qweight", (weight / scale.unsqueeze(1)).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.bfloat16())
        self.register_buffer("weight_bf16", weight.bfloat16() if large_bf16 else None)
        self.rescore = rescore

    def forward(self, h: Tensor, weight: Tensor) -> Tensor:
        """h: [N, dim]; weight: the fp32 [V, dim] head -> fp32 logits [N, V]."""
        if h.shape[0] <= self.int8_max_rows:
            logits = torch._weight_int8pack_mm(h.bfloat16(), self.qweight, self.scales).float()
        elif self.weight_bf16 is not None:
            logits = F.linear(h.bfloat16(), self.weight_bf16).float()
        else:
            return F.linear(h.float(), weight)  # the fp32 head: nothing to rescore
        top = logits.topk(self.rescore, dim=-1, sorted=False).indices  # [N, k]
        exact = torch.bmm(weight[top], h.float().unsqueeze(2)).squeeze(2)  # [N, k]
        return logits.scatter_(1, top, exact)


class GroupedHead(nn.Module):
    """The LM head as Q8_0 groups (w = d * q, 32 weights a group) in the engine's grouped kernel: 4x fewer bytes
    than the fp32 head and, for a GGUF Q8_0 embedding, the very same weights (built only when d * q reproduces the
    fp32 head exactly; `q8_groups`). Path "q4": fp32 activations, the fp32 head's logits (no rescore needed);
    "q4q8": activations quantized to int8 per group of 32 (logits off by ~0.5 %, not rescored)."""

    def __init__(self, q: Tensor, d: Tensor, path: str = "q4"):
        super().__init__()
        if path not in GROUPED_PATHS:
            raise ValueError(f"GroupedHead path must be one of {', '.join(GROUPED_PATHS)}; got {path!r}")
        self.path = path
        self.register_buffer("qs", q)
        self.register_buffer("d", d)

    def forward(self, h: Tensor, weight: Tensor) -> Tensor:
        if self.path == "q4q8":
            return torch.ops.dpserve.q8q8_linear(h.float(), self.qs, self.d)
        return torch.ops.dpserve.q8_linear(h.float(), self.qs, self.d)


def q8_groups(weight: Tensor, group_size: int = 32) -> tuple[Tensor, Tensor] | None:
    """fp32 [V, dim] -> (q int8 [V, dim], d fp32 [V, dim / 32]) with d * q == weight exactly, or None.

    A GGUF Q8_0 tensor dequantizes to d * q with d an fp16 and max |q| = 127 in each group (llama.cpp's
    quantizer), so d is the group's max |w| / 127 rounded to fp16; any other weight fails the exactness check."""
    V, dim = weight.shape
    if dim % group_size:
        return None
    groups = weight.view(V, -1, group_size)
    d = (groups.abs().amax(dim=-1) / 127).half().float()  # [V, G]
    q = torch.where(d.unsqueeze(-1) > 0, groups / d.clamp(min=1e-30).unsqueeze(-1), 0).round().clamp(-127, 127)
    if not torch.equal(q * d.unsqueeze(-1), groups):
        return None
    return q.to(torch.int8).view(V, dim), d.contiguous()
