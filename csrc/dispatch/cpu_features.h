#pragma once
#include <cstdint>

namespace fa2cpu {
// What this CPU + OS can run (each flag implies the ones below it).
struct CpuFeatures {
    bool amx = false;         // AMX-TILE + AMX-BF16, XCR0 tile state, Linux permission granted
    bool avx512bf16 = false;  // AVX512_BF16 on top of avx512
    bool avx512 = false;      // AVX-512 F/DQ/BW/VL with ZMM state enabled
    bool avx2 = false;        // AVX2 + FMA + F16C with YMM state enabled
};
const CpuFeatures& cpu_features();
}  // namespace fa2cpu
