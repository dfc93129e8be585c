"""The CPU quantized layers against fp32 references: GroupedLinear on the kernel paths (both row kinds),
FastHead (rescored top-k) and GroupedHead (exact Q8_0 groups; on int8 activations for "q4q8")."""

import pytest
import torch
import torch.nn.functional as F

from dpserve_engine import kernels
from dpserve_engine.quantized import FastHead, GroupedHead, GroupedLinear, RowSplit, q8_groups

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def engine_kernels(engine_cache_dir):
    kernels.load(engine_cache_dir)  # torch.ops.dpserve.q4_linear, q8_linear, q4q8_linear, q8q8_linear


def q4_groups(n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d = torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001
    m = -8 * d + torch.randn(n, k // 32, generator=gen) * 0.001
    return q, d, m


def reference(q, d, m, x, path):
    """fp32 weights as each path defines them. int4: (q - 8) * bf16(d) + bf16(m + 8 d) on bf16 activations;
    q4: the file's d * q + m on fp32 activations."""
    if path == "int4":
        scale, zero = d.bfloat16().float(), (m + 8 * d).bfloat16().float()
        w = ((q.float() - 8).view(q.shape[0], -1, 32) * scale.unsqueeze(-1) + zero.unsqueeze(-1)).view(q.shape)
        return F.linear(x.bfloat16().float(), w)
    w = (q.float().view(q.shape[0], -1, 32) * d.unsqueeze(-1) + m.unsqueeze(-1)).view(q.shape)
    return F.linear(x.double(), w.double()).float()


@pytest.mark.parametrize("path", ["int4", "q4"])
@pytest.mark.parametrize("decode_rows", [0, 3, 7])
def test_grouped_linear_decode_and_prefill_rows_match_fp32(path, decode_rows):
    q, d, m = q4_groups(96, 128)
    split = RowSplit()
    layer = GroupedLinear(q, d, m, split, path)
    x = torch.randn(7, 128)
    split.decode_rows = decode_rows
    y = layer(x)
    assert y.shape == (7, 96) and y.dtype == torch.float32
    # both row kinds compute the same weights; only the activations' precision and the order of sums differ
    tol = dict(rtol=1e-2, atol=1e-3) if path == "int4" else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, reference(q, d, m, x, path), **tol)


@pytest.mark.parametrize("decode_rows", [0, 3, 7])
def test_q4q8_decode_rows_take_the_int8_kernel_and_prefill_rows_the_fp32_copy(decode_rows):
    q, d, m = q4_groups(96, 128)
    split = RowSplit()
    layer = GroupedLinear(q, d, m, split, "q4q8")
    x = torch.randn(7, 128)
    split.decode_rows = decode_rows
    y = layer(x)
    assert y.shape == (7, 96) and y.dtype == torch.float32
    expected = reference(q, d, m, x, "q4")
    torch.testing.assert_close(y[decode_rows:], expected[decode_rows:], rtol=1e-5, atol=1e-5)  # fp32 prefill
    decoded = y[:decode_rows]
    assert torch.equal(decoded, torch.ops.dpserve.q4q8_linear(x[:decode_rows], layer.qs, layer.d, layer.m))
    if decode_rows:  # int8 activations: near fp32, not equal
        error = (decoded - expected[:decode_rows]).norm() / expected[:decode_rows].norm()
        assert 0 < error < 0.02


def test_unknown_paths_are_refused():
    q, d, m = q4_groups(32, 64)
    with pytest.raises(ValueError, match="q4q8"):
        GroupedLinear(q, d, m, RowSplit(), "q8")
    with pytest.raises(ValueError, match="q4q8"):
        GroupedHead(*q8_groups(q8_0_weight(10, 64)), "int4")


@pytest.mark.parametrize("path", ["int4", "q4", "q4q8"])
def test_a_row_gets_the_same_result_alone_or_batched_on_its_path(path):
    q, d, m = q4_groups(64, 96, seed=1)
    split = RowSplit()
    layer = GroupedLinear(q, d, m, split, path)
    x = torch.randn(19, 96)  # more rows than the q4 kernel's block of 8
    split.decode_rows = 19
    together = layer(x)
    for i in (0, 8, 18):
        split.decode_rows = 1
        assert torch.equal(layer(x[i : i + 1]), together[i : i + 1])
    assert torch.equal(layer.decode(torch.cat([x[:3], torch.zeros(2, 96)]), 3)[:3], together[:3])


def test_q4_kernel_gives_a_row_the_same_bits_whatever_the_batch_and_the_threads_split():
    """N = 203: each thread's outputs end in 16-wide vector tiles, then single outputs (the minima's pass), at
    places that move with the thread count and the batch's rows (the split's grain)."""
    q, d, m = q4_groups(203, 96, seed=5)
    layer = GroupedLinear(q, d, m, RowSplit(), "q4")
    x = torch.randn(13, 96)
    op = lambda rows: torch.ops.dpserve.q4_linear(rows, layer.qs, layer.d, layer.mt)  # noqa: E731
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([op(x[i : i + 1]) for i in range(13)])
        for n in (2, 3):
            torch.set_num_threads(n)
            assert torch.equal(op(x), alone), n
            assert torch.equal(op(x[:5]), alone[:5]), n
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(alone, reference(q, d, m, x, "q4"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["q4", "q4q8"])
def test_q4_decode_zeroes_padding_rows(path):
    q, d, m = q4_groups(32, 64, seed=3)
    layer = GroupedLinear(q, d, m, RowSplit(), path)
    y = layer.decode(torch.randn(5, 64), 2)
    assert y.shape == (5, 32) and torch.count_nonzero(y[2:]) == 0


def test_q4_kernel_refuses_mismatched_shapes():
    q, d, m = q4_groups(32, 64)
    layer = GroupedLinear(q, d, m, RowSplit(), "q4")
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.dpserve.q4_linear(torch.randn(2, 96), layer.qs, layer.d, layer.mt)
    with pytest.raises(RuntimeError, match="minima do not match"):  # [K / 32, N]: not d's layout
        torch.ops.dpserve.q4_linear(torch.randn(2, 64), layer.qs, layer.d, layer.mt.t().contiguous())


def test_fast_head_rescores_the_best_candidates_exactly():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(1000, 64, generator=gen) * 0.1
    for large_bf16 in (True, False):
        head = FastHead(weight, large_bf16=large_bf16)
        for rows in (1, 4, 8, 16, 40):  # int8 below 9 rows, bf16 (or fp32) above
            h = torch.randn(rows, 64, generator=gen)
            exact = F.linear(h, weight)
            got = head(h, weight)
            assert torch.equal(got.argmax(-1), exact.argmax(-1))
            top = exact.topk(4, dim=-1).indices
            torch.testing.assert_close(got.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got, exact, rtol=0.05, atol=0.05)  # the tail: approximate


def q8_0_weight(rows: int, dim: int, seed: int = 4) -> torch.Tensor:
    """A weight as a GGUF Q8_0 tensor dequantizes: fp16 d = amax / 127 per group of 32, q = round(w / d)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, dim // 32, 32, generator=gen)
    d = (w.abs().amax(-1, keepdim=True) / 127).half().float()
    return ((w / d).round().clamp(-127, 127) * d).view(rows, dim)


def test_q8_groups_reproduce_a_q8_0_weight_and_refuse_others():
    weight = q8_0_weight(300, 64)
    q, d = q8_groups(weight)
    assert q.dtype == torch.int8 and torch.equal(q.float().view(300, 2, 32) * d.unsqueeze(-1), weight.view(300, 2, 32))
    assert q8_groups(torch.randn(300, 64)) is None  # not Q8_0: no exact groups
    assert q8_groups(torch.randn(10, 48)) is None  # not a whole number of groups


def test_grouped_head_is_the_fp32_head_and_batch_invariant():
    weight = q8_0_weight(1000, 64)
    head = GroupedHead(*q8_groups(weight))
    h = torch.randn(13, 64)
    got = head(h, weight)
    torch.testing.assert_close(got, F.linear(h.double(), weight.double()).float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.cat([head(h[i : i + 1], weight) for i in range(13)]), got)


def test_grouped_head_on_int8_activations_is_near_the_fp32_head_and_batch_invariant():
    weight = q8_0_weight(1000, 64)
    head = GroupedHead(*q8_groups(weight), "q4q8")
    h = torch.randn(13, 64)
    got = head(h, weight)
    assert torch.equal(got, torch.ops.dpserve.q8q8_linear(h, head.qs, head.d))
    exact = F.linear(h.double(), weight.double()).float()
    assert 0 < (got - exact).norm() / exact.norm() < 0.02
    assert torch.equal(torch.cat([head(h[i : i + 1], weight) for i in range(13)]), got)
