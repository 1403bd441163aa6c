// The dispatch table: one row per family of catalogue.def that this build compiled, the usable
// best one chosen once and cached in an atomic; set_isa overrides it (FA2CPU_ISA is read by the
// Python layer at import and routed through set_isa so both paths share one validation).
//
// Which families were compiled: setup.py passes FA2CPU_BUILT_FAMILIES, a bit mask over catalogue
// rows (bit i = row i). A family that was not built is referenced only inside a discarded
// `if constexpr` branch, so its `kTable_<name>` need not exist.
#include <atomic>

#include "../kernels/common/kernel.h"
#include "cpu_features.h"
#include "registry.h"

#ifndef FA2CPU_BUILT_FAMILIES
#define FA2CPU_BUILT_FAMILIES (1ull << int(fa2cpu::Isa::generic))
#endif

namespace fa2cpu {

#define FA2CPU_FAMILY(name, flags) extern const KernelTable kTable_##name;
#include "fa2cpu/catalogue.def"

namespace {

constexpr bool built(Isa isa) { return (static_cast<unsigned long long>(FA2CPU_BUILT_FAMILIES) >> int(isa)) & 1u; }
static_assert(built(Isa::generic), "the generic family is always built");

const KernelTable* table_of(int isa) {
#define FA2CPU_FAMILY(name, flags) \
    if constexpr (built(Isa::name)) if (isa == int(Isa::name)) return &kTable_##name;
#include "fa2cpu/catalogue.def"
    return nullptr;
}

bool cpu_can_run(int isa) {
    const CpuFeatures& f = cpu_features();
#define FA2CPU_FAMILY(name, flags) if (isa == int(Isa::name)) return f.name;
#include "fa2cpu/catalogue.def"
    return false;
}

constexpr const char* kIsaNames[] = {
#define FA2CPU_FAMILY(name, flags) #name,
#include "fa2cpu/catalogue.def"
};
constexpr const char* kDtypeNames[] = {
#define FA2CPU_DTYPE(name, numpy_name, bytes) numpy_name,
#include "fa2cpu/catalogue.def"
};

std::atomic<int> g_chosen{-1};

}  // namespace

int isa_count() { return int(Isa::count); }
const char* isa_name(int isa) { return isa >= 0 && isa < int(Isa::count) ? kIsaNames[isa] : nullptr; }
int dtype_count() { return int(DType::count); }
const char* dtype_name(int dtype) { return dtype >= 0 && dtype < int(DType::count) ? kDtypeNames[dtype] : nullptr; }

bool isa_compiled(int isa) { return isa >= 0 && isa < int(Isa::count) && table_of(isa) != nullptr; }
bool isa_usable(int isa) { return isa_compiled(isa) && cpu_can_run(isa); }

int available_isas(int* out) {
    int n = 0;
    for (int i = 0; i < int(Isa::count); ++i)
        if (isa_usable(i)) out[n++] = i;
    return n;
}

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
