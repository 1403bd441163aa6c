# Shared by bench/run_*.sh: print the machine and code being measured, then run fa2cpu-bench with
# each command line echoed, saving its table (NAME.txt) and records (NAME.json) under $OUT.
set -euo pipefail
PY=${PYTHON:-python3}  # the interpreter that has fa2cpu (and torch) installed
# The run_*.sh scripts pass --plot, which needs matplotlib: without it every plotted step failed
# and the run went on with those tables missing. Stop before measuring anything instead.
$PY -c "import matplotlib" 2>/dev/null || {
    echo "bench/run_*.sh: matplotlib is missing (the tables come with plots): pip install 'fa2cpu[bench]'" >&2
    exit 2
}
BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

describe_machine() {
    local git="git -C $BENCH_DIR"
    echo "# date:    $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "# code:    $($git rev-parse --short HEAD 2>/dev/null || echo unknown)$($git diff --quiet HEAD 2>/dev/null || echo ' + uncommitted changes')"
    echo "# kernel:  $(uname -srm)"
    echo "# cpu:     $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) usable CPUs"
    $PY -c "import fa2cpu; fa2cpu.show_config()" | sed 's/^/# /'
}

# run_bench NAME ARGS...: one fa2cpu-bench run -> $OUT/NAME.txt, $OUT/NAME.json. The progress line
# stays on the terminal (stderr); a failed check is reported and the script carries on.
run_bench() {
    local name=$1; shift
    echo "\$ fa2cpu-bench $* --json $OUT/$name.json" | tee "$OUT/$name.txt"
    set +e
    $PY -m fa2cpu.bench "$@" --json "$OUT/$name.json" | tee -a "$OUT/$name.txt"
    local rc=${PIPESTATUS[0]}
    set -e
    if [ "$rc" != 0 ]; then echo "!! fa2cpu-bench exited with status $rc" | tee -a "$OUT/$name.txt"; fi
    echo
}
