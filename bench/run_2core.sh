#!/usr/bin/env bash
# Regenerates the 2-core machine's tables (README, bench/RESULTS.md): B=1 H=32, D=128 and D=64,
# N=2048,4096, causal and not, fp32 and bf16, every SIMD family from the best usable one down to
# avx2, against torch SDPA on the same 2 threads; then decode B=16 Hq=32 Hk=8 Nk=8192 and a
# 1-vs-2-thread scaling run. About 5 minutes. Run it on an otherwise idle machine.
#   usage: bench/run_2core.sh OUTDIR   (name it for the CPU in it, e.g. bench/results/zen5_2core)
source "$(dirname "$0")/common.sh"
OUT=${1:?usage: $0 OUTDIR, named for the machine (e.g. bench/results/zen5_2core)}
mkdir -p "$OUT"
describe_machine | tee "$OUT/machine.txt"

# 'auto' is the best usable family (avx512bf16 where the CPU has it), then the older ones this CPU
# can run (an AVX2-only CPU such as a Zen 3 has neither avx512 nor avx512bf16: fa2cpu-bench refuses
# a family the CPU cannot run, so those are left out rather than failing every step).
ISAS="auto $($PY -c "import fa2cpu; u = fa2cpu.available_isas(); print(' '.join(f for f in ('avx512', 'avx2') if f in u))")"
PREFILL="--mode prefill --batch 1 --heads 32 --seqlen 2048 4096 --dtype fp32 bf16 --threads 2"

run_bench prefill_d128 $PREFILL --head-dim 128 --isa $ISAS --baselines torch --plot "$OUT/prefill_d128.png"
run_bench prefill_d64  $PREFILL --head-dim 64  --isa $ISAS --baselines torch --plot "$OUT/prefill_d64.png"
run_bench decode --mode decode --batch 16 --heads 32 --kv-heads 8 --seqlen 8192 --head-dim 128 \
    --dtype fp32 bf16 --threads 2 --isa $ISAS --baselines torch
run_bench threads --mode prefill --batch 1 --heads 32 --seqlen 4096 --head-dim 128 --dtype fp32 bf16 \
    --no-causal --threads 1 2 --baselines torch --plot "$OUT/threads.png"

"$PY" "$BENCH_DIR/tables.py" "$OUT"/prefill_d128.json "$OUT"/prefill_d64.json "$OUT"/decode.json \
    "$OUT"/threads.json | tee "$OUT/tables.md"
