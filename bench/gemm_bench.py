#!/usr/bin/env python3
"""Expert grouped-GEMM benchmark: ours vs torch._grouped_mm vs the dense bf16 GEMM ceiling, one run.

For each model shape (docs/design.md, "CPU reference") at 8192 tokens/rank and EP=2, rank 0's expert row counts
come from a softmax top-k routing of random logits over 2 x 8192 tokens. Four GEMMs per shape:
  gate/up  [rows, H] x [E_local, 2I, H]^T -> ours with the fused SwiGLU epilogue (writes [rows, I]);
           torch._grouped_mm writes [rows, 2I] (no activation)
  down     [rows, I] x [E_local, H, I]^T -> [rows, H]
  down dg  the backward's down dgrad: d_out [rows, H] x [E_local, H, I] (the forward's W_down read MN-major)
           -> ours with the SwiGLU backward epilogue (reads g, u [rows, 2I], writes d_g, d_u [rows, 2I] and the
           row partials of d_rw); torch._grouped_mm writes d_hu [rows, I]
  gu dg    the gate/up dgrad: [d_g, d_u] [rows, 2I] x [E_local, 2I, H] (fused W_gate; W_up, MN-major) -> [rows, H]
The dense ceiling is one torch.mm with the same M = routed rows, N and K. TFLOP/s count real rows only
(2 * rows * N * K); our padding to tile_m-row segments is work we pay for and do not count. Time: median of
CUDA-event timings in the steady power state: ours and torch._grouped_mm take turns call by call; the dense
ceiling is timed alone (see time_ms).
With --gemm wgrad (or all, the default), the weight-gradient GEMMs of the same row counts follow
(mok::weight_grad_gemm, k-grouped: grad_e = a_eᵀ b_e over expert e's rows; see wgrad_main).
With --gemm fp8, the forward's two GEMMs in FP8 (Precision::kFP8, DeepSeek-V3's block scales) at one EP = --ep
rank's row counts (default 8), next to ours in bf16, torch._scaled_grouped_mm (rowwise scales, weights
pre-quantized) and the dense FP8 ceiling (torch._scaled_mm, rowwise); see fp8_main.
Usage: gemm_bench.py --lib build/bench/libmok_bench_capi.so [--iters N] [--tile-m 64|128] [--cluster 0|1|2]
                     [--shapes A,B] [--only ours|torch|dense] [--trace DIR] [--gemm expert|wgrad|all|fp8] [--ep N]
                     [--fp8] (with --gemm wgrad)
                     [--block-n 0|128|192] [--two-pass-gate-up] [--side-outputs] (with --gemm fp8)
"""
import argparse
import ctypes
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import capi  # noqa: E402


def positive_int(text):
    """argparse type of the benches' counts (--iters, --tokens, ...): an int > 0, or a usage error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {value}")
    return value

SHAPES = [  # name, experts, hidden, intermediate, top_k, shared expert (of width intermediate); as reference/routing_gen.cpp
    ("Kimi-K2.7", 384, 7168, 2048, 8, True),
    ("GLM-5.2", 256, 6144, 2048, 8, True),
    ("Qwen3.5-397B", 512, 4096, 1024, 10, True),
    ("DeepSeek-V4-Pro", 384, 7168, 3072, 6, True),
    ("gpt-oss-120b", 128, 2880, 2880, 4, False),  # H and I not multiples of the GEMM tiles
    ("Qwen3-30B-A3B", 128, 2048, 768, 8, False),
]
DEFAULT_TILE_M = 64  # mok::ScheduleOptions' default padding
TORCH_GROUP_ALIGN = 16  # torchtitan pads each expert's rows for torch._grouped_mm
WAIT_TIMEOUT_S = 10.0  # the GEMMs' waits give up after 2 * this + 1 s (mok::ScheduleOptions' default)


def new_status(lib, error):
    """A status word in device memory for the GEMMs' waits (mok_bench_status_new), one per run."""
    status = ctypes.c_void_p()
    if lib.mok_bench_status_new(ctypes.byref(status), error, len(error)) != 0:
        raise RuntimeError(error.value.decode())
    return status


def check_status(lib, status, stream, error):
    """Raises with the report when a GEMM's wait timed out since the word was made."""
    if lib.mok_bench_status_check(status, stream, error, len(error)) != 0:
        raise RuntimeError("a GEMM reported: " + error.value.decode())


def time_ms(fns, iters, warmup_s=0.3):
    """Median milliseconds of each function. The functions take turns, one call each per round, after
    warmup_s seconds of such rounds: under sustained load the H200 lowers its SM clock when it reaches the
    power limit, within tens of milliseconds, so each function is timed in the steady state of the mix."""
    begin = time.time()
    while time.time() - begin < warmup_s:
        for fn in fns:
            fn()
        torch.cuda.synchronize()
    return [median(t) for t in timed_turns(fns, iters)]


# With MOK_BENCH_CLOCKS=1, the SM clock after each timed call (bench/nvml.py), per function of the last
# timed_turns: LAST_CLOCKS[i] is the median MHz of fns[i], or None (not asked for, or no NVML). Opt-in: the reads
# add host time between the timed calls, so the timed loop stays the earlier rounds' unless asked.
LAST_CLOCKS = []
_sm_clock = None


class _NoClock:
    def mhz(self):
        return None


def sm_clock():
    global _sm_clock
    if _sm_clock is None:
        if os.environ.get("MOK_BENCH_CLOCKS") == "1":
            import nvml
            _sm_clock = nvml.SmClock(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        else:
            _sm_clock = _NoClock()
    return _sm_clock


def timed_turns(fns, iters):
    """iters rounds, each function called once per round and timed alone with CUDA events: [[ms] per function].
    Also sets LAST_CLOCKS (the SM clock read after each call, outside the timed interval)."""
    global LAST_CLOCKS
    clock = sm_clock()
    times = [[] for _ in fns]
    clocks = [[] for _ in fns]
    for _ in range(iters):
        for fn, t, c in zip(fns, times, clocks):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            t.append(start.elapsed_time(stop))
            mhz = clock.mhz()
            if mhz is not None:
                c.append(mhz)
    LAST_CLOCKS = [median(c) if c else None for c in clocks]
    return times


def clock_line(names, clocks):
    """'SM clock (median MHz after each timed call): a 1755, b 1740' for the functions sampled, '' if none was."""
    cells = [f"{n} {c}" for n, c in zip(names, clocks) if c is not None]
    return f"SM clock (median MHz after each timed call): {', '.join(cells)}" if cells else ""


def median(values):
    return sorted(values)[len(values) // 2]


def bench_setup(args):
    """(library, ticket, error buffer, status word, generator, stream, commit) of a benchmark run."""
    lib = capi.load(os.path.abspath(args.lib))
    error = ctypes.create_string_buffer(512)
    commit = os.environ.get("MOK_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return (lib, torch.zeros(1, dtype=torch.int32, device="cuda"), error, new_status(lib, error),
            torch.Generator(device="cuda").manual_seed(0), torch.cuda.current_stream().cuda_stream, commit)


def rank0_counts(num_experts, top_k, tokens, gen, ep=2):
    logits = torch.randn(ep * tokens, num_experts, device="cuda", generator=gen)
    ids = logits.topk(top_k, dim=1).indices.flatten()
    counts = torch.bincount(ids, minlength=num_experts)[: num_experts // ep]
    return counts.to(torch.int32)


def rank0_schedule(num_experts, top_k, tokens, tile_m, gen, ep=2):
    """One EP rank's routed rows as our GEMMs and torch's take them: (local experts, rows per expert, our segment
    offsets [local + 1] padded to tile_m, our padded rows, real rows, the scheduled-rows count on the device,
    torch's group offsets aligned to TORCH_GROUP_ALIGN, torch's rows)."""
    local = num_experts // ep
    counts = rank0_counts(num_experts, top_k, tokens, gen, ep)
    padded = (counts + tile_m - 1) // tile_m * tile_m
    offsets = torch.zeros(local + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = torch.cumsum(padded, 0)
    torch_offs = torch.cumsum((counts + TORCH_GROUP_ALIGN - 1) // TORCH_GROUP_ALIGN * TORCH_GROUP_ALIGN,
                              0).to(torch.int32)
    return (local, counts, offsets, int(offsets[-1]), int(counts.sum()), offsets[-1:].clone(), torch_offs,
            int(torch_offs[-1]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lib", default="build/bench/libmok_bench_capi.so")
    parser.add_argument("--iters", type=positive_int, default=20)
    parser.add_argument("--tokens", type=positive_int, default=8192)
    parser.add_argument("--tile-m", type=int, default=DEFAULT_TILE_M, choices=[64, 128])
    parser.add_argument("--shapes", default="")
    parser.add_argument("--cluster", type=int, default=0, help="CTAs sharing an A tile: 1, 2, 0 = library's choice")
    parser.add_argument("--block-n", type=int, default=0, choices=[0, 128, 256],
                        help="--gemm fp8: the store GEMM's tile width (ExpertGemmArgs::block_n), 0 = library's choice")
    parser.add_argument("--only", default="", help="time only this one: ours, torch or dense (for profilers)")
    parser.add_argument("--trace", default="", help="folder for per-tile timings of ours (summary: bench/gemm_trace_stats.py)")
    parser.add_argument("--gemm", default="all", choices=["expert", "wgrad", "all", "fp8"],
                        help="the expert GEMMs, the weight-gradient GEMMs or both (--only, --trace, --cluster: expert "
                        "only); fp8: the forward's GEMMs in FP8")
    parser.add_argument("--fp8", action="store_true",
                        help="--gemm wgrad: also the FP8 weight-gradient GEMM (operands quantized per column per 128 "
                             "rows by quantize_columns_fp8), alone and with its two quantizations")
    parser.add_argument("--ep", type=positive_int, default=None,
                        help="--gemm fp8 (default 8) and wgrad (default 2): the EP size whose rank 0 row counts are "
                             "used")
    parser.add_argument("--two-pass-gate-up", action="store_true",
                        help="--gemm fp8: also fp8_q2, the gate/up GEMM writing h quantized as two 128 x 128 passes "
                             "a task (ExpertGemmArgs::block_n 128; fp8_q is the library's 128 x 256 tile), timed in "
                             "the same turns")
    parser.add_argument("--side-outputs", action="store_true",
                        help="--gemm fp8: also fp8_s and fp8_sw, the gate/up GEMM writing h quantized beside a "
                             "training context's side outputs (bf16 g | u and h) as two 128 x 128 passes "
                             "(ExpertGemmArgs::block_n 128) and with the library's 128 x 256 tile")
    parser.add_argument("--digest", action="store_true",
                        help="--gemm fp8: print a fingerprint of our outputs per GEMM (inputs seeded), so that two "
                             "builds' bits can be compared (--lib)")
    args = parser.parse_args()
    if args.gemm == "wgrad":
        return wgrad_main(args)
    if args.gemm == "fp8":
        return fp8_main(args)
    # status: the GEMMs' waits report here (bounded: a stalled kernel fails the run)
    lib, ticket, error, status, gen, stream, commit = bench_setup(args)
    gemm = lib.mok_bench_expert_gemm
    print(f"expert GEMM benchmark, commit {commit or 'unknown'}, {torch.cuda.get_device_name()}, "
          f"{args.tokens} tokens/rank, EP=2 (rank 0's experts), tile_m {args.tile_m}, cluster {args.cluster or 'auto'}, median of {args.iters}")
    header = (f"{'shape':16s} {'gemm':8s} {'rows':>7s} {'pad%':>5s} {'ours':>7s} {'torch':>7s} {'dense':>7s} "
              f"{'ours/torch':>10s} {'ours/dense':>10s}")
    print(header + "   (TFLOP/s)")
    for name, num_experts, hidden, inter, top_k, _ in SHAPES:
        if args.shapes and name not in args.shapes.split(','):
            continue
        tile_m = args.tile_m
        local, counts, offsets, rows_padded, rows, scheduled, torch_offs, torch_rows = rank0_schedule(
            num_experts, top_k, args.tokens, tile_m, gen)

        w13 = torch.randn(local, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
        w2 = torch.randn(local, hidden, inter, device="cuda", dtype=torch.bfloat16) / inter**0.5
        # label, epilogue (0 store, 1 SwiGLU, 2 SwiGLU backward), b_major (0 K, 1 MN), k, our n, weights,
        # the accumulator columns (N of the FLOP count), torch's weights ([E, K, N])
        gemms = (("gate/up", 1, 0, hidden, inter, w13, 2 * inter, w13.transpose(-2, -1)),
                 ("down", 0, 0, inter, hidden, w2, hidden, w2.transpose(-2, -1)),
                 ("down dg", 2, 1, hidden, inter, w2, inter, w2),
                 ("gu dg", 0, 1, 2 * inter, hidden, w13, hidden, w13))
        for label, epilogue, b_major, k, n_out, weights, n_total, w_t in gemms:
            a = torch.randn(rows_padded, k, device="cuda", dtype=torch.bfloat16)
            backward = epilogue == 2
            out = torch.empty(rows_padded, 2 * n_out if backward else n_out, device="cuda", dtype=torch.bfloat16)
            gate_up = torch.randn(rows_padded, 2 * n_out, device="cuda", dtype=torch.bfloat16) if backward else None
            n_blocks = -(-n_out // 256)  # gemm_n_blocks(kSwiGLUBackward, n)
            partials = torch.empty(rows_padded, n_blocks, device="cuda", dtype=torch.float32) if backward else None

            def ours(trace=None):
                rc = gemm(epilogue, a.data_ptr(), rows_padded, k, weights.data_ptr(), None, b_major, n_out, local,
                          counts.data_ptr(), offsets.data_ptr(), scheduled.data_ptr(), tile_m, None, 0.0, out.data_ptr(),
                          None, gate_up.data_ptr() if backward else None, partials.data_ptr() if backward else None,
                          args.cluster, ticket.data_ptr(), trace, status, WAIT_TIMEOUT_S, stream, error, len(error))
                if rc != 0:
                    raise RuntimeError(error.value.decode())

            a_torch = torch.randn(torch_rows, k, device="cuda", dtype=torch.bfloat16)
            grouped = lambda: torch._grouped_mm(a_torch, w_t, offs=torch_offs)  # w_t [E, K, N], as torchtitan passes it
            a_dense = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            b_dense = torch.randn(k, n_total, device="cuda", dtype=torch.bfloat16)
            dense = lambda: torch.mm(a_dense, b_dense)

            flops = 2.0 * rows * n_total * k
            if args.only:
                fn = dict(ours=ours, torch=grouped, dense=dense)[args.only]
                begin = time.time()
                tflops = flops / time_ms([fn], args.iters)[0] / 1e9
                print(f"{name:16s} {label:8s} {args.only} {tflops:7.0f}  wall {begin:.2f} {time.time():.2f}", flush=True)
                continue

            def save_trace(suffix):
                trace = torch.zeros(rows_padded // 64 * -(-n_total // 256) * 2 * 4, dtype=torch.int64, device="cuda")
                ours(trace.data_ptr())
                torch.cuda.synchronize()
                os.makedirs(args.trace, exist_ok=True)
                # With the segment offsets: gemm_trace_stats.py tells the tasks of 128 rows from the shorter ones.
                torch.save({"trace": trace.cpu(), "offsets": offsets.cpu()},
                           os.path.join(args.trace, f"{name}_{label.replace('/', '').replace(' ', '_')}{suffix}.pt"))

            if args.trace:
                save_trace("")
            # The two grouped GEMMs (both stream all expert weights from DRAM) in turns; the dense ceiling
            # alone, in its own steady state: it draws less power and keeps a higher clock, and timing it
            # between grouped GEMMs would lower the ceiling we compare against.
            t_ours, t_torch = time_ms([ours, grouped], args.iters)
            clocks = list(LAST_CLOCKS)
            (t_dense,) = time_ms([dense], args.iters)
            clocks += LAST_CLOCKS
            if args.trace:
                save_trace("_hot")
            tf = [flops / t / 1e9 for t in (t_ours, t_torch, t_dense)]
            print(f"{name:16s} {label:8s} {rows:7d} {100.0 * (rows_padded - rows) / rows:5.1f} {tf[0]:7.0f} "
                  f"{tf[1]:7.0f} {tf[2]:7.0f} {tf[0] / tf[1]:10.2f} {tf[0] / tf[2]:10.2f}", flush=True)
            line = clock_line(["ours", "torch", "dense"], clocks)
            if line:
                print(f"  {name} {label}: {line}", flush=True)
            del a, out, gate_up, partials, a_torch, a_dense, b_dense
        check_status(lib, status, stream, error)
        del w13, w2
        torch.cuda.empty_cache()
    if args.gemm == "all":
        print()
        wgrad_main(args)


def wgrad_main(args):
    """The weight-gradient GEMMs of each shape's rank-0 rows (same routing draws as the expert table):
      dW_gate/up  a = [d_g, d_u] [rows, 2I], b = x [rows, H] -> [E_local, 2I, H] (gate and up rows to two
                  outputs, out_split at I), K = each expert's rows
      dW_down     a = dy [rows, H], b = h [rows, I]        -> [E_local, H, I]
    Ours in its three output modes (bf16, fp32 written, fp32 accumulated), torch._grouped_mm's weight
    gradient (2d x 2d with offs along K, as its autograd computes it: a.t() [m, rows] x b [rows, n], 16-row
    aligned groups, bf16 out), and two dense ceilings: torch.bmm over the experts with every expert's K the
    mean row count (the same outputs, bf16) and one torch.mm over all rows (M = m, N = n, K = rows, a single
    output: the compute ceiling without the per-expert output traffic). TFLOP/s count 2 * real rows * m * n.
    f32 TB/s: the fp32 mode's output bytes per second (its HBM write floor at small K). --tokens 4096 gives
    the K of 8192 tokens at EP = 1 (~171 rows per Kimi expert)."""
    lib, ticket, error, status, gen, stream, commit = bench_setup(args)
    wgrad = lib.mok_bench_weight_grad_gemm
    ep = args.ep or 2
    print(f"weight-gradient GEMM benchmark, commit {commit or 'unknown'}, {torch.cuda.get_device_name()}, "
          f"{args.tokens} tokens/rank, EP={ep} (rank 0's experts), tile_m {args.tile_m}, median of {args.iters}")
    fp8_head = (f" {'f8bf':>6s} {'f8acc':>6s} {'q+f8':>6s} {'q+f8/acc':>8s} {'f8err':>7s} {'f8bb':>6s} {'f8bb_err':>8s}"
                if args.fp8 else "")
    print(f"{'shape':16s} {'gemm':11s} {'rows':>7s} {'K/e':>5s} {'bf16':>6s} {'f32':>6s} {'acc':>6s} {'torch':>6s} "
          f"{'bmm':>6s} {'mm':>6s} {'bf16/torch':>10s} {'bf16/bmm':>8s} {'f32/bmm':>8s} {'f32 TB/s':>8s}{fp8_head}"
          "   (TFLOP/s" + ("; f8bf: the FP8 GEMM writing bf16 (the layer bench's mode), f8acc: accumulating fp32, "
                          "q+f8: f8acc with the quantization of both operands, "
                          "q+f8/acc: speed-up over acc, f8err: normwise |fp8 - f32| / |f32|; f8bb, f8bb_err: f8bf and "
                          "f8err with b scaled per 128 x 128 block, b_block_scales)" if args.fp8 else ")"))
    torch_failed = None
    for name, num_experts, hidden, inter, top_k, _ in SHAPES:
        if args.shapes and name not in args.shapes.split(','):
            continue
        tile_m = args.tile_m
        local, counts, offsets, rows_padded, rows, scheduled, torch_offs, torch_rows = rank0_schedule(
            num_experts, top_k, args.tokens, tile_m, gen, ep)
        # Padding rows are zero in a (the contract: zero in a or in b).
        index = torch.arange(rows_padded, device="cuda", dtype=torch.int32)
        expert_of = torch.searchsorted(offsets[1:], index, right=True)
        real = (index - offsets[expert_of]) < counts.to(torch.int32)[expert_of]
        k_mean = max(16, round(rows / local / 16) * 16)
        for label, m, n, m_split in (("dW_gate/up", 2 * inter, hidden, inter), ("dW_down", hidden, inter, 0)):
            a = torch.randn(rows_padded, m, device="cuda", dtype=torch.bfloat16) * real[:, None]
            b = torch.randn(rows_padded, n, device="cuda", dtype=torch.bfloat16)
            top = m_split or m
            outs = {dtype: (torch.empty(local, top, n, device="cuda", dtype=dtype),
                            torch.empty(local, m - top, n, device="cuda", dtype=dtype) if m_split else None)
                    for dtype in (torch.bfloat16, torch.float32)}
            outs[torch.float32][0].zero_()
            if m_split:
                outs[torch.float32][1].zero_()

            def ours(output):
                out, split = outs[torch.bfloat16 if output == 0 else torch.float32]
                rc = wgrad(a.data_ptr(), b.data_ptr(), rows_padded, m, n, local, offsets.data_ptr(), scheduled.data_ptr(),
                           tile_m, output, out.data_ptr(), split.data_ptr() if split is not None else None, m_split,
                           ticket.data_ptr(), status, WAIT_TIMEOUT_S, stream, error, len(error))
                if rc != 0:
                    raise RuntimeError(error.value.decode())

            a_torch = torch.randn(torch_rows, m, device="cuda", dtype=torch.bfloat16)
            b_torch = torch.randn(torch_rows, n, device="cuda", dtype=torch.bfloat16)
            grouped = lambda: torch._grouped_mm(a_torch.t(), b_torch, offs=torch_offs)
            if torch_failed is None:
                try:
                    grouped()
                except (RuntimeError, AttributeError) as e:
                    torch_failed = str(e).splitlines()[0]
                    print(f"  (torch._grouped_mm weight gradient unavailable: {torch_failed})")
            a_bmm = torch.randn(local, k_mean, m, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            b_bmm = torch.randn(local, k_mean, n, device="cuda", dtype=torch.bfloat16)
            bmm = lambda: torch.bmm(a_bmm, b_bmm)
            a_mm = torch.randn(rows, m, device="cuda", dtype=torch.bfloat16).t()
            b_mm = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
            mm = lambda: torch.mm(a_mm, b_mm)

            # The grouped GEMMs in turns (all write E_local outputs); each dense ceiling alone (see time_ms).
            fns = [lambda: ours(0), lambda: ours(1), lambda: ours(2)] + ([grouped] if torch_failed is None else [])
            if args.fp8:
                fp8_fns, fp8_err = fp8_weight_grad(lib, a, b, m, n, m_split, local, counts, offsets, rows_padded,
                                                   ticket, status, stream, error, outs, ours)
                fns += fp8_fns
            times = time_ms(fns, args.iters)
            t_torch = times[3] if torch_failed is None else float("nan")
            (t_bmm,) = time_ms([bmm], args.iters)
            (t_mm,) = time_ms([mm], args.iters)
            flops = 2.0 * rows * m * n
            tf = [flops / t / 1e9 for t in times[:3]] + [flops / t_torch / 1e9,
                                                         2.0 * local * k_mean * m * n / t_bmm / 1e9, flops / t_mm / 1e9]
            out_tbps = local * m * n * 4 / times[1] / 1e9
            fp8_cells = ""
            if args.fp8:
                t_f8bf, t_f8, t_qf8, t_f8bb = times[-4:]
                fp8_cells = (f" {flops / t_f8bf / 1e9:6.0f} {flops / t_f8 / 1e9:6.0f} {flops / t_qf8 / 1e9:6.0f} "
                             f"{times[2] / t_qf8:8.2f} {fp8_err[0]:7.4f} {flops / t_f8bb / 1e9:6.0f} {fp8_err[1]:8.4f}")
            print(f"{name:16s} {label:11s} {rows:7d} {rows / local:5.0f} {tf[0]:6.0f} {tf[1]:6.0f} {tf[2]:6.0f} {tf[3]:6.0f} "
                  f"{tf[4]:6.0f} {tf[5]:6.0f} {tf[0] / tf[3]:10.2f} {tf[0] / tf[4]:8.2f} {tf[1] / tf[4]:8.2f} "
                  f"{out_tbps:8.2f}{fp8_cells}", flush=True)
            del a, b, outs, a_torch, b_torch, a_bmm, b_bmm, a_mm, b_mm
            torch.cuda.empty_cache()
        check_status(lib, status, stream, error)


def fp8_weight_grad(lib, a, b, m, n, m_split, local, counts, offsets, rows_padded, ticket, status, stream, error, outs,
                    ours):
    """The FP8 weight gradient of wgrad_main's operands a [rows, m], b [rows, n]: ([the FP8 GEMM writing bf16 and
    accumulating fp32 on operands quantized once, the two quantize_columns_fp8 calls + the accumulating GEMM, the
    GEMM writing bf16 with b scaled per 128 x 128 block (b_block_scales)], normwise errors of the fp32
    results against our bf16 GEMM's fp32 result: per-column b scales, block b scales)."""
    rows8 = lib.mok_bench_fp8_column_rows(rows_padded, local)
    offsets8 = torch.empty(local + 1, device="cuda", dtype=torch.int32)
    qa, qb = (torch.empty(c, rows8, device="cuda", dtype=torch.uint8) for c in (m, n))
    sa, sb = (torch.empty(rows8 // 128, c, device="cuda", dtype=torch.float32) for c in (m, n))
    qbb = torch.empty(n, rows8, device="cuda", dtype=torch.uint8)
    sbb = torch.empty(-(-n // 128), rows8 // 128, device="cuda", dtype=torch.float32)
    top = m_split or m
    out8 = (torch.zeros(local, top, n, device="cuda", dtype=torch.float32),
            torch.zeros(local, m - top, n, device="cuda", dtype=torch.float32) if m_split else None)

    def check(rc):
        if rc != 0:
            raise RuntimeError(error.value.decode())

    def quantize():
        for src, cols, out, scales, blocks in ((a, m, qa, sa, 0), (b, n, qb, sb, 0), (b, n, qbb, sbb, 1)):
            check(lib.mok_bench_quantize_columns_fp8(src.data_ptr(), rows_padded, cols, local, counts.data_ptr(),
                                                     offsets.data_ptr(), offsets8.data_ptr(), out.data_ptr(),
                                                     scales.data_ptr(), 0, blocks, stream, error, len(error)))

    def gemm(output=2, out=out8, blocks=0):
        qb_, sb_ = (qbb, sbb) if blocks else (qb, sb)
        check(lib.mok_bench_weight_grad_gemm_fp8(qa.data_ptr(), sa.data_ptr(), qb_.data_ptr(), sb_.data_ptr(), rows8,
                                                 m, n, local, offsets8.data_ptr(), offsets8[local:].data_ptr(), output,
                                                 out[0].data_ptr(), out[1].data_ptr() if out[1] is not None else None,
                                                 m_split, blocks, ticket.data_ptr(), status, WAIT_TIMEOUT_S, stream,
                                                 error, len(error)))

    quantize()
    ours(1)
    ref = outs[torch.float32]
    errors = []
    for blocks in (0, 1):
        fresh = tuple(None if t is None else torch.empty_like(t) for t in out8)
        gemm(1, fresh, blocks)  # fp32 written, against ours
        pairs = [(fresh[0], ref[0])] + ([(fresh[1], ref[1])] if m_split else [])
        diff = sum((x - y).double().pow(2).sum().item() for x, y in pairs)
        norm = sum(y.double().pow(2).sum().item() for _, y in pairs)
        errors.append((diff / norm) ** 0.5)
    return ([lambda: gemm(0, outs[torch.bfloat16]), gemm, lambda: (quantize(), gemm()),
             lambda: gemm(0, outs[torch.bfloat16], 1)], errors)


E4M3_MAX = 448.0


def quantize_rows_1x128(a):
    """a [rows, k] -> (e4m3 [rows, k], scales [ceil(k/128), rows] fp32): DeepSeek-V3's activation scales."""
    rows, k = a.shape
    blocks = -(-k // 128)
    padded = torch.nn.functional.pad(a.float(), (0, blocks * 128 - k)).view(rows, blocks, 128)
    scales = padded.abs().amax(dim=2) / E4M3_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = (padded / scales[:, :, None]).view(rows, blocks * 128)[:, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), scales.t().contiguous()


def quantize_blocks_128x128(w):
    """w [E, rows, k] -> (e4m3 [E, rows, k], scales [E, ceil(rows/128), ceil(k/128)]): the weights' block scales."""
    experts, rows, k = w.shape
    rb, kb = -(-rows // 128), -(-k // 128)
    q = torch.empty(experts, rows, k, dtype=torch.float8_e4m3fn, device=w.device)
    scales = torch.empty(experts, rb, kb, dtype=torch.float32, device=w.device)
    chunk = max(1, (1 << 28) // (rb * kb * 128 * 128))  # experts per pass: about 1 GiB of fp32 at a time
    for e in range(0, experts, chunk):
        part = w[e:e + chunk]
        padded = torch.nn.functional.pad(part.float(), (0, kb * 128 - k, 0, rb * 128 - rows))
        padded = padded.view(part.shape[0], rb, 128, kb, 128)
        s = padded.abs().amax(dim=(2, 4)) / E4M3_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))
        q[e:e + chunk] = (padded / s[:, :, None, :, None]).view(part.shape[0], rb * 128, kb * 128)[:, :rows, :k]
        scales[e:e + chunk] = s
    return q, scales


def quantize_rowwise(t, dim):
    """Per-row (dim=-1 amax) scales as torch's rowwise FP8 GEMMs take them: (e4m3, fp32 scales)."""
    scales = (t.float().abs().amax(dim=dim, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
    return (t.float() / scales).to(torch.float8_e4m3fn), scales


def fingerprint(t):
    """A position-weighted sum of a tensor's bits (int64, hex): equal bits give equal prints."""
    bits = t.contiguous().view(torch.uint8).reshape(-1).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
    return f"{int((bits * weights).sum()) & (2**64 - 1):016x}"


def fp8_main(args):
    """The forward's GEMMs in FP8 at one EP = args.ep rank's row counts: ours (block scales, SwiGLU fused into
    gate/up) against ours in bf16, torch._scaled_grouped_mm (rowwise, the same weights quantized per output
    column) and the dense FP8 rate (torch._scaled_mm over the same M, N, K). Quantization is not timed (the
    weights are quantized once per optimizer step; the activations' quantization is fused into producers in
    the layer). TFLOP/s: 2 * rows * N * K over real rows."""
    lib, ticket, error, status, gen, stream, commit = bench_setup(args)
    torch.manual_seed(0)  # the operands (torch's default generator): the same inputs in every run
    print(f"FP8 expert GEMM benchmark, commit {commit or 'unknown'}, {torch.cuda.get_device_name()}, "
          f"{args.tokens} tokens/rank, EP={args.ep or 8} (rank 0's experts), tile_m {args.tile_m}, store tile width "
          f"{args.block_n or 'auto'}, median of {args.iters}")
    print(f"{'shape':16s} {'gemm':8s} {'E':>4s} {'rows':>7s} {'fp8':>7s} {'fp8_q':>7s} {'bf16':>7s} {'t_fp8':>7s} "
          f"{'d_fp8':>7s} {'fp8/bf16':>8s} {'fp8/t_fp8':>9s} {'fp8/d_fp8':>9s}   (TFLOP/s; fp8_q: gate/up writing h "
          "quantized; t_fp8 torch._scaled_grouped_mm, d_fp8 torch._scaled_mm)")
    for name, num_experts, hidden, inter, top_k, _ in SHAPES:
        if args.shapes and name not in args.shapes.split(','):
            continue
        tile_m = args.tile_m
        local, counts, offsets, rows_padded, rows, scheduled, torch_offs, torch_rows = rank0_schedule(
            num_experts, top_k, args.tokens, tile_m, gen, args.ep or 8)
        w13 = torch.randn(local, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
        w2 = torch.randn(local, hidden, inter, device="cuda", dtype=torch.bfloat16) / inter**0.5
        for label, epilogue, k, n_out, weights, n_total in (("gate/up", 1, hidden, inter, w13, 2 * inter),
                                                             ("down", 0, inter, hidden, w2, hidden)):
            a = torch.randn(rows_padded, k, device="cuda", dtype=torch.bfloat16)
            a_q, a_s = quantize_rows_1x128(a)
            w_q, w_s = quantize_blocks_128x128(weights)
            out = torch.empty(rows_padded, n_out, device="cuda", dtype=torch.bfloat16)
            # gate/up also with h written quantized (the layer's FP8 gate/up: e4m3 h and its 1 x 128 scales)
            out_q = torch.empty(rows_padded, n_out, device="cuda", dtype=torch.uint8)
            out_qs = torch.empty((n_out + 127) // 128, rows_padded, device="cuda", dtype=torch.float32)

            # with --side-outputs: a training context's bf16 g | u and h beside the quantized h
            side = args.side_outputs and epilogue == 1
            gate_up = torch.empty(rows_padded, 2 * n_out, device="cuda", dtype=torch.bfloat16) if side else None
            hidden_bf16 = torch.empty(rows_padded, n_out, device="cuda", dtype=torch.bfloat16) if side else None

            def ours_fp8(quantized_out=False, block_n=0, side_outputs=False):
                rc = lib.mok_bench_expert_gemm_fp8(
                    epilogue, a_q.data_ptr(), a_s.data_ptr(), rows_padded, k, w_q.data_ptr(), w_s.data_ptr(), None,
                    None, n_out, local, counts.data_ptr(), offsets.data_ptr(), scheduled.data_ptr(), tile_m, None,
                    out_q.data_ptr() if quantized_out else out.data_ptr(),
                    out_qs.data_ptr() if quantized_out else None,
                    gate_up.data_ptr() if side_outputs else None, hidden_bf16.data_ptr() if side_outputs else None,
                    args.cluster,
                    args.block_n if epilogue == 0 else block_n, ticket.data_ptr(), status,
                    WAIT_TIMEOUT_S, stream, error, len(error))
                if rc != 0:
                    raise RuntimeError(error.value.decode())

            def ours_bf16():
                rc = lib.mok_bench_expert_gemm(
                    epilogue, a.data_ptr(), rows_padded, k, weights.data_ptr(), None, 0, n_out, local,
                    counts.data_ptr(), offsets.data_ptr(), scheduled.data_ptr(), tile_m, None, 0.0, out.data_ptr(),
                    None, None, None, 0, ticket.data_ptr(), None, status, WAIT_TIMEOUT_S, stream, error, len(error))
                if rc != 0:
                    raise RuntimeError(error.value.decode())

            a_t, a_ts = quantize_rowwise(torch.randn(torch_rows, k, device="cuda", dtype=torch.bfloat16), -1)
            w_t, w_ts = quantize_rowwise(weights, -1)  # [E, N, K], a scale per output column
            w_t_kn = w_t.transpose(-2, -1)  # [E, K, N] column-major, as _scaled_grouped_mm takes it
            a_ts, w_ts = a_ts.reshape(torch_rows), w_ts.reshape(local, n_total)

            def torch_fp8():
                return torch._scaled_grouped_mm(a_t, w_t_kn, a_ts, w_ts, offs=torch_offs, out_dtype=torch.bfloat16)

            a_d, a_ds = quantize_rowwise(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16), -1)
            b_d, b_ds = quantize_rowwise(torch.randn(n_total, k, device="cuda", dtype=torch.bfloat16), -1)

            def dense_fp8():
                return torch._scaled_mm(a_d, b_d.t(), a_ds, b_ds.t(), out_dtype=torch.bfloat16)

            flops = 2.0 * rows * n_total * k
            fns = {"fp8": ours_fp8, "bf16": ours_bf16, "t_fp8": torch_fp8}
            if epilogue == 1:
                fns["fp8_q"] = lambda: ours_fp8(quantized_out=True)
                if args.two_pass_gate_up:
                    fns["fp8_q2"] = lambda: ours_fp8(quantized_out=True, block_n=128)
                if side:
                    fns["fp8_s"] = lambda: ours_fp8(quantized_out=True, block_n=128, side_outputs=True)
                    fns["fp8_sw"] = lambda: ours_fp8(quantized_out=True, side_outputs=True)
            available = {}
            for key, fn in fns.items():
                try:
                    fn()
                    torch.cuda.synchronize()
                    available[key] = fn
                except Exception as e:  # noqa: BLE001  (a peer that does not run here is reported, not fatal)
                    print(f"  {name} {label}: {key} unavailable: {str(e).splitlines()[0][:160]}", flush=True)
            if args.digest and "fp8" in available:
                ours_fp8()  # (ours_bf16 wrote `out` since)
                prints = [f"fp8 {fingerprint(out)}"]
                for key in ("fp8_q", "fp8_q2", "fp8_s", "fp8_sw"):
                    if key in available:
                        available[key]()
                        prints.append(f"{key} {fingerprint(out_q)} scales {fingerprint(out_qs)}")
                        if key.startswith("fp8_s"):
                            prints.append(f"g|u {fingerprint(gate_up)} h {fingerprint(hidden_bf16)}")
                print(f"  digest {name} {label}: {', '.join(prints)}", flush=True)
            times = dict(zip(available, time_ms(list(available.values()), args.iters)))
            clocks = dict(zip(available, LAST_CLOCKS))
            try:
                (times["d_fp8"],) = time_ms([dense_fp8], args.iters)
                clocks["d_fp8"] = LAST_CLOCKS[0]
            except Exception as e:  # noqa: BLE001
                print(f"  {name} {label}: d_fp8 unavailable: {str(e).splitlines()[0][:160]}", flush=True)
            tf = {key: flops / t / 1e9 for key, t in times.items()}
            cell = lambda key: f"{tf[key]:7.0f}" if key in tf else f"{'-':>7s}"
            ratio = lambda key, width: f"{tf['fp8'] / tf[key]:{width}.2f}" if "fp8" in tf and key in tf else f"{'-':>{width}s}"
            wide = f" fp8_q2 {cell('fp8_q2')}" if "fp8_q2" in tf else ""
            wide += "".join(f" {key} {cell(key)}" for key in ("fp8_s", "fp8_sw") if key in tf)
            if "fp8_q" in tf and "t_fp8" in tf:
                wide += f" fp8_q/t_fp8 {tf['fp8_q'] / tf['t_fp8']:.2f}"
            print(f"{name:16s} {label:8s} {local:4d} {rows:7d} {cell('fp8')} {cell('fp8_q')} {cell('bf16')} "
                  f"{cell('t_fp8')} {cell('d_fp8')} {ratio('bf16', 8)} {ratio('t_fp8', 9)} {ratio('d_fp8', 9)}{wide}",
                  flush=True)
            line = clock_line(list(clocks), list(clocks.values()))
            if line:
                print(f"  {name} {label}: {line}", flush=True)
            del a, a_q, a_s, w_q, w_s, out, out_q, out_qs, a_t, w_t, w_t_kn, a_d, b_d
        check_status(lib, status, stream, error)
        del w13, w2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
