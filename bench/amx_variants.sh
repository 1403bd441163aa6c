#!/usr/bin/env bash
# Builds fa2cpu in place with each AMX tile length and times bf16 attention (bench/check_family.py)
# for each; prints one line per variant. Usage: bench/amx_variants.sh 128 256
set -euo pipefail
cd "$(dirname "$0")/.."
for bc in "$@"; do
    FA2CPU_EXTRA_CFLAGS="-DFA2CPU_AMX_BC=$bc" python3 setup.py build_ext --inplace --force > /dev/null 2>&1
    echo "== FA2CPU_AMX_BC=$bc"
    PYTHONPATH=. python3 bench/check_family.py amx bf16 | grep -E "worst|GFLOP"
done
