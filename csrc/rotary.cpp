// ftshims rotary embedding: op schema, argument validation, CPU kernels.
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
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
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

[[maybe_unused]] int storage_code(at::ScalarType t) {
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

// ===========================================================================
// CPU kernels
namespace {

// bf16 <-> fp32 with the same rounding as c10::BFloat16 (round to nearest even,
// NaN -> 0x7FC0), written branch-free so that the loops vectorise.
inline __attribute__((always_inline)) float bf16_load(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline __attribute__((always_inline)) uint16_t bf16_store(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return ((u & 0x7FFFFFFFu) > 0x7F800000u) ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
}

struct F32Io {
  using storage = float;
  static inline __attribute__((always_inline)) float load(float v) { return v; }
  static inline __attribute__((always_inline)) float store(float v) { return v; }
};
struct Bf16Io {
  using storage = uint16_t;
  static inline __attribute__((always_inline)) float load(uint16_t v) { return bf16_load(v); }
  static inline __attribute__((always_inline)) uint16_t store(float v) { return bf16_store(v); }
};

constexpr int64_t kBlock = 64;

// Contiguous rows (dim stride 1). Values go through small local blocks so the
// loops vectorise even when out == in (in place).
template <typename Io>
inline __attribute__((always_inline)) void rot_half_contig(const typename Io::storage* in,
                                                             typename Io::storage* out, const float* c0,
                                                             const float* s0, const float* c1, const float* s1,
                                                             int64_t half) {
  for (int64_t i0 = 0; i0 < half; i0 += kBlock) {
    const int64_t n = std::min(kBlock, half - i0);
    float a[kBlock], b[kBlock];
    for (int64_t j = 0; j < n; ++j) {
      a[j] = Io::load(in[i0 + j]);
      b[j] = Io::load(in[half + i0 + j]);
    }
    for (int64_t j = 0; j < n; ++j) {
      out[i0 + j] = Io::store(a[j] * c0[i0 + j] - b[j] * s0[i0 + j]);
      out[half + i0 + j] = Io::store(b[j] * c1[i0 + j] + a[j] * s1[i0 + j]);
    }
  }
}

template <typename Io>
inline __attribute__((always_inline)) void rot_inter_contig(const typename Io::storage* in,
                                                              typename Io::storage* out, const float* c0,
                                                              const float* s0, const float* c1, const float* s1,
                                                              int64_t half) {
  for (int64_t i0 = 0; i0 < half; i0 += kBlock) {
    const int64_t n = std::min(kBlock, half - i0);
    float a[kBlock], b[kBlock];
    for (int64_t j = 0; j < n; ++j) {
      a[j] = Io::load(in[2 * (i0 + j)]);
      b[j] = Io::load(in[2 * (i0 + j) + 1]);
    }
    for (int64_t j = 0; j < n; ++j) {
      out[2 * (i0 + j)] = Io::store(a[j] * c0[i0 + j] - b[j] * s0[i0 + j]);
      out[2 * (i0 + j) + 1] = Io::store(b[j] * c1[i0 + j] + a[j] * s1[i0 + j]);
    }
  }
}

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define FTS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FTS_CLONES
#endif

FTS_CLONES void rot_half_f32(const float* in, float* out, const float* c0, const float* s0, const float* c1,
                             const float* s1, int64_t half) {
  rot_half_contig<F32Io>(in, out, c0, s0, c1, s1, half);
}
FTS_CLONES void rot_inter_f32(const float* in, float* out, const float* c0, const float* s0, const float* c1,
                              const float* s1, int64_t half) {
  rot_inter_contig<F32Io>(in, out, c0, s0, c1, s1, half);
}
FTS_CLONES void rot_half_bf16(const uint16_t* in, uint16_t* out, const float* c0, const float* s0, const float* c1,
                              const float* s1, int64_t half) {
  rot_half_contig<Bf16Io>(in, out, c0, s0, c1, s1, half);
}
FTS_CLONES void rot_inter_bf16(const uint16_t* in, uint16_t* out, const float* c0, const float* s0,
                               const float* c1, const float* s1, int64_t half) {
  rot_inter_contig<Bf16Io>(in, out, c0, s0, c1, s1, half);
}

// Any dtype, any dim stride.
template <typename T, typename A>
void rot_generic(const T* in, T* out, int64_t sd, int64_t od, const A* c0, const A* s0, const A* c1, const A* s1,
                 int64_t half, bool interleaved) {
  for (int64_t i = 0; i < half; ++i) {
    const int64_t i0 = interleaved ? 2 * i : i;
    const int64_t i1 = interleaved ? 2 * i + 1 : i + half;
    const A a = static_cast<A>(in[i0 * sd]);
    const A b = static_cast<A>(in[i1 * sd]);
    out[i0 * od] = static_cast<T>(a * c0[i] - b * s0[i]);
    out[i1 * od] = static_cast<T>(b * c1[i] + a * s1[i]);
  }
}

template <typename T, typename A>
inline void rot_row(const T* in, T* out, int64_t sd, int64_t od, const A* c0, const A* s0, const A* c1, const A* s1,
                    int64_t half, bool interleaved) {
  if constexpr (std::is_same<A, float>::value && std::is_same<T, float>::value) {
    if (sd == 1 && od == 1) {
      (interleaved ? rot_inter_f32 : rot_half_f32)(in, out, c0, s0, c1, s1, half);
      return;
    }
  }
  if constexpr (std::is_same<A, float>::value && std::is_same<T, c10::BFloat16>::value) {
    if (sd == 1 && od == 1) {
      (interleaved ? rot_inter_bf16 : rot_half_bf16)(reinterpret_cast<const uint16_t*>(in),
                                                     reinterpret_cast<uint16_t*>(out), c0, s0, c1, s1, half);
      return;
    }
  }
  rot_generic<T, A>(in, out, sd, od, c0, s0, c1, s1, half, interleaved);
}

// Position of token (b, s): explicit positions, or the index inside its
// sequence, plus per-row/sequence offsets and the scalar offset.
inline int64_t token_position(const Params& p, int64_t b, int64_t s) {
  int64_t pos, row = b;
  if (p.cu_seqlens.ptr) {
    int64_t lo = 0, hi = p.nseq - 1;  // largest j with cu[j] <= s
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (load_index(p.cu_seqlens, mid) <= s) lo = mid; else hi = mid - 1;
    }
    row = lo;
    pos = p.positions.ptr ? load_index(p.positions, s * p.positions.stride_s)
                          : s - load_index(p.cu_seqlens, lo);
  } else {
    pos = p.positions.ptr ? load_index(p.positions, b * p.positions.stride_b + s * p.positions.stride_s) : s;
  }
  if (p.offsets.ptr) pos += load_index(p.offsets, row);
  return pos + p.offset;
}

inline void angle(float pos_f, float f, float& c, float& s) {
  // fp32 product with its rounding error recovered by an fma, so the phase is
  // that of position * inv_freq exactly (not of its fp32 rounding).
  // |lo| <= ulp(hi)/2 (<= 0.5 for positions below 2^24): cos/sin of lo by their
  // Taylor series, accurate to 1e-7 over that whole range.
  const float hi = pos_f * f;
  const float lo = std::fma(pos_f, f, -hi);
  const float ch = std::cos(hi), sh = std::sin(hi);
  const float l2 = lo * lo;
  const float cl = 1.0f - l2 * (0.5f - l2 * (1.0f / 24.0f - l2 * (1.0f / 720.0f)));
  const float sl = lo * (1.0f - l2 * (1.0f / 6.0f - l2 * (1.0f / 120.0f - l2 * (1.0f / 5040.0f))));
  c = ch * cl - sh * sl;
  s = sh * cl + ch * sl;
}
inline void angle(double pos_f, double f, double& c, double& s) {
  const double a = pos_f * f;
  c = std::cos(a);
  s = std::sin(a);
}

template <typename A, typename C>
void fill_angles(const Params& p, int64_t b, int64_t s, A* c0, A* s0, A* c1, A* s1) {
  const int64_t half = p.half;
  const A scale = static_cast<A>(p.scaling);
  const A sign = p.conjugate ? A(-1) : A(1);
  if (p.mode == kInvFreq) {
    const A pos = static_cast<A>(token_position(p, b, s));
    for (int64_t i = 0; i < half; ++i) {
      A c, sn;
      angle(pos, static_cast<A>(p.inv_freq[i * p.inv_freq_stride]), c, sn);
      c0[i] = c1[i] = c * scale;
      s0[i] = s1[i] = sn * scale * sign;
    }
    return;
  }
  int64_t cbase, sbase;
  if (p.mode == kCosTable) {
    const int64_t row = token_position(p, b, s);
    cbase = row * p.cos_stride[0];
    sbase = row * p.sin_stride[0];
  } else {
    cbase = b * p.cos_stride[0] + s * p.cos_stride[1];
    sbase = b * p.sin_stride[0] + s * p.sin_stride[1];
  }
  const C* cp = static_cast<const C*>(p.cos);
  const C* sp = static_cast<const C*>(p.sin);
  const int64_t cw = p.cos_stride[2], sw = p.sin_stride[2];
  for (int64_t i = 0; i < half; ++i) {
    int64_t j0 = i, j1 = i;
    if (p.cos_full) {
      j0 = p.interleaved ? 2 * i : i;
      j1 = p.interleaved ? 2 * i + 1 : i + half;
    }
    c0[i] = static_cast<A>(cp[cbase + j0 * cw]) * scale;
    c1[i] = static_cast<A>(cp[cbase + j1 * cw]) * scale;
    // conjugate = the transposed map: out0 = a c0 + b s1, out1 = b c1 - a s0
    // (for a true rotation s0 == s1 and this is the inverse rotation).
    const int64_t k0 = p.conjugate ? j1 : j0, k1 = p.conjugate ? j0 : j1;
    s0[i] = static_cast<A>(sp[sbase + k0 * sw]) * scale * sign;
    s1[i] = static_cast<A>(sp[sbase + k1 * sw]) * scale * sign;
  }
}

// Tokens are processed in blocks: the angles of a block are computed once,
// then every head of q and k is rotated block-row by block-row. This keeps the
// sincos work per token (not per head) and reads memory in long runs whether
// the heads or the tokens are adjacent in memory ([b, s, h, d] or [b, h, s, d]).
constexpr int64_t kTokenBlock = 32;

template <typename T, typename C>
void cpu_kernel(const Params& p) {
  using A = typename std::conditional<std::is_same<T, double>::value, double, float>::type;
  const int64_t tokens = p.batch * p.seq;
  const int64_t blocks = (tokens + kTokenBlock - 1) / kTokenBlock;
  const int64_t half = p.half;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> buf(4 * half * kTokenBlock);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t t0 = blk * kTokenBlock;
      const int64_t nt = std::min(kTokenBlock, tokens - t0);
      for (int64_t u = 0; u < nt; ++u) {
        const int64_t t = t0 + u;
        A* c0 = buf.data() + 4 * half * u;
        fill_angles<A, C>(p, t / p.seq, t % p.seq, c0, c0 + half, c0 + 2 * half, c0 + 3 * half);
      }
      for (int j = 0; j < p.nx; ++j) {
        const TensorRef& r = p.x[j];
        for (int64_t h = 0; h < r.heads; ++h) {
          for (int64_t u = 0; u < nt; ++u) {
            const int64_t t = t0 + u;
            const int64_t b = t / p.seq, s = t % p.seq;
            const T* in = static_cast<const T*>(r.in) + b * r.in_stride[0] + s * r.in_stride[1] + h * r.in_stride[2];
            T* out = static_cast<T*>(r.out) + b * r.out_stride[0] + s * r.out_stride[1] + h * r.out_stride[2];
            const A* c0 = buf.data() + 4 * half * u;
            rot_row<T, A>(in, out, r.in_stride[3], r.out_stride[3], c0, c0 + half, c0 + 2 * half, c0 + 3 * half, half,
                          p.interleaved);
          }
        }
      }
    }
  });
}

template <typename T>
void cpu_dispatch_cos(const Launch& L) {
  if (L.params.mode == kInvFreq || L.cos_is_float) {
    cpu_kernel<T, float>(L.params);
  } else {
    cpu_kernel<T, T>(L.params);
  }
}

void run_cpu(const Launch& L) {
  if (L.empty) return;
  switch (L.dtype) {
    case at::kFloat: cpu_dispatch_cos<float>(L); break;
    case at::kDouble: cpu_dispatch_cos<double>(L); break;
    case at::kBFloat16: cpu_dispatch_cos<c10::BFloat16>(L); break;
    case at::kHalf: cpu_dispatch_cos<c10::Half>(L); break;
    default: TORCH_CHECK_VALUE(false, "rotary: unsupported dtype ", L.dtype);
  }
}

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
  run_cpu(L);
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
