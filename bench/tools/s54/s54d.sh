#!/bin/bash
# AMX test machine: bash bench/tools/s54/s54d.sh (logs under $OUT). Issue 11's backward_vs_torch
# at 16 threads from this tree (20de32c: dq chunks + streamed partials), amx family.
cd "$(dirname "$0")/../../.."
ROOT=$PWD
lscpu | grep -E "^Model:|^CPU\(s\)|L2|L3" > $OUT/s54d_machine.txt
mkdir -p /tmp/s54d && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/s54d/
(cd /tmp/s54d && rm -f fa2cpu/*.so && FA2CPU_DISABLE=avx512bf16,avx512,avx2 python3 setup.py build_ext --inplace -j16 > /tmp/build_d.log 2>&1; echo "build rc=$?")
cd /tmp/s54d && for hn in "16 2048" "32 4096"; do set -- $hn
  PYTHONPATH=/tmp/s54d timeout 90 python3 $ROOT/bench/backward_vs_torch.py --threads 16 --heads $1 --n $2 --dtypes fp32,bf16 --reps 3
done 2>&1 | tee $OUT/s54d_backward_vs_torch16.log
