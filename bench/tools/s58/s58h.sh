#!/bin/bash
# AMX test machine (session 58, last minutes): amx-only builds base0 (sacrificial), base (HEAD),
# g96 (AMX backward row groups of 96 rows, one block per update; s58c.sh measured 384 rows
# 0.87-0.91x); bf16 full at 16 threads in process. Logs under $OUT.
cd "$(dirname "$0")/../../.."
ROOT=$PWD; T0=$(date +%s)
build() {  # build NAME CFLAGS
  mkdir -p /tmp/v/$1 && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/v/$1/ && rm -f /tmp/v/$1/fa2cpu/*.so /tmp/v/$1/fa2cpu/_core.cpp
  (cd /tmp/v/$1 && FA2CPU_DISABLE=avx512bf16,avx512,avx2 FA2CPU_EXTRA_CFLAGS="$2" python3 setup.py build_ext --inplace -j5 > build.log 2>&1; echo "build $1 rc=$?")
}
{ build base0 "" & build base "" & build g96 "-DFA2CPU_AMX_BWD_GROUP_ROWS=96 -DFA2CPU_AMX_BWD_UPDATE_BLOCKS=1" & wait; } > $OUT/s58h_ab.log 2>&1
echo "built at $(( $(date +%s) - T0 )) s" >> $OUT/s58h_ab.log
cd /tmp; M=$ROOT/bench/tools/s52/bwd_multi.py; V=/tmp/v
{ PYTHONPATH=$V/base timeout 30 python3 $M 16 32 4096 0 bf16 5 $V/base0/fa2cpu $V/base/fa2cpu $V/g96/fa2cpu
  PYTHONPATH=$V/base timeout 30 python3 $M 16 32 4096 0 bf16 5 $V/base0/fa2cpu $V/g96/fa2cpu $V/base/fa2cpu
  PYTHONPATH=$V/base timeout 20 python3 $M 16 16 2048 0 bf16 9 $V/base0/fa2cpu $V/base/fa2cpu $V/g96/fa2cpu; } >> $OUT/s58h_ab.log 2>&1
echo "all done at $(( $(date +%s) - T0 )) s" >> $OUT/s58h_ab.log
