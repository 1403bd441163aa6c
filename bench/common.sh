# Shared by the bench/run_*.sh scripts: print the machine and code being measured, then run
# fa2cpu-bench with each command line echoed, saving its table (.txt) and records (.json).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

describe_machine() {
    echo "# date:    $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "# code:    $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (uncommitted changes)')"
    echo "# kernel:  $(uname -srm)"
    echo "# cpu:     $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) usable CPUs"
    python -c "import fa2cpu; fa2cpu.show_config()" | sed 's/^/# /'
}

# run_bench NAME ARGS...: one fa2cpu-bench invocation -> $OUT/NAME.txt and $OUT/NAME.json
run_bench() {
    local name=$1; shift
    {
        echo "\$ fa2cpu-bench $* --json $OUT/$name.json"
        python -m fa2cpu.bench "$@" --json "$OUT/$name.json"
    } 2>&1 | tee "$OUT/$name.txt"
    echo
}
