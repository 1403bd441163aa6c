// Session 38 prototype (not the library's code): an L1-blocked AMX item schedule for issue 12 --
// 64-row blocks, 32-key score chunks (8 KB of scores, Q of the block 16 KB, all in L1), a simple
// one-pass softmax per chunk, PV per 128 keys from P pairs of the block -- timed as products only,
// softmax only, sequential, and overlapped (the next chunk's QK and a quarter of the previous
// sub-tile's PV stepped inside each chunk's softmax). One 192-row item, D = Dv = 128, 2048 keys,
// tiles packed as amx.cpp packs them. Timing only: no rescale in the data, the outputs unchecked.
//   g++ -O3 -std=c++17 -fno-math-errno -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c \
//       -mavx512bf16 -mavx512vnni -mamx-tile -mamx-bf16 -fopenmp -Icsrc/kernels -Icsrc -Icsrc/include \
//       bench/tools/amx_l1_blocks_proto.cpp -o /tmp/l1 -Wl,--unresolved-symbols=ignore-all && /tmp/l1 1.3
// (argv[1]: core / TSC clock ratio for the % column). Results: bench/RESULTS.md, session 38.
#include "kernels/amx.cpp"
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>
#include <cstdio>
#include <random>
#include <vector>
using namespace fa2cpu;
using G = AmxGemm;
constexpr int64_t M = 192, D = 128, Dv = 128, NK = 2048, BC = 256, T = NK / BC;
constexpr int64_t RBL = 64;            // rows per block
constexpr int64_t CH = 32;             // keys per score chunk
constexpr int64_t SUB = 128;           // keys per PV
constexpr int64_t NU = D / 32;         // K 32-element blocks per key block
constexpr int64_t D2P = D / 2;         // Q pairs

struct Ops { const uint32_t* q; float* o; };
struct Unit { const uint16_t* k; const uint16_t* vT; int64_t r0, half; };

// Stepper: QK of one chunk (2 row pairs x 4 depth steps = 8 steps), PV of a sub-tile (4 dv blocks x 2 row pairs x 4 = 32 steps)
struct Job { int kind; Unit u; int64_t c; float* s; const uint32_t* p; int64_t a, r, t, end; };
struct Stepper {
    Job job[3]; int n = 0, cur = 0; const Ops* ops;
    void add_qk(const Unit& u, int64_t c, float* s) { job[n++] = Job{0, u, c, s, nullptr, 0, 0, 0, 0}; }
    void add_pv(const Unit& u, const uint32_t* p, int64_t first, int64_t end) {  // steps [first, end) of 32
        job[n++] = Job{1, u, 0, nullptr, p, first, 0, 0, end};
    }
    __attribute__((always_inline)) void operator()() { if (cur < n) step(); }
    void drain() { while (cur < n) step(); }
    __attribute__((always_inline)) void step() {
        Job& J = job[cur];
        if (J.kind == 0) {
            const int64_t c = J.u.half * SUB + J.c;          // key offset in the 256-key tile
            const uint16_t* k0 = J.u.k + (c / 16) * NU * 512;
            const uint32_t* qb = ops->q + G::q_at(M, J.t, J.u.r0 + J.r);
            if (J.t == 0) { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
            _tile_loadd(4, k0 + (J.t / 16) * 512, 64);
            _tile_loadd(5, k0 + (NU + J.t / 16) * 512, 64);
            _tile_loadd(6, qb, 64);
            _tile_loadd(7, qb + 256, 64);
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
            if ((J.t += 16) < D2P) return;
            float* s = J.s + J.r;
            _tile_stored(0, s, RBL * 4); _tile_stored(1, s + 16, RBL * 4);
            _tile_stored(2, s + 16 * RBL, RBL * 4); _tile_stored(3, s + 16 * RBL + 16, RBL * 4);
            J.t = 0;
            if ((J.r += 32) < RBL) return;
            ++cur;
        } else {
            // step index a: dv block j = a / 8, row pair rp = (a / 4) % 2, key step t = a % 4
            const int64_t j = (J.a / 8) * 32, rp = ((J.a / 4) % 2) * 32, t = (J.a % 4) * 32;
            float* o = ops->o + j * M + J.u.r0 + rp;
            const int64_t c = J.u.half * SUB + t;
            const uint16_t* vT = J.u.vT + ((j / 16) * (BC / 32) + c / 32) * 512;
            const uint32_t* pr = J.p + (t / 2) * RBL + rp;
            if (t == 0) { _tile_loadd(0, o, M * 4); _tile_loadd(1, o + 16, M * 4); _tile_loadd(2, o + 16 * M, M * 4); _tile_loadd(3, o + 16 * M + 16, M * 4); }
            _tile_loadd(4, vT, 64);
            _tile_loadd(5, vT + (BC / 32) * 512, 64);
            _tile_loadd(6, pr, RBL * 4);
            _tile_loadd(7, pr + 16, RBL * 4);
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
            if (t == SUB - 32) { _tile_stored(0, o, M * 4); _tile_stored(1, o + 16, M * 4); _tile_stored(2, o + 16 * M, M * 4); _tile_stored(3, o + 16 * M + 16, M * 4); }
            if (++J.a < J.end) return;
            ++cur;
        }
    }
};

// one-pass softmax of a 32-key x 64-row chunk against the running max m (no rescale), P pairs into p
template <class Tick>
__attribute__((always_inline)) inline void softmax_chunk(const float* s, uint32_t* p, const float* m, float* l, Tick& tick) {
    __m512 neg_m[4], sum[4], mx[4];
    for (int v = 0; v < 4; ++v) { neg_m[v] = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_loadu_ps(m + 16 * v)); sum[v] = _mm512_setzero_ps(); mx[v] = _mm512_set1_ps(-INFINITY); }
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int k = 0; k < CH; k += 2) {
        tick();
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
            const __m512 x0 = _mm512_loadu_ps(s + k * RBL + 16 * v), x1 = _mm512_loadu_ps(s + (k + 1) * RBL + 16 * v);
            mx[v] = _mm512_max_ps(mx[v], _mm512_max_ps(x0, x1));
            const __m512 e0 = V512::exp2_bf16p(_mm512_add_ps(x0, neg_m[v])), e1 = V512::exp2_bf16p(_mm512_add_ps(x1, neg_m[v]));
            sum[v] = _mm512_add_ps(sum[v], _mm512_add_ps(e0, e1));
            _mm512_storeu_si512(p + (k / 2) * RBL + 16 * v, _mm512_permutexvar_epi16(inter, (__m512i)_mm512_cvtne2ps_pbh(e1, e0)));
        }
    }
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(l + 16 * v, _mm512_add_ps(_mm512_loadu_ps(l + 16 * v), sum[v]));
}

int main(int argc, char** argv) {
    const double ratio = argc > 1 ? atof(argv[1]) : 1.3;
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) { std::puts("no AMX"); return 1; }
    configure_full_tiles();
    std::mt19937 g(1);
    auto alloc = [&](int64_t n) { float* p = static_cast<float*>(aligned_alloc(64, ((n * 4 + 63) / 64) * 64));
        uint16_t* u = reinterpret_cast<uint16_t*>(p); for (int64_t i = 0; i < 2 * n; ++i) u[i] = uint16_t(0x3c00 | (g() & 0x7f)); return p; };
    float* q = alloc(G::q_floats(D, M));
    float* o = alloc(G::o_floats(Dv, M));
    std::vector<float*> kt(T), vt(T);
    for (int t = 0; t < T; ++t) { kt[t] = alloc(BC * D / 2); vt[t] = alloc(Dv * BC / 2); }
    float* sbuf = alloc(2 * CH * RBL);
    uint32_t* pbuf = reinterpret_cast<uint32_t*>(alloc(2 * SUB / 2 * RBL));
    std::vector<float> m(M, 8.f), l(M, 0.f);
    Ops ops{reinterpret_cast<const uint32_t*>(q), o};
    std::vector<Unit> units;
    for (int t = 0; t < T; ++t) for (int64_t r0 = 0; r0 < M; r0 += RBL) for (int h = 0; h < 2; ++h)
        units.push_back(Unit{reinterpret_cast<const uint16_t*>(kt[t]), reinterpret_cast<const uint16_t*>(vt[t]), r0, h});
    const int64_t NUN = units.size();
    struct NoT { void operator()() {} } not_;
    auto sched = [&](const char* name, int mode) {
        double best = 1e30;
        for (int round = 0; round < 5; ++round) {
            const uint64_t c0 = __rdtsc();
            for (int rep = 0; rep < 20; ++rep) {
                if (mode == 3) {  // overlapped
                    { Stepper w; w.ops = &ops; w.add_qk(units[0], 0, sbuf); w.drain(); }
                    for (int64_t u = 0; u < NUN; ++u) {
                        uint32_t* pu = pbuf + (u & 1) * (SUB / 2) * RBL;
                        for (int c = 0; c < SUB / CH; ++c) {
                            const int64_t idx = u * 4 + c;
                            Stepper w; w.ops = &ops;
                            if (idx + 1 < NUN * 4) w.add_qk(units[(idx + 1) / 4], ((idx + 1) % 4) * CH, sbuf + ((idx + 1) & 1) * CH * RBL);
                            if (u > 0) w.add_pv(units[u - 1], pbuf + ((u - 1) & 1) * (SUB / 2) * RBL, c * 8, c * 8 + 8);
                            softmax_chunk(sbuf + (idx & 1) * CH * RBL, pu + c * (CH / 2) * RBL, m.data() + units[u].r0, l.data() + units[u].r0, w);
                            w.drain();
                        }
                    }
                    Stepper w; w.ops = &ops; w.add_pv(units[NUN - 1], pbuf + ((NUN - 1) & 1) * (SUB / 2) * RBL, 0, 32); w.drain();
                } else {
                    for (int64_t u = 0; u < NUN; ++u) {
                        uint32_t* pu = pbuf + (u & 1) * (SUB / 2) * RBL;
                        for (int c = 0; c < SUB / CH; ++c) {
                            if (mode != 2) { Stepper w; w.ops = &ops; w.add_qk(units[u], c * CH, sbuf); w.drain(); }
                            if (mode != 1) softmax_chunk(sbuf, pu + c * (CH / 2) * RBL, m.data() + units[u].r0, l.data() + units[u].r0, not_);
                        }
                        if (mode != 2) { Stepper w; w.ops = &ops; w.add_pv(units[u], pu, 0, 32); w.drain(); }
                    }
                }
            }
            best = std::min(best, double(__rdtsc() - c0));
        }
        const double tdp = 20.0 * 12288;
        std::printf("%-34s %6.0f kTSC per item pass, %5.1f TSC per tdpbf16ps, %3.0f %% of its rate\n", name, best / 20 / 1e3, best / tdp, 100.0 * 16 / (best / tdp * ratio));
    };
    for (int k = 0; k < 2; ++k) {
        sched("L1 blocks: products only", 1);
        sched("L1 blocks: softmax only", 2);
        sched("L1 blocks: sequential", 0);
        sched("L1 blocks: overlapped", 3);
    }
    _tile_release();
}
