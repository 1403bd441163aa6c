#pragma once
#include <cstdint>

namespace fa2cpu {
// What this CPU + OS can run: one flag per family of catalogue.def, set by cpu_features.cpp
// (generic is always true). Each x86 flag implies the ones of the families after it.
struct CpuFeatures {
#define FA2CPU_FAMILY(name, flags) bool name = false;
#include "fa2cpu/catalogue.def"
    bool amd = false;  // vendor "AuthenticAMD" (a kernel variant may prefer one vendor's cores)
    // AVX512-VNNI beside the avx512 family (Cascade Lake, Ice Lake: no AVX512-BF16, so no
    // avx512bf16 family): a variant of that family's int8 decode runs on it (gemm_decode.h).
    bool avx512vnni = false;
};
const CpuFeatures& cpu_features();
}  // namespace fa2cpu
