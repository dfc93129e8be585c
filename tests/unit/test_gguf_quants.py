"""GGUF quant types per tensor (issue #36): Q4_0, Q4_1 and Q4_K tensors repack into the 4-bit groups the grouped
kernels run and Q8_0 ones into the int8 groups of the Q8_0 head's kernel, exactly (the weights they stand for equal
gguf.quants.dequantize's, bit for bit); other types are dequantized; a fused layer whose parts come in different
forms runs dense; the start-up log names each type's path. The file is a tiny llama GGUF of random blocks (any bytes are a valid block once its fp16 scales are sane)."""

import logging

import numpy as np
import pytest
import torch

from dpserve_engine.loader import load_gguf
from dpserve_engine.model import GroupedLinear, Precision, _expanded, build_model
from dpserve_engine.quantized import Q8Linear

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.timeout(120)

DIM, FFN, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 260
HEAD_DIM = DIM // HEADS
FP16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q4_K: (0, 2), Q.Q6_K: (208,), Q.Q8_0: (0,)}  # byte offsets in a block
TYPES = {  # a Q4_K_M-like mix: attn_v in Q6_K, so the fused qkv layer has parts of two kinds
    "attn_q": Q.Q4_K, "attn_k": Q.Q4_0, "attn_v": Q.Q6_K, "attn_output": Q.Q8_0,
    "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_0,
}  # fmt: skip
SHAPES = {"attn_q": (DIM, DIM), "attn_k": (KV_HEADS * HEAD_DIM, DIM), "attn_v": (KV_HEADS * HEAD_DIM, DIM),
          "attn_output": (DIM, DIM), "ffn_gate": (FFN, DIM), "ffn_up": (FFN, DIM), "ffn_down": (DIM, FFN)}  # fmt: skip


def random_blocks(rng, rows: int, cols: int, qtype) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        scale = rng.uniform(0.002, 0.02, size=(rows, cols // block)).astype(np.float16)
        raw[..., offset : offset + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gguf") / "mixed.gguf")
    rng = np.random.default_rng(3)
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in ((writer.add_embedding_length, DIM), (writer.add_block_count, 1), (writer.add_head_count, HEADS),
                       (writer.add_head_count_kv, KV_HEADS), (writer.add_feed_forward_length, FFN),
                       (writer.add_context_length, 64)):  # fmt: skip
        add(value)
    writer.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, DIM), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(DIM, dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(DIM, dtype=np.float32))
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(DIM, dtype=np.float32))
    for kind, qtype in TYPES.items():
        writer.add_tensor(f"blk.0.{kind}.weight", random_blocks(rng, *SHAPES[kind], qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
      "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
      "ffn_down": "mlp.down_proj"}  # fmt: skip


def test_4_bit_types_repack_into_groups_that_stand_for_ggufs_own_weights(mixed_gguf, caplog):
    caplog.set_level(logging.INFO, logger="dpserve_engine")
    _, groups = load_gguf(mixed_gguf, "int4")
    _, dense = load_gguf(mixed_gguf, None)  # every tensor through gguf.quants.dequantize
    for kind, qtype in TYPES.items():
        base = f"model.layers.0.{HF[kind]}"
        if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0):
            assert base + ".weight" not in groups
            assert torch.equal(_expanded(groups, base), dense[base + ".weight"]), kind
        else:
            assert torch.equal(groups[base + ".weight"], dense[base + ".weight"]), kind
    log = caplog.text
    assert "Q4_K x2 -> 4-bit groups for the grouped kernels" in log and "Q6_K x1 -> dequantized to fp32" in log
    assert "Q4_0 x2 -> 4-bit groups" in log and "Q4_1 x1 -> 4-bit groups" in log and "F32 x4 -> fp32" in log
    assert "Q8_0 x1 -> int8 groups for the grouped kernel" in log


def test_a_fused_layer_of_mixed_types_runs_dense_and_the_grouped_ones_compute_the_dequantized_weights(mixed_gguf):
    from dpserve_engine import kernels
    from dpserve_engine.settings import EngineConfig

    kernels.load(EngineConfig().cache_dir)  # the grouped kernels (built once a machine)
    args, groups = load_gguf(mixed_gguf, "int4")
    _, dense = load_gguf(mixed_gguf, None)
    model = build_model(args, groups, Precision.fp32(), torch.device("cpu"), "q4")
    layer = model.layers[0]
    qkv = layer.attention.wqkv  # q (Q4_K), k (Q4_0), v (Q6_K): dense, on the weights gguf dequantizes
    assert not isinstance(qkv, GroupedLinear)
    names = [f"model.layers.0.self_attn.{n}_proj.weight" for n in "qkv"]
    assert torch.equal(qkv.weight, torch.cat([dense[n] for n in names]))
    x = torch.randn(3, DIM, generator=torch.Generator().manual_seed(0))
    layers = ((layer.attention.wo, Q8Linear, ["self_attn.o_proj"]), (layer.feed_forward.w2, GroupedLinear,
              ["mlp.down_proj"]), (layer.feed_forward.w13, GroupedLinear, ["mlp.gate_proj", "mlp.up_proj"]))  # fmt: skip
    for module, kind, names in layers:
        assert isinstance(module, kind), names
        weight = torch.cat([dense[f"model.layers.0.{name}.weight"] for name in names])
        name = names[0]
        inputs = x if weight.shape[1] == DIM else torch.randn(3, weight.shape[1], generator=torch.Generator())
        want = inputs @ weight.T
        for decode_rows in (3, 0):  # the 4-bit kernel, then the dense prefill copy
            model.row_split.decode_rows = decode_rows
            got = module(inputs)
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (name, decode_rows, (got - want).abs().max())
