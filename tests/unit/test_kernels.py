"""The engine's C++ decode attention (kernels.py, csrc/paged_attention.cpp) against the gather + softmax math."""

from __future__ import annotations

import pytest
import torch

from dpserve_engine import kernels


@pytest.fixture(scope="module")
def op(engine_cache_dir):
    kernels.load(engine_cache_dir)  # built once per machine (~20 s), as an engine does on its first start
    return torch.ops.dpserve.paged_decode_attention


def reference(q, k_cache, v_cache, table, length, block_size, scale):
    """One sequence: gather its first `length` positions by block table, softmax(q k^T * scale) v per head."""
    slots = (table.unsqueeze(1) * block_size + torch.arange(block_size)).view(-1)[:length]
    k, v = k_cache[:, slots].double(), v_cache[:, slots].double()  # [Hkv, L, hd]
    hkv, hd = k.shape[0], k.shape[2]
    qh = q.double().view(hkv, -1, hd)  # [Hkv, G, hd]
    return (torch.softmax(qh @ k.transpose(1, 2) * scale, dim=-1) @ v).view(-1, hd).float()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hkv,group,hd,block_size", [(3, 3, 64, 16), (2, 2, 16, 4), (1, 4, 24, 8)])
def test_matches_the_gathered_attention_and_is_batch_invariant(op, hkv, group, hd, block_size):
    gen = torch.Generator().manual_seed(hd)
    num_blocks, lengths = 64, [1, 5, block_size, block_size + 1, 3 * block_size + 7, 150]
    k_cache = torch.randn(hkv, num_blocks * block_size, hd, generator=gen)
    v_cache = torch.randn(hkv, num_blocks * block_size, hd, generator=gen)
    width = max(-(-n // block_size) for n in lengths)
    # scattered blocks, padded with block 0 past each sequence's end (as the runner pads)
    table = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in lengths])
    for row, n in enumerate(lengths):
        table[row, -(-n // block_size) :] = 0
    positions = torch.tensor(lengths) - 1
    q = torch.randn(len(lengths), hkv * group, hd, generator=gen)
    scale = hd**-0.5
    out = op(q, k_cache, v_cache, table, positions, block_size, scale)
    assert out.shape == q.shape
    for row, n in enumerate(lengths):
        expected = reference(q[row], k_cache, v_cache, table[row], n, block_size, scale)
        torch.testing.assert_close(out[row], expected, atol=1e-5, rtol=1e-5)
    # a sequence's output has the same bits alone (its own table width), in the batch, and on one thread
    threads = torch.get_num_threads()
    try:
        for row, n in enumerate(lengths):
            own = table[row : row + 1, : -(-n // block_size)]
            alone = op(q[row : row + 1], k_cache, v_cache, own, positions[row : row + 1], block_size, scale)
            assert torch.equal(alone[0], out[row])
        torch.set_num_threads(1)
        assert torch.equal(op(q, k_cache, v_cache, table, positions, block_size, scale), out)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(60)
def test_refuses_positions_past_the_block_table(op):
    cache = torch.zeros(1, 8 * 4, 16)
    with pytest.raises(RuntimeError, match="past the block table"):
        op(torch.zeros(1, 2, 16), cache, cache, torch.zeros(1, 2, dtype=torch.long), torch.tensor([8]), 4, 0.25)
