#!/usr/bin/env python3
"""The layer's forward in FP8 (MoeOptions::precision "fp8", unfused and fused paths) against ours in BF16 (unfused
and fused), one GPU, EP = 1, in one run: issue 27's forward ratios (the bar: fused FP8 against fused BF16).

Shapes: --shapes names of the model shapes (bench/gemm_bench.SHAPES) and --experts-per E_global / E: the default 8
runs one EP = 8 rank's share of experts with all of the --tokens tokens routed among them (48 of Kimi-K2.7's 384:
about 1360 rows each at 8192 tokens and top-8), as the issue's "one EP = 8 rank" rows; --experts-per 1 runs the
full shapes (the weights stream from DRAM: FP8 halves their bytes); a shape that does not fit runs again with half
its experts, printed as "NAME E/2" (as bench/layer_bench.py does). Each shape's weights are random bf16
(N(0, 1/fan_in)); the FP8 layer's weights are those quantized by the recipe (128 x 128 blocks; quantization is not
timed: it runs once per optimizer step). Time: median of CUDA-event timings, the forwards in turns.
Also printed: the FP8 output's normwise error against the BF16 output of the same inputs, and, where torchao
imports (a 3 MB wheel: carry it), torchao's FP8 expert MLP forward of the same routed rows as a same-run peer
(torchao.prototype.moe_training's rowwise FP8 grouped GEMM, quantizing its operands every call as its training
does; rows grouped by expert and padded to 16 as torchtitan does; routed experts only, no dispatch or combine:
a smaller job than our layer's).
With --backward: forward + backward instead (issue 28's bar: FP8 forward + backward against our BF16's), each path's
layer built with the backward; the FP8 backward is the stage kernels (docs/design.md, "FP8 backward") after the FP8
forward of that path, bf16's the stage kernels after its forward; weight gradient tensors bf16, written (the FP8
layers' weight-gradient GEMMs FP8, the default; fp8b: bf16 ones, MoeOptions::bf16_weight_gradients). The FP8 fused layer
also with keep_gate_up=False (its backward recomputes g | u and h: the same bits, a smaller context), and torchao's
expert MLP forward + backward as the peer (the gradients of its rows and weights). Also printed: the FP8 d_x's
normwise error against BF16's and each layer's forward context bytes (issue 28 item 3).
Usage: fp8_layer_bench.py --lib build/bench/libmok_bench_capi.so [--shapes A,B] [--experts-per N] [--tokens T]
       [--breakdown] [--backward [--backward-paths fp8,fp8f,fp8r,fp8b,fp8m,fp8c,bf16,fused]]
"""
import argparse
import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import capi  # noqa: E402
import gemm_bench  # noqa: E402  (gemm_bench.LAST_CLOCKS: the SM clocks of the last timed turns)
from gemm_bench import SHAPES, clock_line, positive_int, quantize_blocks_128x128, time_ms  # noqa: E402
from layer_bench import kernel_breakdown  # noqa: E402


ERROR = ctypes.create_string_buffer(1024)


def check(rc):
    if rc != 0:
        raise RuntimeError(ERROR.value.decode(errors="replace"))


def create(lib, **options):
    layer = lib.mok_bench_layer_create(None, 0, torch.cuda.current_device(), *capi.layer_options(**options), ERROR,
                                       len(ERROR))
    if not layer:
        raise RuntimeError(ERROR.value.decode(errors="replace"))
    return layer


def random_problem(gen, t, experts, hidden, inter, top_k, shared):
    """x [t, H] ~ N(0, 1), ids of the top-k of random logits, router weights U(0, 1), and the six bf16 weights
    ~ N(0, 1/fan_in) (the shared three None without a shared expert)."""
    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=torch.float32, generator=gen).mul_(scale).bfloat16()
    x = randn(t, hidden)
    topk_idx = torch.randn(t, experts, device="cuda", generator=gen).topk(top_k, dim=1).indices.int()
    rw = torch.rand(t, top_k, device="cuda", generator=gen)
    w = [randn(experts, inter, hidden, scale=hidden**-0.5), randn(experts, inter, hidden, scale=hidden**-0.5),
         randn(experts, hidden, inter, scale=inter**-0.5)]
    w += [randn(inter, hidden, scale=hidden**-0.5), randn(inter, hidden, scale=hidden**-0.5),
          randn(hidden, inter, scale=inter**-0.5)] if shared else [None, None, None]
    return x, topk_idx, rw, w


def torchao_expert_mlp(name, gen, topk_idx, experts, hidden, w, backward=False):
    """torchao's FP8 rowwise expert MLP over the routed rows (random rows, grouped by expert and padded to 16 as
    torchtitan does; routed experts only, no dispatch, combine or shared expert): a callable running its forward, or
    with `backward` its forward and the gradients of its rows and both weights for a random upstream gradient (as its
    training does: every operand quantized on each call), run once here. None, printed, where torchao does not
    import or its first run fails (out of memory at the larger shapes)."""
    try:
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm as tao_gmm
    except Exception as e:  # noqa: BLE001  (a peer that does not import is reported, not fatal)
        print(f"torchao FP8 grouped GEMM unavailable: {str(e).splitlines()[0][:160]}")
        return None
    counts = torch.bincount(topk_idx.flatten().long(), minlength=experts)
    offs = torch.cumsum((counts + 15) // 16 * 16, 0).to(torch.int32)
    rows = torch.randn(int(offs[-1]), hidden, device="cuda", generator=gen).bfloat16()
    w13_t = torch.cat([w[0], w[1]], dim=1).transpose(-2, -1)  # [E, H, 2I], column-major per expert
    w2_t = w[2].transpose(-2, -1)  # [E, I, H], column-major per expert

    def mlp(a, w13, w2):
        gate, up = tao_gmm(a, w13, offs, pad_token_groups_for_grouped_mm=False).chunk(2, dim=-1)
        return tao_gmm((torch.nn.functional.silu(gate) * up).contiguous(), w2, offs,
                       pad_token_groups_for_grouped_mm=False)

    if not backward:
        def step():
            with torch.no_grad():
                return mlp(rows, w13_t, w2_t)
    else:
        leaves = [rows.requires_grad_(), w13_t.detach().requires_grad_(), w2_t.detach().requires_grad_()]
        d_rows = torch.randn(int(offs[-1]), hidden, device="cuda", generator=gen).bfloat16()

        def step():
            return torch.autograd.grad(mlp(*leaves), leaves, d_rows)
    try:
        step()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        print(f"  {name}: torchao peer failed: {str(e).splitlines()[0][:160]}", flush=True)
        return None
    return step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lib", default="build/bench/libmok_bench_capi.so")
    parser.add_argument("--shapes", default="Kimi-K2.7,GLM-5.2,DeepSeek-V4-Pro,Qwen3.5-397B")
    parser.add_argument("--experts-per", type=positive_int, default=8, help="run E_global / this many experts")
    parser.add_argument("--tokens", type=positive_int, default=8192)
    parser.add_argument("--iters", type=positive_int, default=20)
    parser.add_argument("--breakdown", action="store_true",
                        help="also the GPU time per kernel of the FP8 and the bf16 forwards, unfused and fused, with "
                             "each call timed alone, back to back and its kernels' sum; with --backward, of the FP8 "
                             "fused and bf16 fused forward + backward (torch.profiler)")
    parser.add_argument("--backward", action="store_true",
                        help="time forward + backward (the layers built with the backward) instead of the forward")
    parser.add_argument("--backward-paths", default=",".join(p for p in BACKWARD_PATHS if p not in OPT_IN_PATHS),
                        help="with --backward, the layers built (fp8f and fused always; fewer fit larger shapes; "
                             "only when named: fp8b, fp8f with bf16 weight gradients; fp8m, fp8f with the backward "
                             "megakernel)")
    args = parser.parse_args()
    lib = capi.load(os.path.abspath(args.lib))
    if args.backward:
        return run_backward(lib, args)
    stream = torch.cuda.current_stream().cuda_stream
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"FP8 layer forward, {torch.cuda.get_device_name()}, EP=1, {args.tokens} tokens, E = E_global / "
          f"{args.experts_per}, median of {args.iters}")
    print(f"{'shape':16s} {'E':>4s} {'fp8_ms':>8s} {'fp8f_ms':>8s} {'bf16_ms':>8s} {'fused_ms':>8s} {'tao_ms':>8s} "
          f"{'fp8/bf16':>8s} {'fp8f/fused':>10s} {'fp8f/tao':>8s} {'fp8f_TF':>7s} {'err':>8s} {'f==u':>5s} "
          f"{'w_MiB':>8s} {'w8_MiB':>8s}   (fp8: the FP8 unfused path, fp8f the FP8 fused path; bf16 unfused, fused; "
          "ratios: speed-ups; err: normwise |fp8 - bf16| / |bf16|; f==u: the FP8 fused output bitwise the unfused one; "
          "w_MiB, w8_MiB: the rank's weights in bf16, and in e4m3 with their block scales)")
    def run_shape(name, experts, label, hidden, inter, top_k, shared):
        t = args.tokens
        common = dict(ep_size=1, num_tokens=t, top_k=top_k, num_experts=experts, hidden=hidden, intermediate=inter,
                      shared_expert=bool(shared), backward=False)
        layers = {"fp8": create(lib, path="unfused", precision="fp8", **common),
                  "fp8f": create(lib, path="fused", precision="fp8", **common),
                  "bf16": create(lib, path="unfused", **common),
                  "fused": create(lib, path="fused", **common)}
        try:
            x, topk_idx, rw, w = random_problem(gen, t, experts, hidden, inter, top_k, shared)
            fp8, pointers = fp8_weight_pointers(w, transposed=False)
            weight_mib = sum(v.numel() * v.element_size() for v in w if v is not None) / 2**20
            fp8_weight_mib = sum(v.numel() * v.element_size() for v in fp8 if v is not None) / 2**20
            outs = {p: torch.empty(t, hidden, device="cuda", dtype=torch.bfloat16) for p in layers}
            wp = [0 if v is None else v.data_ptr() for v in w]

            def forward(path):
                if path.startswith("fp8"):
                    return lambda: check(lib.mok_bench_layer_forward_fp8(
                        layers[path], x.data_ptr(), topk_idx.data_ptr(), 0, rw.data_ptr(), pointers,
                        outs[path].data_ptr(), stream, ERROR, len(ERROR)))
                return lambda: check(lib.mok_bench_layer_forward(
                    layers[path], x.data_ptr(), topk_idx.data_ptr(), 0, rw.data_ptr(), *wp, outs[path].data_ptr(),
                    stream, ERROR, len(ERROR)))

            fns = [forward(p) for p in layers]
            tao_forward = torchao_expert_mlp(name, gen, topk_idx, experts, hidden, w)
            if tao_forward is not None:
                fns.append(tao_forward)
            for fn in fns:
                fn()
            for layer in layers.values():
                check(lib.mok_bench_layer_check_status(layer, stream, ERROR, len(ERROR)))
            err = ((outs["fp8"].float() - outs["bf16"].float()).norm() / outs["bf16"].float().norm()).item()
            ms = dict(zip(list(layers) + ["tao"], time_ms(fns, args.iters)))
            clocks = dict(zip(list(layers) + ["tao"], gemm_bench.LAST_CLOCKS))
            flops = 6.0 * t * (top_k + int(bool(shared))) * hidden * inter
            tao = f"{ms['tao']:8.3f}" if "tao" in ms else f"{'-':>8s}"
            tao_ratio = f"{ms['tao'] / ms['fp8f']:8.2f}" if "tao" in ms else f"{'-':>8s}"
            same = "yes" if torch.equal(outs["fp8f"], outs["fp8"]) else "NO"
            print(f"{label:16s} {experts:4d} {ms['fp8']:8.3f} {ms['fp8f']:8.3f} {ms['bf16']:8.3f} {ms['fused']:8.3f} "
                  f"{tao} {ms['bf16'] / ms['fp8']:8.2f} {ms['fused'] / ms['fp8f']:10.2f} {tao_ratio} "
                  f"{flops / ms['fp8f'] / 1e9:7.0f} {err:8.4f} {same:>5s} {weight_mib:8.1f} {fp8_weight_mib:8.1f}",
                  flush=True)
            line = clock_line(list(clocks), list(clocks.values()))
            if line:
                print(f"  {label}: {line}", flush=True)
            if args.breakdown:
                for path in ("fp8", "fp8f", "bf16", "fused"):
                    kernels = kernel_breakdown(forward(path))
                    for kernel, kernel_ms in kernels:
                        print(f"  {name} {path:5s} {kernel:40s} {kernel_ms:8.3f} ms per call", flush=True)
                    print(f"  {name} {path:5s} timed alone {ms[path]:.3f} ms, back to back "
                          f"{back_to_back_ms(forward(path), args.iters):.3f} ms a call, its kernels "
                          f"{sum(k for _, k in kernels):.3f} ms", flush=True)
            for layer in layers.values():
                check(lib.mok_bench_layer_check_status(layer, stream, ERROR, len(ERROR)))
        finally:  # (an out-of-memory error included: the retry needs the memory back)
            for layer in layers.values():
                lib.mok_bench_layer_destroy(layer)

    for_each_shape(args, run_shape)


def back_to_back_ms(fn, iters):
    """Milliseconds a call of fn, iters calls enqueued back to back between two events (the host's enqueue overlaps
    the GPU's work): against the call timed alone, what the host adds before and between a call's kernels."""
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / iters


def fp8_weight_pointers(w, transposed=True):
    """The FP8 weight tensors and their pointers from the six bf16 weights w (None: no shared expert): the 12 of
    mok_bench_layer_forward_fp8 (e4m3 values, then scales, per weight in MoeWeights' order; the 2-D shared weights
    quantized as one expert), and with `transposed` the 20 of mok_bench_layer_backward_fp8 (then the transposed copies
    of [gate; up] and down, routed then shared). A 128 x 128 block's scale serves its transpose, so the transposed
    copies are the forward's values transposed (quantize_weights_fp8's out_transposed)."""
    fp8 = []
    for tensor in w:
        if tensor is None:
            fp8 += [None, None]
            continue
        q, s = quantize_blocks_128x128(tensor if tensor.dim() == 3 else tensor[None])
        fp8 += [q, s]  # [E or 1, rows, cols] and its scales, squeezed below
    copies = []
    for gate, up, down in ((0, 1, 2), (3, 4, 5)) if transposed else ():
        if fp8[2 * gate] is None:
            copies += [None] * 4
            continue
        gate_up = torch.cat([fp8[2 * gate].view(torch.uint8), fp8[2 * up].view(torch.uint8)], dim=1)
        gate_up_scales = torch.cat([fp8[2 * gate + 1], fp8[2 * up + 1]], dim=1)
        copies += [gate_up.transpose(1, 2).contiguous().view(torch.float8_e4m3fn),
                       gate_up_scales.transpose(1, 2).contiguous(),
                       fp8[2 * down].view(torch.uint8).transpose(1, 2).contiguous().view(torch.float8_e4m3fn),
                       fp8[2 * down + 1].transpose(1, 2).contiguous()]
    tensors = fp8 + copies
    shared = {6, 7, 8, 9, 10, 11, 16, 17, 18, 19}  # the shared expert's: 2-D
    tensors = [t if t is None or n not in shared else t[0].contiguous() for n, t in enumerate(tensors)]
    return tensors, (ctypes.c_void_p * len(tensors))(*[0 if t is None else t.data_ptr() for t in tensors])


# --backward's layers.
# name: (forward path, precision, keep_gate_up, bf16_weight_gradients, backward_megakernel, fp8_weight_gradient_columns)
BACKWARD_PATHS = {"fp8": ("unfused", "fp8", True, False, False, False),
                  "fp8f": ("fused", "fp8", True, False, False, False),
                  "fp8r": ("fused", "fp8", False, False, False, False),
                  "fp8b": ("fused", "fp8", True, True, False, False),
                  "fp8m": ("fused", "fp8", True, False, True, False),
                  "fp8c": ("fused", "fp8", True, False, False, True),
                  "bf16": ("unfused", "bf16", True, False, False, False),
                  "fused": ("fused", "bf16", True, False, False, False)}
OPT_IN_PATHS = ("fp8b", "fp8m", "fp8c")  # built only when --backward-paths names them


def run_backward(lib, args):
    """--backward: forward + backward of the FP8 layer (unfused, fused forward) against ours in BF16, one line a shape."""
    stream = torch.cuda.current_stream().cuda_stream
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"FP8 layer forward + backward, {torch.cuda.get_device_name()}, EP=1, {args.tokens} tokens, E = E_global / "
          f"{args.experts_per}, median of {args.iters}, weight gradient tensors bf16, written")
    print(f"{'shape':16s} {'E':>4s} {'fp8_ms':>8s} {'fp8f_ms':>8s} {'fp8r_ms':>8s} {'bf16_ms':>8s} {'fused_ms':>8s} "
          f"{'fp8/bf16':>8s} {'fp8f/fused':>10s} {'fp8r/fused':>10s} {'fp8f_TF':>7s} {'dx_err':>8s} {'dw_err':>8s} "
          f"{'r==f':>5s} {'tao_ms':>8s} {'fp8f/tao':>8s} {'ctx8_MiB':>8s} {'ctx8r_MiB':>9s} {'ctx_MiB':>8s}"
          + (f" {'fp8b_ms':>8s} {'fp8b/fused':>10s} {'fp8b/tao':>8s} {'dw_err_b':>9s} {'dx b=f':>6s}"
             if "fp8b" in args.backward_paths.split(",") else "")
          + (f" {'fp8m_ms':>8s} {'fp8m/fused':>10s} {'m==f':>6s}" if "fp8m" in args.backward_paths.split(",") else "")
          + (f" {'fp8c_ms':>8s} {'fp8c/fused':>10s} {'fp8c/tao':>8s} {'dw_err_c':>9s} {'dx c=f':>6s}"
             if "fp8c" in args.backward_paths.split(",") else "")
          + "   "
          "(forward + backward ms: fp8 the FP8 unfused forward, fp8f the FP8 fused one, each then the FP8 stage "
          "backward; fp8r the fused one with keep_gate_up=False (the backward recomputes g | u and h); bf16 unfused, "
          "fused, each then bf16's stage backward; ratios: speed-ups; dx_err, dw_err: normwise |fp8 - bf16| / |bf16| "
          "of d_x and of the routed down weight gradient; r==f: fp8r's gradients bitwise fp8f's; tao: torchao 0.18's "
          "FP8 rowwise expert MLP forward + backward of the same rows (routed experts only); ctx: forward context "
          "bytes, FP8 fused (g | u and h kept), FP8 recompute, bf16 fused; the FP8 layers' weight gradients FP8; "
          "fp8b: fp8f with bf16 weight gradients (bf16_weight_gradients), dw_err_b its routed down weight gradient's "
          "error, dx b=f: its d_x and d_rw bitwise fp8f's; fp8m: fp8f with the backward megakernel "
          "(backward_megakernel), m==f: its d_x, d_rw and weight gradients bitwise fp8f's; fp8c: fp8f with x and h "
          "per column in the FP8 weight gradients, DeepSeek-V3's recipe (fp8_weight_gradient_columns; fp8f's: per "
          "128 x 128 block), dw_err_c its routed down weight gradient's error, dx c=f: its d_x and d_rw bitwise "
          "fp8f's)")

    wanted = set(args.backward_paths.split(",")) | {"fp8f", "fused"}
    unknown = wanted - set(BACKWARD_PATHS)
    if unknown:
        raise SystemExit(f"--backward-paths: unknown {sorted(unknown)}; choose among {list(BACKWARD_PATHS)}")

    def run_shape(name, experts, label, hidden, inter, top_k, shared):
        t = args.tokens
        common = dict(ep_size=1, num_tokens=t, top_k=top_k, num_experts=experts, hidden=hidden, intermediate=inter,
                      shared_expert=bool(shared))
        layers = {p: create(lib, path=path, precision=precision, keep_gate_up=keep,
                            **(dict(bf16_weight_gradients=True) if bf16w else {}),
                            **(dict(backward_megakernel=True) if megakernel else {}),
                            **(dict(fp8_weight_gradient_columns=True) if columns else {}), **common)
                  for p, (path, precision, keep, bf16w, megakernel, columns) in BACKWARD_PATHS.items() if p in wanted}
        try:
            x, topk_idx, rw, w = random_problem(gen, t, experts, hidden, inter, top_k, shared)
            d_out = torch.randn(t, hidden, device="cuda", generator=gen).bfloat16()
            fp8_tensors, fp8_pointers = fp8_weight_pointers(w)
            forward_pointers = (ctypes.c_void_p * 12)(*fp8_pointers[:12])
            wp = [0 if v is None else v.data_ptr() for v in w]
            outs = {p: torch.empty(t, hidden, device="cuda", dtype=torch.bfloat16) for p in layers}
            d_x = {p: torch.empty(t, hidden, device="cuda", dtype=torch.bfloat16) for p in layers}
            d_rw = {p: torch.empty(t, top_k, device="cuda", dtype=torch.float32) for p in layers}
            # The compared layers' own weight gradients; the unfused ones write into the fused ones' (memory for the
            # EP = 1 shapes).
            grads = {p: {n: torch.empty_like(v) for n, v in zip(capi.GRADS, w) if v is not None}
                     for p in ("fp8f", "fp8r", "fp8b", "fp8m", "fp8c", "fused") if p in layers}
            grads["fp8"], grads["bf16"] = grads["fp8f"], grads["fused"]
            arrays = {p: capi.grad_arrays(grads[p], {n: "bf16" for n in grads[p]}, {n: "write" for n in grads[p]})
                      for p in layers}

            def step(p):
                def run():
                    if p.startswith("fp8"):
                        check(lib.mok_bench_layer_forward_fp8(layers[p], x.data_ptr(), topk_idx.data_ptr(), 0,
                                                              rw.data_ptr(), forward_pointers, outs[p].data_ptr(),
                                                              stream, ERROR, len(ERROR)))
                        check(lib.mok_bench_layer_backward_fp8(layers[p], x.data_ptr(), topk_idx.data_ptr(), 0,
                                                               rw.data_ptr(), fp8_pointers, d_out.data_ptr(),
                                                               d_x[p].data_ptr(), d_rw[p].data_ptr(), *arrays[p],
                                                               stream, ERROR, len(ERROR)))
                    else:
                        check(lib.mok_bench_layer_forward(layers[p], x.data_ptr(), topk_idx.data_ptr(), 0,
                                                          rw.data_ptr(), *wp, outs[p].data_ptr(), stream, ERROR,
                                                          len(ERROR)))
                        check(lib.mok_bench_layer_backward(layers[p], x.data_ptr(), topk_idx.data_ptr(), 0,
                                                           rw.data_ptr(), *wp, d_out.data_ptr(), d_x[p].data_ptr(),
                                                           d_rw[p].data_ptr(), *arrays[p], stream, ERROR, len(ERROR)))
                return run

            fns = [step(p) for p in layers]
            for fn in fns:
                fn()
            for layer in layers.values():
                check(lib.mok_bench_layer_check_status(layer, stream, ERROR, len(ERROR)))
            tao_step = torchao_expert_mlp(name, gen, topk_idx, experts, hidden, w, backward=True)
            if tao_step is not None:
                fns.append(tao_step)
            norm_err = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
            dx_err = norm_err(d_x["fp8f"], d_x["fused"])
            dw_err = norm_err(grads["fp8f"]["expert_down"], grads["fused"]["expert_down"])
            same = "fp8r" in layers and all(
                torch.equal(a, b) for a, b in [(d_x["fp8r"], d_x["fp8f"]), (d_rw["fp8r"], d_rw["fp8f"])] +
                [(grads["fp8r"][n], grads["fp8f"][n]) for n in grads["fp8f"]])
            ms = dict(zip(list(layers) + ["tao"], time_ms(fns, args.iters)))
            for layer in layers.values():
                check(lib.mok_bench_layer_check_status(layer, stream, ERROR, len(ERROR)))
            ctx = {p: lib.mok_bench_layer_context_bytes(layers[p], ERROR, len(ERROR)) / 2**20 for p in layers}
            flops = 18.0 * t * (top_k + int(bool(shared))) * hidden * inter  # forward 6, backward 12 per row

            def recipe_cells(p):  # --backward-paths with fp8b or fp8c: another weight-gradient recipe than fp8f's
                if p not in layers:
                    return ""
                recipe_err = norm_err(grads[p]["expert_down"], grads["fused"]["expert_down"])
                same_dgrads = torch.equal(d_x[p], d_x["fp8f"]) and torch.equal(d_rw[p], d_rw["fp8f"])
                return (f" {ms[p]:8.3f} {ratio('fused', p):10.2f} {cell(8, ratio('tao', p), '.2f')} "
                        f"{recipe_err:9.4f} {'yes' if same_dgrads else 'NO':>6s}")

            def fp8m_cells():  # --backward-paths with fp8m: the backward megakernel against fp8f's stage kernels
                if "fp8m" not in layers:
                    return ""
                pairs = [(d_x["fp8m"], d_x["fp8f"]), (d_rw["fp8m"], d_rw["fp8f"])]
                pairs += [(grads["fp8m"][n], grads["fp8f"][n]) for n in grads["fp8f"]]
                same_bits = all(torch.equal(a, b) for a, b in pairs)
                return f" {ms['fp8m']:8.3f} {ratio('fused', 'fp8m'):10.2f} {'yes' if same_bits else 'NO':>6s}"

            def cell(width, value, spec):  # "-" for a layer not built
                return f"{value:{width}{spec}}" if value is not None else f"{'-':>{width}s}"
            ratio = lambda a, b: ms[a] / ms[b] if a in ms and b in ms else None
            print(f"{label:16s} {experts:4d} {cell(8, ms.get('fp8'), '.3f')} {ms['fp8f']:8.3f} "
                  f"{cell(8, ms.get('fp8r'), '.3f')} {cell(8, ms.get('bf16'), '.3f')} {ms['fused']:8.3f} "
                  f"{cell(8, ratio('bf16', 'fp8'), '.2f')} {ratio('fused', 'fp8f'):10.2f} "
                  f"{cell(10, ratio('fused', 'fp8r'), '.2f')} {flops / ms['fp8f'] / 1e9:7.0f} {dx_err:8.4f} "
                  f"{dw_err:8.4f} {('yes' if same else 'NO') if 'fp8r' in layers else '-':>5s} "
                  f"{cell(8, ms.get('tao'), '.3f')} {cell(8, ratio('tao', 'fp8f'), '.2f')} {ctx['fp8f']:8.1f} "
                  f"{cell(9, ctx.get('fp8r'), '.1f')} {ctx['fused']:8.1f}{recipe_cells('fp8b')}"
                  f"{fp8m_cells()}{recipe_cells('fp8c')}", flush=True)
            if args.breakdown:  # where the step's time goes, FP8 against bf16
                for p in [p for p in ("fp8f", "fp8b", "fp8m", "fp8c", "fused") if p in layers]:
                    for kernel, kernel_ms in kernel_breakdown(step(p)):
                        print(f"  {name} {p:5s} {kernel:40s} {kernel_ms:8.3f} ms per call", flush=True)
            del fp8_tensors
        finally:
            for layer in layers.values():
                lib.mok_bench_layer_destroy(layer)

    for_each_shape(args, run_shape)


def for_each_shape(args, run_shape):
    """run_shape(name, experts, label, H, I, k, shared) for each of --shapes with E_global / --experts-per experts; a
    shape that does not fit runs again with half its experts, as "NAME E/2" (as bench/layer_bench.py does)."""
    for name, num_experts, hidden, inter, top_k, shared in SHAPES:
        if name not in args.shapes.split(","):
            continue
        experts = num_experts // args.experts_per
        out_of_memory = False
        try:
            run_shape(name, experts, name, hidden, inter, top_k, shared)
        except torch.OutOfMemoryError:
            out_of_memory = True  # retried below, once the exception no longer holds the failed run's tensors
        torch.cuda.empty_cache()
        if out_of_memory:
            print(f"  {name}: out of memory with {experts} experts; again with {experts // 2} (same tokens and top-k: "
                  "twice the rows per expert)", flush=True)
            try:
                run_shape(name, experts // 2, f"{name} E/2", hidden, inter, top_k, shared)
            except torch.OutOfMemoryError:
                print(f"  {name}: out of memory with {experts // 2} experts too; skipped", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
