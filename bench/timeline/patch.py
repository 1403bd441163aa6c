"""Timeline instrumentation of a copy of the tree (bench/timeline/README.md); never of the checkout.

    python bench/timeline/patch.py <copy>/csrc/driver/driver.cpp   # also patches <copy>/fa2cpu/_core.pyx
"""
import os
import sys


def sub(text, old, new):
    """text with `old` (which must occur exactly once: a patch that no longer applies fails) replaced."""
    if text.count(old) != 1:
        sys.exit(f"patch.py: expected one occurrence of {old[:60]!r}, found {text.count(old)}")
    return text.replace(old, new)


p = sys.argv[1]
s = open(p).read()
s = sub(s, 'void run_item_on_thread(int64_t i, void* c) {\n    RunCtx& x = *static_cast<RunCtx*>(c);',
'''}  // namespace
struct XEv { unsigned long long t0, t1; int tid; int item; };
XEv g_xev[1 << 16]; std::atomic<int> g_xn{0}; std::atomic<int> g_xtid{0};
thread_local int t_xtid = -1;
unsigned long long g_xcall0 = 0, g_xcall1 = 0;
// Records the item (its split's share of the merge tree included) when the function returns.
struct XItem {
    unsigned long long t0; int item;
    ~XItem() { int k = g_xn.fetch_add(1); if (k < (1 << 16)) g_xev[k] = XEv{t0, __rdtsc(), t_xtid, item}; }
};
namespace {
void run_item_on_thread(int64_t i, void* c) {
    if (t_xtid < 0) t_xtid = g_xtid.fetch_add(1);
    XItem _xitem{__rdtsc(), int(i)};
    RunCtx& x = *static_cast<RunCtx*>(c);''')
s = sub(s, '''    parallel_for(int64_t(plan.items.size()), threads, &run_item_on_thread, &ctx);
    tls_shared.mem.trim();''', '''    g_xn.store(0); g_xcall0 = __rdtsc();
    parallel_for(int64_t(plan.items.size()), threads, &run_item_on_thread, &ctx);
    g_xcall1 = __rdtsc();
    if (std::getenv("FA2CPU_XTRACE")) {
        int n = g_xn.load(); std::fprintf(stderr, "XCALL %llu items %d pre %llu\\n", (g_xcall1 - g_xcall0), n, g_xcall0 - _xentry);
        for (int k = 0; k < n && k < 64; ++k) std::fprintf(stderr, "XI %d %d %llu %llu\\n", g_xev[k].tid, g_xev[k].item, g_xev[k].t0 - g_xcall0, g_xev[k].t1 - g_xcall0);
    }
    tls_shared.mem.trim();''')
s = sub(s, 'int forward(const Params& p) {\n    check_forward(p);', 'int forward(const Params& p) {\n    const unsigned long long _xentry = __rdtsc();\n    check_forward(p);')
s = sub(s, '#include <omp.h>', '#include <omp.h>\n#include <x86intrin.h>\n#include <cstdio>')
open(p, 'w').write(s)
# _core.pyx: total cycles inside DecodeStep.__call__ (entry to return), and up to forward()
px = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(p))), "fa2cpu", "_core.pyx")
t = open(px).read()
t = sub(t, '''cdef class DecodeStep:''', '''cdef extern from "x86intrin.h":
    unsigned long long __rdtsc() nogil
cdef extern from "stdio.h":
    ctypedef struct FILE
    FILE* stderr
    int fprintf(FILE*, const char*, ...) nogil

cdef class DecodeStep:''')
t = sub(t, '''        cdef int32_t* lens
        cdef int64_t b, t, h, pos, row, blk''', '''        cdef unsigned long long _x0 = __rdtsc(), _x1
        cdef int32_t* lens
        cdef int64_t b, t, h, pos, row, blk''')
t = sub(t, '''            for b in range(batch):
                lens[b] = <int32_t>self.lengths[b]
            rc = c.forward(p)
        if rc != 0:
            raise MemoryError("fa2cpu: could not allocate per-thread scratch memory")
        return True''', '''            for b in range(batch):
                lens[b] = <int32_t>self.lengths[b]
            _x1 = __rdtsc()
            rc = c.forward(p)
        if rc != 0:
            raise MemoryError("fa2cpu: could not allocate per-thread scratch memory")
        fprintf(stderr, "XSTEP %llu %llu\\n", _x1 - _x0, __rdtsc() - _x0)
        return True''')
open(px, "w").write(t)
