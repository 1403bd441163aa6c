#!/bin/bash
# AMX test machine, prepared in session 54 for the next: bash bench/tools/s54/s55a.sh (logs under
# $OUT). With the dq sums overlapped and the partials streamed (20de32c), is 4 items per CPU still
# the best plan at 16 threads? amx family builds of this tree with FA2CPU_BWD_ITEMS_PER_CPU 2 / 3 / 6
# against the default 4, in process at 16 threads, both orders; then issue 11's backward_vs_torch
# at 16 threads from the default build.
cd "$(dirname "$0")/../../.."
ROOT=$PWD
lscpu | grep -E "^Model:|^CPU\(s\)|L2|L3" > $OUT/s55a_machine.txt
for d in i4 i2 i3 i6; do mkdir -p /tmp/s55_$d && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/s55_$d/; done
for d in i4 i2 i3 i6; do
  (cd /tmp/s55_$d && rm -f fa2cpu/*.so && FA2CPU_DISABLE=avx512bf16,avx512,avx2 FA2CPU_EXTRA_CFLAGS="-DFA2CPU_BWD_ITEMS_PER_CPU=${d#i}" python3 setup.py build_ext --inplace -j4 > /tmp/build_$d.log 2>&1; echo "build $d rc=$?") &
done
wait
cp -r /tmp/s55_i4 /tmp/s55_i4b
cd /tmp; M=$ROOT/bench/tools/s52/bwd_multi.py
for c in "16 16 2048 0 bf16 11" "16 16 2048 1 bf16 11" "16 16 2048 0 fp32 5" "16 32 4096 0 bf16 3" "16 32 4096 0 fp32 3"; do
  PYTHONPATH=/tmp/s55_i4 timeout 100 python3 $M $c /tmp/s55_i4b/fa2cpu /tmp/s55_i4/fa2cpu /tmp/s55_i2/fa2cpu /tmp/s55_i3/fa2cpu /tmp/s55_i6/fa2cpu
  PYTHONPATH=/tmp/s55_i4 timeout 100 python3 $M $c /tmp/s55_i4b/fa2cpu /tmp/s55_i6/fa2cpu /tmp/s55_i3/fa2cpu /tmp/s55_i2/fa2cpu /tmp/s55_i4/fa2cpu
done 2>&1 | tee $OUT/s55a_items_per_cpu_ab.log
cd /tmp/s55_i4 && for hn in "16 2048" "32 4096"; do set -- $hn
  PYTHONPATH=/tmp/s55_i4 timeout 100 python3 $ROOT/bench/backward_vs_torch.py --threads 16 --heads $1 --n $2 --dtypes fp32,bf16 --reps 3
done 2>&1 | tee $OUT/s55a_backward_vs_torch16.log
