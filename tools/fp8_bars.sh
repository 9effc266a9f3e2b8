#!/usr/bin/env bash
# Run ON THE GPU MACHINE, from the repository root: issue 27's and 28's bars (and issue 26's layer shapes) from a
# prebuilt version (tools/build_versions.sh, run on the development machine: no device time building):
#   tools/fp8_bars.sh [DIR]        DIR = scratch/pre/main by default: libmok_bench_capi.so, bench/ and COMMIT
# torchao's FP8 expert MLP joins as a peer where its wheel is carried in scratch/wheels
# (`python3 -m pip download --no-deps torchao==0.18.0 -d scratch/wheels` here: 3.3 MB). In the order the bars need
# them, the unmet bars first: the FP8 forward + backward at one EP = 8 rank's shapes (issue 28's 1.35x), the FP8 GEMMs
# (gemm_bench --gemm fp8: issue 27's 1000 TFLOP/s), the FP8 forward at one EP = 8 rank's shapes and at EP = 1 (the
# full shapes; DeepSeek-V4-Pro with half its experts), the FP8 forward + backward at EP = 1 (an H200's memory), then
# layer_bench at SonicMoE's fine-grained shapes and Qwen3.5-397B. Each bench's full output goes to $OUT (the device
# tool's return folder) when set; its table rows are printed. A bench that runs past its limit (200 s, or what
# MOK_BARS_BUDGET_S, the call's seconds, leaves) is stopped and the next one runs; one that would start with less than
# 60 s of that budget left is skipped, said so.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
dir=${1:-scratch/pre/main}
out=${OUT:-/tmp/mok_fp8_bars}
mkdir -p "$out"
[ -f "$dir/libmok_bench_capi.so" ] || { echo "fp8_bars: no $dir/libmok_bench_capi.so (tools/build_versions.sh)" >&2; exit 2; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nccl_lib=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib"))' 2>/dev/null || true)
# The prebuilt library was linked on the development machine: the CUDA runtime and NCCL from their folders here.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/lib${nccl_lib:+:$nccl_lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
echo "library: $(cat "$dir/COMMIT" 2>/dev/null || echo '?') ($dir)"
wheels=(scratch/wheels/torchao-*.whl)
if [ -f "${wheels[0]}" ]; then
  python3 -m pip install --no-deps -q "${wheels[0]}" 2>&1 | tail -n 1
else
  echo "no torchao wheel in scratch/wheels: its columns stay empty"
fi
budget=${MOK_BARS_BUDGET_S:-100000}
bench() {  # bench LOG SCRIPT ARGS...: one bench of $dir, its rows printed, everything into $out/LOG
  local log=$1 script=$2 limit=$((budget - SECONDS))
  shift 2
  if [ "$limit" -lt 60 ]; then
    echo "== skipped (MOK_BARS_BUDGET_S=$budget, $SECONDS s used): $script $*"
    return
  fi
  [ "$limit" -gt 200 ] && limit=200
  echo "== $script $* ($SECONDS s)"
  timeout "$limit" python3 "$dir/bench/$script" --lib "$dir/libmok_bench_capi.so" "$@" 2>&1 | tee -a "$out/$log" |
    grep -v '^  \|unavailable'
}
# MOK_BARS_BWD_PATHS: the first bench's --backward-paths (e.g. fp8f,fp8c,fused: an opt-in path beside the default's).
bench bwd.txt fp8_layer_bench.py --backward --iters 10 --shapes Kimi-K2.7,GLM-5.2,DeepSeek-V4-Pro \
  ${MOK_BARS_BWD_PATHS:+--backward-paths "$MOK_BARS_BWD_PATHS"}
bench gemm.txt gemm_bench.py --gemm fp8 --iters 20
bench fwd.txt fp8_layer_bench.py --iters 10
bench fwd.txt fp8_layer_bench.py --iters 5 --experts-per 1 --shapes Kimi-K2.7,GLM-5.2,Qwen3.5-397B
bench fwd.txt fp8_layer_bench.py --iters 5 --experts-per 2 --shapes DeepSeek-V4-Pro
bench bwd.txt fp8_layer_bench.py --backward --iters 5 --experts-per 1 --shapes Kimi-K2.7,GLM-5.2,Qwen3.5-397B \
  --backward-paths fp8f
bench bwd.txt fp8_layer_bench.py --backward --iters 5 --experts-per 2 --shapes DeepSeek-V4-Pro --backward-paths fp8f
bench layer.txt layer_bench.py --shapes Qwen3.5-397B --shape sonic512:32768:4096:512:128:8 \
  --shape sonic1024:32768:4096:1024:128:8 --iters 5
echo "fp8_bars: done in $SECONDS s"
