// fa2cpu public C++ header: the Params struct every entry point fills, the ISA vocabulary and the
// entry points. No intrinsics here: this header is included by code built for every ISA and by the
// dispatcher, which is built with no -m flags.
#pragma once
#include <cstdint>

namespace fa2cpu {

// Kernel families, best first. The same names are used in file names, FA2CPU_ISA and Python.
enum class Isa : int { amx = 0, avx512bf16 = 1, avx512 = 2, avx2 = 3, generic = 4, count = 5 };

enum class DType : int { f32 = 0, f16 = 1, bf16 = 2 };

// Largest head dim (D and Dv): per-row stack buffers and scratch are sized by it.
constexpr int64_t kMaxHeadDim = 256;
enum class MaskKind : int { none = 0, boolean = 1, additive = 2 };  // boolean: uint8, additive: float32

// One call's description. All strides are in ELEMENTS of the array they belong to.
//
// Sequences: batch entry b has nq(b) query rows and nk(b) key rows:
//   nq(b) = cu_q ? cu_q[b+1]-cu_q[b] : nq        (varlen packs rows of all sequences on one axis)
//   nk(b) = seqlen_k ? seqlen_k[b] : cu_k ? cu_k[b+1]-cu_k[b] : nk
// Query row i of sequence b, head h, element d lives at
//   q + (cu_q ? 0 : b*q_sb) + ((cu_q ? cu_q[b] : 0) + i)*q_sn + h*q_sh + d*q_sd     (same for out)
// Key position p of sequence b, kv-head h:
//   paged (block_table != null): blk = block_table[b*bt_sb + p/block_size];
//                                 k + blk*k_sb + (p%block_size)*k_sn + h*k_sh
//   otherwise:                   k + (cu_k ? 0 : b*k_sb) + ((cu_k ? cu_k[b] : 0) + p)*k_sn + h*k_sh
// The Python layer has validated every index these formulas can produce.
struct Params {
    int dtype = 0;  // DType
    int64_t batch = 0, hq = 0, hk = 0, d = 0, dv = 0;
    int64_t nq = 0, nk = 0;
    const int64_t* cu_q = nullptr;
    const int64_t* cu_k = nullptr;
    const int64_t* seqlen_k = nullptr;
    const int32_t* block_table = nullptr;
    int64_t bt_sb = 0, block_size = 0;

    const void* q = nullptr; int64_t q_sb = 0, q_sh = 0, q_sn = 0, q_sd = 0;
    const void* k = nullptr; int64_t k_sb = 0, k_sh = 0, k_sn = 0, k_sd = 0;
    const void* v = nullptr; int64_t v_sb = 0, v_sh = 0, v_sn = 0, v_sd = 0;
    void* out = nullptr;     int64_t o_sb = 0, o_sh = 0, o_sn = 0, o_sd = 0;
    float* lse = nullptr;    int64_t l_sb = 0, l_sh = 0, l_sn = 0;  // float32 (b, hq, row); optional

    float scale = 1.0f;
    float softcap = 0.0f;                   // <= 0: off
    int64_t win_left = -1, win_right = -1;  // -1: unbounded (causal is win_right = 0)
    const float* alibi = nullptr; int64_t al_sb = 0, al_sh = 0;  // slopes[b*al_sb + h*al_sh]
    int mask_kind = 0;  // MaskKind
    const void* mask = nullptr; int64_t m_sb = 0, m_sh = 0, m_sq = 0, m_sk = 0;

    int num_threads = 1;
    int num_splits = 0;  // 0: automatic split of the key axis, 1: none, n: n splits
};

// The entry points take and return plain ints (Isa / DType codes) so the Cython layer needs no
// C++ enum support.
//
// forward: runs attention as described by p with the family currently selected. Throws
// std::invalid_argument (before anything is written) when p breaks the contract above (head dims
// in 1..kMaxHeadDim, hk >= 1, hq % hk == 0, ...); nothing is thrown from inside the parallel work.
// Returns 0 on success, nonzero on allocation failure. num_threads is capped at the CPUs the
// process may use.
int forward(const Params& p);

// Dispatch control (registry.cpp). available_isas fills `out` with the usable families, best first,
// and returns their count.
int available_isas(int* out);
bool isa_compiled(int isa);
bool isa_usable(int isa);
int get_isa();
void set_isa(int isa);  // caller checked isa_usable
void reset_isa();       // back to the automatic (best usable) choice

// Probes for the benchmark: measured peak GFLOP/s of a family's main multiply-add for a dtype
// (DType code; f16 counts as f32 since it is converted) on `threads` threads, and read bandwidth.
double peak_gflops(int isa, int dtype, int threads, double seconds);
double read_bandwidth_gbs(int threads, int64_t nbytes);

}  // namespace fa2cpu
