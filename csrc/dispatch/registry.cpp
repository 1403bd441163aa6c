// The dispatch table: one row per compiled family, the usable best one chosen once and cached in
// an atomic; set_isa overrides it (FA2CPU_ISA is read by the Python layer at import and routed
// through set_isa so both paths share one validation).
#include <atomic>

#include "../kernels/common/kernel.h"
#include "cpu_features.h"
#include "registry.h"

namespace fa2cpu {

extern const KernelTable kTableGeneric;
#if defined(FA2CPU_HAVE_AVX2)
extern const KernelTable kTableAvx2;
#endif
#if defined(FA2CPU_HAVE_AVX512)
extern const KernelTable kTableAvx512;
#endif
#if defined(FA2CPU_HAVE_AVX512BF16)
extern const KernelTable kTableAvx512bf16;
#endif
#if defined(FA2CPU_HAVE_AMX)
extern const KernelTable kTableAmx;
#endif

static const KernelTable* table_of(int isa) {
    switch (Isa(isa)) {
#if defined(FA2CPU_HAVE_AMX)
        case Isa::amx: return &kTableAmx;
#endif
#if defined(FA2CPU_HAVE_AVX512BF16)
        case Isa::avx512bf16: return &kTableAvx512bf16;
#endif
#if defined(FA2CPU_HAVE_AVX512)
        case Isa::avx512: return &kTableAvx512;
#endif
#if defined(FA2CPU_HAVE_AVX2)
        case Isa::avx2: return &kTableAvx2;
#endif
        case Isa::generic: return &kTableGeneric;
        default: return nullptr;
    }
}

bool isa_compiled(int isa) { return isa >= 0 && isa < int(Isa::count) && table_of(isa) != nullptr; }

bool isa_usable(int isa) {
    if (!isa_compiled(isa)) return false;
    const CpuFeatures& f = cpu_features();
    switch (Isa(isa)) {
        case Isa::amx: return f.amx;
        case Isa::avx512bf16: return f.avx512bf16;
        case Isa::avx512: return f.avx512;
        case Isa::avx2: return f.avx2;
        default: return true;
    }
}

int available_isas(int* out) {
    int n = 0;
    for (int i = 0; i < int(Isa::count); ++i)
        if (isa_usable(i)) out[n++] = i;
    return n;
}

static std::atomic<int> g_chosen{-1};

static int best_isa() {
    for (int i = 0; i < int(Isa::count); ++i)
        if (isa_usable(i)) return i;
    return int(Isa::generic);
}

int get_isa() {
    int c = g_chosen.load(std::memory_order_acquire);
    if (c < 0) {
        c = best_isa();
        g_chosen.store(c, std::memory_order_release);
    }
    return c;
}
void set_isa(int isa) { g_chosen.store(isa, std::memory_order_release); }
void reset_isa() { g_chosen.store(best_isa(), std::memory_order_release); }

const KernelTable& current_table() { return *table_of(get_isa()); }
const KernelTable* family_table(int isa) { return isa_usable(isa) ? table_of(isa) : nullptr; }

}  // namespace fa2cpu
