#!/bin/bash
# AMX test machine (session 58, first call): bash bench/tools/s58/s58a.sh, logs under $OUT.
# The backward / varlen / torch tests on every family at HEAD (late accumulation included, never run
# there yet); the float32 backward in process against the tree without late_acc.patch (16 threads,
# H=16 N=2048, sacrificial copy first, three orders); issue 11's table at 16 threads, H=32 N=4096.
cd "$(dirname "$0")/../../.."
ROOT=$PWD
T0=$(date +%s)
lscpu | grep -E "^Model:|^CPU\(s\)" > $OUT/s58a_machine.txt
python3 setup.py build_ext --inplace -j16 > /tmp/s58a_build.log 2>&1; echo "build rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/s58a_machine.txt
PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_backward.py tests/test_varlen.py tests/test_torch.py tests/test_torch_sdpa.py 2>&1 | tail -n 4 > $OUT/s58a_tests.log
echo "tests done at $(( $(date +%s) - T0 )) s" >> $OUT/s58a_tests.log
bash bench/tools/s47/build_pair.sh $ROOT/bench/tools/s57/late_acc.patch s58a > /dev/null 2>&1
tail -qn1 $OUT/build_*.log >> $OUT/s58a_machine.txt; rm -f $OUT/build_*.log $OUT/patch.log
cp -r /tmp/s58a_base /tmp/s58a_base0
cd /tmp; M=$ROOT/bench/tools/s52/bwd_multi.py
B=/tmp/s58a_base/fa2cpu; N=/tmp/s58a_new/fa2cpu; Z=/tmp/s58a_base0/fa2cpu
c="16 16 2048 0 fp32 9"
{ PYTHONPATH=/tmp/s58a_base timeout 40 python3 $M $c $Z $B $N
  PYTHONPATH=/tmp/s58a_base timeout 40 python3 $M $c $Z $N $B
  PYTHONPATH=/tmp/s58a_base timeout 40 python3 $M $c $Z $B $N; } > $OUT/s58a_f32_ab.log 2>&1
echo "ab done at $(( $(date +%s) - T0 )) s" >> $OUT/s58a_f32_ab.log
cd $ROOT
PYTHONPATH=$PWD timeout 200 python3 bench/backward_vs_torch.py --threads 16 --heads 32 --n 4096 --dtypes fp32,bf16 --reps 3 > $OUT/s58a_bwd16_h32.log 2>&1
echo "all done at $(( $(date +%s) - T0 )) s" >> $OUT/s58a_bwd16_h32.log
