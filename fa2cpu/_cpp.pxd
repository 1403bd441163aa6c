# Declarations of the C++ core (csrc/include/fa2cpu/fa2cpu.h). Every call that can throw is
# declared `except +` so a C++ exception becomes a Python exception, never an abort.
from libc.stdint cimport int32_t, int64_t

cdef extern from "fa2cpu/fa2cpu.h" namespace "fa2cpu" nogil:
    cdef cppclass Params:
        int dtype
        int64_t batch, hq, hk, d, dv, nq, nk
        const int64_t* cu_q
        const int64_t* cu_k
        const int64_t* seqlen_k
        const int32_t* block_table
        int64_t bt_sb, block_size
        const void* q
        int64_t q_sb, q_sh, q_sn, q_sd
        const void* k
        int64_t k_sb, k_sh, k_sn, k_sd
        const void* v
        int64_t v_sb, v_sh, v_sn, v_sd
        void* out
        int64_t o_sb, o_sh, o_sn, o_sd
        float* lse
        int64_t l_sb, l_sh, l_sn
        float scale, softcap
        int64_t win_left, win_right
        const float* alibi
        int64_t al_sb, al_sh
        int mask_kind
        const void* mask
        int64_t m_sb, m_sh, m_sq, m_sk
        int num_threads, num_splits

    int forward(const Params& p) except +
    int available_isas(int* out) except +
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
