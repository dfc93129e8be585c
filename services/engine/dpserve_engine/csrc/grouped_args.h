// What the grouped-kernel ops (grouped_linear.cpp: fp32 activations, grouped_linear_q8.cpp: int8 activations) share:
// the argument checks and contiguous inputs, how finely the outputs are split among threads, and the fixed-order
// sums both use (the minima's term, the 8 lanes of an AVX2 accumulator). x [M, K] fp32; qs [N, K / weights_per_byte] of `q_type`; d (and m for Q4_1) [N, K / 32] fp32.
#pragma once

#include <ATen/core/Tensor.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

namespace dpserve_grouped {

struct Args {
  int64_t M, K, N, G;    // rows, input features, outputs, groups of 32 a row
  at::Tensor x, qs, d, m;  // contiguous; m undefined without minima (Q8_0)
};

// m_transposed: the minima come as [K / 32, N] (q4_linear's layout) instead of d's [N, K / 32].
inline Args prepare(const char* name, const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                    const at::Tensor* m, int64_t weights_per_byte, at::ScalarType q_type,
                    bool m_transposed = false) {
  TORCH_CHECK(x.dim() == 2 && qs.dim() == 2 && d.dim() == 2, name, ": bad ranks");
  TORCH_CHECK(x.scalar_type() == at::kFloat && d.scalar_type() == at::kFloat && qs.scalar_type() == q_type, name,
              ": bad dtypes");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), G = K / 32;
  TORCH_CHECK(K % 32 == 0 && qs.size(1) == K / weights_per_byte && d.size(0) == N && d.size(1) == G, name,
              ": shapes do not match");
  TORCH_CHECK(m == nullptr || (m->scalar_type() == at::kFloat && m->dim() == 2 &&
                                m->size(0) == (m_transposed ? G : N) && m->size(1) == (m_transposed ? N : G)),
              name, ": minima do not match the scales");
  return {M, K, N, G, x.contiguous(), qs.contiguous(), d.contiguous(), m ? m->contiguous() : at::Tensor()};
}

// Outputs a thread takes at least: ~8 K flops an output and row (of up to `row_block` rows a pass), so that a
// thread's share is worth waking it for.
inline int64_t output_grain(int64_t K, int64_t M, int64_t row_block) {
  return std::max<int64_t>(16, 32768 / (K * std::min<int64_t>(M, row_block)));
}

// The kernels walk W output by output (one row of qs, d and m each); they ask for the row kPrefetchRows ahead
// while computing this one. The hardware prefetchers alone left a step waiting on memory: a batch-1 Q4_1 group
// took ~14 cycles with W out of cache against ~5 in it, ~6 with this (AVX2 code, 2026-12-05). A hint only: the
// arithmetic, and so every output bit, is unchanged.
constexpr int64_t kPrefetchRows = 8;
// (asm volatile on x86: GCC's dead-code pass deletes a loop of __builtin_prefetch calls, which have no effect it
// can see, in some of the inlined sites and not in others.)
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) {
#if defined(__x86_64__) || defined(__i386__)
    asm volatile("prefetcht0 %0" : : "m"(c[b]));
#else
    __builtin_prefetch(c + b, 0, 3);
#endif
  }
}
template <typename Q>
inline void prefetch_ahead(int64_t n, int64_t n1, const Q* qs, int64_t row_bytes, const float* d, const float* m,
                           int64_t G) {
  const int64_t ahead = n + kPrefetchRows;
  if (ahead >= n1) return;  // past this thread's outputs: another thread's, or past W
  prefetch_bytes(qs + ahead * row_bytes, row_bytes * static_cast<int64_t>(sizeof(Q)));
  prefetch_bytes(d + ahead * G, G * static_cast<int64_t>(sizeof(float)));
  if (m) prefetch_bytes(m + ahead * G, G * static_cast<int64_t>(sizeof(float)));
}

// sum_g m[g] * s[g], in a fixed order: Q4_1's minima term (s: the group sums of a row's activations).
inline float min_term(const float* m, const float* s, int64_t G) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t g = 0;
  for (; g + 8 <= G; g += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += m[g + l] * s[g + l];
  float t = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  for (; g < G; ++g) t += m[g] * s[g];
  return t;
}

#if defined(__AVX2__) && defined(__FMA__)
// The 8 lanes summed in a fixed tree: ((0+4) + (2+6)) + ((1+5) + (3+7)).
inline float hsum8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);                   // lanes (0+4, 1+5, 2+6, 3+7)
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));          // (0+4 + 2+6, 1+5 + 3+7)
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}
#endif

}  // namespace dpserve_grouped
