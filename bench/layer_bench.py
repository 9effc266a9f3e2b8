#!/usr/bin/env python3
"""MoE forward layer benchmark: ours (one call through the C API; the fused megakernel path, and its unfused twin)
vs a torchtitan-style PyTorch baseline, one run.

The layer (DESIGN.md section 1), on each rank, T tokens, E global experts, E/EP of them local:
  out[t] = shared(x[t]) + sum_j rw[t,j] * expert_{idx[t,j]}(x[t]),   mlp(x) = W_down (silu(W_gate x) * (W_up x))
Data per rank (seed + rank): x ~ randn, top-k of randn logits (with --skew s, expert e's logit gets
-s * log(1 + perm(e)), perm a fixed random permutation), router weights = softmax over the k chosen logits,
weights ~ randn / sqrt(fan_in).
Baseline (BF16, as torchtitan builds it): histc + all-to-all of the counts, splits read to the host,
sort routes by expert, all-to-all-v of the rows, expert-major permutation padded to 16 rows per expert
(generate_permute_indices), torch._grouped_mm gate/up/down, inverse permutation, all-to-all-v back, unsort,
dense shared expert, weighted sum in fp32. At EP=1 no all-to-alls.
Measured (DESIGN.md section 4): per shape, fused, unfused and the baseline take turns call by call after a
warm-up (steady power state, see gemm_bench.time_ms); each call is timed with CUDA events on each rank, a call's
time is the slowest rank's, reported: the median. Ours includes building its schedule. The dense ceiling (timed
alone) is torch.mm [M,H]x[H,2I] then [M,I]x[I,H], M = T*(k+1) (T*k without a shared expert: gpt-oss-120b,
Qwen3-30B-A3B). TFLOP/s per GPU = 6*(T + T*k)*H*I / time (6*T*k*H*I without a shared expert). Then one
correctness check on the same inputs: ||fused - base||_F / ||base||_F (fp32, max over ranks), and fused == unfused
bitwise on every rank; the exit status is 1 when a shape's error is above 2e-2 or NaN, or the paths differ.
--timeline DIR also records the fused kernel's tasks and writes DIR/timeline_<shape>_ep<EP>_rank<r>.json
(Chrome trace; tools/timeline_png.py draws it); the records cost one store per task.
Usage: python3 -m torch.distributed.run --standalone --nproc-per-node=2 bench/layer_bench.py   (EP=2)
       python3 bench/layer_bench.py                                                            (EP=1)
         [--lib build/bench/libmok_bench_capi.so] [--tokens 8192] [--iters 20] [--shapes A,B] [--skew 0]
         [--only fused|unfused|base] [--check-only] [--breakdown] [--seed 0] [--comm-ctas N]
         [--minibatch ROWS] [--timeline DIR]
"""
import argparse
import ctypes
import os
import re
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from capi import load  # noqa: E402
from gemm_bench import SHAPES, TORCH_GROUP_ALIGN, median, timed_turns  # noqa: E402

TOLERANCE = 2e-2  # relative Frobenius error, bf16 level
ERROR = ctypes.create_string_buffer(1024)


def check(rc):
    if rc != 0:
        raise RuntimeError(ERROR.value.decode(errors="replace"))


def max_over_ranks(tensor):
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


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
        x_send, x_recv = x_recv, x_recv.new_empty(rows, hidden)
        dist.all_to_all_single(x_recv, x_send, recv_splits, send_splits)
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
        y_back = y.new_empty(tokens * top_k, hidden)
        dist.all_to_all_single(y_back, y_recv[:-1], send_splits, recv_splits)
    y_routes = torch.empty_like(y_back)
    y_routes[order] = y_back
    # 6. shared expert, weighted sum
    routed = (y_routes.view(tokens, top_k, hidden).float() * router_weights[..., None]).sum(1)
    if shared_gate is None:
        return routed.bfloat16()
    shared = torch.mm(F.silu(torch.mm(x, shared_gate.t())) * torch.mm(x, shared_up.t()), shared_down.t())
    return (shared.float() + routed).bfloat16()


def create_layer(lib, ep, rank, tokens, top_k, num_experts, hidden, inter, shared, fused, comm_ctas=0, minibatch=0,
                 timeline_records=0):
    """Collective: every rank calls it at the same time. Rank 0's NCCL unique id goes to the others."""
    uid = None
    if ep > 1:
        uid = (ctypes.c_uint8 * 128)()
        shared_id = torch.zeros(128, dtype=torch.uint8, device="cuda")
        if rank == 0:
            check(lib.mok_bench_nccl_unique_id(uid, ERROR, len(ERROR)))
            shared_id.copy_(torch.tensor(list(uid), dtype=torch.uint8))
        dist.broadcast(shared_id, src=0)
        uid = (ctypes.c_uint8 * 128)(*shared_id.tolist())
    layer = lib.mok_bench_layer_create(uid, ep, rank, torch.cuda.current_device(), tokens, top_k, num_experts, hidden,
                                       inter, int(shared), int(fused), comm_ctas, minibatch, timeline_records, 0, 0.0,
                                       ERROR, len(ERROR))
    if not layer:
        raise RuntimeError(ERROR.value.decode(errors="replace"))
    return layer


def dense_ceiling(tokens, top_k, shared, hidden, inter):
    rows = tokens * (top_k + int(shared))
    a1, b1 = (torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in ((rows, hidden), (hidden, 2 * inter)))
    a2, b2 = (torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in ((rows, inter), (inter, hidden)))
    c1 = torch.empty(rows, 2 * inter, device="cuda", dtype=torch.bfloat16)
    c2 = torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)
    return lambda: (torch.mm(a1, b1, out=c1), torch.mm(a2, b2, out=c2))


def kernel_breakdown(fn, iters=5):
    """GPU time per forward by kernel (torch.profiler sees our library's kernels too): [(name, ms)], largest first.
    Kernels of one template are told apart by their epilogue (the shared expert's GEMMs are in the same rows)."""
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
        label = match.group(1) if match else event.key[:40]
        if label == "expert_gemm_kernel":
            label += " swiglu" if re.search(r"Epilogue\)1|kSwiGLU", event.key) else " store"
        totals[label] = totals.get(label, 0) + us / 1e3 / iters
    return sorted(totals.items(), key=lambda kv: -kv[1])


def run_shape(lib, args, ep, rank, name, num_experts, hidden, inter, top_k, shared):
    """Times and checks one shape, prints its row on rank 0; returns a failure text or None. Everything it allocates
    is freed on return."""
    tokens = args.tokens
    inputs = make_inputs(num_experts, hidden, inter, top_k, shared, tokens, ep, rank, args.skew, args.seed)
    outs = {path: torch.empty(tokens, hidden, device="cuda", dtype=torch.bfloat16) for path in ("fused", "unfused")}
    stream = torch.cuda.current_stream().cuda_stream
    layers = {}
    for path in ("fused", "unfused"):
        if args.only in ("", path):
            layers[path] = create_layer(lib, ep, rank, tokens, top_k, num_experts, hidden, inter, shared, path == "fused",
                                        args.comm_ctas, args.minibatch, 8192 if args.timeline and path == "fused" else 0)
    pointers = [0 if t is None else t.data_ptr() for t in inputs.values()]
    pointers.insert(2, 0)  # topk_dtype after topk_idx: int32 ids

    def ours(path):
        return lambda: check(lib.mok_bench_layer_forward(layers[path], *pointers, outs[path].data_ptr(), stream, ERROR,
                                                         len(ERROR)))

    def base():
        return baseline_forward(ep=ep, **inputs)

    times = dict(fused=None, unfused=None, base=None, dense=None)
    relerr = bitwise = None
    if args.only:
        begin = time.time()
        (times[args.only],) = time_ms([ours(args.only) if args.only != "base" else base], args.iters)
        if rank == 0:
            print(f"{name}: {args.only} only, wall {begin:.2f} {time.time():.2f}", flush=True)
    else:
        if not args.check_only:
            # Ours and the baseline in turns (all stream every expert weight); the dense ceiling alone, in its own
            # steady state (it draws less power and keeps a higher clock).
            times["fused"], times["unfused"], times["base"] = time_ms([ours("fused"), ours("unfused"), base], args.iters)
            (times["dense"],) = time_ms([dense_ceiling(tokens, top_k, shared, hidden, inter)], args.iters)
        for path in layers:
            outs[path].fill_(float("nan"))  # a row ours does not write shows as NaN
            ours(path)()
            check(lib.mok_bench_layer_check_status(layers[path], stream, ERROR, len(ERROR)))
        ref = base().float()
        err = ((outs["fused"].float() - ref).norm() / ref.norm()).nan_to_num(nan=float("inf")).reshape(1)
        relerr = max_over_ranks(err).item()
        differs = torch.tensor([float(not torch.equal(outs["fused"].view(torch.int16), outs["unfused"].view(torch.int16)))],
                               device="cuda")
        bitwise = max_over_ranks(differs).item() == 0
    if args.timeline and "fused" in layers:
        os.makedirs(args.timeline, exist_ok=True)
        path = os.path.join(args.timeline, f"timeline_{name}_ep{ep}_rank{rank}.json")
        check(lib.mok_bench_layer_write_timeline(layers["fused"], stream, path.encode(), ERROR, len(ERROR)))
    breakdown = {path: kernel_breakdown(ours(path)) for path in layers} if args.breakdown else {}
    comm_ctas = lib.mok_bench_layer_comm_ctas(layers["fused"]) if "fused" in layers else 0
    torch.cuda.synchronize()
    for layer in layers.values():
        lib.mok_bench_layer_destroy(layer)

    flops = 6.0 * (tokens * int(shared) + tokens * top_k) * hidden * inter  # the shared expert counts as a route
    tf = {k: flops / v / 1e9 for k, v in times.items() if v}
    t = times

    def ratio(a, b):
        return a and b and a / b

    cells = [(t["fused"], 9, ".2f"), (t["unfused"], 10, ".2f"), (t["base"], 9, ".2f"), (tf.get("fused"), 9, ".0f"),
             (tf.get("base"), 8, ".0f"), (tf.get("dense"), 9, ".0f"), (ratio(t["base"], t["fused"]), 11, ".2f"),
             (ratio(t["dense"], t["fused"]), 12, ".2f"), (ratio(t["base"], t["unfused"]), 13, ".2f"),
             (relerr, 9, ".1e")]
    if rank == 0:
        same = "-" if bitwise is None else ("yes" if bitwise else "NO")
        print(f"{name:16s} {ep:2d} {comm_ctas:5d} " +
              " ".join(f"{'-' if v is None else format(v, f):>{w}}" for v, w, f in cells) + f" {same:>8s}", flush=True)
        for path, rows in breakdown.items():
            for label, ms in rows:
                print(f"    {path:8s} {label:36s} {ms:7.3f} ms per forward (rank 0)", flush=True)
    if relerr is not None and not relerr <= TOLERANCE:
        return f"{name} (relative error {relerr:.2e})"
    if bitwise is False:
        return f"{name} (fused and unfused outputs differ)"
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lib", default="build/bench/libmok_bench_capi.so")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--shapes", default="", help="comma-separated names (default: all)")
    parser.add_argument("--skew", type=float, default=0.0, help="routing skew s: bias -s*log(1+perm(e))")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", choices=["", "fused", "unfused", "base"],
                        help="time only this one (for profilers)")
    parser.add_argument("--check-only", action="store_true", help="correctness check only, no timing")
    parser.add_argument("--breakdown", action="store_true", help="also print our GPU time per kernel (torch.profiler)")
    parser.add_argument("--comm-ctas", type=int, default=0,
                        help="fused path: CTAs given to communication (default 0: the producer warps copy)")
    parser.add_argument("--minibatch", type=int, default=0, help="fused path: minibatch rows (0: default)")
    parser.add_argument("--timeline", default="", help="directory for the fused kernel's Chrome-trace timelines")
    args = parser.parse_args()

    ep = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    rank = 0
    if ep > 1:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        rank = dist.get_rank()
    lib = load(os.path.abspath(args.lib))
    names = [s[0] for s in SHAPES]
    wanted = args.shapes.split(",") if args.shapes else names
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {names}")

    if rank == 0:
        commit = os.environ.get("MOK_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        print(f"MoE forward layer benchmark, commit {commit or 'unknown'}, {torch.cuda.get_device_name()}, EP={ep}, "
              f"{args.tokens} tokens/rank, median of {args.iters} (slowest rank), skew {args.skew}", flush=True)
        print(f"{'shape':16s} {'EP':>2s} {'comm':>5s} {'fused_ms':>9s} {'unfused_ms':>10s} {'base_ms':>9s} "
              f"{'fused_TF':>9s} {'base_TF':>8s} {'dense_TF':>9s} {'fused/base':>11s} {'fused/dense':>12s} "
              f"{'unfused/base':>13s} {'relerr':>9s} {'bitwise':>8s}", flush=True)
    failed = []
    for name, num_experts, hidden, inter, top_k, shared in SHAPES:
        if name not in wanted:
            continue
        assert num_experts % ep == 0, f"{name}: {num_experts} experts do not split over {ep} ranks"
        failure = run_shape(lib, args, ep, rank, name, num_experts, hidden, inter, top_k, shared)
        torch.cuda.empty_cache()
        if failure:
            failed.append(failure)
    if dist.is_initialized():
        dist.destroy_process_group()
    if failed:
        if rank == 0:
            print(f"FAILED (relative error above {TOLERANCE}, NaN, or paths not bitwise equal): {', '.join(failed)}",
                  flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
