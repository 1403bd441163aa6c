#!/bin/bash
# AMX test machine (device tool), from the repo root: bash bench/tools/amx_layouts_s44/s44a.sh
# (logs under $OUT). Builds the base (this tree) and three variants of amx_blocked_layouts.patch
# (P / P+O^T / P+O^T+scores in 1 KB tile blocks, FA2CPU_AMX_PBLK / OBLK / SBLK), runs the amx
# family's forward tests on the fully blocked one, then times all of them in one process with a
# second copy of the base as the same-code control (multi.py: median ms, first / this).
set -x
cd "$(dirname "$0")/../../.."
ROOT=$PWD
HERE=$ROOT/bench/tools/amx_layouts_s44
lscpu | grep -E "Model name|^CPU\(s\)" > $OUT/cpu.txt
python3 -c "import xdist" 2>/dev/null && XD="-n 8" || XD=""
declare -A FL=( [base]="" [p]="-DFA2CPU_AMX_PBLK=1" [po]="-DFA2CPU_AMX_PBLK=1 -DFA2CPU_AMX_OBLK=1" [pos]="-DFA2CPU_AMX_PBLK=1 -DFA2CPU_AMX_OBLK=1 -DFA2CPU_AMX_SBLK=1" )
for v in base p po pos; do
  mkdir -p /tmp/v_$v && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/v_$v/ 2>/dev/null
  [ $v != base ] && (cd /tmp/v_$v && patch -p1 < $HERE/amx_blocked_layouts.patch > /dev/null)
  (cd /tmp/v_$v && FA2CPU_EXTRA_CFLAGS="${FL[$v]}" python3 setup.py build_ext --inplace -j4 > $OUT/build_$v.log 2>&1; echo "build $v rc=$?" >> $OUT/build_$v.log) &
done
wait
tail -n1 $OUT/build_*.log
cp -r /tmp/v_base /tmp/v_base2
# correctness of the fully blocked build on the amx family (forward, varlen, sinks)
(cd /tmp/v_pos && cp -r $ROOT/tests . && FA2CPU_ISA=amx PYTHONPATH=/tmp/v_pos timeout 300 python3 -m pytest -q -x $XD tests/test_forward.py tests/test_varlen.py tests/test_sinks.py -k "not torch" > $OUT/test_pos.log 2>&1; echo rc=$? >> $OUT/test_pos.log)
tail -3 $OUT/test_pos.log
P="base=/tmp/v_base/fa2cpu p=/tmp/v_p/fa2cpu po=/tmp/v_po/fa2cpu pos=/tmp/v_pos/fa2cpu base2=/tmp/v_base2/fa2cpu"
for round in 1 2; do
  taskset -c 3 python3 $HERE/multi.py 1 4 4096 0 5 $P
  taskset -c 3 python3 $HERE/multi.py 1 4 4096 1 5 $P
  python3 $HERE/multi.py 16 32 4096 0 7 $P
  python3 $HERE/multi.py 16 32 4096 1 7 $P
  python3 $HERE/multi.py 16 32 2048 0 9 $P
done 2>&1 | tee $OUT/ab.log
# the fully blocked build against torch SDPA (issue 12's ratios and % of the tile probe), if time is left
(cd /tmp/v_pos && timeout 150 python3 $ROOT/bench/vs_torch.py --threads 16 --cases prefill --reps 3 > $OUT/vs_torch_pos.log 2>&1)
tail -12 $OUT/vs_torch_pos.log
