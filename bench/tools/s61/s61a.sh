#!/bin/bash
# AMX test machine (session 61, first call):
#  1. the float32 cache's decode prefetch distance, 64 KB ahead (the working tree) against 32 KB
#     (HEAD d3c121f), in process (bench/ab_inproc.py, both orders), amx and avx2 families,
#     16 threads, 2 (taskset -c 0,1) and 1 (taskset -c 0); on the 2-core Zen 5 64 KB read
#     1.29-1.32x faster at 1 thread, 1.04-1.10x at 2, bf16 / int8 caches unchanged (not touched).
#  2. session 60's s60b: the float32 reduction passes DC = CC = 128 against 64, amx and avx512.
cd "$(dirname "$0")/../../.."
T0=$(date +%s); LOG=$OUT/s61a.log
lscpu | grep -E "^Model:|^CPU\(s\)|^Model name" > $LOG
build() {  # build DIR SED_DECODE SED_VEC
  rm -rf $1; mkdir -p $1; cp -r setup.py pyproject.toml fa2cpu csrc README.md $1/; rm -f $1/fa2cpu/*.so $1/fa2cpu/_core.cpp
  [ -n "$2" ] && sed -i "$2" $1/csrc/kernels/common/decode_operands.h
  [ -n "$3" ] && sed -i "$3" $1/csrc/kernels/common/vec_avx512.h
  (cd $1 && FA2CPU_DISABLE=avx512bf16 python3 setup.py build_ext --inplace -j6 > build.log 2>&1; echo "build $1 rc=$?")
}
OLD="s/kPrefetchBytes = int64_t(sizeof(T) == 4 ? 64 : 32) << 10;/kPrefetchBytes = int64_t(32) << 10;/"
DC="s/static constexpr int64_t DC = 64, CC = 64;/static constexpr int64_t DC = 128, CC = 128;/"
build /tmp/ab/base "$OLD" "" >> $LOG & build /tmp/ab/new "" "" >> $LOG & build /tmp/ab/dc128 "$OLD" "$DC" >> $LOG & wait
grep -c "kPrefetchBytes = int64_t(32) << 10" /tmp/ab/base/csrc/kernels/common/decode_operands.h /tmp/ab/new/csrc/kernels/common/decode_operands.h >> $LOG
grep -c "DC = 128, CC = 128" /tmp/ab/dc128/csrc/kernels/common/vec_avx512.h >> $LOG
echo "built at $(( $(date +%s) - T0 )) s" >> $LOG
ab() { echo "## FA2CPU_ISA=$FA2CPU_ISA $PRE $*" >> $LOG; PYTHONPATH=/tmp/ab/base timeout 100 $PRE python3 bench/ab_inproc.py "$@" 2>&1 | tail -1 >> $LOG; }
for isa in amx avx2; do
  export FA2CPU_ISA=$isa
  PRE="" ab /tmp/ab/base/fa2cpu /tmp/ab/new/fa2cpu 16 decode fp32 15
  PRE="" ab /tmp/ab/new/fa2cpu /tmp/ab/base/fa2cpu 16 decode fp32 15
  PRE="taskset -c 0,1" ab /tmp/ab/base/fa2cpu /tmp/ab/new/fa2cpu 2 decode fp32 11
  PRE="taskset -c 0,1" ab /tmp/ab/new/fa2cpu /tmp/ab/base/fa2cpu 2 decode fp32 11
  PRE="taskset -c 0" ab /tmp/ab/base/fa2cpu /tmp/ab/new/fa2cpu 1 decode fp32 7
  PRE="taskset -c 0" ab /tmp/ab/new/fa2cpu /tmp/ab/base/fa2cpu 1 decode fp32 7
done
echo "decode done at $(( $(date +%s) - T0 )) s" >> $LOG
for isa in amx avx512; do
  export FA2CPU_ISA=$isa
  PRE="" ab /tmp/ab/base/fa2cpu /tmp/ab/dc128/fa2cpu 1 8 2048 0 fp32 7
  PRE="" ab /tmp/ab/dc128/fa2cpu /tmp/ab/base/fa2cpu 1 8 2048 0 fp32 7
  PRE="" ab /tmp/ab/base/fa2cpu /tmp/ab/dc128/fa2cpu 16 32 4096 0 fp32 5
  PRE="" ab /tmp/ab/dc128/fa2cpu /tmp/ab/base/fa2cpu 16 32 4096 0 fp32 5
done
echo "all done at $(( $(date +%s) - T0 )) s" >> $LOG
