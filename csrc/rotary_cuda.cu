// ftshims rotary embedding: CUDA kernels.
//
// One block per token (grid-stride over tokens). The block computes the token's
// angles once per rotary pair (sincos of position * inv_freq, or the cos/sin
// rows) into shared memory, then rotates every head of q and of k from them:
// the phase is made once per (position, frequency) and shared by all heads, and
// q and k share one launch. Loads and stores are 16-byte vectors (P pairs of a
// half, or P interleaved pairs) when the rows are contiguous and aligned, scalar
// otherwise. All arithmetic is fp32 (fp64 for fp64 data);
// the phase is position * inv_freq with the product's rounding error recovered
// by an fma, and sincosf is the accurate one (this file must not be compiled
// with --use_fast_math).
//
// Only c10/cuda headers are used (no ATen/cuda/CUDAContext.h), so a minimal
// toolkit without cuBLAS/cuSPARSE headers can build it.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "rotary.h"

namespace ftshims_rotary {

namespace {

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// One 16-byte global load or store (ld/st.global.v4): a Vec of 16 bytes moves as
// four 32-bit words of its bit patterns. (Copied as a struct, through a union or
// by memcpy, the compiler splits the store into one per element or pair.)
__device__ __forceinline__ uint32_t raw_bits(float v) { return __float_as_uint(v); }
__device__ __forceinline__ uint16_t raw_bits(c10::Half v) { return v.x; }
__device__ __forceinline__ uint16_t raw_bits(c10::BFloat16 v) { return v.x; }
__device__ __forceinline__ float from_bits(uint32_t u, float*) { return __uint_as_float(u); }
__device__ __forceinline__ c10::Half from_bits(uint16_t u, c10::Half*) { return c10::Half(u, c10::Half::from_bits()); }
__device__ __forceinline__ c10::BFloat16 from_bits(uint16_t u, c10::BFloat16*) {
  return c10::BFloat16(u, c10::BFloat16::from_bits());
}

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load16(const T* ptr) {
  static_assert(sizeof(T) * N == 16, "16-byte vectors only");
  const uint4 u = *reinterpret_cast<const uint4*>(ptr);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
  Vec<T, N> v;
  if constexpr (sizeof(T) == 8) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
      v.v[j] = __longlong_as_double(static_cast<long long>((static_cast<uint64_t>(w[2 * j + 1]) << 32) | w[2 * j]));
  } else if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) v.v[j] = from_bits(w[j], static_cast<T*>(nullptr));
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v.v[2 * j] = from_bits(static_cast<uint16_t>(w[j] & 0xFFFFu), static_cast<T*>(nullptr));
      v.v[2 * j + 1] = from_bits(static_cast<uint16_t>(w[j] >> 16), static_cast<T*>(nullptr));
    }
  }
  return v;
}

template <typename T, int N>
__device__ __forceinline__ void store16(T* ptr, const Vec<T, N>& v) {
  static_assert(sizeof(T) * N == 16, "16-byte vectors only");
  uint32_t w[4];
  if constexpr (sizeof(T) == 8) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const uint64_t b = static_cast<uint64_t>(__double_as_longlong(v.v[j]));
      w[2 * j] = static_cast<uint32_t>(b);
      w[2 * j + 1] = static_cast<uint32_t>(b >> 32);
    }
  } else if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = raw_bits(v.v[j]);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = static_cast<uint32_t>(raw_bits(v.v[2 * j])) | (static_cast<uint32_t>(raw_bits(v.v[2 * j + 1])) << 16);
  }
  // By instruction: given a uint4 (or a struct, a union, a memcpy) the compiler still splits the store by element.
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
               : "memory");
}

template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

__device__ __forceinline__ void device_angle(float pos, float f, float& c, float& s) {
  const float hi = __fmul_rn(pos, f);
  const float lo = fmaf(pos, f, -hi);
  float sh, ch;
  sincosf(hi, &sh, &ch);
  // cos/sin of the residual |lo| <= ulp(hi)/2 by Taylor series (1e-7 up to |lo| = 0.5).
  const float l2 = lo * lo;
  const float cl = 1.0f - l2 * (0.5f - l2 * (1.0f / 24.0f - l2 * (1.0f / 720.0f)));
  const float sl = lo * (1.0f - l2 * (1.0f / 6.0f - l2 * (1.0f / 120.0f - l2 * (1.0f / 5040.0f))));
  c = ch * cl - sh * sl;
  s = sh * cl + ch * sl;
}
__device__ __forceinline__ void device_angle(double pos, double f, double& c, double& s) {
  sincos(pos * f, &s, &c);
}

__device__ __forceinline__ int64_t device_position(const Params& p, int64_t b, int64_t s) {
  int64_t pos, row = b;
  if (p.cu_seqlens.ptr) {
    int64_t lo = 0, hi = p.nseq - 1;
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

template <typename T, typename A, int P>
__device__ __forceinline__ Vec<T, 2 * P> rotate_interleaved(const Vec<T, 2 * P>& x, const A* c0, const A* s0,
                                                           const A* c1, const A* s1) {
  Vec<T, 2 * P> o;
#pragma unroll
  for (int j = 0; j < P; ++j) {
    const A a = static_cast<A>(x.v[2 * j]), b = static_cast<A>(x.v[2 * j + 1]);
    o.v[2 * j] = static_cast<T>(a * c0[j] - b * s0[j]);
    o.v[2 * j + 1] = static_cast<T>(b * c1[j] + a * s1[j]);
  }
  return o;
}

template <typename T, typename A, int P>
__device__ __forceinline__ void rotate_halves(Vec<T, P>& x0, Vec<T, P>& x1, const A* c0, const A* s0, const A* c1,
                                              const A* s1) {
#pragma unroll
  for (int j = 0; j < P; ++j) {
    const A a = static_cast<A>(x0.v[j]), b = static_cast<A>(x1.v[j]);
    x0.v[j] = static_cast<T>(a * c0[j] - b * s0[j]);
    x1.v[j] = static_cast<T>(b * c1[j] + a * s1[j]);
  }
}

// Pairs whose angles a block holds in shared memory at once (4 x 1024 fp32 = 16 KiB,
// 32 KiB for fp64): rotary_dim/2 up to this is one pass per token, beyond it a few.
constexpr int kSlice = 1024;

// One block per token at a time (grid-stride over tokens). For each slice of the
// rotary pairs: (1) the block's threads compute the slice's angles once — sin/cos
// of position * inv_freq, or the rows of the cos/sin tables — into shared memory;
// (2) every (row, chunk) of q and of k is rotated from them, chunk fastest, so a
// warp reads and writes consecutive 16-byte vectors of a row ([b, s, h, d]: of
// the token's rows, which are adjacent). P pairs per chunk; INTER: interleaved
// pairs (2i, 2i+1), else halves (i, i+half); VEC: rows contiguous and aligned for
// P-wide (half) / 2P-wide (interleaved) vectors of 16 bytes.
template <typename T, typename C, int P, bool INTER, bool VEC>
__global__ void rotary_kernel(const Params p, int64_t tokens) {
  using A = typename Acc<T>::type;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* sc0 = reinterpret_cast<A*>(smem_raw);
  A* ss0 = sc0 + kSlice;
  A* sc1 = ss0 + kSlice;
  A* ss1 = sc1 + kSlice;
  const int64_t heads_q = p.x[0].heads;
  const int64_t rows_total = heads_q + (p.nx > 1 ? p.x[1].heads : 0);
  const A scale = static_cast<A>(p.scaling);
  const A sign = p.conjugate ? A(-1) : A(1);
  const int64_t half = p.half;

  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t b = t / p.seq, s = t % p.seq;
    const int64_t pos = p.mode != kCosToken ? device_position(p, b, s) : 0;
    int64_t cb = 0, sb = 0;
    if (p.mode == kCosTable) {
      cb = pos * p.cos_stride[0];
      sb = pos * p.sin_stride[0];
    } else if (p.mode == kCosToken) {
      cb = b * p.cos_stride[0] + s * p.cos_stride[1];
      sb = b * p.sin_stride[0] + s * p.sin_stride[1];
    }
    for (int64_t base = 0; base < half; base += kSlice) {
      const int n = static_cast<int>(min(static_cast<int64_t>(kSlice), half - base));
      // (1) the slice's angles, once per (token, pair)
      for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const int64_t i = base + j;
        if (p.mode == kInvFreq) {
          A c, sn;
          device_angle(static_cast<A>(pos), static_cast<A>(p.inv_freq[i * p.inv_freq_stride]), c, sn);
          sc0[j] = sc1[j] = c * scale;
          ss0[j] = ss1[j] = sn * scale * sign;
        } else {
          const C* cp = static_cast<const C*>(p.cos);
          const C* sp = static_cast<const C*>(p.sin);
          int64_t j0 = i, j1 = i;
          if (p.cos_full) {
            j0 = INTER ? 2 * i : i;
            j1 = INTER ? 2 * i + 1 : i + half;
          }
          sc0[j] = static_cast<A>(cp[cb + j0 * p.cos_stride[2]]) * scale;
          sc1[j] = static_cast<A>(cp[cb + j1 * p.cos_stride[2]]) * scale;
          // conjugate = the transposed map (sin halves swap): the inverse rotation when s0 == s1
          const int64_t k0 = p.conjugate ? j1 : j0, k1 = p.conjugate ? j0 : j1;
          ss0[j] = static_cast<A>(sp[sb + k0 * p.sin_stride[2]]) * scale * sign;
          ss1[j] = static_cast<A>(sp[sb + k1 * p.sin_stride[2]]) * scale * sign;
        }
      }
      __syncthreads();
      // (2) every row of q and k, chunk by chunk
      const int chunks = n / P;  // n is a multiple of P: kSlice is, and so is half (VEC) or P == 1
      const int items = static_cast<int>(rows_total) * chunks;  // < 2^31: checked at launch
      for (int it = threadIdx.x; it < items; it += blockDim.x) {
        const int row = it / chunks;
        const int jc = (it - row * chunks) * P;  // first pair of the chunk, in the slice
        const int64_t i0 = base + jc;                            // ... in the row
        // q's row or k's (selected field by field: indexing p.x with a variable would copy it to local memory)
        const bool is_k = row >= heads_q;
        const TensorRef& r0 = p.x[0];
        const TensorRef& r1 = p.x[1];
        const int64_t h = is_k ? row - heads_q : row;
        const T* in = static_cast<const T*>(is_k ? r1.in : r0.in) +
                      b * (is_k ? r1.in_stride[0] : r0.in_stride[0]) + s * (is_k ? r1.in_stride[1] : r0.in_stride[1]) +
                      h * (is_k ? r1.in_stride[2] : r0.in_stride[2]);
        T* out = static_cast<T*>(is_k ? r1.out : r0.out) + b * (is_k ? r1.out_stride[0] : r0.out_stride[0]) +
                 s * (is_k ? r1.out_stride[1] : r0.out_stride[1]) + h * (is_k ? r1.out_stride[2] : r0.out_stride[2]);
        if constexpr (VEC) {
          if constexpr (INTER) {
            using V = Vec<T, 2 * P>;
            const V x = load16<T, 2 * P>(in + 2 * i0);
            store16(out + 2 * i0, rotate_interleaved<T, A, P>(x, sc0 + jc, ss0 + jc, sc1 + jc, ss1 + jc));
          } else {
            using V = Vec<T, P>;
            V x0 = load16<T, P>(in + i0);
            V x1 = load16<T, P>(in + half + i0);
            rotate_halves<T, A, P>(x0, x1, sc0 + jc, ss0 + jc, sc1 + jc, ss1 + jc);
            store16(out + i0, x0);
            store16(out + half + i0, x1);
          }
        } else {
          const int64_t sd = is_k ? r1.in_stride[3] : r0.in_stride[3];
          const int64_t od = is_k ? r1.out_stride[3] : r0.out_stride[3];
#pragma unroll
          for (int j = 0; j < P; ++j) {
            const int64_t i = i0 + j;
            const int64_t k0 = INTER ? 2 * i : i;
            const int64_t k1 = INTER ? 2 * i + 1 : i + half;
            const A a = static_cast<A>(in[k0 * sd]), bb = static_cast<A>(in[k1 * sd]);
            out[k0 * od] = static_cast<T>(a * sc0[jc + j] - bb * ss0[jc + j]);
            out[k1 * od] = static_cast<T>(bb * sc1[jc + j] + a * ss1[jc + j]);
          }
        }
      }
      __syncthreads();  // the next slice or token overwrites the angles
    }
  }
}

bool aligned(const void* ptr, int64_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// Can every row be read and written as P-pair vectors?
template <typename T, int P, bool INTER>
bool can_vectorise(const Params& p) {
  const int64_t width = INTER ? 2 * P : P;  // elements per vector
  if (p.half % P != 0) return false;
  for (int j = 0; j < p.nx; ++j) {
    const TensorRef& r = p.x[j];
    if (r.in_stride[3] != 1 || r.out_stride[3] != 1) return false;
    if (!aligned(r.in, width * sizeof(T)) || !aligned(r.out, width * sizeof(T))) return false;
    for (int d = 0; d < 3; ++d) {
      if (r.in_stride[d] % width != 0 || r.out_stride[d] % width != 0) return false;
    }
    if (!INTER && p.half % width != 0) return false;
  }
  return true;
}

template <typename T, typename C, int P, bool INTER, bool VEC>
void launch(const Params& p, cudaStream_t stream) {
  using A = typename Acc<T>::type;
  const int64_t tokens = p.batch * p.seq;
  const int64_t rows_total = p.x[0].heads + (p.nx > 1 ? p.x[1].heads : 0);
  // Threads: the (row, chunk) items of one token, in as few equal rounds of at most 512 as they fit.
  const int64_t items = rows_total * (std::min<int64_t>(p.half, kSlice) / P);
  TORCH_CHECK_VALUE(items < (int64_t(1) << 31), "rotary: too many heads for one CUDA launch (", rows_total, ")");
  const int64_t rounds = std::max<int64_t>(1, (items + 511) / 512);
  const int64_t per_round = (items + rounds - 1) / rounds;
  const int threads = static_cast<int>(std::min<int64_t>(512, std::max<int64_t>(64, (per_round + 31) / 32 * 32)));
  const int64_t blocks = std::min<int64_t>(tokens, int64_t(1) << 30);
  const size_t smem = 4 * kSlice * sizeof(A);
  rotary_kernel<T, C, P, INTER, VEC><<<static_cast<unsigned>(blocks), threads, smem, stream>>>(p, tokens);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, typename C>
void dispatch_layout(const Params& p, cudaStream_t stream) {
  constexpr int PH = 16 / sizeof(T) > 0 ? 16 / sizeof(T) : 1;  // pairs per thread, half layout (16-byte vectors)
  constexpr int PI = PH / 2 > 0 ? PH / 2 : 1;                  // pairs per thread, interleaved (one 16-byte vector)
  if (p.interleaved) {
    if (can_vectorise<T, PI, true>(p)) launch<T, C, PI, true, true>(p, stream);
    else launch<T, C, 1, true, false>(p, stream);
  } else {
    if (can_vectorise<T, PH, false>(p)) launch<T, C, PH, false, true>(p, stream);
    else launch<T, C, 1, false, false>(p, stream);
  }
}

template <typename T>
void dispatch_cos(const Params& p, bool cos_is_float, cudaStream_t stream) {
  if (p.mode == kInvFreq || cos_is_float) dispatch_layout<T, float>(p, stream);
  else dispatch_layout<T, T>(p, stream);
}

}  // namespace

void run_cuda(const Params& p, int32_t storage, bool cos_is_float, int device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  switch (storage) {
    case kF32: dispatch_cos<float>(p, cos_is_float, stream); break;
    case kF16: dispatch_cos<c10::Half>(p, cos_is_float, stream); break;
    case kBF16: dispatch_cos<c10::BFloat16>(p, cos_is_float, stream); break;
    default: dispatch_cos<double>(p, cos_is_float, stream); break;
  }
}

}  // namespace ftshims_rotary
