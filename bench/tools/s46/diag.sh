#!/bin/bash
# AMX test machine: bash bench/tools/s46/diag.sh (logs under $OUT): builds the amx family in /tmp/v_base,
# then bwd_diag.py at 16 threads (fp32, bf16; H 16 / 32 / 64) and 8 threads (fp32).
cd "$(dirname "$0")/../../.."
mkdir -p /tmp/v_base && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/v_base/
(cd /tmp/v_base && FA2CPU_DISABLE=avx512bf16,avx512,avx2 python3 setup.py build_ext --inplace -j16 > $OUT/build_base.log 2>&1; echo "build rc=$?" >> $OUT/build_base.log)
tail -n1 $OUT/build_base.log
cd /tmp
export PYTHONPATH=/tmp/v_base
H=/work/main/bench/tools/s46
(python3 $H/bwd_diag.py 16 fp32 16 32 64; python3 $H/bwd_diag.py 16 bf16 16 32 64; taskset -c 0-7 python3 $H/bwd_diag.py 8 fp32 16 32) 2>&1 | tee $OUT/bwd_diag.log
