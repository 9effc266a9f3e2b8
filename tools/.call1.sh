set -u
C=48f9b8a
OUT2=$OUT; mkdir -p /tmp/suite /tmp/py
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
(CMAKE_BUILD_PARALLEL_LEVEL=8 python3 -m pip install --disable-pip-version-check --no-build-isolation -C cmake.define.MOK_DEPS_DIR=$PWD/.deps . > /tmp/py/pip.log 2>&1; echo "pip rc=$?" >> /tmp/py/pip.log) &
MOK_COMMIT=$C OUT=/tmp/suite MOK_SUITE_SANITIZERS=0 MOK_SUITE_SOAK=0 MOK_SUITE_GEMM_BENCH=0 MOK_SUITE_LAYER_BENCH=1 MOK_SUITE_LAYER_TIMEOUT=200 MOK_SUITE_LAYER_ARGS='--iters 5' MOK_SUITE_TIMEOUT=200 timeout 430 tools/gpu_suite.sh 'gpu' > /tmp/suite/console.txt 2>&1
wait
tail -2 /tmp/py/pip.log
(cd python/tests && timeout 150 python3 -m pytest -rs -q -p no:cacheprovider . > /tmp/py/pytest.log 2>&1; echo "pytest rc=$?" >> /tmp/py/pytest.log)
grep -A30 "== summary" /tmp/suite/console.txt | head -24
grep -E "^f\+b |^fwd " /tmp/suite/console.txt | tail -12 | cut -c1-200
tail -15 /tmp/py/pytest.log | cut -c1-300
cp /tmp/suite/console.txt /tmp/suite/ctest.log /tmp/suite/layer_bench.log /tmp/py/pytest.log /tmp/py/pip.log $OUT2/ 2>/dev/null
