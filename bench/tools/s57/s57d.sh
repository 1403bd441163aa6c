#!/bin/bash
# AMX test machine (session 57, short form of s57c.sh for the last minutes of device time): the
# backward / varlen / torch tests on every family with late_acc.patch, then the float32 backward in
# process against the tree without it at 16 threads (H=16 N=2048), three orders. Logs under $OUT.
cd "$(dirname "$0")/../../.."
ROOT=$PWD
T0=$(date +%s)
lscpu | grep -E "^Model:|^CPU\(s\)" > $OUT/s57d_machine.txt
python3 setup.py build_ext --inplace -j16 > /tmp/s57d_build.log 2>&1; echo "build rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/s57d_machine.txt
PYTHONPATH=$PWD timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_backward.py tests/test_varlen.py tests/test_torch.py tests/test_torch_sdpa.py 2>&1 | tail -n 4 > $OUT/s57d_tests.log
echo "tests done at $(( $(date +%s) - T0 )) s" >> $OUT/s57d_tests.log
bash bench/tools/s47/build_pair.sh $ROOT/bench/tools/s57/late_acc.patch s57d > /dev/null 2>&1
cp -r /tmp/s57d_base /tmp/s57d_base0
cd /tmp; M=$ROOT/bench/tools/s52/bwd_multi.py
B=/tmp/s57d_base/fa2cpu; N=/tmp/s57d_new/fa2cpu; Z=/tmp/s57d_base0/fa2cpu
c="16 16 2048 0 fp32 9"
{ PYTHONPATH=/tmp/s57d_base timeout 40 python3 $M $c $Z $B $N
  PYTHONPATH=/tmp/s57d_base timeout 40 python3 $M $c $Z $N $B
  PYTHONPATH=/tmp/s57d_base timeout 40 python3 $M $c $Z $B $N; } 2>&1 | tee $OUT/s57d_f32_ab.log
echo "all done at $(( $(date +%s) - T0 )) s" | tee -a $OUT/s57d_f32_ab.log
