"""A Llama-family decoder over a paged KV cache, in the gpt-fast style.

Every linear layer runs on the flattened token batch x: [T, dim] (all sequences' new tokens side by side).
Attention reads and writes K/V through flat cache slots (block_id * block_size + offset): one-token decodes are
batched into one matmul attention, prefill chunks run per sequence with a causal mask over their cached prefix.
Two entry points: `forward` (any mix of decodes and prefill chunks, eager) and `decode` (one-token decodes only,
tensor inputs only: what compiled.py compiles; the same math and the same `_qkv`, with decode attention in a C++ op).

Precision: weights may be bf16 while activations, norms and the residual stay fp32 (`Linear` casts its input to
the weight dtype and its output back). On this CPU that mix, with an fp32 KV cache and an fp32 LM head, gives the
same greedy tokens as fp32 at half the weight bandwidth (measured in docs/benchmarks.md).

Mixture of experts: when `ModelArgs.num_experts` is set, each block's MLP is a `moe.MoEFeedForward` (top-k routed
SwiGLU experts, Mixtral names in the state dict); a model may hold a subset of the experts (`expert_ids`) and run
them across ranks through an `ExpertComm` (`set_expert_comm`, `dummy_forward`; see moe.py).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from collections.abc import Sequence
from typing import NamedTuple

from torch import Tensor, nn

from dpserve_engine.moe import ExpertComm, MoEFeedForward, expert_range
from dpserve_engine.quantized import GROUPED_PATHS, FastHead, GroupedHead, GroupedLinear, Q8Linear, RowSplit, q8_groups


@dataclasses.dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int = 0  # 0: dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    tie_embeddings: bool = True
    qkv_bias: bool = False
    num_experts: int = 0  # > 0: every block's MLP is a mixture of this many experts (moe.py); ffn_dim is an expert's
    num_experts_per_tok: int = 0  # top-k experts per token

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.dim // self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


@dataclasses.dataclass(frozen=True)
class Precision:
    weight: torch.dtype  # linear layers
    act: torch.dtype  # residual stream, norms, attention
    kv: torch.dtype
    head: torch.dtype  # LM head (fp32 keeps greedy == fp32 reference)

    @staticmethod
    def for_device(device: torch.device, dtype: str = "auto") -> Precision:
        """The mix for a device and EngineConfig.dtype ("auto", "bfloat16", "float32")."""
        if dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"dtype must be auto, bfloat16 or float32, got {dtype!r}")
        if dtype == "float32" or (dtype == "auto" and device.type == "cpu"):
            return Precision.fp32()
        if device.type == "cuda":
            return Precision(torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32)
        return Precision(torch.bfloat16, torch.float32, torch.float32, torch.float32)

    @staticmethod
    def fp32() -> Precision:
        return Precision(torch.float32, torch.float32, torch.float32, torch.float32)


@dataclasses.dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the token batch
    end: int
    context_slots: Tensor  # [C] cache slots of positions 0..C-1 (cached prefix + this chunk)
    mask: Tensor  # [n, C] True where query i may attend key j (causal)


@dataclasses.dataclass
class AttentionMetadata:
    slot_mapping: Tensor  # [T] cache slot each new token's K/V is written to
    num_decodes: int  # rows 0..num_decodes-1 are one-token decodes
    block_size: int
    decode_block_index: Tensor | None  # [Hkv * D * nb] rows of the [Hkv * num_blocks, block_size * hd] cache view:
    #                                    each decode's blocks (padded with block 0 to the longest), per kv head
    decode_bias: Tensor | None  # [1, D, 1, nb * block_size] 0 for real positions, -inf for padding
    prefills: list[PrefillChunk]


class DecodeInputs(NamedTuple):
    """A step of one-token decodes only, in tensors alone (the compiled decode's inputs; see compiled.py)."""

    tokens: Tensor  # [D]
    positions: Tensor  # [D]
    slot_mapping: Tensor  # [D] cache slot of each new token's K/V
    block_table: Tensor  # [D, nb] each sequence's cache blocks, padded with block 0 to the longest
    block_size: int  # a constant to torch.compile
    num_rows: Tensor  # [] rows 0..num_rows-1 are real decodes, the rest padding (skipped by the int4 matmuls)


class Linear(nn.Module):
    """x @ w.T with x in the activation dtype and w in the weight dtype (cast in, cast back out)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)

    def decode(self, x: Tensor, rows: int) -> Tensor:
        return self(x)  # every row a decode: the same path (padding rows included)


def fused_linear(
    state: dict[str, Tensor], names: list[str], linear: nn.Module, split: RowSplit, path: str
) -> nn.Module:
    """Fill `linear` with the row-concatenation of the named weights, or build a GroupedLinear from their groups.
    Where only some of the names come as 4-bit groups (a Q4_K_M file keeps some v projections in Q6_K), the layer
    is dense: the groups are expanded to the weights they stand for (w = d q + m, as gguf dequantizes them)."""
    kinds = {_kind(state, n) for n in names}
    if kinds == {".qweight"}:
        parts = (torch.cat([state[n + part] for n in names]) for part in (".qweight", ".scales", ".mins"))
        return GroupedLinear(*parts, split, path)
    if kinds == {".q8weight"} and path in GROUPED_PATHS:
        q, d = (torch.cat([state[n + part] for n in names]) for part in (".q8weight", ".q8scales"))
        return Q8Linear(q, d, split, path)
    linear.weight.copy_(torch.cat([_expanded(state, n) for n in names]))
    if linear.bias is not None:
        linear.bias.copy_(torch.cat([state[n + ".bias"] for n in names]))
    return linear


def _kind(state: dict[str, Tensor], name: str) -> str:
    """How the loader gave a weight: ".qweight" (4-bit groups), ".q8weight" (Q8_0 groups) or ".weight" (dense)."""
    return next((kind for kind in (".qweight", ".q8weight") if name + kind in state), ".weight")


def _expanded(state: dict[str, Tensor], name: str) -> Tensor:
    """The fp32 weights [N, K] a tensor stands for, in whichever form the loader gave it (w = d q + m, w = d q)."""
    kind = _kind(state, name)
    if kind == ".weight":
        return state[name + ".weight"]
    q = state[name + kind]
    groups = q.reshape(q.shape[0], -1, GroupedLinear.group_size).float()
    if kind == ".q8weight":
        return (groups * state[name + ".q8scales"].unsqueeze(-1)).reshape(q.shape)
    d, m = state[name + ".scales"], state[name + ".mins"]
    return (groups * d.unsqueeze(-1) + m.unsqueeze(-1)).reshape(q.shape)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)  # always fp32

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:  # no casts to dispatch: a decode step runs 61 norms
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)


def rope_tables(args: ModelArgs) -> tuple[Tensor, Tensor]:
    """cos, signed sin: [max_seq_len, head_dim] for the rotate_half layout (HF order): cos = [c, c] and
    sin = [-s, s], so that rotate_half(x) * [s, s] == swap_halves(x) * [-s, s] (apply_rope)."""
    # on the CPU, even under build_model's meta device (where arange goes through torch._refs and imports dynamo)
    inv_freq = 1.0 / (
        args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64, device="cpu") / args.head_dim)
    )
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64, device="cpu"), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1).float(), torch.cat([-sin, sin], dim=-1).float()


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x: [T, H, hd]; cos, signed_sin: [T, 1, hd] (rope_tables). x * cos + rotate_half(x) * sin, with
    rotate_half(x) = [-x2, x1] written as the swapped halves [x2, x1] times the signed sin: 3 ops, not 10."""
    xf = x if x.dtype == torch.float32 else x.float()
    swapped = torch.roll(xf, xf.shape[-1] // 2, dims=-1)  # [x2, x1]
    out = torch.addcmul(xf * cos, swapped, signed_sin)
    return out if out.dtype == x.dtype else out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, prec: Precision):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_size, self.kv_size = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.wqkv = Linear(args.dim, self.q_size + 2 * self.kv_size, args.qkv_bias, prec.weight)
        self.wo = Linear(self.q_size, args.dim, False, prec.weight)
        self.scale = args.head_dim**-0.5

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata, kv: tuple[Tensor, Tensor]) -> Tensor:
        T = x.shape[0]
        q, k, v = self._qkv(self.wqkv(x), cos, sin)
        k_cache, v_cache = kv  # [Hkv, num_slots, hd]: kv-head major, so gathered K/V need no transpose
        k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1).to(v_cache.dtype))
        D = meta.num_decodes
        if D == T:
            out = self._decode(q, k_cache, v_cache, meta)
        else:
            parts = [self._decode(q[:D], k_cache, v_cache, meta)] if D else []
            parts += [self._prefill(q[c.start : c.end], k_cache, v_cache, c) for c in meta.prefills]
            out = torch.cat(parts)
        return self.wo(out.reshape(T, self.q_size))

    def decode(
        self, x: Tensor, cos: Tensor, sin: Tensor, inputs: DecodeInputs, kv: tuple[Tensor, Tensor], rows: int
    ) -> Tensor:
        """A decode-only step written for torch.compile: tensor inputs only, K/V written with index_put_ (which
        inductor updates in place) and attended where they lie in the cache by the engine's C++ op (kernels.py,
        loaded by compiled.py); the same math as forward() (up to the order of the sums)."""
        D = x.shape[0]
        q, k, v = self._qkv(self.wqkv.decode(x, rows), cos, sin)
        k_cache, v_cache = kv
        heads = torch.arange(self.n_kv_heads, device=x.device).unsqueeze(1)
        k_cache.index_put_((heads, inputs.slot_mapping.unsqueeze(0)), k.transpose(0, 1).to(k_cache.dtype))
        v_cache.index_put_((heads, inputs.slot_mapping.unsqueeze(0)), v.transpose(0, 1).to(v_cache.dtype))
        out = torch.ops.dpserve.paged_decode_attention(
            q, k_cache, v_cache, inputs.block_table, inputs.positions, inputs.block_size, self.scale
        )
        return self.wo.decode(out.reshape(D, self.q_size), rows)

    def _qkv(self, qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The fused projection's output -> q [T, H, hd], k [T, Hkv, hd] (both rotated), v [T, Hkv, hd]."""
        T = qkv.shape[0]
        qk = qkv[:, : self.q_size + self.kv_size].view(T, self.n_heads + self.n_kv_heads, self.head_dim)
        q, k = apply_rope(qk, cos, sin).split([self.n_heads, self.n_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.n_kv_heads, self.head_dim)
        return q, k, v

    def _decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata) -> Tensor:
        """Batched one-token attention: gather each sequence's cache blocks (whole blocks: a few contiguous KiB
        each, not one row per token), mask the padding, matmul grouped by kv head."""
        D, hd = q.shape[0], self.head_dim
        rows = meta.decode_block_index  # index_select of 2-D rows: ~4x faster than advanced indexing here
        block_rows = meta.block_size * hd
        k = k_cache.view(-1, block_rows).index_select(0, rows).view(self.n_kv_heads, D, -1, hd)  # [Hkv, D, L, hd]
        v = v_cache.view(-1, block_rows).index_select(0, rows).view(self.n_kv_heads, D, -1, hd)
        return self._attend(q, k, v, meta.decode_bias)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
        """q [D, H, hd]; k, v [Hkv, D, L, hd]; bias [1, D, 1, L] (0 or -inf) -> [D, H, hd]."""
        D, G, hd, dtype = q.shape[0], self.n_heads // self.n_kv_heads, self.head_dim, q.dtype
        q = (q * self.scale).view(D, self.n_kv_heads, G, hd).transpose(0, 1).to(k.dtype)  # [Hkv, D, G, hd]
        scores = torch.matmul(q, k.transpose(-1, -2))  # [Hkv, D, G, L]
        probs = (scores.float() + bias).softmax(dim=-1).to(v.dtype)
        out = torch.matmul(probs, v)  # [Hkv, D, G, hd]
        return out.transpose(0, 1).reshape(D, self.n_heads, hd).to(dtype)

    def _prefill(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, chunk: PrefillChunk) -> Tensor:
        """One sequence's chunk: n queries over its C cached positions (prefix + chunk), causal."""
        k = k_cache.index_select(1, chunk.context_slots).to(q.dtype).unsqueeze(0)  # [1, Hkv, C, hd]
        v = v_cache.index_select(1, chunk.context_slots).to(q.dtype).unsqueeze(0)
        # 4-D (a batch of one): torch's CPU flash kernel takes it, where 3-D inputs fall back to the math path
        # that materializes the scores (1.7-2x slower at 128-512 tokens here)
        out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=chunk.mask, enable_gqa=True)
        return out[0].transpose(0, 1)  # [n, H, hd]


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, prec: Precision):
        super().__init__()
        self.ffn_dim = args.ffn_dim
        self.w13 = Linear(args.dim, 2 * args.ffn_dim, False, prec.weight)  # gate and up, fused
        self.w2 = Linear(args.ffn_dim, args.dim, False, prec.weight)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.ffn_dim, dim=-1)
        return self.w2(F.silu(gate) * up)

    def decode(self, x: Tensor, rows: int) -> Tensor:
        gate, up = self.w13.decode(x, rows).split(self.ffn_dim, dim=-1)
        return self.w2.decode(F.silu(gate) * up, rows)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, prec: Precision, expert_ids: Sequence[int] | None = None):
        super().__init__()
        self.attention = Attention(args, prec)
        if args.is_moe:
            self.feed_forward = MoEFeedForward(args.dim, args.ffn_dim, args.num_experts, args.num_experts_per_tok,
                                               prec.weight, expert_ids)  # fmt: skip
        else:
            self.feed_forward = FeedForward(args, prec)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata, kv: tuple[Tensor, Tensor]) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, meta, kv)
        return h + self.feed_forward(self.ffn_norm(h))

    def decode(
        self, x: Tensor, cos: Tensor, sin: Tensor, inputs: DecodeInputs, kv: tuple[Tensor, Tensor], rows: int
    ) -> Tensor:
        h = x + self.attention.decode(self.attention_norm(x), cos, sin, inputs, kv, rows)
        return h + self.feed_forward.decode(self.ffn_norm(h), rows)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, prec: Precision, expert_ids: Sequence[int] | None = None):
        """expert_ids: the experts this model holds, of an MoE model (default: all); None for a dense model."""
        super().__init__()
        if expert_ids is not None and not args.is_moe:
            raise ValueError("expert_ids were given for a dense model (ModelArgs.num_experts is 0)")
        self.args, self.prec = args, prec
        embedding_dtype = prec.head if args.tie_embeddings else prec.act  # tied: the fp32 head doubles as embedding
        # `_weight`: no random init (build_model fills it); on the meta device nn.Embedding's normal_ goes through
        # torch._refs, which imports dynamo: ~2 s of a rank's start-up, now spent in the background compile.
        self.tok_embeddings = nn.Embedding(
            args.vocab_size, args.dim, _weight=torch.empty(args.vocab_size, args.dim, dtype=embedding_dtype)
        )
        self.tok_embeddings.weight.requires_grad_(False)
        self.layers = nn.ModuleList(TransformerBlock(args, prec, expert_ids) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tie_embeddings else Linear(args.dim, args.vocab_size, False, prec.head)
        self.fast_head: FastHead | GroupedHead | None = None  # set by quantize_head()
        self.row_split = RowSplit()  # read by GroupedLinear layers
        self.kernel_paths = None  # cpu_paths.KernelPaths of GGUF groups on CPU (set by core.load_model)
        cos, sin = rope_tables(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(
        self, tokens: Tensor, positions: Tensor, meta: AttentionMetadata, kv_caches: list[tuple[Tensor, Tensor]]
    ) -> Tensor:
        """tokens, positions: [T] -> final hidden states [T, dim] (logits are computed only where needed)."""
        self.row_split.decode_rows = meta.num_decodes
        self._begin_expert_forward()
        x = self.tok_embeddings(tokens).to(self.prec.act)  # [T, dim]
        cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)  # [T, 1, hd]
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, meta, kv)
        return self.norm(x)

    def decode(self, inputs: DecodeInputs, kv_caches: list[tuple[Tensor, Tensor]]) -> Tensor:
        """A step of one-token decodes -> final hidden states [D, dim]; what compiled.py compiles."""
        x = self.tok_embeddings(inputs.tokens).to(self.prec.act)
        cos = self.rope_cos[inputs.positions].unsqueeze(1)
        sin = self.rope_sin[inputs.positions].unsqueeze(1)
        rows = (inputs.num_rows + 0).item()  # of a computed tensor: unbacked, so never specialized to a value
        torch._check(rows >= 1)
        torch._check(rows <= x.shape[0])
        self._begin_expert_forward()
        for layer, kv in zip(self.layers, kv_caches):
            x = layer.decode(x, cos, sin, inputs, kv, rows)
        return self.norm(x)

    @property
    def moe_layers(self) -> list[MoEFeedForward]:
        return [layer.feed_forward for layer in self.layers if isinstance(layer.feed_forward, MoEFeedForward)]

    @property
    def expert_ids(self) -> list[int] | None:
        """The experts this model holds (None: a dense model)."""
        return self.moe_layers[0].expert_ids if self.args.is_moe else None

    def set_expert_comm(self, comm: ExpertComm | None) -> None:
        """Run the MoE layers across the ranks of `comm` (None: locally). The model must hold exactly the experts
        moe.expert_range gives its rank."""
        if not self.args.is_moe:
            raise ValueError("set_expert_comm: a dense model has no experts to share")
        if comm is not None:
            expected = list(expert_range(self.args.num_experts, comm.rank, comm.world_size))
            if self.expert_ids != expected:
                raise ValueError(f"rank {comm.rank} of {comm.world_size} must hold experts {expected[0]}.."
                                 f"{expected[-1]}; this model holds {self.expert_ids}")  # fmt: skip
        for moe in self.moe_layers:
            moe.comm = comm

    @torch.no_grad()  # not inference_mode: the new stacks become parameters, like load_weights' copies
    def set_experts(self, expert_ids: Sequence[int], state: dict[str, Tensor]) -> None:
        """Hold exactly `expert_ids` in every MoE layer (re-sharding; MoEFeedForward.set_experts): kept where held
        already, the others copied from `state` (loader.load_weights(..., expert_ids=the new ones))."""
        for i, layer in enumerate(self.layers):
            layer.feed_forward.set_experts(expert_ids, state, f"model.layers.{i}.block_sparse_moe.")

    @property
    def expert_weight_bytes(self) -> int:
        """Bytes of the experts' weights this model holds (0 for a dense model)."""
        return sum(t.numel() * t.element_size() for moe in self.moe_layers for t in (moe.w13, moe.w2))

    @torch.inference_mode()
    def dummy_forward(self) -> None:
        """A forward of zero tokens, for an expert-parallel rank with nothing to run while others step: only the
        MoE layers (attention and norms are per rank, and a zero-row step needs neither), each making its gather
        and scatter_sum so the ranks' collectives match. Without a comm it computes nothing."""
        empty = torch.empty(0, self.args.dim, dtype=self.prec.act, device=self.rope_cos.device)
        self._begin_expert_forward()
        for moe in self.moe_layers:
            moe(empty)

    def _begin_expert_forward(self) -> None:
        """Tell the MoE layers' comm a forward starts (ExpertComm's optional begin_forward: the ranks' row counts
        are the same in every layer of it). Dense models: nothing."""
        if not self.args.is_moe:
            return
        layers = self.moe_layers
        begin = getattr(layers[0].comm, "begin_forward", None)
        if begin is not None:
            begin(len(layers))

    def compute_logits(self, h: Tensor) -> Tensor:
        """h: [N, dim] -> fp32 logits [N, vocab]."""
        if self.fast_head is not None:
            return self.fast_head(h, self.head_weight.float())
        if self.output is None:
            return F.linear(h.to(self.prec.head), self.tok_embeddings.weight).float()
        return self.output(h.to(self.prec.head)).float()

    @property
    def head_weight(self) -> Tensor:
        """[vocab, dim]: the tied embedding or the separate output layer's weight."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def quantize_head(self, path: str = "int4") -> str:
        """Run the LM head on a quantized copy (CPU; cpu_paths.py's path): "q4" / "q4q8" the exact Q8_0 groups in
        the grouped kernel (fp32 / int8 activations) where the head is one, else int8/bf16 (or fp32 without bf16
        hardware) copies with an fp32 rescore of each row's best candidates. Returns what it built, for the log."""
        weight = self.head_weight.detach().float()
        groups = q8_groups(weight) if path in ("q4", "q4q8") else None
        if groups is not None:
            self.fast_head = GroupedHead(*groups, path)
            return "Q8_0 groups, grouped kernel" + (", int8 activations" if path == "q4q8" else "")
        self.fast_head = FastHead(weight, large_bf16=path == "int4")
        return "int8 (<= 8 rows) / " + ("bf16" if path == "int4" else "fp32") + ", top-8 rescored in fp32"

    def load_weights(self, state: dict[str, Tensor], path: str = "int4") -> None:
        """Load a loader.py state dict (HF names, HF rotate_half q/k layout), fusing qkv and gate/up; GGUF groups
        become GroupedLinear layers on kernel path `path` (cpu_paths.py). MoE blocks take Mixtral's names
        (`block_sparse_moe.gate`, `.experts.{j}.w1/w2/w3`), of the experts held only."""
        with torch.no_grad():
            self.tok_embeddings.weight.copy_(state["model.embed_tokens.weight"])
            self.norm.weight.copy_(state["model.norm.weight"])
            if self.output is not None:
                self.output.weight.copy_(state.get("lm_head.weight", state["model.embed_tokens.weight"]))
            split = self.row_split
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                attn, ffn = layer.attention, layer.feed_forward
                attn.wqkv = fused_linear(state, [f"{p}self_attn.{n}_proj" for n in "qkv"], attn.wqkv, split, path)
                attn.wo = fused_linear(state, [p + "self_attn.o_proj"], attn.wo, split, path)
                if isinstance(ffn, MoEFeedForward):
                    ffn.load(state, p + "block_sparse_moe.")  # Mixtral names
                else:
                    ffn.w13 = fused_linear(state, [p + "mlp.gate_proj", p + "mlp.up_proj"], ffn.w13, split, path)
                    ffn.w2 = fused_linear(state, [p + "mlp.down_proj"], ffn.w2, split, path)
                layer.attention_norm.weight.copy_(state[p + "input_layernorm.weight"])
                layer.ffn_norm.weight.copy_(state[p + "post_attention_layernorm.weight"])


def build_model(
    args: ModelArgs, state: dict[str, Tensor] | None, prec: Precision, device: torch.device, path: str = "int4",
    expert_ids: Sequence[int] | None = None,
) -> Transformer:
    """A Transformer on `device`; random weights when state is None (tests). `path`: the kernel path of GGUF
    groups in `state` (cpu_paths.py). `expert_ids`: the experts of an MoE model to hold (default: all; `state`
    needs only theirs: loader.load_weights(..., expert_ids))."""
    with torch.device("meta"):
        model = Transformer(args, prec, expert_ids)
    model = model.to_empty(device=device)
    cos, sin = rope_tables(args)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    if state is None:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5 / p.shape[-1] ** 0.5)
    else:
        tracked = _ReadTracking(state)
        model.load_weights(tracked, path)
        held = None if expert_ids is None else {str(e) for e in expert_ids}
        unread = sorted(k for k in state if k not in tracked.read and not k.endswith("rotary_emb.inv_freq")
                        and not (held is not None and _expert_of(k) not in (None, *held)))  # others' experts
        if unread:  # a weight the model has no place for: serving without it would be silently wrong
            raise ValueError(f"the model does not use {len(unread)} of the checkpoint's tensors (an architecture "
                             f"feature it does not implement): {', '.join(unread[:6])}{' ...' if len(unread) > 6 else ''}")
    return model.eval()


def _expert_of(name: str) -> str | None:
    """The expert number in a Mixtral-named tensor ("...block_sparse_moe.experts.3.w1.weight" -> "3")."""
    _, sep, rest = name.partition(".block_sparse_moe.experts.")
    return rest.split(".", 1)[0] if sep else None


class _ReadTracking(dict):
    """A state dict that records which tensors were read (membership tests do not count)."""

    def __init__(self, state: dict[str, Tensor]):
        super().__init__(state)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Tensor:
        value = super().__getitem__(key)
        self.read.add(key)
        return value

    def get(self, key: str, default=None):
        if key in self:
            return self[key]
        return default
