// ftshims rotary embedding: CUDA kernels.
//
// One block per token (grid-stride over tokens). Each thread owns a chunk of P
// rotation pairs of the head dimension: it computes (or loads) the P angles of
// its chunk once and then rotates that chunk in every head of q and of k, so
// the sincos work is amortised over all heads and q/k share one launch.
// Loads and stores are P-wide vectors (16 bytes) when the rows are contiguous
// and aligned, scalar otherwise. All arithmetic is fp32 (fp64 for fp64 data);
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

// P pairs per thread. INTER: interleaved pairs (2i, 2i+1), else halves (i, i+half).
// VEC: rows are contiguous and aligned for P-wide (half) / 2P-wide (interleaved) vectors.
template <typename T, typename C, int P, bool INTER, bool VEC>
__global__ void rotary_kernel(const Params p, int64_t tokens, int chunks, int tpr, int rows_per_iter) {
  using A = typename Acc<T>::type;
  const int tid = threadIdx.x;
  const int lane = tid % tpr;
  const int row0 = tid / tpr;
  if (row0 >= rows_per_iter) return;
  const int64_t rows_total = p.x[0].heads + (p.nx > 1 ? p.x[1].heads : 0);
  const A scale = static_cast<A>(p.scaling);
  const A sign = p.conjugate ? A(-1) : A(1);
  const int64_t half = p.half;

  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t b = t / p.seq, s = t % p.seq;
    int64_t pos = 0;
    if (p.mode != kCosToken) pos = device_position(p, b, s);

    for (int chunk = lane; chunk < chunks; chunk += tpr) {
      const int64_t i0 = static_cast<int64_t>(chunk) * P;
      A c0[P], s0[P], c1[P], s1[P];
      if (p.mode == kInvFreq) {
#pragma unroll
        for (int j = 0; j < P; ++j) {
          A c, sn;
          device_angle(static_cast<A>(pos), static_cast<A>(p.inv_freq[(i0 + j) * p.inv_freq_stride]), c, sn);
          c0[j] = c1[j] = c * scale;
          s0[j] = s1[j] = sn * scale * sign;
        }
      } else {
        int64_t cb, sb;
        if (p.mode == kCosTable) {
          cb = pos * p.cos_stride[0];
          sb = pos * p.sin_stride[0];
        } else {
          cb = b * p.cos_stride[0] + s * p.cos_stride[1];
          sb = b * p.sin_stride[0] + s * p.sin_stride[1];
        }
        const C* cp = static_cast<const C*>(p.cos);
        const C* sp = static_cast<const C*>(p.sin);
#pragma unroll
        for (int j = 0; j < P; ++j) {
          const int64_t i = i0 + j;
          int64_t j0 = i, j1 = i;
          if (p.cos_full) {
            j0 = INTER ? 2 * i : i;
            j1 = INTER ? 2 * i + 1 : i + half;
          }
          c0[j] = static_cast<A>(cp[cb + j0 * p.cos_stride[2]]) * scale;
          c1[j] = static_cast<A>(cp[cb + j1 * p.cos_stride[2]]) * scale;
          // conjugate = the transposed map (sin halves swap): the inverse rotation when s0 == s1
          const int64_t k0 = p.conjugate ? j1 : j0, k1 = p.conjugate ? j0 : j1;
          s0[j] = static_cast<A>(sp[sb + k0 * p.sin_stride[2]]) * scale * sign;
          s1[j] = static_cast<A>(sp[sb + k1 * p.sin_stride[2]]) * scale * sign;
        }
      }

      auto row_ptrs = [&](int64_t row, const T*& in, T*& out) {
        const int which = row < p.x[0].heads ? 0 : 1;
        const TensorRef& r = p.x[which];
        const int64_t h = which ? row - p.x[0].heads : row;
        in = static_cast<const T*>(r.in) + b * r.in_stride[0] + s * r.in_stride[1] + h * r.in_stride[2];
        out = static_cast<T*>(r.out) + b * r.out_stride[0] + s * r.out_stride[1] + h * r.out_stride[2];
      };
      if (VEC) {
        // Two rows per step, both loaded before either is stored: twice the bytes in flight per thread.
        for (int64_t row = row0; row < rows_total; row += 2 * static_cast<int64_t>(rows_per_iter)) {
          const int64_t row_b = row + rows_per_iter;
          const bool two = row_b < rows_total;
          const T *in_a, *in_b = nullptr;
          T *out_a, *out_b = nullptr;
          row_ptrs(row, in_a, out_a);
          if (two) row_ptrs(row_b, in_b, out_b);
          if (INTER) {
            using V = Vec<T, 2 * P>;
            V xa = *reinterpret_cast<const V*>(in_a + 2 * i0);
            V xb;
            if (two) xb = *reinterpret_cast<const V*>(in_b + 2 * i0);
            *reinterpret_cast<V*>(out_a + 2 * i0) = rotate_interleaved<T, A, P>(xa, c0, s0, c1, s1);
            if (two) *reinterpret_cast<V*>(out_b + 2 * i0) = rotate_interleaved<T, A, P>(xb, c0, s0, c1, s1);
          } else {
            using V = Vec<T, P>;
            V xa0 = *reinterpret_cast<const V*>(in_a + i0);
            V xa1 = *reinterpret_cast<const V*>(in_a + half + i0);
            V xb0, xb1;
            if (two) {
              xb0 = *reinterpret_cast<const V*>(in_b + i0);
              xb1 = *reinterpret_cast<const V*>(in_b + half + i0);
            }
            rotate_halves<T, A, P>(xa0, xa1, c0, s0, c1, s1);
            *reinterpret_cast<V*>(out_a + i0) = xa0;
            *reinterpret_cast<V*>(out_a + half + i0) = xa1;
            if (two) {
              rotate_halves<T, A, P>(xb0, xb1, c0, s0, c1, s1);
              *reinterpret_cast<V*>(out_b + i0) = xb0;
              *reinterpret_cast<V*>(out_b + half + i0) = xb1;
            }
          }
        }
      } else {
        for (int64_t row = row0; row < rows_total; row += rows_per_iter) {
          const int which = row < p.x[0].heads ? 0 : 1;
          const TensorRef& r = p.x[which];
          const T* in;
          T* out;
          row_ptrs(row, in, out);
          const int64_t sd = r.in_stride[3], od = r.out_stride[3];
#pragma unroll
          for (int j = 0; j < P; ++j) {
            const int64_t i = i0 + j;
            const int64_t k0 = INTER ? 2 * i : i;
            const int64_t k1 = INTER ? 2 * i + 1 : i + half;
            const A a = static_cast<A>(in[k0 * sd]), bb = static_cast<A>(in[k1 * sd]);
            out[k0 * od] = static_cast<T>(a * c0[j] - bb * s0[j]);
            out[k1 * od] = static_cast<T>(bb * c1[j] + a * s1[j]);
          }
        }
      }
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
  const int64_t tokens = p.batch * p.seq;
  const int64_t rows_total = p.x[0].heads + (p.nx > 1 ? p.x[1].heads : 0);
  const int chunks = static_cast<int>(p.half / P);
  const int tpr = std::min(chunks, 256);
  const int rows_per_iter = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows_total, 512 / tpr)));
  const int threads = tpr * rows_per_iter;
  const int64_t blocks = std::min<int64_t>(tokens, int64_t(1) << 30);
  rotary_kernel<T, C, P, INTER, VEC><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(p, tokens, chunks, tpr,
                                                                                            rows_per_iter);
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
