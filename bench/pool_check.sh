#!/usr/bin/env bash
# The driver's thread pool (issue 8) against the OpenMP parallel region it replaced (commit
# e994523), same machine, same run: prefill and decode speed against torch SDPA at 1 and all
# threads, and call latency idle vs busy on two cores (bench/busy.py under taskset).
#   usage: bench/pool_check.sh OLD_SRC OUTDIR   (OLD_SRC: a source tree of the older commit)
set -uo pipefail
OLD=$(cd "$1" && pwd); OUT=$(mkdir -p "$2" && cd "$2" && pwd)
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
( $PY -m pip install -q --no-build-isolation --no-deps --target /tmp/site_old "$OLD" > "$OUT/build_old.log" 2>&1 ) &
( $PY -m pip install -q --no-build-isolation --no-deps --target /tmp/site_new "$HERE" > "$OUT/build_new.log" 2>&1 ) &
wait
N=$(nproc)
cd /tmp  # not the source tree: `python -m` would import the unbuilt checkout
for which in old new; do
  export PYTHONPATH=/tmp/site_$which
  echo "=== $which: $($PY -c 'import fa2cpu; print(fa2cpu.__file__)') cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-) nproc $N"
  $PY -m fa2cpu.bench --mode prefill --batch 1 --heads 32 --seqlen 2048 --head-dim 128 --dtype bf16 --isa amx \
      --no-causal --threads 1 "$N" --baselines torch --repeat 3 --quiet 2>&1 | grep -v "^#"
  $PY -m fa2cpu.bench --mode prefill --batch 1 --heads 32 --seqlen 2048 --head-dim 128 --dtype fp32 --isa avx512 \
      --causal --threads 1 "$N" --baselines torch --repeat 3 --quiet 2>&1 | grep -v "^#"
  $PY -m fa2cpu.bench --mode decode --batch 16 --heads 32 --kv-heads 8 --seqlen 8192 --head-dim 128 \
      --dtype bf16 fp32 --threads 1 2 "$N" --baselines torch --repeat 5 --quiet 2>&1 | grep -v "^#"
done 2>&1 | tee "$OUT/speed.txt"
for which in old new; do
  export PYTHONPATH=/tmp/site_$which
  echo "=== $which, 2 cores (taskset -c 0,1), 1 competing process"
  taskset -c 0,1 $PY "$HERE/bench/busy.py" --seconds 1.5
  if [ $which = old ]; then
    echo "=== old with OMP_WAIT_POLICY=passive"
    OMP_WAIT_POLICY=passive taskset -c 0,1 $PY "$HERE/bench/busy.py" --seconds 1.5
  fi
done 2>&1 | tee "$OUT/busy.txt"
