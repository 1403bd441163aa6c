#!/bin/bash
# AMX test machine (session 59, third call). Where does the amx bf16 backward lose at 16 threads?
# The plan depends on the machine's CPUs, not the thread count, so H=32 N=4096 runs the same items
# at 1, 4, 8 and 16 threads: phase cycles per call at each (bench/tools/s58/backward_phases.patch,
# amx family), beside the forward's time. Then issue 12's figures (vs_torch at 16 and 1 thread).
# Logs under $OUT.
cd "$(dirname "$0")/../../.."
ROOT=$PWD; T0=$(date +%s)
lscpu | grep -E "^Model:|^CPU\(s\)|^Model name" > $OUT/s59c_phases.log
(python3 setup.py build_ext --inplace -j8 > /tmp/s59c_build.log 2>&1; echo "build rc=$?") >> $OUT/s59c_phases.log &
mkdir -p /tmp/pt && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/pt/ && rm -f /tmp/pt/fa2cpu/*.so /tmp/pt/fa2cpu/_core.cpp
(cd /tmp/pt && patch -p1 < $ROOT/bench/tools/s58/backward_phases.patch > /dev/null && FA2CPU_DISABLE=avx512bf16,avx512,avx2 python3 setup.py build_ext --inplace -j8 > build.log 2>&1; echo "phases build rc=$?") >> $OUT/s59c_phases.log
wait
echo "built at $(( $(date +%s) - T0 )) s" >> $OUT/s59c_phases.log
P="timeout 60 python3 $ROOT/bench/tools/s58/phases.py"
for c in "bf16 1 32 4096 0 1" "bf16 4 32 4096 0 2" "bf16 8 32 4096 0 3" "bf16 16 32 4096 0 5" "bf16 1 4 4096 0 2"; do
  PYTHONPATH=/tmp/pt $P $c
done >> $OUT/s59c_phases.log 2>&1
echo "phases done at $(( $(date +%s) - T0 )) s" >> $OUT/s59c_phases.log
{ PYTHONPATH=$ROOT timeout 200 python3 bench/vs_torch.py --threads 16 --cases prefill --reps 3
  PYTHONPATH=$ROOT timeout 150 python3 bench/vs_torch.py --threads 1 --cases prefill --heads 8 --max-n 4096 --reps 3; } > $OUT/s59c_issue12.log 2>&1
echo "all done at $(( $(date +%s) - T0 )) s" >> $OUT/s59c_issue12.log
