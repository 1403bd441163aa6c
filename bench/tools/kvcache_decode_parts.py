"""Where the Python around a KVCache decode step goes: bench/decode_anatomy.py (random-init Llama,
hidden 2048, heads 16/4, 4 layers, 2048-token prompt, 16 decode steps, bf16 and fp32) with timers around
the cache layer's _padding_plan / _attend / _step_attend, decode calls only: mean and median per call
(the mean shows what the median hides: work done by one layer per forward). Session 37.

    PYTHONPATH=$PWD python bench/tools/kvcache_decode_parts.py THREADS
"""
import collections, os, statistics, sys, time
T = sys.argv[1] if len(sys.argv) > 1 else "2"
sys.argv = ["x", T]
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # bench/: decode_anatomy
import decode_anatomy as da
from fa2cpu.integrations import _hf_cache
L = _hf_cache._KVLayer
mine = collections.defaultdict(list)
def wrap(name, decode):
    f = getattr(L, name)
    def g(self, *a, **k):
        t0 = time.perf_counter(); r = f(self, *a, **k); dt = time.perf_counter() - t0
        if decode(a): mine[(name, str(self._owner.dtype))].append(dt)
        return r
    setattr(L, name, g)
wrap("_padding_plan", lambda a: a[0] is not None and a[0].q_length == 1)
wrap("_attend", lambda a: a[1].shape[2] == 1)
wrap("_step_attend", lambda a: a[0].shape[2] == 1)
da.main()
for n, v in sorted(mine.items()):
    print(f"{n[0]:15s} {n[1]:15s} decode calls {len(v):4d}: mean {statistics.mean(v)*1e6:7.1f} us  median {statistics.median(v)*1e6:7.1f} us")
