"""CPU tests of the benchmarks' SM-clock sampling (bench/nvml.py's SmClock over a stand-in NVML library, and
gemm_bench.clock_line, the printed line): a clock read through NVML's calls with the device found by its UUID,
None wherever NVML does not load, does not initialize or does not know the device, and no line without samples.
No extension, no GPU."""
import ctypes
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import gemm_bench  # noqa: E402
import nvml  # noqa: E402


class FakeNvml:
    """The three NVML calls SmClock makes, answering with the given status codes and clock."""

    def __init__(self, init=0, handle=0, clock=0, mhz=1755):
        self.codes = dict(init=init, handle=handle, clock=clock)
        self.mhz = mhz
        self.uuids = []

    def nvmlInit_v2(self):
        return self.codes["init"]

    def nvmlDeviceGetHandleByUUID(self, uuid, handle):
        self.uuids.append(uuid)
        return self.codes["handle"]

    def nvmlDeviceGetClockInfo(self, handle, kind, value):
        assert kind == 1, "NVML_CLOCK_SM"
        value._obj.value = self.mhz
        return self.codes["clock"]


def with_library(monkeypatch, library):
    def load(name):
        assert name == "libnvidia-ml.so.1"
        if library is None:
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")
        return library
    monkeypatch.setattr(ctypes, "CDLL", load)


def test_reads_the_sm_clock_of_the_device_named_by_its_uuid(monkeypatch):
    library = FakeNvml(mhz=1755)
    with_library(monkeypatch, library)
    clock = nvml.SmClock("3f2a-77")
    assert clock.mhz() == 1755
    assert library.uuids == [b"GPU-3f2a-77"]
    assert nvml.SmClock("GPU-3f2a-77").mhz() == 1755 and library.uuids[-1] == b"GPU-3f2a-77"


def test_none_without_nvml_or_its_device(monkeypatch):
    with_library(monkeypatch, None)
    assert nvml.SmClock("3f2a-77").mhz() is None
    for failing in (dict(init=1), dict(handle=13), dict(clock=3)):
        with_library(monkeypatch, FakeNvml(**failing))
        assert nvml.SmClock("3f2a-77").mhz() is None, failing


def test_clock_line_names_each_sampled_function():
    assert (gemm_bench.clock_line(["fused", "unfused", "base"], [1755, None, 1980]) ==
            "SM clock (median MHz after each timed call): fused 1755, base 1980")
    assert gemm_bench.clock_line(["fused"], [None]) == ""
    assert gemm_bench.clock_line([], []) == ""
