#!/bin/bash
# AMX test machine (session 59, first call): HEAD built in place; issue 13's int8 and bf16 decode at
# 1, 2 (taskset) and 16 threads, and at 1 thread from a cache that fits L2 / L3 (per-core rates:
# is int8 decode compute-bound on Intel?); then
# bench/tools/s58/amx_phases.sh (where the amx backward's cycles go). Logs under $OUT.
cd "$(dirname "$0")/../../.."
ROOT=$PWD; T0=$(date +%s)
lscpu | grep -E "^Model:|^CPU\(s\)|^Model name|^Flags" > $OUT/s59a_machine.txt
python3 setup.py build_ext --inplace -j16 > /tmp/s59a_build.log 2>&1; echo "build rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/s59a_machine.txt
bash bench/tools/s58/amx_phases.sh
K="timeout 100 python3 bench/kv_quant.py --caches bf16,int8"
{ PYTHONPATH=$ROOT $K --threads 16 --reps 9
  PYTHONPATH=$ROOT taskset -c 0,1 $K --threads 2 --reps 7
  PYTHONPATH=$ROOT taskset -c 0 $K --threads 1 --reps 5
  PYTHONPATH=$ROOT taskset -c 0 $K --threads 1 --batch 1 --nk 1024 --reps 41
  PYTHONPATH=$ROOT taskset -c 0 $K --threads 1 --batch 1 --nk 256 --reps 101; } > $OUT/s59a_kv.log 2>&1
echo "all done at $(( $(date +%s) - T0 )) s" >> $OUT/s59a_kv.log
