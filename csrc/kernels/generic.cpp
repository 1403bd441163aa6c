// Family "generic": portable C++, no intrinsics, built with the compiler's baseline flags. It runs
// the same tile loop as the SIMD families with an 8-lane array "vector" the compiler may
// auto-vectorise; it is the reference for the others and the only family on non-x86 machines.
#include <cmath>

#include "common/gemm_f32.h"
#include "common/probe.h"
#include "common/routes.h"
#include "common/tile_loop.h"

namespace fa2cpu {
namespace {

struct VGeneric {
    struct vec { float x[8]; };
    static constexpr int W = 8, RV = 1, NK = 4, ND = 4;
    static constexpr int64_t BC = 64, MAX_ROWS = 64;
    static constexpr int64_t DC = kMaxHeadDim, CC = BC;  // one reduction pass per product (gemm_f32.h)

#define FA2_GENERIC_MAP(expr) vec r; for (int i = 0; i < W; ++i) r.x[i] = (expr); return r
    static vec zero() { FA2_GENERIC_MAP(0.f); }
    static vec set1(float a) { FA2_GENERIC_MAP(a); }
    static vec load(const float* p) { FA2_GENERIC_MAP(p[i]); }
    static void store(float* p, const vec& a) { for (int i = 0; i < W; ++i) p[i] = a.x[i]; }
    static vec fma(const vec& a, const vec& b, const vec& c) { FA2_GENERIC_MAP(a.x[i] * b.x[i] + c.x[i]); }
    static vec add(const vec& a, const vec& b) { FA2_GENERIC_MAP(a.x[i] + b.x[i]); }
    static vec sub(const vec& a, const vec& b) { FA2_GENERIC_MAP(a.x[i] - b.x[i]); }
    static vec mul(const vec& a, const vec& b) { FA2_GENERIC_MAP(a.x[i] * b.x[i]); }
    // max keeps a NaN of either operand's lane from being dropped only via the later exp2; same as SIMD.
    static vec max(const vec& a, const vec& b) { FA2_GENERIC_MAP(a.x[i] > b.x[i] ? a.x[i] : b.x[i]); }
    static vec abs(const vec& a) { FA2_GENERIC_MAP(std::fabs(a.x[i])); }
    static vec exp2(const vec& a) { FA2_GENERIC_MAP(std::exp2(a.x[i])); }
    static vec tanh(const vec& a) { FA2_GENERIC_MAP(std::tanh(a.x[i])); }
    static vec mask_outside(const vec& x, const vec& kc, const vec& lo, const vec& hi, const vec& ninf) {
        FA2_GENERIC_MAP((kc.x[i] < lo.x[i] || kc.x[i] > hi.x[i]) ? ninf.x[i] : x.x[i]);
    }
    static vec zero_where_ninf(const vec& m) { FA2_GENERIC_MAP(m.x[i] == -INFINITY ? 0.f : m.x[i]); }
#undef FA2_GENERIC_MAP
    static bool any_gt(const vec& a, const vec& b) {
        for (int i = 0; i < W; ++i) if (a.x[i] > b.x[i]) return true;
        return false;
    }
    static void load_row(float* dst, const void* src, int64_t n, int64_t stride, DType dt) {
        load_row_scalar(dst, src, n, stride, dt);
    }
    static void store_row(void* base, int64_t idx, int64_t stride, const float* src, int64_t n, DType dt) {
        fa2cpu::store_row(base, idx, stride, src, n, dt);
    }
};

double peak(int, double seconds) { return fma_peak_gflops<VGeneric, 4>(seconds); }

}  // namespace

extern const KernelTable kTable_generic = make_table(&peak, BackwardRoute<BackwardLoop<VGeneric>>(),
                                                     TileRoute<TileLoop<VGeneric, F32Gemm<VGeneric>>>::route("f32"));

}  // namespace fa2cpu
