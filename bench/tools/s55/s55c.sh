#!/bin/bash
# AMX test machine (session 55, second call): bash bench/tools/s55/s55c.sh, logs under $OUT. The last
# kv heads split twice as finely where the plan deals `want` splits per head (fine_tail2.patch; s55b's
# fine_tail.patch did it for every plan and lost at H=32 N=4096, whose cap raises the splits to 4;
# run it on a clean tree: build_pair.sh ... apply builds the tree (base) and the tree + the patch (new)):
# in process against HEAD at 16 threads, a sacrificial copy first and three orders; bwd / fwd of both
# builds (scaling.py at 16 threads); issue 11's table from the new build.
cd "$(dirname "$0")/../../.."
ROOT=$PWD
T0=$(date +%s)
lscpu | grep -E "^Model:|^CPU\(s\)|L2|L3" > $OUT/s55c_machine.txt
bash bench/tools/s47/build_pair.sh $ROOT/bench/tools/s55/fine_tail2.patch s55c apply > /dev/null 2>&1
(cd /tmp/s55c_new && patch -p1 -R --dry-run < $ROOT/bench/tools/s55/fine_tail2.patch > /dev/null && echo "new has the patch") > $OUT/s55c_builds.log 2>&1
tail -qn1 $OUT/build_*.log >> $OUT/s55c_builds.log; rm -f $OUT/build_*.log $OUT/patch.log
echo "builds done at $(( $(date +%s) - T0 )) s" >> $OUT/s55c_builds.log
cp -r /tmp/s55c_base /tmp/s55c_base0
cd /tmp; M=$ROOT/bench/tools/s52/bwd_multi.py
B=/tmp/s55c_base/fa2cpu; N=/tmp/s55c_new/fa2cpu; Z=/tmp/s55c_base0/fa2cpu
ab() {
  for c in "$@"; do
    PYTHONPATH=/tmp/s55c_base timeout 60 python3 $M $c $Z $B $N
    PYTHONPATH=/tmp/s55c_base timeout 60 python3 $M $c $Z $N $B
    PYTHONPATH=/tmp/s55c_base timeout 60 python3 $M $c $Z $B $N
  done
}
ab "16 16 2048 0 bf16 21" "16 16 2048 0 fp32 9" 2>&1 | tee $OUT/s55c_fine_tail2_ab.log
for b in base new; do
  echo "== $b"
  PYTHONPATH=/tmp/s55c_$b timeout 60 python3 $ROOT/bench/tools/s55/scaling.py 16 2048 0 bf16 9 16
  PYTHONPATH=/tmp/s55c_$b timeout 60 python3 $ROOT/bench/tools/s55/scaling.py 16 2048 0 fp32 5 16
done 2>&1 | tee $OUT/s55c_bwd_fwd16.log
echo "at $(( $(date +%s) - T0 )) s" >> $OUT/s55c_bwd_fwd16.log
ab "16 16 2048 1 bf16 21" "16 32 4096 0 bf16 5" "16 8 2048 0 bf16 21" 2>&1 | tee -a $OUT/s55c_fine_tail2_ab.log
cd /tmp/s55c_new && PYTHONPATH=/tmp/s55c_new timeout 120 python3 $ROOT/bench/backward_vs_torch.py --threads 16 --heads 16 --n 2048 --dtypes fp32,bf16 --reps 5 2>&1 | tee $OUT/s55c_backward_vs_torch16.log
echo "all done at $(( $(date +%s) - T0 )) s"
