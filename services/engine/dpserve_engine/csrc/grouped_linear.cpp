// y = x @ W.T for W stored as GGUF groups of 32 weights with fp32 activations: Q4_1 (w = d * q + m, q in 0..15;
// `q4_linear`) and Q8_0 (w = d * q, q in -127..127; `q8_linear`, the tied LM head).
//
// For CPUs without hardware bf16 (AVX2), where torch's int4 kernel (bf16 activations), its int8 kernel and bf16
// GEMMs run emulated. Per output n and row i: y[i, n] = sum_g d[n, g] * (q[n, g, :] . x[i, g, :]) + sum_g m[n, g] * sx[i, g]
// with sx[i, g] the sum of the group's 32 activations. That is the dequantized fp32 matmul with the sums taken
// in another order: the weights are the file's own, in fp32, no activation is rounded. The minima's term is a
// pass of its own over the thread's outputs, tiles of 16 outputs by up to 4 rows (m transposed, [K / 32, N]; `min_terms`), each output's sum
// taken over g in order with fused multiply-adds: in the per-output loop it took ~18 % of the kernel at 8+ rows
// (a short horizontal sum per row and output; 2026-12-06).
//
// Batch invariance: every (i, n) is computed by one thread with the same instructions in the same order whatever
// M is and whichever block of rows i falls in, so a row's output has the same bits alone or in any batch.
// Work: threads split the outputs n; each decodes a group's nibbles once and uses them for up to kRowBlock rows.
//
// Layout (quantized.py `GroupedLinear`): Q4_1 qs [N, K / 2] uint8, the file's bytes (group g's 16 bytes hold weight
// j in the low nibble of byte j and weight j + 16 in the high nibble); Q8_0 qs [N, K] int8; d [N, K / 32] fp32; Q4_1's
// m transposed, [K / 32, N] fp32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "grouped_args.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int64_t kGroup = 32;
constexpr int kRowBlock = 8;
constexpr int64_t kTileBytes = 256 * 1024;  // of W, done for every block of rows in turn (in L2)

// Sum of n floats in a fixed order (8 lanes, then the lanes in a fixed tree, then the tail).
inline float fixed_sum(const float* a, int64_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += a[i + l];
  float s = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  for (; i < n; ++i) s += a[i];
  return s;
}

#if defined(__AVX2__) && defined(__FMA__)

using dpserve_grouped::hsum8;

// Rows 0..MB-1 of x (row stride K) against one output's groups: dot[i] = sum_g d[g] * (q_g . x_i,g).
template <int MB>
inline void q4_dots(const float* x, int64_t K, const uint8_t* q, const float* d, int64_t G, float* dot) {
  const __m256i low = _mm256_set1_epi32(0x0F);
  __m256 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* qg = q + g * 16;
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qg)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qg + 8)));
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low));  // weights 0..7
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low));  // 8..15
    const __m256 w2 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));   // 16..23
    const __m256 w3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));   // 24..31
    const __m256 dg = _mm256_broadcast_ss(d + g);
    for (int i = 0; i < MB; ++i) {
      const float* xg = x + i * K + g * kGroup;
      __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
      t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), t);
      t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), t);
      t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), t);
      acc[i] = _mm256_fmadd_ps(dg, t, acc[i]);
    }
  }
  for (int i = 0; i < MB; ++i) dot[i] = hsum8(acc[i]);
}

// The same for Q8_0 groups (32 signed bytes, no minimum).
template <int MB>
inline void q8_dots(const float* x, int64_t K, const int8_t* q, const float* d, int64_t G, float* dot) {
  __m256 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int8_t* qg = q + g * kGroup;
    // four named vectors, not an array: with an array GCC kept the accumulators on the stack (a store and a load
    // per row and group; ~25 % slower than the Q4_1 kernel at 8 rows)
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qg))));
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qg + 8))));
    const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qg + 16))));
    const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qg + 24))));
    const __m256 dg = _mm256_broadcast_ss(d + g);
    for (int i = 0; i < MB; ++i) {
      const float* xg = x + i * K + g * kGroup;
      __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
      t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), t);
      t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), t);
      t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), t);
      acc[i] = _mm256_fmadd_ps(dg, t, acc[i]);
    }
  }
  for (int i = 0; i < MB; ++i) dot[i] = hsum8(acc[i]);
}

#else  // portable: the same sums in the same order, without intrinsics

// w[0..32) of one group, as floats in the order the AVX2 code pairs them with x
inline void unpack(const uint8_t* qg, float* w) {
  for (int j = 0; j < 16; ++j) {
    w[j] = static_cast<float>(qg[j] & 0x0F);
    w[j + 16] = static_cast<float>(qg[j] >> 4);
  }
}
inline void unpack(const int8_t* qg, float* w) {
  for (int j = 0; j < 32; ++j) w[j] = static_cast<float>(qg[j]);
}

template <int MB, typename Q, int64_t kGroupBytes>
inline void portable_dots(const float* x, int64_t K, const Q* q, const float* d, int64_t G, float* dot) {
  float acc[MB][8] = {};
  for (int64_t g = 0; g < G; ++g) {
    float w[32];
    unpack(q + g * kGroupBytes, w);
    for (int i = 0; i < MB; ++i) {
      const float* xg = x + i * K + g * kGroup;
      for (int l = 0; l < 8; ++l) {
        float t = w[l] * xg[l];
        t = w[l + 8] * xg[l + 8] + t;
        t = w[l + 16] * xg[l + 16] + t;
        t = w[l + 24] * xg[l + 24] + t;
        acc[i][l] = d[g] * t + acc[i][l];
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    const float* a = acc[i];
    dot[i] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
  }
}
template <int MB>
inline void q4_dots(const float* x, int64_t K, const uint8_t* q, const float* d, int64_t G, float* dot) {
  portable_dots<MB, uint8_t, 16>(x, K, q, d, G, dot);
}
template <int MB>
inline void q8_dots(const float* x, int64_t K, const int8_t* q, const float* d, int64_t G, float* dot) {
  portable_dots<MB, int8_t, 32>(x, K, q, d, G, dot);
}

#endif

#if defined(__AVX2__) && defined(__FMA__)
// R rows (s: their sx rows) of the minima's term for the 16 outputs at n, into out (row stride N).
template <int R>
inline void min_tile(const float* mt, const float* s, int64_t G, int64_t N, int64_t n, float* out) {
  __m256 lo[R], hi[R];
  for (int j = 0; j < R; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const __m256 m0 = _mm256_loadu_ps(mt + g * N + n), m1 = _mm256_loadu_ps(mt + g * N + n + 8);
    for (int j = 0; j < R; ++j) {
      const __m256 sv = _mm256_broadcast_ss(s + j * G + g);
      lo[j] = _mm256_fmadd_ps(m0, sv, lo[j]);
      hi[j] = _mm256_fmadd_ps(m1, sv, hi[j]);
    }
  }
  for (int j = 0; j < R; ++j) {
    _mm256_storeu_ps(out + j * N + n, lo[j]);
    _mm256_storeu_ps(out + j * N + n + 8, hi[j]);
  }
}
#endif

// Q4_1's minima term of outputs n0..n1 of rows 0..M-1, into out: out[i, n] = sum_g mt[g, n] * sx[i, g], summed
// over g in order, each step one fused multiply-add from 0 (the same bits in a vector lane and in the scalar tail,
// whichever outputs a thread got). 16 outputs and up to 4 rows a pass: up to 8 independent sums, each mt vector
// loaded once for the rows.
void min_terms(const float* mt, const float* sx, int64_t G, int64_t N, int64_t M, int64_t n0, int64_t n1, float* out) {
  int64_t n = n0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; n + 16 <= n1; n += 16) {
    int64_t i = 0;
    for (; i + 4 <= M; i += 4) min_tile<4>(mt, sx + i * G, G, N, n, out + i * N);
    switch (M - i) {
      case 3: min_tile<3>(mt, sx + i * G, G, N, n, out + i * N); break;
      case 2: min_tile<2>(mt, sx + i * G, G, N, n, out + i * N); break;
      case 1: min_tile<1>(mt, sx + i * G, G, N, n, out + i * N); break;
      default: break;
    }
  }
#endif
  for (; n < n1; ++n) {
    for (int64_t i = 0; i < M; ++i) {
      float a = 0.0f;
      for (int64_t g = 0; g < G; ++g) a = std::fma(mt[g * N + n], sx[i * G + g], a);
      out[i * N + n] = a;
    }
  }
}

// Outputs n0..n1 of rows 0..MB-1. Q4_1 adds the minima's term that min_terms left in out; Q8_0 has none (m null).
// (`prefetch_end`: the thread's last output, past which nothing is prefetched.)
template <int MB, typename Q>
void block(const float* x, int64_t K, const Q* qs, int64_t row_bytes, const float* d, int64_t G, int64_t n0,
           int64_t n1, int64_t prefetch_end, float* out, int64_t N) {
  float dot[MB];
  for (int64_t n = n0; n < n1; ++n) {
    dpserve_grouped::prefetch_ahead(n, prefetch_end, qs, row_bytes, d, static_cast<const float*>(nullptr), G);
    if constexpr (sizeof(Q) == 1 && std::is_same_v<Q, uint8_t>) {
      q4_dots<MB>(x, K, qs + n * row_bytes, d + n * G, G, dot);
      for (int i = 0; i < MB; ++i) out[i * N + n] = dot[i] + out[i * N + n];
    } else {
      q8_dots<MB>(x, K, qs + n * row_bytes, d + n * G, G, dot);
      for (int i = 0; i < MB; ++i) out[i * N + n] = dot[i];
    }
  }
}

template <typename Q>
using BlockFn = void (*)(const float*, int64_t, const Q*, int64_t, const float*, int64_t, int64_t, int64_t, int64_t,
                         float*, int64_t);

template <typename Q>
constexpr BlockFn<Q> kBlocks[kRowBlock] = {block<1, Q>, block<2, Q>, block<3, Q>, block<4, Q>,
                                           block<5, Q>, block<6, Q>, block<7, Q>, block<8, Q>};

template <typename Q>
at::Tensor grouped_linear(const char* name, const at::Tensor& x_in, const at::Tensor& qs_in, const at::Tensor& d_in,
                          const at::Tensor* m_in, int64_t weights_per_byte, at::ScalarType q_type) {
  // x [M, K] fp32; qs [N, K / weights_per_byte]; d (and m) [N, K / 32] fp32 -> [M, N] fp32
  const dpserve_grouped::Args a =
      dpserve_grouped::prepare(name, x_in, qs_in, d_in, m_in, weights_per_byte, q_type, /*m_transposed=*/true);
  const int64_t M = a.M, K = a.K, N = a.N, G = a.G;
  const at::Tensor &x = a.x, &qs = a.qs, &d = a.d, &m = a.m;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  at::Tensor sx_t;
  const float* sx = nullptr;
  if (m_in) {  // per row and group, the sum of the group's activations (for the minima's term)
    sx_t = at::empty({M, G}, x.options());
    float* s = sx_t.data_ptr<float>();
    for (int64_t i = 0; i < M; ++i)
      for (int64_t g = 0; g < G; ++g) s[i * G + g] = fixed_sum(xp + i * K + g * kGroup, kGroup);
    sx = s;
  }
  const Q* qp = static_cast<const Q*>(qs.data_ptr());
  const float* dp = d.data_ptr<float>();
  const float* mp = m_in ? m.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = K / weights_per_byte;
  // Past kRowBlock rows, each block of rows walks W again: a tile of outputs (~kTileBytes of W) is done for every
  // block of rows before the next tile, so W comes from memory once (the Q8_0 head, 28 MB, was read twice a step
  // at 9-16 rows) and the later blocks find it in cache. The same sums for every (i, n) as without tiles.
  const int64_t tile = M <= kRowBlock ? N : std::max<int64_t>(16, kTileBytes / (row_bytes * int64_t(sizeof(Q))));
  at::parallel_for(0, N, dpserve_grouped::output_grain(K, M, kRowBlock), [&](int64_t n0, int64_t n1) {
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
      const int64_t t1 = std::min(n1, t0 + tile);
      for (int64_t i0 = 0; i0 < M; i0 += kRowBlock) {
        const int64_t mb = std::min<int64_t>(kRowBlock, M - i0);
        if (mp) min_terms(mp, sx + i0 * G, G, N, mb, t0, t1, op + i0 * N);
        kBlocks<Q>[mb - 1](xp + i0 * K, K, qp, row_bytes, dp, G, t0, t1, n1, op + i0 * N, N);
      }
    }
  });
  return out;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& mt) {
  return grouped_linear<uint8_t>("q4_linear", x, qs, d, &mt, 2, at::kByte);
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  return grouped_linear<int8_t>("q8_linear", x, qs, d, nullptr, 1, at::kChar);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dpserve, lib) {
  lib.def("q4_linear(Tensor x, Tensor qs, Tensor d, Tensor mt) -> Tensor");
  lib.def("q8_linear(Tensor x, Tensor qs, Tensor d) -> Tensor");
}

TORCH_LIBRARY_IMPL(dpserve, CPU, lib) {
  lib.impl("q4_linear", &q4_linear);
  lib.impl("q8_linear", &q8_linear);
}
