#!/bin/bash
# AMX test machine (session 56): bash bench/tools/s56/s56b.sh, logs under $OUT. The tree as
# committed (fine schedule tail on >= 16 CPUs): the backward / varlen / torch tests on every family
# with this machine's 16-CPU plans, then issue 11's tables at 16 threads (H=32 N=4096 and H=16 N=2048).
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
lscpu | grep -E "^Model:|^CPU\(s\)|L2|L3" > $OUT/s56b_machine.txt
python3 setup.py build_ext --inplace -j16 > $OUT/s56b_build.log 2>&1; echo "build rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/s56b_machine.txt
python3 -c "import fa2cpu; print(fa2cpu.available_isas())" >> $OUT/s56b_machine.txt 2>&1
tail -n 3 $OUT/s56b_build.log > $OUT/s56b_build_tail.log; rm $OUT/s56b_build.log
PYTHONPATH=$PWD timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_backward.py tests/test_varlen.py tests/test_torch.py tests/test_torch_sdpa.py 2>&1 | tail -n 15 > $OUT/s56b_tests.log
echo "tests done at $(( $(date +%s) - T0 )) s" >> $OUT/s56b_tests.log
PYTHONPATH=$PWD timeout 200 python3 bench/backward_vs_torch.py --threads 16 --heads 32 --n 4096 --dtypes fp32,bf16 --reps 3 2>&1 | tee $OUT/s56b_backward_vs_torch16_h32.log
PYTHONPATH=$PWD timeout 120 python3 bench/backward_vs_torch.py --threads 16 --heads 16 --n 2048 --dtypes fp32,bf16 --reps 5 2>&1 | tee $OUT/s56b_backward_vs_torch16_h16.log
echo "all done at $(( $(date +%s) - T0 )) s"
