#!/bin/bash
# AMX test machine (prepared in session 58 for the next lease): where the amx backward's cycles go
# at 1 and 16 threads (issue 11: bf16 bwd / fwd 2.82 at H=32 N=4096 full, 16 threads, and ~2.8 at
# 1 thread in session 55, where the 2-core Xeon VM read 2.33-2.42). Builds this tree with
# bench/tools/s58/backward_phases.patch (amx family only) and runs bench/tools/s58/phases.py.
# bash bench/tools/s58/amx_phases.sh; logs under $OUT.
cd "$(dirname "$0")/../../.."
ROOT=$PWD; T0=$(date +%s)
lscpu | grep -E "^Model:|^CPU\(s\)|^Model name" > $OUT/amx_phases.log
mkdir -p /tmp/pt && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/pt/ && rm -f /tmp/pt/fa2cpu/*.so /tmp/pt/fa2cpu/_core.cpp
(cd /tmp/pt && patch -p1 < $ROOT/bench/tools/s58/backward_phases.patch > /dev/null && FA2CPU_DISABLE=avx512bf16,avx512,avx2 python3 setup.py build_ext --inplace -j16 > build.log 2>&1; echo "build rc=$? at $(( $(date +%s) - T0 )) s") >> $OUT/amx_phases.log
P="timeout 60 python3 $ROOT/bench/tools/s58/phases.py"
for c in "bf16 16 32 4096 0 5" "bf16 1 4 4096 0 3" "bf16 16 16 2048 0 9" "bf16 1 2 2048 0 5" "fp32 16 32 4096 0 3" "fp32 1 2 4096 0 3"; do
  PYTHONPATH=/tmp/pt $P $c
done >> $OUT/amx_phases.log 2>&1
echo "all done at $(( $(date +%s) - T0 )) s" >> $OUT/amx_phases.log
