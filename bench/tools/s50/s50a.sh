#!/bin/bash
# AMX test machine: bash bench/tools/s50/s50a.sh (logs under $OUT). Issue 13's decode at 16, 8 and 1
# threads in three forms (decode_memory_probe.py: real, last-level cache flushed, L1-resident keys),
# bench/kv_quant.py as the issue measures it (with session 50's read-bandwidth probe), and the int8
# route's far prefetch 32 keys ahead instead of 64 (int8_prefetch32.patch) in process at 16 threads.
cd "$(dirname "$0")/../../.."
ROOT=$PWD
bash bench/tools/s48/build_amx.sh /tmp/s50
cp $OUT/build.log $OUT/build_base.log
bash bench/tools/s48/build_amx.sh /tmp/s50_pf32 $ROOT/bench/tools/s50/int8_prefetch32.patch
lscpu > $OUT/s50a_lscpu.txt
cd /tmp/s50
{
  for t in 16 8; do PYTHONPATH=/tmp/s50 python3 $ROOT/bench/tools/s50/decode_memory_probe.py $t 9 2048 2.0; done
  PYTHONPATH=/tmp/s50 python3 $ROOT/bench/tools/s50/decode_memory_probe.py 1 3 2048 2.0
  PYTHONPATH=/tmp/s50 python3 $ROOT/bench/kv_quant.py --threads 16 --caches bf16,int8 --reps 9
  cp -r /tmp/s50 /tmp/s50_base2
  cd /tmp && for c in int8 bf16; do PYTHONPATH=/tmp/s50 python3 $ROOT/bench/tools/s46/decode_multi.py 16 $c 11 /tmp/s50/fa2cpu /tmp/s50_pf32/fa2cpu /tmp/s50_base2/fa2cpu; done
} 2>&1 | tee $OUT/s50a_decode_forms.log
