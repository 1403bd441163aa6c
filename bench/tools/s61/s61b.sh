#!/bin/bash
# AMX test machine (session 61, second call): the amx bf16 backward's row block RB (backward_amx.h),
# 96 (HEAD) against 32 and 64 with the dV / dK reduction kept at 192 rows (FA2CPU_AMX_BWD_UPDATE_BLOCKS
# 6 / 3). At RB = 32 a row block's float32 S and dP (128 keys x 32 rows, 16 KB each) stay in L1
# between the two score products and the softmax gradient that reads them; at 96 they are 48 KB each.
# Same tile operations in number; only where S / dP and the K / V row tiles live changes.
# 1. in-process A/Bs (bench/ab_inproc.py T backward H N CAUSAL bf16 REPS) at 16 threads and 1
# (taskset); their max|diff| against HEAD is 0 if the blocking keeps every reduction order;
# 2. FA2CPU_ISA=amx tests/test_backward.py on the RB = 32 build.
cd "$(dirname "$0")/../../.."
T0=$(date +%s); LOG=$OUT/s61b.log
lscpu | grep -E "^Model:|^CPU\(s\)|^Model name" > $LOG
build() {  # build DIR EXTRA_CFLAGS
  rm -rf $1; mkdir -p $1; cp -r setup.py pyproject.toml fa2cpu csrc README.md tests $1/; rm -f $1/fa2cpu/*.so $1/fa2cpu/_core.cpp
  (cd $1 && FA2CPU_EXTRA_CFLAGS="$2" FA2CPU_DISABLE=avx512bf16,avx2 python3 setup.py build_ext --inplace -j8 > build.log 2>&1; echo "build $1 rc=$?")
}
build /tmp/ab/base "" >> $LOG &
build /tmp/ab/rb32 "-DFA2CPU_AMX_BWD_RB=32 -DFA2CPU_AMX_BWD_UPDATE_BLOCKS=6" >> $LOG &
# (rb64, -DFA2CPU_AMX_BWD_RB=64 -DFA2CPU_AMX_BWD_UPDATE_BLOCKS=3, left out: device time)
wait
grep -c "FA2CPU_AMX_BWD_RB=32" /tmp/ab/rb32/build.log >> $LOG
echo "built at $(( $(date +%s) - T0 )) s" >> $LOG
XD=$(python3 -c "import xdist" 2>/dev/null && echo "-n 16" || echo "-k bf16")
ab() { echo "## $PRE $*" >> $LOG; PYTHONPATH=/tmp/ab/base timeout 90 $PRE python3 bench/ab_inproc.py "$@" 2>&1 | tail -1 >> $LOG; }
for v in rb32; do
  PRE="" ab /tmp/ab/base/fa2cpu /tmp/ab/$v/fa2cpu 16 backward 32 4096 0 bf16 5
  PRE="" ab /tmp/ab/$v/fa2cpu /tmp/ab/base/fa2cpu 16 backward 32 4096 0 bf16 5
  PRE="" ab /tmp/ab/base/fa2cpu /tmp/ab/$v/fa2cpu 16 backward 32 4096 1 bf16 5
  PRE="taskset -c 0" ab /tmp/ab/base/fa2cpu /tmp/ab/$v/fa2cpu 1 backward 4 4096 0 bf16 3
  # (second 1-thread order left out: device time)
  echo "## tests $v" >> $LOG
  (cd /tmp/ab/$v && FA2CPU_ISA=amx timeout 100 python3 -m pytest -q -x $XD -p no:cacheprovider tests/test_backward.py 2>&1 | tail -3) >> $LOG
  echo "tests $v done at $(( $(date +%s) - T0 )) s" >> $LOG
  echo "$v done at $(( $(date +%s) - T0 )) s" >> $LOG
done
