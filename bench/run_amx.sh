#!/usr/bin/env bash
# Regenerates the 16-core Intel Xeon (AMX) tables (README, bench/RESULTS.md): B=1 H=32 D=128
# N=2048,4096, causal and not, bf16 on the amx family and fp32 on avx512, each against torch SDPA
# at 1, 2, 4, 8 and 16 threads (thread-scaling tables and plots); then decode B=16 Hq=32 Hk=8
# Nk=8192 (K+V 1 GiB in fp32, far beyond the L3). About 6 minutes. Run it on an otherwise idle machine.
#   usage: bench/run_amx.sh [OUTDIR]       (default: bench/results/xeon_amx_16core)
source "$(dirname "$0")/common.sh"
OUT=${1:-$BENCH_DIR/results/xeon_amx_16core}
mkdir -p "$OUT"
describe_machine | tee "$OUT/machine.txt"

THREADS="1 2 4 8 16"
PREFILL="--mode prefill --batch 1 --heads 32 --seqlen 2048 4096 --head-dim 128 --threads $THREADS"

run_bench prefill_bf16_amx    $PREFILL --dtype bf16 --isa amx    --baselines torch --plot "$OUT/prefill_bf16_amx.png"
run_bench prefill_fp32_avx512 $PREFILL --dtype fp32 --isa avx512 --baselines torch --plot "$OUT/prefill_fp32_avx512.png"
run_bench decode --mode decode --batch 16 --heads 32 --kv-heads 8 --seqlen 8192 --head-dim 128 \
    --dtype fp32 bf16 --isa auto --threads $THREADS --baselines torch --plot "$OUT/decode.png"

"$PY" "$BENCH_DIR/tables.py" "$OUT"/prefill_bf16_amx.json "$OUT"/prefill_fp32_avx512.json \
    "$OUT"/decode.json | tee "$OUT/tables.md"
