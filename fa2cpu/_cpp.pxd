# Declarations of the C++ core (csrc/include/fa2cpu/fa2cpu.h). Every call that can throw is
# declared `except +` so a C++ exception becomes a Python exception, never an abort.
from libc.stdint cimport int32_t, int64_t

cdef extern from "fa2cpu/fa2cpu.h" namespace "fa2cpu" nogil:
    cdef cppclass Params:
        int dtype
        int64_t batch, hq, hk, d, dv, nq, nk
        const int64_t* cu_seqlens_q
        const int64_t* cu_seqlens_k
        const int64_t* seqlen_k
        const int32_t* block_table
        int64_t block_table_batch_stride, block_size
        int kv_dtype
        const float* k_scale
        int64_t k_scale_batch_stride, k_scale_head_stride, k_scale_row_stride
        const float* v_scale
        int64_t v_scale_batch_stride, v_scale_head_stride, v_scale_row_stride
        const void* q
        int64_t q_batch_stride, q_head_stride, q_row_stride, q_dim_stride
        const void* k
        int64_t k_batch_stride, k_head_stride, k_row_stride, k_dim_stride
        const void* v
        int64_t v_batch_stride, v_head_stride, v_row_stride, v_dim_stride
        void* out
        int64_t out_batch_stride, out_head_stride, out_row_stride, out_dim_stride
        float* lse
        int64_t lse_batch_stride, lse_head_stride, lse_row_stride
        float scale, softcap
        int64_t window_left, window_right
        const float* alibi
        int64_t alibi_batch_stride, alibi_head_stride
        const float* sinks
        int mask_kind
        const void* mask
        int64_t mask_batch_stride, mask_head_stride, mask_query_stride, mask_key_stride
        int num_threads, num_splits

    cdef cppclass BackwardParams:
        Params f
        const void* dout
        int64_t dout_batch_stride, dout_head_stride, dout_row_stride, dout_dim_stride
        void* dq
        int64_t dq_batch_stride, dq_head_stride, dq_row_stride, dq_dim_stride
        void* dk
        int64_t dk_batch_stride, dk_head_stride, dk_row_stride, dk_dim_stride
        void* dv
        int64_t dv_batch_stride, dv_head_stride, dv_row_stride, dv_dim_stride

    int forward(const Params& p) except +
    int backward(const BackwardParams& p) except +
    int available_isas(int* out) except +
    int isa_count() except +
    const char* isa_name(int isa) except +
    int dtype_count() except +
    const char* dtype_name(int dtype) except +
    bint isa_compiled(int isa) except +
    bint isa_usable(int isa) except +
    int get_isa() except +
    void set_isa(int isa) except +
    void reset_isa() except +
    double peak_gflops(int isa, int dtype, int threads, double seconds) except +
    double read_bandwidth_gbs(int threads, int64_t nbytes) except +

cdef extern from "driver/pool.h" namespace "fa2cpu" nogil:
    int max_useful_threads() except +
    int pool_threads() except +
    ctypedef void (*GompParallelFn)(void (*)(void*), void*, unsigned, unsigned) noexcept nogil
    ctypedef int (*MaxThreadsFn)() noexcept nogil
    void set_openmp_backend(bint on, GompParallelFn gomp_parallel, MaxThreadsFn max_threads) except +
    bint openmp_backend() except +
    bint openmp_backend_is_foreign() except +
    int backend_max_threads() except +
