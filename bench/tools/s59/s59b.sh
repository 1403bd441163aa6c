#!/bin/bash
# AMX test machine (session 59, second call). s59a (model 207) found the amx bf16 backward's items
# 1.64x slower per unit of work at 16 threads (H=32 N=4096: 1024-key items of ~3 MB, above a
# core's 2 MB L2) than at 1 thread (H=4: 512-key items), where the forward lost 1.27x. Here: amx-only
# builds base0 (sacrificial), base (HEAD), c24 (bf16 budget 24 MB: 1.5 MB items at 16 CPUs, 8
# splits at H=32 N=4096), c96 (96 MB: 6 MB items, 2 splits); bf16 backward in process at 16
# threads, two orders. Then issue 13's decode, three runs each at 16 and 2 threads. Logs under $OUT.
cd "$(dirname "$0")/../../.."
ROOT=$PWD; T0=$(date +%s)
lscpu | grep -E "^Model:|^CPU\(s\)|^Model name" > $OUT/s59b_ab.log
build() {  # build NAME CFLAGS
  mkdir -p /tmp/v/$1 && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/v/$1/ && rm -f /tmp/v/$1/fa2cpu/*.so /tmp/v/$1/fa2cpu/_core.cpp
  (cd /tmp/v/$1 && FA2CPU_DISABLE=avx512bf16,avx512,avx2 FA2CPU_EXTRA_CFLAGS="$2" python3 setup.py build_ext --inplace -j3 > build.log 2>&1; echo "build $1 rc=$?")
}
(python3 setup.py build_ext --inplace -j4 > /tmp/s59b_build.log 2>&1; echo "build rc=$?") >> $OUT/s59b_ab.log &
{ build base0 "" & build base "" & build c24 "-DFA2CPU_BWD_CACHE_BUDGET_MB=24" & build c96 "-DFA2CPU_BWD_CACHE_BUDGET_MB=96" & wait; } >> $OUT/s59b_ab.log 2>&1
wait
echo "built at $(( $(date +%s) - T0 )) s" >> $OUT/s59b_ab.log
cd /tmp; M=$ROOT/bench/tools/s52/bwd_multi.py; V=/tmp/v
{ for c in "16 32 4096 0 bf16 5" "16 16 2048 0 bf16 9" "16 32 4096 1 bf16 5"; do
    PYTHONPATH=$V/base timeout 60 python3 $M $c $V/base0/fa2cpu $V/base/fa2cpu $V/c24/fa2cpu $V/c96/fa2cpu
    PYTHONPATH=$V/base timeout 60 python3 $M $c $V/base0/fa2cpu $V/c96/fa2cpu $V/c24/fa2cpu $V/base/fa2cpu
  done; } >> $OUT/s59b_ab.log 2>&1
echo "ab done at $(( $(date +%s) - T0 )) s" >> $OUT/s59b_ab.log
cd $ROOT; K="timeout 60 python3 bench/kv_quant.py --caches bf16,int8"
{ for i in 1 2 3; do PYTHONPATH=$ROOT $K --threads 16 --reps 9; PYTHONPATH=$ROOT taskset -c 0,1 $K --threads 2 --reps 7; done; } > $OUT/s59b_kv.log 2>&1
echo "all done at $(( $(date +%s) - T0 )) s" >> $OUT/s59b_kv.log
