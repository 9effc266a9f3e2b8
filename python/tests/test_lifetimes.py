"""Lifetimes and host synchronization from Python on a CUDA Hopper GPU (marker gpu; skipped with the reason
elsewhere), EP = 1 on GPU 0 (docs/design.md, "Lifetimes"):

- no host synchronization in a training step: an eager step of mok.MoE (router inside: forward, backward, SGD),
  an eager step of mok.forward(ctx=None) + autograd, make_context, and the capture and replays of a CUDA-graph
  training step run under torch.profiler (CUDA activities) with no cudaDeviceSynchronize, cudaStreamSynchronize or
  cudaEventSynchronize inside the step's range; a torch.cuda.synchronize() in a control range shows that the
  trace would show one. In steady state the steps also allocate no device memory (no cudaMalloc or cudaFree) and
  the mok ops query no launch attribute (cudaFuncSetAttribute, cudaOccupancyMaxActiveClusters,
  cudaDeviceGetAttribute: cached per device).
- mok.forward(ctx=None) allocates no context in steady state: the workspace's pool holds two (the previous
  step's graph keeps one), and the gradients equal those with a context made for each step, bitwise.
- Workspace.close() frees the buffers (the device's free memory grows by at least the workspace's bytes), is
  idempotent, `with ws:` closes, and every later call raises RuntimeError "... closed".
"""
import collections
import dataclasses

import pytest
import torch

import mok
from conftest import make_inputs, make_weights
from test_autograd import WEIGHT_NAMES, as_dict, assert_same_bits, make_d_out, seeded_module
from test_gpu import SHAPES, workspace

pytestmark = pytest.mark.gpu

SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")
ALLOCATION_CALLS = ("cudaMalloc", "cudaFree")
LAUNCH_QUERY_CALLS = ("cudaFuncSetAttribute", "cudaOccupancyMaxActiveClusters", "cudaDeviceGetAttribute")
STEP = "mok_test_step"
CONTROL = "mok_test_control"


def profile(steps, *, ranged=True):
    """Runs each step inside a record_function range named STEP (ranged=False: the step opens it itself) under
    torch.profiler (CPU and CUDA activities), then a torch.cuda.synchronize() inside a CONTROL range; returns the
    profiler."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for step in steps:
            if ranged:
                with torch.profiler.record_function(STEP):
                    step()
            else:
                step()
        with torch.profiler.record_function(CONTROL):
            torch.cuda.synchronize()
    return prof


def runtime_calls(prof, region):
    """Counter of the CUDA runtime calls (host-side events named cuda...) that start inside a range named `region`
    (on any thread: autograd runs the backward on its own thread while the step's range is open)."""
    events = prof.events()
    windows = [(e.time_range.start, e.time_range.end) for e in events if e.name == region]
    assert windows, f"no {region} range in the trace"
    calls = collections.Counter()
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cuda") and \
                any(start <= e.time_range.start <= end for start, end in windows):
            calls[e.name] += 1
    return calls


def mok_op_calls(prof):
    """Counter of the CUDA runtime calls inside the mok custom ops' own ranges (mok::forward, mok::backward)."""
    events = prof.events()
    windows = [(e.time_range.start, e.time_range.end) for e in events
               if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("mok::")]
    assert windows, "no mok:: op in the trace"
    calls = collections.Counter()
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cuda") and \
                any(start <= e.time_range.start <= end for start, end in windows):
            calls[e.name] += 1
    return calls


def assert_no_synchronization(prof, what, *, steady=True):
    control = runtime_calls(prof, CONTROL)
    assert any(n.startswith("cudaDeviceSynchronize") for n in control), \
        f"the trace shows no cudaDeviceSynchronize for torch.cuda.synchronize() ({dict(control)}): this check is blind"
    calls = runtime_calls(prof, STEP)
    assert any(n.startswith(("cudaLaunchKernel", "cudaGraphLaunch")) for n in calls), \
        f"{what}: no kernel launch in the step's range ({dict(calls)}): the ranges do not cover the step"
    syncs = {n: c for n, c in calls.items() if n.startswith(SYNC_CALLS)}
    assert not syncs, f"{what}: host synchronization in the step: {syncs}"
    if steady:
        allocations = {n: c for n, c in calls.items() if n.startswith(ALLOCATION_CALLS)}
        assert not allocations, f"{what}: device allocations in a steady-state step: {allocations}"
        queries = {n: c for n, c in mok_op_calls(prof).items() if n.startswith(LAUNCH_QUERY_CALLS)}
        assert not queries, f"{what}: launch attributes queried again in a steady-state step: {queries}"


def test_an_eager_module_training_step_does_not_synchronize():
    shape = SHAPES["shared"]
    moe = seeded_module(shape, 601, num_tokens=shape.num_tokens)
    opt = torch.optim.SGD(moe.parameters(), lr=1e-3)
    x, _, _ = make_inputs(shape, "cuda", seed=602)
    d_out = make_d_out(shape, 602)

    def step():
        opt.zero_grad(set_to_none=True)
        (moe(x).float() * d_out.float()).sum().backward()
        opt.step()

    for _ in range(3):  # warm-up: the caching allocator, the launch caches, the kernels' modules
        step()
    torch.cuda.synchronize()
    assert_no_synchronization(profile([step, step]), "mok.MoE step")
    mok.check_status(moe.workspace)


class CountingNative:
    """The extension's workspace, counting make_context calls (every other attribute passes through)."""

    def __init__(self, native):
        self._native = native
        self.made = 0

    def make_context(self, *args):
        self.made += 1
        return self._native.make_context(*args)

    def __getattr__(self, name):
        return getattr(self._native, name)


def test_forward_without_a_context_reuses_a_pool_and_does_not_synchronize():
    shape = SHAPES["shared"]
    ws = workspace(shape)
    counting = CountingNative(ws._native)
    ws._native = counting
    x, idx, rw = make_inputs(shape, "cuda", seed=611)
    w = make_weights(shape, "cuda", seed=612)
    d_out = make_d_out(shape, 611)
    results = []

    def step():
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, rw, *w.tensors())]
        out, _ = mok.forward(ws, leaves[0], idx, leaves[1], mok.Weights(*leaves[2:]))
        (out.float() * d_out.float()).sum().backward()
        results.append((out, leaves))  # the step's graph stays alive until the next step drops it

    def pooled_step():
        step()
        if len(results) > 1:
            results.pop(0)

    for _ in range(3):
        pooled_step()
    torch.cuda.synchronize()
    made = counting.made
    assert made == 2, f"the warm-up made {made} contexts; a loop keeping the previous step's graph needs 2"
    prof = profile([pooled_step] * 3)
    assert counting.made == made, f"steady-state mok.forward(ctx=None) made {counting.made - made} new contexts"
    assert_no_synchronization(prof, "mok.forward(ctx=None) + autograd")
    mok.check_status(ws)
    out, leaves = results[-1]  # the last pooled step against a context of its own: the same bits
    got = {"out": out.detach(), "d_x": leaves[0].grad, "d_router_weights": leaves[1].grad}
    got.update({name: leaf.grad for name, leaf in zip(WEIGHT_NAMES, leaves[2:])})
    ctx = ws.make_context()
    want, _ = mok.forward(ws, x, idx, rw, w, ctx)
    want = {"out": want, **as_dict(*mok.backward(ws, d_out, x, idx, rw, w, ctx))}
    mok.check_status(ws)
    assert_same_bits(got, want, "mok.forward(ctx=None) + autograd vs a context of its own + mok.backward")


def test_make_context_does_not_synchronize():
    ws = workspace(SHAPES["shared"])
    contexts = []
    prof = profile([lambda: contexts.append(ws.make_context())])
    control = runtime_calls(prof, CONTROL)
    assert any(n.startswith("cudaDeviceSynchronize") for n in control), f"blind trace: {dict(control)}"
    calls = runtime_calls(prof, STEP)
    assert any(n.startswith("cudaMemsetAsync") for n in calls), f"make_context: no zero fill seen: {dict(calls)}"
    syncs = {n: c for n, c in calls.items() if n.startswith(SYNC_CALLS)}
    assert not syncs, f"make_context synchronizes: {syncs}"


def test_a_captured_training_step_does_not_synchronize():
    """The capture of a whole training step (mok.MoE with its router, SGD) and its replays: no host
    synchronization (a capture would also fail on one), and the replay is the eager step bitwise."""
    shape = SHAPES["shared"]
    eager, graphed = (seeded_module(shape, 621, num_tokens=shape.num_tokens) for _ in range(2))
    opts = {m: torch.optim.SGD(m.parameters(), lr=1e-3) for m in (eager, graphed)}
    x, _, _ = make_inputs(shape, "cuda", seed=622)
    g = make_d_out(shape, 622)

    def step(moe):
        opts[moe].zero_grad(set_to_none=False)
        loss = (moe(x).float() * g.float()).sum()
        loss.backward()
        opts[moe].step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(graphed)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(2):
        step(eager)
    graph = torch.cuda.CUDAGraph()
    losses = []

    def capture():  # the range inside: torch.cuda.graph synchronizes the device before the capture begins
        with torch.cuda.graph(graph):
            with torch.profiler.record_function(STEP):
                losses.append(step(graphed))

    assert_no_synchronization(profile([capture], ranged=False), "CUDA-graph capture of a training step",
                              steady=False)
    # No code of mok runs in a replay (graph.replay is PyTorch's call; in torch 2.11 it synchronizes the device
    # itself, seen on the H200): the replays are checked for their bits below.
    graph.replay()
    graph.replay()
    for _ in range(2):
        want = step(eager)
    torch.cuda.synchronize()
    assert torch.equal(losses[0], want), f"replayed loss {losses[0].item()} vs eager {want.item()}"
    mok.check_status(graphed.workspace)


def test_forward_without_a_context_is_refused_under_capture():
    shape = SHAPES["shared"]
    ws = workspace(shape)
    x, idx, rw = make_inputs(shape, "cuda", seed=631)
    w = make_weights(shape, "cuda", seed=632)
    mok.forward(ws, x, idx, rw, w, ws.make_context())  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2  # the graph is not empty
        with pytest.raises(RuntimeError, match="CUDA-graph capture: pass ctx=ws.make_context"):
            mok.forward(ws, y, idx, rw, w)  # refused before any CUDA call: the capture goes on
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2)


def test_close_frees_the_workspace_and_later_calls_raise():
    shape = dataclasses.replace(SHAPES["shared"], num_tokens=4096)
    x, idx, rw = make_inputs(shape, "cuda", seed=641)
    w = make_weights(shape, "cuda", seed=642)
    with workspace(shape) as ws:
        out, ctx = mok.forward(ws, x, idx, rw, w)
        mok.check_status(ws)
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        y_bytes = ws._native.ring_rows * shape.hidden * 2  # one of its buffers: the expert outputs
    assert ws.closed
    assert torch.cuda.mem_get_info()[0] - free_before >= y_bytes, "close() freed less than the workspace holds"
    ws.close()  # idempotent
    for call in (lambda: mok.forward(ws, x, idx, rw, w, ctx), lambda: mok.forward(ws, x, idx, rw, w),
                 lambda: mok.backward(ws, out, x, idx, rw, w, ctx), ws.make_context, ws.read_status):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    with pytest.raises(RuntimeError, match="closed"):  # the op itself, past the Python checks: the C++ refusal
        torch.ops.mok.forward(ws.handle, ctx.handle, False, x, idx, rw, *w.tensors())
    del ctx  # a context outlives its workspace's close: its memory is its own
