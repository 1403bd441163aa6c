#!/bin/bash
# AMX test machine (session 58): bash bench/tools/s58/s58b.sh, logs under $OUT (6 files).
# 1. HEAD built in place, the backward / varlen / torch tests on every family (the late
#    accumulation, fa1ebe0 / a4b6c5d, never run there; the amx family's float32 backward is V512x46).
# 2. amx-only builds side by side: base0 (sacrificial), base (HEAD), nolate (late_acc.patch
#    reversed), g384 (AMX backward row groups of 384 rows, dV / dK updated once per 4 blocks).
# 3. In process at 16 threads, three orders: fp32 H=16 N=2048 full base vs nolate; bf16 H=32 N=4096
#    full and H=16 N=2048 full base vs g384.
# 4. Issue 11's table at 16 threads, H=32 N=4096.
cd "$(dirname "$0")/../../.."
ROOT=$PWD
T0=$(date +%s)
lscpu | grep -E "^Model:|^CPU\(s\)|^Model name" > $OUT/s58b_machine.txt
python3 setup.py build_ext --inplace -j16 > /tmp/s58b_build.log 2>&1; echo "build rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/s58b_machine.txt
( PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_backward.py tests/test_varlen.py tests/test_torch.py tests/test_torch_sdpa.py 2>&1 | tail -n 4 > $OUT/s58b_tests.log
  echo "tests done at $(( $(date +%s) - T0 )) s" >> $OUT/s58b_tests.log ) &
build() {  # build NAME CFLAGS [reverse-patch]
  mkdir -p /tmp/v/$1 && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/v/$1/ && rm -f /tmp/v/$1/fa2cpu/*.so /tmp/v/$1/fa2cpu/_core.cpp
  [ -n "$3" ] && (cd /tmp/v/$1 && patch -R -p1 < "$3" > /dev/null)
  (cd /tmp/v/$1 && FA2CPU_DISABLE=avx512bf16,avx512,avx2 FA2CPU_EXTRA_CFLAGS="$2" python3 setup.py build_ext --inplace -j4 > build.log 2>&1; echo "build $1 rc=$?")
}
wait
build base0 "" & build base "" & build nolate "" $ROOT/bench/tools/s57/late_acc.patch & build g384 "-DFA2CPU_AMX_BWD_GROUP_ROWS=384 -DFA2CPU_AMX_BWD_UPDATE_BLOCKS=4" &
wait
echo "variants built at $(( $(date +%s) - T0 )) s" >> $OUT/s58b_machine.txt
cd /tmp; M=$ROOT/bench/tools/s52/bwd_multi.py; V=/tmp/v
{ for c in "16 16 2048 0 fp32 9"; do
    PYTHONPATH=$V/base timeout 40 python3 $M $c $V/base0/fa2cpu $V/base/fa2cpu $V/nolate/fa2cpu
    PYTHONPATH=$V/base timeout 40 python3 $M $c $V/base0/fa2cpu $V/nolate/fa2cpu $V/base/fa2cpu
    PYTHONPATH=$V/base timeout 40 python3 $M $c $V/base0/fa2cpu $V/base/fa2cpu $V/nolate/fa2cpu; done
  for c in "16 32 4096 0 bf16 5" "16 16 2048 0 bf16 9"; do
    PYTHONPATH=$V/base timeout 60 python3 $M $c $V/base0/fa2cpu $V/base/fa2cpu $V/g384/fa2cpu
    PYTHONPATH=$V/base timeout 60 python3 $M $c $V/base0/fa2cpu $V/g384/fa2cpu $V/base/fa2cpu
    PYTHONPATH=$V/base timeout 60 python3 $M $c $V/base0/fa2cpu $V/base/fa2cpu $V/g384/fa2cpu; done; } > $OUT/s58b_ab.log 2>&1
echo "ab done at $(( $(date +%s) - T0 )) s" >> $OUT/s58b_ab.log
cd $ROOT
PYTHONPATH=$PWD timeout 170 python3 bench/backward_vs_torch.py --threads 16 --heads 32 --n 4096 --dtypes fp32,bf16 --reps 3 > $OUT/s58b_bwd16_h32.log 2>&1
echo "all done at $(( $(date +%s) - T0 )) s" >> $OUT/s58b_bwd16_h32.log
