// ftshims rotary embedding: the CPU kernel (rotary_cpu.h) for the build's own
// instruction set, and the choice among the compiled ones, made once per process.
//
// The choice follows torch's: at::get_cpu_capability() (which honours torch's
// ATEN_CPU_CAPABILITY=default|avx2|avx512), capped by what this CPU supports, so a
// forced capability never executes an instruction the CPU lacks.
#define CPU_CAPABILITY ftshims_cpu_default
#include "rotary_cpu.h"

#include <ATen/Version.h>

#include <string>

namespace ftshims_rotary {

#if FTSHIMS_CPU_X86_KERNELS
namespace ftshims_cpu_avx2 {
void run_cpu_kernel(const Params& p, int32_t storage, bool cos_is_float);
}
namespace ftshims_cpu_avx512 {
void run_cpu_kernel(const Params& p, int32_t storage, bool cos_is_float);
}
#endif

namespace {

enum class Isa { kDefault, kAvx2, kAvx512 };

Isa choose_isa() {
  const std::string torch_choice = at::get_cpu_capability();
#if FTSHIMS_CPU_X86_KERNELS
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (torch_choice == "AVX512" && avx512) return Isa::kAvx512;
  if ((torch_choice == "AVX512" || torch_choice == "AVX2") && avx2) return Isa::kAvx2;
#endif
  (void)torch_choice;
  return Isa::kDefault;
}

Isa isa() {
  static const Isa chosen = choose_isa();
  return chosen;
}

}  // namespace

void run_cpu(const Params& p, int32_t storage, bool cos_is_float) {
  switch (isa()) {
#if FTSHIMS_CPU_X86_KERNELS
    case Isa::kAvx512: ftshims_cpu_avx512::run_cpu_kernel(p, storage, cos_is_float); return;
    case Isa::kAvx2: ftshims_cpu_avx2::run_cpu_kernel(p, storage, cos_is_float); return;
#endif
    default: ftshims_cpu_default::run_cpu_kernel(p, storage, cos_is_float); return;
  }
}

const char* cpu_isa() {
  switch (isa()) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "default";
  }
}

}  // namespace ftshims_rotary
