// Times the AMX forward's tile products (AmxGemm::qk / ::pv of csrc/kernels/amx.cpp, included
// whole so it always measures the current code) and its softmax on one item's shapes: M = 192
// rows (two 96-row blocks), D = Dv = 128, 2048 keys in 256-key tiles, tiles packed as the kernel
// packs them (contents random bf16). One core; AMX CPUs only. From the repository root:
//
//   g++ -O3 -std=c++17 -fno-math-errno -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c \
//       -mavx512bf16 -mavx512vnni -mamx-tile -mamx-bf16 -fopenmp -Icsrc/kernels -Icsrc -Icsrc/include \
//       bench/tools/amx_item_harness.cpp -o /tmp/amx_item -Wl,--unresolved-symbols=ignore-all
//   /tmp/amx_item          # every case below, best of 5 rounds each
//
// Cases: the kernel's qk, pv and both; probes that keep one operand L1-resident (wrong results,
// timing only): QK with K read from its first 32-key block / Q from its first row pair / S stored
// into a 12 KB ring; PV with V^T from its first 32 columns / P from its first row pair / O^T
// tiles in a 4 KB scratch; and the softmax (TileLoop::softmax_update) of one 96 x 256 score block.
// Figures: TSC cycles per tdpbf16ps and % of its 16-cycle rate (core/TSC clock ratio from argv[1],
// default 1.44 = 3.75 GHz / 2.6 GHz, the 2-core Xeon of bench/RESULTS.md session 34).
#include "kernels/amx.cpp"

#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>

#include <cstdio>
#include <random>
#include <vector>

using namespace fa2cpu;
using G = AmxGemm;
constexpr int64_t M = 192, D = 128, Dv = 128, NK = 2048, BC = G::BC, RB = G::RB, T = NK / BC;

enum Probe { kNone = 0, kHotA = 1, kHotB = 2, kHotC = 4 };

// G::qk with probes: kHotA K from key block 0, kHotB Q from row pair 0, kHotC S into a 12 KB ring.
template <int kProbe>
void qk_probe(const ItemOperands& x, const RowBlock& rows, const KvTile& kt, int64_t nc, float* s) {
    const uint32_t* q = reinterpret_cast<const uint32_t*>(x.q);
    const uint16_t* k = static_cast<const uint16_t*>(kt.data);
    const int64_t D2p = G::d2p(x.d), ncp = round_up(nc, 32), nu = kt.ld / 32;
    for (int64_t c = 0; c < ncp; c += 32) {
        const uint16_t* k0 = k + ((kProbe & kHotA) ? 0 : (c / 16) * nu * 512);
        for (int r = 0; r < rows.vectors * 16; r += 32) {
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t t = 0; t < D2p; t += 16) {
                const uint32_t* qb = q + G::q_at(x.M, t, (kProbe & kHotB) ? 0 : rows.r0 + r);
                _tile_loadd(4, k0 + (t / 16) * 512, 64);
                _tile_loadd(5, k0 + (nu + t / 16) * 512, 64);
                _tile_loadd(6, qb, 64);
                _tile_loadd(7, qb + 256, 64);
                _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
            }
            const int64_t cs = (kProbe & kHotC) ? c % 32 : c;
            _tile_stored(0, s + cs * RB + r, RB * 4); _tile_stored(1, s + cs * RB + r + 16, RB * 4);
            _tile_stored(2, s + (cs + 16) * RB + r, RB * 4); _tile_stored(3, s + (cs + 16) * RB + r + 16, RB * 4);
        }
    }
}

// G::pv with probes: kHotA V^T from columns [0, 32), kHotB P from row pair 0, kHotC O^T in 4 KB.
template <int kProbe>
void pv_probe(const ItemOperands& x, const RowBlock& rows, float* s, int64_t nc, const KvTile& vt) {
    const uint32_t* pb = reinterpret_cast<const uint32_t*>(s);
    const uint16_t* vT = static_cast<const uint16_t*>(vt.data);
    const int64_t ncp = round_up(nc, 32), ldv = vt.ld;
    alignas(64) static float scratch[1024];
    for (int64_t j = 0; j < G::o_rows(x.dv); j += 32)
        for (int r = 0; r < rows.vectors * 16; r += 32) {
            float* o = (kProbe & kHotC) ? scratch : x.o + rows.r0 + j * x.M + r;
            const int64_t ld = (kProbe & kHotC) ? 32 : x.M, jj = (kProbe & kHotA) ? 0 : j, rr = (kProbe & kHotB) ? 0 : r;
            _tile_loadd(0, o, ld * 4); _tile_loadd(1, o + 16, ld * 4);
            _tile_loadd(2, o + 16 * ld, ld * 4); _tile_loadd(3, o + 16 * ld + 16, ld * 4);
            for (int64_t c = 0; c < ncp; c += 32) {
                _tile_loadd(4, vT + ((jj / 16) * (ldv / 32) + c / 32) * 512, 64);
                _tile_loadd(5, vT + ((jj / 16 + 1) * (ldv / 32) + c / 32) * 512, 64);
                _tile_loadd(6, pb + (c / 2) * RB + rr, RB * 4);
                _tile_loadd(7, pb + (c / 2) * RB + rr + 16, RB * 4);
                _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, o, ld * 4); _tile_stored(1, o + 16, ld * 4);
            _tile_stored(2, o + 16 * ld, ld * 4); _tile_stored(3, o + 16 * ld + 16, ld * 4);
        }
}

int main(int argc, char** argv) {
    const double ratio = argc > 1 ? atof(argv[1]) : 1.44;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
        std::puts("no AMX permission");
        return 1;
    }
    configure_full_tiles();  // first: configured later, after the softmax case, ldtilecfg faulted on the 2-core VM
    std::mt19937 g(1);
    auto alloc = [&](int64_t n) {  // n floats of random bf16 pairs near 1
        float* p = static_cast<float*>(aligned_alloc(64, ((n * 4 + 63) / 64) * 64));
        uint16_t* u = reinterpret_cast<uint16_t*>(p);
        for (int64_t i = 0; i < 2 * n; ++i) u[i] = uint16_t(0x3c00 | (g() & 0x7f));
        return p;
    };
    float* q = alloc(G::q_floats(D, M));
    float* o = alloc(G::o_floats(Dv, M));
    float* s = alloc(BC * RB);
    std::vector<float*> kt(T), vt(T);
    for (int t = 0; t < T; ++t) { kt[t] = alloc(G::k_floats(D)); vt[t] = alloc(G::v_floats(Dv)); }
    const ItemOperands ops{q, o, M, D, Dv, 1.f};
    int32_t kv_head[M] = {0};

    // The softmax of one 96-row block over 256 keys, scores refilled from `src` before each call.
    {
        using Loop = TileLoop<V512, AmxGemm>;
        std::vector<float> src(BC * RB), m(M, 3.f), l(M, 1.f), pb((BC + 1) / 2 * RB);
        for (float& x : src) x = float(int(g() % 2000) - 1000) / 500.f;  // scores in [-2, 2): no rescale
        double best = 1e30;
        for (int round = 0; round < 20; ++round) {
            std::memcpy(s, src.data(), sizeof(float) * BC * RB);
            const uint64_t c0 = __rdtsc();
            Loop::softmax_update(ops, int(RB / 16), BC, s, pb.data(), m.data(), l.data(), 0, 1.f);
            best = std::min(best, double(__rdtsc() - c0));
        }
        std::printf("%-44s %6.2f core cycles per 16 scores\n", "softmax, 96 x 256 block", best * ratio / (BC * RB / 16));
    }

    auto run = [&](const char* name, auto qk, auto pv, int products) {
        double best = 1e30;
        for (int round = 0; round < 5; ++round) {
            const uint64_t c0 = __rdtsc();
            for (int rep = 0; rep < 100; ++rep)
                for (int t = 0; t < T; ++t)
                    for (int64_t r0 = 0; r0 < M; r0 += RB) {
                        const RowBlock rows{r0, int(RB / 16), int(RB), kv_head};
                        if (products & 1) qk(ops, rows, KvTile{kt[t], round_up(D, 32), 0, 0}, BC, s);
                        if (products & 2) pv(ops, rows, s, BC, KvTile{vt[t], BC, 0, 0});
                    }
            best = std::min(best, double(__rdtsc() - c0));
        }
        const double tdp = 100.0 * T * (M / RB) * ((products == 3 ? 2 : 1) * (BC / 32) * (RB / 32) * (D / 32) * 4);
        const double per = best / tdp;
        std::printf("%-44s %6.1f TSC cycles per tdpbf16ps, %3.0f %% of its rate\n", name, per, 100.0 * 16 / (per * ratio));
    };
    run("qk + pv (AmxGemm)", G::qk, G::pv, 3);
    run("qk (AmxGemm)", G::qk, G::pv, 1);
    run("  qk, K from its first key block", qk_probe<kHotA>, G::pv, 1);
    run("  qk, Q from its first row pair", qk_probe<kHotB>, G::pv, 1);
    run("  qk, S into a 12 KB ring", qk_probe<kHotC>, G::pv, 1);
    run("  qk, all three", qk_probe<kHotA | kHotB | kHotC>, G::pv, 1);
    run("pv (AmxGemm)", G::qk, G::pv, 2);
    run("  pv, V^T from its first 32 columns", G::qk, pv_probe<kHotA>, 2);
    run("  pv, P from its first row pair", G::qk, pv_probe<kHotB>, 2);
    run("  pv, O^T tiles in a 4 KB scratch", G::qk, pv_probe<kHotC>, 2);
    run("  pv, all three", G::qk, pv_probe<kHotA | kHotB | kHotC>, 2);
    _tile_release();
    return 0;
}
