// The argument checks and shapes shared by the grouped-kernel ops (grouped_linear.cpp: fp32 activations,
// grouped_linear_q8.cpp: int8 activations): x [M, K] fp32; qs [N, K / weights_per_byte] of `q_type`; d (and m for
// Q4_1) [N, K / 32] fp32.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace dpserve_grouped {

struct Shape {
  int64_t M, K, N, G;  // rows, input features, outputs, groups of 32 a row
};

inline Shape check_args(const char* name, const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                        const at::Tensor* m, int64_t weights_per_byte, at::ScalarType q_type) {
  TORCH_CHECK(x.dim() == 2 && qs.dim() == 2 && d.dim() == 2, name, ": bad ranks");
  TORCH_CHECK(x.scalar_type() == at::kFloat && d.scalar_type() == at::kFloat && qs.scalar_type() == q_type, name,
              ": bad dtypes");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), G = K / 32;
  TORCH_CHECK(K % 32 == 0 && qs.size(1) == K / weights_per_byte && d.size(0) == N && d.size(1) == G, name,
              ": shapes do not match");
  TORCH_CHECK(m == nullptr || (m->scalar_type() == at::kFloat && m->sizes() == d.sizes()), name,
              ": minima do not match the scales");
  return {M, K, N, G};
}

}  // namespace dpserve_grouped
