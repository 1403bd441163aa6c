#!/bin/bash
# AMX test machine: bash bench/tools/s47/s47a.sh (logs under $OUT). Builds the amx family of this
# tree, then at 16 threads: the backward's gradients as np.zeros against np.empty in one process
# (grad_alloc_ab.py, H=16 N=2048 and H=32 N=4096) and issue 11's table (backward_vs_torch.py).
cd "$(dirname "$0")/../../.."
ROOT=$PWD; HERE=$ROOT/bench/tools/s47
lscpu | grep -E "Model name|^Model:" > $OUT/machine.txt
mkdir -p /tmp/w && cp -r setup.py pyproject.toml fa2cpu csrc README.md bench /tmp/w/
(cd /tmp/w && FA2CPU_DISABLE=avx512bf16,avx512,avx2 python3 setup.py build_ext --inplace -j16 > $OUT/build.log 2>&1; echo "build rc=$?" >> $OUT/build.log)
tail -n1 $OUT/build.log
cd /tmp/w && {
  python3 -c "import fa2cpu; from fa2cpu import _core; print(fa2cpu.get_isa(), 'amx probe 16 thr', round(_core.peak_gflops('amx', 'bf16', 16, 0.2)), 'fp32', round(_core.peak_gflops('amx', 'fp32', 16, 0.2)))"
  PYTHONPATH=/tmp/w python3 bench/tools/s47/grad_alloc_ab.py 16 16 2048 9
  PYTHONPATH=/tmp/w python3 bench/tools/s47/grad_alloc_ab.py 16 32 4096 5 fp32,bf16 0
  PYTHONPATH=/tmp/w python3 bench/backward_vs_torch.py --threads 16 --dtypes fp32,bf16 --reps 5
} 2>&1 | tee $OUT/s47a.log
