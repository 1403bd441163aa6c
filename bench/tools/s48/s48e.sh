#!/bin/bash
# AMX test machine: bash bench/tools/s48/s48e.sh (logs under $OUT). The dq reduction of split kv
# heads by the family's reduce_row (this tree) against the driver's scalar loop
# (reduce_row_family.patch reversed), amx family, in one process (bench/ab_inproc.py base new):
# 16 threads (4 key splits per kv head at H=16 N=2048), 2 threads H=8, 1 thread H=4.
cd "$(dirname "$0")/../../.."; ROOT=$PWD
lscpu | grep -E "Model name|^Model:" > $OUT/machine.txt
bash bench/tools/s47/build_pair.sh $PWD/bench/tools/s48/reduce_row_family.patch rr
{
  for c in "16 backward 16 2048 0 bf16 11" "16 backward 16 2048 1 bf16 11" "16 backward 16 2048 0 fp32 7" "16 backward 16 2048 1 fp32 7" \
           "16 backward 32 4096 0 bf16 5" "16 backward 32 4096 0 fp32 3" "2 backward 8 2048 0 bf16 7" "1 backward 4 2048 0 bf16 5"; do
    (cd /tmp && PYTHONPATH=/tmp/rr_new python3 $ROOT/bench/ab_inproc.py /tmp/rr_base/fa2cpu /tmp/rr_new/fa2cpu $c 2>&1 | tail -n1)
  done
} 2>&1 | tee $OUT/s48e.log
