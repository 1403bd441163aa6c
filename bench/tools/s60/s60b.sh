#!/bin/bash
# AMX test machine (session 60, second call): the float32 products' reduction passes, DC = CC = 64
# (HEAD) against 128 (one pass at D = 128), in process (bench/ab_inproc.py, both orders), amx
# (V512x46) and avx512 (V512) families, 1 and 16 threads. On a 2-core Ice Lake-SP 128 read
# 1.02-1.04x faster; session 26 had measured the passes faster on a Sapphire-Rapids-class Xeon.
cd "$(dirname "$0")/../../.."
ROOT=$PWD; T0=$(date +%s); LOG=$OUT/s60b_dc128.log
lscpu | grep -E "^Model:|^CPU\(s\)|^Model name" > $LOG
build() {  # build DIR [sed expression on vec_avx512.h]
  rm -rf $1; mkdir -p $1; cp -r setup.py pyproject.toml fa2cpu csrc README.md $1/; rm -f $1/fa2cpu/*.so $1/fa2cpu/_core.cpp
  [ -n "$2" ] && sed -i "$2" $1/csrc/kernels/common/vec_avx512.h
  (cd $1 && FA2CPU_DISABLE=avx512bf16,avx2 python3 setup.py build_ext --inplace -j8 > build.log 2>&1; echo "build $1 rc=$?")
}
build /tmp/ab/base "" >> $LOG & build /tmp/ab/dc128 "s/static constexpr int64_t DC = 64, CC = 64;/static constexpr int64_t DC = 128, CC = 128;/" >> $LOG & wait
grep -c "DC = 128, CC = 128" /tmp/ab/dc128/csrc/kernels/common/vec_avx512.h >> $LOG
echo "built at $(( $(date +%s) - T0 )) s" >> $LOG
ab() { echo "## FA2CPU_ISA=$FA2CPU_ISA $*" >> $LOG; PYTHONPATH=/tmp/ab/base timeout 100 python3 bench/ab_inproc.py "$@" 2>&1 | tail -1 >> $LOG; }
for isa in amx avx512; do
  export FA2CPU_ISA=$isa
  ab /tmp/ab/base/fa2cpu /tmp/ab/dc128/fa2cpu 1 8 2048 0 fp32 7
  ab /tmp/ab/dc128/fa2cpu /tmp/ab/base/fa2cpu 1 8 2048 0 fp32 7
  ab /tmp/ab/base/fa2cpu /tmp/ab/dc128/fa2cpu 16 32 4096 0 fp32 5
  ab /tmp/ab/dc128/fa2cpu /tmp/ab/base/fa2cpu 16 32 4096 0 fp32 5
  ab /tmp/ab/base/fa2cpu /tmp/ab/dc128/fa2cpu 16 32 4096 1 fp32 5
done
echo "all done at $(( $(date +%s) - T0 )) s" >> $LOG
