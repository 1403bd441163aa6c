#!/bin/bash
# AMX test machine: bash bench/tools/s48/s48d.sh (logs under $OUT). Phase timers of the backward
# (bwd_phase_timers.patch: TSC per run_item phase summed over threads, wall TSC of the items and
# the dq reduction per call), amx family, 16 threads.
cd "$(dirname "$0")/../../.."; ROOT=$PWD
bash bench/tools/s48/build_amx.sh /tmp/ph $ROOT/bench/tools/s48/bwd_phase_timers.patch
cd /tmp && {
  for c in "16 2048 0 20 bf16" "16 2048 1 20 bf16" "16 2048 0 8 fp32" "32 4096 0 5 bf16" "64 2048 0 10 bf16"; do
    echo "## 16 threads: $c"; OMP_NUM_THREADS=16 PYTHONPATH=/tmp/ph python3 $ROOT/bench/tools/s48/bwd_only.py $c
  done
  echo "## 1 thread: 4 2048 0 5 bf16"; OMP_NUM_THREADS=1 PYTHONPATH=/tmp/ph python3 $ROOT/bench/tools/s48/bwd_only.py 4 2048 0 5 bf16
} 2>&1 | tee $OUT/s48d.log
