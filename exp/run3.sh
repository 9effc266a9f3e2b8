export MOK_COMMIT=$1
(cmake -S . -B build-gpu -G Ninja -DMOK_DEPS_DIR=$PWD/.deps >/dev/null && cmake --build build-gpu -j 16 >/dev/null) || exit 1
L=build-gpu/bench/libmok_bench_capi.so
timeout 150 python3 bench/gemm_bench.py --lib $L --iters 10 --dynamic --trace $OUT/trace || exit 1
python3 exp/trace_stats.py $OUT/trace
M=gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_ltcfabric.sum,lts__ltcfabric2ltc_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed
timeout 60 ncu --kernel-name regex:expert_gemm --launch-skip 3 --launch-count 1 --metrics $M python3 bench/gemm_bench.py --lib $L --shapes Kimi-K2.7 --iters 1 --only ours --dynamic 2>&1 | grep -E "  [a-z_]+__" 
