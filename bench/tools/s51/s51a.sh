#!/bin/bash
# AMX test machine: bash bench/tools/s51/s51a.sh (logs under $OUT). Session 51's paged decode
# changes (paged_runs.patch = git diff e6b1816 75c0e2d -- csrc: the int16 route's one-block tiles
# in registers, tiles spanning blocks of 16-31 keys, small blocks prefetched prefetch_keys /
# block_size blocks ahead) against the tree without them, in process at 16 threads, both load
# orders; the KV-cache tests on the amx family; issue 13's kv_quant at 16 threads.
cd "$(dirname "$0")/../../.."
ROOT=$PWD
lscpu | grep -E "Model name|^Model:" > $OUT/s51a_machine.txt
bash bench/tools/s47/build_pair.sh $ROOT/bench/tools/s51/paged_runs.patch s51a
cd /tmp
for cb in "int8 16" "int8 32" "int8 64" "bf16 16" "bf16 64" "fp32 16"; do set -- $cb
  PYTHONPATH=/tmp/s51a_new python3 $ROOT/bench/tools/s50/decode_paged_ab.py 16 $1 $2 7 /tmp/s51a_base/fa2cpu /tmp/s51a_new/fa2cpu | tail -n1
  PYTHONPATH=/tmp/s51a_new python3 $ROOT/bench/tools/s50/decode_paged_ab.py 16 $1 $2 7 /tmp/s51a_new/fa2cpu /tmp/s51a_base/fa2cpu | tail -n1
done 2>&1 | tee $OUT/s51a_paged_ab.log
for o in "base new" "new base"; do set -- $o
  PYTHONPATH=/tmp/s51a_new python3 $ROOT/bench/tools/s50/decode_layouts.py 16 int8 bnhd 7 /tmp/s51a_$1/fa2cpu /tmp/s51a_$2/fa2cpu | tail -n1
done 2>&1 | tee -a $OUT/s51a_paged_ab.log
PYTHONPATH=/tmp/s51a_new python3 $ROOT/bench/tools/s50/decode_paged_ab.py 1 int8 16 5 /tmp/s51a_base/fa2cpu /tmp/s51a_new/fa2cpu 2>&1 | tail -n1 | tee -a $OUT/s51a_paged_ab.log
(cd /tmp/s51a_new && cp -r $ROOT/tests . && OMP_NUM_THREADS=16 timeout 300 python3 -m pytest -q -x tests/test_kvcache.py tests/test_kvcache_quant.py -p no:cacheprovider > $OUT/s51a_tests.log 2>&1; tail -n2 $OUT/s51a_tests.log)
cd /tmp/s51a_new && PYTHONPATH=/tmp/s51a_new python3 $ROOT/bench/kv_quant.py --threads 16 --caches bf16,int8 --reps 9 2>&1 | tee $OUT/s51a_kv_quant16.log
