# cython: language_level=3
"""Thin bridge from validated NumPy arrays to the C++ core: fills a Params struct with data
pointers and element strides, releases the GIL and calls the kernel. All argument checking
happens before this point, in fa2cpu/attention.py."""
cimport numpy as cnp
import numpy as np
from libc.stdint cimport INT64_MAX, int8_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t
from libc.math cimport fabsf, isfinite, ldexpf, nearbyintf
from libc.string cimport memcpy
from openmp cimport omp_get_max_threads

from fa2cpu._cpp cimport BackwardParams, Params
from fa2cpu cimport _cpp as c

cnp.import_array()

# The catalogue (csrc/include/fa2cpu/catalogue.def), as the C++ core was built with it.
ISA_NAMES = tuple(c.isa_name(i).decode() for i in range(c.isa_count()))  # best first
DTYPE_CODES = {c.dtype_name(i).decode(): i for i in range(c.dtype_count())}  # NumPy name -> code
cdef int DTYPE_F32 = DTYPE_CODES["float32"], DTYPE_BF16 = DTYPE_CODES["bfloat16"], DTYPE_I8 = DTYPE_CODES["int8"]


cdef inline void _strides4(cnp.ndarray a, int64_t* s):
    """Element strides of a 4-D array view (the caller guarantees itemsize divides them)."""
    cdef Py_ssize_t item = cnp.PyArray_ITEMSIZE(a)
    cdef cnp.npy_intp* st = cnp.PyArray_STRIDES(a)
    cdef int i
    for i in range(4):
        s[i] = st[i] // item


cdef inline void _view(cnp.ndarray a, const void** data, int64_t* batch, int64_t* head, int64_t* row,
                       int64_t* dim):
    """Data pointer and element strides of a 4-D (batch, head, position, feature) view into the
    Params fields given."""
    cdef int64_t s[4]
    _strides4(a, s)
    data[0] = cnp.PyArray_DATA(a)
    batch[0], head[0], row[0], dim[0] = s[0], s[1], s[2], s[3]


cdef cnp.ndarray _element_strided(cnp.ndarray a):
    """a itself, or an aligned contiguous copy when its data pointer or a byte stride is not a
    multiple of the item size (only hand-made views): the core addresses arrays by element
    strides through typed pointers."""
    cdef Py_ssize_t item = cnp.PyArray_ITEMSIZE(a)
    cdef cnp.npy_intp* st = cnp.PyArray_STRIDES(a)
    cdef int i
    if (<size_t>cnp.PyArray_DATA(a)) % item:
        return a.copy(order="C")
    for i in range(cnp.PyArray_NDIM(a)):
        if st[i] % item:
            return a.copy(order="C")
    return a


cdef void _fill(Params* p, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out, object lse,
                int dtype, int64_t batch, int64_t hq, int64_t hk, int64_t nq, int64_t nk,
                double scale, double softcap, int64_t win_left, int64_t win_right,
                object alibi, object cu_q, object cu_k, int num_threads) except *:
    """The Params fields shared by the forward and the backward (q, k, v, out element-strided:
    _element_strided applied by the caller)."""
    cdef cnp.ndarray a
    p.dtype = dtype
    p.batch = batch
    p.hq = hq
    p.hk = hk
    p.nq = nq
    p.nk = nk
    p.d = cnp.PyArray_DIM(q, 3)
    p.dv = cnp.PyArray_DIM(v, 3)
    _view(q, &p.q, &p.q_batch_stride, &p.q_head_stride, &p.q_row_stride, &p.q_dim_stride)
    _view(k, &p.k, &p.k_batch_stride, &p.k_head_stride, &p.k_row_stride, &p.k_dim_stride)
    _view(v, &p.v, &p.v_batch_stride, &p.v_head_stride, &p.v_row_stride, &p.v_dim_stride)
    _view(out, <const void**>&p.out, &p.out_batch_stride, &p.out_head_stride, &p.out_row_stride, &p.out_dim_stride)
    p.lse = NULL
    if lse is not None:
        a = lse
        p.lse = <float*>cnp.PyArray_DATA(a)
        p.lse_batch_stride = cnp.PyArray_STRIDES(a)[0] // 4
        p.lse_head_stride = cnp.PyArray_STRIDES(a)[1] // 4
        p.lse_row_stride = cnp.PyArray_STRIDES(a)[2] // 4
    p.scale = scale
    p.softcap = softcap
    p.window_left = win_left
    p.window_right = win_right
    p.alibi = NULL
    if alibi is not None:
        a = alibi
        p.alibi = <const float*>cnp.PyArray_DATA(a)
        p.alibi_batch_stride = cnp.PyArray_STRIDES(a)[0] // 4
        p.alibi_head_stride = cnp.PyArray_STRIDES(a)[1] // 4
    p.sinks = NULL
    p.mask = NULL
    p.mask_kind = 0
    p.cu_seqlens_q = NULL
    p.cu_seqlens_k = NULL
    p.seqlen_k = NULL
    p.block_table = NULL
    if cu_q is not None:
        a = cu_q
        p.cu_seqlens_q = <const int64_t*>cnp.PyArray_DATA(a)
    if cu_k is not None:
        a = cu_k
        p.cu_seqlens_k = <const int64_t*>cnp.PyArray_DATA(a)
    p.num_threads = num_threads


def run(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out, object lse, *,
        int dtype, int64_t batch, int64_t hq, int64_t hk, int64_t nq, int64_t nk,
        double scale, double softcap, int64_t win_left, int64_t win_right,
        object alibi, object mask, int mask_kind,
        object cu_q, object cu_k, object seqlen_k, object block_table, int64_t block_size,
        int num_threads, int num_splits, object sinks=None, int kv_dtype=-1, object k_scale=None,
        object v_scale=None):
    """q, k, v, out: 4-D views in (batch, head, position, feature) order (varlen/paged views
    described in csrc/include/fa2cpu/fa2cpu.h); lse: float32 3-D (batch, head, row) view or None;
    alibi: float32 2-D (batch, head) view or None; mask: 4-D uint8/float32 view or None;
    cu_q/cu_k/seqlen_k: int64 contiguous or None; block_table: int32 2-D or None; sinks: float32
    contiguous (hq,) or None. kv_dtype: k/v's DType code when they are a quantized cache's codes
    (-1: dtype); k_scale / v_scale: float32 3-D (batch or block, head, position) views or None."""
    cdef Params p
    cdef int64_t s[4]
    cdef cnp.ndarray a
    q = _element_strided(q)  # kept alive here: p points into them until the call returns
    k = _element_strided(k)
    v = _element_strided(v)
    _fill(&p, q, k, v, out, lse, dtype, batch, hq, hk, nq, nk, scale, softcap, win_left, win_right, alibi,
          cu_q, cu_k, num_threads)
    if mask is not None:
        a = mask
        p.mask = cnp.PyArray_DATA(a)
        p.mask_kind = mask_kind
        _strides4(a, s)
        p.mask_batch_stride, p.mask_head_stride, p.mask_query_stride, p.mask_key_stride = s[0], s[1], s[2], s[3]
    if seqlen_k is not None:
        a = seqlen_k
        p.seqlen_k = <const int64_t*>cnp.PyArray_DATA(a)
    if sinks is not None:
        a = sinks
        p.sinks = <const float*>cnp.PyArray_DATA(a)
    if block_table is not None:
        a = block_table
        p.block_table = <const int32_t*>cnp.PyArray_DATA(a)
        p.block_table_batch_stride = cnp.PyArray_STRIDES(a)[0] // 4
        p.block_size = block_size
    p.num_splits = num_splits
    p.kv_dtype = kv_dtype
    if k_scale is not None:
        a = k_scale
        p.k_scale = <const float*>cnp.PyArray_DATA(a)
        p.k_scale_batch_stride, p.k_scale_head_stride, p.k_scale_row_stride = (
            cnp.PyArray_STRIDES(a)[0] // 4, cnp.PyArray_STRIDES(a)[1] // 4, cnp.PyArray_STRIDES(a)[2] // 4)
    if v_scale is not None:
        a = v_scale
        p.v_scale = <const float*>cnp.PyArray_DATA(a)
        p.v_scale_batch_stride, p.v_scale_head_stride, p.v_scale_row_stride = (
            cnp.PyArray_STRIDES(a)[0] // 4, cnp.PyArray_STRIDES(a)[1] // 4, cnp.PyArray_STRIDES(a)[2] // 4)
    cdef int rc
    with nogil:
        rc = c.forward(p)
    if rc != 0:
        raise MemoryError("fa2cpu: could not allocate per-thread scratch memory")
    return out


def run_strided(size_t q, int64_t qb, int64_t qh, int64_t qn, int64_t qd,
                size_t k, int64_t kb, int64_t kh, int64_t kn, int64_t kd,
                size_t v, int64_t vb, int64_t vh, int64_t vn, int64_t vd,
                size_t out, int64_t ob, int64_t oh, int64_t on, int64_t od, *,
                int dtype, int64_t batch, int64_t hq, int64_t hk, int64_t nq, int64_t nk, int64_t d,
                int64_t dv, double scale, double softcap, int64_t win_left, int64_t win_right, int num_threads):
    """``run`` for memory the caller describes by address and element strides ((batch, head,
    position, feature) order, like run's views): fa2cpu.torch's lean route for plain tensors,
    whose checks the caller has made (the same as the NumPy API's; options already normalised)."""
    cdef Params p
    p.dtype, p.batch, p.hq, p.hk, p.nq, p.nk, p.d, p.dv = dtype, batch, hq, hk, nq, nk, d, dv
    p.q = <const void*>q
    p.q_batch_stride, p.q_head_stride, p.q_row_stride, p.q_dim_stride = qb, qh, qn, qd
    p.k = <const void*>k
    p.k_batch_stride, p.k_head_stride, p.k_row_stride, p.k_dim_stride = kb, kh, kn, kd
    p.v = <const void*>v
    p.v_batch_stride, p.v_head_stride, p.v_row_stride, p.v_dim_stride = vb, vh, vn, vd
    p.out = <void*>out
    p.out_batch_stride, p.out_head_stride, p.out_row_stride, p.out_dim_stride = ob, oh, on, od
    p.scale, p.softcap = scale, softcap
    p.window_left, p.window_right = win_left, win_right
    p.num_threads = num_threads
    cdef int rc
    with nogil:
        rc = c.forward(p)
    if rc != 0:
        raise MemoryError("fa2cpu: could not allocate per-thread scratch memory")


cdef class DecodeStep:
    """A prepared ``flash_attention_with_kvcache`` call with an append, over one KV cache (the
    transformers KVCache's decode route, fa2cpu/integrations/_hf_cache.py): everything about the
    cache is read once here, so a step reads nothing but the integers it is given.

    k_cache / v_cache: the cache's 4-D (batch, head, position, feature) views (contiguous caches)
    or (block, head, row, feature) views with ``block_table`` int32 (B, max_blocks) (paged), of
    the kernels' dtype ``dtype`` (a DType code), element-strided, writable; kept alive here.
    A quantized cache: ``kv_dtype`` its codes' DType (int8 / float8_e4m3fn) and ``k_scale`` /
    ``v_scale`` float32 3-D views (batch | block, head, position | row) of the scales; new keys
    / values are quantized by the NumPy append's rule (fa2cpu/attention.py _quantize, float32
    arithmetic, the same bits: tests/test_transformers.py).

    A step trusts its caller for what only the caller can know (the pointers address live
    tensors of the dtype given, with the strides given, not overlapping the cache; the block
    table's entries for the positions written and read are valid blocks) and checks the rest
    (sizes, capacity) before anything is written."""
    cdef Params p
    cdef object keep
    cdef char* k_base
    cdef char* v_base
    cdef int64_t itemsize, cache_batch, capacity
    cdef int64_t kcs[4]
    cdef int64_t vcs[4]
    cdef int64_t kss[3]
    cdef int64_t vss[3]
    cdef float* k_scale_base
    cdef float* v_scale_base
    cdef int64_t[::1] lengths   # the kernels' seqlen_k of one step

    def __init__(self, cnp.ndarray k_cache, cnp.ndarray v_cache, object block_table, int64_t block_size,
                 int dtype, int kv_dtype=-1, object k_scale=None, object v_scale=None):
        cdef cnp.ndarray bt, ks, vs
        cdef int i
        if _element_strided(k_cache) is not k_cache or _element_strided(v_cache) is not v_cache:
            raise ValueError("k_cache, v_cache: must be element-strided")
        self.keep = (k_cache, v_cache, block_table, k_scale, v_scale)
        self.p.dtype = dtype
        self.p.kv_dtype = kv_dtype
        if kv_dtype >= 0:
            ks, vs = k_scale, v_scale
            if cnp.PyArray_TYPE(ks) != cnp.NPY_FLOAT32 or cnp.PyArray_TYPE(vs) != cnp.NPY_FLOAT32 \
                    or _element_strided(ks) is not ks or _element_strided(vs) is not vs:
                raise ValueError("k_scale, v_scale: expected element-strided float32 views")
            self.k_scale_base, self.v_scale_base = <float*>cnp.PyArray_DATA(ks), <float*>cnp.PyArray_DATA(vs)
            for i in range(3):
                self.kss[i] = cnp.PyArray_STRIDES(ks)[i] // 4
                self.vss[i] = cnp.PyArray_STRIDES(vs)[i] // 4
            self.p.k_scale, self.p.v_scale = self.k_scale_base, self.v_scale_base
            self.p.k_scale_batch_stride, self.p.k_scale_head_stride = self.kss[0], self.kss[1]
            self.p.v_scale_batch_stride, self.p.v_scale_head_stride = self.vss[0], self.vss[1]
            self.p.k_scale_row_stride, self.p.v_scale_row_stride = self.kss[2], self.vss[2]
        self.itemsize = cnp.PyArray_ITEMSIZE(k_cache)
        self.p.hk = cnp.PyArray_DIM(k_cache, 1)
        self.p.d = cnp.PyArray_DIM(k_cache, 3)
        self.p.dv = cnp.PyArray_DIM(v_cache, 3)
        _view(k_cache, &self.p.k, &self.p.k_batch_stride, &self.p.k_head_stride, &self.p.k_row_stride,
              &self.p.k_dim_stride)
        _view(v_cache, &self.p.v, &self.p.v_batch_stride, &self.p.v_head_stride, &self.p.v_row_stride,
              &self.p.v_dim_stride)
        _strides4(k_cache, self.kcs)
        _strides4(v_cache, self.vcs)
        self.k_base = <char*>cnp.PyArray_DATA(k_cache)
        self.v_base = <char*>cnp.PyArray_DATA(v_cache)
        if block_table is None:
            self.cache_batch = cnp.PyArray_DIM(k_cache, 0)
            self.capacity = cnp.PyArray_DIM(k_cache, 2)
        else:
            bt = block_table
            self.p.block_table = <const int32_t*>cnp.PyArray_DATA(bt)
            self.p.block_table_batch_stride = cnp.PyArray_STRIDES(bt)[0] // 4
            self.p.block_size = block_size
            self.cache_batch = cnp.PyArray_DIM(bt, 0)
            if block_size < 1 or cnp.PyArray_DIM(bt, 1) > INT64_MAX // block_size:
                raise ValueError(f"block_table: {cnp.PyArray_DIM(bt, 1)} blocks of {block_size} rows do not make a "
                                 f"capacity of 1 to 2**63 - 1 keys")
            self.capacity = cnp.PyArray_DIM(bt, 1) * block_size
        self.lengths = np.zeros(self.cache_batch, np.int64)

    def __call__(self, size_t q, int64_t qb, int64_t qh, int64_t qn, int64_t qd,
                 size_t k, int64_t kb, int64_t kh, int64_t kn, int64_t kd,
                 size_t v, int64_t vb, int64_t vh, int64_t vn, int64_t vd,
                 size_t out, int64_t batch, int64_t hq, int64_t nq, int64_t d, int64_t n_new,
                 cnp.ndarray seqlens, double scale, double softcap, int64_t win_left, int64_t win_right,
                 int num_threads=0):
        """Appends the new keys / values at each sequence's end and attends, GIL released.
        q (batch, hq, nq, d) and new k / v (batch, hk, n_new, d | dv): data addresses and element
        strides in that (batch, head, position, feature) order; out: a C-contiguous
        (batch, nq, hq, dv) buffer. ``seqlens``: int32, contiguous, the stored length of each
        sequence (at least ``batch`` entries); the first ``batch`` grow by n_new once the new
        tokens are stored (nothing is written when a check fails).
        win_left / win_right as the kernels take them (-1 unbounded). num_threads: the kernels'
        thread count as the NumPy API normalises it (0: OpenMP's current maximum). Not thread-safe: one step
        object serves one caller at a time (it owns the kernels' per-step lengths).
        Returns True; False (nothing written) when a quantized cache gets an inf / NaN key or value,
        which the caller's general path refuses with its own error."""
        cdef int32_t* lens
        cdef int64_t b, t, h, pos, row, blk
        cdef int64_t hk = self.p.hk, dv = self.p.dv, item = self.itemsize  # the cache's element size
        cdef int64_t src_item = 4 if self.p.dtype == DTYPE_F32 else 2       # q's, and the new k / v's
        if cnp.PyArray_TYPE(seqlens) != cnp.NPY_INT32 or cnp.PyArray_NDIM(seqlens) != 1 \
                or cnp.PyArray_DIM(seqlens, 0) < batch or not cnp.PyArray_IS_C_CONTIGUOUS(seqlens) \
                or not cnp.PyArray_ISWRITEABLE(seqlens):
            raise ValueError("seqlens: expected writable contiguous int32 lengths of every sequence")
        lens = <int32_t*>cnp.PyArray_DATA(seqlens)
        if not 1 <= batch <= self.cache_batch or hq < 1 or hq % hk or d != self.p.d or nq < 1 or n_new < 0:
            raise ValueError(f"decode step: q ({batch}, {hq}, {nq}, {d}) does not fit the cache "
                             f"(batch <= {self.cache_batch}, {hk} kv heads, D = {self.p.d})")
        for b in range(batch):
            self.lengths[b] = lens[b] + n_new
            if self.lengths[b] < n_new or self.lengths[b] > self.capacity:
                raise ValueError(f"decode step: sequence {b} would hold {self.lengths[b]} positions "
                                 f"(capacity {self.capacity})")
        cdef bint finite = True
        if self.p.kv_dtype >= 0:
            with nogil:
                for b in range(batch):
                    for t in range(n_new):
                        for h in range(hk):
                            finite = finite and _finite_row(<const char*>k + (b * kb + h * kh + t * kn) * src_item,
                                                            kd, self.p.d, self.p.dtype)
                            finite = finite and _finite_row(<const char*>v + (b * vb + h * vh + t * vn) * src_item,
                                                            vd, dv, self.p.dtype)
            if not finite:
                return False
        cdef Params p = self.p
        p.batch, p.hq, p.nq, p.nk = batch, hq, nq, self.capacity
        p.q = <const void*>q
        p.q_batch_stride, p.q_head_stride, p.q_row_stride, p.q_dim_stride = qb, qh, qn, qd
        p.out = <void*>out
        p.out_batch_stride, p.out_head_stride, p.out_row_stride, p.out_dim_stride = nq * hq * dv, dv, hq * dv, 1
        p.seqlen_k = &self.lengths[0]
        p.scale, p.softcap = scale, softcap
        # As kvcache_problem normalises them: bounds past every sequence are unbounded.
        p.window_left = -1 if win_left >= self.capacity else win_left
        p.window_right = -1 if win_right >= nq else win_right
        p.num_threads = num_threads if num_threads > 0 else max(1, min(c.backend_max_threads(), c.max_useful_threads()))
        cdef int rc
        with nogil:
            # The append: rows of n_new new tokens per (sequence, kv head), into their cache slots.
            for b in range(batch):
                for t in range(n_new):
                    pos = self.lengths[b] - n_new + t
                    if p.block_table != NULL:
                        blk = p.block_table[b * p.block_table_batch_stride + pos // p.block_size]
                        row = pos % p.block_size
                    else:
                        blk, row = b, pos
                    for h in range(hk):
                        _store_row(self.k_base, self.kcs, self.k_scale_base, self.kss, blk, h, row,
                                   <const char*>k + (b * kb + h * kh + t * kn) * src_item, kd, self.p.d, item,
                                   p.dtype, p.kv_dtype)
                        _store_row(self.v_base, self.vcs, self.v_scale_base, self.vss, blk, h, row,
                                   <const char*>v + (b * vb + h * vh + t * vn) * src_item, vd, dv, item,
                                   p.dtype, p.kv_dtype)
            for b in range(batch):
                lens[b] = <int32_t>self.lengths[b]
            rc = c.forward(p)
        if rc != 0:
            raise MemoryError("fa2cpu: could not allocate per-thread scratch memory")
        return True


cdef inline float _load(const char* src, int dtype) noexcept nogil:
    """One element of a kernel dtype (DType code: float32, float16 or bfloat16) as float32, exactly."""
    cdef uint32_t bits
    cdef uint16_t h
    cdef float f
    if dtype == DTYPE_F32:
        memcpy(&f, src, 4)
        return f
    memcpy(&h, src, 2)
    if dtype == DTYPE_BF16:
        bits = (<uint32_t>h) << 16
    else:  # float16
        bits = (<uint32_t>(h & 0x8000)) << 16
        if (h >> 10) & 0x1F == 0:  # zero or subnormal: mant * 2^-24, exact in float32
            f = ldexpf(<float>(h & 0x3FF), -24)
            return -f if h & 0x8000 else f
        if (h >> 10) & 0x1F == 0x1F:
            bits = bits | 0x7F800000 | ((<uint32_t>(h & 0x3FF)) << 13)
        else:
            bits = bits | ((<uint32_t>(((h >> 10) & 0x1F) + 112)) << 23) | ((<uint32_t>(h & 0x3FF)) << 13)
    memcpy(&f, &bits, 4)
    return f


cdef inline bint _finite_row(const char* src, int64_t stride, int64_t n, int dtype) noexcept nogil:
    cdef int64_t i
    cdef int64_t item = 4 if dtype == DTYPE_F32 else 2
    for i in range(n):
        if not isfinite(_load(src + i * stride * item, dtype)):
            return False
    return True


cdef inline uint8_t _e4m3(float y) noexcept nogil:
    """float8_e4m3fn code of a finite |y| <= 448, rounded to nearest even (subnormals below 2^-6)."""
    cdef uint32_t bits, mant, rem
    cdef int32_t e
    cdef uint8_t sign, r
    memcpy(&bits, &y, 4)
    sign = <uint8_t>((bits >> 24) & 0x80)
    cdef float a = fabsf(y)
    if a < 0.015625:  # subnormal: m * 2^-9, m = 8 rounds up into the smallest normal's code
        return sign | <uint8_t>nearbyintf(a * 512.0)
    e = <int32_t>((bits >> 23) & 0xFF) - 127
    mant = bits & 0x7FFFFF
    r = <uint8_t>(mant >> 20)
    rem = mant & 0xFFFFF
    if rem > 0x80000 or (rem == 0x80000 and (r & 1)):
        r += 1
        if r == 8:
            r = 0
            e += 1
    return sign | <uint8_t>((e + 7) << 3) | r


cdef inline float _quantize_row(char* dst, int64_t dst_stride, const char* src, int64_t src_stride, int64_t n,
                                int dtype, int kv_dtype) noexcept nogil:
    """Codes of n finite elements into dst (1-byte codes, element stride dst_stride); returns the
    row's scale. The rule of fa2cpu/attention.py _quantize in float32: scale = max|x| / limit
    (127 int8, 448 float8), y = x / (scale or 1), int8 rounds half to even, both clamp to
    [-limit, limit]."""
    cdef int64_t i
    cdef int64_t item = 4 if dtype == DTYPE_F32 else 2
    cdef float x, y, amax = 0.0
    cdef bint i8 = kv_dtype == DTYPE_I8
    cdef float limit = 127.0 if i8 else 448.0
    for i in range(n):
        x = fabsf(_load(src + i * src_stride * item, dtype))
        if x > amax:
            amax = x
    cdef float sc = amax / limit
    cdef float div = sc if sc > 0 else <float>1.0
    for i in range(n):
        y = _load(src + i * src_stride * item, dtype) / div
        if i8:
            y = nearbyintf(y)
        elif sc == 0:  # a row of zeros (-0.0 included) gets codes 0, not float8's -0 (0x80)
            y = 0.0
        y = limit if y > limit else (-limit if y < -limit else y)
        if i8:
            (<int8_t*>(dst + i * dst_stride))[0] = <int8_t>y
        else:
            (<uint8_t*>(dst + i * dst_stride))[0] = _e4m3(y)
    return sc


cdef inline void _store_row(char* base, const int64_t* cs, float* scale_base, const int64_t* ss, int64_t blk,
                            int64_t h, int64_t row, const char* src, int64_t src_stride, int64_t n, int64_t item,
                            int dtype, int kv_dtype) noexcept nogil:
    """One new row (n elements of kernel dtype `dtype` at src) into cache slot (blk, h, row) of a
    cache with element strides cs (item bytes each): copied, or (kv_dtype >= 0) quantized into
    1-byte codes with its scale at scale_base[(blk, h, row) by strides ss]."""
    cdef int64_t at = blk * cs[0] + h * cs[1] + row * cs[2]
    if kv_dtype < 0:
        _copy_row(base + at * item, cs[3], src, src_stride, n, item)
    else:
        scale_base[blk * ss[0] + h * ss[1] + row * ss[2]] = _quantize_row(base + at, cs[3], src, src_stride, n,
                                                                          dtype, kv_dtype)


cdef inline void _copy_row(char* dst, int64_t dst_stride, const char* src, int64_t src_stride, int64_t n,
                           int64_t item) noexcept nogil:
    """n elements of `item` bytes, element strides given."""
    cdef int64_t i
    if dst_stride == 1 and src_stride == 1:
        memcpy(dst, src, n * item)
        return
    for i in range(n):
        memcpy(dst + i * dst_stride * item, src + i * src_stride * item, item)


# ---- Gradient memory kept for the next backward ----------------------------------------------
# A backward call's dq / dk / dv are new arrays. Memory fresh from the OS is zeroed by the kernel
# page by page on first touch, inside the parallel kernels (with transparent huge pages, 2 MB at
# a time while the other threads wait on the same pages); glibc hands blocks of several MB back
# to the OS when they are freed, so a training loop's every backward paid that again. On the
# 2-core Xeon with AMX (a VM; 2 threads, B=1 H=16 N=2048 D=128) fresh gradients made the
# backward 1.10-1.32x slower than reused ones (1.00 at one thread; 0.99-1.02x at 16 threads on
# the AMX test machine, whose page faults are cheap; bench/RESULTS.md, session 48). So the memory
# of gradients the caller has dropped is kept (a block of the same byte size is reused, newest
# first), up to FA2CPU_KEEP_GRADIENTS_MB (read at import, default 256; 0 keeps nothing); the
# oldest go first. Allocation and __dealloc__ run under the GIL; a mutex guards the list as well.
cdef extern from *:
    """
    #include <cstdlib>
    #include <mutex>
    #include <vector>

    #include "driver/driver.h"
    struct Fa2cpuKeptBlock { void* ptr; size_t nbytes; };
    static std::vector<Fa2cpuKeptBlock> fa2cpu_kept;  // oldest first
    static size_t fa2cpu_kept_bytes = 0;
    static std::mutex fa2cpu_kept_mutex;  // the GIL guards every caller; this, builds without one
    // FA2CPU_KEEP_GRADIENTS_MB (read once, at import): MiB kept; unset, empty or not a
    // non-negative integer: 256 (driver.h env_count).
    static const size_t fa2cpu_keep_limit = size_t(fa2cpu::env_count("FA2CPU_KEEP_GRADIENTS_MB", 256, int64_t(1) << 30)) << 20;
    // A kept block of exactly nbytes (the newest such), else new memory; null when out of memory.
    static void* fa2cpu_take_block(size_t nbytes) {
        {
            std::lock_guard<std::mutex> lock(fa2cpu_kept_mutex);
            for (size_t i = fa2cpu_kept.size(); i-- > 0;)
                if (fa2cpu_kept[i].nbytes == nbytes) {
                    void* p = fa2cpu_kept[i].ptr;
                    fa2cpu_kept_bytes -= nbytes;
                    fa2cpu_kept.erase(fa2cpu_kept.begin() + i);
                    return p;
                }
        }
        // New memory as the driver's other large buffers get it (2 MB pages asked for from 8 MB on).
        return fa2cpu::alloc_large(nbytes);
    }
    // p's memory onto the kept list (the oldest freed while over the limit), or freed.
    static void fa2cpu_give_back(void* p, size_t nbytes) {
        if (nbytes > fa2cpu_keep_limit) { std::free(p); return; }
        std::lock_guard<std::mutex> lock(fa2cpu_kept_mutex);
        fa2cpu_kept.push_back({p, nbytes});
        fa2cpu_kept_bytes += nbytes;
        while (fa2cpu_kept_bytes > fa2cpu_keep_limit) {
            std::free(fa2cpu_kept.front().ptr);
            fa2cpu_kept_bytes -= fa2cpu_kept.front().nbytes;
            fa2cpu_kept.erase(fa2cpu_kept.begin());
        }
    }
    static size_t fa2cpu_kept_now() {
        std::lock_guard<std::mutex> lock(fa2cpu_kept_mutex);
        return fa2cpu_kept_bytes;
    }
    """
    void* fa2cpu_take_block(size_t nbytes)
    void fa2cpu_give_back(void* p, size_t nbytes)
    size_t fa2cpu_kept_now()


cdef class _KeptMemory:
    """The memory behind one gradient array (its base, through the buffer protocol); given back to
    the kept list when the last array or view of it is gone."""
    cdef void* ptr
    cdef size_t nbytes
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]

    def __getbuffer__(self, Py_buffer* buf, int flags):
        buf.buf = self.ptr
        buf.obj = self
        buf.len = self.nbytes
        buf.readonly = 0
        buf.itemsize = 1
        buf.format = "B"
        buf.ndim = 1
        self.shape[0] = self.nbytes
        self.strides[0] = 1
        buf.shape = self.shape
        buf.strides = self.strides
        buf.suboffsets = NULL
        buf.internal = NULL

    def __releasebuffer__(self, Py_buffer* buf):
        pass

    def __dealloc__(self):
        if self.ptr != NULL:
            fa2cpu_give_back(self.ptr, self.nbytes)


def gradient_array(shape, dtype):
    """An uninitialised C-contiguous array of this shape and dtype for a backward's gradient, in
    kept memory (see above) when it has elements."""
    dtype = np.dtype(dtype)
    cdef size_t count = 1
    for n in shape:
        count *= <size_t>n
    if count == 0:
        return np.empty(shape, dtype)
    cdef _KeptMemory mem = _KeptMemory.__new__(_KeptMemory)
    mem.nbytes = count * dtype.itemsize
    mem.ptr = fa2cpu_take_block(mem.nbytes)
    if mem.ptr == NULL:
        raise MemoryError(f"fa2cpu: could not allocate a gradient of shape {tuple(shape)}")
    return np.frombuffer(mem, dtype=dtype, count=count).reshape(shape)


def kept_gradient_bytes():
    """Bytes of gradient memory kept for reuse now (FA2CPU_KEEP_GRADIENTS_MB caps them)."""
    return fa2cpu_kept_now()


def run_backward(cnp.ndarray dout, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out,
                 cnp.ndarray lse, cnp.ndarray dq, cnp.ndarray dk, cnp.ndarray dv, *,
                 int dtype, int64_t batch, int64_t hq, int64_t hk, int64_t nq, int64_t nk,
                 double scale, double softcap, int64_t win_left, int64_t win_right,
                 object alibi, object cu_q, object cu_k, int num_threads):
    """Gradients of the forward call these arguments describe (same meaning as run's), written
    into dq, dk, dv: 4-D (batch, head, position, feature) views laid out like q, k, v (dout like
    out), element-strided, of q's dtype. lse: float32 3-D (batch, head, row) view as the forward
    returned it."""
    cdef BackwardParams p
    for name, a in (("dq", dq), ("dk", dk), ("dv", dv)):
        if _element_strided(a) is not a:
            raise ValueError(f"{name}: must be element-strided and aligned")
    dout = _element_strided(dout)  # kept alive here: p points into them until the call returns
    q = _element_strided(q)
    k = _element_strided(k)
    v = _element_strided(v)
    out = _element_strided(out)
    lse = _element_strided(lse)  # the caller's lse (the forward's own is element-strided)
    _fill(&p.f, q, k, v, out, lse, dtype, batch, hq, hk, nq, nk, scale, softcap, win_left, win_right, alibi,
          cu_q, cu_k, num_threads)
    _view(dout, &p.dout, &p.dout_batch_stride, &p.dout_head_stride, &p.dout_row_stride, &p.dout_dim_stride)
    _view(dq, <const void**>&p.dq, &p.dq_batch_stride, &p.dq_head_stride, &p.dq_row_stride, &p.dq_dim_stride)
    _view(dk, <const void**>&p.dk, &p.dk_batch_stride, &p.dk_head_stride, &p.dk_row_stride, &p.dk_dim_stride)
    _view(dv, <const void**>&p.dv, &p.dv_batch_stride, &p.dv_head_stride, &p.dv_row_stride, &p.dv_dim_stride)
    cdef int rc
    with nogil:
        rc = c.backward(p)
    if rc != 0:
        raise MemoryError("fa2cpu: could not allocate the backward's scratch memory")


def max_threads():
    """OpenMP's current maximum for the calling thread (follows OMP_NUM_THREADS/threadpoolctl);
    with an external OpenMP runtime selected (fa2cpu.torch), that runtime's (torch.set_num_threads)."""
    return c.backend_max_threads()


def max_useful_threads():
    """CPUs this process may run on: the cap on any thread count (csrc/driver/pool.h)."""
    return c.max_useful_threads()


def pool_threads():
    """Helper threads the driver's pool has created in this process (0 before the first
    multi-threaded call, and again in a child of fork())."""
    return c.pool_threads()


def set_parallel_backend(str name, size_t gomp_parallel=0, size_t max_threads=0):
    """'pool' (fa2cpu's own threads, the default) or 'openmp' (an OpenMP runtime: fa2cpu.torch
    selects it, so calls inside PyTorch run on torch's threads). gomp_parallel / max_threads:
    addresses of another runtime's GOMP_parallel / omp_get_max_threads to use instead of the
    one this extension links (0: ours). See csrc/driver/pool.h."""
    if name not in ("pool", "openmp"):
        raise ValueError(f"name: expected 'pool' or 'openmp', got {name!r}")
    c.set_openmp_backend(name == "openmp", <c.GompParallelFn>gomp_parallel, <c.MaxThreadsFn>max_threads)


def parallel_backend():
    if not c.openmp_backend():
        return "pool"
    return "openmp (external runtime)" if c.openmp_backend_is_foreign() else "openmp"


def available_isas():
    cdef int codes[64]
    cdef int n = c.available_isas(codes)
    return [ISA_NAMES[codes[i]] for i in range(n)]


def compiled_isas():
    return [ISA_NAMES[i] for i in range(len(ISA_NAMES)) if c.isa_compiled(i)]


def get_isa():
    return ISA_NAMES[c.get_isa()]


def set_isa(str name):
    """Caller validated `name` against available_isas()."""
    c.set_isa(ISA_NAMES.index(name))


def reset_isa():
    c.reset_isa()


def peak_gflops(str family, str dtype, int threads, double seconds=0.2):
    """Measured GFLOP/s of `family`'s main multiply-add for dtype ('fp32', 'bf16', 'fp16') on
    `threads` threads, for about `seconds`. 0.0 when the family cannot run here."""
    if family not in ISA_NAMES:
        raise ValueError(f"family: unknown {family!r}; expected one of {ISA_NAMES}")
    code = DTYPE_CODES.get({"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(dtype, dtype))
    if code is None:
        raise ValueError(f"dtype: unknown {dtype!r}; expected 'fp32', 'bf16' or 'fp16'")
    if threads < 1:
        raise ValueError("threads: must be >= 1")
    cdef int isa = ISA_NAMES.index(family)
    cdef int dt = code
    cdef double r
    with nogil:
        r = c.peak_gflops(isa, dt, threads, seconds)
    return r


def read_bandwidth_gbs(int threads, int64_t nbytes=1 << 30):
    """Measured read bandwidth (GB/s) of `threads` threads streaming a buffer of `nbytes`."""
    if threads < 1:
        raise ValueError("threads: must be >= 1")
    if nbytes < 1:
        raise ValueError("nbytes: must be >= 1")
    cdef double r
    with nogil:
        r = c.read_bandwidth_gbs(threads, nbytes)
    return r


cdef extern from *:
    """
    #define FA2CPU_STR2(x) #x
    #define FA2CPU_STR(x) FA2CPU_STR2(x)
    #if defined(__clang__)
    static const char* fa2cpu_compiler = "clang " __clang_version__;
    #elif defined(__GNUC__)
    static const char* fa2cpu_compiler = "gcc " __VERSION__;
    #else
    static const char* fa2cpu_compiler = "unknown";
    #endif
    #ifdef _OPENMP
    static const char* fa2cpu_openmp = "OpenMP " FA2CPU_STR(_OPENMP);
    #else
    static const char* fa2cpu_openmp = "none";
    #endif
    """
    const char* fa2cpu_compiler
    const char* fa2cpu_openmp


def compiler_info():
    return fa2cpu_compiler.decode()


def openmp_info():
    return fa2cpu_openmp.decode()
