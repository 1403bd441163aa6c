#!/bin/bash
# AMX test machine: bash bench/tools/s53/s53i.sh (logs under $OUT). The split taper kept within
# the equal plan's split count (bench/tools/s53/bwd_split_taper_within.patch) against this tree,
# amx family, in process at 16 threads (a sacrificial copy of base first, both orders).
cd "$(dirname "$0")/../../.."
ROOT=$PWD
lscpu | grep -E "^Model:" > $OUT/s53i_machine.txt
for d in base tw; do mkdir -p /tmp/s53i_$d && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/s53i_$d/; done
(cd /tmp/s53i_tw && patch -p1 < $ROOT/bench/tools/s53/bwd_split_taper_within.patch > /dev/null; echo "patch rc=$?")
for d in base tw; do
  (cd /tmp/s53i_$d && rm -f fa2cpu/*.so && FA2CPU_DISABLE=avx512bf16,avx512,avx2 python3 setup.py build_ext --inplace -j8 > /tmp/build_$d.log 2>&1; echo "build $d rc=$?") &
done
wait
cp -r /tmp/s53i_base /tmp/s53i_base2
cd /tmp; M=$ROOT/bench/tools/s52/bwd_multi.py
for c in "16 16 2048 0 fp32 7" "16 16 2048 0 bf16 11" "16 16 2048 1 bf16 11" "16 32 4096 0 bf16 3"; do
  PYTHONPATH=/tmp/s53i_base timeout 60 python3 $M $c /tmp/s53i_base2/fa2cpu /tmp/s53i_base/fa2cpu /tmp/s53i_tw/fa2cpu
  PYTHONPATH=/tmp/s53i_base timeout 60 python3 $M $c /tmp/s53i_base2/fa2cpu /tmp/s53i_tw/fa2cpu /tmp/s53i_base/fa2cpu
done 2>&1 | tee $OUT/s53i_taper_within_ab.log
