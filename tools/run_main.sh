#!/usr/bin/env bash
# Builds the library and runs the main program on the local GPU(s) (README's first command): the MoE
# layer benchmark, forward and forward + backward (bench/layer_bench.py's default; --no-backward for the
# forward alone), ours vs the torchtitan-style PyTorch baseline (under autograd for the backward), at EP=1
# and, with two or more GPUs, at EP = the number of GPUs (one process per GPU). Installs PyTorch (pip) when
# it is missing. Besides the tables it writes, per EP, the rows as JSON and a PNG bar chart of them
# (bench/chart_png.py; matplotlib when it imports, else a built-in renderer) into $MOK_RESULTS_DIR
# (default bench/results, git-ignored): layer_bench_ep<EP>.json and layer_bench_ep<EP>.png.
#   tools/run_main.sh [bench/layer_bench.py arguments, e.g. --shapes Kimi-K2.7 --iters 20]
set -euo pipefail
cd "$(dirname "$0")/.."
# A Hopper GPU first, before minutes of building: the driver's view (nvidia-smi ships with it).
need="run_main: mok needs an NVIDIA Hopper GPU (sm_90); found"
if ! command -v nvidia-smi >/dev/null; then
  echo "$need no NVIDIA driver (nvidia-smi is not on PATH)" >&2
  exit 1
fi
if ! caps=$(nvidia-smi --query-gpu=compute_cap,name --format=csv,noheader 2>&1); then
  echo "$need no usable GPU (nvidia-smi: $caps)" >&2
  exit 1
fi
if ! grep -q "^9\.0," <<<"$caps"; then
  echo "$need ${caps//$'\n'/; } (compute capability, name)" >&2
  exit 1
fi
tools/build.sh --target mok_bench_capi
lib="${MOK_BUILD_DIR:-build}/bench/libmok_bench_capi.so"
# NVLink multicast stays off on the shared machines (never use NVLS/multimem).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if ! python3 -c "import torch" 2>/dev/null; then
  echo "run_main: PyTorch missing: python3 -m pip install torch"
  python3 -m pip install --disable-pip-version-check torch
fi
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 1 ]; then
  echo "run_main: no CUDA GPU visible; the benchmark needs a Hopper GPU" >&2
  exit 1
fi
results="${MOK_RESULTS_DIR:-bench/results}"
# --json and --chart before "$@": a caller's own wins (argparse keeps the last).
python3 bench/layer_bench.py --lib "$lib" --json "$results/layer_bench_ep1.json" \
  --chart "$results/layer_bench_ep1.png" "$@"
if [ "$gpus" -ge 2 ]; then
  python3 -m torch.distributed.run --standalone --nproc-per-node="$gpus" bench/layer_bench.py --lib "$lib" \
    --json "$results/layer_bench_ep$gpus.json" --chart "$results/layer_bench_ep$gpus.png" "$@"
fi
