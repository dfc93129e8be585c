// y = x @ W.T for W stored as GGUF groups of 32 weights with int8 activations, llama.cpp's way: Q4_1 weights
// (`q4q8_linear`) and Q8_0 weights (`q8q8_linear`, the tied LM head). Same layouts, shapes and dtypes as
// grouped_linear.cpp's q4_linear / q8_linear (fp32 x in, fp32 y out); kernel path "q4q8" (cpu_paths.py).
//
// Each row of x is first quantized per group of 32 as llama.cpp's Q8_1 does (with fp32 scales, not fp16):
// d_x = max|x| / 127, q_x = round(x * (1 / d_x)) in -127..127 (to nearest, ties to even), s_x = d_x * sum(q_x). Per
// output n and row i:
//   y[i, n] = sum_g (d_w[n, g] * d_x[i, g]) * (q_w[n, g, :] . q_x[i, g, :]) + sum_g m_w[n, g] * s_x[i, g]
// with the 32-term dot of a group in integers (exact) and the rest in fp32 in a fixed order (Q8_0 has no m_w term).
// This is not the fp32 model: every activation is rounded to 8 bits of its group's range (an error of up to
// d_x / 2), so outputs move by ~0.5 % and greedy tokens can differ from fp32's (README, precision section).
//
// Why: on CPUs without bf16 or VNNI (AVX2) one row's group costs about half the instructions of the
// fp32-activation kernel: the weights stay bytes (no conversion of 32 nibbles to floats), and one
// _mm256_maddubs_epi16 (unsigned weight bytes x signed activation bytes -> 16 pair sums) + _mm256_madd_epi16 with
// ones (-> 8 int32 sums of 4) replace four float multiply-adds; a conversion and an FMA with d_w * d_x fold the
// group into the sum. With several rows the weights' conversion is shared anyway, and a row's group costs about
// as many instructions either way (here a load + maddubs, madd, convert, scale and FMA; there four FMAs on loads
// and one more), so the gain is mostly at small batches (README).
// No int16 saturation: Q4_1 pairs reach 2 * 15 * 127 = 3810; Q8_0 uses the sign trick (|w| unsigned times x with
// w's sign applied: _mm256_sign_epi8), pairs up to 2 * 128 * 127 = 32512 < 32767 even for w = -128.
//
// Batch invariance: a row is quantized on its own (the same bytes and scales alone or in any batch), and every
// (i, n) is computed by one thread with the same instructions in the same order whatever M is and whichever block
// of rows i falls in, so a row's output has the same bits alone or in any batch.
//
// Portable code (CPUs without AVX2/FMA, and the `*_portable` ops on any CPU, for the tests): the same integer sums
// per lane and the same float operations in the same order (std::fma where the AVX2 code fuses), so it gives the
// AVX2 code's bits.
//
// Layout as grouped_linear.cpp: Q4_1 qs [N, K / 2] uint8 (group g's 16 bytes hold weight j in the low nibble of
// byte j and weight j + 16 in the high nibble); Q8_0 qs [N, K] int8; d, m [N, K / 32] fp32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "grouped_args.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DPSERVE_Q8_AVX2 1
#else
#define DPSERVE_Q8_AVX2 0
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace {

using dpserve_grouped::min_term;

constexpr int64_t kGroup = 32;
constexpr int kRowBlock = 8;
// A group whose largest |x| is below this is taken as zeros (d_x = 0, no division by 0 and no 1 / d_x overflow)
constexpr float kMinGroupMax = 1e-30f;

// Rows 0..M-1 of x [M, K] -> q [M, K] int8, d [M, G] and s [M, G] (Q8_1 with fp32 scales; see the top). One row at
// a time, each on its own, so a row's bytes do not depend on the batch.
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* s) {
  const int64_t G = K / kGroup;
  for (int64_t r = 0; r < M * G; ++r) {  // r: group g of row i, at x + i * K + g * 32 = x + r * 32
    const float* xg = x + r * kGroup;
    int8_t* qg = q + r * kGroup;
    float amax = 0.0f;
    bool finite = true;
    for (int j = 0; j < kGroup; ++j) {
      const float a = std::fabs(xg[j]);
      amax = std::max(amax, a);
      finite &= a <= FLT_MAX;  // false for inf and NaN
    }
    if (!finite) {  // NaN reaches the row's outputs through the scale (the fp32 kernels give inf or NaN there)
      std::fill(qg, qg + kGroup, int8_t{0});
      d[r] = s[r] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    if (amax < kMinGroupMax) {  // zero group: scale 0, no 0 / 0
      std::fill(qg, qg + kGroup, int8_t{0});
      d[r] = s[r] = 0.0f;
      continue;
    }
    const float dg = amax / 127.0f, inv = 1.0f / dg;
    int32_t sum = 0;
    for (int j = 0; j < kGroup; ++j) {
      // |x * inv| <= 127 up to a rounding of inv, which cannot reach 127.5; clamped all the same
      const float v = std::min(127.0f, std::max(-127.0f, std::nearbyint(xg[j] * inv)));
      qg[j] = static_cast<int8_t>(v);
      sum += qg[j];
    }
    d[r] = dg;
    s[r] = dg * static_cast<float>(sum);
  }
}

// The 8 lanes of an accumulator summed in hsum8's order (grouped_args.h).
inline float lane_sum(const float* a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// Rows 0..MB-1 (quantized: xq row stride K, scales dx row stride G) against one output's groups:
// dot[i] = sum_g (d[g] * dx[i, g]) * (q_g . xq_i,g). Lane l of a group's sum holds the products of bytes
// 4l..4l+3 (what _mm256_madd_epi16 of the pair sums gives), and lane l of the accumulator sums those.
template <int MB, typename Q>
inline void portable_dots(const int8_t* xq, const float* dx, int64_t K, int64_t G, const Q* q, const float* d,
                          float* dot) {
  float acc[MB][8] = {};
  for (int64_t g = 0; g < G; ++g) {
    int32_t w[kGroup];
    if constexpr (std::is_same_v<Q, uint8_t>) {
      const uint8_t* qg = q + g * 16;
      for (int j = 0; j < 16; ++j) {
        w[j] = qg[j] & 0x0F;
        w[j + 16] = qg[j] >> 4;
      }
    } else {
      for (int j = 0; j < kGroup; ++j) w[j] = q[g * kGroup + j];
    }
    for (int i = 0; i < MB; ++i) {
      const int8_t* xg = xq + i * K + g * kGroup;
      const float scale = d[g] * dx[i * G + g];
      for (int l = 0; l < 8; ++l) {
        int32_t t = 0;
        for (int j = 4 * l; j < 4 * l + 4; ++j) t += w[j] * xg[j];
        acc[i][l] = std::fma(scale, static_cast<float>(t), acc[i][l]);
      }
    }
  }
  for (int i = 0; i < MB; ++i) dot[i] = lane_sum(acc[i]);
}

#if DPSERVE_Q8_AVX2

using dpserve_grouped::hsum8;

// Unsigned bytes u times signed bytes s: 8 int32 sums of 4 products (bytes 4l..4l+3 in lane l), as floats.
inline __m256 int_dot(__m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);                          // 16 int16 sums of 2
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));  // 8 int32 sums of 4, exact in fp32
}

template <int MB>
inline void q4q8_dots(const int8_t* xq, const float* dx, int64_t K, int64_t G, const uint8_t* q, const float* d,
                      float* dot) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    // the group's 32 weights as bytes 0..15 in x's order: low nibbles (weights 0..15), then high (16..31)
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16));
    const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), low);
    const __m256 dg = _mm256_broadcast_ss(d + g);
    for (int i = 0; i < MB; ++i) {
      const __m256i xg = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * K + g * kGroup));
      const __m256 scale = _mm256_mul_ps(dg, _mm256_broadcast_ss(dx + i * G + g));
      acc[i] = _mm256_fmadd_ps(scale, int_dot(w, xg), acc[i]);
    }
  }
  for (int i = 0; i < MB; ++i) dot[i] = hsum8(acc[i]);
}

template <int MB>
inline void q8q8_dots(const int8_t* xq, const float* dx, int64_t K, int64_t G, const int8_t* q, const float* d,
                      float* dot) {
  __m256 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * kGroup));
    const __m256i abs_w = _mm256_sign_epi8(w, w);  // |w| as unsigned bytes (-128 -> 128)
    const __m256 dg = _mm256_broadcast_ss(d + g);
    for (int i = 0; i < MB; ++i) {
      const __m256i xg = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * K + g * kGroup));
      const __m256 scale = _mm256_mul_ps(dg, _mm256_broadcast_ss(dx + i * G + g));
      // x with w's sign (0 where w is 0): |w| * sign(w) x = w x
      acc[i] = _mm256_fmadd_ps(scale, int_dot(abs_w, _mm256_sign_epi8(xg, w)), acc[i]);
    }
  }
  for (int i = 0; i < MB; ++i) dot[i] = hsum8(acc[i]);
}

#endif

template <int MB, typename Q, bool kSimd>
inline void dots(const int8_t* xq, const float* dx, int64_t K, int64_t G, const Q* q, const float* d, float* dot) {
#if DPSERVE_Q8_AVX2
  if constexpr (kSimd) {
    if constexpr (std::is_same_v<Q, uint8_t>)
      q4q8_dots<MB>(xq, dx, K, G, q, d, dot);
    else
      q8q8_dots<MB>(xq, dx, K, G, q, d, dot);
    return;
  }
#endif
  portable_dots<MB, Q>(xq, dx, K, G, q, d, dot);
}

// Outputs n0..n1 of rows 0..MB-1. Q4_1 adds the minima's term, sum_g m[n, g] * s[i, g]; Q8_0 has none (m null).
template <int MB, typename Q, bool kSimd>
void block(const int8_t* xq, const float* dx, const float* sx, int64_t K, int64_t G, const Q* qs, int64_t row_bytes,
           const float* d, const float* m, int64_t n0, int64_t n1, float* out, int64_t N) {
  float dot[MB];
  for (int64_t n = n0; n < n1; ++n) {
    dpserve_grouped::prefetch_ahead(n, n1, qs, row_bytes, d, m, G);
    dots<MB, Q, kSimd>(xq, dx, K, G, qs + n * row_bytes, d + n * G, dot);
    if constexpr (std::is_same_v<Q, uint8_t>) {
      for (int i = 0; i < MB; ++i) out[i * N + n] = dot[i] + min_term(m + n * G, sx + i * G, G);
    } else {
      for (int i = 0; i < MB; ++i) out[i * N + n] = dot[i];
    }
  }
}

template <typename Q>
using BlockFn = void (*)(const int8_t*, const float*, const float*, int64_t, int64_t, const Q*, int64_t, const float*,
                         const float*, int64_t, int64_t, float*, int64_t);

template <typename Q, bool kSimd>
constexpr BlockFn<Q> kBlocks[kRowBlock] = {block<1, Q, kSimd>, block<2, Q, kSimd>, block<3, Q, kSimd>,
                                           block<4, Q, kSimd>, block<5, Q, kSimd>, block<6, Q, kSimd>,
                                           block<7, Q, kSimd>, block<8, Q, kSimd>};

template <typename Q, bool kSimd>
at::Tensor q8act_linear(const char* name, const at::Tensor& x_in, const at::Tensor& qs_in, const at::Tensor& d_in,
                        const at::Tensor* m_in, int64_t weights_per_byte, at::ScalarType q_type) {
  // x [M, K] fp32; qs [N, K / weights_per_byte]; d (and m) [N, K / 32] fp32 -> [M, N] fp32
  const dpserve_grouped::Args a = dpserve_grouped::prepare(name, x_in, qs_in, d_in, m_in, weights_per_byte, q_type);
  const int64_t M = a.M, K = a.K, N = a.N, G = a.G;
  const at::Tensor &x = a.x, &qs = a.qs, &d = a.d, &m = a.m;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  // the activations as Q8_1 groups: bytes, scales and (for the minima's term) scaled sums
  at::Tensor xq_t = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor dx_t = at::empty({M, G}, x.options()), sx_t = at::empty({M, G}, x.options());
  int8_t* xq = xq_t.data_ptr<int8_t>();
  float* dx = dx_t.data_ptr<float>();
  float* sx = sx_t.data_ptr<float>();
  quantize_rows(x.data_ptr<float>(), M, K, xq, dx, sx);
  const Q* qp = static_cast<const Q*>(qs.data_ptr());
  const float* dp = d.data_ptr<float>();
  const float* mp = m_in ? m.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = K / weights_per_byte;
  at::parallel_for(0, N, dpserve_grouped::output_grain(K, M, kRowBlock), [&](int64_t n0, int64_t n1) {
    for (int64_t i0 = 0; i0 < M; i0 += kRowBlock) {
      const int64_t mb = std::min<int64_t>(kRowBlock, M - i0);
      kBlocks<Q, kSimd>[mb - 1](xq + i0 * K, dx + i0 * G, sx + i0 * G, K, G, qp, row_bytes, dp, mp, n0, n1,
                                op + i0 * N, N);
    }
  });
  return out;
}

at::Tensor q4q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  return q8act_linear<uint8_t, true>("q4q8_linear", x, qs, d, &m, 2, at::kByte);
}

at::Tensor q8q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  return q8act_linear<int8_t, true>("q8q8_linear", x, qs, d, nullptr, 1, at::kChar);
}

// The portable code on any CPU (the AVX2 code's bits; for the tests)
at::Tensor q4q8_linear_portable(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  return q8act_linear<uint8_t, false>("q4q8_linear_portable", x, qs, d, &m, 2, at::kByte);
}

at::Tensor q8q8_linear_portable(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  return q8act_linear<int8_t, false>("q8q8_linear_portable", x, qs, d, nullptr, 1, at::kChar);
}

// Whether q4q8_linear / q8q8_linear run the AVX2 code (else the portable code)
bool q8act_simd() { return DPSERVE_Q8_AVX2; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(dpserve, lib) {
  lib.def("q4q8_linear(Tensor x, Tensor qs, Tensor d, Tensor m) -> Tensor");
  lib.def("q8q8_linear(Tensor x, Tensor qs, Tensor d) -> Tensor");
  lib.def("q4q8_linear_portable(Tensor x, Tensor qs, Tensor d, Tensor m) -> Tensor");
  lib.def("q8q8_linear_portable(Tensor x, Tensor qs, Tensor d) -> Tensor");
  lib.def("q8act_simd() -> bool", &q8act_simd);  // no tensors to dispatch on: one kernel for every backend
}

TORCH_LIBRARY_IMPL(dpserve, CPU, lib) {
  lib.impl("q4q8_linear", &q4q8_linear);
  lib.impl("q8q8_linear", &q8q8_linear);
  lib.impl("q4q8_linear_portable", &q4q8_linear_portable);
  lib.impl("q8q8_linear_portable", &q8q8_linear_portable);
}
