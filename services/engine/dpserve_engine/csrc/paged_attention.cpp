// One-token decode attention over the paged KV cache, for the compiled decode step (kernels.py, compiled.py).
//
// What the eager path does with a gather, two batched matmuls and a masked softmax (model.py `_decode`), in one
// pass that reads each sequence's K/V rows where they lie in the cache: no gathered copy, no padding to the
// longest sequence, no mask. Each (sequence, kv head) pair is one work item: its G query heads score the
// sequence's positions 0..pos, take a softmax and sum V. Items are independent, computed whole by one thread and
// always summed in the same order, so a sequence's output does not depend on what else is in the batch, nor on
// how the items were split among the threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// The lanes of v summed (a fixed tree of shuffles and adds).
inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// Dot product of two rows of n floats, always summed in the same order.
inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.0f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  }
  float sum = hsum(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// a[0..n) += p * v[0..n)
inline void axpy(float* a, float p, const float* v, int64_t n) {
  const Vec vp(p);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    at::vec::fmadd(vp, Vec::loadu(v + i), Vec::loadu(a + i)).store(a + i);
  }
  for (; i < n; ++i) a[i] += p * v[i];
}

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table_in, const at::Tensor& positions_in,
                                  int64_t block_size, double scale) {
  // q [D, H, hd] fp32; k_cache, v_cache [Hkv, slots, hd] fp32 (contiguous); block_table [D, nb] and positions
  // [D] int64 -> out [D, H, hd]: for row d, attention over cache positions 0..positions[d].
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "paged_decode_attention: bad ranks");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat, "paged_decode_attention: fp32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode_attention: cache not contiguous");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor block_table = block_table_in.contiguous();
  const at::Tensor positions = positions_in.contiguous();
  const int64_t D = q.size(0), H = q.size(1), hd = q.size(2);
  const int64_t Hkv = k_cache.size(0), slots = k_cache.size(1), nb = block_table.size(1);
  TORCH_CHECK(H % Hkv == 0 && k_cache.size(2) == hd && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: shapes");
  const int64_t G = H / Hkv;
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  for (int64_t d = 0; d < D; ++d) {
    TORCH_CHECK(pos[d] >= 0 && pos[d] < nb * block_size, "paged_decode_attention: position past the block table");
  }
  // Items of fewer than ~16k multiply-adds each (short contexts) go to a thread in groups.
  // Items: (sequence d, kv head h), each costing its context length (its G query heads share the K/V rows read).
  // The threads take contiguous runs of items of about equal cost, so that a lone sequence's heads spread over
  // the threads (split by item count, they all went to one thread while another took the padding rows). Small
  // steps stay on one thread.
  const int64_t items = D * Hkv;
  if (items == 0) return out;
  std::vector<int64_t> prefix(items + 1, 0);  // prefix[i]: cost of items 0..i-1
  for (int64_t i = 0; i < items; ++i) prefix[i + 1] = prefix[i] + pos[i / Hkv] + 1 + 8;  // + 8: an item's overhead
  const int64_t total = prefix[items];
  const int64_t chunks =
      std::clamp<int64_t>(total * G * hd * 2 / 16384, 1, std::min<int64_t>(items, at::get_num_threads()));
  const auto item_at = [&](int64_t c) {  // first item of chunk c
    return static_cast<int64_t>(std::lower_bound(prefix.begin(), prefix.end(), total * c / chunks) - prefix.begin());
  };
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> scores;
    std::vector<float> acc(G * hd);
    for (int64_t item = item_at(c0); item < std::min(items, item_at(c1)); ++item) {
      const int64_t d = item / Hkv, h = item % Hkv, len = pos[d] + 1;
      const float* qd = qp + (d * H + h * G) * hd;  // this kv head's G query heads
      const float* kh = kp + h * slots * hd;
      const float* vh = vp + h * slots * hd;
      const int64_t* td = table + d * nb;
      scores.resize(G * len);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {  // block by block: no division per position
        const float* krow = kh + td[t0 / block_size] * block_size * hd;
        for (int64_t t = t0; t < std::min(len, t0 + block_size); ++t, krow += hd) {
          for (int64_t g = 0; g < G; ++g) scores[g * len + t] = dot(qd + g * hd, krow, hd) * fscale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {  // softmax over positions, in place
        float* s = scores.data() + g * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) m = std::max(m, s[t]);
        int64_t t = 0;
        Vec vsum(0.0f), vm(m);
        for (; t + Vec::size() <= len; t += Vec::size()) {
          Vec e = (Vec::loadu(s + t) - vm).exp_u20();
          e.store(s + t);
          vsum = vsum + e;
        }
        float sum = hsum(vsum);
        for (; t < len; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        const float inv = 1.0f / sum;
        for (t = 0; t < len; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const float* vrow = vh + td[t0 / block_size] * block_size * hd;
        for (int64_t t = t0; t < std::min(len, t0 + block_size); ++t, vrow += hd) {
          for (int64_t g = 0; g < G; ++g) axpy(acc.data() + g * hd, scores[g * len + t], vrow, hd);
        }
      }
      std::copy(acc.begin(), acc.end(), op + (d * H + h * G) * hd);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(dpserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor positions, "
        "int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(dpserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
