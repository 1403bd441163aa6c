#!/bin/bash
# AMX test machine (device tool), from the repo root: bash bench/tools/s46/s46.sh (logs under $OUT).
# Session 46: (1) thread scaling of the forward and backward, fp32 and bf16 (scaling.py), to see
# whether issue 11's fp32 gap at 16 threads is per-core or parallel; (2) the int8 / fp8 decode
# without the near (L1) code-line prefetch of session 40 (decode_no_near_prefetch.patch), in
# process against the base (decode_multi.py); (3) torch's backward at 1 thread beside ours.
set -x
cd "$(dirname "$0")/../../.."
ROOT=$PWD
HERE=$ROOT/bench/tools/s46
lscpu | grep -E "Model name|^CPU\(s\)|^Model:" > $OUT/cpu.txt
for v in base nopf0; do
  mkdir -p /tmp/v_$v && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/v_$v/
  [ $v = nopf0 ] && (cd /tmp/v_nopf0 && patch -p1 < $HERE/decode_no_near_prefetch.patch)
  F=""; [ $v = nopf0 ] && F="-DNOPF0"
  (cd /tmp/v_$v && FA2CPU_DISABLE=avx512bf16,avx512,avx2 FA2CPU_EXTRA_CFLAGS="$F" python3 setup.py build_ext --inplace -j8 > $OUT/build_$v.log 2>&1; echo "build $v rc=$?" >> $OUT/build_$v.log) &
done
wait
tail -n1 $OUT/build_*.log
export PYTHONPATH=/tmp/v_base
for t in 1 2 4 8 16; do taskset -c 0-$((t-1)) python3 $HERE/scaling.py $t fp32 bf16; done 2>&1 | tee $OUT/scaling.log
for round in 1 2; do
  python3 $HERE/decode_multi.py 16 int8 11 /tmp/v_base/fa2cpu /tmp/v_nopf0/fa2cpu
  taskset -c 0,1 python3 $HERE/decode_multi.py 2 int8 7 /tmp/v_base/fa2cpu /tmp/v_nopf0/fa2cpu
  python3 $HERE/decode_multi.py 16 fp8 7 /tmp/v_base/fa2cpu /tmp/v_nopf0/fa2cpu
done 2>&1 | tee $OUT/decode_ab.log
timeout 200 taskset -c 0 python3 bench/backward_vs_torch.py --threads 1 --dtypes fp32,bf16 --causal 0 --reps 3 2>&1 | tee $OUT/bwd_torch_1thr.log
timeout 120 python3 bench/backward_vs_torch.py --threads 16 --dtypes fp32,bf16 --causal 0 --reps 5 2>&1 | tee $OUT/bwd_torch_16thr.log
