// ftshims rotary embedding: the CPU kernel (rotary_cpu.h) built for AVX-512 (F, BW, VL, DQ);
// rotary_cpu.cpp runs it only on CPUs that have these instructions.
//
// The instruction set is switched on for this file alone by a pragma (one build
// line serves every source of torch's extension builder). GCC does not define
// the matching feature macros after the pragma, which torch's headers (and
// sleef.h) test, so they are defined here. Inline functions of the headers that
// other files also emit are taken from the first object on the link line,
// rotary.cpp, built for the baseline: see FTSHIMS_CPU_SOURCES in
// ftshims/kernels/_build.py, which keeps this file after it.
#include "rotary.h"

#if FTSHIMS_CPU_X86_KERNELS
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2")
#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __F16C__
#define __F16C__ 1
#endif
#ifndef __BMI__
#define __BMI__ 1
#endif
#ifndef __BMI2__
#define __BMI2__ 1
#endif
#ifndef __AVX512F__
#define __AVX512F__ 1
#endif
#ifndef __AVX512BW__
#define __AVX512BW__ 1
#endif
#ifndef __AVX512VL__
#define __AVX512VL__ 1
#endif
#ifndef __AVX512DQ__
#define __AVX512DQ__ 1
#endif
#define CPU_CAPABILITY ftshims_cpu_avx512
#define CPU_CAPABILITY_AVX512
#include "rotary_cpu.h"
#endif
