#!/bin/bash
# AMX test machine: bash bench/tools/s48/s48a.sh (logs under $OUT). Builds the amx family of this
# tree, then at 16 threads: the backward's gradients from np.empty against kept memory in one
# process (kept_gradients_ab.py), issue 11's table (backward_vs_torch.py), and the backward tests
# on the amx family.
cd "$(dirname "$0")/../../.."
bash bench/tools/s48/build_amx.sh /tmp/w
cd /tmp/w && {
  python3 -c "import fa2cpu; from fa2cpu import _core; print(fa2cpu.get_isa(), 'amx probe 16 thr', round(_core.peak_gflops('amx', 'bf16', 16, 0.2)), 'fp32', round(_core.peak_gflops('amx', 'fp32', 16, 0.2)))"
  for c in "16 16 2048 0 bf16 9" "16 16 2048 1 bf16 9" "16 16 2048 0 fp32 7" "16 16 2048 1 fp32 7" "16 32 4096 0 bf16 5" "16 32 4096 0 fp32 3" "2 16 2048 0 bf16 7"; do
    PYTHONPATH=/tmp/w python3 bench/tools/s48/kept_gradients_ab.py $c
  done
  PYTHONPATH=/tmp/w python3 bench/backward_vs_torch.py --threads 16 --dtypes fp32,bf16 --reps 5
} 2>&1 | tee $OUT/s48a.log
cd /tmp/w && PYTHONPATH=/tmp/w timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_backward.py > $OUT/tests_backward_amx.log 2>&1; tail -n3 $OUT/tests_backward_amx.log
