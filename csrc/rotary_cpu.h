// ftshims rotary embedding: the CPU kernel, written once with at::vec::Vectorized
// and compiled once per instruction set:
//   rotary_cpu.cpp         the build's own flags (x86-64 baseline, NEON on aarch64, ...),
//                          plus the runtime choice between the three;
//   rotary_cpu_avx2.cpp    AVX2 + FMA + F16C   (x86-64 with GCC only)
//   rotary_cpu_avx512.cpp  AVX-512 F/BW/VL/DQ  (x86-64 with GCC only)
// The including file defines CPU_CAPABILITY (a namespace name of this library's
// own, so no inline function of this file can be confused with torch's) and,
// for the x86 vector sets, CPU_CAPABILITY_AVX2 / CPU_CAPABILITY_AVX512, which
// select torch's specialisations of Vectorized — exactly as torch compiles its
// own kernels.
//
// The kernel is memory-bound: q and k are read once and written once. So
//  * rows are loaded, converted (bf16/fp16 -> fp32) and stored in vector
//    registers; the rotation runs in fp32 (fp64 for fp64 data);
//  * the angles of a block of kTokenBlock tokens are made once (sin/cos of the
//    phase, or the rows of the cos/sin tables converted to fp32) and shared
//    by every head of q and of k;
//  * rows are visited in memory order ([b, s, h, d]: token by token;
//    [b, h, s, d]: head by head through the block), so every thread streams;
//  * threads split the work over token blocks, and over heads too when there
//    are fewer blocks than threads (decoding, short sequences).
//
// Results equal the pure-PyTorch reference's: the same fp32 products and
// differences, in the same order, never fused (the build passes
// -ffp-contract=off); the phase position * inv_freq is formed in fp64, where it
// is exact for positions below 2^29 (as the reference forms it), and its sine
// and cosine are evaluated in fp64 and rounded to fp32 once.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "rotary.h"

namespace ftshims_rotary {
namespace CPU_CAPABILITY {

void run_cpu_kernel(const Params& p, int32_t storage, bool cos_is_float);

namespace {

using at::vec::Vectorized;
using fVec = Vectorized<float>;
using dVec = Vectorized<double>;

// Tokens whose angles are made together. 16 tokens x 4 x rotary_dim/2 fp32
// values is 16 KiB for head_dim 128: it stays in L1 while every head is rotated.
constexpr int64_t kTokenBlock = 16;
// Below this many elements per thread a split costs more than it saves (torch's own grain).
constexpr int64_t kGrainElements = 32768;

// ---------------------------------------------------------------------------
// positions

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
    pos = p.positions.ptr ? load_index(p.positions, s * p.positions.stride_s) : s - load_index(p.cu_seqlens, lo);
  } else {
    pos = p.positions.ptr ? load_index(p.positions, b * p.positions.stride_b + s * p.positions.stride_s) : s;
  }
  if (p.offsets.ptr) pos += load_index(p.offsets, row);
  return pos + p.offset;
}

// ---------------------------------------------------------------------------
// sin and cos of fp64 phases, vectorised

// pi/2 in four parts: the first three have 24 significant bits, so k * part is
// exact for |k| < 2^29 and the reduction x - k pi/2 loses nothing there.
constexpr double kPio2_1 = 1.570796251296997;       // 0x1.921fb4p+0
constexpr double kPio2_2 = 7.549789415861596e-08;   // 0x1.4442d0p-24
constexpr double kPio2_3 = 5.390302529957765e-15;   // 0x1.846988p-48
constexpr double kPio2_4 = 3.2820035428735005e-22;  // the rest of pi/2
constexpr double kTwoOverPi = 0.6366197723675814;
// Beyond this |phase| (k ~ 2^27) the scalar std::sin/std::cos take over.
constexpr double kVectorPhaseLimit = 268435456.0;  // 2^28

// sin and cos of x for |x| <= kVectorPhaseLimit: Cody-Waite reduction to
// |r| <= pi/4, then fdlibm's kernels __kernel_sin/__kernel_cos (error < 1 ulp
// of fp64), then the quadrant. Plain multiplies and adds (no fma needed), so the
// result is the same for every instruction set.
inline void sincos_vec(const dVec& x, dVec& c, dVec& s) {
  const dVec k = (x * dVec(kTwoOverPi)).round();
  dVec r = x - k * dVec(kPio2_1);
  r = r - k * dVec(kPio2_2);
  r = r - k * dVec(kPio2_3);
  r = r - k * dVec(kPio2_4);
  const dVec z = r * r;
  const dVec ps = dVec(8.33333333332248946124e-03) +
                  z * (dVec(-1.98412698298579493134e-04) +
                       z * (dVec(2.75573137070700676789e-06) +
                            z * (dVec(-2.50507602534068634195e-08) + z * dVec(1.58969099521155010221e-10))));
  const dVec sr = r + (z * r) * (dVec(-1.66666666666666324348e-01) + z * ps);
  const dVec pc =
      z * (dVec(4.16666666666666019037e-02) +
           z * (dVec(-1.38888888888741095749e-03) +
                z * (dVec(2.48015872894767294178e-05) +
                     z * (dVec(-2.75573143513906633035e-07) +
                          z * (dVec(2.08757232129817482790e-09) + z * dVec(-1.13596475577881948265e-11))))));
  const dVec one(1.0);
  const dVec hz = dVec(0.5) * z;
  const dVec w = one - hz;
  const dVec cr = w + (((one - w) - hz) + z * pc);
  // quadrant n = k mod 4: (sin, cos) = (s, c), (c, -s), (-s, -c), (-c, s)
  const dVec n = k - dVec(4.0) * (k * dVec(0.25)).floor();
  const dVec odd = (n == dVec(1.0)) | (n == dVec(3.0));
  const dVec sin_neg = n >= dVec(2.0);
  const dVec cos_neg = (n == dVec(1.0)) | (n == dVec(2.0));
  const dVec s0 = dVec::blendv(sr, cr, odd);
  const dVec c0 = dVec::blendv(cr, sr, odd);
  s = dVec::blendv(s0, s0.neg(), sin_neg);
  c = dVec::blendv(c0, c0.neg(), cos_neg);
}

// cos/sin of n phases, rounded to fp32 and multiplied by `scale` (cos) and
// `sin_scale` (sin; carries the sign of the conjugate map), as the reference
// does: cos(phase).to(fp32) * scaling.
inline void sincos_to_float(const double* phase, int64_t n, double max_abs, float scale, float sin_scale,
                            float* cos_out, float* sin_out) {
  if (!(max_abs <= kVectorPhaseLimit)) {  // also NaN
    for (int64_t i = 0; i < n; ++i) {
      cos_out[i] = static_cast<float>(std::cos(phase[i])) * scale;
      sin_out[i] = static_cast<float>(std::sin(phase[i])) * sin_scale;
    }
    return;
  }
  constexpr int64_t W = dVec::size();
  alignas(64) double cb[W];
  alignas(64) double sb[W];
  for (int64_t i = 0; i < n; i += W) {
    const int64_t m = std::min(W, n - i);
    const dVec x = m == W ? dVec::loadu(phase + i) : dVec::loadu(phase + i, m);
    dVec c, s;
    sincos_vec(x, c, s);
    c.store(cb);
    s.store(sb);
    for (int64_t j = 0; j < m; ++j) {
      cos_out[i + j] = static_cast<float>(cb[j]) * scale;
      sin_out[i + j] = static_cast<float>(sb[j]) * sin_scale;
    }
  }
}

// ---------------------------------------------------------------------------
// angles of a block of tokens

// The four angle rows of one token (each rotary_dim/2 long): out0 = a c0 - b s0,
// out1 = b c1 + a s1 for the pair (a, b). They may point into the block's
// buffer or, for fp32 tables read as they are, into the cos/sin tensors.
template <typename A>
struct TokenAngles {
  const A* c0;
  const A* s0;
  const A* c1;
  const A* s1;
};

// n values of a contiguous run of cos/sin (fp32 or the storage dtype) as fp32, times scale.
template <typename C>
inline void to_float_scaled(const C* src, int64_t n, float scale, float* dst) {
  const fVec sv(scale);
  if constexpr (std::is_same<C, float>::value) {
    constexpr int64_t W = fVec::size();
    for (int64_t i = 0; i < n; i += W) {
      const int64_t m = std::min(W, n - i);
      const fVec v = m == W ? fVec::loadu(src + i) : fVec::loadu(src + i, m);
      (v * sv).store(dst + i, m);
    }
  } else {
    constexpr int64_t W = Vectorized<C>::size();
    constexpr int64_t H = fVec::size();
    for (int64_t i = 0; i < n; i += W) {
      const int64_t m = std::min(W, n - i);
      const Vectorized<C> v = m == W ? Vectorized<C>::loadu(src + i) : Vectorized<C>::loadu(src + i, m);
      auto lohi = at::vec::convert_to_float<C>(v);
      (std::get<0>(lohi) * sv).store(dst + i, std::min(m, H));
      if (m > H) (std::get<1>(lohi) * sv).store(dst + i + H, m - H);
    }
  }
}

// Angles of tokens [t0, t0 + nt) into `buf` (4 x nt x half values of A) and
// `ang`. `phase` is scratch for nt x half fp64 phases (fp32 storage only);
// `inv` holds inv_freq in A's precision (fp64 for the fp32 path: the phase is
// formed in fp64).
template <typename A, typename C>
void fill_block(const Params& p, const double* inv, int64_t t0, int64_t nt, A* buf, double* phase,
                TokenAngles<A>* ang) {
  const int64_t half = p.half;
  const A scale = static_cast<A>(p.scaling);
  const A sign = p.conjugate ? A(-1) : A(1);
  A* cos_buf = buf;
  A* sin_buf = buf + nt * half;
  A* cos1_buf = buf + 2 * nt * half;
  A* sin1_buf = buf + 3 * nt * half;

  if (p.mode == kInvFreq) {
    if constexpr (std::is_same<A, float>::value) {
      double max_abs = 0.0;
      for (int64_t u = 0; u < nt; ++u) {
        const int64_t t = t0 + u;
        const double pos = static_cast<double>(token_position(p, t / p.seq, t % p.seq));
        double* ph = phase + u * half;
        for (int64_t i = 0; i < half; ++i) {
          ph[i] = pos * inv[i];
          max_abs = std::max(max_abs, std::abs(ph[i]));
        }
      }
      sincos_to_float(phase, nt * half, max_abs, scale, scale * sign, cos_buf, sin_buf);
    } else {
      for (int64_t u = 0; u < nt; ++u) {
        const int64_t t = t0 + u;
        const double pos = static_cast<double>(token_position(p, t / p.seq, t % p.seq));
        for (int64_t i = 0; i < half; ++i) {
          const double a = pos * inv[i];
          cos_buf[u * half + i] = std::cos(a) * scale;
          sin_buf[u * half + i] = std::sin(a) * scale * sign;
        }
      }
    }
    for (int64_t u = 0; u < nt; ++u) {
      ang[u].c0 = ang[u].c1 = cos_buf + u * half;
      ang[u].s0 = ang[u].s1 = sin_buf + u * half;
    }
    return;
  }

  const C* cp = static_cast<const C*>(p.cos);
  const C* sp = static_cast<const C*>(p.sin);
  const int64_t cw = p.cos_stride[2], sw = p.sin_stride[2];
  // Contiguous rows in the half-rotated layout (or one value per pair) are
  // converted with vectors; fp32 rows needing no scale or sign are read in place.
  const bool contiguous = cw == 1 && sw == 1 && (!p.cos_full || !p.interleaved);
  const bool read_directly = std::is_same<A, float>::value && std::is_same<C, float>::value && contiguous &&
                        p.scaling == 1.0 && !p.conjugate;
  for (int64_t u = 0; u < nt; ++u) {
    const int64_t t = t0 + u;
    const int64_t b = t / p.seq, s = t % p.seq;
    int64_t cbase, sbase;
    if (p.mode == kCosTable) {
      const int64_t row = token_position(p, b, s);
      cbase = row * p.cos_stride[0];
      sbase = row * p.sin_stride[0];
    } else {
      cbase = b * p.cos_stride[0] + s * p.cos_stride[1];
      sbase = b * p.sin_stride[0] + s * p.sin_stride[1];
    }
    // Offsets (in the table row) of the runs read for c0, c1, s0, s1; conjugate
    // = the transposed map: out0 = a c0 + b s1, out1 = b c1 - a s0 (for a true
    // rotation s0 == s1 and this is the inverse rotation).
    const int64_t second = p.cos_full ? half : 0;
    const int64_t k0 = p.conjugate ? second : 0, k1 = p.conjugate ? 0 : second;
    if constexpr (std::is_same<A, float>::value) {
      if (read_directly) {
        ang[u].c0 = reinterpret_cast<const float*>(cp + cbase);
        ang[u].c1 = reinterpret_cast<const float*>(cp + cbase + second);
        ang[u].s0 = reinterpret_cast<const float*>(sp + sbase);
        ang[u].s1 = reinterpret_cast<const float*>(sp + sbase + second);
        continue;
      }
      if (contiguous) {
        float* c0 = cos_buf + u * half;
        float* s0 = sin_buf + u * half;
        to_float_scaled<C>(cp + cbase, half, scale, c0);
        to_float_scaled<C>(sp + sbase + k0, half, scale * sign, s0);
        ang[u].c0 = c0;
        ang[u].s0 = s0;
        if (p.cos_full) {
          float* c1 = cos1_buf + u * half;
          float* s1 = sin1_buf + u * half;
          to_float_scaled<C>(cp + cbase + second, half, scale, c1);
          to_float_scaled<C>(sp + sbase + k1, half, scale * sign, s1);
          ang[u].c1 = c1;
          ang[u].s1 = s1;
        } else {
          ang[u].c1 = c0;
          ang[u].s1 = s0;
        }
        continue;
      }
    }
    // Any stride, the interleaved full-width layout, fp64.
    A* c0 = cos_buf + u * half;
    A* s0 = sin_buf + u * half;
    A* c1 = cos1_buf + u * half;
    A* s1 = sin1_buf + u * half;
    for (int64_t i = 0; i < half; ++i) {
      int64_t j0 = i, j1 = i;
      if (p.cos_full) {
        j0 = p.interleaved ? 2 * i : i;
        j1 = p.interleaved ? 2 * i + 1 : i + half;
      }
      c0[i] = static_cast<A>(cp[cbase + j0 * cw]) * scale;
      c1[i] = static_cast<A>(cp[cbase + j1 * cw]) * scale;
      const int64_t m0 = p.conjugate ? j1 : j0, m1 = p.conjugate ? j0 : j1;
      s0[i] = static_cast<A>(sp[sbase + m0 * sw]) * scale * sign;
      s1[i] = static_cast<A>(sp[sbase + m1 * sw]) * scale * sign;
    }
    ang[u] = {c0, s0, c1, s1};
  }
}

// ---------------------------------------------------------------------------
// one row (one head of one token): contiguous rows with vectors

inline fVec load_f(const float* ptr, int64_t count) {
  constexpr int64_t W = fVec::size();
  if (count >= W) return fVec::loadu(ptr);
  return count > 0 ? fVec::loadu(ptr, count) : fVec(0.0f);
}

// Streaming (non-temporal) stores, x86 vector builds only: a large
// out-of-place output is written around the caches, so no line of it is read
// from memory just to be overwritten, and the input stays cached. Used for
// whole, aligned vectors of outputs of at least kStreamMinBytes (smaller ones are
// likely read from the cache by the next op).
constexpr int64_t kStreamMinBytes = int64_t(16) << 20;
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kStreamBytes = 64;
inline void stream_store(float* out, const fVec& v) { _mm512_stream_ps(out, v); }
template <typename T>
inline void stream_store(T* out, const Vectorized<T>& v) { _mm512_stream_si512(reinterpret_cast<__m512i*>(out), v); }
inline void stream_fence() { _mm_sfence(); }
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kStreamBytes = 32;
inline void stream_store(float* out, const fVec& v) { _mm256_stream_ps(out, v); }
template <typename T>
inline void stream_store(T* out, const Vectorized<T>& v) { _mm256_stream_si256(reinterpret_cast<__m256i*>(out), v); }
inline void stream_fence() { _mm_sfence(); }
#else
constexpr int64_t kStreamBytes = 0;  // no streaming stores in this build
inline void stream_store(float* out, const fVec& v) { v.store(out); }
template <typename T>
inline void stream_store(T* out, const Vectorized<T>& v) { v.store(out); }
inline void stream_fence() {}
#endif

// Stores `count` values (lo's, then hi's) as T; whole vectors streamed when NT.
template <typename T, bool NT>
inline void store_f(const fVec& lo, const fVec& hi, T* out, int64_t count) {
  if constexpr (std::is_same<T, float>::value) {
    constexpr int64_t W = fVec::size();
    if (NT && count == 2 * W) {
      stream_store(out, lo);
      stream_store(out + W, hi);
      return;
    }
    lo.store(out, std::min(count, W));
    if (count > W) hi.store(out + W, count - W);
  } else {
    const Vectorized<T> v = at::vec::convert_from_float<T>(lo, hi);
    if (count >= Vectorized<T>::size()) {
      if (NT) stream_store(out, v);
      else v.store(out);
    } else {
      v.store(out, count);
    }
  }
}

// 2 x fVec::size() values of x at `ptr` as fp32 (count of them valid, the rest 0).
template <typename T>
inline void load_2f(const T* ptr, int64_t count, fVec& lo, fVec& hi) {
  if constexpr (std::is_same<T, float>::value) {
    constexpr int64_t W = fVec::size();
    lo = load_f(ptr, count);
    hi = load_f(ptr + W, count - W);
  } else {
    const Vectorized<T> v =
        count >= Vectorized<T>::size() ? Vectorized<T>::loadu(ptr) : Vectorized<T>::loadu(ptr, count);
    auto lohi = at::vec::convert_to_float<T>(v);
    lo = std::get<0>(lohi);
    hi = std::get<1>(lohi);
  }
}

// Half-rotated pairs (i, i + half).
template <typename T, bool NT>
inline void rotate_half_row(const T* in, T* out, const TokenAngles<float>& g, int64_t half) {
  constexpr int64_t H = fVec::size();
  constexpr int64_t W = 2 * H;  // elements per step: one Vectorized<bf16/fp16>, two of fp32
  for (int64_t i = 0; i < half; i += W) {
    const int64_t m = std::min(W, half - i);
    fVec a0, a1, b0, b1;
    load_2f<T>(in + i, m, a0, a1);
    load_2f<T>(in + half + i, m, b0, b1);
    const fVec c00 = load_f(g.c0 + i, m), c01 = load_f(g.c0 + i + H, m - H);
    const fVec s00 = load_f(g.s0 + i, m), s01 = load_f(g.s0 + i + H, m - H);
    const fVec c10 = load_f(g.c1 + i, m), c11 = load_f(g.c1 + i + H, m - H);
    const fVec s10 = load_f(g.s1 + i, m), s11 = load_f(g.s1 + i + H, m - H);
    store_f<T, NT>(a0 * c00 - b0 * s00, a1 * c01 - b1 * s01, out + i, m);
    store_f<T, NT>(b0 * c10 + a0 * s10, b1 * c11 + a1 * s11, out + half + i, m);
  }
}

// Interleaved pairs (2i, 2i + 1).
template <typename T, bool NT>
inline void rotate_interleaved_row(const T* in, T* out, const TokenAngles<float>& g, int64_t half) {
  constexpr int64_t H = fVec::size();  // pairs per step
  for (int64_t i = 0; i < half; i += H) {
    const int64_t m = std::min(H, half - i);
    fVec x0, x1;
    load_2f<T>(in + 2 * i, 2 * m, x0, x1);
    auto ab = at::vec::deinterleave2(x0, x1);
    const fVec& a = std::get<0>(ab);
    const fVec& b = std::get<1>(ab);
    const fVec o0 = a * load_f(g.c0 + i, m) - b * load_f(g.s0 + i, m);
    const fVec o1 = b * load_f(g.c1 + i, m) + a * load_f(g.s1 + i, m);
    auto y = at::vec::interleave2(o0, o1);
    store_f<T, NT>(std::get<0>(y), std::get<1>(y), out + 2 * i, 2 * m);
  }
}

// Any dtype, any dim stride (fp64 data, strided rows).
template <typename T, typename A>
void rotate_row_generic(const T* in, T* out, int64_t sd, int64_t od, const TokenAngles<A>& g, int64_t half,
                        bool interleaved) {
  for (int64_t i = 0; i < half; ++i) {
    const int64_t i0 = interleaved ? 2 * i : i;
    const int64_t i1 = interleaved ? 2 * i + 1 : i + half;
    const A a = static_cast<A>(in[i0 * sd]);
    const A b = static_cast<A>(in[i1 * sd]);
    out[i0 * od] = static_cast<T>(a * g.c0[i] - b * g.s0[i]);
    out[i1 * od] = static_cast<T>(b * g.c1[i] + a * g.s1[i]);
  }
}

// How the rows of one tensor are rotated.
enum class RowPath { kGeneric, kVector, kVectorStream };

template <typename T, typename A>
inline void rotate_row(const T* in, T* out, const TensorRef& r, RowPath path, const TokenAngles<A>& g, int64_t half,
                       bool interleaved) {
  if constexpr (std::is_same<A, float>::value) {
    if (path == RowPath::kVectorStream) {
      if (interleaved) rotate_interleaved_row<T, true>(in, out, g, half);
      else rotate_half_row<T, true>(in, out, g, half);
      return;
    }
    if (path == RowPath::kVector) {
      if (interleaved) rotate_interleaved_row<T, false>(in, out, g, half);
      else rotate_half_row<T, false>(in, out, g, half);
      return;
    }
  }
  rotate_row_generic<T, A>(in, out, r.in_stride[3], r.out_stride[3], g, half, interleaved);
}

// Contiguous rows take the vector path; large out-of-place outputs whose every
// row and half-row starts on a vector boundary are streamed.
template <typename T>
RowPath row_path(const Params& p, const TensorRef& r, int64_t total_out_bytes) {
  if (std::is_same<T, double>::value || r.in_stride[3] != 1 || r.out_stride[3] != 1) return RowPath::kGeneric;
  if (kStreamBytes == 0 || r.out == r.in || total_out_bytes < kStreamMinBytes) return RowPath::kVector;
  const int64_t e = sizeof(T);
  bool aligned = reinterpret_cast<uintptr_t>(r.out) % kStreamBytes == 0;
  for (int d = 0; d < 3; ++d) aligned = aligned && (r.out_stride[d] * e) % kStreamBytes == 0;
  if (!p.interleaved) aligned = aligned && (p.half * e) % kStreamBytes == 0;
  return aligned ? RowPath::kVectorStream : RowPath::kVector;
}

// ---------------------------------------------------------------------------
// the launch

template <typename T, typename C>
void cpu_kernel(const Params& p) {
  using A = typename std::conditional<std::is_same<T, double>::value, double, float>::type;
  const int64_t tokens = p.batch * p.seq;
  const int64_t half = p.half;
  const int64_t blocks = (tokens + kTokenBlock - 1) / kTokenBlock;
  const int64_t heads_q = p.x[0].heads;
  const int64_t rows = heads_q + (p.nx > 1 ? p.x[1].heads : 0);
  if (tokens == 0 || rows == 0) return;

  // Work items: (token block, group of heads). Heads are split only when the
  // blocks alone cannot keep every thread busy.
  const int64_t threads = at::get_num_threads();
  int64_t groups = 1;
  if (blocks < 2 * threads) groups = std::min<int64_t>(rows, (2 * threads + blocks - 1) / blocks);
  const int64_t items = blocks * groups;
  const int64_t rows_per_item = (rows + groups - 1) / groups;
  const int64_t work = std::min<int64_t>(kTokenBlock, tokens) * rows_per_item * p.rotary_dim;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, work));

  std::vector<double> inv;
  if (p.mode == kInvFreq) {
    inv.resize(half);
    for (int64_t i = 0; i < half; ++i) inv[i] = static_cast<double>(p.inv_freq[i * p.inv_freq_stride]);
  }
  // Visit rows in memory order: token by token when a token's heads lie closer
  // together than consecutive tokens ([b, s, h, d]), head by head otherwise.
  const TensorRef& q = p.x[0];
  const bool token_major = std::abs(q.in_stride[2]) <= std::abs(q.in_stride[1]);
  const int64_t total_out_bytes = tokens * rows * p.rotary_dim * static_cast<int64_t>(sizeof(T));
  RowPath path[2] = {RowPath::kGeneric, RowPath::kGeneric};
  bool streams = false;
  for (int j = 0; j < p.nx; ++j) {
    path[j] = row_path<T>(p, p.x[j], total_out_bytes);
    streams = streams || path[j] == RowPath::kVectorStream;
  }

  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<A> buf(4 * half * kTokenBlock);
    std::vector<double> phase(std::is_same<A, float>::value ? half * kTokenBlock : 0);
    TokenAngles<A> ang[kTokenBlock];
    int64_t in_off[2][kTokenBlock], out_off[2][kTokenBlock];
    int64_t filled = -1;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t blk = item / groups, group = item % groups;
      const int64_t t0 = blk * kTokenBlock;
      const int64_t nt = std::min(kTokenBlock, tokens - t0);
      if (blk != filled) {  // consecutive items of one block share its angles
        fill_block<A, C>(p, inv.data(), t0, nt, buf.data(), phase.data(), ang);
        for (int64_t u = 0; u < nt; ++u) {
          const int64_t b = (t0 + u) / p.seq, s = (t0 + u) % p.seq;
          for (int j = 0; j < p.nx; ++j) {
            in_off[j][u] = b * p.x[j].in_stride[0] + s * p.x[j].in_stride[1];
            out_off[j][u] = b * p.x[j].out_stride[0] + s * p.x[j].out_stride[1];
          }
        }
        filled = blk;
      }
      const int64_t row_lo = group * rows / groups, row_hi = (group + 1) * rows / groups;
      auto rotate = [&](int64_t u, int64_t row) {
        const int j = row < heads_q ? 0 : 1;
        const int64_t h = j ? row - heads_q : row;
        const TensorRef& r = p.x[j];
        const T* in = static_cast<const T*>(r.in) + in_off[j][u] + h * r.in_stride[2];
        T* out = static_cast<T*>(r.out) + out_off[j][u] + h * r.out_stride[2];
        rotate_row<T, A>(in, out, r, path[j], ang[u], half, p.interleaved);
      };
      if (token_major) {
        for (int64_t u = 0; u < nt; ++u)
          for (int64_t row = row_lo; row < row_hi; ++row) rotate(u, row);
      } else {
        for (int64_t row = row_lo; row < row_hi; ++row)
          for (int64_t u = 0; u < nt; ++u) rotate(u, row);
      }
    }
    if (streams) stream_fence();  // the streamed lines are visible before the pool's barrier
  });
}

template <typename T>
void dispatch_cos(const Params& p, bool cos_is_float) {
  if (p.mode == kInvFreq || cos_is_float) cpu_kernel<T, float>(p);
  else cpu_kernel<T, T>(p);
}

}  // namespace

void run_cpu_kernel(const Params& p, int32_t storage, bool cos_is_float) {
  switch (storage) {
    case kF32: dispatch_cos<float>(p, cos_is_float); break;
    case kF16: dispatch_cos<c10::Half>(p, cos_is_float); break;
    case kBF16: dispatch_cos<c10::BFloat16>(p, cos_is_float); break;
    default: dispatch_cos<double>(p, cos_is_float); break;
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace ftshims_rotary
