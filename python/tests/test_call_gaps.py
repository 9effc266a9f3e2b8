"""CPU tests of bench/call_gaps.py's trace arithmetic: a profiled call's GPU events are those that start between its
host entry and the return of the synchronize after it (the host's marks, not the profiler's GPU-side copies of them); its busy time, span, the wait for its first kernel and the
idle gaps between kernels (overlapping kernels leave none). Synthetic traces with fresh random times (the seed is
in every failure message); bad shapes exit 2 before the library is loaded. No extension, no GPU."""
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import call_gaps  # noqa: E402


@pytest.fixture
def seed():
    return random.randrange(2**32)


def random_call(rng, start):
    """Kernels back to back with random gaps from `start`: [(start, end, name)] and the gaps before each but the
    first."""
    events, gaps, t = [], [], start
    for k in range(rng.randrange(1, 8)):
        if k:
            gap = rng.choice([0.0, rng.uniform(1, 3000)])
            gaps.append(gap)
            t += gap
        dur = rng.uniform(5, 5000)
        events.append((t, t + dur, f"kernel_{k}<T>(args)"))
        t += dur
    return events, gaps


def test_call_summary_splits_a_call(seed):
    rng = random.Random(seed)
    entered = rng.uniform(0, 1e6)
    lead = rng.uniform(0, 3000)
    events, gaps = random_call(rng, entered + lead)
    s = call_gaps.call_summary(events, entered)
    assert s["kernels"] == len(events), f"seed {seed}"
    assert s["busy_us"] == pytest.approx(sum(e - b for b, e, _ in events)), f"seed {seed}"
    assert s["span_us"] == pytest.approx(events[-1][1] - events[0][0]), f"seed {seed}"
    assert s["lead_us"] == pytest.approx(lead), f"seed {seed}"
    assert [g for g, _ in s["gaps"]] == pytest.approx(gaps), f"seed {seed}"
    assert [n for _, n in s["gaps"]] == [n for _, _, n in events[1:]], f"seed {seed}: a gap names the next kernel"
    # span = busy + idle when nothing overlaps
    assert s["span_us"] == pytest.approx(s["busy_us"] + sum(gaps)), f"seed {seed}"


def test_overlapping_kernels_leave_no_gap():
    # the second kernel ends inside the first: the third's gap counts from the first's end
    s = call_gaps.call_summary([(0.0, 100.0, "a"), (10.0, 50.0, "b"), (130.0, 140.0, "c")])
    assert [g for g, _ in s["gaps"]] == [0.0, 30.0]
    assert "lead_us" not in s


def test_trace_events_and_calls_between_marks(seed, tmp_path):
    rng = random.Random(seed)
    trace, expected, t = [], [], 0.0
    for _ in range(rng.randrange(1, 5)):
        t += rng.uniform(100, 1000)
        before, _ = random_call(rng, t)  # the untimed forward before the call: not the call's
        t = before[-1][1] + rng.uniform(10, 100)
        entry = t
        mine, _ = random_call(rng, t + rng.uniform(0, 500))
        t = mine[-1][1] + rng.uniform(1, 50)
        trace += [dict(ph="X", cat="kernel", name=n, ts=b, dur=e - b) for b, e, n in before + mine]
        trace += [dict(ph="X", cat="user_annotation", name=call_gaps.CALL_MARK, ts=entry, dur=20.0),
                  dict(ph="X", cat="user_annotation", name=call_gaps.SYNC_MARK, ts=entry + 30.0, dur=t - entry - 30.0),
                  dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=entry + 1.0, dur=5.0),
                  # the profiler's GPU-side copy of a range: not a host mark
                  dict(ph="X", cat="gpu_user_annotation", name=call_gaps.CALL_MARK, ts=mine[0][0], dur=1.0)]
        expected.append((entry, t, mine))
    rng.shuffle(trace)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": trace + [dict(ph="M", name="process_name")]}))
    gpu, api, marks = call_gaps.trace_events(str(path))
    assert [b for b, _ in marks[call_gaps.CALL_MARK]] == [e for e, _, _ in expected], f"seed {seed}"
    assert len(api) == len(expected), f"seed {seed}"
    for (t0, _), (_, t1), (entry, end, mine) in zip(marks[call_gaps.CALL_MARK], marks[call_gaps.SYNC_MARK], expected):
        assert t1 == pytest.approx(end), f"seed {seed}"
        got = call_gaps.events_between(gpu, t0, t1)
        assert [n for _, _, n in got] == [n for _, _, n in mine], f"seed {seed}: the call's kernels, not the forward's"


def test_short_name():
    assert call_gaps.short_name("void mok::kernels::pull_grad_rows_kernel<int>(mok::kernels::GradPullParams)") == \
        "mok::kernels::pull_grad_rows_kernel"[-28:]


@pytest.mark.parametrize("args, message", [
    ([], "name a shape"),
    (["--shape", "x:1024:100:512:8:2"], "hidden: expected a positive multiple of 64, got 100"),
    (["--shapes", "NoSuchModel"], "unknown shape 'NoSuchModel'"),
])
def test_bad_shapes_exit_2_before_the_gpu(args, message):
    # checked before the library is loaded: no GPU, no build needed
    run = subprocess.run([sys.executable, str(BENCH / "call_gaps.py"), "--lib", "/nonexistent.so", *args],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr
