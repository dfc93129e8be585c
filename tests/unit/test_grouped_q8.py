"""The int8-activation grouped ops (csrc/grouped_linear_q8.cpp, kernel path "q4q8"): q4q8_linear (Q4_1 weights)
and q8q8_linear (the Q8_0 head) against a float64 reference of the same quantized math, against the
fp32-activation ops, batch invariance, zero and non-finite groups, and the portable code."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dpserve_engine import kernels

pytestmark = pytest.mark.timeout(120)

ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 17]  # every block size of the kernel's 8-row blocks, and blocks + a remainder
# K: 3 groups (under the 8 lanes of the minima's sum) and 10 (8 lanes + a tail), neither a multiple of 256;
# N: not a multiple of the kernel's grain (1000 outputs at K = 96 split into chunks of 341 and a remainder)
SHAPES = [(96, 1000), (320, 100)]


@pytest.fixture(scope="module", autouse=True)
def engine_kernels(engine_cache_dir):
    kernels.load(engine_cache_dir)


def q4_weights(n: int, k: int, seed: int = 0):
    """Q4_1 groups as the ops take them: qs [N, K / 2] (weight j low nibble, j + 16 high), d, m [N, K / 32]; and
    the nibbles [N, K / 32, 32] in x's order."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen, dtype=torch.uint8)
    d = torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001
    m = -8 * d + torch.randn(n, k // 32, generator=gen) * 0.01  # not centred: the minima's term matters
    qs = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2)
    return qs, d, m, q


def q8_weights(n: int, k: int, seed: int = 0):
    """Q8_0 groups: qs [N, K] int8 (with -128, the sign trick's edge), d [N, K / 32]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    q[0, :32] = -128
    d = torch.rand(n, k // 32, generator=gen) * 0.01 + 0.001
    return q, d


def activations(m: int, k: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, 32:64] *= 20  # groups of different ranges
    return x


def quantize_rows(x: torch.Tensor):
    """The op's activation quantization (llama.cpp's Q8_1 with fp32 scales), in fp32 like the op:
    d = max|x| / 127, q = round(x * (1 / d)) (ties to even), s = d * sum(q); groups under 1e-30 are zeros."""
    g = x.view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1)
    zero = amax < 1e-30
    d = torch.where(zero, 0.0, amax / 127)
    inv = torch.where(zero, 0.0, 1 / d.clamp(min=1e-38))
    q = (g * inv.unsqueeze(-1)).round().clamp(-127, 127)
    return q, d, d * q.sum(-1)


def reference(x, wq, dw, mw=None) -> torch.Tensor:
    """sum_g fp32(d_w d_x) (q_w . q_x) + sum_g m_w s_x, in float64 from the op's fp32 scales and integer dots."""
    qx, dx, sx = quantize_rows(x)  # [M, G, 32], [M, G], [M, G]
    wq = wq.view(wq.shape[0], -1, 32).double()  # [N, G, 32]
    dots = torch.einsum("mgj,ngj->mng", qx.double(), wq)  # integers, exact in float64
    scale = (dw.unsqueeze(0) * dx.unsqueeze(1)).double()  # [M, N, G]: the fp32 product the op takes
    y = (scale * dots).sum(-1)
    if mw is not None:
        y = y + sx.double() @ mw.double().T
    return y


def op_q4(x, w):
    qs, d, m, _ = w
    return torch.ops.dpserve.q4q8_linear(x, qs, d, m)


def op_q8(x, w):
    qs, d = w
    return torch.ops.dpserve.q8q8_linear(x, qs, d)


def case(name: str, n: int, k: int, seed: int):
    """(weights, op, reference) of q4q8_linear ("q4") or q8q8_linear ("q8")."""
    if name == "q4":
        w = q4_weights(n, k, seed)
        return w, op_q4, lambda x: reference(x, w[3], w[1], w[2])
    w = q8_weights(n, k, seed)
    return w, op_q8, lambda x: reference(x, *w)


@pytest.mark.parametrize("k, n", SHAPES)
def test_q4q8_is_the_quantized_math_and_near_the_fp32_op(k, n):
    w = q4_weights(n, k)
    qs, d, m, nibbles = w
    for rows in ROWS:
        x = activations(rows, k, seed=rows)
        y = op_q4(x, w)
        assert y.shape == (rows, n) and y.dtype == torch.float32
        ref = reference(x, nibbles, d, m)
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        fp32 = torch.ops.dpserve.q4_linear(x, qs, d, m.t().contiguous())  # the same weights on fp32 activations
        assert (y - fp32).norm() / fp32.norm() < 0.01, rows


@pytest.mark.parametrize("k, n", SHAPES)
def test_q8q8_is_the_quantized_math_and_near_the_fp32_op(k, n):
    w = q8_weights(n, k)
    qs, d = w
    for rows in ROWS:
        x = activations(rows, k, seed=rows)
        y = op_q8(x, w)
        assert y.shape == (rows, n) and y.dtype == torch.float32
        ref = reference(x, qs, d)
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        fp32 = torch.ops.dpserve.q8_linear(x, qs, d)
        assert (y - fp32).norm() / fp32.norm() < 0.01, rows


@pytest.mark.parametrize("name", ["q4", "q8"])
def test_a_row_has_the_same_bits_alone_or_in_any_batch(name):
    k, n = 320, 100
    w, op, _ = case(name, n, k, seed=2)
    x = activations(16, k, seed=3)
    batch16 = op(x, w)
    threads = torch.get_num_threads()
    try:
        for i in (0, 1, 7, 8, 15):  # first / last of a block of 8, the block after it, the remainder
            alone = op(x[i : i + 1], w)
            assert torch.equal(alone[0], batch16[i]), i
            three = torch.cat([x[(i + 1) % 16 : (i + 1) % 16 + 1], x[i : i + 1], x[(i + 5) % 16 : (i + 5) % 16 + 1]])
            assert torch.equal(op(three, w)[1], alone[0]), i
        torch.set_num_threads(1)
        assert torch.equal(op(x, w), batch16)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["q4", "q8"])
def test_zero_and_tiny_groups_give_zero_scales_not_nan(name):
    k, n = 96, 40
    w, op, ref = case(name, n, k, seed=4)
    x = activations(4, k, seed=5)
    x[:, :32] = 0  # a zero group in every row
    x[1] = 0  # a zero row
    x[2, 32:64] = 1e-35  # a group too small to scale: taken as zeros
    y = op(x, w)
    assert torch.isfinite(y).all()
    assert torch.count_nonzero(y[1]) == 0  # no activation, no output (the minima's term is m * 0)
    torch.testing.assert_close(y.double(), ref(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["q4", "q8"])
def test_a_non_finite_activation_spoils_its_row_only(name):
    k, n = 96, 40
    w, op, _ = case(name, n, k, seed=6)
    x = activations(3, k, seed=7)
    clean = op(x, w)
    x[1, 40] = float("nan")
    y = op(x, w)
    assert torch.isnan(y[1]).all()
    assert torch.equal(y[[0, 2]], clean[[0, 2]])


@pytest.mark.parametrize("k, n", SHAPES)
def test_the_portable_code_gives_the_same_bits(k, n):
    """The portable code (what a CPU without AVX2/FMA runs) as its own ops, on this CPU: the same integer sums and
    float operations in the same order as the AVX2 code. Where the kernels were built without AVX2
    (q8act_simd() False) both ops run the portable code and this holds trivially."""
    w4, w8 = q4_weights(n, k, seed=8), q8_weights(n, k, seed=8)
    for rows in ROWS:
        x = activations(rows, k, seed=rows + 100)
        x[0, :32] = 0
        assert torch.equal(torch.ops.dpserve.q4q8_linear_portable(x, *w4[:3]), op_q4(x, w4)), rows
        assert torch.equal(torch.ops.dpserve.q8q8_linear_portable(x, *w8), op_q8(x, w8)), rows


def test_simd_code_is_built_on_an_avx2_cpu():
    from dpserve_engine.cpu_paths import detect

    flags = detect().flags
    if not {"avx2", "fma"} <= flags:
        pytest.skip("no AVX2/FMA here: the ops run the portable code")
    assert torch.ops.dpserve.q8act_simd()


def test_ops_refuse_mismatched_shapes_and_dtypes():
    qs, d, m, _ = q4_weights(32, 64)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.dpserve.q4q8_linear(torch.randn(2, 96), qs, d, m)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.dpserve.q4q8_linear(torch.randn(2, 48), qs[:, :24], d, m)  # K not a multiple of 32
    with pytest.raises(RuntimeError, match="bad dtypes"):
        torch.ops.dpserve.q4q8_linear(torch.randn(2, 64).double(), qs, d, m)
    q8, d8 = q8_weights(32, 64)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.dpserve.q8q8_linear(torch.randn(2, 96), q8, d8)
    with pytest.raises(RuntimeError, match="bad dtypes"):
        torch.ops.dpserve.q8q8_linear(torch.randn(2, 64), q8.view(torch.uint8), d8)


def test_fake_impls_give_the_output_shape_for_tracing():
    """What the compiled decode step's tracing sees (kernels.py registers them)."""
    qs, d, m, _ = q4_weights(48, 64)
    q8, d8 = q8_weights(80, 64)
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(5, 64))
        fake = [mode.from_tensor(t) for t in (qs, d, m, q8, d8)]
        assert torch.ops.dpserve.q4q8_linear(x, *fake[:3]).shape == (5, 48)
        assert torch.ops.dpserve.q8q8_linear(x, *fake[3:]).shape == (5, 80)
    x = torch.randn(3, 64)
    traced = torch.compile(lambda x: torch.ops.dpserve.q4q8_linear(x, qs, d, m) + 1, backend="aot_eager",
                           fullgraph=True)  # fmt: skip
    assert torch.equal(traced(x), torch.ops.dpserve.q4q8_linear(x, qs, d, m) + 1)
