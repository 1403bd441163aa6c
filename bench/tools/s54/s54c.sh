#!/bin/bash
# AMX test machine: bash bench/tools/s54/s54c.sh (logs under $OUT). Second A/B of the dq sums
# queued behind the items (this tree = new, dq_chunks.patch reversed = base), and new with the
# split items' float32 dq partial rows streamed (dq_partials_nt.patch = nt), amx family, in
# process at 16 threads, both orders (a sacrificial copy of base first).
cd "$(dirname "$0")/../../.."
ROOT=$PWD
lscpu | grep -E "^Model:|^CPU\(s\)|L2|L3" > $OUT/s54c_machine.txt
for d in base new nt; do mkdir -p /tmp/s54c_$d && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/s54c_$d/; done
(cd /tmp/s54c_base && patch -R -p1 < $ROOT/bench/tools/s54/dq_chunks.patch > /dev/null; echo "patch base rc=$?")
(cd /tmp/s54c_nt && patch -p1 < $ROOT/bench/tools/s54/dq_partials_nt.patch > /dev/null; echo "patch nt rc=$?")
for d in base new nt; do
  (cd /tmp/s54c_$d && rm -f fa2cpu/*.so && FA2CPU_DISABLE=avx512bf16,avx512,avx2 python3 setup.py build_ext --inplace -j6 > /tmp/build_$d.log 2>&1; echo "build $d rc=$?") &
done
wait
cp -r /tmp/s54c_base /tmp/s54c_base2
cd /tmp; M=$ROOT/bench/tools/s52/bwd_multi.py
for c in "16 16 2048 0 bf16 15" "16 16 2048 1 bf16 15" "16 16 2048 0 fp32 7" "16 32 4096 0 bf16 5" "16 32 4096 0 fp32 3"; do
  PYTHONPATH=/tmp/s54c_base timeout 80 python3 $M $c /tmp/s54c_base2/fa2cpu /tmp/s54c_base/fa2cpu /tmp/s54c_new/fa2cpu /tmp/s54c_nt/fa2cpu
  PYTHONPATH=/tmp/s54c_base timeout 80 python3 $M $c /tmp/s54c_base2/fa2cpu /tmp/s54c_nt/fa2cpu /tmp/s54c_new/fa2cpu /tmp/s54c_base/fa2cpu
done 2>&1 | tee $OUT/s54c_ab.log
