#!/bin/bash
# AMX test machine: bash bench/tools/s50/s50a.sh (logs under $OUT). Session 50:
# 1. the decode prefetch distance capped at 32 KB of the stream (prefetch_bytes.patch, in this
#    tree) against the tree without it, in process (decode_layouts.py) at 16 threads;
# 2. issue 13's decode in three forms (decode_memory_probe.py: real, last-level cache flushed,
#    L1-resident keys) at 16, 8 and 1 threads, and bench/kv_quant.py at 16 threads (session 50's
#    read-bandwidth probe);
# 3. the KV-cache tests on the amx family at 16 threads.
cd "$(dirname "$0")/../../.."
ROOT=$PWD
lscpu > $OUT/s50a_lscpu.txt
bash bench/tools/s47/build_pair.sh $ROOT/bench/tools/s50/prefetch_bytes.patch s50
cp -r /tmp/s50_base /tmp/s50_base2
cd /tmp
{
  for t in 16; do for c in fp32 bf16 int8 fp8; do
    PYTHONPATH=/tmp/s50_new python3 $ROOT/bench/tools/s50/decode_layouts.py $t $c bnhd 9 /tmp/s50_base/fa2cpu /tmp/s50_new/fa2cpu /tmp/s50_base2/fa2cpu | tail -n2
  done; done
  PYTHONPATH=/tmp/s50_new python3 $ROOT/bench/tools/s50/decode_layouts.py 16 bf16 bhnd 9 /tmp/s50_base/fa2cpu /tmp/s50_new/fa2cpu | tail -n1
  PYTHONPATH=/tmp/s50_new python3 $ROOT/bench/tools/s50/decode_layouts.py 16 int8 bhnd 9 /tmp/s50_base/fa2cpu /tmp/s50_new/fa2cpu | tail -n1
} 2>&1 | tee $OUT/s50a_prefetch_ab.log
{
  for t in 16; do PYTHONPATH=/tmp/s50_new python3 $ROOT/bench/tools/s50/decode_memory_probe.py $t 9 2048 2.0; done
  PYTHONPATH=/tmp/s50_new python3 $ROOT/bench/tools/s50/decode_memory_probe.py 1 3 2048 2.0
  PYTHONPATH=/tmp/s50_new python3 $ROOT/bench/kv_quant.py --threads 16 --caches bf16,int8 --reps 9
  PYTHONPATH=/tmp/s50_base python3 $ROOT/bench/kv_quant.py --threads 16 --caches bf16,int8 --reps 9
} 2>&1 | tee $OUT/s50a_decode_forms.log
cp -r $ROOT/tests /tmp/s50_new/ && cd /tmp/s50_new && OMP_NUM_THREADS=16 PYTHONPATH=/tmp/s50_new timeout 200 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_kvcache.py tests/test_kvcache_quant.py > $OUT/s50a_tests_amx.log 2>&1
tail -n3 $OUT/s50a_tests_amx.log
# (Session 50's call ran the A/B lines without PYTHONPATH, which failed; they ran in a second call on
# the same warm machine, also in the reverse order (new build first): s50b_prefetch_ab.log.)
