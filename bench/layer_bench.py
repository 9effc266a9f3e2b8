#!/usr/bin/env python3
"""MoE layer benchmark, forward and forward + backward: ours (one call each through the C API; the fused
megakernel forward path, and its unfused twin) vs a torchtitan-style PyTorch baseline, one run.

The layer (docs/design.md), on each rank, T tokens, E global experts, E/EP of them local:
  out[t] = shared(x[t]) + sum_j rw[t,j] * expert_{idx[t,j]}(x[t]),   mlp(x) = W_down (silu(W_gate x) * (W_up x))
Data per rank (seed + rank): x ~ randn, top-k of randn logits (with --skew s, expert e's logit gets
-s * log(1 + perm(e)), perm a fixed random permutation), router weights = softmax over the k chosen logits,
weights ~ randn / sqrt(fan_in); the output's gradient d_out ~ randn (its own generator, seed 2^31 + seed + rank).
Baseline (BF16, as torchtitan builds it): histc + all-to-all of the counts, splits read to the host,
sort routes by expert, all-to-all-v of the rows, expert-major permutation padded to 16 rows per expert
(generate_permute_indices), torch._grouped_mm gate/up/down, inverse permutation, all-to-all-v back, unsort,
dense shared expert, weighted sum in fp32. At EP=1 no all-to-alls. Its backward is PyTorch autograd through the
same construction (x, the router weights and all six weights require grad; the all-to-all-v's backward is the
reverse all-to-all-v, as torchtitan's all_to_all_single_autograd), timed as forward + out.backward(d_out), every
.grad set to None before each call (written, not accumulated: autograd's first micro-batch).
Ours forward + backward: mok_bench_layer_forward then mok_bench_layer_backward (MoeWorkspace::backward on the
context the forward filled: d_x, d_router_weights and the six weight gradients; --grad-mode bf16 (default: the
baseline's dtype) or fp32 written, or accumulated into fp32); backward alone: mok_bench_layer_backward again
on the last forward's context.
Measured (docs/perf_notes.md, "The forward + backward table"): per shape, the calls of one table take turns call
by call after a warm-up (steady power state, see gemm_bench.time_ms): forward: fused, unfused, baseline; forward +
backward: fused fwd+bwd, unfused fwd+bwd, fused bwd, unfused bwd, baseline fwd+bwd under autograd. Each call is
timed with CUDA events on each rank, a call's time is the slowest rank's, reported: the median. Ours includes
building its schedule.
Dense ceilings (each timed alone, in its own steady state), M = T*(k+1) rows (T*k without a shared expert:
gpt-oss-120b, Qwen3-30B-A3B): forward = torch.mm [M,H]x[H,2I] then [M,I]x[I,H]; forward + backward = those two
and their four backward GEMMs (dgrad [M,H]x[H,I] and [M,2I]x[2I,H], wgrad [I,M]x[M,H] and [H,M]x[M,2I]): 3x the
forward's GEMM work. TFLOP/s per GPU, the shared expert counting as one more route (replayed work not counted):
  forward             6 * (T + T*k) * H * I / t       (6 * T*k * H * I without a shared expert)
  forward + backward 18 * (T + T*k) * H * I / t      (18 * T*k * H * I without a shared expert)
  backward alone     12 * (T + T*k) * H * I / t      (12 * T*k * H * I without a shared expert)
and, in SonicMoE's convention (routed experts only, whatever else the layer computes; bench/shapes.py, flops):
sonic_TF = 6 * T*k * H * I / t of the fused forward, sonic_bwd_TF = 12 * T*k * H * I / t of its backward called alone.
With --sonic-timing both come from times taken as SonicMoE's benchmark (its benchmarks/moe-cute.py) takes them:
triton.testing.do_bench's way (calls back to back, the L2 cleared before each, the mean; back_to_back_ms), the
backward as the forward + backward time minus the training-mode forward's. Not from our per-call times subtracted:
those put the backward 1-3 ms under the other two timings at I = 1024 (perf_notes rounds 24-25). Without a shared expert
(gpt-oss-120b, Qwen3-30B-A3B, a custom shape without one) the counts agree.
Shapes: the model shapes by name (--shapes, default all) at --tokens per rank, and custom ones, --shape
name:T:H:I:E:k[:shared] (repeatable; or as an entry of --shapes): T tokens per rank, shared the shared expert's
width (0 or absent: none, so the run is routed experts only; else I, the library's only width), checked by
mok.LayerShape's rules before anything runs (bench/shapes.py). E.g. SonicMoE's fine-grained shapes:
  --shape sonic512:32768:4096:512:128:8 --shape sonic1024:32768:4096:1024:128:8
Then the correctness checks on the same inputs (max over ranks): forward ||fused - base||_F / ||base||_F (fp32)
within 2e-2, fused == unfused bitwise; backward (d_x, d_rw, and every weight gradient, per expert: the largest
relative error over the experts of the six tensors; an expert whose reference is 0 must be 0) against the
baseline's autograd gradients within 3e-2 (bf16 budget: the baseline rounds every autograd step to bf16, about
twice the forward's chain of roundings; on small CPU shapes its own gradients sit 3-5e-3 from fp32), and
the fused-path layer's gradients == the unfused-path layer's bitwise (all of them, outputs poisoned with NaN
first). The exit status is 1 when any of these fails, is NaN, or a call of ours fails.
Memory: the routed weights, our gradients and the baseline's (and, in the check, a second set of ours) must
fit one GPU; DeepSeek-V4-Pro's routed weights alone are 51 GB at EP=1. --experts-fraction auto (default) runs a
shape whose estimated need exceeds the free memory with half its experts (same T, k, H, I; twice the rows per
expert; the FLOP count does not change), printed as "NAME E/2" with a note; a number (e.g. 0.5) forces it.
Context: the device bytes of one layer's ForwardContext (what training keeps from forward to backward per
layer, ForwardContext::bytes()).
Optional: liger-kernel's LigerFusedMoEFunction (routed experts only, EP=1: [E, 2I, H] gate/up, its own
routing), forward + backward timed alone when it is importable and fits, its forward checked against the
baseline's routed-only forward; otherwise a note says why it is skipped.
--timeline DIR also records the fused kernel's tasks and writes DIR/timeline_<shape>_ep<EP>_rank<r>.json
(Chrome trace; tools/timeline_png.py draws it); the records cost one store per task. --breakdown prints our GPU time
per kernel (torch.profiler) and, from the same records (so it turns them on too), the fused forward's phases and,
with --backward-megakernel, the fused backward's: per task kind its tasks, CTA-ms and share of the CTAs' time.
Output: rows tagged "fwd" (forward table) and "f+b" (forward + backward table) as each shape finishes; with
several shapes the two tables again at the end. --json PATH also writes the run and those rows, every column by its
header's name, unrounded (see write_results_json); --chart PATH draws them as a PNG bar chart (bench/chart_png.py:
per shape ours fused and unfused, the baseline and the dense ceiling in TFLOP/s, forward and forward + backward;
matplotlib when it imports, else a built-in renderer). Both are written by rank 0 after the tables, their paths
printed last.
Usage: python3 -m torch.distributed.run --standalone --nproc-per-node=2 bench/layer_bench.py   (EP=2)
       python3 bench/layer_bench.py                                                            (EP=1)
         [--lib build/bench/libmok_bench_capi.so] [--tokens 8192] [--iters 20] [--shapes A,B]
         [--shape name:T:H:I:E:k[:shared] ...] [--skew 0]
         [--load-factor F]
         [--backward | --no-backward] [--grad-mode bf16|fp32|accumulate] [--experts-fraction auto|F]
         [--only fused|unfused|base|fused-train|unfused-train|base-train|fused-bwd|unfused-bwd]
         [--check-only] [--breakdown] [--seed 0] [--comm-ctas N] [--minibatch ROWS] [--timeline DIR] [--backward-megakernel]
         [--json PATH] [--chart PATH]
"""
import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from capi import GRADS, grad_arrays, layer_options, load  # noqa: E402
from chart_png import chart_title, draw_layer_chart  # noqa: E402
import gemm_bench  # noqa: E402  (gemm_bench.LAST_CLOCKS: the SM clocks of the last timed turns)
from gemm_bench import TORCH_GROUP_ALIGN, clock_line, median, positive_int, timed_turns  # noqa: E402
from shapes import SPEC, check_shape, flops, select_shapes  # noqa: E402
from timeline_stats import load_events, phase_table  # noqa: E402

TOLERANCE = 2e-2  # forward: relative Frobenius error, bf16 level
GRAD_TOLERANCE = 3e-2  # backward: relative Frobenius error of d_x, d_rw and each expert's weight gradients
ERROR = ctypes.create_string_buffer(1024)
TIMELINE_RECORDS = 8192  # per CTA, with --timeline or --breakdown (later tasks are dropped; the breakdown says so)
MARGIN_BYTES = 4 << 30  # CUDA context, cuBLAS workspaces, allocator slack, the checks' chunk temporaries
CHUNK_ELEMENTS = 1 << 26  # elements per slice in the gradient comparisons (fp32 temporaries of 256 MB)
GRAD_MODES = {  # --grad-mode: (our gradients' dtype, mok::GradMode)
    "bf16": ("bf16", "write"), "fp32": ("fp32", "write"), "accumulate": ("fp32", "accumulate")}
ONLY = ["", "fused", "unfused", "base", "fused-train", "unfused-train", "base-train", "fused-bwd", "unfused-bwd"]


def check(rc):
    if rc != 0:
        raise RuntimeError(ERROR.value.decode(errors="replace"))


def max_over_ranks(tensor):
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def max_value_over_ranks(value):
    """A host float, the largest of every rank's (NaN counts as inf)."""
    value = float("inf") if value != value else value
    return max_over_ranks(torch.tensor([value], dtype=torch.float64, device="cuda")).item()


def time_ms(fns, iters, warmup_s=0.3):
    """gemm_bench.time_ms for functions that run collectives: the same warm-up and turns, but all ranks must make
    the same calls, so they agree when the warm-up ends (the shortest-running rank decides); a call's time is the
    slowest rank's (CUDA events on each rank, max over ranks), and each function's median of those is returned."""
    begin = time.time()
    while True:
        for fn in fns:
            fn()
        torch.cuda.synchronize()
        elapsed = torch.tensor([-(time.time() - begin)], device="cuda")
        if -max_over_ranks(elapsed).item() >= warmup_s:  # max of -elapsed = -(min elapsed)
            break
    times = timed_turns(fns, iters)
    slowest = max_over_ranks(torch.tensor(times, dtype=torch.float64, device="cuda")).tolist()
    return [median(t) for t in slowest]


def back_to_back_ms(fn, iters, flush_bytes=256 << 20):
    """SonicMoE's timing (its benchmarks/moe-cute.py times with triton.testing.do_bench): one call to warm up, then
    iters calls back to back (no synchronization between them, so the host's launch time hides behind the GPU's
    work), each after an L2-clearing write of flush_bytes and between its own CUDA events; the mean in ms, the
    slowest rank's (every rank makes the same calls)."""
    cache = torch.empty(flush_bytes, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, stop in events:
        cache.zero_()
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    return max_value_over_ranks(sum(start.elapsed_time(stop) for start, stop in events) / iters)


def make_inputs(num_experts, hidden, inter, top_k, shared, tokens, ep, rank, skew, seed):
    """One rank's data, in mok_bench_layer_forward's argument order (no shared weights without a shared expert)."""
    gen = torch.Generator(device="cuda").manual_seed(seed + rank)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=gen, **bf16)
    logits = torch.randn(tokens, num_experts, device="cuda", generator=gen)
    if skew > 0:
        perm = torch.randperm(num_experts, generator=torch.Generator().manual_seed(seed))  # same on all ranks
        logits += (-skew * torch.log1p(perm.float())).cuda()
    chosen, idx = logits.topk(top_k, dim=1)
    local = num_experts // ep

    def weight(*shape):  # fan_in = last dim
        return torch.randn(*shape, generator=gen, **bf16).mul_(shape[-1] ** -0.5)

    return dict(x=x, topk_idx=idx.to(torch.int32).contiguous(), router_weights=torch.softmax(chosen, dim=1).contiguous(),
                expert_gate=weight(local, inter, hidden), expert_up=weight(local, inter, hidden),
                expert_down=weight(local, hidden, inter), shared_gate=weight(inter, hidden) if shared else None,
                shared_up=weight(inter, hidden) if shared else None, shared_down=weight(hidden, inter) if shared else None)


def make_grad_output(tokens, hidden, rank, seed):
    """d_out [T, H] bf16 ~ randn, from its own generator (the forward's inputs stay those of make_inputs)."""
    gen = torch.Generator(device="cuda").manual_seed(2**31 + seed + rank)
    return torch.randn(tokens, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)


class AllToAllRows(torch.autograd.Function):
    """dist.all_to_all_single of rows [n, H] with autograd: the backward sends the gradient rows back with the
    splits swapped (torchtitan's all_to_all_single_autograd, here without the functional-collectives wrapper)."""

    @staticmethod
    def forward(ctx, rows, out_splits, in_splits):
        ctx.splits = out_splits, in_splits
        out = rows.new_empty(sum(out_splits), rows.shape[1])
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_rows = grad.new_empty(sum(in_splits), grad.shape[1])
        dist.all_to_all_single(grad_rows, grad.contiguous(), in_splits, out_splits)
        return grad_rows, None, None


def permute_indices(counts, ep, local, rows, align=TORCH_GROUP_ALIGN):
    """torchtitan's generate_permute_indices in torch ops (no host sync). counts: [ep * local] rows received,
    [src rank][local expert] order. Returns the gather index (length rows + local*align, rounded up to align;
    -1 = padding) into the received rows that gives expert-major order, each expert's group padded to a multiple
    of align rows (at least align), and the int32 cumulative group ends for torch._grouped_mm."""
    dev = counts.device
    grid = counts.view(ep, local)
    m_sizes = (grid.sum(0).clamp_min(align) + align - 1) // align * align
    m_offsets = torch.cumsum(m_sizes, 0)
    dest_start = ((m_offsets - m_sizes)[None, :] + torch.cumsum(grid, 0) - grid).flatten()  # group (src, e), expert-major
    src_start = torch.cumsum(counts, 0) - counts  # the same group in received order
    group = torch.repeat_interleave(torch.arange(ep * local, device=dev), counts, output_size=rows)
    dest = dest_start[group] + torch.arange(rows, device=dev) - src_start[group]
    max_len = (rows + local * align + align - 1) // align * align
    perm = torch.full((max_len,), -1, dtype=torch.int64, device=dev)
    perm[dest] = torch.arange(rows, device=dev)
    return perm, m_offsets.to(torch.int32)


def baseline_forward(x, topk_idx, router_weights, expert_gate, expert_up, expert_down, shared_gate, shared_up,
                     shared_down, ep=1):
    """The layer in torch ops; differentiable in x, the router weights and the weights (autograd)."""
    tokens, top_k = topk_idx.shape
    hidden, local = x.shape[1], expert_gate.shape[0]
    flat = topk_idx.flatten()
    # 1. rows per global expert; each rank learns what it receives ([src rank][local expert]); splits to the host
    # (torch.histc as torchtitan counts: unlike torch.bincount it does not read the largest id to the host)
    send_counts = torch.histc(flat.float(), bins=ep * local, min=0, max=ep * local).to(torch.int64)
    if ep > 1:
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        send_splits, recv_splits = torch.stack(
            [send_counts.view(ep, local).sum(1), recv_counts.view(ep, local).sum(1)]).tolist()  # host sync
        rows = sum(recv_splits)
    else:
        recv_counts, rows = send_counts, tokens * top_k
    # 2. routes sorted by global expert (so by destination rank), rows gathered and sent
    order = torch.argsort(flat, stable=True)
    x_recv = x[order // top_k]
    if ep > 1:
        x_recv = AllToAllRows.apply(x_recv, recv_splits, send_splits)
    # 3. expert-major, padded groups (torchtitan's _permute: a zero row appended for the -1 indices)
    perm, offs = permute_indices(recv_counts, ep, local, rows)
    x_e = torch.vstack((x_recv, x_recv.new_zeros(hidden)))[perm]
    # 4. the experts
    h = F.silu(torch._grouped_mm(x_e, expert_gate.transpose(-2, -1), offs=offs))
    h = h * torch._grouped_mm(x_e, expert_up.transpose(-2, -1), offs=offs)
    y = torch._grouped_mm(h, expert_down.transpose(-2, -1), offs=offs)
    # 5. back to received order (torchtitan's _unpermute), back to the source ranks, back to route order
    y_recv = y.new_empty(rows + 1, hidden)
    y_recv[perm] = y
    y_back = y_recv[:-1]
    if ep > 1:
        y_back = AllToAllRows.apply(y_back, send_splits, recv_splits)
    y_routes = torch.empty_like(y_back)
    y_routes[order] = y_back
    # 6. shared expert, weighted sum
    routed = (y_routes.view(tokens, top_k, hidden).float() * router_weights[..., None]).sum(1)
    if shared_gate is None:
        return routed.bfloat16()
    shared = torch.mm(F.silu(torch.mm(x, shared_gate.t())) * torch.mm(x, shared_up.t()), shared_down.t())
    return (shared.float() + routed).bfloat16()


def create_layer(lib, rank, **options):
    """Collective: every rank calls it at the same time. Rank 0's NCCL unique id goes to the others. options: the
    layer's shape and options by name (capi.layer_options: Python LayerShape's and Config's field names, e.g.
    ep_size=2, path="unfused", backward_megakernel=True); one left out keeps the library's default."""
    uid = None
    if options.get("ep_size", 1) > 1:
        uid = (ctypes.c_uint8 * 128)()
        shared_id = torch.zeros(128, dtype=torch.uint8, device="cuda")
        if rank == 0:
            check(lib.mok_bench_nccl_unique_id(uid, ERROR, len(ERROR)))
            shared_id.copy_(torch.tensor(list(uid), dtype=torch.uint8))
        dist.broadcast(shared_id, src=0)
        uid = (ctypes.c_uint8 * 128)(*shared_id.tolist())
    layer = lib.mok_bench_layer_create(uid, rank, torch.cuda.current_device(), *layer_options(**options), ERROR,
                                       len(ERROR))
    if not layer:
        raise RuntimeError(ERROR.value.decode(errors="replace"))
    return layer


def context_bytes(lib, layer):
    """Bytes of the layer's forward context (ForwardContext::bytes())."""
    value = lib.mok_bench_layer_context_bytes(layer, ERROR, len(ERROR))
    if value < 0:
        raise RuntimeError(ERROR.value.decode(errors="replace"))
    return value


def dense_ceiling(tokens, top_k, shared, hidden, inter):
    rows = tokens * (top_k + int(shared))
    a1, b1 = (torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in ((rows, hidden), (hidden, 2 * inter)))
    a2, b2 = (torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in ((rows, inter), (inter, hidden)))
    c1 = torch.empty(rows, 2 * inter, device="cuda", dtype=torch.bfloat16)
    c2 = torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)
    return lambda: (torch.mm(a1, b1, out=c1), torch.mm(a2, b2, out=c2))


def dense_training_ceiling(tokens, top_k, shared, hidden, inter):
    """The forward's two GEMMs and their four backward GEMMs at M = T*(k+1) rows (T*k without a shared expert):
    18 * M * H * I flops, 3x the forward's."""
    rows = tokens * (top_k + int(shared))

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    x, w1, d_gu = randn(rows, hidden), randn(hidden, 2 * inter), randn(rows, 2 * inter)  # gate/up: x·w1 -> [M, 2I]
    h, w2, d_y = randn(rows, inter), randn(inter, hidden), randn(rows, hidden)  # down: h·w2 -> [M, H]
    gu, y = torch.empty_like(d_gu), torch.empty_like(d_y)
    d_h, d_w2 = torch.empty_like(h), torch.empty_like(w2)
    d_x, d_w1 = torch.empty_like(x), torch.empty_like(w1)

    def run():
        torch.mm(x, w1, out=gu)
        torch.mm(h, w2, out=y)
        torch.mm(d_y, w2.t(), out=d_h)     # down dgrad [M,H]x[H,I]
        torch.mm(h.t(), d_y, out=d_w2)     # down wgrad [I,M]x[M,H]
        torch.mm(d_gu, w1.t(), out=d_x)    # gate/up dgrad [M,2I]x[2I,H]
        torch.mm(x.t(), d_gu, out=d_w1)    # gate/up wgrad [H,M]x[M,2I]
    return run


def torch_side_bytes(local_experts, hidden, inter, shared, tokens, top_k, grad_bytes, backward):
    """Estimated peak device bytes of one shape beside our layers: the weights, and with the backward our
    gradients and, at once, either the baseline's gradients and autograd activations (timing, the check's first
    half) or a second set of ours (the check's fused == unfused comparison); plus MARGIN_BYTES."""
    weights = 2 * 3 * hidden * inter * (local_experts + int(shared))
    rows = tokens * top_k + local_experts * TORCH_GROUP_ALIGN
    # baseline per routed row: x_e, g, u, silu, h, y and its three reorderings (bf16), the fp32 weighted terms,
    # and about as much again in the backward's transient gradients; per token the shared expert's
    activations = rows * (24 * hidden + 16 * inter) + tokens * (8 * hidden + 16 * inter)
    if not backward:
        return weights + activations + MARGIN_BYTES
    ours = weights // 2 * grad_bytes
    return weights + ours + max(weights + activations, ours) + MARGIN_BYTES


def mangled_function(key):
    """The function's own name in an Itanium-mangled nested name (`_ZN3mok4gemm18expert_gemm_kernelI...` ->
    `expert_gemm_kernel`: the profiler leaves some long template names mangled), or None for any other key."""
    if not key.startswith("_ZN"):
        return None
    i, name = 3, None
    while i < len(key) and key[i].isdigit():
        j = i
        while j < len(key) and key[j].isdigit():
            j += 1
        length = int(key[i:j])
        name, i = key[j:j + length], j + length
    return name


def fp8_epilogue(key):
    """An FP8 expert GEMM kernel's epilogue type, from its (mangled or demangled) name; the wide tiles' traits
    (Fp8WideStoreTraits, Fp8WideGateUp...) name theirs only through the traits."""
    match = re.search(r"(SwiGLUBackward|SwiGLUQuant|SwiGLU|Store)Epilogue|Fp8Wide(Store|GateUp)", key)
    if match is None:
        return "?"
    if match.group(1):
        return match.group(1) + "Epilogue"
    return {"Store": "StoreEpilogue", "GateUp": "SwiGLUQuantEpilogue"}[match.group(2)]


def kernel_breakdown(fn, iters=5):
    """GPU time per call by kernel (torch.profiler sees our library's kernels too): [(name, ms)], largest first.
    Kernels of one template are told apart by their epilogue (the shared expert's GEMMs are in the same rows), and
    the FP8 expert GEMMs by their operands and epilogue type."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    totals = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us <= 0 or event.key.startswith("cuda"):  # runtime API rows, not kernels
            continue
        match = re.search(r"(\w+_kernel)", event.key)
        label = mangled_function(event.key) or (match.group(1) if match else event.key[:40])
        if label == "expert_gemm_kernel" and re.search(r"Fp8Mainloop|Fp8Wide", event.key):
            label += " fp8 " + fp8_epilogue(event.key)
        elif label == "expert_gemm_kernel":
            label += " swiglu" if re.search(r"Epilogue\)1|kSwiGLU", event.key) else " store"
        totals[label] = totals.get(label, 0) + us / 1e3 / iters
    return sorted(totals.items(), key=lambda kv: -kv[1])


def megakernel_phases(lib, layer, stream, what, name, ep, rank):
    """--breakdown's per-phase lines of the megakernel the last call ran (its timeline records: the kernel_breakdown
    call before this one ran it last), rank 0's."""
    if rank != 0:
        return []
    torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"timeline_{name}_ep{ep}.json")
        check(lib.mok_bench_layer_write_timeline(layer, stream, path.encode(), ERROR, len(ERROR)))
        return phase_table(load_events(path), what, TIMELINE_RECORDS)


def slices(*tensors):
    """The tensors cut along dim 0 into slices of about CHUNK_ELEMENTS (a 2-D tensor is one slice)."""
    if tensors[0].dim() < 3:
        yield tuple(t[None] for t in tensors)
        return
    step = max(1, CHUNK_ELEMENTS // tensors[0][0].numel())
    for begin in range(0, tensors[0].shape[0], step):
        yield tuple(t[begin:begin + step] for t in tensors)


def relative_error(ours, ref):
    """||ours - ref||_F / ||ref||_F in fp32 (NaN -> inf)."""
    err = (ours.float() - ref.float()).norm() / ref.float().norm()
    return err.nan_to_num(nan=float("inf"), posinf=float("inf")).item()


def expert_relative_error(ours, ref):
    """The largest relative Frobenius error over the experts of a [E, rows, cols] gradient (a 2-D gradient is one
    expert); an expert whose reference is all zero must be all zero (else inf); NaN -> inf."""
    worst = 0.0
    for a, b in slices(ours, ref):
        a, b = a.float(), b.float()
        diff = (a - b).pow(2).sum(dim=(1, 2)).sqrt()
        norm = b.pow(2).sum(dim=(1, 2)).sqrt()
        err = torch.where(norm > 0, diff / norm.clamp_min(1e-30), torch.where(diff > 0, float("inf"), 0.0))
        worst = max(worst, err.nan_to_num(nan=float("inf"), posinf=float("inf")).max().item())
    return worst


def bitwise_equal(a, b):
    """Same bits (NaN and -0 included), slice by slice."""
    as_int = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
    return all(torch.equal(x.view(as_int[x.dtype]), y.view(as_int[y.dtype])) for x, y in slices(a, b))


def liger_function():
    """(LigerFusedMoEFunction or None, why not)."""
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except Exception as e:  # not installed, or an import error of its own (triton, transformers)
        return None, f"liger-kernel not importable ({type(e).__name__}: {str(e)[:80]})"
    return LigerFusedMoEFunction, ""


def run_liger(args, inputs, d_out, top_k, hidden, inter, tokens):
    """liger-kernel's routed experts, forward + backward timed alone, and its forward's relative error against the
    baseline's routed-only forward: (ms or None, relerr or None, note)."""
    fn, why = liger_function()
    if fn is None:
        return None, None, why
    local = inputs["expert_gate"].shape[0]
    routed = 2 * 3 * hidden * inter * local
    rows = tokens * top_k
    need = routed * 2 // 3 + routed + rows * (8 * hidden + 24 * inter) + MARGIN_BYTES  # [E,2I,H] copy, grads, buffers
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    if need > free:
        return None, None, f"liger skipped: needs about {need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"
    with torch.no_grad():
        gate_up = torch.cat([inputs["expert_gate"], inputs["expert_up"]], dim=1)  # liger: gate rows, then up rows
    gate_up.requires_grad_(True)
    x, rw, down, idx = inputs["x"], inputs["router_weights"], inputs["expert_down"], inputs["topk_idx"]
    leaves = (x, rw, gate_up, down)
    try:
        with torch.no_grad():
            ref = baseline_forward(**dict(inputs, shared_gate=None, shared_up=None, shared_down=None)).float()
            err = relative_error(fn.apply(x, gate_up, down, idx, rw), ref)
            del ref

        def step():
            for t in leaves:
                t.grad = None
            fn.apply(x, gate_up, down, idx, rw).backward(d_out)

        ms = None
        if not args.check_only:
            (ms,) = time_ms([step], args.iters)
        for t in leaves:
            t.grad = None
        return ms, err, ""
    except Exception as e:  # its failure is a note, not ours
        for t in leaves:
            t.grad = None
        return None, None, f"liger failed ({type(e).__name__}: {str(e)[:120]})"


def format_cells(cells):
    return " ".join(f"{'-' if v is None else format(v, f):>{w}}" for v, w, f in cells)


FORWARD_HEADER = (f"fwd {'shape':20s} {'EP':>2s} {'comm':>5s} {'fused_ms':>9s} {'unfused_ms':>10s} {'base_ms':>9s} "
                  f"{'fused_TF':>9s} {'base_TF':>8s} {'dense_TF':>9s} {'sonic_TF':>8s} {'fused/base':>11s} "
                  f"{'fused/dense':>12s} {'unfused/base':>13s} {'relerr':>9s} {'bitwise':>8s}")
TRAIN_HEADER = (f"f+b {'shape':20s} {'EP':>2s} {'ctx_MiB':>8s} {'fb_fused':>9s} {'fb_unfused':>10s} {'bwd_fused':>9s} "
                f"{'bwd_unfused':>11s} {'fb_base':>8s} {'fused_TF':>8s} {'base_TF':>8s} {'dense_TF':>8s} "
                f"{'bwd_TF':>7s} {'sonic_bwd_TF':>12s} {'fused/base':>10s} {'fused/dense':>11s} {'unfused/base':>12s} "
                f"{'dx_err':>8s} {'drw_err':>8s} {'dw_err':>8s} {'bitwise':>7s}")
FORWARD_COLUMNS = FORWARD_HEADER.split()[1:]  # the names of a row's cells, as printed (--json's keys)
TRAIN_COLUMNS = TRAIN_HEADER.split()[1:]


def ratio(a, b):
    return a and b and a / b


def table_record(table, columns, leading, cells, bitwise, unfused_tf, dims):
    """A printed row as {column: value}: the leading cells (shape, EP[, comm]), the formatted cells' values, the
    bitwise cell (True, False, None for "-"); plus table, unfused_TF (not printed: the chart's unfused bar) and
    dims (not printed: the shape's T, H, I, E (the experts it ran with), k and shared width, ShapeResult.dims)."""
    values = leading + [value for value, _, _ in cells] + [bitwise]
    assert len(values) == len(columns), f"{table}: {len(values)} cells for {len(columns)} columns"
    return dict(table=table, **dict(zip(columns, values)), unfused_TF=unfused_tf, dims=dims)


def write_results_json(path, run, records, failed):
    """{"run": the header line's conditions, "columns": each table's printed column names, "rows": the printed rows
    as table_record makes them, in print order, "failed": the failed checks}. Non-finite floats are written as
    Python's json writes them (NaN, Infinity)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(run=run, columns={"fwd": FORWARD_COLUMNS, "f+b": TRAIN_COLUMNS}, rows=records, failed=failed),
                  f, indent=1)
        f.write("\n")


def write_outputs(args, run, records, failed):
    """--json and --chart (rank 0, after the tables); prints their paths. A chart with nothing to draw (no timed
    rows: --check-only, --only) is a printed note, not a failure; so is a matplotlib that imports but fails (the
    built-in renderer draws the chart then)."""
    if args.json:
        write_results_json(args.json, run, records, failed)
        print(f"json: {args.json}", flush=True)
    if not args.chart:
        return
    os.makedirs(os.path.dirname(args.chart) or ".", exist_ok=True)
    try:
        renderer = draw_layer_chart(records, args.chart, chart_title(run))
    except ValueError as e:
        print(f"{e}; no PNG written", flush=True)
        return
    except Exception as e:  # noqa: BLE001 (matplotlib's own failure: the numbers are fine)
        renderer = draw_layer_chart(records, args.chart, chart_title(run), "builtin")
        renderer += f"; matplotlib failed: {type(e).__name__}: {str(e)[:120]}"
    print(f"chart: {args.chart} ({renderer})", flush=True)


def run_shape(lib, args, ep, rank, shape):
    """Times and checks one shape (shapes.Shape; tokens None: --tokens): a ShapeResult. Everything it allocates is
    freed on return."""
    name, num_experts, hidden, inter, top_k, shared = (shape.name, shape.num_experts, shape.hidden, shape.inter,
                                                       shape.top_k, shape.shared)
    tokens = args.tokens if shape.tokens is None else shape.tokens
    stream = torch.cuda.current_stream().cuda_stream
    backward = args.backward and (not args.only or "-" in args.only)  # --only of a forward needs no gradients
    only_path = args.only.split("-")[0]
    grad_dtype, grad_mode = GRAD_MODES[args.grad_mode]
    grad_bytes = 4 if grad_dtype == "fp32" else 2
    notes = []
    if shape.tokens is not None:
        notes.append(f"{name}: custom shape T={tokens} tokens per rank, H={hidden}, I={inter}, E={num_experts}, "
                     f"k={top_k}, " + ("a shared expert of width I" if shared else "routed experts only"))
    layers = {}

    def create_layers(experts):
        for path in ("fused", "unfused"):
            if not args.only or only_path == path:
                options = dict(ep_size=ep, num_tokens=tokens, top_k=top_k, num_experts=experts, hidden=hidden,
                               intermediate=inter, shared_expert=bool(shared), path=path, comm_ctas=args.comm_ctas)
                if path == "fused":
                    options["backward_megakernel"] = bool(args.backward_megakernel)
                    if args.timeline or args.breakdown:
                        options["timeline_records"] = TIMELINE_RECORDS
                if path == "unfused" and args.gather_rows:
                    # MoeOptions::gather_rows; without the backward the expert-major copy of x is skipped (EP = 1)
                    options["gather_rows"] = True
                    options["backward"] = bool(backward)
                if args.scatter_rows:
                    # MoeOptions::scatter_rows: the unfused down GEMM and the stage backward's gate/up dgrad write
                    # the combine rows (the fused forward ignores it)
                    options["scatter_rows"] = True
                if args.minibatch:
                    options["minibatch_rows"] = args.minibatch
                if args.load_factor:
                    options["load_factor"] = args.load_factor
                layers[path] = create_layer(lib, rank, **options)

    def destroy_layers():
        torch.cuda.synchronize()
        for layer in layers.values():
            lib.mok_bench_layer_destroy(layer)
        layers.clear()

    try:
        # The experts this run holds: all, a forced fraction, or half when the estimate does not fit (decided after
        # our layers took their memory; every rank takes the same decision).
        experts = num_experts if args.experts_fraction == "auto" else round(num_experts * float(args.experts_fraction))
        if experts % ep or experts < top_k:
            raise SystemExit(f"{name}: --experts-fraction {args.experts_fraction} gives {experts} experts, not a "
                             f"multiple of EP={ep} of at least k={top_k}")
        create_layers(experts)
        if args.experts_fraction == "auto":
            need = torch_side_bytes(experts // ep, hidden, inter, shared, tokens, top_k, grad_bytes, backward)
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info()[0]
            if max_value_over_ranks(float(need > free)) > 0 and (experts // 2) % ep == 0:
                destroy_layers()
                experts //= 2
                create_layers(experts)
                notes.append(f"{name}: run with {experts} of its {num_experts} experts: weights, gradients and the "
                             f"baseline need about {need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free")
        label = (name if experts == num_experts else f"{name} E/{num_experts // experts}"
                 if num_experts % experts == 0 else f"{name} E={experts}")

        inputs = make_inputs(experts, hidden, inter, top_k, shared, tokens, ep, rank, args.skew, args.seed)
        pointers = [0 if t is None else t.data_ptr() for t in inputs.values()]
        pointers.insert(2, 0)  # topk_dtype after topk_idx: int32 ids
        outs = {path: torch.empty(tokens, hidden, device="cuda", dtype=torch.bfloat16) for path in layers}
        weights = {n: inputs[n] for n in GRADS if inputs[n] is not None}
        leaves = [t for t in inputs.values() if t is not None and t.is_floating_point()]  # x, rw and the weights

        def ours_forward(path):
            return lambda: check(lib.mok_bench_layer_forward(layers[path], *pointers, outs[path].data_ptr(), stream,
                                                             ERROR, len(ERROR)))

        def base_forward():
            with torch.no_grad():
                return baseline_forward(ep=ep, **inputs)

        ctx = {path: context_bytes(lib, layer) for path, layer in layers.items()}
        if len(set(ctx.values())) > 1:
            notes.append(f"{name}: context bytes per layer " +
                         ", ".join(f"{p} {v / 2**20:.1f} MiB" for p, v in ctx.items()))
        ctx_mib = next(iter(ctx.values())) / 2**20 if ctx else None

        # ---- the backward's buffers and calls
        if backward:
            d_out = make_grad_output(tokens, hidden, rank, args.seed)
            for t in leaves:
                t.requires_grad_(True)
            d_x = {path: torch.empty(tokens, hidden, device="cuda", dtype=torch.bfloat16) for path in layers}
            d_rw = {path: torch.empty(tokens, top_k, device="cuda", dtype=torch.float32) for path in layers}
            torch_dtype = torch.float32 if grad_dtype == "fp32" else torch.bfloat16

            def new_grads():
                return {n: (torch.zeros if grad_mode == "accumulate" else torch.empty)(
                    w.shape, device="cuda", dtype=torch_dtype) for n, w in weights.items()}

            def arrays_of(grads):
                return grad_arrays(grads, {n: grad_dtype for n in grads}, {n: grad_mode for n in grads})

            grads = new_grads() if layers else {}  # written by every timed call of both paths; the check's fused set
            arrays = arrays_of(grads)

            def ours_backward(path, arrays=arrays):
                return lambda: check(lib.mok_bench_layer_backward(
                    layers[path], *pointers, d_out.data_ptr(), d_x[path].data_ptr(), d_rw[path].data_ptr(), *arrays,
                    stream, ERROR, len(ERROR)))

            def ours_train(path, arrays=arrays):
                forward, backward_call = ours_forward(path), ours_backward(path, arrays)
                return lambda: (forward(), backward_call())

            def base_train():
                for t in leaves:
                    t.grad = None
                baseline_forward(ep=ep, **inputs).backward(d_out)

        times = {}
        clocks = {}  # the SM clock of each timed call, printed after the timing (gemm_bench.timed_turns)
        fwd = dict(relerr=None, bitwise=None)
        bwd = dict(dx=None, drw=None, dw=None, worst="", bitwise=None, error=None)
        if args.only:
            calls = dict(base=base_forward)
            calls.update({p: ours_forward(p) for p in layers})
            if backward:
                calls["base-train"] = base_train
                calls.update({f"{p}-train": ours_train(p) for p in layers})
                calls.update({f"{p}-bwd": ours_backward(p) for p in layers})
            if args.only.endswith("-bwd"):
                ours_forward(only_path)()  # the context the backward reads
            begin = time.time()
            (times[args.only],) = time_ms([calls[args.only]], args.iters)
            if rank == 0:
                print(f"{label}: {args.only} only, {times[args.only]:.3f} ms, wall {begin:.2f} {time.time():.2f}",
                      flush=True)
        else:
            if not args.check_only:
                # Ours and the baseline in turns (all stream every expert weight); each dense ceiling alone, in its
                # own steady state (it draws less power and keeps a higher clock).
                times["fused"], times["unfused"], times["base"] = time_ms(
                    [ours_forward("fused"), ours_forward("unfused"), base_forward], args.iters)
                clocks.update(zip(["fused", "unfused", "base"], gemm_bench.LAST_CLOCKS))
                (times["dense"],) = time_ms([dense_ceiling(tokens, top_k, shared, hidden, inter)], args.iters)
                clocks["dense"] = gemm_bench.LAST_CLOCKS[0]
            # Forward: fused vs the baseline, fused == unfused.
            for path in layers:
                outs[path].fill_(float("nan"))  # a row ours does not write shows as NaN
                ours_forward(path)()
                check(lib.mok_bench_layer_check_status(layers[path], stream, ERROR, len(ERROR)))
            ref = base_forward().float()
            fwd["relerr"] = max_value_over_ranks(relative_error(outs["fused"], ref))
            del ref
            fwd["bitwise"] = max_value_over_ranks(float(not bitwise_equal(outs["fused"], outs["unfused"]))) == 0
            if backward:
                try:  # at EP=1 a failed backward still leaves the forward's row
                    if not args.check_only:
                        (times["fb_fused"], times["fb_unfused"], times["bwd_fused"], times["bwd_unfused"],
                         times["fb_base"]) = time_ms([ours_train("fused"), ours_train("unfused"),
                                                      ours_backward("fused"), ours_backward("unfused"), base_train],
                                                     args.iters)
                        clocks.update(zip(["fb_fused", "fb_unfused", "bwd_fused", "bwd_unfused", "fb_base"],
                                          gemm_bench.LAST_CLOCKS))
                        for t in leaves:
                            t.grad = None
                        (times["fb_dense"],) = time_ms([dense_training_ceiling(tokens, top_k, shared, hidden, inter)],
                                                       args.iters)
                        clocks["fb_dense"] = gemm_bench.LAST_CLOCKS[0]
                        torch.cuda.empty_cache()
                    check_backward(lib, layers, stream, leaves, inputs, weights, grads, new_grads, arrays_of,
                                   grad_mode == "accumulate", d_x, d_rw, base_train, ours_train, bwd)
                except RuntimeError as e:
                    if ep > 1:
                        raise  # the other ranks would wait in a collective
                    bwd["error"] = str(e)
                    for t in leaves:
                        t.grad = None
        line = clock_line(list(clocks), list(clocks.values()))
        if line and rank == 0:
            print(f"  {label}: {line}", flush=True)
        if args.sonic_timing and "fused" in layers and not args.only and not args.check_only:
            # --sonic-timing: the fused forward and forward + backward timed as SonicMoE's benchmark times its own
            times["sonic_fused"] = back_to_back_ms(ours_forward("fused"), args.iters)
            if backward and not bwd["error"]:
                times["sonic_fb_fused"] = back_to_back_ms(ours_train("fused"), args.iters)
            timed = f"forward {times['sonic_fused']:.2f} ms"
            if "sonic_fb_fused" in times:
                timed += f", forward + backward {times['sonic_fb_fused']:.2f} ms"
            notes.append(f"{name}: sonic_TF and sonic_bwd_TF timed as SonicMoE's benchmark times its own (calls back "
                         f"to back, the L2 cleared before each, the mean of {args.iters}): {timed}")
        if args.timeline and "fused" in layers:
            os.makedirs(args.timeline, exist_ok=True)
            path = os.path.join(args.timeline, f"timeline_{name}_ep{ep}_rank{rank}.json")
            check(lib.mok_bench_layer_write_timeline(layers["fused"], stream, path.encode(), ERROR, len(ERROR)))
        breakdown, phases = {}, []
        if args.breakdown:
            for path in layers:
                breakdown[f"{path} forward"] = kernel_breakdown(ours_forward(path))
                if path == "fused":
                    phases += megakernel_phases(lib, layers[path], stream, "fused forward", name, ep, rank)
                if backward and not bwd["error"]:
                    breakdown[f"{path} backward"] = kernel_breakdown(ours_backward(path))
                    if path == "fused" and args.backward_megakernel:
                        phases += megakernel_phases(lib, layers[path], stream, "fused backward", name, ep, rank)
        comm_ctas = lib.mok_bench_layer_comm_ctas(layers["fused"]) if "fused" in layers else 0

        liger = None
        if backward and ep == 1 and not args.only:
            grads.clear()  # our gradients and the baseline's go: room for liger's gate/up copy and its gradients
            for t in leaves:
                t.grad = None
            liger = run_liger(args, inputs, d_out, top_k, hidden, inter, tokens)
    finally:
        destroy_layers()

    return ShapeResult(label=label, ep=ep, tokens=tokens, experts=experts, top_k=top_k, hidden=hidden, inter=inter,
                       shared=shared, backward=backward, times=times, fwd=fwd, bwd=bwd, ctx_mib=ctx_mib,
                       comm_ctas=comm_ctas, liger=liger, notes=notes, breakdown=breakdown, phases=phases)


class ShapeResult:
    """What run_shape measured for one shape; rows() prints them, failures() judges them."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def tflops(self):
        """TFLOP/s of every timed call in our convention (shapes.flops "ours": 6 (forward), 18 (fwd+bwd) or 12
        (backward) x routes x H x I, the shared expert counting as a route), keyed as times; plus, in SonicMoE's
        convention (routed experts only), sonic_fused: the fused forward; sonic_bwd_fused: the fused backward. With
        --sonic-timing's back-to-back times (sonic_fused, sonic_fb_fused) both are SonicMoE's timing, the backward
        as forward + backward minus forward (none when that is not positive); else ours (fused, bwd_fused)."""
        def rate(key, kind, convention="ours", t=None):
            t = self.times.get(key) if t is None else t
            count = flops(kind, convention, self.tokens, self.top_k, self.hidden, self.inter, self.shared)
            return t and t > 0 and count / t / 1e9

        kinds = dict(fused="fwd", unfused="fwd", base="fwd", dense="fwd", fb_fused="f+b", fb_unfused="f+b",
                     fb_base="f+b", fb_dense="f+b", bwd_fused="bwd", bwd_unfused="bwd")
        rates = {k: rate(k, kind) for k, kind in kinds.items()}
        if "sonic_fb_fused" in self.times:
            backward = self.times["sonic_fb_fused"] - self.times["sonic_fused"]
        else:
            backward = self.times.get("bwd_fused")
        rates.update(sonic_fused=rate("sonic_fused" if "sonic_fused" in self.times else "fused", "fwd", "sonic"),
                     sonic_bwd_fused=backward and rate(None, "bwd", "sonic", backward))
        return {k: v for k, v in rates.items() if v}

    def dims(self):
        """The shape as run: T (tokens per rank), H, I, E (the experts it ran with), k, shared (width, 0: none)."""
        return dict(T=self.tokens, H=self.hidden, I=self.inter, E=self.experts, k=self.top_k,
                    shared=self.inter if self.shared else 0)

    def rows(self, rows_out, records_out):
        """Prints the shape's table rows (appended to rows_out, and as {column: value} to records_out: the printed
        cells unrounded, None for "-", plus unfused_TF, the chart's), its notes and its kernel breakdown."""
        t, tf, fwd, bwd, label = self.times, self.tflops(), self.fwd, self.bwd, self.label
        same = "-" if fwd["bitwise"] is None else ("yes" if fwd["bitwise"] else "NO")
        cells = [(t.get("fused"), 9, ".2f"), (t.get("unfused"), 10, ".2f"), (t.get("base"), 9, ".2f"),
                 (tf.get("fused"), 9, ".0f"), (tf.get("base"), 8, ".0f"), (tf.get("dense"), 9, ".0f"),
                 (tf.get("sonic_fused"), 8, ".0f"), (ratio(t.get("base"), t.get("fused")), 11, ".2f"),
                 (ratio(t.get("dense"), t.get("fused")), 12, ".2f"),
                 (ratio(t.get("base"), t.get("unfused")), 13, ".2f"), (fwd["relerr"], 9, ".1e")]
        rows_out.append(f"fwd {label:20s} {self.ep:2d} {self.comm_ctas:5d} {format_cells(cells)} {same:>8s}")
        print(rows_out[-1], flush=True)
        records_out.append(table_record("fwd", FORWARD_COLUMNS, [label, self.ep, self.comm_ctas], cells,
                                        fwd["bitwise"], tf.get("unfused"), self.dims()))
        if self.backward:
            same = "-" if bwd["bitwise"] is None else ("yes" if bwd["bitwise"] else "NO")
            cells = [(self.ctx_mib, 8, ".1f"), (t.get("fb_fused"), 9, ".2f"), (t.get("fb_unfused"), 10, ".2f"),
                     (t.get("bwd_fused"), 9, ".2f"), (t.get("bwd_unfused"), 11, ".2f"), (t.get("fb_base"), 8, ".2f"),
                     (tf.get("fb_fused"), 8, ".0f"), (tf.get("fb_base"), 8, ".0f"), (tf.get("fb_dense"), 8, ".0f"),
                     (tf.get("bwd_fused"), 7, ".0f"), (tf.get("sonic_bwd_fused"), 12, ".0f"),
                     (ratio(t.get("fb_base"), t.get("fb_fused")), 10, ".2f"),
                     (ratio(t.get("fb_dense"), t.get("fb_fused")), 11, ".2f"),
                     (ratio(t.get("fb_base"), t.get("fb_unfused")), 12, ".2f"), (bwd["dx"], 8, ".1e"),
                     (bwd["drw"], 8, ".1e"), (bwd["dw"], 8, ".1e")]
            rows_out.append(f"f+b {label:20s} {self.ep:2d} {format_cells(cells)} {same:>7s}")
            print(rows_out[-1], flush=True)
            records_out.append(table_record("f+b", TRAIN_COLUMNS, [label, self.ep], cells, bwd["bitwise"],
                                            tf.get("fb_unfused"), self.dims()))
        notes = list(self.notes)
        if self.liger is not None:
            ms, err, why = self.liger
            if err is not None:
                routed = flops("f+b", "sonic", self.tokens, self.top_k, self.hidden, self.inter, self.shared)
                timed = "not timed" if ms is None else f"{ms:.2f} ms, {routed / ms / 1e9:.0f} TFLOP/s (18*T*k*H*I)"
                ours = "" if not tf.get("fb_fused") else f" (ours fused: {tf['fb_fused']:.0f} TFLOP/s, whole layer)"
                notes.append(f"{label}: liger-kernel LigerFusedMoEFunction, routed experts only: fwd+bwd "
                             f"{timed}{ours}; its forward vs the baseline's routed-only forward: relerr {err:.1e}")
            else:
                notes.append(f"{label}: {why}")
        if bwd["error"]:
            notes.append(f"{label}: backward FAILED: {bwd['error']}")
        for note in notes:
            print(f"    note: {note}", flush=True)
        for what, rows in self.breakdown.items():
            for kernel, ms in rows:
                print(f"    {what:16s} {kernel:36s} {ms:7.3f} ms per call (rank 0)", flush=True)
        for line in self.phases:
            print(line, flush=True)

    def failures(self):
        """Texts of the checks that failed (an error above its budget or NaN, a bitwise difference, a failed
        backward)."""
        fwd, bwd, label = self.fwd, self.bwd, self.label
        failures = []
        if fwd["relerr"] is not None and not fwd["relerr"] <= TOLERANCE:
            failures.append(f"{label} (forward relative error {fwd['relerr']:.2e})")
        if fwd["bitwise"] is False:
            failures.append(f"{label} (fused and unfused outputs differ)")
        for key, what in (("dx", "d_x"), ("drw", "d_rw"), ("dw", f"weight gradient {bwd['worst']}")):
            if bwd[key] is not None and not bwd[key] <= GRAD_TOLERANCE:
                failures.append(f"{label} ({what} relative error {bwd[key]:.2e})")
        if bwd["bitwise"] is False:
            failures.append(f"{label} (fused-path and unfused-path gradients differ)")
        if bwd["error"]:
            failures.append(f"{label} (backward failed)")
        return failures


def check_backward(lib, layers, stream, leaves, inputs, weights, grads, new_grads, arrays_of, accumulate, d_x, d_rw,
                   base_train, ours_train, result):
    """Fills result (dx, drw, dw: relative errors against the baseline's autograd gradients, max over ranks; worst:
    the weight gradient with the largest; bitwise: fused-path == unfused-path gradients on every rank). Holds at
    most the weights, two sets of gradients and the baseline's activations at once."""
    for t in leaves:
        t.grad = None
    base_train()
    ref_dx, ref_drw = inputs["x"].grad, inputs["router_weights"].grad
    ref_grads = {n: w.grad for n, w in weights.items()}
    for t in leaves:
        t.grad = None

    def run(path, grad_set):
        d_x[path].fill_(float("nan"))
        d_rw[path].fill_(float("nan"))
        for g in grad_set.values():  # written gradients must cover everything; accumulated ones start at 0
            g.zero_() if accumulate else g.fill_(float("nan"))
        ours_train(path, arrays_of(grad_set))()
        check(lib.mok_bench_layer_check_status(layers[path], stream, ERROR, len(ERROR)))
        torch.cuda.synchronize()

    run("fused", grads)
    result["dx"] = max_value_over_ranks(relative_error(d_x["fused"], ref_dx))
    result["drw"] = max_value_over_ranks(relative_error(d_rw["fused"], ref_drw))
    per_weight = {n: max_value_over_ranks(expert_relative_error(grads[n], ref_grads[n])) for n in grads}
    result["worst"] = max(per_weight, key=per_weight.get)
    result["dw"] = per_weight[result["worst"]]
    del ref_dx, ref_drw, ref_grads
    unfused_grads = new_grads()
    run("unfused", unfused_grads)
    same = (bitwise_equal(d_x["fused"], d_x["unfused"]) and bitwise_equal(d_rw["fused"], d_rw["unfused"])
            and all(bitwise_equal(grads[n], unfused_grads[n]) for n in grads))
    result["bitwise"] = max_value_over_ranks(float(not same)) == 0
    del unfused_grads
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lib", default="build/bench/libmok_bench_capi.so")
    parser.add_argument("--tokens", type=positive_int, default=8192, help="tokens per rank")
    parser.add_argument("--iters", type=positive_int, default=20, help="timed calls per function (median)")
    parser.add_argument("--shapes", default="",
                        help=f"comma-separated names of model shapes, or custom shapes {SPEC} (default: every model "
                        "shape, unless --shape is given)")
    parser.add_argument("--shape", action="append", default=[], metavar=SPEC,
                        help="a custom shape (repeatable; after --shapes' shapes): T tokens per rank, H, I, E experts, "
                        "top-k, shared: the shared expert's width, 0 or absent for none (routed experts only), else I; "
                        "e.g. fine512:32768:4096:512:128:8")
    parser.add_argument("--skew", type=float, default=0.0, help="routing skew s: bias -s*log(1+perm(e))")
    parser.add_argument("--load-factor", type=float, default=0.0,
                        help="ScheduleOptions.load_factor (0: the library's, 2): each rank holds load_factor * T * k "
                        "expert rows; with --skew at EP > 2 raise it (EP: the worst case) or the status check "
                        "reports a capacity overflow")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                        help="also time and check forward + backward (default on)")
    parser.add_argument("--grad-mode", default="bf16", choices=list(GRAD_MODES),
                        help="our weight gradients: bf16 or fp32 written, or accumulated into fp32 (default bf16)")
    parser.add_argument("--experts-fraction", default="auto",
                        help="auto: half the experts where the estimate does not fit the GPU; or a fraction, e.g. 0.5")
    parser.add_argument("--only", default="", choices=ONLY, help="time only this one (for profilers): a forward, "
                        "X-train = forward + backward, X-bwd = backward alone")
    parser.add_argument("--check-only", action="store_true", help="correctness checks only, no timing")
    parser.add_argument("--breakdown", action="store_true", help="also print our GPU time per kernel (torch.profiler)")
    parser.add_argument("--sonic-timing", action="store_true",
                        help="also time the fused forward and forward + backward as SonicMoE's benchmark does (calls "
                        "back to back, the L2 cleared by a 256 MiB write before each, the mean): sonic_TF and "
                        "sonic_bwd_TF use them")
    parser.add_argument("--backward-megakernel", action="store_true",
                        help="the fused layer's backward as one persistent launch (FusedOptions::backward_megakernel)")
    parser.add_argument("--gather-rows", action="store_true",
                        help="unfused path: the gate/up GEMM gathers its rows from x and the backward's down dgrad "
                        "its rows from d_out (MoeOptions::gather_rows; with --no-backward at EP = 1 the expert-major "
                        "copy of x is skipped)")
    parser.add_argument("--scatter-rows", action="store_true",
                        help="the unfused down GEMM and the stage-kernel backward's gate/up dgrad write each row to "
                        "its token's combine row (MoeOptions::scatter_rows; the fused forward ignores it)")
    parser.add_argument("--comm-ctas", type=int, default=0,
                        help="fused path: CTAs given to communication (default 0: the producer warps copy)")
    parser.add_argument("--minibatch", type=int, default=0, help="fused path: minibatch rows (0: default)")
    parser.add_argument("--timeline", default="", help="directory for the fused kernel's Chrome-trace timelines")
    parser.add_argument("--json", default="", help="also write the run and its table rows to this JSON file")
    parser.add_argument("--chart", default="", help="also draw the tables as a PNG bar chart at this path")
    args = parser.parse_args()
    if "-" in args.only and not args.backward:
        parser.error(f"--only {args.only} needs --backward")
    if args.experts_fraction != "auto":
        try:
            fraction = float(args.experts_fraction)
        except ValueError:
            parser.error(f"--experts-fraction: auto or a number in (0, 1], got {args.experts_fraction}")
        if not 0 < fraction <= 1:
            parser.error(f"--experts-fraction: must be in (0, 1], got {fraction}")

    ep = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        shapes = select_shapes(args.shapes, args.shape)
        for shape in shapes:
            check_shape(shape, args.tokens if shape.tokens is None else shape.tokens, ep)
    except ValueError as e:
        parser.error(str(e))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    rank = 0
    if ep > 1:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        rank = dist.get_rank()
    lib = load(os.path.abspath(args.lib))

    run = {}
    if rank == 0:
        commit = os.environ.get("MOK_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        run = dict(commit=commit or None, gpu=torch.cuda.get_device_name(), ep=ep, tokens_per_rank=args.tokens,
                   iters=args.iters, skew=args.skew, backward=args.backward, grad_mode=args.grad_mode,
                   forward_tolerance=TOLERANCE, grad_tolerance=GRAD_TOLERANCE, seed=args.seed,
                   comm_ctas=args.comm_ctas, minibatch=args.minibatch, load_factor=args.load_factor,
                   check_only=args.check_only)
        what = "forward and forward + backward" if args.backward else "forward"
        budgets = f", gradients {args.grad_mode}, budgets fwd {TOLERANCE} bwd {GRAD_TOLERANCE}" * args.backward
        budgets += ", fused backward: megakernel" * (args.backward and args.backward_megakernel)
        print(f"MoE layer benchmark ({what}), commit {commit or 'unknown'}, {torch.cuda.get_device_name()}, EP={ep}, "
              f"{args.tokens} tokens/rank, median of {args.iters} (slowest rank), skew {args.skew}{budgets}",
              flush=True)
        print(FORWARD_HEADER, flush=True)
        if args.backward:
            print(TRAIN_HEADER + "   (fb = fwd+bwd ms, bwd = backward alone ms; TF = TFLOP/s)", flush=True)
    failed, rows, records = [], [], []
    for shape in shapes:
        name = shape.name
        try:
            result = run_shape(lib, args, ep, rank, shape)
            if rank == 0 and not args.only:
                result.rows(rows, records)
            failed += result.failures()
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            if ep > 1:
                raise  # the other ranks would wait in a collective
            print(f"{name}: FAILED: {type(e).__name__}: {e}", flush=True)
            failed.append(f"{name} ({type(e).__name__})")
        torch.cuda.empty_cache()
    if rank == 0 and args.backward and len(rows) > 2:
        print("\n" + FORWARD_HEADER + "\n" + "\n".join(r for r in rows if r.startswith("fwd")), flush=True)
        print(TRAIN_HEADER + "\n" + "\n".join(r for r in rows if r.startswith("f+b")), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank == 0:
        write_outputs(args, run, records, failed)
    if failed:
        if rank == 0:
            print(f"FAILED (an error above its budget, NaN, paths not bitwise equal, or a failed call): "
                  f"{', '.join(failed)}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
