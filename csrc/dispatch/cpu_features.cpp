// CPU and OS feature detection. Built with no -m flags: it must run on any x86-64 (and compile
// to "nothing but generic" elsewhere). A family is usable only if the CPU has its instructions
// AND the OS saves the register state they use (XCR0), AND for AMX the kernel granted the
// tile-data permission.
#include "cpu_features.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace fa2cpu {

#if defined(__x86_64__) || defined(_M_X64)
static uint64_t read_xcr0() {
    uint32_t eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return (uint64_t(edx) << 32) | eax;
}

static bool request_amx_permission() {
#if defined(__linux__)
    constexpr long ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return false;
    unsigned long bitmask = 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bitmask) != 0) return false;
    return (bitmask & (1ul << XFEATURE_XTILEDATA)) != 0;
#else
    return false;
#endif
}

// The families' CPU checks (one line each below, f.<family> = ...); generic needs nothing.
static CpuFeatures detect() {
    CpuFeatures f;
    f.generic = true;
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return f;
    const unsigned max_leaf = a;
    f.amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // "Auth" "enti" "cAMD"
    __get_cpuid(1, &a, &b, &c, &d);
    const bool osxsave = c & (1u << 27), fma = c & (1u << 12), f16c = c & (1u << 29), avx = c & (1u << 28);
    if (!osxsave || !avx) return f;
    const uint64_t xcr0 = read_xcr0();
    const bool os_ymm = (xcr0 & 0x6) == 0x6;             // SSE + AVX state
    const bool os_zmm = os_ymm && (xcr0 & 0xe0) == 0xe0;  // opmask, ZMM_Hi256, Hi16_ZMM
    const bool os_amx = (xcr0 & (3ull << 17)) == (3ull << 17);  // XTILECFG + XTILEDATA
    if (max_leaf < 7) return f;
    __cpuid_count(7, 0, a, b, c, d);
    const bool avx2 = b & (1u << 5), avx512f = b & (1u << 16), avx512dq = b & (1u << 17);
    const bool avx512bw = b & (1u << 30), avx512vl = b & (1u << 31);
    const bool avx512_vnni = c & (1u << 11);
    const bool amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24);
    __cpuid_count(7, 1, a, b, c, d);
    const bool avx512_bf16 = a & (1u << 5);

    f.avx2 = os_ymm && avx2 && fma && f16c;
    f.avx512 = f.avx2 && os_zmm && avx512f && avx512dq && avx512bw && avx512vl;
    f.avx512vnni = f.avx512 && avx512_vnni;
    f.avx512bf16 = f.avx512 && avx512_bf16 && avx512_vnni;  // every AVX512_BF16 CPU has VNNI
    f.amx = f.avx512bf16 && amx_bf16 && amx_tile && os_amx && request_amx_permission();
    return f;
}
#else
static CpuFeatures detect() {
    CpuFeatures f;
    f.generic = true;
    return f;
}
#endif

const CpuFeatures& cpu_features() {
    static const CpuFeatures f = detect();  // thread-safe one-time init
    return f;
}

}  // namespace fa2cpu
