// ATen-level half of the rotary op: validation and planning (rotary.cpp), shared
// with the CUDA entry points (rotary_cuda.cu). Kept separate from rotary.h so the
// device code never needs ATen headers.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <vector>

#include "rotary.h"

namespace ftshims_rotary {

struct Launch {
  Params params;
  at::ScalarType dtype = at::kFloat;  // storage dtype of q/k
  bool cos_is_float = false;          // cos/sin stored as fp32 (instead of the storage dtype)
  bool empty = false;                 // nothing to rotate (zero-sized input)
  std::vector<at::Tensor> keep;       // temporaries the params point into
};

// Validates every argument (raising ValueError through TORCH_CHECK_VALUE before
// any kernel runs), copies the pass-through tail of out-of-place outputs, and
// fills the launch description. `q_out`/`k_out` are the outputs (== inputs in place).
Launch prepare(const at::Tensor& q, const c10::optional<at::Tensor>& k, const at::Tensor& q_out,
               const c10::optional<at::Tensor>& k_out, const c10::optional<at::Tensor>& cos,
               const c10::optional<at::Tensor>& sin, const c10::optional<at::Tensor>& inv_freq,
               const c10::optional<at::Tensor>& positions, const c10::optional<at::Tensor>& seqlen_offsets,
               const c10::optional<at::Tensor>& cu_seqlens, int64_t offset, int64_t rotary_dim, bool interleaved,
               bool conjugate, double scaling, bool inplace);

}  // namespace ftshims_rotary
