#!/usr/bin/env python3
"""CPU emulation of the backward's roundings, to size the error budgets of tests/gpu/test_moe_backward.cpp.

The GPU backward (docs/design.md, "Backward") stores g, u, h, d_g, d_u, dy = rw * d_out and each route's d_x
partial in bf16 and sums in fp32; the CPU reference (reference::backward) sums in double and stores fp32.
This script runs both on one random problem with PyTorch on the CPU (fp32 matmuls with bf16 roundings where
the GPU stores, against float64) and prints the worst |gpu - ref| / budget of each gradient under the
test's budgets (a ratio below 1 passes):
  d_x, d_rw   2^-6 (|ref| + rms)             (+ 2^-7 * sum of |partials| for d_x)
  weights     2^-5 (|ref| + rms_row * rms_col / rms), per expert
and, for comparison, the weights under 2^-6 (|ref| + rms).

  python3 tools/backward_rounding_sim.py [--tokens N] [--hidden H] [--intermediate I] [--experts E] [--top-k k]
"""
import argparse
import math

import torch


def silu(g):
    return g * torch.sigmoid(g)


def silu_grad(g):
    s = torch.sigmoid(g)
    return s * (1 + g * (1 - s))


def bf16(t):
    return t.to(torch.bfloat16).to(t.dtype)


def emulated(w, xs, d_out, rw):
    """The GPU's roundings for one expert's rows: fp32 sums, bf16 stores."""
    gate, up, down = w
    g, u = xs @ gate.T, xs @ up.T
    gb, ub = bf16(g), bf16(u)
    h = bf16(silu(g) * u)                              # the forward's h, from the fp32 g, u
    d_hu = d_out @ down
    d_h = rw[:, None] * d_hu
    d_g, d_u = bf16(d_h * ub * silu_grad(gb)), bf16(d_h * silu(gb))   # from the stored g, u
    dy = bf16(rw[:, None] * d_out)
    return {"d_x": bf16(d_g @ gate + d_u @ up), "d_rw": (d_hu * silu(gb) * ub).sum(1),
            "down": dy.T @ h, "gate": d_g.T @ xs, "up": d_u.T @ xs}


def exact(w, xs, d_out, rw):
    gate, up, down = (t.double() for t in w)
    xs, d_out, rw = xs.double(), d_out.double(), rw.double()
    g, u = xs @ gate.T, xs @ up.T
    h = silu(g) * u
    dy = rw[:, None] * d_out
    d_h = dy @ down
    d_g, d_u = d_h * u * silu_grad(g), d_h * silu(g)
    return {"d_x": d_g @ gate + d_u @ up, "d_rw": (d_out * (h @ down.T)).sum(1),
            "down": dy.T @ h, "gate": d_g.T @ xs, "up": d_u.T @ xs}


def ratio(got, want, budget):
    return ((got.double() - want).abs() / budget).max().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1280)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--experts", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    a = parser.parse_args()
    torch.manual_seed(a.seed)
    n, hdim, idim, e, k = a.tokens, a.hidden, a.intermediate, a.experts, a.top_k
    x = bf16(torch.randn(n, hdim))
    d_out = bf16(torch.randn(n, hdim))
    weights = [(bf16(torch.randn(idim, hdim) / math.sqrt(hdim)), bf16(torch.randn(idim, hdim) / math.sqrt(hdim)),
                bf16(torch.randn(hdim, idim) / math.sqrt(idim))) for _ in range(e + 1)]  # [e]: the shared expert
    topk = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    rw = torch.softmax(torch.randn(n, k), 1)

    worst = {}

    def note(name, value):
        worst[name] = max(worst.get(name, 0.0), value)

    def weight_checks(prefix, got, want):
        for name in ("gate", "up", "down"):
            g, w = got[name], want[name]
            rms = w.pow(2).mean().sqrt()
            row = w.pow(2).mean(1, keepdim=True).sqrt()
            col = w.pow(2).mean(0, keepdim=True).sqrt()
            note(f"{prefix} {name} (test budget)", ratio(g, w, 2**-5 * (w.abs() + row * col / rms)))
            note(f"{prefix} {name} (2^-6, one rms)", ratio(g, w, 2**-6 * (w.abs() + rms)))

    d_x, d_x_ref = torch.zeros(n, hdim), torch.zeros(n, hdim, dtype=torch.float64)
    partials = torch.zeros(n, hdim, dtype=torch.float64)
    d_rw, d_rw_ref = torch.zeros(n, k), torch.zeros(n, k, dtype=torch.float64)
    got, want = emulated(weights[e], x, d_out, torch.ones(n)), exact(weights[e], x, d_out, torch.ones(n))
    d_x += got["d_x"]
    d_x_ref += want["d_x"]
    partials += want["d_x"].abs()
    weight_checks("shared", got, want)
    for expert in range(e):
        rows = (topk == expert).nonzero()
        if len(rows) == 0:
            continue
        t, j = rows[:, 0], rows[:, 1]
        got = emulated(weights[expert], x[t], d_out[t], rw[t, j])
        want = exact(weights[expert], x[t], d_out[t], rw[t, j])
        d_x.index_add_(0, t, got["d_x"])  # fp32; the GPU adds in slot order, the same to these digits
        d_x_ref.index_add_(0, t, want["d_x"])
        partials.index_add_(0, t, want["d_x"].abs())
        d_rw[t, j], d_rw_ref[t, j] = got["d_rw"], want["d_rw"]
        weight_checks("expert", got, want)
    rms = d_x_ref.pow(2).mean().sqrt()
    note("d_x (test budget)", ratio(bf16(d_x), d_x_ref, 2**-6 * (d_x_ref.abs() + rms) + 2**-7 * partials))
    note("d_rw (test budget)", ratio(d_rw, d_rw_ref, 2**-6 * (d_rw_ref.abs() + d_rw_ref.pow(2).mean().sqrt())))
    print(f"N={n} H={hdim} I={idim} E={e} k={k} seed {a.seed}: worst |gpu - ref| / budget")
    for name, value in worst.items():
        print(f"  {name:30s} {value:.3f}")


if __name__ == "__main__":
    main()
