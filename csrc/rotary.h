// ftshims rotary embedding: the plain description of one launch, shared by the
// CPU kernels (rotary.cpp) and the CUDA kernels (rotary_cuda.cu).
//
// Every tensor is seen through a logical [batch, seq, heads, dim] view with
// arbitrary strides (varlen inputs are [1, total, heads, dim]). Angles are
// `position * inv_freq[i]` computed in fp32 (fp64 for fp64 storage) inside the
// kernel, or read from cos/sin tensors; the rotation itself always runs in
// fp32 (fp64 for fp64 storage), whatever the storage dtype.
#pragma once

#include <cstdint>

namespace ftshims_rotary {

// Where the angle comes from.
enum AngleMode : int32_t {
  kInvFreq = 0,   // angle = position * inv_freq[i] (fp32 inv_freq of rotary_dim/2 values)
  kCosTable = 1,  // cos/sin rows indexed by position: [rows, width]
  kCosToken = 2,  // cos/sin rows indexed by (batch, seq): [batch or 1, seq, width]
};

// Index tensors may be int32 or int64; `is64` says which.
struct IndexRef {
  const void* ptr = nullptr;
  bool is64 = true;
  int64_t stride_b = 0;  // positions only: strides over (batch, seq); 0 broadcasts
  int64_t stride_s = 0;
};

struct TensorRef {
  const void* in = nullptr;
  void* out = nullptr;  // may equal `in` (in place)
  int64_t heads = 0;
  int64_t in_stride[4] = {0, 0, 0, 0};   // batch, seq, head, dim
  int64_t out_stride[4] = {0, 0, 0, 0};
};

struct Params {
  int64_t batch = 0, seq = 0, head_dim = 0;
  int64_t rotary_dim = 0, half = 0;
  TensorRef x[2];
  int32_t nx = 1;  // 1: q only, 2: q and k in one launch

  int32_t mode = kInvFreq;
  const float* inv_freq = nullptr;  // kInvFreq (fp32 always)
  int64_t inv_freq_stride = 1;
  // kCosTable / kCosToken: cos and sin share one dtype (that of x, or fp32).
  const void* cos = nullptr;
  const void* sin = nullptr;
  bool cos_full = false;           // width == rotary_dim (HF layout) instead of rotary_dim/2
  int64_t cos_stride[3] = {0, 0, 0};  // table: (row, -, col); token: (batch, seq, col)
  int64_t sin_stride[3] = {0, 0, 0};

  IndexRef positions;              // optional: explicit position per (batch, seq)
  IndexRef offsets;                // optional: per batch (or per varlen sequence) offset
  IndexRef cu_seqlens;             // optional: varlen boundaries, nseq + 1 entries
  int64_t nseq = 0;
  int64_t offset = 0;              // scalar offset added to every position

  bool interleaved = false;
  bool conjugate = false;
  double scaling = 1.0;
};

// Storage dtype of q/k, for the CUDA entry point (which sees no ATen types).
enum StorageCode : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2, kF64 = 3 };

// rotary_cpu*.cpp: the CPU kernels, on torch's intra-op thread pool, for the
// instruction set chosen once per process (cpu_isa(): "avx512", "avx2" or
// "default", the build's own flags).
void run_cpu(const Params& p, int32_t storage, bool cos_is_float);
const char* cpu_isa();

// The AVX2 and AVX-512 builds of the CPU kernel exist for x86-64 with GCC (they
// switch the instruction set on by pragma); elsewhere the build's own flags
// serve alone (NEON on aarch64 through torch's Vectorized).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define FTSHIMS_CPU_X86_KERNELS 1
#else
#define FTSHIMS_CPU_X86_KERNELS 0
#endif

#ifdef FTSHIMS_WITH_CUDA
// rotary_cuda.cu: launch on the current stream of `device`. `cos_is_float`:
// cos/sin are fp32 (otherwise they have the storage dtype).
void run_cuda(const Params& p, int32_t storage, bool cos_is_float, int device);
#endif

#if defined(__CUDACC__)
#define FTS_HOST_DEVICE __host__ __device__
#else
#define FTS_HOST_DEVICE
#endif

FTS_HOST_DEVICE inline int64_t load_index(const IndexRef& r, int64_t i) {
  return r.is64 ? static_cast<const int64_t*>(r.ptr)[i] : static_cast<const int32_t*>(r.ptr)[i];
}

}  // namespace ftshims_rotary
