// fa2cpu public C++ header: the Params struct every entry point fills, the ISA vocabulary and the
// entry points. No intrinsics here: this header is included by code built for every ISA and by the
// dispatcher, which is built with no -m flags.
#pragma once
#include <cstdint>

namespace fa2cpu {

// Kernel families (best first) and element types: the rows of catalogue.def, in its order.
enum class Isa : int {
#define FA2CPU_FAMILY(name, flags) name,
#include "catalogue.def"
    count
};
enum class DType : int {
#define FA2CPU_DTYPE(name, numpy_name, bytes) name,
#include "catalogue.def"
    count
};

// Largest head dim (D and Dv): per-row stack buffers and scratch are sized by it.
constexpr int64_t kMaxHeadDim = 256;
enum class MaskKind : int { none = 0, boolean = 1, additive = 2 };  // boolean: uint8, additive: float32

// One call's description. All strides are in ELEMENTS of the array they belong to.
//
// Sequences: batch entry b has nq(b) query rows and nk(b) key rows:
//   nq(b) = cu_seqlens_q ? cu_seqlens_q[b+1]-cu_seqlens_q[b] : nq        (varlen packs rows of all sequences on one axis)
//   nk(b) = seqlen_k ? seqlen_k[b] : cu_seqlens_k ? cu_seqlens_k[b+1]-cu_seqlens_k[b] : nk
// Query row i of sequence b, head h, element d lives at (same for out)
//   q + (cu_seqlens_q ? (cu_seqlens_q[b] + i)*q_row_stride : b*q_batch_stride + i*q_row_stride)
//     + h*q_head_stride + d*q_dim_stride
// Key position p of sequence b, kv-head h (same for v):
//   paged (block_table != null): blk = block_table[b*block_table_batch_stride + p/block_size];
//     k + blk*k_batch_stride + (p%block_size)*k_row_stride + h*k_head_stride
//   otherwise:
//     k + (cu_seqlens_k ? (cu_seqlens_k[b] + p)*k_row_stride : b*k_batch_stride + p*k_row_stride)
//       + h*k_head_stride
// The Python layer has validated every index these formulas can produce.
struct Params {
    int dtype = 0;  // DType of q and out (and of k, v unless kv_dtype says otherwise): f32, f16 or bf16
    int64_t batch = 0, hq = 0, hk = 0, d = 0, dv = 0;
    int64_t nq = 0, nk = 0;
    const int64_t* cu_seqlens_q = nullptr;
    const int64_t* cu_seqlens_k = nullptr;
    const int64_t* seqlen_k = nullptr;
    const int32_t* block_table = nullptr;
    int64_t block_table_batch_stride = 0, block_size = 0;

    // K/V element type: -1 = dtype; DType::i8 or DType::f8e4m3 for a quantized KV cache, whose
    // cached value at key position p, kv head h is code * scale with (same formula as k's, with
    // these strides; a null scale array means scale 1)
    //   scale = k_scale[<k's row offset with k_scale_batch_stride, k_scale_row_stride>
    //                   + h*k_scale_head_stride]                         (v likewise)
    int kv_dtype = -1;
    const float* k_scale = nullptr; int64_t k_scale_batch_stride = 0, k_scale_head_stride = 0, k_scale_row_stride = 0;
    const float* v_scale = nullptr; int64_t v_scale_batch_stride = 0, v_scale_head_stride = 0, v_scale_row_stride = 0;

    const void* q = nullptr; int64_t q_batch_stride = 0, q_head_stride = 0, q_row_stride = 0, q_dim_stride = 0;
    const void* k = nullptr; int64_t k_batch_stride = 0, k_head_stride = 0, k_row_stride = 0, k_dim_stride = 0;
    const void* v = nullptr; int64_t v_batch_stride = 0, v_head_stride = 0, v_row_stride = 0, v_dim_stride = 0;
    void* out = nullptr;     int64_t out_batch_stride = 0, out_head_stride = 0, out_row_stride = 0, out_dim_stride = 0;
    // float32 (b, hq, row) log-sum-exp; optional
    float* lse = nullptr;    int64_t lse_batch_stride = 0, lse_head_stride = 0, lse_row_stride = 0;

    float scale = 1.0f;
    float softcap = 0.0f;                   // <= 0: off
    int64_t window_left = -1, window_right = -1;  // -1: unbounded (causal is window_right = 0)
    // slope of (b, h) = alibi[b*alibi_batch_stride + h*alibi_head_stride]
    const float* alibi = nullptr; int64_t alibi_batch_stride = 0, alibi_head_stride = 0;
    // Attention sinks: sinks[h] is a raw logit (natural-log domain, no scale / softcap / alibi)
    // joining every row of query head h's softmax denominator with no value vector; optional.
    const float* sinks = nullptr;
    int mask_kind = 0;  // MaskKind
    const void* mask = nullptr;
    int64_t mask_batch_stride = 0, mask_head_stride = 0, mask_query_stride = 0, mask_key_stride = 0;

    int num_threads = 1;
    int num_splits = 0;  // 0: automatic split of the key axis, 1: none, n: n splits
};

// One backward call (FlashAttention-2, paper Algorithm 2): the forward's description in `f`
// (q, k, v, out, lse, sizes, cu_seqlens, scale, softcap, window, alibi, num_threads; no mask, no
// KV cache: f.mask, f.block_table and f.seqlen_k must be null, f.num_splits is ignored) plus the
// upstream gradient and the three gradients to write. All strides are in ELEMENTS.
//   dout, dq: laid out like q/out (row i of sequence b, head h: f's query-row formula with these
//             strides); dout has Dv features, dq D.
//   dk, dv:   laid out like k/v (key position p of sequence b, kv head h: f's non-paged key
//             formula with these strides); summed over the query heads of each GQA group.
//   f.lse:    required, natural-log float32 (b, hq, row) as the forward wrote it; -inf rows (no
//             visible key) contribute nothing.
// dout/dq/dk/dv have f.dtype; every product is accumulated in float32.
struct BackwardParams {
    Params f;
    const void* dout = nullptr; int64_t dout_batch_stride = 0, dout_head_stride = 0, dout_row_stride = 0, dout_dim_stride = 0;
    void* dq = nullptr; int64_t dq_batch_stride = 0, dq_head_stride = 0, dq_row_stride = 0, dq_dim_stride = 0;
    void* dk = nullptr; int64_t dk_batch_stride = 0, dk_head_stride = 0, dk_row_stride = 0, dk_dim_stride = 0;
    void* dv = nullptr; int64_t dv_batch_stride = 0, dv_head_stride = 0, dv_row_stride = 0, dv_dim_stride = 0;
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

// backward: writes dq, dk, dv of the loss sum(dout * out) for the call p.f describes, with the
// family currently selected. Throws std::invalid_argument (before anything is written) when p
// breaks the contract above or forward's; results are bit-identical for any num_threads.
// Returns 0 on success, nonzero on allocation failure (outputs then unspecified).
int backward(const BackwardParams& p);

// Dispatch control (registry.cpp). available_isas fills `out` with the usable families, best first,
// and returns their count.
int available_isas(int* out);
int isa_count();
const char* isa_name(int isa);      // catalogue.def's name; nullptr outside 0..isa_count()-1
int dtype_count();
const char* dtype_name(int dtype);  // NumPy's name of a DType code
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
