#!/bin/bash
# AMX test machine (session 55): bash bench/tools/s55/s55b.sh, logs under $OUT. Where the 16-thread
# backward's time goes after the dq chunks (20de32c): (1) the idle probe (bwd_idle_probe.patch:
# items' busy share, threads' last item end, chunk wait / sums) at 16 threads; (2) forward and
# backward scaling 1 -> 16 threads of one build (scaling.py); (3) issue 11's table at 16 threads;
# (4) FA2CPU_BWD_ITEMS_PER_CPU 3 / 6 against 4, and the last kv heads split twice as finely
# (fine_tail.patch, FA2CPU_BWD_FINE_TAIL=1), in process, both orders (as s54/s55a.sh).
cd "$(dirname "$0")/../../.."
ROOT=$PWD
T0=$(date +%s)
lscpu | grep -E "^Model:|^CPU\(s\)|L2|L3|MHz" > $OUT/s55b_machine.txt
for d in i4 i3 i6 probe tail; do mkdir -p /tmp/s55_$d && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/s55_$d/; done
(cd /tmp/s55_probe && patch -p1 < $ROOT/bench/tools/s55/bwd_idle_probe.patch > /dev/null)
(cd /tmp/s55_tail && patch -p1 < $ROOT/bench/tools/s55/fine_tail.patch > /dev/null)
for d in i4 i3 i6 probe tail; do
  n=${d#i}; x=; [ $d = probe ] && n=4; [ $d = tail ] && n=4 && x=-DFA2CPU_BWD_FINE_TAIL=1
  (cd /tmp/s55_$d && FA2CPU_DISABLE=avx512bf16,avx512,avx2 FA2CPU_EXTRA_CFLAGS="-DFA2CPU_BWD_ITEMS_PER_CPU=$n $x" python3 setup.py build_ext --inplace -j4 > /tmp/build_$d.log 2>&1; echo "build $d rc=$?") &
done 2>&1 | tee $OUT/s55b_builds.log
wait
echo "builds done at $(( $(date +%s) - T0 )) s" | tee -a $OUT/s55b_builds.log
cp -r /tmp/s55_i4 /tmp/s55_i4b
cd /tmp
{
for c in "16 2048 0 6 bf16" "16 2048 1 6 bf16" "16 2048 0 3 fp32" "32 4096 0 3 bf16"; do
  OMP_NUM_THREADS=16 PYTHONPATH=/tmp/s55_probe timeout 60 python3 $ROOT/bench/tools/s48/bwd_only.py $c
done
echo "probe done at $(( $(date +%s) - T0 )) s"
} 2>&1 | tee $OUT/s55b_idle_probe.log
{
PYTHONPATH=/tmp/s55_i4 timeout 90 python3 $ROOT/bench/tools/s55/scaling.py 16 2048 0 bf16 5 1,2,4,8,16
PYTHONPATH=/tmp/s55_i4 timeout 60 python3 $ROOT/bench/tools/s55/scaling.py 16 2048 0 fp32 3 1,16
echo "scaling done at $(( $(date +%s) - T0 )) s"
} 2>&1 | tee $OUT/s55b_scaling.log
cd /tmp/s55_i4 && for hn in "16 2048" "32 4096"; do set -- $hn
  PYTHONPATH=/tmp/s55_i4 timeout 90 python3 $ROOT/bench/backward_vs_torch.py --threads 16 --heads $1 --n $2 --dtypes fp32,bf16 --reps 3
done 2>&1 | tee $OUT/s55b_backward_vs_torch16.log
cd /tmp; M=$ROOT/bench/tools/s52/bwd_multi.py
for c in "16 16 2048 0 bf16 11" "16 16 2048 1 bf16 11" "16 16 2048 0 fp32 5" "16 32 4096 0 bf16 3"; do
  [ $(( $(date +%s) - T0 )) -gt 540 ] && { echo "out of time"; break; }
  PYTHONPATH=/tmp/s55_i4 timeout 60 python3 $M $c /tmp/s55_i4b/fa2cpu /tmp/s55_i4/fa2cpu /tmp/s55_tail/fa2cpu /tmp/s55_i3/fa2cpu /tmp/s55_i6/fa2cpu
  PYTHONPATH=/tmp/s55_i4 timeout 60 python3 $M $c /tmp/s55_i4b/fa2cpu /tmp/s55_i6/fa2cpu /tmp/s55_i3/fa2cpu /tmp/s55_tail/fa2cpu /tmp/s55_i4/fa2cpu
done 2>&1 | tee $OUT/s55b_items_per_cpu_ab.log
echo "all done at $(( $(date +%s) - T0 )) s"
