// ftshims rotary embedding: op schema, argument validation, dispatch (the CPU
// kernels are in rotary_cpu*.cpp, the CUDA kernels in rotary_cuda.cu).
//
// Ops (namespace ftshims, see ftshims/kernels/rotary.py for the public API):
//   rotary(q, k?, cos?, sin?, inv_freq?, positions?, seqlen_offsets?, cu_seqlens?,
//          offset, rotary_dim, interleaved, conjugate, scaling) -> Tensor[]   (out of place)
//   rotary_(q!, k!?, ...same...) -> ()                                       (in place)
// q and k are logical [batch, seq, heads, dim] views with any strides (varlen:
// [1, total, heads, dim] with cu_seqlens). Bad input raises ValueError
// (TORCH_CHECK_VALUE) before any kernel runs.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "rotary.h"
#include "rotary_op.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace ftshims_rotary {

namespace {

bool is_index_dtype(at::ScalarType t) { return t == at::kInt || t == at::kLong; }

bool is_storage_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

int storage_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    default: return kF64;
  }
}

void check_device(const at::Tensor& t, const at::Tensor& q, const char* name) {
  TORCH_CHECK_VALUE(t.device() == q.device(), "rotary: ", name, " is on ", t.device(), " but q is on ", q.device());
}

IndexRef index_ref(const at::Tensor& t) {
  IndexRef r;
  r.ptr = t.data_ptr();
  r.is64 = t.scalar_type() == at::kLong;
  return r;
}

}  // namespace

Launch prepare(const at::Tensor& q, const c10::optional<at::Tensor>& k, const at::Tensor& q_out,
               const c10::optional<at::Tensor>& k_out, const c10::optional<at::Tensor>& cos_opt,
               const c10::optional<at::Tensor>& sin_opt, const c10::optional<at::Tensor>& inv_freq,
               const c10::optional<at::Tensor>& positions_opt, const c10::optional<at::Tensor>& offsets_opt,
               const c10::optional<at::Tensor>& cu_opt, int64_t offset, int64_t rotary_dim, bool interleaved,
               bool conjugate, double scaling, bool inplace) {
  Launch L;
  Params& p = L.params;

  // ---- shapes and dtypes -------------------------------------------------
  TORCH_CHECK_VALUE(q.dim() == 4, "rotary: q must be 4-D [batch, seq, heads, dim], got ", q.sizes());
  TORCH_CHECK_VALUE(is_storage_dtype(q.scalar_type()),
                    "rotary: q must be float32, float16, bfloat16 or float64, got ", q.scalar_type());
  const int64_t B = q.size(0), S = q.size(1), D = q.size(3);
  const bool has_k = k.has_value() && k->defined();
  if (has_k) {
    TORCH_CHECK_VALUE(k->dim() == 4, "rotary: k must be 4-D [batch, seq, heads, dim], got ", k->sizes());
    TORCH_CHECK_VALUE(k->size(0) == B && k->size(1) == S && k->size(3) == D,
                      "rotary: k ", k->sizes(), " does not match q ", q.sizes(),
                      " in batch, seq and head_dim");
    TORCH_CHECK_VALUE(k->scalar_type() == q.scalar_type(), "rotary: k is ", k->scalar_type(), " but q is ",
                      q.scalar_type());
    check_device(*k, q, "k");
  }
  TORCH_CHECK_VALUE(rotary_dim >= 2 && rotary_dim % 2 == 0 && rotary_dim <= D,
                    "rotary: rotary_dim must be even and in [2, head_dim=", D, "], got ", rotary_dim);
  TORCH_CHECK_VALUE(std::isfinite(scaling), "rotary: scaling must be finite, got ", scaling);

  const bool has_cos = cos_opt.has_value() && cos_opt->defined();
  const bool has_sin = sin_opt.has_value() && sin_opt->defined();
  const bool has_freq = inv_freq.has_value() && inv_freq->defined();
  TORCH_CHECK_VALUE(has_cos == has_sin, "rotary: cos and sin must be given together");
  TORCH_CHECK_VALUE(has_cos != has_freq, "rotary: give either inv_freq or cos/sin (exactly one angle source)");

  const bool varlen = cu_opt.has_value() && cu_opt->defined();
  const bool has_pos = positions_opt.has_value() && positions_opt->defined();
  const bool has_off = offsets_opt.has_value() && offsets_opt->defined();

  int64_t nseq = 0;
  at::Tensor cu;
  if (varlen) {
    cu = *cu_opt;
    TORCH_CHECK_VALUE(is_index_dtype(cu.scalar_type()), "rotary: cu_seqlens must be int32 or int64, got ",
                      cu.scalar_type());
    TORCH_CHECK_VALUE(cu.dim() == 1 && cu.size(0) >= 2, "rotary: cu_seqlens must be 1-D with at least 2 entries");
    TORCH_CHECK_VALUE(B == 1, "rotary: varlen input must be [1, total, heads, dim] (batch 1), got ", q.sizes());
    check_device(cu, q, "cu_seqlens");
    cu = cu.contiguous();
    nseq = cu.size(0) - 1;
  }

  at::Tensor positions, offsets;
  if (has_pos) {
    positions = *positions_opt;
    TORCH_CHECK_VALUE(is_index_dtype(positions.scalar_type()), "rotary: positions must be int32 or int64, got ",
                      positions.scalar_type());
    TORCH_CHECK_VALUE(positions.dim() == 2 && (positions.size(0) == 1 || positions.size(0) == B) &&
                          positions.size(1) == S,
                      "rotary: positions must be [batch or 1, seq] = [", B, ", ", S, "], got ", positions.sizes());
    check_device(positions, q, "positions");
  }
  if (has_off) {
    offsets = *offsets_opt;
    TORCH_CHECK_VALUE(is_index_dtype(offsets.scalar_type()), "rotary: seqlen_offsets must be int32 or int64, got ",
                      offsets.scalar_type());
    const int64_t want = varlen ? nseq : B;
    TORCH_CHECK_VALUE(offsets.dim() == 1 && offsets.size(0) == want, "rotary: seqlen_offsets must be [", want,
                      "] (one per ", varlen ? "sequence" : "batch row", "), got ", offsets.sizes());
    check_device(offsets, q, "seqlen_offsets");
    offsets = offsets.contiguous();
  }

  at::Tensor cos, sin;
  int64_t table_rows = 0;
  if (has_freq) {
    const at::Tensor& f = *inv_freq;
    TORCH_CHECK_VALUE(f.scalar_type() == at::kFloat, "rotary: inv_freq must be float32, got ", f.scalar_type());
    TORCH_CHECK_VALUE(f.dim() == 1 && f.size(0) == rotary_dim / 2, "rotary: inv_freq must be [rotary_dim/2 = ",
                      rotary_dim / 2, "], got ", f.sizes());
    check_device(f, q, "inv_freq");
    p.mode = kInvFreq;
    p.inv_freq = f.data_ptr<float>();
    p.inv_freq_stride = f.stride(0);
  } else {
    cos = *cos_opt;
    sin = *sin_opt;
    TORCH_CHECK_VALUE(cos.sizes() == sin.sizes(), "rotary: cos ", cos.sizes(), " and sin ", sin.sizes(),
                      " differ in shape");
    TORCH_CHECK_VALUE(cos.scalar_type() == sin.scalar_type(), "rotary: cos is ", cos.scalar_type(), " but sin is ",
                      sin.scalar_type());
    TORCH_CHECK_VALUE(at::isFloatingType(cos.scalar_type()), "rotary: cos/sin must be floating point, got ",
                      cos.scalar_type());
    check_device(cos, q, "cos");
    check_device(sin, q, "sin");
    TORCH_CHECK_VALUE(cos.dim() == 2 || cos.dim() == 3,
                      "rotary: cos/sin must be [rows, width] (indexed by position) or [batch or 1, seq, width] "
                      "(one row per token), got ",
                      cos.sizes());
    const int64_t W = cos.size(-1);
    TORCH_CHECK_VALUE(W == rotary_dim / 2 || W == rotary_dim, "rotary: cos/sin width must be rotary_dim/2 = ",
                      rotary_dim / 2, " or rotary_dim = ", rotary_dim, ", got ", W);
    p.cos_full = W == rotary_dim;
    if (cos.scalar_type() != q.scalar_type() && cos.scalar_type() != at::kFloat) {
      cos = cos.to(at::kFloat);
      sin = sin.to(at::kFloat);
    }
    L.cos_is_float = cos.scalar_type() == at::kFloat;
    if (cos.dim() == 2) {
      p.mode = kCosTable;
      table_rows = cos.size(0);
      TORCH_CHECK_VALUE(table_rows >= 1, "rotary: the cos/sin table is empty");
      p.cos_stride[0] = cos.stride(0);
      p.cos_stride[2] = cos.stride(1);
      p.sin_stride[0] = sin.stride(0);
      p.sin_stride[2] = sin.stride(1);
    } else {
      p.mode = kCosToken;
      TORCH_CHECK_VALUE((cos.size(0) == 1 || cos.size(0) == B) && cos.size(1) == S,
                        "rotary: per-token cos/sin must be [batch or 1, seq, width] with batch=", B, ", seq=", S,
                        ", got ", cos.sizes());
      TORCH_CHECK_VALUE(!has_pos && !has_off && offset == 0,
                        "rotary: positions/seqlen_offsets do not apply to per-token cos/sin ([batch, seq, width]); "
                        "pass a [rows, width] table to index it by position");
      p.cos_stride[0] = cos.size(0) == 1 ? 0 : cos.stride(0);
      p.cos_stride[1] = cos.stride(1);
      p.cos_stride[2] = cos.stride(2);
      p.sin_stride[0] = sin.size(0) == 1 ? 0 : sin.stride(0);
      p.sin_stride[1] = sin.stride(1);
      p.sin_stride[2] = sin.stride(2);
    }
    p.cos = cos.data_ptr();
    p.sin = sin.data_ptr();
    L.keep.push_back(cos);
    L.keep.push_back(sin);
  }

  if (inplace) {
    TORCH_CHECK_VALUE(at::has_internal_overlap(q) != at::MemOverlap::Yes,
                      "rotary: in-place q has overlapping elements (an expanded view); pass a real tensor");
    if (has_k) {
      TORCH_CHECK_VALUE(at::has_internal_overlap(*k) != at::MemOverlap::Yes,
                        "rotary: in-place k has overlapping elements (an expanded view); pass a real tensor");
    }
  }

  // ---- value checks (these read index tensors; on CUDA they synchronise) --
  if (varlen) {
    const at::Tensor c64 = cu.to(at::kLong);
    const int64_t first = c64[0].item<int64_t>();
    const int64_t last = c64[nseq].item<int64_t>();
    TORCH_CHECK_VALUE(first == 0 && last == S, "rotary: cu_seqlens must start at 0 and end at total=", S,
                      ", got ", first, " ... ", last);
    if (nseq > 1) {
      const int64_t min_len = (c64.slice(0, 1) - c64.slice(0, 0, nseq)).min().item<int64_t>();
      TORCH_CHECK_VALUE(min_len >= 0, "rotary: cu_seqlens must be non-decreasing");
    }
  }
  if (p.mode == kCosTable && B * S > 0) {
    // Every position used must index a row of the table: an out-of-range row
    // would read past the table (flash-attn returns silently unrotated output).
    int64_t lo = 0, hi = 0;
    if (!varlen) {
      at::Tensor pos;
      if (has_pos) {
        pos = positions.to(at::kLong);
        if (has_off) pos = pos + offsets.to(at::kLong).view({B, 1});
      } else {
        pos = at::arange(S, q.options().dtype(at::kLong)).view({1, S});
        if (has_off) pos = pos + offsets.to(at::kLong).view({B, 1});
      }
      auto mm = at::aminmax(pos);
      lo = std::get<0>(mm).item<int64_t>();
      hi = std::get<1>(mm).item<int64_t>();
    } else {
      const at::Tensor c64 = cu.to(at::kLong);
      const at::Tensor tok = at::arange(S, q.options().dtype(at::kLong));
      const at::Tensor seq_id = at::searchsorted(c64.slice(0, 1), tok, /*out_int32=*/false, /*right=*/true);
      at::Tensor pos = has_pos ? positions.to(at::kLong).view({S}) : tok - c64.index_select(0, seq_id);
      if (has_off) pos = pos + offsets.to(at::kLong).index_select(0, seq_id);
      auto mm = at::aminmax(pos);
      lo = std::get<0>(mm).item<int64_t>();
      hi = std::get<1>(mm).item<int64_t>();
    }
    lo += offset;
    hi += offset;
    TORCH_CHECK_VALUE(lo >= 0 && hi < table_rows, "rotary: positions ", lo, "..", hi,
                      " (after seqlen_offsets) fall outside the cos/sin table of ", table_rows, " rows");
  }

  // ---- fill the launch ------------------------------------------------------
  L.dtype = q.scalar_type();
  p.batch = B;
  p.seq = S;
  p.head_dim = D;
  p.rotary_dim = rotary_dim;
  p.half = rotary_dim / 2;
  p.interleaved = interleaved;
  p.conjugate = conjugate;
  p.scaling = scaling;
  p.offset = offset;
  p.nseq = nseq;
  if (varlen) {
    p.cu_seqlens = index_ref(cu);
    L.keep.push_back(cu);
  }
  if (has_pos) {
    p.positions = index_ref(positions);
    p.positions.stride_b = positions.size(0) == 1 ? 0 : positions.stride(0);
    p.positions.stride_s = positions.stride(1);
    L.keep.push_back(positions);
  }
  if (has_off) {
    p.offsets = index_ref(offsets);
    L.keep.push_back(offsets);
  }

  auto fill = [&](TensorRef& r, const at::Tensor& in, const at::Tensor& out) {
    TORCH_CHECK_VALUE(out.sizes() == in.sizes() && out.scalar_type() == in.scalar_type() &&
                          out.device() == in.device(),
                      "rotary: output does not match input");
    r.in = in.data_ptr();
    r.out = out.data_ptr();
    r.heads = in.size(2);
    for (int d = 0; d < 4; ++d) {
      r.in_stride[d] = in.stride(d);
      r.out_stride[d] = out.stride(d);
    }
    if (!inplace && rotary_dim < D) {
      out.narrow(3, rotary_dim, D - rotary_dim).copy_(in.narrow(3, rotary_dim, D - rotary_dim));
    }
  };
  fill(p.x[0], q, q_out);
  p.nx = 1;
  if (has_k) {
    fill(p.x[1], *k, *k_out);
    p.nx = 2;
  }
  int64_t heads = p.x[0].heads + (has_k ? p.x[1].heads : 0);
  L.empty = B * S * heads == 0;
  return L;
}

namespace {

void run(const at::Tensor& q, const Launch& L) {
  if (L.empty) return;
  if (q.is_cuda()) {
#ifdef FTSHIMS_WITH_CUDA
    run_cuda(L.params, storage_code(L.dtype), L.cos_is_float, q.get_device());
    return;
#else
    TORCH_CHECK_VALUE(false, "rotary: this build of the ftshims extension has no CUDA kernels");
#endif
  }
  TORCH_CHECK_VALUE(q.device().is_cpu(), "rotary: unsupported device ", q.device());
  TORCH_CHECK_VALUE(L.dtype == at::kFloat || L.dtype == at::kDouble || L.dtype == at::kBFloat16 || L.dtype == at::kHalf,
                    "rotary: unsupported dtype ", L.dtype);
  run_cpu(L.params, storage_code(L.dtype), L.cos_is_float);
}

// A fresh CPU output of many megabytes would be faulted in 4 KiB page by page
// (most of the op's time on CPU); ask for transparent huge pages before the
// first touch. Advice only: the range is inside the tensor's own allocation.
void advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  if (!t.device().is_cpu() || t.nbytes() < 4 * kHuge) return;
  const uintptr_t start = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t first = (start + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = (start + t.nbytes()) & ~(kHuge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
  (void)t;
#endif
}

std::vector<at::Tensor> rotary_out_of_place(const at::Tensor& q, const c10::optional<at::Tensor>& k,
                                            const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin,
                                            const c10::optional<at::Tensor>& inv_freq,
                                            const c10::optional<at::Tensor>& positions,
                                            const c10::optional<at::Tensor>& seqlen_offsets,
                                            const c10::optional<at::Tensor>& cu_seqlens, int64_t offset,
                                            int64_t rotary_dim, bool interleaved, bool conjugate, double scaling) {
  TORCH_CHECK_VALUE(q.dim() == 4, "rotary: q must be 4-D [batch, seq, heads, dim], got ", q.sizes());
  at::Tensor q_out = at::empty_like(q);
  advise_huge_pages(q_out);
  c10::optional<at::Tensor> k_out;
  if (k.has_value() && k->defined()) {
    k_out = at::empty_like(*k);
    advise_huge_pages(*k_out);
  }
  Launch L = prepare(q, k, q_out, k_out, cos, sin, inv_freq, positions, seqlen_offsets, cu_seqlens, offset, rotary_dim,
                     interleaved, conjugate, scaling, /*inplace=*/false);
  run(q, L);
  std::vector<at::Tensor> outs{q_out};
  if (k_out.has_value()) outs.push_back(*k_out);
  return outs;
}

void rotary_in_place(const at::Tensor& q, const c10::optional<at::Tensor>& k, const c10::optional<at::Tensor>& cos,
                     const c10::optional<at::Tensor>& sin, const c10::optional<at::Tensor>& inv_freq,
                     const c10::optional<at::Tensor>& positions, const c10::optional<at::Tensor>& seqlen_offsets,
                     const c10::optional<at::Tensor>& cu_seqlens, int64_t offset, int64_t rotary_dim,
                     bool interleaved, bool conjugate, double scaling) {
  Launch L = prepare(q, k, q, k, cos, sin, inv_freq, positions, seqlen_offsets, cu_seqlens, offset, rotary_dim,
                     interleaved, conjugate, scaling, /*inplace=*/true);
  run(q, L);
}

// Build facts, for diagnostics: which instruction set the CPU kernel runs with here.
std::string cpu_isa_info() { return cpu_isa(); }

// Build facts, for diagnostics: which backends this binary carries.
std::string build_info() {
#ifdef FTSHIMS_WITH_CUDA
  return "cpu,cuda";
#else
  return "cpu";
#endif
}

}  // namespace

}  // namespace ftshims_rotary

#define FTSHIMS_ROTARY_ARGS                                                                                 \
  "Tensor? cos, Tensor? sin, Tensor? inv_freq, Tensor? positions, Tensor? seqlen_offsets, Tensor? cu_seqlens, " \
  "int offset, int rotary_dim, bool interleaved, bool conjugate, float scaling"

TORCH_LIBRARY_FRAGMENT(ftshims, m) {
  m.def("rotary(Tensor q, Tensor? k, " FTSHIMS_ROTARY_ARGS ") -> Tensor[]");
  m.def("rotary_(Tensor(a!) q, Tensor(b!)? k, " FTSHIMS_ROTARY_ARGS ") -> ()");
  m.def("rotary_build_info() -> str", &ftshims_rotary::build_info);
  m.def("rotary_cpu_isa() -> str", &ftshims_rotary::cpu_isa_info);
}

TORCH_LIBRARY_IMPL(ftshims, CPU, m) {
  m.impl("rotary", &ftshims_rotary::rotary_out_of_place);
  m.impl("rotary_", &ftshims_rotary::rotary_in_place);
}

#ifdef FTSHIMS_WITH_CUDA
TORCH_LIBRARY_IMPL(ftshims, CUDA, m) {
  m.impl("rotary", &ftshims_rotary::rotary_out_of_place);
  m.impl("rotary_", &ftshims_rotary::rotary_in_place);
}
#endif
