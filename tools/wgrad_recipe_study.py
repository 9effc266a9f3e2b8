#!/usr/bin/env python3
"""What the FP8 weight gradient's scaling recipe costs in accuracy, on the training example's own gradients.

Trains examples/train_moe.py's plain-PyTorch twin (its expert MLPs in torch ops, so every expert's rows x, h, dy and
d(g|u) are visible) for --steps and, at the steps in --record, takes every expert MLP call's operands (the routed
experts' and the shared expert's). For each it computes the weight gradients dW_down = dyᵀ h and dW_gate|up =
d(g|u)ᵀ x in float64 from the bf16 operands (the reference: a bf16 weight gradient with fp32 accumulation is that to
within its one rounding) and from operands quantized to e4m3 under each recipe, and prints the normwise error
|dW_q - dW| / |dW|, median and largest over the calls. Recipes (K = the call's rows, padded to 128 with zeros;
scale = amax / 448 of the group, 1 for an all-zero group):
  col128     both operands one scale per column per 128 rows (DeepSeek-V3's weight-gradient scaling; the library's)
  grad_blk   the gradient operand (dy, d(g|u)) one scale per 128 rows x 128 columns, the activation as col128
  act_blk    the activation operand (h, x) one scale per 128 rows x 128 columns, the gradient as col128
  grad_seg   the gradient operand one scale per column over all K rows, the activation as col128
A recipe with one operand's scale constant over a k-block across 128 columns promotes each k-block with one FMA a
value instead of two (docs/perf_notes.md, round 46); this measures what that costs in accuracy.
Runs wherever torch does (a GPU if there is one); the library is not needed.
"""
import argparse
import os
import statistics
import sys
import types

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.modules.setdefault("mok", types.ModuleType("mok"))  # the twin does not use the library
import train_moe  # noqa: E402

E4M3_MAX = 448.0


def quantize(x, rows_per_scale, cols_per_scale):
    """x [K, C] float32 -> e4m3 values times their scales (float32), one scale per rows_per_scale x cols_per_scale
    block (None: all of that dimension); K padded to rows_per_scale with zeros (dropped again)."""
    k, c = x.shape
    rb = k if rows_per_scale is None else rows_per_scale
    cb = c if cols_per_scale is None else cols_per_scale
    kp, cp = -(-k // rb) * rb, -(-c // cb) * cb
    xp = torch.zeros(kp, cp, dtype=torch.float32, device=x.device)
    xp[:k, :c] = x
    blocks = xp.view(kp // rb, rb, cp // cb, cb)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (blocks / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale
    return q.view(kp, cp)[:k, :c]


# (rows, columns) a scale covers, per recipe: (the gradient operand's, the activation operand's); None: all rows.
SCALE_GROUPS = {
    "col128": ((128, 1), (128, 1)),
    "grad_blk": ((128, 128), (128, 1)),
    "act_blk": ((128, 1), (128, 128)),
    "grad_seg": ((None, 1), (128, 1)),
}


RECIPES = tuple(SCALE_GROUPS)


def operand(x, recipe, gradient):
    return quantize(x, *SCALE_GROUPS[recipe][0 if gradient else 1])


def errors(grad, act):
    """{recipe: normwise error} of gradᵀ act ([K, Cg] and [K, Ca] bf16)."""
    ref = grad.double().T @ act.double()
    norm = ref.norm().item()
    out = {}
    for r in RECIPES:
        q = operand(grad.float(), r, True).double().T @ operand(act.float(), r, False).double()
        out[r] = (q - ref).norm().item() / norm if norm > 0 else 0.0
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="training steps of the twin")
    p.add_argument("--record", default="1,20,50,100", help="steps (1-based) whose operands are measured")
    p.add_argument("--batch", type=int, default=64, help="sequences per step (the FP8 loss bar's example: 64)")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    args = train_moe.parse_args(["--batch", str(a.batch), "--seed", str(a.seed), "--steps", str(a.steps)])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        record = {int(s) for s in a.record.split(",")}
    except ValueError:
        p.error(f"--record must be comma-separated step numbers, got {a.record!r}")
    if not record or min(record) < 1 or max(record) > a.steps:
        p.error(f"--record steps must lie in [1, --steps {a.steps}], got {a.record!r}")
    calls = []
    recording = [False]

    def mlp(rows, gate, up, down):  # TorchMoE.mlp, its intermediates kept at the recorded steps
        g, u = rows @ gate.T, rows @ up.T
        hidden = (F.silu(g.float()) * u.float()).to(rows.dtype)
        out = hidden @ down.T
        if recording[0] and out.requires_grad:
            for t in (g, u, out):
                t.retain_grad()
            calls.append((rows.detach(), hidden.detach(), g, u, out))
        return out

    train_moe.TorchMoE.mlp = staticmethod(mlp)
    state = train_moe.initial_state(args, device)
    model = train_moe.Model(args, [train_moe.TorchMoE(args, device) for _ in range(args.layers)], device)
    model.load_state_dict(state)
    data = train_moe.make_data(args.steps, args.batch, args.seq, args.seed, 0, device)
    optimizer = train_moe.MixedPrecisionAdamW(model.parameters(), args.lr)
    results = {("dW_down", r): [] for r in RECIPES} | {("dW_gate/up", r): [] for r in RECIPES}
    rows_seen = []
    for step in range(args.steps):
        recording[0] = (step + 1) in record
        batch = data[step]
        loss = F.cross_entropy(model(batch[:, :-1]).float().view(-1, train_moe.VOCAB), batch[:, 1:].reshape(-1))
        loss.backward()
        for rows, hidden, g, u, out in calls:
            rows_seen.append(rows.shape[0])
            for r, e in errors(out.grad, hidden).items():
                results[("dW_down", r)].append(e)
            for r, e in errors(torch.cat([g.grad, u.grad], 1), rows).items():
                results[("dW_gate/up", r)].append(e)
        calls.clear()
        optimizer.step(train_moe.learning_rate(args, step))
        optimizer.zero_grad()
        if recording[0]:
            print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)
    print(f"{len(rows_seen)} expert MLP calls measured (rows a call: {min(rows_seen)}-{max(rows_seen)}), "
          f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}")
    print(f"{'gradient':12s} {'recipe':9s} {'median':>8s} {'max':>8s} {'median / col128':>16s}")
    for name in ("dW_down", "dW_gate/up"):
        base = statistics.median(results[(name, "col128")])
        for r in RECIPES:
            v = results[(name, r)]
            med = statistics.median(v)
            print(f"{name:12s} {r:9s} {med:8.5f} {max(v):8.5f} {med / base:16.2f}")


if __name__ == "__main__":
    main()
