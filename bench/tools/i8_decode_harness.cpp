// The int8 decode route's products (Q16DecodeGemm<I8Int16Codes>::qk / ::pv of
// csrc/kernels/common/gemm_decode.h, included whole through amx.cpp so it measures the current
// code) beside the bf16 cache's route (DecodeGemm<Bf16Elem>) on issue 13's item: 32 query rows =
// 8 kv heads x 4, D = Dv = 128, an interleaved (N, Hk, D) cache in the routes' 256-key tiles,
// int8 with per-(key, head) float32 scales. NK keys: in L2 (1024: 1 MB of int8 K + V) or far
// past the caches (65536: 128 MB int8, 256 MB bf16). One core; AVX512-VNNI + AVX512-BF16 CPUs.
// From the repository root:
//
//   g++ -O3 -std=c++17 -fno-math-errno -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c \
//       -mavx512bf16 -mavx512vnni -mamx-tile -mamx-bf16 -fopenmp -Icsrc/kernels -Icsrc -Icsrc/include \
//       bench/tools/i8_decode_harness.cpp -o /tmp/i8_decode -Wl,--unresolved-symbols=ignore-all
//   /tmp/i8_decode            # every case below
//   /tmp/i8_decode int8       # only the int8 route's qk + pv from memory (to alternate builds)
//   I8H_PFK=64 I8H_HINT=1 /tmp/i8_decode bytes   # only "bytes alone", prefetch keys ahead / hint
//
// Cases (best of 5 rounds; TSC cycles and ns per (key, kv head); bf16 / int8 is the speed ratio
// issue 13 asks 1.8 of): qk alone; pv alone (its P quantization included, P filled per tile);
// qk + pv (pv reading qk's scores as P: no softmax); "bytes alone": one load per 64-byte line of
// the same K then V tiles in key order, with the routes' prefetch (prefetcht1 64 keys ahead for
// int8, 32 for bf16: 64 KB either way) and no arithmetic, the memory stream's own rate.
// Session 37 (bench/RESULTS.md): on the 2-core Xeon int8 qk + pv from memory ~29 ns, from L2
// ~17 ns, bytes alone ~20-22 ns; bf16 ~44-49 / ~33 / ~37-41.
#include "kernels/amx.cpp"

#include <x86intrin.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

using namespace fa2cpu;
using G8 = Q16DecodeGemm<I8Int16Codes>;     // the int8 cache's route (bf16 q)
using G16 = DecodeGemm<Bf16Elem>;           // the bf16 cache's route, for the ratio
constexpr int64_t Hk = 8, R = 4, M = Hk * R, D = 128, Dv = 128, BC = G8::BC;

template <class T>
struct Cache {
    std::vector<T> k, v;
    std::vector<float> ks, vs;
    int64_t nk;
    explicit Cache(int64_t n) : k(n * Hk * D), v(n * Hk * Dv), ks(n * Hk), vs(n * Hk), nk(n) {
        std::mt19937 g(1);
        for (auto* a : {&k, &v})
            for (auto& x : *a) x = sizeof(T) == 1 ? T(int(g() % 255) - 127) : T(0x3c00 + g() % 0x200);  // bf16 in [2^-7, 2^-6)
        for (auto* a : {&ks, &vs})
            for (auto& x : *a) x = 0.01f + 0.01f * float(g() % 100) / 100.f;
    }
    template <class G>
    KvTile tile(int which, int64_t c0) const {
        KvTile t{};
        t.data = which == 0 ? static_cast<const void*>(k.data() + c0 * Hk * D) : static_cast<const void*>(v.data() + c0 * Hk * Dv);
        t.ld = Hk * D;
        t.head_stride = D;
        t.prefetch = c0 + BC + G::kPrefetchKeys < nk ? G::kPrefetchKeys * Hk * D : 0;
        if (sizeof(T) == 1) {
            t.scale = (which == 0 ? ks.data() : vs.data()) + c0 * Hk;
            t.scale_ld = Hk;
            t.scale_head_stride = 1;
        }
        return t;
    }
};

// Best of 5 rounds, TSC cycles per (key, kv head), of qk (mode 0), pv (1) or both (2) over the cache.
static int64_t sink = 0;
// bytes-alone mode: prefetch distance in keys (0: none) and hint (0 t0, 1 t1, 2 t2), from the
// environment (I8H_PFK, I8H_HINT; default the route's: kPrefetchKeys, t1)
static int64_t g_pfk = -1;
static int g_hint = 1;
template <class G, class T>
double run(const Cache<T>& c, int mode) {
    std::vector<float> q(G::q_floats(D, M) + 64), o(G::o_floats(Dv, M) + 64), s(BC * G::RB + 64);
    std::vector<int32_t> kv_head(64, Hk - 1);
    std::mt19937 g(2);
    std::normal_distribution<float> nd;
    for (int64_t r = 0; r < M; ++r) {
        float row[D];
        for (auto& x : row) x = nd(g);
        G::pack_q_row(q.data(), M, r, row, D, 0.0883883f * kLog2e);
        kv_head[r] = int32_t(r / R);
    }
    const ItemOperands x{q.data(), o.data(), M, D, Dv, 1.f};
    const RowBlock block{0, int(M / 16), int(M), kv_head.data()};
    double best = 1e30;
    for (int round = 0; round < 5; ++round) {
        const int64_t passes = c.nk >= 65536 ? 1 : 64;
        const uint64_t t0 = __rdtsc();
        for (int64_t p = 0; p < passes; ++p)
            for (int64_t c0 = 0; c0 < c.nk; c0 += BC) {
                const KvTile kt = c.template tile<G>(0, c0), vt = c.template tile<G>(1, c0);
                if (mode == 3) {  // the bytes alone: one load per line, K then V, prefetched as the route does
                    for (int w = 0; w < 2; ++w) {
                        const KvTile& t = w ? vt : kt;
                        const char* base = static_cast<const char*>(t.data);
                        const int64_t row = Hk * D * int64_t(sizeof(T));
                        for (int64_t k = 0; k < BC; ++k)
                            for (int64_t l = 0; l < row; l += 64) {
                                if (t.prefetch && g_pfk > 0) {
                                    const char* a = base + (k + g_pfk) * row + l;
                                    if (g_hint == 0) _mm_prefetch(a, _MM_HINT_T0);
                                    else if (g_hint == 2) _mm_prefetch(a, _MM_HINT_T2);
                                    else _mm_prefetch(a, _MM_HINT_T1);
                                }
                                sink += *reinterpret_cast<const volatile int*>(base + k * row + l);
                            }
                    }
                    continue;
                }
                if (mode != 1) G::qk(x, block, kt, BC, s.data());
                if (mode == 1)  // P-like values for pv alone (both: pv reads qk's scores as P)
                    for (int64_t i = 0; i < BC * G::RB; ++i) s[i] = 0.004f;
                if (mode != 0) G::pv(x, block, s.data(), BC, vt);
            }
        const double per = double(__rdtsc() - t0) / double(passes * c.nk * Hk);
        best = per < best ? per : best;
    }
    return best;
}

int main(int argc, char** argv) {
    const double tsc_ghz = [] {
        const auto t0 = std::chrono::steady_clock::now();
        const uint64_t c0 = __rdtsc();
        while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(200)) {}
        return double(__rdtsc() - c0) / 0.2e9;
    }();
    static const char* names[] = {"qk", "pv (+ P fill)", "qk + pv", "bytes alone (a load per line)"};
    // argv[1] = "int8": only the int8 route's qk + pv from memory (for alternating builds)
    const bool only = argc > 1 && std::string(argv[1]) == "int8";
    const bool bytes = argc > 1 && std::string(argv[1]) == "bytes";  // only the bytes-alone pass, both caches
    if (const char* e = std::getenv("I8H_HINT")) g_hint = std::atoi(e);
    for (int64_t nk : {int64_t(1024), int64_t(65536)}) {
        if (only && nk < 65536) continue;
        const Cache<int8_t> c8(nk);
        const Cache<uint16_t> c16(only ? 0 : nk);
        if (bytes && nk < 65536) continue;
        for (int mode = only ? 2 : bytes ? 3 : 0; mode < (only ? 3 : 4); ++mode) {
            const char* pf = std::getenv("I8H_PFK");
            g_pfk = pf ? std::atoi(pf) : G8::kPrefetchKeys;
            const double a = run<G8>(c8, mode);
            if (!pf) g_pfk = G16::kPrefetchKeys;
            const double b = only ? 0.0 : run<G16>(c16, mode);
            std::printf("NK=%6lld %-7s %-30s int8 %6.1f TSC %5.1f ns | bf16 %6.1f TSC %5.1f ns | bf16 / int8 %.2f\n",
                        (long long)nk, nk >= 65536 ? "memory" : "L2", names[mode], a, a / tsc_ghz, b, b / tsc_ghz, b / a);
        }
    }
    std::printf("(per (key, kv head); TSC %.2f GHz; pv alone includes filling the tile's P block, qk + pv reads the scores as P)\n", tsc_ghz);
    return 0;
}
