#!/bin/bash
# AMX test machine: bash bench/tools/s50/s50a.sh (logs under $OUT). Issue 13's decode at 16 and 1
# threads in three forms (decode_memory_probe.py: real, last-level cache flushed, L1-resident keys),
# then bench/kv_quant.py as the issue measures it, on the amx family built from this tree.
cd "$(dirname "$0")/../../.."
ROOT=$PWD
bash bench/tools/s48/build_amx.sh /tmp/s50
lscpu > $OUT/s50a_lscpu.txt
cd /tmp/s50
{
  for t in 16 8; do PYTHONPATH=/tmp/s50 python3 $ROOT/bench/tools/s50/decode_memory_probe.py $t 9 2048 2.0; done
  PYTHONPATH=/tmp/s50 python3 $ROOT/bench/tools/s50/decode_memory_probe.py 1 3 2048 2.0
  PYTHONPATH=/tmp/s50 python3 $ROOT/bench/kv_quant.py --threads 16 --caches bf16,int8 --reps 9
} 2>&1 | tee $OUT/s50a_decode_forms.log
