"""The CPU quantized layers against fp32 references: Int4Linear (both row paths) and FastHead (rescored top-k)."""

import pytest
import torch
import torch.nn.functional as F

from dpserve_engine.model import FastHead, Int4Linear, RowSplit

pytestmark = pytest.mark.timeout(60)


def q4_groups(n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d = torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001
    m = -8 * d + torch.randn(n, k // 32, generator=gen) * 0.001
    return q, d, m


def reference(q, d, m, x):
    """fp32 weights as the kernel defines them: (q - 8) * bf16(d) + bf16(m + 8 d), per group of 32."""
    scale, zero = d.bfloat16().float(), (m + 8 * d).bfloat16().float()
    w = ((q.float() - 8).view(q.shape[0], -1, 32) * scale.unsqueeze(-1) + zero.unsqueeze(-1)).view(q.shape)
    return F.linear(x.bfloat16().float(), w)


@pytest.mark.parametrize("decode_rows", [0, 3, 7])
def test_int4_linear_decode_and_prefill_rows_match_fp32(decode_rows):
    q, d, m = q4_groups(96, 128)
    split = RowSplit()
    layer = Int4Linear(q, d, m, split)
    x = torch.randn(7, 128)
    split.decode_rows = decode_rows
    y = layer(x)
    ref = reference(q, d, m, x)
    assert y.shape == (7, 96) and y.dtype == torch.float32
    # both paths compute the same weights; only bf16 activations and summation order differ
    torch.testing.assert_close(y, ref, rtol=1e-2, atol=1e-3)


def test_a_row_gets_the_same_result_alone_or_batched_on_its_path():
    q, d, m = q4_groups(64, 64, seed=1)
    split = RowSplit()
    layer = Int4Linear(q, d, m, split)
    x = torch.randn(5, 64)
    split.decode_rows = 5
    together = layer(x)
    split.decode_rows = 1
    alone = layer(x[:1])
    torch.testing.assert_close(together[:1], alone, rtol=0, atol=0)


def test_fast_head_rescores_the_best_candidates_exactly():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(1000, 64, generator=gen) * 0.1
    head = FastHead(weight)
    for rows in (1, 4, 8, 16, 40):  # int8 below 9 rows, bf16 above
        h = torch.randn(rows, 64, generator=gen)
        exact = F.linear(h, weight)
        got = head(h, weight)
        assert torch.equal(got.argmax(-1), exact.argmax(-1))
        top = exact.topk(4, dim=-1).indices
        torch.testing.assert_close(got.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, exact, rtol=0.05, atol=0.05)  # the tail: approximate
