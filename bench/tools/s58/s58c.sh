#!/bin/bash
# AMX test machine (session 58, short form of s58b.sh for little device time left): HEAD's
# backward / varlen / torch tests on every family; amx-only builds base0 (sacrificial), base
# (HEAD), g384 (AMX backward row groups of 384 rows, dV / dK updated once per 4 blocks); bf16
# H=32 N=4096 and H=16 N=2048 full at 16 threads in process, three orders. Logs under $OUT.
cd "$(dirname "$0")/../../.."
ROOT=$PWD
T0=$(date +%s)
lscpu | grep -E "^Model:|^CPU\(s\)|^Model name" > $OUT/s58c_machine.txt
build() {  # build NAME CFLAGS
  mkdir -p /tmp/v/$1 && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/v/$1/ && rm -f /tmp/v/$1/fa2cpu/*.so /tmp/v/$1/fa2cpu/_core.cpp
  (cd /tmp/v/$1 && FA2CPU_DISABLE=avx512bf16,avx512,avx2 FA2CPU_EXTRA_CFLAGS="$2" python3 setup.py build_ext --inplace -j3 > build.log 2>&1; echo "build $1 rc=$?")
}
(python3 setup.py build_ext --inplace -j8 > /tmp/s58c_build.log 2>&1; echo "build rc=$?") >> $OUT/s58c_machine.txt &
build base0 "" >> $OUT/s58c_machine.txt & build base "" >> $OUT/s58c_machine.txt &
build g384 "-DFA2CPU_AMX_BWD_GROUP_ROWS=384 -DFA2CPU_AMX_BWD_UPDATE_BLOCKS=4" >> $OUT/s58c_machine.txt &
wait
echo "built at $(( $(date +%s) - T0 )) s" >> $OUT/s58c_machine.txt
PYTHONPATH=$PWD timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_backward.py tests/test_varlen.py tests/test_torch.py tests/test_torch_sdpa.py 2>&1 | tail -n 4 > $OUT/s58c_tests.log
echo "tests done at $(( $(date +%s) - T0 )) s" >> $OUT/s58c_tests.log
cd /tmp; M=$ROOT/bench/tools/s52/bwd_multi.py; V=/tmp/v
for c in "16 32 4096 0 bf16 5" "16 16 2048 0 bf16 9"; do
  PYTHONPATH=$V/base timeout 50 python3 $M $c $V/base0/fa2cpu $V/base/fa2cpu $V/g384/fa2cpu
  PYTHONPATH=$V/base timeout 50 python3 $M $c $V/base0/fa2cpu $V/g384/fa2cpu $V/base/fa2cpu
  PYTHONPATH=$V/base timeout 50 python3 $M $c $V/base0/fa2cpu $V/base/fa2cpu $V/g384/fa2cpu
done > $OUT/s58c_ab.log 2>&1
echo "all done at $(( $(date +%s) - T0 )) s" >> $OUT/s58c_ab.log
