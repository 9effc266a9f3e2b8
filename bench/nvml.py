"""The SM clock of the benchmarked GPU through NVML (the driver's libnvidia-ml, by ctypes: no Python package).

Why: under sustained load the H200 lowers its SM clock at its 700 W power limit, so two builds (or ours and a peer)
timed in turns can differ by their clocks as well as by their code (docs/perf_notes.md, round 16: the bounded and
the unbounded dgrad GEMM take the same cycles at a fixed clock and not the same time in the timed loop). With
MOK_BENCH_CLOCKS=1 the benchmarks sample the clock after each timed call and print each function's median.

SmClock(device).mhz() -> int, or None where NVML does not load or does not know the device (no driver, a GPU that
is not NVIDIA's, a CPU-only machine): the benchmarks then print no clocks; nothing else depends on it.
"""
import ctypes

_NVML_SUCCESS = 0
_NVML_CLOCK_SM = 1


class SmClock:
    """NVML's current SM clock of one CUDA device (found by its UUID, so CUDA_VISIBLE_DEVICES does not matter)."""

    def __init__(self, device_uuid):
        self._lib = None
        self._handle = ctypes.c_void_p()
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            return
        if lib.nvmlInit_v2() != _NVML_SUCCESS:
            return
        uuid = str(device_uuid)
        if not uuid.startswith("GPU-"):
            uuid = "GPU-" + uuid
        if lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(self._handle)) != _NVML_SUCCESS:
            return
        self._lib = lib

    def mhz(self):
        """The SM clock now, in MHz; None without NVML."""
        if self._lib is None:
            return None
        value = ctypes.c_uint()
        if self._lib.nvmlDeviceGetClockInfo(self._handle, _NVML_CLOCK_SM, ctypes.byref(value)) != _NVML_SUCCESS:
            return None
        return value.value
