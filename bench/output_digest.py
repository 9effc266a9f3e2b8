#!/usr/bin/env python3
"""SHA-256 digests of the layer's outputs, to compare two builds bit for bit (issue 26, item 3: a refactor of the
GEMM engine must give today's bits). One GPU, EP = 1, the bench shapes (bench/gemm_bench.py SHAPES) with a fraction
of their experts, layer_bench's inputs (same seed, same generators). Per shape, for the unfused path, the fused
forward with the stage-kernel backward and the fused forward with the backward megakernel: the forward's output,
then per gradient mode (bf16 written, fp32 written, fp32 accumulated onto a fixed non-zero start) d_x, d_rw and the
six weight gradients. One line per tensor: shape, path, mode, tensor, digest.

Usage (the same script for both builds; the C API did not change):
  python3 bench/output_digest.py --lib /path/to/main/build/bench/libmok_bench_capi.so > before.txt
  python3 bench/output_digest.py --lib build/bench/libmok_bench_capi.so > after.txt
  diff before.txt after.txt     # empty: bitwise the same
"""
import argparse
import hashlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from capi import GRADS, grad_arrays, load  # noqa: E402
from gemm_bench import SHAPES  # noqa: E402
from layer_bench import ERROR, check, create_layer, make_grad_output, make_inputs  # noqa: E402

MODES = (("bf16", "write"), ("fp32", "write"), ("fp32", "accumulate"))


def digest(tensor):
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lib", default="build/bench/libmok_bench_capi.so")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--experts-fraction", type=float, default=0.25, help="of each shape's experts")
    parser.add_argument("--shapes", default="", help="comma-separated names (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    lib = load(args.lib)
    stream = torch.cuda.current_stream().cuda_stream
    wanted = set(filter(None, args.shapes.split(",")))
    for name, num_experts, hidden, inter, top_k, shared in SHAPES:
        if wanted and name not in wanted:
            continue
        experts = max(top_k, round(num_experts * args.experts_fraction))
        inputs = make_inputs(experts, hidden, inter, top_k, shared, args.tokens, 1, 0, 0.0, args.seed)
        pointers = [0 if t is None else t.data_ptr() for t in inputs.values()]
        pointers.insert(2, 0)  # topk_dtype after topk_idx: int32 ids
        d_out = make_grad_output(args.tokens, hidden, 0, args.seed)
        weights = {n: inputs[n] for n in GRADS if inputs[n] is not None}
        for path, megakernel in (("unfused", False), ("fused", False), ("fused", True)):
            label = f"{name} E={experts} T={args.tokens} {path}" + (" bwd-megakernel" if megakernel else "")
            options = dict(ep_size=1, num_tokens=args.tokens, top_k=top_k, num_experts=experts, hidden=hidden,
                           intermediate=inter, shared_expert=bool(shared), path=path)
            if path == "fused":
                options["backward_megakernel"] = megakernel
            layer = create_layer(lib, 0, **options)
            try:
                out = torch.full((args.tokens, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)
                check(lib.mok_bench_layer_forward(layer, *pointers, out.data_ptr(), stream, ERROR, len(ERROR)))
                check(lib.mok_bench_layer_check_status(layer, stream, ERROR, len(ERROR)))
                print(f"{label} forward out {digest(out)}", flush=True)
                for dtype, mode in MODES:
                    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
                    gen = torch.Generator(device="cuda").manual_seed(12345)
                    grads = {n: (torch.randn(w.shape, generator=gen, device="cuda", dtype=torch_dtype)
                                 if mode == "accumulate" else torch.full(w.shape, float("nan"), device="cuda",
                                                                         dtype=torch_dtype))
                             for n, w in weights.items()}
                    d_x = torch.full((args.tokens, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)
                    d_rw = torch.full((args.tokens, top_k), float("nan"), device="cuda", dtype=torch.float32)
                    arrays = grad_arrays(grads, {n: dtype for n in grads}, {n: mode for n in grads})
                    check(lib.mok_bench_layer_backward(layer, *pointers, d_out.data_ptr(), d_x.data_ptr(),
                                                       d_rw.data_ptr(), *arrays, stream, ERROR, len(ERROR)))
                    check(lib.mok_bench_layer_check_status(layer, stream, ERROR, len(ERROR)))
                    tensors = dict(d_x=d_x, d_rw=d_rw, **{f"d_{n}": g for n, g in grads.items()})
                    for tensor_name, tensor in tensors.items():
                        print(f"{label} {dtype}-{mode} {tensor_name} {digest(tensor)}", flush=True)
            finally:
                torch.cuda.synchronize()
                lib.mok_bench_layer_destroy(layer)


if __name__ == "__main__":
    main()
