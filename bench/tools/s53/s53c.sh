#!/bin/bash
# AMX test machine: bash bench/tools/s53/s53c.sh (logs under $OUT). Sized to the device
# time left: amx-family builds only (base = this tree with bench/tools/s53/gradient.patch
# reversed, new = this tree, taper = this tree with bench/tools/s48/bwd_split_taper.patch), the
# in-process A/B at 16 threads, issue 11's backward_vs_torch at 16 threads from the new build (the
# amx family runs fp32 on its float32 products), then the phase timers if time is left.
cd "$(dirname "$0")/../../.."
ROOT=$PWD
lscpu | grep -E "Model name|^Model:|^L2|^L3|^CPU\(s\)" > $OUT/s53c_machine.txt
for d in base new taper ph; do mkdir -p /tmp/s53_$d && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/s53_$d/; done
(cd /tmp/s53_base && patch -R -p1 < $ROOT/bench/tools/s53/gradient.patch > /dev/null; echo "base patch rc=$?")
(cd /tmp/s53_taper && patch -p1 < $ROOT/bench/tools/s48/bwd_split_taper.patch > /dev/null; echo "taper patch rc=$?")
(cd /tmp/s53_ph && patch -p1 < $ROOT/bench/tools/s53/bwd_phase_timers.patch > /dev/null; echo "ph patch rc=$?")
for d in base new taper ph; do
  (cd /tmp/s53_$d && rm -f fa2cpu/*.so && FA2CPU_DISABLE=avx512bf16,avx512,avx2 python3 setup.py build_ext --inplace -j4 > /tmp/build_$d.log 2>&1; echo "build $d rc=$?") &
done
wait
cp -r /tmp/s53_base /tmp/s53_base2
cd /tmp
M=$ROOT/bench/tools/s52/bwd_multi.py
{
for c in "16 16 2048 0 bf16 9" "16 16 2048 1 bf16 9" "16 32 4096 0 bf16 3" "16 16 2048 0 fp32 5"; do
  PYTHONPATH=/tmp/s53_base timeout 100 python3 $M $c /tmp/s53_base2/fa2cpu /tmp/s53_base/fa2cpu /tmp/s53_new/fa2cpu /tmp/s53_taper/fa2cpu
  PYTHONPATH=/tmp/s53_base timeout 100 python3 $M $c /tmp/s53_base2/fa2cpu /tmp/s53_taper/fa2cpu /tmp/s53_new/fa2cpu /tmp/s53_base/fa2cpu
done
} 2>&1 | tee $OUT/s53c_ab.log
cd /tmp/s53_new && for hn in "16 2048" "32 4096"; do set -- $hn
  PYTHONPATH=/tmp/s53_new timeout 120 python3 $ROOT/bench/backward_vs_torch.py --threads 16 --heads $1 --n $2 --dtypes fp32,bf16 --reps 3
done 2>&1 | tee $OUT/s53c_backward_vs_torch16.log
cd /tmp && for c in "16 2048 0 10 bf16" "32 4096 0 3 bf16"; do
  echo "## 16 threads: $c"; OMP_NUM_THREADS=16 PYTHONPATH=/tmp/s53_ph timeout 60 python3 $ROOT/bench/tools/s48/bwd_only.py $c
done 2>&1 | tee $OUT/s53c_phases.log
